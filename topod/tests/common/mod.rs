//! What the integration tests share: where the real machines live, and clean-up of test cgroups.

// Each test binary uses only some of these.
#![allow(dead_code)]

use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `shared/topologies`: `$TOPO_SHARED_DIR/topologies`, else `../shared/topologies` beside the
/// repository. Missing is a failure, not a skip: CI always has it.
pub fn topologies() -> PathBuf {
    let dir = std::env::var_os("TOPO_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"));
    let t = dir.join("topologies");
    assert!(
        t.join("expected-counts.tsv").is_file(),
        "shared topologies missing at {}; set TOPO_SHARED_DIR",
        t.display()
    );
    t
}

/// Kills every process left in the cgroup directories under `root` and removes them and `root`
/// (test clean-up that must work even after a failed assertion).
pub fn remove_cgroup_tree(root: &std::path::Path) {
    // Deepest first: a test may leave cgroups made inside a job's (nested), and rmdir of a
    // cgroup with children is EBUSY. A mount left inside (a test's bind mount) is not entered:
    // what it shows is not the test's to kill.
    if let Ok(entries) = std::fs::read_dir(root) {
        for e in entries.flatten() {
            let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
            if is_dir && !is_mount_point(&e.path()) {
                remove_cgroup_tree(&e.path());
            }
        }
    }
    if let Ok(procs) = std::fs::read_to_string(root.join("cgroup.procs")) {
        let pids: Vec<i32> = procs.split_whitespace().filter_map(|p| p.parse().ok()).collect();
        for &pid in &pids {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        if !pids.is_empty() {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
    let _ = std::fs::remove_dir(root);
}

/// Whether `path` is where something is mounted (/proc/self/mountinfo's fifth field).
fn is_mount_point(path: &std::path::Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else { return false };
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|m| std::path::Path::new(&m.replace("\\040", " ")) == path)
}

/// The real cgroup hierarchies that the integration tests create jobs in: v1 where the cpuset
/// controller is a v1 hierarchy (CI's machine class, with freezer and memory beside it), v2 where
/// it is in the unified hierarchy (a pure v2 host, such as the guest of tests/cgroup-v2-vm.sh).
#[derive(Debug, Clone)]
pub enum RealCgroups {
    V1 { cpuset: PathBuf, freezer: Option<PathBuf>, memory: Option<PathBuf>, cpu: Option<PathBuf> },
    V2 { mount: PathBuf },
}

impl RealCgroups {
    /// This host's hierarchies, or why a test that needs real cpusets cannot run here. With
    /// `TOPO_REQUIRE_REAL_CGROUPS` set (tests/cgroup-v2-vm.sh sets it in its guest), a host that
    /// has none fails the test instead of skipping it.
    pub fn detect() -> Result<Self, String> {
        let found = Self::find();
        if let (Err(why), Some(_)) = (&found, std::env::var_os("TOPO_REQUIRE_REAL_CGROUPS")) {
            panic!("TOPO_REQUIRE_REAL_CGROUPS is set, but {why}");
        }
        found
    }

    fn find() -> Result<Self, String> {
        if !nix::unistd::geteuid().is_root() {
            return Err("real cgroups need root".into());
        }
        let mounts = std::fs::read_to_string("/proc/mounts")
            .map_err(|e| format!("reading /proc/mounts: {e}"))?;
        if let (Some(cpuset), freezer, memory) = topod::cgroup::v1::v1_mounts(&mounts) {
            let cpu = topod::cgroup::v1::v1_cpu_mount(&mounts);
            return Ok(RealCgroups::V1 { cpuset, freezer, memory, cpu });
        }
        if let Some(mount) = topod::cgroup::v2::v2_mount(&mounts) {
            let offered =
                std::fs::read_to_string(mount.join("cgroup.controllers")).unwrap_or_default();
            if offered.split_whitespace().any(|c| c == "cpuset") {
                return Ok(RealCgroups::V2 { mount });
            }
        }
        Err("no cpuset controller is mounted, neither as a v1 hierarchy nor in the unified v2 one"
            .into())
    }

    /// `"v1"` or `"v2"`, as topod's config spells it.
    pub fn kind(&self) -> &'static str {
        match self {
            RealCgroups::V1 { .. } => "v1",
            RealCgroups::V2 { .. } => "v2",
        }
    }

    /// Where topod puts `cgroup_subtree = "<subtree>"` in every hierarchy (v2: `<subtree>.slice`);
    /// the first is the one whose job directories hold the cpusets.
    pub fn roots(&self, subtree: &str) -> Vec<PathBuf> {
        match self {
            RealCgroups::V1 { cpuset, freezer, memory, cpu } => {
                [Some(cpuset), freezer.as_ref(), memory.as_ref(), cpu.as_ref()]
                    .into_iter()
                    .flatten()
                    .map(|m| m.join(subtree))
                    .collect()
            }
            RealCgroups::V2 { mount } => vec![mount.join(format!("{subtree}.slice"))],
        }
    }

    /// A backend on `subtree` (created if missing), as topod would make it.
    pub fn backend(&self, subtree: &str) -> Box<dyn topod::cgroup::CgroupBackend> {
        match self {
            RealCgroups::V1 { cpuset, freezer, memory, cpu } => Box::new(
                topod::cgroup::v1::V1::new(
                    cpuset.join(subtree),
                    freezer.as_ref().map(|f| f.join(subtree)),
                    memory.as_ref().map(|m| m.join(subtree)),
                )
                .expect("v1 subtree")
                .with_cpu_groups(cpu.as_ref().map(|c| c.join(subtree))),
            ),
            RealCgroups::V2 { mount } => Box::new(
                topod::cgroup::v2::V2::new(mount.join(format!("{subtree}.slice")))
                    .expect("v2 subtree")
                    .with_cpu_groups(),
            ),
        }
    }

    /// The file that holds a job's memory limit, where the memory controller is there.
    pub fn memory_limit_file(&self, subtree: &str, job: &str) -> Option<PathBuf> {
        match self {
            RealCgroups::V1 { memory, .. } => {
                memory.as_ref().map(|m| m.join(subtree).join(job).join("memory.limit_in_bytes"))
            }
            RealCgroups::V2 { mount } => {
                let offered =
                    std::fs::read_to_string(mount.join("cgroup.controllers")).unwrap_or_default();
                offered
                    .split_whitespace()
                    .any(|c| c == "memory")
                    .then(|| mount.join(format!("{subtree}.slice")).join(job).join("memory.max"))
            }
        }
    }
}

/// Removes a test's subtree from every hierarchy (killing what is left in it) when the test
/// ends, pass or fail.
pub struct SubtreeCleanup(pub Vec<PathBuf>);

impl Drop for SubtreeCleanup {
    fn drop(&mut self) {
        for root in &self.0 {
            remove_cgroup_tree(root);
        }
    }
}

/// A topod process that is killed when the test ends.
pub struct Daemon {
    pub child: Child,
    pub socket: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts topod on an emulated 2-socket EPYC 9654 (`emulate`), or on this host's own topology.
pub fn start(dir: &Path, extra: &[&str], emulate: bool) -> Daemon {
    let socket = dir.join("topod.sock");
    let zen4 = topologies().join("converted-hwloc2.9/AMD-19h-Zen4-2xEpyc-9654.xml");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_topod"));
    cmd.args(["--socket", socket.to_str().unwrap(), "--state-dir", dir.to_str().unwrap()]);
    if emulate {
        cmd.args(["--topology", zen4.to_str().unwrap()]);
    }
    // Its log goes to topod.log beside the socket, for the tests that read it.
    let log = std::fs::File::create(dir.join("topod.log")).expect("topod.log");
    let child = cmd.args(extra).stderr(Stdio::from(log)).spawn().expect("topod starts");
    let start = Instant::now();
    while UnixStream::connect(&socket).is_err() {
        assert!(start.elapsed() < Duration::from_secs(20), "topod did not open its socket");
        std::thread::sleep(Duration::from_millis(20));
    }
    Daemon { child, socket }
}

/// Sends raw bytes as one request and returns the reply object.
pub fn raw(socket: &Path, bytes: &[u8]) -> Value {
    let mut s = UnixStream::connect(socket).unwrap();
    // topod answers a line longer than its limit and closes before reading the rest: a write
    // that then finds the connection closed ("Broken pipe", seen on a busy machine) is no
    // failure, the answer waits to be read.
    let _ = s.write_all(&[bytes, b"\n"].concat());
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("reply {line:?}: {e}"))
}

/// One request line (a JSON object without `v`, as the attack tests write it) and its reply.
pub fn ask(socket: &Path, request: &str) -> Value {
    let line = format!("{{\"v\":1,{}", request.trim_start_matches('{'));
    raw(socket, line.as_bytes())
}

/// [`ask`], which must succeed: its `ok` value.
pub fn ok(socket: &Path, request: &str) -> Value {
    let reply = ask(socket, request);
    assert!(reply.get("ok").is_some(), "{request} should succeed: {reply}");
    reply["ok"].clone()
}

pub fn error_of(v: &Value) -> (String, String) {
    (
        v["error"]["code"].as_str().unwrap_or("").to_string(),
        v["error"]["message"].as_str().unwrap_or("").to_string(),
    )
}

pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// topod on this host's real cgroups (v1 or v2, whichever holds the cpuset controller), on a
/// subtree of its own named after `name`, with `extra` configuration; `None` (having said
/// SKIPPED) where there are none.
pub fn real_daemon(
    dir: &Path,
    name: &str,
    extra: &str,
) -> Option<(Daemon, RealCgroups, String, SubtreeCleanup, PathBuf)> {
    let cgroups = match RealCgroups::detect() {
        Ok(c) => c,
        Err(why) => {
            skip(&why);
            return None;
        }
    };
    let subtree = format!("{name}-{}", std::process::id());
    let config = dir.join("topod.toml");
    std::fs::write(
        &config,
        format!("cgroup = \"{}\"\ncgroup_subtree = \"{subtree}\"\n{extra}", cgroups.kind()),
    )
    .unwrap();
    let cleanup = SubtreeCleanup(cgroups.roots(&subtree));
    let d = start(dir, &["--config", config.to_str().unwrap()], false);
    Some((d, cgroups, subtree, cleanup, config))
}

/// A temporary directory that an unprivileged user may enter (a test's socket lives there).
pub fn open_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .unwrap();
    dir
}

/// Writes `text` as `dir/topod.toml` and returns its path.
pub fn config(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("topod.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// Says on stderr that a test cannot run here and why (`SKIPPED: ...`), and, when the suite set
/// `TOPO_SKIP_LOG`, adds a line to that file, so that tests/run-all.sh can count skips and give
/// their reasons (cargo shows a passing test's output to nobody).
pub fn skip(why: &str) {
    eprintln!("SKIPPED: {why}");
    if let Some(log) = std::env::var_os("TOPO_SKIP_LOG") {
        let test = std::thread::current().name().unwrap_or("?").to_string();
        let exe = std::env::current_exe()
            .ok()
            .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
            .unwrap_or_default();
        let binary = exe.rsplit_once('-').map_or(exe.as_str(), |(name, _)| name).to_string();
        let line = format!("{binary}::{test}: {why}\n");
        let _ = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .and_then(|mut f| std::io::Write::write_all(&mut f, line.as_bytes()));
    }
}
