//! Topology reservations on this host (see `topo_core::reservation`): made by the batch system
//! or an administrator for a waiting job (`reserve`), kept in the state directory so that a
//! restart keeps them, avoided by every other job's placement, claimed by the named job's
//! allocate, dropped by `unreserve` or when they expire. A block for a request that asks topod
//! for GPUs (`gpus=`) holds them too: no other job is given them, and the named job is.

use super::gpus::pick_gpus;
use super::{Host, HostError, Prepared};
use std::collections::{BTreeMap, BTreeSet};
use topo_core::cpuset::CpuSet;
use topo_core::place::Occupancy;
use topo_core::request::GpuBind;
use topo_core::reservation::{self, Reservation};

/// The longest a reservation may be made for: 30 days.
pub const MAX_RESERVATION_S: u64 = 30 * 24 * 3600;

/// The host's topology reservations by job, and how many times they changed (the free map's
/// generation counts them, so that a plug-in's cache sees a new block as a change).
#[derive(Debug, Default)]
pub(crate) struct Blocks {
    by_job: BTreeMap<String, Reservation>,
    changes: u64,
}

impl Blocks {
    /// No reservation at all, live or expired.
    pub(crate) fn is_empty(&self) -> bool {
        self.by_job.is_empty()
    }

    /// Every reservation, live or expired.
    pub(crate) fn all(&self) -> impl Iterator<Item = &Reservation> + Clone {
        self.by_job.values()
    }

    /// The live reservations at `now` of jobs other than `job`: what keeps `job` out.
    pub(crate) fn others_live(&self, job: &str, now: i64) -> impl Iterator<Item = &Reservation> {
        let job = job.to_string();
        self.by_job.values().filter(move |r| r.job != job && r.live(now))
    }

    /// `job`'s reservation, when it is live at `now`.
    pub(crate) fn live_of(&self, job: &str, now: i64) -> Option<&Reservation> {
        self.by_job.get(job).filter(|r| r.live(now))
    }

    /// How many times the reservations changed.
    pub(crate) fn changes(&self) -> u64 {
        self.changes
    }
}

impl Host {
    /// Reserves a block for `job`'s `prepared` request for `expires_in_s` seconds, replacing a
    /// reservation the job had. Returns it, and the CPUs of the block that running jobs hold
    /// now (it drains as they end).
    pub fn reserve(
        &mut self,
        job: &str,
        prepared: &Prepared,
        expires_in_s: u64,
    ) -> Result<(Reservation, CpuSet), HostError> {
        crate::cgroup::JobId::parse(job)?;
        if !(1..=MAX_RESERVATION_S).contains(&expires_in_s) {
            return Err(HostError::BadArgument(format!(
                "expires_in_s = {expires_in_s}: a reservation lasts from 1 s to {MAX_RESERVATION_S} s (30 days)"
            )));
        }
        if let Some(a) = self.ledger.get(job) {
            return Err(HostError::AlreadyAllocated {
                job: job.into(),
                cpus: a.cpus.to_string(),
                request: a.request.clone(),
            });
        }
        let now = self.now_s();
        let others: Vec<&Reservation> = self.reservations.others_live(job, now).collect();
        let occupancy = self.ledger.occupancy_for(None);
        // Not in an open prime pool: who the job is (its queue, owner) is not known before its
        // allocate, and a block there would be for a job the pool may not admit.
        let mut request = prepared.request.clone();
        let open: CpuSet = CpuSet::union_all(
            &self
                .pools()
                .into_iter()
                .filter(|(_, open)| *open)
                .map(|(p, _)| p.cpus)
                .collect::<Vec<_>>(),
        );
        if !open.is_empty() {
            let outside =
                request.cpu_list.as_ref().unwrap_or(&self.model.allocatable).difference(&open);
            if outside.is_empty() {
                return Err(HostError::DoesNotFit {
                    job: job.into(),
                    source: topo_core::place::PlaceError::Impossible(format!(
                        "every CPU it may use ({open}) is in an open prime-time pool"
                    )),
                    held_back: String::new(),
                });
            }
            request.cpu_list = Some(outside);
        }
        // A request that asks topod for GPUs (`gpus=`) has them held with its block, and the
        // block lies beside them (`gpubind=any`: anywhere): GPUs free now with room beside them
        // now first, else GPUs no other block holds, whose jobs end as the block drains.
        let mut gpus = Vec::new();
        if super::gpus::gpus_to_choose(prepared)?.is_some() {
            let reserved: BTreeSet<String> =
                others.iter().flat_map(|r| r.gpus.iter().cloned()).collect();
            let mut in_use = self.held_gpus();
            in_use.extend(reserved.iter().cloned());
            let free_now = reservation::blocked_for(&occupancy, others.iter().copied(), "", now);
            let only_blocks =
                reservation::blocked_for(&Occupancy::default(), others.iter().copied(), "", now);
            let pick = |occupancy: &Occupancy, kept: &BTreeSet<String>| {
                pick_gpus(&self.topo, &self.model, occupancy, kept, &request, self.strategy, job)
            };
            // Where neither works, the refusal is the one about the GPUs free now (the other's
            // list of "free" GPUs would name GPUs jobs hold).
            let chosen = match pick(&free_now, &in_use) {
                Ok(chosen) => chosen,
                Err(now) => pick(&only_blocks, &reserved).map_err(|_| now)?,
            };
            if let Some(near) = chosen.near.filter(|_| request.gpubind != Some(GpuBind::Any)) {
                let base = request.cpu_list.as_ref().unwrap_or(&self.model.allocatable);
                request.cpu_list = Some(base.intersection(&near));
            }
            gpus = chosen.gpus;
        }
        let (block, busy) = reservation::choose_block(
            &self.model,
            &occupancy,
            &others,
            &request,
            self.strategy,
            now,
        )
        .map_err(|source| HostError::DoesNotFit {
            job: job.into(),
            source,
            held_back: String::new(),
        })?;
        let r = Reservation {
            job: job.into(),
            cpus: block.cpus,
            request: prepared.ask.request.clone(),
            made_at: now,
            expires_at: now + expires_in_s as i64,
            gpus,
        };
        let before = self.reservations.by_job.insert(job.into(), r.clone());
        if let Err(e) = self.save_reservations() {
            match before {
                Some(b) => self.reservations.by_job.insert(job.into(), b),
                None => self.reservations.by_job.remove(job),
            };
            return Err(e);
        }
        tracing::info!(
            event = "reserved",
            job = %job,
            cpus = %r.cpus,
            busy = %busy,
            gpus = %r.gpus.join(","),
            "job {job}: CPUs {}{} reserved for {expires_in_s} s ({} of them busy now)",
            r.cpus,
            gpus_named(&r),
            busy.len()
        );
        Ok((r, busy))
    }

