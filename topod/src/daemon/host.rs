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
mod gpus;
mod moves;
mod notify;
mod pools;
mod preempt;
mod recover;
mod reserve;
mod settle;
mod snapshot;
mod space;
pub use moves::check_resize_signal;
pub use pools::{make_pools, PoolConfig};
pub use recover::Recovery;
pub use reserve::MAX_RESERVATION_S;
pub use settle::KernelWork;
pub use snapshot::Snapshot;
/// Defragmenting migration's settings (topod.toml `defrag`, `migrate_min_run_s`,
/// `migrate_gap_s`): the policy core's, whose rule for when a job may be moved both apply.
pub use topo_core::policy::Defrag;
use topo_core::policy::{RunClock, Stopper};
use topo_core::proto;

pub use super::records::{JobAsk, JobRecord};
use super::records::{Records, RecordsError};
use crate::cgroup::{
    CgroupBackend, CgroupError, CgroupSpec, CharDevice, JobId, JobIdError, ReleaseReport,
};
use serde::Serialize;
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
    /// A request that cannot be run here (CPUs this host does not have, a task count out of
    /// range).
    #[error("bad request: {0}")]
    BadRequest(String),
    /// A request string that does not parse, and where ([`request::RequestError`]'s span).
    #[error("bad request: {0}")]
    Unparsable(request::RequestError),
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
    /// A pid that names no other process (0 and below mean the writer itself to the kernel), the
    /// host's init, or a process the kernel will not move (a kernel thread).
    #[error("pid {0} is not a process topod can move into a job (not 0 or below, which name the writer, not 1, the host's init, not a kernel thread, not topod's own)")]
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
    /// An owner's resume of a job whose CPUs a job suspended by preemption waits for.
    #[error("job {job} stays suspended: {why}; that job resumes first, then job {job} may (its owner's suspension may not keep a job suspended by preemption waiting; root, an administrator or the batch system may still resume it now)")]
    WaitedFor {
        /// The job.
        job: String,
        /// Which CPUs, waited for by which job.
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

/// A request checked against this host and ready to place. Preparing takes no lock: parsing
/// a 64 KiB request must not hold up other clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepared {
    /// The request, with the task count and the batch system's CPUs folded in.
    pub request: Request,
    /// What the job asks, as its record keeps it: [`JobAsk::request`] is the canonical text of
    /// [`Prepared::request`], which is what the ledger and the record keep.
    pub ask: JobAsk,
    /// What the allocate said about gang scheduling.
    pub gang: GangAsk,
    /// When it does not fit, it may suspend running preemptible jobs (see [`Host::set_preempt`]).
    pub preempt: bool,
    /// The batch system starts the job suspended (see `host/follow.rs`).
    pub starts_suspended: bool,
    /// The allocate came with the batch system's view of the host (`batch`, or
    /// `starts_suspended`): only such a job may borrow the CPUs of a job the batch system
    /// suspended (see `host/follow.rs`).
    pub follows_batch: bool,
    /// A job given GPUs without `gpubind=`: the CPUs of their NUMA nodes (among those it may
    /// use), where its placement tries first.
    pub near_gpus: Option<CpuSet>,
    /// topod chose its GPUs (`gpus=`, see `host/gpus.rs`): it is placed on [`Self::near_gpus`]
    /// only, or does not fit.
    pub near_only: bool,
    /// Its GPUs by NUMA node (the node's CPUs, how many of its GPUs are there) when they lie
    /// in several: each node's share of its tasks is placed beside them first
    /// ([`topo_core::gpus::place_split`]). Empty otherwise.
    pub gpu_nodes: Vec<(CpuSet, usize)>,
    /// How many GPUs topod is to choose in each NUMA node (node id, count), as the batch
    /// system counted them (`allocate`'s `gpus_by_numa`; see `host/gpus.rs`). Empty: where
    /// topod finds best.
    pub gpus_by_numa: Vec<(u32, u32)>,
}

