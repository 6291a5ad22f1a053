//! The host-state cache: per host, a shared hardware model and the free map topod last
//! reported. Pure data; [`crate::fetch`] fills it.
//!
//! **Readers never wait for the refresher.** The cache the scheduler's callbacks read is an
//! immutable snapshot ([`CacheCell::load`], an atomically swapped `Arc`): a writer
//! ([`CacheCell::write`]) works on its own copy and publishes it when it is done, so a refresh
//! that builds ten thousand hardware models never holds anything a reader needs. The copy is
//! cheap: hosts are `Arc`s (a copy is one reference count per host, and a host is cloned only
//! when it is changed), and the name index is shared until a host is added.
//!
//! **Names.** Schedulers and configurations disagree on domains (a host configured as
//! `n1.cluster.example` is offered as `n1`, or the other way round). Every host is indexed by its
//! name and by its aliases: its short name (the part before the first dot) and, when a domain is
//! configured ([`HostCache::set_domain`]), its short name with that domain. A lookup is one or
//! two hash probes; a name that is no host's is remembered in a bounded negative cache, which
//! every added host clears.

use crate::address::Address;
use arc_swap::ArcSwap;
use serde::Deserialize;
use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, LockResult, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};
use topo_core::cpuset::CpuSet;
use topo_core::defrag::DefragLimits;
use topo_core::place::model::HostModel;
use topo_core::place::{Occupancy, Strategy};
use topo_core::request::{self, Request};
use topo_core::reservation::Reservation;
use topo_core::topology::Topology;

/// A host's index in the cache; stable for the life of the cache.
pub type HostId = u32;

/// The part of topod's `free_map` reply ([`topo_core::proto::reply::FreeMap`]) the cache keeps, so
/// that ten thousand hosts cost no more than they must; `reads_the_protocols_free_map` checks
/// that it reads what topod sends.
#[derive(Debug, Clone, Deserialize)]
pub struct FreeMap {
    /// The ledger's generation: it changes whenever a job is allocated or released.
    pub generation: u64,
    /// CPUs jobs may get on that host (its reserved CPUs left out).
    pub allocatable: CpuSet,
    /// CPUs held by jobs.
    pub held: CpuSet,
    /// CPUs no new job may get (the rest of an exclusive job's domains).
    pub fenced: CpuSet,
    /// The jobs topod holds CPUs for.
    #[serde(default)]
    pub job_ids: Vec<String>,
    /// The live topology reservations: a block of CPUs each, for one waiting job only
    /// (kept as [`Block`]s).
    #[serde(default)]
    pub reservations: Vec<Reservation>,
    /// The host moves running jobs to make room for an allocate that does not fit although
    /// enough CPUs are free (topod.toml `defrag`).
    #[serde(default)]
    pub defrag: bool,
    /// With `defrag`: the running jobs topod's planner may move and its bounds (a topod
    /// older than this field sends none: such a host counts as fitting after moves whenever
    /// enough CPUs are free, as before).
    #[serde(default)]
    pub moves: Option<topo_core::proto::reply::DefragView>,
    /// The host's prime-time pools, open or not as of topod's last look.
    #[serde(default)]
    pub pools: Vec<topo_core::proto::reply::PoolStatus>,
    /// The GPUs no job and no reservation holds there, each by where it is (for `gpus=`
    /// requests).
    #[serde(default)]
    pub gpus: Vec<topo_core::gpus::GpuSite>,
    /// The GPUs reservations hold for their jobs, free to those jobs only (kept with their
    /// [`Block`]s).
    #[serde(default)]
    pub reserved_gpus: Vec<topo_core::proto::reply::ReservedGpu>,
    /// The fingerprint of the topology topod serves (a topod older than this field sends
    /// none): when it is not the one the cache has, the topology is fetched again.
    #[serde(default)]
    pub topology_id: Option<u64>,
}

/// What [`HostCache::update`] did with a fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Updated {
    /// The state is the one fetched.
    Applied,
    /// The free map named another topology than the cached one and none came with it (its
    /// topod is on other hardware now): the host's state is gone, and the next fetch brings
    /// the topology.
    AnotherTopology,
}

/// What the cache holds of a host's topology, which tells a fetch whether to bring it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CachedTopology {
    /// None: the fetch brings it.
    Nothing,
    /// The one with this fingerprint (`None`: from a topod too old to send one): the fetch
    /// brings it again only when topod's free map names another.
    Known(Option<u64>),
}

impl CachedTopology {
    /// Whether a fetch must bring the topology whatever the free map says.
    pub fn is_nothing(self) -> bool {
        self == CachedTopology::Nothing
    }

    /// Whether topod's free map, naming `served`, says the cached topology is not topod's: it
    /// names another, or none where the cached one came with a name (a topod too old to name it
    /// took the place of one that did; fetched once, then cached as unnamed).
    pub fn is_stale(self, served: Option<u64>) -> bool {
        match self {
            CachedTopology::Nothing => true,
            CachedTopology::Known(known) => served != known,
        }
    }
}

