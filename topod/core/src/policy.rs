//! The policy core: the decisions topo makes over time, as a pure function of state and events.
//!
//! ## The model
//!
//! The state is a set of hosts (each its [`HostModel`] and the [`Occupancy`] its running jobs
//! leave), the jobs waiting in order of submission, the running jobs with their parts and
//! estimated ends, and the time the caller says it is. A driver hands [`PolicyCore::step`] the
//! events of one instant (submit, end, tick) and gets back the [`Action`]s to carry out: start
//! job J on these hosts with these CPUs (the issues that follow add suspend, resume, resize,
//! migrate and reserve). The core records its own decisions in its state as it makes them, so
//! the next step sees them; the driver applies them to the world:
//!
//! - `topoctl simulate` (`crate::sim`) applies them to its model of N hosts, and turns each start
//!   into an end event one run time later;
//! - `topod` applies a start to a real cgroup. On a live host the batch system is the queue: it
//!   decides *which* job runs *where*, so topod enters the core at the host decision
//!   ([`start_on_host`]), the same function the cluster steps call for every part of every job.
//!
//! Nothing here reads a clock, sleeps or does I/O: times are the caller's (seconds, any origin).
//!
//! ## Cluster order
//!
//! [`QueueOrder::Fcfs`]: jobs start in submission order; the first that does not fit blocks all
//! behind it. [`QueueOrder::Easy`] (EASY backfilling, Lifka 1995; Mu'alem and Feitelson 2001):
//! when the queue's head does not fit, it gets a reservation at the earliest time enough
//! processors are free by the running jobs' *estimated* ends (the shadow time); a later job may
//! start now if it fits now and either ends by the shadow time (by its estimate) or uses no more
//! than the processors the head will not need then (the extra processors, which it then uses
//! up). Jobs are considered in queue order, once per step.
//!
//! ## Processors, hosts and CPUs
//!
//! A job asks for a count of processors; a processor is one whole core (on a machine without
//! SMT, one PU), so no two jobs share a core. The core picks hosts as a batch system packing
//! jobs would: a job that fits one host goes to the host with the fewest free cores that holds
//! it; a larger job takes whole free hosts, the fullest-free first, and puts its remainder on
//! the tightest host that holds it. On each host the job's part is placed by [`place::place`]
//! with the configured strategy (`topod`'s own code), which chooses the CPUs and measures how
//! local they are.

use crate::cpuset::CpuSet;
use crate::place::{self, HostModel, Occupancy, PlaceError, Placement, Strategy};
use crate::request::{Level, Request};
use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;

/// Time in seconds, from the driver's origin.
pub type Time = i64;

/// A job, as the driver numbers it: a small dense integer (an index into the driver's table).
pub type JobKey = u32;

/// A host, by its index in the core's host list.
pub type HostId = u32;

/// The cluster-level order jobs start in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QueueOrder {
    /// First come, first served: the first job that does not fit blocks the queue.
    Fcfs,
    /// EASY backfilling: a reservation for the queue's head, later jobs start around it.
    Easy,
}

impl QueueOrder {
    /// The name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            QueueOrder::Fcfs => "fcfs",
            QueueOrder::Easy => "easy",
        }
    }
}

impl std::str::FromStr for QueueOrder {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fcfs" => Ok(QueueOrder::Fcfs),
            "easy" => Ok(QueueOrder::Easy),
            other => Err(format!("unknown policy {other:?}: the policies are fcfs and easy")),
        }
    }
}

/// How the core decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyConfig {
    /// Cluster order.
    pub order: QueueOrder,
    /// The strategy that chooses CPUs on a host.
    pub strategy: Strategy,
}

/// What a job asks of the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobSpec {
    /// Processors (whole cores).
    pub procs: u32,
    /// Estimated run time, seconds: what backfilling plans with.
    pub estimate: Time,
}

/// Something that happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A job was submitted.
    Submit {
        /// The job.
        job: JobKey,
        /// What it asks for.
        spec: JobSpec,
    },
    /// A running job ended (or was cancelled while waiting).
    End {
        /// The job.
        job: JobKey,
    },
    /// Time passed; nothing else happened.
    Tick,
}

