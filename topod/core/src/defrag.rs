//! Defragmenting migration: the fewest moves of running jobs that let a new job fit on a host.
//!
//! ## The problem
//!
//! A host may refuse a job although at least as many PUs are free as it needs: the free PUs are
//! in the wrong places (spread over NUMA nodes when each task wants one, on cores that other jobs
//! half use when the job wants whole cores). Moving a few running jobs, each to another place its
//! own request allows, can make the room. topo owns every job's cpuset, so a move is a cpuset
//! rewrite and a memory migration; this module only decides which moves, as a pure function of
//! the host's [`HostModel`], its [`Occupancy`], the running jobs and the new request.
//!
//! ## What a plan is
//!
//! For a set S of running jobs, the plan is built in three steps, each with [`place::place`]:
//! 1. S is taken out of the occupancy (what its jobs hold and fence);
//! 2. the new request is placed there;
//! 3. each job of S is placed again with its own request, the largest first, each on the
//!    occupancy that holds the new job and the jobs of S placed before it.
//!
//! So in the state a plan leads to no CPU is held twice, no job holds a CPU another fences, and
//! every job honours its own request: the same number of tasks (a moved job is placed with
//! `tasks` set to the number of tasks it runs with, so a malleable job keeps its current size),
//! the same units per task, `same=`, exclusivity, `CPU_LIST`, `MAX_RADIUS`. A job that step 3
//! puts back on exactly the CPUs it had did not move: it is left out of the plan and keeps its
//! allocation as it is.
//!
//! ## Which plan
//!
//! With [`DefragLimits::keep_locality`] (the default), locality comes first: a moved job may not
//! end up spanning more NUMA nodes or L3 groups than it does now, and a plan that places the new
//! job within the fewest NUMA nodes and L3 groups its size allows beats any plan that does not,
//! whatever it moves (a refused job placed badly would lower the host's locality, and a job
//! placed once stays where it is). Then plans are ordered by [`PlanCost`]: the fewest moves; then
//! the fewest PUs moved (the sum of the moved jobs' PUs: what the kernel has to migrate, and how
//! many threads lose their caches); then the new job's placement score ([`place::score`], lower
//! is better). Jobs whose [`Movable::may_move`] is false (too young, moved too recently: the
//! caller decides) are never moved; nor is a job larger than [`DefragLimits::max_moved_pus`].
//!
//! ## The search
//!
//! With `keep_locality`, the search runs twice: first for the new request kept inside the fewest
//! domains its size allows of the finer of the NUMA and L3 levels (as `distribute=pack(level=n)`
//! asks, unless the request says where to go itself: `balance`, a pack limit, `MAX_RADIUS`),
//! then, when that finds nothing, for the request as it is. The two share the budget.
//!
//! A quick count prunes each search: with S taken out, the new request's available units
//! (threads, or whole cores, L3 groups... where it asks for those, after exclusivity and
//! `CPU_LIST`) must be enough, counted in whole tasks per `same=` domain when it has `same=`, and
//! inside one of the regions placement tries when it has a pack limit. Without a pack limit the
//! count is a necessary condition (no set that fails it could work); with one it mirrors where
//! placement looks. Only sets that pass are placed for real, in this order:
//!
//! 1. **Single moves**: every movable job that passes, the fewest PUs first; the first that works
//!    and every other of the same size are compared; larger ones are not tried.
//! 2. **Pairs**, when no single move works: the [`DefragLimits::max_candidates`] most helpful
//!    jobs (those whose removal leaves the new request the least short, then the smallest),
//!    every pair of them that passes, the fewest PUs first, as for singles.
//! 3. **Greedy, up to [`DefragLimits::max_moves`]**, when no pair works either: from each of the
//!    first [`DefragLimits::greedy_seeds`] candidates, add the candidate that leaves the request
//!    least short (then the smallest) until the count passes and the set works.
//!
//! So without `keep_locality`, or when the first search finds nothing, the plan is the best of
//! all single moves, else of all pairs of candidates (given how a set is placed, above). The work
//! is bounded by [`DefragLimits::max_evaluations`] sets placed for real, not by a clock: the
//! function stays pure and gives the same answer on every machine.

use crate::cpuset::CpuSet;
use crate::ledger::Allocation;
use crate::place::{self, HostModel, Occupancy, Placement, PlacementMetrics, Strategy};
use crate::request::{Distribute, Level, Request};
use std::borrow::Cow;
use std::cmp::Reverse;
use std::collections::BTreeSet;

/// A running job on the host, as the planner sees it.
#[derive(Debug, Clone)]
pub struct Movable<'a, K> {
    /// The caller's name for the job, given back in [`Move::key`].
    pub key: K,
    /// The request it was placed for: a move places it again with this request (with `tasks`
    /// set to `tasks.len()`).
    pub request: &'a Request,
    /// The CPUs it holds now (they must be in the occupancy's `held`).
    pub cpus: &'a CpuSet,
    /// The CPUs it fences now (in the occupancy's `fenced`).
    pub fenced: &'a CpuSet,
    /// Its CPUs per task. Empty when unknown (an allocation rebuilt from a cgroup): the request's
    /// own task count is used then.
    pub tasks: &'a [CpuSet],
    /// Whether the caller allows moving it now.
    pub may_move: bool,
}

impl<'a, K> Movable<'a, K> {
    /// A job from its ledger allocation and the request it was placed for.
    pub fn from_allocation(
        key: K,
        request: &'a Request,
        allocation: &'a Allocation,
        may_move: bool,
    ) -> Self {
        Movable {
            key,
            request,
            cpus: &allocation.cpus,
            fenced: &allocation.fenced,
            tasks: &allocation.tasks,
            may_move,
        }
    }

    /// Whether what it holds is what its request gives for the tasks it runs with: so many
    /// units of its unit level. A job that does not match (its allocation predates a change of
    /// request, or was rebuilt without its tasks) could not be placed again at its own size, and
    /// is never moved.
    fn size_matches(&self, model: &HostModel) -> bool {
        let tasks = match self.tasks.len() {
            0 => self.request.tasks.unwrap_or(place::DEFAULT_TASKS) as usize,
            n => n,
        };
        let units = match self.request.unit {
            Level::Thread => self.cpus.len(),
            unit => model.touched(unit, self.cpus).len(),
        };
        units == tasks * self.request.units_per_task.max(1) as usize
    }

    /// The request a move places it with: its own, for the number of tasks it runs with now.
    fn request_as_running(&self) -> Cow<'a, Request> {
        let running = u32::try_from(self.tasks.len()).unwrap_or(u32::MAX);
        if self.tasks.is_empty()
            || (self.request.tasks == Some(running) && self.request.tasks_max.is_none())
        {
            return Cow::Borrowed(self.request);
        }
        Cow::Owned(Request { tasks: Some(running), tasks_max: None, ..self.request.clone() })
    }
}

