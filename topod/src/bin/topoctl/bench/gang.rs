//! `topoctl bench gang`: what gang time slicing costs, on real cgroups, with real topods.
//!
//! For each slice length T, two topods start on this host, each on a cgroup subtree, socket and
//! state directory of its own, with `gang_rows = 2` and `gang_slice_s = T`:
//!
//! - topod A holds two gang jobs, rows 0 and 1, both on one CPU (the batch system's choice),
//!   each with one busy process. One CPU, always one of them running: over a window of whole
//!   slices the two processes should get the window's length of CPU time. What they miss (by
//!   `/proc/PID/schedstat`, nanoseconds on a CPU) is the time the switches lost, less what one
//!   busy process alone on that CPU misses over the same length (the baseline, measured
//!   first: timer interrupts, other processes).
//! - topod B holds the same two jobs with idle processes. After every boundary both topods are
//!   asked when they switched (`free_map`'s `gang.last_switch_at`): the difference is the skew
//!   between two hosts whose clocks agree exactly (one host, one clock), and each switch's
//!   distance from k·T is its lateness.
//!
//! The measuring thread runs on another CPU than the jobs. Needs root and two CPUs.

use crate::live::call;
use crate::{print_json, Failure};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde::Serialize;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use topo_client::Client;
use topo_core::proto::{AllocateArgs, Op};

/// Children killed when dropped (busy processes, topods).
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = kill(Pid::from_raw(c.id() as i32), Signal::SIGTERM);
            let _ = c.wait();
        }
    }
}

/// A topod of the bench, with the cgroup subtree it made.
struct Topod {
    process: Children,
    socket: PathBuf,
    subtree: String,
}

impl Drop for Topod {
    fn drop(&mut self) {
        self.process.0.iter_mut().for_each(|c| {
            let _ = kill(Pid::from_raw(c.id() as i32), Signal::SIGTERM);
            let _ = c.wait();
        });
        remove_subtree(&self.subtree);
    }
}

fn remove_subtree(subtree: &str) {
    let Ok(mounts) = std::fs::read_to_string(topod::cgroup::MOUNTS) else { return };
    let (cpuset, freezer, memory) = topod::cgroup::v1::v1_mounts(&mounts);
    let cpu = topod::cgroup::v1::v1_cpu_mount(&mounts);
    let v2 = topod::cgroup::v2::v2_mount(&mounts).map(|m| m.join(format!("{subtree}.slice")));
    for dir in [
        cpuset.map(|m| m.join(subtree)),
        freezer.map(|m| m.join(subtree)),
        memory.map(|m| m.join(subtree)),
        cpu.map(|m| m.join(subtree)),
        v2,
    ]
    .into_iter()
    .flatten()
    {
        let _ = std::fs::remove_dir(dir);
    }
}

