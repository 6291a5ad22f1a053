//! Running jobs given new CPUs: a malleable job grown or shrunk (`resize`), and the plans of
//! several moves at once that defragmentation and equipartition make.
//!
//! A plan is applied in four steps, each safe to cut short by a crash:
//! 1. the whole plan (every moved job's new allocation) is written to the state directory
//!    ([`Records::write_moves`]), after the ledger has checked the end state;
//! 2. each job's cgroup gets its new CPUs and memory nodes (shrinks first, so that the CPUs a
//!    grow takes have been left already); the kernel moves the job's threads, and its pages
//!    where the nodes change ([`CgroupBackend::update`]);
//! 3. the ledger takes the new allocations and each job's record its new tasks;
//! 4. the plan is removed, and each job is told: its notify file is rewritten with a new
//!    generation (`generation=`, `cpus=`, `mems=`; what libtopo's `topo_resize_wait` reads),
//!    then its `resize_signal`, if it chose one, goes to each of its processes (`super::notify`).
//!
//! A restart that finds a plan makes its moves again ([`Host::recover_moves`]): the plan was
//! whole and checked before the first cgroup changed, so finishing it is always consistent.
//! A cgroup the kernel refuses mid-plan is put back, with the moves made before it.

use super::super::records::PlannedMove;
use super::{Host, HostError, JobAsk, JobRecord};
use crate::cgroup::{CgroupError, CgroupSpec, JobId};
use std::collections::BTreeMap;
use topo_core::ledger::{Allocation, JobState, LedgerError};
use topo_core::place;
use topo_core::request;

impl Host {
    /// The protocol's `resize`: `Host::resize_to`, and `tasks` becomes the job's ceiling for
    /// equipartition ([`JobRecord::tasks_cap`]), kept in its record, until the next `resize`.
    pub fn resize(&mut self, job: &str, tasks: u32) -> Result<Allocation, HostError> {
        let before = self.hints.get(job).and_then(|h| h.tasks_cap);
        if let Some(hint) = self.hints.get_mut(job) {
            hint.tasks_cap = Some(tasks);
        }
        let resized = self.resize_to(job, tasks);
        let Some(hint) = self.hints.get(job).cloned() else { return resized };
        match &resized {
            // Recorded (again: a move's record has it already; a resize to the size the job
            // has moved nothing).
            Ok(_) if before != Some(tasks) => {
                if let Ok(id) = JobId::parse(job) {
                    self.record(&id, &hint);
                }
            }
            Ok(_) => {}
            Err(_) => {
                if let Some(hint) = self.hints.get_mut(job) {
                    hint.tasks_cap = before;
                }
            }
        }
        resized
    }

    /// Grows or shrinks the running malleable job `job` to `tasks` tasks within its request's
    /// range (`*min-max`), keeping its tasks where they are (see `topo_core::place::resize`),
    /// and tells it. Returns its new allocation.
    pub(crate) fn resize_to(&mut self, job: &str, tasks: u32) -> Result<Allocation, HostError> {
        self.check_changeable(job)?;
        let alloc =
            self.ledger.get(job).cloned().ok_or_else(|| HostError::UnknownJob(job.into()))?;
        let state = self.ledger.state_of(job).unwrap_or(JobState::Running);
        if state != JobState::Running {
            return Err(LedgerError::WrongState { job: job.into(), state }.into());
        }
        let req =
            request::parse(&alloc.request).ok().filter(request::Request::is_malleable).ok_or_else(
                || HostError::NotMalleable { job: job.into(), request: alloc.request.clone() },
            )?;
        let (min, max) = req.task_range();
        if !(min..=max).contains(&tasks) {
            return Err(HostError::OutOfRange { job: job.into(), tasks, min, max });
        }
        // A job recovered without its tasks' record whose CPUs do not divide into its tasks: a
        // shrink would keep the wrong CPUs, a grow place tasks beside ones that are not its.
        if self.hints.get(job).is_some_and(|h| h.tasks_unknown) {
            return Err(HostError::TasksUnknown {
                job: job.into(),
                cpus: alloc.cpus.to_string(),
                request: alloc.request.clone(),
            });
        }
        if tasks as usize == alloc.tasks.len() {
            return Ok(alloc);
        }
        // A grow never borrows a suspended job's CPUs (it is no job that fits nowhere else);
        // CPUs it borrows already it keeps.
        let mut occupancy = self.placement_occupancy(job, None);
        if let Some(mut held) = self.without_lending(&occupancy) {
            held.held.difference_with(&alloc.cpus);
            held.fenced.difference_with(&alloc.cpus);
            occupancy = held;
        }
        let placement =
            place::resize(&self.model, &occupancy, &req, &alloc.tasks, tasks, self.strategy)
                .map_err(|source| HostError::DoesNotFit {
                    job: job.into(),
                    source,
                    held_back: String::new(),
                })?;
        let resized = Allocation {
            cpus: placement.cpus,
            tasks: placement.tasks,
            mems: placement.mems,
            fenced: placement.fenced,
            ..alloc
        };
        self.apply_moves(vec![resized], "resized")?;
        self.ledger.get(job).cloned().ok_or_else(|| HostError::UnknownJob(job.into()))
    }

