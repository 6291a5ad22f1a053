//! Every hwloc XML v2 file in `shared/topologies` reads with the counts hwloc 2.9 reports
//! (`expected-counts.tsv`: packages, NUMA nodes, L3 groups, cores, PUs, allowed only).

mod common;

use std::path::PathBuf;
use topo_core::topology::hwloc_xml;

fn shared() -> PathBuf {
    common::topologies()
}

#[test]
fn xml_counts_match_hwloc() {
    let root = shared();
    let tsv = std::fs::read_to_string(root.join("expected-counts.tsv")).unwrap();
    let mut checked = 0;
    let mut wrong = Vec::new();
    for line in tsv.lines().skip(1).filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split('\t').collect();
        assert_eq!(f.len(), 6, "bad line in expected-counts.tsv: {line}");
        if !f[0].ends_with(".xml") {
            continue;
        }
        let expected: Vec<usize> = f[1..].iter().map(|v| v.parse().unwrap()).collect();
        let topo =
            hwloc_xml::read_file(&root.join(f[0])).unwrap_or_else(|e| panic!("{}: {e}", f[0]));
        let c = topo.counts();
        let got = vec![c.packages, c.numa_nodes, c.l3_groups, c.cores, c.pus];
        if got != expected {
            wrong.push(format!("{}: got {got:?}, hwloc says {expected:?}", f[0]));
        }
        checked += 1;
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(checked >= 20, "only {checked} XML files checked");
}

#[test]
fn v3_files_are_refused_clearly() {
    let e =
        hwloc_xml::read_file(&shared().join("hwloc-master-v3-xml/AMD-19h-Zen4-2xEpyc-9654.xml"))
            .unwrap_err()
            .to_string();
    assert!(e.contains("version 3") && e.contains("hwloc 2.x"), "{e}");
}

#[test]
fn devices_and_distances_are_read() {
    let t = hwloc_xml::read_file(&shared().join("xml/96em64t-4n4d3ca2co-pci.xml")).unwrap();
    assert_eq!(t.numa_distance(0, 1), 26);
    assert!(t.devices.iter().any(|d| d.names.iter().any(|n| n == "eth0")), "{:?}", t.devices);
    // This IBM x3950's only display adapter is its board's ATI ES1000: no job's GPU.
    assert!(t.devices.iter().any(|d| d.device_id == Some(0x515e)), "{:?}", t.devices);
    assert_eq!(topo_core::gpus::gpu_indices(&t), Vec::<usize>::new());
    let gpus = hwloc_xml::read_file(
        &shared().join("converted-hwloc2.9/nvidiagpunumanodes.keptgpunuma.xml"),
    )
    .unwrap();
    assert_eq!(
        gpus.numa_nodes
            .iter()
            .filter(|n| n.kind == topo_core::topology::MemoryKind::GpuMemory)
            .count(),
        6
    );
    let hybrid = hwloc_xml::read_file(
        &shared().join("converted-hwloc2.9/20em64t-hybrid-1p6c2t+2ca4co1t.xml"),
    )
    .unwrap();
    assert_eq!(hybrid.cpu_kinds.len(), 2);
}

#[test]
fn nvlink_islands_come_from_hwlocs_bandwidth_matrix() {
    // POWER8 with four P100s: NVLink joins GPUs 0-1 and 2-3, and each pair to its package.
    let t = hwloc_xml::read_file(&shared().join("xml/power8gpudistances.xml")).unwrap();
    let fabric = |address: &str| {
        t.devices
            .iter()
            .find(|d| d.pci_address == address)
            .unwrap_or_else(|| panic!("no device {address}: {:?}", t.devices))
            .fabric
            .clone()
    };
    let first = Some("nvlink:0002:01:00.0".to_string());
    let second = Some("nvlink:000a:01:00.0".to_string());
    assert_eq!(fabric("0002:01:00.0"), first);
    assert_eq!(fabric("0003:01:00.0"), first);
    // The packages' links do not join the pairs into one island.
    assert_eq!(fabric("000a:01:00.0"), second);
    assert_eq!(fabric("000b:01:00.0"), second);
    let named: Vec<String> = t.devices.iter().filter_map(|d| d.fabric_name()).collect();
    assert_eq!(named.len(), 4, "{named:?}");
    assert_eq!(named[0], "NVLink island 0002:01:00.0");
    // A machine without the matrix has no fabric.
    let plain = hwloc_xml::read_file(&shared().join("xml/96em64t-4n4d3ca2co-pci.xml")).unwrap();
    assert!(plain.devices.iter().all(|d| d.fabric.is_none()));
}
