//! The file system and processes under the cgroup backends, behind one trait: [`Kernel`] is the
//! real one, `fake_fs::FakeCgroupFs` a cgroup file system
//! emulated in a temporary directory, so the backends' own code runs in unit tests.
//!
//! [`Files`] wraps either with the helpers both backends share, each error carrying the path
//! and the data.

use super::{CgroupError, CgroupSpec, Effective, JobId};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use topo_core::cpuset::CpuSet;

/// What the cgroup backends do to the operating system.
pub trait CgroupFs: Send + Sync + std::fmt::Debug {
    /// Reads a whole file.
    fn read(&self, path: &Path) -> std::io::Result<Vec<u8>>;
    /// Writes `data` to an existing file in one `write(2)`, without creating or truncating it.
    fn write(&self, path: &Path, data: &[u8]) -> std::io::Result<()>;
    /// Makes one directory (`mkdir(2)`).
    fn create_dir(&self, path: &Path) -> std::io::Result<()>;
    /// Makes a directory and its missing parents.
    fn create_dir_all(&self, path: &Path) -> std::io::Result<()>;
    /// Removes one directory (`rmdir(2)`).
    fn remove_dir(&self, path: &Path) -> std::io::Result<()>;
    /// Whether `path` is a directory.
    fn is_dir(&self, path: &Path) -> bool;
    /// Whether `path` exists.
    fn exists(&self, path: &Path) -> bool;
    /// The directories directly under `path`.
    fn subdirs(&self, path: &Path) -> std::io::Result<Vec<PathBuf>>;
    /// Sends SIGKILL to `pid`; whether it was delivered.
    fn kill(&self, pid: i32) -> bool;
    /// The thread ids of process `pid` (`/proc/PID/task`), if it exists.
    fn threads(&self, pid: i32) -> Option<Vec<i32>>;
    /// This process's cgroups (`/proc/self/cgroup`), if they can be read.
    fn own_cgroups(&self) -> Option<String>;
    /// Sets thread `tid`'s CPU affinity to `cpus` (`sched_setaffinity(2)`); whether it took.
    fn set_affinity(&self, tid: i32, cpus: &CpuSet) -> bool;
    /// Reads `path` until `done` accepts its text or `timeout` passes, and says which. Between
    /// reads it waits for the kernel's "file modified" notification (`poll(2)` `POLLPRI` on a
    /// kernfs file such as v2's `cgroup.events`), not for a fixed sleep.
    fn watch(
        &self,
        path: &Path,
        timeout: Duration,
        done: &mut dyn FnMut(&str) -> bool,
    ) -> std::io::Result<bool>;
}

/// How long a wait for a cgroup state reads the file again at once before it sleeps or waits
/// for a notification: a freeze is usually reported within a millisecond, and the first sleep
/// or notification can cost ten (`topoctl bench freeze`).
pub const SPIN: Duration = Duration::from_millis(2);

/// Whether `path` is a directory of the file system `parent_dev` (a cgroup's child cgroup) that
/// is not the root of a mount, from one `statx(2)`: a bind mount of another cgroup of the same
/// hierarchy has the same device, so `STATX_ATTR_MOUNT_ROOT` (Linux 5.8) tells it apart; before
/// 5.8 the device alone does. A symbolic link is not followed, and a path the kernel cannot
/// describe is not walked into.
#[allow(unsafe_code)]
fn is_child_cgroup(path: &Path, parent_dev: u64) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(name) = std::ffi::CString::new(path.as_os_str().as_bytes()) else { return false };
    let mut buf = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: `name` is a NUL-terminated path that outlives the call, and `buf` is a writable
    // `struct statx` of the right size for the kernel to fill; no link is followed.
    let rc = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            name.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
            libc::STATX_TYPE,
            buf.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return false;
    }
    // SAFETY: statx returned 0, so it filled `buf`.
    let st = unsafe { buf.assume_init() };
    let mount_root = libc::STATX_ATTR_MOUNT_ROOT as u64;
    u32::from(st.stx_mode) & libc::S_IFMT == libc::S_IFDIR
        && libc::makedev(st.stx_dev_major, st.stx_dev_minor) == parent_dev
        && st.stx_attributes & st.stx_attributes_mask & mount_root == 0
}

