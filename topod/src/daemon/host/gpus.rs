//! GPUs topod chooses (issue 33, mode 2): a request that asks for `gpus=n` per task, where the
//! batch system did not say which GPUs the job has (topod alone, LSF with topo's module), gets
//! the GPUs [`topo_core::gpus::choose`] picks among those no job holds: under one PCIe switch
//! and in the NUMA node (else the package) where its CPUs fit beside them. It then runs near
//! them or waits ([`Prepared::near_only`]); `gpubind=any` lets it run anywhere once placed
//! near them failed. The GPUs go into its record, its listing and, with `confine_devices`, its
//! device rules, as GPUs a batch system gave.

use super::{Host, HostError, Prepared};
use topo_core::cpuset::CpuSet;
use topo_core::gpus::GpuSite;
use topo_core::place::{self, HostModel, PlaceError, Strategy};
use topo_core::request::GpuBind;
use topo_core::request::Level;
use topo_core::request::Request;
use topo_core::topology::Topology;

impl Host {
    /// The PCI addresses of the GPUs live jobs hold (running, suspended or frozen in a gang
    /// row): what no other job may be given by topod.
    pub fn held_gpus(&self) -> std::collections::BTreeSet<String> {
        self.hints.values().flat_map(|h| h.ask.gpus.iter().cloned()).collect()
    }

    /// The GPUs `job` may not be given: those live jobs hold, and those the live reservations
    /// of other jobs hold for them.
    pub(super) fn gpus_kept_from(&self, job: &str) -> std::collections::BTreeSet<String> {
        let now = self.now_s();
        let mut kept = self.held_gpus();
        for r in self.reservations.others_live(job, now) {
            kept.extend(r.gpus.iter().cloned());
        }
        kept
    }

    /// The GPUs `job`'s live reservation holds for it, where it has one that holds GPUs.
    fn reserved_gpus(&self, job: &str) -> Option<&[String]> {
        let now = self.now_s();
        self.reservations
            .live_of(job, now)
            .filter(|r| !r.gpus.is_empty())
            .map(|r| r.gpus.as_slice())
    }

