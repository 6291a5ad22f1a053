//! Issue 33, the batch system chose the GPUs: topod discovers GPUs from a sysfs tree (PCI
//! functions with their NUMA nodes, behind a PCIe switch) under a fake root, places a job given
//! a GPU on CPUs of that GPU's NUMA node, and `topoctl jobs` says how near they are.

mod common;

use common::{ask, error_of, ok};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn write(root: &Path, rel: &str, text: &str) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, text).unwrap();
}

/// A PCI function at `path` under `sys/devices` (its last component the address), linked from
/// `sys/bus/pci/devices` as the kernel does.
fn pci_function(root: &Path, path: &str, class: &str, numa_node: &str, drm: Option<&str>) {
    let address = path.rsplit('/').next().unwrap();
    let dir = format!("sys/devices/{path}");
    write(root, &format!("{dir}/class"), class);
    write(root, &format!("{dir}/vendor"), "0x10de");
    write(root, &format!("{dir}/numa_node"), numa_node);
    if let Some(card) = drm {
        std::fs::create_dir_all(root.join(format!("{dir}/drm/{card}"))).unwrap();
    }
    std::fs::create_dir_all(root.join("sys/bus/pci/devices")).unwrap();
    std::os::unix::fs::symlink(
        format!("../../../devices/{path}"),
        root.join(format!("sys/bus/pci/devices/{address}")),
    )
    .unwrap();
}

/// Two packages, each one NUMA node of four single-thread cores (node 0: CPUs 0-3, node 1:
/// 4-7); GPU card0 on node 0 straight off a root port, cards 1 and 2 on node 1 behind one PCIe
/// switch.
fn machine(root: &Path) {
    write(root, "sys/devices/system/cpu/online", "0-7\n");
    for cpu in 0..8 {
        let (package, siblings, mask) = if cpu < 4 { (0, "0-3", "0f") } else { (1, "4-7", "f0") };
        let d = format!("sys/devices/system/cpu/cpu{cpu}");
        write(root, &format!("{d}/topology/thread_siblings_list"), &cpu.to_string());
        write(root, &format!("{d}/topology/core_siblings_list"), siblings);
        write(root, &format!("{d}/topology/physical_package_id"), &package.to_string());
        write(root, &format!("{d}/topology/core_id"), &(cpu % 4).to_string());
        write(root, &format!("{d}/cache/index3/level"), "3");
        write(root, &format!("{d}/cache/index3/type"), "Unified");
        write(root, &format!("{d}/cache/index3/shared_cpu_map"), mask);
    }
    write(root, "sys/devices/system/node/possible", "0-1\n");
    for (node, cpus, distance) in [(0, "0-3", "10 21\n"), (1, "4-7", "21 10\n")] {
        let d = format!("sys/devices/system/node/node{node}");
        write(root, &format!("{d}/cpulist"), cpus);
        write(root, &format!("{d}/meminfo"), &format!("Node {node} MemTotal:  1048576 kB\n"));
        write(root, &format!("{d}/distance"), distance);
    }
    write(root, "proc/mounts", "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n");
    write(root, "proc/self/cgroup", "0::/\n");
    write(root, "sys/fs/cgroup/cpuset.cpus.effective", "0-7\n");
    write(root, "sys/fs/cgroup/cpuset.mems.effective", "0-1\n");
    let bridge = "0x060400";
    pci_function(root, "pci0000:00/0000:00:01.0", bridge, "0", None);
    pci_function(root, "pci0000:00/0000:00:01.0/0000:18:00.0", "0x030200", "0", Some("card0"));
    let switch = "pci0000:80/0000:80:01.0/0000:81:00.0";
    pci_function(root, "pci0000:80/0000:80:01.0", bridge, "1", None);
    pci_function(root, switch, bridge, "1", None);
    for (port, gpu, card) in [("82:08.0", "86:00.0", "card1"), ("82:10.0", "87:00.0", "card2")] {
        pci_function(root, &format!("{switch}/0000:{port}"), bridge, "1", None);
        let path = format!("{switch}/0000:{port}/0000:{gpu}");
        pci_function(root, &path, "0x030200", "1", Some(card));
    }
    // Network adapters: an InfiniBand HCA behind the GPUs' switch on node 1 (interface ib0,
    // RDMA device mlx5_0), an Ethernet port on node 0's own root port.
    let hca = format!("{switch}/0000:82:18.0/0000:88:00.0");
    pci_function(root, &format!("{switch}/0000:82:18.0"), bridge, "1", None);
    pci_function(root, &hca, "0x020700", "1", None);
    let eth = "pci0000:00/0000:00:02.0/0000:19:00.0";
    pci_function(root, "pci0000:00/0000:00:02.0", bridge, "0", None);
    pci_function(root, eth, "0x020000", "0", None);
    for dir in
        [format!("{hca}/net/ib0"), format!("{hca}/infiniband/mlx5_0"), format!("{eth}/net/eth1")]
    {
        std::fs::create_dir_all(root.join("sys/devices").join(dir)).unwrap();
    }
    // An SR-IOV virtual function of the HCA (its own interface, a `physfn` link back): not
    // another adapter near anything.
    let vf = format!("{switch}/0000:82:18.0/0000:88:00.1");
    pci_function(root, &vf, "0x020700", "1", None);
    std::fs::create_dir_all(root.join("sys/devices").join(&vf).join("net/ib0v0")).unwrap();
    std::os::unix::fs::symlink(
        "../0000:88:00.0",
        root.join("sys/devices").join(&vf).join("physfn"),
    )
    .unwrap();
    // The character devices of card0 and card2, as the kernel links them (major 241: local
    // and experimental use, as the test's own device nodes are).
    std::fs::create_dir_all(root.join("sys/dev/char")).unwrap();
    for (dev, path) in [
        ("241:0", "pci0000:00/0000:00:01.0/0000:18:00.0/drm/card0"),
        ("241:2", "pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:10.0/0000:87:00.0/drm/card2"),
    ] {
        std::os::unix::fs::symlink(
            format!("../../devices/{path}"),
            root.join("sys/dev/char").join(dev),
        )
        .unwrap();
    }
}

