//! Baselines, written from their published descriptions (see `shared/reference/placement.md`):
//! what kubelet's CPU manager and Slurm's block distribution would choose. Both take whole
//! cores when the request asks for cores or exclusivity, keep each task inside one domain when
//! the request says `same=` (as Topology Manager alignment and Slurm task binding can), and
//! ignore `MAX_RADIUS` and `MAX_CPU_PER_NODE`, which they cannot express.

use super::engine::JobShape;
use super::model::HostModel;
use super::{domain_name, unit_name, PlaceError};
use crate::cpuset::CpuSet;
use crate::request::Level;

/// CPUs the baseline needs per task and may use: `(need, pool)`, whole free cores only when the
/// request asks for cores or exclusivity (kubelet's `full-pcpus-only`, Slurm's core allocation).
fn need_and_pool(model: &HostModel, job: &JobShape) -> Result<(usize, CpuSet), PlaceError> {
    let need = job.units_per_task * model.pus_per_unit(job.unit);
    let whole_cores = job.unit != Level::Thread || job.exclusive.is_some();
    let pool = if whole_cores {
        CpuSet::union_all(model.cores.iter().filter(|c| c.is_subset(&job.avail)))
    } else {
        job.avail.clone()
    };
    if pool.len() < need * job.tasks {
        return Err(PlaceError::NotEnoughFree {
            needed: need * job.tasks,
            free: pool.len(),
            unit: unit_name(Level::Thread),
            detail: String::new(),
        });
    }
    Ok((need, pool))
}

/// How a baseline picks the one domain for a task that must stay inside one (`same=`): kubelet's
/// Topology Manager prefers the narrowest hint, then the lowest NUMA id (the first domain that
/// fits); Slurm's block distribution the fullest domain that still fits.
#[derive(Clone, Copy)]
enum DomainChoice {
    FirstThatFits,
    FullestThatFits,
}

/// Runs a baseline: the whole job at once, or, when each task must stay inside one domain of a
/// level, task by task inside the domain the batch system's own rule picks. The baselines honour
/// `same=` that way (kubelet aligns each container to a NUMA node or socket, Slurm binds tasks in
/// blocks); `MAX_RADIUS` and `MAX_CPU_PER_NODE` they cannot express.
fn run(
    model: &HostModel,
    job: &JobShape,
    choice: DomainChoice,
    take: fn(&HostModel, &CpuSet, usize) -> CpuSet,
) -> Result<Vec<CpuSet>, PlaceError> {
    let (per_task, mut pool) = need_and_pool(model, job)?;
    let Some(level) = job.same else {
        let all = take(model, &pool, per_task * job.tasks);
        return Ok(into_tasks(job, &all));
    };
    let mut tasks = Vec::with_capacity(job.tasks);
    for _ in 0..job.tasks {
        let fits = model.domains(level).iter().filter(|d| d.intersection_len(&pool) >= per_task);
        let dom = match choice {
            DomainChoice::FirstThatFits => fits.min_by_key(|d| d.first()),
            DomainChoice::FullestThatFits => {
                fits.min_by_key(|d| (d.intersection_len(&pool), d.first()))
            }
        };
        let Some(dom) = dom else {
            return Err(PlaceError::Shape {
                needed: job.units_needed(),
                unit: unit_name(job.unit),
                why: format!(
                    "no {} has {per_task} free CPUs for the next task",
                    domain_name(level)
                ),
            });
        };
        let t = take(model, &dom.intersection(&pool), per_task);
        pool.difference_with(&t);
        tasks.push(t);
    }
    Ok(tasks)
}

/// Cuts the chosen CPUs into the job's tasks, in order.
fn into_tasks(job: &JobShape, cpus: &CpuSet) -> Vec<CpuSet> {
    let per = (cpus.len() / job.tasks).max(1);
    let ids: Vec<u32> = cpus.iter().collect();
    let mut tasks: Vec<CpuSet> = ids.chunks(per).map(|c| c.iter().copied().collect()).collect();
    while tasks.len() > job.tasks {
        if let Some(extra) = tasks.pop() {
            if let Some(last) = tasks.last_mut() {
                last.union_with(&extra);
            }
        }
    }
    tasks
}

