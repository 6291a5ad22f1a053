//! The cache, reservations and evaluation together, fed by a fake source built from real
//! machines in `shared/topologies`.

use crate::cache::{CachedTopology, FreeMap};
use crate::eval::{self, Claimant, Context, NoFit, Verdict};
use crate::fetch::{refresh_once, FetchError, Fetched, HostSource, Shared};
use crate::{Address, CacheConfig, Unreachable};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use topo_core::cpuset::CpuSet;
use topo_core::request::{self, Request};
use topo_core::topology::{hwloc_xml, Topology};

/// What `evaluate` needs: the cache and reservations under test, `config`'s staleness limit.
fn context<'a>(
    cache: &'a crate::HostCache,
    reservations: &'a crate::Reservations,
    config: &CacheConfig,
    now: Instant,
    unreachable: Unreachable,
) -> Context<'a> {
    Context {
        cache,
        reservations,
        now,
        epoch_s: eval::epoch_now(),
        stale_after: config.stale_after(),
        unreachable,
    }
}

fn shared_topology(name: &str) -> Topology {
    let dir = std::env::var_os("TOPO_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared"));
    hwloc_xml::read_file(&dir.join("topologies/converted-hwloc2.9").join(name)).unwrap()
}

/// Hosts in memory: a topology and a free map per address; addresses not listed fail.
#[derive(Default)]
struct FakeSource {
    hosts: Mutex<HashMap<String, (Topology, FreeMap)>>,
    calls: Mutex<Vec<(String, bool)>>,
}

impl FakeSource {
    fn set(&self, address: &str, topo: &Topology, held: &str, jobs: &[&str], generation: u64) {
        let free = FreeMap {
            generation,
            allocatable: topo.allowed.clone(),
            held: CpuSet::parse_list(held).unwrap(),
            fenced: CpuSet::new(),
            job_ids: jobs.iter().map(|j| j.to_string()).collect(),
            reservations: Vec::new(),
            defrag: false,
            moves: None,
            pools: Vec::new(),
            gpus: Vec::new(),
            reserved_gpus: Vec::new(),
            topology_id: None,
        };
        self.hosts.lock().unwrap().insert(address.to_string(), (topo.clone(), free));
    }
}

impl FakeSource {
    /// `address` reports `free` exactly (blocks and `defrag` included).
    fn set_map(&self, address: &str, topo: &Topology, free: FreeMap) {
        self.hosts.lock().unwrap().insert(address.to_string(), (topo.clone(), free));
    }
}

impl HostSource for FakeSource {
    fn fetch(&self, address: &Address, cached: CachedTopology) -> Result<Fetched, FetchError> {
        let with_topology = cached.is_nothing();
        self.calls.lock().unwrap().push((address.to_string(), with_topology));
        let hosts = self.hosts.lock().unwrap();
        let (topo, free) = hosts.get(&address.to_string()).ok_or_else(|| FetchError {
            address: address.to_string(),
            message: "connection refused".into(),
        })?;
        Ok(Fetched { topology: with_topology.then(|| topo.clone()), free_map: free.clone() })
    }
}

fn with_tasks(text: &str, tasks: u32) -> Request {
    let mut r = request::parse(text).unwrap();
    r.tasks.get_or_insert(tasks);
    r
}

fn setup(config: &CacheConfig) -> (Shared, FakeSource) {
    let shared = Shared::default();
    let source = FakeSource::default();
    let zen = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    let knl = shared_topology("Intel-KnightsLanding-XeonPhi-7210.xml");
    source.set("unix:/a.sock", &zen, "", &[], 1);
    source.set("unix:/b.sock", &zen, "0-23,48-71", &["lsf-1"], 7);
    source.set("unix:/c.sock", &knl, "", &[], 1);
    {
        let mut cache = shared.cache.write().unwrap();
        for (name, addr) in
            [("a", "/a.sock"), ("b", "/b.sock"), ("c", "/c.sock"), ("down", "/down.sock")]
        {
            cache.add(name, Address::Unix(addr.into()));
        }
    }
    let (ok, failed) = refresh_once(&shared, &source, config);
    assert_eq!((ok, failed), (3, 1));
    (shared, source)
}

#[test]
fn hosts_share_models_and_fetch_their_topology_once() {
    let config = CacheConfig::default();
    let (shared, source) = setup(&config);
    assert_eq!(shared.cache.load().model_count(), 2, "two Zen hosts share one model");
    source.calls.lock().unwrap().clear();
    refresh_once(&shared, &source, &config);
    let calls = source.calls.lock().unwrap().clone();
    assert!(
        calls.iter().any(|(a, t)| a == "unix:/down.sock" && *t),
        "the host never reached is still asked for its topology"
    );
    assert!(calls.iter().filter(|(a, _)| a != "unix:/down.sock").all(|(_, t)| !t), "{calls:?}");
    let cache = shared.cache.load();
    assert_eq!(cache.lookup("b.cluster.example"), cache.lookup("b"), "short names match");
    assert!(cache
        .host(cache.lookup("down").unwrap())
        .last_error
        .as_deref()
        .unwrap()
        .contains("connection refused"));
}

#[test]
fn fit_follows_the_free_map_and_the_policy() {
    let config = CacheConfig::default();
    let (shared, _source) = setup(&config);
    let cache = shared.cache.load();
    let resv = shared.reservations.lock().unwrap();
    let mut ctx = context(&cache, &resv, &config, Instant::now(), Unreachable::Open);
    let id = |n| cache.lookup(n).unwrap();
    // 24 cores in one package: fits the empty Zen host, not the one whose first package is held.
    let req = with_tasks("affinity[core(24,same=socket)]", 1);
    assert!(matches!(eval::evaluate(&ctx, id("a"), &req, Claimant::Anyone), Verdict::Fits { .. }));
    match eval::evaluate(
        &ctx,
        id("b"),
        &with_tasks("affinity[core(24,same=socket)]", 3),
        Claimant::Anyone,
    ) {
        Verdict::NoFit(NoFit::TooFewCpus { free: 48, needed: 72 }) => {}
        other => panic!("{other:?}"),
    }
    assert!(matches!(eval::evaluate(&ctx, id("b"), &req, Claimant::Anyone), Verdict::Fits { .. }));
    match eval::evaluate(
        &ctx,
        id("b"),
        &with_tasks("affinity[core(24,same=socket)]", 2),
        Claimant::Anyone,
    ) {
        Verdict::NoFit(NoFit::Placement(_)) => {}
        other => panic!("only one package is free on b: {other:?}"),
    }
    // The unreachable host: kept last when fail-open, removed with the reason when fail-closed.
    assert_eq!(
        eval::evaluate(&ctx, id("down"), &req, Claimant::Anyone),
        Verdict::Fits { score: eval::UNKNOWN_SCORE, cpus: CpuSet::new(), claims_block: false }
    );
    ctx.unreachable = Unreachable::Closed;
    match eval::evaluate(&ctx, id("down"), &req, Claimant::Anyone) {
        Verdict::NoFit(why) => assert!(why.to_string().contains("connection refused"), "{why}"),
        other => panic!("{other:?}"),
    }
    // Stale: an answer older than stale_after counts as unknown.
    ctx.now += config.stale_after() + Duration::from_secs(1);
    assert!(matches!(
        eval::evaluate(&ctx, id("a"), &req, Claimant::Anyone),
        Verdict::NoFit(NoFit::Unknown(_))
    ));
    ctx.unreachable = Unreachable::Open;
    // The best host for a small request is the busy one (best fit packs), and both beat unknown.
    ctx.now = Instant::now();
    let small = with_tasks("affinity[core(2)]", 1);
    let score = |h| match eval::evaluate(&ctx, id(h), &small, Claimant::Anyone) {
        Verdict::Fits { score, .. } => score,
        other => panic!("{other:?}"),
    };
    assert!(score("a") < eval::UNKNOWN_SCORE && score("b") < eval::UNKNOWN_SCORE);
    assert_eq!(eval::max_tasks(&ctx, id("b"), &req, Claimant::Anyone, 4), 1);
    assert_eq!(eval::max_tasks(&ctx, id("a"), &req, Claimant::Anyone, 4), 2);
}

#[test]
fn reservations_stop_double_counting_until_the_host_reports_the_job() {
    let config = CacheConfig::default();
    let (shared, source) = setup(&config);
    let now = Instant::now();
    let half = with_tasks("affinity[core(24,same=socket)]", 1);
    let a = shared.cache.load().lookup("a").unwrap();
    // Two jobs each take one package of host a.
    for job in ["lsf-10", "lsf-11"] {
        let cache = shared.cache.load();
        let mut resv = shared.reservations.lock().unwrap();
        let ctx = context(&cache, &resv, &config, now, Unreachable::Open);
        let Verdict::Fits { cpus, .. } = eval::evaluate(&ctx, a, &half, Claimant::Anyone) else {
            panic!("{job} should fit")
        };
        resv.reserve(job, a, cpus, now);
    }
    {
        let cache = shared.cache.load();
        let resv = shared.reservations.lock().unwrap();
        let ctx = context(&cache, &resv, &config, now, Unreachable::Open);
        assert!(
            matches!(
                eval::evaluate(&ctx, a, &with_tasks("affinity[core(1)]", 1), Claimant::Anyone),
                Verdict::NoFit(_)
            ),
            "both packages are reserved"
        );
        let r10 = &resv.of_job("lsf-10")[0].cpus;
        let r11 = &resv.of_job("lsf-11")[0].cpus;
        assert!(!r10.intersects(r11), "{r10} and {r11} overlap");
    }
    // Host a now reports lsf-10 (holding what it was reserved); lsf-11 is deallocated.
    let held = shared.reservations.lock().unwrap().of_job("lsf-10")[0].cpus.to_string();
    let zen = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    source.set("unix:/a.sock", &zen, &held, &["lsf-10"], 2);
    assert!(shared.reservations.lock().unwrap().release("lsf-11"));
    refresh_once(&shared, &source, &config);
    let resv = shared.reservations.lock().unwrap();
    assert!(resv.is_empty(), "confirmed reservations are dropped");
    let cache = shared.cache.load();
    let ctx = context(&cache, &resv, &config, now, Unreachable::Open);
    assert!(
        matches!(eval::evaluate(&ctx, a, &half, Claimant::Anyone), Verdict::Fits { .. }),
        "one package is free again"
    );
    assert!(matches!(
        eval::evaluate(&ctx, a, &with_tasks("affinity[core(24,same=socket)]", 2), Claimant::Anyone),
        Verdict::NoFit(_)
    ));
}

