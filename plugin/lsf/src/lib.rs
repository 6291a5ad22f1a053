//! `schmod_topo.so`: the LSF scheduler module of topo.
//!
//! LSF's scheduler (`mbschd`) loads the module listed in `lsb.modules` and calls
//! [`sched_init`], which registers a resource-requirement handler. For every new resource
//! requirement the scheduler calls the handler's `newFn`; the module reads the job's `-extsched`
//! strings and the queue's `MANDATORY_EXTSCHED` / `DEFAULT_EXTSCHED`, merges them per keyword
//! and parses them with the placement core's request language ([`extsched`]). Jobs without a
//! topology request are left alone. Jobs with equal requests get the same handler key, which
//! makes them LSF "peer jobs", matched together.
//!
//! - `matchFn` removes every candidate host whose free topology cannot hold the request, with a
//!   custom pending reason; `sortFn` orders the rest by rank
//!   ([`topo_plugin_core::eval::Verdict::rank`]): hosts where the request fits as they are, by
//!   placement score, then hosts where it fits only in a topology reservation (a block) made
//!   for a request of this shape (for the one peer job it is for), then hosts with topod's
//!   `defrag` where it fits only after the moves topod's planner would make, then prime-time
//!   pools that may admit it, then unknown hosts when fail-open. Both read only the in-memory host-state cache
//!   ([`topo_plugin_core`]), which a background thread keeps fresh from each host's topod:
//!   nothing on the scheduler's thread waits for the network.
//! - matchFn is not told which job it matches (LSF matches peer jobs together), so there a
//!   block made for a request of the same shape may be one peer's (a host where they need it
//!   ranks after every host where they fit without) and every other block is in the way; `checkAllocFn` and `notifyAllocFn`, which know the job (`lsf-<jobid>`, or
//!   `lsf-<jobid>[<index>]` for an array element: the id a reservation for it must name), use only
//!   that job's own block.
//! - `notifyAllocFn` keeps tentative reservations (`NOTIFY_ALLOC`, `NOTIFY_STARTUP` replay
//!   after a scheduler restart, `NOTIFY_DEALLOC`), so that two jobs in one session never count
//!   the same CPUs; a reservation goes when the host's topod reports the job.
//! - `checkAllocFn` re-checks an allocation against the current state and limits the tasks on a
//!   host that can no longer hold them (another job's block in the way included).
//!
//! A string that does not parse pends the job with a pending reason that quotes the fragment.
//! Every exported function catches panics and returns an error code; the module logs through
//! `tracing` to the file its configuration names ([`config`]).

mod api;
pub mod config;
pub mod extsched;
mod handler;
mod hosts;
pub mod keys;

use api::Api;
use config::ModuleConfig;
use std::os::raw::{c_int, c_void};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use topo_ffi_guard::Caught;
use topo_plugin_core::eval::Memo;
use topo_plugin_core::fetch::{Refresher, Shared, TopodSource};

/// What the module holds between calls.
struct Module {
    api: Api,
    config: ModuleConfig,
    shared: Arc<Shared>,
    memo: Mutex<Memo>,
    /// The scheduler's host pointers resolved to cache hosts, for this `sched_init`.
    hosts: Mutex<hosts::HostIndex>,
    refresher: Mutex<Option<Refresher>>,
}

/// The module of the last successful `sched_init`.
///
/// The scheduler may call `sched_finalize` and then `sched_init` again in the same process
/// (with or without `dlclose` in between: the library is linked `-z nodelete`, see build.rs, so
/// it stays mapped and its statics survive). Each `sched_init` after a `sched_finalize`
/// therefore builds a new module (the configuration read again, a new cache, a new refresher)
/// and registers the handler again. A `sched_init` without `sched_finalize` before it also
/// builds a new module from the configuration read again, but over the running module's cache
/// and reservations (see [`init`]).
/// The old module is left in place rather than freed: a callback of the old session may still
/// hold it, and `&'static` is what lets every callback reach the module without a lock held
/// across the call. Its refresher is stopped at `sched_finalize`, or by the next `sched_init`.
static MODULE: RwLock<Option<&'static Module>> = RwLock::new(None);
/// The modules of earlier `sched_init` calls, kept (for late callbacks, as above) where they
/// stay reachable: one small struct per `sched_init` of the process, whose hosts went at
/// `sched_finalize` or passed to the next module.
static RETIRED: Mutex<Vec<&'static Module>> = Mutex::new(Vec::new());
static HANDLER: OnceLock<topo_lsf_sys::RsrcReqHandlerType> = OnceLock::new();
/// The log file and level of the process's first start, which stay for its life.
static FIRST_LOG: OnceLock<(std::path::PathBuf, String)> = OnceLock::new();

