//! The job records: what the cgroup tree cannot say about a job (its request, its tasks' CPUs,
//! the uid that may join its own processes), one small file per job under
//! `<state_dir>/jobs/`.
//!
//! A record is written before `allocate` answers, so a topod killed at any moment after that
//! answer finds the job's owner again (a job whose owner was lost would refuse its own
//! `topo-exec`). One file per job keeps each write the size of one job, whatever the number of
//! jobs. Each is written to a new temporary file (`O_EXCL | O_NOFOLLOW`, mode 0600) and renamed
//! over the old one, so a crash leaves the old record or the new one, never half of one; no
//! `fsync`: the records describe live cgroups, which do not outlive the machine either.
//!
//! The directory must be root's and writable by nobody else when topod runs as root; otherwise
//! a planted link or file could make root write where it should not.

use crate::cgroup::JobId;
use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use topo_core::cpuset::CpuSet;
use topo_core::ledger::Allocation;
use topo_core::policy::RunClock;

/// What a job asked of this host: built once from its allocate (the request made canonical by
/// [`super::host::prepare`], and what the protocol's fields said of the job), kept in its
/// record, and read by every rule that depends on what a job said of itself (preemption's
/// expansion factor, prime-time pools, a malleable job's signal, the GPUs the batch system
/// gave it). Another allocate of the same job (a Slurm step) only adds the GPUs it names.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct JobAsk {
    /// The request, in its canonical form (what the ledger keeps, and what reads back as the
    /// same request after a restart).
    pub request: String,
    /// The uid that may join its own processes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_uid: Option<u32>,
    /// It may be suspended for another job (its allocate said so).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub preemptible: bool,
    /// When the batch system took it, seconds since the epoch (for its expansion factor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submitted_at: Option<i64>,
    /// Its estimated run time, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimate_s: Option<u64>,
    /// The signal its processes get after its CPUs change (a malleable job's choice).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resize_signal: Option<i32>,
    /// Its batch queue, as its allocate said (prime-time pools admit by queue).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    /// The prime-time pool its allocate named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// The GPUs the batch system gave it, by PCI address (kept for `list`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<String>,
}

/// One job's record: what it asked ([`JobAsk`]) and what has happened to it on this host since
/// (its tasks' CPUs, its suspensions and by whom, its gang row, its run time, its moves). The
/// file holds both as one JSON object, as records always have.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct JobRecord {
    /// What it asked.
    #[serde(flatten)]
    pub ask: JobAsk,
    /// The CPUs of each task.
    pub tasks: Vec<CpuSet>,
    /// When the job was last allocated (a new allocation, or the same one asked again), in UTC
    /// to the nanosecond: a release queued before then was for an earlier run of the same job
    /// id ([`super::host::Host::allocated_after`]), also after a restart. Records written
    /// before this field existed take their file's time ([`Records::load`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated_at: Option<String>,
    /// How long it has run, since when it is protected from preemption and migration, and how
    /// many times preemption suspended it (its fields are the record's own, as before).
    #[serde(flatten)]
    pub clock: RunClock,
    /// Written before topod freezes the job and cleared after it thaws it: a frozen cgroup
    /// whose record does not say so was frozen by a release that a crash cut short, not
    /// suspended ([`super::host::Host::recover`]).
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
    /// The job it was suspended for, while topod's preemption holds it: topod resumes it
    /// itself once its CPUs are free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preempted_by: Option<String>,
    /// The generation its notify file says: 1 when allocated, one more at every change.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub notify_generation: u64,
    /// When its CPUs last changed (a resize or a move), seconds since the epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_at: Option<i64>,
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

impl JobRecord {
    /// [`JobRecord::allocated_at`] as a time (`None` when missing or not a time).
    pub fn allocated_time(&self) -> Option<std::time::SystemTime> {
        self.allocated_at.as_deref().and_then(topo_core::pending::parse_utc)
    }
}

impl JobRecord {
    /// When the job ends by its estimate if it runs on from now without a stop, seconds since
    /// the epoch; `None` without an estimate, or while it is not running.
    pub fn estimated_end(&self) -> Option<i64> {
        self.clock.estimated_end(self.ask.estimate_s?)
    }
}

