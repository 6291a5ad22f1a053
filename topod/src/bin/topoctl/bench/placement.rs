//! `topoctl bench placement`: every strategy on one seeded job stream per machine
//! (`topo_core::bench`), for locality, rejections and the time of each decision.

use crate::offline::{load_path, shared_topologies};
use crate::Failure;
use std::path::PathBuf;
use topo_core::bench;
use topo_core::place::{HostModel, Strategy};
use topo_core::CpuSet;

fn default_bench_topologies() -> Result<Vec<PathBuf>, Failure> {
    let root = shared_topologies().ok_or_else(|| {
        Failure::input(
            "no --topology given and no shared/topologies folder found (set TOPO_SHARED_DIR to the shared folder)",
        )
    })?;
    let mut files = Vec::new();
    for sub in ["xml", "converted-hwloc2.9"] {
        let dir = root.join(sub);
        let entries = std::fs::read_dir(&dir)
            .map_err(|e| Failure::input(format!("cannot list {}: {e}", dir.display())))?;
        for entry in entries.flatten() {
            let p = entry.path();
            if p.extension().is_some_and(|x| x == "xml") {
                files.push(p);
            }
        }
    }
    files.sort();
    Ok(files)
}

pub(crate) fn run(
    topologies: &[PathBuf],
    strategies: &[Strategy],
    seed: u64,
    jobs: usize,
    json: bool,
    migrate: Option<topo_core::defrag::DefragLimits>,
) -> Result<(), Failure> {
    let files =
        if topologies.is_empty() { default_bench_topologies()? } else { topologies.to_vec() };
    let strategies: Vec<Strategy> =
        if strategies.is_empty() { Strategy::ALL.to_vec() } else { strategies.to_vec() };
    if !json {
        println!(
            "seed {seed}, {jobs} jobs per stream, host kept at most {:.0}% busy before each arrival\n\
             NUMA-ok / L3-ok: share of placed jobs within the fewest NUMA nodes / L3 groups their size allows\n\
             radius: mean largest SLIT distance inside a job (10 = one node); SMT: cores shared by two jobs\n\
             rej-free: jobs rejected while at least as many PUs were free; load: mean share of PUs held\n{}",
            bench::TARGET_LOAD * 100.0,
            if migrate.is_some() {
                "with migration: +migr: rejections while free left; plans: refused jobs placed by moving others;\n\
                 moves, PUs: jobs and PUs moved; worse: moves after which a job spans more NUMA nodes or L3 groups;\n\
                 plan p50/p99/max: planner time per call, microseconds\n"
            } else {
                ""
            }
        );
    }
    for file in files {
        let topo = load_path(&file)?;
        let model =
            HostModel::new(&topo, &CpuSet::new()).map_err(|e| Failure::input(e.to_string()))?;
        let gpu_results = gpu_stream_results(&topo, &model, seed, jobs);
        let stream = bench::job_stream(&model, seed, jobs);
        let results: Vec<bench::BenchResult> =
            strategies.iter().map(|&s| bench::replay(&model, &stream, s)).collect();
        let migrated: Vec<bench::MigrationResult> = match migrate {
            Some(limits) => strategies
                .iter()
                .map(|&s| bench::replay_migrating(&model, &stream, s, limits))
                .collect(),
            None => Vec::new(),
        };
        if json {
            for r in &results {
                let line = serde_json::to_string(r).map_err(|e| Failure::runtime(e.to_string()))?;
                println!("{line}");
            }
            for r in &migrated {
                let line = serde_json::to_string(r).map_err(|e| Failure::runtime(e.to_string()))?;
                println!("{line}");
            }
            for r in &gpu_results {
                let line = serde_json::to_string(r).map_err(|e| Failure::runtime(e.to_string()))?;
                println!("{line}");
            }
            continue;
        }
        let c = topo.counts();
        println!(
            "{} ({} PUs, {} cores, {} L3, {} NUMA, {} packages)",
            topo.short_name(),
            c.pus,
            c.cores,
            c.l3_groups,
            c.numa_nodes,
            c.packages
        );
        println!(
            "  {:<12} {:>6} {:>7} {:>7} {:>7} {:>7} {:>8} {:>5} {:>8} {:>8}",
            "strategy",
            "placed",
            "NUMA-ok",
            "L3-ok",
            "radius",
            "SMT",
            "rej-free",
            "load",
            "p50 us",
            "p99 us"
        );
        for r in &results {
            println!(
                "  {:<12} {:>6} {:>7.3} {:>7.3} {:>7.2} {:>7} {:>8} {:>4.0}% {:>8.2} {:>8.2}",
                r.strategy,
                r.placed,
                r.numa_optimal_share,
                r.l3_optimal_share,
                r.mean_radius,
                r.smt_shared,
                r.rejected_while_free,
                r.mean_load * 100.0,
                r.decision_p50_us,
                r.decision_p99_us
            );
        }
        if !gpu_results.is_empty() {
            println!(
                "  GPU stream ({} GPUs, {} cores beside each; half the jobs ask 1-8 GPUs and 1 to that many cores per GPU):",
                topo_core::gpus::gpu_indices(&topo).len(),
                topo_core::gpus::cores_per_gpu(&topo, &model)
            );
            // The islands' column only where the machine has NVLink or xGMI.
            let fabrics = topo.devices.iter().any(|d| d.fabric.is_some());
            let island_head =
                if fabrics { format!(" {:>11}", "one-island") } else { String::new() };
            println!(
                "  {:<16} {:>8} {:>7} {:>7} {:>7} {:>10} {:>11}{island_head} {:>9}",
                "GPU policy",
                "GPU jobs",
                "placed",
                "local",
                "local%",
                "task-local",
                "one-switch",
                "refused*"
            );
            for r in &gpu_results {
                let island = if fabrics {
                    format!(" {:>5}/{:<5}", r.one_fabric, r.multi)
                } else {
                    String::new()
                };
                println!(
                    "  {:<16} {:>8} {:>7} {:>7} {:>6.1}% {:>10} {:>5}/{:<5}{island} {:>9}",
                    r.policy.name(),
                    r.gpu_jobs,
                    r.placed,
                    r.local,
                    r.local_pct(),
                    r.task_local,
                    r.one_switch,
                    r.multi,
                    r.refused_gpus_free
                );
            }
            let island_note =
                if fabrics { "; one-island: in one NVLink island or xGMI hive" } else { "" };
            println!("  (local: every CPU in its GPUs' NUMA nodes; task-local: each of those nodes has its share of the tasks (tasks x its GPUs / the job's GPUs) wholly inside; one-switch: multi-GPU jobs behind one PCIe switch{island_note}; refused*: while enough GPUs were free)");
        }
        if !migrated.is_empty() {
            println!(
                "  with migration (up to {} moves per plan; NUMA-ok, L3-ok: where jobs end up)",
                migrate.map_or(0, |l| l.max_moves)
            );
            println!(
                "  {:<12} {:>8} {:>8} {:>6} {:>7} {:>7} {:>6} {:>6} {:>7} {:>6} {:>8} {:>8} {:>8}",
                "strategy",
                "rej-free",
                "+migr",
                "placed",
                "NUMA-ok",
                "L3-ok",
                "plans",
                "moves",
                "PUs",
                "worse",
                "plan p50",
                "p99 us",
                "max us"
            );
            for r in &migrated {
                println!(
                    "  {:<12} {:>8} {:>8} {:>6} {:>7.3} {:>7.3} {:>6} {:>6} {:>7} {:>6} {:>8.1} {:>8.1} {:>8.1}",
                    r.strategy,
                    r.rejected_while_free_without,
                    r.rejected_while_free,
                    r.placed,
                    r.numa_optimal_share,
                    r.l3_optimal_share,
                    r.plans,
                    r.moves,
                    r.moved_pus,
                    r.moves_less_local,
                    r.planner_p50_us,
                    r.planner_p99_us,
                    r.planner_max_us
                );
            }
        }
        println!();
    }
    Ok(())
}

/// The GPU stream (`topo_core::gpus`) under topo's choice and both baselines, on a host with two
/// or more GPUs; nothing on others.
fn gpu_stream_results(
    topo: &topo_core::topology::Topology,
    model: &HostModel,
    seed: u64,
    jobs: usize,
) -> Vec<topo_core::gpus::GpuBenchResult> {
    use topo_core::gpus;
    let count = gpus::gpu_indices(topo).len();
    if count < 2 {
        return Vec::new();
    }
    let stream = gpus::gpu_stream(count, gpus::cores_per_gpu(topo, model), seed, jobs);
    gpus::GpuPolicy::ALL.iter().map(|&p| gpus::replay_gpus(topo, model, &stream, p)).collect()
}
