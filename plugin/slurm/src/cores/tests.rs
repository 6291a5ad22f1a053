//! The translation against hwloc's own order on the real machines in `shared/topologies`.
//!
//! The reference is computed the way slurmd computes its map, from hwloc's XML tree (children in
//! logical order): packages in document order, skipping those without cores, then the cores
//! below each package in document order, each as the OS ids of its PUs. Our side gets only the
//! flat graph that topod's readers make (from the same XML, and from the raw sysfs snapshot the
//! XML was exported from), as the plug-in does at run time.

use super::*;
use std::io::Read;
use std::path::{Path, PathBuf};
use topo_core::topology::{hwloc_xml, sysfs, Domain};

fn shared() -> PathBuf {
    let dir = std::env::var_os("TOPO_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared"));
    let t = dir.join("topologies");
    assert!(t.is_dir(), "shared topologies missing at {}; set TOPO_SHARED_DIR", t.display());
    t
}

/// Slurm's abstract core order read straight from hwloc's tree.
fn hwloc_order(xml: &str) -> Vec<CpuSet> {
    let options = roxmltree::ParsingOptions { allow_dtd: true, ..Default::default() };
    let doc = roxmltree::Document::parse_with_options(xml, options).unwrap();
    let is =
        |n: &roxmltree::Node, ty: &str| n.has_tag_name("object") && n.attribute("type") == Some(ty);
    let mut order = Vec::new();
    for package in doc.descendants().filter(|n| is(n, "Package")) {
        for core in package.descendants().filter(|n| is(n, "Core")) {
            let pus: CpuSet = core
                .descendants()
                .filter(|n| is(n, "PU"))
                .map(|pu| pu.attribute("os_index").unwrap().parse::<u32>().unwrap())
                .collect();
            order.push(pus);
        }
    }
    order
}

fn xml_files() -> Vec<PathBuf> {
    let root = shared();
    let mut files: Vec<PathBuf> = ["converted-hwloc2.9", "xml"]
        .iter()
        .flat_map(|d| std::fs::read_dir(root.join(d)).unwrap().flatten().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "xml"))
        .collect();
    files.sort();
    files
}

#[test]
fn order_matches_hwloc_on_every_real_machine() {
    let mut compared = Vec::new();
    for path in xml_files() {
        let text = std::fs::read_to_string(&path).unwrap();
        let reference = hwloc_order(&text);
        if reference.is_empty() {
            continue; // no Package objects: Slurm falls back to a linear map
        }
        let topo =
            hwloc_xml::read_file(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let ours = slurm_core_order(&topo);
        assert_eq!(ours.len(), reference.len(), "{}: core count", path.display());
        for (i, (a, b)) in ours.iter().zip(&reference).enumerate() {
            assert_eq!(a, b, "{}: abstract core {i}", path.display());
        }
        compared.push(path.file_name().unwrap().to_string_lossy().into_owned());
    }
    assert!(compared.len() >= 15, "only {} machines compared: {compared:?}", compared.len());
}

fn extract(tarball: &Path, into: &Path) -> PathBuf {
    let mut bytes = Vec::new();
    bzip2::read::BzDecoder::new(std::fs::File::open(tarball).unwrap())
        .read_to_end(&mut bytes)
        .unwrap();
    tar::Archive::new(&bytes[..]).unpack(into).unwrap();
    std::fs::read_dir(into)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.join("sys").is_dir())
        .unwrap()
}

/// At run time topod reads sysfs, not XML: the order from the raw snapshot must be hwloc's too.
#[test]
fn order_from_sysfs_snapshots_matches_hwloc() {
    let root = shared();
    let mut compared = 0;
    for entry in std::fs::read_dir(root.join("linux")).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(stem) = name.strip_suffix(".tar.bz2") else { continue };
        // slurmd loads hwloc with the whole system, CPUs outside its cgroup included: compare with
        // the export made the same way where the snapshot has such CPUs.
        let whole = root.join(format!("converted-hwloc2.9/{stem}.disallowed.xml"));
        let xml_path = if whole.is_file() {
            whole
        } else {
            root.join(format!("converted-hwloc2.9/{stem}.xml"))
        };
        let xml = std::fs::read_to_string(xml_path).unwrap();
        let reference = hwloc_order(&xml);
        let tmp = tempfile::tempdir().unwrap();
        let topo = sysfs::read(&extract(&entry.path(), tmp.path())).unwrap();
        assert_eq!(slurm_core_order(&topo), reference, "{stem}");
        compared += 1;
    }
    assert!(compared >= 8, "only {compared} snapshots");
}

