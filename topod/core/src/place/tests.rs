//! Placement tests on regular synthetic machines, where the right answer is known by hand.

use super::*;
use crate::ledger::Ledger;
use crate::request::{CpusetOption, Exclusive, MemBind, Scope};
use crate::topology::{SyntheticShape, Topology};
use proptest::prelude::{
    any, prop_assert, prop_assert_eq, prop_oneof, proptest, Just, ProptestConfig,
};
use proptest::strategy::Strategy as PropStrategy;

/// 2 packages × 2 NUMA × 2 L3 × 4 cores × 2 threads = 64 PUs; siblings 32 apart.
fn machine() -> HostModel {
    let topo = Topology::synthetic(SyntheticShape {
        packages: 2,
        numa_per_package: 2,
        l3_per_numa: 2,
        cores_per_l3: 4,
        threads_per_core: 2,
    });
    HostModel::new(&topo, &CpuSet::new()).unwrap()
}

fn threads(n: u32) -> Request {
    Request::threads(n)
}

fn cores(per_task: u32, tasks: u32, same: Option<Level>) -> Request {
    Request {
        unit: Level::Core,
        units_per_task: per_task,
        tasks: Some(tasks),
        same,
        ..Request::default()
    }
}

fn set(s: &str) -> CpuSet {
    CpuSet::parse_list(s).unwrap()
}

#[test]
fn the_tree_follows_the_machine() {
    let m = machine();
    assert_eq!(m.allocatable.len(), 64);
    assert_eq!((m.sockets.len(), m.numa.len(), m.l3.len(), m.cores.len()), (2, 4, 8, 32));
    // machine + 2 sockets + 4 numa + 8 l3 + 32 cores
    assert_eq!(m.tree.len(), 47);
    assert_eq!(m.min_domains_for(Level::Numa, 20), 2);
    assert_eq!(m.hops(12), 1);
    assert_eq!(m.hops(32), 2);
}

#[test]
fn best_fit_keeps_a_small_job_in_one_l3() {
    let m = machine();
    let p = place(&m, &Occupancy::default(), &threads(8), Strategy::BestFit).unwrap();
    assert_eq!(p.cpus, set("0-3,32-35"), "a whole L3 group: 4 cores with both threads");
    assert_eq!((p.metrics.l3_groups, p.metrics.numa_nodes, p.metrics.smt_shared), (1, 1, 0));
}

#[test]
fn best_fit_chooses_the_tightest_domain() {
    let m = machine();
    // L3 group 5 (cores 20-23) has 2 free threads left; L3 group 0 has 5 free.
    let occ = Occupancy { held: set("20-23,52-53,0-2"), fenced: CpuSet::new() };
    // Two threads: the smallest domain that holds them is a whole free core, and the one in the
    // tightest L3 group (group 0) wins; the two stranded threads of group 5 would share cores.
    let p = place(&m, &occ, &threads(2), Strategy::BestFit).unwrap();
    assert_eq!(p.cpus, set("3,35"));
    assert_eq!(p.metrics.smt_shared, 0);
    let p = place(&m, &occ, &threads(5), Strategy::BestFit).unwrap();
    assert_eq!(p.cpus, set("3,32-35"), "the 5 free threads of L3 group 0, not a fresh group");
}

#[test]
fn best_fit_spans_the_nearest_domains() {
    let m = machine();
    let p = place(&m, &Occupancy::default(), &threads(20), Strategy::BestFit).unwrap();
    assert_eq!(p.metrics.numa_nodes, 2);
    assert_eq!(
        p.metrics.sockets, 1,
        "two NUMA nodes of the same package (distance 12), not across (32)"
    );
    assert_eq!(p.metrics.radius, 12);
    assert_eq!(p.metrics.l3_groups, 3);
}

#[test]
fn first_fit_is_topology_blind() {
    let m = machine();
    let p = place(&m, &Occupancy::default(), &threads(8), Strategy::FirstFit).unwrap();
    assert_eq!(p.cpus, set("0-7"), "the lowest ids: one thread of 8 cores in two L3 groups");
    assert_eq!(p.metrics.l3_groups, 2);
}

