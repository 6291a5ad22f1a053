//! `HostModel`: the hardware graph prepared for fast placement.
//!
//! Placement needs, many times per second, "how many free units are under this domain" and
//! "which domains of level X does this set touch". The model answers both with precomputed
//! bitsets and per-CPU lookup tables. It is built once per topology (and per set of reserved
//! CPUs) and shared read-only: topod builds one for its host, the cluster-side plug-in builds one
//! per distinct machine type and evaluates every host of that type against it.
//!
//! **The placement tree.** The levels of the graph need not nest (sub-NUMA clustering puts two
//! NUMA nodes under one L3; on the IBM x3950 four packages share a NUMA node). The model builds a
//! strict tree anyway by successive refinement: start from the whole machine and split each node
//! by the domains of the next level, largest levels first, keeping the non-empty intersections.
//! A level whose split changes nothing is skipped. Every tree node records the level it came from,
//! so a tree node of level X always lies inside one domain of X.

use crate::cpuset::CpuSet;
use crate::request::Level;
use crate::topology::Topology;

/// A node of the placement tree.
#[derive(Debug, Clone)]
pub struct TreeNode {
    /// The level this node was split by (`None` for the machine root).
    pub level: Option<Level>,
    /// Allocatable CPUs under this node.
    pub cpus: CpuSet,
    /// How many: `cpus.len()`, kept (on a host of thousands of CPUs each count is a pass over
    /// a long bit vector, and best-fit compares the sizes of every node that fits).
    pub size: usize,
    /// The size of its largest child (0 for a leaf): a search for a node of at least n CPUs
    /// need not look among children all smaller.
    pub largest_child: usize,
    /// Children, in ascending order of number (siblings are numbered in turn), and mostly of
    /// first CPU (a NUMA part of CPUs without a memory node comes after the others).
    pub children: Vec<usize>,
    /// Every child is a leaf (a core) of one size: a node of a flat host's thousands of cores,
    /// where a choice among the children need not sort or search them (see the placement engine).
    pub uniform_leaves: bool,
    /// The parent (`None` for the root).
    pub parent: Option<usize>,
    /// Index of the NUMA node domain (in `HostModel::numa`) this node lies in, when it lies in one.
    pub numa: Option<usize>,
    /// For core, L3, NUMA and socket (in that order): the one domain of that level this node
    /// lies in, if it lies in one.
    pub within: [Option<usize>; 4],
}

/// Position of a level in [`TreeNode::within`] (`None` for threads).
pub fn level_slot(level: Level) -> Option<usize> {
    match level {
        Level::Thread => None,
        Level::Core => Some(0),
        Level::L3 => Some(1),
        Level::Numa => Some(2),
        Level::Socket => Some(3),
    }
}