/// What the cache knows of a host's state: what a placement depends on and the jobs topod
/// holds. (Not topod's ledger generation: a ledger that changed and came back to the same CPUs
/// and jobs is the same state, and what the memo computed for it stays true.) Equality is what
/// counts as a change ([`HostEntry::version`]): a block reserved, dropped or renewed, or
/// `defrag` switched, is one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostState {
    /// Index into the shared models.
    pub model: u32,
    /// Whether the host moves running jobs to make room ([`FreeMap::defrag`]).
    pub defrag: bool,
    /// CPUs held by jobs ([`HostState::occupancy`]).
    pub held: Packed,
    /// CPUs no new job may use besides: fenced, or not allocatable on that host.
    pub fenced: Packed,
    /// Hashes of the job ids topod holds ([`job_hash`]), sorted.
    pub jobs: Box<[u64]>,
    /// The topology reservations topod reported, by job hash (empty on most hosts, where it
    /// costs no allocation). Whether each still holds is decided when a job is evaluated, by
    /// the time then ([`Block::live`]).
    pub blocks: Box<[Block]>,
    /// With `defrag`, what topod's planner would work with ([`Moves`]); `None` on most hosts.
    pub moves: Option<Arc<Moves>>,
    /// The prime-time pools open as of topod's last look (empty on most hosts): their CPUs are
    /// for the jobs they admit only ([`crate::eval`], "Prime-time pools").
    pub pools: Box<[OpenPool]>,
    /// The GPUs no job and no reservation holds, by where they are (empty on hosts without
    /// GPUs): a `gpus=` request is fitted beside them as topod chooses
    /// ([`topo_core::gpus::choose_among`]). Shared by every host whose list is the same
    /// ([`GpuLists`]): a site is ~180 bytes, and a host of 8 GPUs would keep 1.5 KB of them.
    pub gpus: Arc<[topo_core::gpus::GpuSite]>,
    /// The fingerprint of the topology its model was made from, as topod sent it with the free
    /// map ([`FreeMap::topology_id`]; `None` from a topod too old to send one).
    pub topology_id: Option<u64>,
}

/// The lists of free GPU sites the cache's hosts hold, one copy of each: hosts of one kind
/// with the same GPUs free (all of them, most of the time) share it. Lists no host holds any
/// more are dropped as the set grows, so it stays within twice the lists in use.
#[derive(Debug, Default)]
pub struct GpuLists {
    lists: HashSet<Arc<[topo_core::gpus::GpuSite]>>,
    /// The set's size at which lists no host holds are next dropped.
    prune_at: usize,
}

impl GpuLists {
    /// The shared copy of `sites`.
    pub fn intern(
        &mut self,
        sites: &[topo_core::gpus::GpuSite],
    ) -> Arc<[topo_core::gpus::GpuSite]> {
        if let Some(list) = self.lists.get(sites) {
            return list.clone();
        }
        if self.lists.len() >= self.prune_at {
            // Held by this set alone: no host (of any snapshot) has it.
            self.lists.retain(|l| Arc::strong_count(l) > 1);
            self.prune_at = (2 * self.lists.len()).max(64);
        }
        let list: Arc<[topo_core::gpus::GpuSite]> = sites.into();
        self.lists.insert(list.clone());
        list
    }

    /// How many lists it keeps.
    pub fn len(&self) -> usize {
        self.lists.len()
    }

    /// Whether it keeps none.
    pub fn is_empty(&self) -> bool {
        self.lists.is_empty()
    }
}

/// A prime-time pool open on a host as topod last reported it (topod.toml `prime_pools`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OpenPool {
    /// Its name, for messages.
    pub name: Box<str>,
    /// Its CPUs.
    pub cpus: Packed,
    /// The hashes ([`job_hash`]) of the queues whose jobs it admits.
    pub queues: Box<[u64]>,
    /// The uids whose jobs it admits.
    pub users: Box<[u32]>,
    /// It admits jobs whose allocate names it (`TOPO_POOL`, which a scheduler does not see).
    pub named: bool,
}

/// What topod's planner works with at an allocate on a host with `defrag` (its free map's
/// `moves`), each job's request parsed: [`crate::eval::evaluate`] runs the same plan
/// (`defrag::plan_moves`) to tell whether moves would make room, with the jobs whose
/// [`MovableJob::movable_from`] has come by the scheduler's clock.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct Moves {
    /// The host's placement strategy.
    pub strategy: Strategy,
    /// The planner's bounds.
    pub limits: DefragLimits,
    /// The running jobs it considers (those whose request does not parse are left out, as
    /// topod leaves them).
    pub jobs: Box<[MovableJob]>,
}

/// A running job topod's planner considers.
#[derive(Debug, PartialEq, Eq)]
pub struct MovableJob {
    /// The request it was placed for, as topod sent it.
    pub text: Box<str>,
    /// The same, parsed.
    pub request: Request,
    /// Its CPUs.
    pub cpus: CpuSet,
    /// The CPUs it fences.
    pub fenced: CpuSet,
    /// Its CPUs per task.
    pub tasks: Box<[CpuSet]>,
    /// Seconds since the epoch from which topod may move it.
    pub movable_from: i64,
}

impl Hash for MovableJob {
    fn hash<H: Hasher>(&self, h: &mut H) {
        // The request is the text's parse.
        (&self.text, &self.cpus, &self.fenced, &self.tasks, self.movable_from).hash(h);
    }
}

