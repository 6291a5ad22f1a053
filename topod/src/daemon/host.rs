//! The host's state: its hardware graph, the ledger, and the job cgroups, kept in step.
//!
//! Every change goes cgroup first, ledger second, job record third: a job is in the ledger only
//! once its cgroup exists with its CPUs, and leaves the ledger only once its cgroup is gone. The
//! record (request, tasks, owner; [`super::records`]) is written before `allocate` answers; at
//! start the ledger is rebuilt from the cgroups that exist, with the records adding what the
//! cgroup tree cannot say ([`Host::recover`]).
//!
//! Locking: the server holds one lock over a `Host`, and nothing done under it waits on a
//! client or on a job's processes. Requests are parsed and checked before the lock
//! ([`prepare`]); reads copy a [`Snapshot`] and work without it; a release kills and waits
//! without it ([`Host::begin_release`], [`ReleaseTicket::run`], [`Host::finish_release`]), as
//! do a suspend and a resume ([`FreezeTicket`]) and the freezes and thaws that follow a change:
//! gang slices, a preemption's victims and their resumes, queued for the server
//! ([`KernelWork`]). Under the lock the kernel is only asked about cgroups no process is in
//! yet (a new job's, made frozen for its gang row, or undone) and, at start, before serving.

#[cfg(test)]
mod agrees;
mod follow;
mod moves;
mod pools;
mod preempt;
mod reserve;
mod settle;
mod space;
pub use moves::check_resize_signal;
pub use pools::{make_pools, PoolConfig};
pub use reserve::MAX_RESERVATION_S;
pub use settle::KernelWork;
pub use space::DefragConfig;

use super::records::{Records, RecordsError};
use crate::cgroup::{CgroupBackend, CgroupError, CgroupSpec, JobId, JobIdError, ReleaseReport};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use topo_core::cpuset::CpuSet;
use topo_core::ledger::{Allocation, JobState, JobView, Ledger, LedgerError, Missized};
use topo_core::place::{self, HostMetrics, HostModel, PlaceError, Strategy};
use topo_core::request::{self, Request};
use topo_core::topology::Topology;

/// Why a host operation was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// A job id that cannot name a cgroup.
    #[error(transparent)]
    BadJob(#[from] JobIdError),
    /// A request string that does not parse.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The job does not fit now.
    #[error("{} does not fit: {source}{held_back}", fit_subject(job))]
    DoesNotFit {
        /// The job (empty for a `fit`, which names none).
        job: String,
        /// Why.
        #[source]
        source: PlaceError,
        /// When only other jobs' reservations or open prime-time pools keep it out: `; it
        /// would fit without ...` naming them (else empty), so that a user who sees free CPUs
        /// in the host's picture learns why they are not theirs.
        held_back: String,
    },
    /// The jobs an allocate preempts are being frozen, without the host lock: the server asks
    /// again once they are (never an answer to a client).
    #[error("job {0}: the jobs it preempts are being suspended")]
    PreemptionUnderWay(String),
    /// The job already holds CPUs for another request.
    #[error("job {job} already holds CPUs {cpus} for {request}")]
    AlreadyAllocated {
        /// The job.
        job: String,
        /// Its CPUs.
        cpus: String,
        /// Its request.
        request: String,
    },
    /// A pid that names no other process (0 and below mean the writer itself to the kernel).
    #[error("pid {0} is not a process topod can move into a job")]
    BadPid(i32),
    /// No such job.
    #[error("job {0} holds nothing on this host")]
    UnknownJob(String),
    /// Processes that would not die.
    #[error("job {job}: {} process(es) would not die ({pids:?}); its cgroup and CPUs are kept", pids.len())]
    Survivors {
        /// The job.
        job: String,
        /// Their pids.
        pids: Vec<i32>,
    },
    /// The cgroup layer failed.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// The ledger refused (a bug or a foreign cgroup overlapping ours).
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    /// The job is being released.
    #[error("job {0} is being released; try again once its release has finished")]
    Releasing(String),
    /// The job record could not be written.
    #[error("the job record could not be written, so nothing was changed: {0}")]
    Records(RecordsError),
    /// The job is being suspended or resumed.
    #[error("job {job} is {what}; try again once that has finished")]
    Changing {
        /// The job.
        job: String,
        /// `being suspended` or `being resumed`.
        what: &'static str,
    },
    /// The job is suspended: it takes no process and is not allocated again until resumed.
    #[error(
        "job {0} is suspended (its processes are frozen and its CPUs may be lent); resume it first"
    )]
    Suspended(String),
    /// A resume while another job runs on the suspended job's CPUs.
    #[error("job {job} stays suspended: its CPUs {cpus} are lent to job {holder}; resume it once {holder} has ended or been suspended")]
    Lent {
        /// The suspended job.
        job: String,
        /// The CPUs in use.
        cpus: String,
        /// The job running on them.
        holder: String,
    },
    /// An owner's suspend or resume of a job with a process in it that is not the owner's.
    #[error("job {job}: process {pid} in it runs as uid {uid}, not as the job's owner: only root, an administrator or the batch system may suspend or resume it")]
    ForeignProcess {
        /// The job.
        job: String,
        /// The process.
        pid: i32,
        /// Its real or effective uid that is not the owner's.
        uid: u32,
    },
    /// An owner's suspend of a job that holds CPUs a job suspended by preemption waits for.
    #[error("job {job} may not be suspended by its owner: {why}; it would keep that job frozen (only root, an administrator or the batch system may suspend it)")]
    HoldsForPreempted {
        /// The job.
        job: String,
        /// Which CPUs, held for which job.
        why: String,
    },
    /// An argument out of its range (not the request).
    #[error("{0}")]
    BadArgument(String),
    /// An unreserve of a job that has no reservation.
    #[error("job {0} has no topology reservation on this host")]
    NoReservation(String),
    /// A resize of a job whose request has no task range.
    #[error("job {job} is not malleable: its request {request:?} gives no task range (ask for one with *min-max, e.g. affinity[core*4-16])")]
    NotMalleable {
        /// The job.
        job: String,
        /// Its request.
        request: String,
    },
    /// A resize of a job whose tasks are not known: recovered from its cgroup without its
    /// record, its CPUs do not divide into its request's tasks.
    #[error("job {job}: its tasks are not known (topod recovered it from its cgroup without a record of its tasks, or with one its cgroup no longer matches, and its CPUs {cpus} do not divide into tasks of {request}); it is not resized, and runs on as it is until it ends")]
    TasksUnknown {
        /// The job.
        job: String,
        /// Its CPUs.
        cpus: String,
        /// Its request.
        request: String,
    },
    /// A resize outside the job's range.
    #[error("job {job} runs with {min} to {max} tasks; {tasks} is outside that range")]
    OutOfRange {
        /// The job.
        job: String,
        /// Tasks asked.
        tasks: u32,
        /// Its least.
        min: u32,
        /// Its most.
        max: u32,
    },
    /// The notify directory cannot be used.
    #[error("the notify directory: {0}")]
    Notify(String),
    /// A gang-scheduled allocate on a host without gang slicing.
    #[error("job {0} asks to be gang-scheduled, but gang time slicing is off on this host (topod.toml: gang_rows = 2 or more)")]
    NoGang(String),
    /// A gang row the host does not have.
    #[error("job {job} asks for gang row {row}; this host has rows 0 to {} (gang_rows = {rows})", rows - 1)]
    GangRow {
        /// The job.
        job: String,
        /// The row asked.
        row: u32,
        /// Rows configured.
        rows: u32,
    },
}

/// What the job record keeps per job (see [`super::records`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobHint {
    /// The canonical request.
    pub request: String,
    /// The CPUs of each task.
    pub tasks: Vec<CpuSet>,
    /// The uid that may join its own processes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_uid: Option<u32>,
    /// When the job was last allocated (a new allocation, or the same one asked again), in UTC
    /// to the nanosecond: a release queued before then was for an earlier run of the same job id
    /// ([`Host::allocated_after`]), also after a restart. Records written before this field
    /// existed take their file's time ([`super::records::Records::load`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated_at: Option<String>,
    /// How many times topod's preemption has suspended the job (`preempt_max_suspensions`).
    /// Suspensions by its owner, an administrator or the batch system are not the policy's and
    /// do not count: an owner's own would otherwise use up the job's turns and shield it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub suspensions: u32,
    /// Written before topod freezes the job and cleared after it thaws it: a frozen cgroup
    /// whose record does not say so was frozen by a release that a crash cut short, not
    /// suspended ([`Host::recover`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub suspended: bool,
    /// The job's owner, when it was the owner who suspended it: only then may the owner resume
    /// it (a suspension by root, an administrator or the batch system is theirs to undo).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspended_by: Option<u32>,
    /// Its gang row, when gang-scheduled: a job found frozen after a restart that has one was
    /// frozen by slicing, and takes its turns again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gang_row: Option<u32>,
    /// It may be suspended for another job (its allocate said so).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub preemptible: bool,
    /// When the batch system took it, seconds since the epoch (for its expansion factor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submitted_at: Option<i64>,
    /// Its estimated run time, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimate_s: Option<u64>,
    /// Seconds it ran before its last start or resume.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub ran_s: u64,
    /// When it last started or resumed, seconds since the epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_since: Option<i64>,
    /// When it started, or was last resumed after topod's preemption, seconds since the epoch:
    /// it may not be preempted before `preempt_min_run_s` from then. Another suspension and
    /// resume (its owner's, say) does not restart that time, or an owner could keep the job
    /// out of reach by suspending and resuming it. Records without it take `running_since`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protected_since: Option<i64>,
    /// The job it was suspended for, while topod's preemption holds it: topod resumes it
    /// itself once its CPUs are free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preempted_by: Option<String>,
    /// The signal its processes get after its CPUs change (a malleable job's choice).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resize_signal: Option<i32>,
    /// The generation its notify file says: 1 when allocated, one more at every change.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub notify_generation: u64,
    /// When its CPUs last changed (a resize or a move), seconds since the epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_at: Option<i64>,
    /// Its batch queue, as its allocate said (prime-time pools admit by queue).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    /// The prime-time pool its allocate named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// A malleable job's size its last `resize` asked for: equipartition grows it no further
    /// (an owner who gave CPUs back does not get them pushed on it again), until a resize asks
    /// for more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks_cap: Option<u32>,
    /// Its tasks are not known: recovered from its cgroup without a record of its tasks (or with
    /// one its cgroup no longer matches), and not since divided into tasks of its request by an
    /// allocate. Kept in the record, so that the next restart does not take the tasks made up
    /// for it (one over all its CPUs) as known. Such a job is never resized, by `resize` or by
    /// equipartition.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tasks_unknown: bool,
    /// Suspended by the batch system, not by topod (Slurm stopped it and gave its CPUs to
    /// another job, see `host/follow.rs`): topod neither froze it nor thaws it, and a restart
    /// keeps it suspended beside the job that borrows its CPUs.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub batch_suspended: bool,
    /// When the batch system suspended it (nanoseconds since the epoch, unique on the host):
    /// the last suspended runs first again.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub batch_suspended_ns: u64,
}

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl JobHint {
    /// [`JobHint::allocated_at`] as a time (`None` when missing or not a time).
    pub fn allocated_time(&self) -> Option<std::time::SystemTime> {
        self.allocated_at.as_deref().and_then(topo_core::pending::parse_utc)
    }
}

/// What a restart found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Recovery {
    /// Jobs whose cgroups were found and kept.
    pub kept: Vec<String>,
    /// Of those, the ones found frozen: kept suspended (their CPUs may be lent).
    pub suspended: Vec<String>,
    /// Cgroups that overlap another job's CPUs (left alone, not in the ledger).
    pub conflicts: Vec<String>,
    /// Records of jobs that have no cgroup any more (removed).
    pub dropped_hints: Vec<String>,
    /// Job cgroups that never got CPUs and hold no process (removed).
    pub removed: Vec<String>,
    /// Records whose request no longer reads back as itself (kept without the request, so
    /// without its exclusive fence until the batch system asks again).
    pub bad_requests: Vec<String>,
    /// Files in the records directory that are not readable records (left alone).
    pub unreadable: Vec<String>,
}

