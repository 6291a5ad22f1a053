//! The wire protocol between topod and its clients (`topo-exec`, `topoctl`, the plug-ins).
//!
//! One JSON object per line, each carrying the protocol version `v`. A request names its
//! operation in `op`; a reply is either `{"v":1,"ok":{...}}` or `{"v":1,"error":{"code":..,
//! "message":..}}`. Lines longer than [`MAX_LINE_BYTES`] are refused before they are parsed.
//!
//! ```text
//! {"v":1,"op":"version"}
//! {"v":1,"op":"topology"}
//! {"v":1,"op":"free_map"}
//! {"v":1,"op":"fit","request":"affinity[core(2)*4]"}
//! {"v":1,"op":"allocate","job":"1234","request":"affinity[thread*8]","cpus":"0-15","mem_limit_bytes":1073741824}
//! {"v":1,"op":"allocate","job":"1235","request":"affinity[core(2)]","join_pid":4243}
//! {"v":1,"op":"join","job":"1234","pid":4242}
//! {"v":1,"op":"self_join_files","job":"1234"}
//! {"v":1,"op":"release","job":"1234"}
//! {"v":1,"op":"suspend","job":"1234"}
//! {"v":1,"op":"resume","job":"1234"}
//! {"v":1,"op":"resize","job":"1234","tasks":12}
//! {"v":1,"op":"reserve","job":"1240","request":"affinity[numa]","expires_in_s":3600}
//! {"v":1,"op":"unreserve","job":"1240"}
//! {"v":1,"op":"list"}
//! ```
//!
//! Parsing is strict: unknown fields, unknown operations, a missing or unknown version, and
//! anything that is not one JSON object on one line are refused with a message that says which.
//! So a field added within version 1 (`join_pid`, a job start in one request) is refused by an
//! older topod as unknown, and a client can fall back to `allocate` and then `join`.
//!
//! Versions: topod answers each request in the request's version, from
//! [`OLDEST_PROTOCOL_VERSION`] to [`PROTOCOL_VERSION`], so a client older than topod is
//! answered as it expects (it refuses fields it does not know). Version 2 adds only where a
//! refusal points: an error's `at` (the field and the byte range in it, for a request string
//! that does not parse). This build's clients ask in version 2 and, told by an older topod
//! that it speaks only version 1, ask again in version 1 (`topo-client`); a site may upgrade
//! topod and its clients in either order.

use serde::{Deserialize, Serialize};

/// The newest protocol version this build speaks, the one its clients ask in.
pub const PROTOCOL_VERSION: u32 = 2;

/// The oldest protocol version topod still answers in (each request is answered in its own).
pub const OLDEST_PROTOCOL_VERSION: u32 = 1;

/// The longest request line accepted, newline excluded.
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// The longest batch queue or prime-time pool name an `allocate` may give (Slurm's partition,
/// PBS's and LSF's queues are well under it): each is kept in the job's record and shown by
/// `list`, so one user's long names must not make every client's `list` of the host too long.
pub const MAX_NAME_BYTES: usize = 128;

/// Checks an `allocate`'s `queue` or `pool` (`field`): at most [`MAX_NAME_BYTES`] bytes, no
/// control characters (no batch system names a queue with a newline, and one would garble
/// `topoctl jobs`). The error names the field and says what is wrong.
pub fn check_name(field: &str, value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err(format!("{field} is empty (leave it out when there is none)"));
    }
    if value.len() > MAX_NAME_BYTES {
        return Err(format!(
            "{field} is {} bytes long; at most {MAX_NAME_BYTES} bytes (it starts {:?})",
            value.len(),
            value.chars().take(40).collect::<String>()
        ));
    }
    if let Some((at, c)) = value.char_indices().find(|(_, c)| c.is_control()) {
        return Err(format!("{field} {value:?} has a control character ({c:?}) at byte {at}"));
    }
    Ok(())
}

/// The longest reply a client reads (the topology and list of the largest hosts are well under
/// a MiB): a peer that sends more is broken or hostile, and a client inside a batch system's
/// daemon must not grow without bound reading it.
pub const MAX_REPLY_BYTES: usize = 16 * 1024 * 1024;

/// Where topod listens unless configured otherwise; every client's default.
pub const DEFAULT_SOCKET: &str = "/run/topo/topod.sock";

/// The administrators' socket beside `socket` (`topod.sock` -> `topod-admin.sock`): mode 0600,
/// root's, with its own listen queue and accept thread, so that root and the batch system reach
/// topod however many connections users open on the public socket. Clients running as root try
/// it first and fall back to `socket` (an older topod has none).
pub fn admin_socket_for(socket: &std::path::Path) -> std::path::PathBuf {
    let stem = socket.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let name = match socket.extension() {
        Some(ext) => format!("{stem}-admin.{}", ext.to_string_lossy()),
        None => format!("{stem}-admin"),
    };
    socket.with_file_name(name)
}

/// The file through which topod tells a job its CPUs (`generation=N`, `cpus=LIST`, `mems=LIST`,
/// one per line, rewritten whole at every change): `job-notify/<job>` beside the socket, world-
/// readable. `topo-exec` gives its path to the job as `TOPO_NOTIFY_FILE`; libtopo's
/// `topo_resize_wait` blocks on it. `job` must be a valid job id (one path component).
pub fn notify_file_for(socket: &std::path::Path, job: &str) -> std::path::PathBuf {
    notify_dir_for(socket).join(job)
}

/// The directory of the jobs' notify files: `job-notify` beside the socket (not `notify`, the
/// name systemd-style notify sockets often take).
pub fn notify_dir_for(socket: &std::path::Path) -> std::path::PathBuf {
    socket.with_file_name("job-notify")
}

/// The operations, as they appear in `op`.
pub const OPERATIONS: &[&str] = &[
    "version",
    "topology",
    "free_map",
    "fit",
    "allocate",
    "join",
    "self_join_files",
    "release",
    "list",
    "suspend",
    "resume",
    "resize",
    "reserve",
    "unreserve",
    "follow",
];

