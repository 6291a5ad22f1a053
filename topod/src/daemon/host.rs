//! The host's state: its hardware graph, the ledger, and the job cgroups, kept in step.
//!
//! Every change goes cgroup first, ledger second, hint file third: a job is in the ledger only
//! once its cgroup exists with its CPUs, and leaves the ledger only once its cgroup is gone. The
//! hint file (the requests and tasks of the jobs, written atomically) is only a hint: at start
//! the ledger is rebuilt from the cgroups that exist ([`Host::recover`]).

use crate::cgroup::{CgroupBackend, CgroupError, CgroupSpec, JobId, JobIdError};
use crate::cpuset::CpuSet;
use crate::ledger::{Allocation, Ledger, LedgerError};
use crate::place::{self, HostMetrics, HostModel, PlaceError, Strategy};
use crate::request::{self, Request};
use crate::topology::Topology;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// Why a host operation was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// A job id that cannot name a cgroup.
    #[error(transparent)]
    BadJob(#[from] JobIdError),
    /// A request string that does not parse.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The job does not fit now.
    #[error("job {job} does not fit: {source}")]
    DoesNotFit {
        /// The job.
        job: String,
        /// Why.
        #[source]
        source: PlaceError,
    },
    /// The job already holds CPUs for another request.
    #[error("job {job} already holds CPUs {cpus} for {request}")]
    AlreadyAllocated {
        /// The job.
        job: String,
        /// Its CPUs.
        cpus: String,
        /// Its request.
        request: String,
    },
    /// A pid that names no other process (0 and below mean the writer itself to the kernel).
    #[error("pid {0} is not a process topod can move into a job")]
    BadPid(i32),
    /// No such job.
    #[error("job {0} holds nothing on this host")]
    UnknownJob(String),
    /// Processes that would not die.
    #[error("job {job}: {} process(es) would not die ({pids:?}); its cgroup and CPUs are kept", pids.len())]
    Survivors {
        /// The job.
        job: String,
        /// Their pids.
        pids: Vec<i32>,
    },
    /// The cgroup layer failed.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// The ledger refused (a bug or a foreign cgroup overlapping ours).
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

/// What the hint file keeps per job.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobHint {
    /// The canonical request.
    pub request: String,
    /// The CPUs of each task.
    pub tasks: Vec<CpuSet>,
    /// The uid that may join its own processes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_uid: Option<u32>,
}

/// What a restart found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Recovery {
    /// Jobs whose cgroups were found and kept.
    pub kept: Vec<String>,
    /// Cgroups that overlap another job's CPUs (left alone, not in the ledger).
    pub conflicts: Vec<String>,
    /// Hints for jobs that have no cgroup any more (dropped).
    pub dropped_hints: Vec<String>,
    /// Job cgroups that never got CPUs and hold no process (removed).
    pub removed: Vec<String>,
}

/// The state of one host.
pub struct Host {
    topo: Topology,
    model: HostModel,
    ledger: Ledger,
    hints: BTreeMap<String, JobHint>,
    backend: Box<dyn CgroupBackend>,
    hint_file: Option<PathBuf>,
    hint_writer: Option<HintWriter>,
    strategy: Strategy,
    release_timeout: Duration,
    /// Jobs that have had a process: only those are released when they become empty.
    joined: std::collections::BTreeSet<String>,
    /// Jobs with processes that were told how to move themselves in and have not yet confirmed
    /// with `join`: how many, and the last offer. Their joins check before writing, and
    /// [`Host::release_empty`] leaves them alone for [`SELF_JOIN_WINDOW`] after the last offer.
    self_join_offered: BTreeMap<String, (u32, std::time::Instant)>,
}

/// How long after a process was told how to move itself into a job the job is not released for
/// being empty: the move and its confirming `join` take milliseconds, but until then topod
/// cannot see the process coming.
const SELF_JOIN_WINDOW: Duration = Duration::from_secs(10);

