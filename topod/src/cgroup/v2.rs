//! cgroup v2: job cgroups under our subtree of the unified hierarchy.
//!
//! v2 rules kept here: controllers reach a child only through the parent's
//! `cgroup.subtree_control` (`+cpuset +memory`), and a cgroup with controllers enabled for its
//! children holds no processes, so our subtree root holds none; `cpuset.cpus`/`cpuset.mems` are
//! written before a process joins (a new v2 cpuset is not empty but inherits its parent's CPUs,
//! so readiness is read from these files, not from `.effective`) and `cpuset.*.effective` is
//! read back; release writes `cgroup.kill` (Linux 5.14+), or freezes with `cgroup.freeze` and
//! kills, then waits for `populated 0` in `cgroup.events` before `rmdir`.

use super::files::{
    check_existing, configured, job_dirs, kill_all, mkdir, read, read_pids, read_set,
    refuse_if_topod_inside, rmdir, wait_until, write,
};
use super::{CgroupBackend, CgroupError, CgroupSpec, Effective, JobId, ReleaseReport};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// cgroup v2 job cgroups under one subtree root.
#[derive(Debug, Clone)]
pub struct V2 {
    root: PathBuf,
    cpuset: bool,
    memory: bool,
}

/// The unified hierarchy's mount point, from `/proc/mounts`-format text.
pub fn v2_mount(mounts: &str) -> Option<PathBuf> {
    mounts.lines().find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        (f.len() >= 3 && f[2] == "cgroup2").then(|| PathBuf::from(f[1]))
    })
}

impl V2 {
    /// Uses (and creates) `subtree` under this host's unified hierarchy.
    pub fn detect(subtree: &str) -> Result<Self, CgroupError> {
        let mounts = read(Path::new("/proc/mounts"))?;
        let mount = v2_mount(&mounts)
            .ok_or_else(|| CgroupError::Unsupported("no cgroup v2 hierarchy is mounted".into()))?;
        V2::new(mount.join(subtree))
    }

    /// Job cgroups under `root` (created if missing), with cpuset and memory enabled for them
    /// where the parent offers those controllers.
    pub fn new(root: PathBuf) -> Result<Self, CgroupError> {
        mkdir(&root)?;
        let parent = root
            .parent()
            .ok_or_else(|| CgroupError::Unsupported(format!("{} has no parent", root.display())))?;
        let offered = read(&parent.join("cgroup.controllers"))?;
        let has = |c: &str| offered.split_whitespace().any(|x| x == c);
        let (cpuset, memory) = (has("cpuset"), has("memory"));
        let wanted: Vec<&str> = [("cpuset", cpuset), ("memory", memory)]
            .iter()
            .filter(|(_, ok)| *ok)
            .map(|(c, _)| *c)
            .collect();
        for dir in [parent, root.as_path()] {
            let enabled = read(&dir.join("cgroup.subtree_control"))?;
            for c in &wanted {
                if !enabled.split_whitespace().any(|x| x == *c) {
                    write(&dir.join("cgroup.subtree_control"), &format!("+{c}"))?;
                }
            }
        }
        Ok(V2 { root, cpuset, memory })
    }

    fn dir(&self, job: &JobId) -> PathBuf {
        self.root.join(job.as_str())
    }

    fn effective(&self, dir: &Path) -> Result<Effective, CgroupError> {
        Ok(Effective {
            cpus: read_set(&dir.join("cpuset.cpus.effective"))?,
            mems: read_set(&dir.join("cpuset.mems.effective"))?,
        })
    }

    /// The effective sets of a configured job cgroup; empty for one made but never configured
    /// (listed so, a restart removes it).
    fn job_effective(&self, dir: &Path) -> Result<Effective, CgroupError> {
        if configured(dir)?.is_none() {
            return Ok(Effective::default());
        }
        self.effective(dir)
    }

    fn populated(dir: &Path) -> Result<bool, CgroupError> {
        let events = read(&dir.join("cgroup.events"))?;
        Ok(events.lines().any(|l| l.trim() == "populated 1"))
    }
}