#[test]
fn unconfirmed_reservations_expire() {
    let config = CacheConfig { reservation_ttl_s: 1, ..CacheConfig::default() };
    let (shared, _source) = setup(&config);
    let mut resv = shared.reservations.lock().unwrap();
    let long_ago = Instant::now() - Duration::from_secs(5);
    resv.reserve("lsf-99", 0, CpuSet::parse_list("0-3").unwrap(), long_ago);
    assert_eq!(resv.reconcile(&shared.cache.load(), Instant::now(), Duration::from_secs(1)), 1);
    assert!(resv.on_host(0).is_none());
}

#[test]
fn discovered_hosts_get_the_template_address() {
    let config =
        CacheConfig { address_template: "unix:/{host}.sock".into(), ..CacheConfig::default() };
    let (shared, _source) = setup(&config);
    shared.discovered.lock().unwrap().insert("c2".into());
    refresh_once(&shared, &_source, &config);
    let cache = shared.cache.load();
    let id = cache.lookup("c2").expect("added");
    assert_eq!(cache.host(id).address, Address::Unix("/c2.sock".into()));
}

#[test]
fn the_memo_agrees_with_evaluate_and_forgets_changed_hosts() {
    let config = CacheConfig::default();
    let (shared, _source) = setup(&config);
    let cache = shared.cache.load();
    let mut resv = crate::Reservations::new();
    let mut memo = eval::Memo::new();
    let hosts: Vec<u32> = (0..cache.len() as u32).collect();
    let req = with_tasks("affinity[core(24,same=socket)]", 1);
    let direct = |resv: &crate::Reservations| {
        let ctx = context(&cache, resv, &config, Instant::now(), Unreachable::Open);
        hosts
            .iter()
            .map(|&h| eval::evaluate(&ctx, h, &req, Claimant::peers_of(&req)).rank())
            .collect::<Vec<_>>()
    };
    let via_memo = |memo: &mut eval::Memo, resv: &crate::Reservations| {
        let ctx = context(&cache, resv, &config, Instant::now(), Unreachable::Open);
        memo.scores(&ctx, "k", &req, &hosts)
    };
    assert_eq!(via_memo(&mut memo, &resv), direct(&resv));
    assert_eq!(via_memo(&mut memo, &resv), direct(&resv), "remembered scores are the same");
    // Host b's free package is reserved: the memo must not answer from before.
    let b = cache.lookup("b").unwrap();
    let before = via_memo(&mut memo, &resv)[b as usize];
    assert!(before.is_some());
    resv.reserve("lsf-1", b, CpuSet::parse_list("24-47,72-95").unwrap(), Instant::now());
    let after = via_memo(&mut memo, &resv);
    assert_eq!(after[b as usize], None, "b is full once its free package is reserved");
    assert_eq!(after, direct(&resv));
}

#[test]
fn a_change_seen_by_one_shape_is_forgotten_by_every_shape() {
    let config = CacheConfig::default();
    let (shared, _source) = setup(&config);
    let cache = shared.cache.load();
    let mut resv = crate::Reservations::new();
    let mut memo = eval::Memo::new();
    // Every host twice over, as if two LSF hosts shared each topod: equal states, one placement.
    let hosts: Vec<u32> = (0..cache.len() as u32).chain(0..cache.len() as u32).collect();
    let socket = with_tasks("affinity[core(24,same=socket)]", 1);
    let core = with_tasks("affinity[core(1)]", 40);
    let run = |memo: &mut eval::Memo, resv: &crate::Reservations, key: &str, req: &Request| {
        let ctx = context(&cache, resv, &config, Instant::now(), Unreachable::Open);
        let direct: Vec<Option<u64>> = hosts
            .iter()
            .map(|&h| eval::evaluate(&ctx, h, req, Claimant::peers_of(req)).rank())
            .collect();
        (memo.scores(&ctx, key, req, &hosts), direct)
    };
    let (m, d) = run(&mut memo, &resv, "socket", &socket);
    assert_eq!(m, d);
    let (m, d) = run(&mut memo, &resv, "core40", &core);
    assert_eq!(m, d);
    let a = cache.lookup("a").unwrap();
    assert!(m[a as usize].is_some(), "40 cores fit idle a before the reservation");
    resv.reserve("lsf-1", a, CpuSet::parse_list("0-23,48-71").unwrap(), Instant::now());
    // The first shape sees a changed; the second must not answer from before either.
    let (m, d) = run(&mut memo, &resv, "socket", &socket);
    assert_eq!(m, d);
    let (m, d) = run(&mut memo, &resv, "core40", &core);
    assert_eq!(m[a as usize], None, "40 cores no longer fit a");
    assert_eq!(m, d);
}

#[test]
fn reads_the_protocols_free_map() {
    let sent = topo_core::proto::reply::FreeMap {
        generation: 7,
        allocatable: CpuSet::parse_list("0-15").unwrap(),
        held: CpuSet::parse_list("0-3").unwrap(),
        fenced: CpuSet::parse_list("4").unwrap(),
        jobs: 1,
        job_ids: vec!["lsf-1".into()],
        free: Default::default(),
        gang: None,
        reservations: vec![block("lsf-2", "8-11", "affinity[core(4)]", 1_000)],
        defrag: true,
        // Their CPUs are for the jobs they admit (eval: "Prime-time pools").
        pools: vec![topo_core::proto::reply::PoolStatus {
            name: "day".into(),
            cpus: CpuSet::parse_list("12-15").unwrap(),
            open: true,
            queues: vec!["interactive".into()],
            users: Vec::new(),
            named: false,
        }],
        moves: Some(halves_moves([EXPIRES, i64::MAX], true)),
        gpus: vec![topo_core::gpus::GpuSite {
            numa: Some(CpuSet::parse_list("8-15").unwrap()),
            socket: Some(CpuSet::parse_list("0-15").unwrap()),
            switch: Some("0000:81:00.0".into()),
            fabric: None,
        }],
        reserved_gpus: vec![topo_core::proto::reply::ReservedGpu {
            job: "lsf-2".into(),
            site: topo_core::gpus::GpuSite {
                numa: Some(CpuSet::parse_list("8-15").unwrap()),
                socket: Some(CpuSet::parse_list("0-15").unwrap()),
                switch: None,
                fabric: None,
            },
        }],
        held_gpus: Vec::new(),
        topology_id: Some(0x0123_4567_89ab_cdef),
    };
    let kept: FreeMap = serde_json::from_value(serde_json::to_value(&sent).unwrap()).unwrap();
    assert_eq!(kept.moves, sent.moves);
    assert_eq!(kept.topology_id, sent.topology_id);
    assert_eq!(kept.gpus, sent.gpus);
    assert_eq!(kept.reserved_gpus, sent.reserved_gpus);
    assert_eq!(kept.pools, sent.pools);
    assert_eq!(
        (kept.generation, kept.held, kept.fenced, kept.job_ids),
        (7, sent.held.clone(), sent.fenced.clone(), sent.job_ids.clone())
    );
    assert_eq!(kept.allocatable, sent.allocatable);
    assert_eq!((kept.reservations, kept.defrag), (sent.reservations.clone(), true));
    // Neither is sent when there is none (nor by a topod from before them).
    let none = topo_core::proto::reply::FreeMap {
        reservations: Vec::new(),
        defrag: false,
        moves: None,
        ..sent.clone()
    };
    let text = serde_json::to_value(&none).unwrap();
    assert!(
        text.get("reservations").is_none()
            && text.get("defrag").is_none()
            && text.get("moves").is_none(),
        "{text}"
    );
    let kept: FreeMap = serde_json::from_value(text).unwrap();
    assert!(kept.reservations.is_empty() && !kept.defrag && kept.moves.is_none());
}

// ---- The stand-in's defects (issues 2, 3, 4): each of these failed before the fix. ----

/// A source of many hosts: `hung` addresses sleep for `hang` and then fail (a topod that
/// accepts and never answers, cut by the time-out); every other address answers at once.
struct ManyHosts {
    topology: Topology,
    free: FreeMap,
    hang: Duration,
    hung: std::collections::HashSet<String>,
}

impl HostSource for ManyHosts {
    fn fetch(&self, address: &Address, cached: CachedTopology) -> Result<Fetched, FetchError> {
        let with_topology = cached.is_nothing();
        let a = address.to_string();
        if self.hung.contains(&a) {
            std::thread::sleep(self.hang);
            return Err(FetchError { address: a, message: "timed out".into() });
        }
        Ok(Fetched {
            topology: with_topology.then(|| self.topology.clone()),
            free_map: self.free.clone(),
        })
    }
}

fn idle_free_map(topo: &Topology) -> FreeMap {
    FreeMap {
        generation: 1,
        allocatable: topo.allowed.clone(),
        held: CpuSet::new(),
        fenced: CpuSet::new(),
        job_ids: Vec::new(),
        reservations: Vec::new(),
        defrag: false,
        moves: None,
        pools: Vec::new(),
        gpus: Vec::new(),
        reserved_gpus: Vec::new(),
        topology_id: None,
    }
}

