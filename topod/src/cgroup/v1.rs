//! cgroup v1: a `cpuset` hierarchy (required), and `freezer`, `memory` and `cpu` hierarchies
//! when mounted. Each job gets a directory named by its id under our subtree in each of them.
//!
//! The `cpu` directory sets no limit: it makes each job one entity for the CPU scheduler (its
//! `cpu.shares` default, 1024), so that a job's hundreds of threads weigh as one against topod's
//! and other jobs' threads on a CPU they share, as Kubernetes groups a pod's containers.
//!
//! v1 rules kept here: `cpuset.cpus` and `cpuset.mems` are written before any task joins (the
//! kernel refuses tasks in an empty cpuset); our subtree's own cpuset directory is given its
//! parent's CPUs and memory nodes when created; a process is moved by writing its pid to
//! `cgroup.procs` of each hierarchy; release freezes through `freezer.state`.
//! `cpuset.cpu_exclusive` is not used: it would need our whole subtree to be exclusive of the
//! rest of the system; exclusivity between jobs is the ledger's.

use super::fs::{spin_until, wait_until, Files, SPIN};
use super::{CgroupBackend, CgroupError, CgroupSpec, CharDevice, Effective, JobId, ReleaseReport};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// cgroup v1 job cgroups.
#[derive(Debug, Clone)]
pub struct V1 {
    files: Files,
    cpuset: PathBuf,
    freezer: Option<PathBuf>,
    memory: Option<PathBuf>,
    cpu: Option<PathBuf>,
    devices: Option<PathBuf>,
}

/// The mount point of the v1 hierarchy with the `devices` controller, from `/proc/mounts`-format
/// text.
pub fn v1_devices_mount(mounts: &str) -> Option<PathBuf> {
    mounts.lines().find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        (f.len() >= 4 && f[2] == "cgroup" && f[3].split(',').any(|o| o == "devices"))
            .then(|| PathBuf::from(f[1]))
    })
}

