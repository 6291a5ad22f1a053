//! Job cgroups: the one OS boundary topod crosses to confine a job.
//!
//! One trait, [`CgroupBackend`], with three implementations: [`v1::V1`] (separate `cpuset`,
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

pub mod fake;
mod files;
pub mod jobid;
pub mod v1;
pub mod v2;

pub use jobid::{JobId, JobIdError};

/// The calling process, ready to move itself into a job's cgroup by writing `0` to each of the
/// v1 `tasks` files [`CgroupBackend::self_join_files`] names.
///
/// Why: writing a pid to `cgroup.procs` takes the kernel's global threadgroup lock for writing,
/// which waits for an RCU grace period when no migration happened just before (milliseconds
/// each time on a quiet host). A thread moving only itself (`0` written to v1 `tasks`) skips that
/// lock on current kernels (`cgroup_procs_write_start`; on this project's test VM, kernel 6.18:
/// 0.3 ms against 6.3 ms, `tests/cgroup-join-bench.py`).
///
/// The caller is root and the file names come from topod, so they are checked before anything is
/// written: each must be a file named `tasks` in a directory named after the job, on a cgroup v1
/// file system, opened without following links, creating or truncating anything. v1 `tasks`
/// moves one thread, so a process with more than one thread is refused: the others would stay
/// behind. Nothing is written unless every check passes.
pub struct SelfJoin {
    files: Vec<(PathBuf, std::fs::File)>,
}

impl SelfJoin {
    /// Checks the process and opens every file; writes nothing.
    pub fn prepare(job: &str, files: &[PathBuf]) -> Result<SelfJoin, CgroupError> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut opened = Vec::with_capacity(files.len());
        for file in files {
            let named_right = file.file_name().is_some_and(|n| n == "tasks")
                && file.parent().and_then(|d| d.file_name()).is_some_and(|n| n == job);
            if !named_right {
                return Err(CgroupError::Unsupported(format!(
                    "{} is not a tasks file of job {job}'s cgroup",
                    file.display()
                )));
            }
            let f = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
                .open(file)
                .map_err(|source| CgroupError::Io {
                    action: "opening",
                    path: file.clone(),
                    data: None,
                    source,
                })?;
            let on_cgroup_v1 = nix::sys::statfs::fstatfs(&f)
                .is_ok_and(|fs| fs.filesystem_type() == nix::sys::statfs::CGROUP_SUPER_MAGIC);
            if !on_cgroup_v1 {
                return Err(CgroupError::Unsupported(format!(
                    "{} is not on a cgroup v1 file system",
                    file.display()
                )));
            }
            opened.push((file.clone(), f));
        }
        let status = std::path::Path::new("/proc/self/status");
        let text = std::fs::read_to_string(status).map_err(|source| CgroupError::Io {
            action: "reading",
            path: status.into(),
            data: None,
            source,
        })?;
        let threads = text.lines().find_map(|l| l.strip_prefix("Threads:")).map(str::trim);
        if threads != Some("1") {
            return Err(CgroupError::Unsupported(format!(
                "this process has {} threads; only a single-threaded process can move itself through v1 tasks files",
                threads.unwrap_or("an unknown number of")
            )));
        }
        Ok(SelfJoin { files: opened })
    }

    /// Writes `0` to each file in order. An error here may leave the process moved in some
    /// hierarchies and not others.
    pub fn move_in(self) -> Result<(), CgroupError> {
        use std::io::Write;
        for (path, mut f) in self.files {
            f.write_all(b"0").map_err(|source| CgroupError::Io {
                action: "writing",
                path,
                data: Some("0".into()),
                source,
            })?;
        }
        Ok(())
    }
}

use crate::cpuset::CpuSet;
use std::path::PathBuf;
use std::time::Duration;

/// What a job's cgroup gets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupSpec {
    /// Its CPUs.
    pub cpus: CpuSet,
    /// Its memory nodes.
    pub mems: CpuSet,
    /// Memory limit in bytes.
    pub memory_limit: Option<u64>,
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
}

/// The cgroup operations topod needs.
pub trait CgroupBackend: Send + Sync {
    /// `v1`, `v2` or `fake`.
    fn kind(&self) -> &'static str;
    /// Creates the job's cgroup with its CPUs and memory nodes (idempotent for the same spec),
    /// and returns what the kernel made effective.
    fn create(&self, job: &JobId, spec: &CgroupSpec) -> Result<Effective, CgroupError>;
    /// Moves a process, with all its threads, into the job's cgroup.
    fn join(&self, job: &JobId, pid: i32) -> Result<(), CgroupError>;
    /// The files a root, single-threaded process writes `0` to, in order, to move itself into
    /// the job's cgroup ([`SelfJoin`]); empty where the backend offers no such path (then only
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
    /// CPUs that cpusets we did not create hold exclusively (an administrator's exclusive
    /// cpuset, a v2 partition): never to be given to a job.
    fn foreign_cpus(&self) -> Result<CpuSet, CgroupError> {
        Ok(CpuSet::new())
    }
    /// Gives topod's subtree every CPU of its parent that no foreign exclusive cpuset holds
    /// (after one went away); nothing where the subtree inherits its parent's CPUs by itself.
    fn widen(&self) -> Result<(), CgroupError> {
        Ok(())
    }
}
