//! A malleable job resized through a real topod on real cgroups (issue 18): the real malleable
//! C program (tests/malleable/malleable.c, on libtopo's `topo_resize_wait`) started by
//! `topo-exec` with a `*min-max` request is shrunk and grown by the protocol's `resize`; its
//! cgroup, its threads' affinities, its log (generation, CPUs, workers, signals counted) and
//! `/proc/PID/task` follow. Refusals (outside the range, a rigid job, no room, a user who does
//! not own the job, an owner who asks for more) change nothing. topod killed by SIGKILL and
//! started again keeps the resized CPUs, and the job's notify file never goes back a generation.
//!
//! Needs root and a cpuset controller with at least two CPUs (v1 on the CI machine class, v2 in
//! tests/cgroup-v2-vm.sh's guest); skipped visibly elsewhere. The program is built by
//! tests/malleable/build.sh against the newest libtopo.so of this target directory (`cargo test
//! --workspace` builds it; alone: `cargo build -p topo-capi`). Its workers spin, so it is
//! killed by a drop guard whatever fails first, and the test's cgroup subtree (with anything
//! left in it) is removed by another.

mod common;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use topo_client::Client;
use topo_core::ledger::Allocation;
use topo_core::proto::{AllocateArgs, Op};
use topo_core::CpuSet;

/// How long anything the test waits for may take (the v2 guest's CPUs are emulated).
const PATIENCE: Duration = Duration::from_secs(30);

/// The resize signal the job asks for and the program counts: SIGUSR1.
const SIGNAL: &str = "10";

