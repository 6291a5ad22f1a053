//! The shape-aware placement engine behind best-fit, pack, balance and buddy, and first-fit.
//!
//! A job is `tasks` tasks of `units_per_task` units. The engine counts, for every node of the
//! placement tree, how many units are available under it and (with `same=level`) how many whole
//! tasks fit under it; then it walks down from the machine, at each node asking the strategy how
//! to split the remaining need among the children. Inside a node that lies in one `same=` domain
//! it switches from counting tasks to counting units. At a leaf (a core) it takes CPUs.
//!
//! A node whose children are cores of one size, each holding at most one of the job's units
//! (a NUMA node of a flat host of thousands of cores), leaves no choice to weigh: pack and
//! balance take its lowest-numbered cores that have a unit, and so does best-fit inside one
//! NUMA node; the walk takes them without sorting or searching the children (a property test
//! holds it to the general walk).

use super::model::{level_slot, HostModel};
use super::{domain_name, unit_name, Occupancy, PlaceError, Strategy, DEFAULT_TASKS};
use crate::cpuset::CpuSet;
use crate::request::{Distribute, Level, Request};

/// A request resolved against one host: what is available and what is needed.
#[derive(Debug, Clone)]
pub struct JobShape {
    /// CPUs the job may take (free, inside CPU_LIST, wholly free domains when exclusive).
    pub avail: CpuSet,
    /// One CPU per available unit: the unit's first CPU (for threads, `avail` itself).
    pub unit_reps: CpuSet,
    /// The unit level.
    pub unit: Level,
    /// Units per task.
    pub units_per_task: usize,
    /// Tasks.
    pub tasks: usize,
    /// `same=` level.
    pub same: Option<Level>,
    /// The level held exclusively against other jobs, if any.
    pub exclusive: Option<Level>,
    /// `exclusive=(level,injob)`: no two tasks of the job in one domain of this level.
    pub task_spread: Option<Level>,
    /// `exclusive=(level,intask)`: no two units of the job in one domain of this level.
    pub unit_spread: Option<Level>,
    /// At most this many units from one NUMA node.
    pub numa_cap_units: Option<usize>,
    /// `MAX_RADIUS` in hops.
    pub max_hops: Option<u32>,
    /// `distribute=pack(level=n)`.
    pub pack_limit: Option<(Level, u32)>,
    /// Whether `CPU_LIST` narrowed what is available.
    pub inside_cpu_list: bool,
}

impl JobShape {
    /// Resolves `request` on `model` under `occupancy`.
    pub fn new(
        model: &HostModel,
        occupancy: &Occupancy,
        request: &Request,
    ) -> Result<Self, PlaceError> {
        let mut free = occupancy.free(model);
        if let Some(list) = &request.cpu_list {
            // CPUs the host does not have at all are a mistake in the request, not a lack of
            // free CPUs: say so (every front end places through here).
            let host = model.allocatable.union(&model.excluded);
            let missing = list.difference(&host);
            if !missing.is_empty() {
                return Err(PlaceError::Impossible(format!(
                    "CPU_LIST names CPUs {missing}, which this host does not have (its CPUs are \
                     {host})"
                )));
            }
            free.intersect_with(list);
        }
        let exclusive = request.exclusive_level();
        let avail = match exclusive {
            Some(level) if level != Level::Thread => wholly_within(model.domains(level), &free),
            _ => free,
        };
        let unit = request.unit;
        let unit_reps = model.whole_domain_firsts(unit, &avail);
        let pus_per_unit = model.pus_per_unit(unit);
        let numa_cap_units = request.max_cpu_per_node.map(|c| c as usize / pus_per_unit);
        let max_hops = request.max_radius;
        let pack_limit = match request.distribute {
            Distribute::Pack(limit) => limit,
            _ => None,
        };
        let job = JobShape {
            avail,
            unit_reps,
            unit,
            units_per_task: request.units_per_task.max(1) as usize,
            tasks: request.tasks.unwrap_or(DEFAULT_TASKS).max(1) as usize,
            same: request.same.filter(|s| *s > unit),
            exclusive,
            task_spread: request.task_spread_level().filter(|l| *l > unit),
            unit_spread: request.unit_spread_level().filter(|l| *l > unit),
            numa_cap_units,
            max_hops,
            pack_limit,
            inside_cpu_list: request.cpu_list.is_some(),
        };
        job.check_possible(model)?;
        Ok(job)
    }