/// How far the search may go.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct DefragLimits {
    /// Jobs moved by one plan, at most (0: never move anything).
    pub max_moves: usize,
    /// PUs moved by one plan, at most (also: no job larger than this is moved).
    pub max_moved_pus: usize,
    /// Jobs the pair and greedy searches consider: the most helpful ones.
    pub max_candidates: usize,
    /// Starting jobs of the greedy search (each a different first move).
    pub greedy_seeds: usize,
    /// Sets of jobs placed for real (each costs one placement per job in it, plus one), at most.
    pub max_evaluations: usize,
    /// Locality first: a moved job must span no more NUMA nodes and no more L3 groups at its new
    /// place than at its old one, and a plan that places the new job within the fewest its size
    /// allows beats any that does not (see the module documentation).
    pub keep_locality: bool,
}

impl Default for DefragLimits {
    /// Up to 8 moves, any size, 32 candidates, 4 greedy starts, 300 sets placed, locality first:
    /// what `topoctl bench placement --migrate` uses ([`crate::bench::replay_migrating`]); with
    /// 4 moves the 384-PU Zen 4 keeps 13 of its 83 rejections instead of 8.
    fn default() -> Self {
        DefragLimits {
            max_moves: 8,
            max_moved_pus: usize::MAX,
            max_candidates: 32,
            greedy_seeds: 4,
            max_evaluations: 300,
            keep_locality: true,
        }
    }
}

/// One running job's new place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Move<K> {
    /// The job, as the caller named it in [`Movable::key`].
    pub key: K,
    /// Where it goes: CPUs, tasks, memory nodes, fence. Its metrics are measured against the
    /// state the plan leads to, without the job itself.
    pub placement: Placement,
}

/// What a plan costs; plans compare in this order (fewest moves, then fewest PUs moved, then
/// the new job's score), after locality (see [`DefragLimits::keep_locality`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct PlanCost {
    /// Jobs moved.
    pub moves: usize,
    /// PUs of the jobs moved.
    pub moved_pus: usize,
    /// [`place::score`] of the new job's placement.
    pub score: u64,
}

/// Moves that make a new job fit, and where it then goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan<K> {
    /// The jobs to move and their new places, in an order in which they can be carried out one
    /// by one (each job's new CPUs and fence meet no CPU held or fenced by a job that moves after
    /// it) when [`Plan::sequential`] says there is one.
    pub moves: Vec<Move<K>>,
    /// Where the new job goes, once every move is done. Its metrics are measured against the
    /// state the moves lead to.
    pub placement: Placement,
    /// Whether `moves` can be carried out one at a time in their order. When false, some moved
    /// jobs take each other's CPUs in a cycle: the caller must go through a state where two of
    /// them share CPUs for a moment (widen, then narrow), or suspend one meanwhile.
    pub sequential: bool,
}

impl<K> Plan<K> {
    /// What the plan costs.
    pub fn cost(&self) -> PlanCost {
        PlanCost {
            moves: self.moves.len(),
            moved_pus: self.moved_pus(),
            score: place::score(&self.placement.metrics),
        }
    }

    /// PUs the moves migrate: the sum of the moved jobs' sizes.
    pub fn moved_pus(&self) -> usize {
        self.moves.iter().map(|m| m.placement.cpus.len()).sum()
    }
}

/// The smallest set of moves of running jobs after which `request` fits on the host, or `None`
/// when the search finds none within `limits`.
///
/// `occupancy` is everything held and fenced on the host, the jobs of `jobs` included; `jobs`
/// are the running jobs (those with `may_move` false are never moved; jobs not listed are never
/// moved either). When the request fits as things are, the plan has no move. Worth calling on any
/// refusal while at least as many PUs are free as the request needs, which includes
/// [`place::PlaceError::rejected_while_free`] and also a request for whole cores refused because
/// the free PUs lie on cores other jobs half use.
///
/// What a plan is, how plans are ordered and how the search goes are in the module
/// documentation.
pub fn plan_moves<K: Clone>(
    model: &HostModel,
    occupancy: &Occupancy,
    jobs: &[Movable<'_, K>],
    request: &Request,
    strategy: Strategy,
    limits: DefragLimits,
) -> Option<Plan<K>> {
    if let Ok(placement) = place::place(model, occupancy, request, strategy) {
        return Some(Plan { moves: Vec::new(), placement, sequential: true });
    }
    if limits.max_moves == 0 {
        return None;
    }
    let mut budget = limits;
    let local = limits.keep_locality.then(|| as_local_as_its_size_allows(model, request));
    if let Some(local) = local.flatten() {
        let mut search = Search::new(model, occupancy, jobs, &local, strategy, budget, true);
        if let Some(plan) = search.run() {
            return Some(plan);
        }
        budget.max_evaluations = budget.max_evaluations.saturating_sub(search.tried.len());
    }
    Search::new(model, occupancy, jobs, request, strategy, budget, false).run()
}

/// `request` kept inside the fewest domains its size allows of the finer of the NUMA and L3
/// levels (`distribute=pack(level=n)`), when it leaves where its jobs go to the strategy and the
/// limit narrows anything.
fn as_local_as_its_size_allows(model: &HostModel, request: &Request) -> Option<Request> {
    // MAX_RADIUS has placement try regions of its own; `balance` and an explicit pack limit say
    // where the job wants to be already.
    if request.max_radius.is_some()
        || !matches!(request.distribute, Distribute::Any | Distribute::Pack(None))
    {
        return None;
    }
    let level = if model.l3.len() > model.numa.len() { Level::L3 } else { Level::Numa };
    let pus = request.tasks.unwrap_or(place::DEFAULT_TASKS).max(1) as usize
        * request.units_per_task.max(1) as usize
        * model.pus_per_unit(request.unit);
    let n = model.min_domains_for(level, pus);
    if n >= model.domains(level).len() {
        return None;
    }
    let n = u32::try_from(n).ok()?;
    Some(Request { distribute: Distribute::Pack(Some((level, n))), ..request.clone() })
}

/// A job the search may move.
struct Candidate<'a> {
    /// Index into the caller's `jobs`.
    index: usize,
    /// The request it is placed again with.
    request: Cow<'a, Request>,
    /// Its PUs.
    pus: usize,
    /// What it holds and fences: free once it is taken out.
    taken: CpuSet,
    /// How short the new request is with only this job taken out (see [`Bound::shortfall`]).
    shortfall: usize,
    /// NUMA nodes and L3 groups it spans now.
    spans: (usize, usize),
}

/// A set that works: the new job's placement and the moved jobs' (by candidate index).
struct Found {
    placement: Placement,
    moves: Vec<(usize, Placement)>,
    cost: PlanCost,
}

