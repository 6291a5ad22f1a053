//! topod's preemption at allocate (after NCI's PBS), by the per-host rules in
//! `topo_core::policy` that the simulator's cluster core applies too: who may be suspended for
//! whom (`preemption_on_host`, told what only the host knows by [`Host::kept_by_host`]), the
//! CPUs held for a suspended job and who may borrow them (`may_borrow`, `holds_for_suspended`),
//! and when a victim runs again ([`Host::resume_preempted`], in `super::settle`). The
//! differential test `super::agrees` checks that topod and the cluster core decide alike.
use super::*;

/// Preemption on this host: its rules (`None`: allocates never suspend jobs) and the
/// preemptors whose victims are being frozen, by job.
#[derive(Default)]
pub(crate) struct Preemption {
    pub(crate) rules: Option<topo_core::policy::Preempt>,
    pub(crate) under_way: BTreeMap<String, Preempting>,
}

/// A preemption whose victims are being frozen (without the host lock): the allocate asked
/// again places the job.
pub(crate) struct Preempting {
    /// The jobs chosen for it, with their records as they were before.
    victims: Vec<(JobId, JobRecord)>,
    /// Its expansion factor, for the log.
    xf: f64,
}

impl Preempting {
    /// Whether a victim's freeze is still queued or under way.
    pub(crate) fn freezing(&self, host: &Host) -> bool {
        self.victims.iter().any(|(v, _)| host.is_switching(v.as_str()))
    }
}

impl Host {
    /// For a refusal: `; CPUs ... are held for job V, suspended by preemption for job P ...`
    /// for each job suspended by preemption whose free CPUs `job` (ending at `ends_by`) may not
    /// borrow; else empty.
    pub(super) fn held_for_preempted_note(&self, job: &str, ends_by: Option<i64>) -> String {
        let running = self.ledger.occupancy_for(None);
        let mut note = String::new();
        for a in self.ledger.suspended_jobs() {
            let Some(hint) = self.hints.get(&a.job) else { continue };
            let Some(preemptor) = hint.preempted_by.as_deref().filter(|p| *p != job) else {
                continue;
            };
            let resume_by = self.resume_by(hint);
            if topo_core::policy::may_borrow(ends_by, resume_by) {
                continue;
            }
            let idle = a.cpus.difference(&running.held);
            if idle.is_empty() {
                continue;
            }
            let until = match resume_by {
                Some(t) => format!(
                    "until about {} s from now, its preemptor's time limit",
                    (t - self.now_s()).max(0)
                ),
                None if self.preemption.under_way.contains_key(preemptor) => {
                    format!("while job {preemptor} is being started on them")
                }
                None => format!("while job {preemptor} is suspended or has no time limit"),
            };
            let asked = if ends_by.is_some() {
                "its estimate_s ends later"
            } else {
                "it gave no estimate_s"
            };
            note += &format!(
                "; CPUs {idle} are held for job {}, suspended by preemption for job {preemptor}, {until} (only a job that ends by then may use them; {asked})",
                a.job
            );
        }
        note
    }

    /// A job's expansion factor now (`topo_core::policy::expansion_factor`): its time since
    /// submission and its estimate less what it has run; `None` without a submission time and
    /// estimate.
    pub(super) fn expansion_factor(&self, hint: &JobRecord, now: i64) -> Option<f64> {
        Some(hint.clock.expansion_factor(now, hint.ask.submitted_at?, hint.ask.estimate_s?))
    }

