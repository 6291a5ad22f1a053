//! What reads need: a [`Snapshot`] copied out under the host lock in a moment and published
//! after every change, so that the free map, `fit`, the job list and the host picture are
//! answered without the lock; and the jobs as clients see them ([`Host::jobs`]).

use super::*;

/// What reads need of the host, copied out under the lock in a moment and used without it.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// The placement model (shared, replaced when foreign cpusets change).
    pub model: Arc<HostModel>,
    /// The host's topology (its GPUs, for `fit`'s `gpus=`).
    pub topo: Arc<Topology>,
    /// Its fingerprint ([`Topology::fingerprint`]), computed once.
    pub topology_id: u64,
    /// The placement strategy.
    pub strategy: Strategy,
    /// Held and fenced CPUs.
    pub occupancy: place::Occupancy,
    /// The ledger's generation.
    pub generation: u64,
    /// The jobs, with their state and owner.
    pub jobs: Vec<JobView>,
    /// Gang time slicing, when configured.
    pub gang: Option<topo_core::proto::reply::GangStatus>,
    /// The live topology reservations.
    pub reservations: Vec<topo_core::reservation::Reservation>,
    /// Whether the host moves jobs to make room (`defrag`).
    pub defrag: bool,
    /// The prime-time pools, open or not as of this snapshot.
    pub pools: Vec<topo_core::proto::reply::PoolStatus>,
    /// With `defrag`, what the planner would work with (`Host::defrag_view`).
    pub moves: Option<topo_core::proto::reply::DefragView>,
}

impl Snapshot {
    /// Would `prepared` fit, and how well, for a job that has no reservation here (other jobs'
    /// reserved blocks, and the GPUs they hold, are not free to it).
    /// A request with `gpus=` is fitted beside the free GPUs topod would choose.
    pub fn fit(&self, prepared: &Prepared) -> Result<place::Fit, HostError> {
        let usable = self.usable();
        let mut request = std::borrow::Cow::Borrowed(&prepared.request);
        if gpus::gpus_to_choose(prepared)?.is_some() {
            let pick = gpus::pick_gpus(
                &self.topo,
                &self.model,
                &usable,
                &self.taken_gpus().into_iter().map(str::to_string).collect(),
                &prepared.request,
                self.strategy,
                "",
            )?;
            let near = pick.near.as_ref().and_then(|near| topo_core::gpus::within(&request, near));
            // Near them as allocate places it (gpubind=any: there when it fits, else anywhere).
            let any = prepared.request.gpubind == Some(request::GpuBind::Any);
            if let Some(near) =
                near.filter(|near| !any || place::fit_and_score(&self.model, &usable, near).is_ok())
            {
                request = std::borrow::Cow::Owned(near);
            }
        }
        place::fit_and_score(&self.model, &usable, &request).map_err(|source| {
            HostError::DoesNotFit { job: String::new(), source, held_back: String::new() }
        })
    }

    /// The `free_map` reply: what schedulers' plug-ins read of the host.
    pub fn free_map(&self) -> topo_core::proto::reply::FreeMap {
        topo_core::proto::reply::FreeMap {
            generation: self.generation,
            allocatable: self.model.allocatable.clone(),
            held: self.occupancy.held.clone(),
            fenced: self.occupancy.fenced.clone(),
            jobs: self.jobs.len(),
            job_ids: self.jobs.iter().map(|j| j.allocation.job.clone()).collect(),
            free: self.host_metrics(),
            gang: self.gang.clone(),
            reservations: self.reservations.clone(),
            defrag: self.defrag,
            pools: self.pools.clone(),
            moves: self.moves.clone(),
            gpus: self
                .free_gpus()
                .into_iter()
                .map(|g| topo_core::gpus::GpuSite::of(&self.topo, g))
                .collect(),
            reserved_gpus: self.reserved_free_gpus(),
            held_gpus: self.held_gpus(),
            topology_id: Some(self.topology_id),
        }
    }

    /// The GPUs jobs hold that are GPUs for jobs here (not a device a batch system named that
    /// is none, nor one the host no longer has), with their jobs.
    fn held_gpus(&self) -> Vec<topo_core::proto::reply::HeldGpu> {
        let gpus = topo_core::gpus::gpu_indices(&self.topo);
        let mut out = Vec::new();
        for j in &self.jobs {
            for gpu in &j.gpus {
                let Some(&g) =
                    gpus.iter().find(|&&g| self.topo.devices[g].pci_address == gpu.pci_address)
                else {
                    continue;
                };
                out.push(topo_core::proto::reply::HeldGpu {
                    job: j.allocation.job.clone(),
                    pci_address: gpu.pci_address.clone(),
                    site: topo_core::gpus::GpuSite::of(&self.topo, g),
                });
            }
        }
        out
    }

