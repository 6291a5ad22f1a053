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
//! - the directory must be root's (topod's own user's, for a topod run without root), writable
//!   by topod and by no one else, not immutable, and not a link; otherwise nothing in it is read,
//!   removed or done, and topod says so once (topod keeps no CAP_DAC_OVERRIDE: a request it
//!   could not remove would be done again every pass, and after every restart);
//! - each file must be a regular file (never a link: nothing is followed), owned likewise, not
//!   writable by group or others, with one name; its name must be a job id topod accepts
//!   ([`JobId::parse`]) and is never used as a path; a file that fails is removed and logged,
//!   and its job is not touched;
//! - a job allocated again after the request was made (Slurm requeued it, and its new run started
//!   here) is not released: the request was for the run that ended (the time of the last
//!   allocation is in the job's record, so this holds after a restart too);
//! - an entry that cannot be removed (immutable, a directory) is left alone while it stays as it
//!   was, and each problem is said once until it changes (per entry, and per kind of problem
//!   with the directory), so the 5 s tick does not fill the log.
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
    /// Immutable or append-only (`chattr +i`, `+a`): its name cannot be removed (for a
    /// directory: no name in it can).
    pub pinned: bool,
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

/// Why the directory is not acted on (see [`check_dir`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DirProblem {
    /// A symbolic link (owned by this uid).
    Link(u32),
    /// Not a directory (owned by this uid).
    NotDir(u32),
    /// Owned by this uid, which is neither root nor topod's.
    Owner(u32),
    /// Writable by its group or others (its mode).
    Shared(u32),
    /// Not writable by its owner (its mode): topod, which keeps no CAP_DAC_OVERRIDE, could
    /// release a job but never remove its request, and would do it again after a restart.
    ReadOnly(u32),
    /// Immutable or append-only (`chattr +i`/`+a`): nothing in it can be removed.
    Pinned,
}

impl std::fmt::Display for DirProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DirProblem::Link(_) => write!(f, "a symbolic link"),
            DirProblem::NotDir(_) => write!(f, "not a directory"),
            DirProblem::Owner(uid) => write!(f, "owned by uid {uid}, not by topod's user"),
            DirProblem::Shared(mode) => {
                write!(f, "writable by its group or others (mode {:o})", mode & 0o7777)
            }
            DirProblem::ReadOnly(mode) => write!(
                f,
                "not writable by its owner (mode {:o}), so topod could not remove a request once done",
                mode & 0o7777
            ),
            DirProblem::Pinned => write!(
                f,
                "immutable or append-only (lsattr -d shows it), so topod could not remove a request once done"
            ),
        }
    }
}

impl DirProblem {
    /// Which kind of problem: each is said once ([`PendingReleases`]), whatever comes between.
    fn key(&self) -> &'static str {
        match self {
            DirProblem::Link(_) => "dir:link",
            DirProblem::NotDir(_) => "dir:not-dir",
            DirProblem::Owner(_) => "dir:owner",
            DirProblem::Shared(_) => "dir:shared",
            DirProblem::ReadOnly(_) => "dir:read-only",
            DirProblem::Pinned => "dir:pinned",
        }
    }

    /// What fixes it, for the directory `path`: never a `chown` or `chmod` of what another user
    /// made (either would follow a link, or adopt a directory with what its maker put in it).
    fn fix(&self, path: &Path, me: u32, socket_dir_open: bool) -> String {
        let shown = path.display();
        match *self {
            DirProblem::Link(uid) | DirProblem::NotDir(uid) | DirProblem::Owner(uid)
                if uid != 0 && uid != me =>
            {
                topo_core::pending::remove_foreign(path, uid, socket_dir_open)
            }
            DirProblem::Link(_) | DirProblem::NotDir(_) => format!("remove {shown}"),
            // Root's, for a topod that is not root: topod must be able to remove requests.
            DirProblem::Owner(_) => format!("chown {me} {shown}"),
            DirProblem::Shared(_) | DirProblem::ReadOnly(_) => format!("chmod 700 {shown}"),
            DirProblem::Pinned => format!("chattr -i -a {shown}"),
        }
    }
}