#[test]
fn hung_hosts_do_not_make_healthy_hosts_stale() {
    let (healthy, hung) = (2000, 500);
    let topo = shared_topology("Intel-KnightsLanding-XeonPhi-7210.xml");
    let source = ManyHosts {
        free: idle_free_map(&topo),
        topology: topo,
        hang: Duration::from_millis(400),
        hung: (0..hung).map(|i| format!("unix:/hung{i}.sock")).collect(),
    };
    let config = CacheConfig {
        workers: 16,
        timeout_ms: 400,
        refresh_interval_ms: 1000,
        stale_after_ms: 5000,
        address_template: String::new(),
        // This test times the refresher itself, while the other tests run beside it at the
        // normal priority.
        refresh_nice: 0,
        ..CacheConfig::default()
    };
    let shared = std::sync::Arc::new(Shared::default());
    {
        let mut cache = shared.cache.write().unwrap();
        // Hung hosts first and interleaved, the worst order for a round-based refresher.
        for i in 0..healthy.max(hung) {
            if i < hung {
                cache.add(&format!("hung{i}"), Address::Unix(format!("/hung{i}.sock").into()));
            }
            if i < healthy {
                cache.add(&format!("ok{i}"), Address::Unix(format!("/ok{i}.sock").into()));
            }
        }
    }
    let refresher =
        crate::fetch::Refresher::start(shared.clone(), std::sync::Arc::new(source), config.clone())
            .unwrap();
    let usable = |shared: &Shared| {
        let cache = shared.cache.load();
        let now = Instant::now();
        (0..healthy)
            .filter(|i| {
                let id = cache.lookup(&format!("ok{i}")).unwrap();
                cache.usable(id, now, config.stale_after()).is_ok()
            })
            .count()
    };
    let start = Instant::now();
    while usable(&shared) < healthy {
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "healthy hosts still unknown after 15 s: {} of {healthy} usable",
            usable(&shared)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Twice the stale limit: no healthy host ever goes stale meanwhile (a round-based refresher
    // needs 500 x 0.4 s / 16 workers = 12.5 s per round here). The limit is 5 refresh intervals,
    // so that a machine loaded by other tests (load averages of 7 to 10 made a 3 s limit fail
    // once) does not fail it, while the round-based refresher still would.
    let watch = Instant::now();
    while watch.elapsed() < Duration::from_secs(10) {
        let n = usable(&shared);
        assert_eq!(n, healthy, "healthy hosts went stale at {:?}", watch.elapsed());
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(refresher);
}

#[test]
fn name_lookups_do_not_scan() {
    let mut cache = crate::HostCache::new();
    for i in 0..10_000 {
        let name = format!("node{i:05}.cluster.example");
        cache.add(&name, Address::Tcp(format!("{name}:7979")));
    }
    let checked = || crate::cache::NAMES_CHECKED.with(std::cell::Cell::get);
    let before = checked();
    for round in 0..3 {
        for i in 0..10_000 {
            // Configured by FQDN, offered by the scheduler under the short name.
            assert_eq!(cache.lookup(&format!("node{i:05}")), Some(i), "round {round}");
        }
        for i in 0..2_000 {
            assert_eq!(cache.lookup(&format!("other{i}")), None);
        }
    }
    // Counted, not timed: a hash probe checks the one host it finds against the name, and a
    // lookup probes at most three names (as given, lower-case, short). A scan per name would
    // check 10,000 hosts per lookup, 3.6e8 in all. What lookups cost is
    // `cargo bench -p topo-plugin-core --bench names`.
    let per_lookup = (checked() - before) as f64 / 36_000.0;
    assert!(per_lookup <= 3.0, "{per_lookup} host names checked per lookup");
}

#[test]
fn a_refresh_that_changed_nothing_keeps_the_memo() {
    let config = CacheConfig::default();
    let (shared, source) = setup(&config);
    let versions = |shared: &Shared| {
        let cache = shared.cache.load();
        cache.hosts().map(|(_, h)| h.version).collect::<Vec<_>>()
    };
    let before = versions(&shared);
    refresh_once(&shared, &source, &config);
    assert_eq!(versions(&shared), before, "nothing changed, so the memo stays valid");
    // A ledger whose generation moved on but came back to the same CPUs and jobs (a job
    // allocated and released between two refreshes) is the same state for placements.
    let zen0 = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    source.set("unix:/b.sock", &zen0, "0-23,48-71", &["lsf-1"], 9);
    refresh_once(&shared, &source, &config);
    assert_eq!(versions(&shared), before, "only the generation changed");
    let zen = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    source.set("unix:/a.sock", &zen, "0-3", &["lsf-5"], 2);
    refresh_once(&shared, &source, &config);
    let after = versions(&shared);
    let a = shared.cache.load().lookup("a").unwrap() as usize;
    assert_ne!(after[a], before[a], "host a changed");
    for (i, (x, y)) in before.iter().zip(&after).enumerate() {
        if i != a {
            assert_eq!(x, y, "host {i} did not change");
        }
    }
}

#[test]
fn the_memo_costs_at_most_264_bytes_per_host_at_64_shapes() {
    let config = CacheConfig::default();
    let (shared, _source) = setup(&config);
    let cache = shared.cache.load();
    let resv = crate::Reservations::new();
    let mut memo = eval::Memo::new();
    let hosts: Vec<u32> = (0..cache.len() as u32).collect();
    let ctx = context(&cache, &resv, &config, Instant::now(), Unreachable::Open);
    // The same shapes on no host: what the memo holds whatever the number of hosts.
    let mut fixed = eval::Memo::new();
    for n in 1..=eval::MEMO_SHAPES as u32 {
        let key = format!("affinity[core({n})]#1");
        let req = with_tasks(&format!("affinity[core({n})]"), 1);
        memo.scores(&ctx, &key, &req, &hosts);
        fixed.scores(&ctx, &key, &req, &[]);
    }
    // 4 bytes per host and shape, 8 per host: with the cache's own, at most 1 KB per host.
    let per_host = (memo.bytes() - fixed.bytes()) as f64 / hosts.len() as f64;
    assert!(per_host <= 264.0, "{per_host} bytes per host at 64 shapes");
}

#[test]
fn readers_never_wait_for_a_first_refresh() {
    let topo = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    let source = ManyHosts {
        free: idle_free_map(&topo),
        topology: topo,
        hang: Duration::ZERO,
        hung: Default::default(),
    };
    let config =
        CacheConfig { workers: 2, address_template: String::new(), ..CacheConfig::default() };
    let shared = Shared::default();
    {
        let mut cache = shared.cache.write().unwrap();
        for i in 0..10_000 {
            cache.add(&format!("n{i}"), Address::Unix(format!("/n{i}.sock").into()));
        }
    }
    let done = std::sync::atomic::AtomicBool::new(false);
    let refresh_began = Instant::now();
    let (longest, loads, refresh) = std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let (mut longest, mut loads) = (Duration::ZERO, 0usize);
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let t = Instant::now();
                let cache = shared.cache.load();
                longest = longest.max(t.elapsed());
                loads += 1;
                std::hint::black_box(cache.len());
                drop(cache);
                std::thread::sleep(Duration::from_micros(200));
            }
            (longest, loads)
        });
        refresh_once(&shared, &source, &config);
        let refresh = refresh_began.elapsed();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let (longest, loads) = reader.join().unwrap();
        (longest, loads, refresh)
    });
    eprintln!("a first refresh of 10,000 hosts took {refresh:?}; {loads} reads meanwhile, the longest {longest:?}");
    // A reader that waited for the refresh (a lock held across it) would get a handful of reads
    // and wait most of it. Not a fixed time: on a loaded machine any thread may be descheduled
    // for tens of ms (two such limits failed at load averages of 7 to 10).
    assert!(loads >= 10, "only {loads} reads in a refresh of {refresh:?}");
    assert!(longest < refresh / 4, "a reader waited {longest:?} of a refresh of {refresh:?}");
}

// ---- Issues 1 and 5: dispatches are never dropped, and a dispatch that does not fit reserves. ----

#[test]
fn startup_replays_before_the_first_refresh_are_placed_when_the_state_arrives() {
    use crate::reserve::Dispatched;
    let config =
        CacheConfig { address_template: "unix:/{host}.sock".into(), ..CacheConfig::default() };
    let shared = Shared::default();
    let source = FakeSource::default();
    let zen = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    source.set("unix:/a.sock", &zen, "", &[], 1);
    source.set("unix:/new.sock", &zen, "", &[], 1);
    shared.cache.write().unwrap().add("a", Address::Unix("/a.sock".into()));
    let half = with_tasks("affinity[core(24,same=socket)]", 1);
    // NOTIFY_STARTUP replays, before any refresh: a known host and one not in the cache yet.
    {
        let cache = shared.cache.load();
        let mut resv = shared.reservations.lock().unwrap();
        for (job, host) in [("lsf-1", "a"), ("lsf-2", "new")] {
            assert_eq!(
                resv.dispatch(&cache, job, host, &half, Instant::now()),
                Dispatched::Pending
            );
        }
        assert_eq!(resv.pending().len(), 2);
    }
    shared.discovered.lock().unwrap().insert("new".into());
    refresh_once(&shared, &source, &config);
    let cache = shared.cache.load();
    let resv = shared.reservations.lock().unwrap();
    assert!(resv.pending().is_empty(), "{:?}", resv.pending());
    for (job, host) in [("lsf-1", "a"), ("lsf-2", "new")] {
        let r = resv.of_job(job);
        assert_eq!(r.len(), 1, "{job} is reserved on {host}");
        assert_eq!(r[0].host, cache.lookup(host).unwrap());
        assert_eq!(r[0].cpus.len(), 48, "one package with its SMT siblings");
    }
    // A new job no longer counts those CPUs: one package left on a.
    let ctx = context(&cache, &resv, &config, Instant::now(), Unreachable::Closed);
    let a = cache.lookup("a").unwrap();
    assert!(matches!(eval::evaluate(&ctx, a, &half, Claimant::Anyone), Verdict::Fits { .. }));
    assert!(matches!(
        eval::evaluate(&ctx, a, &with_tasks("affinity[core(24,same=socket)]", 2), Claimant::Anyone),
        Verdict::NoFit(_)
    ));
}

#[test]
fn pending_dispatches_expire_and_go_with_their_job() {
    let config = CacheConfig::default();
    let (shared, _source) = setup(&config);
    let cache = shared.cache.load();
    let mut resv = shared.reservations.lock().unwrap();
    let req = with_tasks("affinity[core(1)]", 1);
    let long_ago = Instant::now() - Duration::from_secs(10);
    resv.dispatch(&cache, "lsf-1", "nowhere", &req, long_ago);
    resv.dispatch(&cache, "lsf-2", "nowhere", &req, Instant::now());
    resv.dispatch(&cache, "lsf-3", "nowhere", &req, Instant::now());
    assert_eq!(resv.settle(&cache, Instant::now(), Duration::from_secs(5)), 0);
    assert_eq!(resv.pending().len(), 2, "the old one expired");
    assert!(resv.release("lsf-2"));
    assert_eq!(resv.pending().iter().map(|p| p.job.as_str()).collect::<Vec<_>>(), ["lsf-3"]);
}

#[test]
fn a_dispatch_that_does_not_fit_still_reserves_its_least_cpu_count() {
    use crate::reserve::Dispatched;
    let config = CacheConfig::default();
    let (shared, _source) = setup(&config);
    let cache = shared.cache.load();
    let mut resv = shared.reservations.lock().unwrap();
    let b = cache.lookup("b").unwrap();
    // Two packages on b, whose first package is held: does not fit, but LSF dispatched it.
    let two = with_tasks("affinity[core(24,same=socket)]", 2);
    match resv.dispatch(&cache, "lsf-7", "b", &two, Instant::now()) {
        Dispatched::Squeezed(cpus, NoFit::Placement(_)) => {
            assert_eq!(cpus, CpuSet::parse_list("24-47,72-95").unwrap(), "the 48 free CPUs")
        }
        other => panic!("{other:?}"),
    }
    let ctx = context(&cache, &resv, &config, Instant::now(), Unreachable::Closed);
    assert!(
        matches!(
            eval::evaluate(&ctx, b, &with_tasks("affinity[core(1)]", 1), Claimant::Anyone),
            Verdict::NoFit(_)
        ),
        "the next job does not count the same CPUs"
    );
    // A request larger than the whole host holds nothing there.
    match resv.dispatch(
        &cache,
        "lsf-8",
        "b",
        &with_tasks("affinity[core(65536)]", 1),
        Instant::now(),
    ) {
        Dispatched::Squeezed(cpus, _) => assert!(cpus.is_empty(), "{cpus}"),
        other => panic!("{other:?}"),
    }
    // A host that already reports the job reserves nothing.
    assert_eq!(
        resv.dispatch(&cache, "lsf-1", "b", &with_tasks("affinity[core(1)]", 1), Instant::now()),
        Dispatched::Held
    );
}

