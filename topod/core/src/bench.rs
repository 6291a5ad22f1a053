//! The placement-quality benchmark: one seeded job stream replayed per strategy on a host.
//!
//! The stream: job sizes mostly powers of two from one PU up to a whole package (one in five
//! any size in that range), in four shapes, a quarter each:
//! - a plain count of threads (`thread*N`, what a slot-counting scheduler sees);
//! - threads grouped by NUMA node (`thread(k,same=numa)*t`, k up to 16 and half the node);
//! - exclusive whole cores kept in one L3 group or one socket per task
//!   (`core(c,same=l3|socket)*t`, tasks of up to 16 PUs and half the domain; whole cores are
//!   exclusive by
//!   construction);
//! - a plain count with `membind=localonly`.
//!
//! The replay keeps the host about 85% busy: before each arrival, running jobs leave in order of
//! their end time until at most 85% of the allocatable PUs are held; then the job is placed or
//! rejected (a rejected job is dropped). Every strategy sees the same jobs in the same order.
//!
//! Per strategy it reports the share of placed jobs within the minimum possible number of NUMA
//! nodes and of L3 groups for their size, the mean radius (largest SLIT distance inside the job),
//! SMT siblings shared with another job, rejections while enough PUs were free, and the time of
//! each placement decision (p50/p99 over the decisions, measured around the `place` call only;
//! the stream is replayed [`TIMING_RUNS`] times and each decision's median time kept).
//!
//! With migration ([`replay_migrating`]), the same stream is replayed once more, and each arrival
//! refused while enough PUs are free asks [`defrag::plan_moves`] for moves of running jobs (every
//! running job movable); a plan found is carried out on the ledger (the moved jobs released, the
//! new job allocated, the moved jobs allocated again at their new places) before the next
//! arrival. It reports the rejections while free without and with migration, the moves, the PUs
//! moved, the locality of the jobs where they end up, and the planner's time per call.

use crate::defrag::{self, DefragLimits, Movable};
use crate::ledger::Ledger;
use crate::place::{self, HostModel, Occupancy, PlacementMetrics, Strategy};
use crate::request::{Level, MemBind, Request};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Instant;

/// The stream is replayed this many times; each decision's median time over the runs counts.
pub const TIMING_RUNS: usize = 3;

/// Target share of allocatable PUs held just before each arrival.
pub const TARGET_LOAD: f64 = 0.85;

/// The largest task of a shaped job, in PUs: hybrid MPI+threads jobs run tasks of a few cores
/// each; a single task the size of a package would only test whether a package is free.
pub const MAX_TASK_PUS: usize = 16;

/// A job of the stream.
#[derive(Debug, Clone)]
pub struct StreamJob {
    /// What it asks for.
    pub request: Request,
    /// How many arrivals it stays for.
    pub lifetime: u32,
    /// PUs it needs on this host.
    pub pus: usize,
}

/// A small, fast, seeded generator (SplitMix64), so streams are the same on every machine and
/// with every version of every crate.
#[derive(Debug, Clone)]
pub struct SplitMix(u64);

