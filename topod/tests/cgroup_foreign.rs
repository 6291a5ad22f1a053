//! An administrator's exclusive cpuset (v1) or cpuset partition (v2) beside topod's subtree:
//! topod's subtree leaves its CPUs out, and reports them as foreign so that no job gets them.
//! Real cgroups, as root (skipped visibly elsewhere; the v2 test needs a pure v2 host such as the
//! guest of tests/cgroup-v2-vm.sh). Its own test binary: an exclusive cpuset would collide with
//! the subtrees other tests make at the same level.

mod common;

use common::{config, open_dir, start};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use topo_client::Client;
use topo_core::proto::Op;
use topo_core::CpuSet;
use topod::cgroup::v1::V1;
use topod::cgroup::v2::{v2_mount, V2};
use topod::cgroup::CgroupBackend;

struct Remove(Vec<PathBuf>);

impl Drop for Remove {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_dir(p);
        }
    }
}

/// The v1 tests here each make an exclusive cpuset at the top of the cpuset hierarchy, which
/// the kernel refuses while a sibling overlaps it: one at a time.
static V1_TOP: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A private exclusive parent cpuset with every CPU and memory node of the hierarchy, so that an
/// exclusive cpuset can be made inside it whatever else the host holds. A sibling at the top
/// that overlaps it (some other test's leftovers) fails the test, naming it: skipping would hide
/// the v1 exclusive-cpuset path on exactly the hosts that have v1. Removed when dropped.
struct ExclusiveParent(PathBuf);

impl ExclusiveParent {
    fn make(mount: &Path, name: &str) -> ExclusiveParent {
        let parent = ExclusiveParent(mount.join(name));
        std::fs::create_dir(&parent.0).unwrap();
        std::fs::write(
            parent.0.join("cpuset.mems"),
            std::fs::read_to_string(mount.join("cpuset.mems")).unwrap().trim(),
        )
        .unwrap();
        std::fs::write(
            parent.0.join("cpuset.cpus"),
            std::fs::read_to_string(mount.join("cpuset.cpus")).unwrap().trim(),
        )
        .unwrap();
        if let Err(e) = std::fs::write(parent.0.join("cpuset.cpu_exclusive"), "1") {
            let siblings: Vec<String> = std::fs::read_dir(mount)
                .unwrap()
                .flatten()
                .filter(|e| e.path().is_dir())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            panic!("cannot make a private exclusive cpuset ({e}); cpusets beside it (a test's leftovers?): {siblings:?}");
        }
        parent
    }

    /// An administrator's exclusive cpuset of `cpu` inside.
    fn exclusive_child(&self, name: &str, cpu: u32) -> PathBuf {
        let admin = self.0.join(name);
        std::fs::create_dir(&admin).unwrap();
        std::fs::write(
            admin.join("cpuset.mems"),
            std::fs::read_to_string(self.0.join("cpuset.mems")).unwrap().trim(),
        )
        .unwrap();
        std::fs::write(admin.join("cpuset.cpus"), cpu.to_string()).unwrap();
        std::fs::write(admin.join("cpuset.cpu_exclusive"), "1").unwrap();
        admin
    }
}

impl Drop for ExclusiveParent {
    fn drop(&mut self) {
        // remove_cgroup_tree removes what is nested, deepest first.
        common::remove_cgroup_tree(&self.0);
        for hierarchy in ["freezer", "memory", "cpu"] {
            let p = Path::new("/sys/fs/cgroup").join(hierarchy).join(self.0.file_name().unwrap());
            common::remove_cgroup_tree(&p);
        }
    }
}

/// The v1 cpuset mount and its CPUs, or why the v1 tests cannot run here.
fn v1_cpuset() -> Option<(PathBuf, CpuSet)> {
    let Ok(common::RealCgroups::V1 { cpuset, .. }) = common::RealCgroups::detect() else {
        common::skip("needs root and a cgroup v1 cpuset hierarchy");
        return None;
    };
    let all =
        CpuSet::parse_list(&std::fs::read_to_string(cpuset.join("cpuset.cpus")).unwrap()).unwrap();
    if all.len() < 2 {
        common::skip("needs two CPUs");
        return None;
    }
    Some((cpuset, all))
}

#[test]
fn an_exclusive_cpuset_beside_ours_is_foreign() {
    let Some((mount, all)) = v1_cpuset() else { return };
    let _one_at_a_time = V1_TOP.lock().unwrap_or_else(|e| e.into_inner());
    let last = all.last().unwrap();
    let parent = ExclusiveParent::make(&mount, &format!("topo-fx-{}-backend", std::process::id()));
    parent.exclusive_child("admin", last);
    let ours = parent.0.join("topo");
    let v1 = V1::new(ours.clone(), None, None).unwrap();
    assert_eq!(v1.foreign_cpus().unwrap().to_string(), last.to_string());
    let ours_cpus =
        CpuSet::parse_list(&std::fs::read_to_string(ours.join("cpuset.cpus")).unwrap()).unwrap();
    assert!(!ours_cpus.contains(last), "our subtree leaves the exclusive CPU out: {ours_cpus}");
    assert_eq!(ours_cpus, all.difference(&std::iter::once(last).collect()));
}