#[test]
fn aliases_follow_the_configured_domain_and_unknown_names_are_remembered() {
    let mut cache = crate::HostCache::new();
    let fqdn = cache.add("n1.cluster.example", Address::Tcp("n1:7979".into()));
    let short = cache.add("n2", Address::Tcp("n2:7979".into()));
    assert_eq!(cache.lookup("n1"), Some(fqdn), "short name of a configured FQDN");
    // Without a domain, any domain finds a short-named host.
    assert_eq!(cache.lookup("n2.elsewhere.org"), Some(short));
    cache.set_domain("cluster.example");
    assert_eq!(cache.lookup("n2.cluster.example"), Some(short), "FQDN with the domain");
    assert_eq!(cache.lookup("n2.elsewhere.org"), None, "another domain is another host");
    assert_eq!(cache.lookup("n1"), Some(fqdn));
    assert_eq!(cache.negative_len(), 1);
    assert_eq!(cache.lookup("n3"), None);
    assert_eq!(cache.negative_len(), 2, "remembered");
    // Adding a host forgets the names remembered as no host's.
    let n3 = cache.add("n3.cluster.example", Address::Tcp("n3:7979".into()));
    assert_eq!(cache.negative_len(), 0);
    assert_eq!(cache.lookup("n3"), Some(n3));
    // An alias never hides a host's own name.
    let own = cache.add("n1", Address::Tcp("other:7979".into()));
    assert_ne!(own, fqdn);
    assert_eq!(cache.lookup("n1"), Some(own));
    // Host names are case-insensitive, as in DNS and LSF.
    let mixed = cache.add("Node7.Cluster.Example", Address::Tcp("n7:7979".into()));
    for name in ["node7", "NODE7", "node7.cluster.example", "Node7.Cluster.Example"] {
        assert_eq!(cache.lookup(name), Some(mixed), "{name}");
    }
}

#[test]
fn many_pending_dispatches_are_kept_once_each() {
    // One job dispatched to 40,000 hosts not known yet: each dispatch is a map insert.
    let cache = crate::HostCache::new();
    let mut resv = crate::Reservations::new();
    let req = with_tasks("affinity[core(1)]", 1);
    // What the 40,000 cost (a scan of the pending ones per dispatch made it quadratic) is
    // `cargo bench -p topo-plugin-core --bench names`; here, that each is kept once, by host.
    for i in 0..40_000 {
        resv.dispatch(&cache, "lsf-1", &format!("h{i}"), &req, Instant::now());
    }
    resv.dispatch(&cache, "lsf-1", "h7", &req, Instant::now());
    assert_eq!(resv.pending().len(), 40_000);
    assert!(resv.release("lsf-1"));
    assert!(resv.pending().is_empty());
}

/// A source that records the nice value of the thread each fetch runs on.
struct NiceProbe(Mutex<Vec<i32>>);

impl HostSource for NiceProbe {
    fn fetch(&self, address: &Address, _cached: CachedTopology) -> Result<Fetched, FetchError> {
        self.0.lock().unwrap().push(crate::fetch::thread_nice());
        Err(FetchError { address: address.to_string(), message: "probe".into() })
    }
}

#[cfg(target_os = "linux")]
#[test]
fn refresh_threads_run_below_the_schedulers_priority() {
    let shared = std::sync::Arc::new(Shared::default());
    shared.cache.write().unwrap().add("a", Address::Unix("/a.sock".into()));
    let probe = std::sync::Arc::new(NiceProbe(Mutex::new(Vec::new())));
    let config = CacheConfig { address_template: String::new(), ..CacheConfig::default() };
    let refresher = crate::fetch::Refresher::start(shared.clone(), probe.clone(), config).unwrap();
    let start = Instant::now();
    while probe.0.lock().unwrap().is_empty() && start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(refresher);
    let mine = crate::fetch::thread_nice();
    let seen = probe.0.lock().unwrap().clone();
    assert!(!seen.is_empty(), "no fetch within a minute");
    let want = (mine + CacheConfig::default().refresh_nice as i32).min(19);
    assert!(seen.iter().all(|&n| n == want), "fetch threads at nice {seen:?}, this one {mine}");
    // The caller's thread keeps its own priority.
    assert_eq!(crate::fetch::thread_nice(), mine);
}

#[test]
fn a_refresh_copies_only_the_hosts_it_changes() {
    let config = CacheConfig::default();
    let (shared, source) = setup(&config);
    let before = shared.cache.load();
    refresh_once(&shared, &source, &config);
    let after = shared.cache.load();
    for (id, h) in before.hosts() {
        // Same state: the new snapshot shares the entry (only its fetch time, in the flat
        // status array, changed), so a refresh allocates nothing per unchanged host.
        assert!(std::ptr::eq(h, after.host(id)), "host {} was copied", h.name);
    }
    let zen = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    source.set("unix:/a.sock", &zen, "0-3", &["lsf-5"], 2);
    refresh_once(&shared, &source, &config);
    let changed = shared.cache.load();
    let a = changed.lookup("a").unwrap();
    assert!(!std::ptr::eq(after.host(a), changed.host(a)), "a changed");
    assert!(after.host(a).state != changed.host(a).state);
    let b = changed.lookup("b").unwrap();
    assert!(std::ptr::eq(after.host(b), changed.host(b)), "b did not change");
    // The fingerprint a match tells states apart by follows the state.
    let print = |c: &crate::HostCache, h| {
        let s = c.host(h).state.as_ref().unwrap();
        crate::cache::state_fingerprint(s)
    };
    assert_eq!(changed.status(a).fingerprint, print(&changed, a));
    assert_ne!(changed.status(a).fingerprint, after.status(a).fingerprint);
    assert_eq!(changed.status(b).fingerprint, print(&changed, b));
    assert_ne!(changed.status(a).fingerprint, changed.status(b).fingerprint);
}

#[test]
fn a_refresher_stopped_with_clear_leaves_no_host_behind() {
    let topo = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    let source = std::sync::Arc::new(ManyHosts {
        free: idle_free_map(&topo),
        topology: topo,
        hang: Duration::ZERO,
        hung: Default::default(),
    });
    let config = CacheConfig { address_template: String::new(), ..CacheConfig::default() };
    let usable = |shared: &Shared| {
        let cache = shared.cache.load();
        let now = Instant::now();
        (0..cache.len() as u32).filter(|&h| cache.is_fresh(h, now, config.stale_after())).count()
    };
    let start = |shared: &std::sync::Arc<Shared>| {
        for i in 0..50 {
            shared
                .cache
                .write()
                .unwrap()
                .add(&format!("h{i}"), Address::Unix(format!("/{i}").into()));
        }
        let r =
            crate::fetch::Refresher::start(shared.clone(), source.clone(), config.clone()).unwrap();
        let t = Instant::now();
        while usable(shared) < 50 && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(usable(shared), 50);
        shared.reservations.lock().unwrap().reserve("j", 0, CpuSet::first_n(2), Instant::now());
        r
    };
    let kept = std::sync::Arc::new(Shared::default());
    start(&kept).stop_soon();
    let cleared = std::sync::Arc::new(Shared::default());
    let snapshot = cleared.cache.load();
    start(&cleared).stop_and_clear();
    let t = Instant::now();
    while !cleared.cache.load().is_empty() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(cleared.cache.load().is_empty(), "the cache is emptied");
    assert!(cleared.reservations.lock().unwrap().is_empty(), "and the reservations");
    assert!(snapshot.is_empty() || snapshot.len() == 50, "a reader's snapshot is its own");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(kept.cache.load().len(), 50, "stop_soon keeps the cache");
    assert!(!kept.reservations.lock().unwrap().is_empty());
}

// ---- Topology reservations and hosts that defragment (issue 18). ----

/// A reservation as topod lists it in its free map.
fn block(
    job: &str,
    cpus: &str,
    request: &str,
    expires_at: i64,
) -> topo_core::reservation::Reservation {
    topo_core::reservation::Reservation {
        job: job.into(),
        cpus: CpuSet::parse_list(cpus).unwrap(),
        request: request::parse(request).unwrap().to_string(),
        made_at: 0,
        expires_at,
        gpus: Vec::new(),
    }
}

/// A free map of `topo` with `held`, `blocks` and `defrag`.
fn free_map(
    topo: &Topology,
    held: &str,
    blocks: Vec<topo_core::reservation::Reservation>,
    defrag: bool,
) -> FreeMap {
    FreeMap {
        held: CpuSet::parse_list(held).unwrap(),
        reservations: blocks,
        defrag,
        ..idle_free_map(topo)
    }
}

/// The Zen hosts' packages (24 cores and their SMT siblings each).
const PACKAGE_0: &str = "0-23,48-71";
const PACKAGE_1: &str = "24-47,72-95";
/// When the tests' blocks lapse (seconds since the epoch); the tests set the clock around it.
const EXPIRES: i64 = 2_000_000_000;

/// Hosts `x` and `y` with the given free maps (and the hosts of [`setup`]), refreshed once.
fn setup_with(config: &CacheConfig, x: FreeMap, y: FreeMap) -> (Shared, FakeSource) {
    let (shared, source) = setup(config);
    let zen = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    source.set_map("unix:/x.sock", &zen, x);
    source.set_map("unix:/y.sock", &zen, y);
    {
        let mut cache = shared.cache.write().unwrap();
        cache.add("x", Address::Unix("/x.sock".into()));
        cache.add("y", Address::Unix("/y.sock".into()));
    }
    refresh_once(&shared, &source, config);
    (shared, source)
}

