//! GPUs and CPUs chosen together by topology (issue 33, "topo chooses"), and the benchmark that
//! compares that choice with what Slurm and Kubernetes do on the same job stream.
//!
//! The model: a host's GPUs (and other accelerators) are [`Topology::devices`] of class `Gpu`
//! or `Accelerator`; each is near the CPUs of its NUMA node, of its package, or of nothing
//! known ([`Topology::cpus_near`]). A job asks for `count` GPUs and a CPU request. [`choose`]
//! tries, tightest first, each NUMA node and then each package whose free GPUs suffice, taking
//! the GPUs behind one PCIe switch where it can and placing the CPUs inside that domain; only
//! when no domain holds both does it take free GPUs from several, with its CPUs in their NUMA
//! nodes. A job whose CPUs cannot be near its GPUs waits rather than runs away from them, as
//! Kubernetes' `single-numa-node` does, but a job larger than one node is not refused for
//! ever. Once placed, a job of several tasks is told each task's GPUs ([`gpus_per_task`]: the
//! nearest its own CPUs), and every job its nearest network adapters ([`nics_near`]: behind
//! its GPUs' PCIe switch, else in their NUMA node or package; without GPUs, its CPUs' node).
//! Jobs without GPUs are kept off the CPUs near free GPUs when they fit elsewhere
//! ([`away_from_free_gpus`]). The baselines ([`GpuPolicy::SlurmLike`],
//! [`GpuPolicy::SingleNumaNode`]) stand for Slurm's cons_tres without gres `Cores=` (cores
//! first, lowest numbers first; GPUs by index) and Kubernetes' Topology Manager with the
//! `single-numa-node` policy (one NUMA node holds the CPUs and the GPUs, or the pod is not
//! admitted).

#[cfg(feature = "sim")]
use crate::bench::SplitMix;
use crate::cpuset::CpuSet;
#[cfg(feature = "sim")]
use crate::ledger::Ledger;
use crate::place::{self, HostModel, Occupancy, Placement, Strategy};
use crate::request::{Level, Request};
use crate::topology::{DeviceClass, Topology};
use serde::Serialize;

/// `affinity[core*n]`: `n` single-core tasks.
pub fn cores(n: u32) -> Request {
    Request { unit: Level::Core, tasks: Some(n), ..Request::default() }
}

/// The devices a job may be given as GPUs: GPUs and accelerators, by index in
/// [`Topology::devices`], without those that are no job's ([`is_for_jobs`]).
pub fn gpu_indices(topo: &Topology) -> Vec<usize> {
    (0..topo.devices.len()).filter(|&i| is_for_jobs(&topo.devices[i])).collect()
}

/// Vendors of the display adapters on servers' boards and BMCs (ASPEED 0x1a03, Matrox 0x102b,
/// per the PCI ID registry): VGA (class 0x03) but no job's GPU.
const BOARD_DISPLAY_VENDORS: [u16; 2] = [0x1a03, 0x102b];

/// Single display adapters (vendor, device) that are no job's GPU either, by the PCI ID
/// registry's names: a server board's ATI ES1000 (as on the IBM x3950 in
/// `../shared/topologies`), and the display a virtual machine is given (QEMU's standard VGA
/// 1234:1111, Cirrus GD 5446 1013:00b8, QXL 1b36:0100, virtio-gpu 1af4:1050, VMware SVGA II
/// 15ad:0405, Hyper-V's synthetic video 1414:5353).
const BOARD_DISPLAY_DEVICES: [(u16, u16); 7] = [
    (0x1002, 0x515e),
    (0x1234, 0x1111),
    (0x1013, 0x00b8),
    (0x1b36, 0x0100),
    (0x1af4, 0x1050),
    (0x15ad, 0x0405),
    (0x1414, 0x5353),
];

/// Intel's PCI vendor id: its co-processors (class 0x0b40) are QuickAssist crypto and
/// compression engines, which the kernel uses for everyone, not a job's accelerator.
const INTEL: u16 = 0x8086;

/// Whether `device` is a GPU or accelerator a job may be given (and be confined to): class
/// 0x03 (display) or an accelerator, but not a board's, BMC's or virtual machine's display
/// adapter, nor Intel's QuickAssist, nor an SR-IOV virtual function (a slice of a GPU listed
/// already as its physical function, made for virtual machines: giving both would give the same
/// GPU twice).
pub fn is_for_jobs(device: &crate::topology::IoDevice) -> bool {
    let vendor = device.vendor_id.unwrap_or(0);
    if device.virtual_function {
        return false;
    }
    match device.class {
        DeviceClass::Gpu => {
            let id = (vendor, device.device_id.unwrap_or(0));
            !BOARD_DISPLAY_VENDORS.contains(&vendor) && !BOARD_DISPLAY_DEVICES.contains(&id)
        }
        DeviceClass::Accelerator => !(vendor == INTEL && device.class_code >> 8 == 0x0b40),
        _ => false,
    }
}

/// GPUs and CPUs chosen for a job.
#[derive(Debug, Clone)]
pub struct GpuPick {
    /// The GPUs, by index in [`Topology::devices`].
    pub gpus: Vec<usize>,
    /// The CPUs.
    pub placement: Placement,
}

/// Who chooses the GPUs and CPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum GpuPolicy {
    /// topo: GPUs and CPUs together, tightest domain first ([`choose`]).
    Topo,
    /// Slurm's cons_tres without gres `Cores=`: CPUs first (lowest free cores), GPUs by index.
    SlurmLike,
    /// Kubernetes' Topology Manager, `single-numa-node`: the first NUMA node that holds both,
    /// else not admitted.
    SingleNumaNode,
}

impl GpuPolicy {
    /// Every policy, topo's first.
    pub const ALL: [GpuPolicy; 3] =
        [GpuPolicy::Topo, GpuPolicy::SlurmLike, GpuPolicy::SingleNumaNode];

    /// The name printed.
    pub fn name(self) -> &'static str {
        match self {
            GpuPolicy::Topo => "topo",
            GpuPolicy::SlurmLike => "slurm-like",
            GpuPolicy::SingleNumaNode => "k8s-single-numa",
        }
    }
}

/// `request` kept to `cpus` (with its own CPU list, if any); `None` when nothing is left.
pub fn within(request: &Request, cpus: &CpuSet) -> Option<Request> {
    let list = match &request.cpu_list {
        Some(list) => list.intersection(cpus),
        None => cpus.clone(),
    };
    (!list.is_empty()).then(|| Request { cpu_list: Some(list), ..request.clone() })
}

/// Where a GPU is, as [`choose_among`] needs it: the CPUs near it at each level and the PCIe
/// switch above it. topod sends the free GPUs' sites in its free map, so that a scheduler's
/// plug-in chooses as topod will.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
pub struct GpuSite {
    /// The CPUs of its NUMA node ([`Topology::cpus_near`]); none when not known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa: Option<CpuSet>,
    /// The CPUs of its package; none when not known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<CpuSet>,
    /// The PCIe switch above it (its second upstream bridge), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub switch: Option<String>,
    /// Its NVLink island or xGMI hive ([`crate::topology::IoDevice::fabric`]), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fabric: Option<String>,
}

impl GpuSite {
    /// The site of `topo`'s device `g`.
    pub fn of(topo: &Topology, g: usize) -> GpuSite {
        let device = &topo.devices[g];
        GpuSite {
            numa: topo.cpus_near(device, Level::Numa),
            socket: topo.cpus_near(device, Level::Socket),
            switch: device.switch().map(str::to_string),
            fabric: device.fabric.clone(),
        }
    }

