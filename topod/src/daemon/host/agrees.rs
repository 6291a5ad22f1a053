//! The differential test of the time rules: one event script driven through the cluster policy
//! core (`topo_core::policy::PolicyCore`, what `topoctl simulate` runs) on one host and through
//! [`Host`] on a fake cgroup file system, with a first-come-first-served batch system in front
//! of it (what an LSF or PBS queue does: the first waiting job is asked for, with the right to
//! preempt, until one does not fit). After every instant both must hold the same jobs running,
//! on the same CPUs, and the same jobs suspended.
//!
//! The scripts cover submits, ends (a job ends when its estimate has run, counting from its
//! start and resumes), the passing of time, and jobs' owners suspending and resuming them
//! (`topoctl suspend` and `resume` as the job's user). Each script runs under one rule set:
//! preemption with every job preemptible; gang slicing (with preemption in every other script:
//! gang jobs then neither preempt nor are preempted); equipartition of malleable jobs; or
//! migration (a job no larger than a NUMA node asks for one, and one that does not fit although
//! enough CPUs are free moves running jobs). Both drivers must also give each owner's request
//! the same answer (carried out, or refused for the same reason). The owner's dodge of issue 30
//! (suspend and resume to reset preemption's counters) is a scripted case.
//! topod's side runs its freezes and thaws at once, or queues them and runs them after, as the
//! server does without the host lock (asking a preempting allocate again).
//! `AGREE_SEEDS=N` runs N random scripts per rule set and host (15 by default; 100 passed when
//! this was written), `AGREE_DEBUG=1` prints both drivers' views at every instant.
//!
//! Found by it: the core resumed a job suspended by preemption onto CPUs a job its owner had
//! suspended (after lending them) holds, which topod does not; the core now decides as topod.
//! Found by it before, and fixed in both drivers' shared code: `victims_on_host` kept victims the job
//! did not need; the core counted the CPUs held for suspended jobs as free when choosing victims
//! and borrowed them where other CPUs were free; topod chose victims without the CPUs the job
//! may borrow, and kept a victim frozen on free CPUs its running preemptor never took.

use super::tests::{run_queued, small_topology, two_nodes_of_four};
use super::*;
use crate::cgroup::fake::Fake;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicI64, Ordering};
use topo_core::bench::SplitMix;
use topo_core::policy::{
    self, Action, Event, JobKey, JobSpec, PolicyConfig, PolicyCore, QueueOrder, Refusal,
};

/// The uid of every job's owner in the scripts.
const OWNER: u32 = 1_000;

/// The time rule a script runs under, in both drivers.
#[derive(Debug, Clone, Copy)]
enum Rules {
    /// Preemption, every job preemptible.
    Preempt(policy::Preempt),
    /// Gang time slicing, every job gang-scheduled: the batch system in front of topod takes
    /// the first row where the job fits, as the core does, and tells topod that row. With
    /// `Some` preemption rules too, preemption is on and every job asks to preempt and may be
    /// preempted, as a site running both would configure it: a gang job neither preempts nor
    /// is preempted (it waits for a row), in both drivers.
    Gang(policy::Gang, Option<policy::Preempt>),
    /// Equipartition of the CPUs rigid jobs leave among the malleable jobs (every even-numbered
    /// job malleable, in the range `Malleability` gives it: `*min-max` for topod).
    Malleable(policy::Malleability),
    /// Defragmenting migration: a job that does not fit although enough CPUs are free moves
    /// running jobs (those its timers let move) to make room.
    Defrag(policy::Defrag),
}

impl Rules {
    /// The task range the job asks for: `(min, max)`, equal for a rigid job.
    fn range(&self, job: JobKey, cores: u32) -> (u32, u32) {
        match self {
            Rules::Malleable(m) if job % 2 == 0 => m.range(cores),
            _ => (cores, cores),
        }
    }
}

/// One job of a script.
#[derive(Debug, Clone, Copy)]
struct ScriptJob {
    submit: i64,
    cores: u32,
    estimate: i64,
}

/// `prepared` as a job of the script asks it where preemption is on: it may preempt and be
/// preempted, with its submission time and estimate.
fn asks_to_preempt(prepared: &mut Prepared, j: &ScriptJob) {
    PreemptAsk::apply(
        PreemptAsk {
            preempt: true,
            preemptible: true,
            submitted_at: Some(EPOCH + j.submit),
            estimate_s: Some(j.estimate as u64),
        },
        prepared,
    );
}

/// Where a job is, as one driver has it.
#[derive(Debug, Default, PartialEq, Eq)]
struct View {
    running: BTreeMap<JobKey, CpuSet>,
    suspended: BTreeSet<JobKey>,
}