#[test]
fn another_jobs_block_keeps_a_job_off_it_and_its_own_job_fits_there() {
    let config = CacheConfig::default();
    let zen = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    let socket = "affinity[core(24,same=socket)]";
    // x: package 0 held, package 1 reserved for lsf-7. y: the same without the block.
    let (shared, _source) = setup_with(
        &config,
        free_map(&zen, PACKAGE_0, vec![block("lsf-7", PACKAGE_1, socket, EXPIRES)], false),
        free_map(&zen, PACKAGE_0, vec![], false),
    );
    let cache = shared.cache.load();
    let resv = crate::Reservations::new();
    let mut ctx = context(&cache, &resv, &config, Instant::now(), Unreachable::Closed);
    ctx.epoch_s = EXPIRES - 60;
    let (x, y) = (cache.lookup("x").unwrap(), cache.lookup("y").unwrap());
    let req = with_tasks(socket, 1);
    let small = with_tasks("affinity[core(2)]", 1);
    // Any other job: the block is as good as held.
    for who in [Claimant::Anyone, Claimant::job("lsf-8"), Claimant::peers_of(&small)] {
        assert_eq!(
            eval::evaluate(&ctx, x, &small, who),
            Verdict::NoFit(NoFit::TooFewCpus { free: 0, needed: 2 }),
            "{who:?}"
        );
        assert!(matches!(eval::evaluate(&ctx, y, &small, who), Verdict::Fits { .. }), "{who:?}");
    }
    // The job it is for fits inside it, and ranks x before y, where it also fits.
    let block_cpus = CpuSet::parse_list(PACKAGE_1).unwrap();
    let own = eval::evaluate(&ctx, x, &req, Claimant::job("lsf-7"));
    match &own {
        Verdict::Fits { cpus, claims_block: true, .. } => assert_eq!(cpus, &block_cpus),
        other => panic!("{other:?}"),
    }
    let there = eval::evaluate(&ctx, y, &req, Claimant::job("lsf-7"));
    assert!(matches!(there, Verdict::Fits { claims_block: false, .. }), "{there:?}");
    assert!(own.rank().unwrap() < there.rank().unwrap(), "{own:?} before {there:?}");
    // A small job of its own goes inside the block too, as topod places it.
    match eval::evaluate(&ctx, x, &small, Claimant::job("lsf-7")) {
        Verdict::Fits { cpus, claims_block: true, .. } => assert!(cpus.is_subset(&block_cpus)),
        other => panic!("{other:?}"),
    }
    // A group of peers with the block's request (LSF's matchFn, which knows no job): x takes
    // them only in the block, whatever their task count, so it is for one of them, and the
    // memo ranks it after y, where any of them fits (issue 31: it ranked x first, and
    // checkAllocFn then closed it to every peer but lsf-7).
    assert!(matches!(
        eval::evaluate(&ctx, x, &with_tasks(socket, 2), Claimant::peers_of(&req)),
        Verdict::NoFit(_)
    ));
    match eval::evaluate(&ctx, x, &req, Claimant::peers_of(&with_tasks(socket, 4))) {
        Verdict::InPeersBlock { cpus, .. } => assert_eq!(cpus, block_cpus),
        other => panic!("{other:?}"),
    }
    let mut memo = eval::Memo::new();
    let ranks = memo.scores(&ctx, "socket#1", &req, &[x, y]);
    let (on_x, on_y) = (ranks[0].unwrap(), ranks[1].unwrap());
    assert!(on_y < eval::IN_PEERS_BLOCK_RANK && on_x >= eval::IN_PEERS_BLOCK_RANK, "{ranks:?}");
    assert!(on_x < eval::AFTER_MOVES_RANK, "still a candidate, for lsf-7: {ranks:?}");
    // checkAllocFn's question for another peer, by name: x does not take it.
    assert_eq!(eval::max_tasks(&ctx, x, &req, Claimant::job("lsf-9"), 4), 0);
    assert_eq!(eval::max_tasks(&ctx, x, &req, Claimant::job("lsf-7"), 4), 1);
}

#[test]
fn peers_that_fit_beside_a_block_rank_its_host_as_any_other_and_the_block_stays_its_jobs() {
    let config = CacheConfig::default();
    let zen = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    let socket = "affinity[core(24,same=socket)]";
    // x: package 1 reserved for lsf-7, package 0 free. y: all free.
    let (shared, _source) = setup_with(
        &config,
        free_map(&zen, "", vec![block("lsf-7", PACKAGE_1, socket, EXPIRES)], false),
        free_map(&zen, "", vec![], false),
    );
    let cache = shared.cache.load();
    let resv = crate::Reservations::new();
    let mut ctx = context(&cache, &resv, &config, Instant::now(), Unreachable::Closed);
    ctx.epoch_s = EXPIRES - 60;
    let (x, y) = (cache.lookup("x").unwrap(), cache.lookup("y").unwrap());
    let req = with_tasks(socket, 1);
    let (package_0, package_1) =
        (CpuSet::parse_list(PACKAGE_0).unwrap(), CpuSet::parse_list(PACKAGE_1).unwrap());
    // The peers fit beside the block: an ordinary fit there, on the CPUs any peer but lsf-7
    // gets, ranked with y's by score (not first because of the block).
    let peers = eval::evaluate(&ctx, x, &req, Claimant::peers_of(&req));
    match &peers {
        Verdict::Fits { cpus, claims_block: false, .. } => assert!(cpus.is_subset(&package_0)),
        other => panic!("{other:?}"),
    }
    let on_y = eval::evaluate(&ctx, y, &req, Claimant::peers_of(&req));
    assert_eq!(peers.rank(), on_y.rank(), "{peers:?} and {on_y:?}");
    // Two tasks need the block too: a candidate for lsf-7 only, after every host where they fit.
    let two = with_tasks(socket, 2);
    assert!(matches!(
        eval::evaluate(&ctx, x, &two, Claimant::peers_of(&two)),
        Verdict::InPeersBlock { .. }
    ));
    assert!(matches!(
        eval::evaluate(&ctx, y, &two, Claimant::peers_of(&two)),
        Verdict::Fits { claims_block: false, .. }
    ));
    // What checkAllocFn then says, job by job: the block stays lsf-7's.
    match eval::evaluate(&ctx, x, &req, Claimant::job("lsf-7")) {
        Verdict::Fits { cpus, claims_block: true, .. } => assert_eq!(cpus, package_1),
        other => panic!("{other:?}"),
    }
    assert_eq!(eval::max_tasks(&ctx, x, &req, Claimant::job("lsf-9"), 2), 1);
    assert_eq!(eval::max_tasks(&ctx, x, &req, Claimant::job("lsf-7"), 2), 2);
}

#[test]
fn an_expired_block_is_ignored_and_the_memo_does_not_outlive_it() {
    let config = CacheConfig::default();
    let zen = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    let (shared, _source) = setup_with(
        &config,
        free_map(
            &zen,
            PACKAGE_0,
            vec![block("lsf-7", PACKAGE_1, "affinity[numa]", EXPIRES)],
            false,
        ),
        free_map(&zen, "", vec![], false),
    );
    let cache = shared.cache.load();
    let resv = crate::Reservations::new();
    let x = cache.lookup("x").unwrap();
    let small = with_tasks("affinity[core(2)]", 1);
    let mut memo = eval::Memo::new();
    let mut ctx = context(&cache, &resv, &config, Instant::now(), Unreachable::Closed);
    for (epoch_s, fits) in [(EXPIRES - 1, false), (EXPIRES, true), (EXPIRES + 3600, true)] {
        ctx.epoch_s = epoch_s;
        let direct = eval::evaluate(&ctx, x, &small, Claimant::Anyone);
        assert_eq!(matches!(direct, Verdict::Fits { .. }), fits, "at {epoch_s}: {direct:?}");
        let remembered = memo.scores(&ctx, "small", &small, &[x]);
        assert_eq!(remembered[0].is_some(), fits, "the memo at {epoch_s}: {remembered:?}");
    }
    // The memo's first answer (before the expiry) was remembered, and not given after it.
    ctx.epoch_s = EXPIRES - 1;
    assert_eq!(memo.scores(&ctx, "small", &small, &[x]), [None]);
}

#[test]
fn a_block_reserved_renewed_or_dropped_is_a_change_of_state() {
    let config = CacheConfig::default();
    let zen = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    let numa = "affinity[numa]";
    let (shared, source) =
        setup_with(&config, free_map(&zen, "", vec![], false), free_map(&zen, "", vec![], false));
    let state = |shared: &Shared| {
        let cache = shared.cache.load();
        let x = cache.lookup("x").unwrap();
        (cache.host(x).version, cache.status(x))
    };
    let mut seen = vec![state(&shared)];
    let steps: Vec<FreeMap> = vec![
        free_map(&zen, "", vec![block("lsf-7", "0-5,48-53", numa, EXPIRES)], false),
        free_map(&zen, "", vec![block("lsf-7", "0-5,48-53", numa, EXPIRES + 600)], false),
        free_map(&zen, "", vec![block("lsf-8", "0-5,48-53", numa, EXPIRES + 600)], false),
        free_map(&zen, "", vec![], false),
        free_map(&zen, "", vec![], true),
    ];
    for (i, free) in steps.into_iter().enumerate() {
        source.set_map("unix:/x.sock", &zen, free.clone());
        refresh_once(&shared, &source, &config);
        let now = state(&shared);
        let before = seen.last().unwrap();
        assert_ne!(now.0, before.0, "step {i}: a new version");
        assert_ne!(now.1.fingerprint, before.1.fingerprint, "step {i}: a new fingerprint");
        // The same again is no change.
        source.set_map("unix:/x.sock", &zen, free);
        refresh_once(&shared, &source, &config);
        assert_eq!(state(&shared).0, now.0, "step {i} again");
        seen.push(now);
    }
    let until: Vec<u32> = seen.iter().map(|s| s.1.blocks_until).collect();
    let (e, e600) = (EXPIRES as u32, (EXPIRES + 600) as u32);
    let none = crate::cache::NO_BLOCKS;
    assert_eq!(until, [none, e, e600, e600, none, none]);
    // Blocks cost a host nothing on the heap where there are none.
    let cache = shared.cache.load();
    let y = cache.host(cache.lookup("y").unwrap());
    assert!(y.state.as_ref().unwrap().blocks.is_empty());
}