/// A request checked against this host and ready to place. Preparing takes no lock: parsing
/// a 64 KiB request must not hold up other clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepared {
    /// The request, with the task count and the batch system's CPUs folded in.
    pub request: Request,
    /// Its canonical text, which is what the ledger and the record keep.
    pub canonical: String,
    /// What the allocate said about gang scheduling.
    pub gang: GangAsk,
    /// What the allocate said about preemption.
    pub preempt: PreemptAsk,
    /// A malleable job's signal for its resizes (checked by [`check_resize_signal`]).
    pub resize_signal: Option<i32>,
    /// The prime-time pool the allocate names.
    pub pool: Option<String>,
    /// The batch system starts the job suspended (see `host/follow.rs`).
    pub starts_suspended: bool,
    /// The allocate came with the batch system's view of the host (`batch`, or
    /// `starts_suspended`): only such a job may borrow the CPUs of a job the batch system
    /// suspended (see `host/follow.rs`).
    pub follows_batch: bool,
}

/// What an `allocate` says about preemption (see [`Host::set_preempt`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PreemptAsk {
    /// When it does not fit, it may suspend running preemptible jobs.
    pub preempt: bool,
    /// It may be suspended for another job.
    pub preemptible: bool,
    /// When the batch system took the job, seconds since the epoch.
    pub submitted_at: Option<i64>,
    /// Its estimated run time (its time limit), seconds.
    pub estimate_s: Option<u64>,
}

/// What an `allocate` says about gang time slicing (see [`GangConfig`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GangAsk {
    /// Gang-scheduled (`Some(true)`), not (`Some(false)`), or as configured (`None`).
    pub gang: Option<bool>,
    /// The row to take (so that every host of a multi-host job uses the same one).
    pub row: Option<u32>,
    /// Runs through every slice, whatever the configuration says.
    pub prime: bool,
    /// The batch system's queue: jobs of the configured prime queues run through every slice.
    pub queue: Option<String>,
}

/// Gang time slicing on this host (`gang_*` in topod.toml).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GangConfig {
    /// Slice length and rows.
    pub gang: topo_core::policy::Gang,
    /// Every job is gang-scheduled unless it is prime (otherwise only those that ask).
    pub all_jobs: bool,
    /// Queues whose jobs are prime.
    pub prime_queues: Vec<String>,
}

/// What one slice switch did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct GangSwitch {
    /// The row whose slice it is.
    pub active_row: u32,
    /// Jobs frozen.
    pub frozen: Vec<String>,
    /// Jobs thawed.
    pub thawed: Vec<String>,
    /// Jobs that should have changed and could not (the log says why).
    pub failed: Vec<String>,
}

/// Parses and checks `text` for a host with topology `topo`: a task count of at least 1, CPUs
/// (in `CPU_LIST` and from the batch system) that this host has, and a canonical form that reads
/// back as itself (every recorded request must, or a restart would not rebuild the same fences).
pub fn prepare(
    topo: &Topology,
    text: &str,
    tasks: Option<u32>,
    given_cpus: Option<&str>,
) -> Result<Prepared, HostError> {
    let mut req = request::parse(text).map_err(|e| HostError::BadRequest(e.to_string()))?;
    if tasks == Some(0) {
        return Err(HostError::BadRequest("tasks = 0: a job has at least one task".into()));
    }
    // The same bound as the request language's `*count`.
    if let Some(n) = tasks.filter(|&n| n > request::MAX_COUNT) {
        return Err(HostError::BadRequest(format!("tasks = {n}: at most {}", request::MAX_COUNT)));
    }
    if req.tasks.is_none() {
        req.tasks = Some(tasks.unwrap_or(place::DEFAULT_TASKS));
    }
    let not_here = |what: &str, set: &CpuSet| {
        let missing = set.difference(&topo.pus);
        (!missing.is_empty()).then(|| {
            HostError::BadRequest(format!(
                "{what} names CPUs {missing}, which this host does not have (its CPUs are {})",
                topo.pus
            ))
        })
    };
    if let Some(e) = req.cpu_list.as_ref().and_then(|l| not_here("CPU_LIST", l)) {
        return Err(e);
    }
    if let Some(text) = given_cpus {
        let given =
            CpuSet::parse_list(text).map_err(|e| HostError::BadRequest(format!("cpus: {e}")))?;
        if let Some(e) = not_here("the batch system's CPU list", &given) {
            return Err(e);
        }
        let inside = match &req.cpu_list {
            Some(list) => list.intersection(&given),
            None => given,
        };
        if inside.is_empty() {
            return Err(HostError::BadRequest(format!(
                "CPU_LIST {} has no CPU among those the batch system gave the job ({text})",
                req.cpu_list.as_ref().map(|l| l.to_string()).unwrap_or_default()
            )));
        }
        req.cpu_list = Some(inside);
    }
    let canonical = req.to_string();
    match request::parse(&canonical) {
        Ok(again) if again.to_string() == canonical => Ok(Prepared {
            request: req,
            canonical,
            gang: GangAsk::default(),
            preempt: PreemptAsk::default(),
            resize_signal: None,
            pool: None,
            starts_suspended: false,
            follows_batch: false,
        }),
        Ok(again) => Err(HostError::BadRequest(format!(
            "{text:?} cannot be recorded: it becomes {canonical:?}, which reads back as {again}"
        ))),
        Err(e) => Err(HostError::BadRequest(format!(
            "{text:?} cannot be recorded: it becomes {canonical:?}, which does not read back: {e}"
        ))),
    }
}

/// A recovered job's tasks: its record's, checked against the CPUs its cgroup has (the cgroup
/// is the truth: a record that could not be written after a resize is stale). Tasks outside
/// the cgroup's CPUs are dropped and CPUs no task names become one more task.
fn tasks_for(job: &JobId, recorded: &[CpuSet], cpus: &CpuSet) -> Vec<CpuSet> {
    let mut tasks: Vec<CpuSet> =
        recorded.iter().filter(|t| !t.is_empty() && t.is_subset(cpus)).cloned().collect();
    let rest = cpus.difference(&CpuSet::union_all(&tasks));
    if !rest.is_empty() {
        tasks.push(rest);
    }
    if tasks != recorded && !recorded.is_empty() {
        tracing::warn!(
            "job {job}: its record's tasks do not match its cgroup's CPUs {cpus}; taken from the cgroup"
        );
    }
    tasks
}

/// What reads need of the host, copied out under the lock in a moment and used without it.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// The placement model (shared, replaced when foreign cpusets change).
    pub model: Arc<HostModel>,
    /// Held and fenced CPUs.
    pub occupancy: place::Occupancy,
    /// The ledger's generation.
    pub generation: u64,
    /// The jobs, with their state and owner.
    pub jobs: Vec<JobView>,
    /// Gang time slicing, when configured.
    pub gang: Option<topo_core::proto::reply::GangStatus>,
    /// The live topology reservations.
    pub reservations: Vec<topo_core::reservation::Reservation>,
    /// Whether the host moves jobs to make room (`defrag`).
    pub defrag: bool,
    /// The prime-time pools, open or not as of this snapshot.
    pub pools: Vec<topo_core::proto::reply::PoolStatus>,
}

/// What a "does not fit" message is about: the job, or for `fit` the request.
impl JobHint {
    /// Since when the job counts as running for preemption's and defrag's minimum run times:
    /// [`JobHint::protected_since`], or for a record written before it, `running_since`.
    pub fn protected_from(&self) -> Option<i64> {
        self.protected_since.or(self.running_since)
    }

    /// When the job ends by its estimate if it runs on from now without a stop, seconds since
    /// the epoch; `None` without an estimate, or while it is not running.
    pub fn estimated_end(&self) -> Option<i64> {
        let since = self.running_since?;
        let left = self.estimate_s?.saturating_sub(self.ran_s);
        Some(since.saturating_add(i64::try_from(left).unwrap_or(i64::MAX)))
    }
}

/// `refused` (a [`HostError::DoesNotFit`]) with why preemption did not make room added to its
/// message, so that a user who asked to preempt learns which rule kept it out.
fn not_preempted(refused: HostError, why: &str) -> HostError {
    refused_because(refused, "preemption did not make room", why)
}

/// `refused` (a [`HostError::DoesNotFit`]) with `; what: why` added to its message.
fn refused_because(refused: HostError, what: &str, why: &str) -> HostError {
    match refused {
        HostError::DoesNotFit { job, source, held_back } => {
            HostError::DoesNotFit { job, source, held_back: format!("{held_back}; {what}: {why}") }
        }
        other => other,
    }
}

/// The first `most` of `items` joined with "; ", and how many more there are.
fn summarize(items: &[String], most: usize) -> String {
    let mut text = items.iter().take(most).cloned().collect::<Vec<_>>().join("; ");
    if items.len() > most {
        text += &format!("; and {} more", items.len() - most);
    }
    text
}

fn fit_subject(job: &str) -> String {
    if job.is_empty() {
        "the request".to_string()
    } else {
        format!("job {job}")
    }
}

impl Snapshot {
    /// Would `prepared` fit, and how well, for a job that has no reservation here (other jobs'
    /// reserved blocks are not free to it).
    pub fn fit(&self, prepared: &Prepared) -> Result<place::Fit, HostError> {
        place::fit_and_score(&self.model, &self.usable(), &prepared.request).map_err(|source| {
            HostError::DoesNotFit { job: String::new(), source, held_back: String::new() }
        })
    }

    /// What is free, by shape, for a job that has no reservation here (what Slurm's features
    /// and PBS's counts are made from).
    pub fn host_metrics(&self) -> HostMetrics {
        HostMetrics::measure(&self.model, &self.usable())
    }

    /// The occupancy with every reserved block fenced (the snapshot holds live ones only).
    fn usable(&self) -> place::Occupancy {
        topo_core::reservation::blocked_for(&self.occupancy, &self.reservations, "", i64::MIN)
    }
}

/// A release under way: the slow part (killing the job's processes and waiting for them to go)
/// runs without the host lock, through [`ReleaseTicket::run`]; [`Host::finish_release`] then
/// frees the CPUs.
#[must_use]
pub struct ReleaseTicket {
    id: JobId,
    known: bool,
    backend: Arc<dyn CgroupBackend>,
    timeout: Duration,
}

impl ReleaseTicket {
    /// Kills what is left of the job and removes its cgroup. Takes no lock.
    pub fn run(&self) -> Result<ReleaseReport, CgroupError> {
        self.backend.release(&self.id, self.timeout)
    }
}

/// A suspend or resume under way: waiting for the kernel to report the job frozen or thawed
/// runs without the host lock, through [`FreezeTicket::run`]; [`Host::finish_suspend`] or
/// [`Host::finish_resume`] then records the outcome.
#[must_use]
pub struct FreezeTicket {
    id: JobId,
    /// Freeze (`Some(true)`), thaw (`Some(false)`), or leave as it is: a gang job's resume,
    /// which stays frozen until its slice.
    freeze: Option<bool>,
    backend: Arc<dyn CgroupBackend>,
    timeout: Duration,
    started: std::time::Instant,
}

impl FreezeTicket {
    /// Freezes or thaws the job's cgroup and waits for the kernel to say so. Takes no lock.
    pub fn run(&self) -> Result<(), CgroupError> {
        match self.freeze {
            Some(true) => self.backend.freeze(&self.id, self.timeout),
            Some(false) => self.backend.thaw(&self.id, self.timeout),
            None => Ok(()),
        }
    }

    fn micros(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX)
    }
}

