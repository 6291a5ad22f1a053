//! `topoctl bench resize`: how long a running malleable job takes to shrink and expand, against
//! a running topod (issue 18's target: at most 10 ms median from the request to the job running
//! on its new CPUs; Charm++'s shrink of 128 to 64 processors took 86 ms).
//!
//! The job is the real malleable program (tests/malleable/malleable.c, built by
//! tests/malleable/build.sh) with a fixed number of spinning worker threads (64 by default),
//! started by `topo-exec` with the request `affinity[UNIT*MIN-MAX]` and a resize signal, so it
//! starts with MAX tasks. Each round resizes it to MIN tasks (shrink), then back to MAX
//! (expand). Each resize is timed from the moment the `resize` request is sent to:
//!
//! - the reply: topod has rewritten the job's cgroup, its record and its notify file, and sent
//!   the signal;
//! - the threads moved: every thread of the program (workers, main, control) is allowed exactly
//!   the new CPUs, polled with `sched_getaffinity` on each thread (the kernel's
//!   `Cpus_allowed_list`, which is checked too, from `/proc/PID/task/*/status`, after every
//!   resize); the kernel moves them while topod writes the cgroup, so this is usually earlier
//!   than the reply;
//! - the program's own line for the new generation: its control thread has woken on the notify
//!   file (libtopo's `topo_resize_wait`), seen the signal, and found every one of its threads on
//!   exactly the new CPUs (`on_new_cpus=yes`).
//!
//! The job runs in a session of its own, as a batch system starts jobs. Where the kernel groups
//! each session's threads for the CPU scheduler (`kernel.sched_autogroup_enabled`, on by
//! default), the job's spinning workers then share the CPUs as one group against topod and the
//! timing threads, as under a site's cpu controller (topod's systemd unit and the batch
//! system's job cgroups); run topod in a session of its own too (systemd does; by hand:
//! `setsid topod ...`). Without that the timings measure how long topod waits among the job's
//! workers for a CPU. The job is released (topod kills the program) and the program killed
//! when the bench ends, also on a failure.

use crate::{print_json, Failure};
use clap::Args;
use nix::unistd::Pid;
use serde::Serialize;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use topo_client::Client;
use topo_core::ledger::Allocation;
use topo_core::proto::Op;
use topo_core::CpuSet;

/// How long one resize may take to reach the program before the bench gives up.
const PATIENCE: Duration = Duration::from_secs(10);

/// `topoctl bench resize`'s options.
#[derive(Debug, Args)]
pub(crate) struct ResizeOpts {
    /// topod's socket.
    #[arg(long, value_name = "PATH", default_value = topo_core::proto::DEFAULT_SOCKET)]
    socket: PathBuf,
    /// The malleable test program (`tests/malleable/build.sh DIR` builds DIR/malleable).
    #[arg(long, value_name = "PATH")]
    program: PathBuf,
    /// The program's worker threads, whatever its CPUs.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    threads: u32,
    /// Rounds (each: one shrink and one expand).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    rounds: u32,
    /// What one task is: thread, core, numa, ... (the request's PU type).
    #[arg(long, default_value = "thread")]
    unit: String,
    /// Tasks when shrunk.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    min: u32,
    /// Tasks when expanded [default with --unit thread: every CPU no job holds].
    #[arg(long)]
    max: Option<u32>,
    /// The signal topod sends the job after each resize (the program counts it).
    #[arg(long, default_value_t = 10)]
    signal: i32,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Median and 95th percentile of one measure, milliseconds.
#[derive(Debug, Clone, Serialize)]
struct Figures {
    median_ms: f64,
    p95_ms: f64,
    max_ms: f64,
}

/// The three times of one direction (shrink or expand).
#[derive(Debug, Clone, Serialize)]
struct Direction {
    /// To topod's reply.
    reply: Figures,
    /// To every thread allowed exactly the new CPUs.
    threads_moved: Figures,
    /// To the program's line for the new generation (`on_new_cpus=yes`).
    program_logged: Figures,
}

#[derive(Debug, Serialize)]
struct Report {
    request: String,
    cgroup: String,
    threads: u32,
    rounds: u32,
    expanded_cpus: String,
    shrunk_cpus: String,
    shrink: Direction,
    expand: Direction,
}

/// One resize's times from its request.
#[derive(Debug, Clone, Copy)]
struct Sample {
    reply: Duration,
    threads_moved: Duration,
    program_logged: Duration,
}

/// The nearest-rank quantile `q` of `samples` (sorted here).
fn figures(samples: &mut [Duration]) -> Figures {
    samples.sort();
    let at = |q: f64| {
        let i = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len().max(1)) - 1;
        samples.get(i).map_or(0.0, |d| d.as_secs_f64() * 1e3)
    };
    Figures { median_ms: at(0.5), p95_ms: at(0.95), max_ms: at(1.0) }
}