impl SplitMix {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// Makes the seeded job stream for `model`.
pub fn job_stream(model: &HostModel, seed: u64, count: usize) -> Vec<StreamJob> {
    let mut rng = SplitMix::new(seed);
    let package = model.sockets.iter().map(|s| s.len()).max().unwrap_or(1).max(1);
    let numa = model.numa.iter().map(|s| s.len()).max().unwrap_or(1).max(1);
    let tpc = model.threads_per_core.max(1);
    let l3_cores = model.l3.iter().map(|s| s.len() / tpc).max().unwrap_or(1).max(1);
    let socket_cores = package / tpc;
    let mut out = Vec::with_capacity(count);
    while out.len() < count {
        let size = pick_size(&mut rng, package);
        let lifetime = 1 + rng.below(40) as u32;
        let request = match rng.below(4) {
            0 => Request::threads(size as u32),
            1 => {
                let k = largest_divisor_at_most(size, (numa / 2).clamp(1, MAX_TASK_PUS));
                Request {
                    unit: Level::Thread,
                    units_per_task: k as u32,
                    tasks: Some((size / k) as u32),
                    same: Some(Level::Numa),
                    ..Request::default()
                }
            }
            2 => {
                let cores = (size / tpc).max(1);
                let (same, room) = if rng.below(2) == 0 {
                    (Level::L3, l3_cores)
                } else {
                    (Level::Socket, socket_cores)
                };
                let room = (room / 2).min(MAX_TASK_PUS / tpc).max(1);
                let c = largest_divisor_at_most(cores, room);
                Request {
                    unit: Level::Core,
                    units_per_task: c as u32,
                    tasks: Some((cores / c) as u32),
                    same: Some(same),
                    ..Request::default()
                }
            }
            _ => Request { membind: MemBind::LocalOnly, ..Request::threads(size as u32) },
        };
        let pus = request.tasks.unwrap_or(1) as usize
            * request.units_per_task as usize
            * model.pus_per_unit(request.unit);
        out.push(StreamJob { request, lifetime, pus });
    }
    out
}

fn pick_size(rng: &mut SplitMix, package: usize) -> usize {
    if rng.below(5) == 0 {
        return 1 + rng.below(package as u64) as usize;
    }
    let max_exp = usize::BITS - 1 - package.leading_zeros();
    // Smaller sizes are more common: exponent e with weight (max_exp + 1 - e).
    let total: u64 = (1..=u64::from(max_exp) + 1).sum();
    let mut r = rng.below(total);
    for e in 0..=max_exp {
        let w = u64::from(max_exp + 1 - e);
        if r < w {
            return 1usize << e;
        }
        r -= w;
    }
    1
}

fn largest_divisor_at_most(n: usize, limit: usize) -> usize {
    (1..=limit.min(n).max(1)).rev().find(|d| n % d == 0).unwrap_or(1)
}

/// What one strategy did with the stream on one host.
#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    /// The topology's name.
    pub topology: String,
    /// The strategy.
    pub strategy: String,
    /// Jobs offered.
    pub jobs: usize,
    /// Jobs placed.
    pub placed: usize,
    /// Share of placed jobs spanning no more NUMA nodes than their size requires.
    pub numa_optimal_share: f64,
    /// Share of placed jobs spanning no more L3 groups than their size requires.
    pub l3_optimal_share: f64,
    /// Mean over placed jobs of the largest SLIT distance inside the job (10 = one node).
    pub mean_radius: f64,
    /// Cores shared between two jobs, counted when the second job is placed.
    pub smt_shared: usize,
    /// Jobs rejected although at least as many PUs as they needed were free.
    pub rejected_while_free: usize,
    /// Placed jobs whose placement breaks their `same=` request (strategies that cannot express it).
    pub shape_violations: usize,
    /// Mean share of allocatable PUs held at each arrival.
    pub mean_load: f64,
    /// Median placement decision time, microseconds.
    pub decision_p50_us: f64,
    /// 99th percentile placement decision time, microseconds.
    pub decision_p99_us: f64,
}

/// Replays `stream` on `model` with `strategy`, [`TIMING_RUNS`] times: the replay is
/// deterministic, so every run makes the same decisions on the same states; each decision's time
/// is its median over the runs, so that a burst of noise on a shared machine (a timer interrupt,
/// a neighbour's work) does not pass for placement cost.
pub fn replay(model: &HostModel, stream: &[StreamJob], strategy: Strategy) -> BenchResult {
    let (mut result, mut runs) = replay_once(model, stream, strategy);
    let mut all = vec![std::mem::take(&mut runs)];
    for _ in 1..TIMING_RUNS {
        let (again, times) = replay_once(model, stream, strategy);
        debug_assert_eq!(again.placed, result.placed, "the replay is deterministic");
        all.push(times);
    }
    let mut times_ns: Vec<u64> = (0..stream.len())
        .map(|i| {
            let mut v: Vec<u64> = all.iter().map(|t| t[i]).collect();
            v.sort_unstable();
            v[v.len() / 2]
        })
        .collect();
    times_ns.sort_unstable();
    let pct = |q: f64| -> f64 {
        if times_ns.is_empty() {
            return 0.0;
        }
        let idx = ((times_ns.len() as f64 - 1.0) * q).round() as usize;
        times_ns[idx] as f64 / 1000.0
    };
    result.decision_p50_us = pct(0.50);
    result.decision_p99_us = pct(0.99);
    result
}

