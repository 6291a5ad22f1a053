//! Fit-and-score of one request on one cached host: the placement core's best-fit placement,
//! on what the host reported minus the tentative reservations.

use crate::cache::{HostCache, HostId, Unknown};
use crate::config::Unreachable;
use crate::reserve::Reservations;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use topo_core::cpuset::CpuSet;
use topo_core::place::{self, PlaceError};
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
    let mut occupancy = state.occupancy();
    if let Some(reserved) = ctx.reservations.on_host(host) {
        occupancy.held.union_with(reserved);
    }
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

/// Scores of `request` on `hosts` (`NO_FIT` where it does not fit).
///
/// A placement depends on nothing but the host's hardware model, its occupancy and its
/// reservations, so hosts equal in all three get the same verdict: each distinct state is
/// placed once ([`distinct_states`]). A cluster's idle hosts of one hardware model are one
/// placement, not thousands; a cluster where every host differs pays one placement per host.
fn evaluate_many(ctx: &Context<'_>, request: &Request, hosts: &[HostId]) -> Vec<u64> {
    let (reps, which) = distinct_states(ctx, hosts);
    let scores = evaluate_each(ctx, request, &reps);
    which.iter().map(|&r| scores[r as usize]).collect()
}

/// The hosts of `hosts` that stand for every distinct (model, occupancy, reservations) among
/// them, and for each host of `hosts` the index of the one that stands for it. Hosts whose
/// state is not usable each stand for themselves. Hosts without reservations are told apart by
/// their state's fingerprint ([`crate::cache::state_fingerprint`], in the flat status array: no
/// host's state is read); the few with reservations by their whole state, compared.
fn distinct_states(ctx: &Context<'_>, hosts: &[HostId]) -> (Vec<HostId>, Vec<u32>) {
    use std::collections::hash_map::DefaultHasher;
    use std::hash::{Hash, Hasher};
    let mut reps: Vec<HostId> = Vec::new();
    let mut which: Vec<u32> = Vec::with_capacity(hosts.len());
    let mut by_print: HashMap<[u64; 2], u32> = HashMap::new();
    // Hosts with reservations: hash of the whole state -> the representatives with that hash
    // (equal states are compared, so a hash collision only costs a comparison).
    let mut by_hash: HashMap<u64, Vec<u32>> = HashMap::new();
    let state_of = |h: HostId| {
        ctx.cache
            .usable(h, ctx.now, ctx.stale_after)
            .ok()
            .map(|state| (state.model, &state.held, &state.fenced, ctx.reservations.on_host(h)))
    };
    let own = |h: HostId, reps: &mut Vec<HostId>| {
        reps.push(h);
        reps.len() as u32 - 1
    };
    for &h in hosts {
        if !ctx.cache.is_fresh(h, ctx.now, ctx.stale_after) {
            which.push(own(h, &mut reps));
            continue;
        }
        if ctx.reservations.on_host(h).is_none() {
            let print = ctx.cache.status(h).fingerprint;
            let r = *by_print.entry(print).or_insert_with(|| own(h, &mut reps));
            which.push(r);
            continue;
        }
        let Some(key) = state_of(h) else {
            which.push(own(h, &mut reps));
            continue;
        };
        let mut hasher = DefaultHasher::new();
        key.hash(&mut hasher);
        let same = by_hash.entry(hasher.finish()).or_default();
        match same.iter().find(|&&r| state_of(reps[r as usize]) == Some(key)) {
            Some(&r) => which.push(r),
            None => {
                let r = own(h, &mut reps);
                same.push(r);
                which.push(r);
            }
        }
    }
    (reps, which)
}