struct Search<'s, 'a, K> {
    model: &'s HostModel,
    occupancy: &'s Occupancy,
    jobs: &'s [Movable<'a, K>],
    request: &'s Request,
    strategy: Strategy,
    limits: DefragLimits,
    bound: Bound<'s>,
    /// The jobs that may move, in the caller's order.
    candidates: Vec<Candidate<'a>>,
    /// Sets placed for real so far (as sorted candidate indexes), so none is placed twice.
    tried: BTreeSet<Vec<usize>>,
    /// Whether only plans that place the new job within the fewest NUMA nodes and L3 groups its
    /// size allows count.
    local_only: bool,
    best: Option<Found>,
}

impl<'s, 'a, K: Clone> Search<'s, 'a, K> {
    fn new(
        model: &'s HostModel,
        occupancy: &'s Occupancy,
        jobs: &'s [Movable<'a, K>],
        request: &'s Request,
        strategy: Strategy,
        limits: DefragLimits,
        local_only: bool,
    ) -> Self {
        let free = occupancy.free(model);
        let bound = Bound::new(model, request, &free);
        let candidates = jobs
            .iter()
            .enumerate()
            .filter(|(_, j)| j.may_move && !j.cpus.is_empty())
            .filter(|(_, j)| j.cpus.len() <= limits.max_moved_pus)
            .filter(|(_, j)| j.size_matches(model))
            .map(|(index, j)| {
                let taken = j.cpus.union(j.fenced);
                let shortfall = bound.shortfall(&taken);
                Candidate {
                    index,
                    request: j.request_as_running(),
                    pus: j.cpus.len(),
                    taken,
                    shortfall,
                    spans: spans(model, j.cpus),
                }
            })
            .collect();
        Search {
            model,
            occupancy,
            jobs,
            request,
            strategy,
            limits,
            bound,
            candidates,
            tried: BTreeSet::new(),
            local_only,
            best: None,
        }
    }

    /// Single moves, then pairs, then greedy (see the module documentation).
    fn run(&mut self) -> Option<Plan<K>> {
        // More free CPUs never count fewer units: when taking out every candidate is not enough,
        // no set is.
        let all = CpuSet::union_all(self.candidates.iter().map(|c| &c.taken));
        if self.bound.shortfall(&all) > 0 {
            return None;
        }
        self.singles();
        let ranked = self.ranked();
        let all = CpuSet::union_all(ranked.iter().map(|&c| &self.candidates[c].taken));
        let hopeless = self.bound.shortfall(&all) > 0;
        if self.best.is_none() && self.limits.max_moves >= 2 && !hopeless {
            self.pairs(&ranked);
        }
        if self.best.is_none() && self.limits.max_moves >= 3 && !hopeless {
            self.greedy(&ranked);
        }
        let found = self.best.take()?;
        Some(self.plan(found))
    }

    /// Whether a set of `moves` jobs and `pus` PUs could still beat the best plan found.
    fn could_beat(&self, moves: usize, pus: usize) -> bool {
        self.best.as_ref().is_none_or(|b| (moves, pus) <= (b.cost.moves, b.cost.moved_pus))
    }

    fn consider(&mut self, found: Found) {
        if self.best.as_ref().is_none_or(|b| found.cost < b.cost) {
            self.best = Some(found);
        }
    }

    fn singles(&mut self) {
        let mut order: Vec<usize> =
            (0..self.candidates.len()).filter(|&c| self.candidates[c].shortfall == 0).collect();
        order.sort_by_key(|&c| (self.candidates[c].pus, c));
        for c in order {
            if !self.could_beat(1, self.candidates[c].pus) {
                break;
            }
            if let Some(found) = self.evaluate(&[c]) {
                self.consider(found);
            }
        }
    }

    /// The candidates the pair and greedy searches consider, the most helpful first.
    fn ranked(&self) -> Vec<usize> {
        let mut ranked: Vec<usize> = (0..self.candidates.len()).collect();
        ranked.sort_by_key(|&c| (self.candidates[c].shortfall, self.candidates[c].pus, c));
        ranked.truncate(self.limits.max_candidates);
        ranked
    }

    fn pairs(&mut self, ranked: &[usize]) {
        let mut pairs: Vec<(usize, usize, usize)> = Vec::new();
        for (i, &a) in ranked.iter().enumerate() {
            for &b in &ranked[i + 1..] {
                let (ca, cb) = (&self.candidates[a], &self.candidates[b]);
                let pus = ca.pus + cb.pus;
                if pus > self.limits.max_moved_pus {
                    continue;
                }
                if self.bound.shortfall(&ca.taken.union(&cb.taken)) == 0 {
                    pairs.push((pus, a.min(b), a.max(b)));
                }
            }
        }
        pairs.sort_unstable();
        for (pus, a, b) in pairs {
            if !self.could_beat(2, pus) {
                break;
            }
            if let Some(found) = self.evaluate(&[a, b]) {
                self.consider(found);
            }
        }
    }

    fn greedy(&mut self, ranked: &[usize]) {
        for &seed in ranked.iter().take(self.limits.greedy_seeds) {
            let mut set = vec![seed];
            let mut taken = self.candidates[seed].taken.clone();
            let mut pus = self.candidates[seed].pus;
            loop {
                if !self.could_beat(set.len(), 0) {
                    break;
                }
                if self.bound.shortfall(&taken) == 0 {
                    if let Some(found) = self.evaluate(&set) {
                        self.consider(found);
                        break;
                    }
                }
                if set.len() >= self.limits.max_moves {
                    break;
                }
                // The next job: the one that leaves the request least short, then the smallest.
                let next = ranked
                    .iter()
                    .copied()
                    .filter(|c| !set.contains(c))
                    .filter(|&c| pus + self.candidates[c].pus <= self.limits.max_moved_pus)
                    .map(|c| {
                        let shortfall =
                            self.bound.shortfall(&taken.union(&self.candidates[c].taken));
                        ((shortfall, self.candidates[c].pus, c), c)
                    })
                    .min();
                let Some((_, c)) = next else { break };
                set.push(c);
                taken.union_with(&self.candidates[c].taken);
                pus += self.candidates[c].pus;
            }
        }
    }

    /// Takes `set` (candidate indexes) out, places the new request, places the set again;
    /// `None` when a placement fails, or when the budget is spent or the set was tried already.
    fn evaluate(&mut self, set: &[usize]) -> Option<Found> {
        if self.tried.len() >= self.limits.max_evaluations {
            return None;
        }
        let mut key = set.to_vec();
        key.sort_unstable();
        if !self.tried.insert(key) {
            return None;
        }
        let mut occ = self.occupancy.clone();
        for &c in set {
            let job = &self.jobs[self.candidates[c].index];
            occ.held.difference_with(job.cpus);
            occ.fenced.difference_with(job.fenced);
        }
        let placement = place::place(self.model, &occ, self.request, self.strategy).ok()?;
        if self.local_only && !(placement.metrics.numa_optimal() && placement.metrics.l3_optimal())
        {
            return None;
        }
        add(&mut occ, &placement);
        let mut order = set.to_vec();
        order.sort_by_key(|&c| (Reverse(self.candidates[c].pus), c));
        let mut moves = Vec::with_capacity(order.len());
        for c in order {
            let p =
                place::place(self.model, &occ, &self.candidates[c].request, self.strategy).ok()?;
            if self.limits.keep_locality {
                let (numa, l3) = self.candidates[c].spans;
                if p.metrics.numa_nodes > numa || p.metrics.l3_groups > l3 {
                    return None;
                }
            }
            add(&mut occ, &p);
            moves.push((c, p));
        }
        // A job put back on its own CPUs did not move (its fence is the same, as it is a
        // function of its CPUs and its request): it keeps its allocation.
        moves.retain(|(c, p)| p.cpus != *self.jobs[self.candidates[*c].index].cpus);
        let mut placement = placement;
        placement.metrics = measure_in(self.model, &occ, &placement.cpus);
        let cost = PlanCost {
            moves: moves.len(),
            moved_pus: moves.iter().map(|(c, _)| self.candidates[*c].pus).sum(),
            score: place::score(&placement.metrics),
        };
        Some(Found { placement, moves, cost })
    }

    /// The plan of a set that works: moves in an order they can be carried out in, metrics
    /// against the final state.
    fn plan(&self, found: Found) -> Plan<K> {
        let Found { placement, mut moves, .. } = found;
        // The final occupancy: everything but the moved jobs' old places, plus the new ones.
        let mut occ = self.occupancy.clone();
        for (c, _) in &moves {
            let job = &self.jobs[self.candidates[*c].index];
            occ.held.difference_with(job.cpus);
            occ.fenced.difference_with(job.fenced);
        }
        add(&mut occ, &placement);
        for (_, p) in &moves {
            add(&mut occ, p);
        }
        for (_, p) in &mut moves {
            p.metrics = measure_in(self.model, &occ, &p.cpus);
        }
        // Kahn's order: a job moves once no job still to move holds or fences its new CPUs.
        let new_taken: Vec<CpuSet> = moves.iter().map(|(_, p)| p.cpus.union(&p.fenced)).collect();
        let mut left: Vec<usize> = (0..moves.len()).collect();
        let mut order = Vec::with_capacity(moves.len());
        let mut sequential = true;
        while !left.is_empty() {
            let ready = left.iter().position(|&i| {
                left.iter().all(|&j| j == i || !new_taken[i].intersects(&self.old_taken(&moves[j])))
            });
            match ready {
                Some(pos) => order.push(left.remove(pos)),
                None => {
                    sequential = false;
                    order.append(&mut left);
                }
            }
        }
        let mut slots: Vec<Option<(usize, Placement)>> = moves.into_iter().map(Some).collect();
        let moves = order
            .into_iter()
            .filter_map(|i| slots[i].take())
            .map(|(c, placement)| Move {
                key: self.jobs[self.candidates[c].index].key.clone(),
                placement,
            })
            .collect();
        Plan { moves, placement, sequential }
    }

    fn old_taken(&self, (c, _): &(usize, Placement)) -> CpuSet {
        self.candidates[*c].taken.clone()
    }
}