/// What a client asks.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
// An `allocate` carries every field a batch system may give; a request is parsed once per line
// and moved, never kept in bulk, so boxing it would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum Op {
    /// The daemon's version and protocol version.
    Version,
    /// The host's hardware graph.
    Topology,
    /// Who holds what, with a generation number that changes on every change.
    FreeMap,
    /// Would a request fit, and how well (read-only).
    Fit(FitArgs),
    /// Place a job and create its cgroup; the same job and request again is not an error.
    Allocate(AllocateArgs),
    /// Move a process (all its threads) into the job's cgroup.
    Join {
        /// The job id.
        job: String,
        /// The process.
        pid: i32,
    },
    /// The files a root, single-threaded process writes `0` to so as to move itself into the
    /// job's cgroup, cheaper than `join` (see `topo_client::SelfJoin`); `{"job", "files"}`,
    /// with no files where the host's cgroups offer no such path. For root, an administrator,
    /// or the job's owner; the process then sends `join` for itself, which topod confirms.
    SelfJoinFiles {
        /// The job id.
        job: String,
    },
    /// Kill what is left of the job, remove its cgroup, free its CPUs.
    Release {
        /// The job id.
        job: String,
    },
    /// Every allocation.
    List,
    /// Freeze every process of the job (the kernel's freezer); its memory stays, its CPUs may
    /// be lent to other jobs until `resume` (root or administrators).
    Suspend {
        /// The job id.
        job: String,
    },
    /// Thaw a suspended job once its CPUs are free again (root or administrators).
    Resume {
        /// The job id.
        job: String,
    },
    /// Grow or shrink a running malleable job (its request says `*min-max`) to `tasks` tasks
    /// within its range, and tell it (its notify file, its `resize_signal`); the answer is its
    /// new allocation (root or administrators).
    Resize {
        /// The job id.
        job: String,
        /// Its new number of tasks.
        tasks: u32,
    },
    /// Set a block of CPUs aside for a waiting job until it is allocated or the reservation
    /// expires: other jobs are placed outside it, jobs running in it run on (root or
    /// administrators). A job's new reservation replaces its old one.
    Reserve(ReserveArgs),
    /// Drop a job's reservation (root or administrators).
    Unreserve {
        /// The job id.
        job: String,
    },
    /// What the batch system has done with the jobs on this host, for topod to follow (root or
    /// administrators; the Slurm plug-in asks slurmctld and sends it before each allocate and
    /// after each release). Jobs it has suspended itself (Slurm's suspend preemption and gang
    /// scheduling stop them with SIGSTOP or Slurm's own freezer) lend their CPUs, which the
    /// batch system then gives to another job; topod does not freeze them. Jobs it runs again
    /// take their CPUs back once no running job holds them. Jobs topod suspended itself are
    /// not touched.
    Follow(BatchView),
}

/// The batch system's own view of the jobs on this host: which it has suspended, which it runs.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchView {
    /// Jobs the batch system has suspended now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub suspended: Vec<String>,
    /// Jobs it runs now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub running: Vec<String>,
}

/// The most jobs one [`BatchView`] may name (a host holds far fewer).
pub const MAX_BATCH_VIEW_JOBS: usize = 4096;

