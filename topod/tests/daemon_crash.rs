//! topod survives SIGKILL at any point: concurrent clients run allocate / join / release cycles
//! with real processes in real cgroups while another thread kills topod and starts it again.
//! Checked: every job keeps exactly its CPUs across restarts, no CPU is ever held by two running
//! jobs, and once every job is released no cgroup and no job process is left. Every other cycle
//! also suspends its job, lends its CPU to a second job, and resumes it once that one is gone:
//! a suspended job stays suspended (and frozen in the kernel) across restarts, and never runs
//! beside the job borrowing its CPU. Every fourth cycle places a malleable job instead
//! (`*1-2`, with equipartition on, so arrivals and departures resize it) and resizes it: its
//! processes run on exactly the CPUs topod says, whatever the kills cut short (a plan of moves
//! is finished by the restart). Every eighth cycle also reserves a block, finds it kept across
//! restarts, and drops it.
//! Needs root and a cpuset controller: v1 on the CI machine class, v2 on a pure v2 host
//! (tests/cgroup-v2-vm.sh); skipped visibly elsewhere. `TOPO_CRASH_CYCLES` and
//! `TOPO_CRASH_KILLS` scale it (defaults 1000 and 100), and `TOPO_CRASH_SPREAD_MS` (default 40)
//! widens the random time between kills.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use topo_client::{Client, ClientError};
use topo_core::proto::{ErrorCode, Op};
use topo_core::CpuSet;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn spawn_topod(socket: &Path, dir: &Path, config: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_topod"))
        .args([
            "--socket",
            socket.to_str().unwrap(),
            "--state-dir",
            dir.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
        ])
        .stderr(if std::env::var_os("TOPO_CRASH_LOG").is_some() {
            Stdio::inherit()
        } else {
            Stdio::null()
        })
        .spawn()
        .expect("topod starts")
}

/// One call, retried across topod restarts (connection refused, reset, or cut mid-reply).
fn call(socket: &Path, op: Op) -> Result<serde_json::Value, topo_core::proto::ErrorBody> {
    let start = Instant::now();
    loop {
        let result = Client::connect(socket).and_then(|mut c| c.call(op.clone()));
        match result {
            Ok(v) => return Ok(v),
            Err(ClientError::Refused(body)) => return Err(body),
            Err(_) if start.elapsed() < Duration::from_secs(60) => {
                std::thread::sleep(Duration::from_millis(3))
            }
            Err(e) => panic!("topod unreachable for a minute: {e}"),
        }
    }
}

fn cpus_allowed(pid: u32) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).map(|s| s.trim().to_string())
}

/// No CPU is held by two running jobs (a suspended job's CPUs may be lent).
fn check_no_cpu_twice(list: &serde_json::Value, failures: &Mutex<Vec<String>>) {
    let mut held = CpuSet::new();
    for job in list.as_array().into_iter().flatten() {
        // A suspended job holds none of its CPUs, also while it is being released.
        if job["state"] == "suspended" || job.get("lent_to").is_some() {
            continue;
        }
        let cpus = CpuSet::parse_list(job["cpus"].as_str().unwrap_or("")).unwrap_or_default();
        if cpus.intersects(&held) {
            let jobs: Vec<String> = list
                .as_array()
                .into_iter()
                .flatten()
                .map(|j| format!("{} {} {}", j["job"], j["state"], j["cpus"]))
                .collect();
            failures.lock().unwrap().push(format!(
                "CPUs {} held twice (job {}) in [{}]",
                cpus.intersection(&held),
                job["job"],
                jobs.join(", ")
            ));
        }
        held.union_with(&cpus);
    }
}

/// A retried call whose first reply a kill cut short: `already` (a message part) means done.
fn call_once_done(socket: &Path, op: Op, already: &str) -> Result<(), topo_core::proto::ErrorBody> {
    match call(socket, op) {
        Err(e) if e.code == ErrorCode::BadRequest && e.message.contains(already) => Ok(()),
        other => other.map(|_| ()),
    }
}