fn module() -> Result<&'static Module, String> {
    MODULE
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .ok_or_else(|| "schmod_topo: called before sched_init succeeded".to_string())
}

/// Runs one entry point or callback: an error is logged and becomes `on_error`, and so does a
/// panic (which must never unwind into the scheduler).
fn guarded<T>(callback: &'static str, on_error: T, f: impl FnOnce() -> Result<T, String>) -> T {
    let body = || {
        inject_panic(callback);
        f()
    };
    match topo_ffi_guard::catch(body) {
        Ok(v) => v,
        Err(Caught::Error(message)) => {
            tracing::error!(callback, "{message}");
            on_error
        }
        Err(Caught::Panic(what)) => {
            tracing::error!(
                callback,
                "internal error (panic: {what}); the call returns an error and the scheduler goes on"
            );
            on_error
        }
    }
}

#[cfg(feature = "inject-panic")]
fn inject_panic(callback: &str) {
    if std::env::var("TOPO_LSF_PANIC_IN").is_ok_and(|c| c == callback) {
        panic!("injected into {callback} (test build)");
    }
}

#[cfg(not(feature = "inject-panic"))]
fn inject_panic(_callback: &str) {}

/// Entry point: the module's interface version (0, as every known module returns).
#[no_mangle]
pub extern "C" fn sched_version(_param: *mut c_void) -> c_int {
    0
}

/// Entry point: reads the configuration, resolves the scheduler's functions, starts the cache
/// refresher and registers the handler. 0 on success, -1 (logged) on failure.
#[no_mangle]
pub extern "C" fn sched_init(_param: *mut c_void) -> c_int {
    guarded("sched_init", -1, init)
}

/// `sched_init` calls one at a time (two at once would each start a refresher).
static INIT: Mutex<()> = Mutex::new(());

