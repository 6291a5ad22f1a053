//! Space over time on this host: equipartition of the CPUs rigid jobs leave among the malleable
//! jobs (`equipartition` in topod.toml), and defragmenting migration (`defrag`): when a job does
//! not fit although enough CPUs are free, running jobs are moved, each within its own request,
//! so that it does. Both decide with the policy core (`topo_core::malleable`,
//! `topo_core::defrag`) and carry out with the moves of [`super::moves`].
//!
//! Delay timers, as the Cray T3E's psched had them, keep migration from thrashing: a job is not
//! moved before it has run `migrate_min_run_s`, nor again within `migrate_gap_s` of its last
//! move (or resize).

use super::{Host, HostError, Prepared};
use topo_core::cpuset::CpuSet;
use topo_core::defrag::{self, Movable};
use topo_core::ledger::{Allocation, JobState};
use topo_core::malleable::{self, Malleable};
use topo_core::policy::{Defrag, NotMovable, RunClock};
use topo_core::request::{self, Request};

/// A job arriving on the host, for equipartition's shares beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// A rigid job that takes this many CPUs (its own and those it fences).
    Rigid(u64),
    /// A malleable job, which takes its share with the others.
    Malleable(Malleable),
}

/// What [`Host::defragment_for`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Defragged {
    /// Running jobs were moved: the arrival fits now.
    Moved,
    /// Nothing moved; with why, when only topod's timers kept the jobs that would make room
    /// in place (`migrate_min_run_s`, `migrate_gap_s`), for the refusal.
    NoRoom(Option<String>),
}

impl Host {
    /// Turns equipartition of the malleable jobs on or off.
    pub fn set_equipartition(&mut self, on: bool) {
        self.equipartition = on;
    }

    /// Turns defragmenting migration on (`Some`) or off.
    pub fn set_defrag(&mut self, defrag: Option<Defrag>) {
        self.defrag = defrag;
    }

    /// The running malleable jobs that may be resized, in the order they were allocated (the
    /// tie-break equipartition keeps from one rebalance to the next), with their requests.
    fn malleable_jobs(&self) -> Vec<(Allocation, Request)> {
        let mut jobs: Vec<(Option<String>, Allocation, Request)> = self
            .ledger
            .jobs()
            .filter(|a| a.gang_row.is_none() && !self.releasing.contains(&a.job))
            .filter(|a| !self.changing.contains_key(&a.job))
            // Tasks not known (see JobRecord::tasks_unknown): as rigid as it is.
            .filter(|a| !self.hints.get(&a.job).is_some_and(|h| h.tasks_unknown))
            .filter_map(|a| {
                let req = request::parse(&a.request).ok().filter(Request::is_malleable)?;
                let at = self.hints.get(&a.job).and_then(|h| h.allocated_at.clone());
                Some((at, a.clone(), req))
            })
            .collect();
        jobs.sort_by(|a, b| (&a.0, &a.1.job).cmp(&(&b.0, &b.1.job)));
        jobs.into_iter().map(|(_, a, r)| (a, r)).collect()
    }

    /// The malleable jobs with the sizes equipartition gives them beside `arrival` (see
    /// [`Arrival`]; `None`: the jobs alone); `None` when there is no such share (none
    /// malleable, or their least sizes do not fit). A suspended job's CPUs are not shared out:
    /// a malleable job grown onto them would keep it from resuming.
    fn equipartition_targets(
        &self,
        arrival: Option<Arrival>,
    ) -> Option<Vec<(Allocation, Request, u32)>> {
        let jobs = self.malleable_jobs();
        if jobs.is_empty() {
            return None;
        }
        let occupancy = self.placement_occupancy("", None);
        let occupancy = self.without_lending(&occupancy).unwrap_or(occupancy);
        let mut free = occupancy.free(&self.model).len() as u64;
        let mut shapes: Vec<Malleable> = jobs
            .iter()
            .map(|(a, r)| {
                let (min, max) = r.task_range();
                // No further than its last resize asked for.
                let cap = self.hints.get(&a.job).and_then(|h| h.tasks_cap);
                let max = cap.map_or(max, |c| c.clamp(min, max));
                let per_task = (a.cpus.len() / a.tasks.len().max(1)).max(1);
                free += a.cpus.len() as u64;
                Malleable { min, max, pus_per_task: per_task as u32 }
            })
            .collect();
        // A rigid arrival's CPUs are set aside; a malleable one takes its share with the others.
        let set_aside = match arrival {
            Some(Arrival::Rigid(pus)) => pus,
            Some(Arrival::Malleable(m)) => {
                shapes.push(m);
                0
            }
            None => 0,
        };
        let free = u32::try_from(free.saturating_sub(set_aside)).unwrap_or(u32::MAX);
        match malleable::equipartition(free, &shapes) {
            Ok(t) => Some(jobs.into_iter().zip(t).map(|((a, r), t)| (a, r, t)).collect()),
            Err(e) => {
                if arrival.is_none() {
                    tracing::warn!("equipartition: {e}; the malleable jobs keep their sizes");
                }
                None
            }
        }
    }