    fn near(&self, level: Level) -> Option<&CpuSet> {
        match level {
            Level::Socket => self.socket.as_ref(),
            _ => self.numa.as_ref(),
        }
    }
}

/// `count` of the GPUs `group`: those of one NVLink island or xGMI hive first (their links
/// are faster than any PCIe path), else those behind one PCIe switch, else in address order.
/// Of the islands (switches) that hold them all, the one with the fewest free GPUs, keeping
/// larger ones whole; inside an island, those behind one switch first. One GPU comes from
/// outside any island (switch) when there is such a GPU: it needs no links, and the linked
/// ones stay whole for jobs that do.
fn take_from(sites: &[GpuSite], group: &[usize], count: usize) -> Vec<usize> {
    let fabric = |g: usize| sites[g].fabric.as_deref();
    let switch = |g: usize| sites[g].switch.as_deref();
    let by_switch = |gpus: &[usize]| {
        let alone: Vec<usize> = gpus.iter().copied().filter(|&g| switch(g).is_none()).collect();
        if count == 1 && !alone.is_empty() {
            return alone[..1].to_vec();
        }
        match smallest_holding(gpus, count, switch) {
            Some(v) => v[..count].to_vec(),
            None => gpus[..count].to_vec(),
        }
    };
    let unlinked: Vec<usize> = group.iter().copied().filter(|&g| fabric(g).is_none()).collect();
    if count == 1 && !unlinked.is_empty() {
        return by_switch(&unlinked);
    }
    match smallest_holding(group, count, fabric) {
        Some(island) => by_switch(&island),
        None => by_switch(group),
    }
}

/// `count` of the free GPUs `group` (indices into `sites`), taken as [`choose_among`] takes
/// them from one domain (one NVLink island, else one PCIe switch, keeping larger ones whole);
/// `None` when the group has fewer. For a batch system that counted how many GPUs a job has
/// in each NUMA node: topod takes each node's from that node's free GPUs.
pub fn take(sites: &[GpuSite], group: &[usize], count: usize) -> Option<Vec<usize>> {
    (count > 0 && group.len() >= count).then(|| take_from(sites, group, count))
}

/// The NUMA node (kernel id) a GPU at `site` counts in: the node whose CPUs are those near
/// it (a GPU in a node without CPUs counts in the node whose CPUs are nearest; one whose node
/// the kernel does not know, in none). What a batch system counting GPUs per NUMA node (the
/// PBS hook, from the free map's sites) and topod following those counts both go by.
pub fn counted_node(topo: &Topology, site: &GpuSite) -> Option<u32> {
    let near = site.numa.as_ref()?;
    topo.numa_nodes.iter().find(|n| n.cpus.intersection(&topo.pus) == *near).map(|n| n.os_index)
}

/// Of `group`'s GPUs split by `key` (those without one apart), the smallest part of at least
/// `count` (the first of equals, in `group`'s order).
fn smallest_holding<'a>(
    group: &[usize],
    count: usize,
    key: impl Fn(usize) -> Option<&'a str>,
) -> Option<Vec<usize>> {
    let mut parts: Vec<(&str, Vec<usize>)> = Vec::new();
    for &g in group {
        let Some(k) = key(g) else { continue };
        match parts.iter_mut().find(|(p, _)| *p == k) {
            Some((_, v)) => v.push(g),
            None => parts.push((k, vec![g])),
        }
    }
    parts.into_iter().map(|(_, v)| v).filter(|v| v.len() >= count).min_by_key(Vec::len)
}

/// topo's choice: `count` of the `free` GPUs and a placement of `request` beside them (see the
/// module docs), or `None` when there are not enough free GPUs or the CPUs do not fit.
pub fn choose(
    topo: &Topology,
    model: &HostModel,
    occupancy: &Occupancy,
    free: &[usize],
    request: &Request,
    count: usize,
    strategy: Strategy,
) -> Option<GpuPick> {
    let sites: Vec<GpuSite> = free.iter().map(|&g| GpuSite::of(topo, g)).collect();
    let (picked, placement) = choose_among(&sites, model, occupancy, request, count, strategy)?;
    Some(GpuPick { gpus: picked.iter().map(|&i| free[i]).collect(), placement })
}

/// [`choose`] over the free GPUs' `sites` (indices into it returned): what a scheduler's
/// plug-in runs on a host's free map.
pub fn choose_among(
    sites: &[GpuSite],
    model: &HostModel,
    occupancy: &Occupancy,
    request: &Request,
    count: usize,
    strategy: Strategy,
) -> Option<(Vec<usize>, Placement)> {
    if sites.len() < count {
        return None;
    }
    let free_cpus = occupancy.free(model);
    for level in [Level::Numa, Level::Socket] {
        // The free GPUs near each domain of this level.
        let mut groups: Vec<(CpuSet, Vec<usize>)> = Vec::new();
        for (g, site) in sites.iter().enumerate() {
            let Some(near) = site.near(level) else { continue };
            match groups.iter_mut().find(|(cpus, _)| cpus == near) {
                Some((_, v)) => v.push(g),
                None => groups.push((near.clone(), vec![g])),
            }
        }
        groups.retain(|(_, v)| v.len() >= count);
        // Best fit: the fewest spare GPUs, then the fewest free CPUs, so that domains with many
        // free GPUs stay whole for jobs that need many.
        groups.sort_by_key(|(cpus, v)| (v.len(), cpus.intersection(&free_cpus).len()));
        for (cpus, group) in &groups {
            let Some(inside) = within(request, cpus) else { continue };
            let gpus = take_from(sites, group, count);
            // GPUs of one package in several of its nodes: each node's tasks beside them.
            let split = place_by_node(sites, &gpus, model, occupancy, &inside, strategy);
            if let Some(placement) =
                split.or_else(|| place::place(model, occupancy, &inside, strategy).ok())
            {
                return Some((gpus, placement));
            }
        }
    }
    // No domain holds both (the job wants more GPUs than any package has free, or the CPUs
    // beside them are taken): its GPUs from several, its CPUs in their NUMA nodes, or it waits.
    // Sets of GPUs tried in turn, the first whose CPUs fit wins:
    //  1. of known place, one node at a time (most free CPUs first), so the GPUs lie where the
    //     CPUs can go and each node's tasks have GPUs of their own;
    //  2. of known place, in address order;
    //  3. of unknown place first (`numa_node` -1 and no `local_cpulist`: nothing is nearer than
    //     anything else): with one of them the CPUs may go anywhere.
    let allowed =
        request.cpu_list.as_ref().map_or(free_cpus.clone(), |l| l.intersection(&free_cpus));
    // The known-place GPUs by node, the nodes with the most CPUs free for the job first; then
    // one GPU from each node in turn.
    let mut nodes: Vec<(&CpuSet, Vec<usize>)> = Vec::new();
    for (g, site) in sites.iter().enumerate() {
        let Some(node) = &site.numa else { continue };
        match nodes.iter_mut().find(|(n, _)| *n == node) {
            Some((_, v)) => v.push(g),
            None => nodes.push((node, vec![g])),
        }
    }
    nodes.sort_by_key(|(n, v)| (std::cmp::Reverse(n.intersection(&allowed).len()), v[0]));
    let most = nodes.iter().map(|(_, v)| v.len()).max().unwrap_or(0);
    let spread: Vec<usize> = (0..most)
        .flat_map(|turn| nodes.iter().filter_map(move |(_, v)| v.get(turn).copied()))
        .collect();
    let mut in_order: Vec<usize> = (0..sites.len()).collect();
    in_order.sort_by_key(|&g| sites[g].numa.is_none());
    let mut unknown_first: Vec<usize> = (0..sites.len()).collect();
    unknown_first.sort_by_key(|&g| sites[g].numa.is_some());
    for candidates in [spread, in_order, unknown_first] {
        if candidates.len() < count {
            continue;
        }
        let mut gpus = candidates;
        gpus.truncate(count);
        gpus.sort_unstable();
        let mut near = CpuSet::new();
        let mut anywhere = false;
        for &g in &gpus {
            match &sites[g].numa {
                Some(cpus) => near.union_with(cpus),
                None => anywhere = true,
            }
        }
        let placed = if anywhere {
            place::place(model, occupancy, request, strategy).ok()
        } else {
            place_by_node(sites, &gpus, model, occupancy, request, strategy).or_else(|| {
                within(request, &near)
                    .and_then(|r| place::place(model, occupancy, &r, strategy).ok())
            })
        };
        if let Some(placement) = placed {
            return Some((gpus, placement));
        }
    }
    None
}