/// The hardware graph restricted to allocatable CPUs, indexed for placement.
#[derive(Debug, Clone)]
pub struct HostModel {
    /// Name of the topology it was built from.
    pub name: String,
    /// CPUs jobs may be given: online, allowed, not reserved.
    pub allocatable: CpuSet,
    /// CPUs seen but not allocatable (outside the allowed set, or reserved), for display.
    pub excluded: CpuSet,
    /// Domains per level, restricted to allocatable CPUs, empty ones dropped. Level order:
    /// `Thread` is implicit (each allocatable CPU), then core, L3, NUMA, socket.
    pub cores: Vec<CpuSet>,
    /// L3 groups; when the machine has none, the NUMA∩package domains stand in.
    pub l3: Vec<CpuSet>,
    /// NUMA nodes with allocatable CPUs.
    pub numa: Vec<CpuSet>,
    /// OS ids of the NUMA nodes in `numa`.
    pub numa_os: Vec<u32>,
    /// Every NUMA node whose memory the job may use (including CPU-less ones), by OS id.
    pub all_mems: CpuSet,
    /// Packages.
    pub sockets: Vec<CpuSet>,
    /// `numa_distance[i * numa.len() + j]`: SLIT distance between `numa[i]` and `numa[j]`.
    pub numa_distance: Vec<u32>,
    /// Distinct remote distances, ascending: `hops(d)` is the position of `d` in this list + 1.
    remote_distances: Vec<u32>,
    /// For each CPU id (up to the largest allocatable), index into `cores`/`l3`/`numa`/`sockets`.
    core_of: Vec<u32>,
    l3_of: Vec<u32>,
    numa_of: Vec<u32>,
    socket_of: Vec<u32>,
    /// The placement tree; node 0 is the machine.
    pub tree: Vec<TreeNode>,
    /// Tree nodes with children, deepest first (children before parents).
    internal_bottom_up: Vec<usize>,
    /// For each CPU id, the tree leaf holding it.
    leaf_of: Vec<u32>,
    /// Per level (core, L3, NUMA, socket): running sums of domain sizes, largest first.
    largest_first_prefix: [Vec<usize>; 4],
    /// CPU-less memory nodes (OS id) with the CPU NUMA domains nearest to each.
    pub cpuless: Vec<(u32, Vec<usize>)>,
    /// Threads per core on this machine (the largest core's size).
    pub threads_per_core: usize,
    /// Per level (core, L3, NUMA, socket): each domain's first CPU and size, so that a question
    /// about many domains need not scan their sets (each a bit vector as long as the host).
    outline: [DomainOutline; 4],
}

/// The first CPU and the size of each domain of one level, and whether the domains are
/// disjoint (each CPU in one: what the counting shortcuts rely on).
#[derive(Debug, Clone, Default)]
struct DomainOutline {
    first: Vec<u32>,
    size: Vec<u32>,
    disjoint: bool,
    /// Every allocatable CPU is a domain of its own (the cores of a host without SMT).
    singletons: bool,
}

impl DomainOutline {
    fn of(domains: &[CpuSet], allocatable: usize) -> Self {
        let size: Vec<u32> = domains.iter().map(|d| d.len() as u32).collect();
        let total: usize = size.iter().map(|&s| s as usize).sum();
        DomainOutline {
            first: domains.iter().map(|d| d.first().unwrap_or(NONE)).collect(),
            singletons: size.len() == allocatable && size.iter().all(|&s| s == 1),
            size,
            disjoint: CpuSet::union_all(domains).len() == total,
        }
    }
}

const NONE: u32 = u32::MAX;

/// Why a host model could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// Nothing is left to allocate.
    #[error("{name}: no allocatable CPU (allowed: {allowed:?}, reserved: {reserved:?})")]
    NoCpus {
        /// Topology name.
        name: String,
        /// The allowed set.
        allowed: String,
        /// The reserved set.
        reserved: String,
    },
}