/// The state of one host.
pub struct Host {
    topo: Arc<Topology>,
    model: Arc<HostModel>,
    /// CPUs configuration keeps from jobs.
    reserved: CpuSet,
    /// CPUs other exclusive cpusets hold, as last seen.
    foreign: CpuSet,
    ledger: Ledger,
    hints: BTreeMap<String, JobHint>,
    backend: Arc<dyn CgroupBackend>,
    records: Option<Records>,
    strategy: Strategy,
    release_timeout: Duration,
    /// Jobs whose release is under way (their CPUs stay held until it ends).
    releasing: BTreeSet<String>,
    /// Jobs being suspended or resumed, and which.
    changing: BTreeMap<String, &'static str>,
    /// Jobs a gang switch or a resume after preemption is freezing or thawing (see [`settle`]).
    switching: BTreeMap<String, settle::WorkKind>,
    /// Whether those freezes and thaws are queued for the server to run without the lock.
    defer_waits: bool,
    /// The freezes and thaws queued, not yet taken.
    queued_work: Vec<KernelWork>,
    /// The gang switch under way, with what it has done.
    gang_cycle: Option<settle::GangCycle>,
    /// Preemptors whose victims are being frozen, by job (see [`preempt`]).
    preempting: BTreeMap<String, preempt::Preempting>,
    /// How long a freeze or thaw may take before it is given up.
    freeze_timeout: Duration,
    /// Jobs that have had a process: only those are released when they become empty.
    joined: BTreeSet<String>,
    /// Jobs with processes that were told how to move themselves in and have not yet confirmed
    /// with `join`: how many, and the last offer. Their joins check before writing, and
    /// [`Host::release_empty`] leaves them alone for [`SELF_JOIN_WINDOW`] after the last offer.
    self_join_offered: BTreeMap<String, (u32, std::time::Instant)>,
    /// Gang time slicing, when configured, and what it has done.
    gang: Option<GangConfig>,
    gang_status: Option<topo_core::proto::reply::GangStatus>,
    /// The wall clock gang slices follow (a test's own in tests).
    clock: Arc<dyn Fn() -> std::time::SystemTime + Send + Sync>,
    /// Preemption's rules, when allocates may suspend jobs.
    preempt: Option<topo_core::policy::Preempt>,
    /// What topod counts for its metrics (allocations, releases, requests).
    metrics: Arc<super::metrics::Metrics>,
    /// Jobs the sampler found mis-sized, until their release.
    missized: BTreeMap<String, Missized>,
    /// Where jobs' notify files go (see [`moves`]).
    notify_dir: Option<PathBuf>,
    /// Topology reservations by job (see [`reserve`]).
    reservations: BTreeMap<String, topo_core::reservation::Reservation>,
    /// Bumped at every change of the reservations: the free map's generation counts them.
    reservation_changes: u64,
    /// Prime-time pools (see [`pools`]), the host's offset from UTC at a time, and which pools
    /// were in a window at the last look.
    pools: Vec<topo_core::prime::Pool>,
    utc_offset: Arc<dyn Fn(i64) -> i64 + Send + Sync>,
    pools_open: Vec<bool>,
    /// Malleable jobs share what rigid jobs leave equally (see [`space`]).
    equipartition: bool,
    /// Defragmenting migration, when on (see [`space`]).
    defrag: Option<DefragConfig>,
    /// Tells Slurm and PBS of the CPUs topod changed in their running jobs, when set.
    batch_reporter: Option<super::batch_report::BatchReporter>,
}

/// How long after a process was told how to move itself into a job the job is not released for
/// being empty: the move and its confirming `join` take milliseconds, but until then topod
/// cannot see the process coming.
const SELF_JOIN_WINDOW: Duration = Duration::from_secs(10);

/// What a job being frozen or thawed for its gang slice, or resumed after preemption, is doing
/// (the server finishes that before it begins a release, suspend or resume, so clients do not
/// see it).
const SWITCHING: &str = "being frozen or thawed for its gang slice or its resume after preemption";

impl Host {
    /// A host with an empty ledger; call [`Host::recover`] next. `reserved` are the CPUs that
    /// configuration keeps from jobs; the CPUs of other exclusive cpusets are added by
    /// [`Host::reconcile_foreign`].
    pub fn new(
        topo: Topology,
        reserved: CpuSet,
        backend: Box<dyn CgroupBackend>,
        records: Option<Records>,
        strategy: Strategy,
    ) -> Result<Self, place::ModelError> {
        let model = HostModel::new(&topo, &reserved)?;
        Ok(Host {
            topo: Arc::new(topo),
            model: Arc::new(model),
            reserved,
            foreign: CpuSet::new(),
            ledger: Ledger::new(),
            hints: BTreeMap::new(),
            backend: Arc::from(backend),
            records,
            strategy,
            release_timeout: Duration::from_secs(10),
            releasing: Default::default(),
            changing: Default::default(),
            switching: Default::default(),
            defer_waits: false,
            queued_work: Vec::new(),
            gang_cycle: None,
            preempting: BTreeMap::new(),
            freeze_timeout: Duration::from_secs(5),
            joined: Default::default(),
            self_join_offered: Default::default(),
            gang: None,
            gang_status: None,
            clock: Arc::new(std::time::SystemTime::now),
            preempt: None,
            metrics: Default::default(),
            missized: BTreeMap::new(),
            notify_dir: None,
            reservations: BTreeMap::new(),
            reservation_changes: 0,
            pools: Vec::new(),
            utc_offset: Arc::new(|_| 0),
            pools_open: Vec::new(),
            equipartition: false,
            defrag: None,
            batch_reporter: None,
        })
    }

    /// Lets an allocate that asks (`preempt`) suspend running jobs that said they may be
    /// (`preemptible`) when it does not fit, by `rules` (see `topo_core::policy::Preempt`); off
    /// with `None`.
    pub fn set_preempt(&mut self, rules: Option<topo_core::policy::Preempt>) {
        self.preempt = rules;
    }

    /// Where the changes topod makes to running batch jobs' CPUs are told (see
    /// [`super::batch_report`]); nowhere with `None`.
    pub fn set_batch_reporter(&mut self, reporter: Option<super::batch_report::BatchReporter>) {
        self.batch_reporter = reporter;
    }

    fn now_s(&self) -> i64 {
        self.now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
    }

    /// What placing `job` in `row` must avoid: the ledger's answer, the blocks other jobs have
    /// reserved, the open prime-time pools that do not admit it, and the CPUs of jobs suspended
    /// by preemption for another job (lent only to a job that ends before they may resume, or a
    /// stream of small jobs could keep them frozen for good).
    fn placement_occupancy(&self, job: &str, row: Option<u32>) -> place::Occupancy {
        let (queue, owner, pool) = self.asker_of(job);
        let who = topo_core::prime::Asker { queue: queue.as_deref(), owner, pool: pool.as_deref() };
        let ends_by = self.hints.get(job).and_then(JobHint::estimated_end);
        self.placement_occupancy_as(job, row, who, ends_by).0
    }

    /// [`Host::placement_occupancy`] for a job that is `who` for the prime-time pools; also
    /// the CPUs of the open pools it may use.
    fn placement_occupancy_as(
        &self,
        job: &str,
        row: Option<u32>,
        who: topo_core::prime::Asker<'_>,
        ends_by: Option<i64>,
    ) -> (place::Occupancy, CpuSet) {
        let occ = topo_core::reservation::blocked_for(
            &self.jobs_occupancy(job, row, ends_by),
            self.reservations.values(),
            job,
            self.now_s(),
        );
        self.with_pools(&occ, who)
    }

    /// What jobs hold for `job`'s placement in gang row `row`: running jobs, and suspended jobs
    /// held for a preemptor other than `job`, unless `job` ends (by its estimate, at `ends_by`)
    /// before they may resume (`topo_core::policy::may_borrow`); reservations and pools left out.
    fn jobs_occupancy(
        &self,
        job: &str,
        row: Option<u32>,
        ends_by: Option<i64>,
    ) -> place::Occupancy {
        let mut occ = self.ledger.occupancy_for(row);
        for a in self.ledger.suspended_jobs() {
            let Some(hint) = self.hints.get(&a.job) else { continue };
            let held = hint.preempted_by.as_deref().is_some_and(|p| p != job)
                && !topo_core::policy::may_borrow(ends_by, self.resume_by(hint));
            if held {
                occ.held.union_with(&a.cpus);
                occ.fenced.union_with(&a.fenced);
            }
        }
        occ
    }

    /// `occupancy` with the CPUs of every suspended job held, when there is one (`None`
    /// otherwise): where a job goes without borrowing.
    fn without_lending(&self, occupancy: &place::Occupancy) -> Option<place::Occupancy> {
        let mut suspended = self.ledger.suspended_jobs().peekable();
        suspended.peek()?;
        let mut occ = occupancy.clone();
        for a in suspended {
            occ.held.union_with(&a.cpus);
            occ.fenced.union_with(&a.fenced);
        }
        Some(occ)
    }

    /// For a refusal: `; it would fit without ...` naming the other jobs' reservations and the
    /// open prime-time pools that do not admit `who` which keep `request` out, in the first of
    /// `rows` where it fits without them; else empty. Named are only those holding CPUs the job
    /// may use (its `cpus`) that no job holds: removing any other would not help.
    fn held_back_by(
        &self,
        job: &str,
        request: &Request,
        rows: &[Option<u32>],
        who: topo_core::prime::Asker<'_>,
        ends_by: Option<i64>,
    ) -> String {
        if self.reservations.is_empty() && self.pools.is_empty() {
            return String::new();
        }
        let now = self.now_s();
        let may_use = request.cpu_list.as_ref().unwrap_or(&self.model.allocatable);
        let open = self.open_pools();
        // What keeps CPUs out: its CPUs, and how the message names it.
        let mut blockers: Vec<(&CpuSet, String)> = self
            .reservations
            .values()
            .filter(|r| r.job != job && r.live(now))
            .map(|r| {
                let text = format!(
                    "job {}'s reservation (CPUs {}, for {} s more)",
                    r.job,
                    r.cpus,
                    (r.expires_at - now).max(0)
                );
                (&r.cpus, text)
            })
            .collect();
        for (pool, _) in self.pools.iter().zip(open).filter(|(p, open)| *open && !p.admits(who)) {
            let text = format!(
                "prime-time pool {} (CPUs {}, open now; it admits {})",
                pool.name,
                pool.cpus,
                pool.admission()
            );
            blockers.push((&pool.cpus, text));
        }
        for &row in rows {
            let jobs = self.jobs_occupancy(job, row, ends_by);
            let mut free = may_use.difference(&jobs.held);
            free.difference_with(&jobs.fenced);
            let (named, kept): (Vec<_>, Vec<_>) =
                blockers.iter().partition(|(cpus, _)| cpus.intersects(&free));
            if named.is_empty() {
                continue;
            }
            let mut occ = jobs;
            for (cpus, _) in kept {
                occ.fenced.union_with(cpus);
            }
            if topo_core::policy::start_on_host(&self.model, &occ, request, self.strategy).is_ok() {
                let by: Vec<&str> = named.iter().map(|(_, text)| text.as_str()).collect();
                return format!("; it would fit without {}", by.join(" and "));
            }
        }
        String::new()
    }

    /// The wall clock gang slices follow, instead of the system's (for tests and emulation).
    pub fn set_clock(&mut self, clock: Arc<dyn Fn() -> std::time::SystemTime + Send + Sync>) {
        self.clock = clock;
    }

    /// The time by the host's clock.
    pub fn now(&self) -> std::time::SystemTime {
        (self.clock)()
    }

    /// Turns gang time slicing on (with at least 2 rows) or off.
    pub fn set_gang(&mut self, gang: Option<GangConfig>) {
        self.gang = gang.filter(|g| g.gang.rows >= 2 && g.gang.slice >= 1);
        self.gang_status = self.gang.as_ref().map(|g| topo_core::proto::reply::GangStatus {
            slice_s: g.gang.slice as u64,
            rows: g.gang.rows,
            ..Default::default()
        });
    }

    /// Slicing for gang jobs left from a configuration that had it (or more rows), until they
    /// end: 30 s slices over the rows they have, so that none stays frozen for ever.
    fn gang_leftover(&self) -> Option<GangConfig> {
        // Every release and slice tick asks: no allocation, one pass over the jobs.
        let top = self
            .ledger
            .jobs()
            .chain(self.ledger.gang_frozen_jobs())
            .chain(self.ledger.suspended_jobs())
            .filter_map(|a| a.gang_row)
            .max()?;
        Some(GangConfig {
            gang: topo_core::policy::Gang { slice: 30, rows: top + 1 },
            all_jobs: false,
            prime_queues: Vec::new(),
        })
    }

    /// The gang configuration, when slicing is on.
    pub fn gang(&self) -> Option<&GangConfig> {
        self.gang.as_ref()
    }

    /// The row `ask` puts a new job in, as a list of rows to try in order; `None` when the job is
    /// not gang-scheduled.
    fn gang_rows_for(&self, job: &str, ask: &GangAsk) -> Result<Option<Vec<u32>>, HostError> {
        let Some(cfg) = &self.gang else {
            if ask.gang == Some(true) || ask.row.is_some() {
                return Err(HostError::NoGang(job.to_string()));
            }
            return Ok(None);
        };
        if ask.row.is_some() && (ask.gang == Some(false) || ask.prime) {
            return Err(HostError::BadRequest(format!(
                "job {job}: gang_row is for gang-scheduled jobs; it cannot go with {}",
                if ask.prime { "prime" } else { "gang = false" }
            )));
        }
        let prime = ask.prime || ask.queue.as_ref().is_some_and(|q| cfg.prime_queues.contains(q));
        let wanted = ask.gang.unwrap_or(cfg.all_jobs) || ask.row.is_some();
        if prime || !wanted {
            return Ok(None);
        }
        let rows = cfg.gang.rows;
        if let Some(row) = ask.row {
            if row >= rows {
                return Err(HostError::GangRow { job: job.to_string(), row, rows });
            }
            return Ok(Some(vec![row]));
        }
        // Without a row given, the row comes from the job id (FNV-1a) and no other: every host
        // of a multi-host job puts it in the same row without talking, so it runs in the same
        // slices everywhere. (Trying other rows when it does not fit there would break that.)
        let hash = job.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        Ok(Some(vec![(hash % u64::from(rows)) as u32]))
    }