    /// `prepared` with the GPUs topod chooses for it, when its request says `gpus=` and the
    /// batch system named none (`None`: nothing to choose; the job is allocated as it is). A
    /// job the batch system gave GPUs is checked: as many as `gpus=` asks for its tasks. A job
    /// allocated already keeps what it has (the allocate answers it again). No free GPUs near
    /// which its CPUs fit: it does not fit, saying how many GPUs are free; more GPUs than the
    /// host has: it never fits.
    pub(super) fn choose_gpus(
        &self,
        job: &str,
        prepared: &Prepared,
        owner_uid: Option<u32>,
    ) -> Result<Option<Prepared>, HostError> {
        let request = &prepared.request;
        let Some(per_task) = gpus_to_choose(prepared)? else { return Ok(None) };
        if let Some(existing) = self.ledger.get(job) {
            let has_gpus = self.hints.get(job).is_some_and(|h| !h.ask.gpus.is_empty());
            if has_gpus || !existing.request.is_empty() {
                self.warn_if_counted_elsewhere(job, &prepared.gpus_by_numa);
                return Ok(None);
            }
            // Found in its cgroup without a record (topod died before writing it, or it was
            // lost): its GPUs were never written down. Chosen now, beside its CPUs, as the
            // batch system asks again.
            let mut occupancy = self.ledger.occupancy_for(None);
            occupancy.held = occupancy.held.difference(&existing.cpus);
            // As the batch system counted them by node, where it did and they are free.
            if let Ok(Counted::Taken(given)) = self.take_as_counted(job, &prepared.gpus_by_numa) {
                if !given.is_empty() {
                    tracing::warn!(
                        "job {job}: found without its record; topod took GPU(s) {} for its gpus={per_task} now, as the batch system counted them",
                        given.join(", ")
                    );
                    let mut chosen = prepared.clone();
                    chosen.ask.gpus = given;
                    chosen.gpus_by_numa = Vec::new();
                    return Ok(Some(chosen));
                }
            }
            // Its CPUs are where they are: GPUs beside them where free, else any free ones.
            let mut inside =
                topo_core::gpus::within(request, &existing.cpus).unwrap_or_else(|| request.clone());
            inside.gpubind = Some(GpuBind::Any);
            let pick = pick_gpus(
                &self.topo,
                &self.model,
                &occupancy,
                &self.gpus_kept_from(job),
                &inside,
                self.strategy,
                job,
            )?;
            tracing::warn!(
                "job {job}: found without its record; topod chose GPU(s) {} for its gpus={per_task} now",
                pick.gpus.join(", ")
            );
            let mut chosen = prepared.clone();
            chosen.ask.gpus = pick.gpus;
            return Ok(Some(chosen));
        }
        if !prepared.gpus_by_numa.is_empty() {
            if let Some(chosen) = self.gpus_as_counted(job, prepared, per_task)? {
                return Ok(Some(chosen));
            }
        }
        let who = topo_core::prime::Asker {
            queue: prepared.ask.queue.as_deref(),
            owner: owner_uid,
            pool: prepared.ask.pool.as_deref(),
        };
        let (occupancy, _) = self.placement_occupancy_as(job, None, who, self.ends_by(prepared));
        let occupancy = self.without_lending(&occupancy).unwrap_or(occupancy);
        let mut kept = self.gpus_kept_from(job);
        // A job whose reservation holds GPUs takes those when enough of them are free and its
        // CPUs fit beside them (its block lies there); else free GPUs no reservation holds, as
        // any job (not a mix: the LSF module's choice, from the free map, is the same).
        let own = self.reserved_gpus(job).unwrap_or_default();
        let topo = &self.topo;
        let own_pick = if own.is_empty() {
            None
        } else {
            // Every GPU but its own free ones is kept from this pick.
            let others: std::collections::BTreeSet<String> = topo_core::gpus::gpu_indices(topo)
                .into_iter()
                .map(|g| topo.devices[g].pci_address.clone())
                .filter(|a| !own.contains(a) || kept.contains(a))
                .collect();
            pick_gpus(topo, &self.model, &occupancy, &others, request, self.strategy, job).ok()
        };
        let pick = match own_pick {
            Some(pick) => pick,
            None => {
                kept.extend(own.iter().cloned());
                pick_gpus(topo, &self.model, &occupancy, &kept, request, self.strategy, job)
                    .map_err(|e| self.naming_gpu_reservations(e, job, &occupancy, request))?
            }
        };
        let mut chosen = prepared.clone();
        chosen.ask.gpus = pick.gpus;
        chosen.near_only = pick.near.is_some() && request.gpubind != Some(GpuBind::Any);
        chosen.near_gpus = pick.near;
        chosen.gpu_nodes = pick.nodes;
        tracing::info!(
            "job {job}: topod chose GPU(s) {} for gpus={per_task} (CPUs near them: {})",
            chosen.ask.gpus.join(", "),
            chosen.near_gpus.as_ref().map_or_else(|| "anywhere".to_string(), CpuSet::to_string)
        );
        Ok(Some(chosen))
    }

