//! Fit-and-score of one request on one cached host: the placement core's best-fit placement,
//! on what the host reported minus the tentative reservations and the blocks other jobs have
//! reserved there.
//!
//! **Ranks.** A host's verdict is sorted by one number, [`Verdict::rank`] (lower first), in
//! bands, so that no score inside a band can outweigh the band:
//!
//! 1. the job fits and the host holds a live block reserved for it ([`CLAIMS_BLOCK_RANK`] +
//!    the placement score): dispatching it there spends the block that was set aside for it;
//! 2. it fits as the host is now ([`FITS_RANK`] + the placement score);
//! 3. it fits only in a block reserved for a request of its shape, for one of a group of peer
//!    jobs the batch system matches without naming ([`Verdict::InPeersBlock`],
//!    [`IN_PEERS_BLOCK_RANK`] + the placement score): the host is for that one job only, so
//!    every other peer takes a host where it fits first;
//! 4. it fits only after the host moves running jobs ([`Verdict::AfterMoves`],
//!    [`AFTER_MOVES_RANK`]);
//!    or only in an open prime-time pool that may admit the job ([`Verdict::InPool`],
//!    [`IN_POOL_RANK`], just after);
//! 5. the host's state is unknown and the policy is fail-open ([`UNKNOWN_SCORE`]), as before
//!    after every host whose state is known.
//!
//! **Topology reservations** (topod's `reserve`, [`crate::cache::Block`]). topod places every
//! job but the named one outside a live block, and the named one inside it when it fits there
//! (else anywhere outside the others' blocks). The evaluation does the same for a
//! [`Claimant`]: the blocks it owns are usable, and tried first; every other live block is
//! fenced. A block is live until its `expires_at` by [`Context::epoch_s`], the scheduler's
//! clock (a host whose clock is ahead drops it sooner; the next refresh shows it gone).
//!
//! **Fits after moves.** A host whose topod has `defrag` moves running jobs to make room for an
//! allocate that does not fit although enough CPUs are free. Its free map says what its planner
//! would work with ([`crate::cache::Moves`]: the running jobs it considers, with the time from
//! which each may move, and its strategy and limits), and the evaluation runs the same plan
//! (`defrag::plan_moves`) with the jobs movable by the scheduler's clock: a request that fails
//! only on shape ([`PlaceError::rejected_while_free`]) is [`Verdict::AfterMoves`] (a candidate,
//! ranked below every host where the job fits as it is) when moves make room, and
//! [`NoFit::NoMoves`] when none would (jobs too young, moved too recently, pinned by a
//! `CPU_LIST`). A topod too old to say keeps the optimistic guess: any such host is
//! [`Verdict::AfterMoves`] and topod decides at the allocate. On a host without `defrag` it does
//! not fit, as before. (topod plans first with its open prime-time pools kept out, which the
//! plug-ins do not know; the evaluation is its second try.)

use crate::cache::{
    fresh_from, job_hash, shape_hash, Block, HostCache, HostId, HostState, Moves, OpenPool, Unknown,
};
use crate::config::Unreachable;
use crate::reserve::Reservations;
use rustc_hash::{FxHashMap, FxHasher};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use topo_core::cpuset::CpuSet;
use topo_core::defrag;
use topo_core::gpus::GpuSite;
use topo_core::place::model::HostModel;
use topo_core::place::{self, Occupancy, PlaceError};
use topo_core::request::Request;

/// Score given to hosts kept by the fail-open policy: after every host whose state is known
/// (above every rank band).
pub const UNKNOWN_SCORE: u64 = u64::MAX / 2;

/// The width of a rank band: placement scores ([`place::score`]) stay far below it (a score
/// counts extra NUMA nodes by ten thousand), and one above it is cut to it.
pub const RANK_BAND: u64 = 1 << 32;
/// Rank of a host holding a block for the job: first.
pub const CLAIMS_BLOCK_RANK: u64 = 0;
/// Rank of a host where the job fits as it is.
pub const FITS_RANK: u64 = RANK_BAND;
/// Rank of a host where a group of peers fits only in a block reserved for one of them: after
/// every host where any of them fits as it is.
pub const IN_PEERS_BLOCK_RANK: u64 = 2 * RANK_BAND;
/// Rank of a host where the job fits only after moves: after every host where it fits.
pub const AFTER_MOVES_RANK: u64 = 3 * RANK_BAND;
/// Rank of a host where the job fits only in an open prime-time pool that may admit it: after
/// every host where it fits, as it is or after moves.
pub const IN_POOL_RANK: u64 = AFTER_MOVES_RANK + 1;

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
    /// No placement, and the host's `defrag` would move no job to make room (none may move yet,
    /// a `CPU_LIST` keeps them, or no plan within its limits); with what its jobs' timers say.
    NoMoves(PlaceError, MoveTimers),
    /// It would fit on CPUs of prime-time pools open now that do not admit the job: their
    /// names and whom they admit.
    ClosedPools(String),
    /// A `gpus=` request: too few GPUs are free there, or its CPUs fit beside none of them
    /// (what topod would say).
    Gpus(String),
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
            NoFit::NoMoves(e, timers) => {
                write!(f, "{e}; the host's defrag would move no running job to make room now")?;
                match (timers.movable_now, timers.next_in_s) {
                    (0, Some(s)) => write!(
                        f,
                        " (none has run migrate_min_run_s since its start, or migrate_gap_s \
                         since its last move, yet; the first may move in {s} s)"
                    ),
                    (0, None) => write!(f, " (none of its jobs may move)"),
                    (n, next) => {
                        write!(
                            f,
                            " (moving the {n} job(s) that may move makes no room within its \
                             limits; a job's CPU_LIST keeps it where it is)"
                        )?;
                        match next {
                            Some(s) => write!(f, "; another may move in {s} s"),
                            None => Ok(()),
                        }
                    }
                }
            }
            NoFit::ClosedPools(pools) => write!(
                f,
                "it fits only on CPUs of prime-time pools open now that do not admit it: {pools}"
            ),
            NoFit::Gpus(why) => write!(f, "{why}"),
            NoFit::Unknown(u) => write!(f, "host state unknown and the policy is fail-closed: {u}"),
        }
    }
}