/// A job whose `gpus` (indices into `sites`) lie in several NUMA nodes, placed with each
/// node's share of its tasks beside that node's GPUs ([`place_split`] over [`nodes_of`]).
fn place_by_node(
    sites: &[GpuSite],
    gpus: &[usize],
    model: &HostModel,
    occupancy: &Occupancy,
    request: &Request,
    strategy: Strategy,
) -> Option<Placement> {
    let nodes = nodes_of(gpus.iter().map(|&g| sites[g].numa.as_ref()))?;
    place_split(model, occupancy, request, &nodes, strategy)
}

/// A job's GPUs by NUMA node, each node's CPUs with how many of the GPUs are there (in the
/// order the GPUs come), given each GPU's node CPUs; `None` when one's node is not known or
/// they are all in one node (nothing to split).
pub fn nodes_of<'a>(
    gpu_nodes: impl IntoIterator<Item = Option<&'a CpuSet>>,
) -> Option<Vec<(CpuSet, usize)>> {
    let mut nodes: Vec<(CpuSet, usize)> = Vec::new();
    for node in gpu_nodes {
        let node = node?;
        match nodes.iter_mut().find(|(n, _)| n == node) {
            Some((_, count)) => *count += 1,
            None => nodes.push((node.clone(), 1)),
        }
    }
    (nodes.len() >= 2).then_some(nodes)
}

/// [`nodes_of`] for `topo`'s devices `gpus`, by their NUMA nodes' CPUs: empty when they are
/// all in one node or one's node is not known (what topod keeps for a job's placement).
pub fn nodes_of_devices<'a>(
    topo: &Topology,
    gpus: impl IntoIterator<Item = &'a crate::topology::IoDevice>,
) -> Vec<(CpuSet, usize)> {
    let nodes: Vec<Option<CpuSet>> =
        gpus.into_iter().map(|d| topo.cpus_near(d, Level::Numa)).collect();
    nodes_of(nodes.iter().map(Option::as_ref)).unwrap_or_default()
}

/// `request` placed so that each NUMA node of its GPUs (`nodes`: the node's CPUs, how many of
/// the job's GPUs are there) has its share of the tasks beside them: the node with `g` of the
/// job's `n` GPUs gets `tasks × g / n` tasks, placed inside its CPUs, node after node. Without
/// it the tasks go anywhere in the nodes' CPUs together, and a node may get more tasks than
/// GPUs while another's GPUs have none beside them (`gpus_per_task` then gives those tasks
/// GPUs of another node). What topod places, and the LSF module scores, for a job whose GPUs
/// lie in several nodes. `None` when a share is not a whole number of tasks, the request binds
/// the job as a whole (MAX_RADIUS beyond what the parts span, `exclusive=(...,injob)`, a
/// static cpuset, memory for the whole job), or a share does not fit in its node: the job is
/// then placed as one.
pub fn place_split(
    model: &HostModel,
    occupancy: &Occupancy,
    request: &Request,
    nodes: &[(CpuSet, usize)],
    strategy: Strategy,
) -> Option<Placement> {
    let whole_job = request.exclusive.is_some_and(|e| e.scope != crate::request::Scope::AllJobs)
        || request.cpuset_name.is_some()
        || request.mem_mib.is_some();
    if whole_job || nodes.len() < 2 {
        return None;
    }
    let tasks = request.tasks? as usize;
    let gpus: usize = nodes.iter().map(|(_, g)| g).sum();
    let mut placed: Vec<CpuSet> = Vec::with_capacity(tasks);
    for (node, count) in nodes {
        let share = tasks * count;
        if share % gpus != 0 || share < gpus {
            return None;
        }
        let part =
            Request { tasks: Some(u32::try_from(share / gpus).ok()?), ..within(request, node)? };
        // Each part against the others' jobs only: the parts lie in different nodes, so they
        // cannot overlap, and one part's exclusive domain (a package both nodes are in) is
        // the job's own, not another job's.
        let p = place::place(model, occupancy, &part, strategy).ok()?;
        placed.extend(p.tasks);
    }
    let whole = place::from_tasks(model, occupancy, request, placed);
    // MAX_RADIUS holds for the job, not only for each part.
    if request.max_radius.is_some_and(|r| whole.metrics.hops > r) {
        return None;
    }
    Some(whole)
}

/// [`place_split`] with best fit, scored as [`place::fit_and_score`] scores: what the LSF
/// module ranks a host by for such a job.
pub fn fit_split(
    model: &HostModel,
    occupancy: &Occupancy,
    request: &Request,
    nodes: &[(CpuSet, usize)],
) -> Option<place::Fit> {
    let p = place_split(model, occupancy, request, nodes, Strategy::BestFit)?;
    Some(place::Fit { score: place::score(&p.metrics), cpus: p.cpus })
}

/// Whether each NUMA node holding some of a job's `gpus` has its share of the job's `tasks`
/// wholly inside it (at least `tasks × g / n` for `g` of the job's `n` GPUs, rounded down): so
/// that each task can use GPUs of its own node. A job with its GPUs in one node is judged by
/// the same rule (all its tasks there).
pub fn tasks_beside_their_gpus(topo: &Topology, gpus: &[usize], tasks: &[CpuSet]) -> bool {
    let mut nodes: Vec<(Option<CpuSet>, usize)> = Vec::new();
    for &g in gpus {
        let near = topo.devices.get(g).and_then(|d| topo.cpus_near(d, Level::Numa));
        match nodes.iter_mut().find(|(n, _)| *n == near) {
            Some((_, count)) => *count += 1,
            None => nodes.push((near, 1)),
        }
    }
    nodes.iter().all(|(node, count)| {
        let Some(node) = node else { return false };
        let beside = tasks.iter().filter(|t| t.is_subset(node)).count();
        beside >= tasks.len() * count / gpus.len().max(1)
    })
}