    /// Rebuilds the ledger from the job cgroups that exist; the records add their requests,
    /// tasks and owners. `legacy` holds the hints of an older topod's single hint file, used for
    /// jobs that have no record.
    pub fn recover(&mut self, legacy: BTreeMap<String, JobHint>) -> Result<Recovery, HostError> {
        let mut report = Recovery::default();
        let (mut hints, unreadable) = self.records.as_ref().map(Records::load).unwrap_or_default();
        report.unreadable = unreadable;
        for (job, hint) in legacy {
            hints.entry(job).or_insert(hint);
        }
        self.load_reservations();
        // A plan of moves a crash cut short is finished before the cgroups are read.
        let moved = self.recover_moves(&mut hints);
        // Running jobs first: a frozen job's CPUs may have been lent to one of them.
        let mut found = self.backend.list()?;
        let frozen: BTreeSet<String> = found
            .iter()
            .filter(|(job, _)| self.backend.is_frozen(job).unwrap_or(false))
            .map(|(job, _)| job.to_string())
            .collect();
        let busy: BTreeSet<String> = found
            .iter()
            .filter(|(job, _)| self.backend.pids(job).map(|p| !p.is_empty()).unwrap_or(false))
            .map(|(job, _)| job.to_string())
            .collect();
        let recorded_suspended: BTreeSet<String> = hints
            .iter()
            .filter(|(_, h)| h.suspended || h.batch_suspended)
            .map(|(j, _)| j.clone())
            .collect();
        // Running jobs first, those with processes before empty ones; then thawed jobs whose
        // record says suspended (a resume a crash cut short, or a thaw behind topod's back);
        // frozen jobs last. So a job that may have lent its CPUs never displaces their borrower.
        found.sort_by_key(|(job, _)| {
            let j = job.as_str();
            (frozen.contains(j), recorded_suspended.contains(j), !busy.contains(j), j.to_string())
        });
        for (job, eff) in found {
            if eff.cpus.is_empty() {
                // Made but never given CPUs (topod died inside allocate): nothing can have
                // joined it, so it is provably dead.
                if self.backend.pids(&job).map(|p| p.is_empty()).unwrap_or(false) {
                    let _ = self.backend.release(&job, self.release_timeout);
                    report.removed.push(job.to_string());
                    continue;
                }
            }
            let mut hint = hints.remove(job.as_str()).unwrap_or_default();
            let parsed = if hint.request.is_empty() {
                None
            } else {
                request::parse(&hint.request).ok().filter(|r| r.to_string() == hint.request)
            };
            if parsed.is_none() && !hint.request.is_empty() {
                report.bad_requests.push(job.to_string());
                hint.request.clear();
            }
            let mut tasks = tasks_for(&job, &hint.tasks, &eff.cpus);
            if tasks != hint.tasks {
                hint.tasks_unknown = true;
            }
            // A malleable request known from the record: its CPUs, divided as the request
            // shapes them, are its tasks, as when the batch system asks again for a job
            // recovered without a record (see allocate). Only CPUs that do not divide so leave
            // its tasks unknown, and its resizes refused.
            if hint.tasks_unknown {
                let split = parsed
                    .as_ref()
                    .filter(|r| r.is_malleable())
                    .and_then(|r| place::split_into_tasks(&self.model, r, &eff.cpus));
                if let Some(split) = split {
                    tasks = split;
                    hint.tasks_unknown = false;
                }
            }
            hint.tasks = tasks.clone();
            let fenced = match parsed.as_ref().and_then(|r| r.exclusive_level()) {
                Some(level) => self.model.closure(level, &eff.cpus).difference(&eff.cpus),
                None => CpuSet::new(),
            };
            let alloc = Allocation {
                job: job.to_string(),
                cpus: eff.cpus.clone(),
                tasks,
                mems: eff.mems.clone(),
                fenced,
                request: hint.request.clone(),
                gang_row: hint.gang_row,
            };
            if self.backend.pids(&job).map(|p| !p.is_empty()).unwrap_or(false) {
                self.joined.insert(job.to_string());
            }
            let occupied = self.ledger.occupancy();
            let in_way = alloc.cpus.intersects(&occupied.held)
                || alloc.cpus.intersects(&occupied.fenced)
                || alloc.fenced.intersects(&occupied.held);
            // Frozen by slicing when the crash came: it takes its turns again.
            let gang_frozen =
                hint.gang_row.is_some() && frozen.contains(job.as_str()) && !hint.suspended;
            let suspended = match (frozen.contains(job.as_str()), hint.suspended) {
                _ if gang_frozen => false,
                // Stopped by the batch system, not frozen by topod: still lending its CPUs
                // when a running job holds them; else running again, as the batch system
                // resumes it once the job on its CPUs is gone.
                (false, false) if hint.batch_suspended => {
                    hint.batch_suspended = in_way;
                    in_way
                }
                (true, true) => true,
                (true, false) if in_way => {
                    // Frozen without a record that says suspended (the adopt of an older topod,
                    // or a release cut short) while running jobs hold its CPUs: thawing it
                    // would run two jobs on one CPU. It stays suspended.
                    tracing::warn!(
                        "job {job}: found frozen, its CPUs held by running jobs; kept suspended"
                    );
                    hint.suspended = true;
                    true
                }
                (true, false) => {
                    // Frozen by a release (or a suspend whose record was never written) that a
                    // crash cut short: it holds its CPUs as a running job; thawed, so that its
                    // processes are not left stopped for ever (the batch system's release comes
                    // again and kills them).
                    tracing::warn!("job {job}: found frozen without being suspended (a release cut short?); thawing it");
                    if let Err(e) = self.backend.thaw(&job, self.freeze_timeout) {
                        tracing::warn!("job {job}: {e}");
                    }
                    false
                }
                (false, true) if in_way => {
                    // Suspended, and thawed behind topod's back while its CPUs are lent:
                    // frozen again, so that no CPU runs two jobs.
                    tracing::warn!("job {job}: suspended but found thawed while its CPUs are lent; freezing it again");
                    match self.backend.freeze(&job, self.freeze_timeout) {
                        Ok(()) => true,
                        Err(e) => {
                            tracing::warn!("job {job}: {e}");
                            false
                        }
                    }
                }
                (false, true) => {
                    // Thawed by a resume that a crash cut short before its record changed.
                    hint.suspended = false;
                    false
                }
                (false, false) => false,
            };
            let inserted = if gang_frozen {
                self.ledger.insert_gang_frozen(alloc)
            } else if suspended {
                self.ledger.insert_suspended(alloc).map(|_| ())
            } else {
                match self.ledger.insert(alloc.clone()) {
                    Ok(_) => Ok(()),
                    Err(_) if alloc.gang_row.is_some() => {
                        // A gang job running on CPUs a job of another row runs on (a thaw
                        // behind topod's back): frozen until its slice.
                        tracing::warn!("job {job}: found running on CPUs of another gang row's running job; frozen until its slice");
                        match self.backend.freeze(&job, self.freeze_timeout) {
                            Ok(()) => self.ledger.insert_gang_frozen(alloc),
                            Err(e) => Err(LedgerError::Conflict {
                                job: job.to_string(),
                                cpus: alloc.cpus.to_string(),
                                holder: e.to_string(),
                            }),
                        }
                    }
                    Err(e) => Err(e),
                }
            };
            match inserted {
                Ok(()) => {
                    if suspended {
                        report.suspended.push(job.to_string());
                    }
                    report.kept.push(job.to_string());
                    self.record(&job, &hint);
                    self.hints.insert(job.to_string(), hint);
                }
                Err(_) => report.conflicts.push(job.to_string()),
            }
        }
        for job in hints.into_keys() {
            if let (Some(records), Ok(id)) = (&self.records, JobId::parse(&job)) {
                let _ = records.remove(&id);
            }
            report.dropped_hints.push(job);
        }
        // Every job's notify file says its CPUs again (a job moved by the plan learns of it, by
        // its signal too); files of jobs that are gone go.
        let kept = report.kept.clone();
        if let Some(dir) = &self.notify_dir {
            moves::sweep_notify_dir(dir, &kept.iter().cloned().collect());
        }
        for job in kept {
            let signal = moved.contains(&job);
            self.tell(&job, signal);
        }
        Ok(report)
    }

    /// Places and confines a job; the same job with the same request again returns what it has.
    pub fn allocate(
        &mut self,
        job: &str,
        request_text: &str,
        tasks: Option<u32>,
        given_cpus: Option<&str>,
        mem_limit: Option<u64>,
        owner_uid: Option<u32>,
    ) -> Result<Allocation, HostError> {
        let prepared = prepare(&self.topo, request_text, tasks, given_cpus)?;
        self.allocate_prepared(job, &prepared, mem_limit, owner_uid)
    }

    /// [`Host::allocate`] for a request already [`prepare`]d.
    pub fn allocate_prepared(
        &mut self,
        job: &str,
        prepared: &Prepared,
        mem_limit: Option<u64>,
        owner_uid: Option<u32>,
    ) -> Result<Allocation, HostError> {
        // The time goes into the job's record (written before the answer, the same allocation
        // asked again too), so that it outlives a restart.
        let asked = topo_core::pending::format_utc_nanos(std::time::SystemTime::now());
        if prepared.starts_suspended {
            return self.allocate_suspended(job, prepared, |host| {
                host.allocate_inner(job, prepared, mem_limit, owner_uid, asked)
            });
        }
        self.allocate_inner(job, prepared, mem_limit, owner_uid, asked)
    }

    /// When `job` was last allocated, if that was after `t` (see [`JobHint::allocated_at`]).
    pub fn allocated_after(
        &self,
        job: &str,
        t: std::time::SystemTime,
    ) -> Option<std::time::SystemTime> {
        self.hints.get(job).and_then(JobHint::allocated_time).filter(|at| *at > t)
    }

