//! Releases queued while topod could not be reached, done when it can: at start, once the
//! ledger is rebuilt (beside serving, not before it: a release whose processes will not die
//! takes its timeout), and then on its five-second tick.
//!
//! A batch system's epilog that cannot reach topod leaves one file per job in
//! `<socket dir>/release-pending/` ([`topo_core::pending`], written by
//! `topo_client::queue_release`) and succeeds, so a topod restart does not drain the node. Each
//! file asks topod, as root, to kill a job's processes and free its CPUs, so topod acts only on
//! what root wrote:
//!
//! - the directory must be root's (or topod's own user's, for a topod run without root) and
//!   writable by no one else, and not a link; otherwise nothing in it is read, removed or done,
//!   and topod says so once;
//! - each file must be a regular file (never a link: nothing is followed), owned likewise, not
//!   writable by group or others, with one name; its name must be a job id topod accepts
//!   ([`JobId::parse`]) and is never used as a path; a file that fails is removed and logged,
//!   and its job is not touched;
//! - a job allocated again after the request was made (Slurm requeued it, and its new run started
//!   here) is not released: the request was for the run that ended.
//!
//! Everything that touches the file system sits behind [`PendingFs`] ([`Kernel`], and a fake in
//! the tests), and everything that releases behind [`Releaser`] (the server); what to do with
//! one entry is the pure [`judge`].

use super::host::HostError;
use crate::cgroup::JobId;
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};
use topo_core::pending::{format_utc, QueuedRelease, MAX_REQUEST_BYTES};

/// How long a temporary file (a name starting with `.`, which no job id does) may sit before it
/// counts as left behind by an epilog that died while writing.
const TEMPORARY_FILE_AGE: Duration = Duration::from_secs(60);

/// What a directory entry is, as seen without following a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link.
    Symlink,
    /// Anything else (a FIFO, a socket, a device).
    Other,
}

/// One directory or file, as the kernel describes it (`lstat`, or `fstat` of what was opened).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inspected {
    /// What it is.
    pub kind: Kind,
    /// Its owner.
    pub uid: u32,
    /// Its permission bits (`0o7777`).
    pub mode: u32,
    /// How many names it has.
    pub links: u64,
    /// When it was last written.
    pub modified: SystemTime,
    /// The first [`MAX_REQUEST_BYTES`] + 1 bytes of a regular file (none for anything else, or
    /// for a file topod may not read).
    pub contents: Option<Vec<u8>>,
}

/// The file-system side: the directory, opened once per pass; what is in it; removing a name.
pub trait PendingFs {
    /// An open directory: every later call acts on the directory that was opened and checked,
    /// whatever happens to its path meanwhile.
    type Dir;
    /// Opens `path` without following a link: `None` when nothing is there. A link or another
    /// non-directory is returned as such (its [`Inspected::kind`]), without a handle.
    fn open_dir(&self, path: &Path) -> std::io::Result<Option<(Option<Self::Dir>, Inspected)>>;
    /// The names in the directory (not `.` and `..`).
    fn list(&self, dir: &Self::Dir) -> std::io::Result<Vec<OsString>>;
    /// One entry, without following a link; a regular file's contents with it.
    fn inspect(&self, dir: &Self::Dir, name: &OsStr) -> std::io::Result<Inspected>;
    /// Removes one name (a link itself, never what it points to).
    fn remove(&self, dir: &Self::Dir, name: &OsStr) -> std::io::Result<()>;
}

/// What releases a queued job: the server, in topod.
pub trait Releaser {
    /// Releases `job` the way a protocol `release` does, unless it was allocated after
    /// `asked_at` (then it answers when).
    fn release_queued(&self, job: &JobId, asked_at: SystemTime) -> Result<Queued, HostError>;
}

/// What [`Releaser::release_queued`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Queued {
    /// Released: its processes killed (how many), its cgroup removed, its CPUs freed.
    Released {
        /// Processes killed.
        killed: usize,
    },
    /// Not released: it was allocated after the request, at this time (a new run of that id).
    AllocatedSince(SystemTime),
}

