//! `topoctl slurm-features`: publishes this host's topology to Slurm as node features, for the
//! constraints that `packaging/slurm/job_submit.lua` adds to `--topology` jobs.
//!
//! Two kinds, all powers of two, a host carrying every power up to what it has:
//! - what the host can ever offer, which job_submit.lua constrains jobs on: `topo_cpus_N` (at
//!   least N allocatable CPUs) and `topo_numa_N` (a NUMA node with at least N allocatable CPUs).
//!   A job asks for the largest power of two not above its need, so no host that fits is ever
//!   filtered out, and a request no host can ever hold is refused at submission;
//! - what is free now, for people and for sites' own policies: `topo_free_N` (N free CPUs) and
//!   `topo_freenuma_N` (N free CPUs inside one NUMA node), updated whenever they change.
//!
//! Why the free state is not a constraint: without a node_features plugin, slurmctld checks a
//! job's constraint against the nodes' *active* features at submission, so a constraint that no
//! node satisfies at that moment refuses the job ("Requested node configuration is not
//! available") instead of keeping it pending. Tested on Slurm 22.05.8. Free cores are Slurm's own
//! accounting anyway (cons_tres): on a Slurm node topod only holds CPUs of Slurm jobs.
//!
//! `AvailableFeatures` gets every feature the host could have, `ActiveFeatures` what it has now;
//! features not starting with `topo_` (the site's own) are kept in both. Every `--interval`
//! seconds the node's features are read back from slurmctld and `scontrol update` runs when they
//! differ from topod's: a change on the host, or slurmctld having reset them (`scontrol
//! reconfigure` and a slurmctld restart go back to slurm.conf's features, Slurm 22.05). A
//! failed round (slurmctld restarting) is said on stderr and tried again.

use crate::cli::Daemon;
use crate::live::{call, connect};
use crate::Failure;
use std::process::Command;
use topo_core::proto::reply::FreeMap;
use topo_core::proto::Op;
use topo_core::topology::Topology;

/// The prefix of every feature this command owns.
pub const PREFIX: &str = "topo_";

/// `<cpus_name>_N` for every power of two N up to `cpus`, then `<numa_name>_N` up to `in_one_numa`.
pub fn powers(cpus_name: &str, cpus: u64, numa_name: &str, in_one_numa: u64) -> Vec<String> {
    let mut features = Vec::new();
    for (name, n) in [(cpus_name, cpus), (numa_name, in_one_numa)] {
        let mut step = 1u64;
        while step <= n {
            features.push(format!("{name}_{step}"));
            step *= 2;
        }
    }
    features
}

/// What the host can ever offer (job_submit.lua's constraints).
pub fn capability_features(allocatable: u64, largest_numa: u64) -> Vec<String> {
    powers("topo_cpus", allocatable, "topo_numa", largest_numa)
}

/// What is free now.
pub fn free_features(free_cpus: u64, largest_free_in_one_numa: u64) -> Vec<String> {
    powers("topo_free", free_cpus, "topo_freenuma", largest_free_in_one_numa)
}

/// The node's features with ours replaced: `current` is Slurm's comma list (`(null)` for none).
pub fn merged(current: &str, ours: &[String]) -> String {
    let kept = current
        .split(',')
        .map(str::trim)
        .filter(|f| !f.is_empty() && *f != "(null)" && !f.starts_with(PREFIX));
    kept.map(str::to_string).chain(ours.iter().cloned()).collect::<Vec<_>>().join(",")
}

