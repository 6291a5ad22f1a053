//! The ledger: who holds what on one host.
//!
//! Invariants, checked on every change and by property tests over random sequences:
//! - no CPU is held by two jobs;
//! - no job holds a CPU that another job fences (the rest of an exclusive job's core/domain),
//!   and no CPU is fenced twice;
//! - `occupancy()` is exactly the union of what the jobs hold and fence.
//!
//! A suspended job (frozen by the kernel's freezer) keeps its allocation but runs nothing, so
//! its CPUs are not in the occupancy: they may be *lent* to other jobs, and the ledger says who
//! borrows what from whom ([`Ledger::lent`]). It runs again ([`Ledger::resume`]) only on CPUs no
//! running job holds or fences, so no CPU ever runs two jobs at once.
//!
//! A gang-scheduled job (time slicing, see `crate::policy::Gang`) has a row. It shares CPUs with
//! gang jobs of other rows and takes turns with them: between its slices it is *frozen by
//! slicing*, out of the occupancy like a suspended job. Placement sees each row on its own
//! ([`Ledger::occupancy_for`]): a job of row r avoids the jobs that are not gang-scheduled and
//! the gang jobs of row r, running or frozen; a job that is not gang-scheduled avoids every job.
//! So two jobs of one row never share a CPU, and a job that runs through every slice never
//! shares one with anybody.
//!
//! A refused change leaves the ledger as it was.

use crate::cpuset::CpuSet;
use crate::place::{Occupancy, Placement};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What one job holds.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    /// The job id as the batch system names it.
    pub job: String,
    /// Its CPUs.
    pub cpus: CpuSet,
    /// Its CPUs per task.
    pub tasks: Vec<CpuSet>,
    /// Its memory nodes (OS ids).
    pub mems: CpuSet,
    /// CPUs it keeps other jobs off (exclusive).
    pub fenced: CpuSet,
    /// The canonical request string it was placed for.
    pub request: String,
    /// Its row, when gang-scheduled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gang_row: Option<u32>,
}

/// Where a job is in its life, as `list` shows it.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Allocated; its processes (if any) run.
    Running,
    /// Its release is under way: its processes are being killed, and its CPUs are held until
    /// its cgroup is gone (a suspended job being released holds none: its CPUs may stay lent,
    /// `lent_to`).
    Releasing,
    /// Frozen by `suspend`: its processes and memory stay, its CPUs may be lent to other jobs
    /// until `resume`.
    Suspended,
    /// Gang-scheduled and frozen until its row's slice (or until the jobs on its CPUs stop).
    Frozen,
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            JobState::Running => "running",
            JobState::Releasing => "releasing",
            JobState::Suspended => "suspended",
            JobState::Frozen => "frozen",
        })
    }
}

/// One job as `list` reports it: its allocation, its state and its owner.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobView {
    /// What it holds.
    #[serde(flatten)]
    pub allocation: Allocation,
    /// Where it is in its life (older topods did not say: running).
    #[serde(default = "running")]
    pub state: JobState,
    /// The uid that may move its own processes in, if one was given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_uid: Option<u32>,
    /// A suspended job: its CPUs that running jobs borrow now, by borrower.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub lent_to: BTreeMap<String, CpuSet>,
    /// A running job: its CPUs that belong to suspended jobs, by owner.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub borrowed_from: BTreeMap<String, CpuSet>,
    /// Set once topod's sampler has found the job mis-sized (after its settling time): its
    /// threads keep more CPUs busy than it was given, or it leaves most of them idle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missized: Option<Missized>,
    /// A job topod suspended to start this other one: topod resumes it itself once that one
    /// has ended and its CPUs are free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preempted_by: Option<String>,
    /// The batch queue its allocate gave (Slurm's partition, LSF's and PBS's queue): prime-time
    /// pools and `gang_prime_queues` admit by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    /// The prime-time pool its allocate named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// A malleable job's ceiling from its last `resize`: equipartition grows it no further.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks_cap: Option<u32>,
    /// Suspended by the batch system itself (Slurm's suspend preemption or gang scheduling),
    /// which stopped it: topod did not freeze it, and lends its CPUs only to the job the batch
    /// system starts on them.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub batch_suspended: bool,
    /// The GPUs (or other PCI devices) the batch system gave it, and how near its CPUs they are.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<JobGpu>,
    /// The network adapters nearest it ([`crate::gpus::nics_near`]): behind its GPUs' PCIe
    /// switch, else in their NUMA node or package; a job without GPUs, in its CPUs' NUMA node or
    /// package. Empty on a host whose adapters' places are not known.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nics: Vec<JobNic>,
    /// A job of several tasks asking `gpus=n` per task: each task's GPUs (PCI addresses), in
    /// task order, the nearest its own CPUs ([`crate::gpus::gpus_per_task`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub task_gpus: Vec<Vec<String>>,
}