    /// Units the whole job needs.
    pub fn units_needed(&self) -> usize {
        self.tasks * self.units_per_task
    }

    fn check_possible(&self, model: &HostModel) -> Result<(), PlaceError> {
        let total_units = match self.unit {
            Level::Thread => model.allocatable.len(),
            u => model.domains(u).len(),
        };
        let need = self.units_needed();
        if need > total_units {
            return Err(PlaceError::Impossible(format!(
                "asks for {need} {}(s), the host has {total_units}",
                unit_name(self.unit)
            )));
        }
        if let Some(same) = self.same {
            let per_unit = model.pus_per_unit(self.unit);
            let largest = model.domains(same).iter().map(|d| d.len() / per_unit).max().unwrap_or(0);
            if self.units_per_task > largest {
                return Err(PlaceError::Impossible(format!(
                    "each task asks for {} {}(s) in one {}, the largest {} has {largest}",
                    self.units_per_task,
                    unit_name(self.unit),
                    domain_name(same),
                    domain_name(same)
                )));
            }
        }
        if let Some(0) = self.numa_cap_units {
            return Err(PlaceError::Impossible("MAX_CPU_PER_NODE is smaller than one unit".into()));
        }
        let free_units = self.unit_reps.len();
        if free_units < need {
            let mut detail = String::new();
            if self.inside_cpu_list {
                detail += " inside CPU_LIST";
            }
            if let Some(level) = self.exclusive {
                detail += &format!(" (exclusive: only wholly free {}s count)", domain_name(level));
            }
            return Err(PlaceError::NotEnoughFree {
                needed: need,
                free: free_units,
                unit: unit_name(self.unit),
                detail,
            });
        }
        Ok(())
    }

    /// The CPUs of the units whose first CPUs are `reps`.
    fn units_cpus(&self, model: &HostModel, reps: &[u32]) -> CpuSet {
        let mut out = CpuSet::new();
        for &rep in reps {
            match self.unit {
                Level::Thread => out.insert(rep),
                u => {
                    if let Some(i) = model.domain_of(u, rep) {
                        out.union_with(&model.domains(u)[i]);
                    }
                }
            }
        }
        out
    }
}

/// The union of the domains wholly inside `pool`.
fn wholly_within(domains: &[CpuSet], pool: &CpuSet) -> CpuSet {
    let mut out = CpuSet::new();
    for d in domains.iter().filter(|d| d.is_subset(pool)) {
        out.union_with(d);
    }
    out
}

/// Per-tree-node counts for one job: available units, and whole tasks.
struct Counts {
    units: Vec<usize>,
    slots: Vec<usize>,
}

impl JobShape {
    /// Whether the job is counted in whole tasks (each inside one `same=` domain, or no two in
    /// one `injob` domain) rather than in units.
    fn by_tasks(&self) -> bool {
        self.same.is_some() || self.task_spread.is_some()
    }

    /// Whether a tree node is where a task's units are picked: it lies inside one `same=` domain
    /// and one `injob` domain (or is a leaf).
    fn is_task_terminal(&self, node: &super::model::TreeNode) -> bool {
        let inside = |level: Option<Level>| {
            level.and_then(level_slot).is_none_or(|s| node.within[s].is_some())
        };
        node.children.is_empty() || (inside(self.same) && inside(self.task_spread))
    }

    /// Whether a tree node lies inside one domain of `level`.
    fn within(node: &super::model::TreeNode, level: Option<Level>) -> bool {
        level.and_then(level_slot).is_some_and(|s| node.within[s].is_some())
    }
}

