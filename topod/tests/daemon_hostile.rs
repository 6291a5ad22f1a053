//! topod against hostile local users, a crashing daemon and bad configuration: each way an
//! unprivileged user or a mistake broke topod once, kept as a test that failed before the fix.
//!
//! The attackers are small Python programs (Debian's /usr/bin/python3, standard library only)
//! run as the unprivileged user nobody (65534), so topod sees them as the ordinary local user
//! they are. Most tests need root for that (and the real-cgroup ones for the cgroups); they say
//! SKIPPED where they cannot run.

mod common;

use common::{config, is_root, open_dir, start, Daemon};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use topo_client::Client;
use topo_core::proto::Op;

const NOBODY: u32 = 65534;

/// Runs a Python program as nobody with the socket path as its argument; returns its output
/// lines, each a JSON value.
fn as_nobody(socket: &Path, program: &str) -> Vec<Value> {
    let out = Command::new("/usr/bin/python3")
        .args(["-c", program])
        .arg(socket)
        .uid(NOBODY)
        .gid(NOBODY)
        .stdin(Stdio::null())
        .output()
        .expect("python3 runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the attacker failed: {stderr}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect()
}

fn allocate(c: &mut Client, job: &str, owner: Option<u32>) -> Value {
    c.call(Op::Allocate(topo_core::proto::AllocateArgs {
        owner_uid: owner,
        ..topo_core::proto::AllocateArgs::new(job, "affinity[thread*1]")
    }))
    .unwrap()
}

fn skip_unless_root() -> bool {
    if !is_root() {
        common::skip("needs root (the attacker runs as the user nobody)");
    }
    !is_root()
}

/// Python: connect, hand the connection to a child, exit; the child then asks to join its
/// parent's pid (the peer pid topod saw at connect) and its own.
const HANDED_OVER: &str = r#"
import json, os, socket, sys, time
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
opener = os.getpid()
if os.fork():
    os._exit(0)
while os.getppid() == opener:
    time.sleep(0.01)
f = s.makefile("rw")
for pid in (opener, os.getpid()):
    f.write(json.dumps({"v": 1, "op": "join", "job": "owned", "pid": pid}) + "\n"); f.flush()
    print(f.readline().strip())
"#;

/// Python: the ordinary case, a process of the owner moving itself in; then into a job that is
/// not its own.
const OWN_JOIN: &str = r#"
import json, os, socket, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); f = s.makefile("rw")
for job in ("owned", "other"):
    f.write(json.dumps({"v": 1, "op": "join", "job": job, "pid": os.getpid()}) + "\n"); f.flush()
    print(f.readline().strip())
"#;

#[test]
fn a_connection_handed_to_a_child_cannot_join_once_its_opener_has_exited() {
    if skip_unless_root() {
        return;
    }
    let dir = open_dir();
    let d = start(dir.path(), &["--cgroup", "fake"], true);
    let mut c = Client::connect(&d.socket).unwrap();
    allocate(&mut c, "owned", Some(NOBODY));
    allocate(&mut c, "other", Some(1000));
    let replies = as_nobody(&d.socket, HANDED_OVER);
    assert_eq!(replies.len(), 2);
    // The opener's pid is free now (no wrap-around here, so nothing has it yet): refused as no
    // process. Had it been reused, the peer's pidfd says the opener exited: refused as that
    // (the server's unit test `a_reused_peer_pid_is_not_the_peer` covers it).
    // On a kernel without SO_PEERPIDFD an opener that exited before topod's accept is not named
    // at all (below): refused too, saying so (seen in the slow cgroup v2 guest, kernel 6.1).
    let m = replies[0]["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("is running") || m.contains("has exited") || m.contains("could not identify"),
        "{}",
        replies[0]
    );
    // The child's own pid is not the peer's. (On a kernel without SO_PEERPIDFD, topod names the
    // peer by pidfd_open at accept; an opener that exited before that is not named at all, and
    // its connection moves nothing for anyone: refused too, saying so.)
    assert_eq!(replies[1]["error"]["code"], "forbidden", "{}", replies[1]);
    let m = replies[1]["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("only your own process") || m.contains("could not identify"),
        "{}",
        replies[1]
    );
    // The owner's own live process still gets in; another user's job does not take it.
    let replies = as_nobody(&d.socket, OWN_JOIN);
    assert!(replies[0]["ok"].is_object(), "{}", replies[0]);
    assert_eq!(replies[1]["error"]["code"], "forbidden", "{}", replies[1]);
    assert!(
        replies[1]["error"]["message"].as_str().unwrap().contains("is not yours"),
        "{}",
        replies[1]
    );
}