/// What the timers of a defragmenting host's jobs say at the scheduler's clock, for a refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoveTimers {
    /// Jobs that may move now.
    pub movable_now: usize,
    /// Seconds until the next job may move (none: no job will while it runs).
    pub next_in_s: Option<i64>,
}

impl MoveTimers {
    fn of(moves: &Moves, now_s: i64) -> Self {
        MoveTimers {
            movable_now: moves.jobs.iter().filter(|j| j.movable_from <= now_s).count(),
            next_in_s: moves
                .jobs
                .iter()
                .map(|j| j.movable_from)
                .filter(|&t| t > now_s && t < i64::MAX)
                .min()
                .map(|t| t - now_s),
        }
    }
}

/// The answer for one host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// It fits as the host is now.
    Fits {
        /// The placement score ([`place::score`], lower is better), or [`UNKNOWN_SCORE`] for a
        /// fail-open host.
        score: u64,
        /// The CPUs it would get (empty for a fail-open host): inside the claimant's block when
        /// it fits there, as topod places it.
        cpus: CpuSet,
        /// The host holds a live block for the claimant, which the job spends there.
        claims_block: bool,
    },
    /// A group of peer jobs ([`Claimant::Peers`]) fits only by using a live block reserved for
    /// a request of their shape: the one job it is for fits there, and no other does. A
    /// candidate after every host where they fit as they are ([`IN_PEERS_BLOCK_RANK`]), so
    /// that the block does not draw every peer to a host the per-job check (LSF's
    /// checkAllocFn) then closes to all but one.
    InPeersBlock {
        /// The placement score inside the block.
        score: u64,
        /// The CPUs the job the block is for would get.
        cpus: CpuSet,
    },
    /// It does not fit as the host is now, though enough CPUs are free, and the host's topod
    /// would move running jobs to make room (`defrag`, the same plan; see the module docs): a
    /// candidate, after every host where it fits.
    AfterMoves(PlaceError),
    /// It fits only on CPUs of prime-time pools open now that may admit the job, for all the
    /// batch system tells (peers of any queue, or a job that may name the pool): a candidate,
    /// ranked after every other ([`IN_POOL_RANK`]); the per-job check and topod decide. The
    /// pools' names.
    InPool(String),
    /// It does not.
    NoFit(NoFit),
}

impl Verdict {
    /// The number the host is sorted by, lower first (see the module docs), or `None` when the
    /// host is no candidate.
    pub fn rank(&self) -> Option<u64> {
        match *self {
            Verdict::Fits { score, .. } if score >= UNKNOWN_SCORE => Some(UNKNOWN_SCORE),
            Verdict::Fits { score, claims_block: true, .. } => {
                Some(CLAIMS_BLOCK_RANK + score.min(RANK_BAND - 1))
            }
            Verdict::Fits { score, claims_block: false, .. } => {
                Some(FITS_RANK + score.min(RANK_BAND - 1))
            }
            Verdict::InPeersBlock { score, .. } => {
                Some(IN_PEERS_BLOCK_RANK + score.min(RANK_BAND - 1))
            }
            Verdict::AfterMoves(_) => Some(AFTER_MOVES_RANK),
            Verdict::InPool(_) => Some(IN_POOL_RANK),
            Verdict::NoFit(_) => None,
        }
    }
}

/// Whose blocks and pools a placement may use: topod places a job inside its own block and
/// every other job outside it, and keeps every job out of the prime-time pools open now that do
/// not admit it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claimant {
    /// A job without a block, admitted to no pool: every live block and every open pool is in
    /// its way.
    Anyone,
    /// One job, by the hash of its topod job id ([`Claimant::job`]): its own blocks are
    /// usable, every other live block is in its way; and its queue and owner, when known
    /// ([`Claimant::job_of`]), for the pools that admit them.
    Job(u64, Admission),
    /// One of a group of jobs with the same request that the batch system matches together
    /// without saying which job it is placing (LSF's "peer jobs": matchFn gets no job). A block
    /// made for a request of the same shape ([`shape_hash`]) may be one of theirs: a host where
    /// they fit outside it ranks as any where they fit (the job it is for goes inside it, the
    /// others beside it), and one where they fit only in it is a candidate for that one job,
    /// after every host where they fit ([`Verdict::InPeersBlock`]). A pool may admit them, so
    /// a host where they fit only in an open pool is a candidate ranked after every other
    /// ([`Verdict::InPool`]). Optimistic: the per-job check (LSF's checkAllocFn, with
    /// [`Claimant::Job`]) and topod decide for the job itself.
    Peers(u64),
}