    /// The GPUs reservations hold for their jobs that no job holds now, with their jobs.
    fn reserved_free_gpus(&self) -> Vec<topo_core::proto::reply::ReservedGpu> {
        let held: std::collections::BTreeSet<&str> =
            self.jobs.iter().flat_map(|j| j.gpus.iter().map(|g| g.pci_address.as_str())).collect();
        let mut out = Vec::new();
        for r in &self.reservations {
            for address in r.gpus.iter().filter(|a| !held.contains(a.as_str())) {
                if let Some(g) = self.topo.devices.iter().position(|d| &d.pci_address == address) {
                    out.push(topo_core::proto::reply::ReservedGpu {
                        job: r.job.clone(),
                        site: topo_core::gpus::GpuSite::of(&self.topo, g),
                    });
                }
            }
        }
        out
    }

    /// The host's GPUs (and accelerators) no job holds and no reservation holds for its job,
    /// by index in the topology's devices: what a job without a reservation here may be given.
    pub fn free_gpus(&self) -> Vec<usize> {
        let held = self.taken_gpus();
        topo_core::gpus::gpu_indices(&self.topo)
            .into_iter()
            .filter(|&g| !held.contains(self.topo.devices[g].pci_address.as_str()))
            .collect()
    }

    /// The PCI addresses of the GPUs jobs hold and reservations hold for their jobs.
    fn taken_gpus(&self) -> std::collections::BTreeSet<&str> {
        self.jobs
            .iter()
            .flat_map(|j| j.gpus.iter().map(|g| g.pci_address.as_str()))
            .chain(self.reservations.iter().flat_map(|r| r.gpus.iter().map(String::as_str)))
            .collect()
    }

    /// What is free, by shape, for a job that has no reservation here (what Slurm's features
    /// and PBS's counts are made from).
    pub fn host_metrics(&self) -> HostMetrics {
        HostMetrics::measure(&self.model, &self.usable())
    }

    /// The occupancy with every reserved block fenced (the snapshot holds live ones only).
    fn usable(&self) -> place::Occupancy {
        topo_core::reservation::blocked_for(&self.occupancy, &self.reservations, "", i64::MIN)
    }
}

