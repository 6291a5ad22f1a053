//! Metrics (Prometheus text exposition format) and mis-sized jobs.
//!
//! What topod counts as it serves ([`Metrics`]: allocations, refusals by reason, request
//! latency, releases and the processes they had to kill) and what a sampler reads from the
//! kernel about each running job every `metrics_interval_s` ([`JobUsage`], through the
//! [`UsageReader`] trait: [`KernelUsage`] reads the job's cgroup files and `/proc`, the tests'
//! [`FakeUsage`] answers what it is told). From the samples, [`Sizer`] (pure: figures and a
//! clock in, a verdict out) flags a job whose threads keep more CPUs busy than it was given, or
//! that leaves most of them idle, once it has run past its settling time. [`render`] writes it
//! all as one scrape.
//!
//! Where the figures come from:
//! - CPU time: v2 `cpu.stat` `usage_usec` of the job's cgroup; v1 (topod makes no cpuacct group
//!   for a job) the sum over the job's processes of `/proc/PID/stat` utime, stime, cutime and
//!   cstime (the time of their exited threads and of the children they reaped counts; a
//!   process that exits unreaped by another of the job takes its time with it).
//! - Threads runnable: the threads in state `R` (running or waiting for a CPU) of the job's
//!   processes, from `/proc/PID/task/TID/stat`, on both.
//! - Pressure: v2 `cpu.pressure` and `memory.pressure` (PSI) of the job's cgroup. v1 has no
//!   per-cgroup PSI; the closest is the cpuset's `cpuset.memory_pressure` (a rate of direct
//!   reclaim), given only when the root's `cpuset.memory_pressure_enabled` is 1 (topod does not
//!   switch it on); CPU pressure on v1 is the runnable threads against the CPUs given.

use super::host::Snapshot;
use crate::cgroup::{CgroupBackend, JobId};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use topo_core::ledger::{JobState, Missized, MissizedKind};

/// The request latency histogram's bucket bounds, in seconds.
pub const LATENCY_BUCKETS: [f64; 11] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0, 5.0];

#[derive(Debug, Clone, Default)]
struct Histogram {
    buckets: [u64; LATENCY_BUCKETS.len()],
    count: u64,
    sum: f64,
}

/// What topod counts, and the last sample of every running job.
#[derive(Debug, Default)]
pub struct Metrics {
    counts: Mutex<Counts>,
    jobs: Mutex<BTreeMap<String, JobSample>>,
}

/// The counters, as of one moment.
#[derive(Debug, Clone, Default)]
pub struct Counts {
    allocations: u64,
    refusals: BTreeMap<(&'static str, String), u64>,
    latency: BTreeMap<&'static str, Histogram>,
    releases: u64,
    releases_with_leftovers: u64,
    leftovers_killed: u64,
    flagged: BTreeMap<&'static str, u64>,
    samples: u64,
    sample_seconds: f64,
}

/// One running job's last sample.
#[derive(Debug, Clone, PartialEq)]
pub struct JobSample {
    /// CPUs given.
    pub cpus: usize,
    /// What the kernel said.
    pub usage: JobUsage,
}

impl Metrics {
    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A job was allocated.
    pub fn allocated(&self) {
        self.counts().allocations += 1;
    }

    /// A request `op` took `seconds`; `refused` is its error code, if it failed.
    pub fn request(&self, op: &'static str, seconds: f64, refused: Option<String>) {
        let mut c = self.counts();
        let h = c.latency.entry(op).or_default();
        h.count += 1;
        h.sum += seconds;
        if let Some(i) = LATENCY_BUCKETS.iter().position(|b| seconds <= *b) {
            h.buckets[i] += 1;
        }
        if let Some(code) = refused {
            *c.refusals.entry((op, code)).or_default() += 1;
        }
    }

    /// A job was released, killing `killed` processes it had left.
    pub fn released(&self, killed: usize) {
        let mut c = self.counts();
        c.releases += 1;
        if killed > 0 {
            c.releases_with_leftovers += 1;
            c.leftovers_killed += killed as u64;
        }
    }

    /// The sampler took `seconds` over its last round, and found these jobs newly mis-sized.
    pub fn sampled(&self, seconds: f64, jobs: BTreeMap<String, JobSample>, flagged: &[Missized]) {
        {
            let mut c = self.counts();
            c.samples += 1;
            c.sample_seconds = seconds;
            for f in flagged {
                *c.flagged.entry(f.kind.as_str()).or_default() += 1;
            }
        }
        *self.jobs.lock().unwrap_or_else(|e| e.into_inner()) = jobs;
    }

