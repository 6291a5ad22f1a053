//! Tentative reservations: CPUs (and, for a `gpus=` request, GPUs) the scheduler has given a
//! job on a host that the host's topod has not reported yet. Without them, two jobs
//! dispatched in one scheduling session (or before the next refresh) would both be matched
//! against the same free CPUs.
//!
//! A dispatch ([`Reservations::dispatch`]) always ends in one of three ways: the job's CPUs are
//! reserved (where the placement core would put it, inside the job's own topology block when it
//! has one there, as topod does; or, when it does not fit or fits only after the host moves
//! running jobs, the first free CPUs outside other jobs' blocks up to its least count), topod
//! already reports the job, or the host's state is not known yet (a scheduler replaying its jobs
//! with `NOTIFY_STARTUP` before the first refresh, or a host not in the cache yet) and the
//! dispatch waits, as a [`Pending`] one, until the refresher brings that host's state
//! ([`Reservations::settle`]). Reservations and pending dispatches alike go after the
//! reservation time-out when no host confirms them.

use crate::cache::{HostCache, HostId};
use crate::config::Unreachable;
use crate::eval::{self, Admission, Claimant, Context, NoFit, Verdict};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};
use topo_core::cpuset::CpuSet;
use topo_core::gpus::GpuSite;
use topo_core::request::Request;

/// One job's reservation on one host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// The host.
    pub host: HostId,
    /// The CPUs the placement core chose there.
    pub cpus: CpuSet,
    /// The GPUs it takes there, by where they are (a `gpus=` request's, as topod chooses).
    pub gpus: Vec<GpuSite>,
    /// When it was made (or replayed).
    pub made: Instant,
    /// What the job asked and who it is, where the scheduler dispatched it (not for a bare
    /// [`Reservations::reserve`]): a host whose topod changes ([`Reservations::forget_host`])
    /// has the job placed again from it.
    pub asked: Option<Box<(Request, Admission)>>,
}

/// A dispatch to a host whose state is not known yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    /// The job.
    pub job: String,
    /// The host, as the scheduler names it.
    pub host: Box<str>,
    /// The request, with the task count the host got.
    pub request: Request,
    /// When the scheduler dispatched it.
    pub made: Instant,
    /// Its queue and owner, for the prime-time pools.
    pub admission: Admission,
    /// Taken back from a host whose topod changed ([`Reservations::forget_host`]): placed only
    /// where it fits the new state, else dropped (that topod will refuse it).
    pub again: bool,
}

/// What a dispatch did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dispatched {
    /// These CPUs are reserved, where the placement core puts the job.
    Reserved(CpuSet),
    /// The job does not fit the host (the scheduler dispatched it anyway, e.g. after a state
    /// change or a forced run); these CPUs, the first free ones up to the least the request can
    /// use, are reserved so that the next job does not count them as free. The job's real CPUs
    /// are topod's choice when it starts; a few wrong CPUs held for one refresh cost less than
    /// a second job sent to CPUs that are gone.
    Squeezed(CpuSet, NoFit),
    /// The job fits only after the host moves running jobs ([`Verdict::AfterMoves`]), or only in
    /// a prime-time pool that may admit it by name ([`Verdict::InPool`]): these CPUs, the first
    /// free ones up to its least count, are reserved so that the next job does not count them;
    /// topod chooses the real ones when it places it.
    AfterMoves(CpuSet),
    /// topod already reports the job: nothing to reserve.
    Held,
    /// The host's state is not known yet: kept until it arrives.
    Pending,
}

/// Every open reservation, by job and by host.
#[derive(Debug, Default)]
pub struct Reservations {
    by_job: HashMap<String, Vec<Reservation>>,
    /// Dispatches waiting for their host's state, by job and host name (a dispatch is O(log n),
    /// not a scan: a job may be dispatched to thousands of hosts not known yet).
    pending: BTreeMap<(String, Box<str>), Pending>,
    by_host: HashMap<HostId, CpuSet>,
    /// The GPUs reserved on each host that has any (few: only `gpus=` dispatches).
    gpus_by_host: HashMap<HostId, Vec<GpuSite>>,
    /// Indexed by host: looked up for every candidate of every match, so no hashing.
    versions: Vec<u32>,
}