/// One replay, for the quality figures only (the timing fields stay 0): what tests need.
pub fn replay_quality(model: &HostModel, stream: &[StreamJob], strategy: Strategy) -> BenchResult {
    replay_once(model, stream, strategy).0
}

/// One replay: the quality figures, and each decision's time in nanoseconds, in stream order.
fn replay_once(
    model: &HostModel,
    stream: &[StreamJob],
    strategy: Strategy,
) -> (BenchResult, Vec<u64>) {
    let capacity = model.allocatable.len().max(1);
    let mut ledger = Ledger::new();
    let mut running: Vec<(u64, String)> = Vec::new();
    let mut times_ns: Vec<u64> = Vec::with_capacity(stream.len());
    let (mut placed, mut numa_ok, mut l3_ok, mut radius_sum, mut smt, mut rwf, mut violations) =
        (0, 0, 0, 0u64, 0, 0, 0);
    let mut load_sum = 0.0;
    for (i, job) in stream.iter().enumerate() {
        let now = i as u64;
        running.sort_by_key(|(end, _)| std::cmp::Reverse(*end));
        while ledger.occupancy().held.len() as f64 > TARGET_LOAD * capacity as f64 {
            let Some((_, id)) = running.pop() else { break };
            let _ = ledger.release(&id);
        }
        load_sum += ledger.occupancy().held.len() as f64 / capacity as f64;
        let free = ledger.occupancy().free(model).len();
        let occupancy: &Occupancy = ledger.occupancy();
        let start = Instant::now();
        let result = place::place(model, occupancy, &job.request, strategy);
        times_ns.push(start.elapsed().as_nanos() as u64);
        match result {
            Ok(p) => {
                placed += 1;
                numa_ok += usize::from(p.metrics.numa_optimal());
                l3_ok += usize::from(p.metrics.l3_optimal());
                radius_sum += u64::from(p.metrics.radius);
                smt += p.metrics.smt_shared;
                if let Some(same) = job.request.same {
                    violations +=
                        usize::from(p.tasks.iter().any(|t| model.touched(same, t).len() > 1));
                }
                let id = format!("job{i}");
                if ledger.allocate(&id, &p, "").is_ok() {
                    running.push((now + u64::from(job.lifetime), id));
                }
            }
            Err(_) => rwf += usize::from(free >= job.pus),
        }
    }
    let share = |n: usize| if placed == 0 { 0.0 } else { n as f64 / placed as f64 };
    let result = BenchResult {
        topology: model.name.clone(),
        strategy: strategy.name().to_string(),
        jobs: stream.len(),
        placed,
        numa_optimal_share: share(numa_ok),
        l3_optimal_share: share(l3_ok),
        mean_radius: if placed == 0 { 0.0 } else { radius_sum as f64 / placed as f64 },
        smt_shared: smt,
        rejected_while_free: rwf,
        shape_violations: violations,
        mean_load: load_sum / stream.len().max(1) as f64,
        decision_p50_us: 0.0,
        decision_p99_us: 0.0,
    };
    (result, times_ns)
}