/// One host's share of a started job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// The host.
    pub host: HostId,
    /// Whole cores it holds there.
    pub cores: u32,
    /// The placement on it: CPUs, tasks, memory nodes, what it fences, its metrics.
    pub placement: Arc<Placement>,
}

/// What the driver must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Start the job with these parts.
    Start {
        /// The job.
        job: JobKey,
        /// Its parts, one per host.
        parts: Vec<Part>,
    },
}

/// Why the core cannot take an event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// The job asks for more processors than the whole cluster has.
    #[error("job {job} asks for {procs} processors; the cluster has {total}")]
    LargerThanCluster {
        /// The job.
        job: JobKey,
        /// What it asks.
        procs: u32,
        /// What the cluster has.
        total: u64,
    },
    /// The job asks for no processor.
    #[error("job {job} asks for no processor")]
    NoProcessors {
        /// The job.
        job: JobKey,
    },
    /// A submit for a job already known.
    #[error("job {job} was submitted twice")]
    Duplicate {
        /// The job.
        job: JobKey,
    },
    /// An end for a job the core does not know.
    #[error("job {job} ended but is neither running nor waiting")]
    UnknownJob {
        /// The job.
        job: JobKey,
    },
}

/// The host decision: where `request` goes on one host, by `strategy`. `topod` allocates
/// through this; the cluster steps place every part of every job through it.
pub fn start_on_host(
    model: &HostModel,
    occupancy: &Occupancy,
    request: &Request,
    strategy: Strategy,
) -> Result<Placement, PlaceError> {
    place::place(model, occupancy, request, strategy)
}

/// The request for `cores` whole cores on one host, one task each (an MPI rank per processor).
pub fn cores_request(cores: u32) -> Request {
    Request { tasks: Some(cores), unit: Level::Core, ..Request::default() }
}

#[derive(Debug)]
struct HostState {
    model: Arc<HostModel>,
    occupancy: Occupancy,
    /// Whole cores, all allocatable.
    cores: u32,
    free: u32,
    /// The placement of a job taking the whole empty host (one answer; computed once per model).
    whole: Option<Arc<Placement>>,
}

#[derive(Debug)]
struct Running {
    parts: Vec<Part>,
    procs: u32,
    estimated_end: Time,
}

#[derive(Debug)]
enum Slot {
    Unknown,
    Waiting(JobSpec),
    Running(Running),
}

/// The policy core's state and its decisions. See the module documentation.
#[derive(Debug)]
pub struct PolicyCore {
    config: PolicyConfig,
    hosts: Vec<HostState>,
    /// `by_free[f]`: hosts with exactly `f` free cores, by id.
    by_free: Vec<BTreeSet<HostId>>,
    total: u64,
    free: u64,
    jobs: Vec<Slot>,
    queue: VecDeque<JobKey>,
    /// Running jobs by estimated end.
    ends: BTreeSet<(Time, JobKey)>,
    now: Time,
}

impl PolicyCore {
    /// A core over `hosts` (models may be shared between hosts of one kind).
    pub fn new(hosts: Vec<Arc<HostModel>>, config: PolicyConfig) -> Self {
        let mut whole_cache: Vec<(*const HostModel, Option<Arc<Placement>>)> = Vec::new();
        let mut states = Vec::with_capacity(hosts.len());
        for model in hosts {
            let cores =
                model.cores.iter().filter(|c| c.is_subset(&model.allocatable)).count() as u32;
            let key = Arc::as_ptr(&model);
            let whole = match whole_cache.iter().find(|(k, _)| *k == key) {
                Some((_, w)) => w.clone(),
                None => {
                    let w = (cores > 0)
                        .then(|| {
                            start_on_host(
                                &model,
                                &Occupancy::default(),
                                &cores_request(cores),
                                config.strategy,
                            )
                            .ok()
                        })
                        .flatten()
                        .map(Arc::new);
                    whole_cache.push((key, w.clone()));
                    w
                }
            };
            states.push(HostState {
                model,
                occupancy: Occupancy::default(),
                cores,
                free: cores,
                whole,
            });
        }
        let max = states.iter().map(|h| h.cores).max().unwrap_or(0) as usize;
        let mut by_free = vec![BTreeSet::new(); max + 1];
        for (i, h) in states.iter().enumerate() {
            by_free[h.free as usize].insert(i as HostId);
        }
        let total = states.iter().map(|h| u64::from(h.cores)).sum();
        PolicyCore {
            config,
            hosts: states,
            by_free,
            total,
            free: total,
            jobs: Vec::new(),
            queue: VecDeque::new(),
            ends: BTreeSet::new(),
            now: Time::MIN,
        }
    }