fn start_topod(dir: &Path, name: &str, slice: u64) -> Result<Topod, Failure> {
    let exe = std::env::current_exe().map_err(|e| Failure::runtime(e.to_string()))?;
    let topod = exe.with_file_name("topod");
    if !topod.is_file() {
        return Err(Failure::runtime(format!(
            "{} not found: bench gang starts topods from beside topoctl",
            topod.display()
        )));
    }
    let state = dir.join(name);
    std::fs::create_dir_all(&state).map_err(|e| Failure::runtime(e.to_string()))?;
    let subtree = format!("topo-bench-gang-{name}-{}", std::process::id());
    let config = state.join("topod.toml");
    std::fs::write(
        &config,
        format!("cgroup_subtree = \"{subtree}\"\ngang_rows = 2\ngang_slice_s = {slice}\n"),
    )
    .map_err(|e| Failure::runtime(e.to_string()))?;
    let socket = state.join("topod.sock");
    let log = std::fs::File::create(state.join("topod.log"))
        .map_err(|e| Failure::runtime(e.to_string()))?;
    let child = Command::new(&topod)
        .arg("--config")
        .arg(&config)
        .arg("--socket")
        .arg(&socket)
        .arg("--state-dir")
        .arg(&state)
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .map_err(|e| Failure::runtime(format!("starting {}: {e}", topod.display())))?;
    let started = Instant::now();
    let topod = Topod { process: Children(vec![child]), socket, subtree };
    while Client::connect(&topod.socket).is_err() {
        if started.elapsed() > Duration::from_secs(20) {
            return Err(Failure::runtime(format!(
                "topod {name} did not open its socket within 20 s (see {})",
                state.join("topod.log").display()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(topod)
}

fn busy(cpu: u32) -> Result<Child, Failure> {
    let child = Command::new("sh")
        .args(["-c", "while :; do :; done"])
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| Failure::runtime(e.to_string()))?;
    let mut one = nix::sched::CpuSet::new();
    let _ = one.set(cpu as usize);
    let _ = nix::sched::sched_setaffinity(Pid::from_raw(child.id() as i32), &one);
    Ok(child)
}

fn idle() -> Result<Child, Failure> {
    Command::new("sleep").arg("100000").spawn().map_err(|e| Failure::runtime(e.to_string()))
}

/// Nanoseconds the process has spent on a CPU.
fn on_cpu_ns(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|n| n.parse().ok()))
        .unwrap_or(0)
}

fn seconds_since_epoch() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64()
}

/// Sleeps until `offset` seconds after the next multiple of `slice` seconds since the epoch.
fn sleep_past_boundary(slice: u64, offset: f64) {
    let now = seconds_since_epoch();
    let next = ((now / slice as f64).floor() + 1.0) * slice as f64 + offset;
    std::thread::sleep(Duration::from_secs_f64((next - now).max(0.0)));
}

fn gang_status(socket: &Path) -> Result<topo_core::proto::reply::GangStatus, Failure> {
    let free: topo_core::proto::reply::FreeMap = call(
        &mut Client::connect(socket).map_err(|e| Failure::runtime(e.to_string()))?,
        Op::FreeMap,
    )?;
    free.gang.ok_or_else(|| Failure::runtime("topod answered without its gang status"))
}

fn allocate(socket: &Path, job: &str, row: u32, cpu: u32, pid: u32) -> Result<(), Failure> {
    let mut c = Client::connect(socket).map_err(|e| Failure::runtime(e.to_string()))?;
    c.call(Op::Allocate(AllocateArgs {
        cpus: Some(cpu.to_string()),
        gang: Some(true),
        gang_row: Some(row),
        join_pid: Some(pid as i32),
        ..AllocateArgs::new(job, "affinity[thread*1]")
    }))
    .map_err(|e| Failure::runtime(format!("allocate {job}: {e}")))?;
    Ok(())
}

/// One slice length's figures.
#[derive(Debug, Serialize)]
struct SliceFigures {
    slice_s: u64,
    window_s: f64,
    switches: u64,
    /// CPU time the two gang jobs missed over the window, less the baseline, ms (below zero:
    /// less than the baseline's noise).
    lost_ms: f64,
    lost_per_switch_us: f64,
    lost_per_second_us: f64,
    /// What one busy process alone on the CPU missed over the same length, ms.
    baseline_lost_ms: f64,
    /// topod's own time to freeze and thaw at the last switch, µs.
    switch_us: u64,
    /// |A's switch − B's switch| at the same boundary, ms: median and largest.
    skew_median_ms: f64,
    skew_max_ms: f64,
    /// Switch time − k·T, ms: median and largest, both topods.
    late_median_ms: f64,
    late_max_ms: f64,
    boundaries: usize,
}

fn median_and_max(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v.get(v.len() / 2).copied().unwrap_or(0.0), v.last().copied().unwrap_or(0.0))
}

/// The CPUs this process may use, and the one the measuring thread keeps to.
struct Affinity {
    all: nix::sched::CpuSet,
    mine: nix::sched::CpuSet,
}

