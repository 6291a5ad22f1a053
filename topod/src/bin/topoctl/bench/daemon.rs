//! `topoctl bench daemon`: what topod costs on top of the kernel.
//!
//! 1. Job start and release through topod, timed per cycle: a waiting process is started as
//!    one request (`allocate` with `join_pid`) on even cycles and as two
//!    (`allocate`, then `join`) on odd ones; then `release` kills it.
//! 2. The same kernel operations done directly, alternating with 1 cycle by cycle, when this
//!    host has the cgroup v1 cpuset hierarchy and we are root: mkdir in each hierarchy, write
//!    `cpuset.mems`, `cpuset.cpus`, the pid to `cgroup.procs`; then freeze, kill, thaw, wait
//!    until empty, rmdir.
//! 3. Allocate/release pairs per second from concurrent clients (no processes).
//! 4. topod's resident memory, before and after filling the host with one-thread jobs.

use crate::{print_json, Failure};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use topo_client::Client;
use topo_core::proto::Op;

#[derive(Serialize)]
struct Figures {
    cycles: usize,
    topod_start_p50_us: f64,
    topod_start_p99_us: f64,
    topod_start_two_requests_p50_us: f64,
    topod_start_two_requests_p99_us: f64,
    topod_release_p50_us: f64,
    topod_release_p99_us: f64,
    raw_start_p50_us: Option<f64>,
    raw_start_p99_us: Option<f64>,
    raw_release_p50_us: Option<f64>,
    raw_release_p99_us: Option<f64>,
    start_plus_release_ratio_p50: Option<f64>,
    start_two_requests_plus_release_ratio_p50: Option<f64>,
    clients: usize,
    pairs_attempted: usize,
    pairs_completed: usize,
    pairs_per_second: f64,
    live_jobs: usize,
    rss_kib_idle: u64,
    rss_kib_with_live_jobs: u64,
}

/// The `q` quantile of `v` (sorted in place).
pub(crate) fn pct(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v.get(((v.len().max(1) - 1) as f64 * q).round() as usize).copied().unwrap_or(0.0)
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn call(c: &mut Client, op: Op) -> Result<serde_json::Value, Failure> {
    c.call(op).map_err(|e| Failure::runtime(e.to_string()))
}

fn typed<T: serde::de::DeserializeOwned>(c: &mut Client, op: Op) -> Result<T, Failure> {
    c.call_as(op).map_err(|e| Failure::runtime(e.to_string()))
}

/// A waiting process to move into a job's cgroup, killed and reaped when dropped, so that a
/// benchmark cut short (topod gone, a cgroup write refused) leaves nothing running.
struct Sleeper(Child);

impl Sleeper {
    fn id(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Settled (its exec done) before the clock starts, so that both paths time only the cgroup work.
fn sleeper() -> Result<Sleeper, Failure> {
    let child = Command::new("sleep")
        .arg("600")
        .spawn()
        .map_err(|e| Failure::runtime(format!("cannot start sleep: {e}")))?;
    std::thread::sleep(Duration::from_millis(2));
    Ok(Sleeper(child))
}

/// The resident memory of process `pid`, in KiB (0 when it cannot be read).
pub(crate) fn rss_kib(pid: u64) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("VmRSS:")
                    .map(|v| v.trim().trim_end_matches("kB").trim().parse().unwrap_or(0))
            })
        })
        .unwrap_or(0)
}

