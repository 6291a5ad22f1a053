//! `topoctl bench migrate`: what one move of a running job costs on real cgroups, the rewrite
//! that defragmentation makes (`Host::apply_moves` calls [`CgroupBackend::update`] for each
//! moved job).
//!
//! The bench calls the backend itself, as `bench freeze` does, rather than going through a
//! topod: topod has no request that moves one chosen job (moves come out of its placement), and
//! the kernel's part of a move is exactly this one call, which topod makes unchanged. The
//! backend is the one topod would use here (v2 where the unified hierarchy offers cpuset, else
//! v1), on a subtree of the bench's own that is removed at the end.
//!
//! The job is one process (this program, run with a hidden flag) in a cgroup of its own, with
//! `--threads` spinning threads. Where the job's CPUs allow two NUMA nodes with memory, it also
//! allocates and touches `--mem` of anonymous memory after it joined its cgroup, whose
//! `cpuset.mems` is then the first node only, so the pages start there (checked in
//! `/proc/PID/numa_maps`). Each round moves the job there and back:
//!
//! - cpuset only: the job's CPUs change, its memory nodes do not; timed are the update call
//!   (v1 and v2 write `cpuset.cpus`, and the kernel moves every thread before the write returns)
//!   and the time until every thread's `Cpus_allowed_list` (`/proc/PID/task/*/status`) shows the
//!   new CPUs;
//! - memory (two nodes only): the job moves to the CPUs and the memory node of the other NUMA
//!   node; timed are the update call (v1: `cpuset.memory_migrate=1`, then `cpuset.mems`, then
//!   `cpuset.cpus`; v2: `cpuset.mems`, then `cpuset.cpus`) and the time until `numa_maps` shows at
//!   least 99% of the job's anonymous memory on the new node, read again and again from the
//!   moment the call returned (the first read says whether the kernel moved the pages before
//!   the write returned); the rate is the bytes that changed node over each of those times.
//!
//! The measuring thread runs at `SCHED_FIFO` priority 1, so the job's spinning threads never
//! delay it, and on a CPU the job never gets where the host has one to spare. The job's process
//! ends when the bench closes its stdin; it is also killed, its cgroup released and the subtree
//! removed when the bench ends, on a failure too.

use crate::{print_json, Failure};
use clap::Args;
use nix::unistd::Pid;
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use topo_core::CpuSet;
use topod::cgroup::fs::Files;
use topod::cgroup::v1::v1_mounts;
use topod::cgroup::v2::v2_mount;
use topod::cgroup::{CgroupBackend, CgroupSpec, JobId, Kind, MOUNTS};

/// How long the threads may take to show their new CPUs before the bench gives up.
const THREADS_PATIENCE: Duration = Duration::from_secs(10);
/// How long the pages may take to reach their new node (an emulated guest moves a GiB slowly).
const PAGES_PATIENCE: Duration = Duration::from_secs(300);
/// Share of the job's anonymous memory on the new node at which a move counts as done.
const DONE_SHARE: f64 = 0.99;
/// What the job writes once its memory is touched and its threads spin.
const READY: &str = "ready";

/// `topoctl bench migrate`'s options.
#[derive(Debug, Args)]
pub(crate) struct MigrateOpts {
    /// Spinning threads in the job's process (besides its main thread).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=4096))]
    threads: u32,
    /// Touched anonymous memory the job holds and moves across NUMA nodes, where the host has
    /// two (K, M, G, T: powers of 1024).
    #[arg(long, value_name = "SIZE", default_value = "1G", value_parser = parse_size)]
    mem: u64,
    /// Rounds (each: one move there and one back), of the cpuset-only moves and of the memory
    /// moves.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    rounds: u32,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Be the bench's job process: wait for a line on stdin (the bench has put this process in
    /// the job's cgroup), touch the memory, start the threads, say `ready`, run until stdin ends.
    #[arg(long, hide = true)]
    job_process: bool,
}

/// A size with an optional binary suffix (`1G`, `512M`, `64k`, `1GiB`, `4096`).
fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let t = t.strip_suffix("iB").or_else(|| t.strip_suffix('B')).unwrap_or(t);
    let (digits, shift) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 10),
        Some('M') => (&t[..t.len() - 1], 20),
        Some('G') => (&t[..t.len() - 1], 30),
        Some('T') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let n: u64 = digits.parse().map_err(|_| format!("{text:?} is not a size like 1G or 512M"))?;
    n.checked_mul(1 << shift).ok_or_else(|| format!("{text} is too large"))
}