/// Seconds from the script's origin to the host's clock.
const EPOCH: i64 = 1_700_000_000;

fn name(job: JobKey) -> String {
    format!("j{job:04}")
}

fn key(name: &str) -> JobKey {
    name[1..].parse().unwrap()
}

/// The host's side: topod, and a FCFS queue in front of it.
struct TopodDriver {
    host: Host,
    clock: Arc<AtomicI64>,
    queue: VecDeque<JobKey>,
    jobs: Vec<ScriptJob>,
    /// Whether the host queues its freezes and thaws, as under the server (which runs them
    /// without the lock, then asks a preempting allocate again), or runs them at once.
    deferred: bool,
    rules: Rules,
}

impl TopodDriver {
    fn new(topo: &Topology, rules: Rules, jobs: &[ScriptJob], deferred: bool) -> Self {
        let fake = Fake::new(topo.allowed.clone(), topo.allowed_mems.clone());
        let mut host =
            Host::new(topo.clone(), CpuSet::new(), Box::new(fake), None, Strategy::BestFit)
                .unwrap();
        match rules {
            Rules::Preempt(rules) => host.set_preempt(Some(rules)),
            Rules::Gang(gang, preempt) => {
                host.set_gang(Some(GangConfig { gang, all_jobs: true, prime_queues: Vec::new() }));
                host.set_preempt(preempt);
            }
            Rules::Malleable(_) => host.set_equipartition(true),
            Rules::Defrag(defrag) => host.set_defrag(Some(defrag)),
        }
        if deferred {
            host.defer_kernel_waits();
        }
        let clock = Arc::new(AtomicI64::new(EPOCH));
        let c = clock.clone();
        host.set_clock(Arc::new(move || {
            std::time::UNIX_EPOCH + Duration::from_secs(c.load(Ordering::SeqCst) as u64)
        }));
        TopodDriver { host, clock, queue: VecDeque::new(), jobs: jobs.to_vec(), deferred, rules }
    }

    /// Applies the instant's events, then asks for the queue's jobs. Returns topod's answer to
    /// each owner's suspend or resume, in order: `None` when it was carried out, else why not.
    fn step(&mut self, now: i64, events: &[Event]) -> Vec<Option<Refusal>> {
        self.clock.store(EPOCH + now, Ordering::SeqCst);
        let mut answers = Vec::new();
        for e in events {
            match *e {
                Event::End { job } => {
                    if self.queue.contains(&job) {
                        self.queue.retain(|j| *j != job);
                    } else {
                        self.host.release(&name(job)).unwrap();
                        run_queued(&mut self.host);
                    }
                }
                Event::Submit { job, .. } => self.queue.push_back(job),
                Event::Tick => {}
                Event::OwnerSuspend { job } => answers.push(self.owner_suspends(&name(job))),
                Event::OwnerResume { job } => answers.push(self.owner_resumes(&name(job))),
            }
        }
        // topod's own tick resumes what it can and switches gang slices; then the queue's head
        // is asked for, with the right to preempt, until one does not fit or one preempted (the
        // core preempts once per instant).
        self.host.resume_preempted();
        run_queued(&mut self.host);
        if let Rules::Malleable(_) = self.rules {
            // FCFS: the queue's head, malleable or not, until one does not fit.
            while let Some(&head) = self.queue.front() {
                let j = self.jobs[head as usize];
                let (min, max) = self.rules.range(head, j.cores);
                let request = Request {
                    tasks: Some(min),
                    tasks_max: (min < max).then_some(max),
                    ..policy::cores_request(min)
                };
                let prepared = prepare(&self.host.topo, &request.to_string(), None, None).unwrap();
                match self.host.allocate_prepared(&name(head), &prepared, None, None) {
                    Ok(_) => {
                        run_queued(&mut self.host);
                        self.queue.pop_front();
                    }
                    Err(HostError::DoesNotFit { .. }) => break,
                    Err(e) => panic!("job {head}: {e}"),
                }
            }
            return answers;
        }
        if let Some(gang) = self.host.gang().map(|g| g.gang) {
            self.host.gang_switch(self.host.now());
            run_queued(&mut self.host);
            while let Some(&head) = self.queue.front() {
                if !self.start_in_a_row(head, gang.rows) {
                    break;
                }
                self.queue.pop_front();
            }
            self.host.gang_switch(self.host.now());
            run_queued(&mut self.host);
            return answers;
        }
        while let Some(&head) = self.queue.front() {
            let j = self.jobs[head as usize];
            let text = self.request_of(j.cores).to_string();
            let mut prepared = prepare(&self.host.topo, &text, None, None).unwrap();
            asks_to_preempt(&mut prepared, &j);
            let suspended_before = self.host.ledger().suspended_jobs().count();
            let mut allocated = self.host.allocate_prepared(&name(head), &prepared, None, None);
            if let Err(HostError::PreemptionUnderWay(_)) = allocated {
                assert!(self.deferred, "only a deferring host answers so");
                run_queued(&mut self.host);
                allocated = self.host.allocate_prepared(&name(head), &prepared, None, None);
                self.host.abandon_preemption(&name(head));
                run_queued(&mut self.host);
            }
            match allocated {
                Ok(_) => {
                    self.queue.pop_front();
                    if self.host.ledger().suspended_jobs().count() > suspended_before {
                        break;
                    }
                }
                Err(HostError::DoesNotFit { .. }) => break,
                Err(e) => panic!("job {head}: {e}"),
            }
        }
        answers
    }