fn direction(samples: &[Sample]) -> Direction {
    let pick = |f: fn(&Sample) -> Duration| {
        let mut v: Vec<Duration> = samples.iter().map(f).collect();
        figures(&mut v)
    };
    Direction {
        reply: pick(|s| s.reply),
        threads_moved: pick(|s| s.threads_moved),
        program_logged: pick(|s| s.program_logged),
    }
}

/// The bench's job: the program started by topo-exec. Dropping it releases the job (topod kills
/// the program) and kills the program itself in case the release could not.
struct Job {
    child: Child,
    socket: PathBuf,
    id: String,
    dir: PathBuf,
}

impl Drop for Job {
    fn drop(&mut self) {
        if let Ok(mut c) = Client::connect(&self.socket) {
            let _ = c.call(Op::Release { job: self.id.clone() });
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Job {
    fn log(&self) -> PathBuf {
        self.dir.join("malleable.log")
    }

    /// What the program (or topo-exec before it) said on stderr, for a failure's message.
    fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.join("stderr")).unwrap_or_default().trim().to_string()
    }

    /// Fails if the program has ended.
    fn check_alive(&mut self) -> Result<(), Failure> {
        match self.child.try_wait() {
            Ok(Some(status)) => Err(Failure::runtime(format!(
                "the malleable program ended ({status}): {}",
                self.stderr()
            ))),
            _ => Ok(()),
        }
    }
}

/// The program's log, read as it grows.
struct LogTail {
    path: PathBuf,
    offset: u64,
    partial: String,
}

impl LogTail {
    /// The whole lines written since the last call.
    fn new_lines(&mut self) -> Vec<String> {
        let Ok(mut f) = std::fs::File::open(&self.path) else { return Vec::new() };
        if f.seek(SeekFrom::Start(self.offset)).is_err() {
            return Vec::new();
        }
        let mut text = String::new();
        let Ok(n) = f.read_to_string(&mut text) else { return Vec::new() };
        self.offset += n as u64;
        self.partial.push_str(&text);
        let mut lines: Vec<String> = self.partial.split('\n').map(str::to_string).collect();
        self.partial = lines.pop().unwrap_or_default();
        lines
    }
}

/// The value of `key=` in one of the program's lines.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// The thread ids of process `pid`.
fn threads_of(pid: u32) -> Result<Vec<Pid>, Failure> {
    let dir = format!("/proc/{pid}/task");
    let entries =
        std::fs::read_dir(&dir).map_err(|e| Failure::runtime(format!("reading {dir}: {e}")))?;
    Ok(entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .map(Pid::from_raw)
        .collect())
}

/// Whether every thread in `tids` is allowed exactly `want` (one `sched_getaffinity` each).
fn all_on(tids: &[Pid], want: &nix::sched::CpuSet) -> Result<bool, Failure> {
    for &tid in tids {
        let got = nix::sched::sched_getaffinity(tid)
            .map_err(|e| Failure::runtime(format!("sched_getaffinity of thread {tid}: {e}")))?;
        if got != *want {
            return Ok(false);
        }
    }
    Ok(true)
}

fn kernel_set(cpus: &CpuSet) -> Result<nix::sched::CpuSet, Failure> {
    let mut set = nix::sched::CpuSet::new();
    for c in cpus.iter() {
        set.set(c as usize).map_err(|e| Failure::runtime(format!("CPU {c}: {e}")))?;
    }
    Ok(set)
}

/// Checks, from `/proc/PID/task/*/status`, that each of `pid`'s threads is allowed `cpus`.
fn check_status_files(pid: u32, cpus: &CpuSet) -> Result<(), Failure> {
    for tid in threads_of(pid)? {
        let path = format!("/proc/{pid}/task/{tid}/status");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| Failure::runtime(format!("reading {path}: {e}")))?;
        let allowed = text
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .and_then(|v| CpuSet::parse_list(v.trim()).ok());
        if allowed.as_ref() != Some(cpus) {
            return Err(Failure::runtime(format!(
                "thread {tid} is allowed {allowed:?}, not the job's CPUs {cpus}"
            )));
        }
    }
    Ok(())
}