impl BatchView {
    /// Checks the view: every job id valid, none named twice, at most
    /// [`MAX_BATCH_VIEW_JOBS`]; the error names the field and the job.
    pub fn check(&self) -> Result<(), String> {
        let total = self.suspended.len() + self.running.len();
        if total > MAX_BATCH_VIEW_JOBS {
            return Err(format!(
                "the batch system's view names {total} jobs; at most {MAX_BATCH_VIEW_JOBS}"
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for (field, jobs) in [("suspended", &self.suspended), ("running", &self.running)] {
            for job in jobs {
                crate::JobId::parse(job).map_err(|e| format!("{field}: {e}"))?;
                if !seen.insert(job.as_str()) {
                    return Err(format!(
                        "{field}: job {job} is named twice in the batch system's view"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The fields of `reserve`.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReserveArgs {
    /// The waiting job.
    pub job: String,
    /// The shape of the block, as a request (`affinity[numa]`, `affinity[core(8,same=l3)]`).
    pub request: String,
    /// Tasks when the request does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks: Option<u32>,
    /// Choose the block only inside these CPUs (list format).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<String>,
    /// Seconds until the reservation lapses if the job has not been allocated (1 to 30 days).
    pub expires_in_s: u64,
}

/// The fields of `fit`. Callers build one with [`FitArgs::new`] and struct update
/// (`FitArgs { tasks, ..FitArgs::new(request) }`), so a new optional field changes only this
/// type and the daemon's handler.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FitArgs {
    /// The request string.
    pub request: String,
    /// Tasks when the request does not say (`bsub -n`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks: Option<u32>,
    /// Fit only within these CPUs (list format), as `allocate`'s `cpus` places: would the job
    /// fit inside what the batch system gave it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<String>,
    /// The GPUs the job would be given, as `allocate`'s `gpus`: with `gpubind=numa` or
    /// `socket`, would it fit near them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<String>,
}

impl FitArgs {
    /// `fit` of `request`, no optional field set.
    pub fn new(request: impl Into<String>) -> Self {
        FitArgs { request: request.into(), ..FitArgs::default() }
    }
}

/// The fields of `allocate`; built as [`FitArgs`] is, from [`AllocateArgs::new`].
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocateArgs {
    /// The batch system's job id.
    pub job: String,
    /// The request string.
    pub request: String,
    /// Tasks when the request does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks: Option<u32>,
    /// CPUs the batch system already gave the job (list format); placement stays inside.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<String>,
    /// Memory limit for the job's cgroup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_limit_bytes: Option<u64>,
    /// The uid the job runs as: that user may then join its own processes to the job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_uid: Option<u32>,
    /// A process to move into the job's cgroup once it is made, as `join` would: a job start in
    /// one round trip. If the move fails, an allocation this request made is undone (one that
    /// was there before stays), and the error says which.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join_pid: Option<i32>,
    /// Gang time slicing: `true` to share CPUs with gang jobs of other rows, taking turns by
    /// slices; `false` not to; unset: as topod's `gang_all_jobs` says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gang: Option<bool>,
    /// The gang row to take (give the same one on every host of a multi-host job).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gang_row: Option<u32>,
    /// A prime job: runs through every slice, never shares a CPU.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub prime: bool,
    /// The batch system's queue (jobs of `gang_prime_queues` are prime).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    /// When the job does not fit, it may suspend running jobs that are `preemptible` (when
    /// topod's `preempt` allows it; needs `submitted_at` and `estimate_s`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub preempt: bool,
    /// The job may be suspended for another (then it needs `submitted_at` and `estimate_s`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub preemptible: bool,
    /// When the batch system took the job, seconds since the epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submitted_at: Option<i64>,
    /// Its estimated run time (its time limit), seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimate_s: Option<u64>,
    /// A malleable job: the signal (a standard signal number the job can catch, e.g. 10 for
    /// SIGUSR1 on Linux) topod sends to each of its processes after its CPUs change, once its
    /// notify file says the new ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resize_signal: Option<i32>,
    /// The prime-time pool the job may use (topod.toml `prime_pools`), besides those its queue
    /// and owner give it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// What the batch system has done with the other jobs on this host, applied first as
    /// [`Op::Follow`] does: a job it suspended lends this one its CPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<BatchView>,
    /// The batch system starts this job suspended (Slurm's gang scheduling started it in a row
    /// that is not running): it is placed inside `cpus` (needed) as if the jobs running there
    /// had lent them, and held suspended by the batch system until it runs it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub starts_suspended: bool,
    /// The GPUs (or other PCI devices) the batch system gave the job on this host: PCI
    /// addresses (`0000:3b:00.0`), names `topology` lists (`card1`), character device numbers
    /// (`char:195:0`, what the plug-ins send) or device files (`/dev/nvidia0`, as topod sees
    /// `/dev`). The job's CPUs go near them as its request's `gpubind=` says (by default: in
    /// their NUMA nodes when it fits there), and `list` says how near they are. Where topod
    /// confines devices (`confine_devices`), the job may open no other GPU's device files.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<String>,
    /// How many of the job's GPUs the batch system counted in each NUMA node, for a request
    /// with `gpus=` whose GPUs topod chooses (PBS with one vnode per NUMA node counts a chunk's
    /// `ngpus` on the vnodes `host[N]` it took them from, and may take them from a node other
    /// than its CPUs'): topod then takes that many free GPUs in each node, so that its count
    /// of free GPUs per node stays the batch system's. The counts add up to the GPUs the
    /// request asks for; not with `gpus`. A topod older than this field refuses it as unknown.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus_by_numa: Vec<NumaGpus>,
}

/// GPUs a batch system counted in one NUMA node (`allocate`'s `gpus_by_numa`).
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NumaGpus {
    /// The NUMA node's kernel id (`nodeN`; PBS's vnode `host[N]`).
    pub numa: u32,
    /// How many GPUs the job has there (at least 1).
    pub count: u32,
}

impl AllocateArgs {
    /// `allocate` of `job` for `request`, no optional field set.
    pub fn new(job: impl Into<String>, request: impl Into<String>) -> Self {
        AllocateArgs { job: job.into(), request: request.into(), ..AllocateArgs::default() }
    }
}

impl Op {
    /// An `allocate` of `job` for `request`, with no optional field set.
    pub fn allocate(job: impl Into<String>, request: impl Into<String>) -> Op {
        Op::Allocate(AllocateArgs::new(job, request))
    }

    /// This `allocate` with `join_pid` set (other operations are returned as they are).
    pub fn joining(mut self, pid: i32) -> Op {
        if let Op::Allocate(args) = &mut self {
            args.join_pid = Some(pid);
        }
        self
    }

    /// This `allocate` with `owner_uid` set (other operations are returned as they are).
    pub fn owned_by(mut self, uid: u32) -> Op {
        if let Op::Allocate(args) = &mut self {
            args.owner_uid = Some(uid);
        }
        self
    }

    /// The operation's name, as `op` spells it on the wire.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Version => "version",
            Op::Topology => "topology",
            Op::FreeMap => "free_map",
            Op::Fit(_) => "fit",
            Op::Allocate(_) => "allocate",
            Op::Join { .. } => "join",
            Op::SelfJoinFiles { .. } => "self_join_files",
            Op::Release { .. } => "release",
            Op::List => "list",
            Op::Suspend { .. } => "suspend",
            Op::Resume { .. } => "resume",
            Op::Resize { .. } => "resize",
            Op::Reserve(_) => "reserve",
            Op::Unreserve { .. } => "unreserve",
            Op::Follow(_) => "follow",
        }
    }

    /// Whether the operation changes the host (allocate, join, self_join_files, release,
    /// suspend, resume); the read-only TCP listener refuses these.
    pub fn changes_state(&self) -> bool {
        matches!(
            self,
            Op::Allocate(_)
                | Op::Join { .. }
                | Op::SelfJoinFiles { .. }
                | Op::Release { .. }
                | Op::Suspend { .. }
                | Op::Resume { .. }
                | Op::Resize { .. }
                | Op::Reserve(_)
                | Op::Unreserve { .. }
                | Op::Follow(_)
        )
    }
}

/// The `ok` value of each reply, typed: topod builds these, clients read them (a field renamed
/// on one side fails to parse on the other, instead of reading as 0). `topology` answers a
/// [`crate::topology::Topology`], `fit` a [`crate::place::Fit`], `allocate` a
/// [`crate::ledger::Allocation`], `list` a list of [`crate::ledger::JobView`].
pub mod reply {
    use crate::cpuset::CpuSet;
    use crate::place::HostMetrics;
    use serde::{Deserialize, Serialize};
    use std::path::PathBuf;

    /// `version`.
    #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Version {
        /// topod's version.
        pub topod: String,
        /// The protocol version it speaks.
        pub protocol: u32,
        /// Its cgroup backend: `v1`, `v2` or `fake`.
        pub cgroup: String,
        /// Its process id.
        pub pid: u32,
    }

    /// Gang time slicing on a host: its configuration and what it has done.
    #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct GangStatus {
        /// Slice length, seconds.
        pub slice_s: u64,
        /// Rows.
        pub rows: u32,
        /// The slice of the last switch (seconds since the epoch ÷ slice length).
        pub slice: i64,
        /// The row whose slice it was.
        pub active_row: u32,
        /// Switches that froze or thawed a job.
        pub switches: u64,
        /// Freezes for another row's slice, in all.
        pub frozen: u64,
        /// Freezes and thaws that failed (the log says why).
        pub failed: u64,
        /// When the last switch began, UTC to the nanosecond.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub last_switch_at: Option<String>,
        /// How long it took to freeze and thaw, microseconds.
        pub last_switch_us: u64,
    }

    /// `free_map`: who holds what, by CPU and by shape.
    #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct FreeMap {
        /// The ledger's generation: it changes whenever a job is allocated or released.
        pub generation: u64,
        /// CPUs jobs may get (reserved and foreign ones left out).
        pub allocatable: CpuSet,
        /// CPUs held by jobs.
        pub held: CpuSet,
        /// CPUs no new job may get (the rest of an exclusive job's domains).
        pub fenced: CpuSet,
        /// How many jobs hold CPUs.
        pub jobs: usize,
        /// Their ids.
        #[serde(default)]
        pub job_ids: Vec<String>,
        /// What is free, by shape.
        pub free: HostMetrics,
        /// Gang time slicing, when the host has it on.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub gang: Option<GangStatus>,
        /// The live topology reservations: their blocks are for their own jobs only.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub reservations: Vec<crate::reservation::Reservation>,
        /// The host moves running jobs to make room for an allocate that does not fit although
        /// enough CPUs are free (topod.toml `defrag`): a scheduler may rank such a host below
        /// those where the job fits as things are.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        pub defrag: bool,
        /// The host's prime-time pools (topod.toml `prime_pools`), open or not as of topod's
        /// last look (at every change, and on its 5 s tick).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub pools: Vec<PoolStatus>,
        /// With `defrag`: what topod's planner would work with at an allocate, so that a
        /// scheduler runs the same plan (`defrag::plan_moves`) and counts the host as fitting
        /// after moves only when moves would make room.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub moves: Option<DefragView>,
        /// The GPUs (and accelerators) no job holds and no reservation holds, each by where
        /// it is, so that a scheduler's plug-in chooses for a `gpus=` request as topod will
        /// (`topo_core::gpus::choose_among`). A topod older than this field sends none.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub gpus: Vec<crate::gpus::GpuSite>,
        /// The GPUs a live reservation holds for its job and no job holds now: free to that
        /// job (which topod gives them first), to no other.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub reserved_gpus: Vec<ReservedGpu>,
        /// The GPUs (and accelerators) jobs hold, each with its job and where it is, so that a
        /// batch system counting GPUs per NUMA node (the PBS hook's per-NUMA vnodes) counts
        /// held ones as it counts free ones. A topod older than this field sends none.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub held_gpus: Vec<HeldGpu>,
        /// The fingerprint of the topology this topod serves (`Topology::fingerprint`): a
        /// plug-in that cached the topology fetches it again when this changes (topod
        /// restarted on other hardware). A topod older than this field sends none.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub topology_id: Option<u64>,
    }

    /// A GPU a job holds (`free_map`'s `held_gpus`).
    #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct HeldGpu {
        /// The job.
        pub job: String,
        /// Its PCI address.
        pub pci_address: String,
        /// Where it is.
        pub site: crate::gpus::GpuSite,
    }

    /// A GPU a reservation holds for its job (`free_map`'s `reserved_gpus`).
    #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct ReservedGpu {
        /// The job the reservation is for.
        pub job: String,
        /// Where the GPU is.
        pub site: crate::gpus::GpuSite,
    }

    /// The running jobs topod's `defrag` may move, and the planner's bounds.
    #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct DefragView {
        /// The host's placement strategy (topod.toml `strategy`).
        pub strategy: crate::place::Strategy,
        /// How far the planner may go (topod.toml `migrate_*`).
        pub limits: crate::defrag::DefragLimits,
        /// The running jobs it considers (not gang-scheduled, not being released or changed).
        pub jobs: Vec<MovableJob>,
    }

    /// A running job as topod's planner sees it.
    #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct MovableJob {
        /// Its id.
        pub job: String,
        /// The request it was placed for (a move places it again with it: a `CPU_LIST` keeps
        /// it where it is).
        pub request: String,
        /// Its CPUs.
        pub cpus: CpuSet,
        /// The CPUs it fences.
        #[serde(default, skip_serializing_if = "CpuSet::is_empty")]
        pub fenced: CpuSet,
        /// Its CPUs per task.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub tasks: Vec<CpuSet>,
        /// Seconds since the epoch from which it may be moved (topod.toml
        /// `migrate_min_run_s` after its start, `migrate_gap_s` after its last move); none:
        /// not while it runs (a job whose start topod did not see).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub movable_from: Option<i64>,
    }

