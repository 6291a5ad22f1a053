//! `cargo bench -p topo-plugin-core --bench names`: what the cluster-side cache spends on host
//! names and on dispatches to hosts it does not know yet, at cluster sizes. The unit tests count
//! the work (a few name checks per lookup, one pending entry per dispatch); how long it takes is
//! measured here (in a release build, on a quiet machine), not asserted.

use std::hint::black_box;
use std::time::{Duration, Instant};
use topo_plugin_core::{Address, HostCache, Reservations};

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
    let hosts = 10_000;
    let mut cache = HostCache::new();
    for i in 0..hosts {
        let name = format!("node{i:05}.cluster.example");
        cache.add(&name, Address::Tcp(format!("{name}:7979")));
    }
    let short: Vec<String> = (0..hosts).map(|i| format!("node{i:05}")).collect();
    let unknown: Vec<String> = (0..2_000).map(|i| format!("other{i}")).collect();
    let budget = Duration::from_secs(3);
    // Configured by FQDN, offered by the scheduler under the short name; and names of no host.
    measure("12,000 lookups over 10,000 hosts (10,000 short names, 2,000 unknown)", budget, || {
        for name in short.iter().chain(&unknown) {
            black_box(cache.lookup(black_box(name)));
        }
    });
    // One job dispatched to 40,000 hosts whose state has not come yet: each is kept pending.
    let request = {
        let mut r = topo_core::request::parse("affinity[core(1)]").unwrap();
        r.tasks.get_or_insert(1);
        r
    };
    let empty = HostCache::new();
    let targets: Vec<String> = (0..40_000).map(|i| format!("h{i}")).collect();
    measure("40,000 pending dispatches of one job, then its release", budget, || {
        let mut resv = Reservations::new();
        for host in &targets {
            resv.dispatch(&empty, "lsf-1", host, &request, Instant::now());
        }
        assert!(resv.release("lsf-1"));
    });
}