/// A state directory that topod cannot trust or use.
#[derive(Debug, thiserror::Error)]
pub enum RecordsError {
    /// Cannot create, open or write.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Others could plant files in it.
    #[error("the state directory {path} is {why}; it must belong to root and be writable by root only (chown root {path}; chmod 755 {path})")]
    Unsafe {
        /// The directory.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
}

/// Writes `bytes` to `path` through the temporary file `tmp` and a rename: a crash leaves the
/// old file or the new one, never half of one.
fn write_atomically(tmp: &Path, path: &Path, bytes: &[u8]) -> Result<(), RecordsError> {
    fn io<'a>(
        action: &'static str,
        path: &'a Path,
    ) -> impl FnOnce(std::io::Error) -> RecordsError + 'a {
        move |source| RecordsError::Io { action, path: path.to_path_buf(), source }
    }
    // O_EXCL and O_NOFOLLOW: whatever is at that name is neither followed nor written
    // through. A temporary file left by a crash is ours to replace.
    let create = || {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
            .open(tmp)
    };
    let mut f = match create() {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            std::fs::remove_file(tmp).map_err(io("removing", tmp))?;
            create()
        }
        other => other,
    }
    .map_err(io("creating", tmp))?;
    f.write_all(bytes).map_err(io("writing", tmp))?;
    drop(f);
    std::fs::rename(tmp, path).map_err(io("renaming into place", path))
}

/// One move of a plan: the job's new allocation, and which run of the job it is for (its
/// record's `allocated_at` when the plan was made): a restart does not move a later run of the
/// same job id (a requeue) by an old plan.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PlannedMove {
    /// The job's allocation once moved.
    #[serde(flatten)]
    pub to: Allocation,
    /// The run it was planned for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
}

/// The records directory.
#[derive(Debug, Clone)]
pub struct Records {
    dir: PathBuf,
}

/// Whether a directory topod writes as root is safe from other users: owned by root (or by
/// topod's own uid) and not writable by group or others. Checks the directory itself, not a link
/// to it.
pub fn check_private_dir(path: &Path) -> Result<(), RecordsError> {
    let meta = std::fs::symlink_metadata(path).map_err(|source| RecordsError::Io {
        action: "inspecting",
        path: path.to_path_buf(),
        source,
    })?;
    let me = nix::unistd::geteuid().as_raw();
    let unsafe_dir = |why: String| Err(RecordsError::Unsafe { path: path.to_path_buf(), why });
    if meta.file_type().is_symlink() {
        return unsafe_dir("a symbolic link".into());
    }
    if !meta.is_dir() {
        return unsafe_dir("not a directory".into());
    }
    if meta.uid() != me && meta.uid() != 0 {
        return unsafe_dir(format!("owned by uid {}", meta.uid()));
    }
    let mode = meta.permissions().mode();
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return unsafe_dir(format!(
            "writable by {} (mode {:o})",
            if mode & 0o002 != 0 { "everyone" } else { "its group" },
            mode & 0o7777
        ));
    }
    if mode & 0o022 != 0 {
        // Sticky and shared (like /tmp): others cannot replace our files, but can plant names.
        return unsafe_dir(format!("shared with other users (mode {:o})", mode & 0o7777));
    }
    Ok(())
}

