//! Placement: which CPUs and memory nodes a job gets on one host.
//!
//! Everything here is a pure function of a [`HostModel`] (the hardware graph, prepared once), an
//! [`Occupancy`] (which CPUs other jobs hold or fence off) and a [`Request`]. The host daemon
//! calls it to allocate; the cluster-side plug-ins call the very same function on a cached
//! occupancy to decide whether a host fits and how well ([`fit_and_score`]), so cluster and host
//! never disagree.
//!
//! ## How a request becomes a placement
//!
//! 1. **Available CPUs**: allocatable, not held, not fenced by another job's exclusive domain,
//!    inside `CPU_LIST` if given. With `exclusive=(level,..)` (or `CPUSET_CPU_EXCLUSIVE`, which
//!    means `exclusive=(core,alljobs)`), only domains of that level that are wholly free count.
//! 2. **Units**: a `thread` unit is one available CPU; a `core`/`l3`/`numa`/`socket` unit is such
//!    a domain whose every allocatable CPU is available.
//! 3. **Tasks**: `tasks` × `units_per_task` units; with `same=level` each task's units lie inside
//!    one domain of that level. `MAX_CPU_PER_NODE` caps the CPUs taken from any NUMA node, and
//!    `MAX_RADIUS` bounds the NUMA distance (in hops) between the job's nodes.
//! 4. **The strategy** decides where, walking the placement tree of the model (see
//!    [`model`]); the strategies are described on [`Strategy`].
//! 5. **Binding**: `cpubind=level` binds each task to the job's CPUs in the domains of that level
//!    its own CPUs touch (`Placement::bind`); `distribute=balance` makes best-fit spread the
//!    tasks evenly (the balance strategy); `pack` and `any` are what best-fit does.
//! 6. **Memory**: `membind=localonly` (or `CPUSET_MEMORY_LOCAL`/`_MANDATORY`) gives the NUMA
//!    nodes local to the chosen CPUs plus the CPU-less nodes (HBM, GPU memory) nearest to them;
//!    otherwise every allowed memory node.

pub mod baseline;
pub mod engine;
pub mod metrics;
pub mod model;

pub use metrics::{HostMetrics, PlacementMetrics};
pub use model::{HostModel, ModelError};

use crate::cpuset::CpuSet;
use crate::request::{Distribute, Level, Request};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Which CPUs are taken on a host, as placement sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Occupancy {
    /// CPUs held by jobs.
    pub held: CpuSet,
    /// CPUs not held but unusable by other jobs: the rest of an exclusive job's cores/domains.
    pub fenced: CpuSet,
}

impl Occupancy {
    /// CPUs of `model` that a new job may use.
    pub fn free(&self, model: &HostModel) -> CpuSet {
        let mut f = model.allocatable.difference(&self.held);
        f.difference_with(&self.fenced);
        f
    }
}

/// A placement strategy.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// The default. Put the job in the smallest, tightest domain that holds it (the domain with
    /// the fewest free units that still fits, so large free blocks survive); when it must span,
    /// take the set of domains with the fewest members and the smallest NUMA distance between
    /// them, consuming the fuller ones first.
    BestFit,
    /// Fill the fullest domains first at every level, spilling into the next when one is full.
    Pack,
    /// Spread the job's units evenly over the domains at every level.
    Balance,
    /// Topology-blind: the lowest-numbered available units, as a scheduler that counts slots.
    FirstFit,
    /// Split the job into power-of-two blocks and put each block in the tightest tree domain
    /// that holds it (after the Multiple Buddy Strategy / Modified 2-D Buddy allocators).
    Buddy,
    /// Baseline: Kubernetes CPU manager static policy, `takeByTopologyNUMAPacked`.
    K8sStatic,
    /// Baseline: Slurm `select/cons_tres` block distribution (fewest sockets, tightest socket).
    SlurmBlock,
}

impl Strategy {
    /// Every strategy, ours first, then the baselines.
    pub const ALL: [Strategy; 7] = [
        Strategy::BestFit,
        Strategy::Pack,
        Strategy::Balance,
        Strategy::FirstFit,
        Strategy::Buddy,
        Strategy::K8sStatic,
        Strategy::SlurmBlock,
    ];