    /// Processors (whole cores) in the cluster.
    pub fn total_procs(&self) -> u64 {
        self.total
    }

    /// Processors free now.
    pub fn free_procs(&self) -> u64 {
        self.free
    }

    /// Jobs waiting.
    pub fn queue_len(&self) -> usize {
        self.queue.len()
    }

    /// Jobs running.
    pub fn running_len(&self) -> usize {
        self.ends.len()
    }

    /// The occupancy of a host.
    pub fn occupancy(&self, host: HostId) -> &Occupancy {
        &self.hosts[host as usize].occupancy
    }

    /// Whether `spec` could ever start here (checks a submit before it is made).
    pub fn admissible(&self, job: JobKey, spec: JobSpec) -> Result<(), PolicyError> {
        if spec.procs == 0 {
            return Err(PolicyError::NoProcessors { job });
        }
        if u64::from(spec.procs) > self.total {
            return Err(PolicyError::LargerThanCluster {
                job,
                procs: spec.procs,
                total: self.total,
            });
        }
        Ok(())
    }

    /// Applies the events of the instant `now` (all of them before deciding anything, so that
    /// two jobs ending at once free their processors together), then decides. Returns what to
    /// do. An event the core cannot take is refused with nothing changed by it; the events
    /// before it in the batch stay applied, and no decision is made.
    pub fn step(
        &mut self,
        now: Time,
        events: impl IntoIterator<Item = Event>,
    ) -> Result<Vec<Action>, PolicyError> {
        self.now = self.now.max(now);
        for event in events {
            match event {
                Event::Submit { job, spec } => self.submit(job, spec)?,
                Event::End { job } => self.end(job)?,
                Event::Tick => {}
            }
        }
        let mut actions = Vec::new();
        self.schedule(&mut actions);
        Ok(actions)
    }

    fn slot(&mut self, job: JobKey) -> &mut Slot {
        let i = job as usize;
        if i >= self.jobs.len() {
            self.jobs.resize_with(i + 1, || Slot::Unknown);
        }
        &mut self.jobs[i]
    }

    fn submit(&mut self, job: JobKey, spec: JobSpec) -> Result<(), PolicyError> {
        self.admissible(job, spec)?;
        let slot = self.slot(job);
        if !matches!(slot, Slot::Unknown) {
            return Err(PolicyError::Duplicate { job });
        }
        *slot = Slot::Waiting(spec);
        self.queue.push_back(job);
        Ok(())
    }

    fn end(&mut self, job: JobKey) -> Result<(), PolicyError> {
        let slot = self.jobs.get_mut(job as usize).ok_or(PolicyError::UnknownJob { job })?;
        match std::mem::replace(slot, Slot::Unknown) {
            Slot::Running(r) => {
                self.ends.remove(&(r.estimated_end, job));
                self.give_back(&r.parts);
                self.free += u64::from(r.procs);
                Ok(())
            }
            Slot::Waiting(_) => {
                // Cancelled while waiting.
                self.queue.retain(|j| *j != job);
                Ok(())
            }
            Slot::Unknown => Err(PolicyError::UnknownJob { job }),
        }
    }

    fn spec(&self, job: JobKey) -> JobSpec {
        match &self.jobs[job as usize] {
            Slot::Waiting(spec) => *spec,
            _ => unreachable!("only waiting jobs are queued"),
        }
    }

    fn schedule(&mut self, actions: &mut Vec<Action>) {
        while let Some(&head) = self.queue.front() {
            let spec = self.spec(head);
            if !self.try_start(head, spec, actions) {
                break;
            }
            self.queue.pop_front();
        }
        if self.config.order != QueueOrder::Easy || self.queue.len() < 2 || self.free == 0 {
            return;
        }
        let head = self.spec(self.queue[0]);
        let (shadow, mut extra) = self.shadow(head.procs);
        let mut i = 1;
        while i < self.queue.len() && self.free > 0 {
            let job = self.queue[i];
            let spec = self.spec(job);
            let ends_in_time = self.now.saturating_add(spec.estimate) <= shadow;
            let fits_beside = u64::from(spec.procs) <= extra;
            if u64::from(spec.procs) <= self.free
                && (ends_in_time || fits_beside)
                && self.try_start(job, spec, actions)
            {
                if !ends_in_time {
                    extra -= u64::from(spec.procs);
                }
                self.queue.remove(i);
            } else {
                i += 1;
            }
        }
    }