    /// The request a job of `cores` cores asks for: under migration, one NUMA node when it fits
    /// in one (the core's `numa_local`), else any cores.
    fn request_of(&self, cores: u32) -> Request {
        let model = &self.host.model;
        let numa_cores = model
            .numa
            .iter()
            .map(|n| model.cores.iter().filter(|c| c.is_subset(n)).count() as u32)
            .max()
            .unwrap_or(0);
        match self.rules {
            Rules::Defrag(_) if cores <= numa_cores => policy::numa_request(cores),
            _ => policy::cores_request(cores),
        }
    }

    /// Asks topod for `head` in each gang row in turn, as a batch system that chose the first
    /// row with room would; whether one took it.
    fn start_in_a_row(&mut self, head: JobKey, rows: u32) -> bool {
        let j = self.jobs[head as usize];
        let text = policy::cores_request(j.cores).to_string();
        let mut prepared = prepare(&self.host.topo, &text, None, None).unwrap();
        if let Rules::Gang(_, Some(_)) = self.rules {
            // Asking to preempt, as every job does where preemption is on.
            asks_to_preempt(&mut prepared, &j);
        }
        for row in 0..rows {
            prepared.gang = GangAsk { gang: Some(true), row: Some(row), ..GangAsk::default() };
            match self.host.allocate_prepared(&name(head), &prepared, None, None) {
                Ok(_) => {
                    run_queued(&mut self.host);
                    return true;
                }
                Err(HostError::DoesNotFit { .. }) => {}
                Err(e) => panic!("job {head} in row {row}: {e}"),
            }
        }
        false
    }

    /// The job's owner suspends it, as the server lets them (`Op::Suspend` for a peer that is
    /// not an administrator): not a suspension by the policy, which is not theirs to take over.
    fn owner_suspends(&mut self, job: &str) -> Option<Refusal> {
        // (The server forbids taking over the policy's suspension; any other is the owner's.)
        if self.host.ledger().is_suspended(job) {
            return Some(Refusal::NotRunning);
        }
        let ticket = match self.host.begin_suspend(job, Some(OWNER)) {
            Ok(ticket) => ticket,
            Err(e) => return Some(refusal(job, e)),
        };
        let outcome = ticket.run();
        let answer = self.host.finish_suspend(ticket, outcome).err().map(|e| refusal(job, e));
        // What the suspension set off (a gang switch onto its CPUs), as the server settles it.
        run_queued(&mut self.host);
        answer
    }

    /// The job's owner resumes it, as the server lets them (`Op::Resume`): only a suspension
    /// of their own.
    fn owner_resumes(&mut self, job: &str) -> Option<Refusal> {
        if !self.host.ledger().is_suspended(job) {
            return Some(Refusal::NotSuspended);
        }
        if self.host.suspended_by(job) != Some(OWNER) {
            return Some(Refusal::SuspendedByPolicy);
        }
        let ticket = match self.host.begin_resume(job, Some(OWNER)) {
            Ok(ticket) => ticket,
            Err(e) => return Some(refusal(job, e)),
        };
        let outcome = ticket.run();
        let answer = self.host.finish_resume(ticket, outcome).err().map(|e| refusal(job, e));
        run_queued(&mut self.host);
        answer
    }

    /// What runs, and what does not: suspended, or frozen until its gang row's slice.
    fn view(&self) -> View {
        let ledger = self.host.ledger();
        if std::env::var_os("AGREE_DEBUG").is_some() {
            let rows: Vec<_> = ledger
                .jobs()
                .chain(ledger.suspended_jobs())
                .chain(ledger.gang_frozen_jobs())
                .map(|a| (a.job.clone(), a.gang_row, a.tasks.clone()))
                .collect();
            eprintln!("  topod rows {rows:?}");
        }
        View {
            running: ledger.jobs().map(|a| (key(&a.job), a.cpus.clone())).collect(),
            suspended: ledger
                .suspended_jobs()
                .chain(ledger.gang_frozen_jobs())
                .map(|a| key(&a.job))
                .collect(),
        }
    }
}

