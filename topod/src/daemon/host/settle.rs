//! The freezes and thaws that follow a change: gang slices (freezes first, then thaws onto the
//! CPUs they freed) and the jobs preemption suspended running again.
//!
//! The host decides them under its lock ([`Host::gang_switch`], [`Host::resume_preempted`]);
//! each job concerned is marked `switching`, so nothing else plans for it meanwhile. A thaw
//! takes the job's CPUs in the ledger before the kernel runs it, a freeze gives them up only
//! once the kernel reports it frozen: no CPU runs two jobs at once, whoever holds the lock in
//! between.
//!
//! Where the kernel's waits run depends on who drives the host. The server defers them
//! ([`Host::defer_kernel_waits`]): the work is queued, and [`Host::take_kernel_work`],
//! [`KernelWork::run`] (without the lock) and [`Host::finish_kernel_work`] do it, the way a
//! release's kill runs through its ticket. Driven directly (tests, the differential test, start-up)
//! each runs at once, under the caller's borrow.

use super::*;

/// A freeze or thaw the host decided on, to be run without its lock.
#[must_use]
pub struct KernelWork {
    ticket: FreezeTicket,
    kind: WorkKind,
    /// A preemption victim's record before and after its suspension.
    victim: Option<Box<VictimHints>>,
}

/// A preemption victim's record as it was, and as its suspension makes it.
pub(super) struct VictimHints {
    pub(super) before: JobRecord,
    pub(super) after: JobRecord,
}

/// What a [`KernelWork`] is for, and so how its outcome is recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WorkKind {
    /// A gang job whose row lost the slice: frozen, then its CPUs are free in the ledger.
    GangFreeze,
    /// A gang job whose row has the slice: its CPUs were taken in the ledger, then thawed.
    GangThaw,
    /// A job suspended by preemption whose CPUs are free again: taken back, then thawed.
    ResumePreempted,
    /// A running job suspended for a preemptor: frozen, then suspended in the ledger.
    VictimFreeze,
    /// A victim whose preemptor did not fit after all: taken back, then thawed.
    VictimThaw,
}

impl KernelWork {
    /// Runs the freeze or thaw and waits for the kernel to report it. Takes no lock.
    pub fn run(&self) -> Result<(), CgroupError> {
        self.ticket.run()
    }

    /// Whether it is a gang freeze, after which other rows' jobs may be thawed onto its CPUs.
    pub fn frees_cpus(&self) -> bool {
        self.kind == WorkKind::GangFreeze
    }
}

/// What the gang slicing of one switch has done so far, and since when.
pub(super) struct GangCycle {
    began: std::time::Instant,
    at: std::time::SystemTime,
    report: GangSwitch,
}

/// The freezes and thaws the host decided and has not finished: the jobs concerned (nothing
/// else plans for them meanwhile), the work queued for the server, and the gang switch under
/// way.
#[derive(Default)]
pub(super) struct Settling {
    /// Jobs a gang switch or a resume after preemption is freezing or thawing.
    pub(super) switching: BTreeMap<String, WorkKind>,
    /// Whether those freezes and thaws are queued for the server to run without the lock.
    pub(super) defer_waits: bool,
    /// The freezes and thaws queued, not yet taken.
    pub(super) queued_work: Vec<KernelWork>,
    /// The gang switch under way, with what it has done.
    pub(super) gang_cycle: Option<GangCycle>,
    /// A gang switch met a job being frozen or thawed: made again once that is done.
    pub(super) gang_recheck: bool,
}

impl Host {
    /// Queues the kernel's freezes and thaws for [`Host::take_kernel_work`] instead of running
    /// them at once (the server, which runs them without the host lock).
    pub fn defer_kernel_waits(&mut self) {
        self.settling.defer_waits = true;
    }

    /// Whether freezes or thaws are queued for [`Host::take_kernel_work`].
    pub fn has_queued_kernel_work(&self) -> bool {
        !self.settling.queued_work.is_empty()
    }

    /// The freezes and thaws decided and not yet run (see [`Host::defer_kernel_waits`]).
    pub fn take_kernel_work(&mut self) -> Vec<KernelWork> {
        std::mem::take(&mut self.settling.queued_work)
    }

