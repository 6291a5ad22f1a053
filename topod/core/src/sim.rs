//! The what-if simulator: a workload replayed on a model cluster through the policy core.
//!
//! The simulator is the second driver of [`crate::policy`]: it feeds the core each instant's
//! submits and ends, applies the starts the core decides to its model (a start becomes an end
//! event one run time later), and measures what happened. The core places every part of every
//! job with the same `place` code topod runs, so `numa_optimal_share` here means what it means
//! in `topoctl bench placement`: the share of jobs within the fewest NUMA nodes (L3 groups) that
//! could hold their size, on every host they span.
//!
//! Figures (as the scheduling literature uses them):
//! - **utilization**: processor-seconds used ÷ (processors × makespan), where the makespan runs
//!   from the first submit to the last end;
//! - **wait**: start − submit, plus any time the job spent suspended by preemption (a suspended
//!   job waits as a queued one does); **p95 wait**: the nearest-rank 95th percentile;
//! - **bounded slowdown** (τ = 10 s): max(1, (wait + run) ÷ max(run, τ)), averaged over jobs.
//!
//! ## Malleable jobs
//!
//! A trace says nothing of which jobs could be resized; [`mark_malleable`] marks a share of them,
//! chosen by a hash of the trace's job number (the same jobs at every run and for every share
//! below or above: a job marked at 0.3 is marked at 0.5). With [`PolicyConfig::malleable`] the
//! core runs the marked jobs that fit one host malleable (multi-host jobs stay rigid), shrinks
//! and grows them by equipartition (see [`crate::policy`]), and the simulator keeps their work:
//! a job logged with `run` seconds on `p` processors has `run × p` processor-seconds to do,
//! which drain at the rate of the processors it holds (linear speedup, optimistic: no loss of
//! efficiency with more processors, no cost per resize). At every resize its end moves to
//! the instant its work is done, the last second rounded up (the clock counts whole seconds),
//! so it may hold its processors up to a second longer than its work needs. Utilization counts
//! the work, `run × p`, whatever the sizes the job ran at; the bounded slowdown divides its
//! time in the system by its logged run time, so a job run shrunk shows it.
//!
//! ## Moves, blocks and pools
//!
//! With [`PolicyConfig::defrag`] or prime-time pools that migrate, the core moves running jobs
//! ([`Action::Move`]): a job's CPUs change and its end does not, unless the move has a pause
//! ([`PolicyConfig::move_cost`]), during which its work stands still, so its end comes that much
//! later (and it holds its processors that much longer: utilization, which counts the work,
//! falls). Blocks ([`Action::Reserve`]) and pools are the core's own state; the report counts
//! what the core did with them ([`crate::policy::Counters`]).
//!
//! ## Suspensions
//!
//! With preemption a suspended job stops running and its end moves later by as long as it stays
//! suspended, plus [`PolicyConfig::suspend_cost`] per suspension: its memory written out and
//! read back, its caches lost (0: free). Utilization counts the trace's work, so a cost that
//! keeps processors busy longer shows as lower utilization. With gang slicing each freeze of a
//! job that has run costs it [`PolicyConfig::switch_cost`] the same way (its caches refilled
//! when its row runs again).

use crate::bench::SplitMix;
use crate::place::HostModel;
use crate::policy::{
    Action, Event, JobKey, JobSpec, PolicyConfig, PolicyCore, PolicyError, Reserve, Time,
};
use crate::swf::{Skip, Trace};
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::sync::Arc;

/// τ of the bounded slowdown, seconds.
pub const SLOWDOWN_BOUND_S: f64 = 10.0;

/// A job as the simulator replays it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimJob {
    /// The trace's job number.
    pub id: i64,
    /// Submit time, seconds.
    pub submit: Time,
    /// How long it runs once started, seconds.
    pub run: Time,
    /// What the scheduler believes it will run ([`crate::swf::SwfJob::estimate`]).
    pub estimate: Time,
    /// Processors (whole cores).
    pub procs: u32,
    /// Whether the core may run it malleable (see [`mark_malleable`]).
    pub malleable: bool,
}

/// Marks the share `fraction` (0 to 1) of `jobs` malleable, by a hash of each trace job
/// number: a job is marked when its hash, as a number in [0, 1), is below `fraction`, so runs
/// are reproducible, 1 marks every job, and a larger share marks a superset. Returns how many
/// are marked. Whether a marked job runs malleable is the core's decision (it must fit one host
/// and have a range of more than one size).
pub fn mark_malleable(jobs: &mut [SimJob], fraction: f64) -> usize {
    let mut marked = 0;
    for job in jobs {
        let hash = SplitMix::new(job.id as u64).next_u64();
        job.malleable = ((hash >> 11) as f64) / ((1u64 << 53) as f64) < fraction;
        marked += usize::from(job.malleable);
    }
    marked
}

/// Cuts every job of `jobs` that ran longer than it requested (its line in `trace`, by
/// `lines`, [`crate::swf::SwfJob::outlived_request`]) to its requested time, as a batch system
/// that kills jobs at their limit would have: it runs, and is estimated at, the time it asked
/// for. Returns how many were cut.
pub fn kill_at_limit(jobs: &mut [SimJob], lines: &[usize], trace: &Trace) -> usize {
    let mut killed = 0;
    for (job, &line) in jobs.iter_mut().zip(lines) {
        if let Some(logged) = trace.jobs.get(line).filter(|l| l.outlived_request()) {
            job.run = logged.requested_time;
            job.estimate = logged.requested_time;
            killed += 1;
        }
    }
    killed
}

/// Which trace lines to replay.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceFilter {
    /// Only these queues (field 15), when given.
    pub queues: Option<Vec<i64>>,
    /// Not these queues.
    pub skip_queues: Vec<i64>,
}

impl TraceFilter {
    fn keeps(&self, queue: i64) -> bool {
        self.queues.as_ref().is_none_or(|q| q.contains(&queue))
            && !self.skip_queues.contains(&queue)
    }
}

/// The jobs of a trace a replay takes, and what it leaves out.
#[derive(Debug, Clone, Default)]
pub struct Selected {
    /// The jobs, in submit order.
    pub jobs: Vec<SimJob>,
    /// How many lines were left out, for each reason.
    pub skipped: BTreeMap<Skip, usize>,
    /// The job numbers that came again ([`Skip::Duplicate`]), in file order, each once.
    pub duplicates: Vec<i64>,
    /// Each job's line: its index in the trace's `jobs` (for per-job output, which carries
    /// the line's other fields over).
    pub lines: Vec<usize>,
}

/// The jobs of `trace` a cluster of `total_procs` processors can replay, in submit order, and
/// how many lines were left out for each reason (the filter's queues too). A job number seen
/// on an earlier replayed line is a broken log: the later line is left out and counted.
pub fn jobs_from_trace(trace: &Trace, filter: &TraceFilter, total_procs: u64) -> Selected {
    let mut jobs = Vec::with_capacity(trace.jobs.len());
    let mut lines = Vec::with_capacity(trace.jobs.len());
    let mut skipped = BTreeMap::new();
    let mut seen = std::collections::HashSet::with_capacity(trace.jobs.len());
    let mut duplicates = Vec::new();
    for (index, line) in trace.jobs.iter().enumerate() {
        if !filter.keeps(line.queue) {
            *skipped.entry(Skip::Queue).or_insert(0) += 1;
            continue;
        }
        match line.replayable() {
            Ok(procs) if u64::from(procs) > total_procs => {
                *skipped.entry(Skip::LargerThanCluster).or_insert(0) += 1;
            }
            Ok(_) if !seen.insert(line.id) => {
                *skipped.entry(Skip::Duplicate).or_insert(0) += 1;
                if !duplicates.contains(&line.id) {
                    duplicates.push(line.id);
                }
            }
            Ok(procs) => {
                jobs.push(SimJob {
                    id: line.id,
                    submit: line.submit.max(0),
                    run: line.run,
                    estimate: line.estimate(),
                    procs,
                    malleable: false,
                });
                lines.push(index);
            }
            Err(why) => *skipped.entry(why).or_insert(0) += 1,
        }
    }
    // The format says lines are sorted by submit time; a stable sort keeps file order on ties.
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by_key(|&i| jobs[i].submit);
    let jobs = order.iter().map(|&i| jobs[i]).collect();
    let lines = order.iter().map(|&i| lines[i]).collect();
    Selected { jobs, skipped, duplicates, lines }
}

/// Splits the jobs of `selected` between the partitions of a cluster: `partition_of` names each
/// one's partition by its trace line, or none; a job in none, or larger than its partition's
/// `capacity` (processors), is left out and counted ([`Skip::NoPartition`],
/// [`Skip::LargerThanPartition`]). Returns each partition's jobs, as indices into the jobs
/// `selected` keeps, in submit order.
pub fn split(
    selected: &mut Selected,
    trace: &Trace,
    capacity: &[u64],
    partition_of: &dyn Fn(&crate::swf::SwfJob) -> Option<usize>,
) -> Vec<Vec<usize>> {
    let mut parts = vec![Vec::new(); capacity.len()];
    let mut kept = 0;
    for i in 0..selected.jobs.len() {
        let line = selected.lines[i];
        let to = partition_of(&trace.jobs[line]).filter(|&p| p < capacity.len());
        let why = match to {
            None => Skip::NoPartition,
            Some(p) if u64::from(selected.jobs[i].procs) > capacity[p] => Skip::LargerThanPartition,
            Some(p) => {
                parts[p].push(kept);
                selected.jobs[kept] = selected.jobs[i];
                selected.lines[kept] = line;
                kept += 1;
                continue;
            }
        };
        *selected.skipped.entry(why).or_insert(0) += 1;
    }
    selected.jobs.truncate(kept);
    selected.lines.truncate(kept);
    parts
}

/// One point of the time series: after the decisions of instant `t`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Sample {
    /// Seconds since the first submit.
    pub t: Time,
    /// Processors held.
    pub busy: u64,
    /// Jobs waiting.
    pub queue: usize,
}

