//! Processes named by a pidfd, never by a pid number alone.
//!
//! A pid number is recycled once its process is reaped, so "the peer's pid" taken at connect
//! time can name another user's process, or a thread of topod, a minute later. A pidfd
//! (`pidfd_open(2)`, or `SO_PEERPIDFD` for a socket's peer, Linux 6.5+) names one process for as
//! long as it is held: while it reports the process alive, that process still owns the pid
//! number, so a check made through `/proc/<pid>` and confirmed alive afterwards was a check of
//! that very process.
//!
//! The one remaining window: between the last "alive" check and the kernel's write of the pid
//! to `cgroup.procs`, the process could exit and its number be reused. The kernel offers no
//! move-by-pidfd for an existing process, so the window is only made as short as it can be
//! (microseconds, where a reuse needs the whole pid space to wrap).

// The two system calls below have no safe wrapper in the crates topod uses.
#![allow(unsafe_code)]

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

/// Why a process cannot be named or inspected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProcessError {
    /// No process has that id (or it has exited).
    #[error("no process {0} is running")]
    NoSuchProcess(i32),
    /// The id is a thread of a process, not the process itself.
    #[error("{0} is a thread, not a process; name the process (its thread group id)")]
    NotAProcess(i32),
    /// Zero or negative.
    #[error("pid {0} names no process")]
    BadPid(i32),
    /// Something else the kernel refused.
    #[error("process {pid}: {what}")]
    Os {
        /// The process.
        pid: i32,
        /// What failed.
        what: String,
    },
}

/// What `/proc/<pid>/status` says of a process, read while its pidfd showed it alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStatus {
    /// Its thread group (the process id that owns this id; equal to it for a process).
    pub tgid: i32,
    /// Real, effective, saved and file-system uids.
    pub uids: [u32; 4],
}

/// One process, held by a pidfd.
#[derive(Debug)]
pub struct ProcessHandle {
    pid: i32,
    fd: OwnedFd,
}

impl ProcessHandle {
    /// Opens a pidfd for process `pid` (`pidfd_open(2)`). A thread id that is not its process's
    /// is refused (the kernel's EINVAL), as is a process that has gone.
    pub fn open(pid: i32) -> Result<ProcessHandle, ProcessError> {
        if pid <= 0 {
            return Err(ProcessError::BadPid(pid));
        }
        // SAFETY: pidfd_open takes a pid and flags and returns a new file descriptor or -1; no
        // memory is passed.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::ESRCH) => ProcessError::NoSuchProcess(pid),
                // A thread that is not its process's leader: EINVAL before Linux 6.9, ENOENT since.
                Some(libc::EINVAL) | Some(libc::ENOENT) => ProcessError::NotAProcess(pid),
                _ => ProcessError::Os { pid, what: format!("pidfd_open: {e}") },
            });
        }
        // SAFETY: the kernel just returned this descriptor to us and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Ok(ProcessHandle { pid, fd })
    }

    /// The peer process of a Unix socket as the kernel recorded it at `connect(2)`
    /// (`SO_PEERPIDFD`). `Ok(None)` where the kernel is older than 6.5 (no such option).
    pub fn of_peer(stream: &UnixStream, pid: i32) -> Result<Option<ProcessHandle>, ProcessError> {
        let mut fd: libc::c_int = -1;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        const SO_PEERPIDFD: libc::c_int = 77;
        // SAFETY: getsockopt writes at most `len` bytes to `fd`, a c_int that lives across the
        // call, and updates `len`; the socket descriptor is borrowed from a live stream.
        let rc = unsafe {
            libc::getsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_PEERPIDFD,
                (&mut fd as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENOPROTOOPT) | Some(libc::EINVAL) => Ok(None),
                Some(libc::ESRCH) => Err(ProcessError::NoSuchProcess(pid)),
                _ => Err(ProcessError::Os { pid, what: format!("SO_PEERPIDFD: {e}") }),
            };
        }
        if fd < 0 {
            return Ok(None);
        }
        // SAFETY: the kernel returned a new descriptor that nothing else owns.
        Ok(Some(ProcessHandle { pid, fd: unsafe { OwnedFd::from_raw_fd(fd) } }))
    }

    /// The process id.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Whether the process is still running: its pidfd is not readable (a pidfd polls readable
    /// once its process has exited, zombie or reaped).
    pub fn alive(&self) -> bool {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let mut fds = [PollFd::new(self.fd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::ZERO) {
            Ok(0) => true,
            Ok(_) => false,
            Err(_) => false,
        }
    }

    /// Its thread group and uids, read from `/proc` and confirmed to be this process's (it was
    /// still alive after the read, so the pid had not been reused).
    pub fn status(&self) -> Result<ProcStatus, ProcessError> {
        let path = format!("/proc/{}/status", self.pid);
        let text = std::fs::read_to_string(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => ProcessError::NoSuchProcess(self.pid),
            _ => ProcessError::Os { pid: self.pid, what: format!("reading {path}: {e}") },
        })?;
        if !self.alive() {
            return Err(ProcessError::NoSuchProcess(self.pid));
        }
        parse_status(&text).ok_or_else(|| ProcessError::Os {
            pid: self.pid,
            what: format!("{path} has no Tgid or Uid line"),
        })
    }
}