impl Moves {
    /// From topod's view; jobs whose request does not parse are left out.
    pub fn from_view(view: &topo_core::proto::reply::DefragView) -> Self {
        // The search's bounds other than `max_moves` are not topod settings: any topod sends
        // the defaults. Larger ones from the wire are cut to them, so that no reply makes a
        // match search without end inside the scheduler.
        let d = DefragLimits::default();
        let limits = DefragLimits {
            max_candidates: view.limits.max_candidates.min(d.max_candidates),
            greedy_seeds: view.limits.greedy_seeds.min(d.greedy_seeds),
            max_evaluations: view.limits.max_evaluations.min(d.max_evaluations),
            ..view.limits
        };
        Moves {
            strategy: view.strategy,
            limits,
            jobs: view
                .jobs
                .iter()
                .filter_map(|j| {
                    Some(MovableJob {
                        request: request::parse(&j.request).ok()?,
                        text: j.request.as_str().into(),
                        cpus: j.cpus.clone(),
                        fenced: j.fenced.clone(),
                        tasks: j.tasks.clone().into(),
                        movable_from: j.movable_from.unwrap_or(i64::MAX),
                    })
                })
                .collect(),
        }
    }

    /// Whether `view` is what these were made from.
    fn is_view(&self, view: &topo_core::proto::reply::DefragView) -> bool {
        self.strategy == view.strategy
            && self.limits == view.limits
            && self.jobs.len() == view.jobs.len()
            && self.jobs.iter().zip(&view.jobs).all(|(a, b)| {
                *a.text == *b.request
                    && a.cpus == b.cpus
                    && a.fenced == b.fenced
                    && *a.tasks == *b.tasks
                    && a.movable_from == b.movable_from.unwrap_or(i64::MAX)
            })
    }

    /// The first time after `now_s` at which a job becomes movable ([`NO_BLOCKS`]: none).
    fn next_movable_after(&self, now_s: i64) -> u32 {
        self.jobs
            .iter()
            .map(|j| j.movable_from)
            .filter(|&t| t > now_s && t < i64::MAX)
            .map(|t| t.clamp(0, i64::from(NO_BLOCKS - 1)) as u32)
            .min()
            .unwrap_or(NO_BLOCKS)
    }
}

/// One topology reservation as the cache keeps it (from topod's
/// [`topo_core::reservation::Reservation`]): the block of CPUs set aside for one waiting job.
/// On that host topod places every other job outside the block, and the named job inside it
/// when it fits there; so does [`crate::eval::evaluate`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Block {
    /// The hash of the job it is for ([`job_hash`] of topod's job id, e.g. `lsf-1234`).
    pub job: u64,
    /// The hash of the request it was chosen for, without its task count ([`shape_hash`]):
    /// a batch system that matches a group of jobs with one request without naming the job
    /// (LSF's peer jobs) may count the block as its own when the request is the same.
    pub shape: u64,
    /// Seconds since the epoch at which it lapses.
    pub expires_at: i64,
    /// The block.
    pub cpus: Packed,
    /// The GPUs topod holds with it (for a `gpus=` request) that no job holds now, by where
    /// they are: its job's first (topod gives it those), no other job's (topod's free map
    /// leaves them out of its free GPUs).
    pub gpus: Box<[topo_core::gpus::GpuSite]>,
}

impl Block {
    /// Whether it still holds at `now_s` (seconds since the epoch), as topod decides it.
    pub fn live(&self, now_s: i64) -> bool {
        now_s < self.expires_at
    }
}

/// The hash of a request's shape: its canonical text with the task count left out (a block is
/// chosen for a task count topod was told; a batch system matches with its own per host).
pub fn shape_hash(request: &Request) -> u64 {
    let shape = Request { tasks: None, tasks_max: None, ..request.clone() };
    let mut h = DefaultHasher::new();
    shape.to_string().hash(&mut h);
    h.finish()
}

/// [`shape_hash`] of a request as topod wrote it; a text that does not parse (a newer topod's
/// syntax) gets a hash no parsed request has, so no peer group takes its block for its own.
fn shape_hash_of_text(text: &str) -> u64 {
    match request::parse(text) {
        Ok(r) => shape_hash(&r),
        Err(_) => {
            let mut h = DefaultHasher::new();
            ("unparsed", text).hash(&mut h);
            h.finish()
        }
    }
}

impl HostState {
    /// What a new job may not use: held, fenced, or not allocatable on that host.
    pub fn occupancy(&self) -> Occupancy {
        Occupancy { held: self.held.unpack(), fenced: self.fenced.unpack() }
    }
}

/// A CPU set as the cache keeps it: its 64-bit words up to the last non-empty one, on the heap
/// (an empty set allocates nothing). A [`CpuSet`] keeps 512 CPUs inline (72 bytes), which ten
/// thousand hosts would pay twice each, mostly for sets of a few words or none.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Packed(Box<[u64]>);

impl Packed {
    /// The words of `set`.
    pub fn pack(set: &CpuSet) -> Self {
        let Some(last) = set.last() else { return Self::default() };
        let mut words = vec![0u64; last as usize / 64 + 1];
        for cpu in set.iter() {
            words[cpu as usize / 64] |= 1 << (cpu % 64);
        }
        Self(words.into())
    }

    /// The set again.
    pub fn unpack(&self) -> CpuSet {
        let mut set = CpuSet::new();
        for (i, &word) in self.0.iter().enumerate() {
            let mut w = word;
            while w != 0 {
                set.insert(i as u32 * 64 + w.trailing_zeros());
                w &= w - 1;
            }
        }
        set
    }
}