/// Suspends `job`, places a borrower that may take its CPU, checks that `job` cannot resume
/// while the borrower runs there, releases the borrower and resumes `job` on its own CPUs.
fn suspend_lend_resume(
    socket: &Path,
    job: &str,
    cpus: &str,
    roots: &[std::path::PathBuf],
    failures: &Mutex<Vec<String>>,
) {
    let fail = |what: String| failures.lock().unwrap().push(format!("{job}: {what}"));
    if let Err(e) = call_once_done(socket, Op::Suspend { job: job.into() }, "is suspended") {
        return fail(format!("suspend: {}", e.message));
    }
    // Only this worker resumes its job, and a restart thaws nothing: it is frozen in the kernel.
    let frozen = roots.iter().any(|root| {
        let dir = root.join(job);
        std::fs::read_to_string(dir.join("freezer.state")).is_ok_and(|s| s.trim() == "FROZEN")
            || std::fs::read_to_string(dir.join("cgroup.freeze")).is_ok_and(|s| s.trim() == "1")
    });
    if !frozen {
        fail("suspended but not frozen in the kernel".into());
    }
    let borrower = format!("{job}-b");
    let lent = match call(socket, Op::allocate(&borrower, "affinity[thread*1]")) {
        Ok(b) => b["cpus"].as_str() == Some(cpus),
        Err(e) if e.code == ErrorCode::DoesNotFit => false,
        Err(e) => {
            fail(format!("borrower allocate: {}", e.message));
            false
        }
    };
    if let Ok(list) = call(socket, Op::List) {
        check_no_cpu_twice(&list, failures);
    }
    if lent {
        match call(socket, Op::Resume { job: job.into() }) {
            Err(e) if e.code == ErrorCode::DoesNotFit && e.message.contains("lent to job") => {}
            other => fail(format!("resumed onto its borrower's CPU: {other:?}")),
        }
    }
    match call(socket, Op::Release { job: borrower.clone() }) {
        Ok(_) => {}
        Err(e) if e.code == ErrorCode::UnknownJob => {}
        Err(e) => fail(format!("borrower release: {}", e.message)),
    }
    // Other workers' jobs may borrow its CPU too: it resumes once none runs there.
    let start = Instant::now();
    loop {
        match call_once_done(socket, Op::Resume { job: job.into() }, "is running") {
            Ok(()) => break,
            Err(e)
                if e.code == ErrorCode::DoesNotFit
                    && e.message.contains("lent to job")
                    && start.elapsed() < Duration::from_secs(30) =>
            {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return fail(format!("resume: {}", e.message)),
        }
    }
    match call(socket, Op::List) {
        Ok(list) => {
            let mine = list.as_array().and_then(|a| a.iter().find(|j| j["job"] == job).cloned());
            match mine {
                Some(j) if j["cpus"] == cpus && j["state"] == "running" => {}
                other => fail(format!("after resume: {other:?}, had {cpus}")),
            }
        }
        Err(e) => fail(format!("list: {}", e.message)),
    }
}

/// The CPUs topod lists for `job` now, if it holds any.
fn listed_cpus(socket: &Path, job: &str) -> Option<String> {
    let list = call(socket, Op::List).ok()?;
    let mine = list.as_array()?.iter().find(|j| j["job"] == job)?.clone();
    mine["cpus"].as_str().map(str::to_string)
}

/// A malleable job's process runs on exactly its cgroup's CPUs, and topod lists those, before
/// and after an explicit resize to one task. Equipartition resizes it too, at other cycles'
/// arrivals and departures, and the list topod answers is published once such a change is
/// whole (after the kernel has it): so the three are read until they agree, and only a
/// disagreement that lasts a second is a failure.
fn resize_and_check(
    socket: &Path,
    job: &str,
    pid: u32,
    cpuset_root: &Path,
    failures: &Mutex<Vec<String>>,
) {
    let fail = |what: String| failures.lock().unwrap().push(format!("{job}: {what}"));
    let cgroup = cpuset_root.join(job).join("cpuset.cpus");
    let agree = || {
        let start = Instant::now();
        loop {
            let before = std::fs::read_to_string(&cgroup).ok().map(|s| s.trim().to_string());
            let seen = cpus_allowed(pid);
            let after = std::fs::read_to_string(&cgroup).ok().map(|s| s.trim().to_string());
            let listed = listed_cpus(socket, job);
            if before == after && seen == before && listed == before && before.is_some() {
                return Ok(());
            }
            if start.elapsed() > Duration::from_secs(1) {
                return Err(format!(
                    "cgroup {before:?}/{after:?}, process {seen:?}, topod lists {listed:?}"
                ));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    if let Err(e) = agree() {
        fail(format!("for a second: {e}"));
    }
    match call(socket, Op::Resize { job: job.into(), tasks: 1 }) {
        Ok(a) if a["tasks"].as_array().map(Vec::len) == Some(1) => {}
        Ok(a) => fail(format!("resized to one task, holds {a}")),
        Err(e) => fail(format!("resize: {}", e.message)),
    }
    if let Err(e) = agree() {
        fail(format!("after the resize, for a second: {e}"));
    }
}

/// Reserves a one-CPU block for a job that never comes, finds it in the free map (after any
/// number of restarts), and drops it.
fn reserve_and_drop(socket: &Path, job: &str, failures: &Mutex<Vec<String>>) {
    let fail = |what: String| failures.lock().unwrap().push(format!("{job}: {what}"));
    let args = topo_core::proto::ReserveArgs {
        job: job.into(),
        request: "affinity[thread*1]".into(),
        tasks: None,
        cpus: None,
        expires_in_s: 600,
    };
    match call(socket, Op::Reserve(args)) {
        Ok(_) => {}
        // Every CPU is in another worker's block: nothing to check.
        Err(e) if e.code == ErrorCode::DoesNotFit => return,
        Err(e) => return fail(format!("reserve: {}", e.message)),
    }
    std::thread::sleep(Duration::from_millis(3));
    match call(socket, Op::FreeMap) {
        Ok(free) => {
            let kept =
                free["reservations"].as_array().is_some_and(|r| r.iter().any(|r| r["job"] == job));
            if !kept {
                fail(format!("reservation lost: {}", free["reservations"]));
            }
        }
        Err(e) => fail(format!("free_map: {}", e.message)),
    }
    match call(socket, Op::Unreserve { job: job.into() }) {
        Ok(_) => {}
        // Its reply cut by a kill, retried: already dropped.
        Err(e) if e.code == ErrorCode::UnknownJob => {}
        Err(e) => fail(format!("unreserve: {}", e.message)),
    }
}

#[test]
fn sigkill_at_random_points() {
    let cgroups = match common::RealCgroups::detect() {
        Ok(c) => c,
        Err(why) => return common::skip(&format!("the crash test uses real cgroups: {why}")),
    };
    let cycles = env_or("TOPO_CRASH_CYCLES", 1000);
    let min_kills = env_or("TOPO_CRASH_KILLS", 100);
    // Kills land 5 to 5 + this many ms apart; an emulated guest, where every call is slower,
    // sets a wider spread so that calls still complete between kills.
    let kill_spread_ms = env_or("TOPO_CRASH_SPREAD_MS", 40).max(1) as u64;
    // As many clients as CPUs (at least 2, at most 8): each can always place a one-CPU job,
    // unless another holds on to one across a restart.
    let clients = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).clamp(2, 8);
    let dir = tempfile::tempdir().unwrap();
    let subtree = format!("topo-crash-test-{}", std::process::id());
    let roots = cgroups.roots(&subtree);
    let config = dir.path().join("topod.toml");
    std::fs::write(
        &config,
        format!(
            "cgroup = \"{}\"\ncgroup_subtree = \"{subtree}\"\nequipartition = true\n",
            cgroups.kind()
        ),
    )
    .unwrap();
    let socket = dir.path().join("topod.sock");
    let daemon = Arc::new(Mutex::new(spawn_topod(&socket, dir.path(), &config)));
    let done = Arc::new(AtomicBool::new(false));
    let kills = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let next_cycle = Arc::new(AtomicUsize::new(0));
    let completed = Arc::new(AtomicUsize::new(0));
    let allocated = Arc::new(AtomicUsize::new(0));

    // The killer: SIGKILL topod at random moments and start it again.
    let killer = {
        let (daemon, done, kills, socket, dir, config) = (
            daemon.clone(),
            done.clone(),
            kills.clone(),
            socket.clone(),
            dir.path().to_path_buf(),
            config.clone(),
        );
        std::thread::spawn(move || {
            let mut rng = 0x2545_F491_4F6C_DD1Du64;
            while !done.load(Ordering::SeqCst) {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                // Half the kills count their delay from topod's start (so some land in its
                // start-up and ledger rebuild), half from when it answers: on a slow host (an
                // emulated guest) topod then still gets work done between kills.
                if rng & 1 == 0 {
                    let started = Instant::now();
                    while Client::connect(&socket).is_err()
                        && started.elapsed() < Duration::from_secs(30)
                    {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                }
                std::thread::sleep(Duration::from_millis(5 + (rng >> 1) % kill_spread_ms));
                let mut d = daemon.lock().unwrap();
                let _ = d.kill();
                let _ = d.wait();
                kills.fetch_add(1, Ordering::SeqCst);
                *d = spawn_topod(&socket, &dir, &config);
            }
        })
    };

    let workers: Vec<_> = (0..clients)
        .map(|w| {
            let roots = roots.clone();
            let (socket, failures, next_cycle, completed, kills, allocated) = (
                socket.clone(),
                failures.clone(),
                next_cycle.clone(),
                completed.clone(),
                kills.clone(),
                allocated.clone(),
            );
            std::thread::spawn(move || loop {
                let i = next_cycle.fetch_add(1, Ordering::SeqCst);
                // Until enough cycles placed a job and enough kills happened.
                if allocated.load(Ordering::SeqCst) >= cycles
                    && kills.load(Ordering::SeqCst) >= min_kills
                {
                    return;
                }
                let job = format!("w{w}-{i}");
                let malleable = i % 4 == 2;
                if i % 8 == 0 {
                    reserve_and_drop(&socket, &format!("{job}-r"), &failures);
                }
                let request = if malleable { "affinity[thread*1-2]" } else { "affinity[thread*1]" };
                let alloc = match call(&socket, Op::allocate(&job, request)) {
                    Ok(a) => a,
                    Err(e) if e.code == ErrorCode::DoesNotFit => {
                        completed.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(2));
                        continue;
                    }
                    Err(e) => {
                        failures.lock().unwrap().push(format!("{job}: allocate: {}", e.message));
                        continue;
                    }
                };
                allocated.fetch_add(1, Ordering::SeqCst);
                let cpus = alloc["cpus"].as_str().unwrap_or("").to_string();
                let mut child = Command::new("sleep").arg("30").spawn().unwrap();
                if let Err(e) = call(&socket, Op::Join { job: job.clone(), pid: child.id() as i32 })
                {
                    failures
                        .lock()
                        .unwrap()
                        .push(format!("{job}: join after allocate: {} (a lost job?)", e.message));
                }
                if malleable {
                    resize_and_check(&socket, &job, child.id(), &roots[0], &failures);
                    match call(&socket, Op::Release { job: job.clone() }) {
                        Ok(_) => {}
                        Err(e) if e.code == ErrorCode::UnknownJob => {}
                        Err(e) => {
                            failures.lock().unwrap().push(format!("{job}: release: {}", e.message))
                        }
                    }
                    let _ = child.wait();
                    completed.fetch_add(1, Ordering::SeqCst);
                    continue;
                }
                if cpus_allowed(child.id()).as_deref() != Some(cpus.as_str()) {
                    failures.lock().unwrap().push(format!(
                        "{job}: process runs on {:?}, topod gave {cpus}",
                        cpus_allowed(child.id())
                    ));
                }
                std::thread::sleep(Duration::from_millis(2));
                // After any number of restarts the job still holds exactly its CPUs.
                if let Ok(list) = call(&socket, Op::List) {
                    check_no_cpu_twice(&list, &failures);
                    let mine = list
                        .as_array()
                        .and_then(|a| a.iter().find(|j| j["job"] == job.as_str()).cloned());
                    match mine {
                        Some(j) if j["cpus"] == cpus.as_str() => {}
                        other => failures
                            .lock()
                            .unwrap()
                            .push(format!("{job}: lost or moved: {other:?}, had {cpus}")),
                    }
                }
                if i % 2 == 1 {
                    suspend_lend_resume(&socket, &job, &cpus, &roots, &failures);
                }
                match call(&socket, Op::Release { job: job.clone() }) {
                    Ok(_) => {}
                    // A release whose reply was cut by a kill, retried: already done.
                    Err(e) if e.code == ErrorCode::UnknownJob => {}
                    Err(e) => {
                        failures.lock().unwrap().push(format!("{job}: release: {}", e.message))
                    }
                }
                let _ = child.wait();
                completed.fetch_add(1, Ordering::SeqCst);
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    done.store(true, Ordering::SeqCst);
    killer.join().unwrap();

    // The end state: nothing held, no job cgroup, no job process.
    let list = call(&socket, Op::List).unwrap();
    let left: Vec<String> = std::fs::read_dir(&roots[0])
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    {
        let mut d = daemon.lock().unwrap();
        let _ = d.kill();
        let _ = d.wait();
    }
    for root in &roots {
        let _ = std::fs::remove_dir(root);
    }
    let failures = failures.lock().unwrap();
    let kills = kills.load(Ordering::SeqCst);
    let (completed, allocated) =
        (completed.load(Ordering::SeqCst), allocated.load(Ordering::SeqCst));
    eprintln!("crash test on cgroup {}: {completed} cycles ({allocated} with a job placed, the rest found the host full), {kills} SIGKILLs, {} failures", cgroups.kind(), failures.len());
    assert!(allocated >= cycles, "only {allocated} cycles placed a job");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(kills >= min_kills, "only {kills} kills");
    assert_eq!(list, serde_json::json!([]), "no job left in the ledger");
    assert!(left.is_empty(), "job cgroups left behind: {left:?}");
    let _ = common::topologies;
}
