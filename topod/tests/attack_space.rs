//! Hostile use of the space-over-time features (issue 18) from outside topod: malformed
//! `resize` and `reserve` requests, notify files under thousands of resizes, unsafe notify
//! directories, corrupt or foreign files in the state directory, bad `prime_pools`
//! configurations, and resize, suspend, resume and release racing one another. Each test runs
//! its own topod on the fake backend (no cgroups are left behind) and checks behaviour that is
//! right today, so that it stays right.

mod common;

use common::{ask, error_of, ok, start};
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use topo_client::Client;
use topo_core::proto::Op;

fn refused(socket: &Path, request: &str, code: &str, says: &str) {
    let reply = ask(socket, request);
    let (got, message) = error_of(&reply);
    assert_eq!(got, code, "{request}: {reply}");
    assert!(message.contains(says), "{request}: {message:?} should say {says:?}");
}

fn notify_file(socket: &Path, job: &str) -> PathBuf {
    topo_core::proto::notify_file_for(socket, job)
}

fn generation_of(text: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix("generation="))
        .and_then(|g| g.parse().ok())
        .unwrap_or_else(|| panic!("no generation in {text:?}"))
}

fn free_map(socket: &Path) -> Value {
    ok(socket, r#"{"op":"free_map"}"#)
}

/// topod on the fake backend and the emulated EPYC 9654, with whoever runs the test as an
/// administrator (root always is one), so that the tests run without root too.
fn start_fake(dir: &Path) -> common::Daemon {
    let me = nix::unistd::geteuid().as_raw();
    let config = common::config(dir, &format!("admin_uids = [{me}]\n"));
    start(dir, &["--cgroup", "fake", "--config", config.to_str().unwrap()], true)
}

/// Runs topod with `config` until it exits (it must, within 20 s) and returns its stderr.
fn topod_that_stops(dir: &Path, config: &str) -> String {
    let config = common::config(dir, config);
    let zen4 = common::topologies().join("converted-hwloc2.9/AMD-19h-Zen4-2xEpyc-9654.xml");
    let mut child = Command::new(env!("CARGO_BIN_EXE_topod"))
        .args(["--cgroup", "fake", "--topology", zen4.to_str().unwrap()])
        .args(["--socket", dir.join("run/topod.sock").to_str().unwrap()])
        .args(["--state-dir", dir.join("state").to_str().unwrap()])
        .args(["--config", config.to_str().unwrap()])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
            assert!(!status.success(), "topod should refuse to start: {err}");
            return err;
        }
        if started.elapsed() > std::time::Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("topod started although it should have refused");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn hostile_resize_and_reserve_requests_are_refused_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = start_fake(dir.path());
    let s = d.socket.as_path();
    ok(s, r#"{"op":"allocate","job":"m","request":"affinity[thread*2-8]","resize_signal":10}"#);
    ok(s, r#"{"op":"allocate","job":"r","request":"affinity[thread*2]"}"#);
    let before = free_map(s);
    let told = std::fs::read_to_string(notify_file(s, "m")).unwrap();
    for (request, code, says) in [
        (r#"{"op":"resize","job":"m","tasks":0}"#, "bad_request", "0 is outside that range"),
        (r#"{"op":"resize","job":"m","tasks":9}"#, "bad_request", "9 is outside that range"),
        (
            r#"{"op":"resize","job":"m","tasks":4294967295}"#,
            "bad_request",
            "4294967295 is outside that range",
        ),
        (r#"{"op":"resize","job":"m","tasks":4294967296}"#, "bad_request", "expected u32"),
        (r#"{"op":"resize","job":"m","tasks":-1}"#, "bad_request", "expected u32"),
        (r#"{"op":"resize","job":"m","tasks":1.5}"#, "bad_request", "expected u32"),
        (r#"{"op":"resize","job":"m"}"#, "bad_request", "missing field `tasks`"),
        (r#"{"op":"resize","job":"../m","tasks":2}"#, "bad_request", "'/'"),
        (r#"{"op":"resize","job":"tasks","tasks":2}"#, "bad_request", "control file"),
        (r#"{"op":"resize","job":"nobody","tasks":2}"#, "unknown_job", "nobody"),
        (r#"{"op":"resize","job":"r","tasks":1}"#, "bad_request", "not malleable"),
        (
            r#"{"op":"allocate","job":"x","request":"affinity[thread*1-2]","resize_signal":9}"#,
            "bad_request",
            "not SIGKILL or SIGSTOP",
        ),
        (
            r#"{"op":"allocate","job":"x","request":"affinity[thread*1-2]","resize_signal":19}"#,
            "bad_request",
            "not SIGKILL or SIGSTOP",
        ),
        (
            r#"{"op":"allocate","job":"x","request":"affinity[thread*1-2]","resize_signal":0}"#,
            "bad_request",
            "resize_signal = 0",
        ),
        (
            r#"{"op":"allocate","job":"x","request":"affinity[thread*1-2]","resize_signal":64}"#,
            "bad_request",
            "resize_signal = 64",
        ),
        (
            r#"{"op":"allocate","job":"x","request":"affinity[thread*1-2]","resize_signal":-1}"#,
            "bad_request",
            "resize_signal = -1",
        ),
        (
            r#"{"op":"reserve","job":"w","request":"affinity[numa]","expires_in_s":-5}"#,
            "bad_request",
            "expected u64",
        ),
        (
            r#"{"op":"reserve","job":"w","request":"affinity[numa]","expires_in_s":0}"#,
            "bad_request",
            "1 s to 2592000 s",
        ),
        (
            r#"{"op":"reserve","job":"w","request":"affinity[numa]","expires_in_s":2592001}"#,
            "bad_request",
            "1 s to 2592000 s",
        ),
        (
            r#"{"op":"reserve","job":"w","request":"affinity[numa]","expires_in_s":18446744073709551615}"#,
            "bad_request",
            "1 s to 2592000 s",
        ),
        (
            r#"{"op":"reserve","job":"w","request":"affinity[numa]"}"#,
            "bad_request",
            "missing field `expires_in_s`",
        ),
        (
            r#"{"op":"reserve","job":"../w","request":"affinity[numa]","expires_in_s":60}"#,
            "bad_request",
            "'/'",
        ),
        (
            r#"{"op":"reserve","job":"w","request":"affinity[numa]","cpus":"0-999","expires_in_s":60}"#,
            "bad_topology_request",
            "does not have",
        ),
        (
            r#"{"op":"reserve","job":"m","request":"affinity[numa]","expires_in_s":60}"#,
            "bad_request",
            "already",
        ),
        (r#"{"op":"unreserve","job":"w"}"#, "unknown_job", "w"),
        (r#"{"op":"unreserve","job":"../w"}"#, "bad_request", "'/'"),
    ] {
        refused(s, request, code, says);
    }
    let after = free_map(s);
    assert_eq!(after, before, "no refused request changed the host");
    assert!(after.get("reservations").is_none(), "{after}");
    assert_eq!(std::fs::read_to_string(notify_file(s, "m")).unwrap(), told);
    // Asking for the size it has is no change either: same generation, same file.
    ok(s, r#"{"op":"resize","job":"m","tasks":8}"#);
    assert_eq!(std::fs::read_to_string(notify_file(s, "m")).unwrap(), told);
}

#[test]
fn notify_files_follow_hundreds_of_resizes_and_leave_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let d = start_fake(dir.path());
    let s = d.socket.as_path();
    let mut c = Client::connect(s).unwrap();
    c.call(Op::allocate("m", "affinity[core*1-4]")).unwrap();
    let file = notify_file(s, "m");
    let mut last = generation_of(&std::fs::read_to_string(&file).unwrap());
    assert_eq!(last, 1, "a new job's file starts at generation 1");
    for i in 0..400u32 {
        let tasks = [1, 4, 2, 3][i as usize % 4];
        let a = c.call(Op::Resize { job: "m".into(), tasks }).unwrap();
        let text = std::fs::read_to_string(&file).unwrap();
        let generation = generation_of(&text);
        assert_eq!(generation, last + 1, "one generation per change: {text}");
        last = generation;
        assert!(text.contains(&format!("\ncpus={}\n", a["cpus"].as_str().unwrap())), "{text}");
        let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644, "world-readable, written by root only");
    }
    let names: Vec<String> = std::fs::read_dir(file.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["m"], "no temporary file is left behind");
    c.call(Op::Release { job: "m".into() }).unwrap();
    assert!(!file.exists(), "the release removes the job's file");
    // The same job id again starts a new file from generation 1.
    c.call(Op::allocate("m", "affinity[core*1-4]")).unwrap();
    assert_eq!(generation_of(&std::fs::read_to_string(&file).unwrap()), 1);
}

#[test]
fn an_unsafe_notify_directory_stops_topod_and_says_which() {
    type Plant = Box<dyn Fn(&Path)>;
    let cases: Vec<(&str, Plant, &str)> = vec![
        (
            "a symbolic link",
            Box::new(|notify: &Path| {
                let target = notify.parent().unwrap().parent().unwrap().join("elsewhere");
                std::fs::create_dir(&target).unwrap();
                std::os::unix::fs::symlink(&target, notify).unwrap();
            }),
            "a symbolic link",
        ),
        (
            "world-writable",
            Box::new(|notify: &Path| {
                std::fs::create_dir(notify).unwrap();
                std::fs::set_permissions(notify, std::fs::Permissions::from_mode(0o777)).unwrap();
            }),
            "writable by everyone",
        ),
        (
            "a file",
            Box::new(|notify: &Path| std::fs::write(notify, "x").unwrap()),
            "not a directory",
        ),
    ];
    for (what, plant, says) in cases {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("run")).unwrap();
        let notify = topo_core::proto::notify_dir_for(&dir.path().join("run/topod.sock"));
        plant(&notify);
        let err = topod_that_stops(dir.path(), "");
        assert!(err.contains(notify.to_str().unwrap()) && err.contains(says), "{what}: {err}");
        assert!(!dir.path().join("run/topod.sock").exists(), "{what}: no socket was opened");
    }
}

#[test]
fn a_corrupt_or_foreign_plan_of_moves_is_dropped_and_the_host_starts() {
    for (what, plan) in [
        ("cut short", r#"[{"job":"a","cpus":"0-3""#.to_string()),
        ("not a list", r#"{"job":"a"}"#.to_string()),
        (
            "unknown jobs and CPUs the host lacks",
            r#"[{"job":"ghost","cpus":"0-4095","tasks":["0-4095"],"mems":"0","fenced":"","request":"affinity[thread*4096]"},{"job":"../etc","cpus":"0","tasks":["0"],"mems":"0","fenced":"","request":"affinity[thread]"}]"#.to_string(),
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("moves.json"), &plan).unwrap();
        let d = start_fake(dir.path());
        let map = free_map(&d.socket);
        assert_eq!((map["jobs"].as_u64(), map["held"].as_str()), (Some(0), Some("")), "{what}");
        assert!(!dir.path().join("moves.json").exists(), "{what}: the plan is removed");
        // The host works: a malleable job is placed and resized.
        ok(&d.socket, r#"{"op":"allocate","job":"m","request":"affinity[thread*1-2]"}"#);
        ok(&d.socket, r#"{"op":"resize","job":"m","tasks":1}"#);
        assert!(!dir.path().join("moves.json").exists(), "{what}: no plan stays after a move");
        let log = std::fs::read_to_string(dir.path().join("topod.log")).unwrap();
        if what != "unknown jobs and CPUs the host lacks" {
            assert!(log.contains("plan of moves") && log.contains("moves.json"), "{what}: {log}");
        }
        assert!(!log.contains("panicked"), "{what}: {log}");
    }
}

#[test]
fn corrupt_reservations_are_reported_and_a_new_reserve_replaces_them() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("reservations.json");
    std::fs::write(&file, r#"[{"job":"w","cpus":"0-7""#).unwrap();
    let d = start_fake(dir.path());
    let s = d.socket.as_path();
    let log = std::fs::read_to_string(dir.path().join("topod.log")).unwrap();
    assert!(
        log.contains("reservations.json") && log.contains("starting without topology reservations"),
        "{log}"
    );
    assert!(free_map(s).get("reservations").is_none());
    let r = ok(s, r#"{"op":"reserve","job":"w","request":"affinity[core(4)]","expires_in_s":60}"#);
    let saved: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(saved[0]["job"], "w");
    assert_eq!(saved[0]["cpus"], r["cpus"]);
}

#[test]
fn reservations_covering_the_host_refuse_fit_and_other_jobs_but_not_their_own() {
    let dir = tempfile::tempdir().unwrap();
    let d = start_fake(dir.path());
    let s = d.socket.as_path();
    // The emulated EPYC 9654 has two packages: one block each.
    ok(s, r#"{"op":"reserve","job":"w1","request":"affinity[socket]","expires_in_s":600}"#);
    ok(s, r#"{"op":"reserve","job":"w2","request":"affinity[socket]","expires_in_s":600}"#);
    refused(
        s,
        r#"{"op":"reserve","job":"w3","request":"affinity[thread]","expires_in_s":60}"#,
        "does_not_fit",
        "w3",
    );
    refused(s, r#"{"op":"fit","request":"affinity[thread]"}"#, "does_not_fit", "");
    refused(
        s,
        r#"{"op":"allocate","job":"other","request":"affinity[thread]"}"#,
        "does_not_fit",
        "other",
    );
    assert_eq!(free_map(s)["reservations"].as_array().map(Vec::len), Some(2));
    let w1 = ok(s, r#"{"op":"allocate","job":"w1","request":"affinity[socket]"}"#);
    assert_eq!(
        topo_core::CpuSet::parse_list(w1["cpus"].as_str().unwrap()).unwrap().len(),
        192,
        "{w1}"
    );
    // Its reservation is spent; the other one still holds.
    assert_eq!(free_map(s)["reservations"].as_array().map(Vec::len), Some(1));
    refused(
        s,
        r#"{"op":"allocate","job":"other","request":"affinity[thread]"}"#,
        "does_not_fit",
        "other",
    );
    ok(s, r#"{"op":"unreserve","job":"w2"}"#);
    ok(s, r#"{"op":"allocate","job":"other","request":"affinity[thread]"}"#);
}

#[test]
fn bad_prime_pool_configurations_stop_topod_with_a_message() {
    let pool = |body: &str| format!("[[prime_pools]]\n{body}\n");
    for (config, says) in [
        (
            pool("name = \"a\"\ncpus = \"0-7\"\nwindows = [\"Mon 08:00-09:00\"]")
                + &pool("name = \"b\"\ncpus = \"4-11\"\nwindows = [\"Mon 08:00-09:00\"]"),
            "CPUs 4-7 are in another pool",
        ),
        (
            pool("name = \"a\"\ncpus = \"0-7\"\nwindows = [\"Mon 08:00-09:00\"]")
                + &pool("name = \"a\"\ncpus = \"8-11\"\nwindows = [\"Mon 08:00-09:00\"]"),
            "distinct, non-empty names",
        ),
        (
            pool("name = \"a\"\nshape = \"affinity[socket*3]\"\nwindows = [\"Mon 08:00-09:00\"]"),
            "never fit",
        ),
        (
            pool("name = \"a\"\ncpus = \"0-7\"\nshape = \"affinity[core]\"\nwindows = [\"Mon 08:00-09:00\"]"),
            "one of the two",
        ),
        (pool("name = \"a\"\ncpus = \"0-4000\"\nwindows = [\"Mon 08:00-09:00\"]"), "384-4000"),
        (pool("name = \"a\"\ncpus = \"0-7\"\nwindows = []"), "no windows"),
        (pool("name = \"a\"\ncpus = \"0-7\"\nwindows = [\"Mon 25:00-26:00\"]"), "not a time of day"),
        (pool("name = \"a\"\ncpus = \"0-7\"\nwindows = [\"Fri-Mon 08:00-09:00\"]"), "backwards"),
        (pool("name = \"a\"\ncpus = \"0-7\"\nwindows = [\"Mon 22:00-02:00\"]"), "across midnight"),
        (
            pool("name = \"a\"\ncpus = \"0-7\"\nwindows = [\"Mon 08:00-09:00\"]\non_open = \"evict\""),
            "expected `stay` or `migrate`",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("run")).unwrap();
        let err = topod_that_stops(dir.path(), &config);
        assert!(err.contains(says), "{config}\nshould say {says:?}: {err}");
    }
}

#[test]
fn resize_suspend_resume_and_release_racing_keep_the_ledger_whole() {
    let dir = tempfile::tempdir().unwrap();
    let d = start_fake(dir.path());
    let socket = d.socket.clone();
    for round in 0..25 {
        let job = format!("race{round}");
        ok(
            &socket,
            &format!(r#"{{"op":"allocate","job":"{job}","request":"affinity[core*2-16]"}}"#),
        );
        let requests = [
            format!(r#"{{"op":"release","job":"{job}"}}"#),
            format!(r#"{{"op":"resize","job":"{job}","tasks":2}}"#),
            format!(r#"{{"op":"suspend","job":"{job}"}}"#),
            format!(r#"{{"op":"resize","job":"{job}","tasks":16}}"#),
            format!(r#"{{"op":"resume","job":"{job}"}}"#),
            format!(r#"{{"op":"resize","job":"{job}","tasks":5}}"#),
        ];
        let threads: Vec<_> = (0..requests.len())
            .map(|i| {
                // A different order each round.
                let request = requests[(i + round) % requests.len()].clone();
                let socket = socket.clone();
                std::thread::spawn(move || ask(&socket, &request))
            })
            .collect();
        for t in threads {
            let reply = t.join().unwrap();
            if let Some(e) = reply.get("error") {
                let code = e["code"].as_str().unwrap_or("");
                assert!(
                    ["bad_request", "unknown_job", "does_not_fit"].contains(&code),
                    "a race is refused plainly, never as an internal error: {reply}"
                );
            }
        }
        let _ = ask(&socket, &format!(r#"{{"op":"resume","job":"{job}"}}"#));
        let _ = ask(&socket, &format!(r#"{{"op":"release","job":"{job}"}}"#));
        let map = free_map(&socket);
        assert_eq!(
            (map["jobs"].as_u64(), map["held"].as_str()),
            (Some(0), Some("")),
            "round {round}: {map}"
        );
        assert!(!notify_file(&socket, &job).exists(), "round {round}");
    }
    assert!(!socket.with_file_name("moves.json").exists());
    assert!(!dir.path().join("moves.json").exists());
    let log = std::fs::read_to_string(dir.path().join("topod.log")).unwrap();
    assert!(!log.contains("panicked"), "{log}");
}