    fn allocate_inner(
        &mut self,
        job: &str,
        prepared: &Prepared,
        mem_limit: Option<u64>,
        owner_uid: Option<u32>,
        asked: String,
    ) -> Result<Allocation, HostError> {
        let id = JobId::parse(job)?;
        if self.releasing.contains(job) {
            return Err(HostError::Releasing(job.to_string()));
        }
        if let Some(pool) = prepared.pool.as_ref().filter(|_| !self.pools.is_empty()) {
            if !self.pools.iter().any(|p| &p.name == pool) {
                let names: Vec<&str> = self.pools.iter().map(|p| p.name.as_str()).collect();
                return Err(HostError::BadArgument(format!(
                    "job {job}: pool {pool:?}: this host has no prime-time pool of that name (its pools: {})",
                    names.join(", ")
                )));
            }
        }
        let canonical = &prepared.canonical;
        if self.ledger.is_suspended(id.as_str()) && !self.batch_suspended(id.as_str()) {
            // Its CPUs may be lent: answering them would give a step CPUs another job runs on.
            // (A job the batch system suspended shares them by the batch system's turns.)
            return Err(HostError::Suspended(job.to_string()));
        }
        if let Some(existing) = self.ledger.get(id.as_str()) {
            if &existing.request == canonical {
                // Asked again (each step, or a requeued job's new run): a new allocation time.
                let existing = existing.clone();
                let mut hint = self.hints.get(job).cloned().unwrap_or_else(|| JobHint {
                    request: existing.request.clone(),
                    tasks: existing.tasks.clone(),
                    ..JobHint::default()
                });
                hint.allocated_at = Some(asked);
                self.write_record(&id, &hint)?;
                self.hints.insert(job.to_string(), hint);
                return Ok(existing);
            }
            if existing.request.is_empty() {
                // Recovered from its cgroup without a record (topod died before writing it):
                // the batch system asking again tells us what it was.
                let mut adopted = existing.clone();
                adopted.request = canonical.clone();
                // Its tasks were not recorded either: as the request shapes them, where its
                // CPUs divide so (else resizes are refused, see resize_to).
                let mut tasks_unknown = self.hints.get(job).is_some_and(|h| h.tasks_unknown);
                if prepared.request.is_malleable() {
                    if let Some(tasks) =
                        place::split_into_tasks(&self.model, &prepared.request, &adopted.cpus)
                    {
                        adopted.tasks = tasks;
                        tasks_unknown = false;
                    }
                }
                if let Some(level) = prepared.request.exclusive_level() {
                    adopted.fenced =
                        self.model.closure(level, &adopted.cpus).difference(&adopted.cpus);
                }
                let suspended = self.ledger.is_suspended(id.as_str());
                let hint = JobHint {
                    request: canonical.clone(),
                    tasks: adopted.tasks.clone(),
                    owner_uid,
                    allocated_at: Some(asked),
                    suspensions: u32::from(suspended),
                    suspended,
                    suspended_by: None,
                    gang_row: adopted.gang_row,
                    // What this allocate says of the job, as a new one's record would keep it.
                    preemptible: prepared.preempt.preemptible,
                    submitted_at: prepared.preempt.submitted_at,
                    estimate_s: prepared.preempt.estimate_s,
                    running_since: (!suspended).then(|| self.now_s()),
                    protected_since: (!suspended).then(|| self.now_s()),
                    resize_signal: prepared.resize_signal,
                    queue: prepared.gang.queue.clone(),
                    pool: prepared.pool.clone(),
                    tasks_unknown,
                    ..JobHint::default()
                };
                self.write_record(&id, &hint)?;
                self.ledger.release(id.as_str())?;
                if suspended {
                    // Frozen: it holds no CPUs in the occupancy, so no fence can clash.
                    self.ledger.insert_suspended(adopted.clone())?;
                    self.hints.insert(job.to_string(), hint);
                    return Ok(adopted);
                }
                if self.ledger.insert(adopted.clone()).is_err() {
                    // Its fence now overlaps another job: keep it as it was, without the fence.
                    adopted.fenced = CpuSet::new();
                    self.ledger.insert(adopted.clone())?;
                }
                self.hints.insert(job.to_string(), hint);
                return Ok(adopted);
            }
            return Err(HostError::AlreadyAllocated {
                job: job.to_string(),
                cpus: existing.cpus.to_string(),
                request: existing.request.clone(),
            });
        }
        if let Some(under_way) = self.preempting.remove(job) {
            if under_way.freezing(self) {
                // Asked again by someone else while its victims freeze: not twice.
                self.preempting.insert(job.to_string(), under_way);
                return Err(HostError::Changing {
                    job: job.to_string(),
                    what: "being started: the jobs it preempts are being suspended",
                });
            }
            let placed = self.place_preemptor(&id, prepared, mem_limit, owner_uid, under_way);
            return self.allocated(&id, prepared, (mem_limit, owner_uid), None, asked, placed);
        }
        let rows = self.gang_rows_for(job, &prepared.gang)?;
        let mut first = self.place_and_create(&id, prepared, mem_limit, owner_uid, rows.as_deref());
        let could_fit = |r: &Result<(), HostError>| {
            matches!(r, Err(HostError::DoesNotFit { source, .. })
                if !matches!(source, place::PlaceError::Impossible(_)))
        };
        if could_fit(&first) && rows.is_none() {
            // Room made by moving: malleable jobs shrunk to the shares equipartition gives them
            // beside the arrival, or failing that (its shape did not fit in what they left)
            // to their least, when that makes it fit (equipartition shares the rest again
            // after); else running jobs moved (defrag).
            let arrival = if self.equipartition {
                self.fits_with_mins(job, prepared, owner_uid)
            } else {
                None
            };
            if let Some(arrival) = arrival {
                if self.shrink_for_arrival(arrival) {
                    first = self.place_and_create(&id, prepared, mem_limit, owner_uid, None);
                }
                if first.is_err() && self.shrink_to_mins() {
                    first = self.place_and_create(&id, prepared, mem_limit, owner_uid, None);
                }
                if first.is_err() {
                    self.rebalance();
                }
            }
            if could_fit(&first) {
                match self.defragment_for(job, prepared, owner_uid) {
                    Ok(space::Defragged::Moved) => {
                        first = self.place_and_create(&id, prepared, mem_limit, owner_uid, None);
                    }
                    Ok(space::Defragged::NoRoom(Some(why))) => {
                        first = first.map_err(|e| {
                            refused_because(e, "moving running jobs did not make room", &why)
                        });
                    }
                    Ok(space::Defragged::NoRoom(None)) => {}
                    Err(e) => {
                        tracing::warn!("job {job}: making room by moving jobs failed: {e}")
                    }
                }
            }
        }
        let first = match first {
            Err(refused @ HostError::DoesNotFit { .. })
                if prepared.preempt.preempt && rows.is_none() && self.preempt.is_some() =>
            {
                self.preempt_and_place(&id, prepared, mem_limit, owner_uid, refused)
            }
            // It asked to preempt: say why that was not tried.
            Err(refused @ HostError::DoesNotFit { .. }) if prepared.preempt.preempt => {
                Err(not_preempted(
                    refused,
                    if self.preempt.is_none() {
                        "preemption is off on this host (preempt = false in topod.toml)"
                    } else {
                        "a gang-scheduled job does not preempt (it waits for its row)"
                    },
                ))
            }
            other => other,
        };
        self.allocated(&id, prepared, (mem_limit, owner_uid), rows.as_deref(), asked, first)
    }

    /// The end of a new job's allocate, given how its placement went: tried again where the
    /// kernel refused the cpuset, then recorded.
    fn allocated(
        &mut self,
        id: &JobId,
        prepared: &Prepared,
        (mem_limit, owner_uid): (Option<u64>, Option<u32>),
        rows: Option<&[u32]>,
        asked: String,
        first: Result<(), HostError>,
    ) -> Result<Allocation, HostError> {
        let job = id.as_str();
        let canonical = &prepared.canonical;
        match first {
            Err(HostError::Cgroup(e)) => {
                // The kernel refused the cpuset: an exclusive cpuset beside ours may have come or
                // gone since the model was made. Look again, and try once more if it changed.
                if self.reconcile_foreign().is_some() {
                    tracing::info!("job {job}: the cgroup was refused ({e}); placing again inside the CPUs topod may now use");
                    self.place_and_create(id, prepared, mem_limit, owner_uid, rows)?;
                } else {
                    return Err(HostError::Cgroup(e));
                }
            }
            other => other?,
        }
        let alloc = self
            .ledger
            .get(id.as_str())
            .cloned()
            .ok_or_else(|| HostError::UnknownJob(job.to_string()))?;
        let hint = JobHint {
            request: canonical.clone(),
            tasks: alloc.tasks.clone(),
            owner_uid,
            allocated_at: Some(asked),
            suspensions: 0,
            suspended: false,
            suspended_by: None,
            gang_row: alloc.gang_row,
            preemptible: prepared.preempt.preemptible,
            submitted_at: prepared.preempt.submitted_at,
            estimate_s: prepared.preempt.estimate_s,
            ran_s: 0,
            running_since: Some(self.now_s()),
            protected_since: Some(self.now_s()),
            preempted_by: None,
            resize_signal: prepared.resize_signal,
            notify_generation: 1,
            moved_at: None,
            queue: prepared.gang.queue.clone(),
            pool: prepared.pool.clone(),
            tasks_cap: None,
            tasks_unknown: false,
            batch_suspended: false,
            batch_suspended_ns: 0,
        };
        // The record is written before the answer: an owner lost in a crash would lock the job's
        // own processes out of it.
        if let Err(e) = self.write_record(id, &hint) {
            let _ = self.backend.release(id, self.release_timeout);
            let _ = self.ledger.release(id.as_str());
            return Err(e);
        }
        self.hints.insert(job.to_string(), hint);
        self.claim_reservation(job);
        self.tell(job, false);
        self.rebalance();
        self.metrics.allocated();
        tracing::info!(
            event = "allocated",
            job = %job,
            cpus = %alloc.cpus,
            mems = %alloc.mems,
            request = %canonical,
            owner_uid,
            "job {job}: allocated CPUs {}",
            alloc.cpus
        );
        if let Some(row) = alloc.gang_row {
            // Created frozen: it runs now if its row has the slice or its CPUs are idle.
            self.gang_switch(self.now());
            tracing::info!("job {job}: gang row {row}, CPUs {}", alloc.cpus);
        }
        Ok(self.ledger.get(id.as_str()).cloned().unwrap_or(alloc))
    }