impl Prepared {
    /// The same job given the GPUs `names` (PCI addresses or OS names, as [`Topology::device`]
    /// reads them) by the batch system: with `gpubind=numa` or `socket` its CPUs are kept to
    /// the NUMA nodes or packages of those GPUs (folded into its CPU list, so that every later
    /// placement, resize and restart keeps them there); without `gpubind=` those CPUs are where
    /// its placement tries first ([`Prepared::near_gpus`]); `gpubind=any` keeps none. A name
    /// this host has no device for, a GPU given twice, or a binding the GPUs' locality cannot
    /// meet is refused, naming it. `gpubind=` without GPUs binds nothing (logged).
    pub fn with_gpus(mut self, topo: &Topology, names: &[String]) -> Result<Self, HostError> {
        if names.is_empty() {
            // With gpus= topod chooses them, and binds then (`host/gpus.rs`).
            if let (Some(bind @ (request::GpuBind::Numa | request::GpuBind::Socket)), None) =
                (self.request.gpubind, self.request.gpus_per_task)
            {
                tracing::info!(
                    "request {}: gpubind={} binds nothing: the batch system gave the job no GPUs",
                    self.ask.request,
                    bind.name()
                );
            }
            return Ok(self);
        }
        let mut devices: Vec<&topo_core::topology::IoDevice> = Vec::new();
        for name in names {
            let Some(device) = topo.device(name) else {
                let known: Vec<String> = topo
                    .devices
                    .iter()
                    .filter(|d| d.class != topo_core::topology::DeviceClass::Other)
                    .map(|d| match d.names.first() {
                        // A name is a sysfs file name: it may hold a newline, which would
                        // split the one-line reply a batch system shows.
                        Some(n) => format!("{} ({})", d.pci_address, crate::picture::printable(n)),
                        None => d.pci_address.clone(),
                    })
                    .collect();
                // A host may have thousands of functions (SR-IOV): name a few.
                const SHOWN: usize = 16;
                let listed = match known.len() {
                    0 => "none".to_string(),
                    n if n <= SHOWN => known.join(", "),
                    n => format!("{}, and {} more", known[..SHOWN].join(", "), n - SHOWN),
                };
                return Err(HostError::BadArgument(format!(
                    "gpus: this host has no PCI device {name:?} (give a PCI address or a name `topoctl show` lists; its devices: {listed})"
                )));
            };
            if devices.iter().any(|d| d.pci_address == device.pci_address) {
                return Err(HostError::BadArgument(if *name == device.pci_address {
                    format!("gpus: GPU {name} is named twice")
                } else {
                    format!("gpus: {name:?} names {} a second time", device.pci_address)
                }));
            }
            devices.push(device);
        }
        self.ask.gpus = devices.iter().map(|d| d.pci_address.clone()).collect();
        let bind = self.request.gpubind;
        if bind == Some(request::GpuBind::Any) {
            return Ok(self);
        }
        self.gpu_nodes = topo_core::gpus::nodes_of_devices(topo, devices.iter().copied());
        let level = match bind {
            Some(request::GpuBind::Socket) => request::Level::Socket,
            _ => request::Level::Numa,
        };
        let mut near = CpuSet::new();
        for device in &devices {
            match topo.cpus_near(device, level) {
                Some(cpus) => near.union_with(&cpus),
                None if bind.is_some() => {
                    let why = match device.numa_node {
                        None => "its numa_node is -1 and it lists no local CPUs".to_string(),
                        Some(n) => format!("its NUMA node {n} is not one of this host's with CPUs near it, and it lists no local CPUs"),
                    };
                    return Err(HostError::BadRequest(format!(
                        "gpubind={}: which CPUs are near GPU {} is not known on this host ({why}); give gpubind=any",
                        bind.map_or("numa", request::GpuBind::name),
                        device.pci_address
                    )));
                }
                // Best effort: one GPU of unknown place makes no CPU nearer than another.
                None => return Ok(self),
            }
        }
        let mut kept = self.request.clone();
        let inside = match &kept.cpu_list {
            Some(list) => list.intersection(&near),
            None => near.intersection(&topo.allowed),
        };
        if inside.is_empty() {
            if bind.is_none() {
                return Ok(self);
            }
            return Err(HostError::BadRequest(format!(
                "gpubind={}: the CPUs near GPUs {} ({near}) are none of those the job may use ({})",
                bind.map_or("numa", request::GpuBind::name),
                self.ask.gpus.join(", "),
                kept.cpu_list.as_ref().map_or_else(|| topo.allowed.to_string(), |l| l.to_string())
            )));
        }
        if bind.is_some() {
            kept.cpu_list = Some(inside);
            self.ask.request = kept.to_string();
            self.request = kept;
        } else {
            self.near_gpus = Some(inside);
        }
        Ok(self)
    }
}

/// `names` with every character device replaced by the PCI address of the device behind it,
/// found under the root `topo` was read from (this host's `/` for an hwloc XML file); other
/// names are kept. A character device is named by its number, `char:MAJOR:MINOR` (what the
/// batch system's plug-ins send: they stat the file in the job's view of `/dev`, which under
/// the systemd unit's PrivateDevices= is not topod's), or by a device file (a path:
/// `/dev/dri/card1`, `/dev/nvidia0`) that topod stats itself. A path that is not a character
/// device, or a device on no PCI function this host lists, is refused naming it.
pub fn device_files_to_pci(topo: &Topology, names: &[String]) -> Result<Vec<String>, HostError> {
    use std::os::unix::fs::FileTypeExt;
    let source = std::path::Path::new(&topo.source);
    let root = if source.is_dir() { source } else { std::path::Path::new("/") };
    names
        .iter()
        .map(|name| {
            let refused = |why: String| HostError::BadArgument(format!("gpus: {name}: {why}"));
            let (major, minor) = if let Some(number) = name.strip_prefix("char:") {
                parse_char_device(number).ok_or_else(|| {
                    refused("a character device is named char:MAJOR:MINOR (major below 4096, minor below 1048576), e.g. char:195:0".into())
                })?
            } else if name.starts_with('/') {
                let meta = std::fs::metadata(name).map_err(|e| refused(e.to_string()))?;
                if !meta.file_type().is_char_device() {
                    return Err(refused("not a character device".into()));
                }
                let rdev = std::os::unix::fs::MetadataExt::rdev(&meta);
                (nix::sys::stat::major(rdev) as u32, nix::sys::stat::minor(rdev) as u32)
            } else {
                return Ok(name.clone());
            };
            let found = topo_core::topology::sysfs::pci_function_of_char_device(root, major, minor);
            if let Some(address) = found.as_deref().filter(|a| topo.device(a).is_none()) {
                return Err(refused(format!(
                    "character device {major}:{minor} is on PCI function {address}, which is none of the devices this host lists (topoctl show)"
                )));
            }
            found.ok_or_else(|| {
                let under = root.join("sys/dev/char");
                refused(format!(
                    "character device {major}:{minor} is on no PCI function ({} and proc/driver/nvidia say none)",
                    under.display()
                ))
            })
        })
        .collect()
}