/// Writes the hint file off the request path: each change sends the whole file; the writer
/// keeps only the newest. A write lost in a crash costs nothing but a hint.
struct HintWriter {
    tx: std::sync::mpsc::Sender<Vec<u8>>,
    thread: std::thread::JoinHandle<()>,
}

impl HintWriter {
    fn start(path: PathBuf) -> HintWriter {
        let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
        let thread = std::thread::spawn(move || {
            while let Ok(mut bytes) = rx.recv() {
                while let Ok(newer) = rx.try_recv() {
                    bytes = newer;
                }
                let tmp = path.with_extension("tmp");
                if let Err(e) = std::fs::write(&tmp, &bytes).and_then(|()| std::fs::rename(&tmp, &path)) {
                    tracing::warn!("cannot write the hint file {}: {e}", path.display());
                }
            }
        });
        HintWriter { tx, thread }
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        // Let the writer finish what it was given.
        if let Some(w) = self.hint_writer.take() {
            drop(w.tx);
            let _ = w.thread.join();
        }
    }
}

impl Host {
    /// A host with an empty ledger; call [`Host::recover`] next.
    pub fn new(topo: Topology, model: HostModel, backend: Box<dyn CgroupBackend>, hint_file: Option<PathBuf>, strategy: Strategy) -> Self {
        let hint_writer = hint_file.clone().map(HintWriter::start);
        Host {
            topo,
            model,
            ledger: Ledger::new(),
            hints: BTreeMap::new(),
            backend,
            hint_file,
            hint_writer,
            strategy,
            release_timeout: Duration::from_secs(10),
            joined: Default::default(),
            self_join_offered: Default::default(),
        }
    }

    /// Rebuilds the ledger from the job cgroups that exist; the hint file adds their requests.
    pub fn recover(&mut self) -> Result<Recovery, HostError> {
        let mut hints: BTreeMap<String, JobHint> = match &self.hint_file {
            Some(path) => match std::fs::read_to_string(path) {
                Ok(text) => serde_json::from_str(&text).unwrap_or_default(),
                Err(_) => BTreeMap::new(),
            },
            None => BTreeMap::new(),
        };
        let mut report = Recovery::default();
        for (job, eff) in self.backend.list()? {
            if eff.cpus.is_empty() {
                // Made but never given CPUs (topod died inside allocate): nothing can have
                // joined it, so it is provably dead.
                if self.backend.pids(&job).map(|p| p.is_empty()).unwrap_or(false) {
                    let _ = self.backend.release(&job, self.release_timeout);
                    report.removed.push(job.to_string());
                    continue;
                }
            }
            let hint = hints.remove(job.as_str()).unwrap_or_default();
            let tasks = if hint.tasks.is_empty() { vec![eff.cpus.clone()] } else { hint.tasks.clone() };
            let fenced = match request::parse(&hint.request).ok().and_then(|r| r.exclusive_level()) {
                Some(level) => self.model.closure(level, &eff.cpus).difference(&eff.cpus),
                None => CpuSet::new(),
            };
            let alloc = Allocation { job: job.to_string(), cpus: eff.cpus.clone(), tasks, mems: eff.mems.clone(), fenced, request: hint.request.clone() };
            if self.backend.pids(&job).map(|p| !p.is_empty()).unwrap_or(false) {
                self.joined.insert(job.to_string());
            }
            match self.ledger.insert(alloc) {
                Ok(_) => {
                    report.kept.push(job.to_string());
                    self.hints.insert(job.to_string(), hint);
                }
                Err(_) => report.conflicts.push(job.to_string()),
            }
        }
        report.dropped_hints = hints.into_keys().collect();
        self.save_hints();
        Ok(report)
    }

