//! Job cgroups: the one OS boundary topod crosses to confine a job.
//!
//! One trait, [`CgroupBackend`], with three implementations: [`v1::V1`] (separate `cpuset`, `cpu`,
//! `freezer` and `memory` hierarchies, as on most hybrid hosts), [`v2::V2`] (the unified
//! hierarchy: `cpuset.cpus`/`cpuset.mems`, `memory.max`, `cgroup.freeze`, `cgroup.kill`,
//! `cgroup.events`), and [`fake::Fake`] (in memory, for tests of the callers).
//!
//! Rules every backend keeps (kernel facts from `shared/reference/cgroups.md`):
//! - a job's cgroup is named by a validated [`JobId`] only, so no id can name a path outside
//!   our subtree;
//! - `cpus` and `mems` are written before any process joins (a v1 cpuset with no CPUs refuses
//!   tasks), and the effective values are read back;
//! - release freezes the job, kills every process, thaws, waits until the cgroup is empty, and
//!   removes it, in bounded time, reporting whatever would not die;
//! - the cgroup tree is the truth: [`CgroupBackend::list`] finds every job cgroup that exists, so
//!   a restarted daemon can rebuild its ledger.

pub mod devices_bpf;
pub mod fake;
#[cfg(test)]
pub(crate) mod fake_fs;
pub mod fs;
pub mod v1;
pub mod v2;

use fs::Files;

/// Where the kernel lists mounted file systems (`/proc/mounts` format); the backends take its
/// text as an argument, so tests give them a fake cgroup file system's.
pub const MOUNTS: &str = "/proc/self/mounts";

/// A cgroup backend topod can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// In memory ([`fake::Fake`]): jobs are not confined.
    Fake,
    /// [`v1::V1`].
    V1,
    /// [`v2::V2`].
    V2,
}

impl Kind {
    /// `auto`: v2 where the unified hierarchy in `mounts` offers the cpuset controller, else v1.
    pub fn auto(files: &Files, mounts: &str) -> Kind {
        let v2_with_cpuset = v2::v2_mount(mounts)
            .and_then(|m| files.read(&m.join("cgroup.controllers")).ok())
            .is_some_and(|c| c.split_whitespace().any(|x| x == "cpuset"));
        if v2_with_cpuset {
            Kind::V2
        } else {
            Kind::V1
        }
    }

    /// The directory of topod's `subtree` in the cpuset hierarchy (the one topod locks), if
    /// that hierarchy is mounted; none for the fake.
    pub fn subtree_dir(self, mounts: &str, subtree: &str) -> Option<PathBuf> {
        match self {
            Kind::Fake => None,
            Kind::V1 => v1::v1_mounts(mounts).0.map(|cpuset| cpuset.join(subtree)),
            Kind::V2 => v2::v2_mount(mounts).map(|m| m.join(format!("{subtree}.slice"))),
        }
    }

    /// The backend, on `subtree` of the hierarchies `mounts` names (v2: `<subtree>.slice`),
    /// through `files`; the fake's parent holds `cpus` and `mems`. With `options.cpu_groups`,
    /// each job is also a group of the CPU scheduler (v1: a directory in the `cpu` hierarchy,
    /// where mounted; v2: the `cpu` controller, where offered). With
    /// `options.confine_devices`, each job's denied devices are kept (v1: a directory in the
    /// `devices` hierarchy, which must be mounted; v2: a BPF program on the job's cgroup, see
    /// [`devices_bpf`]).
    pub fn open(
        self,
        files: Files,
        mounts: &str,
        subtree: &str,
        cpus: &CpuSet,
        mems: &CpuSet,
        options: OpenOptions,
    ) -> Result<Box<dyn CgroupBackend>, CgroupError> {
        Ok(match self {
            Kind::Fake => {
                let fake = fake::Fake::new(cpus.clone(), mems.clone());
                Box::new(if options.confine_devices { fake.confining_devices() } else { fake })
            }
            Kind::V1 => {
                let mut v1 = v1::V1::detect_in(files, mounts, subtree)?;
                let devices = v1::v1_devices_mount(mounts).map(|d| d.join(subtree));
                if options.confine_devices {
                    let devices = devices.ok_or_else(|| {
                        CgroupError::Unsupported(
                            "confine_devices needs the cgroup v1 devices hierarchy, which is not mounted (mount -t cgroup -o devices devices /sys/fs/cgroup/devices)".into(),
                        )
                    })?;
                    v1 = v1.with_devices(devices)?;
                } else {
                    v1 = v1.without_devices(devices);
                }
                let cpu = v1::v1_cpu_mount(mounts).map(|c| c.join(subtree));
                Box::new(if options.cpu_groups {
                    v1.with_cpu_groups(cpu)
                } else {
                    v1.without_cpu_groups(cpu)
                })
            }
            Kind::V2 => {
                let mut v2 = v2::V2::detect_in(files, mounts, &format!("{subtree}.slice"))?;
                if options.confine_devices {
                    v2 = v2.with_devices(std::sync::Arc::new(devices_bpf::Bpf))?;
                }
                Box::new(if options.cpu_groups {
                    v2.with_cpu_groups()
                } else {
                    v2.without_cpu_groups()
                })
            }
        })
    }
}