    /// A prime-time pool as `free_map` shows it.
    #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct PoolStatus {
        /// Its name (an allocate's `pool` names it).
        pub name: String,
        /// Its CPUs.
        pub cpus: CpuSet,
        /// Inside one of its windows now: only the jobs it admits may use its CPUs.
        pub open: bool,
        /// The queues whose jobs it admits.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub queues: Vec<String>,
        /// The uids whose jobs it admits.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub users: Vec<u32>,
        /// It admits jobs whose allocate names it.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        pub named: bool,
    }

    /// `reserve`.
    #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Reserve {
        /// The reservation made.
        #[serde(flatten)]
        pub reservation: crate::reservation::Reservation,
        /// CPUs of the block that running jobs hold now: it is the job's once they end.
        pub busy: CpuSet,
        /// The reservation's GPUs that running jobs hold now (PCI addresses): the job's once
        /// they end.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub busy_gpus: Vec<String>,
    }

    /// `join`.
    #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Join {
        /// The job.
        pub job: String,
        /// The process moved in.
        pub pid: i32,
    }

    /// `self_join_files`.
    #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct SelfJoinFiles {
        /// The job.
        pub job: String,
        /// The files to write `0` to, in order; none where the host offers no self-join.
        pub files: Vec<PathBuf>,
    }

    /// `release`.
    #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Release {
        /// The job.
        pub job: String,
        /// How many of its processes were killed.
        pub killed: usize,
    }

    /// `suspend`.
    #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Suspend {
        /// The job.
        pub job: String,
        /// Its CPUs, now free for other jobs to borrow.
        pub cpus: CpuSet,
        /// Microseconds from the request to the kernel reporting the job frozen.
        pub frozen_after_us: u64,
    }

    /// `follow`: what changed in topod's ledger.
    #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
    #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Follow {
        /// Jobs now held as suspended by the batch system (their CPUs may be lent).
        pub suspended: Vec<String>,
        /// Jobs the batch system runs again, running again in the ledger.
        pub resumed: Vec<String>,
        /// Jobs it runs again whose CPUs a job topod holds as running still has: left
        /// suspended in the ledger until that job is released or suspended (the log says so).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub still_lent: Vec<String>,
    }

    /// `resume`.
    #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Resume {
        /// The job.
        pub job: String,
        /// The CPUs it runs on again.
        pub cpus: CpuSet,
        /// Microseconds from the request to the kernel reporting the job thawed.
        pub thawed_after_us: u64,
    }
}

