//! The job side of a malleable job's resizes: reading and waiting for topod's notify file.
//!
//! When topod grows or shrinks a running job's cpuset it atomically rewrites the job's notify
//! file, `<notify_dir>/<job id>` (written to a temporary file in the same directory, then
//! renamed over the old one), whose path the job's processes find in `TOPO_NOTIFY_FILE`:
//!
//! ```text
//! generation=3
//! cpus=0-3,8-11
//! mems=0
//! ```
//!
//! `generation` is 1 when the job is allocated and grows by one at every change, so a program
//! that remembers the last generation it acted on knows whether there is something new.
//!
//! [`wait`] watches the file's directory with inotify (a rename over the file arrives as
//! `IN_MOVED_TO`, a write in place as `IN_CLOSE_WRITE`) rather than the file itself, whose inode
//! every rename replaces. The watch is set up before the first read, so a change that lands
//! between that read and the first wait still wakes it. One inotify instance per call, closed on
//! return: no threads and no state, so it is safe in any thread of any program.

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use std::ffi::OsStr;
use std::io::Read;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use topo_core::cpuset::CpuSet;

/// The variable topo-exec (and the batch plug-ins) set to the job's notify file.
pub const NOTIFY_FILE_ENV: &str = "TOPO_NOTIFY_FILE";

/// More than any real notify file holds (a list of every other CPU of an 8192-CPU machine is
/// about 40 KB); a longer file is not one topod wrote.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// What the notify file says: the job's CPUs as of one generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// 1 at allocation, one more at every change of the job's CPUs.
    pub generation: u64,
    /// The job's CPUs from this generation on; never empty.
    pub cpus: CpuSet,
    /// The job's memory nodes, when the file says (topod always writes them).
    pub mems: Option<CpuSet>,
}

/// Why the notify file could not be read or waited for.
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    /// No path was given and the environment has none.
    #[error("no notify file: none given and {NOTIFY_FILE_ENV} is not set (topo-exec sets it for a job's processes)")]
    NoEnv,
    /// The path names no file in a directory (empty, `/`, ends in `..`).
    #[error("notify file {path:?} is not the path of a file")]
    NotAFilePath { path: PathBuf },
    /// The file cannot be opened or read (most often: it does not exist).
    #[error("cannot read notify file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    /// The file's content is not what topod writes.
    #[error("notify file {path} is malformed: {reason}")]
    Malformed { path: PathBuf, reason: String },
    /// The directory cannot be watched (no inotify, too many instances, no read permission).
    #[error("cannot watch {dir} for changes of the notify file: {source}")]
    Watch { dir: PathBuf, source: Errno },
}

/// The path to use: `given`, else `$TOPO_NOTIFY_FILE`.
pub fn resolve(given: Option<&str>) -> Result<PathBuf, NotifyError> {
    match given {
        Some(path) => Ok(PathBuf::from(path)),
        None => std::env::var_os(NOTIFY_FILE_ENV)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .ok_or(NotifyError::NoEnv),
    }
}

/// Reads the content of a notify file: one `key=value` per line. `generation` and `cpus` are
/// required, `mems` is checked when present, blank lines and keys this version does not know
/// are skipped (so topod can add keys without breaking older programs).
pub fn parse(text: &str) -> Result<Notice, String> {
    let mut generation = None;
    let mut cpus = None;
    let mut mems = None;
    for (index, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let number = index + 1;
        let (key, value) = line
            .split_once('=')
            .ok_or_else(|| format!("line {number} {line:?} is not key=value"))?;
        let (key, value) = (key.trim(), value.trim());
        let slot_taken = |taken: bool| {
            if taken {
                Err(format!("line {number}: {key} given twice"))
            } else {
                Ok(())
            }
        };
        match key {
            "generation" => {
                slot_taken(generation.is_some())?;
                let g: u64 = value.parse().map_err(|_| {
                    format!("line {number}: generation {value:?} is not a whole number")
                })?;
                if g == 0 {
                    return Err(format!("line {number}: generation 0 (generations start at 1)"));
                }
                generation = Some(g);
            }
            "cpus" => {
                slot_taken(cpus.is_some())?;
                let set = CpuSet::parse_list(value).map_err(|e| format!("line {number}: {e}"))?;
                if set.is_empty() {
                    return Err(format!("line {number}: cpus is empty"));
                }
                cpus = Some(set);
            }
            "mems" => {
                slot_taken(mems.is_some())?;
                mems = Some(CpuSet::parse_list(value).map_err(|e| format!("line {number}: {e}"))?);
            }
            _ => {}
        }
    }
    Ok(Notice {
        generation: generation.ok_or("no generation= line")?,
        cpus: cpus.ok_or("no cpus= line")?,
        mems,
    })
}

/// Reads and parses the notify file at `path`.
pub fn read(path: &Path) -> Result<Notice, NotifyError> {
    let read_error = |source| NotifyError::Read { path: path.to_path_buf(), source };
    let mut text = String::new();
    std::fs::File::open(path)
        .map_err(read_error)?
        .take(MAX_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(read_error)?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(NotifyError::Malformed {
            path: path.to_path_buf(),
            reason: format!("longer than {MAX_FILE_BYTES} bytes"),
        });
    }
    parse(&text).map_err(|reason| NotifyError::Malformed { path: path.to_path_buf(), reason })
}