/// What to do with one directory entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Release the job.
    Release {
        /// The job.
        job: JobId,
        /// When the release was asked.
        asked_at: SystemTime,
        /// Who asked.
        asked_by: String,
    },
    /// Remove the entry without releasing anything, and say why.
    Refuse {
        /// Why.
        why: String,
    },
    /// Remove a temporary file left behind, quietly.
    Clean,
    /// Leave it (a temporary file being written now).
    Leave,
}

/// Whether the directory may be acted on: root's (or `me`'s), a directory, not a link, not
/// writable by group or others. `Err` says what is wrong.
pub fn check_dir(dir: &Inspected, me: u32) -> Result<(), String> {
    match dir.kind {
        Kind::Dir => {}
        Kind::Symlink => return Err("a symbolic link".into()),
        _ => return Err("not a directory".into()),
    }
    check_owner(dir, me)
}

fn check_owner(it: &Inspected, me: u32) -> Result<(), String> {
    if it.uid != 0 && it.uid != me {
        return Err(format!("owned by uid {}, not root", it.uid));
    }
    if it.mode & 0o022 != 0 {
        return Err(format!("writable by its group or others (mode {:o})", it.mode & 0o7777));
    }
    Ok(())
}

/// What to do with the entry `name` (already inspected, without following it), for a topod
/// running as `me`, at `now`.
pub fn judge(name: &OsStr, file: &Inspected, me: u32, now: SystemTime) -> Verdict {
    let Some(text) = name.to_str() else {
        return Verdict::Refuse { why: "its name is not text, so not a job id".into() };
    };
    if text.starts_with('.') {
        // The writer's temporary file; no job id starts with '.'.
        let age = now.duration_since(file.modified).unwrap_or_default();
        return if age > TEMPORARY_FILE_AGE { Verdict::Clean } else { Verdict::Leave };
    }
    let job = match JobId::parse(text) {
        Ok(job) => job,
        Err(e) => return Verdict::Refuse { why: format!("not a job id ({e})") },
    };
    match file.kind {
        Kind::File => {}
        Kind::Symlink => {
            return Verdict::Refuse { why: "a symbolic link, which is not followed".into() }
        }
        Kind::Dir => return Verdict::Refuse { why: "a directory".into() },
        Kind::Other => return Verdict::Refuse { why: "not a regular file".into() },
    }
    if let Err(why) = check_owner(file, me) {
        return Verdict::Refuse { why };
    }
    if file.links != 1 {
        return Verdict::Refuse { why: format!("a file with {} names", file.links) };
    }
    let Some(contents) = file.contents.as_deref() else {
        return Verdict::Refuse { why: "a file topod cannot read".into() };
    };
    let read = (contents.len() <= MAX_REQUEST_BYTES).then(|| QueuedRelease::parse(contents));
    match read.flatten() {
        Some((request, asked_at)) => Verdict::Release { job, asked_at, asked_by: request.asked_by },
        // Root made it without a request in it (`touch`): its time is the file's.
        None => Verdict::Release {
            job,
            asked_at: file.modified,
            asked_by: "root (the file holds no request; its time is the file's)".into(),
        },
    }
}

/// What happened to one entry in a pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The job was released; the request removed.
    Released {
        /// The job.
        job: String,
        /// Processes killed.
        killed: usize,
    },
    /// topod held nothing for the job; the request removed.
    NotHeld {
        /// The job.
        job: String,
    },
    /// The job was allocated again after the request; the request removed, the job kept.
    AllocatedSince {
        /// The job.
        job: String,
    },
    /// The release failed or is under way; the request is kept and tried again next pass.
    Kept {
        /// The job.
        job: String,
    },
    /// The entry was not acted on, and removed.
    Refused {
        /// The entry's name.
        name: String,
    },
    /// The whole directory was refused; nothing in it was touched.
    DirRefused,
}

/// The queue, processed one pass at a time.
pub struct PendingReleases<F: PendingFs> {
    fs: F,
    dir: PathBuf,
    me: u32,
    /// The last thing said about the directory (said again only when it changes).
    said_about_dir: Option<String>,
    /// Jobs whose release failed, with the last error said (said again only when it changes).
    failing: BTreeMap<String, String>,
    /// Entries that could not be removed in the last pass (said once).
    stuck: BTreeSet<OsString>,
}