/// How [`Kind::open`] opens a backend (topod.toml's `cpu_groups` and `confine_devices`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpenOptions {
    /// Each job is a group of the CPU scheduler.
    pub cpu_groups: bool,
    /// Each job may open only its own GPUs' device files ([`CgroupSpec::denied_devices`]).
    pub confine_devices: bool,
}

pub use topo_core::jobid::{JobId, JobIdError};

use std::path::PathBuf;
use std::time::Duration;
use topo_core::cpuset::CpuSet;

/// What a job's cgroup gets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupSpec {
    /// Its CPUs.
    pub cpus: CpuSet,
    /// Its memory nodes.
    pub mems: CpuSet,
    /// Memory limit in bytes.
    pub memory_limit: Option<u64>,
    /// Character devices the job's processes may not open (other jobs' GPUs), where topod
    /// confines devices (`confine_devices`): v1 writes each to the job's `devices.deny`. Set at
    /// creation only; a resize or a move keeps what the job had.
    pub denied_devices: Vec<CharDevice>,
}

/// A character device by number, as the kernel's device rules name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CharDevice {
    /// Its major number (the driver).
    pub major: u32,
    /// Its minor number (which of the driver's devices).
    pub minor: u32,
}

impl std::fmt::Display for CharDevice {
    /// `c MAJOR:MINOR`, the form of a v1 `devices.allow`/`devices.deny` rule's device.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "c {}:{}", self.major, self.minor)
    }
}

/// What the kernel says a job's cgroup has.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Effective {
    /// Effective CPUs.
    pub cpus: CpuSet,
    /// Effective memory nodes.
    pub mems: CpuSet,
}

/// The outcome of a release.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReleaseReport {
    /// Processes that were killed.
    pub killed: usize,
    /// Processes still there when the time ran out (the cgroup is then left in place).
    pub survivors: Vec<i32>,
}

/// The files in which the kernel reports how a job uses what it was given (for metrics); each
/// is absent where the backend or the kernel has none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageFiles {
    /// v2 `cpu.stat` (`usage_usec`: CPU time of every process that ever ran in it).
    pub cpu_stat: Option<PathBuf>,
    /// v2 `cpu.pressure` (PSI: time some of its threads waited for a CPU).
    pub cpu_pressure: Option<PathBuf>,
    /// v2 `memory.pressure` (PSI: time its threads stalled on memory).
    pub memory_pressure: Option<PathBuf>,
    /// v1 `cpuset.memory_pressure` (a filtered rate of direct reclaim in the cpuset; kept only
    /// when the root cpuset's `cpuset.memory_pressure_enabled` is 1).
    pub cpuset_memory_pressure: Option<PathBuf>,
}

/// A failed cgroup operation, with the file and what was written.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// Reading, writing, creating or removing a cgroup file failed.
    #[error("{action} {path}{data}: {source}", data = data.as_ref().map(|d| format!(" (writing {d:?})")).unwrap_or_default())]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// What was written, if anything.
        data: Option<String>,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A cgroup file held something unexpected.
    #[error("{path}: {what}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// The job has no cgroup.
    #[error("job {0} has no cgroup")]
    NoSuchJob(String),
    /// The job's cgroup exists already with other CPUs.
    #[error("job {job} already has a cgroup with CPUs {existing}, not {wanted}")]
    Exists {
        /// The job.
        job: String,
        /// What it has.
        existing: String,
        /// What was asked.
        wanted: String,
    },
    /// A join before the cgroup has CPUs and memory nodes.
    #[error("job {0}: its cgroup has no CPUs or memory nodes yet; refusing to move a process in")]
    NotReady(String),
    /// The needed controller is not there.
    #[error("{0}")]
    Unsupported(String),
    /// The kernel did not report the state in time (undone where it can be).
    #[error("job {job}: the kernel did not report it {state} within {waited:?}{undone}")]
    Timeout {
        /// The job.
        job: String,
        /// `frozen` or `thawed`.
        state: &'static str,
        /// How long topod waited.
        waited: Duration,
        /// What was done about it.
        undone: &'static str,
    },
}

impl CgroupError {
    /// The kernel did not report `job` `state` (`frozen`, `thawed`) within `waited`; `undone`
    /// says what was done about it ("" or "; thawed again").
    pub(crate) fn not_reported(
        job: &JobId,
        state: &'static str,
        waited: Duration,
        undone: &'static str,
    ) -> Self {
        CgroupError::Timeout { job: job.to_string(), state, waited, undone }
    }
}