#[test]
fn exclusive_cpus_fence_their_siblings() {
    let m = machine();
    let req = Request {
        tasks: Some(3),
        cpuset_options: vec![CpusetOption::CpuExclusive],
        ..Request::default()
    };
    let p = place(&m, &Occupancy::default(), &req, Strategy::BestFit).unwrap();
    assert_eq!(p.cpus.len(), 3);
    assert_eq!(p.fenced.len(), 1, "the fourth thread of the second core is fenced");
    let mut ledger = Ledger::new();
    ledger.allocate("a", &p, "x").unwrap();
    // Fill every other CPU with single threads: none may land on the fenced one.
    for i in 0..60 {
        let q = place(&m, ledger.occupancy(), &threads(1), Strategy::BestFit).unwrap();
        assert!(!q.cpus.intersects(&p.fenced));
        ledger.allocate(&format!("j{i}"), &q, "x").unwrap();
    }
    let err = place(&m, ledger.occupancy(), &threads(1), Strategy::BestFit).unwrap_err();
    assert!(matches!(err, PlaceError::NotEnoughFree { free: 0, .. }), "{err}");
    ledger.check().unwrap();
}

#[test]
fn an_exclusive_job_needs_wholly_free_cores() {
    let m = machine();
    // One thread of every core is held: no core is wholly free.
    let occ = Occupancy { held: set("0-31"), fenced: CpuSet::new() };
    let req = Request {
        exclusive: Some(Exclusive { level: Level::Core, scope: Scope::AllJobs }),
        ..threads(1)
    };
    let err = place(&m, &occ, &req, Strategy::BestFit).unwrap_err();
    assert!(matches!(err, PlaceError::NotEnoughFree { free: 0, .. }), "{err}");
}

#[test]
fn same_numa_keeps_each_task_in_one_node() {
    let m = machine();
    // Node 0 has 3 free cores (cores 0-4 held), node 1 has 8, the other package is full.
    let held = set("0-4,32-36,16-31,48-63");
    let occ = Occupancy { held, fenced: CpuSet::new() };
    let p = place(&m, &occ, &cores(2, 4, Some(Level::Numa)), Strategy::BestFit).unwrap();
    assert_eq!(p.tasks.len(), 4);
    for t in &p.tasks {
        assert_eq!(t.len(), 4, "two whole cores of two threads");
        assert_eq!(m.touched(Level::Numa, t).len(), 1, "task {t} spans NUMA nodes");
    }
}

#[test]
fn same_shape_is_rejected_while_free_when_fragmented() {
    let m = machine();
    // Every NUMA node keeps exactly one free core: 4 free cores, but no node has 2.
    let mut held = m.allocatable.clone();
    for core in [0u32, 8, 16, 24] {
        held.remove(core);
        held.remove(core + 32);
    }
    let occ = Occupancy { held, fenced: CpuSet::new() };
    let err = place(&m, &occ, &cores(2, 1, Some(Level::Numa)), Strategy::BestFit).unwrap_err();
    assert!(err.rejected_while_free(), "{err}");
    assert!(err.to_string().contains("inside one NUMA node"), "{err}");
    // Without the shape the same job fits.
    assert!(place(&m, &occ, &cores(2, 1, None), Strategy::BestFit).is_ok());
}

#[test]
fn cpu_list_and_max_cpu_per_node() {
    let m = machine();
    let req = Request { cpu_list: Some(set("40-47")), ..threads(4) };
    let p = place(&m, &Occupancy::default(), &req, Strategy::BestFit).unwrap();
    assert!(p.cpus.is_subset(&set("40-47")));
    let req = Request { max_cpu_per_node: Some(2), ..threads(8) };
    let p = place(&m, &Occupancy::default(), &req, Strategy::BestFit).unwrap();
    assert_eq!(p.metrics.numa_nodes, 4);
    for n in &m.numa {
        assert!(n.intersection_len(&p.cpus) <= 2);
    }
    let req = Request { max_cpu_per_node: Some(2), ..threads(9) };
    assert!(place(&m, &Occupancy::default(), &req, Strategy::BestFit).is_err());
}

