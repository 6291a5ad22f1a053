//! `topod`: the per-host daemon. Owns the host's hardware graph and the ledger of who holds
//! which CPUs, creates and removes the jobs' cgroups, and answers on a Unix socket.
//!
//! It needs no configuration file. A restart (or a crash) loses nothing: at start the ledger is
//! rebuilt from the job cgroups that exist. Stopping it leaves every job running.

use clap::Parser;
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixDatagram, UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use topo_client::Client;
use topo_core::place::Strategy;
use topo_core::proto::Op;
use topo_core::topology::{hwloc_xml, sysfs};
use topod::cgroup::{self, fs::Files, Kind};
use topod::cli::{TopodArgs, DEFAULT_CONFIG};
use topod::daemon::batch_report::{BatchReporter, RealCommands, COMMAND_TIMEOUT, SETTLE};
use topod::daemon::conn::{raise_fd_limit, Gate};
use topod::daemon::host::Host;
use topod::daemon::metrics;
use topod::daemon::pending::{Kernel, PendingFs, PendingReleases};
use topod::daemon::records::JobRecord;
use topod::daemon::records::Records;
use topod::daemon::server::{self, Admins, Listener, Server};
use topod::daemon::{CgroupKind, Config, DEFAULT_SOCKET, DEFAULT_STATE_DIR};

/// The machine `path` describes: an hwloc XML file, or a directory holding a sysfs snapshot
/// (`sys/` and `proc/`, as `hwloc-gather-topology` makes, or a tree made for a test); this
/// host's without one.
fn read_topology(path: Option<&Path>) -> Result<topo_core::topology::Topology, String> {
    let Some(path) = path else {
        return sysfs::read(Path::new("/"))
            .map_err(|e| format!("reading this host's topology: {e}"));
    };
    if path.is_dir() {
        sysfs::read(path).map_err(|e| format!("reading the sysfs snapshot {}: {e}", path.display()))
    } else {
        hwloc_xml::read_file(path).map_err(|e| e.to_string())
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = TopodArgs::parse();
    // A check's answer is for a person or a script (the package's postinst), never the journal.
    let plain = args.check_config || std::io::IsTerminal::is_terminal(&std::io::stderr());
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            // Once: plainly on a terminal, as a log line elsewhere (the journal).
            if plain {
                eprintln!("topod: {message}");
            } else {
                tracing::error!("{message}");
            }
            ExitCode::from(1)
        }
    }
}