#[test]
fn a_defragmenting_host_where_the_job_fits_only_after_moves_ranks_after_those_where_it_fits() {
    use crate::reserve::Dispatched;
    let config = CacheConfig::default();
    let zen = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    // Half of each package held: 48 CPUs free, but no whole package.
    let halves = "0-11,48-59,24-35,72-83";
    let (shared, source) = setup_with(
        &config,
        free_map(&zen, halves, vec![], true),
        free_map(&zen, halves, vec![], false),
    );
    let cache = shared.cache.load();
    let mut resv = crate::Reservations::new();
    let ctx = context(&cache, &resv, &config, Instant::now(), Unreachable::Open);
    let id = |n| cache.lookup(n).unwrap();
    let (x, y) = (id("x"), id("y"));
    let socket = with_tasks("affinity[core(24,same=socket)]", 1);
    let peers = Claimant::peers_of(&socket);
    // x defragments: a candidate after the moves; y does not: refused, as before.
    let after = eval::evaluate(&ctx, x, &socket, peers);
    match &after {
        Verdict::AfterMoves(e) => assert!(e.rejected_while_free(), "{e}"),
        other => panic!("{other:?}"),
    }
    match eval::evaluate(&ctx, y, &socket, peers) {
        Verdict::NoFit(NoFit::Placement(e)) => assert!(e.rejected_while_free(), "{e}"),
        other => panic!("{other:?}"),
    }
    // Ranked after a and b (where it fits as they are), before the unknown host (fail-open).
    let hosts = [id("down"), x, y, id("b"), id("a")];
    let ranks = eval::Memo::new().scores(&ctx, "socket#1", &socket, &hosts);
    let mut order: Vec<(u64, &str)> = ranks
        .iter()
        .zip(["down", "x", "y", "b", "a"])
        .filter_map(|(r, n)| r.map(|r| (r, n)))
        .collect();
    order.sort();
    let names: Vec<&str> = order.iter().map(|o| o.1).collect();
    assert_eq!(names[2..], ["x", "down"], "{order:?}");
    assert_eq!(ranks[1], after.rank());
    // More than the free CPUs is refused on x as well: moves make no CPUs.
    let three = with_tasks("affinity[core(24,same=socket)]", 3);
    assert!(matches!(
        eval::evaluate(&ctx, x, &three, peers),
        Verdict::NoFit(NoFit::TooFewCpus { .. })
    ));
    // checkAllocFn leaves x to topod: its tasks count as taken there.
    assert_eq!(eval::max_tasks(&ctx, x, &socket, Claimant::job("lsf-3"), 2), 1);
    assert_eq!(eval::max_tasks(&ctx, y, &socket, Claimant::job("lsf-3"), 2), 0);
    // A dispatch there holds its least count of free CPUs until topod reports the job.
    match resv.dispatch(&cache, "lsf-3", "x", &socket, Instant::now()) {
        Dispatched::AfterMoves(cpus) => {
            assert_eq!(cpus.len(), 24);
            assert!(!cpus.intersects(&CpuSet::parse_list(halves).unwrap()), "{cpus}");
        }
        other => panic!("{other:?}"),
    }
    // Without defrag any more, x refuses it too.
    source.set_map("unix:/x.sock", &zen, free_map(&zen, halves, vec![], false));
    refresh_once(&shared, &source, &config);
    let cache = shared.cache.load();
    let ctx = context(&cache, &resv, &config, Instant::now(), Unreachable::Open);
    assert!(matches!(eval::evaluate(&ctx, x, &socket, peers), Verdict::NoFit(_)));
}

/// What topod's free map says its planner would move on the Zen with half of each package
/// held by two 12-core jobs, each movable from `from` (seconds since the epoch), `pinned` by a
/// `CPU_LIST` of its own CPUs or not.
fn halves_moves(from: [i64; 2], pinned: bool) -> topo_core::proto::reply::DefragView {
    let job = |name: &str, cpus: &str, from: i64| topo_core::proto::reply::MovableJob {
        job: name.into(),
        request: if pinned {
            format!("CPUSET[CPU_LIST={cpus}] affinity[core(12)]")
        } else {
            "affinity[core(12)]".into()
        },
        cpus: CpuSet::parse_list(cpus).unwrap(),
        fenced: CpuSet::new(),
        tasks: Vec::new(),
        movable_from: (from < i64::MAX).then_some(from),
    };
    topo_core::proto::reply::DefragView {
        strategy: topo_core::place::Strategy::BestFit,
        limits: topo_core::defrag::DefragLimits::default(),
        jobs: vec![job("lsf-1", "0-11,48-59", from[0]), job("lsf-2", "24-35,72-83", from[1])],
    }
}