/// Python: opens 20 connections and asks on each for topod's version; reports how many topod
/// refused as busy and how many it answered (every connection gets one or the other, however
/// slowly: no clock), then how many of the answered ones topod closed once idle. Each wait for
/// topod is up to a minute, and one that runs out counts for nothing.
const MANY_CONNECTIONS: &str = r#"
import json, socket, sys
conns = []
for _ in range(20):
    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); conns.append(s)
busy, admitted = 0, []
for s in conns:
    s.settimeout(60)
    try:
        s.sendall(b'{"v":1,"op":"version"}\n')
    except OSError:
        pass  # refused and closed already: the reason waits to be read
    data = b""
    try:
        while b"\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    if b'"busy"' in data and b"max_connections_per_user" in data:
        busy += 1
    elif b'"ok"' in data:
        admitted.append(s)
print(json.dumps({"busy": busy, "admitted": len(admitted)}))
sys.stdout.flush()
closed = 0
for s in admitted:
    try:
        if s.recv(4096) == b"":
            closed += 1
    except OSError:
        pass
print(json.dumps({"closed_after_idle": closed}))
"#;

/// Python: a request line (760 bytes, no newline) sent one byte every 50 ms or slower, so at
/// least 38 s in all; stops at topod's answer and reports how many bytes it had sent by then.
const SLOW_LINE: &str = r#"
import json, socket, sys, time
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
line = b'{"v":1,"op":"list"}' * 40
sent, reply, closed = 0, b"", False
s.setblocking(False)
for b in line:
    try:
        s.send(bytes([b]))
        sent += 1
    except OSError:
        closed = True  # topod has closed: its reason waits to be read
    time.sleep(0.05)
    try:
        reply += s.recv(4096)
    except OSError:
        pass
    if reply or closed:
        break
print(json.dumps({"sent": sent, "of": len(line), "reply": reply.decode()}))
"#;

#[test]
fn one_user_cannot_hold_the_connections_or_dribble_a_line() {
    if skip_unless_root() {
        return;
    }
    let dir = open_dir();
    let conf = config(dir.path(), "cgroup = \"fake\"\nmax_connections_per_user = 4\nmax_connections = 6\nidle_timeout_ms = 2000\nline_timeout_ms = 400\nwrite_timeout_ms = 300\n");
    let d = start(dir.path(), &["--config", conf.to_str().unwrap()], true);
    // Root keeps getting in while the user holds its connections.
    let socket = d.socket.clone();
    let root_meanwhile = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        let held: Vec<_> = (0..10).map(|_| Client::connect(&socket).unwrap()).collect();
        let mut c = Client::connect(&socket).unwrap();
        let jobs = c.call(Op::FreeMap).unwrap()["jobs"].clone();
        drop(held);
        jobs
    });
    // Root's own socket: a user can neither connect to it nor crowd it.
    let admin = topo_core::proto::admin_socket_for(&d.socket);
    let mode = std::fs::metadata(&admin).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{}", admin.display());
    let knock = "import json, socket, sys\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect(sys.argv[1]); print(json.dumps('connected'))\nexcept PermissionError:\n    print(json.dumps('refused'))\n";
    assert_eq!(as_nobody(&admin, knock), [serde_json::json!("refused")]);
    let replies = as_nobody(&d.socket, MANY_CONNECTIONS);
    assert_eq!(replies[0], serde_json::json!({ "busy": 16, "admitted": 4 }));
    assert_eq!(
        replies[1],
        serde_json::json!({ "closed_after_idle": 4 }),
        "idle connections are closed"
    );
    assert_eq!(root_meanwhile.join().unwrap(), 0);
    // A line that dribbles in is cut off at the line limit, with a reason, while it still
    // dribbles: in bytes, not seconds (a limit that each byte pushed back would let it all in).
    let r = &as_nobody(&d.socket, SLOW_LINE)[0];
    assert!(r["reply"].as_str().unwrap().contains("did not arrive whole within 0.4 s"), "{r}");
    assert!(r["sent"].as_u64().unwrap() < r["of"].as_u64().unwrap(), "{r}");
}