/// What a prime-time pool admits a job by, as far as the batch system tells: its queue (as
/// [`job_hash`] of the name) and its owner's uid. (A job may also name a pool in its
/// environment, `TOPO_POOL`, which the scheduler does not see: a pool that admits jobs by name
/// is taken as possibly the job's.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Admission {
    /// The hash of its queue's name.
    pub queue: Option<u64>,
    /// Its owner's uid.
    pub uid: Option<u32>,
}

impl Admission {
    /// A job of `queue` owned by `uid`.
    pub fn new(queue: Option<&str>, uid: Option<u32>) -> Self {
        Admission { queue: queue.map(job_hash), uid }
    }
}

impl Claimant {
    /// The job with topod job id `id` (e.g. `lsf-1234`), its queue and owner not known.
    pub fn job(id: &str) -> Self {
        Claimant::Job(job_hash(id), Admission::default())
    }

    /// The job with topod job id `id`, of the queue and owner in `admission`.
    pub fn job_of(id: &str, admission: Admission) -> Self {
        Claimant::Job(job_hash(id), admission)
    }

    /// The group of jobs whose request is `request` (its task count aside).
    pub fn peers_of(request: &Request) -> Self {
        Claimant::Peers(shape_hash(request))
    }

    /// Whether `block` is the claimant's own.
    pub fn owns(&self, block: &Block) -> bool {
        match *self {
            Claimant::Anyone => false,
            Claimant::Job(job, _) => block.job == job,
            Claimant::Peers(shape) => block.shape == shape,
        }
    }

    /// Whether `pool` surely admits the claimant (by its queue or owner).
    fn admitted_to(&self, pool: &OpenPool) -> bool {
        match *self {
            Claimant::Job(_, a) => {
                a.queue.is_some_and(|q| pool.queues.contains(&q))
                    || a.uid.is_some_and(|u| pool.users.contains(&u))
            }
            Claimant::Anyone | Claimant::Peers(_) => false,
        }
    }

    /// Whether `pool` may admit the claimant for all the batch system tells: peers may be of
    /// any queue; a job may name a pool that admits by name.
    fn maybe_admitted_to(&self, pool: &OpenPool) -> bool {
        match self {
            Claimant::Anyone => false,
            Claimant::Job(..) => self.admitted_to(pool) || pool.named,
            Claimant::Peers(_) => true,
        }
    }
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
    /// The time now in seconds since the epoch ([`epoch_now`]), for the blocks' expiries.
    pub epoch_s: i64,
    /// How old a state may be.
    pub stale_after: Duration,
    /// What to do with unknown hosts.
    pub unreachable: Unreachable,
}

/// Seconds since the epoch by the system clock (0 before 1970).
pub fn epoch_now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

/// The least number of CPUs `request` can be placed on.
pub fn min_cpus(request: &Request) -> usize {
    request.tasks.unwrap_or(place::DEFAULT_TASKS) as usize * request.units_per_task as usize
}

/// What `who` may not use on `host` in `state`: held, fenced, not allocatable, tentatively
/// reserved, in another job's live block, or in an open prime-time pool that does not surely
/// admit it; and the CPUs of its own live blocks there.
pub fn occupancy_for(
    ctx: &Context<'_>,
    host: HostId,
    state: &HostState,
    who: Claimant,
) -> (Occupancy, CpuSet) {
    let mut occupancy = state.occupancy();
    for pool in state.pools.iter().filter(|p| !who.admitted_to(p)) {
        occupancy.fenced.union_with(&pool.cpus.unpack());
    }
    if let Some(reserved) = ctx.reservations.on_host(host) {
        occupancy.held.union_with(reserved);
    }
    let mut own = CpuSet::new();
    for block in state.blocks.iter().filter(|b| b.live(ctx.epoch_s)) {
        let cpus = block.cpus.unpack();
        if who.owns(block) {
            own.union_with(&cpus);
        } else {
            occupancy.fenced.union_with(&cpus);
        }
    }
    (occupancy, own)
}

