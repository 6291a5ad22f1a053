//! Releases queued while topod could not be reached (`<socket dir>/release-pending/<job>`, as a
//! batch system's epilog leaves them with `topo_client::queue_release`): a real topod does them
//! as it starts, and on its 5 s tick while it runs; it acts only on
//! regular files of root's (or its own user's) that no one else can write, and follows no link.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use topo_client::Client;
use topo_core::pending::{pending_dir_for, QueuedRelease};
use topo_core::proto::Op;

fn jobs(socket: &Path) -> Vec<String> {
    let mut c = Client::connect(socket).unwrap();
    c.list().unwrap().into_iter().map(|j| j.allocation.job).collect()
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn log(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("topod.log")).unwrap_or_default()
}

/// Writes a well-formed request as `dir/name` with `mode`, not through `queue_release` (which
/// would refuse to make what these tests plant).
fn plant(dir: &Path, name: &str, mode: u32) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, QueuedRelease::new(std::time::SystemTime::now(), "a planter").to_bytes())
        .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path
}

#[test]
fn a_running_topod_does_what_root_queued_and_refuses_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let d = common::start(dir.path(), &["--cgroup", "fake"], true);
    let mut c = Client::connect(&d.socket).unwrap();
    for job in ["slurm-1", "slurm-2", "slurm-3", "slurm-4", "slurm-5"] {
        c.allocate(Op::allocate(job, "affinity[core(2)]")).unwrap();
    }
    // As the epilog does when topod does not answer in time; and one for a job topod never had.
    let queued = topo_client::queue_release(&d.socket, "slurm-1", "the test's epilog").unwrap();
    topo_client::queue_release(&d.socket, "slurm-99", "the test's epilog").unwrap();
    let pending = pending_dir_for(&d.socket);
    assert_eq!(queued, pending.join("slurm-1"));
    // What topod must not act on: a link (to a well-formed request), a file others may write,
    // a file of another user (root can make one), a name that is not a job id.
    let elsewhere = plant(dir.path(), "elsewhere", 0o600);
    std::os::unix::fs::symlink(&elsewhere, pending.join("slurm-2")).unwrap();
    plant(&pending, "slurm-3", 0o666);
    if common::is_root() {
        let theirs = plant(&pending, "slurm-4", 0o600);
        nix::unistd::chown(&theirs, Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();
    } else {
        common::skip("a request owned by another user needs root to make");
    }
    plant(&pending, "a b", 0o600);
    let start = Instant::now();
    while !names(&pending).is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "topod's tick did not take the queue: {:?}\n{}",
            names(&pending),
            log(dir.path())
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(jobs(&d.socket), ["slurm-2", "slurm-3", "slurm-4", "slurm-5"]);
    assert!(elsewhere.exists(), "a link is removed, never what it names");
    let said = log(dir.path());
    assert!(said.contains("released slurm-1, which ended while topod was unreachable; asked by the test's epilog at "), "{said}");
    assert!(said.contains("queued release of slurm-99 done: topod holds nothing for it"), "{said}");
    assert!(said.contains("slurm-2: refused (it is a symbolic link"), "{said}");
    assert!(
        said.contains("slurm-3: refused (it is writable by its group or others (mode 666))"),
        "{said}"
    );
    if common::is_root() {
        assert!(said.contains("slurm-4: refused (it is owned by uid 65534"), "{said}");
    }
    assert!(said.contains("a b: refused (it is not a job id"), "{said}");

    // A directory others could write: nothing in it is done or removed, and topod says so once.
    std::fs::set_permissions(&pending, std::fs::Permissions::from_mode(0o777)).unwrap();
    plant(&pending, "slurm-5", 0o600);
    std::thread::sleep(Duration::from_secs(11));
    assert_eq!(names(&pending), ["slurm-5"]);
    assert!(jobs(&d.socket).contains(&"slurm-5".to_string()));
    let said = log(dir.path());
    assert_eq!(said.matches("queued releases there are not done").count(), 1, "{said}");
}

/// topod on this host's real cgroups, with its configuration file, as `common::real_daemon`
/// starts it.
fn restart(dir: &Path, config: &Path) -> common::Daemon {
    common::start(dir, &["--config", config.to_str().unwrap()], false)
}

#[test]
fn a_job_that_ended_while_topod_was_down_is_released_when_it_starts() {
    let dir = tempfile::tempdir().unwrap();
    let Some((mut d, cgroups, subtree, _cleanup, config)) =
        common::real_daemon(dir.path(), "topo-pending-test", "")
    else {
        return;
    };
    // A job with a process left in it (what the epilog's release would have killed).
    let mut left: Child = Command::new("sleep").arg("300").spawn().unwrap();
    let mut c = Client::connect(&d.socket).unwrap();
    c.allocate(Op::allocate("slurm-42", "affinity[thread]").joining(left.id() as i32)).unwrap();
    let job_dir = cgroups.roots(&subtree)[0].join("slurm-42");
    assert!(job_dir.is_dir());
    // topod goes away (killed: nothing of its own is cleaned up), the job ends meanwhile, and
    // the epilog cannot reach it.
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    let e = Client::connect(&d.socket).and_then(|mut c| c.release("slurm-42")).unwrap_err();
    assert!(e.is_unreachable(), "{e}");
    let queued = topo_client::queue_release(&d.socket, "slurm-42", "the test's epilog").unwrap();
    assert!(queued.exists() && job_dir.is_dir(), "nothing is done while topod is down");
    // Started again: the job is released and the request is gone. (That this is done as topod
    // starts, before the tick's first 5 s wait, is topod's unit test
    // `the_tick_does_the_queued_releases_before_its_first_wait`: no clock here.)
    let d = restart(dir.path(), &config);
    let start = Instant::now();
    while !jobs(&d.socket).is_empty() || queued.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "not released after topod started\n{}",
            log(dir.path())
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(cgroups.roots(&subtree).iter().all(|root| !root.join("slurm-42").exists()));
    let start = Instant::now();
    while left.try_wait().unwrap().is_none() {
        assert!(start.elapsed() < Duration::from_secs(10), "the job's process was not killed");
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = log(dir.path());
    assert!(log.contains("released slurm-42, which ended while topod was unreachable; asked by the test's epilog at "), "{log}");
    assert!(log.contains("(1 process(es) left were killed)"), "{log}");
}
