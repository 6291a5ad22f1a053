//! Fit-and-score of one request on one cached host: the placement core's best-fit placement,
//! on what the host reported minus the tentative reservations.

use crate::cache::{HostCache, HostId, Unknown};
use crate::config::Unreachable;
use crate::reserve::Reservations;
use std::borrow::Cow;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use topo_core::cpuset::CpuSet;
use topo_core::place::{self, Occupancy, PlaceError};
use topo_core::request::Request;

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
            NoFit::TooFewCpus { free, needed } => {
                write!(f, "needs at least {needed} CPUs but only {free} are free")
            }
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
    let free = model.allocatable.len()
        - model.allocatable.intersection_len(&occupancy.held.union(&occupancy.fenced));
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

/// Scores of `request` on `hosts` (`NO_FIT` where it does not fit). Many hosts are split over
/// the machine's cores: a first match of a new shape over thousands of hosts is the one costly
/// case, and the scheduler waits for it. Threads only compute; none does I/O.
fn evaluate_many(ctx: &Context<'_>, request: &Request, hosts: &[HostId]) -> Vec<u64> {
    let one = |&h: &HostId| match evaluate(ctx, h, request) {
        Verdict::Fits { score, .. } => score,
        Verdict::NoFit(_) => NO_FIT,
    };
    let threads =
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_MATCH_THREADS);
    if hosts.len() < PARALLEL_FROM || threads < 2 {
        return hosts.iter().map(one).collect();
    }
    let chunk = hosts.len().div_ceil(threads);
    std::thread::scope(|s| {
        let parts: Vec<_> = hosts
            .chunks(chunk)
            .map(|part| s.spawn(move || part.iter().map(one).collect::<Vec<u64>>()))
            .collect();
        // A panicking worker is re-raised here, on the caller's thread, where the plug-in's
        // guard catches it.
        parts
            .into_iter()
            .flat_map(|p| p.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

/// Below this many hosts to evaluate, one thread does it.
const PARALLEL_FROM: usize = 512;
/// At most this many threads evaluate at once.
const MAX_MATCH_THREADS: usize = 8;

/// Remembered verdicts per request shape and host, valid while neither the host's state nor its
/// reservations change. A host's state changes only when a job starts or ends there (a refresh
/// that brings the same state keeps its version), so a scheduler matching many jobs of the same
/// shape pays for a placement once per host and change, not once per job (LSF, for the same
/// reason, matches "peer jobs" with equal requests together).
///
/// Memory: per host, the (state version, reservation version) pair its epoch stands for and
/// the epoch (12 bytes); per shape and host, the epoch the verdict was computed at and the
/// score (8 bytes). At [`MEMO_SHAPES`] shapes that is 524 bytes per host.
#[derive(Debug, Default)]
pub struct Memo {
    shapes: HashMap<String, ShapeMemo>,
    tick: u64,
    /// Per host: the (state version, reservation version) its epoch stands for.
    seen: Vec<(u32, u32)>,
    /// Per host: bumped whenever `seen` changes; 0 means never seen.
    epoch: Vec<u32>,
}

#[derive(Debug, Default)]
struct ShapeMemo {
    last_used: u64,
    /// Per host: the epoch the verdict was computed at (0: none) and the score (`NO_FIT32`).
    entries: Vec<(u32, u32)>,
}

/// The most shapes remembered; the least recently used goes first.
pub const MEMO_SHAPES: usize = 64;
const NO_FIT: u64 = u64::MAX;
/// A remembered "does not fit"; scores that do not fit below it are not remembered.
const NO_FIT32: u32 = u32::MAX;

impl Memo {
    /// Empty.
    pub fn new() -> Self {
        Self::default()
    }

    /// The current epoch of host `h` (0: its state is unusable, nothing is remembered).
    fn epoch_of(&mut self, ctx: &Context<'_>, h: HostId) -> u32 {
        if ctx.cache.usable(h, ctx.now, ctx.stale_after).is_err() {
            return 0;
        }
        let i = h as usize;
        let now = (ctx.cache.host(h).version, ctx.reservations.version(h));
        if self.epoch[i] == 0 || self.seen[i] != now {
            self.seen[i] = now;
            // Never 0; wrapping past u32::MAX changes would take years of jobs on one host.
            self.epoch[i] = self.epoch[i].wrapping_add(1).max(1);
        }
        self.epoch[i]
    }

    /// Verdicts for `request` (whose canonical text with its task count is `key`) on each of
    /// `hosts`, as `Some(score)` when it fits; each comes from the memo when the host has not
    /// changed since, else from [`evaluate`].
    pub fn scores(
        &mut self,
        ctx: &Context<'_>,
        key: &str,
        request: &Request,
        hosts: &[HostId],
    ) -> Vec<Option<u64>> {
        self.tick += 1;
        if !self.shapes.contains_key(key) && self.shapes.len() >= MEMO_SHAPES {
            if let Some(oldest) =
                self.shapes.iter().min_by_key(|(_, s)| s.last_used).map(|(k, _)| k.clone())
            {
                self.shapes.remove(&oldest);
            }
        }
        if let Some(&max) = hosts.iter().max() {
            if self.epoch.len() <= max as usize {
                self.epoch.resize(max as usize + 1, 0);
                self.seen.resize(max as usize + 1, (0, 0));
            }
        }
        // One pass: a remembered score where the host has not changed since; the rest (changed,
        // never seen with this shape, or stale: an entry goes stale without changing, so stale
        // hosts are evaluated every time and not remembered) is computed after.
        let epochs: Vec<u32> = hosts.iter().map(|&h| self.epoch_of(ctx, h)).collect();
        let shape = self.shapes.entry(key.to_string()).or_default();
        shape.last_used = self.tick;
        if shape.entries.len() < self.epoch.len() {
            shape.entries.resize(self.epoch.len(), (0, NO_FIT32));
        }
        let mut out: Vec<u64> = Vec::with_capacity(hosts.len());
        let mut misses: Vec<(usize, HostId, u32)> = Vec::new();
        for (pos, (&h, &epoch)) in hosts.iter().zip(&epochs).enumerate() {
            let (seen, score) = shape.entries[h as usize];
            if epoch != 0 && seen == epoch {
                out.push(if score == NO_FIT32 { NO_FIT } else { u64::from(score) });
            } else {
                out.push(NO_FIT);
                misses.push((pos, h, epoch));
            }
        }
        let ids: Vec<HostId> = misses.iter().map(|m| m.1).collect();
        for ((pos, h, epoch), score) in misses.into_iter().zip(evaluate_many(ctx, request, &ids)) {
            out[pos] = score;
            let small = if score == NO_FIT { Some(NO_FIT32) } else { u32::try_from(score).ok() };
            match small {
                Some(s) if epoch != 0 && (s != NO_FIT32 || score == NO_FIT) => {
                    shape.entries[h as usize] = (epoch, s)
                }
                // Unusable, or a score too large to keep in 32 bits: computed every time.
                _ => shape.entries[h as usize] = (0, NO_FIT32),
            }
        }
        out.into_iter().map(|s| Some(s).filter(|&s| s != NO_FIT)).collect()
    }

    /// Bytes the memo holds.
    pub fn bytes(&self) -> usize {
        let per_host = self.seen.capacity() * std::mem::size_of::<(u32, u32)>()
            + self.epoch.capacity() * std::mem::size_of::<u32>();
        per_host
            + self
                .shapes
                .iter()
                .map(|(k, s)| k.len() + s.entries.capacity() * std::mem::size_of::<(u32, u32)>())
                .sum::<usize>()
    }
}