fn run(args: TopodArgs) -> Result<(), String> {
    // SIGTERM and SIGINT are taken by one thread (stop_on_signal), never by the others: blocked
    // here, before any thread starts, so that every thread inherits the mask.
    let mut stop_signals = nix::sys::signal::SigSet::empty();
    stop_signals.add(nix::sys::signal::Signal::SIGTERM);
    stop_signals.add(nix::sys::signal::Signal::SIGINT);
    stop_signals.thread_block().map_err(|e| format!("cannot block SIGTERM and SIGINT: {e}"))?;
    let config_file = match &args.config {
        Some(path) => Some(path.clone()),
        None if Path::new(DEFAULT_CONFIG).exists() => Some(PathBuf::from(DEFAULT_CONFIG)),
        None => None,
    };
    let config = match &config_file {
        Some(path) => Config::load(path).map_err(|e| e.to_string())?,
        None => Config::default(),
    };
    let socket =
        args.socket.or(config.socket.clone()).unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET));
    let state_dir = args
        .state_dir
        .or(config.state_dir.clone())
        .unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_DIR));
    let kind = args.cgroup.or(config.cgroup).unwrap_or_default();
    let subtree = config.cgroup_subtree.clone().unwrap_or_else(|| "topo".to_string());
    // A second topod stops before it reads or changes any cgroup: recovery would remove job
    // cgroups the running one is still configuring. The socket answering tells the common case;
    // the lock on the cgroup subtree tells a second topod with another socket. (Preparing the
    // subtree touches no job.)
    if args.remove_cgroups && UnixStream::connect(&socket).is_ok() {
        return Err(format!(
            "topod is running (it answers on {}): stop it before removing its cgroup subtree",
            socket.display()
        ));
    }
    if !args.prepare_cgroups && !args.check_config {
        refuse_if_running(&socket)?;
    }
    let files = Files::default();
    let mounts = std::fs::read_to_string(cgroup::MOUNTS)
        .map_err(|e| format!("reading {}: {e}", cgroup::MOUNTS))?;
    let kind = match kind {
        CgroupKind::Fake => Kind::Fake,
        CgroupKind::V1 => Kind::V1,
        CgroupKind::V2 => Kind::V2,
        CgroupKind::Auto => Kind::auto(&files, &mounts),
    };
    require_cpuset(kind, &mounts)?;
    if args.check_config {
        if config.confine_devices {
            check_confine_devices(kind, &mounts)?;
        }
        let topology = args.topology.or(config.topology.clone());
        return check_config(config_file.as_deref(), &config, &socket, &state_dir, topology);
    }
    let fds = match raise_fd_limit() {
        Ok(n) => n.to_string(),
        Err(e) => {
            tracing::warn!("cannot raise the open-file limit: {e}");
            "unknown".to_string()
        }
    };
    let options = cgroup::OpenOptions {
        cpu_groups: config.cpu_groups.unwrap_or(true),
        confine_devices: config.confine_devices,
    };
    if args.prepare_cgroups {
        return prepare_cgroups(
            kind,
            files,
            &mounts,
            &subtree,
            args.topology.or(config.topology),
            options,
        );
    }
    if args.remove_cgroups {
        return remove_cgroups(kind, &mounts, &subtree);
    }
    let _subtree_lock = lock_subtree(kind.subtree_dir(&mounts, &subtree))?;
    let topo = read_topology(args.topology.or(config.topology.clone()).as_deref())?;
    let reserved = config.reserved_cpus.clone().unwrap_or_default();
    let strategy = config.strategy.unwrap_or(Strategy::BestFit);
    let backend = kind
        .open(files, &mounts, &subtree, &topo.allowed, &topo.allowed_mems, options)
        .map_err(|e| match kind {
        Kind::V1 => format!("{e} (use --cgroup fake to try topod without cgroups)"),
        _ => e.to_string(),
    })?;
    let records = Records::open(&state_dir).map_err(|e| e.to_string())?;
    let mut host = Host::new(topo, reserved.clone(), backend, Some(records), strategy)
        .map_err(|e| e.to_string())?;
    // Before any thread starts: every thread of topod's inherits where and how it runs.
    keep_clear_of_jobs(&reserved);
    host.set_gang(config.gang());
    if config.gang_rows.is_none()
        && (config.gang_slice_s.is_some()
            || config.gang_all_jobs
            || !config.gang_prime_queues.is_empty())
    {
        tracing::warn!("gang_slice_s, gang_all_jobs and gang_prime_queues do nothing without gang_rows: gang time slicing is off");
    }
    host.set_preempt(config.preempt());
    host.set_equipartition(config.equipartition);
    host.set_defrag(config.defrag());
    let pools = topod::daemon::host::make_pools(host.model(), &config.prime_pools)
        .map_err(|e| format!("topod.toml prime_pools: {e}"))?;
    for p in &pools {
        tracing::info!("prime pool {}: CPUs {}, {} window(s)", p.name, p.cpus, p.windows.len());
    }
    // The pools' windows are in the host's local time: its offset from UTC at each moment
    // (daylight saving time included).
    host.set_pools(
        pools,
        Arc::new(|t| {
            use chrono::{Offset, TimeZone};
            chrono::Local
                .timestamp_opt(t, 0)
                .single()
                .map_or(0, |d| i64::from(d.offset().fix().local_minus_utc()))
        }),
    );
    // Jobs' notify files (their CPUs, rewritten at every resize or move), beside the socket.
    host.set_notify_dir(Some(topo_core::proto::notify_dir_for(&socket)))
        .map_err(|e| e.to_string())?;
    if let Some((_, foreign)) = host.reconcile_foreign() {
        tracing::info!(
            "CPUs {foreign} belong to exclusive cpusets topod did not create; no job gets them"
        );
    }
    let legacy = legacy_hints(&state_dir);
    let recovery = host
        .recover(legacy.hints)
        .map_err(|e| format!("rebuilding the ledger from the cgroups: {e}"))?;
    for file in legacy.files {
        // Every job it described now has its own record.
        let _ = std::fs::remove_file(&file);
    }
    tracing::info!(
        kept = recovery.kept.len(),
        conflicts = recovery.conflicts.len(),
        dropped_records = recovery.dropped_hints.len(),
        "ledger rebuilt from the cgroup tree ({} backend)",
        host.backend_kind()
    );
    for job in &recovery.conflicts {
        tracing::warn!(
            "job cgroup {job} overlaps another job's CPUs; left alone, not in the ledger"
        );
    }
    for job in &recovery.bad_requests {
        tracing::warn!("job {job}: its recorded request does not read back as itself; kept without it until the batch system asks again");
    }
    for name in &recovery.unreadable {
        tracing::warn!(
            "{}: not a job record topod can read; left alone",
            state_dir.join("jobs").join(name).display()
        );
    }
    // The TCP listener (its key read, its port bound) is set up before the socket opens, so
    // that a client that finds the socket finds the listener too, and a bad TCP setting stops
    // topod before any client can reach it (tcp_allow was checked with the configuration).
    let tcp = match &config.tcp_listen {
        None => None,
        Some(addr) => {
            let key_file = config.tcp_key_file.clone().unwrap_or_default();
            let key = read_key(&key_file)?;
            let allow = config.tcp_allow.clone();
            let tcp =
                std::net::TcpListener::bind(addr).map_err(|e| format!("tcp_listen {addr}: {e}"))?;
            tracing::info!(
                "read-only TCP listener on {addr} for {} allowed address(es)",
                allow.len()
            );
            Some((tcp, allow, key))
        }
    };
    let metrics_listener = match &config.metrics_listen {
        None => None,
        Some(addr) => {
            let l = std::net::TcpListener::bind(addr)
                .map_err(|e| format!("metrics_listen {addr}: {e}"))?;
            tracing::info!(
                "metrics (Prometheus text format) on http://{addr}/metrics for {}",
                if config.metrics_allow.is_empty() {
                    "loopback only".to_string()
                } else {
                    format!("{} allowed address(es)", config.metrics_allow.len())
                }
            );
            Some(l)
        }
    };
    // The administrators' socket first: once the public one answers, root's is there too, with
    // its mode (a client, or a test, that waits for the public socket then finds both).
    let admin_socket = topo_core::proto::admin_socket_for(&socket);
    let admin_listener = bind(&admin_socket, 0o600)?;
    let listener = bind(&socket, 0o666)?;
    drop_capabilities(config.confine_devices)?;
    // Capabilities are each thread's own: the reporting thread starts only now, with what
    // topod kept (it runs scontrol and qalter as root within them).
    let reporter = config
        .tell_batch_system
        .unwrap_or(true)
        .then(|| BatchReporter::start(Arc::new(RealCommands::default()), COMMAND_TIMEOUT, SETTLE));
    host.set_batch_reporter(reporter.clone());
    let admins = Admins { uids: config.admin_uids.clone(), gids: config.admin_gids.clone() };
    let limits = config.limits();
    tracing::info!(
        "listening on {} (at most {} connections from users who are not administrators, {} per user; open-file limit {fds})",
        socket.display(),
        limits.max_connections,
        limits.max_connections_per_user
    );
    let server = Server::new(host, admins, Gate::new(limits));
    stop_on_signal(server.clone(), reporter)?;
    let mut pending = PendingReleases::new(
        Kernel,
        topo_core::pending::pending_dir_for(&socket),
        nix::unistd::geteuid().as_raw(),
    );
    notify_systemd(&socket, server.clone())?;
    if config.auto_release {
        let server = server.clone();
        start_thread("auto-release", move || loop {
            std::thread::sleep(Duration::from_secs(1));
            let released = server.lock().release_empty();
            for job in &released {
                tracing::info!("job {job}: its cgroup is empty; released");
            }
            if !released.is_empty() {
                // What the releases queued (a preempted job resumes, a gang row runs on the
                // CPUs they left), without the lock, now rather than at the next tick.
                server.settle();
            }
        })?;
    }
    {
        // Not before serving: a release whose processes will not die takes its timeout, and
        // systemd must hear that topod is up.
        let server = server.clone();
        start_thread("tick", move || {
            tick(&server, &mut pending, || {
                std::thread::sleep(TICK);
                true
            })
        })?;
    }
    {
        // Gang slices: freeze and thaw at every slice boundary (k times the slice since the
        // epoch, by the wall clock), at once after a restart, and for gang jobs a configuration
        // without gang_rows left behind.
        let server = server.clone();
        start_thread("gang-slices", move || loop {
            let now = std::time::SystemTime::now();
            let slice = server.lock().gang().map_or(30, |g| g.gang.slice.max(1)) as u128;
            server.lock().gang_switch(now);
            server.settle();
            let since = now.duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
            let period = slice * 1_000_000_000;
            let wait = period - since % period;
            std::thread::sleep(Duration::from_nanos(wait.min(u128::from(u64::MAX)) as u64));
        })?;
    }
    if let Some((every, rules)) = config.sampling() {
        // Every running job's CPU time, threads and pressure, the mis-sized ones flagged, and the
        // textfile written, each period; the reading takes no lock.
        let server = server.clone();
        let reader = metrics::KernelUsage::new(server.lock().backend(), Path::new("/proc"));
        let textfile = config.metrics_textfile.clone();
        std::thread::Builder::new()
            .name("topod-metrics".into())
            .spawn(move || {
                let mut sizer = metrics::Sizer::new(rules);
                let mut failing = false;
                loop {
                    metrics::sample(&server, &reader, &mut sizer);
                    if let Some(file) = &textfile {
                        let text = metrics::render(&server.snapshot(), &server.metrics);
                        match metrics::write_textfile(file, &text) {
                            Ok(()) => failing = false,
                            Err(e) if !failing => {
                                failing = true;
                                tracing::warn!("metrics_textfile {}: {e}", file.display());
                            }
                            Err(_) => {}
                        }
                    }
                    std::thread::sleep(every);
                }
            })
            .map_err(|e| format!("cannot start the metrics sampler: {e}"))?;
    }
    if let Some(l) = metrics_listener {
        let server = server.clone();
        let allow = config.metrics_allow.clone();
        start_thread("metrics-listener", move || metrics::serve(l, server, allow))?;
    }
    if let Some((tcp, allow, key)) = tcp {
        let (server, allow, key) = (server.clone(), Arc::new(allow), Arc::new(key));
        start_thread("tcp-listener", move || topod::daemon::tcp::serve(tcp, server, allow, key))?;
    }
    {
        let server = server.clone();
        start_thread("admin-listener", move || {
            server::serve(admin_listener, server, Listener::Admins)
        })?;
    }
    server::serve(listener, server, Listener::Public);
    Err("the socket stopped accepting connections".into())
}

