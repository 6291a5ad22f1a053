//! `topo-plugin-bench`: what a cluster-side plug-in costs per job, and per host in memory.
//!
//! Builds a cluster of `--hosts` hosts from real machines in `shared/topologies`, each loaded by
//! its own seeded job stream (the placement benchmark's), fills the host-state cache with them,
//! then times, per job of a mixed request stream, what the LSF module's matchFn + sortFn do:
//! fit-and-score on every candidate and a sort of the hosts that fit. Against it, in the same
//! run, the 2001 design: one synchronous round trip per host to a live topod (`fit`), measured
//! on `--baseline-jobs` jobs against a real `topod` started here (fake cgroup backend).
//!
//! ```sh
//! cargo build --release -p topod --bin topod
//! cargo run --release -p topo-plugin-core --features bench --bin topo-plugin-bench -- --hosts 10000
//! ```
//!
//! `--baseline-jobs 0` leaves out the live topod. The run also prints the memo's bytes per host
//! at its most shapes (64), the cache and memo together per host, and the longest time a reader
//! waited for a snapshot while a first refresh of every host (topologies included) ran.
//!
//! `--blocked-hosts PCT` gives that share of hosts a topology reservation (a NUMA node's block
//! for a waiting job, where topod would choose it, live for an hour), and `--defrag-hosts PCT`
//! that share `defrag` (a job that fits there only after moves stays a candidate, ranked after
//! the hosts where it fits): both 0 by default, as the cluster was before topod had them.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use topo_client::Client;
use topo_core::bench::{job_stream, SplitMix, TARGET_LOAD};
use topo_core::ledger::Ledger;
use topo_core::place::{self, model::HostModel, Occupancy, Strategy};
use topo_core::proto::Op;
use topo_core::reservation::{choose_block, Reservation};
use topo_core::topology::{hwloc_xml, Topology};
use topo_plugin_core::cache::{CachedTopology, FreeMap, HostCache};
use topo_plugin_core::eval::{self, Claimant, Context, Memo, Verdict};
use topo_plugin_core::fetch::{refresh_once, FetchError, Fetched, HostSource, Shared};
use topo_plugin_core::{Address, CacheConfig, Reservations, Unreachable};

/// Every host's topod, in memory: the machines' topologies and the hosts' free maps.
struct InMemory {
    topologies: Vec<Topology>,
    free: Vec<FreeMap>,
}

impl HostSource for InMemory {
    fn fetch(&self, address: &Address, cached: CachedTopology) -> Result<Fetched, FetchError> {
        let with_topology = cached.is_nothing();
        let Address::Unix(path) = address else { unreachable!("the bench uses unix:/N") };
        let i: usize = path.to_string_lossy().trim_start_matches('/').parse().unwrap_or(0);
        Ok(Fetched {
            topology: with_topology.then(|| self.topologies[i % self.topologies.len()].clone()),
            free_map: self.free[i].clone(),
        })
    }
}

/// Counts live heap bytes, for the cache's memory per host.
struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged and only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The machines the cluster is made of (a mix of sizes, as real clusters have).
const MACHINES: &[&str] = &[
    "converted-hwloc2.9/AMD-17h-Zen-2xEpyc-7451.xml",
    "converted-hwloc2.9/AMD-19h-Zen4-2xEpyc-9654.xml",
    "converted-hwloc2.9/Intel-SapphireRapids-2xXeonMax9460.xml",
    "converted-hwloc2.9/64amd64-4s2n4ca2co.xml",
    "converted-hwloc2.9/32intel64-2p8co2t+8ve.xml",
    "xml/96em64t-4n4d3ca2co-pci.xml",
];

struct Args {
    hosts: usize,
    jobs: usize,
    baseline_jobs: usize,
    blocked_pct: usize,
    defrag_pct: usize,
    topod: PathBuf,
    shared: PathBuf,
}

