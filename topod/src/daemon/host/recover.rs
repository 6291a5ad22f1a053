//! A restart: the ledger rebuilt from the job cgroups that exist (the kernel's truth), each
//! job's record adding what the cgroup tree cannot say (request, tasks, owner, suspensions).
//! A frozen cgroup whose record says suspended stays suspended; one whose record does not was
//! frozen by a release a crash cut short, and is thawed, unless it has a gang row.

use super::*;

/// What a restart found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Recovery {
    /// Jobs whose cgroups were found and kept.
    pub kept: Vec<String>,
    /// Of those, the ones found frozen: kept suspended (their CPUs may be lent).
    pub suspended: Vec<String>,
    /// Cgroups that overlap another job's CPUs (left alone, not in the ledger).
    pub conflicts: Vec<String>,
    /// Records of jobs that have no cgroup any more (removed).
    pub dropped_hints: Vec<String>,
    /// Job cgroups that never got CPUs and hold no process (removed).
    pub removed: Vec<String>,
    /// Records whose request no longer reads back as itself (kept without the request, so
    /// without its exclusive fence until the batch system asks again).
    pub bad_requests: Vec<String>,
    /// Files in the records directory that are not readable records (left alone).
    pub unreadable: Vec<String>,
}

impl Host {
    /// Rebuilds the ledger from the job cgroups that exist; the records add their requests,
    /// tasks and owners. `legacy` holds the hints of an older topod's single hint file, used for
    /// jobs that have no record.
    pub fn recover(&mut self, legacy: BTreeMap<String, JobRecord>) -> Result<Recovery, HostError> {
        let mut report = Recovery::default();
        let (mut hints, unreadable) = self.records.as_ref().map(Records::load).unwrap_or_default();
        report.unreadable = unreadable;
        for (job, hint) in legacy {
            hints.entry(job).or_insert(hint);
        }
        self.load_reservations();
        // A plan of moves a crash cut short is finished before the cgroups are read.
        let moved = self.recover_moves(&mut hints);
        // Running jobs first: a frozen job's CPUs may have been lent to one of them.
        let mut found = self.backend.list()?;
        let frozen: BTreeSet<String> = found
            .iter()
            .filter(|(job, _)| self.backend.is_frozen(job).unwrap_or(false))
            .map(|(job, _)| job.to_string())
            .collect();
        let busy: BTreeSet<String> = found
            .iter()
            .filter(|(job, _)| self.backend.pids(job).map(|p| !p.is_empty()).unwrap_or(false))
            .map(|(job, _)| job.to_string())
            .collect();
        let recorded_suspended: BTreeSet<String> = hints
            .iter()
            .filter(|(_, h)| h.suspended || h.batch_suspended)
            .map(|(j, _)| j.clone())
            .collect();
        // Running jobs first, those with processes before empty ones; then thawed jobs whose
        // record says suspended (a resume a crash cut short, or a thaw behind topod's back);
        // frozen jobs last. So a job that may have lent its CPUs never displaces their borrower.
        found.sort_by_key(|(job, _)| {
            let j = job.as_str();
            (frozen.contains(j), recorded_suspended.contains(j), !busy.contains(j), j.to_string())
        });
        for (job, eff) in found {
            if eff.cpus.is_empty() {
                // Made but never given CPUs (topod died inside allocate): nothing can have
                // joined it, so it is provably dead.
                if self.backend.pids(&job).map(|p| p.is_empty()).unwrap_or(false) {
                    let _ = self.backend.release(&job, self.release_timeout);
                    report.removed.push(job.to_string());
                    continue;
                }
            }
            let mut hint = hints.remove(job.as_str()).unwrap_or_default();
            let parsed = if hint.ask.request.is_empty() {
                None
            } else {
                request::parse(&hint.ask.request).ok().filter(|r| r.to_string() == hint.ask.request)
            };
            if parsed.is_none() && !hint.ask.request.is_empty() {
                report.bad_requests.push(job.to_string());
                hint.ask.request.clear();
            }
            let mut tasks = tasks_for(&job, &hint.tasks, &eff.cpus);
            if tasks != hint.tasks {
                hint.tasks_unknown = true;
            }
            // A malleable request known from the record: its CPUs, divided as the request
            // shapes them, are its tasks, as when the batch system asks again for a job
            // recovered without a record (see allocate). Only CPUs that do not divide so leave
            // its tasks unknown, and its resizes refused.
            if hint.tasks_unknown {
                let split = parsed
                    .as_ref()
                    .filter(|r| r.is_malleable())
                    .and_then(|r| place::split_into_tasks(&self.model, r, &eff.cpus));
                if let Some(split) = split {
                    tasks = split;
                    hint.tasks_unknown = false;
                }
            }
            hint.tasks = tasks.clone();
            let fenced = match parsed.as_ref().and_then(|r| r.exclusive_level()) {
                Some(level) => self.model.closure(level, &eff.cpus).difference(&eff.cpus),
                None => CpuSet::new(),
            };
            let alloc = Allocation {
                job: job.to_string(),
                cpus: eff.cpus.clone(),
                tasks,
                mems: eff.mems.clone(),
                fenced,
                request: hint.ask.request.clone(),
                gang_row: hint.gang_row,
            };
            if self.backend.pids(&job).map(|p| !p.is_empty()).unwrap_or(false) {
                self.joined.insert(job.to_string());
            }
            let occupied = self.ledger.occupancy();
            let in_way = alloc.cpus.intersects(&occupied.held)
                || alloc.cpus.intersects(&occupied.fenced)
                || alloc.fenced.intersects(&occupied.held);
            // Frozen by slicing when the crash came: it takes its turns again.
            let gang_frozen =
                hint.gang_row.is_some() && frozen.contains(job.as_str()) && !hint.suspended;
            let suspended = match (frozen.contains(job.as_str()), hint.suspended) {
                _ if gang_frozen => false,
                // Stopped by the batch system, not frozen by topod: still lending its CPUs
                // when a running job holds them; else running again, as the batch system
                // resumes it once the job on its CPUs is gone.
                (false, false) if hint.batch_suspended => {
                    hint.batch_suspended = in_way;
                    if !in_way {
                        hint.clock.resume(self.now_s(), Stopper::Outside);
                    }
                    in_way
                }
                (true, true) => true,
                (true, false) if in_way => {
                    // Frozen without a record that says suspended (the adopt of an older topod,
                    // or a release cut short) while running jobs hold its CPUs: thawing it
                    // would run two jobs on one CPU. It stays suspended.
                    tracing::warn!(
                        "job {job}: found frozen, its CPUs held by running jobs; kept suspended"
                    );
                    hint.suspended = true;
                    hint.clock.stop(self.now_s(), Stopper::Outside);
                    true
                }
                (true, false) => {
                    // Frozen by a release (or a suspend whose record was never written) that a
                    // crash cut short: it holds its CPUs as a running job; thawed, so that its
                    // processes are not left stopped for ever (the batch system's release comes
                    // again and kills them).
                    tracing::warn!("job {job}: found frozen without being suspended (a release cut short?); thawing it");
                    if let Err(e) = self.backend.thaw(&job, self.freeze_timeout) {
                        tracing::warn!("job {job}: {e}");
                    }
                    false
                }
                (false, true) if in_way => {
                    // Suspended, and thawed behind topod's back while its CPUs are lent:
                    // frozen again, so that no CPU runs two jobs.
                    tracing::warn!("job {job}: suspended but found thawed while its CPUs are lent; freezing it again");
                    match self.backend.freeze(&job, self.freeze_timeout) {
                        Ok(()) => true,
                        Err(e) => {
                            tracing::warn!("job {job}: {e}");
                            false
                        }
                    }
                }
                (false, true) => {
                    // Thawed by a resume that a crash cut short before its record changed, or
                    // never frozen (a suspend or preemption cut short before its freeze): it
                    // runs, and its clock with it, as after a resume by hand (one after
                    // preemption restarts its protection and keeps the count).
                    hint.suspended = false;
                    hint.suspended_by = None;
                    let after = match hint.preempted_by.take() {
                        Some(_) => Stopper::Preemption,
                        None => Stopper::Outside,
                    };
                    hint.clock.resume(self.now_s(), after);
                    false
                }
                (false, false) => false,
            };
            let inserted = if gang_frozen {
                self.ledger.insert_gang_frozen(alloc)
            } else if suspended {
                self.ledger.insert_suspended(alloc).map(|_| ())
            } else {
                match self.ledger.insert(alloc.clone()) {
                    Ok(_) => Ok(()),
                    Err(_) if alloc.gang_row.is_some() => {
                        // A gang job running on CPUs a job of another row runs on (a thaw
                        // behind topod's back): frozen until its slice.
                        tracing::warn!("job {job}: found running on CPUs of another gang row's running job; frozen until its slice");
                        match self.backend.freeze(&job, self.freeze_timeout) {
                            Ok(()) => self.ledger.insert_gang_frozen(alloc),
                            Err(e) => Err(LedgerError::Conflict {
                                job: job.to_string(),
                                cpus: alloc.cpus.to_string(),
                                holder: e.to_string(),
                            }),
                        }
                    }
                    Err(e) => Err(e),
                }
            };
            match inserted {
                Ok(()) => {
                    if suspended {
                        report.suspended.push(job.to_string());
                    }
                    report.kept.push(job.to_string());
                    self.record(&job, &hint);
                    self.hints.insert(job.to_string(), hint);
                }
                Err(_) => report.conflicts.push(job.to_string()),
            }
        }
        for job in hints.into_keys() {
            if let (Some(records), Ok(id)) = (&self.records, JobId::parse(&job)) {
                let _ = records.remove(&id);
            }
            report.dropped_hints.push(job);
        }
        // Every job's notify file says its CPUs again (a job moved by the plan learns of it, by
        // its signal too); files of jobs that are gone go.
        let kept = report.kept.clone();
        for job in &kept {
            // Device rules as its record says (a job from before devices were confined, or
            // one whose devices cgroup a crash or an administrator removed).
            if let Ok(id) = JobId::parse(job) {
                if let Err(e) = self.sync_device_rules(&id) {
                    tracing::warn!("job {job}: its device rules: {e}");
                }
            }
        }
        if let Some(dir) = &self.notify_dir {
            notify::sweep_notify_dir(dir, &kept.iter().cloned().collect());
        }
        for job in kept {
            let signal = moved.contains(&job);
            self.tell(&job, signal);
        }
        // Shrunk for an arrival that a crash kept from being placed, the malleable jobs would
        // stay so until the next allocate or release: shared out again now (each told).
        self.rebalance();
        Ok(report)
    }
}