fn init() -> Result<c_int, String> {
    let _one_at_a_time = INIT.lock().unwrap_or_else(|e| e.into_inner());
    // A module whose refresher runs: this is sched_init again without sched_finalize.
    let running =
        module().ok().filter(|m| m.refresher.lock().unwrap_or_else(|e| e.into_inner()).is_some());
    if running.is_none() && module().is_ok() {
        tracing::info!(
            "sched_init after sched_finalize: reading the configuration and starting again"
        );
    }
    let path = config::path();
    // Everything is read and checked before anything changes: a configuration that no longer
    // reads, or a handler the scheduler refuses, fails this call (loudly) and leaves a running
    // module as it was.
    if module().is_ok() && !path.exists() {
        // A missing file means the defaults at a process's first start; at a later one it
        // would silently turn the site's settings (fail-closed, its hosts, its key) into them.
        let e = format!("sched_init: {} no longer exists; this process read it at its first start (restore it; a file that is to mean the defaults may be empty)", path.display());
        eprintln!("schmod_topo: {e}");
        return Err(e);
    }
    let mut config = config::load(&path).inspect_err(|e| eprintln!("schmod_topo: {e}"))?;
    match FIRST_LOG.get() {
        None => {
            config::start_log(&config.lsf).inspect_err(|e| eprintln!("schmod_topo: {e}"))?;
            let _ = FIRST_LOG.set((config.lsf.log_file.clone(), config.lsf.log_level.clone()));
        }
        Some((file, level)) if *file != config.lsf.log_file || *level != config.lsf.log_level => {
            tracing::warn!(log_file = %file.display(), log_level = %level, "sched_init: the log file and level stay those of this process's first start; the new ones ({}, {}) take effect when mbschd starts again", config.lsf.log_file.display(), config.lsf.log_level);
        }
        Some(_) => {}
    }
    if running.is_some() {
        tracing::info!(config = %path.display(), "sched_init called again without sched_finalize: the configuration is read again; the host states and tentative reservations are kept");
    } else {
        tracing::info!(version = env!("CARGO_PKG_VERSION"), config = %path.display(), header = topo_lsf_sys::HEADER_USED, "schmod_topo starting");
    }
    let api = Api::resolve()?;
    tracing::info!(flavour = ?api.flavour, "scheduler interface resolved");
    let key_store = key_store_of(&config.lsf)?;
    let hosts = config.cache.validate().map_err(|e| e.to_string())?;
    // From here the cache holds the hosts; the configuration's own copy (and the refresher's
    // copy of the configuration) would be two more of ten thousand names and addresses.
    config.cache.hosts = Default::default();
    let key = config.cache.read_key().map_err(|e| e.to_string())?;
    let handler_id = config.lsf.handler_id;
    let unreachable = config.cache.unreachable;
    // Again without sched_finalize, the running module's cache and tentative reservations are
    // kept (a job dispatched before must not lose its CPUs to the next one).
    let shared = running.map_or_else(|| Arc::new(Shared::default()), |m| m.shared.clone());
    let source = Arc::new(TopodSource::new(key, config.cache.timeout()));
    let start_refresher = || {
        Refresher::start(shared.clone(), source.clone(), config.cache.clone())
            .map_err(|e| format!("cannot start the refresh thread: {e}"))
    };
    // At a first start the refresher is started before the handler is registered (a scheduler
    // must never hold the handler of a module that has none); again, after, so that nothing
    // changes the running module's cache (the refresher sets the domain) unless the
    // registration succeeds.
    let mut refresher = if running.is_none() {
        put_hosts(&shared, &config.cache.domain, &hosts);
        Some(start_refresher()?)
    } else {
        None
    };
    // The table lives as long as the process (the header: "Memory must not be freed"); a static
    // rather than a leaked box, so that it stays reachable whether the scheduler keeps the
    // pointer or a copy.
    let handler = HANDLER.get_or_init(handler::table);
    // SAFETY: `handler` is a valid table of six callbacks in the ABI order that is never freed;
    // the scheduler only reads it.
    let rc = unsafe { (api.register_handler)(handler_id, std::ptr::from_ref(handler).cast_mut()) };
    if rc < 0 {
        // Nothing has changed: the next sched_init starts from scratch, or from the running
        // module, which goes on as it was.
        if let Some(r) = refresher {
            r.stop_soon();
        }
        let again =
            if running.is_some() { "sched_init called again without sched_finalize: " } else { "" };
        return Err(format!("{again}the scheduler refused handler id {handler_id} (returned {rc}); another module may use it: set [lsf] handler_id"));
    }
    let refresher = match refresher.take() {
        Some(r) => r,
        None => {
            put_hosts(&shared, &config.cache.domain, &hosts);
            // Should this fail, the handler is the running module's too (one table), and it
            // goes on serving.
            start_refresher()?
        }
    };
    if let Some(old) = running {
        // The new refresher writes the same cache from now on; what the old module remembered
        // per host (verdicts, host pointers: megabytes at ten thousand hosts) goes now, not at
        // the end of the process.
        if let Some(r) = old.refresher.lock().unwrap_or_else(|e| e.into_inner()).take() {
            r.stop_soon();
        }
        *old.memo.lock().unwrap_or_else(|e| e.into_inner()) = Memo::new();
        *old.hosts.lock().unwrap_or_else(|e| e.into_inner()) = hosts::HostIndex::new();
    }
    extsched::set_key_store(key_store);
    // Published only once the handler is registered: a module is running exactly when the
    // scheduler has its handler. A new host index: the scheduler's host pointers and indexes
    // are resolved again (they may name other hosts than before).
    let module: &'static Module = Box::leak(Box::new(Module {
        api,
        config,
        shared,
        memo: Mutex::new(Memo::new()),
        hosts: Mutex::new(hosts::HostIndex::new()),
        refresher: Mutex::new(Some(refresher)),
    }));
    let before = MODULE.write().unwrap_or_else(|e| e.into_inner()).replace(module);
    if let Some(before) = before {
        RETIRED.lock().unwrap_or_else(|e| e.into_inner()).push(before);
    }
    tracing::info!(handler_id, hosts = hosts.len(), ?unreachable, "handler registered");
    Ok(0)
}

