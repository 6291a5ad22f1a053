//! An in-memory cgroup backend for tests of the callers: the same rules as the kernel's (no
//! join before CPUs and memory nodes, effective CPUs limited to the parent's), no processes.

use super::{CgroupBackend, CgroupError, CgroupSpec, CharDevice, Effective, JobId, ReleaseReport};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;
use topo_core::cpuset::CpuSet;

/// In-memory job cgroups under a parent that allows `parent_cpus` and `parent_mems`.
#[derive(Debug)]
pub struct Fake {
    parent_cpus: CpuSet,
    parent_mems: CpuSet,
    jobs: Mutex<BTreeMap<JobId, (Effective, Vec<i32>)>>,
    frozen: Mutex<std::collections::BTreeSet<JobId>>,
    /// With `confine_devices`: each job's denied devices, as its spec gave them.
    denied: Option<Mutex<BTreeMap<JobId, Vec<CharDevice>>>>,
}

impl Fake {
    /// A fake hierarchy whose parent holds these CPUs and memory nodes.
    pub fn new(parent_cpus: CpuSet, parent_mems: CpuSet) -> Self {
        Fake {
            parent_cpus,
            parent_mems,
            jobs: Mutex::new(BTreeMap::new()),
            frozen: Mutex::new(Default::default()),
            denied: None,
        }
    }

    /// Keeps each job's denied devices, as the v1 backend opened with its `devices` hierarchy.
    pub fn confining_devices(mut self) -> Self {
        self.denied = Some(Mutex::new(BTreeMap::new()));
        self
    }

    /// The devices `job` was denied at creation (`None`: not confining, or no such job).
    pub fn denied_devices(&self, job: &JobId) -> Option<Vec<CharDevice>> {
        let denied = self.denied.as_ref()?.lock().unwrap_or_else(|e| e.into_inner());
        denied.get(job).cloned()
    }

    fn jobs(&self) -> std::sync::MutexGuard<'_, BTreeMap<JobId, (Effective, Vec<i32>)>> {
        // A panic in another test thread must not poison every later call.
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl CgroupBackend for Fake {
    fn kind(&self) -> &'static str {
        "fake"
    }

    fn confines_devices(&self) -> bool {
        self.denied.is_some()
    }