    /// Places and confines a job; the same job with the same request again returns what it has.
    pub fn allocate(
        &mut self,
        job: &str,
        request_text: &str,
        tasks: Option<u32>,
        given_cpus: Option<&str>,
        mem_limit: Option<u64>,
        owner_uid: Option<u32>,
    ) -> Result<Allocation, HostError> {
        let id = JobId::parse(job)?;
        let mut req = request::parse(request_text).map_err(|e| HostError::BadRequest(e.to_string()))?;
        if req.tasks.is_none() {
            req.tasks = Some(tasks.unwrap_or(place::DEFAULT_TASKS));
        }
        if let Some(text) = given_cpus {
            let given = CpuSet::parse_list(text).map_err(|e| HostError::BadRequest(format!("cpus: {e}")))?;
            req.cpu_list = Some(match &req.cpu_list {
                Some(list) => list.intersection(&given),
                None => given,
            });
        }
        let canonical = req.to_string();
        if let Some(existing) = self.ledger.get(id.as_str()) {
            if existing.request == canonical {
                return Ok(existing.clone());
            }
            if existing.request.is_empty() {
                // Recovered from its cgroup without a hint (topod died before writing it): the
                // batch system asking again tells us what it was.
                let mut adopted = existing.clone();
                adopted.request = canonical.clone();
                self.ledger.release(id.as_str())?;
                self.ledger.insert(adopted.clone())?;
                self.hints.insert(job.to_string(), JobHint { request: canonical, tasks: adopted.tasks.clone(), owner_uid });
                self.save_hints();
                return Ok(adopted);
            }
            return Err(HostError::AlreadyAllocated { job: job.to_string(), cpus: existing.cpus.to_string(), request: existing.request.clone() });
        }
        let placement = place::place(&self.model, self.ledger.occupancy(), &req, self.strategy)
            .map_err(|source| HostError::DoesNotFit { job: job.to_string(), source })?;
        let spec = CgroupSpec { cpus: placement.cpus.clone(), mems: placement.mems.clone(), memory_limit: mem_limit.or(req.mem_mib.map(|m| m << 20)) };
        self.backend.create(&id, &spec)?;
        let alloc = match self.ledger.allocate(id.as_str(), &placement, &canonical) {
            Ok(a) => a.clone(),
            Err(e) => {
                // Keep cgroups and ledger in step: undo the cgroup we just made.
                let _ = self.backend.release(&id, self.release_timeout);
                return Err(e.into());
            }
        };
        self.hints.insert(job.to_string(), JobHint { request: canonical, tasks: alloc.tasks.clone(), owner_uid });
        self.save_hints();
        Ok(alloc)
    }

    /// Moves a process into the job's cgroup.
    pub fn join(&mut self, job: &str, pid: i32) -> Result<(), HostError> {
        let id = JobId::parse(job)?;
        // Writing 0 to cgroup.procs moves the writer: topod would confine (and later kill) itself.
        if pid <= 0 || pid as u32 == std::process::id() {
            return Err(HostError::BadPid(pid));
        }
        if self.ledger.get(id.as_str()).is_none() {
            return Err(HostError::UnknownJob(job.to_string()));
        }
        if let Some((pending, _)) = self.self_join_offered.get_mut(job) {
            self.backend.join_unless_in(&id, pid)?;
            *pending = pending.saturating_sub(1);
            if *pending == 0 {
                self.self_join_offered.remove(job);
            }
        } else {
            self.backend.join(&id, pid)?;
        }
        self.joined.insert(job.to_string());
        Ok(())
    }

    /// The files through which a root process moves itself into the job's cgroup (empty where
    /// the backend has none). The process then confirms with [`Host::join`], which finds it
    /// already there and writes nothing.
    pub fn self_join_files(&mut self, job: &str) -> Result<Vec<PathBuf>, HostError> {
        let id = JobId::parse(job)?;
        if self.ledger.get(id.as_str()).is_none() {
            return Err(HostError::UnknownJob(job.to_string()));
        }
        let files = self.backend.self_join_files(&id)?;
        if !files.is_empty() {
            let offer = self.self_join_offered.entry(job.to_string()).or_insert((0, std::time::Instant::now()));
            *offer = (offer.0 + 1, std::time::Instant::now());
        }
        Ok(files)
    }