/// Whether the directory may be acted on: a directory (not a link) of topod's own user (root),
/// which topod can write and no one else can (topod keeps no CAP_DAC_OVERRIDE: a request it
/// could not remove would be done again every pass, and after every restart).
pub fn check_dir(dir: &Inspected, me: u32) -> Result<(), DirProblem> {
    match dir.kind {
        Kind::Dir => {}
        Kind::Symlink => return Err(DirProblem::Link(dir.uid)),
        _ => return Err(DirProblem::NotDir(dir.uid)),
    }
    if dir.uid != me {
        return Err(DirProblem::Owner(dir.uid));
    }
    if dir.mode & 0o022 != 0 {
        return Err(DirProblem::Shared(dir.mode));
    }
    if dir.mode & 0o300 != 0o300 {
        return Err(DirProblem::ReadOnly(dir.mode));
    }
    if dir.pinned {
        return Err(DirProblem::Pinned);
    }
    Ok(())
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
    if file.pinned {
        // Done, it could not be removed, and would be done again after every restart.
        return Verdict::Refuse {
            why:
                "immutable or append-only (lsattr shows it), so topod could not remove it once done"
                    .into(),
        };
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
    /// An entry that could not be removed before, unchanged since: left alone.
    Stuck {
        /// The entry's name.
        name: String,
    },
}

/// How many things said (about entries and conditions) are remembered, so that each is said
/// once until it changes; past that, a new one is said every pass it happens.
const MAX_SAID: usize = 4096;

/// How long the directory must have been usable (or absent) before a problem with it that was
/// said before is said again when it comes back (one that comes and goes every pass is said
/// once, not every pass).
const DIR_QUIET: Duration = Duration::from_secs(600);

/// What was said, per entry or condition (`key`), each once until it changes; bounded by
/// [`MAX_SAID`].
#[derive(Debug, Default)]
struct Said(BTreeMap<String, String>);

impl Said {
    /// Whether `what` is new for `key` (and so to be said); remembers it.
    fn first_time(&mut self, key: &str, what: &str) -> bool {
        if self.0.get(key).map(String::as_str) == Some(what) {
            return false;
        }
        if self.0.len() < MAX_SAID || self.0.contains_key(key) {
            self.0.insert(key.to_string(), what.to_string());
        }
        true
    }

    /// Forgets what was said under keys with `prefix` that `keep` refuses.
    fn forget(&mut self, prefix: &str, keep: impl Fn(&str) -> bool) {
        self.0.retain(|k, _| !k.starts_with(prefix) || keep(&k[prefix.len()..]));
    }
}

/// What an entry that could not be removed was, to know it again: it is left alone until it
/// changes (acting on it again would release the same job every pass).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    kind: Kind,
    uid: u32,
    mode: u32,
    modified: SystemTime,
}

impl Seen {
    fn of(it: &Inspected) -> Seen {
        Seen { kind: it.kind, uid: it.uid, mode: it.mode, modified: it.modified }
    }
}

/// How loud a line is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Level {
    Info,
    Warn,
}

/// The queue, processed one pass at a time.
pub struct PendingReleases<F: PendingFs> {
    fs: F,
    dir: PathBuf,
    me: u32,
    /// What was said about the directory (per kind of problem, `dir:`) and its entries
    /// (`entry:`, `remove:`, per name), each said once until it changes.
    said: Said,
    /// Since when the directory has been usable (or absent); problems with it are forgotten
    /// after [`DIR_QUIET`] of that.
    dir_fine_since: Option<SystemTime>,
    /// Whether the socket's directory was looked at (at the first pass, as topod starts).
    socket_dir_checked: bool,
    /// Jobs whose release failed, with the last error said (said again only when it changes).
    failing: BTreeMap<String, String>,
    /// Entries that could not be removed, as they were: left alone while they stay so.
    stuck: BTreeMap<OsString, Seen>,
    /// Every line said, for the tests.
    #[cfg(test)]
    lines: Vec<String>,
}