/// The character devices of the host's GPUs and accelerators, each with its PCI function, read
/// under the root `topo` came from (this host's `/` for an hwloc XML file) each time: a driver
/// loaded after topod started (nvidia-modprobe) adds device files, and a GPU that appeared
/// after (hot-plug, SR-IOV functions made later), which no job can be given until topod reads
/// the host again, is judged by its class and vendor as read now, so that every job is denied it.
fn gpu_devices(topo: &Topology) -> Vec<(CharDevice, String)> {
    use topo_core::topology::sysfs;
    let source = std::path::Path::new(&topo.source);
    let root = if source.is_dir() { source } else { std::path::Path::new("/") };
    sysfs::char_devices_on_pci(root)
        .into_iter()
        .filter(|(_, _, address)| match topo.device(address) {
            Some(device) => topo_core::gpus::is_for_jobs(device),
            None => sysfs::pci_function_now(root, address)
                .is_some_and(|device| topo_core::gpus::is_for_jobs(&device)),
        })
        .map(|(major, minor, address)| (CharDevice { major, minor }, address))
        .collect()
}

/// Says at start which device files confinement keeps jobs to, and warns where the host lists
/// GPUs none of which has a device file (their driver not loaded yet: until it is, nothing is
/// denied).
fn log_gpu_devices(topo: &Topology) {
    let devices = gpu_devices(topo);
    if devices.is_empty() {
        let gpus: Vec<&str> = topo_core::gpus::gpu_indices(topo)
            .into_iter()
            .map(|g| topo.devices[g].pci_address.as_str())
            .collect();
        if !gpus.is_empty() {
            tracing::warn!(
                "confine_devices: none of this host's GPUs and accelerators ({}) has a device file yet (is its driver loaded?); each job's device rules are made again as it is allocated, joined or found at start",
                gpus.join(", ")
            );
        }
        return;
    }
    let listed: Vec<String> =
        devices.iter().map(|(d, a)| format!("{}:{} ({a})", d.major, d.minor)).collect();
    tracing::info!(
        "confine_devices: a job may open only its own of these GPU and accelerator device files: {}",
        listed.join(", ")
    );
}

/// `MAJOR:MINOR` in decimal, as `ls -l` and `/sys/dev/char` write a device number.
fn parse_char_device(text: &str) -> Option<(u32, u32)> {
    let (major, minor) = text.split_once(':')?;
    let number = |t: &str| {
        (!t.is_empty() && t.bytes().all(|b| b.is_ascii_digit())).then(|| t.parse().ok()).flatten()
    };
    Some((number(major)?, number(minor)?))
        .filter(|&(a, i)| topo_core::topology::sysfs::is_device_number(a, i))
}

/// What an `allocate` says about preemption, in one value: tests set it on a [`Prepared`] the
/// way the server does from the protocol's fields.
#[cfg(test)]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PreemptAsk {
    pub preempt: bool,
    pub preemptible: bool,
    pub submitted_at: Option<i64>,
    pub estimate_s: Option<u64>,
}

#[cfg(test)]
impl PreemptAsk {
    /// `prepared` with what `ask` says.
    pub(crate) fn apply(ask: PreemptAsk, prepared: &mut Prepared) {
        prepared.preempt = ask.preempt;
        prepared.ask.preemptible = ask.preemptible;
        prepared.ask.submitted_at = ask.submitted_at;
        prepared.ask.estimate_s = ask.estimate_s;
    }
}

/// What an `allocate` says about gang time slicing (see [`GangConfig`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GangAsk {
    /// Gang-scheduled (`Some(true)`), not (`Some(false)`), or as configured (`None`).
    pub gang: Option<bool>,
    /// The row to take (so that every host of a multi-host job uses the same one).
    pub row: Option<u32>,
    /// Runs through every slice, whatever the configuration says (as do the jobs of the
    /// configured prime queues: [`JobAsk::queue`]).
    pub prime: bool,
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
    let mut req = request::parse(text).map_err(HostError::Unparsable)?;
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
            ask: JobAsk { request: canonical, ..JobAsk::default() },
            gang: GangAsk::default(),
            preempt: false,
            starts_suspended: false,
            follows_batch: false,
            near_gpus: None,
            near_only: false,
            gpu_nodes: Vec::new(),
            gpus_by_numa: Vec::new(),
        }),
        Ok(again) => Err(HostError::BadRequest(format!(
            "{text:?} cannot be recorded: it becomes {canonical:?}, which reads back as {again}"
        ))),
        Err(e) => Err(HostError::BadRequest(format!(
            "{text:?} cannot be recorded: it becomes {canonical:?}, which does not read back: {e}"
        ))),
    }
}

