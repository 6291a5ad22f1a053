//! The request language: what a job asks of one host's topology.
//!
//! Two syntaxes arrive from the batch systems, and both normalize into one [`Request`]:
//!
//! - LSF's `CPUSET[KEY=value;...]` (`bsub -extsched`, the queue's `DEFAULT_EXTSCHED` and
//!   `MANDATORY_EXTSCHED`), from the SGI cpuset integration;
//! - LSF's `affinity[...]` resource-requirement section, which is also the value of Slurm's
//!   `--topology=` and PBS's `-l topology=`.
//!
//! A request string may hold one of each (`CPUSET[...] affinity[...]`). A [`Request`] prints back
//! to one canonical string that parses to the same `Request`.
//!
//! - [`parse`] (also `str::parse::<Request>()`): the grammar, the meaning of each part and
//!   topo's extensions (`l3`, `:mem=SIZE`, `|` between `CPUSET_OPTIONS`) are documented on
//!   [`parse`]; in short:
//!
//!   ```text
//!   CPUSET[KEY=value;...]   KEY ∈ CPUSET_TYPE CPUSET_NAME CPU_LIST CPUSET_OPTIONS MAX_RADIUS
//!                                 MAX_CPU_PER_NODE RESUME_OPTION
//!   affinity[pu_type[(n[,same=level][,exclusive=(level[,scope])])][*tasks[-max]]
//!            [:cpubind=level][:membind=localonly|localprefer]
//!            [:distribute=pack|pack(level=n)|balance|any][:mem=SIZE]]
//!   pu_type, level ∈ numa socket core thread mcm(=numa) cpu(=thread) l3
//!   scope ∈ intask (default) injob alljobs
//!   ```
//! - [`merge_extsched`]: the per-keyword queue merge, where an empty value deletes;
//! - `Display` for [`Request`]: the canonical text; [`Request::validate`]: the invariants that
//!   make `parse(&r.to_string()) == Ok(r)`.
//!
//! Errors ([`RequestError`], [`MergeError`]) carry the byte span of the offending text, the text,
//! a message and the accepted keywords.

use crate::cpuset::CpuSet;
use serde::Serialize;

mod canonical;
mod merge;
mod parse;
#[cfg(test)]
mod tests;

pub use merge::{merge_extsched, ExtschedSource, MergeError};
pub use parse::{caret, parse, RequestError, MAX_COUNT, MAX_MEM_MIB, MAX_NAME_LEN, QUOTED_CHARS};

/// A processor-unit type, and the levels that `same=`, `exclusive=` and `cpubind=` name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Level {
    /// A hardware thread (PU). Aliases: `thread`, `cpu`.
    Thread,
    /// A physical core.
    Core,
    /// An L3 cache group (CCX on AMD). topo extension: `l3`.
    L3,
    /// A NUMA node. Aliases: `numa`, `mcm`.
    Numa,
    /// A package. `socket`.
    Socket,
}

/// Who else may share a domain marked exclusive (`exclusive=(level,scope)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scope {
    /// Each unit of a task gets a domain of the level to itself (`intask`). topo enforces it for
    /// every unit of the job, which is stronger than LSF requires but never weaker.
    InTask,
    /// Each task of the job gets its own domains of the level: no two tasks of this job share
    /// one (`injob`; IBM's example `core(2,same=socket,exclusive=(socket,injob))` puts the two
    /// tasks on different sockets). Other jobs may share.
    InJob,
    /// No other job may use the job's domains of that level (`alljobs`).
    AllJobs,
}

/// `exclusive=(level[,scope])`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Exclusive {
    /// The level whose domains are held exclusively.
    pub level: Level,
    /// Against whom.
    pub scope: Scope,
}

/// `membind=`: which memory nodes the job gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MemBind {
    /// All memory nodes, the local ones preferred (LSF's default).
    #[default]
    LocalPrefer,
    /// Only the NUMA nodes local to the chosen CPUs.
    LocalOnly,
}