    /// Whether freezes or thaws are queued or under way: while they are, the jobs concerned are
    /// marked and only the server's settling may change them.
    pub fn kernel_work_pending(&self) -> bool {
        !self.settling.switching.is_empty()
    }

    /// Whether a job is being suspended or resumed (its ticket's freeze or thaw under way).
    pub fn changes_under_way(&self) -> bool {
        !self.changing.is_empty()
    }

    /// Whether `job` is being frozen or thawed by a gang switch or a resume after preemption.
    pub(super) fn is_switching(&self, job: &str) -> bool {
        self.settling.switching.contains_key(job)
    }

    /// Records what the kernel did with one [`KernelWork`].
    pub fn finish_kernel_work(&mut self, work: KernelWork, outcome: Result<(), CgroupError>) {
        self.finish_work(work, outcome);
        self.end_gang_cycle_when_done();
    }

    /// [`Host::finish_kernel_work`] within a switch that goes on (its report still filling).
    fn finish_work(&mut self, work: KernelWork, outcome: Result<(), CgroupError>) {
        let job = work.ticket.id.as_str().to_string();
        self.settling.switching.remove(&job);
        match work.kind {
            WorkKind::GangFreeze => self.finish_gang_freeze(&job, outcome),
            WorkKind::GangThaw => self.finish_gang_thaw(&job, outcome),
            WorkKind::ResumePreempted => self.finish_resume_preempted(&work.ticket.id, outcome),
            WorkKind::VictimFreeze | WorkKind::VictimThaw => {
                if let Some(hints) = work.victim {
                    self.finish_victim(&work.ticket.id, work.kind, *hints, outcome);
                }
            }
        }
    }

    /// Freezes `victim` for a preemptor (its record says so already), or thaws it again when
    /// the preemptor did not fit (it holds its CPUs again in the ledger already).
    pub(super) fn change_victim(&mut self, victim: JobId, freeze: bool, hints: VictimHints) {
        let ticket = self.freeze_ticket(victim, freeze);
        let kind = if freeze { WorkKind::VictimFreeze } else { WorkKind::VictimThaw };
        self.kernel(KernelWork { ticket, kind, victim: Some(Box::new(hints)) });
    }

    fn finish_victim(
        &mut self,
        id: &JobId,
        kind: WorkKind,
        hints: VictimHints,
        outcome: Result<(), CgroupError>,
    ) {
        let job = id.as_str().to_string();
        if self.ledger.get(&job).is_none() {
            return;
        }
        match (kind, outcome) {
            (WorkKind::VictimFreeze, Ok(())) => {
                let _ = self.ledger.suspend(&job);
                let preemptor = hints.after.preempted_by.clone().unwrap_or_default();
                if !self.preemption.under_way.contains_key(&preemptor)
                    && self.ledger.get(&preemptor).is_none()
                {
                    // Its preemptor gave up while it froze: it runs again at once.
                    tracing::info!("job {job}: frozen for job {preemptor}, which was not started; it runs again");
                    let after = hints.after;
                    if self.ledger.resume(&job, None).is_ok() {
                        let hints = VictimHints { before: hints.before, after };
                        self.change_victim(id.clone(), false, hints);
                    } else {
                        self.hints.insert(job, after);
                    }
                    return;
                }
                self.hints.insert(job, hints.after);
            }
            (WorkKind::VictimFreeze, Err(e)) => {
                let preemptor = hints.after.preempted_by.unwrap_or_default();
                tracing::warn!("job {job}: suspending it for job {preemptor} failed: {e}");
                self.record(id, &hints.before);
            }
            (_, Ok(())) => {
                self.record(id, &hints.before);
                self.hints.insert(job, hints.before);
            }
            (_, Err(e)) => {
                tracing::warn!("job {job}: thawing it again failed: {e}");
                let _ = self.ledger.suspend(&job);
            }
        }
    }