/// `machine()` written at `root`, and a topod on it (fake cgroups) with its socket in `dir`.
fn topod_on_machine(dir: &Path, root: &Path) -> common::Daemon {
    machine(root);
    common::start(dir, &["--cgroup", "fake", "--topology", root.to_str().unwrap()], false)
}

fn topoctl(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_topoctl")).args(args).output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn a_job_given_a_gpu_runs_on_its_numa_node_and_topoctl_jobs_says_how_near() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let d = topod_on_machine(dir.path(), &root);
    let socket = d.socket.to_str().unwrap();
    // Discovery: the GPUs with their nodes and the switch two of them share.
    let topo = ok(&d.socket, r#"{"op":"topology"}"#);
    let gpu = |address: &str| -> Value {
        topo["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["pci_address"] == address)
            .unwrap_or_else(|| panic!("{address} not in {topo}"))
            .clone()
    };
    assert_eq!(gpu("0000:18:00.0")["numa_node"], 0);
    assert_eq!(gpu("0000:86:00.0")["numa_node"], 1);
    assert_eq!(gpu("0000:86:00.0")["upstream"][1], "0000:81:00.0");
    assert_eq!(gpu("0000:87:00.0")["upstream"][1], "0000:81:00.0");
    assert_eq!(gpu("0000:88:00.1")["virtual_function"], true);
    assert_eq!(gpu("0000:88:00.0").get("virtual_function"), None);
    // One core taken on node 0: best-fit alone puts a 3-core job beside it.
    ok(&d.socket, r#"{"op":"allocate","job":"cpu","request":"affinity[core]"}"#);
    let fit = ok(&d.socket, r#"{"op":"fit","request":"affinity[core*3]"}"#);
    assert_eq!(fit["cpus"], "1-3", "{fit}");
    // Given card1, the same job runs on node 1, card1's.
    let (done, out) = topoctl(&[
        "alloc",
        "--socket",
        socket,
        "--job",
        "g",
        "--gpus",
        "card1",
        "affinity[core*3]",
    ]);
    assert!(done && out.contains("CPUs 4-6"), "{out}");
    let (done, out) = topoctl(&["jobs", "--socket", socket]);
    assert!(done, "{out}");
    assert!(out.contains("GPUs 0000:86:00.0 (card1, NUMA node 1, local to every CPU)"), "{out}");
    // The adapter behind card1's switch; for the job without GPUs, the one in its CPU's node.
    assert!(
        out.contains(
            "nearest network adapters 0000:88:00.0 (ib0, mlx5_0; behind its GPUs' PCIe switch)"
        ),
        "{out}"
    );
    assert!(
        out.contains("nearest network adapters 0000:19:00.0 (eth1; in its CPUs' NUMA node)"),
        "{out}"
    );
    let listed = ok(&d.socket, r#"{"op":"list"}"#);
    let nics = |job: &str| -> Value {
        listed.as_array().unwrap().iter().find(|j| j["job"] == job).unwrap()["nics"].clone()
    };
    assert_eq!(nics("g")[0]["near"], "pcie-switch", "{listed}");
    assert_eq!(nics("g").as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(nics("cpu")[0]["near"], "numa-node", "{listed}");
    // Node 1 has one core left: gpubind=numa does not fit, and says so; without it the job
    // runs on node 0, and the listing says how far that is.
    let strict = ask(
        &d.socket,
        r#"{"op":"allocate","job":"s","request":"affinity[core*2:gpubind=numa]","gpus":["0000:87:00.0"]}"#,
    );
    let (code, message) = error_of(&strict);
    assert_eq!(code, "does_not_fit", "{strict}");
    assert!(
        message
            .contains("gpubind=numa keeps it to CPUs 4-7, those near its GPUs 0000:87:00.0 that"),
        "{message}"
    );
    let loose = ok(
        &d.socket,
        r#"{"op":"allocate","job":"l","request":"affinity[core*2]","gpus":["87:00.0"]}"#,
    );
    assert_eq!(loose["cpus"], "1-2", "{loose}");
    let (_, out) = topoctl(&["jobs", "--socket", socket]);
    assert!(
        out.contains("0000:87:00.0 (card2, NUMA node 1, distance 21 to the farthest CPU"),
        "{out}"
    );
    // A name this host has no device for: refused, naming it and what there is.
    let bad = ask(
        &d.socket,
        r#"{"op":"allocate","job":"b","request":"affinity[core]","gpus":["card9"]}"#,
    );
    let (code, message) = error_of(&bad);
    assert_eq!(code, "bad_request", "{bad}");
    assert!(
        message.contains("no PCI device \"card9\"") && message.contains("0000:18:00.0 (card0)"),
        "{message}"
    );
    let listed = ok(&d.socket, r#"{"op":"list"}"#);
    assert!(
        !listed.to_string().contains("\"b\""),
        "nothing was allocated for the refused job: {listed}"
    );
    // fit takes the GPUs too: near card0 (node 0: CPU 0 taken, 1-2 by job l) one core is left.
    let fit =
        ok(&d.socket, r#"{"op":"fit","request":"affinity[core:gpubind=numa]","gpus":["card0"]}"#);
    assert_eq!(fit["cpus"], "3", "{fit}");
    let no = ask(
        &d.socket,
        r#"{"op":"fit","request":"affinity[core*2:gpubind=numa]","gpus":["card0"]}"#,
    );
    assert_eq!(error_of(&no).0, "does_not_fit", "{no}");
}

/// A batch system names GPUs by their device files (Slurm's gres.conf `File=`): topod finds
/// the PCI function behind each through the tree's `sys/dev/char`; a file that is no character
/// device, or one on no PCI function, is refused naming it.
#[test]
fn gpus_named_by_device_file_are_found_through_sys_dev_char() {
    if !common::is_root() {
        common::skip("making device nodes needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    machine(&root);
    let node = |name: &str, minor: u64| device_node(dir.path(), name, minor);
    let (card0, card2, stray) = (node("gpu0", 0), node("gpu2", 2), node("stray", 7));
    let d = common::start(
        dir.path(),
        &["--cgroup", "fake", "--topology", root.to_str().unwrap()],
        false,
    );
    let allocate = |job: &str, request: &str, gpu: &str| {
        ask(
            &d.socket,
            &format!(r#"{{"op":"allocate","job":"{job}","request":"{request}","gpus":["{gpu}"]}}"#),
        )
    };
    let near_card2 = allocate("a", "affinity[core*2]", &card2);
    assert_eq!(near_card2["ok"]["cpus"], "4-5", "{near_card2}");
    let near_card0 = allocate("b", "affinity[core*2]", &card0);
    assert_eq!(near_card0["ok"]["cpus"], "0-1", "{near_card0}");
    let listed = ok(&d.socket, r#"{"op":"list"}"#).to_string();
    assert!(listed.contains("0000:87:00.0") && listed.contains("0000:18:00.0"), "{listed}");
    let (code, message) = error_of(&allocate("c", "affinity[core]", &stray));
    assert_eq!(code, "bad_request");
    assert!(message.contains("character device 241:7 is on no PCI function"), "{message}");
    let regular = dir.path().join("topod.log");
    let (_, message) = error_of(&allocate("c", "affinity[core]", regular.to_str().unwrap()));
    assert!(message.contains("topod.log: not a character device"), "{message}");
}

/// One package, one NUMA node, CPU 0 alone (a CPU every host has, so that the real cgroup
/// backend can give it), and two GPUs on that node whose character devices are 241:0 and 241:1.
fn one_cpu_machine_with_two_gpus(root: &Path) {
    write(root, "sys/devices/system/cpu/online", "0\n");
    let d = "sys/devices/system/cpu/cpu0";
    write(root, &format!("{d}/topology/thread_siblings_list"), "0");
    write(root, &format!("{d}/topology/core_siblings_list"), "0");
    write(root, &format!("{d}/topology/physical_package_id"), "0");
    write(root, &format!("{d}/topology/core_id"), "0");
    write(root, "sys/devices/system/node/possible", "0\n");
    write(root, "sys/devices/system/node/node0/cpulist", "0");
    write(root, "sys/devices/system/node/node0/meminfo", "Node 0 MemTotal:  1048576 kB\n");
    write(root, "sys/devices/system/node/node0/distance", "10\n");
    write(root, "proc/mounts", "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n");
    write(root, "proc/self/cgroup", "0::/\n");
    write(root, "sys/fs/cgroup/cpuset.cpus.effective", "0\n");
    write(root, "sys/fs/cgroup/cpuset.mems.effective", "0\n");
    pci_function(root, "pci0000:00/0000:00:01.0", "0x060400", "0", None);
    std::fs::create_dir_all(root.join("sys/dev/char")).unwrap();
    for (minor, gpu, card) in [(0, "18:00.0", "card0"), (1, "19:00.0", "card1")] {
        let path = format!("pci0000:00/0000:00:01.0/0000:{gpu}");
        pci_function(root, &path, "0x030200", "0", Some(card));
        std::os::unix::fs::symlink(
            format!("../../devices/{path}/drm/{card}"),
            root.join(format!("sys/dev/char/241:{minor}")),
        )
        .unwrap();
    }
}

/// A character device node `dir/name` for `241:minor` (no driver has major 241: opening one
/// the job may open fails with ENXIO, one it may not with EPERM, from the devices controller).
fn device_node(dir: &Path, name: &str, minor: u64) -> String {
    let path = dir.join(name);
    nix::sys::stat::mknod(
        &path,
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(241, minor),
    )
    .unwrap();
    path.to_str().unwrap().to_string()
}

/// What opening each file inside job `job` (through topo-exec, which moves itself into every
/// hierarchy) says: `Operation not permitted`, `No such device or address`, ...
fn opened_inside(socket: &Path, job: &str, files: &[&str]) -> Vec<String> {
    files
        .iter()
        .map(|file| {
            let out = Command::new(env!("CARGO_BIN_EXE_topo-exec"))
                .args(["--socket", socket.to_str().unwrap(), "--job", job, "--"])
                .args(["sh", "-c", &format!("exec 3< {file}")])
                .output()
                .unwrap();
            let said = String::from_utf8_lossy(&out.stderr);
            for why in ["Operation not permitted", "No such device or address"] {
                if said.contains(why) {
                    return why.to_string();
                }
            }
            format!("unexpected: status {}, {said}", out.status)
        })
        .collect()
}

/// Issue 33, confinement, on the real kernel: with `confine_devices`, a job given GPU 241:0
/// (named by device number, as the plug-ins send it) opens it but not the other GPU's device
/// file, a job given none opens neither, a restarted topod keeps both so, and a job whose GPU
/// topod chose (`gpus=1`) opens that one only; without CAP_SYS_ADMIN topod refuses to start,
/// saying why. cgroup v1 (the devices controller) on CI's machine class; cgroup v2 (a BPF
/// program per job) in the suite's pure v2 guest.
#[test]
fn with_confine_devices_a_job_opens_only_its_own_gpu() {
    if !common::is_root() {
        common::skip("device nodes and the devices controller need root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    one_cpu_machine_with_two_gpus(&root);
    let cgroups = match common::RealCgroups::detect() {
        Ok(c) => c,
        Err(why) => return common::skip(&why),
    };
    let subtree = format!("topo-devices-test-{}", std::process::id());
    let config = common::config(
        dir.path(),
        &format!(
            "cgroup = \"{}\"\ncgroup_subtree = \"{subtree}\"\ntopology = \"{}\"\nconfine_devices = true\n",
            cgroups.kind(),
            root.display()
        ),
    );
    let topod = |drop_sys_admin: bool, extra: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_topod"));
        cmd.args(extra);
        cmd.args(["--config", config.to_str().unwrap(), "--socket"])
            .arg(dir.path().join("refused.sock"))
            .arg("--state-dir")
            .arg(dir.path().join("refused-state"));
        if drop_sys_admin {
            // SAFETY: between fork and exec only the capability system calls run, which
            // allocate nothing and take no lock.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                    use caps::{CapSet, Capability::CAP_SYS_ADMIN};
                    for set in [CapSet::Effective, CapSet::Permitted, CapSet::Bounding] {
                        caps::drop(None, set, CAP_SYS_ADMIN).map_err(std::io::Error::other)?;
                    }
                    Ok(())
                });
            }
        }
        cmd.output().unwrap()
    };
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    // v1: the devices hierarchy's directory of each job; v2 has none (a BPF program on the
    // job's own cgroup).
    let devices = match cgroups.kind() {
        "v1" => match topod::cgroup::v1::v1_devices_mount(&mounts) {
            Some(d) => Some(d),
            None => return common::skip("no cgroup v1 devices hierarchy is mounted"),
        },
        _ => None,
    };
    let mut roots = cgroups.roots(&subtree);
    roots.extend(devices.iter().map(|d| d.join(&subtree)));
    let _cleanup = common::SubtreeCleanup(roots);
    // Without CAP_SYS_ADMIN, topod says what it needs before taking any job.
    let out = topod(true, &[]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "topod started without CAP_SYS_ADMIN: {said}");
    assert!(said.contains("CAP_SYS_ADMIN") && said.contains("confine-devices.conf"), "{said}");
    // --check-config (what a package upgrade runs before the restart) says the same.
    let out = topod(true, &["--check-config"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && said.contains("CAP_SYS_ADMIN"), "{said}");

    let (gpu0, gpu1) = (device_node(dir.path(), "gpu0", 0), device_node(dir.path(), "gpu1", 1));
    let denied = "Operation not permitted";
    let opens = "No such device or address";
    let mut d = common::start(dir.path(), &["--config", config.to_str().unwrap()], false);
    ok(
        &d.socket,
        r#"{"op":"allocate","job":"d1","request":"affinity[core]","gpus":["char:241:0"]}"#,
    );
    assert_eq!(opened_inside(&d.socket, "d1", &[&gpu0, &gpu1]), [opens, denied]);
    let listed = ok(&d.socket, r#"{"op":"list"}"#).to_string();
    assert!(listed.contains("0000:18:00.0"), "{listed}");
    ok(&d.socket, r#"{"op":"release","job":"d1"}"#);
    if let Some(devices) = &devices {
        assert!(!devices.join(&subtree).join("d1").exists(), "release removes the devices cgroup");
    }
    ok(&d.socket, r#"{"op":"allocate","job":"d2","request":"affinity[core]"}"#);
    assert_eq!(opened_inside(&d.socket, "d2", &[&gpu0, &gpu1]), [denied, denied]);
    // A restart finds the job, and the kernel kept its rules.
    drop(d);
    d = common::start(dir.path(), &["--config", config.to_str().unwrap()], false);
    let listed = ok(&d.socket, r#"{"op":"list"}"#).to_string();
    assert!(listed.contains("\"d2\""), "{listed}");
    assert_eq!(opened_inside(&d.socket, "d2", &[&gpu0, &gpu1]), [denied, denied]);
    ok(&d.socket, r#"{"op":"release","job":"d2"}"#);
    // A later allocate of the same job naming the other GPU (a step's own): it has both.
    ok(
        &d.socket,
        r#"{"op":"allocate","job":"d4","request":"affinity[core]","gpus":["char:241:1"]}"#,
    );
    assert_eq!(opened_inside(&d.socket, "d4", &[&gpu0, &gpu1]), [denied, opens]);
    ok(
        &d.socket,
        r#"{"op":"allocate","job":"d4","request":"affinity[core]","gpus":["char:241:0"]}"#,
    );
    assert_eq!(opened_inside(&d.socket, "d4", &[&gpu0, &gpu1]), [opens, opens]);
    ok(&d.socket, r#"{"op":"release","job":"d4"}"#);
    // Its devices cgroup removed behind topod's back (an administrator's rmdir, a release cut
    // short): made again, with its rules, before the next process joins.
    if let Some(devices) = &devices {
        ok(&d.socket, r#"{"op":"allocate","job":"d5","request":"affinity[core]"}"#);
        std::fs::remove_dir(devices.join(&subtree).join("d5")).unwrap();
        assert_eq!(opened_inside(&d.socket, "d5", &[&gpu0, &gpu1]), [denied, denied]);
        ok(&d.socket, r#"{"op":"release","job":"d5"}"#);
    }
    // A job allocated while devices were not confined is confined once topod starts with it.
    drop(d);
    let off = dir.path().join("off.toml");
    std::fs::write(
        &off,
        std::fs::read_to_string(&config).unwrap().replace("confine_devices = true", ""),
    )
    .unwrap();
    d = common::start(dir.path(), &["--config", off.to_str().unwrap()], false);
    ok(
        &d.socket,
        r#"{"op":"allocate","job":"d6","request":"affinity[core]","gpus":["char:241:1"]}"#,
    );
    assert_eq!(opened_inside(&d.socket, "d6", &[&gpu0, &gpu1]), [opens, opens]);
    drop(d);
    d = common::start(dir.path(), &["--config", config.to_str().unwrap()], false);
    assert_eq!(opened_inside(&d.socket, "d6", &[&gpu0, &gpu1]), [denied, opens]);
    // And turned off again: v1: its devices cgroup goes, with the subtree; v2: its program
    // stays with its cgroup until the job ends (new jobs get none).
    drop(d);
    d = common::start(dir.path(), &["--config", off.to_str().unwrap()], false);
    if let Some(devices) = &devices {
        assert!(!devices.join(&subtree).exists(), "the devices subtree is left");
        assert_eq!(opened_inside(&d.socket, "d6", &[&gpu0, &gpu1]), [opens, opens]);
        ok(&d.socket, r#"{"op":"release","job":"d6"}"#);
    } else {
        assert_eq!(opened_inside(&d.socket, "d6", &[&gpu0, &gpu1]), [denied, opens]);
        // The one CPU is d6's: it goes first.
        ok(&d.socket, r#"{"op":"release","job":"d6"}"#);
        ok(&d.socket, r#"{"op":"allocate","job":"d7","request":"affinity[core]"}"#);
        assert_eq!(opened_inside(&d.socket, "d7", &[&gpu0, &gpu1]), [opens, opens]);
        ok(&d.socket, r#"{"op":"release","job":"d7"}"#);
    }
    drop(d);
    d = common::start(dir.path(), &["--config", config.to_str().unwrap()], false);
    // GPUs topod chooses (gpus=1) are confined the same way.
    ok(&d.socket, r#"{"op":"allocate","job":"d3","request":"affinity[core:gpus=1]"}"#);
    let listed = ok(&d.socket, r#"{"op":"list"}"#);
    let chosen = listed[0]["gpus"][0]["pci_address"].as_str().unwrap_or_default().to_string();
    let (own, other) = match chosen.as_str() {
        "0000:18:00.0" => (&gpu0, &gpu1),
        "0000:19:00.0" => (&gpu1, &gpu0),
        _ => panic!("topod chose no GPU of the two: {listed}"),
    };
    assert_eq!(opened_inside(&d.socket, "d3", &[own, other]), [opens, denied]);
    ok(&d.socket, r#"{"op":"release","job":"d3"}"#);
    // A GPU that appears after topod read the host (hot-plug, SR-IOV functions made later) is
    // denied to every job from its next join on; no job can be given it until topod reads the
    // host again (an attack finding: it stayed open to every job until a restart).
    let hot = "pci0000:00/0000:00:01.0/0000:1a:00.0";
    pci_function(&root, hot, "0x030200", "0", Some("card2"));
    std::os::unix::fs::symlink(
        format!("../../devices/{hot}/drm/card2"),
        root.join("sys/dev/char/241:2"),
    )
    .unwrap();
    let gpu2 = device_node(dir.path(), "gpu2", 2);
    ok(
        &d.socket,
        r#"{"op":"allocate","job":"d8","request":"affinity[core]","gpus":["char:241:0"]}"#,
    );
    assert_eq!(opened_inside(&d.socket, "d8", &[&gpu0, &gpu1, &gpu2]), [opens, denied, denied]);
    ok(&d.socket, r#"{"op":"release","job":"d8"}"#);
}

/// A device file is looked up by topod as root: only an administrator may name GPUs by path in
/// `fit` (anyone may name them by number, which reveals no more than `/sys/dev/char` does).
#[test]
fn only_an_administrator_names_gpus_by_device_file_in_fit() {
    use std::os::unix::process::CommandExt;
    if !common::is_root() {
        common::skip("the client runs as the user nobody");
        return;
    }
    let dir = common::open_dir();
    let root = dir.path().join("root");
    let d = topod_on_machine(dir.path(), &root);
    let as_nobody = |gpu: &str| -> Value {
        let program = r#"
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall((json.dumps({"v": 1, "op": "fit", "request": "affinity[core]", "gpus": [sys.argv[2]]}) + "\n").encode())
print(s.makefile().readline(), end="")
"#;
        let out = Command::new("/usr/bin/python3")
            .args(["-c", program])
            .arg(&d.socket)
            .arg(gpu)
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{text:?}: {e}; {}", String::from_utf8_lossy(&out.stderr)))
    };
    let (code, message) = error_of(&as_nobody("/dev/null"));
    assert_eq!(code, "forbidden", "{message}");
    assert!(message.contains("device file"), "{message}");
    let (code, message) = error_of(&as_nobody("char:1:3"));
    assert_eq!(code, "bad_request", "{message}");
    assert!(message.contains("character device 1:3 is on no PCI function"), "{message}");
    let fit = ask(&d.socket, r#"{"op":"fit","request":"affinity[core]","gpus":["/dev/null"]}"#);
    assert!(error_of(&fit).1.contains("character device 1:3 is on no PCI function"), "{fit}");
}

/// `topo-exec` allocating job `job` with `request` through `socket` and running `sh -c script`.
fn topo_exec_sh(socket: &Path, job: &str, request: &str, script: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_topo-exec"));
    command
        .args(["--socket", socket.to_str().unwrap(), "--job", job, "--request", request, "--"])
        .args(["sh", "-c", script]);
    command
}

/// A job whose GPUs topod chose is told which: topo-exec sets TOPO_GPUS (and, for NVIDIA GPUs
/// whose UUID the driver lists, CUDA_VISIBLE_DEVICES; not here: the tree's GPUs have no driver,
/// so one the job inherited is removed).
#[test]
fn topo_exec_tells_the_job_the_gpus_topod_chose() {
    if !common::is_root() {
        common::skip("topo-exec allocates as root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let d = topod_on_machine(dir.path(), &root);
    let out = topo_exec_sh(
        &d.socket,
        "x",
        "affinity[core(2):gpus=2]",
        "echo TOPO_GPUS=$TOPO_GPUS; echo TOPO_NICS=$TOPO_NICS; echo CUDA=${CUDA_VISIBLE_DEVICES-unset}",
    )
    // One from the submission's environment (qsub -V) numbers GPUs the job was not given (an
    // attack finding: it reached the job).
    .env("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5")
    .output()
    .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    let complaint = String::from_utf8_lossy(&out.stderr);
    // The two GPUs behind node 1's switch, with the CPUs of node 1.
    assert!(said.contains("TOPO_GPUS=0000:86:00.0,0000:87:00.0\n"), "{said}{complaint}");
    assert!(said.contains("TOPO_NICS=ib0\n"), "the HCA behind their switch: {said}");
    assert!(said.contains("CUDA=unset"), "{said}");
    assert!(complaint.contains("CUDA_VISIBLE_DEVICES not set"), "{complaint}");
}

/// topo-exec's own lists left in the environment by an outer job are never this job's: a job
/// without GPUs does not see an outer job's TOPO_GPUS or TOPO_TASK_GPUS.
#[test]
fn topo_exec_drops_the_lists_an_outer_job_left_in_the_environment() {
    if !common::is_root() {
        common::skip("topo-exec allocates as root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let d = topod_on_machine(dir.path(), &root);
    let script = "echo GPUS=${TOPO_GPUS-unset} TASKS=${TOPO_TASK_GPUS-unset}";
    let out = topo_exec_sh(&d.socket, "y", "affinity[core(1)]", script)
        .env("TOPO_GPUS", "0000:99:00.0")
        .env("TOPO_TASK_GPUS", "0000:99:00.0")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("GPUS=unset TASKS=unset"), "{said}");
}

/// Issue 33: a reservation for a `gpus=` request, through the socket and `topoctl` as an
/// administrator makes it: it holds GPUs beside its block (`topoctl reserve` and
/// `topoctl reservations` name them), no other job is given them, the free map lists them for
/// its job only, a restart keeps them, and the job's allocate gets them.
#[test]
fn a_reservation_for_gpus_holds_them_across_a_restart_until_its_job_takes_them() {
    if !common::is_root() {
        common::skip("reserve is for root or administrators");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let d = topod_on_machine(dir.path(), &root);
    let socket = d.socket.to_str().unwrap();
    let (done, said) = topoctl(&[
        "reserve",
        "--socket",
        socket,
        "--job",
        "big",
        "--for",
        "1h",
        "affinity[core(2):gpus=2]",
    ]);
    // The two GPUs behind node 1's switch, and the block on node 1.
    assert!(done, "{said}");
    assert!(
        said.contains(
            "job big: CPUs 4-5 and GPU(s) 0000:86:00.0, 0000:87:00.0 reserved for 3600 s"
        ),
        "{said}"
    );
    let (_, listed) = topoctl(&["reservations", "--socket", socket]);
    assert!(listed.contains("(GPUs 0000:86:00.0, 0000:87:00.0)"), "{listed}");
    let free = ok(&d.socket, r#"{"op":"free_map"}"#);
    assert_eq!(free["gpus"].as_array().map(Vec::len), Some(1), "{free}");
    let reserved = free["reserved_gpus"].as_array().unwrap();
    assert_eq!(reserved.len(), 2, "{free}");
    assert!(reserved.iter().all(|g| g["job"] == "big"), "{free}");
    let other = ask(&d.socket, r#"{"op":"allocate","job":"x","request":"affinity[core:gpus=2]"}"#);
    assert!(error_of(&other).1.contains("needs 2 GPU(s) but only 1 are free"), "{other}");
    // Killed and started again: still held, and given to its job.
    drop(d);
    let args = ["--cgroup", "fake", "--topology", root.to_str().unwrap()];
    let d = common::start(dir.path(), &args, false);
    let other = ask(&d.socket, r#"{"op":"allocate","job":"x","request":"affinity[core:gpus=2]"}"#);
    assert!(error_of(&other).1.contains("needs 2 GPU(s) but only 1 are free"), "{other}");
    let big =
        ok(&d.socket, r#"{"op":"allocate","job":"big","request":"affinity[core(2):gpus=2]"}"#);
    assert_eq!(big["cpus"], "4-5", "{big}");
    let (_, jobs) = topoctl(&["jobs", "--socket", d.socket.to_str().unwrap(), "--json"]);
    let jobs: serde_json::Value = serde_json::from_str(&jobs).unwrap();
    let gpus: Vec<&str> = jobs[0]["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["pci_address"].as_str().unwrap())
        .collect();
    assert_eq!(gpus, ["0000:86:00.0", "0000:87:00.0"], "{jobs}");
    let (_, listed) = topoctl(&["reservations", "--socket", d.socket.to_str().unwrap()]);
    assert!(listed.contains("no topology reservations"), "{listed}");
    // A block whose GPUs a running job holds drains with it, and says so.
    let socket = d.socket.to_str().unwrap();
    let (done, said) = topoctl(&[
        "reserve",
        "--socket",
        socket,
        "--job",
        "later",
        "--for",
        "1h",
        "affinity[core(2):gpus=2]",
    ]);
    assert!(done, "{said}");
    assert!(
        said.contains("and GPU(s) 0000:86:00.0, 0000:87:00.0 reserved for 3600 s;")
            && said.contains("GPU(s) 0000:86:00.0, 0000:87:00.0 are busy until their jobs end"),
        "{said}"
    );
}

/// Issue 33, per-task GPUs: a job of two tasks with one GPU each is told which GPU is each
/// task's (`TOPO_TASK_GPUS`, `task_gpus` in `list`), the one nearest that task's CPUs.
#[test]
fn topo_exec_tells_each_task_its_own_gpu() {
    if !common::is_root() {
        common::skip("topo-exec allocates as root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let d = topod_on_machine(dir.path(), &root);
    // Node 1's two GPUs are card1 and card2 (86:00.0, 87:00.0); card0 is node 0's. With card1
    // held, a job of one task on each node with a GPU each: each task gets its node's GPU.
    ok(&d.socket, r#"{"op":"allocate","job":"hold","request":"affinity[core]","gpus":["card1"]}"#);
    let out = Command::new(env!("CARGO_BIN_EXE_topo-exec"))
        .args(["--socket", d.socket.to_str().unwrap(), "--job", "t"])
        .args(["--request", "affinity[core(3)*2:gpus=1]", "--"])
        .args(["sh", "-c", "echo TOPO_TASK_GPUS=$TOPO_TASK_GPUS"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    let complaint = String::from_utf8_lossy(&out.stderr);
    let listed = ok(&d.socket, r#"{"op":"list"}"#);
    let job = listed.as_array().unwrap().iter().find(|j| j["job"] == "t").unwrap().clone();
    let tasks: Vec<String> =
        job["tasks"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect();
    let task_gpus = job["task_gpus"].as_array().unwrap_or_else(|| panic!("{job}"));
    assert_eq!(tasks.len(), 2, "{job}");
    // Whatever order the placement gave the tasks, each one's GPU is in its node.
    let node_of = |cpus: &str| if cpus.starts_with(['0', '1', '2', '3']) { 0 } else { 1 };
    for (t, cpus) in tasks.iter().enumerate() {
        let want = if node_of(cpus) == 0 { "0000:18:00.0" } else { "0000:87:00.0" };
        assert_eq!(task_gpus[t], serde_json::json!([want]), "task {t} on {cpus}: {job}");
    }
    let expected: Vec<&str> = task_gpus.iter().map(|g| g[0].as_str().unwrap()).collect();
    assert!(
        said.contains(&format!("TOPO_TASK_GPUS={}\n", expected.join(";"))),
        "{said}{complaint}"
    );
    let (_, shown) = topoctl(&["jobs", "--socket", d.socket.to_str().unwrap()]);
    assert!(shown.contains("GPUs by task (nearest its CPUs) task 0: "), "{shown}");
}

/// Issue 33: GPUs of one xGMI hive (amdgpu's `xgmi_hive_info/xgmi_hive_id`) go together
/// before two behind one PCIe switch, and `topoctl show` and `topoctl jobs` name the hive.
#[test]
fn two_gpus_come_from_one_xgmi_hive_before_one_pcie_switch() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    machine(&root);
    // A third GPU on node 1, on a root port of its own, in one hive with card2 (behind the
    // switch with card1).
    pci_function(&root, "pci0000:80/0000:80:02.0", "0x060400", "1", None);
    let lone = "pci0000:80/0000:80:02.0/0000:90:00.0";
    pci_function(&root, lone, "0x030200", "1", Some("card3"));
    let card2 = "pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:10.0/0000:87:00.0";
    for gpu in [lone, card2] {
        write(&root, &format!("sys/devices/{gpu}/xgmi_hive_info/xgmi_hive_id"), "4660\n");
    }
    let (done, out) = topoctl(&["show", "--topology", root.to_str().unwrap()]);
    assert!(done, "{out}");
    let line = |address: &str| {
        out.lines().find(|l| l.contains(address)).unwrap_or_else(|| panic!("{address}: {out}"))
    };
    assert!(line("0000:90:00.0").ends_with(", xGMI hive 4660"), "{out}");
    assert!(line("0000:87:00.0").ends_with("PCIe switch 0000:81:00.0, xGMI hive 4660"), "{out}");
    assert!(!line("0000:86:00.0").contains("xGMI"), "{out}");
    let d = common::start(
        dir.path(),
        &["--cgroup", "fake", "--topology", root.to_str().unwrap()],
        false,
    );
    let socket = d.socket.to_str().unwrap();
    let (done, out) =
        topoctl(&["alloc", "--socket", socket, "--job", "pair", "affinity[core(2):gpus=2]"]);
    assert!(done, "{out}");
    let (done, out) = topoctl(&["jobs", "--socket", socket]);
    assert!(done, "{out}");
    assert!(
        out.contains("GPUs 0000:87:00.0 (card2, NUMA node 1, local to every CPU, xGMI hive 4660), 0000:90:00.0 (card3, NUMA node 1, local to every CPU, xGMI hive 4660)"),
        "the hive's pair, not the switch's: {out}"
    );
    // One GPU more: card1, the one left.
    let (done, out) =
        topoctl(&["alloc", "--socket", socket, "--job", "one", "affinity[core:gpus=1]"]);
    assert!(done, "{out}");
    let (_, out) = topoctl(&["jobs", "--socket", socket]);
    assert!(out.contains("GPUs 0000:86:00.0 (card1"), "{out}");
}

/// Issue 33: a job whose GPUs come from two NUMA nodes gets each node's share of its tasks
/// beside that node's GPUs (an attack finding: topod chose the GPUs so but then placed both
/// tasks in one node, and one task's GPU was the other node's), and `topoctl jobs` measures
/// each GPU's distance to its own tasks.
#[test]
fn a_job_whose_gpus_lie_in_two_nodes_has_a_task_beside_each() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let d = topod_on_machine(dir.path(), &root);
    // card1 held: the free GPUs are card0 (node 0) and card2 (node 1), one each.
    ok(&d.socket, r#"{"op":"allocate","job":"hold","request":"affinity[core]","gpus":["card1"]}"#);
    // Two one-core tasks would fit in either node; each goes beside its own GPU.
    ok(&d.socket, r#"{"op":"allocate","job":"t","request":"affinity[core*2:gpus=1]"}"#);
    let listed = ok(&d.socket, r#"{"op":"list"}"#);
    let job = listed.as_array().unwrap().iter().find(|j| j["job"] == "t").unwrap().clone();
    let tasks: Vec<topo_core::CpuSet> = job["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| topo_core::CpuSet::parse_list(t.as_str().unwrap()).unwrap())
        .collect();
    let node = |n: &str| topo_core::CpuSet::parse_list(n).unwrap();
    let (node0, node1) = (node("0-3"), node("4-7"));
    assert_eq!(tasks.len(), 2, "{job}");
    assert!(tasks[0].is_subset(&node0) && tasks[1].is_subset(&node1), "{job}");
    assert_eq!(job["task_gpus"], serde_json::json!([["0000:18:00.0"], ["0000:87:00.0"]]), "{job}");
    let (_, shown) = topoctl(&["jobs", "--socket", d.socket.to_str().unwrap()]);
    assert!(
        shown.contains("0000:18:00.0 (card0, NUMA node 0, local to its tasks' CPUs)"),
        "{shown}"
    );
    // The same for GPUs the batch system gave, one per task: a task beside each, and each
    // GPU listed as its task's.
    ok(&d.socket, r#"{"op":"release","job":"t"}"#);
    ok(
        &d.socket,
        r#"{"op":"allocate","job":"b","request":"affinity[core*2]","gpus":["card0","card2"]}"#,
    );
    let listed = ok(&d.socket, r#"{"op":"list"}"#);
    let job = listed.as_array().unwrap().iter().find(|j| j["job"] == "b").unwrap().clone();
    assert_eq!(job["task_gpus"], serde_json::json!([["0000:18:00.0"], ["0000:87:00.0"]]), "{job}");
    let first = topo_core::CpuSet::parse_list(job["tasks"][0].as_str().unwrap()).unwrap();
    assert!(first.is_subset(&node0), "{job}");
}