    /// Suspends the running jobs that free the tightest domain for `prepared` (see
    /// `topo_core::policy::victims_on_host`) and places it; when it still does not fit, they
    /// run again and `refused` is returned.
    pub(super) fn preempt_and_place(
        &mut self,
        id: &JobId,
        prepared: &Prepared,
        mem_limit: Option<u64>,
        owner_uid: Option<u32>,
        refused: HostError,
    ) -> Result<(), HostError> {
        let Some(rules) = self.preemption.rules else { return Err(refused) };
        let now = self.now_s();
        let me = JobRecord { ask: prepared.ask.clone(), ..JobRecord::default() };
        // Who may be suspended and for whom: the steps topod shares with the policy core
        // (`topo_core::policy::preemption_on_host`); topod only says what its host knows.
        let my_xf = match topo_core::policy::may_preempt(&rules, self.expansion_factor(&me, now)) {
            Ok(xf) => xf,
            Err(why) => {
                tracing::info!(
                    "job {id}: does not fit, and may not preempt: {}",
                    self.say_not_preempted(&why)
                );
                return Err(not_preempted(refused, &self.say_not_preempted(&why)));
            }
        };
        let in_the_way: Vec<topo_core::policy::InTheWay<String>> = self
            .ledger
            .jobs()
            // A job outside the CPUs the request may use frees nothing for it.
            .filter(|a| prepared.request.cpu_list.as_ref().is_none_or(|l| a.cpus.intersects(l)))
            .filter_map(|a| {
                let hint = self.hints.get(&a.job)?;
                Some(topo_core::policy::InTheWay {
                    job: a.job.clone(),
                    cpus: a.cpus.clone(),
                    fenced: a.fenced.clone(),
                    procs: a.cpus.len() as u32,
                    ran: hint.clock.protected_for(now),
                    suspensions: hint.clock.suspensions,
                    xf: self.expansion_factor(hint, now),
                    kept: self.kept_by_host(&a.job, hint),
                })
            })
            .collect();
        let (model, strategy) = (self.model.clone(), self.strategy);
        let mut fits_in = |domain: &CpuSet, occ: &place::Occupancy| {
            let mut request = prepared.request.clone();
            request.cpu_list = Some(match &request.cpu_list {
                Some(list) => list.intersection(domain),
                None => domain.clone(),
            });
            topo_core::policy::start_on_host(&model, occ, &request, strategy).is_ok()
        };
        // Where it would go: with the CPUs of suspended jobs it may borrow (it ends before they
        // may resume), as its placement will see them.
        let who = topo_core::prime::Asker {
            queue: prepared.ask.queue.as_deref(),
            owner: owner_uid,
            pool: prepared.ask.pool.as_deref(),
        };
        let ends_by = self.ends_by(prepared);
        let (occupancy, _) = self.placement_occupancy_as(id.as_str(), None, who, ends_by);
        let chosen = topo_core::policy::preemption_on_host(
            &rules,
            my_xf,
            in_the_way,
            |job: &String| self.holds_for_preempted(job),
            &model,
            &occupancy,
            &mut fits_in,
        );
        let victims = match chosen {
            Ok(victims) => victims,
            Err(why) => return Err(not_preempted(refused, &self.say_not_preempted(&why))),
        };
        // Under way from the first freeze: a victim whose freeze ends after the job gave up
        // runs again (`finish_victim`).
        self.preemption
            .under_way
            .insert(id.to_string(), Preempting { victims: Vec::new(), xf: my_xf });
        for victim in &victims {
            let Ok(vid) = JobId::parse(victim) else { continue };
            let before = self.hints.get(victim).cloned().unwrap_or_default();
            let mut after = before.clone();
            after.suspended = true;
            after.suspended_by = None;
            after.preempted_by = Some(id.to_string());
            after.clock.stop(now, Stopper::Preemption);
            // The record first, as for every suspend: a crash after the freeze finds it suspended.
            if self.write_record(&vid, &after).is_err() {
                continue;
            }
            if let Some(p) = self.preemption.under_way.get_mut(id.as_str()) {
                p.victims.push((vid.clone(), before.clone()));
            }
            self.change_victim(vid, true, settle::VictimHints { before, after });
        }
        if self.settling.defer_waits {
            // The freezes run without the lock; the same allocate, asked again once they are
            // done, places the job (`place_preemptor`).
            return Err(HostError::PreemptionUnderWay(id.to_string()));
        }
        let Some(under_way) = self.preemption.under_way.remove(id.as_str()) else {
            return Err(not_preempted(refused, "its preemption was given up"));
        };
        self.place_preemptor(id, prepared, mem_limit, owner_uid, under_way)
    }