impl Reservations {
    /// None.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records that `job` was given `cpus` on `host`, replacing what it had there.
    pub fn reserve(&mut self, job: &str, host: HostId, cpus: CpuSet, now: Instant) {
        self.reserve_with_gpus(job, host, cpus, Vec::new(), now);
    }

    /// [`reserve_with_gpus`](Self::reserve_with_gpus) of a dispatch: with what the job asked,
    /// to place it again if the host's topod changes.
    fn reserve_dispatched(
        &mut self,
        job: &str,
        host: HostId,
        (cpus, gpus): (CpuSet, Vec<GpuSite>),
        asked: (Request, Admission),
        now: Instant,
    ) {
        self.reserve_with_gpus(job, host, cpus, gpus, now);
        if let Some(r) =
            self.by_job.get_mut(job).and_then(|l| l.iter_mut().find(|r| r.host == host))
        {
            r.asked = Some(Box::new(asked));
        }
    }

    /// [`reserve`](Self::reserve), with the GPUs the job takes there.
    pub fn reserve_with_gpus(
        &mut self,
        job: &str,
        host: HostId,
        cpus: CpuSet,
        gpus: Vec<GpuSite>,
        now: Instant,
    ) {
        let list = self.by_job.entry(job.to_string()).or_default();
        list.retain(|r| r.host != host);
        list.push(Reservation { host, cpus, gpus, made: now, asked: None });
        self.recompute(host);
    }