/// One host.
#[derive(Debug, Clone)]
pub struct HostEntry {
    /// Its name as the batch system spells it.
    pub name: Box<str>,
    /// Where its topod answers.
    pub address: Address,
    /// Its last known state.
    pub state: Option<HostState>,
    /// Why the last fetch failed, when it did.
    pub last_error: Option<Box<str>>,
    /// Changes whenever `state` does, and only then: a refresh that brings the same state
    /// keeps it, so [`crate::eval::Memo`] keeps what it computed for the host.
    pub version: u32,
}

/// What a match reads of every candidate, kept in one flat array beside the hosts (not behind
/// each host's `Arc`), so that a match over ten thousand hosts reads memory in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostStatus {
    /// When the state was fetched (`None`: never).
    pub fetched_at: Option<Instant>,
    /// The host's [`HostEntry::version`].
    pub version: u32,
    /// The earliest expiry of the state's blocks, in seconds since the epoch (clamped to
    /// `u32`), or [`NO_BLOCKS`]: a verdict on the host may change at that time without the
    /// state changing, so the memo keeps none past it. (Fits in the struct's padding.)
    pub blocks_until: u32,
    /// A 128-bit fingerprint of the state's model, occupancy, blocks and `defrag`
    /// ([`state_fingerprint`]): hosts with equal fingerprints get equal placements, so a match
    /// places each distinct state once without reading every host's state (computed by the
    /// refresher, when it changes).
    pub fingerprint: [u64; 2],
    /// Its last fetch failed, or one did before the first success: its topod was asked and did
    /// not answer. A host never fetched and never failed has not been asked yet (the first
    /// refresh after a start is under way): it is offered to no job, whatever the `unreachable`
    /// policy, which is for topods that do not answer, not for answers still coming ([`Self::asked`]).
    pub failed: bool,
}

impl HostStatus {
    /// Whether its topod has answered or failed to at least once; a host not asked yet is
    /// offered to no job, even with `unreachable = "open"` (after a scheduler's restart the
    /// jobs it replays may have filled it: issue 31).
    pub fn asked(&self) -> bool {
        self.fetched_at.is_some() || self.failed
    }
}

/// [`HostStatus::blocks_until`] of a host without blocks.
pub const NO_BLOCKS: u32 = u32::MAX;

impl Default for HostStatus {
    fn default() -> Self {
        Self {
            fetched_at: None,
            version: 0,
            blocks_until: NO_BLOCKS,
            fingerprint: [0; 2],
            failed: false,
        }
    }
}

/// [`HostStatus::blocks_until`] of `state`.
fn earliest_expiry(state: &HostState) -> u32 {
    state
        .blocks
        .iter()
        .map(|b| b.expires_at.clamp(0, i64::from(NO_BLOCKS - 1)) as u32)
        .min()
        .unwrap_or(NO_BLOCKS)
}

/// The earliest fetch time whose state is still fresh at `now` (`None`: every fetched state is,
/// the process being younger than `stale_after`), for [`HostCache::fetched_since`].
pub fn fresh_from(now: Instant, stale_after: Duration) -> Option<Instant> {
    now.checked_sub(stale_after)
}

/// A 128-bit fingerprint of what a placement on a host depends on: its model, occupancy,
/// blocks (jobs, shapes, expiries and CPUs) and whether it defragments; two SipHash passes with
/// different prefixes. Two different states share one with a probability of about 2^-128 per
/// pair, far below any hardware error rate, so equal fingerprints are taken for equal states.
pub fn state_fingerprint(state: &HostState) -> [u64; 2] {
    let pass = |prefix: u8| {
        let mut h = DefaultHasher::new();
        prefix.hash(&mut h);
        state.model.hash(&mut h);
        state.held.hash(&mut h);
        state.fenced.hash(&mut h);
        state.defrag.hash(&mut h);
        state.blocks.hash(&mut h);
        state.moves.hash(&mut h);
        state.pools.hash(&mut h);
        state.gpus.hash(&mut h);
        h.finish()
    };
    [pass(0x5a), pass(0xa5)]
}

/// Why a host's state cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unknown {
    /// The host is not in the cache.
    NotKnown,
    /// Never fetched successfully.
    NeverFetched(Option<Box<str>>),
    /// Fetched too long ago.
    Stale(Duration, Option<Box<str>>),
}

impl std::fmt::Display for Unknown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let why = |e: &Option<Box<str>>| {
            e.as_deref().map(|e| format!(" (last error: {e})")).unwrap_or_default()
        };
        match self {
            Unknown::NotKnown => write!(f, "no topod address is configured for this host"),
            Unknown::NeverFetched(e) => write!(f, "its topod has not answered yet{}", why(e)),
            Unknown::Stale(age, e) => {
                write!(f, "its topod last answered {} s ago{}", age.as_secs(), why(e))
            }
        }
    }
}

/// The cache (one snapshot of it; see [`CacheCell`]).
#[derive(Debug, Default, Clone)]
pub struct HostCache {
    models: Vec<Arc<HostModel>>,
    model_by_key: HashMap<u64, u32>,
    hosts: Chunked<Arc<HostEntry>>,
    /// Per host, what every match reads ([`HostStatus`]).
    status: Chunked<HostStatus>,
    names: Arc<NameIndex>,
    /// Changes whenever a name may find another host than before (a host added, the domain
    /// changed), so that callers who remember what a name found know when to ask again.
    names_version: u64,
    /// Names that are no host's; replaced by an empty one whenever a host is added.
    negative: Arc<Mutex<HashSet<Box<str>>>>,
    /// The hosts' lists of free GPUs, one copy of each (shared by every snapshot).
    gpu_lists: Arc<Mutex<GpuLists>>,
}

