//! cgroup v1: a `cpuset` hierarchy (required), and `freezer` and `memory` hierarchies when
//! mounted. Each job gets a directory named by its id under our subtree in each of them.
//!
//! v1 rules kept here: `cpuset.cpus` and `cpuset.mems` are written before any task joins (the
//! kernel refuses tasks in an empty cpuset); our subtree's own cpuset directory is given its
//! parent's CPUs and memory nodes when created; a process is moved by writing its pid to
//! `cgroup.procs` of each hierarchy; release freezes through `freezer.state`.
//! `cpuset.cpu_exclusive` is not used: it would need our whole subtree to be exclusive of the
//! rest of the system; exclusivity between jobs is the ledger's.

use super::files::{
    check_existing, configured, job_dirs, kill_all, mkdir, read, read_pids, read_set,
    refuse_if_topod_inside, rmdir, wait_until, write,
};
use super::{CgroupBackend, CgroupError, CgroupSpec, Effective, JobId, ReleaseReport};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// cgroup v1 job cgroups.
#[derive(Debug, Clone)]
pub struct V1 {
    cpuset: PathBuf,
    freezer: Option<PathBuf>,
    memory: Option<PathBuf>,
}

/// Where the v1 hierarchies are mounted, from `/proc/self/mountinfo`-style text (`/proc/mounts`
/// format: device, mount point, type, options).
pub fn v1_mounts(mounts: &str) -> (Option<PathBuf>, Option<PathBuf>, Option<PathBuf>) {
    let (mut cpuset, mut freezer, mut memory) = (None, None, None);
    for line in mounts.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 4 || f[2] != "cgroup" {
            continue;
        }
        let opts: Vec<&str> = f[3].split(',').collect();
        let point = PathBuf::from(f[1]);
        if opts.contains(&"cpuset") {
            cpuset.get_or_insert(point.clone());
        }
        if opts.contains(&"freezer") {
            freezer.get_or_insert(point.clone());
        }
        if opts.contains(&"memory") {
            memory.get_or_insert(point);
        }
    }
    (cpuset, freezer, memory)
}

impl V1 {
    /// Uses (and creates) `subtree` under each mounted hierarchy of this host.
    pub fn detect(subtree: &str) -> Result<Self, CgroupError> {
        let mounts = read(Path::new("/proc/mounts"))?;
        let (cpuset, freezer, memory) = v1_mounts(&mounts);
        let cpuset = cpuset.ok_or_else(|| {
            CgroupError::Unsupported("no cgroup v1 cpuset hierarchy is mounted".into())
        })?;
        V1::new(
            cpuset.join(subtree),
            freezer.map(|f| f.join(subtree)),
            memory.map(|m| m.join(subtree)),
        )
    }

    /// Job cgroups under these subtree roots (created if missing).
    pub fn new(
        cpuset: PathBuf,
        freezer: Option<PathBuf>,
        memory: Option<PathBuf>,
    ) -> Result<Self, CgroupError> {
        mkdir(&cpuset)?;
        // A new cpuset directory has no CPUs: give ours its parent's, less those an exclusive
        // sibling holds (the kernel refuses an overlap with an exclusive cpuset).
        let parent = cpuset
            .parent()
            .ok_or_else(|| CgroupError::Unsupported(format!("{} has no parent", cpuset.display())))?
            .to_path_buf();
        if read(&cpuset.join("cpuset.mems"))?.trim().is_empty() {
            write(&cpuset.join("cpuset.mems"), read(&parent.join("cpuset.mems"))?.trim())?;
        }
        if read(&cpuset.join("cpuset.cpus"))?.trim().is_empty() {
            let cpus =
                read_set(&parent.join("cpuset.cpus"))?.difference(&exclusive_siblings(&cpuset)?);
            write(&cpuset.join("cpuset.cpus"), &cpus.to_string())?;
        } else {
            // An exclusive cpuset that held some of the parent's CPUs when the subtree was made
            // may be gone: take its CPUs back.
            widen_subtree(&cpuset)?;
        }
        for root in freezer.iter().chain(memory.iter()) {
            // A nested subtree (`batch/topo`) needs its parents here too; in the cpuset
            // hierarchy they must exist already, with the CPUs the subtree may use.
            if let Some(parent) = root.parent() {
                std::fs::create_dir_all(parent).map_err(|source| CgroupError::Io {
                    action: "creating",
                    path: parent.to_path_buf(),
                    data: None,
                    source,
                })?;
            }
            mkdir(root)?;
            // Leftovers of a release cut short: a job directory with no cpuset directory and no
            // process is provably dead.
            if let Ok(entries) = std::fs::read_dir(root) {
                for e in entries.flatten().filter(|e| e.path().is_dir()) {
                    let name = e.file_name();
                    let orphan = JobId::parse(&name.to_string_lossy()).is_ok()
                        && !cpuset.join(&name).exists();
                    if orphan
                        && read_pids(&e.path().join("cgroup.procs"))
                            .map(|p| p.is_empty())
                            .unwrap_or(false)
                    {
                        let _ = rmdir(&e.path());
                    }
                }
            }
        }
        Ok(V1 { cpuset, freezer, memory })
    }

