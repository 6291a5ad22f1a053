//! Filling the cache in the background: every host's topod is asked for its free map (and, the
//! first time, its topology), many hosts at once, each with a time-out. The scheduler's own
//! thread never waits on a host.
//!
//! The model is per host, not per round:
//!
//! - Each host has its own due time. A host that answered is due again `refresh_interval`
//!   after its last fetch started; a host whose fetch failed backs off (twice the interval, then
//!   4x, at most 8x), so hosts that do not answer are asked less often.
//! - Each result is applied as it arrives (results that arrive together are published
//!   together, within a few milliseconds), so a host's age is that of its own last answer and
//!   never waits for the slowest host of a round.
//! - At most `workers` fetches run at once, but a fetch running longer than eight times the
//!   recent typical fetch (at least 20 ms, at most a quarter of the time-out) counts as stuck and
//!   no longer takes a worker's place, and a fetch of a host whose last fetch failed never takes
//!   one: another thread starts instead (up to [`MAX_THREADS_PER_WORKER`] threads per worker). A
//!   hung topod thus costs its own time-out and nothing else; the healthy hosts keep their pace.
//! - Readers never wait for any of this: results go into a copy of the cache that is published
//!   at once ([`crate::cache::CacheCell`]).
//!
//! After each batch of results, the reservations are reconciled with what the hosts report and
//! the dispatches that waited for a host's state are placed ([`Reservations::settle`]).

use crate::address::Address;
use crate::cache::{CacheCell, CachedTopology, FreeMap, HostCache, HostId, Updated};
use crate::config::CacheConfig;
use crate::reserve::Reservations;
use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use topo_client::Client;
use topo_core::proto::Op;
use topo_core::topology::Topology;

/// What one fetch brings back.
#[derive(Debug, Clone)]
pub struct Fetched {
    /// The topology, when it was asked for.
    pub topology: Option<Topology>,
    /// The free map.
    pub free_map: FreeMap,
}

/// A failed fetch, in words for the log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{address}: {message}")]
pub struct FetchError {
    /// The address asked.
    pub address: String,
    /// What went wrong.
    pub message: String,
}

/// Where host states come from: topod itself, or a fake in tests.
pub trait HostSource: Send + Sync {
    /// Fetches the free map of the topod at `address`, and its topology when the cache has
    /// none (`cached`) or the free map names another than the cached one.
    fn fetch(&self, address: &Address, cached: CachedTopology) -> Result<Fetched, FetchError>;
}

/// The real source: topod's read-only TCP listener or its Unix socket.
pub struct TopodSource {
    key: Option<String>,
    timeout: Duration,
    /// The topods that answered in an older protocol version (a site upgrading its modules
    /// before its hosts), with that version and since when: each fetch is a new connection,
    /// which would otherwise ask in this build's version, be refused and ask again, every
    /// time. Asked in this build's version again after [`OLDER_TOPOD_RECHECK`], to notice an
    /// upgraded host.
    older: Mutex<HashMap<String, (u32, Instant)>>,
}

/// How long a topod that answered in an older protocol version is asked in that version.
pub const OLDER_TOPOD_RECHECK: Duration = Duration::from_secs(600);

impl TopodSource {
    /// A source presenting `key` to TCP listeners, with `timeout` per connect, read and write.
    pub fn new(key: Option<String>, timeout: Duration) -> Self {
        Self { key, timeout, older: Mutex::new(HashMap::new()) }
    }

    /// The version to ask `address` in, where it answered in an older one lately (an entry
    /// older than [`OLDER_TOPOD_RECHECK`] goes: the host is asked in this build's version).
    fn older_version(&self, address: &str) -> Option<u32> {
        let mut older = self.older.lock().unwrap_or_else(|e| e.into_inner());
        let &(version, since) = older.get(address)?;
        if since.elapsed() < OLDER_TOPOD_RECHECK {
            return Some(version);
        }
        older.remove(address);
        None
    }
}

