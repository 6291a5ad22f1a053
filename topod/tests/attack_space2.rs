//! Hostile use, from outside topod, of what commits 6a4101f..8bbce12 added: lending a suspended
//! job's CPUs only to a job that fits nowhere else, resize ceilings (`tasks_cap`) for
//! equipartition, equipartition's shrinks for an arrival, `topoctl alloc --owner`, and prime-time
//! pools' `named` with the queue/pool name checks. Each topod runs on the fake backend and the
//! 64-PU `64amd64-4s2n4ca2co` machine (8 L3 groups of 8 PUs), so no cgroup is left behind.
//! Four of them found bugs (equipartition grew jobs onto suspended jobs' CPUs, a malleable arrival
//! resized the others twice, pool names no allocate can send passed the config check), fixed since.

mod common;

use common::{ask, error_of, ok, start};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn refused(socket: &Path, request: &str, says: &str) -> String {
    let reply = ask(socket, request);
    let (_, message) = error_of(&reply);
    assert!(message.contains(says), "{request}: {reply} should say {says:?}");
    message
}

fn machine() -> std::path::PathBuf {
    common::topologies().join("converted-hwloc2.9/64amd64-4s2n4ca2co.xml")
}

/// topod on the fake backend and the 64-PU machine, whoever runs the test an administrator.
fn start_with(dir: &Path, extra: &str) -> common::Daemon {
    let me = nix::unistd::geteuid().as_raw();
    let config = common::config(dir, &format!("admin_uids = [{me}]\n{extra}"));
    let machine = machine();
    start(
        dir,
        &[
            "--cgroup",
            "fake",
            "--topology",
            machine.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
        ],
        false,
    )
}

