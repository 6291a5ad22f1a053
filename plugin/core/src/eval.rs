//! Fit-and-score of one request on one cached host: the placement core's best-fit placement,
//! on what the host reported minus the tentative reservations.

use crate::cache::{HostCache, HostId, Unknown};
use crate::config::Unreachable;
use crate::reserve::Reservations;
use std::borrow::Cow;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use topod::cpuset::CpuSet;
use topod::place::{self, Occupancy, PlaceError};
use topod::request::Request;

/// Score given to hosts kept by the fail-open policy: after every host whose state is known.
pub const UNKNOWN_SCORE: u64 = u64::MAX / 2;

/// Why a request does not fit a host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoFit {
    /// Fewer free CPUs than the request needs at the least (checked before placing).
    TooFewCpus {
        /// Free CPUs.
        free: usize,
        /// The least the request can use.
        needed: usize,
    },
    /// The placement core found no placement.
    Placement(PlaceError),
    /// The host's state is unknown and the policy is fail-closed.
    Unknown(Unknown),
}

impl std::fmt::Display for NoFit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoFit::TooFewCpus { free, needed } => write!(f, "needs at least {needed} CPUs but only {free} are free"),
            NoFit::Placement(e) => write!(f, "{e}"),
            NoFit::Unknown(u) => write!(f, "host state unknown and the policy is fail-closed: {u}"),
        }
    }
}

/// The answer for one host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// It fits; lower scores are better.
    Fits {
        /// The placement score ([`place::score`]), or [`UNKNOWN_SCORE`] for a fail-open host.
        score: u64,
        /// The CPUs it would get (empty for a fail-open host).
        cpus: CpuSet,
    },
    /// It does not.
    NoFit(NoFit),
}

/// What [`evaluate`] needs besides the request.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    /// The cache.
    pub cache: &'a HostCache,
    /// The open reservations.
    pub reservations: &'a Reservations,
    /// The time now.
    pub now: Instant,
    /// How old a state may be.
    pub stale_after: Duration,
    /// What to do with unknown hosts.
    pub unreachable: Unreachable,
}

/// The least number of CPUs `request` can be placed on.
pub fn min_cpus(request: &Request) -> usize {
    request.tasks.unwrap_or(place::DEFAULT_TASKS) as usize * request.units_per_task as usize
}

/// Fit-and-score of `request` (its task count set) on `host`.
pub fn evaluate(ctx: &Context<'_>, host: HostId, request: &Request) -> Verdict {
    let state = match ctx.cache.usable(host, ctx.now, ctx.stale_after) {
        Ok(s) => s,
        Err(unknown) => {
            return match ctx.unreachable {
                Unreachable::Open => Verdict::Fits { score: UNKNOWN_SCORE, cpus: CpuSet::new() },
                Unreachable::Closed => Verdict::NoFit(NoFit::Unknown(unknown)),
            }
        }
    };
    let model = ctx.cache.model(state);
    let occupancy: Cow<'_, Occupancy> = match ctx.reservations.on_host(host) {
        Some(reserved) => {
            let mut o = state.occupancy.clone();
            o.held.union_with(reserved);
            Cow::Owned(o)
        }
        None => Cow::Borrowed(&state.occupancy),
    };
    // Counting first: on a busy cluster most hosts fail here, without a placement.
    let free = model.allocatable.len() - model.allocatable.intersection_len(&occupancy.held.union(&occupancy.fenced));
    let needed = min_cpus(request);
    if free < needed {
        return Verdict::NoFit(NoFit::TooFewCpus { free, needed });
    }
    match place::fit_and_score(model, &occupancy, request) {
        Ok(fit) => Verdict::Fits { score: fit.score, cpus: fit.cpus },
        Err(e) => Verdict::NoFit(NoFit::Placement(e)),
    }
}

/// The most tasks of `request` (at most `limit`) that fit `host` together; 0 when none does.
pub fn max_tasks(ctx: &Context<'_>, host: HostId, request: &Request, limit: u32) -> u32 {
    let fits = |n: u32| {
        let mut r = request.clone();
        r.tasks = Some(n);
        matches!(evaluate(ctx, host, &r), Verdict::Fits { .. })
    };
    let (mut lo, mut hi) = (0u32, limit);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// Remembered verdicts per request shape and host, valid while neither the host's state nor its
/// reservations change. A host's state changes only when a job starts or ends there, so a
/// scheduler matching many jobs of the same shape pays for a placement once per host and
/// change, not once per job (LSF, for the same reason, matches "peer jobs" with equal
/// requests together).
#[derive(Debug, Default)]
pub struct Memo {
    shapes: HashMap<String, ShapeMemo>,
    tick: u64,
}

#[derive(Debug, Default)]
struct ShapeMemo {
    last_used: u64,
    /// Per host: the stamp the verdict was computed at (0: none) and the score (`NO_FIT`).
    entries: Vec<(u64, u64)>,
}

/// The most shapes remembered; the least recently used goes first.
pub const MEMO_SHAPES: usize = 64;
const NO_FIT: u64 = u64::MAX;

impl Memo {
    /// Empty.
    pub fn new() -> Self {
        Self::default()
    }

    /// Verdicts for `request` (whose canonical text with its task count is `key`) on each of
    /// `hosts`, as `Some(score)` when it fits; each comes from the memo when the host has not
    /// changed since, else from [`evaluate`].
    pub fn scores(&mut self, ctx: &Context<'_>, key: &str, request: &Request, hosts: &[HostId]) -> Vec<Option<u64>> {
        self.tick += 1;
        if !self.shapes.contains_key(key) && self.shapes.len() >= MEMO_SHAPES {
            if let Some(oldest) = self.shapes.iter().min_by_key(|(_, s)| s.last_used).map(|(k, _)| k.clone()) {
                self.shapes.remove(&oldest);
            }
        }
        let shape = self.shapes.entry(key.to_string()).or_default();
        shape.last_used = self.tick;
        hosts
            .iter()
            .map(|&h| {
                // Freshness is checked every time: an entry goes stale without changing.
                if ctx.cache.usable(h, ctx.now, ctx.stale_after).is_err() {
                    return match evaluate(ctx, h, request) {
                        Verdict::Fits { score, .. } => Some(score),
                        Verdict::NoFit(_) => None,
                    };
                }
                let stamp = (u64::from(ctx.cache.host(h).version) << 32 | u64::from(ctx.reservations.version(h))) + 1;
                let i = h as usize;
                if shape.entries.len() <= i {
                    shape.entries.resize(i + 1, (0, NO_FIT));
                }
                if shape.entries[i].0 != stamp {
                    let score = match evaluate(ctx, h, request) {
                        Verdict::Fits { score, .. } => score,
                        Verdict::NoFit(_) => NO_FIT,
                    };
                    shape.entries[i] = (stamp, score);
                }
                Some(shape.entries[i].1).filter(|&s| s != NO_FIT)
            })
            .collect()
    }

    /// Bytes the memo holds.
    pub fn bytes(&self) -> usize {
        self.shapes.iter().map(|(k, s)| k.len() + s.entries.capacity() * std::mem::size_of::<(u64, u64)>()).sum()
    }
}