impl Prepared {
    /// What an `allocate` asks, read once from the wire for a host with topology `topo`: the
    /// request ([`prepare`], keeping its parsed form and the position of a parse error), the
    /// GPUs the batch system gave, and every field a rule reads later, checked here (a queue or
    /// pool name, the resize signal, the times preemption needs, the batch system's view) so
    /// that nothing past this point sees a field it has not. The job id, memory limit, process
    /// to join and the batch system's view stay the caller's: they are not what the job asks
    /// of the host but how this one request is carried out.
    pub fn from_allocate(topo: &Topology, args: &proto::AllocateArgs) -> Result<Self, HostError> {
        let resize_signal = args
            .resize_signal
            .map(check_resize_signal)
            .transpose()
            .map_err(HostError::BadArgument)?;
        // The request first: its error says where in it, and no device file is looked at for a
        // request refused anyway.
        let prepared = prepare(topo, &args.request, args.tasks, args.cpus.as_deref())?;
        let gpus = device_files_to_pci(topo, &args.gpus)?;
        let mut prepared = prepared.with_gpus(topo, &gpus)?;
        for (field, value) in [("queue", &args.queue), ("pool", &args.pool)] {
            if let Some(Err(why)) = value.as_deref().map(|v| proto::check_name(field, v)) {
                return Err(HostError::BadArgument(why));
            }
        }
        let (submitted_at, estimate_s) = (args.submitted_at, args.estimate_s);
        if (args.preempt || args.preemptible) && (submitted_at.is_none() || estimate_s.is_none()) {
            return Err(HostError::BadArgument(
                "preempt and preemptible need submitted_at (seconds since the epoch) and estimate_s (the job's time limit): a job's expansion factor comes from them".into(),
            ));
        }
        if submitted_at.is_some_and(|t| t <= 0) || estimate_s == Some(0) {
            return Err(HostError::BadArgument(
                "submitted_at is seconds since the epoch (above 0) and estimate_s the job's time limit in seconds (at least 1; a job without a limit is not preemptible and cannot preempt)".into(),
            ));
        }
        if let Some(Err(why)) = args.batch.as_ref().map(proto::BatchView::check) {
            return Err(HostError::BadArgument(why));
        }
        prepared.gpus_by_numa = gpus_by_numa(topo, &prepared, args)?;
        prepared.ask = JobAsk {
            owner_uid: args.owner_uid,
            preemptible: args.preemptible,
            submitted_at,
            estimate_s,
            resize_signal,
            queue: args.queue.clone(),
            pool: args.pool.clone(),
            ..prepared.ask
        };
        prepared.gang = GangAsk { gang: args.gang, row: args.gang_row, prime: args.prime };
        prepared.preempt = args.preempt;
        prepared.starts_suspended = args.starts_suspended;
        prepared.follows_batch = args.starts_suspended || args.batch.is_some();
        Ok(prepared)
    }
}