impl HostSource for TopodSource {
    fn fetch(&self, address: &Address, cached: CachedTopology) -> Result<Fetched, FetchError> {
        let name = address.to_string();
        let fail = |message: String| FetchError { address: name.clone(), message };
        let mut client = match address {
            Address::Unix(path) => Client::connect_with_timeout(path, self.timeout),
            Address::Tcp(hostport) => {
                Client::connect_tcp(hostport, self.key.as_deref().unwrap_or(""), self.timeout)
            }
        }
        .map_err(|e| fail(e.to_string()))?;
        // A whole reply within four read timeouts: a topod that drips its reply must not keep
        // its host unknown for as long as the drip lasts (attack: minutes, at a byte per
        // 0.4 s), as the refresher asks a host again only once its fetch is over.
        client.set_reply_within(self.timeout.saturating_mul(4));
        let asked_older = self.older_version(&name);
        if let Some(v) = asked_older {
            client.speak_version(v);
        }
        let mut topology = if cached.is_nothing() {
            Some(client.topology().map_err(|e| fail(e.to_string()))?)
        } else {
            None
        };
        // Only the part the cache keeps is decoded (see `FreeMap`).
        let free_map = client.call_as::<FreeMap>(Op::FreeMap).map_err(|e| fail(e.to_string()))?;
        if topology.is_none() && cached.is_stale(free_map.topology_id) {
            // Its topod came back on other hardware: the topology again, on this connection
            // (one process serves one topology, so it goes with the free map just read).
            topology = Some(client.topology().map_err(|e| fail(e.to_string()))?);
        }
        let answered_in = client.protocol_version();
        if asked_older.is_none() && answered_in < topo_core::proto::PROTOCOL_VERSION {
            let mut older = self.older.lock().unwrap_or_else(|e| e.into_inner());
            older.insert(name, (answered_in, Instant::now()));
        }
        Ok(Fetched { topology, free_map })
    }
}

/// The shared state a plug-in reads.
#[derive(Debug, Default)]
pub struct Shared {
    /// The cache: [`CacheCell::load`] for a snapshot that never waits.
    pub cache: CacheCell,
    /// The reservations.
    pub reservations: Mutex<Reservations>,
    /// Host names the scheduler asked about that the cache did not know; the refresher adds
    /// them (with the address template) at once.
    pub discovered: Mutex<BTreeSet<String>>,
    /// How many per-host lines this minute (see [`HostLines`]).
    pub host_lines: Mutex<HostLines>,
}

/// Lines about one host (its first failure, its arrival among the scheduler's candidates) a
/// minute at most; past them each is logged at debug level only and counted.
pub const HOST_LINES_PER_MINUTE: u32 = 20;

/// The budget of per-host lines: at 100,000 hosts that all fail, or arrive, at once, the log
/// gets 20 of them and one line a minute with how many more there were, not 100,000.
#[derive(Debug, Default)]
pub struct HostLines {
    window: Option<Instant>,
    said: u32,
    left_out: u64,
}

impl HostLines {
    /// Whether a host's line may be logged at `now`; if not, it is counted.
    pub fn admit(&mut self, now: Instant) -> bool {
        self.roll(now);
        if self.said < HOST_LINES_PER_MINUTE {
            self.said += 1;
            true
        } else {
            self.left_out += 1;
            false
        }
    }

    /// Starts a new minute once one has passed, saying how many lines the last one left out;
    /// returns that count.
    pub fn roll(&mut self, now: Instant) -> u64 {
        if self.window.is_some_and(|t| now.saturating_duration_since(t) < Duration::from_secs(60)) {
            return 0;
        }
        let left_out = std::mem::take(&mut self.left_out);
        if left_out > 0 {
            tracing::warn!(
                left_out,
                "{left_out} more hosts were new or began failing in the last minute; their lines were logged at debug level only"
            );
        }
        self.window = Some(now);
        self.said = 0;
        left_out
    }
}

/// One host's fetch: which host, at which address, what came back, and when.
type FetchOutcome = (HostId, Address, Result<Fetched, FetchError>, Instant);

/// A batch of results is published after this long at most.
const BATCH: Duration = Duration::from_millis(5);

