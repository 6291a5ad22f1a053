//! `topoctl bench freeze`: how long suspending and resuming a job takes with the kernel's
//! freezer, against stopping and continuing the same processes with signals.
//!
//! A job of N busy processes (`sh -c 'while :; do :; done'`) is made in a cgroup of its own
//! (topo's cgroup backend, in a subtree of its own that is removed at the end). Each round, in
//! turn: freeze until the kernel reports the cgroup frozen (v1 `freezer.state` reads `FROZEN`;
//! v2 `cgroup.events` says `frozen 1`, waited on through its change notification) and thaw
//! until it reports thawed; then SIGSTOP to every process until each shows state `T` in
//! `/proc/PID/stat`, and SIGCONT until none does, which is what a batch system that suspends by
//! signals (Slurm's PreemptMode=SUSPEND, LSF's and PBS's default) can observe at best. Needs root.
//!
//! As on a site where the daemons run on a CPU kept from jobs (topod's `reserved_cpus`), the
//! measuring thread runs on the first allowed CPU and the job on the others (its cpuset, and
//! each process's affinity): otherwise the 64 busy processes thawed a moment ago would starve
//! the very thread that times them, and the figure would be the scheduler's, not the freezer's.

use crate::{print_json, Failure};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use topo_core::CpuSet;
use topod::cgroup::fs::Files;
use topod::cgroup::v2::{v2_mount, V2};
use topod::cgroup::{CgroupBackend, CgroupSpec, JobId, Kind, MOUNTS};

/// Median and 99th percentile, microseconds.
#[derive(Debug, Clone, Serialize)]
struct Figures {
    median_us: f64,
    p99_us: f64,
}

fn figures(mut samples: Vec<Duration>) -> Figures {
    samples.sort();
    let at = |q: f64| {
        let i = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len().max(1)) - 1;
        samples.get(i).map_or(0.0, |d| d.as_secs_f64() * 1e6)
    };
    Figures { median_us: at(0.5), p99_us: at(0.99) }
}

#[derive(Debug, Serialize)]
struct Report {
    backend: String,
    processes: usize,
    job_cpus: String,
    timed_on: usize,
    rounds: usize,
    freeze: Figures,
    thaw: Figures,
    freeze_and_thaw: Figures,
    sigstop: Figures,
    sigcont: Figures,
    sigstop_and_sigcont: Figures,
}

/// The job's busy processes, killed when dropped.
struct Busy(Vec<Child>);

impl Drop for Busy {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = kill(Pid::from_raw(c.id() as i32), Signal::SIGCONT);
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn state_of(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')').next()?.split_whitespace().next()?.chars().next()
}

fn wait_states(pids: &[u32], stopped: bool, timeout: Duration) -> Result<(), Failure> {
    let start = Instant::now();
    while !pids.iter().all(|&p| (state_of(p) == Some('T')) == stopped) {
        if start.elapsed() > timeout {
            return Err(Failure::runtime(format!(
                "the processes did not all {} within {timeout:?}",
                if stopped { "stop" } else { "continue" }
            )));
        }
        std::hint::spin_loop();
    }
    Ok(())
}

fn signal_all(pids: &[u32], sig: Signal) {
    for &p in pids {
        let _ = kill(Pid::from_raw(p as i32), sig);
    }
}