    /// The head's reservation: the earliest estimated end by which `procs` are free, and how
    /// many processors beyond its need are free then.
    fn shadow(&self, procs: u32) -> (Time, u64) {
        let need = u64::from(procs);
        let mut free = self.free;
        for &(end, job) in &self.ends {
            if let Slot::Running(r) = &self.jobs[job as usize] {
                free += u64::from(r.procs);
            }
            if free >= need {
                return (end, free - need);
            }
        }
        // Unreachable for an admissible job (all running jobs ending frees the whole cluster).
        (Time::MAX, 0)
    }

    /// Starts `job` now if hosts and CPUs can be found for it.
    fn try_start(&mut self, job: JobKey, spec: JobSpec, actions: &mut Vec<Action>) -> bool {
        if u64::from(spec.procs) > self.free {
            return false;
        }
        let Some(choice) = self.choose_hosts(spec.procs) else { return false };
        let mut parts = Vec::with_capacity(choice.len());
        for (host, cores) in choice {
            let h = &self.hosts[host as usize];
            let placement = match (&h.whole, cores == h.cores && h.free == h.cores) {
                (Some(whole), true) => Arc::clone(whole),
                _ => match start_on_host(
                    &h.model,
                    &h.occupancy,
                    &cores_request(cores),
                    self.config.strategy,
                ) {
                    Ok(p) => Arc::new(p),
                    Err(_) => {
                        // Counts said yes, the host said no (a strategy that cannot place a
                        // plain count here): undo what this job took and leave it waiting.
                        self.give_back(&parts);
                        return false;
                    }
                },
            };
            self.take(host, cores, &placement);
            parts.push(Part { host, cores, placement });
        }
        self.free -= u64::from(spec.procs);
        let estimated_end = self.now.saturating_add(spec.estimate);
        self.ends.insert((estimated_end, job));
        *self.slot(job) =
            Slot::Running(Running { parts: parts.clone(), procs: spec.procs, estimated_end });
        actions.push(Action::Start { job, parts });
        true
    }

    fn take(&mut self, host: HostId, cores: u32, placement: &Placement) {
        let h = &mut self.hosts[host as usize];
        h.occupancy.held.union_with(&placement.cpus);
        h.occupancy.fenced.union_with(&placement.fenced);
        self.by_free[h.free as usize].remove(&host);
        h.free -= cores;
        self.by_free[h.free as usize].insert(host);
    }

    fn give_back(&mut self, parts: &[Part]) {
        for part in parts {
            let h = &mut self.hosts[part.host as usize];
            h.occupancy.held.difference_with(&part.placement.cpus);
            h.occupancy.fenced.difference_with(&part.placement.fenced);
            self.by_free[h.free as usize].remove(&part.host);
            h.free += part.cores;
            self.by_free[h.free as usize].insert(part.host);
        }
    }

    /// Hosts and core counts for a job of `procs` (see the module documentation), or `None`
    /// when the free cores do not add up.
    fn choose_hosts(&self, procs: u32) -> Option<Vec<(HostId, u32)>> {
        let mut remaining = procs;
        let mut chosen = Vec::new();
        for f in (1..self.by_free.len()).rev() {
            for &host in &self.by_free[f] {
                if remaining == 0 {
                    return Some(chosen);
                }
                if f as u32 <= remaining {
                    chosen.push((host, f as u32));
                    remaining -= f as u32;
                } else {
                    // This host could hold the rest; the tightest one that can goes instead.
                    // (Hosts of this bucket before it may be chosen already; it is not.)
                    let tightest = (remaining as usize..f)
                        .find_map(|g| self.by_free[g].first().copied())
                        .unwrap_or(host);
                    chosen.push((tightest, remaining));
                    return Some(chosen);
                }
            }
            if remaining == 0 {
                return Some(chosen);
            }
        }
        (remaining == 0).then_some(chosen)
    }
}