/// The cgroup operations topod needs.
pub trait CgroupBackend: Send + Sync {
    /// `v1`, `v2` or `fake`.
    fn kind(&self) -> &'static str;
    /// Whether [`CgroupSpec::denied_devices`] is kept (a backend opened to confine devices).
    fn confines_devices(&self) -> bool {
        false
    }
    /// Makes the job's device rules say `denied` and `allowed` (each device of either list
    /// denied or allowed, others as they were), making its devices cgroup, with the job's
    /// processes moved in, where it is missing (a job from before devices were confined, a
    /// release cut short, an administrator's `rmdir`). Nothing where the backend does not
    /// confine devices.
    fn set_device_rules(
        &self,
        job: &JobId,
        denied: &[CharDevice],
        allowed: &[CharDevice],
    ) -> Result<(), CgroupError> {
        let _ = (job, denied, allowed);
        Ok(())
    }
    /// Creates the job's cgroup with its CPUs and memory nodes (idempotent for the same spec),
    /// and returns what the kernel made effective.
    fn create(&self, job: &JobId, spec: &CgroupSpec) -> Result<Effective, CgroupError>;
    /// Gives the existing cgroup of a job new CPUs and memory nodes while its processes run (a
    /// resize or a move), and returns what the kernel made effective. The kernel moves every
    /// thread onto the new CPUs at once. Memory: v1 moves the job's pages to its new nodes
    /// because topod sets `cpuset.memory_migrate` first (cgroup-v1/cpusets.rst, 1.5); v2 has no
    /// such switch and always migrates when `cpuset.mems` changes (cgroup-v2.rst, "Cpuset
    /// Interface Files"). The memory limit is left as it is.
    fn update(&self, job: &JobId, spec: &CgroupSpec) -> Result<Effective, CgroupError> {
        let _ = spec;
        Err(CgroupError::Unsupported(format!(
            "the {} backend cannot change job {job}'s CPUs",
            self.kind()
        )))
    }
    /// Moves a process, with all its threads, into the job's cgroup.
    fn join(&self, job: &JobId, pid: i32) -> Result<(), CgroupError>;
    /// The files a root, single-threaded process writes `0` to, in order, to move itself into
    /// the job's cgroup (`topo_client::SelfJoin`); empty where the backend offers no such path (then only
    /// [`CgroupBackend::join`] moves processes). Checks what `join` checks.
    fn self_join_files(&self, job: &JobId) -> Result<Vec<PathBuf>, CgroupError> {
        let _ = job;
        Ok(Vec::new())
    }
    /// As [`CgroupBackend::join`], for a process that may have moved itself in already: where
    /// it is in, nothing is written (a write would take the kernel's global migration lock).
    fn join_unless_in(&self, job: &JobId, pid: i32) -> Result<(), CgroupError> {
        self.join(job, pid)
    }
    /// The processes in the job's cgroup.
    fn pids(&self, job: &JobId) -> Result<Vec<i32>, CgroupError>;
    /// Kills everything in the job's cgroup and removes it.
    fn release(&self, job: &JobId, timeout: Duration) -> Result<ReleaseReport, CgroupError>;
    /// Every job cgroup under our subtree, with its effective CPUs and memory nodes.
    fn list(&self) -> Result<Vec<(JobId, Effective)>, CgroupError>;
    /// Stops every process of the job at once (v1 `freezer.state`, v2 `cgroup.freeze`) and
    /// returns when the kernel reports the whole cgroup frozen; the job's memory stays where it
    /// is. Not frozen within `timeout`: thawed again and an error.
    fn freeze(&self, job: &JobId, timeout: Duration) -> Result<(), CgroupError> {
        let _ = (job, timeout);
        Err(CgroupError::Unsupported(format!("the {} backend cannot freeze jobs", self.kind())))
    }
    /// Lets a frozen job run again; returns when the kernel reports it thawed.
    fn thaw(&self, job: &JobId, timeout: Duration) -> Result<(), CgroupError> {
        let _ = (job, timeout);
        Err(CgroupError::Unsupported(format!("the {} backend cannot thaw jobs", self.kind())))
    }
    /// Whether the job's cgroup is frozen or freezing (what a restarted topod reads back).
    fn is_frozen(&self, job: &JobId) -> Result<bool, CgroupError> {
        let _ = job;
        Ok(false)
    }
    /// CPUs that cpusets we did not create hold exclusively (an administrator's exclusive
    /// cpuset, a v2 partition): never to be given to a job.
    fn foreign_cpus(&self) -> Result<CpuSet, CgroupError> {
        Ok(CpuSet::new())
    }
    /// Where the kernel reports the job's CPU time and pressure (none for the fake).
    fn usage_files(&self, job: &JobId) -> UsageFiles {
        let _ = job;
        UsageFiles::default()
    }
    /// Gives topod's subtree every CPU of its parent that no foreign exclusive cpuset holds
    /// (after one went away); nothing where the subtree inherits its parent's CPUs by itself.
    fn widen(&self) -> Result<(), CgroupError> {
        Ok(())
    }
}