/// Applies `first` and whatever else `next` has ready (for at most [`BATCH`]) in one write of
/// the cache, then reconciles the reservations. Returns what was applied, as (host, success).
fn apply_batch(
    shared: &Shared,
    config: &CacheConfig,
    first: FetchOutcome,
    mut next: impl FnMut() -> Option<FetchOutcome>,
) -> Vec<(HostId, bool, Instant)> {
    let started = Instant::now();
    let mut applied = Vec::new();
    // Hosts whose topod came back on other hardware: the jobs dispatched to them are placed again.
    let mut other_hardware = Vec::new();
    {
        let mut cache = shared.cache.write().unwrap_or_else(|e| e.into_inner());
        let mut outcome = Some(first);
        while let Some((id, address, result, at)) = outcome.take() {
            let ended = at;
            if id as usize >= cache.len() {
                // The cache was emptied (sched_finalize) while this fetch ran.
                break;
            }
            let ok = match result {
                // Fetched at an address the host no longer has (a configuration read again
                // moved it while the fetch ran, by this refresher or the one before): that was
                // another topod's state. Nothing is applied; the host is fetched again.
                _ if cache.host(id).address != address => {
                    tracing::debug!(host = %cache.host(id).name, %address, "a fetch from the host's old address is dropped");
                    true
                }
                Ok(f) => {
                    let topology_came = f.topology.is_some();
                    let model_before = cache.host(id).state.as_ref().map(|s| s.model);
                    match cache.update(id, f.topology.as_ref(), f.free_map, at) {
                        Ok(Updated::AnotherTopology) => {
                            // A source that did not bring the topology (the real one brings it
                            // on the same connection): the state went; the next fetch brings it.
                            other_hardware.push(id);
                            tracing::warn!(host = %cache.host(id).name, "its topod serves another topology than before (restarted on other hardware?); the topology is fetched again, and the jobs dispatched to it are placed again on it");
                            true
                        }
                        Ok(Updated::Applied) => {
                            let model_now = cache.host(id).state.as_ref().map(|s| s.model);
                            let name = &cache.host(id).name;
                            if !topology_came {
                                // The free map alone: nothing to say.
                            } else if model_before.is_none() {
                                tracing::info!(host = %name, "topod answers; topology and free map cached");
                            } else if model_before == model_now {
                                // Equal topologies share a model: the same hardware, named
                                // differently (a topod upgraded, or one too old to name it).
                                tracing::info!(host = %name, "its topod names its topology differently now (upgraded or downgraded?); it is the same as the one cached");
                            } else {
                                other_hardware.push(id);
                                // At most a few hosts a minute (a topod that changes it at every
                                // reply would otherwise say so at every refresh).
                                if shared
                                    .host_lines
                                    .lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .admit(at)
                                {
                                    tracing::warn!(host = %name, "its topod serves another topology than before (restarted on other hardware?); the new one is cached, and the jobs dispatched to it are placed again on it");
                                } else {
                                    tracing::debug!(host = %name, "its topod serves another topology than before");
                                }
                            }
                            true
                        }
                        Err(e) => {
                            tracing::warn!(host = %cache.host(id).name, "unusable reply from topod: {e}");
                            cache.failed(id, &e);
                            false
                        }
                    }
                }
                Err(e) => {
                    let text = e.to_string();
                    // Said once when a host starts failing (or fails differently), not every time,
                    // and for a few hosts a minute (HostLines).
                    if cache.host(id).last_error.as_deref() != Some(text.as_str())
                        && shared.host_lines.lock().unwrap_or_else(|e| e.into_inner()).admit(at)
                    {
                        tracing::warn!(host = %cache.host(id).name, "cannot fetch the free map: {e}");
                    } else {
                        tracing::debug!(host = %cache.host(id).name, "still cannot fetch the free map");
                    }
                    cache.failed(id, &text);
                    false
                }
            };
            applied.push((id, ok, ended));
            if started.elapsed() < BATCH {
                outcome = next();
            }
        }
    }
    // The count of the lines the last minute left out, once it has passed.
    shared.host_lines.lock().unwrap_or_else(|e| e.into_inner()).roll(Instant::now());
    // The reservations first, the cache's snapshot after: one taken before could be older
    // than one a dispatch holding the lock saw (a configuration moving a host meanwhile).
    let mut reservations = shared.reservations.lock().unwrap_or_else(|e| e.into_inner());
    let cache = shared.cache.load();
    let now = Instant::now();
    let ttl = Duration::from_secs(config.reservation_ttl_s);
    for id in other_hardware {
        reservations.forget_host(id, &cache.host(id).name);
    }
    let dropped = reservations.reconcile(&cache, now, ttl);
    let placed = reservations.settle(&cache, now, ttl);
    drop(reservations);
    tracing::trace!(
        results = applied.len(),
        reservations_dropped = dropped,
        pending_placed = placed,
        "host states applied"
    );
    applied
}

/// One round, for tests and tools: fetches every host of the cache once through `source` with
/// `workers` threads, applying each result as it arrives. Returns (successes, failures).
pub fn refresh_once(
    shared: &Shared,
    source: &dyn HostSource,
    config: &CacheConfig,
) -> (usize, usize) {
    set_domain(shared, config);
    add_discovered(shared, config);
    let jobs: Vec<(HostId, Address, CachedTopology)> = {
        let cache = shared.cache.load();
        cache.hosts().map(|(id, h)| (id, h.address.clone(), cache.cached_topology(id))).collect()
    };
    let next = AtomicUsize::new(0);
    let (done, results) = mpsc::channel::<FetchOutcome>();
    let (mut ok, mut failed) = (0, 0);
    std::thread::scope(|s| {
        for _ in 0..config.workers.min(jobs.len().max(1)) {
            let done = done.clone();
            let (jobs, next) = (&jobs, &next);
            s.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((id, address, cached)) = jobs.get(i) else { break };
                let r = source.fetch(address, *cached);
                if done.send((*id, address.clone(), r, Instant::now())).is_err() {
                    break;
                }
            });
        }
        drop(done);
        while let Ok(first) = results.recv() {
            for (_, success, _) in apply_batch(shared, config, first, || results.try_recv().ok()) {
                if success {
                    ok += 1;
                } else {
                    failed += 1;
                }
            }
        }
    });
    tracing::debug!(ok, failed, "host states refreshed");
    (ok, failed)
}