    /// Drops `job`'s reservation and returns it.
    pub fn unreserve(&mut self, job: &str) -> Result<Reservation, HostError> {
        crate::cgroup::JobId::parse(job)?;
        let r = self
            .reservations
            .by_job
            .remove(job)
            .ok_or_else(|| HostError::NoReservation(job.into()))?;
        if let Err(e) = self.save_reservations() {
            self.reservations.by_job.insert(job.into(), r);
            return Err(e);
        }
        tracing::info!(event = "unreserved", job = %job, "job {job}: reservation of CPUs {}{} dropped", r.cpus, gpus_named(&r));
        Ok(r)
    }

    /// The live reservations.
    pub fn reservations(&self) -> Vec<Reservation> {
        let now = self.now_s();
        self.reservations.all().filter(|r| r.live(now)).cloned().collect()
    }

    /// Drops the reservations that have expired (topod's tick); returns their jobs.
    pub fn expire_reservations(&mut self) -> Vec<String> {
        let now = self.now_s();
        let gone: Vec<String> =
            self.reservations.all().filter(|r| !r.live(now)).map(|r| r.job.clone()).collect();
        for job in &gone {
            self.reservations.by_job.remove(job);
            tracing::info!(event = "reservation_expired", job = %job, "job {job}: its reservation expired");
        }
        if !gone.is_empty() {
            if let Err(e) = self.save_reservations() {
                tracing::warn!("{e}");
            }
        }
        gone
    }

    /// The job's allocate spent its reservation.
    pub(crate) fn claim_reservation(&mut self, job: &str) {
        if let Some(r) = self.reservations.by_job.remove(job) {
            tracing::info!(event = "reservation_claimed", job = %job, "job {job}: its reservation of CPUs {}{} is claimed", r.cpus, gpus_named(&r));
            if let Err(e) = self.save_reservations() {
                tracing::warn!("{e}");
            }
        }
    }

    /// `job`'s live block, if it has one.
    pub(crate) fn block_of(&self, job: &str) -> Option<&CpuSet> {
        let now = self.now_s();
        self.reservations.live_of(job, now).map(|r| &r.cpus)
    }

    /// Reads the reservations back after a restart (expired ones are dropped at the next tick).
    pub(crate) fn load_reservations(&mut self) {
        let Some(records) = &self.records else { return };
        match records.load_reservations() {
            Ok(mut all) => {
                // A GPU the host no longer has (removed, or gone from the bus since): the block
                // gives up its GPUs, so that its job takes free ones as any job would (it never
                // mixes reserved and free ones), and none stays held for nothing.
                let mut changed = false;
                for r in &mut all {
                    let gone: Vec<&str> = r
                        .gpus
                        .iter()
                        .map(String::as_str)
                        .filter(|a| self.topo.device(a).is_none())
                        .collect();
                    if !gone.is_empty() {
                        tracing::warn!(
                            event = "reservation_gpus_gone",
                            job = %r.job,
                            "job {}: its reservation's GPU(s) {} are no longer on this host; the reservation keeps CPUs {} and holds no GPU, its job takes free ones",
                            r.job,
                            gone.join(", "),
                            r.cpus
                        );
                        r.gpus.clear();
                        changed = true;
                    }
                }
                self.reservations.by_job = all.into_iter().map(|r| (r.job.clone(), r)).collect();
                self.reservations.changes += 1;
                if changed {
                    if let Err(e) = self.save_reservations() {
                        tracing::error!("{e}; the reservations' GPUs are dropped in memory only");
                    }
                }
            }
            Err(e) => tracing::error!("{e}; starting without topology reservations"),
        }
    }

    fn save_reservations(&mut self) -> Result<(), HostError> {
        self.reservations.changes += 1;
        match &self.records {
            Some(records) => records
                .write_reservations(&self.reservations.all().collect::<Vec<_>>())
                .map_err(HostError::Records),
            None => Ok(()),
        }
    }
}

/// " and GPU(s) ..." for a reservation that holds GPUs, for its log lines; else nothing.
fn gpus_named(r: &Reservation) -> String {
    if r.gpus.is_empty() {
        String::new()
    } else {
        format!(" and GPU(s) {}", r.gpus.join(", "))
    }
}