/// The most cgroups nested in a job's that a release looks at (and removes): a bound on a
/// hostile tree, far above what a container runtime makes.
pub const MAX_NESTED: usize = 4096;

/// The real kernel: cgroup file systems, signals, `/proc`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Kernel;

impl CgroupFs for Kernel {
    fn read(&self, path: &Path) -> std::io::Result<Vec<u8>> {
        // Cgroup files report a size of 0, so the size probe (a stat) of fs::read buys nothing;
        // these reads are on every job's start and release.
        let mut file = std::fs::File::open(path)?;
        let mut bytes = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            match file.read(&mut chunk) {
                Ok(0) => return Ok(bytes),
                Ok(n) => bytes.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    fn write(&self, path: &Path, data: &[u8]) -> std::io::Result<()> {
        std::fs::OpenOptions::new()
            .write(true)
            .create(false)
            .truncate(false)
            .open(path)?
            .write_all(data)
    }

    fn create_dir(&self, path: &Path) -> std::io::Result<()> {
        std::fs::create_dir(path)
    }

    fn create_dir_all(&self, path: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(path)
    }

    fn remove_dir(&self, path: &Path) -> std::io::Result<()> {
        std::fs::remove_dir(path)
    }

    fn is_dir(&self, path: &Path) -> bool {
        path.is_dir()
    }

    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }

    fn subdirs(&self, path: &Path) -> std::io::Result<Vec<PathBuf>> {
        use std::os::unix::fs::MetadataExt;
        // Only directories of this very file system: a symbolic link or a mount inside a
        // cgroup (root in a job bind-mounting another cgroup, or any directory, there) is
        // not walked into, so that a release never kills or removes what is outside the job.
        // The entry's type comes with the directory listing: the control files cost no stat
        // (every release and auto-release tick lists each job's directories).
        let dev = std::fs::metadata(path)?.dev();
        Ok(std::fs::read_dir(path)?
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.path())
            .filter(|p| is_child_cgroup(p, dev))
            .collect())
    }

