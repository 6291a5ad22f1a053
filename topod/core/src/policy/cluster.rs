//! The cluster policy core: the decisions topo makes over time for a whole cluster, as a pure
//! function of state and events (the per-host rules it applies are in [`super`]).
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
//! up). Jobs are considered in queue order, once per step. [`QueueOrder::Conservative`]
//! (conservative backfilling, Mu'alem and Feitelson 2001): *every* waiting job, in queue order,
//! gets a reservation at the earliest time its processors stay free for its whole estimate,
//! by the running jobs' estimated ends and the reservations before it; a job starts now only
//! when its reservation is now, so no start delays any job ahead of it (EASY protects only the
//! head). A job whose reservation is now but whose placement is refused (its shape) is reserved
//! at the next time it fits. It is not combined with gang slicing, malleable jobs or
//! preemption (with those the core backfills as EASY does).
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
//!
//! ## Malleable jobs ([`Malleability`])
//!
//! A job the driver marks malleable (see [`JobSpec::malleable`]) that fits one host runs on any
//! number of processors in its range (for `p` processors asked, `ceil(p / min_divisor)` to `p`)
//! and is resized while it runs. On each host the malleable jobs share the cores its rigid jobs
//! leave by equipartition ([`crate::malleable::equipartition`], one task per core, ties by the
//! order the jobs started in), rebalanced when a job ends there (before the instant's starts,
//! as topod shares out what a release frees before it hears of the next job) and after every
//! instant in which one started there. Multi-host jobs stay rigid, as does a job whose range is
//! one size.
//!
//! - **Work.** A malleable job's estimate is for its `p` processors: `estimate × p`
//!   processor-seconds, which drain at the rate of the processors it holds (linear speedup), so
//!   its estimated end moves at every resize. Linear speedup is the optimistic bound: a real
//!   code loses some efficiency with more processors and pays for each resize (Charm++ moves
//!   its objects, an MPI code redistributes its data); neither is charged here.
//! - **Counting.** The cores a malleable job holds beyond its least size count as free for
//!   starting jobs (the host's free count, [`PolicyCore::free_procs`], EASY's reservation and
//!   its shadow time): a rigid job started on a host first shrinks the malleable jobs there
//!   toward their least sizes, by equipartition of what it leaves them, then is placed. A
//!   malleable job starts as soon as some host has its least size free in that count, on the
//!   host where equipartition gives it the most processors (then the host with the fewest free,
//!   then the lowest number), at whatever size that is. EASY plans with a malleable job's least
//!   size and its longest run (`estimate × p ÷ least size`), and its reservation for the queue's
//!   head takes every running malleable job to end as late as its estimate allows if it runs at
//!   its least size from now on (a start may shrink it to that at any time), so that no job
//!   started around the head delays it by shrinking one.
//! - **CPUs.** A shrink keeps a job's first tasks where they are and frees the others; a grow
//!   places the new tasks in the host's free cores with the job's own request
//!   ([`place::resize`]). The driver is told by [`Action::Resize`]: the grows into what the
//!   instant's ends freed first, then shrinks as they happen (before any start that uses the
//!   cores they free), then the grows once the instant's starts are done. A malleable job that
//!   starts is placed whole at its share (the others shrunk to theirs first), as topod starts
//!   one. The differential test `topod::daemon::host::agrees` holds the core to topod's CPUs.
//!
//! Malleable jobs are not combined with preemption or gang slicing (a suspended job's CPUs would
//! be grown into, and rows would share what equipartition divides): with either set, every job
//! runs rigid.
//!
//! ## Space over time: NUMA-local jobs, migration, reservations, prime time
//!
//! The four options below work on the CPUs of each host, as topod does, and go with neither
//! preemption nor gang slicing (with either set they are off). They combine with each other and
//! with malleable jobs. With all of them off, the core decides exactly as without them.
//!
//! - **NUMA-local jobs** ([`PolicyConfig::numa_local`]). A rigid job that fits in one NUMA node
//!   of a host asks for one (`MAX_RADIUS=0`, one task per core): the core tries the hosts with
//!   enough free cores, the fewest free first, and starts it on the first where placement finds
//!   them in one node; it never splits such a job over hosts. Larger jobs and malleable ones ask
//!   for plain cores. Free cores can then be in the wrong places (four free, two in each node,
//!   refuse a job of four): the fragmentation the next two options work against. The counts the
//!   cluster order uses (free cores, EASY's shadow time) do not see shape, so a job the counts
//!   allow may still wait; [`Counters::refused_on_shape`] counts those refusals.
//! - **Defragmenting migration** ([`Defrag`]). When every host tried refuses a job's part on
//!   shape although enough cores are free there, the core asks [`defrag::plan_moves`] for the
//!   fewest moves of running jobs' parts on such a host (the same hosts in the same order) that
//!   make room, each moved part placed again with its own request, as topod's allocate does
//!   (`space.rs`): a job that has run less than `min_run`, or was moved or resized within `gap`
//!   seconds, stays put (the T3E psched's delay timers). The moves come out as [`Action::Move`]
//!   before the start. A move costs the moved job [`PolicyConfig::move_cost`] seconds of
//!   progress (0: free, the model is work conserving). EASY needs no change: its counts already
//!   said such a job could start, and with migration it does start then, instead of waiting for
//!   an end that frees the right cores.
//! - **Topology reservations** ([`PolicyConfig::reserve`], EASY only; "blocking" after the SDSC
//!   Paragon). When EASY reserves for the queue's head, the core predicts the hosts it will
//!   start on (the free cores at the shadow time, counting the running jobs estimated to have
//!   ended by then, chosen as the head's start would choose them) and sets a block aside on each
//!   with [`reservation::choose_block`], for the head's part there, on the CPUs those jobs leave
//!   (so a block drains as they end). Every other job is placed outside the blocks
//!   ([`reservation::blocked_for`]; the counts it starts by leave their free cores out), except,
//!   by default ([`Reserve::Outlasting`]), a job EASY backfills because it ends by the shadow
//!   time: it is gone before the head starts. With [`Reserve::Strict`] the blocks bind every
//!   other job, as the Paragon's blocking kept its nodes empty. The head starts on its blocks'
//!   hosts when they have its parts free, inside the blocks where it fits there, and that spends
//!   them. The blocks are made again when the head, its shadow time or the cluster changes, and
//!   dropped when another job becomes the head ([`Action::Reserve`] tells the driver each new
//!   set). EASY's rule is unchanged: a backfilled job must still end by the shadow time or fit
//!   in the extra processors; the blocks only say where.
//! - **Prime-time pools** ([`Prime`]). A share of each host's cores is a pool, reserved in weekly
//!   windows (local time at the caller's clock plus an epoch and a UTC offset) for the jobs it
//!   admits: those whose estimate is at most `max_estimate`. Inside a window others are placed
//!   outside the pools (and their counts leave the pools' free cores out), admitted jobs go into
//!   a pool first when they fit there ([`prime::pools_for`], as topod). When a window opens, jobs
//!   on a pool that it does not admit stay, or with [`OnOpen::Migrate`] are moved out where they
//!   fit ([`Action::Move`]). The core asks to be woken ([`PolicyCore::next_wakeup`]) at the
//!   window changes that can matter: a close while jobs wait, an open while jobs run with
//!   `Migrate`. EASY's shadow time does not see the pools.
//!
//! ## Suspensions that are not the policy's
//!
//! A job's owner may stop their running job and start it again ([`Event::OwnerSuspend`],
//! [`Event::OwnerResume`]), as `topoctl suspend` and `resume` do on a live host. Its CPUs may
//! then go to any job; its resume waits until no running job holds them. The rules that keep an
//! owner from gaming preemption, or from holding another user's job:
//!
//! - the owner's suspension does not count toward [`Preempt::max_suspensions`], and its resume
//!   does not restart [`Preempt::min_run`]: it never shields a job from preemption;
//! - a job that runs on CPUs a job suspended by preemption waits for may not be stopped so (it
//!   would keep that job suspended as long as its owner liked);
//! - a job suspended by preemption resumes (by the policy, never by its owner) as soon as its
//!   CPUs are free of running jobs, also onto those of a job its owner stopped, whose resume is
//!   refused while a job suspended by preemption waits for any of its CPUs.
//!
//! A gang job stopped so keeps its place in its row but leaves the row's turns (other rows' jobs
//! may run on its CPUs in its slices), and goes back to them when resumed. Malleable jobs'
//! owners' suspensions are not modelled (refused with an error). topod decides each of these the
//! same way (the differential test `topod::daemon::host::agrees`).

use super::profile;
use super::queue::WaitQueue;
use super::*;
use crate::cpuset::CpuSet;
use crate::defrag::{self, Movable};
use crate::malleable::{self, EquipartitionError, Malleable};
use crate::place::{self, HostModel, Occupancy, PlaceError, Placement, Strategy};
use crate::prime::{self, Asker, LocalTime, OnOpen, Window};
use crate::request::Request;
use crate::reservation::{self, Reservation};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// The cluster-level order jobs start in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QueueOrder {
    /// First come, first served: the first job that does not fit blocks the queue.
    Fcfs,
    /// EASY backfilling: a reservation for the queue's head, later jobs start around it.
    Easy,
    /// Conservative backfilling: a reservation for every waiting job; a later job starts now
    /// only if it delays none of them.
    Conservative,
}

impl QueueOrder {
    /// The name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            QueueOrder::Fcfs => "fcfs",
            QueueOrder::Easy => "easy",
            QueueOrder::Conservative => "conservative",
        }
    }
}

impl std::str::FromStr for QueueOrder {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fcfs" => Ok(QueueOrder::Fcfs),
            "easy" => Ok(QueueOrder::Easy),
            "conservative" => Ok(QueueOrder::Conservative),
            other => Err(format!(
                "unknown policy {other:?}: the policies are fcfs, easy and conservative"
            )),
        }
    }
}

/// How the core decides.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyConfig {
    /// Cluster order.
    pub order: QueueOrder,
    /// The strategy that chooses CPUs on a host.
    pub strategy: Strategy,
    /// Suspending running jobs for a waiting one, when set (not with `gang`).
    pub preempt: Option<Preempt>,
    /// Gang time slicing, when set.
    pub gang: Option<Gang>,
    /// Malleable jobs resized by equipartition, when set (not with `preempt` or `gang`: with
    /// either, every job runs rigid). See the module documentation.
    pub malleable: Option<Malleability>,
    /// A rigid job that fits in one NUMA node asks for one (not with `preempt` or `gang`; see
    /// the module documentation).
    pub numa_local: bool,
    /// Defragmenting migration, when set (not with `preempt` or `gang`).
    pub defrag: Option<Defrag>,
    /// Topology reservations for EASY's head, when set (not with `preempt` or `gang`; nothing
    /// with FCFS).
    pub reserve: Option<Reserve>,
    /// Prime-time pools, when set (not with `preempt` or `gang`).
    pub prime: Option<Prime>,
    /// What a move costs the moved job, seconds: it makes no progress for this long (0, the
    /// default: moves are free and the model is work conserving).
    pub move_cost: Time,
    /// What a suspension by preemption costs the suspended job, seconds of progress (0, the
    /// default: free): the time to write its memory out and read it back, and its caches lost.
    /// The core plans with it (the job's estimated end moves later by as much at each
    /// suspension) and a driver charges it.
    pub suspend_cost: Time,
    /// What a gang switch costs the job it freezes, seconds of progress (0, the default: free):
    /// its caches and TLB refilled when its row runs again. The core plans with it (the frozen
    /// job's estimated end moves later by as much at each freeze) and a driver charges it. It
    /// must be below the slice: a job frozen after every slice it runs would never progress
    /// (the simulator refuses it, [`crate::sim::SimError::SwitchCostNotBelowSlice`]).
    pub switch_cost: Time,
    /// With [`QueueOrder::Conservative`], how many waiting jobs (in queue order) get
    /// reservations; the others start only where they delay none of those (Maui's
    /// RESERVATIONDEPTH; 1 is close to EASY). `None`: every waiting job.
    pub reservation_depth: Option<u32>,
}

impl PolicyConfig {
    /// A configuration with none of preemption, gang slicing, malleable jobs, NUMA-local jobs,
    /// migration, reservations or prime time.
    pub fn plain(order: QueueOrder, strategy: Strategy) -> Self {
        PolicyConfig {
            order,
            strategy,
            preempt: None,
            gang: None,
            malleable: None,
            numa_local: false,
            defrag: None,
            reserve: None,
            prime: None,
            move_cost: 0,
            suspend_cost: 0,
            switch_cost: 0,
            reservation_depth: None,
        }
    }
}

/// Whom the head's blocks bind (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reserve {
    /// Every other job that would still run when the head starts: a backfilled job that ends by
    /// the shadow time (by its estimate) may use the blocks, as it is gone by then.
    #[default]
    Outlasting,
    /// Every other job, as the Paragon's blocking kept its nodes empty.
    Strict,
}

/// How many cores of each host a prime-time pool takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PoolSize {
    /// This share of the host's cores (0 to 1), rounded to the nearest core, at least one.
    Share(f64),
    /// This many cores (at most the host's).
    Cores(u32),
}

impl PoolSize {
    /// The pool's cores on a host of `cores`.
    pub fn of(self, cores: u32) -> u32 {
        let n = match self {
            PoolSize::Share(f) => (f64::from(cores) * f.clamp(0.0, 1.0)).round() as u32,
            PoolSize::Cores(n) => n,
        };
        n.clamp(1, cores.max(1))
    }
}

/// The name the core's pools have (what an admitted job's allocate names, in topod's terms).
pub const PRIME_POOL: &str = "prime";

/// Prime-time pools (see the module documentation): on every host `size` cores, placed by the
/// strategy as one job of that many cores on the empty host, are reserved inside `windows` for
/// the jobs whose estimate is at most `max_estimate`.
#[derive(Debug, Clone, PartialEq)]
pub struct Prime {
    /// Cores of each host in its pool.
    pub size: PoolSize,
    /// When the pools are reserved, in local time.
    pub windows: Vec<Window>,
    /// Jobs whose estimate is at most this many seconds are admitted.
    pub max_estimate: Time,
    /// What happens to jobs on a pool that it does not admit when a window opens.
    pub on_open: OnOpen,
    /// Seconds since the epoch at the caller's time 0 (a trace's `UnixStartTime`).
    pub epoch_at_zero: i64,
    /// Local time's offset east of UTC, seconds (one offset throughout: no daylight saving).
    pub utc_offset: i64,
}

impl Prime {
    /// Whether the pools admit a job.
    pub fn admits(&self, spec: &JobSpec) -> bool {
        spec.estimate <= self.max_estimate
    }

    /// The local time at the caller's time `t`.
    pub fn local_time(&self, t: Time) -> LocalTime {
        LocalTime::at(self.epoch_at_zero.saturating_add(t), self.utc_offset)
    }

    /// Whether a window is open at `t`.
    pub fn open_at(&self, t: Time) -> bool {
        let local = self.local_time(t);
        self.windows.iter().any(|w| w.open_at(local))
    }

    /// The first time after `t` at which a window opens or closes (a minute boundary of local
    /// time), or `None` without windows.
    pub fn next_change(&self, t: Time) -> Option<Time> {
        let local = self.epoch_at_zero.saturating_add(t).saturating_add(self.utc_offset);
        let day = local.div_euclid(86_400);
        let mut next: Option<i64> = None;
        // Every window edge within the next eight days (a week's windows repeat after seven).
        for d in day..=day + 8 {
            // 1970-01-01 was a Thursday (weekday 3).
            let weekday = (d + 3).rem_euclid(7) as usize;
            for w in self.windows.iter().filter(|w| w.days[weekday]) {
                for minute in [w.start, w.end] {
                    let edge = d * 86_400 + i64::from(minute) * 60;
                    if edge > local && next.is_none_or(|n| edge < n) {
                        next = Some(edge);
                    }
                }
            }
        }
        next.map(|edge| edge - self.utc_offset - self.epoch_at_zero)
    }
}

/// Why a running job was moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoveReason {
    /// To make room for a job refused on shape (defragmenting migration).
    Defrag,
    /// Out of a prime-time pool whose window opened, which does not admit it.
    PrimeWindow,
}

/// What the core has done, counted from its start (for reports).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Start attempts refused on shape on every host tried, although some had enough free
    /// cores (after migration, when it is on).
    pub refused_on_shape: u64,
    /// Jobs started after moves made room for them.
    pub defrag_starts: u64,
    /// Moves of running jobs for defragmentation.
    pub moves: u64,
    /// PUs of the jobs moved for defragmentation.
    pub moved_pus: u64,
    /// Moves out of prime-time pools at a window's opening.
    pub prime_moves: u64,
    /// Blocks set aside (a block made again elsewhere counts again; one made again on the same
    /// CPUs does not).
    pub blocks_made: u64,
    /// Queue heads that had blocks.
    pub reserved_heads: u64,
    /// Queue heads that started with every part inside their blocks.
    pub heads_in_block: u64,
    /// Jobs started that the prime-time pools admit.
    pub admitted_starts: u64,
    /// Waiting jobs backfilling passes looked at: the passes' work. An EASY pass, and a
    /// conservative one beyond its reservation depth, finds through the queue's index only the
    /// jobs that could start by their counts.
    pub backfill_looked_at: u64,
}

/// How malleable jobs are treated (see the module documentation): a job marked malleable that
/// asks for `p` processors and fits one host runs on `ceil(p / min_divisor)` to `p` of them, and
/// the malleable jobs of a host share what its rigid jobs leave by equipartition.
///
/// The default `min_divisor` is 4: a job may be shrunk to a quarter of its size. It bounds the
/// stretch of a job run at its least size to four times its run time (with linear speedup), so
/// that EASY's plan for it (its longest run) stays within a small multiple of its estimate,
/// while leaving a 16-processor job room to run on 4 beside others. It is this project's
/// choice, not a figure taken from a study.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malleability {
    /// A malleable job of `p` processors runs on at least `ceil(p / min_divisor)` (at least 1).
    pub min_divisor: u32,
}

impl Default for Malleability {
    fn default() -> Self {
        Malleability { min_divisor: 4 }
    }
}

impl Malleability {
    /// The range of processors of a malleable job that asks for `procs`.
    pub fn range(&self, procs: u32) -> (u32, u32) {
        (procs.div_ceil(self.min_divisor.max(1)).max(1).min(procs.max(1)), procs)
    }
}

/// What a job asks of the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobSpec {
    /// Processors (whole cores).
    pub procs: u32,
    /// Estimated run time, seconds: what backfilling plans with.
    pub estimate: Time,
    /// Whether the job may be resized while it runs (see [`Malleability`]); ignored unless the
    /// configuration has `malleable`, and for jobs larger than one host.
    pub malleable: bool,
}

impl JobSpec {
    /// A rigid job.
    pub fn rigid(procs: u32, estimate: Time) -> Self {
        JobSpec { procs, estimate, malleable: false }
    }
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
    /// The running job's owner (or an administrator, outside the policy) suspends it: its CPUs
    /// may go to other jobs until it is resumed. This suspension is not the policy's: it does
    /// not count toward [`Preempt::max_suspensions`], its resume does not restart
    /// [`Preempt::min_run`], and the policy never resumes it. Refused ([`Action::Refused`]) when
    /// the job is not running, or runs on CPUs a job suspended by preemption waits for (it would
    /// keep that job suspended as long as its owner liked).
    OwnerSuspend {
        /// The job.
        job: JobKey,
    },
    /// The owner resumes the job they suspended, on its own CPUs. Refused ([`Action::Refused`])
    /// for a job the owner did not suspend, while a running job holds any of its CPUs, and while
    /// a job suspended by preemption waits for any of them.
    OwnerResume {
        /// The job.
        job: JobKey,
    },
}

/// Why the core did not do what a job's owner asked ([`Event::OwnerSuspend`],
/// [`Event::OwnerResume`]). topod refuses the same requests for the same reasons.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// A suspend for a job that is not running (it waits, or is suspended already).
    #[error("the job is not running")]
    NotRunning,
    /// A resume for a job that is not suspended.
    #[error("the job is not suspended")]
    NotSuspended,
    /// A resume for a job suspended by preemption: the policy resumes it when its CPUs are free.
    #[error(
        "the job was suspended by preemption, not by its owner; it resumes when its CPUs are free"
    )]
    SuspendedByPolicy,
    /// A suspend for a job that runs on CPUs a job suspended by preemption waits for.
    #[error("the job runs on CPUs a job suspended by preemption waits for")]
    HoldsForSuspended,
    /// A resume while a running job holds some of its CPUs.
    #[error("some of the job's CPUs are lent to a running job")]
    Lent,
    /// A resume of a job some of whose CPUs a job suspended by preemption waits for (it ran on
    /// them while they were lent): that job resumes first.
    #[error("a job suspended by preemption waits for some of the job's CPUs")]
    WaitedFor,
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

/// The running ones of some jobs as [`gang_runs`] takes them: every part in one vector (sized
/// once: a job on many hosts has a part on each), and each job's row and how many parts it has.
struct GangParts<'a> {
    parts: Vec<(HostId, &'a CpuSet)>,
    jobs: Vec<(u32, usize)>,
}

impl<'a> GangParts<'a> {
    /// The running ones of `jobs`, in order.
    fn of(slots: &'a [Slot], jobs: &[JobKey]) -> Self {
        let running = jobs.iter().filter_map(|&job| match &slots[job as usize] {
            Slot::Running(r) => Some(r),
            _ => None,
        });
        let jobs: Vec<(u32, usize)> = running.clone().map(|r| (r.row, r.parts.len())).collect();
        let mut parts = Vec::with_capacity(jobs.iter().map(|&(_, n)| n).sum());
        for r in running {
            parts.extend(r.parts.iter().map(|p| (p.host, &p.placement.cpus)));
        }
        GangParts { parts, jobs }
    }

    /// [`gang_runs`]'s members, over these vectors.
    fn members(&self) -> Vec<GangMember<'_>> {
        let mut start = 0;
        let mut members = Vec::with_capacity(self.jobs.len());
        for &(row, n) in &self.jobs {
            members.push(GangMember { row, parts: &self.parts[start..start + n] });
            start += n;
        }
        members
    }
}

/// What gang slicing does over one period while nothing else happens
/// ([`PolicyCore::gang_cycle`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GangCycle {
    /// Slice length, seconds.
    pub slice: Time,
    /// The running jobs, each with the cores it holds.
    pub jobs: Vec<(JobKey, u64)>,
    /// Per slice of the period, from the one now is in: whether each job (in `jobs` order)
    /// runs in it.
    pub runs: Vec<Vec<bool>>,
}