pub(crate) fn run(socket: &Path, cycles: usize, clients: usize, json: bool) -> Result<(), Failure> {
    let mut c = Client::connect(socket).map_err(|e| Failure::runtime(e.to_string()))?;
    let version: topo_core::proto::reply::Version = typed(&mut c, Op::Version)?;
    let pid = u64::from(version.pid);
    let backend = version.cgroup;

    // 1 and 2, alternating cycle by cycle, so that load from elsewhere falls on both alike.
    // The direct baseline compares like with like only when topod itself runs on cgroup v1.
    let raw_v1 = if backend == "v1" { RawV1::new()? } else { None };
    let (mut raw_start, mut raw_release) = (Vec::with_capacity(cycles), Vec::with_capacity(cycles));
    let (mut start_t, mut start_two_t, mut release_t) =
        (Vec::with_capacity(cycles), Vec::with_capacity(cycles), Vec::with_capacity(cycles));
    let mut first_cpus = String::new();
    for i in 0..cycles {
        let child = sleeper()?;
        let job = format!("bench-{}-{i}", std::process::id());
        let one_request = i % 2 == 0;
        let t0 = Instant::now();
        let join_pid = one_request.then_some(child.id() as i32);
        let a: topo_core::ledger::Allocation = typed(
            &mut c,
            Op::Allocate(topo_core::proto::AllocateArgs {
                join_pid,
                ..topo_core::proto::AllocateArgs::new(job.clone(), "affinity[thread*1]")
            }),
        )?;
        if one_request {
            start_t.push(us(t0.elapsed()));
        } else {
            call(&mut c, Op::Join { job: job.clone(), pid: child.id() as i32 })?;
            start_two_t.push(us(t0.elapsed()));
        }
        if first_cpus.is_empty() {
            first_cpus = a.cpus.to_string();
        }
        let t1 = Instant::now();
        call(&mut c, Op::Release { job })?;
        release_t.push(us(t1.elapsed()));
        drop(child);
        if let Some(raw) = &raw_v1 {
            let (s, r) = raw.cycle(i, &first_cpus)?;
            raw_start.push(s);
            raw_release.push(r);
        }
    }
    drop(raw_v1);
    let raw = (!raw_start.is_empty()).then_some((raw_start, raw_release));

    // 3. Throughput from concurrent clients: only pairs that allocated and released count (a
    // refusal when the host is full is quick and proves nothing).
    let pairs = cycles.max(100);
    let completed = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|w| {
            let socket = socket.to_path_buf();
            let completed = completed.clone();
            std::thread::spawn(move || -> Result<(), String> {
                let mut c = Client::connect(&socket).map_err(|e| e.to_string())?;
                for i in (w..pairs).step_by(clients.max(1)) {
                    let job = format!("pair-{}-{i}", std::process::id());
                    let op = Op::allocate(&job, "affinity[thread*1]");
                    match c.call(op) {
                        Ok(_) => {
                            c.call(Op::Release { job }).map_err(|e| e.to_string())?;
                            completed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        Err(topo_client::ClientError::Refused(e))
                            if e.code == topo_core::proto::ErrorCode::DoesNotFit => {}
                        Err(e) => return Err(e.to_string()),
                    }
                }
                Ok(())
            })
        })
        .collect();
    for t in threads {
        t.join()
            .map_err(|_| Failure::runtime("a client thread panicked"))?
            .map_err(Failure::runtime)?;
    }
    let completed = completed.load(std::sync::atomic::Ordering::Relaxed);
    let pairs_per_second = completed as f64 / started.elapsed().as_secs_f64();

    // 4. Memory with the host full of one-thread jobs (with the fake backend, no processes).
    let rss_idle = rss_kib(pid);
    let mut live = Vec::new();
    loop {
        let job = format!("live-{}-{}", std::process::id(), live.len());
        match c.call(Op::allocate(&job, "affinity[thread*1]")) {
            Ok(_) => live.push(job),
            Err(_) => break,
        }
        if live.len() >= 1000 {
            break;
        }
    }
    let rss_live = rss_kib(pid);
    for job in &live {
        call(&mut c, Op::Release { job: job.clone() })?;
    }

    let (mut s, mut s2, mut r) = (start_t, start_two_t, release_t);
    let mut f = Figures {
        cycles,
        topod_start_p50_us: pct(&mut s, 0.5),
        topod_start_p99_us: pct(&mut s, 0.99),
        topod_start_two_requests_p50_us: pct(&mut s2, 0.5),
        topod_start_two_requests_p99_us: pct(&mut s2, 0.99),
        topod_release_p50_us: pct(&mut r, 0.5),
        topod_release_p99_us: pct(&mut r, 0.99),
        raw_start_p50_us: None,
        raw_start_p99_us: None,
        raw_release_p50_us: None,
        raw_release_p99_us: None,
        start_plus_release_ratio_p50: None,
        start_two_requests_plus_release_ratio_p50: None,
        clients,
        pairs_attempted: pairs,
        pairs_completed: completed,
        pairs_per_second,
        live_jobs: live.len(),
        rss_kib_idle: rss_idle,
        rss_kib_with_live_jobs: rss_live,
    };
    if let Some((mut rs, mut rr)) = raw {
        f.raw_start_p50_us = Some(pct(&mut rs, 0.5));
        f.raw_start_p99_us = Some(pct(&mut rs, 0.99));
        f.raw_release_p50_us = Some(pct(&mut rr, 0.5));
        f.raw_release_p99_us = Some(pct(&mut rr, 0.99));
        let raw_p50 = pct(&mut rs, 0.5) + pct(&mut rr, 0.5);
        f.start_plus_release_ratio_p50 =
            Some((f.topod_start_p50_us + f.topod_release_p50_us) / raw_p50);
        f.start_two_requests_plus_release_ratio_p50 =
            Some((f.topod_start_two_requests_p50_us + f.topod_release_p50_us) / raw_p50);
    }
    if json {
        return print_json(&f);
    }
    println!("topod ({backend} cgroups), {cycles} cycles, one-thread jobs");
    println!(
        "  start, one request (allocate with join_pid)  p50 {:>8.1} us  p99 {:>8.1} us",
        f.topod_start_p50_us, f.topod_start_p99_us
    );
    println!(
        "  start, two requests (allocate, then join)    p50 {:>8.1} us  p99 {:>8.1} us",
        f.topod_start_two_requests_p50_us, f.topod_start_two_requests_p99_us
    );
    println!(
        "  release                                      p50 {:>8.1} us  p99 {:>8.1} us",
        f.topod_release_p50_us, f.topod_release_p99_us
    );
    match (f.raw_start_p50_us, f.raw_start_p99_us, f.raw_release_p50_us, f.raw_release_p99_us, f.start_plus_release_ratio_p50, f.start_two_requests_plus_release_ratio_p50) {
        (Some(a), Some(b), Some(c2), Some(d), Some(ratio), Some(ratio_two)) => {
            println!("the same cgroup v1 operations done directly, same run");
            println!("  start (mkdir, cpus, mems, pid)               p50 {a:>8.1} us  p99 {b:>8.1} us");
            println!("  release (freeze, kill, rmdir)                p50 {c2:>8.1} us  p99 {d:>8.1} us");
            println!("  start + release through topod / direct, at p50: {ratio:.2}x (start in one request), {ratio_two:.2}x (in two)");
        }
        _ => println!("(no direct baseline: it needs topod on cgroup v1, and root with the v1 cpuset hierarchy here)"),
    }
    println!("{clients} concurrent clients: {:.0} allocate/release pairs per second ({} of {} attempted pairs completed; the others found the host full)", f.pairs_per_second, f.pairs_completed, f.pairs_attempted);
    println!(
        "topod resident memory: {} KiB idle, {} KiB with {} live jobs",
        f.rss_kib_idle, f.rss_kib_with_live_jobs, f.live_jobs
    );
    Ok(())
}