/// What a replay measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SimReport {
    /// Cluster order.
    pub policy: String,
    /// Host strategy.
    pub placement: &'static str,
    /// Hosts.
    pub hosts: usize,
    /// Processors (whole cores) in the cluster.
    pub processors: u64,
    /// Jobs replayed.
    pub jobs: usize,
    /// Suspensions (with preemption).
    pub suspensions: usize,
    /// Seconds of progress each suspension cost the suspended job (with preemption).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub suspend_cost_s: Option<Time>,
    /// Gang slice length, seconds (with gang slicing).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gang_slice_s: Option<Time>,
    /// How many waiting jobs got reservations (conservative backfilling with a depth).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reservation_depth: Option<u32>,
    /// Seconds of progress each gang freeze cost the frozen job (with gang slicing).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub switch_cost_s: Option<Time>,
    /// Freezes by gang slicing: a job stopped at a slice boundary for another row's jobs.
    pub gang_freezes: usize,
    /// Jobs the core ran malleable (with malleable jobs).
    pub malleable_jobs: usize,
    /// Resizes of malleable jobs: each change of a job's size counts once.
    pub resizes: usize,
    /// Whether jobs that fit one NUMA node asked for one ([`PolicyConfig::numa_local`]).
    pub numa_local: bool,
    /// Start attempts refused on shape on every host tried although cores were free there
    /// (after migration, with it).
    pub refused_on_shape: u64,
    /// Jobs started after moves made room (with migration).
    pub defrag_starts: u64,
    /// Moves of running jobs for defragmentation.
    pub moves: u64,
    /// PUs of the jobs moved for defragmentation.
    pub moved_pus: u64,
    /// Moves out of prime-time pools as a window opened.
    pub prime_moves: u64,
    /// Blocks set aside for EASY's head (with reservations).
    pub blocks: u64,
    /// Queue heads that had blocks.
    pub reserved_heads: u64,
    /// Queue heads that started with every part inside their blocks.
    pub heads_in_block: u64,
    /// Jobs started that the prime-time pools admit (with prime time).
    pub admitted_starts: u64,
    /// Trace lines not replayed, by reason.
    pub skipped: BTreeMap<String, usize>,
    /// Jobs cut to their requested time, when the replay kills jobs at their limit
    /// ([`kill_at_limit`]; the caller says).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub killed_at_limit: Option<usize>,
    /// Processor-seconds used ÷ (processors × makespan).
    pub utilization: f64,
    /// Mean wait, seconds.
    pub mean_wait_s: f64,
    /// 95th percentile of the wait (nearest rank), seconds.
    pub p95_wait_s: f64,
    /// Largest wait, seconds.
    pub max_wait_s: f64,
    /// Mean bounded slowdown, τ = 10 s.
    pub mean_bounded_slowdown: f64,
    /// Percentiles (nearest rank) and largest of the wait, the response (wait plus run:
    /// submission to completion) and the bounded slowdown.
    pub percentiles: Percentiles,
    /// First submit to last end, seconds.
    pub makespan_s: f64,
    /// Share of jobs within the fewest NUMA nodes that could hold them, on every host.
    pub numa_optimal_share: f64,
    /// The same for L3 groups.
    pub l3_optimal_share: f64,
    /// Replay speed: jobs per second of the simulator's own wall time (the caller times it).
    pub jobs_per_s: f64,
    /// Waits per job, seconds, in job order (for pictures).
    #[serde(skip)]
    pub waits: Vec<Time>,
    /// Bounded slowdowns per job (for pictures).
    #[serde(skip)]
    pub slowdowns: Vec<f64>,
    /// Busy processors and queue length over time (for pictures).
    #[serde(skip)]
    pub series: Vec<Sample>,
    /// What happened to each job, in job order (for per-job output).
    #[serde(skip)]
    pub outcomes: Vec<JobOutcome>,
    /// A cluster replayed in partitions ([`merge`]): each one's own figures.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub partitions: Vec<PartitionFigures>,
}

/// One partition's figures in a cluster replayed in partitions ([`merge`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PartitionFigures {
    /// Its name.
    pub name: String,
    /// Its policy and host strategy.
    pub policy: String,
    /// Its host strategy.
    pub placement: &'static str,
    /// Hosts and processors.
    pub hosts: usize,
    /// Processors (whole cores).
    pub processors: u64,
    /// Jobs replayed there.
    pub jobs: usize,
    /// Processor-seconds used ÷ (its processors × its makespan).
    pub utilization: f64,
    /// Mean wait, seconds.
    pub mean_wait_s: f64,
    /// 95th percentile of the wait (nearest rank), seconds.
    pub p95_wait_s: f64,
    /// Mean bounded slowdown.
    pub mean_bounded_slowdown: f64,
    /// Its first submit to its last end, seconds.
    pub makespan_s: f64,
}

/// One partition of a cluster: its name, its replay, and the jobs it replayed (their indices
/// in the whole cluster's job list, in its replay's order).
#[derive(Debug, Clone)]
pub struct Partition {
    /// Its name.
    pub name: String,
    /// Its replay (with its outcomes and series).
    pub report: SimReport,
    /// Its jobs' indices in the cluster's jobs.
    pub jobs: Vec<usize>,
}

/// What happened to one job in a replay. Times are the trace's clock (seconds); the wait, the
/// response (`end` − submit) and the bounded slowdown are the ones the figures average, so a
/// job's `wait` counts the time it spent suspended by preemption, and its run as a writer of
/// per-job results gives it, the response minus the wait, counts the rest (its run, and for a
/// gang job the slices it sat out).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct JobOutcome {
    /// When it first ran.
    pub start: Time,
    /// When it ended.
    pub end: Time,
    /// Start − submit, plus the time it spent suspended by preemption.
    pub wait: Time,
    /// Seconds it spent suspended by preemption.
    pub suspended: Time,
    /// Suspensions by preemption.
    pub suspensions: u32,
    /// Freezes by gang slicing (a job started in a row whose slice is not now counts one).
    pub gang_freezes: u32,
    /// Moves of its CPUs (defragmentation, prime-time pools opening).
    pub moves: u32,
    /// Changes of its size (a malleable job).
    pub resizes: u32,
    /// Processors it held when it started (below its request: a malleable job started small).
    pub procs_at_start: u32,
    /// Hosts it started on (where: [`Action::Start`], which [`replay_observed`] shows).
    pub hosts: u32,
    /// NUMA nodes its CPUs spanned when it started, summed over its hosts.
    pub numa_nodes: u32,
    /// Whether that was the fewest that could hold its CPUs, on every host.
    pub numa_optimal: bool,
    /// The same for L3 groups.
    pub l3_groups: u32,
    /// The same for L3 groups.
    pub l3_optimal: bool,
    /// Bounded slowdown (τ = 10 s): max(1, response ÷ max(logged run, τ)).
    pub bounded_slowdown: f64,
}

/// The 50th, 90th and 99th percentiles (nearest rank) and the largest of one figure over the
/// replayed jobs (0 without jobs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Quantiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

impl Quantiles {
    /// Of `values` (in any order).
    pub fn of(mut values: Vec<f64>) -> Self {
        values.sort_unstable_by(f64::total_cmp);
        let n = values.len();
        let rank = |p: usize| if n == 0 { 0.0 } else { values[(n * p).div_ceil(100).max(1) - 1] };
        Quantiles { p50: rank(50), p90: rank(90), p99: rank(99), max: rank(100) }
    }
}

/// [`Quantiles`] of the wait, the response and the bounded slowdown, seconds for the first two.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Start minus submit, plus time suspended by preemption.
    pub wait_s: Quantiles,
    /// Completion minus submit.
    pub response_s: Quantiles,
    /// Bounded slowdown, τ = 10 s.
    pub bounded_slowdown: Quantiles,
}

/// Why a replay stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    /// The core refused an event.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// Jobs were left waiting with nothing running that could free room for them.
    #[error(
        "{count} job(s) never ran to their end: job {first} ({procs} processors) still waits on an idle cluster \
         ({strategy} could not place it on these hosts although enough cores were free); the figures would be wrong, so there are none"
    )]
    NeverStarted {
        /// How many.
        count: usize,
        /// The first one's trace job number.
        first: i64,
        /// What it asks for.
        procs: u32,
        /// The host strategy.
        strategy: &'static str,
    },
    /// A gang switch would cost a job at least the slice it runs in: it would never progress.
    #[error(
        "a gang switch costing {cost} s leaves nothing of a {slice} s slice: no job would ever progress (the cost must be below the slice)"
    )]
    SwitchCostNotBelowSlice {
        /// The cost per switch, seconds.
        cost: Time,
        /// The slice, seconds.
        slice: Time,
    },
}

/// How a configuration is named in reports: `easy`, `fcfs+preempt`, ...
pub fn policy_name(config: &PolicyConfig) -> String {
    let mut name = config.order.name().to_string();
    if config.preempt.is_some() {
        name.push_str("+preempt");
    }
    if config.gang.is_some() {
        name.push_str("+gang");
    }
    if config.malleable.is_some() {
        name.push_str("+malleable");
    }
    if config.defrag.is_some() {
        name.push_str("+defrag");
    }
    match config.reserve {
        Some(Reserve::Outlasting) => name.push_str("+reserve"),
        Some(Reserve::Strict) => name.push_str("+reserve-strict"),
        None => {}
    }
    if config.prime.is_some() {
        name.push_str("+prime");
    }
    name
}

/// Replays `jobs` (in submit order) on `hosts` under `config`. `progress` is called with the
/// number of jobs submitted so far, every 4,096 jobs and at the end.
///
/// A suspended job stops running: its end moves later by as long as it stays suspended. With
/// gang slicing the same holds for a job frozen between its slices, and the core is woken at
/// every slice boundary while it asks to be ([`PolicyCore::next_wakeup`]). A malleable job's end
/// moves at every resize (see the module documentation).
pub fn replay(
    hosts: Vec<Arc<HostModel>>,
    jobs: &[SimJob],
    config: PolicyConfig,
    progress: &mut dyn FnMut(usize),
) -> Result<SimReport, SimError> {
    replay_observed(hosts, jobs, config, progress, &mut |_, _| {})
}

/// [`replay`], showing `observe` every action the core decides, with its time, before the
/// simulator applies it (for checks on the events of a replay).
///
/// A move ([`Action::Move`]) changes a job's CPUs, not its end, unless it has a pause
/// ([`PolicyConfig::move_cost`]): then the job makes no progress for that long and its end
/// moves later by as much. Reservations ([`Action::Reserve`]) are the core's own business.
///
/// With gang slicing and no switch cost, whole periods of slices in which no job is submitted
/// or ends are not stepped through: the jobs' progress, their freezes and the series' samples
/// are worked out from the repeating pattern ([`PolicyCore::gang_cycle`]), and `observe` is
/// not shown those freezes and thaws (each is counted). The figures are the same as stepping.
pub fn replay_observed(
    hosts: Vec<Arc<HostModel>>,
    jobs: &[SimJob],
    config: PolicyConfig,
    progress: &mut dyn FnMut(usize),
    observe: &mut dyn FnMut(Time, &Action),
) -> Result<SimReport, SimError> {
    replay_stepping(hosts, jobs, config, progress, observe, false)
}