fn count(model: &HostModel, job: &JobShape, reps: &CpuSet) -> Counts {
    let n = model.tree.len();
    let mut units = vec![0usize; n];
    // Leaves first, by visiting the available units only; then, since children always come
    // after their parent, the internal nodes bottom-up.
    for cpu in reps.iter() {
        if let Some(leaf) = model.leaf_of(cpu) {
            units[leaf] += 1;
        }
    }
    let cap_units = |node: &super::model::TreeNode, u: usize| -> usize {
        let mut u = u;
        if let (Some(cap), Some(_)) = (job.numa_cap_units, node.numa) {
            u = u.min(cap);
        }
        if JobShape::within(node, job.unit_spread) {
            u = u.min(1);
        }
        u
    };
    if job.numa_cap_units.is_some() || job.unit_spread.is_some() {
        for (id, node) in model.tree.iter().enumerate().filter(|(_, n)| n.children.is_empty()) {
            units[id] = cap_units(node, units[id]);
        }
    }
    for &id in model.internal_bottom_up() {
        let node = &model.tree[id];
        units[id] = cap_units(node, node.children.iter().map(|&c| units[c]).sum());
    }
    if !job.by_tasks() {
        return Counts { slots: units.clone(), units };
    }
    let cap_tasks = |node: &super::model::TreeNode, t: usize| {
        if JobShape::within(node, job.task_spread) {
            t.min(1)
        } else {
            t
        }
    };
    let mut slots = vec![0usize; n];
    for (id, node) in model.tree.iter().enumerate().filter(|(_, n)| n.children.is_empty()) {
        slots[id] = cap_tasks(node, units[id] / job.units_per_task);
    }
    for &id in model.internal_bottom_up() {
        let node = &model.tree[id];
        let t = if job.is_task_terminal(node) {
            units[id] / job.units_per_task
        } else {
            node.children.iter().map(|&c| slots[c]).sum()
        };
        slots[id] = cap_tasks(node, t);
    }
    Counts { units, slots }
}

/// Places a job with a shape-aware strategy; returns the CPUs of each task.
pub fn place_shaped(
    model: &HostModel,
    job: &JobShape,
    strategy: Strategy,
) -> Result<Vec<CpuSet>, PlaceError> {
    let tasks = place_once(model, job, &job.unit_reps, strategy)?;
    let cpus = CpuSet::union_all(&tasks);
    if within_limits(model, job, &cpus) {
        return Ok(tasks);
    }
    // The unconstrained choice breaks MAX_RADIUS or pack(level=n): retry inside each region that
    // satisfies the limit, and keep the best.
    let mut best: Option<(u64, Vec<CpuSet>)> = None;
    for region in limit_regions(model, job) {
        let reps = job.unit_reps.intersection(&region);
        if let Ok(t) = place_once(model, job, &reps, strategy) {
            let cpus = CpuSet::union_all(&t);
            if within_limits(model, job, &cpus) {
                let m = super::PlacementMetrics::measure(model, &Occupancy::default(), &cpus);
                let s = super::score(&m);
                if best.as_ref().is_none_or(|(b, _)| s < *b) {
                    best = Some((s, t));
                }
            }
        }
    }
    best.map(|(_, t)| t).ok_or_else(|| PlaceError::Shape {
        needed: job.units_needed(),
        unit: unit_name(job.unit),
        why: match (job.max_hops, job.pack_limit) {
            (Some(h), _) => format!("no set of NUMA nodes within MAX_RADIUS={h} hops has room"),
            (None, Some((l, n))) => format!("does not fit in {n} {}(s)", domain_name(l)),
            _ => "limits".into(),
        },
    })
}

fn within_limits(model: &HostModel, job: &JobShape, cpus: &CpuSet) -> bool {
    if let Some(h) = job.max_hops {
        let numa = model.touched(Level::Numa, cpus);
        if model.hops(model.radius(&numa)) > h {
            return false;
        }
    }
    if let Some((level, n)) = job.pack_limit {
        let k = if level == Level::Thread { cpus.len() } else { model.touched(level, cpus).len() };
        if k > n as usize {
            return false;
        }
    }
    true
}

/// Candidate regions (CPU sets) that satisfy the job's MAX_RADIUS / pack limit.
fn limit_regions(model: &HostModel, job: &JobShape) -> Vec<CpuSet> {
    let mut regions = Vec::new();
    if let Some(h) = job.max_hops {
        let n = model.numa.len();
        for centre in 0..n {
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by_key(|&o| (model.distance(centre, o), o));
            let mut chosen: Vec<usize> = Vec::new();
            for o in order {
                if chosen.iter().all(|&c| model.hops(model.distance(c, o)) <= h) {
                    chosen.push(o);
                }
            }
            regions.push(CpuSet::union_all(chosen.iter().map(|&i| &model.numa[i])));
        }
    } else if let Some((level, n)) = job.pack_limit {
        let doms = model.domains(level);
        for start in 0..doms.len() {
            // n consecutive domains starting at each one: neighbours by numbering are close.
            let region = CpuSet::union_all(
                (0..(n as usize).min(doms.len())).map(|k| &doms[(start + k) % doms.len()]),
            );
            regions.push(region);
        }
    }
    regions.sort();
    regions.dedup();
    regions
}

