//! Filling the cache in the background: every host's topod is asked for its free map (and, the
//! first time, its topology), many hosts at once, each with a time-out. The scheduler's own
//! thread never waits on a host.

use crate::address::Address;
use crate::cache::{FreeMap, HostCache, HostId};
use crate::config::CacheConfig;
use crate::reserve::Reservations;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, RwLock};
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
    /// Fetches the free map of the topod at `address`, and its topology when `with_topology`.
    fn fetch(&self, address: &Address, with_topology: bool) -> Result<Fetched, FetchError>;
}

/// The real source: topod's read-only TCP listener or its Unix socket.
pub struct TopodSource {
    key: Option<String>,
    timeout: Duration,
}

impl TopodSource {
    /// A source presenting `key` to TCP listeners, with `timeout` per connect, read and write.
    pub fn new(key: Option<String>, timeout: Duration) -> Self {
        Self { key, timeout }
    }
}

impl HostSource for TopodSource {
    fn fetch(&self, address: &Address, with_topology: bool) -> Result<Fetched, FetchError> {
        let fail = |message: String| FetchError { address: address.to_string(), message };
        let mut client = match address {
            Address::Unix(path) => Client::connect_with_timeout(path, self.timeout),
            Address::Tcp(hostport) => {
                Client::connect_tcp(hostport, self.key.as_deref().unwrap_or(""), self.timeout)
            }
        }
        .map_err(|e| fail(e.to_string()))?;
        let topology = if with_topology {
            Some(client.topology().map_err(|e| fail(e.to_string()))?)
        } else {
            None
        };
        // Only the part the cache keeps is decoded (see `FreeMap`).
        let free_map = client.call_as::<FreeMap>(Op::FreeMap).map_err(|e| fail(e.to_string()))?;
        Ok(Fetched { topology, free_map })
    }
}

/// The shared state a plug-in reads.
#[derive(Debug, Default)]
pub struct Shared {
    /// The cache.
    pub cache: RwLock<HostCache>,
    /// The reservations.
    pub reservations: Mutex<Reservations>,
    /// Host names the scheduler asked about that the cache did not know; the refresher adds
    /// them (with the address template) on its next round.
    pub discovered: Mutex<BTreeSet<String>>,
}

/// One host's fetch: which host, what came back, and when.
type FetchOutcome = (HostId, Result<Fetched, FetchError>, Instant);

/// One round: fetches every host of `cache` through `source` with `workers` threads, then
/// applies the results. Returns (successes, failures).
pub fn refresh_once(
    shared: &Shared,
    source: &dyn HostSource,
    config: &CacheConfig,
) -> (usize, usize) {
    add_discovered(shared, config);
    let jobs: Vec<(HostId, Address, bool)> = {
        let cache = shared.cache.read().unwrap_or_else(|e| e.into_inner());
        cache.hosts().map(|(id, h)| (id, h.address.clone(), cache.needs_topology(id))).collect()
    };
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<FetchOutcome>> = Mutex::new(Vec::with_capacity(jobs.len()));
    std::thread::scope(|s| {
        for _ in 0..config.workers.min(jobs.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((id, address, with_topology)) = jobs.get(i) else { break };
                let r = source.fetch(address, *with_topology);
                results.lock().unwrap_or_else(|e| e.into_inner()).push((*id, r, Instant::now()));
            });
        }
    });
    let results = results.into_inner().unwrap_or_else(|e| e.into_inner());
    let (mut ok, mut failed) = (0, 0);
    // Applied in slices so that the scheduler's readers never wait long for the lock.
    for chunk in results.chunks(256) {
        let mut cache = shared.cache.write().unwrap_or_else(|e| e.into_inner());
        for (id, result, at) in chunk {
            match result {
                Ok(f) => match cache.update(*id, f.topology.as_ref(), f.free_map.clone(), *at) {
                    Ok(()) => {
                        ok += 1;
                        if f.topology.is_some() {
                            tracing::info!(host = %cache.host(*id).name, "topod answers; topology and free map cached");
                        }
                    }
                    Err(e) => {
                        failed += 1;
                        tracing::warn!(host = %cache.host(*id).name, "unusable reply from topod: {e}");
                        cache.failed(*id, &e);
                    }
                },
                Err(e) => {
                    failed += 1;
                    let text = e.to_string();
                    // Said once when a host starts failing (or fails differently), not every round.
                    if cache.host(*id).last_error.as_deref() != Some(text.as_str()) {
                        tracing::warn!(host = %cache.host(*id).name, "cannot fetch the free map: {e}");
                    } else {
                        tracing::debug!(host = %cache.host(*id).name, "still cannot fetch the free map");
                    }
                    cache.failed(*id, &text);
                }
            }
        }
    }
    let cache = shared.cache.read().unwrap_or_else(|e| e.into_inner());
    let dropped = shared.reservations.lock().unwrap_or_else(|e| e.into_inner()).reconcile(
        &cache,
        Instant::now(),
        Duration::from_secs(config.reservation_ttl_s),
    );
    tracing::debug!(ok, failed, reservations_dropped = dropped, "host states refreshed");
    (ok, failed)
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
        match crate::address::Address::from_template(&config.address_template, &name) {
            Ok(a) => {
                tracing::info!(host = %name, address = %a, "new host from the scheduler's candidates");
                cache.add(&name, a);
            }
            Err(e) => tracing::warn!(host = %name, "cannot make its topod address: {e}"),
        }
    }
}

/// The background thread that keeps the cache fresh.
pub struct Refresher {
    stop: Sender<()>,
    thread: Option<JoinHandle<()>>,
}

impl Refresher {
    /// Starts refreshing `shared` from `source` every `config.refresh_interval()`; the first
    /// round starts at once.
    pub fn start(
        shared: Arc<Shared>,
        source: Arc<dyn HostSource>,
        config: CacheConfig,
    ) -> std::io::Result<Refresher> {
        let (stop, stopped): (Sender<()>, Receiver<()>) = mpsc::channel();
        let thread =
            std::thread::Builder::new().name("topo-refresh".into()).spawn(move || loop {
                let started = Instant::now();
                refresh_once(&shared, source.as_ref(), &config);
                let wait = config.refresh_interval().saturating_sub(started.elapsed());
                match stopped.recv_timeout(wait) {
                    Err(RecvTimeoutError::Timeout) => continue,
                    _ => break,
                }
            })?;
        Ok(Refresher { stop, thread: Some(thread) })
    }

    /// Whether the thread still runs.
    pub fn is_running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Stops the thread and waits for its round to end.
    pub fn stop(mut self) {
        self.halt();
    }

    /// Tells the thread to stop after its current round, without waiting (a round may take up
    /// to a time-out per host; a scheduler shutting down should not wait for it).
    pub fn stop_soon(mut self) {
        let _ = self.stop.send(());
        self.thread.take();
    }

    fn halt(&mut self) {
        let _ = self.stop.send(());
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