impl<F: PendingFs> PendingReleases<F> {
    /// The queue in `dir` (`topo_core::pending::pending_dir_for` topod's socket), for a topod
    /// running as uid `me`.
    pub fn new(fs: F, dir: PathBuf, me: u32) -> Self {
        PendingReleases {
            fs,
            dir,
            me,
            said_about_dir: None,
            failing: BTreeMap::new(),
            stuck: BTreeSet::new(),
        }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Does every release queued now; logs one line per job (and per refused file).
    pub fn process(&mut self, releaser: &impl Releaser) -> Vec<Outcome> {
        let opened = match self.fs.open_dir(&self.dir) {
            Ok(Some(opened)) => opened,
            Ok(None) => {
                self.said_about_dir = None;
                return Vec::new();
            }
            Err(e) => {
                self.say_about_dir(format!("cannot open {}: {e}", self.dir.display()));
                return vec![Outcome::DirRefused];
            }
        };
        let dir = match (check_dir(&opened.1, self.me), opened.0) {
            (Ok(()), Some(dir)) => dir,
            (Ok(()), None) => return vec![Outcome::DirRefused],
            (Err(why), _) => {
                self.say_about_dir(format!(
                    "{} is {why}; queued releases there are not done until it is a directory of root's that no one else can write (chown root {0}; chmod 700 {0})",
                    self.dir.display()
                ));
                return vec![Outcome::DirRefused];
            }
        };
        self.said_about_dir = None;
        let mut names = match self.fs.list(&dir) {
            Ok(names) => names,
            Err(e) => {
                self.say_about_dir(format!("cannot list {}: {e}", self.dir.display()));
                return vec![Outcome::DirRefused];
            }
        };
        names.sort();
        let now = SystemTime::now();
        let mut outcomes = Vec::new();
        let mut stuck = BTreeSet::new();
        for name in names {
            let shown = name.to_string_lossy().into_owned();
            let path = self.dir.join(&name);
            let file = match self.fs.inspect(&dir, &name) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => {
                    tracing::warn!("queued release {}: cannot read it: {e}", path.display());
                    continue;
                }
            };
            // An entry that cannot be removed (a directory) is spoken of once, not every pass.
            let said_before = self.stuck.contains(&name);
            let mut remove = |fs: &F| {
                if let Err(e) = fs.remove(&dir, &name) {
                    if !said_before {
                        tracing::warn!("queued release {}: cannot remove it: {e}", path.display());
                    }
                    stuck.insert(name.clone());
                }
            };
            match judge(&name, &file, self.me, now) {
                Verdict::Leave => {}
                Verdict::Clean => {
                    tracing::info!(
                        "removing {}, left by a writer that did not finish",
                        path.display()
                    );
                    remove(&self.fs);
                }
                Verdict::Refuse { .. } if said_before => {
                    remove(&self.fs);
                    outcomes.push(Outcome::Refused { name: shown });
                }
                Verdict::Refuse { why } => {
                    tracing::warn!(
                        "queued release {}: refused (it is {why}); nothing released",
                        path.display()
                    );
                    remove(&self.fs);
                    outcomes.push(Outcome::Refused { name: shown });
                }
                Verdict::Release { job, asked_at, asked_by } => {
                    let (outcome, done) = self.release_one(releaser, &job, asked_at, &asked_by);
                    if done {
                        remove(&self.fs);
                    }
                    outcomes.push(outcome);
                }
            }
        }
        self.stuck = stuck;
        outcomes
    }