impl<F: PendingFs> PendingReleases<F> {
    /// The queue in `dir` (`topo_core::pending::pending_dir_for` topod's socket), for a topod
    /// running as uid `me`.
    pub fn new(fs: F, dir: PathBuf, me: u32) -> Self {
        PendingReleases {
            fs,
            dir,
            me,
            said: Said::default(),
            dir_fine_since: None,
            socket_dir_checked: false,
            failing: BTreeMap::new(),
            stuck: BTreeMap::new(),
            #[cfg(test)]
            lines: Vec::new(),
        }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Does every release queued now; logs one line per job (and per refused file), each
    /// problem once until it changes.
    pub fn process(&mut self, releaser: &impl Releaser) -> Vec<Outcome> {
        self.process_at(releaser, SystemTime::now())
    }

    /// [`PendingReleases::process`] at `now`.
    pub fn process_at(&mut self, releaser: &impl Releaser, now: SystemTime) -> Vec<Outcome> {
        if !self.socket_dir_checked {
            self.socket_dir_checked = true;
            if let Some(problem) = self.socket_dir_problem() {
                self.say(
                    Level::Warn,
                    format!("{problem} (any user can then stop Slurm's epilogs from queueing releases there, or plant entries in it)"),
                );
            }
        }
        let opened = match self.fs.open_dir(&self.dir) {
            Ok(Some(opened)) => opened,
            Ok(None) => {
                self.dir_usable(now, &BTreeSet::new());
                return Vec::new();
            }
            Err(e) => {
                let what = format!("cannot open {}: {e}", self.dir.display());
                self.dir_refused("dir:open", what);
                return vec![Outcome::DirRefused];
            }
        };
        let dir = match (check_dir(&opened.1, self.me), opened.0) {
            (Ok(()), Some(dir)) => dir,
            (Ok(()), None) => return vec![Outcome::DirRefused],
            (Err(problem), _) => {
                let socket = self.socket_dir_problem();
                let fix = problem.fix(&self.dir, self.me, socket.is_some());
                let mut what = format!(
                    "{} is {problem}; queued releases there are not done until it is fixed: {fix}",
                    self.dir.display()
                );
                if let Some(socket) = socket {
                    what = format!("{what} ({socket})");
                }
                self.dir_refused(problem.key(), what);
                return vec![Outcome::DirRefused];
            }
        };
        let mut names = match self.fs.list(&dir) {
            Ok(names) => names,
            Err(e) => {
                let what = format!("cannot list {}: {e}", self.dir.display());
                self.dir_refused("dir:list", what);
                return vec![Outcome::DirRefused];
            }
        };
        names.sort();
        self.dir_usable(now, &names.iter().cloned().collect());
        let mut outcomes = Vec::new();
        for name in names {
            let shown = name.to_string_lossy().into_owned();
            let path = self.dir.join(&name);
            let file = match self.fs.inspect(&dir, &name) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => {
                    let what = format!("queued release {}: cannot read it: {e}", path.display());
                    self.say_about(&format!("entry:{shown}"), Level::Warn, what);
                    continue;
                }
            };
            if self.stuck.get(&name) == Some(&Seen::of(&file)) {
                // Could not be removed, and unchanged since: done (or refused) already.
                outcomes.push(Outcome::Stuck { name: shown });
                continue;
            }
            self.stuck.remove(&name);
            match judge(&name, &file, self.me, now) {
                Verdict::Leave => {}
                Verdict::Clean => {
                    let what = format!(
                        "removing {}, left by a writer that did not finish",
                        path.display()
                    );
                    self.say_about(&format!("entry:{shown}"), Level::Info, what);
                    self.remove(&dir, &name, &file);
                }
                Verdict::Refuse { why } => {
                    let what = format!(
                        "queued release {}: refused (it is {why}); nothing released",
                        path.display()
                    );
                    self.say_about(&format!("entry:{shown}"), Level::Warn, what);
                    self.remove(&dir, &name, &file);
                    outcomes.push(Outcome::Refused { name: shown });
                }
                Verdict::Release { job, asked_at, asked_by } => {
                    let (outcome, done) = self.release_one(releaser, &job, asked_at, &asked_by);
                    if done {
                        self.remove(&dir, &name, &file);
                    }
                    outcomes.push(outcome);
                }
            }
        }
        outcomes
    }