/// [`replay_observed`]; with `every_slice`, every gang slice boundary is stepped through (the
/// reference the skipping is tested against).
fn replay_stepping(
    hosts: Vec<Arc<HostModel>>,
    jobs: &[SimJob],
    config: PolicyConfig,
    progress: &mut dyn FnMut(usize),
    observe: &mut dyn FnMut(Time, &Action),
    every_slice: bool,
) -> Result<SimReport, SimError> {
    if let Some(g) = config.gang.filter(|g| config.switch_cost >= g.slice) {
        return Err(SimError::SwitchCostNotBelowSlice { cost: config.switch_cost, slice: g.slice });
    }
    let host_count = hosts.len();
    let strategy = config.strategy;
    let policy = policy_name(&config);
    let gang_slice_s = config.gang.map(|g| g.slice);
    let numa_local = config.numa_local;
    let gang = config.gang.is_some();
    let gang_period = config.gang.map(|g| g.slice.max(1).saturating_mul(i64::from(g.rows.max(1))));
    let suspend_cost = config.suspend_cost.max(0);
    let switch_cost = config.switch_cost.max(0);
    let reservation_depth = config
        .reservation_depth
        .filter(|_| config.order == crate::policy::QueueOrder::Conservative);
    let preempting = config.preempt.is_some() && !gang;
    let mut core = PolicyCore::new(hosts, config);
    let total = core.total_procs();
    let n = jobs.len();
    let origin = jobs.first().map_or(0, |j| j.submit);
    let mut start: Vec<Option<Time>> = vec![None; n];
    let mut finish: Vec<Option<Time>> = vec![None; n];
    // The end each job will reach if nothing more happens to it (its pending end event), and
    // what a suspended job still has to run. An end event that no longer matches is stale.
    let mut due: Vec<Option<Time>> = vec![None; n];
    let mut left: Vec<Time> = vec![0; n];
    // When a job was suspended by preemption, and how long it has been so far: its wait.
    let mut suspended_at: Vec<Option<Time>> = vec![None; n];
    let mut suspended_for: Vec<Time> = vec![0; n];
    // A job's processors now, and its processor-seconds still to run as of `marked`: a resize
    // changes the rate its work drains at.
    let mut rate: Vec<u32> = vec![0; n];
    let mut work: Vec<u128> = vec![0; n];
    let mut marked: Vec<Time> = vec![0; n];
    // Per job, for its outcome: how it started and what happened to it after.
    let mut spans: Vec<(u32, u32, bool, u32, bool)> = vec![(0, 0, false, 0, false); n];
    let mut at_start: Vec<u32> = vec![0; n];
    let mut counts: Vec<Counts> = vec![Counts::default(); n];
    let mut resizes = 0usize;
    let mut suspensions = 0usize;
    let mut gang_freezes = 0usize;
    let mut ends: BinaryHeap<Reverse<(Time, JobKey)>> = BinaryHeap::new();
    let mut series = Vec::new();
    let mut next = 0usize;
    let mut events = Vec::new();
    loop {
        let next_submit = jobs.get(next).map(|j| j.submit);
        let next_end = ends.peek().map(|Reverse((t, _))| *t);
        let wakeup = core.next_wakeup();
        let Some(now) = [next_submit, next_end, wakeup].into_iter().flatten().min() else {
            break;
        };
        events.clear();
        while let Some(Reverse((t, job))) = ends.peek().copied() {
            if t != now {
                break;
            }
            ends.pop();
            if due[job as usize] == Some(t) {
                due[job as usize] = None;
                finish[job as usize] = Some(t);
                events.push(Event::End { job });
            }
        }
        if events.is_empty() && next_submit != Some(now) {
            if wakeup != Some(now) {
                // Only stale end events at this instant.
                continue;
            }
            events.push(Event::Tick);
        }
        let before = next;
        while next < n && jobs[next].submit == now {
            let j = &jobs[next];
            let key = JobKey::try_from(next).unwrap_or(JobKey::MAX);
            events.push(Event::Submit {
                job: key,
                spec: JobSpec { procs: j.procs, estimate: j.estimate, malleable: j.malleable },
            });
            next += 1;
        }
        if next / 4096 != before / 4096 {
            progress(next);
        }
        for action in core.step(now, events.drain(..))? {
            observe(now, &action);
            let (job, end) = match action {
                Action::Start { job, parts } => {
                    start[job as usize] = Some(now);
                    let numa_optimal = parts.iter().all(|p| p.placement.metrics.numa_optimal());
                    let l3_optimal = parts.iter().all(|p| p.placement.metrics.l3_optimal());
                    let i = job as usize;
                    let sum = |f: fn(&crate::place::PlacementMetrics) -> usize| {
                        parts.iter().map(|p| f(&p.placement.metrics) as u32).sum::<u32>()
                    };
                    spans[i] = (
                        parts.len() as u32,
                        sum(|m| m.numa_nodes),
                        numa_optimal,
                        sum(|m| m.l3_groups),
                        l3_optimal,
                    );
                    rate[i] = parts.iter().map(|p| p.placement.tasks.len() as u32).sum();
                    at_start[i] = rate[i];
                    work[i] = u128::try_from(jobs[i].run).unwrap_or(0) * u128::from(jobs[i].procs);
                    marked[i] = now;
                    if rate[i] == jobs[i].procs {
                        (job, now.saturating_add(jobs[i].run))
                    } else {
                        // Started malleable below its size.
                        (job, now.saturating_add(seconds_for(work[i], rate[i])))
                    }
                }
                Action::Resize { job, parts } => {
                    let i = job as usize;
                    let ran = u128::try_from(now - marked[i]).unwrap_or(0);
                    work[i] = work[i].saturating_sub(ran * u128::from(rate[i]));
                    // (Within a move's pause, its work starts again when the pause ends.)
                    marked[i] = marked[i].max(now);
                    rate[i] = parts.iter().map(|p| p.placement.tasks.len() as u32).sum();
                    resizes += 1;
                    counts[i].resizes += 1;
                    (job, now.saturating_add(seconds_for(work[i], rate[i])))
                }
                Action::Suspend { job } => {
                    let i = job as usize;
                    left[i] = due[i].take().map_or(0, |d| d - now);
                    let started_frozen = gang && start[i] == Some(now) && left[i] == jobs[i].run;
                    if started_frozen {
                        // Started frozen (its row's slice is not now): it has not run yet, and
                        // its wait goes on until it does.
                        start[i] = None;
                    }
                    if gang {
                        gang_freezes += 1;
                        counts[i].gang_freezes += 1;
                        if !started_frozen {
                            // Its caches are refilled when its row runs again.
                            left[i] = left[i].saturating_add(switch_cost);
                        }
                    } else {
                        suspensions += 1;
                        counts[i].suspensions += 1;
                        // Its memory is written out and read back, its caches are lost.
                        left[i] = left[i].saturating_add(suspend_cost);
                        suspended_at[i] = Some(now);
                    }
                    continue;
                }
                Action::Resume { job } => {
                    let i = job as usize;
                    start[i].get_or_insert(now);
                    if let Some(at) = suspended_at[i].take() {
                        suspended_for[i] += now - at;
                    }
                    (job, now.saturating_add(left[i]))
                }
                Action::Move { job, pause, .. } => {
                    let i = job as usize;
                    counts[i].moves += 1;
                    if pause <= 0 {
                        continue;
                    }
                    // Its work stops for the pause: what is left runs from then on.
                    let ran = u128::try_from(now - marked[i]).unwrap_or(0);
                    work[i] = work[i].saturating_sub(ran * u128::from(rate[i]));
                    marked[i] = marked[i].max(now).saturating_add(pause);
                    (job, marked[i].saturating_add(seconds_for(work[i], rate[i])))
                }
                // A trace carries no owner's suspend or resume, so nothing is refused.
                Action::Reserve { .. } | Action::Refused { .. } => continue,
            };
            due[job as usize] = Some(end);
            ends.push(Reverse((end, job)));
        }
        series.push(Sample { t: now - origin, busy: core.busy_procs(), queue: core.queue_len() });
        // Worth asking the core only when a whole period passes before the next submit.
        let next_submit = jobs.get(next).map(|j| j.submit);
        if !every_slice
            && gang_period.is_some_and(|period| next_submit.is_none_or(|t| t - now > period))
        {
            let skipped = skip_gang_periods(&mut core, now, next_submit, &start, &due, &left);
            if let Some(skip) = skipped {
                let until = now + skip.span;
                for (i, w) in skip.left {
                    match due[i] {
                        Some(_) => {
                            due[i] = Some(until + w);
                            ends.push(Reverse((until + w, i as JobKey)));
                        }
                        None => left[i] = w,
                    }
                }
                for (i, f) in skip.freezes {
                    counts[i].gang_freezes += u32::try_from(f).unwrap_or(u32::MAX);
                    gang_freezes += f;
                }
                // A sample at every boundary skipped, as stepping gives (made here, not kept
                // twice: a long last job with short slices skips millions).
                let queue = core.queue_len();
                let (slice, phases) = (skip.slice, skip.busy_in.len());
                series.extend((1..=skip.boundaries).map(|b| Sample {
                    t: now + b as Time * slice - origin,
                    busy: skip.busy_in[b % phases],
                    queue,
                }));
            }
        }
    }
    progress(n);
    // A job that never started, or was suspended and never resumed, holds up the figures.
    let never: Vec<usize> = (0..n).filter(|&i| finish[i].is_none()).collect();
    if let Some(&first) = never.first() {
        return Err(SimError::NeverStarted {
            count: never.len(),
            first: jobs[first].id,
            procs: jobs[first].procs,
            strategy: strategy.name(),
        });
    }
    let outcomes: Vec<JobOutcome> = jobs
        .iter()
        .zip(&start)
        .enumerate()
        .map(|(i, (j, s))| {
            // Every job started (checked above). Time suspended by preemption is waiting too.
            let wait = s.unwrap_or(j.submit) - j.submit + suspended_for[i];
            // From submission to completion: the wait, the run, and any time spent suspended.
            let end = finish[i].unwrap_or(j.submit + wait + j.run);
            let in_system = (end - j.submit) as f64;
            let (hosts, numa_nodes, numa_optimal, l3_groups, l3_optimal) = spans[i];
            let Counts { suspensions, gang_freezes, moves, resizes } = counts[i];
            JobOutcome {
                start: s.unwrap_or(j.submit),
                end,
                wait,
                suspended: suspended_for[i],
                suspensions,
                gang_freezes,
                moves,
                resizes,
                procs_at_start: at_start[i],
                hosts,
                numa_nodes,
                numa_optimal,
                l3_groups,
                l3_optimal,
                bounded_slowdown: (in_system / (j.run as f64).max(SLOWDOWN_BOUND_S)).max(1.0),
            }
        })
        .collect();
    let summary = Summary::of(jobs, &outcomes, total);
    let counters = core.counters();
    Ok(SimReport {
        policy,
        placement: strategy.name(),
        hosts: host_count,
        processors: total,
        jobs: n,
        suspensions,
        suspend_cost_s: preempting.then_some(suspend_cost),
        switch_cost_s: gang.then_some(switch_cost),
        reservation_depth,
        gang_slice_s,
        gang_freezes,
        malleable_jobs: usize::try_from(core.malleable_started()).unwrap_or(usize::MAX),
        resizes,
        numa_local,
        refused_on_shape: counters.refused_on_shape,
        defrag_starts: counters.defrag_starts,
        moves: counters.moves,
        moved_pus: counters.moved_pus,
        prime_moves: counters.prime_moves,
        blocks: counters.blocks_made,
        reserved_heads: counters.reserved_heads,
        heads_in_block: counters.heads_in_block,
        admitted_starts: counters.admitted_starts,
        series,
        outcomes,
        ..SimReport::default()
    }
    .with(summary))
}