/// Median, 95th percentile and largest of one measure, milliseconds.
#[derive(Debug, Clone, Serialize)]
struct Figures {
    median_ms: f64,
    p95_ms: f64,
    max_ms: f64,
}

/// The nearest-rank quantile `q` of ascending `sorted` (0 when empty).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len().max(1)) - 1;
    sorted.get(i).copied().unwrap_or(0.0)
}

fn figures(samples: &[Duration]) -> Figures {
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    Figures {
        median_ms: quantile(&ms, 0.5),
        p95_ms: quantile(&ms, 0.95),
        max_ms: quantile(&ms, 1.0),
    }
}

/// Rates of the moves, GiB/s: the median, and the rate 95% of the moves reached (the slow end,
/// matching the 95th percentile of the times).
#[derive(Debug, Clone, Serialize)]
struct Rates {
    median_gib_s: f64,
    p95_slow_gib_s: f64,
}

fn rates(bytes_and_times: &[(u64, Duration)]) -> Rates {
    let mut r: Vec<f64> = bytes_and_times
        .iter()
        .map(|&(b, t)| b as f64 / (1u64 << 30) as f64 / t.as_secs_f64().max(1e-9))
        .collect();
    r.sort_by(f64::total_cmp);
    Rates { median_gib_s: quantile(&r, 0.5), p95_slow_gib_s: quantile(&r, 0.05) }
}

/// The moves of the job's CPUs alone.
#[derive(Debug, Clone, Serialize)]
struct CpusetMoves {
    /// The update call.
    update: Figures,
    /// From the call to every thread's `Cpus_allowed_list` showing the new CPUs.
    threads_on_new_cpus: Figures,
}

/// The moves of the job's CPUs and memory to the other NUMA node.
#[derive(Debug, Clone, Serialize)]
struct MemoryMoves {
    /// The two nodes the job moves between.
    nodes: [u32; 2],
    /// The job's anonymous memory before the first move, bytes.
    job_bytes: u64,
    /// Of it, in transparent huge pages (`AnonHugePages` in `smaps_rollup`), bytes.
    huge_page_bytes: u64,
    /// The bytes that changed node, median over the moves.
    moved_bytes_median: u64,
    /// The update call.
    update: Figures,
    /// From the call to `numa_maps` showing at least 99% of the memory on the new node.
    pages_on_new_node: Figures,
    /// The moved bytes over the update call.
    rate_update: Rates,
    /// The moved bytes over the time to 99%.
    rate_pages: Rates,
    /// The least share of the memory already on the new node in the first `numa_maps` read
    /// after the update call returned (1.0: every move was done when the write returned).
    first_read_share_min: f64,
    /// One read of `numa_maps`.
    numa_maps_read: Figures,
}

#[derive(Debug, Serialize)]
struct Report {
    backend: String,
    kernel: String,
    transparent_hugepage: String,
    threads: u32,
    rounds: u32,
    from_cpus: String,
    to_cpus: String,
    timer: String,
    cpuset_only: CpusetMoves,
    memory: Option<MemoryMoves>,
    /// Why the memory moves were not measured, when they were not.
    memory_not_measured: Option<String>,
}

/// Where the job moves, and where the measuring thread runs.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Layout {
    /// A CPU the job never gets, for the measuring thread, where there is one to spare.
    timer_cpu: Option<u32>,
    /// The job's CPUs at the start, and after a move there.
    from_cpus: CpuSet,
    to_cpus: CpuSet,
    /// The NUMA nodes of `from_cpus` and `to_cpus`, where they differ; `None`: one node.
    nodes: Option<(u32, u32)>,
}

