//! cgroup v2: job cgroups under our subtree of the unified hierarchy.
//!
//! v2 rules kept here: controllers reach a child only through the parent's
//! `cgroup.subtree_control` (`+cpuset +memory`, and `+cpu` where offered so that each job is one
//! entity for the CPU scheduler), and a cgroup with controllers enabled for its
//! children holds no processes, so our subtree root holds none; `cpuset.cpus`/`cpuset.mems` are
//! written before a process joins (a new v2 cpuset is not empty but inherits its parent's CPUs,
//! so readiness is read from these files, not from `.effective`) and `cpuset.*.effective` is
//! read back; release writes `cgroup.kill` (Linux 5.14+), or freezes with `cgroup.freeze` and
//! kills, then waits for `populated 0` in `cgroup.events` before `rmdir`.

use super::devices_bpf::DeviceFilter;
use super::fs::{wait_until, Files};
use super::{CgroupBackend, CgroupError, CgroupSpec, CharDevice, Effective, JobId, ReleaseReport};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// cgroup v2 job cgroups under one subtree root.
#[derive(Debug, Clone)]
pub struct V2 {
    files: Files,
    root: PathBuf,
    cpuset: bool,
    memory: bool,
    /// Where each job's device program is set, with `confine_devices` (see
    /// [`super::devices_bpf`]).
    devices: Option<Arc<dyn DeviceFilter>>,
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
        let files = Files::default();
        let mounts = files.read(Path::new(super::MOUNTS))?;
        Self::detect_in(files, &mounts, subtree)
    }

    /// Uses (and creates) `subtree` under the unified hierarchy `mounts` (`/proc/mounts` text)
    /// names, through `files`.
    pub fn detect_in(files: Files, mounts: &str, subtree: &str) -> Result<Self, CgroupError> {
        let mount = v2_mount(mounts)
            .ok_or_else(|| CgroupError::Unsupported("no cgroup v2 hierarchy is mounted".into()))?;
        V2::with_files(files, mount.join(subtree))
    }

    /// Job cgroups under `root` (created if missing), with cpuset and memory enabled for them
    /// where the parent offers those controllers.
    pub fn new(root: PathBuf) -> Result<Self, CgroupError> {
        Self::with_files(Files::default(), root)
    }

    /// [`V2::new`] through `files`.
    pub fn with_files(files: Files, root: PathBuf) -> Result<Self, CgroupError> {
        files.mkdir(&root)?;
        let parent = root
            .parent()
            .ok_or_else(|| CgroupError::Unsupported(format!("{} has no parent", root.display())))?;
        let offered = files.read(&parent.join("cgroup.controllers"))?;
        let has = |c: &str| offered.split_whitespace().any(|x| x == c);
        let (cpuset, memory) = (has("cpuset"), has("memory"));
        let wanted: Vec<&str> = [("cpuset", cpuset), ("memory", memory)]
            .iter()
            .filter(|(_, ok)| *ok)
            .map(|(c, _)| *c)
            .collect();
        for dir in [parent, root.as_path()] {
            let enabled = files.read(&dir.join("cgroup.subtree_control"))?;
            for c in &wanted {
                if !enabled.split_whitespace().any(|x| x == *c) {
                    files.write(&dir.join("cgroup.subtree_control"), &format!("+{c}"))?;
                }
            }
        }
        Ok(V2 { files, root, cpuset, memory, devices: None })
    }

    /// Enables the `cpu` controller for the job cgroups where the parent offers it, so that each
    /// job is one entity for the CPU scheduler (cpu.weight 100) and our subtree one beside the
    /// system's: a job's hundreds of threads weigh as one against topod's. Best effort: the
    /// kernel refuses `+cpu` while a realtime thread sits in a cgroup below (under
    /// CONFIG_RT_GROUP_SCHED), and jobs are confined without it; a refusal is logged.
    pub fn with_cpu_groups(self) -> Self {
        let files = &self.files;
        let Some(parent) = self.root.parent() else { return self };
        let offered = files.read(&parent.join("cgroup.controllers")).unwrap_or_default();
        if !offered.split_whitespace().any(|x| x == "cpu") {
            return self;
        }
        for dir in [parent, self.root.as_path()] {
            let control = dir.join("cgroup.subtree_control");
            let enabled = files.read(&control).unwrap_or_default();
            if enabled.split_whitespace().any(|x| x == "cpu") {
                continue;
            }
            if let Err(_e) = files.write(&control, "+cpu") {
                #[cfg(feature = "daemon")]
                tracing::warn!(
                    "the cpu controller could not be enabled for jobs ({_e}): a job's threads \
                     then weigh one by one against topod's on a CPU they share"
                );
                break;
            }
        }
        self
    }

    /// Undoes [`V2::with_cpu_groups`] for our subtree (`cpu_groups = false` after a start with
    /// it): `-cpu` in our own `cgroup.subtree_control`, so that no job is a group of the CPU
    /// scheduler. The parent's is left as it is: others use it. Best effort, logged.
    pub fn without_cpu_groups(self) -> Self {
        let control = self.root.join("cgroup.subtree_control");
        let enabled = self.files.read(&control).unwrap_or_default();
        if enabled.split_whitespace().any(|x| x == "cpu") {
            if let Err(_e) = self.files.write(&control, "-cpu") {
                #[cfg(feature = "daemon")]
                tracing::warn!(
                    "cpu_groups = false, but the cpu controller stays enabled for jobs: {_e}"
                );
            }
        }
        self
    }

    /// Confines each job's devices by a BPF program on its cgroup, set through `filter`
    /// ([`CgroupSpec::denied_devices`], [`CgroupBackend::set_device_rules`]); `filter` is
    /// checked first, so that a kernel or a process that cannot load one says so now.
    pub fn with_devices(mut self, filter: Arc<dyn DeviceFilter>) -> Result<Self, CgroupError> {
        filter.check().map_err(|e| {
            CgroupError::Unsupported(format!(
                "confine_devices on cgroup v2 loads a BPF device program into each job's cgroup, and loading one failed: {e}; it needs a kernel built with CONFIG_CGROUP_BPF, CAP_SYS_ADMIN and the bpf system call; under systemd install packaging/topod-confine-devices.conf (Debian: /usr/share/doc/topod/examples/confine-devices.conf) as /etc/systemd/system/topod.service.d/confine-devices.conf and run systemctl daemon-reload, or turn confine_devices off"
            ))
        })?;
        self.devices = Some(filter);
        Ok(self)
    }

    fn dir(&self, job: &JobId) -> PathBuf {
        self.root.join(job.as_str())
    }

    fn effective(&self, dir: &Path) -> Result<Effective, CgroupError> {
        Ok(Effective {
            cpus: self.files.read_set(&dir.join("cpuset.cpus.effective"))?,
            mems: self.files.read_set(&dir.join("cpuset.mems.effective"))?,
        })
    }

    /// The effective sets of a configured job cgroup; empty for one made but never configured
    /// (listed so, a restart removes it).
    fn job_effective(&self, dir: &Path) -> Result<Effective, CgroupError> {
        if self.files.configured(dir)?.is_none() {
            return Ok(Effective::default());
        }
        self.effective(dir)
    }

    fn populated(&self, dir: &Path) -> Result<bool, CgroupError> {
        let events = self.files.read(&dir.join("cgroup.events"))?;
        Ok(events.lines().any(|l| l.trim() == "populated 1"))
    }
}

