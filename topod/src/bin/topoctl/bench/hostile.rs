//! `topoctl bench daemon --hostile N`: what unprivileged clients can do to everyone else.
//!
//! Three phases against a running topod, each timing root's job start and release (allocate
//! with join_pid, then release, of a one-thread job with a waiting process) while a watcher
//! times `topoctl status` (connect, topology, list, free map) every 20 ms and samples topod's
//! resident memory:
//! 1. quiet;
//! 2. two unprivileged clients loop 64 KiB `fit` requests (`CPU_LIST=0-65535,...` and a
//!    valid list of the host's own CPUs repeated to the same size);
//! 3. one unprivileged user holds N idle connections, reconnecting whatever topod closes;
//! 4. a job of that user's runs S spinning threads (sending topod nothing) on every CPU topod
//!    gives it while one CPU is left for root's jobs; this program (the batch system's
//!    stand-in) runs on the CPUs outside that job, as a site's daemons do.
//!
//! The attackers are this program again (`topoctl bench attack ...`, hidden), run as uid and gid
//! 65534 (nobody), so topod sees them as the ordinary user they are. Needs root.

use super::daemon::{pct, rss_kib};
use crate::{print_json, Failure};
use serde::Serialize;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use topo_client::Client;
use topo_core::proto::Op;
use topod::daemon::process;

/// The uid and gid the attackers run as.
const NOBODY: u32 = 65534;

#[derive(Serialize, Default, Clone)]
struct Phase {
    name: String,
    cycles: usize,
    start_release_p50_us: f64,
    start_release_p99_us: f64,
    status_p99_ms: f64,
    status_max_ms: f64,
    status_failures: usize,
    root_failures: usize,
    rss_max_kib: u64,
    /// For the attack phases: how many requests or connections the attackers made.
    attacker_ops: u64,
}

#[derive(Serialize)]
struct Figures {
    phases: Vec<Phase>,
    /// Each attack phase's root p99 over the quiet one.
    p99_ratio_fit: f64,
    p99_ratio_idle: f64,
    /// The spinning job's phase: root's p99 and `status`'s maximum over the quiet phase's with
    /// the same cycle.
    p99_ratio_spin: Option<f64>,
    status_max_ratio_spin: Option<f64>,
}

/// A child process (an attacker, a job's waiting process), killed and reaped when dropped, so
/// that a benchmark cut short leaves nothing running.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn attacker(socket: &Path, mode: &str, count: usize, stats: &Path) -> Result<Reaped, Failure> {
    let me = std::env::current_exe()
        .map_err(|e| Failure::runtime(format!("cannot find topoctl itself: {e}")))?;
    let child = Command::new(me)
        .args(["bench", "attack", "--socket"])
        .arg(socket)
        .args(["--mode", mode, "--count", &count.to_string(), "--stats"])
        .arg(stats)
        .uid(NOBODY)
        .gid(NOBODY)
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| Failure::runtime(format!("cannot start an attacker: {e}")))?;
    Ok(Reaped(child))
}

/// What root's timed cycle is: a job started and released, or (on a host with no CPU free) a
/// `fit` and a `list`, each through the host lock as an allocate is.
#[derive(Clone, Copy, PartialEq)]
enum Cycle {
    StartRelease,
    FitList,
}

/// Times `cycles` root job starts and releases while a watcher times `topoctl status` and
/// samples topod's memory.
fn phase(socket: &Path, name: &str, cycles: usize, topod_pid: u64) -> Result<Phase, Failure> {
    phase_of(socket, name, cycles, topod_pid, Cycle::StartRelease)
}

