//! Telling the batch system what topod changed in a running job.
//!
//! The batch system keeps a job's books (the CPUs it counts, what `scontrol show job` or
//! `qstat -f` says); topod decides which CPUs. When topod gives a running job other CPUs by
//! itself (a resize, equipartition, a defragmenting move, a prime pool opening), the batch
//! system cannot know, and neither Slurm nor PBS lets a running job's CPU count change. So
//! topod writes the change where the batch system shows it:
//! - **Slurm**: the job's `AdminComment` (`scontrol update JobId=N AdminComment=...`;
//!   `man scontrol`: set by Slurm's administrators and root, whom topod runs as). The user's
//!   own `Comment` is left alone.
//! - **PBS**: the job's `comment` (`qalter -W comment=... ID`; OpenPBS lets managers and
//!   operators alter it on a running job: `ATR_DFLAG_ALTRUN` and `NO_USER_SET` in its
//!   `master_job_attr_def.xml`). A root that is no PBS manager or operator of the server is
//!   refused, and the refusal is logged.
//!
//! Which system a job belongs to is read from its id as the plug-ins make it (`slurm-<id>`,
//! `pbs-<id>`); other jobs are not reported. The commands run on one thread of their own, so
//! a slow or unreachable controller never holds the host's lock; a job's report goes
//! [`SETTLE`] after its last change (at most [`MAX_DELAY`] after its first not yet told), its
//! newest replacing one not yet sent; a stop sends what waits ([`BatchReporter::flush`]).
//!
//! The commands run as root with topod's capabilities only (the thread starts after topod has
//! dropped the others): `CAP_NET_BIND_SERVICE` is kept for them, as PBS's default
//! authentication (`resvport`) has qalter's `pbs_iff` bind a reserved port. Each runs in a
//! process group of its own, killed with it; its stderr is read as it comes, the first
//! 2000 bytes quoted in the log when it fails.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long one command may run before it is killed (Slurm's own RPC retries to a
/// controller that does not answer last longer).
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// Jobs with a report waiting, at most; past this the oldest report is dropped (logged).
const MAX_WAITING: usize = 1024;

/// Runs a batch system's command: the OS boundary, real in topod, fake in tests.
pub trait BatchCommands: Send + Sync {
    /// Runs `argv` (its first element a program name, found as [`RealCommands`] says) for at
    /// most `timeout`; `Err` says why it failed, with what the command printed.
    fn run(&self, argv: &[String], timeout: Duration) -> Result<(), String>;
}

/// The command that tells the batch system of `job` that `text` describes it now, or `None`
/// when `job` is no job of a batch system topod knows.
pub fn command_for(job: &str, text: &str) -> Option<Vec<String>> {
    if let Some(id) = job.strip_prefix("slurm-") {
        // Slurm's job ids are numbers (an array task has its own).
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        return Some(vec![
            "scontrol".into(),
            "update".into(),
            format!("JobId={id}"),
            format!("AdminComment={text}"),
        ]);
    }
    if let Some(id) = job.strip_prefix("pbs-") {
        // A subjob of an array ("12[3].server") is refused by qalter (PBSE_IVALREQ:
        // req_modifyjob in OpenPBS's src/server/req_modify.c takes whole jobs only).
        if id.is_empty() || id.starts_with('-') || (id.contains('[') && !id.contains("[]")) {
            return None;
        }
        // qalter's -W splits its value at commas (attribute lists): a CPU list's commas
        // become spaces.
        return Some(vec![
            "qalter".into(),
            "-W".into(),
            format!("comment={}", text.replace(',', " ")),
            id.into(),
        ]);
    }
    None
}

/// What a report says: `topo on node07: resized at 2026-11-28 09:12:03 UTC: runs on 1 CPU (0)`.
/// The host is named: a job on several hosts has one comment, which each host's topod
/// replaces with its own news.
pub fn report_text(
    host: &str,
    why: &str,
    cpus: &topo_core::cpuset::CpuSet,
    at_unix_s: i64,
) -> String {
    let n = cpus.len();
    let when = chrono::DateTime::from_timestamp(at_unix_s, 0)
        .map_or_else(|| at_unix_s.to_string(), |t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string());
    let s = if n == 1 { "" } else { "s" };
    format!("topo on {host}: {why} at {when}: runs on {n} CPU{s} ({cpus})")
}