/// How long a stop waits for releases, suspensions and resumptions under way (a release waits
/// up to its own kill timeout); systemd's stop timeout (90 s by default) is longer.
const STOP_DRAIN: Duration = Duration::from_secs(60);

/// How long a stop waits for the reports to batch systems still settling.
const REPORT_DRAIN: Duration = Duration::from_secs(10);

/// A stop (`systemctl stop`, an upgrade's restart, a package removal: SIGTERM; Ctrl-C: SIGINT)
/// waits for the releases, suspensions and resumptions under way and for the host lock, then
/// exits: none is cut in half (a release stopped between its freeze and its thaw left the job
/// frozen, its processes in D state, until the next start). Jobs keep running, as ever.
/// Reports to the batch system still settling are sent first (see
/// `topod::daemon::batch_report`).
fn stop_on_signal(server: Arc<Server>, reporter: Option<BatchReporter>) -> Result<(), String> {
    start_thread("stop-on-signal", move || {
        let mut signals = nix::sys::signal::SigSet::empty();
        signals.add(nix::sys::signal::Signal::SIGTERM);
        signals.add(nix::sys::signal::Signal::SIGINT);
        let signal = match signals.wait() {
            Ok(signal) => signal,
            Err(e) => {
                tracing::error!("waiting for a stop signal failed: {e}; topod stops at once");
                std::process::exit(1);
            }
        };
        if let Ok(path) = std::env::var("NOTIFY_SOCKET") {
            let _ = UnixDatagram::unbound().and_then(|s| s.send_to(b"STOPPING=1", path));
        }
        let under_way = server.in_flight();
        if under_way > 0 {
            tracing::info!(
                "{signal}: stopping once {under_way} release(s), suspension(s) or resumption(s) under way are done"
            );
        }
        let (_host, left) = server.drain(STOP_DRAIN);
        if left > 0 {
            tracing::warn!(
                "{signal}: stopping with {left} release(s), suspension(s) or resumption(s) still under way after {} s; the next start finishes them",
                STOP_DRAIN.as_secs()
            );
        } else {
            tracing::info!("{signal}: stopped; jobs keep running and the next start adopts them");
        }
        // Under the host lock: no report comes after these.
        if let Some(reporter) = reporter {
            if !reporter.flush(REPORT_DRAIN) {
                tracing::warn!(
                    "{signal}: some changes to jobs' CPUs were not told to their batch system within {} s",
                    REPORT_DRAIN.as_secs()
                );
            }
        }
        std::process::exit(0);
    })
}