/// Fit-and-score of `request` (its task count set) on `host`, for `who`.
///
/// **Prime-time pools.** An open pool's CPUs are for the jobs it admits (topod.toml
/// `prime_pools`). The placement keeps out of every open pool that does not surely admit `who`
/// ([`occupancy_for`]); where that finds no room, a host where the job would fit in pools that
/// may admit it ([`Claimant`]: peers of unknown queue, a pool admitting jobs by name) is
/// [`Verdict::InPool`], and one where it would fit only in pools that cannot admit it is
/// [`NoFit::ClosedPools`].
pub fn evaluate(ctx: &Context<'_>, host: HostId, request: &Request, who: Claimant) -> Verdict {
    let verdict = evaluate_outside_pools(ctx, host, request, who);
    let Verdict::NoFit(NoFit::TooFewCpus { .. } | NoFit::Placement(_) | NoFit::NoMoves(..)) =
        verdict
    else {
        return verdict;
    };
    let Ok(state) = ctx.cache.usable(host, ctx.now, ctx.stale_after) else { return verdict };
    let closed: Vec<&OpenPool> = state.pools.iter().filter(|p| !who.admitted_to(p)).collect();
    if closed.is_empty() {
        return verdict;
    }
    // Placed again with the pools that may admit it open to it, then with every pool, as if
    // each admitted it: which of the two finds room says why.
    let fits_with = |usable: &dyn Fn(&OpenPool) -> bool| {
        let mut lifted = state.clone();
        lifted.pools = state.pools.iter().filter(|p| !usable(p)).cloned().collect();
        let (occupancy, _) = occupancy_for(ctx, host, &lifted, Claimant::Anyone);
        place::fit_and_score(ctx.cache.model(state), &occupancy, request).is_ok()
    };
    let names = |pools: &[&OpenPool]| {
        pools.iter().map(|p| p.name.to_string()).collect::<Vec<_>>().join(", ")
    };
    let maybe: Vec<&OpenPool> =
        closed.iter().copied().filter(|p| who.maybe_admitted_to(p)).collect();
    if !maybe.is_empty() && fits_with(&|p| who.admitted_to(p) || who.maybe_admitted_to(p)) {
        return Verdict::InPool(names(&maybe));
    }
    if fits_with(&|_| true) {
        return Verdict::NoFit(NoFit::ClosedPools(names(&closed)));
    }
    verdict
}

/// [`evaluate`] without the pools that do not surely admit `who`.
fn evaluate_outside_pools(
    ctx: &Context<'_>,
    host: HostId,
    request: &Request,
    who: Claimant,
) -> Verdict {
    let state = match ctx.cache.usable(host, ctx.now, ctx.stale_after) {
        Ok(s) => s,
        Err(unknown) => {
            // Fail-open is for a topod that does not answer, not for one not asked yet.
            return match ctx.unreachable {
                Unreachable::Open if ctx.cache.status(host).asked() => {
                    Verdict::Fits { score: UNKNOWN_SCORE, cpus: CpuSet::new(), claims_block: false }
                }
                _ => Verdict::NoFit(NoFit::Unknown(unknown)),
            };
        }
    };
    let model = ctx.cache.model(state);
    let (occupancy, own) = occupancy_for(ctx, host, state, who);
    // Counting first: on a busy cluster most hosts fail here, without a placement.
    let free = model.allocatable.len()
        - model.allocatable.intersection_len(&occupancy.held.union(&occupancy.fenced));
    let needed = min_cpus(request);
    if free < needed {
        return Verdict::NoFit(NoFit::TooFewCpus { free, needed });
    }
    // A gpus= request is placed beside the free GPUs topod would choose for it; in its own
    // block when that holds its GPUs (topod gives it those, and the block lies beside them).
    // Only a gpus= request looks at GPUs (the scheduler's hot path: most requests do not).
    let asks_gpus = request.gpus_per_task.is_some();
    let own_gpus = if asks_gpus { own_block_gpus(ctx, state, who) } else { Vec::new() };
    let free_gpus = if asks_gpus {
        ctx.reservations.untaken_gpus(host, &state.gpus)
    } else {
        std::borrow::Cow::Borrowed(&state.gpus[..])
    };
    let placed = |occupancy: &Occupancy, own: CpuSet, own_gpus: &[GpuSite]| {
        let (request, nodes) = match gpu_choice(model, &free_gpus, own_gpus, occupancy, request) {
            Err(no) => return Verdict::NoFit(no),
            Ok((Some(near), gpus, _)) => (near, gpu_nodes(&gpus)),
            Ok((None, _, _)) => (request.clone(), Vec::new()),
        };
        evaluate_placed(ctx, state, model, occupancy, own, &request, &nodes)
    };
    let claims_block = !own.is_empty();
    if claims_block && matches!(who, Claimant::Peers(_)) {
        // The block is one peer's at most: where they fit beside it (as it is, or after moves
        // that leave it alone), the host is as good for every one of them; where they need
        // it, only for the one it is for.
        let mut beside = occupancy.clone();
        beside.fenced.union_with(&own);
        let for_any = placed(&beside, CpuSet::new(), &[]);
        if !matches!(for_any, Verdict::NoFit(_)) {
            return for_any;
        }
        return match placed(&occupancy, own, &own_gpus) {
            Verdict::Fits { score, cpus, .. } => Verdict::InPeersBlock { score, cpus },
            // Moves that need the block's CPUs would make room for its job only, and where is
            // topod's to say: left to the per-job check and topod, not offered to the peers.
            _ => for_any,
        };
    }
    placed(&occupancy, own, &own_gpus)
}

/// The GPUs topod's reservations hold for `who` in its own live blocks on a host in `state`.
fn own_block_gpus(ctx: &Context<'_>, state: &HostState, who: Claimant) -> Vec<GpuSite> {
    state
        .blocks
        .iter()
        .filter(|b| b.live(ctx.epoch_s) && who.owns(b))
        .flat_map(|b| b.gpus.iter().cloned())
        .collect()
}

/// Where a `gpus=` request goes and the GPUs it takes, as topod chooses them: among those its
/// own blocks hold (`own`) first, else among the free ones (`free`: topod's free map's, less
/// those tentatively reserved for other dispatches). See [`beside_free_gpus`]. The flag says
/// the GPUs are its own blocks'.
fn gpu_choice(
    model: &HostModel,
    free: &[GpuSite],
    own: &[GpuSite],
    occupancy: &Occupancy,
    request: &Request,
) -> Result<(Option<Request>, Vec<GpuSite>, bool), NoFit> {
    match beside_free_gpus(model, own, occupancy, request) {
        Ok((near, gpus)) if !own.is_empty() => Ok((near, gpus, true)),
        _ => beside_free_gpus(model, free, occupancy, request)
            .map(|(near, gpus)| (near, gpus, false)),
    }
}

