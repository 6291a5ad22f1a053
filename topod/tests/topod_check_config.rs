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
    assert_eq!(said.trim(), format!("{}: valid: topod would start with it", file.display()));
}

#[test]
fn each_mistake_is_named_plainly_with_its_file() {
    for (text, expected) in [
        ("gang_rows = 1\n", "gang_rows must be 2 to 64"),
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
    ] {
        let (out, file, _dir) = check(text);
        let said = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{text:?} was accepted: {said}");
        assert!(said.contains(expected), "{text:?}: {said}");
        // One plain line (a script shows it as it is): no log timestamp or level.
        assert!(said.starts_with("topod: "), "{text:?}: {said}");
        assert!(!said.contains("ERROR"), "{text:?}: {said}");
        if !text.starts_with("reserved") && !text.starts_with("tcp") {
            assert!(said.contains(&file.display().to_string()), "{text:?}: {said}");
        }
    }
}

#[test]
fn it_neither_needs_nor_touches_a_running_topod_or_cgroups() {
    // A socket path where nothing listens and a state directory that does not exist: a check
    // reads neither (the postinst runs it while the old topod runs).
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("topod.toml");
    std::fs::write(
        &file,
        format!(
            "socket = \"{0}/no/topod.sock\"\nstate_dir = \"{0}/no-state\"\n",
            dir.path().display()
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_topod"))
        .args(["--cgroup", "v1", "--check-config", "--topology"])
        .arg(bundled_topology())
        .arg("--config")
        .arg(&file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!dir.path().join("no-state").exists());
    assert!(!dir.path().join("no").exists());
}
