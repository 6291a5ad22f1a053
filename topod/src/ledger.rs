//! The ledger: who holds what on one host.
//!
//! Invariants, checked on every change and by property tests over random sequences:
//! - no CPU is held by two jobs;
//! - no job holds a CPU that another job fences (the rest of an exclusive job's core/domain);
//! - `occupancy()` is exactly the union of what the jobs hold and fence.
//!
//! A refused change leaves the ledger as it was.

use crate::cpuset::CpuSet;
use crate::place::{Occupancy, Placement};
use serde::Serialize;
use std::collections::BTreeMap;

/// What one job holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
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
}

/// A change the ledger refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    /// The job already holds an allocation.
    #[error("job {0} already holds CPUs {1}")]
    AlreadyAllocated(String, CpuSet),
    /// Some of the CPUs are held by other jobs.
    #[error("CPUs {cpus} requested for job {job} are held by job {holder}")]
    Conflict {
        /// The job asking.
        job: String,
        /// The CPUs in conflict.
        cpus: CpuSet,
        /// A job holding or fencing them.
        holder: String,
    },
    /// No such job.
    #[error("job {0} holds nothing on this host")]
    UnknownJob(String),
    /// An allocation with no CPU.
    #[error("job {0}: an allocation needs at least one CPU")]
    Empty(String),
}

/// Who holds what on one host.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Ledger {
    jobs: BTreeMap<String, Allocation>,
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
    pub fn allocate(&mut self, job: &str, placement: &Placement, request: &str) -> Result<&Allocation, LedgerError> {
        self.insert(Allocation {
            job: job.to_string(),
            cpus: placement.cpus.clone(),
            tasks: placement.tasks.clone(),
            mems: placement.mems.clone(),
            fenced: placement.fenced.clone(),
            request: request.to_string(),
        })
    }

    /// Records an allocation (also used when rebuilding the ledger from what exists).
    pub fn insert(&mut self, alloc: Allocation) -> Result<&Allocation, LedgerError> {
        if let Some(existing) = self.jobs.get(&alloc.job) {
            return Err(LedgerError::AlreadyAllocated(alloc.job.clone(), existing.cpus.clone()));
        }
        if alloc.cpus.is_empty() {
            return Err(LedgerError::Empty(alloc.job));
        }
        let claims = alloc.cpus.union(&alloc.fenced);
        for other in self.jobs.values() {
            let clash = alloc.cpus.intersection(&other.cpus.union(&other.fenced));
            let clash = clash.union(&claims.intersection(&other.cpus));
            if !clash.is_empty() {
                return Err(LedgerError::Conflict { job: alloc.job.clone(), cpus: clash, holder: other.job.clone() });
            }
        }
        self.occupancy.held.union_with(&alloc.cpus);
        self.occupancy.fenced.union_with(&alloc.fenced);
        self.generation += 1;
        let key = alloc.job.clone();
        Ok(self.jobs.entry(key).or_insert(alloc))
    }

    /// Frees what `job` holds and returns it.
    pub fn release(&mut self, job: &str) -> Result<Allocation, LedgerError> {
        let alloc = self.jobs.remove(job).ok_or_else(|| LedgerError::UnknownJob(job.to_string()))?;
        self.occupancy.held.difference_with(&alloc.cpus);
        // Fences may overlap between exclusive jobs of the same domain level only if both fence
        // the same free CPUs; rebuild the fence union rather than subtract.
        self.occupancy.fenced = self.jobs.values().fold(CpuSet::new(), |a, j| a.union(&j.fenced));
        self.generation += 1;
        Ok(alloc)
    }

    /// The allocation of `job`.
    pub fn get(&self, job: &str) -> Option<&Allocation> {
        self.jobs.get(job)
    }

    /// All allocations, by job id.
    pub fn jobs(&self) -> impl Iterator<Item = &Allocation> {
        self.jobs.values()
    }

    /// Number of jobs.
    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    /// Whether no job holds anything.
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
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
                return Err(format!("job {} holds CPUs {} that another job holds", a.job, a.cpus.intersection(&held)));
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
        Ok(())
    }
}