/// Whole gang periods skipped at a boundary ([`skip_gang_periods`]).
struct GangSkip {
    /// Seconds skipped.
    span: Time,
    /// Per job (by index): its seconds still to run after them.
    left: Vec<(usize, Time)>,
    /// Per job: its freezes in them.
    freezes: Vec<(usize, usize)>,
    /// Slice boundaries in them (the last at `span`).
    boundaries: usize,
    /// Slice length, seconds.
    slice: Time,
    /// The busy processors in each slice of a period, from the one the skipping starts in.
    busy_in: Vec<u64>,
}

/// At a slice boundary `now` the core has stepped: as many whole gang periods as pass with no
/// job submitted (the next at `next_submit`) and none ending, with what they do to each job
/// (`due`: the end of a running job; `left`: what a frozen one has to run), or `None` when
/// not one does (or the core cannot say: [`PolicyCore::gang_cycle`]). A job that never ran yet
/// (`start`) stops the skipping: its first run is its start.
fn skip_gang_periods(
    core: &mut PolicyCore,
    now: Time,
    next_submit: Option<Time>,
    start: &[Option<Time>],
    due: &[Option<Time>],
    left: &[Time],
) -> Option<GangSkip> {
    let cycle = core.gang_cycle()?;
    let rows = cycle.runs.len();
    let period = cycle.slice.checked_mul(rows as Time)?;
    // No submit in the periods, nor at their end (the core steps there with it).
    let mut periods = match next_submit {
        Some(t) => (t - now - 1).max(0) / period,
        None => Time::MAX,
    };
    let mut per_job = Vec::with_capacity(cycle.jobs.len());
    for (k, &(job, _)) in cycle.jobs.iter().enumerate() {
        let i = job as usize;
        // Its first run is its start, at a boundary.
        start[i]?;
        let running = due[i].map(|d| d - now);
        if running.is_some() != cycle.runs[0][k] {
            return None;
        }
        let work = running.unwrap_or(left[i]);
        let slices = cycle.runs.iter().filter(|r| r[k]).count() as Time;
        let freezes = (0..rows).filter(|&j| cycle.runs[j][k] && !cycle.runs[(j + 1) % rows][k]);
        let ran = slices * cycle.slice;
        // At least a second left at the end: no job ends in the periods, nor at their end.
        if ran > 0 {
            periods = periods.min((work - 1).max(0) / ran);
        }
        per_job.push((i, work, ran, freezes.count()));
    }
    if periods < 1 || per_job.is_empty() {
        return None;
    }
    // Whole periods only: what one period does, times `periods`.
    let busy_in: Vec<u64> = (0..rows)
        .map(|j| {
            let on = cycle.jobs.iter().zip(&cycle.runs[j]).filter(|(_, &run)| run);
            on.map(|(&(_, held), _)| held).sum()
        })
        .collect();
    let boundaries = usize::try_from(periods).ok()?.checked_mul(rows)?;
    let times = periods as usize;
    core.skip_gang_periods(periods as u64);
    Some(GangSkip {
        span: periods * period,
        left: per_job.iter().map(|&(i, work, ran, _)| (i, work - periods * ran)).collect(),
        freezes: per_job.iter().map(|&(i, .., f)| (i, f * times)).collect(),
        boundaries,
        slice: cycle.slice,
        busy_in,
    })
}

/// One report of a cluster whose partitions (disjoint sets of hosts, each with its own jobs and
/// policy) were replayed apart: the figures are those of `jobs` (in submit order, every one in
/// exactly one partition) with the outcomes the partitions gave them, over all their processors
/// from the first submit to the last end, as [`replay`] sums up one replay; counts are summed,
/// and the series adds up the partitions' busy processors and queues at every instant. Disjoint
/// hosts share nothing, so replaying them apart decides exactly what one replay of them all
/// would. `policy` and `placement` name the whole; each partition's own are in `partitions`.
/// `whole` is the cluster's hosts and processors, which may be more than the partitions' (hosts
/// in no partition stand idle, and utilization counts them).
pub fn merge(
    policy: String,
    placement: &'static str,
    parts: Vec<Partition>,
    jobs: &[SimJob],
    whole: (usize, u64),
) -> SimReport {
    let mut outcomes = vec![JobOutcome::default(); jobs.len()];
    for part in &parts {
        for (&i, outcome) in part.jobs.iter().zip(&part.report.outcomes) {
            outcomes[i] = *outcome;
        }
    }
    let reports: Vec<&SimReport> = parts.iter().map(|p| &p.report).collect();
    let sum = |f: fn(&SimReport) -> u64| reports.iter().map(|r| f(r)).sum::<u64>();
    let sum_usize = |f: fn(&SimReport) -> usize| reports.iter().map(|r| f(r)).sum::<usize>();
    let first = |f: fn(&SimReport) -> Option<Time>| reports.iter().find_map(|r| f(r));
    let processors = sum(|r| r.processors).max(whole.1);
    let summary = Summary::of(jobs, &outcomes, processors);
    let origin = jobs.first().map_or(0, |j| j.submit);
    let series = merge_series(
        parts
            .iter()
            .map(|p| {
                let at = p.jobs.first().map_or(origin, |&i| jobs[i].submit);
                (at - origin, p.report.series.as_slice())
            })
            .collect(),
    );
    let partitions = parts
        .iter()
        .map(|p| PartitionFigures {
            name: p.name.clone(),
            policy: p.report.policy.clone(),
            placement: p.report.placement,
            hosts: p.report.hosts,
            processors: p.report.processors,
            jobs: p.report.jobs,
            utilization: p.report.utilization,
            mean_wait_s: p.report.mean_wait_s,
            p95_wait_s: p.report.p95_wait_s,
            mean_bounded_slowdown: p.report.mean_bounded_slowdown,
            makespan_s: p.report.makespan_s,
        })
        .collect();
    SimReport {
        policy,
        placement,
        hosts: sum_usize(|r| r.hosts).max(whole.0),
        processors,
        jobs: jobs.len(),
        suspensions: sum_usize(|r| r.suspensions),
        suspend_cost_s: first(|r| r.suspend_cost_s),
        gang_slice_s: first(|r| r.gang_slice_s),
        reservation_depth: reports.iter().find_map(|r| r.reservation_depth),
        switch_cost_s: first(|r| r.switch_cost_s),
        gang_freezes: sum_usize(|r| r.gang_freezes),
        malleable_jobs: sum_usize(|r| r.malleable_jobs),
        resizes: sum_usize(|r| r.resizes),
        numa_local: reports.iter().any(|r| r.numa_local),
        refused_on_shape: sum(|r| r.refused_on_shape),
        defrag_starts: sum(|r| r.defrag_starts),
        moves: sum(|r| r.moves),
        moved_pus: sum(|r| r.moved_pus),
        prime_moves: sum(|r| r.prime_moves),
        blocks: sum(|r| r.blocks),
        reserved_heads: sum(|r| r.reserved_heads),
        heads_in_block: sum(|r| r.heads_in_block),
        admitted_starts: sum(|r| r.admitted_starts),
        series,
        outcomes,
        partitions,
        ..SimReport::default()
    }
    .with(summary)
}

/// The sum of several series, each shifted by its offset (its first submit after the whole's):
/// at every instant any of them changes, the busy processors and queues of all as they then
/// stand (a series holds its last sample until its next; before its first it counts nothing).
fn merge_series(parts: Vec<(Time, &[Sample])>) -> Vec<Sample> {
    let mut points: Vec<(Time, usize, Sample)> = parts
        .iter()
        .enumerate()
        .flat_map(|(k, (offset, series))| series.iter().map(move |s| (s.t + offset, k, *s)))
        .collect();
    points.sort_by_key(|(t, k, _)| (*t, *k));
    let mut now: Vec<(u64, usize)> = vec![(0, 0); parts.len()];
    let (mut busy, mut queue) = (0u64, 0usize);
    let mut merged: Vec<Sample> = Vec::with_capacity(points.len());
    for (t, k, sample) in points {
        let (was_busy, was_queued) = std::mem::replace(&mut now[k], (sample.busy, sample.queue));
        busy = busy - was_busy + sample.busy;
        queue = queue - was_queued + sample.queue;
        match merged.last_mut() {
            Some(last) if last.t == t => {
                last.busy = busy;
                last.queue = queue;
            }
            _ => merged.push(Sample { t, busy, queue }),
        }
    }
    merged
}

/// What happened to one job after it started, counted as the replay goes.
#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    suspensions: u32,
    gang_freezes: u32,
    moves: u32,
    resizes: u32,
}

