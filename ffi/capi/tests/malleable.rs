//! The malleable test program (tests/malleable/malleable.c) against libtopo's
//! `topo_resize_wait`, without topod: the test plays topod's part by rewriting the notify file
//! (temporary file, rename) and sending the resize signal, and checks the program's reaction in
//! its log and in `/proc/PID/task`.
//!
//! The program is built by tests/malleable/build.sh against the libtopo.so that this `cargo test`
//! built (the cdylib beside this test's executable). Its workers spin, so every run is killed by
//! a drop guard, whatever fails first.

use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const PATIENCE: Duration = Duration::from_secs(10);

/// A running malleable program, killed (SIGKILL) and reaped when dropped.
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
    fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
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
                panic!("malleable ended ({status}) with {} of {count} lines: {text}", lines.len());
            }
            assert!(start.elapsed() < PATIENCE, "{} of {count} log lines: {text:?}", lines.len());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The number of threads the kernel shows for the process.
    fn tasks(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/task", self.child.id())).unwrap().count()
    }

    /// Waits for the process to end by itself.
    fn exit_status(&mut self) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(start.elapsed() < PATIENCE, "malleable did not end");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A fresh build of the program in `dir`.
fn build(dir: &Path) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // The cdylib sits beside the test executable (target/debug/deps), built by this cargo test.
    let lib_dir = exe.parent().unwrap();
    assert!(
        lib_dir.join("libtopo.so").is_file(),
        "no libtopo.so beside {} (cargo test -p topo-capi builds it)",
        exe.display()
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/malleable/build.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg(dir)
        .arg(lib_dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "tests/malleable/build.sh failed (a C compiler is needed: tests/install-deps.sh): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// Rewrites the notify file as topod does: a temporary file beside it, then a rename.
fn rewrite(notify: &Path, generation: u64, cpus: &str) {
    let tmp = notify.with_extension("tmp");
    std::fs::write(&tmp, format!("generation={generation}\ncpus={cpus}\nmems=0\n")).unwrap();
    std::fs::rename(&tmp, notify).unwrap();
}

/// Starts the program: `options`, then its log (in `dir`), then `threads` if given.
fn start(
    program: &Path,
    dir: &Path,
    notify: &Path,
    options: &[&str],
    threads: Option<usize>,
) -> Malleable {
    let log = dir.join("log");
    let child = Command::new(program)
        .args(options)
        .arg(&log)
        .args(threads.map(|t| t.to_string()))
        .env("TOPO_NOTIFY_FILE", notify)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    Malleable { child, log }
}

/// This process's CPUs, as a list in the kernel's form ("0-3,8") and one by one.
fn own_cpus() -> (String, Vec<usize>) {
    let set = sched_getaffinity(Pid::from_raw(0)).unwrap();
    let ids: Vec<usize> =
        (0..CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect();
    let mut ranges: Vec<(usize, usize)> = Vec::new();
    for &id in &ids {
        match ranges.last_mut() {
            Some((_, last)) if *last + 1 == id => *last = id,
            _ => ranges.push((id, id)),
        }
    }
    let list = ranges
        .iter()
        .map(|&(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") })
        .collect::<Vec<_>>()
        .join(",");
    (list, ids)
}

#[test]
fn one_worker_per_cpu_follows_each_generation_and_counts_the_resize_signal() {
    let dir = tempfile::tempdir().unwrap();
    let program = build(dir.path());
    let notify = dir.path().join("job-42");
    let (list, ids) = own_cpus();
    let count = ids.len();
    rewrite(&notify, 1, &list);
    let mut m = start(&program, dir.path(), &notify, &["--signal", "10"], None);

    let lines = m.lines(1);
    assert!(
        lines[0].starts_with(&format!("generation=1 cpus={list} "))
            && lines[0].contains(&format!(" threads={count} signals=0 ")),
        "{lines:?}"
    );
    // Workers, main and the control thread.
    assert_eq!(m.tasks(), count + 2);

    // Shrink to one CPU, with the signal topod sends after the rewrite.
    rewrite(&notify, 2, "0");
    kill(m.pid(), Signal::SIGUSR1).unwrap();
    let lines = m.lines(2);
    assert!(lines[1].starts_with("generation=2 cpus=0 threads=1 signals=1 "), "{lines:?}");
    assert_eq!(m.tasks(), 3);

    // Grow to three (the program only counts the list), with no signal: the count stays.
    rewrite(&notify, 3, "0-2");
    let lines = m.lines(3);
    assert!(lines[2].starts_with("generation=3 cpus=0-2 threads=3 signals=1 "), "{lines:?}");
    assert_eq!(m.tasks(), 5);

    // A rewrite without a new generation is no change.
    rewrite(&notify, 3, "0");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(m.lines(3).len(), 3);
    assert_eq!(m.tasks(), 5);

    kill(m.pid(), Signal::SIGTERM).unwrap();
    let status = m.exit_status();
    assert!(status.success(), "SIGTERM should end it cleanly: {status}");
}

#[test]
fn a_fixed_thread_count_only_checks_that_the_threads_moved_to_the_new_cpus() {
    let dir = tempfile::tempdir().unwrap();
    let program = build(dir.path());
    let notify = dir.path().join("job-43");
    let (list, ids) = own_cpus();
    rewrite(&notify, 1, &list);
    let mut m = start(&program, dir.path(), &notify, &[], Some(3));
    let lines = m.lines(1);
    assert!(
        lines[0].contains(" threads=3 ") && lines[0].ends_with(" on_new_cpus=yes"),
        "{lines:?}"
    );
    assert_eq!(m.tasks(), 5);

    // What topod's cpuset change does to the threads: every one moves to the first CPU.
    let first = ids[0];
    let mut only_first = CpuSet::new();
    only_first.set(first).unwrap();
    for task in std::fs::read_dir(format!("/proc/{}/task", m.child.id())).unwrap() {
        let tid: i32 = task.unwrap().file_name().to_str().unwrap().parse().unwrap();
        sched_setaffinity(Pid::from_raw(tid), &only_first).unwrap();
    }
    rewrite(&notify, 2, &first.to_string());
    let lines = m.lines(2);
    assert_eq!(
        lines[1],
        format!("generation=2 cpus={first} threads=3 affinity={first} on_new_cpus=yes")
    );

    // A list the threads were not moved to: after its second of patience, "no".
    rewrite(&notify, 3, &(first + 1).to_string());
    let lines = m.lines(3);
    assert!(
        lines[2].starts_with(&format!("generation=3 cpus={} threads=3 ", first + 1))
            && lines[2].ends_with(" on_new_cpus=no"),
        "{lines:?}"
    );
    assert_eq!(m.tasks(), 5);

    // The file gone (as at the job's end): an error line and status 1, not a hang.
    std::fs::remove_file(&notify).unwrap();
    let status = m.exit_status();
    assert_eq!(status.code(), Some(1));
    let lines = m.lines(4);
    assert!(lines[3].starts_with("error=cannot read notify file"), "{lines:?}");
}

#[test]
fn without_a_notify_file_it_says_so_and_starts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let program = build(dir.path());
    let out = Command::new(&program)
        .arg(dir.path().join("log"))
        .env_remove("TOPO_NOTIFY_FILE")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("TOPO_NOTIFY_FILE is not set"), "{stderr}");
}