/// NUMA nodes and L3 groups `cpus` spans.
fn spans(model: &HostModel, cpus: &CpuSet) -> (usize, usize) {
    (model.touched_set(Level::Numa, cpus).len(), model.touched_set(Level::L3, cpus).len())
}

fn add(occ: &mut Occupancy, p: &Placement) {
    occ.held.union_with(&p.cpus);
    occ.fenced.union_with(&p.fenced);
}

/// The metrics of `cpus`, a job of the state `occ`, as if it were placed last.
fn measure_in(model: &HostModel, occ: &Occupancy, cpus: &CpuSet) -> PlacementMetrics {
    let others = Occupancy { held: occ.held.difference(cpus), fenced: occ.fenced.clone() };
    PlacementMetrics::measure(model, &others, cpus)
}

/// What the new request could get if some running jobs were taken out, counted quickly: the
/// condition that prunes the search (see [`plan_moves`]).
///
/// The request's available units (after `CPU_LIST` and exclusivity) are counted per `same=`
/// domain (row) and per region placement may use: the whole host, or with `pack(level=n)` each
/// run of n neighbouring domains of that level that placement tries. The counts for the CPUs
/// free now are kept; taking jobs out only adds the units of the domains their CPUs touch, so a
/// question costs in proportion to the jobs' size, not the host's.
struct Bound<'m> {
    model: &'m HostModel,
    cpu_list: Option<&'m CpuSet>,
    exclusive: Option<Level>,
    unit: Level,
    units_per_task: usize,
    tasks: usize,
    /// The `same=` level, when tasks must each lie inside one of its domains.
    same: Option<Level>,
    /// The `pack(level=n)` level, if any.
    pack: Option<Level>,
    /// Rows: domains of the `same=` level (1 without one).
    rows: usize,
    /// For each domain of the pack level (one column without one), the regions holding it.
    regions_of: Vec<Vec<usize>>,
    /// CPUs free now.
    free: CpuSet,
    /// The request's available CPUs now.
    avail: CpuSet,
    /// Available units now, per region and row: `region * rows + row`.
    units: Vec<usize>,
    /// Whole tasks (with `same=`) or units (without) available now, per region.
    have: Vec<usize>,
}

impl<'m> Bound<'m> {
    fn new(model: &'m HostModel, request: &'m Request, free: &CpuSet) -> Self {
        let unit = request.unit;
        let (pack, regions) = match request.distribute {
            Distribute::Pack(Some((level, n))) if level != Level::Thread => {
                let len = model.domains(level).len();
                let mut regions: Vec<Vec<usize>> = (0..len)
                    .map(|start| {
                        let mut r: Vec<usize> =
                            (0..(n as usize).min(len)).map(|k| (start + k) % len).collect();
                        r.sort_unstable();
                        r
                    })
                    .collect();
                regions.sort();
                regions.dedup();
                (Some(level), regions)
            }
            _ => (None, vec![vec![0]]),
        };
        let columns = pack.map_or(1, |l| model.domains(l).len());
        let mut regions_of = vec![Vec::new(); columns];
        for (r, region) in regions.iter().enumerate() {
            for &c in region {
                regions_of[c].push(r);
            }
        }
        let same = request.same.filter(|s| *s > unit);
        let rows = same.map_or(1, |l| model.domains(l).len());
        let mut bound = Bound {
            model,
            cpu_list: request.cpu_list.as_ref(),
            exclusive: request.exclusive_level().filter(|l| *l != Level::Thread),
            unit,
            units_per_task: request.units_per_task.max(1) as usize,
            tasks: request.tasks.unwrap_or(place::DEFAULT_TASKS).max(1) as usize,
            same,
            pack,
            rows,
            regions_of,
            free: free.clone(),
            avail: CpuSet::new(),
            units: vec![0; regions.len() * rows],
            have: vec![0; regions.len()],
        };
        let mut avail = match bound.cpu_list {
            Some(list) => free.intersection(list),
            None => free.clone(),
        };
        if let Some(level) = bound.exclusive {
            avail = whole_domains(model, level, &avail, &avail);
        }
        for cell in bound.cells(&bound.unit_reps(&avail, &avail)) {
            bound.units[cell] += 1;
        }
        for r in 0..regions.len() {
            bound.have[r] = (0..rows).map(|row| bound.worth(bound.units[r * rows + row])).sum();
        }
        bound.avail = avail;
        bound
    }