    /// `prepared` given GPUs in each NUMA node as the batch system counted them
    /// (`gpus_by_numa`, PBS's per-NUMA vnodes), so that the batch system's count of free GPUs
    /// in each node stays topod's ([`Host::take_as_counted`]). The job is then placed as one
    /// whose GPUs the batch system named ([`Prepared::with_gpus`]): its CPUs beside them where
    /// they fit among those it may use (the batch system chose where its CPUs are too, and may
    /// have taken GPUs of another node), or refused where its `gpubind=` keeps its CPUs away
    /// from them. `Ok(None)` when the counts are not this host's GPUs by node (an
    /// administrator's count on a vnode over GPUs whose node the kernel does not know): topod
    /// chooses as without them (logged once a start).
    fn gpus_as_counted(
        &self,
        job: &str,
        prepared: &Prepared,
        per_task: u32,
    ) -> Result<Option<Prepared>, HostError> {
        let counted: Vec<String> =
            prepared.gpus_by_numa.iter().map(|(n, c)| format!("{c} in node {n}")).collect();
        let given = match self.take_as_counted(job, &prepared.gpus_by_numa)? {
            Counted::Taken(given) => given,
            Counted::NotThisHost(why) => {
                if self.counts_not_followed.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::debug!(
                        "job {job}: GPUs counted {} not followed: {why}",
                        counted.join(", ")
                    );
                    return Ok(None);
                }
                tracing::warn!(
                    "job {job}: the batch system counted its GPUs by NUMA node ({}), but {why}: topod chooses them as without those counts (the batch system's count of free GPUs per node may then differ from topod's; said once until topod restarts, then at debug level)",
                    counted.join(", ")
                );
                return Ok(None);
            }
        };
        // A gpubind= the GPUs counted cannot meet (the batch system split the job's chunk: its
        // CPUs in one node, its GPUs counted in another) is the job's rule against the batch
        // system's choice: refused, saying so. Choosing GPUs beside its CPUs instead would take
        // GPUs the batch system counts as free in their node.
        let mut chosen = match prepared.clone().with_gpus(&self.topo, &given) {
            Ok(chosen) => chosen,
            Err(HostError::BadRequest(why)) => {
                return Err(HostError::BadRequest(format!(
                    "{why}: the batch system counted the job's GPUs as {} (gpus_by_numa) and gave it CPUs away from them (it split the job's chunk over NUMA nodes); without gpubind= it would run on those CPUs with those GPUs",
                    counted.join(", ")
                )));
            }
            Err(e) => return Err(e),
        };
        chosen.gpus_by_numa = Vec::new();
        tracing::info!(
            "job {job}: topod chose GPU(s) {} for gpus={per_task}, as the batch system counted them ({}; CPUs near them: {})",
            chosen.ask.gpus.join(", "),
            counted.join(", "),
            chosen.near_gpus.as_ref().map_or_else(|| "where they fit".to_string(), CpuSet::to_string)
        );
        Ok(Some(chosen))
    }

    /// A job allocated again keeps its GPUs (the allocate answers it again); where the batch
    /// system now counts them in other NUMA nodes than they are, that is worth a line.
    fn warn_if_counted_elsewhere(&self, job: &str, counts: &[(u32, u32)]) {
        if counts.is_empty() {
            return;
        }
        let topo = &self.topo;
        let held = self.hints.get(job).map(|h| h.ask.gpus.clone()).unwrap_or_default();
        if held.is_empty() {
            return;
        }
        let nodes: Vec<(String, Option<u32>)> = topo_core::gpus::gpu_indices(topo)
            .into_iter()
            .map(|g| {
                let node = topo_core::gpus::counted_node(topo, &GpuSite::of(topo, g));
                (topo.devices[g].pci_address.clone(), node)
            })
            .collect();
        // Counts topod does not follow here (not this host's GPUs by node) were not followed
        // at its first allocate either: nothing new to say.
        let in_node = |node: u32| nodes.iter().filter(|(_, n)| *n == Some(node)).count();
        if counts.iter().any(|&(node, count)| in_node(node) < count as usize) {
            return;
        }
        let mut has: std::collections::BTreeMap<u32, u32> = std::collections::BTreeMap::new();
        for address in &held {
            if let Some((_, Some(node))) = nodes.iter().find(|(a, _)| a == address) {
                *has.entry(*node).or_default() += 1;
            }
        }
        let asked: std::collections::BTreeMap<u32, u32> = counts.iter().copied().collect();
        if has != asked {
            let say = |v: &std::collections::BTreeMap<u32, u32>| {
                v.iter().map(|(n, c)| format!("{c} in node {n}")).collect::<Vec<_>>().join(", ")
            };
            tracing::warn!(
                "job {job}: allocated again with its GPUs counted as {}; it keeps those it has ({}: {})",
                say(&asked),
                held.join(", "),
                say(&has)
            );
        }
    }

    /// The PCI addresses of `counts` free GPUs in each NUMA node (node id, count), each
    /// node's taken from its GPUs no job holds and no other job's reservation holds, as
    /// [`topo_core::gpus::take`] takes them from one domain. A GPU is in the node
    /// [`topo_core::gpus::counted_node`] says (as the PBS hook counts each vnode's GPUs from
    /// the free map). [`Counted::NotThisHost`] when a node has fewer GPUs than counted at all; too few
    /// free: it does not fit, naming the node (and the reservations, where only they keep it
    /// out).
    fn take_as_counted(&self, job: &str, counts: &[(u32, u32)]) -> Result<Counted, HostError> {
        let topo = &self.topo;
        let kept = self.gpus_kept_from(job);
        let held = self.held_gpus();
        let all = topo_core::gpus::gpu_indices(topo);
        let sites: Vec<GpuSite> = all.iter().map(|&g| GpuSite::of(topo, g)).collect();
        let address = |i: usize| topo.devices[all[i]].pci_address.clone();
        let mut given: Vec<String> = Vec::new();
        let nodes: Vec<Option<u32>> =
            sites.iter().map(|site| topo_core::gpus::counted_node(topo, site)).collect();
        for &(node, count) in counts {
            let in_node: Vec<usize> = (0..all.len()).filter(|&i| nodes[i] == Some(node)).collect();
            if in_node.len() < count as usize {
                return Ok(Counted::NotThisHost(format!(
                    "NUMA node {node} has {} GPU(s) for jobs here (a GPU whose node the kernel does not know is in none; one in a node without CPUs is in the node whose CPUs are nearest)",
                    in_node.len()
                )));
            }
            let free: Vec<usize> =
                in_node.iter().copied().filter(|&i| !kept.contains(&address(i))).collect();
            let Some(picked) = topo_core::gpus::take(&sites, &free, count as usize) else {
                let names: Vec<String> = free.iter().map(|&i| address(i)).collect();
                let unheld = in_node.iter().filter(|&&i| !held.contains(&address(i))).count();
                let now = self.now_s();
                // Only reservations whose GPUs in this node no job holds keep them out.
                let holding = self.reservations.others_live(job, now).filter(|r| {
                    r.gpus
                        .iter()
                        .any(|g| !held.contains(g) && in_node.iter().any(|&i| address(i) == *g))
                });
                let held_back = if unheld >= count as usize {
                    would_fit_without(holding, now)
                } else {
                    String::new()
                };
                return Err(HostError::DoesNotFit {
                    job: job.to_string(),
                    source: PlaceError::NotEnoughFree {
                        needed: count as usize,
                        free: free.len(),
                        unit: "GPU",
                        detail: format!(
                            " in NUMA node {node}, where the batch system counted them (gpus_by_numa; the node has {} GPU(s){})",
                            in_node.len(),
                            if names.is_empty() {
                                String::new()
                            } else {
                                format!(", free: {}", names.join(", "))
                            }
                        ),
                    },
                    held_back,
                });
            };
            given.extend(picked.into_iter().map(address));
        }
        Ok(Counted::Taken(given))
    }

    /// `refused` (a job's GPUs not found) with `; it would fit without job J's reservation
    /// (GPU(s) ...)` when the GPUs other jobs' reservations hold are what keeps it out, as a
    /// refusal names the blocks that keep CPUs out: the free GPUs a batch system counts are
    /// not all free to the job, and an administrator sees why.
    fn naming_gpu_reservations(
        &self,
        refused: HostError,
        job: &str,
        occupancy: &place::Occupancy,
        request: &Request,
    ) -> HostError {
        let HostError::DoesNotFit { job: who, source, held_back } = refused else {
            return refused;
        };
        let now = self.now_s();
        let holding: Vec<_> =
            self.reservations.others_live(job, now).filter(|r| !r.gpus.is_empty()).collect();
        let mut held_back = held_back;
        if held_back.is_empty()
            && !holding.is_empty()
            && pick_gpus(
                &self.topo,
                &self.model,
                occupancy,
                &self.held_gpus(),
                request,
                self.strategy,
                job,
            )
            .is_ok()
        {
            held_back = would_fit_without(holding.iter().copied(), now);
        }
        HostError::DoesNotFit { job: who, source, held_back }
    }
}