    /// Releases every job whose cgroup has had processes and has none left; returns their ids.
    /// (A job allocated but not yet joined is left alone.)
    pub fn release_empty(&mut self) -> Vec<String> {
        let moving_in = |j: &str| self.self_join_offered.get(j).is_some_and(|(_, last)| last.elapsed() < SELF_JOIN_WINDOW);
        let candidates: Vec<String> = self.joined.iter().filter(|j| self.ledger.get(j).is_some() && !moving_in(j)).cloned().collect();
        let mut released = Vec::new();
        for job in candidates {
            let Ok(id) = JobId::parse(&job) else { continue };
            if self.backend.pids(&id).map(|p| p.is_empty()).unwrap_or(false) && self.release(&job).is_ok() {
                released.push(job);
            }
        }
        released
    }

    /// Kills what is left of the job, removes its cgroup and frees its CPUs.
    pub fn release(&mut self, job: &str) -> Result<usize, HostError> {
        let id = JobId::parse(job)?;
        let known = self.ledger.get(id.as_str()).is_some();
        let report = match self.backend.release(&id, self.release_timeout) {
            Ok(r) => r,
            Err(CgroupError::NoSuchJob(_)) if known => Default::default(),
            Err(CgroupError::NoSuchJob(_)) => return Err(HostError::UnknownJob(job.to_string())),
            Err(e) => return Err(e.into()),
        };
        if !report.survivors.is_empty() {
            return Err(HostError::Survivors { job: job.to_string(), pids: report.survivors });
        }
        if known {
            self.ledger.release(id.as_str())?;
        }
        self.hints.remove(job);
        self.joined.remove(job);
        self.self_join_offered.remove(job);
        self.save_hints();
        Ok(report.killed)
    }

    /// The uid allowed to join its own processes to `job`, if one was given at allocation.
    pub fn owner_of(&self, job: &str) -> Option<u32> {
        self.hints.get(job).and_then(|h| h.owner_uid)
    }

    /// Would `request` fit now, and how well.
    pub fn fit(&self, request_text: &str, tasks: Option<u32>) -> Result<place::Fit, HostError> {
        let mut req: Request = request::parse(request_text).map_err(|e| HostError::BadRequest(e.to_string()))?;
        if req.tasks.is_none() {
            req.tasks = Some(tasks.unwrap_or(place::DEFAULT_TASKS));
        }
        place::fit_and_score(&self.model, self.ledger.occupancy(), &req).map_err(|source| HostError::DoesNotFit { job: String::new(), source })
    }

    /// The ledger.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The hardware graph.
    pub fn topology(&self) -> &Topology {
        &self.topo
    }

    /// What is free, by shape.
    pub fn host_metrics(&self) -> HostMetrics {
        HostMetrics::measure(&self.model, self.ledger.occupancy())
    }

    /// The CPUs jobs may get.
    pub fn allocatable(&self) -> &CpuSet {
        &self.model.allocatable
    }

