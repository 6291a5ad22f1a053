//! `topod`: the per-host daemon. Owns the host's hardware graph and the ledger of who holds
//! which CPUs, creates and removes the jobs' cgroups, and answers on a Unix socket.
//!
//! It needs no configuration file. A restart (or a crash) loses nothing: at start the ledger is
//! rebuilt from the job cgroups that exist. Stopping it leaves every job running.

use clap::Parser;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixDatagram, UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use topod::cgroup::{fake::Fake, v1::V1, v2::V2, CgroupBackend};
use topod::daemon::host::Host;
use topod::daemon::server::{self, Admins};
use topod::daemon::{Config, DEFAULT_SOCKET, DEFAULT_STATE_DIR};
use topod::place::{HostModel, Strategy};
use topod::topology::{hwloc_xml, sysfs};
use topod::CpuSet;

#[derive(Parser)]
#[command(name = "topod", version, about = "Topology-aware job placement: the per-host daemon")]
struct Args {
    /// Configuration file (TOML); default: /etc/topo/topod.toml when it exists.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Socket to listen on [default: /run/topo/topod.sock].
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Directory for the job hint file [default: /run/topo].
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// cgroup backend: auto, v1, v2 or fake (in memory, for demos and tests) [default: auto].
    #[arg(long, value_name = "KIND")]
    cgroup: Option<String>,
    /// Emulate the machine of this hwloc XML file instead of reading /sys.
    #[arg(long, value_name = "FILE")]
    topology: Option<PathBuf>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_target(false).with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).init();
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            tracing::error!("{message}");
            eprintln!("topod: {message}");
            ExitCode::from(1)
        }
    }
}