/// How many GPUs per task topod is to choose for `prepared`: `None` when its request has no
/// `gpus=`, or the batch system gave it GPUs (checked: as many as `gpus=` asks for its tasks).
/// `gpus=` with a task range is refused (GPUs do not resize with a job).
pub(super) fn gpus_to_choose(prepared: &Prepared) -> Result<Option<u32>, HostError> {
    let request = &prepared.request;
    let Some(per_task) = request.gpus_per_task else { return Ok(None) };
    let tasks = request.tasks.unwrap_or(1);
    if request.is_malleable() {
        return Err(HostError::BadRequest(format!(
            "gpus={per_task} with a task range (*{tasks}-{}): a job's GPUs do not grow or shrink with it; give a task count",
            request.tasks_max.unwrap_or(tasks)
        )));
    }
    let wanted = u64::from(per_task) * u64::from(tasks);
    if prepared.ask.gpus.is_empty() {
        return Ok(Some(per_task));
    }
    if prepared.ask.gpus.len() as u64 != wanted {
        return Err(HostError::BadRequest(format!(
            "the batch system gave the job {} GPU(s) ({}), but its request asks for gpus={per_task} per task for {tasks} task(s): {wanted}",
            prepared.ask.gpus.len(),
            prepared.ask.gpus.join(", ")
        )));
    }
    Ok(None)
}

/// `; it would fit without job R's reservation (GPU(s) ..., for N s more) and ...` naming
/// `holding`, the reservations whose GPUs keep a job out; empty when there are none.
fn would_fit_without<'a>(
    holding: impl Iterator<Item = &'a topo_core::reservation::Reservation>,
    now: i64,
) -> String {
    let named: Vec<String> = holding
        .map(|r| {
            format!(
                "job {}'s reservation (GPU(s) {}, for {} s more)",
                r.job,
                r.gpus.join(", "),
                (r.expires_at - now).max(0)
            )
        })
        .collect();
    if named.is_empty() {
        String::new()
    } else {
        format!("; it would fit without {}", named.join(" and "))
    }
}

