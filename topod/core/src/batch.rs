//! What the execution side reads from the batch system's job environment: the job id topod
//! knows a job by, the slots on this host, and the affinity host file MPI launchers read.

/// The job id topod knows an LSF job by: `lsf-<id>`, or `lsf-<id>[<index>]` for an element of
/// a job array (index 0 or none: not an element). The LSF scheduler module reserves under it and
/// `topo-exec` and `topoctl lsf-pre-exec` allocate under it.
pub fn lsf_job_id(job: impl std::fmt::Display, index: Option<u64>) -> String {
    match index.filter(|&i| i > 0) {
        Some(index) => format!("lsf-{job}[{index}]"),
        None => format!("lsf-{job}"),
    }
}

/// The job id topod knows a Slurm job by on a host: `slurm-<jobid>`, one allocation per job and
/// host shared by all its steps.
pub fn slurm_job_id(job: impl std::fmt::Display) -> String {
    format!("slurm-{job}")
}

/// The job id topod knows a PBS job by: `pbs-<PBS job id>` (`123.server` -> `pbs-123.server`;
/// the PBS hook makes the same).
pub fn pbs_job_id(job: &str) -> String {
    format!("pbs-{job}")
}

/// The job id of the job this process belongs to, from its environment (`get` looks a variable
/// up; empty counts as unset): the one its batch system's topo part allocated under
/// ([`lsf_job_id`] from `$LSB_JOBID` and `$LSB_JOBINDEX`, [`slurm_job_id`] from
/// `$SLURM_JOB_ID`, [`pbs_job_id`] from `$PBS_JOBID`).
pub fn job_id(get: impl Fn(&str) -> Option<String>) -> Option<String> {
    let get = |k: &str| get(k).filter(|v| !v.is_empty());
    if let Some(id) = get("LSB_JOBID") {
        let index = get("LSB_JOBINDEX").and_then(|i| i.parse::<u64>().ok());
        return Some(lsf_job_id(id, index));
    }
    if let Some(id) = get("SLURM_JOB_ID") {
        return Some(slurm_job_id(id));
    }
    get("PBS_JOBID").map(|id| pbs_job_id(&id))
}

/// The slots LSF gave the job on `host`, from `$LSB_MCPU_HOSTS` (`"hostA 4 hostB 2"`); a host
/// may be named by its short name.
pub fn lsf_slots_on(mcpu_hosts: &str, host: &str) -> Option<u32> {
    let short = |h: &str| h.split('.').next().unwrap_or(h).to_string();
    let words: Vec<&str> = mcpu_hosts.split_whitespace().collect();
    words
        .chunks(2)
        .filter(|p| p.len() == 2 && (p[0] == host || short(p[0]) == short(host)))
        .filter_map(|p| p[1].parse::<u32>().ok())
        .reduce(|a, b| a + b)
}

/// An `LSB_AFFINITY_HOSTFILE`-compatible file: one line per task, `host cpu_list`. The optional
/// NUMA-node and memory-policy columns LSF may add are left out: Open MPI versions that read
/// the file mis-bound tasks when they were there (see the reference's pain points).
pub fn affinity_hostfile(host: &str, task_cpus: &[String]) -> String {
    task_cpus.iter().map(|cpus| format!("{host} {cpus}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn job_ids() {
        assert_eq!(job_id(env(&[("LSB_JOBID", "1234")])).as_deref(), Some("lsf-1234"));
        assert_eq!(
            job_id(env(&[("LSB_JOBID", "1234"), ("LSB_JOBINDEX", "0")])).as_deref(),
            Some("lsf-1234")
        );
        assert_eq!(
            job_id(env(&[("LSB_JOBID", "1234"), ("LSB_JOBINDEX", "7")])).as_deref(),
            Some("lsf-1234[7]")
        );
        assert_eq!(
            job_id(env(&[("LSB_JOBID", ""), ("SLURM_JOB_ID", "55")])).as_deref(),
            Some("slurm-55"),
            "the id the SPANK plug-in allocates under"
        );
        assert_eq!(job_id(env(&[("PBS_JOBID", "12[3].srv")])).as_deref(), Some("pbs-12[3].srv"));
        assert_eq!(job_id(env(&[])), None);
    }

    #[test]
    fn slots_and_hostfile() {
        assert_eq!(lsf_slots_on("hostA 4 hostB 2", "hostB"), Some(2));
        assert_eq!(lsf_slots_on("hostA.example.org 4 hostB 2", "hostA"), Some(4));
        assert_eq!(lsf_slots_on("hostA 4 hostA 2", "hostA"), Some(6));
        assert_eq!(lsf_slots_on("hostA 4 hostB", "hostB"), None);
        assert_eq!(lsf_slots_on("hostA x", "hostA"), None);
        assert_eq!(affinity_hostfile("n1", &["0-1".into(), "2-3".into()]), "n1 0-1\nn1 2-3\n");
    }
}