pub(crate) fn run(
    processes: usize,
    rounds: usize,
    v2_freezer: bool,
    json: bool,
) -> Result<(), Failure> {
    if !nix::unistd::geteuid().is_root() {
        return Err(Failure::input(
            "bench freeze makes cgroups and freezes processes: run it as root",
        ));
    }
    let mounts = std::fs::read_to_string(MOUNTS)
        .map_err(|e| Failure::runtime(format!("reading {MOUNTS}: {e}")))?;
    let subtree = format!("topo-bench-freeze-{}", std::process::id());
    let job = JobId::parse("bench").map_err(|e| Failure::runtime(e.to_string()))?;
    // The measuring thread on the first CPU this process may use, the job on the rest.
    let allowed = nix::sched::sched_getaffinity(Pid::from_raw(0))
        .map_err(|e| Failure::runtime(format!("sched_getaffinity: {e}")))?;
    let cpus: Vec<usize> =
        (0..nix::sched::CpuSet::count()).filter(|&c| allowed.is_set(c).unwrap_or(false)).collect();
    let (own, job_cpus) = match cpus.as_slice() {
        [first, rest @ ..] if !rest.is_empty() => {
            (*first, rest.iter().map(|&c| c as u32).collect::<CpuSet>())
        }
        _ => {
            return Err(Failure::runtime(
                "bench freeze needs two CPUs: one to time on, the others for the job",
            ))
        }
    };
    let mut mine = nix::sched::CpuSet::new();
    let _ = mine.set(own);
    nix::sched::sched_setaffinity(Pid::from_raw(0), &mine)
        .map_err(|e| Failure::runtime(format!("sched_setaffinity: {e}")))?;
    // The backend topod would use here; or, with --v2-freezer, a v2 cgroup (on a hybrid host the
    // v2 mount has freeze and events without cpuset, which freezing does not need).
    let (backend, label, roots): (Box<dyn CgroupBackend>, String, Vec<PathBuf>) = if v2_freezer {
        let mount = v2_mount(&mounts)
            .ok_or_else(|| Failure::runtime("no cgroup v2 hierarchy is mounted"))?;
        let root = mount.join(&subtree);
        let v2 = V2::new(root.clone()).map_err(|e| Failure::runtime(e.to_string()))?;
        std::fs::create_dir(root.join(job.as_str()))
            .map_err(|e| Failure::runtime(format!("{}: {e}", root.display())))?;
        (Box::new(v2), "v2 cgroup.freeze".into(), vec![root])
    } else {
        let kind = Kind::auto(&Files::default(), &mounts);
        let backend = kind
            .open(
                Files::default(),
                &mounts,
                &subtree,
                &CpuSet::new(),
                &CpuSet::new(),
                Default::default(),
            )
            .map_err(|e| Failure::runtime(format!("the {kind:?} cgroup backend: {e}")))?;
        let root = kind.subtree_dir(&mounts, &subtree);
        let all = std::fs::read_to_string(
            root.as_ref().map(|r| r.join("cpuset.cpus")).unwrap_or_default(),
        )
        .or_else(|_| {
            std::fs::read_to_string(
                root.as_ref().map(|r| r.join("cpuset.cpus.effective")).unwrap_or_default(),
            )
        })
        .unwrap_or_default();
        let mems = std::fs::read_to_string(
            root.as_ref().map(|r| r.join("cpuset.mems")).unwrap_or_default(),
        )
        .or_else(|_| {
            std::fs::read_to_string(
                root.as_ref().map(|r| r.join("cpuset.mems.effective")).unwrap_or_default(),
            )
        })
        .unwrap_or_default();
        let spec = CgroupSpec {
            cpus: CpuSet::parse_list(all.trim()).unwrap_or_default().intersection(&job_cpus),
            mems: CpuSet::parse_list(mems.trim()).unwrap_or_default(),
            memory_limit: None,
            ..Default::default()
        };
        backend.create(&job, &spec).map_err(|e| Failure::runtime(e.to_string()))?;
        let label = match kind {
            Kind::V1 => "v1 freezer.state",
            Kind::V2 => "v2 cgroup.freeze",
            Kind::Fake => "fake",
        };
        let roots = subtree_roots(&mounts, &subtree);
        (backend, label.into(), roots)
    };
    let result = measure(&*backend, &job, &label, processes, rounds, &job_cpus);
    let _ = backend.release(&job, Duration::from_secs(10));
    for root in &roots {
        let _ = std::fs::remove_dir(root);
    }
    let mut report = result?;
    report.timed_on = own;
    if json {
        return print_json(&report);
    }
    println!(
        "{} busy processes in one job on CPUs {}, {} rounds, backend {}, timed from CPU {} (until the kernel reports it)",
        report.processes, report.job_cpus, report.rounds, report.backend, report.timed_on
    );
    println!("{:<34} {:>10} {:>10}", "", "median", "p99");
    let row = |name: &str, f: &Figures| {
        println!("{name:<34} {:>7.2} ms {:>7.2} ms", f.median_us / 1e3, f.p99_us / 1e3)
    };
    row("freeze (whole cgroup frozen)", &report.freeze);
    row("thaw", &report.thaw);
    row("freeze + thaw", &report.freeze_and_thaw);
    row("SIGSTOP (every process in T)", &report.sigstop);
    row("SIGCONT (no process in T)", &report.sigcont);
    row("SIGSTOP + SIGCONT", &report.sigstop_and_sigcont);
    Ok(())
}