    /// After queued gang freezes have run: thaws the jobs whose row has the slice onto the CPUs
    /// they freed (queued in turn). Freezes nothing.
    pub fn gang_thaws(&mut self) {
        let Some((active, members)) = self.gang_members(self.now()) else { return };
        self.thaw_members(active, &members);
        self.end_gang_cycle_when_done();
    }

    /// Whether a gang switch met a job being frozen or thawed and must be made again once the
    /// kernel's work is done (the server does, [`Host::gang_switch`]). Cleared.
    pub fn take_gang_recheck(&mut self) -> bool {
        std::mem::take(&mut self.settling.gang_recheck)
    }

    /// Runs `work` at once when nobody defers the kernel's waits, else queues it.
    fn kernel(&mut self, work: KernelWork) {
        self.settling.switching.insert(work.ticket.id.as_str().to_string(), work.kind);
        if self.settling.defer_waits {
            self.settling.queued_work.push(work);
        } else {
            let outcome = work.run();
            self.finish_work(work, outcome);
        }
    }

    /// Freezes and thaws the gang jobs for the slice `now` falls in (see
    /// `topo_core::policy::gang_runs`): the freezes first, so that no CPU runs two jobs at once;
    /// a job whose freeze fails keeps running, and the ledger then refuses to thaw a job onto
    /// its CPUs. Jobs being released, suspended, resumed or switched are left alone. Where the
    /// kernel's waits are deferred, the thaws that wait for freezes come with
    /// [`Host::gang_thaws`]; the report then says what was done by the time it returns.
    pub fn gang_switch(&mut self, now: std::time::SystemTime) -> Option<GangSwitch> {
        let (active, members) = self.gang_members(now)?;
        let freezes: Vec<JobId> = members
            .iter()
            .filter(|m| m.running && !m.should_run)
            .filter_map(|m| JobId::parse(&m.job).ok())
            .collect();
        self.settling.gang_cycle.get_or_insert_with(|| GangCycle {
            began: std::time::Instant::now(),
            at: now,
            report: GangSwitch { active_row: active, ..GangSwitch::default() },
        });
        for id in freezes {
            let ticket = self.freeze_ticket(id, true);
            self.kernel(KernelWork { ticket, kind: WorkKind::GangFreeze, victim: None });
        }
        // Deferred freezes still hold their CPUs: the thaws onto them come after
        // (`gang_thaws`); those onto CPUs that are free now need not wait.
        self.thaw_members(active, &members);
        let report = self.settling.gang_cycle.as_ref().map(|c| c.report.clone());
        self.end_gang_cycle_when_done();
        report
    }

    /// The gang jobs not being changed otherwise, with whether each runs now and should run in
    /// the slice `now` falls in; `None` without slicing.
    fn gang_members(&mut self, now: std::time::SystemTime) -> Option<(u32, Vec<GangMemberNow>)> {
        let cfg = self.gang.clone().or_else(|| self.gang_leftover())?;
        let since_epoch = now.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let busy = |job: &str| self.releasing.contains(job) || self.changing.contains_key(job);
        let gang_jobs = self.ledger.gang_jobs();
        if gang_jobs.iter().any(|a| self.settling.switching.contains_key(&a.job)) {
            // One is being frozen or thawed: once it is, the switch is made again with it.
            self.settling.gang_recheck = true;
        }
        let mut members: Vec<GangMemberNow> = gang_jobs
            .into_iter()
            .filter(|a| !busy(&a.job) && !self.settling.switching.contains_key(&a.job))
            .map(|a| GangMemberNow {
                job: a.job.clone(),
                row: a.gang_row.unwrap_or(0),
                cpus: a.cpus.clone(),
                running: !self.ledger.is_gang_frozen(&a.job),
                should_run: false,
            })
            .collect();
        let parts: Vec<[(u32, &CpuSet); 1]> = members.iter().map(|m| [(0, &m.cpus)]).collect();
        let views: Vec<topo_core::policy::GangMember<'_>> = members
            .iter()
            .zip(&parts)
            .map(|(m, parts)| topo_core::policy::GangMember { row: m.row, parts })
            .collect();
        // Rows beyond the configured ones (gang_rows lowered while their jobs live) keep turns
        // of their own: folded onto the configured rows they would collide with them.
        let rows = members.iter().map(|m| m.row + 1).max().unwrap_or(0).max(cfg.gang.rows);
        let active =
            topo_core::policy::Gang { rows, ..cfg.gang }.active_row(since_epoch.as_secs() as i64);
        let runs = topo_core::policy::gang_runs(active, rows, &views);
        for (m, should_run) in members.iter_mut().zip(runs) {
            m.should_run = should_run;
        }
        if let Some(status) = &mut self.gang_status {
            status.active_row = active;
            status.slice = cfg.gang.slice_at(since_epoch.as_secs() as i64);
        }
        Some((active, members))
    }