/// How long after a job's last change its report is sent: a burst of changes (equipartition
/// rebalancing several times) is one command, and the batch system's own word on a job just
/// started comes first (PBS's scheduler writes "Job run at ..." into the comment once the start
/// hooks are done, over anything written during them: seen with OpenPBS 23.06 and
/// `job_run_wait = execjob_hook`).
pub const SETTLE: Duration = Duration::from_secs(10);

/// At most this long after a job's first change not yet told its report is sent, however
/// often the job changes meanwhile (equipartition on a host where short jobs come and go).
pub const MAX_DELAY: Duration = Duration::from_secs(60);

#[derive(Default)]
struct Waiting {
    /// Job to its newest report's text, when it is due, and when its first change not yet
    /// told came.
    reports: BTreeMap<String, (String, Instant, Instant)>,
    /// Reports being run now (for tests that wait until all are done).
    running: usize,
}

impl Waiting {
    /// The job whose report is due first, and when.
    fn next(&self) -> Option<(String, Instant)> {
        self.reports
            .iter()
            .min_by_key(|(_, (_, due, _))| *due)
            .map(|(job, (_, due, _))| (job.clone(), *due))
    }
}

/// Sends reports to the batch systems, one command at a time, on its own thread.
#[derive(Clone)]
pub struct BatchReporter {
    waiting: Arc<(Mutex<Waiting>, Condvar)>,
    settle: Duration,
    /// This host's name, as the reports give it.
    host: String,
}

impl BatchReporter {
    /// Starts the reporting thread, which runs each command through `commands`, `settle` after
    /// the job's last change (see [`SETTLE`]).
    pub fn start(commands: Arc<dyn BatchCommands>, timeout: Duration, settle: Duration) -> Self {
        let waiting: Arc<(Mutex<Waiting>, Condvar)> = Arc::default();
        let shared = waiting.clone();
        let spawned = std::thread::Builder::new().name("batch-report".into()).spawn(move || loop {
            let (job, text) = {
                let (lock, cv) = &*shared;
                let mut w = lock.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    match w.next() {
                        Some((job, due)) if due <= Instant::now() => {
                            let text = w.reports.remove(&job).map(|(text, ..)| text).unwrap_or_default();
                            w.running += 1;
                            break (job, text);
                        }
                        Some((_, due)) => {
                            let left = due.saturating_duration_since(Instant::now());
                            w = cv.wait_timeout(w, left).unwrap_or_else(|e| e.into_inner()).0;
                        }
                        None => w = cv.wait(w).unwrap_or_else(|e| e.into_inner()),
                    }
                }
            };
            if let Some(argv) = command_for(&job, &text) {
                match commands.run(&argv, timeout) {
                    Ok(()) => tracing::info!(job = %job, "told the batch system: {text}"),
                    Err(e) => tracing::warn!(
                        job = %job,
                        "cannot tell the batch system of job {job} that {text:?}: {e} (set tell_batch_system = false in topod.toml to stop trying)"
                    ),
                }
            }
            let (lock, cv) = &*shared;
            lock.lock().unwrap_or_else(|e| e.into_inner()).running -= 1;
            cv.notify_all();
        });
        if let Err(e) = spawned {
            tracing::error!("cannot start the thread that tells batch systems of changes: {e}");
        }
        BatchReporter { waiting, settle, host: this_host() }
    }

    /// Queues the report that `job` runs on `cpus` since `at_unix_s`, after `why` (see
    /// [`report_text`]).
    pub fn report_change(
        &self,
        job: &str,
        why: &str,
        cpus: &topo_core::cpuset::CpuSet,
        at_unix_s: i64,
    ) {
        self.report(job, report_text(&self.host, why, cpus, at_unix_s));
    }

    /// The host name the reports give.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// Queues `text` for `job`, replacing a report of it not yet sent, due `settle` from now.
    /// Jobs of no batch system topod knows are skipped.
    pub fn report(&self, job: &str, text: String) {
        if command_for(job, &text).is_none() {
            return;
        }
        let (lock, cv) = &*self.waiting;
        let mut w = lock.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let first = w.reports.get(job).map_or(now, |(_, _, first)| *first);
        let due = (now + self.settle).min(first + MAX_DELAY.max(self.settle));
        w.reports.insert(job.to_string(), (text, due, first));
        while w.reports.len() > MAX_WAITING {
            if let Some((old, _)) = w.next() {
                w.reports.remove(&old);
                tracing::warn!(
                    "job {old}: its change is not told to the batch system ({MAX_WAITING} reports wait already)"
                );
            }
        }
        cv.notify_all();
    }

    /// Sends every waiting report now, and waits at most `limit` for them: topod stops, and a
    /// report still settling would be lost.
    pub fn flush(&self, limit: Duration) -> bool {
        {
            let (lock, cv) = &*self.waiting;
            let mut w = lock.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            for (_, due, _) in w.reports.values_mut() {
                *due = now;
            }
            cv.notify_all();
        }
        self.wait_idle(limit)
    }

    /// Drops `job`'s report not yet sent, if any.
    pub fn forget(&self, job: &str) {
        let (lock, cv) = &*self.waiting;
        lock.lock().unwrap_or_else(|e| e.into_inner()).reports.remove(job);
        cv.notify_all();
    }

    /// Waits until no report waits or runs, or `limit` has passed; whether none does.
    pub fn wait_idle(&self, limit: Duration) -> bool {
        let (lock, cv) = &*self.waiting;
        let end = Instant::now() + limit;
        let mut w = lock.lock().unwrap_or_else(|e| e.into_inner());
        while !w.reports.is_empty() || w.running > 0 {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            w = cv.wait_timeout(w, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        true
    }
}

/// This host's name up to its first dot, as `squeue` and `qstat` name hosts.
fn this_host() -> String {
    let name = nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned());
    let name = name.unwrap_or_else(|_| "this host".into());
    name.split('.').next().unwrap_or_default().to_string()
}