    /// The name used on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::BestFit => "best-fit",
            Strategy::Pack => "pack",
            Strategy::Balance => "balance",
            Strategy::FirstFit => "first-fit",
            Strategy::Buddy => "buddy",
            Strategy::K8sStatic => "k8s-static",
            Strategy::SlurmBlock => "slurm-block",
        }
    }

    /// Whether the strategy honours the shape of a request (`same=`, `MAX_RADIUS`,
    /// `MAX_CPU_PER_NODE`). The topology-blind one and the baselines only place a count of CPUs
    /// (whole cores where the request asks for cores or exclusivity).
    pub fn honours_shape(self) -> bool {
        matches!(self, Strategy::BestFit | Strategy::Pack | Strategy::Balance | Strategy::Buddy)
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown strategy name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown placement strategy {0:?}; expected one of best-fit, pack, balance, first-fit, buddy, k8s-static, slurm-block")]
pub struct UnknownStrategy(pub String);

impl FromStr for Strategy {
    type Err = UnknownStrategy;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Strategy::ALL
            .into_iter()
            .find(|st| st.name() == s)
            .ok_or_else(|| UnknownStrategy(s.to_string()))
    }
}

impl<'de> serde::Deserialize<'de> for Strategy {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// Where a job goes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Placement {
    /// Every CPU of the job.
    pub cpus: CpuSet,
    /// The CPUs of each task, in task order.
    pub tasks: Vec<CpuSet>,
    /// The CPUs each task is bound to: its own CPUs, or with `cpubind=level` the job's CPUs in
    /// the domains of that level its CPUs touch.
    pub bind: Vec<CpuSet>,
    /// Memory nodes (OS ids) the job may allocate from.
    pub mems: CpuSet,
    /// CPUs other jobs may no longer use because this job holds their domain exclusively.
    pub fenced: CpuSet,
    /// How good it is.
    pub metrics: PlacementMetrics,
}

/// Why a job does not fit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaceError {
    /// Fewer units are free than the job needs.
    #[error("needs {needed} {unit}(s) but only {free} are free{detail}")]
    NotEnoughFree {
        /// Units needed.
        needed: usize,
        /// Units free (in the request's unit, after exclusivity and CPU_LIST).
        free: usize,
        /// The unit.
        unit: &'static str,
        /// More context.
        detail: String,
    },
    /// Enough units are free, but not in the shape the request asks for.
    // "N needed": N is what the job asks, not what is free (as "N are free" read).
    #[error(
        "{needed} {unit}(s) needed and as many are free, but not in the requested shape: {why}"
    )]
    Shape {
        /// Units needed.
        needed: usize,
        /// The unit.
        unit: &'static str,
        /// Which constraint could not be met.
        why: String,
    },
    /// The request can never fit this host, even empty.
    #[error("can never fit this host: {0}")]
    Impossible(String),
}

impl PlaceError {
    /// Whether the host had enough free units and failed only on shape: the "rejected while
    /// free" case that fragmentation causes.
    pub fn rejected_while_free(&self) -> bool {
        matches!(self, PlaceError::Shape { .. })
    }
}

/// Default number of tasks when neither the request nor the batch system says.
pub const DEFAULT_TASKS: u32 = 1;

/// Places `request` on the host described by `model` with the given occupancy.
pub fn place(
    model: &HostModel,
    occupancy: &Occupancy,
    request: &Request,
    strategy: Strategy,
) -> Result<Placement, PlaceError> {
    let job = engine::JobShape::new(model, occupancy, request)?;
    // `distribute=balance` asks the default strategy to spread; `pack` and `any` are what
    // best-fit does anyway.
    let strategy = match (strategy, request.distribute) {
        (Strategy::BestFit, Distribute::Balance) => Strategy::Balance,
        (s, _) => s,
    };
    let chosen = match strategy {
        Strategy::K8sStatic => baseline::k8s_static(model, &job)?,
        Strategy::SlurmBlock => baseline::slurm_block(model, &job)?,
        Strategy::FirstFit => engine::first_fit(model, &job)?,
        Strategy::BestFit | Strategy::Pack | Strategy::Balance | Strategy::Buddy => {
            engine::place_shaped(model, &job, strategy)?
        }
    };
    Ok(finish(model, occupancy, request, &job, chosen))
}