    /// Thaws the frozen `members` that should run, each taking its CPUs in the ledger first
    /// (refused while a job still runs on any of them: a freeze not yet done, or one that
    /// failed).
    fn thaw_members(&mut self, active: u32, members: &[GangMemberNow]) {
        for m in members.iter().filter(|m| !m.running && m.should_run) {
            let Ok(id) = JobId::parse(&m.job) else { continue };
            let being_switched =
                self.settling.switching.keys().any(|job| {
                    self.ledger.jobs().any(|a| &a.job == job && a.cpus.intersects(&m.cpus))
                });
            if being_switched {
                // A job on its CPUs is still being frozen (`gang_thaws` comes back for it) or
                // thawed (the switch is made again once it is).
                self.settling.gang_recheck = true;
                continue;
            }
            if let Err(e) = self.ledger.gang_thaw(&m.job) {
                tracing::warn!("job {}: stays frozen in row {active}'s slice: {e}", m.job);
                self.gang_cycle_report(|r| r.failed.push(m.job.clone()));
                continue;
            }
            let ticket = self.freeze_ticket(id, false);
            self.kernel(KernelWork { ticket, kind: WorkKind::GangThaw, victim: None });
        }
    }

    fn finish_gang_freeze(&mut self, job: &str, outcome: Result<(), CgroupError>) {
        match outcome {
            Ok(()) => {
                if self.ledger.get(job).is_some() && !self.ledger.is_suspended(job) {
                    let _ = self.ledger.gang_freeze(job);
                }
                if let Some(status) = &mut self.gang_status {
                    status.frozen += 1;
                }
                self.gang_cycle_report(|r| r.frozen.push(job.to_string()));
            }
            Err(e) => {
                tracing::warn!(
                    "job {job}: freezing it for its row's turn failed; it keeps running: {e}"
                );
                self.gang_cycle_report(|r| r.failed.push(job.to_string()));
            }
        }
    }

    fn finish_gang_thaw(&mut self, job: &str, outcome: Result<(), CgroupError>) {
        match outcome {
            Ok(()) => self.gang_cycle_report(|r| r.thawed.push(job.to_string())),
            Err(e) => {
                if self.ledger.get(job).is_some() {
                    let _ = self.ledger.gang_freeze(job);
                }
                tracing::warn!("job {job}: thawing it for its slice failed: {e}");
                self.gang_cycle_report(|r| r.failed.push(job.to_string()));
            }
        }
    }

    fn gang_cycle_report(&mut self, f: impl FnOnce(&mut GangSwitch)) {
        if let Some(cycle) = &mut self.settling.gang_cycle {
            f(&mut cycle.report);
        }
    }

    /// Once no gang freeze or thaw is queued or under way: counts the switch in the gang status
    /// (when it changed anything) and logs it.
    fn end_gang_cycle_when_done(&mut self) {
        if self
            .settling
            .switching
            .values()
            .any(|kind| matches!(kind, WorkKind::GangFreeze | WorkKind::GangThaw))
        {
            return;
        }
        let Some(cycle) = self.settling.gang_cycle.take() else { return };
        let report = cycle.report;
        if let Some(status) = &mut self.gang_status {
            if !report.frozen.is_empty() || !report.thawed.is_empty() {
                status.switches += 1;
                status.last_switch_at = Some(topo_core::pending::format_utc_nanos(cycle.at));
                status.last_switch_us = cycle.began.elapsed().as_micros() as u64;
            }
            status.failed += report.failed.len() as u64;
        }
        if !report.frozen.is_empty() || !report.thawed.is_empty() {
            tracing::debug!(
                "gang slice of row {}: froze {:?}, thawed {:?} in {} us",
                report.active_row,
                report.frozen,
                report.thawed,
                cycle.began.elapsed().as_micros()
            );
        }
    }