/// The malleable program built in `dir` against the newest libtopo.so of this target directory
/// (beside this test's executable, as `cargo test --workspace` leaves it, or one level up, as
/// `cargo build -p topo-capi` does).
fn build_malleable(dir: &Path) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap().to_path_buf();
    let lib_dir = [deps.clone(), deps.parent().unwrap().to_path_buf()]
        .into_iter()
        .filter_map(|d| {
            let modified = std::fs::metadata(d.join("libtopo.so")).ok()?.modified().ok()?;
            Some((modified, d))
        })
        .max()
        .map(|(_, d)| d)
        .unwrap_or_else(|| {
            panic!(
                "no libtopo.so in {} or its parent: build it with `cargo build -p topo-capi`",
                deps.display()
            )
        });
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/malleable/build.sh");
    let out = Command::new("bash").arg(&script).arg(dir).arg(&lib_dir).output().unwrap();
    assert!(
        out.status.success(),
        "tests/malleable/build.sh failed (a C compiler is needed: tests/install-deps.sh): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// The malleable program running as a job (topo-exec execs it, so the child is the program),
/// killed and reaped when dropped.
struct Malleable {
    child: Child,
    log: PathBuf,
}

impl Drop for Malleable {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Malleable {
    /// Starts `program` as job `job` with `request` through topo-exec, asking for the resize
    /// signal and counting it.
    fn start(program: &Path, socket: &Path, dir: &Path, job: &str, request: &str) -> Malleable {
        let log = dir.join(format!("{job}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_topo-exec"))
            .arg("--socket")
            .arg(socket)
            .args(["--job", job, "--request", request, "--resize-signal", SIGNAL, "--"])
            .arg(program)
            .args(["--signal", SIGNAL])
            .arg(&log)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        Malleable { child, log }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The log's lines once there are `count`, or a failure naming what is there.
    fn lines(&mut self, count: usize) -> Vec<String> {
        let start = Instant::now();
        loop {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            let lines: Vec<String> = text.lines().map(str::to_string).collect();
            if lines.len() >= count {
                return lines;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "the program ended ({status}) with {} of {count} lines: {text}",
                    lines.len()
                );
            }
            assert!(start.elapsed() < PATIENCE, "{} of {count} log lines: {text:?}", lines.len());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Each of the process's threads' `Cpus_allowed_list` (threads that end meanwhile left out).
    fn thread_affinities(&self) -> Vec<String> {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", self.pid())) else {
            return Vec::new();
        };
        tasks
            .flatten()
            .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
            .filter_map(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                    .map(|v| v.trim().to_string())
            })
            .collect()
    }

    /// Waits until the process has `workers` workers (plus main and the control thread, what
    /// `/proc/PID/task` counts) and every thread is allowed exactly `cpus`. A worker the program
    /// has joined may still be listed for a moment, so this waits rather than looks once.
    fn expect_threads_on(&self, workers: usize, cpus: &CpuSet) {
        let start = Instant::now();
        loop {
            let seen = self.thread_affinities();
            let on = seen.iter().all(|a| CpuSet::parse_list(a).ok().as_ref() == Some(cpus));
            if seen.len() == workers + 2 && on {
                return;
            }
            assert!(
                start.elapsed() < PATIENCE,
                "wanted {workers} workers + 2 threads on CPUs {cpus}; the threads are on {seen:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// The value of `key=` in one of the program's log lines.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// The generation a notify file says, `None` when it cannot be read.
fn notify_generation(file: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    text.lines().find_map(|l| l.strip_prefix("generation="))?.parse().ok()
}

/// Samples a notify file every 2 ms on a thread of its own until dropped; `stop` gives what it
/// read, in order (`None`: the file could not be read at that moment).
struct GenerationWatch {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<Option<u64>>>>,
}

impl GenerationWatch {
    fn start(file: PathBuf) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut seen = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                seen.push(notify_generation(&file));
                std::thread::sleep(Duration::from_millis(2));
            }
            // And once after the stop: on a loaded machine the thread may not have run since
            // the last change its caller waited for.
            seen.push(notify_generation(&file));
            seen
        });
        GenerationWatch { stop, thread: Some(thread) }
    }

    fn stop(mut self) -> Vec<Option<u64>> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for GenerationWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The CPUs the job's cgroup has (`cpuset.cpus`, in v1 and v2 alike).
fn cgroup_cpus(cpuset_root: &Path, job: &str) -> CpuSet {
    let text = std::fs::read_to_string(cpuset_root.join(job).join("cpuset.cpus")).unwrap();
    CpuSet::parse_list(text.trim()).unwrap()
}

fn resize(c: &mut Client, job: &str, tasks: u32) -> Allocation {
    c.call_as(Op::Resize { job: job.into(), tasks })
        .unwrap_or_else(|e| panic!("resize {job} to {tasks}: {e}"))
}

/// Checks a resize to `alloc` all the way to the job: its cgroup, the program's new log line
/// (number `line`: the generation, the CPUs, one worker per CPU, the signals counted so far,
/// the threads' affinity), its threads in `/proc` and the notify file.
fn expect_resized(
    m: &mut Malleable,
    cpuset_root: &Path,
    notify: &Path,
    alloc: &Allocation,
    line: usize,
    generation: u64,
    signals: u32,
) {
    let job = alloc.job.as_str();
    assert_eq!(cgroup_cpus(cpuset_root, job), alloc.cpus, "job {job}'s cgroup");
    let lines = m.lines(line + 1);
    let l = &lines[line];
    let cpus = alloc.cpus.to_string();
    let workers = alloc.cpus.len().to_string();
    assert_eq!(
        (
            field(l, "generation"),
            field(l, "cpus"),
            field(l, "threads"),
            field(l, "signals"),
            field(l, "affinity")
        ),
        (
            Some(generation.to_string().as_str()),
            Some(cpus.as_str()),
            Some(workers.as_str()),
            Some(signals.to_string().as_str()),
            Some(cpus.as_str())
        ),
        "log line {line}: {l}"
    );
    m.expect_threads_on(alloc.cpus.len(), &alloc.cpus);
    assert_eq!(notify_generation(notify), Some(generation), "{}", notify.display());
}

/// The CPUs no job holds, as topod sees them.
fn free_cpus(c: &mut Client) -> CpuSet {
    let free = c.free_map().unwrap();
    free.allocatable.difference(&free.held).difference(&free.fenced)
}

#[test]
fn a_real_malleable_program_follows_its_resizes_and_a_restart_keeps_them() {
    let dir = common::open_dir();
    let Some((d, cgroups, subtree, _cleanup, config)) =
        common::real_daemon(dir.path(), "topo-resize-test", "")
    else {
        return;
    };
    let mut d = d;
    let mut c = Client::connect(&d.socket).unwrap();
    let pus = c.free_map().unwrap().allocatable.len();
    if pus < 2 {
        common::skip(&format!("a resize needs two CPUs topod may give; it has {pus}"));
        return;
    }
    let program = build_malleable(dir.path());
    let cpuset_root = cgroups.roots(&subtree)[0].clone();
    let notify = topo_core::proto::notify_file_for(&d.socket, "m1");

    // A malleable job of one or two tasks starts with the most that fit: two.
    let mut m = Malleable::start(&program, &d.socket, dir.path(), "m1", "affinity[thread*1-2]");
    let first = m.lines(1);
    let start: Allocation = {
        let list = c.list().unwrap();
        list.into_iter().find(|j| j.allocation.job == "m1").unwrap().allocation
    };
    assert_eq!(start.tasks.len(), 2, "{start:?}");
    expect_resized(&mut m, &cpuset_root, &notify, &start, 0, 1, 0);
    assert!(first[0].starts_with("generation=1 "), "{first:?}");

    // Shrink to one task: the first task's CPU is kept.
    let small = resize(&mut c, "m1", 1);
    assert_eq!(small.tasks, start.tasks[..1].to_vec(), "a shrink keeps the first task");
    expect_resized(&mut m, &cpuset_root, &notify, &small, 1, 2, 1);

    // Refused, with a message that says why; nothing changes.
    let rigid_tasks = free_cpus(&mut c).len() as u32;
    let mut sleeper = Command::new("sleep").arg("300").spawn().unwrap();
    let rigid = c
        .call_as::<Allocation>(Op::Allocate(AllocateArgs {
            join_pid: Some(sleeper.id() as i32),
            ..AllocateArgs::new("rigid", format!("affinity[thread*{rigid_tasks}]"))
        }))
        .unwrap();
    for (job, tasks, says) in [
        ("m1", 3, "job m1 runs with 1 to 2 tasks; 3 is outside that range"),
        ("m1", 0, "job m1 runs with 1 to 2 tasks; 0 is outside that range"),
        ("rigid", 1, "job rigid is not malleable"),
        ("m1", 2, "does not fit"),
        ("nobody", 1, "nobody"),
    ] {
        let e = c.call(Op::Resize { job: job.into(), tasks }).unwrap_err().to_string();
        assert!(e.contains(says), "resize {job} to {tasks}: {e:?} should say {says:?}");
    }
    assert_eq!(cgroup_cpus(&cpuset_root, "m1"), small.cpus);
    assert_eq!(cgroup_cpus(&cpuset_root, "rigid"), rigid.cpus);
    assert_eq!(notify_generation(&notify), Some(2), "a refusal tells the job nothing");
    assert_eq!(m.lines(2).len(), 2);
    c.call(Op::Release { job: "rigid".into() }).unwrap();
    let _ = sleeper.wait();

    // Grown back to two: the same two CPUs (its first task stays where it is).
    let grown = resize(&mut c, "m1", 2);
    assert_eq!(grown.tasks[0], small.tasks[0]);
    expect_resized(&mut m, &cpuset_root, &notify, &grown, 2, 3, 2);
    // The same size again is no change: no new generation, no signal.
    assert_eq!(resize(&mut c, "m1", 2), grown);
    assert_eq!(notify_generation(&notify), Some(3));

    // Shrunk, then topod is killed (SIGKILL) and started again, twice: the job keeps its one
    // CPU, its record keeps the generation and the signal, and the notify file never goes
    // back, or away, meanwhile.
    let small = resize(&mut c, "m1", 1);
    expect_resized(&mut m, &cpuset_root, &notify, &small, 3, 4, 3);
    let watch = GenerationWatch::start(notify.clone());
    for _ in 0..2 {
        drop(c);
        d.child.kill().unwrap();
        d.child.wait().unwrap();
        drop(d);
        assert_eq!(cgroup_cpus(&cpuset_root, "m1"), small.cpus, "the kernel keeps it meanwhile");
        d = common::start(dir.path(), &["--config", config.to_str().unwrap()], false);
        c = Client::connect(&d.socket).unwrap();
        let list = c.list().unwrap();
        let kept = &list.iter().find(|j| j.allocation.job == "m1").unwrap().allocation;
        assert_eq!((&kept.cpus, &kept.tasks), (&small.cpus, &small.tasks), "after a restart");
        assert_eq!(cgroup_cpus(&cpuset_root, "m1"), small.cpus);
        assert_eq!(notify_generation(&notify), Some(4), "a restart is no new generation");
    }
    // Its owner-chosen signal and its generation count survived: the next resize is generation
    // 5 and the fourth signal.
    let grown = resize(&mut c, "m1", 2);
    expect_resized(&mut m, &cpuset_root, &notify, &grown, 4, 5, 4);
    let seen = watch.stop();
    assert!(seen.iter().all(Option::is_some), "the notify file went missing: {seen:?}");
    let seen: Vec<u64> = seen.into_iter().flatten().collect();
    assert!(seen.windows(2).all(|w| w[0] <= w[1]), "a generation went back: {seen:?}");
    assert_eq!((seen.first(), seen.last()), (Some(&4), Some(&5)));
    assert_eq!(m.lines(5).len(), 5, "the restarts wrote no generation of their own");

    // Released: the program is killed, its notify file and cgroup are gone.
    c.call(Op::Release { job: "m1".into() }).unwrap();
    let status = m.child.wait().unwrap();
    assert!(status.code().is_none(), "killed by the release: {status}");
    assert!(!notify.exists());
    assert!(!cpuset_root.join("m1").exists());
}

/// topod on real cgroups (see `common::real_daemon`) with a client, where it may give two CPUs
/// (a resize needs them); `None`, having said SKIPPED, elsewhere.
fn two_cpu_daemon(
    dir: &Path,
    name: &str,
) -> Option<(common::Daemon, common::RealCgroups, String, common::SubtreeCleanup, Client)> {
    let (d, cgroups, subtree, cleanup, _config) = common::real_daemon(dir, name, "")?;
    let mut c = Client::connect(&d.socket).unwrap();
    let pus = c.free_map().unwrap().allocatable.len();
    if pus < 2 {
        common::skip(&format!("a resize needs two CPUs topod may give; it has {pus}"));
        return None;
    }
    Some((d, cgroups, subtree, cleanup, c))
}

#[test]
fn the_owner_may_shrink_a_malleable_job_but_not_grow_it_and_others_may_not_resize_it() {
    let dir = common::open_dir();
    let Some((d, cgroups, subtree, _cleanup, mut c)) =
        two_cpu_daemon(dir.path(), "topo-resize-owner-test")
    else {
        return;
    };
    let cpuset_root = cgroups.roots(&subtree)[0].clone();
    let start: Allocation = c
        .call_as(Op::Allocate(AllocateArgs {
            owner_uid: Some(65534),
            ..AllocateArgs::new("owned", "affinity[thread*1-2]")
        }))
        .unwrap();
    assert_eq!(start.tasks.len(), 2);
    let socket = d.socket.to_str().unwrap().to_string();
    let resize_as = |uid: u32, tasks: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_topoctl"))
            .args(["resize", "owned", tasks, "--socket", &socket])
            .uid(uid)
            .gid(65534)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    // Someone else: refused, whichever way.
    for tasks in ["1", "2"] {
        let (ok, text) = resize_as(65533, tasks);
        assert!(
            !ok && text.contains(
                "resizing a job that is not yours needs root or a configured administrator"
            ),
            "{text}"
        );
    }
    assert_eq!(cgroup_cpus(&cpuset_root, "owned"), start.cpus);
    // The owner gives a CPU back.
    let (ok, text) = resize_as(65534, "1");
    assert!(ok && text.contains("job owned now runs 1 tasks"), "{text}");
    let small = &start.tasks[0];
    assert_eq!(&cgroup_cpus(&cpuset_root, "owned"), small);
    // Growing is the batch system's (root's) decision, even back to where it was.
    let (ok, text) = resize_as(65534, "2");
    assert!(
        !ok && text.contains("growing a job needs root or a configured administrator"),
        "{text}"
    );
    assert_eq!(&cgroup_cpus(&cpuset_root, "owned"), small);
    // Asking for the size it has is no growth.
    let (ok, text) = resize_as(65534, "1");
    assert!(ok, "{text}");
    let grown = resize(&mut c, "owned", 2);
    assert_eq!(cgroup_cpus(&cpuset_root, "owned"), grown.cpus);
    c.call(Op::Release { job: "owned".into() }).unwrap();
}

/// The CPUs `pid` may run on (`Cpus_allowed_list` in `/proc/PID/status`).
fn allowed(pid: u32) -> CpuSet {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let list = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap();
    CpuSet::parse_list(list.trim()).unwrap()
}

/// A task pinned to one CPU by its batch system (Slurm's task/affinity binds each task with
/// sched_setaffinity, and the plug-in narrows it to the task's CPUs) follows a resize of its
/// job: since Linux 6.2 a cpuset change keeps a thread's own mask, so topod sets it.
#[test]
fn a_pinned_task_of_a_malleable_job_reaches_the_cpus_a_grow_adds() {
    let dir = common::open_dir();
    let Some((_d, _cgroups, _subtree, _cleanup, mut c)) =
        two_cpu_daemon(dir.path(), "topo-pinned-test")
    else {
        return;
    };
    let start: Allocation =
        c.allocate(Op::Allocate(AllocateArgs::new("p1", "affinity[thread*1-2]"))).unwrap();
    assert_eq!(start.tasks.len(), 2, "{start:?}");
    let first = start.tasks[0].first().unwrap();
    struct Kill(Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let task = Kill(
        Command::new("taskset").args(["-c", &first.to_string(), "sleep", "60"]).spawn().unwrap(),
    );
    let pid = task.0.id();
    let deadline = Instant::now() + PATIENCE;
    while allowed(pid) != CpuSet::parse_list(&first.to_string()).unwrap() {
        assert!(Instant::now() < deadline, "taskset did not pin {pid}");
        std::thread::sleep(Duration::from_millis(10));
    }
    c.call_as::<topo_core::proto::reply::Join>(Op::Join { job: "p1".into(), pid: pid as i32 })
        .unwrap();
    let small = resize(&mut c, "p1", 1);
    assert_eq!(allowed(pid), small.cpus, "after the shrink");
    let grown = resize(&mut c, "p1", 2);
    assert_eq!(grown.cpus, start.cpus);
    assert_eq!(
        allowed(pid),
        grown.cpus,
        "after the grow: the task may run on every CPU of its job"
    );
    drop(task);
    c.release("p1").unwrap();
}