impl Records {
    /// Uses `<state_dir>/jobs`, creating it (mode 0700) if missing. `state_dir` is checked with
    /// [`check_private_dir`] when topod runs as root.
    pub fn open(state_dir: &Path) -> Result<Records, RecordsError> {
        std::fs::create_dir_all(state_dir).map_err(|source| RecordsError::Io {
            action: "creating",
            path: state_dir.to_path_buf(),
            source,
        })?;
        if nix::unistd::geteuid().is_root() {
            check_private_dir(state_dir)?;
        }
        let dir = state_dir.join("jobs");
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(source) => return Err(RecordsError::Io { action: "creating", path: dir, source }),
        }
        check_private_dir(&dir)?;
        Ok(Records { dir })
    }

    fn path(&self, job: &JobId) -> PathBuf {
        self.dir.join(format!("{}.json", job.as_str()))
    }

    /// Writes the record of `job`, replacing the one it had; done when this returns.
    pub fn write(&self, job: &JobId, hint: &JobRecord) -> Result<(), RecordsError> {
        let bytes = serde_json::to_vec(hint).unwrap_or_default();
        let tmp = self.dir.join(format!(".{}.tmp", job.as_str()));
        write_atomically(&tmp, &self.path(job), &bytes)
    }

    /// Where the plan of moves under way is kept: beside the records directory, so that no job
    /// id can name it.
    fn moves_path(&self) -> PathBuf {
        self.dir.parent().unwrap_or(&self.dir).join("moves.json")
    }

    /// Writes the plan of moves topod is about to make (running jobs given new CPUs: a resize, a
    /// defragmentation, a rebalance). It is written whole before the first cgroup changes and
    /// removed after the last record is updated; a restart that finds it makes the moves again
    /// ([`super::host::Host::recover`]), so a crash never leaves half of a plan.
    pub fn write_moves(&self, moves: &[PlannedMove]) -> Result<(), RecordsError> {
        let bytes = serde_json::to_vec(moves).unwrap_or_default();
        let path = self.moves_path();
        write_atomically(&path.with_extension("json.tmp"), &path, &bytes)
    }

    /// The plan of moves a crash cut short, if any (an unreadable plan is an error: topod must
    /// not guess where jobs were going).
    pub fn load_moves(&self) -> Result<Option<Vec<PlannedMove>>, RecordsError> {
        let path = self.moves_path();
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| RecordsError::Io {
                action: "reading the plan of moves",
                path,
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(RecordsError::Io { action: "reading", path, source }),
        }
    }

    /// Writes the host's topology reservations, replacing what was there.
    pub fn write_reservations(
        &self,
        reservations: &[&topo_core::reservation::Reservation],
    ) -> Result<(), RecordsError> {
        let bytes = serde_json::to_vec(reservations).unwrap_or_default();
        let path = self.dir.parent().unwrap_or(&self.dir).join("reservations.json");
        write_atomically(&path.with_extension("json.tmp"), &path, &bytes)
    }

    /// The topology reservations written last (none when there is no file).
    pub fn load_reservations(
        &self,
    ) -> Result<Vec<topo_core::reservation::Reservation>, RecordsError> {
        let path = self.dir.parent().unwrap_or(&self.dir).join("reservations.json");
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| RecordsError::Io {
                action: "reading the topology reservations",
                path,
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(source) => Err(RecordsError::Io { action: "reading", path, source }),
        }
    }

    /// Removes the plan of moves once every move is made and recorded.
    pub fn remove_moves(&self) -> Result<(), RecordsError> {
        let path = self.moves_path();
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(RecordsError::Io { action: "removing", path, source }),
        }
    }

    /// Removes the record of `job` (none is not an error).
    pub fn remove(&self, job: &JobId) -> Result<(), RecordsError> {
        let path = self.path(job);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(RecordsError::Io { action: "removing", path, source }),
        }
    }

    /// Every record, by job id; files that are not records (or cannot be read) are reported in
    /// the second list and left alone. A record without [`JobRecord::allocated_at`] (written by a
    /// topod before it kept one) takes its file's time: it was written when the job was
    /// allocated, or later.
    pub fn load(&self) -> (BTreeMap<String, JobRecord>, Vec<String>) {
        let mut records = BTreeMap::new();
        let mut unreadable = Vec::new();
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return (records, unreadable) };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue;
            }
            let Some(job) = name.strip_suffix(".json").filter(|j| JobId::parse(j).is_ok()) else {
                unreadable.push(name);
                continue;
            };
            let parsed = std::fs::read(e.path())
                .ok()
                .and_then(|b| serde_json::from_slice::<JobRecord>(&b).ok());
            match parsed {
                Some(mut hint) => {
                    if hint.allocated_time().is_none() {
                        hint.allocated_at = e
                            .metadata()
                            .and_then(|m| m.modified())
                            .ok()
                            .map(topo_core::pending::format_utc_nanos);
                    }
                    records.insert(job.to_string(), hint);
                }
                None => unreadable.push(name),
            }
        }
        (records, unreadable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_replace_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let r = Records::open(dir.path()).unwrap();
        let job = JobId::parse("12[3]").unwrap();
        let hint = JobRecord {
            ask: JobAsk {
                request: "affinity[thread*1]".into(),
                owner_uid: Some(1000),
                preemptible: true,
                submitted_at: Some(1_700_000_000),
                estimate_s: Some(3600),
                resize_signal: Some(10),
                queue: Some("batch".into()),
                pool: Some("day".into()),
                gpus: vec!["0000:3b:00.0".into()],
            },
            tasks: vec![topo_core::CpuSet::parse_list("3").unwrap()],
            allocated_at: Some("2025-06-01T12:00:00.123456789Z".into()),
            clock: RunClock {
                suspensions: 2,
                ran_s: 120,
                running_since: None,
                protected_since: Some(1_700_000_050),
            },
            suspended: true,
            suspended_by: Some(1000),
            gang_row: Some(1),
            preempted_by: Some("9".into()),
            notify_generation: 3,
            moved_at: Some(1_700_000_100),
            tasks_cap: Some(2),
            tasks_unknown: true,
            batch_suspended: true,
            batch_suspended_ns: 1_700_000_000_000_000_000,
        };
        // One flat object on disk, as records were before what a job asked was its own type: a
        // topod of either version reads the other's records.
        let flat = serde_json::to_value(&hint).unwrap();
        for key in ["request", "owner_uid", "queue", "gpus", "tasks", "suspensions", "ran_s"] {
            assert!(flat.get(key).is_some(), "{key} in {flat}");
        }
        assert!(flat.get("ask").is_none() && flat.get("clock").is_none(), "{flat}");
        let before = r#"{"request":"affinity[thread*1]","tasks":["3"],"owner_uid":1000,"suspensions":1,"preemptible":true,"submitted_at":1700000000,"estimate_s":3600,"queue":"batch","gpus":["0000:3b:00.0"]}"#;
        let old: JobRecord = serde_json::from_str(before).unwrap();
        assert_eq!((old.ask.owner_uid, old.ask.queue.as_deref()), (Some(1000), Some("batch")));
        assert_eq!(
            (old.ask.estimate_s, old.clock.suspensions, old.tasks.len()),
            (Some(3600), 1, 1)
        );
        r.write(&job, &hint).unwrap();
        r.write(&job, &hint).unwrap();
        let (all, bad) = r.load();
        assert_eq!(all.get("12[3]"), Some(&hint));
        assert!(bad.is_empty());
        r.remove(&job).unwrap();
        r.remove(&job).unwrap();
        assert!(r.load().0.is_empty());
        // The plan of moves lives beside the records, where no job id can name it.
        assert_eq!(r.load_moves().unwrap(), None);
        let moved = topo_core::ledger::Allocation {
            job: "12[3]".into(),
            cpus: topo_core::CpuSet::parse_list("4-5").unwrap(),
            tasks: vec![topo_core::CpuSet::parse_list("4-5").unwrap()],
            mems: topo_core::CpuSet::parse_list("0").unwrap(),
            fenced: Default::default(),
            request: "affinity[thread*1-2]".into(),
            gang_row: None,
        };
        let planned = PlannedMove { to: moved, run: Some("2025-06-01T12:00:00Z".into()) };
        r.write_moves(std::slice::from_ref(&planned)).unwrap();
        assert_eq!(r.load_moves().unwrap(), Some(vec![planned]));
        assert!(r.load().0.is_empty() && r.load().1.is_empty());
        std::fs::write(dir.path().join("moves.json"), "{").unwrap();
        assert!(r.load_moves().unwrap_err().to_string().contains("plan of moves"));
        r.remove_moves().unwrap();
        r.remove_moves().unwrap();
        assert_eq!(r.load_moves().unwrap(), None);
    }

    #[test]
    fn a_planted_link_is_never_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let r = Records::open(dir.path()).unwrap();
        let target = dir.path().join("victim");
        std::fs::write(&target, "precious").unwrap();
        let job = JobId::parse("7").unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join("jobs/.7.tmp")).unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join("jobs/7.json")).unwrap();
        r.write(&job, &JobRecord::default()).unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious");
        assert!(!std::fs::symlink_metadata(dir.path().join("jobs/7.json"))
            .unwrap()
            .file_type()
            .is_symlink());
    }

    #[test]
    fn a_directory_others_can_write_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = check_private_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("writable by everyone") && e.contains("chmod 755"), "{e}");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(check_private_dir(dir.path())
            .unwrap_err()
            .to_string()
            .contains("shared with other users"));
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        check_private_dir(dir.path()).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(dir.path(), &link).unwrap();
        assert!(check_private_dir(&link).unwrap_err().to_string().contains("symbolic link"));
    }
}
