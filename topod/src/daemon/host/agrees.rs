//! The differential test of the time rules: one event script driven through the cluster policy
//! core (`topo_core::policy::PolicyCore`, what `topoctl simulate` runs) on one host and through
//! [`Host`] on a fake cgroup file system, with a first-come-first-served batch system in front
//! of it (what an LSF or PBS queue does: the first waiting job is asked for, with the right to
//! preempt, until one does not fit). After every instant both must hold the same jobs running,
//! on the same CPUs, and the same jobs suspended.
//!
//! The scripts cover submits, ends (a job ends when its estimate has run, counting from its
//! start and resumes), and the passing of time; preemption is on with every job preemptible.
//! topod's side runs its freezes and thaws at once, or queues them and runs them after, as the
//! server does without the host lock (asking a preempting allocate again).
//! `AGREE_SEEDS=N` runs N random scripts per rule set and host (15 by default; 100 passed when
//! this was written), `AGREE_DEBUG=1` prints both drivers' views at every instant.
//!
//! Found by it and fixed in both drivers' shared code: `victims_on_host` kept victims the job
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
    self, Action, Event, JobKey, JobSpec, PolicyConfig, PolicyCore, QueueOrder,
};

/// One job of a script.
#[derive(Debug, Clone, Copy)]
struct ScriptJob {
    submit: i64,
    cores: u32,
    estimate: i64,
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
}

impl TopodDriver {
    fn new(topo: &Topology, rules: policy::Preempt, jobs: &[ScriptJob], deferred: bool) -> Self {
        let fake = Fake::new(topo.allowed.clone(), topo.allowed_mems.clone());
        let mut host =
            Host::new(topo.clone(), CpuSet::new(), Box::new(fake), None, Strategy::BestFit)
                .unwrap();
        host.set_preempt(Some(rules));
        if deferred {
            host.defer_kernel_waits();
        }
        let clock = Arc::new(AtomicI64::new(EPOCH));
        let c = clock.clone();
        host.set_clock(Arc::new(move || {
            std::time::UNIX_EPOCH + Duration::from_secs(c.load(Ordering::SeqCst) as u64)
        }));
        TopodDriver { host, clock, queue: VecDeque::new(), jobs: jobs.to_vec(), deferred }
    }

    fn step(&mut self, now: i64, events: &[Event]) {
        self.clock.store(EPOCH + now, Ordering::SeqCst);
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
            }
        }
        // topod's own tick resumes what it can; then the queue's head is asked for, with the
        // right to preempt, until one does not fit or one preempted (the core preempts once
        // per instant).
        self.host.resume_preempted();
        run_queued(&mut self.host);
        while let Some(&head) = self.queue.front() {
            let j = self.jobs[head as usize];
            let text = policy::cores_request(j.cores).to_string();
            let mut prepared = prepare(&self.host.topo, &text, None, None).unwrap();
            prepared.preempt = PreemptAsk {
                preempt: true,
                preemptible: true,
                submitted_at: Some(EPOCH + j.submit),
                estimate_s: Some(j.estimate as u64),
            };
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
    }

    fn view(&self) -> View {
        View {
            running: self.host.ledger().jobs().map(|a| (key(&a.job), a.cpus.clone())).collect(),
            suspended: self.host.ledger().suspended_jobs().map(|a| key(&a.job)).collect(),
        }
    }
}

/// Runs `jobs` through both drivers, ending each job when its estimate has run, with a tick
/// every `tick` seconds; panics at the first instant they differ. Returns how many
/// suspensions there were.
fn agree(
    topo: &Topology,
    rules: policy::Preempt,
    jobs: &[ScriptJob],
    tick: i64,
    deferred: bool,
) -> usize {
    let model = Arc::new(place::HostModel::new(topo, &CpuSet::new()).unwrap());
    let config = PolicyConfig {
        preempt: Some(rules),
        ..PolicyConfig::plain(QueueOrder::Fcfs, Strategy::BestFit)
    };
    let mut core = PolicyCore::new(vec![model], config);
    let mut topod = TopodDriver::new(topo, rules, jobs, deferred);
    let mut seen = View::default();
    // Per job: when its estimate will have run (while it runs), what is left (while suspended).
    let mut due: BTreeMap<JobKey, i64> = BTreeMap::new();
    let mut left: BTreeMap<JobKey, i64> = BTreeMap::new();
    let mut own: BTreeMap<JobKey, CpuSet> = BTreeMap::new();
    let mut next = 0usize;
    let mut suspensions = 0;
    let mut now = 0i64;
    let mut script = Vec::new();
    while next < jobs.len() || !seen.running.is_empty() || !seen.suspended.is_empty() {
        let mut events = Vec::new();
        for (&job, &at) in &due {
            if at <= now {
                events.push(Event::End { job });
            }
        }
        for e in &events {
            if let Event::End { job } = e {
                due.remove(job);
                seen.running.remove(job);
            }
        }
        while next < jobs.len() && jobs[next].submit <= now {
            let j = jobs[next];
            let spec = JobSpec::rigid(j.cores, j.estimate);
            events.push(Event::Submit { job: next as JobKey, spec });
            next += 1;
        }
        if events.is_empty() {
            events.push(Event::Tick);
        }
        script.push((now, events.clone()));
        for action in core.step(now, events.iter().copied()).unwrap() {
            match action {
                Action::Start { job, parts } => {
                    seen.running.insert(job, parts[0].placement.cpus.clone());
                    due.insert(job, now + jobs[job as usize].estimate);
                }
                Action::Suspend { job } => {
                    suspensions += 1;
                    // It keeps its CPUs for its resume.
                    own.insert(job, seen.running.remove(&job).unwrap());
                    seen.suspended.insert(job);
                    left.insert(job, due.remove(&job).unwrap() - now);
                }
                Action::Resume { job } => {
                    seen.suspended.remove(&job);
                    due.insert(job, now + left.remove(&job).unwrap());
                    seen.running.insert(job, own.remove(&job).unwrap());
                }
                other => panic!("the core decided {other:?}, which this script does not expect"),
            }
        }
        topod.step(now, &events);
        let host_view = topod.view();
        if std::env::var_os("AGREE_DEBUG").is_some() {
            eprintln!("{now}: {events:?}\n  core  {seen:?}\n  topod {host_view:?}");
        }
        assert_eq!(
            seen,
            host_view,
            "the core (left) and topod (right) differ at {now} s after:\n{}",
            script.iter().map(|(t, e)| format!("  {t}: {e:?}")).collect::<Vec<_>>().join("\n")
        );
        // The next instant: a submit, an end, or a tick.
        let next_submit = jobs.get(next).map(|j| j.submit);
        let next_end = due.values().min().copied();
        now = [next_submit, next_end, Some(now + tick)].into_iter().flatten().min().unwrap();
        assert!(script.len() < 100_000, "the script does not end");
    }
    suspensions
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