/// What topod's refusal of an owner's request is in the core's terms.
fn refusal(job: &str, e: HostError) -> Refusal {
    match e {
        HostError::Lent { .. } => Refusal::Lent,
        HostError::HoldsForPreempted { .. } => Refusal::HoldsForSuspended,
        HostError::WaitedFor { .. } => Refusal::WaitedFor,
        e => panic!("job {job}: the owner's request failed: {e}"),
    }
}

/// How the jobs' owners suspend and resume them in a script.
#[derive(Debug, Clone)]
enum Owners {
    /// At random.
    Random {
        /// Seeds the owners' choices.
        seed: u64,
        /// At each instant, one in `suspend_one_in` suspends a running job.
        suspend_one_in: u64,
        /// At each instant, one in `resume_one_in` of the jobs suspended by their owners
        /// resumes.
        resume_one_in: u64,
    },
    /// At these instants (`OwnerSuspend` and `OwnerResume` events only).
    At(Vec<(i64, Event)>),
}

/// What happened, counted over a script.
#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    /// Suspensions the policy decided: by preemption, or freezes for gang slices.
    preempted: usize,
    /// Owners' suspends and resumes carried out.
    owners_done: usize,
    /// Resizes of malleable jobs.
    resized: usize,
    /// Moves by migration.
    moved: usize,
    /// Owners' suspends and resumes refused.
    owners_refused: usize,
    /// Owners' suspends refused because the job held CPUs a job suspended by preemption waits
    /// for (the rule that keeps an owner from holding another job suspended).
    refused_holding: usize,
    /// Owners' resumes refused because a job suspended by preemption waited for the job's CPUs.
    refused_waited_for: usize,
}

/// Runs `jobs` through both drivers, ending each job when its estimate has run, with a tick
/// every `tick` seconds, and with `owners` the jobs' owners suspending and resuming them;
/// panics at the first instant they differ.
fn agree(
    topo: &Topology,
    rules: policy::Preempt,
    jobs: &[ScriptJob],
    tick: i64,
    deferred: bool,
) -> usize {
    agree_with_owners(topo, rules, jobs, tick, deferred, None).preempted
}

fn agree_with_owners(
    topo: &Topology,
    rules: policy::Preempt,
    jobs: &[ScriptJob],
    tick: i64,
    deferred: bool,
    owners: Option<Owners>,
) -> Counts {
    agree_under(topo, Rules::Preempt(rules), jobs, tick, deferred, owners)
}

