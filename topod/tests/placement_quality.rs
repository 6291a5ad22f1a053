//! The placement-quality claims, checked on every real machine in `shared/topologies` with the
//! benchmark's job stream: best-fit keeps jobs at least as local (NUMA and L3) as pack, balance,
//! first-fit and the Kubernetes baseline on every machine, strictly more than topology-blind
//! first-fit, and over all machines more local than every strategy and baseline, with no more
//! rejections while enough PUs are free than either baseline. The full benchmark is
//! `topoctl bench placement`.

mod common;

use std::path::PathBuf;
use topo_core::bench::{job_stream, replay_quality};
use topo_core::place::{HostModel, Strategy};
use topo_core::topology::hwloc_xml;
use topo_core::CpuSet;

/// Jobs per stream: enough that the shares settle to within a point.
const JOBS: usize = 2000;

fn topology_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for sub in ["xml", "converted-hwloc2.9"] {
        let dir = common::topologies().join(sub);
        for entry in std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e} (set TOPO_SHARED_DIR)", dir.display()))
        {
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
    let strategies = Strategy::ALL;
    let files = topology_files();
    let mut failures = Vec::new();
    // Per strategy: sums over topologies of NUMA share, L3 share, rejections while free.
    let mut totals = vec![(0.0f64, 0.0f64, 0usize); strategies.len()];
    for file in &files {
        let topo = hwloc_xml::read_file(file).unwrap();
        let model = HostModel::new(&topo, &CpuSet::new()).unwrap();
        let stream = job_stream(&model, 1, JOBS);
        let results: Vec<_> =
            strategies.iter().map(|&s| replay_quality(&model, &stream, s)).collect();
        let best = &results[0];
        assert_eq!(best.strategy, "best-fit");
        assert_eq!(best.shape_violations, 0, "{}", best.topology);
        for (i, r) in results.iter().enumerate() {
            totals[i].0 += r.numa_optimal_share;
            totals[i].1 += r.l3_optimal_share;
            totals[i].2 += r.rejected_while_free;
            // On every machine: at least as local as the strategies that do not search for the
            // tightest domain, and as kubelet's static policy.
            let must_beat = matches!(
                strategies[i],
                Strategy::Pack | Strategy::Balance | Strategy::FirstFit | Strategy::K8sStatic
            );
            if must_beat
                && (r.numa_optimal_share > best.numa_optimal_share
                    || r.l3_optimal_share > best.l3_optimal_share)
            {
                failures.push(format!(
                    "{}: {} is more local (NUMA {:.3}, L3 {:.3}) than best-fit (NUMA {:.3}, L3 {:.3})",
                    best.topology, r.strategy, r.numa_optimal_share, r.l3_optimal_share, best.numa_optimal_share, best.l3_optimal_share
                ));
            }
        }
        let first = &results[3];
        let machine_has_choice = model.numa.len() > 1 || model.l3.len() > 1;
        if machine_has_choice
            && best.numa_optimal_share <= first.numa_optimal_share
            && best.l3_optimal_share <= first.l3_optimal_share
        {
            failures.push(format!(
                "{}: best-fit is not strictly more local than first-fit",
                best.topology
            ));
        }
    }
    // Over all machines: the most local of all, Slurm's block distribution and buddy included
    // (on a few small two-socket machines those come within a point of best-fit or above it:
    // see the benchmark), and no more rejections while PUs are free than either baseline.
    let (bn, bl, br) = totals[0];
    for (i, &(n, l, r)) in totals.iter().enumerate().skip(1) {
        let name = strategies[i].name();
        if n > bn || l > bl {
            failures.push(format!("over all machines {name} is more local (NUMA {n:.3}, L3 {l:.3}) than best-fit (NUMA {bn:.3}, L3 {bl:.3})"));
        }
        if matches!(strategies[i], Strategy::K8sStatic | Strategy::SlurmBlock) && r < br {
            failures.push(format!(
                "over all machines {name} rejected {r} jobs while PUs were free, best-fit {br}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