/// What one strategy did with the stream on one host when refused jobs may move running ones
/// (see [`replay_migrating`]).
#[derive(Debug, Clone, Serialize)]
pub struct MigrationResult {
    /// The topology's name.
    pub topology: String,
    /// The strategy.
    pub strategy: String,
    /// Jobs offered.
    pub jobs: usize,
    /// Rejections while enough PUs were free on the same stream without migration.
    pub rejected_while_free_without: usize,
    /// Jobs placed.
    pub placed: usize,
    /// Jobs rejected although at least as many PUs as they needed were free, and for which no
    /// plan was found.
    pub rejected_while_free: usize,
    /// Share of placed jobs within the fewest NUMA nodes their size allows, each job counted
    /// where it ends up (after its last move).
    pub numa_optimal_share: f64,
    /// The same for L3 groups.
    pub l3_optimal_share: f64,
    /// Mean over placed jobs of the largest SLIT distance inside the job, where it ends up.
    pub mean_radius: f64,
    /// Mean share of allocatable PUs held at each arrival.
    pub mean_load: f64,
    /// Plans carried out (each placed one refused job).
    pub plans: usize,
    /// Jobs moved, over all plans.
    pub moves: usize,
    /// PUs moved, over all plans.
    pub moved_pus: usize,
    /// Moves after which the moved job spans more NUMA nodes or L3 groups than before.
    pub moves_less_local: usize,
    /// Median time of one planner call (found a plan or not; each call's median over
    /// [`TIMING_RUNS`] runs), microseconds.
    pub planner_p50_us: f64,
    /// 99th percentile of the same.
    pub planner_p99_us: f64,
    /// The longest planner call, microseconds.
    pub planner_max_us: f64,
}

/// Replays `stream` on `model` with `strategy` without migration (for its rejections), then
/// with migration: an arrival refused while enough PUs are free (the bench's definition: free
/// PUs at least the job's) gets a plan from [`defrag::plan_moves`] with `limits`, every running
/// job movable, and the plan is carried out on the ledger. The replay with migration is
/// deterministic and runs [`TIMING_RUNS`] times; each planner call's time is its median over the
/// runs, as for placement decisions.
pub fn replay_migrating(
    model: &HostModel,
    stream: &[StreamJob],
    strategy: Strategy,
    limits: DefragLimits,
) -> MigrationResult {
    let without = replay_quality(model, stream, strategy);
    let mut runs = Vec::with_capacity(TIMING_RUNS);
    let (mut result, first) = replay_migrating_once(model, stream, strategy, limits);
    runs.push(first);
    for _ in 1..TIMING_RUNS {
        let (again, times) = replay_migrating_once(model, stream, strategy, limits);
        debug_assert_eq!((again.placed, again.moves), (result.placed, result.moves));
        runs.push(times);
    }
    let mut planner_ns: Vec<u64> = (0..runs[0].len())
        .map(|i| {
            let mut v: Vec<u64> = runs.iter().filter_map(|t| t.get(i).copied()).collect();
            v.sort_unstable();
            v[v.len() / 2]
        })
        .collect();
    planner_ns.sort_unstable();
    let pct = |q: f64| -> f64 {
        if planner_ns.is_empty() {
            return 0.0;
        }
        let idx = ((planner_ns.len() as f64 - 1.0) * q).round() as usize;
        planner_ns[idx] as f64 / 1000.0
    };
    result.rejected_while_free_without = without.rejected_while_free;
    result.planner_p50_us = pct(0.50);
    result.planner_p99_us = pct(0.99);
    result.planner_max_us = pct(1.0);
    result
}