fn set_domain(shared: &Shared, config: &CacheConfig) {
    if shared.cache.load().domain() != config.domain.trim_start_matches('.') {
        shared.cache.write().unwrap_or_else(|e| e.into_inner()).set_domain(&config.domain);
    }
}

fn add_discovered(shared: &Shared, config: &CacheConfig) {
    let names = std::mem::take(&mut *shared.discovered.lock().unwrap_or_else(|e| e.into_inner()));
    if names.is_empty() || config.address_template.is_empty() {
        return;
    }
    let mut cache = shared.cache.write().unwrap_or_else(|e| e.into_inner());
    for name in names {
        if cache.lookup(&name).is_some() {
            continue;
        }
        let say = shared.host_lines.lock().unwrap_or_else(|e| e.into_inner()).admit(Instant::now());
        match crate::address::Address::from_template(&config.address_template, &name) {
            Ok(a) => {
                if say {
                    tracing::info!(host = %name, address = %a, "new host from the scheduler's candidates");
                } else {
                    tracing::debug!(host = %name, address = %a, "new host from the scheduler's candidates");
                }
                cache.add(&name, a);
            }
            Err(e) if say => tracing::warn!(host = %name, "cannot make its topod address: {e}"),
            Err(e) => tracing::debug!(host = %name, "cannot make its topod address: {e}"),
        }
    }
}

/// At most this many fetch threads per configured worker (stuck fetches included).
pub const MAX_THREADS_PER_WORKER: usize = 8;

/// What the refresher's thread receives: a result, or the order to stop.
enum Msg {
    Done(Box<FetchOutcome>),
    /// Stop; with `clear`, empty the cache and the reservations once no result can come.
    Stop {
        clear: bool,
    },
}

/// One fetch for a worker thread.
struct Task {
    id: HostId,
    address: Address,
    cached: CachedTopology,
}

/// When each host is due, which run, and how often each has failed in a row. Pure bookkeeping;
/// [`Refresher`]'s thread does the rest.
#[derive(Debug, Default)]
struct Schedule {
    due: BinaryHeap<Reverse<(Instant, HostId)>>,
    /// Hosts scheduled so far (ids below this are known).
    known: usize,
    /// Fetches running: host, when it started, and whether its last fetch failed (such a
    /// fetch never takes a worker's place).
    running: HashMap<HostId, (Instant, bool)>,
    /// Failures in a row, per host.
    failures: Vec<u32>,
    /// A moving average of successful fetches' durations.
    typical: Option<Duration>,
}

impl Schedule {
    /// Schedules hosts `known..hosts`, due at `now`.
    fn grow(&mut self, hosts: usize, now: Instant) {
        for id in self.known..hosts {
            self.due.push(Reverse((now, id as HostId)));
        }
        self.known = self.known.max(hosts);
        self.failures.resize(self.known, 0);
    }

    /// Running fetches that take a worker's place at `now`: not stuck, and of a host whose last
    /// fetch did not fail.
    fn active(&self, now: Instant, stuck_after: Duration) -> usize {
        self.running
            .values()
            .filter(|&&(t, suspect)| !suspect && now.saturating_duration_since(t) < stuck_after)
            .count()
    }

    /// How long a fetch may run before it counts as stuck: eight times the typical fetch, at
    /// least 20 ms, at most a quarter of `timeout`.
    fn stuck_after(&self, timeout: Duration) -> Duration {
        let cap = (timeout / 4).max(Duration::from_millis(10));
        self.typical.map_or(cap, |t| (t * 8).max(Duration::from_millis(20)).min(cap))
    }

    /// The next host due at `now`, if any, taken off the queue and marked running.
    fn take_due(&mut self, now: Instant) -> Option<HostId> {
        match self.due.peek() {
            Some(Reverse((t, _))) if *t <= now => {}
            _ => return None,
        }
        let Reverse((_, id)) = self.due.pop()?;
        let suspect = self.failures.get(id as usize).is_some_and(|&f| f > 0);
        self.running.insert(id, (now, suspect));
        Some(id)
    }

