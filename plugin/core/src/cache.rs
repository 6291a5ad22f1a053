//! The host-state cache: per host, a shared hardware model and the free map topod last
//! reported. Pure data; [`crate::fetch`] fills it.

use crate::address::Address;
use serde::Deserialize;
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};
use topo_core::cpuset::CpuSet;
use topo_core::place::model::HostModel;
use topo_core::place::Occupancy;
use topo_core::topology::Topology;

/// A host's index in the cache; stable for the life of the cache.
pub type HostId = u32;

/// The part of topod's `free_map` reply ([`topo_core::proto::reply::FreeMap`]) the cache keeps, so
/// that ten thousand hosts cost no more than they must; `reads_the_protocols_free_map` checks
/// that it reads what topod sends.
#[derive(Debug, Clone, Deserialize)]
pub struct FreeMap {
    /// The ledger's generation: it changes whenever a job is allocated or released.
    pub generation: u64,
    /// CPUs jobs may get on that host (its reserved CPUs left out).
    pub allocatable: CpuSet,
    /// CPUs held by jobs.
    pub held: CpuSet,
    /// CPUs no new job may get (the rest of an exclusive job's domains).
    pub fenced: CpuSet,
    /// The jobs topod holds CPUs for.
    #[serde(default)]
    pub job_ids: Vec<String>,
}

/// What the cache knows of a host's state.
#[derive(Debug, Clone)]
pub struct HostState {
    /// Index into the shared models.
    pub model: u32,
    /// What a new job may not use: held, fenced, or not allocatable on that host.
    pub occupancy: Occupancy,
    /// topod's ledger generation.
    pub generation: u64,
    /// Hashes of the job ids topod holds ([`job_hash`]), sorted.
    pub jobs: Box<[u64]>,
}

/// One host.
#[derive(Debug)]
pub struct HostEntry {
    /// Its name as the batch system spells it.
    pub name: Box<str>,
    /// Where its topod answers.
    pub address: Address,
    /// Its last known state.
    pub state: Option<HostState>,
    /// When that state was fetched.
    pub fetched_at: Option<Instant>,
    /// Why the last fetch failed, when it did.
    pub last_error: Option<Box<str>>,
    /// Changes whenever `state` does (for [`crate::eval::Memo`]).
    pub version: u32,
}

/// Why a host's state cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unknown {
    /// The host is not in the cache.
    NotKnown,
    /// Never fetched successfully.
    NeverFetched(Option<Box<str>>),
    /// Fetched too long ago.
    Stale(Duration, Option<Box<str>>),
}

impl std::fmt::Display for Unknown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let why = |e: &Option<Box<str>>| {
            e.as_deref().map(|e| format!(" (last error: {e})")).unwrap_or_default()
        };
        match self {
            Unknown::NotKnown => write!(f, "no topod address is configured for this host"),
            Unknown::NeverFetched(e) => write!(f, "its topod has not answered yet{}", why(e)),
            Unknown::Stale(age, e) => {
                write!(f, "its topod last answered {} s ago{}", age.as_secs(), why(e))
            }
        }
    }
}

/// The cache.
#[derive(Debug, Default)]
pub struct HostCache {
    models: Vec<Arc<HostModel>>,
    model_by_key: HashMap<u64, u32>,
    hosts: Vec<HostEntry>,
    by_name: HashMap<Box<str>, HostId>,
}

/// A stable hash of a job id, for the per-host job lists.
pub fn job_hash(job: &str) -> u64 {
    let mut h = DefaultHasher::new();
    job.hash(&mut h);
    h.finish()
}