fn run(args: Args) -> Result<(), String> {
    let config = match &args.config {
        Some(path) => Config::load(path).map_err(|e| e.to_string())?,
        None if Path::new("/etc/topo/topod.toml").exists() => Config::load(Path::new("/etc/topo/topod.toml")).map_err(|e| e.to_string())?,
        None => Config::default(),
    };
    let socket = args.socket.or(config.socket.clone()).unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET));
    let state_dir = args.state_dir.or(config.state_dir.clone()).unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_DIR));
    let kind = args.cgroup.or(config.cgroup.clone()).unwrap_or_else(|| "auto".to_string());
    let subtree = config.cgroup_subtree.clone().unwrap_or_else(|| "topo".to_string());
    // A second topod stops before it reads or changes any cgroup: recovery would remove job
    // cgroups the running one is still configuring.
    refuse_if_running(&socket)?;
    let topo = match args.topology.or(config.topology.clone()) {
        Some(file) => hwloc_xml::read_file(&file).map_err(|e| e.to_string())?,
        None => sysfs::read(Path::new("/")).map_err(|e| format!("reading this host's topology: {e}"))?,
    };
    let reserved = match &config.reserved_cpus {
        Some(list) => CpuSet::parse_list(list).map_err(|e| format!("reserved_cpus: {e}"))?,
        None => CpuSet::new(),
    };
    let strategy: Strategy = config.strategy.as_deref().unwrap_or("best-fit").parse().map_err(|e: topod::place::UnknownStrategy| e.to_string())?;
    let backend = backend(&kind, &subtree, &topo)?;
    let foreign = backend.foreign_cpus().map_err(|e| format!("looking for other exclusive cpusets: {e}"))?;
    if !foreign.is_empty() {
        tracing::info!("CPUs {foreign} belong to exclusive cpusets topod did not create; no job gets them");
    }
    let model = HostModel::new(&topo, &reserved.union(&foreign)).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(&state_dir).map_err(|e| format!("cannot create the state directory {}: {e}", state_dir.display()))?;
    let hint_file = state_dir.join("jobs.json");
    adopt_legacy_hints(&hint_file);
    let mut host = Host::new(topo, model, backend, Some(hint_file), strategy);
    let recovery = host.recover().map_err(|e| format!("rebuilding the ledger from the cgroups: {e}"))?;
    tracing::info!(
        kept = recovery.kept.len(),
        conflicts = recovery.conflicts.len(),
        dropped_hints = recovery.dropped_hints.len(),
        "ledger rebuilt from the cgroup tree ({} backend)",
        host.backend_kind()
    );
    for job in &recovery.conflicts {
        tracing::warn!("job cgroup {job} overlaps another job's CPUs; left alone, not in the ledger");
    }
    // The TCP listener (its key read, its port bound) is set up before the socket opens, so
    // that a client that finds the socket finds the listener too, and a bad TCP setting stops
    // topod before any client can reach it (tcp_allow was checked with the configuration).
    let tcp = match &config.tcp_listen {
        None => None,
        Some(addr) => {
            let key_file = config.tcp_key_file.clone().unwrap_or_default();
            let key = std::fs::read_to_string(&key_file).map_err(|e| format!("tcp_key_file {}: {e}", key_file.display()))?;
            let key = key.trim().to_string();
            if key.len() < 16 {
                return Err(format!("tcp_key_file {}: the key must be at least 16 characters", key_file.display()));
            }
            let allow: Vec<_> = config.tcp_allow.iter().filter_map(|a| topod::daemon::tcp::Allow::parse(a).ok()).collect();
            let tcp = std::net::TcpListener::bind(addr).map_err(|e| format!("tcp_listen {addr}: {e}"))?;
            tracing::info!("read-only TCP listener on {addr} for {} allowed address(es)", allow.len());
            Some((tcp, allow, key))
        }
    };
    let listener = bind(&socket)?;
    drop_capabilities()?;
    let admins = Arc::new(Admins { uids: config.admin_uids.clone(), gids: config.admin_gids.clone() });
    tracing::info!("listening on {}", socket.display());
    notify_systemd();
    let host = Arc::new(Mutex::new(host));
    if config.auto_release {
        let host = host.clone();
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_secs(1));
            let released = host.lock().unwrap_or_else(|e| e.into_inner()).release_empty();
            for job in released {
                tracing::info!("job {job}: its cgroup is empty; released");
            }
        });
    }
    if let Some((tcp, allow, key)) = tcp {
        let (host, allow, key) = (host.clone(), Arc::new(allow), Arc::new(key));
        std::thread::spawn(move || topod::daemon::tcp::serve(tcp, host, allow, key));
    }
    server::serve(listener, host, admins);
    Err("the socket stopped accepting connections".into())
}

fn backend(kind: &str, subtree: &str, topo: &topod::topology::Topology) -> Result<Box<dyn CgroupBackend>, String> {
    let v2_with_cpuset = || {
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
        topod::cgroup::v2::v2_mount(&mounts)
            .and_then(|m| std::fs::read_to_string(m.join("cgroup.controllers")).ok())
            .is_some_and(|c| c.split_whitespace().any(|x| x == "cpuset"))
    };
    match kind {
        "fake" => Ok(Box::new(Fake::new(topo.allowed.clone(), topo.allowed_mems.clone()))),
        "v1" => Ok(Box::new(V1::detect(subtree).map_err(|e| e.to_string())?)),
        "v2" => Ok(Box::new(V2::detect(&format!("{subtree}.slice")).map_err(|e| e.to_string())?)),
        "auto" if v2_with_cpuset() => Ok(Box::new(V2::detect(&format!("{subtree}.slice")).map_err(|e| e.to_string())?)),
        "auto" => Ok(Box::new(V1::detect(subtree).map_err(|e| format!("{e}; no cgroup v2 cpuset controller either (use --cgroup fake to try topod without cgroups)"))?)),
        other => Err(format!("--cgroup {other:?}: expected auto, v1, v2 or fake")),
    }
}