/// A cgroup v1 subtree of our own in which the kernel operations of a job start and release
/// are done directly; removed when dropped.
struct RawV1 {
    roots: Vec<PathBuf>,
    has_freezer: bool,
    parent_mems: String,
}

fn io_failure(what: &str, p: &Path, e: std::io::Error) -> Failure {
    Failure::runtime(format!("{what} {}: {e}", p.display()))
}

impl RawV1 {
    /// `None` when not root or without the v1 cpuset hierarchy.
    fn new() -> Result<Option<RawV1>, Failure> {
        if !nix::unistd::geteuid().is_root() {
            return Ok(None);
        }
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
        let (Some(cpuset), freezer, memory) = topod::cgroup::v1::v1_mounts(&mounts) else {
            return Ok(None);
        };
        let name = format!("topo-raw-bench-{}", std::process::id());
        let has_freezer = freezer.is_some();
        let roots: Vec<PathBuf> =
            [Some(cpuset), freezer, memory].into_iter().flatten().map(|m| m.join(&name)).collect();
        let mut raw = RawV1 { roots, has_freezer, parent_mems: String::new() };
        for r in &raw.roots {
            std::fs::create_dir(r).map_err(|e| io_failure("mkdir", r, e))?;
        }
        let root = &raw.roots[0];
        let parent = |file: &str| {
            std::fs::read_to_string(root.parent().map(|p| p.join(file)).unwrap_or_default())
                .unwrap_or_default()
                .trim()
                .to_string()
        };
        let (parent_mems, parent_cpus) = (parent("cpuset.mems"), parent("cpuset.cpus"));
        std::fs::write(root.join("cpuset.mems"), &parent_mems)
            .map_err(|e| io_failure("write", root, e))?;
        std::fs::write(root.join("cpuset.cpus"), &parent_cpus)
            .map_err(|e| io_failure("write", root, e))?;
        raw.parent_mems = parent_mems;
        Ok(Some(raw))
    }