/// [`phase`], with root's cycle `cycle`.
fn phase_of(
    socket: &Path,
    name: &str,
    cycles: usize,
    topod_pid: u64,
    cycle: Cycle,
) -> Result<Phase, Failure> {
    let stop = Arc::new(AtomicBool::new(false));
    let status_times = Arc::new(Mutex::new((Vec::<f64>::new(), 0usize, 0u64)));
    let watcher = {
        let (stop, times, socket) = (stop.clone(), status_times.clone(), socket.to_path_buf());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let ok = Client::connect_with_timeout(&socket, Duration::from_secs(5))
                    .and_then(|mut c| {
                        c.call(Op::Topology)
                            .and_then(|_| c.call(Op::List))
                            .and_then(|_| c.call(Op::FreeMap))
                    })
                    .is_ok();
                let ms = t.elapsed().as_secs_f64() * 1e3;
                let rss = rss_kib(topod_pid);
                let mut g = times.lock().unwrap_or_else(|e| e.into_inner());
                g.0.push(ms);
                g.1 += usize::from(!ok);
                g.2 = g.2.max(rss);
                drop(g);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    // A failed start or release is counted (and the connection made again), not fatal: against
    // a topod that does not hold up, the failures are the figure.
    let mut c = Client::connect(socket).ok();
    let mut times = Vec::with_capacity(cycles);
    let mut root_failures = 0;
    let mut outcome = Ok(());
    for i in 0..cycles {
        if cycle == Cycle::FitList {
            let t = Instant::now();
            let r = match c.as_mut() {
                Some(c) => c
                    .call(Op::Fit(topo_core::proto::FitArgs::new("affinity[thread*1]")))
                    .and_then(|_| c.call(Op::List))
                    .map(drop),
                None => Err(topo_client::ClientError::Io {
                    peer: socket.display().to_string(),
                    source: std::io::Error::other("not connected"),
                }),
            };
            times.push(t.elapsed().as_secs_f64() * 1e6);
            // On a full host topod answers the fit "does not fit": an answer all the same.
            if r.as_ref().is_err_and(|e| e.is_unreachable()) {
                root_failures += 1;
                c = Client::connect_with_timeout(socket, Duration::from_secs(5)).ok();
            }
            continue;
        }
        let child = match Command::new("sleep").arg("600").spawn() {
            Ok(c) => c,
            Err(e) => {
                outcome = Err(Failure::runtime(format!("cannot start sleep: {e}")));
                break;
            }
        };
        let child = Reaped(child);
        std::thread::sleep(Duration::from_millis(2));
        let job = format!("hostile-{}-{}-{i}", std::process::id(), name.len());
        let t = Instant::now();
        let op = Op::allocate(&job, "affinity[thread*1]").joining(child.0.id() as i32);
        let r = match c.as_mut() {
            Some(c) => c.allocate(op).and_then(|_| c.release(&job)).map(drop),
            None => Err(topo_client::ClientError::Io {
                peer: socket.display().to_string(),
                source: std::io::Error::other("not connected"),
            }),
        };
        times.push(t.elapsed().as_secs_f64() * 1e6);
        drop(child);
        if r.is_err() {
            root_failures += 1;
            c = Client::connect_with_timeout(socket, Duration::from_secs(5)).ok();
            if let Some(c) = c.as_mut() {
                let _ = c.call(Op::Release { job });
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let _ = watcher.join();
    outcome?;
    let (mut status, failures, rss_max) =
        std::mem::take(&mut *status_times.lock().unwrap_or_else(|e| e.into_inner()));
    Ok(Phase {
        name: name.to_string(),
        cycles,
        start_release_p50_us: pct(&mut times, 0.5),
        start_release_p99_us: pct(&mut times, 0.99),
        status_p99_ms: pct(&mut status, 0.99),
        status_max_ms: status.iter().copied().fold(0.0, f64::max),
        status_failures: failures,
        root_failures,
        rss_max_kib: rss_max,
        attacker_ops: 0,
    })
}

fn read_ops(stats: &Path) -> u64 {
    std::fs::read_to_string(stats).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
}

pub(crate) fn run(
    socket: &Path,
    cycles: usize,
    idle_connections: usize,
    spinners: usize,
    spin_everywhere: bool,
    json: bool,
) -> Result<(), Failure> {
    if !nix::unistd::geteuid().is_root() {
        return Err(Failure::runtime("bench daemon --hostile needs root: its attackers run as the unprivileged user nobody (65534)"));
    }
    let mut c = Client::connect(socket).map_err(|e| Failure::runtime(e.to_string()))?;
    let topod_pid = u64::from(c.version().map_err(|e| Failure::runtime(e.to_string()))?.pid);
    drop(c);
    let dir = tempfile_dir()?;
    let stats = dir.join("ops");
    let mut phases = vec![phase(socket, "quiet", cycles, topod_pid)?];
    {
        let _a = attacker(socket, "fit", 0, &dir.join("ops-a"))?;
        let _b = attacker(socket, "fit-valid", 0, &dir.join("ops-b"))?;
        std::thread::sleep(Duration::from_millis(300));
        let mut p = phase(socket, "two clients looping 64 KiB fit", cycles, topod_pid)?;
        p.attacker_ops = read_ops(&dir.join("ops-a")) + read_ops(&dir.join("ops-b"));
        phases.push(p);
    }
    {
        let _a = attacker(socket, "idle", idle_connections, &stats)?;
        // Let it open its connections before timing.
        let t = Instant::now();
        while read_ops(&stats) < idle_connections as u64 && t.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut p = phase(
            socket,
            &format!("{idle_connections} idle connections from one user"),
            cycles,
            topod_pid,
        )?;
        p.attacker_ops = read_ops(&stats);
        phases.push(p);
    }
    let spin = if spinners > 0 {
        spin_phase(socket, cycles, spinners, topod_pid, &dir.join("ops-spin"), spin_everywhere)?
    } else {
        None
    };
    let _ = std::fs::remove_dir_all(&dir);
    let quiet = phases[0].start_release_p99_us.max(1.0);
    let (spin_quiet, spin) = match spin {
        Some((q, p)) => (q, Some(p)),
        None => (None, None),
    };
    // The spinning phase against the quiet one with the same cycle.
    let reference = spin_quiet.as_ref().unwrap_or(&phases[0]);
    let (ref_p99, ref_status) =
        (reference.start_release_p99_us.max(1.0), reference.status_max_ms.max(0.001));
    let f = Figures {
        p99_ratio_fit: phases[1].start_release_p99_us / quiet,
        p99_ratio_idle: phases[2].start_release_p99_us / quiet,
        p99_ratio_spin: spin.as_ref().map(|p| p.start_release_p99_us / ref_p99),
        status_max_ratio_spin: spin.as_ref().map(|p| p.status_max_ms / ref_status),
        phases: phases.into_iter().chain(spin_quiet).chain(spin).collect(),
    };
    if json {
        return print_json(&f);
    }
    println!("root's job start + release (allocate with join_pid, release), {cycles} cycles per phase; `topoctl status` every 20 ms");
    println!(
        "{:<44} {:>10} {:>10} {:>11} {:>11} {:>9} {:>9} {:>10} {:>12}",
        "phase",
        "p50 us",
        "p99 us",
        "status p99",
        "status max",
        "root fail",
        "stat fail",
        "RSS KiB",
        "attacker ops"
    );
    for p in &f.phases {
        println!(
            "{:<44} {:>10.0} {:>10.0} {:>8.1} ms {:>8.1} ms {:>9} {:>9} {:>10} {:>12}",
            p.name,
            p.start_release_p50_us,
            p.start_release_p99_us,
            p.status_p99_ms,
            p.status_max_ms,
            p.root_failures,
            p.status_failures,
            p.rss_max_kib,
            p.attacker_ops
        );
    }
    println!(
        "root's p99 under attack / quiet: {:.2}x (fit), {:.2}x (idle connections)",
        f.p99_ratio_fit, f.p99_ratio_idle
    );
    match (f.p99_ratio_spin, f.status_max_ratio_spin) {
        (Some(p99), Some(status)) => println!(
            "under the spinning job / quiet: root's p99 {p99:.2}x, status max {status:.2}x"
        ),
        _ if spinners > 0 => println!("the spinning job's phase was not run: it needs CPUs free for jobs (without --spin-everywhere two: one for the spinning job, one for root's)"),
        _ => {}
    }
    Ok(())
}

/// Phase 4: a job of the unprivileged user's runs `spinners` threads. Without `everywhere` it
/// holds every free CPU but one, root's cycles use the CPU left, and this program moves itself
/// off the job's CPUs first. With `everywhere` it holds every free CPU (a full host); root's
/// cycles are then `fit` and `list`, timed once before the spinning starts (the quiet figure
/// it is compared with) and once during, and this program runs at topod's own priority (nice
/// -10) in both, so that the figure is topod's, not this client's. Returns the quiet phase of
/// its own (with `everywhere`) and the spinning one; None when no CPU, or with `everywhere`
/// not two, are free for jobs.
fn spin_phase(
    socket: &Path,
    cycles: usize,
    spinners: usize,
    topod_pid: u64,
    stats: &Path,
    everywhere: bool,
) -> Result<Option<(Option<Phase>, Phase)>, Failure> {
    let mut c = Client::connect(socket).map_err(|e| Failure::runtime(e.to_string()))?;
    let job = format!("hostile-spin-{}", std::process::id());
    let all_pus = c.topology().map_err(|e| Failure::runtime(e.to_string()))?.pus;
    let pus = all_pus.len();
    let mut held = None;
    for k in (1..=pus).rev() {
        if c.call(Op::allocate(&job, format!("affinity[thread*{k}]"))).is_err() {
            continue;
        }
        if everywhere {
            held = Some(k);
            break;
        }
        // The largest job that leaves one CPU for root's one-thread jobs.
        let probe = format!("{job}-probe");
        if c.call(Op::allocate(&probe, "affinity[thread*1]")).is_ok() {
            let _ = c.release(&probe);
            held = Some(k);
            break;
        }
        let _ = c.release(&job);
    }
    let Some(held) = held else { return Ok(None) };
    let listed = c.call(Op::List).map_err(|e| Failure::runtime(e.to_string()))?;
    let spin_cpus = listed
        .as_array()
        .and_then(|a| a.iter().find(|j| j["job"] == job.as_str()))
        .and_then(|j| j["cpus"].as_str())
        .and_then(|l| topo_core::cpuset::CpuSet::parse_list(l).ok())
        .unwrap_or_default();
    let cycle = if everywhere { Cycle::FitList } else { Cycle::StartRelease };
    let outcome = (|| {
        let quiet = if everywhere {
            // This thread only; the watcher it starts inherits it.
            if let Err(e) = process::set_this_thread_nice(process::DAEMON_NICE) {
                eprintln!("topoctl: cannot run at topod's nice {}: {e}", process::DAEMON_NICE);
            }
            Some(phase_of(socket, "quiet (fit + list)", cycles, topod_pid, cycle)?)
        } else {
            None
        };
        let spinner = attacker(socket, "spin", spinners, stats)?;
        let t = Instant::now();
        while read_ops(stats) < spinners as u64 && t.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(50));
        }
        c.call(Op::Join { job: job.clone(), pid: spinner.0.id() as i32 }).map_err(|e| {
            Failure::runtime(format!("moving the spinning threads into {job}: {e}"))
        })?;
        if !everywhere {
            // Off the job's CPUs: this thread, and the watcher it starts next.
            let _ = process::pin_this_thread(&all_pus.difference(&spin_cpus));
        }
        let mut p = phase_of(
            socket,
            &format!(
                "{spinners} spinning threads on {held} CPU(s){}",
                if everywhere { " (fit + list)" } else { "" }
            ),
            cycles,
            topod_pid,
            cycle,
        )?;
        p.attacker_ops = read_ops(stats);
        drop(spinner);
        Ok((quiet, p))
    })();
    // On a connection of its own: the first may have idled out during the phases.
    let released = Client::connect(socket).and_then(|mut c| c.release(&job));
    if let Err(e) = released {
        eprintln!("topoctl: releasing {job} after the benchmark: {e} (topoctl release {job})");
    }
    outcome.map(Some)
}

fn tempfile_dir() -> Result<std::path::PathBuf, Failure> {
    let dir = std::env::temp_dir().join(format!("topo-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| Failure::runtime(format!("cannot create {}: {e}", dir.display())))?;
    // The attackers (nobody) write their counts here.
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777))
        .map_err(|e| Failure::runtime(e.to_string()))?;
    Ok(dir)
}

/// The attacker (hidden `topoctl bench attack`): runs until killed, writing how many requests or
/// connections it made to `stats` now and then.
pub(crate) fn attack(socket: &Path, mode: &str, count: usize, stats: &Path) -> Result<(), Failure> {
    let mut ops: u64 = 0;
    let mut last_write = Instant::now();
    let mut note = |ops: u64, force: bool| {
        if force || last_write.elapsed() > Duration::from_millis(200) {
            let _ = std::fs::write(stats, ops.to_string());
            last_write = Instant::now();
        }
    };
    match mode {
        "fit" | "fit-valid" => {
            let list = if mode == "fit" {
                vec!["0-65535"; (topo_core::proto::MAX_LINE_BYTES - 200) / 8].join(",")
            } else {
                let mut c = Client::connect(socket).map_err(|e| Failure::runtime(e.to_string()))?;
                let pus =
                    c.topology().map_err(|e| Failure::runtime(e.to_string()))?.pus.to_string();
                vec![pus.as_str(); (topo_core::proto::MAX_LINE_BYTES - 200) / (pus.len() + 1)]
                    .join(",")
            };
            let request = format!("CPUSET[CPU_LIST={list}] affinity[thread*2]");
            // Just under the line limit: a whole request topod must parse, not one it refuses
            // for its length.
            let line =
                topo_core::proto::Request::new(Op::Fit(topo_core::proto::FitArgs::new(request)))
                    .to_line();
            assert!(line.len() <= topo_core::proto::MAX_LINE_BYTES, "{} bytes", line.len());
            loop {
                let Ok(mut s) = UnixStream::connect(socket) else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                let mut reply = [0u8; 4096];
                loop {
                    if s.write_all(line.as_bytes()).is_err()
                        || s.read(&mut reply).map(|n| n == 0).unwrap_or(true)
                    {
                        break;
                    }
                    ops += 1;
                    note(ops, false);
                }
            }
        }
        "idle" => {
            use nix::sys::resource::{getrlimit, setrlimit, Resource};
            if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
                let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
            }
            let mut conns: Vec<Option<UnixStream>> = (0..count).map(|_| None).collect();
            loop {
                for slot in conns.iter_mut() {
                    // A connection topod closed (it refused it, or it idled out) is opened again.
                    let closed = slot.as_mut().is_none_or(is_closed);
                    if closed {
                        *slot = UnixStream::connect(socket).ok();
                        ops += 1;
                    }
                }
                note(ops, true);
                std::thread::sleep(Duration::from_millis(500));
            }
        }
        "spin" => {
            for _ in 0..count {
                // A thread that only burns CPU: it sends topod nothing.
                std::thread::spawn(|| loop {
                    std::hint::spin_loop();
                });
                ops += 1;
            }
            note(ops, true);
            loop {
                std::thread::sleep(Duration::from_secs(60));
            }
        }
        other => Err(Failure::input(format!("unknown attack mode {other:?}"))),
    }
}

/// Whether topod has closed this connection (reads what it sent, such as a refusal, without
/// waiting).
fn is_closed(s: &mut UnixStream) -> bool {
    if s.set_nonblocking(true).is_err() {
        return true;
    }
    let mut b = [0u8; 512];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}