/// A request line: the version and the operation.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// Protocol version.
    pub v: u32,
    /// The operation and its fields.
    #[serde(flatten)]
    pub op: Op,
}

impl Request {
    /// A request in this build's protocol version.
    pub fn new(op: Op) -> Self {
        Self { v: PROTOCOL_VERSION, op }
    }

    /// The line to send, newline included.
    pub fn to_line(&self) -> String {
        let mut s = serde_json::to_string(self).unwrap_or_else(|_| String::from("{}"));
        s.push('\n');
        s
    }
}

/// Error codes a reply may carry.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The line is not a valid request (JSON, fields, size, version).
    BadRequest,
    /// The request string (topology request) does not parse.
    BadTopologyRequest,
    /// The peer may not do this (state changes need root or a configured administrator).
    Forbidden,
    /// No such job.
    UnknownJob,
    /// The job does not fit now.
    DoesNotFit,
    /// Something failed on the host (cgroup, file system).
    Internal,
    /// Too many connections (from this user, or in all); try again later.
    Busy,
}

/// An error reply's body.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorBody {
    /// What kind of error.
    pub code: ErrorCode,
    /// What is wrong, for a person.
    pub message: String,
    /// Where in the request it is wrong, when that is one place in one field (protocol version
    /// 2; never sent in a version 1 reply).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<ErrorAt>,
}

/// Where an error is ([`ErrorBody::at`]): a byte range of one field of the request, such as
/// the offending word of a `request` string, for a client to point at (`topoctl` prints the
/// request with a caret line under it).
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorAt {
    /// The request's field, e.g. `request`.
    pub field: String,
    /// The first byte of the offending text in that field's value.
    pub start: usize,
    /// The byte after it (equal to `start` at the end of the text).
    pub end: usize,
}

/// A reply line.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reply {
    /// Protocol version.
    pub v: u32,
    /// The result, on success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ok: Option<serde_json::Value>,
    /// The error, on failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
}

impl Reply {
    /// A success carrying `value`.
    pub fn ok(value: serde_json::Value) -> Self {
        Self { v: PROTOCOL_VERSION, ok: Some(value), error: None }
    }

    /// A failure.
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            v: PROTOCOL_VERSION,
            ok: None,
            error: Some(ErrorBody { code, message: message.into(), at: None }),
        }
    }

    /// The same failure, pointing at `at`.
    pub fn at(mut self, at: ErrorAt) -> Self {
        if let Some(e) = &mut self.error {
            e.at = Some(at);
        }
        self
    }

    /// The reply as a request of protocol version `v` is answered: in that version, without
    /// what versions before 2 do not have (a client refuses a field it does not know).
    pub fn in_version(mut self, v: u32) -> Self {
        self.v = v.clamp(OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION);
        if self.v < 2 {
            if let Some(e) = &mut self.error {
                e.at = None;
            }
        }
        self
    }

    /// The line to send, newline included.
    pub fn to_line(&self) -> String {
        let mut s = serde_json::to_string(self).unwrap_or_else(|_| String::from("{}"));
        s.push('\n');
        s
    }
}

/// Why a request line was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// Longer than [`MAX_LINE_BYTES`].
    #[error("request of {0} bytes is longer than the limit of {MAX_LINE_BYTES} bytes")]
    TooLong(usize),
    /// Not UTF-8.
    #[error("request is not UTF-8 text (invalid byte at offset {0})")]
    NotText(usize),
    /// Empty line.
    #[error("empty request line; send one JSON object per line")]
    Empty,
    /// Not JSON, or not an object, or wrong fields.
    #[error("request is not valid: {0}")]
    Invalid(String),
    /// `op` names no operation.
    #[error("unknown operation {0:?}; expected one of {ops}", ops = OPERATIONS.join(", "))]
    UnknownOp(String),
    /// A reply that is not valid (what a client says of topod's answer).
    #[error("reply is not valid: {0}")]
    InvalidReply(String),
    /// A reply in a version this client does not speak.
    #[error(
        "the reply is in protocol version {got}; this client speaks versions {OLDEST_PROTOCOL_VERSION} to {PROTOCOL_VERSION}"
    )]
    ReplyVersion {
        /// The reply's version.
        got: u64,
    },
    /// Wrong or missing version.
    #[error(
        "protocol version {got} is not supported; this topod speaks versions {OLDEST_PROTOCOL_VERSION} to {PROTOCOL_VERSION}"
    )]
    Version {
        /// The version the client sent (0 when missing).
        got: u64,
    },
}

/// Whether this build speaks protocol version `v`.
pub fn is_spoken(v: u64) -> bool {
    (u64::from(OLDEST_PROTOCOL_VERSION)..=u64::from(PROTOCOL_VERSION)).contains(&v)
}