fn place_once(
    model: &HostModel,
    job: &JobShape,
    reps: &CpuSet,
    strategy: Strategy,
) -> Result<Vec<CpuSet>, PlaceError> {
    let mut taken: Vec<CpuSet> = Vec::with_capacity(job.tasks);
    if strategy == Strategy::Buddy {
        // Power-of-two blocks of tasks, largest first, each placed best-fit on what is left.
        let mut left = reps.clone();
        for block in power_of_two_blocks(job.tasks) {
            let sub = JobShape { tasks: block, ..job.clone() };
            let tasks = descend(model, &sub, &left, Strategy::BestFit)?;
            for t in &tasks {
                left.difference_with(t);
                // Later blocks must not share the spread domains of this one either.
                for level in [job.unit_spread, job.task_spread].into_iter().flatten() {
                    left.difference_with(&model.closure(level, t));
                }
            }
            taken.extend(tasks);
        }
        return Ok(taken);
    }
    descend(model, job, reps, strategy)
}

fn power_of_two_blocks(n: usize) -> Vec<usize> {
    (0..usize::BITS).rev().map(|b| 1usize << b).filter(|b| n & b != 0).collect()
}

fn descend(
    model: &HostModel,
    job: &JobShape,
    reps: &CpuSet,
    strategy: Strategy,
) -> Result<Vec<CpuSet>, PlaceError> {
    let counts = count(model, job, reps);
    let need_slots = if job.by_tasks() { job.tasks } else { job.units_needed() };
    if counts.slots[0] < need_slots {
        let free_units = reps.len();
        let mut why = format!(
            "no room for {} task(s) of {} {}(s)",
            job.tasks,
            job.units_per_task,
            unit_name(job.unit)
        );
        if let Some(s) = job.same {
            why += &format!(", each inside one {}", domain_name(s));
        }
        if let Some(t) = job.task_spread {
            why += &format!(", each task in a {} of its own (injob)", domain_name(t));
        }
        if let Some(u) = job.unit_spread {
            why += &format!(", each unit in a {} of its own (intask)", domain_name(u));
        }
        if job.numa_cap_units.is_some() {
            why += ", at most MAX_CPU_PER_NODE per NUMA node";
        }
        return Err(if free_units < job.units_needed() {
            PlaceError::NotEnoughFree {
                needed: job.units_needed(),
                free: free_units,
                unit: unit_name(job.unit),
                detail: String::new(),
            }
        } else {
            PlaceError::Shape { needed: job.units_needed(), unit: unit_name(job.unit), why }
        });
    }
    let mut out =
        Walk { model, job, reps, counts: &counts, strategy, tasks: Vec::with_capacity(job.tasks) };
    if job.by_tasks() {
        out.by_tasks(0, need_slots);
    } else {
        let units = out.by_units(0, need_slots);
        out.split_into_tasks(units);
    }
    if out.tasks.len() != job.tasks {
        // Counting and walking disagree: a bug, reported rather than hidden.
        return Err(PlaceError::Shape {
            needed: job.units_needed(),
            unit: unit_name(job.unit),
            why: format!("internal: placed {} of {} tasks", out.tasks.len(), job.tasks),
        });
    }
    Ok(out.tasks)
}

struct Walk<'a> {
    model: &'a HostModel,
    job: &'a JobShape,
    reps: &'a CpuSet,
    counts: &'a Counts,
    strategy: Strategy,
    tasks: Vec<CpuSet>,
}