/// [`PolicyCore::switch_gang`]'s memo: the generation it holds for, the running jobs by key,
/// and for each row (as the active one) which of them run, once worked out.
#[derive(Debug)]
struct GangPattern {
    generation: u64,
    jobs: Vec<JobKey>,
    runs: Vec<Option<Vec<bool>>>,
}

/// What an EASY pass found (generation, head, shadow time, reserved row, extra processors):
/// a pass that finds the same goes on where the last one stopped.
type PassState = (u64, JobKey, Time, u32, u64);

/// A conservative backfilling pass's plan, for the next pass to go on from.
#[derive(Debug)]
struct Conservative {
    /// The core's generation it was made at: any change of a host's occupancy plans again.
    generation: u64,
    /// Free processors over time, with the reservations of the jobs planned.
    profile: profile::Profile,
    /// The queue position before which every job has its reservation in `profile` (or started).
    planned: usize,
    /// The queue's numbering of positions then ([`WaitQueue::numbering`]).
    numbering: u64,
    /// The earliest reservation: when it comes, the pass plans again.
    due: Time,
    /// Reservations made (at most [`PolicyConfig::reservation_depth`]).
    reserved: usize,
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
    /// Suspend the job (freeze it; its CPUs go to others until it resumes).
    Suspend {
        /// The job.
        job: JobKey,
    },
    /// Resume the suspended job on its own CPUs.
    Resume {
        /// The job.
        job: JobKey,
    },
    /// Give the running malleable job these parts instead of its current ones: a shrink keeps
    /// its first tasks where they are, a grow adds tasks (see the module documentation). Its
    /// processors are its tasks.
    Resize {
        /// The job.
        job: JobKey,
        /// Its parts now (one: malleable jobs run on one host).
        parts: Vec<Part>,
    },
    /// Move the running job's part on one host to other CPUs of that host (the same number of
    /// tasks, its own request): a cpuset rewrite and a memory migration for topod.
    Move {
        /// The job.
        job: JobKey,
        /// All its parts, the moved one at its new place.
        parts: Vec<Part>,
        /// Why.
        why: MoveReason,
        /// Seconds the job makes no progress because of the move ([`PolicyConfig::move_cost`]).
        pause: Time,
    },
    /// Set these blocks aside for the waiting job, replacing any it had; none: its blocks are
    /// dropped. A job's start inside its blocks spends them without this action.
    Reserve {
        /// The waiting job (the queue's head).
        job: JobKey,
        /// Its blocks, per host.
        blocks: Vec<(HostId, CpuSet)>,
    },
    /// The owner's suspend or resume of the job ([`Event::OwnerSuspend`],
    /// [`Event::OwnerResume`]) was refused: nothing changed. An owner's request carried out
    /// comes out as [`Action::Suspend`] or [`Action::Resume`], before the instant's decisions.
    Refused {
        /// The job.
        job: JobKey,
        /// Why.
        why: Refusal,
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
    /// An owner's suspend or resume of a job the core does not know.
    #[error("job {job}'s owner asked to suspend or resume it, but it is neither running, waiting nor suspended")]
    OwnerOfUnknownJob {
        /// The job.
        job: JobKey,
    },
    /// An owner's suspension of a job the core does not model it for: a malleable one
    /// (equipartition would grow others into its CPUs).
    #[error("job {job} is {kind}: the policy core does not model its owner's suspension")]
    OwnerSuspensionNotModelled {
        /// The job.
        job: JobKey,
        /// What kind of job it is ("malleable").
        kind: &'static str,
    },
}

#[derive(Debug)]
struct HostState {
    model: Arc<HostModel>,
    /// Whole cores, all allocatable.
    cores: u32,
    /// The placement of a job taking the whole empty host (one answer; computed once per model).
    whole: Option<Arc<Placement>>,
    /// The most allocatable cores in one NUMA node (what a NUMA-local job may ask for).
    numa_cores: u32,
}

/// What a [`FreeView`] holds for: the core's generation and occupancy changes, whether the
/// pools are fenced and whether blocks bind.
type FreeViewKey = (u64, u64, bool, bool);

/// Free cores per host as a class of jobs counts them (see `PolicyCore::free_for`).
#[derive(Debug)]
struct FreeView {
    free: Vec<u32>,
    total: u64,
    by_free: BTreeMap<u32, HostBits>,
}

/// The blocks set aside for the queue's head (see the module documentation).
#[derive(Debug)]
struct Blocks {
    /// The head.
    head: JobKey,
    /// The shadow time and the core's generation they were made at: made again when either
    /// changes.
    shadow: Time,
    generation: u64,
    /// Per host: the head's cores there and the block.
    on: Vec<(HostId, u32, Reservation)>,
}

/// One row of the cluster: what its jobs hold on each host. Without gang slicing there is one.
#[derive(Debug)]
struct Row {
    occupancy: Vec<Occupancy>,
    /// Wholly free cores per host.
    free: Vec<u32>,
    /// Hosts by free cores (only counts some host has), each set by id.
    by_free: BTreeMap<u32, HostBits>,
    /// Free cores in the row.
    free_total: u64,
    /// Jobs started in the row and not ended.
    jobs: u32,
}

#[derive(Debug)]
struct Running {
    parts: Vec<Part>,
    procs: u32,
    estimated_end: Time,
    spec: JobSpec,
    submitted: Time,
    /// How long it has run, since when it is protected from preemption, and how often
    /// preemption suspended it (as topod's job records keep it).
    clock: RunClock,
    /// Its row (0 without gang slicing).
    row: u32,
    /// Frozen by gang slicing until its row's slice (it keeps its CPUs).
    frozen: bool,
    /// Its range and progress, when it runs malleable.
    flex: Option<Flex>,
    /// When it was last moved or resized (migration's delay timer).
    moved_at: Option<Time>,
    /// Whether it asked for one NUMA node (its moves keep that).
    numa_local: bool,
}

impl Running {
    /// The cores its parts made unavailable.
    fn held(&self) -> u64 {
        self.parts.iter().map(|p| u64::from(p.cores)).sum()
    }

    /// The cores no starting job can have while it runs: all it holds, or a malleable job's
    /// least size (the rest can be taken back by shrinking it).
    fn kept(&self) -> u64 {
        match &self.flex {
            Some(f) => u64::from(f.min),
            None => self.held(),
        }
    }

    /// Its expansion factor at `now` (see [`Preempt`]).
    fn xf(&self, now: Time) -> f64 {
        expansion_factor(now - self.submitted, self.estimated_end - now, self.spec.estimate)
    }
}

/// A malleable job's range and the part of its estimate still to run (see the module
/// documentation: its work drains at the rate of the processors it holds).
#[derive(Debug)]
struct Flex {
    /// Least processors.
    min: u32,
    /// Most processors.
    max: u32,
    /// Processors it runs on now (its tasks).
    procs: u32,
    /// Processor-seconds of its estimate still to run at `at`.
    work: u128,
    /// When `work` was last brought up to date.
    at: Time,
}

impl Flex {
    /// Brings the work left up to `now`.
    fn drain(&mut self, now: Time) {
        let elapsed = u128::try_from(now.saturating_sub(self.at)).unwrap_or(0);
        self.work = self.work.saturating_sub(elapsed * u128::from(self.procs));
        self.at = self.at.max(now);
    }

    /// When it ends by its estimate if it runs at its least size from `now` on.
    fn latest_end(&self, now: Time) -> Time {
        let elapsed = u128::try_from(now.saturating_sub(self.at)).unwrap_or(0);
        let work = self.work.saturating_sub(elapsed * u128::from(self.procs));
        let seconds = work.div_ceil(u128::from(self.min.max(1)));
        now.max(self.at).saturating_add(Time::try_from(seconds).unwrap_or(Time::MAX))
    }

