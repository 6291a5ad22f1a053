//! The host's unit tests, on the fake cgroup kernel.

use super::*;
use crate::cgroup::fake::Fake;
use topo_core::topology::SyntheticShape;

/// A fake "kernel" that can outlive a Host (restart tests) and, when asked, offers
/// self-join files as the v1 backend does.
struct SharedFake {
    kernel: std::sync::Arc<Fake>,
    offers_self_join: bool,
    /// What foreign exclusive cpusets hold, as the test sets it.
    foreign: std::sync::Arc<std::sync::Mutex<CpuSet>>,
}

impl CgroupBackend for SharedFake {
    fn kind(&self) -> &'static str {
        "fake"
    }
    fn confines_devices(&self) -> bool {
        self.kernel.confines_devices()
    }
    fn set_device_rules(
        &self,
        j: &JobId,
        denied: &[crate::cgroup::CharDevice],
        allowed: &[crate::cgroup::CharDevice],
    ) -> Result<(), CgroupError> {
        self.kernel.set_device_rules(j, denied, allowed)
    }
    fn create(&self, j: &JobId, s: &CgroupSpec) -> Result<crate::cgroup::Effective, CgroupError> {
        self.kernel.create(j, s)
    }
    fn update(&self, j: &JobId, s: &CgroupSpec) -> Result<crate::cgroup::Effective, CgroupError> {
        self.kernel.update(j, s)
    }
    fn join(&self, j: &JobId, p: i32) -> Result<(), CgroupError> {
        self.kernel.join(j, p)
    }
    fn self_join_files(&self, j: &JobId) -> Result<Vec<PathBuf>, CgroupError> {
        Ok(if self.offers_self_join {
            vec![PathBuf::from(format!("/fake/{}/tasks", j.as_str()))]
        } else {
            Vec::new()
        })
    }
    fn pids(&self, j: &JobId) -> Result<Vec<i32>, CgroupError> {
        self.kernel.pids(j)
    }
    fn release(&self, j: &JobId, t: Duration) -> Result<crate::cgroup::ReleaseReport, CgroupError> {
        self.kernel.release(j, t)
    }
    fn list(&self) -> Result<Vec<(JobId, crate::cgroup::Effective)>, CgroupError> {
        self.kernel.list()
    }
    fn foreign_cpus(&self) -> Result<CpuSet, CgroupError> {
        Ok(self.foreign.lock().unwrap().clone())
    }
    fn freeze(&self, j: &JobId, t: Duration) -> Result<(), CgroupError> {
        self.kernel.freeze(j, t)
    }
    fn thaw(&self, j: &JobId, t: Duration) -> Result<(), CgroupError> {
        self.kernel.thaw(j, t)
    }
    fn is_frozen(&self, j: &JobId) -> Result<bool, CgroupError> {
        self.kernel.is_frozen(j)
    }
}

/// Two packages of one NUMA node each, two L3 groups of four two-thread cores per node.
fn two_packages() -> Topology {
    Topology::synthetic(SyntheticShape {
        packages: 2,
        numa_per_package: 1,
        l3_per_numa: 2,
        cores_per_l3: 4,
        threads_per_core: 2,
    })
}

fn host(records: Option<Records>) -> Host {
    let topo = two_packages();
    let fake = Fake::new(topo.allowed.clone(), topo.allowed_mems.clone());
    Host::new(topo, CpuSet::new(), Box::new(fake), records, Strategy::BestFit).unwrap()
}

/// Two packages, each one NUMA node of four single-thread cores.
pub(super) fn two_nodes_of_four() -> Topology {
    Topology::synthetic(SyntheticShape {
        packages: 2,
        numa_per_package: 1,
        l3_per_numa: 1,
        cores_per_l3: 4,
        threads_per_core: 1,
    })
}

/// One package, one NUMA node and one L3 group of `cores` single-thread cores.
pub(super) fn small_topology(cores: u32) -> Topology {
    Topology::synthetic(SyntheticShape {
        packages: 1,
        numa_per_package: 1,
        l3_per_numa: 1,
        cores_per_l3: cores,
        threads_per_core: 1,
    })
}

/// A fake kernel that outlives the hosts started on it, as the cgroup tree outlives topod.
fn kernel_for(topo: &Topology) -> std::sync::Arc<Fake> {
    std::sync::Arc::new(Fake::new(topo.allowed.clone(), topo.allowed_mems.clone()))
}

/// A host on `kernel`, with its job records in `records` when given: start it again on the
/// same kernel and directory to restart topod.
fn host_on(
    topo: &Topology,
    kernel: &std::sync::Arc<Fake>,
    records: Option<&std::path::Path>,
) -> Host {
    let backend = Box::new(SharedFake {
        kernel: kernel.clone(),
        offers_self_join: false,
        foreign: Default::default(),
    });
    let records = records.map(|dir| Records::open(dir).unwrap());
    Host::new(topo.clone(), CpuSet::new(), backend, records, Strategy::BestFit).unwrap()
}

/// A malleable job recovered from its cgroup without its record (issue 29): asked again by
/// the batch system, its tasks are taken from its CPUs as its request shapes them, and a
/// resize works; where its CPUs do not divide into tasks of the request, a resize is
/// refused saying why, instead of answering ok and changing nothing.
#[test]
fn a_malleable_job_recovered_without_its_record_keeps_its_tasks_or_refuses_resizes() {
    let topo = small_topology(8);
    let kernel = kernel_for(&topo);
    let mut first = host_on(&topo, &kernel, None);
    let a = first.allocate("7", "affinity[core*2-4]", Some(4), None, None, None).unwrap();
    assert_eq!(a.tasks.len(), 4);
    let b = first.allocate("8", "affinity[core*3]", None, None, None, None).unwrap();
    assert_eq!(b.cpus.len(), 3);
    drop(first);
    // Their records lost: both come back as one task over their CPUs, request unknown.
    let records = tempfile::tempdir().unwrap();
    let mut h = host_on(&topo, &kernel, Some(records.path()));
    h.recover(BTreeMap::new()).unwrap();
    assert!(matches!(h.resize("7", 2), Err(HostError::NotMalleable { .. })));
    let again = h.allocate("7", "affinity[core*2-4]", Some(4), None, None, None).unwrap();
    assert_eq!(again.cpus, a.cpus);
    assert_eq!(again.tasks.len(), 4, "{:?}", again.tasks);
    let shrunk = h.resize("7", 2).unwrap();
    assert_eq!((shrunk.tasks.len(), shrunk.cpus.len()), (2, 2));
    // Three cores do not divide into tasks of two cores each.
    h.allocate("8", "affinity[core(2)*1-2]", Some(1), None, None, None).unwrap();
    let refused = |h: &mut Host| {
        let e = h.resize("8", 1).unwrap_err();
        assert!(matches!(e, HostError::TasksUnknown { .. }), "{e}");
        assert!(e.to_string().contains("its tasks are not known"), "{e}");
        assert_eq!(h.ledger.get("8").unwrap().cpus, b.cpus, "nothing changed");
    };
    refused(&mut h);
    // Nor does equipartition resize it (it would share the free CPUs out to it).
    h.set_equipartition(true);
    let resized = h.rebalance();
    assert!(!resized.contains(&"8".to_string()), "{resized:?}");
    assert_eq!(h.ledger.get("8").unwrap().cpus, b.cpus, "nothing changed");
    h.allocate("9", "affinity[core*1-2]", Some(2), None, None, None).unwrap();
    drop(h);
    // Restarted with the records written since: job 8's tasks are still not known (its
    // record keeps it, not the one task made up for it); job 7's and 9's are.
    let mut after = host_on(&topo, &kernel, Some(records.path()));
    after.recover(BTreeMap::new()).unwrap();
    refused(&mut after);
    assert_eq!(after.resize("7", 3).unwrap().tasks.len(), 3);
    assert_eq!(after.resize("9", 1).unwrap().tasks.len(), 1);
}

/// Seen once in the suite's crash test on cgroup v2 (SIGKILLs at random points, with
/// equipartition): a malleable job came back with a record whose tasks its cgroup no
/// longer matched, and every later resize was refused. Its request is in the record, so
/// its CPUs are divided as the request shapes them, as when the batch system asks again.
#[test]
fn a_malleable_job_whose_record_its_cgroup_no_longer_matches_is_divided_again() {
    use crate::cgroup::CgroupBackend;
    let topo = small_topology(8);
    let kernel = kernel_for(&topo);
    let dir = tempfile::tempdir().unwrap();
    let mut first = host_on(&topo, &kernel, Some(dir.path()));
    let a = first.allocate("7", "affinity[thread*1-4]", Some(4), None, None, None).unwrap();
    assert_eq!(a.tasks.len(), 4);
    drop(first);
    // Two of its CPUs taken from its cgroup behind the record's back.
    let two = CpuSet::union_all(&a.tasks[..2]);
    let spec = CgroupSpec {
        cpus: two.clone(),
        mems: a.mems.clone(),
        memory_limit: None,
        ..Default::default()
    };
    kernel.update(&JobId::parse("7").unwrap(), &spec).unwrap();
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    h.recover(BTreeMap::new()).unwrap();
    assert_eq!(h.ledger().get("7").unwrap().tasks.len(), 2);
    assert!(!h.hints["7"].tasks_unknown);
    assert_eq!(h.resize("7", 1).unwrap().tasks.len(), 1);
    assert_eq!(h.resize("7", 3).unwrap().tasks.len(), 3);
    h.ledger().check().unwrap();
}