    /// Shrinks, all at once, the jobs of `targets` that are above their target (each keeps its
    /// first tasks); returns the jobs shrunk, or `None` when the shrinks failed.
    fn shrink_to_targets(
        &mut self,
        targets: &[(Allocation, Request, u32)],
        why: &'static str,
    ) -> Option<Vec<String>> {
        let mut shrinks = Vec::new();
        for (a, r, t) in targets {
            if (*t as usize) < a.tasks.len() {
                let occ = self.placement_occupancy(&a.job, None);
                if let Ok(p) =
                    topo_core::place::resize(&self.model, &occ, r, &a.tasks, *t, self.strategy)
                {
                    shrinks.push(Allocation {
                        cpus: p.cpus,
                        tasks: p.tasks,
                        mems: p.mems,
                        fenced: p.fenced,
                        ..a.clone()
                    });
                }
            }
        }
        let shrunk: Vec<String> = shrinks.iter().map(|a| a.job.clone()).collect();
        match self.apply_moves(shrinks, why) {
            Ok(()) => Some(shrunk),
            Err(e) => {
                tracing::warn!("equipartition: the shrinks failed: {e}");
                None
            }
        }
    }

    /// Shares the CPUs that rigid jobs leave among the malleable jobs by equipartition: shrinks
    /// first, then grows, each job told. A grow that does not fit in the job's shape is made as
    /// large as fits. Returns the jobs resized. Nothing without `equipartition`.
    pub fn rebalance(&mut self) -> Vec<String> {
        if !self.equipartition {
            return Vec::new();
        }
        let Some(targets) = self.equipartition_targets(None) else { return Vec::new() };
        // Shrinks first, all at once: what they leave is what the grows take.
        let Some(mut changed) = self.shrink_to_targets(&targets, "shrunk by equipartition") else {
            return Vec::new();
        };
        for (a, _, t) in &targets {
            let now = a.tasks.len() as u32;
            // As large as fits, from the target down.
            for n in (now + 1..=*t).rev() {
                if self.resize_to(&a.job, n).is_ok() {
                    changed.push(a.job.clone());
                    break;
                }
            }
        }
        changed
    }

    /// Makes room for `arrival` by shrinking the malleable jobs to the shares equipartition
    /// gives them beside it (each job resized once, to where the rebalance after the arrival
    /// leaves it); returns whether any shrank.
    pub(crate) fn shrink_for_arrival(&mut self, arrival: Arrival) -> bool {
        let Some(targets) = self.equipartition_targets(Some(arrival)) else { return false };
        self.shrink_to_targets(&targets, "shrunk by equipartition for an arrival")
            .is_some_and(|shrunk| !shrunk.is_empty())
    }

    /// What `prepared` would take (see [`Arrival`]) with every malleable job at its least size
    /// (their first tasks kept, as a shrink keeps them), if it fits so: only then are they
    /// shrunk for it, so that a request no shrink can help (or its retries) does not resize
    /// every malleable job twice.
    pub(crate) fn fits_with_mins(
        &self,
        job: &str,
        prepared: &Prepared,
        owner_uid: Option<u32>,
    ) -> Option<Arrival> {
        let who = topo_core::prime::Asker {
            queue: prepared.ask.queue.as_deref(),
            owner: owner_uid,
            pool: prepared.ask.pool.as_deref(),
        };
        let (mut occupancy, _) =
            self.placement_occupancy_as(job, None, who, self.ends_by(prepared));
        for (a, r) in self.malleable_jobs() {
            let (min, _) = r.task_range();
            let kept = CpuSet::union_all(&a.tasks[..(min as usize).min(a.tasks.len())]);
            occupancy.held.difference_with(&a.cpus.difference(&kept));
        }
        let request =
            self.start_size(&prepared.request).unwrap_or_else(|| prepared.request.clone());
        let placed =
            topo_core::place::place(&self.model, &occupancy, &request, self.strategy).ok()?;
        if prepared.request.is_malleable() {
            let (min, max) = prepared.request.task_range();
            let per_task = (placed.cpus.len() / placed.tasks.len().max(1)).max(1);
            return Some(Arrival::Malleable(Malleable { min, max, pus_per_task: per_task as u32 }));
        }
        Some(Arrival::Rigid((placed.cpus.len() + placed.fenced.len()) as u64))
    }

