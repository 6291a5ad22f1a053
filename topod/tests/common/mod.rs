//! What the integration tests share: where the real machines live, and clean-up of test cgroups.

// Each test binary uses only some of these.
#![allow(dead_code)]

use std::path::PathBuf;

/// `shared/topologies`: `$TOPO_SHARED_DIR/topologies`, else `../shared/topologies` beside the
/// repository. Missing is a failure, not a skip: CI always has it.
pub fn topologies() -> PathBuf {
    let dir = std::env::var_os("TOPO_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"));
    let t = dir.join("topologies");
    assert!(t.join("expected-counts.tsv").is_file(), "shared topologies missing at {}; set TOPO_SHARED_DIR", t.display());
    t
}

/// Kills every process left in the cgroup directories under `root` and removes them and `root`
/// (test clean-up that must work even after a failed assertion).
pub fn remove_cgroup_tree(root: &std::path::Path) {
    if let Ok(entries) = std::fs::read_dir(root) {
        for e in entries.flatten().filter(|e| e.path().is_dir()) {
            if let Ok(procs) = std::fs::read_to_string(e.path().join("cgroup.procs")) {
                for pid in procs.split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
            let _ = std::fs::remove_dir(e.path());
        }
    }
    let _ = std::fs::remove_dir(root);
}