/// What the watching thread saw of one resize, and when.
#[derive(Default)]
struct Seen {
    /// Every thread on one same new set of CPUs: when, and the set.
    moved: Option<(Instant, nix::sched::CpuSet)>,
    /// The program's line for the new generation: when, and the line.
    logged: Option<(Instant, String)>,
}

/// Watches the program's threads and log until every thread has left `before` for one same
/// set and the program has written its line for `generation` (or `abort` is set, or
/// [`PATIENCE`] has passed). The new CPUs are not known before topod's reply, hence "one same
/// set", checked against the reply afterwards.
fn watch(
    tids: &[Pid],
    log: &mut LogTail,
    before: &nix::sched::CpuSet,
    generation: u64,
    abort: &AtomicBool,
) -> Result<Seen, Failure> {
    let wanted = generation.to_string();
    let started = Instant::now();
    let mut seen = Seen::default();
    while !abort.load(Ordering::Relaxed) && started.elapsed() < PATIENCE {
        if seen.moved.is_none() {
            let first = nix::sched::sched_getaffinity(tids[0]).map_err(|e| {
                Failure::runtime(format!("sched_getaffinity of thread {}: {e}", tids[0]))
            })?;
            if first != *before && all_on(tids, &first)? {
                seen.moved = Some((Instant::now(), first));
            }
        }
        if seen.logged.is_none() {
            let lines = log.new_lines();
            let now = Instant::now();
            if let Some(line) = lines.into_iter().find(|l| {
                field(l, "generation") == Some(wanted.as_str()) || l.starts_with("error=")
            }) {
                seen.logged = Some((now, line));
            }
        }
        if seen.moved.is_some() && seen.logged.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    Ok(seen)
}

/// One resize of `job` to `tasks` from CPUs `before`, timed from the request: see the module
/// documentation. `generation` is the notify file's generation it should bring.
fn timed_resize(
    client: &mut Client,
    job: &mut Job,
    tids: &[Pid],
    log: &mut LogTail,
    tasks: u32,
    generation: u64,
    before: &CpuSet,
) -> Result<(Allocation, Sample), Failure> {
    let before = kernel_set(before)?;
    let id = job.id.clone();
    let abort = AtomicBool::new(false);
    // The watching thread starts before the clock does.
    let (t0, reply, reply_at, seen) = std::thread::scope(|s| {
        let watcher = s.spawn(|| watch(tids, log, &before, generation, &abort));
        let t0 = Instant::now();
        let reply = client.call_as::<Allocation>(Op::Resize { job: id.clone(), tasks });
        let reply_at = t0.elapsed();
        if reply.is_err() {
            abort.store(true, Ordering::Relaxed);
        }
        let seen = watcher.join().unwrap_or_else(|_| Err(Failure::runtime("watcher panicked")));
        (t0, reply, reply_at, seen)
    });
    let alloc = reply.map_err(|e| Failure::runtime(format!("resize {id} to {tasks}: {e}")))?;
    let seen = seen?;
    let want = kernel_set(&alloc.cpus)?;
    let threads_moved = match seen.moved {
        Some((at, set)) if set == want => at.saturating_duration_since(t0),
        Some((_, set)) => {
            return Err(Failure::runtime(format!(
                "the program's threads went to {set:?}, not the job's new CPUs {}",
                alloc.cpus
            )))
        }
        None => {
            return Err(Failure::runtime(format!(
                "the program's threads were not all moved to CPUs {} within {PATIENCE:?} (does topod run on real cgroups?)",
                alloc.cpus
            )))
        }
    };
    let program_logged = match seen.logged {
        Some((at, line)) => {
            let cpus = field(&line, "cpus").and_then(|c| CpuSet::parse_list(c).ok());
            if cpus.as_ref() != Some(&alloc.cpus) || field(&line, "on_new_cpus") != Some("yes") {
                return Err(Failure::runtime(format!(
                    "the program's line for generation {generation} does not say CPUs {} with every thread on them: {line}",
                    alloc.cpus
                )));
            }
            at.saturating_duration_since(t0)
        }
        None => {
            job.check_alive()?;
            return Err(Failure::runtime(format!(
                "the program wrote no line for generation {generation} within {PATIENCE:?}"
            )));
        }
    };
    check_status_files(job.child.id(), &alloc.cpus)?;
    Ok((alloc, Sample { reply: reply_at, threads_moved, program_logged }))
}

/// Runs the bench (see the module documentation).
pub(crate) fn run(opts: ResizeOpts) -> Result<(), Failure> {
    let connect = || Client::connect(&opts.socket).map_err(|e| Failure::runtime(e.to_string()));
    let mut client = connect()?;
    let version = client.version().map_err(|e| Failure::runtime(e.to_string()))?;
    let free = client.free_map().map_err(|e| Failure::runtime(e.to_string()))?;
    let max = match opts.max {
        Some(max) => max,
        None if opts.unit == "thread" => {
            free.allocatable.difference(&free.held).difference(&free.fenced).len() as u32
        }
        None => return Err(Failure::input("give --max: the tasks of the expanded job")),
    };
    if max <= opts.min {
        return Err(Failure::input(format!(
            "--max {max} must be more than --min {} (this host has {} free CPUs)",
            opts.min,
            free.allocatable.difference(&free.held).len()
        )));
    }
    if !opts.program.is_file() {
        return Err(Failure::input(format!(
            "no program at {}: build it with tests/malleable/build.sh DIR (after cargo build -p topo-capi)",
            opts.program.display()
        )));
    }
    let request = format!("affinity[{}*{}-{max}]", opts.unit, opts.min);
    let id = format!("bench-resize-{}", std::process::id());
    let dir = std::env::temp_dir().join(format!("topo-{id}"));
    std::fs::create_dir_all(&dir)
        .map_err(|e| Failure::runtime(format!("creating {}: {e}", dir.display())))?;
    let stderr = std::fs::File::create(dir.join("stderr"))
        .map_err(|e| Failure::runtime(format!("creating {}: {e}", dir.display())))?;
    let topo_exec = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("topo-exec")))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("topo-exec"));
    let signal = opts.signal.to_string();
    let log_path = dir.join("malleable.log");
    let mut command = Command::new(&topo_exec);
    // SAFETY: setsid is async-signal-safe and touches no memory of this process.
    unsafe {
        command.pre_exec(|| nix::unistd::setsid().map(drop).map_err(std::io::Error::from));
    }
    let child = command
        .arg("--socket")
        .arg(&opts.socket)
        .args(["--job", &id, "--request", &request, "--resize-signal", &signal, "--"])
        .arg(&opts.program)
        .args(["--signal", &signal])
        .arg(&log_path)
        .arg(opts.threads.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .map_err(|e| {
            let _ = std::fs::remove_dir_all(&dir);
            Failure::runtime(format!("running {}: {e}", topo_exec.display()))
        })?;
    let mut job = Job { child, socket: opts.socket.clone(), id: id.clone(), dir };
    let mut log = LogTail { path: job.log(), offset: 0, partial: String::new() };

    // The program's first line: its start, on the CPUs of its most tasks.
    let started = Instant::now();
    let first = loop {
        if let Some(line) = log.new_lines().into_iter().next() {
            break line;
        }
        job.check_alive()?;
        if started.elapsed() > PATIENCE {
            return Err(Failure::runtime("the malleable program did not start"));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut generation: u64 = field(&first, "generation")
        .and_then(|g| g.parse().ok())
        .ok_or_else(|| Failure::runtime(format!("the program's first line: {first}")))?;
    let jobs = client.list().map_err(|e| Failure::runtime(e.to_string()))?;
    let expanded = jobs
        .into_iter()
        .find(|j| j.allocation.job == id)
        .map(|j| j.allocation)
        .ok_or_else(|| Failure::runtime(format!("topod does not list job {id}")))?;
    if expanded.tasks.len() != max as usize {
        return Err(Failure::runtime(format!(
            "job {id} started with {} tasks, not {max}: other jobs hold CPUs",
            expanded.tasks.len()
        )));
    }
    // The control thread starts just after the first line.
    let tids = loop {
        let tids = threads_of(job.child.id())?;
        if tids.len() == opts.threads as usize + 2 {
            break tids;
        }
        if started.elapsed() > PATIENCE {
            return Err(Failure::runtime(format!(
                "the program has {} threads, not {} workers, main and control",
                tids.len(),
                opts.threads
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let (mut shrinks, mut expands) = (Vec::new(), Vec::new());
    let mut current = expanded.cpus.clone();
    let mut shrunk_cpus = CpuSet::new();
    // Each resize lets the job run undisturbed a moment first, as between real resizes.
    let settle = Duration::from_millis(20);
    for _ in 0..opts.rounds {
        for (tasks, samples) in [(opts.min, &mut shrinks), (max, &mut expands)] {
            std::thread::sleep(settle);
            generation += 1;
            let (alloc, sample) =
                timed_resize(&mut client, &mut job, &tids, &mut log, tasks, generation, &current)?;
            if tasks == opts.min {
                shrunk_cpus = alloc.cpus.clone();
            }
            current = alloc.cpus;
            samples.push(sample);
        }
    }
    let report = Report {
        request,
        cgroup: version.cgroup,
        threads: opts.threads,
        rounds: opts.rounds,
        expanded_cpus: expanded.cpus.to_string(),
        shrunk_cpus: shrunk_cpus.to_string(),
        shrink: direction(&shrinks),
        expand: direction(&expands),
    };
    drop(job);
    if opts.json {
        return print_json(&report);
    }
    print_report(&report, &opts.socket);
    Ok(())
}

fn print_report(r: &Report, socket: &Path) {
    println!(
        "job {} with {} spinning threads, topod at {} ({} cgroups): {} rounds of shrink to CPUs {} and expand to CPUs {}",
        r.request,
        r.threads,
        socket.display(),
        r.cgroup,
        r.rounds,
        r.shrunk_cpus,
        r.expanded_cpus
    );
    println!("{:<44} {:>10} {:>10} {:>10}", "from the resize request to", "median", "p95", "max");
    for (name, d) in [("shrink", &r.shrink), ("expand", &r.expand)] {
        for (what, f) in [
            ("topod's reply", &d.reply),
            ("every thread on the new CPUs", &d.threads_moved),
            ("the program's line (on_new_cpus=yes)", &d.program_logged),
        ] {
            println!(
                "{:<44} {:>7.2} ms {:>7.2} ms {:>7.2} ms",
                format!("{name}: {what}"),
                f.median_ms,
                f.p95_ms,
                f.max_ms
            );
        }
    }
}
