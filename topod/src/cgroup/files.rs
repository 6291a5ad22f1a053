//! Reading and writing cgroup files, with errors that carry the path and the data.

use super::{CgroupError, CgroupSpec, Effective, JobId};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use topo_core::cpuset::CpuSet;

pub(crate) fn read(path: &Path) -> Result<String, CgroupError> {
    let err = |source| CgroupError::Io {
        action: "reading",
        path: path.to_path_buf(),
        data: None,
        source,
    };
    // Cgroup files report a size of 0, so the size probe (a stat) of fs::read_to_string buys
    // nothing; these reads are on every job's start and release.
    let mut file = std::fs::File::open(path).map_err(err)?;
    let mut bytes = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match file.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => bytes.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(err(e)),
        }
    }
    String::from_utf8(bytes).map_err(|e| CgroupError::Format {
        path: path.to_path_buf(),
        what: format!("not UTF-8 text: {e}"),
    })
}

/// Writes `data` to an existing cgroup file in one `write(2)` (the kernel takes one value per
/// write), without creating or truncating it.
pub(crate) fn write(path: &Path, data: &str) -> Result<(), CgroupError> {
    let err = |source| CgroupError::Io {
        action: "writing",
        path: path.to_path_buf(),
        data: Some(data.to_string()),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(false)
        .truncate(false)
        .open(path)
        .map_err(err)?;
    f.write_all(data.as_bytes()).map_err(err)
}

pub(crate) fn mkdir(path: &Path) -> Result<bool, CgroupError> {
    match std::fs::create_dir(path) {
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

pub(crate) fn rmdir(path: &Path) -> Result<(), CgroupError> {
    match std::fs::remove_dir(path) {
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

pub(crate) fn read_set(path: &Path) -> Result<CpuSet, CgroupError> {
    let text = read(path)?;
    CpuSet::parse_list(&text)
        .map_err(|e| CgroupError::Format { path: path.to_path_buf(), what: e.to_string() })
}

/// The pids in a `cgroup.procs` file. The kernel may list a pid twice while it migrates.
pub(crate) fn read_pids(path: &Path) -> Result<Vec<i32>, CgroupError> {
    let text = read(path)?;
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

/// Polls `done` until it holds or `timeout` passes: every 50 us for the first 2 ms (a killed
/// process usually leaves within a millisecond, and a release waits on it), then backing off
/// to every 5 ms.
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

/// SIGKILL to each pid (again, if it was signalled before and is still listed while it dies);
/// a pid that is already gone is not an error. `signalled` collects every pid signalled, so
/// that a release reports each process once.
pub(crate) fn kill_all(pids: &[i32], signalled: &mut std::collections::BTreeSet<i32>) {
    let me = std::process::id() as i32;
    for &pid in pids {
        // Never topod itself, whatever put it in a job's cgroup.
        if pid > 0
            && pid != me
            && nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            )
            .is_ok()
        {
            signalled.insert(pid);
        }
    }
}

/// The job cgroup directories under `root`, by job id. Directories whose names are not job ids
/// (made by someone else) are left out.
pub(crate) fn job_dirs(root: &Path) -> Result<Vec<(JobId, PathBuf)>, CgroupError> {
    let entries = std::fs::read_dir(root).map_err(|source| CgroupError::Io {
        action: "listing",
        path: root.to_path_buf(),
        data: None,
        source,
    })?;
    let mut out: Vec<(JobId, PathBuf)> = entries
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| JobId::parse(&e.file_name().to_string_lossy()).ok().map(|j| (j, e.path())))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// What topod wrote to a job cgroup's `cpuset.cpus` and `cpuset.mems`; `None` while either is
/// empty (made, but topod died before the writes). Readiness is read here, never from the
/// effective sets: a new v2 cpuset, and a v1 one under the `cpuset_v2_mode` mount option, shows
/// its parent's CPUs as effective before any are written.
pub(crate) fn configured(dir: &Path) -> Result<Option<Effective>, CgroupError> {
    let set = Effective {
        cpus: read_set(&dir.join("cpuset.cpus"))?,
        mems: read_set(&dir.join("cpuset.mems"))?,
    };
    Ok((!set.cpus.is_empty() && !set.mems.is_empty()).then_some(set))
}

/// For a job cgroup that `create` found already made: the same spec again is idempotent, and
/// one never configured is the caller's to finish; anything else is another allocation's.
pub(crate) fn check_existing(
    dir: &Path,
    job: &JobId,
    spec: &CgroupSpec,
) -> Result<(), CgroupError> {
    match configured(dir)? {
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

/// Refuses to freeze or kill a job cgroup that topod itself is in (`/proc/self/cgroup`): topod
/// never moves itself into a job, but an administrator writing to `cgroup.procs` by hand can, and
/// a release would then freeze topod in its own freezer.
pub(crate) fn refuse_if_topod_inside(job: &JobId, dirs: &[PathBuf]) -> Result<(), CgroupError> {
    let Ok(mine) = std::fs::read_to_string("/proc/self/cgroup") else { return Ok(()) };
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