/// The figures of a replay, from what happened to each job: the summary averages exactly what
/// [`JobOutcome`] holds, so per-job results add up to it, and a cluster replayed in partitions
/// ([`merge`]) is summed up as one replay would be.
struct Summary {
    utilization: f64,
    mean_wait_s: f64,
    p95_wait_s: f64,
    max_wait_s: f64,
    mean_bounded_slowdown: f64,
    percentiles: Percentiles,
    makespan_s: f64,
    numa_optimal_share: f64,
    l3_optimal_share: f64,
    waits: Vec<Time>,
    slowdowns: Vec<f64>,
}

impl SimReport {
    /// The report with `summary`'s figures (and no speed yet: the caller times the replay).
    fn with(self, summary: Summary) -> SimReport {
        SimReport {
            utilization: summary.utilization,
            mean_wait_s: summary.mean_wait_s,
            p95_wait_s: summary.p95_wait_s,
            max_wait_s: summary.max_wait_s,
            mean_bounded_slowdown: summary.mean_bounded_slowdown,
            percentiles: summary.percentiles,
            makespan_s: summary.makespan_s,
            numa_optimal_share: summary.numa_optimal_share,
            l3_optimal_share: summary.l3_optimal_share,
            jobs_per_s: 0.0,
            waits: summary.waits,
            slowdowns: summary.slowdowns,
            ..self
        }
    }
}

impl Summary {
    /// Of `jobs` (in submit order) with their `outcomes`, on `processors` processors.
    fn of(jobs: &[SimJob], outcomes: &[JobOutcome], processors: u64) -> Self {
        let n = jobs.len();
        let origin = jobs.first().map_or(0, |j| j.submit);
        // A job's end may have moved earlier (a malleable job grown), so the last end is the
        // last of the jobs' ends, not the last end event.
        let last_end = outcomes.iter().map(|o| o.end).max().unwrap_or(origin).max(origin);
        let makespan = (last_end - origin) as f64;
        let waits: Vec<Time> = outcomes.iter().map(|o| o.wait).collect();
        let responses: Vec<f64> =
            jobs.iter().zip(outcomes).map(|(j, o)| (o.end - j.submit) as f64).collect();
        let slowdowns: Vec<f64> = outcomes.iter().map(|o| o.bounded_slowdown).collect();
        let work: f64 = jobs.iter().map(|j| j.run as f64 * f64::from(j.procs)).sum();
        let mean = |v: f64| if n == 0 { 0.0 } else { v / n as f64 };
        let mut sorted = waits.clone();
        sorted.sort_unstable();
        let p95 = if n == 0 { 0 } else { sorted[(n * 95).div_ceil(100).max(1) - 1] };
        let count = |f: fn(&JobOutcome) -> bool| outcomes.iter().filter(|o| f(o)).count() as f64;
        Summary {
            utilization: if makespan > 0.0 { work / (processors as f64 * makespan) } else { 0.0 },
            mean_wait_s: mean(waits.iter().map(|w| *w as f64).sum()),
            p95_wait_s: p95 as f64,
            max_wait_s: sorted.last().copied().unwrap_or(0) as f64,
            mean_bounded_slowdown: mean(slowdowns.iter().sum()),
            percentiles: Percentiles {
                wait_s: Quantiles::of(waits.iter().map(|w| *w as f64).collect()),
                response_s: Quantiles::of(responses),
                bounded_slowdown: Quantiles::of(slowdowns.clone()),
            },
            makespan_s: makespan,
            numa_optimal_share: mean(count(|o| o.numa_optimal)),
            l3_optimal_share: mean(count(|o| o.l3_optimal)),
            waits,
            slowdowns,
        }
    }
}