/// A vector in shared chunks: a copy costs one reference count per [`CHUNK`] elements, and a
/// change copies only its own chunk (when another copy shares it). The refresher publishes a
/// copy of the cache for every few results; with ten thousand hosts in one plain vector, each
/// copy (and each old snapshot's drop) touched every host.
#[derive(Debug, Clone)]
struct Chunked<T> {
    chunks: Vec<Arc<Vec<T>>>,
    len: usize,
}

/// Elements per chunk of [`Chunked`].
const CHUNK: usize = 256;

impl<T> Default for Chunked<T> {
    fn default() -> Self {
        Self { chunks: Vec::new(), len: 0 }
    }
}

impl<T: Clone> Chunked<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn push(&mut self, value: T) {
        if self.len % CHUNK == 0 {
            self.chunks.push(Arc::new(Vec::with_capacity(CHUNK)));
        }
        if let Some(last) = self.chunks.last_mut() {
            Arc::make_mut(last).push(value);
        }
        self.len += 1;
    }

    fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flat_map(|c| c.iter())
    }
}

impl<T> std::ops::Index<usize> for Chunked<T> {
    type Output = T;
    fn index(&self, i: usize) -> &T {
        &self.chunks[i / CHUNK][i % CHUNK]
    }
}

impl<T: Clone> std::ops::IndexMut<usize> for Chunked<T> {
    /// Copies the element's chunk first when another copy of the vector shares it.
    fn index_mut(&mut self, i: usize) -> &mut T {
        &mut Arc::make_mut(&mut self.chunks[i / CHUNK])[i % CHUNK]
    }
}

/// Host names and aliases, by hash: a name is not stored again (ten thousand hosts with two or
/// three names each would cost more than the rest of their entries); a hit is checked against
/// the names of the host it points to.
#[derive(Debug, Default, Clone)]
struct NameIndex {
    /// The hash of a name or alias ([`name_hash`]), the host, and whether it is the host's own
    /// name (which an alias never replaces; of two hosts with the same alias, the first keeps it).
    by_hash: HashMap<u64, (HostId, bool)>,
    /// Names whose hash another name has already (about 2^-64 per pair), by the name itself.
    overflow: HashMap<Box<str>, (HostId, bool)>,
    /// The configured domain, without a leading dot; empty: none.
    domain: Box<str>,
}

/// The most names the negative cache remembers; it starts again empty when full.
pub const NEGATIVE_NAMES: usize = 65_536;

fn name_hash(name: &str) -> u64 {
    let mut h = DefaultHasher::new();
    name.hash(&mut h);
    h.finish()
}

/// Every name the host called `name` is found by: that name first, then its aliases, and
/// (host names are case-insensitive, as in DNS and LSF) the lower-case forms, which a lookup
/// tries when the name as given is not found.
fn names_for(name: &str, domain: &str) -> Vec<String> {
    let mut out = vec![name.to_string()];
    out.extend(aliases(name, domain));
    let lower = name.to_ascii_lowercase();
    out.extend(aliases(&lower, domain));
    out.push(lower);
    out
}

#[cfg(test)]
thread_local! {
    /// How many host names this thread has checked a name against
    /// ([`NameIndex::is_name_of`]), for the tests: a lookup checks a few, never one per host.
    pub(crate) static NAMES_CHECKED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

impl NameIndex {
    /// Whether `name` is one of the names of the host called `host_name`.
    fn is_name_of(&self, name: &str, host_name: &str) -> bool {
        #[cfg(test)]
        NAMES_CHECKED.with(|n| n.set(n.get() + 1));
        // The host's own name, the usual hit, without making its aliases.
        name == host_name || names_for(host_name, &self.domain).iter().any(|n| n == name)
    }

    /// The host `name` finds, and whether it is that host's own name.
    fn get<'a>(&self, name: &str, host_name: impl Fn(HostId) -> &'a str) -> Option<(HostId, bool)> {
        if let Some(&(id, own)) = self.by_hash.get(&name_hash(name)) {
            if self.is_name_of(name, host_name(id)) {
                return Some((id, own));
            }
        }
        self.overflow.get(name).copied()
    }

    /// Indexes host `id`, called `name`; `host_name` gives the names of the hosts indexed
    /// already (and of `id`).
    fn insert<'a>(&mut self, name: &str, id: HostId, host_name: impl Fn(HostId) -> &'a str) {
        for (i, n) in names_for(name, &self.domain).into_iter().enumerate() {
            let own = i == 0;
            if !own && n == name {
                continue;
            }
            let h = name_hash(&n);
            match self.by_hash.get(&h).copied() {
                None => {
                    self.by_hash.insert(h, (id, own));
                }
                // The same name: a host's own name replaces an alias; an alias stays the first
                // host's.
                Some((other, _)) if self.is_name_of(&n, host_name(other)) => {
                    if own {
                        self.by_hash.insert(h, (id, true));
                    }
                }
                // Another name with the same hash.
                Some(_) => {
                    if own {
                        self.overflow.insert(n.into(), (id, true));
                    } else {
                        self.overflow.entry(n.into()).or_insert((id, false));
                    }
                }
            }
        }
    }
}

