//! `topod --check-config`, as the Debian package's postinst and an admin run it: the real binary,
//! the bundled real topology, configuration files with the mistakes a site makes.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output};

fn bundled_topology() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/dell-r740-2x-xeon-gold-6230-snc2.xml")
}

/// `topod --check-config` on a file holding `text`, on the bundled machine.
fn check(text: &str) -> (Output, PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("topod.toml");
    std::fs::File::create(&file).unwrap().write_all(text.as_bytes()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_topod"))
        .arg("--config")
        .arg(&file)
        .arg("--topology")
        .arg(bundled_topology())
        .arg("--check-config")
        .output()
        .expect("topod runs");
    (out, file, dir)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_valid_configuration_is_said_valid() {
    let (out, file, _dir) = check("cgroup_subtree = \"site\"\nreserved_cpus = \"0-1\"\n");
    assert!(out.status.success(), "{}", stderr(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        said.trim(),
        format!("{}: valid (not checked: whether its ports are free)", file.display())
    );
}

#[test]
fn each_mistake_is_named_plainly_with_its_file() {
    for (text, expected) in [
        ("gang_rows = 1\n", "gang_rows must be 2 to 64"),
        // The policies that do not combine, as the simulator refuses them too (one rule:
        // topo_core::policy::rules_conflict, whose reason both give).
        ("equipartition = true\npreempt = true\n", "equipartition does not go with preempt"),
        (
            "equipartition = true\ngang_rows = 2\n",
            "equipartition does not go with preempt or gang_rows",
        ),
        (
            "equipartition = true\ngang_rows = 2\n",
            topo_core::policy::rules_conflict(false, true, true).unwrap(),
        ),
        ("bogus = 1\n", "unknown field `bogus`"),
        ("cgroup_subtree = \"../x\"\n", "cgroup_subtree"),
        // Checked against the machine, as a start does: these CPUs leave none to allocate.
        (
            "reserved_cpus = \"0-79\"\n",
            "reserved_cpus 0-79: dell-r740-2x-xeon-gold-6230-snc2: no allocatable CPU",
        ),
        (
            "tcp_listen = \"127.0.0.1:0\"\ntcp_key_file = \"/nonexistent/topo.key\"\n",
            "tcp_key_file /nonexistent/topo.key",
        ),
        // What a start under the systemd unit would meet (found by an attack on the package's
        // upgrade: each passed the check, and the upgraded topod did not start).
        ("metrics_listen = \"192.0.2.77:9879\"\n", "192.0.2.77 is not an address of this host"),
        (
            "tcp_listen = \"127.0.0.1:0\"\ntcp_key_file = \"/tmp/topo.key\"\n",
            "tcp_key_file /tmp/topo.key: topod's systemd unit hides /tmp from it",
        ),
        ("socket = \"/nonexistent-dir/topod.sock\"\n", "socket: /nonexistent-dir does not exist"),
    ] {
        let (out, file, _dir) = check(text);
        let said = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{text:?} was accepted: {said}");
        assert!(said.contains(expected), "{text:?}: {said}");
        // One plain line (a script shows it as it is): no log timestamp or level.
        assert!(said.starts_with("topod: "), "{text:?}: {said}");
        assert!(!said.contains("ERROR"), "{text:?}: {said}");
        if text.starts_with("gang") || text.starts_with("bogus") || text.starts_with("cgroup") {
            assert!(said.contains(&file.display().to_string()), "{text:?}: {said}");
        }
    }
}

#[test]
fn it_creates_nothing_and_needs_no_running_topod() {
    // A socket whose directory is missing, and a state directory that does not exist: said,
    // and neither made (the postinst runs the check while the old topod runs, or none does).
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("topod.toml");
    for (text, said) in [
        (format!("socket = \"{}/no/topod.sock\"\n", dir.path().display()), "socket: "),
        (format!("state_dir = \"{}/no-state\"\n", dir.path().display()), "state_dir: "),
    ] {
        std::fs::write(&file, text).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_topod"))
            .args(["--cgroup", "fake", "--check-config", "--topology"])
            .arg(bundled_topology())
            .arg("--config")
            .arg(&file)
            .output()
            .unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains(said) && err.contains("does not exist, and topod does not create it"),
            "{err}"
        );
    }
    assert!(!dir.path().join("no-state").exists());
    assert!(!dir.path().join("no").exists());
}

#[test]
fn a_key_root_cannot_read_without_cap_dac_override_is_refused() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: needs root (chowns the key to nobody)");
        return;
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let key = dir.path().join("tcp.key");
    std::fs::write(&key, "0123456789abcdef-key\n").unwrap();
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    nix::unistd::chown(
        &key,
        Some(nix::unistd::Uid::from_raw(65534)),
        Some(nix::unistd::Gid::from_raw(65534)),
    )
    .unwrap();
    let (out, _, _d) = check(&format!(
        "tcp_listen = \"127.0.0.1:0\"\ntcp_allow = [\"127.0.0.1\"]\ntcp_key_file = \"{}\"\n",
        key.display()
    ));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("owned by uid 65534") && err.contains("chown root:root"), "{err}");
}

#[test]
fn cgroup_v2_without_its_cpuset_controller_is_refused() {
    let (out, _, _d) = check("cgroup = \"v2\"\n");
    let err = stderr(&out);
    let v2_cpuset = std::fs::read_to_string("/proc/mounts").unwrap().lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.get(2) == Some(&"cgroup2")).then(|| {
            std::fs::read_to_string(format!("{}/cgroup.controllers", f[1])).unwrap_or_default()
        })
    });
    match v2_cpuset {
        Some(c) if c.split_whitespace().any(|x| x == "cpuset") => {
            assert!(out.status.success(), "{err}")
        }
        _ => {
            assert_eq!(out.status.code(), Some(1), "{err}");
            assert!(
                err.contains("offers no cpuset controller")
                    || err.contains("no cgroup v2 hierarchy"),
                "{err}"
            );
        }
    }
}

/// Issue 27: a site that turns on topod's own gang slicing or preemption is told, by the check
/// its package runs, that Slurm's and PBS's jobs never get them, and what to use instead.
#[test]
fn gang_rows_and_preempt_are_said_not_to_apply_to_slurm_and_pbs_jobs() {
    let (out, _file, _dir) = check("gang_rows = 2\ngang_all_jobs = true\npreempt = true\n");
    assert!(out.status.success(), "{}", stderr(&out));
    let said = stderr(&out);
    assert!(
        said.contains(
            "gang_rows: Slurm's plug-in and PBS's hook never let topod gang-slice their jobs"
        ),
        "{said}"
    );
    assert!(said.contains("Use Slurm's PreemptMode=GANG"), "{said}");
    assert!(
        said.contains("preempt: Slurm's plug-in and PBS's hook never mark a job preemptible"),
        "{said}"
    );
    let (out, _file, _dir) = check("equipartition = true\n");
    assert_eq!(stderr(&out), "", "nothing to say without them");
}