    /// A fetch of `id` ended at `ended` and was applied at `now`: it is due again after the
    /// interval (from when it started), or after a back-off when it failed: doubling up to 8
    /// intervals, but never past half of `stale_after`, so that a host whose topod is back (a
    /// restart) is known again well within the time a state stays usable.
    fn finished(
        &mut self,
        id: HostId,
        ok: bool,
        (ended, now): (Instant, Instant),
        interval: Duration,
        stale_after: Duration,
    ) {
        let started = self.running.remove(&id).map_or(now, |(t, _)| t);
        if ok {
            let took = ended.saturating_duration_since(started);
            self.typical = Some(self.typical.map_or(took, |t| (t * 7 + took) / 8));
        }
        let i = id as usize;
        if i >= self.failures.len() {
            return;
        }
        let due = if ok {
            self.failures[i] = 0;
            started + interval
        } else {
            self.failures[i] = self.failures[i].saturating_add(1);
            let backoff = interval * (1u32 << self.failures[i].min(4).saturating_sub(1)).min(8);
            now + backoff.min((stale_after / 2).max(interval))
        };
        self.due.push(Reverse((due.max(now), id)));
    }

    /// How long until the next host is due (zero if one is).
    fn until_next(&self, now: Instant) -> Option<Duration> {
        self.due.peek().map(|Reverse((t, _))| t.saturating_duration_since(now))
    }
}

/// The background thread that keeps the cache fresh.
pub struct Refresher {
    stop: Sender<Msg>,
    thread: Option<JoinHandle<()>>,
}

impl Refresher {
    /// Starts refreshing `shared` from `source`, each host every `config.refresh_interval()`;
    /// every host is due at once.
    pub fn start(
        shared: Arc<Shared>,
        source: Arc<dyn HostSource>,
        config: CacheConfig,
    ) -> std::io::Result<Refresher> {
        let (results, inbox) = mpsc::channel::<Msg>();
        let stop = results.clone();
        let thread = std::thread::Builder::new().name("topo-refresh".into()).spawn(move || {
            background_priority(config.refresh_nice);
            run(&shared, source, &config, results, inbox)
        })?;
        Ok(Refresher { stop, thread: Some(thread) })
    }