/// Before version 0.1's hint file moved to /run/topo, it was /var/lib/topo/jobs.json: the first
/// start after an upgrade takes it over, so that live jobs keep their owners and requests.
fn adopt_legacy_hints(hint_file: &Path) {
    let legacy = Path::new("/var/lib/topo/jobs.json");
    if hint_file.exists() || hint_file == legacy || !legacy.exists() {
        return;
    }
    match std::fs::copy(legacy, hint_file) {
        Ok(_) => tracing::info!("took over the job hints of {} (the hint file is now {})", legacy.display(), hint_file.display()),
        Err(e) => tracing::warn!("cannot take over the job hints of {}: {e}", legacy.display()),
    }
}

/// Stops a second topod before it touches anything: the socket answers.
fn refuse_if_running(path: &Path) -> Result<(), String> {
    if UnixStream::connect(path).is_ok() {
        return Err(format!("another topod is already listening on {}", path.display()));
    }
    Ok(())
}

/// Binds the socket, replacing a stale one that nobody answers on; everyone may connect (what
/// they may do is decided per request from their kernel credentials).
fn bind(path: &Path) -> Result<UnixListener, String> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    if path.exists() {
        refuse_if_running(path)?;
        std::fs::remove_file(path).map_err(|e| format!("cannot remove the stale socket {}: {e}", path.display()))?;
    }
    let listener = UnixListener::bind(path).map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).map_err(|e| format!("chmod {}: {e}", path.display()))?;
    Ok(listener)
}

/// `Type=notify`: tells systemd we are ready, and keeps its watchdog fed.
fn notify_systemd() {
    let Some(socket) = std::env::var_os("NOTIFY_SOCKET") else { return };
    let send = move |msg: &str| {
        if let Ok(sock) = UnixDatagram::unbound() {
            let _ = sock.send_to(msg.as_bytes(), &socket);
        }
    };
    send("READY=1");
    if let Some(usec) = std::env::var("WATCHDOG_USEC").ok().and_then(|v| v.parse::<u64>().ok()) {
        let period = Duration::from_micros(usec / 2);
        std::thread::spawn(move || loop {
            std::thread::sleep(period);
            send("WATCHDOG=1");
        });
    }
}

/// What topod keeps after start-up (`shared/reference/cgroups.md` A.1.4): writing in the cgroup
/// tree, killing job processes, setting other users' CPU affinity, and chown/fowner for
/// delegated subtrees. Moving another user's process on cgroup v1 needs euid 0, which stays.
/// The same list is the unit's `CapabilityBoundingSet`.
const KEEP: [caps::Capability; 5] = [
    caps::Capability::CAP_DAC_OVERRIDE,
    caps::Capability::CAP_KILL,
    caps::Capability::CAP_SYS_NICE,
    caps::Capability::CAP_CHOWN,
    caps::Capability::CAP_FOWNER,
];

fn drop_capabilities() -> Result<(), String> {
    use caps::{CapSet, Capability};
    let keep: caps::CapsHashSet = KEEP.iter().copied().collect();
    let has = caps::read(None, CapSet::Permitted).map_err(|e| format!("reading capabilities: {e}"))?;
    if has.is_empty() {
        // Not root, and nothing to drop: an unprivileged run (fake cgroups, emulation).
        return Ok(());
    }
    let can_drop_bounding = has.contains(&Capability::CAP_SETPCAP);
    if can_drop_bounding {
        for cap in caps::all().into_iter().filter(|c| !keep.contains(c)) {
            caps::drop(None, CapSet::Bounding, cap).map_err(|e| format!("dropping {cap} from the bounding set: {e}"))?;
        }
    }
    let kept: caps::CapsHashSet = keep.intersection(&has).copied().collect();
    caps::clear(None, CapSet::Inheritable).map_err(|e| format!("clearing inheritable capabilities: {e}"))?;
    caps::set(None, CapSet::Effective, &kept).map_err(|e| format!("setting effective capabilities: {e}"))?;
    caps::set(None, CapSet::Permitted, &kept).map_err(|e| format!("setting permitted capabilities: {e}"))?;
    let mut names: Vec<String> = kept.iter().map(|c| c.to_string()).collect();
    names.sort();
    tracing::info!("capabilities kept: {}", names.join(" "));
    Ok(())
}