/// Each task's GPUs: `gpus` (by index in [`Topology::devices`]) shared out `per_task` to each
/// of `tasks` (their CPUs, in task order), each task's the nearest its CPUs. First every task
/// takes GPUs whose NUMA node holds all its CPUs; then the rest go to the tasks still short,
/// each to the one it shares the most CPUs with (NUMA node, then package). `None` when the
/// GPUs are not `per_task` per task.
pub fn gpus_per_task(
    topo: &Topology,
    gpus: &[usize],
    tasks: &[CpuSet],
    per_task: usize,
) -> Option<Vec<Vec<usize>>> {
    if tasks.is_empty() || per_task == 0 || gpus.len() != per_task * tasks.len() {
        return None;
    }
    let near = |g: usize, level| topo.devices.get(g).and_then(|d| topo.cpus_near(d, level));
    let numa: Vec<Option<CpuSet>> = gpus.iter().map(|&g| near(g, Level::Numa)).collect();
    let socket: Vec<Option<CpuSet>> = gpus.iter().map(|&g| near(g, Level::Socket)).collect();
    let mut taken = vec![false; gpus.len()];
    let mut out: Vec<Vec<usize>> = vec![Vec::new(); tasks.len()];
    for (t, cpus) in tasks.iter().enumerate() {
        for (i, node) in numa.iter().enumerate() {
            let local = node.as_ref().is_some_and(|n| cpus.is_subset(n));
            if out[t].len() < per_task && !taken[i] && local {
                taken[i] = true;
                out[t].push(i);
            }
        }
    }
    let shared = |set: &Option<CpuSet>, cpus: &CpuSet| {
        set.as_ref().map_or(0, |s| s.intersection(cpus).len())
    };
    for (t, cpus) in tasks.iter().enumerate() {
        while out[t].len() < per_task {
            let nearness = |i: usize| (shared(&numa[i], cpus), shared(&socket[i], cpus));
            let best = (0..gpus.len())
                .filter(|&i| !taken[i])
                .max_by_key(|&i| (nearness(i), std::cmp::Reverse(i)))?;
            taken[best] = true;
            out[t].push(best);
        }
    }
    Some(
        out.into_iter()
            .map(|mut v| {
                v.sort_unstable();
                v.into_iter().map(|i| gpus[i]).collect()
            })
            .collect(),
    )
}

/// How near a network adapter is to a job ([`nics_near`]), nearest first.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum NicNearness {
    /// Behind the same PCIe switch as one of the job's GPUs: GPU-direct traffic need not cross
    /// the CPU's root complex.
    PcieSwitch,
    /// In the NUMA node of one of the job's GPUs (a job without GPUs: of its CPUs).
    NumaNode,
    /// In the package of one of the job's GPUs (of its CPUs).
    Package,
}

impl NicNearness {
    /// For `topoctl jobs`: "behind its GPUs' PCIe switch".
    pub fn describe(self, with_gpus: bool) -> &'static str {
        match (self, with_gpus) {
            (NicNearness::PcieSwitch, _) => "behind its GPUs' PCIe switch",
            (NicNearness::NumaNode, true) => "in its GPUs' NUMA node",
            (NicNearness::NumaNode, false) => "in its CPUs' NUMA node",
            (NicNearness::Package, true) => "in its GPUs' package",
            (NicNearness::Package, false) => "in its CPUs' package",
        }
    }
}

/// The network adapters nearest a job, by index in [`Topology::devices`] with how near, in
/// index order: for each of its `gpus`, the adapters nearest that GPU (behind its PCIe switch,
/// else in its NUMA node, else in its package); for a job without GPUs, those nearest its `cpus`
/// (in a NUMA node, else a package, they share). Adapters of unknown place are never near.
pub fn nics_near(topo: &Topology, gpus: &[usize], cpus: &CpuSet) -> Vec<(usize, NicNearness)> {
    // Physical adapters of known NUMA node: a node of -1 makes the kernel's `local_cpulist`
    // every CPU (no place at all), and an SR-IOV virtual function is its adapter again.
    let nics: Vec<usize> = (0..topo.devices.len())
        .filter(|&i| {
            let d = &topo.devices[i];
            d.class == DeviceClass::Network
                && d.numa_node.is_some()
                && !d.virtual_function
                && !gpus.contains(&i)
        })
        .collect();
    let mut best: std::collections::BTreeMap<usize, NicNearness> = Default::default();
    let mut keep_nearest = |ranked: Vec<(usize, NicNearness)>| {
        let Some(nearest) = ranked.iter().map(|&(_, r)| r).min() else { return };
        for (nic, rank) in ranked.into_iter().filter(|&(_, r)| r == nearest) {
            let kept = best.entry(nic).or_insert(rank);
            *kept = (*kept).min(rank);
        }
    };
    // Each adapter's node and package CPUs, worked out once (a listing asks for every job). A
    // CPU-less node (memory only, as CXL or a GPU's own) stands for the CPUs nearest it there,
    // which are not its own: a device in it is in no CPUs' node, only near their package.
    let place = |d: &crate::topology::IoDevice| {
        let in_cpu_node = d.numa_node.is_some_and(|n| {
            topo.numa_nodes.iter().any(|node| node.os_index == n && !node.cpus.is_empty())
        });
        let numa = topo.cpus_near(d, Level::Numa).filter(|_| in_cpu_node);
        (numa, topo.cpus_near(d, Level::Socket))
    };
    let nic_places: Vec<_> = nics.iter().map(|&n| place(&topo.devices[n])).collect();
    let same =
        |a: &Option<CpuSet>, b: &Option<CpuSet>| matches!((a, b), (Some(a), Some(b)) if a == b);
    for &g in gpus {
        let Some(gpu) = topo.devices.get(g) else { continue };
        let (_, gpu_socket) = place(gpu);
        let ranked = nics
            .iter()
            .zip(&nic_places)
            .filter_map(|(&n, (_, socket))| {
                let rank = if gpu.switch().is_some() && gpu.shared_bridges(&topo.devices[n]) >= 2 {
                    NicNearness::PcieSwitch
                } else if gpu.numa_node.is_some_and(|node| {
                    topo.devices[n].numa_node == Some(node)
                        && topo.numa_nodes.iter().any(|known| known.os_index == node)
                }) {
                    NicNearness::NumaNode
                } else if same(&gpu_socket, socket) {
                    NicNearness::Package
                } else {
                    return None;
                };
                Some((n, rank))
            })
            .collect();
        keep_nearest(ranked);
    }
    if gpus.is_empty() && !cpus.is_empty() {
        let shares = |set: &Option<CpuSet>| set.as_ref().is_some_and(|near| near.intersects(cpus));
        let ranked = nics
            .iter()
            .zip(&nic_places)
            .filter_map(|(&n, (numa, socket))| {
                if shares(numa) {
                    Some((n, NicNearness::NumaNode))
                } else if shares(socket) {
                    Some((n, NicNearness::Package))
                } else {
                    None
                }
            })
            .collect();
        keep_nearest(ranked);
    }
    best.into_iter().collect()
}

/// Where a job without GPUs should go on a host with GPUs: not on the CPUs that GPU jobs will
/// want, when it fits elsewhere. Keeps, in each NUMA node, `per_gpu` free CPUs for each free GPU
/// near it (the node's highest-numbered free CPUs), and returns `request` kept off them; `None`
/// when nothing need be kept or the rest is empty (then place it as asked).
pub fn away_from_free_gpus(
    topo: &Topology,
    model: &HostModel,
    occupancy: &Occupancy,
    free: &[usize],
    request: &Request,
    per_gpu: usize,
) -> Option<Request> {
    let free_cpus = occupancy.free(model);
    let mut kept = CpuSet::new();
    for node in &model.numa {
        let gpus_here = free
            .iter()
            .filter(|&&g| {
                topo.cpus_near(&topo.devices[g], Level::Numa).is_some_and(|c| c.intersects(node))
            })
            .count();
        let want = gpus_here * per_gpu;
        let here: Vec<u32> = node.intersection(&free_cpus).iter().collect();
        for &cpu in here.iter().rev().take(want) {
            kept.insert(cpu);
        }
    }
    if kept.is_empty() {
        return None;
    }
    within(request, &model.allocatable.difference(&kept))
}