fn parse_args() -> Result<Args, String> {
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_default();
    let mut a = Args {
        hosts: 10_000,
        jobs: 200,
        baseline_jobs: 3,
        blocked_pct: 0,
        defrag_pct: 0,
        topod: exe_dir.join("topod"),
        shared: std::env::var_os("TOPO_SHARED_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("../shared")),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number =
            |v: String| v.parse::<usize>().map_err(|_| format!("{flag}: {v:?} is not a number"));
        match flag.as_str() {
            "--hosts" => a.hosts = number(value()?)?,
            "--jobs" => a.jobs = number(value()?)?,
            "--baseline-jobs" => a.baseline_jobs = number(value()?)?,
            "--blocked-hosts" => a.blocked_pct = number(value()?)?.min(100),
            "--defrag-hosts" => a.defrag_pct = number(value()?)?.min(100),
            "--topod" => a.topod = PathBuf::from(value()?),
            "--shared" => a.shared = PathBuf::from(value()?),
            "-h" | "--help" => {
                println!("usage: topo-plugin-bench [--hosts N] [--jobs N] [--baseline-jobs N] [--blocked-hosts PCT] [--defrag-hosts PCT] [--topod PATH] [--shared DIR]");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
    }
    if a.hosts == 0 || a.jobs == 0 {
        return Err("--hosts and --jobs must be at least 1".into());
    }
    Ok(a)
}

/// A host's free map after its own seeded stream ran for a while.
fn loaded_free_map(topo: &Topology, model: &HostModel, seed: u64) -> FreeMap {
    let mut rng = SplitMix::new(seed);
    let stream = job_stream(model, seed, 20 + rng.below(100) as usize);
    let mut ledger = Ledger::new();
    let mut running: Vec<(usize, String)> = Vec::new();
    let capacity = model.allocatable.len() as f64;
    for (i, job) in stream.iter().enumerate() {
        running.retain(|(end, id)| *end > i || ledger.release(id).is_err());
        while ledger.occupancy().held.len() as f64 > TARGET_LOAD * capacity {
            let Some((_, id)) = running.pop() else { break };
            let _ = ledger.release(&id);
        }
        if let Ok(p) = place::place(model, ledger.occupancy(), &job.request, Strategy::BestFit) {
            let id = format!("j{i}");
            if ledger.allocate(&id, &p, "").is_ok() {
                running.push((i + job.lifetime as usize, id));
            }
        }
    }
    FreeMap {
        generation: ledger.generation(),
        allocatable: topo.allowed.clone(),
        held: ledger.occupancy().held.clone(),
        fenced: ledger.occupancy().fenced.clone(),
        job_ids: ledger.jobs().map(|a| a.job.clone()).collect(),
        reservations: Vec::new(),
        defrag: false,
        moves: None,
        pools: Vec::new(),
        gpus: Vec::new(),
        reserved_gpus: Vec::new(),
        topology_id: Some(topo.fingerprint()),
    }
}

/// A NUMA node's block for a waiting job on the host of `free`, where topod would choose it,
/// lapsing an hour after `now_s`; none when the host has no room for one.
fn block_for(model: &HostModel, free: &FreeMap, host: usize, now_s: i64) -> Option<Reservation> {
    let request = topo_core::request::parse("affinity[numa]").ok()?;
    let occupancy = Occupancy { held: free.held.clone(), fenced: free.fenced.clone() };
    let (p, _) = choose_block(model, &occupancy, &[], &request, Strategy::BestFit, now_s).ok()?;
    Some(Reservation {
        job: format!("lsf-{}", 900_000 + host),
        cpus: p.cpus,
        request: request.to_string(),
        made_at: now_s,
        expires_at: now_s + 3600,
        gpus: Vec::new(),
    })
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

struct Topod {
    child: Child,
    dir: PathBuf,
}

impl Drop for Topod {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start_topod(binary: &Path, topology: &Path) -> Result<(Topod, PathBuf), String> {
    let dir = std::env::temp_dir().join(format!("topo-plugin-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let socket = dir.join("topod.sock");
    let child = Command::new(binary)
        .args(["--cgroup", "fake", "--socket"])
        .arg(&socket)
        .arg("--state-dir")
        .arg(&dir)
        .arg("--topology")
        .arg(topology)
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| {
            format!(
                "cannot start {} ({e}); build it first: cargo build --release -p topod --bin topod",
                binary.display()
            )
        })?;
    let t = Topod { child, dir };
    for _ in 0..200 {
        if Client::connect(&socket).is_ok() {
            return Ok((t, socket));
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    Err("topod did not open its socket within 5 s".into())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("topo-plugin-bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args = parse_args()?;
    let topo_dir = args.shared.join("topologies");
    let machines: Vec<(Topology, HostModel)> = MACHINES
        .iter()
        .map(|m| {
            let t = hwloc_xml::read_file(&topo_dir.join(m)).map_err(|e| format!("{m}: {e}"))?;
            let model = HostModel::new(&t, &Default::default()).map_err(|e| format!("{m}: {e}"))?;
            Ok((t, model))
        })
        .collect::<Result<_, String>>()?;

    // The cluster: loaded hosts, in the cache as the refresher would leave it. The free maps
    // (kept for the refresh measurement below) are made before the cache is measured and each
    // is cloned into it, so the heap's growth is the cache's own.
    // Spread evenly: every (100 / PCT)-th host, counted in hundredths.
    let every = |pct: usize, i: usize| (i * pct) / 100 != ((i + 1) * pct) / 100;
    let now_s = eval::epoch_now();
    let free_maps: Vec<FreeMap> = (0..args.hosts)
        .map(|i| {
            let (t, m) = &machines[i % machines.len()];
            let mut free = loaded_free_map(t, m, i as u64 + 1);
            if every(args.blocked_pct, i) {
                free.reservations.extend(block_for(m, &free, i, now_s));
            }
            free.defrag = every(args.defrag_pct, i);
            free
        })
        .collect();
    let blocked = free_maps.iter().filter(|f| !f.reservations.is_empty()).count();
    let defragmenting = free_maps.iter().filter(|f| f.defrag).count();
    let before = LIVE.load(Ordering::Relaxed);
    let mut cache = HostCache::new();
    let at = Instant::now();
    for (i, free) in free_maps.iter().enumerate() {
        let (t, _) = &machines[i % machines.len()];
        let free = free.clone();
        let name = format!("node{i:05}.cluster.example");
        let id = cache.add(&name, Address::Tcp(format!("{name}:7979")));
        cache.update(id, Some(t), free, at)?;
    }
    let cache_bytes = LIVE.load(Ordering::Relaxed) - before;
    let models = cache.model_count();

    // The jobs: a mixed stream of requests (sizes and shapes repeat, as in real queues).
    let mut requests = Vec::new();
    for (k, (_, m)) in machines.iter().enumerate() {
        for j in job_stream(m, 1000 + k as u64, args.jobs.div_ceil(machines.len())) {
            requests.push(j.request);
        }
    }
    requests.truncate(args.jobs);
    // Interleaved, so that consecutive jobs rarely share a shape.
    let mut rng = SplitMix::new(7);
    for i in (1..requests.len()).rev() {
        requests.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let keys: Vec<String> =
        requests.iter().map(|r| format!("{r}#{}", r.tasks.unwrap_or(1))).collect();
    let distinct = keys.iter().collect::<std::collections::HashSet<_>>().len();
    let candidates: Vec<u32> = (0..args.hosts as u32).collect();

    // A scheduling session as the LSF module runs it: per job, matchFn + sortFn (fit-and-score
    // on every candidate, through the memo; a sort of the hosts that fit), then the job is
    // dispatched to the best host, whose reservation changes that host for the jobs after it.
    let mut reservations = Reservations::new();
    let mut memo = Memo::new();
    let mut per_job_ms = Vec::with_capacity(requests.len());
    let mut first_of_shape_ms = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut kept_total = 0usize;
    let (mut own_block_total, mut after_moves_total) = (0usize, 0usize);
    for (i, (r, key)) in requests.iter().zip(&keys).enumerate() {
        let ctx = Context {
            cache: &cache,
            reservations: &reservations,
            now: Instant::now(),
            epoch_s: eval::epoch_now(),
            stale_after: Duration::from_secs(3600),
            unreachable: Unreachable::Open,
        };
        let start = Instant::now();
        let scores = memo.scores(&ctx, key, r, &candidates);
        let mut kept: Vec<(u64, u32)> =
            scores.iter().zip(&candidates).filter_map(|(s, &h)| s.map(|s| (s, h))).collect();
        kept.sort_unstable();
        let ms = start.elapsed().as_secs_f64() * 1e3;
        per_job_ms.push(ms);
        if seen.insert(key.clone()) {
            first_of_shape_ms.push(ms);
        }
        kept_total += kept.len();
        own_block_total += kept
            .iter()
            .filter(|k| (eval::IN_PEERS_BLOCK_RANK..eval::AFTER_MOVES_RANK).contains(&k.0))
            .count();
        after_moves_total += kept
            .iter()
            .filter(|k| (eval::AFTER_MOVES_RANK..eval::UNKNOWN_SCORE).contains(&k.0))
            .count();
        let dispatch = kept.first().and_then(|&(_, h)| {
            match eval::evaluate(&ctx, h, r, Claimant::peers_of(r)) {
                Verdict::Fits { cpus, .. } | Verdict::InPeersBlock { cpus, .. } => Some((h, cpus)),
                Verdict::AfterMoves(_) | Verdict::InPool(_) | Verdict::NoFit(_) => None,
            }
        });
        if let Some((h, cpus)) = dispatch {
            reservations.reserve(&format!("job{i}"), h, cpus, Instant::now());
        }
    }
    per_job_ms.sort_by(f64::total_cmp);
    first_of_shape_ms.sort_by(f64::total_cmp);

    // The memo at its most shapes, measured on the heap (allocator overhead aside).
    let memo_64_bytes = {
        let ctx = Context {
            cache: &cache,
            reservations: &reservations,
            now: Instant::now(),
            epoch_s: eval::epoch_now(),
            stale_after: Duration::from_secs(3600),
            unreachable: Unreachable::Open,
        };
        let before = LIVE.load(Ordering::Relaxed);
        let mut memo = Memo::new();
        let small = topo_core::request::parse("affinity[core(1)]").map_err(|e| e.to_string())?;
        for n in 1..=eval::MEMO_SHAPES as u32 {
            let mut r = small.clone();
            r.tasks = Some(n);
            memo.scores(&ctx, &format!("{r}#{n}"), &r, &candidates);
        }
        let bytes = LIVE.load(Ordering::Relaxed) - before;
        drop(memo);
        bytes
    };

    // Readers during a first refresh: every host's topology and free map arriving through the
    // refresher while a reader takes snapshots as the scheduler's callbacks do.
    let shared = Shared::default();
    {
        let mut c = shared.cache.write().unwrap_or_else(|e| e.into_inner());
        for i in 0..args.hosts {
            c.add(&format!("node{i:05}"), Address::Unix(format!("/{i}").into()));
        }
    }
    let source =
        InMemory { topologies: machines.iter().map(|m| m.0.clone()).collect(), free: free_maps };
    let config = CacheConfig { address_template: String::new(), ..CacheConfig::default() };
    let done = std::sync::atomic::AtomicBool::new(false);
    let (longest_wait, loads, refresh_s) = std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let (mut longest, mut loads) = (Duration::ZERO, 0u64);
            while !done.load(Ordering::Relaxed) {
                let t = Instant::now();
                let snapshot = shared.cache.load();
                longest = longest.max(t.elapsed());
                loads += 1;
                std::hint::black_box(snapshot.len());
                drop(snapshot);
                std::thread::sleep(Duration::from_micros(100));
            }
            (longest, loads)
        });
        let t = Instant::now();
        refresh_once(&shared, &source, &config);
        let took = t.elapsed().as_secs_f64();
        done.store(true, Ordering::Relaxed);
        let (longest, loads) = reader.join().unwrap_or_default();
        (longest, loads, took)
    });

    // The 2001 design: one synchronous round trip per host to a live topod.
    let mut baseline_ms = Vec::new();
    let _topod = if args.baseline_jobs > 0 {
        Some(start_topod(&args.topod, &topo_dir.join(MACHINES[0]))?)
    } else {
        None
    };
    for r in requests.iter().take(args.baseline_jobs) {
        let Some((_, socket)) = &_topod else { break };
        let text = r.to_string();
        let start = Instant::now();
        for _ in 0..args.hosts {
            let mut c = Client::connect(socket).map_err(|e| e.to_string())?;
            let _ = c.call(Op::Fit(topo_core::proto::FitArgs::new(text.clone())));
        }
        baseline_ms.push(start.elapsed().as_secs_f64() * 1e3);
    }
    baseline_ms.sort_by(f64::total_cmp);

    let p50 = percentile(&per_job_ms, 0.5);
    println!("cluster: {} hosts of {} machine types ({} distinct models in the cache), each loaded by its own job stream; {} with a topology reservation, {} with defrag", args.hosts, machines.len(), models, blocked, defragmenting);
    println!(
        "jobs: {} mixed requests; on average {:.0} hosts are candidates for each",
        per_job_ms.len(),
        kept_total as f64 / per_job_ms.len() as f64
    );
    if blocked + defragmenting > 0 {
        println!(
            "  of which on average {:.1} only in a block of their request's shape, {:.0} only after moves",
            own_block_total as f64 / per_job_ms.len() as f64,
            after_moves_total as f64 / per_job_ms.len() as f64
        );
    }
    println!("match + sort per job, session of {} jobs ({} distinct shapes): p50 {:.3} ms  p90 {:.3} ms  p99 {:.3} ms  max {:.3} ms", per_job_ms.len(), distinct, p50, percentile(&per_job_ms, 0.9), percentile(&per_job_ms, 0.99), per_job_ms[per_job_ms.len() - 1]);
    println!(
        "  first job of each shape (nothing remembered): p50 {:.3} ms  max {:.3} ms",
        percentile(&first_of_shape_ms, 0.5),
        first_of_shape_ms[first_of_shape_ms.len() - 1]
    );
    if !baseline_ms.is_empty() {
        let base50 = percentile(&baseline_ms, 0.5);
        println!(
            "one round trip per host to a live topod (2001 design), {} jobs: p50 {:.1} ms per job",
            baseline_ms.len(),
            base50
        );
        println!("speed-up at p50: {:.0}x", base50 / p50);
    }
    println!(
        "cache memory: {} bytes in all, {:.0} bytes per host (models shared: {} for {} hosts)",
        cache_bytes,
        cache_bytes as f64 / args.hosts as f64,
        models,
        args.hosts
    );
    println!(
        "memo: {} bytes for {} shapes ({} bytes per host per shape remembered)",
        memo.bytes(),
        distinct.min(eval::MEMO_SHAPES),
        eval::MEMO_BYTES_PER_SHAPE_AND_HOST
    );
    println!(
        "memo at {} shapes: {} bytes per host; cache + memo: {:.0} bytes per host",
        eval::MEMO_SHAPES,
        memo_64_bytes / args.hosts,
        (cache_bytes + memo_64_bytes) as f64 / args.hosts as f64
    );
    println!(
        "first refresh of {} hosts (topologies and free maps, in memory): {:.2} s; longest wait of a reader meanwhile: {:?} over {} snapshots",
        args.hosts, refresh_s, longest_wait, loads
    );
    Ok(())
}