impl HostModel {
    /// Builds the model of `topo`, leaving out the `reserved` CPUs.
    pub fn new(topo: &Topology, reserved: &CpuSet) -> Result<Self, ModelError> {
        let allocatable = topo.allowed.difference(reserved);
        if allocatable.is_empty() {
            return Err(ModelError::NoCpus {
                name: topo.short_name().to_string(),
                allowed: topo.allowed.to_string(),
                reserved: reserved.to_string(),
            });
        }
        let restrict = |sets: &mut dyn Iterator<Item = &CpuSet>| -> Vec<CpuSet> {
            let mut out: Vec<CpuSet> =
                sets.map(|s| s.intersection(&allocatable)).filter(|s| !s.is_empty()).collect();
            out.sort_by_key(|s| s.first());
            out.dedup();
            out
        };
        let mut cores = restrict(&mut topo.cores.iter().map(|d| &d.cpus));
        // CPUs no core claims (readers should not produce them, but be safe) become cores of one.
        let covered = CpuSet::union_all(&cores);
        for cpu in allocatable.difference(&covered).iter() {
            cores.push(std::iter::once(cpu).collect());
        }
        cores.sort_by_key(|s| s.first());
        let mut numa_pairs: Vec<(CpuSet, u32)> = topo
            .numa_nodes
            .iter()
            .map(|n| (n.cpus.intersection(&allocatable), n.os_index))
            .filter(|(s, _)| !s.is_empty())
            .collect();
        numa_pairs.sort_by_key(|(s, _)| s.first());
        let (mut numa, mut numa_os): (Vec<CpuSet>, Vec<u32>) = numa_pairs.into_iter().unzip();
        let numa_covered = CpuSet::union_all(&numa);
        let orphan = allocatable.difference(&numa_covered);
        if !orphan.is_empty() {
            // CPUs with no local memory node (offline node 0): treat them as one more domain with
            // no memory of its own, so that they can still be placed and measured.
            numa.push(orphan);
            numa_os.push(NONE);
        }
        let mut sockets = restrict(&mut topo.packages.iter().map(|d| &d.cpus));
        if sockets.is_empty() {
            sockets.push(allocatable.clone());
        }
        let mut l3 = restrict(&mut topo.l3_groups.iter().map(|d| &d.cpus));
        if l3.is_empty() {
            // No L3 (KNL, old Opterons): the cache-sharing level that matters is then the NUMA
            // node within the package.
            for n in &numa {
                for s in &sockets {
                    let x = n.intersection(s);
                    if !x.is_empty() {
                        l3.push(x);
                    }
                }
            }
            l3.sort_by_key(|s| s.first());
        }
        let max_cpu = allocatable.last().unwrap_or(0) as usize + 1;
        let index_of = |doms: &[CpuSet]| {
            let mut v = vec![NONE; max_cpu];
            for (i, d) in doms.iter().enumerate() {
                for c in d.iter() {
                    if (c as usize) < max_cpu && v[c as usize] == NONE {
                        v[c as usize] = i as u32;
                    }
                }
            }
            v
        };
        let (core_of, l3_of, numa_of, socket_of) =
            (index_of(&cores), index_of(&l3), index_of(&numa), index_of(&sockets));
        let n = numa.len();
        let mut numa_distance = vec![10; n * n];
        for i in 0..n {
            for j in 0..n {
                numa_distance[i * n + j] = if i == j {
                    10
                } else if numa_os[i] == NONE || numa_os[j] == NONE {
                    20
                } else {
                    topo.numa_distance(numa_os[i], numa_os[j]).max(11)
                };
            }
        }
        let mut remote_distances: Vec<u32> =
            numa_distance.iter().copied().filter(|&d| d > 10).collect();
        remote_distances.sort_unstable();
        remote_distances.dedup();
        let all_mems = topo
            .numa_nodes
            .iter()
            .map(|n| n.os_index)
            .filter(|id| topo.allowed_mems.contains(*id))
            .collect();
        let threads_per_core = cores.iter().map(|c| c.len()).max().unwrap_or(1);
        let cpuless = topo
            .numa_nodes
            .iter()
            .filter(|m| topo.allowed_mems.contains(m.os_index) && !m.cpus.intersects(&allocatable))
            .map(|m| {
                // Nearest CPU domains: those holding its near CPUs, else the closest by distance.
                let by_cpus: Vec<usize> =
                    (0..numa.len()).filter(|&i| numa[i].intersects(&m.near_cpus)).collect();
                if !by_cpus.is_empty() || topo.distances.is_none() {
                    return (m.os_index, by_cpus);
                }
                let dist: Vec<u32> = numa_os
                    .iter()
                    .map(
                        |&os| {
                            if os == NONE {
                                u32::MAX
                            } else {
                                topo.numa_distance(m.os_index, os)
                            }
                        },
                    )
                    .collect();
                let best = dist.iter().copied().min().unwrap_or(u32::MAX);
                let near = if best == u32::MAX {
                    Vec::new()
                } else {
                    (0..dist.len()).filter(|&i| dist[i] == best).collect()
                };
                (m.os_index, near)
            })
            .collect();
        let mut model = HostModel {
            name: topo.short_name().to_string(),
            excluded: topo.pus.difference(&allocatable),
            allocatable,
            cores,
            l3,
            numa,
            numa_os,
            all_mems,
            sockets,
            numa_distance,
            remote_distances,
            core_of,
            l3_of,
            numa_of,
            socket_of,
            tree: Vec::new(),
            largest_first_prefix: Default::default(),
            leaf_of: Vec::new(),
            internal_bottom_up: Vec::new(),
            cpuless,
            threads_per_core,
            outline: Default::default(),
        };
        model.outline = [Level::Core, Level::L3, Level::Numa, Level::Socket]
            .map(|l| DomainOutline::of(model.domains(l), model.allocatable.len()));
        model.tree = model.build_tree();
        for id in 0..model.tree.len() {
            let largest = model.tree[id].children.iter().map(|&c| model.tree[c].size).max();
            model.tree[id].largest_child = largest.unwrap_or(0);
            let node = &model.tree[id];
            let uniform = !node.children.is_empty()
                && node.children.iter().all(|&c| {
                    model.tree[c].children.is_empty() && model.tree[c].size == node.largest_child
                });
            model.tree[id].uniform_leaves = uniform;
        }
        model.internal_bottom_up =
            (0..model.tree.len()).rev().filter(|&i| !model.tree[i].children.is_empty()).collect();
        model.leaf_of = vec![NONE; max_cpu];
        for (id, node) in model.tree.iter().enumerate().filter(|(_, n)| n.children.is_empty()) {
            for cpu in node.cpus.iter() {
                if let Some(slot) = model.leaf_of.get_mut(cpu as usize) {
                    *slot = id as u32;
                }
            }
        }
        model.largest_first_prefix =
            [Level::Core, Level::L3, Level::Numa, Level::Socket].map(|l| {
                let mut sizes: Vec<usize> = model.domains(l).iter().map(|d| d.len()).collect();
                sizes.sort_unstable_by(|a, b| b.cmp(a));
                sizes
                    .iter()
                    .scan(0, |acc, s| {
                        *acc += s;
                        Some(*acc)
                    })
                    .collect()
            });
        Ok(model)
    }