impl Walk<'_> {
    /// Places `need` whole tasks under `node` (same= mode).
    fn by_tasks(&mut self, node: usize, need: usize) {
        self.tasks_under(node, need, true)
    }

    /// [`Self::by_tasks`]; `search` false where `node` is what the search below its parent
    /// chose: the smallest node that fits. Nothing strictly smaller below it fits; a child with
    /// all its CPUs (a package of one L3 group) has its count too, its siblings none, so the
    /// split hands it on whole, and it searches again.
    fn tasks_under(&mut self, node: usize, need: usize, search: bool) {
        if self.job.is_task_terminal(&self.model.tree[node]) {
            let units = self.by_units(node, need * self.job.units_per_task);
            self.split_into_tasks(units);
            return;
        }
        if search {
            if let Some(inner) = self.smallest_fitting_below(node, need, &self.counts.slots) {
                return self.tasks_under(inner, need, false);
            }
        }
        for (child, k) in self.split(node, need, &self.counts.slots) {
            self.tasks_under(child, k, true);
        }
    }

    /// Takes `need` units under `node`; returns their representative CPUs in placement order.
    fn by_units(&mut self, node: usize, need: usize) -> Vec<u32> {
        let mut out = Vec::with_capacity(need);
        self.collect_units(node, need, &mut out, true);
        out
    }

    /// Takes `need` units under `node` into `out`; `search` as in [`Self::tasks_under`].
    fn collect_units(&mut self, node: usize, need: usize, out: &mut Vec<u32>, search: bool) {
        let n = &self.model.tree[node];
        if need == self.counts.units[node]
            && self.job.numa_cap_units.is_none()
            && self.job.unit_spread.is_none()
        {
            // Everything under this node: no choice left to make.
            self.take_all(node, out);
            return;
        }
        if n.children.is_empty() {
            let before = out.len();
            out.extend(n.cpus.iter().filter(|&c| self.reps.contains(c)).take(need));
            debug_assert!(out.len() - before <= need);
            return;
        }
        if self.one_unit_per_child(node) && self.takes_lowest_children(node) {
            // What the search and the split below would choose, without sorting thousands of
            // children: the lowest-numbered that have a unit, one unit each.
            let mut left = need;
            for &child in &n.children {
                if left == 0 {
                    break;
                }
                if self.counts.units[child] > 0 {
                    let cpus = &self.model.tree[child].cpus;
                    out.extend(cpus.iter().filter(|&c| self.reps.contains(c)).take(1));
                    left -= 1;
                }
            }
            return;
        }
        if search {
            if let Some(inner) = self.smallest_fitting_below(node, need, &self.counts.units) {
                return self.collect_units(inner, need, out, false);
            }
        }
        for (child, k) in self.split(node, need, &self.counts.units) {
            self.collect_units(child, k, out, true);
        }
    }

    /// Whether every child of `node` is a core of one size holding at most one of the job's
    /// units (so at most one task): a core of one CPU, or a unit of a core or more.
    fn one_unit_per_child(&self, node: usize) -> bool {
        #[cfg(test)]
        if tests::NO_SHORTCUTS.get() {
            return false;
        }
        let n = &self.model.tree[node];
        n.uniform_leaves && (self.job.unit != Level::Thread || n.largest_child == 1)
    }

    /// Whether, among children that each hold one unit at most, the strategy takes the
    /// lowest-numbered that hold one: pack and balance take children in order (all counts
    /// equal), best-fit inside one NUMA node takes the fewest children, lowest first (across
    /// NUMA nodes it weighs their distances instead, see [`Self::best_fit_split`]).
    fn takes_lowest_children(&self, node: usize) -> bool {
        match self.strategy {
            Strategy::Pack | Strategy::Balance => true,
            _ => self.model.tree[node].numa.is_some(),
        }
    }

    /// Every available unit under `node`, core by core.
    fn take_all(&self, node: usize, out: &mut Vec<u32>) {
        let n = &self.model.tree[node];
        if n.children.is_empty() {
            out.extend(n.cpus.iter().filter(|&c| self.reps.contains(c)));
            return;
        }
        for &child in &n.children {
            if self.counts.units[child] > 0 {
                self.take_all(child, out);
            }
        }
    }

    /// Best-fit only: the smallest domain strictly below `node` that holds `need` on its own,
    /// the tightest (fewest free) among equally small ones. Searching the whole subtree rather
    /// than the children one level at a time keeps a greedy choice high in the tree (the
    /// emptier package) from hiding a tight hole lower down (a nearly full L3 group).
    fn smallest_fitting_below(&self, node: usize, need: usize, counts: &[usize]) -> Option<usize> {
        if !matches!(self.strategy, Strategy::BestFit | Strategy::Buddy) {
            return None;
        }
        let tree = &self.model.tree;
        let key = |id: usize| {
            // Equal candidates: the one whose parent is tightest, then the lowest. (Ordering by
            // the fullness of every ancestor instead, or by which candidate keeps the largest
            // free block of each level, was measured and is worse on most machines.)
            let parent_free = tree[id].parent.map_or(0, |p| counts[p]);
            (tree[id].size, counts[id], parent_free, id)
        };
        let mut best: Option<(usize, usize, usize, usize)> = None;
        let mut stack: smallvec::SmallVec<[usize; 64]> = smallvec::SmallVec::new();
        self.push_below(node, need, counts, &mut stack);
        while let Some(id) = stack.pop() {
            if counts[id] < need {
                continue;
            }
            let k = key(id);
            if best.is_none_or(|b| k < b) {
                best = Some(k);
            }
            self.push_below(id, need, counts, &mut stack);
        }
        best.map(|(_, _, _, id)| id)
    }

    /// Pushes the children of `id` that [`Self::smallest_fitting_below`] must look at. A node
    /// holds at most one unit (or task) per CPU: children all smaller than `need` are not looked
    /// at. Of a flat run of cores with a unit each at most, only a need of one fits in one, and
    /// the lowest-numbered with a unit is the best of them (same size, count and parent).
    fn push_below(
        &self,
        id: usize,
        need: usize,
        counts: &[usize],
        stack: &mut smallvec::SmallVec<[usize; 64]>,
    ) {
        let node = &self.model.tree[id];
        if node.largest_child < need {
            return;
        }
        if need > 0 && self.one_unit_per_child(id) {
            if need == 1 {
                stack.extend(node.children.iter().copied().find(|&c| counts[c] >= 1));
            }
            return;
        }
        stack.extend_from_slice(&node.children);
    }

    fn split_into_tasks(&mut self, reps: Vec<u32>) {
        for chunk in reps.chunks(self.job.units_per_task) {
            self.tasks.push(self.job.units_cpus(self.model, chunk));
        }
    }

    /// How to share `need` among the children of `node`, by the strategy.
    fn split(&self, node: usize, need: usize, counts: &[usize]) -> Vec<(usize, usize)> {
        let children: Vec<usize> =
            self.model.tree[node].children.iter().copied().filter(|&c| counts[c] > 0).collect();
        match self.strategy {
            Strategy::Pack => fill_in_order(children, counts, need, |c| (counts[c], c)),
            Strategy::Balance => balance(&children, counts, need),
            _ if self.model.tree[node].numa.is_some() => fewest_children(children, counts, need),
            _ => self.best_fit_split(&children, counts, need),
        }
    }

    fn best_fit_split(
        &self,
        children: &[usize],
        counts: &[usize],
        need: usize,
    ) -> Vec<(usize, usize)> {
        // One child holds it all: the tightest one.
        if let Some(&c) =
            children.iter().filter(|&&c| counts[c] >= need).min_by_key(|&&c| (counts[c], c))
        {
            return vec![(c, need)];
        }
        // Span: grow a set around each possible centre, nearest first (largest first among equally
        // near ones, so the set stays small); keep the set with the fewest members, then the
        // smallest radius, then the least left over.
        let numa_of = |c: usize| {
            self.model
                .domain_of(Level::Numa, self.model.tree[c].cpus.first().unwrap_or(0))
                .unwrap_or(0)
        };
        let mut best: Option<((usize, u32, usize), Vec<usize>)> = None;
        for &centre in children {
            let cn = numa_of(centre);
            let mut order: Vec<usize> = children.iter().copied().filter(|&c| c != centre).collect();
            order.sort_by_key(|&c| {
                (self.model.distance(cn, numa_of(c)), std::cmp::Reverse(counts[c]), c)
            });
            let mut set = vec![centre];
            let mut sum = counts[centre];
            for c in order {
                if sum >= need {
                    break;
                }
                set.push(c);
                sum += counts[c];
            }
            if sum < need {
                continue;
            }
            let numas: Vec<usize> = set.iter().map(|&c| numa_of(c)).collect();
            let key = (set.len(), self.model.radius(&numas), sum - need);
            if best.as_ref().is_none_or(|(k, _)| key < *k) {
                best = Some((key, set));
            }
        }
        let set = best.map(|(_, s)| s).unwrap_or_default();
        // Consume the fuller (fewer free) members whole, the remainder from the emptiest.
        fill_in_order(set, counts, need, |c| (counts[c], c))
    }
}