/// Chooses the job's two sets of CPUs (as many CPUs each) among `allowed`: on the first two of
/// `nodes` (node id, its CPUs; nodes with memory only) that have allowed CPUs, else halves of
/// `allowed`; and a CPU for the measuring thread outside both, where one is left.
fn layout(allowed: &CpuSet, nodes: &[(u32, CpuSet)]) -> Result<Layout, String> {
    let usable: Vec<(u32, CpuSet)> = nodes
        .iter()
        .map(|(id, cpus)| (*id, cpus.intersection(allowed)))
        .filter(|(_, cpus)| !cpus.is_empty())
        .collect();
    if let [(a, ca), (b, cb), ..] = usable.as_slice() {
        let (mut ca, mut cb) = (ca.clone(), cb.clone());
        let outside = allowed.difference(&ca.union(&cb));
        let timer_cpu = if let Some(c) = outside.first() {
            Some(c)
        } else if ca.len() >= 2 {
            ca.first()
        } else if cb.len() >= 2 {
            cb.first()
        } else {
            None
        };
        if let Some(c) = timer_cpu {
            ca.remove(c);
            cb.remove(c);
        }
        let k = ca.len().min(cb.len());
        return Ok(Layout {
            timer_cpu,
            from_cpus: ca.take_first(k),
            to_cpus: cb.take_first(k),
            nodes: Some((*a, *b)),
        });
    }
    let (timer_cpu, rest) = match allowed.len() {
        0 | 1 => {
            return Err(format!(
                "the job needs two CPUs to move between, and this bench may use only {allowed}"
            ))
        }
        2 => (None, allowed.clone()),
        _ => {
            let first = allowed.first();
            (first, allowed.iter().filter(|&c| Some(c) != first).collect())
        }
    };
    let k = rest.len() / 2;
    let from_cpus = rest.take_first(k);
    let to_cpus = rest.difference(&from_cpus).take_first(k);
    Ok(Layout { timer_cpu, from_cpus, to_cpus, nodes: None })
}

/// Bytes of anonymous memory per NUMA node in a `/proc/PID/numa_maps` text: every mapping not
/// backed by a file (heap, stack, anonymous maps), its `N<node>=<pages>` fields times its
/// `kernelpagesize_kB` (the counts of a transparent huge page are in base pages).
fn anon_bytes_by_node(numa_maps: &str) -> BTreeMap<u32, u64> {
    let mut by_node = BTreeMap::new();
    for line in numa_maps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.iter().any(|f| f.starts_with("file=")) {
            continue;
        }
        let page_kib: u64 = fields
            .iter()
            .find_map(|f| f.strip_prefix("kernelpagesize_kB=")?.parse().ok())
            .unwrap_or(4);
        for f in &fields {
            let Some((node, pages)) = f.strip_prefix('N').and_then(|r| r.split_once('=')) else {
                continue;
            };
            if let (Ok(node), Ok(pages)) = (node.parse::<u32>(), pages.parse::<u64>()) {
                *by_node.entry(node).or_insert(0) += pages * page_kib * 1024;
            }
        }
    }
    by_node
}

/// The share of `by_node`'s bytes on `node` (0 when there are none).
fn share_on(by_node: &BTreeMap<u32, u64>, node: u32) -> f64 {
    let total: u64 = by_node.values().sum();
    if total == 0 {
        return 0.0;
    }
    by_node.get(&node).copied().unwrap_or(0) as f64 / total as f64
}

fn read(path: impl AsRef<Path>) -> Result<String, Failure> {
    let path = path.as_ref();
    std::fs::read_to_string(path)
        .map_err(|e| Failure::runtime(format!("reading {}: {e}", path.display())))
}

/// The job's anonymous memory per node, from its `numa_maps`.
fn job_memory(pid: u32) -> Result<BTreeMap<u32, u64>, Failure> {
    Ok(anon_bytes_by_node(&read(format!("/proc/{pid}/numa_maps"))?))
}

/// The bench's job: its cgroup, in a subtree of the bench's own, and its process. Dropped: the
/// process's stdin is closed (it ends) and it is killed, the cgroup released and the subtree's
/// directories removed.
struct Job {
    backend: Box<dyn CgroupBackend>,
    id: JobId,
    subtree_dirs: Vec<PathBuf>,
    process: Option<Child>,
}