/// Runs the commands on this host: each program found in `PATH`, and PBS's `qalter` first in
/// `$PBS_EXEC/bin`, as `/etc/pbs.conf` names it (OpenPBS installs in /opt/pbs, which no
/// system `PATH` has).
pub struct RealCommands {
    /// PBS's configuration file.
    pub pbs_conf: PathBuf,
}

impl Default for RealCommands {
    /// PBS's configuration where its own commands look: `$PBS_CONF_FILE`, else /etc/pbs.conf.
    fn default() -> Self {
        let pbs_conf = std::env::var_os("PBS_CONF_FILE")
            .map_or_else(|| PathBuf::from("/etc/pbs.conf"), PathBuf::from);
        RealCommands { pbs_conf }
    }
}

impl RealCommands {
    fn program(&self, name: &str) -> Option<PathBuf> {
        let path =
            std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
        let mut dirs: Vec<PathBuf> = Vec::new();
        // The PBS that pbs.conf names first, then PATH's.
        if name == "qalter" {
            dirs.extend(pbs_exec(&self.pbs_conf).map(|exec| exec.join("bin")));
        }
        dirs.extend(std::env::split_paths(&path));
        dirs.into_iter().map(|d| d.join(name)).find(|p| is_executable(p))
    }
}

/// `PBS_EXEC` of a `pbs.conf` (lines `NAME=value`).
fn pbs_exec(conf: &Path) -> Option<PathBuf> {
    let text = std::fs::read_to_string(conf).ok()?;
    text.lines()
        .find_map(|l| l.trim().strip_prefix("PBS_EXEC="))
        .map(|v| PathBuf::from(v.trim()))
        .filter(|p| p.is_absolute())
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

impl BatchCommands for RealCommands {
    fn run(&self, argv: &[String], timeout: Duration) -> Result<(), String> {
        use std::os::unix::process::CommandExt;
        let (name, args) = argv.split_first().ok_or("no command")?;
        let program = self.program(name).ok_or_else(|| format!("{name}: not found in PATH"))?;
        // A group of its own: a timeout or its end takes a wrapper's children along.
        let mut child = Command::new(&program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .map_err(|e| format!("{}: {e}", program.display()))?;
        let group = nix::unistd::Pid::from_raw(child.id() as i32);
        let kill_group = || {
            let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
        };
        // Read as it comes, never blocking: a command that writes more than a pipe holds, or
        // leaves a child holding its stderr, must not stop the reports.
        let mut stderr = child.stderr.take();
        if let Some(err) = &stderr {
            use nix::fcntl::{fcntl, FcntlArg, OFlag};
            use std::os::fd::AsRawFd;
            let _ = fcntl(err.as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK));
        }
        let mut said = Vec::new();
        let end = Instant::now() + timeout;
        let status = loop {
            drain(&mut stderr, &mut said);
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(50)),
                Ok(None) => {
                    kill_group();
                    let _ = child.wait();
                    return Err(format!("{name} did not finish within {} s", timeout.as_secs()));
                }
                Err(e) => {
                    kill_group();
                    return Err(format!("{name}: {e}"));
                }
            }
        };
        drain(&mut stderr, &mut said);
        kill_group();
        if status.success() {
            return Ok(());
        }
        Err(format!("{name} {status}: {}", String::from_utf8_lossy(&said).trim()))
    }
}