/// A baseline's choice (or topo's, through [`choose`]).
pub fn choose_as(
    policy: GpuPolicy,
    topo: &Topology,
    model: &HostModel,
    occupancy: &Occupancy,
    free: &[usize],
    request: &Request,
    count: usize,
) -> Option<GpuPick> {
    match policy {
        GpuPolicy::Topo => choose(topo, model, occupancy, free, request, count, Strategy::BestFit),
        GpuPolicy::SlurmLike => {
            if free.len() < count {
                return None;
            }
            let placement = place::place(model, occupancy, request, Strategy::FirstFit).ok()?;
            Some(GpuPick { gpus: free[..count].to_vec(), placement })
        }
        GpuPolicy::SingleNumaNode => topo.numa_nodes_with_cpus().find_map(|node| {
            let here: Vec<usize> = free
                .iter()
                .copied()
                .filter(|&g| topo.devices[g].numa_node == Some(node.os_index))
                .collect();
            if here.len() < count {
                return None;
            }
            let inside = within(request, &node.cpus)?;
            let placement = place::place(model, occupancy, &inside, Strategy::BestFit).ok()?;
            Some(GpuPick { gpus: here[..count].to_vec(), placement })
        }),
    }
}

/// Whether every CPU of `cpus` is in a NUMA node one of `gpus` hangs off (for a GPU whose node
/// is not known: near its local CPUs' nodes, see [`Topology::cpus_near`]).
pub fn is_local(topo: &Topology, gpus: &[usize], cpus: &CpuSet) -> bool {
    let mut near = CpuSet::new();
    for &g in gpus {
        match topo.cpus_near(&topo.devices[g], Level::Numa) {
            Some(c) => near.union_with(&c),
            None => return false,
        }
    }
    cpus.is_subset(&near)
}

#[cfg(feature = "sim")]
/// A job of the GPU stream.
#[derive(Debug, Clone)]
pub struct GpuJob {
    /// Its GPUs (0 for a CPU-only job).
    pub gpus: usize,
    /// Its CPUs.
    pub request: Request,
    /// How many arrivals it stays for.
    pub lifetime: u32,
}

/// The cores each GPU has beside it: of every NUMA node with GPUs near it, its cores divided
/// among them, the least over the nodes (at least 1). A job asking that many cores per GPU can
/// always be near its GPUs on an empty host.
pub fn cores_per_gpu(topo: &Topology, model: &HostModel) -> usize {
    let gpus = gpu_indices(topo);
    let tpc = model.threads_per_core.max(1);
    model
        .numa
        .iter()
        .filter_map(|node| {
            let near = gpus
                .iter()
                .filter(|&&g| {
                    topo.cpus_near(&topo.devices[g], Level::Numa)
                        .is_some_and(|c| c.intersects(node))
                })
                .count();
            (near > 0).then(|| node.len() / tpc / near)
        })
        .min()
        .unwrap_or(1)
        .max(1)
}

#[cfg(feature = "sim")]
/// A seeded stream for a host with `gpus` GPUs: half GPU jobs of 1, 2, 4 or 8 GPUs (as many as
/// the host has at most; 1 and 2 the most common) with 1 to `per_gpu` cores per GPU (the host's
/// [`cores_per_gpu`], as a site sets Slurm's `RestrictedCoresPerGPU` or its users'
/// `--cpus-per-gpu`), half CPU-only jobs of 1-16 cores; lifetimes of 1-40 arrivals.
pub fn gpu_stream(gpus: usize, per_gpu: usize, seed: u64, count: usize) -> Vec<GpuJob> {
    let share = per_gpu.max(1) as u64;
    let mut rng = SplitMix::new(seed);
    (0..count)
        .map(|_| {
            let lifetime = 1 + rng.below(40) as u32;
            if gpus > 0 && rng.below(2) == 0 {
                let want = [1usize, 1, 1, 1, 2, 2, 2, 4, 4, 8][rng.below(10) as usize].min(gpus);
                let per_gpu = 1 + rng.below(share) as u32;
                let request = cores(want as u32 * per_gpu);
                GpuJob { gpus: want, request, lifetime }
            } else {
                GpuJob { gpus: 0, request: cores(1 + rng.below(16) as u32), lifetime }
            }
        })
        .collect()
}

#[cfg(feature = "sim")]
/// What one policy did with the GPU stream on one host.
#[derive(Debug, Clone, Serialize)]
pub struct GpuBenchResult {
    /// The host.
    pub topology: String,
    /// The policy.
    pub policy: GpuPolicy,
    /// GPU jobs in the stream.
    pub gpu_jobs: usize,
    /// GPU jobs placed.
    pub placed: usize,
    /// Of those, jobs whose CPUs are all in their GPUs' NUMA nodes.
    pub local: usize,
    /// Of those with two or more GPUs, jobs whose GPUs sit behind one PCIe switch.
    pub one_switch: usize,
    /// Of those with two or more GPUs, jobs whose GPUs are in one NVLink island or xGMI hive.
    pub one_fabric: usize,
    /// Placed GPU jobs whose tasks sit beside their own GPUs ([`tasks_beside_their_gpus`]).
    pub task_local: usize,
    /// Placed GPU jobs with two or more GPUs.
    pub multi: usize,
    /// GPU jobs refused while enough GPUs were free.
    pub refused_gpus_free: usize,
}

#[cfg(feature = "sim")]
impl GpuBenchResult {
    /// Share of placed GPU jobs that are local, in percent.
    pub fn local_pct(&self) -> f64 {
        100.0 * self.local as f64 / self.placed.max(1) as f64
    }
}