impl CgroupBackend for V2 {
    fn usage_files(&self, job: &JobId) -> super::UsageFiles {
        let dir = self.dir(job);
        super::UsageFiles {
            cpu_stat: Some(dir.join("cpu.stat")),
            cpu_pressure: Some(dir.join("cpu.pressure")),
            memory_pressure: Some(dir.join("memory.pressure")),
            cpuset_memory_pressure: None,
        }
    }

    fn kind(&self) -> &'static str {
        "v2"
    }

    fn confines_devices(&self) -> bool {
        self.devices.is_some()
    }

    /// Replaces the job's device program by one that denies `denied` (a device of `allowed` is
    /// simply not in it; one in neither list is allowed too, unlike v1's rules, which keep it).
    fn set_device_rules(
        &self,
        job: &JobId,
        denied: &[CharDevice],
        _allowed: &[CharDevice],
    ) -> Result<(), CgroupError> {
        let Some(filter) = &self.devices else { return Ok(()) };
        let dir = self.dir(job);
        if !self.files.is_dir(&dir) {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        filter.set(&dir, denied)
    }

    /// CPUs of the partitions (`cpuset.cpus.partition` root or isolated) beside our subtree.
    fn foreign_cpus(&self) -> Result<topo_core::cpuset::CpuSet, CgroupError> {
        let mut out = topo_core::cpuset::CpuSet::new();
        let Some(parent) = self.root.parent() else { return Ok(out) };
        for p in self.files.subdirs(parent) {
            if p == self.root {
                continue;
            }
            let partition = self.files.read(&p.join("cpuset.cpus.partition")).unwrap_or_default();
            if matches!(partition.split_whitespace().next(), Some("root") | Some("isolated")) {
                out.union_with(&self.files.read_set(&p.join("cpuset.cpus.effective"))?);
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
        let made = self.files.mkdir(&dir)?;
        if !made {
            self.files.check_existing(&dir, job, spec)?;
        }
        // Devices before the cpuset is configured: no process may join before (see join). A new
        // cgroup with nothing to deny needs no program; an existing one gets its list anew.
        match &self.devices {
            Some(_) if made && spec.denied_devices.is_empty() => {}
            Some(filter) => filter.set(&dir, &spec.denied_devices)?,
            None if !spec.denied_devices.is_empty() => {
                return Err(CgroupError::Unsupported(format!(
                    "job {job}: its devices cannot be confined: topod was not started with confine_devices"
                )));
            }
            None => {}
        }
        self.files.write(&dir.join("cpuset.mems"), &spec.mems.to_string())?;
        self.files.write(&dir.join("cpuset.cpus"), &spec.cpus.to_string())?;
        if let (true, Some(limit)) = (self.memory, spec.memory_limit) {
            self.files.write(&dir.join("memory.max"), &limit.to_string())?;
        }
        self.effective(&dir)
    }

    fn update(&self, job: &JobId, spec: &CgroupSpec) -> Result<Effective, CgroupError> {
        let dir = self.dir(job);
        if !self.cpuset || !self.files.is_dir(&dir) {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        // No memory_migrate in v2: a change of cpuset.mems moves the pages by itself.
        let mems = dir.join("cpuset.mems");
        if self.files.read_set(&mems)? != spec.mems {
            self.files.write(&mems, &spec.mems.to_string())?;
        }
        self.files.write(&dir.join("cpuset.cpus"), &spec.cpus.to_string())?;
        let effective = self.effective(&dir)?;
        // Every thread's own affinity follows the change (see Files::set_affinity_all).
        self.files.set_affinity_all(&self.files.read_pids_within(&dir)?, &effective.cpus);
        Ok(effective)
    }

    fn join(&self, job: &JobId, pid: i32) -> Result<(), CgroupError> {
        let dir = self.dir(job);
        if !self.files.is_dir(&dir) {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        if self.cpuset {
            // Not yet configured: a process let in now would run on every CPU of the parent.
            if self.files.configured(&dir)?.is_none() {
                return Err(CgroupError::NotReady(job.to_string()));
            }
        }
        self.files.write(&dir.join("cgroup.procs"), &pid.to_string())
    }

    fn pids(&self, job: &JobId) -> Result<Vec<i32>, CgroupError> {
        let dir = self.dir(job);
        if !self.files.is_dir(&dir) {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        self.files.read_pids_within(&dir)
    }

    fn freeze(&self, job: &JobId, timeout: Duration) -> Result<(), CgroupError> {
        let dir = self.dir(job);
        if !self.files.is_dir(&dir) {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        // topod's own processes must never be frozen: nothing would thaw them.
        self.files.refuse_if_topod_inside(job, std::slice::from_ref(&dir))?;
        self.files.write(&dir.join("cgroup.freeze"), "1")?;
        // `frozen 1` appears in cgroup.events once every process is stopped; the kernel
        // notifies the change (cgroup-v2.rst, "cgroup.events").
        let events = dir.join("cgroup.events");
        if self.files.watch(&events, timeout, |t| t.lines().any(|l| l.trim() == "frozen 1"))? {
            return Ok(());
        }
        self.files.write(&dir.join("cgroup.freeze"), "0")?;
        Err(CgroupError::not_reported(job, "frozen", timeout, "; thawed again"))
    }

    fn thaw(&self, job: &JobId, timeout: Duration) -> Result<(), CgroupError> {
        let dir = self.dir(job);
        if !self.files.is_dir(&dir) {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        self.files.write(&dir.join("cgroup.freeze"), "0")?;
        let events = dir.join("cgroup.events");
        if self.files.watch(&events, timeout, |t| t.lines().any(|l| l.trim() == "frozen 0"))? {
            return Ok(());
        }
        Err(CgroupError::not_reported(job, "thawed", timeout, ""))
    }

    fn is_frozen(&self, job: &JobId) -> Result<bool, CgroupError> {
        let dir = self.dir(job);
        if !self.files.is_dir(&dir) {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        Ok(self.files.read(&dir.join("cgroup.freeze"))?.trim() == "1")
    }

    fn release(&self, job: &JobId, timeout: Duration) -> Result<ReleaseReport, CgroupError> {
        let dir = self.dir(job);
        if !self.files.is_dir(&dir) {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        self.files.refuse_if_topod_inside(job, std::slice::from_ref(&dir))?;
        // The processes of cgroups nested in the job's (made by root in the job) are the job's
        // too: cgroup.kill and cgroup.freeze take the subtree, the fallbacks read it.
        let before = self.files.read_pids_within(&dir)?;
        let mut signalled = std::collections::BTreeSet::new();
        if self.files.exists(&dir.join("cgroup.kill")) {
            self.files.write(&dir.join("cgroup.kill"), "1")?;
            signalled.extend(before.iter().copied());
        } else {
            self.files.write(&dir.join("cgroup.freeze"), "1")?;
            let frozen_and_killed = wait_until(timeout / 2, || {
                Ok(self
                    .files
                    .read(&dir.join("cgroup.events"))?
                    .lines()
                    .any(|l| l.trim() == "frozen 1"))
            })
            .and_then(|_| self.files.read_pids_within(&dir))
            .map(|pids| self.files.kill_all(&pids, &mut signalled));
            // Thawed whatever happened: a release that failed here would otherwise leave the
            // job's processes frozen and the job held.
            let thawed = self.files.write(&dir.join("cgroup.freeze"), "0");
            frozen_and_killed?;
            thawed?;
        }
        let empty = wait_until(timeout, || {
            if !self.populated(&dir)? {
                return Ok(true);
            }
            self.files.kill_all(&self.files.read_pids_within(&dir)?, &mut signalled);
            Ok(false)
        })?;
        let killed = signalled.len();
        if !empty {
            return Ok(ReleaseReport { killed, survivors: self.files.read_pids_within(&dir)? });
        }
        self.files.rmdir_within(&dir)?;
        Ok(ReleaseReport { killed, survivors: Vec::new() })
    }

    fn list(&self) -> Result<Vec<(JobId, Effective)>, CgroupError> {
        self.files
            .job_dirs(&self.root)?
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

#[cfg(test)]
mod tests {
    //! The backend's own code against a cgroup v2 file system emulated in a temporary directory
    //! ([`super::super::fake_fs`]); the real-kernel tests run in `tests/cgroup-v2-vm.sh`.

    use super::super::fake_fs::FakeCgroupFs;
    use super::super::fs::CgroupFs;
    use super::super::{CgroupBackend, CgroupError, CgroupSpec, Files, JobId, Kind};
    use super::V2;
    use std::sync::Arc;
    use std::time::Duration;
    use topo_core::cpuset::CpuSet;

    fn set(s: &str) -> CpuSet {
        CpuSet::parse_list(s).unwrap()
    }

    fn spec(cpus: &str, mems: &str) -> CgroupSpec {
        CgroupSpec { cpus: set(cpus), mems: set(mems), ..CgroupSpec::default() }
    }

    fn open(fs: &Arc<FakeCgroupFs>) -> V2 {
        V2::detect_in(Files::new(fs.clone()), &fs.mounts(), "topo.slice").unwrap().with_cpu_groups()
    }

    fn job(id: &str) -> JobId {
        JobId::parse(id).unwrap()
    }

    #[test]
    fn a_job_lives_and_is_released_on_the_emulated_kernel() {
        let fs = Arc::new(FakeCgroupFs::v2("0-7", "0-1"));
        assert_eq!(Kind::auto(&Files::new(fs.clone()), &fs.mounts()), Kind::V2);
        let v2 = open(&fs);
        // Controllers reach the jobs through both subtree_control files.
        for dir in [fs.root("unified"), fs.root("unified").join("topo.slice")] {
            let enabled = std::fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap();
            assert_eq!(enabled, "cpu cpuset memory", "{}", dir.display());
        }
        let mut limited = spec("2-3", "0");
        limited.memory_limit = Some(1 << 30);
        let effective = v2.create(&job("1"), &limited).unwrap();
        assert_eq!((effective.cpus, effective.mems), (set("2-3"), set("0")));
        let dir = fs.root("unified").join("topo.slice/1");
        assert_eq!(std::fs::read_to_string(dir.join("memory.max")).unwrap(), "1073741824");
        fs.start_process(100);
        fs.start_process(101);
        v2.join(&job("1"), 100).unwrap();
        v2.join(&job("1"), 101).unwrap();
        assert_eq!(v2.pids(&job("1")).unwrap(), vec![100, 101]);
        let report = v2.release(&job("1"), Duration::from_secs(1)).unwrap();
        assert_eq!((report.killed, report.survivors.len()), (2, 0));
        assert!(!dir.exists());
    }

    #[test]
    fn turning_cpu_groups_off_takes_the_cpu_controller_from_the_jobs() {
        let fs = Arc::new(FakeCgroupFs::v2("0-7", "0-1"));
        let v2 = open(&fs);
        v2.create(&job("1"), &spec("0-1", "0")).unwrap();
        let slice = fs.root("unified").join("topo.slice");
        assert!(slice.join("1/cpu.weight").exists());
        // A restart with cpu_groups = false: the jobs are no longer the scheduler's groups; the
        // parent keeps what others enabled there.
        let off = V2::detect_in(Files::new(fs.clone()), &fs.mounts(), "topo.slice")
            .unwrap()
            .without_cpu_groups();
        let read = |dir: &std::path::Path| {
            std::fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap()
        };
        assert_eq!(read(&slice), "cpuset memory");
        assert_eq!(read(&fs.root("unified")), "cpu cpuset memory");
        off.create(&job("2"), &spec("2-3", "0")).unwrap();
        assert!(!slice.join("2/cpu.weight").exists());
        off.release(&job("1"), Duration::from_secs(1)).unwrap();
        off.release(&job("2"), Duration::from_secs(1)).unwrap();
    }

    #[test]
    fn a_new_cgroup_inherits_its_parents_cpus_but_is_not_ready() {
        let fs = Arc::new(FakeCgroupFs::v2("0-7", "0-1"));
        let v2 = open(&fs);
        let dir = fs.root("unified").join("topo.slice/2");
        fs.create_dir(&dir).unwrap();
        // The kernel's inheritance: before cpuset.cpus is written, effective is the parent's.
        assert_eq!(std::fs::read_to_string(dir.join("cpuset.cpus.effective")).unwrap(), "0-7");
        fs.start_process(200);
        assert!(matches!(v2.join(&job("2"), 200), Err(CgroupError::NotReady(_))));
        let listed = v2.list().unwrap();
        assert_eq!(listed.len(), 1);
        assert!(listed[0].1.cpus.is_empty(), "never configured: listed without CPUs");
        // Written, effective follows (within the parent's).
        v2.create(&job("2"), &spec("6-7", "1")).unwrap();
        assert_eq!(std::fs::read_to_string(dir.join("cpuset.cpus.effective")).unwrap(), "6-7");
    }

    #[test]
    fn survivors_keep_the_cgroup_and_cgroups_nested_in_a_job_go_with_it() {
        let fs = Arc::new(FakeCgroupFs::v2("0-7", "0-1"));
        let v2 = open(&fs);
        v2.create(&job("3"), &spec("0-1", "0")).unwrap();
        fs.start_process(300);
        fs.unkillable(300);
        v2.join(&job("3"), 300).unwrap();
        let report = v2.release(&job("3"), Duration::from_millis(30)).unwrap();
        assert_eq!(report.survivors, vec![300]);
        assert!(fs.root("unified").join("topo.slice/3").exists());
        // Cgroups root in the job made inside it (an attack finding: rmdir was EBUSY, and the
        // job and its CPUs stayed held): their processes are the job's, and they go with it.
        v2.create(&job("4"), &spec("2-3", "0")).unwrap();
        let job4 = fs.root("unified").join("topo.slice/4");
        for inner in ["inner", "inner/deeper", "other"] {
            fs.create_dir(&job4.join(inner)).unwrap();
        }
        fs.start_process(400);
        fs.write(&job4.join("inner/deeper/cgroup.procs"), b"400").unwrap();
        assert_eq!(v2.pids(&job("4")).unwrap(), vec![400]);
        let report = v2.release(&job("4"), Duration::from_secs(1)).unwrap();
        assert_eq!((report.killed, report.survivors.len()), (1, 0), "{report:?}");
        assert!(!job4.exists());
        // One that will not die there keeps the whole job, and is named.
        v2.create(&job("6"), &spec("2-3", "0")).unwrap();
        let job6 = fs.root("unified").join("topo.slice/6");
        fs.create_dir(&job6.join("inner")).unwrap();
        fs.start_process(600);
        fs.unkillable(600);
        fs.write(&job6.join("inner/cgroup.procs"), b"600").unwrap();
        let report = v2.release(&job("6"), Duration::from_millis(30)).unwrap();
        assert_eq!(report.survivors, vec![600]);
        assert!(job6.join("inner").exists());
    }

    #[test]
    fn a_release_never_kills_the_cgroup_topod_is_in() {
        let fs = Arc::new(FakeCgroupFs::v2("0-7", "0-1"));
        let v2 = open(&fs);
        v2.create(&job("5"), &spec("0-1", "0")).unwrap();
        fs.set_own_cgroups("0::/topo.slice/5\n");
        let e = v2.release(&job("5"), Duration::from_secs(1)).unwrap_err().to_string();
        assert!(e.contains("topod itself is in job 5's cgroup"), "{e}");
    }

    #[test]
    fn with_confine_devices_each_job_gets_its_deny_list_before_it_takes_processes() {
        use super::super::devices_bpf::FakeFilter;
        use super::super::CharDevice;
        let fs = Arc::new(FakeCgroupFs::v2("0-7", "0-1"));
        let filter = Arc::new(FakeFilter::default());
        let v2 = open(&fs).with_devices(filter.clone()).unwrap();
        assert!(v2.confines_devices());
        let gpu = |minor| CharDevice { major: 195, minor };
        let dir = |id: &str| fs.root("unified").join("topo.slice").join(id);
        let mut with_gpus = spec("0-1", "0");
        with_gpus.denied_devices = vec![gpu(1), gpu(0), gpu(1)];
        v2.create(&job("g1"), &with_gpus).unwrap();
        assert_eq!(filter.denied(&dir("g1")), Some(vec![gpu(0), gpu(1)]));
        // Nothing to deny on a new cgroup: no program.
        v2.create(&job("g2"), &spec("2-3", "0")).unwrap();
        assert_eq!(filter.denied(&dir("g2")), None);
        // The rules change whole: what is allowed now is simply not denied.
        v2.set_device_rules(&job("g1"), &[gpu(0)], &[gpu(1)]).unwrap();
        assert_eq!(filter.denied(&dir("g1")), Some(vec![gpu(0)]));
        v2.set_device_rules(&job("g2"), &[gpu(1)], &[]).unwrap();
        assert_eq!(filter.denied(&dir("g2")), Some(vec![gpu(1)]));
        let e = v2.set_device_rules(&job("gone"), &[gpu(1)], &[]).unwrap_err();
        assert!(matches!(e, CgroupError::NoSuchJob(_)), "{e}");
        // Without confine_devices a job that asks for it is refused, not left open.
        let plain = open(&fs);
        assert!(!plain.confines_devices());
        let e = plain.create(&job("g3"), &with_gpus).unwrap_err().to_string();
        assert!(e.contains("not started with confine_devices"), "{e}");
        assert!(plain.set_device_rules(&job("g1"), &[gpu(1)], &[]).is_ok());
    }
}