    /// Does one queued release and says what happened; the flag says whether the request is
    /// done (else it stays for the next pass).
    fn release_one(
        &mut self,
        releaser: &impl Releaser,
        job: &JobId,
        asked_at: SystemTime,
        asked_by: &str,
    ) -> (Outcome, bool) {
        let asked = format!("asked by {asked_by} at {}", format_utc(asked_at));
        let name = job.to_string();
        let outcome = match releaser.release_queued(job, asked_at) {
            Ok(Queued::Released { killed }) => {
                let killed_some = if killed > 0 {
                    format!(" ({killed} process(es) left were killed)")
                } else {
                    String::new()
                };
                tracing::info!(
                    "released {job}, which ended while topod was unreachable; {asked}{killed_some}"
                );
                Outcome::Released { job: name, killed }
            }
            Err(HostError::UnknownJob(_)) => {
                tracing::info!(
                    "queued release of {job} done: topod holds nothing for it ({asked})"
                );
                Outcome::NotHeld { job: name }
            }
            Ok(Queued::AllocatedSince(at)) => {
                tracing::info!(
                    "queued release of {job} dropped ({asked}): the job was allocated again since, at {}; it keeps its CPUs",
                    format_utc(at)
                );
                Outcome::AllocatedSince { job: name }
            }
            // A release under way (the epilog's own, which timed out): the next pass sees.
            Err(HostError::Releasing(_)) => return (Outcome::Kept { job: name }, false),
            Err(e) => {
                let message = e.to_string();
                if self.failing.get(&name) != Some(&message) {
                    tracing::warn!(
                        "queued release of {job} ({asked}) failed: {message}; kept in {}, tried again every 5 s",
                        self.dir.display()
                    );
                    self.failing.insert(name.clone(), message);
                }
                return (Outcome::Kept { job: name }, false);
            }
        };
        self.failing.remove(job.as_str());
        (outcome, true)
    }

    fn say_about_dir(&mut self, what: String) {
        if self.said_about_dir.as_ref() != Some(&what) {
            tracing::warn!("{what}");
            self.said_about_dir = Some(what);
        }
    }
}

/// The kernel: every step relative to the directory's descriptor, nothing followed.
#[derive(Debug, Default, Clone, Copy)]
pub struct Kernel;

impl Kernel {
    // nlink_t is u64 on x86_64 and u32 on aarch64.
    #[allow(clippy::useless_conversion)]
    fn inspected(stat: &nix::sys::stat::FileStat, contents: Option<Vec<u8>>) -> Inspected {
        use nix::sys::stat::SFlag;
        let kind = match SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT {
            SFlag::S_IFREG => Kind::File,
            SFlag::S_IFDIR => Kind::Dir,
            SFlag::S_IFLNK => Kind::Symlink,
            _ => Kind::Other,
        };
        let modified = std::time::UNIX_EPOCH
            + Duration::new(
                u64::try_from(stat.st_mtime).unwrap_or(0),
                u32::try_from(stat.st_mtime_nsec).unwrap_or(0),
            );
        Inspected {
            kind,
            uid: stat.st_uid,
            mode: stat.st_mode & 0o7777,
            links: u64::from(stat.st_nlink),
            modified,
            contents,
        }
    }
}

impl PendingFs for Kernel {
    type Dir = std::fs::File;

    fn open_dir(&self, path: &Path) -> std::io::Result<Option<(Option<Self::Dir>, Inspected)>> {
        use nix::fcntl::OFlag;
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags((OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC).bits())
            .open(path);
        match opened {
            Ok(dir) => {
                let stat = nix::sys::stat::fstat(dir.as_raw_fd())?;
                Ok(Some((Some(dir), Self::inspected(&stat, None))))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            // A link (ELOOP, or ENOTDIR for a link to a directory) or not a directory at all.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
                let stat = nix::sys::stat::lstat(path)?;
                Ok(Some((None, Self::inspected(&stat, None))))
            }
            Err(e) => Err(e),
        }
    }

    fn list(&self, dir: &Self::Dir) -> std::io::Result<Vec<OsString>> {
        use nix::fcntl::OFlag;
        use std::os::fd::AsRawFd;
        use std::os::unix::ffi::OsStrExt;
        let mut listing = nix::dir::Dir::openat(
            Some(dir.as_raw_fd()),
            ".",
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )?;
        let mut names = Vec::new();
        for entry in listing.iter() {
            let name = entry?.file_name().to_bytes().to_vec();
            if name != b"." && name != b".." {
                names.push(OsStr::from_bytes(&name).to_os_string());
            }
        }
        Ok(names)
    }

