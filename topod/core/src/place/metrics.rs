//! Placement quality, per placement and per host (see `shared/reference/placement.md` §4).

use super::model::HostModel;
use super::Occupancy;
use crate::cpuset::CpuSet;
use crate::request::Level;
use serde::Serialize;

/// How good one placement is.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PlacementMetrics {
    /// CPUs placed.
    pub cpus: usize,
    /// NUMA nodes the job spans.
    pub numa_nodes: usize,
    /// The fewest NUMA nodes that could hold this many CPUs on the empty host.
    pub min_numa_nodes: usize,
    /// L3 groups spanned.
    pub l3_groups: usize,
    /// The fewest L3 groups that could hold this many CPUs.
    pub min_l3_groups: usize,
    /// Packages spanned.
    pub sockets: usize,
    /// The fewest packages that could hold this many CPUs.
    pub min_sockets: usize,
    /// The largest SLIT distance between two of the job's NUMA nodes (10 = one node).
    pub radius: u32,
    /// The same in hops (0 = one node), the `MAX_RADIUS` unit.
    pub hops: u32,
    /// The job's cores whose other threads another job already holds.
    pub smt_shared: usize,
    /// L3 groups that were wholly free and that the job now uses only in part.
    pub free_l3_broken: usize,
}

impl PlacementMetrics {
    /// Measures `cpus` placed on `model` where `before` was the occupancy before the placement.
    pub fn measure(model: &HostModel, before: &Occupancy, cpus: &CpuSet) -> Self {
        let numa = model.touched(Level::Numa, cpus);
        let radius = model.radius(&numa);
        let n = cpus.len();
        let smt_shared = model
            .touched_set(Level::Core, cpus)
            .iter()
            .filter(|&c| model.cores[c as usize].intersects_outside(cpus, &before.held))
            .count();
        let l3 = model.touched_set(Level::L3, cpus);
        let free_l3_broken = l3
            .iter()
            .filter(|&l| {
                let d = &model.l3[l as usize];
                !d.intersects(&before.held) && !d.intersects(&before.fenced) && !d.is_subset(cpus)
            })
            .count();
        PlacementMetrics {
            cpus: n,
            numa_nodes: numa.len(),
            min_numa_nodes: model.min_domains_for(Level::Numa, n),
            l3_groups: l3.len(),
            min_l3_groups: model.min_domains_for(Level::L3, n),
            sockets: model.touched_set(Level::Socket, cpus).len(),
            min_sockets: model.min_domains_for(Level::Socket, n),
            radius,
            hops: model.hops(radius),
            smt_shared,
            free_l3_broken,
        }
    }

    /// Whether the job spans no more NUMA nodes than it must.
    pub fn numa_optimal(&self) -> bool {
        self.numa_nodes <= self.min_numa_nodes
    }

    /// Whether the job spans no more L3 groups than it must.
    pub fn l3_optimal(&self) -> bool {
        self.l3_groups <= self.min_l3_groups
    }
}

/// What is still free on a host, by shape: the largest request of each kind that fits now.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct HostMetrics {
    /// Free CPUs.
    pub free_cpus: usize,
    /// Free whole cores.
    pub free_cores: usize,
    /// Wholly free L3 groups.
    pub free_l3_groups: usize,
    /// Wholly free NUMA nodes (with CPUs).
    pub free_numa_nodes: usize,
    /// Wholly free packages.
    pub free_sockets: usize,
    /// The most free CPUs inside one L3 group.
    pub largest_in_one_l3: usize,
    /// The most free CPUs inside one NUMA node.
    pub largest_in_one_numa: usize,
    /// The most free CPUs inside one package.
    pub largest_in_one_socket: usize,
}

impl HostMetrics {
    /// Measures the host's free map.
    pub fn measure(model: &HostModel, occupancy: &Occupancy) -> Self {
        let free = occupancy.free(model);
        let whole = |doms: &[CpuSet]| doms.iter().filter(|d| d.is_subset(&free)).count();
        let most =
            |doms: &[CpuSet]| doms.iter().map(|d| d.intersection_len(&free)).max().unwrap_or(0);
        HostMetrics {
            free_cpus: free.len(),
            free_cores: whole(&model.cores),
            free_l3_groups: whole(&model.l3),
            free_numa_nodes: whole(&model.numa),
            free_sockets: whole(&model.sockets),
            largest_in_one_l3: most(&model.l3),
            largest_in_one_numa: most(&model.numa),
            largest_in_one_socket: most(&model.sockets),
        }
    }
}