    /// The counters now.
    pub fn snapshot(&self) -> (Counts, BTreeMap<String, JobSample>) {
        let counts = self.counts().clone();
        (counts, self.jobs.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }
}

/// One job's use of what it was given, as the kernel reports it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobUsage {
    /// CPU time of its processes, in seconds (see the module's notes for where from).
    pub cpu_seconds: Option<f64>,
    /// Processes in its cgroup.
    pub processes: u32,
    /// Their threads.
    pub threads: u32,
    /// Of those, running or waiting for a CPU (state `R`).
    pub runnable: u32,
    /// v2 `cpu.pressure`.
    pub cpu_pressure: Option<Pressure>,
    /// v2 `memory.pressure`.
    pub memory_pressure: Option<Pressure>,
    /// v1 `cpuset.memory_pressure`, where the kernel keeps it.
    pub cpuset_memory_pressure: Option<u64>,
}

/// A PSI file's figures.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Pressure {
    /// `some avg10`: the share (percent) of the last 10 s in which some thread waited.
    pub some_avg10: f64,
    /// `some total`, in microseconds.
    pub some_total_us: u64,
    /// `full total`, in microseconds (memory; `cpu.pressure` has it too on newer kernels).
    pub full_total_us: Option<u64>,
}

/// Reads a job's figures from the OS.
pub trait UsageReader: Send + Sync {
    /// The job's figures now; `None` when it has no cgroup (any more).
    fn read(&self, job: &JobId) -> Option<JobUsage>;
}

/// The real reader: the job's cgroup files (through the backend) and `/proc`.
pub struct KernelUsage {
    backend: Arc<dyn CgroupBackend>,
    proc_root: PathBuf,
    ticks_per_second: f64,
}

impl KernelUsage {
    /// A reader of the jobs of `backend`, with `/proc` at `proc_root`.
    pub fn new(backend: Arc<dyn CgroupBackend>, proc_root: &Path) -> KernelUsage {
        // /proc counts in USER_HZ, which is 100 on every architecture Linux runs on today.
        KernelUsage { backend, proc_root: proc_root.to_path_buf(), ticks_per_second: 100.0 }
    }
}

impl UsageReader for KernelUsage {
    fn read(&self, job: &JobId) -> Option<JobUsage> {
        let pids = self.backend.pids(job).ok()?;
        let files = self.backend.usage_files(job);
        let read = |p: &Option<PathBuf>| p.as_ref().and_then(|p| std::fs::read_to_string(p).ok());
        let mut usage = JobUsage { processes: pids.len() as u32, ..Default::default() };
        let mut ticks = 0u64;
        for pid in pids {
            let dir = self.proc_root.join(pid.to_string());
            if let Some(stat) =
                std::fs::read_to_string(dir.join("stat")).ok().and_then(|t| parse_stat(&t))
            {
                ticks += stat.ticks;
            }
            let Ok(tasks) = std::fs::read_dir(dir.join("task")) else { continue };
            for task in tasks.flatten() {
                let Some(stat) = std::fs::read_to_string(task.path().join("stat"))
                    .ok()
                    .and_then(|t| parse_stat(&t))
                else {
                    continue;
                };
                usage.threads += 1;
                if stat.state == 'R' {
                    usage.runnable += 1;
                }
            }
        }
        usage.cpu_seconds = match read(&files.cpu_stat).and_then(|t| cpu_stat_usage_usec(&t)) {
            Some(us) => Some(us as f64 / 1e6),
            None => Some(ticks as f64 / self.ticks_per_second),
        };
        usage.cpu_pressure = read(&files.cpu_pressure).and_then(|t| parse_pressure(&t));
        usage.memory_pressure = read(&files.memory_pressure).and_then(|t| parse_pressure(&t));
        usage.cpuset_memory_pressure =
            read(&files.cpuset_memory_pressure).and_then(|t| t.trim().parse().ok());
        Some(usage)
    }
}

/// A reader that answers what a test set (`None` for jobs it was not told about).
#[derive(Debug, Default)]
pub struct FakeUsage(pub Mutex<BTreeMap<String, JobUsage>>);

impl FakeUsage {
    /// Sets what `job` reads as.
    pub fn set(&self, job: &str, usage: JobUsage) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).insert(job.to_string(), usage);
    }
}

impl UsageReader for FakeUsage {
    fn read(&self, job: &JobId) -> Option<JobUsage> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).get(job.as_str()).cloned()
    }
}

/// What one `/proc/.../stat` line gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// The state letter.
    pub state: char,
    /// utime + stime + cutime + cstime, in clock ticks.
    pub ticks: u64,
}

/// Parses `/proc/PID/stat` (the command name may hold spaces and parentheses: the fields start
/// after the last `)`).
pub fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3 of the line, utime..cstime fields 14 to 17.
    let state = f.first()?.chars().next()?;
    let ticks = f.get(11..15)?.iter().map(|v| v.parse::<i64>().unwrap_or(0).max(0) as u64).sum();
    Some(Stat { state, ticks })
}

/// `usage_usec` of a v2 `cpu.stat`.
pub fn cpu_stat_usage_usec(text: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix("usage_usec ")).and_then(|v| v.trim().parse().ok())
}

/// Parses a PSI file (`some avg10=.. avg60=.. avg300=.. total=..`, and a `full` line).
pub fn parse_pressure(text: &str) -> Option<Pressure> {
    let field = |line: &str, key: &str| {
        line.split_whitespace().find_map(|kv| kv.strip_prefix(key)).map(str::to_string)
    };
    let some = text.lines().find(|l| l.starts_with("some "))?;
    let full = text.lines().find(|l| l.starts_with("full "));
    Some(Pressure {
        some_avg10: field(some, "avg10=")?.parse().ok()?,
        some_total_us: field(some, "total=")?.parse().ok()?,
        full_total_us: full.and_then(|l| field(l, "total=")?.parse().ok()),
    })
}