/// The subtree's directory in every cgroup hierarchy that has it, deepest first.
fn subtree_roots(mounts: &str, subtree: &str) -> Vec<PathBuf> {
    let (cpuset, freezer, memory) = topod::cgroup::v1::v1_mounts(mounts);
    [cpuset, freezer, memory, v2_mount(mounts).map(|m| m.join(format!("{subtree}.slice")))]
        .into_iter()
        .flatten()
        .map(|m| if m.ends_with(format!("{subtree}.slice")) { m } else { m.join(subtree) })
        .filter(|p| Path::new(p).is_dir())
        .collect()
}

fn measure(
    backend: &dyn CgroupBackend,
    job: &JobId,
    label: &str,
    processes: usize,
    rounds: usize,
    job_cpus: &CpuSet,
) -> Result<Report, Failure> {
    let mut affinity = nix::sched::CpuSet::new();
    for c in job_cpus.iter() {
        let _ = affinity.set(c as usize);
    }
    let mut busy = Busy(Vec::with_capacity(processes));
    for _ in 0..processes {
        let child = Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| Failure::runtime(format!("starting a busy process: {e}")))?;
        let _ = nix::sched::sched_setaffinity(Pid::from_raw(child.id() as i32), &affinity);
        backend.join(job, child.id() as i32).map_err(|e| Failure::runtime(e.to_string()))?;
        busy.0.push(child);
    }
    let pids: Vec<u32> = busy.0.iter().map(Child::id).collect();
    let timeout = Duration::from_secs(10);
    // Before each timed operation the job runs undisturbed for a while, as a job between two
    // suspensions does (processes just continued by SIGCONT freeze more slowly, and the other
    // way round).
    let settle = Duration::from_millis(50);
    let (mut freeze, mut thaw, mut both) = (Vec::new(), Vec::new(), Vec::new());
    let (mut stop, mut cont, mut signals) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t0 = Instant::now();
        backend.freeze(job, timeout).map_err(|e| Failure::runtime(e.to_string()))?;
        let t1 = Instant::now();
        backend.thaw(job, timeout).map_err(|e| Failure::runtime(e.to_string()))?;
        let t2 = Instant::now();
        freeze.push(t1 - t0);
        thaw.push(t2 - t1);
        both.push(t2 - t0);
        std::thread::sleep(settle);
        let t0 = Instant::now();
        signal_all(&pids, Signal::SIGSTOP);
        wait_states(&pids, true, timeout)?;
        let t1 = Instant::now();
        signal_all(&pids, Signal::SIGCONT);
        wait_states(&pids, false, timeout)?;
        let t2 = Instant::now();
        stop.push(t1 - t0);
        cont.push(t2 - t1);
        signals.push(t2 - t0);
        std::thread::sleep(settle);
    }
    Ok(Report {
        backend: label.to_string(),
        processes,
        job_cpus: job_cpus.to_string(),
        timed_on: 0,
        rounds,
        freeze: figures(freeze),
        thaw: figures(thaw),
        freeze_and_thaw: figures(both),
        sigstop: figures(stop),
        sigcont: figures(cont),
        sigstop_and_sigcont: figures(signals),
    })
}