/// Score of a placement: lower is better. Extra NUMA nodes beyond the minimum weigh most, then
/// extra L3 groups, then distance, then free whole L3 groups the job breaks into.
pub fn score(m: &PlacementMetrics) -> u64 {
    let extra_numa = (m.numa_nodes.saturating_sub(m.min_numa_nodes)) as u64;
    let extra_l3 = (m.l3_groups.saturating_sub(m.min_l3_groups)) as u64;
    extra_numa * 10_000
        + extra_l3 * 1_000
        + u64::from(m.hops) * 100
        + m.free_l3_broken as u64 * 10
        + m.smt_shared as u64
}

/// What a cluster-side plug-in asks of a host: does the job fit, and how well.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fit {
    /// The score of the placement the host would make (lower is better).
    pub score: u64,
    /// The CPUs it would get.
    pub cpus: CpuSet,
}

/// Fit-and-score on a host summary: exactly what [`place`] with best-fit would do on that host.
pub fn fit_and_score(
    model: &HostModel,
    occupancy: &Occupancy,
    request: &Request,
) -> Result<Fit, PlaceError> {
    let p = place(model, occupancy, request, Strategy::BestFit)?;
    Ok(Fit { score: score(&p.metrics), cpus: p.cpus })
}

/// A job's CPUs split into its tasks as its request shapes them (each task `units_per_task`
/// whole units of the request's level, nearest first, inside one domain of its `same=` level),
/// for a job whose tasks were not recorded (recovered from its cgroup alone). `None` when the
/// CPUs do not divide so: a unit cut short, units left over, or a task count outside the
/// request's range; such a job cannot be resized, since its tasks are not known.
pub fn split_into_tasks(
    model: &HostModel,
    request: &Request,
    cpus: &CpuSet,
) -> Option<Vec<CpuSet>> {
    let mut units: Vec<CpuSet> = Vec::new();
    // Threads are units of their own (the model keeps no domain list for them).
    let threads: Vec<CpuSet>;
    let domains = if request.unit == Level::Thread {
        threads = cpus.iter().map(|c| CpuSet::from_iter([c])).collect();
        &threads[..]
    } else {
        model.domains(request.unit)
    };
    for domain in domains {
        let inside = domain.intersection(cpus);
        if inside.is_empty() {
            continue;
        }
        if inside != *domain {
            return None;
        }
        units.push(inside);
    }
    if units.is_empty() || CpuSet::union_all(&units) != *cpus {
        return None;
    }
    // Nearest first (socket, NUMA node, L3 group, core, then CPU number), so that a task's units
    // are neighbours however the machine numbers its CPUs (SMT siblings are often numbered
    // far apart, sockets alternately).
    let key = |unit: &CpuSet| {
        let cpu = unit.iter().next().unwrap_or(0);
        let at = |level| model.domain_of(level, cpu);
        (at(Level::Socket), at(Level::Numa), at(Level::L3), at(Level::Core), cpu)
    };
    units.sort_by_key(key);
    let per_task = request.units_per_task.max(1) as usize;
    if units.len() % per_task != 0 {
        return None;
    }
    let tasks: Vec<CpuSet> = units.chunks(per_task).map(CpuSet::union_all).collect();
    let (min, max) = request.task_range();
    if !(min as usize..=max as usize).contains(&tasks.len()) {
        return None;
    }
    if let Some(level) = request.same {
        if tasks.iter().any(|t| model.single_domain(level, t).is_none()) {
            return None;
        }
    }
    Some(tasks)
}

