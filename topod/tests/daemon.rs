//! topod as a process: its socket protocol, bad input, permissions, `topo-exec`, and a restart
//! after SIGKILL with real cgroups (as root, on the host's cpuset controller: v1 on CI's machine
//! class, v2 on a pure v2 host; skipped visibly where there is none).

mod common;

use common::{error_of, is_root, raw, start};
use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::{Duration, Instant};
use topo_client::{Client, ClientError};
use topo_core::proto::Op;

#[test]
fn protocol_and_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let d = start(dir.path(), &["--cgroup", "fake"], true);
    let mut c = Client::connect(&d.socket).unwrap();
    assert_eq!(c.call(Op::Version).unwrap()["protocol"], topo_core::proto::PROTOCOL_VERSION);
    assert_eq!(c.call(Op::Topology).unwrap()["pus"], "0-383");
    let a = c
        .call(Op::Allocate(topo_core::proto::AllocateArgs::new(
            "100",
            "affinity[core(4,same=l3)*2]",
        )))
        .unwrap();
    assert_eq!(
        a["cpus"].as_str().map(|s| topo_core::CpuSet::parse_list(s).unwrap().len()),
        Some(16)
    );
    // Every reply reads as its type in topo_core::proto::reply (or the type the reply names).
    let free = c.free_map().unwrap();
    assert_eq!(
        (free.jobs, free.job_ids.clone(), free.held.len()),
        (1, vec!["100".to_string()], 16)
    );
    assert_eq!(c.version().unwrap().protocol, topo_core::proto::PROTOCOL_VERSION);
    assert_eq!(c.topology().unwrap().pus.len(), 384);
    let listed = c.list().unwrap();
    assert_eq!(
        (listed[0].allocation.job.as_str(), listed[0].state),
        ("100", topo_core::ledger::JobState::Running)
    );
    let gen = free.generation;
    // The fake backend has no files to move oneself through: clients then ask join.
    assert_eq!(
        c.call(Op::SelfJoinFiles { job: "100".into() }).unwrap(),
        serde_json::json!({ "job": "100", "files": [] })
    );

    // Garbage of every kind: a clear error each, nothing changes.
    let long = format!("{{\"v\":1,\"op\":\"release\",\"job\":\"{}\"}}", "9".repeat(70_000));
    let cases: Vec<(Vec<u8>, &str, &str)> = vec![
        (b"{\"v\":1,\"op\":\"allocate\"".to_vec(), "bad_request", "not JSON"),
        (b"not json at all".to_vec(), "bad_request", "not JSON"),
        (long.into_bytes(), "bad_request", "longer than the limit"),
        (b"{\"v\":1,\"op\":\"reboot\"}".to_vec(), "bad_request", "unknown operation"),
        (b"{\"v\":7,\"op\":\"list\"}".to_vec(), "bad_request", "version 7"),
        (b"{\"v\":1,\"op\":\"release\",\"job\":\"../x\"}".to_vec(), "bad_request", "'/'"),
        (b"{\"v\":1,\"op\":\"release\",\"job\":\"a/b\"}".to_vec(), "bad_request", "'/'"),
        (b"{\"v\":1,\"op\":\"release\",\"job\":\".\"}".to_vec(), "bad_request", "starts with"),
        (b"{\"v\":1,\"op\":\"release\",\"job\":\"a\\u0000b\"}".to_vec(), "bad_request", "'\\0'"),
        (
            format!("{{\"v\":1,\"op\":\"release\",\"job\":\"{}\"}}", "7".repeat(4096)).into_bytes(),
            "bad_request",
            "4096 bytes",
        ),
        (
            b"{\"v\":1,\"op\":\"allocate\",\"job\":\"101\",\"request\":\"affinity[cores]\"}"
                .to_vec(),
            "bad_topology_request",
            "cores",
        ),
        (
            b"{\"v\":1,\"op\":\"allocate\",\"job\":\"101\",\"request\":\"affinity[socket*3]\"}"
                .to_vec(),
            "does_not_fit",
            "never fit",
        ),
        (b"{\"v\":1,\"op\":\"release\",\"job\":\"999\"}".to_vec(), "unknown_job", "999"),
        (b"{\"v\":1,\"op\":\"self_join_files\",\"job\":\"999\"}".to_vec(), "unknown_job", "999"),
        (b"{\"v\":1,\"op\":\"self_join_files\",\"job\":\"../100\"}".to_vec(), "bad_request", "'/'"),
    ];
    for (bytes, code, text) in cases {
        let reply = raw(&d.socket, &bytes);
        let (got_code, message) = error_of(&reply);
        assert_eq!(got_code, code, "{message}");
        assert!(message.contains(text), "{code}: {message:?} should mention {text:?}");
        // A version 1 client is answered in version 1, which has no `at`.
        assert_eq!(reply["v"], 1, "{reply}");
        assert!(reply["error"].get("at").is_none(), "{reply}");
    }
    // In version 2 the same refusal points at the offending text of the request string.
    let v2 = raw(
        &d.socket,
        b"{\"v\":2,\"op\":\"allocate\",\"job\":\"101\",\"request\":\"affinity[cores]\"}",
    );
    assert_eq!(v2["v"], 2, "{v2}");
    assert_eq!(v2["error"]["at"], serde_json::json!({"field": "request", "start": 9, "end": 14}));
    let v2_fit =
        raw(&d.socket, b"{\"v\":2,\"op\":\"fit\",\"request\":\"affinity[core(2):membind=x]\"}");
    assert_eq!(v2_fit["error"]["at"]["start"], 25, "{v2_fit}");
    // A refusal with no one place to point at has none.
    let never = raw(
        &d.socket,
        b"{\"v\":2,\"op\":\"allocate\",\"job\":\"101\",\"request\":\"affinity[socket*3]\"}",
    );
    assert_eq!((never["v"].as_u64(), never["error"].get("at")), (Some(2), None), "{never}");
    let after = c.call(Op::FreeMap).unwrap();
    assert_eq!(after["generation"].as_u64(), Some(gen), "no bad request changed the ledger");
    assert_eq!(after["jobs"], 1);

    // A user who is not an administrator may read, not change.
    if is_root() {
        let out = Command::new(env!("CARGO_BIN_EXE_topo-exec"))
            .args([
                "--socket",
                d.socket.to_str().unwrap(),
                "--job",
                "102",
                "--request",
                "affinity[thread]",
                "--",
                "true",
            ])
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("allocate needs root"), "{err}");
        assert_eq!(c.call(Op::FreeMap).unwrap()["jobs"], 1);
    } else {
        common::skip("the non-administrator check needs root to switch users");
    }
    let done = c.call(Op::Release { job: "100".into() }).unwrap();
    assert_eq!(done["job"], "100");
    assert!(matches!(c.call(Op::Release { job: "100".into() }), Err(ClientError::Refused(_))));
}