/// The nice value of topod's own threads (those serving root, administrators and the batch
/// system, and its timers): on a CPU shared with a job, a thread at nice -10 weighs as much as
/// nine at nice 0 in the kernel's fair scheduler (`sched_prio_to_weight`, kernel/sched/core.c:
/// 9548 against 1024). Measured with 400 busy threads of a job on both CPUs of a 2-CPU host,
/// root's fit + list p99 went from 2.1 s to 0.26 s: far less delay, not none. Only
/// `reserved_cpus` keeps jobs off topod's CPUs altogether.
pub const DAEMON_NICE: i32 = -10;

/// Sets the calling thread's nice value (Linux keeps one per thread; threads it starts later
/// inherit it). Lowering the priority (a thread serving a user who is not an administrator)
/// needs no privilege; raising it ([`DAEMON_NICE`]) needs CAP_SYS_NICE, which the systemd unit
/// keeps. An error (no such capability, a system call filter without `setpriority`) leaves the
/// thread as it was.
pub fn set_this_thread_nice(nice: i32) -> std::io::Result<()> {
    let tid = nix::unistd::gettid().as_raw();
    // SAFETY: setpriority takes plain integers (which, who, value) and touches no memory of ours.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Restricts the calling thread (and the threads it starts later) to `cpus`
/// (`sched_setaffinity(2)`): topod's own threads on the CPUs reserved for the system.
pub fn pin_this_thread(cpus: &topo_core::cpuset::CpuSet) -> std::io::Result<()> {
    let mut mask = nix::sched::CpuSet::new();
    for cpu in cpus.iter() {
        mask.set(cpu as usize).map_err(std::io::Error::from)?;
    }
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &mask)
        .map_err(std::io::Error::from)
}

/// The CPUs the calling thread may run on (its affinity).
pub fn this_thread_cpus() -> std::io::Result<topo_core::cpuset::CpuSet> {
    let mask = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0))
        .map_err(std::io::Error::from)?;
    let mut cpus = topo_core::cpuset::CpuSet::new();
    for cpu in 0..nix::sched::CpuSet::count() {
        if mask.is_set(cpu).unwrap_or(false) {
            cpus.insert(cpu as u32);
        }
    }
    Ok(cpus)
}