    /// Places the job, creates its cgroup and records it in the ledger; on any failure leaves
    /// no cgroup and no ledger entry behind.
    fn place_and_create(
        &mut self,
        id: &JobId,
        prepared: &Prepared,
        mem_limit: Option<u64>,
        owner_uid: Option<u32>,
        gang_rows: Option<&[u32]>,
    ) -> Result<(), HostError> {
        // The policy core's host decision: the same function the simulator places every part of
        // every job with, so a replay says what this host would do. A gang job takes the first
        // of its rows where it fits.
        let rows: Vec<Option<u32>> = match gang_rows {
            Some(rows) => rows.iter().map(|r| Some(*r)).collect(),
            None => vec![None],
        };
        let who = topo_core::prime::Asker {
            queue: prepared.gang.queue.as_deref(),
            owner: owner_uid,
            pool: prepared.pool.as_deref(),
        };
        // A job with a reservation goes inside its block when it fits there, one a prime-time
        // pool admits inside the pool.
        let inside = |cpus: &CpuSet| {
            let list = match &prepared.request.cpu_list {
                Some(list) => list.intersection(cpus),
                None => cpus.clone(),
            };
            (!list.is_empty()).then(|| Request { cpu_list: Some(list), ..prepared.request.clone() })
        };
        let inside_block = self.block_of(id.as_str()).and_then(inside);
        let ends_by = self.ends_by(prepared);
        let mut refused = None;
        let mut found = None;
        'rows: for row in rows {
            let (occupancy, pool_cpus) =
                self.placement_occupancy_as(id.as_str(), row, who, ends_by);
            // The CPUs of a job the batch system suspended go only to the job it starts on
            // them, whose allocate says what it did: topod's view of its suspension may be old.
            let occupancy =
                if prepared.follows_batch { occupancy } else { self.batch_lenders_held(occupancy) };
            // A suspended job's CPUs are lent only when the job fits nowhere else: a borrower
            // keeps the suspended job from resuming until it ends.
            let without_lending = self.without_lending(&occupancy);
            let inside_pool = inside(&pool_cpus);
            for request in inside_block.iter().chain(&inside_pool).chain([&prepared.request]) {
                for occupancy in without_lending.iter().chain([&occupancy]) {
                    let placed = match self.start_malleable(occupancy, request) {
                        Some(p) => Ok(p),
                        None => topo_core::policy::start_on_host(
                            &self.model,
                            occupancy,
                            request,
                            self.strategy,
                        ),
                    };
                    match placed {
                        Ok(p) => {
                            found = Some((p, row));
                            break 'rows;
                        }
                        Err(e) => refused = Some(e),
                    }
                }
            }
        }
        let Some((placement, row)) = found else {
            let source =
                refused.unwrap_or_else(|| place::PlaceError::Impossible("no row to try".into()));
            let rows: Vec<Option<u32>> = match gang_rows {
                Some(rows) => rows.iter().map(|r| Some(*r)).collect(),
                None => vec![None],
            };
            let mut held_back =
                self.held_back_by(id.as_str(), &prepared.request, &rows, who, ends_by);
            held_back += &self.held_for_preempted_note(id.as_str(), ends_by);
            if let (Some(tried), Some(cfg)) = (gang_rows, &self.gang) {
                // A gang job tries only its own row: say which, and that the row is what is full.
                let tried: Vec<String> = tried.iter().map(u32::to_string).collect();
                held_back += &format!(
                    "; gang time slicing: it runs only in row {} of {}, and the jobs of that row leave it no room",
                    tried.join(", "),
                    cfg.gang.rows
                );
            }
            return Err(HostError::DoesNotFit { job: id.to_string(), source, held_back });
        };
        let spec = CgroupSpec {
            cpus: placement.cpus.clone(),
            mems: placement.mems.clone(),
            memory_limit: mem_limit.or(prepared.request.mem_mib.map(|m| m << 20)),
        };
        if let Err(e) = self.backend.create(id, &spec) {
            // Nothing can have joined a cgroup that was never configured: remove what was made.
            let _ = self.backend.release(id, Duration::from_millis(100));
            return Err(e.into());
        }
        let inserted = match row {
            None => self.ledger.allocate(id.as_str(), &placement, &prepared.canonical).map(|_| ()),
            Some(row) => {
                // Frozen before anything can join it: it shares CPUs with other rows' jobs.
                if let Err(e) = self.backend.freeze(id, self.freeze_timeout) {
                    let _ = self.backend.release(id, self.release_timeout);
                    return Err(e.into());
                }
                self.ledger.insert_gang_frozen(Allocation {
                    job: id.to_string(),
                    cpus: placement.cpus.clone(),
                    tasks: placement.tasks.clone(),
                    mems: placement.mems.clone(),
                    fenced: placement.fenced.clone(),
                    request: prepared.canonical.clone(),
                    gang_row: Some(row),
                })
            }
        };
        if let Err(e) = inserted {
            // Keep cgroups and ledger in step: undo the cgroup we just made.
            let _ = self.backend.release(id, self.release_timeout);
            return Err(e.into());
        }
        Ok(())
    }

    /// Where a malleable job starts: with the most tasks of its range that fit now, found by
    /// halving the range (placement succeeds for every count below one that fits, as the free
    /// CPUs that hold n tasks hold fewer). `None` for a rigid job, or when not even its least
    /// fits (the caller's placement then says why).
    fn start_malleable(
        &self,
        occupancy: &place::Occupancy,
        req: &Request,
    ) -> Option<place::Placement> {
        if !req.is_malleable() {
            return None;
        }
        let (min, max) = req.task_range();
        let with = |n: u32| Request { tasks: Some(n), tasks_max: None, ..req.clone() };
        let place = |n: u32| {
            topo_core::policy::start_on_host(&self.model, occupancy, &with(n), self.strategy).ok()
        };
        let mut best = place(min)?;
        let (mut lo, mut hi) = (min + 1, max);
        while lo <= hi {
            let mid = lo + (hi - lo) / 2;
            match place(mid) {
                Some(p) => {
                    best = p;
                    lo = mid + 1;
                }
                None => hi = mid - 1,
            }
        }
        Some(best)
    }

    /// Moves a process into the job's cgroup. The caller has checked who the process is
    /// (`super::server` does, by pidfd).
    pub fn join(&mut self, job: &str, pid: i32) -> Result<(), HostError> {
        let id = JobId::parse(job)?;
        // Writing 0 to cgroup.procs moves the writer, and any id of topod's would move topod
        // into the job (and its release would then freeze and kill topod).
        if pid <= 0 || super::process::is_own(pid) {
            return Err(HostError::BadPid(pid));
        }
        if self.ledger.get(id.as_str()).is_none() {
            return Err(HostError::UnknownJob(job.to_string()));
        }
        if self.releasing.contains(job) {
            return Err(HostError::Releasing(job.to_string()));
        }
        let topod_suspended =
            self.ledger.is_suspended(id.as_str()) && !self.batch_suspended(id.as_str());
        if topod_suspended || self.changing.contains_key(job) {
            // A process moved in would freeze at once (or, where its freezer directory is
            // gone, run on CPUs lent to another job). A job the batch system suspended is not
            // frozen: its processes start as the batch system lets them (the Slurm plug-in's
            // tasks wait until slurmctld runs the job).
            return Err(HostError::Suspended(job.to_string()));
        }
        if let Some((pending, _)) = self.self_join_offered.get_mut(job) {
            self.backend.join_unless_in(&id, pid)?;
            *pending = pending.saturating_sub(1);
            if *pending == 0 {
                self.self_join_offered.remove(job);
            }
        } else {
            self.backend.join(&id, pid)?;
        }
        if self.joined.insert(job.to_string()) {
            // The first process only: a job's later joins (one per task) would flood the log.
            tracing::info!(event = "joined", job = %job, pid, "job {job}: process {pid} joined");
        }
        Ok(())
    }

    /// The files through which a root process moves itself into the job's cgroup (empty where
    /// the backend has none). The process then confirms with [`Host::join`], which finds it
    /// already there and writes nothing.
    pub fn self_join_files(&mut self, job: &str) -> Result<Vec<PathBuf>, HostError> {
        let id = JobId::parse(job)?;
        if self.ledger.get(id.as_str()).is_none() {
            return Err(HostError::UnknownJob(job.to_string()));
        }
        if self.releasing.contains(job) {
            return Err(HostError::Releasing(job.to_string()));
        }
        let files = self.backend.self_join_files(&id)?;
        if !files.is_empty() {
            let offer = self
                .self_join_offered
                .entry(job.to_string())
                .or_insert((0, std::time::Instant::now()));
            *offer = (offer.0 + 1, std::time::Instant::now());
        }
        Ok(files)
    }

    /// Releases every job whose cgroup has had processes and has none left; returns their ids.
    /// (A job allocated but not yet joined is left alone.)
    pub fn release_empty(&mut self) -> Vec<String> {
        let moving_in = |j: &str| {
            self.self_join_offered.get(j).is_some_and(|(_, last)| last.elapsed() < SELF_JOIN_WINDOW)
        };
        let candidates: Vec<String> = self
            .joined
            .iter()
            .filter(|j| {
                self.ledger.get(j).is_some() && !moving_in(j) && !self.releasing.contains(*j)
            })
            .cloned()
            .collect();
        let mut released = Vec::new();
        for job in candidates {
            let Ok(id) = JobId::parse(&job) else { continue };
            if self.backend.pids(&id).map(|p| p.is_empty()).unwrap_or(false)
                && self.release(&job).is_ok()
            {
                released.push(job);
            }
        }
        released
    }

    /// Starts releasing `job`: from now on it takes no process and no second release, and its
    /// CPUs stay held until [`Host::finish_release`].
    pub fn begin_release(&mut self, job: &str) -> Result<ReleaseTicket, HostError> {
        let id = JobId::parse(job)?;
        if let Some(what) = self.changing.get(job) {
            return Err(HostError::Changing { job: job.to_string(), what });
        }
        if self.is_switching(job) {
            return Err(HostError::Changing { job: job.to_string(), what: SWITCHING });
        }
        if !self.releasing.insert(job.to_string()) {
            return Err(HostError::Releasing(job.to_string()));
        }
        Ok(ReleaseTicket {
            known: self.ledger.get(id.as_str()).is_some(),
            id,
            backend: self.backend.clone(),
            timeout: self.release_timeout,
        })
    }

    /// Ends a release begun with [`Host::begin_release`], given what [`ReleaseTicket::run`] did:
    /// the CPUs are freed once the cgroup is gone; returns how many processes were killed.
    pub fn finish_release(
        &mut self,
        ticket: ReleaseTicket,
        outcome: Result<ReleaseReport, CgroupError>,
    ) -> Result<usize, HostError> {
        let job = ticket.id.as_str().to_string();
        self.releasing.remove(&job);
        let report = match outcome {
            Ok(r) => r,
            Err(CgroupError::NoSuchJob(_)) if ticket.known => Default::default(),
            Err(CgroupError::NoSuchJob(_)) => return Err(HostError::UnknownJob(job)),
            Err(e) => return Err(e.into()),
        };
        if !report.survivors.is_empty() {
            return Err(HostError::Survivors { job, pids: report.survivors });
        }
        if self.ledger.get(&job).is_some() {
            self.ledger.release(&job)?;
        }
        self.hints.remove(&job);
        self.joined.remove(&job);
        self.self_join_offered.remove(&job);
        self.missized.remove(&job);
        self.forget_notify(&job);
        self.metrics.released(report.killed);
        tracing::info!(event = "released", job = %job, killed = report.killed, "job {job}: released");
        if let Some(records) = &self.records {
            if let Err(e) = records.remove(&ticket.id) {
                tracing::warn!("job {job}: {e}");
            }
        }
        // Its CPUs may be what a job the batch system suspended for it runs on again, what a
        // preempted job waits for, or what another row's gang job could run on, or what
        // malleable jobs grow into.
        self.resume_batch_lenders();
        self.resume_preempted();
        self.rebalance();
        self.gang_switch(self.now());
        Ok(report.killed)
    }

    /// Kills what is left of the job, removes its cgroup and frees its CPUs, all under the
    /// caller's lock (the server releases in two steps instead).
    pub fn release(&mut self, job: &str) -> Result<usize, HostError> {
        let ticket = self.begin_release(job)?;
        let outcome = ticket.run();
        self.finish_release(ticket, outcome)
    }

    /// Starts suspending `job`: checks it can be, then the caller runs the ticket (without the
    /// lock) and calls [`Host::finish_suspend`].
    pub fn begin_suspend(&mut self, job: &str, by: Option<u32>) -> Result<FreezeTicket, HostError> {
        let id = self.check_changeable(job)?;
        // Its owner stops only what is theirs: checked under the lock that marks the job
        // "being suspended", which no join passes until the freeze is done.
        if let Some(owner) = by {
            if let Some((pid, uid)) = self.foreign_process(job, owner) {
                return Err(HostError::ForeignProcess { job: job.to_string(), pid, uid });
            }
            // A job a preempted one waits for would keep it frozen as long as its owner liked.
            if let Some(why) = self.holds_for_preempted(job) {
                return Err(HostError::HoldsForPreempted { job: job.to_string(), why });
            }
        }
        // Suspended by topod's preemption or by the batch system: now it is this suspension,
        // which freezes it.
        // Not by its owner, though: the suspension is not the owner's to take over (and then
        // resume, which the owner may do with a suspension of their own).
        if self.ledger.is_suspended(job) && (!self.suspended_by_policy(job) || by.is_some()) {
            return Err(HostError::Ledger(LedgerError::WrongState {
                job: job.to_string(),
                state: JobState::Suspended,
            }));
        }
        // The record first: a crash after the freeze must find a job that was suspended.
        let mut hint = self.hints.get(job).cloned().unwrap_or_default();
        hint.suspended = true;
        hint.suspended_by = by;
        // Suspended by preemption already: now it is this suspension, which topod does not undo.
        hint.preempted_by = None;
        hint.batch_suspended = false;
        self.write_record(&id, &hint)?;
        self.hints.insert(job.to_string(), hint);
        self.changing.insert(job.to_string(), "being suspended");
        Ok(self.freeze_ticket(id, true))
    }

    /// Ends a suspend: once the kernel reports the job frozen, its CPUs may be lent.
    pub fn finish_suspend(
        &mut self,
        ticket: FreezeTicket,
        outcome: Result<(), CgroupError>,
    ) -> Result<topo_core::proto::reply::Suspend, HostError> {
        let job = ticket.id.as_str().to_string();
        self.changing.remove(&job);
        let mut hint = self.hints.get(&job).cloned().unwrap_or_default();
        if let Err(e) = outcome {
            // Thawed again by the backend: running, as the record now says too.
            hint.suspended = false;
            hint.suspended_by = None;
            self.record(&ticket.id, &hint);
            self.hints.insert(job, hint);
            return Err(e.into());
        }
        if !self.ledger.is_suspended(&job) {
            self.ledger.suspend(&job)?;
        }
        let cpus = self.ledger.get(&job).map(|a| a.cpus.clone()).unwrap_or_default();
        // Not counted in `suspensions`: this suspension is not the policy's.
        let now = self.now_s();
        hint.ran_s += hint.running_since.take().map_or(0, |t| (now - t).max(0) as u64);
        if self.ledger.get(&job).is_some_and(|a| a.gang_row.is_some()) {
            // Its CPUs are idle now: another row's job may run on them until the next slice.
            self.gang_switch(self.now());
        }
        self.record(&ticket.id, &hint);
        self.hints.insert(job.clone(), hint);
        tracing::info!(event = "suspended", job = %job, cpus = %cpus, "job {job}: suspended; CPUs {cpus} may be lent");
        Ok(topo_core::proto::reply::Suspend { job, cpus, frozen_after_us: ticket.micros() })
    }

    /// Starts resuming `job`: its CPUs are taken back now (refused while another job runs on
    /// any of them), then the caller runs the ticket and calls [`Host::finish_resume`].
    pub fn begin_resume(&mut self, job: &str) -> Result<FreezeTicket, HostError> {
        let id = self.check_changeable(job)?;
        if self.ledger.is_suspended(job)
            && self.ledger.get(job).is_some_and(|a| a.gang_row.is_some())
        {
            // A gang job goes back to taking turns: frozen until the switch below says it runs.
            match self.ledger.resume_to_gang(job) {
                Ok(()) => {}
                Err(LedgerError::Conflict { cpus, holder, .. }) => {
                    return Err(HostError::Lent { job: job.to_string(), cpus, holder })
                }
                Err(e) => return Err(e.into()),
            }
            self.changing.insert(job.to_string(), "being resumed");
            let mut ticket = self.freeze_ticket(id, false);
            ticket.freeze = None;
            return Ok(ticket);
        }
        match self.ledger.resume(job, None) {
            Ok(_) => {}
            Err(LedgerError::Conflict { cpus, holder, .. }) => {
                return Err(HostError::Lent { job: job.to_string(), cpus, holder })
            }
            Err(e) => return Err(e.into()),
        }
        self.changing.insert(job.to_string(), "being resumed");
        Ok(self.freeze_ticket(id, false))
    }

    /// Ends a resume. When the kernel did not thaw the job, it stays suspended.
    pub fn finish_resume(
        &mut self,
        ticket: FreezeTicket,
        outcome: Result<(), CgroupError>,
    ) -> Result<topo_core::proto::reply::Resume, HostError> {
        let job = ticket.id.as_str().to_string();
        self.changing.remove(&job);
        if let Err(e) = outcome {
            if self.backend.is_frozen(&ticket.id).unwrap_or(false) {
                let _ = self.ledger.suspend(&job);
            }
            return Err(e.into());
        }
        let cpus = self.ledger.get(&job).map(|a| a.cpus.clone()).unwrap_or_default();
        if let Some(mut hint) = self.hints.get(&job).cloned() {
            hint.suspended = false;
            hint.suspended_by = None;
            if hint.preempted_by.take().is_some() {
                // Preemption's suspension, undone by hand: as topod's own resume would.
                hint.protected_since = Some(self.now_s());
            }
            hint.batch_suspended = false;
            hint.running_since = Some(self.now_s());
            self.record(&ticket.id, &hint);
            self.hints.insert(job.clone(), hint);
        }
        if ticket.freeze.is_none() {
            self.gang_switch(self.now());
            let now =
                if self.ledger.is_gang_frozen(&job) { "frozen until its slice" } else { "running" };
            tracing::info!(event = "resumed", job = %job, cpus = %cpus, "job {job}: resumed to gang slicing on CPUs {cpus} ({now})");
        } else {
            tracing::info!(event = "resumed", job = %job, cpus = %cpus, "job {job}: resumed on CPUs {cpus}");
        }
        Ok(topo_core::proto::reply::Resume { job, cpus, thawed_after_us: ticket.micros() })
    }

    /// Suspended jobs the kernel no longer reports frozen (thawed behind topod's back, while
    /// their CPUs may be lent): each marked as being suspended, with a ticket that freezes it
    /// again without the lock; [`Host::finish_suspend`] then records the outcome.
    pub fn begin_refreeze(&mut self) -> Vec<FreezeTicket> {
        let thawed: Vec<String> = self
            .ledger
            .suspended_jobs()
            .chain(self.ledger.gang_frozen_jobs())
            .map(|a| a.job.clone())
            .filter(|job| {
                !self.releasing.contains(job)
                    && !self.changing.contains_key(job)
                    && !self.is_switching(job)
            })
            // The batch system stopped it, not topod's freezer.
            .filter(|job| !self.hints.get(job).is_some_and(|h| h.batch_suspended))
            .filter(|job| {
                JobId::parse(job).is_ok_and(|id| matches!(self.backend.is_frozen(&id), Ok(false)))
            })
            .collect();
        let mut tickets = Vec::new();
        for job in thawed {
            let Ok(id) = JobId::parse(&job) else { continue };
            tracing::warn!(
                "job {job}: suspended, but found thawed (by someone else?); freezing it again"
            );
            self.changing.insert(job, "being suspended");
            tickets.push(self.freeze_ticket(id, true));
        }
        tickets
    }

    /// Ends a [`Host::begin_refreeze`] ticket: the job stays suspended either way (when the
    /// freeze failed, the failure is logged).
    pub fn finish_refreeze(&mut self, ticket: FreezeTicket, outcome: Result<(), CgroupError>) {
        let job = ticket.id.as_str().to_string();
        self.changing.remove(&job);
        if let Err(e) = outcome {
            tracing::warn!("job {job}: freezing it again failed: {e}");
        }
    }

    fn check_changeable(&self, job: &str) -> Result<JobId, HostError> {
        let id = JobId::parse(job)?;
        if self.releasing.contains(job) {
            return Err(HostError::Releasing(job.to_string()));
        }
        if let Some(what) = self.changing.get(job) {
            return Err(HostError::Changing { job: job.to_string(), what });
        }
        if self.is_switching(job) {
            return Err(HostError::Changing { job: job.to_string(), what: SWITCHING });
        }
        if self.ledger.get(job).is_none() {
            return Err(HostError::UnknownJob(job.to_string()));
        }
        Ok(id)
    }

    fn freeze_ticket(&self, id: JobId, freeze: bool) -> FreezeTicket {
        FreezeTicket {
            id,
            freeze: Some(freeze),
            backend: self.backend.clone(),
            timeout: self.freeze_timeout,
            started: std::time::Instant::now(),
        }
    }

    /// Suspends `job` under the caller's lock (the server does it in three steps).
    pub fn suspend(&mut self, job: &str) -> Result<topo_core::proto::reply::Suspend, HostError> {
        let ticket = self.begin_suspend(job, None)?;
        let outcome = ticket.run();
        self.finish_suspend(ticket, outcome)
    }

    /// Resumes `job` under the caller's lock.
    pub fn resume(&mut self, job: &str) -> Result<topo_core::proto::reply::Resume, HostError> {
        let ticket = self.begin_resume(job)?;
        let outcome = ticket.run();
        self.finish_resume(ticket, outcome)
    }

    /// Looks again at the exclusive cpusets beside topod's subtree: when one has come or gone,
    /// the placement model is rebuilt without (or again with) its CPUs, and the subtree is
    /// widened to what it may use now. Returns the foreign CPUs before and after a change.
    pub fn reconcile_foreign(&mut self) -> Option<(CpuSet, CpuSet)> {
        let foreign = match self.backend.foreign_cpus() {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!("looking for other exclusive cpusets: {e}");
                return None;
            }
        };
        if foreign == self.foreign {
            return None;
        }
        if let Err(e) = self.backend.widen() {
            tracing::warn!("widening topod's cgroup subtree: {e}");
        }
        match HostModel::new(&self.topo, &self.reserved.union(&foreign)) {
            Ok(model) => {
                self.model = Arc::new(model);
                let before = std::mem::replace(&mut self.foreign, foreign.clone());
                tracing::info!(
                    "exclusive cpusets beside topod's now hold CPUs {} (were {}); jobs may use {}",
                    if foreign.is_empty() { "none".to_string() } else { foreign.to_string() },
                    if before.is_empty() { "none".to_string() } else { before.to_string() },
                    self.model.allocatable
                );
                Some((before, foreign))
            }
            Err(e) => {
                tracing::warn!("exclusive cpusets beside topod's hold CPUs {foreign}: {e}");
                None
            }
        }
    }

    /// The first process in `job`'s cgroup whose real or effective uid is not `owner`, with
    /// that uid: its owner may stop and start only what is theirs (as the resize signal goes
    /// only to the owner's processes). A process gone meanwhile is not counted.
    pub fn foreign_process(&self, job: &str, owner: u32) -> Option<(i32, u32)> {
        let id = JobId::parse(job).ok()?;
        let pids = self.backend.pids(&id).ok()?;
        pids.into_iter().find_map(|pid| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            let uids = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
            let foreign = uids
                .split_whitespace()
                .take(2)
                .filter_map(|u| u.parse::<u32>().ok())
                .find(|&u| u != owner)?;
            Some((pid, foreign))
        })
    }

    /// Whether `job` is suspended by the batch system or by topod's preemption (for another
    /// job), not by a person.
    pub fn suspended_by_policy(&self, job: &str) -> bool {
        self.ledger.is_suspended(job)
            && self.hints.get(job).is_some_and(|h| h.preempted_by.is_some() || h.batch_suspended)
    }

    /// Why `job`'s owner (`uid`) may not resume it: who suspended it, and who may resume it.
    pub fn not_the_owners_to_resume(&self, job: &str, uid: u32) -> String {
        match self.hints.get(job) {
            Some(JobHint { preempted_by: Some(p), .. }) => format!(
                "job {job} was suspended by topod's preemption for job {p}; topod resumes it once its CPUs are free of running jobs and of {p} (you are uid {uid})"
            ),
            Some(h) if h.batch_suspended => format!(
                "job {job} was suspended by the batch system; it resumes it (you are uid {uid})"
            ),
            _ => format!(
                "job {job} was suspended by root, an administrator or the batch system; only they may resume it (you are uid {uid})"
            ),
        }
    }

    /// Who suspended `job`, when it was its owner (see [`JobHint::suspended_by`]).
    pub fn suspended_by(&self, job: &str) -> Option<u32> {
        self.hints.get(job).and_then(|h| h.suspended_by)
    }

    /// The uid allowed to join its own processes to `job`, if one was given at allocation.
    pub fn owner_of(&self, job: &str) -> Option<u32> {
        self.hints.get(job).and_then(|h| h.owner_uid)
    }

    /// Would `request` fit now, and how well.
    pub fn fit(&self, request_text: &str, tasks: Option<u32>) -> Result<place::Fit, HostError> {
        let prepared = prepare(&self.topo, request_text, tasks, None)?;
        self.snapshot().fit(&prepared)
    }

    /// What reads need, copied for use without the lock.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            model: self.model.clone(),
            // With gang rows, what a job that runs through every slice must avoid.
            occupancy: self.ledger.occupancy_for(None),
            // Reservations change what placement may use, so they count as changes too.
            generation: self.ledger.generation() + self.reservation_changes,
            jobs: self.jobs(),
            reservations: self.reservations(),
            defrag: self.defrag.is_some(),
            gang: self.gang_status.clone(),
            pools: self.pool_status(),
        }
    }

    /// Every job with its state, owner, and the CPUs lent between suspended and running jobs.
    pub fn jobs(&self) -> Vec<JobView> {
        let loans = self.ledger.lent();
        let view = |a: &Allocation, state: JobState| JobView {
            allocation: a.clone(),
            state: if self.releasing.contains(&a.job) { JobState::Releasing } else { state },
            owner_uid: self.owner_of(&a.job),
            lent_to: loans
                .iter()
                .filter(|l| l.owner == a.job)
                .map(|l| (l.holder.clone(), l.cpus.clone()))
                .collect(),
            borrowed_from: loans
                .iter()
                .filter(|l| l.holder == a.job)
                .map(|l| (l.owner.clone(), l.cpus.clone()))
                .collect(),
            missized: self.missized.get(&a.job).cloned(),
            preempted_by: (state == JobState::Suspended)
                .then(|| self.hints.get(&a.job).and_then(|h| h.preempted_by.clone()))
                .flatten(),
            queue: self.hints.get(&a.job).and_then(|h| h.queue.clone()),
            pool: self.hints.get(&a.job).and_then(|h| h.pool.clone()),
            tasks_cap: self.hints.get(&a.job).and_then(|h| h.tasks_cap),
            batch_suspended: state == JobState::Suspended
                && self.hints.get(&a.job).is_some_and(|h| h.batch_suspended),
        };
        let mut jobs: Vec<JobView> = self
            .ledger
            .jobs()
            .map(|a| view(a, JobState::Running))
            .chain(self.ledger.suspended_jobs().map(|a| view(a, JobState::Suspended)))
            .chain(self.ledger.gang_frozen_jobs().map(|a| view(a, JobState::Frozen)))
            .collect();
        jobs.sort_by(|a, b| a.allocation.job.cmp(&b.allocation.job));
        jobs
    }

    /// What topod counts for its metrics.
    pub fn metrics(&self) -> Arc<super::metrics::Metrics> {
        self.metrics.clone()
    }

    /// The cgroup backend (the metrics sampler reads the jobs' processes and files through it,
    /// without the lock).
    pub fn backend(&self) -> Arc<dyn CgroupBackend> {
        self.backend.clone()
    }

    /// Marks `job` mis-sized until its release; true the first time (the caller logs it once).
    pub fn flag_missized(&mut self, job: &str, flag: Missized) -> bool {
        if self.ledger.get(job).is_none() || self.missized.contains_key(job) {
            return false;
        }
        self.missized.insert(job.to_string(), flag);
        true
    }

    /// The placement model (allocatable CPUs: configuration's reserved and foreign ones out).
    pub fn model(&self) -> &HostModel {
        &self.model
    }

    /// The ledger.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The hardware graph.
    pub fn topology(&self) -> &Arc<Topology> {
        &self.topo
    }

    /// What is free, by shape.
    pub fn host_metrics(&self) -> HostMetrics {
        HostMetrics::measure(&self.model, self.ledger.occupancy())
    }

    /// The CPUs jobs may get.
    pub fn allocatable(&self) -> &CpuSet {
        &self.model.allocatable
    }

    /// The backend's name.
    pub fn backend_kind(&self) -> &'static str {
        self.backend.kind()
    }

    fn write_record(&self, id: &JobId, hint: &JobHint) -> Result<(), HostError> {
        match &self.records {
            Some(r) => r.write(id, hint).map_err(HostError::Records),
            None => Ok(()),
        }
    }

    /// Writes a record during recovery, where a failure is only logged (the cgroup is kept).
    fn record(&self, id: &JobId, hint: &JobHint) {
        if let Err(e) = self.write_record(id, hint) {
            tracing::warn!("job {id}: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
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
        fn create(
            &self,
            j: &JobId,
            s: &CgroupSpec,
        ) -> Result<crate::cgroup::Effective, CgroupError> {
            self.kernel.create(j, s)
        }
        fn update(
            &self,
            j: &JobId,
            s: &CgroupSpec,
        ) -> Result<crate::cgroup::Effective, CgroupError> {
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
        fn release(
            &self,
            j: &JobId,
            t: Duration,
        ) -> Result<crate::cgroup::ReleaseReport, CgroupError> {
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

    fn host(records: Option<Records>) -> Host {
        let topo = Topology::synthetic(SyntheticShape {
            packages: 2,
            numa_per_package: 1,
            l3_per_numa: 2,
            cores_per_l3: 4,
            threads_per_core: 2,
        });
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
        let spec = CgroupSpec { cpus: two.clone(), mems: a.mems.clone(), memory_limit: None };
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
        assert!(matches!(h.join("8", 1), Err(HostError::UnknownJob(_))));
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
                    &CgroupSpec { cpus: a.cpus.clone(), mems: a.mems.clone(), memory_limit: None },
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
        assert_eq!(
            again.owner_of("1"),
            Some(1000),
            "the owner was durable before allocate answered"
        );
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
            p.gang.queue = Some("batch".into());
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
        p.gang.queue = Some("interactive".into());
        let i = h.allocate_prepared("i", &p, None, None).unwrap();
        assert!(i.cpus.is_subset(&pool));
        let mut p = prepare(&topo, "affinity[thread*2]", None, None).unwrap();
        p.pool = Some("day".into());
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
        assert!(ran[0][2]
            .ends_with(&format!("runs on 2 CPUs ({})", cpus.to_string().replace(',', " "))));
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
        h.set_defrag(Some(DefragConfig {
            min_run_s: 60,
            gap_s: 300,
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
        // The moved job may not move again within the gap.
        h.release("n").unwrap();
        let (stay, went) = if a.cpus == a0 { (&a, &b) } else { (&b, &a) };
        h.release(&stay.job).unwrap();
        // The moved job is alone on its node; a job pinned to two CPUs of the other node (its
        // CPU list keeps it there) leaves two free on each node again.
        let other = h.model().numa[1 - numa_of(&h, &went.cpus).unwrap()].clone();
        let pin: CpuSet = other.iter().take(2).collect();
        h.allocate("o", "affinity[thread*2]", None, Some(&pin.to_string()), None, None).unwrap();
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
        h.set_defrag(Some(DefragConfig {
            min_run_s: 0,
            gap_s: 0,
            limits: topo_core::defrag::DefragLimits::default(),
        }));
        for j in ["a", "b", "c"] {
            h.allocate(j, "affinity[thread*1]", None, None, None, None).unwrap();
        }
        h.release("b").unwrap();
        let before: Vec<String> =
            h.ledger().jobs().map(|a| format!("{} {}", a.job, a.cpus)).collect();
        let n = h.allocate("n", "affinity[thread(2,same=numa)]", None, None, None, None);
        assert!(n.is_ok(), "{before:?}: {n:?}");
    }

    #[test]
    fn a_resize_whose_record_cannot_be_written_is_made_again_at_the_restart_and_never_told_backwards(
    ) {
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
        let shrunk =
            Allocation { cpus: m.tasks[0].clone(), tasks: m.tasks[..1].to_vec(), ..m.clone() };
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
        h.set_defrag(Some(DefragConfig {
            min_run_s: 0,
            gap_s: 0,
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
            p.gang.queue = Some(queue.into());
            p
        };
        let a = h
            .allocate_prepared("a", &with_queue("affinity[thread*2]", "batch"), None, None)
            .unwrap();
        let b = h
            .allocate_prepared("b", &with_queue("affinity[thread*2]", "batch"), None, None)
            .unwrap();
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
        GangAsk { gang: Some(!prime), row, prime, queue: None }
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
        let a =
            gang_allocate(&mut first, "a", "affinity[thread*4]", gang_ask(Some(0), false)).unwrap();
        let b =
            gang_allocate(&mut first, "b", "affinity[thread*4]", gang_ask(Some(1), false)).unwrap();
        assert_eq!((a.gang_row, b.gang_row), (Some(0), Some(1)));
        assert_eq!(a.cpus, b.cpus, "rows share the CPUs");
        // A third in row 0, a job that is not gang-scheduled, a prime one: no room.
        for (job, ask) in [
            ("c", gang_ask(Some(0), false)),
            ("d", GangAsk::default()),
            ("e", gang_ask(None, true)),
            ("f", GangAsk { queue: Some("prime".into()), gang: Some(true), ..GangAsk::default() }),
        ] {
            let err = gang_allocate(&mut first, job, "affinity[thread*1]", ask).unwrap_err();
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
        assert!(
            s.thawed.is_empty() && frozen("a"),
            "a suspended is not thawed for its slice: {s:?}"
        );
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
        let here = h.gang_rows_for("multi-7", &gang_ask(None, false)).unwrap();
        let there = h2.gang_rows_for("multi-7", &gang_ask(None, false)).unwrap();
        assert_eq!(here, there);
        assert_eq!(here.map(|r| r.len()), Some(1));
    }

    /// Issue 30: `topoctl suspend; topoctl resume` twice by a job's owner used up its
    /// `preempt_max_suspensions` and restarted its `preempt_min_run_s`, so that an urgent job
    /// was refused. Only the policy's suspensions count, and only its resumes protect.
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
        let alloc = |h: &mut Host, job: &str, p: PreemptAsk| {
            let mut prepared = prepare(&h.topo, "affinity[thread*2]", None, None).unwrap();
            prepared.preempt = p;
            h.allocate_prepared(job, &prepared, None, None)
        };
        let victim = PreemptAsk {
            preempt: false,
            preemptible: true,
            submitted_at: Some(999_990),
            estimate_s: Some(100_000),
        };
        alloc(&mut h, "v", victim).unwrap();
        // An hour later its owner suspends and resumes it, twice.
        seconds.store(1_003_600, std::sync::atomic::Ordering::SeqCst);
        for _ in 0..2 {
            let ticket = h.begin_suspend("v", Some(1000)).unwrap();
            let outcome = ticket.run();
            h.finish_suspend(ticket, outcome).unwrap();
            h.resume("v").unwrap();
        }
        assert_eq!(h.hints["v"].suspensions, 0, "the owner's suspensions are not the policy's");
        // An urgent job (waited 3.6 h for an hour's work: expansion factor 4.6) takes its CPUs.
        let urgent = PreemptAsk {
            preempt: true,
            preemptible: false,
            submitted_at: Some(990_000),
            estimate_s: Some(3_600),
        };
        alloc(&mut h, "p", urgent.clone()).unwrap();
        assert!(kernel.is_frozen(&JobId::parse("v").unwrap()).unwrap());
        assert_eq!(h.hints["v"].preempted_by.as_deref(), Some("p"));
        assert_eq!(h.hints["v"].suspensions, 1);
        // Nor can its owner take preemption's suspension over (to resume it as their own):
        // attack, issue 29.
        assert!(h.suspended_by_policy("v"));
        assert!(h.begin_suspend("v", Some(1000)).is_err());
        assert_eq!(h.hints["v"].preempted_by.as_deref(), Some("p"));
        // Resumed by topod after p: protected for preempt_min_run_s again.
        h.release("p").unwrap();
        assert!(!kernel.is_frozen(&JobId::parse("v").unwrap()).unwrap());
        seconds.store(1_003_900, std::sync::atomic::Ordering::SeqCst);
        assert!(matches!(alloc(&mut h, "q", urgent.clone()), Err(HostError::DoesNotFit { .. })));
        // A job its owner keeps suspended is no victim: topod would otherwise resume it later.
        seconds.store(1_010_000, std::sync::atomic::Ordering::SeqCst);
        let ticket = h.begin_suspend("v", Some(1000)).unwrap();
        let outcome = ticket.run();
        h.finish_suspend(ticket, outcome).unwrap();
        let _ = alloc(&mut h, "r", urgent);
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
        prepared.preempt = PreemptAsk {
            preempt: true,
            preemptible: false,
            submitted_at: Some(h.now_s() - 86_400),
            estimate_s: Some(60),
        };
        let e = h.allocate_prepared("b", &prepared, None, None).unwrap_err().to_string();
        assert!(e.contains("preemption is off on this host (preempt = false"), "{e}");
        h.set_preempt(Some(topo_core::policy::Preempt::default()));
        prepared.preempt.submitted_at = None;
        let e = h.allocate_prepared("b", &prepared, None, None).unwrap_err().to_string();
        assert!(e.contains("it gave no submission time and time limit"), "{e}");
    }

    /// A host on `kernel` whose preemption lets a job be suspended at once, up to 5 times.
    fn preempting_on(topo: &Topology, kernel: &std::sync::Arc<Fake>) -> Host {
        let mut h = host_on(topo, kernel, None);
        h.set_preempt(Some(topo_core::policy::Preempt {
            min_run: 0,
            max_suspensions: 5,
            min_xf: 2.0,
        }));
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
            prepared.preempt = match preempt {
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
            };
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
        assert!(
            frozen("v") && h.ledger().is_suspended("v"),
            "topod does not undo an explicit suspend"
        );
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
            prepared.preempt = ask;
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
            text.contains(
                "CPUs 1 are held for job v, suspended by preemption for job p, until about "
            ) && text.contains("s from now, its preemptor's time limit")
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
        assert!(
            e.contains("job short may not be suspended: it runs on CPUs 1 held for job v"),
            "{e}"
        );
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
            prepared.preempt = p;
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
        let f =
            alloc(&mut h, "f", "affinity[core(4,same=numa)]", ask(true, 990_000, 3_600)).unwrap();
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
            for w in work {
                let outcome = w.run();
                h.finish_kernel_work(w, outcome);
            }
            h.gang_thaws();
        }
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
            prepared.preempt = PreemptAsk {
                preempt,
                preemptible: !preempt,
                submitted_at: Some(if preempt { 990_000 } else { 999_000 }),
                estimate_s: Some(3_600),
            };
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
        assert!(matches!(
            first.suspend("a"),
            Err(HostError::Ledger(LedgerError::WrongState { .. }))
        ));
        let e = first.resume("a").unwrap_err();
        assert!(e.to_string().contains("lent to job b"), "{e}");
        assert!(kernel.is_frozen(&JobId::parse("a").unwrap()).unwrap());
        assert!(matches!(
            first.resume("b"),
            Err(HostError::Ledger(LedgerError::WrongState { .. }))
        ));
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
        assert_eq!(again.hints["a"].suspensions, 0);
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
    fn a_job_the_batch_system_suspended_lends_its_cpus_unfrozen_and_runs_again_after_its_borrower()
    {
        let dir = tempfile::tempdir().unwrap();
        let topo = small_topology(8);
        let kernel = kernel_for(&topo);
        let mut h = host_on(&topo, &kernel, Some(dir.path()));
        let low =
            h.allocate("slurm-1", "affinity[thread*4]", None, Some("0-3"), None, None).unwrap();
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
        let first =
            h.allocate("slurm-1", "affinity[thread*4]", None, Some("0-3"), None, None).unwrap();
        let other =
            h.allocate("slurm-5", "affinity[thread*2]", None, Some("4-5"), None, None).unwrap();
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
        let e =
            h.allocate("1", "affinity[thread]", Some(0), None, None, None).unwrap_err().to_string();
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
        let old: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
        let mut old = old.as_object().unwrap().clone();
        old.remove("allocated_at");
        std::fs::write(&record, serde_json::to_vec(&old).unwrap()).unwrap();
        let written = std::time::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        std::fs::File::options().write(true).open(&record).unwrap().set_modified(written).unwrap();
        let mut fourth = start(&kernel);
        fourth.recover(BTreeMap::new()).unwrap();
        assert_eq!(
            fourth.allocated_after("slurm-11", written - Duration::from_secs(1)),
            Some(written)
        );
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
}
