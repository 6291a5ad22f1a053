//! `topoctl` as a user runs it: the real binary, real topology files, and what it prints.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};

fn shared() -> PathBuf {
    common::topologies().parent().unwrap().to_path_buf()
}

fn zen4() -> PathBuf {
    shared().join("topologies/converted-hwloc2.9/AMD-19h-Zen4-2xEpyc-9654.xml")
}

fn topoctl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_topoctl")).args(args).output().expect("topoctl runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn show_json_has_the_counts() {
    let o = topoctl(&["show", "--topology", zen4().to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(
        (
            v["packages"].as_u64(),
            v["numa_nodes"].as_u64(),
            v["l3_groups"].as_u64(),
            v["cores"].as_u64(),
            v["pus"].as_u64()
        ),
        (Some(2), Some(1), Some(24), Some(192), Some(384))
    );
}

#[test]
fn every_picture_fits_100_columns() {
    for sub in ["xml", "converted-hwloc2.9"] {
        for entry in std::fs::read_dir(shared().join("topologies").join(sub)).unwrap() {
            let path = entry.unwrap().path();
            let o = topoctl(&["show", "--topology", path.to_str().unwrap()]);
            assert!(o.status.success(), "{}: {}", path.display(), stderr(&o));
            let text = stdout(&o);
            for line in text.lines() {
                assert!(
                    line.chars().count() <= 100,
                    "{}: line of {} columns:\n{line}",
                    path.display(),
                    line.chars().count()
                );
            }
            assert!(text.contains("Package"), "{}", path.display());
        }
    }
}

#[test]
fn show_names_the_pcie_switch_each_device_sits_behind() {
    let path = shared().join("topologies/converted-hwloc2.9/32intel64-2p8co2t+8ve.xml");
    let o = topoctl(&["show", "--topology", path.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    let line = |dev: &str| text.lines().find(|l| l.contains(dev)).unwrap_or_default().to_string();
    assert!(line("(ve0)").ends_with("PCIe switch 0000:18:00.0"), "{text}");
    assert!(line("(ve7)").ends_with("PCIe switch 0000:3b:00.0"), "{text}");
}

#[test]
fn check_prints_the_normalized_request() {
    let o = topoctl(&["check", "affinity[core(2, same=numa)*4 : membind=localonly]"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).trim(), "affinity[core(2,same=numa)*4:membind=localonly]");
}

#[test]
fn check_merges_queue_strings_per_keyword() {
    let o = topoctl(&[
        "check",
        "CPUSET[CPU_LIST=1,5,7-12;MAX_CPU_PER_NODE=4]",
        "--queue-default",
        "CPUSET[CPUSET_OPTIONS=CPUSET_CPU_EXCLUSIVE]",
        "--queue-mandatory",
        "CPUSET[CPUSET_TYPE=dynamic;MAX_CPU_PER_NODE=2]",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let r = &v["request"];
    assert_eq!(r["max_cpu_per_node"], 2);
    assert_eq!(r["cpu_list"], "1,5,7-12");
    assert_eq!(r["cpuset_type"], "dynamic");
    assert_eq!(r["cpuset_options"][0], "CpuExclusive");
}

#[test]
fn a_bad_request_points_at_the_fragment() {
    let o = topoctl(&["check", "affinity[cores(2)]"]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(err.contains("cores"), "{err}");
    assert!(err.contains('^'), "a caret line under the fragment:\n{err}");
    assert!(err.contains("core"), "the accepted words:\n{err}");
}

#[test]
fn a_bad_request_with_json_gives_the_same_words_as_json() {
    let text = topoctl(&["check", "affinity[cores(2)]"]);
    let o = topoctl(&["check", "--json", "affinity[cores(2)]"]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(stderr(&o), stderr(&text), "stderr is unchanged by --json");
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let e = &v["error"];
    let last_line = stderr(&text).trim_end().lines().last().unwrap().to_string();
    assert_eq!(e["message"], last_line.as_str());
    assert_eq!(format!("topoctl: {}\n", e["text"].as_str().unwrap()), stderr(&text));
    assert_eq!(
        (e["byte"].as_u64(), e["fragment"].as_str(), e["source"].as_str()),
        (Some(9), Some("cores"), Some("job"))
    );
    assert!(e["expected"].as_array().unwrap().iter().any(|w| w == "core"), "{e}");
}

#[test]
fn place_shows_the_picture_and_metrics() {
    let o = topoctl(&[
        "place",
        "--topology",
        zen4().to_str().unwrap(),
        "affinity[core(4,same=l3)*2]",
        "affinity[thread*6]",
        "-n",
        "3",
        "CPUSET[MAX_RADIUS=0]",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("job1") && text.contains("job3"), "{text}");
    assert!(text.contains("NUMA/min"), "{text}");
    assert!(!text.contains("rejected"), "{text}");
    let o =
        topoctl(&["place", "--topology", zen4().to_str().unwrap(), "--json", "affinity[socket*3]"]);
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert!(v["jobs"][0]["rejected"]["reason"].as_str().unwrap().contains("never fit"), "{v}");
}

#[test]
fn unknown_strategy_lists_the_known_ones() {
    let o = topoctl(&[
        "place",
        "--topology",
        zen4().to_str().unwrap(),
        "--strategy",
        "fastest",
        "affinity[thread]",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("best-fit"), "{}", stderr(&o));
}

#[test]
fn missing_topology_file_is_a_clear_error() {
    let o = topoctl(&["show", "--topology", "/nonexistent/machine.xml"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("/nonexistent/machine.xml"), "{}", stderr(&o));
}

#[test]
fn bench_json_has_every_field() {
    let o = topoctl(&[
        "bench",
        "placement",
        "--topology",
        zen4().to_str().unwrap(),
        "--jobs",
        "200",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines: Vec<serde_json::Value> =
        stdout(&o).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let names: Vec<&str> = lines.iter().map(|v| v["strategy"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["best-fit", "pack", "balance", "first-fit", "buddy", "k8s-static", "slurm-block"]
    );
    for v in &lines {
        for key in [
            "topology",
            "numa_optimal_share",
            "l3_optimal_share",
            "mean_radius",
            "smt_shared",
            "rejected_while_free",
            "decision_p50_us",
            "decision_p99_us",
        ] {
            assert!(!v[key].is_null(), "{key} missing in {v}");
        }
    }
}

#[test]
fn the_demo_needs_nothing_beside_the_repository() {
    // From an empty directory with no shared folder in reach: the bundled machine, with its NUMA
    // nodes, and exactly as many jobs in the table as the header says were placed.
    let empty = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_topoctl"))
        .arg("demo")
        .current_dir(empty.path())
        .env_remove("TOPO_SHARED_DIR")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("dell-r740-2x-xeon-gold-6230-snc2") && out.contains("4 NUMA nodes"),
        "{out}"
    );
    assert!(out.contains("NUMA 3  372 GiB") && !out.contains("memory size unknown"), "{out}");
    let said: usize = out
        .lines()
        .next()
        .unwrap()
        .split(": ")
        .nth(2)
        .and_then(|s| s.split(" placed").next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap();
    let rows = out
        .lines()
        .filter(|l| l.starts_with("job") && !l.contains("rejected") && !l.starts_with("job "))
        .count();
    assert_eq!(said, rows, "{out}");
    assert!(
        out.lines().any(|l| l.starts_with("job") && l.split_whitespace().nth(4) == Some("11")),
        "a job spanning the two halves of a socket shows distance 11: {out}"
    );
    // Cut short by a closed pipe: no panic.
    let mut child = Command::new(env!("CARGO_BIN_EXE_topoctl"))
        .arg("demo")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
}