    /// Places a preemptor once its victims are frozen (those whose freeze failed run on); when
    /// it does not fit even so, they run again.
    pub(super) fn place_preemptor(
        &mut self,
        id: &JobId,
        prepared: &Prepared,
        mem_limit: Option<u64>,
        owner_uid: Option<u32>,
        under_way: Preempting,
    ) -> Result<(), HostError> {
        let mine = |host: &Host, victim: &JobId| {
            host.ledger.is_suspended(victim.as_str())
                && host.hints.get(victim.as_str()).and_then(|h| h.preempted_by.as_deref())
                    == Some(id.as_str())
        };
        let victims: Vec<(JobId, JobRecord)> =
            under_way.victims.into_iter().filter(|(v, _)| mine(self, v)).collect();
        let placed = self.place_and_create(id, prepared, mem_limit, owner_uid, None);
        let victims = match placed {
            Ok(()) => {
                // A victim whose CPUs it did not take (others came free while the freezes ran,
                // e.g. a job its owner suspended) runs on at once, as if never suspended: its
                // record as before, the suspension not counted (as the policy core undoes it).
                let took = self.ledger.get(id.as_str()).map(|a| a.cpus.clone()).unwrap_or_default();
                let (needed, spared): (Vec<_>, Vec<_>) = victims.into_iter().partition(|(v, _)| {
                    self.ledger.get(v.as_str()).is_some_and(|a| a.cpus.intersects(&took))
                });
                if !spared.is_empty() {
                    let names: Vec<&str> = spared.iter().map(|(v, _)| v.as_str()).collect();
                    tracing::info!("job {id}: placed without the CPUs of job(s) {names:?} suspended for it; they run again");
                    self.undo_preemption(id.as_str(), spared);
                }
                needed
            }
            Err(_) => victims,
        };
        let names: Vec<&str> = victims.iter().map(|(v, _)| v.as_str()).collect();
        match placed {
            Ok(()) => {
                for victim in &names {
                    tracing::info!(event = "suspended", job = %victim, by = %id, "job {victim}: suspended for job {id}");
                }
                tracing::info!(
                    "job {id}: suspended job(s) {names:?} to start it (expansion factor {:.2}); they resume when their CPUs are free",
                    under_way.xf
                );
                Ok(())
            }
            Err(refused) => {
                let why = if names.is_empty() {
                    "suspending the jobs chosen for it failed (the log says why)".to_string()
                } else {
                    format!("it did not fit even with job(s) {} suspended", names.join(", "))
                };
                self.undo_preemption(id.as_str(), victims);
                Err(not_preempted(refused, &why))
            }
        }
    }

    /// A preemption whose allocate did not come back to place its job (it was refused on the
    /// way, e.g. released meanwhile): its victims run again. Nothing when there is none.
    pub fn abandon_preemption(&mut self, job: &str) {
        if let Some(under_way) = self.preemption.under_way.remove(job) {
            tracing::info!("job {job}: not started; the jobs suspended for it run again");
            self.undo_preemption(job, under_way.victims);
        }
    }

    /// Every victim still suspended for `preemptor` runs again, as its record said before.
    fn undo_preemption(&mut self, preemptor: &str, victims: Vec<(JobId, JobRecord)>) {
        for (vid, before) in victims {
            let Some(after) = self.hints.get(vid.as_str()).cloned() else { continue };
            if !self.ledger.is_suspended(vid.as_str())
                || after.preempted_by.as_deref() != Some(preemptor)
            {
                continue;
            }
            if self.ledger.resume(vid.as_str(), None).is_ok() {
                self.change_victim(vid, false, settle::VictimHints { before, after });
            }
        }
    }

    /// What only this host knows that keeps a running job from being suspended for another,
    /// whatever the rules of `topo_core::policy::Preempt` say; `None` when nothing does.
    pub(super) fn kept_by_host(&self, job: &str, hint: &JobRecord) -> Option<String> {
        let gang = self.ledger.get(job).is_some_and(|a| a.gang_row.is_some());
        if !hint.ask.preemptible {
            Some(format!("job {job} did not say it may be suspended (preemptible)"))
        } else if self.ledger.is_suspended(job) {
            // It runs on nothing to free, and its suspension is somebody else's.
            Some(format!("job {job} is suspended already"))
        } else if gang {
            Some(format!("job {job} is gang-scheduled"))
        } else if self.releasing.contains(job)
            || self.changing.contains_key(job)
            || self.is_switching(job)
        {
            Some(format!("job {job} is being changed"))
        } else {
            None
        }
    }