/// Inside one NUMA node every child is as near as any other: the fewest children that hold the
/// need are the ones with the most free, and of those the fuller are consumed whole first.
///
/// Of the sets of that many children that hold the need, it picks one with the least left over:
/// slot by slot, the smallest child (then the lowest) that still lets the largest remaining ones
/// cover the rest. Children are kept in runs by free count, so that a slot costs a pass over
/// the distinct counts, not over the children (a flat node of 4,096 cores has one count, 1).
fn fewest_children(children: Vec<usize>, counts: &[usize], need: usize) -> Vec<(usize, usize)> {
    // The children by count, then number: each count's children are one run of `by_count`,
    // and `runs` holds each run's count and what is left of it (start, end), counts ascending.
    let mut by_count: Vec<(usize, usize)> = children.iter().map(|&c| (counts[c], c)).collect();
    by_count.sort_unstable();
    let mut runs: Vec<(usize, usize, usize)> = Vec::new();
    for (i, &(v, _)) in by_count.iter().enumerate() {
        match runs.last_mut() {
            Some(run) if run.0 == v => run.2 = i + 1,
            _ => runs.push((v, i, i + 1)),
        }
    }
    // The sum of the `n` largest counts left.
    let largest = |runs: &[(usize, usize, usize)], mut n: usize| -> usize {
        let mut sum = 0;
        for &(v, start, end) in runs.iter().rev() {
            let take = n.min(end - start);
            sum += take * v;
            n -= take;
            if n == 0 {
                break;
            }
        }
        sum
    };
    let mut left_children = children.len();
    let mut k = 0;
    let mut sum = 0;
    for &(v, _) in by_count.iter().rev() {
        if sum >= need {
            break;
        }
        sum += v;
        k += 1;
    }
    let mut chosen = Vec::with_capacity(k);
    let mut left = need;
    for slot in 0..k {
        // In the order "most free first, then lowest", a child among the first `top` covers the
        // rest with the `top` largest others, which with itself are the first `top + 1`; a
        // child after them, with its own count and the first `top`. The lowest child of a
        // count comes first among its equals, so it is the one to test. (A later child of the
        // same count inside the first `top + 1` adds what the lowest adds: no other choice.)
        let top = (k - slot - 1).min(left_children);
        let with_in_top = largest(&runs, (top + 1).min(left_children));
        let first_top = largest(&runs, top);
        let mut more_free = left_children;
        let mut pick = None;
        for (r, &(v, start, end)) in runs.iter().enumerate() {
            more_free -= end - start;
            if start == end {
                continue;
            }
            let covers = if more_free < top { with_in_top } else { v + first_top };
            if covers >= left {
                pick = Some(r);
                break;
            }
        }
        let Some(run) = pick.and_then(|r| runs.get_mut(r)) else { break };
        let Some(&(v, c)) = by_count.get(run.1) else { break };
        run.1 += 1;
        left_children -= 1;
        left = left.saturating_sub(v);
        chosen.push(c);
    }
    fill_in_order(chosen, counts, need, |c| (counts[c], c))
}