#[cfg(feature = "sim")]
/// Replays `stream` on the host with `policy`: before each arrival jobs whose lifetime ended
/// leave, then jobs leave in order of their end until at most 85% of the CPUs are held; a job
/// that cannot be placed is dropped (CPU-only jobs are placed by best-fit under every policy).
pub fn replay_gpus(
    topo: &Topology,
    model: &HostModel,
    stream: &[GpuJob],
    policy: GpuPolicy,
) -> GpuBenchResult {
    let all = gpu_indices(topo);
    let capacity = model.allocatable.len().max(1) as f64;
    // The CPUs kept per free GPU: half the host's share (the stream's jobs take 1 to it).
    let share = (cores_per_gpu(topo, model) / 2).max(1);
    let mut ledger = Ledger::new();
    let mut gpu_free = vec![true; topo.devices.len()];
    let mut running: Vec<(u64, String, Vec<usize>)> = Vec::new();
    let mut r = GpuBenchResult {
        topology: topo.short_name().to_string(),
        policy,
        gpu_jobs: 0,
        placed: 0,
        local: 0,
        one_switch: 0,
        one_fabric: 0,
        task_local: 0,
        multi: 0,
        refused_gpus_free: 0,
    };
    for (i, job) in stream.iter().enumerate() {
        let now = i as u64;
        running.sort_by_key(|(end, _, _)| std::cmp::Reverse(*end));
        while running.last().is_some_and(|(end, _, _)| *end <= now)
            || ledger.occupancy().held.len() as f64 > crate::bench::TARGET_LOAD * capacity
        {
            let Some((_, id, gpus)) = running.pop() else { break };
            let _ = ledger.release(&id);
            for g in gpus {
                gpu_free[g] = true;
            }
        }
        let free: Vec<usize> = all.iter().copied().filter(|&g| gpu_free[g]).collect();
        let occupancy = ledger.occupancy().clone();
        let id = format!("job{i}");
        if job.gpus == 0 {
            // topo keeps CPU-only jobs off the CPUs near free GPUs when they fit elsewhere; the
            // baselines place them as asked.
            let steered = (policy == GpuPolicy::Topo)
                .then(|| away_from_free_gpus(topo, model, &occupancy, &free, &job.request, share))
                .flatten()
                .and_then(|r| place::place(model, &occupancy, &r, Strategy::BestFit).ok());
            let placed = steered.map(Ok).unwrap_or_else(|| {
                place::place(model, &occupancy, &job.request, Strategy::BestFit)
            });
            if let Ok(p) = placed {
                if ledger.allocate(&id, &p, "").is_ok() {
                    running.push((now + u64::from(job.lifetime), id, Vec::new()));
                }
            }
            continue;
        }
        r.gpu_jobs += 1;
        match choose_as(policy, topo, model, &occupancy, &free, &job.request, job.gpus) {
            Some(pick) => {
                r.placed += 1;
                r.local += usize::from(is_local(topo, &pick.gpus, &pick.placement.cpus));
                r.task_local +=
                    usize::from(tasks_beside_their_gpus(topo, &pick.gpus, &pick.placement.tasks));
                if pick.gpus.len() > 1 {
                    r.multi += 1;
                    let first = topo.devices[pick.gpus[0]].switch();
                    r.one_switch += usize::from(
                        first.is_some()
                            && pick.gpus.iter().all(|&g| topo.devices[g].switch() == first),
                    );
                    let island = &topo.devices[pick.gpus[0]].fabric;
                    r.one_fabric += usize::from(
                        island.is_some()
                            && pick.gpus.iter().all(|&g| topo.devices[g].fabric == *island),
                    );
                }
                if ledger.allocate(&id, &pick.placement, "").is_ok() {
                    for &g in &pick.gpus {
                        gpu_free[g] = false;
                    }
                    running.push((now + u64::from(job.lifetime), id, pick.gpus));
                }
            }
            None => r.refused_gpus_free += usize::from(free.len() >= job.gpus),
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_gpus_come_from_one_nvlink_island_before_one_pcie_switch() {
        let (mut topo, model) = host();
        // Node 1: GPUs 2 and 3 behind switch B, 4 on its own port; NVLink joins 3 and 4.
        topo.devices[3].fabric = Some("nvlink:0000:21:00.0".into());
        topo.devices[4].fabric = Some("nvlink:0000:21:00.0".into());
        let none = Occupancy::default();
        let node1: Vec<usize> = vec![2, 3, 4];
        let two = choose(&topo, &model, &none, &node1, &cores(4), 2, Strategy::BestFit).unwrap();
        assert_eq!(two.gpus, [3, 4], "the NVLinked pair, not the pair behind one switch");
        assert!(two.placement.cpus.is_subset(&model.numa[1]));
        // One GPU: an island is kept whole for the jobs that need two.
        let one = choose(&topo, &model, &none, &node1, &cores(1), 1, Strategy::BestFit).unwrap();
        assert_eq!(one.gpus, [2]);
        // Three: no island holds them; the switch's pair and the other, as before.
        let three = choose(&topo, &model, &none, &node1, &cores(4), 3, Strategy::BestFit).unwrap();
        assert_eq!(three.gpus.len(), 3);
        // Islands in an xGMI hive count the same, and the smallest island that holds them wins.
        topo.devices[2].fabric = Some("xgmi:7".into());
        let mixed = choose(&topo, &model, &none, &node1, &cores(4), 2, Strategy::BestFit).unwrap();
        assert_eq!(mixed.gpus, [3, 4]);
    }

    #[test]
    fn a_job_whose_gpus_lie_in_two_nodes_has_each_nodes_share_of_tasks_beside_them() {
        let (topo, model) = host();
        let none = Occupancy::default();
        let all = gpu_indices(&topo);
        // Four tasks of one GPU each: no node has four GPUs, so two come from each node, and
        // two tasks go beside each pair (best fit alone would put all four in one node).
        let request = Request { gpus_per_task: Some(1), ..cores(4) };
        let pick = choose(&topo, &model, &none, &all, &request, 4, Strategy::BestFit).unwrap();
        let nodes: Vec<Option<u32>> =
            pick.gpus.iter().map(|&g| topo.devices[g].numa_node).collect();
        assert_eq!(nodes.iter().filter(|n| **n == Some(0)).count(), 2, "{nodes:?}");
        let tasks = &pick.placement.tasks;
        assert_eq!(tasks.len(), 4);
        assert!(tasks[..2].iter().all(|t| t.is_subset(&model.numa[0])), "{tasks:?}");
        assert!(tasks[2..].iter().all(|t| t.is_subset(&model.numa[1])), "{tasks:?}");
        // So every task has a GPU of its own node.
        let per_task = gpus_per_task(&topo, &pick.gpus, tasks, 1).unwrap();
        for (t, gpus) in per_task.iter().enumerate() {
            assert!(is_local(&topo, gpus, &tasks[t]), "task {t} {:?}: GPUs {gpus:?}", tasks[t]);
        }
        assert_eq!(pick.placement.cpus, CpuSet::union_all(tasks));
        // Eight tasks for four GPUs: four beside each pair.
        let pick = choose(&topo, &model, &none, &all, &cores(8), 4, Strategy::BestFit).unwrap();
        let in_node0 = pick.placement.tasks.iter().filter(|t| t.is_subset(&model.numa[0])).count();
        assert_eq!(in_node0, 4, "{:?}", pick.placement.tasks);
        // Shares that are no whole number of tasks (three tasks, four GPUs): placed as one job.
        let odd = choose(&topo, &model, &none, &all, &cores(3), 4, Strategy::BestFit).unwrap();
        assert_eq!(odd.placement.tasks.len(), 3);
        // MAX_RADIUS=0 holds for the job: not split over the two nodes.
        let tight = Request { max_radius: Some(0), ..cores(4) };
        let pick = choose(&topo, &model, &none, &all, &tight, 4, Strategy::BestFit).unwrap();
        assert_eq!(pick.placement.metrics.hops, 0, "{:?}", pick.placement.tasks);
    }

    #[test]
    fn a_boards_display_adapter_and_quickassist_are_no_jobs_gpus() {
        let device = |class_code: u32, vendor: u16| crate::topology::IoDevice {
            pci_address: "0000:01:00.0".into(),
            class: crate::topology::classify_pci(class_code),
            class_code,
            vendor_id: Some(vendor),
            device_id: None,
            names: Vec::new(),
            numa_node: Some(0),
            local_cpus: CpuSet::new(),
            upstream: Vec::new(),
            virtual_function: false,
            fabric: None,
        };
        assert!(is_for_jobs(&device(0x030200, 0x10de)), "an NVIDIA 3D controller");
        assert!(is_for_jobs(&device(0x030000, 0x1002)), "an AMD VGA GPU");
        assert!(is_for_jobs(&device(0x0b4000, 0x1bcf)), "a NEC vector engine");
        assert!(is_for_jobs(&device(0x120000, 0x1da3)), "a processing accelerator");
        assert!(!is_for_jobs(&device(0x030000, 0x1a03)), "an ASPEED BMC's VGA");
        assert!(!is_for_jobs(&device(0x030000, 0x102b)), "a Matrox board VGA");
        assert!(!is_for_jobs(&device(0x0b4000, 0x8086)), "Intel QuickAssist");
        assert!(!is_for_jobs(&device(0x020000, 0x10de)), "a NIC");
        let model =
            |vendor: u16, id: u16| IoDevice { device_id: Some(id), ..device(0x030000, vendor) };
        assert!(!is_for_jobs(&model(0x1002, 0x515e)), "a board's ATI ES1000");
        assert!(!is_for_jobs(&model(0x1234, 0x1111)), "a virtual machine's standard VGA");
        assert!(!is_for_jobs(&model(0x1af4, 0x1050)), "virtio-gpu");
        assert!(is_for_jobs(&model(0x1002, 0x740f)), "an AMD Instinct GPU");
        let vf = IoDevice { virtual_function: true, ..device(0x030200, 0x10de) };
        assert!(!is_for_jobs(&vf), "an SR-IOV virtual function of a GPU");
    }
    use crate::topology::{IoDevice, SyntheticShape};

    /// Two packages of one NUMA node of 8 one-thread cores; GPUs 0-1 on node 0 behind switch A,
    /// 2-3 on node 1 behind switch B, 4 on node 1 on its own root port.
    fn host() -> (Topology, HostModel) {
        let mut topo = Topology::synthetic(SyntheticShape {
            packages: 2,
            numa_per_package: 1,
            l3_per_numa: 1,
            cores_per_l3: 8,
            threads_per_core: 1,
        });
        let gpu = |address: &str, node: u32, switch: Option<&str>| IoDevice {
            pci_address: address.into(),
            class: DeviceClass::Gpu,
            class_code: 0x030200,
            vendor_id: None,
            device_id: None,
            names: Vec::new(),
            numa_node: Some(node),
            local_cpus: CpuSet::new(),
            upstream: match switch {
                Some(s) => vec!["0000:00:01.0".into(), s.into(), "0000:00:02.0".into()],
                None => vec!["0000:00:03.0".into()],
            },
            virtual_function: false,
            fabric: None,
        };
        topo.devices = vec![
            gpu("0000:10:00.0", 0, Some("A")),
            gpu("0000:11:00.0", 0, Some("A")),
            gpu("0000:20:00.0", 1, Some("B")),
            gpu("0000:21:00.0", 1, Some("B")),
            gpu("0000:30:00.0", 1, None),
        ];
        let model = HostModel::new(&topo, &CpuSet::new()).unwrap();
        (topo, model)
    }

    #[test]
    fn gpus_and_cpus_come_from_one_node_and_two_gpus_from_one_switch() {
        let (topo, model) = host();
        let none = Occupancy::default();
        let all = gpu_indices(&topo);
        // One GPU: the node with the fewest free GPUs that suffice (node 0 has 2, node 1 has 3).
        let one = choose(&topo, &model, &none, &all, &cores(4), 1, Strategy::BestFit).unwrap();
        assert_eq!(one.gpus, [0]);
        assert!(is_local(&topo, &one.gpus, &one.placement.cpus), "{:?}", one.placement.cpus);
        // Two on node 1: the two behind switch B, not the one on its own port.
        let node1: Vec<usize> = vec![4, 2, 3];
        let two = choose(&topo, &model, &none, &node1, &cores(4), 2, Strategy::BestFit).unwrap();
        assert_eq!(two.gpus, [2, 3]);
        assert!(two.placement.cpus.is_subset(&model.numa[1]));
        // Node 0's CPUs all taken: its GPUs do not go with CPUs elsewhere; the job waits.
        let busy = Occupancy { held: model.numa[0].clone(), ..Occupancy::default() };
        assert!(choose(&topo, &model, &busy, &[0, 1], &cores(2), 1, Strategy::BestFit).is_none());
        // Four GPUs: no node has them; two from each, the CPUs in both nodes.
        let four =
            choose(&topo, &model, &none, &[0, 1, 2, 3], &cores(4), 4, Strategy::BestFit).unwrap();
        assert!(is_local(&topo, &four.gpus, &four.placement.cpus));
        assert!(choose(&topo, &model, &none, &[0], &cores(1), 2, Strategy::BestFit).is_none());
    }

    #[test]
    fn gpus_of_unknown_place_are_taken_last_and_only_they_free_the_cpus() {
        let (mut topo, _) = host();
        // GPU 0 of unknown place (`numa_node` -1, as on cloud VMs), first by address.
        let mut unknown = topo.devices[0].clone();
        unknown.pci_address = "0000:05:00.0".into();
        unknown.numa_node = None;
        unknown.upstream = vec!["0000:00:04.0".into()];
        topo.devices.insert(0, unknown);
        let model = HostModel::new(&topo, &CpuSet::new()).unwrap();
        let none = Occupancy::default();
        let near = |g: usize| topo.cpus_near(&topo.devices[g], Level::Numa);
        assert_eq!(near(0), None, "read as unknown, not as node 0");
        // Node 0's CPUs taken: one GPU from each node is needed, not the unknown one.
        let busy = Occupancy { held: model.numa[0].iter().take(6).collect(), ..none.clone() };
        let two =
            choose(&topo, &model, &busy, &[0, 1, 3], &cores(4), 2, Strategy::BestFit).unwrap();
        assert_eq!(two.gpus, [1, 3], "the two of known place");
        assert!(is_local(&topo, &two.gpus, &two.placement.cpus), "{:?}", two.placement.cpus);
        // Three needed, one of unknown place among them: the CPUs may be anywhere free.
        let three =
            choose(&topo, &model, &busy, &[0, 1, 3], &cores(4), 3, Strategy::BestFit).unwrap();
        assert_eq!(three.gpus, [0, 1, 3]);
        assert_eq!(three.placement.cpus.len(), 4);
        // Node 1's CPUs all taken: its GPU cannot have CPUs beside it, the unknown one can.
        let full = Occupancy { held: model.numa[1].clone(), ..none.clone() };
        let one = choose(&topo, &model, &full, &[0, 3], &cores(2), 1, Strategy::BestFit).unwrap();
        assert_eq!(one.gpus, [0], "a GPU of unknown place rather than none");
        assert!(one.placement.cpus.is_subset(&model.numa[0]));
    }

    #[test]
    fn the_nics_nearest_a_job_are_behind_its_gpus_switch_else_in_their_node_else_package() {
        let (mut topo, _) = host();
        let nic = |address: &str, node: Option<u32>, upstream: &[&str]| IoDevice {
            pci_address: address.into(),
            class: DeviceClass::Network,
            class_code: 0x020700,
            vendor_id: None,
            device_id: None,
            names: vec![format!("mlx5_{}", &address[5..7])],
            numa_node: node,
            local_cpus: CpuSet::new(),
            upstream: upstream.iter().map(|s| s.to_string()).collect(),
            virtual_function: false,
            fabric: None,
        };
        // 5: behind switch A with GPUs 0-1; 6: node 1's own root port; 7: place not known.
        topo.devices.push(nic("0000:12:00.0", Some(0), &["0000:00:01.0", "A", "0000:00:05.0"]));
        topo.devices.push(nic("0000:40:00.0", Some(1), &["0000:00:06.0"]));
        topo.devices.push(nic("0000:50:00.0", None, &["0000:00:07.0"]));
        let none = CpuSet::new();
        use NicNearness::*;
        assert_eq!(nics_near(&topo, &[0], &none), [(5, PcieSwitch)]);
        // GPU 2 is behind switch B, which has no NIC: the one in its node.
        assert_eq!(nics_near(&topo, &[2], &none), [(6, NumaNode)]);
        assert_eq!(nics_near(&topo, &[1, 4], &none), [(5, PcieSwitch), (6, NumaNode)]);
        // Without GPUs: by the CPUs' nodes (0-7 node 0, 8-15 node 1).
        let cpus = |list: &str| CpuSet::parse_list(list).unwrap();
        assert_eq!(nics_near(&topo, &[], &cpus("1-2")), [(5, NumaNode)]);
        assert_eq!(nics_near(&topo, &[], &cpus("6-9")), [(5, NumaNode), (6, NumaNode)]);
        // An SR-IOV virtual function of NIC 5 behind the same switch is not another adapter;
        // a NIC given to the job as its device is not its own nearest adapter.
        let mut vf = nic("0000:12:00.1", Some(0), &["0000:00:01.0", "A", "0000:00:05.0"]);
        vf.virtual_function = true;
        topo.devices.push(vf);
        assert_eq!(nics_near(&topo, &[0], &none), [(5, PcieSwitch)]);
        assert_eq!(nics_near(&topo, &[5], &none), []);
        topo.devices.pop();
        // A NIC whose node is -1 is near nothing, even with a `local_cpulist` (the kernel
        // gives every CPU then).
        let mut listed = nic("0000:60:00.0", None, &["0000:00:08.0"]);
        listed.local_cpus = cpus("0-3");
        topo.devices.push(listed);
        assert_eq!(nics_near(&topo, &[], &cpus("1-2")), [(5, NumaNode)]);
        topo.devices.pop();
        // Only the unknown NIC left: nothing is near.
        topo.devices.truncate(5);
        topo.devices.push(nic("0000:50:00.0", None, &["0000:00:07.0"]));
        assert!(nics_near(&topo, &[0], &none).is_empty());
        assert!(nics_near(&topo, &[], &cpus("0-15")).is_empty());
        // A NIC on a CPU-less node (memory only) whose nearest CPUs are node 0's is in no CPUs'
        // node: beside one in node 0 it is not near at all, alone it is in their package.
        topo.devices.truncate(5);
        topo.numa_nodes.push(crate::topology::NumaNode {
            os_index: 2,
            cpus: CpuSet::new(),
            near_cpus: cpus("0-7"),
            memory_bytes: 1 << 30,
            kind: crate::topology::MemoryKind::Dram,
        });
        topo.devices.push(nic("0000:70:00.0", Some(2), &["0000:00:09.0"]));
        assert_eq!(nics_near(&topo, &[0], &none), [(5, Package)]);
        assert_eq!(nics_near(&topo, &[], &cpus("1-2")), [(5, Package)]);
        topo.devices.push(nic("0000:12:00.0", Some(0), &["0000:00:0a.0"]));
        assert_eq!(nics_near(&topo, &[0], &none), [(6, NumaNode)]);
        assert_eq!(nics_near(&topo, &[], &cpus("1-2")), [(6, NumaNode)]);
        // A GPU in that CPU-less node too: the NIC is in its node.
        topo.devices[4].numa_node = Some(2);
        topo.devices[4].upstream = vec!["0000:00:0b.0".into()];
        assert_eq!(nics_near(&topo, &[4], &none), [(5, NumaNode)]);
        // Both on a node the topology does not know (no sys/devices/system/node/node7): not
        // known to be near at all.
        topo.devices[4].numa_node = Some(7);
        topo.devices[5].numa_node = Some(7);
        assert_eq!(nics_near(&topo, &[4], &none), []);
    }

    #[test]
    fn each_task_gets_the_gpus_nearest_its_own_cpus() {
        let (topo, _) = host();
        let cpus = |list: &str| CpuSet::parse_list(list).unwrap();
        // Task 0 on node 1, task 1 on node 0: each gets its own node's GPU, whatever the order.
        let tasks = [cpus("8-9"), cpus("0-1")];
        assert_eq!(gpus_per_task(&topo, &[0, 2], &tasks, 1), Some(vec![vec![2], vec![0]]));
        // Two per task, one task per node.
        let tasks = [cpus("0-3"), cpus("8-11")];
        assert_eq!(
            gpus_per_task(&topo, &[0, 1, 2, 3], &tasks, 2),
            Some(vec![vec![0, 1], vec![2, 3]])
        );
        // A task across both nodes (mostly node 1) takes what is left once the task wholly in
        // node 1 has that node's GPU.
        let tasks = [cpus("7-9"), cpus("10-11")];
        assert_eq!(gpus_per_task(&topo, &[0, 2], &tasks, 1), Some(vec![vec![0], vec![2]]));
        // Both tasks on node 1, one GPU there: one task is left the far one.
        let tasks = [cpus("8-9"), cpus("10-11")];
        assert_eq!(gpus_per_task(&topo, &[0, 4], &tasks, 1), Some(vec![vec![4], vec![0]]));
        // Not n per task: no sharing out.
        assert_eq!(gpus_per_task(&topo, &[0, 1, 2], &tasks, 1), None);
        assert_eq!(gpus_per_task(&topo, &[], &[], 1), None);
    }

    #[test]
    fn a_job_across_nodes_takes_gpus_where_its_cpus_can_go() {
        let (topo, model) = host();
        // Node 0's CPUs all taken; node 0 has GPUs 0 and 1 free, node 1 only GPU 2.
        let full = Occupancy { held: model.numa[0].clone(), ..Occupancy::default() };
        let two =
            choose(&topo, &model, &full, &[0, 1, 2], &cores(2), 2, Strategy::BestFit).unwrap();
        assert_eq!(two.gpus, [0, 2], "one of node 0's and node 1's own");
        assert!(two.placement.cpus.is_subset(&model.numa[1]));
        // Two tasks, one per node: a GPU in each node, not two in one.
        let cpus = CpuSet::parse_list("5-10").unwrap();
        let request = Request { cpu_list: Some(cpus), ..cores(6) };
        let none = Occupancy::default();
        let spread = choose(&topo, &model, &none, &[0, 1, 2, 3], &request, 2, Strategy::BestFit);
        let spread = spread.unwrap();
        assert_eq!(spread.gpus, [0, 2], "{:?}", spread.placement.cpus);
    }

    #[test]
    fn the_baselines_behave_as_slurm_and_kubernetes_do() {
        let (topo, model) = host();
        let none = Occupancy::default();
        let all = gpu_indices(&topo);
        // Slurm-like: GPU by index, cores from the lowest: GPU 2 with cores 0-3 is not local.
        let slurm =
            choose_as(GpuPolicy::SlurmLike, &topo, &model, &none, &[2, 3], &cores(4), 1).unwrap();
        assert_eq!(slurm.gpus, [2]);
        assert!(!is_local(&topo, &slurm.gpus, &slurm.placement.cpus));
        // single-numa-node: 3 GPUs fit no node's GPUs together... node 1 has three.
        let k8s =
            choose_as(GpuPolicy::SingleNumaNode, &topo, &model, &none, &all, &cores(2), 3).unwrap();
        assert_eq!(k8s.gpus, [2, 3, 4]);
        assert!(choose_as(GpuPolicy::SingleNumaNode, &topo, &model, &none, &all, &cores(2), 4)
            .is_none());
    }

    #[cfg(feature = "sim")]
    #[test]
    fn on_the_stream_topo_is_always_local_more_often_than_slurm_and_about_as_often_as_kubernetes() {
        let (topo, model) = host();
        assert_eq!(cores_per_gpu(&topo, &model), 2, "node 1: 8 cores for 3 GPUs");
        let stream = gpu_stream(gpu_indices(&topo).len(), cores_per_gpu(&topo, &model), 7, 400);
        let topo_r = replay_gpus(&topo, &model, &stream, GpuPolicy::Topo);
        let slurm = replay_gpus(&topo, &model, &stream, GpuPolicy::SlurmLike);
        let k8s = replay_gpus(&topo, &model, &stream, GpuPolicy::SingleNumaNode);
        assert!(topo_r.gpu_jobs > 100 && topo_r.placed > 0);
        assert!(topo_r.local_pct() > slurm.local_pct() + 20.0, "{topo_r:?} {slurm:?}");
        // single-numa-node is always local, by refusing what is not; so is topo.
        assert_eq!(k8s.local, k8s.placed);
        assert_eq!(topo_r.local, topo_r.placed, "topo places a GPU job near its GPUs or not yet");
        // Against single-numa-node on this small host it is a near thing (79 against 80 on
        // seed 7): best-fit by spare GPUs is a heuristic. The real machines' figures: README.
        assert!(topo_r.placed + 8 >= k8s.placed, "{topo_r:?} {k8s:?}");
    }
}