    /// `free` (a host's free GPUs as topod reported them) less those reserved there, one for
    /// one by where they are (GPUs at the same place are alike to a placement).
    pub fn untaken_gpus<'a>(&self, host: HostId, free: &'a [GpuSite]) -> Cow<'a, [GpuSite]> {
        let Some(taken) = self.gpus_by_host.get(&host) else { return Cow::Borrowed(free) };
        let mut left = free.to_vec();
        for site in taken {
            if let Some(i) = left.iter().position(|g| g == site) {
                left.remove(i);
            }
        }
        Cow::Owned(left)
    }

    /// Forgets `job` everywhere (deallocation), pending dispatches included; returns whether it
    /// had a reservation or a pending dispatch.
    pub fn release(&mut self, job: &str) -> bool {
        let before = self.pending.len();
        self.pending.retain(|(j, _), _| j != job);
        let had_pending = self.pending.len() < before;
        let Some(list) = self.by_job.remove(job) else { return had_pending };
        for r in list {
            self.recompute(r.host);
        }
        true
    }

    /// The scheduler dispatched `job` to `host` with `request` (its task count set to what that
    /// host got) at `made`: reserves its CPUs there, or keeps the dispatch pending while the
    /// host's state is unknown. The host's last known state is used even when stale: a
    /// reservation on an old state is better than none.
    pub fn dispatch(
        &mut self,
        cache: &HostCache,
        job: &str,
        host: &str,
        request: &Request,
        made: Instant,
    ) -> Dispatched {
        self.dispatch_as(cache, job, Admission::default(), host, request, made)
    }

    /// [`dispatch`](Self::dispatch) of a job whose queue and owner are known: it is placed
    /// outside the open prime-time pools that do not admit it, as topod will place it.
    pub fn dispatch_as(
        &mut self,
        cache: &HostCache,
        job: &str,
        admission: Admission,
        host: &str,
        request: &Request,
        made: Instant,
    ) -> Dispatched {
        let Some(id) = cache.lookup(host).filter(|&id| cache.host(id).state.is_some()) else {
            self.pending.insert(
                (job.to_string(), host.into()),
                Pending {
                    job: job.to_string(),
                    host: host.into(),
                    request: request.clone(),
                    made,
                    admission,
                    again: false,
                },
            );
            return Dispatched::Pending;
        };
        self.place(cache, job, admission, id, request, made)
    }

    fn place(
        &mut self,
        cache: &HostCache,
        job: &str,
        admission: Admission,
        id: HostId,
        request: &Request,
        made: Instant,
    ) -> Dispatched {
        let Some(state) = cache.host(id).state.as_ref() else { return Dispatched::Pending };
        if state.holds(job) {
            return Dispatched::Held;
        }
        // What this job already has here is not in the way of its own placement.
        self.by_job.entry(job.to_string()).or_default().retain(|r| r.host != id);
        self.recompute(id);
        let ctx = Context {
            cache,
            reservations: self,
            now: made,
            // The blocks as they are when the job is placed (a settled dispatch is placed later
            // than it was made).
            epoch_s: eval::epoch_now(),
            stale_after: Duration::MAX,
            unreachable: Unreachable::Closed,
        };
        let who = Claimant::job_of(job, admission);
        // The first free CPUs (its own block's included, others' left out) up to the least
        // the request can use. A request larger than the whole host can never start there
        // (topod refuses it), so it holds nothing; otherwise its least CPU count, as the job
        // may start once something ends (`core(65536)` must not take the whole host for the
        // reservation's lifetime).
        let least_free = || {
            let model = cache.model(state);
            let (occupancy, _) = eval::occupancy_for(&ctx, id, state, who);
            let mut free = model.allocatable.difference(&occupancy.held);
            free.difference_with(&occupancy.fenced);
            let least = eval::min_cpus(request);
            free.take_first(if least > model.allocatable.len() { 0 } else { least })
        };
        // The GPUs it takes from the free ones: as topod chooses them where it fits; otherwise
        // the first free ones it asks for, as its CPUs (none where its own blocks hold GPUs:
        // topod gives it those).
        let own_gpus = eval::holds_own_gpus(&ctx, id, who);
        let mut gpus = None;
        let outcome = match eval::evaluate(&ctx, id, request, who) {
            Verdict::Fits { cpus, .. } | Verdict::InPeersBlock { cpus, .. } => {
                gpus = Some(eval::gpus_taken(&ctx, id, request, who));
                Dispatched::Reserved(cpus)
            }
            // topod chooses (it moves jobs, or the job names a pool that admits it by name).
            Verdict::AfterMoves(_) | Verdict::InPool(_) => Dispatched::AfterMoves(least_free()),
            Verdict::NoFit(why) => Dispatched::Squeezed(least_free(), why),
        };
        let cpus = match &outcome {
            Dispatched::Reserved(c) | Dispatched::Squeezed(c, _) | Dispatched::AfterMoves(c) => {
                c.clone()
            }
            _ => CpuSet::new(),
        };
        let gpus = gpus.unwrap_or_else(|| {
            let wanted = if own_gpus { 0 } else { request.gpus_wanted().unwrap_or(0) };
            self.untaken_gpus(id, &state.gpus).iter().take(wanted).cloned().collect()
        });
        if !cpus.is_empty() || !gpus.is_empty() {
            self.reserve_dispatched(job, id, (cpus, gpus), (request.clone(), admission), made);
        }
        outcome
    }

    /// Places the pending dispatches whose host's state is now known, and drops those older
    /// than `ttl`. Returns the number placed.
    pub fn settle(&mut self, cache: &HostCache, now: Instant, ttl: Duration) -> usize {
        if self.pending.is_empty() {
            return 0;
        }
        let mut placed = 0;
        for p in std::mem::take(&mut self.pending).into_values() {
            if now.saturating_duration_since(p.made) > ttl {
                tracing::info!(job = %p.job, host = %p.host, "the host's state never came; pending reservation dropped");
                continue;
            }
            match cache.lookup(&p.host).filter(|&id| cache.host(id).state.is_some()) {
                Some(id) => {
                    let outcome = self.place(cache, &p.job, p.admission, id, &p.request, p.made);
                    // Placed again on a host whose topod changed, and not fitting it even idle:
                    // that topod refuses it, so nothing is held (one that only waits for CPUs
                    // holds its least count, as at a first dispatch).
                    let never_fits = || {
                        let state = cache.host(id).state.as_ref();
                        state.is_some_and(|state| {
                            let idle = topo_core::place::Occupancy::default();
                            topo_core::place::fit_and_score(cache.model(state), &idle, &p.request)
                                .is_err()
                        })
                    };
                    if p.again && matches!(outcome, Dispatched::Squeezed(..)) && never_fits() {
                        if let Some(list) = self.by_job.get_mut(&p.job) {
                            list.retain(|r| r.host != id);
                        }
                        self.by_job.retain(|_, list| !list.is_empty());
                        self.recompute(id);
                        tracing::info!(job = %p.job, host = %p.host, ?outcome, "a job dispatched to the host before its topod changed can never fit its new machine; nothing is held for it (its topod will refuse it)");
                        continue;
                    }
                    tracing::info!(job = %p.job, host = %p.host, ?outcome, "pending dispatch placed now that the host's state is known");
                    placed += 1;
                }
                None => {
                    self.pending.insert((p.job.clone(), p.host.clone()), p);
                }
            }
        }
        placed
    }

    /// The dispatches waiting for their host's state.
    pub fn pending(&self) -> Vec<&Pending> {
        self.pending.values().collect()
    }

    /// The CPUs reserved on `host`.
    pub fn on_host(&self, host: HostId) -> Option<&CpuSet> {
        self.by_host.get(&host)
    }

    /// The GPUs reserved on `host`, by where they are, in one order for equal lists.
    pub fn gpus_on_host(&self, host: HostId) -> Option<&[GpuSite]> {
        self.gpus_by_host.get(&host).map(Vec::as_slice)
    }

    /// The reservations of `job`.
    pub fn of_job(&self, job: &str) -> &[Reservation] {
        self.by_job.get(job).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Number of jobs with a reservation.
    pub fn len(&self) -> usize {
        self.by_job.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.by_job.is_empty()
    }

    /// Drops what the hosts now report themselves (the job is in their free map) and what is
    /// older than `ttl` (a job that never started). Returns the number dropped.
    pub fn reconcile(&mut self, cache: &HostCache, now: Instant, ttl: Duration) -> usize {
        let mut touched = Vec::new();
        let mut dropped = 0;
        self.by_job.retain(|job, list| {
            list.retain(|r| {
                let confirmed = cache.host(r.host).state.as_ref().is_some_and(|s| s.holds(job));
                let expired = now.saturating_duration_since(r.made) > ttl;
                if confirmed || expired {
                    touched.push(r.host);
                    dropped += 1;
                }
                !(confirmed || expired)
            });
            !list.is_empty()
        });
        touched.sort_unstable();
        touched.dedup();
        for h in touched {
            self.recompute(h);
        }
        dropped
    }

    /// Takes back every reservation on `host` (named `name` by the scheduler), whose topod is
    /// another now (it came back on other hardware, or the configuration moved the host): their
    /// CPUs were the old topod's. Each dispatched job's becomes a pending dispatch again, placed
    /// on the new state when it is known ([`settle`](Self::settle)), with its time-out from its
    /// first dispatch; dispatches already pending there stay. Returns the number taken back.
    pub fn forget_host(&mut self, host: HostId, name: &str) -> usize {
        let mut again = Vec::new();
        self.by_job.retain(|job, list| {
            list.retain_mut(|r| {
                if r.host != host {
                    return true;
                }
                again.push((job.clone(), r.made, r.asked.take()));
                false
            });
            !list.is_empty()
        });
        self.recompute(host);
        let taken = again.len();
        for (job, made, asked) in again {
            if let Some(asked) = asked {
                let (request, admission) = *asked;
                let pending = Pending {
                    job: job.clone(),
                    host: name.into(),
                    request,
                    made,
                    admission,
                    again: true,
                };
                self.pending.insert((job, name.into()), pending);
            }
        }
        taken
    }

    /// Changes whenever the reservations on `host` do (for [`crate::eval::Memo`]).
    pub fn version(&self, host: HostId) -> u32 {
        self.versions.get(host as usize).copied().unwrap_or(0)
    }

    fn recompute(&mut self, host: HostId) {
        let i = host as usize;
        if self.versions.len() <= i {
            self.versions.resize(i + 1, 0);
        }
        self.versions[i] = self.versions[i].wrapping_add(1);
        let union = CpuSet::union_all(
            self.by_job.values().flatten().filter(|r| r.host == host).map(|r| &r.cpus),
        );
        if union.is_empty() {
            self.by_host.remove(&host);
        } else {
            self.by_host.insert(host, union);
        }
        let gpus: Vec<GpuSite> = self
            .by_job
            .values()
            .flatten()
            .filter(|r| r.host == host)
            .flat_map(|r| r.gpus.iter().cloned())
            .collect();
        if gpus.is_empty() {
            self.gpus_by_host.remove(&host);
        } else {
            // One order for equal lists: hosts with the same reserved GPUs are matched alike.
            let mut gpus = gpus;
            gpus.sort_by_cached_key(|g| format!("{g:?}"));
            self.gpus_by_host.insert(host, gpus);
        }
    }
}