fn agree_under(
    topo: &Topology,
    rules: Rules,
    jobs: &[ScriptJob],
    tick: i64,
    deferred: bool,
    owners: Option<Owners>,
) -> Counts {
    let model = Arc::new(place::HostModel::new(topo, &CpuSet::new()).unwrap());
    let plain = PolicyConfig::plain(QueueOrder::Fcfs, Strategy::BestFit);
    let config = match rules {
        Rules::Preempt(rules) => PolicyConfig { preempt: Some(rules), ..plain },
        Rules::Gang(gang, preempt) => PolicyConfig { gang: Some(gang), preempt, ..plain },
        Rules::Malleable(m) => PolicyConfig { malleable: Some(m), ..plain },
        // Jobs no larger than a NUMA node ask for one: what leaves room only after moves.
        Rules::Defrag(defrag) => PolicyConfig { defrag: Some(defrag), numa_local: true, ..plain },
    };
    let mut core = PolicyCore::new(vec![model], config);
    let mut topod = TopodDriver::new(topo, rules, jobs, deferred);
    let mut seen = View::default();
    // Per job: when its estimate will have run (while it runs), what is left (while suspended).
    let mut due: BTreeMap<JobKey, i64> = BTreeMap::new();
    let mut left: BTreeMap<JobKey, i64> = BTreeMap::new();
    let mut own: BTreeMap<JobKey, CpuSet> = BTreeMap::new();
    // Per running job: its work left (processor-seconds) at a time, and its processors since.
    let mut work: BTreeMap<JobKey, (u128, i64, u128)> = BTreeMap::new();
    let mut next = 0usize;
    let mut counts = Counts::default();
    let mut now = 0i64;
    let mut script = Vec::new();
    let mut rng = SplitMix::new(match &owners {
        Some(Owners::Random { seed, .. }) => *seed,
        _ => 0,
    });
    // The jobs suspended by their owners, as the core has them.
    let mut by_owner: BTreeSet<JobKey> = BTreeSet::new();
    while next < jobs.len() || !seen.running.is_empty() || !seen.suspended.is_empty() {
        // The owners first (so that both drivers answer them before the instant's ends, which
        // topod acts on at once): one may suspend a running job (whatever it holds), some
        // resume theirs; now and then one tries to resume a job preemption suspended.
        let mut events = Vec::new();
        match &owners {
            Some(Owners::Random { suspend_one_in, resume_one_in, .. }) => {
                // A job that runs, or that the policy stopped (preempted, or frozen for its
                // gang slice).
                let stoppable: Vec<JobKey> = seen
                    .running
                    .keys()
                    .copied()
                    .filter(|j| due[j] > now)
                    .chain(seen.suspended.iter().copied().filter(|j| !by_owner.contains(j)))
                    .collect();
                if !stoppable.is_empty() && rng.below(*suspend_one_in) == 0 {
                    let job = stoppable[rng.below(stoppable.len() as u64) as usize];
                    events.push(Event::OwnerSuspend { job });
                }
                for &job in &seen.suspended {
                    let mine = by_owner.contains(&job);
                    if (mine && rng.below(*resume_one_in) == 0) || (!mine && rng.below(20) == 0) {
                        events.push(Event::OwnerResume { job });
                    }
                }
            }
            Some(Owners::At(at)) => {
                events.extend(at.iter().filter(|(t, _)| *t == now).map(|(_, e)| *e));
            }
            None => {}
        }
        let ending: Vec<JobKey> =
            due.iter().filter(|&(_, &at)| at <= now).map(|(&job, _)| job).collect();
        for job in ending {
            events.push(Event::End { job });
        }
        while next < jobs.len() && jobs[next].submit <= now {
            let j = jobs[next];
            let spec = JobSpec {
                malleable: matches!(rules, Rules::Malleable(_)) && next % 2 == 0,
                ..JobSpec::rigid(j.cores, j.estimate)
            };
            events.push(Event::Submit { job: next as JobKey, spec });
            next += 1;
        }
        if events.is_empty() {
            events.push(Event::Tick);
        }
        // With equipartition, topod hears of the instant's ends one release at a time and shares
        // out what each frees at once: the core is told them one by one too.
        let batches: Vec<Vec<Event>> = if matches!(rules, Rules::Malleable(_)) {
            let (ends, rest): (Vec<Event>, Vec<Event>) =
                events.iter().partition(|e| matches!(e, Event::End { .. }));
            ends.into_iter().map(|e| vec![e]).chain((!rest.is_empty()).then_some(rest)).collect()
        } else {
            vec![events]
        };
        for events in batches {
            for e in &events {
                if let Event::End { job } = e {
                    // (A job resized by an earlier batch of the instant ends all the same.)
                    seen.running.remove(job);
                    due.remove(job);
                    work.remove(job);
                }
            }
            let asked: Vec<JobKey> = events
                .iter()
                .filter_map(|e| match *e {
                    Event::OwnerSuspend { job } | Event::OwnerResume { job } => Some(job),
                    _ => None,
                })
                .collect();
            script.push((now, events.clone()));
            // The core on the host's clock: gang slices are k·slice seconds since the epoch in both.
            let actions = core.step(EPOCH + now, events.iter().copied()).unwrap();
            // The owners' answers come first, one per request, in order.
            let core_answers: Vec<Option<Refusal>> = asked
                .iter()
                .zip(&actions)
                .map(|(&asked, action)| match *action {
                    Action::Suspend { job } | Action::Resume { job } if job == asked => None,
                    Action::Refused { job, why } if job == asked => Some(why),
                    ref other => panic!("job {asked}'s owner was answered {other:?}"),
                })
                .collect();
            for (&job, (e, answer)) in asked.iter().zip(events.iter().zip(&core_answers)) {
                match (e, answer) {
                    (Event::OwnerSuspend { .. }, None) => {
                        by_owner.insert(job);
                    }
                    (Event::OwnerResume { .. }, None) => {
                        by_owner.remove(&job);
                    }
                    _ => {}
                }
                if answer.is_some() {
                    counts.owners_refused += 1;
                    counts.refused_holding +=
                        usize::from(*answer == Some(Refusal::HoldsForSuspended));
                    counts.refused_waited_for += usize::from(*answer == Some(Refusal::WaitedFor));
                } else {
                    counts.owners_done += 1;
                }
            }
            for (i, action) in actions.into_iter().enumerate() {
                match action {
                    Action::Start { job, parts } => {
                        if std::env::var_os("AGREE_DEBUG").is_some() {
                            eprintln!("  core start {job} {:?}", parts[0].placement.tasks);
                        }
                        seen.running.insert(job, parts[0].placement.cpus.clone());
                        due.insert(job, now + jobs[job as usize].estimate);
                        // Its work, processor-seconds: its estimate at the size it asked for,
                        // draining at the processors it holds (as the core has it).
                        let j = jobs[job as usize];
                        let rate = parts[0].placement.tasks.len() as u128;
                        let total = j.estimate as u128 * u128::from(j.cores);
                        work.insert(job, (total, now, rate));
                        due.insert(job, now + total.div_ceil(rate) as i64);
                    }
                    Action::Resize { job, parts } => {
                        if std::env::var_os("AGREE_DEBUG").is_some() {
                            eprintln!("  core resize {job} {:?}", parts[0].placement.tasks);
                        }
                        let (left, since, rate) = work[&job];
                        let left = left.saturating_sub((now - since) as u128 * rate);
                        let rate = parts[0].placement.tasks.len() as u128;
                        work.insert(job, (left, now, rate));
                        due.insert(job, now + left.div_ceil(rate) as i64);
                        seen.running.insert(job, parts[0].placement.cpus.clone());
                        counts.resized += 1;
                    }
                    Action::Suspend { job } => {
                        counts.preempted += usize::from(i >= asked.len());
                        // It keeps its CPUs for its resume. (Its owner may stop a job frozen for
                        // its gang slice: it does not run either way.)
                        if let Some(cpus) = seen.running.remove(&job) {
                            own.insert(job, cpus);
                            seen.suspended.insert(job);
                            left.insert(job, due.remove(&job).unwrap() - now);
                        }
                    }
                    Action::Resume { job } => {
                        seen.suspended.remove(&job);
                        due.insert(job, now + left.remove(&job).unwrap());
                        seen.running.insert(job, own.remove(&job).unwrap());
                    }
                    Action::Refused { .. } => {}
                    Action::Move { job, parts, .. } => {
                        if std::env::var_os("AGREE_DEBUG").is_some() {
                            eprintln!("  core move {job} {:?}", parts[0].placement.tasks);
                        }
                        seen.running.insert(job, parts[0].placement.cpus.clone());
                        counts.moved += 1;
                    }
                    other => {
                        panic!("the core decided {other:?}, which this script does not expect")
                    }
                }
            }
            let host_answers = topod.step(now, &events);
            let host_view = topod.view();
            if std::env::var_os("AGREE_DEBUG").is_some() {
                eprintln!("{now}: {events:?}\n  core  {seen:?}\n  topod {host_view:?}");
            }
            let history = || {
                script.iter().map(|(t, e)| format!("  {t}: {e:?}")).collect::<Vec<_>>().join("\n")
            };
            assert_eq!(
                core_answers,
                host_answers,
                "the core (left) and topod (right) answer the owners differently at {now} s after:\n{}",
                history()
            );
            assert_eq!(
                seen,
                host_view,
                "the core (left) and topod (right) differ at {now} s after:\n{}",
                history()
            );
        }
        // The next instant: a submit, an end, or a tick.
        let next_submit = jobs.get(next).map(|j| j.submit);
        let next_end = due.values().min().copied();
        let next_owner = match &owners {
            Some(Owners::At(at)) => at.iter().map(|(t, _)| *t).filter(|t| *t > now).min(),
            _ => None,
        };
        now = [next_submit, next_end, next_owner, Some(now + tick)]
            .into_iter()
            .flatten()
            .min()
            .unwrap();
        assert!(script.len() < 100_000, "the script does not end");
    }
    counts
}