/// Every CPU the parts of a job hold, per host, for checks.
pub fn cpus_by_host(parts: &[Part]) -> Vec<(HostId, CpuSet)> {
    parts.iter().map(|p| (p.host, p.placement.cpus.clone())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::{SyntheticShape, Topology};

    fn flat(n: usize, cores: u32) -> Vec<Arc<HostModel>> {
        let model = Arc::new(HostModel::new(&Topology::flat(cores), &CpuSet::new()).unwrap());
        vec![model; n]
    }

    fn two_socket(n: usize) -> Vec<Arc<HostModel>> {
        let topo = Topology::synthetic(SyntheticShape {
            packages: 2,
            numa_per_package: 1,
            l3_per_numa: 1,
            cores_per_l3: 8,
            threads_per_core: 2,
        });
        let model = Arc::new(HostModel::new(&topo, &CpuSet::new()).unwrap());
        vec![model; n]
    }

    fn core(order: QueueOrder, hosts: Vec<Arc<HostModel>>) -> PolicyCore {
        PolicyCore::new(hosts, PolicyConfig { order, strategy: Strategy::BestFit })
    }

    fn submit(job: JobKey, procs: u32, estimate: Time) -> Event {
        Event::Submit { job, spec: JobSpec { procs, estimate } }
    }

    fn started(actions: &[Action]) -> Vec<JobKey> {
        actions.iter().map(|Action::Start { job, .. }| *job).collect()
    }

    #[test]
    fn fcfs_blocks_behind_the_head_and_easy_backfills_around_it() {
        for (order, expect) in [(QueueOrder::Fcfs, vec![]), (QueueOrder::Easy, vec![2])] {
            let mut c = core(order, flat(4, 1));
            assert_eq!(started(&c.step(0, [submit(0, 3, 100)]).unwrap()), vec![0]);
            // Job 1 needs all four: it waits for job 0 (estimated end 100).
            // Job 2 (one processor, 50 s) ends before then: EASY starts it, FCFS does not.
            let a = c.step(10, [submit(1, 4, 100), submit(2, 1, 50)]).unwrap();
            assert_eq!(started(&a), expect, "{order:?}");
            // Job 3 would run past the shadow time and there is no extra processor: never now.
            let a = c.step(11, [submit(3, 1, 500)]).unwrap();
            assert!(started(&a).is_empty(), "{order:?}");
        }
    }

    #[test]
    fn easy_lets_a_long_job_use_the_processors_the_head_does_not_need() {
        let mut c = core(QueueOrder::Easy, flat(4, 1));
        c.step(0, [submit(0, 2, 100)]).unwrap();
        // Head needs 3: at t=100 four are free, one extra. A long one-processor job may take it.
        let a = c.step(1, [submit(1, 3, 10), submit(2, 1, 10_000), submit(3, 1, 10_000)]).unwrap();
        assert_eq!(started(&a), vec![2]);
        // The head starts on time when job 0 ends.
        let a = c.step(100, [Event::End { job: 0 }]).unwrap();
        assert_eq!(started(&a), vec![1]);
    }

    #[test]
    fn ends_at_one_instant_free_together_before_deciding() {
        let mut c = core(QueueOrder::Easy, flat(4, 1));
        c.step(0, [submit(0, 2, 100), submit(1, 2, 100)]).unwrap();
        c.step(1, [submit(2, 4, 100), submit(3, 2, 1_000)]).unwrap();
        // Both end at 100: the head (4) must start, not job 3 after the first end.
        let a = c.step(100, [Event::End { job: 0 }, Event::End { job: 1 }]).unwrap();
        assert_eq!(started(&a), vec![2]);
    }

    #[test]
    fn a_small_job_goes_to_the_tightest_host_and_a_large_one_spans_whole_hosts() {
        let mut c = core(QueueOrder::Fcfs, two_socket(3));
        // 16 cores per host. 10 on host 0, then 4 goes to host 0 (6 free), not an empty host.
        let a = c.step(0, [submit(0, 10, 100), submit(1, 4, 100)]).unwrap();
        let hosts: Vec<Vec<HostId>> = a
            .iter()
            .map(|Action::Start { parts, .. }| parts.iter().map(|p| p.host).collect())
            .collect();
        assert_eq!(hosts, vec![vec![0], vec![0]]);
        // 20 = one whole free host + 4 on the tightest (host 0 has 2 left: no; a whole host).
        let a = c.step(1, [submit(2, 20, 100)]).unwrap();
        let Action::Start { parts, .. } = &a[0];
        let cores: Vec<(HostId, usize)> =
            parts.iter().map(|p| (p.host, p.placement.tasks.len())).collect();
        assert_eq!(cores, vec![(1, 16), (2, 4)]);
        // Whole cores, no core shared between jobs, and the 4-core part kept in one socket.
        let occ = c.occupancy(2);
        assert_eq!(occ.held.len(), 8);
        assert!(parts[1].placement.metrics.numa_optimal());
        assert_eq!(c.free_procs(), 48 - 34);
    }

    #[test]
    fn no_cpu_is_given_twice_and_everything_comes_back() {
        let mut c = core(QueueOrder::Easy, two_socket(4));
        let mut held: std::collections::HashMap<JobKey, Vec<(HostId, CpuSet)>> = Default::default();
        let mut rng = crate::bench::SplitMix::new(7);
        let mut t = 0;
        for job in 0..400u32 {
            t += 1;
            let mut events = vec![submit(job, 1 + rng.below(40) as u32, 1 + rng.below(50) as i64)];
            // End a random running job now and then.
            if let Some(&victim) = held.keys().min_by_key(|k| (**k).wrapping_mul(2654435761) ^ job)
            {
                if rng.below(2) == 0 {
                    events.push(Event::End { job: victim });
                    held.remove(&victim);
                }
            }
            for Action::Start { job, parts } in c.step(t, events).unwrap() {
                held.insert(job, cpus_by_host(&parts));
            }
            let mut per_host: std::collections::HashMap<HostId, CpuSet> = Default::default();
            for parts in held.values() {
                for (h, cpus) in parts {
                    let seen = per_host.entry(*h).or_default();
                    assert!(!seen.intersects(cpus), "a CPU given twice on host {h}");
                    seen.union_with(cpus);
                }
            }
            for h in 0..4 {
                assert_eq!(per_host.get(&h).cloned().unwrap_or_default(), c.occupancy(h).held);
            }
        }
        let running: Vec<JobKey> = held.keys().copied().collect();
        let ends = running.iter().map(|&job| Event::End { job });
        let mut starts = c.step(t + 1, ends).unwrap();
        // Drain the queue: end whatever starts until nothing waits.
        while !starts.is_empty() {
            t += 1;
            let ends: Vec<Event> =
                starts.iter().map(|Action::Start { job, .. }| Event::End { job: *job }).collect();
            starts = c.step(t + 1, ends).unwrap();
        }
        assert_eq!(c.queue_len(), 0);
        assert_eq!(c.free_procs(), c.total_procs());
        assert!((0..4).all(|h| c.occupancy(h).held.is_empty()));
    }

    #[test]
    fn bad_events_are_refused_and_change_nothing() {
        let mut c = core(QueueOrder::Fcfs, flat(2, 1));
        assert_eq!(
            c.step(0, [submit(0, 3, 1)]).unwrap_err(),
            PolicyError::LargerThanCluster { job: 0, procs: 3, total: 2 }
        );
        assert_eq!(c.step(0, [submit(0, 0, 1)]).unwrap_err(), PolicyError::NoProcessors { job: 0 });
        assert_eq!(
            c.step(0, [Event::End { job: 5 }]).unwrap_err(),
            PolicyError::UnknownJob { job: 5 }
        );
        c.step(0, [submit(1, 1, 1)]).unwrap();
        assert_eq!(c.step(0, [submit(1, 1, 1)]).unwrap_err(), PolicyError::Duplicate { job: 1 });
        assert_eq!(c.free_procs(), 1);
        // Cancelled while waiting: leaves the queue.
        c.step(1, [submit(2, 2, 5)]).unwrap();
        assert_eq!(c.queue_len(), 1);
        c.step(2, [Event::End { job: 2 }]).unwrap();
        assert_eq!(c.queue_len(), 0);
    }
}
