//! `spank_topo.so`: topo's Slurm SPANK plug-in.
//!
//! Users ask `srun`, `sbatch` or `salloc` for `--topology=REQUEST` in the placement core's
//! affinity grammar (`affinity[core(2,same=numa)*4]`, or `CPUSET[...]`). The model:
//!
//! 1. **Submission** (srun/sbatch/salloc; SPANK local and allocator contexts). The request is
//!    parsed by [`topo_core::request::parse`]; a bad one refuses the submission with the parse error
//!    and nothing is submitted. A good one's summary ([`need`]) goes into the job's control
//!    environment, where `job_submit.lua` turns it into node features to filter hosts on.
//! 2. **On each host, per step** (slurmstepd, remote context, root, before the tasks are
//!    forked). The plug-in translates the cores Slurm gave the job (`S_JOB_ALLOC_CORES`,
//!    Slurm's abstract core indexes, [`cores`]) to OS CPU ids and asks the host's topod to
//!    allocate the job (`slurm-<jobid>`, one allocation per job and host, [`plan`]) inside them.
//! 3. **Each task** (the forked child, root, before exec): joins topod's cgroup for the job, or,
//!    when Slurm's task/cgroup or proctrack/cgroup already holds it in a Slurm cgroup, stays
//!    there (never fighting Slurm's cgroups) and only narrows ([`args::Mode`]). Just before
//!    exec, as the user, its affinity is set to its CPUs and `TOPO_JOB`, `TOPO_CPUS`,
//!    `TOPO_TASK_CPUS`, `TOPO_MEMS`, `TOPO_CGROUP` are exported.
//! 4. **Job end** (job epilog): topod releases the job: kills stragglers, removes its cgroup,
//!    frees its CPUs. When topod cannot be reached then, the release is queued for it
//!    (`topo_client::queue_release`) and the epilog succeeds, so the node is not drained.
//!
//! Without `--topology` every callback returns at once. The Slurm ABI is in `spank` (not
//! built for the tests: its functions exist only inside Slurm); everything else is pure.

pub mod args;
pub mod cores;
pub mod gres;
pub mod need;
pub mod plan;
#[cfg(not(test))]
mod spank;

#[cfg(test)]
mod tests {
    /// What a Slurm user reads when a `--topology` request is refused (at submission, by the
    /// plug-in's parser; on the host, by topod's, which is the same) never names LSF's strings.
    #[test]
    fn refusals_of_a_request_do_not_speak_lsf() {
        for bad in [
            "affinity[cores(2)]",
            "affinity[core(0)]",
            "affinity[core(2,same=numb)]",
            "CPUSET[MAX_RADIUS=x]",
            "CPUSET[BAD=1]",
            "affinity[core] affinity[core]",
            "affinity[core",
            "",
            "affinity[core(2)*99999999]",
        ] {
            let e = topo_core::request::parse(bad).expect_err(bad).to_string();
            for lsf in ["extsched", "EXTSCHED", "LSF", "bsub", "mbschd"] {
                assert!(!e.contains(lsf), "{bad:?}: {e:?} names {lsf}");
            }
        }
    }
}