/// Whether `error` is an older topod's refusal of a version this build speaks: the client then
/// asks again in version 1. Such a topod answers in version 1 with this text, whatever the
/// request.
pub fn refuses_newer_version(reply: &Reply) -> bool {
    reply.v < PROTOCOL_VERSION
        && reply.error.as_ref().is_some_and(|e| {
            e.code == ErrorCode::BadRequest
                && e.message
                    .starts_with(&format!("protocol version {PROTOCOL_VERSION} is not supported"))
        })
}

/// Parses one request line (without or with its trailing newline).
pub fn parse_request(line: &[u8]) -> Result<Request, ProtoError> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.len() > MAX_LINE_BYTES {
        return Err(ProtoError::TooLong(line.len()));
    }
    let text = std::str::from_utf8(line).map_err(|e| ProtoError::NotText(e.valid_up_to()))?;
    if text.trim().is_empty() {
        return Err(ProtoError::Empty);
    }
    // Look at the envelope first, so that the error names the real problem (a bad version or
    // an unknown operation) rather than a serde message about variants. A field given twice is
    // refused: which of the two counts would be a guess.
    let value = serde_json::from_str::<UniqueKeys>(text)
        .map_err(|e| ProtoError::Invalid(format!("not JSON: {e}")))?
        .0;
    let obj =
        value.as_object().ok_or_else(|| ProtoError::Invalid("expected a JSON object".into()))?;
    match obj.get("v") {
        None => return Err(ProtoError::Invalid("missing protocol version \"v\"".into())),
        Some(v) => match v.as_u64() {
            Some(v) if is_spoken(v) => {}
            Some(v) => return Err(ProtoError::Version { got: v }),
            None => {
                let shown: String = v.to_string().chars().take(32).collect();
                return Err(ProtoError::Invalid(format!("protocol version \"v\" must be a whole number such as {PROTOCOL_VERSION}, not {shown}")));
            }
        },
    }
    let op = match obj.get("op").and_then(serde_json::Value::as_str) {
        Some(op) if OPERATIONS.contains(&op) => op,
        Some(op) => return Err(ProtoError::UnknownOp(op.chars().take(64).collect())),
        None => return Err(ProtoError::Invalid("missing operation \"op\"".into())),
    };
    // serde cannot refuse unknown fields through `flatten`: check them here.
    let allowed = fields_of(op);
    if let Some(extra) =
        obj.keys().find(|k| !matches!(k.as_str(), "v" | "op") && !allowed.contains(&k.as_str()))
    {
        let accepted = if allowed.is_empty() { "none".to_string() } else { allowed.join(", ") };
        return Err(ProtoError::Invalid(format!(
            "unknown field {:?} for operation {op}; accepted fields: {accepted}",
            extra.chars().take(64).collect::<String>()
        )));
    }
    serde_json::from_value(value).map_err(|e| ProtoError::Invalid(e.to_string()))
}

/// A JSON value whose objects have no key twice (serde_json keeps the last of duplicates).
struct UniqueKeys(serde_json::Value);

impl<'de> Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(UniqueKeysVisitor).map(UniqueKeys)
    }
}

struct UniqueKeysVisitor;

impl<'de> serde::de::Visitor<'de> for UniqueKeysVisitor {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(serde_json::Number::from_f64(v)
            .map_or(serde_json::Value::Null, serde_json::Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }
    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        while let Some(UniqueKeys(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(serde_json::Value::Array(out))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let UniqueKeys(value) = map.next_value()?;
            if out.contains_key(&key) {
                let shown: String = key.chars().take(64).collect();
                return Err(serde::de::Error::custom(format!("field {shown:?} is given twice")));
            }
            out.insert(key, value);
        }
        Ok(serde_json::Value::Object(out))
    }
}

/// The fields each operation takes besides `v` and `op`.
fn fields_of(op: &str) -> &'static [&'static str] {
    match op {
        "fit" => &["request", "tasks", "cpus", "gpus"],
        "allocate" => &[
            "job",
            "request",
            "tasks",
            "cpus",
            "mem_limit_bytes",
            "owner_uid",
            "join_pid",
            "gang",
            "gang_row",
            "prime",
            "queue",
            "preempt",
            "preemptible",
            "submitted_at",
            "estimate_s",
            "resize_signal",
            "pool",
            "batch",
            "starts_suspended",
            "gpus",
            "gpus_by_numa",
        ],
        "follow" => &["suspended", "running"],
        "resize" => &["job", "tasks"],
        "reserve" => &["job", "request", "tasks", "cpus", "expires_in_s"],
        "unreserve" => &["job"],
        "join" => &["job", "pid"],
        "self_join_files" => &["job"],
        "release" | "suspend" | "resume" => &["job"],
        _ => &[],
    }
}

/// Parses one reply line.
pub fn parse_reply(line: &[u8]) -> Result<Reply, ProtoError> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let text = std::str::from_utf8(line).map_err(|e| ProtoError::NotText(e.valid_up_to()))?;
    let reply: Reply =
        serde_json::from_str(text).map_err(|e| ProtoError::InvalidReply(e.to_string()))?;
    if !is_spoken(u64::from(reply.v)) {
        return Err(ProtoError::ReplyVersion { got: u64::from(reply.v) });
    }
    // Version 1 has no position: one there is not trusted.
    let v = reply.v;
    Ok(reply.in_version(v))
}

/// The protocol as a JSON Schema (draft 2020-12), generated from the types above: what
/// `topoctl protocol-schema` prints and `packaging/protocol.schema.json` holds (the suite checks
/// that the file is what this build generates). Clients in other languages, the PBS hook among
/// them, read replies against it.
///
/// The document validates any protocol line (a request or a reply). Its `$defs` name every
/// type; `Request` and `Reply` are the two lines, and `ok.<operation>` is the `ok` value of a
/// successful reply to each operation.
#[cfg(feature = "schema")]
pub mod schema {
    use super::{reply, ErrorBody, Reply, Request, OPERATIONS, PROTOCOL_VERSION};
    use serde_json::{json, Value};