/// `AvailableFeatures=...` and `ActiveFeatures=...` from `scontrol show node -o NAME`.
fn current_features(scontrol: &str, node: &str) -> Result<(String, String), Failure> {
    let out = Command::new(scontrol)
        .args(["show", "node", "-o", node])
        .output()
        .map_err(|e| Failure::runtime(format!("cannot run {scontrol}: {e}")))?;
    if !out.status.success() {
        return Err(Failure::runtime(format!(
            "{scontrol} show node {node}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |name: &str| {
        text.split_whitespace().find_map(|w| w.strip_prefix(name)).unwrap_or("").to_string()
    };
    Ok((field("AvailableFeatures="), field("ActiveFeatures=")))
}

fn publish(scontrol: &str, node: &str, available: &str, active: &str) -> Result<(), Failure> {
    let out = Command::new(scontrol)
        .args([
            "update",
            &format!("NodeName={node}"),
            &format!("AvailableFeatures={available}"),
            &format!("ActiveFeatures={active}"),
        ])
        .output()
        .map_err(|e| Failure::runtime(format!("cannot run {scontrol}: {e}")))?;
    if !out.status.success() {
        return Err(Failure::runtime(format!(
            "{scontrol} update NodeName={node}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Runs the command: once, or forever every `interval` seconds, publishing on change.
pub fn run(
    daemon: &Daemon,
    node: Option<String>,
    interval: u64,
    once: bool,
    dry_run: bool,
    scontrol: &str,
) -> Result<(), Failure> {
    let node = match node {
        Some(n) => n,
        None => {
            let out = Command::new("hostname")
                .arg("-s")
                .output()
                .map_err(|e| Failure::runtime(format!("cannot run hostname: {e}")))?;
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        }
    };
    // What the host could ever offer: all its allocatable CPUs, its largest NUMA node.
    let mut c = connect(daemon)?;
    let topo: Topology = call(&mut c, Op::Topology)?;
    let allocatable = call::<FreeMap>(&mut c, Op::FreeMap)?.allocatable;
    let largest_numa =
        topo.numa_nodes.iter().map(|n| n.cpus.intersection_len(&allocatable)).max().unwrap_or(0);
    let capability = capability_features(allocatable.len() as u64, largest_numa as u64);
    let possible: Vec<String> = capability
        .iter()
        .cloned()
        .chain(free_features(allocatable.len() as u64, largest_numa as u64))
        .collect();
    loop {
        match publish_round(daemon, &node, &capability, &possible, dry_run, scontrol) {
            Ok(()) => {}
            // Once (and a dry run): the caller is told. As a service: slurmctld restarting or
            // topod away for a moment must not end it; said, and tried again next round.
            Err(e) if once || dry_run => return Err(e),
            Err(e) => {
                eprintln!("topoctl slurm-features: {e}; trying again in {}s", interval.max(1))
            }
        }
        if once || dry_run {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_secs(interval.max(1)));
    }
}

/// One look: topod's free map and slurmctld's features of the node; `scontrol update` when
/// they differ from what topod says (a change here, or slurmctld reset them).
fn publish_round(
    daemon: &Daemon,
    node: &str,
    capability: &[String],
    possible: &[String],
    dry_run: bool,
    scontrol: &str,
) -> Result<(), Failure> {
    let free = call::<FreeMap>(&mut connect(daemon)?, Op::FreeMap)?.free;
    let ours: Vec<String> = capability
        .iter()
        .cloned()
        .chain(free_features(free.free_cpus as u64, free.largest_in_one_numa as u64))
        .collect();
    if dry_run {
        println!("node {node}: available {}; active {}", possible.join(","), ours.join(","));
        return Ok(());
    }
    let (available_now, active_now) = current_features(scontrol, node)?;
    let (available, active) = (merged(&available_now, possible), merged(&active_now, &ours));
    if same_features(&available_now, &available) && same_features(&active_now, &active) {
        return Ok(());
    }
    publish(scontrol, node, &available, &active)?;
    println!("node {node}: published AvailableFeatures={available} ActiveFeatures={active}");
    Ok(())
}

/// Whether two feature lists name the same features, in any order (slurmctld keeps its own).
fn same_features(a: &str, b: &str) -> bool {
    let set = |s: &str| -> std::collections::BTreeSet<String> {
        s.split(',')
            .map(str::trim)
            .filter(|f| !f.is_empty() && *f != "(null)")
            .map(str::to_string)
            .collect()
    };
    set(a) == set(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn features_never_hide_a_host_that_fits() {
        assert_eq!(
            capability_features(12, 3),
            [
                "topo_cpus_1",
                "topo_cpus_2",
                "topo_cpus_4",
                "topo_cpus_8",
                "topo_numa_1",
                "topo_numa_2"
            ]
        );
        assert!(free_features(0, 0).is_empty());
        // A job needing n CPUs asks for the largest power of two not above n (job_submit.lua).
        for need in 1..300u64 {
            let step = 1u64 << (63 - need.leading_zeros());
            for free in need..need + 5 {
                assert!(
                    capability_features(free, 0).contains(&format!("topo_cpus_{step}")),
                    "{need} {free}"
                );
            }
        }
    }

    #[test]
    fn features_compare_as_sets() {
        assert!(same_features("b,a", "a,b"));
        assert!(same_features("(null)", ""));
        assert!(!same_features("a", "a,topo_cpus_1"));
    }

    #[test]
    fn site_features_are_kept() {
        let ours = free_features(2, 2);
        assert_eq!(
            merged("(null)", &ours),
            "topo_free_1,topo_free_2,topo_freenuma_1,topo_freenuma_2"
        );
        assert_eq!(merged("gpu,topo_free_64,ib", &ours[..1]), "gpu,ib,topo_free_1");
    }
}