#[test]
fn a_cpu_list_of_cpus_the_host_does_not_have_says_so() {
    // The 64-CPU machine: CPUs 5000-6000 do not exist; that is not "0 free inside CPU_LIST".
    let m = machine();
    let req = Request { cpu_list: Some(set("5000-6000")), ..threads(2) };
    let e = place(&m, &Occupancy::default(), &req, Strategy::BestFit).unwrap_err();
    assert!(matches!(e, PlaceError::Impossible(_)), "{e}");
    assert!(
        e.to_string().contains("CPU_LIST names CPUs 5000-6000, which this host does not have"),
        "{e}"
    );
    // Some on the host and some not: still named.
    let req = Request { cpu_list: Some(set("60-70")), ..threads(2) };
    let e = place(&m, &Occupancy::default(), &req, Strategy::BestFit).unwrap_err();
    assert!(e.to_string().contains("CPUs 64-70"), "{e}");
    // The same from the plug-ins' fit-and-score, which ranks hosts by the same code.
    let held = Occupancy { held: set("40-47"), fenced: CpuSet::new() };
    let req = Request { cpu_list: Some(set("40-47")), ..threads(2) };
    let e = place(&m, &held, &req, Strategy::BestFit).unwrap_err();
    assert!(e.to_string().contains("inside CPU_LIST"), "CPUs that exist but are held: {e}");
}

#[test]
fn max_radius_keeps_the_job_in_one_package() {
    let m = machine();
    // Package 0: node 0 full, node 1 has 8 free. Package 1: node 2 has 10 free, node 3 full.
    let held = set("0-7,32-39,24-31,56-63,16-19,48").union(&set("8-11,40-43"));
    let occ = Occupancy { held, fenced: CpuSet::new() };
    let free = occ.free(&m);
    assert_eq!(free.len(), 8 + 11, "setup: 8 free in node 1, 11 in node 2");
    let req = Request { max_radius: Some(1), ..threads(free.len() as u32) };
    let err = place(&m, &occ, &req, Strategy::BestFit).unwrap_err();
    assert!(err.to_string().contains("MAX_RADIUS"), "{err}");
    let ok = Request { max_radius: Some(2), ..threads(free.len() as u32) };
    assert!(place(&m, &occ, &ok, Strategy::BestFit).is_ok());
}

#[test]
fn whole_domain_units_and_memory_binding() {
    let m = machine();
    let req = Request {
        unit: Level::Numa,
        tasks: Some(2),
        membind: MemBind::LocalOnly,
        ..Request::default()
    };
    let p = place(&m, &Occupancy::default(), &req, Strategy::BestFit).unwrap();
    assert_eq!(p.cpus.len(), 32);
    assert_eq!(p.metrics.numa_nodes, 2);
    assert_eq!(p.metrics.sockets, 1);
    assert_eq!(p.mems, set("0-1"));
    let prefer = place(&m, &Occupancy::default(), &threads(2), Strategy::BestFit).unwrap();
    assert_eq!(prefer.mems, set("0-3"), "localprefer: every node, local first");
}

#[test]
fn impossible_requests_say_so() {
    let m = machine();
    let e = place(&m, &Occupancy::default(), &threads(65), Strategy::BestFit).unwrap_err();
    assert!(matches!(e, PlaceError::Impossible(_)), "{e}");
    let e = place(&m, &Occupancy::default(), &cores(9, 1, Some(Level::L3)), Strategy::BestFit)
        .unwrap_err();
    assert!(e.to_string().contains("largest L3 group has 4"), "{e}");
}

#[test]
fn every_strategy_places_a_plain_job() {
    let m = machine();
    for s in Strategy::ALL {
        let p = place(&m, &Occupancy::default(), &threads(12), s).unwrap();
        assert_eq!(p.cpus.len(), 12, "{s}");
        assert_eq!(p.tasks.len(), 12, "{s}");
        assert_eq!(s.name().parse::<Strategy>().unwrap(), s);
    }
    assert!("bestfit".parse::<Strategy>().unwrap_err().to_string().contains("best-fit"));
}

#[test]
fn balance_spreads_and_pack_fills() {
    let m = machine();
    let p = place(&m, &Occupancy::default(), &threads(4), Strategy::Balance).unwrap();
    assert_eq!(p.metrics.sockets, 2);
    let occ = Occupancy { held: set("0"), fenced: CpuSet::new() };
    let p = place(&m, &occ, &threads(4), Strategy::Pack).unwrap();
    assert!(p.cpus.is_subset(&set("0-3,32-35")), "pack fills the used L3 group first: {}", p.cpus);
}