/// Waits until the notify file at `path` holds a generation above `last_generation` and returns
/// it; `None` once `timeout` has passed without one (`None` timeout: waits for ever). The file
/// is read at once, then again after each event that names it. Interrupted system calls are
/// retried, so a signal (such as the job's `resize_signal`) does not end the wait.
///
/// A file that is missing, or goes missing while waiting (removed, renamed away), is an error,
/// as is one whose content is malformed.
pub fn wait(
    path: &Path,
    last_generation: u64,
    timeout: Option<Duration>,
) -> Result<Option<Notice>, NotifyError> {
    let deadline = timeout.map(|t| Instant::now() + t);
    let name =
        path.file_name().ok_or_else(|| NotifyError::NotAFilePath { path: path.to_path_buf() })?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let watch_error = |source| NotifyError::Watch { dir: dir.to_path_buf(), source };
    let inotify =
        Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK).map_err(watch_error)?;
    inotify
        .add_watch(
            dir,
            AddWatchFlags::IN_MOVED_TO
                | AddWatchFlags::IN_CLOSE_WRITE
                | AddWatchFlags::IN_MOVED_FROM
                | AddWatchFlags::IN_DELETE,
        )
        .map_err(watch_error)?;
    loop {
        let notice = read(path)?;
        if notice.generation > last_generation {
            return Ok(Some(notice));
        }
        if !wait_for_event(&inotify, name, deadline).map_err(watch_error)? {
            return Ok(None);
        }
    }
}