/// `distribute=`: how tasks spread inside the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Distribute {
    /// No preference (LSF's default): topo uses its best-fit strategy.
    #[default]
    Any,
    /// As close together as possible; `pack(level=n)` requires the whole job inside `n`
    /// domains of `level` or it does not fit.
    Pack(Option<(Level, u32)>),
    /// Spread evenly over the domains of the level the tasks are bound at.
    Balance,
}

/// topo extension, `gpubind=`: how near the GPUs the batch system gave a job its CPUs must be.
/// Without it, a job given GPUs gets CPUs in its GPUs' NUMA nodes when they fit there now, and
/// anywhere else the batch system allows when they do not (best effort).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum GpuBind {
    /// Every CPU in a NUMA node one of its GPUs hangs off, or the job does not fit.
    Numa,
    /// Every CPU in a package (socket) one of its GPUs hangs off, or the job does not fit.
    Socket,
    /// No GPU locality: CPUs anywhere the batch system allows.
    Any,
}

impl GpuBind {
    /// The keyword as the grammar spells it.
    pub fn name(self) -> &'static str {
        match self {
            GpuBind::Numa => "numa",
            GpuBind::Socket => "socket",
            GpuBind::Any => "any",
        }
    }
}

/// `CPUSET_TYPE=`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CpusetType {
    /// A cpuset made for the job (the normal case).
    Dynamic,
    /// An existing, administrator-made cpuset named by `CPUSET_NAME`.
    Static,
    /// No cpuset: the job runs unconfined.
    None,
}

/// One `CPUSET_OPTIONS` flag (names from SGI IRIX cpusets, as LSF used them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum CpusetOption {
    /// `CPUSET_CPU_EXCLUSIVE`: no other job on the job's CPUs or their SMT siblings.
    CpuExclusive,
    /// `CPUSET_MEMORY_LOCAL`: memory only from the nodes local to the CPUs.
    MemoryLocal,
    /// `CPUSET_MEMORY_EXCLUSIVE`: no other job gets those memory nodes.
    MemoryExclusive,
    /// `CPUSET_MEMORY_KERNEL_AVOID`: the kernel avoids the job's memory nodes.
    MemoryKernelAvoid,
    /// `CPUSET_MEMORY_MANDATORY`: allocation fails rather than spill to other nodes.
    MemoryMandatory,
    /// `CPUSET_POLICY_PAGE`: page to swap when the nodes are full.
    PolicyPage,
    /// `CPUSET_POLICY_KILL`: kill the job when the nodes are full.
    PolicyKill,
    /// `CPUSET_EVENT_NOTIFY`: notify on cpuset events.
    EventNotify,
}

/// `RESUME_OPTION=`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum ResumeOption {
    /// `ORIG_CPUS`: try to get the original CPUs back on resume.
    OrigCpus,
}

/// The normalized request: everything a job asks of one host, whichever syntax it came in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Request {
    /// Number of tasks: `*count` in the affinity syntax; `None` means "as many as the batch
    /// system gives" (`bsub -n`, `srun -n`), 1 when nobody says.
    pub tasks: Option<u32>,
    /// topo extension, malleable jobs: `*min-max` makes `tasks` the least number of tasks the
    /// job runs with and this the most; topod may grow or shrink the job within the range while
    /// it runs (`resize`, equipartition). `None` for a rigid job. Always larger than `tasks`.
    pub tasks_max: Option<u32>,
    /// The unit each task asks for (`core` in `core(2)`); `Thread` for CPUSET requests.
    pub unit: Level,
    /// Units per task (`2` in `core(2)`).
    pub units_per_task: u32,
    /// `same=`: each task's units lie inside one domain of this level.
    pub same: Option<Level>,
    /// `exclusive=(level,scope)`.
    pub exclusive: Option<Exclusive>,
    /// `cpubind=`: the level tasks are bound at.
    pub cpubind: Option<Level>,
    /// `membind=`.
    pub membind: MemBind,
    /// `distribute=`.
    pub distribute: Distribute,
    /// `CPUSET_TYPE=`.
    pub cpuset_type: Option<CpusetType>,
    /// `CPUSET_NAME=`: the static cpuset to run in.
    pub cpuset_name: Option<String>,
    /// `CPU_LIST=`: only these CPUs may be used.
    pub cpu_list: Option<CpuSet>,
    /// `MAX_RADIUS=`: largest NUMA distance allowed between any two of the job's NUMA nodes,
    /// in hops where a hop is one step of the SLIT above local (see `place`).
    pub max_radius: Option<u32>,
    /// `MAX_CPU_PER_NODE=`: at most this many CPUs from any one NUMA node.
    pub max_cpu_per_node: Option<u32>,
    /// `CPUSET_OPTIONS=`.
    pub cpuset_options: Vec<CpusetOption>,
    /// `RESUME_OPTION=`.
    pub resume_option: Option<ResumeOption>,
    /// topo extension: memory in MiB the job needs from its memory nodes.
    pub mem_mib: Option<u64>,
    /// topo extension, `gpubind=`: how near its GPUs the job's CPUs must be; `None`: near
    /// them when they fit there (see [`GpuBind`]).
    pub gpubind: Option<GpuBind>,
    /// topo extension, `gpus=`: GPUs per task, for topod to choose (with the CPUs beside
    /// them) where the batch system does not say which GPUs a job has.
    pub gpus_per_task: Option<u32>,
}