/// The free GPUs `who`'s `request` takes on `host` where [`evaluate`] finds it fits: what a
/// dispatch there reserves, so that the next job does not count them as free
/// ([`crate::reserve`]). None for a request without `gpus=`, or one that takes GPUs its own
/// blocks hold (topod's free map counts those apart already).
pub fn gpus_taken(
    ctx: &Context<'_>,
    host: HostId,
    request: &Request,
    who: Claimant,
) -> Vec<GpuSite> {
    if request.gpus_per_task.is_none() {
        return Vec::new();
    }
    let Some(state) = ctx.cache.host(host).state.as_ref() else { return Vec::new() };
    let (occupancy, _) = occupancy_for(ctx, host, state, who);
    let free = ctx.reservations.untaken_gpus(host, &state.gpus);
    let own = own_block_gpus(ctx, state, who);
    match gpu_choice(ctx.cache.model(state), &free, &own, &occupancy, request) {
        Ok((_, gpus, false)) => gpus,
        _ => Vec::new(),
    }
}

/// Whether `who`'s own live blocks on `host` hold GPUs (which topod gives it first).
pub fn holds_own_gpus(ctx: &Context<'_>, host: HostId, who: Claimant) -> bool {
    ctx.cache
        .host(host)
        .state
        .as_ref()
        .is_some_and(|state| !own_block_gpus(ctx, state, who).is_empty())
}

/// For a `gpus=` request (GPUs per task, chosen by topod): the request kept to the CPUs near
/// the GPUs among `gpus` (the free map's free ones, or those the job's own blocks hold) topod
/// would choose on this host ([`topo_core::gpus::choose_among`]), `None` where it runs anywhere
/// (no `gpus=`, `gpubind=any`, a GPU of unknown place), with the GPUs it takes; refused where
/// too few GPUs are free or its CPUs fit beside none.
fn beside_free_gpus(
    model: &HostModel,
    gpus: &[GpuSite],
    occupancy: &Occupancy,
    request: &Request,
) -> Result<(Option<Request>, Vec<GpuSite>), NoFit> {
    use topo_core::request::{GpuBind, Level};
    let Some(per_task) = request.gpus_per_task else { return Ok((None, Vec::new())) };
    if request.is_malleable() {
        return Err(NoFit::Gpus(format!(
            "gpus={per_task} with a task range: a job's GPUs do not grow or shrink with it"
        )));
    }
    let wanted = request.gpus_wanted().unwrap_or(0);
    let free = gpus.len();
    if free < wanted {
        return Err(NoFit::Gpus(format!(
            "gpus={per_task} needs {wanted} free GPU(s); {free} are free"
        )));
    }
    let chosen = topo_core::gpus::choose_among(
        gpus,
        model,
        occupancy,
        request,
        wanted,
        place::Strategy::BestFit,
    );
    let Some((picked, _)) = chosen else {
        if request.gpubind == Some(GpuBind::Any) {
            // Anywhere, as topod places it when it fits beside none (with the first GPUs).
            return Ok((None, gpus[..wanted].to_vec()));
        }
        return Err(NoFit::Gpus(format!(
            "gpus={per_task}: its CPUs do not fit beside any {wanted} of the {free} free GPU(s)"
        )));
    };
    let taken: Vec<GpuSite> = picked.iter().map(|&g| gpus[g].clone()).collect();
    if request.gpubind == Some(GpuBind::Any) {
        return Ok((None, taken));
    }
    let level = if request.gpubind == Some(GpuBind::Socket) { Level::Socket } else { Level::Numa };
    let mut near = CpuSet::new();
    for site in &taken {
        let cpus = if level == Level::Socket { &site.socket } else { &site.numa };
        match cpus {
            Some(cpus) => near.union_with(cpus),
            None => return Ok((None, taken)),
        }
    }
    Ok((topo_core::gpus::within(request, &near), taken))
}

/// The GPUs `taken` by NUMA node when they lie in several (see
/// [`topo_core::gpus::place_split`]); empty otherwise.
fn gpu_nodes(taken: &[GpuSite]) -> Vec<(CpuSet, usize)> {
    topo_core::gpus::nodes_of(taken.iter().map(|g| g.numa.as_ref())).unwrap_or_default()
}