    /// Gives running jobs new allocations together (see the module documentation); `why` is
    /// the log's verb ("resized", "moved"). Moves to where a job already is are dropped.
    pub(crate) fn apply_moves(
        &mut self,
        moves: Vec<Allocation>,
        why: &'static str,
    ) -> Result<(), HostError> {
        let moves: Vec<Allocation> =
            moves.into_iter().filter(|m| self.ledger.get(&m.job) != Some(m)).collect();
        if moves.is_empty() {
            return Ok(());
        }
        for m in &moves {
            self.check_changeable(&m.job)?;
        }
        let mut next = self.ledger.clone();
        next.move_jobs(&moves)?;
        if let Some(records) = &self.records {
            let planned: Vec<PlannedMove> = moves
                .iter()
                .map(|m| PlannedMove {
                    to: m.clone(),
                    run: self.hints.get(&m.job).and_then(|h| h.allocated_at.clone()),
                })
                .collect();
            records.write_moves(&planned).map_err(HostError::Records)?;
        }
        let old: BTreeMap<&str, &Allocation> = moves
            .iter()
            .filter_map(|m| self.ledger.get(&m.job).map(|a| (m.job.as_str(), a)))
            .collect();
        let mut order: Vec<&Allocation> = moves.iter().collect();
        order.sort_by_key(|m| old.get(m.job.as_str()).is_none_or(|o| !m.cpus.is_subset(&o.cpus)));
        let mut done: Vec<(JobId, &Allocation)> = Vec::new();
        for m in order {
            let id = JobId::parse(&m.job)?;
            let spec = CgroupSpec {
                cpus: m.cpus.clone(),
                mems: m.mems.clone(),
                memory_limit: None,
                ..Default::default()
            };
            if let Err(e) = self.backend.update(&id, &spec) {
                // Put back what was moved, newest first, so that no CPU ends up in two jobs.
                for (id, _) in done.iter().rev() {
                    if let Some(o) = old.get(id.as_str()) {
                        let back = CgroupSpec {
                            cpus: o.cpus.clone(),
                            mems: o.mems.clone(),
                            memory_limit: None,
                            ..Default::default()
                        };
                        if let Err(undo) = self.backend.update(id, &back) {
                            tracing::error!(
                                "job {id}: could not be put back on CPUs {}: {undo}",
                                o.cpus
                            );
                        }
                    }
                }
                if let Some(records) = &self.records {
                    let _ = records.remove_moves();
                }
                return Err(e.into());
            }
            done.push((id, m));
        }
        self.ledger = next;
        let now = self.now_s();
        let mut recorded = true;
        for m in &moves {
            let hint = self.hints.entry(m.job.clone()).or_insert_with(|| JobRecord {
                ask: JobAsk { request: m.request.clone(), ..JobAsk::default() },
                ..JobRecord::default()
            });
            hint.tasks = m.tasks.clone();
            hint.moved_at = Some(now);
            hint.notify_generation = hint.notify_generation.max(1).saturating_add(1);
            let hint = hint.clone();
            if let (Ok(id), Some(records)) = (JobId::parse(&m.job), &self.records) {
                if let Err(e) = records.write(&id, &hint) {
                    tracing::error!("job {id}: {e}; the plan of moves stays, so that a restart makes the move again and records it");
                    recorded = false;
                }
            }
        }
        for m in &moves {
            tracing::info!(
                event = why,
                job = %m.job,
                cpus = %m.cpus,
                mems = %m.mems,
                "job {}: {why} to CPUs {} (memory nodes {}, {} tasks)",
                m.job,
                m.cpus,
                m.mems,
                m.tasks.len()
            );
            self.tell(&m.job, true);
            if let Some(reporter) = &self.batch_reporter {
                reporter.report_change(&m.job, why, &m.cpus, now);
            }
        }
        // Only now: a crash before this makes the moves again at the restart, and the jobs are
        // told again (file and signal), so none misses its signal.
        if let (true, Some(records)) = (recorded, &self.records) {
            if let Err(e) = records.remove_moves() {
                tracing::warn!("{e}");
            }
        }
        Ok(())
    }

