//! What the execution side reads from the batch system's job environment: the job id topod
//! knows a job by, the slots on this host, and the affinity host file MPI launchers read.

/// The job id of the job this process belongs to, from its environment (`get` looks a variable
/// up; empty counts as unset): under LSF `lsf-$LSB_JOBID`, with `[$LSB_JOBINDEX]` for an element
/// of a job array (the id the LSF scheduler module reserves under); else `$SLURM_JOB_ID` or
/// `$PBS_JOBID` as they are.
pub fn job_id(get: impl Fn(&str) -> Option<String>) -> Option<String> {
    let get = |k: &str| get(k).filter(|v| !v.is_empty());
    if let Some(id) = get("LSB_JOBID") {
        return Some(match get("LSB_JOBINDEX").filter(|i| i != "0") {
            Some(index) => format!("lsf-{id}[{index}]"),
            None => format!("lsf-{id}"),
        });
    }
    get("SLURM_JOB_ID").or_else(|| get("PBS_JOBID"))
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
            Some("55")
        );
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