/// GPUs taken as a batch system counted them by NUMA node ([`Host::take_as_counted`]).
enum Counted {
    /// Their PCI addresses.
    Taken(Vec<String>),
    /// The counts are not this host's GPUs by node: why.
    NotThisHost(String),
}

/// GPUs [`pick_gpus`] chose.
#[derive(Debug, Clone)]
pub(super) struct GpuChoice {
    /// Their PCI addresses.
    pub gpus: Vec<String>,
    /// The CPUs near them (of their NUMA nodes; `gpubind=socket`: packages) that the job may
    /// use; `None` when one is of unknown place.
    pub near: Option<CpuSet>,
    /// Them by NUMA node, when they lie in several ([`Prepared::gpu_nodes`]).
    pub nodes: Vec<(CpuSet, usize)>,
}

/// The `gpus=` of `request` (a rigid one: checked by the caller) for its tasks, chosen among
/// the host's GPUs not in `held` with its CPUs beside them in `occupancy`
/// ([`topo_core::gpus::choose`]). Refused as not fitting when too few are free or its CPUs
/// fit beside none; as never fitting when the host has too few.
pub(super) fn pick_gpus(
    topo: &Topology,
    model: &HostModel,
    occupancy: &place::Occupancy,
    held: &std::collections::BTreeSet<String>,
    request: &Request,
    strategy: Strategy,
    job: &str,
) -> Result<GpuChoice, HostError> {
    let per_task = request.gpus_per_task.unwrap_or(1);
    let tasks = request.tasks.unwrap_or(1);
    let wanted = request.gpus_wanted().unwrap_or(0);
    let all = topo_core::gpus::gpu_indices(topo);
    let does_not_fit = |source: PlaceError, held_back: String| HostError::DoesNotFit {
        job: job.to_string(),
        source,
        held_back,
    };
    if wanted > all.len() {
        return Err(does_not_fit(
            PlaceError::Impossible(format!(
                "gpus={per_task} for {tasks} task(s) needs {wanted} GPU(s); this host has {}",
                all.len()
            )),
            String::new(),
        ));
    }
    let free: Vec<usize> =
        all.iter().copied().filter(|&g| !held.contains(&topo.devices[g].pci_address)).collect();
    // gpubind=any: near its GPUs when it fits there, else anywhere (the GPUs as choose would
    // order them: one switch first).
    let pick = topo_core::gpus::choose(topo, model, occupancy, &free, request, wanted, strategy)
        .or_else(|| {
            if request.gpubind != Some(GpuBind::Any) || free.len() < wanted {
                return None;
            }
            let placement = place::place(model, occupancy, request, strategy).ok()?;
            Some(topo_core::gpus::GpuPick { gpus: free[..wanted].to_vec(), placement })
        });
    let Some(pick) = pick else {
        let names: Vec<&str> = free.iter().map(|&g| topo.devices[g].pci_address.as_str()).collect();
        let source = if free.len() < wanted {
            PlaceError::NotEnoughFree {
                needed: wanted,
                free: free.len(),
                unit: "GPU",
                detail: format!(
                    " (gpus={per_task} for {tasks} task(s), of the host's {}{})",
                    all.len(),
                    if names.is_empty() {
                        String::new()
                    } else {
                        format!("; free: {}", names.join(", "))
                    }
                ),
            }
        } else {
            PlaceError::Shape {
                needed: wanted,
                unit: "GPU",
                why: format!(
                    "gpus={per_task}: its CPUs do not fit beside any {wanted} of the free GPUs ({}) now",
                    names.join(", ")
                ),
            }
        };
        return Err(does_not_fit(source, String::new()));
    };
    // Near: the NUMA nodes (gpubind=socket: the packages) of the chosen GPUs, unless one is of
    // unknown place (then nothing is nearer than anything else).
    let level = if request.gpubind == Some(GpuBind::Socket) { Level::Socket } else { Level::Numa };
    let mut near = Some(CpuSet::new());
    for &g in &pick.gpus {
        match (topo.cpus_near(&topo.devices[g], level), near.as_mut()) {
            (Some(cpus), Some(n)) => n.union_with(&cpus),
            _ => near = None,
        }
    }
    Ok(GpuChoice {
        gpus: pick.gpus.iter().map(|&g| topo.devices[g].pci_address.clone()).collect(),
        near: near.map(|n| n.intersection(request.cpu_list.as_ref().unwrap_or(&topo.allowed))),
        nodes: if request.gpubind == Some(GpuBind::Any) {
            Vec::new()
        } else {
            topo_core::gpus::nodes_of_devices(topo, pick.gpus.iter().map(|&g| &topo.devices[g]))
        },
    })
}