    fn dirs(&self, job: &JobId) -> impl Iterator<Item = PathBuf> + '_ {
        let name = job.as_str().to_string();
        std::iter::once(&self.cpuset)
            .chain(self.freezer.iter())
            .chain(self.memory.iter())
            .map(move |root| root.join(&name))
    }

    /// Writes `pid` to `cgroup.procs` in each hierarchy; with `unless_in`, skips a hierarchy
    /// whose `tasks` lists every thread of it already (a process that moved itself in).
    fn move_in(&self, job: &JobId, pid: i32, unless_in: bool) -> Result<(), CgroupError> {
        if !self.cpuset.join(job.as_str()).is_dir() {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        for d in self.dirs(job) {
            let procs = d.join("cgroup.procs");
            if unless_in && every_thread_in(&d, pid) {
                continue;
            }
            match write(&procs, &pid.to_string()) {
                Ok(()) => {}
                // The kernel refuses tasks in a v1 cpuset without CPUs or memory nodes (ENOSPC,
                // cpuset_can_attach): say that plainly. Checked on failure rather than read
                // before every join, which is on the job's start path.
                Err(CgroupError::Io { source, .. })
                    if d.starts_with(&self.cpuset)
                        && source.raw_os_error() == Some(nix::errno::Errno::ENOSPC as i32) =>
                {
                    return Err(CgroupError::NotReady(job.to_string()));
                }
                Err(_) => {
                    // A create cut short (topod killed) may have made the cpuset but not the
                    // freezer or memory directory: make it and try again.
                    mkdir(&d)?;
                    write(&procs, &pid.to_string())?;
                }
            }
        }
        Ok(())
    }

    /// The job's cpuset exists and has CPUs and memory nodes (a v1 cpuset without them refuses
    /// tasks; saying so is clearer than the kernel's ENOSPC).
    fn ready_for_processes(&self, job: &JobId) -> Result<(), CgroupError> {
        let dir = self.cpuset.join(job.as_str());
        if !dir.is_dir() {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        match configured(&dir)? {
            Some(_) => Ok(()),
            None => Err(CgroupError::NotReady(job.to_string())),
        }
    }

    fn effective(&self, dir: &Path) -> Result<Effective, CgroupError> {
        // Where the kernel has no effective_* files (older kernels), the configured values apply.
        let read_either = |effective: &str, configured: &str| match read_set(&dir.join(effective)) {
            Err(e) if is_not_found(&e) => read_set(&dir.join(configured)),
            other => other,
        };
        Ok(Effective {
            cpus: read_either("cpuset.effective_cpus", "cpuset.cpus")?,
            mems: read_either("cpuset.effective_mems", "cpuset.mems")?,
        })
    }

    fn all_pids(&self, job: &JobId) -> Result<Vec<i32>, CgroupError> {
        self.pids_in(self.dirs(job))
    }

    /// The processes in the job's freezer and memory directories (the cpuset's left out).
    fn pids_beside_cpuset(&self, job: &JobId) -> Result<Vec<i32>, CgroupError> {
        self.pids_in(self.dirs(job).skip(1))
    }

    fn pids_in(&self, dirs: impl Iterator<Item = PathBuf>) -> Result<Vec<i32>, CgroupError> {
        let mut pids = Vec::new();
        for dir in dirs {
            match read_pids(&dir.join("cgroup.procs")) {
                Ok(p) => pids.extend(p),
                // A hierarchy where the job has no directory (a create cut short) holds nothing.
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(e),
            }
        }
        pids.sort_unstable();
        pids.dedup();
        Ok(pids)
    }
}

/// The CPUs of the cpusets beside `root` (same parent) that are marked `cpuset.cpu_exclusive`.
fn exclusive_siblings(root: &Path) -> Result<topo_core::cpuset::CpuSet, CgroupError> {
    let mut out = topo_core::cpuset::CpuSet::new();
    let Some(parent) = root.parent() else { return Ok(out) };
    let Ok(entries) = std::fs::read_dir(parent) else { return Ok(out) };
    for e in entries.flatten() {
        let p = e.path();
        if p == root || !p.is_dir() {
            continue;
        }
        if read(&p.join("cpuset.cpu_exclusive")).map(|v| v.trim() == "1").unwrap_or(false) {
            out.union_with(&read_set(&p.join("cpuset.cpus"))?);
        }
    }
    Ok(out)
}

/// Writes to the subtree root's `cpuset.cpus` every CPU of its parent that no exclusive sibling
/// holds, when that is more than it has (a v1 cpuset keeps what it was given when an exclusive
/// sibling goes away, so topod's subtree would stay narrowed for good).
fn widen_subtree(root: &Path) -> Result<(), CgroupError> {
    let Some(parent) = root.parent() else { return Ok(()) };
    let may_use = read_set(&parent.join("cpuset.cpus"))?.difference(&exclusive_siblings(root)?);
    let has = read_set(&root.join("cpuset.cpus"))?;
    if !may_use.is_subset(&has) {
        write(&root.join("cpuset.cpus"), &may_use.to_string())?;
    }
    Ok(())
}

/// Whether a cgroup file operation failed because the file or directory is not there.
fn is_not_found(e: &CgroupError) -> bool {
    matches!(e, CgroupError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
}

/// Whether every thread of `pid` is in the cgroup `dir` (v1 `cgroup.procs` lists a process as
/// soon as one of its threads is in, so it cannot tell).
fn every_thread_in(dir: &Path, pid: i32) -> bool {
    let Ok(tasks) = read_pids(&dir.join("tasks")) else { return false };
    let Ok(threads) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    let mut any = false;
    for thread in threads {
        let tid =
            thread.ok().and_then(|t| t.file_name().to_str().and_then(|n| n.parse::<i32>().ok()));
        match tid {
            Some(tid) if tasks.binary_search(&tid).is_ok() => any = true,
            _ => return false,
        }
    }
    any
}

impl CgroupBackend for V1 {
    fn foreign_cpus(&self) -> Result<topo_core::cpuset::CpuSet, CgroupError> {
        exclusive_siblings(&self.cpuset)
    }

    fn widen(&self) -> Result<(), CgroupError> {
        widen_subtree(&self.cpuset)
    }

    fn kind(&self) -> &'static str {
        "v1"
    }

    fn create(&self, job: &JobId, spec: &CgroupSpec) -> Result<Effective, CgroupError> {
        let dir = self.cpuset.join(job.as_str());
        if !mkdir(&dir)? {
            check_existing(&dir, job, spec)?;
        }
        // Memory nodes first: some kernels check the pair when CPUs are written.
        write(&dir.join("cpuset.mems"), &spec.mems.to_string())?;
        write(&dir.join("cpuset.cpus"), &spec.cpus.to_string())?;
        if let Some(freezer) = &self.freezer {
            mkdir(&freezer.join(job.as_str()))?;
        }
        if let Some(memory) = &self.memory {
            let m = memory.join(job.as_str());
            mkdir(&m)?;
            if let Some(limit) = spec.memory_limit {
                write(&m.join("memory.limit_in_bytes"), &limit.to_string())?;
            }
        }
        self.effective(&dir)
    }

    fn join(&self, job: &JobId, pid: i32) -> Result<(), CgroupError> {
        self.move_in(job, pid, false)
    }

    fn join_unless_in(&self, job: &JobId, pid: i32) -> Result<(), CgroupError> {
        self.move_in(job, pid, true)
    }

    fn self_join_files(&self, job: &JobId) -> Result<Vec<PathBuf>, CgroupError> {
        self.ready_for_processes(job)?;
        let mut files = Vec::new();
        for d in self.dirs(job) {
            // As in join: a create cut short may have left out the freezer or memory directory.
            mkdir(&d)?;
            files.push(d.join("tasks"));
        }
        Ok(files)
    }

    fn pids(&self, job: &JobId) -> Result<Vec<i32>, CgroupError> {
        if !self.cpuset.join(job.as_str()).is_dir() {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        self.all_pids(job)
    }

    fn release(&self, job: &JobId, timeout: Duration) -> Result<ReleaseReport, CgroupError> {
        if !self.dirs(job).any(|d| d.is_dir()) {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        refuse_if_topod_inside(job, &self.dirs(job).collect::<Vec<_>>())?;
        let freezer = self.freezer.as_ref().map(|f| f.join(job.as_str())).filter(|d| d.is_dir());
        let mut signalled = std::collections::BTreeSet::new();
        if let Some(f) = &freezer {
            // Freezing stops forks; SIGKILL reaches frozen tasks once thawed. Whatever forked
            // before the freeze took hold is caught by the loop below.
            write(&f.join("freezer.state"), "FROZEN")?;
            kill_all(&self.all_pids(job)?, &mut signalled);
            write(&f.join("freezer.state"), "THAWED")?;
        }
        // Without a freezer (or for what slipped through): kill until empty.
        let cpuset_procs = self.cpuset.join(job.as_str()).join("cgroup.procs");
        // The freezer stage has just read and signalled every hierarchy; without it, the first
        // look does.
        let mut look_everywhere = freezer.is_none();
        let empty = wait_until(timeout, || {
            // Every process topod or a self-join moved in is in the cpuset, so that one file is
            // watched while processes die; the other hierarchies are read once it is empty (a
            // process can be in the freezer or memory directory alone when something else
            // moved it out of the cpuset).
            let pids = if look_everywhere {
                self.all_pids(job)?
            } else {
                let dying = read_pids(&cpuset_procs).or_else(|e| {
                    if is_not_found(&e) {
                        Ok(Vec::new())
                    } else {
                        Err(e)
                    }
                })?;
                if dying.is_empty() {
                    self.pids_beside_cpuset(job)?
                } else {
                    dying
                }
            };
            look_everywhere = false;
            kill_all(&pids, &mut signalled);
            Ok(pids.is_empty())
        })?;
        if !empty {
            // What the cpuset's survivors kept from being looked at gets its signal too.
            let survivors = self.all_pids(job)?;
            kill_all(&survivors, &mut signalled);
            return Ok(ReleaseReport { killed: signalled.len(), survivors });
        }
        let killed = signalled.len();
        // The cpuset directory goes last: it is what `list` finds, so a release cut short leaves
        // the job findable, never a nameless freezer or memory directory.
        let mut dirs: Vec<PathBuf> = self.dirs(job).collect();
        dirs.rotate_left(1);
        for d in dirs {
            rmdir(&d)?;
        }
        Ok(ReleaseReport { killed, survivors: Vec::new() })
    }

    fn list(&self) -> Result<Vec<(JobId, Effective)>, CgroupError> {
        job_dirs(&self.cpuset)?
            .into_iter()
            .map(|(job, dir)| {
                // A job cgroup never configured is listed without CPUs, so that a restart removes it.
                let effective = if configured(&dir)?.is_some() {
                    self.effective(&dir)?
                } else {
                    Effective::default()
                };
                Ok((job, effective))
            })
            .collect()
    }
}