/// How many of a process's threads are called `name`.
fn threads_called(pid: u32, name: &str) -> usize {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    tasks
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == name)
        })
        .count()
}

/// Waits (up to a minute: a liveness wait, not a speed limit) until topod has closed `s`,
/// without reading from it.
fn closed_by_peer(s: &UnixStream) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    // POLLHUP needs no asking: the kernel reports it once both directions are shut, as a
    // close by the peer does, whatever is still unread.
    let mut fds = [PollFd::new(s.as_fd(), PollFlags::empty())];
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        match poll(&mut fds, PollTimeout::from(1000u16)) {
            Ok(_) => {
                let seen = fds[0].revents().unwrap_or(PollFlags::empty());
                if seen.contains(PollFlags::POLLHUP) {
                    return true;
                }
            }
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => panic!("poll: {e}"),
        }
    }
    false
}

#[test]
fn a_client_that_never_reads_its_replies_is_closed() {
    let dir = open_dir();
    let conf = config(
        dir.path(),
        &format!(
            "cgroup = \"fake\"\nwrite_timeout_ms = 300\nadmin_uids = [{}]\n",
            nix::unistd::geteuid()
        ),
    );
    let d = start(dir.path(), &["--config", conf.to_str().unwrap()], true);
    let mut s = UnixStream::connect(&d.socket).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    // Each topology reply of the emulated EPYC is about 100 KB: the socket buffers fill at once.
    let line = b"{\"v\":1,\"op\":\"topology\"}\n".repeat(200);
    let _ = s.write_all(&line);
    // Nothing is read before topod closes the connection, however long that takes: what it
    // wrote is then only what the socket buffers held.
    assert!(closed_by_peer(&s), "topod kept the connection of a client that never reads");
    let mut got = Vec::new();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let _ = s.read_to_end(&mut got);
    let replies = got.iter().filter(|&&b| b == b'\n').count();
    assert!(replies < 200, "topod gave up on the reader: {replies} replies of 200");
    // And no thread is left serving it (topod names each connection's thread).
    let t = Instant::now();
    while threads_called(d.child.id(), "topod-conn") > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the connection's thread stays: {} topod-conn thread(s)",
            threads_called(d.child.id(), "topod-conn")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// topod on the emulated EPYC (fake backend) with 40 open files at most, soft and hard, so that
/// it cannot raise them and runs out after a few dozen connections; `env` is added to its
/// environment, its log goes to `log`. prlimit execs topod: the child is topod.
fn topod_with_40_files(dir: &Path, env: &[(&str, &std::ffi::OsStr)], log: Stdio) -> Daemon {
    let socket = dir.join("topod.sock");
    let zen4 = common::topologies().join("converted-hwloc2.9/AMD-19h-Zen4-2xEpyc-9654.xml");
    let child = Command::new("prlimit")
        .arg("--nofile=40:40")
        .arg(env!("CARGO_BIN_EXE_topod"))
        .args(["--cgroup", "fake", "--socket"])
        .arg(&socket)
        .arg("--state-dir")
        .arg(dir)
        .arg("--topology")
        .arg(&zen4)
        .envs(env.iter().copied())
        .stderr(log)
        .spawn()
        .unwrap();
    Daemon { child, socket }
}

#[test]
fn out_of_descriptors_topod_waits_instead_of_spinning() {
    let dir = open_dir();
    let log = dir.path().join("topod.log");
    // Root's connections are never refused, so only the descriptor limit stops them.
    let d = topod_with_40_files(dir.path(), &[], Stdio::from(std::fs::File::create(&log).unwrap()));
    let socket = d.socket.clone();
    let t = Instant::now();
    while UnixStream::connect(&socket).is_err() {
        assert!(t.elapsed() < Duration::from_secs(20), "topod did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let held: Vec<UnixStream> = (0..60).filter_map(|_| UnixStream::connect(&socket).ok()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let cpu = |pid: u32| -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
        (fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap()) / 100.0
    };
    let before = cpu(d.child.id());
    std::thread::sleep(Duration::from_secs(2));
    let used = cpu(d.child.id()) - before;
    assert!(used < 0.5, "topod spun on accept errors: {used} CPU seconds in 2 s");
    let text = std::fs::read_to_string(&log).unwrap();
    let logged = text.matches("accepting a connection on the socket failed").count();
    assert!((1..=3).contains(&logged), "{logged} accept-failure lines:\n{text}");
    drop(held);
    // Once connections close, topod serves again.
    let t = Instant::now();
    loop {
        if let Ok(mut c) = Client::connect_with_timeout(&socket, Duration::from_secs(2)) {
            if c.call(Op::Version).is_ok() {
                break;
            }
        }
        assert!(t.elapsed() < Duration::from_secs(10), "topod did not recover");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The cost is not timed here: that a fit takes no host lock is the server's unit test
/// `a_fit_is_answered_while_the_host_lock_is_held`; what root's allocate and release cost while
/// such fits loop is `topoctl bench daemon --hostile` (before the fix: 3.6 s per fit under the
/// lock, 10 s for root's allocate and release), and one fit's refusal is
/// `cargo bench -p topod --bench requests`.
#[test]
fn a_64_kib_fit_leaves_other_clients_served() {
    let dir = open_dir();
    let conf = config(
        dir.path(),
        &format!("cgroup = \"fake\"\nadmin_uids = [{}]\n", nix::unistd::geteuid()),
    );
    let d = start(dir.path(), &["--config", conf.to_str().unwrap()], true);
    let list = vec!["0-65535"; 64 * 1024 / 8 - 10].join(",");
    let huge = format!("CPUSET[CPU_LIST={list}]");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let loopers: Vec<_> = (0..2)
        .map(|_| {
            let (socket, huge, stop) = (d.socket.clone(), huge.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut c = Client::connect(&socket).unwrap();
                let mut n = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let e = c
                        .call(Op::Fit(topo_core::proto::FitArgs::new(huge.clone())))
                        .unwrap_err()
                        .to_string();
                    assert!(e.contains("CPUs 384-65535, which this host does not have"), "{e}");
                    n += 1;
                }
                n
            })
        })
        .collect();
    let mut c = Client::connect(&d.socket).unwrap();
    for i in 0..50 {
        allocate(&mut c, &format!("j{i}"), None);
        c.call(Op::Release { job: format!("j{i}") }).unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let fits: usize = loopers.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(fits >= 2, "the attackers got answers too: {fits}");
    assert!(c.call(Op::List).unwrap().as_array().is_some_and(Vec::is_empty), "all released");
}

#[test]
fn topoctl_run_releases_a_job_that_outlives_the_idle_time() {
    let dir = open_dir();
    let conf = config(
        dir.path(),
        &format!(
            "cgroup = \"fake\"\nidle_timeout_ms = 300\nadmin_uids = [{}]\n",
            nix::unistd::geteuid()
        ),
    );
    let d = start(dir.path(), &["--config", conf.to_str().unwrap()], true);
    let out = Command::new(env!("CARGO_BIN_EXE_topoctl"))
        .args([
            "run",
            "--socket",
            d.socket.to_str().unwrap(),
            "--request",
            "affinity[thread]",
            "--job",
            "long",
            "--",
            "sleep",
            "1",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut c = Client::connect(&d.socket).unwrap();
    assert_eq!(c.call(Op::List).unwrap(), serde_json::json!([]), "the job was released");
}

#[test]
fn bad_settings_and_requests_are_refused_with_a_reason() {
    let dir = open_dir();
    // A cgroup_subtree that climbs out of the cgroup mounts.
    let conf = config(dir.path(), "cgroup_subtree = \"../../../../tmp/topo-escape\"\n");
    let out = Command::new(env!("CARGO_BIN_EXE_topod"))
        .args([
            "--config",
            conf.to_str().unwrap(),
            "--socket",
            dir.path().join("s").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("cgroup_subtree") && err.contains("\"..\""),
        "{err}"
    );
    assert!(!Path::new("/tmp/topo-escape").exists());
    // A state directory others may write to (a planted link would make root write through it).
    if is_root() {
        let shared = dir.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_topod"))
            .args([
                "--cgroup",
                "fake",
                "--socket",
                dir.path().join("s").to_str().unwrap(),
                "--state-dir",
                shared.to_str().unwrap(),
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("writable by everyone"), "{err}");
    }
    // tasks 0, a field twice, a version that is not a whole number: refused, and said so.
    let d = start(dir.path(), &["--cgroup", "fake"], true);
    let ask = |line: &str| -> Value {
        let mut s = UnixStream::connect(&d.socket).unwrap();
        s.write_all(format!("{line}\n").as_bytes()).unwrap();
        let mut reply = String::new();
        BufReader::new(s).read_line(&mut reply).unwrap();
        serde_json::from_str(&reply).unwrap()
    };
    let r = ask(r#"{"v":1,"op":"allocate","job":"z","request":"affinity[thread]","tasks":0}"#);
    assert!(r["error"]["message"].as_str().unwrap_or("").contains("tasks = 0"), "{r}");
    let r = ask(r#"{"v":1,"op":"release","job":"a","job":"b"}"#);
    assert!(r["error"]["message"].as_str().unwrap_or("").contains("\"job\" is given twice"), "{r}");
    let r = ask(r#"{"v":1.0,"op":"list"}"#);
    assert!(r["error"]["message"].as_str().unwrap_or("").contains("whole number"), "{r}");
    let r = ask(r#"{"v":1,"op":"fit","request":"CPUSET[CPU_LIST=5000-6000]"}"#);
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("CPUs 5000-6000, which this host does not have"),
        "{r}"
    );
    assert_eq!(ask(r#"{"v":1,"op":"list"}"#)["ok"], serde_json::json!([]));
}

#[test]
fn two_topods_cannot_share_a_cgroup_subtree() {
    let dir = open_dir();
    let Some((d, _cgroups, subtree, _cleanup, conf)) =
        common::real_daemon(dir.path(), "topo-twice-test", "")
    else {
        return;
    };
    let other = open_dir();
    let out = Command::new(env!("CARGO_BIN_EXE_topod"))
        .args([
            "--config",
            conf.to_str().unwrap(),
            "--socket",
            other.path().join("s").to_str().unwrap(),
            "--state-dir",
            other.path().to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("another topod already manages the cgroup subtree")
            && err.contains(&subtree),
        "{err}"
    );
    // The first one is untouched.
    let mut c = Client::connect(&d.socket).unwrap();
    allocate(&mut c, "1", None);
    c.call(Op::Release { job: "1".into() }).unwrap();
}

#[test]
fn owners_survive_a_kill_right_after_allocate() {
    let dir = open_dir();
    let Some((mut d, _cgroups, _subtree, _cleanup, conf)) =
        common::real_daemon(dir.path(), "topo-owner-test", "")
    else {
        return;
    };
    for round in 0..15 {
        let mut c = Client::connect(&d.socket).unwrap();
        let job = format!("o{round}");
        allocate(&mut c, &job, Some(4000 + round));
        // SIGKILL the moment the answer is in.
        d.child.kill().unwrap();
        d.child.wait().unwrap();
        d = start(dir.path(), &["--config", conf.to_str().unwrap()], false);
        let mut c = Client::connect(&d.socket).unwrap();
        let jobs = c.call(Op::List).unwrap();
        let me = jobs
            .as_array()
            .unwrap()
            .iter()
            .find(|j| j["job"] == job.as_str())
            .unwrap_or_else(|| panic!("{job} lost: {jobs}"));
        assert_eq!(me["owner_uid"], 4000 + round, "round {round}: {me}");
        c.call(Op::Release { job }).unwrap();
    }
}

/// Where process `pid` is in the hierarchy mounted at `mount` (from `/proc/<pid>/cgroup`).
fn cgroup_of(pid: u32, mount: &Path) -> PathBuf {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let name = mount.file_name().unwrap().to_string_lossy().into_owned();
    let path = text
        .lines()
        .find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
            (controllers.split(',').any(|c| c == name)
                || (controllers.is_empty() && mount.join("cgroup.controllers").exists()))
            .then(|| path.to_string())
        })
        .unwrap_or_else(|| panic!("{pid} is in no cgroup of {}: {text}", mount.display()));
    mount.join(path.trim_start_matches('/'))
}

#[test]
fn a_release_never_freezes_topod_itself() {
    let dir = open_dir();
    let Some((d, cgroups, subtree, _cleanup, _)) =
        common::real_daemon(dir.path(), "topo-inside-test", "")
    else {
        return;
    };
    let mut c = Client::connect(&d.socket).unwrap();
    allocate(&mut c, "trap", None);
    // An administrator's slip: topod moved into a job's cgroup by hand.
    let roots = cgroups.roots(&subtree);
    let homes: Vec<PathBuf> =
        roots.iter().map(|r| cgroup_of(d.child.id(), r.parent().unwrap())).collect();
    for root in &roots {
        std::fs::write(root.join("trap/cgroup.procs"), d.child.id().to_string()).unwrap();
    }
    let e = c.call(Op::Release { job: "trap".into() }).unwrap_err().to_string();
    assert!(e.contains("topod itself is in job trap's cgroup"), "{e}");
    // topod is alive and answering, not frozen or killed.
    let mut again = Client::connect_with_timeout(&d.socket, Duration::from_secs(5)).unwrap();
    assert_eq!(again.call(Op::List).unwrap()[0]["job"], "trap");
    for home in &homes {
        std::fs::write(home.join("cgroup.procs"), d.child.id().to_string()).unwrap();
    }
    c.call(Op::Release { job: "trap".into() }).unwrap();
}

#[test]
fn the_watchdog_is_fed_only_while_topod_serves() {
    let dir = open_dir();
    let notify = dir.path().join("notify");
    let systemd = std::os::unix::net::UnixDatagram::bind(&notify).unwrap();
    systemd.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    // A few dozen connections leave topod no descriptor for its watchdog's probe.
    let env =
        [("NOTIFY_SOCKET", notify.as_os_str()), ("WATCHDOG_USEC", std::ffi::OsStr::new("300000"))];
    let log = dir.path().join("topod.log");
    let d =
        topod_with_40_files(dir.path(), &env, Stdio::from(std::fs::File::create(&log).unwrap()));
    let socket = d.socket.clone();
    // Counted in events, not seconds: topod's watchdog is one thread that probes, then feeds
    // systemd or logs the failure, one probe after the other. Each wait is up to a minute (a
    // liveness wait: on an idle machine each takes a few probe periods of 100 ms).
    let failed_probes = || {
        std::fs::read_to_string(&log).unwrap_or_default().matches("the watchdog's probe").count()
    };
    // What systemd hears until `enough` says so (or the minute runs out).
    let hear_until = |enough: &dyn Fn(&[String]) -> bool| -> Vec<String> {
        let t = Instant::now();
        let mut got = Vec::new();
        let mut buf = [0u8; 256];
        while !enough(&got) && t.elapsed() < Duration::from_secs(60) {
            if let Ok(n) = systemd.recv(&mut buf) {
                got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
        }
        got
    };
    let fed = |got: &[String]| got.iter().filter(|m| *m == "WATCHDOG=1").count();
    let first = hear_until(&|got| fed(got) >= 3);
    assert_eq!(first.first().map(String::as_str), Some("READY=1"), "{first:?}");
    assert!(fed(&first) >= 3, "fed while serving: {first:?}");
    let held: Vec<UnixStream> = (0..60).filter_map(|_| UnixStream::connect(&socket).ok()).collect();
    // Starved once topod says it cannot accept (out of descriptors; the held connections stay
    // open and keep it so). Any probe that began before then is over once one after it failed,
    // and what it sent is queued here: drained. The next two probes fail too, and systemd
    // hears nothing from them.
    let said = |what: &str| std::fs::read_to_string(&log).unwrap_or_default().contains(what);
    let t = Instant::now();
    while !said("accepting a connection on the socket failed") {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "topod was not starved with 60 connections open and 40 descriptors:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let wait_for_failures = |n: usize| {
        let t = Instant::now();
        while failed_probes() < n {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "{} failed probes logged, not {n}, while topod could not serve:\n{}",
                failed_probes(),
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    wait_for_failures(failed_probes() + 1);
    systemd.set_nonblocking(true).unwrap();
    while systemd.recv(&mut [0u8; 256]).is_ok() {}
    systemd.set_nonblocking(false).unwrap();
    let before = failed_probes();
    wait_for_failures(before + 2);
    let mut starved = Vec::new();
    systemd.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 256];
    while let Ok(n) = systemd.recv(&mut buf) {
        starved.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    systemd.set_nonblocking(false).unwrap();
    assert!(
        !starved.iter().any(|m| m == "WATCHDOG=1"),
        "fed while topod could not serve: {starved:?}"
    );
    drop(held);
    let again = hear_until(&|got| fed(got) >= 1);
    assert!(fed(&again) >= 1, "fed again once it serves: {again:?}");
}

/// Python: as a job's owner, suspend a job holding a process of root's, then join a process
/// of one's own to another job and suspend and resume that.
const SUSPEND_MIXED: &str = r#"
import json, os, socket, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); f = s.makefile("rw")
def ask(request):
    f.write(json.dumps(dict(v=1, **request)) + "\n"); f.flush()
    print(f.readline().strip())
ask({"op": "suspend", "job": "mixed"})
ask({"op": "join", "job": "mine", "pid": os.getpid()})
ask({"op": "suspend", "job": "mine"})
ask({"op": "resume", "job": "mine"})
"#;

#[test]
fn an_owner_cannot_suspend_a_job_holding_someone_elses_process() {
    // Issue 29: an owner's suspend froze a root process and another user's that were inside
    // the job's cgroup. Now refused, naming the process; the owner's own job still suspends.
    if skip_unless_root() {
        return;
    }
    let dir = open_dir();
    let d = start(dir.path(), &["--cgroup", "fake"], true);
    let mut c = Client::connect(&d.socket).unwrap();
    allocate(&mut c, "mixed", Some(NOBODY));
    allocate(&mut c, "mine", Some(NOBODY));
    let mut roots = Command::new("sleep").arg("60").spawn().unwrap();
    c.call(Op::Join { job: "mixed".into(), pid: roots.id() as i32 }).unwrap();
    let replies = as_nobody(&d.socket, SUSPEND_MIXED);
    let _ = roots.kill();
    let _ = roots.wait();
    assert_eq!(replies.len(), 4, "{replies:?}");
    assert_eq!(replies[0]["error"]["code"], "forbidden", "{}", replies[0]);
    let m = replies[0]["error"]["message"].as_str().unwrap();
    assert!(m.contains(&format!("process {} in it runs as uid 0", roots.id())), "{m}");
    for (i, r) in replies.iter().enumerate().skip(1) {
        assert!(r["ok"].is_object(), "reply {i}: {r}");
    }
}

#[test]
fn a_notify_directory_a_user_made_first_is_named_and_never_used() {
    // Issue 29: in a socket directory everyone can write, a user who made job-notify/ first
    // kept topod from starting, and the error told root to chown the user's directory. Now it
    // says to remove it and to move the socket, and topod changes nothing in it.
    if skip_unless_root() {
        return;
    }
    let dir = open_dir();
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::os::unix::fs::PermissionsExt::from_mode(0o1777))
        .unwrap();
    let theirs = shared.join("job-notify");
    std::fs::create_dir(&theirs).unwrap();
    nix::unistd::chown(&theirs, Some(nix::unistd::Uid::from_raw(NOBODY)), None).unwrap();
    std::fs::set_permissions(&theirs, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_topod"))
        .args(["--cgroup", "fake", "--socket"])
        .arg(shared.join("topod.sock"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--topology")
        .arg(common::topologies().join("converted-hwloc2.9/AMD-19h-Zen4-2xEpyc-9654.xml"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "topod started with a user's notify directory: {err}");
    assert!(
        err.contains(&format!("remove {}, which uid {NOBODY} created", theirs.display()))
            && err.contains("move the socket to a directory only root can write"),
        "{err}"
    );
    assert!(!err.contains("chown root"), "{err}");
    let meta = std::fs::metadata(&theirs).unwrap();
    assert_eq!(
        (std::os::unix::fs::MetadataExt::uid(&meta), meta.permissions().mode() & 0o7777),
        (NOBODY, 0o777),
        "topod changed the user's directory"
    );
}

/// The pids controller's directory for a test cgroup (v1 hierarchy, or the unified one with
/// `pids` enabled for its children), or why there is none.
fn pids_cgroup(name: &str) -> Result<PathBuf, String> {
    let mounts = std::fs::read_to_string("/proc/mounts").map_err(|e| e.to_string())?;
    for line in mounts.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() >= 4 && f[2] == "cgroup" && f[3].split(',').any(|o| o == "pids") {
            return Ok(Path::new(f[1]).join(name));
        }
    }
    let v2 = topod::cgroup::v2::v2_mount(&mounts).ok_or("no pids controller is mounted")?;
    let offered = std::fs::read_to_string(v2.join("cgroup.controllers")).unwrap_or_default();
    if !offered.split_whitespace().any(|c| c == "pids") {
        return Err("the unified hierarchy offers no pids controller".into());
    }
    std::fs::write(v2.join("cgroup.subtree_control"), "+pids").map_err(|e| e.to_string())?;
    Ok(v2.join(name))
}

/// Attack, issue 29: a job that took every process id of the host (32,437 threads) left topod
/// unable to start a thread for a connection, and root's requests on the administrators'
/// socket failed with EPIPE. Here topod is held to the threads it has by a pids cgroup: root is
/// still answered (on the accept thread), a connection to the public socket is told why not.
#[test]
fn root_is_answered_when_topod_cannot_start_a_thread() {
    if skip_unless_root() {
        return;
    }
    let dir = open_dir();
    let d = start(dir.path(), &["--cgroup", "fake"], true);
    let cg = match pids_cgroup(&format!("topo-test-threads-{}", std::process::id())) {
        Ok(cg) => cg,
        Err(why) => return common::skip(&why),
    };
    std::fs::create_dir(&cg).unwrap();
    struct Out(PathBuf, u32);
    impl Drop for Out {
        fn drop(&mut self) {
            // topod back to the root of the hierarchy, then the test cgroup goes.
            let root = self.0.parent().unwrap().join("cgroup.procs");
            let _ = std::fs::write(root, self.1.to_string());
            let _ = std::fs::remove_dir(&self.0);
        }
    }
    let pid = d.child.id();
    // Up to its last thread first: the public socket is served last, by topod's main thread
    // after every other is started (start() returns once it is bound; a slow guest held to
    // fewer threads there made topod's start-up fail).
    let answered = common::ask(&d.socket, r#"{"op":"version"}"#);
    assert!(answered["ok"].is_object(), "{answered}");
    let _out = Out(cg.clone(), pid);
    std::fs::write(cg.join("cgroup.procs"), pid.to_string()).unwrap();
    // topod held to the threads it has now. A thread still ending (start-up's, a connection's
    // just served) would leave room for one more, so the limit is set again until a
    // connection to the public socket finds none (seen in the slow v2 guest). The connection
    // sends nothing: topod's refusal is then read whole (a request topod never read would make
    // its close a reset), and a thread that did start waits silently until the read times out.
    let mut refused = None;
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(50));
        let current = std::fs::read_to_string(cg.join("pids.current")).unwrap();
        std::fs::write(cg.join("pids.max"), current.trim()).unwrap();
        let s = UnixStream::connect(&d.socket).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        let mut line = String::new();
        let _ = BufReader::new(s).read_line(&mut line);
        if line.contains("cannot start a thread for this connection") {
            refused = Some(line);
            break;
        }
    }
    assert!(refused.is_some(), "topod always found a thread for a public connection");
    for round in 0..3 {
        let mut c = Client::connect(&d.socket).expect("root connects");
        let v = c.version().unwrap_or_else(|e| panic!("round {round}: root's version: {e}"));
        assert_eq!(u64::from(v.pid), u64::from(pid));
        assert!(c.call(Op::List).is_ok(), "round {round}: root's list");
    }
    let log = std::fs::read_to_string(dir.path().join("topod.log")).unwrap();
    assert!(
        log.contains("starting a thread for a connection on the administrators' socket"),
        "{log}"
    );
}

/// topod started where it may not start a thread (its cgroup's pids limit) stops with a message
/// naming the thread, not a panic (it panicked before, at its first `thread::spawn`).
#[test]
fn topod_that_cannot_start_its_threads_says_which_and_stops() {
    if skip_unless_root() {
        return;
    }
    let dir = open_dir();
    let cg = match pids_cgroup(&format!("topo-test-start-{}", std::process::id())) {
        Ok(cg) => cg,
        Err(why) => return common::skip(&why),
    };
    std::fs::create_dir(&cg).unwrap();
    struct Gone(PathBuf);
    impl Drop for Gone {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir(&self.0);
        }
    }
    let _gone = Gone(cg.clone());
    // One task: topod's main thread, and no other.
    std::fs::write(cg.join("pids.max"), "1").unwrap();
    let procs = cg.join("cgroup.procs");
    let socket = dir.path().join("topod.sock");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_topod"));
    cmd.args(["--cgroup", "fake", "--socket", socket.to_str().unwrap()]);
    cmd.args(["--state-dir", dir.path().to_str().unwrap()]);
    // SAFETY: the closure runs in the child between fork and exec and only writes a file
    // (open, write, close: async-signal-safe system calls through std's thin wrappers).
    unsafe {
        cmd.pre_exec(move || std::fs::write(&procs, b"0"));
    }
    let out = cmd.stdin(Stdio::null()).output().expect("topod runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("cannot start topod's") && err.contains("thread"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