fn allocate(socket: &Path, job: &str, request: &str) -> Value {
    ok(socket, &format!(r#"{{"op":"allocate","job":"{job}","request":"{request}"}}"#))
}

fn list(socket: &Path) -> Vec<Value> {
    ok(socket, r#"{"op":"list"}"#).as_array().unwrap().clone()
}

fn job(socket: &Path, name: &str) -> Value {
    list(socket).into_iter().find(|j| j["job"] == name).unwrap_or_else(|| panic!("no job {name}"))
}

/// A CPU list such as "0-3,8" as CPU numbers.
fn cpu_ids(text: &str) -> Vec<u32> {
    let mut cpus = Vec::new();
    for part in text.split(',').filter(|p| !p.is_empty()) {
        let (first, last) = part.split_once('-').unwrap_or((part, part));
        cpus.extend(first.parse::<u32>().unwrap()..=last.parse::<u32>().unwrap());
    }
    cpus
}

fn cpus_of(socket: &Path, name: &str) -> Vec<u32> {
    cpu_ids(job(socket, name)["cpus"].as_str().unwrap())
}

fn overlap(a: &[u32], b: &[u32]) -> Vec<u32> {
    a.iter().filter(|c| b.contains(c)).copied().collect()
}

/// The generation of a job's notify file (one more at each resize).
fn generation(socket: &Path, name: &str) -> u64 {
    let text = std::fs::read_to_string(topo_core::proto::notify_file_for(socket, name)).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("generation="))
        .and_then(|g| g.parse().ok())
        .unwrap_or_else(|| panic!("no generation in {text:?}"))
}

// ---------------------------------------------------------------------------------------------
// 1. Lending only to a job that fits nowhere else.

/// Equipartition's rebalance after an allocate grows a malleable job onto the CPUs of a job
/// the user suspended although the malleable job fits (and was placed) beside them: the
/// suspended job then cannot resume until the malleable job ends. Lending is for a job that
/// fits nowhere else; a grow is not such a job.
#[test]

fn equipartition_does_not_grow_a_malleable_job_onto_a_suspended_jobs_cpus() {
    let dir = common::open_dir();
    let d = start_with(dir.path(), "equipartition = true\n");
    let s = &d.socket;
    allocate(s, "s", "affinity[core*4]");
    let suspended = cpus_of(s, "s");
    ok(s, r#"{"op":"suspend","job":"s"}"#);
    allocate(s, "m", "affinity[core*1-64]");
    let m = cpus_of(s, "m");
    assert_eq!(m.len(), 60, "m fits beside s on the 60 other CPUs: {m:?}");
    assert!(overlap(&m, &suspended).is_empty(), "m borrows s's CPUs {:?}", overlap(&m, &suspended));
    ok(s, r#"{"op":"resume","job":"s"}"#);
}

/// The same, when the suspend comes after the malleable job started: the next allocate or
/// release anywhere makes equipartition grow it onto the suspended job's CPUs.
#[test]

fn a_later_rebalance_does_not_take_a_suspended_jobs_cpus() {
    let dir = common::open_dir();
    let d = start_with(dir.path(), "equipartition = true\n");
    let s = &d.socket;
    allocate(s, "s", "affinity[core*8]");
    allocate(s, "m", "affinity[core*1-64]");
    assert_eq!(cpus_of(s, "m").len(), 56);
    ok(s, r#"{"op":"suspend","job":"s"}"#);
    let suspended = cpus_of(s, "s");
    // A short rigid job comes and goes beside them.
    allocate(s, "r", "affinity[core*1]");
    ok(s, r#"{"op":"release","job":"r"}"#);
    let m = cpus_of(s, "m");
    assert!(overlap(&m, &suspended).is_empty(), "m took s's CPUs {:?}", overlap(&m, &suspended));
    ok(s, r#"{"op":"resume","job":"s"}"#);
}

/// Held: a job given CPUs by the batch system (`cpus`) goes beside a suspended job inside
/// them while it can, borrows only when nothing else is left there, and the suspended job's
/// resume is refused naming the borrower until it ends.
#[test]
fn given_cpus_borrow_a_suspended_jobs_cpus_only_when_nothing_else_is_left() {
    let dir = common::open_dir();
    let d = start_with(dir.path(), "");
    let s = &d.socket;
    ok(s, r#"{"op":"allocate","job":"s","request":"affinity[core*4]","cpus":"0-3"}"#);
    ok(s, r#"{"op":"suspend","job":"s"}"#);
    let b = ok(s, r#"{"op":"allocate","job":"b","request":"affinity[core*4]","cpus":"0-7"}"#);
    assert_eq!(b["cpus"], "4-7", "{b}");
    let c = ok(s, r#"{"op":"allocate","job":"c","request":"affinity[core*2]","cpus":"0-7"}"#);
    assert!(cpu_ids(c["cpus"].as_str().unwrap()).iter().all(|c| *c < 4), "{c}");
    refused(s, r#"{"op":"resume","job":"s"}"#, "c");
    ok(s, r#"{"op":"release","job":"c"}"#);
    assert_eq!(ok(s, r#"{"op":"resume","job":"s"}"#)["cpus"], "0-3");
}

/// Held: an exclusive job (a whole L3 group to itself) does not fence a suspended job's
/// CPUs while another L3 group is free; when it must, the suspended job waits for it.
#[test]
fn an_exclusive_job_fences_a_suspended_jobs_cpus_only_when_it_must() {
    let dir = common::open_dir();
    let d = start_with(dir.path(), "");
    let s = &d.socket;
    ok(s, r#"{"op":"allocate","job":"s","request":"affinity[core*2]","cpus":"0-1"}"#);
    ok(s, r#"{"op":"suspend","job":"s"}"#);
    let x = r#"{"op":"allocate","job":"x","request":"affinity[core(2,exclusive=(l3,alljobs))*1]","cpus":"0-15"}"#;
    let got = cpu_ids(ok(s, x)["cpus"].as_str().unwrap());
    assert!(got.iter().all(|c| *c >= 8), "x goes to the free L3 group: {got:?}");
    ok(s, r#"{"op":"release","job":"x"}"#);
    // The other L3 group taken: x may only go beside s, fencing it.
    allocate(s, "fill", "affinity[core*8]");
    assert_eq!(cpus_of(s, "fill"), (8..16).collect::<Vec<_>>());
    let got = ok(s, x);
    assert!(cpu_ids(got["cpus"].as_str().unwrap()).iter().all(|c| *c < 8), "{got}");
    refused(s, r#"{"op":"resume","job":"s"}"#, "x");
    ok(s, r#"{"op":"release","job":"x"}"#);
    ok(s, r#"{"op":"resume","job":"s"}"#);
}

/// Held: a preemptor gets its victim's CPUs although a user-suspended job's CPUs are lendable
/// too, and the user-suspended job can resume while the preemptor runs.
#[test]
fn a_preemptor_gets_its_victims_cpus_beside_a_user_suspended_job() {
    let dir = common::open_dir();
    let d = start_with(dir.path(), "preempt = true\npreempt_min_run_s = 0\n");
    let s = &d.socket;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    // s (suspended by its user) on 0-1 of L3 0, a rigid job on the rest of L3 0, the victim v
    // on L3 1, rigid jobs everywhere else.
    ok(s, r#"{"op":"allocate","job":"s","request":"affinity[core*2]","cpus":"0-1"}"#);
    ok(s, r#"{"op":"allocate","job":"r0","request":"affinity[core*6]","cpus":"2-7"}"#);
    ok(
        s,
        &format!(
            r#"{{"op":"allocate","job":"v","request":"affinity[core*8]","cpus":"8-15","preemptible":true,"submitted_at":{},"estimate_s":100000}}"#,
            now - 10
        ),
    );
    ok(s, r#"{"op":"allocate","job":"rest","request":"affinity[core*48]","cpus":"16-63"}"#);
    ok(s, r#"{"op":"suspend","job":"s"}"#);
    let p = ok(
        s,
        &format!(
            r#"{{"op":"allocate","job":"p","request":"affinity[core*8]","preempt":true,"submitted_at":{},"estimate_s":3600}}"#,
            now - 86_400
        ),
    );
    assert_eq!(p["cpus"], "8-15", "{p}");
    assert_eq!(job(s, "v")["state"], "suspended");
    assert_eq!(ok(s, r#"{"op":"resume","job":"s"}"#)["cpus"], "0-1");
    ok(s, r#"{"op":"release","job":"p"}"#);
    assert_eq!(job(s, "v")["state"], "running", "v resumed once p ended");
}

// ---------------------------------------------------------------------------------------------
// 2. Resize ceilings.

/// Held: a resize to the size a job has, a resize out of range and one that does not fit
/// change nothing of its ceiling; a resize sets the ceiling list shows, which the job's
/// owner may lower but never lift.
#[test]
fn resize_ceilings_survive_failures_and_an_owner_only_lowers_them() {
    let dir = common::open_dir();
    let d = start_with(dir.path(), "equipartition = true\n");
    let s = &d.socket;
    ok(s, r#"{"op":"allocate","job":"m1","request":"affinity[core*1-64]","owner_uid":65534}"#);
    allocate(s, "m2", "affinity[core*1-64]");
    assert_eq!((cpus_of(s, "m1").len(), cpus_of(s, "m2").len()), (32, 32));
    assert!(job(s, "m1").get("tasks_cap").is_none_or(Value::is_null));
    ok(s, r#"{"op":"resize","job":"m1","tasks":32}"#);
    assert_eq!(job(s, "m1")["tasks_cap"], 32);
    refused(s, r#"{"op":"resize","job":"m1","tasks":65}"#, "outside that range");
    refused(s, r#"{"op":"resize","job":"m1","tasks":40}"#, "does not fit");
    assert_eq!(job(s, "m1")["tasks_cap"], 32, "failed resizes leave the ceiling");
    ok(s, r#"{"op":"resize","job":"m1","tasks":10}"#);
    // Arrivals and departures: m1 stays at 10, m2 takes the rest.
    allocate(s, "r", "affinity[core*2]");
    ok(s, r#"{"op":"release","job":"r"}"#);
    assert_eq!((cpus_of(s, "m1").len(), cpus_of(s, "m2").len()), (10, 54));
    if common::is_root() {
        use std::os::unix::process::CommandExt;
        let topoctl = |args: &[&str]| {
            Command::new(env!("CARGO_BIN_EXE_topoctl"))
                .args(args)
                .args(["--socket", s.to_str().unwrap()])
                .uid(65534)
                .gid(65534)
                .output()
                .unwrap()
        };
        let grow = topoctl(&["resize", "m1", "11"]);
        assert!(!grow.status.success(), "the owner grew its job");
        assert!(topoctl(&["resize", "m1", "8"]).status.success());
        assert_eq!(job(s, "m1")["tasks_cap"], 8);
        assert!(!topoctl(&["resize", "m2", "8"]).status.success(), "not m2's owner");
    }
    // A release with m1 alone: it stays at its ceiling.
    ok(s, r#"{"op":"release","job":"m2"}"#);
    assert!(cpus_of(s, "m1").len() <= 10);
}

// ---------------------------------------------------------------------------------------------
// 3. Equipartition's shrinks for an arrival.

/// Held: a rigid arrival resizes each malleable job once, straight to its share.
#[test]
fn a_rigid_arrival_resizes_each_malleable_job_once() {
    let dir = common::open_dir();
    let d = start_with(dir.path(), "equipartition = true\n");
    let s = &d.socket;
    allocate(s, "m1", "affinity[core*1-64]");
    allocate(s, "m2", "affinity[core*1-64]");
    let before = (generation(s, "m1"), generation(s, "m2"));
    allocate(s, "r", "affinity[core*8]");
    assert_eq!((cpus_of(s, "m1").len(), cpus_of(s, "m2").len()), (28, 28));
    assert_eq!((generation(s, "m1"), generation(s, "m2")), (before.0 + 1, before.1 + 1));
}

/// A malleable arrival: the running malleable jobs are first shrunk to their shares beside
/// the arrival's least size (1 task), then shrunk again by the rebalance that shares with the
/// arrival. m2 goes 32 -> 31 -> 21 (two resizes, two signals, two moves); on m2's own arrival
/// m1 went 64 -> 63 -> 32. Each should be resized once, to its share beside the arrival.
#[test]

fn a_malleable_arrival_resizes_each_malleable_job_once() {
    let dir = common::open_dir();
    let d = start_with(dir.path(), "equipartition = true\n");
    let s = &d.socket;
    allocate(s, "m1", "affinity[core*1-64]");
    let first = generation(s, "m1");
    allocate(s, "m2", "affinity[core*1-64]");
    let before = (generation(s, "m1"), generation(s, "m2"));
    allocate(s, "m3", "affinity[core*1-64]");
    let sizes = [cpus_of(s, "m1").len(), cpus_of(s, "m2").len(), cpus_of(s, "m3").len()];
    assert_eq!(sizes.iter().sum::<usize>(), 64);
    assert!(sizes.iter().all(|n| (21..=22).contains(n)), "{sizes:?}");
    assert_eq!(
        (generation(s, "m1"), generation(s, "m2")),
        (before.0 + 1, before.1 + 1),
        "each running malleable job resized once for m3"
    );
    assert_eq!(before.0, first + 1, "m1 resized once for m2");
}

/// A malleable arrival whose shape does not fit in what its share leaves (m's first 32 tasks keep
/// L3 groups half full): m was shrunk to its share, grown back, shrunk to it again, then to its
/// least, then shared out (five resizes). Now: its share, its least, shared out.
#[test]
fn a_malleable_arrival_whose_shape_misses_its_share_resizes_the_others_at_most_three_times() {
    let dir = common::open_dir();
    let d = start_with(dir.path(), "equipartition = true\n");
    let s = &d.socket;
    ok(s, r#"{"op":"allocate","job":"r","request":"affinity[core*4]","cpus":"0-3"}"#);
    allocate(s, "m", "affinity[core*1-64]");
    // m grows onto 0-3: its tasks are 4..63, then 0..3.
    ok(s, r#"{"op":"release","job":"r"}"#);
    let before = generation(s, "m");
    allocate(s, "a", "affinity[l3*4-5]");
    let resizes = generation(s, "m") - before;
    assert!(resizes <= 3, "m resized {resizes} times for one arrival");
    let (m, a) = (cpus_of(s, "m"), cpus_of(s, "a"));
    assert!(overlap(&m, &a).is_empty() && m.len() + a.len() <= 64, "{m:?} {a:?}");
}

// ---------------------------------------------------------------------------------------------
// 4. --owner, pools' `named`, and name checks.

/// Held: `--owner` takes a name or a uid and refuses an unknown name, naming it.
#[test]
fn topoctl_alloc_owner_takes_a_name_or_a_uid() {
    let dir = common::open_dir();
    let d = start_with(dir.path(), "");
    let s = d.socket.to_str().unwrap();
    let alloc = |job: &str, owner: &str| {
        Command::new(env!("CARGO_BIN_EXE_topoctl"))
            .args(["alloc", "--socket", s, "--job", job, "--owner", owner, "affinity[core]"])
            .output()
            .unwrap()
    };
    assert!(alloc("a", "nobody").status.success());
    assert!(alloc("b", "65534").status.success());
    let bad = alloc("c", "no-such-user-zz");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("no-such-user-zz"));
    assert_eq!(job(&d.socket, "a")["owner_uid"], 65534);
    assert_eq!(job(&d.socket, "b")["owner_uid"], 65534);
}

/// Held: a pool with queues admits a job that only names it only with `named = true`.
#[test]
fn a_pool_with_queues_admits_a_job_naming_it_only_when_named() {
    for (named, inside) in [(false, false), (true, true)] {
        let dir = common::open_dir();
        let d = start_with(
            dir.path(),
            &format!(
                "prime_pools = [{{ name = \"day\", cpus = \"0-7\", windows = [\"Mon-Sun 00:00-24:00\"], queues = [\"interactive\"], named = {named} }}]\n"
            ),
        );
        let s = &d.socket;
        ok(s, r#"{"op":"allocate","job":"fill","request":"affinity[core*56]","cpus":"8-63"}"#);
        let reply =
            ask(s, r#"{"op":"allocate","job":"j","request":"affinity[core*2]","pool":"day"}"#);
        assert_eq!(reply.get("ok").is_some(), inside, "named = {named}: {reply}");
        assert!(ask(
            s,
            r#"{"op":"allocate","job":"q","request":"affinity[core*2]","queue":"interactive"}"#
        )
        .get("ok")
        .is_some());
    }
}

/// Held: queue and pool names over 128 bytes or with control characters are refused at
/// allocate, naming the field; 128 bytes is accepted.
#[test]
fn queue_and_pool_names_are_checked_at_allocate() {
    let dir = common::open_dir();
    let d = start_with(dir.path(), "");
    let s = &d.socket;
    let long = "q".repeat(128);
    ok(s, &format!(r#"{{"op":"allocate","job":"a","request":"affinity[core]","queue":"{long}"}}"#));
    let longer = "q".repeat(129);
    refused(
        s,
        &format!(r#"{{"op":"allocate","job":"b","request":"affinity[core]","queue":"{longer}"}}"#),
        "queue is 129 bytes",
    );
    // Multi-byte: 43 three-byte characters are 129 bytes.
    let wide = "\u{2603}".repeat(43);
    refused(
        s,
        &format!(r#"{{"op":"allocate","job":"b","request":"affinity[core]","pool":"{wide}"}}"#),
        "pool is 129 bytes",
    );
    for bad in [r"a\u0000b", r"a\u001bb", r"a\u007fb", r"a\u0085b", r"a\nb"] {
        refused(
            s,
            &format!(r#"{{"op":"allocate","job":"b","request":"affinity[core]","queue":"{bad}"}}"#),
            "control character",
        );
    }
    refused(s, r#"{"op":"allocate","job":"b","request":"affinity[core]","queue":""}"#, "empty");
}

/// topod's configuration takes prime-time pools that no allocate can ever name or be admitted
/// by: a pool name of 200 bytes or with a control character (every allocate naming it is
/// refused by the name check), and queues that no allocate can send ("" or a control
/// character). Such a pool admits no one, which the same commit made a configuration error,
/// and inside its windows its CPUs go to nobody.
#[test]

fn a_pool_no_allocate_can_reach_is_a_configuration_error() {
    let long = "p".repeat(200);
    let pools = [
        format!(r#"{{ name = "{long}", cpus = "0-7", windows = ["Mon-Sun 00:00-24:00"] }}"#),
        r#"{ name = "d\ty", cpus = "0-7", windows = ["Mon-Sun 00:00-24:00"] }"#.to_string(),
        r#"{ name = "day", cpus = "0-7", windows = ["Mon-Sun 00:00-24:00"], queues = [""] }"#
            .to_string(),
        r#"{ name = "day", cpus = "0-7", windows = ["Mon-Sun 00:00-24:00"], queues = ["a\u0001"] }"#
            .to_string(),
    ];
    for pool in pools {
        let dir = tempfile::tempdir().unwrap();
        let config = common::config(dir.path(), &format!("prime_pools = [{pool}]\n"));
        let socket = dir.path().join("topod.sock");
        let mut child = Command::new(env!("CARGO_BIN_EXE_topod"))
            .args(["--cgroup", "fake", "--topology", machine().to_str().unwrap()])
            .args(["--socket", socket.to_str().unwrap()])
            .args(["--state-dir", dir.path().to_str().unwrap()])
            .args(["--config", config.to_str().unwrap()])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Refused or started, by what topod does rather than how soon: it exits, or it opens
        // its socket (which it does only once its configuration has been accepted). A minute
        // for either is a liveness wait.
        let started = std::time::Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if socket.exists() || started.elapsed() > std::time::Duration::from_secs(60) {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        assert!(status.is_some_and(|s| !s.success()), "topod started with prime_pools = [{pool}]");
    }
}