/// The aliases of `name`: its short name, and its short name with `domain`.
fn aliases(name: &str, domain: &str) -> Vec<String> {
    let short = name.split('.').next().unwrap_or(name);
    let mut out = Vec::new();
    if short != name && !short.is_empty() {
        out.push(short.to_string());
    }
    if !domain.is_empty() {
        let fqdn = format!("{short}.{domain}");
        if fqdn != name {
            out.push(fqdn);
        }
    }
    out
}

/// Where the current snapshot of the cache lives: readers [`load`](Self::load) it without ever
/// waiting; writers take turns ([`write`](Self::write)), each on a copy it publishes when done.
#[derive(Debug, Default)]
pub struct CacheCell {
    current: ArcSwap<HostCache>,
    writer: Mutex<()>,
}

impl CacheCell {
    /// The current snapshot. Never waits: what a writer is doing is not in it until published.
    pub fn load(&self) -> Arc<HostCache> {
        self.current.load_full()
    }

    /// A copy of the current snapshot to change, published when the returned writer is
    /// dropped. Writers wait for each other (only); the error is the writers' lock poisoned by a
    /// panicking writer, and holds a usable writer.
    pub fn write(&self) -> LockResult<CacheWriter<'_>> {
        let writer =
            |lock| CacheWriter { _lock: lock, cell: self, cache: Box::new((*self.load()).clone()) };
        match self.writer.lock() {
            Ok(lock) => Ok(writer(lock)),
            Err(poisoned) => Err(PoisonError::new(writer(poisoned.into_inner()))),
        }
    }
}

/// A writer's copy of the cache; dropping it publishes it.
#[derive(Debug)]
pub struct CacheWriter<'a> {
    _lock: MutexGuard<'a, ()>,
    cell: &'a CacheCell,
    cache: Box<HostCache>,
}

impl std::ops::Deref for CacheWriter<'_> {
    type Target = HostCache;
    fn deref(&self) -> &HostCache {
        &self.cache
    }
}

impl std::ops::DerefMut for CacheWriter<'_> {
    fn deref_mut(&mut self) -> &mut HostCache {
        &mut self.cache
    }
}

impl Drop for CacheWriter<'_> {
    fn drop(&mut self) {
        self.cell.current.store(Arc::from(std::mem::take(&mut self.cache)));
    }
}

/// A stable hash of a job id, for the per-host job lists.
pub fn job_hash(job: &str) -> u64 {
    let mut h = DefaultHasher::new();
    job.hash(&mut h);
    h.finish()
}