    /// When it ends by its estimate at its present size (the last second rounded up).
    fn estimated_end(&self) -> Time {
        let seconds = self.work.div_ceil(u128::from(self.procs.max(1)));
        self.at.saturating_add(Time::try_from(seconds).unwrap_or(Time::MAX))
    }
}

/// The malleable jobs of one host, for equipartition.
#[derive(Debug, Clone, Default)]
struct FlexHost {
    /// Running malleable jobs, in the order they started (equipartition's tie order).
    jobs: Vec<JobKey>,
    /// The sum of their least sizes.
    mins: u32,
    /// The cores they hold beyond their least sizes: counted free for starting jobs.
    reclaim: u32,
}

/// A suspended job: what it had, how much of its estimate was left, and until when other jobs
/// may borrow its CPUs ([`may_borrow`]).
#[derive(Debug)]
struct Suspended {
    run: Running,
    remaining: Time,
    resume_by: Time,
    /// Suspended by its owner ([`Event::OwnerSuspend`]), not by preemption: any job may use its
    /// CPUs, nothing is held for it, and only its owner resumes it.
    by_owner: bool,
}

#[derive(Debug)]
enum Slot {
    Unknown,
    Waiting(JobSpec, Time),
    Running(Running),
    Suspended(Suspended),
}

/// The policy core's state and its decisions. See the module documentation.
#[derive(Debug)]
pub struct PolicyCore {
    config: PolicyConfig,
    hosts: Vec<HostState>,
    rows: Vec<Row>,
    /// Bumped whenever a host's occupancy changes: a backfill pass that finds the cluster, the
    /// head and its reservation as the last one left them starts where that one stopped.
    generation: u64,
    /// (generation, head, shadow time, reserved row, extra processors, queue numbering) of the
    /// last backfill pass, and the queue position it stopped at.
    backfilled: Option<(PassState, usize, u64)>,
    /// The last conservative pass's plan (see [`Conservative`]).
    conservative: Option<Conservative>,
    total: u64,
    jobs: Vec<Slot>,
    /// Waiting jobs, in arrival order, indexed by what they need.
    queue: WaitQueue,
    /// Running jobs by estimated end.
    ends: BTreeSet<(Time, JobKey)>,
    /// Suspended jobs.
    suspended: BTreeSet<JobKey>,
    /// Running jobs frozen by gang slicing.
    frozen: u32,
    /// Gang slicing's pattern while the running jobs stay the same: (generation, running jobs
    /// by key, for each active row which of them run). Slice after slice repeats it.
    gang_pattern: Option<GangPattern>,
    now: Time,
    /// Malleable jobs' rules, when they are in effect (not with preemption or gang slicing).
    malleable: Option<Malleability>,
    /// The most cores of a host: a malleable job must fit one.
    largest_host: u32,
    /// Per host, its malleable jobs (empty without `malleable`).
    flex: Vec<FlexHost>,
    /// The sum of the hosts' `reclaim`.
    reclaim_total: u64,
    /// Hosts whose malleable jobs are rebalanced at the end of the step.
    dirty: BTreeSet<HostId>,
    /// Jobs started malleable so far.
    malleable_started: u64,
    /// NUMA-local jobs, migration, reservations and prime time, as in effect (not with
    /// preemption or gang slicing).
    numa_local: bool,
    defrag: Option<Defrag>,
    reserve: bool,
    prime: Option<Prime>,
    /// Per host, its prime-time pool (empty without `prime`).
    pools: Vec<prime::Pool>,
    /// Whether a window was open at the last step.
    pools_open: bool,
    /// The head's blocks, with `reserve`.
    blocks: Option<Blocks>,
    /// Whether the blocks bind even the jobs that end before the head starts.
    strict_blocks: bool,
    /// The job being backfilled that ends by the shadow time, while it is started: the blocks
    /// do not bind it (unless strict).
    waived: Option<JobKey>,
    /// The last head counted in [`Counters::reserved_heads`].
    last_reserved: Option<JobKey>,
    /// Bumped at every change of an occupancy (unlike `generation`, also at a resize).
    occupancy_changes: u64,
    /// The last [`Self::free_for`] answer, with the (generation, occupancy changes, pools
    /// fenced, blocks binding) it holds for.
    free_views: Option<(FreeViewKey, Arc<FreeView>)>,
    /// The last [`Self::held_view`] answer: for the (generation, occupancy changes, suspended
    /// jobs whose CPUs are held from the asker) it holds for, the free counts and the CPUs held.
    held_views: Option<(HeldViewKey, Arc<HeldView>)>,
    counters: Counters,
}

/// (generation, occupancy changes, the suspended jobs whose CPUs a job may not borrow).
type HeldViewKey = (u64, u64, Vec<JobKey>);

/// The free counts a job starts by when it may not borrow some suspended jobs' CPUs, and those
/// CPUs per host.
type HeldView = (FreeView, BTreeMap<HostId, CpuSet>);

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
            let numa_cores = model
                .numa
                .iter()
                .map(|n| {
                    model
                        .cores
                        .iter()
                        .filter(|c| c.is_subset(n) && c.is_subset(&model.allocatable))
                        .count() as u32
                })
                .max()
                .unwrap_or(0);
            states.push(HostState { model, cores, whole, numa_cores });
        }
        let total = states.iter().map(|h| u64::from(h.cores)).sum();
        let largest_host = states.iter().map(|h| h.cores).max().unwrap_or(0);
        // Refused by both drivers' configuration; a core built with them anyway keeps its jobs
        // rigid.
        let malleable = config.malleable.filter(|_| {
            super::rules_conflict(config.preempt.is_some(), config.gang.is_some(), true).is_none()
        });
        let space = config.preempt.is_none() && config.gang.is_none();
        let prime = config.prime.clone().filter(|_| space);
        let pools = match &prime {
            Some(p) => Self::make_pools(&states, p, config.strategy),
            None => Vec::new(),
        };
        let flex =
            if malleable.is_some() { vec![FlexHost::default(); states.len()] } else { vec![] };
        let row_count = config.gang.map_or(1, |g| g.rows.max(1));
        let rows = (0..row_count)
            .map(|_| {
                let mut by_free: BTreeMap<u32, HostBits> = BTreeMap::new();
                for (i, h) in states.iter().enumerate() {
                    by_free.entry(h.cores).or_default().insert(i as HostId);
                }
                Row {
                    occupancy: vec![Occupancy::default(); states.len()],
                    free: states.iter().map(|h| h.cores).collect(),
                    by_free,
                    free_total: total,
                    jobs: 0,
                }
            })
            .collect();
        let (config_numa_local, config_defrag, config_strict) =
            (config.numa_local, config.defrag, config.reserve == Some(Reserve::Strict));
        let config_reserve = config.reserve.is_some();
        PolicyCore {
            config,
            hosts: states,
            rows,
            generation: 0,
            backfilled: None,
            conservative: None,
            total,
            jobs: Vec::new(),
            queue: WaitQueue::default(),
            ends: BTreeSet::new(),
            suspended: BTreeSet::new(),
            frozen: 0,
            gang_pattern: None,
            now: Time::MIN,
            malleable,
            largest_host,
            flex,
            reclaim_total: 0,
            dirty: BTreeSet::new(),
            malleable_started: 0,
            numa_local: config_numa_local && space,
            defrag: config_defrag.filter(|_| space),
            reserve: config_reserve && space,
            prime,
            pools,
            pools_open: false,
            blocks: None,
            strict_blocks: config_strict,
            waived: None,
            last_reserved: None,
            occupancy_changes: 0,
            free_views: None,
            held_views: None,
            counters: Counters::default(),
        }
    }

    /// Each host's prime-time pool: its share of cores placed by `strategy` as one job on the
    /// empty host (one answer per model).
    fn make_pools(states: &[HostState], prime: &Prime, strategy: Strategy) -> Vec<prime::Pool> {
        let mut cache: Vec<(*const HostModel, CpuSet)> = Vec::new();
        states
            .iter()
            .map(|h| {
                let key = Arc::as_ptr(&h.model);
                let cpus = match cache.iter().find(|(k, _)| *k == key) {
                    Some((_, c)) => c.clone(),
                    None => {
                        let request = cores_request(prime.size.of(h.cores));
                        let cpus =
                            start_on_host(&h.model, &Occupancy::default(), &request, strategy)
                                .map(|p| p.cpus)
                                .unwrap_or_default();
                        cache.push((key, cpus.clone()));
                        cpus
                    }
                };
                prime::Pool {
                    name: PRIME_POOL.to_string(),
                    cpus,
                    windows: prime.windows.clone(),
                    queues: Vec::new(),
                    users: Vec::new(),
                    named: true,
                    on_open: prime.on_open,
                }
            })
            .collect()
    }

    /// Processors (whole cores) in the cluster.
    pub fn total_procs(&self) -> u64 {
        self.total
    }

    /// Processors free now for a starting job (in the first row; without gang slicing there is
    /// one). The cores malleable jobs hold beyond their least sizes count as free: a start takes
    /// them back.
    pub fn free_procs(&self) -> u64 {
        self.rows[0].free_total
    }

    /// Processors of the jobs running now (not suspended, not frozen by gang slicing; malleable
    /// jobs at their present sizes).
    pub fn busy_procs(&self) -> u64 {
        if self.config.gang.is_none() {
            return self.total - self.rows[0].free_total + self.reclaim_total;
        }
        self.ends
            .iter()
            .filter_map(|&(_, job)| match &self.jobs[job as usize] {
                Slot::Running(r) if !r.frozen => Some(r.held()),
                _ => None,
            })
            .sum()
    }

    /// When the core wants a [`Event::Tick`] next although nothing else happens: the next gang
    /// slice boundary, while jobs of more than one row are running.
    ///
    /// With preemption: while jobs wait, the next instant at which the first of them could
    /// preempt where it could not before (its expansion factor reaching the threshold or passing
    /// a running job's, a running job reaching the least run), so that preemption is re-checked
    /// as time passes and not only when a job is submitted or ends.
    ///
    /// With prime-time pools: the next window change while it can matter, that is while a
    /// window is open and jobs wait (its close lets them onto the pools), or while none is open,
    /// jobs run and an opening moves them ([`OnOpen::Migrate`]).
    pub fn next_wakeup(&self) -> Option<Time> {
        if let Some(gang) = self.config.gang {
            let rows_in_use = self.rows.iter().filter(|r| r.jobs > 0).count();
            return (rows_in_use > 1).then(|| gang.next_boundary(self.now));
        }
        if let Some(rules) = &self.config.preempt {
            if self.now == Time::MIN {
                return None;
            }
            return self.next_preempt_check(rules);
        }
        let prime = self.prime.as_ref()?;
        if self.now == Time::MIN {
            return None;
        }
        let open = prime.open_at(self.now);
        let matters = if open {
            !self.queue.is_empty()
        } else {
            prime.on_open == OnOpen::Migrate && !self.ends.is_empty()
        };
        if matters {
            prime.next_change(self.now)
        } else {
            None
        }
    }

    /// What the core has done so far (moves, blocks, refusals on shape...).
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// The blocks set aside for the queue's head now, per host (with `reserve`).
    pub fn blocks(&self) -> Option<(JobKey, Vec<(HostId, CpuSet)>)> {
        let b = self.blocks.as_ref()?;
        Some((b.head, b.on.iter().map(|(h, _, r)| (*h, r.cpus.clone())).collect()))
    }

    /// The CPUs of a host's prime-time pool (empty without pools).
    pub fn pool_cpus(&self, host: HostId) -> CpuSet {
        self.pools.get(host as usize).map(|p| p.cpus.clone()).unwrap_or_default()
    }

    /// Jobs waiting.
    pub fn queue_len(&self) -> usize {
        self.queue.len()
    }

    /// Jobs running.
    pub fn running_len(&self) -> usize {
        self.ends.len()
    }

    /// Jobs suspended.
    pub fn suspended_len(&self) -> usize {
        self.suspended.len()
    }

    /// Jobs started malleable so far (see [`Malleability`]).
    pub fn malleable_started(&self) -> u64 {
        self.malleable_started
    }

    /// The malleable jobs running on a host, in the order they started, with their processors.
    pub fn malleable_on(&self, host: HostId) -> Vec<(JobKey, u32)> {
        let Some(f) = self.flex.get(host as usize) else { return Vec::new() };
        f.jobs.iter().map(|&job| (job, self.flex_of(job).map_or(0, |fl| fl.procs))).collect()
    }

    /// The occupancy of a host (in the first row; without gang slicing there is one).
    pub fn occupancy(&self, host: HostId) -> &Occupancy {
        &self.rows[0].occupancy[host as usize]
    }

    /// The occupancy of a host in a gang row.
    pub fn row_occupancy(&self, row: u32, host: HostId) -> &Occupancy {
        &self.rows[row as usize].occupancy[host as usize]
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
    /// do. When the core cannot take one of the events, the whole batch is refused with that
    /// event's error and nothing changed (not even the clock), so that no action taken on an
    /// event before it goes untold.
    pub fn step(
        &mut self,
        now: Time,
        events: impl IntoIterator<Item = Event>,
    ) -> Result<Vec<Action>, PolicyError> {
        let events: Vec<Event> = events.into_iter().collect();
        self.check_events(&events)?;
        self.now = self.now.max(now);
        let mut actions = Vec::new();
        for event in events {
            match event {
                Event::Submit { job, spec } => self.submit(job, spec)?,
                Event::End { job } => self.end(job)?,
                Event::Tick => {}
                Event::OwnerSuspend { job } => self.owner_suspend(job, &mut actions)?,
                Event::OwnerResume { job } => self.owner_resume(job, &mut actions)?,
            }
        }
        self.schedule(&mut actions);
        Ok(actions)
    }

    /// Whether every event of a batch can be taken, in order (a job submitted earlier in the
    /// batch is known to the later events, one ended is not): the first that cannot, as its
    /// error.
    fn check_events(&self, events: &[Event]) -> Result<(), PolicyError> {
        // Jobs whose being known the batch changed so far: submitted (true) or ended (false).
        let mut changed: BTreeMap<JobKey, bool> = BTreeMap::new();
        let known = |changed: &BTreeMap<JobKey, bool>, job: JobKey| {
            changed.get(&job).copied().unwrap_or_else(|| {
                !matches!(self.jobs.get(job as usize), None | Some(Slot::Unknown))
            })
        };
        for event in events {
            match *event {
                Event::Submit { job, spec } => {
                    self.admissible(job, spec)?;
                    if known(&changed, job) {
                        return Err(PolicyError::Duplicate { job });
                    }
                    changed.insert(job, true);
                }
                Event::End { job } => {
                    if !known(&changed, job) {
                        return Err(PolicyError::UnknownJob { job });
                    }
                    changed.insert(job, false);
                }
                Event::OwnerSuspend { job } | Event::OwnerResume { job } => {
                    if !known(&changed, job) {
                        return Err(PolicyError::OwnerOfUnknownJob { job });
                    }
                    let suspend = matches!(event, Event::OwnerSuspend { .. });
                    if let (true, None, Some(Slot::Running(r))) =
                        (suspend, changed.get(&job), self.jobs.get(job as usize))
                    {
                        if r.flex.is_some() {
                            let kind = "malleable";
                            return Err(PolicyError::OwnerSuspensionNotModelled { job, kind });
                        }
                    }
                }
                Event::Tick => {}
            }
        }
        Ok(())
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
        let now = self.now;
        let slot = self.slot(job);
        if !matches!(slot, Slot::Unknown) {
            return Err(PolicyError::Duplicate { job });
        }
        *slot = Slot::Waiting(spec, now);
        let need = self.need(&spec);
        let run = self.longest_run(&spec, self.stretch());
        self.queue.push(job, need, run);
        Ok(())
    }

    fn end(&mut self, job: JobKey) -> Result<(), PolicyError> {
        let slot = self.jobs.get_mut(job as usize).ok_or(PolicyError::UnknownJob { job })?;
        match std::mem::replace(slot, Slot::Unknown) {
            Slot::Running(r) => {
                self.ends.remove(&(r.estimated_end, job));
                if !self.flex.is_empty() {
                    for p in &r.parts {
                        let host = p.host as usize;
                        if r.flex.is_some() {
                            self.flex[host].jobs.retain(|j| *j != job);
                            self.refresh_flex(p.host);
                        }
                        if !self.flex[host].jobs.is_empty() {
                            self.dirty.insert(p.host);
                        }
                    }
                }
                self.give_back(r.row, &r.parts);
                self.rows[r.row as usize].jobs -= 1;
                self.frozen -= u32::from(r.frozen);
                Ok(())
            }
            Slot::Waiting(..) => {
                // Cancelled while waiting (queue positions change: no backfill pass resumes).
                self.queue.remove(job);
                self.generation += 1;
                Ok(())
            }
            Slot::Suspended(s) => {
                // Killed while suspended: its CPUs are not held by it, except a gang job's,
                // which its row kept through its owner's suspension.
                self.suspended.remove(&job);
                if self.config.gang.is_some() {
                    self.give_back(s.run.row, &s.run.parts);
                }
                self.rows[s.run.row as usize].jobs -= 1;
                Ok(())
            }
            Slot::Unknown => Err(PolicyError::UnknownJob { job }),
        }
    }

    /// [`Event::OwnerSuspend`]: the job leaves its CPUs (any job may use them) and keeps what is
    /// left of its estimate; its suspension count and its protection from preemption are its
    /// own and stay.
    fn owner_suspend(&mut self, job: JobKey, actions: &mut Vec<Action>) -> Result<(), PolicyError> {
        let why = match self.jobs.get(job as usize) {
            None | Some(Slot::Unknown) => return Err(PolicyError::OwnerOfUnknownJob { job }),
            Some(Slot::Waiting(..) | Slot::Suspended(_)) => Some(Refusal::NotRunning),
            Some(Slot::Running(r)) => {
                if r.flex.is_some() {
                    return Err(PolicyError::OwnerSuspensionNotModelled { job, kind: "malleable" });
                }
                self.holds_for_suspended(r).then_some(Refusal::HoldsForSuspended)
            }
        };
        if let Some(why) = why {
            actions.push(Action::Refused { job, why });
            return Ok(());
        }
        let Slot::Running(mut r) = std::mem::replace(&mut self.jobs[job as usize], Slot::Unknown)
        else {
            unreachable!("checked running above");
        };
        r.clock.stop(self.now, Stopper::Outside);
        self.ends.remove(&(r.estimated_end, job));
        if self.config.gang.is_some() {
            // A gang job keeps its place in its row and leaves the row's turns (frozen or
            // not): the other rows' jobs may run on its CPUs in its slices (the instant's gang
            // switch), as topod's ledger has it. (Its CPUs stay taken: the running jobs change.)
            if std::mem::take(&mut r.frozen) {
                self.frozen -= 1;
            }
            self.generation += 1;
        } else {
            self.give_back(r.row, &r.parts);
        }
        let remaining = (r.estimated_end - self.now).max(0);
        // Nothing is held for it: every job may borrow its CPUs (its resume waits for them).
        let resume_by = Time::MAX;
        self.jobs[job as usize] =
            Slot::Suspended(Suspended { run: r, remaining, resume_by, by_owner: true });
        self.suspended.insert(job);
        actions.push(Action::Suspend { job });
        Ok(())
    }

    /// [`Event::OwnerResume`]: the job takes its own CPUs back when no running job holds them;
    /// a gang job, which kept them in its row, goes back to taking turns (the instant's gang
    /// switch freezes it again when the slice is not its row's). It counts as running since
    /// its start (or its last resume after preemption) for [`Preempt::min_run`], so that an
    /// owner's suspend and resume never shield it.
    fn owner_resume(&mut self, job: JobKey, actions: &mut Vec<Action>) -> Result<(), PolicyError> {
        let why = match self.jobs.get(job as usize) {
            None | Some(Slot::Unknown) => return Err(PolicyError::OwnerOfUnknownJob { job }),
            Some(Slot::Waiting(..) | Slot::Running(_)) => Some(Refusal::NotSuspended),
            Some(Slot::Suspended(s)) if !s.by_owner => Some(Refusal::SuspendedByPolicy),
            Some(Slot::Suspended(_)) if self.config.gang.is_some() => None,
            Some(Slot::Suspended(s)) if !self.free_again(&s.run) => Some(Refusal::Lent),
            Some(Slot::Suspended(s)) => self.waited_for(job, &s.run).then_some(Refusal::WaitedFor),
        };
        if let Some(why) = why {
            actions.push(Action::Refused { job, why });
            return Ok(());
        }
        self.resume_suspended(job);
        actions.push(Action::Resume { job });
        Ok(())
    }

    /// Whether none of the suspended job's CPUs (nor those it fences) is held by a running job,
    /// nor any CPU it holds fenced by one.
    fn free_again(&self, run: &Running) -> bool {
        run.parts.iter().all(|p| {
            let occ = &self.rows[0].occupancy[p.host as usize];
            !p.placement.cpus.intersects(&occ.held)
                && !p.placement.cpus.intersects(&occ.fenced)
                && !p.placement.fenced.intersects(&occ.held)
        })
    }

    /// Whether another job suspended by preemption (not by its owner) waits for some of `run`'s
    /// CPUs: `run` may not take them, running or resumed.
    fn waited_for(&self, job: JobKey, run: &Running) -> bool {
        self.suspended.iter().filter(|&&o| o != job).any(|&o| match &self.jobs[o as usize] {
            Slot::Suspended(other) if !other.by_owner => overlap(&run.parts, &other.run.parts),
            _ => false,
        })
    }

    /// Puts the suspended `job` back on its CPUs, running on what was left of its estimate.
    /// After a preemption it counts as running from now for [`Preempt::min_run`]; after its
    /// owner's suspension, from when it did before.
    fn resume_suspended(&mut self, job: JobKey) {
        let Slot::Suspended(s) = std::mem::replace(&mut self.jobs[job as usize], Slot::Unknown)
        else {
            return;
        };
        let mut run = s.run;
        if self.config.gang.is_none() {
            for p in &run.parts {
                self.take(0, p.host, &p.placement);
            }
        } else {
            // Back among the running jobs, on CPUs its row kept.
            self.generation += 1;
        }
        run.estimated_end = self.now.saturating_add(s.remaining);
        run.clock.resume(self.now, if s.by_owner { Stopper::Outside } else { Stopper::Preemption });
        self.ends.insert((run.estimated_end, job));
        self.suspended.remove(&job);
        self.jobs[job as usize] = Slot::Running(run);
    }

    fn spec(&self, job: JobKey) -> JobSpec {
        match &self.jobs[job as usize] {
            Slot::Waiting(spec, _) => *spec,
            _ => unreachable!("only waiting jobs are queued"),
        }
    }

    fn schedule(&mut self, actions: &mut Vec<Action>) {
        self.open_windows(actions);
        // What the instant's ends freed goes to the malleable jobs beside them first, as topod
        // shares it out at a release, before it hears of the jobs the batch system starts next
        // (their starts shrink them again).
        self.rebalance_dirty(actions);
        self.resume_what_fits(actions);
        while let Some(head) = self.queue.front() {
            let spec = self.spec(head);
            if !self.try_start_in_any_row(head, spec, actions) {
                break;
            }
            self.queue.pop_front();
        }
        self.drop_stale_blocks(actions);
        if self.config.preempt.is_some() && self.config.gang.is_none() {
            if let Some(head) = self.queue.front() {
                if self.preempt_for(head, actions) {
                    self.queue.pop_front();
                }
            }
        }
        let backfilling = match self.config.order {
            QueueOrder::Fcfs => false,
            QueueOrder::Easy => true,
            QueueOrder::Conservative if self.conservative_applies() => {
                if self.queue.len() >= 2 && self.rows[0].free_total > 0 {
                    self.backfill_conservative(actions);
                }
                false
            }
            // With gang rows, malleable jobs or preemption: EASY's pass.
            QueueOrder::Conservative => true,
        };
        if backfilling && self.queue.len() >= 2 && self.rows.iter().any(|r| r.free_total > 0) {
            self.backfill(actions);
        }
        self.rebalance_dirty(actions);
        self.switch_gang(actions);
    }

    /// Whether conservative backfilling runs as such: one row, rigid jobs, no preemption.
    fn conservative_applies(&self) -> bool {
        self.config.gang.is_none() && self.malleable.is_none() && self.config.preempt.is_none()
    }

    /// Conservative backfilling's pass (see the module documentation): every waiting job, in
    /// queue order, is reserved at the earliest time it fits in the profile of free processors
    /// (the running jobs' estimated ends, the reservations before it); one whose time is now is
    /// started. While no host's occupancy changes and no reservation's time has come, the next
    /// pass goes on from the same profile with the jobs submitted since (the reservations of
    /// those before them stand). It stops when nothing is free now: later jobs are planned by
    /// a later pass, in order.
    fn backfill_conservative(&mut self, actions: &mut Vec<Action>) {
        let depth = self.config.reservation_depth.map_or(usize::MAX, |d| d as usize);
        let (mut profile, mut at, mut due, mut reserved) = match self.conservative.take() {
            Some(plan)
                if plan.generation == self.generation
                    && self.now < plan.due
                    && self.queue.carry(plan.planned, plan.numbering).is_some() =>
            {
                let mut profile = plan.profile;
                profile.advance(self.now);
                let planned = self.queue.carry(plan.planned, plan.numbering).unwrap_or(0);
                (profile, planned, plan.due, plan.reserved)
            }
            _ => {
                let ends =
                    self.ends.iter().filter_map(|&(end, job)| match &self.jobs[job as usize] {
                        Slot::Running(r) => Some((end, r.held())),
                        _ => None,
                    });
                (profile::Profile::new(self.now, self.rows[0].free_total, ends), 0, Time::MAX, 0)
            }
        };
        while profile.free_now() > 0 {
            // Beyond the depth only a job that starts now matters: the queue's index passes over
            // those whose size and estimate cannot fit the profile's first two steps.
            let next = if reserved >= depth {
                let (free, lasting, then) = profile.first_drop();
                self.queue.first_candidate(at, then, free, lasting)
            } else {
                self.queue.next_from(at)
            };
            let Some((position, job)) = next else {
                at = self.queue.end();
                break;
            };
            at = position + 1;
            self.counters.backfill_looked_at += 1;
            let spec = self.spec(job);
            let (need, run) = (u64::from(spec.procs), spec.estimate.max(1));
            let mut at = profile.earliest(need, run);
            if at == Some(profile.now()) {
                let free_before = self.rows[0].free_total;
                if self.try_start(job, spec, 0, actions) {
                    // What it took (a strategy may take more than asked), for its estimate.
                    let took = free_before.saturating_sub(self.rows[0].free_total);
                    profile.take(self.now, run, took);
                    self.queue.remove(job);
                    continue;
                }
                // Enough processors, not in a shape it fits: the next time they may be.
                at = profile.earliest_later(need, run);
            }
            // Beyond the depth a job that cannot start now gets no reservation.
            if let Some(at) = at.filter(|_| reserved < depth) {
                profile.take(at, run, need);
                due = due.min(at);
                reserved += 1;
            }
        }
        self.conservative = Some(Conservative {
            generation: self.generation,
            profile,
            planned: at,
            numbering: self.queue.numbering(),
            due,
            reserved,
        });
    }

    /// How much longer than its estimate a job may take in the wall clock: `rows` with gang
    /// slicing (it runs at least one slice in every `rows`), else 1.
    fn stretch(&self) -> Time {
        Time::from(self.config.gang.map_or(1, |g| g.rows.max(1)))
    }

    /// EASY's pass behind the head (see the module documentation). With gang slicing the head's
    /// reservation is in the row where enough processors are free soonest; a later job may start
    /// in any other row where it fits, and in that row under EASY's rule.
    fn backfill(&mut self, actions: &mut Vec<Action>) {
        let Some(head_job) = self.queue.front() else { return };
        let head = self.spec(head_job);
        let head_need = self.need(&head);
        let (shadow, reserved, mut extra) = (0..self.rows.len() as u32)
            .map(|row| {
                let (at, spare) = self.shadow(row, head_need);
                (at, row, spare)
            })
            .min_by_key(|&(at, row, _)| (at, row))
            .unwrap_or((Time::MAX, 0, 0));
        if self.reserve {
            self.reserve_for(head_job, head, shadow, actions);
        }
        let stretch = self.stretch();
        // A pass over the same cluster, head and reservation as the last one: the jobs that
        // pass looked at were refused, and later they end later still, so they are refused
        // again; only the jobs submitted since are new.
        let state = (self.generation, head_job, shadow, reserved, extra);
        let mut at = match self.backfilled {
            Some((last, stopped, numbering)) if last == state => {
                self.queue.carry(stopped, numbering).unwrap_or(0)
            }
            _ => 0,
        };
        // The jobs that could start by their counts alone, from the queue's index: a pass
        // visits those, not every job waiting.
        let within = shadow.saturating_sub(self.now);
        while self.rows.iter().any(|r| r.free_total > 0) {
            let in_reserved = self.rows[reserved as usize].free_total;
            let elsewhere = (0..self.rows.len())
                .filter(|&r| r != reserved as usize)
                .map(|r| self.rows[r].free_total)
                .max()
                .unwrap_or(0);
            let any = elsewhere.max(extra.min(in_reserved));
            let Some((position, job)) = self.queue.first_candidate(at, any, in_reserved, within)
            else {
                at = self.queue.end();
                break;
            };
            at = position + 1;
            if job == head_job {
                continue;
            }
            self.counters.backfill_looked_at += 1;
            let spec = self.spec(job);
            let need = self.need(&spec);
            let ends_in_time = self.now.saturating_add(self.longest_run(&spec, stretch)) <= shadow;
            let fits_beside = u64::from(need) <= extra;
            let mut started = false;
            for row in 0..self.rows.len() as u32 {
                let free_before = self.rows[row as usize].free_total;
                if u64::from(need) > free_before {
                    continue;
                }
                if row == reserved && !(ends_in_time || fits_beside) {
                    continue;
                }
                // A job that ends by the shadow time (by its estimate) is out of the head's
                // way before it starts: the blocks do not bind it, unless they are strict.
                self.waived = (ends_in_time && !self.strict_blocks).then_some(job);
                let started_now = self.try_start(job, spec, row, actions);
                self.waived = None;
                if started_now {
                    if row == reserved && !ends_in_time {
                        // The cores it made unavailable (a strategy may take more than asked).
                        extra =
                            extra.saturating_sub(free_before - self.rows[row as usize].free_total);
                    }
                    started = true;
                    break;
                }
            }
            if started {
                self.queue.remove(job);
            }
        }
        let state = (self.generation, head_job, shadow, reserved, extra);
        self.backfilled = Some((state, at, self.queue.numbering()));
    }

    /// What gang slicing will do from now on while no job is submitted or ends, for a driver
    /// that skips whole periods of slices (the simulator): `None` unless that is all that can
    /// happen at the slice boundaries ahead, that is with gang slicing, at least two rows in
    /// use, no switch cost (a cost moves estimated ends, and so EASY's reservation), and `now`
    /// at a boundary after the core has stepped there. Then no boundary can start a job:
    /// the free cores stay as they are, and every waiting job's room beside the head's
    /// reservation only shrinks as time passes.
    pub fn gang_cycle(&mut self) -> Option<GangCycle> {
        let gang = self.config.gang?;
        if self.config.switch_cost > 0
            || self.now.rem_euclid(gang.slice.max(1)) != 0
            || self.rows.iter().filter(|r| r.jobs > 0).count() < 2
        {
            return None;
        }
        let pattern = self.gang_pattern.as_mut().filter(|p| p.generation == self.generation)?;
        let rows = gang.rows.max(1);
        let active = gang.active_row(self.now) % rows;
        // Every row's turn, worked out now if it was not yet (the same running jobs give it).
        if pattern.runs.iter().any(Option::is_none) {
            let parts = GangParts::of(&self.jobs, &pattern.jobs);
            let members = parts.members();
            if members.len() != pattern.jobs.len() {
                return None;
            }
            for (row, runs) in pattern.runs.iter_mut().enumerate() {
                if runs.is_none() {
                    *runs = Some(gang_runs(row as u32, gang.rows, &members));
                }
            }
        }
        let mut jobs = Vec::with_capacity(pattern.jobs.len());
        for &job in &pattern.jobs {
            let Slot::Running(r) = &self.jobs[job as usize] else { return None };
            jobs.push((job, r.held()));
        }
        let runs: Vec<Vec<bool>> = (0..rows)
            .map(|k| pattern.runs[((active + k) % rows) as usize].clone().unwrap_or_default())
            .collect();
        // The slice now is in must be as the core left it.
        let now_runs = &runs[0];
        let as_left = pattern.jobs.iter().zip(now_runs).all(
            |(&job, &run)| matches!(&self.jobs[job as usize], Slot::Running(r) if r.frozen != run),
        );
        as_left.then_some(GangCycle { slice: gang.slice.max(1), jobs, runs })
    }

    /// Moves the core's clock `periods` whole gang periods on (each `rows` slices) from a
    /// boundary at which [`Self::gang_cycle`] answered: each row has had its turn `periods`
    /// times, and the core stands as it stood (the same row's slice, the same jobs frozen).
    /// The driver accounts for what the slices did ([`GangCycle`]).
    pub fn skip_gang_periods(&mut self, periods: u64) {
        if let Some(gang) = self.config.gang {
            let period = gang.slice.max(1).saturating_mul(i64::from(gang.rows.max(1)));
            let by = period.saturating_mul(i64::try_from(periods).unwrap_or(i64::MAX));
            self.now = self.now.saturating_add(by);
        }
    }

    /// Freezes and thaws gang jobs for the slice `now` falls in (see [`gang_runs`]): the
    /// freezes first, so that no CPU runs two jobs at once.
    fn switch_gang(&mut self, actions: &mut Vec<Action>) {
        let Some(gang) = self.config.gang else { return };
        if self.frozen == 0 && self.rows.iter().filter(|r| r.jobs > 0).count() < 2 {
            return;
        }
        // While the running jobs stay the same (the generation counts every start, end, and
        // owner's suspension or resume), each row's turn repeats the pattern worked out for it.
        let active = (gang.active_row(self.now) % gang.rows.max(1)) as usize;
        let mut pattern = match self.gang_pattern.take() {
            Some(p) if p.generation == self.generation => p,
            _ => {
                let mut jobs: Vec<JobKey> = self.ends.iter().map(|&(_, job)| job).collect();
                jobs.sort_unstable();
                let rows = gang.rows.max(1) as usize;
                GangPattern { generation: self.generation, jobs, runs: vec![None; rows] }
            }
        };
        if pattern.runs[active].is_none() {
            let parts = GangParts::of(&self.jobs, &pattern.jobs);
            pattern.runs[active] = Some(gang_runs(active as u32, gang.rows, &parts.members()));
        }
        let mut thaw = Vec::new();
        let runs = pattern.runs[active].as_deref().unwrap_or_default();
        for (&job, &runs) in pattern.jobs.iter().zip(runs) {
            let Slot::Running(r) = &mut self.jobs[job as usize] else { continue };
            if r.frozen != runs {
                continue;
            }
            r.frozen = !runs;
            if runs {
                self.frozen -= 1;
                thaw.push(Action::Resume { job });
            } else {
                self.frozen += 1;
                let cost = self.config.switch_cost.max(0);
                if cost > 0 {
                    // Its progress lost to the switch: it ends that much later.
                    self.ends.remove(&(r.estimated_end, job));
                    r.estimated_end = r.estimated_end.saturating_add(cost);
                    self.ends.insert((r.estimated_end, job));
                }
                actions.push(Action::Suspend { job });
            }
        }
        actions.extend(thaw);
        self.gang_pattern = Some(pattern);
    }

    /// The head's reservation in `row`: the earliest estimated end by which `procs` are free,
    /// and how many processors beyond its need are free then.
    fn shadow(&self, row: u32, procs: u32) -> (Time, u64) {
        if self.malleable.is_some() {
            return self.shadow_with_malleable(procs);
        }
        let need = u64::from(procs);
        let mut free = self.rows[row as usize].free_total;
        let mut ends = self.ends.iter().peekable();
        // By estimated end, every job ending at one second together: the head's reservation
        // counts all the cores free at that second (not only up to the job that was enough).
        while let Some(&&(end, _)) = ends.peek() {
            while let Some(&&(at, job)) = ends.peek() {
                if at != end {
                    break;
                }
                match &self.jobs[job as usize] {
                    Slot::Running(r) if r.row == row => free += r.kept(),
                    _ => {}
                }
                ends.next();
            }
            if free >= need {
                return (end, free - need);
            }
        }
        // Unreachable for an admissible job (all running jobs ending frees the whole cluster).
        (Time::MAX, 0)
    }

    /// [`Self::shadow`] with malleable jobs: each ends at the latest its estimate allows, at its
    /// least size from now on, since a start may shrink it to that at any time, and frees its
    /// least size then (the rest counts as free already).
    fn shadow_with_malleable(&self, procs: u32) -> (Time, u64) {
        let need = u64::from(procs);
        let mut free = self.rows[0].free_total;
        let mut ends: Vec<(Time, u64)> = self
            .ends
            .iter()
            .filter_map(|&(end, job)| match &self.jobs[job as usize] {
                Slot::Running(r) => match &r.flex {
                    Some(f) => Some((f.latest_end(self.now), r.kept())),
                    None => Some((end, r.kept())),
                },
                _ => None,
            })
            .collect();
        ends.sort_unstable();
        let mut i = 0;
        while i < ends.len() {
            let at = ends[i].0;
            while i < ends.len() && ends[i].0 == at {
                free += ends[i].1;
                i += 1;
            }
            if free >= need {
                return (at, free - need);
            }
        }
        (Time::MAX, 0)
    }

    /// Starts `job` now in the first row where hosts and CPUs can be found for it.
    fn try_start_in_any_row(
        &mut self,
        job: JobKey,
        spec: JobSpec,
        actions: &mut Vec<Action>,
    ) -> bool {
        (0..self.rows.len() as u32).any(|row| self.try_start(job, spec, row, actions))
    }

    /// Starts `job` now in `row` if hosts and CPUs can be found for it there.
    fn try_start(
        &mut self,
        job: JobKey,
        spec: JobSpec,
        row: u32,
        actions: &mut Vec<Action>,
    ) -> bool {
        if let Some(range) = self.malleable_range(&spec) {
            return self.try_start_malleable(job, spec, range, actions);
        }
        if self.space_options() {
            return self.try_start_in_space(job, spec, actions);
        }
        if u64::from(spec.procs) > self.rows[row as usize].free_total {
            return false;
        }
        let held_view = self.held_view(job, spec, row);
        let choice = match &held_view {
            None => self.choose_hosts(row, spec.procs),
            Some(view) if u64::from(spec.procs) > view.0.total => return false,
            Some(view) => choose_hosts_in(&view.0.by_free, spec.procs),
        };
        let Some(choice) = choice else { return false };
        let mut parts = Vec::with_capacity(choice.len());
        for (host, cores) in choice {
            if self.flex.get(host as usize).is_some_and(|f| !f.jobs.is_empty()) {
                // Make room: the malleable jobs there share what this job leaves them.
                self.shrink_for(host, cores, actions);
                self.dirty.insert(host);
            }
            let h = &self.hosts[host as usize];
            let r = &self.rows[row as usize];
            let empty = r.free[host as usize] == h.cores;
            let fence = held_view.as_ref().and_then(|v| v.1.get(&host));
            let fenced;
            let occupancy = match fence {
                None => &r.occupancy[host as usize],
                Some(cpus) => {
                    let mut occ = r.occupancy[host as usize].clone();
                    occ.fenced.union_with(cpus);
                    fenced = occ;
                    &fenced
                }
            };
            let placement = match &h.whole {
                // The whole of an empty host: placed once, when the core was made.
                Some(whole) if cores == h.cores && empty && fence.is_none() => Arc::clone(whole),
                _ => {
                    // A suspended job's CPUs are borrowed only where the job fits nowhere else
                    // (as topod does): a borrower keeps it from resuming until it ends.
                    let request = cores_request(cores);
                    let unlent = self.suspended_cpus_on(host).map(|cpus| {
                        let mut occ = occupancy.clone();
                        occ.fenced.union_with(&cpus);
                        occ
                    });
                    let strategy = self.config.strategy;
                    let place = |occ: &Occupancy| start_on_host(&h.model, occ, &request, strategy);
                    let placed = match unlent.as_ref().map(place) {
                        Some(Ok(p)) => Ok(p),
                        _ => place(occupancy),
                    };
                    match placed {
                        Ok(p) => Arc::new(p),
                        Err(_) => {
                            // Counts said yes, the host said no (a strategy that cannot place a
                            // plain count here): undo what this job took and leave it waiting.
                            self.give_back(row, &parts);
                            return false;
                        }
                    }
                }
            };
            let held = self.take(row, host, &placement);
            parts.push(Part { host, cores: held, placement });
        }
        self.record_start(job, spec, row, parts, false, actions);
        true
    }

    /// The CPUs of the jobs suspended by preemption on `host`, when there are any.
    fn suspended_cpus_on(&self, host: HostId) -> Option<CpuSet> {
        let mut cpus = CpuSet::new();
        for &v in &self.suspended {
            if let Slot::Suspended(s) = &self.jobs[v as usize] {
                for p in s.run.parts.iter().filter(|p| p.host == host) {
                    cpus.union_with(&p.placement.cpus);
                }
            }
        }
        (!cpus.is_empty()).then_some(cpus)
    }

    /// The free counts `job` may start by, and the CPUs per host it must stay off, when jobs
    /// suspended by preemption hold CPUs it may not borrow ([`may_borrow`]: it would end after
    /// they may resume); `None` when there are none. Kept until the cluster changes.
    fn held_view(&mut self, job: JobKey, spec: JobSpec, row: u32) -> Option<Arc<HeldView>> {
        if self.suspended.is_empty() || row != 0 {
            return None;
        }
        let ends_by = self.now.saturating_add(spec.estimate.saturating_mul(self.stretch()));
        let binding: Vec<JobKey> = self
            .suspended
            .iter()
            .copied()
            .filter(|&v| match &self.jobs[v as usize] {
                Slot::Suspended(s) => {
                    !s.by_owner && v != job && !may_borrow(Some(ends_by), Some(s.resume_by))
                }
                _ => false,
            })
            .collect();
        if binding.is_empty() {
            return None;
        }
        let key = (self.generation, self.occupancy_changes, binding);
        if let Some((k, view)) = &self.held_views {
            if *k == key {
                return Some(Arc::clone(view));
            }
        }
        let mut fences: BTreeMap<HostId, CpuSet> = BTreeMap::new();
        for v in &key.2 {
            if let Slot::Suspended(s) = &self.jobs[*v as usize] {
                for p in &s.run.parts {
                    fences.entry(p.host).or_default().union_with(&p.placement.cpus);
                }
            }
        }
        let answer = Arc::new((self.fenced_view(&fences), fences));
        self.held_views = Some((key, Arc::clone(&answer)));
        Some(answer)
    }

    /// Records the start of the rigid `job` with `parts` (taken already) and tells the driver.
    /// A head that starts spends its blocks.
    fn record_start(
        &mut self,
        job: JobKey,
        spec: JobSpec,
        row: u32,
        parts: Vec<Part>,
        numa_local: bool,
        actions: &mut Vec<Action>,
    ) {
        self.rows[row as usize].jobs += 1;
        let estimated_end = self.now.saturating_add(spec.estimate.saturating_mul(self.stretch()));
        self.ends.insert((estimated_end, job));
        let submitted = match &self.jobs[job as usize] {
            Slot::Waiting(_, at) => *at,
            _ => self.now,
        };
        if let Some(b) = self.blocks.take_if(|b| b.head == job) {
            let inside = parts.iter().all(|p| {
                b.on.iter().any(|(h, _, r)| *h == p.host && p.placement.cpus.is_subset(&r.cpus))
            });
            self.counters.heads_in_block += u64::from(inside);
            // Other jobs may use what the blocks held: backfill passes start over.
            self.generation += 1;
        }
        if self.prime.as_ref().is_some_and(|p| p.admits(&spec)) {
            self.counters.admitted_starts += 1;
        }
        *self.slot(job) = Slot::Running(Running {
            parts: parts.clone(),
            procs: spec.procs,
            estimated_end,
            spec,
            submitted,
            clock: RunClock::started(self.now),
            row,
            frozen: false,
            flex: None,
            moved_at: None,
            numa_local,
        });
        actions.push(Action::Start { job, parts });
    }

    /// Resumes suspended jobs whose CPUs are all free again, highest expansion factor first.
    fn resume_what_fits(&mut self, actions: &mut Vec<Action>) {
        if self.suspended.is_empty() {
            return;
        }
        let now = self.now;
        let suspended: Vec<ToResume<JobKey>> = self
            .suspended
            .iter()
            .filter_map(|&job| match &self.jobs[job as usize] {
                Slot::Suspended(s) => Some(ToResume {
                    job,
                    xf: expansion_factor(now - s.run.submitted, s.remaining, s.run.spec.estimate),
                    by_preemption: !s.by_owner,
                    kept: false,
                }),
                _ => None,
            })
            .collect();
        let resumed = resume_preempted(suspended, |&job| {
            let Slot::Suspended(s) = &self.jobs[job as usize] else { return false };
            // Not onto CPUs another suspended job holds that the policy does not: it would find
            // them taken on its resume. A job its owner suspended holds nothing (its resume
            // waits for this one instead). topod decides so too.
            if !self.free_again(&s.run) || self.waited_for(job, &s.run) {
                return false;
            }
            self.resume_suspended(job);
            true
        });
        actions.extend(resumed.into_iter().map(|job| Action::Resume { job }));
    }

    /// Suspends running jobs so that `head` starts now, if the rules of [`Preempt`] allow it;
    /// whether it started.
    fn preempt_for(&mut self, head: JobKey, actions: &mut Vec<Action>) -> bool {
        let Some(rules) = self.config.preempt else { return false };
        let Slot::Waiting(spec, submitted) = self.jobs[head as usize] else { return false };
        let now = self.now;
        // The steps topod takes for its host too: the threshold, then who may be suspended
        // (`preemption_candidates`, in job order so that equal expansion factors go by job).
        let xf = expansion_factor(now - submitted, spec.estimate, spec.estimate);
        let Ok(head_xf) = may_preempt::<JobKey>(&rules, Some(xf)) else { return false };
        let in_the_way = self.ends.iter().filter_map(|&(_, job)| match &self.jobs[job as usize] {
            Slot::Running(r) => Some(InTheWay {
                job,
                cpus: CpuSet::new(),
                fenced: CpuSet::new(),
                procs: r.procs,
                ran: r.clock.protected_for(now),
                suspensions: r.clock.suspensions,
                xf: Some(r.xf(now)),
                kept: None,
            }),
            _ => None,
        });
        let holds = |job: &JobKey| match &self.jobs[*job as usize] {
            Slot::Running(r) => self.holds_for_suspended(r).then(String::new),
            _ => None,
        };
        let Ok(mut eligible) = preemption_candidates(&rules, head_xf, in_the_way, holds) else {
            return false;
        };
        eligible.sort_by_key(|c| c.job);
        let eligible: Vec<(JobKey, f64)> = eligible.into_iter().map(|c| (c.job, c.xf)).collect();
        // The head sees the CPUs held for suspended jobs it may not borrow as taken.
        let held = self.held_view(head, spec, 0);
        let fences = held.as_ref().map(|v| &v.1);
        let Some(victims) = self.choose_victims(spec.procs, &eligible, fences) else {
            return false;
        };
        // Suspend them, then start the head; if it still cannot start, resume them at once.
        let mut suspended = Vec::with_capacity(victims.len());
        for job in &victims {
            if let Slot::Running(r) =
                std::mem::replace(&mut self.jobs[*job as usize], Slot::Unknown)
            {
                self.ends.remove(&(r.estimated_end, *job));
                self.give_back(0, &r.parts);
                let remaining = (r.estimated_end - now).max(0);
                suspended.push(*job);
                // Lent to the head without condition while it is placed.
                let resume_by = Time::MAX;
                self.jobs[*job as usize] =
                    Slot::Suspended(Suspended { run: r, remaining, resume_by, by_owner: false });
                self.suspended.insert(*job);
            }
        }
        let mut started = Vec::new();
        if self.try_start(head, spec, 0, &mut started) {
            // Each victim may resume once the head ends by its estimate (at once if the head
            // took none of its CPUs); until then, only jobs that end by that borrow its CPUs.
            let head_end = match &self.jobs[head as usize] {
                Slot::Running(r) => Some((r.estimated_end, r.parts.clone())),
                _ => None,
            };
            let cost = self.config.suspend_cost.max(0);
            for job in suspended {
                let Slot::Suspended(s) = &self.jobs[job as usize] else { continue };
                let overlaps = head_end.as_ref().is_some_and(|(_, parts)| {
                    parts.iter().any(|h| {
                        s.run.parts.iter().any(|v| {
                            v.host == h.host && v.placement.cpus.intersects(&h.placement.cpus)
                        })
                    })
                });
                if !overlaps {
                    // The head took none of its CPUs (a job over several hosts goes where the
                    // counts say): it runs on, never stopped.
                    self.unsuspend(job);
                    continue;
                }
                if let Slot::Suspended(s) = &mut self.jobs[job as usize] {
                    s.run.clock.stop(now, Stopper::Preemption);
                    s.remaining = s.remaining.saturating_add(cost);
                    s.resume_by = head_end.as_ref().map_or(now, |(end, _)| *end);
                }
                actions.push(Action::Suspend { job });
            }
            actions.extend(started);
            return true;
        }
        // Undo exactly what was done: nothing was told to the driver yet.
        for job in suspended {
            self.unsuspend(job);
        }
        false
    }

    /// Puts a job `preempt_for` took off its CPUs back on them, as if it had never been:
    /// nothing was told to the driver.
    fn unsuspend(&mut self, job: JobKey) {
        if let Slot::Suspended(s) = std::mem::replace(&mut self.jobs[job as usize], Slot::Unknown) {
            for p in &s.run.parts {
                self.take(0, p.host, &p.placement);
            }
            self.ends.insert((s.run.estimated_end, job));
            self.suspended.remove(&job);
            self.jobs[job as usize] = Slot::Running(s.run);
        }
    }

    /// Whether the running job holds CPUs a suspended job waits for ([`holds_for_suspended`]).
    fn holds_for_suspended(&self, run: &Running) -> bool {
        if self.suspended.is_empty() {
            return false;
        }
        run.parts.iter().any(|p| {
            let held = self
                .suspended
                .iter()
                .filter_map(|&v| match &self.jobs[v as usize] {
                    Slot::Suspended(s) if !s.by_owner => Some((v, s)),
                    _ => None,
                })
                .flat_map(|(v, s)| {
                    let on_host = s.run.parts.iter().filter(|q| q.host == p.host);
                    on_host.map(move |q| (v, &q.placement.cpus))
                });
            holds_for_suspended(&p.placement.cpus, held).is_some()
        })
    }

    /// The next instant after now at which preemption could decide otherwise with no event
    /// between: the first waiting job's expansion factor reaching the threshold or passing a
    /// running job's (a running job's stays constant: its time in the system and its time to
    /// run trade second for second), or a running job reaching `min_run`.
    fn next_preempt_check(&self, rules: &Preempt) -> Option<Time> {
        let head = self.queue.front()?;
        let Slot::Waiting(spec, submitted) = self.jobs[head as usize] else { return None };
        let now = self.now;
        // The first second at which its expansion factor, (t - submitted + estimate) /
        // max(estimate, 1), is above xf (or at it, for the threshold).
        let reaches = |xf: f64, strictly: bool| -> Option<Time> {
            let at =
                submitted as f64 + xf * spec.estimate.max(1) as f64 - spec.estimate.max(0) as f64;
            if !at.is_finite() {
                return None;
            }
            let t = if strictly { at.floor() as Time + 1 } else { at.ceil() as Time };
            (t > now).then_some(t)
        };
        let threshold = reaches(rules.min_xf, false);
        if threshold.is_some() {
            // Below the threshold nothing else matters yet.
            return threshold;
        }
        self.ends
            .iter()
            .filter_map(|&(_, job)| match &self.jobs[job as usize] {
                Slot::Running(r) => {
                    let ripe =
                        r.clock.protected_from().unwrap_or(now).saturating_add(rules.min_run);
                    let ripe = (ripe > now).then_some(ripe);
                    [ripe, reaches(r.xf(now), true)].into_iter().flatten().min()
                }
                _ => None,
            })
            .min()
    }

    /// The victims whose suspension frees room for `procs` (see [`Preempt`]): for a job that
    /// fits one host, the tightest domain on any host; for a larger one, the lowest expansion
    /// factors anywhere.
    fn choose_victims(
        &self,
        procs: u32,
        eligible: &[(JobKey, f64)],
        fences: Option<&BTreeMap<HostId, CpuSet>>,
    ) -> Option<Vec<JobKey>> {
        let max_host = self.hosts.iter().map(|h| h.cores).max().unwrap_or(0);
        if procs > max_host {
            let mut by_xf = eligible.to_vec();
            by_xf.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
            let mut free = self.rows[0].free_total;
            let mut victims = Vec::new();
            for (job, _) in by_xf {
                if free >= u64::from(procs) {
                    break;
                }
                if let Slot::Running(r) = &self.jobs[job as usize] {
                    free += r.held();
                    victims.push(job);
                }
            }
            return (free >= u64::from(procs)).then_some(victims);
        }
        // (domain rank, processors suspended, sum of expansion factors), victims
        let mut best: Option<((u8, u64, f64), Vec<JobKey>)> = None;
        for (h, host) in self.hosts.iter().enumerate() {
            if host.cores < procs {
                continue;
            }
            // Eligible jobs with a part on this host.
            let mut here: Vec<Candidate<JobKey>> = Vec::new();
            for (job, xf) in eligible {
                if let Slot::Running(r) = &self.jobs[*job as usize] {
                    if let Some(p) = r.parts.iter().find(|p| p.host as usize == h) {
                        here.push(Candidate {
                            job: *job,
                            xf: *xf,
                            cpus: p.placement.cpus.clone(),
                            fenced: p.placement.fenced.clone(),
                            procs: r.procs,
                        });
                    }
                }
            }
            if here.is_empty() {
                continue;
            }
            // Equal expansion factors go by job number.
            here.sort_by(|a, b| a.xf.total_cmp(&b.xf).then(a.job.cmp(&b.job)));
            let mut occupancy = self.rows[0].occupancy[h].clone();
            if let Some(fence) = fences.and_then(|f| f.get(&(h as HostId))) {
                occupancy.fenced.union_with(fence);
            }
            let model = &host.model;
            let mut fits_in = |domain: &CpuSet, occ: &Occupancy| {
                let busy = occ.held.union(&occ.fenced);
                let free = model
                    .cores
                    .iter()
                    .filter(|c| {
                        c.is_subset(domain)
                            && c.is_subset(&model.allocatable)
                            && !c.intersects(&busy)
                    })
                    .count() as u32;
                free >= procs
            };
            if let Some((key, victims)) = victims_on_host(model, &occupancy, &here, &mut fits_in) {
                let better = best.as_ref().is_none_or(|(k, _)| {
                    (key.0, key.1).cmp(&(k.0, k.1)).then(key.2.total_cmp(&k.2)).is_lt()
                });
                if better {
                    best = Some((key, victims));
                }
            }
        }
        best.map(|(_, v)| v)
    }

    /// Records `placement` on `host` in `row`; returns the cores it made unavailable (those it
    /// took whole, and any it shares with nobody yet but leaves partly used).
    fn take(&mut self, row: u32, host: HostId, placement: &Placement) -> u32 {
        let occ = &mut self.rows[row as usize].occupancy[host as usize];
        occ.held.union_with(&placement.cpus);
        occ.fenced.union_with(&placement.fenced);
        let before = self.recount(row, host);
        before.saturating_sub(self.rows[row as usize].free[host as usize])
    }

    fn give_back(&mut self, row: u32, parts: &[Part]) {
        for part in parts {
            let occ = &mut self.rows[row as usize].occupancy[part.host as usize];
            occ.held.difference_with(&part.placement.cpus);
            occ.fenced.difference_with(&part.placement.fenced);
            self.recount(row, part.host);
        }
    }

    /// Counts the host's wholly free cores in `row` again (a strategy may take more or other
    /// cores than asked); keeps the totals and the buckets in step. Returns the count before.
    fn recount(&mut self, row: u32, host: HostId) -> u32 {
        let before = self.recount_quietly(row, host);
        self.generation += 1;
        before
    }

    /// [`Self::recount`] without telling the backfill pass (the caller does when it matters).
    /// With malleable jobs, the cores they hold beyond their least sizes count as free.
    fn recount_quietly(&mut self, row: u32, host: HostId) -> u32 {
        self.occupancy_changes += 1;
        let reclaim = self.flex.get(host as usize).map_or(0, |f| f.reclaim);
        let h = &self.hosts[host as usize];
        let r = &mut self.rows[row as usize];
        let occ = &r.occupancy[host as usize];
        let before = r.free[host as usize];
        let busy = occ.held.union(&occ.fenced);
        // Every core of the model is allocatable (HostModel keeps only allocatable CPUs).
        let after =
            if busy.is_empty() { h.cores } else { h.model.cores_clear_of(&busy) as u32 } + reclaim;
        r.free[host as usize] = after;
        r.free_total = r.free_total + u64::from(after) - u64::from(before);
        if before != after {
            if let Some(set) = r.by_free.get_mut(&before) {
                set.remove(host);
                if set.is_empty() {
                    r.by_free.remove(&before);
                }
            }
            r.by_free.entry(after).or_default().insert(host);
        }
        before
    }

    /// The range of processors `spec` runs malleable with, when it does: malleable jobs on, the
    /// job marked malleable, fitting one host, and a range of more than one size.
    fn malleable_range(&self, spec: &JobSpec) -> Option<(u32, u32)> {
        let rules = self.malleable?;
        if !spec.malleable || spec.procs > self.largest_host {
            return None;
        }
        let (min, max) = rules.range(spec.procs);
        (min < max).then_some((min, max))
    }

    /// Processors that must be free (as [`Self::free_procs`] counts) for `spec` to start: its
    /// least size when it runs malleable.
    fn need(&self, spec: &JobSpec) -> u32 {
        self.malleable_range(spec).map_or(spec.procs, |(min, _)| min)
    }

    /// How long `spec` may run by its estimate: times `stretch` (gang rows), or for a malleable
    /// job its run at its least size.
    fn longest_run(&self, spec: &JobSpec, stretch: Time) -> Time {
        match self.malleable_range(spec) {
            Some((min, max)) => {
                let work = u128::try_from(spec.estimate.max(0)).unwrap_or(0) * u128::from(max);
                Time::try_from(work.div_ceil(u128::from(min))).unwrap_or(Time::MAX)
            }
            None => spec.estimate.saturating_mul(stretch),
        }
    }

    fn flex_of(&self, job: JobKey) -> Option<&Flex> {
        match self.jobs.get(job as usize) {
            Some(Slot::Running(r)) => r.flex.as_ref(),
            _ => None,
        }
    }

    /// Brings a host's sums of least sizes and of cores held beyond them up to date.
    fn refresh_flex(&mut self, host: HostId) {
        let (mut mins, mut reclaim) = (0u32, 0u32);
        for &job in &self.flex[host as usize].jobs {
            if let Slot::Running(r) = &self.jobs[job as usize] {
                if let (Some(f), Some(p)) = (&r.flex, r.parts.first()) {
                    mins += f.min;
                    reclaim += p.cores.saturating_sub(f.min);
                }
            }
        }
        let f = &mut self.flex[host as usize];
        self.reclaim_total = self.reclaim_total - u64::from(f.reclaim) + u64::from(reclaim);
        f.mins = mins;
        f.reclaim = reclaim;
    }

    /// Equipartition on `host` of the cores its rigid jobs leave, less `reserve` (cores about
    /// to go to a rigid job), among its malleable jobs and `newcomer` (last). Sizes in order.
    fn equipartition_on(
        &self,
        host: HostId,
        reserve: u32,
        newcomer: Option<Malleable>,
    ) -> Result<Vec<u32>, EquipartitionError> {
        let f = &self.flex[host as usize];
        // Free as counted (wholly free cores and what malleable jobs hold beyond their least
        // sizes) plus their least sizes: every core no rigid job holds.
        let budget = self.rows[0].free[host as usize] + f.mins;
        let mut jobs: Vec<Malleable> = f
            .jobs
            .iter()
            .filter_map(|&job| self.flex_of(job))
            .map(|fl| Malleable { min: fl.min, max: fl.max, pus_per_task: 1 })
            .collect();
        jobs.extend(newcomer);
        malleable::equipartition(budget.saturating_sub(reserve), &jobs)
    }

    /// Shrinks the malleable jobs on `host` so that `reserve` cores are wholly free there.
    fn shrink_for(&mut self, host: HostId, reserve: u32, actions: &mut Vec<Action>) {
        let sizes = match self.equipartition_on(host, reserve, None) {
            Ok(sizes) => sizes,
            Err(e) => {
                // The free count said the reserve fits beside the least sizes.
                debug_assert!(false, "host {host}: {e}");
                self.flex[host as usize]
                    .jobs
                    .iter()
                    .map(|&j| self.flex_of(j).map_or(1, |f| f.min))
                    .collect()
            }
        };
        let jobs = self.flex[host as usize].jobs.clone();
        for (job, size) in jobs.into_iter().zip(sizes) {
            if self.flex_of(job).is_some_and(|f| f.procs > size) {
                self.resize(host, job, size, actions);
            }
        }
    }

    /// Equipartition on `host` again: shrinks first, then grows, in start order.
    fn rebalance(&mut self, host: HostId, actions: &mut Vec<Action>) {
        let Ok(sizes) = self.equipartition_on(host, 0, None) else {
            debug_assert!(false, "host {host}: the least sizes no longer fit");
            return;
        };
        let jobs = self.flex[host as usize].jobs.clone();
        for shrinking in [true, false] {
            for (&job, &size) in jobs.iter().zip(&sizes) {
                let Some(now) = self.flex_of(job).map(|f| f.procs) else { continue };
                if (shrinking && now > size) || (!shrinking && now < size) {
                    self.resize(host, job, size, actions);
                }
            }
        }
        #[cfg(debug_assertions)]
        self.check_host(host);
    }

    /// Rebalances every host where a job started or ended in this step.
    fn rebalance_dirty(&mut self, actions: &mut Vec<Action>) {
        while let Some(host) = self.dirty.pop_first() {
            if !self.flex[host as usize].jobs.is_empty() {
                self.rebalance(host, actions);
            }
        }
    }

    /// Gives the malleable `job` on `host` `size` processors: a shrink keeps its first tasks, a
    /// grow places more with its own request ([`place::resize`]). Whether it was resized.
    fn resize(&mut self, host: HostId, job: JobKey, size: u32, actions: &mut Vec<Action>) -> bool {
        let now = self.now;
        let model = Arc::clone(&self.hosts[host as usize].model);
        let Some(Slot::Running(r)) = self.jobs.get(job as usize) else { return false };
        let Some(old) = r.parts.first().map(|p| Arc::clone(&p.placement)) else { return false };
        let request = cores_request(old.tasks.len() as u32);
        // A grow stays out of the pools the job must avoid; it may go into another job's
        // blocks, as what it gains beyond its least size is the head's for the taking (its start
        // shrinks the job first).
        let view;
        let occ = if self.space_options() {
            view = self.view_as(host, job, self.admits(&r.spec), false).0;
            &view
        } else {
            &self.rows[0].occupancy[host as usize]
        };
        let Ok(placement) =
            place::resize(&model, occ, &request, &old.tasks, size, self.config.strategy)
        else {
            return false;
        };
        let occ = &mut self.rows[0].occupancy[host as usize];
        occ.held.difference_with(&old.cpus);
        occ.fenced.difference_with(&old.fenced);
        occ.held.union_with(&placement.cpus);
        occ.fenced.union_with(&placement.fenced);
        let cores = cores_touched(&model, &placement);
        let procs = placement.tasks.len() as u32;
        let Some(Slot::Running(r)) = self.jobs.get_mut(job as usize) else { return false };
        let Some(flex) = r.flex.as_mut() else { return false };
        flex.drain(now);
        flex.procs = procs;
        let end = flex.estimated_end();
        self.ends.remove(&(r.estimated_end, job));
        r.estimated_end = end;
        self.ends.insert((end, job));
        r.parts = vec![Part { host, cores, placement: Arc::new(placement) }];
        r.moved_at = Some(now);
        actions.push(Action::Resize { job, parts: r.parts.clone() });
        self.refresh_flex(host);
        // The free count does not move (what a job gains beyond its least size is counted free
        // as the free cores it took were): the backfill pass need not start over for it.
        let before = self.recount_quietly(0, host);
        if before != self.rows[0].free[host as usize] {
            self.generation += 1;
        }
        true
    }

    /// Starts the malleable `job` now, at the size equipartition gives it on the host where
    /// that is largest, if some host has its least size free (see the module documentation).
    fn try_start_malleable(
        &mut self,
        job: JobKey,
        spec: JobSpec,
        (min, max): (u32, u32),
        actions: &mut Vec<Action>,
    ) -> bool {
        let newcomer = Malleable { min, max, pus_per_task: 1 };
        // (size, free, host): the largest size, then the fewest free, then the lowest number.
        let mut best: Option<(u32, u32, HostId)> = None;
        for (&free, hosts) in self.rows[0].by_free.range(min..) {
            for host in hosts.iter() {
                let Ok(sizes) = self.equipartition_on(host, 0, Some(newcomer)) else { continue };
                let size = sizes.last().copied().unwrap_or(0);
                let better = best.is_none_or(|(s, f, h)| {
                    size.cmp(&s).then(f.cmp(&free).then(h.cmp(&host))).is_gt()
                });
                if better {
                    best = Some((size, free, host));
                }
            }
        }
        let Some((_, _, host)) = best else { return false };
        let Ok(sizes) = self.equipartition_on(host, 0, Some(newcomer)) else { return false };
        let jobs = self.flex[host as usize].jobs.clone();
        for (&other, &size) in jobs.iter().zip(&sizes) {
            if self.flex_of(other).is_some_and(|f| f.procs > size) {
                self.resize(host, other, size, actions);
            }
        }
        self.dirty.insert(host);
        let size = sizes.last().copied().unwrap_or(min);
        let h = &self.hosts[host as usize];
        let placed = if self.space_options() {
            // In its view: the largest size from equipartition's down that fits outside the
            // blocks and pools it must avoid.
            let admitted = self.admits(&spec);
            (min..=size.max(min))
                .rev()
                .find_map(|n| self.place_in_view(host, job, admitted, &cores_request(n)).ok())
        } else {
            let occ = &self.rows[0].occupancy[host as usize];
            start_on_host(&h.model, occ, &cores_request(size), self.config.strategy).ok()
        };
        let Some(placement) = placed else {
            // Counts said yes, the host said no: the jobs shrunk for it grow back at the rebalance.
            return false;
        };
        let h = &self.hosts[host as usize];
        let cores = cores_touched(&h.model, &placement);
        let procs = placement.tasks.len() as u32;
        let occ = &mut self.rows[0].occupancy[host as usize];
        occ.held.union_with(&placement.cpus);
        occ.fenced.union_with(&placement.fenced);
        let now = self.now;
        let flex = Flex {
            min,
            max,
            procs,
            work: u128::try_from(spec.estimate.max(0)).unwrap_or(0) * u128::from(max),
            at: now,
        };
        let estimated_end = flex.estimated_end();
        let submitted = match &self.jobs[job as usize] {
            Slot::Waiting(_, at) => *at,
            _ => now,
        };
        let parts = vec![Part { host, cores, placement: Arc::new(placement) }];
        *self.slot(job) = Slot::Running(Running {
            parts: parts.clone(),
            procs: spec.procs,
            estimated_end,
            spec,
            submitted,
            clock: RunClock::started(now),
            row: 0,
            frozen: false,
            flex: Some(flex),
            moved_at: None,
            numa_local: false,
        });
        self.flex[host as usize].jobs.push(job);
        self.refresh_flex(host);
        self.recount(0, host);
        self.rows[0].jobs += 1;
        self.ends.insert((estimated_end, job));
        self.malleable_started += 1;
        if self.blocks.take_if(|b| b.head == job).is_some() {
            self.generation += 1;
        }
        if self.admits(&spec) {
            self.counters.admitted_starts += 1;
        }
        actions.push(Action::Start { job, parts });
        true
    }

    /// Checks a host's malleable bookkeeping against its occupancy (debug builds, after every
    /// rebalance): sizes within ranges and equal to tasks, CPUs held and disjoint, the sums, and
    /// the free count as wholly free cores plus what the jobs hold beyond their least sizes.
    #[cfg(debug_assertions)]
    fn check_host(&self, host: HostId) {
        let f = &self.flex[host as usize];
        let occ = &self.rows[0].occupancy[host as usize];
        let mut seen = CpuSet::new();
        let (mut mins, mut reclaim) = (0, 0);
        for &job in &f.jobs {
            let Some(Slot::Running(r)) = self.jobs.get(job as usize) else {
                panic!("host {host}: malleable job {job} is not running");
            };
            let (Some(fl), [p]) = (&r.flex, r.parts.as_slice()) else {
                panic!("host {host}: job {job} is not malleable on one host");
            };
            assert_eq!(p.host, host);
            assert!((fl.min..=fl.max).contains(&fl.procs), "job {job}: {fl:?}");
            assert_eq!(p.placement.tasks.len(), fl.procs as usize, "job {job}");
            assert!(p.placement.cpus.is_subset(&occ.held), "job {job}: CPUs not held");
            assert!(!p.placement.cpus.intersects(&seen), "job {job}: CPUs of another job");
            seen.union_with(&p.placement.cpus);
            mins += fl.min;
            reclaim += p.cores - fl.min;
        }
        assert_eq!((f.mins, f.reclaim), (mins, reclaim), "host {host}");
        let h = &self.hosts[host as usize];
        let busy = occ.held.union(&occ.fenced);
        let wholly_free = h
            .model
            .cores
            .iter()
            .filter(|c| c.is_subset(&h.model.allocatable) && !c.intersects(&busy))
            .count() as u32;
        assert_eq!(self.rows[0].free[host as usize], wholly_free + reclaim, "host {host}");
    }

    /// Hosts and core counts for a job of `procs` (see the module documentation), or `None`
    /// when the free cores do not add up.
    fn choose_hosts(&self, row: u32, procs: u32) -> Option<Vec<(HostId, u32)>> {
        choose_hosts_in(&self.rows[row as usize].by_free, procs)
    }
}