impl Default for Request {
    fn default() -> Self {
        Self {
            tasks: None,
            tasks_max: None,
            unit: Level::Thread,
            units_per_task: 1,
            same: None,
            exclusive: None,
            cpubind: None,
            membind: MemBind::LocalPrefer,
            distribute: Distribute::Any,
            cpuset_type: None,
            cpuset_name: None,
            cpu_list: None,
            max_radius: None,
            max_cpu_per_node: None,
            cpuset_options: Vec::new(),
            resume_option: None,
            mem_mib: None,
            gpubind: None,
            gpus_per_task: None,
        }
    }
}

impl Request {
    /// A plain request for `n` hardware threads, as a slot-counting scheduler would make.
    pub fn threads(n: u32) -> Self {
        Self { tasks: Some(n), ..Self::default() }
    }

    /// The level at which the job must not share domains with other jobs (`alljobs`, or
    /// `CPUSET_CPU_EXCLUSIVE`, which means no SMT sibling shared with another job).
    pub fn exclusive_level(&self) -> Option<Level> {
        match self.exclusive {
            Some(Exclusive { level, scope: Scope::AllJobs }) => Some(level),
            _ if self.cpuset_options.contains(&CpusetOption::CpuExclusive) => Some(Level::Core),
            _ => None,
        }
    }

    /// The level at which the tasks of this job must not share domains (`injob`).
    pub fn task_spread_level(&self) -> Option<Level> {
        match self.exclusive {
            Some(Exclusive { level, scope: Scope::InJob }) => Some(level),
            _ => None,
        }
    }

    /// The level at which every unit must have a domain to itself (`intask`).
    pub fn unit_spread_level(&self) -> Option<Level> {
        match self.exclusive {
            Some(Exclusive { level, scope: Scope::InTask }) => Some(level),
            _ => None,
        }
    }

    /// How many GPUs a `gpus=` request asks for in all (`gpus=` per task times its tasks, one
    /// task where it gives none); `None` without `gpus=`.
    pub fn gpus_wanted(&self) -> Option<usize> {
        let per_task = self.gpus_per_task?;
        Some(per_task as usize * self.tasks.unwrap_or(crate::place::DEFAULT_TASKS) as usize)
    }

    /// Whether the job is malleable (`*min-max`): topod may resize it within its range.
    pub fn is_malleable(&self) -> bool {
        self.tasks_max.is_some()
    }

    /// The task range `min..=max` (`max == min` for a rigid job), with the default task count
    /// where none is given.
    pub fn task_range(&self) -> (u32, u32) {
        let min = self.tasks.unwrap_or(1);
        (min, self.tasks_max.unwrap_or(min).max(min))
    }

    /// Whether the memory nodes are limited to those local to the CPUs.
    pub fn memory_local_only(&self) -> bool {
        self.membind == MemBind::LocalOnly
            || self.cpuset_options.contains(&CpusetOption::MemoryLocal)
            || self.cpuset_options.contains(&CpusetOption::MemoryMandatory)
    }
}