    fn kill(&self, pid: i32) -> bool {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL)
            .is_ok()
    }

    fn threads(&self, pid: i32) -> Option<Vec<i32>> {
        let entries = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
        entries
            .map(|t| t.ok().and_then(|t| t.file_name().to_str().and_then(|n| n.parse().ok())))
            .collect()
    }

    fn own_cgroups(&self) -> Option<String> {
        std::fs::read_to_string("/proc/self/cgroup").ok()
    }

    fn set_affinity(&self, tid: i32, cpus: &CpuSet) -> bool {
        let mut mask = nix::sched::CpuSet::new();
        // A CPU beyond what the kernel's mask type holds (1024) cannot be set; none is lost
        // silently: the set fails.
        if cpus.iter().any(|c| mask.set(c as usize).is_err()) {
            return false;
        }
        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(tid), &mask).is_ok()
    }

    fn watch(
        &self,
        path: &Path,
        timeout: Duration,
        done: &mut dyn FnMut(&str) -> bool,
    ) -> std::io::Result<bool> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        use std::os::fd::AsFd;
        use std::os::unix::fs::FileExt;
        // One open file: kernfs notifies the readers of an open file of each change after
        // their last read, so a change between the read and the poll is not missed.
        let file = std::fs::File::open(path)?;
        let start = Instant::now();
        let deadline = start + timeout;
        let mut buf = [0u8; 512];
        loop {
            let n = loop {
                match file.read_at(&mut buf, 0) {
                    Ok(n) => break n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            };
            if done(&String::from_utf8_lossy(&buf[..n])) {
                return Ok(true);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            // The kernel sends at most one change notification per file every 10 ms
            // (CGROUP_FILE_NOTIFY_MIN_INTV), so a change right after another is reported late:
            // read again at once for the first SPIN, then wait for the notification.
            if start.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            let ms = u16::try_from(left.as_millis().max(1)).unwrap_or(u16::MAX);
            let mut fds = [PollFd::new(file.as_fd(), PollFlags::POLLPRI)];
            match poll(&mut fds, PollTimeout::from(ms)) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// A [`CgroupFs`] with the helpers the backends share; errors carry the path and the data.
#[derive(Debug, Clone)]
pub struct Files(Arc<dyn CgroupFs>);

impl Default for Files {
    fn default() -> Self {
        Files(Arc::new(Kernel))
    }
}

impl Files {
    /// Over `fs`.
    pub fn new(fs: Arc<dyn CgroupFs>) -> Self {
        Files(fs)
    }

    /// The file system underneath.
    pub fn fs(&self) -> &dyn CgroupFs {
        &*self.0
    }

    pub(crate) fn read(&self, path: &Path) -> Result<String, CgroupError> {
        let bytes = self.0.read(path).map_err(|source| CgroupError::Io {
            action: "reading",
            path: path.to_path_buf(),
            data: None,
            source,
        })?;
        String::from_utf8(bytes).map_err(|e| CgroupError::Format {
            path: path.to_path_buf(),
            what: format!("not UTF-8 text: {e}"),
        })
    }

    /// Writes `data` to an existing cgroup file in one `write(2)` (the kernel takes one value
    /// per write), without creating or truncating it.
    pub(crate) fn write(&self, path: &Path, data: &str) -> Result<(), CgroupError> {
        self.0.write(path, data.as_bytes()).map_err(|source| CgroupError::Io {
            action: "writing",
            path: path.to_path_buf(),
            data: Some(data.to_string()),
            source,
        })
    }

    /// Makes `path`; whether it was made (false: it was there).
    pub(crate) fn mkdir(&self, path: &Path) -> Result<bool, CgroupError> {
        match self.0.create_dir(path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
            Err(source) => Err(CgroupError::Io {
                action: "creating",
                path: path.to_path_buf(),
                data: None,
                source,
            }),
        }
    }

    pub(crate) fn mkdir_all(&self, path: &Path) -> Result<(), CgroupError> {
        self.0.create_dir_all(path).map_err(|source| CgroupError::Io {
            action: "creating",
            path: path.to_path_buf(),
            data: None,
            source,
        })
    }

    /// Removes `path`; one already gone is not an error.
    pub(crate) fn rmdir(&self, path: &Path) -> Result<(), CgroupError> {
        match self.0.remove_dir(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(CgroupError::Io {
                action: "removing",
                path: path.to_path_buf(),
                data: None,
                source,
            }),
        }
    }

    pub(crate) fn is_dir(&self, path: &Path) -> bool {
        self.0.is_dir(path)
    }

    pub(crate) fn exists(&self, path: &Path) -> bool {
        self.0.exists(path)
    }

    /// The directories under `path`; none when it cannot be listed.
    pub(crate) fn subdirs(&self, path: &Path) -> Vec<PathBuf> {
        self.0.subdirs(path).unwrap_or_default()
    }

    /// The cgroups someone made inside the job cgroup `dir` (root in the job, a container
    /// runtime, systemd-run), deepest first, so that each can go before its parent: a job's
    /// release kills their processes too and removes them, or `rmdir` of the job's is EBUSY and
    /// the job and its CPUs stay held. At most [`MAX_NESTED`] of them.
    pub(crate) fn nested(&self, dir: &Path) -> Vec<PathBuf> {
        let mut found = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        // Each is listed after its parent; reversed, before it.
        while let Some(parent) = stack.pop() {
            for child in self.subdirs(&parent) {
                if found.len() == MAX_NESTED {
                    break;
                }
                found.push(child.clone());
                stack.push(child);
            }
        }
        found.reverse();
        found
    }

    /// The pids in `dir` and the cgroups nested in it; a nested one that went meanwhile holds
    /// none.
    pub(crate) fn read_pids_within(&self, dir: &Path) -> Result<Vec<i32>, CgroupError> {
        let mut pids = self.read_pids(&dir.join("cgroup.procs"))?;
        for inner in self.nested(dir) {
            match self.read_pids(&inner.join("cgroup.procs")) {
                Ok(p) => pids.extend(p),
                Err(CgroupError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        pids.sort_unstable();
        pids.dedup();
        Ok(pids)
    }

    /// Removes the job cgroup `dir` with the cgroups nested in it, deepest first; one made
    /// meanwhile (EBUSY) is looked for again, twice.
    pub(crate) fn rmdir_within(&self, dir: &Path) -> Result<(), CgroupError> {
        let mut tries = 0;
        loop {
            let removed = self.nested(dir).iter().try_for_each(|inner| self.rmdir(inner));
            match removed.and_then(|()| self.rmdir(dir)) {
                Err(CgroupError::Io { source, .. })
                    if source.raw_os_error() == Some(libc::EBUSY) && tries < 2 =>
                {
                    tries += 1;
                }
                done => return done,
            }
        }
    }

    /// [`CgroupFs::watch`], with the path in the error.
    pub(crate) fn watch(
        &self,
        path: &Path,
        timeout: Duration,
        mut done: impl FnMut(&str) -> bool,
    ) -> Result<bool, CgroupError> {
        self.0.watch(path, timeout, &mut done).map_err(|source| CgroupError::Io {
            action: "watching",
            path: path.to_path_buf(),
            data: None,
            source,
        })
    }

    pub(crate) fn read_set(&self, path: &Path) -> Result<CpuSet, CgroupError> {
        let text = self.read(path)?;
        CpuSet::parse_list(&text)
            .map_err(|e| CgroupError::Format { path: path.to_path_buf(), what: e.to_string() })
    }

    /// The pids in a `cgroup.procs` file. The kernel may list a pid twice while it migrates.
    pub(crate) fn read_pids(&self, path: &Path) -> Result<Vec<i32>, CgroupError> {
        let text = self.read(path)?;
        let mut pids = Vec::new();
        for word in text.split_whitespace() {
            let pid: i32 = word.parse().map_err(|_| CgroupError::Format {
                path: path.to_path_buf(),
                what: format!("{word:?} is not a pid"),
            })?;
            pids.push(pid);
        }
        pids.sort_unstable();
        pids.dedup();
        Ok(pids)
    }

    /// SIGKILL to each pid (again, if it was signalled before and is still listed while it
    /// dies); a pid that is already gone is not an error. `signalled` collects every pid
    /// signalled, so that a release reports each process once.
    /// Gives every thread of `pids` the CPU affinity `cpus` (a job's new CPUs after its cpuset
    /// changed). Since Linux 6.2 a cpuset change keeps a thread's own `sched_setaffinity` mask
    /// (intersected with the new CPUs), so a task the batch system pinned to one CPU would
    /// never reach the CPUs a grow adds, and a shrink could leave it on fewer than it has.
    /// Threads that exit meanwhile are no error; returns how many were set.
    pub(crate) fn set_affinity_all(&self, pids: &[i32], cpus: &CpuSet) -> usize {
        let me = std::process::id() as i32;
        let mut set = 0;
        for &pid in pids.iter().filter(|&&p| p > 0 && p != me) {
            for tid in self.0.threads(pid).unwrap_or_default() {
                if self.0.set_affinity(tid, cpus) {
                    set += 1;
                }
            }
        }
        set
    }

    pub(crate) fn kill_all(&self, pids: &[i32], signalled: &mut std::collections::BTreeSet<i32>) {
        let me = std::process::id() as i32;
        for &pid in pids {
            // Never topod itself, whatever put it in a job's cgroup.
            if pid > 0 && pid != me && self.0.kill(pid) {
                signalled.insert(pid);
            }
        }
    }

    /// The job cgroup directories under `root`, by job id. Directories whose names are not job
    /// ids (made by someone else) are left out.
    pub(crate) fn job_dirs(&self, root: &Path) -> Result<Vec<(JobId, PathBuf)>, CgroupError> {
        let dirs = self.0.subdirs(root).map_err(|source| CgroupError::Io {
            action: "listing",
            path: root.to_path_buf(),
            data: None,
            source,
        })?;
        let mut out: Vec<(JobId, PathBuf)> = dirs
            .into_iter()
            .filter_map(|d| {
                let name = d.file_name()?.to_string_lossy().into_owned();
                JobId::parse(&name).ok().map(|j| (j, d))
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// What topod wrote to a job cgroup's `cpuset.cpus` and `cpuset.mems`; `None` while either
    /// is empty (made, but topod died before the writes). Readiness is read here, never from
    /// the effective sets: a new v2 cpuset, and a v1 one under the `cpuset_v2_mode` mount
    /// option, shows its parent's CPUs as effective before any are written.
    pub(crate) fn configured(&self, dir: &Path) -> Result<Option<Effective>, CgroupError> {
        let set = Effective {
            cpus: self.read_set(&dir.join("cpuset.cpus"))?,
            mems: self.read_set(&dir.join("cpuset.mems"))?,
        };
        Ok((!set.cpus.is_empty() && !set.mems.is_empty()).then_some(set))
    }

    /// For a job cgroup that `create` found already made: the same spec again is idempotent,
    /// and one never configured is the caller's to finish; anything else is another
    /// allocation's.
    pub(crate) fn check_existing(
        &self,
        dir: &Path,
        job: &JobId,
        spec: &CgroupSpec,
    ) -> Result<(), CgroupError> {
        match self.configured(dir)? {
            Some(existing) if existing.cpus != spec.cpus || existing.mems != spec.mems => {
                Err(CgroupError::Exists {
                    job: job.to_string(),
                    existing: existing.cpus.to_string(),
                    wanted: spec.cpus.to_string(),
                })
            }
            _ => Ok(()),
        }
    }

    /// Refuses to freeze or kill a job cgroup that topod itself is in (`/proc/self/cgroup`):
    /// topod never moves itself into a job, but an administrator writing to `cgroup.procs` by
    /// hand can, and a release would then freeze topod in its own freezer.
    pub(crate) fn refuse_if_topod_inside(
        &self,
        job: &JobId,
        dirs: &[PathBuf],
    ) -> Result<(), CgroupError> {
        let Some(mine) = self.0.own_cgroups() else { return Ok(()) };
        for line in mine.lines() {
            let Some(path) = line.splitn(3, ':').nth(2).map(|p| p.trim_start_matches('/')) else {
                continue;
            };
            if !path.is_empty() && dirs.iter().any(|d| d.ends_with(path)) {
                return Err(CgroupError::Unsupported(format!(
                    "topod itself is in job {job}'s cgroup ({path}); refusing to freeze or kill it. Move topod out (echo {} > the parent's cgroup.procs) and release again",
                    std::process::id()
                )));
            }
        }
        Ok(())
    }
}

/// Polls `done` until it holds or `timeout` passes: every 50 us for the first 2 ms (a killed
/// process usually leaves within a millisecond, and a release waits on it), then backing off
/// to every 5 ms.
/// Calls `done` again and again, without sleeping, until it says yes or `limit` passes.
pub(crate) fn spin_until(
    limit: Duration,
    mut done: impl FnMut() -> Result<bool, CgroupError>,
) -> Result<bool, CgroupError> {
    let start = Instant::now();
    loop {
        if done()? {
            return Ok(true);
        }
        if start.elapsed() >= limit {
            return Ok(false);
        }
        std::hint::spin_loop();
    }
}

pub(crate) fn wait_until(
    timeout: Duration,
    mut done: impl FnMut() -> Result<bool, CgroupError>,
) -> Result<bool, CgroupError> {
    const EAGER: Duration = Duration::from_millis(2);
    let start = Instant::now();
    let mut pause = Duration::from_micros(50);
    loop {
        if done()? {
            return Ok(true);
        }
        let waited = start.elapsed();
        if waited >= timeout {
            return Ok(false);
        }
        std::thread::sleep(pause);
        if waited >= EAGER {
            pause = (pause * 2).min(Duration::from_millis(5));
        }
    }
}
