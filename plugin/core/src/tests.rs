//! The cache, reservations and evaluation together, fed by a fake source built from real
//! machines in `shared/topologies`.

use crate::cache::FreeMap;
use crate::eval::{self, Context, NoFit, Verdict};
use crate::fetch::{refresh_once, FetchError, Fetched, HostSource, Shared};
use crate::{Address, CacheConfig, Unreachable};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use topo_core::cpuset::CpuSet;
use topo_core::request::{self, Request};
use topo_core::topology::{hwloc_xml, Topology};

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
        };
        self.hosts.lock().unwrap().insert(address.to_string(), (topo.clone(), free));
    }
}

impl HostSource for FakeSource {
    fn fetch(&self, address: &Address, with_topology: bool) -> Result<Fetched, FetchError> {
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
    assert_eq!(shared.cache.read().unwrap().model_count(), 2, "two Zen hosts share one model");
    source.calls.lock().unwrap().clear();
    refresh_once(&shared, &source, &config);
    let calls = source.calls.lock().unwrap().clone();
    assert!(
        calls.iter().any(|(a, t)| a == "unix:/down.sock" && *t),
        "the host never reached is still asked for its topology"
    );
    assert!(calls.iter().filter(|(a, _)| a != "unix:/down.sock").all(|(_, t)| !t), "{calls:?}");
    let cache = shared.cache.read().unwrap();
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
    let cache = shared.cache.read().unwrap();
    let resv = shared.reservations.lock().unwrap();
    let mut ctx = Context {
        cache: &cache,
        reservations: &resv,
        now: Instant::now(),
        stale_after: config.stale_after(),
        unreachable: Unreachable::Open,
    };
    let id = |n| cache.lookup(n).unwrap();
    // 24 cores in one package: fits the empty Zen host, not the one whose first package is held.
    let req = with_tasks("affinity[core(24,same=socket)]", 1);
    assert!(matches!(eval::evaluate(&ctx, id("a"), &req), Verdict::Fits { .. }));
    match eval::evaluate(&ctx, id("b"), &with_tasks("affinity[core(24,same=socket)]", 3)) {
        Verdict::NoFit(NoFit::TooFewCpus { free: 48, needed: 72 }) => {}
        other => panic!("{other:?}"),
    }
    assert!(matches!(eval::evaluate(&ctx, id("b"), &req), Verdict::Fits { .. }));
    match eval::evaluate(&ctx, id("b"), &with_tasks("affinity[core(24,same=socket)]", 2)) {
        Verdict::NoFit(NoFit::Placement(_)) => {}
        other => panic!("only one package is free on b: {other:?}"),
    }
    // The unreachable host: kept last when fail-open, removed with the reason when fail-closed.
    assert_eq!(
        eval::evaluate(&ctx, id("down"), &req),
        Verdict::Fits { score: eval::UNKNOWN_SCORE, cpus: CpuSet::new() }
    );
    ctx.unreachable = Unreachable::Closed;
    match eval::evaluate(&ctx, id("down"), &req) {
        Verdict::NoFit(why) => assert!(why.to_string().contains("connection refused"), "{why}"),
        other => panic!("{other:?}"),
    }
    // Stale: an answer older than stale_after counts as unknown.
    ctx.now += config.stale_after() + Duration::from_secs(1);
    assert!(matches!(eval::evaluate(&ctx, id("a"), &req), Verdict::NoFit(NoFit::Unknown(_))));
    ctx.unreachable = Unreachable::Open;
    // The best host for a small request is the busy one (best fit packs), and both beat unknown.
    ctx.now = Instant::now();
    let small = with_tasks("affinity[core(2)]", 1);
    let score = |h| match eval::evaluate(&ctx, id(h), &small) {
        Verdict::Fits { score, .. } => score,
        other => panic!("{other:?}"),
    };
    assert!(score("a") < eval::UNKNOWN_SCORE && score("b") < eval::UNKNOWN_SCORE);
    assert_eq!(eval::max_tasks(&ctx, id("b"), &req, 4), 1);
    assert_eq!(eval::max_tasks(&ctx, id("a"), &req, 4), 2);
}

#[test]
fn reservations_stop_double_counting_until_the_host_reports_the_job() {
    let config = CacheConfig::default();
    let (shared, source) = setup(&config);
    let now = Instant::now();
    let half = with_tasks("affinity[core(24,same=socket)]", 1);
    let a = shared.cache.read().unwrap().lookup("a").unwrap();
    // Two jobs each take one package of host a.
    for job in ["lsf-10", "lsf-11"] {
        let cache = shared.cache.read().unwrap();
        let mut resv = shared.reservations.lock().unwrap();
        let ctx = Context {
            cache: &cache,
            reservations: &resv,
            now,
            stale_after: config.stale_after(),
            unreachable: Unreachable::Open,
        };
        let Verdict::Fits { cpus, .. } = eval::evaluate(&ctx, a, &half) else {
            panic!("{job} should fit")
        };
        resv.reserve(job, a, cpus, now);
    }
    {
        let cache = shared.cache.read().unwrap();
        let resv = shared.reservations.lock().unwrap();
        let ctx = Context {
            cache: &cache,
            reservations: &resv,
            now,
            stale_after: config.stale_after(),
            unreachable: Unreachable::Open,
        };
        assert!(
            matches!(
                eval::evaluate(&ctx, a, &with_tasks("affinity[core(1)]", 1)),
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
    let cache = shared.cache.read().unwrap();
    let ctx = Context {
        cache: &cache,
        reservations: &resv,
        now,
        stale_after: config.stale_after(),
        unreachable: Unreachable::Open,
    };
    assert!(
        matches!(eval::evaluate(&ctx, a, &half), Verdict::Fits { .. }),
        "one package is free again"
    );
    assert!(matches!(
        eval::evaluate(&ctx, a, &with_tasks("affinity[core(24,same=socket)]", 2)),
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
    assert_eq!(
        resv.reconcile(&shared.cache.read().unwrap(), Instant::now(), Duration::from_secs(1)),
        1
    );
    assert!(resv.on_host(0).is_none());
}

#[test]
fn discovered_hosts_get_the_template_address() {
    let config =
        CacheConfig { address_template: "unix:/{host}.sock".into(), ..CacheConfig::default() };
    let (shared, _source) = setup(&config);
    shared.discovered.lock().unwrap().insert("c2".into());
    refresh_once(&shared, &_source, &config);
    let cache = shared.cache.read().unwrap();
    let id = cache.lookup("c2").expect("added");
    assert_eq!(cache.host(id).address, Address::Unix("/c2.sock".into()));
}

#[test]
fn the_memo_agrees_with_evaluate_and_forgets_changed_hosts() {
    let config = CacheConfig::default();
    let (shared, _source) = setup(&config);
    let cache = shared.cache.read().unwrap();
    let mut resv = crate::Reservations::new();
    let mut memo = eval::Memo::new();
    let hosts: Vec<u32> = (0..cache.len() as u32).collect();
    let req = with_tasks("affinity[core(24,same=socket)]", 1);
    let direct = |resv: &crate::Reservations| {
        let ctx = Context {
            cache: &cache,
            reservations: resv,
            now: Instant::now(),
            stale_after: config.stale_after(),
            unreachable: Unreachable::Open,
        };
        hosts
            .iter()
            .map(|&h| match eval::evaluate(&ctx, h, &req) {
                Verdict::Fits { score, .. } => Some(score),
                Verdict::NoFit(_) => None,
            })
            .collect::<Vec<_>>()
    };
    let via_memo = |memo: &mut eval::Memo, resv: &crate::Reservations| {
        let ctx = Context {
            cache: &cache,
            reservations: resv,
            now: Instant::now(),
            stale_after: config.stale_after(),
            unreachable: Unreachable::Open,
        };
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
fn reads_the_protocols_free_map() {
    let sent = topo_core::proto::reply::FreeMap {
        generation: 7,
        allocatable: CpuSet::parse_list("0-15").unwrap(),
        held: CpuSet::parse_list("0-3").unwrap(),
        fenced: CpuSet::parse_list("4").unwrap(),
        jobs: 1,
        job_ids: vec!["lsf-1".into()],
        free: Default::default(),
    };
    let kept: FreeMap = serde_json::from_value(serde_json::to_value(&sent).unwrap()).unwrap();
    assert_eq!(
        (kept.generation, kept.held, kept.fenced, kept.job_ids),
        (7, sent.held, sent.fenced, sent.job_ids)
    );
    assert_eq!(kept.allocatable, sent.allocatable);
}