    /// The domains of `level` (for `Thread`, none: every CPU is its own domain).
    pub fn domains(&self, level: Level) -> &[CpuSet] {
        match level {
            Level::Thread => &[],
            Level::Core => &self.cores,
            Level::L3 => &self.l3,
            Level::Numa => &self.numa,
            Level::Socket => &self.sockets,
        }
    }

    /// CPUs in one unit of `level` (the largest such domain; 1 for threads).
    pub fn pus_per_unit(&self, level: Level) -> usize {
        match level {
            Level::Thread => 1,
            Level::Core => self.threads_per_core,
            l => self.domains(l).iter().map(|d| d.len()).max().unwrap_or(1),
        }
    }

    /// Tree nodes that have children, children before parents.
    pub fn internal_bottom_up(&self) -> &[usize] {
        &self.internal_bottom_up
    }

    /// The tree leaf holding `cpu`.
    #[inline]
    pub fn leaf_of(&self, cpu: u32) -> Option<usize> {
        self.leaf_of.get(cpu as usize).copied().filter(|&i| i != NONE).map(|i| i as usize)
    }

    /// Index of the domain of `level` holding `cpu`.
    #[inline]
    pub fn domain_of(&self, level: Level, cpu: u32) -> Option<usize> {
        let table = match level {
            Level::Thread => return Some(cpu as usize),
            Level::Core => &self.core_of,
            Level::L3 => &self.l3_of,
            Level::Numa => &self.numa_of,
            Level::Socket => &self.socket_of,
        };
        table.get(cpu as usize).copied().filter(|&i| i != NONE).map(|i| i as usize)
    }