/// Starts one of topod's own threads, named (`ps -L` shows it), or says which could not start
/// (the pids limit of its cgroup, say) instead of panicking.
fn start_thread<F>(name: &str, body: F) -> Result<(), String>
where
    F: FnOnce() + Send + 'static,
{
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(body)
        .map(drop)
        .map_err(|e| format!("cannot start topod's {name} thread: {e}"))
}

/// The shared key of the TCP listener: a file holding at least 16 characters that no one but
/// its owner and group may read, and only its owner may change. Group read is allowed (the LSF
/// master's module reads the same key as the LSF administrator) and logged, with the group.
/// topod places CPUs: a v2 hierarchy without the cpuset controller (a hybrid host, where cpuset
/// is bound to v1) would start a topod that refuses every job.
fn require_cpuset(kind: Kind, mounts: &str) -> Result<(), String> {
    if kind != Kind::V2 {
        return Ok(());
    }
    let mount = cgroup::v2::v2_mount(mounts)
        .ok_or_else(|| "cgroup = \"v2\", but no cgroup v2 hierarchy is mounted".to_string())?;
    let offered = std::fs::read_to_string(mount.join("cgroup.controllers")).unwrap_or_default();
    if offered.split_whitespace().any(|c| c == "cpuset") {
        return Ok(());
    }
    Err(format!(
        "cgroup v2 was asked for (cgroup = \"v2\" or --cgroup v2), but the cgroup v2 hierarchy at {} offers no cpuset controller (on this host it is bound to cgroup v1): leave cgroup out (auto) or set it to \"v1\"",
        mount.display()
    ))
}

/// Paths the systemd unit (packaging/systemd/topod.service) hides from topod: ProtectHome=yes
/// and PrivateTmp=yes.
const HIDDEN_BY_THE_UNIT: [&str; 5] = ["/root", "/home", "/run/user", "/tmp", "/var/tmp"];

/// `--check-config`: what a start reads before it touches cgroups, checked the same way (the
/// configuration was read by the caller): the topology, the reserved CPUs against it, the prime
/// pools, the TCP key, the listening addresses, and the files the unit's sandbox would hide or
/// topod could not create. Prints one line on success. Not checked: whether a port is free (the
/// running topod holds its own), and writes the unit forbids outside /run/topo.
fn check_config(
    file: Option<&Path>,
    config: &Config,
    socket: &Path,
    state_dir: &Path,
    topology: Option<PathBuf>,
) -> Result<(), String> {
    let read_files =
        [("topology", topology.as_deref()), ("tcp_key_file", config.tcp_key_file.as_deref())];
    for (key, path) in read_files {
        let Some(path) = path else { continue };
        if let Some(hidden) = HIDDEN_BY_THE_UNIT.iter().find(|h| path.starts_with(h)) {
            return Err(format!(
                "{key} {}: topod's systemd unit hides {hidden} from it (ProtectHome, PrivateTmp): put the file under /etc/topo",
                path.display()
            ));
        }
    }
    for (key, dir) in [("socket", socket.parent()), ("state_dir", Some(state_dir))] {
        let Some(dir) = dir else { continue };
        // The unit's RuntimeDirectory makes /run/topo, and lets topod write there (and in the
        // cgroup tree) only: ProtectSystem=strict.
        if dir.starts_with(DEFAULT_STATE_DIR) {
            continue;
        }
        if !dir.is_dir() {
            return Err(format!(
                "{key}: {} does not exist, and topod does not create it",
                dir.display()
            ));
        }
        eprintln!(
            "topod: note: {key} is in {}, which topod's systemd unit keeps read-only unless a drop-in adds it to ReadWritePaths (ProtectSystem=strict)",
            dir.display()
        );
    }
    for (key, addr) in
        [("tcp_listen", &config.tcp_listen), ("metrics_listen", &config.metrics_listen)]
    {
        let Some(addr) = addr else { continue };
        let parsed: std::net::SocketAddr =
            addr.parse().map_err(|e| format!("{key} {addr:?}: {e}"))?;
        // The address must be this host's (its port may be the running topod's: not tried).
        std::net::TcpListener::bind((parsed.ip(), 0)).map_err(|e| {
            format!("{key} {addr}: {} is not an address of this host: {e}", parsed.ip())
        })?;
    }
    let topo = read_topology(topology.as_deref())?;
    let reserved = config.reserved_cpus.clone().unwrap_or_default();
    let model = topo_core::place::HostModel::new(&topo, &reserved)
        .map_err(|e| format!("reserved_cpus {reserved}: {e}"))?;
    topod::daemon::host::make_pools(&model, &config.prime_pools)
        .map_err(|e| format!("topod.toml prime_pools: {e}"))?;
    if config.tcp_listen.is_some() {
        read_key(&config.tcp_key_file.clone().unwrap_or_default())?;
    }
    for note in batch_system_notes(config) {
        eprintln!("topod: note: {note}");
    }
    match file {
        Some(file) => println!("{}: valid (not checked: whether its ports are free)", file.display()),
        None => println!("no configuration file ({DEFAULT_CONFIG} does not exist): topod starts with its defaults"),
    }
    Ok(())
}