/// The mount point of the v1 hierarchy with the `cpu` controller (often `cpu,cpuacct`), from
/// `/proc/mounts`-format text.
pub fn v1_cpu_mount(mounts: &str) -> Option<PathBuf> {
    mounts.lines().find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        (f.len() >= 4 && f[2] == "cgroup" && f[3].split(',').any(|o| o == "cpu"))
            .then(|| PathBuf::from(f[1]))
    })
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
        let files = Files::default();
        let mounts = files.read(Path::new(super::MOUNTS))?;
        Self::detect_in(files, &mounts, subtree)
    }

    /// Uses (and creates) `subtree` under each hierarchy `mounts` (`/proc/mounts` text) names,
    /// through `files`.
    pub fn detect_in(files: Files, mounts: &str, subtree: &str) -> Result<Self, CgroupError> {
        let (cpuset, freezer, memory) = v1_mounts(mounts);
        let cpuset = cpuset.ok_or_else(|| {
            CgroupError::Unsupported("no cgroup v1 cpuset hierarchy is mounted".into())
        })?;
        V1::with_files(
            files,
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
        Self::with_files(Files::default(), cpuset, freezer, memory)
    }

    /// [`V1::new`] through `files`.
    pub fn with_files(
        files: Files,
        cpuset: PathBuf,
        freezer: Option<PathBuf>,
        memory: Option<PathBuf>,
    ) -> Result<Self, CgroupError> {
        files.mkdir(&cpuset)?;
        // A new cpuset directory has no CPUs: give ours its parent's, less those an exclusive
        // sibling holds (the kernel refuses an overlap with an exclusive cpuset).
        let parent = cpuset
            .parent()
            .ok_or_else(|| CgroupError::Unsupported(format!("{} has no parent", cpuset.display())))?
            .to_path_buf();
        if files.read(&cpuset.join("cpuset.mems"))?.trim().is_empty() {
            files.write(
                &cpuset.join("cpuset.mems"),
                files.read(&parent.join("cpuset.mems"))?.trim(),
            )?;
        }
        if files.read(&cpuset.join("cpuset.cpus"))?.trim().is_empty() {
            let cpus = files
                .read_set(&parent.join("cpuset.cpus"))?
                .difference(&exclusive_siblings(&files, &cpuset)?);
            files.write(&cpuset.join("cpuset.cpus"), &cpus.to_string())?;
        } else {
            // An exclusive cpuset that held some of the parent's CPUs when the subtree was made
            // may be gone: take its CPUs back.
            widen_subtree(&files, &cpuset)?;
        }
        for root in freezer.iter().chain(memory.iter()) {
            prepare_beside(&files, &cpuset, root)?;
        }
        Ok(V1 { files, cpuset, freezer, memory, cpu: None, devices: None })
    }

    /// With the grouping turned off: what an earlier start with it on left under `root` in the
    /// cpu hierarchy goes, its jobs' processes back to that hierarchy's root cgroup (ungrouped,
    /// as the setting says). Best effort, like the grouping.
    pub fn without_cpu_groups(self, root: Option<PathBuf>) -> Self {
        self.leave_hierarchy(root);
        self
    }

    /// With `confine_devices` off: what an earlier start with it on left under `root` in the
    /// devices hierarchy goes, its jobs' processes back to that hierarchy's root cgroup (no
    /// longer confined, as the setting says). Best effort.
    pub fn without_devices(self, root: Option<PathBuf>) -> Self {
        self.leave_hierarchy(root);
        self
    }

    /// Moves every process under `root` (topod's subtree in a hierarchy beside the cpuset one)
    /// to the hierarchy's root cgroup and removes the job directories and the subtree.
    fn leave_hierarchy(&self, root: Option<PathBuf>) {
        let Some(root) = root.filter(|r| self.files.is_dir(r)) else { return };
        let Some(top) = root.ancestors().nth(1).map(Path::to_path_buf) else { return };
        // The hierarchy's root cgroup: the one whose parent holds no cgroup.procs.
        let hierarchy_root = top
            .ancestors()
            .take_while(|d| self.files.exists(&d.join("cgroup.procs")))
            .last()
            .map(Path::to_path_buf)
            .unwrap_or(top);
        for dir in self.files.subdirs(&root) {
            for pid in self.files.read_pids(&dir.join("cgroup.procs")).unwrap_or_default() {
                let _ = self.files.write(&hierarchy_root.join("cgroup.procs"), &pid.to_string());
            }
            let _ = self.files.rmdir(&dir);
        }
        let _ = self.files.rmdir(&root);
    }

    /// Job cgroups in the `cpu` hierarchy too, under `root` (created if missing): each job then
    /// weighs as one entity for the CPU scheduler. None leaves the jobs where they were in it.
    /// Best effort: a subtree that cannot be made there (a read-only mount in a container) is
    /// logged, and the jobs are confined without it.
    pub fn with_cpu_groups(mut self, root: Option<PathBuf>) -> Self {
        self.cpu = root.filter(|root| match prepare_beside(&self.files, &self.cpuset, root) {
            Ok(()) => {
                // Under CONFIG_RT_GROUP_SCHED a new cpu cgroup gets no realtime time.
                let rt_by_group = root
                    .parent()
                    .is_some_and(|p| self.files.read(&p.join("cpu.rt_runtime_us")).is_ok());
                #[cfg(feature = "daemon")]
                if rt_by_group {
                    tracing::warn!(
                        "this kernel schedules realtime threads by cgroup (CONFIG_RT_GROUP_SCHED): \
                         with cpu_groups, a job's processes cannot switch to SCHED_FIFO or \
                         SCHED_RR (set cpu_groups = false in topod.toml where jobs need that)"
                    );
                }
                let _ = rt_by_group;
                // Jobs that ran while the grouping was off (a restart with cpu_groups turned
                // on): their processes into their own cpu directory now.
                for (job, dir) in self.files.job_dirs(&self.cpuset).unwrap_or_default() {
                    let grouped = root.join(job.as_str());
                    if self.files.is_dir(&grouped) || self.files.mkdir(&grouped).is_err() {
                        continue;
                    }
                    for pid in self.files.read_pids(&dir.join("cgroup.procs")).unwrap_or_default() {
                        let _ = self.files.write(&grouped.join("cgroup.procs"), &pid.to_string());
                    }
                }
                true
            }
            Err(_e) => {
                #[cfg(feature = "daemon")]
                tracing::warn!(
                    "jobs are not grouped for the CPU scheduler ({_e}): a job's threads then \
                     weigh one by one against topod's on a CPU they share"
                );
                false
            }
        });
        self
    }

    /// Job cgroups in the `devices` hierarchy too, under `root` (the subtree there, created if
    /// missing): each job's directory denies the devices its spec names
    /// ([`CgroupSpec::denied_devices`]). Writing a device rule takes CAP_SYS_ADMIN
    /// (security/device_cgroup.c, devcgroup_access_write), which the caller checks.
    pub fn with_devices(mut self, root: PathBuf) -> Result<Self, CgroupError> {
        prepare_beside(&self.files, &self.cpuset, &root)?;
        self.devices = Some(root);
        Ok(self)
    }

    fn dirs(&self, job: &JobId) -> impl Iterator<Item = PathBuf> + '_ {
        let name = job.as_str().to_string();
        std::iter::once(&self.cpuset)
            .chain(self.freezer.iter())
            .chain(self.memory.iter())
            .chain(self.cpu.iter())
            .chain(self.devices.iter())
            .map(move |root| root.join(&name))
    }

    /// Writes `pid` to `cgroup.procs` in each hierarchy; with `unless_in`, skips a hierarchy
    /// whose `tasks` lists every thread of it already (a process that moved itself in).
    fn move_in(&self, job: &JobId, pid: i32, unless_in: bool) -> Result<(), CgroupError> {
        if !self.files.is_dir(&self.cpuset.join(job.as_str())) {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        for d in self.dirs(job) {
            let procs = d.join("cgroup.procs");
            if unless_in && every_thread_in(&self.files, &d, pid) {
                continue;
            }
            match self.files.write(&procs, &pid.to_string()) {
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
                    // freezer, memory or cpu directory: make it and try again. (The devices
                    // directory is made, with the job's rules, before every join by the host:
                    // `set_device_rules`. One made here raced an rmdir in between.)
                    self.files.mkdir(&d)?;
                    match self.files.write(&procs, &pid.to_string()) {
                        // The cpu directory only groups the job for the scheduler; the kernel
                        // refuses a realtime process there (its cpu.rt_runtime_us is 0 under
                        // CONFIG_RT_GROUP_SCHED), and the job is confined without it.
                        Err(_) if self.cpu.as_ref().is_some_and(|c| d.starts_with(c)) => {}
                        other => other?,
                    }
                }
            }
        }
        Ok(())
    }

    /// The job's cpuset exists and has CPUs and memory nodes (a v1 cpuset without them refuses
    /// tasks; saying so is clearer than the kernel's ENOSPC).
    fn ready_for_processes(&self, job: &JobId) -> Result<(), CgroupError> {
        let dir = self.cpuset.join(job.as_str());
        if !self.files.is_dir(&dir) {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        match self.files.configured(&dir)? {
            Some(_) => Ok(()),
            None => Err(CgroupError::NotReady(job.to_string())),
        }
    }

    fn effective(&self, dir: &Path) -> Result<Effective, CgroupError> {
        // Where the kernel has no effective_* files (older kernels), the configured values apply.
        let read_either =
            |effective: &str, configured: &str| match self.files.read_set(&dir.join(effective)) {
                Err(e) if is_not_found(&e) => self.files.read_set(&dir.join(configured)),
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

    /// The job's `freezer.state`; an error when the freezer hierarchy is not mounted or the
    /// job has no cgroup.
    fn freezer_state(&self, job: &JobId) -> Result<PathBuf, CgroupError> {
        let Some(freezer) = &self.freezer else {
            return Err(CgroupError::Unsupported(
                "suspend and resume need the cgroup v1 freezer hierarchy, which is not mounted (mount -t cgroup -o freezer freezer /sys/fs/cgroup/freezer)".into(),
            ));
        };
        let dir = freezer.join(job.as_str());
        if !self.files.is_dir(&dir) {
            if !self.files.is_dir(&self.cpuset.join(job.as_str())) {
                return Err(CgroupError::NoSuchJob(job.to_string()));
            }
            // Made before the freezer was mounted: make its freezer directory and move its
            // processes in, as join does.
            self.files.mkdir(&dir)?;
            for pid in self.all_pids(job)? {
                let _ = self.files.write(&dir.join("cgroup.procs"), &pid.to_string());
            }
        }
        Ok(dir.join("freezer.state"))
    }

    /// The processes in the job's freezer, memory and cpu directories (the cpuset's left out).
    fn pids_beside_cpuset(&self, job: &JobId) -> Result<Vec<i32>, CgroupError> {
        self.pids_in(self.dirs(job).skip(1))
    }

    fn pids_in(&self, dirs: impl Iterator<Item = PathBuf>) -> Result<Vec<i32>, CgroupError> {
        let mut pids = Vec::new();
        for dir in dirs {
            // With the cgroups nested in the job's (made by root in the job): its processes too.
            match self.files.read_pids_within(&dir) {
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

/// Makes `root`, the subtree in a hierarchy beside the cpuset one, and removes what a release
/// cut short left in it: a job directory with no cpuset directory and no process.
fn prepare_beside(files: &Files, cpuset: &Path, root: &Path) -> Result<(), CgroupError> {
    // A nested subtree (`batch/topo`) needs its parents here too; in the cpuset hierarchy they
    // must exist already, with the CPUs the subtree may use.
    if let Some(parent) = root.parent() {
        files.mkdir_all(parent)?;
    }
    files.mkdir(root)?;
    for dir in files.subdirs(root) {
        let Some(name) = dir.file_name() else { continue };
        let orphan =
            JobId::parse(&name.to_string_lossy()).is_ok() && !files.exists(&cpuset.join(name));
        if orphan
            && files.read_pids(&dir.join("cgroup.procs")).map(|p| p.is_empty()).unwrap_or(false)
        {
            let _ = files.rmdir(&dir);
        }
    }
    Ok(())
}

/// The CPUs of the cpusets beside `root` (same parent) that are marked `cpuset.cpu_exclusive`.
fn exclusive_siblings(
    files: &Files,
    root: &Path,
) -> Result<topo_core::cpuset::CpuSet, CgroupError> {
    let mut out = topo_core::cpuset::CpuSet::new();
    let Some(parent) = root.parent() else { return Ok(out) };
    for p in files.subdirs(parent) {
        if p == root {
            continue;
        }
        if files.read(&p.join("cpuset.cpu_exclusive")).map(|v| v.trim() == "1").unwrap_or(false) {
            out.union_with(&files.read_set(&p.join("cpuset.cpus"))?);
        }
    }
    Ok(out)
}

/// Writes to the subtree root's `cpuset.cpus` every CPU of its parent that no exclusive sibling
/// holds, when that is more than it has (a v1 cpuset keeps what it was given when an exclusive
/// sibling goes away, so topod's subtree would stay narrowed for good).
fn widen_subtree(files: &Files, root: &Path) -> Result<(), CgroupError> {
    let Some(parent) = root.parent() else { return Ok(()) };
    let may_use =
        files.read_set(&parent.join("cpuset.cpus"))?.difference(&exclusive_siblings(files, root)?);
    let has = files.read_set(&root.join("cpuset.cpus"))?;
    if !may_use.is_subset(&has) {
        files.write(&root.join("cpuset.cpus"), &may_use.to_string())?;
    }
    Ok(())
}

/// Whether a cgroup file operation failed because the file or directory is not there.
fn is_not_found(e: &CgroupError) -> bool {
    matches!(e, CgroupError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
}

/// Whether every thread of `pid` is in the cgroup `dir` (v1 `cgroup.procs` lists a process as
/// soon as one of its threads is in, so it cannot tell).
fn every_thread_in(files: &Files, dir: &Path, pid: i32) -> bool {
    let Ok(tasks) = files.read_pids(&dir.join("tasks")) else { return false };
    let Some(threads) = files.fs().threads(pid) else { return false };
    !threads.is_empty() && threads.iter().all(|tid| tasks.binary_search(tid).is_ok())
}

impl CgroupBackend for V1 {
    fn foreign_cpus(&self) -> Result<topo_core::cpuset::CpuSet, CgroupError> {
        exclusive_siblings(&self.files, &self.cpuset)
    }

    fn widen(&self) -> Result<(), CgroupError> {
        widen_subtree(&self.files, &self.cpuset)
    }

    fn usage_files(&self, job: &JobId) -> super::UsageFiles {
        // topod makes no cpuacct group for a job: its CPU time comes from /proc (see
        // daemon::metrics). The cpuset's memory_pressure is the closest v1 has to PSI.
        // The switch is in the hierarchy's root only: the first ancestor that has it.
        let enabled = self
            .cpuset
            .ancestors()
            .skip(1)
            .find_map(|dir| self.files.read(&dir.join("cpuset.memory_pressure_enabled")).ok())
            .is_some_and(|v| v.trim() == "1");
        super::UsageFiles {
            cpuset_memory_pressure: enabled
                .then(|| self.cpuset.join(job.as_str()).join("cpuset.memory_pressure")),
            ..Default::default()
        }
    }

    fn kind(&self) -> &'static str {
        "v1"
    }

    fn confines_devices(&self) -> bool {
        self.devices.is_some()
    }

    fn set_device_rules(
        &self,
        job: &JobId,
        denied: &[CharDevice],
        allowed: &[CharDevice],
    ) -> Result<(), CgroupError> {
        let Some(devices) = &self.devices else { return Ok(()) };
        if !self.files.is_dir(&self.cpuset.join(job.as_str())) {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        let d = devices.join(job.as_str());
        let made = self.files.mkdir(&d)?;
        // Denied first: a device in neither list keeps its rule, so nothing is open between.
        for device in denied {
            self.files.write(&d.join("devices.deny"), &format!("{device} rwm"))?;
        }
        // In a cgroup that allows by default, an allow removes the matching deny
        // (security/device_cgroup.c, devcgroup_update_access).
        for device in allowed {
            self.files.write(&d.join("devices.allow"), &format!("{device} rwm"))?;
        }
        if made {
            // Its processes were in another devices cgroup (the hierarchy's root, or a batch
            // system's): confined now.
            for pid in self.files.read_pids(&self.cpuset.join(job.as_str()).join("cgroup.procs"))? {
                let _ = self.files.write(&d.join("cgroup.procs"), &pid.to_string());
            }
        }
        Ok(())
    }

    fn create(&self, job: &JobId, spec: &CgroupSpec) -> Result<Effective, CgroupError> {
        let dir = self.cpuset.join(job.as_str());
        if !self.files.mkdir(&dir)? {
            self.files.check_existing(&dir, job, spec)?;
        }
        // Devices before the cpuset is configured: a job that can take processes has its rules
        // (a cpuset without CPUs is a create cut short, which a restart removes).
        match &self.devices {
            Some(devices) => {
                let d = devices.join(job.as_str());
                self.files.mkdir(&d)?;
                // A new devices cgroup copies its parent's rules (here: every device allowed);
                // each deny is an exception to that (cgroup-v1/devices.rst).
                for device in &spec.denied_devices {
                    self.files.write(&d.join("devices.deny"), &format!("{device} rwm"))?;
                }
            }
            None if !spec.denied_devices.is_empty() => {
                return Err(CgroupError::Unsupported(format!(
                    "job {job}: its devices cannot be confined: topod was not started with confine_devices"
                )));
            }
            None => {}
        }
        // Memory nodes first: some kernels check the pair when CPUs are written.
        self.files.write(&dir.join("cpuset.mems"), &spec.mems.to_string())?;
        self.files.write(&dir.join("cpuset.cpus"), &spec.cpus.to_string())?;
        for beside in self.freezer.iter().chain(self.cpu.iter()) {
            self.files.mkdir(&beside.join(job.as_str()))?;
        }
        if let Some(memory) = &self.memory {
            let m = memory.join(job.as_str());
            self.files.mkdir(&m)?;
            if let Some(limit) = spec.memory_limit {
                self.files.write(&m.join("memory.limit_in_bytes"), &limit.to_string())?;
            }
        }
        self.effective(&dir)
    }

    fn update(&self, job: &JobId, spec: &CgroupSpec) -> Result<Effective, CgroupError> {
        let dir = self.cpuset.join(job.as_str());
        if !self.files.is_dir(&dir) {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        let mems = dir.join("cpuset.mems");
        if self.files.read_set(&mems)? != spec.mems {
            // Set before the nodes change, so that the pages follow (cpusets.rst 1.5 and 1.9).
            self.files.write(&dir.join("cpuset.memory_migrate"), "1")?;
            self.files.write(&mems, &spec.mems.to_string())?;
        }
        self.files.write(&dir.join("cpuset.cpus"), &spec.cpus.to_string())?;
        let effective = self.effective(&dir)?;
        // Every thread's own affinity follows the change (see Files::set_affinity_all).
        self.files.set_affinity_all(&self.all_pids(job)?, &effective.cpus);
        Ok(effective)
    }

    fn join(&self, job: &JobId, pid: i32) -> Result<(), CgroupError> {
        self.move_in(job, pid, false)
    }

    fn join_unless_in(&self, job: &JobId, pid: i32) -> Result<(), CgroupError> {
        self.move_in(job, pid, true)
    }

    fn self_join_files(&self, job: &JobId) -> Result<Vec<PathBuf>, CgroupError> {
        self.ready_for_processes(job)?;
        let mut tasks_files = Vec::new();
        for d in self.dirs(job) {
            // As in join: a create cut short may have left out the freezer, memory or cpu directory.
            self.files.mkdir(&d)?;
            tasks_files.push(d.join("tasks"));
        }
        Ok(tasks_files)
    }

    fn pids(&self, job: &JobId) -> Result<Vec<i32>, CgroupError> {
        if !self.files.is_dir(&self.cpuset.join(job.as_str())) {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        self.all_pids(job)
    }

    fn freeze(&self, job: &JobId, timeout: Duration) -> Result<(), CgroupError> {
        let state = self.freezer_state(job)?;
        self.files.refuse_if_topod_inside(job, &self.dirs(job).collect::<Vec<_>>())?;
        self.files.write(&state, "FROZEN")?;
        // v1 sends no notification: the state reads FREEZING until every task is stopped
        // (cgroup-v1/freezer-subsystem.rst), so it is read again, eagerly at first.
        let frozen = || Ok(self.files.read(&state)?.trim() == "FROZEN");
        if spin_until(SPIN.min(timeout), frozen)? || wait_until(timeout, frozen)? {
            return Ok(());
        }
        self.files.write(&state, "THAWED")?;
        Err(CgroupError::not_reported(job, "frozen", timeout, "; thawed again"))
    }

    fn thaw(&self, job: &JobId, timeout: Duration) -> Result<(), CgroupError> {
        let state = self.freezer_state(job)?;
        self.files.write(&state, "THAWED")?;
        if wait_until(timeout, || Ok(self.files.read(&state)?.trim() == "THAWED"))? {
            return Ok(());
        }
        Err(CgroupError::not_reported(job, "thawed", timeout, ""))
    }

    fn is_frozen(&self, job: &JobId) -> Result<bool, CgroupError> {
        let Some(dir) = self.freezer.as_ref().map(|f| f.join(job.as_str())) else {
            return Ok(false);
        };
        if !self.files.is_dir(&dir) {
            return Ok(false);
        }
        Ok(self.files.read(&dir.join("freezer.state"))?.trim() != "THAWED")
    }

    fn release(&self, job: &JobId, timeout: Duration) -> Result<ReleaseReport, CgroupError> {
        if !self.dirs(job).any(|d| self.files.is_dir(&d)) {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        self.files.refuse_if_topod_inside(job, &self.dirs(job).collect::<Vec<_>>())?;
        let freezer =
            self.freezer.as_ref().map(|f| f.join(job.as_str())).filter(|d| self.files.is_dir(d));
        let mut signalled = std::collections::BTreeSet::new();
        if let Some(f) = &freezer {
            // Freezing stops forks; SIGKILL reaches frozen tasks once thawed. Whatever forked
            // before the freeze took hold is caught by the loop below.
            self.files.write(&f.join("freezer.state"), "FROZEN")?;
            let pids = self.all_pids(job);
            if let Ok(pids) = &pids {
                self.files.kill_all(pids, &mut signalled);
            }
            // Thawed whatever happened: a release that failed here would otherwise leave the
            // job's processes frozen (in D state) and the job held.
            let thawed = self.files.write(&f.join("freezer.state"), "THAWED");
            pids?;
            thawed?;
        }
        // Without a freezer (or for what slipped through): kill until empty.
        let cpuset_procs = self.cpuset.join(job.as_str()).join("cgroup.procs");
        // The freezer stage has just read and signalled every hierarchy; without it, the first
        // look does.
        let mut look_everywhere = freezer.is_none();
        let empty = wait_until(timeout, || {
            // Every process topod or a self-join moved in is in the cpuset, so that one file is
            // watched while processes die; the other hierarchies are read once it is empty (a
            // process can be in the freezer, memory or cpu directory alone when something else
            // moved it out of the cpuset).
            let pids = if look_everywhere {
                self.all_pids(job)?
            } else {
                let dying = self.files.read_pids(&cpuset_procs).or_else(|e| {
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
            self.files.kill_all(&pids, &mut signalled);
            Ok(pids.is_empty())
        })?;
        if !empty {
            // What the cpuset's survivors kept from being looked at gets its signal too.
            let survivors = self.all_pids(job)?;
            self.files.kill_all(&survivors, &mut signalled);
            return Ok(ReleaseReport { killed: signalled.len(), survivors });
        }
        let killed = signalled.len();
        // The cpuset directory goes last: it is what `list` finds, so a release cut short leaves
        // the job findable, never a nameless freezer, memory or cpu directory.
        let mut dirs: Vec<PathBuf> = self.dirs(job).collect();
        dirs.rotate_left(1);
        for d in dirs {
            self.files.rmdir_within(&d)?;
        }
        Ok(ReleaseReport { killed, survivors: Vec::new() })
    }

    fn list(&self) -> Result<Vec<(JobId, Effective)>, CgroupError> {
        self.files
            .job_dirs(&self.cpuset)?
            .into_iter()
            .map(|(job, dir)| {
                // A job cgroup never configured is listed without CPUs, so that a restart removes it.
                let effective = if self.files.configured(&dir)?.is_some() {
                    self.effective(&dir)?
                } else {
                    Effective::default()
                };
                Ok((job, effective))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    //! The backend's own code against a cgroup v1 file system emulated in a temporary directory
    //! ([`super::super::fake_fs`]); the real-kernel tests are `topod/tests/cgroup_real.rs`.

    use super::super::fake_fs::FakeCgroupFs;
    use super::super::{CgroupBackend, CgroupError, CgroupSpec, Files, JobId, Kind};
    use super::{v1_cpu_mount, V1};
    use std::path::PathBuf;
    use std::sync::Arc;
    use std::time::Duration;
    use topo_core::cpuset::CpuSet;

    fn set(s: &str) -> CpuSet {
        CpuSet::parse_list(s).unwrap()
    }

    fn spec(cpus: &str, mems: &str) -> CgroupSpec {
        CgroupSpec { cpus: set(cpus), mems: set(mems), ..CgroupSpec::default() }
    }

    fn open(fs: &Arc<FakeCgroupFs>) -> V1 {
        V1::detect_in(Files::new(fs.clone()), &fs.mounts(), "topo")
            .unwrap()
            .with_cpu_groups(v1_cpu_mount(&fs.mounts()).map(|c| c.join("topo")))
    }

    fn job(id: &str) -> JobId {
        JobId::parse(id).unwrap()
    }

    #[test]
    fn a_cpuset_change_gives_every_thread_the_new_cpus() {
        let fs = Arc::new(FakeCgroupFs::v1("0-7", "0-1"));
        let v1 = open(&fs);
        v1.create(&job("1"), &spec("2-3", "0")).unwrap();
        fs.start_process(100);
        fs.start_process(101);
        v1.join(&job("1"), 100).unwrap();
        // Shrunk, then grown: each time every process of the job gets the job's new CPUs,
        // and no process outside it is touched.
        v1.update(&job("1"), &spec("2", "0")).unwrap();
        assert_eq!(fs.affinity(100), Some(set("2")));
        v1.update(&job("1"), &spec("2-5", "0")).unwrap();
        assert_eq!(fs.affinity(100), Some(set("2-5")));
        assert_eq!(fs.affinity(101), None);
    }

    #[test]
    fn a_job_lives_and_is_released_on_the_emulated_kernel() {
        let fs = Arc::new(FakeCgroupFs::v1("0-7", "0-1"));
        assert_eq!(Kind::auto(&Files::new(fs.clone()), &fs.mounts()), Kind::V1);
        let v1 = open(&fs);
        // The subtree got its parent's CPUs and memory nodes.
        let subtree = fs.root("cpuset").join("topo");
        assert_eq!(std::fs::read_to_string(subtree.join("cpuset.cpus")).unwrap(), "0-7");
        let effective = v1.create(&job("1"), &spec("2-3", "0")).unwrap();
        assert_eq!((effective.cpus, effective.mems), (set("2-3"), set("0")));
        fs.start_process(100);
        v1.join(&job("1"), 100).unwrap();
        // In the cpu hierarchy too: the job weighs as one entity for the CPU scheduler.
        for h in ["cpuset", "freezer", "memory", "cpu"] {
            let procs = fs.root(h).join("topo/1/cgroup.procs");
            assert_eq!(std::fs::read_to_string(procs).unwrap().trim(), "100", "{h}");
        }
        assert_eq!(v1.pids(&job("1")).unwrap(), vec![100]);
        assert_eq!(v1.list().unwrap().len(), 1);
        let report = v1.release(&job("1"), Duration::from_secs(1)).unwrap();
        assert_eq!((report.killed, report.survivors.len()), (1, 0));
        for h in ["cpuset", "freezer", "memory", "cpu"] {
            assert!(!fs.root(h).join("topo/1").exists(), "{h}");
        }
        assert!(matches!(v1.pids(&job("1")), Err(CgroupError::NoSuchJob(_))));
    }

    #[test]
    fn a_cpuset_without_cpus_takes_no_process_and_lists_without_cpus() {
        let fs = Arc::new(FakeCgroupFs::v1("0-7", "0-1"));
        let v1 = open(&fs);
        // topod died between mkdir and the writes: the kernel's ENOSPC, said plainly.
        use super::super::fs::CgroupFs;
        fs.create_dir(&fs.root("cpuset").join("topo/2")).unwrap();
        fs.start_process(200);
        assert!(matches!(v1.join(&job("2"), 200), Err(CgroupError::NotReady(_))));
        let listed = v1.list().unwrap();
        assert_eq!(listed.len(), 1);
        assert!(listed[0].1.cpus.is_empty(), "a never-configured job must list without CPUs");
        // CPUs outside the parent's are the kernel's EINVAL, with the file and the value named.
        let e = v1.create(&job("3"), &spec("8-9", "0")).unwrap_err().to_string();
        assert!(
            e.contains("cpuset.cpus") && e.contains("8-9") && e.contains("Invalid argument"),
            "{e}"
        );
        // The same job with other CPUs is another allocation's.
        v1.create(&job("4"), &spec("0-1", "0")).unwrap();
        assert!(matches!(v1.create(&job("4"), &spec("2-3", "0")), Err(CgroupError::Exists { .. })));
        v1.create(&job("4"), &spec("0-1", "0")).unwrap();
    }

    #[test]
    fn a_release_reports_what_would_not_die_and_nested_cgroups_go_with_the_job() {
        let fs = Arc::new(FakeCgroupFs::v1("0-7", "0-1"));
        let v1 = open(&fs);
        v1.create(&job("5"), &spec("0-1", "0")).unwrap();
        fs.start_process(500);
        fs.unkillable(500);
        v1.join(&job("5"), 500).unwrap();
        let report = v1.release(&job("5"), Duration::from_millis(30)).unwrap();
        assert_eq!(report.survivors, vec![500]);
        assert!(fs.root("cpuset").join("topo/5").exists(), "a cgroup with survivors stays");
        // Cgroups root in the job made inside it, in any hierarchy (an attack finding: rmdir was
        // EBUSY, and the job and its CPUs stayed held): their processes are the job's, and
        // they go with it.
        use super::super::fs::CgroupFs;
        v1.create(&job("6"), &spec("2-3", "0")).unwrap();
        fs.create_dir(&fs.root("freezer").join("topo/6/inner")).unwrap();
        fs.create_dir(&fs.root("freezer").join("topo/6/inner/deeper")).unwrap();
        fs.create_dir(&fs.root("memory").join("topo/6/other")).unwrap();
        fs.start_process(600);
        v1.join(&job("6"), 600).unwrap();
        fs.write(&fs.root("freezer").join("topo/6/inner/deeper/cgroup.procs"), b"600").unwrap();
        assert_eq!(v1.pids(&job("6")).unwrap(), vec![600]);
        let report = v1.release(&job("6"), Duration::from_secs(1)).unwrap();
        assert_eq!((report.killed, report.survivors.len()), (1, 0), "{report:?}");
        for h in ["cpuset", "freezer", "memory"] {
            assert!(!fs.root(h).join("topo/6").exists(), "{h}");
        }
        // A release that fails once the job is frozen thaws it again (an attack finding: its
        // processes stayed frozen, the job held): here a nested cgroup.procs that is no list.
        v1.create(&job("7"), &spec("2-3", "0")).unwrap();
        fs.create_dir(&fs.root("memory").join("topo/7/odd")).unwrap();
        std::fs::write(fs.root("memory").join("topo/7/odd/cgroup.procs"), "not-a-pid\n").unwrap();
        assert!(v1.release(&job("7"), Duration::from_secs(1)).is_err());
        let state = std::fs::read_to_string(fs.root("freezer").join("topo/7/freezer.state"));
        assert_eq!(state.unwrap().trim(), "THAWED");
    }

    #[test]
    fn an_exclusive_sibling_narrows_the_subtree_until_it_goes() {
        let fs = Arc::new(FakeCgroupFs::v1("0-7", "0-1"));
        use super::super::fs::CgroupFs;
        let other = fs.root("cpuset").join("other");
        fs.create_dir(&other).unwrap();
        fs.write(&other.join("cpuset.mems"), b"0").unwrap();
        fs.write(&other.join("cpuset.cpus"), b"0-1").unwrap();
        fs.write(&other.join("cpuset.cpu_exclusive"), b"1").unwrap();
        let v1 = open(&fs);
        assert_eq!(v1.foreign_cpus().unwrap(), set("0-1"));
        let subtree = fs.root("cpuset").join("topo/cpuset.cpus");
        assert_eq!(std::fs::read_to_string(&subtree).unwrap(), "2-7");
        // The kernel refuses a job on the sibling's CPUs.
        assert!(v1.create(&job("7"), &spec("0-3", "0")).is_err());
        fs.remove_dir(&other).unwrap();
        v1.widen().unwrap();
        assert!(v1.foreign_cpus().unwrap().is_empty());
        assert_eq!(std::fs::read_to_string(&subtree).unwrap(), "0-7");
        v1.create(&job("7"), &spec("0-3", "0")).unwrap();
    }

    #[test]
    fn a_restarted_backend_finds_its_jobs_and_refuses_to_kill_topod() {
        let fs = Arc::new(FakeCgroupFs::v1("0-7", "0-1"));
        open(&fs).create(&job("8"), &spec("4-5", "1")).unwrap();
        let again = open(&fs);
        let listed = again.list().unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!((listed[0].0.as_str(), &listed[0].1.cpus), ("8", &set("4-5")));
        fs.set_own_cgroups("12:cpuset:/topo/8\n11:freezer:/\n");
        let e = again.release(&job("8"), Duration::from_secs(1)).unwrap_err().to_string();
        assert!(e.contains("topod itself is in job 8's cgroup"), "{e}");
    }

    #[test]
    fn the_cpu_hierarchy_is_found_alone_or_beside_cpuacct_and_never_as_cpuset() {
        let mounts = "cgroup /sys/fs/cgroup/cpuset cgroup rw,relatime,cpuset 0 0\n\
                      cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,relatime,cpu,cpuacct 0 0\n";
        assert_eq!(v1_cpu_mount(mounts), Some(PathBuf::from("/sys/fs/cgroup/cpu,cpuacct")));
        let alone = "cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n";
        assert_eq!(v1_cpu_mount(alone), Some(PathBuf::from("/sys/fs/cgroup/cpu")));
        let none = "cgroup /sys/fs/cgroup/cpuset cgroup rw,cpuset 0 0\n\
                    cgroup /sys/fs/cgroup/cpuacct cgroup rw,cpuacct 0 0\n\
                    cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n";
        assert_eq!(v1_cpu_mount(none), None);
    }

    #[test]
    fn a_job_cut_short_in_the_cpu_hierarchy_is_completed_or_cleaned_up() {
        let fs = Arc::new(FakeCgroupFs::v1("0-7", "0-1"));
        let v1 = open(&fs);
        v1.create(&job("9"), &spec("0-1", "0")).unwrap();
        // A create cut short before the cpu directory: join makes it.
        std::fs::remove_dir_all(fs.root("cpu").join("topo/9")).unwrap();
        fs.start_process(900);
        v1.join(&job("9"), 900).unwrap();
        let procs = fs.root("cpu").join("topo/9/cgroup.procs");
        assert_eq!(std::fs::read_to_string(procs).unwrap().trim(), "900");
        // A release cut short after the cpuset went: the empty cpu directory goes at start.
        use super::super::fs::CgroupFs;
        fs.create_dir(&fs.root("cpu").join("topo/10")).unwrap();
        open(&fs);
        assert!(!fs.root("cpu").join("topo/10").exists());
        assert!(fs.root("cpu").join("topo/9").exists(), "a live job's cpu directory stays");
    }

    #[test]
    fn turning_the_cpu_grouping_on_groups_running_jobs_and_off_ungroups_them() {
        let fs = Arc::new(FakeCgroupFs::v1("0-7", "0-1"));
        let cpu_root = || v1_cpu_mount(&fs.mounts()).map(|c| c.join("topo"));
        let without = || {
            V1::detect_in(Files::new(fs.clone()), &fs.mounts(), "topo")
                .unwrap()
                .without_cpu_groups(cpu_root())
        };
        // A job started with the grouping off: not in the cpu hierarchy.
        let off = without();
        off.create(&job("11"), &spec("0-1", "0")).unwrap();
        fs.start_process(1100);
        off.join(&job("11"), 1100).unwrap();
        assert!(!fs.root("cpu").join("topo/11").exists());
        // A restart with it on: the running job's process goes into its own cpu directory.
        open(&fs);
        let procs = fs.root("cpu").join("topo/11/cgroup.procs");
        assert_eq!(std::fs::read_to_string(&procs).unwrap().trim(), "1100");
        // Off again: back to the hierarchy's root, and nothing of topo's left there.
        let off = without();
        assert!(!fs.root("cpu").join("topo").exists());
        let root_procs = std::fs::read_to_string(fs.root("cpu").join("cgroup.procs")).unwrap();
        assert!(root_procs.lines().any(|l| l.trim() == "1100"), "{root_procs}");
        // The job itself is untouched, and is released as before.
        assert_eq!(off.pids(&job("11")).unwrap(), vec![1100]);
        off.release(&job("11"), Duration::from_secs(1)).unwrap();
    }
}