/// A network adapter near a job, as `list` reports it.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobNic {
    /// Its PCI address.
    pub pci_address: String,
    /// The names the OS gives it: its network interfaces (`ib0`, `eth2`), then its RDMA device
    /// (`mlx5_0`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub names: Vec<String>,
    /// How near.
    pub near: crate::gpus::NicNearness,
}

/// A GPU a job was given, as `list` reports it.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobGpu {
    /// Its PCI address.
    pub pci_address: String,
    /// The first name the OS gives it (`card1`), when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The NUMA node it hangs off, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// The largest NUMA distance (SLIT; 10 = local) between it and the CPUs of the job's tasks
    /// that use it (`JobView::task_gpus`), else all the job's CPUs; `None` when its node is
    /// not known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distance: Option<u32>,
    /// The host no longer has it (topod restarted on a host whose devices changed).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gone: bool,
    /// Its NVLink island or xGMI hive (`topology::IoDevice::fabric`), when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fabric: Option<String>,
}

/// A job that does not use what it was given, as topod's sampler judged it.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Missized {
    /// Which way.
    pub kind: MissizedKind,
    /// One line for a person: the figures it was judged on.
    pub reason: String,
}

/// Which way a job is mis-sized.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissizedKind {
    /// More threads runnable than CPUs given: it would run faster on more CPUs, or it starts
    /// more threads than it asked for.
    Busy,
    /// Most of its CPUs idle: it asked for more than it uses.
    Idle,
}

impl MissizedKind {
    /// `busy` or `idle`.
    pub fn as_str(self) -> &'static str {
        match self {
            MissizedKind::Busy => "busy",
            MissizedKind::Idle => "idle",
        }
    }
}

fn running() -> JobState {
    JobState::Running
}

/// A change the ledger refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    /// The job already holds an allocation.
    #[error("job {0} already holds CPUs {1}")]
    AlreadyAllocated(String, String),
    /// Some of the CPUs are held by other jobs.
    #[error("CPUs {cpus} requested for job {job} are held by job {holder}")]
    Conflict {
        /// The job asking.
        job: String,
        /// The CPUs in conflict, in list form.
        cpus: String,
        /// A job holding or fencing them.
        holder: String,
    },
    /// No such job.
    #[error("job {0} holds nothing on this host")]
    UnknownJob(String),
    /// An allocation with no CPU.
    #[error("job {0}: an allocation needs at least one CPU")]
    Empty(String),
    /// A gang operation on a job that is not gang-scheduled.
    #[error("job {0} is not gang-scheduled")]
    NotGang(String),
    /// A move the ledger cannot make, and why.
    #[error("job {0} cannot be moved: {1}")]
    Moving(String, &'static str),
    /// Suspend of a job already suspended, or resume of one that is not.
    #[error("job {job} is {state}")]
    WrongState {
        /// The job.
        job: String,
        /// What it is.
        state: JobState,
    },
}

/// Whether `a` and `b` hold or fence any CPU in common (fences may meet fences: two exclusive
/// jobs' fences never overlap, as placement keeps them apart).
fn clash(a: &Allocation, b: &Allocation) -> bool {
    a.cpus.intersects(&b.cpus) || a.cpus.intersects(&b.fenced) || a.fenced.intersects(&b.cpus)
}

/// CPUs a running job borrows from a suspended one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Loan {
    /// The suspended owner.
    pub owner: String,
    /// The running borrower.
    pub holder: String,
    /// The CPUs.
    pub cpus: CpuSet,
}