    /// Removes an entry; one that will not go is said once and left alone while it stays as
    /// it is.
    fn remove(&mut self, dir: &F::Dir, name: &OsStr, file: &Inspected) {
        if let Err(e) = self.fs.remove(dir, name) {
            let what = format!(
                "queued release {}: cannot remove it: {e}; topod leaves it alone until it changes",
                self.dir.join(name).display()
            );
            self.say_about(&format!("remove:{}", name.to_string_lossy()), Level::Warn, what);
            self.stuck.insert(name.to_os_string(), Seen::of(file));
        }
    }

    /// What is wrong with the socket's directory (the queue's parent), if anything.
    fn socket_dir_problem(&self) -> Option<String> {
        let parent = match self.dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let (_, it) = self.fs.open_dir(parent).ok()??;
        topo_core::pending::socket_dir_problem(
            parent,
            it.kind == Kind::Symlink,
            it.uid,
            it.mode,
            self.me,
        )
    }

    /// The directory could not be used, for this kind of problem (`key`): said once until it
    /// changes, even when it comes and goes.
    fn dir_refused(&mut self, key: &str, what: String) {
        self.dir_fine_since = None;
        self.say_about(key, Level::Warn, what);
    }

    /// The directory is usable (or absent) at `now` and holds `names`: what was said about
    /// entries that are gone is forgotten, and about the directory once it has been usable for
    /// [`DIR_QUIET`].
    fn dir_usable(&mut self, now: SystemTime, names: &BTreeSet<OsString>) {
        let since = *self.dir_fine_since.get_or_insert(now);
        if now.duration_since(since).unwrap_or_default() >= DIR_QUIET {
            self.said.forget("dir:", |_| false);
        }
        let present: BTreeSet<String> =
            names.iter().map(|n| n.to_string_lossy().into_owned()).collect();
        self.said.forget("entry:", |n| present.contains(n));
        self.said.forget("remove:", |n| present.contains(n));
        self.stuck.retain(|n, _| names.contains(n));
        self.failing.retain(|job, _| present.contains(job));
    }

    /// Says `what` under `key` unless it was said there last.
    fn say_about(&mut self, key: &str, level: Level, what: String) {
        if self.said.first_time(key, &what) {
            self.say(level, what);
        }
    }

    fn say(&mut self, level: Level, what: String) {
        match level {
            Level::Info => tracing::info!("{what}"),
            Level::Warn => tracing::warn!("{what}"),
        }
        #[cfg(test)]
        self.lines.push(what);
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
                self.say(
                    Level::Info,
                    format!("released {job}, which ended while topod was unreachable; {asked}{killed_some}"),
                );
                Outcome::Released { job: name, killed }
            }
            Err(HostError::UnknownJob(_)) => {
                self.say(
                    Level::Info,
                    format!("queued release of {job} done: topod holds nothing for it ({asked})"),
                );
                Outcome::NotHeld { job: name }
            }
            Ok(Queued::AllocatedSince(at)) => {
                self.say(
                    Level::Info,
                    format!(
                        "queued release of {job} dropped ({asked}): the job was allocated again since, at {}; it keeps its CPUs",
                        format_utc(at)
                    ),
                );
                Outcome::AllocatedSince { job: name }
            }
            // A release under way (the epilog's own, which timed out): the next pass sees.
            Err(HostError::Releasing(_)) => return (Outcome::Kept { job: name }, false),
            Err(e) => {
                let message = e.to_string();
                if self.failing.get(&name) != Some(&message) {
                    let what = format!(
                        "queued release of {job} ({asked}) failed: {message}; kept in {}, tried again every 5 s",
                        self.dir.display()
                    );
                    self.say(Level::Warn, what);
                    self.failing.insert(name.clone(), message);
                }
                return (Outcome::Kept { job: name }, false);
            }
        };
        self.failing.remove(job.as_str());
        (outcome, true)
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
            pinned: false,
            contents,
        }
    }
}