    /// Whether the thread still runs.
    pub fn is_running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Stops the thread and waits for it (not for fetches still running: they end with their
    /// time-out and their results are dropped).
    pub fn stop(mut self) {
        self.halt();
    }

    /// Tells the thread to stop, without waiting.
    pub fn stop_soon(mut self) {
        let _ = self.stop.send(Msg::Stop { clear: false });
        self.thread.take();
    }

    /// Tells the thread to stop, without waiting, and to empty the cache and the reservations
    /// when it has (a scheduler that finalizes the plug-in and starts it again builds new ones;
    /// the old hosts' states would otherwise stay for the life of the process). Readers holding
    /// a snapshot keep it until they let it go.
    pub fn stop_and_clear(mut self) {
        let _ = self.stop.send(Msg::Stop { clear: true });
        self.thread.take();
    }

    fn halt(&mut self) {
        let _ = self.stop.send(Msg::Stop { clear: false });
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Refresher {
    fn drop(&mut self) {
        self.halt();
    }
}

/// The refresher's thread: hands due hosts to fetch threads and applies what they bring.
fn run(
    shared: &Shared,
    source: Arc<dyn HostSource>,
    config: &CacheConfig,
    results: Sender<Msg>,
    inbox: Receiver<Msg>,
) {
    let interval = config.refresh_interval();
    let max_threads = config.workers.max(1) * MAX_THREADS_PER_WORKER;
    let (tasks, queue) = mpsc::channel::<Task>();
    let queue = Arc::new(Mutex::new(queue));
    let mut threads = 0usize;
    let mut schedule = Schedule::default();
    let mut clear = false;
    set_domain(shared, config);
    loop {
        add_discovered(shared, config);
        let cache = shared.cache.load();
        let now = Instant::now();
        let stuck_after = schedule.stuck_after(config.timeout());
        schedule.grow(cache.len(), now);
        while schedule.active(now, stuck_after) < config.workers.max(1) {
            if threads <= schedule.running.len() {
                if threads >= max_threads {
                    break;
                }
                let (queue, results, source) = (queue.clone(), results.clone(), source.clone());
                let spawned = std::thread::Builder::new()
                    .name("topo-fetch".into())
                    // Started by the refresher's thread, it inherits that thread's lower priority.
                    .spawn(move || fetch_thread(&queue, &results, source.as_ref()));
                match spawned {
                    Ok(_) => threads += 1,
                    Err(e) => {
                        tracing::warn!("cannot start a fetch thread: {e}");
                        break;
                    }
                }
            }
            let Some(id) = schedule.take_due(now) else { break };
            if id as usize >= cache.len() {
                // Emptied by another module's sched_finalize before this refresher stopped.
                continue;
            }
            let h = cache.host(id);
            let task = Task { id, address: h.address.clone(), cached: cache.cached_topology(id) };
            if tasks.send(task).is_err() {
                return;
            }
        }
        drop(cache);
        // Wake for the next due host, or, when none can start before a fetch ends or becomes
        // stuck, for that (never a busy wait).
        let mut wait = schedule.until_next(now).unwrap_or(interval).min(interval);
        if !schedule.running.is_empty() {
            let next_stuck = schedule
                .running
                .values()
                .filter(|&&(_, suspect)| !suspect)
                .map(|&(t, _)| (t + stuck_after).saturating_duration_since(now))
                .filter(|d| !d.is_zero())
                .min()
                .unwrap_or(stuck_after);
            wait = if wait.is_zero() { next_stuck } else { wait.min(next_stuck) };
        }
        let first = match inbox.recv_timeout(wait) {
            Ok(Msg::Done(outcome)) => *outcome,
            Ok(Msg::Stop { clear: c }) => {
                clear = c;
                break;
            }
            Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => continue,
        };
        let mut stop = false;
        let next = || match inbox.try_recv() {
            Ok(Msg::Done(outcome)) => Some(*outcome),
            Ok(Msg::Stop { clear: c }) => {
                stop = true;
                clear = c;
                None
            }
            Err(TryRecvError::Empty | TryRecvError::Disconnected) => None,
        };
        let applied = apply_batch(shared, config, first, next);
        let now = Instant::now();
        for (id, ok, ended) in applied {
            schedule.finished(id, ok, (ended, now), interval, config.stale_after());
        }
        if stop {
            break;
        }
    }
    if clear {
        // Nothing of this refresher writes any more: fetches still running send to a channel
        // no one reads.
        *shared.cache.write().unwrap_or_else(|e| e.into_inner()) = HostCache::new();
        *shared.reservations.lock().unwrap_or_else(|e| e.into_inner()) = Reservations::new();
    }
    tracing::debug!(cleared = clear, "refresher stopped");
}

/// Lowers the calling thread's CPU priority by `levels` nice levels (`[cache] refresh_nice`,
/// 10 by default; threads it starts inherit it): the refresher and its fetch threads run inside the scheduler's process, and while they parse ten thousand hosts' states
/// (a first refresh, after a restart) they must not take the CPU from the scheduler's own
/// thread, whose callbacks a scheduling session waits for. On Linux a nice value is per thread.
fn background_priority(levels: u32) {
    if levels == 0 {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        extern "C" {
            fn gettid() -> i32;
            fn getpriority(which: i32, who: u32) -> i32;
            fn setpriority(which: i32, who: u32, prio: i32) -> i32;
        }
        const PRIO_PROCESS: i32 = 0;
        // SAFETY: plain system calls on the calling thread's own id; no memory is passed.
        let rc = unsafe {
            let tid = gettid() as u32;
            let now = getpriority(PRIO_PROCESS, tid);
            setpriority(PRIO_PROCESS, tid, (now + levels as i32).min(19))
        };
        if rc != 0 {
            tracing::debug!("cannot lower the refresh thread's priority; it keeps the scheduler's");
        }
    }
}

/// This thread's nice value (tests).
#[cfg(all(test, target_os = "linux"))]
pub(crate) fn thread_nice() -> i32 {
    extern "C" {
        fn gettid() -> i32;
        fn getpriority(which: i32, who: u32) -> i32;
    }
    // SAFETY: plain system calls on the calling thread's own id.
    unsafe { getpriority(0, gettid() as u32) }
}

/// A fetch thread: takes tasks until the refresher goes.
fn fetch_thread(queue: &Mutex<Receiver<Task>>, results: &Sender<Msg>, source: &dyn HostSource) {
    loop {
        let task = queue.lock().unwrap_or_else(|e| e.into_inner()).recv();
        let Ok(task) = task else { return };
        let r = source.fetch(&task.address, task.cached);
        if results.send(Msg::Done(Box::new((task.id, task.address, r, Instant::now())))).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod schedule_tests {
    use super::*;

    #[test]
    fn a_failing_host_is_tried_again_within_half_the_stale_limit() {
        // Issue 31: with the defaults (5 s, 30 s) the back-off reached 40 s, so a restarted
        // topod stayed unknown past the 30 s its state may be used.
        let (interval, stale) = (Duration::from_secs(5), Duration::from_secs(30));
        let mut schedule = Schedule::default();
        let start = Instant::now();
        schedule.grow(1, start);
        let mut now = start;
        let mut waits = Vec::new();
        for _ in 0..6 {
            let id = schedule.take_due(now).expect("due");
            schedule.finished(id, false, (now, now), interval, stale);
            let Reverse((due, _)) = *schedule.due.peek().unwrap();
            waits.push(due.duration_since(now).as_secs());
            now = due;
        }
        assert_eq!(waits, [5, 10, 15, 15, 15, 15]);
        // A short stale limit never makes it retry faster than the interval.
        let id = schedule.take_due(now).unwrap();
        schedule.finished(id, false, (now, now), interval, Duration::from_secs(6));
        let Reverse((due, _)) = *schedule.due.peek().unwrap();
        assert_eq!(due.duration_since(now), interval);
        // Back: the interval again.
        let id = schedule.take_due(due).unwrap();
        schedule.finished(id, true, (due, due), interval, stale);
        let Reverse((next, _)) = *schedule.due.peek().unwrap();
        assert_eq!(next.duration_since(due), interval);
    }
}

/// An idle host's free map as topod sends it, serving the topology named `topology_id` (tests).
#[cfg(test)]
fn idle_reply(
    allocatable: topo_core::cpuset::CpuSet,
    topology_id: Option<u64>,
) -> topo_core::proto::reply::FreeMap {
    topo_core::proto::reply::FreeMap {
        generation: 1,
        allocatable,
        held: Default::default(),
        fenced: Default::default(),
        jobs: 0,
        job_ids: Vec::new(),
        free: Default::default(),
        gang: None,
        reservations: Vec::new(),
        defrag: false,
        pools: Vec::new(),
        moves: None,
        gpus: Vec::new(),
        reserved_gpus: Vec::new(),
        held_gpus: Vec::new(),
        topology_id,
    }
}

/// A scripted topod on `socket`: answers `connections` connections, each request line (its
/// protocol version and operation) with what `answer` says, and returns per connection what
/// `note` made of each request (tests).
#[cfg(test)]
fn scripted_topod<N: Send + 'static>(
    socket: &std::path::Path,
    connections: usize,
    answer: impl Fn(u64, &str) -> String + Send + 'static,
    note: impl Fn(u64, &str) -> N + Send + 'static,
) -> std::thread::JoinHandle<Vec<Vec<N>>> {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::os::unix::net::UnixListener::bind(socket).unwrap();
    std::thread::spawn(move || {
        (0..connections)
            .map(|_| {
                let (conn, _) = listener.accept().unwrap();
                let mut asked = Vec::new();
                for line in BufReader::new(conn.try_clone().unwrap()).lines() {
                    let request: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
                    let (v, op) = (request["v"].as_u64().unwrap(), request["op"].as_str().unwrap());
                    (&conn).write_all(format!("{}\n", answer(v, op)).as_bytes()).unwrap();
                    asked.push(note(v, op));
                }
                asked
            })
            .collect()
    })
}

#[cfg(test)]
mod older_topod_tests {
    use super::*;
    use topo_core::cpuset::CpuSet;

    /// A topod on `socket` that speaks protocol versions up to `speaks`, as topod does: a
    /// request in a newer version gets version 1's refusal, word for word. Returns, per
    /// connection, the versions it was asked in.
    fn topod_of_version(
        socket: &std::path::Path,
        speaks: u32,
        connections: usize,
    ) -> std::thread::JoinHandle<Vec<Vec<u64>>> {
        let free_map = topo_core::proto::reply::FreeMap {
            generation: 3,
            held: CpuSet::parse_list("0-1").unwrap(),
            jobs: 1,
            job_ids: vec!["lsf-1".into()],
            ..idle_reply(CpuSet::parse_list("0-7").unwrap(), None)
        };
        let free_map = serde_json::to_string(&free_map).unwrap();
        let answer = move |v: u64, _: &str| {
            if v as u32 <= speaks {
                format!(r#"{{"v":{v},"ok":{free_map}}}"#)
            } else {
                format!(
                    r#"{{"v":1,"error":{{"code":"bad_request","message":"protocol version {v} is not supported; this topod speaks version 1"}}}}"#
                )
            }
        };
        scripted_topod(socket, connections, answer, |v, _| v)
    }

    #[test]
    fn a_topod_that_answered_in_version_1_is_asked_in_it_until_the_recheck() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("old.sock");
        let old = topod_of_version(&socket, 1, 4);
        let source = TopodSource::new(None, Duration::from_secs(10));
        let address = Address::Unix(socket.clone());
        for _ in 0..3 {
            let fetched = source.fetch(&address, CachedTopology::Known(None)).unwrap();
            assert_eq!((fetched.free_map.generation, fetched.free_map.job_ids.len()), (3, 1));
        }
        // Ten minutes on, it is asked in this build's version again (it may have been upgraded).
        for entry in source.older.lock().unwrap().values_mut() {
            entry.1 = Instant::now().checked_sub(OLDER_TOPOD_RECHECK).unwrap();
        }
        source.fetch(&address, CachedTopology::Known(None)).unwrap();
        let now = topo_core::proto::PROTOCOL_VERSION as u64;
        assert_eq!(old.join().unwrap(), [vec![now, 1], vec![1], vec![1], vec![now, 1]]);

        // An up-to-date topod is never noted, and is asked once per fetch.
        let socket = dir.path().join("new.sock");
        let new = topod_of_version(&socket, topo_core::proto::PROTOCOL_VERSION, 2);
        let address = Address::Unix(socket);
        source.fetch(&address, CachedTopology::Known(None)).unwrap();
        source.fetch(&address, CachedTopology::Known(None)).unwrap();
        assert_eq!(new.join().unwrap(), [vec![now], vec![now]]);
        assert_eq!(source.older.lock().unwrap().len(), 1, "only the old topod is noted");
    }
}

#[cfg(test)]
mod topology_change_tests {
    use super::*;

    /// A topod on `socket` serving `topo`, whose free map names `served` as its topology's
    /// fingerprint; it answers `connections` connections and returns the operations each asked.
    fn topod_serving(
        socket: &std::path::Path,
        topo: Topology,
        served: Option<u64>,
        connections: usize,
    ) -> std::thread::JoinHandle<Vec<Vec<String>>> {
        let free_map = idle_reply(topo.allowed.clone(), served);
        let (free_map, topo) =
            (serde_json::to_string(&free_map).unwrap(), serde_json::to_string(&topo).unwrap());
        let answer = move |v: u64, op: &str| {
            let ok = if op == "topology" { &topo } else { &free_map };
            format!(r#"{{"v":{v},"ok":{ok}}}"#)
        };
        scripted_topod(socket, connections, answer, |_, op| op.to_string())
    }

    /// issue 31: a topod that came back on other hardware at the same address was judged on the
    /// topology cached first until the scheduler restarted the module.
    #[test]
    fn a_topod_serving_another_topology_is_asked_for_it_on_the_same_connection() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("topod.sock");
        let intel = Topology::flat(16);
        let id = intel.fingerprint();
        let topod = topod_serving(&socket, intel.clone(), Some(id), 4);
        let source = TopodSource::new(None, Duration::from_secs(10));
        let address = Address::Unix(socket);
        // The cache knows this topology: the free map alone.
        let same = source.fetch(&address, CachedTopology::Known(Some(id))).unwrap();
        assert!(same.topology.is_none());
        // It knows another (or one from a topod too old to name it): the topology comes again.
        let other = source.fetch(&address, CachedTopology::Known(Some(id ^ 1))).unwrap();
        assert_eq!(other.topology.as_ref(), Some(&intel));
        assert_eq!(other.free_map.topology_id, Some(id));
        let older = source.fetch(&address, CachedTopology::Known(None)).unwrap();
        assert_eq!(older.topology.as_ref(), Some(&intel));
        // None cached: the topology first, as always.
        assert!(source.fetch(&address, CachedTopology::Nothing).unwrap().topology.is_some());
        let asked = topod.join().unwrap();
        assert_eq!(
            asked,
            [
                vec!["free_map"],
                vec!["free_map", "topology"],
                vec!["free_map", "topology"],
                vec!["topology", "free_map"]
            ]
        );
    }

    /// A topod too old to name its topology is not asked for it again once the cache has its
    /// topology (cached as unnamed); one that took the place of a topod that named its own is
    /// (attack on 1380592: an older topod on other hardware was never noticed).
    #[test]
    fn a_topod_that_names_no_topology_is_asked_for_it_once() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("topod.sock");
        let topod = topod_serving(&socket, Topology::flat(4), None, 2);
        let source = TopodSource::new(None, Duration::from_secs(10));
        let address = Address::Unix(socket);
        let unnamed = source.fetch(&address, CachedTopology::Known(None)).unwrap();
        assert!(unnamed.topology.is_none());
        let named_before = source.fetch(&address, CachedTopology::Known(Some(7))).unwrap();
        assert_eq!(named_before.topology, Some(Topology::flat(4)));
        assert_eq!(topod.join().unwrap(), [vec!["free_map"], vec!["free_map", "topology"]]);
    }
}