/// Puts the configuration's hosts in the cache: hosts it adds join; a host at a new address
/// starts unknown there, the jobs dispatched to it placed again on that state when it comes; a
/// host it no longer names stays until sched_finalize (a job may hold a reservation there).
/// The domain is set first: a match remembers what each host pointer's name found, until the
/// cache's names change.
fn put_hosts(shared: &Shared, domain: &str, hosts: &[(String, topo_plugin_core::Address)]) {
    let mut cache = shared.cache.write().unwrap_or_else(|e| e.into_inner());
    cache.set_domain(domain);
    let mut reservations = shared.reservations.lock().unwrap_or_else(|e| e.into_inner());
    for (name, address) in hosts {
        if let Some(id) = cache.add_at(name, address.clone()) {
            let placed_again = reservations.forget_host(id, name);
            tracing::warn!(host = %name, %address, placed_again, "the configuration gives this host another topod; its state is fetched there, and the jobs dispatched to it are placed again on that state when it comes");
        }
    }
    // The cache first (its writer publishes when dropped), the reservations after: a dispatch
    // waiting for them must not find the host's old state (attack: a job reserved on the old
    // topod's CPUs right after the move, held on the new one until its time-out).
    drop(cache);
    drop(reservations);
}

/// Where long requests are kept for a new scheduler process ([`keys`]): `[lsf] key_dir`, which
/// must be usable, or beside the log file, where a failure only costs replays after a restart.
/// Opened here, put in use only once `sched_init` succeeds.
fn key_store_of(lsf: &config::LsfConfig) -> Result<Option<Arc<dyn keys::KeyStore>>, String> {
    let (dir, chosen) = match &lsf.key_dir {
        Some(dir) => (dir.clone(), true),
        None => (lsf.log_file.with_file_name("schmod_topo.keys"), false),
    };
    match keys::DirKeyStore::open(&dir) {
        Ok(store) => {
            tracing::info!(dir = %dir.display(), "long requests kept in key_dir");
            Ok(Some(Arc::new(store)))
        }
        Err(e) if chosen => Err(e),
        Err(e) => {
            tracing::warn!("{e}; long requests are kept in memory only, so a restarted scheduler cannot replay jobs that have one (set [lsf] key_dir)");
            Ok(None)
        }
    }
}

/// Entry point (phase 1); the module works through its handler.
#[no_mangle]
pub extern "C" fn sched_pre_proc(_param: *mut c_void) -> c_int {
    0
}

/// Entry point (phase 2); the module works through its handler.
#[no_mangle]
pub extern "C" fn sched_match_limit(_param: *mut c_void) -> c_int {
    0
}

/// Entry point (phase 3); the module works through its handler.
#[no_mangle]
pub extern "C" fn sched_order_alloc(_param: *mut c_void) -> c_int {
    0
}

/// Entry point (phase 4); the module works through its handler.
#[no_mangle]
pub extern "C" fn sched_post_proc(_param: *mut c_void) -> c_int {
    0
}

/// Entry point: tells the refresh thread to stop (without waiting for its round) and to empty
/// the cache and the reservations when it has; the memo and the host index go at once. A later
/// `sched_init` starts the module again.
#[no_mangle]
pub extern "C" fn sched_finalize(_param: *mut c_void) -> c_int {
    guarded("sched_finalize", -1, || {
        if let Ok(m) = module() {
            if let Some(r) = m.refresher.lock().unwrap_or_else(|e| e.into_inner()).take() {
                // The module stays (a late callback may still reach it), but not what it holds
                // of ten thousand hosts: a sched_init after this one builds its own.
                r.stop_and_clear();
            }
            *m.memo.lock().unwrap_or_else(|e| e.into_inner()) = Memo::new();
            *m.hosts.lock().unwrap_or_else(|e| e.into_inner()) = hosts::HostIndex::new();
            tracing::info!("schmod_topo finalized");
        }
        Ok(0)
    })
}