/// The verdict for `request` on a host in `state` whose CPUs the claimant may not use are
/// `occupancy`, its own live blocks there being `own`; a job whose GPUs lie in several NUMA
/// nodes (`gpu_nodes`) is placed with each node's share of its tasks beside them first, as
/// topod places it.
fn evaluate_placed(
    ctx: &Context<'_>,
    state: &HostState,
    model: &HostModel,
    occupancy: &Occupancy,
    own: CpuSet,
    request: &Request,
    gpu_nodes: &[(CpuSet, usize)],
) -> Verdict {
    let claims_block = !own.is_empty();
    // Inside its own block first, as topod places the job its block is for.
    if claims_block {
        let inside = match &request.cpu_list {
            Some(list) => list.intersection(&own),
            None => own,
        };
        if !inside.is_empty() {
            let r = Request { cpu_list: Some(inside), ..request.clone() };
            let split = topo_core::gpus::fit_split(model, occupancy, &r, gpu_nodes);
            if let Some(fit) = split.or_else(|| place::fit_and_score(model, occupancy, &r).ok()) {
                return Verdict::Fits { score: fit.score, cpus: fit.cpus, claims_block };
            }
        }
    }
    if let Some(fit) = topo_core::gpus::fit_split(model, occupancy, request, gpu_nodes) {
        return Verdict::Fits { score: fit.score, cpus: fit.cpus, claims_block };
    }
    match place::fit_and_score(model, occupancy, request) {
        Ok(fit) => Verdict::Fits { score: fit.score, cpus: fit.cpus, claims_block },
        // topod tries moves on every refusal but one that can never fit (its `could_fit`):
        // whole cores, L3 groups or NUMA nodes that the running jobs' CPUs break up too.
        Err(e) if state.defrag && !matches!(e, PlaceError::Impossible(_)) => match &state.moves {
            Some(moves) if moves_make_room(ctx, model, occupancy, moves, request) => {
                Verdict::AfterMoves(e)
            }
            Some(moves) => Verdict::NoFit(NoFit::NoMoves(e, MoveTimers::of(moves, ctx.epoch_s))),
            // A topod that does not say what it would move: an optimistic guess, as before.
            None if e.rejected_while_free() => Verdict::AfterMoves(e),
            None => Verdict::NoFit(NoFit::Placement(e)),
        },
        Err(e) => Verdict::NoFit(NoFit::Placement(e)),
    }
}

/// Whether topod's planner, given what it reported ([`Moves`]), finds moves that make room for
/// `request`: the same plan ([`defrag::plan_moves`]) with the jobs movable by the scheduler's
/// clock. (topod plans first with its open prime-time pools kept out, which the plug-in does
/// not know; its second try is this one.)
fn moves_make_room(
    ctx: &Context<'_>,
    model: &HostModel,
    occupancy: &Occupancy,
    moves: &Moves,
    request: &Request,
) -> bool {
    let jobs: Vec<defrag::Movable<'_, usize>> = moves
        .jobs
        .iter()
        .enumerate()
        .map(|(i, j)| defrag::Movable {
            key: i,
            request: &j.request,
            cpus: &j.cpus,
            fenced: &j.fenced,
            tasks: &j.tasks,
            may_move: j.movable_from <= ctx.epoch_s,
        })
        .collect();
    if !jobs.iter().any(|j| j.may_move) {
        return false;
    }
    defrag::plan_moves(model, occupancy, &jobs, request, moves.strategy, moves.limits)
        .is_some_and(|plan| !plan.moves.is_empty())
}