    /// One job start (mkdir in each hierarchy, mems, cpus, the pid in each) and release
    /// (freeze, kill, thaw, wait until empty, rmdir): microseconds for each.
    fn cycle(&self, i: usize, cpus: &str) -> Result<(f64, f64), Failure> {
        let child = sleeper()?;
        let dirs: Vec<PathBuf> = self.roots.iter().map(|r| r.join(i.to_string())).collect();
        let t0 = Instant::now();
        for d in &dirs {
            std::fs::create_dir(d).map_err(|e| io_failure("mkdir", d, e))?;
        }
        std::fs::write(dirs[0].join("cpuset.mems"), &self.parent_mems)
            .map_err(|e| io_failure("write", &dirs[0], e))?;
        std::fs::write(dirs[0].join("cpuset.cpus"), cpus)
            .map_err(|e| io_failure("write", &dirs[0], e))?;
        for d in &dirs {
            std::fs::write(d.join("cgroup.procs"), child.id().to_string())
                .map_err(|e| io_failure("write", d, e))?;
        }
        let start = us(t0.elapsed());
        let t1 = Instant::now();
        let frozen = self.has_freezer.then(|| dirs[1].join("freezer.state"));
        if let Some(f) = &frozen {
            let _ = std::fs::write(f, "FROZEN");
        }
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        if let Some(f) = &frozen {
            let _ = std::fs::write(f, "THAWED");
        }
        while !std::fs::read_to_string(dirs[0].join("cgroup.procs"))
            .unwrap_or_default()
            .trim()
            .is_empty()
        {
            std::thread::sleep(Duration::from_micros(50));
        }
        for d in dirs.iter().rev() {
            std::fs::remove_dir(d).map_err(|e| io_failure("rmdir", d, e))?;
        }
        let release = us(t1.elapsed());
        drop(child);
        Ok((start, release))
    }
}

impl Drop for RawV1 {
    fn drop(&mut self) {
        // A cycle cut short leaves its directories (its process killed by now): remove them,
        // deepest first, giving the kernel a moment to empty them.
        for _ in 0..100 {
            let mut left = false;
            for r in &self.roots {
                for d in std::fs::read_dir(r)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter(|e| e.path().is_dir())
                {
                    left |= std::fs::remove_dir(d.path()).is_err();
                }
            }
            if !left {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        for r in &self.roots {
            let _ = std::fs::remove_dir(r);
        }
    }
}
