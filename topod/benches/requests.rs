//! `cargo bench -p topod --bench requests`: what topod spends on a request before it takes any
//! lock, for the largest line a client may send (64 KiB): a `CPU_LIST` naming `0-65535` some
//! 8,000 times (refused: CPUs the host does not have), and the host's own CPUs listed to the same
//! size (accepted). The unit tests check that these are refused early and answered without the
//! host lock; how long they take is measured here (in a release build, on a quiet machine), not
//! asserted. `topoctl bench daemon --hostile` measures what two clients looping such requests
//! cost root's job starts through a running topod.

use std::hint::black_box;
use std::time::{Duration, Instant};
use topo_core::topology::{SyntheticShape, Topology};
use topod::daemon::host::prepare;

/// Runs `f` for about `budget` (at least 5 times) and prints the median and fastest run.
fn measure(name: &str, budget: Duration, mut f: impl FnMut()) {
    let mut runs = Vec::new();
    let start = Instant::now();
    while runs.len() < 5 || start.elapsed() < budget {
        let t = Instant::now();
        f();
        runs.push(t.elapsed());
    }
    runs.sort();
    println!(
        "{name}: median {:?}, fastest {:?} ({} runs)",
        runs[runs.len() / 2],
        runs[0],
        runs.len()
    );
}

fn main() {
    // A two-socket host of 384 PUs, as the emulated EPYC of the daemon's tests.
    let topo = Topology::synthetic(SyntheticShape {
        packages: 2,
        numa_per_package: 4,
        l3_per_numa: 3,
        cores_per_l3: 8,
        threads_per_core: 2,
    });
    let max = 64 * 1024 - 64;
    let repeat = |item: &str| -> String {
        let n = (max - "CPUSET[CPU_LIST=]".len()) / (item.len() + 1);
        format!("CPUSET[CPU_LIST={}]", vec![item; n].join(","))
    };
    let absent = repeat("0-65535");
    let own = repeat(&topo.pus.to_string());
    let budget = Duration::from_secs(3);
    measure("prepare, 64 KiB CPU_LIST of CPUs the host lacks (refused)", budget, || {
        assert!(prepare(&topo, black_box(&absent), None, None).is_err());
    });
    measure("prepare, 64 KiB CPU_LIST of the host's own CPUs", budget, || {
        assert!(prepare(&topo, black_box(&own), None, None).is_ok());
    });
}