impl Drop for Job {
    fn drop(&mut self) {
        if let Some(mut child) = self.process.take() {
            drop(child.stdin.take());
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = self.backend.release(&self.id, Duration::from_secs(10));
        for dir in &self.subtree_dirs {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

impl Job {
    fn pid(&self) -> u32 {
        self.process.as_ref().map_or(0, Child::id)
    }

    /// Moves the job to `cpus` and `mems`, checking what the kernel made effective.
    fn update(&self, cpus: &CpuSet, mems: &CpuSet) -> Result<(), Failure> {
        let spec = CgroupSpec {
            cpus: cpus.clone(),
            mems: mems.clone(),
            memory_limit: None,
            ..Default::default()
        };
        let effective =
            self.backend.update(&self.id, &spec).map_err(|e| Failure::runtime(e.to_string()))?;
        if effective.cpus != *cpus || effective.mems != *mems {
            return Err(Failure::runtime(format!(
                "the kernel made CPUs {} and nodes {} effective, not {cpus} and {mems}",
                effective.cpus, effective.mems
            )));
        }
        Ok(())
    }
}

/// Every directory of `subtree` in the mounted hierarchies (v1's, and v2's `<subtree>.slice`).
fn subtree_dirs(mounts: &str, subtree: &str) -> Vec<PathBuf> {
    let (cpuset, freezer, memory) = v1_mounts(mounts);
    let mut dirs: Vec<PathBuf> =
        [cpuset, freezer, memory].into_iter().flatten().map(|m| m.join(subtree)).collect();
    dirs.extend(v2_mount(mounts).map(|m| m.join(format!("{subtree}.slice"))));
    dirs.retain(|d| d.is_dir());
    dirs
}

/// The CPUs and memory nodes the subtree at `dir` offers its jobs.
fn subtree_resources(kind: Kind, dir: &Path) -> Result<(CpuSet, CpuSet), Failure> {
    let (cpus, mems) = match kind {
        Kind::V2 => ("cpuset.cpus.effective", "cpuset.mems.effective"),
        _ => ("cpuset.cpus", "cpuset.mems"),
    };
    let parse = |name: &str| -> Result<CpuSet, Failure> {
        let text = read(dir.join(name))?;
        CpuSet::parse_list(text.trim())
            .map_err(|e| Failure::runtime(format!("{}: {e}", dir.join(name).display())))
    };
    Ok((parse(cpus)?, parse(mems)?))
}

/// The NUMA nodes among `mems`, each with its CPUs (from sysfs; none where sysfs has no nodes).
fn numa_nodes(mems: &CpuSet) -> Vec<(u32, CpuSet)> {
    mems.iter()
        .filter_map(|node| {
            let text =
                std::fs::read_to_string(format!("/sys/devices/system/node/node{node}/cpulist"))
                    .ok()?;
            Some((node, CpuSet::parse_list(text.trim()).ok()?))
        })
        .collect()
}

/// The job process (`--job-process`): see [`MigrateOpts::job_process`].
fn job_process(threads: u32, bytes: u64) -> Result<(), Failure> {
    let mut stdin = std::io::stdin().lock();
    let mut go = String::new();
    stdin.read_line(&mut go).map_err(|e| Failure::runtime(format!("reading stdin: {e}")))?;
    if go.is_empty() {
        return Ok(());
    }
    let len = usize::try_from(bytes).map_err(|_| Failure::input("--mem is too large here"))?;
    // Each page written once, so that the kernel gives it a frame now, on the cgroup's node.
    let mut memory = vec![0u8; len];
    for i in (0..len).step_by(4096) {
        memory[i] = 1;
    }
    std::hint::black_box(&mut memory);
    for _ in 0..threads {
        std::thread::spawn(|| loop {
            std::hint::spin_loop();
        });
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "{READY}")
        .and_then(|()| out.flush())
        .map_err(|e| Failure::runtime(format!("writing stdout: {e}")))?;
    // Until the bench closes stdin (or dies); exit ends the spinning threads.
    let _ = std::io::copy(&mut stdin, &mut std::io::sink());
    std::hint::black_box(&memory);
    std::process::exit(0)
}

/// Starts the job's process, puts it in the job's cgroup and waits until it is ready.
fn start_job_process(job: &mut Job, threads: u32, bytes: u64) -> Result<(), Failure> {
    let exe = std::env::current_exe()
        .map_err(|e| Failure::runtime(format!("finding this program: {e}")))?;
    let child = Command::new(exe)
        .args(["bench", "migrate", "--job-process", "--threads"])
        .arg(threads.to_string())
        .arg("--mem")
        .arg(bytes.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| Failure::runtime(format!("starting the job's process: {e}")))?;
    let pid = child.id();
    job.process = Some(child);
    job.backend.join(&job.id, pid as i32).map_err(|e| Failure::runtime(e.to_string()))?;
    let child = job.process.as_mut().expect("just set");
    let mut stdin = child.stdin.take().expect("piped");
    writeln!(stdin, "go").map_err(|e| Failure::runtime(format!("writing to the job: {e}")))?;
    child.stdin = Some(stdin);
    let mut line = String::new();
    let stdout = child.stdout.as_mut().expect("piped");
    BufReader::new(stdout)
        .read_line(&mut line)
        .map_err(|e| Failure::runtime(format!("reading the job's output: {e}")))?;
    if line.trim() != READY {
        let status = child.try_wait().ok().flatten();
        return Err(Failure::runtime(format!(
            "the job's process did not get ready (said {line:?}, status {status:?})"
        )));
    }
    Ok(())
}

/// The thread ids of process `pid`.
fn threads_of(pid: u32) -> Result<Vec<u32>, Failure> {
    let dir = format!("/proc/{pid}/task");
    let entries =
        std::fs::read_dir(&dir).map_err(|e| Failure::runtime(format!("reading {dir}: {e}")))?;
    Ok(entries.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect())
}

/// Whether every thread in `tids` of `pid` shows `cpus` as its `Cpus_allowed_list`.
fn threads_on(pid: u32, tids: &[u32], cpus: &CpuSet) -> Result<bool, Failure> {
    for tid in tids {
        let status = read(format!("/proc/{pid}/task/{tid}/status"))?;
        let allowed = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .and_then(|v| CpuSet::parse_list(v.trim()).ok());
        if allowed.as_ref() != Some(cpus) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Keeps the calling (measuring) thread on `cpu`, if any, at `SCHED_FIFO` 1; says what it got.
fn hold_timer_thread(cpu: Option<u32>) -> Result<String, Failure> {
    let mut placed = String::from("on any CPU the job also uses");
    if let Some(cpu) = cpu {
        let mut set = nix::sched::CpuSet::new();
        set.set(cpu as usize).map_err(|e| Failure::runtime(format!("CPU {cpu}: {e}")))?;
        nix::sched::sched_setaffinity(Pid::from_raw(0), &set)
            .map_err(|e| Failure::runtime(format!("sched_setaffinity: {e}")))?;
        placed = format!("on CPU {cpu}, which the job never gets");
    }
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: a plain system call on the calling thread with a valid parameter.
    let policy = if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } == 0 {
        "SCHED_FIFO 1".to_string()
    } else {
        format!("SCHED_OTHER (SCHED_FIFO refused: {})", std::io::Error::last_os_error())
    };
    Ok(format!("{placed}, at {policy}"))
}

/// The word in brackets of `/sys/kernel/mm/transparent_hugepage/enabled`.
fn thp_mode() -> String {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .ok()
        .and_then(|t| Some(t.split('[').nth(1)?.split(']').next()?.to_string()))
        .unwrap_or_else(|| "unknown".into())
}

/// `AnonHugePages` of `pid`, bytes.
fn huge_page_bytes(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|t| {
            let kib = t.lines().find_map(|l| l.strip_prefix("AnonHugePages:"))?;
            kib.trim().trim_end_matches("kB").trim().parse::<u64>().ok()
        })
        .map_or(0, |kib| kib * 1024)
}

/// One cpuset-only move: (update call, to every thread on the new CPUs).
fn cpuset_move(
    job: &Job,
    tids: &[u32],
    cpus: &CpuSet,
    mems: &CpuSet,
) -> Result<(Duration, Duration), Failure> {
    let pid = job.pid();
    let t0 = Instant::now();
    job.update(cpus, mems)?;
    let update = t0.elapsed();
    loop {
        if threads_on(pid, tids, cpus)? {
            return Ok((update, t0.elapsed()));
        }
        if t0.elapsed() > THREADS_PATIENCE {
            return Err(Failure::runtime(format!(
                "the job's threads did not all show CPUs {cpus} within {THREADS_PATIENCE:?}"
            )));
        }
        std::thread::sleep(Duration::from_micros(20));
    }
}

/// One move of the job's CPUs and memory from node `from` to node `to`.
struct MemorySample {
    update: Duration,
    pages_on_new_node: Duration,
    moved_bytes: u64,
    first_read_share: f64,
    reads: Vec<Duration>,
}

fn memory_move(
    job: &Job,
    tids: &[u32],
    cpus: &CpuSet,
    from: u32,
    to: u32,
) -> Result<MemorySample, Failure> {
    let pid = job.pid();
    let before = job_memory(pid)?;
    let share_before = share_on(&before, from);
    if share_before < DONE_SHARE {
        return Err(Failure::runtime(format!(
            "before the move only {:.1}% of the job's memory is on node {from}",
            share_before * 100.0
        )));
    }
    let on_target_before = before.get(&to).copied().unwrap_or(0);
    let mems: CpuSet = [to].into_iter().collect();
    let t0 = Instant::now();
    job.update(cpus, &mems)?;
    let update = t0.elapsed();
    let (mut first_read_share, mut reads) = (None, Vec::new());
    let (after, pages_on_new_node) = loop {
        let r0 = Instant::now();
        let now = job_memory(pid)?;
        reads.push(r0.elapsed());
        let share = share_on(&now, to);
        first_read_share.get_or_insert(share);
        if share >= DONE_SHARE {
            break (now, t0.elapsed());
        }
        if t0.elapsed() > PAGES_PATIENCE {
            return Err(Failure::runtime(format!(
                "after {PAGES_PATIENCE:?} only {:.1}% of the job's memory is on node {to}",
                share * 100.0
            )));
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    if !threads_on(pid, tids, cpus)? {
        return Err(Failure::runtime(format!("the job's threads are not all on CPUs {cpus}")));
    }
    Ok(MemorySample {
        update,
        pages_on_new_node,
        moved_bytes: after.get(&to).copied().unwrap_or(0).saturating_sub(on_target_before),
        first_read_share: first_read_share.unwrap_or(0.0),
        reads,
    })
}

/// Runs the bench (see the module documentation), or the job's process with `--job-process`.
pub(crate) fn run(opts: MigrateOpts) -> Result<(), Failure> {
    if opts.job_process {
        return job_process(opts.threads, opts.mem);
    }
    if !nix::unistd::geteuid().is_root() {
        return Err(Failure::input("bench migrate makes and rewrites cgroups: run it as root"));
    }
    let mounts = read(MOUNTS)?;
    let kind = Kind::auto(&Files::default(), &mounts);
    let subtree = format!("topo-bench-migrate-{}", std::process::id());
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
    let id = JobId::parse("bench-migrate").map_err(|e| Failure::runtime(e.to_string()))?;
    let mut job = Job { backend, id, subtree_dirs: subtree_dirs(&mounts, &subtree), process: None };
    let subtree_dir = kind
        .subtree_dir(&mounts, &subtree)
        .ok_or_else(|| Failure::runtime("no cpuset hierarchy for the bench's subtree"))?;
    let (subtree_cpus, subtree_mems) = subtree_resources(kind, &subtree_dir)?;
    let own = nix::sched::sched_getaffinity(Pid::from_raw(0))
        .map_err(|e| Failure::runtime(format!("sched_getaffinity: {e}")))?;
    let allowed: CpuSet =
        subtree_cpus.iter().filter(|&c| own.is_set(c as usize).unwrap_or(false)).collect();
    let nodes = numa_nodes(&subtree_mems);
    let layout = layout(&allowed, &nodes).map_err(Failure::runtime)?;
    let (from_mems, memory_not_measured) = match layout.nodes {
        Some((a, _)) => ([a].into_iter().collect(), None),
        None => (
            subtree_mems.clone(),
            Some(format!(
                "the job's CPUs are all in one NUMA node with memory (nodes {subtree_mems}): the memory move cannot be measured here"
            )),
        ),
    };
    let bytes = if layout.nodes.is_some() { opts.mem } else { 0 };
    let spec = CgroupSpec {
        cpus: layout.from_cpus.clone(),
        mems: from_mems.clone(),
        memory_limit: None,
        ..Default::default()
    };
    job.backend.create(&job.id, &spec).map_err(|e| Failure::runtime(e.to_string()))?;
    start_job_process(&mut job, opts.threads, bytes)?;
    let pid = job.pid();
    let tids = threads_of(pid)?;
    if tids.len() != opts.threads as usize + 1 {
        return Err(Failure::runtime(format!(
            "the job's process has {} threads, not {} spinning and its main one",
            tids.len(),
            opts.threads
        )));
    }
    if !threads_on(pid, &tids, &layout.from_cpus)? {
        return Err(Failure::runtime(format!(
            "the job's threads are not all on its CPUs {}",
            layout.from_cpus
        )));
    }
    let timer = hold_timer_thread(layout.timer_cpu)?;

    // The job runs undisturbed a moment before each move, as between real moves.
    let (mut update, mut visible) = (Vec::new(), Vec::new());
    for _ in 0..opts.rounds {
        for cpus in [&layout.to_cpus, &layout.from_cpus] {
            std::thread::sleep(Duration::from_millis(20));
            let (u, v) = cpuset_move(&job, &tids, cpus, &from_mems)?;
            update.push(u);
            visible.push(v);
        }
    }
    let cpuset_only =
        CpusetMoves { update: figures(&update), threads_on_new_cpus: figures(&visible) };

    let memory = match layout.nodes {
        None => None,
        Some((a, b)) => {
            let job_bytes: u64 = job_memory(pid)?.values().sum();
            let huge = huge_page_bytes(pid);
            let mut samples = Vec::new();
            for _ in 0..opts.rounds {
                for (cpus, from, to) in [(&layout.to_cpus, a, b), (&layout.from_cpus, b, a)] {
                    std::thread::sleep(Duration::from_millis(100));
                    samples.push(memory_move(&job, &tids, cpus, from, to)?);
                }
            }
            let pick = |f: fn(&MemorySample) -> Duration| {
                figures(&samples.iter().map(f).collect::<Vec<_>>())
            };
            let mut moved: Vec<u64> = samples.iter().map(|s| s.moved_bytes).collect();
            moved.sort();
            let reads: Vec<Duration> = samples.iter().flat_map(|s| s.reads.clone()).collect();
            Some(MemoryMoves {
                nodes: [a, b],
                job_bytes,
                huge_page_bytes: huge,
                moved_bytes_median: moved[(moved.len() - 1) / 2],
                update: pick(|s| s.update),
                pages_on_new_node: pick(|s| s.pages_on_new_node),
                rate_update: rates(
                    &samples.iter().map(|s| (s.moved_bytes, s.update)).collect::<Vec<_>>(),
                ),
                rate_pages: rates(
                    &samples
                        .iter()
                        .map(|s| (s.moved_bytes, s.pages_on_new_node))
                        .collect::<Vec<_>>(),
                ),
                first_read_share_min: samples
                    .iter()
                    .map(|s| s.first_read_share)
                    .fold(f64::INFINITY, f64::min),
                numa_maps_read: figures(&reads),
            })
        }
    };
    drop(job);
    let node_of = |cpus: &CpuSet, node: Option<u32>| match node {
        Some(n) => format!("{cpus} (node {n})"),
        None => cpus.to_string(),
    };
    let report = Report {
        backend: match kind {
            Kind::V1 => "v1 (cpuset.memory_migrate=1, cpuset.mems, cpuset.cpus)".into(),
            Kind::V2 => "v2 (cpuset.mems, cpuset.cpus)".into(),
            Kind::Fake => "fake".into(),
        },
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string(),
        transparent_hugepage: thp_mode(),
        threads: opts.threads,
        rounds: opts.rounds,
        from_cpus: node_of(&layout.from_cpus, layout.nodes.map(|n| n.0)),
        to_cpus: node_of(&layout.to_cpus, layout.nodes.map(|n| n.1)),
        timer,
        cpuset_only,
        memory,
        memory_not_measured,
    };
    if opts.json {
        return print_json(&report);
    }
    print_report(&report);
    Ok(())
}

fn print_report(r: &Report) {
    println!(
        "job: one process with {} spinning threads on real cgroups, backend {}, kernel {}",
        r.threads, r.backend, r.kernel
    );
    println!(
        "moves between CPUs {} and CPUs {}, {} rounds there and back; timed {}",
        r.from_cpus, r.to_cpus, r.rounds, r.timer
    );
    println!("{:<52} {:>13} {:>13} {:>13}", "", "median", "p95", "max");
    let row = |name: &str, f: &Figures| {
        println!("{name:<52} {:>10.3} ms {:>10.3} ms {:>10.3} ms", f.median_ms, f.p95_ms, f.max_ms)
    };
    row("cpuset only: update call", &r.cpuset_only.update);
    row("cpuset only: every thread's Cpus_allowed_list new", &r.cpuset_only.threads_on_new_cpus);
    match (&r.memory, &r.memory_not_measured) {
        (Some(m), _) => {
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            let what = format!(
                "{:.2} GiB node {} <-> {}",
                gib(m.moved_bytes_median),
                m.nodes[0],
                m.nodes[1]
            );
            row(&format!("{what}: update call"), &m.update);
            row(&format!("{what}: >= 99% of pages on new node"), &m.pages_on_new_node);
            row("one read of numa_maps", &m.numa_maps_read);
            println!("{:<52} {:>13} {:>13}", "", "median", "p95 (slow)");
            for (name, rate) in [
                ("GiB/s over the update call", &m.rate_update),
                ("GiB/s to 99% of pages", &m.rate_pages),
            ] {
                println!(
                    "{name:<52} {:>7.3} GiB/s {:>7.3} GiB/s",
                    rate.median_gib_s, rate.p95_slow_gib_s
                );
            }
            println!(
                "job memory {:.2} GiB anonymous ({:.2} GiB in transparent huge pages, THP {}); first numa_maps read after each update call: at least {:.1}% on the new node{}",
                gib(m.job_bytes),
                gib(m.huge_page_bytes),
                r.transparent_hugepage,
                m.first_read_share_min * 100.0,
                if m.first_read_share_min >= DONE_SHARE {
                    " (the pages had moved when the write returned)"
                } else {
                    " (the pages moved after the write returned)"
                }
            );
        }
        (None, Some(why)) => println!("memory: not measured: {why}"),
        (None, None) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(text: &str) -> CpuSet {
        CpuSet::parse_list(text).unwrap()
    }

    #[test]
    fn sizes_take_binary_suffixes() {
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("64k"), Ok(64 << 10));
        assert_eq!(parse_size("3GiB"), Ok(3 << 30));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("1.5G").is_err());
        assert!(parse_size("G").is_err());
        assert!(parse_size("99999999T").is_err());
    }

    #[test]
    fn numa_maps_counts_anonymous_memory_per_node() {
        let text = "\
55d0c0a00000 default file=/usr/bin/x mapped=10 N0=6 N1=4 kernelpagesize_kB=4
55d0c1000000 default heap anon=3 dirty=3 N0=3 kernelpagesize_kB=4
7f0000000000 default anon=262144 dirty=262144 N0=1000 N1=261144 kernelpagesize_kB=4
7f1000000000 default huge anon=2 dirty=2 N1=2 kernelpagesize_kB=2048
7ffd00000000 default stack anon=5 dirty=5 N0=5 kernelpagesize_kB=4
7ffd10000000 default
";
        let by_node = anon_bytes_by_node(text);
        assert_eq!(by_node.get(&0), Some(&((3 + 1000 + 5) * 4096)));
        assert_eq!(by_node.get(&1), Some(&(261_144 * 4096 + 2 * 2048 * 1024)));
        let share = share_on(&by_node, 1);
        assert!(share > 0.99 && share < 1.0, "{share}");
        assert_eq!(share_on(&BTreeMap::new(), 0), 0.0);
    }

    #[test]
    fn two_nodes_keep_a_cpu_for_the_timer_and_move_between_nodes() {
        let nodes = [(0, set("0-1")), (1, set("2-3"))];
        let l = layout(&set("0-3"), &nodes).unwrap();
        assert_eq!(l.timer_cpu, Some(0));
        assert_eq!((l.from_cpus, l.to_cpus), (set("1"), set("2")));
        assert_eq!(l.nodes, Some((0, 1)));
        // One CPU per node: no spare CPU, the job moves between them.
        let l = layout(&set("0,2"), &nodes).unwrap();
        assert_eq!((l.timer_cpu, l.from_cpus, l.to_cpus), (None, set("0"), set("2")));
        // A node without allowed CPUs does not count.
        let l = layout(&set("0-1"), &nodes).unwrap();
        assert_eq!(l.nodes, None);
    }

    #[test]
    fn one_node_moves_between_halves() {
        let l = layout(&set("0-1"), &[(0, set("0-1"))]).unwrap();
        assert_eq!(
            (l.timer_cpu, l.from_cpus, l.to_cpus, l.nodes),
            (None, set("0"), set("1"), None)
        );
        let l = layout(&set("0-7"), &[]).unwrap();
        assert_eq!((l.timer_cpu, l.from_cpus, l.to_cpus), (Some(0), set("1-3"), set("4-6")));
        assert!(layout(&set("3"), &[]).is_err());
    }

    #[test]
    fn rates_and_quantiles() {
        let gib = 1u64 << 30;
        let r = rates(&[
            (gib, Duration::from_secs(1)),
            (gib, Duration::from_millis(500)),
            (gib, Duration::from_secs(2)),
        ]);
        assert!((r.median_gib_s - 1.0).abs() < 1e-9);
        assert!((r.p95_slow_gib_s - 0.5).abs() < 1e-9);
        let f = figures(&[Duration::from_millis(3), Duration::from_millis(1)]);
        assert_eq!((f.median_ms, f.max_ms), (1.0, 3.0));
    }
}