    /// What `units` in one row of a region are worth: whole tasks with `same=`, else units.
    fn worth(&self, units: usize) -> usize {
        match self.same {
            Some(_) => units / self.units_per_task,
            None => units,
        }
    }

    /// One CPU (the first) per unit wholly inside `avail` among those `touched` touches.
    fn unit_reps(&self, touched: &CpuSet, avail: &CpuSet) -> CpuSet {
        match self.unit {
            Level::Thread => touched.clone(),
            unit => {
                let domains = self.model.domains(unit);
                let mut reps = CpuSet::new();
                for i in self.model.touched_set(unit, touched).iter() {
                    let d = &domains[i as usize];
                    if d.is_subset(avail) {
                        if let Some(first) = d.first() {
                            reps.insert(first);
                        }
                    }
                }
                reps
            }
        }
    }

    /// The cells (`region * rows + row`) the units of `reps` count in, once per unit and
    /// region.
    fn cells(&self, reps: &CpuSet) -> Vec<usize> {
        let mut cells = Vec::new();
        for rep in reps.iter() {
            let row = self.same.map_or(Some(0), |l| self.model.domain_of(l, rep));
            let column = self.pack.map_or(Some(0), |l| self.model.domain_of(l, rep));
            if let (Some(row), Some(column)) = (row, column) {
                cells.extend(self.regions_of[column].iter().map(|&r| r * self.rows + row));
            }
        }
        cells
    }

    /// How many units the request lacks when the CPUs `taken` (held or fenced by the jobs
    /// taken out) are free too: 0 when it might fit, more when it cannot. Counts whole tasks
    /// only with `same=`; with `pack(level=n)`, in the best region placement tries.
    fn shortfall(&self, taken: &CpuSet) -> usize {
        let mut added = match self.cpu_list {
            Some(list) => taken.intersection(list),
            None => taken.clone(),
        };
        if let Some(level) = self.exclusive {
            // Only the domains the jobs touch can have become wholly free.
            let mut pool = self.free.union(taken);
            if let Some(list) = self.cpu_list {
                pool.intersect_with(list);
            }
            added = whole_domains(self.model, level, &added, &pool);
        }
        let avail = self.avail.union(&added);
        // Each region's worth now, changed only in the rows the new units fall in.
        let mut added_units = vec![0usize; self.units.len()];
        let mut changed = Vec::new();
        for cell in self.cells(&self.unit_reps(&added, &avail)) {
            if added_units[cell] == 0 {
                changed.push(cell);
            }
            added_units[cell] += 1;
        }
        let mut have = self.have.clone();
        for cell in changed {
            let before = self.units[cell];
            have[cell / self.rows] += self.worth(before + added_units[cell]) - self.worth(before);
        }
        let need = match self.same {
            Some(_) => self.tasks,
            None => self.tasks * self.units_per_task,
        };
        let short = need.saturating_sub(have.into_iter().max().unwrap_or(0));
        match self.same {
            Some(_) => short * self.units_per_task,
            None => short,
        }
    }
}

/// The union of the domains of `level` that `touched` touches and that lie wholly inside `pool`.
fn whole_domains(model: &HostModel, level: Level, touched: &CpuSet, pool: &CpuSet) -> CpuSet {
    let domains = model.domains(level);
    let mut out = CpuSet::new();
    for i in model.touched_set(level, touched).iter() {
        let d = &domains[i as usize];
        if d.is_subset(pool) {
            out.union_with(d);
        }
    }
    out
}

// The tests draw their streams from the benchmark's generator (the `sim` feature, on by default).
#[cfg(all(test, feature = "sim"))]
mod tests {
    use super::*;
    use crate::bench::{self, SplitMix};
    use crate::ledger::Ledger;
    use crate::request::CpusetOption;
    use crate::topology::{SyntheticShape, Topology};
    use proptest::prelude::{prop_assert, proptest, ProptestConfig};
    use std::path::PathBuf;

    /// 2 packages × 2 NUMA × 2 L3 × 4 cores × 2 threads = 64 PUs; siblings 32 apart.
    fn machine() -> HostModel {
        let topo = Topology::synthetic(SyntheticShape {
            packages: 2,
            numa_per_package: 2,
            l3_per_numa: 2,
            cores_per_l3: 4,
            threads_per_core: 2,
        });
        HostModel::new(&topo, &CpuSet::new()).unwrap()
    }

    /// The machine bundled with the repository: a Dell R740 in SNC2 (80 PUs, 4 NUMA nodes
    /// sharing 2 L3 groups).
    fn dell() -> HostModel {
        let xml = include_str!("../../data/dell-r740-2x-xeon-gold-6230-snc2.xml");
        let topo = crate::topology::hwloc_xml::parse("dell-r740", xml).unwrap();
        HostModel::new(&topo, &CpuSet::new()).unwrap()
    }