/// Who holds what on one host.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Ledger {
    jobs: BTreeMap<String, Allocation>,
    /// Suspended jobs: not in the occupancy (see the module documentation).
    suspended: BTreeMap<String, Allocation>,
    /// Gang jobs frozen until their slice: not in the occupancy either.
    gang_frozen: BTreeMap<String, Allocation>,
    occupancy: Occupancy,
    /// Bumped on every change, so that caches can tell a stale copy.
    generation: u64,
}

impl Ledger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `placement` for `job`.
    pub fn allocate(
        &mut self,
        job: &str,
        placement: &Placement,
        request: &str,
    ) -> Result<&Allocation, LedgerError> {
        self.insert(Allocation {
            job: job.to_string(),
            cpus: placement.cpus.clone(),
            tasks: placement.tasks.clone(),
            mems: placement.mems.clone(),
            fenced: placement.fenced.clone(),
            request: request.to_string(),
            gang_row: None,
        })
    }

    /// Records an allocation (also used when rebuilding the ledger from what exists).
    pub fn insert(&mut self, alloc: Allocation) -> Result<&Allocation, LedgerError> {
        self.check_new(&alloc)?;
        // The occupancy answers "is anything in the way" in a few word operations; only when
        // something is do we look for whom, to name the holder.
        let in_way = alloc.cpus.intersects(&self.occupancy.held)
            || alloc.cpus.intersects(&self.occupancy.fenced)
            || alloc.fenced.intersects(&self.occupancy.held)
            || alloc.fenced.intersects(&self.occupancy.fenced);
        if in_way {
            for other in self.jobs.values() {
                let mut clash = alloc.cpus.intersection(&other.cpus);
                clash.union_with(&alloc.cpus.intersection(&other.fenced));
                clash.union_with(&alloc.fenced.intersection(&other.cpus));
                clash.union_with(&alloc.fenced.intersection(&other.fenced));
                if !clash.is_empty() {
                    return Err(LedgerError::Conflict {
                        job: alloc.job.clone(),
                        cpus: clash.to_string(),
                        holder: other.job.clone(),
                    });
                }
            }
        }
        self.occupancy.held.union_with(&alloc.cpus);
        self.occupancy.fenced.union_with(&alloc.fenced);
        self.generation += 1;
        let key = alloc.job.clone();
        Ok(self.jobs.entry(key).or_insert(alloc))
    }

    /// A new allocation names a job the ledger does not know, and holds a CPU.
    fn check_new(&self, alloc: &Allocation) -> Result<(), LedgerError> {
        if let Some(existing) = self.get(&alloc.job) {
            return Err(LedgerError::AlreadyAllocated(
                alloc.job.clone(),
                existing.cpus.to_string(),
            ));
        }
        if alloc.cpus.is_empty() {
            return Err(LedgerError::Empty(alloc.job.clone()));
        }
        Ok(())
    }

    /// Frees what `job` holds and returns it.
    pub fn release(&mut self, job: &str) -> Result<Allocation, LedgerError> {
        if let Some(alloc) = self.suspended.remove(job).or_else(|| self.gang_frozen.remove(job)) {
            self.generation += 1;
            return Ok(alloc);
        }
        let alloc =
            self.jobs.remove(job).ok_or_else(|| LedgerError::UnknownJob(job.to_string()))?;
        self.occupancy.held.difference_with(&alloc.cpus);
        // Fences never overlap: an exclusive job needs wholly free domains, fenced CPUs are not.
        self.occupancy.fenced.difference_with(&alloc.fenced);
        self.generation += 1;
        Ok(alloc)
    }

    /// Gives running jobs new CPUs all at once: a resize, a defragmentation, a rebalance of
    /// malleable jobs. Each entry is a running job's whole new allocation. Refused, with the
    /// ledger unchanged, when one of them is not running (suspended, frozen by slicing, gang-
    /// scheduled: those keep their CPUs), is named twice, holds no CPU, or would hold or fence a
    /// CPU another job holds or fences once every move is made (a gang job's CPUs count even
    /// while it is frozen). Moves may trade places: only the end state is checked.
    pub fn move_jobs(&mut self, moves: &[Allocation]) -> Result<(), LedgerError> {
        let mut next = self.jobs.clone();
        let mut seen = std::collections::BTreeSet::new();
        for m in moves {
            let state =
                self.state_of(&m.job).ok_or_else(|| LedgerError::UnknownJob(m.job.clone()))?;
            if state != JobState::Running {
                return Err(LedgerError::WrongState { job: m.job.clone(), state });
            }
            if m.gang_row.is_some() || self.jobs.get(&m.job).is_some_and(|a| a.gang_row.is_some()) {
                return Err(LedgerError::Moving(m.job.clone(), "it is gang-scheduled"));
            }
            if m.cpus.is_empty() {
                return Err(LedgerError::Empty(m.job.clone()));
            }
            if !seen.insert(m.job.as_str()) {
                return Err(LedgerError::Moving(m.job.clone(), "it is moved twice at once"));
            }
            next.insert(m.job.clone(), m.clone());
        }
        for m in moves {
            let other = next
                .values()
                .chain(self.gang_frozen.values())
                .find(|o| o.job != m.job && clash(m, o));
            if let Some(o) = other {
                let mut cpus = m.cpus.intersection(&o.cpus);
                cpus.union_with(&m.cpus.intersection(&o.fenced));
                cpus.union_with(&m.fenced.intersection(&o.cpus));
                return Err(LedgerError::Conflict {
                    job: m.job.clone(),
                    cpus: cpus.to_string(),
                    holder: o.job.clone(),
                });
            }
        }
        let mut occupancy = Occupancy::default();
        for a in next.values() {
            occupancy.held.union_with(&a.cpus);
            occupancy.fenced.union_with(&a.fenced);
        }
        self.jobs = next;
        self.occupancy = occupancy;
        self.generation += 1;
        Ok(())
    }

    /// The allocation of `job`, running, suspended or frozen by slicing.
    pub fn get(&self, job: &str) -> Option<&Allocation> {
        self.jobs.get(job).or_else(|| self.suspended.get(job)).or_else(|| self.gang_frozen.get(job))
    }

    /// Whether `job` is frozen by gang slicing.
    pub fn is_gang_frozen(&self, job: &str) -> bool {
        self.gang_frozen.contains_key(job)
    }

    /// The gang jobs frozen by slicing, by job id.
    pub fn gang_frozen_jobs(&self) -> impl Iterator<Item = &Allocation> {
        self.gang_frozen.values()
    }

    /// Every gang-scheduled job that is not suspended, running or frozen, by job id.
    pub fn gang_jobs(&self) -> Vec<&Allocation> {
        let mut all: Vec<&Allocation> = self
            .jobs
            .values()
            .chain(self.gang_frozen.values())
            .filter(|a| a.gang_row.is_some())
            .collect();
        all.sort_by(|a, b| a.job.cmp(&b.job));
        all
    }

    /// What placement must avoid for a job of gang row `row`, or for a job that is not
    /// gang-scheduled (`None`): see the module documentation.
    pub fn occupancy_for(&self, row: Option<u32>) -> Occupancy {
        let gang =
            self.jobs.values().chain(self.gang_frozen.values()).chain(self.suspended.values());
        if !gang.clone().any(|a| a.gang_row.is_some()) {
            return self.occupancy.clone();
        }
        let mut occ = Occupancy::default();
        for a in self.jobs.values() {
            if a.gang_row.is_none() || row.is_none() || a.gang_row == row {
                occ.held.union_with(&a.cpus);
                occ.fenced.union_with(&a.fenced);
            }
        }
        // Frozen and suspended gang jobs keep their place in their row.
        for a in self.gang_frozen.values().chain(self.suspended.values()) {
            if a.gang_row.is_some() && (row.is_none() || a.gang_row == row) {
                occ.held.union_with(&a.cpus);
                occ.fenced.union_with(&a.fenced);
            }
        }
        occ
    }

    /// Records a new gang job frozen (it runs when [`Ledger::gang_thaw`] says so): refused
    /// while a job of its own row, or one that is not gang-scheduled, holds any of its CPUs.
    pub fn insert_gang_frozen(&mut self, alloc: Allocation) -> Result<(), LedgerError> {
        self.check_new(&alloc)?;
        let row = alloc.gang_row;
        if row.is_none() {
            return Err(LedgerError::NotGang(alloc.job.clone()));
        }
        let others =
            self.jobs.values().chain(self.gang_frozen.values()).chain(self.suspended.values());
        for other in others {
            let same_row = other.gang_row.is_none() || other.gang_row == row;
            if !same_row {
                continue;
            }
            let mut clash = alloc.cpus.intersection(&other.cpus);
            clash.union_with(&alloc.cpus.intersection(&other.fenced));
            clash.union_with(&alloc.fenced.intersection(&other.cpus));
            if !clash.is_empty() && !self.suspended.contains_key(&other.job) {
                return Err(LedgerError::Conflict {
                    job: alloc.job.clone(),
                    cpus: clash.to_string(),
                    holder: other.job.clone(),
                });
            }
        }
        self.gang_frozen.insert(alloc.job.clone(), alloc);
        self.generation += 1;
        Ok(())
    }

    /// Freezes a running gang job for another row's slice: its CPUs leave the occupancy.
    pub fn gang_freeze(&mut self, job: &str) -> Result<(), LedgerError> {
        match self.jobs.get(job) {
            Some(a) if a.gang_row.is_some() => {}
            Some(_) => return Err(LedgerError::NotGang(job.to_string())),
            None => return Err(self.not_in_state(job)),
        }
        let alloc = self.release(job)?;
        self.gang_frozen.insert(job.to_string(), alloc);
        self.generation += 1;
        Ok(())
    }

    /// Runs a frozen gang job again; refused, with the holder named, while a running job holds
    /// or fences any of its CPUs.
    pub fn gang_thaw(&mut self, job: &str) -> Result<(), LedgerError> {
        let Some(alloc) = self.gang_frozen.remove(job) else {
            return Err(self.not_in_state(job));
        };
        let original = alloc.clone();
        match self.insert(alloc) {
            Ok(_) => Ok(()),
            Err(e) => {
                self.gang_frozen.insert(job.to_string(), original);
                Err(e)
            }
        }
    }

    /// A suspended gang job goes back to taking turns: frozen until [`Ledger::gang_thaw`].
    /// Refused, with the holder named, while a job that is not gang-scheduled, or one of its own
    /// row, holds or fences any of its CPUs (it may have been lent them meanwhile).
    pub fn resume_to_gang(&mut self, job: &str) -> Result<(), LedgerError> {
        let alloc = match self.suspended.get(job) {
            Some(a) if a.gang_row.is_some() => a,
            Some(_) => return Err(LedgerError::NotGang(job.to_string())),
            None => return Err(self.not_in_state(job)),
        };
        if let Some(holder) = self
            .jobs
            .values()
            .chain(self.gang_frozen.values())
            .filter(|o| o.gang_row.is_none() || o.gang_row == alloc.gang_row)
            .find(|o| clash(alloc, o))
        {
            return Err(LedgerError::Conflict {
                job: job.to_string(),
                cpus: alloc.cpus.intersection(&holder.cpus.union(&holder.fenced)).to_string(),
                holder: holder.job.clone(),
            });
        }
        if let Some(alloc) = self.suspended.remove(job) {
            self.gang_frozen.insert(job.to_string(), alloc);
            self.generation += 1;
        }
        Ok(())
    }

    /// The error for `job` not being where an operation needs it: where it is, or unknown.
    fn not_in_state(&self, job: &str) -> LedgerError {
        match self.state_of(job) {
            Some(state) => LedgerError::WrongState { job: job.to_string(), state },
            None => LedgerError::UnknownJob(job.to_string()),
        }
    }

    /// Where `job` is, if the ledger knows it.
    pub fn state_of(&self, job: &str) -> Option<JobState> {
        if self.jobs.contains_key(job) {
            Some(JobState::Running)
        } else if self.suspended.contains_key(job) {
            Some(JobState::Suspended)
        } else if self.gang_frozen.contains_key(job) {
            Some(JobState::Frozen)
        } else {
            None
        }
    }

    /// Whether `job` is suspended.
    pub fn is_suspended(&self, job: &str) -> bool {
        self.suspended.contains_key(job)
    }

    /// The running jobs' allocations, by job id.
    pub fn jobs(&self) -> impl Iterator<Item = &Allocation> {
        self.jobs.values()
    }

    /// The suspended jobs' allocations, by job id.
    pub fn suspended_jobs(&self) -> impl Iterator<Item = &Allocation> {
        self.suspended.values()
    }

    /// Number of jobs, running, suspended and frozen by slicing.
    pub fn len(&self) -> usize {
        self.jobs.len() + self.suspended.len() + self.gang_frozen.len()
    }

    /// Whether no job holds anything.
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty() && self.suspended.is_empty() && self.gang_frozen.is_empty()
    }

    /// Marks a running job suspended: its CPUs leave the occupancy and may be lent.
    pub fn suspend(&mut self, job: &str) -> Result<(), LedgerError> {
        if self.suspended.contains_key(job) {
            return Err(LedgerError::WrongState {
                job: job.to_string(),
                state: JobState::Suspended,
            });
        }
        // A job frozen by slicing is suspended where it is (it runs nothing already).
        let alloc = self.release(job)?;
        self.suspended.insert(job.to_string(), alloc);
        self.generation += 1;
        Ok(())
    }

    /// Records a suspended job found after a restart (its CPUs may be lent already).
    pub fn insert_suspended(&mut self, alloc: Allocation) -> Result<(), LedgerError> {
        self.check_new(&alloc)?;
        self.suspended.insert(alloc.job.clone(), alloc);
        self.generation += 1;
        Ok(())
    }

    /// Runs a suspended job again on its own CPUs, or on `cpus` (with their tasks) when given;
    /// refused, with the holder named, while a running job holds or fences any of them.
    pub fn resume(
        &mut self,
        job: &str,
        elsewhere: Option<(CpuSet, Vec<CpuSet>, CpuSet)>,
    ) -> Result<&Allocation, LedgerError> {
        let Some(mut alloc) = self.suspended.remove(job) else {
            return Err(self.not_in_state(job));
        };
        let original = alloc.clone();
        if let Some((cpus, tasks, fenced)) = elsewhere {
            alloc.cpus = cpus;
            alloc.tasks = tasks;
            alloc.fenced = fenced;
        }
        // A gang job frozen until its slice keeps its CPUs as a running one does.
        if let Some(holder) = self.gang_frozen.values().find(|o| clash(&alloc, o)) {
            let e = LedgerError::Conflict {
                job: job.to_string(),
                cpus: alloc.cpus.intersection(&holder.cpus.union(&holder.fenced)).to_string(),
                holder: holder.job.clone(),
            };
            self.suspended.insert(job.to_string(), original);
            return Err(e);
        }
        match self.insert(alloc) {
            Ok(_) => Ok(&self.jobs[job]),
            Err(e) => {
                self.suspended.insert(job.to_string(), original);
                Err(e)
            }
        }
    }

    /// Who borrows which CPUs from which suspended job.
    pub fn lent(&self) -> Vec<Loan> {
        let mut loans = Vec::new();
        for owner in self.suspended.values() {
            if !owner.cpus.intersects(&self.occupancy.held) {
                continue;
            }
            for holder in self.jobs.values() {
                let cpus = owner.cpus.intersection(&holder.cpus);
                if !cpus.is_empty() {
                    loans.push(Loan { owner: owner.job.clone(), holder: holder.job.clone(), cpus });
                }
            }
        }
        loans
    }

    /// What placement must avoid.
    pub fn occupancy(&self) -> &Occupancy {
        &self.occupancy
    }

    /// The change counter.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The job holding `cpu`, if any.
    pub fn holder_of(&self, cpu: u32) -> Option<&Allocation> {
        if !self.occupancy.held.contains(cpu) {
            return None;
        }
        self.jobs.values().find(|a| a.cpus.contains(cpu))
    }

    /// Checks every invariant; `Err` names the first broken one. Used by tests and after a
    /// rebuild from the cgroup tree.
    pub fn check(&self) -> Result<(), String> {
        let mut held = CpuSet::new();
        let mut fenced = CpuSet::new();
        for a in self.jobs.values() {
            if a.cpus.intersects(&held) {
                return Err(format!(
                    "job {} holds CPUs {} that another job holds",
                    a.job,
                    a.cpus.intersection(&held)
                ));
            }
            if a.fenced.intersects(&fenced) {
                return Err(format!(
                    "job {} fences CPUs {} that another job fences",
                    a.job,
                    a.fenced.intersection(&fenced)
                ));
            }
            held.union_with(&a.cpus);
            fenced.union_with(&a.fenced);
        }
        if held.intersects(&fenced) {
            return Err(format!("CPUs {} are both held and fenced", held.intersection(&fenced)));
        }
        if held != self.occupancy.held || fenced != self.occupancy.fenced {
            return Err("the occupancy summary does not match the jobs".into());
        }
        // Gang rows: no two jobs of one row share a CPU, and no gang job shares one with a job
        // that is not gang-scheduled (running, frozen or suspended alike).
        let all: Vec<&Allocation> = self
            .jobs
            .values()
            .chain(self.gang_frozen.values())
            .chain(self.suspended.values())
            .collect();
        for (i, a) in all.iter().enumerate() {
            if self.gang_frozen.contains_key(&a.job) && a.gang_row.is_none() {
                return Err(format!("job {} is frozen by slicing but has no row", a.job));
            }
            for b in &all[i + 1..] {
                let shares =
                    a.gang_row.is_some() && b.gang_row.is_some() && a.gang_row != b.gang_row;
                let suspended_lender =
                    self.suspended.contains_key(&a.job) || self.suspended.contains_key(&b.job);
                if !shares && !suspended_lender && a.cpus.intersects(&b.cpus) {
                    return Err(format!(
                        "jobs {} and {} share CPUs {} although they are not gang jobs of different rows",
                        a.job,
                        b.job,
                        a.cpus.intersection(&b.cpus)
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(job: &str, cpus: &str, fenced: &str) -> Allocation {
        Allocation {
            job: job.into(),
            cpus: CpuSet::parse_list(cpus).unwrap(),
            tasks: vec![],
            mems: CpuSet::new(),
            fenced: CpuSet::parse_list(fenced).unwrap(),
            request: String::new(),
            gang_row: None,
        }
    }

    #[test]
    fn a_gang_job_and_an_ordinary_one_never_end_up_sharing_cpus_through_suspensions() {
        let gang = |job: &str, cpus: &str, row: u32| Allocation {
            gang_row: Some(row),
            ..alloc(job, cpus, "")
        };
        let mut l = Ledger::new();
        // An ordinary job suspended; a gang job placed on its lent CPU.
        l.insert(alloc("a", "1", "")).unwrap();
        l.suspend("a").unwrap();
        l.insert_gang_frozen(gang("g", "1", 0)).unwrap();
        l.gang_thaw("g").unwrap();
        // a may not resume onto the gang job, running or frozen.
        assert!(matches!(l.resume("a", None), Err(LedgerError::Conflict { .. })));
        l.gang_freeze("g").unwrap();
        let err = l.resume("a", None).unwrap_err();
        assert_eq!(
            err,
            LedgerError::Conflict { job: "a".into(), cpus: "1".into(), holder: "g".into() }
        );
        // g suspended: a resumes; then g may not rejoin its turns onto a's CPU.
        l.suspend("g").unwrap();
        l.resume("a", None).unwrap();
        let err = l.resume_to_gang("g").unwrap_err();
        assert_eq!(
            err,
            LedgerError::Conflict { job: "g".into(), cpus: "1".into(), holder: "a".into() }
        );
        assert!(l.is_suspended("g"));
        l.check().unwrap();
        // A job frozen by slicing is "frozen", not unknown.
        l.release("a").unwrap();
        l.resume_to_gang("g").unwrap();
        assert_eq!(
            l.resume("g", None).unwrap_err(),
            LedgerError::WrongState { job: "g".into(), state: JobState::Frozen }
        );
    }

    #[test]
    fn a_suspended_jobs_cpus_are_lent_and_it_resumes_only_when_they_are_back() {
        let mut l = Ledger::new();
        l.insert(alloc("a", "0-3", "")).unwrap();
        l.suspend("a").unwrap();
        assert!(l.occupancy().held.is_empty() && l.is_suspended("a") && l.len() == 1);
        assert!(matches!(
            l.suspend("a"),
            Err(LedgerError::WrongState { state: JobState::Suspended, .. })
        ));
        // b borrows 2-5: two of a's CPUs.
        l.insert(alloc("b", "2-5", "")).unwrap();
        assert_eq!(
            l.lent(),
            vec![Loan {
                owner: "a".into(),
                holder: "b".into(),
                cpus: CpuSet::parse_list("2-3").unwrap()
            }]
        );
        let before = l.clone();
        let e = l.resume("a", None).unwrap_err();
        assert!(
            matches!(&e, LedgerError::Conflict { holder, cpus, .. } if holder == "b" && cpus == "2-3"),
            "{e}"
        );
        assert_eq!((l.is_suspended("a"), l.occupancy()), (true, before.occupancy()));
        // Elsewhere, on CPUs nobody runs on: allowed.
        let six_seven = CpuSet::parse_list("6-7").unwrap();
        l.resume("a", Some((six_seven.clone(), vec![six_seven.clone()], CpuSet::new()))).unwrap();
        assert_eq!(l.get("a").unwrap().cpus, six_seven);
        l.check().unwrap();
        // Suspended again, then b leaves: a resumes on its CPUs; a suspended job releases.
        l.suspend("a").unwrap();
        l.release("b").unwrap();
        l.resume("a", None).unwrap();
        assert!(matches!(
            l.resume("a", None),
            Err(LedgerError::WrongState { state: JobState::Running, .. })
        ));
        l.suspend("a").unwrap();
        l.release("a").unwrap();
        assert!(l.is_empty() && l.occupancy().held.is_empty());
        l.check().unwrap();
    }

    #[test]
    fn refused_changes_leave_the_ledger_as_it_was() {
        let mut l = Ledger::new();
        l.insert(alloc("a", "0-1", "2")).unwrap();
        let g = l.generation();
        for (bad, holder) in [
            (alloc("b", "1", ""), "a"),
            (alloc("b", "2", ""), "a"),
            (alloc("b", "5", "0"), "a"),
            (alloc("b", "5", "2"), "a"),
        ] {
            match l.insert(bad) {
                Err(LedgerError::Conflict { holder: h, .. }) => assert_eq!(h, holder),
                other => panic!("expected a conflict, got {other:?}"),
            }
        }
        assert!(matches!(l.insert(alloc("a", "9", "")), Err(LedgerError::AlreadyAllocated(..))));
        assert!(matches!(l.insert(alloc("c", "", "")), Err(LedgerError::Empty(_))));
        assert!(matches!(l.release("zz"), Err(LedgerError::UnknownJob(_))));
        assert_eq!(l.generation(), g);
        assert_eq!(l.len(), 1);
        l.check().unwrap();
        assert_eq!(l.holder_of(1).map(|a| a.job.as_str()), Some("a"));
        l.release("a").unwrap();
        assert!(l.occupancy().held.is_empty() && l.occupancy().fenced.is_empty());
        l.check().unwrap();
    }

    #[test]
    fn moves_are_made_together_or_not_at_all() {
        let mut l = Ledger::new();
        l.insert(alloc("a", "0-1", "")).unwrap();
        l.insert(alloc("b", "2-3", "")).unwrap();
        l.insert(alloc("s", "6", "")).unwrap();
        l.suspend("s").unwrap();
        // a and b trade places: only the end state counts.
        l.move_jobs(&[alloc("a", "2-3", ""), alloc("b", "0-1", "")]).unwrap();
        assert_eq!(l.holder_of(0).map(|a| a.job.as_str()), Some("b"));
        l.check().unwrap();
        let g = l.generation();
        let before = l.occupancy().clone();
        for (moves, says) in [
            (vec![alloc("a", "0", "")], "held by job b"),
            (vec![alloc("a", "4", "1")], "held by job b"),
            (vec![alloc("a", "4", ""), alloc("a", "5", "")], "moved twice"),
            (vec![alloc("a", "", "")], "at least one CPU"),
            (vec![alloc("s", "7", "")], "is suspended"),
            (vec![alloc("zz", "7", "")], "holds nothing"),
            (vec![alloc("a", "4-5", ""), alloc("b", "5", "")], "held by job b"),
        ] {
            let e = l.move_jobs(&moves).expect_err(says).to_string();
            assert!(e.contains(says), "{moves:?}: {e}");
        }
        assert_eq!((l.generation(), l.occupancy()), (g, &before));
        l.check().unwrap();
    }
}