impl Affinity {
    /// Starts a topod with every CPU this process may use (it reads its CPUs from its own
    /// affinity), then goes back to the measuring CPU.
    fn start_topod(&self, dir: &Path, name: &str, slice: u64) -> Result<Topod, Failure> {
        let _ = nix::sched::sched_setaffinity(Pid::from_raw(0), &self.all);
        let topod = start_topod(dir, name, slice);
        let _ = nix::sched::sched_setaffinity(Pid::from_raw(0), &self.mine);
        topod
    }
}

fn measure(
    slice: u64,
    slices: u32,
    job_cpu: u32,
    dir: &Path,
    affinity: &Affinity,
) -> Result<SliceFigures, Failure> {
    let window = Duration::from_secs(slice * u64::from(slices));
    // The baseline: one busy process alone on the jobs' CPU for the window's length.
    let alone = Children(vec![busy(job_cpu)?]);
    std::thread::sleep(Duration::from_millis(200));
    let pid = alone.0[0].id();
    let (t0, c0) = (Instant::now(), on_cpu_ns(pid));
    std::thread::sleep(window);
    let baseline_lost = t0.elapsed().as_nanos() as f64 - (on_cpu_ns(pid) - c0) as f64;
    drop(alone);

    let a = affinity.start_topod(dir, "a", slice)?;
    let b = affinity.start_topod(dir, "b", slice)?;
    let workers = Children(vec![busy(job_cpu)?, busy(job_cpu)?, idle()?, idle()?]);
    allocate(&a.socket, "a0", 0, job_cpu, workers.0[0].id())?;
    allocate(&a.socket, "a1", 1, job_cpu, workers.0[1].id())?;
    allocate(&b.socket, "b0", 0, job_cpu, workers.0[2].id())?;
    allocate(&b.socket, "b1", 1, job_cpu, workers.0[3].id())?;
    let pids = [workers.0[0].id(), workers.0[1].id()];
    // From just after a boundary to just after the boundary `slices` later.
    sleep_past_boundary(slice, 0.05);
    let before = gang_status(&a.socket)?;
    let (t0, c0) = (Instant::now(), pids.iter().map(|p| on_cpu_ns(*p)).sum::<u64>());
    let mut skews = Vec::new();
    let mut lateness = Vec::new();
    for _ in 0..slices {
        // Ask both after the boundary, once each has switched.
        sleep_past_boundary(slice, (slice as f64 / 2.0).min(0.5));
        let (sa, sb) = (gang_status(&a.socket)?, gang_status(&b.socket)?);
        let at = |s: &topo_core::proto::reply::GangStatus| {
            s.last_switch_at
                .as_deref()
                .and_then(topo_core::pending::parse_utc)
                .map(|t| t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64())
        };
        if let (Some(ta), Some(tb)) = (at(&sa), at(&sb)) {
            if sa.slice == sb.slice {
                skews.push((ta - tb).abs() * 1e3);
                for t in [ta, tb] {
                    lateness.push((t - sa.slice as f64 * slice as f64) * 1e3);
                }
            }
        }
    }
    sleep_past_boundary(slice, 0.05);
    let elapsed = t0.elapsed().as_nanos() as f64;
    let used = (pids.iter().map(|p| on_cpu_ns(*p)).sum::<u64>() - c0) as f64;
    let after = gang_status(&a.socket)?;
    let switches = after.switches - before.switches;
    let baseline = baseline_lost * elapsed / window.as_nanos() as f64;
    // May come out below zero: the switches then cost less than the noise the baseline shows.
    let lost = elapsed - used - baseline;
    for job in ["a0", "a1"] {
        let _ = Client::connect(&a.socket).map(|mut c| c.call(Op::Release { job: job.into() }));
    }
    for job in ["b0", "b1"] {
        let _ = Client::connect(&b.socket).map(|mut c| c.call(Op::Release { job: job.into() }));
    }
    drop(workers);
    let (skew_median_ms, skew_max_ms) = median_and_max(skews.clone());
    let (late_median_ms, late_max_ms) = median_and_max(lateness);
    Ok(SliceFigures {
        slice_s: slice,
        window_s: elapsed / 1e9,
        switches,
        lost_ms: lost / 1e6,
        lost_per_switch_us: if switches == 0 { 0.0 } else { lost / 1e3 / switches as f64 },
        lost_per_second_us: lost / 1e3 / (elapsed / 1e9),
        baseline_lost_ms: baseline / 1e6,
        switch_us: after.last_switch_us,
        skew_median_ms,
        skew_max_ms,
        late_median_ms,
        late_max_ms,
        boundaries: skews.len(),
    })
}

