//! The placement-quality claims, checked on every real machine in `shared/topologies`: with the
//! benchmark's job stream, best-fit keeps jobs at least as local (NUMA and L3) as every other
//! strategy and baseline, strictly more than topology-blind first-fit, and rejects no more jobs
//! while enough PUs are free than either baseline. A short stream here; the full benchmark is
//! `topoctl bench placement`.

use std::path::PathBuf;
use topod::bench::{job_stream, replay};
use topod::place::{HostModel, Strategy};
use topod::topology::hwloc_xml;
use topod::CpuSet;

fn topology_files() -> Vec<PathBuf> {
    let shared = std::env::var_os("TOPO_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"));
    let mut files = Vec::new();
    for sub in ["xml", "converted-hwloc2.9"] {
        let dir = shared.join("topologies").join(sub);
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e} (set TOPO_SHARED_DIR)", dir.display())) {
            let p = entry.unwrap().path();
            if p.extension().is_some_and(|x| x == "xml") {
                files.push(p);
            }
        }
    }
    files.sort();
    assert!(files.len() >= 20, "expected the 20 XML topologies, found {}", files.len());
    files
}

#[test]
fn best_fit_is_the_most_local_and_rejects_least() {
    let mut failures = Vec::new();
    for file in topology_files() {
        let topo = hwloc_xml::read_file(&file).unwrap();
        let model = HostModel::new(&topo, &CpuSet::new()).unwrap();
        let stream = job_stream(&model, 1, 600);
        let best = replay(&model, &stream, Strategy::BestFit);
        assert_eq!(best.shape_violations, 0, "{}", best.topology);
        for s in Strategy::ALL.into_iter().filter(|&s| s != Strategy::BestFit) {
            let other = replay(&model, &stream, s);
            if other.numa_optimal_share > best.numa_optimal_share + 1e-9 || other.l3_optimal_share > best.l3_optimal_share + 1e-9 {
                failures.push(format!(
                    "{}: {} is more local (NUMA {:.3} L3 {:.3}) than best-fit (NUMA {:.3} L3 {:.3})",
                    best.topology, other.strategy, other.numa_optimal_share, other.l3_optimal_share, best.numa_optimal_share, best.l3_optimal_share
                ));
            }
            if matches!(s, Strategy::K8sStatic | Strategy::SlurmBlock) && other.rejected_while_free < best.rejected_while_free {
                failures.push(format!(
                    "{}: {} rejected {} jobs while free, best-fit {}",
                    best.topology, other.strategy, other.rejected_while_free, best.rejected_while_free
                ));
            }
            if s == Strategy::FirstFit {
                let machine_has_choice = model.numa.len() > 1 || model.l3.len() > 1;
                let strictly = best.numa_optimal_share > other.numa_optimal_share || best.l3_optimal_share > other.l3_optimal_share;
                if machine_has_choice && !strictly {
                    failures.push(format!("{}: best-fit is not strictly more local than first-fit", best.topology));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