    /// The backend's name.
    pub fn backend_kind(&self) -> &'static str {
        self.backend.kind()
    }

    /// Hands the hint file to its writer, which writes it atomically (temporary file, then
    /// rename). A failure is only logged: the cgroup tree stays the truth.
    fn save_hints(&self) {
        let Some(writer) = &self.hint_writer else { return };
        match serde_json::to_vec(&self.hints) {
            Ok(bytes) => {
                let _ = writer.tx.send(bytes);
            }
            Err(e) => tracing::warn!("cannot encode the job hints: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cgroup::fake::Fake;
    use crate::topology::SyntheticShape;

    /// A fake "kernel" that can outlive a Host (restart tests) and, when asked, offers
    /// self-join files as the v1 backend does.
    struct SharedFake {
        kernel: std::sync::Arc<Fake>,
        offers_self_join: bool,
    }

    impl CgroupBackend for SharedFake {
        fn kind(&self) -> &'static str {
            "fake"
        }
        fn create(&self, j: &JobId, s: &CgroupSpec) -> Result<crate::cgroup::Effective, CgroupError> {
            self.kernel.create(j, s)
        }
        fn join(&self, j: &JobId, p: i32) -> Result<(), CgroupError> {
            self.kernel.join(j, p)
        }
        fn self_join_files(&self, j: &JobId) -> Result<Vec<PathBuf>, CgroupError> {
            Ok(if self.offers_self_join { vec![PathBuf::from(format!("/fake/{}/tasks", j.as_str()))] } else { Vec::new() })
        }
        fn pids(&self, j: &JobId) -> Result<Vec<i32>, CgroupError> {
            self.kernel.pids(j)
        }
        fn release(&self, j: &JobId, t: Duration) -> Result<crate::cgroup::ReleaseReport, CgroupError> {
            self.kernel.release(j, t)
        }
        fn list(&self) -> Result<Vec<(JobId, crate::cgroup::Effective)>, CgroupError> {
            self.kernel.list()
        }
    }

    fn host(hints: Option<PathBuf>) -> Host {
        let topo = Topology::synthetic(SyntheticShape { packages: 2, numa_per_package: 1, l3_per_numa: 2, cores_per_l3: 4, threads_per_core: 2 });
        let model = HostModel::new(&topo, &CpuSet::new()).unwrap();
        let fake = Fake::new(topo.allowed.clone(), topo.allowed_mems.clone());
        Host::new(topo, model, Box::new(fake), hints, Strategy::BestFit)
    }

    #[test]
    fn allocate_is_idempotent_and_release_frees() {
        let mut h = host(None);
        let a = h.allocate("7", "affinity[core(2)*2]", None, None, None, None).unwrap();
        assert_eq!(a.cpus.len(), 8);
        assert_eq!(h.allocate("7", "affinity[core(2)*2]", None, None, None, None).unwrap(), a);
        assert!(matches!(h.allocate("7", "affinity[thread]", None, None, None, None), Err(HostError::AlreadyAllocated { .. })));
        h.join("7", 123).unwrap();
        assert!(matches!(h.join("8", 1), Err(HostError::UnknownJob(_))));
        assert!(h.release_empty().is_empty(), "job 7 still has its process");
        assert_eq!(h.release("7").unwrap(), 1);
        // A job that had a process and has none left goes by itself; one never joined stays.
        h.allocate("10", "affinity[thread]", None, None, None, None).unwrap();
        h.allocate("11", "affinity[thread]", None, None, None, None).unwrap();
        h.join("10", 77).unwrap();
        h.backend.release(&JobId::parse("10").unwrap(), Duration::from_secs(1)).unwrap();
        h.backend.create(&JobId::parse("10").unwrap(), &CgroupSpec { cpus: h.ledger().get("10").unwrap().cpus.clone(), mems: h.ledger().get("10").unwrap().mems.clone(), memory_limit: None }).unwrap();
        assert_eq!(h.release_empty(), ["10"]);
        assert!(h.ledger().get("11").is_some());
        h.release("11").unwrap();
        assert!(h.ledger().is_empty());
        assert!(matches!(h.release("7"), Err(HostError::UnknownJob(_))));
    }

    #[test]
    fn a_job_with_a_process_moving_itself_in_is_not_released_as_empty() {
        let topo = Topology::synthetic(SyntheticShape { packages: 1, numa_per_package: 1, l3_per_numa: 1, cores_per_l3: 4, threads_per_core: 1 });
        let model = HostModel::new(&topo, &CpuSet::new()).unwrap();
        let kernel = std::sync::Arc::new(Fake::new(topo.allowed.clone(), topo.allowed_mems.clone()));
        let mut h = Host::new(topo, model, Box::new(SharedFake { kernel, offers_self_join: true }), None, Strategy::BestFit);
        let a = h.allocate("20", "affinity[thread*2]", None, None, None, None).unwrap();
        let id = JobId::parse("20").unwrap();
        let empty_the_cgroup = |h: &mut Host| {
            h.backend.release(&id, Duration::from_secs(1)).unwrap();
            h.backend.create(&id, &CgroupSpec { cpus: a.cpus.clone(), mems: a.mems.clone(), memory_limit: None }).unwrap();
        };
        // Task 0 joined and ended; task 1 was told how to move itself in and has not confirmed.
        h.join("20", 100).unwrap();
        assert_eq!(h.self_join_files("20").unwrap().len(), 1);
        empty_the_cgroup(&mut h);
        assert!(h.release_empty().is_empty(), "task 1 is on its way in");
        // Task 1 confirms; when it ends, the job goes.
        h.join("20", 101).unwrap();
        empty_the_cgroup(&mut h);
        assert_eq!(h.release_empty(), ["20"]);
        assert!(matches!(h.self_join_files("20"), Err(HostError::UnknownJob(_))));
    }

    #[test]
    fn bad_input_changes_nothing() {
        let mut h = host(None);
        for (job, req) in [("../x", "affinity[thread]"), ("a/b", "affinity[thread]"), (".", "affinity[thread]"), ("ok", "affinity[cores]"), ("ok", "affinity[thread*999]")] {
            assert!(h.allocate(job, req, None, None, None, None).is_err(), "{job} {req}");
        }
        assert!(h.ledger().is_empty());
        assert!(h.allocate("9", "affinity[thread*4]", None, Some("0-1"), None, None).is_err(), "inside the CPUs the batch system gave");
        let inside = h.allocate("9", "affinity[thread*2]", None, Some("8-9"), None, None).unwrap();
        assert_eq!(inside.cpus.to_string(), "8-9");
    }

    #[test]
    fn a_restart_keeps_every_job() {
        let dir = tempfile::tempdir().unwrap();
        let hints = dir.path().join("jobs.json");
        let topo = Topology::synthetic(SyntheticShape { packages: 1, numa_per_package: 1, l3_per_numa: 1, cores_per_l3: 8, threads_per_core: 1 });
        let model = HostModel::new(&topo, &CpuSet::new()).unwrap();
        // One fake "kernel" that outlives the daemon.
        let kernel = std::sync::Arc::new(Fake::new(topo.allowed.clone(), topo.allowed_mems.clone()));
        let mut first = Host::new(topo.clone(), model.clone(), Box::new(SharedFake { kernel: kernel.clone(), offers_self_join: false }), Some(hints.clone()), Strategy::BestFit);
        let a = first.allocate("1", "CPUSET[CPUSET_OPTIONS=CPUSET_CPU_EXCLUSIVE] affinity[thread*3]", None, None, None, Some(1000)).unwrap();
        let b = first.allocate("2", "affinity[thread*2]", None, None, None, None).unwrap();
        drop(first);
        let mut again = Host::new(topo, model, Box::new(SharedFake { kernel, offers_self_join: false }), Some(hints), Strategy::BestFit);
        let report = again.recover().unwrap();
        assert_eq!(report.kept, ["1", "2"]);
        assert_eq!(again.ledger().get("1").unwrap().cpus, a.cpus);
        assert_eq!(again.ledger().get("2").unwrap().request, b.request);
        assert_eq!(again.owner_of("1"), Some(1000));
        again.ledger().check().unwrap();
        // No CPU is handed out twice after the restart.
        let c = again.allocate("3", "affinity[thread*3]", None, None, None, None).unwrap();
        assert!(!c.cpus.intersects(&a.cpus) && !c.cpus.intersects(&b.cpus));
    }
}