impl CgroupBackend for V2 {
    fn kind(&self) -> &'static str {
        "v2"
    }

    /// CPUs of the partitions (`cpuset.cpus.partition` root or isolated) beside our subtree.
    fn foreign_cpus(&self) -> Result<topo_core::cpuset::CpuSet, CgroupError> {
        let mut out = topo_core::cpuset::CpuSet::new();
        let Some(parent) = self.root.parent() else { return Ok(out) };
        let Ok(entries) = std::fs::read_dir(parent) else { return Ok(out) };
        for e in entries.flatten() {
            let p = e.path();
            if p == self.root || !p.is_dir() {
                continue;
            }
            let partition = read(&p.join("cpuset.cpus.partition")).unwrap_or_default();
            if matches!(partition.split_whitespace().next(), Some("root") | Some("isolated")) {
                out.union_with(&read_set(&p.join("cpuset.cpus.effective"))?);
            }
        }
        Ok(out)
    }

    fn create(&self, job: &JobId, spec: &CgroupSpec) -> Result<Effective, CgroupError> {
        if !self.cpuset {
            return Err(CgroupError::Unsupported(format!(
                "the cgroup v2 hierarchy above {} offers no cpuset controller (enable it, or use the v1 backend)",
                self.root.display()
            )));
        }
        let dir = self.dir(job);
        if !mkdir(&dir)? {
            check_existing(&dir, job, spec)?;
        }
        write(&dir.join("cpuset.mems"), &spec.mems.to_string())?;
        write(&dir.join("cpuset.cpus"), &spec.cpus.to_string())?;
        if let (true, Some(limit)) = (self.memory, spec.memory_limit) {
            write(&dir.join("memory.max"), &limit.to_string())?;
        }
        self.effective(&dir)
    }

    fn join(&self, job: &JobId, pid: i32) -> Result<(), CgroupError> {
        let dir = self.dir(job);
        if !dir.is_dir() {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        if self.cpuset {
            // Not yet configured: a process let in now would run on every CPU of the parent.
            if configured(&dir)?.is_none() {
                return Err(CgroupError::NotReady(job.to_string()));
            }
        }
        write(&dir.join("cgroup.procs"), &pid.to_string())
    }

    fn pids(&self, job: &JobId) -> Result<Vec<i32>, CgroupError> {
        let dir = self.dir(job);
        if !dir.is_dir() {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        read_pids(&dir.join("cgroup.procs"))
    }

    fn release(&self, job: &JobId, timeout: Duration) -> Result<ReleaseReport, CgroupError> {
        let dir = self.dir(job);
        if !dir.is_dir() {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        refuse_if_topod_inside(job, std::slice::from_ref(&dir))?;
        let before = read_pids(&dir.join("cgroup.procs"))?;
        let mut signalled = std::collections::BTreeSet::new();
        if dir.join("cgroup.kill").exists() {
            write(&dir.join("cgroup.kill"), "1")?;
            signalled.extend(before.iter().copied());
        } else {
            write(&dir.join("cgroup.freeze"), "1")?;
            wait_until(timeout / 2, || {
                Ok(read(&dir.join("cgroup.events"))?.lines().any(|l| l.trim() == "frozen 1"))
            })?;
            kill_all(&read_pids(&dir.join("cgroup.procs"))?, &mut signalled);
            write(&dir.join("cgroup.freeze"), "0")?;
        }
        let empty = wait_until(timeout, || {
            if !V2::populated(&dir)? {
                return Ok(true);
            }
            kill_all(&read_pids(&dir.join("cgroup.procs"))?, &mut signalled);
            Ok(false)
        })?;
        let killed = signalled.len();
        if !empty {
            return Ok(ReleaseReport { killed, survivors: read_pids(&dir.join("cgroup.procs"))? });
        }
        rmdir(&dir)?;
        Ok(ReleaseReport { killed, survivors: Vec::new() })
    }

    fn list(&self) -> Result<Vec<(JobId, Effective)>, CgroupError> {
        job_dirs(&self.root)?
            .into_iter()
            .map(|(job, dir)| {
                Ok((
                    job,
                    if self.cpuset { self.job_effective(&dir)? } else { Effective::default() },
                ))
            })
            .collect()
    }
}