#[test]
fn fit_and_score_on_a_summary_matches_the_host() {
    let m = machine();
    let mut ledger = Ledger::new();
    for (i, n) in [3u32, 8, 5, 1, 16].into_iter().enumerate() {
        let p = place(&m, ledger.occupancy(), &threads(n), Strategy::BestFit).unwrap();
        ledger.allocate(&format!("j{i}"), &p, "x").unwrap();
    }
    // What a plug-in caches: the occupancy, serialized and read back.
    let wire = serde_json::to_string(ledger.occupancy()).unwrap();
    let v: serde_json::Value = serde_json::from_str(&wire).unwrap();
    let summary = Occupancy {
        held: CpuSet::parse_list(v["held"].as_str().unwrap()).unwrap(),
        fenced: CpuSet::parse_list(v["fenced"].as_str().unwrap()).unwrap(),
    };
    for n in [1u32, 2, 6, 12, 20] {
        let req = threads(n);
        let host = place(&m, ledger.occupancy(), &req, Strategy::BestFit).unwrap();
        let fit = fit_and_score(&m, &summary, &req).unwrap();
        assert_eq!(fit.cpus, host.cpus);
        assert_eq!(fit.score, score(&host.metrics));
    }
}

fn arb_request() -> impl PropStrategy<Value = Request> {
    let unit = prop_oneof![Just(Level::Thread), Just(Level::Core)];
    let same = prop_oneof![
        Just(None),
        Just(Some(Level::L3)),
        Just(Some(Level::Numa)),
        Just(Some(Level::Socket))
    ];
    let spread = prop_oneof![
        Just(None),
        Just(Some(Exclusive { level: Level::Core, scope: Scope::InTask })),
        Just(Some(Exclusive { level: Level::L3, scope: Scope::InJob })),
        Just(Some(Exclusive { level: Level::Numa, scope: Scope::InJob })),
    ];
    (unit, 1u32..5, 1u32..5, same, any::<bool>(), spread).prop_map(
        |(unit, upt, tasks, same, excl, spread)| Request {
            unit,
            units_per_task: upt,
            tasks: Some(tasks),
            same,
            exclusive: spread.filter(|e| e.level > unit),
            cpuset_options: if excl { vec![CpusetOption::CpuExclusive] } else { vec![] },
            ..Request::default()
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Random allocate/release sequences: every placement lies in free CPUs, has the asked size
    /// and shape, and the ledger's invariants hold after every step.
    #[test]
    fn ledger_invariants_hold(ops in proptest::collection::vec((arb_request(), 0usize..7, any::<bool>()), 1..60)) {
        let m = machine();
        let mut ledger = Ledger::new();
        for (i, (req, strat, release)) in ops.into_iter().enumerate() {
            let strategy = Strategy::ALL[strat];
            if release && !ledger.is_empty() {
                let victim = ledger.jobs().nth(i % ledger.len()).map(|a| a.job.clone()).unwrap();
                ledger.release(&victim).unwrap();
            } else if let Ok(p) = place(&m, ledger.occupancy(), &req, strategy) {
                let free = ledger.occupancy().free(&m);
                prop_assert!(p.cpus.is_subset(&free), "{strategy}: {} outside free {}", p.cpus, free);
                prop_assert_eq!(p.tasks.len(), req.tasks.unwrap() as usize);
                let per_unit = if req.unit == Level::Core { 2 } else { 1 };
                if req.exclusive_level().is_none() || strategy.honours_shape() || req.unit == Level::Core {
                    prop_assert_eq!(p.cpus.len(), (req.tasks.unwrap() * req.units_per_task) as usize * per_unit);
                }
                if let (Some(same), true) = (req.same, strategy.honours_shape()) {
                    for t in &p.tasks {
                        prop_assert_eq!(m.touched(same, t).len(), 1, "{}: task {} breaks same={:?}", strategy, t, same);
                    }
                }
                if strategy.honours_shape() {
                    if let Some(level) = req.task_spread_level() {
                        let mut seen = CpuSet::new();
                        for t in &p.tasks {
                            let doms = m.touched_set(level, t);
                            prop_assert!(!doms.intersects(&seen), "{}: tasks share a {:?}: {:?}", strategy, level, p.tasks);
                            seen.union_with(&doms);
                        }
                    }
                    if let Some(level) = req.unit_spread_level() {
                        let units = p.cpus.len() / per_unit;
                        prop_assert_eq!(m.touched(level, &p.cpus).len(), units, "{}: units share a {:?}: {}", strategy, level, p.cpus);
                    }
                }
                ledger.allocate(&format!("job{i}"), &p, "x").unwrap();
            }
            prop_assert!(ledger.check().is_ok(), "{:?}", ledger.check());
        }
    }
}

#[test]
fn injob_puts_each_task_in_its_own_domain() {
    let m = machine();
    // IBM's example: two tasks of two cores, each in one socket, the two on different sockets.
    let req = Request {
        exclusive: Some(Exclusive { level: Level::Socket, scope: Scope::InJob }),
        ..cores(2, 2, Some(Level::Socket))
    };
    let p = place(&m, &Occupancy::default(), &req, Strategy::BestFit).unwrap();
    let sockets: Vec<Vec<usize>> = p.tasks.iter().map(|t| m.touched(Level::Socket, t)).collect();
    assert_eq!(sockets.len(), 2);
    assert_eq!(sockets[0].len(), 1);
    assert_eq!(sockets[1].len(), 1);
    assert_ne!(sockets[0], sockets[1], "{:?}", p.tasks);
    assert!(p.fenced.is_empty(), "injob keeps other jobs out of nothing");
    // Three such tasks cannot fit two sockets.
    let three = Request { tasks: Some(3), ..req };
    assert!(place(&m, &Occupancy::default(), &three, Strategy::BestFit)
        .unwrap_err()
        .to_string()
        .contains("injob"));
}

#[test]
fn intask_gives_every_unit_its_own_domain() {
    let m = machine();
    let req = Request {
        exclusive: Some(Exclusive { level: Level::Core, scope: Scope::InTask }),
        units_per_task: 4,
        ..threads(1)
    };
    let p = place(&m, &Occupancy::default(), &req, Strategy::BestFit).unwrap();
    assert_eq!(p.cpus.len(), 4);
    assert_eq!(
        m.touched(Level::Core, &p.cpus).len(),
        4,
        "four threads on four different cores: {}",
        p.cpus
    );
    assert_eq!(m.touched(Level::L3, &p.cpus).len(), 1, "and still close together: {}", p.cpus);
}

#[test]
fn cpubind_and_distribute() {
    let m = machine();
    let req = Request { cpubind: Some(Level::Socket), ..cores(1, 2, None) };
    let p = place(&m, &Occupancy::default(), &req, Strategy::BestFit).unwrap();
    assert_eq!(p.tasks.len(), 2);
    assert!(
        p.bind.iter().all(|b| *b == p.cpus),
        "both tasks bound to the job's CPUs in their socket: {:?}",
        p.bind
    );
    let plain = place(&m, &Occupancy::default(), &cores(1, 2, None), Strategy::BestFit).unwrap();
    assert_eq!(plain.bind, plain.tasks);
    let spread = Request { distribute: crate::request::Distribute::Balance, ..threads(4) };
    let p = place(&m, &Occupancy::default(), &spread, Strategy::BestFit).unwrap();
    assert_eq!(p.metrics.sockets, 2, "distribute=balance spreads: {}", p.cpus);
}

#[test]
fn a_resize_keeps_the_tasks_it_can_and_places_new_ones_near_and_in_shape() {
    let m = machine();
    let req: Request = "affinity[core(1)*2-8]".parse().unwrap();
    let first = place(&m, &Occupancy::default(), &req, Strategy::BestFit).unwrap();
    let mut ledger = Ledger::new();
    ledger.allocate("m", &first, "m").unwrap();
    // Another job right beside it.
    let other = place(&m, ledger.occupancy(), &cores(1, 2, None), Strategy::BestFit).unwrap();
    ledger.allocate("other", &other, "other").unwrap();
    // Grow to 6: the first two tasks stay, four new ones come, none on the other job's CPUs.
    let grown = resize(&m, ledger.occupancy(), &req, &first.tasks, 6, Strategy::BestFit).unwrap();
    assert_eq!(grown.tasks.len(), 6);
    assert_eq!(grown.tasks[..2], first.tasks[..]);
    assert!(!grown.cpus.intersects(&other.cpus));
    assert_eq!(grown.metrics.numa_nodes, 1, "grown within its node: {}", grown.cpus);
    // Shrink to 3: its first three tasks.
    let shrunk = resize(&m, ledger.occupancy(), &req, &grown.tasks, 3, Strategy::BestFit).unwrap();
    assert_eq!(shrunk.tasks, grown.tasks[..3].to_vec());
    // Injob spread against its own tasks: a new task never shares a socket with an old one.
    let spread: Request = "affinity[core(1,exclusive=(socket,injob))*1-2]".parse().unwrap();
    let one = place(&m, &Occupancy::default(), &spread, Strategy::BestFit).unwrap();
    let mut l = Ledger::new();
    l.allocate("s", &one, "s").unwrap();
    let two = resize(&m, l.occupancy(), &spread, &one.tasks, 2, Strategy::BestFit).unwrap();
    let sockets: Vec<_> =
        two.tasks.iter().map(|t| m.domain_of(Level::Socket, t.first().unwrap())).collect();
    assert_ne!(sockets[0], sockets[1], "{:?}", two.tasks);
    // Too big for what is free: refused, nothing chosen.
    assert!(resize(&m, ledger.occupancy(), &req, &first.tasks, 40, Strategy::BestFit).is_err());
    assert!(resize(&m, ledger.occupancy(), &req, &first.tasks, 0, Strategy::BestFit).is_err());
}

#[test]
fn a_jobs_cpus_split_into_tasks_as_its_request_shapes_them() {
    use crate::topology::{SyntheticShape, Topology};
    let topo = Topology::synthetic(SyntheticShape {
        packages: 1,
        numa_per_package: 1,
        l3_per_numa: 1,
        cores_per_l3: 4,
        threads_per_core: 2,
    });
    let model = HostModel::new(&topo, &CpuSet::new()).unwrap();
    let req = |r: &str| crate::request::parse(r).unwrap();
    let core0 = model.domains(Level::Core)[0].clone();
    let core1 = model.domains(Level::Core)[1].clone();
    let two_cores = core0.union(&core1);
    // Two whole cores: two tasks of a core, one of two cores, four of a thread.
    let split = split_into_tasks(&model, &req("affinity[core*1-4]"), &two_cores).unwrap();
    assert_eq!(split, vec![core0.clone(), core1.clone()]);
    // Threads two to a core: each task one core's threads, however they are numbered.
    let siblings = split_into_tasks(&model, &req("affinity[thread(2,same=core)*1-4]"), &two_cores);
    assert_eq!(siblings.unwrap(), vec![core0.clone(), core1.clone()]);
    let pairs = split_into_tasks(&model, &req("affinity[core(2)*1-2]"), &two_cores).unwrap();
    assert_eq!(pairs.len(), 1);
    let threads = split_into_tasks(&model, &req("affinity[thread*1-8]"), &two_cores).unwrap();
    assert_eq!(threads.len(), 4);
    // A core cut short, units left over, or a count out of range: not known.
    let first = core0.iter().next().unwrap();
    let cut = two_cores.difference(&CpuSet::from_iter([first]));
    assert_eq!(split_into_tasks(&model, &req("affinity[core*1-4]"), &cut), None);
    let three = CpuSet::union_all(&model.domains(Level::Core)[..3]);
    assert_eq!(split_into_tasks(&model, &req("affinity[core(2)*1-2]"), &three), None);
    assert_eq!(split_into_tasks(&model, &req("affinity[core*3-4]"), &two_cores), None);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    /// The model's counting shortcuts give what testing each domain's set gives: the first CPU
    /// of each domain wholly inside a set, and the cores clear of a set. With two threads per
    /// core siblings are 32 apart, so a core's two CPUs sit in different words of the bit
    /// vector; with one, each core is a CPU (the shortcut for hosts without SMT).
    #[test]
    fn whole_domains_and_clear_cores_match_testing_each_domain(
        members in proptest::collection::vec(any::<bool>(), 64),
        reserved in 0u32..4,
        threads_per_core in 1u32..3,
    ) {
        let topo = Topology::synthetic(SyntheticShape {
            packages: 2,
            numa_per_package: 2,
            l3_per_numa: 2,
            cores_per_l3: 8 / threads_per_core,
            threads_per_core,
        });
        // Reserving CPUs leaves cores of one thread beside cores of two.
        let m = HostModel::new(&topo, &(0..reserved).map(|i| 32 + 4 * i).collect()).unwrap();
        let cpus: CpuSet = (0..64u32).filter(|&c| members[c as usize]).collect();
        for level in [Level::Core, Level::L3, Level::Numa, Level::Socket] {
            let by_sets: CpuSet = m
                .domains(level)
                .iter()
                .filter(|d| d.is_subset(&cpus))
                .filter_map(|d| d.first())
                .collect();
            prop_assert_eq!(m.whole_domain_firsts(level, &cpus), by_sets);
        }
        prop_assert_eq!(m.whole_domain_firsts(Level::Thread, &cpus), cpus.clone());
        let touched = m.cores.iter().filter(|c| c.intersects(&cpus)).count();
        prop_assert_eq!(m.cores_touching(&cpus), touched);
        let clear = m.cores.iter().filter(|c| !c.intersects(&cpus)).count();
        prop_assert_eq!(m.cores_clear_of(&cpus), clear);
    }
}

/// A machine for the shortcut comparison: flat, or packages of NUMA nodes of L3 groups of cores
/// of one or two threads, with some CPUs reserved (cores of one thread beside cores of two).
fn arb_model() -> impl PropStrategy<Value = HostModel> {
    let flat = (1u32..80).prop_map(Topology::flat);
    let shaped = (1u32..3, 1u32..3, 1u32..3, 1u32..10, 1u32..3).prop_map(|(p, n, l, c, t)| {
        Topology::synthetic(SyntheticShape {
            packages: p,
            numa_per_package: n,
            l3_per_numa: l,
            cores_per_l3: c,
            threads_per_core: t,
        })
    });
    (prop_oneof![flat, shaped], proptest::collection::vec(0u32..160, 0..3)).prop_map(
        |(topo, reserved)| {
            let reserved: CpuSet =
                reserved.into_iter().filter(|&c| c + 1 < topo.pus.len() as u32).collect();
            HostModel::new(&topo, &reserved).unwrap()
        },
    )
}

/// Requests for the shortcut comparison: the shapes of `arb_request`, plain counts of threads
/// and cores (what the simulator and most batch jobs ask), and per-NUMA-node caps.
fn arb_any_request() -> impl PropStrategy<Value = Request> {
    let plain =
        (any::<bool>(), 1u32..40, proptest::option::of(1u32..6)).prop_map(|(by_core, n, cap)| {
            Request {
                max_cpu_per_node: cap,
                ..if by_core { cores(1, n, None) } else { threads(n) }
            }
        });
    prop_oneof![arb_request(), plain]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(600))]

    /// The engine's shortcut for nodes of many cores of one size (the lowest-numbered cores that
    /// are free, without sorting or searching them) chooses what the general search and split
    /// choose, for every strategy, on machines flat and shaped, partly busy.
    #[test]
    fn the_flat_node_shortcut_places_as_the_general_walk(
        m in arb_model(),
        busy in proptest::collection::vec(any::<bool>(), 160),
        req in arb_any_request(),
    ) {
        let held: CpuSet = m.allocatable.iter().filter(|&c| busy[c as usize % 160]).collect();
        let occ = Occupancy { held, fenced: CpuSet::new() };
        /// Places by the general walk while it lives, also when that panics (proptest catches
        /// the panic and shrinks on the same thread).
        struct GeneralWalk;
        impl Drop for GeneralWalk {
            fn drop(&mut self) {
                super::engine::tests::NO_SHORTCUTS.set(false);
            }
        }
        for strategy in Strategy::ALL {
            let fast = place(&m, &occ, &req, strategy);
            let general = {
                super::engine::tests::NO_SHORTCUTS.set(true);
                let _general = GeneralWalk;
                place(&m, &occ, &req, strategy)
            };
            prop_assert_eq!(fast, general, "{:?} {}", strategy, m.name);
        }
    }
}