/// When a job is mis-sized.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SizeRules {
    /// No verdict before a job has run this long (its start-up, serial set-up, input).
    pub settle: Duration,
    /// Busy: threads runnable on average, since settling, above this many times the CPUs given.
    pub busy_ratio: f64,
    /// Idle: CPU time per second, and threads runnable, both below this share of the CPUs given.
    pub idle_fraction: f64,
}

impl Default for SizeRules {
    fn default() -> Self {
        SizeRules { settle: Duration::from_secs(300), busy_ratio: 1.25, idle_fraction: 0.5 }
    }
}

/// What the sizer keeps of one job.
#[derive(Debug, Clone)]
struct Watch {
    cpus: usize,
    first: Instant,
    /// From the first sample after settling: when, and the CPU time then.
    start: Option<(Instant, Option<f64>)>,
    samples: u32,
    runnable_sum: f64,
    flagged: bool,
}

/// Judges jobs from their samples (pure: the clock is an argument).
#[derive(Debug, Clone, Default)]
pub struct Sizer {
    rules: SizeRules,
    watches: BTreeMap<String, Watch>,
}

/// Samples after settling before a verdict.
const MIN_SAMPLES: u32 = 3;

impl Sizer {
    /// A sizer with `rules`.
    pub fn new(rules: SizeRules) -> Sizer {
        Sizer { rules, watches: BTreeMap::new() }
    }

    /// One sample of a running `job` holding `cpus` CPUs, at `now`: its flag, the first time a
    /// sample finds it mis-sized (never again for the same job).
    pub fn observe(
        &mut self,
        job: &str,
        cpus: usize,
        usage: &JobUsage,
        now: Instant,
    ) -> Option<Missized> {
        let w = self.watches.entry(job.to_string()).or_insert(Watch {
            cpus,
            first: now,
            start: None,
            samples: 0,
            runnable_sum: 0.0,
            flagged: false,
        });
        if w.cpus != cpus {
            // Given other CPUs: start again.
            *w = Watch {
                cpus,
                first: now,
                start: None,
                samples: 0,
                runnable_sum: 0.0,
                flagged: w.flagged,
            };
        }
        if w.flagged || cpus == 0 || now.duration_since(w.first) < self.rules.settle {
            return None;
        }
        let (since, cpu_then) = *w.start.get_or_insert((now, usage.cpu_seconds));
        w.samples += 1;
        w.runnable_sum += f64::from(usage.runnable);
        let elapsed = now.duration_since(since).as_secs_f64();
        if w.samples < MIN_SAMPLES || elapsed <= 0.0 {
            return None;
        }
        let runnable = w.runnable_sum / f64::from(w.samples);
        let rate = match (cpu_then, usage.cpu_seconds) {
            // A counter that went back (processes left unreaped): no rate this time.
            (Some(a), Some(b)) if b >= a => Some((b - a) / elapsed),
            _ => None,
        };
        let given = cpus as f64;
        let pressure = usage
            .cpu_pressure
            .as_ref()
            .map(|p| format!(", CPU pressure {:.0} % (some, 10 s)", p.some_avg10))
            .unwrap_or_default();
        let used = rate.map(|r| format!("; {r:.2} CPUs' worth of time used")).unwrap_or_default();
        let plural = if cpus == 1 { "" } else { "s" };
        let verdict = if runnable > self.rules.busy_ratio * given {
            Some(Missized {
                kind: MissizedKind::Busy,
                reason: format!(
                    "busy: {runnable:.1} threads runnable on average for {cpus} CPU{plural} given{used}{pressure}, over {elapsed:.0} s after settling"
                ),
            })
        } else if runnable < self.rules.idle_fraction * given
            && rate.is_none_or(|r| r < self.rules.idle_fraction * given)
        {
            let share =
                rate.map(|r| format!(" ({:.0} % of them)", 100.0 * r / given)).unwrap_or_default();
            Some(Missized {
                kind: MissizedKind::Idle,
                reason: format!(
                    "idle: {runnable:.1} threads runnable on average for {cpus} CPU{plural} given{used}{share}, over {elapsed:.0} s after settling"
                ),
            })
        } else {
            None
        };
        w.flagged = verdict.is_some();
        verdict
    }

    /// Forgets the jobs not in `running` (released, or suspended or frozen: their watch starts
    /// again when they run).
    pub fn keep_only(&mut self, running: &BTreeSet<String>) {
        self.watches.retain(|job, _| running.contains(job));
    }
}