/// Whether what `file` opened is immutable or append-only (`chattr +i`, `+a`): then its name
/// cannot be removed, nor (for a directory) any name in it. A file system without these flags
/// says so (ENOTTY), and nothing there is.
#[allow(unsafe_code)]
fn pinned(file: &std::fs::File) -> bool {
    use std::os::fd::AsRawFd;
    // From <linux/fs.h>; not in the libc crate.
    const FS_IMMUTABLE_FL: libc::c_int = 0x10;
    const FS_APPEND_FL: libc::c_int = 0x20;
    let mut flags: libc::c_int = 0;
    // SAFETY: the descriptor is open for the whole call (`file` is borrowed), and
    // FS_IOC_GETFLAGS writes one int (despite its encoded size; e2fsprogs passes an int too) to
    // the pointer, which points at a live c_int of this frame.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) };
    rc == 0 && flags & (FS_IMMUTABLE_FL | FS_APPEND_FL) != 0
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
                let inspected = Inspected { pinned: pinned(&dir), ..Self::inspected(&stat, None) };
                Ok(Some((Some(dir), inspected)))
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
        let is_pinned = pinned(&file);
        let mut contents = Vec::new();
        if Self::inspected(&stat, None).kind == Kind::File {
            file.take(MAX_REQUEST_BYTES as u64 + 1).read_to_end(&mut contents)?;
        }
        Ok(Inspected { pinned: is_pinned, ..Self::inspected(&stat, Some(contents)) })
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
            pinned: false,
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
            pinned: false,
            contents: None,
        }
    }

    /// A directory in memory.
    struct FakeFs {
        /// The queue's directory (the socket's directory is root's, mode 0755, unless
        /// `socket_dir` says otherwise).
        dir: RefCell<Option<Inspected>>,
        socket_dir: Option<Inspected>,
        entries: RefCell<BTreeMap<OsString, Inspected>>,
        /// Names whose removal fails (an immutable file, a directory).
        unremovable: BTreeSet<OsString>,
    }

    impl FakeFs {
        fn new(entries: &[(&str, Inspected)]) -> FakeFs {
            FakeFs {
                dir: RefCell::new(Some(dir_meta())),
                socket_dir: None,
                entries: RefCell::new(
                    entries.iter().map(|(n, i)| (OsString::from(n), i.clone())).collect(),
                ),
                unremovable: BTreeSet::new(),
            }
        }
        fn names(&self) -> Vec<String> {
            self.entries.borrow().keys().map(|k| k.to_string_lossy().into_owned()).collect()
        }
    }

    impl PendingFs for &FakeFs {
        type Dir = ();
        fn open_dir(&self, path: &Path) -> std::io::Result<Option<(Option<()>, Inspected)>> {
            let it = if path.ends_with(topo_core::pending::PENDING_DIR_NAME) {
                self.dir.borrow().clone()
            } else {
                Some(self.socket_dir.clone().unwrap_or(Inspected { mode: 0o755, ..dir_meta() }))
            };
            Ok(it.map(|d| ((d.kind == Kind::Dir).then_some(()), d)))
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
            if self.unremovable.contains(name) {
                return Err(std::io::Error::from_raw_os_error(libc::EPERM));
            }
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
        let none = FakeFs { dir: RefCell::new(None), ..FakeFs::new(&[]) };
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
        // The same from a topod that is not root, for its own user's files (in its own
        // directory: it could not remove a request from root's).
        let fs = FakeFs {
            dir: RefCell::new(Some(Inspected { uid: 1000, ..dir_meta() })),
            ..FakeFs::new(&[("slurm-1", by(1000)), ("slurm-2", by(1001))])
        };
        let mut q = PendingReleases::new(&fs, PathBuf::from("/tmp/q/release-pending"), 1000);
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
            assert!(check_dir(&dir, ROOT).unwrap_err().to_string().contains(why), "{why}");
            let fs = FakeFs {
                dir: RefCell::new(Some(dir)),
                ..FakeFs::new(&[("slurm-1", request(now))])
            };
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
            [Outcome::Stuck { name: "slurm-4".into() }, Outcome::NotHeld { job: "slurm-5".into() }]
        );
        assert!(q.stuck.contains_key(OsStr::new("slurm-4")), "said once, not every pass");
        assert!(!dir.join("slurm-5").exists());
        // No directory: nothing to do.
        let mut none = PendingReleases::new(Kernel, tmp.path().join("none"), me);
        assert!(none.process(&h).is_empty());
    }

    #[test]
    fn a_request_that_cannot_be_removed_is_acted_on_once() {
        // An immutable file (or one on a file system that will not let it go): done once, then
        // left alone; it would otherwise be done again every pass, and after every restart.
        let mut fs = FakeFs::new(&[("slurm-77", request(at(100))), ("slurm-78", request(at(100)))]);
        fs.unremovable.insert("slurm-77".into());
        let h = host(&[("slurm-78", 10)]);
        let mut q = queue(&fs);
        q.process(&h);
        q.process(&h);
        q.process(&h);
        assert_eq!(*h.asked.lock().unwrap(), ["slurm-77", "slurm-78"]);
        assert_eq!(fs.names(), ["slurm-77"]);
    }

    #[test]
    fn a_queue_directory_topod_cannot_write_is_not_acted_on() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("release-pending");
        let me = nix::unistd::geteuid().as_raw();
        topo_client::queue_release(&tmp.path().join("topod.sock"), "slurm-11", "x").unwrap();
        // Root's, mode 0500: topod (without CAP_DAC_OVERRIDE) could release but never remove.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o500)).unwrap();
        let h = host(&[("slurm-11", 10)]);
        let mut q = PendingReleases::new(Kernel, dir.clone(), me);
        assert_eq!(q.process(&h), [Outcome::DirRefused]);
        assert!(h.asked.lock().unwrap().is_empty(), "nothing done that could not be undone");
        assert!(dir.join("slurm-11").exists());
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert_eq!(q.process(&h), [Outcome::Released { job: "slurm-11".into(), killed: 1 }]);
    }

    #[test]
    fn each_problem_is_said_once_until_it_changes() {
        let now = SystemTime::now();
        let old = now - Duration::from_secs(3600);
        let leftover = Inspected { kind: Kind::Dir, modified: old, contents: None, ..request(old) };
        let pinned = Inspected { pinned: true, ..request(at(100)) };
        let mut fs = FakeFs::new(&[(".x", leftover), ("slurm-77", pinned)]);
        fs.unremovable.insert(".x".into());
        fs.unremovable.insert("slurm-77".into());
        let h = host(&[("slurm-77", 10)]);
        let mut q = queue(&fs);
        for pass in 0..5 {
            q.process_at(&h, now + Duration::from_secs(5 * pass));
        }
        assert!(h.asked.lock().unwrap().is_empty(), "a request that cannot be removed is not done");
        assert_eq!(q.lines.len(), 4, "{:#?}", q.lines);
        assert!(q.lines[0].contains("removing /run/topo/release-pending/.x"), "{}", q.lines[0]);
        assert!(q.lines[1].contains(".x: cannot remove it"), "{}", q.lines[1]);
        assert!(q.lines[2].contains("slurm-77: refused (it is immutable"), "{}", q.lines[2]);
        assert!(q.lines[3].contains("slurm-77: cannot remove it"), "{}", q.lines[3]);
        // Gone, then back: said again.
        fs.entries.borrow_mut().remove(OsStr::new("slurm-77"));
        q.process_at(&h, now + Duration::from_secs(30));
        fs.entries
            .borrow_mut()
            .insert("slurm-77".into(), Inspected { pinned: true, ..request(at(200)) });
        q.process_at(&h, now + Duration::from_secs(35));
        assert_eq!(q.lines.len(), 6, "{:#?}", q.lines);

        // A directory a user swaps between a directory of theirs and a link, every pass.
        let fs = FakeFs::new(&[("slurm-1", request(now))]);
        let mut q = queue(&fs);
        let theirs = Inspected { uid: 1000, ..dir_meta() };
        let link = Inspected { kind: Kind::Symlink, uid: 1000, ..dir_meta() };
        for pass in 0..20 {
            let it = if pass % 2 == 0 { theirs.clone() } else { link.clone() };
            *fs.dir.borrow_mut() = Some(it);
            assert_eq!(
                q.process_at(&h, now + Duration::from_secs(5 * pass)),
                [Outcome::DirRefused]
            );
        }
        assert_eq!(q.lines.len(), 2, "{:#?}", q.lines);
        // Fixed for a while, then broken again: said again.
        *fs.dir.borrow_mut() = None;
        q.process_at(&h, now + Duration::from_secs(200));
        q.process_at(&h, now + Duration::from_secs(200) + DIR_QUIET);
        *fs.dir.borrow_mut() = Some(link);
        q.process_at(&h, now + Duration::from_secs(205) + DIR_QUIET);
        assert_eq!(q.lines.len(), 3, "{:#?}", q.lines);
    }

    #[test]
    fn another_users_entry_is_to_be_removed_never_adopted() {
        // The socket's directory is like /tmp: a user made release-pending first.
        let fs = FakeFs {
            dir: RefCell::new(Some(Inspected { uid: 1000, ..dir_meta() })),
            socket_dir: Some(Inspected { mode: 0o1777, ..dir_meta() }),
            ..FakeFs::new(&[("slurm-1", request(SystemTime::now()))])
        };
        let mut q = queue(&fs);
        assert_eq!(q.process(&host(&[])), [Outcome::DirRefused]);
        assert_eq!(q.lines.len(), 2, "{:#?}", q.lines);
        assert!(
            q.lines[0].starts_with("topod's socket directory /run/topo is writable by others (mode 1777): move the socket to a directory only root can write, e.g. /run/topo"),
            "{}",
            q.lines[0]
        );
        let refused = &q.lines[1];
        assert!(
            refused.contains("remove /run/topo/release-pending, which uid 1000 created, and move the socket to a directory only root can write"),
            "{refused}"
        );
        assert!(!refused.contains("chown") && !refused.contains("chmod"), "{refused}");
        // Root's own directory with the wrong mode: chmod is safe, and said.
        let fs = FakeFs {
            dir: RefCell::new(Some(Inspected { mode: 0o500, ..dir_meta() })),
            ..FakeFs::new(&[])
        };
        let mut q = queue(&fs);
        assert_eq!(q.process(&host(&[])), [Outcome::DirRefused]);
        assert_eq!(q.lines.len(), 1, "the socket's directory is fine: {:#?}", q.lines);
        assert!(q.lines[0].contains("not writable by its owner (mode 500)"), "{}", q.lines[0]);
        assert!(q.lines[0].ends_with("chmod 700 /run/topo/release-pending"), "{}", q.lines[0]);
    }

    #[test]
    fn an_immutable_request_is_not_done() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("release-pending");
        let me = nix::unistd::geteuid().as_raw();
        let file =
            topo_client::queue_release(&tmp.path().join("topod.sock"), "slurm-77", "x").unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let chattr = |flag: &str, path: &Path| {
            std::process::Command::new("chattr")
                .arg(flag)
                .arg(path)
                .status()
                .is_ok_and(|s| s.success())
        };
        if !chattr("+i", &file) {
            eprintln!("SKIP: chattr +i needs root and a file system with the flag");
            return;
        }
        let h = host(&[("slurm-77", 10)]);
        let mut q = PendingReleases::new(Kernel, dir.clone(), me);
        let first = q.process(&h);
        let second = q.process(&h);
        chattr("-i", &file);
        assert_eq!(first, [Outcome::Refused { name: "slurm-77".into() }]);
        assert_eq!(second, [Outcome::Stuck { name: "slurm-77".into() }]);
        assert!(h.asked.lock().unwrap().is_empty());
        // The directory itself immutable: not acted on at all.
        assert!(chattr("+i", &dir));
        let third = q.process(&h);
        chattr("-i", &dir);
        assert_eq!(third, [Outcome::DirRefused]);
        assert!(q.lines.iter().any(|l| l.contains("immutable or append-only")), "{:#?}", q.lines);
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