    /// Finishes the plan of moves a crash cut short (see the module documentation): each job
    /// still there gets its planned CPUs, and its record (in `hints`) its planned tasks. Returns
    /// the jobs moved.
    pub(crate) fn recover_moves(&mut self, hints: &mut BTreeMap<String, JobRecord>) -> Vec<String> {
        let Some(records) = self.records.clone() else { return Vec::new() };
        let moves = match records.load_moves() {
            Ok(Some(moves)) => moves,
            Ok(None) => return Vec::new(),
            Err(e) => {
                tracing::error!("{e}; the jobs it moved keep the CPUs their cgroups have");
                let _ = records.remove_moves();
                return Vec::new();
            }
        };
        // Only moves of the run each was planned for (a job released and allocated again since,
        // a requeue, is not moved by an old plan), and only when what they lead to holds no CPU
        // another job's cgroup has: a plan that does not fit what is there is not trusted.
        let moves: Vec<Allocation> = moves
            .into_iter()
            .filter(|m| {
                let now_run = hints.get(&m.to.job).and_then(|h| h.allocated_at.as_ref());
                let same = m.run.is_none() || m.run.as_ref() == now_run;
                if !same {
                    tracing::warn!(
                        "job {}: a plan of moves for an earlier run of it is dropped",
                        m.to.job
                    );
                }
                same
            })
            .map(|m| m.to)
            .collect();
        let others = self.backend.list().unwrap_or_default();
        let clash = moves.iter().enumerate().find_map(|(i, m)| {
            let other_job = others
                .iter()
                .filter(|(j, _)| !moves.iter().any(|n| n.job == j.as_str()))
                .find(|(_, e)| e.cpus.intersects(&m.cpus))
                .map(|(j, _)| j.to_string());
            let other_move =
                moves[..i].iter().find(|n| n.cpus.intersects(&m.cpus)).map(|n| n.job.clone());
            other_job.or(other_move).map(|o| (m.job.clone(), o))
        });
        if let Some((job, other)) = clash {
            tracing::error!("the plan of moves would put job {job} on CPUs job {other} has; dropped, every job keeps the CPUs its cgroup has");
            let _ = records.remove_moves();
            return Vec::new();
        }
        let mut moved = Vec::new();
        for m in moves {
            let Ok(id) = JobId::parse(&m.job) else { continue };
            let spec = CgroupSpec {
                cpus: m.cpus.clone(),
                mems: m.mems.clone(),
                memory_limit: None,
                ..Default::default()
            };
            match self.backend.update(&id, &spec) {
                Ok(_) => {
                    if let Some(hint) = hints.get_mut(&m.job) {
                        hint.tasks = m.tasks.clone();
                        hint.moved_at = Some(self.now_s());
                        hint.notify_generation = hint.notify_generation.max(1).saturating_add(1);
                        self.record(&id, hint);
                    }
                    tracing::info!(
                        "job {}: a move a restart cut short is made: CPUs {}",
                        m.job,
                        m.cpus
                    );
                    moved.push(m.job);
                }
                // Released since: nothing to move.
                Err(CgroupError::NoSuchJob(_)) => {}
                Err(e) => tracing::error!(
                    "job {}: the planned move to CPUs {} failed: {e}",
                    m.job,
                    m.cpus
                ),
            }
        }
        if let Err(e) = records.remove_moves() {
            tracing::warn!("{e}");
        }
        moved
    }
}

/// The signal a job may choose to hear about its resizes by: a standard signal it can catch
/// (1 to 31 on Linux, not SIGKILL or SIGSTOP; SIGUSR1 and SIGUSR2 are the usual choices). It
/// goes only to the job's processes that catch it (see `Host::tell`).
pub fn check_resize_signal(signal: i32) -> Result<i32, String> {
    use nix::sys::signal::Signal;
    match Signal::try_from(signal) {
        Ok(Signal::SIGKILL | Signal::SIGSTOP) | Err(_) => Err(format!(
            "resize_signal = {signal}: a standard signal number the job can catch, e.g. {} (SIGUSR1) or {} (SIGUSR2); not SIGKILL or SIGSTOP",
            Signal::SIGUSR1 as i32,
            Signal::SIGUSR2 as i32
        )),
        Ok(_) => Ok(signal),
    }
}