/// Blocks until an event names `name` (or the watch is lost or the queue overflowed: then
/// the file must be read again too); false when `deadline` passes first.
fn wait_for_event(
    inotify: &Inotify,
    name: &OsStr,
    deadline: Option<Instant>,
) -> Result<bool, Errno> {
    loop {
        let timeout = match deadline {
            None => PollTimeout::NONE,
            Some(deadline) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Ok(false);
                }
                // Rounded up, so that less than a millisecond left is not a busy poll of 0.
                let ms = left.as_micros().div_ceil(1000);
                PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
            }
        };
        let mut fds = [PollFd::new(inotify.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, timeout) {
            Ok(0) | Err(Errno::EINTR) => continue,
            Ok(_) => {}
            Err(e) => return Err(e),
        }
        let events = match inotify.read_events() {
            Ok(events) => events,
            Err(Errno::EAGAIN | Errno::EINTR) => continue,
            Err(e) => return Err(e),
        };
        let concerns_file = |e: &nix::sys::inotify::InotifyEvent| {
            e.name.as_deref() == Some(name)
                || e.mask.intersects(AddWatchFlags::IN_Q_OVERFLOW | AddWatchFlags::IN_IGNORED)
        };
        if events.iter().any(concerns_file) {
            return Ok(true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    /// Writes `text` to `path` as topod does: a temporary file beside it, then a rename.
    fn rewrite(path: &Path, text: &str) {
        let tmp = path.with_file_name(format!(
            ".{}.tmp",
            path.file_name().and_then(|n| n.to_str()).unwrap_or("x")
        ));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, path).unwrap();
    }

    fn notice(generation: u64, cpus: &str) -> String {
        format!("generation={generation}\ncpus={cpus}\nmems=0\n")
    }

    #[test]
    fn parses_what_topod_writes() {
        let n = parse("generation=3\ncpus=0-3,8-11\nmems=0\n").unwrap();
        assert_eq!(n.generation, 3);
        assert_eq!(n.cpus.to_string(), "0-3,8-11");
        assert_eq!(n.cpus.len(), 8);
        assert_eq!(n.mems.map(|m| m.to_string()).as_deref(), Some("0"));
    }

    #[test]
    fn skips_blank_lines_and_unknown_keys_and_tolerates_spaces() {
        let n = parse("\n cpus = 5 \r\nfuture=whatever\n\ngeneration= 12\n").unwrap();
        assert_eq!((n.generation, n.cpus.to_string(), n.mems), (12, "5".to_string(), None));
    }

    #[test]
    fn refuses_content_topod_never_writes() {
        let cases = [
            ("cpus=0-3\n", "no generation"),
            ("generation=1\n", "no cpus"),
            ("generation=0\ncpus=0\n", "generation 0"),
            ("generation=-1\ncpus=0\n", "not a whole number"),
            ("generation=1x\ncpus=0\n", "not a whole number"),
            ("generation=1\ncpus=\n", "cpus is empty"),
            ("generation=1\ncpus=3-1\n", "runs backwards"),
            ("generation=1\ncpus=0\nmems=a\n", "line 3"),
            ("generation=1\ngeneration=2\ncpus=0\n", "generation given twice"),
            ("generation=1\ncpus 0\n", "line 2 \"cpus 0\" is not key=value"),
            ("", "no generation"),
        ];
        for (text, expected) in cases {
            let reason = parse(text).expect_err(text);
            assert!(reason.contains(expected), "{text:?}: {reason:?} lacks {expected:?}");
        }
    }

    #[test]
    fn read_names_the_file_and_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("job-1");
        let e = read(&missing).unwrap_err().to_string();
        assert!(e.contains("cannot read notify file") && e.contains("job-1"), "{e}");
        std::fs::write(&missing, "generation=1\n").unwrap();
        let e = read(&missing).unwrap_err().to_string();
        assert!(e.contains("malformed") && e.contains("no cpus"), "{e}");
        std::fs::write(&missing, "x".repeat(MAX_FILE_BYTES as usize + 1)).unwrap();
        assert!(read(&missing).unwrap_err().to_string().contains("longer than"));
    }

    #[test]
    fn returns_at_once_when_the_file_is_already_newer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job");
        rewrite(&path, &notice(4, "0-1"));
        // Timeout 0 allows one look and no wait for an event: finding it proves the look.
        let n = wait(&path, 3, Some(Duration::ZERO)).unwrap().expect("found by the first look");
        assert_eq!((n.generation, n.cpus.len()), (4, 2));
        // With time to wait, still the look first: nothing ever changes the file again, so a
        // wait for an event first would end in the timeout's None.
        let n = wait(&path, 3, Some(Duration::from_secs(10))).unwrap().expect("not waited for");
        assert_eq!((n.generation, n.cpus.len()), (4, 2));
        // Timeout 0: one look, no waiting.
        assert_eq!(wait(&path, 4, Some(Duration::ZERO)).unwrap(), None);
    }

    #[test]
    fn times_out_when_nothing_changes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job");
        rewrite(&path, &notice(1, "0"));
        // The wait runs on a thread so that one that never timed out fails the test (after a
        // minute: a liveness wait, not a limit on how late a timeout may come) instead of
        // hanging it. It waits at least its timeout (a lower bound, which load cannot break).
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = thread::spawn(move || {
            let start = Instant::now();
            let got = wait(&path, 1, Some(Duration::from_millis(300)));
            let _ = tx.send((got.map_err(|e| e.to_string()), start.elapsed()));
        });
        let (got, waited) = rx.recv_timeout(Duration::from_secs(60)).expect("the wait never ended");
        waiter.join().unwrap();
        assert_eq!(got.unwrap(), None);
        assert!(waited >= Duration::from_millis(300), "{waited:?}");
    }

    #[test]
    fn wakes_on_a_rename_and_ignores_other_files_and_the_same_generation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job-7");
        rewrite(&path, &notice(1, "0-3"));
        let writer = {
            let path = path.clone();
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(100));
                // A sibling job's file and a rewrite without a new generation: no return.
                rewrite(&path.with_file_name("job-8"), &notice(9, "4-7"));
                rewrite(&path, &notice(1, "0-3"));
                thread::sleep(Duration::from_millis(200));
                rewrite(&path, &notice(2, "0-1"));
            })
        };
        // A notice before the 20 s deadline was woken by an event: at the deadline the wait
        // gives None without looking again (`times_out_when_nothing_changes`).
        let start = Instant::now();
        let n =
            wait(&path, 1, Some(Duration::from_secs(20))).unwrap().expect("woken by the rename");
        let waited = start.elapsed();
        writer.join().unwrap();
        assert_eq!((n.generation, n.cpus.to_string()), (2, "0-1".to_string()));
        assert!(waited >= Duration::from_millis(300), "returned before generation 2: {waited:?}");
    }

    #[test]
    fn wakes_on_a_write_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job");
        rewrite(&path, &notice(5, "0"));
        let writer = {
            let path = path.clone();
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(100));
                std::fs::write(&path, notice(6, "0-2")).unwrap();
            })
        };
        let n = wait(&path, 5, None).unwrap().unwrap();
        writer.join().unwrap();
        assert_eq!((n.generation, n.cpus.len()), (6, 3));
    }

    #[test]
    fn a_file_removed_while_waiting_is_an_error_not_a_hang() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job");
        rewrite(&path, &notice(1, "0"));
        let remover = {
            let path = path.clone();
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(100));
                std::fs::remove_file(&path).unwrap();
            })
        };
        let e = wait(&path, 1, Some(Duration::from_secs(20))).unwrap_err();
        remover.join().unwrap();
        assert!(matches!(e, NotifyError::Read { .. }), "{e}");
    }

    #[test]
    fn a_missing_file_or_directory_is_an_error_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let e = wait(&dir.path().join("nope"), 0, None).unwrap_err();
        assert!(matches!(e, NotifyError::Read { .. }), "{e}");
        let e = wait(&dir.path().join("no-dir/job"), 0, None).unwrap_err();
        assert!(matches!(e, NotifyError::Watch { .. }), "{e}");
        let e = wait(Path::new("/"), 0, None).unwrap_err();
        assert!(matches!(e, NotifyError::NotAFilePath { .. }), "{e}");
    }
}
