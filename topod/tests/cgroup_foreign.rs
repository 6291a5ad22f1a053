//! An administrator's exclusive cpuset (v1) or cpuset partition (v2) beside topod's subtree:
//! topod's subtree leaves its CPUs out, and reports them as foreign so that no job gets them.
//! Real cgroups, as root (skipped visibly elsewhere; the v2 test needs a pure v2 host such as the
//! guest of tests/cgroup-v2-vm.sh). Its own test binary: an exclusive cpuset would collide with
//! the subtrees other tests make at the same level.

use std::path::PathBuf;
use topod::cgroup::v1::{v1_mounts, V1};
use topod::cgroup::v2::{v2_mount, V2};
use topod::cgroup::CgroupBackend;
use topod::CpuSet;

struct Remove(Vec<PathBuf>);

impl Drop for Remove {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_dir(p);
        }
    }
}

#[test]
fn an_exclusive_cpuset_beside_ours_is_foreign() {
    if !nix::unistd::geteuid().is_root() {
        return eprintln!("SKIPPED: needs root");
    }
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    let (Some(mount), _, _) = v1_mounts(&mounts) else {
        return eprintln!("SKIPPED: no cgroup v1 cpuset hierarchy");
    };
    let all = CpuSet::parse_list(&std::fs::read_to_string(mount.join("cpuset.cpus")).unwrap()).unwrap();
    if all.len() < 2 {
        return eprintln!("SKIPPED: needs two CPUs");
    }
    let last = all.last().unwrap();
    let admin = mount.join(format!("admin-exclusive-{}", std::process::id()));
    let ours = mount.join(format!("topo-foreign-test-{}", std::process::id()));
    let _cleanup = Remove(vec![ours.clone(), admin.clone()]);
    std::fs::create_dir(&admin).unwrap();
    std::fs::write(admin.join("cpuset.mems"), std::fs::read_to_string(mount.join("cpuset.mems")).unwrap().trim()).unwrap();
    std::fs::write(admin.join("cpuset.cpus"), last.to_string()).unwrap();
    if std::fs::write(admin.join("cpuset.cpu_exclusive"), "1").is_err() {
        return eprintln!("SKIPPED: another cpuset here already overlaps CPU {last}; cannot make an exclusive one");
    }
    let v1 = V1::new(ours.clone(), None, None).unwrap();
    assert_eq!(v1.foreign_cpus().unwrap().to_string(), last.to_string());
    let ours_cpus = CpuSet::parse_list(&std::fs::read_to_string(ours.join("cpuset.cpus")).unwrap()).unwrap();
    assert!(!ours_cpus.contains(last), "our subtree leaves the exclusive CPU out: {ours_cpus}");
    assert_eq!(ours_cpus, all.difference(&std::iter::once(last).collect()));
}

#[test]
fn a_partition_beside_ours_is_foreign() {
    if !nix::unistd::geteuid().is_root() {
        return eprintln!("SKIPPED: needs root");
    }
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    let Some(mount) = v2_mount(&mounts) else {
        return eprintln!("SKIPPED: no cgroup v2 hierarchy");
    };
    if !std::fs::read_to_string(mount.join("cgroup.controllers")).unwrap_or_default().split_whitespace().any(|c| c == "cpuset") {
        assert!(std::env::var_os("TOPO_REQUIRE_REAL_CGROUPS").is_none(), "TOPO_REQUIRE_REAL_CGROUPS is set, but the v2 hierarchy has no cpuset controller");
        return eprintln!("SKIPPED: the cgroup v2 hierarchy has no cpuset controller here (a hybrid host)");
    }
    let all = CpuSet::parse_list(&std::fs::read_to_string(mount.join("cpuset.cpus.effective")).unwrap()).unwrap();
    if all.len() < 2 {
        return eprintln!("SKIPPED: needs two CPUs");
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
        assert!(std::env::var_os("TOPO_REQUIRE_REAL_CGROUPS").is_none(), "the kernel did not make CPU {last} a valid partition: {}", state.trim());
        return eprintln!("SKIPPED: the kernel did not make CPU {last} a valid partition here: {}", state.trim());
    }
    let v2 = V2::new(ours.clone()).unwrap();
    assert_eq!(v2.foreign_cpus().unwrap().to_string(), last.to_string());
    let ours_cpus = CpuSet::parse_list(&std::fs::read_to_string(ours.join("cpuset.cpus.effective")).unwrap()).unwrap();
    assert_eq!(ours_cpus, all.difference(&std::iter::once(last).collect()), "our subtree leaves the partition's CPU out");
}