/// What `--check-config` says of the time policies Slurm's and PBS's jobs never get from topod.
fn batch_system_notes(config: &Config) -> Vec<&'static str> {
    let mut notes = Vec::new();
    if config.gang_rows.is_some() {
        notes.push("gang_rows: Slurm's plug-in and PBS's hook never let topod gang-slice their jobs (they ask gang = false, whatever gang_all_jobs says): the batch system would not know the time a job spent frozen and would end it at its time limit. Use Slurm's PreemptMode=GANG, which topod follows; slicing applies to jobs allocated with topoctl alloc --gang or topo-exec");
    }
    if config.preempt {
        notes.push("preempt: Slurm's plug-in and PBS's hook never mark a job preemptible, for the same reason: their own preemption (Slurm's PreemptMode=SUSPEND, PBS's express queues) suspends jobs, and topod follows it");
    }
    notes
}

fn read_key(key_file: &Path) -> Result<String, String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(key_file)
        .map_err(|e| format!("tcp_key_file {}: {e}", key_file.display()))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o027 != 0 {
        return Err(format!(
            "tcp_key_file {}: {} (mode {mode:o}); make it readable by its owner (and at most its group) only: chmod 600 (or 640)",
            key_file.display(),
            if mode & 0o007 != 0 { "every user can read or change it" } else { "its group can change it" }
        ));
    }
    if mode & 0o040 != 0 {
        tracing::info!("tcp_key_file {} is readable by group {} (mode {mode:o}): its members can read the free map over TCP", key_file.display(), meta.gid());
    }
    // topod runs as root without CAP_DAC_OVERRIDE (the unit's bounding set): only the owner's
    // or root group's read bit lets it in, whatever root could read outside the unit.
    let readable_by_root =
        (meta.uid() == 0 && mode & 0o400 != 0) || (meta.gid() == 0 && mode & 0o040 != 0);
    if nix::unistd::geteuid().is_root() && !readable_by_root {
        return Err(format!(
            "tcp_key_file {}: owned by uid {} (mode {mode:o}), so topod, root without CAP_DAC_OVERRIDE, cannot read it: chown root:root {0}; chmod 600 {0}",
            key_file.display(),
            meta.uid()
        ));
    }
    let key = std::fs::read_to_string(key_file)
        .map_err(|e| format!("tcp_key_file {}: {e}", key_file.display()))?;
    let key = key.trim().to_string();
    if key.len() < 16 {
        return Err(format!(
            "tcp_key_file {}: the key must be at least 16 characters",
            key_file.display()
        ));
    }
    Ok(key)
}

/// `--prepare-cgroups`: the subtree made in each hierarchy, as the backend makes it at start,
/// by a process that may (the unit's `ExecStartPre=+`); nothing else is read or changed.
fn prepare_cgroups(
    kind: Kind,
    files: Files,
    mounts: &str,
    subtree: &str,
    topology: Option<PathBuf>,
    options: cgroup::OpenOptions,
) -> Result<(), String> {
    if let Some(dir) = kind.subtree_dir(mounts, subtree) {
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                return Err(format!("cannot create topod's cgroup subtree {}: {e}", dir.display()))
            }
        }
    }
    let topo = read_topology(topology.as_deref())?;
    kind.open(files, mounts, subtree, &topo.allowed, &topo.allowed_mems, options)
        .map_err(|e| e.to_string())?;
    let dirs = kind.subtree_dir(mounts, subtree).map(|d| d.display().to_string());
    let layout = match kind {
        Kind::V1 => "cgroup v1",
        Kind::V2 => "cgroup v2",
        _ => "no kernel cgroups",
    };
    println!(
        "topod: cgroup subtree {} ready ({layout})",
        dirs.unwrap_or_else(|| subtree.to_string())
    );
    Ok(())
}