    /// A machine from `shared/topologies` (missing is a failure, as in the crate's other tests).
    fn shared(rel: &str) -> HostModel {
        let dir = std::env::var_os("TOPO_SHARED_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared"));
        let path = dir.join("topologies").join(rel);
        let topo = crate::topology::hwloc_xml::read_file(&path)
            .unwrap_or_else(|e| panic!("{}: {e}; set TOPO_SHARED_DIR", path.display()));
        HostModel::new(&topo, &CpuSet::new()).unwrap()
    }

    fn set(s: &str) -> CpuSet {
        CpuSet::parse_list(s).unwrap()
    }

    /// Running jobs on a host: a ledger and each job's request.
    struct Host {
        ledger: Ledger,
        requests: Vec<(String, Request)>,
    }

    impl Host {
        fn new() -> Self {
            Host { ledger: Ledger::new(), requests: Vec::new() }
        }

        /// A job holding exactly `cpus` (split in order into its request's tasks), placed for
        /// `request`.
        fn hold(&mut self, job: &str, cpus: &str, request: Request) {
            let cpus = set(cpus);
            let ids: Vec<u32> = cpus.iter().collect();
            let per_task = ids.len() / request.tasks.unwrap_or(1) as usize;
            let alloc = Allocation {
                job: job.into(),
                cpus: cpus.clone(),
                tasks: ids.chunks(per_task).map(|c| c.iter().copied().collect()).collect(),
                mems: CpuSet::new(),
                fenced: CpuSet::new(),
                request: String::new(),
                gang_row: None,
            };
            self.ledger.insert(alloc).unwrap();
            self.requests.push((job.into(), request));
        }

        fn movables(&self, may_move: impl Fn(&str) -> bool) -> Vec<Movable<'_, String>> {
            self.requests
                .iter()
                .map(|(job, request)| {
                    let alloc = self.ledger.get(job).unwrap();
                    Movable::from_allocation(job.clone(), request, alloc, may_move(job))
                })
                .collect()
        }
    }

    fn keys(plan: &Plan<String>) -> Vec<&str> {
        plan.moves.iter().map(|m| m.key.as_str()).collect()
    }

    /// Each NUMA node (16 PUs) has 4 free; a task of 8 threads in one node fits nowhere. Moving
    /// C (4 PUs) or D (8 PUs) out of node 1 would make room there; A (10) out of node 0 too.
    fn four_free_per_node() -> Host {
        let mut h = Host::new();
        // Node 0 = CPUs 0-7,32-39; node 1 = 8-15,40-47; node 2 = 16-23,48-55; node 3 = 24-31,56-63.
        h.hold("A", "0-7,32-33", Request::threads(10));
        h.hold("B", "34-35", Request::threads(2));
        h.hold("C", "8-11", Request::threads(4));
        h.hold("D", "12-15,40-43", Request::threads(8));
        h.hold("E", "16-23,48-51", Request::threads(12));
        h.hold("F", "24-31,56-59", Request::threads(12));
        h
    }

    fn eight_in_one_node() -> Request {
        Request { units_per_task: 8, tasks: Some(1), same: Some(Level::Numa), ..Request::default() }
    }

    #[test]
    fn the_smallest_single_move_that_makes_room_is_chosen() {
        let m = machine();
        let h = four_free_per_node();
        let r = eight_in_one_node();
        let occ = h.ledger.occupancy();
        assert!(place::place(&m, occ, &r, Strategy::BestFit).unwrap_err().rejected_while_free());
        let jobs = h.movables(|_| true);
        let plan = plan_moves(&m, occ, &jobs, &r, Strategy::BestFit, SIZES_ONLY).expect("a plan");
        assert_eq!(
            keys(&plan),
            ["C"],
            "B (2 PUs) is too small to help, C (4) is the smallest that does"
        );
        assert_eq!(plan.cost().moves, 1);
        assert_eq!(plan.moved_pus(), 4);
        assert_eq!(m.touched(Level::Numa, &plan.placement.cpus).len(), 1);
        assert!(plan.sequential);
        // C may not move: D (8 PUs) is next, before A (10).
        let jobs = h.movables(|j| j != "C");
        let plan = plan_moves(&m, occ, &jobs, &r, Strategy::BestFit, SIZES_ONLY).expect("a plan");
        assert_eq!(keys(&plan), ["D"]);
        // No job of more than 4 PUs may move, and C may not: nothing.
        let small = DefragLimits { max_moved_pus: 4, ..SIZES_ONLY };
        assert!(plan_moves(&m, occ, &jobs, &r, Strategy::BestFit, small).is_none());
        // No move allowed at all.
        let none = DefragLimits { max_moves: 0, ..DefragLimits::default() };
        assert!(plan_moves(&m, occ, &h.movables(|_| true), &r, Strategy::BestFit, none).is_none());
    }

    /// Limits that order plans by moves and PUs only.
    const SIZES_ONLY: DefragLimits = DefragLimits {
        max_moves: 4,
        max_moved_pus: usize::MAX,
        max_candidates: 32,
        greedy_seeds: 8,
        max_evaluations: 300,
        keep_locality: false,
    };

    #[test]
    fn a_plan_that_keeps_the_new_job_in_one_l3_group_wins_over_a_smaller_one() {
        let m = machine();
        let h = four_free_per_node();
        let r = eight_in_one_node();
        let occ = h.ledger.occupancy();
        let jobs = h.movables(|_| true);
        // Moving C alone leaves node 1 with 8 free threads, but in two L3 groups (4 + 4).
        let small = plan_moves(&m, occ, &jobs, &r, Strategy::BestFit, SIZES_ONLY).unwrap();
        assert_eq!(small.placement.metrics.l3_groups, 2);
        // Moving C and D frees L3 group 2 (CPUs 8-11,40-43) whole: the new job goes there.
        let local = plan_moves(&m, occ, &jobs, &r, Strategy::BestFit, DefragLimits::default())
            .expect("a plan");
        let mut moved = keys(&local);
        moved.sort_unstable();
        assert_eq!(moved, ["C", "D"]);
        assert_eq!(local.placement.cpus, set("8-11,40-43"));
        assert!(local.placement.metrics.l3_optimal() && local.placement.metrics.numa_optimal());
        assert!(local.cost() > small.cost(), "more moves, for locality");
        // The moved jobs are no less local than they were (one NUMA node, one or two L3 groups).
        for mv in &local.moves {
            assert_eq!(mv.placement.metrics.numa_nodes, 1, "{}", mv.key);
        }
    }

    #[test]
    fn a_request_that_fits_needs_no_move() {
        let m = machine();
        let h = four_free_per_node();
        let jobs = h.movables(|_| true);
        let r = Request::threads(16);
        let plan = plan_moves(
            &m,
            h.ledger.occupancy(),
            &jobs,
            &r,
            Strategy::BestFit,
            DefragLimits::default(),
        )
        .unwrap();
        assert!(plan.moves.is_empty());
        assert_eq!(plan.placement.cpus.len(), 16);
    }

    #[test]
    fn two_small_jobs_on_a_free_l3_group_are_moved_together() {
        let m = machine();
        let mut h = Host::new();
        // L3 group 0 = cores 0-3 = CPUs 0-3,32-35: two one-thread jobs on two of its cores.
        h.hold("small1", "0", Request::threads(1));
        h.hold("small2", "1", Request::threads(1));
        // Every other L3 group (8 PUs) is held but for one thread by an immovable job.
        for g in 1..8u32 {
            let (lo, hi) = (g * 4, g * 4 + 3);
            h.hold(
                &format!("big{g}"),
                &format!("{lo}-{hi},{}-{}", lo + 32, hi + 31),
                Request::threads(7),
            );
        }
        let r = Request {
            unit: Level::Core,
            units_per_task: 4,
            tasks: Some(1),
            same: Some(Level::L3),
            ..Request::default()
        };
        let occ = h.ledger.occupancy();
        assert!(place::place(&m, occ, &r, Strategy::BestFit).is_err());
        let jobs = h.movables(|j| j.starts_with("small"));
        let plan = plan_moves(&m, occ, &jobs, &r, Strategy::BestFit, DefragLimits::default())
            .expect("a plan");
        let mut moved = keys(&plan);
        moved.sort_unstable();
        assert_eq!(moved, ["small1", "small2"]);
        assert_eq!(plan.placement.cpus, set("0-3,32-35"));
        for mv in &plan.moves {
            assert_eq!(mv.placement.cpus.len(), 1);
            assert!(!mv.placement.cpus.intersects(&set("0-3,32-35")));
        }
        // One move only: not enough.
        let one = DefragLimits { max_moves: 1, ..DefragLimits::default() };
        assert!(plan_moves(&m, occ, &jobs, &r, Strategy::BestFit, one).is_none());
    }

    #[test]
    fn a_malleable_job_moves_with_the_tasks_it_runs_with() {
        let m = machine();
        let mut h = four_free_per_node();
        // Replace C by a malleable job (2 to 8 tasks of one thread) running 4 tasks.
        h.ledger.release("C").unwrap();
        h.requests.retain(|(j, _)| j != "C");
        h.ledger
            .insert(Allocation {
                job: "C".into(),
                cpus: set("8-11"),
                tasks: (8..12).map(|c| std::iter::once(c).collect()).collect(),
                mems: CpuSet::new(),
                fenced: CpuSet::new(),
                request: String::new(),
                gang_row: None,
            })
            .unwrap();
        h.requests.push((
            "C".into(),
            Request { tasks: Some(2), tasks_max: Some(8), ..Request::default() },
        ));
        let jobs = h.movables(|_| true);
        let plan = plan_moves(
            &m,
            h.ledger.occupancy(),
            &jobs,
            &eight_in_one_node(),
            Strategy::BestFit,
            SIZES_ONLY,
        )
        .unwrap();
        assert_eq!(keys(&plan), ["C"]);
        assert_eq!(plan.moves[0].placement.tasks.len(), 4, "still 4 tasks, not the request's 2");
    }

    // ---- Property tests on real machines ----

    /// A host after a random stretch of the benchmark's job stream (with some jobs made
    /// exclusive, so that fences are in play), and the first arrival it refuses although enough
    /// PUs are free.
    fn fragmented(model: &HostModel, seed: u64) -> Option<(Host, Request)> {
        let mut rng = SplitMix::new(seed);
        let mut stream = bench::job_stream(model, seed, 600);
        for job in &mut stream {
            if job.request.unit == Level::Thread && rng.below(5) == 0 {
                job.request.cpuset_options.push(CpusetOption::CpuExclusive);
                job.pus = job.pus.div_ceil(model.threads_per_core) * model.threads_per_core;
            }
        }
        let capacity = model.allocatable.len();
        let target = capacity * (75 + rng.below(20) as usize) / 100;
        let mut host = Host::new();
        let mut running: Vec<(u64, String)> = Vec::new();
        for (i, job) in stream.iter().enumerate() {
            running.sort_by_key(|(end, _)| Reverse(*end));
            while host.ledger.occupancy().held.len() > target {
                let Some((_, id)) = running.pop() else { break };
                host.ledger.release(&id).unwrap();
                host.requests.retain(|(j, _)| *j != id);
            }
            let occ = host.ledger.occupancy();
            let free = occ.free(model).len();
            match place::place(model, occ, &job.request, Strategy::BestFit) {
                Ok(p) => {
                    let id = format!("j{i}");
                    host.ledger.allocate(&id, &p, "").unwrap();
                    host.requests.push((id.clone(), job.request.clone()));
                    running.push((i as u64 + u64::from(job.lifetime), id));
                }
                Err(e)
                    if i >= 40
                        && free >= job.pus
                        && !matches!(e, place::PlaceError::Impossible(_)) =>
                {
                    return Some((host, job.request.clone()));
                }
                Err(_) => {}
            }
        }
        None
    }

    /// Checks that `p` is a placement `request` allows on `model`, with `tasks` tasks.
    fn check_placement(
        model: &HostModel,
        request: &Request,
        tasks: usize,
        p: &Placement,
    ) -> Result<(), String> {
        if p.tasks.len() != tasks {
            return Err(format!("{} tasks, not {tasks}", p.tasks.len()));
        }
        if CpuSet::union_all(&p.tasks) != p.cpus
            || p.tasks.iter().map(|t| t.len()).sum::<usize>() != p.cpus.len()
        {
            return Err("tasks do not partition the CPUs".into());
        }
        if !p.cpus.is_subset(&model.allocatable) {
            return Err("CPUs outside the allocatable set".into());
        }
        let upt = request.units_per_task.max(1) as usize;
        for t in &p.tasks {
            let units = match request.unit {
                Level::Thread => t.len(),
                unit => {
                    let touched = model.touched(unit, t);
                    if touched.iter().any(|&d| !model.domains(unit)[d].is_subset(t)) {
                        return Err(format!("task {t} holds part of a {unit:?}"));
                    }
                    touched.len()
                }
            };
            if units != upt {
                return Err(format!("task {t} has {units} units, not {upt}"));
            }
            if let Some(same) = request.same.filter(|s| *s > request.unit) {
                if model.touched(same, t).len() != 1 {
                    return Err(format!("task {t} spans several {same:?} domains"));
                }
            }
        }
        let fence = match request.exclusive_level() {
            Some(level) => model.closure(level, &p.cpus).difference(&p.cpus),
            None => CpuSet::new(),
        };
        if p.fenced != fence {
            return Err(format!("fence {} instead of {fence}", p.fenced));
        }
        if let Some(h) = request.max_radius {
            let numa = model.touched(Level::Numa, &p.cpus);
            if model.hops(model.radius(&numa)) > h {
                return Err("beyond MAX_RADIUS".into());
            }
        }
        Ok(())
    }

    /// The documented procedure for one set, written again: the cost of the plan it gives.
    fn reference_cost(
        model: &HostModel,
        occ: &Occupancy,
        jobs: &[Movable<'_, String>],
        set: &[usize],
        r: &Request,
        keep_locality: bool,
    ) -> Option<(usize, usize)> {
        let mut occ = occ.clone();
        for &i in set {
            occ.held.difference_with(jobs[i].cpus);
            occ.fenced.difference_with(jobs[i].fenced);
        }
        let p = place::place(model, &occ, r, Strategy::BestFit).ok()?;
        add(&mut occ, &p);
        let mut order = set.to_vec();
        order.sort_by_key(|&i| (Reverse(jobs[i].cpus.len()), i));
        let (mut moves, mut pus) = (0, 0);
        for i in order {
            let req = Request {
                tasks: Some(jobs[i].tasks.len() as u32),
                tasks_max: None,
                ..jobs[i].request.clone()
            };
            let q = place::place(model, &occ, &req, Strategy::BestFit).ok()?;
            let (numa, l3) = spans(model, jobs[i].cpus);
            if keep_locality && (q.metrics.numa_nodes > numa || q.metrics.l3_groups > l3) {
                return None;
            }
            add(&mut occ, &q);
            if q.cpus != *jobs[i].cpus {
                moves += 1;
                pus += jobs[i].cpus.len();
            }
        }
        Some((moves, pus))
    }

    fn check_plan(model: &HostModel, seed: u64) -> Result<(), String> {
        let Some((host, r)) = fragmented(model, seed) else { return Ok(()) };
        let mut rng = SplitMix::new(seed ^ 0x5EED);
        let frozen: Vec<bool> = host.requests.iter().map(|_| rng.below(4) == 0).collect();
        let jobs: Vec<Movable<'_, String>> = host
            .requests
            .iter()
            .zip(&frozen)
            .map(|((job, req), frozen)| {
                Movable::from_allocation(job.clone(), req, host.ledger.get(job).unwrap(), !frozen)
            })
            .collect();
        let occ = host.ledger.occupancy();
        // Half the cases order plans by moves and PUs only.
        let limits = DefragLimits {
            max_evaluations: usize::MAX,
            keep_locality: seed % 2 == 0,
            ..DefragLimits::default()
        };
        let plan = plan_moves(model, occ, &jobs, &r, Strategy::BestFit, limits);

        // Optimality among single moves and pairs, against the procedure written again.
        let movable: Vec<usize> = (0..jobs.len()).filter(|&i| jobs[i].may_move).collect();
        let best_of = |sets: &mut dyn Iterator<Item = Vec<usize>>| {
            sets.filter_map(|s| reference_cost(model, occ, &jobs, &s, &r, limits.keep_locality))
                .min()
        };
        let single = best_of(&mut movable.iter().map(|&i| vec![i]));
        let pair = if single.is_none() && movable.len() <= limits.max_candidates {
            best_of(
                &mut movable
                    .iter()
                    .enumerate()
                    .flat_map(|(k, &a)| movable[k + 1..].iter().map(move |&b| vec![a, b])),
            )
        } else {
            None
        };
        if let Some(best) = single.or(pair) {
            let Some(plan) = &plan else { return Err(format!("no plan, but {best:?} works")) };
            let got = (plan.cost().moves, plan.moved_pus());
            let local =
                plan.placement.metrics.numa_optimal() && plan.placement.metrics.l3_optimal();
            // A larger plan only for the sake of the new job's locality.
            if got > best && !local {
                return Err(format!("plan costs {got:?}, but {best:?} works"));
            }
        }
        let Some(plan) = plan else { return Ok(()) };

        // The new job's placement is one its request allows.
        let tasks = r.tasks.unwrap_or(1) as usize;
        check_placement(model, &r, tasks, &plan.placement).map_err(|e| format!("new job: {e}"))?;
        // Each moved job: movable, really moved, placed as its own request allows, same tasks.
        let mut seen = BTreeSet::new();
        for mv in &plan.moves {
            let i = jobs.iter().position(|j| j.key == mv.key).ok_or("unknown key")?;
            if !seen.insert(i) {
                return Err(format!("{} moved twice", mv.key));
            }
            if !jobs[i].may_move {
                return Err(format!("{} may not move", mv.key));
            }
            if mv.placement.cpus == *jobs[i].cpus {
                return Err(format!("{} stays where it is but is listed", mv.key));
            }
            check_placement(model, jobs[i].request, jobs[i].tasks.len(), &mv.placement)
                .map_err(|e| format!("{}: {e}", mv.key))?;
            let (numa, l3) = spans(model, jobs[i].cpus);
            let m = &mv.placement.metrics;
            if limits.keep_locality && (m.numa_nodes > numa || m.l3_groups > l3) {
                return Err(format!("{} is less local than it was", mv.key));
            }
            let sizes = |t: &[CpuSet]| {
                let mut v: Vec<usize> = t.iter().map(|t| t.len()).collect();
                v.sort_unstable();
                v
            };
            // Same PUs per task (whole cores may differ in size on a hybrid machine).
            let same_cores = model.threads_per_core == 1 || jobs[i].request.unit == Level::Thread;
            if same_cores && sizes(&mv.placement.tasks) != sizes(jobs[i].tasks) {
                return Err(format!("{}: task sizes changed", mv.key));
            }
        }
        // The state the plan leads to: the ledger takes it (no CPU held twice, fences kept).
        let mut after = Ledger::new();
        for j in &jobs {
            let old = host.ledger.get(&j.key).unwrap();
            match plan.moves.iter().find(|m| m.key == j.key) {
                Some(m) => after.allocate(&j.key, &m.placement, "").map(drop),
                None => after.insert(old.clone()).map(drop),
            }
            .map_err(|e| format!("final state: {e}"))?;
        }
        after.allocate("new", &plan.placement, "").map_err(|e| format!("new job: {e}"))?;
        after.check()?;
        // Carried out one move at a time in the plan's order, when it says it can be.
        if plan.sequential {
            let mut live = host.ledger.clone();
            for m in &plan.moves {
                live.release(&m.key).unwrap();
                live.allocate(&m.key, &m.placement, "")
                    .map_err(|e| format!("move of {}: {e}", m.key))?;
            }
            live.allocate("new", &plan.placement, "")
                .map_err(|e| format!("new job after the moves: {e}"))?;
        }
        if plan.moves.len() > limits.max_moves {
            return Err(format!("{} moves", plan.moves.len()));
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn plans_on_the_dell_r740_are_valid(seed in 0u64..1_000_000) {
            let m = dell();
            if let Err(e) = check_plan(&m, seed) {
                prop_assert!(false, "seed {}: {}", seed, e);
            }
        }

        #[test]
        fn plans_on_a_four_thread_core_machine_are_valid(seed in 0u64..1_000_000) {
            let m = shared("converted-hwloc2.9/nvidiagpunumanodes.xml");
            if let Err(e) = check_plan(&m, seed) {
                prop_assert!(false, "seed {}: {}", seed, e);
            }
        }

        #[test]
        fn plans_on_a_sub_numa_knl_are_valid(seed in 0u64..1_000_000) {
            let m = shared("xml/64intel64-fakeKNL-SNC4-hybrid.xml");
            if let Err(e) = check_plan(&m, seed) {
                prop_assert!(false, "seed {}: {}", seed, e);
            }
        }
    }
}