    fn set_device_rules(
        &self,
        job: &JobId,
        denied: &[CharDevice],
        allowed: &[CharDevice],
    ) -> Result<(), CgroupError> {
        let Some(rules) = &self.denied else { return Ok(()) };
        if !self.jobs().contains_key(job) {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        let mut rules = rules.lock().unwrap_or_else(|e| e.into_inner());
        let now = rules.entry(job.clone()).or_default();
        now.extend_from_slice(denied);
        now.retain(|d| !allowed.contains(d));
        now.sort();
        now.dedup();
        Ok(())
    }

    fn create(&self, job: &JobId, spec: &CgroupSpec) -> Result<Effective, CgroupError> {
        let effective = Effective {
            cpus: spec.cpus.intersection(&self.parent_cpus),
            mems: spec.mems.intersection(&self.parent_mems),
        };
        let mut jobs = self.jobs();
        if let Some((existing, _)) = jobs.get(job) {
            if *existing != effective {
                return Err(CgroupError::Exists {
                    job: job.to_string(),
                    existing: existing.cpus.to_string(),
                    wanted: spec.cpus.to_string(),
                });
            }
            return Ok(existing.clone());
        }
        match &self.denied {
            Some(denied) => {
                let mut denied = denied.lock().unwrap_or_else(|e| e.into_inner());
                denied.insert(job.clone(), spec.denied_devices.clone());
            }
            None if !spec.denied_devices.is_empty() => {
                return Err(CgroupError::Unsupported(format!(
                    "job {job}: its devices cannot be confined: topod was not started with confine_devices"
                )));
            }
            None => {}
        }
        jobs.insert(job.clone(), (effective.clone(), Vec::new()));
        Ok(effective)
    }

    fn update(&self, job: &JobId, spec: &CgroupSpec) -> Result<Effective, CgroupError> {
        let mut jobs = self.jobs();
        let (eff, _) = jobs.get_mut(job).ok_or_else(|| CgroupError::NoSuchJob(job.to_string()))?;
        *eff = Effective {
            cpus: spec.cpus.intersection(&self.parent_cpus),
            mems: spec.mems.intersection(&self.parent_mems),
        };
        Ok(eff.clone())
    }

    fn join(&self, job: &JobId, pid: i32) -> Result<(), CgroupError> {
        let mut jobs = self.jobs();
        let (eff, pids) =
            jobs.get_mut(job).ok_or_else(|| CgroupError::NoSuchJob(job.to_string()))?;
        if eff.cpus.is_empty() || eff.mems.is_empty() {
            return Err(CgroupError::NotReady(job.to_string()));
        }
        if !pids.contains(&pid) {
            pids.push(pid);
        }
        Ok(())
    }

    fn pids(&self, job: &JobId) -> Result<Vec<i32>, CgroupError> {
        self.jobs()
            .get(job)
            .map(|(_, p)| p.clone())
            .ok_or_else(|| CgroupError::NoSuchJob(job.to_string()))
    }

    fn release(&self, job: &JobId, _timeout: Duration) -> Result<ReleaseReport, CgroupError> {
        self.frozen.lock().unwrap_or_else(|e| e.into_inner()).remove(job);
        if let Some(denied) = &self.denied {
            denied.lock().unwrap_or_else(|e| e.into_inner()).remove(job);
        }
        let (_, pids) =
            self.jobs().remove(job).ok_or_else(|| CgroupError::NoSuchJob(job.to_string()))?;
        Ok(ReleaseReport { killed: pids.len(), survivors: Vec::new() })
    }

    fn list(&self) -> Result<Vec<(JobId, Effective)>, CgroupError> {
        Ok(self.jobs().iter().map(|(j, (e, _))| (j.clone(), e.clone())).collect())
    }

    fn freeze(&self, job: &JobId, _timeout: Duration) -> Result<(), CgroupError> {
        self.set_frozen(job, true)
    }

    fn thaw(&self, job: &JobId, _timeout: Duration) -> Result<(), CgroupError> {
        self.set_frozen(job, false)
    }

    fn is_frozen(&self, job: &JobId) -> Result<bool, CgroupError> {
        Ok(self.frozen.lock().unwrap_or_else(|e| e.into_inner()).contains(job))
    }
}

impl Fake {
    fn set_frozen(&self, job: &JobId, frozen: bool) -> Result<(), CgroupError> {
        if !self.jobs().contains_key(job) {
            return Err(CgroupError::NoSuchJob(job.to_string()));
        }
        let mut set = self.frozen.lock().unwrap_or_else(|e| e.into_inner());
        if frozen {
            set.insert(job.clone());
        } else {
            set.remove(job);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fake_keeps_the_kernel_rules() {
        let fake = Fake::new(CpuSet::parse_list("0-7").unwrap(), CpuSet::parse_list("0").unwrap());
        let job = JobId::parse("42").unwrap();
        let spec = CgroupSpec {
            cpus: CpuSet::parse_list("2-3,9").unwrap(),
            mems: CpuSet::parse_list("0").unwrap(),
            ..Default::default()
        };
        let eff = fake.create(&job, &spec).unwrap();
        assert_eq!(eff.cpus.to_string(), "2-3", "limited to the parent");
        assert_eq!(fake.create(&job, &spec).unwrap(), eff, "idempotent");
        let other = CgroupSpec { cpus: CpuSet::parse_list("4").unwrap(), ..spec.clone() };
        assert!(matches!(fake.create(&job, &other), Err(CgroupError::Exists { .. })));
        fake.join(&job, 100).unwrap();
        assert_eq!(fake.pids(&job).unwrap(), [100]);
        let empty = JobId::parse("43").unwrap();
        fake.create(&empty, &CgroupSpec::default()).unwrap();
        assert!(matches!(fake.join(&empty, 1), Err(CgroupError::NotReady(_))));
        assert_eq!(fake.list().unwrap().len(), 2);
        assert_eq!(fake.release(&job, Duration::from_secs(1)).unwrap().killed, 1);
        assert!(matches!(fake.pids(&job), Err(CgroupError::NoSuchJob(_))));
    }
}