#[test]
fn a_partition_beside_ours_is_foreign() {
    if !nix::unistd::geteuid().is_root() {
        return common::skip("needs root");
    }
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    let Some(mount) = v2_mount(&mounts) else {
        return common::skip("no cgroup v2 hierarchy");
    };
    if !std::fs::read_to_string(mount.join("cgroup.controllers"))
        .unwrap_or_default()
        .split_whitespace()
        .any(|c| c == "cpuset")
    {
        assert!(
            std::env::var_os("TOPO_REQUIRE_REAL_CGROUPS").is_none(),
            "TOPO_REQUIRE_REAL_CGROUPS is set, but the v2 hierarchy has no cpuset controller"
        );
        return common::skip(
            "the cgroup v2 hierarchy has no cpuset controller here (a hybrid host)",
        );
    }
    let all =
        CpuSet::parse_list(&std::fs::read_to_string(mount.join("cpuset.cpus.effective")).unwrap())
            .unwrap();
    if all.len() < 2 {
        return common::skip("needs two CPUs");
    }
    let last = all.last().unwrap();
    let admin = mount.join(format!("admin-partition-{}", std::process::id()));
    let ours = mount.join(format!("topo-foreign-test-{}", std::process::id()));
    let _cleanup = Remove(vec![ours.clone(), admin.clone()]);
    std::fs::write(mount.join("cgroup.subtree_control"), "+cpuset").unwrap();
    std::fs::create_dir(&admin).unwrap();
    std::fs::write(admin.join("cpuset.cpus"), last.to_string()).unwrap();
    std::fs::write(admin.join("cpuset.cpus.partition"), "root").unwrap();
    let state = std::fs::read_to_string(admin.join("cpuset.cpus.partition")).unwrap();
    if state.trim() != "root" {
        assert!(
            std::env::var_os("TOPO_REQUIRE_REAL_CGROUPS").is_none(),
            "the kernel did not make CPU {last} a valid partition: {}",
            state.trim()
        );
        return common::skip(&format!(
            "the kernel did not make CPU {last} a valid partition here: {}",
            state.trim()
        ));
    }
    let v2 = V2::new(ours.clone()).unwrap();
    assert_eq!(v2.foreign_cpus().unwrap().to_string(), last.to_string());
    let ours_cpus =
        CpuSet::parse_list(&std::fs::read_to_string(ours.join("cpuset.cpus.effective")).unwrap())
            .unwrap();
    assert_eq!(
        ours_cpus,
        all.difference(&std::iter::once(last).collect()),
        "our subtree leaves the partition's CPU out"
    );
}

/// topod (the daemon, on real v1 cgroups) beside an administrator's exclusive cpuset that comes
/// after topod started and then goes away: the allocate the kernel refuses leaves no directory,
/// and topod takes the CPU back once it is free (it used to stay narrowed for good, and every
/// allocate on that CPU failed with "Permission denied" and left an empty job directory).
#[test]
fn a_foreign_exclusive_cpuset_that_goes_away_gives_its_cpus_back() {
    let Some((mount, all)) = v1_cpuset() else { return };
    let _one_at_a_time = V1_TOP.lock().unwrap_or_else(|e| e.into_inner());
    let last = all.last().unwrap();
    let name = format!("topo-fx-{}-daemon", std::process::id());
    let parent = ExclusiveParent::make(&mount, &name);
    let dir = open_dir();
    let conf = config(dir.path(), &format!("cgroup = \"v1\"\ncgroup_subtree = \"{name}/topo\"\n"));
    let d = start(dir.path(), &["--config", conf.to_str().unwrap()], false);
    let mut c = Client::connect(&d.socket).unwrap();
    let everything = format!("affinity[thread*{}]", all.len());
    let alloc = |c: &mut Client| c.call(Op::allocate("wide", everything.clone()));
    let job_dirs = || -> Vec<std::ffi::OsString> {
        std::fs::read_dir(parent.0.join("topo"))
            .unwrap()
            .flatten()
            .filter(|e| e.path().is_dir())
            .map(|e| e.file_name())
            .collect()
    };
    // After topod started, an administrator narrows topod's subtree and makes an exclusive
    // cpuset of the last CPU: topod's model still counts it until it looks again.
    let rest = all.difference(&std::iter::once(last).collect());
    std::fs::write(parent.0.join("topo/cpuset.cpus"), rest.to_string()).unwrap();
    let admin = parent.exclusive_child("admin", last);
    // The kernel refuses the job's cpuset (or topod has looked already and it does not fit):
    // either way the job is refused and leaves no directory behind.
    let e = alloc(&mut c).unwrap_err().to_string();
    assert!(e.contains("does not fit"), "CPU {last} is the administrator's now: {e}");
    assert!(job_dirs().is_empty(), "a refused allocate leaves no job directory: {:?}", job_dirs());
    let small = c.call(Op::allocate("small", "affinity[thread*1]")).unwrap();
    assert_ne!(small["cpus"], last.to_string());
    c.call(Op::Release { job: "small".into() }).unwrap();
    std::fs::remove_dir(&admin).unwrap();
    // topod looks again on its own (every 5 s): it widens its subtree, and the job then gets
    // every CPU.
    let t = Instant::now();
    let a = loop {
        match alloc(&mut c) {
            Ok(a) => break a,
            Err(e) => assert!(
                t.elapsed() < Duration::from_secs(15),
                "topod never took CPU {last} back: {e}"
            ),
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    assert_eq!(a["cpus"], all.to_string());
    let subtree_cpus = std::fs::read_to_string(parent.0.join("topo/cpuset.cpus")).unwrap();
    assert_eq!(subtree_cpus.trim(), all.to_string(), "the subtree was widened");
    c.call(Op::Release { job: "wide".into() }).unwrap();
    assert!(job_dirs().is_empty(), "no job directories left behind: {:?}", job_dirs());
    drop(d);
}