    /// Resumes the jobs topod's preemption suspended whose CPUs are all free again, highest
    /// expansion factor first: free of running jobs, and of the job they were suspended for
    /// even while it is suspended itself (it would find its CPUs taken back). Each takes its
    /// CPUs back in the ledger now; the thaw follows (at once, or queued where deferred).
    /// Returns them. Who is tried, and in what order, is `topo_core::policy::resume_preempted`,
    /// which the cluster core runs too.
    pub fn resume_preempted(&mut self) -> Vec<String> {
        let now = self.now_s();
        let suspended: Vec<topo_core::policy::ToResume<String>> = self
            .ledger
            .suspended_jobs()
            .filter_map(|a| {
                let hint = self.hints.get(&a.job)?;
                let preemptor = hint.preempted_by.as_ref();
                Some(topo_core::policy::ToResume {
                    job: a.job.clone(),
                    xf: self.expansion_factor(hint, now).unwrap_or(0.0),
                    by_preemption: preemptor.is_some(),
                    // Not while its preemptor is being placed on its CPUs, nor while it is
                    // being released or changed.
                    kept: preemptor.is_some_and(|p| self.preemption.under_way.contains_key(p))
                        || self.releasing.contains(&a.job)
                        || self.changing.contains_key(&a.job)
                        || self.settling.switching.contains_key(&a.job),
                })
            })
            .collect();
        // A job its owner suspended holds nothing: its CPUs were lent, and its owner's resume
        // waits for this job (else an owner could keep it suspended).
        let by_owner = |job: &str| self.hints.get(job).is_some_and(|h| h.suspended_by.is_some());
        let holders: Vec<(String, CpuSet)> = self
            .ledger
            .suspended_jobs()
            .filter(|o| !by_owner(&o.job))
            .chain(self.ledger.gang_frozen_jobs())
            .map(|o| (o.job.clone(), o.cpus.clone()))
            .collect();
        topo_core::policy::resume_preempted(suspended, |job| {
            let Ok(id) = JobId::parse(job) else { return false };
            // Not onto CPUs a suspended job holds (its preemptor, or a borrower, suspended by
            // root: it would find them taken on its resume); running jobs' CPUs the ledger's
            // resume refuses. Free CPUs are its own again, even before its preemptor ends.
            let Some(cpus) = self.ledger.get(job).map(|a| a.cpus.clone()) else { return false };
            if holders.iter().any(|(o, held)| o != job && held.intersects(&cpus))
                || self.ledger.resume(job, None).is_err()
            {
                return false;
            }
            let ticket = self.freeze_ticket(id, false);
            self.kernel(KernelWork { ticket, kind: WorkKind::ResumePreempted, victim: None });
            true
        })
    }

    fn finish_resume_preempted(&mut self, id: &JobId, outcome: Result<(), CgroupError>) {
        let job = id.as_str().to_string();
        if self.ledger.get(&job).is_none() {
            // Released meanwhile.
            return;
        }
        if let Err(e) = outcome {
            tracing::warn!("job {job}: resuming it after preemption failed: {e}");
            let _ = self.ledger.suspend(&job);
            return;
        }
        if let Some(mut hint) = self.hints.get(&job).cloned() {
            let now = self.now_s();
            hint.suspended = false;
            hint.preempted_by = None;
            hint.clock.resume(now, Stopper::Preemption);
            self.record(id, &hint);
            self.hints.insert(job.clone(), hint);
        }
        tracing::info!(event = "resumed", job = %job, "job {job}: resumed on its CPUs after preemption");
    }
}

/// One gang job as a switch sees it.
struct GangMemberNow {
    job: String,
    row: u32,
    cpus: CpuSet,
    running: bool,
    should_run: bool,
}