impl HostCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `name` (or returns it when present).
    pub fn add(&mut self, name: &str, address: Address) -> HostId {
        if let Some(&id) = self.by_name.get(name) {
            return id;
        }
        let id = self.hosts.len() as HostId;
        self.hosts.push(HostEntry {
            name: name.into(),
            address,
            state: None,
            fetched_at: None,
            last_error: None,
            version: 0,
        });
        self.by_name.insert(name.into(), id);
        id
    }

    /// The host called `name`: exactly, or by its short name when the batch system and the
    /// configuration disagree on the domain.
    pub fn lookup(&self, name: &str) -> Option<HostId> {
        if let Some(&id) = self.by_name.get(name) {
            return Some(id);
        }
        let short = name.split('.').next().unwrap_or(name);
        self.by_name.get(short).copied().or_else(|| {
            // A configured FQDN asked for by its short name.
            self.hosts
                .iter()
                .position(|h| h.name.split('.').next() == Some(short))
                .map(|i| i as HostId)
        })
    }

    /// Number of hosts.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// A host.
    pub fn host(&self, id: HostId) -> &HostEntry {
        &self.hosts[id as usize]
    }

    /// Every host, with its id.
    pub fn hosts(&self) -> impl Iterator<Item = (HostId, &HostEntry)> {
        self.hosts.iter().enumerate().map(|(i, h)| (i as HostId, h))
    }

    /// Number of distinct hardware models.
    pub fn model_count(&self) -> usize {
        self.models.len()
    }

    /// The model of a state.
    pub fn model(&self, state: &HostState) -> &HostModel {
        &self.models[state.model as usize]
    }

    /// Whether a fetch for `id` must also bring the topology.
    pub fn needs_topology(&self, id: HostId) -> bool {
        self.hosts[id as usize].state.is_none()
    }

    /// The state of `id` if it is fresh enough at `now`.
    pub fn usable(
        &self,
        id: HostId,
        now: Instant,
        stale_after: Duration,
    ) -> Result<&HostState, Unknown> {
        let h = &self.hosts[id as usize];
        match (&h.state, h.fetched_at) {
            (Some(state), Some(at)) => {
                let age = now.saturating_duration_since(at);
                if age > stale_after {
                    Err(Unknown::Stale(age, h.last_error.clone()))
                } else {
                    Ok(state)
                }
            }
            _ => Err(Unknown::NeverFetched(h.last_error.clone())),
        }
    }

    /// Records a successful fetch. `topology` comes with the first fetch of a host (and whenever
    /// the fetcher asks again); hosts with equal topologies share one model.
    pub fn update(
        &mut self,
        id: HostId,
        topology: Option<&Topology>,
        free: FreeMap,
        at: Instant,
    ) -> Result<(), String> {
        let model = match topology {
            Some(topo) => self.intern_model(topo)?,
            None => match &self.hosts[id as usize].state {
                Some(s) => s.model,
                None => return Err("the first fetch of a host must bring its topology".into()),
            },
        };
        let m = &self.models[model as usize];
        let mut unusable = m.allocatable.difference(&free.allocatable);
        unusable.union_with(&free.fenced);
        let mut jobs: Vec<u64> = free.job_ids.iter().map(|j| job_hash(j)).collect();
        jobs.sort_unstable();
        let h = &mut self.hosts[id as usize];
        h.state = Some(HostState {
            model,
            occupancy: Occupancy { held: free.held, fenced: unusable },
            generation: free.generation,
            jobs: jobs.into(),
        });
        h.fetched_at = Some(at);
        h.last_error = None;
        h.version = h.version.wrapping_add(1);
        Ok(())
    }

    /// Records a failed fetch; the last good state stays until it goes stale.
    pub fn failed(&mut self, id: HostId, error: &str) {
        self.hosts[id as usize].last_error = Some(error.into());
    }

    fn intern_model(&mut self, topo: &Topology) -> Result<u32, String> {
        let key = {
            let mut h = DefaultHasher::new();
            serde_json::to_string(topo).map_err(|e| e.to_string())?.hash(&mut h);
            h.finish()
        };
        if let Some(&m) = self.model_by_key.get(&key) {
            return Ok(m);
        }
        let model = HostModel::new(topo, &CpuSet::new()).map_err(|e| e.to_string())?;
        let m = self.models.len() as u32;
        self.models.push(Arc::new(model));
        self.model_by_key.insert(key, m);
        Ok(m)
    }
}

impl HostState {
    /// Whether topod reports holding `job`.
    pub fn holds(&self, job: &str) -> bool {
        self.jobs.binary_search(&job_hash(job)).is_ok()
    }
}