/// [`PolicyCore::choose_hosts`] over any hosts-by-free-cores buckets.
fn choose_hosts_in(by_free: &BTreeMap<u32, HostBits>, procs: u32) -> Option<Vec<(HostId, u32)>> {
    let mut remaining = procs;
    let mut chosen = Vec::new();
    for (&f, hosts) in by_free.range(1..).rev() {
        for host in hosts.iter() {
            if remaining == 0 {
                return Some(chosen);
            }
            if f <= remaining {
                chosen.push((host, f));
                remaining -= f;
            } else {
                // This host could hold the rest; the tightest one that can goes instead.
                // (Hosts of this bucket before it may be chosen already; it is not.)
                let tightest =
                    by_free.range(remaining..f).find_map(|(_, set)| set.first()).unwrap_or(host);
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

/// A set of hosts, one bit each: insert and remove in constant time (a free-cores bucket
/// changes at every start and end), iterated by number as a `BTreeSet` would be.
#[derive(Debug, Clone, Default)]
struct HostBits {
    words: Vec<u64>,
    len: u32,
}

impl HostBits {
    fn insert(&mut self, host: HostId) {
        let (word, bit) = (host as usize / 64, host % 64);
        if word >= self.words.len() {
            self.words.resize(word + 1, 0);
        }
        if self.words[word] & (1 << bit) == 0 {
            self.words[word] |= 1 << bit;
            self.len += 1;
        }
    }

    fn remove(&mut self, host: HostId) {
        let (word, bit) = (host as usize / 64, host % 64);
        if let Some(w) = self.words.get_mut(word) {
            if *w & (1 << bit) != 0 {
                *w &= !(1 << bit);
                self.len -= 1;
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn first(&self) -> Option<HostId> {
        self.iter().next()
    }

    /// The hosts, lowest number first.
    fn iter(&self) -> impl Iterator<Item = HostId> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &word)| {
            let mut rest = word;
            std::iter::from_fn(move || {
                (rest != 0).then(|| {
                    let bit = rest.trailing_zeros();
                    rest &= rest - 1;
                    i as HostId * 64 + bit
                })
            })
        })
    }
}

/// Hosts by free cores, from a count per host.
fn buckets(free: &[u32]) -> BTreeMap<u32, HostBits> {
    let mut by_free: BTreeMap<u32, HostBits> = BTreeMap::new();
    for (host, &f) in free.iter().enumerate() {
        by_free.entry(f).or_default().insert(host as HostId);
    }
    by_free
}

/// Hosts with at least `procs` free cores, the fewest free first, then by number.
fn tightest_first(free: &[u32], procs: u32) -> Vec<HostId> {
    let mut hosts: Vec<(u32, HostId)> = free
        .iter()
        .enumerate()
        .filter(|&(_, &f)| f >= procs)
        .map(|(h, &f)| (f, h as HostId))
        .collect();
    hosts.sort_unstable();
    hosts.into_iter().map(|(_, h)| h).collect()
}

/// The request of a NUMA-local job of `cores` cores: one task per core, all in one NUMA node.
pub fn numa_request(cores: u32) -> Request {
    Request { max_radius: Some(0), ..cores_request(cores) }
}

/// NUMA-local jobs, migration, reservations and prime time (see the module documentation).
impl PolicyCore {
    /// Whether any of them is in effect: rigid starts then go through [`Self::try_start_in_space`].
    fn space_options(&self) -> bool {
        self.numa_local || self.defrag.is_some() || self.reserve || self.prime.is_some()
    }

    /// Whether the prime-time pools admit `spec`.
    fn admits(&self, spec: &JobSpec) -> bool {
        self.prime.as_ref().is_some_and(|p| p.admits(spec))
    }

    /// Whether `spec` runs NUMA-local: the option on, rigid, and no larger than a NUMA node.
    fn asks_numa_local(&self, spec: &JobSpec) -> bool {
        self.numa_local
            && self.malleable_range(spec).is_none()
            && self.hosts.iter().any(|h| spec.procs <= h.numa_cores)
    }

    /// What placing a part of `job` on `host` must avoid (the blocks of another job, the open
    /// pools if they do not admit it), and where to try first (its own blocks, the open pools
    /// that admit it), as topod's `placement_occupancy` and `place_and_create`.
    fn view(&self, host: HostId, job: JobKey, admitted: bool) -> (Occupancy, Vec<CpuSet>) {
        self.view_as(host, job, admitted, self.waived != Some(job))
    }

    /// [`Self::view`], with the blocks of another job binding it or not.
    fn view_as(
        &self,
        host: HostId,
        job: JobKey,
        admitted: bool,
        blocks_bind: bool,
    ) -> (Occupancy, Vec<CpuSet>) {
        let mut occ = self.rows[0].occupancy[host as usize].clone();
        let mut preferred = Vec::new();
        if let Some(b) = &self.blocks {
            let here = b.on.iter().filter(|(h, ..)| *h == host).map(|(_, _, r)| r);
            if b.head == job {
                preferred.extend(here.map(|r| r.cpus.clone()));
            } else if blocks_bind {
                occ = reservation::blocked_for(&occ, here, &job.to_string(), self.now);
            }
        }
        if let (Some(prime), Some(pool)) = (&self.prime, self.pools.get(host as usize)) {
            let who = Asker { pool: admitted.then_some(PRIME_POOL), ..Asker::default() };
            let (o, mine) =
                prime::pools_for(&occ, std::slice::from_ref(pool), who, prime.local_time(self.now));
            occ = o;
            if !mine.is_empty() {
                preferred.push(mine);
            }
        }
        (occ, preferred)
    }

    /// `occupancy` with the open prime-time pool and every block on `host` kept out (as
    /// fenced): where any job may go.
    fn strict_view(&self, host: HostId, occupancy: &Occupancy) -> Occupancy {
        let mut strict = occupancy.clone();
        if self.pools_open {
            if let Some(pool) = self.pools.get(host as usize) {
                strict.fenced.union_with(&pool.cpus);
            }
        }
        if let Some(b) = &self.blocks {
            for (_, _, r) in b.on.iter().filter(|(h, ..)| *h == host) {
                strict.fenced.union_with(&r.cpus);
            }
        }
        strict.fenced.difference_with(&strict.held);
        strict
    }

    /// Places `request` for `job` on `host` in its view: inside each preferred set where it fits
    /// there, else anywhere the view allows.
    fn place_in_view(
        &self,
        host: HostId,
        job: JobKey,
        admitted: bool,
        request: &Request,
    ) -> Result<Placement, PlaceError> {
        let (occ, preferred) = self.view(host, job, admitted);
        let model = &self.hosts[host as usize].model;
        for cpus in &preferred {
            let list = match &request.cpu_list {
                Some(list) => list.intersection(cpus),
                None => cpus.clone(),
            };
            if list.is_empty() {
                continue;
            }
            let inside = Request { cpu_list: Some(list), ..request.clone() };
            if let Ok(p) = start_on_host(model, &occ, &inside, self.config.strategy) {
                return Ok(p);
            }
        }
        start_on_host(model, &occ, request, self.config.strategy)
    }

    /// Free cores per host as `job` may count them (less the wholly free cores of the blocks
    /// and open pools it must avoid), or `None` when that is the row's own count. Jobs that
    /// avoid the same things count alike: the answer is kept until the cluster changes.
    fn free_for(&mut self, job: JobKey, admitted: bool) -> Option<Arc<FreeView>> {
        let pools = !admitted && self.prime.as_ref().is_some_and(|p| p.open_at(self.now));
        let blocks_bind = self
            .blocks
            .as_ref()
            .is_some_and(|b| b.head != job && self.waived != Some(job) && !b.on.is_empty());
        if !pools && !blocks_bind {
            return None;
        }
        let key = (self.generation, self.occupancy_changes, pools, blocks_bind);
        if let Some((k, view)) = &self.free_views {
            if *k == key {
                return Some(Arc::clone(view));
            }
        }
        let mut fences: BTreeMap<HostId, CpuSet> = BTreeMap::new();
        if pools {
            for (h, pool) in self.pools.iter().enumerate() {
                fences.insert(h as HostId, pool.cpus.clone());
            }
        }
        if let Some(b) = self.blocks.as_ref().filter(|_| blocks_bind) {
            for (h, _, r) in &b.on {
                fences.entry(*h).or_default().union_with(&r.cpus);
            }
        }
        let view = Arc::new(self.fenced_view(&fences));
        self.free_views = Some((key, Arc::clone(&view)));
        Some(view)
    }

    /// The row's free cores per host less the wholly free cores inside `fences` (per host).
    fn fenced_view(&self, fences: &BTreeMap<HostId, CpuSet>) -> FreeView {
        let mut free = self.rows[0].free.clone();
        for (host, fence) in fences {
            let model = &self.hosts[*host as usize].model;
            let occ = &self.rows[0].occupancy[*host as usize];
            let busy = occ.held.union(&occ.fenced);
            let hidden = model
                .cores
                .iter()
                .filter(|c| c.is_subset(&model.allocatable))
                .filter(|c| c.intersects(fence) && !c.intersects(&busy))
                .count() as u32;
            free[*host as usize] = free[*host as usize].saturating_sub(hidden);
        }
        FreeView { total: free.iter().map(|&f| u64::from(f)).sum(), by_free: buckets(&free), free }
    }

    /// Starts the rigid `job` now if hosts and CPUs can be found for it, in its view, moving
    /// running jobs where migration is on and a part is refused on shape.
    fn try_start_in_space(
        &mut self,
        job: JobKey,
        spec: JobSpec,
        actions: &mut Vec<Action>,
    ) -> bool {
        let admitted = self.admits(&spec);
        let free = self.free_for(job, admitted);
        if self.asks_numa_local(&spec) {
            return self.start_numa_local(job, spec, admitted, free.as_deref(), actions);
        }
        let available = free.as_ref().map_or(self.rows[0].free_total, |f| f.total);
        if u64::from(spec.procs) > available {
            return false;
        }
        let choice = match self.block_choice(job, spec.procs, free.as_deref()) {
            Some(choice) => Some(choice),
            None => match &free {
                None => self.choose_hosts(0, spec.procs),
                Some(f) => choose_hosts_in(&f.by_free, spec.procs),
            },
        };
        let Some(choice) = choice else { return false };
        let mut parts = Vec::with_capacity(choice.len());
        let mut moved = false;
        for (host, cores) in choice {
            if self.flex.get(host as usize).is_some_and(|f| !f.jobs.is_empty()) {
                self.shrink_for(host, cores, actions);
                self.dirty.insert(host);
            }
            let request = cores_request(cores);
            let placed = match self.place_in_view(host, job, admitted, &request) {
                Ok(p) => Some(p),
                Err(e) if e.rejected_while_free() => {
                    let p = self.defragment(host, job, admitted, &request, actions);
                    moved |= p.is_some();
                    self.counters.refused_on_shape += u64::from(p.is_none());
                    p
                }
                Err(_) => None,
            };
            let Some(placement) = placed else {
                self.give_back(0, &parts);
                return false;
            };
            let placement = Arc::new(placement);
            let held = self.take(0, host, &placement);
            parts.push(Part { host, cores: held, placement });
        }
        self.counters.defrag_starts += u64::from(moved);
        self.record_start(job, spec, 0, parts, false, actions);
        true
    }

    /// The head's hosts and cores by its blocks, when it has them and they have its parts free.
    fn block_choice(
        &self,
        job: JobKey,
        procs: u32,
        free: Option<&FreeView>,
    ) -> Option<Vec<(HostId, u32)>> {
        let b = self.blocks.as_ref().filter(|b| b.head == job && !b.on.is_empty())?;
        let room = |h: HostId| free.map_or(self.rows[0].free[h as usize], |f| f.free[h as usize]);
        let total: u32 = b.on.iter().map(|(_, c, _)| *c).sum();
        (total == procs && b.on.iter().all(|(h, c, _)| room(*h) >= *c))
            .then(|| b.on.iter().map(|(h, c, _)| (*h, *c)).collect())
    }

    /// Starts the NUMA-local `job` on the first host, the fewest free first (its block's host
    /// before all), where its cores are free in one NUMA node; failing that, with migration,
    /// on the first of the hosts that refused it on shape where moves make room.
    fn start_numa_local(
        &mut self,
        job: JobKey,
        spec: JobSpec,
        admitted: bool,
        free: Option<&FreeView>,
        actions: &mut Vec<Action>,
    ) -> bool {
        let procs = spec.procs;
        let by_free = free.map_or(&self.rows[0].by_free, |f| &f.by_free);
        let mut candidates: Vec<HostId> =
            by_free.range(procs..).flat_map(|(_, hosts)| hosts.iter()).collect();
        if let Some(&(h, ..)) =
            self.blocks.as_ref().filter(|b| b.head == job).and_then(|b| b.on.first())
        {
            if let Some(i) = candidates.iter().position(|&c| c == h) {
                candidates.remove(i);
                candidates.insert(0, h);
            }
        }
        let request = numa_request(procs);
        let mut refused = Vec::new();
        for &host in &candidates {
            let reclaim = self.flex.get(host as usize).map_or(0, |f| f.reclaim);
            if reclaim > 0 && self.rows[0].free[host as usize] - reclaim < procs {
                // Make room: the malleable jobs there share what this job leaves them.
                self.shrink_for(host, procs, actions);
                self.dirty.insert(host);
            }
            match self.place_in_view(host, job, admitted, &request) {
                Ok(p) => {
                    self.start_on_one(job, spec, host, p, actions);
                    return true;
                }
                Err(e) if e.rejected_while_free() => refused.push(host),
                Err(_) => {}
            }
        }
        for &host in &refused {
            if let Some(p) = self.defragment(host, job, admitted, &request, actions) {
                self.counters.defrag_starts += 1;
                self.start_on_one(job, spec, host, p, actions);
                return true;
            }
        }
        self.counters.refused_on_shape += u64::from(!refused.is_empty());
        false
    }

    /// Records the NUMA-local `job` started on `host` with `placement`.
    fn start_on_one(
        &mut self,
        job: JobKey,
        spec: JobSpec,
        host: HostId,
        placement: Placement,
        actions: &mut Vec<Action>,
    ) {
        let placement = Arc::new(placement);
        let held = self.take(0, host, &placement);
        self.record_start(job, spec, 0, vec![Part { host, cores: held, placement }], true, actions);
    }

    /// Moves running jobs' parts on `host` so that `request` fits there for `job`, by
    /// [`defrag::plan_moves`] within the delay timers; where the request then goes, or `None`
    /// (migration off, or no plan).
    fn defragment(
        &mut self,
        host: HostId,
        job: JobKey,
        admitted: bool,
        request: &Request,
        actions: &mut Vec<Action>,
    ) -> Option<Placement> {
        let rules = self.defrag?;
        let now = self.now;
        let (occupancy, _) = self.view(host, job, admitted);
        // The running jobs with a part here, with the request each part was placed with.
        let mut here: Vec<(JobKey, Arc<Placement>, Request, bool)> = self
            .ends
            .iter()
            .filter_map(|&(_, other)| {
                let Slot::Running(r) = &self.jobs[other as usize] else { return None };
                let part = r.parts.iter().find(|p| p.host == host)?;
                let tasks = part.placement.tasks.len() as u32;
                let request = if r.numa_local { numa_request(tasks) } else { cores_request(tasks) };
                let may_move = rules.may_move(now, &r.clock, r.moved_at);
                Some((other, Arc::clone(&part.placement), request, may_move))
            })
            .collect();
        here.sort_by_key(|(key, ..)| *key);
        let plan = {
            let movables: Vec<Movable<'_, JobKey>> = here
                .iter()
                .map(|(key, p, request, may_move)| Movable {
                    key: *key,
                    request,
                    cpus: &p.cpus,
                    fenced: &p.fenced,
                    tasks: &p.tasks,
                    may_move: *may_move,
                })
                .collect();
            let model = &self.hosts[host as usize].model;
            // First with the open pool and every block kept out for all (a plan that moves no
            // job where it may not go); failing that, in this job's view, the moves checked
            // below. topod plans so too (`space.rs`).
            let strict = self.strict_view(host, &occupancy);
            let plan = |occ: &Occupancy| {
                defrag::plan_moves(
                    model,
                    occ,
                    &movables,
                    request,
                    self.config.strategy,
                    rules.limits,
                )
            };
            plan(&strict).or_else(|| plan(&occupancy))?
        };
        // Each moved job must land where it may go itself: outside the open pool when it does
        // not admit it, and outside the blocks reserved for another job. (What the arriving job
        // and the other moved jobs leave is the plan's own business.)
        for m in &plan.moves {
            let Some(Slot::Running(r)) = self.jobs.get(m.key as usize) else { return None };
            let (mut own, _) = self.view(host, m.key, self.admits(&r.spec));
            let old = here.iter().find(|(k, ..)| *k == m.key).map(|(_, p, ..)| p)?;
            own.held.difference_with(&old.cpus);
            own.fenced.difference_with(&old.fenced);
            let mut barred = own.fenced.intersection(&m.placement.cpus);
            barred.union_with(&own.held.intersection(&m.placement.cpus));
            for (_, other, ..) in
                here.iter().filter(|(k, ..)| plan.moves.iter().any(|o| o.key == *k))
            {
                barred.difference_with(&other.cpus);
            }
            if !barred.is_empty() {
                return None;
            }
        }
        let moves = plan.moves.into_iter().map(|m| (m.key, m.placement)).collect();
        self.move_parts(host, moves, MoveReason::Defrag, actions);
        Some(plan.placement)
    }

    /// Moves each job's part on `host` to its new placement (every old place freed before any
    /// new one is taken: a job may go where another was), and tells the driver.
    fn move_parts(
        &mut self,
        host: HostId,
        moves: Vec<(JobKey, Placement)>,
        why: MoveReason,
        actions: &mut Vec<Action>,
    ) {
        let model = Arc::clone(&self.hosts[host as usize].model);
        let (now, pause) = (self.now, self.config.move_cost.max(0));
        let olds: Vec<Arc<Placement>> = moves
            .iter()
            .filter_map(|(job, _)| match self.jobs.get(*job as usize) {
                Some(Slot::Running(r)) => {
                    r.parts.iter().find(|p| p.host == host).map(|p| Arc::clone(&p.placement))
                }
                _ => None,
            })
            .collect();
        debug_assert_eq!(olds.len(), moves.len(), "every moved job runs on host {host}");
        let occ = &mut self.rows[0].occupancy[host as usize];
        for old in &olds {
            occ.held.difference_with(&old.cpus);
            occ.fenced.difference_with(&old.fenced);
        }
        for (_, p) in &moves {
            occ.held.union_with(&p.cpus);
            occ.fenced.union_with(&p.fenced);
        }
        for (job, placement) in moves {
            let pus = placement.cpus.len() as u64;
            let cores = cores_touched(&model, &placement);
            let Some(Slot::Running(r)) = self.jobs.get_mut(job as usize) else { continue };
            let Some(part) = r.parts.iter_mut().find(|p| p.host == host) else { continue };
            *part = Part { host, cores, placement: Arc::new(placement) };
            r.moved_at = Some(now);
            if pause > 0 {
                // No progress while it moves: its end, or its work's, comes later.
                let end = match r.flex.as_mut() {
                    Some(f) => {
                        f.drain(now);
                        f.at = f.at.max(now).saturating_add(pause);
                        f.estimated_end()
                    }
                    None => r.estimated_end.saturating_add(pause),
                };
                self.ends.remove(&(r.estimated_end, job));
                r.estimated_end = end;
                self.ends.insert((end, job));
            }
            let parts = r.parts.clone();
            match why {
                MoveReason::Defrag => {
                    self.counters.moves += 1;
                    self.counters.moved_pus += pus;
                }
                MoveReason::PrimeWindow => self.counters.prime_moves += 1,
            }
            actions.push(Action::Move { job, parts, why, pause });
        }
        self.recount(0, host);
    }

    /// Sets blocks aside for the head `head` whose reservation is at `shadow` (see the module
    /// documentation), unless they were made for this head, shadow time and cluster already.
    fn reserve_for(
        &mut self,
        head: JobKey,
        spec: JobSpec,
        shadow: Time,
        actions: &mut Vec<Action>,
    ) {
        if self
            .blocks
            .as_ref()
            .is_some_and(|b| (b.head, b.shadow, b.generation) == (head, shadow, self.generation))
        {
            return;
        }
        let now = self.now;
        let numa_local = self.asks_numa_local(&spec);
        let mut on = Vec::new();
        // A malleable head starts on what is free at its least size: no block for it.
        if self.malleable_range(&spec).is_none() && shadow != Time::MAX {
            let admitted = self.admits(&spec);
            // Free cores at the shadow time, and what the jobs estimated to end by then leave.
            let mut free = self.rows[0].free.clone();
            let mut leaving: BTreeMap<HostId, Occupancy> = BTreeMap::new();
            for &(end, job) in &self.ends {
                let Slot::Running(r) = &self.jobs[job as usize] else { continue };
                let (at, least) = match &r.flex {
                    Some(f) => (f.latest_end(now), Some(f.min)),
                    None => (end, None),
                };
                if at > shadow {
                    continue;
                }
                for p in &r.parts {
                    free[p.host as usize] += least.unwrap_or(p.cores);
                    let o = leaving.entry(p.host).or_default();
                    o.held.union_with(&p.placement.cpus);
                    o.fenced.union_with(&p.placement.fenced);
                }
            }
            let at_shadow = |host: HostId| {
                let (mut occ, _) = self.view(host, head, admitted);
                if let Some(o) = leaving.get(&host) {
                    occ.held.difference_with(&o.held);
                    occ.fenced.difference_with(&o.fenced);
                }
                occ
            };
            let strategy = self.config.strategy;
            // The hosts the head's start would choose then.
            let hosts: Vec<(HostId, u32)> = if numa_local {
                let candidates = tightest_first(&free, spec.procs);
                let request = numa_request(spec.procs);
                let fits = candidates.iter().copied().find(|&h| {
                    start_on_host(&self.hosts[h as usize].model, &at_shadow(h), &request, strategy)
                        .is_ok()
                });
                fits.or(candidates.first().copied())
                    .map(|h| vec![(h, spec.procs)])
                    .unwrap_or_default()
            } else {
                choose_hosts_in(&buckets(&free), spec.procs).unwrap_or_default()
            };
            for (host, cores) in hosts {
                let request = if numa_local { numa_request(cores) } else { cores_request(cores) };
                let model = &self.hosts[host as usize].model;
                if let Ok((block, _busy)) =
                    reservation::choose_block(model, &at_shadow(host), &[], &request, strategy, now)
                {
                    on.push((
                        host,
                        cores,
                        Reservation {
                            job: head.to_string(),
                            cpus: block.cpus,
                            request: request.to_string(),
                            made_at: now,
                            expires_at: Time::MAX,
                            gpus: Vec::new(),
                        },
                    ));
                }
            }
        }
        let old = self.blocks.take();
        let new_head = old.as_ref().is_none_or(|b| b.head != head);
        if let Some(o) = old.as_ref().filter(|o| o.head != head && !o.on.is_empty()) {
            actions.push(Action::Reserve { job: o.head, blocks: Vec::new() });
        }
        let old_on: &[(HostId, u32, Reservation)] =
            old.as_ref().filter(|o| o.head == head).map_or(&[], |o| &o.on);
        let kept =
            |h: HostId, cpus: &CpuSet| old_on.iter().any(|(oh, _, r)| *oh == h && r.cpus == *cpus);
        let made = on.iter().filter(|(h, _, r)| !kept(*h, &r.cpus)).count();
        self.counters.blocks_made += made as u64;
        if !on.is_empty() && self.last_reserved != Some(head) {
            self.last_reserved = Some(head);
            self.counters.reserved_heads += 1;
        }
        let unchanged = !new_head && made == 0 && on.len() == old_on.len();
        if !unchanged {
            if !on.is_empty() || !old_on.is_empty() {
                let blocks = on.iter().map(|(h, _, r)| (*h, r.cpus.clone())).collect();
                actions.push(Action::Reserve { job: head, blocks });
            }
            // Other jobs' views changed: backfill passes start over.
            self.generation += 1;
        }
        self.blocks = Some(Blocks { head, shadow, generation: self.generation, on });
    }

    /// Drops the blocks when their job is no longer the queue's head (it was cancelled, or
    /// another job is first now); a head that started spent them already.
    fn drop_stale_blocks(&mut self, actions: &mut Vec<Action>) {
        let front = self.queue.front();
        if let Some(b) = self.blocks.take_if(|b| Some(b.head) != front) {
            if !b.on.is_empty() {
                actions.push(Action::Reserve { job: b.head, blocks: Vec::new() });
            }
            self.generation += 1;
        }
    }

    /// Notes a window opening or closing; at an opening with [`OnOpen::Migrate`], moves the
    /// running jobs the pools do not admit off the pools' CPUs where they fit elsewhere on
    /// their hosts (else they stay).
    fn open_windows(&mut self, actions: &mut Vec<Action>) {
        let Some(prime) = &self.prime else { return };
        let open = prime.open_at(self.now);
        let migrate = prime.on_open == OnOpen::Migrate;
        if open == self.pools_open {
            return;
        }
        self.pools_open = open;
        // Who may go where changed: backfill passes start over.
        self.generation += 1;
        if !open || !migrate {
            return;
        }
        let mut running: Vec<JobKey> = self.ends.iter().map(|&(_, job)| job).collect();
        running.sort_unstable();
        for job in running {
            let Slot::Running(r) = &self.jobs[job as usize] else { continue };
            if self.admits(&r.spec) {
                continue;
            }
            let on_pools: Vec<(HostId, Arc<Placement>)> = r
                .parts
                .iter()
                .filter(|p| p.placement.cpus.intersects(&self.pools[p.host as usize].cpus))
                .map(|p| (p.host, Arc::clone(&p.placement)))
                .collect();
            let numa_local = r.numa_local;
            for (host, old) in on_pools {
                let tasks = old.tasks.len() as u32;
                let request = if numa_local { numa_request(tasks) } else { cores_request(tasks) };
                let (mut occ, _) = self.view(host, job, false);
                occ.held.difference_with(&old.cpus);
                occ.fenced.difference_with(&old.fenced);
                let model = &self.hosts[host as usize].model;
                if let Ok(p) = start_on_host(model, &occ, &request, self.config.strategy) {
                    self.move_parts(host, vec![(job, p)], MoveReason::PrimeWindow, actions);
                }
            }
        }
    }
}

/// Whether two jobs' parts share a CPU on some host.
fn overlap(a: &[Part], b: &[Part]) -> bool {
    a.iter().any(|p| {
        b.iter().any(|q| q.host == p.host && q.placement.cpus.intersects(&p.placement.cpus))
    })
}

/// The allocatable cores of `model` a placement uses or fences, whole or in part.
fn cores_touched(model: &HostModel, placement: &Placement) -> u32 {
    // The model's cores lie within its allocatable CPUs (`HostModel::new` cuts them to it).
    model.cores_touching(&placement.cpus.union(&placement.fenced)) as u32
}

/// Every CPU the parts of a job hold, per host, for checks.
pub fn cpus_by_host(parts: &[Part]) -> Vec<(HostId, CpuSet)> {
    parts.iter().map(|p| (p.host, p.placement.cpus.clone())).collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::topology::{SyntheticShape, Topology};

    proptest::proptest! {
        #[test]
        fn host_bits_hold_what_a_btree_set_holds(ops in proptest::collection::vec((proptest::bool::ANY, 0u32..300), 0..400)) {
            let (mut bits, mut set) = (HostBits::default(), BTreeSet::new());
            for (insert, host) in ops {
                if insert {
                    bits.insert(host);
                    set.insert(host);
                } else {
                    bits.remove(host);
                    set.remove(&host);
                }
                proptest::prop_assert_eq!(bits.is_empty(), set.is_empty());
                proptest::prop_assert_eq!(bits.first(), set.first().copied());
            }
            proptest::prop_assert_eq!(bits.iter().collect::<Vec<_>>(), set.into_iter().collect::<Vec<_>>());
        }
    }

    /// `n` plain hosts of `cores` processors (one model shared).
    pub(crate) fn flat(n: usize, cores: u32) -> Vec<Arc<HostModel>> {
        let model = Arc::new(HostModel::new(&Topology::flat(cores), &CpuSet::new()).unwrap());
        vec![model; n]
    }

    /// `n` hosts of two packages of 8 two-thread cores (one model shared).
    pub(crate) fn two_socket(n: usize) -> Vec<Arc<HostModel>> {
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
        PolicyCore::new(hosts, PolicyConfig::plain(order, Strategy::BestFit))
    }

    fn submit(job: JobKey, procs: u32, estimate: Time) -> Event {
        Event::Submit { job, spec: JobSpec::rigid(procs, estimate) }
    }

    fn starts(actions: Vec<Action>) -> Vec<(JobKey, Vec<Part>)> {
        actions
            .into_iter()
            .filter_map(|a| match a {
                Action::Start { job, parts } => Some((job, parts)),
                _ => None,
            })
            .collect()
    }

    fn started(actions: &[Action]) -> Vec<JobKey> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Start { job, .. } => Some(*job),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn easy_passes_a_long_queue_of_jobs_that_cannot_start_without_looking_at_each() {
        // 64 one-core hosts: 63 busy for a long time, the head waits for all 64. Behind it n
        // jobs that would fit the free core but run past the head's start, then n short jobs
        // one after another, each backfilled and ended: 2n passes over the cluster changed,
        // each of which looked at every waiting job before the queue had an index (n² looks).
        // Conservative backfilling with a depth of 2 passes them over beyond its depth.
        let n: JobKey = 2_000;
        let mut conservative = PolicyConfig::plain(QueueOrder::Conservative, Strategy::BestFit);
        conservative.reservation_depth = Some(2);
        for config in [PolicyConfig::plain(QueueOrder::Easy, Strategy::BestFit), conservative] {
            let mut c = PolicyCore::new(crate::policy::tests::flat(64, 1), config);
            assert_eq!(started(&c.step(0, [submit(0, 63, 10_000_000)]).unwrap()), [0]);
            c.step(1, [submit(1, 64, 100)]).unwrap();
            let long = (2..2 + n).map(|job| submit(job, 1, 20_000_000));
            assert!(started(&c.step(2, long).unwrap()).is_empty());
            for k in 0..n {
                let (job, t) = (2 + n + k, 3 + 2 * Time::from(k));
                assert_eq!(started(&c.step(t, [submit(job, 1, 1)]).unwrap()), [job]);
                c.step(t + 1, [Event::End { job }]).unwrap();
            }
            assert_eq!(c.queue_len(), 1 + n as usize);
            let looked = c.counters().backfill_looked_at;
            assert!(looked <= 4 * u64::from(n), "{looked} looks for {n} short jobs");
        }
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
    fn conservative_backfilling_delays_no_waiting_job_where_easy_delays_the_second() {
        // Four processors: job 0 holds one until 50, job 1 two until 100; one is free.
        // Waiting: the head (2: all four, 100 s), job 3 (two, 50 s: reserved at 50 by
        // conservative backfilling, before the head), job 4 (one, 60 s).
        let mut firsts = Vec::new();
        for order in [QueueOrder::Easy, QueueOrder::Conservative] {
            let mut c = core(order, flat(4, 1));
            assert_eq!(started(&c.step(0, [submit(0, 1, 50), submit(1, 2, 100)]).unwrap()), [0, 1]);
            let a = c.step(1, [submit(2, 4, 100), submit(3, 2, 50), submit(4, 1, 60)]).unwrap();
            let at_1 = started(&a);
            // At 50 job 0 ends.
            let at_50 = started(&c.step(50, [Event::End { job: 0 }]).unwrap());
            firsts.push((at_1, at_50));
        }
        // EASY starts job 4 now (it ends by the head's shadow time, 100) and job 3, which needs
        // two, cannot start at 50; conservative backfilling keeps job 4 out of job 3's way.
        assert_eq!(firsts, [(vec![4], vec![]), (vec![], vec![3])]);
    }

    #[test]
    fn a_reservation_depth_of_one_lets_a_job_delay_the_second_waiting_job_as_easy_does() {
        // The first test's scene: with every job reserved, job 4 may not start at 1 (it would
        // delay job 3); with only the head reserved, it may, as under EASY.
        for (depth, expect) in [(None, vec![]), (Some(2), vec![]), (Some(1), vec![4])] {
            let config = PolicyConfig {
                reservation_depth: depth,
                ..PolicyConfig::plain(QueueOrder::Conservative, Strategy::BestFit)
            };
            let mut c = PolicyCore::new(flat(4, 1), config);
            c.step(0, [submit(0, 1, 50), submit(1, 2, 100)]).unwrap();
            let a = c.step(1, [submit(2, 4, 100), submit(3, 2, 50), submit(4, 1, 60)]).unwrap();
            assert_eq!(started(&a), expect, "{depth:?}");
        }
    }

    #[test]
    fn conservative_backfilling_starts_what_delays_nobody_and_plans_on_from_its_last_pass() {
        let mut c = core(QueueOrder::Conservative, flat(4, 1));
        c.step(0, [submit(0, 2, 100)]).unwrap();
        // The head (all four) is reserved at 100; job 2 (one, 1,000 s) would hold one then:
        // it waits. Job 3 (one, 99 s) is done by then: it starts.
        let a = c.step(1, [submit(1, 4, 10), submit(2, 1, 1000), submit(3, 1, 99)]).unwrap();
        assert_eq!(started(&a), [3]);
        // Submitted later with nothing changed: planned after the others, from the same plan
        // (job 2 reserved from 110). One processor is free until 100: a job of 10 s starts, one
        // of 500 s does not.
        let a = c.step(2, [submit(4, 1, 500), submit(5, 1, 10)]).unwrap();
        assert_eq!(started(&a), [5]);
        assert_eq!(c.queue.iter().collect::<Vec<_>>(), [1, 2, 4]);
        assert!(started(&c.step(12, [Event::End { job: 5 }]).unwrap()).is_empty());
        let a = c.step(100, [Event::End { job: 0 }, Event::End { job: 3 }]).unwrap();
        assert_eq!(started(&a), [1]);
        let a = c.step(110, [Event::End { job: 1 }]).unwrap();
        assert_eq!(started(&a), [2, 4]);
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
        let a = starts(c.step(0, [submit(0, 10, 100), submit(1, 4, 100)]).unwrap());
        let hosts: Vec<Vec<HostId>> =
            a.iter().map(|(_, parts)| parts.iter().map(|p| p.host).collect()).collect();
        assert_eq!(hosts, vec![vec![0], vec![0]]);
        // 20 = one whole free host + 4 on the tightest (host 0 has 2 left: no; a whole host).
        let a = starts(c.step(1, [submit(2, 20, 100)]).unwrap());
        let (_, parts) = &a[0];
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
            for (job, parts) in starts(c.step(t, events).unwrap()) {
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
                started(&starts).into_iter().map(|job| Event::End { job }).collect();
            starts = c.step(t + 1, ends).unwrap();
        }
        assert_eq!(c.queue_len(), 0);
        assert_eq!(c.free_procs(), c.total_procs());
        assert!((0..4).all(|h| c.occupancy(h).held.is_empty()));
    }

    fn preempting(hosts: Vec<Arc<HostModel>>, rules: Preempt) -> PolicyCore {
        PolicyCore::new(
            hosts,
            PolicyConfig {
                preempt: Some(rules),
                ..PolicyConfig::plain(QueueOrder::Fcfs, Strategy::BestFit)
            },
        )
    }

    #[test]
    fn a_long_waiting_job_suspends_the_jobs_that_free_the_tightest_domain_and_they_resume_first() {
        let rules = Preempt { min_run: 100, max_suspensions: 1, min_xf: 2.0 };
        let mut c = preempting(two_socket(1), rules);
        // 16 cores, two sockets of 8. a: 4 cores (socket 0), d: 8 cores (socket 1), both long.
        assert_eq!(started(&c.step(0, [submit(0, 4, 10_000)]).unwrap()), vec![0]);
        assert_eq!(started(&c.step(0, [submit(1, 8, 10_000)]).unwrap()), vec![1]);
        // The head needs 8 and has waited long enough only at t = 1001 (xf = (1000 + 1000)/1000).
        let a = c.step(1, [submit(2, 8, 1_000)]).unwrap();
        assert!(a.is_empty(), "8 cores are not free and nobody has waited: {a:?}");
        let a = c.step(500, [Event::Tick]).unwrap();
        assert!(a.is_empty(), "xf 1.5 is below 2: {a:?}");
        let a = c.step(1_001, [Event::Tick]).unwrap();
        // Suspending job 0 (4 cores) frees socket 0 whole; job 1 would free as much with 8.
        assert_eq!(a[0], Action::Suspend { job: 0 });
        let (job, parts) = starts(a).remove(0);
        assert_eq!(job, 2);
        assert!(
            parts[0].placement.metrics.numa_optimal(),
            "one socket: {:?}",
            parts[0].placement.cpus
        );
        assert_eq!(c.suspended_len(), 1);
        // A job submitted now does not start on the suspended job's CPUs before it resumes.
        let a = c.step(1_500, [Event::End { job: 2 }, submit(3, 4, 10)]).unwrap();
        assert_eq!(a.first(), Some(&Action::Resume { job: 0 }), "{a:?}");
        // Suspended once already: never again (max_suspensions 1); job 1 may be.
        let a = c.step(5_000, [submit(4, 16, 1_000)]).unwrap();
        assert!(!a.contains(&Action::Suspend { job: 0 }), "{a:?}");
    }

    #[test]
    fn an_owners_suspension_lends_the_cpus_and_never_shields_the_job_from_preemption() {
        let rules = Preempt { min_run: 300, max_suspensions: 1, min_xf: 2.0 };
        let mut c = preempting(flat(1, 4), rules);
        let (suspend, resume) =
            (|job| Event::OwnerSuspend { job }, |job| Event::OwnerResume { job });
        let refused = |job, why| Action::Refused { job, why };
        c.step(0, [submit(0, 4, 10_000)]).unwrap();
        // Its owner stops it: a job submitted then runs on its CPUs, and its resume waits.
        let a = c.step(100, [suspend(0), submit(1, 2, 50)]).unwrap();
        assert_eq!(a[0], Action::Suspend { job: 0 });
        assert_eq!(started(&a), vec![1]);
        assert_eq!(c.step(120, [resume(0)]).unwrap(), vec![refused(0, Refusal::Lent)]);
        assert_eq!(
            c.step(150, [Event::End { job: 1 }, resume(0)]).unwrap(),
            vec![Action::Resume { job: 0 }]
        );
        assert_eq!(c.free_procs(), 0);
        // Stopped and started again three times more, the last just before a job could preempt it.
        for t in [200, 250, 1_280] {
            assert_eq!(c.step(t, [suspend(0)]).unwrap(), vec![Action::Suspend { job: 0 }]);
            assert_eq!(c.step(t + 10, [resume(0)]).unwrap(), vec![Action::Resume { job: 0 }]);
        }
        // Job 2 reaches expansion factor 2 at 1,295 + 5: neither the owner's three suspensions
        // (max_suspensions 1) nor the resume at 1,290 (min_run 300) spare job 0.
        assert!(c.step(1_295, [submit(2, 4, 5)]).unwrap().is_empty());
        let a = c.step(1_300, [Event::Tick]).unwrap();
        assert_eq!(a[0], Action::Suspend { job: 0 }, "{a:?}");
        assert_eq!(started(&a), vec![2]);
        // The owner may neither resume what preemption suspended nor stop its preemptor.
        // A batch with an event the core cannot take changes nothing (the resume and the
        // suspend before it are not carried out untold).
        let a = c.step(1_310, [resume(0), suspend(2), suspend(3)]);
        assert_eq!(a, Err(PolicyError::OwnerOfUnknownJob { job: 3 }));
        assert_eq!((c.suspended_len(), c.running_len()), (1, 1));
        let a = c.step(1_310, [resume(0), suspend(2), submit(3, 1, 10), suspend(3)]).unwrap();
        assert_eq!(
            a,
            vec![
                refused(0, Refusal::SuspendedByPolicy),
                refused(2, Refusal::HoldsForSuspended),
                refused(3, Refusal::NotRunning),
            ]
        );
        // Ended while its owner had it stopped: its CPUs were not held by it.
        let a = c.step(2_300, [Event::End { job: 2 }]).unwrap();
        assert_eq!(a[0], Action::Resume { job: 0 }, "{a:?}");
        // Refused whole: job 0 is not suspended by the first event untold.
        let a = c.step(2_310, [suspend(0), Event::End { job: 99 }]);
        assert_eq!(a, Err(PolicyError::UnknownJob { job: 99 }));
        assert_eq!(c.suspended_len(), 0);
        c.step(2_400, [Event::End { job: 3 }, suspend(0)]).unwrap();
        c.step(2_500, [Event::End { job: 0 }]).unwrap();
        assert_eq!((c.suspended_len(), c.free_procs()), (0, 4));
        assert_eq!(c.step(2_600, [resume(0)]), Err(PolicyError::OwnerOfUnknownJob { job: 0 }));
    }

    #[test]
    fn jobs_that_have_not_run_long_enough_are_not_suspended() {
        let rules = Preempt { min_run: 10_000, max_suspensions: 5, min_xf: 1.0 };
        let mut c = preempting(flat(2, 1), rules);
        c.step(0, [submit(0, 2, 100_000)]).unwrap();
        let a = c.step(5_000, [submit(1, 1, 10)]).unwrap();
        assert!(a.is_empty(), "{a:?}");
        let a = c.step(10_000, [Event::Tick]).unwrap();
        assert_eq!(a.first(), Some(&Action::Suspend { job: 0 }), "{a:?}");
        // Job 0 held both processors; it resumes when job 1 ends.
        let a = c.step(10_010, [Event::End { job: 1 }]).unwrap();
        assert_eq!(a, vec![Action::Resume { job: 0 }]);
        assert_eq!(c.free_procs(), 0);
    }

    #[test]
    fn preemption_is_rechecked_as_time_passes_not_only_at_submits_and_ends() {
        let rules = Preempt { min_run: 300, max_suspensions: 2, min_xf: 2.0 };
        let mut c = preempting(flat(1, 4), rules);
        c.step(0, [submit(0, 4, 100_000)]).unwrap();
        // Job 1 reaches expansion factor 2 at 100 + 1,000: the core asks to be woken then.
        assert!(c.step(100, [submit(1, 2, 1_000)]).unwrap().is_empty());
        assert_eq!(c.next_wakeup(), Some(1_100));
        let a = c.step(1_100, [Event::Tick]).unwrap();
        assert_eq!(a.first(), Some(&Action::Suspend { job: 0 }), "{a:?}");
        assert_eq!(started(&a), vec![1]);
        // Nobody waits: nothing to wake for.
        assert_eq!(c.next_wakeup(), None);

        // A head past the threshold waits for a running job to reach min_run.
        let mut c = preempting(flat(1, 2), rules);
        c.step(0, [submit(0, 2, 100_000)]).unwrap();
        c.step(10, [submit(1, 2, 1)]).unwrap();
        assert_eq!(c.next_wakeup(), Some(11), "expansion factor 2 at 10 + 1");
        assert!(c.step(11, [Event::Tick]).unwrap().is_empty());
        assert_eq!(c.next_wakeup(), Some(300), "job 0 may be suspended from 300 on");
        let a = c.step(300, [Event::Tick]).unwrap();
        assert_eq!(started(&a), vec![1], "{a:?}");
    }

    #[test]
    fn a_suspended_jobs_cpus_are_lent_only_to_jobs_that_end_before_it_may_resume() {
        let rules = Preempt { min_run: 300, max_suspensions: 2, min_xf: 2.0 };
        let mut c = preempting(flat(1, 4), rules);
        c.step(0, [submit(0, 4, 10_000)]).unwrap();
        c.step(0, [submit(1, 2, 1_000)]).unwrap();
        // Job 1 suspends job 0 at 1,000 and takes 2 of its 4 processors until 2,000.
        let a = c.step(1_000, [Event::Tick]).unwrap();
        assert_eq!(a.first(), Some(&Action::Suspend { job: 0 }), "{a:?}");
        assert_eq!(c.free_procs(), 2);
        // Job 2 would end at 7,100, after job 0 may resume: it is kept off job 0's CPUs.
        let a = c.step(1_100, [submit(2, 2, 6_000)]).unwrap();
        assert!(started(&a).is_empty(), "{a:?}");
        // Job 3 ends at 1,600, before 2,000: it borrows them (EASY behind the waiting job 2).
        let mut c2 = PolicyCore::new(
            flat(1, 4),
            PolicyConfig {
                preempt: Some(rules),
                ..PolicyConfig::plain(QueueOrder::Easy, Strategy::BestFit)
            },
        );
        c2.step(0, [submit(0, 4, 10_000)]).unwrap();
        c2.step(0, [submit(1, 2, 1_000)]).unwrap();
        c2.step(1_000, [Event::Tick]).unwrap();
        assert!(started(&c2.step(1_100, [submit(2, 2, 6_000)]).unwrap()).is_empty());
        let a = c2.step(1_100, [submit(3, 2, 500)]).unwrap();
        assert_eq!(started(&a), vec![3], "{a:?}");
        // Job 3 holds CPUs job 0 waits for: it is never a victim, whoever waits.
        c2.step(1_200, [submit(4, 4, 10)]).unwrap();
        let a = c2.step(1_500, [Event::Tick]).unwrap();
        assert!(!a.contains(&Action::Suspend { job: 3 }), "{a:?}");
        // Both borrowers gone by 2,000: job 0 resumes on its own CPUs before anyone starts.
        c2.step(1_600, [Event::End { job: 3 }]).unwrap();
        let a = c2.step(2_000, [Event::End { job: 1 }]).unwrap();
        assert_eq!(a.first(), Some(&Action::Resume { job: 0 }), "{a:?}");
        let set = |l: &str| CpuSet::parse_list(l).unwrap();
        assert_eq!(
            holds_for_suspended(&set("1-2"), [(7u32, &set("2-3"))]).as_deref(),
            Some("it runs on CPUs 2 held for job 7, suspended by preemption")
        );
        assert!(holds_for_suspended(&set("0-1"), [(7u32, &set("2-3"))]).is_none());
        assert!(may_borrow(Some(10), Some(10)) && !may_borrow(Some(11), Some(10)));
        assert!(!may_borrow(None, Some(10)) && !may_borrow(Some(1), None));
    }

    #[test]
    fn gang_runs_its_row_then_whatever_fits_beside_it() {
        let set = |l: &str| CpuSet::parse_list(l).unwrap();
        let (a, b, c, d) = (set("0-3"), set("4-7"), set("2-5"), set("6-7"));
        // Row 0: a, b. Row 1: c (overlaps both). Row 2: d (overlaps b only).
        let members = [
            GangMember { row: 0, parts: &[(0, &a)] },
            GangMember { row: 0, parts: &[(0, &b)] },
            GangMember { row: 1, parts: &[(0, &c)] },
            GangMember { row: 2, parts: &[(0, &d)] },
        ];
        assert_eq!(gang_runs(0, 3, &members), vec![true, true, false, false]);
        // Row 1's slice: c, then d beside it (6-7 unused); a and b overlap c.
        assert_eq!(gang_runs(1, 3, &members), vec![false, false, true, true]);
        // Row 2's slice: d, then row 0 (a fits beside d, b does not), then c overlaps a.
        assert_eq!(gang_runs(2, 3, &members), vec![true, false, false, true]);
        // A job spanning hosts runs on all or none: e (row 1) is clear on host 1, not host 0.
        let e0 = set("0");
        let e1 = set("0");
        let spanning = [
            GangMember { row: 0, parts: &[(0, &a)] },
            GangMember { row: 1, parts: &[(0, &e0), (1, &e1)] },
        ];
        assert_eq!(gang_runs(0, 2, &spanning), vec![true, false]);
        assert_eq!(gang_runs(1, 2, &spanning), vec![false, true]);
        let g = Gang { slice: 30, rows: 3 };
        assert_eq!(
            (g.active_row(0), g.active_row(29), g.active_row(30), g.active_row(90)),
            (0, 0, 1, 0)
        );
        assert_eq!((g.next_boundary(0), g.next_boundary(29), g.next_boundary(-1)), (30, 30, 0));
        assert_eq!(g.active_row(-1), 2, "slices before the origin count down the same way");
    }

    fn gang(hosts: Vec<Arc<HostModel>>, order: QueueOrder, slice: Time, rows: u32) -> PolicyCore {
        PolicyCore::new(
            hosts,
            PolicyConfig {
                gang: Some(Gang { slice, rows }),
                ..PolicyConfig::plain(order, Strategy::BestFit)
            },
        )
    }

    #[test]
    fn gang_jobs_share_cpus_across_rows_and_take_turns_at_slice_boundaries() {
        let mut c = gang(flat(1, 2), QueueOrder::Fcfs, 10, 2);
        // Both processors to job 0 (row 0), then job 1 (row 1): it starts, frozen at once.
        let a = c.step(0, [submit(0, 2, 100)]).unwrap();
        assert_eq!(started(&a), vec![0]);
        let a = c.step(3, [submit(1, 2, 100)]).unwrap();
        assert_eq!(a[1..], [Action::Suspend { job: 1 }]);
        assert_eq!(started(&a), vec![1]);
        assert_eq!(c.next_wakeup(), Some(10));
        // A third needs a row with room: none.
        assert!(c.step(4, [submit(2, 1, 100)]).unwrap().is_empty());
        // Slice 1 belongs to row 1: job 0 frozen first, then job 1 thawed.
        let a = c.step(10, [Event::Tick]).unwrap();
        assert_eq!(a, vec![Action::Suspend { job: 0 }, Action::Resume { job: 1 }]);
        assert_eq!(c.busy_procs(), 2);
        // Job 1 ends in row 1's slice: job 2 starts in row 1 (row 0 is full) and runs; job 0
        // overlaps it and stays frozen until row 0's slice.
        let a = c.step(15, [Event::End { job: 1 }]).unwrap();
        assert_eq!(started(&a), vec![2]);
        assert_eq!(a.len(), 1, "{a:?}");
        let a = c.step(20, [Event::Tick]).unwrap();
        assert_eq!(a, vec![Action::Suspend { job: 2 }, Action::Resume { job: 0 }]);
        // Once only one row has jobs and nobody is frozen, the core needs no more ticks.
        c.step(21, [Event::End { job: 2 }]).unwrap();
        assert_eq!(c.next_wakeup(), None);
        assert_eq!(c.busy_procs(), 2);
    }

    #[test]
    fn a_gang_job_its_owner_stops_keeps_its_row_place_and_lends_its_slices() {
        let mut c = gang(flat(1, 2), QueueOrder::Fcfs, 10, 2);
        c.step(0, [submit(0, 2, 100)]).unwrap();
        c.step(3, [submit(1, 2, 100)]).unwrap();
        // Job 0 (row 0) is stopped by its owner in its own slice: job 1 (row 1) runs on.
        let a = c.step(5, [Event::OwnerSuspend { job: 0 }]).unwrap();
        assert_eq!(a, vec![Action::Suspend { job: 0 }, Action::Resume { job: 1 }]);
        // Row 0 keeps job 0's place: a job of two processors still finds no row with room.
        assert!(c.step(6, [submit(2, 2, 10)]).unwrap().is_empty());
        // Slices pass without switching; stopping the frozen job 1 too leaves nothing running.
        assert!(c.step(10, [Event::Tick]).unwrap().is_empty());
        assert!(c.step(20, [Event::Tick]).unwrap().is_empty());
        assert_eq!(
            c.step(21, [Event::OwnerSuspend { job: 1 }]).unwrap(),
            vec![Action::Suspend { job: 1 }]
        );
        assert_eq!(c.busy_procs(), 0);
        // Resumed in row 1's slice: job 0 goes back to its turns, frozen at once; job 1 runs.
        let a = c.step(32, [Event::OwnerResume { job: 0 }, Event::OwnerResume { job: 1 }]).unwrap();
        assert_eq!(
            a,
            vec![Action::Resume { job: 0 }, Action::Resume { job: 1 }, Action::Suspend { job: 0 }]
        );
        let a = c.step(40, [Event::Tick]).unwrap();
        assert_eq!(a, vec![Action::Suspend { job: 1 }, Action::Resume { job: 0 }]);
    }

    #[test]
    fn a_gang_job_killed_while_its_owner_stopped_it_gives_its_row_back() {
        let mut c = gang(flat(1, 2), QueueOrder::Fcfs, 10, 2);
        c.step(0, [submit(0, 2, 100)]).unwrap();
        c.step(3, [submit(1, 2, 100)]).unwrap();
        c.step(5, [Event::OwnerSuspend { job: 0 }]).unwrap();
        // Killed while stopped: its row's two processors are free again for a new job.
        let a = c.step(6, [Event::End { job: 0 }, submit(2, 2, 10)]).unwrap();
        assert_eq!(started(&a), [2], "{a:?}");
    }

    /// Each job's CPUs per host, and whether it runs now.
    type Live = std::collections::BTreeMap<JobKey, (Vec<(HostId, CpuSet)>, bool)>;

    #[test]
    fn under_gang_slicing_no_cpu_runs_two_jobs_at_once() {
        for order in [QueueOrder::Fcfs, QueueOrder::Easy] {
            let mut c = gang(two_socket(3), order, 7, 3);
            let mut rng = crate::bench::SplitMix::new(23);
            let mut running: Live = Default::default();
            let mut t = 0;
            let mut freezes = 0;
            for job in 0..600u32 {
                t += rng.below(5) as Time;
                if let Some(w) = c.next_wakeup() {
                    if w <= t {
                        c.step(w, [Event::Tick])
                            .unwrap()
                            .into_iter()
                            .for_each(|a| freezes += apply(&mut running, a));
                    }
                }
                let mut events =
                    vec![submit(job, 1 + rng.below(30) as u32, 1 + rng.below(60) as i64)];
                if rng.below(3) == 0 {
                    if let Some(&victim) =
                        running.keys().nth(rng.below(running.len().max(1) as u64) as usize)
                    {
                        events.push(Event::End { job: victim });
                        running.remove(&victim);
                    }
                }
                for a in c.step(t, events).unwrap() {
                    freezes += apply(&mut running, a);
                }
                let mut per_host: std::collections::HashMap<HostId, CpuSet> = Default::default();
                for (parts, live) in running.values() {
                    for (h, cpus) in parts.iter().filter(|_| *live) {
                        let seen = per_host.entry(*h).or_default();
                        assert!(
                            !seen.intersects(cpus),
                            "{order:?}: a CPU runs two jobs on host {h} at {t}"
                        );
                        seen.union_with(cpus);
                    }
                }
                let live: u64 = running
                    .values()
                    .filter(|(_, l)| *l)
                    .map(|(p, _)| p.iter().map(|(_, c)| c.len() as u64 / 2).sum::<u64>())
                    .sum();
                assert_eq!(live, c.busy_procs(), "{order:?} at {t}");
            }
            assert!(freezes > 100, "{order:?}: the stream makes rows take turns ({freezes})");
        }
        fn apply(running: &mut Live, a: Action) -> u32 {
            match a {
                Action::Start { job, parts } => {
                    running.insert(job, (cpus_by_host(&parts), true));
                    0
                }
                Action::Suspend { job } => {
                    running.get_mut(&job).unwrap().1 = false;
                    1
                }
                Action::Resume { job } => {
                    running.get_mut(&job).unwrap().1 = true;
                    0
                }
                other => unreachable!("no malleable jobs, moves or blocks here: {other:?}"),
            }
        }
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

    fn malleable(order: QueueOrder, hosts: Vec<Arc<HostModel>>) -> PolicyCore {
        PolicyCore::new(
            hosts,
            PolicyConfig {
                malleable: Some(Malleability::default()),
                ..PolicyConfig::plain(order, Strategy::BestFit)
            },
        )
    }

    fn submit_malleable(job: JobKey, procs: u32, estimate: Time) -> Event {
        Event::Submit { job, spec: JobSpec { procs, estimate, malleable: true } }
    }

    /// (job, processors) of every start and resize, in order.
    fn sizes(actions: &[Action]) -> Vec<(&'static str, JobKey, usize)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Start { job, parts } => {
                    Some(("start", *job, parts.iter().map(|p| p.placement.tasks.len()).sum()))
                }
                Action::Resize { job, parts } => {
                    Some(("resize", *job, parts.iter().map(|p| p.placement.tasks.len()).sum()))
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_malleable_job_starts_on_what_is_free_and_shares_by_equipartition() {
        let mut c = malleable(QueueOrder::Fcfs, flat(1, 8));
        // Rigid job 0 holds 6 of 8. Job 1 (8 processors, malleable: 2 to 8) starts on the 2
        // left instead of waiting; job 2 (4: 1 to 4) finds nothing beyond job 1's least size.
        assert_eq!(sizes(&c.step(0, [submit(0, 6, 100)]).unwrap()), vec![("start", 0, 6)]);
        let a = c.step(1, [submit_malleable(1, 8, 100), submit_malleable(2, 4, 100)]).unwrap();
        assert_eq!(sizes(&a), vec![("start", 1, 2)]);
        assert_eq!((c.free_procs(), c.busy_procs(), c.queue_len()), (0, 8, 1));
        // Job 0 ends: job 1 takes what it freed (as topod grows it at the release, before the
        // batch system starts the next job), then job 2 starts and the two share the 8 equally.
        let a = c.step(50, [Event::End { job: 0 }]).unwrap();
        assert_eq!(sizes(&a), vec![("resize", 1, 8), ("resize", 1, 4), ("start", 2, 4)]);
        assert_eq!(c.malleable_on(0), vec![(1, 4), (2, 4)]);
        // Their least sizes (2 and 1) are all a starting job cannot have.
        assert_eq!((c.free_procs(), c.busy_procs()), (5, 8));
        // Job 2 ends: job 1 takes the whole host.
        let a = c.step(60, [Event::End { job: 2 }]).unwrap();
        assert_eq!(sizes(&a), vec![("resize", 1, 8)]);
        assert_eq!(c.occupancy(0).held.len(), 8);
        assert_eq!(c.malleable_started(), 2);
    }

    #[test]
    fn a_rigid_job_shrinks_malleable_jobs_first_and_waits_when_their_least_sizes_are_in_the_way() {
        let mut c = malleable(QueueOrder::Fcfs, two_socket(1));
        // 16 cores. Job 0 (16, malleable 4 to 16) takes them all.
        let a = c.step(0, [submit_malleable(0, 16, 1_000)]).unwrap();
        assert_eq!(sizes(&a), vec![("start", 0, 16)]);
        // Rigid job 1 (8): job 0 shrinks to 8 first, then job 1 starts, on other CPUs, in one
        // socket.
        let a = c.step(10, [submit(1, 8, 1_000)]).unwrap();
        assert_eq!(sizes(&a), vec![("resize", 0, 8), ("start", 1, 8)]);
        let (Action::Resize { parts: kept, .. }, Action::Start { parts: new, .. }) = (&a[0], &a[1])
        else {
            panic!("{a:?}")
        };
        assert!(!kept[0].placement.cpus.intersects(&new[0].placement.cpus));
        assert!(new[0].placement.metrics.numa_optimal());
        // Rigid job 2 (5): only 4 more can be taken back from job 0 (its least size is 4).
        let a = c.step(20, [submit(2, 5, 1_000)]).unwrap();
        assert!(a.is_empty(), "{a:?}");
        assert_eq!(c.free_procs(), 4);
        // Rigid job 3 (4) fits: job 0 goes down to its least size.
        let a = c.step(21, [Event::End { job: 2 }, submit(3, 4, 1_000)]).unwrap();
        assert_eq!(sizes(&a), vec![("resize", 0, 4), ("start", 3, 4)]);
        // Job 1 ends: job 0 grows into its cores.
        let a = c.step(30, [Event::End { job: 1 }]).unwrap();
        assert_eq!(sizes(&a), vec![("resize", 0, 12)]);
    }

    #[test]
    fn easy_plans_a_malleable_job_with_its_least_size_and_longest_run() {
        let mut c = malleable(QueueOrder::Easy, flat(1, 8));
        // Job 0 rigid 4 until 100; the head (rigid 8) waits for it.
        c.step(0, [submit(0, 4, 100)]).unwrap();
        assert!(c.step(1, [submit(1, 8, 100)]).unwrap().is_empty());
        // Job 2, malleable 4 (1 to 4), 20 s at 4: at its least size 80 s, which ends before
        // the shadow time (100): it starts, on the 4 free.
        let a = c.step(2, [submit_malleable(2, 4, 20)]).unwrap();
        assert_eq!(sizes(&a), vec![("start", 2, 4)]);
        c.step(3, [Event::End { job: 2 }]).unwrap();
        // Job 3, malleable 4, 30 s: 120 s at its least size ends after the shadow time, and the
        // head needs every processor then: it waits although 4 are free.
        let a = c.step(4, [submit_malleable(3, 4, 30)]).unwrap();
        assert!(a.is_empty(), "{a:?}");
    }

    #[test]
    fn with_malleable_jobs_no_cpu_is_given_twice_and_hosts_are_shared_by_equipartition() {
        for order in [QueueOrder::Fcfs, QueueOrder::Easy] {
            let hosts = two_socket(3);
            let model = Arc::clone(&hosts[0]);
            let mut c = malleable(order, hosts);
            let mut rng = crate::bench::SplitMix::new(31);
            // Each running job: its CPUs per host and its processors.
            let mut held: BTreeMap<JobKey, (Vec<(HostId, CpuSet)>, u32)> = BTreeMap::new();
            let mut specs: BTreeMap<JobKey, JobSpec> = BTreeMap::new();
            let (mut resizes, mut t) = (0, 0);
            for job in 0..500u32 {
                t += 1;
                let spec = JobSpec {
                    procs: 1 + rng.below(24) as u32,
                    estimate: 1 + rng.below(50) as Time,
                    malleable: rng.below(2) == 0,
                };
                specs.insert(job, spec);
                let mut events = vec![Event::Submit { job, spec }];
                if rng.below(2) == 0 {
                    if let Some(&victim) =
                        held.keys().nth(rng.below(held.len().max(1) as u64) as usize)
                    {
                        events.push(Event::End { job: victim });
                        held.remove(&victim);
                    }
                }
                for a in c.step(t, events).unwrap() {
                    match a {
                        Action::Start { job, parts } => {
                            let procs = parts.iter().map(|p| p.placement.tasks.len() as u32).sum();
                            held.insert(job, (cpus_by_host(&parts), procs));
                        }
                        Action::Resize { job, parts } => {
                            resizes += 1;
                            let procs = parts[0].placement.tasks.len() as u32;
                            held.insert(job, (cpus_by_host(&parts), procs));
                        }
                        other => panic!("{other:?}"),
                    }
                }
                let mut per_host: BTreeMap<HostId, CpuSet> = BTreeMap::new();
                let mut busy = 0u64;
                for (job, (parts, procs)) in &held {
                    let (spec, procs) = (specs[job], *procs);
                    busy += u64::from(procs);
                    let (min, max) = Malleability::default().range(spec.procs);
                    if !spec.malleable || parts.len() > 1 {
                        assert_eq!(procs, spec.procs, "{order:?}: rigid job {job} resized");
                    }
                    assert!((min..=max).contains(&procs), "{order:?}: job {job} at {procs}");
                    for (h, cpus) in parts {
                        let seen = per_host.entry(*h).or_default();
                        assert!(!seen.intersects(cpus), "{order:?}: a CPU given twice on {h}");
                        seen.union_with(cpus);
                    }
                }
                assert_eq!(busy, c.busy_procs(), "{order:?} at {t}");
                for h in 0..3 {
                    let mine = per_host.get(&h).cloned().unwrap_or_default();
                    assert_eq!(mine, c.occupancy(h).held, "{order:?}: host {h} at {t}");
                    // Equipartition wastes nothing: a malleable job below its size means no
                    // wholly free core on its host.
                    let below =
                        c.malleable_on(h).iter().any(|&(job, procs)| procs < specs[&job].procs);
                    let free_cores =
                        model.cores.iter().filter(|core| !core.intersects(&mine)).count();
                    assert!(
                        !below || free_cores == 0,
                        "{order:?}: host {h} at {t}: {free_cores} free, {:?}",
                        c.malleable_on(h)
                    );
                }
            }
            assert!(resizes > 100, "{order:?}: the stream resizes jobs ({resizes})");
            assert!(c.malleable_started() > 50, "{order:?}: {}", c.malleable_started());
            // Everything comes back.
            let ends: Vec<Event> = held.keys().map(|&job| Event::End { job }).collect();
            let mut actions = c.step(t + 1, ends).unwrap();
            while !actions.is_empty() {
                t += 1;
                let started: Vec<JobKey> = started(&actions);
                let ends = started.into_iter().map(|job| Event::End { job });
                actions = c.step(t + 1, ends).unwrap();
            }
            assert_eq!(c.queue_len(), 0, "{order:?}");
            assert_eq!((c.free_procs(), c.busy_procs()), (c.total_procs(), 0), "{order:?}");
        }
    }

    // ---- NUMA-local jobs, migration, reservations, prime time ----

    fn spaced(
        order: QueueOrder,
        hosts: Vec<Arc<HostModel>>,
        set: impl FnOnce(&mut PolicyConfig),
    ) -> PolicyCore {
        let mut config =
            PolicyConfig { numa_local: true, ..PolicyConfig::plain(order, Strategy::BestFit) };
        set(&mut config);
        PolicyCore::new(hosts, config)
    }

    /// The NUMA node `cpus` lie in, when they lie in one.
    fn node_of(model: &HostModel, cpus: &CpuSet) -> Option<usize> {
        let touched = model.touched(Level::Numa, cpus);
        (touched.len() == 1).then(|| touched[0])
    }

    #[test]
    fn a_job_refused_on_shape_starts_after_the_fewest_moves_and_young_jobs_stay() {
        for (min_run, migrate) in [(60, true), (200, false)] {
            let hosts = two_socket(1);
            let model = Arc::clone(&hosts[0]);
            let mut c = spaced(QueueOrder::Fcfs, hosts, |cfg| {
                cfg.defrag = Some(Defrag { min_run, ..Defrag::default() });
            });
            // Job 0 (4 cores) and job 2 (2) share node 0, job 1 (6) has node 1: two cores are
            // free in each node.
            let first = starts(
                c.step(0, [submit(0, 4, 1000), submit(2, 2, 1000), submit(1, 6, 1000)]).unwrap(),
            );
            let mut held: BTreeMap<JobKey, CpuSet> =
                first.iter().map(|(j, p)| (*j, p[0].placement.cpus.clone())).collect();
            let node = |held: &BTreeMap<JobKey, CpuSet>, job| node_of(&model, &held[&job]);
            assert_eq!(
                (node(&held, 0), node(&held, 2), node(&held, 1)),
                (Some(0), Some(0), Some(1))
            );
            // Job 3 asks for 4 cores in one node at 100: four are free, two in each.
            let actions = c.step(100, [submit(3, 4, 10)]).unwrap();
            if !migrate {
                assert!(actions.is_empty(), "job 2 has run 100 s of the 200 it must: {actions:?}");
                assert_eq!(c.counters().refused_on_shape, 1);
                assert_eq!(c.queue_len(), 1);
                continue;
            }
            for a in &actions {
                match a {
                    Action::Move { job, parts, why: MoveReason::Defrag, pause: 0 } => {
                        held.insert(*job, parts[0].placement.cpus.clone());
                    }
                    Action::Start { job, parts } => {
                        held.insert(*job, parts[0].placement.cpus.clone());
                    }
                    other => panic!("{other:?}"),
                }
            }
            // One move: the small job goes to node 1, the new one gets node 0's four cores.
            assert!(matches!(actions[0], Action::Move { job: 2, .. }), "{actions:?}");
            assert!(matches!(actions[1], Action::Start { job: 3, .. }), "{actions:?}");
            assert_eq!((node(&held, 2), node(&held, 3), held[&3].len()), (Some(1), Some(0), 8));
            let k = c.counters();
            assert_eq!((k.moves, k.moved_pus, k.defrag_starts, k.refused_on_shape), (1, 4, 1, 0));
            let mut all = CpuSet::new();
            for cpus in held.values() {
                assert!(!all.intersects(cpus), "a CPU given twice");
                all.union_with(cpus);
            }
            assert_eq!(all, c.occupancy(0).held);
            assert_eq!(c.free_procs(), 0);
        }
    }

    #[test]
    fn a_block_keeps_a_long_backfilled_job_off_the_node_the_head_waits_for() {
        let mut head_start = Vec::new();
        for reserve in [None, Some(Reserve::Outlasting), Some(Reserve::Strict)] {
            let hosts = two_socket(1);
            let model = Arc::clone(&hosts[0]);
            let mut c = spaced(QueueOrder::Easy, hosts, |cfg| cfg.reserve = reserve);
            // Job 0 (5 cores, to 100) takes node 0, job 1 (4, to 1000) node 1: 3 and 4 free.
            c.step(0, [submit(0, 5, 100), submit(1, 4, 1000)]).unwrap();
            // The head, job 2 (7 in one node), fits nowhere now; job 0's end frees node 0 for
            // it. Job 3 (3, to 1001) outlasts that but fits in EASY's extra processors.
            let a = c.step(1, [submit(2, 7, 100), submit(3, 3, 1000)]).unwrap();
            let started_3 = starts(a.clone());
            assert_eq!(started_3.iter().map(|(j, _)| *j).collect::<Vec<_>>(), vec![3]);
            let node_3 = node_of(&model, &started_3[0].1[0].placement.cpus);
            if reserve.is_some() {
                let (head, blocks) = c.blocks().expect("blocks for the head");
                assert_eq!((head, blocks.len()), (2, 1));
                assert_eq!(node_of(&model, &blocks[0].1), Some(0));
                assert!(!blocks[0].1.intersects(&started_3[0].1[0].placement.cpus));
                assert!(a.iter().any(|x| matches!(x, Action::Reserve { job: 2, .. })));
                assert_eq!(node_3, Some(1), "job 3 kept off the head's node");
            } else {
                assert_eq!(node_3, Some(0), "best-fit takes the tighter node");
            }
            let b = c.step(100, [Event::End { job: 0 }]).unwrap();
            if started(&b).contains(&2) {
                head_start.push(100);
                let k = c.counters();
                assert_eq!((k.reserved_heads, k.heads_in_block), (1, 1));
                assert!(c.blocks().is_none(), "spent");
            } else {
                let b = c.step(1000, [Event::End { job: 1 }]).unwrap();
                assert_eq!(started(&b), vec![2]);
                head_start.push(1000);
            }
        }
        assert_eq!(head_start, vec![1000, 100, 100]);
    }

    #[test]
    fn a_job_that_ends_before_the_head_may_use_its_block_unless_blocks_are_strict() {
        for (reserve, expect) in [(Reserve::Outlasting, vec![3]), (Reserve::Strict, vec![])] {
            let hosts = two_socket(1);
            let mut c = spaced(QueueOrder::Easy, hosts, |cfg| cfg.reserve = Some(reserve));
            c.step(0, [submit(0, 5, 100), submit(1, 4, 1000)]).unwrap();
            // The head, job 2, gets a block of 7 cores in node 0, due at 100; job 4 (4 cores,
            // outlasting that) fills node 1. Node 0's 3 free cores are then mostly in the block.
            c.step(1, [submit(2, 7, 100), submit(4, 4, 5000)]).unwrap();
            // Job 3 (3 cores for 50 s) is gone by 100: it may use the block, unless strict.
            let a = c.step(2, [submit(3, 3, 50)]).unwrap();
            assert_eq!(started(&a), expect, "{reserve:?}");
        }
    }

    #[test]
    fn prime_time_pools_keep_others_out_in_their_windows_and_migrate_at_the_opening() {
        // 2026-11-23 00:00 UTC, a Monday.
        let monday = 1_795_392_000;
        let hour = 3600;
        let prime = Prime {
            size: PoolSize::Cores(4),
            windows: vec!["Mon-Fri 08:00-18:00".parse().unwrap()],
            max_estimate: 3600,
            on_open: OnOpen::Migrate,
            epoch_at_zero: monday,
            utc_offset: 0,
        };
        assert_eq!(prime.next_change(0), Some(8 * hour));
        assert_eq!(prime.next_change(8 * hour), Some(18 * hour));
        assert_eq!(prime.next_change(4 * 24 * hour + 18 * hour), Some(7 * 24 * hour + 8 * hour));
        let pacific = Prime { utc_offset: -8 * hour, ..prime.clone() };
        assert_eq!(pacific.next_change(0), Some(16 * hour), "Monday 08:00 local is 16:00 UTC");
        assert!(!pacific.open_at(9 * hour) && pacific.open_at(17 * hour));

        let config = PolicyConfig {
            prime: Some(prime),
            ..PolicyConfig::plain(QueueOrder::Fcfs, Strategy::BestFit)
        };
        let mut c = PolicyCore::new(two_socket(1), config);
        let pool = c.pool_cpus(0);
        assert_eq!(pool.len(), 8, "4 cores of 2 threads");
        // 07:00, the window closed: a long job of 4 cores lands on the pool's cores.
        let a = starts(c.step(7 * hour, [submit(0, 4, 10 * hour)]).unwrap());
        assert_eq!(a[0].1[0].placement.cpus, pool);
        assert_eq!(c.next_wakeup(), Some(8 * hour), "woken at the opening, to move it");
        // 08:00: the window opens and it is moved out.
        match c.step(8 * hour, [Event::Tick]).unwrap().as_slice() {
            [Action::Move { job: 0, parts, why: MoveReason::PrimeWindow, .. }] => {
                assert!(!parts[0].placement.cpus.intersects(&pool));
            }
            other => panic!("{other:?}"),
        }
        // 09:00: a long job of 8 cores fits outside the pool; a short one (admitted) goes into
        // the pool; a long one of 1 core finds only the pool's cores free, and waits.
        let b = starts(
            c.step(9 * hour, [submit(1, 8, 2 * hour), submit(2, 4, 600), submit(3, 1, 2 * hour)])
                .unwrap(),
        );
        let cpus =
            |job| b.iter().find(|(j, _)| *j == job).map(|(_, p)| p[0].placement.cpus.clone());
        assert!(!cpus(1).unwrap().intersects(&pool));
        assert_eq!(cpus(2), Some(pool.clone()));
        assert_eq!((cpus(3), c.queue_len()), (None, 1));
        assert_eq!(c.next_wakeup(), Some(18 * hour), "woken at the close, for the waiting job");
        // The short job ends: its pool is free, but not for a long job while the window is open.
        assert!(c.step(9 * hour + 600, [Event::End { job: 2 }]).unwrap().is_empty());
        // 18:00: the window closes, and the waiting job takes a pool core.
        let d = starts(c.step(18 * hour, [Event::Tick]).unwrap());
        assert_eq!(d.len(), 1);
        assert!(d[0].1[0].placement.cpus.is_subset(&pool));
        let k = c.counters();
        assert_eq!((k.prime_moves, k.admitted_starts), (1, 1));
    }

    #[test]
    fn with_every_space_option_no_cpu_is_given_twice_and_the_occupancy_is_the_jobs() {
        for order in [QueueOrder::Fcfs, QueueOrder::Easy, QueueOrder::Conservative] {
            let hosts = two_socket(3);
            let model = Arc::clone(&hosts[0]);
            let prime = Prime {
                size: PoolSize::Share(0.25),
                windows: vec!["Mon-Fri 08:00-18:00".parse().unwrap()],
                max_estimate: 30,
                on_open: OnOpen::Migrate,
                epoch_at_zero: 1_795_392_000,
                utc_offset: 0,
            };
            // (Conservative backfilling keeps every job rigid: with malleable jobs it is EASY.)
            let conservative = order == QueueOrder::Conservative;
            let mut c = spaced(order, hosts, |cfg| {
                cfg.malleable = (!conservative).then(Malleability::default);
                cfg.defrag = Some(Defrag { min_run: 5, gap: 10, ..Defrag::default() });
                cfg.reserve = (order == QueueOrder::Easy).then_some(Reserve::Outlasting);
                cfg.prime = Some(prime.clone());
            });
            let mut rng = crate::bench::SplitMix::new(41);
            let mut held: Held = BTreeMap::new();
            let mut specs: BTreeMap<JobKey, JobSpec> = BTreeMap::new();
            let (mut t, mut moves) = (0, 0);
            for job in 0..800u32 {
                // Minutes apart, so that the windows open and close.
                t += 60 * rng.below(30) as Time;
                if let Some(w) = c.next_wakeup().filter(|w| *w <= t) {
                    for a in c.step(w, [Event::Tick]).unwrap() {
                        moves += apply(&mut held, &specs, a, w, &prime, &c);
                    }
                }
                let spec = JobSpec {
                    procs: 1 + rng.below(20) as u32,
                    estimate: 1 + rng.below(60) as Time,
                    malleable: rng.below(4) == 0,
                };
                specs.insert(job, spec);
                let mut events = vec![Event::Submit { job, spec }];
                if rng.below(2) == 0 {
                    if let Some(&victim) =
                        held.keys().nth(rng.below(held.len().max(1) as u64) as usize)
                    {
                        events.push(Event::End { job: victim });
                        held.remove(&victim);
                    }
                }
                for a in c.step(t, events).unwrap() {
                    moves += apply(&mut held, &specs, a, t, &prime, &c);
                }
                let mut per_host: BTreeMap<HostId, CpuSet> = BTreeMap::new();
                for (parts, _) in held.values() {
                    for (h, cpus) in parts {
                        let seen = per_host.entry(*h).or_default();
                        assert!(!seen.intersects(cpus), "{order:?}: a CPU given twice on {h}");
                        seen.union_with(cpus);
                    }
                }
                for h in 0..3 {
                    let mine = per_host.get(&h).cloned().unwrap_or_default();
                    assert_eq!(mine, c.occupancy(h).held, "{order:?}: host {h} at {t}");
                }
                // NUMA-local jobs stay in one node, moved or not.
                for (parts, spec) in held.values() {
                    if !spec.malleable && spec.procs <= 8 {
                        assert!(node_of(&model, &parts[0].1).is_some(), "{order:?}: {spec:?}");
                    }
                }
            }
            assert!(moves > 0, "{order:?}: the stream moves jobs");
            let k = c.counters();
            assert!(k.admitted_starts > 50 && k.refused_on_shape > 0, "{order:?}: {k:?}");
            if order == QueueOrder::Easy {
                assert!(k.blocks_made > 0 && k.heads_in_block > 0, "{k:?}");
            }
        }

        /// Each running job's CPUs per host and what it asked for.
        type Held = BTreeMap<JobKey, (Vec<(HostId, CpuSet)>, JobSpec)>;

        /// Applies an action; checks that no job the pools do not admit is placed on them in a
        /// window; returns 1 for a move.
        fn apply(
            held: &mut Held,
            specs: &BTreeMap<JobKey, JobSpec>,
            a: Action,
            t: Time,
            prime: &Prime,
            c: &PolicyCore,
        ) -> u32 {
            let (job, parts, moved) = match a {
                Action::Start { job, parts } | Action::Resize { job, parts } => (job, parts, 0),
                Action::Move { job, parts, .. } => (job, parts, 1),
                Action::Reserve { .. } => return 0,
                other => panic!("{other:?}"),
            };
            let spec = specs[&job];
            if prime.open_at(t) && !prime.admits(&spec) {
                for p in &parts {
                    let before = held.get(&job).and_then(|(old, _)| {
                        old.iter().find(|(h, _)| *h == p.host).map(|(_, c)| c.clone())
                    });
                    // New CPUs on a pool in a window: none (a shrink keeps old ones).
                    let new = p.placement.cpus.difference(&before.unwrap_or_default());
                    assert!(
                        !new.intersects(&c.pool_cpus(p.host)),
                        "job {job} at {t}: {spec:?} moved {moved} new {new} pool {}",
                        c.pool_cpus(p.host)
                    );
                }
            }
            held.insert(job, (cpus_by_host(&parts), spec));
            moved
        }
    }
}