fn random_jobs(seed: u64, n: usize, cores: u32) -> Vec<ScriptJob> {
    let mut rng = SplitMix::new(seed);
    let mut t = 0;
    (0..n)
        .map(|_| {
            t += rng.below(200) as i64;
            ScriptJob {
                submit: t,
                cores: 1 + rng.below(u64::from(cores)) as u32,
                estimate: 1 + rng.below(3_000) as i64,
            }
        })
        .collect()
}

#[test]
fn policy_agrees_on_preemption_and_the_cpus_held_for_suspended_jobs() {
    let rules = policy::Preempt { min_run: 60, max_suspensions: 2, min_xf: 1.5 };
    // A long job, then one that waits for it until its expansion factor lets it preempt, then
    // a short one that borrows the victim's idle CPUs and a long one that may not.
    let jobs = [
        ScriptJob { submit: 0, cores: 8, estimate: 10_000 },
        ScriptJob { submit: 10, cores: 4, estimate: 1_000 },
        ScriptJob { submit: 700, cores: 2, estimate: 200 },
        ScriptJob { submit: 700, cores: 2, estimate: 5_000 },
    ];
    for deferred in [false, true] {
        assert!(agree(&two_nodes_of_four(), rules, &jobs, 50, deferred) > 0);
    }
}