/// Scores of `request` on each of `hosts`. Many hosts are split over the machine's cores: a
/// first match of a new shape over thousands of hosts is the one costly case, and the
/// scheduler waits for it. Threads only compute; none does I/O.
fn evaluate_each(ctx: &Context<'_>, request: &Request, hosts: &[HostId]) -> Vec<u64> {
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
/// Memory: per host, the (state version, reservation version) pair its remembered verdicts stand
/// for (8 bytes); per shape and host, the score or "does not fit" or "not known" (4 bytes). At
/// [`MEMO_SHAPES`] shapes that is 264 bytes per host. A host seen changed has its verdicts
/// forgotten in every shape at once, so that a verdict needs no stamp of its own.
#[derive(Debug, Default)]
pub struct Memo {
    /// At most [`MEMO_SHAPES`]; looked up by key once per match.
    shapes: Vec<ShapeMemo>,
    tick: u64,
    /// Per host: the (state version, reservation version) the remembered verdicts stand for
    /// ([`NEVER`]: none remembered).
    seen: Vec<(u32, u32)>,
}

#[derive(Debug)]
struct ShapeMemo {
    key: Box<str>,
    last_used: u64,
    /// Per host: [`NOT_KNOWN`], [`NO_FIT32`] or the score.
    scores: Vec<u32>,
}

/// The most shapes remembered; the least recently used goes first.
pub const MEMO_SHAPES: usize = 64;
/// What the memo keeps per shape and host: a 32-bit score (or "does not fit", "not known").
pub const MEMO_BYTES_PER_SHAPE_AND_HOST: usize = std::mem::size_of::<u32>();
const NO_FIT: u64 = u64::MAX;
/// Nothing remembered for that host and shape.
const NOT_KNOWN: u32 = u32::MAX;
/// A remembered "does not fit"; scores from here up are not remembered.
const NO_FIT32: u32 = u32::MAX - 1;
const NEVER: (u32, u32) = (u32::MAX, u32::MAX);

impl Memo {
    /// Empty.
    pub fn new() -> Self {
        Self::default()
    }

    /// The index of the shape `key`, made (the least recently used one forgotten when there are
    /// [`MEMO_SHAPES`]) when it is not remembered.
    fn shape(&mut self, key: &str) -> usize {
        if let Some(i) = self.shapes.iter().position(|s| *s.key == *key) {
            return i;
        }
        if self.shapes.len() >= MEMO_SHAPES {
            if let Some(oldest) = (0..self.shapes.len()).min_by_key(|&i| self.shapes[i].last_used) {
                self.shapes.swap_remove(oldest);
            }
        }
        let scores = vec![NOT_KNOWN; self.seen.len()];
        self.shapes.push(ShapeMemo { key: key.into(), last_used: 0, scores });
        self.shapes.len() - 1
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
        let n = hosts.iter().max().map_or(0, |&m| m as usize + 1);
        if self.seen.len() < n {
            self.seen.resize(n, NEVER);
            for shape in &mut self.shapes {
                shape.scores.resize(n, NOT_KNOWN);
            }
        }
        let s = self.shape(key);
        self.shapes[s].last_used = self.tick;
        // One pass: a remembered score where the host has not changed since, the policy's answer
        // where its state is unknown or stale (never remembered: a state goes stale without
        // changing); the rest (changed, or never seen with this shape) is computed after.
        let mut out: Vec<u64> = Vec::with_capacity(hosts.len());
        let mut misses: Vec<(usize, HostId)> = Vec::new();
        for (pos, &h) in hosts.iter().enumerate() {
            let i = h as usize;
            let status = ctx.cache.status(h);
            let fresh = status
                .fetched_at
                .is_some_and(|at| ctx.now.saturating_duration_since(at) <= ctx.stale_after);
            if !fresh {
                // What `evaluate` answers for a host whose state is unknown or stale, without a
                // call per host: after a restart every host is unknown until its state comes.
                out.push(match ctx.unreachable {
                    Unreachable::Open => UNKNOWN_SCORE,
                    Unreachable::Closed => NO_FIT,
                });
                continue;
            }
            let now = (status.version, ctx.reservations.version(h));
            if self.seen[i] != now {
                // Changed: what any shape remembers of it is gone.
                for shape in &mut self.shapes {
                    shape.scores[i] = NOT_KNOWN;
                }
                self.seen[i] = now;
            }
            match self.shapes[s].scores[i] {
                NOT_KNOWN => {
                    out.push(NO_FIT);
                    misses.push((pos, h));
                }
                NO_FIT32 => out.push(NO_FIT),
                score => out.push(u64::from(score)),
            }
        }
        let ids: Vec<HostId> = misses.iter().map(|m| m.1).collect();
        let remembered = &mut self.shapes[s].scores;
        for ((pos, h), score) in misses.into_iter().zip(evaluate_many(ctx, request, &ids)) {
            out[pos] = score;
            // A score too large for 32 bits is computed every time.
            remembered[h as usize] = match score {
                NO_FIT => NO_FIT32,
                s if s < u64::from(NO_FIT32) => s as u32,
                _ => NOT_KNOWN,
            };
        }
        out.into_iter().map(|s| Some(s).filter(|&s| s != NO_FIT)).collect()
    }

    /// Bytes the memo holds.
    pub fn bytes(&self) -> usize {
        self.seen.capacity() * std::mem::size_of::<(u32, u32)>()
            + self.shapes.capacity() * std::mem::size_of::<ShapeMemo>()
            + self
                .shapes
                .iter()
                .map(|s| s.key.len() + s.scores.capacity() * std::mem::size_of::<u32>())
                .sum::<usize>()
    }
}