    /// The schema document.
    pub fn document() -> Value {
        let mut generator = schemars::generate::SchemaSettings::draft2020_12().into_generator();
        let request = generator.subschema_for::<Request>();
        let reply_line = generator.subschema_for::<Reply>();
        let _ = generator.subschema_for::<ErrorBody>();
        let ok: Vec<(&str, schemars::Schema)> = vec![
            ("version", generator.subschema_for::<reply::Version>()),
            ("topology", generator.subschema_for::<crate::topology::Topology>()),
            ("free_map", generator.subschema_for::<reply::FreeMap>()),
            ("fit", generator.subschema_for::<crate::place::Fit>()),
            ("allocate", generator.subschema_for::<crate::ledger::Allocation>()),
            ("join", generator.subschema_for::<reply::Join>()),
            ("self_join_files", generator.subschema_for::<reply::SelfJoinFiles>()),
            ("release", generator.subschema_for::<reply::Release>()),
            ("list", generator.subschema_for::<Vec<crate::ledger::JobView>>()),
            ("suspend", generator.subschema_for::<reply::Suspend>()),
            ("resume", generator.subschema_for::<reply::Resume>()),
            ("resize", generator.subschema_for::<crate::ledger::Allocation>()),
            ("reserve", generator.subschema_for::<reply::Reserve>()),
            ("unreserve", generator.subschema_for::<crate::reservation::Reservation>()),
            ("follow", generator.subschema_for::<reply::Follow>()),
        ];
        debug_assert!(ok.iter().map(|(op, _)| *op).eq(OPERATIONS.iter().copied()));
        let mut defs = generator.take_definitions(true);
        for (op, schema) in ok {
            defs.insert(format!("ok.{op}"), schema.to_value());
        }
        json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": format!("topod protocol, version {PROTOCOL_VERSION}"),
            "description": "One JSON object per line over topod's Unix socket (or its read-only TCP listener): a request (#/$defs/Request), answered by a reply (#/$defs/Reply) whose ok value for operation OP is #/$defs/ok.OP. Generated by topoctl protocol-schema from topo-core's types.",
            "protocol_version": PROTOCOL_VERSION,
            "anyOf": [request.to_value(), reply_line.to_value()],
            "$defs": defs,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn queue_and_pool_names_are_short_and_printable() {
        for good in [
            "interactive",
            "workq",
            "gpu-long.q",
            "../x",
            "\u{e9}t\u{e9}",
            "x".repeat(128).as_str(),
        ] {
            assert_eq!(check_name("queue", good), Ok(()), "{good}");
        }
        for (bad, says) in [
            ("", "queue is empty"),
            (&*"x".repeat(129), "129 bytes long; at most 128"),
            ("a\nb", "control character ('\\n') at byte 1"),
            ("nul\u{0}", "at byte 3"),
            ("\u{1b}[31mred", "at byte 0"),
        ] {
            let e = check_name("queue", bad).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }

    #[test]
    fn follow_is_strict_and_the_view_is_checked() {
        let r = parse_request(
            br#"{"v":1,"op":"follow","suspended":["slurm-1"],"running":["slurm-2"]}"#,
        )
        .unwrap();
        assert_eq!(
            r.op,
            Op::Follow(BatchView {
                suspended: vec!["slurm-1".into()],
                running: vec!["slurm-2".into()]
            })
        );
        assert_eq!(
            parse_request(br#"{"v":1,"op":"follow"}"#).unwrap().op,
            Op::Follow(BatchView::default())
        );
        for bad in [
            &br#"{"v":1,"op":"follow","suspend":["slurm-1"]}"#[..],
            br#"{"v":1,"op":"follow","suspended":"slurm-1"}"#,
            br#"{"v":1,"op":"allocate","job":"j","request":"affinity[core]","batch":{"bogus":[]}}"#,
        ] {
            assert!(parse_request(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        let many = BatchView {
            suspended: (0..MAX_BATCH_VIEW_JOBS + 1).map(|n| format!("slurm-{n}")).collect(),
            running: vec![],
        };
        assert!(many.check().unwrap_err().contains("at most 4096"));
        let bad = BatchView { suspended: vec![], running: vec!["a/b".into()] };
        assert!(bad.check().unwrap_err().starts_with("running: "));
    }

    #[test]
    fn every_operation_round_trips() {
        let ops = vec![
            Op::Version,
            Op::Topology,
            Op::FreeMap,
            Op::Fit(FitArgs {
                tasks: Some(4),
                cpus: Some("8-15".into()),
                ..FitArgs::new("affinity[core(2)]")
            }),
            Op::Allocate(AllocateArgs {
                tasks: Some(2),
                cpus: Some("0-15".into()),
                mem_limit_bytes: Some(1 << 30),
                owner_uid: Some(1000),
                join_pid: Some(4242),
                ..AllocateArgs::new("1234[7]", "affinity[thread*8]")
            }),
            Op::Join { job: "1234".into(), pid: 4242 },
            Op::SelfJoinFiles { job: "1234".into() },
            Op::Release { job: "1234".into() },
            Op::List,
            Op::Suspend { job: "1234".into() },
            Op::Resume { job: "1234".into() },
            Op::Resize { job: "1234".into(), tasks: 12 },
            Op::Reserve(ReserveArgs {
                job: "1240".into(),
                request: "affinity[numa]".into(),
                tasks: None,
                cpus: Some("0-31".into()),
                expires_in_s: 3600,
            }),
            Op::Unreserve { job: "1240".into() },
            Op::Follow(BatchView {
                suspended: vec!["slurm-1".into()],
                running: vec!["slurm-2".into()],
            }),
        ];
        assert_eq!(ops.len(), OPERATIONS.len());
        for op in ops {
            assert!(OPERATIONS.contains(&op.name()), "{op:?}");
            let line = Request::new(op.clone()).to_line();
            assert!(line.contains(&format!("\"op\":\"{}\"", op.name())), "{line}");
            assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
            assert_eq!(parse_request(line.as_bytes()).unwrap().op, op, "{line}");
        }
        let r = Reply::error(ErrorCode::Forbidden, "only root may release");
        assert_eq!(parse_reply(r.to_line().as_bytes()).unwrap(), r);
    }

    #[test]
    fn each_request_is_answered_in_its_version_and_version_1_has_no_position() {
        for v in [1, 2] {
            let line = format!("{{\"v\":{v},\"op\":\"list\"}}");
            assert_eq!(parse_request(line.as_bytes()).unwrap().v, v);
        }
        let at = ErrorAt { field: "request".into(), start: 9, end: 14 };
        let refusal = Reply::error(ErrorCode::BadTopologyRequest, "bad").at(at.clone());
        let v2 = refusal.clone().in_version(2);
        assert_eq!((v2.v, v2.error.as_ref().unwrap().at.as_ref()), (2, Some(&at)));
        assert!(v2.to_line().contains(r#""at":{"field":"request","start":9,"end":14}"#));
        let v1 = refusal.in_version(1);
        assert_eq!((v1.v, v1.error.as_ref().unwrap().at.as_ref()), (1, None));
        assert!(!v1.to_line().contains("\"at\""), "{}", v1.to_line());
        // A client reads replies of both versions, and no other.
        for v in [1, 2] {
            let line = format!("{{\"v\":{v},\"ok\":{{}}}}");
            assert_eq!(parse_reply(line.as_bytes()).unwrap().v, v);
        }
        assert!(parse_reply(br#"{"v":3,"ok":{}}"#).is_err());
        // What a version 1 topod answers to a version 2 request, and nothing else, is a
        // refusal of the version.
        let old = parse_reply(br#"{"v":1,"error":{"code":"bad_request","message":"protocol version 2 is not supported; this topod speaks version 1"}}"#).unwrap();
        assert!(refuses_newer_version(&old));
        let other = Reply::error(ErrorCode::BadRequest, "unknown field \"x\"").in_version(1);
        assert!(!refuses_newer_version(&other));
        let ours = Reply::error(ErrorCode::BadRequest, ProtoError::Version { got: 2 }.to_string());
        assert!(!refuses_newer_version(&ours), "this build speaks 2: its reply is v2");
    }

    #[test]
    fn the_admin_socket_sits_beside_the_public_one() {
        let p = |s: &str| admin_socket_for(std::path::Path::new(s)).display().to_string();
        assert_eq!(p("/run/topo/topod.sock"), "/run/topo/topod-admin.sock");
        assert_eq!(p("/tmp/x/s"), "/tmp/x/s-admin");
    }

    #[test]
    fn an_allocate_reads_gpus_counted_per_numa_node_strictly() {
        let line = r#"{"v":2,"op":"allocate","job":"1","request":"affinity[core:gpus=2]","gpus_by_numa":[{"numa":0,"count":1},{"numa":1,"count":1}]}"#;
        let Op::Allocate(args) = parse_request(line.as_bytes()).unwrap().op else { panic!() };
        assert_eq!(
            args.gpus_by_numa,
            vec![NumaGpus { numa: 0, count: 1 }, NumaGpus { numa: 1, count: 1 }]
        );
        let e = |s: &str| parse_request(s.as_bytes()).unwrap_err().to_string();
        let extra = r#"{"v":2,"op":"allocate","job":"1","request":"r","gpus_by_numa":[{"numa":0,"count":1,"gpu":"x"}]}"#;
        assert!(e(extra).contains("unknown field `gpu`"), "{}", e(extra));
        let negative = r#"{"v":2,"op":"allocate","job":"1","request":"r","gpus_by_numa":[{"numa":-1,"count":1}]}"#;
        assert!(e(negative).contains("invalid value"), "{}", e(negative));
    }

    #[test]
    fn bad_lines_say_what_is_wrong() {
        let e = |s: &str| parse_request(s.as_bytes()).unwrap_err().to_string();
        assert!(e("").contains("empty"));
        assert!(e("{\"v\":1,\"op\":\"version\"").contains("not JSON"));
        assert!(e("[1,2]").contains("JSON object"));
        assert!(e("{\"op\":\"version\"}").contains("missing protocol version"));
        assert!(e("{\"v\":3,\"op\":\"version\"}")
            .contains("version 3 is not supported; this topod speaks versions 1 to 2"));
        assert!(e("{\"v\":0,\"op\":\"version\"}").contains("version 0 is not supported"));
        assert!(e("{\"v\":1,\"op\":\"format_disk\"}")
            .contains("unknown operation \"format_disk\"; expected one of version"));
        assert!(e("{\"v\":1}").contains("missing operation"));
        assert!(e("{\"v\":1,\"op\":\"release\"}").contains("job"));
        assert!(e("{\"v\":1,\"op\":\"join\",\"job\":\"1\",\"pid\":\"x\"}").contains("invalid type"));
        assert!(e("{\"v\":1,\"op\":\"list\",\"extra\":true}").contains("unknown field"));
        assert!(e("{\"v\":1,\"op\":\"release\",\"job\":\"1\",\"job\":\"2\"}")
            .contains("field \"job\" is given twice"));
        assert!(e("{\"v\":1,\"v\":1,\"op\":\"list\"}").contains("given twice"));
        assert!(
            e("{\"v\":1.0,\"op\":\"list\"}").contains("whole number"),
            "{}",
            e("{\"v\":1.0,\"op\":\"list\"}")
        );
        assert!(e("{\"v\":\"1\",\"op\":\"list\"}").contains("whole number"));
        let long =
            format!("{{\"v\":1,\"op\":\"release\",\"job\":\"{}\"}}", "a".repeat(MAX_LINE_BYTES));
        assert!(e(&long).contains("longer than the limit"));
        assert!(matches!(
            parse_request(b"{\"v\":1,\"op\":\"li\xffst\"}"),
            Err(ProtoError::NotText(_))
        ));
    }

    proptest! {
        #[test]
        fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = parse_request(&bytes);
            let _ = parse_reply(&bytes);
        }

        #[test]
        fn truncated_valid_lines_are_refused(cut in 0usize..60) {
            let line = Request::new(Op::Release { job: "123".into() }).to_line();
            let cut = cut.min(line.len() - 2);
            prop_assert!(parse_request(&line.as_bytes()[..cut]).is_err());
        }
    }
}
