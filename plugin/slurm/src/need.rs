//! What a request needs from a host, in the coarse terms Slurm can filter hosts on.
//!
//! The submitting side (srun, sbatch, salloc) parses `--topology` with the placement core's own
//! parser and puts a summary into the job's control environment (`spank_job_env`), where
//! `job_submit.lua` turns it into node features; `topoctl slurm-features` publishes the same
//! features for each host's free map. So the request language is parsed in one place (Rust),
//! and the Lua script only compares numbers.
//!
//! Features are powers of two, and a host carries every one up to what it has free
//! (`topo_free_8`: at least 8 free CPUs; `topo_numa_4`: at least 4 inside one NUMA node; see
//! `topoctl slurm-features`). The script asks for the largest power of two not above the need,
//! so a host that fits is never filtered out: the filter is coarse, topod decides on the host.

use topo_core::request::{Level, Request};

/// The environment variable, in the job's control environment, that carries the summary.
pub const NEED_VARIABLE: &str = "TOPO_NEED";

/// The smallest number of CPUs a request needs: every unit is at least one CPU.
pub fn min_cpus(req: &Request, tasks_if_unsaid: u32) -> u64 {
    u64::from(req.tasks.unwrap_or(tasks_if_unsaid).max(1)) * u64::from(req.units_per_task.max(1))
}

/// The summary: `cpus=N` and, when each task must sit in one NUMA node or one package (or
/// finer), `numa=M` with M the CPUs one task needs there.
pub fn summary(req: &Request, tasks_if_unsaid: u32) -> String {
    let mut s = format!("cpus={}", min_cpus(req, tasks_if_unsaid));
    if matches!(req.same, Some(Level::Numa | Level::L3 | Level::Core | Level::Thread)) {
        s.push_str(&format!(" numa={}", req.units_per_task.max(1)));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summaries() {
        let r = topo_core::request::parse("affinity[core(2,same=numa)*4]").unwrap();
        assert_eq!(summary(&r, 1), "cpus=8 numa=2");
        let r = topo_core::request::parse("affinity[core(3)]").unwrap();
        assert_eq!(summary(&r, 5), "cpus=15");
    }
}