/// Under the systemd unit's `UMask=0077` the jobs' notify files must still be readable by the
/// jobs' users (`TOPO_NOTIFY_FILE`), and no one else may write them.
#[test]
fn notify_files_are_readable_by_jobs_whatever_topods_umask() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("topod.sock");
    let zen4 = common::topologies().join("converted-hwloc2.9/AMD-19h-Zen4-2xEpyc-9654.xml");
    let child = Command::new("sh")
        .args(["-c", "umask 077; exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_topod"))
        .args(["--socket", socket.to_str().unwrap(), "--state-dir", dir.path().to_str().unwrap()])
        .args(["--topology", zen4.to_str().unwrap(), "--cgroup", "fake"])
        .stderr(std::fs::File::create(dir.path().join("topod.log")).unwrap())
        .spawn()
        .unwrap();
    let _d = common::Daemon { child, socket: socket.clone() };
    let start = Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(start.elapsed() < Duration::from_secs(20), "topod did not open its socket");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut c = Client::connect(&socket).unwrap();
    c.allocate(Op::allocate("n1", "affinity[core]")).unwrap();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let notify_dir = topo_core::proto::notify_dir_for(&socket);
    assert_eq!(mode(&notify_dir), 0o755, "{}", notify_dir.display());
    assert_eq!(mode(&notify_dir.join("n1")), 0o644);
}

#[test]
fn fit_within_the_cpus_the_batch_system_gave() {
    let dir = tempfile::tempdir().unwrap();
    let d = start(dir.path(), &["--cgroup", "fake"], true);
    let mut c = Client::connect(&d.socket).unwrap();
    let within = |cpus: &str| topo_core::proto::FitArgs {
        cpus: Some(cpus.into()),
        ..topo_core::proto::FitArgs::new("affinity[core(2)]")
    };
    // The emulated EPYC 9654 pairs CPU n with n+192 on one core.
    let given = "8-10,200-202";
    let fit: topo_core::place::Fit = c.call_as(Op::Fit(within(given))).unwrap();
    assert_eq!(fit.cpus.len(), 4, "two cores of two threads: {}", fit.cpus);
    assert!(fit.cpus.is_subset(&topo_core::CpuSet::parse_list(given).unwrap()), "{}", fit.cpus);
    // Single threads of eight cores hold no whole core; a CPU the host does not have is named.
    let e = c.call(Op::Fit(within("8-15"))).unwrap_err().to_string();
    assert!(e.contains("the request does not fit") && e.contains("whole core"), "{e}");
    let e = c.call(Op::Fit(within("5000"))).unwrap_err().to_string();
    assert!(e.contains("5000"), "{e}");
}