/// Runs the bench for each slice length in `slices` (seconds), over `per_run` slices each.
pub(crate) fn run(slices: &[u64], per_run: u32, json: bool) -> Result<(), Failure> {
    if !nix::unistd::geteuid().is_root() {
        return Err(Failure::runtime("bench gang starts topods on real cgroups: run it as root"));
    }
    let allowed = nix::sched::sched_getaffinity(Pid::from_raw(0))
        .map_err(|e| Failure::runtime(format!("sched_getaffinity: {e}")))?;
    let cpus: Vec<u32> = (0..nix::sched::CpuSet::count() as u32)
        .filter(|c| allowed.is_set(*c as usize).unwrap_or(false))
        .collect();
    let (Some(&mine), Some(&jobs)) = (cpus.first(), cpus.last()) else {
        return Err(Failure::runtime("no CPU to run on"));
    };
    if mine == jobs {
        return Err(Failure::runtime(
            "bench gang needs two CPUs: one for the jobs, one to measure",
        ));
    }
    let mut me = nix::sched::CpuSet::new();
    let _ = me.set(mine as usize);
    let _ = nix::sched::sched_setaffinity(Pid::from_raw(0), &me);
    let affinity = Affinity { all: allowed, mine: me };
    let dir = std::env::temp_dir().join(format!("topo-bench-gang-{}", std::process::id()));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(|e| Failure::runtime(format!("{}: {e}", dir.display())))?;
    let mut all = Vec::new();
    let mut outcome = Ok(());
    for &slice in slices {
        if !json {
            eprintln!("slices of {slice} s: {per_run} slices, after a baseline as long ...");
        }
        match measure(slice, per_run, jobs, &dir, &affinity) {
            Ok(f) => all.push(f),
            Err(e) => {
                outcome = Err(e);
                break;
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    outcome?;
    if json {
        return print_json(&all);
    }
    println!("gang slicing on CPU {jobs}: two busy jobs in rows 0 and 1 (topod A), the same idle (topod B)");
    println!(
        "{:>6} {:>7} {:>8} {:>12} {:>12} {:>9} {:>8} {:>10} {:>15} {:>15}",
        "slice",
        "window",
        "switches",
        "lost/switch",
        "lost/second",
        "baseline",
        "switch",
        "boundaries",
        "skew A-B",
        "late vs k*T"
    );
    for f in &all {
        println!(
            "{:>5}s {:>6.1}s {:>8} {:>10.0}us {:>10.0}us {:>7.1}ms {:>6}us {:>10} {:>6.2}/{:<6.2}ms {:>6.2}/{:<6.2}ms",
            f.slice_s,
            f.window_s,
            f.switches,
            f.lost_per_switch_us,
            f.lost_per_second_us,
            f.baseline_lost_ms,
            f.switch_us,
            f.boundaries,
            f.skew_median_ms,
            f.skew_max_ms,
            f.late_median_ms,
            f.late_max_ms
        );
    }
    println!("lost: CPU time the two jobs missed over the window less what one busy process alone missed over as long (baseline);");
    println!("below zero: within that noise. switch: topod's freeze + thaw at the last switch. skew, late: median/largest.");
    Ok(())
}