/// One round of the sampler: reads every running job, judges it, and flags (and logs, once)
/// the newly mis-sized ones on the host.
pub fn sample(server: &super::server::Server, reader: &dyn UsageReader, sizer: &mut Sizer) {
    let started = Instant::now();
    let snap = server.snapshot();
    let mut jobs = BTreeMap::new();
    let mut flagged = Vec::new();
    let mut running = BTreeSet::new();
    for view in snap.jobs.iter().filter(|j| j.state == JobState::Running) {
        let job = &view.allocation.job;
        let Ok(id) = JobId::parse(job) else { continue };
        let Some(usage) = reader.read(&id) else { continue };
        let cpus = view.allocation.cpus.len();
        running.insert(job.clone());
        if let Some(flag) = sizer.observe(job, cpus, &usage, Instant::now()) {
            flagged.push((job.clone(), flag));
        }
        jobs.insert(job.clone(), JobSample { cpus, usage });
    }
    sizer.keep_only(&running);
    let mut newly = Vec::new();
    if !flagged.is_empty() {
        let mut host = server.lock();
        for (job, flag) in flagged {
            if host.flag_missized(&job, flag.clone()) {
                tracing::warn!(
                    event = "flagged",
                    job = %job,
                    kind = flag.kind.as_str(),
                    "job {job}: mis-sized, {}",
                    flag.reason
                );
                newly.push(flag);
            }
        }
    }
    server.metrics.sampled(started.elapsed().as_secs_f64(), jobs, &newly);
}

/// Escapes a label value.
fn label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// A per-job family: name, type, help, and its value from a sample (none: not shown).
type PerJob = (&'static str, &'static str, &'static str, fn(&JobSample) -> Option<f64>);

/// The whole scrape, in the Prometheus text exposition format (version 0.0.4).
pub fn render(snap: &Snapshot, metrics: &Metrics) -> String {
    let (c, jobs) = metrics.snapshot();
    let mut out = String::with_capacity(4096);
    let family = |out: &mut String, name: &str, kind: &str, help: &str| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    };
    let held = snap.occupancy.held.len();
    let fenced = snap.occupancy.fenced.len();
    let free = snap.host_metrics();
    family(
        &mut out,
        "topod_cpus",
        "gauge",
        "CPUs jobs may get, by state (free, held by jobs, fenced off by exclusive jobs).",
    );
    let _ = writeln!(out, "topod_cpus{{state=\"allocatable\"}} {}", snap.model.allocatable.len());
    let _ = writeln!(out, "topod_cpus{{state=\"held\"}} {held}");
    let _ = writeln!(out, "topod_cpus{{state=\"fenced\"}} {fenced}");
    let _ = writeln!(out, "topod_cpus{{state=\"free\"}} {}", free.free_cpus);
    family(&mut out, "topod_free_domains", "gauge", "Wholly free domains, by level.");
    for (level, n) in [
        ("core", free.free_cores),
        ("l3", free.free_l3_groups),
        ("numa", free.free_numa_nodes),
        ("package", free.free_sockets),
    ] {
        let _ = writeln!(out, "topod_free_domains{{level=\"{level}\"}} {n}");
    }
    family(
        &mut out,
        "topod_largest_free_cpus",
        "gauge",
        "The most free CPUs inside one domain, by level.",
    );
    for (level, n) in [
        ("l3", free.largest_in_one_l3),
        ("numa", free.largest_in_one_numa),
        ("package", free.largest_in_one_socket),
    ] {
        let _ = writeln!(out, "topod_largest_free_cpus{{level=\"{level}\"}} {n}");
    }
    family(&mut out, "topod_jobs", "gauge", "Jobs, by state.");
    for state in [JobState::Running, JobState::Releasing, JobState::Suspended, JobState::Frozen] {
        let n = snap.jobs.iter().filter(|j| j.state == state).count();
        let _ = writeln!(out, "topod_jobs{{state=\"{state}\"}} {n}");
    }
    family(&mut out, "topod_allocations_total", "counter", "Jobs allocated.");
    let _ = writeln!(out, "topod_allocations_total {}", c.allocations);
    family(
        &mut out,
        "topod_refusals_total",
        "counter",
        "Requests refused or failed, by operation and error code.",
    );
    for ((op, code), n) in &c.refusals {
        let _ = writeln!(out, "topod_refusals_total{{op=\"{op}\",code=\"{}\"}} {n}", label(code));
    }
    family(
        &mut out,
        "topod_request_duration_seconds",
        "histogram",
        "Time to answer a request, by operation.",
    );
    for (op, h) in &c.latency {
        let mut cumulative = 0;
        for (bound, n) in LATENCY_BUCKETS.iter().zip(h.buckets) {
            cumulative += n;
            let _ = writeln!(
                out,
                "topod_request_duration_seconds_bucket{{op=\"{op}\",le=\"{bound}\"}} {cumulative}"
            );
        }
        let _ = writeln!(
            out,
            "topod_request_duration_seconds_bucket{{op=\"{op}\",le=\"+Inf\"}} {}",
            h.count
        );
        let _ = writeln!(out, "topod_request_duration_seconds_sum{{op=\"{op}\"}} {}", h.sum);
        let _ = writeln!(out, "topod_request_duration_seconds_count{{op=\"{op}\"}} {}", h.count);
    }
    family(&mut out, "topod_releases_total", "counter", "Jobs released.");
    let _ = writeln!(out, "topod_releases_total {}", c.releases);
    family(
        &mut out,
        "topod_releases_with_leftovers_total",
        "counter",
        "Releases that found processes left in the job and killed them.",
    );
    let _ = writeln!(out, "topod_releases_with_leftovers_total {}", c.releases_with_leftovers);
    family(
        &mut out,
        "topod_leftover_processes_killed_total",
        "counter",
        "Processes killed at release.",
    );
    let _ = writeln!(out, "topod_leftover_processes_killed_total {}", c.leftovers_killed);
    family(&mut out, "topod_jobs_flagged_total", "counter", "Jobs found mis-sized, by kind.");
    for kind in ["busy", "idle"] {
        let _ = writeln!(
            out,
            "topod_jobs_flagged_total{{kind=\"{kind}\"}} {}",
            c.flagged.get(kind).unwrap_or(&0)
        );
    }
    family(
        &mut out,
        "topod_sample_duration_seconds",
        "gauge",
        "Time the last sampling round of the jobs took.",
    );
    let _ = writeln!(out, "topod_sample_duration_seconds {}", c.sample_seconds);
    family(&mut out, "topod_samples_total", "counter", "Sampling rounds.");
    let _ = writeln!(out, "topod_samples_total {}", c.samples);

    // Per job: the last sample of every running job.
    let flags: BTreeMap<&str, &Missized> = snap
        .jobs
        .iter()
        .filter_map(|j| j.missized.as_ref().map(|m| (j.allocation.job.as_str(), m)))
        .collect();
    let per_job: [PerJob; 10] = [
        ("topod_job_cpus", "gauge", "CPUs given to the job.", |s| Some(s.cpus as f64)),
        ("topod_job_cpu_usage_seconds_total", "counter", "CPU time of the job's processes (v2 cpu.stat; v1 /proc/PID/stat).", |s| s.usage.cpu_seconds),
        ("topod_job_processes", "gauge", "Processes in the job's cgroup.", |s| Some(f64::from(s.usage.processes))),
        ("topod_job_threads", "gauge", "Threads of the job's processes.", |s| Some(f64::from(s.usage.threads))),
        ("topod_job_threads_runnable", "gauge", "Threads running or waiting for a CPU (state R), against topod_job_cpus.", |s| Some(f64::from(s.usage.runnable))),
        ("topod_job_cpu_pressure_some_seconds_total", "counter", "Time some of the job's threads waited for a CPU (v2 cpu.pressure).", |s| s.usage.cpu_pressure.as_ref().map(|p| p.some_total_us as f64 / 1e6)),
        ("topod_job_cpu_pressure_some_avg10", "gauge", "Share (percent) of the last 10 s some of the job's threads waited for a CPU (v2 cpu.pressure).", |s| s.usage.cpu_pressure.as_ref().map(|p| p.some_avg10)),
        ("topod_job_memory_pressure_some_seconds_total", "counter", "Time some of the job's threads stalled on memory (v2 memory.pressure).", |s| s.usage.memory_pressure.as_ref().map(|p| p.some_total_us as f64 / 1e6)),
        ("topod_job_memory_pressure_full_seconds_total", "counter", "Time all of the job's threads stalled on memory (v2 memory.pressure).", |s| s.usage.memory_pressure.as_ref().and_then(|p| p.full_total_us).map(|us| us as f64 / 1e6)),
        ("topod_job_cpuset_memory_pressure", "gauge", "v1 cpuset.memory_pressure (direct reclaims per second, times 1000, filtered), where the root's cpuset.memory_pressure_enabled is 1.", |s| s.usage.cpuset_memory_pressure.map(|v| v as f64)),
    ];
    for (name, kind, help, value) in per_job {
        let values: Vec<(&String, f64)> =
            jobs.iter().filter_map(|(job, s)| value(s).map(|v| (job, v))).collect();
        if values.is_empty() {
            continue;
        }
        family(&mut out, name, kind, help);
        for (job, v) in values {
            let _ = writeln!(out, "{name}{{job=\"{}\"}} {v}", label(job));
        }
    }
    family(&mut out, "topod_job_missized", "gauge", "1 for a job found mis-sized (busy: more threads runnable than CPUs; idle: most CPUs unused).");
    for (job, m) in flags {
        let _ = writeln!(
            out,
            "topod_job_missized{{job=\"{}\",kind=\"{}\"}} 1",
            label(job),
            m.kind.as_str()
        );
    }
    out
}