/// `--remove-cgroups`: topod's subtree removed from every hierarchy where it holds no job
/// cgroup (refused before this while a topod answers: see `refuse_if_running`). A job cgroup
/// left is a job still running (a stopped topod leaves its jobs running); it and its subtree
/// stay, named, and the removal still succeeds, so that a package removal never fails on it.
fn remove_cgroups(kind: Kind, mounts: &str, subtree: &str) -> Result<(), String> {
    let dirs: Vec<PathBuf> = match kind {
        Kind::Fake => Vec::new(),
        Kind::V1 => {
            let (cpuset, freezer, memory) = cgroup::v1::v1_mounts(mounts);
            let cpu = cgroup::v1::v1_cpu_mount(mounts);
            let devices = cgroup::v1::v1_devices_mount(mounts);
            [cpuset, freezer, memory, cpu, devices]
                .into_iter()
                .flatten()
                .map(|m| m.join(subtree))
                .collect()
        }
        Kind::V2 => kind.subtree_dir(mounts, subtree).into_iter().collect(),
    };
    // A topod on another socket holds the subtree's lock for its lifetime.
    if let Some(dir) = kind.subtree_dir(mounts, subtree).filter(|d| d.exists()) {
        let file =
            std::fs::File::open(&dir).map_err(|e| format!("cannot open {}: {e}", dir.display()))?;
        if let Err((_, nix::errno::Errno::EWOULDBLOCK)) =
            nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
        {
            return Err(format!(
                "a running topod manages {} (it holds its lock): stop it first",
                dir.display()
            ));
        }
    }
    for dir in dirs.iter().filter(|d| d.exists()) {
        let mut running = Vec::new();
        let entries =
            std::fs::read_dir(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
        for entry in entries.filter_map(Result::ok) {
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let job = entry.path();
            let procs = std::fs::read_to_string(job.join("cgroup.procs")).unwrap_or_default();
            // A job cgroup without a process is one whose job has ended: it goes too.
            if procs.trim().is_empty() && std::fs::remove_dir(&job).is_ok() {
                println!("topod: removed {} (its job has ended)", job.display());
                continue;
            }
            running.push(entry.file_name().to_string_lossy().into_owned());
        }
        if !running.is_empty() {
            println!(
                "topod: {} kept: it holds the cgroups of jobs still running ({}); once they have ended: rmdir {}/* {}",
                dir.display(),
                running.join(", "),
                dir.display(),
                dir.display()
            );
            continue;
        }
        match std::fs::remove_dir(dir) {
            Ok(()) => println!("topod: removed {}", dir.display()),
            Err(e) => println!("topod: {} kept: {e}", dir.display()),
        }
    }
    Ok(())
}

/// Takes an exclusive lock (`flock(2)`) on topod's subtree in the cpuset hierarchy, held for
/// topod's lifetime: two topods on one subtree would both give the same CPUs away. Taken before
/// anything in the subtree is read or changed.
fn lock_subtree(dir: Option<PathBuf>) -> Result<Option<nix::fcntl::Flock<std::fs::File>>, String> {
    let Some(dir) = dir else { return Ok(None) };
    match std::fs::create_dir(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(format!("cannot create topod's cgroup subtree {}: {e}", dir.display()))
        }
    }
    let file = std::fs::File::open(&dir)
        .map_err(|e| format!("cannot open topod's cgroup subtree {}: {e}", dir.display()))?;
    match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(Some(lock)),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Err(format!(
            "another topod already manages the cgroup subtree {} (it holds its lock); one topod per subtree, or set another cgroup_subtree",
            dir.display()
        )),
        Err((_, e)) => Err(format!("cannot lock topod's cgroup subtree {}: {e}", dir.display())),
    }
}

/// The single hint file of older topods (`<state_dir>/jobs.json`, and before that
/// `/var/lib/topo/jobs.json`): read once at the first start after an upgrade, for jobs that have
/// no record of their own yet, then removed.
struct Legacy {
    hints: BTreeMap<String, JobRecord>,
    files: Vec<PathBuf>,
}

fn legacy_hints(state_dir: &Path) -> Legacy {
    let mut legacy = Legacy { hints: BTreeMap::new(), files: Vec::new() };
    for file in [state_dir.join("jobs.json"), PathBuf::from("/var/lib/topo/jobs.json")] {
        let Ok(text) = std::fs::read_to_string(&file) else { continue };
        match serde_json::from_str::<BTreeMap<String, JobRecord>>(&text) {
            Ok(hints) => {
                tracing::info!("taking over {} job hint(s) of {}", hints.len(), file.display());
                for (job, hint) in hints {
                    legacy.hints.entry(job).or_insert(hint);
                }
                legacy.files.push(file);
            }
            Err(e) => {
                tracing::warn!("{}: not a hint file topod can read ({e}); ignored", file.display())
            }
        }
    }
    legacy
}

/// Stops a second topod before it touches anything: the socket answers.
fn refuse_if_running(path: &Path) -> Result<(), String> {
    if UnixStream::connect(path).is_ok() {
        return Err(format!("another topod is already listening on {}", path.display()));
    }
    Ok(())
}

/// Binds a socket with `mode` (0666 public: everyone may connect; 0600 the administrators'), replacing a stale one that nobody answers on (what
/// they may do is decided per request from their kernel credentials).
fn bind(path: &Path, mode: u32) -> Result<UnixListener, String> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    if path.exists() {
        refuse_if_running(path)?;
        std::fs::remove_file(path)
            .map_err(|e| format!("cannot remove the stale socket {}: {e}", path.display()))?;
    }
    let listener = UnixListener::bind(path)
        .map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("chmod {}: {e}", path.display()))?;
    Ok(listener)
}

/// How often [`tick`] comes round.
const TICK: Duration = Duration::from_secs(5);

/// topod's tick, for as long as `wait` (a sleep of [`TICK`]) says to go on. Releases an epilog
/// queued while topod could not be reached are done at once, before the first wait (as topod
/// starts), and then on every tick (an epilog that timed out while topod was busy). A job
/// allocated again meanwhile is not released (see daemon::pending).
///
/// Exclusive cpusets beside topod's come and go: look again on each tick, so that topod takes
/// back the CPUs of one that went away (an allocate the kernel refuses looks too). A suspended
/// job someone thawed is frozen again on it, as its CPUs may be lent. Topology reservations that
/// have expired go on it too.
fn tick<F: PendingFs>(
    server: &Server,
    pending: &mut PendingReleases<F>,
    mut wait: impl FnMut() -> bool,
) {
    loop {
        pending.process(server);
        if !wait() {
            return;
        }
        server.lock().reconcile_foreign();
        server.refreeze_suspended();
        {
            let mut host = server.lock();
            host.resume_preempted();
            host.expire_reservations();
            host.pool_windows();
        }
        server.settle();
    }
}