/// `allocate`'s `gpus_by_numa` checked against the host and the request: each node one of the
/// host's, named once, with at least one GPU; not beside `gpus` (GPUs named leave nothing to
/// choose); adding up to the GPUs the request asks for.
fn gpus_by_numa(
    topo: &Topology,
    prepared: &Prepared,
    args: &proto::AllocateArgs,
) -> Result<Vec<(u32, u32)>, HostError> {
    let counts = &args.gpus_by_numa;
    if counts.is_empty() {
        return Ok(Vec::new());
    }
    let bad = |why: String| Err(HostError::BadArgument(format!("gpus_by_numa: {why}")));
    if !args.gpus.is_empty() {
        return bad(
            "counts GPUs for topod to choose, but gpus names them already; give one or the other"
                .into(),
        );
    }
    let mut seen: Vec<(u32, u32)> = Vec::with_capacity(counts.len());
    for c in counts {
        if !topo.numa_nodes.iter().any(|n| n.os_index == c.numa) {
            let nodes: Vec<String> =
                topo.numa_nodes.iter().map(|n| n.os_index.to_string()).collect();
            return bad(format!(
                "this host has no NUMA node {} (its nodes: {})",
                c.numa,
                nodes.join(", ")
            ));
        }
        if c.count == 0 {
            return bad(format!("NUMA node {} is given 0 GPUs; leave it out", c.numa));
        }
        if seen.iter().any(|(n, _)| *n == c.numa) {
            return bad(format!("NUMA node {} is named twice", c.numa));
        }
        seen.push((c.numa, c.count));
    }
    let counted: u64 = seen.iter().map(|(_, c)| u64::from(*c)).sum();
    let said: Vec<String> = seen.iter().map(|(n, c)| format!("{c} in node {n}")).collect();
    let request = &prepared.request;
    let Some(wanted) = request.gpus_wanted() else {
        return bad(format!(
            "counts {counted} GPU(s) ({}), but the request {} asks for none (gpus=)",
            said.join(", "),
            prepared.ask.request
        ));
    };
    if counted != wanted as u64 {
        return bad(format!(
            "counts {counted} GPU(s) ({}), but the request asks for gpus={} per task for {} task(s): {wanted}",
            said.join(", "),
            request.gpus_per_task.unwrap_or(0),
            request.tasks.unwrap_or(topo_core::place::DEFAULT_TASKS)
        ));
    }
    Ok(seen)
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

/// A join the kernel refused with EINVAL at `cgroup.procs`: the process is one no cgroup may
/// take (a kernel thread), said as such rather than as an internal error.
fn kernel_thread_or(e: CgroupError, pid: i32) -> HostError {
    match &e {
        CgroupError::Io { source, path, .. }
            if source.raw_os_error() == Some(libc::EINVAL)
                && path.file_name().is_some_and(|n| n == "cgroup.procs") =>
        {
            HostError::BadPid(pid)
        }
        _ => HostError::Cgroup(e),
    }
}

/// What a "does not fit" message is about: the job, or for `fit` the request.
fn fit_subject(job: &str) -> String {
    if job.is_empty() {
        "the request".to_string()
    } else {
        format!("job {job}")
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
    /// Its fingerprint, computed once (the free map carries it).
    topology_id: u64,
    model: Arc<HostModel>,
    /// CPUs configuration keeps from jobs.
    reserved: CpuSet,
    /// CPUs other exclusive cpusets hold, as last seen.
    foreign: CpuSet,
    ledger: Ledger,
    hints: BTreeMap<String, JobRecord>,
    backend: Arc<dyn CgroupBackend>,
    records: Option<Records>,
    strategy: Strategy,
    release_timeout: Duration,
    /// Jobs whose release is under way (their CPUs stay held until it ends).
    releasing: BTreeSet<String>,
    /// Jobs being suspended or resumed, and which.
    changing: BTreeMap<String, &'static str>,
    /// The freezes and thaws decided and not yet done (see [`settle`]).
    settling: settle::Settling,
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
    /// Preemption: its rules, when allocates may suspend jobs, and those under way (see
    /// [`preempt`]).
    preemption: preempt::Preemption,
    /// What topod counts for its metrics (allocations, releases, requests).
    metrics: Arc<super::metrics::Metrics>,
    /// Jobs the sampler found mis-sized, until their release.
    missized: BTreeMap<String, Missized>,
    /// Whether the backend confines devices (see [`Host::device_rules`]).
    confine_devices: bool,
    /// Where jobs' notify files go (see [`moves`]).
    notify_dir: Option<PathBuf>,
    /// Topology reservations (see [`reserve`]).
    reservations: reserve::Blocks,
    /// Prime-time pools (see [`pools`]).
    pools: pools::PrimePools,
    /// Malleable jobs share what rigid jobs leave equally (see [`space`]).
    equipartition: bool,
    /// Defragmenting migration, when on (see [`space`]).
    defrag: Option<Defrag>,
    /// Tells Slurm and PBS of the CPUs topod changed in their running jobs, when set.
    batch_reporter: Option<super::batch_report::BatchReporter>,
    /// A batch system's GPU counts by NUMA node were found not to be this host's since the
    /// start (said once, `host/gpus.rs`).
    counts_not_followed: std::sync::atomic::AtomicBool,
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
        let confine_devices = backend.confines_devices();
        if confine_devices && backend.kind() == "fake" {
            tracing::warn!("confine_devices: the fake cgroup backend confines nothing (it only keeps each job's device rules in memory)");
        } else if confine_devices {
            log_gpu_devices(&topo);
        }
        Ok(Host {
            confine_devices,
            topology_id: topo.fingerprint(),
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
            settling: settle::Settling::default(),
            freeze_timeout: Duration::from_secs(5),
            joined: Default::default(),
            self_join_offered: Default::default(),
            gang: None,
            gang_status: None,
            clock: Arc::new(std::time::SystemTime::now),
            preemption: preempt::Preemption::default(),
            metrics: Default::default(),
            missized: BTreeMap::new(),
            notify_dir: None,
            reservations: reserve::Blocks::default(),
            pools: pools::PrimePools::default(),
            equipartition: false,
            defrag: None,
            batch_reporter: None,
            counts_not_followed: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Lets an allocate that asks (`preempt`) suspend running jobs that said they may be
    /// (`preemptible`) when it does not fit, by `rules` (see `topo_core::policy::Preempt`); off
    /// with `None`.
    pub fn set_preempt(&mut self, rules: Option<topo_core::policy::Preempt>) {
        self.preemption.rules = rules;
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
        let ends_by = self.hints.get(job).and_then(JobRecord::estimated_end);
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
            self.reservations.all(),
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
            .others_live(job, now)
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
        for (pool, _) in
            self.pools.list().iter().zip(open).filter(|(p, open)| *open && !p.admits(who))
        {
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

    /// What a job given the GPUs at `gpus` (PCI addresses) may not open, where the backend
    /// confines devices: every other GPU's and accelerator's device files (a job given none
    /// may open none). Device files on no GPU's PCI function (`/dev/nvidiactl`,
    /// `/dev/nvidia-uvm`) stay open to all, as under Slurm's ConstrainDevices.
    pub fn denied_devices(&self, gpus: &[String]) -> Vec<CharDevice> {
        self.device_rules(gpus).0
    }

    /// The device files of the host's GPUs and accelerators a job given `gpus` may not open,
    /// and those it may (its own); both empty where devices are not confined.
    fn device_rules(&self, gpus: &[String]) -> (Vec<CharDevice>, Vec<CharDevice>) {
        if !self.confine_devices {
            return (Vec::new(), Vec::new());
        }
        let (own, others): (Vec<_>, Vec<_>) =
            gpu_devices(&self.topo).into_iter().partition(|(_, address)| gpus.contains(address));
        (others.into_iter().map(|d| d.0).collect(), own.into_iter().map(|d| d.0).collect())
    }

    /// Makes `job`'s device rules match its GPUs (those its record keeps; none when it has no
    /// record) before a process joins it, and at start: its devices cgroup may be missing (a
    /// job from before devices were confined, a release cut short, an administrator's rmdir)
    /// or a driver may have added device files since.
    fn sync_device_rules(&self, id: &JobId) -> Result<(), HostError> {
        if !self.confine_devices {
            return Ok(());
        }
        let gpus = self.hints.get(id.as_str()).map(|h| h.ask.gpus.clone()).unwrap_or_default();
        let (denied, allowed) = self.device_rules(&gpus);
        self.backend.set_device_rules(id, &denied, &allowed)?;
        Ok(())
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

    /// The row `ask` puts a new job of batch queue `queue` in, as a list of rows to try in
    /// order; `None` when the job is not gang-scheduled.
    fn gang_rows_for(
        &self,
        job: &str,
        ask: &GangAsk,
        queue: Option<&str>,
    ) -> Result<Option<Vec<u32>>, HostError> {
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
        let prime = ask.prime || queue.is_some_and(|q| cfg.prime_queues.iter().any(|p| p == q));
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
        let hash = topo_core::topology::fnv1a(job.as_bytes());
        Ok(Some(vec![(hash % u64::from(rows)) as u32]))
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
        let chosen = self.choose_gpus(job, prepared, owner_uid)?;
        let prepared = chosen.as_ref().unwrap_or(prepared);
        if chosen.is_none() && !prepared.ask.gpus.is_empty() {
            // The batch system's word on its GPUs stands (Slurm shares one GPU between jobs
            // with its shard and mps gres), but a GPU another job holds is worth a line.
            for (other, hint) in self.hints.iter().filter(|(other, _)| other.as_str() != job) {
                for gpu in prepared.ask.gpus.iter().filter(|g| hint.ask.gpus.contains(g)) {
                    tracing::warn!("job {job}: given GPU {gpu}, which job {other} holds too");
                }
            }
            let now = self.now_s();
            for r in self.reservations.others_live(job, now) {
                for gpu in prepared.ask.gpus.iter().filter(|g| r.gpus.contains(g)) {
                    tracing::warn!(
                        "job {job}: given GPU {gpu}, which job {}'s reservation holds; while this job holds it, job {} is given free GPUs instead of its reserved ones",
                        r.job,
                        r.job
                    );
                }
            }
        }
        if prepared.starts_suspended {
            return self.allocate_suspended(job, prepared, |host| {
                host.allocate_inner(job, prepared, mem_limit, owner_uid, asked)
            });
        }
        self.allocate_inner(job, prepared, mem_limit, owner_uid, asked)
    }

    /// When `job` was last allocated, if that was after `t` (see [`JobRecord::allocated_at`]).
    pub fn allocated_after(
        &self,
        job: &str,
        t: std::time::SystemTime,
    ) -> Option<std::time::SystemTime> {
        self.hints.get(job).and_then(JobRecord::allocated_time).filter(|at| *at > t)
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
        if let Some(pool) = prepared.ask.pool.as_ref().filter(|_| !self.pools.is_empty()) {
            if !self.pools.list().iter().any(|p| &p.name == pool) {
                let names: Vec<&str> = self.pools.list().iter().map(|p| p.name.as_str()).collect();
                return Err(HostError::BadArgument(format!(
                    "job {job}: pool {pool:?}: this host has no prime-time pool of that name (its pools: {})",
                    names.join(", ")
                )));
            }
        }
        let canonical = &prepared.ask.request;
        if self.ledger.is_suspended(id.as_str()) && !self.batch_suspended(id.as_str()) {
            // Its CPUs may be lent: answering them would give a step CPUs another job runs on.
            // (A job the batch system suspended shares them by the batch system's turns.)
            return Err(HostError::Suspended(job.to_string()));
        }
        if let Some(existing) = self.ledger.get(id.as_str()) {
            if &existing.request == canonical {
                // Asked again (each step, or a requeued job's new run): a new allocation time.
                let existing = existing.clone();
                let mut hint = self.hints.get(job).cloned().unwrap_or_else(|| JobRecord {
                    ask: JobAsk { request: existing.request.clone(), ..JobAsk::default() },
                    tasks: existing.tasks.clone(),
                    ..JobRecord::default()
                });
                // Each step names its own GPUs (Slurm's SLURM_STEP_GPUS), all the job's: the
                // job has every GPU any of its allocates named, and may open each of them.
                let added: Vec<String> = prepared
                    .ask
                    .gpus
                    .iter()
                    .filter(|g| !hint.ask.gpus.contains(g))
                    .cloned()
                    .collect();
                if !added.is_empty() && prepared.request.gpus_per_task.is_some() {
                    // Its gpus= fixed how many it holds.
                    return Err(HostError::BadRequest(format!(
                        "job {job} holds GPU(s) {} for its request's gpus=; this allocate names {}",
                        hint.ask.gpus.join(", "),
                        prepared.ask.gpus.join(", ")
                    )));
                }
                if !added.is_empty() {
                    hint.ask.gpus.extend(added.iter().cloned());
                    tracing::info!(
                        "job {job}: also given GPU(s) {} (its CPUs stay where they are)",
                        added.join(", ")
                    );
                    let (denied, allowed) = self.device_rules(&hint.ask.gpus);
                    self.backend.set_device_rules(&id, &denied, &allowed)?;
                }
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
                let hint = JobRecord {
                    // What this allocate says of the job, as a new one's record would keep it.
                    ask: JobAsk { owner_uid, ..prepared.ask.clone() },
                    tasks: adopted.tasks.clone(),
                    allocated_at: Some(asked),
                    clock: RunClock::found(self.now_s(), suspended),
                    suspended,
                    suspended_by: None,
                    gang_row: adopted.gang_row,
                    tasks_unknown,
                    ..JobRecord::default()
                };
                // Its device rules as its GPUs now say (made at start with none known).
                let (denied, allowed) = self.device_rules(&hint.ask.gpus);
                self.backend.set_device_rules(&id, &denied, &allowed)?;
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
        if let Some(under_way) = self.preemption.under_way.remove(job) {
            if under_way.freezing(self) {
                // Asked again by someone else while its victims freeze: not twice.
                self.preemption.under_way.insert(job.to_string(), under_way);
                return Err(HostError::Changing {
                    job: job.to_string(),
                    what: "being started: the jobs it preempts are being suspended",
                });
            }
            let placed = self.place_preemptor(&id, prepared, mem_limit, owner_uid, under_way);
            return self.allocated(&id, prepared, (mem_limit, owner_uid), None, asked, placed);
        }
        let rows = self.gang_rows_for(job, &prepared.gang, prepared.ask.queue.as_deref())?;
        // A malleable arrival starts at its share: the malleable jobs first shrink to the shares
        // equipartition gives them beside it, so that it is placed whole at its size (one
        // placement, no grow right after), as the policy core starts one.
        let shrunk_for_it = rows.is_none()
            && self.equipartition
            && prepared.request.is_malleable()
            && match self.fits_with_mins(job, prepared, owner_uid) {
                Some(arrival @ space::Arrival::Malleable(_)) => self.shrink_for_arrival(arrival),
                _ => false,
            };
        let mut first = self.place_and_create(&id, prepared, mem_limit, owner_uid, rows.as_deref());
        // Whether the malleable jobs were shared out again after a failed try (once per
        // allocate: each resize is told to the job).
        let mut rebalanced = false;
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
                // (Shrunk to these shares already for a malleable arrival: not again.)
                if !shrunk_for_it && self.shrink_for_arrival(arrival) {
                    first = self.place_and_create(&id, prepared, mem_limit, owner_uid, None);
                }
                if first.is_err() && self.shrink_to_mins() {
                    first = self.place_and_create(&id, prepared, mem_limit, owner_uid, None);
                }
                if first.is_err() {
                    self.rebalance();
                    rebalanced = true;
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
        if first.is_err() && shrunk_for_it && !rebalanced {
            // They take back what it did not: shared again without it.
            self.rebalance();
        }
        let first = match first {
            Err(refused @ HostError::DoesNotFit { .. })
                if prepared.preempt && rows.is_none() && self.preemption.rules.is_some() =>
            {
                self.preempt_and_place(&id, prepared, mem_limit, owner_uid, refused)
            }
            // It asked to preempt: say why that was not tried.
            Err(refused @ HostError::DoesNotFit { .. }) if prepared.preempt => Err(not_preempted(
                refused,
                if self.preemption.rules.is_none() {
                    "preemption is off on this host (preempt = false in topod.toml)"
                } else {
                    "a gang-scheduled job does not preempt (it waits for its row)"
                },
            )),
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
        let canonical = &prepared.ask.request;
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
        let hint = JobRecord {
            ask: JobAsk { owner_uid, ..prepared.ask.clone() },
            tasks: alloc.tasks.clone(),
            allocated_at: Some(asked),
            clock: RunClock::started(self.now_s()),
            suspended: false,
            suspended_by: None,
            gang_row: alloc.gang_row,
            preempted_by: None,
            notify_generation: 1,
            moved_at: None,
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
            "job {job}: allocated CPUs {}{}",
            alloc.cpus,
            if prepared.ask.gpus.is_empty() {
                String::new()
            } else {
                format!(" (given GPUs {})", prepared.ask.gpus.join(", "))
            }
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
            queue: prepared.ask.queue.as_deref(),
            owner: owner_uid,
            pool: prepared.ask.pool.as_deref(),
        };
        // A job with a reservation goes inside its block when it fits there, one a prime-time
        // pool admits inside the pool.
        let within = topo_core::gpus::within;
        let inside = |cpus: &CpuSet| within(&prepared.request, cpus);
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
            // Each of these first near the job's GPUs, when it was given some (best effort); a
            // malleable job goes there only at its largest size (not shrunk to its least beside
            // them while its CPUs could be more elsewhere).
            let bases = [inside_block.as_ref(), inside_pool.as_ref(), Some(&prepared.request)];
            // A preference never borrows a suspended job's CPUs (that is for a job that fits
            // nowhere else): the near tries go without lending only.
            let tries: Vec<(Request, bool)> = bases
                .into_iter()
                .flatten()
                .flat_map(|base| {
                    let near = prepared.near_gpus.as_ref().and_then(|near| within(base, near));
                    let near = near.map(|r| match r.tasks_max {
                        Some(max) => Request { tasks: Some(max), tasks_max: None, ..r },
                        None => r,
                    });
                    // Placed only beside GPUs topod chose (else others would be nearer).
                    let anywhere = (!prepared.near_only).then(|| (base.clone(), false));
                    near.map(|r| (r, true)).into_iter().chain(anywhere)
                })
                .collect();
            for (request, near) in &tries {
                let lending = if *near { None } else { Some(&occupancy) };
                let plain = without_lending.as_ref().unwrap_or(&occupancy);
                let first = if *near || without_lending.is_some() { Some(plain) } else { None };
                for occupancy in first.into_iter().chain(lending) {
                    // A job whose GPUs lie in several NUMA nodes: each node's share of its
                    // tasks beside them, when that fits.
                    let split = || {
                        topo_core::gpus::place_split(
                            &self.model,
                            occupancy,
                            request,
                            &prepared.gpu_nodes,
                            self.strategy,
                        )
                    };
                    let placed = match self.start_malleable(occupancy, request).or_else(split) {
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
            if let (Some(bind @ (request::GpuBind::Numa | request::GpuBind::Socket)), false) =
                (prepared.request.gpubind, prepared.ask.gpus.is_empty())
            {
                // Its CPU list came from its GPUs, not from the user: say so.
                held_back += &format!(
                    "; gpubind={} keeps it to CPUs {}, those near its GPUs {} that it may use",
                    bind.name(),
                    prepared.request.cpu_list.as_ref().map(|l| l.to_string()).unwrap_or_default(),
                    prepared.ask.gpus.join(", ")
                );
            }
            if let (true, Some(near)) = (prepared.near_only, &prepared.near_gpus) {
                held_back += &format!(
                    "; topod chose GPU(s) {} for its gpus=: it runs only on CPUs near them ({near})",
                    prepared.ask.gpus.join(", ")
                );
            }
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
            denied_devices: self.denied_devices(&prepared.ask.gpus),
        };
        if let Err(e) = self.backend.create(id, &spec) {
            // Nothing can have joined a cgroup that was never configured: remove what was made.
            let _ = self.backend.release(id, Duration::from_millis(100));
            return Err(e.into());
        }
        let inserted = match row {
            None => {
                self.ledger.allocate(id.as_str(), &placement, &prepared.ask.request).map(|_| ())
            }
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
                    request: prepared.ask.request.clone(),
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
        // Init moved in would take the whole host's confinement from the job's, and keep the
        // job from being released (it cannot be killed).
        if pid <= 1 || super::process::is_own(pid) {
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
        self.sync_device_rules(&id)?;
        if let Some((pending, _)) = self.self_join_offered.get_mut(job) {
            self.backend.join_unless_in(&id, pid).map_err(|e| kernel_thread_or(e, pid))?;
            *pending = pending.saturating_sub(1);
            if *pending == 0 {
                self.self_join_offered.remove(job);
            }
        } else {
            self.backend.join(&id, pid).map_err(|e| kernel_thread_or(e, pid))?;
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
        self.sync_device_rules(&id)?;
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
        hint.clock.stop(self.now_s(), Stopper::Outside);
        if self.ledger.get(&job).is_some_and(|a| a.gang_row.is_some()) {
            // Its CPUs are idle now: another row's job may run on them until the next slice.
            self.gang_switch(self.now());
        }
        self.record(&ticket.id, &hint);
        self.hints.insert(job.clone(), hint);
        tracing::info!(event = "suspended", job = %job, cpus = %cpus, "job {job}: suspended; CPUs {cpus} may be lent");
        Ok(topo_core::proto::reply::Suspend { job, cpus, frozen_after_us: ticket.micros() })
    }

    /// Starts resuming `job` (`by` its owner, or else by root, an administrator or the batch
    /// system): its CPUs are taken back now (refused while another job runs on any of them),
    /// then the caller runs the ticket and calls [`Host::finish_resume`].
    pub fn begin_resume(&mut self, job: &str, by: Option<u32>) -> Result<FreezeTicket, HostError> {
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
        // Its owner takes back no CPU a job suspended by preemption waits for (it ran there on
        // CPUs this job lent): that job would wait as long as this one ran, and this one could
        // then not be preempted.
        if by.is_some() {
            if let Some(why) = self.waited_for_by_preempted(job) {
                let _ = self.ledger.suspend(job);
                return Err(HostError::WaitedFor { job: job.to_string(), why });
            }
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
            // Preemption's suspension, undone by hand, restarts the job's protection as
            // topod's own resume would; any other does not.
            let after = match hint.preempted_by.take() {
                Some(_) => Stopper::Preemption,
                None => Stopper::Outside,
            };
            hint.batch_suspended = false;
            hint.clock.resume(self.now_s(), after);
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
        let ticket = self.begin_resume(job, None)?;
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
            Some(JobRecord { preempted_by: Some(p), .. }) => format!(
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

    /// Who suspended `job`, when it was its owner (see [`JobRecord::suspended_by`]).
    pub fn suspended_by(&self, job: &str) -> Option<u32> {
        self.hints.get(job).and_then(|h| h.suspended_by)
    }

    /// The uid allowed to join its own processes to `job`, if one was given at allocation.
    pub fn owner_of(&self, job: &str) -> Option<u32> {
        self.hints.get(job).and_then(|h| h.ask.owner_uid)
    }

    /// Would `request` fit now, and how well.
    pub fn fit(&self, request_text: &str, tasks: Option<u32>) -> Result<place::Fit, HostError> {
        let prepared = prepare(&self.topo, request_text, tasks, None)?;
        self.snapshot().fit(&prepared)
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

    fn write_record(&self, id: &JobId, hint: &JobRecord) -> Result<(), HostError> {
        match &self.records {
            Some(r) => r.write(id, hint).map_err(HostError::Records),
            None => Ok(()),
        }
    }

    /// Writes a record during recovery, where a failure is only logged (the cgroup is kept).
    fn record(&self, id: &JobId, hint: &JobRecord) {
        if let Err(e) = self.write_record(id, hint) {
            tracing::warn!("job {id}: {e}");
        }
    }
}

#[cfg(test)]
mod tests;