    /// Indexes of the domains of `level` that `cpus` touches.
    pub fn touched(&self, level: Level, cpus: &CpuSet) -> Vec<usize> {
        self.touched_set(level, cpus).iter().map(|i| i as usize).collect()
    }

    /// The indexes of the domains of `level` that `cpus` touches, as a set.
    pub fn touched_set(&self, level: Level, cpus: &CpuSet) -> CpuSet {
        let mut out = CpuSet::new();
        for c in cpus.iter() {
            if let Some(i) = self.domain_of(level, c) {
                out.insert(i as u32);
            }
        }
        out
    }

    /// How many cores hold none of `busy`'s CPUs. One pass over `busy`, where testing each core
    /// against it costs a pass over the host's bit vector per core (4,096 cores: 260,000 words).
    pub fn cores_clear_of(&self, busy: &CpuSet) -> usize {
        self.cores.len() - self.cores_touching(busy)
    }

    /// How many cores hold any of `cpus` (the cores a job's CPUs touch). One pass over `cpus`
    /// where the cores are disjoint, as [`Self::cores_clear_of`].
    pub fn cores_touching(&self, cpus: &CpuSet) -> usize {
        if !self.outline[0].disjoint {
            return self.cores.iter().filter(|c| c.intersects(cpus)).count();
        }
        if self.outline[0].singletons {
            return cpus.intersection_len(&self.allocatable);
        }
        self.touched_set(Level::Core, cpus).len()
    }

    /// The first CPU of each domain of `level` lying wholly inside `avail` (for `Thread`,
    /// `avail` itself). One pass over `avail` and one over the domains' sizes.
    pub fn whole_domain_firsts(&self, level: Level, avail: &CpuSet) -> CpuSet {
        let Some(slot) = level_slot(level) else { return avail.clone() };
        let outline = &self.outline[slot];
        if outline.singletons && outline.disjoint {
            return avail.intersection(&self.allocatable);
        }
        let mut out = CpuSet::new();
        if !outline.disjoint {
            let doms = self.domains(level);
            for cpu in avail.iter() {
                if let Some(i) = self.domain_of(level, cpu) {
                    if doms[i].first() == Some(cpu) && doms[i].is_subset(avail) {
                        out.insert(cpu);
                    }
                }
            }
            return out;
        }
        let mut inside = vec![0u32; outline.size.len()];
        for cpu in avail.iter() {
            if let Some(i) = self.domain_of(level, cpu) {
                inside[i] += 1;
            }
        }
        for (i, &n) in inside.iter().enumerate() {
            if n > 0 && n == outline.size[i] {
                out.insert(outline.first[i]);
            }
        }
        out
    }

    /// The union of the domains of `level` that `cpus` touches.
    pub fn closure(&self, level: Level, cpus: &CpuSet) -> CpuSet {
        if level == Level::Thread {
            return cpus.clone();
        }
        let doms = self.domains(level);
        CpuSet::union_all(self.touched(level, cpus).into_iter().map(|i| &doms[i]))
    }

    /// The smallest number of domains of `level` that could hold `n` CPUs on the empty machine.
    pub fn min_domains_for(&self, level: Level, n: usize) -> usize {
        let Some(slot) = level_slot(level) else { return n };
        // prefix[k] = CPUs in the k+1 largest domains.
        let prefix = &self.largest_first_prefix[slot];
        prefix.partition_point(|&sum| sum < n).min(prefix.len().saturating_sub(1)) + 1
    }

    /// SLIT distance between NUMA domains `a` and `b` (indexes into `numa`).
    #[inline]
    pub fn distance(&self, a: usize, b: usize) -> u32 {
        self.numa_distance[a * self.numa.len() + b]
    }

    /// Radius of a set of NUMA domains: the largest SLIT distance between two of them (10 for one).
    pub fn radius(&self, numa: &[usize]) -> u32 {
        let mut r = 10;
        for &a in numa {
            for &b in numa {
                r = r.max(self.distance(a, b));
            }
        }
        r
    }