#[test]
fn topo_exec_runs_the_job_inside_and_a_restart_keeps_it() {
    let dir = tempfile::tempdir().unwrap();
    let Some((mut d, cgroups, subtree, cleanup, config)) =
        common::real_daemon(dir.path(), "topo-daemon-test", "")
    else {
        return;
    };
    // The job: a shell (started by topo-exec inside the job's cgroup) that reports its CPUs.
    let out_file = dir.path().join("inside.txt");
    let mut job = Command::new(env!("CARGO_BIN_EXE_topo-exec"))
        .args([
            "--socket",
            d.socket.to_str().unwrap(),
            "--job",
            "200",
            "--request",
            "affinity[thread*1]",
            "--",
        ])
        .args([
            "sh",
            "-c",
            &format!(
                "grep Cpus_allowed_list /proc/self/status > {}; echo $TOPO_CPUS >> {}; sleep 300",
                out_file.display(),
                out_file.display()
            ),
        ])
        .spawn()
        .unwrap();
    let start_t = Instant::now();
    while std::fs::read_to_string(&out_file).map(|s| s.lines().count() < 2).unwrap_or(true) {
        assert!(start_t.elapsed() < Duration::from_secs(20), "the job did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let inside = std::fs::read_to_string(&out_file).unwrap();
    let mut lines = inside.lines();
    let allowed = lines.next().unwrap().split(':').nth(1).unwrap().trim().to_string();
    let given = lines.next().unwrap().trim().to_string();
    assert_eq!(allowed, given, "the job runs on exactly the CPUs topod gave it");
    // The job is in every hierarchy (v1: topo-exec ran as root and single-threaded, so it moved
    // itself in; v2: topod moved it).
    let roots = cgroups.roots(&subtree);
    let cgroup_dir = roots[0].join("200");
    for root in &roots {
        let procs = std::fs::read_to_string(root.join("200/cgroup.procs")).unwrap();
        assert!(
            procs.split_whitespace().any(|p| p == job.id().to_string()),
            "{} in {}",
            job.id(),
            root.display()
        );
    }

    // topod runs with only the capabilities it needs, in every thread (capabilities are each
    // thread's own: a thread started before they were dropped kept root's, as the thread that
    // runs scontrol and qalter once did).
    // CAP_KILL (5), CAP_NET_BIND_SERVICE (10, for qalter's pbs_iff) and CAP_SYS_NICE (23)
    // only: everything else it does is as uid 0 on root's files.
    let wanted = (1u64 << 5) | (1 << 10) | (1 << 23);
    let tasks = std::fs::read_dir(format!("/proc/{}/task", d.child.id())).unwrap();
    let mut threads = 0;
    for task in tasks {
        let status = std::fs::read_to_string(task.unwrap().path().join("status")).unwrap();
        let cap = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
                .unwrap()
        };
        let name = status.lines().next().unwrap_or_default().to_string();
        assert_eq!(cap("CapEff:"), wanted, "{name}: CapEff {:#x}", cap("CapEff:"));
        assert_eq!(cap("CapPrm:"), wanted, "{name}: CapPrm {:#x}", cap("CapPrm:"));
        threads += 1;
    }
    assert!(threads > 2, "topod's threads were seen ({threads})");
    // SIGKILL topod and start it again: the job keeps its CPUs and stays in the ledger.
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    drop(d);
    let d = start(dir.path(), &["--config", config.to_str().unwrap()], false);
    let mut c = Client::connect(&d.socket).unwrap();
    let list = c.call(Op::List).unwrap();
    assert_eq!(list[0]["job"], "200", "{list}");
    assert_eq!(list[0]["cpus"], given.as_str());
    // Nobody else gets those CPUs.
    let other = c.call(Op::allocate("201", "affinity[thread*1]"));
    match other {
        Ok(o) => {
            assert_ne!(o["cpus"], given.as_str());
            c.call(Op::Release { job: "201".into() }).unwrap();
        }
        Err(e) => assert!(e.to_string().contains("free"), "a one-CPU host has nothing left: {e}"),
    }
    // Release kills the job and removes its cgroup.
    c.call(Op::Release { job: "200".into() }).unwrap();
    assert!(job.wait().unwrap().code().is_none(), "the job was killed");
    assert!(!cgroup_dir.exists());

    // A job start in one request: allocate with join_pid moves the process in.
    let mut sleeper = Command::new("sleep").arg("300").spawn().unwrap();
    let pid = sleeper.id() as i32;
    let a = c.call(Op::allocate("202", "affinity[thread*1]").joining(pid)).unwrap();
    for root in &roots {
        let procs = std::fs::read_to_string(root.join("202/cgroup.procs")).unwrap();
        assert!(
            procs.split_whitespace().any(|p| p == pid.to_string()),
            "{pid} in {}",
            root.display()
        );
    }
    let allowed = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let allowed = allowed
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .to_string();
    assert_eq!(allowed, a["cpus"].as_str().unwrap(), "the kernel confines it to the job's CPUs");
    c.call(Op::Release { job: "202".into() }).unwrap();
    assert!(sleeper.wait().unwrap().code().is_none(), "killed by the release");
    // A process that is not there: a bad request (not `internal`), and nothing is allocated.
    let err = c.call(Op::allocate("203", "affinity[thread*1]").joining(i32::MAX)).unwrap_err();
    assert!(
        matches!(&err, ClientError::Refused(e) if e.code == topo_core::proto::ErrorCode::BadRequest),
        "{err:?}"
    );
    assert!(err.to_string().contains(&format!("no process {} is running", i32::MAX)), "{err}");
    assert_eq!(c.call(Op::List).unwrap(), serde_json::json!([]));
    assert!(roots.iter().all(|root| !root.join("203").exists()), "no cgroup either");
    // pid 0 (the writer itself, to the kernel), topod itself and any of its threads are refused,
    // and a job that was there before keeps its allocation.
    c.call(Op::allocate("204", "affinity[thread*1]")).unwrap();
    let err = c.call(Op::allocate("204", "affinity[thread*1]").joining(0)).unwrap_err();
    assert!(err.to_string().contains("pid 0 names no process"), "{err}");
    let topod_pid = d.child.id() as i32;
    assert!(c
        .call(Op::Join { job: "204".into(), pid: topod_pid })
        .unwrap_err()
        .to_string()
        .contains("is topod itself"));
    for tid in std::fs::read_dir(format!("/proc/{topod_pid}/task"))
        .unwrap()
        .flatten()
        .filter_map(|t| t.file_name().to_str()?.parse::<i32>().ok())
    {
        let err = c.call(Op::Join { job: "204".into(), pid: tid }).unwrap_err().to_string();
        assert!(
            err.contains("is topod itself") || err.contains("is a thread, not a process"),
            "tid {tid}: {err}"
        );
    }
    // The host's init, and a kernel thread (the kernel refuses it: said so, not `internal`):
    // an attack finding, init was moved in, and the job then could not be released.
    let err = c.call(Op::Join { job: "204".into(), pid: 1 }).unwrap_err().to_string();
    assert!(err.contains("pid 1 is not a process topod can move") && err.contains("init"), "{err}");
    let kthreadd = std::fs::read_to_string("/proc/2/comm").is_ok_and(|c| c.trim() == "kthreadd");
    if kthreadd {
        let err = c.call(Op::Join { job: "204".into(), pid: 2 }).unwrap_err();
        assert!(
            matches!(&err, ClientError::Refused(e) if e.code == topo_core::proto::ErrorCode::BadRequest)
                && err.to_string().contains("pid 2 is not a process topod can move"),
            "{err:?}"
        );
    }
    assert_eq!(c.call(Op::List).unwrap()[0]["job"], "204");
    c.call(Op::Release { job: "204".into() }).unwrap();
    drop(cleanup);
}

/// A topod on this host's real cgroups in its own subtree (`name`, plus `extra` config lines),
/// or `None` when this host cannot (not root, no cpuset controller): the test then says SKIPPED.
#[test]
fn auto_release_frees_a_finished_job() {
    let dir = tempfile::tempdir().unwrap();
    let Some((d, cgroups, subtree, _cleanup, _)) =
        common::real_daemon(dir.path(), "topo-auto-test", "auto_release = true\n")
    else {
        return;
    };
    let status = Command::new(env!("CARGO_BIN_EXE_topo-exec"))
        .args([
            "--socket",
            d.socket.to_str().unwrap(),
            "--job",
            "300",
            "--request",
            "affinity[thread]",
            "--",
            "true",
        ])
        .status()
        .unwrap();
    assert!(status.success());
    let mut c = Client::connect(&d.socket).unwrap();
    let start_t = Instant::now();
    while c.call(Op::List).unwrap() != serde_json::json!([]) {
        // A hang guard, not a speed check: a busy machine may take a while (issue 29).
        assert!(start_t.elapsed() < Duration::from_secs(120), "the finished job was not released");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(cgroups.roots(&subtree).iter().all(|root| !root.join("300").exists()));
}

#[test]
fn the_tcp_listener_is_read_only_and_keyed() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let key_file = dir.path().join("tcp.key");
    std::fs::write(&key_file, "0123456789abcdef-test-key\n").unwrap();
    let config = dir.path().join("topod.toml");
    std::fs::write(
        &config,
        format!("tcp_listen = \"127.0.0.1:{port}\"\ntcp_allow = [\"127.0.0.0/8\"]\ntcp_key_file = \"{}\"\n", key_file.display()),
    )
    .unwrap();
    // A key every user can read is refused, saying how to fix it.
    std::fs::set_permissions(&key_file, std::os::unix::fs::PermissionsExt::from_mode(0o644))
        .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_topod"))
        .args([
            "--cgroup",
            "fake",
            "--config",
            config.to_str().unwrap(),
            "--socket",
            dir.path().join("s").to_str().unwrap(),
            "--state-dir",
            dir.path().to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("every user can read or change it (mode 644)")
            && err.contains("chmod 600"),
        "{err}"
    );
    std::fs::set_permissions(&key_file, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .unwrap();
    let _d = start(dir.path(), &["--cgroup", "fake", "--config", config.to_str().unwrap()], true);
    let ask = |first: &str, request: &str| -> Value {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(format!("{first}\n{request}\n").as_bytes()).unwrap();
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap()
    };
    let free = ask("0123456789abcdef-test-key", "{\"v\":1,\"op\":\"free_map\"}");
    assert_eq!(free["ok"]["allocatable"], "0-383", "{free}");
    let (code, message) = error_of(&ask("wrong-key", "{\"v\":1,\"op\":\"free_map\"}"));
    assert_eq!(code, "forbidden", "{message}");
    assert!(message.contains("key"));
    let (code, message) =
        error_of(&ask("0123456789abcdef-test-key", "{\"v\":1,\"op\":\"release\",\"job\":\"1\"}"));
    assert_eq!(code, "forbidden");
    assert!(message.contains("read-only"), "{message}");
    let (code, message) = error_of(&ask(
        "0123456789abcdef-test-key",
        "{\"v\":1,\"op\":\"self_join_files\",\"job\":\"1\"}",
    ));
    assert_eq!(code, "forbidden");
    assert!(message.contains("read-only"), "{message}");
}

#[test]
fn lsf_pre_exec_job_starter_and_post_exec() {
    // topod on an emulated machine with the fake backend: no root needed.
    let dir = tempfile::tempdir().unwrap();
    let d = start(dir.path(), &["--cgroup", "fake"], true);
    let host = nix::unistd::gethostname().unwrap().to_string_lossy().into_owned();
    let me = nix::unistd::User::from_uid(nix::unistd::getuid()).unwrap().unwrap().name;
    let lsf_env = |c: &mut Command| {
        c.env("LSB_JOBID", "4711")
            .env("LSB_JOBINDEX", "3")
            .env("LSB_MCPU_HOSTS", format!("elsewhere 8 {host} 3"))
            .env("TMPDIR", dir.path())
            .env("USER", &me)
            .env_remove("TOPO_REQUEST")
            .env_remove("TOPO_QUEUE_MANDATORY")
            .env_remove("TOPO_QUEUE_DEFAULT");
    };
    let topoctl = |sub: &str, extra: &[(&str, &str)]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_topoctl"));
        c.args([sub, "--socket", d.socket.to_str().unwrap()]);
        lsf_env(&mut c);
        for (k, v) in extra {
            c.env(k, v);
        }
        c.output().unwrap()
    };
    // A bad request: exit 99, so that LSF ends the job instead of pending it forever.
    let bad = topoctl("lsf-pre-exec", &[("TOPO_REQUEST", "affinity[core(2,same=numaa)]")]);
    assert_eq!(bad.status.code(), Some(99), "{}", String::from_utf8_lossy(&bad.stderr));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("numaa"));
    // The host pre-exec (root) allocates: the queue's mandatory string is merged in.
    let pre = topoctl(
        "lsf-pre-exec",
        &[
            ("TOPO_REQUEST", "affinity[core(2)]"),
            ("TOPO_QUEUE_MANDATORY", "affinity[core(2,same=numa)]"),
        ],
    );
    assert!(pre.status.success(), "{}", String::from_utf8_lossy(&pre.stderr));
    assert!(
        String::from_utf8_lossy(&pre.stdout).contains("same=numa"),
        "{}",
        String::from_utf8_lossy(&pre.stdout)
    );
    // The job starter joins it and writes the affinity host file.
    let mut c = Command::new(env!("CARGO_BIN_EXE_topo-exec"));
    c.args([
        "--socket",
        d.socket.to_str().unwrap(),
        "--",
        "sh",
        "-c",
        "echo $TOPO_JOB; echo $LSB_AFFINITY_HOSTFILE; cat $LSB_AFFINITY_HOSTFILE",
    ]);
    lsf_env(&mut c);
    let out = c.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "lsf-4711[3]", "{text}");
    let hostfile = dir.path().join("topo-affinity.lsf-4711[3]");
    assert_eq!(lines[1], hostfile.to_str().unwrap());
    // Three tasks (this host's slots) of two cores each, one line per task.
    assert_eq!(lines.len(), 5, "{text}");
    let mut client = Client::connect(&d.socket).unwrap();
    let job = client.call(Op::List).unwrap()[0].clone();
    assert_eq!(job["job"], "lsf-4711[3]");
    for (line, task) in lines[2..].iter().zip(job["tasks"].as_array().unwrap()) {
        assert_eq!(*line, format!("{host} {}", task.as_str().unwrap()));
    }
    // The queue's JOB_CONTROLS actions freeze and thaw it (packaging/lsf/lsb.queues).
    let state = |client: &mut Client| client.call(Op::List).unwrap()[0]["state"].clone();
    let sus = topoctl("lsf-suspend", &[]);
    assert!(sus.status.success(), "{}", String::from_utf8_lossy(&sus.stderr));
    assert_eq!(state(&mut client), "suspended");
    assert!(topoctl("lsf-suspend", &[]).status.success(), "LSF may ask twice");
    let res = topoctl("lsf-resume", &[]);
    assert!(res.status.success(), "{}", String::from_utf8_lossy(&res.stderr));
    assert_eq!(state(&mut client), "running");
    // A job topod does not hold gets LSF's own signals, to its process groups.
    let mut other = Command::new("sleep").arg("60").process_group(0).spawn().unwrap();
    let pgid = other.id().to_string();
    let stat = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap()
            .rsplit(')')
            .next()
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .to_string()
    };
    let unheld = [("LSB_JOBID", "4712"), ("LSB_JOBPGIDS", pgid.as_str())];
    let sus = topoctl("lsf-suspend", &unheld);
    assert!(
        sus.status.success() && String::from_utf8_lossy(&sus.stdout).contains("SIGSTOP sent"),
        "{}",
        String::from_utf8_lossy(&sus.stderr)
    );
    // The kernel stops and continues the process as it runs next: waits of up to a minute, for
    // the state and not for a speed.
    let start = Instant::now();
    while stat(other.id()) != "T" && start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(stat(other.id()), "T", "SIGSTOP did not stop the job's process group");
    assert!(topoctl("lsf-resume", &unheld).status.success());
    let start = Instant::now();
    while stat(other.id()) == "T" && start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_ne!(stat(other.id()), "T", "SIGCONT did not continue the job's process group");
    let _ = other.kill();
    let _ = other.wait();
    let none = topoctl("lsf-suspend", &[("LSB_JOBID", "4713")]);
    assert!(
        !none.status.success()
            && String::from_utf8_lossy(&none.stderr)
                .contains("LSB_JOBPGIDS names no process group")
    );
    // The host post-exec releases it and removes the host file.
    let post = topoctl("lsf-post-exec", &[]);
    assert!(post.status.success(), "{}", String::from_utf8_lossy(&post.stderr));
    assert_eq!(client.call(Op::List).unwrap().as_array().unwrap().len(), 0);
    assert!(!hostfile.exists());
}