    fn inspect(&self, dir: &Self::Dir, name: &OsStr) -> std::io::Result<Inspected> {
        use nix::fcntl::{AtFlags, OFlag};
        use std::io::Read;
        use std::os::fd::AsRawFd;
        let stat =
            nix::sys::stat::fstatat(Some(dir.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW)?;
        let first = Self::inspected(&stat, None);
        if first.kind != Kind::File {
            return Ok(first);
        }
        // O_NONBLOCK: a FIFO put in its place meanwhile does not hang topod; what was opened is
        // described again from its own descriptor. A file topod may not read (another user's:
        // topod keeps no CAP_DAC_OVERRIDE) is described without its contents.
        let opened = open_at(
            dir,
            name,
            OFlag::O_RDONLY
                | OFlag::O_NOFOLLOW
                | OFlag::O_NONBLOCK
                | OFlag::O_NOCTTY
                | OFlag::O_CLOEXEC,
        );
        let file = match opened {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => return Ok(first),
            Err(e) => return Err(e),
        };
        let stat = nix::sys::stat::fstat(file.as_raw_fd())?;
        let mut contents = Vec::new();
        if Self::inspected(&stat, None).kind == Kind::File {
            file.take(MAX_REQUEST_BYTES as u64 + 1).read_to_end(&mut contents)?;
        }
        Ok(Self::inspected(&stat, Some(contents)))
    }

    fn remove(&self, dir: &Self::Dir, name: &OsStr) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        nix::unistd::unlinkat(
            Some(dir.as_raw_fd()),
            name,
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        )?;
        Ok(())
    }
}