/// Kubernetes CPU manager, static policy, `takeByTopologyNUMAPacked`: whole free NUMA nodes or
/// sockets (the larger level first), then whole free cores, then single threads; every list
/// ordered by the free CPUs of the enclosing domain, fewest first, then by id.
pub fn k8s_static(model: &HostModel, job: &JobShape) -> Result<Vec<CpuSet>, PlaceError> {
    run(model, job, DomainChoice::FirstThatFits, k8s_take)
}

fn k8s_take(model: &HostModel, pool: &CpuSet, need: usize) -> CpuSet {
    let mut pool = pool.clone();
    let mut taken = CpuSet::new();
    let numa_first = model.sockets.len() >= model.numa.len();
    let levels =
        if numa_first { [&model.numa, &model.sockets] } else { [&model.sockets, &model.numa] };
    for level in levels {
        for dom in level.iter() {
            let left = need - taken.len();
            if dom.is_subset(&pool) && dom.len() <= left {
                take(&mut taken, &mut pool, dom);
            }
        }
    }
    let socket_free = |pool: &CpuSet, cpu: u32| {
        model.domain_of(Level::Socket, cpu).map_or(0, |s| model.sockets[s].intersection_len(pool))
    };
    let numa_free = |pool: &CpuSet, cpu: u32| {
        model.domain_of(Level::Numa, cpu).map_or(0, |s| model.numa[s].intersection_len(pool))
    };
    // takeFullCores
    if need - taken.len() >= model.threads_per_core {
        let mut cores: Vec<&CpuSet> = model.cores.iter().filter(|c| c.is_subset(&pool)).collect();
        cores.sort_by_key(|c| {
            let f = c.first().unwrap_or(0);
            (socket_free(&pool, f), numa_free(&pool, f), f)
        });
        for core in cores {
            if need - taken.len() >= core.len() {
                take(&mut taken, &mut pool, core);
            }
        }
    }
    // takeRemainingCPUs
    let mut cpus: Vec<u32> = pool.iter().collect();
    cpus.sort_by_key(|&c| {
        let core_free =
            model.domain_of(Level::Core, c).map_or(0, |i| model.cores[i].intersection_len(&pool));
        (socket_free(&pool, c), numa_free(&pool, c), core_free, c)
    });
    for c in cpus {
        if taken.len() >= need {
            break;
        }
        taken.insert(c);
    }
    taken
}

fn take(taken: &mut CpuSet, pool: &mut CpuSet, dom: &CpuSet) {
    taken.union_with(dom);
    pool.difference_with(dom);
}

/// Slurm `select/cons_tres` block distribution: the fewest sockets; the socket with the fewest
/// free CPUs that still holds the rest, else the one with the most; inside a socket, cores in
/// order, all free threads of each core.
pub fn slurm_block(model: &HostModel, job: &JobShape) -> Result<Vec<CpuSet>, PlaceError> {
    run(model, job, DomainChoice::FullestThatFits, slurm_take)
}

fn slurm_take(model: &HostModel, pool: &CpuSet, need: usize) -> CpuSet {
    let mut taken = CpuSet::new();
    let mut sockets: Vec<(usize, usize)> =
        model.sockets.iter().enumerate().map(|(i, s)| (i, s.intersection_len(pool))).collect();
    while taken.len() < need {
        let left = need - taken.len();
        let pick = sockets
            .iter()
            .filter(|(_, f)| *f >= left)
            .min_by_key(|(i, f)| (*f, *i))
            .or_else(|| {
                sockets
                    .iter()
                    .filter(|(_, f)| *f > 0)
                    .max_by_key(|(i, f)| (*f, std::cmp::Reverse(*i)))
            })
            .copied();
        let Some((s, _)) = pick else { break };
        let free_here = model.sockets[s].intersection(pool);
        for core in model.cores.iter().filter(|c| c.intersects(&free_here)) {
            for cpu in core.intersection(&free_here).iter() {
                if taken.len() < need {
                    taken.insert(cpu);
                }
            }
        }
        sockets.retain(|(i, _)| *i != s);
    }
    taken
}