/// What a command's stderr holds now, appended to `said` (its first [`STDERR_KEPT`] bytes);
/// at its end the pipe is dropped.
fn drain(stderr: &mut Option<std::process::ChildStderr>, said: &mut Vec<u8>) {
    use std::io::Read;
    let Some(err) = stderr else { return };
    let mut buf = [0u8; 4096];
    loop {
        match err.read(&mut buf) {
            Ok(0) => {
                *stderr = None;
                return;
            }
            Ok(n) => {
                let room = STDERR_KEPT.saturating_sub(said.len());
                said.extend_from_slice(&buf[..n.min(room)]);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// How much of a failed command's stderr its log line quotes.
const STDERR_KEPT: usize = 2000;

/// Records the commands instead of running them, answering each with `answer`.
#[derive(Default)]
pub struct FakeCommands {
    /// Every command run, in order.
    pub ran: Mutex<Vec<Vec<String>>>,
    /// What each run answers: `None` for success.
    pub answer: Mutex<Option<String>>,
}

impl BatchCommands for FakeCommands {
    fn run(&self, argv: &[String], _timeout: Duration) -> Result<(), String> {
        self.ran.lock().unwrap_or_else(|e| e.into_inner()).push(argv.to_vec());
        match self.answer.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_and_pbs_jobs_get_their_systems_command_and_others_none() {
        assert_eq!(
            command_for("slurm-42", "topo: resized to 1 CPU (0) at t").unwrap(),
            ["scontrol", "update", "JobId=42", "AdminComment=topo: resized to 1 CPU (0) at t"]
        );
        assert_eq!(
            command_for("pbs-12.server", "topo: moved to 3 CPUs (0-1,4) at t").unwrap(),
            ["qalter", "-W", "comment=topo: moved to 3 CPUs (0-1 4) at t", "12.server"]
        );
        assert_eq!(command_for("pbs-12[].server", "t").unwrap()[3], "12[].server");
        // A subjob of an array: qalter refuses it, so none is tried.
        for other in
            ["slurm-", "slurm-12x", "slurm--1", "pbs-", "pbs--W", "pbs-12[3].server", "lsf-7", "42"]
        {
            assert_eq!(command_for(other, "x"), None, "{other}");
        }
    }

    #[test]
    fn the_text_names_the_change_the_cpus_and_the_time() {
        let cpus = topo_core::cpuset::CpuSet::parse_list("0").unwrap();
        assert_eq!(
            report_text("node07", "resized", &cpus, 1_795_000_000),
            "topo on node07: resized at 2026-11-18 11:06:40 UTC: runs on 1 CPU (0)"
        );
        let cpus = topo_core::cpuset::CpuSet::parse_list("2-3").unwrap();
        assert_eq!(
            report_text("n", "moved to make room", &cpus, 0),
            "topo on n: moved to make room at 1970-01-01 00:00:00 UTC: runs on 2 CPUs (2-3)"
        );
    }

    #[test]
    fn a_jobs_newest_report_replaces_one_not_yet_sent_and_others_are_skipped() {
        // The fake blocks until released, so the first report is running while the next come.
        struct Gate {
            inner: FakeCommands,
            open: Mutex<bool>,
            cv: Condvar,
        }
        impl BatchCommands for Gate {
            fn run(&self, argv: &[String], t: Duration) -> Result<(), String> {
                let mut open = self.open.lock().unwrap();
                while !*open {
                    open = self.cv.wait(open).unwrap();
                }
                self.inner.run(argv, t)
            }
        }
        let gate = Arc::new(Gate {
            inner: FakeCommands::default(),
            open: Mutex::new(false),
            cv: Condvar::new(),
        });
        let reporter = BatchReporter::start(gate.clone(), COMMAND_TIMEOUT, Duration::ZERO);
        reporter.report("slurm-1", "first".into());
        // Taken by the thread (it runs now, blocked at the gate) before the next reports.
        while !reporter.waiting.0.lock().unwrap().reports.is_empty() {
            std::thread::yield_now();
        }
        reporter.report("slurm-1", "second".into());
        reporter.report("job-not-of-a-batch-system", "never".into());
        reporter.report("slurm-1", "third".into());
        reporter.report("pbs-7.server", "pbs".into());
        *gate.open.lock().unwrap() = true;
        gate.cv.notify_all();
        assert!(reporter.wait_idle(Duration::from_secs(600)));
        let ran = gate.inner.ran.lock().unwrap().clone();
        let last: Vec<&str> = ran
            .iter()
            .filter_map(|a| a.iter().find(|x| x.contains("omment=")))
            .map(String::as_str)
            .collect();
        assert_eq!(last, ["AdminComment=first", "AdminComment=third", "comment=pbs"]);
    }

    #[test]
    fn a_report_waits_its_settling_time_after_the_jobs_last_change() {
        let fake = Arc::new(FakeCommands::default());
        let reporter =
            BatchReporter::start(fake.clone(), COMMAND_TIMEOUT, Duration::from_secs(3600));
        reporter.report("slurm-1", "a".into());
        reporter.report("slurm-1", "b".into());
        assert!(!reporter.wait_idle(Duration::from_millis(50)));
        assert!(fake.ran.lock().unwrap().is_empty(), "not before the hour");
        let w = reporter.waiting.0.lock().unwrap();
        assert_eq!(w.reports.len(), 1);
        assert_eq!(w.reports["slurm-1"].0, "b");
        assert!(w.reports["slurm-1"].1 > Instant::now() + Duration::from_secs(3000));
        drop(w);
        // topod stops: the report goes now.
        reporter.report("slurm-2", "c".into());
        assert!(reporter.flush(Duration::from_secs(600)));
        assert_eq!(fake.ran.lock().unwrap().len(), 2);
        fake.ran.lock().unwrap().clear();
        // The job ended before its report went: nothing is sent.
        reporter.report("slurm-1", "d".into());
        reporter.forget("slurm-1");
        assert!(reporter.wait_idle(Duration::from_secs(600)));
        assert!(fake.ran.lock().unwrap().is_empty());
    }

    #[test]
    fn a_failing_command_is_logged_and_the_next_report_still_runs() {
        let fake = Arc::new(FakeCommands::default());
        *fake.answer.lock().unwrap() = Some("scontrol: Invalid job id specified".into());
        let reporter = BatchReporter::start(fake.clone(), COMMAND_TIMEOUT, Duration::ZERO);
        reporter.report("slurm-1", "a".into());
        assert!(reporter.wait_idle(Duration::from_secs(600)));
        *fake.answer.lock().unwrap() = None;
        reporter.report("slurm-2", "b".into());
        assert!(reporter.wait_idle(Duration::from_secs(600)));
        assert_eq!(fake.ran.lock().unwrap().len(), 2);
    }

    /// A qalter of PBS_EXEC/bin in `dir` that runs `body` (sh).
    fn fake_qalter(dir: &Path, body: &str) -> RealCommands {
        use std::os::unix::fs::PermissionsExt;
        let bin = dir.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let qalter = bin.join("qalter");
        std::fs::write(&qalter, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&qalter, std::fs::Permissions::from_mode(0o755)).unwrap();
        let conf = dir.join("pbs.conf");
        std::fs::write(&conf, format!("PBS_EXEC={}\n", dir.display())).unwrap();
        RealCommands { pbs_conf: conf }
    }

    /// Found by an attack: commands that write much, write bytes that are not UTF-8, or leave
    /// a child holding their stderr, each once stopped or emptied the reports.
    #[test]
    fn hostile_commands_neither_stop_the_reports_nor_hide_what_they_said() {
        let dir = tempfile::tempdir().unwrap();
        let argv = command_for("pbs-5.srv", "t").unwrap();
        let long = Duration::from_secs(600);
        // 5 MB on stderr: read as it comes, so the command ends and its first words are kept.
        let real = fake_qalter(dir.path(), "head -c 5000000 /dev/zero | tr '\\0' x >&2; exit 1");
        let err = real.run(&argv, long).unwrap_err();
        assert!(err.starts_with("qalter exit status: 1: xxxx"), "{}", &err[..80.min(err.len())]);
        assert!(err.len() < 2100, "at most the first 2000 bytes are quoted ({})", err.len());
        // Not UTF-8: quoted as far as it reads.
        let real = fake_qalter(dir.path(), "printf 'bad \\377\\376 words' >&2; exit 2");
        let err = real.run(&argv, long).unwrap_err();
        assert!(err.contains("bad") && err.contains("words"), "{err}");
        // A child keeps stderr open after the command failed: the command's answer is taken,
        // and the child, of the command's own process group, is killed with it.
        let pid_file = dir.path().join("child.pid");
        let real = fake_qalter(
            dir.path(),
            &format!("sleep 100000 & echo $! > {}; echo failing >&2; exit 2", pid_file.display()),
        );
        let err = real.run(&argv, long).unwrap_err();
        assert_eq!(err, "qalter exit status: 2: failing");
        let child: i32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
        // Killed; reaped by init (a zombie's state is Z meanwhile).
        let gone = || {
            std::fs::read_to_string(format!("/proc/{child}/stat"))
                .map_or(true, |s| s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
        };
        while !gone() {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn a_job_that_keeps_changing_is_told_at_most_the_longest_delay_after_its_first_change() {
        let fake = Arc::new(FakeCommands::default());
        let reporter = BatchReporter::start(fake, COMMAND_TIMEOUT, Duration::from_secs(3600));
        reporter.report("slurm-1", "a".into());
        let first_due = reporter.waiting.0.lock().unwrap().reports["slurm-1"].1;
        reporter.report("slurm-1", "b".into());
        let w = reporter.waiting.0.lock().unwrap();
        let (text, due, _) = &w.reports["slurm-1"];
        assert_eq!(text, "b");
        // The settling time (an hour here) is longer than the longest delay: it is the bound,
        // and a second change does not push the report later than the first's.
        assert!(*due <= first_due, "{due:?} after {first_due:?}");
    }

    #[test]
    fn real_commands_say_what_failed_and_find_qalter_through_pbs_conf() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        let qalter = bin.join("qalter");
        std::fs::write(
            &qalter,
            "#!/bin/sh\necho \"qalter: Unauthorized Request $*\" >&2\nexit 3\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&qalter, std::fs::Permissions::from_mode(0o755)).unwrap();
        let conf = dir.path().join("pbs.conf");
        std::fs::write(&conf, format!("PBS_SERVER=x\nPBS_EXEC={}\n", dir.path().display()))
            .unwrap();
        let real = RealCommands { pbs_conf: conf };
        let argv = command_for("pbs-5.srv", "topo: t").unwrap();
        let err = real.run(&argv, COMMAND_TIMEOUT).unwrap_err();
        assert!(
            err.contains("exit status: 3")
                && err.contains("Unauthorized Request -W comment=topo: t 5.srv"),
            "{err}"
        );
        let missing =
            real.run(&["no-such-program-of-topo".to_string()], COMMAND_TIMEOUT).unwrap_err();
        assert_eq!(missing, "no-such-program-of-topo: not found in PATH");
    }
}