/// Where a running malleable job goes when it is resized to `new_tasks` tasks.
///
/// `occupancy` is the host's, *including* the job; `current` is the job's tasks. A shrink keeps
/// the first `new_tasks` tasks where they are (the job's threads on the others are moved by the
/// kernel onto the CPUs it keeps). A grow keeps every task where it is and places the new ones
/// in free CPUs with the job's own request (its shape per task, `injob` spread against its own
/// tasks, exclusivity), as near as best-fit puts them; when that cannot be done in the request's
/// shape (`pack(level=n)` broken, say) the whole job is placed again, which may move its tasks.
/// The answer's CPUs, fence and memory nodes are for the whole resized job.
pub fn resize(
    model: &HostModel,
    occupancy: &Occupancy,
    request: &Request,
    current: &[CpuSet],
    new_tasks: u32,
    strategy: Strategy,
) -> Result<Placement, PlaceError> {
    let new_tasks = new_tasks as usize;
    if new_tasks == 0 {
        return Err(PlaceError::Impossible("a job keeps at least one task".into()));
    }
    let own = CpuSet::union_all(current);
    let own_fence = match request.exclusive_level() {
        Some(level) => model.closure(level, &own).difference(&own),
        None => CpuSet::new(),
    };
    let mut without = occupancy.clone();
    without.held.difference_with(&own);
    without.fenced.difference_with(&own_fence);
    let fixed = Request { tasks: Some(new_tasks as u32), tasks_max: None, ..request.clone() };
    if new_tasks <= current.len() {
        return Ok(finish_tasks(model, &without, request, current[..new_tasks].to_vec()));
    }
    let extra = Request { tasks: Some((new_tasks - current.len()) as u32), ..fixed.clone() };
    let mut around = without.clone();
    around.held.union_with(&own);
    if let Some(level) = request.task_spread_level() {
        around.fenced.union_with(&model.closure(level, &own).difference(&own));
    }
    if let Some(level) = request.unit_spread_level() {
        around.fenced.union_with(&model.closure(level, &own).difference(&own));
    }
    if let Ok(more) = place(model, &around, &extra, strategy) {
        let mut tasks = current.to_vec();
        tasks.extend(more.tasks);
        let grown = finish_tasks(model, &without, request, tasks);
        let packed = match request.distribute {
            Distribute::Pack(Some((level, n))) => {
                let domains = model.domains(level);
                let touched = domains.iter().filter(|d| d.intersects(&grown.cpus)).count();
                level == Level::Thread || touched <= n as usize
            }
            _ => true,
        };
        if packed {
            return Ok(grown);
        }
    }
    place(model, &without, &fixed, strategy)
}

/// [`finish`] for tasks chosen outside the engine (a resize).
fn finish_tasks(
    model: &HostModel,
    occupancy: &Occupancy,
    request: &Request,
    tasks: Vec<CpuSet>,
) -> Placement {
    let cpus = CpuSet::union_all(&tasks);
    let fenced = match request.exclusive_level() {
        Some(level) => model.closure(level, &cpus).difference(&cpus),
        None => CpuSet::new(),
    };
    let mems = if request.memory_local_only() {
        model.local_mems_with_cpuless(&cpus)
    } else {
        model.all_mems.clone()
    };
    let metrics = PlacementMetrics::measure(model, occupancy, &cpus);
    let bind = match request.cpubind {
        Some(level) if level != Level::Thread => {
            tasks.iter().map(|t| model.closure(level, t).intersection(&cpus)).collect()
        }
        _ => tasks.clone(),
    };
    Placement { cpus, tasks, bind, mems, fenced, metrics }
}

/// The placement of `request` made of `tasks` placed already (each a free part of `occupancy`),
/// as [`place`] would give it: the job's CPUs, fences, memory nodes, bindings and metrics. For
/// a job placed in parts (`gpus::choose_among` places each NUMA node's share of the tasks
/// beside that node's GPUs).
pub fn from_tasks(
    model: &HostModel,
    occupancy: &Occupancy,
    request: &Request,
    tasks: Vec<CpuSet>,
) -> Placement {
    finish_tasks(model, occupancy, request, tasks)
}

fn finish(
    model: &HostModel,
    occupancy: &Occupancy,
    request: &Request,
    job: &engine::JobShape,
    tasks: Vec<CpuSet>,
) -> Placement {
    debug_assert_eq!(job.exclusive, request.exclusive_level());
    finish_tasks(model, occupancy, request, tasks)
}

/// A unit of a level, for messages: what one unit of a request is.
pub(crate) fn unit_name(level: Level) -> &'static str {
    match level {
        Level::Thread => "thread",
        Level::Core => "whole core",
        Level::L3 => "whole L3 group",
        Level::Numa => "whole NUMA node",
        Level::Socket => "whole socket",
    }
}

/// A domain of a level, for messages.
pub(crate) fn domain_name(level: Level) -> &'static str {
    match level {
        Level::Thread => "thread",
        Level::Core => "core",
        Level::L3 => "L3 group",
        Level::Numa => "NUMA node",
        Level::Socket => "socket",
    }
}

#[cfg(test)]
mod tests;
