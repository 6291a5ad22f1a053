//! Slurm's abstract core indexes (`S_JOB_ALLOC_CORES`, `S_STEP_ALLOC_CORES`) to OS CPU ids.
//!
//! The core lists Slurm hands a SPANK plug-in are not OS CPU ids. They index the node's cores in
//! Slurm's *abstract* order: socket-major, the cores of socket 0 first. slurmd builds that order
//! from hwloc (`xcpuinfo_hwloc_topo_get` in `src/slurmd/common/xcpuinfo.c`): for each package
//! that holds cores, in hwloc's logical order, each core below it in logical order; a core's CPUs
//! are the OS ids of its hardware threads. hwloc's logical order is the order of a walk of its
//! tree in which siblings are sorted by their first CPU; Slurm keeps packages, dies, L3 caches,
//! groups and cores in that tree (it filters L1/L2 caches out).
//!
//! topo's hardware graph is flat (levels of CPU sets, no tree; see [`topo_core::topology`]), so the
//! walk is rebuilt from containment: a core's position is decided by the first CPU of each
//! domain that holds it (package, die, NUMA node, L3 group), from the largest domain to the
//! smallest, then by its own first CPU. On x86 machines numbered the Linux way this is plainly
//! "package by package, cores by first CPU", with SMT siblings (`0` and `192` on a 2x96-core
//! EPYC) inside one core.
//!
//! The translation assumes that slurm.conf describes the node as slurmd sees it (`slurmd -C`:
//! `Sockets`, `CoresPerSocket`, `ThreadsPerCore`); an index beyond the node's cores is an error
//! that says so. `SlurmdParameters=l3cache_as_socket` / `numa_node_as_socket` change what Slurm
//! calls a socket but not the order of the cores, because L3 groups and NUMA nodes sit inside
//! packages in the same walk.

use topo_core::topology::Topology;
use topo_core::CpuSet;

/// Why a Slurm core list could not be translated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreMapError {
    /// The list is not in Slurm's list format.
    #[error("Slurm core list {list:?} is not a list of core indexes: {reason}")]
    BadList {
        /// The text Slurm gave.
        list: String,
        /// What is wrong.
        reason: String,
    },
    /// An index past the last core of the node.
    #[error(
        "Slurm core index {index} is beyond this node's {cores} cores (list {list:?}); \
         does slurm.conf describe this node as `slurmd -C` does (Sockets, CoresPerSocket, ThreadsPerCore)?"
    )]
    BeyondNode {
        /// The index.
        index: u32,
        /// The node's cores.
        cores: usize,
        /// The list Slurm gave.
        list: String,
    },
}

/// The node's cores in Slurm's abstract order, each as the OS ids of its online hardware threads.
pub fn slurm_core_order(topo: &Topology) -> Vec<CpuSet> {
    let min = |s: &CpuSet| s.first().unwrap_or(u32::MAX);
    // Every domain that can sit between the machine and a core in hwloc's tree.
    let containers: Vec<&CpuSet> = topo
        .packages
        .iter()
        .map(|d| &d.cpus)
        .chain(topo.dies.iter().map(|d| &d.cpus))
        .chain(topo.numa_nodes.iter().map(|n| &n.cpus).filter(|c| !c.is_empty()))
        .chain(topo.l3_groups.iter().map(|d| &d.cpus))
        .collect();
    let mut keyed: Vec<(Vec<u32>, CpuSet)> = topo
        .cores
        .iter()
        .map(|core| core.cpus.intersection(&topo.pus))
        .filter(|cpus| !cpus.is_empty())
        .map(|cpus| {
            let mut holders: Vec<&CpuSet> =
                containers.iter().copied().filter(|c| cpus.is_subset(c) && **c != cpus).collect();
            // Outermost first; the same set at two levels is one hwloc object.
            holders.sort_by(|a, b| b.len().cmp(&a.len()).then(min(a).cmp(&min(b))));
            holders.dedup();
            let mut key: Vec<u32> = holders.iter().map(|h| min(h)).collect();
            key.push(min(&cpus));
            (key, cpus)
        })
        .collect();
    keyed.sort();
    keyed.into_iter().map(|(_, cpus)| cpus).collect()
}

/// The OS CPU ids of the cores Slurm listed (`"0-2,7"`), given the node's core order.
pub fn translate(order: &[CpuSet], list: &str) -> Result<CpuSet, CoreMapError> {
    let indexes = CpuSet::parse_list(list)
        .map_err(|e| CoreMapError::BadList { list: list.to_string(), reason: e.to_string() })?;
    let mut cpus = CpuSet::new();
    for index in indexes.iter() {
        let core = order.get(index as usize).ok_or_else(|| CoreMapError::BeyondNode {
            index,
            cores: order.len(),
            list: list.to_string(),
        })?;
        cpus.union_with(core);
    }
    Ok(cpus)
}

#[cfg(test)]
mod tests;