impl HostCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `name` (or returns it when present under that very name).
    pub fn add(&mut self, name: &str, address: Address) -> HostId {
        if let Some((id, true)) = self.names.get(name, |h| &self.hosts[h as usize].name) {
            return id;
        }
        let id = self.hosts.len() as HostId;
        self.hosts.push(Arc::new(HostEntry {
            name: name.into(),
            address,
            state: None,
            last_error: None,
            version: 0,
        }));
        self.status.push(HostStatus::default());
        let hosts = &self.hosts;
        Arc::make_mut(&mut self.names).insert(name, id, |h| &hosts[h as usize].name);
        self.names_version += 1;
        // A name remembered as no host's may be this one's (or one of its aliases).
        self.negative = Arc::default();
        id
    }

    /// [`add`](Self::add), and where `name` is known at another address (a configuration read
    /// again), moves it there: its state goes, as it was another topod's. `Some` (its id) when
    /// it moved.
    pub fn add_at(&mut self, name: &str, address: Address) -> Option<HostId> {
        let id = self.add(name, address.clone());
        let moved = self.hosts[id as usize].address != address;
        if moved {
            let h = Arc::make_mut(&mut self.hosts[id as usize]);
            h.address = address;
            h.state = None;
            h.last_error = None;
            h.version = h.version.wrapping_add(1);
            self.status[id as usize] = HostStatus::default();
        }
        moved.then_some(id)
    }

    /// Sets the domain aliases are made with (`""`: none) and indexes every host again.
    pub fn set_domain(&mut self, domain: &str) {
        let domain = domain.trim_start_matches('.');
        if *self.names.domain == *domain {
            return;
        }
        let mut index = NameIndex { domain: domain.into(), ..NameIndex::default() };
        let hosts = &self.hosts;
        for (i, h) in hosts.iter().enumerate() {
            index.insert(&h.name, i as HostId, |h| &hosts[h as usize].name);
        }
        self.names = Arc::new(index);
        self.negative = Arc::default();
        self.names_version += 1;
    }

    /// Changes whenever a name may find another host than before ([`lookup`](Self::lookup)):
    /// a host added, or the domain changed.
    pub fn names_version(&self) -> u64 {
        self.names_version
    }

    /// The configured domain (`""`: none).
    pub fn domain(&self) -> &str {
        &self.names.domain
    }

    /// The host called `name`: by its name or one of its aliases (its short name, or its short
    /// name with the configured domain). Without a configured domain, a name with any domain
    /// also finds the host of its short name. One or two hash probes, never a scan.
    pub fn lookup(&self, name: &str) -> Option<HostId> {
        let find = |n: &str| self.names.get(n, |h| &self.hosts[h as usize].name).map(|(id, _)| id);
        if let Some(id) = find(name) {
            return Some(id);
        }
        let mut negative = self.negative.lock().unwrap_or_else(|e| e.into_inner());
        if negative.contains(name) {
            return None;
        }
        if name.bytes().any(|b| b.is_ascii_uppercase()) {
            if let Some(id) = find(&name.to_ascii_lowercase()) {
                return Some(id);
            }
        }
        if self.names.domain.is_empty() {
            let short = name.split('.').next().unwrap_or(name).to_ascii_lowercase();
            if short != name {
                if let Some(id) = find(&short) {
                    return Some(id);
                }
            }
        }
        if negative.len() >= NEGATIVE_NAMES {
            negative.clear();
        }
        negative.insert(name.into());
        None
    }

    /// How many names the negative cache holds.
    pub fn negative_len(&self) -> usize {
        self.negative.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Number of hosts.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// A host.
    pub fn host(&self, id: HostId) -> &HostEntry {
        &self.hosts[id as usize]
    }

    /// What every match reads of a host: when its state was fetched, and its version.
    pub fn status(&self, id: HostId) -> HostStatus {
        self.status[id as usize]
    }

    /// Whether the state of `id` is usable at `now`: fetched, and not longer than `stale_after`
    /// ago. The cheap form of [`usable`](Self::usable), from the flat status array.
    pub fn is_fresh(&self, id: HostId, now: Instant, stale_after: Duration) -> bool {
        self.fetched_since(id, fresh_from(now, stale_after))
    }

    /// Whether the state of `id` was fetched at or after `from` ([`fresh_from`]; `None`: at any
    /// time). The form of [`is_fresh`](Self::is_fresh) for a loop over many hosts: one
    /// comparison of instants per host, not a subtraction.
    pub fn fetched_since(&self, id: HostId, from: Option<Instant>) -> bool {
        self.status[id as usize].fetched_at.is_some_and(|at| from.is_none_or(|f| at >= f))
    }

    /// Every host, with its id.
    pub fn hosts(&self) -> impl Iterator<Item = (HostId, &HostEntry)> {
        self.hosts.iter().enumerate().map(|(i, h)| (i as HostId, &**h))
    }

    /// How many distinct lists of free GPUs the hosts share ([`GpuLists`]).
    pub fn gpu_list_count(&self) -> usize {
        self.gpu_lists.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Number of distinct hardware models.
    pub fn model_count(&self) -> usize {
        self.models.len()
    }

    /// The model of a state.
    pub fn model(&self, state: &HostState) -> &HostModel {
        &self.models[state.model as usize]
    }

    /// What the cache holds of `id`'s topology: a fetch brings it when there is none, or when
    /// topod's is not this one.
    pub fn cached_topology(&self, id: HostId) -> CachedTopology {
        match &self.hosts[id as usize].state {
            None => CachedTopology::Nothing,
            Some(state) => CachedTopology::Known(state.topology_id),
        }
    }

    /// The state of `id` if it is fresh enough at `now`.
    pub fn usable(
        &self,
        id: HostId,
        now: Instant,
        stale_after: Duration,
    ) -> Result<&HostState, Unknown> {
        let h = &self.hosts[id as usize];
        match (&h.state, self.status[id as usize].fetched_at) {
            (Some(state), Some(at)) => {
                let age = now.saturating_duration_since(at);
                if age > stale_after {
                    Err(Unknown::Stale(age, h.last_error.clone()))
                } else {
                    Ok(state)
                }
            }
            _ => Err(Unknown::NeverFetched(h.last_error.clone())),
        }
    }

    /// Records a successful fetch. `topology` comes with the first fetch of a host (and whenever
    /// the fetcher asks again); hosts with equal topologies share one model.
    pub fn update(
        &mut self,
        id: HostId,
        topology: Option<&Topology>,
        free: FreeMap,
        at: Instant,
    ) -> Result<Updated, String> {
        let model = match topology {
            Some(topo) => self.intern_model(topo)?,
            None => match &self.hosts[id as usize].state {
                Some(s) if free.topology_id != s.topology_id => {
                    // Its topod came back on other hardware (or reads it differently): the
                    // state goes, so that the next fetch brings the topology.
                    let h = Arc::make_mut(&mut self.hosts[id as usize]);
                    h.state = None;
                    h.version = h.version.wrapping_add(1);
                    self.status[id as usize] = HostStatus::default();
                    return Ok(Updated::AnotherTopology);
                }
                Some(s) => s.model,
                None => return Err("the first fetch of a host must bring its topology".into()),
            },
        };
        let m = &self.models[model as usize];
        let mut unusable = m.allocatable.difference(&free.allocatable);
        unusable.union_with(&free.fenced);
        let mut jobs: Vec<u64> = free.job_ids.iter().map(|j| job_hash(j)).collect();
        jobs.sort_unstable();
        let mut blocks: Vec<Block> = free
            .reservations
            .iter()
            .map(|r| Block {
                job: job_hash(&r.job),
                shape: shape_hash_of_text(&r.request),
                expires_at: r.expires_at,
                cpus: Packed::pack(&r.cpus),
                gpus: free
                    .reserved_gpus
                    .iter()
                    .filter(|g| g.job == r.job)
                    .map(|g| g.site.clone())
                    .collect(),
            })
            .collect();
        // In one order whatever topod's, so that equal reservations are an equal state.
        blocks.sort_unstable_by_key(|b| (b.job, b.expires_at));
        // The jobs' requests parsed only when what topod sent differs from the last state's.
        let before_moves = self.hosts[id as usize].state.as_ref().and_then(|s| s.moves.clone());
        let moves = free.moves.as_ref().map(|view| match before_moves {
            Some(m) if m.is_view(view) => m,
            _ => Arc::new(Moves::from_view(view)),
        });
        let pools: Vec<OpenPool> = free
            .pools
            .iter()
            .filter(|p| p.open)
            .map(|p| OpenPool {
                name: p.name.as_str().into(),
                cpus: Packed::pack(&p.cpus),
                queues: p.queues.iter().map(|q| job_hash(q)).collect(),
                users: p.users.clone().into(),
                named: p.named,
            })
            .collect();
        let state = HostState {
            model,
            defrag: free.defrag,
            held: Packed::pack(&free.held),
            fenced: Packed::pack(&unusable),
            jobs: jobs.into(),
            blocks: blocks.into(),
            moves,
            pools: pools.into(),
            gpus: self.gpu_lists.lock().unwrap_or_else(|e| e.into_inner()).intern(&free.gpus),
            topology_id: free.topology_id,
        };
        let before = self.status[id as usize];
        let entry = &self.hosts[id as usize];
        let mut changed = entry.state.as_ref() != Some(&state);
        // Computed when the state changes (or comes first), not at every refresh.
        let (fingerprint, mut blocks_until) = if changed || before.fetched_at.is_none() {
            (state_fingerprint(&state), earliest_expiry(&state))
        } else {
            (before.fingerprint, before.blocks_until)
        };
        if let Some(m) = &state.moves {
            // The next time a job becomes movable: verdicts on the host change then, without
            // its state changing. Its passing counts as a change (the memo forgets what it
            // remembered before), and the next one is looked for at every refresh.
            let next = earliest_expiry(&state).min(m.next_movable_after(crate::eval::epoch_now()));
            changed |= next != before.blocks_until && before.fetched_at.is_some();
            blocks_until = next;
        }
        if changed || entry.last_error.is_some() {
            // Cloned (when another snapshot shares it) only when something changes.
            let h = Arc::make_mut(&mut self.hosts[id as usize]);
            if changed {
                h.state = Some(state);
                h.version = h.version.wrapping_add(1);
            }
            h.last_error = None;
        }
        let version = self.hosts[id as usize].version;
        self.status[id as usize] =
            HostStatus { fetched_at: Some(at), version, blocks_until, fingerprint, failed: false };
        Ok(Updated::Applied)
    }

    /// Records a failed fetch; the last good state stays until it goes stale.
    pub fn failed(&mut self, id: HostId, error: &str) {
        self.status[id as usize].failed = true;
        if self.hosts[id as usize].last_error.as_deref() != Some(error) {
            Arc::make_mut(&mut self.hosts[id as usize]).last_error = Some(error.into());
        }
    }

    fn intern_model(&mut self, topo: &Topology) -> Result<u32, String> {
        // Hashed as it is written, not through a string: ten thousand hosts' first fetches
        // would each allocate their topology's whole JSON text only to hash it.
        let key = {
            struct HashWriter(DefaultHasher);
            impl std::io::Write for HashWriter {
                fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                    self.0.write(buf);
                    Ok(buf.len())
                }
                fn flush(&mut self) -> std::io::Result<()> {
                    Ok(())
                }
            }
            let mut w = HashWriter(DefaultHasher::new());
            serde_json::to_writer(&mut w, topo).map_err(|e| e.to_string())?;
            w.0.finish()
        };
        if let Some(&m) = self.model_by_key.get(&key) {
            return Ok(m);
        }
        let model = HostModel::new(topo, &CpuSet::new()).map_err(|e| e.to_string())?;
        let m = self.models.len() as u32;
        self.models.push(Arc::new(model));
        self.model_by_key.insert(key, m);
        Ok(m)
    }
}

