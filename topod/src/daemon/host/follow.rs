//! Following the batch system's own suspensions (Slurm's suspend preemption and gang
//! scheduling): the batch system owns a job's clock and decides when it stops; topod owns which
//! CPUs it holds. When Slurm suspends a job (SIGSTOP, or its own freezer) and starts another on
//! the same cores, the plug-in tells topod what slurmctld says of the jobs on this host
//! ([`topo_core::proto::BatchView`]) and topod follows:
//!
//! - a job the batch system suspended is held as suspended *by the batch system*
//!   ([`super::JobRecord::batch_suspended`]): its CPUs may be lent to the job the batch system
//!   starts on them, and topod does not freeze it (the batch system stopped it; topod would not
//!   learn when to thaw it);
//! - a job the batch system runs again takes its CPUs back once no running job holds them, and
//!   when the job that borrowed them is released, the lender runs again in the ledger (Slurm
//!   resumes a suspended job once the job that preempted it is gone);
//! - a job started suspended (gang scheduling puts a new job in a row that is not running) is
//!   placed on the running jobs' CPUs inside what the batch system gave it, and held suspended.
//!
//! The batch system's CPU list bounds every loan: a job only ever borrows CPUs the batch system
//! itself gave it. Jobs topod suspended (its `suspend`, its preemption, its gang rows) are never
//! touched here.

use super::{Host, HostError, Prepared};
use crate::cgroup::JobId;
use topo_core::ledger::{Allocation, LedgerError};
use topo_core::place;
use topo_core::policy::Stopper;
use topo_core::proto::{reply, BatchView};

impl Host {
    /// Applies what the batch system says of the jobs on this host (see the module docs):
    /// suspensions first (so that a job it runs again finds the CPUs its borrower lends back),
    /// then resumptions. Jobs topod does not hold are ignored.
    pub fn follow_batch(&mut self, view: &BatchView) -> Result<reply::Follow, HostError> {
        view.check().map_err(HostError::BadArgument)?;
        let mut done = reply::Follow::default();
        for job in &view.suspended {
            if self.follow_suspend(job)? {
                done.suspended.push(job.clone());
            }
        }
        for job in &view.running {
            match self.follow_resume(job)? {
                Some(true) => done.resumed.push(job.clone()),
                Some(false) => done.still_lent.push(job.clone()),
                None => {}
            }
        }
        Ok(done)
    }

    /// An allocate that came with the batch system's view: the view first, then the job; when
    /// the job is refused, the jobs this view suspended run again in the ledger (the batch
    /// system resumes them: nothing took their CPUs).
    pub fn allocate_following(
        &mut self,
        view: Option<&BatchView>,
        job: &str,
        prepared: &Prepared,
        mem_limit: Option<u64>,
        owner_uid: Option<u32>,
    ) -> Result<Allocation, HostError> {
        let followed = match view {
            Some(v) => self.follow_batch(v)?,
            None => reply::Follow::default(),
        };
        let allocated = self.allocate_prepared(job, prepared, mem_limit, owner_uid);
        if allocated.is_err() {
            for lender in &followed.suspended {
                if self.batch_suspended(lender) && self.ledger.resume(lender, None).is_ok() {
                    self.mark_batch_resumed(
                        lender,
                        &format!("job {job}, started on its CPUs, was refused"),
                    );
                }
            }
        }
        allocated
    }

    /// `occupancy` with the CPUs of the jobs the batch system suspended held: where a job that
    /// did not come with the batch system's view may go.
    pub(super) fn batch_lenders_held(&self, mut occupancy: place::Occupancy) -> place::Occupancy {
        for a in self.ledger.suspended_jobs() {
            if self.hints.get(&a.job).is_some_and(|h| h.batch_suspended) {
                occupancy.held.union_with(&a.cpus);
                occupancy.fenced.union_with(&a.fenced);
            }
        }
        occupancy
    }

    /// Whether the ledger holds `job` as suspended by the batch system.
    pub fn batch_suspended(&self, job: &str) -> bool {
        self.ledger.is_suspended(job) && self.hints.get(job).is_some_and(|h| h.batch_suspended)
    }

    /// Holds a running job as suspended by the batch system. Returns whether it changed.
    fn follow_suspend(&mut self, job: &str) -> Result<bool, HostError> {
        let busy = self.releasing.contains(job) || self.changing.contains_key(job);
        // Only a job running in topod's ledger: one topod froze (suspend, preemption, gang
        // slicing) stays topod's to thaw.
        if busy || self.ledger.jobs().all(|a| a.job != job) {
            return Ok(false);
        }
        let id = JobId::parse(job)?;
        let mut hint = self.hints.get(job).cloned().unwrap_or_default();
        hint.batch_suspended = true;
        // Never the same as another's, so that the last suspended is known (see
        // resume_batch_lenders); nanoseconds since the epoch, from the wall clock.
        let newest = self.hints.values().map(|h| h.batch_suspended_ns).max().unwrap_or(0);
        hint.batch_suspended_ns = now_ns().max(newest + 1);
        hint.clock.stop(self.now_s(), Stopper::Outside);
        // The record first: a restart must find a lender that overlaps its borrower.
        self.write_record(&id, &hint)?;
        self.ledger.suspend(job)?;
        let cpus = self.ledger.get(job).map(|a| a.cpus.to_string()).unwrap_or_default();
        self.hints.insert(job.to_string(), hint);
        tracing::info!(event = "batch_suspended", job = %job, cpus = %cpus, "job {job}: suspended by the batch system; CPUs {cpus} may be lent to the job it starts on them");
        Ok(true)
    }