/// `Type=notify`: tells systemd we are ready, and feeds its watchdog only while topod serves:
/// each period a request through its own socket is answered (the accept loop and a connection
/// thread work) and the host lock can be taken (no change is stuck holding it). A stalled lock
/// or a dead accept loop stops the feeding, and systemd restarts topod (jobs are kept:
/// `KillMode=process`, and the restart rebuilds the ledger).
fn notify_systemd(socket: &Path, server: Arc<Server>) -> Result<(), String> {
    let Some(notify) = std::env::var_os("NOTIFY_SOCKET") else { return Ok(()) };
    let send = move |msg: &str| {
        if let Ok(sock) = UnixDatagram::unbound() {
            let _ = sock.send_to(msg.as_bytes(), &notify);
        }
    };
    send("READY=1");
    if let Some(usec) = std::env::var("WATCHDOG_USEC").ok().and_then(|v| v.parse::<u64>().ok()) {
        let period = Duration::from_micros(usec / 3).max(Duration::from_millis(100));
        let socket = socket.to_path_buf();
        start_thread("watchdog", move || loop {
            std::thread::sleep(period);
            let answered =
                Client::connect_with_timeout(&socket, period).and_then(|mut c| c.call(Op::Version));
            match answered {
                Err(e) => tracing::error!(
                    "the watchdog's probe through {} failed: {e}; not telling systemd topod is alive",
                    socket.display()
                ),
                Ok(_) if !server.lock_is_free_within(period) => tracing::error!(
                    "the host lock has been held for over {} ms; not telling systemd topod is alive",
                    period.as_millis()
                ),
                Ok(_) => send("WATCHDOG=1"),
            }
        })?;
    }
    Ok(())
}

/// topod's own threads keep clear of the load jobs put on their CPUs: on the CPUs the
/// configuration reserves for the system (`reserved_cpus`, which no job is given) when it
/// reserves some, and at nice -10 (`process::DAEMON_NICE`) in any case (on CPUs shared with
/// jobs, a job's busy threads then delay topod's answers far less, though not at all only with
/// CPUs reserved). Threads serving users who are not administrators go down to nice 10 as they
/// start (`server::lower_priority`). Called on the main thread before any other starts: the
/// others inherit both.
fn keep_clear_of_jobs(reserved: &topo_core::cpuset::CpuSet) {
    use topod::daemon::process::{
        daemon_cpus, pin_this_thread, set_this_thread_nice, this_thread_cpus, DAEMON_NICE,
    };
    let root = nix::unistd::geteuid().is_root();
    if !reserved.is_empty() {
        // Within the affinity it was started with (taskset, CPUAffinity=): an administrator's
        // choice, which the reserved CPUs narrow and never widen.
        let started_on = this_thread_cpus().unwrap_or_else(|_| reserved.clone());
        let cpus = match daemon_cpus(reserved, &started_on) {
            Ok(cpus) => cpus,
            Err(kept) => {
                tracing::warn!("reserved_cpus {reserved} lie outside the CPUs topod was started on ({kept}, by taskset or CPUAffinity=): its threads stay there");
                kept
            }
        };
        match pin_this_thread(&cpus) {
            Ok(()) if cpus == *reserved => {
                tracing::info!("topod's threads run on the reserved CPUs {reserved}")
            }
            Ok(()) => tracing::info!(
                "topod's threads run on CPUs {cpus}: the reserved CPUs {reserved} within those it was started on ({started_on})"
            ),
            // An emulated topology's CPUs that this machine lacks, or a cpuset topod was
            // started in without them.
            Err(e) => tracing::warn!(
                "cannot keep topod's threads on the reserved CPUs {reserved} ({e}: not CPUs of this machine, or not in the cpuset or CPU affinity topod was started with); they run wherever the kernel puts them"
            ),
        }
    }
    match set_this_thread_nice(DAEMON_NICE) {
        Ok(()) => tracing::info!("topod's threads run at nice {DAEMON_NICE}, ahead of jobs' threads on a shared CPU"),
        Err(e) if root => tracing::warn!(
            "cannot raise topod's priority to nice {DAEMON_NICE} ({e}; it needs CAP_SYS_NICE): a job with many busy threads on the CPUs topod runs on can delay its answers"
        ),
        // An unprivileged demo (the fake backend) needs no priority.
        Err(_) => {}
    }
}

/// What topod keeps after start-up (`shared/reference/cgroups.md` A.1.4): killing job processes
/// of other users, and moving into a cpuset a process whose capabilities are not a subset of
/// topod's (a job started as root: the kernel's cpuset attach check, `cap_safe_nice`, wants
/// `CAP_SYS_NICE`). Every file it writes (the cgroup tree, /run/topo) is root's, and moving
/// another user's process on cgroup v1 needs euid 0, which stays. And binding a reserved port:
/// not for topod's own listeners, but for the `qalter` it runs to tell PBS of a job's new CPUs
/// (`topod::daemon::batch_report`), whose `pbs_iff` proves it is root that way (PBS's default
/// `resvport` authentication; observed: without it, "pbs_iff: cannot connect to host"). The
/// same list is the unit's `CapabilityBoundingSet`.
const KEEP: [caps::Capability; 3] = [
    caps::Capability::CAP_KILL,
    caps::Capability::CAP_SYS_NICE,
    caps::Capability::CAP_NET_BIND_SERVICE,
];

