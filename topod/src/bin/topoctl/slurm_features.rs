//! `topoctl slurm-features`: publishes this host's free topology to Slurm as node features, for
//! the constraints that `packaging/slurm/job_submit.lua` adds to `--topology` jobs.
//!
//! Features are powers of two, and a host carries every one up to what it has free:
//! `topo_free_8` = at least 8 free CPUs, `topo_numa_4` = at least 4 free CPUs inside one NUMA
//! node. A job is constrained to the largest power of two not above what it needs, so no host
//! that fits is ever filtered out; topod decides on the host.
//!
//! Features Slurm already has for the node that do not start with `topo_` are kept. `scontrol
//! update` runs only when the features change (checked every `--interval` seconds).

use crate::{call, connect, Daemon, Failure};
use std::process::Command;
use topod::proto::Op;

/// The prefix of every feature this command owns.
pub const PREFIX: &str = "topo_";

/// The features of a host with `free_cpus` free and `largest_in_one_numa` free inside one NUMA
/// node, in order.
pub fn host_features(free_cpus: u64, largest_in_one_numa: u64) -> Vec<String> {
    let mut features = Vec::new();
    for (name, n) in [("topo_free", free_cpus), ("topo_numa", largest_in_one_numa)] {
        let mut step = 1u64;
        while step <= n {
            features.push(format!("{name}_{step}"));
            step *= 2;
        }
    }
    features
}

/// The node's features with ours replaced: `current` is Slurm's comma list (`(null)` for none).
pub fn merged(current: &str, ours: &[String]) -> String {
    let kept = current.split(',').map(str::trim).filter(|f| !f.is_empty() && *f != "(null)" && !f.starts_with(PREFIX));
    kept.map(str::to_string).chain(ours.iter().cloned()).collect::<Vec<_>>().join(",")
}

/// `AvailableFeatures=...` from `scontrol show node -o NAME`.
fn current_features(scontrol: &str, node: &str) -> Result<String, Failure> {
    let out = Command::new(scontrol)
        .args(["show", "node", "-o", node])
        .output()
        .map_err(|e| Failure::runtime(format!("cannot run {scontrol}: {e}")))?;
    if !out.status.success() {
        return Err(Failure::runtime(format!("{scontrol} show node {node}: {}", String::from_utf8_lossy(&out.stderr).trim())));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text.split_whitespace().find_map(|w| w.strip_prefix("AvailableFeatures=")).unwrap_or("").to_string())
}

fn publish(scontrol: &str, node: &str, features: &str) -> Result<(), Failure> {
    let value = if features.is_empty() { "\"\"".to_string() } else { features.to_string() };
    let out = Command::new(scontrol)
        .args(["update", &format!("NodeName={node}"), &format!("AvailableFeatures={value}"), &format!("ActiveFeatures={value}")])
        .output()
        .map_err(|e| Failure::runtime(format!("cannot run {scontrol}: {e}")))?;
    if !out.status.success() {
        return Err(Failure::runtime(format!("{scontrol} update NodeName={node}: {}", String::from_utf8_lossy(&out.stderr).trim())));
    }
    Ok(())
}

/// Runs the command: once, or forever every `interval` seconds, publishing on change.
pub fn run(daemon: &Daemon, node: Option<String>, interval: u64, once: bool, dry_run: bool, scontrol: &str) -> Result<(), Failure> {
    let node = match node {
        Some(n) => n,
        None => {
            let out = Command::new("hostname").arg("-s").output().map_err(|e| Failure::runtime(format!("cannot run hostname: {e}")))?;
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        }
    };
    let mut last: Option<Vec<String>> = None;
    loop {
        let free = call(&mut connect(daemon)?, Op::FreeMap)?;
        let get = |k: &str| free["free"][k].as_u64().unwrap_or(0);
        let ours = host_features(get("free_cpus"), get("largest_in_one_numa"));
        if last.as_ref() != Some(&ours) {
            if dry_run {
                println!("node {node}: {}", ours.join(","));
            } else {
                let features = merged(&current_features(scontrol, &node)?, &ours);
                publish(scontrol, &node, &features)?;
                println!("node {node}: published {features}");
            }
            last = Some(ours);
        }
        if once {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_secs(interval.max(1)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn features_never_hide_a_host_that_fits() {
        assert_eq!(host_features(12, 3), ["topo_free_1", "topo_free_2", "topo_free_4", "topo_free_8", "topo_numa_1", "topo_numa_2"]);
        assert!(host_features(0, 0).is_empty());
        // A job needing n CPUs asks for the largest power of two not above n (job_submit.lua).
        for need in 1..300u64 {
            let step = 1u64 << (63 - need.leading_zeros());
            for free in need..need + 5 {
                assert!(host_features(free, 0).contains(&format!("topo_free_{step}")), "{need} {free}");
            }
        }
    }

    #[test]
    fn site_features_are_kept() {
        let ours = host_features(2, 2);
        assert_eq!(merged("(null)", &ours), "topo_free_1,topo_free_2,topo_numa_1,topo_numa_2");
        assert_eq!(merged("gpu,topo_free_64,ib", &ours[..1]), "gpu,ib,topo_free_1");
    }
}