#[test]
fn a_host_fits_after_moves_only_when_its_topod_would_move_a_job_now() {
    // Issue 31: the module kept a defragmenting host for any request that failed on shape
    // alone, though topod moves no job pinned by CPU_LIST or younger than migrate_min_run_s;
    // the only candidate was dispatched there and refused.
    let config = CacheConfig::default();
    let zen = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    let halves = "0-11,48-59,24-35,72-83";
    let with = |moves| FreeMap { moves: Some(moves), ..free_map(&zen, halves, vec![], true) };
    let socket = with_tasks("affinity[core(24,same=socket)]", 1);
    let peers = Claimant::peers_of(&socket);
    let verdict = |x: FreeMap, y: FreeMap, epoch_s: i64| {
        let (shared, _source) = setup_with(&config, x, y);
        let cache = shared.cache.load();
        let resv = crate::Reservations::new();
        let mut ctx = context(&cache, &resv, &config, Instant::now(), Unreachable::Closed);
        ctx.epoch_s = epoch_s;
        let (x, y) = (cache.lookup("x").unwrap(), cache.lookup("y").unwrap());
        let until = cache.status(x).blocks_until;
        (eval::evaluate(&ctx, x, &socket, peers), eval::evaluate(&ctx, y, &socket, peers), until)
    };
    let no_moves =
        |v: &Verdict| matches!(v, Verdict::NoFit(NoFit::NoMoves(e, _)) if e.rejected_while_free());
    // Both jobs movable by the scheduler's clock: moving one makes a package free.
    let (x, _, _) = verdict(
        with(halves_moves([EXPIRES - 100; 2], false)),
        with(halves_moves([EXPIRES; 2], false)),
        EXPIRES - 60,
    );
    assert!(matches!(x, Verdict::AfterMoves(_)), "{x:?}");
    // Neither yet (migrate_min_run_s): refused, with the reason; and the time one becomes
    // movable is when the host's verdicts change (the memo keeps none past it).
    let (x, _, until) = verdict(
        with(halves_moves([EXPIRES; 2], false)),
        with(halves_moves([EXPIRES; 2], false)),
        EXPIRES - 60,
    );
    assert!(no_moves(&x), "{x:?}");
    match &x {
        Verdict::NoFit(why) => assert!(
            why.to_string().contains("none has run migrate_min_run_s")
                && why.to_string().ends_with("the first may move in 60 s)"),
            "{why}"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(until, EXPIRES as u32);
    // One of them movable is enough.
    let (x, y, _) = verdict(
        with(halves_moves([EXPIRES - 100, EXPIRES], false)),
        with(halves_moves([EXPIRES - 100, i64::MAX], false)),
        EXPIRES - 60,
    );
    assert!(
        matches!(x, Verdict::AfterMoves(_)) && matches!(y, Verdict::AfterMoves(_)),
        "{x:?} {y:?}"
    );
    // Pinned by their CPU_LIST, old enough: no move makes room.
    let (x, _, _) =
        verdict(with(halves_moves([0; 2], true)), with(halves_moves([0; 2], true)), EXPIRES - 60);
    assert!(no_moves(&x), "{x:?}");
    // A topod that does not say what it would move: the guess, as before.
    let (x, _, _) = verdict(
        free_map(&zen, halves, vec![], true),
        free_map(&zen, halves, vec![], true),
        EXPIRES - 60,
    );
    assert!(matches!(x, Verdict::AfterMoves(_)), "{x:?}");
}

#[test]
fn the_memo_forgets_a_defragmenting_hosts_verdict_when_a_job_there_becomes_movable() {
    let config = CacheConfig::default();
    let zen = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    let halves = "0-11,48-59,24-35,72-83";
    let x = FreeMap {
        moves: Some(halves_moves([EXPIRES; 2], false)),
        ..free_map(&zen, halves, vec![], true)
    };
    let (shared, _source) = setup_with(&config, x, free_map(&zen, halves, vec![], false));
    let cache = shared.cache.load();
    let resv = crate::Reservations::new();
    let socket = with_tasks("affinity[core(24,same=socket)]", 1);
    let x = cache.lookup("x").unwrap();
    let mut memo = eval::Memo::new();
    let mut ctx = context(&cache, &resv, &config, Instant::now(), Unreachable::Closed);
    for (epoch_s, fits) in
        [(EXPIRES - 60, false), (EXPIRES - 1, false), (EXPIRES, true), (EXPIRES + 60, true)]
    {
        ctx.epoch_s = epoch_s;
        let rank = memo.scores(&ctx, "socket#1", &socket, &[x])[0];
        assert_eq!(rank.is_some(), fits, "at {epoch_s}: {rank:?}");
    }
}

#[test]
fn a_dispatch_goes_into_the_jobs_own_block_and_never_into_anothers() {
    use crate::reserve::Dispatched;
    let config = CacheConfig::default();
    let zen = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    // Dispatches read the system clock: the block holds for an hour from now.
    let later = eval::epoch_now() + 3600;
    let node = "0-5,48-53";
    let (shared, _source) = setup_with(
        &config,
        free_map(&zen, "", vec![block("lsf-7", node, "affinity[numa]", later)], false),
        free_map(&zen, "", vec![], false),
    );
    let cache = shared.cache.load();
    let mut resv = crate::Reservations::new();
    let six = with_tasks("affinity[core(6)]", 1);
    let block_cpus = CpuSet::parse_list(node).unwrap();
    match resv.dispatch(&cache, "lsf-7", "x", &six, Instant::now()) {
        Dispatched::Reserved(cpus) => assert!(cpus.is_subset(&block_cpus), "{cpus}"),
        other => panic!("{other:?}"),
    }
    match resv.dispatch(&cache, "lsf-8", "x", &six, Instant::now()) {
        Dispatched::Reserved(cpus) => assert!(!cpus.intersects(&block_cpus), "{cpus}"),
        other => panic!("{other:?}"),
    }
    // A job squeezed onto a full host holds no CPU of another's block either.
    let all = with_tasks("affinity[core(48)]", 1);
    match resv.dispatch(&cache, "lsf-9", "x", &all, Instant::now()) {
        Dispatched::Squeezed(cpus, _) => assert!(!cpus.intersects(&block_cpus), "{cpus}"),
        other => panic!("{other:?}"),
    }
}

/// Issue 31: 100,000 unknown candidates gave 200,000 log lines. Per-host lines are 20 a
/// minute; the rest are counted and said in one line once the minute has passed.
#[test]
fn per_host_lines_are_twenty_a_minute_and_the_rest_one_count() {
    let mut lines = crate::fetch::HostLines::default();
    let t0 = Instant::now();
    let admitted = (0..100_000).filter(|_| lines.admit(t0)).count();
    assert_eq!(admitted, crate::fetch::HOST_LINES_PER_MINUTE as usize);
    assert_eq!(lines.roll(t0 + Duration::from_secs(59)), 0, "not before the minute has passed");
    assert_eq!(lines.roll(t0 + Duration::from_secs(60)), 100_000 - 20);
    assert!(lines.admit(t0 + Duration::from_secs(61)), "a new minute, a new budget");
    assert_eq!(lines.roll(t0 + Duration::from_secs(200)), 0);
}

#[test]
fn fail_open_offers_a_host_whose_topod_did_not_answer_but_never_one_not_asked_yet() {
    // Issue 31: right after a scheduler's restart every host is unknown until the first
    // refresh brings it; with fail-open each was offered (an impossible request kept 9,997 of
    // 10,000 hosts, and a job landed on a host the replayed jobs had filled).
    let config = CacheConfig::default();
    let (shared, source) = setup(&config);
    let zen = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    source.set("unix:/new.sock", &zen, "", &[], 1);
    shared.cache.write().unwrap().add("new", Address::Unix("/new.sock".into()));
    let resv = crate::Reservations::new();
    let huge = with_tasks("affinity[core(4096)]", 1);
    let who = Claimant::peers_of(&huge);
    let look = |shared: &Shared| {
        let cache = shared.cache.load();
        let ctx = context(&cache, &resv, &config, Instant::now(), Unreachable::Open);
        let (new, down) = (cache.lookup("new").unwrap(), cache.lookup("down").unwrap());
        let memo = eval::Memo::new().scores(&ctx, "huge#1", &huge, &[new, down]);
        (eval::evaluate(&ctx, new, &huge, who), eval::evaluate(&ctx, down, &huge, who), memo)
    };
    // "new" has not been asked yet: not offered, with the reason; "down" failed: offered.
    let (new, down, memo) = look(&shared);
    match new {
        Verdict::NoFit(NoFit::Unknown(why)) => {
            assert!(why.to_string().contains("has not answered yet"), "{why}")
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(down, Verdict::Fits { score: eval::UNKNOWN_SCORE, .. }), "{down:?}");
    assert_eq!(memo, [None, Some(eval::UNKNOWN_SCORE)]);
    // Once it has answered, its state decides (the request does not fit it).
    refresh_once(&shared, &source, &config);
    let (new, _, memo) = look(&shared);
    assert!(matches!(new, Verdict::NoFit(NoFit::TooFewCpus { .. })), "{new:?}");
    assert_eq!(memo[0], None);
    // Once it has failed to answer (its state gone stale or never come), fail-open offers it.
    source.hosts.lock().unwrap().remove("unix:/new.sock");
    let later = Instant::now() + config.stale_after() + Duration::from_secs(1);
    refresh_once(&shared, &source, &config);
    let cache = shared.cache.load();
    let ctx = context(&cache, &resv, &config, later, Unreachable::Open);
    let new = cache.lookup("new").unwrap();
    assert!(cache.status(new).asked());
    assert!(matches!(
        eval::evaluate(&ctx, new, &huge, who),
        Verdict::Fits { score: eval::UNKNOWN_SCORE, .. }
    ));
}

#[test]
fn an_open_prime_time_pool_is_for_the_jobs_it_admits_at_match_check_and_dispatch() {
    // Issue 31: the module ignored prime-time pools: a normal-queue job kept the pool's host,
    // its tentative reservation landed on the pool's CPUs, and topod refused the allocation.
    use crate::reserve::Dispatched;
    use eval::{Admission, IN_POOL_RANK};
    let config = CacheConfig::default();
    let zen = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    let pool = |open: bool, named: bool| topo_core::proto::reply::PoolStatus {
        name: "day".into(),
        cpus: CpuSet::parse_list(PACKAGE_1).unwrap(),
        open,
        queues: vec!["interactive".into()],
        users: vec![1001],
        named,
    };
    // x: package 0 held, package 1 an open pool; y: the same pool closed.
    let (shared, source) = setup_with(
        &config,
        FreeMap { pools: vec![pool(true, false)], ..free_map(&zen, PACKAGE_0, vec![], false) },
        FreeMap { pools: vec![pool(false, false)], ..free_map(&zen, PACKAGE_0, vec![], false) },
    );
    let twelve = with_tasks("affinity[core(12)]", 1);
    let in_pool = CpuSet::parse_list(PACKAGE_1).unwrap();
    let normal = Claimant::job_of("lsf-1", Admission::new(Some("normal"), Some(1000)));
    let interactive = Claimant::job_of("lsf-2", Admission::new(Some("interactive"), Some(1000)));
    let by_user = Claimant::job_of("lsf-3", Admission::new(Some("normal"), Some(1001)));
    {
        let cache = shared.cache.load();
        let resv = crate::Reservations::new();
        let ctx = context(&cache, &resv, &config, Instant::now(), Unreachable::Closed);
        let (x, y) = (cache.lookup("x").unwrap(), cache.lookup("y").unwrap());
        // matchFn (peers, queue unknown): x is a candidate ranked after every other.
        let peers = eval::evaluate(&ctx, x, &twelve, Claimant::peers_of(&twelve));
        assert_eq!(peers, Verdict::InPool("day".into()));
        assert_eq!(peers.rank(), Some(IN_POOL_RANK));
        assert!(matches!(
            eval::evaluate(&ctx, y, &twelve, Claimant::peers_of(&twelve)),
            Verdict::Fits { .. }
        ));
        // checkAllocFn: a normal-queue job may not have it, with the reason; the pool's queue
        // and its user may, inside the pool.
        match eval::evaluate(&ctx, x, &twelve, normal) {
            Verdict::NoFit(why) => assert!(
                why.to_string().contains("prime-time pools open now that do not admit it: day"),
                "{why}"
            ),
            other => panic!("{other:?}"),
        }
        assert_eq!(eval::max_tasks(&ctx, x, &twelve, normal, 4), 0);
        for who in [interactive, by_user] {
            match eval::evaluate(&ctx, x, &twelve, who) {
                Verdict::Fits { cpus, .. } => assert!(cpus.is_subset(&in_pool), "{cpus}"),
                other => panic!("{who:?}: {other:?}"),
            }
        }
        // Where there is room outside the pool, peers are placed outside it.
        let two = with_tasks("affinity[core(2)]", 1);
        match eval::evaluate(&ctx, y, &two, Claimant::peers_of(&two)) {
            Verdict::Fits { .. } => {}
            other => panic!("{other:?}"),
        }
    }
    // Dispatches: the normal-queue job is squeezed (its least count, never the pool's CPUs:
    // none are left outside it), the interactive one reserved inside the pool.
    let mut resv = crate::Reservations::new();
    let cache = shared.cache.load();
    let admission = |q: &str| Admission::new(Some(q), None);
    match resv.dispatch_as(&cache, "lsf-1", admission("normal"), "x", &twelve, Instant::now()) {
        Dispatched::Squeezed(cpus, _) => assert!(!cpus.intersects(&in_pool), "{cpus}"),
        other => panic!("{other:?}"),
    }
    match resv.dispatch_as(&cache, "lsf-2", admission("interactive"), "x", &twelve, Instant::now())
    {
        Dispatched::Reserved(cpus) => assert!(cpus.is_subset(&in_pool), "{cpus}"),
        other => panic!("{other:?}"),
    }
    // A pool that admits jobs by name may be the job's (TOPO_POOL is not the scheduler's to
    // see): left to topod.
    source.set_map(
        "unix:/x.sock",
        &zen,
        FreeMap { pools: vec![pool(true, true)], ..free_map(&zen, PACKAGE_0, vec![], false) },
    );
    refresh_once(&shared, &source, &config);
    let cache = shared.cache.load();
    let resv = crate::Reservations::new();
    let ctx = context(&cache, &resv, &config, Instant::now(), Unreachable::Closed);
    let x = cache.lookup("x").unwrap();
    assert_eq!(eval::evaluate(&ctx, x, &twelve, normal), Verdict::InPool("day".into()));
}

#[test]
fn a_request_for_whole_domains_that_moves_would_free_fits_after_moves_as_topod_tries_them() {
    // Found from outside: topod tries moves on every refusal but one that can never fit, not
    // only on one refused for its shape; the module removed a host where a job of one core in
    // each L3 group kept `affinity[l3(1)]` out, and topod placed it after a move.
    let config = CacheConfig::default();
    let zen = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    let model = topo_core::place::model::HostModel::new(&zen, &CpuSet::new()).unwrap();
    // One core (both threads) of each L3 group held, each by its own movable job.
    let jobs: Vec<topo_core::proto::reply::MovableJob> = model
        .l3
        .iter()
        .enumerate()
        .map(|(i, l3)| {
            let core = model.cores.iter().find(|c| c.is_subset(l3)).unwrap();
            topo_core::proto::reply::MovableJob {
                job: format!("lsf-{i}"),
                request: "affinity[core(1)]".into(),
                cpus: core.clone(),
                fenced: CpuSet::new(),
                tasks: Vec::new(),
                movable_from: Some(EXPIRES - 100),
            }
        })
        .collect();
    let held = CpuSet::union_all(jobs.iter().map(|j| &j.cpus));
    let moves = |from: i64| topo_core::proto::reply::DefragView {
        strategy: topo_core::place::Strategy::BestFit,
        limits: topo_core::defrag::DefragLimits::default(),
        jobs: jobs
            .iter()
            .map(|j| topo_core::proto::reply::MovableJob { movable_from: Some(from), ..j.clone() })
            .collect(),
    };
    let map = |from: i64| FreeMap {
        held: held.clone(),
        defrag: true,
        moves: Some(moves(from)),
        ..idle_free_map(&zen)
    };
    let (shared, _source) = setup_with(&config, map(EXPIRES - 100), map(EXPIRES));
    let cache = shared.cache.load();
    let resv = crate::Reservations::new();
    let mut ctx = context(&cache, &resv, &config, Instant::now(), Unreachable::Closed);
    ctx.epoch_s = EXPIRES - 60;
    let l3 = with_tasks("affinity[l3(1)]", 1);
    let peers = Claimant::peers_of(&l3);
    let (x, y) = (cache.lookup("x").unwrap(), cache.lookup("y").unwrap());
    let on_x = eval::evaluate(&ctx, x, &l3, peers);
    assert!(matches!(on_x, Verdict::AfterMoves(ref e) if !e.rejected_while_free()), "{on_x:?}");
    // Not before they may move.
    assert!(matches!(eval::evaluate(&ctx, y, &l3, peers), Verdict::NoFit(NoFit::NoMoves(..))));
}

#[test]
fn a_free_maps_planner_bounds_above_topods_own_are_cut_to_them() {
    // A topod cannot set these (only defrag_max_moves); a reply that claims more would make
    // every match search longer inside the scheduler.
    let mut view = halves_moves([0; 2], false);
    view.limits.max_evaluations = usize::MAX;
    view.limits.max_candidates = usize::MAX;
    view.limits.greedy_seeds = usize::MAX;
    view.limits.max_moves = 3;
    let moves = crate::cache::Moves::from_view(&view);
    let d = topo_core::defrag::DefragLimits::default();
    assert_eq!(
        (moves.limits.max_evaluations, moves.limits.max_candidates, moves.limits.greedy_seeds),
        (d.max_evaluations, d.max_candidates, d.greedy_seeds)
    );
    assert_eq!(moves.limits.max_moves, 3, "topod's own setting is kept");
    assert_eq!(moves.jobs.len(), 2);
}

#[test]
fn hosts_with_the_same_free_gpus_share_one_list_and_unused_lists_are_dropped() {
    let topo = shared_topology("32intel64-2p8co2t+8ve.xml");
    let site = |g: usize| topo_core::gpus::GpuSite {
        numa: Some(CpuSet::parse_list(if g < 4 { "0-15" } else { "16-31" }).unwrap()),
        socket: Some(CpuSet::parse_list(if g < 4 { "0-15" } else { "16-31" }).unwrap()),
        switch: Some(format!("0000:{:02x}:00.0", 0x10 + g)),
        fabric: None,
    };
    let all: Vec<_> = (0..12).map(site).collect();
    let hosts = 100;
    let mut cache = crate::HostCache::new();
    let now = Instant::now();
    for h in 0..hosts {
        let id = cache.add(&format!("n{h}"), Address::Unix(PathBuf::from("/t.sock")));
        let free = FreeMap { gpus: all.clone(), ..idle_free_map(&topo) };
        cache.update(id, Some(&topo), free, now).unwrap();
    }
    let gpus = |c: &crate::HostCache, h: u32| c.host(h).state.as_ref().unwrap().gpus.clone();
    assert_eq!(*gpus(&cache, 0), *all, "a host keeps the sites topod sent");
    assert!((1..hosts).all(|h| std::sync::Arc::ptr_eq(&gpus(&cache, 0), &gpus(&cache, h))));
    assert_eq!(cache.gpu_list_count(), 1);
    // Churn: every host's free GPUs change many times, through lists no host keeps for long
    // (a few thousand distinct ones of the 4,096 subsets).
    for round in 0..40u32 {
        for h in 0..hosts {
            let taken = (h.wrapping_mul(2_654_435_761) ^ round.wrapping_mul(40_503)) % 4096;
            let free_gpus = all.iter().enumerate().filter(|&(g, _)| taken & (1 << g) == 0);
            let free = FreeMap {
                gpus: free_gpus.map(|(_, s)| s.clone()).collect(),
                ..idle_free_map(&topo)
            };
            cache.update(h, None, free, now).unwrap();
            let kept = gpus(&cache, h);
            assert_eq!(kept.len(), 12 - taken.count_ones() as usize);
            for (g, s) in all.iter().enumerate() {
                assert_eq!(
                    kept.contains(s),
                    taken & (1 << g) == 0,
                    "host {h} round {round}: GPU {g}"
                );
            }
        }
    }
    // At most 100 lists in use now.
    assert!(
        cache.gpu_list_count() <= 2 * hosts as usize + 64,
        "{} lists kept",
        cache.gpu_list_count()
    );
}

/// Attack on the match path (an independent mbschd stand-in): hosts with tentative
/// reservations were told apart by their CPUs and blocks only, not by the GPUs reserved there
/// (nor their free GPUs and open pools), so a host whose GPUs another dispatch took shared the
/// verdict of a host with the same CPUs reserved and all its GPUs free: which one decided
/// depended on the candidates' order. A host with only GPUs reserved was not told apart at all.
#[test]
fn hosts_whose_reservations_differ_in_gpus_get_their_own_verdicts_in_any_order() {
    let config = CacheConfig::default();
    let zen = shared_topology("AMD-17h-Zen-2xEpyc-7451.xml");
    let site = |g: usize| topo_core::gpus::GpuSite {
        numa: Some(CpuSet::parse_list("0-5,48-53").unwrap()),
        socket: Some(CpuSet::parse_list(PACKAGE_0).unwrap()),
        switch: Some(format!("0000:{:02x}:00.0", 0x10 + g)),
        fabric: None,
    };
    let with_gpus =
        FreeMap { gpus: (0..4).map(site).collect(), ..free_map(&zen, "", vec![], false) };
    let (shared, _source) = setup_with(&config, with_gpus.clone(), with_gpus);
    let cache = shared.cache.load();
    let (x, y) = (cache.lookup("x").unwrap(), cache.lookup("y").unwrap());
    let now = Instant::now();
    let four = with_tasks("affinity[core(1):gpus=4]", 1);
    let verdicts = |resv: &crate::Reservations| {
        let ctx = context(&cache, resv, &config, now, Unreachable::Closed);
        let alone: Vec<bool> = [x, y]
            .iter()
            .map(|&h| eval::evaluate(&ctx, h, &four, Claimant::Anyone).rank().is_some())
            .collect();
        for order in [[x, y], [y, x]] {
            let ranks = eval::Memo::new().scores(&ctx, "four", &four, &order);
            let got: Vec<bool> = order
                .iter()
                .map(|h| ranks[order.iter().position(|o| o == h).unwrap()].is_some())
                .collect();
            let want: Vec<bool> =
                order.iter().map(|&h| alone[if h == x { 0 } else { 1 }]).collect();
            assert_eq!(got, want, "candidates in the order {order:?}");
        }
        alone
    };
    // x: job 101 took a GPU and CPUs 0-1; y: job 102 took the same CPUs and no GPU.
    let mut resv = crate::Reservations::new();
    resv.reserve_with_gpus("lsf-101", x, CpuSet::parse_list("0-1").unwrap(), vec![site(0)], now);
    resv.reserve("lsf-102", y, CpuSet::parse_list("0-1").unwrap(), now);
    assert_eq!(verdicts(&resv), [false, true]);
    // Only a GPU reserved on x, nothing on y.
    let mut resv = crate::Reservations::new();
    resv.reserve_with_gpus("lsf-103", x, CpuSet::new(), vec![site(1)], now);
    assert_eq!(verdicts(&resv), [false, true]);
}

/// The cache itself: a free map naming another topology than the cached one, with no
/// topology beside it (a source that did not look), drops the host's state, so that the
/// next fetch brings the topology; a configuration that moves a host does the same.
#[test]
fn the_cache_forgets_a_state_of_another_topology() {
    let (epyc, intel) = (Topology::flat(48), Topology::flat(16));
    let mut cache = crate::HostCache::new();
    let id = cache.add("h1", Address::Unix("/a.sock".into()));
    let free =
        |topo: &Topology| FreeMap { topology_id: Some(topo.fingerprint()), ..idle_free_map(topo) };
    cache.update(id, Some(&epyc), free(&epyc), Instant::now()).unwrap();
    assert_eq!(
        cache.cached_topology(id),
        crate::cache::CachedTopology::Known(Some(epyc.fingerprint()))
    );
    cache.update(id, None, free(&epyc), Instant::now()).unwrap();
    let outcome = cache.update(id, None, free(&intel), Instant::now()).unwrap();
    assert_eq!(outcome, crate::cache::Updated::AnotherTopology);
    assert_eq!(cache.cached_topology(id), crate::cache::CachedTopology::Nothing);
    cache.update(id, Some(&intel), free(&intel), Instant::now()).unwrap();
    assert_eq!(
        cache.cached_topology(id),
        crate::cache::CachedTopology::Known(Some(intel.fingerprint()))
    );
    // The same address again keeps the state; another drops it.
    assert_eq!(cache.add_at("h1", Address::Unix("/a.sock".into())), None);
    assert!(!cache.cached_topology(id).is_nothing());
    assert_eq!(cache.add_at("h1", Address::Unix("/b.sock".into())), Some(id));
    assert_eq!(cache.cached_topology(id), crate::cache::CachedTopology::Nothing);
    assert_eq!(cache.host(id).address, Address::Unix("/b.sock".into()));
}

/// A source whose first fetch, from the host's address, finds the configuration moved the host
/// elsewhere meanwhile (a second sched_init): what the old address said is another topod's.
struct MovedDuringFetch {
    shared: std::sync::Arc<Shared>,
    topology: Topology,
    moved: Mutex<bool>,
}

impl HostSource for MovedDuringFetch {
    fn fetch(&self, address: &Address, cached: CachedTopology) -> Result<Fetched, FetchError> {
        let mut moved = self.moved.lock().unwrap();
        if !*moved {
            *moved = true;
            self.shared.cache.write().unwrap().add_at("h1", Address::Unix("/new.sock".into()));
        }
        let free = FreeMap {
            topology_id: Some(self.topology.fingerprint()),
            ..idle_free_map(&self.topology)
        };
        let _ = address;
        Ok(Fetched { topology: cached.is_nothing().then(|| self.topology.clone()), free_map: free })
    }
}

/// Review of 4f5d619: a fetch handed out before a configuration moved its host was applied
/// under the new address (the old topod's topology kept for good where topods name none).
#[test]
fn a_fetch_from_an_address_the_host_no_longer_has_is_not_applied() {
    let shared = std::sync::Arc::new(Shared::default());
    let id = shared.cache.write().unwrap().add("h1", Address::Unix("/old.sock".into()));
    let source = MovedDuringFetch {
        shared: shared.clone(),
        topology: Topology::flat(8),
        moved: Mutex::new(false),
    };
    let config = CacheConfig::default();
    refresh_once(&shared, &source, &config);
    let cache = shared.cache.load();
    assert_eq!(cache.host(id).address, Address::Unix("/new.sock".into()));
    assert!(cache.host(id).state.is_none(), "the old address's state was applied");
    drop(cache);
    refresh_once(&shared, &source, &config);
    assert!(shared.cache.load().host(id).state.is_some(), "the new address's is");
}

/// Attacks on 4f5d619 and db91782: the jobs dispatched to a host whose topod changed are placed
/// again on the new machine; one that cannot fit it even idle holds nothing there (its topod
/// refuses it), one that only waits for CPUs holds its least count, as at a first dispatch.
#[test]
fn jobs_dispatched_to_a_host_whose_topod_changed_are_placed_again() {
    use crate::reserve::{Dispatched, Reservations};
    let (old, new) = (Topology::flat(48), Topology::flat(16));
    let mut cache = crate::HostCache::new();
    let id = cache.add("h1", Address::Unix("/h1.sock".into()));
    let now = Instant::now();
    cache.update(id, Some(&old), idle_free_map(&old), now).unwrap();
    let mut resv = Reservations::new();
    for (job, cores) in [("lsf-1", 24), ("lsf-2", 12)] {
        let request = request::parse(&format!("affinity[core({cores})]")).unwrap();
        let outcome = resv.dispatch(&cache, job, "h1", &request, now);
        assert!(matches!(outcome, Dispatched::Reserved(_)), "{job}: {outcome:?}");
    }
    // The new machine: 16 CPUs, 10 of them held by a running job.
    let busy = FreeMap {
        held: CpuSet::parse_list("0-9").unwrap(),
        job_ids: vec!["running".into()],
        ..idle_free_map(&new)
    };
    cache.update(id, Some(&new), busy, now).unwrap();
    assert_eq!(resv.forget_host(id, "h1"), 2);
    assert!(resv.of_job("lsf-1").is_empty() && resv.of_job("lsf-2").is_empty());
    resv.settle(&cache, now, Duration::from_secs(300));
    assert!(resv.of_job("lsf-1").is_empty(), "lsf-1 (24 cores) can never fit 16: nothing held");
    let kept: Vec<CpuSet> = resv.of_job("lsf-2").iter().map(|r| r.cpus.clone()).collect();
    assert_eq!(
        kept,
        [CpuSet::parse_list("10-15").unwrap()],
        "lsf-2 (12 cores) waits for CPUs there: it holds the free ones"
    );
    assert!(resv.pending().is_empty());
}