    /// Runs again a job the batch system had suspended, once no running job holds its CPUs.
    /// `None`: not a job the batch system suspended; `Some(false)`: still lent.
    fn follow_resume(&mut self, job: &str) -> Result<Option<bool>, HostError> {
        if !self.batch_suspended(job)
            || self.releasing.contains(job)
            || self.changing.contains_key(job)
        {
            return Ok(None);
        }
        match self.ledger.resume(job, None) {
            Ok(_) => {}
            Err(LedgerError::Conflict { cpus, holder, .. }) => {
                tracing::warn!("job {job}: the batch system runs it again, but CPUs {cpus} are still held by job {holder}, which it has not said it suspended; kept suspended in topod's ledger until {holder} is released or suspended");
                return Ok(Some(false));
            }
            Err(e) => return Err(e.into()),
        }
        self.mark_batch_resumed(job, "the batch system runs it again");
        Ok(Some(true))
    }

    /// After a release: jobs the batch system suspended whose CPUs no running job holds any
    /// more run again in the ledger (the batch system resumes a suspended job once the job it
    /// started on its CPUs is gone). A job the batch system still holds suspended is said so
    /// again by the next view, before any job is placed on its CPUs.
    pub(super) fn resume_batch_lenders(&mut self) -> Vec<String> {
        // The last suspended first: with preemption in tiers (low suspended for mid, mid for
        // high), the batch system resumes mid when high ends, and low stays suspended for mid.
        let mut lenders: Vec<(u64, String)> = self
            .ledger
            .suspended_jobs()
            .filter_map(|a| {
                let hint = self.hints.get(&a.job).filter(|h| h.batch_suspended)?;
                Some((hint.batch_suspended_ns, a.job.clone()))
            })
            .filter(|(_, j)| !self.releasing.contains(j) && !self.changing.contains_key(j))
            .collect();
        lenders.sort_by(|a, b| b.cmp(a));
        let lenders: Vec<String> = lenders.into_iter().map(|(_, j)| j).collect();
        let mut resumed = Vec::new();
        for job in lenders {
            if self.ledger.resume(&job, None).is_ok() {
                self.mark_batch_resumed(&job, "the job on its CPUs is gone");
                resumed.push(job);
            }
        }
        resumed
    }

    fn mark_batch_resumed(&mut self, job: &str, why: &str) {
        let now = self.now_s();
        if let Some(mut hint) = self.hints.get(job).cloned() {
            hint.batch_suspended = false;
            hint.clock.resume(now, Stopper::Outside);
            if let Ok(id) = JobId::parse(job) {
                self.record(&id, &hint);
            }
            self.hints.insert(job.to_string(), hint);
        }
        let cpus = self.ledger.get(job).map(|a| a.cpus.to_string()).unwrap_or_default();
        tracing::info!(event = "batch_resumed", job = %job, cpus = %cpus, "job {job}: running again on CPUs {cpus} ({why})");
    }

    /// Allocates a job the batch system starts suspended: the running jobs on the CPUs it gave
    /// lend them for the placement, then the new job is held suspended by the batch system and
    /// they run on.
    pub(super) fn allocate_suspended(
        &mut self,
        job: &str,
        prepared: &Prepared,
        place: impl FnOnce(&mut Host) -> Result<Allocation, HostError>,
    ) -> Result<Allocation, HostError> {
        let Some(given) = prepared.request.cpu_list.clone() else {
            return Err(HostError::BadArgument(format!(
                "job {job}: starts_suspended needs the CPUs the batch system gave it (cpus): only there may it share CPUs with the jobs it takes turns with"
            )));
        };
        if self.ledger.get(job).is_some() {
            return place(self);
        }
        let lenders: Vec<String> = self
            .ledger
            .jobs()
            .filter(|a| a.cpus.intersects(&given))
            .map(|a| a.job.clone())
            .filter(|j| !self.releasing.contains(j) && !self.changing.contains_key(j))
            .collect();
        for lender in &lenders {
            self.ledger.suspend(lender)?;
        }
        let placed = place(self).and_then(|alloc| {
            self.follow_suspend(job)?;
            Ok(alloc)
        });
        for lender in &lenders {
            if let Err(e) = self.ledger.resume(lender, None) {
                // Cannot happen while the new job is suspended or absent: said, not hidden.
                tracing::error!(
                    "job {lender}: taking its CPUs back after the start of {job} failed: {e}"
                );
            }
        }
        if placed.is_ok() {
            tracing::info!(event = "batch_suspended_start", job = %job, "job {job}: started suspended by the batch system, on CPUs of {} (they take turns)", lenders.join(", "));
        }
        placed.map(|a| self.ledger.get(job).cloned().unwrap_or(a))
    }
}

/// Nanoseconds since the epoch (0 before it).
fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}
