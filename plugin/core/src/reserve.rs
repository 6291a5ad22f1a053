//! Tentative reservations: CPUs the scheduler has given a job on a host that the host's
//! topod has not reported yet. Without them, two jobs dispatched in one scheduling session (or
//! before the next refresh) would both be matched against the same free CPUs.

use crate::cache::{HostCache, HostId};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use topo_core::cpuset::CpuSet;

/// One job's reservation on one host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// The host.
    pub host: HostId,
    /// The CPUs the placement core chose there.
    pub cpus: CpuSet,
    /// When it was made (or replayed).
    pub made: Instant,
}

/// Every open reservation, by job and by host.
#[derive(Debug, Default)]
pub struct Reservations {
    by_job: HashMap<String, Vec<Reservation>>,
    by_host: HashMap<HostId, CpuSet>,
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
        let list = self.by_job.entry(job.to_string()).or_default();
        list.retain(|r| r.host != host);
        list.push(Reservation { host, cpus, made: now });
        self.recompute(host);
    }

    /// Forgets `job` everywhere (deallocation); returns whether it had a reservation.
    pub fn release(&mut self, job: &str) -> bool {
        let Some(list) = self.by_job.remove(job) else { return false };
        for r in list {
            self.recompute(r.host);
        }
        true
    }

    /// The CPUs reserved on `host`.
    pub fn on_host(&self, host: HostId) -> Option<&CpuSet> {
        self.by_host.get(&host)
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
    }
}