/// `openat(2)` relative to `dir`, as a `File`.
#[allow(unsafe_code)]
fn open_at(
    dir: &std::fs::File,
    name: &OsStr,
    flags: nix::fcntl::OFlag,
) -> std::io::Result<std::fs::File> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let fd = nix::fcntl::openat(Some(dir.as_raw_fd()), name, flags, nix::sys::stat::Mode::empty())?;
    // SAFETY: openat just returned this descriptor, which nothing else owns or closes.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::sync::Mutex;

    const ROOT: u32 = 0;

    fn at(secs: u64) -> SystemTime {
        std::time::UNIX_EPOCH + Duration::from_secs(secs)
    }

    /// A request file as the epilog writes it.
    fn request(asked: SystemTime) -> Inspected {
        Inspected {
            kind: Kind::File,
            uid: ROOT,
            mode: 0o600,
            links: 1,
            modified: asked,
            contents: Some(QueuedRelease::new(asked, "the Slurm job epilog (pid 7)").to_bytes()),
        }
    }

    fn dir_meta() -> Inspected {
        Inspected {
            kind: Kind::Dir,
            uid: ROOT,
            mode: 0o700,
            links: 2,
            modified: at(0),
            contents: None,
        }
    }

    /// A directory in memory.
    struct FakeFs {
        dir: Option<Inspected>,
        entries: RefCell<BTreeMap<OsString, Inspected>>,
    }

    impl FakeFs {
        fn new(entries: &[(&str, Inspected)]) -> FakeFs {
            FakeFs {
                dir: Some(dir_meta()),
                entries: RefCell::new(
                    entries.iter().map(|(n, i)| (OsString::from(n), i.clone())).collect(),
                ),
            }
        }
        fn names(&self) -> Vec<String> {
            self.entries.borrow().keys().map(|k| k.to_string_lossy().into_owned()).collect()
        }
    }

    impl PendingFs for &FakeFs {
        type Dir = ();
        fn open_dir(&self, _: &Path) -> std::io::Result<Option<(Option<()>, Inspected)>> {
            Ok(self.dir.clone().map(|d| ((d.kind == Kind::Dir).then_some(()), d)))
        }
        fn list(&self, _: &()) -> std::io::Result<Vec<OsString>> {
            Ok(self.entries.borrow().keys().cloned().collect())
        }
        fn inspect(&self, _: &(), name: &OsStr) -> std::io::Result<Inspected> {
            self.entries
                .borrow()
                .get(name)
                .cloned()
                .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
        }
        fn remove(&self, _: &(), name: &OsStr) -> std::io::Result<()> {
            self.entries.borrow_mut().remove(name);
            Ok(())
        }
    }

    /// Jobs held, with the time each was last allocated; what was asked.
    #[derive(Default)]
    struct FakeHost {
        held: Mutex<BTreeMap<String, SystemTime>>,
        failing: Mutex<BTreeMap<String, String>>,
        asked: Mutex<Vec<String>>,
    }

    impl Releaser for FakeHost {
        fn release_queued(&self, job: &JobId, asked_at: SystemTime) -> Result<Queued, HostError> {
            self.asked.lock().unwrap().push(job.to_string());
            if let Some(why) = self.failing.lock().unwrap().get(job.as_str()) {
                return Err(match why.as_str() {
                    "releasing" => HostError::Releasing(job.to_string()),
                    _ => HostError::Survivors { job: job.to_string(), pids: vec![99] },
                });
            }
            let mut held = self.held.lock().unwrap();
            match held.get(job.as_str()) {
                None => Err(HostError::UnknownJob(job.to_string())),
                Some(&allocated) if allocated > asked_at => Ok(Queued::AllocatedSince(allocated)),
                Some(_) => {
                    held.remove(job.as_str());
                    Ok(Queued::Released { killed: 1 })
                }
            }
        }
    }

    fn host(jobs: &[(&str, u64)]) -> FakeHost {
        let host = FakeHost::default();
        for (job, allocated) in jobs {
            host.held.lock().unwrap().insert(job.to_string(), at(*allocated));
        }
        host
    }

    fn queue(fs: &FakeFs) -> PendingReleases<&FakeFs> {
        PendingReleases::new(fs, PathBuf::from("/run/topo/release-pending"), ROOT)
    }

    #[test]
    fn a_queued_release_is_done_once_and_its_file_goes() {
        let now = SystemTime::now();
        let fs = FakeFs::new(&[("slurm-42", request(now)), ("slurm-43", request(now))]);
        let h = host(&[("slurm-42", 10), ("slurm-7", 10)]);
        let mut q = queue(&fs);
        assert_eq!(
            q.process(&h),
            [
                Outcome::Released { job: "slurm-42".into(), killed: 1 },
                Outcome::NotHeld { job: "slurm-43".into() },
            ]
        );
        assert!(fs.names().is_empty(), "both requests done");
        assert_eq!(h.held.lock().unwrap().keys().collect::<Vec<_>>(), ["slurm-7"]);
        assert!(q.process(&h).is_empty(), "nothing left to do");
        // A directory that is not there is no queue.
        let none = FakeFs { dir: None, entries: Default::default() };
        assert!(queue(&none).process(&h).is_empty());
    }

    #[test]
    fn a_job_allocated_again_since_the_request_is_kept() {
        let fs = FakeFs::new(&[("slurm-42", request(at(100)))]);
        let h = host(&[("slurm-42", 200)]);
        assert_eq!(queue(&fs).process(&h), [Outcome::AllocatedSince { job: "slurm-42".into() }]);
        assert!(h.held.lock().unwrap().contains_key("slurm-42"));
        assert!(fs.names().is_empty(), "the request was for the run that ended");
    }

    #[test]
    fn a_release_that_fails_is_kept_and_tried_again() {
        let fs = FakeFs::new(&[("slurm-1", request(at(100))), ("slurm-2", request(at(100)))]);
        let h = host(&[("slurm-1", 10), ("slurm-2", 10)]);
        h.failing.lock().unwrap().insert("slurm-1".into(), "survivors".into());
        h.failing.lock().unwrap().insert("slurm-2".into(), "releasing".into());
        let mut q = queue(&fs);
        let kept =
            [Outcome::Kept { job: "slurm-1".into() }, Outcome::Kept { job: "slurm-2".into() }];
        assert_eq!(q.process(&h), kept);
        assert_eq!(q.process(&h), kept);
        assert_eq!(fs.names(), ["slurm-1", "slurm-2"]);
        h.failing.lock().unwrap().clear();
        assert_eq!(q.process(&h).len(), 2);
        assert!(fs.names().is_empty() && h.held.lock().unwrap().is_empty());
        assert!(q.failing.is_empty());
    }

    #[test]
    fn only_what_root_wrote_is_acted_on() {
        let now = SystemTime::now();
        let good = request(now);
        let by = |uid| Inspected { uid, ..good.clone() };
        let mode = |mode| Inspected { mode, ..good.clone() };
        let kind = |kind| Inspected { kind, contents: None, ..good.clone() };
        let fs = FakeFs::new(&[
            ("slurm-1", by(1000)),
            ("slurm-2", mode(0o620)),
            ("slurm-3", mode(0o602)),
            ("slurm-4", kind(Kind::Symlink)),
            ("slurm-5", kind(Kind::Dir)),
            ("slurm-6", kind(Kind::Other)),
            ("slurm-7", Inspected { links: 2, ..good.clone() }),
            ("a;b", good.clone()),
            ("a b", good.clone()),
            ("a;b", good.clone()),
            ("slurm-8", mode(0o644)),
        ]);
        let jobs: Vec<(String, u64)> = (1..=8).map(|n| (format!("slurm-{n}"), 10)).collect();
        let h = FakeHost::default();
        for (job, t) in &jobs {
            h.held.lock().unwrap().insert(job.clone(), at(*t));
        }
        let outcomes = queue(&fs).process(&h);
        assert_eq!(*h.asked.lock().unwrap(), ["slurm-8"], "{outcomes:?}");
        assert_eq!(outcomes.iter().filter(|o| matches!(o, Outcome::Refused { .. })).count(), 9);
        assert!(fs.names().is_empty(), "refused entries are removed");
        for n in 1..=7 {
            assert!(h.held.lock().unwrap().contains_key(&format!("slurm-{n}")), "slurm-{n}");
        }
        // The same from a topod that is not root, for its own user's files.
        let fs = FakeFs::new(&[("slurm-1", by(1000)), ("slurm-2", by(1001))]);
        let mut q = PendingReleases::new(&fs, PathBuf::from("/tmp/q"), 1000);
        let outcomes = q.process(&h);
        assert!(matches!(&outcomes[0], Outcome::Released { job, .. } if job == "slurm-1"));
        assert!(matches!(&outcomes[1], Outcome::Refused { name } if name == "slurm-2"));
    }

    #[test]
    fn a_directory_others_could_write_is_not_touched() {
        let now = SystemTime::now();
        let h = host(&[("slurm-1", 10)]);
        for (dir, why) in [
            (Inspected { uid: 1000, ..dir_meta() }, "owned by uid 1000"),
            (Inspected { mode: 0o777, ..dir_meta() }, "writable by its group or others (mode 777)"),
            (Inspected { mode: 0o1777, ..dir_meta() }, "mode 1777"),
            (Inspected { mode: 0o770, ..dir_meta() }, "mode 770"),
            (Inspected { kind: Kind::Symlink, ..dir_meta() }, "a symbolic link"),
            (Inspected { kind: Kind::File, ..dir_meta() }, "not a directory"),
        ] {
            assert!(check_dir(&dir, ROOT).unwrap_err().contains(why), "{why}");
            let fs = FakeFs { dir: Some(dir), ..FakeFs::new(&[("slurm-1", request(now))]) };
            assert_eq!(queue(&fs).process(&h), [Outcome::DirRefused], "{why}");
            assert_eq!(fs.names(), ["slurm-1"], "nothing removed: {why}");
        }
        assert!(h.asked.lock().unwrap().is_empty());
        check_dir(&dir_meta(), ROOT).unwrap();
    }

    #[test]
    fn the_kernel_side_follows_no_link_and_opens_no_fifo() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("release-pending");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let me = nix::unistd::geteuid().as_raw();
        let socket = tmp.path().join("topod.sock");
        topo_client::queue_release(&socket, "slurm-1", "the test").unwrap();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, QueuedRelease::new(SystemTime::now(), "x").to_bytes()).unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::symlink(&victim, dir.join("slurm-2")).unwrap();
        nix::unistd::mkfifo(&dir.join("slurm-3"), nix::sys::stat::Mode::from_bits_truncate(0o600))
            .unwrap();
        std::fs::create_dir(dir.join("slurm-4")).unwrap();
        let h = host(&[("slurm-1", 10), ("slurm-2", 10), ("slurm-3", 10), ("slurm-4", 10)]);
        let mut q = PendingReleases::new(Kernel, dir.clone(), me);
        let outcomes = q.process(&h);
        assert_eq!(outcomes[0], Outcome::Released { job: "slurm-1".into(), killed: 1 });
        assert_eq!(outcomes.len(), 4, "{outcomes:?}");
        assert!(outcomes[1..].iter().all(|o| matches!(o, Outcome::Refused { .. })), "{outcomes:?}");
        assert_eq!(*h.asked.lock().unwrap(), ["slurm-1"]);
        assert!(victim.exists(), "a link is removed, never what it names");
        let left: Vec<_> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, [OsString::from("slurm-4")], "a directory is refused, and not removed");
        // The directory itself as a link, or open to others: nothing in it is read or removed.
        topo_client::queue_release(&socket, "slurm-5", "x").unwrap();
        let real = tmp.path().join("real");
        std::fs::rename(&dir, &real).unwrap();
        std::os::unix::fs::symlink(&real, &dir).unwrap();
        assert_eq!(q.process(&h), [Outcome::DirRefused]);
        assert!(real.join("slurm-5").exists());
        std::fs::remove_file(&dir).unwrap();
        std::fs::rename(&real, &dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o733)).unwrap();
        assert_eq!(q.process(&h), [Outcome::DirRefused]);
        assert!(dir.join("slurm-5").exists());
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert_eq!(
            q.process(&h),
            [
                Outcome::Refused { name: "slurm-4".into() },
                Outcome::NotHeld { job: "slurm-5".into() }
            ]
        );
        assert!(q.stuck.contains(OsStr::new("slurm-4")), "said once, not every pass");
        assert!(!dir.join("slurm-5").exists());
        // No directory: nothing to do.
        let mut none = PendingReleases::new(Kernel, tmp.path().join("none"), me);
        assert!(none.process(&h).is_empty());
    }

    #[test]
    fn requests_without_contents_and_temporary_files() {
        let now = SystemTime::now();
        let touched = Inspected { contents: Some(Vec::new()), mode: 0o644, ..request(at(500)) };
        match judge(OsStr::new("slurm-9"), &touched, ROOT, now) {
            Verdict::Release { job, asked_at, asked_by } => {
                assert_eq!((job.as_str(), asked_at), ("slurm-9", at(500)));
                assert!(asked_by.contains("no request"), "{asked_by}");
            }
            other => panic!("{other:?}"),
        }
        let huge =
            Inspected { contents: Some(vec![b' '; MAX_REQUEST_BYTES + 1]), ..request(at(500)) };
        assert!(matches!(
            judge(OsStr::new("slurm-9"), &huge, ROOT, now),
            Verdict::Release { asked_at, .. } if asked_at == at(500)
        ));
        let written = request(at(700));
        assert!(matches!(
            judge(OsStr::new("slurm-9"), &written, ROOT, now),
            Verdict::Release { asked_by, .. } if asked_by == "the Slurm job epilog (pid 7)"
        ));
        // A temporary file is left while it may be being written, removed once it is old.
        let tmp = request(now);
        assert_eq!(judge(OsStr::new(".slurm-9.77.tmp"), &tmp, ROOT, now), Verdict::Leave);
        let old = Inspected { modified: now - Duration::from_secs(3600), ..tmp };
        assert_eq!(judge(OsStr::new(".slurm-9.77.tmp"), &old, ROOT, now), Verdict::Clean);
        let fs = FakeFs::new(&[(".slurm-9.1.tmp", request(now)), (".slurm-9.2.tmp", old)]);
        assert!(queue(&fs).process(&host(&[])).is_empty());
        assert_eq!(fs.names(), [".slurm-9.1.tmp"]);
        // A file that could not be read is not a request, even from root.
        let unread = Inspected { contents: None, ..request(at(500)) };
        assert!(matches!(
            judge(OsStr::new("slurm-9"), &unread, ROOT, now),
            Verdict::Refuse { why } if why.contains("cannot read")
        ));
        // A name that is not text.
        use std::os::unix::ffi::OsStrExt;
        assert!(matches!(
            judge(OsStr::from_bytes(b"slurm-\xff"), &request(now), ROOT, now),
            Verdict::Refuse { .. }
        ));
    }
}