/// Writes `text` to `path` through a temporary file beside it and a rename, so that a reader
/// (node_exporter's textfile collector) never sees half of it.
pub fn write_textfile(path: &Path, text: &str) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let written = (|| {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Connections waiting for their request head, at most; past it a new one takes the place of
/// the oldest ([`super::conn::Unproven`]), so silent connections never keep a scrape out.
pub const WAITING_FOR_HEAD: usize = 64;
/// Replies being written at once, all addresses together, and to one address (a reply takes
/// at most 5 s however slowly its client reads); beyond, `503`.
pub const REPLIES_AT_ONCE: usize = 64;
/// See [`REPLIES_AT_ONCE`].
pub const REPLIES_PER_ADDRESS: usize = 16;

/// Serves scrapes on `listener` until it fails: an address in `allow` (loopback when it is
/// empty) gets the scrape for any `GET`; nothing else is read from the client, and no key is
/// asked (Prometheus sends none), so the allow-list is the only gate; another address gets
/// `403 Forbidden`, logged once a minute per address ([`super::conn::RefusalLog`]). Each
/// connection on a thread of its own: its request head (8 KiB at most) within 2 s, among
/// [`WAITING_FOR_HEAD`] at most (the oldest gives way), then its reply within 5 s, among
/// [`REPLIES_AT_ONCE`] at most.
pub fn serve(
    listener: std::net::TcpListener,
    server: Arc<super::server::Server>,
    allow: Vec<super::tcp::Allow>,
) {
    let loopback = [
        super::tcp::Allow::parse("127.0.0.0/8").expect("a network"),
        super::tcp::Allow::parse("::1").expect("an address"),
    ];
    let allow = if allow.is_empty() { loopback.to_vec() } else { allow };
    let waiting = super::conn::Unproven::new(WAITING_FOR_HEAD);
    let replying = super::conn::Gate::new(super::conn::Limits {
        max_connections: REPLIES_AT_ONCE,
        max_connections_per_user: REPLIES_PER_ADDRESS,
        ..super::conn::Limits::default()
    });
    let mut refusals = super::conn::RefusalLog::new("metrics", "metrics_allow");
    let mut errors = super::conn::AcceptErrors::new();
    loop {
        let (stream, addr) = match listener.accept() {
            Ok(s) => s,
            Err(e) => {
                errors.failed("the metrics listener", &e);
                continue;
            }
        };
        let ip = addr.ip().to_canonical();
        if !allow.iter().any(|a| a.contains(ip)) {
            if let Some(line) = refusals.refused(ip, Instant::now()) {
                tracing::warn!("{line}");
            }
            answer_at_once(
                stream,
                "403 Forbidden",
                "this address is not in topod's metrics_allow\n",
            );
            continue;
        }
        let Some(place) = waiting.enter(&stream) else { continue };
        let (server, replying) = (server.clone(), replying.clone());
        let spawned = std::thread::Builder::new().name("topod-metrics".into()).spawn(move || {
            if let Err(e) = scrape(stream, &server, place, &replying, ip) {
                tracing::debug!("metrics connection from {ip} ended: {e}");
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("cannot start a thread for a metrics connection: {e}");
        }
    }
}

/// A short reply written without waiting for the client (100 ms at most), then closed.
fn answer_at_once(mut stream: std::net::TcpStream, status: &str, body: &str) {
    use std::io::Write;
    let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
    let _ = stream.write_all(
        format!(
            "HTTP/1.0 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    );
}

fn scrape(
    mut stream: std::net::TcpStream,
    server: &super::server::Server,
    place: super::conn::UnprovenPlace,
    replying: &Arc<super::conn::Gate>,
    ip: IpAddr,
) -> std::io::Result<()> {
    use std::io::{Read, Write};
    let complete =
        |h: &[u8]| h.windows(4).any(|w| w == b"\r\n\r\n") || h.windows(2).any(|w| w == b"\n\n");
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    // The whole head within 2 s, not 2 s per read: a client that trickles bytes cannot hold
    // its place longer.
    let deadline = Instant::now() + Duration::from_secs(2);
    while !complete(&head) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        stream.set_read_timeout(Some(left))?;
        let n = stream.read(&mut buf)?;
        if n == 0 || head.len() + n > 8192 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    if !complete(&head) {
        // Too slow, too long, gone, or made way for a newer connection: no answer.
        return Ok(());
    }
    drop(place);
    let Ok(_replying) = replying.admit(super::conn::Holder::Ip(ip), false) else {
        answer_at_once(stream, "503 Service Unavailable", "too many scrapes at once\n");
        return Ok(());
    };
    let (status, body) = if head.starts_with(b"GET ") {
        ("200 OK", render(&server.snapshot(), &server.metrics))
    } else {
        ("405 Method Not Allowed", "only GET\n".to_string())
    };
    let reply = format!(
        "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    // And the whole reply within 5 s, however slowly the client reads.
    let deadline = Instant::now() + Duration::from_secs(5);
    for chunk in reply.as_bytes().chunks(16 * 1024) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        stream.set_write_timeout(Some(left))?;
        stream.write_all(chunk)?;
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn usage(runnable: u32, cpu_seconds: f64) -> JobUsage {
        JobUsage {
            cpu_seconds: Some(cpu_seconds),
            processes: 1,
            threads: runnable.max(1),
            runnable,
            ..Default::default()
        }
    }

    /// A server on a fake 4-core host (the daemon's unit tests share it).
    pub(crate) fn fake_server() -> Arc<super::super::server::Server> {
        use crate::cgroup::fake::Fake;
        use topo_core::cpuset::CpuSet;
        use topo_core::topology::{SyntheticShape, Topology};
        let topo = Topology::synthetic(SyntheticShape {
            packages: 1,
            numa_per_package: 1,
            l3_per_numa: 1,
            cores_per_l3: 4,
            threads_per_core: 1,
        });
        let fake = Fake::new(topo.allowed.clone(), topo.allowed_mems.clone());
        let host = super::super::host::Host::new(
            topo,
            CpuSet::new(),
            Box::new(fake),
            None,
            topo_core::place::Strategy::BestFit,
        )
        .unwrap();
        super::super::server::Server::new(
            host,
            Default::default(),
            super::super::conn::Gate::new(Default::default()),
        )
    }

    /// What a scrape of `addr` returns (empty: closed without a word).
    fn get(addr: std::net::SocketAddr, request: &[u8]) -> String {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(request);
        let mut reply = String::new();
        let _ = s.read_to_string(&mut reply);
        reply
    }

    #[test]
    fn the_listener_serves_allowed_addresses_only_and_nothing_but_the_scrape() {
        let server = fake_server();
        let open = |allow: Vec<super::super::tcp::Allow>| {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let server = server.clone();
            std::thread::spawn(move || serve(l, server, allow));
            addr
        };
        // Loopback by default.
        let addr = open(Vec::new());
        let reply = get(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
        assert!(
            reply.starts_with("HTTP/1.0 200 OK\r\n") && reply.contains("topod_cpus{"),
            "{reply}"
        );
        assert!(get(addr, b"POST / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.0 405"));
        // A client that sends half a head is closed, unanswered, once the head's time is up (the
        // connection ends in an end of file, which only topod can give: this client's own read
        // timeout, a minute, would end it in an error), and the next one is served.
        {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            s.write_all(b"GET /met").unwrap();
            let mut reply = String::new();
            let end = s.read_to_string(&mut reply);
            assert!(end.is_ok(), "topod did not close a half-sent head: {end:?}");
            assert_eq!(reply, "", "no complete request: no scrape");
        }
        assert!(get(addr, b"GET / HTTP/1.0\n\n").starts_with("HTTP/1.0 200"));
        // An address not on the list is told so, and gets nothing else.
        let addr = open(vec![super::super::tcp::Allow::parse("192.0.2.7").unwrap()]);
        let refused = get(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
        assert!(refused.starts_with("HTTP/1.0 403 Forbidden\r\n"), "{refused}");
        assert!(!refused.contains("topod_cpus"), "{refused}");
    }

    /// A connection to `addr` from the loopback address `from` that sends nothing.
    fn silent(from: [u8; 4], addr: std::net::SocketAddr) -> std::net::TcpStream {
        use nix::sys::socket::{
            bind, connect, socket, AddressFamily, SockFlag, SockType, SockaddrIn,
        };
        use std::os::fd::AsRawFd;
        let fd =
            socket(AddressFamily::Inet, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).unwrap();
        bind(fd.as_raw_fd(), &SockaddrIn::new(from[0], from[1], from[2], from[3], 0)).unwrap();
        connect(
            fd.as_raw_fd(),
            &SockaddrIn::from(match addr {
                std::net::SocketAddr::V4(a) => a,
                _ => unreachable!(),
            }),
        )
        .unwrap();
        std::net::TcpStream::from(fd)
    }

    /// Whether topod has closed `s` (a read finds its end), without waiting.
    fn closed_by_topod(s: &std::net::TcpStream) -> bool {
        use std::io::Read;
        s.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 64];
        let closed = (&*s).read(&mut buf).is_ok();
        s.set_nonblocking(false).unwrap();
        closed
    }

    #[test]
    fn silent_connections_do_not_hold_up_a_scrape() {
        // Issue 29: one scrape at a time, eight silent connections delayed a scrape 9-10 s. Now
        // the scrape is answered while silent ones are still open: with one connection at a
        // time, each would have had its 2 s head deadline and been closed first. (Only a test
        // stalled for all of 2 s, on a very loaded machine, could see every one closed too.)
        let server = fake_server();
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || serve(l, server, Vec::new()));
        let quiet: Vec<_> = (0..8).map(|_| silent([127, 0, 0, 1], addr)).collect();
        let reply = get(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
        assert!(reply.starts_with("HTTP/1.0 200 OK\r\n"), "{reply}");
        let closed = quiet.iter().filter(|s| closed_by_topod(s)).count();
        assert!(
            closed < quiet.len(),
            "the scrape waited for all {closed} silent connections to be closed"
        );
        // More silent connections than there are places, all from the scraper's own address
        // (a local user beside a local Prometheus): the oldest give way, and the scrape is
        // served.
        let more: Vec<_> =
            (0..WAITING_FOR_HEAD + 16).map(|_| silent([127, 0, 0, 1], addr)).collect();
        let reply = get(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
        assert!(reply.starts_with("HTTP/1.0 200 OK\r\n"), "{reply}");
        let closed = quiet.iter().chain(&more).filter(|s| closed_by_topod(s)).count();
        assert!(closed > 16, "only {closed} silent connection(s) gave way");
        drop((quiet, more));
    }

    #[test]
    fn refusals_are_logged_once_a_minute_per_address_with_their_count() {
        let mut log = super::super::conn::RefusalLog::new("metrics", "metrics_allow");
        let t0 = Instant::now();
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let mut lines = Vec::new();
        for i in 0..5_000u64 {
            // 5,000 refusals over 10 s (the attack's rate), from two addresses.
            let now = t0 + Duration::from_millis(i * 2);
            lines.extend(log.refused(if i % 2 == 0 { a } else { b }, now));
        }
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[0].contains("192.0.2.1") && lines[1].contains("192.0.2.2"), "{lines:?}");
        // A minute after its last line, an address's next refusal says how many there were.
        let later = log.refused(a, t0 + Duration::from_secs(61)).expect("a line a minute later");
        assert!(later.contains("(2500 since the last line)"), "{later}");
        assert_eq!(log.refused(a, t0 + Duration::from_secs(62)), None);
    }

    #[test]
    fn the_sampler_flags_through_the_host_and_the_scrape_has_the_job() {
        let server = fake_server();
        server.lock().allocate("j1", "affinity[core*2]", None, None, None, None).unwrap();
        server.lock().allocate("j2", "affinity[core*1]", None, None, None, None).unwrap();
        let reader = FakeUsage::default();
        reader.set("j1", usage(8, 1.0));
        reader.set("j2", usage(1, 1.0));
        let rules = SizeRules { settle: Duration::ZERO, ..Default::default() };
        let mut sizer = Sizer::new(rules);
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(2));
            sample(&server, &reader, &mut sizer);
        }
        let jobs = server.snapshot().jobs.clone();
        assert_eq!(jobs[0].missized.as_ref().map(|m| m.kind), Some(MissizedKind::Busy));
        assert_eq!(jobs[1].missized, None);
        let text = render(&server.snapshot(), &server.metrics);
        for line in [
            "topod_job_cpus{job=\"j1\"} 2",
            "topod_job_threads_runnable{job=\"j1\"} 8",
            "topod_job_missized{job=\"j1\",kind=\"busy\"} 1",
            "topod_jobs_flagged_total{kind=\"busy\"} 1",
            "topod_allocations_total 2",
            "topod_cpus{state=\"held\"} 3",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line} in\n{text}");
        }
        // Released: the flag and the series go.
        server.release("j1").unwrap();
        sample(&server, &reader, &mut sizer);
        let text = render(&server.snapshot(), &server.metrics);
        assert!(!text.contains("job=\"j1\""), "{text}");
        assert!(text.contains("topod_releases_total 1"), "{text}");
    }

    #[test]
    fn parses_the_kernels_files() {
        let stat = "4242 (a (weird) name) R 1 2 3 4 5 6 7 8 9 10 150 50 7 3 20 0 8 0 99 0 0";
        assert_eq!(parse_stat(stat), Some(Stat { state: 'R', ticks: 210 }));
        assert_eq!(parse_stat("garbage"), None);
        let psi = "some avg10=97.50 avg60=40.00 avg300=10.00 total=123456\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=99\n";
        assert_eq!(
            parse_pressure(psi),
            Some(Pressure { some_avg10: 97.5, some_total_us: 123456, full_total_us: Some(99) })
        );
        assert_eq!(cpu_stat_usage_usec("usage_usec 2500000\nuser_usec 1\n"), Some(2_500_000));
    }

    /// A job sampled every second from `t0` with `f(second)`.
    fn run(
        rules: SizeRules,
        cpus: usize,
        seconds: u64,
        f: impl Fn(u64) -> JobUsage,
    ) -> Option<(u64, Missized)> {
        let mut sizer = Sizer::new(rules);
        let t0 = Instant::now();
        (0..seconds).find_map(|s| {
            sizer.observe("j", cpus, &f(s), t0 + Duration::from_secs(s)).map(|m| (s, m))
        })
    }

    #[test]
    fn mis_sized_jobs_are_flagged_once_after_settling_and_well_sized_ones_never() {
        let rules =
            SizeRules { settle: Duration::from_secs(10), busy_ratio: 1.25, idle_fraction: 0.6 };
        // 8 threads spinning on 2 CPUs: each CPU busy all the time.
        let (at, m) = run(rules, 2, 60, |s| usage(8, 2.0 * s as f64)).expect("flagged");
        assert_eq!(m.kind, MissizedKind::Busy);
        assert!((12..15).contains(&at), "after settling and 3 samples, not at {at}");
        assert!(
            m.reason.contains("8.0 threads runnable") && m.reason.contains("2 CPUs given"),
            "{}",
            m.reason
        );
        // 1 thread on 2 CPUs: half of them idle.
        let (_, m) = run(rules, 2, 60, |s| usage(1, s as f64)).expect("flagged");
        assert_eq!(m.kind, MissizedKind::Idle);
        assert!(m.reason.contains("(50 % of them)"), "{}", m.reason);
        // 2 threads on 2 CPUs: fine, even when something else takes half the CPU time (its
        // threads stay runnable).
        assert_eq!(run(rules, 2, 120, |s| usage(2, s as f64)), None);
        assert_eq!(run(rules, 2, 120, |s| usage(2, 2.0 * s as f64)), None);
        // Before settling, nothing.
        assert_eq!(run(rules, 2, 12, |s| usage(8, 2.0 * s as f64)), None);
        // Flagged once only.
        let mut sizer = Sizer::new(rules);
        let t0 = Instant::now();
        let flags = (0..60)
            .filter_map(|s| sizer.observe("j", 1, &usage(4, s as f64), t0 + Duration::from_secs(s)))
            .count();
        assert_eq!(flags, 1);
        // Released and allocated again: a new watch.
        sizer.keep_only(&BTreeSet::new());
        let again = (60..120)
            .filter_map(|s| sizer.observe("j", 1, &usage(4, s as f64), t0 + Duration::from_secs(s)))
            .count();
        assert_eq!(again, 1);
    }
}