impl Host {
    /// What reads need, copied for use without the lock.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            model: self.model.clone(),
            topo: self.topo.clone(),
            topology_id: self.topology_id,
            strategy: self.strategy,
            // With gang rows, what a job that runs through every slice must avoid.
            occupancy: self.ledger.occupancy_for(None),
            // Reservations change what placement may use, so they count as changes too.
            generation: self.ledger.generation() + self.reservations.changes(),
            jobs: self.jobs(),
            reservations: self.reservations(),
            defrag: self.defrag.is_some(),
            gang: self.gang_status.clone(),
            pools: self.pool_status(),
            moves: self.defrag_view(),
        }
    }

    /// Every job with its state, owner, and the CPUs lent between suspended and running jobs.
    pub fn jobs(&self) -> Vec<JobView> {
        let loans = self.ledger.lent();
        let view = |a: &Allocation, state: JobState| {
            // Worked out once: the GPUs' distances are to the tasks each is for.
            let task_gpus = self.task_gpus_of(a);
            JobView {
                allocation: a.clone(),
                state: if self.releasing.contains(&a.job) { JobState::Releasing } else { state },
                owner_uid: self.owner_of(&a.job),
                lent_to: loans
                    .iter()
                    .filter(|l| l.owner == a.job)
                    .map(|l| (l.holder.clone(), l.cpus.clone()))
                    .collect(),
                borrowed_from: loans
                    .iter()
                    .filter(|l| l.holder == a.job)
                    .map(|l| (l.owner.clone(), l.cpus.clone()))
                    .collect(),
                missized: self.missized.get(&a.job).cloned(),
                preempted_by: (state == JobState::Suspended)
                    .then(|| self.hints.get(&a.job).and_then(|h| h.preempted_by.clone()))
                    .flatten(),
                queue: self.hints.get(&a.job).and_then(|h| h.ask.queue.clone()),
                pool: self.hints.get(&a.job).and_then(|h| h.ask.pool.clone()),
                tasks_cap: self.hints.get(&a.job).and_then(|h| h.tasks_cap),
                batch_suspended: state == JobState::Suspended
                    && self.hints.get(&a.job).is_some_and(|h| h.batch_suspended),
                gpus: self.hints.get(&a.job).map_or_else(Vec::new, |h| {
                    self.gpus_of(&h.ask.gpus, &a.cpus, &task_gpus, &a.tasks)
                }),
                nics: self
                    .nics_of(self.hints.get(&a.job).map_or(&[][..], |h| &h.ask.gpus), &a.cpus),
                task_gpus,
            }
        };
        let mut jobs: Vec<JobView> = self
            .ledger
            .jobs()
            .map(|a| view(a, JobState::Running))
            .chain(self.ledger.suspended_jobs().map(|a| view(a, JobState::Suspended)))
            .chain(self.ledger.gang_frozen_jobs().map(|a| view(a, JobState::Frozen)))
            .collect();
        jobs.sort_by(|a, b| a.allocation.job.cmp(&b.allocation.job));
        jobs
    }

    /// Each task's GPUs, for a job of several tasks asking `gpus=n` per task, or given GPUs by
    /// its batch system as many for each task.
    fn task_gpus_of(&self, a: &Allocation) -> Vec<Vec<String>> {
        let Some(addresses) = self.hints.get(&a.job).map(|h| &h.ask.gpus) else {
            return Vec::new();
        };
        let asked = topo_core::request::parse(&a.request).ok().and_then(|r| r.gpus_per_task);
        let even = (!a.tasks.is_empty() && addresses.len() % a.tasks.len() == 0)
            .then(|| (addresses.len() / a.tasks.len()) as u32)
            .filter(|&n| n > 0);
        let per_task = asked.or(even);
        let (Some(per_task), true) = (per_task, a.tasks.len() > 1) else { return Vec::new() };
        let gpus: Option<Vec<usize>> = addresses.iter().map(|a| self.device_index(a)).collect();
        let Some(gpus) = gpus else { return Vec::new() };
        topo_core::gpus::gpus_per_task(&self.topo, &gpus, &a.tasks, per_task as usize)
            .unwrap_or_default()
            .into_iter()
            .map(|task| {
                task.into_iter().map(|g| self.topo.devices[g].pci_address.clone()).collect()
            })
            .collect()
    }

    /// The index in the topology's devices of the device `address` names (`None`: gone).
    fn device_index(&self, address: &str) -> Option<usize> {
        let device = self.topo.device(address)?;
        self.topo.devices.iter().position(|d| d.pci_address == device.pci_address)
    }

    /// The network adapters nearest a job with the GPUs `addresses` on `cpus`.
    fn nics_of(&self, addresses: &[String], cpus: &CpuSet) -> Vec<topo_core::ledger::JobNic> {
        let gpus: Vec<usize> = addresses.iter().filter_map(|a| self.device_index(a)).collect();
        // A job whose GPUs this host no longer has is not given adapters by its CPUs instead.
        if gpus.is_empty() && !addresses.is_empty() {
            return Vec::new();
        }
        topo_core::gpus::nics_near(&self.topo, &gpus, cpus)
            .into_iter()
            .map(|(n, near)| topo_core::ledger::JobNic {
                pci_address: self.topo.devices[n].pci_address.clone(),
                names: self.topo.devices[n].names.clone(),
                near,
            })
            .collect()
    }

    /// The GPUs `addresses` as a job on `cpus` sees them: names, nodes and distances (each
    /// to the CPUs of the `tasks` that `task_gpus` gives it, else to all of `cpus`).
    fn gpus_of(
        &self,
        addresses: &[String],
        cpus: &CpuSet,
        task_gpus: &[Vec<String>],
        tasks: &[CpuSet],
    ) -> Vec<topo_core::ledger::JobGpu> {
        addresses
            .iter()
            .map(|address| {
                let device = self.topo.device(address);
                let users: Vec<&CpuSet> = task_gpus
                    .iter()
                    .zip(tasks)
                    .filter(|(gpus, _)| gpus.contains(address))
                    .map(|(_, t)| t)
                    .collect();
                let its_tasks = CpuSet::union_all(users);
                let cpus = if its_tasks.is_empty() { cpus } else { &its_tasks };
                topo_core::ledger::JobGpu {
                    pci_address: address.clone(),
                    name: device.and_then(|d| d.names.first().cloned()),
                    numa_node: device.and_then(|d| d.numa_node),
                    distance: device.and_then(|d| self.topo.device_distance(d, cpus)),
                    gone: device.is_none(),
                    fabric: device.and_then(|d| d.fabric.clone()),
                }
            })
            .collect()
    }
}