/// One replay with migration: the figures (timing fields 0), and each planner call's time in
/// nanoseconds, in stream order.
fn replay_migrating_once(
    model: &HostModel,
    stream: &[StreamJob],
    strategy: Strategy,
    limits: DefragLimits,
) -> (MigrationResult, Vec<u64>) {
    let capacity = model.allocatable.len().max(1);
    let mut ledger = Ledger::new();
    // Running jobs: their end and, by id, the stream index and locality where they are now.
    let mut running: Vec<(u64, String)> = Vec::new();
    let mut where_now: BTreeMap<String, (usize, Locality)> = BTreeMap::new();
    let mut planner_ns: Vec<u64> = Vec::new();
    let (mut placed, mut rwf, mut plans, mut moves, mut moved_pus, mut less_local) =
        (0, 0, 0, 0, 0, 0);
    let mut totals = Locality::default();
    let mut load_sum = 0.0;
    for (i, job) in stream.iter().enumerate() {
        let now = i as u64;
        running.sort_by_key(|(end, _)| std::cmp::Reverse(*end));
        while ledger.occupancy().held.len() as f64 > TARGET_LOAD * capacity as f64 {
            let Some((_, id)) = running.pop() else { break };
            let _ = ledger.release(&id);
            where_now.remove(&id);
        }
        load_sum += ledger.occupancy().held.len() as f64 / capacity as f64;
        let id = format!("job{i}");
        let placement = match place::place(model, ledger.occupancy(), &job.request, strategy) {
            Ok(p) => p,
            Err(_) if ledger.occupancy().free(model).len() < job.pus => continue,
            Err(_) => {
                let movables: Vec<Movable<'_, String>> = ledger
                    .jobs()
                    .map(|a| {
                        let request = &stream[where_now[&a.job].0].request;
                        Movable::from_allocation(a.job.clone(), request, a, true)
                    })
                    .collect();
                let start = Instant::now();
                let plan = defrag::plan_moves(
                    model,
                    ledger.occupancy(),
                    &movables,
                    &job.request,
                    strategy,
                    limits,
                );
                planner_ns.push(start.elapsed().as_nanos() as u64);
                let Some(plan) = plan else {
                    rwf += 1;
                    continue;
                };
                plans += 1;
                moves += plan.moves.len();
                moved_pus += plan.moved_pus();
                let mut old = Vec::with_capacity(plan.moves.len());
                for m in &plan.moves {
                    old.push(ledger.release(&m.key).expect("a moved job is running"));
                }
                for (m, before) in plan.moves.iter().zip(&old) {
                    let entry = where_now.get_mut(&m.key).expect("a moved job is running");
                    let after = Locality::of(&m.placement.metrics);
                    let was = PlacementMetrics::measure(model, &Occupancy::default(), &before.cpus);
                    if m.placement.metrics.numa_nodes > was.numa_nodes
                        || m.placement.metrics.l3_groups > was.l3_groups
                    {
                        less_local += 1;
                    }
                    totals.sub(&entry.1);
                    totals.add(&after);
                    entry.1 = after;
                    ledger
                        .allocate(&m.key, &m.placement, &before.request)
                        .expect("a plan's moves never overlap");
                }
                plan.placement
            }
        };
        placed += 1;
        let locality = Locality::of(&placement.metrics);
        totals.add(&locality);
        ledger.allocate(&id, &placement, "").expect("placement avoids the occupancy");
        where_now.insert(id.clone(), (i, locality));
        running.push((now + u64::from(job.lifetime), id));
    }
    let share = |n: usize| if placed == 0 { 0.0 } else { n as f64 / placed as f64 };
    let result = MigrationResult {
        topology: model.name.clone(),
        strategy: strategy.name().to_string(),
        jobs: stream.len(),
        rejected_while_free_without: 0,
        placed,
        rejected_while_free: rwf,
        numa_optimal_share: share(totals.numa_ok),
        l3_optimal_share: share(totals.l3_ok),
        mean_radius: if placed == 0 { 0.0 } else { totals.radius as f64 / placed as f64 },
        mean_load: load_sum / stream.len().max(1) as f64,
        plans,
        moves,
        moved_pus,
        moves_less_local: less_local,
        planner_p50_us: 0.0,
        planner_p99_us: 0.0,
        planner_max_us: 0.0,
    };
    (result, planner_ns)
}