#[test]
fn policy_agrees_over_random_scripts() {
    let seeds: u64 = std::env::var("AGREE_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(15);
    let rule_sets = [
        policy::Preempt { min_run: 60, max_suspensions: 2, min_xf: 1.5 },
        policy::Preempt { min_run: 0, max_suspensions: 1, min_xf: 1.1 },
        policy::Preempt { min_run: 300, max_suspensions: 3, min_xf: 3.0 },
    ];
    for (topo, tick) in [(two_nodes_of_four(), 100), (small_topology(6), 37)] {
        let mut suspensions = 0;
        for rules in rule_sets {
            for seed in 0..seeds {
                let jobs = random_jobs(seed, 40, topo.pus.len() as u32);
                // The freezes queued and run without the lock as under the server, on odd
                // seeds; at once, as driven directly, on even ones.
                suspensions += agree(&topo, rules, &jobs, tick, seed % 2 == 1);
            }
        }
        assert!(suspensions > 0, "the scripts preempt on {}", topo.source);
    }
}

#[test]
fn policy_agrees_when_owners_suspend_and_resume_their_jobs() {
    let rule_sets = [
        policy::Preempt { min_run: 60, max_suspensions: 2, min_xf: 1.5 },
        policy::Preempt { min_run: 0, max_suspensions: 1, min_xf: 1.1 },
    ];
    let seeds: u64 = std::env::var("AGREE_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(15);
    let mut total = Counts::default();
    for (topo, tick) in [(two_nodes_of_four(), 100), (small_topology(6), 37)] {
        for rules in rule_sets {
            for seed in 0..seeds {
                let jobs = random_jobs(seed, 40, topo.pus.len() as u32);
                let owners =
                    Owners::Random { seed: seed + 1_000, suspend_one_in: 3, resume_one_in: 4 };
                let c = agree_with_owners(&topo, rules, &jobs, tick, seed % 2 == 1, Some(owners));
                total.preempted += c.preempted;
                total.owners_done += c.owners_done;
                total.owners_refused += c.owners_refused;
                total.refused_holding += c.refused_holding;
                total.refused_waited_for += c.refused_waited_for;
            }
        }
    }
    eprintln!("{total:?}");
    // The scripts did what they are for: owners' requests carried out and refused, and
    // preemption among them.
    assert!(total.preempted > 0 && total.owners_done > 0 && total.refused_holding > 0, "{total:?}");
}

/// The owner's dodge (issue 30): a job whose owner suspends and resumes it again and again
/// must still be preempted as if its owner had never touched it: the owner's suspensions do not
/// count toward `preempt_max_suspensions`, and a resume does not restart `preempt_min_run_s`.
#[test]
fn policy_agrees_that_an_owners_suspensions_do_not_shield_a_job_from_preemption() {
    let rules = policy::Preempt { min_run: 300, max_suspensions: 1, min_xf: 2.0 };
    // Job 0 holds the whole host; job 1, submitted at 1,295, reaches expansion factor 2 at 1,300,
    // ten seconds after job 0's owner last resumed it.
    let jobs = [
        ScriptJob { submit: 0, cores: 8, estimate: 10_000 },
        ScriptJob { submit: 1_295, cores: 8, estimate: 5 },
    ];
    let mut at = Vec::new();
    for t in [100, 200, 1_280] {
        at.push((t, Event::OwnerSuspend { job: 0 }));
        at.push((t + 10, Event::OwnerResume { job: 0 }));
    }
    for deferred in [false, true] {
        let c = agree_with_owners(
            &two_nodes_of_four(),
            rules,
            &jobs,
            5,
            deferred,
            Some(Owners::At(at.clone())),
        );
        assert_eq!((c.owners_done, c.owners_refused), (6, 0), "{c:?}");
        assert_eq!(c.preempted, 1, "job 1 preempted job 0: {c:?}");
    }
}

/// Gang time slicing: the same jobs run, on the same CPUs, and the same wait frozen for their
/// rows' slices, in both drivers, at every instant (slices change between instants, and jobs
/// start in rows that are not running); also while the jobs' owners stop and start them, and
/// with preemption on as well (every job asking to preempt and preemptible: gang jobs wait for
/// their rows instead, in both).
#[test]
fn policy_agrees_on_gang_slices() {
    let seeds: u64 = std::env::var("AGREE_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(15);
    let (mut freezes, mut owners_done) = (0, 0);
    let preempt = policy::Preempt { min_run: 0, max_suspensions: 5, min_xf: 1.0 };
    for (topo, tick) in [(two_nodes_of_four(), 100), (small_topology(6), 37)] {
        for gang in [policy::Gang { slice: 60, rows: 2 }, policy::Gang { slice: 250, rows: 3 }] {
            for seed in 0..seeds {
                let jobs = random_jobs(seed, 40, topo.pus.len() as u32);
                // Preemption on too in every other script.
                let rules = Rules::Gang(gang, (seed % 2 == 1).then_some(preempt));
                freezes += agree_under(&topo, rules, &jobs, tick, seed % 2 == 1, None).preempted;
                // And with the jobs' owners stopping and starting them.
                let owners =
                    Owners::Random { seed: seed + 2_000, suspend_one_in: 3, resume_one_in: 4 };
                let c = agree_under(&topo, rules, &jobs, tick, seed % 2 == 0, Some(owners));
                owners_done += c.owners_done;
            }
        }
    }
    assert!(freezes > 0, "the scripts freeze jobs for their slices");
    assert!(owners_done > 0, "the owners stop and start gang jobs");
}

/// Equipartition: the same malleable jobs grown and shrunk to the same CPUs, beside the same
/// rigid jobs, in both drivers, at every instant (a job ends when its work is done at the sizes
/// it was given).
#[test]
fn policy_agrees_on_equipartition() {
    let seeds: u64 = std::env::var("AGREE_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(15);
    let mut resized = 0;
    for (topo, tick) in [(two_nodes_of_four(), 100), (small_topology(6), 37)] {
        for min_divisor in [2, 4] {
            for seed in 0..seeds {
                let jobs = random_jobs(seed, 40, topo.pus.len() as u32);
                let rules = Rules::Malleable(policy::Malleability { min_divisor });
                resized += agree_under(&topo, rules, &jobs, tick, false, None).resized;
            }
        }
    }
    assert!(resized > 0, "the scripts resize jobs");
}

/// An owner may not hold another user's job suspended (found by attacking the first version):
/// job 0's owner stops it, job 1 starts on its CPUs and is preempted by job 2; when job 2 ends,
/// job 1 resumes on its CPUs at once (before, it waited for job 0, whose owner could keep the
/// host idle and then resume job 0 onto CPUs job 1 waited for, out of preemption's reach), and
/// job 0's resume waits until job 1 is gone.
#[test]
fn policy_agrees_that_an_owner_holds_no_other_job_suspended() {
    let rules = policy::Preempt { min_run: 0, max_suspensions: 5, min_xf: 1.5 };
    let jobs = [
        ScriptJob { submit: 0, cores: 4, estimate: 10_000 },
        ScriptJob { submit: 10, cores: 4, estimate: 10_000 },
        ScriptJob { submit: 20, cores: 4, estimate: 10 },
    ];
    let at = vec![
        (10, Event::OwnerSuspend { job: 0 }),
        (5_000, Event::OwnerResume { job: 0 }),
        (20_000, Event::OwnerResume { job: 0 }),
    ];
    for deferred in [false, true] {
        let c = agree_with_owners(
            &small_topology(4),
            rules,
            &jobs,
            5,
            deferred,
            Some(Owners::At(at.clone())),
        );
        // Job 1 preempted once; the resume at 5,000 refused (job 1 runs on its CPUs), the one
        // at 20,000 carried out.
        assert_eq!((c.preempted, c.owners_done, c.owners_refused), (1, 2, 1), "{c:?}");
    }
}

/// Migration (topod's `defrag`, the core's `+defrag` with NUMA-local jobs): the same moves, at
/// the same instants, to the same CPUs, and none of a job its minimum run keeps in place (a
/// topod that ignored `migrate_min_run_s` fails this). These scripts move no job twice, so the
/// gap between two moves of one job is not compared here (the host's own tests check it).
#[test]
fn policy_agrees_on_migration_and_its_timers() {
    let seeds: u64 = std::env::var("AGREE_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(15);
    let limits = topo_core::defrag::DefragLimits::default();
    let rule_sets = [
        policy::Defrag { min_run: 0, gap: 0, limits },
        policy::Defrag { min_run: 1_000, gap: 2_000, limits },
    ];
    let mut moved = [0; 2];
    for (topo, tick) in [(two_nodes_of_four(), 100), (small_topology(6), 37)] {
        for (i, defrag) in rule_sets.into_iter().enumerate() {
            for seed in 0..seeds {
                // Jobs of up to half the host, arriving faster than they end: NUMA nodes
                // fragment, and starts need moves.
                let mut jobs = random_jobs(seed, 40, topo.pus.len() as u32 / 2);
                for (k, j) in jobs.iter_mut().enumerate() {
                    j.submit = j.submit / 4 + k as i64;
                }
                moved[i] +=
                    agree_under(&topo, Rules::Defrag(defrag), &jobs, tick, false, None).moved;
            }
        }
    }
    eprintln!("moves: {moved:?}");
    assert!(moved.iter().all(|&m| m > 0), "the scripts move jobs under each rule set: {moved:?}");
}