/// Takes from `members` in the order of `key`, each as much as it has, until `need` is met.
fn fill_in_order<K: Ord>(
    mut members: Vec<usize>,
    counts: &[usize],
    need: usize,
    key: impl Fn(usize) -> K,
) -> Vec<(usize, usize)> {
    members.sort_by_key(|&c| key(c));
    let mut left = need;
    let mut out = Vec::new();
    for c in members {
        if left == 0 {
            break;
        }
        let k = counts[c].min(left);
        out.push((c, k));
        left -= k;
    }
    out
}

/// Spreads `need` over `children` as evenly as their counts allow (water-filling).
fn balance(children: &[usize], counts: &[usize], need: usize) -> Vec<(usize, usize)> {
    let mut given = vec![0usize; children.len()];
    let mut left = need;
    while left > 0 {
        let open: Vec<usize> =
            (0..children.len()).filter(|&i| given[i] < counts[children[i]]).collect();
        if open.is_empty() {
            break;
        }
        let share = (left / open.len()).max(1);
        for i in open {
            let k = share.min(counts[children[i]] - given[i]).min(left);
            given[i] += k;
            left -= k;
            if left == 0 {
                break;
            }
        }
    }
    children.iter().zip(given).filter(|(_, g)| *g > 0).map(|(&c, g)| (c, g)).collect()
}