/// Whole seconds for `work` processor-seconds at `rate` processors, the last rounded up.
fn seconds_for(work: u128, rate: u32) -> Time {
    Time::try_from(work.div_ceil(u128::from(rate.max(1)))).unwrap_or(Time::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::place::Strategy;
    use crate::policy::QueueOrder;
    use crate::swf;

    fn flat(n: usize) -> Vec<Arc<HostModel>> {
        crate::policy::tests::flat(n, 1)
    }

    /// The processor-seconds the replay's series says were busy (running, not suspended).
    fn processor_seconds_busy(r: &SimReport) -> f64 {
        r.series.windows(2).map(|w| (w[0].busy as f64) * (w[1].t - w[0].t) as f64).sum()
    }

    fn job(id: i64, submit: Time, run: Time, procs: u32) -> SimJob {
        SimJob { id, submit, run, estimate: run, procs, malleable: false }
    }

    #[test]
    fn jobs_killed_at_their_limit_run_and_are_estimated_at_what_they_asked() {
        // Job 1 asked 100 s and ran 250; job 2 asked 100 and ran 50; job 3 asked nothing.
        let trace = swf::parse(
            "1 0 -1 250 1 -1 -1 1 100 -1 1 -1 -1 -1 1 -1 -1 -1\n\
             2 5 -1 50 1 -1 -1 1 100 -1 1 -1 -1 -1 1 -1 -1 -1\n\
             3 9 -1 70 1 -1 -1 1 -1 -1 1 -1 -1 -1 1 -1 -1 -1\n",
        )
        .unwrap();
        let Selected { mut jobs, lines, .. } = jobs_from_trace(&trace, &TraceFilter::default(), 4);
        assert_eq!((jobs[0].run, jobs[0].estimate), (250, 250));
        assert_eq!(kill_at_limit(&mut jobs, &lines, &trace), 1);
        let runs: Vec<_> = jobs.iter().map(|j| (j.run, j.estimate)).collect();
        assert_eq!(runs, vec![(100, 100), (50, 100), (70, 70)]);
    }

    #[test]
    fn figures_of_a_small_replay_by_hand() {
        // 2 hosts. Job 0: 2 procs 0-100. Job 1: 1 proc, submitted 10, waits until 100, runs 5.
        // Job 2: 1 proc, submitted 20, runs 1000; FCFS starts it at 100 beside job 1.
        let jobs = [job(1, 0, 100, 2), job(2, 10, 5, 1), job(3, 20, 1000, 1)];
        let config = PolicyConfig::plain(QueueOrder::Fcfs, Strategy::BestFit);
        let r = replay(flat(2), &jobs, config, &mut |_| {}).unwrap();
        assert_eq!(r.waits, vec![0, 90, 80]);
        assert_eq!(r.makespan_s, 1100.0);
        assert!((r.utilization - (200.0 + 5.0 + 1000.0) / (2.0 * 1100.0)).abs() < 1e-12);
        // Slowdowns: 1, (90+5)/10 = 9.5, (80+1000)/1000 = 1.08.
        assert!((r.mean_bounded_slowdown - (1.0 + 9.5 + 1.08) / 3.0).abs() < 1e-12);
        assert_eq!(r.p95_wait_s, 90.0);
        // Nearest rank of 3: p50 is the 2nd, p90 and p99 the 3rd. Responses: 100, 95, 1080.
        let q = |p50, p90, p99, max| Quantiles { p50, p90, p99, max };
        assert_eq!(r.percentiles.wait_s, q(80.0, 90.0, 90.0, 90.0));
        assert_eq!(r.percentiles.response_s, q(100.0, 1080.0, 1080.0, 1080.0));
        assert_eq!(r.percentiles.bounded_slowdown, q(1080.0 / 1000.0, 9.5, 9.5, 9.5));
        assert_eq!(r.numa_optimal_share, 1.0);
        assert_eq!(r.series.last().unwrap().busy, 0);
        // Job by job: job 2 ran 100-105 on host 0 or 1, job 3 from 100 on the other.
        let o = &r.outcomes;
        assert_eq!((o[0].start, o[0].end, o[0].wait, o[0].procs_at_start), (0, 100, 0, 2));
        assert_eq!((o[1].start, o[1].end, o[1].wait), (100, 105, 90));
        assert_eq!((o[2].start, o[2].end, o[2].wait), (100, 1100, 80));
        assert_eq!(o.iter().map(|o| o.hosts).collect::<Vec<_>>(), vec![2, 1, 1]);
        assert_eq!(o.iter().map(|o| o.bounded_slowdown).collect::<Vec<_>>(), r.slowdowns);
        assert!(o.iter().all(|o| o.numa_optimal && o.numa_nodes == o.hosts));
    }

    #[test]
    fn with_preemption_every_job_runs_exactly_its_run_time_and_ends() {
        use crate::policy::Preempt;
        let model = crate::policy::tests::two_socket(1).remove(0);
        let mut rng = crate::bench::SplitMix::new(11);
        let mut t = 0;
        let jobs: Vec<SimJob> = (0..3000)
            .map(|i| {
                t += rng.below(40) as Time;
                let run = 1 + rng.below(3000) as Time;
                SimJob {
                    id: i,
                    submit: t,
                    run,
                    estimate: run * (1 + rng.below(3) as Time),
                    procs: 1 + rng.below(40) as u32,
                    malleable: false,
                }
            })
            .collect();
        let work: f64 = jobs.iter().map(|j| (j.run * Time::from(j.procs)) as f64).sum();
        for (order, cost) in [(QueueOrder::Fcfs, 0), (QueueOrder::Easy, 0), (QueueOrder::Easy, 30)]
        {
            let preempt = Some(Preempt { min_run: 60, max_suspensions: 3, min_xf: 1.5 });
            let config = PolicyConfig {
                preempt,
                suspend_cost: cost,
                ..PolicyConfig::plain(order, Strategy::BestFit)
            };
            let hosts = vec![model.clone(); 4];
            let mut charged = 0.0;
            let r = replay_observed(hosts, &jobs, config, &mut |_| {}, &mut |_, a| {
                if let Action::Suspend { job } = a {
                    charged += (cost * Time::from(jobs[*job as usize].procs)) as f64;
                }
            })
            .unwrap();
            assert!(r.suspensions > 0, "{order:?}: the stream makes jobs wait long enough");
            // Processor-seconds held over time equal the jobs' work and what their suspensions
            // cost: no job ran while suspended, none ran twice, none was lost.
            let held = processor_seconds_busy(&r);
            let want = work + charged;
            assert!((held - want).abs() < 1e-6 * want, "{order:?}: held {held}, want {want}");
            assert_eq!(r.series.last().map(|s| (s.busy, s.queue)), Some((0, 0)));
            assert!(r.slowdowns.iter().all(|s| *s >= 1.0));
        }
    }

    #[test]
    fn a_waiting_job_preempts_when_its_time_comes_and_suspended_time_is_waiting() {
        use crate::policy::Preempt;
        // Job 1 (1 processor, 1,000 s) reaches expansion factor 2 at 1,100, long before job 0
        // (both processors, 100,000 s) ends: it preempts then, with no event at that instant.
        let jobs = [job(1, 0, 100_000, 2), job(2, 100, 1_000, 1)];
        let config = PolicyConfig {
            preempt: Some(Preempt::default()),
            suspend_cost: 50,
            ..PolicyConfig::plain(QueueOrder::Easy, Strategy::BestFit)
        };
        let r = replay(flat(2), &jobs, config, &mut |_| {}).unwrap();
        assert_eq!(r.suspensions, 1);
        assert_eq!(r.suspend_cost_s, Some(50));
        // Job 0 was suspended from 1,100 to 2,100: 1,000 s of waiting; job 1 waited 1,000 s.
        assert_eq!(r.waits, vec![1_000, 1_000]);
        // Job 0 ends its 100,000 s, plus 1,000 s suspended, plus the suspension's 50 s.
        assert_eq!(r.makespan_s, 101_050.0);
    }

    #[test]
    fn preemption_regressions_from_an_attack() {
        use crate::policy::Preempt;
        let est = |mut j: SimJob, estimate: Time| {
            j.estimate = estimate;
            j
        };
        let preempting = |min_run: Time, min_xf: f64| PolicyConfig {
            preempt: Some(Preempt { min_run, max_suspensions: 2, min_xf }),
            ..PolicyConfig::plain(QueueOrder::Easy, Strategy::BestFit)
        };
        // A job with no time to run (estimate 0) reaches expansion factor 2 at 10 + 2 s: it is
        // woken then, with min_run 0 as with 300 (it was woken a second early, then never).
        let jobs = [job(1, 0, 100_000, 4), est(job(2, 10, 0, 4), 0)];
        let four = || crate::policy::tests::flat(1, 4);
        let r = replay(four(), &jobs, preempting(0, 2.0), &mut |_| {}).unwrap();
        assert_eq!((r.suspensions, r.waits[1]), (1, 2), "{:?}", r.waits);
        // A job over several hosts is placed where the counts say: a victim whose CPUs it did not
        // take is never suspended (one was, and sat frozen on a free CPU until an unrelated end).
        let jobs = [
            job(1, 0, 1_000, 6),
            job(2, 0, 100_000, 2),
            job(3, 0, 100_000, 2),
            job(4, 0, 90_000, 1),
            job(5, 1_000, 100_000, 1),
            job(6, 1_001, 50_000, 4),
        ];
        let hosts = crate::policy::tests::flat(3, 2);
        let r = replay(hosts, &jobs, preempting(300, 2.0), &mut |_| {}).unwrap();
        assert_eq!(r.suspensions, 2, "{:?}", r.waits);
        assert_eq!(r.waits[4], 0, "job 5 never stopped");
        // Suspended at the instant it started: its wait is its time before the start and while
        // suspended, once (it was counted twice).
        let jobs = [job(1, 0, 1_000, 2), job(2, 0, 100_000, 2), job(3, 10, 100, 2)];
        let two = || crate::policy::tests::flat(1, 2);
        let r = replay(two(), &jobs, preempting(0, 10.9), &mut |_| {}).unwrap();
        assert_eq!(r.waits, vec![0, 1_100, 990]);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
        /// Over random streams (estimates exact): every job does its work plus what its
        /// suspensions cost, and no victim stays suspended past its preemptor's estimated end
        /// (the CPUs held for it are lent only to jobs that end by then, and none of those is
        /// suspended).
        #[test]
        fn preemption_holds_a_victims_cpus_until_its_preemptor_ends(
            seed in 0u64..1_000_000,
            cost in 0i64..200,
            easy in proptest::bool::ANY,
        ) {
            use crate::policy::Preempt;
            let mut rng = crate::bench::SplitMix::new(seed);
            let mut t = 0;
            let jobs: Vec<SimJob> = (0..150)
                .map(|i| {
                    t += rng.below(60) as Time;
                    let run = 1 + rng.below(2_000) as Time;
                    SimJob {
                        id: i,
                        submit: t,
                        run,
                        estimate: run,
                        procs: 1 + rng.below(24) as u32,
                        malleable: false,
                    }
                })
                .collect();
            let order = if easy { QueueOrder::Easy } else { QueueOrder::Fcfs };
            let config = PolicyConfig {
                preempt: Some(Preempt { min_run: 30, max_suspensions: 3, min_xf: 1.5 }),
                suspend_cost: cost,
                ..PolicyConfig::plain(order, Strategy::BestFit)
            };
            let hosts = vec![crate::policy::tests::two_socket(1).remove(0); 2];
            // The victims of the instant's preemption (the next start is their preemptor), and
            // when each suspended victim's preemptor ends by its estimate.
            let mut victims_now: Vec<JobKey> = Vec::new();
            let mut waits_until: BTreeMap<JobKey, Time> = BTreeMap::new();
            let mut charged = 0i64;
            let mut failure: Option<String> = None;
            let r = replay_observed(hosts, &jobs, config, &mut |_| {}, &mut |now, a| match a {
                Action::Start { job, .. } => {
                    for v in victims_now.drain(..) {
                        waits_until.insert(v, now + jobs[*job as usize].estimate);
                    }
                }
                Action::Suspend { job } => {
                    charged += cost * Time::from(jobs[*job as usize].procs);
                    victims_now.push(*job);
                }
                Action::Resume { job } => {
                    if let Some(by) = waits_until.remove(job) {
                        if now > by {
                            failure.get_or_insert(format!(
                                "job {job} resumed at {now}, after its preemptor's end {by}"
                            ));
                        }
                    }
                }
                _ => {}
            })
            .unwrap();
            proptest::prop_assert!(failure.is_none(), "{:?}", failure);
            let work: f64 = jobs.iter().map(|j| (j.run * Time::from(j.procs)) as f64).sum();
            let held = processor_seconds_busy(&r);
            let want = work + charged as f64;
            proptest::prop_assert!((held - want).abs() < 1e-6 * want, "held {} want {}", held, want);
            proptest::prop_assert!(waits_until.is_empty(), "never resumed: {:?}", waits_until);
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// Skipping whole gang periods decides and reports exactly what stepping through every
        /// slice boundary does: every job's outcome, every sample of the series, every count
        /// (issue 32: the core woke at every boundary). Streams with gaps long enough to skip
        /// periods, estimates above and below the runs, on plain and two-socket hosts.
        #[test]
        fn skipping_gang_periods_gives_what_stepping_every_slice_gives(
            seed in 0u64..1_000_000,
            rows in 2u32..4,
            slice in 1i64..90,
            easy in proptest::bool::ANY,
            sockets in proptest::bool::ANY,
        ) {
            use crate::policy::Gang;
            let mut rng = crate::bench::SplitMix::new(seed);
            let mut t = 0;
            let jobs: Vec<SimJob> = (0..120)
                .map(|i| {
                    t += if rng.below(4) == 0 { rng.below(20_000) } else { rng.below(40) } as Time;
                    let run = 1 + rng.below(3_000) as Time;
                    SimJob {
                        id: i,
                        submit: t,
                        run,
                        estimate: (run / 2 + rng.below(4_000) as Time).max(1),
                        procs: 1 + rng.below(20) as u32,
                        malleable: false,
                    }
                })
                .collect();
            let order = if easy { QueueOrder::Easy } else { QueueOrder::Fcfs };
            let config = PolicyConfig {
                gang: Some(Gang { slice, rows }),
                ..PolicyConfig::plain(order, Strategy::BestFit)
            };
            let hosts = if sockets {
                vec![crate::policy::tests::two_socket(1).remove(0); 2]
            } else {
                crate::policy::tests::flat(24, 1)
            };
            let replay_with = |every_slice| {
                replay_stepping(
                    hosts.clone(),
                    &jobs,
                    config.clone(),
                    &mut |_| {},
                    &mut |_, _| {},
                    every_slice,
                )
                .unwrap()
            };
            let (stepped, skipped) = (replay_with(true), replay_with(false));
            proptest::prop_assert_eq!(&stepped.outcomes, &skipped.outcomes);
            proptest::prop_assert_eq!(stepped.series.len(), skipped.series.len());
            for (a, b) in stepped.series.iter().zip(&skipped.series) {
                proptest::prop_assert_eq!(a, b);
            }
            proptest::prop_assert_eq!(stepped.gang_freezes, skipped.gang_freezes);
            proptest::prop_assert_eq!(
                serde_json::to_value(&stepped).unwrap(),
                serde_json::to_value(&skipped).unwrap()
            );
        }
    }

    #[test]
    fn with_gang_slicing_every_job_runs_exactly_its_run_time_and_short_jobs_wait_less() {
        use crate::policy::Gang;
        let model = crate::policy::tests::two_socket(1).remove(0);
        let mut rng = crate::bench::SplitMix::new(5);
        let mut t = 0;
        let jobs: Vec<SimJob> = (0..2000)
            .map(|i| {
                t += rng.below(200) as Time;
                // Mostly short jobs, a few long ones that hold much of the cluster.
                let run = if rng.below(20) == 0 { 5_000 } else { 1 + rng.below(300) as Time };
                SimJob {
                    id: i,
                    submit: t,
                    run,
                    estimate: run,
                    procs: 1 + rng.below(24) as u32,
                    malleable: false,
                }
            })
            .collect();
        let work: f64 = jobs.iter().map(|j| (j.run * Time::from(j.procs)) as f64).sum();
        let easy = PolicyConfig::plain(QueueOrder::Easy, Strategy::BestFit);
        let plain = replay(vec![model.clone(); 4], &jobs, easy.clone(), &mut |_| {}).unwrap();
        let config = PolicyConfig { gang: Some(Gang { slice: 30, rows: 2 }), ..easy };
        let r = replay(vec![model.clone(); 4], &jobs, config, &mut |_| {}).unwrap();
        assert_eq!(r.policy, "easy+gang");
        assert!(r.gang_freezes > 0);
        // Processor-seconds running over time equal the jobs' work: no job ran while frozen,
        // none twice, none was lost.
        let held = processor_seconds_busy(&r);
        assert!((held - work).abs() < 1e-6 * work, "held {held}, work {work}");
        assert_eq!(r.series.last().map(|s| (s.busy, s.queue)), Some((0, 0)));
        assert!(r.slowdowns.iter().all(|s| *s >= 1.0));
        // The point of time slicing: short jobs no longer wait behind long ones.
        assert!(
            r.mean_wait_s < plain.mean_wait_s,
            "gang {} s, easy {} s",
            r.mean_wait_s,
            plain.mean_wait_s
        );
        assert!(r.mean_bounded_slowdown < plain.mean_bounded_slowdown);
    }

    #[test]
    fn each_gang_freeze_of_a_job_that_ran_costs_it_the_switch_cost() {
        use crate::policy::Gang;
        let model = crate::policy::tests::two_socket(1).remove(0);
        let mut rng = crate::bench::SplitMix::new(9);
        let mut t = 0;
        let jobs: Vec<SimJob> = (0..600)
            .map(|i| {
                t += rng.below(100) as Time;
                let run = 1 + rng.below(400) as Time;
                let procs = 1 + rng.below(24) as u32;
                SimJob { id: i, submit: t, run, estimate: run, procs, malleable: false }
            })
            .collect();
        let work: f64 = jobs.iter().map(|j| (j.run * Time::from(j.procs)) as f64).sum();
        let (slice, cost) = (30, 5);
        let config = PolicyConfig {
            gang: Some(Gang { slice, rows: 2 }),
            switch_cost: cost,
            ..PolicyConfig::plain(QueueOrder::Easy, Strategy::BestFit)
        };
        // A freeze costs the job only if it ran since it started or was thawed.
        let mut running_since: BTreeMap<JobKey, Time> = BTreeMap::new();
        let mut charged = 0;
        let r =
            replay_observed(vec![model; 2], &jobs, config, &mut |_| {}, &mut |now, a| match a {
                Action::Start { job, .. } | Action::Resume { job } => {
                    running_since.insert(*job, now);
                }
                Action::Suspend { job } => {
                    let ran = running_since.remove(job).is_some_and(|since| since < now);
                    charged += Time::from(ran) * cost * Time::from(jobs[*job as usize].procs);
                }
                _ => {}
            })
            .unwrap();
        assert_eq!(r.switch_cost_s, Some(cost));
        assert!(charged > 0 && r.gang_freezes > 0);
        // The processors were busy for the work and every charged switch, no more, no less.
        let held = processor_seconds_busy(&r);
        let want = work + charged as f64;
        assert!((held - want).abs() < 1e-6 * want, "held {held}, want {want}");
        assert_eq!(r.series.last().map(|s| (s.busy, s.queue)), Some((0, 0)));
        // A switch that costs a whole slice leaves no progress: refused, not replayed forever.
        let model = crate::policy::tests::two_socket(1).remove(0);
        for cost in [slice, slice + 1] {
            let config = PolicyConfig {
                gang: Some(Gang { slice, rows: 2 }),
                switch_cost: cost,
                ..PolicyConfig::plain(QueueOrder::Easy, Strategy::BestFit)
            };
            let e = replay(vec![model.clone()], &jobs[..2], config, &mut |_| {}).unwrap_err();
            assert_eq!(e, SimError::SwitchCostNotBelowSlice { cost, slice });
        }
    }

    #[test]
    fn malleable_jobs_start_sooner_and_do_exactly_their_work() {
        use crate::policy::Malleability;
        let model = crate::policy::tests::two_socket(1).remove(0);
        let mut rng = crate::bench::SplitMix::new(17);
        let mut t = 0;
        // About 0.85 of the 64 processors' worth of work arrives.
        let rigid: Vec<SimJob> = (0..3000)
            .map(|i| {
                t += rng.below(60) as Time;
                let run = 1 + rng.below(150) as Time;
                SimJob {
                    id: i,
                    submit: t,
                    run,
                    estimate: run * (1 + rng.below(3) as Time),
                    procs: 1 + rng.below(40) as u32,
                    malleable: false,
                }
            })
            .collect();
        let mut jobs = rigid.clone();
        assert_eq!(mark_malleable(&mut jobs, 1.0), jobs.len());
        let easy = PolicyConfig::plain(QueueOrder::Easy, Strategy::BestFit);
        let plain = replay(vec![model.clone(); 4], &rigid, easy.clone(), &mut |_| {}).unwrap();
        // Marks mean nothing while the configuration has no malleable jobs.
        let marked = replay(vec![model.clone(); 4], &jobs, easy.clone(), &mut |_| {}).unwrap();
        assert_eq!((&marked.waits, marked.resizes, marked.malleable_jobs), (&plain.waits, 0, 0));
        let config = PolicyConfig { malleable: Some(Malleability::default()), ..easy };
        let r = replay(vec![model.clone(); 4], &jobs, config, &mut |_| {}).unwrap();
        assert_eq!(r.policy, "easy+malleable");
        // Jobs of 2 to 16 processors fit one host with a range of more than one size.
        let eligible = jobs.iter().filter(|j| (2..=16).contains(&j.procs)).count();
        assert_eq!(r.malleable_jobs, eligible);
        assert!(r.resizes > eligible, "{} resizes", r.resizes);
        // Processor-seconds held over time are the jobs' work, plus less than a second of its
        // processors for each malleable job (its end rounded up to a whole second).
        let work: f64 = jobs.iter().map(|j| (j.run * Time::from(j.procs)) as f64).sum();
        let rounding: f64 =
            jobs.iter().filter(|j| (2..=16).contains(&j.procs)).map(|j| f64::from(j.procs)).sum();
        let held = processor_seconds_busy(&r);
        assert!(held >= work && held - work < rounding, "held {held}, work {work}");
        assert_eq!(r.series.last().map(|s| (s.busy, s.queue)), Some((0, 0)));
        assert!(r.slowdowns.iter().all(|s| *s >= 1.0));
        // The point: a job starts on what is free instead of waiting for all it asked for.
        assert!(
            r.mean_wait_s < 0.8 * plain.mean_wait_s,
            "malleable {} s, rigid {} s",
            r.mean_wait_s,
            plain.mean_wait_s
        );
    }

    #[test]
    fn the_share_of_malleable_jobs_is_reproducible_and_grows_by_adding_jobs() {
        let mut jobs: Vec<SimJob> = (0..10_000).map(|i| job(i, i, 10, 4)).collect();
        let at = |jobs: &mut Vec<SimJob>, share: f64| {
            let n = mark_malleable(jobs, share);
            (n, jobs.iter().map(|j| j.malleable).collect::<Vec<bool>>())
        };
        let (none, _) = at(&mut jobs, 0.0);
        let (third, a) = at(&mut jobs, 0.3);
        let (half, b) = at(&mut jobs, 0.5);
        let (all, _) = at(&mut jobs, 1.0);
        assert_eq!((none, all), (0, 10_000));
        assert!(
            (2_800..3_200).contains(&third) && (4_800..5_200).contains(&half),
            "{third} {half}"
        );
        assert!(a.iter().zip(&b).all(|(x, y)| !x || *y), "0.3 marks a subset of 0.5");
        assert_eq!(at(&mut jobs, 0.3), (third, a), "the same jobs every time");
    }

    #[test]
    fn trace_lines_are_filtered_and_skipped_with_reasons() {
        let text = "; MaxProcs: 4\n\
1 0 -1 10 2 -1 -1 -1 -1 -1 1 -1 -1 -1 0 -1 -1 -1\n\
2 5 -1 10 8 -1 -1 -1 -1 -1 1 -1 -1 -1 1 -1 -1 -1\n\
3 6 -1 -1 -1 -1 -1 -1 -1 -1 5 -1 -1 -1 1 -1 -1 -1\n\
4 7 -1 10 2 -1 -1 -1 30 -1 0 -1 -1 -1 1 -1 -1 -1\n";
        let trace = swf::parse(text).unwrap();
        let Selected { jobs, skipped, .. } = jobs_from_trace(&trace, &TraceFilter::default(), 4);
        assert_eq!(jobs.iter().map(|j| j.id).collect::<Vec<_>>(), vec![1, 4]);
        assert_eq!(jobs[1].estimate, 30);
        assert_eq!(skipped.get(&Skip::LargerThanCluster), Some(&1));
        assert_eq!(skipped.get(&Skip::NoRunTime), Some(&1));
        // The jobs of a queue left out are counted too.
        let batch = TraceFilter { skip_queues: vec![0], ..TraceFilter::default() };
        let Selected { jobs, skipped, .. } = jobs_from_trace(&trace, &batch, 4);
        assert_eq!(jobs.iter().map(|j| j.id).collect::<Vec<_>>(), vec![4]);
        assert_eq!(skipped.get(&Skip::Queue), Some(&1));
        // A job number again: the later line left out, counted and named.
        let again = format!("{text}4 9 -1 10 1 -1 -1 -1 -1 -1 1 -1 -1 -1 1 -1 -1 -1\n");
        let trace = swf::parse(&again).unwrap();
        let s = jobs_from_trace(&trace, &TraceFilter::default(), 4);
        assert_eq!(s.jobs.iter().map(|j| j.id).collect::<Vec<_>>(), vec![1, 4]);
        assert_eq!((s.skipped.get(&Skip::Duplicate), s.duplicates), (Some(&1), vec![4]));
    }

    /// A stream of NUMA-local-sized jobs (1 to 8 cores) on hosts of two 8-core nodes, at about
    /// `load` of `cores` cores' worth of work, with runs of minutes to hours.
    fn small_jobs(seed: u64, n: i64, cores: u32, load: f64) -> Vec<SimJob> {
        let mut rng = crate::bench::SplitMix::new(seed);
        let mut t = 0;
        let mean_work = 4.5 * 1800.0;
        let gap = (mean_work / (f64::from(cores) * load)) as u64;
        (0..n)
            .map(|i| {
                t += rng.below(2 * gap) as Time;
                let run = 60 + rng.below(3540) as Time;
                SimJob {
                    id: i,
                    submit: t,
                    run,
                    estimate: run * (1 + rng.below(2) as Time),
                    procs: 1 + rng.below(8) as u32,
                    malleable: false,
                }
            })
            .collect()
    }

    #[test]
    fn migration_starts_jobs_refused_on_shape_and_does_exactly_their_work() {
        use crate::policy::Defrag;
        let model = crate::policy::tests::two_socket(1).remove(0);
        let jobs = small_jobs(3, 3000, 32, 0.9);
        let work: f64 = jobs.iter().map(|j| (j.run * Time::from(j.procs)) as f64).sum();
        let local = PolicyConfig {
            numa_local: true,
            ..PolicyConfig::plain(QueueOrder::Easy, Strategy::BestFit)
        };
        let plain = replay(vec![model.clone(); 2], &jobs, local.clone(), &mut |_| {}).unwrap();
        let config = PolicyConfig { defrag: Some(Defrag::default()), ..local.clone() };
        let moved = replay(vec![model.clone(); 2], &jobs, config.clone(), &mut |_| {}).unwrap();
        assert_eq!((plain.policy.as_str(), moved.policy.as_str()), ("easy", "easy+defrag"));
        assert!(plain.refused_on_shape > 100, "the stream fragments: {}", plain.refused_on_shape);
        assert!(moved.moves > 0 && moved.defrag_starts > 0, "{} moves", moved.moves);
        assert!(
            moved.refused_on_shape < plain.refused_on_shape,
            "refused {} with moves, {} without",
            moved.refused_on_shape,
            plain.refused_on_shape
        );
        assert!(
            moved.mean_wait_s < plain.mean_wait_s,
            "mean wait {} s with moves, {} s without",
            moved.mean_wait_s,
            plain.mean_wait_s
        );
        // Free moves: processor-seconds held over time are the jobs' work.
        for r in [&plain, &moved] {
            let held = processor_seconds_busy(r);
            assert!((held - work).abs() < 1e-6 * work, "{}: held {held}, work {work}", r.policy);
            assert_eq!(r.series.last().map(|s| (s.busy, s.queue)), Some((0, 0)));
        }
        // A move that costs 120 s: each moved job holds its processors 120 s longer.
        let costly = PolicyConfig { move_cost: 120, ..config };
        let mut paused = 0f64;
        let r = replay_observed(vec![model; 2], &jobs, costly, &mut |_| {}, &mut |_, a| {
            if let Action::Move { parts, pause, .. } = a {
                let procs: usize = parts.iter().map(|p| p.placement.tasks.len()).sum();
                paused += (*pause * procs as Time) as f64;
            }
        })
        .unwrap();
        assert!(r.moves > 0);
        let held = processor_seconds_busy(&r);
        assert!((held - work - paused).abs() < 1e-6 * work, "held {held}, work {work} + {paused}");
    }

    #[test]
    fn with_a_block_the_head_starts_no_later_when_backfill_would_fragment_its_node() {
        use crate::policy::Reserve;
        let model = crate::policy::tests::two_socket(1).remove(0);
        // Job 1 (5 cores to 100) and job 2 (4 to 1000) leave 3 and 4 cores free in the two
        // nodes; job 3 (7 in one node) is the head, due at 100 when job 1 ends; job 4 (3 cores
        // until 1001) fits in EASY's extra processors and would take node 0's free cores.
        let jobs = [job(1, 0, 100, 5), job(2, 0, 1000, 4), job(3, 1, 100, 7), job(4, 1, 1000, 3)];
        let mut waits = Vec::new();
        for reserve in [None, Some(Reserve::Outlasting)] {
            let config = PolicyConfig {
                numa_local: true,
                reserve,
                ..PolicyConfig::plain(QueueOrder::Easy, Strategy::BestFit)
            };
            let r = replay(vec![model.clone()], &jobs, config, &mut |_| {}).unwrap();
            assert_eq!(r.waits[3], 0, "job 4 is backfilled at once");
            waits.push(r.waits[2]);
            if reserve.is_some() {
                assert_eq!((r.blocks, r.reserved_heads, r.heads_in_block), (1, 1, 1));
            }
        }
        assert_eq!(waits, vec![999, 99], "the head's wait without blocks and with");
    }

    #[test]
    fn in_a_window_no_job_the_pools_do_not_admit_is_placed_on_them() {
        use crate::policy::{PoolSize, Prime};
        use crate::prime::OnOpen;
        let model = crate::policy::tests::two_socket(1).remove(0);
        // Two weeks of jobs, an hour or so apart on average, short and long.
        let mut rng = crate::bench::SplitMix::new(29);
        let mut t = 0;
        let jobs: Vec<SimJob> = (0..1500)
            .map(|i| {
                t += rng.below(1600) as Time;
                let run =
                    if rng.below(2) == 0 { 60 + rng.below(3000) } else { 3600 + rng.below(20_000) };
                SimJob {
                    id: i,
                    submit: t,
                    run: run as Time,
                    estimate: run as Time,
                    procs: 1 + rng.below(16) as u32,
                    malleable: false,
                }
            })
            .collect();
        let pool = crate::policy::start_on_host(
            &model,
            &crate::place::Occupancy::default(),
            &crate::policy::cores_request(4),
            Strategy::BestFit,
        )
        .unwrap()
        .cpus;
        for on_open in [OnOpen::Stay, OnOpen::Migrate] {
            let prime = Prime {
                size: PoolSize::Share(0.25),
                windows: vec!["Mon-Fri 08:00-18:00".parse().unwrap()],
                max_estimate: 3600,
                on_open,
                // 2026-11-23 00:00 in California (UTC-8), a Monday.
                epoch_at_zero: 1_795_392_000 + 8 * 3600,
                utc_offset: -8 * 3600,
            };
            let config = PolicyConfig {
                prime: Some(prime.clone()),
                ..PolicyConfig::plain(QueueOrder::Easy, Strategy::BestFit)
            };
            let (mut inside, mut outside_windows, mut admitted_in) = (0, 0, 0);
            let mut running: BTreeMap<JobKey, Vec<crate::cpuset::CpuSet>> = BTreeMap::new();
            let mut check = |now: Time, a: &Action| {
                let (job, parts) = match a {
                    Action::Start { job, parts } | Action::Move { job, parts, .. } => (job, parts),
                    _ => return,
                };
                let admitted = prime.admits(&JobSpec::rigid(1, jobs[*job as usize].estimate));
                // The parts placed now: all of a start's, the one a move moved.
                let before =
                    running.insert(*job, parts.iter().map(|p| p.placement.cpus.clone()).collect());
                let placed = parts
                    .iter()
                    .enumerate()
                    .filter(|(i, p)| before.as_ref().is_none_or(|b| b[*i] != p.placement.cpus));
                let on_pool = placed.into_iter().any(|(_, p)| p.placement.cpus.intersects(&pool));
                match (prime.open_at(now), admitted) {
                    (true, false) => {
                        assert!(!on_pool, "job {job} placed on a pool at {now} in a window: {a:?}");
                        inside += 1;
                    }
                    (true, true) => admitted_in += usize::from(on_pool),
                    (false, _) => outside_windows += usize::from(on_pool),
                }
            };
            let r = replay_observed(vec![model.clone(); 2], &jobs, config, &mut |_| {}, &mut check)
                .unwrap();
            // Not vacuous: others were placed in windows, admitted jobs used the pools then,
            // and outside the windows the pools' cores went to anyone.
            assert!(
                inside > 100 && admitted_in > 50 && outside_windows > 50,
                "{inside} {admitted_in} {outside_windows}"
            );
            assert!(r.admitted_starts > 300, "{}", r.admitted_starts);
            assert_eq!(r.prime_moves > 0, on_open == OnOpen::Migrate, "{on_open:?}");
            assert_eq!(r.policy, "easy+prime");
        }
    }

    #[test]
    fn partitions_replayed_apart_sum_up_as_one_replay_job_by_job_and_instant_by_instant() {
        // Two partitions of 1 and 2 hosts; jobs 0 and 2 in the first, 1 and 3 in the second.
        let jobs = [job(1, 0, 100, 1), job(2, 5, 50, 2), job(3, 10, 10, 1), job(4, 20, 30, 1)];
        let config = PolicyConfig::plain(QueueOrder::Fcfs, Strategy::BestFit);
        let parts = [vec![0, 2], vec![1, 3]];
        let hosts = [1, 2];
        let partitions: Vec<Partition> = parts
            .iter()
            .zip(hosts)
            .enumerate()
            .map(|(k, (part, n))| {
                let own: Vec<SimJob> = part.iter().map(|&i| jobs[i]).collect();
                let report = replay(flat(n), &own, config.clone(), &mut |_| {}).unwrap();
                Partition { name: format!("p{k}"), report, jobs: part.clone() }
            })
            .collect();
        let whole = merge("fcfs".into(), "best-fit", partitions, &jobs, (3, 3));
        // Job 2 (index 2) waits for job 1 on the one host until 100; job 4 waits for job 2's
        // two hosts until 55.
        assert_eq!(whole.waits, vec![0, 0, 90, 35]);
        assert_eq!(whole.outcomes.iter().map(|o| o.end).collect::<Vec<_>>(), [100, 55, 110, 85]);
        assert_eq!((whole.hosts, whole.processors, whole.jobs), (3, 3, 4));
        assert_eq!(whole.makespan_s, 110.0);
        let work = 100.0 + 100.0 + 10.0 + 30.0;
        assert!((whole.utilization - work / (3.0 * 110.0)).abs() < 1e-12);
        assert_eq!(whole.mean_wait_s, 125.0 / 4.0);
        assert_eq!(whole.partitions.len(), 2);
        assert_eq!(whole.partitions[1].jobs, 2);
        // The series adds the partitions' busy processors, each from its own first submit.
        let busy_at = |t: Time| whole.series.iter().rev().find(|s| s.t <= t).map_or(0, |s| s.busy);
        assert_eq!(
            [busy_at(0), busy_at(5), busy_at(20), busy_at(55), busy_at(100)],
            [1, 3, 3, 2, 1]
        );
        assert_eq!(processor_seconds_busy(&whole), work);
    }

    #[test]
    fn jobs_are_split_by_partition_and_those_of_none_or_too_large_are_counted() {
        let trace = swf::parse(
            "1 0 -1 10 1 -1 -1 1 10 -1 1 -1 -1 -1 1 1 -1 -1\n\
             2 1 -1 10 4 -1 -1 4 10 -1 1 -1 -1 -1 1 1 -1 -1\n\
             3 2 -1 10 1 -1 -1 1 10 -1 1 -1 -1 -1 1 2 -1 -1\n\
             4 3 -1 10 1 -1 -1 1 10 -1 1 -1 -1 -1 1 9 -1 -1\n",
        )
        .unwrap();
        let mut selected = jobs_from_trace(&trace, &TraceFilter::default(), 8);
        let parts = split(&mut selected, &trace, &[2, 8], &|line| match line.partition {
            1 => Some(0),
            2 => Some(1),
            _ => None,
        });
        assert_eq!(parts, vec![vec![0], vec![1]]);
        assert_eq!(selected.jobs.iter().map(|j| j.id).collect::<Vec<_>>(), [1, 3]);
        assert_eq!(selected.lines, [0, 2]);
        assert_eq!(selected.skipped.get(&Skip::LargerThanPartition), Some(&1));
        assert_eq!(selected.skipped.get(&Skip::NoPartition), Some(&1));
    }
}