    /// Shrinks every malleable job to its least size (to make room for an arrival); returns
    /// whether any shrank.
    pub(crate) fn shrink_to_mins(&mut self) -> bool {
        let mut any = false;
        for (a, r) in self.malleable_jobs() {
            let (min, _) = r.task_range();
            if a.tasks.len() > min as usize && self.resize_to(&a.job, min).is_ok() {
                any = true;
            }
        }
        any
    }

    /// The running jobs the planner considers (not gang-scheduled, not being released or
    /// changed, not given GPUs: a move could take it away from them), each with the time from
    /// which it may be moved ([`Defrag::movable_from`]: as for preemption, its owner's suspend
    /// and resume do not restart the time).
    fn defrag_candidates<'a>(
        &'a self,
        cfg: &'a Defrag,
    ) -> impl Iterator<Item = (&'a Allocation, topo_core::policy::Time)> + 'a {
        self.ledger
            .jobs()
            .filter(|a| {
                a.gang_row.is_none() && self.ledger.state_of(&a.job) == Some(JobState::Running)
            })
            .filter(|a| !self.releasing.contains(&a.job) && !self.changing.contains_key(&a.job))
            .filter(|a| self.hints.get(&a.job).is_none_or(|h| h.ask.gpus.is_empty()))
            .map(|a| {
                let hint = self.hints.get(&a.job);
                let unknown = RunClock::default();
                let clock = hint.map_or(&unknown, |h| &h.clock);
                let from = cfg.movable_from(clock, hint.and_then(|h| h.moved_at));
                (a, from)
            })
    }

    /// What the planner would work with at an allocate, for the free map (schedulers run the
    /// same plan); `None` without `defrag`.
    pub(crate) fn defrag_view(&self) -> Option<topo_core::proto::reply::DefragView> {
        let cfg = self.defrag.as_ref()?;
        Some(topo_core::proto::reply::DefragView {
            strategy: self.strategy,
            limits: cfg.limits,
            jobs: self
                .defrag_candidates(cfg)
                .map(|(a, movable_from)| topo_core::proto::reply::MovableJob {
                    job: a.job.clone(),
                    request: a.request.clone(),
                    cpus: a.cpus.clone(),
                    fenced: a.fenced.clone(),
                    tasks: a.tasks.clone(),
                    // Plain seconds for JSON readers that hold numbers as doubles.
                    movable_from: (movable_from < topo_core::policy::Time::MAX)
                        .then_some(movable_from.max(0)),
                })
                .collect(),
        })
    }

    /// Moves running jobs so that `prepared` fits, when defragmentation is on and the planner
    /// finds moves within its limits and the delay timers; returns whether it moved any.
    pub(crate) fn defragment_for(
        &mut self,
        job: &str,
        prepared: &Prepared,
        owner_uid: Option<u32>,
    ) -> Result<Defragged, HostError> {
        let Some(cfg) = self.defrag else { return Ok(Defragged::NoRoom(None)) };
        let now = self.now_s();
        let who = topo_core::prime::Asker {
            queue: prepared.ask.queue.as_deref(),
            owner: owner_uid,
            pool: prepared.ask.pool.as_deref(),
        };
        let (occupancy, _) = self.placement_occupancy_as(job, None, who, self.ends_by(prepared));
        let running: Vec<(Allocation, Request, bool)> = self
            .defrag_candidates(&cfg)
            .filter_map(|(a, movable_from)| {
                let req = request::parse(&a.request).ok()?;
                Some((a.clone(), req, movable_from <= now))
            })
            .collect();
        let movables: Vec<Movable<'_, String>> = running
            .iter()
            .map(|(a, r, may)| Movable::from_allocation(a.job.clone(), r, a, *may))
            .collect();
        let request = match self.start_size(&prepared.request) {
            Some(r) => r,
            None => prepared.request.clone(),
        };
        let began = std::time::Instant::now();
        // First with every open prime pool and every reserved block kept out for all (a plan
        // that moves no job where it may not go, the arriving job kept out of its own pool or
        // block too); failing that, with the arriving job's view, the moves checked below.
        let mut strict = occupancy.clone();
        for (pool, open) in self.pools() {
            if open {
                strict.fenced.union_with(&pool.cpus);
            }
        }
        for r in self.reservations() {
            strict.fenced.union_with(&r.cpus);
        }
        strict.fenced.difference_with(&strict.held);
        let plan = defrag::plan_moves(
            &self.model,
            &strict,
            &movables,
            &request,
            self.strategy,
            cfg.limits,
        )
        .or_else(|| {
            defrag::plan_moves(
                &self.model,
                &occupancy,
                &movables,
                &request,
                self.strategy,
                cfg.limits,
            )
        });
        let Some(plan) = plan.filter(|p| !p.moves.is_empty()) else {
            // Would moving the jobs the timers keep in place have made room? Then say so.
            let held: Vec<&(Allocation, Request, bool)> =
                running.iter().filter(|(_, _, may)| !may).collect();
            if held.is_empty() {
                return Ok(Defragged::NoRoom(None));
            }
            let unlocked: Vec<Movable<'_, String>> = running
                .iter()
                .map(|(a, r, _)| Movable::from_allocation(a.job.clone(), r, a, true))
                .collect();
            let plan = defrag::plan_moves(
                &self.model,
                &occupancy,
                &unlocked,
                &request,
                self.strategy,
                cfg.limits,
            );
            let Some(plan) = plan.filter(|p| !p.moves.is_empty()) else {
                return Ok(Defragged::NoRoom(None));
            };
            let why: Vec<String> = plan
                .moves
                .iter()
                .filter_map(|m| held.iter().find(|(a, _, _)| a.job == m.key))
                .map(|(a, _, _)| {
                    let hint = self.hints.get(&a.job);
                    let unknown = RunClock::default();
                    let clock = hint.map_or(&unknown, |h| &h.clock);
                    match cfg.kept_in_place(now, clock, hint.and_then(|h| h.moved_at)) {
                        Some(NotMovable::MovedRecently { ago, gap }) => format!(
                            "job {} was moved or resized {ago} s ago, less than migrate_gap_s {gap}",
                            a.job
                        ),
                        Some(NotMovable::TooEarly { ran, min_run }) => format!(
                            "job {} has run {ran} s, less than migrate_min_run_s {min_run}",
                            a.job
                        ),
                        // Movable by the time this ran: the planner found no room even so.
                        None => format!("job {} may move but no room was found for it", a.job),
                    }
                })
                .collect();
            return Ok(Defragged::NoRoom((!why.is_empty()).then(|| {
                format!("it would fit after moving jobs that may not move yet: {}", why.join("; "))
            })));
        };
        // Each moved job must land where it may go itself: outside the open prime pools that
        // do not admit it and the blocks reserved for other jobs (the plan was made with the
        // arriving job's view of them).
        for m in &plan.moves {
            let mut own = self.placement_occupancy(&m.key, None);
            if let Some(a) = self.ledger.get(&m.key) {
                own.held.difference_with(&a.cpus);
                own.fenced.difference_with(&a.fenced);
            }
            let mut barred = own.fenced.intersection(&m.placement.cpus);
            barred.union_with(&own.held.intersection(&m.placement.cpus));
            // What the arriving job and the other moved jobs take is the plan's own business.
            for other in plan.moves.iter().filter(|o| o.key != m.key) {
                if let Some(a) = self.ledger.get(&other.key) {
                    barred.difference_with(&a.cpus);
                }
            }
            if !barred.is_empty() {
                tracing::info!("job {job}: no room made: moving job {} would put it on CPUs {barred} it may not use", m.key);
                return Ok(Defragged::NoRoom(None));
            }
        }
        let moves: Vec<Allocation> = plan
            .moves
            .iter()
            .filter_map(|m| {
                let a = self.ledger.get(&m.key)?;
                Some(Allocation {
                    cpus: m.placement.cpus.clone(),
                    tasks: m.placement.tasks.clone(),
                    mems: m.placement.mems.clone(),
                    fenced: m.placement.fenced.clone(),
                    ..a.clone()
                })
            })
            .collect();
        tracing::info!(
            event = "defragment",
            job = %job,
            moves = moves.len(),
            moved_pus = plan.moved_pus(),
            planned_us = began.elapsed().as_micros() as u64,
            "job {job}: moving {} running job(s) ({} CPUs) to make room",
            moves.len(),
            plan.moved_pus()
        );
        self.apply_moves(moves, "moved to make room")?;
        Ok(Defragged::Moved)
    }

    /// The request a malleable job is placed with at the least (its `min` tasks, rigid); `None`
    /// for a rigid job.
    fn start_size(&self, req: &Request) -> Option<Request> {
        req.is_malleable().then(|| Request { tasks_max: None, ..req.clone() })
    }
}