/// Topology-blind: the lowest-numbered available units, split into tasks in order.
pub fn first_fit(model: &HostModel, job: &JobShape) -> Result<Vec<CpuSet>, PlaceError> {
    let reps: Vec<u32> = job.unit_reps.iter().take(job.units_needed()).collect();
    if reps.len() < job.units_needed() {
        return Err(PlaceError::NotEnoughFree {
            needed: job.units_needed(),
            free: job.unit_reps.len(),
            unit: unit_name(job.unit),
            detail: String::new(),
        });
    }
    Ok(reps.chunks(job.units_per_task).map(|c| job.units_cpus(model, c)).collect())
}

#[cfg(test)]
pub(super) mod tests {
    use super::{fewest_children, fill_in_order};

    std::thread_local! {
        /// Set by a test to place by the general search and split only, so that the shortcut
        /// for flat nodes can be compared with them (`place::tests`).
        pub(in crate::place) static NO_SHORTCUTS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    use proptest::prelude::{prop_assert_eq, proptest, ProptestConfig};

    /// The rule as first written: every slot scans every child (O(children²) per split).
    fn fewest_children_by_scan(
        mut children: Vec<usize>,
        counts: &[usize],
        need: usize,
    ) -> Vec<(usize, usize)> {
        children.sort_by_key(|&c| (std::cmp::Reverse(counts[c]), c));
        let mut sum = 0;
        let mut k = 0;
        while k < children.len() && sum < need {
            sum += counts[children[k]];
            k += 1;
        }
        let mut chosen = Vec::with_capacity(k);
        let mut left = need;
        for slot in 0..k {
            let after = k - slot - 1;
            let mut prefix = vec![0usize];
            for &c in &children {
                prefix.push(prefix[prefix.len() - 1] + counts[c]);
            }
            let largest_others = |i: usize| {
                let top = after.min(children.len());
                if i >= top {
                    prefix[top]
                } else {
                    prefix[(top + 1).min(children.len())] - counts[children[i]]
                }
            };
            let pick = (0..children.len())
                .filter(|&i| counts[children[i]] + largest_others(i) >= left)
                .min_by_key(|&i| (counts[children[i]], children[i]));
            let Some(i) = pick else { break };
            let c = children.remove(i);
            left = left.saturating_sub(counts[c]);
            chosen.push(c);
        }
        fill_in_order(chosen, counts, need, |c| (counts[c], c))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// The split by counts is the split by scanning, child for child and count for count,
        /// on few and many children, few and many distinct counts, and needs up to the total.
        #[test]
        fn fewest_children_agrees_with_the_scan(
            counts in proptest::collection::vec(0usize..9, 1..60),
            spread in 1usize..40,
            shuffle in proptest::collection::vec(0usize..1000, 60),
            need_share in 0.0f64..=1.2,
        ) {
            // Counts 0 (the callers filter those out) to 17; needs from 0 to above the total.
            let counts: Vec<usize> = counts.iter().map(|&c| (c * spread) % 18).collect();
            let mut children: Vec<usize> = (0..counts.len()).collect();
            children.sort_by_key(|&c| shuffle[c]);
            let total: usize = counts.iter().sum();
            let need = (total as f64 * need_share) as usize;
            prop_assert_eq!(
                fewest_children(children.clone(), &counts, need),
                fewest_children_by_scan(children, &counts, need)
            );
        }
    }

    #[test]
    fn a_flat_node_gives_the_lowest_cores() {
        let counts = vec![1usize; 4096];
        let children: Vec<usize> = (0..4096).rev().collect();
        let split = fewest_children(children.clone(), &counts, 300);
        assert_eq!(split, (0..300).map(|c| (c, 1)).collect::<Vec<_>>());
        assert_eq!(split, fewest_children_by_scan(children, &counts, 300));
    }
}