    /// Radius in hops: 0 inside one NUMA node, k when the largest distance is the k-th smallest
    /// distinct remote distance of this machine (the `MAX_RADIUS` unit).
    pub fn hops(&self, distance: u32) -> u32 {
        if distance <= 10 {
            return 0;
        }
        self.remote_distances
            .iter()
            .position(|&d| d >= distance)
            .map_or(self.remote_distances.len() as u32, |p| p as u32 + 1)
    }

    /// The memory nodes (OS ids) local to `cpus`.
    pub fn local_mems(&self, cpus: &CpuSet) -> CpuSet {
        self.touched(Level::Numa, cpus)
            .into_iter()
            .map(|i| self.numa_os[i])
            .filter(|&id| id != NONE)
            .collect()
    }

    fn build_tree(&self) -> Vec<TreeNode> {
        // Largest levels first by average domain size; ties keep socket > numa > l3 > core.
        let mut levels: Vec<Level> = vec![Level::Socket, Level::Numa, Level::L3, Level::Core];
        let avg = |l: Level| {
            let d = self.domains(l);
            self.allocatable.len() as f64 / d.len().max(1) as f64
        };
        levels.sort_by(|a, b| avg(*b).partial_cmp(&avg(*a)).unwrap_or(std::cmp::Ordering::Equal));
        let mut tree = vec![self.tree_node(None, self.allocatable.clone())];
        let mut frontier = vec![0usize];
        for level in levels {
            let mut next = Vec::new();
            let mut changed = false;
            let mut splits: Vec<(usize, Vec<CpuSet>)> = Vec::new();
            for &node in &frontier {
                let parts: Vec<CpuSet> = self
                    .touched(level, &tree[node].cpus)
                    .into_iter()
                    .map(|i| self.domains(level)[i].intersection(&tree[node].cpus))
                    .filter(|s| !s.is_empty())
                    .collect();
                if parts.len() > 1 || parts.first().is_some_and(|p| p != &tree[node].cpus) {
                    changed = true;
                }
                splits.push((node, parts));
            }
            if !changed && level != Level::Core {
                // This level adds nothing below what we have; still tag the nodes so that a
                // request naming it (same=l3 where L3 == NUMA) finds its domains.
                continue;
            }
            for (node, parts) in splits {
                for part in parts {
                    let mut child = self.tree_node(Some(level), part);
                    child.parent = Some(node);
                    tree.push(child);
                    let id = tree.len() - 1;
                    tree[node].children.push(id);
                    next.push(id);
                }
            }
            frontier = next;
        }
        tree
    }

    fn tree_node(&self, level: Option<Level>, cpus: CpuSet) -> TreeNode {
        let within = [Level::Core, Level::L3, Level::Numa, Level::Socket]
            .map(|l| self.single_domain(l, &cpus));
        TreeNode {
            level,
            numa: within[2],
            within,
            size: cpus.len(),
            largest_child: 0,
            uniform_leaves: false,
            cpus,
            children: Vec::new(),
            parent: None,
        }
    }

    /// The memory nodes local to `cpus` plus the CPU-less nodes (HBM, GPU memory) nearest to them.
    pub fn local_mems_with_cpuless(&self, cpus: &CpuSet) -> CpuSet {
        let mut mems = self.local_mems(cpus);
        let touched = self.touched(Level::Numa, cpus);
        for (os, near) in &self.cpuless {
            if near.iter().any(|n| touched.contains(n)) {
                mems.insert(*os);
            }
        }
        mems
    }

    /// The index of the one domain of `level` that holds all of `cpus`, if there is one.
    pub fn single_domain(&self, level: Level, cpus: &CpuSet) -> Option<usize> {
        let t = self.touched(level, cpus);
        (t.len() == 1).then(|| t[0])
    }
}