/// `--check-config` with `confine_devices`: what a start would refuse (no v1 devices hierarchy;
/// on v2 a kernel that loads no BPF device program; no CAP_SYS_ADMIN to keep).
fn check_confine_devices(kind: Kind, mounts: &str) -> Result<(), String> {
    use cgroup::devices_bpf::DeviceFilter;
    match kind {
        Kind::V2 => cgroup::devices_bpf::Bpf.check().map_err(|e| {
            format!("confine_devices on cgroup v2 loads a BPF device program into each job's cgroup, and loading one failed: {e}")
        })?,
        Kind::V1 if cgroup::v1::v1_devices_mount(mounts).is_none() => {
            return Err("confine_devices needs the cgroup v1 devices hierarchy, which is not mounted (mount -t cgroup -o devices devices /sys/fs/cgroup/devices)".into());
        }
        _ => {}
    }
    let has = caps::read(None, caps::CapSet::Permitted)
        .map_err(|e| format!("reading capabilities: {e}"))?;
    if !has.is_empty() && !has.contains(&caps::Capability::CAP_SYS_ADMIN) {
        return Err(NO_SYS_ADMIN.into());
    }
    Ok(())
}

/// Why topod will not start with `confine_devices` and without CAP_SYS_ADMIN, and what to do.
const NO_SYS_ADMIN: &str = "confine_devices is on, but topod was started without CAP_SYS_ADMIN, which the kernel asks for to set a job's device rules (cgroup v1: devices.deny; v2: a BPF device program); under systemd install packaging/topod-confine-devices.conf (Debian: /usr/share/doc/topod/examples/confine-devices.conf) as /etc/systemd/system/topod.service.d/confine-devices.conf and run systemctl daemon-reload, or turn confine_devices off";

/// With `confine_devices`, [`KEEP`] and CAP_SYS_ADMIN: the kernel asks for it to write a v1
/// `devices.deny` rule (security/device_cgroup.c, devcgroup_access_write), and on v2 it stands
/// for CAP_BPF and CAP_NET_ADMIN in loading and attaching a device program
/// (kernel/bpf/syscall.c, bpf_prog_load; kernel/bpf/token.c, bpf_token_capable), and
/// CAP_NET_ADMIN, which listing a cgroup's programs asks for.
fn drop_capabilities(confine_devices: bool) -> Result<(), String> {
    use caps::{CapSet, Capability};
    let mut keep: caps::CapsHashSet = KEEP.iter().copied().collect();
    if confine_devices {
        keep.insert(Capability::CAP_SYS_ADMIN);
        // Listing a cgroup's BPF programs (BPF_PROG_QUERY, to replace topod's own) asks for
        // CAP_NET_ADMIN itself on kernels such as Debian 12's 6.1 (observed in the v2 guest:
        // EPERM with CAP_SYS_ADMIN alone).
        keep.insert(Capability::CAP_NET_ADMIN);
    }
    let has =
        caps::read(None, CapSet::Permitted).map_err(|e| format!("reading capabilities: {e}"))?;
    if has.is_empty() {
        // Not root, and nothing to drop: an unprivileged run (fake cgroups, emulation).
        return Ok(());
    }
    if confine_devices && !has.contains(&Capability::CAP_SYS_ADMIN) {
        return Err(NO_SYS_ADMIN.into());
    }
    let kept: caps::CapsHashSet = keep.intersection(&has).copied().collect();
    let effective =
        caps::read(None, CapSet::Effective).map_err(|e| format!("reading capabilities: {e}"))?;
    let inheritable =
        caps::read(None, CapSet::Inheritable).map_err(|e| format!("reading capabilities: {e}"))?;
    let mut names: Vec<String> = kept.iter().map(|c| c.to_string()).collect();
    names.sort();
    if has == kept && effective == kept && inheritable.is_empty() {
        // Already so (systemd's bounding set): no capset, which the unit's system call filter
        // does not allow.
        tracing::info!("capabilities: {}", names.join(" "));
        return Ok(());
    }
    if has.contains(&Capability::CAP_SETPCAP) {
        for cap in caps::all().into_iter().filter(|c| !keep.contains(c)) {
            caps::drop(None, CapSet::Bounding, cap)
                .map_err(|e| format!("dropping {cap} from the bounding set: {e}"))?;
        }
    }
    caps::clear(None, CapSet::Inheritable)
        .map_err(|e| format!("clearing inheritable capabilities: {e}"))?;
    caps::set(None, CapSet::Effective, &kept)
        .map_err(|e| format!("setting effective capabilities: {e}"))?;
    caps::set(None, CapSet::Permitted, &kept)
        .map_err(|e| format!("setting permitted capabilities: {e}"))?;
    tracing::info!("capabilities kept: {}", names.join(" "));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tick_does_the_queued_releases_before_its_first_wait() {
        // As topod starts, not a tick later: an epilog that could not reach topod has waited
        // long enough. Whatever the machine's speed, the queue is empty when the first wait
        // begins.
        use topo_core::topology::{SyntheticShape, Topology};
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("topod.sock");
        let topo = Topology::synthetic(SyntheticShape {
            packages: 1,
            numa_per_package: 1,
            l3_per_numa: 1,
            cores_per_l3: 4,
            threads_per_core: 1,
        });
        let fake = cgroup::fake::Fake::new(topo.allowed.clone(), topo.allowed_mems.clone());
        let host = Host::new(
            topo,
            topo_core::cpuset::CpuSet::new(),
            Box::new(fake),
            None,
            Strategy::BestFit,
        )
        .unwrap();
        let server = Server::new(host, Admins::default(), Gate::new(Default::default()));
        let queued = topo_client::queue_release(&socket, "slurm-99", "the test's epilog").unwrap();
        let dir_of = topo_core::pending::pending_dir_for(&socket);
        let mut pending = PendingReleases::new(Kernel, dir_of, nix::unistd::geteuid().as_raw());
        let mut at_waits = Vec::new();
        tick(&server, &mut pending, || {
            at_waits.push(queued.exists());
            at_waits.len() < 2
        });
        assert_eq!(at_waits, [false, false], "the queue was not done before the first wait");
    }
}