    /// Why a job suspends nobody here, as its client reads it (the names are topod.toml's).
    pub(super) fn say_not_preempted(
        &self,
        why: &topo_core::policy::NotPreempted<String>,
    ) -> String {
        use topo_core::policy::{Kept, NotPreempted, Spared};
        let kept = |job: &str, why: &Kept| {
            match why {
            Kept::Host(why) => why.clone(),
            Kept::Rule(Spared::TooEarly { ran, min_run }) => format!(
                "job {job} has run {ran} s since its start or its resume after preemption, less than preempt_min_run_s {min_run}"
            ),
            Kept::Rule(Spared::SuspendedEnough { times, max }) => format!(
                "job {job} was suspended {times} time(s) by preemption already (preempt_max_suspensions {max})"
            ),
            Kept::Rule(Spared::NoExpansionFactor) => {
                format!("job {job} gave no submission time and time limit (no expansion factor)")
            }
            Kept::Rule(Spared::NotLower { xf, for_xf }) => {
                format!("job {job}'s expansion factor {xf:.2} is not below its {for_xf:.2}")
            }
            Kept::Rule(Spared::HoldsForSuspended(why)) => {
                format!("job {job} may not be suspended: {why}")
            }
        }
        };
        match why {
            NotPreempted::NoExpansionFactor => "it gave no submission time and time limit (submitted_at, estimate_s), so it has no expansion factor".to_string(),
            NotPreempted::BelowThreshold { xf, min_xf } => {
                format!("its expansion factor {xf:.2} is below preempt_min_xf {min_xf}")
            }
            NotPreempted::NothingInTheWay => "no job runs on the CPUs it may use".to_string(),
            NotPreempted::AllKept(all) => {
                let said: Vec<String> = all.iter().map(|(job, why)| kept(job, why)).collect();
                format!("no job may be suspended for it: {}", summarize(&said, 4))
            }
            NotPreempted::FreesNoPlace(names) => format!(
                "suspending the jobs that may be suspended for it ({}) frees no place its request fits",
                summarize(names, 8)
            ),
        }
    }

    /// Why `job` holds CPUs a job suspended by preemption waits for (it is that job's preemptor,
    /// or borrowed them; see `topo_core::policy::holds_for_suspended`), or `None`.
    pub(super) fn holds_for_preempted(&self, job: &str) -> Option<String> {
        let cpus = &self.ledger.get(job)?.cpus;
        let waiting = self
            .ledger
            .suspended_jobs()
            .filter(|a| self.hints.get(&a.job).is_some_and(|h| h.preempted_by.is_some()));
        topo_core::policy::holds_for_suspended(cpus, waiting.map(|a| (&a.job, &a.cpus)))
    }

    /// Which job suspended by preemption waits for some of the CPUs of `job` (which ran on them
    /// while `job` was suspended and lent them), said for `job`'s owner; `None` when none does.
    pub(super) fn waited_for_by_preempted(&self, job: &str) -> Option<String> {
        let cpus = &self.ledger.get(job)?.cpus;
        self.ledger.suspended_jobs().filter(|a| a.job != job).find_map(|a| {
            let preemptor = self.hints.get(&a.job)?.preempted_by.as_deref()?;
            let shared = a.cpus.intersection(cpus);
            (!shared.is_empty()).then(|| {
                format!(
                    "job {}, suspended by preemption for job {preemptor}, waits for its CPUs {shared} (it ran on them while job {job} was suspended)",
                    a.job
                )
            })
        })
    }

    /// When a job starting now ends by its time limit: it may borrow the CPUs of a job suspended
    /// by preemption that will not resume before then (`topo_core::policy::may_borrow`).
    pub(crate) fn ends_by(&self, prepared: &Prepared) -> Option<i64> {
        let estimate = prepared.ask.estimate_s?;
        Some(self.now_s().saturating_add(i64::try_from(estimate).unwrap_or(i64::MAX)))
    }

    /// When the job suspended by preemption `hint` describes may resume by its preemptor's
    /// estimate (see `topo_core::policy::may_borrow`); `None` when that is not known.
    pub(super) fn resume_by(&self, hint: &JobRecord) -> Option<i64> {
        let preemptor = hint.preempted_by.as_deref()?;
        self.hints.get(preemptor)?.estimated_end()
    }
}