#[test]
fn translates_zen4_with_siblings_192_apart() {
    let topo =
        hwloc_xml::read_file(&shared().join("converted-hwloc2.9/AMD-19h-Zen4-2xEpyc-9654.xml"))
            .unwrap();
    let order = slurm_core_order(&topo);
    assert_eq!(translate(&order, "0").unwrap().to_string(), "0,192");
    assert_eq!(translate(&order, "0-1,96").unwrap().to_string(), "0-1,96,192-193,288");
    assert!(matches!(
        translate(&order, "192"),
        Err(CoreMapError::BeyondNode { index: 192, cores: 192, .. })
    ));
}

#[test]
fn translates_bulldozer_modules_and_knl_smt4() {
    let bd =
        hwloc_xml::read_file(&shared().join("converted-hwloc2.9/64amd64-4s2n4ca2co.xml")).unwrap();
    let order = slurm_core_order(&bd);
    assert_eq!(order.len(), 64);
    let knl = hwloc_xml::read_file(
        &shared().join("converted-hwloc2.9/Intel-KnightsLanding-XeonPhi-7210.xml"),
    )
    .unwrap();
    let order = slurm_core_order(&knl);
    assert_eq!(order.len(), 64);
    assert_eq!(translate(&order, "1").unwrap().len(), 4, "SMT4: four CPUs per core");
}

#[test]
fn interleaved_numbering_follows_the_package_not_the_cpu_id() {
    // Two packages numbered alternately (cpu 0 on package 0, cpu 1 on package 1, ...), as some
    // BIOSes do: abstract core 1 is the second core of package 0, which is CPU 2, not CPU 1.
    let mut topo = Topology::synthetic(topo_core::topology::SyntheticShape {
        packages: 2,
        numa_per_package: 1,
        l3_per_numa: 1,
        cores_per_l3: 2,
        threads_per_core: 1,
    });
    let set = |ids: &[u32]| ids.iter().copied().collect::<CpuSet>();
    topo.packages = vec![
        Domain { os_index: Some(0), cpus: set(&[0, 2]) },
        Domain { os_index: Some(1), cpus: set(&[1, 3]) },
    ];
    topo.numa_nodes.iter_mut().zip([set(&[0, 2]), set(&[1, 3])]).for_each(|(n, c)| {
        n.cpus = c.clone();
        n.near_cpus = c;
    });
    topo.l3_groups = vec![
        Domain { os_index: Some(0), cpus: set(&[0, 2]) },
        Domain { os_index: Some(1), cpus: set(&[1, 3]) },
    ];
    let order = slurm_core_order(&topo);
    assert_eq!(translate(&order, "0-1").unwrap().to_string(), "0,2");
    assert_eq!(translate(&order, "2").unwrap().to_string(), "1");
}

#[test]
fn bad_lists_say_what_is_wrong() {
    let topo = Topology::synthetic(topo_core::topology::SyntheticShape {
        packages: 1,
        numa_per_package: 1,
        l3_per_numa: 1,
        cores_per_l3: 2,
        threads_per_core: 2,
    });
    let order = slurm_core_order(&topo);
    assert_eq!(translate(&order, "").unwrap(), CpuSet::new());
    let e = translate(&order, "0-x").unwrap_err().to_string();
    assert!(e.contains("\"0-x\""), "{e}");
    let e = translate(&order, "0,5").unwrap_err().to_string();
    assert!(e.contains("index 5") && e.contains("2 cores") && e.contains("slurmd -C"), "{e}");
}