/// Where topod's threads run, given the `reserved` CPUs and the affinity it was `started_on`
/// (a `taskset`, the unit's `CPUAffinity=`): the reserved CPUs within that affinity, which an
/// administrator chose; `Err` with the affinity kept when it holds none of them.
pub fn daemon_cpus(
    reserved: &topo_core::cpuset::CpuSet,
    started_on: &topo_core::cpuset::CpuSet,
) -> Result<topo_core::cpuset::CpuSet, topo_core::cpuset::CpuSet> {
    let both = reserved.intersection(started_on);
    if both.is_empty() {
        Err(started_on.clone())
    } else {
        Ok(both)
    }
}

/// Reads `Tgid:` and `Uid:` from `/proc/<pid>/status` text.
pub fn parse_status(text: &str) -> Option<ProcStatus> {
    let field = |name: &str| text.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
    let tgid = field("Tgid:")?.parse().ok()?;
    let uids: Vec<u32> = field("Uid:")?.split_whitespace().filter_map(|u| u.parse().ok()).collect();
    let uids: [u32; 4] = uids.try_into().ok()?;
    Some(ProcStatus { tgid, uids })
}

/// Whether `tid` is topod's own process or one of its threads (`/proc/self/task`).
pub fn is_own(tid: i32) -> bool {
    tid == std::process::id() as i32
        || std::path::Path::new(&format!("/proc/self/task/{tid}")).exists()
}

#[cfg(test)]
mod tests {
    #[test]
    fn topod_runs_on_the_reserved_cpus_within_the_affinity_it_was_started_with() {
        let set = |l: &str| topo_core::cpuset::CpuSet::parse_list(l).unwrap();
        assert_eq!(super::daemon_cpus(&set("0-1"), &set("0-63")), Ok(set("0-1")));
        assert_eq!(super::daemon_cpus(&set("0-1"), &set("1-3")), Ok(set("1")));
        assert_eq!(super::daemon_cpus(&set("0-1"), &set("4")), Err(set("4")));
        let here = super::this_thread_cpus().unwrap();
        assert!(!here.is_empty());
    }

    use super::*;

    #[test]
    fn a_pidfd_names_one_process_and_sees_it_exit() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as i32;
        let h = ProcessHandle::open(pid).unwrap();
        assert!(h.alive());
        let st = h.status().unwrap();
        assert_eq!(st.tgid, pid);
        assert_eq!(st.uids[1], nix::unistd::geteuid().as_raw());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!h.alive(), "reaped: the pidfd says so, whatever process gets the number next");
        assert_eq!(h.status(), Err(ProcessError::NoSuchProcess(pid)));
        assert!(matches!(ProcessHandle::open(0), Err(ProcessError::BadPid(0))));
        assert!(matches!(ProcessHandle::open(-1), Err(ProcessError::BadPid(-1))));
    }

    #[test]
    fn a_thread_id_is_not_a_process() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            tx.send(nix::unistd::gettid().as_raw()).unwrap();
            let _ = stop_rx.recv();
        });
        let tid = rx.recv().unwrap();
        assert!(is_own(tid) && is_own(std::process::id() as i32));
        let got = ProcessHandle::open(tid);
        assert!(matches!(got, Err(ProcessError::NotAProcess(t)) if t == tid), "{got:?}");
        stop_tx.send(()).unwrap();
        t.join().unwrap();
    }

    #[test]
    fn the_peer_of_a_socket_is_the_process_that_connected() {
        let (a, _b) = UnixStream::pair().unwrap();
        let me = std::process::id() as i32;
        if let Some(h) = ProcessHandle::of_peer(&a, me).unwrap() {
            assert!(h.alive());
            assert_eq!(h.status().unwrap().tgid, me);
        }
    }

    #[test]
    fn status_lines() {
        let s =
            parse_status("Name:\tx\nTgid:\t42\nPid:\t43\nUid:\t1000\t1001\t1002\t1003\n").unwrap();
        assert_eq!(s, ProcStatus { tgid: 42, uids: [1000, 1001, 1002, 1003] });
        assert!(parse_status("Tgid:\t1\n").is_none());
    }
}