/// A placed job's contribution to the locality figures. Totals over jobs that have ended keep
/// their last contribution; a move replaces a running job's.
#[derive(Debug, Clone, Copy, Default)]
struct Locality {
    numa_ok: usize,
    l3_ok: usize,
    radius: u64,
}

impl Locality {
    fn of(m: &PlacementMetrics) -> Self {
        Locality {
            numa_ok: usize::from(m.numa_optimal()),
            l3_ok: usize::from(m.l3_optimal()),
            radius: u64::from(m.radius),
        }
    }

    fn add(&mut self, o: &Locality) {
        self.numa_ok += o.numa_ok;
        self.l3_ok += o.l3_ok;
        self.radius += o.radius;
    }

    fn sub(&mut self, o: &Locality) {
        self.numa_ok -= o.numa_ok;
        self.l3_ok -= o.l3_ok;
        self.radius -= o.radius;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpuset::CpuSet;
    use crate::defrag::DefragLimits;
    use crate::topology::{SyntheticShape, Topology};

    fn model() -> HostModel {
        let t = Topology::synthetic(SyntheticShape {
            packages: 2,
            numa_per_package: 2,
            l3_per_numa: 2,
            cores_per_l3: 4,
            threads_per_core: 2,
        });
        HostModel::new(&t, &CpuSet::new()).unwrap()
    }

    #[test]
    fn the_stream_is_seeded_and_fits_the_host() {
        let m = model();
        let a = job_stream(&m, 7, 300);
        let b = job_stream(&m, 7, 300);
        assert_eq!(
            a.iter().map(|j| j.request.clone()).collect::<Vec<_>>(),
            b.iter().map(|j| j.request.clone()).collect::<Vec<_>>()
        );
        assert!(a.iter().all(|j| j.pus >= 1 && j.pus <= 32), "sizes from 1 PU to a package");
        assert_ne!(
            job_stream(&m, 8, 300).iter().map(|j| j.pus).collect::<Vec<_>>(),
            a.iter().map(|j| j.pus).collect::<Vec<_>>()
        );
    }

    #[test]
    fn replay_keeps_the_host_busy_and_best_fit_beats_first_fit() {
        let m = model();
        let stream = job_stream(&m, 1, 2000);
        let best = replay(&m, &stream, Strategy::BestFit);
        let first = replay(&m, &stream, Strategy::FirstFit);
        assert!(best.mean_load > 0.6 && best.mean_load < 0.9, "load {}", best.mean_load);
        assert!(best.placed > 1000);
        assert!(best.numa_optimal_share > first.numa_optimal_share, "{best:?} vs {first:?}");
        assert!(best.l3_optimal_share > first.l3_optimal_share);
        assert_eq!(best.shape_violations, 0);
    }

    #[test]
    fn migration_places_jobs_refused_while_free_and_never_adds_rejections() {
        let m = model();
        let stream = job_stream(&m, 1, 3000);
        let r = replay_migrating(&m, &stream, Strategy::BestFit, DefragLimits::default());
        assert!(r.rejected_while_free_without > 20, "the stream fragments this host: {r:?}");
        assert!(r.rejected_while_free <= r.rejected_while_free_without, "{r:?}");
        assert!(r.plans > 0 && r.moves >= r.plans && r.moved_pus >= r.moves, "{r:?}");
        // Every rejection while free either got a plan or stays one.
        let plain = replay_quality(&m, &stream, Strategy::BestFit);
        assert!(r.placed > plain.placed, "{} placed against {}", r.placed, plain.placed);
        // No move at all: the replay is the plain one.
        let frozen = DefragLimits { max_moves: 0, ..DefragLimits::default() };
        let none = replay_migrating(&m, &stream, Strategy::BestFit, frozen);
        assert_eq!((none.plans, none.moves), (0, 0));
        assert_eq!(none.rejected_while_free, plain.rejected_while_free);
        assert_eq!(none.placed, plain.placed);
        assert!((none.numa_optimal_share - plain.numa_optimal_share).abs() < 1e-12);
    }
}