/// The most tasks of `request` (at most `limit`) that `host` takes for `who` (where they fit,
/// or fit after moves: see [`Verdict::rank`]); 0 when none does.
pub fn max_tasks(
    ctx: &Context<'_>,
    host: HostId,
    request: &Request,
    who: Claimant,
    limit: u32,
) -> u32 {
    let fits = |n: u32| {
        let mut r = request.clone();
        r.tasks = Some(n);
        evaluate(ctx, host, &r, who).rank().is_some()
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

/// Ranks of `request` on `hosts` for `who` (`NO_FIT` where it is no candidate).
///
/// A placement depends on nothing but the host's hardware model, its occupancy, its blocks,
/// whether it defragments, and its tentative reservations, so hosts equal in all of them get
/// the same verdict: each distinct state is placed once ([`distinct_states`]). A cluster's idle
/// hosts of one hardware model are one placement, not thousands; a cluster where every host
/// differs pays one placement per host.
fn evaluate_many(
    ctx: &Context<'_>,
    request: &Request,
    who: Claimant,
    hosts: &[HostId],
) -> Vec<u64> {
    let (reps, which) = distinct_states(ctx, hosts);
    let ranks = evaluate_each(ctx, request, who, &reps);
    which.iter().map(|&r| ranks[r as usize]).collect()
}

/// The hosts of `hosts` that stand for every distinct state among them (as [`evaluate_many`]
/// says), and for each host of `hosts` the index of the one that stands for it. Hosts whose
/// state is not usable each stand for themselves. Hosts without tentative reservations are told
/// apart by their state's fingerprint ([`crate::cache::state_fingerprint`], in the flat status
/// array: no host's state is read); the few with reservations by their whole state, compared.
fn distinct_states(ctx: &Context<'_>, hosts: &[HostId]) -> (Vec<HostId>, Vec<u32>) {
    use std::hash::{Hash, Hasher};
    let mut reps: Vec<HostId> = Vec::new();
    let mut which: Vec<u32> = Vec::with_capacity(hosts.len());
    // Keyed by fingerprints, themselves hashes of no one's choosing: a fast hash (Fx) suffices,
    // where SipHash was a tenth of a match's instructions (callgrind, LSF scale scenario).
    let mut by_print: FxHashMap<[u64; 2], u32> = FxHashMap::default();
    // Hosts with reservations: hash of their state's fingerprint and what is reserved there ->
    // the representatives with that hash (equal keys are compared, so a hash collision only
    // costs a comparison). The fingerprint covers all the state a placement reads (free GPUs
    // and open pools too); the reserved GPUs count as much as the reserved CPUs.
    let mut by_hash: FxHashMap<u64, Vec<u32>> = FxHashMap::default();
    let fresh_from = fresh_from(ctx.now, ctx.stale_after);
    let reserved = |h: HostId| (ctx.reservations.on_host(h), ctx.reservations.gpus_on_host(h));
    let key_of = |h: HostId| {
        ctx.cache
            .usable(h, ctx.now, ctx.stale_after)
            .ok()
            .map(|_| (ctx.cache.status(h).fingerprint, reserved(h)))
    };
    let own = |h: HostId, reps: &mut Vec<HostId>| {
        reps.push(h);
        reps.len() as u32 - 1
    };
    for &h in hosts {
        if !ctx.cache.fetched_since(h, fresh_from) {
            which.push(own(h, &mut reps));
            continue;
        }
        if reserved(h) == (None, None) {
            let print = ctx.cache.status(h).fingerprint;
            let r = *by_print.entry(print).or_insert_with(|| own(h, &mut reps));
            which.push(r);
            continue;
        }
        let Some(key) = key_of(h) else {
            which.push(own(h, &mut reps));
            continue;
        };
        let mut hasher = FxHasher::default();
        key.hash(&mut hasher);
        let same = by_hash.entry(hasher.finish()).or_default();
        match same.iter().find(|&&r| key_of(reps[r as usize]) == Some(key)) {
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

/// Ranks of `request` on each of `hosts` for `who`. Many hosts are split over the machine's
/// cores: a first match of a new shape over thousands of hosts is the one costly case, and the
/// scheduler waits for it. Threads only compute; none does I/O.
fn evaluate_each(
    ctx: &Context<'_>,
    request: &Request,
    who: Claimant,
    hosts: &[HostId],
) -> Vec<u64> {
    let one = |&h: &HostId| evaluate(ctx, h, request, who).rank().unwrap_or(NO_FIT);
    if hosts.len() < PARALLEL_FROM {
        return hosts.iter().map(one).collect();
    }
    // Asked once per process: the standard library reads the cgroup's CPU limit from files at
    // each call (an open and a read per match, seen in a profile of the LSF module).
    static THREADS: OnceLock<usize> = OnceLock::new();
    let threads = *THREADS.get_or_init(|| {
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_MATCH_THREADS)
    });
    if threads < 2 {
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
/// reservations change. A host's state changes only when a job starts or ends there, or its
/// blocks or `defrag` change (a refresh that brings the same state keeps its version), so a
/// scheduler matching many jobs of the same shape pays for a placement once per host and
/// change, not once per job (LSF, for the same reason, matches "peer jobs" with equal requests
/// together).
///
/// The memo answers for the peer group of the request ([`Claimant::Peers`]): the batch system
/// matches without naming the job, and a verdict for a named job would not hold for its peers.
/// A host whose earliest block has expired by the scheduler's clock is evaluated at every match
/// and its verdict not remembered (it changes without the state changing) until the refresh
/// that brings the state without the block.
///
/// Memory: per host, the (state version, reservation version) pair its remembered verdicts stand
/// for (8 bytes); per shape and host, the rank (its band in 2 bits, the score in 30) or "does
/// not fit" or "not known" (4 bytes). At [`MEMO_SHAPES`] shapes that is 264 bytes per host. A
/// host seen changed has its verdicts forgotten in every shape at once, so that a verdict needs
/// no stamp of its own.
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
    /// Per host: [`NOT_KNOWN`], [`NO_FIT32`] or the rank ([`pack_rank`]).
    scores: Vec<u32>,
}

/// The most shapes remembered; the least recently used goes first.
pub const MEMO_SHAPES: usize = 64;
/// What the memo keeps per shape and host: a 32-bit rank (or "does not fit", "not known").
pub const MEMO_BYTES_PER_SHAPE_AND_HOST: usize = std::mem::size_of::<u32>();
const NO_FIT: u64 = u64::MAX;
/// [`Memo::ranks`]'s "no candidate": above every rank.
pub const NO_RANK: u64 = NO_FIT;
/// Nothing remembered for that host and shape.
const NOT_KNOWN: u32 = u32::MAX;
/// A remembered "does not fit" (band 3 with the two highest scores, which no rank has:
/// band 3 holds only [`AFTER_MOVES_RANK`] and [`IN_POOL_RANK`]).
const NO_FIT32: u32 = u32::MAX - 1;
const NEVER: (u32, u32) = (u32::MAX, u32::MAX);
/// Bits of a remembered rank's score; the two above are its band.
const SCORE_BITS: u32 = 30;

/// A rank in 32 bits: its band (0 to 3) above its score; [`NOT_KNOWN`] (computed every time)
/// for a rank that does not fit (a score of 2^30 or more, one that would read as
/// [`NO_FIT32`] or [`NOT_KNOWN`], or no band: a fail-open host's).
fn pack_rank(rank: u64) -> u32 {
    let (band, score) = (rank / RANK_BAND, rank % RANK_BAND);
    if band > 3 || score >= 1 << SCORE_BITS {
        return NOT_KNOWN;
    }
    let packed = ((band as u32) << SCORE_BITS) | score as u32;
    if packed >= NO_FIT32 {
        return NOT_KNOWN;
    }
    packed
}

/// The rank [`pack_rank`] packed.
fn unpack_rank(packed: u32) -> u64 {
    u64::from(packed >> SCORE_BITS) * RANK_BAND + u64::from(packed & ((1 << SCORE_BITS) - 1))
}

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

    /// Ranks ([`Verdict::rank`]) of `request` (whose canonical text with its task count is
    /// `key`) on each of `hosts`, for the request's peer group ([`Claimant::peers_of`]), as
    /// `Some(rank)` when the host is a candidate; each comes from the memo when the host has not
    /// changed since, else from [`evaluate`].
    pub fn scores(
        &mut self,
        ctx: &Context<'_>,
        key: &str,
        request: &Request,
        hosts: &[HostId],
    ) -> Vec<Option<u64>> {
        let ranks = self.ranks(ctx, key, request, hosts);
        ranks.into_iter().map(|s| Some(s).filter(|&s| s != NO_RANK)).collect()
    }

    /// [`scores`](Self::scores) as plain ranks, [`NO_RANK`] where the host is no candidate: the
    /// form a scheduler's match over thousands of candidates reads without a second vector.
    pub fn ranks(
        &mut self,
        ctx: &Context<'_>,
        key: &str,
        request: &Request,
        hosts: &[HostId],
    ) -> Vec<u64> {
        self.tick += 1;
        let who = Claimant::peers_of(request);
        let n = hosts.iter().max().map_or(0, |&m| m as usize + 1);
        if self.seen.len() < n {
            self.seen.resize(n, NEVER);
            for shape in &mut self.shapes {
                shape.scores.resize(n, NOT_KNOWN);
            }
        }
        let s = self.shape(key);
        self.shapes[s].last_used = self.tick;
        // Whether a verdict on the host holds for as long as its state: not once one of its
        // blocks has expired (`cache::NO_BLOCKS` is above every time).
        let lasting = |blocks_until: u32| i64::from(blocks_until) > ctx.epoch_s;
        // One pass: a remembered rank where the host has not changed since, the policy's answer
        // where its state is unknown or stale (never remembered: a state goes stale without
        // changing); the rest (changed, never seen with this shape, or with an expired block)
        // is computed after.
        let mut out: Vec<u64> = Vec::with_capacity(hosts.len());
        let mut misses: Vec<(usize, HostId)> = Vec::new();
        // Fresh: fetched at or after this (none: the process is younger than `stale_after`).
        // One comparison per host instead of a subtraction.
        let fresh_from = fresh_from(ctx.now, ctx.stale_after);
        for (pos, &h) in hosts.iter().enumerate() {
            let i = h as usize;
            let status = ctx.cache.status(h);
            let fresh = ctx.cache.fetched_since(h, fresh_from);
            if !fresh {
                // What `evaluate` answers for a host whose state is unknown or stale, without a
                // call per host: after a restart every host is unknown until its state comes.
                out.push(match ctx.unreachable {
                    Unreachable::Open if status.asked() => UNKNOWN_SCORE,
                    _ => NO_FIT,
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
            let remembered =
                if lasting(status.blocks_until) { self.shapes[s].scores[i] } else { NOT_KNOWN };
            match remembered {
                NOT_KNOWN => {
                    out.push(NO_FIT);
                    misses.push((pos, h));
                }
                NO_FIT32 => out.push(NO_FIT),
                packed => out.push(unpack_rank(packed)),
            }
        }
        let ids: Vec<HostId> = misses.iter().map(|m| m.1).collect();
        let remembered = &mut self.shapes[s].scores;
        for ((pos, h), rank) in misses.into_iter().zip(evaluate_many(ctx, request, who, &ids)) {
            out[pos] = rank;
            remembered[h as usize] = if !lasting(ctx.cache.status(h).blocks_until) {
                NOT_KNOWN
            } else if rank == NO_FIT {
                NO_FIT32
            } else {
                pack_rank(rank)
            };
        }
        out
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

#[cfg(test)]
mod pack_tests {
    use super::*;

    #[test]
    fn every_band_packs_and_unpacks_and_none_reads_as_no_fit_or_not_known() {
        // Band 3 (after moves, in a pool) was once not kept: every match evaluated those
        // hosts again.
        for rank in [
            CLAIMS_BLOCK_RANK,
            CLAIMS_BLOCK_RANK + 12_345,
            FITS_RANK,
            FITS_RANK + (1 << SCORE_BITS) - 1,
            IN_PEERS_BLOCK_RANK + 7,
            AFTER_MOVES_RANK,
            IN_POOL_RANK,
        ] {
            let packed = pack_rank(rank);
            assert!(packed != NOT_KNOWN && packed != NO_FIT32, "{rank}");
            assert_eq!(unpack_rank(packed), rank);
        }
        // What cannot be kept is computed every time, never taken for "does not fit".
        for rank in [
            UNKNOWN_SCORE,
            FITS_RANK + (1 << SCORE_BITS),
            AFTER_MOVES_RANK + (1 << SCORE_BITS) - 2,
            AFTER_MOVES_RANK + (1 << SCORE_BITS) - 1,
            4 * RANK_BAND,
        ] {
            assert_eq!(pack_rank(rank), NOT_KNOWN, "{rank}");
        }
    }
}