impl HostState {
    /// Whether topod reports holding `job`.
    pub fn holds(&self, job: &str) -> bool {
        self.jobs.binary_search(&job_hash(job)).is_ok()
    }
}

#[cfg(test)]
mod name_tests {
    use super::*;

    #[test]
    fn packed_sets_unpack_to_themselves() {
        for text in ["", "0", "63", "64", "0-3,70,127-129", "5,600-610,1023", "0-4095"] {
            let set = CpuSet::parse_list(text).unwrap();
            let packed = Packed::pack(&set);
            assert_eq!(packed.unpack(), set, "{text:?}");
            // As small as its last word: nothing at all for an empty set.
            let words = set.last().map_or(0, |l| l as usize / 64 + 1);
            assert_eq!(packed.0.len(), words, "{text:?}");
        }
    }

    #[test]
    fn a_name_whose_hash_another_name_has_is_still_found() {
        let names = ["alpha", "beta"];
        let host_name = |h: HostId| names[h as usize];
        let mut index = NameIndex::default();
        index.insert("alpha", 0, host_name);
        // As if "beta" hashed like a name of alpha's: its slot is taken by another name.
        index.by_hash.insert(name_hash("beta"), (0, true));
        index.insert("beta", 1, host_name);
        assert_eq!(index.get("beta", host_name), Some((1, true)));
        assert_eq!(index.get("alpha", host_name), Some((0, true)));
        // A name that is no host's, in a slot another name holds, finds nothing.
        index.by_hash.insert(name_hash("gamma"), (0, true));
        assert_eq!(index.get("gamma", host_name), None);
    }
}