#[test]
fn allocate_is_idempotent_and_release_frees() {
    let mut h = host(None);
    let a = h.allocate("7", "affinity[core(2)*2]", None, None, None, None).unwrap();
    assert_eq!(a.cpus.len(), 8);
    assert_eq!(h.allocate("7", "affinity[core(2)*2]", None, None, None, None).unwrap(), a);
    assert!(matches!(
        h.allocate("7", "affinity[thread]", None, None, None, None),
        Err(HostError::AlreadyAllocated { .. })
    ));
    h.join("7", 123).unwrap();
    assert!(
        matches!(h.join("7", std::process::id() as i32), Err(HostError::BadPid(_))),
        "topod never moves itself"
    );
    assert!(matches!(h.join("8", 123), Err(HostError::UnknownJob(_))));
    // Init moved in would confine the whole host with the job and keep it from being released
    // (an attack finding: an administrator's join of pid 1 was accepted).
    let init = h.join("7", 1).unwrap_err().to_string();
    assert!(
        init.contains("pid 1 is not a process topod can move") && init.contains("host's init"),
        "{init}"
    );
    assert!(h.release_empty().is_empty(), "job 7 still has its process");
    assert_eq!(h.release("7").unwrap(), 1);
    // A job that had a process and has none left goes by itself; one never joined stays.
    h.allocate("10", "affinity[thread]", None, None, None, None).unwrap();
    h.allocate("11", "affinity[thread]", None, None, None, None).unwrap();
    h.join("10", 77).unwrap();
    h.backend.release(&JobId::parse("10").unwrap(), Duration::from_secs(1)).unwrap();
    h.backend
        .create(
            &JobId::parse("10").unwrap(),
            &CgroupSpec {
                cpus: h.ledger().get("10").unwrap().cpus.clone(),
                mems: h.ledger().get("10").unwrap().mems.clone(),
                memory_limit: None,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(h.release_empty(), ["10"]);
    assert!(h.ledger().get("11").is_some());
    h.release("11").unwrap();
    assert!(h.ledger().is_empty());
    assert!(matches!(h.release("7"), Err(HostError::UnknownJob(_))));
}

#[test]
fn a_job_with_a_process_moving_itself_in_is_not_released_as_empty() {
    let topo = small_topology(4);
    let kernel = kernel_for(&topo);
    let mut h = Host::new(
        topo,
        CpuSet::new(),
        Box::new(SharedFake { kernel, offers_self_join: true, foreign: Default::default() }),
        None,
        Strategy::BestFit,
    )
    .unwrap();
    let a = h.allocate("20", "affinity[thread*2]", None, None, None, None).unwrap();
    let id = JobId::parse("20").unwrap();
    let empty_the_cgroup = |h: &mut Host| {
        h.backend.release(&id, Duration::from_secs(1)).unwrap();
        h.backend
            .create(
                &id,
                &CgroupSpec {
                    cpus: a.cpus.clone(),
                    mems: a.mems.clone(),
                    memory_limit: None,
                    ..Default::default()
                },
            )
            .unwrap();
    };
    // Task 0 joined and ended; task 1 was told how to move itself in and has not confirmed.
    h.join("20", 100).unwrap();
    assert_eq!(h.self_join_files("20").unwrap().len(), 1);
    empty_the_cgroup(&mut h);
    assert!(h.release_empty().is_empty(), "task 1 is on its way in");
    // Task 1 confirms; when it ends, the job goes.
    h.join("20", 101).unwrap();
    empty_the_cgroup(&mut h);
    assert_eq!(h.release_empty(), ["20"]);
    assert!(matches!(h.self_join_files("20"), Err(HostError::UnknownJob(_))));
}

#[test]
fn bad_input_changes_nothing() {
    let mut h = host(None);
    for (job, req) in [
        ("../x", "affinity[thread]"),
        ("a/b", "affinity[thread]"),
        (".", "affinity[thread]"),
        ("ok", "affinity[cores]"),
        ("ok", "affinity[thread*999]"),
    ] {
        assert!(h.allocate(job, req, None, None, None, None).is_err(), "{job} {req}");
    }
    assert!(h.ledger().is_empty());
    assert!(
        h.allocate("9", "affinity[thread*4]", None, Some("0-1"), None, None).is_err(),
        "inside the CPUs the batch system gave"
    );
    let inside = h.allocate("9", "affinity[thread*2]", None, Some("8-9"), None, None).unwrap();
    assert_eq!(inside.cpus.to_string(), "8-9");
}

#[test]
fn a_restart_keeps_every_job_and_its_owner() {
    let dir = tempfile::tempdir().unwrap();
    let topo = small_topology(8);
    let kernel = kernel_for(&topo);
    let mut first = host_on(&topo, &kernel, Some(dir.path()));
    let a = first
        .allocate(
            "1",
            "CPUSET[CPUSET_OPTIONS=CPUSET_CPU_EXCLUSIVE] affinity[thread*3]",
            None,
            None,
            None,
            Some(1000),
        )
        .unwrap();
    let b = first.allocate("2", "affinity[thread*2]", None, None, None, None).unwrap();
    // Killed right after answering: no destructor, no background writer to finish.
    std::mem::forget(first);
    let mut again = host_on(&topo, &kernel, Some(dir.path()));
    let report = again.recover(BTreeMap::new()).unwrap();
    assert_eq!(report.kept, ["1", "2"]);
    assert_eq!(again.ledger().get("1").unwrap().cpus, a.cpus);
    assert_eq!(again.ledger().get("2").unwrap().request, b.request);
    assert_eq!(again.owner_of("1"), Some(1000), "the owner was durable before allocate answered");
    again.ledger().check().unwrap();
    // No CPU is handed out twice after the restart.
    let c = again.allocate("3", "affinity[thread*3]", None, None, None, None).unwrap();
    assert!(!c.cpus.intersects(&a.cpus) && !c.cpus.intersects(&b.cpus));
    // A released job's record goes with it.
    again.release("2").unwrap();
    assert!(!dir.path().join("jobs/2.json").exists());
    assert!(dir.path().join("jobs/1.json").exists());
}

#[test]
fn a_malleable_job_grows_shrinks_is_told_and_a_plan_cut_by_a_crash_is_finished() {
    let dir = tempfile::tempdir().unwrap();
    let topo = small_topology(8);
    let kernel = kernel_for(&topo);
    let notify = dir.path().join("notify");
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    h.set_notify_dir(Some(notify.clone())).unwrap();
    let cgroup_cpus = |job: &str| {
        kernel.list().unwrap().into_iter().find(|(j, _)| j.as_str() == job).unwrap().1.cpus
    };
    let told = |job: &str| std::fs::read_to_string(notify.join(job)).unwrap();
    h.allocate("rigid", "affinity[thread*2]", None, None, None, None).unwrap();
    let m = h.allocate("m", "affinity[thread*2-8]", None, None, None, None).unwrap();
    assert_eq!(m.tasks.len(), 6, "a malleable job starts with as many tasks as fit");
    assert_eq!(told("m"), format!("generation=1\ncpus={}\nmems={}\n", m.cpus, m.mems));
    let small = h.resize("m", 3).unwrap();
    assert_eq!(small.tasks, m.tasks[..3].to_vec(), "a shrink keeps the first tasks");
    assert_eq!(cgroup_cpus("m"), small.cpus);
    assert!(told("m").starts_with(&format!("generation=2\ncpus={}\n", small.cpus)));
    // Refusals change nothing.
    let g = h.ledger().generation();
    for (tasks, job, says) in [
        (1, "m", "2 to 8 tasks; 1 is outside"),
        (9, "m", "2 to 8 tasks; 9 is outside"),
        (1, "rigid", "not malleable"),
        (2, "nobody", "holds nothing"),
        (2, "../x", "job id"),
    ] {
        let e = h.resize(job, tasks).expect_err(says).to_string();
        assert!(e.contains(says), "{job} {tasks}: {e}");
    }
    h.allocate("r2", "affinity[thread*2]", None, None, None, None).unwrap();
    let e = h.resize("m", 5).unwrap_err().to_string();
    assert!(e.contains("does not fit"), "{e}");
    assert_eq!(h.ledger().get("m").unwrap(), &small);
    assert_eq!(h.ledger().generation(), g + 1, "only r2's allocation changed the ledger");
    let grown = h.resize("m", 4).unwrap();
    assert_eq!(grown.tasks[..3], small.tasks[..]);
    h.ledger().check().unwrap();
    // Killed between writing a plan and making it: the restart makes it.
    let planned = Allocation {
        cpus: grown.tasks[0].clone(),
        tasks: grown.tasks[..1].to_vec(),
        ..grown.clone()
    };
    let run = h.hints.get("m").and_then(|h| h.allocated_at.clone());
    let plan = crate::daemon::records::PlannedMove { to: planned.clone(), run };
    Records::open(dir.path()).unwrap().write_moves(std::slice::from_ref(&plan)).unwrap();
    std::mem::forget(h);
    let mut again = host_on(&topo, &kernel, Some(dir.path()));
    again.set_notify_dir(Some(notify.clone())).unwrap();
    again.recover(BTreeMap::new()).unwrap();
    assert_eq!(again.ledger().get("m").unwrap().tasks, planned.tasks);
    assert_eq!(cgroup_cpus("m"), planned.cpus);
    assert!(!dir.path().join("moves.json").exists());
    assert!(told("m").starts_with("generation=4\n"), "{}", told("m"));
    again.ledger().check().unwrap();
    again.release("m").unwrap();
    assert!(!notify.join("m").exists());
}

#[test]
fn a_reserved_block_keeps_others_out_drains_is_claimed_and_outlives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let topo = two_nodes_of_four();
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    h.set_clock(Arc::new(|| at(1_000)));
    let node = |h: &Host, job: &str| h.ledger().get(job).unwrap().cpus.clone();
    // One job on each node.
    h.allocate("a", "affinity[thread]", None, Some("0"), None, None).unwrap();
    h.allocate("b", "affinity[thread]", None, Some("4"), None, None).unwrap();
    let numa = prepare(&topo, "affinity[numa]", None, None).unwrap();
    let (r, busy) = h.reserve("big", &numa, 600).unwrap();
    assert_eq!(r.cpus.len(), 4);
    assert_eq!(busy.len(), 1, "one running job is inside the block: {} in {}", busy, r.cpus);
    assert_eq!(r.expires_at, 1_600);
    // fit and the free counts (what Slurm's features and PBS are made from) leave it out.
    assert!(h.fit("affinity[thread*4]", None).is_err(), "6 CPUs free, 3 outside the block");
    assert_eq!(h.snapshot().host_metrics().free_cpus, 3);
    // Others are placed outside, whatever fits best.
    let c = h.allocate("c", "affinity[thread*2]", None, None, None, None).unwrap();
    assert!(!c.cpus.intersects(&r.cpus), "{} in the block {}", c.cpus, r.cpus);
    let e = h.allocate("d", "affinity[thread*2]", None, None, None, None).unwrap_err();
    assert!(e.to_string().contains("does not fit"), "{e}");
    assert!(
        e.to_string().contains(&format!(
            "; it would fit without job big's reservation (CPUs {}, for 600 s more)",
            r.cpus
        )),
        "{e}"
    );
    // Refusals: bad ids, durations, an allocated job, an unknown reservation.
    for (job, secs, says) in [
        ("../x", 60, "job id"),
        ("e", 0, "1 s to"),
        ("e", MAX_RESERVATION_S + 1, "30 days"),
        ("c", 60, "already holds"),
    ] {
        let e = h.reserve(job, &numa, secs).expect_err(says).to_string();
        assert!(e.contains(says), "{job} {secs}: {e}");
    }
    assert!(h.unreserve("nobody").unwrap_err().to_string().contains("no topology reservation"));
    // Killed and restarted: the reservation is still there.
    std::mem::forget(h);
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    h.set_clock(Arc::new(|| at(1_100)));
    h.recover(BTreeMap::new()).unwrap();
    assert_eq!(h.reservations(), std::slice::from_ref(&r));
    // The block's job drains out; the named job is placed inside and spends it.
    let inside = h.ledger().jobs().find(|a| a.cpus.intersects(&r.cpus)).unwrap().job.clone();
    h.release(&inside).unwrap();
    let big = h.allocate("big", "affinity[thread*4]", None, None, None, None).unwrap();
    assert_eq!(big.cpus, r.cpus);
    assert!(h.reservations().is_empty());
    assert_eq!(node(&h, "big"), r.cpus);
    // Expiry: gone at its time, on the tick.
    let one = prepare(&topo, "affinity[thread]", None, None).unwrap();
    h.release("big").unwrap();
    h.reserve("later", &one, 10).unwrap();
    assert_eq!(h.expire_reservations(), Vec::<String>::new());
    h.set_clock(Arc::new(|| at(1_110)));
    assert!(h.reservations().is_empty(), "expired is not live");
    assert_eq!(h.expire_reservations(), ["later"]);
    h.ledger().check().unwrap();
}

#[test]
fn a_prime_pool_is_for_its_jobs_inside_its_windows_and_a_window_that_opens_moves_others_out() {
    let topo = two_nodes_of_four();
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    let configs: Vec<PoolConfig> = toml::from_str::<toml::Table>(
        r#"p = [{ name = "day", shape = "affinity[numa]", windows = ["Mon-Fri 08:00-18:00"], queues = ["interactive"], named = true, on_open = "migrate" }]"#,
    )
    .unwrap()["p"]
        .clone()
        .try_into()
        .unwrap();
    let pools = make_pools(h.model(), &configs).unwrap();
    let pool = pools[0].cpus.clone();
    assert_eq!(pool.len(), 4);
    // 1970-01-05 was a Monday: 07:00 (closed), then 08:00 (open).
    let monday = |h: i64, m: i64| 4 * 86_400 + h * 3600 + m * 60;
    let clock = Arc::new(std::sync::atomic::AtomicI64::new(monday(7, 0)));
    let c = clock.clone();
    h.set_clock(Arc::new(move || at(c.load(std::sync::atomic::Ordering::SeqCst) as u64)));
    h.set_pools(pools, Arc::new(|_| 0));
    // Closed: a batch job may go anywhere; two fill the pool's node and one more.
    let batch = |h: &mut Host, job: &str, n: u32| {
        let mut p = prepare(&topo, &format!("affinity[thread*{n}]"), None, None).unwrap();
        p.ask.queue = Some("batch".into());
        h.allocate_prepared(job, &p, None, None)
    };
    let a = batch(&mut h, "a", 4).unwrap();
    assert_eq!(a.cpus, pool, "best-fit fills the first node, the pool's");
    clock.store(monday(8, 0), std::sync::atomic::Ordering::SeqCst);
    // Open: the window's tick moves the batch job out, where there is room.
    assert_eq!(h.pool_windows(), ["a"]);
    assert!(!h.ledger().get("a").unwrap().cpus.intersects(&pool));
    assert!(h.pool_windows().is_empty(), "only the opening moves jobs");
    // Open: batch jobs stay out; there is no room outside for one more.
    let e = batch(&mut h, "b", 1).unwrap_err().to_string();
    assert!(e.contains("does not fit"), "{e}");
    // The refusal says why CPUs that look free are not the job's, and who may use them.
    assert!(
        e.contains(&format!("; it would fit without prime-time pool day (CPUs {pool}, open now; it admits jobs of queue interactive, jobs that name it (pool \"day\"))")),
        "{e}"
    );
    // A job that would not fit even without the pool is not told about it.
    let e = batch(&mut h, "b", 5).unwrap_err().to_string();
    assert!(e.contains("does not fit") && !e.contains("would fit without"), "{e}");
    // A job of its queue goes inside, as does one whose allocate names it.
    let mut p = prepare(&topo, "affinity[thread*2]", None, None).unwrap();
    p.ask.queue = Some("interactive".into());
    let i = h.allocate_prepared("i", &p, None, None).unwrap();
    assert!(i.cpus.is_subset(&pool));
    let mut p = prepare(&topo, "affinity[thread*2]", None, None).unwrap();
    p.ask.pool = Some("day".into());
    let n = h.allocate_prepared("n", &p, None, None).unwrap();
    assert!(n.cpus.is_subset(&pool));
    h.ledger().check().unwrap();
    // Bad configurations are refused with the pool's name.
    for (bad, says) in [
        (r#"{ name = "x", windows = ["Mon 08:00-09:00"] }"#, "one of the two"),
        (r#"{ name = "x", cpus = "0-99", windows = ["Mon 08:00-09:00"] }"#, "are not"),
        (r#"{ name = "x", cpus = "0", windows = [] }"#, "no windows"),
        (
            r#"{ name = "x", cpus = "0", windows = ["Mon 08:00-09:00"], named = false }"#,
            "admits no job",
        ),
        (r#"{ name = "x", cpus = "0", windows = ["Mon 9-10"] }"#, "HH:MM"),
    ] {
        let c: PoolConfig = toml::from_str::<toml::Table>(&format!("p = {bad}")).unwrap()["p"]
            .clone()
            .try_into()
            .unwrap();
        let e = make_pools(h.model(), &[c]).unwrap_err();
        assert!(e.contains("prime pool \"x\"") && e.contains(says), "{bad}: {e}");
    }
}

#[test]
fn malleable_jobs_share_by_equipartition_at_every_arrival_and_departure() {
    let topo = small_topology(8);
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    h.set_equipartition(true);
    let size = |h: &Host, job: &str| h.ledger().get(job).unwrap().tasks.len();
    h.allocate("m1", "affinity[thread*1-8]", None, None, None, None).unwrap();
    assert_eq!(size(&h, "m1"), 8);
    // A second malleable job: the first shrinks, they share 4 and 4.
    let m2 = h.allocate("m2", "affinity[thread*1-8]", None, None, None, None).unwrap();
    assert_eq!((size(&h, "m1"), size(&h, "m2")), (4, 4));
    assert_eq!(m2.tasks.len(), 4, "the answer is the job's allocation after the rebalance");
    // A rigid arrival takes its CPUs from them; they share the rest. Each is resized once,
    // straight to its share beside the arrival (not to its least and back up).
    let resizes = |h: &Host| (h.hints["m1"].notify_generation, h.hints["m2"].notify_generation);
    let before = resizes(&h);
    h.allocate("r", "affinity[thread*2]", None, None, None, None).unwrap();
    assert_eq!((size(&h, "m1"), size(&h, "m2"), size(&h, "r")), (3, 3, 2));
    assert_eq!(resizes(&h), (before.0 + 1, before.1 + 1));
    // A rigid job that cannot fit even with both at their least resizes nobody (a retried
    // refusal must not thrash the malleable jobs).
    let g = h.ledger().generation();
    let e = h.allocate("big", "affinity[thread*7]", None, None, None, None).unwrap_err();
    assert_eq!(h.ledger().generation(), g, "nothing was shrunk and grown back");
    assert!(e.to_string().contains("does not fit"), "{e}");
    assert_eq!((size(&h, "m1"), size(&h, "m2")), (3, 3));
    // A departure: they grow into what it leaves.
    h.release("r").unwrap();
    assert_eq!((size(&h, "m1"), size(&h, "m2")), (4, 4));
    h.release("m1").unwrap();
    assert_eq!(size(&h, "m2"), 8);
    h.ledger().check().unwrap();
}

#[test]
fn a_resize_is_a_ceiling_equipartition_keeps_across_restarts_until_the_next_resize() {
    let dir = tempfile::tempdir().unwrap();
    let topo = small_topology(8);
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    h.set_equipartition(true);
    let size = |h: &Host, job: &str| h.ledger().get(job).unwrap().tasks.len();
    h.allocate("m1", "affinity[thread*1-8]", None, None, None, None).unwrap();
    h.allocate("m2", "affinity[thread*1-8]", None, None, None, None).unwrap();
    assert_eq!((size(&h, "m1"), size(&h, "m2")), (4, 4));
    // m1's owner gives CPUs back: m2 takes them at the next rebalance, m1 is not regrown.
    assert_eq!(h.resize("m1", 2).unwrap().tasks.len(), 2);
    h.allocate("r", "affinity[thread*1]", None, None, None, None).unwrap();
    h.release("r").unwrap();
    assert_eq!((size(&h, "m1"), size(&h, "m2")), (2, 6));
    // Still so after a restart: the ceiling is in m1's record.
    std::mem::forget(h);
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    h.set_equipartition(true);
    h.recover(BTreeMap::new()).unwrap();
    assert_eq!(h.hints["m1"].tasks_cap, Some(2));
    h.release("m2").unwrap();
    assert_eq!(size(&h, "m1"), 2, "alone, and still no more than its resize asked");
    // A resize to more lifts it; equipartition may then grow the job that far, no further.
    assert_eq!(h.resize("m1", 3).unwrap().tasks.len(), 3);
    assert_eq!(h.resize("m1", 3).unwrap().tasks.len(), 3, "again: nothing changes");
    h.allocate("m3", "affinity[thread*1-8]", None, None, None, None).unwrap();
    h.release("m3").unwrap();
    assert_eq!(size(&h, "m1"), 3);
    // A resize that fails leaves the ceiling as it was.
    assert!(h.resize("m1", 9).is_err());
    assert_eq!(h.hints["m1"].tasks_cap, Some(3));
    h.ledger().check().unwrap();
}

/// Issue 27: the batch system is told of every change topod makes to its jobs' CPUs (in
/// Slurm's AdminComment, PBS's comment), and of nothing else: not an allocate, not a
/// resize to the size a job has, not a job of no batch system.
#[test]
fn a_batch_jobs_resize_and_equipartitions_shrink_are_told_to_its_batch_system() {
    use crate::daemon::batch_report::{BatchReporter, FakeCommands, COMMAND_TIMEOUT};
    let topo = small_topology(4);
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    h.set_clock(Arc::new(|| at(1_795_000_000)));
    let fake = Arc::new(FakeCommands::default());
    let reporter = BatchReporter::start(fake.clone(), COMMAND_TIMEOUT, Duration::ZERO);
    h.set_batch_reporter(Some(reporter.clone()));
    let told = || {
        assert!(reporter.wait_idle(Duration::from_secs(600)));
        std::mem::take(&mut *fake.ran.lock().unwrap())
    };
    h.allocate("slurm-41", "affinity[thread*1-2]", None, None, None, None).unwrap();
    h.allocate("mine", "affinity[thread*1-2]", None, None, None, None).unwrap();
    assert!(told().is_empty(), "an allocate is the batch system's own decision");
    h.resize("slurm-41", 1).unwrap();
    h.resize("mine", 1).unwrap();
    h.resize("slurm-41", 1).unwrap();
    let cpus = h.ledger().get("slurm-41").unwrap().cpus.to_string();
    assert_eq!(
        told(),
        [vec![
            "scontrol".to_string(),
            "update".into(),
            "JobId=41".into(),
            format!(
                "AdminComment=topo on {}: resized at 2026-11-18 11:06:40 UTC: runs on 1 CPU ({cpus})",
                reporter.host()
            ),
        ]]
    );
    // Equipartition shrinks a PBS job for an arrival: PBS hears of it too.
    h.release("slurm-41").unwrap();
    h.release("mine").unwrap();
    h.set_equipartition(true);
    h.allocate("pbs-7.server", "affinity[thread*1-4]", None, None, None, None).unwrap();
    assert_eq!(h.ledger().get("pbs-7.server").unwrap().tasks.len(), 4);
    told();
    h.allocate("rigid", "affinity[thread*2]", None, None, None, None).unwrap();
    let cpus = h.ledger().get("pbs-7.server").unwrap().cpus.clone();
    assert_eq!(cpus.len(), 2);
    let ran = told();
    assert_eq!(ran.len(), 1, "{ran:?}");
    assert_eq!(ran[0][..2], ["qalter".to_string(), "-W".into()]);
    let said = format!("comment=topo on {}: shrunk by equipartition", reporter.host());
    assert!(ran[0][2].starts_with(&said), "{:?}", ran[0]);
    assert!(
        ran[0][2].ends_with(&format!("runs on 2 CPUs ({})", cpus.to_string().replace(',', " ")))
    );
    assert_eq!(ran[0][3], "7.server");
}

#[test]
fn defrag_moves_the_fewest_jobs_to_make_room_and_keeps_its_delay_timers() {
    let topo = two_nodes_of_four();
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    let clock = Arc::new(std::sync::atomic::AtomicI64::new(1_000));
    let c = clock.clone();
    h.set_clock(Arc::new(move || at(c.load(std::sync::atomic::Ordering::SeqCst) as u64)));
    h.set_defrag(Some(Defrag {
        min_run: 60,
        gap: 300,
        limits: topo_core::defrag::DefragLimits::default(),
    }));
    // Two CPUs taken on each node: four free, but not four in one node. (Not with a CPU
    // list: a job the batch system gave CPUs keeps to them, moves too.)
    for job in ["a", "x", "b", "y"] {
        h.allocate(job, "affinity[thread*2]", None, None, None, None).unwrap();
    }
    h.release("x").unwrap();
    h.release("y").unwrap();
    let (a0, b0) =
        (h.ledger().get("a").unwrap().cpus.clone(), h.ledger().get("b").unwrap().cpus.clone());
    assert_eq!(a0.len() + b0.len(), 4);
    let numa_of = |h: &Host, cpus: &CpuSet| {
        h.model().domain_of(topo_core::request::Level::Numa, cpus.first().unwrap())
    };
    assert_ne!(numa_of(&h, &a0), numa_of(&h, &b0), "{a0} {b0}");
    // The free map tells schedulers what the planner works with, so that they decide as it
    // will (issue 31): each job movable from its start plus migrate_min_run_s.
    let movable_from = |h: &Host| -> BTreeMap<String, i64> {
        let view = h.snapshot().moves.expect("defrag is on");
        assert_eq!(
            (view.strategy, view.limits),
            (h.strategy, topo_core::defrag::DefragLimits::default())
        );
        view.jobs.into_iter().map(|j| (j.job, j.movable_from.unwrap())).collect()
    };
    assert_eq!(movable_from(&h), [("a".to_string(), 1_060), ("b".into(), 1_060)].into());
    let node = "affinity[thread(4,same=numa)]";
    // Too young to move: refused, and told why.
    let e = h.allocate("n", node, None, None, None, None).unwrap_err().to_string();
    assert!(
        e.contains("does not fit")
            && e.contains("moving running jobs did not make room: it would fit after moving jobs that may not move yet: job ")
            && e.contains("has run 0 s, less than migrate_min_run_s 60"),
        "{e}"
    );
    clock.store(1_060, std::sync::atomic::Ordering::SeqCst);
    let n = h.allocate("n", node, None, None, None, None).unwrap();
    let (a, b) = (h.ledger().get("a").unwrap().clone(), h.ledger().get("b").unwrap().clone());
    let moved = usize::from(a.cpus != a0) + usize::from(b.cpus != b0);
    assert_eq!(moved, 1, "one move: a {} b {} n {}", a.cpus, b.cpus, n.cpus);
    assert_eq!(
        kernel
            .list()
            .unwrap()
            .into_iter()
            .map(|(j, e)| (j.to_string(), e.cpus))
            .collect::<BTreeMap<_, _>>(),
        [
            ("a".to_string(), a.cpus.clone()),
            ("b".into(), b.cpus.clone()),
            ("n".into(), n.cpus.clone())
        ]
        .into_iter()
        .collect()
    );
    h.ledger().check().unwrap();
    // The moved one from its move plus migrate_gap_s.
    let (went_job, stay_job) = if a.cpus == a0 { ("b", "a") } else { ("a", "b") };
    assert_eq!(
        movable_from(&h),
        [(went_job.to_string(), 1_360), (stay_job.into(), 1_060), ("n".into(), 1_120)].into()
    );
    // The moved job may not move again within the gap.
    h.release("n").unwrap();
    let (stay, went) = if a.cpus == a0 { (&a, &b) } else { (&b, &a) };
    h.release(&stay.job).unwrap();
    // The moved job is alone on its node; a job pinned to two CPUs of the other node (its
    // CPU list keeps it there) leaves two free on each node again.
    let other = h.model().numa[1 - numa_of(&h, &went.cpus).unwrap()].clone();
    let pin: CpuSet = other.iter().take(2).collect();
    h.allocate("o", "affinity[thread*2]", None, Some(&pin.to_string()), None, None).unwrap();
    let pinned = h.snapshot().moves.unwrap().jobs.into_iter().find(|j| j.job == "o").unwrap();
    assert!(pinned.request.contains(&format!("CPU_LIST={pin}")), "{}", pinned.request);
    // Within the moved job's gap: refused; after it: moved again.
    clock.store(1_200, std::sync::atomic::Ordering::SeqCst);
    let e = h.allocate("q", node, None, None, None, None).unwrap_err().to_string();
    assert!(
        e.contains(&format!(
            "job {} was moved or resized 140 s ago, less than migrate_gap_s 300",
            went.job
        )),
        "{e}"
    );
    clock.store(1_360, std::sync::atomic::Ordering::SeqCst);
    h.allocate("q", node, None, None, None, None).unwrap();
    assert_ne!(h.ledger().get(&went.job).unwrap().cpus, went.cpus);
    h.ledger().check().unwrap();
}

#[test]
fn defrag_round_as_the_crash_test_plays_it() {
    let topo = Topology::synthetic(SyntheticShape {
        packages: 1,
        numa_per_package: 2,
        l3_per_numa: 1,
        cores_per_l3: 2,
        threads_per_core: 1,
    });
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    h.set_defrag(Some(Defrag {
        min_run: 0,
        gap: 0,
        limits: topo_core::defrag::DefragLimits::default(),
    }));
    for j in ["a", "b", "c"] {
        h.allocate(j, "affinity[thread*1]", None, None, None, None).unwrap();
    }
    h.release("b").unwrap();
    let before: Vec<String> = h.ledger().jobs().map(|a| format!("{} {}", a.job, a.cpus)).collect();
    let n = h.allocate("n", "affinity[thread(2,same=numa)]", None, None, None, None);
    assert!(n.is_ok(), "{before:?}: {n:?}");
}

#[test]
fn a_resize_whose_record_cannot_be_written_is_made_again_at_the_restart_and_never_told_backwards() {
    let dir = tempfile::tempdir().unwrap();
    let topo = small_topology(4);
    let kernel = kernel_for(&topo);
    let notify = dir.path().join("notify");
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    h.set_notify_dir(Some(notify.clone())).unwrap();
    h.allocate("m", "affinity[thread*1-4]", None, None, None, None).unwrap();
    // The records directory becomes unwritable (a file where it was).
    let jobs = dir.path().join("jobs");
    let saved = dir.path().join("jobs.saved");
    std::fs::rename(&jobs, &saved).unwrap();
    std::fs::write(&jobs, "not a directory").unwrap();
    let shrunk = h.resize("m", 1).unwrap();
    assert!(dir.path().join("moves.json").exists(), "the plan stays until it is recorded");
    let told = |n: &str| std::fs::read_to_string(notify.join(n)).unwrap();
    assert!(told("m").starts_with("generation=2\n"), "{}", told("m"));
    std::mem::forget(h);
    std::fs::remove_file(&jobs).unwrap();
    std::fs::rename(&saved, &jobs).unwrap();
    let mut again = host_on(&topo, &kernel, Some(dir.path()));
    again.set_notify_dir(Some(notify.clone())).unwrap();
    again.recover(BTreeMap::new()).unwrap();
    let m = again.ledger().get("m").unwrap().clone();
    assert_eq!((m.cpus.clone(), m.tasks.clone()), (shrunk.cpus.clone(), shrunk.tasks.clone()));
    assert!(!dir.path().join("moves.json").exists());
    let g: u64 =
        told("m").lines().next().unwrap().strip_prefix("generation=").unwrap().parse().unwrap();
    assert!(g >= 2, "never backwards: {}", told("m"));
    // A record whose tasks disagree with the cgroup (written before a move a crash cut
    // short, the plan lost too) is corrected from the cgroup.
    let mut stale = again.hints.get("m").unwrap().clone();
    stale.tasks = vec![CpuSet::parse_list("0").unwrap(), CpuSet::parse_list("1").unwrap()];
    Records::open(dir.path()).unwrap().write(&JobId::parse("m").unwrap(), &stale).unwrap();
    std::mem::forget(again);
    let mut third = host_on(&topo, &kernel, Some(dir.path()));
    third.set_notify_dir(Some(notify.clone())).unwrap();
    third.recover(BTreeMap::new()).unwrap();
    let m = third.ledger().get("m").unwrap();
    assert_eq!(CpuSet::union_all(&m.tasks), m.cpus, "{m:?}");
    // A file left by a job that is gone is swept.
    std::fs::write(notify.join("gone"), "generation=1\ncpus=0\nmems=0\n").unwrap();
    std::mem::forget(third);
    let mut fourth = host_on(&topo, &kernel, Some(dir.path()));
    fourth.set_notify_dir(Some(notify.clone())).unwrap();
    fourth.recover(BTreeMap::new()).unwrap();
    assert!(!notify.join("gone").exists() && notify.join("m").exists());
}

#[test]
fn a_plan_of_moves_for_an_earlier_run_or_onto_another_jobs_cpus_is_not_made() {
    let dir = tempfile::tempdir().unwrap();
    let topo = small_topology(4);
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    let m = h.allocate("m", "affinity[thread*1-2]", None, None, None, None).unwrap();
    let x = h.allocate("x", "affinity[thread*1]", None, None, None, None).unwrap();
    let records = Records::open(dir.path()).unwrap();
    let plan =
        |to: Allocation, run: Option<String>| crate::daemon::records::PlannedMove { to, run };
    // For an earlier run of m (a requeue since): dropped.
    let shrunk = Allocation { cpus: m.tasks[0].clone(), tasks: m.tasks[..1].to_vec(), ..m.clone() };
    records.write_moves(&[plan(shrunk, Some("1999-01-01T00:00:00Z".into()))]).unwrap();
    std::mem::forget(h);
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    h.recover(BTreeMap::new()).unwrap();
    assert_eq!(h.ledger().get("m").unwrap().cpus, m.cpus);
    // Onto x's CPUs: dropped whole; both keep their CPUs.
    let onto = Allocation { cpus: x.cpus.clone(), tasks: vec![x.cpus.clone()], ..m.clone() };
    records.write_moves(&[plan(onto, None)]).unwrap();
    std::mem::forget(h);
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    h.recover(BTreeMap::new()).unwrap();
    assert_eq!(
        (h.ledger().get("m").unwrap().cpus.clone(), h.ledger().get("x").unwrap().cpus.clone()),
        (m.cpus, x.cpus)
    );
    assert!(!dir.path().join("moves.json").exists());
    h.ledger().check().unwrap();
}

#[test]
fn defrag_moves_no_job_into_an_open_prime_pool_that_does_not_admit_it() {
    let topo = two_nodes_of_four();
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    h.set_defrag(Some(Defrag {
        min_run: 0,
        gap: 0,
        limits: topo_core::defrag::DefragLimits::default(),
    }));
    let node0 = h.model().numa[0].clone();
    let pool_cpus: CpuSet = node0.iter().take(2).collect();
    let configs = vec![PoolConfig {
        name: "day".into(),
        cpus: Some(pool_cpus.clone()),
        shape: None,
        windows: vec!["Mon-Sun 00:00-24:00".into()],
        queues: vec!["prime".into()],
        users: vec![],
        named: None,
        on_open: topo_core::prime::OnOpen::Stay,
    }];
    let pools = make_pools(h.model(), &configs).unwrap();
    h.set_pools(pools, Arc::new(|_| 0));
    let with_queue = |text: &str, queue: &str| {
        let mut p = prepare(&topo, text, None, None).unwrap();
        p.ask.queue = Some(queue.into());
        p
    };
    let a =
        h.allocate_prepared("a", &with_queue("affinity[thread*2]", "batch"), None, None).unwrap();
    let b =
        h.allocate_prepared("b", &with_queue("affinity[thread*2]", "batch"), None, None).unwrap();
    assert!(!a.cpus.intersects(&pool_cpus) && !b.cpus.intersects(&pool_cpus));
    // A prime job wanting a whole node: room is made, and no batch job lands in the pool.
    h.allocate_prepared("p", &with_queue("affinity[thread(4,same=numa)]", "prime"), None, None)
        .unwrap();
    for j in ["a", "b"] {
        let cpus = &h.ledger().get(j).unwrap().cpus;
        assert!(!cpus.intersects(&pool_cpus), "job {j} moved into the pool: {cpus}");
    }
    h.ledger().check().unwrap();
}

fn gang_ask(row: Option<u32>, prime: bool) -> GangAsk {
    GangAsk { gang: Some(!prime), row, prime }
}

fn gang_allocate(
    h: &mut Host,
    job: &str,
    request: &str,
    ask: GangAsk,
) -> Result<Allocation, HostError> {
    let mut prepared = prepare(&h.topo, request, None, None).unwrap();
    prepared.gang = ask;
    h.allocate_prepared(job, &prepared, None, None)
}

/// Seconds since the epoch as a time (slice boundaries are k·T since the epoch).
fn at(secs: u64) -> std::time::SystemTime {
    std::time::UNIX_EPOCH + Duration::from_secs(secs)
}

fn gang_on(h: &mut Host, rows: u32, slice: i64) {
    h.set_gang(Some(GangConfig {
        gang: topo_core::policy::Gang { slice, rows },
        all_jobs: false,
        prime_queues: vec!["prime".into()],
    }));
}

#[test]
fn gang_jobs_share_cpus_by_rows_and_take_turns_also_after_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let topo = small_topology(4);
    let kernel = kernel_for(&topo);
    let seconds = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let clock: Arc<dyn Fn() -> std::time::SystemTime + Send + Sync> = {
        let seconds = seconds.clone();
        Arc::new(move || at(seconds.load(std::sync::atomic::Ordering::SeqCst)))
    };
    // The test's clock: every switch, also those topod makes by itself, happens at `t`.
    let tick = |h: &mut Host, t: u64| {
        seconds.store(t, std::sync::atomic::Ordering::SeqCst);
        h.gang_switch(h.now())
    };
    let mut first = host_on(&topo, &kernel, Some(dir.path()));
    first.set_clock(clock.clone());
    gang_on(&mut first, 2, 30);
    let frozen = |job: &str| kernel.is_frozen(&JobId::parse(job).unwrap()).unwrap();
    let a = gang_allocate(&mut first, "a", "affinity[thread*4]", gang_ask(Some(0), false)).unwrap();
    let b = gang_allocate(&mut first, "b", "affinity[thread*4]", gang_ask(Some(1), false)).unwrap();
    assert_eq!((a.gang_row, b.gang_row), (Some(0), Some(1)));
    assert_eq!(a.cpus, b.cpus, "rows share the CPUs");
    // A third in row 0, a job that is not gang-scheduled, a prime one: no room.
    for (job, ask) in [
        ("c", gang_ask(Some(0), false)),
        ("d", GangAsk::default()),
        ("e", gang_ask(None, true)),
        ("f", GangAsk { gang: Some(true), ..GangAsk::default() }),
    ] {
        let mut prepared = prepare(&first.topo, "affinity[thread*1]", None, None).unwrap();
        prepared.gang = ask;
        // Job f's queue is a prime queue.
        prepared.ask.queue = (job == "f").then(|| "prime".to_string());
        let err = first.allocate_prepared(job, &prepared, None, None).unwrap_err();
        assert!(matches!(err, HostError::DoesNotFit { .. }), "{job}: {err}");
        // The gang job is told its row is what is full.
        let row_full = err.to_string().contains("it runs only in row 0 of 2");
        assert_eq!(row_full, job == "c", "{job}: {err}");
    }
    // Slice 0 (t = 0..30) is row 0's; slice 1 row 1's: freezes first, then thaws.
    tick(&mut first, 60);
    assert!(!frozen("a") && frozen("b"));
    let s = tick(&mut first, 95).unwrap();
    assert_eq!(
        (s.active_row, s.frozen, s.thawed),
        (1, vec!["a".to_string()], vec!["b".to_string()])
    );
    assert!(frozen("a") && !frozen("b"));
    first.ledger().check().unwrap();
    let views = first.jobs();
    assert_eq!((views[0].state, views[1].state), (JobState::Frozen, JobState::Running));
    // A crash: the new topod finds b running, a frozen by slicing, and takes turns again.
    drop(first);
    let mut second = host_on(&topo, &kernel, Some(dir.path()));
    second.set_clock(clock);
    gang_on(&mut second, 2, 30);
    let r = second.recover(BTreeMap::new()).unwrap();
    assert_eq!(r.kept.len(), 2, "{r:?}");
    assert!(second.ledger().is_gang_frozen("a"));
    second.ledger().check().unwrap();
    tick(&mut second, 120);
    assert!(!frozen("a") && frozen("b"));
    // Suspended by the batch system: out of the turns; resumed: back in them, frozen until
    // its slice (b's row has it at 150).
    second.suspend("a").unwrap();
    tick(&mut second, 150);
    assert!(frozen("a") && !frozen("b"));
    let s = tick(&mut second, 180).unwrap();
    assert!(s.thawed.is_empty() && frozen("a"), "a suspended is not thawed for its slice: {s:?}");
    assert!(!frozen("b"), "b runs in a's slice while a is suspended (its CPUs are idle)");
    tick(&mut second, 210);
    second.resume("a").unwrap();
    assert!(frozen("a") && !frozen("b"), "resumed in row 1's slice: a waits for its own");
    tick(&mut second, 240);
    assert!(!frozen("a") && frozen("b"));
    // b ends: a runs through every slice (nobody else wants its CPUs).
    second.release("b").unwrap();
    tick(&mut second, 270);
    assert!(!frozen("a"));
    second.ledger().check().unwrap();
    // A gang job asked on a host without slicing, or a row it does not have: refused.
    assert!(matches!(
        gang_allocate(&mut second, "g", "affinity[thread*1]", gang_ask(Some(2), false)),
        Err(HostError::GangRow { row: 2, rows: 2, .. })
    ));
    second.set_gang(None);
    assert!(matches!(
        gang_allocate(&mut second, "g", "affinity[thread*1]", gang_ask(None, false)),
        Err(HostError::NoGang(_))
    ));
}

#[test]
fn gang_regressions_rows_lowered_suspend_frees_at_once_frozen_is_frozen_and_one_row_per_job() {
    let dir = tempfile::tempdir().unwrap();
    let topo = small_topology(2);
    let kernel = kernel_for(&topo);
    let seconds = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let clock: Arc<dyn Fn() -> std::time::SystemTime + Send + Sync> = {
        let seconds = seconds.clone();
        Arc::new(move || at(seconds.load(std::sync::atomic::Ordering::SeqCst)))
    };
    let tick = |h: &mut Host, t: u64| {
        seconds.store(t, std::sync::atomic::Ordering::SeqCst);
        h.gang_switch(h.now())
    };
    let frozen = |job: &str| kernel.is_frozen(&JobId::parse(job).unwrap()).unwrap();
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    h.set_clock(clock.clone());
    gang_on(&mut h, 4, 10);
    gang_allocate(&mut h, "g0", "affinity[thread*2]", gang_ask(Some(0), false)).unwrap();
    gang_allocate(&mut h, "g2", "affinity[thread*2]", gang_ask(Some(2), false)).unwrap();
    // Restarted with 2 rows: g2's row is kept apart (3 rows of turns), not folded onto g0's.
    drop(h);
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    h.set_clock(clock);
    gang_on(&mut h, 2, 10);
    h.recover(BTreeMap::new()).unwrap();
    tick(&mut h, 20);
    assert!(frozen("g0") && !frozen("g2"), "slice 2 of 3 rows is g2's");
    tick(&mut h, 30);
    assert!(!frozen("g0") && frozen("g2"));
    // The running one suspended: the other runs at once, not at the next boundary.
    h.suspend("g0").unwrap();
    assert!(!frozen("g2"), "g2 runs on the CPUs g0 left");
    // g0 resumed in its own row's slice: it runs, g2 waits; a resume of g2, frozen by
    // slicing, says so (not "holds nothing").
    h.resume("g0").unwrap();
    assert!(!frozen("g0") && frozen("g2"));
    let err = h.resume("g2").unwrap_err();
    assert!(err.to_string().contains("is frozen"), "{err}");
    // Contradictions are refused.
    for ask in [
        GangAsk { gang: Some(false), row: Some(1), ..GangAsk::default() },
        GangAsk { prime: true, row: Some(1), ..GangAsk::default() },
    ] {
        let err = gang_allocate(&mut h, "x", "affinity[thread*1]", ask).unwrap_err();
        assert!(err.to_string().contains("gang_row is for gang-scheduled jobs"), "{err}");
    }
    // Without a row, a job's row comes from its id alone: two hosts in different states
    // put it in the same row, and where that row is full it does not fit (another row's
    // room would split it across slices).
    let other = kernel_for(&topo);
    let mut h2 = host_on(&topo, &other, None);
    gang_on(&mut h2, 2, 10);
    let here = h.gang_rows_for("multi-7", &gang_ask(None, false), None).unwrap();
    let there = h2.gang_rows_for("multi-7", &gang_ask(None, false), None).unwrap();
    assert_eq!(here, there);
    assert_eq!(here.map(|r| r.len()), Some(1));
}

/// Issue 30: `topoctl suspend; topoctl resume` twice by a job's owner used up its
/// `preempt_max_suspensions` and restarted its `preempt_min_run_s`, so that an urgent job
/// was refused. Only the policy's suspensions count, and only its resumes protect.
/// Two CPUs for `job`, asking as `p` says.
fn alloc_pair(h: &mut Host, job: &str, p: PreemptAsk) -> Result<Allocation, HostError> {
    let mut prepared = prepare(&h.topo, "affinity[thread*2]", None, None).unwrap();
    PreemptAsk::apply(p, &mut prepared);
    h.allocate_prepared(job, &prepared, None, None)
}

/// A job that may be suspended, submitted at 999,990 for 100,000 s.
fn long_preemptible() -> PreemptAsk {
    PreemptAsk {
        preempt: false,
        preemptible: true,
        submitted_at: Some(999_990),
        estimate_s: Some(100_000),
    }
}

/// A job that may preempt: it waited since 990,000 for an hour's work.
fn urgent_preemptor() -> PreemptAsk {
    PreemptAsk {
        preempt: true,
        preemptible: false,
        submitted_at: Some(990_000),
        estimate_s: Some(3_600),
    }
}

/// `job`'s owner suspends and resumes it, `times` times.
fn owner_suspends_and_resumes(h: &mut Host, job: &str, times: usize) {
    for _ in 0..times {
        let ticket = h.begin_suspend(job, Some(1000)).unwrap();
        let outcome = ticket.run();
        h.finish_suspend(ticket, outcome).unwrap();
        h.resume(job).unwrap();
    }
}

#[test]
fn an_owner_suspending_and_resuming_a_job_does_not_shield_it_from_preemption() {
    let topo = small_topology(2);
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    let seconds = Arc::new(std::sync::atomic::AtomicU64::new(1_000_000));
    {
        let seconds = seconds.clone();
        h.set_clock(Arc::new(move || at(seconds.load(std::sync::atomic::Ordering::SeqCst))));
    }
    h.set_preempt(Some(topo_core::policy::Preempt {
        min_run: 600,
        max_suspensions: 2,
        min_xf: 2.0,
    }));
    let victim = long_preemptible();
    alloc_pair(&mut h, "v", victim).unwrap();
    // An hour later its owner suspends and resumes it, twice.
    seconds.store(1_003_600, std::sync::atomic::Ordering::SeqCst);
    owner_suspends_and_resumes(&mut h, "v", 2);
    assert_eq!(h.hints["v"].clock.suspensions, 0, "the owner's suspensions are not the policy's");
    // An urgent job (waited 3.6 h for an hour's work: expansion factor 4.6) takes its CPUs.
    let urgent = urgent_preemptor();
    alloc_pair(&mut h, "p", urgent.clone()).unwrap();
    assert!(kernel.is_frozen(&JobId::parse("v").unwrap()).unwrap());
    assert_eq!(h.hints["v"].preempted_by.as_deref(), Some("p"));
    assert_eq!(h.hints["v"].clock.suspensions, 1);
    // Nor can its owner take preemption's suspension over (to resume it as their own):
    // attack, issue 29.
    assert!(h.suspended_by_policy("v"));
    assert!(h.begin_suspend("v", Some(1000)).is_err());
    assert_eq!(h.hints["v"].preempted_by.as_deref(), Some("p"));
    // Resumed by topod after p: protected for preempt_min_run_s again.
    h.release("p").unwrap();
    assert!(!kernel.is_frozen(&JobId::parse("v").unwrap()).unwrap());
    seconds.store(1_003_900, std::sync::atomic::Ordering::SeqCst);
    assert!(matches!(alloc_pair(&mut h, "q", urgent.clone()), Err(HostError::DoesNotFit { .. })));
    // A job its owner keeps suspended is no victim: topod would otherwise resume it later.
    seconds.store(1_010_000, std::sync::atomic::Ordering::SeqCst);
    let ticket = h.begin_suspend("v", Some(1000)).unwrap();
    let outcome = ticket.run();
    h.finish_suspend(ticket, outcome).unwrap();
    let _ = alloc_pair(&mut h, "r", urgent);
    assert_eq!(h.hints["v"].suspended_by, Some(1000));
    assert_eq!(h.hints["v"].preempted_by, None);
    h.ledger().check().unwrap();
    // A suspension by the batch system is not the owner's to take over either.
    let _ = h.release("r");
    h.resume("v").unwrap();
    let view = topo_core::proto::BatchView { suspended: vec!["v".into()], running: vec![] };
    h.follow_batch(&view).unwrap();
    assert!(h.suspended_by_policy("v"));
    assert!(h.begin_suspend("v", Some(1000)).is_err());
    assert!(h.hints["v"].batch_suspended);
    // Root's (or an administrator's) suspension does take it over, as before.
    h.suspend("v").unwrap();
    assert!(!h.hints["v"].batch_suspended);
}

#[test]
fn an_allocate_that_asks_to_preempt_where_it_cannot_is_told_why() {
    let topo = small_topology(2);
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    h.allocate("a", "affinity[thread*2]", None, None, None, None).unwrap();
    let mut prepared = prepare(&h.topo, "affinity[thread*1]", None, None).unwrap();
    PreemptAsk::apply(
        PreemptAsk {
            preempt: true,
            preemptible: false,
            submitted_at: Some(h.now_s() - 86_400),
            estimate_s: Some(60),
        },
        &mut prepared,
    );
    let e = h.allocate_prepared("b", &prepared, None, None).unwrap_err().to_string();
    assert!(e.contains("preemption is off on this host (preempt = false"), "{e}");
    h.set_preempt(Some(topo_core::policy::Preempt::default()));
    prepared.ask.submitted_at = None;
    let e = h.allocate_prepared("b", &prepared, None, None).unwrap_err().to_string();
    assert!(e.contains("it gave no submission time and time limit"), "{e}");
}

/// A host on `kernel` whose preemption lets a job be suspended at once, up to 5 times.
fn preempting_on(topo: &Topology, kernel: &std::sync::Arc<Fake>) -> Host {
    let mut h = host_on(topo, kernel, None);
    h.set_preempt(Some(topo_core::policy::Preempt { min_run: 0, max_suspensions: 5, min_xf: 2.0 }));
    h
}

#[test]
fn preemption_regressions_from_an_attack() {
    let topo = small_topology(2);
    let kernel = kernel_for(&topo);
    let mut h = preempting_on(&topo, &kernel);
    let now = h.now_s();
    let alloc = |h: &mut Host, job: &str, req: &str, cpus: &str, preempt: Option<bool>| {
        let mut prepared = prepare(&h.topo, req, None, Some(cpus)).unwrap();
        PreemptAsk::apply(
            match preempt {
                // A preemptor that has waited a day for an hour; a victim that just came.
                Some(true) => PreemptAsk {
                    preempt: true,
                    preemptible: false,
                    submitted_at: Some(now - 86_400),
                    estimate_s: Some(3_600),
                },
                Some(false) => PreemptAsk {
                    preempt: false,
                    preemptible: true,
                    submitted_at: Some(now - 10),
                    estimate_s: Some(100_000),
                },
                None => PreemptAsk::default(),
            },
            &mut prepared,
        );
        h.allocate_prepared(job, &prepared, None, None)
    };
    let frozen = |job: &str| kernel.is_frozen(&JobId::parse(job).unwrap()).unwrap();
    // A job outside the preemptor's CPUs is never suspended for it.
    alloc(&mut h, "b", "affinity[thread*1]", "0", Some(false)).unwrap();
    alloc(&mut h, "d", "affinity[thread*1]", "1", Some(false)).unwrap();
    alloc(&mut h, "e", "affinity[thread*1]", "1", Some(true)).unwrap();
    assert!(frozen("d") && !frozen("b"), "only d was in e's way");
    h.release("e").unwrap();
    h.release("b").unwrap();
    h.release("d").unwrap();
    // A victim's idle CPUs are lent to nobody but its preemptor, unless a job ends before
    // the preemptor (this one has no time limit).
    alloc(&mut h, "v", "affinity[thread*2]", "0-1", Some(false)).unwrap();
    alloc(&mut h, "p", "affinity[thread*1]", "0", Some(true)).unwrap();
    assert!(frozen("v"));
    assert!(matches!(
        alloc(&mut h, "n", "affinity[thread*1]", "1", None),
        Err(HostError::DoesNotFit { .. })
    ));
    let views = h.jobs();
    assert_eq!(
        views.iter().find(|j| j.allocation.job == "v").unwrap().preempted_by.as_deref(),
        Some("p")
    );
    // Its preemptor only suspended: the victim stays frozen, and the preemptor resumes.
    h.suspend("p").unwrap();
    assert!(h.resume_preempted().is_empty() && frozen("v"));
    h.resume("p").unwrap();
    // Suspended explicitly while preempted: that suspension stands after p ends.
    h.suspend("v").unwrap();
    h.release("p").unwrap();
    assert!(frozen("v") && h.ledger().is_suspended("v"), "topod does not undo an explicit suspend");
    h.resume("v").unwrap();
    assert!(!frozen("v"));
    h.ledger().check().unwrap();
}

#[test]
fn a_preempted_jobs_idle_cpus_go_only_to_jobs_that_end_before_it_may_resume() {
    let topo = small_topology(2);
    let kernel = kernel_for(&topo);
    let mut h = preempting_on(&topo, &kernel);
    let now = h.now_s();
    let alloc = |h: &mut Host, job: &str, cpus: &str, ask: PreemptAsk| {
        let req = format!("affinity[thread*{}]", CpuSet::parse_list(cpus).unwrap().len());
        let mut prepared = prepare(&h.topo, &req, None, Some(cpus)).unwrap();
        PreemptAsk::apply(ask, &mut prepared);
        h.allocate_prepared(job, &prepared, None, None)
    };
    // Preemptible jobs that just came, with these time limits.
    let victim = |estimate: u64| PreemptAsk {
        preempt: false,
        preemptible: true,
        submitted_at: Some(now - 10),
        estimate_s: Some(estimate),
    };
    // A job that waited a day for an hour.
    let urgent = PreemptAsk {
        preempt: true,
        preemptible: false,
        submitted_at: Some(now - 86_400),
        estimate_s: Some(3_600),
    };
    let frozen = |job: &str| kernel.is_frozen(&JobId::parse(job).unwrap()).unwrap();
    alloc(&mut h, "v", "0-1", victim(100_000)).unwrap();
    alloc(&mut h, "p", "0", urgent.clone()).unwrap();
    assert!(frozen("v"));
    // v may resume when p ends, in an hour: CPU 1 goes to a job of 10 minutes, not of 2 hours.
    let e = alloc(&mut h, "long", "1", victim(7_200)).unwrap_err();
    assert!(matches!(e, HostError::DoesNotFit { .. }), "{e}");
    let text = e.to_string();
    assert!(
        text.contains("CPUs 1 are held for job v, suspended by preemption for job p, until about ")
            && text.contains("s from now, its preemptor's time limit")
            && text.contains("its estimate_s ends later"),
        "{text}"
    );
    alloc(&mut h, "short", "1", victim(600)).unwrap();
    // Neither the preemptor's owner nor the borrower's may freeze what v waits for.
    for job in ["p", "short"] {
        let e = h.begin_suspend(job, Some(1000)).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains(&format!("job {job} may not be suspended by its owner")), "{e}");
        assert!(e.contains("held for job v"), "{e}");
    }
    // The borrower holds what v waits for: no preemption takes it.
    let e = alloc(&mut h, "q", "1", urgent).unwrap_err().to_string();
    assert!(e.contains("job short may not be suspended: it runs on CPUs 1 held for job v"), "{e}");
    assert!(!frozen("short"));
    // p ends first: v waits for the borrower too, then runs again on its own CPUs; not onto
    // the CPU of a borrower root suspended either (it would find it taken on its resume).
    h.release("p").unwrap();
    assert!(frozen("v") && h.ledger().is_suspended("v"));
    h.suspend("short").unwrap();
    assert!(h.resume_preempted().is_empty() && frozen("v"));
    h.resume("short").unwrap();
    h.release("short").unwrap();
    assert!(!frozen("v") && !h.ledger().is_suspended("v"));
    h.ledger().check().unwrap();
}

#[test]
fn an_allocate_that_may_preempt_suspends_the_jobs_that_free_the_tightest_domain() {
    // Two packages of 4 cores: a (3 cores) and b (1 core) in package 0, c (4 cores) in
    // package 1, all preemptible, all running for an hour.
    let dir = tempfile::tempdir().unwrap();
    let topo = two_nodes_of_four();
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    let seconds = Arc::new(std::sync::atomic::AtomicU64::new(1_000_000));
    {
        let seconds = seconds.clone();
        h.set_clock(Arc::new(move || at(seconds.load(std::sync::atomic::Ordering::SeqCst))));
    }
    h.set_preempt(Some(topo_core::policy::Preempt {
        min_run: 600,
        max_suspensions: 1,
        min_xf: 2.0,
    }));
    let ask = |preempt: bool, submitted: i64, estimate: u64| PreemptAsk {
        preempt,
        preemptible: !preempt,
        submitted_at: Some(submitted),
        estimate_s: Some(estimate),
    };
    let alloc = |h: &mut Host, job: &str, req: &str, p: PreemptAsk| {
        let mut prepared = prepare(&h.topo, req, None, None).unwrap();
        PreemptAsk::apply(p, &mut prepared);
        h.allocate_prepared(job, &prepared, None, None)
    };
    let a = alloc(&mut h, "a", "affinity[core(3)]", ask(false, 999_000, 100_000)).unwrap();
    let b = alloc(&mut h, "b", "affinity[core(1)]", ask(false, 999_000, 100_000)).unwrap();
    // c waited longer: a higher expansion factor than a's and b's together.
    let c = alloc(&mut h, "c", "affinity[core(4)]", ask(false, 800_000, 100_000)).unwrap();
    assert!(!a.cpus.union(&b.cpus).intersects(&c.cpus));
    // Too early: they have not run 600 s, and the refusal says so.
    seconds.store(1_000_300, std::sync::atomic::Ordering::SeqCst);
    let head = ask(true, 990_000, 3_600);
    let e = alloc(&mut h, "d", "affinity[core(4,same=numa)]", head.clone()).unwrap_err();
    assert!(matches!(e, HostError::DoesNotFit { .. }));
    let text = e.to_string();
    assert!(
        text.contains("preemption did not make room: no job may be suspended for it")
            && text.contains("job a has run 300 s")
            && text.contains("preempt_min_run_s 600"),
        "{text}"
    );
    // After an hour: d (waited 10,300 s for 3,600: xf 3.9) takes package 0 by suspending a
    // and b (4 cores, lower expansion factors), not c.
    seconds.store(1_003_600, std::sync::atomic::Ordering::SeqCst);
    let d = alloc(&mut h, "d", "affinity[core(4,same=numa)]", head.clone()).unwrap();
    assert_eq!(d.cpus, a.cpus.union(&b.cpus));
    let frozen = |job: &str| kernel.is_frozen(&JobId::parse(job).unwrap()).unwrap();
    assert!(frozen("a") && frozen("b") && !frozen("c"));
    assert_eq!(h.hints["a"].preempted_by.as_deref(), Some("d"));
    h.ledger().check().unwrap();
    // Asking without the right to preempt, or below the expansion factor: refused, nobody
    // suspended.
    let low = ask(true, 1_003_000, 3_600);
    let e = alloc(&mut h, "e", "affinity[core(4)]", low).unwrap_err().to_string();
    assert!(e.contains("expansion factor 1.17 is below preempt_min_xf 2"), "{e}");
    assert!(!frozen("c"));
    // d ends: a and b resume by themselves on their own CPUs.
    h.release("d").unwrap();
    assert!(!frozen("a") && !frozen("b"));
    assert_eq!(h.jobs().iter().filter(|j| j.state == JobState::Running).count(), 3);
    // Suspended once already (max 1): a and b are not candidates again; c is.
    seconds.store(1_010_000, std::sync::atomic::Ordering::SeqCst);
    let f = alloc(&mut h, "f", "affinity[core(4,same=numa)]", ask(true, 990_000, 3_600)).unwrap();
    assert_eq!(f.cpus, c.cpus);
    assert!(frozen("c") && !frozen("a"));
    let e = alloc(&mut h, "g", "affinity[core(4)]", ask(true, 900_000, 3_600)).unwrap_err();
    let e = e.to_string();
    assert!(
        e.contains(
            "job a was suspended 1 time(s) by preemption already (preempt_max_suspensions 1)"
        ) && e.contains("job f did not say it may be suspended"),
        "{e}"
    );
    // A crash: the preempted job stays suspended, and is resumed once f ends.
    drop(h);
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    h.set_preempt(Some(topo_core::policy::Preempt::default()));
    h.recover(BTreeMap::new()).unwrap();
    assert!(h.ledger().is_suspended("c"));
    h.release("f").unwrap();
    assert!(!frozen("c") && !h.ledger().is_suspended("c"));
}

/// Runs what a deferring host queued, as the server does without the lock.
pub(super) fn run_queued(h: &mut Host) {
    loop {
        let work = h.take_kernel_work();
        if work.is_empty() {
            return;
        }
        run_work(h, work);
    }
}

/// Runs `work` as the server does without the lock, and what follows it (thaws onto CPUs freezes
/// freed; a gang switch made again when it met one of these jobs halfway).
fn run_work(h: &mut Host, work: Vec<KernelWork>) {
    let freed = work.iter().any(KernelWork::frees_cpus);
    for w in work {
        let outcome = w.run();
        h.finish_kernel_work(w, outcome);
    }
    if freed {
        h.gang_thaws();
    }
    if h.take_gang_recheck() {
        h.gang_switch(h.now());
    }
}

#[test]
fn a_gang_switch_that_meets_a_job_being_thawed_is_made_again_once_it_is() {
    // Found by an attack: a row-0 job resumed just before row 1's slice is being thawed when
    // the slice begins; the switch left it out, judged row 1's job runnable on CPUs that looked
    // idle (the ledger refused), and nothing switched again: row 0 ran through row 1's slice.
    let topo = small_topology(4);
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    h.defer_kernel_waits();
    let seconds = Arc::new(std::sync::atomic::AtomicU64::new(0));
    {
        let seconds = seconds.clone();
        h.set_clock(Arc::new(move || at(seconds.load(std::sync::atomic::Ordering::SeqCst))));
    }
    gang_on(&mut h, 2, 30);
    for (job, row) in [("g0", 0), ("g1", 1)] {
        gang_allocate(&mut h, job, "affinity[thread*4]", gang_ask(Some(row), false)).unwrap();
        run_queued(&mut h);
    }
    let frozen = |job: &str| kernel.is_frozen(&JobId::parse(job).unwrap()).unwrap();
    assert!(!frozen("g0") && frozen("g1"), "row 0's slice");
    h.suspend("g0").unwrap();
    run_queued(&mut h);
    assert!(frozen("g0") && !frozen("g1"), "g1 runs on the CPUs g0 left idle");
    // Resumed at 29 s: back in its row, whose slice it is: g1 is frozen, then g0 is to be
    // thawed...
    seconds.store(29, std::sync::atomic::Ordering::SeqCst);
    let ticket = h.begin_resume("g0", None).unwrap();
    let outcome = ticket.run();
    h.finish_resume(ticket, outcome).unwrap();
    let freeze = h.take_kernel_work();
    run_work(&mut h, freeze);
    let thaw = h.take_kernel_work();
    assert_eq!(thaw.len(), 1, "g0's thaw, queued");
    assert!(frozen("g0") && frozen("g1"));
    // ... and row 1's slice begins while that thaw runs.
    seconds.store(30, std::sync::atomic::Ordering::SeqCst);
    h.gang_switch(h.now());
    run_queued(&mut h);
    run_work(&mut h, thaw);
    run_queued(&mut h);
    assert!(frozen("g0") && !frozen("g1"), "row 1's slice: g1 runs, g0 waits");
    assert!(h.ledger().is_gang_frozen("g0") && !h.ledger().is_gang_frozen("g1"));
    h.ledger().check().unwrap();
    assert_eq!(h.snapshot().gang.unwrap().failed, 0, "no switch failed");
}

#[test]
fn a_deferred_preemption_places_its_job_when_asked_again_and_an_abandoned_one_is_undone() {
    // The server's way: the victims' freezes are queued (run without the lock), and the
    // allocate asked again places the job; one that never comes back (refused on the way)
    // leaves its victims running again, records and all, also after a crash meanwhile.
    let dir = tempfile::tempdir().unwrap();
    let topo = small_topology(4);
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    h.defer_kernel_waits();
    h.set_clock(Arc::new(|| at(1_000_000)));
    h.set_preempt(Some(topo_core::policy::Preempt { min_run: 0, ..Default::default() }));
    let alloc = |h: &mut Host, job: &str, req: &str, preempt: bool| {
        let mut prepared = prepare(&h.topo, req, None, None).unwrap();
        PreemptAsk::apply(
            PreemptAsk {
                preempt,
                preemptible: !preempt,
                submitted_at: Some(if preempt { 990_000 } else { 999_000 }),
                estimate_s: Some(3_600),
            },
            &mut prepared,
        );
        h.allocate_prepared(job, &prepared, None, None)
    };
    let frozen = |job: &str| kernel.is_frozen(&JobId::parse(job).unwrap()).unwrap();
    alloc(&mut h, "v", "affinity[core*4]", false).unwrap();
    let e = alloc(&mut h, "p", "affinity[core*2]", true).unwrap_err();
    assert!(matches!(e, HostError::PreemptionUnderWay(_)), "{e}");
    // Queued, not run: v runs and holds its CPUs; its record already says suspended.
    assert!(!frozen("v") && !h.ledger().is_suspended("v") && h.kernel_work_pending());
    let e = alloc(&mut h, "p", "affinity[core*2]", true).unwrap_err();
    assert!(matches!(e, HostError::Changing { .. }), "asked again while freezing: {e}");
    assert!(h.resume_preempted().is_empty());
    run_queued(&mut h);
    assert!(frozen("v") && h.ledger().is_suspended("v") && !h.kernel_work_pending());
    // Not resumed while its preemptor is being placed on its CPUs.
    assert!(h.resume_preempted().is_empty());
    let p = alloc(&mut h, "p", "affinity[core*2]", true).unwrap();
    assert_eq!(h.hints["v"].preempted_by.as_deref(), Some("p"));
    h.ledger().check().unwrap();
    h.release("p").unwrap();
    run_queued(&mut h);
    assert!(!frozen("v") && !h.ledger().is_suspended("v"));
    assert!(!p.cpus.is_empty());
    // Given up before its victim's freeze ran (another client placed and released it
    // meanwhile): the victim runs again as soon as the freeze ends.
    let e = alloc(&mut h, "s", "affinity[core*2]", true).unwrap_err();
    assert!(matches!(e, HostError::PreemptionUnderWay(_)), "{e}");
    h.abandon_preemption("s");
    run_queued(&mut h);
    assert!(!frozen("v") && !h.ledger().is_suspended("v") && h.hints["v"].preempted_by.is_none());
    h.ledger().check().unwrap();
    // Abandoned: its victims run again once the thaw has run.
    let e = alloc(&mut h, "q", "affinity[core*2]", true).unwrap_err();
    assert!(matches!(e, HostError::PreemptionUnderWay(_)), "{e}");
    run_queued(&mut h);
    assert!(frozen("v"));
    h.abandon_preemption("q");
    assert!(!h.ledger().is_suspended("v"), "its CPUs are taken back before the thaw");
    run_queued(&mut h);
    assert!(!frozen("v") && h.hints["v"].preempted_by.is_none() && !h.hints["v"].suspended);
    h.ledger().check().unwrap();
    // A crash while a preemptor's victims are frozen and it is not yet placed: the restarted
    // topod resumes them (nothing holds their CPUs).
    let e = alloc(&mut h, "r", "affinity[core*2]", true).unwrap_err();
    assert!(matches!(e, HostError::PreemptionUnderWay(_)), "{e}");
    run_queued(&mut h);
    assert!(frozen("v"));
    drop(h);
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    h.set_preempt(Some(topo_core::policy::Preempt::default()));
    h.recover(BTreeMap::new()).unwrap();
    assert!(h.ledger().is_suspended("v"));
    h.resume_preempted();
    assert!(!frozen("v") && !h.ledger().is_suspended("v"));
}

#[test]
fn malleable_jobs_shrunk_for_an_arrival_a_crash_kept_out_are_shared_out_again_at_restart() {
    // Found by attacking the arrival at its share: topod killed between the shrink and the
    // placement left the malleable job at half its size until some other job came or went.
    let dir = tempfile::tempdir().unwrap();
    let topo = small_topology(4);
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    h.set_equipartition(true);
    let m = h.allocate("m", "affinity[core*1-4]", None, None, None, None).unwrap();
    assert_eq!(m.tasks.len(), 4);
    let arrival = space::Arrival::Malleable(topo_core::malleable::Malleable {
        min: 1,
        max: 4,
        pus_per_task: 1,
    });
    assert!(h.shrink_for_arrival(arrival));
    assert_eq!(h.ledger().get("m").unwrap().tasks.len(), 2);
    drop(h);
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    h.set_equipartition(true);
    h.recover(BTreeMap::new()).unwrap();
    assert_eq!(h.ledger().get("m").unwrap().tasks.len(), 4, "shared out again");
    h.ledger().check().unwrap();
}

#[test]
fn an_owner_resumes_no_job_whose_cpus_a_preempted_job_waits_for_and_is_told_which() {
    let topo = small_topology(4);
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    h.set_clock(Arc::new(|| at(1_000_000)));
    h.set_preempt(Some(topo_core::policy::Preempt { min_run: 0, ..Default::default() }));
    let alloc = |h: &mut Host, job: &str, req: &str, cpus: Option<&str>, preempt: bool| {
        let mut prepared = prepare(&h.topo, req, None, cpus).unwrap();
        PreemptAsk::apply(
            PreemptAsk {
                preempt,
                preemptible: !preempt,
                submitted_at: Some(if preempt { 990_000 } else { 999_000 }),
                estimate_s: Some(if preempt { 10 } else { 3_600 }),
            },
            &mut prepared,
        );
        h.allocate_prepared(job, &prepared, None, None)
    };
    alloc(&mut h, "x", "affinity[core*1]", Some("0"), false).unwrap();
    alloc(&mut h, "rest", "affinity[core*1]", Some("3"), false).unwrap();
    // x's owner stops x; p runs on its CPU and two more; q, urgent, suspends p and runs on 1.
    let ticket = h.begin_suspend("x", Some(1_000)).unwrap();
    let outcome = ticket.run();
    h.finish_suspend(ticket, outcome).unwrap();
    alloc(&mut h, "p", "affinity[core*3]", None, false).unwrap();
    let q = alloc(&mut h, "q", "affinity[core*1]", Some("1"), true).unwrap();
    assert!(h.ledger().is_suspended("p") && q.cpus.to_string() == "1", "{}", q.cpus);
    // CPU 0 is free, but p waits for it: x's owner is told so, and x stays suspended.
    let e = h.begin_resume("x", Some(1_000)).err().expect("refused");
    let text = e.to_string();
    assert!(matches!(e, HostError::WaitedFor { .. }), "{text}");
    assert!(
        text.contains("job p, suspended by preemption for job q, waits for its CPUs 0"),
        "{text}"
    );
    assert!(h.ledger().is_suspended("x"));
    h.ledger().check().unwrap();
    // Once q ends, p runs again on its CPUs (x's among them), and x's resume waits for p.
    h.release("q").unwrap();
    assert!(!h.ledger().is_suspended("p"));
    let e = h.begin_resume("x", Some(1_000)).err().expect("refused");
    assert!(matches!(e, HostError::Lent { ref holder, .. } if holder == "p"), "{e}");
    h.release("p").unwrap();
    let ticket = h.begin_resume("x", Some(1_000)).unwrap();
    let outcome = ticket.run();
    h.finish_resume(ticket, outcome).unwrap();
    h.ledger().check().unwrap();
}

#[test]
fn a_victim_whose_cpus_its_preemptor_did_not_take_runs_on_uncounted() {
    // Found by attacking the owner's suspensions: while a victim's freeze ran without the lock,
    // the owner of another job suspended it; the preemptor, asked again, went onto that job's
    // CPUs, and the victim stayed frozen on CPUs nobody took, its suspension counted.
    let topo = two_nodes_of_four();
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    h.defer_kernel_waits();
    h.set_clock(Arc::new(|| at(1_000_000)));
    h.set_preempt(Some(topo_core::policy::Preempt { min_run: 0, ..Default::default() }));
    let alloc = |h: &mut Host, job: &str, req: &str, preempt: bool, preemptible: bool| {
        let mut prepared = prepare(&h.topo, req, None, None).unwrap();
        PreemptAsk::apply(
            PreemptAsk {
                preempt,
                preemptible,
                submitted_at: Some(if preempt { 990_000 } else { 999_000 }),
                estimate_s: Some(if preempt { 10 } else { 3_600 }),
            },
            &mut prepared,
        );
        h.allocate_prepared(job, &prepared, None, None)
    };
    let frozen = |job: &str| kernel.is_frozen(&JobId::parse(job).unwrap()).unwrap();
    let v = alloc(&mut h, "v", "affinity[core*4]", false, true).unwrap();
    let x = alloc(&mut h, "x", "affinity[core*2]", false, false).unwrap();
    alloc(&mut h, "y", "affinity[core*2]", false, false).unwrap();
    let e = alloc(&mut h, "p", "affinity[core*2]", true, false).unwrap_err();
    assert!(matches!(e, HostError::PreemptionUnderWay(_)), "{e}");
    run_queued(&mut h);
    assert!(frozen("v"));
    // x's owner stops x meanwhile: its CPUs are free, and the preemptor goes there.
    let ticket = h.begin_suspend("x", Some(1_000)).unwrap();
    let outcome = ticket.run();
    h.finish_suspend(ticket, outcome).unwrap();
    let p = alloc(&mut h, "p", "affinity[core*2]", true, false).unwrap();
    assert!(!p.cpus.intersects(&v.cpus) && p.cpus.is_subset(&x.cpus), "{} {}", p.cpus, x.cpus);
    run_queued(&mut h);
    assert!(!frozen("v") && !h.ledger().is_suspended("v"));
    let hint = &h.hints["v"];
    assert_eq!(
        (hint.clock.suspensions, hint.preempted_by.as_deref(), hint.suspended),
        (0, None, false)
    );
    h.ledger().check().unwrap();
}

#[test]
fn a_suspended_jobs_cpus_are_lent_and_it_resumes_when_they_are_back_also_after_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let topo = small_topology(8);
    let kernel = kernel_for(&topo);
    let mut first = host_on(&topo, &kernel, Some(dir.path()));
    let a = first.allocate("a", "affinity[thread*6]", None, None, None, None).unwrap();
    let s = first.suspend("a").unwrap();
    assert_eq!(s.cpus, a.cpus);
    assert!(kernel.is_frozen(&JobId::parse("a").unwrap()).unwrap());
    // Only 8 CPUs: b needs at least four of a's.
    let b = first.allocate("b", "affinity[thread*6]", None, None, None, None).unwrap();
    let lent = b.cpus.intersection(&a.cpus);
    assert!(lent.len() >= 4, "{lent}");
    let views = first.jobs();
    assert_eq!((views[0].state, views[1].state), (JobState::Suspended, JobState::Running));
    assert_eq!(views[0].lent_to.get("b"), Some(&lent));
    assert_eq!(views[1].borrowed_from.get("a"), Some(&lent));
    // Twice suspended, or resumed onto b's CPUs: refused, nothing changes.
    assert!(matches!(first.suspend("a"), Err(HostError::Ledger(LedgerError::WrongState { .. }))));
    let e = first.resume("a").unwrap_err();
    assert!(e.to_string().contains("lent to job b"), "{e}");
    assert!(kernel.is_frozen(&JobId::parse("a").unwrap()).unwrap());
    assert!(matches!(first.resume("b"), Err(HostError::Ledger(LedgerError::WrongState { .. }))));
    assert!(matches!(first.suspend("nope"), Err(HostError::UnknownJob(_))));
    // topod dies with a suspended and b on its CPUs: both come back as they were.
    std::mem::forget(first);
    let mut again = host_on(&topo, &kernel, Some(dir.path()));
    let report = again.recover(BTreeMap::new()).unwrap();
    assert_eq!(
        (report.kept.len(), report.suspended.clone()),
        (2, vec!["a".to_string()]),
        "{report:?}"
    );
    assert!(again.ledger().is_suspended("a"));
    assert_eq!(again.ledger().get("b").unwrap().cpus, b.cpus);
    assert!(again.resume("a").unwrap_err().to_string().contains("lent to job b"));
    again.ledger().check().unwrap();
    // b ends: a runs again on its own CPUs, and no CPU is given twice.
    again.release("b").unwrap();
    let r = again.resume("a").unwrap();
    assert_eq!(r.cpus, a.cpus);
    assert!(!kernel.is_frozen(&JobId::parse("a").unwrap()).unwrap());
    assert!(again.allocate("c", "affinity[thread*3]", None, None, None, None).is_err());
    // An explicit suspension is not preemption's: not counted toward
    // preempt_max_suspensions. A suspended job can be released.
    assert_eq!(again.hints["a"].clock.suspensions, 0);
    again.suspend("a").unwrap();
    again.release("a").unwrap();
    assert!(again.ledger().is_empty());
    // A cgroup found frozen that was never suspended (a release cut short by a crash) is
    // a running job that holds its CPUs, and is thawed.
    let d = again.allocate("d", "affinity[thread*2]", None, None, None, None).unwrap();
    let d_id = JobId::parse("d").unwrap();
    kernel.freeze(&d_id, Duration::from_secs(1)).unwrap();
    std::mem::forget(again);
    let mut third = host_on(&topo, &kernel, Some(dir.path()));
    let report = third.recover(BTreeMap::new()).unwrap();
    assert!(report.suspended.is_empty(), "{report:?}");
    assert!(!third.ledger().is_suspended("d") && !kernel.is_frozen(&d_id).unwrap());
    assert_eq!(third.ledger().occupancy().held, d.cpus);
}

/// An allocate that comes with the batch system's view, as the Slurm plug-in sends it.
fn following(
    h: &mut Host,
    suspended: &[&str],
    job: &str,
    request: &str,
    cpus: Option<&str>,
) -> Result<Allocation, HostError> {
    let mut prepared = prepare(&h.topo.clone(), request, None, cpus).unwrap();
    prepared.follows_batch = true;
    h.allocate_following(Some(&view(suspended, &[])), job, &prepared, None, None)
}

#[test]
fn a_job_refused_on_the_cpus_of_a_job_the_batch_system_suspended_gives_them_back() {
    let topo = small_topology(2);
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    h.allocate("slurm-1", "affinity[thread*2]", None, Some("0-1"), None, None).unwrap();
    // Slurm suspended slurm-1 for slurm-2, whose request can never fit this host.
    let e = following(&mut h, &["slurm-1"], "slurm-2", "affinity[thread*4]", Some("0-1"));
    assert!(matches!(e, Err(HostError::DoesNotFit { .. })), "{e:?}");
    // Slurm resumes slurm-1 (its preemptor failed): topod holds it running, its CPUs
    // lent to nobody, and a job without the batch system's view cannot take them.
    assert!(!h.ledger().is_suspended("slurm-1") && !h.batch_suspended("slurm-1"));
    let e = h.allocate("other", "affinity[thread*2]", None, None, None, None);
    assert!(matches!(e, Err(HostError::DoesNotFit { .. })), "{e:?}");
    h.ledger().check().unwrap();
}

#[test]
fn with_preemption_in_tiers_the_last_suspended_runs_again_first() {
    let topo = small_topology(2);
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    h.allocate("slurm-1", "affinity[thread*2]", None, Some("0-1"), None, None).unwrap();
    following(&mut h, &["slurm-1"], "slurm-2", "affinity[thread*2]", Some("0-1")).unwrap();
    following(&mut h, &["slurm-2"], "slurm-3", "affinity[thread*2]", Some("0-1")).unwrap();
    assert!(h.batch_suspended("slurm-1") && h.batch_suspended("slurm-2"));
    // high ends: Slurm resumes mid; low stays suspended for mid.
    h.release("slurm-3").unwrap();
    assert!(!h.ledger().is_suspended("slurm-2"), "mid runs again");
    assert!(h.batch_suspended("slurm-1"), "low still lends to mid");
    h.release("slurm-2").unwrap();
    assert!(!h.ledger().is_suspended("slurm-1"));
    h.ledger().check().unwrap();
}

fn view(suspended: &[&str], running: &[&str]) -> topo_core::proto::BatchView {
    let owned = |jobs: &[&str]| jobs.iter().map(|j| j.to_string()).collect();
    topo_core::proto::BatchView { suspended: owned(suspended), running: owned(running) }
}

#[test]
fn a_job_the_batch_system_suspended_lends_its_cpus_unfrozen_and_runs_again_after_its_borrower() {
    let dir = tempfile::tempdir().unwrap();
    let topo = small_topology(8);
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    let low = h.allocate("slurm-1", "affinity[thread*4]", None, Some("0-3"), None, None).unwrap();
    // Slurm starts the high job on the low job's cores: without being told, topod refuses.
    let e = h.allocate("slurm-2", "affinity[thread*4]", None, Some("0-3"), None, None);
    assert!(matches!(e, Err(HostError::DoesNotFit { .. })), "{e:?}");
    let done = h.follow_batch(&view(&["slurm-1", "slurm-9"], &[])).unwrap();
    assert_eq!(done.suspended, vec!["slurm-1"], "a job topod does not hold is ignored");
    // A job that did not come with the batch system's view never gets them (topod's idea
    // of the suspension may be old: the batch system may have resumed it since).
    let e = h.allocate("other", "affinity[thread*4]", None, Some("0-3"), None, None);
    assert!(matches!(e, Err(HostError::DoesNotFit { .. })), "{e:?}");
    let high = following(&mut h, &[], "slurm-2", "affinity[thread*4]", Some("0-3")).unwrap();
    assert_eq!(high.cpus, low.cpus);
    let low_id = JobId::parse("slurm-1").unwrap();
    assert!(!kernel.is_frozen(&low_id).unwrap(), "Slurm stopped it; topod does not freeze it");
    let views = h.jobs();
    assert_eq!(views[0].state, JobState::Suspended);
    assert!(views[0].batch_suspended);
    assert_eq!(views[1].borrowed_from.get("slurm-1"), Some(&low.cpus));
    // Its freezer is not topod's: the refreeze of thawed suspended jobs leaves it alone.
    assert!(h.begin_refreeze().is_empty());
    // Said again (the next job's allocate): nothing changes.
    assert!(h.follow_batch(&view(&["slurm-1"], &[])).unwrap().suspended.is_empty());
    // Slurm says it runs while the high job still holds its CPUs: not yet.
    let done = h.follow_batch(&view(&[], &["slurm-1"])).unwrap();
    assert_eq!(done.still_lent, vec!["slurm-1"]);
    assert!(h.ledger().is_suspended("slurm-1"));
    // topod dies here: both come back, the lender still lending.
    std::mem::forget(h);
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    let report = h.recover(BTreeMap::new()).unwrap();
    assert!(report.conflicts.is_empty(), "{report:?}");
    assert_eq!(report.suspended, vec!["slurm-1"]);
    assert!(h.batch_suspended("slurm-1"));
    assert!(!kernel.is_frozen(&low_id).unwrap());
    // The high job ends: the low one runs again on its own CPUs, as Slurm resumes it.
    h.release("slurm-2").unwrap();
    assert!(!h.ledger().is_suspended("slurm-1"));
    assert_eq!(h.ledger().get("slurm-1").unwrap().cpus, low.cpus);
    assert!(!h.jobs()[0].batch_suspended);
    h.ledger().check().unwrap();
    // And a restart now finds it running.
    std::mem::forget(h);
    let mut h = host_on(&topo, &kernel, Some(dir.path()));
    let report = h.recover(BTreeMap::new()).unwrap();
    assert!(report.suspended.is_empty(), "{report:?}");
    assert!(!h.ledger().is_suspended("slurm-1"));
}

#[test]
fn a_job_the_batch_system_starts_suspended_takes_turns_on_the_running_jobs_cpus() {
    let topo = small_topology(8);
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    let first = h.allocate("slurm-1", "affinity[thread*4]", None, Some("0-3"), None, None).unwrap();
    let other = h.allocate("slurm-5", "affinity[thread*2]", None, Some("4-5"), None, None).unwrap();
    let mut prepared = prepare(&topo, "affinity[thread*4]", None, Some("0-3")).unwrap();
    prepared.starts_suspended = true;
    let second = h.allocate_prepared("slurm-2", &prepared, None, None).unwrap();
    assert_eq!(second.cpus, first.cpus);
    assert!(h.batch_suspended("slurm-2"));
    assert!(!h.ledger().is_suspended("slurm-1") && !h.ledger().is_suspended("slurm-5"));
    assert_eq!(h.ledger().get("slurm-5").unwrap().cpus, other.cpus);
    h.ledger().check().unwrap();
    // Slurm's next slice: the second runs, the first is stopped.
    let done = h.follow_batch(&view(&["slurm-1"], &["slurm-2", "slurm-5"])).unwrap();
    assert_eq!(
        (done.suspended, done.resumed),
        (vec!["slurm-1".to_string()], vec!["slurm-2".to_string()])
    );
    assert!(h.batch_suspended("slurm-1") && !h.ledger().is_suspended("slurm-2"));
    // Neither is ever frozen by topod.
    for j in ["slurm-1", "slurm-2"] {
        assert!(!kernel.is_frozen(&JobId::parse(j).unwrap()).unwrap());
    }
    h.release("slurm-2").unwrap();
    assert!(!h.ledger().is_suspended("slurm-1"));
    // Without the CPUs Slurm gave, there is nothing to bound the sharing: refused.
    let mut loose = prepare(&topo, "affinity[thread*2]", None, None).unwrap();
    loose.starts_suspended = true;
    let e = h.allocate_prepared("slurm-3", &loose, None, None).unwrap_err();
    assert!(e.to_string().contains("starts_suspended needs the CPUs"), "{e}");
    assert!(h.ledger().get("slurm-3").is_none());
    h.ledger().check().unwrap();
}

#[test]
fn the_batch_systems_view_never_touches_a_job_topod_suspended() {
    let topo = small_topology(8);
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    h.allocate("slurm-1", "affinity[thread*2]", None, None, None, None).unwrap();
    h.suspend("slurm-1").unwrap();
    let id = JobId::parse("slurm-1").unwrap();
    let done = h.follow_batch(&view(&[], &["slurm-1"])).unwrap();
    assert_eq!(done, topo_core::proto::reply::Follow::default());
    assert!(h.ledger().is_suspended("slurm-1") && kernel.is_frozen(&id).unwrap());
    // A batch-suspended job that topod is then asked to suspend is frozen: now topod's.
    h.allocate("slurm-2", "affinity[thread*2]", None, None, None, None).unwrap();
    h.follow_batch(&view(&["slurm-2"], &[])).unwrap();
    h.suspend("slurm-2").unwrap();
    assert!(kernel.is_frozen(&JobId::parse("slurm-2").unwrap()).unwrap());
    assert!(!h.batch_suspended("slurm-2"));
    assert!(h.follow_batch(&view(&[], &["slurm-2"])).unwrap().resumed.is_empty());
    // Garbage is refused whole, naming the job.
    let e = h.follow_batch(&view(&["../x"], &[])).unwrap_err().to_string();
    assert!(e.contains("suspended") && e.contains("../x"), "{e}");
    let e = h.follow_batch(&view(&["slurm-2"], &["slurm-2"])).unwrap_err().to_string();
    assert!(e.contains("named twice"), "{e}");
}

#[test]
fn a_suspended_jobs_cpus_are_lent_only_when_a_job_fits_nowhere_else() {
    let topo = small_topology(8);
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    let a = h.allocate("a", "affinity[thread*2]", None, None, None, None).unwrap();
    h.suspend("a").unwrap();
    // Six CPUs are free without a's: b and c go there, and a can resume at once.
    let b = h.allocate("b", "affinity[thread*4]", None, None, None, None).unwrap();
    let c = h.allocate("c", "affinity[thread*2]", None, None, None, None).unwrap();
    assert!(!b.cpus.intersects(&a.cpus) && !c.cpus.intersects(&a.cpus), "{b:?} {c:?}");
    // Only a's are left: d borrows one, and a waits for it.
    let d = h.allocate("d", "affinity[thread]", None, None, None, None).unwrap();
    assert!(d.cpus.is_subset(&a.cpus), "{}", d.cpus);
    assert!(h.resume("a").unwrap_err().to_string().contains("lent to job d"));
    h.release("d").unwrap();
    assert_eq!(h.resume("a").unwrap().cpus, a.cpus);
    h.ledger().check().unwrap();
}

#[test]
fn a_suspended_job_never_runs_beside_its_borrower_after_a_restart_whatever_its_record_says() {
    let dir = tempfile::tempdir().unwrap();
    let topo = small_topology(2);
    let kernel = kernel_for(&topo);
    let mut first = host_on(&topo, &kernel, Some(dir.path()));
    first.allocate("g", "affinity[thread*2]", None, None, None, None).unwrap();
    first.suspend("g").unwrap();
    // A suspended job takes no process and is not allocated again (its CPUs may be lent).
    assert!(matches!(first.join("g", 4242), Err(HostError::Suspended(_))));
    let again = first.allocate("g", "affinity[thread*2]", None, None, None, None);
    assert!(matches!(again, Err(HostError::Suspended(_))), "{again:?}");
    // h borrows both CPUs and has a process.
    first.allocate("h", "affinity[thread*2]", None, None, None, None).unwrap();
    kernel.join(&JobId::parse("h").unwrap(), 4343).unwrap();
    // Someone thaws g behind topod's back, then topod dies. The name order would put g
    // first; the job with processes wins and g is frozen again.
    let g = JobId::parse("g").unwrap();
    kernel.thaw(&g, Duration::from_secs(1)).unwrap();
    std::mem::forget(first);
    let mut second = host_on(&topo, &kernel, Some(dir.path()));
    let report = second.recover(BTreeMap::new()).unwrap();
    assert!(report.conflicts.is_empty(), "{report:?}");
    assert!(second.ledger().is_suspended("g") && kernel.is_frozen(&g).unwrap());
    assert_eq!(second.ledger().occupancy().held, CpuSet::parse_list("0-1").unwrap());
    // A record from before the 'suspended' flag (or an adopt that lost it) says running:
    // frozen and lent, g still stays suspended instead of being thawed onto h's CPUs.
    let record = dir.path().join("jobs/g.json");
    let text = std::fs::read_to_string(&record)
        .unwrap()
        .replace("\"suspended\":true", "\"suspended\":false");
    assert!(text.contains("\"suspended\":false"), "{text}");
    std::fs::write(&record, text).unwrap();
    std::mem::forget(second);
    let mut third = host_on(&topo, &kernel, Some(dir.path()));
    third.recover(BTreeMap::new()).unwrap();
    assert!(third.ledger().is_suspended("g") && kernel.is_frozen(&g).unwrap());
    third.ledger().check().unwrap();
}

#[test]
fn a_suspended_job_thawed_behind_topods_back_is_frozen_again_on_the_tick() {
    let topo = small_topology(2);
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    h.allocate("a", "affinity[thread*1]", None, None, None, None).unwrap();
    h.suspend("a").unwrap();
    let a = JobId::parse("a").unwrap();
    assert!(h.begin_refreeze().is_empty(), "frozen as it should be");
    kernel.thaw(&a, Duration::from_secs(1)).unwrap();
    let tickets = h.begin_refreeze();
    assert_eq!(tickets.len(), 1);
    // Meanwhile the job is being suspended: no resume or release slips in.
    assert!(matches!(h.resume("a"), Err(HostError::Changing { .. })));
    for t in tickets {
        let outcome = t.run();
        h.finish_refreeze(t, outcome);
    }
    assert!(kernel.is_frozen(&a).unwrap() && h.ledger().is_suspended("a"));
}

#[test]
fn every_recorded_request_reads_back_as_itself() {
    let mut h = host(None);
    let e = h.allocate("1", "affinity[thread]", Some(0), None, None, None).unwrap_err().to_string();
    assert!(e.contains("tasks = 0"), "{e}");
    let e = h.fit("affinity[thread]", Some(0)).unwrap_err().to_string();
    assert!(e.contains("tasks = 0"), "{e}");
    let e = h.fit("affinity[thread]", Some(u32::MAX)).unwrap_err().to_string();
    assert!(e.contains("tasks = 4294967295: at most 65536"), "{e}");
    // CPUs the host does not have are named, early, whatever the request's size: refused
    // by `prepare` itself (before any placement, and with no lock: a server's `fit` calls it
    // first), in one range rather than the request's 6,000, and without echoing the 66 KB
    // request. What such a request costs is timed by `cargo bench -p topod --bench requests`
    // (and through topod by `topoctl bench daemon --hostile`), not here.
    let huge = format!("CPUSET[CPU_LIST={}]", vec!["0-65535"; 6000].join(","));
    let Err(e) = prepare(h.topology(), &huge, None, None) else { panic!("prepared") };
    let e = e.to_string();
    assert!(e.contains("CPU_LIST names CPUs 32-65535, which this host does not have"), "{e}");
    assert!(e.len() < 200, "the refusal does not grow with the request: {} bytes", e.len());
    let e = h.fit(&huge, None).unwrap_err().to_string();
    assert!(e.contains("CPUs 32-65535") && e.contains("does not have"), "{e}");
    let e = h
        .allocate("2", "CPUSET[CPU_LIST=5000-6000]", None, None, None, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("CPUs 5000-6000, which this host does not have"), "{e}");
    let e = h
        .allocate("2", "affinity[thread]", None, Some("0-1,99"), None, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("batch system's CPU list names CPUs 99"), "{e}");
    let e = h
        .allocate("2", "CPUSET[CPU_LIST=5] affinity[thread]", None, Some("0-1"), None, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no CPU among those the batch system gave"), "{e}");
    assert!(h.ledger().is_empty());
    // What is recorded parses back to itself.
    for (req, tasks) in [
        ("affinity[core(2)*2]", None),
        ("affinity[thread]", Some(3)),
        ("CPUSET[CPUSET_OPTIONS=CPUSET_CPU_EXCLUSIVE;MAX_RADIUS=1] affinity[thread*2]", None),
    ] {
        let a = h
            .allocate(
                &format!("j{req}{tasks:?}")
                    .replace(['[', ']', '(', ')', '*', ' ', ';', '=', ','], ""),
                req,
                tasks,
                None,
                None,
                None,
            )
            .unwrap();
        assert_eq!(topo_core::request::parse(&a.request).unwrap().to_string(), a.request);
    }
}

#[test]
fn the_last_allocate_of_a_job_is_remembered_until_it_is_released() {
    let mut h = host(None);
    let before = std::time::SystemTime::now() - Duration::from_secs(1);
    assert_eq!(h.allocated_after("5", before), None);
    h.allocate("5", "affinity[thread]", None, None, None, None).unwrap();
    let first = h.allocated_after("5", before).expect("allocated after `before`");
    assert_eq!(h.allocated_after("5", first), None);
    // The same allocation asked again (a requeued job's new run) counts as a new one.
    std::thread::sleep(Duration::from_millis(5));
    h.allocate("5", "affinity[thread]", None, None, None, None).unwrap();
    assert!(h.allocated_after("5", first).is_some());
    h.release("5").unwrap();
    assert_eq!(h.allocated_after("5", before), None);
}

#[test]
fn the_last_allocate_of_a_job_outlives_a_restart() {
    // A queued release older than a job's last allocation was for an earlier run: a restart
    // must not forget that allocation (it would kill the new run).
    let dir = tempfile::tempdir().unwrap();
    let topo = small_topology(4);
    let kernel = kernel_for(&topo);
    let start = |kernel: &std::sync::Arc<Fake>| host_on(&topo, kernel, Some(dir.path()));
    let mut first = start(&kernel);
    first.allocate("slurm-11", "affinity[thread]", None, None, None, None).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    let asked = std::time::SystemTime::now();
    std::thread::sleep(Duration::from_millis(5));
    // Slurm requeued it and its new run started here: the same allocation asked again.
    first.allocate("slurm-11", "affinity[thread]", None, None, None, None).unwrap();
    let again_at = first.allocated_after("slurm-11", asked).expect("allocated after");
    std::mem::forget(first);
    let mut second = start(&kernel);
    second.recover(BTreeMap::new()).unwrap();
    assert_eq!(second.allocated_after("slurm-11", asked), Some(again_at));
    // And again after a second restart (recovery writes the record again).
    std::mem::forget(second);
    let mut third = start(&kernel);
    third.recover(BTreeMap::new()).unwrap();
    assert_eq!(third.allocated_after("slurm-11", asked), Some(again_at));
    // A record written before records kept the time: its file's time stands for it.
    std::mem::forget(third);
    let record = dir.path().join("jobs/slurm-11.json");
    let old: serde_json::Value = serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
    let mut old = old.as_object().unwrap().clone();
    old.remove("allocated_at");
    std::fs::write(&record, serde_json::to_vec(&old).unwrap()).unwrap();
    let written = std::time::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    std::fs::File::options().write(true).open(&record).unwrap().set_modified(written).unwrap();
    let mut fourth = start(&kernel);
    fourth.recover(BTreeMap::new()).unwrap();
    assert_eq!(fourth.allocated_after("slurm-11", written - Duration::from_secs(1)), Some(written));
    assert_eq!(fourth.allocated_after("slurm-11", written), None);
}

#[test]
fn a_job_being_released_takes_no_process_and_shows_as_releasing() {
    let mut h = host(None);
    h.allocate("5", "affinity[thread*2]", None, None, None, Some(1000)).unwrap();
    h.join("5", 4242).unwrap();
    let ticket = h.begin_release("5").unwrap();
    assert!(matches!(h.join("5", 4243), Err(HostError::Releasing(_))));
    assert!(matches!(
        h.allocate("5", "affinity[thread*2]", None, None, None, None),
        Err(HostError::Releasing(_))
    ));
    assert!(matches!(h.begin_release("5"), Err(HostError::Releasing(_))));
    let view = h.jobs();
    assert_eq!((view[0].state, view[0].owner_uid), (JobState::Releasing, Some(1000)));
    assert_eq!(h.snapshot().occupancy.held.len(), 2, "its CPUs stay held while it is released");
    let outcome = ticket.run();
    assert_eq!(h.finish_release(ticket, outcome).unwrap(), 1);
    assert!(h.ledger().is_empty() && h.jobs().is_empty());
}

#[test]
fn a_foreign_cpuset_that_goes_away_gives_its_cpus_back() {
    let topo = small_topology(4);
    let kernel = kernel_for(&topo);
    let foreign = std::sync::Arc::new(std::sync::Mutex::new(CpuSet::parse_list("3").unwrap()));
    let mut h = Host::new(
        topo,
        CpuSet::new(),
        Box::new(SharedFake { kernel, offers_self_join: false, foreign: foreign.clone() }),
        None,
        Strategy::BestFit,
    )
    .unwrap();
    assert!(h.reconcile_foreign().is_some());
    assert_eq!(h.allocatable().to_string(), "0-2");
    assert!(h.allocate("a", "affinity[thread*4]", None, None, None, None).is_err());
    *foreign.lock().unwrap() = CpuSet::new();
    // The next allocate that the model refuses does not look; the timer (or a refused
    // cgroup) does.
    assert_eq!(h.reconcile_foreign().map(|(_, after)| after.is_empty()), Some(true));
    assert_eq!(h.allocatable().to_string(), "0-3");
    h.allocate("a", "affinity[thread*4]", None, None, None, None).unwrap();
    assert!(h.reconcile_foreign().is_none(), "nothing changed");
}

/// The LSF module's cache of this host ("h"), its free map read as a scheduler reads it over
/// the wire; with the cache's id of the host and the time of the reading.
fn module_cache_of(
    h: &Host,
    topo: &Topology,
) -> (topo_plugin_core::HostCache, topo_plugin_core::cache::HostId, std::time::Instant) {
    use topo_plugin_core::{Address, HostCache};
    let wire = serde_json::to_value(h.snapshot().free_map()).unwrap();
    let free: topo_plugin_core::cache::FreeMap = serde_json::from_value(wire).unwrap();
    let mut cache = HostCache::new();
    let id = cache.add("h", Address::Unix("/nowhere".into()));
    let now = std::time::Instant::now();
    cache.update(id, Some(topo), free, now).unwrap();
    (cache, id, now)
}

/// What the schedulers' plug-ins (the LSF module) decide for `request` on this host from its
/// free map, as a scheduler would read it over the wire: kept (fits, or fits after moves) or
/// removed, with the reason.
fn plugin_verdict(h: &Host, topo: &Topology, request: &str, epoch_s: i64) -> (bool, String) {
    plugin_verdict_for(h, topo, request, epoch_s, None)
}

/// [`plugin_verdict`] for one named job (`Some`: LSF's checkAllocFn, which is told the job,
/// and so its own blocks) or its peers (`None`: matchFn, told only the request).
fn plugin_verdict_for(
    h: &Host,
    topo: &Topology,
    request: &str,
    epoch_s: i64,
    job: Option<&str>,
) -> (bool, String) {
    use topo_plugin_core::{eval, Claimant, Reservations, Unreachable};
    let (cache, id, now) = module_cache_of(h, topo);
    let reservations = Reservations::new();
    let ctx = eval::Context {
        cache: &cache,
        reservations: &reservations,
        now,
        epoch_s,
        stale_after: Duration::from_secs(3600),
        unreachable: Unreachable::Closed,
    };
    let mut req = topo_core::request::parse(request).unwrap();
    req.tasks.get_or_insert(1);
    let who = job.map_or_else(|| Claimant::peers_of(&req), Claimant::job);
    let verdict = eval::evaluate(&ctx, id, &req, who);
    (verdict.rank().is_some(), format!("{verdict:?}"))
}

#[test]
fn the_plugins_keep_a_defragmenting_host_exactly_when_its_allocate_places_the_job() {
    // Issue 31's rule, "a job the module keeps on a host is one topod accepts there", both
    // ways, on random fragmentations of a host that moves jobs, with its timers running.
    let topo = two_packages();
    let shapes = [
        "affinity[core(1)]",
        "affinity[core(2)]",
        "affinity[core(3,same=l3)]",
        "affinity[core(4,same=l3)]",
        "affinity[thread(3)]",
        "affinity[core(2)*2]",
        "affinity[l3(1)]",
        "affinity[numa(1)]",
        "affinity[core(6,same=numa)]",
        "CPUSET[CPU_LIST=0-7] affinity[core(2)]",
    ];
    let (mut kept_accepted, mut removed_refused, mut disagreements) = (0, 0, Vec::new());
    let (mut after_moves, mut no_moves) = (0, 0);
    for (seed, (min_run, gap)) in [(1u64, (0, 0)), (2, (30, 0)), (3, (0, 100)), (4, (20, 40))] {
        let kernel = kernel_for(&topo);
        let mut h = host_on(&topo, &kernel, None);
        let clock = Arc::new(std::sync::atomic::AtomicI64::new(1_000_000));
        let c = clock.clone();
        h.set_clock(Arc::new(move || at(c.load(std::sync::atomic::Ordering::SeqCst) as u64)));
        h.set_defrag(Some(Defrag {
            min_run,
            gap,
            limits: topo_core::defrag::DefragLimits::default(),
        }));
        let mut rng = topo_core::bench::SplitMix::new(seed);
        let mut running: Vec<String> = Vec::new();
        for trial in 0..150 {
            clock.fetch_add((rng.next_u64() % 15) as i64, std::sync::atomic::Ordering::SeqCst);
            // Fragment: start some jobs, end some.
            for _ in 0..(rng.next_u64() % 3) {
                let job = format!("j{seed}-{trial}-{}", rng.next_u64() % 1000);
                let shape = shapes[(rng.next_u64() as usize) % 6];
                if h.allocate(&job, shape, None, None, None, None).is_ok() {
                    running.push(job);
                }
            }
            while running.len() > 2 && rng.next_u64() % 3 == 0 {
                let job = running.remove((rng.next_u64() as usize) % running.len());
                h.release(&job).unwrap();
            }
            let probe = shapes[(rng.next_u64() as usize) % shapes.len()];
            let now = clock.load(std::sync::atomic::Ordering::SeqCst);
            let (kept, verdict) = plugin_verdict(&h, &topo, probe, now);
            let job = format!("p{seed}-{trial}");
            let placed = h.allocate(&job, probe, None, None, None, None);
            after_moves += usize::from(verdict.starts_with("AfterMoves"));
            no_moves += usize::from(verdict.contains("NoMoves"));
            match (kept, &placed) {
                (true, Ok(_)) => kept_accepted += 1,
                (false, Err(_)) => removed_refused += 1,
                _ => disagreements.push(format!(
                    "seed {seed} trial {trial} {probe}: plug-in {verdict}; allocate {:?}",
                    placed.as_ref().map(|a| a.cpus.to_string()).map_err(|e| e.to_string())
                )),
            }
            if placed.is_ok() {
                running.push(job);
            }
            h.ledger().check().unwrap();
        }
    }
    assert!(
        disagreements.is_empty(),
        "{} disagreements:\n{}",
        disagreements.len(),
        disagreements.join("\n")
    );
    // Both answers were common, so the agreement means something.
    assert!(
        kept_accepted > 100 && removed_refused > 100 && after_moves > 10 && no_moves > 10,
        "{kept_accepted} kept, {removed_refused} removed, {after_moves} after moves, {no_moves} \
         with no moves"
    );
}

/// Two packages of one NUMA node of four single-thread cores (node 0: CPUs 0-3, node 1: 4-7),
/// with a GPU on each node and one whose node is not known.
fn two_nodes_with_gpus() -> Topology {
    let gpu = |address: &str, name: &str, node: Option<u32>| topo_core::topology::IoDevice {
        pci_address: address.into(),
        class: topo_core::topology::DeviceClass::Gpu,
        class_code: 0x030200,
        vendor_id: Some(0x10de),
        device_id: None,
        names: vec![name.into()],
        numa_node: node,
        local_cpus: CpuSet::new(),
        upstream: Vec::new(),
        virtual_function: false,
        fabric: None,
    };
    let mut topo = two_nodes_of_four();
    topo.devices = vec![
        gpu("0000:18:00.0", "card0", Some(0)),
        gpu("0000:86:00.0", "card1", Some(1)),
        gpu("0000:d8:00.0", "card2", None),
    ];
    topo
}

fn with_gpus(topo: &Topology, text: &str, cpus: Option<&str>, gpus: &[&str]) -> Prepared {
    let gpus: Vec<String> = gpus.iter().map(|g| g.to_string()).collect();
    prepare(topo, text, None, cpus).and_then(|p| p.with_gpus(topo, &gpus)).unwrap()
}

/// Issue 33, the batch system chose the GPUs: the job's CPUs go in its GPU's NUMA node, also
/// when best-fit would have put it elsewhere; without room there it runs elsewhere unless its
/// request says `gpubind=numa`; the listing says how near, also after a restart.
#[test]
fn a_job_given_a_gpu_gets_cpus_in_its_numa_node_and_the_listing_says_how_near() {
    let topo = two_nodes_with_gpus();
    let kernel = kernel_for(&topo);
    let records = tempfile::tempdir().unwrap();
    let mut h = host_on(&topo, &kernel, Some(records.path()));
    // Node 0 has one core taken: best-fit alone would put a 3-core job there.
    h.allocate("cpu", "affinity[core]", None, None, None, None).unwrap();
    let plain = prepare(&topo, "affinity[core*3]", None, None).unwrap();
    assert_eq!(h.snapshot().fit(&plain).unwrap().cpus, CpuSet::parse_list("1-3").unwrap());
    let a = h.allocate_prepared(
        "g1",
        &with_gpus(&topo, "affinity[core*3]", None, &["card1"]),
        None,
        None,
    );
    assert_eq!(a.unwrap().cpus, CpuSet::parse_list("4-6").unwrap());
    // Asked again by the next step: the same CPUs, not an "already holds" refusal.
    let again = with_gpus(&topo, "affinity[core*3]", None, &["0000:86:00.0"]);
    assert_eq!(
        h.allocate_prepared("g1", &again, None, None).unwrap().cpus,
        CpuSet::parse_list("4-6").unwrap()
    );
    // Node 1 has one core left: a 2-core job given card1 runs on node 0 (best effort) ...
    let b = h.allocate_prepared(
        "g2",
        &with_gpus(&topo, "affinity[core*2]", None, &["card1"]),
        None,
        None,
    );
    assert_eq!(b.unwrap().cpus, CpuSet::parse_list("1-2").unwrap());
    // ... and one that says gpubind=numa does not fit.
    let strict = with_gpus(&topo, "affinity[core*2:gpubind=numa]", None, &["card1"]);
    assert_eq!(strict.request.cpu_list, Some(CpuSet::parse_list("4-7").unwrap()));
    assert!(matches!(
        h.allocate_prepared("g3", &strict, None, None),
        Err(HostError::DoesNotFit { .. })
    ));
    let listed =
        |h: &Host, job: &str| h.jobs().into_iter().find(|j| j.allocation.job == job).unwrap().gpus;
    let g1 = listed(&h, "g1");
    assert_eq!(g1.len(), 1);
    assert_eq!(
        (g1[0].pci_address.as_str(), g1[0].name.as_deref()),
        ("0000:86:00.0", Some("card1"))
    );
    assert_eq!((g1[0].numa_node, g1[0].distance), (Some(1), Some(10)));
    assert_eq!(listed(&h, "g2")[0].distance, Some(32), "card1 on node 1, the job's CPUs on node 0");
    assert!(listed(&h, "cpu").is_empty());
    drop(h);
    let mut h = host_on(&topo, &kernel, Some(records.path()));
    h.recover(BTreeMap::new()).unwrap();
    assert_eq!(listed(&h, "g1")[0].distance, Some(10), "kept across a restart");
    // Started again on a host without that GPU: listed as gone, not as of unknown place.
    let mut without = topo.clone();
    without.devices.retain(|d| d.pci_address != "0000:86:00.0");
    let mut elsewhere = host_on(&without, &kernel, Some(records.path()));
    elsewhere.recover(BTreeMap::new()).unwrap();
    assert!(listed(&elsewhere, "g1")[0].gone);
    assert!(!listed(&h, "g1")[0].gone);
    drop(elsewhere);
    // A malleable job beside its GPU only at its largest size (an attack finding: it was shrunk
    // to its least there while more CPUs were free elsewhere).
    h.release("g1").unwrap();
    h.release("g2").unwrap();
    h.allocate("n1", "affinity[core*3]", None, Some("4-6"), None, None).unwrap();
    let m = with_gpus(&topo, "affinity[core*1-4]", None, &["card1"]);
    let grown = h.allocate_prepared("m", &m, None, None).unwrap();
    assert_eq!(grown.tasks.len(), 4, "{grown:?}: 3 cores free on node 0, 1 on node 1 (its GPU's)");
}

/// Names the host has no device for, a GPU given twice, and bindings that cannot be met are
/// refused, naming what is wrong; a GPU whose node is not known binds nothing by default.
#[test]
fn gpus_that_are_not_here_twice_or_of_unknown_place_are_refused_saying_which() {
    let topo = two_nodes_with_gpus();
    let refused = |text: &str, cpus: Option<&str>, gpus: &[&str]| {
        let gpus: Vec<String> = gpus.iter().map(|g| g.to_string()).collect();
        match prepare(&topo, text, None, cpus).and_then(|p| p.with_gpus(&topo, &gpus)) {
            Ok(p) => panic!("{text} with {gpus:?} was taken: {p:?}"),
            Err(e) => e.to_string(),
        }
    };
    let e = refused("affinity[core]", None, &["card7"]);
    assert!(e.contains("no PCI device \"card7\"") && e.contains("0000:86:00.0 (card1)"), "{e}");
    let e = refused("affinity[core]", None, &["card1", "86:00.0"]);
    assert!(e.contains("\"86:00.0\" names 0000:86:00.0 a second time"), "{e}");
    let e = refused("affinity[core:gpubind=numa]", None, &["card2"]);
    assert!(
        e.contains(
            "which CPUs are near GPU 0000:d8:00.0 is not known on this host (its numa_node is -1"
        ),
        "{e}"
    );
    let e = refused("affinity[core:gpubind=numa]", Some("0-3"), &["card1"]);
    assert!(
        e.contains("the CPUs near GPUs 0000:86:00.0 (4-7) are none of those the job may use (0-3)"),
        "{e}"
    );
    // Unknown place, no gpubind: placed as without GPUs; gpubind=any: no preference at all.
    assert_eq!(with_gpus(&topo, "affinity[core]", None, &["card2"]).near_gpus, None);
    assert_eq!(with_gpus(&topo, "affinity[core:gpubind=any]", None, &["card1"]).near_gpus, None);
    // Attack findings: a GPU on a node outside the CPUs topod may use is refused for good (not
    // "does not fit", which a batch system retries); a node that is not the host's is named.
    let mut narrowed = topo.clone();
    narrowed.allowed = CpuSet::parse_list("0-3").unwrap();
    let gpus = vec!["card1".to_string()];
    let e = prepare(&narrowed, "affinity[core:gpubind=numa]", None, None)
        .and_then(|p| p.with_gpus(&narrowed, &gpus))
        .unwrap_err();
    assert!(matches!(e, HostError::BadRequest(_)), "{e}");
    assert!(e.to_string().contains("(4-7) are none of those the job may use (0-3)"), "{e}");
    let mut elsewhere = topo.clone();
    elsewhere.devices[2].numa_node = Some(7);
    let gpus = vec!["card2".to_string()];
    let e = prepare(&elsewhere, "affinity[core:gpubind=numa]", None, None)
        .and_then(|p| p.with_gpus(&elsewhere, &gpus))
        .unwrap_err()
        .to_string();
    assert!(e.contains("its NUMA node 7 is not one of this host's"), "{e}");
    let socket = with_gpus(&topo, "affinity[core:gpubind=socket]", Some("2-7"), &["card0"]);
    assert_eq!(socket.request.cpu_list, Some(CpuSet::parse_list("2-3").unwrap()));
    assert_eq!(socket.ask.gpus, ["0000:18:00.0"]);
}

/// Review finding: the preference for the GPUs' node never borrows a suspended job's CPUs (a
/// borrower keeps it from resuming); a job that fits elsewhere without borrowing goes there.
#[test]
fn a_gpu_jobs_preference_does_not_borrow_a_suspended_jobs_cpus() {
    let topo = two_nodes_with_gpus();
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    let s = h.allocate("s", "affinity[core*4]", None, Some("4-7"), None, None).unwrap();
    assert_eq!(s.cpus, CpuSet::parse_list("4-7").unwrap());
    h.suspend("s").unwrap();
    let g = with_gpus(&topo, "affinity[core*2]", None, &["card1"]);
    let placed = h.allocate_prepared("g", &g, None, None).unwrap();
    assert!(placed.cpus.is_subset(&CpuSet::parse_list("0-3").unwrap()), "{placed:?}");
}

/// Issue 33, confinement: with a backend that confines devices, each job is denied every other
/// GPU's device files (its DRM card and render nodes, NVIDIA's /dev/nvidiaN), keeps its own, and
/// a job given no GPU is denied them all; device files on no GPU stay open. The devices come
/// from the host's `sys/dev/char` and NVIDIA's proc files under the topology's root.
#[test]
fn with_devices_confined_a_job_is_denied_every_gpu_but_its_own() {
    use crate::cgroup::CharDevice;
    let root = tempfile::tempdir().unwrap();
    let link = |number: &str, target: &str| {
        let dir = root.path().join("sys/dev/char");
        std::fs::create_dir_all(&dir).unwrap();
        std::os::unix::fs::symlink(target, dir.join(number)).unwrap();
    };
    link("226:0", "../../devices/pci0000:00/0000:00:01.0/0000:18:00.0/drm/card0");
    link("226:1", "../../devices/pci0000:80/0000:80:01.0/0000:86:00.0/drm/card1");
    link("226:129", "../../devices/pci0000:80/0000:80:01.0/0000:86:00.0/drm/renderD129");
    link("10:200", "../../devices/virtual/misc/tun");
    let nvidia = root.path().join("proc/driver/nvidia/gpus/0000:d8:00.0");
    std::fs::create_dir_all(&nvidia).unwrap();
    std::fs::write(nvidia.join("information"), "Model: Tesla\nDevice Minor: \t 2\n").unwrap();
    let mut topo = two_nodes_with_gpus();
    topo.source = root.path().display().to_string();
    let dev = |major, minor| CharDevice { major, minor };
    let kernel = std::sync::Arc::new(
        Fake::new(topo.allowed.clone(), topo.allowed_mems.clone()).confining_devices(),
    );
    let mut h = host_on(&topo, &kernel, None);
    h.allocate_prepared("g1", &with_gpus(&topo, "affinity[core]", None, &["card1"]), None, None)
        .unwrap();
    let denied = |job: &str| kernel.denied_devices(&JobId::parse(job).unwrap()).unwrap();
    assert_eq!(denied("g1"), [dev(195, 2), dev(226, 0)], "card1's card and render nodes stay open");
    h.allocate("cpu", "affinity[core]", None, None, None, None).unwrap();
    assert_eq!(denied("cpu"), [dev(195, 2), dev(226, 0), dev(226, 1), dev(226, 129)]);
    h.allocate_prepared(
        "g2",
        &with_gpus(&topo, "affinity[core]", None, &["0000:d8:00.0", "card0"]),
        None,
        None,
    )
    .unwrap();
    assert_eq!(denied("g2"), [dev(226, 1), dev(226, 129)]);
    // A later step of g1 names card0 (its own SLURM_STEP_GPUS): g1 has both, and may open both.
    h.allocate_prepared("g1", &with_gpus(&topo, "affinity[core]", None, &["card0"]), None, None)
        .unwrap();
    assert_eq!(denied("g1"), [dev(195, 2)]);
    let listed: Vec<String> = h
        .jobs()
        .into_iter()
        .find(|j| j.allocation.job == "g1")
        .unwrap()
        .gpus
        .into_iter()
        .map(|g| g.pci_address)
        .collect();
    assert_eq!(listed, ["0000:86:00.0", "0000:18:00.0"]);
    // Without confinement nothing is denied, and the backend is never asked to.
    let plain = kernel_for(&topo);
    let mut h = host_on(&topo, &plain, None);
    h.allocate("cpu", "affinity[core]", None, None, None, None).unwrap();
    assert_eq!(plain.denied_devices(&JobId::parse("cpu").unwrap()), None);
}

/// A GPU may be named by its character device number (`char:MAJOR:MINOR`, what the plug-ins
/// send: topod under PrivateDevices= cannot see the job's /dev), read through `sys/dev/char`.
#[test]
fn a_gpu_named_by_its_device_number_is_found_and_a_bad_number_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("sys/dev/char");
    std::fs::create_dir_all(&dir).unwrap();
    std::os::unix::fs::symlink(
        "../../devices/pci0000:80/0000:80:01.0/0000:86:00.0/drm/card1",
        dir.join("226:1"),
    )
    .unwrap();
    let mut topo = two_nodes_with_gpus();
    topo.source = root.path().display().to_string();
    let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        super::device_files_to_pci(&topo, &names(&["char:226:1", "card0"])).unwrap(),
        ["0000:86:00.0", "card0"]
    );
    for (bad, says) in [
        ("char:226", "char:MAJOR:MINOR"),
        ("char:226:x", "char:MAJOR:MINOR"),
        ("char:-1:0", "char:MAJOR:MINOR"),
        ("char:226:7", "226:7 is on no PCI function"),
    ] {
        let e = super::device_files_to_pci(&topo, &names(&[bad])).unwrap_err().to_string();
        assert!(e.contains(bad) && e.contains(says), "{bad}: {e}");
    }
}

/// Issue 33: a reservation for a request that asks topod for GPUs holds GPUs with its block,
/// which lies beside them: no other job is given them (they are not free in the free map or to
/// `fit`), a second reservation takes others, a restart keeps them, and the named job gets them
/// with CPUs in its block. Where every GPU is in use, the block drains with the GPU's job.
#[test]
fn a_reservation_for_gpus_holds_them_beside_its_block_until_its_job_takes_them() {
    let topo = two_nodes_with_gpus();
    let kernel = kernel_for(&topo);
    let records = tempfile::tempdir().unwrap();
    let mut h = host_on(&topo, &kernel, Some(records.path()));
    h.set_clock(Arc::new(|| at(1_000)));
    let node_cpus = |gpu: &str| match gpu {
        "0000:18:00.0" => CpuSet::parse_list("0-3").unwrap(),
        "0000:86:00.0" => CpuSet::parse_list("4-7").unwrap(),
        other => panic!("reserved {other}, a GPU of unknown place, over one with a node"),
    };
    let gpu_of = |h: &Host, job: &str| {
        let gpus = h.jobs().into_iter().find(|j| j.allocation.job == job).unwrap().gpus;
        gpus.iter().map(|g| g.pci_address.clone()).collect::<Vec<_>>()
    };
    let two = prepare(&topo, "affinity[core(2):gpus=1]", None, None).unwrap();
    let (r, busy) = h.reserve("big", &two, 600).unwrap();
    assert_eq!((r.gpus.len(), busy.len()), (1, 0), "{r:?}");
    assert!(r.cpus.is_subset(&node_cpus(&r.gpus[0])), "{r:?}: the block is beside its GPU");
    // A second reservation holds the other GPU with a node.
    let (r2, _) = h.reserve("big2", &two, 600).unwrap();
    assert_eq!(r2.gpus.len(), 1);
    assert_ne!(r2.gpus, r.gpus);
    assert!(r2.cpus.is_subset(&node_cpus(&r2.gpus[0])), "{r2:?}");
    h.unreserve("big2").unwrap();
    // Others are not given the reserved GPU, and the free map and fit count it as taken.
    let one = prepare(&topo, "affinity[core:gpus=1]", None, None).unwrap();
    h.allocate("x", "affinity[core:gpus=1]", None, None, None, None).unwrap();
    h.allocate("y", "affinity[core:gpus=1]", None, None, None, None).unwrap();
    for job in ["x", "y"] {
        assert_ne!(gpu_of(&h, job), r.gpus, "{job} was given big's reserved GPU");
    }
    let e = h.allocate("z", "affinity[core:gpus=1]", None, None, None, None).unwrap_err();
    assert!(e.to_string().contains("needs 1 GPU(s) but only 0 are free"), "{e}");
    assert!(
        e.to_string().contains(&format!(
            "; it would fit without job big's reservation (GPU(s) {}, for 600 s more)",
            r.gpus[0]
        )),
        "{e}"
    );
    assert!(h.snapshot().free_map().gpus.is_empty(), "the reserved GPU is not free to others");
    assert!(h.snapshot().fit(&one).is_err());
    // Killed and restarted: the reservation keeps its GPU; the named job gets it, in its block.
    std::mem::forget(h);
    let mut h = host_on(&topo, &kernel, Some(records.path()));
    h.set_clock(Arc::new(|| at(1_100)));
    h.recover(BTreeMap::new()).unwrap();
    assert_eq!(h.reservations(), std::slice::from_ref(&r));
    let big = h.allocate("big", "affinity[core(2):gpus=1]", None, None, None, None).unwrap();
    assert_eq!(gpu_of(&h, "big"), r.gpus);
    assert!(big.cpus.is_subset(&r.cpus), "{} in the block {}", big.cpus, r.cpus);
    assert!(h.reservations().is_empty());
    // Every GPU in use: a reservation takes one whose job it then waits for, beside it.
    let (r3, busy) = h.reserve("later", &two, 600).unwrap();
    assert_eq!(r3.gpus.len(), 1);
    assert!(r3.cpus.is_subset(&node_cpus(&r3.gpus[0])), "{r3:?}, busy {busy}");
    let holder = ["x", "y", "big"].into_iter().find(|j| gpu_of(&h, j) == r3.gpus).unwrap();
    let (r4, _) = h.reserve("later2", &two, 600).unwrap();
    assert_ne!(r4.gpus, r3.gpus, "two blocks never share a GPU");
    h.unreserve("later2").unwrap();
    h.release(holder).unwrap();
    assert!(
        h.allocate("w", "affinity[core:gpus=1]", None, None, None, None).is_err(),
        "kept for later"
    );
    h.allocate("later", "affinity[core(2):gpus=1]", None, None, None, None).unwrap();
    assert_eq!(gpu_of(&h, "later"), r3.gpus);
    h.ledger().check().unwrap();
}

/// A reservation whose GPU the host no longer has after a restart (found by an attack: it kept
/// the other GPUs held, which its job could not use with free ones): it holds its CPUs and no
/// GPU, and its job takes free GPUs.
#[test]
fn a_reservation_whose_gpu_is_gone_after_a_restart_holds_none_and_its_job_takes_free_ones() {
    let topo = two_nodes_with_gpus();
    let kernel = kernel_for(&topo);
    let records = tempfile::tempdir().unwrap();
    let mut h = host_on(&topo, &kernel, Some(records.path()));
    h.set_clock(Arc::new(|| at(1_000)));
    let two = prepare(&topo, "affinity[core(2)*2:gpus=1]", None, None).unwrap();
    let (r, _) = h.reserve("big", &two, 600).unwrap();
    assert_eq!(r.gpus.len(), 2, "{r:?}");
    std::mem::forget(h);
    // The host comes back without the first of them.
    let mut fewer = topo.clone();
    fewer.devices.retain(|d| d.pci_address != r.gpus[0]);
    let mut h = host_on(&fewer, &kernel, Some(records.path()));
    h.set_clock(Arc::new(|| at(1_100)));
    h.recover(BTreeMap::new()).unwrap();
    assert_eq!(h.reservations().len(), 1);
    assert!(h.reservations()[0].gpus.is_empty(), "{:?}", h.reservations());
    assert_eq!(h.reservations()[0].cpus, r.cpus);
    let big = h.allocate("big", "affinity[core(2)*2:gpus=1]", None, None, None, None).unwrap();
    let held = h.jobs().into_iter().find(|j| j.allocation.job == "big").unwrap().gpus;
    assert_eq!(held.len(), 2, "{big:?}");
    assert!(held.iter().all(|g| g.pci_address != r.gpus[0] && !g.gone), "{held:?}");
}

/// Issue 33, topod chooses the GPUs (`gpus=`, no batch system naming them): each job gets free
/// GPUs with its CPUs in their NUMA node; a GPU held is given to no other job (also after a
/// restart) until its job ends; too few free is "does not fit", more than the host has "never";
/// a job whose CPUs fit beside no free GPU waits rather than running away from them; `fit`
/// answers the same; the same job asked again keeps its GPUs.
#[test]
fn gpus_topod_chooses_are_free_ones_with_the_cpus_beside_them() {
    let topo = two_nodes_with_gpus();
    let kernel = kernel_for(&topo);
    let records = tempfile::tempdir().unwrap();
    let mut h = host_on(&topo, &kernel, Some(records.path()));
    let node_of =
        |cpus: &CpuSet| if cpus.is_subset(&CpuSet::parse_list("0-3").unwrap()) { 0 } else { 1 };
    let listed =
        |h: &Host, job: &str| h.jobs().into_iter().find(|j| j.allocation.job == job).unwrap().gpus;
    let a = h.allocate("a", "affinity[core(2):gpus=1]", None, None, None, None).unwrap();
    let b = h.allocate("b", "affinity[core(2):gpus=1]", None, None, None, None).unwrap();
    for (job, alloc) in [("a", &a), ("b", &b)] {
        let gpus = listed(&h, job);
        assert_eq!(gpus.len(), 1, "{job}: {gpus:?}");
        assert_eq!(gpus[0].numa_node, Some(node_of(&alloc.cpus)), "{job}: {gpus:?} {alloc:?}");
        assert_eq!(gpus[0].distance, Some(10));
    }
    assert_ne!(listed(&h, "a")[0].pci_address, listed(&h, "b")[0].pci_address);
    // Asked again: the same allocation and GPUs.
    let again = h.allocate("a", "affinity[core(2):gpus=1]", None, None, None, None).unwrap();
    assert_eq!(again.cpus, a.cpus);
    assert_eq!(listed(&h, "a").len(), 1);
    // Named another GPU on top of its gpus=1 (an attack finding: it was added, past its count).
    let other = if listed(&h, "a")[0].pci_address == "0000:18:00.0" { "card1" } else { "card0" };
    let more = with_gpus(&topo, "affinity[core(2):gpus=1]", None, &[other]);
    let e = h.allocate_prepared("a", &more, None, None).unwrap_err().to_string();
    assert!(e.contains("holds GPU(s)") && e.contains("for its request's gpus="), "{e}");
    assert_eq!(listed(&h, "a").len(), 1);
    // The third GPU's place is not known: it is given, and the job's CPUs go anywhere.
    h.allocate("c", "affinity[core:gpus=1]", None, None, None, None).unwrap();
    assert_eq!(listed(&h, "c")[0].pci_address, "0000:d8:00.0");
    let none_free = h.allocate("d", "affinity[core:gpus=1]", None, None, None, None).unwrap_err();
    assert!(matches!(none_free, HostError::DoesNotFit { .. }), "{none_free}");
    assert!(
        none_free
            .to_string()
            .contains("needs 1 GPU(s) but only 0 are free (gpus=1 for 1 task(s), of the host's 3)"),
        "{none_free}"
    );
    let fit = prepare(&topo, "affinity[core:gpus=1]", None, None).unwrap();
    assert!(h.snapshot().fit(&fit).is_err(), "fit says the same");
    let never = h.allocate("e", "affinity[core*2:gpus=2]", None, None, None, None);
    assert!(never.unwrap_err().to_string().contains("needs 4 GPU(s); this host has 3"));
    // Held across a restart; free again once its job ends.
    drop(h);
    let mut h = host_on(&topo, &kernel, Some(records.path()));
    h.recover(BTreeMap::new()).unwrap();
    assert_eq!(h.held_gpus().len(), 3);
    let a_gpu = listed(&h, "a")[0].pci_address.clone();
    h.release("a").unwrap();
    h.allocate("f", "affinity[core:gpus=1]", None, None, None, None).unwrap();
    assert_eq!(listed(&h, "f")[0].pci_address, a_gpu);
    // A job whose CPUs do not fit beside the free GPU waits: b holds one GPU, f the other; with
    // f's node full, a 4-core job does not run on the other node away from f's GPU once f ends.
    h.release("f").unwrap();
    let f_node = 1 - node_of(&b.cpus);
    let fill = if f_node == 0 { "0-3" } else { "4-7" };
    let c_cpus = h.jobs().into_iter().find(|j| j.allocation.job == "c").unwrap().allocation.cpus;
    let free_there = 4 - c_cpus.intersection(&CpuSet::parse_list(fill).unwrap()).len();
    let fill_request = format!("affinity[core*{free_there}]");
    h.allocate("fill", &fill_request, None, Some(fill), None, None).unwrap();
    let waits = prepare(&topo, "affinity[core(2):gpus=1]", None, None).unwrap();
    let e = h.allocate_prepared("g", &waits, None, None).unwrap_err();
    assert!(matches!(e, HostError::DoesNotFit { .. }), "{e}");
    assert!(e.to_string().contains("its CPUs do not fit beside any 1 of the free GPUs"), "{e}");
    h.release("fill").unwrap();
    let beside = h.allocate_prepared("g", &waits, None, None).unwrap();
    assert_eq!(listed(&h, "g")[0].pci_address, a_gpu);
    assert_eq!(node_of(&beside.cpus), f_node, "{beside:?}");
    // Refused outright: a task range (by the parser, so that `topoctl check` and every
    // plug-in refuse it at submission), and GPUs the batch system gave that gpus= does not count.
    let e = prepare(&topo, "affinity[core*1-2:gpus=1]", None, None).unwrap_err().to_string();
    assert!(e.contains("gpus=1 with a task range (*1-2)"), "{e}");
    let given = with_gpus(&topo, "affinity[core*2:gpus=1]", None, &["card0"]);
    let e = h.allocate_prepared("n", &given, None, None).unwrap_err().to_string();
    assert!(
        e.contains("gave the job 1 GPU(s)") && e.contains("gpus=1 per task for 2 task(s): 2"),
        "{e}"
    );
}

/// Two packages, each one NUMA node of two L3 groups of four two-thread cores, with two GPUs on
/// each node (node 1's behind one PCIe switch).
fn two_packages_with_four_gpus() -> Topology {
    let gpu = |address: &str, node: u32, upstream: &[&str]| topo_core::topology::IoDevice {
        pci_address: address.into(),
        class: topo_core::topology::DeviceClass::Gpu,
        class_code: 0x030200,
        vendor_id: Some(0x10de),
        device_id: None,
        names: Vec::new(),
        numa_node: Some(node),
        local_cpus: CpuSet::new(),
        upstream: upstream.iter().map(|u| u.to_string()).collect(),
        virtual_function: false,
        fabric: None,
    };
    let mut topo = two_packages();
    topo.devices = vec![
        gpu("0000:18:00.0", 0, &["0000:00:01.0"]),
        gpu("0000:19:00.0", 0, &["0000:00:02.0"]),
        gpu("0000:86:00.0", 1, &["0000:80:01.0", "0000:81:00.0", "0000:82:08.0"]),
        gpu("0000:87:00.0", 1, &["0000:80:01.0", "0000:81:00.0", "0000:82:10.0"]),
    ];
    topo
}

/// An `allocate` of `job` inside `cpus` with GPUs counted by NUMA node (node, count).
fn counted_args(
    job: &str,
    request: &str,
    cpus: &str,
    counts: &[(u32, u32)],
) -> proto::AllocateArgs {
    let mut args = proto::AllocateArgs::new(job, request);
    args.cpus = Some(cpus.to_string());
    args.gpus_by_numa =
        counts.iter().map(|&(numa, count)| proto::NumaGpus { numa, count }).collect();
    args
}

/// The NUMA nodes of the GPUs `job` holds, as its listing says.
fn gpu_nodes_of(h: &Host, job: &str) -> Vec<Option<u32>> {
    let listed = h.jobs().into_iter().find(|j| j.allocation.job == job).unwrap().gpus;
    listed.iter().map(|g| g.numa_node).collect()
}

/// The CPUs of NUMA node `n`, as a list.
fn node_cpus_of(topo: &Topology, n: u32) -> String {
    topo.numa_nodes.iter().find(|node| node.os_index == n).unwrap().cpus.to_string()
}

/// Issue 33, PBS with one vnode per NUMA node: a chunk PBS gave CPUs of node 0 and one GPU of
/// each node (its scheduler may split a chunk so) gets one GPU in each node, as PBS counted
/// them, not both beside its CPUs: else PBS would see a GPU free in node 0 that topod has
/// given, and one taken in node 1 that is free (the count drifts, and the next job PBS sends
/// to node 0 for a GPU finds none there). A node out of GPUs is named in the refusal, and
/// counts that do not match the request or the host are refused saying what.
#[test]
fn gpus_counted_per_numa_node_by_the_batch_system_are_taken_in_those_nodes() {
    let topo = two_packages_with_four_gpus();
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    let node_cpus = |n: u32| node_cpus_of(&topo, n);
    let ask = |job: &str, request: &str, cpus: &str, counts: &[(u32, u32)]| {
        Prepared::from_allocate(&topo, &counted_args(job, request, cpus, counts))
    };
    let gpus_of = gpu_nodes_of;
    let split = ask("a", "affinity[core(2):gpus=2]", &node_cpus(0), &[(0, 1), (1, 1)]).unwrap();
    let a = h.allocate_prepared("a", &split, None, None).unwrap();
    assert_eq!(gpus_of(&h, "a"), vec![Some(0), Some(1)]);
    assert!(a.cpus.is_subset(&CpuSet::parse_list(&node_cpus(0)).unwrap()), "{a:?}");
    // Each node has one GPU left, as PBS counts; a job PBS gives node 0's takes it, and so for
    // node 1.
    let b = ask("b", "affinity[core:gpus=1]", &node_cpus(0), &[(0, 1)]).unwrap();
    h.allocate_prepared("b", &b, None, None).unwrap();
    assert_eq!(gpus_of(&h, "b"), vec![Some(0)]);
    let c = ask("c", "affinity[core:gpus=1]", &node_cpus(1), &[(1, 1)]).unwrap();
    h.allocate_prepared("c", &c, None, None).unwrap();
    assert_eq!(gpus_of(&h, "c"), vec![Some(1)]);
    let d = ask("d", "affinity[core:gpus=1]", &node_cpus(0), &[(0, 1)]).unwrap();
    let e = h.allocate_prepared("d", &d, None, None).unwrap_err();
    assert!(matches!(e, HostError::DoesNotFit { .. }), "{e}");
    assert!(
        e.to_string().contains(
            "needs 1 GPU(s) but only 0 are free in NUMA node 0, where the batch system counted them (gpus_by_numa; the node has 2 GPU(s))"
        ),
        "{e}"
    );
    // Asked again, a job keeps what it has.
    let again = h.allocate_prepared("a", &split, None, None).unwrap();
    assert_eq!(again.cpus, a.cpus);
    assert_eq!(gpus_of(&h, "a"), vec![Some(0), Some(1)]);
    let refused = |request: &str, counts: &[(u32, u32)], gpus: &[&str]| {
        let mut args = proto::AllocateArgs::new("x", request);
        args.gpus = gpus.iter().map(|g| g.to_string()).collect();
        args.gpus_by_numa =
            counts.iter().map(|&(numa, count)| proto::NumaGpus { numa, count }).collect();
        match Prepared::from_allocate(&topo, &args) {
            Err(HostError::BadArgument(why)) => why,
            other => panic!("{request} {counts:?}: {other:?}"),
        }
    };
    let why = refused("affinity[core*2:gpus=1]", &[(0, 1)], &[]);
    assert!(
        why.contains("counts 1 GPU(s) (1 in node 0), but the request asks for gpus=1 per task for 2 task(s): 2"),
        "{why}"
    );
    let why = refused("affinity[core]", &[(0, 1)], &[]);
    assert!(why.contains("asks for none (gpus=)"), "{why}");
    let why = refused("affinity[core:gpus=1]", &[(7, 1)], &[]);
    assert!(why.contains("this host has no NUMA node 7 (its nodes: 0, 1)"), "{why}");
    let why = refused("affinity[core*2:gpus=1]", &[(0, 0), (1, 2)], &[]);
    assert!(why.contains("NUMA node 0 is given 0 GPUs"), "{why}");
    let why = refused("affinity[core*2:gpus=1]", &[(1, 1), (1, 1)], &[]);
    assert!(why.contains("NUMA node 1 is named twice"), "{why}");
    let why = refused("affinity[core:gpus=1]", &[(0, 1)], &["0000:18:00.0"]);
    assert!(why.contains("gpus names them already"), "{why}");
}

/// From the attacks on `gpus_by_numa`: counts that are not this host's GPUs by node (an
/// administrator's qmgr count over GPUs whose node the kernel does not know) do not refuse a
/// job that ran before them: topod chooses as without them. A split chunk whose `gpubind=numa`
/// keeps its CPUs away from the GPUs counted is refused saying why. Another job's reservation that
/// is all that keeps a node's GPUs out is named, and a job found without its record takes its
/// GPUs where they were counted.
#[test]
fn counts_topod_cannot_follow_are_chosen_as_without_them_and_reservations_are_named() {
    let topo = two_packages_with_four_gpus();
    let kernel = kernel_for(&topo);
    let records = tempfile::tempdir().unwrap();
    let mut h = host_on(&topo, &kernel, Some(records.path()));
    h.set_clock(Arc::new(|| at(1_000)));
    let node_cpus = |n: u32| node_cpus_of(&topo, n);
    let ask = |job: &str, request: &str, cpus: &str, counts: &[(u32, u32)]| {
        Prepared::from_allocate(&topo, &counted_args(job, request, cpus, counts)).unwrap()
    };
    let gpus_of = gpu_nodes_of;
    // Three counted in node 0, which has two: placed as without counts.
    let more = ask("more", "affinity[thread:gpus=3]", &node_cpus(0), &[(0, 3)]);
    h.allocate_prepared("more", &more, None, None).unwrap();
    assert_eq!(gpus_of(&h, "more").len(), 3);
    h.release("more").unwrap();
    // gpubind=numa with its CPU in node 0 and its GPU counted in node 1 (the batch system
    // split its chunk): refused, saying so, not given a GPU the batch system counts as free in
    // node 0 (the second attack: that made the counts drift).
    let bound = ask("bound", "affinity[thread:gpus=1:gpubind=numa]", &node_cpus(0), &[(1, 1)]);
    let e = h.allocate_prepared("bound", &bound, None, None).unwrap_err();
    assert!(matches!(e, HostError::BadRequest(_)), "{e}");
    assert!(
        e.to_string().contains("the batch system counted the job's GPUs as 1 in node 1 (gpus_by_numa) and gave it CPUs away from them (it split the job's chunk over NUMA nodes)"),
        "{e}"
    );
    assert!(h.jobs().is_empty());
    // Node 0's free GPU is another job's reservation: the refusal names it.
    h.allocate_prepared(
        "n0",
        &ask("n0", "affinity[thread:gpus=1]", &node_cpus(0), &[(0, 1)]),
        None,
        None,
    )
    .unwrap();
    let block = prepare(&topo, "affinity[thread:gpus=1]", None, Some(&node_cpus(0))).unwrap();
    let (r, _) = h.reserve("later", &block, 600).unwrap();
    assert_eq!(r.gpus.len(), 1);
    let e = h
        .allocate_prepared(
            "n0b",
            &ask("n0b", "affinity[thread:gpus=1]", &node_cpus(0), &[(0, 1)]),
            None,
            None,
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("only 0 are free in NUMA node 0")
            && e.contains("; it would fit without job later's reservation (GPU(s) "),
        "{e}"
    );
    h.unreserve("later").unwrap();
    // Found without its record: its GPU where the batch system counted it, not beside its CPU.
    let lost = ask("lost", "affinity[thread:gpus=1]", &node_cpus(0), &[(1, 1)]);
    h.allocate_prepared("lost", &lost, None, None).unwrap();
    assert_eq!(gpus_of(&h, "lost"), vec![Some(1)]);
    drop(h);
    std::fs::remove_file(records.path().join("jobs/lost.json")).unwrap();
    let mut h = host_on(&topo, &kernel, Some(records.path()));
    h.recover(BTreeMap::new()).unwrap();
    h.allocate_prepared("lost", &lost, None, None).unwrap();
    assert_eq!(gpus_of(&h, "lost"), vec![Some(1)]);
}

/// Issue 33 and issue 31's rule for `gpus=` requests: the plug-ins (from the free map's free
/// GPUs) keep a host exactly when topod's allocate there chooses GPUs and places the job, on
/// random mixes of GPU and CPU jobs, with reservations for `gpus=` jobs (which hold GPUs) made
/// and claimed among them.
#[test]
fn the_plugins_keep_a_host_for_a_gpus_request_exactly_when_topod_places_it() {
    let topo = two_packages_with_four_gpus();
    let shapes = [
        "affinity[core(2):gpus=1]",
        "affinity[core(6):gpus=1]",
        "affinity[core(4):gpus=2]",
        "affinity[core*2:gpus=1]",
        "affinity[core(8):gpus=1]",
        "affinity[core(3)]",
        "affinity[core(6)]",
        "affinity[core(10):gpus=2:gpubind=socket]",
        "affinity[core(12):gpus=3]",
        "affinity[core(2):gpus=1:gpubind=any]",
        "affinity[core(1):gpus=5]",
    ];
    let (mut kept_accepted, mut removed_refused, mut disagreements) = (0, 0, Vec::new());
    let (mut reserved, mut claimed) = (0, 0);
    for seed in 1..=6u64 {
        let kernel = kernel_for(&topo);
        let mut h = host_on(&topo, &kernel, None);
        let mut rng = topo_core::bench::SplitMix::new(seed);
        let mut running: Vec<String> = Vec::new();
        let mut waiting: Vec<(String, &str)> = Vec::new();
        for trial in 0..150 {
            for _ in 0..(rng.next_u64() % 3) {
                let job = format!("j{seed}-{trial}-{}", rng.next_u64() % 1000);
                let shape = shapes[(rng.next_u64() as usize) % 7];
                if h.allocate(&job, shape, None, None, None, None).is_ok() {
                    running.push(job);
                }
            }
            while running.len() > 2 && rng.next_u64() % 3 == 0 {
                let job = running.remove((rng.next_u64() as usize) % running.len());
                h.release(&job).unwrap();
            }
            // Now and then a block for a waiting gpus= job (at most two at once).
            if h.reservations().len() < 2 && rng.next_u64() % 4 == 0 {
                let job = format!("r{seed}-{trial}");
                let shape = shapes[(rng.next_u64() as usize) % 5];
                let prepared = prepare(&topo, shape, None, None).unwrap();
                if h.reserve(&job, &prepared, 3600).is_ok() {
                    reserved += 1;
                    waiting.push((job, shape));
                }
            }
            // The probe: a waiting job with a block, or a new one.
            let (job, probe) = if !waiting.is_empty() && rng.next_u64() % 3 == 0 {
                waiting.remove(0)
            } else {
                (format!("p{seed}-{trial}"), shapes[(rng.next_u64() as usize) % shapes.len()])
            };
            let (kept, verdict) = plugin_verdict_for(&h, &topo, probe, 0, Some(&job));
            let placed = h.allocate(&job, probe, None, None, None, None);
            if job.starts_with('r') {
                claimed += usize::from(placed.is_ok());
                let _ = h.unreserve(&job);
            }
            match (kept, &placed) {
                (true, Ok(_)) => kept_accepted += 1,
                (false, Err(_)) => removed_refused += 1,
                _ => disagreements.push(format!(
                    "seed {seed} trial {trial} {probe}: plug-in {verdict}; allocate {:?}",
                    placed.as_ref().map(|a| a.cpus.to_string()).map_err(|e| e.to_string())
                )),
            }
            if placed.is_ok() {
                running.push(job);
            }
            // No GPU held by two jobs (a set of 4 could not show it; the listing can).
            let listed: usize = h.jobs().iter().map(|j| j.gpus.len()).sum();
            assert_eq!(listed, h.held_gpus().len(), "a GPU held twice");
        }
    }
    assert!(
        disagreements.is_empty(),
        "{} disagreements:\n{}",
        disagreements.len(),
        disagreements.join("\n")
    );
    assert!(
        kept_accepted > 100 && removed_refused > 100 && reserved > 20 && claimed > 10,
        "{kept_accepted} kept, {removed_refused} removed, {reserved} blocks, {claimed} claimed"
    );
}

/// From the attack on GPU reservations: the LSF module's tentative reservation for a job it
/// dispatched (held until topod's free map reports the job) holds the GPUs the job takes, as it
/// holds its CPUs: a second `gpus=` job is not matched to the same GPU, which topod would refuse.
#[test]
fn the_plugins_dispatch_holds_the_gpus_its_job_takes_until_topod_reports_it() {
    use topo_plugin_core::eval::{self, NoFit, Verdict};
    use topo_plugin_core::reserve::Dispatched;
    use topo_plugin_core::{Claimant, Reservations, Unreachable};
    let topo = two_packages_with_four_gpus();
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    for job in ["a", "b", "c"] {
        h.allocate(job, "affinity[core(2):gpus=1]", None, None, None, None).unwrap();
    }
    assert_eq!(h.snapshot().free_map().gpus.len(), 1);
    let (cache, id, now) = module_cache_of(&h, &topo);
    let mut reservations = Reservations::new();
    let mut req = topo_core::request::parse("affinity[core(2):gpus=1]").unwrap();
    req.tasks = Some(1);
    let dispatched = reservations.dispatch(&cache, "lsf-x", "h", &req, now);
    assert!(matches!(dispatched, Dispatched::Reserved(_)), "{dispatched:?}");
    assert_eq!(reservations.of_job("lsf-x")[0].gpus.len(), 1);
    let verdict_for_y = |reservations: &Reservations| {
        let ctx = eval::Context {
            cache: &cache,
            reservations,
            now,
            epoch_s: 0,
            stale_after: Duration::from_secs(3600),
            unreachable: Unreachable::Closed,
        };
        eval::evaluate(&ctx, id, &req, Claimant::job("lsf-y"))
    };
    let y = verdict_for_y(&reservations);
    assert!(matches!(y, Verdict::NoFit(NoFit::Gpus(_))), "{y:?}");
    // topod agrees: x takes the last GPU, and y then does not fit.
    h.allocate("lsf-x", "affinity[core(2):gpus=1]", None, None, None, None).unwrap();
    assert!(h.allocate("lsf-y", "affinity[core(2):gpus=1]", None, None, None, None).is_err());
    // Without x's dispatch (released), the module would have sent y there too.
    reservations.release("lsf-x");
    let y = verdict_for_y(&reservations);
    assert!(matches!(y, Verdict::Fits { .. }), "{y:?}");
}

/// From the review of the dispatch's GPUs: a job dispatched into its own block, whose GPUs
/// topod's reservation holds (and its free map counts apart), holds no free GPU besides them:
/// the next `gpus=` job is matched to the free GPUs topod would give it.
#[test]
fn a_dispatch_into_its_own_gpu_block_holds_no_free_gpu() {
    use topo_plugin_core::eval::{self, Verdict};
    use topo_plugin_core::reserve::Dispatched;
    use topo_plugin_core::{Claimant, Reservations, Unreachable};
    let topo = two_packages_with_four_gpus();
    let kernel = kernel_for(&topo);
    let mut h = host_on(&topo, &kernel, None);
    let one = prepare(&topo, "affinity[core(2):gpus=1]", None, None).unwrap();
    let (block, _) = h.reserve("lsf-x", &one, 3600).unwrap();
    assert_eq!(block.gpus.len(), 1);
    let free = h.snapshot().free_map();
    assert_eq!((free.gpus.len(), free.reserved_gpus.len()), (3, 1));
    let (cache, id, now) = module_cache_of(&h, &topo);
    let mut reservations = Reservations::new();
    let mut x = topo_core::request::parse("affinity[core(2):gpus=1]").unwrap();
    x.tasks = Some(1);
    let dispatched = reservations.dispatch(&cache, "lsf-x", "h", &x, now);
    assert!(matches!(dispatched, Dispatched::Reserved(_)), "{dispatched:?}");
    assert_eq!(reservations.of_job("lsf-x")[0].gpus, [], "its own block's GPU is not a free one");
    // The three free GPUs are for the next job, as topod gives them.
    let mut y = topo_core::request::parse("affinity[core(2)*3:gpus=1]").unwrap();
    y.tasks = Some(3);
    let ctx = eval::Context {
        cache: &cache,
        reservations: &reservations,
        now,
        epoch_s: 0,
        stale_after: Duration::from_secs(3600),
        unreachable: Unreachable::Closed,
    };
    let verdict = eval::evaluate(&ctx, id, &y, Claimant::job("lsf-y"));
    assert!(matches!(verdict, Verdict::Fits { .. }), "{verdict:?}");
    let x_now = h.allocate("lsf-x", "affinity[core(2):gpus=1]", None, None, None, None).unwrap();
    assert!(x_now.cpus.is_subset(&block.cpus));
    h.allocate("lsf-y", "affinity[core(2)*3:gpus=1]", None, None, None, None).unwrap();
}

/// From the second attack on `gpus=`: `gpubind=any` runs anywhere once no free GPU has room
/// beside it (and `fit` says the same); a job found in its cgroup without a record (topod died
/// before writing it) gets its GPUs chosen when the batch system asks again, and its device
/// rules made for them.
#[test]
fn gpus_any_runs_anywhere_and_a_job_found_without_its_record_gets_its_gpus() {
    let topo = two_nodes_with_gpus();
    let kernel = std::sync::Arc::new(
        Fake::new(topo.allowed.clone(), topo.allowed_mems.clone()).confining_devices(),
    );
    let records = tempfile::tempdir().unwrap();
    let mut h = host_on(&topo, &kernel, Some(records.path()));
    let listed =
        |h: &Host, job: &str| h.jobs().into_iter().find(|j| j.allocation.job == job).unwrap().gpus;
    // card0 (node 0) held; node 1 (card1's) full; card2's place unknown, held too.
    h.allocate("g0", "affinity[core:gpus=1]", None, Some("0"), None, None).unwrap();
    assert_eq!(listed(&h, "g0")[0].pci_address, "0000:18:00.0");
    h.allocate("full", "affinity[core*4]", None, Some("4-7"), None, None).unwrap();
    h.allocate_prepared(
        "g2",
        &with_gpus(&topo, "affinity[core]", Some("1"), &["card2"]),
        None,
        None,
    )
    .unwrap();
    let strict = prepare(&topo, "affinity[core:gpus=1]", None, None).unwrap();
    assert!(h.snapshot().fit(&strict).is_err());
    assert!(h.allocate_prepared("s", &strict, None, None).is_err());
    let any = prepare(&topo, "affinity[core:gpus=1:gpubind=any]", None, None).unwrap();
    let fit = h.snapshot().fit(&any).unwrap();
    let placed = h.allocate_prepared("a", &any, None, None).unwrap();
    assert_eq!(fit.cpus, placed.cpus, "fit and allocate agree");
    assert_eq!(listed(&h, "a")[0].pci_address, "0000:86:00.0");
    assert!(placed.cpus.is_subset(&CpuSet::parse_list("2-3").unwrap()), "{placed:?}");
    drop(h);

    // A job whose cgroup exists without a record (a crash between the two).
    let k = JobId::parse("k").unwrap();
    let spec = CgroupSpec {
        cpus: CpuSet::parse_list("2").unwrap(),
        mems: CpuSet::parse_list("0").unwrap(),
        ..Default::default()
    };
    kernel.release(&JobId::parse("a").unwrap(), Duration::from_secs(1)).unwrap();
    std::fs::remove_file(records.path().join("jobs/a.json")).unwrap();
    kernel.create(&k, &spec).unwrap();
    let mut h = host_on(&topo, &kernel, Some(records.path()));
    h.recover(BTreeMap::new()).unwrap();
    h.allocate("k", "affinity[core:gpus=1]", None, None, None, None).unwrap();
    assert_eq!(listed(&h, "k")[0].pci_address, "0000:86:00.0", "the one free GPU");
    drop(h);
    let mut h = host_on(&topo, &kernel, Some(records.path()));
    h.recover(BTreeMap::new()).unwrap();
    assert_eq!(h.held_gpus().len(), 3, "recorded: held across a restart");
}

#[test]
fn an_allocate_is_read_once_into_what_the_job_asks_and_each_bad_field_is_named() {
    let topo = two_packages();
    let args = proto::AllocateArgs {
        owner_uid: Some(1000),
        queue: Some("batch".into()),
        pool: Some("day".into()),
        preempt: true,
        preemptible: true,
        submitted_at: Some(1_700_000_000),
        estimate_s: Some(3600),
        resize_signal: Some(10),
        gang: Some(true),
        gang_row: Some(1),
        starts_suspended: true,
        tasks: Some(2),
        cpus: Some("0-3".into()),
        ..proto::AllocateArgs::new("7", "affinity[core]")
    };
    let p = Prepared::from_allocate(&topo, &args).unwrap();
    let ask = &p.ask;
    assert_eq!(
        (ask.owner_uid, ask.queue.as_deref(), ask.pool.as_deref()),
        (Some(1000), Some("batch"), Some("day"))
    );
    assert_eq!(
        (ask.preemptible, ask.submitted_at, ask.estimate_s, ask.resize_signal),
        (true, Some(1_700_000_000), Some(3600), Some(10))
    );
    assert_eq!(ask.request, p.request.to_string());
    assert_eq!(p.request.tasks, Some(2));
    assert_eq!(p.request.cpu_list.as_ref().map(ToString::to_string).as_deref(), Some("0-3"));
    assert_eq!(p.gang, GangAsk { gang: Some(true), row: Some(1), prime: false });
    assert!(p.preempt && p.starts_suspended && p.follows_batch);
    let bad = |edit: &dyn Fn(&mut proto::AllocateArgs), says: &str| {
        let mut wrong = args.clone();
        edit(&mut wrong);
        match Prepared::from_allocate(&topo, &wrong) {
            Err(HostError::BadArgument(why)) => assert!(why.contains(says), "{why}"),
            other => panic!("{says}: {other:?}"),
        }
    };
    bad(&|a| a.resize_signal = Some(9), "resize_signal = 9");
    bad(&|a| a.queue = Some("a\nb".into()), "queue \"a\\nb\" has a control character");
    bad(&|a| a.pool = Some(String::new()), "pool");
    bad(&|a| a.estimate_s = None, "need submitted_at");
    bad(&|a| a.submitted_at = Some(0), "above 0");
    bad(&|a| a.gpus = vec!["0000:99:00.0".into()], "no PCI device");
    // The request's own errors keep their kind (and a parse error its position), also beside a
    // bad GPU: the request is read first (attack on this function: it looked at the GPUs
    // first, and the reply lost its position in the request).
    let mut unparsable = args.clone();
    unparsable.request = "affinity[core(".into();
    assert!(matches!(Prepared::from_allocate(&topo, &unparsable), Err(HostError::Unparsable(_))));
    unparsable.gpus = vec!["/etc/passwd".into()];
    assert!(matches!(Prepared::from_allocate(&topo, &unparsable), Err(HostError::Unparsable(_))));
    let no_tasks = proto::AllocateArgs { tasks: Some(0), gpus: vec!["char:abc".into()], ..args };
    match Prepared::from_allocate(&topo, &no_tasks) {
        Err(HostError::BadRequest(why)) => assert!(why.contains("tasks = 0"), "{why}"),
        other => panic!("{other:?}"),
    }
}

/// Attack on the shared job clock (issue 30): a record written before `protected_since`
/// existed, kept across an upgrade, must not let the owner's suspend and resume restart the
/// job's protection; and a preemption a crash cut short before its freeze leaves a running job
/// whose clock runs (it had stopped: its run time and estimated end no longer moved).
#[test]
fn the_job_clock_survives_an_old_record_and_a_crash_in_the_middle_of_a_preemption() {
    let dir = tempfile::tempdir().unwrap();
    let topo = small_topology(2);
    let kernel = kernel_for(&topo);
    let seconds = Arc::new(std::sync::atomic::AtomicU64::new(1_000_000));
    let start = |seconds: &Arc<std::sync::atomic::AtomicU64>| {
        let mut h = host_on(&topo, &kernel, Some(dir.path()));
        let s = seconds.clone();
        h.set_clock(Arc::new(move || at(s.load(std::sync::atomic::Ordering::SeqCst))));
        h.set_preempt(Some(topo_core::policy::Preempt {
            min_run: 600,
            max_suspensions: 3,
            min_xf: 2.0,
        }));
        h
    };
    let set = |t: u64| seconds.store(t, std::sync::atomic::Ordering::SeqCst);
    let victim = long_preemptible();
    let urgent = urgent_preemptor();
    let v = JobId::parse("v").unwrap();
    let mut h = start(&seconds);
    alloc_pair(&mut h, "v", victim).unwrap();
    // Its record as a topod from before `protected_since` wrote it.
    let mut old = h.hints["v"].clone();
    old.clock.protected_since = None;
    h.write_record(&v, &old).unwrap();
    std::mem::forget(h);
    let mut h = start(&seconds);
    h.recover(BTreeMap::new()).unwrap();
    set(1_003_600);
    owner_suspends_and_resumes(&mut h, "v", 2);
    assert_eq!(h.hints["v"].clock.protected_from(), Some(1_000_000), "its start, kept");
    alloc_pair(&mut h, "p", urgent.clone()).unwrap();
    assert_eq!(h.hints["v"].preempted_by.as_deref(), Some("p"), "preempted, not shielded");
    h.release("p").unwrap();
    assert!(h.hints["v"].clock.is_running());
    // A preemption for q cut short by a crash after its record, before its freeze.
    set(1_004_600);
    let mut cut = h.hints["v"].clone();
    cut.suspended = true;
    cut.preempted_by = Some("q".into());
    cut.clock.stop(1_004_600, topo_core::policy::Stopper::Preemption);
    h.write_record(&v, &cut).unwrap();
    std::mem::forget(h);
    set(1_004_700);
    let mut h = start(&seconds);
    h.recover(BTreeMap::new()).unwrap();
    assert!(!h.ledger().is_suspended("v") && !kernel.is_frozen(&v).unwrap());
    let found = &h.hints["v"];
    assert!(!found.suspended && found.preempted_by.is_none());
    assert!(found.clock.is_running(), "its clock runs again: {:?}", found.clock);
    assert_eq!(found.clock.protected_from(), Some(1_004_700), "as resumed after preemption");
    assert_eq!(found.clock.suspensions, 2, "the suspension recorded stays counted");
}