#[test]
fn a_jobs_owner_may_suspend_and_resume_it_and_nobody_else_may() {
    if !is_root() {
        return common::skip("switching users needs root");
    }
    let dir = tempfile::tempdir().unwrap();
    let d = start(dir.path(), &["--cgroup", "fake"], true);
    let socket = d.socket.to_str().unwrap().to_string();
    let mut c = Client::connect(&d.socket).unwrap();
    c.call(Op::Allocate(topo_core::proto::AllocateArgs {
        owner_uid: Some(65534),
        ..topo_core::proto::AllocateArgs::new("300", "affinity[core(1)]")
    }))
    .unwrap();
    let as_uid = |uid: u32, sub: &str| {
        Command::new(env!("CARGO_BIN_EXE_topoctl"))
            .args([sub, "300", "--socket", &socket])
            .uid(uid)
            .gid(65534)
            .output()
            .unwrap()
    };
    let other = as_uid(65533, "suspend");
    assert!(
        !other.status.success()
            && String::from_utf8_lossy(&other.stderr)
                .contains("suspending a job that is not yours")
    );
    assert!(as_uid(65534, "suspend").status.success());
    assert_eq!(c.call(Op::List).unwrap()[0]["state"], "suspended");
    let other = as_uid(65533, "resume");
    assert!(
        !other.status.success()
            && String::from_utf8_lossy(&other.stderr).contains("resuming a job that is not yours")
    );
    assert!(as_uid(65534, "resume").status.success());
    assert_eq!(c.call(Op::List).unwrap()[0]["state"], "running");
    // A suspension by root (or the batch system) is not the owner's to undo.
    c.call(Op::Suspend { job: "300".into() }).unwrap();
    let owner = as_uid(65534, "resume");
    let err = String::from_utf8_lossy(&owner.stderr);
    assert!(!owner.status.success() && err.contains("only they may resume it"), "{err}");
    assert_eq!(c.call(Op::List).unwrap()[0]["state"], "suspended");
    // An LSF action as a user, for a job topod does not hold: LSF's own signals, not a refusal.
    let mut mine =
        Command::new("sleep").arg("60").uid(65534).gid(65534).process_group(0).spawn().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_topoctl"))
        .args(["lsf-suspend", "--socket", &socket])
        .env("LSB_JOBID", "999")
        .env("LSB_JOBPGIDS", mine.id().to_string())
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("SIGSTOP sent"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = mine.kill();
    let _ = mine.wait();
}

#[test]
fn topoctl_alloc_gives_the_owner_by_name_or_uid() {
    let dir = tempfile::tempdir().unwrap();
    let d = start(dir.path(), &["--cgroup", "fake"], true);
    let socket = d.socket.to_str().unwrap().to_string();
    let topoctl = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_topoctl"))
            .args(args)
            .args(["--socket", &socket])
            .output()
            .unwrap()
    };
    let nobody = nix::unistd::User::from_name("nobody").unwrap().unwrap().uid.as_raw();
    for (job, owner) in [("o1", "nobody".to_string()), ("o2", nobody.to_string())] {
        let out = topoctl(&["alloc", "--job", job, "--owner", &owner, "affinity[thread]"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let out = topoctl(&["jobs", "--json"]);
    let jobs: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let owners: Vec<&serde_json::Value> =
        jobs.as_array().unwrap().iter().map(|j| &j["owner_uid"]).collect();
    assert_eq!(owners, [&serde_json::json!(nobody), &serde_json::json!(nobody)]);
    let out = topoctl(&["alloc", "--job", "o3", "--owner", "no-such-user-x", "affinity[thread]"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains("no user \"no-such-user-x\" on this host"),
        "{said}"
    );
}

#[test]
fn suspend_lend_and_resume_through_topoctl() {
    let dir = tempfile::tempdir().unwrap();
    let d = start(dir.path(), &["--cgroup", "fake"], true);
    let socket = d.socket.to_str().unwrap().to_string();
    let topoctl = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_topoctl"))
            .args(args)
            .args(["--socket", &socket])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (code, text) = topoctl(&["alloc", "--job", "200", "affinity[core(8,same=l3)]"]);
    assert_eq!(code, Some(0), "{text}");
    let (code, text) = topoctl(&["suspend", "200"]);
    assert!(
        code == Some(0)
            && text.contains("job 200 suspended: frozen in")
            && text.contains("may be lent"),
        "{text}"
    );
    // Another L3 group is free: a job of the same shape goes there, not on 200's CPUs.
    let held_by = |job: &str| {
        let (_, json) = topoctl(&["jobs", "--json"]);
        let list: serde_json::Value = serde_json::from_str(&json).unwrap();
        let found = list.as_array().unwrap().iter().find(|j| j["job"] == job).cloned();
        found.map(|j| j["cpus"].as_str().unwrap().to_string()).unwrap()
    };
    let suspended_cpus = held_by("200");
    let (code, text) = topoctl(&["alloc", "--job", "199", "affinity[core(8,same=l3)]"]);
    assert_eq!(code, Some(0), "{text}");
    assert_ne!(held_by("199"), suspended_cpus);
    let (code, text) = topoctl(&["release", "199"]);
    assert_eq!(code, Some(0), "{text}");
    // Placed inside 200's CPUs (as a batch system that chose them would): they are lent.
    let (code, text) =
        topoctl(&["alloc", "--job", "201", "--cpus", &suspended_cpus, "affinity[core(8,same=l3)]"]);
    assert_eq!(code, Some(0), "{text}");
    let (_, jobs) = topoctl(&["jobs"]);
    assert!(
        jobs.contains("suspended")
            && jobs.contains("lent to job 201")
            && jobs.contains("borrowed from suspended job 200"),
        "{jobs}"
    );
    let (code, text) = topoctl(&["resume", "200"]);
    assert!(
        code != Some(0)
            && text.contains("job 200 stays suspended")
            && text.contains("lent to job 201"),
        "{text}"
    );
    // Mistakes: a clear message each, nothing changes.
    for (args, expect) in [
        (vec!["suspend", "200"], "job 200 is suspended"),
        (vec!["resume", "201"], "job 201 is running"),
        (vec!["suspend", "999"], "job 999 holds nothing"),
        (vec!["resume", "../200"], "'/'"),
    ] {
        let (code, text) = topoctl(&args);
        assert!(code != Some(0) && text.contains(expect), "{args:?}: {text}");
    }
    if is_root() {
        let out = Command::new(env!("CARGO_BIN_EXE_topoctl"))
            .args(["suspend", "201", "--socket", &socket])
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && err.contains(
                    "suspending a job that is not yours needs root or a configured administrator"
                ),
            "{err}"
        );
    }
    let (code, _) = topoctl(&["release", "201"]);
    assert_eq!(code, Some(0));
    let (code, text) = topoctl(&["resume", "200", "--json"]);
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert!(code == Some(0) && v["job"] == "200" && v["thawed_after_us"].is_u64(), "{text}");
    let (_, jobs) = topoctl(&["jobs", "--json"]);
    let jobs: Value = serde_json::from_str(&jobs).unwrap();
    assert_eq!(
        (jobs[0]["job"].as_str(), jobs[0]["state"].as_str()),
        (Some("200"), Some("running"))
    );
}

#[test]
fn a_suspended_job_someone_thaws_is_frozen_again_within_a_tick() {
    let dir = tempfile::tempdir().unwrap();
    let Some((d, cgroups, _subtree, cleanup, _config)) =
        common::real_daemon(dir.path(), "topo-refreeze-test", "")
    else {
        return;
    };
    let mut c = Client::connect(&d.socket).unwrap();
    let mut sleeper = Command::new("sleep").arg("300").spawn().unwrap();
    c.call(Op::Allocate(topo_core::proto::AllocateArgs {
        join_pid: Some(sleeper.id() as i32),
        ..topo_core::proto::AllocateArgs::new("400", "affinity[thread*1]")
    }))
    .unwrap();
    c.call(Op::Suspend { job: "400".into() }).unwrap();
    // Thawed behind topod's back, through the kernel's own file.
    let (file, thawed, frozen) = match cgroups {
        common::RealCgroups::V1 { .. } => {
            let freezer =
                cleanup.0.iter().find(|r| r.to_string_lossy().contains("/freezer/")).unwrap();
            (freezer.join("400/freezer.state"), "THAWED", "FROZEN")
        }
        common::RealCgroups::V2 { .. } => (cleanup.0[0].join("400/cgroup.freeze"), "0", "1"),
    };
    std::fs::write(&file, thawed).unwrap();
    let start = Instant::now();
    while std::fs::read_to_string(&file).unwrap().trim() != frozen
        && start.elapsed() < Duration::from_secs(15)
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        std::fs::read_to_string(&file).unwrap().trim(),
        frozen,
        "frozen again by topod's tick"
    );
    assert!(std::fs::read_to_string(dir.path().join("topod.log"))
        .unwrap()
        .contains("found thawed"));
    c.call(Op::Release { job: "400".into() }).unwrap();
    let _ = sleeper.wait();
}

/// The running state of a job's cgroup, by the kernel's own files: `Some(true)` while thawed.
fn thawed(cgroups: &common::RealCgroups, cleanup: &common::SubtreeCleanup, job: &str) -> bool {
    match cgroups {
        common::RealCgroups::V1 { .. } => {
            let freezer =
                cleanup.0.iter().find(|r| r.to_string_lossy().contains("/freezer/")).unwrap();
            std::fs::read_to_string(freezer.join(job).join("freezer.state"))
                .is_ok_and(|s| s.trim() == "THAWED")
        }
        common::RealCgroups::V2 { .. } => {
            std::fs::read_to_string(cleanup.0[0].join(job).join("cgroup.events"))
                .is_ok_and(|s| s.lines().any(|l| l == "frozen 0"))
        }
    }
}

/// Samples two gang jobs' cgroups for `span`: how often each ran, and whether both ever did at
/// once. Both run only if the first is seen thawed before and after the second is (a switch
/// freezes before it thaws, so one read of each could catch either side of a switch).
fn sample_turns(
    cgroups: &common::RealCgroups,
    cleanup: &common::SubtreeCleanup,
    a: &str,
    b: &str,
    span: Duration,
) -> (u32, u32, u32) {
    let (mut a_ran, mut b_ran, mut both) = (0, 0, 0);
    let start = Instant::now();
    while start.elapsed() < span {
        let a1 = thawed(cgroups, cleanup, a);
        let b1 = thawed(cgroups, cleanup, b);
        let a2 = thawed(cgroups, cleanup, a);
        a_ran += u32::from(a1 && a2);
        b_ran += u32::from(b1);
        both += u32::from(a1 && b1 && a2);
        std::thread::sleep(Duration::from_millis(10));
    }
    (a_ran, b_ran, both)
}

#[test]
fn gang_jobs_on_one_cpu_take_turns_by_slices_on_real_cgroups_and_after_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let Some((d, cgroups, _subtree, cleanup, config)) =
        common::real_daemon(dir.path(), "topo-gang-test", "gang_rows = 2\ngang_slice_s = 1\n")
    else {
        return;
    };
    let mut c = Client::connect(&d.socket).unwrap();
    /// Spinners killed when the test ends, also when it fails.
    struct Spinners(Vec<std::process::Child>);
    impl Drop for Spinners {
        fn drop(&mut self) {
            for child in &mut self.0 {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
    let spin = || {
        Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap()
    };
    let spinners = Spinners(vec![spin(), spin()]);
    let (spin_a, spin_b) = (&spinners.0[0], &spinners.0[1]);
    // Both on CPU 0 (the batch system's choice), rows 0 and 1, each with its spinner moved in.
    for (job, row, pid) in [("g0", 0, spin_a.id()), ("g1", 1, spin_b.id())] {
        let v = c
            .call(Op::Allocate(topo_core::proto::AllocateArgs {
                cpus: Some("0".into()),
                gang: Some(true),
                gang_row: Some(row),
                join_pid: Some(pid as i32),
                ..topo_core::proto::AllocateArgs::new(job, "affinity[thread*1]")
            }))
            .unwrap();
        assert_eq!((v["cpus"].as_str(), v["gang_row"].as_u64()), (Some("0"), Some(row.into())));
    }
    // A job that runs through every slice finds no room on CPU 0.
    let err = c
        .call(Op::Allocate(topo_core::proto::AllocateArgs {
            cpus: Some("0".into()),
            prime: true,
            ..topo_core::proto::AllocateArgs::new("p", "affinity[thread*1]")
        }))
        .unwrap_err();
    assert!(err.to_string().contains("does not fit"), "{err}");
    let (a, b, both) = sample_turns(&cgroups, &cleanup, "g0", "g1", Duration::from_millis(3500));
    assert!(a > 20 && b > 20 && both == 0, "turns: g0 ran {a}, g1 ran {b}, both {both}");
    let free: Value = c.call(Op::FreeMap).unwrap();
    let gang = &free["gang"];
    assert!(gang["switches"].as_u64().unwrap() >= 2 && gang["rows"] == 2, "{free}");
    assert!(gang["last_switch_us"].as_u64().unwrap() < 200_000, "{gang}");
    // topod killed and started again: both jobs kept, the turns go on.
    drop(c);
    drop(d);
    let d = start(dir.path(), &["--config", config.to_str().unwrap()], false);
    let mut c = Client::connect(&d.socket).unwrap();
    let jobs: Value = c.call(Op::List).unwrap();
    assert_eq!(jobs.as_array().map(|j| j.len()), Some(2), "{jobs}");
    let (a, b, both) = sample_turns(&cgroups, &cleanup, "g0", "g1", Duration::from_millis(2500));
    assert!(a > 10 && b > 10 && both == 0, "after the restart: g0 {a}, g1 {b}, both {both}");
    for job in ["g0", "g1"] {
        c.call(Op::Release { job: job.into() }).unwrap();
    }
    drop(spinners);
}

#[test]
fn an_allocate_that_may_preempt_freezes_a_preemptible_job_and_topod_resumes_it_after() {
    let dir = tempfile::tempdir().unwrap();
    let Some((d, cgroups, _subtree, cleanup, _config)) = common::real_daemon(
        dir.path(),
        "topo-preempt-test",
        "preempt = true\npreempt_min_run_s = 0\n",
    ) else {
        return;
    };
    let mut c = Client::connect(&d.socket).unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs()
        as i64;
    let mut sleeper = Command::new("sleep").arg("300").spawn().unwrap();
    // The low job takes CPU 0; it may be suspended, and has barely waited.
    c.call(Op::Allocate(topo_core::proto::AllocateArgs {
        cpus: Some("0".into()),
        preemptible: true,
        submitted_at: Some(now - 10),
        estimate_s: Some(100_000),
        join_pid: Some(sleeper.id() as i32),
        ..topo_core::proto::AllocateArgs::new("low", "affinity[thread*1]")
    }))
    .unwrap();
    // Preempting needs the times an expansion factor comes from.
    let err = c
        .call(Op::Allocate(topo_core::proto::AllocateArgs {
            cpus: Some("0".into()),
            preempt: true,
            ..topo_core::proto::AllocateArgs::new("high", "affinity[thread*1]")
        }))
        .unwrap_err();
    assert!(err.to_string().contains("submitted_at"), "{err}");
    // A time limit of 0 (an unbeatable expansion factor) or a time before 1970: refused.
    for (submitted, estimate) in [(now - 86_400, 0), (-5, 3_600), (i64::MIN, 3_600)] {
        let err = c
            .call(Op::Allocate(topo_core::proto::AllocateArgs {
                cpus: Some("0".into()),
                preempt: true,
                submitted_at: Some(submitted),
                estimate_s: Some(estimate),
                ..topo_core::proto::AllocateArgs::new("high", "affinity[thread*1]")
            }))
            .unwrap_err();
        assert!(err.to_string().contains("estimate_s the job's time limit"), "{err}");
    }
    // The high job has waited a day for an hour's run: it gets CPU 0, low is frozen.
    let high = c
        .call(Op::Allocate(topo_core::proto::AllocateArgs {
            cpus: Some("0".into()),
            preempt: true,
            submitted_at: Some(now - 86_400),
            estimate_s: Some(3_600),
            ..topo_core::proto::AllocateArgs::new("high", "affinity[thread*1]")
        }))
        .unwrap();
    assert_eq!(high["cpus"], "0");
    assert!(!thawed(&cgroups, &cleanup, "low"), "low is frozen while high runs");
    let jobs: Value = c.call(Op::List).unwrap();
    let low = jobs.as_array().unwrap().iter().find(|j| j["job"] == "low").unwrap();
    assert_eq!(low["state"], "suspended", "{jobs}");
    // high ends: topod resumes low by itself.
    c.call(Op::Release { job: "high".into() }).unwrap();
    assert!(thawed(&cgroups, &cleanup, "low"), "low runs again");
    let jobs: Value = c.call(Op::List).unwrap();
    assert_eq!(jobs[0]["state"], "running", "{jobs}");
    c.call(Op::Release { job: "low".into() }).unwrap();
    let _ = sleeper.wait();
}

/// A stop (SIGTERM: `systemctl stop`, an upgrade's restart, a package removal) that comes while a
/// release is under way waits for it: the release answers, the job's processes are gone and its
/// cgroup removed, and topod exits 0. (Found by an attack: a stop between the release's freeze
/// and its thaw left the job frozen, 3,000 processes in D state, and after a package removal
/// nothing ever thawed it.)
#[test]
fn a_stop_during_a_release_finishes_the_release_first() {
    let dir = tempfile::tempdir().unwrap();
    let Some((mut d, cgroups, subtree, _cleanup, _config)) =
        common::real_daemon(dir.path(), "topo-stop-release", "")
    else {
        return;
    };
    // A job of many processes, so that its release (freeze, kill, wait) takes a while.
    let ready = dir.path().join("ready");
    let mut job = Command::new(env!("CARGO_BIN_EXE_topo-exec"))
        .args(["--socket", d.socket.to_str().unwrap(), "--job", "stop1"])
        .args(["--request", "affinity[thread*1]", "--", "sh", "-c"])
        .arg(format!("for i in $(seq 1500); do sleep 1000 & done; touch {}; wait", ready.display()))
        // Not the test's output: a job left frozen must not hold the test harness's pipes.
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let start_t = Instant::now();
    while !ready.exists() {
        // A hang guard, not a speed bound: 1,500 processes took over 120 s to start in the
        // emulated cgroup v2 guest (a local run of this stop).
        assert!(
            start_t.elapsed() < Duration::from_secs(600),
            "the job did not start its processes"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let socket = d.socket.clone();
    let releaser = std::thread::spawn(move || {
        Client::connect(&socket).unwrap().call(Op::Release { job: "stop1".into() })
    });
    // SIGTERM as soon as the job shows as releasing (or right away if that was missed).
    let mut c = Client::connect(&d.socket).unwrap();
    let seen = Instant::now();
    loop {
        let jobs = c.call(Op::List).unwrap();
        let releasing = jobs
            .as_array()
            .into_iter()
            .flatten()
            .any(|j| j["job"] == "stop1" && j["state"] == "releasing");
        if releasing || seen.elapsed() > Duration::from_secs(10) || releaser.is_finished() {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(d.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let reply = releaser.join().unwrap();
    let status = d.child.wait().unwrap();
    let left: Vec<_> = cgroups
        .roots(&subtree)
        .into_iter()
        .map(|r| r.join("stop1"))
        .filter(|d| d.exists())
        .collect();
    // A job left behind (the bug) is thawed and killed before the checks, so that a failure
    // leaves no frozen processes on the machine.
    for dir in &left {
        let _ = std::fs::write(dir.join("freezer.state"), "THAWED");
        let _ = std::fs::write(dir.join("cgroup.freeze"), "0");
        let _ = std::fs::write(dir.join("cgroup.kill"), "1");
        for pid in std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default().lines() {
            if let Ok(pid) = pid.trim().parse::<i32>() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
    let _ = job.wait();
    assert!(status.success(), "topod's exit after SIGTERM: {status:?}");
    assert!(reply.is_ok(), "the release under way was answered: {reply:?}");
    assert!(left.is_empty(), "the job's cgroups were left: {left:?}");
}

#[test]
fn topo_exec_into_a_suspended_job_is_refused_saying_why() {
    // Issue 29 saw root's topo-exec into a suspended job hang silently (a process joined to a
    // frozen job stops at once). The join is refused, with the reason, and the command never
    // runs; once the job is resumed it does.
    let dir = tempfile::tempdir().unwrap();
    let d = start(dir.path(), &["--cgroup", "fake"], true);
    let mut c = Client::connect(&d.socket).unwrap();
    c.call(Op::allocate("frozen-1", "affinity[core]")).unwrap();
    c.call(Op::Suspend { job: "frozen-1".into() }).unwrap();
    let marker = dir.path().join("ran");
    let exec = || {
        Command::new(env!("CARGO_BIN_EXE_topo-exec"))
            .args(["--socket", d.socket.to_str().unwrap(), "--job", "frozen-1", "--", "touch"])
            .arg(&marker)
            .output()
            .unwrap()
    };
    let out = exec();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("job frozen-1 is suspended") && err.contains("resume it first"), "{err}");
    assert!(!marker.exists(), "the command ran in a suspended job");
    c.call(Op::Resume { job: "frozen-1".into() }).unwrap();
    let out = exec();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(marker.exists());
}

/// Field `n` (1-based, as proc(5) numbers them) of a thread's `/proc/.../stat`.
fn stat_field(stat: &str, n: usize) -> Option<String> {
    // The command name (field 2) may hold spaces; the fields after it follow its last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split_whitespace().nth(n - 3).map(str::to_string)
}

/// topod's own threads keep clear of jobs (issue 29: a job owner's 400 spinning threads delayed
/// root's requests): with `reserved_cpus`, every thread of topod's, including a connection's,
/// runs only on those CPUs, and at nice -10; a thread serving a user who is not an
/// administrator at nice 10.
#[test]
fn topods_threads_run_on_the_reserved_cpus_ahead_of_jobs() {
    if !common::is_root() {
        return common::skip("raising topod's priority needs root");
    }
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap_or_default();
    if online.trim() == "0" {
        return common::skip("one CPU: none to keep for the system");
    }
    let dir = common::open_dir();
    let config = common::config(dir.path(), "cgroup = \"fake\"\nreserved_cpus = \"0\"\n");
    let d = common::start(dir.path(), &["--config", config.to_str().unwrap()], false);
    // A root connection and a connection of nobody's, both open (each has its thread); nobody's
    // is the idle attacker of `topoctl bench daemon --hostile`, holding one connection.
    let mut root = Client::connect(&d.socket).unwrap();
    root.call(Op::List).unwrap();
    // Root on the public socket too (as an administrator who is not root must come): its
    // thread goes back up from the public listener's nice 10.
    let public = raw(&d.socket, br#"{"v":1,"op":"list"}"#);
    assert!(public.get("ok").is_some(), "{public}");
    let mut held_public = std::os::unix::net::UnixStream::connect(&d.socket).unwrap();
    held_public.write_all(b"{\"v\":1,\"op\":\"list\"}\n").unwrap();
    let mut reply = String::new();
    BufReader::new(held_public.try_clone().unwrap()).read_line(&mut reply).unwrap();
    assert!(reply.contains("\"ok\""), "{reply}");
    let stats_dir = dir.path().join("stats");
    std::fs::create_dir(&stats_dir).unwrap();
    std::fs::set_permissions(&stats_dir, std::os::unix::fs::PermissionsExt::from_mode(0o777))
        .unwrap();
    let stats = stats_dir.join("ops");
    // Killed when the test ends, pass or fail (it would hold cargo's output pipe open).
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _nobody = Killed(
        Command::new(env!("CARGO_BIN_EXE_topoctl"))
            .args(["bench", "attack", "--mode", "idle", "--count", "1", "--socket"])
            .arg(&d.socket)
            .arg("--stats")
            .arg(&stats)
            .uid(65534)
            .gid(65534)
            .spawn()
            .unwrap(),
    );
    let waited = Instant::now();
    while std::fs::read_to_string(&stats).map_or(true, |s| s.trim() != "1") {
        // A bound for a hang only, not a measure.
        assert!(waited.elapsed() < Duration::from_secs(120), "nobody's connection never opened");
        std::thread::sleep(Duration::from_millis(20));
    }
    root.call(Op::List).unwrap();
    let topod = d.child.id();
    // Every thread's CPUs and nice value, once nobody's connection thread (which lowers itself
    // as it starts) is seen at nice 10.
    let threads = || {
        let tasks = std::fs::read_dir(format!("/proc/{topod}/task")).unwrap().flatten();
        tasks
            .map(|task| {
                let status =
                    std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
                let cpus = status
                    .lines()
                    .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                    .map(|c| c.trim().to_string());
                let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
                (task.file_name().to_string_lossy().to_string(), cpus, stat_field(&stat, 19))
            })
            .collect::<Vec<_>>()
    };
    let mut seen = threads();
    while seen.iter().filter(|t| t.2.as_deref() == Some("10")).count() < 2 {
        assert!(waited.elapsed() < Duration::from_secs(120), "no thread at nice 10: {seen:?}");
        std::thread::sleep(Duration::from_millis(20));
        seen = threads();
    }
    let (mut at_minus_10, mut at_10, mut others) = (0, 0, Vec::new());
    for (tid, cpus, nice) in &seen {
        assert_eq!(cpus.as_deref(), Some("0"), "thread {tid} of topod runs on {cpus:?}");
        match nice.as_deref() {
            Some("-10") => at_minus_10 += 1,
            Some("10") => at_10 += 1,
            other => others.push(format!("{tid}: {other:?}")),
        }
    }
    assert!(others.is_empty(), "threads at another nice value: {others:?}");
    // The main thread, the administrators' listener, root's two connections; the public
    // listener and nobody's connection.
    assert!(at_minus_10 >= 4, "{at_minus_10} threads at nice -10");
    assert_eq!(at_10, 2, "the public listener and nobody's connection at nice 10");
    let log = std::fs::read_to_string(dir.path().join("topod.log")).unwrap();
    assert!(log.contains("topod's threads run on the reserved CPUs 0"), "{log}");
}

/// `reserved_cpus` narrows the CPUs topod was started on (a `taskset`, the unit's
/// `CPUAffinity=`) and never widens them; reserved CPUs outside them leave topod where it was
/// put, saying so (it replaced an administrator's taskset before).
#[test]
fn reserved_cpus_keep_within_the_affinity_topod_was_started_with() {
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap_or_default();
    if online.trim() == "0" {
        return common::skip("one CPU: no affinity to narrow");
    }
    if Command::new("taskset").arg("--version").output().is_err() {
        return common::skip("no taskset here");
    }
    for (reserved, want, said) in [
        ("0-1", "1", "within those it was started on (1)"),
        ("0", "1", "lie outside the CPUs topod was started on (1"),
    ] {
        let dir = common::open_dir();
        let socket = dir.path().join("topod.sock");
        let config = common::config(
            dir.path(),
            &format!("cgroup = \"fake\"\nreserved_cpus = \"{reserved}\"\n"),
        );
        let log = std::fs::File::create(dir.path().join("topod.log")).unwrap();
        let child = Command::new("taskset")
            .args(["-c", "1", env!("CARGO_BIN_EXE_topod"), "--config"])
            .arg(&config)
            .arg("--socket")
            .arg(&socket)
            .arg("--state-dir")
            .arg(dir.path())
            // A machine of its own: the fake backend takes this one's CPUs from topod's affinity.
            .arg("--topology")
            .arg(common::topologies().join("converted-hwloc2.9/AMD-19h-Zen4-2xEpyc-9654.xml"))
            .stderr(std::process::Stdio::from(log))
            .spawn()
            .unwrap();
        let d = common::Daemon { child, socket };
        let started = Instant::now();
        while std::os::unix::net::UnixStream::connect(&d.socket).is_err() {
            assert!(started.elapsed() < Duration::from_secs(20), "topod did not open its socket");
            std::thread::sleep(Duration::from_millis(20));
        }
        let status = std::fs::read_to_string(format!("/proc/{}/status", d.child.id())).unwrap();
        let cpus = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap();
        assert_eq!(cpus.trim(), want, "reserved_cpus {reserved} under taskset -c 1");
        let text = std::fs::read_to_string(dir.path().join("topod.log")).unwrap();
        assert!(text.contains(said), "{text}");
    }
}

/// A command topo-exec cannot run is refused before anything is allocated for it (an attack
/// finding: the allocation stayed, holding its CPUs, until somebody released it).
#[test]
fn topo_exec_allocates_nothing_for_a_command_that_cannot_run() {
    if !common::is_root() {
        return common::skip("topo-exec allocates as root");
    }
    let dir = common::open_dir();
    let d = common::start(dir.path(), &["--cgroup", "fake"], true);
    for (command, says) in [
        ("no-such-command-anywhere", "no such command in PATH"),
        ("/nonexistent/job.sh", "No such file"),
        ("/tmp", "is a directory"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_topo-exec"))
            .args(["--socket", d.socket.to_str().unwrap(), "--job", "nocmd"])
            .args(["--request", "affinity[core]", "--", command])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{command}: {err}");
        let mut c = Client::connect(&d.socket).unwrap();
        assert_eq!(c.call(Op::List).unwrap(), serde_json::json!([]), "{command}: {err}");
    }
}
