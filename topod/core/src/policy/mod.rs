//! Time policy: the rules topo applies to jobs over time, as pure functions of state and events.
//!
//! Two drivers run them, and they decide by the same code:
//!
//! - **The per-host rules** (this module): which running jobs a waiting one may suspend
//!   ([`Preempt`], [`victims_on_host`]), whose CPUs a suspended job lends and to whom
//!   ([`may_borrow`], [`holds_for_suspended`]), which gang row runs in which slice ([`Gang`],
//!   [`gang_runs`]), and where a request goes on one host ([`start_on_host`]). `topod` applies
//!   them to its host's cgroups; the cluster core below applies them to every host it models.
//! - **The cluster core** (`PolicyCore`, with the `sim` feature, on by default): a queue, FCFS
//!   or EASY backfilling over many hosts, malleable jobs, migration, reservations and
//!   prime-time pools, driven by `topoctl simulate` (`crate::sim`). The plug-ins loaded into
//!   the batch systems' daemons build topo-core without it.
//!
//! Nothing here reads a clock, sleeps or does I/O: times are the caller's (seconds, any origin).

use crate::cpuset::CpuSet;
use crate::defrag::DefragLimits;
use crate::place::{self, HostModel, Occupancy, PlaceError, Placement, Strategy};
use crate::request::{Level, Request};

/// Time in seconds, from the driver's origin.
pub type Time = i64;

/// A job, as the driver numbers it: a small dense integer (an index into the driver's table).
pub type JobKey = u32;

/// A host, by its index in the core's host list.
pub type HostId = u32;

/// Gang time slicing (the T3E's psched; Ousterhout's matrix): every host has `rows` rows, and a
/// job is started in one row, on every host it spans. Jobs of one row never share a CPU; jobs
/// of different rows may. Time is cut into slices of `slice` seconds, slice k starting at
/// k·`slice` from the origin of the caller's clock (the epoch, for topod), so hosts whose clocks
/// agree switch together without talking. In slice k the jobs of row k mod `rows` run, and so
/// does every job of another row whose CPUs none of those use (alternative scheduling,
/// Feitelson's term), the nearest rows first; the rest are frozen. See [`gang_runs`].
///
/// A job in a row runs at least one slice in every `rows`: backfilling plans with its estimate
/// times `rows`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gang {
    /// Slice length, seconds (at least 1).
    pub slice: Time,
    /// Rows per host: how many jobs may share a CPU (at least 1).
    pub rows: u32,
}

impl Gang {
    /// The slice `now` falls in.
    pub fn slice_at(&self, now: Time) -> i64 {
        now.div_euclid(self.slice.max(1))
    }

    /// The row whose slice `now` falls in.
    pub fn active_row(&self, now: Time) -> u32 {
        self.slice_at(now).rem_euclid(i64::from(self.rows.max(1))) as u32
    }

    /// When the slice after the one `now` falls in starts.
    pub fn next_boundary(&self, now: Time) -> Time {
        self.slice_at(now).saturating_add(1).saturating_mul(self.slice.max(1))
    }
}

/// A running job that may be suspended for another, on one host (see [`victims_on_host`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate<K> {
    /// The job.
    pub job: K,
    /// Its expansion factor now.
    pub xf: f64,
    /// Its CPUs on the host.
    pub cpus: CpuSet,
    /// What it fences there.
    pub fenced: CpuSet,
    /// What suspending it costs (its processors).
    pub procs: u32,
}

/// The running jobs to suspend on one host so that a job fits, by the rules of [`Preempt`]:
/// for each domain (every L3 group, then every NUMA node, package, the whole host), the
/// candidates that have CPUs in it, lowest expansion factor first, until `fits_in(domain,
/// occupancy without them)` says the job fits inside that domain, less any of them it fits
/// without; of all domains where that happens, the tightest level, then the fewest processors
/// suspended, then the lowest sum of expansion factors. Returns that key and the victims, or
/// `None` when no set does. Both
/// drivers call it: the cluster steps with a count of free cores, topod with a real placement.
pub fn victims_on_host<K: Clone>(
    model: &HostModel,
    occupancy: &Occupancy,
    candidates: &[Candidate<K>],
    fits_in: &mut dyn FnMut(&CpuSet, &Occupancy) -> bool,
) -> Option<((u8, u64, f64), Vec<K>)> {
    let mut by_xf: Vec<&Candidate<K>> = candidates.iter().collect();
    by_xf.sort_by(|a, b| a.xf.total_cmp(&b.xf));
    let whole = [model.allocatable.clone()];
    let levels: [(u8, &[CpuSet]); 4] = [
        (0, model.l3.as_slice()),
        (1, model.numa.as_slice()),
        (2, model.sockets.as_slice()),
        (3, &whole),
    ];
    let mut best: Option<((u8, u64, f64), Vec<K>)> = None;
    for (rank, domains) in levels {
        for domain in domains {
            let mut occ = occupancy.clone();
            if fits_in(domain, &occ) {
                // It fits there already: nobody need be suspended for it there.
                continue;
            }
            let mut chosen: Vec<&Candidate<K>> = Vec::new();
            let mut fits = false;
            for c in &by_xf {
                if !c.cpus.intersects(domain) {
                    continue;
                }
                occ.held.difference_with(&c.cpus);
                occ.fenced.difference_with(&c.fenced);
                chosen.push(c);
                if fits_in(domain, &occ) {
                    fits = true;
                    break;
                }
            }
            if !fits {
                continue;
            }
            // Keep none that is not needed: a job taken early for its low expansion factor may
            // free too little to matter once the later ones are taken (highest first goes back).
            for i in (0..chosen.len().saturating_sub(1)).rev() {
                let mut without = occupancy.clone();
                for (j, c) in chosen.iter().enumerate() {
                    if j != i {
                        without.held.difference_with(&c.cpus);
                        without.fenced.difference_with(&c.fenced);
                    }
                }
                if fits_in(domain, &without) {
                    chosen.remove(i);
                }
            }
            let cost = chosen.iter().map(|c| u64::from(c.procs)).sum::<u64>();
            let xf_sum = chosen.iter().map(|c| c.xf).sum::<f64>();
            let victims: Vec<K> = chosen.iter().map(|c| c.job.clone()).collect();
            let key = (rank, cost, xf_sum);
            let better = best.as_ref().is_none_or(|(k, _)| {
                (key.0, key.1).cmp(&(k.0, k.1)).then(key.2.total_cmp(&k.2)).is_lt()
            });
            if better {
                best = Some((key, victims));
            }
        }
    }
    best
}

/// A job in gang time slicing, for [`gang_runs`]: its row and its CPUs on each host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GangMember<'a> {
    /// Its row.
    pub row: u32,
    /// Its CPUs, per host.
    pub parts: &'a [(HostId, &'a CpuSet)],
}

/// Which of `members` run while row `active` of `rows` has the slice: every job of that row,
/// then each job of the rows after it in turn (`active`+1, `active`+2, ... modulo `rows`; in
/// the order given within a row) whose CPUs on every host it spans are used by no job chosen
/// before it. A multi-host job runs on all its hosts or none. No two jobs chosen share a CPU
/// when no two jobs of one row do. Both drivers call this: topod for one host at each slice
/// boundary, the simulator for the cluster.
pub fn gang_runs(active: u32, rows: u32, members: &[GangMember<'_>]) -> Vec<bool> {
    let rows = rows.max(1);
    // The CPUs of the jobs chosen so far, by host (hosts are small dense numbers): the one
    // part chosen there, by reference, until a second makes it a union of its own (most hosts
    // of a large cluster of small hosts hold one job, and a set is 72 bytes to copy).
    let hosts = members.iter().flat_map(|m| m.parts).map(|(h, _)| *h as usize + 1).max();
    let mut busy: Vec<Busy<'_>> = vec![Busy::Idle; hosts.unwrap_or(0)];
    let mut unions: Vec<CpuSet> = Vec::new();
    let mut runs = vec![false; members.len()];
    // Row by row from the active one, each in the order given (rows are few: a pass per row
    // costs less than sorting the members).
    for k in 0..rows {
        let row = (active % rows + k) % rows;
        for (i, m) in members.iter().enumerate().filter(|(_, m)| m.row % rows == row) {
            let clear = k == 0
                || m.parts.iter().all(|(h, cpus)| match busy[*h as usize] {
                    Busy::Idle => true,
                    Busy::One(b) => !b.intersects(cpus),
                    Busy::Union(u) => !unions[u].intersects(cpus),
                });
            if !clear {
                continue;
            }
            runs[i] = true;
            for &(h, cpus) in m.parts {
                let b = &mut busy[h as usize];
                *b = match *b {
                    Busy::Idle => Busy::One(cpus),
                    Busy::One(first) => {
                        unions.push(first.union(cpus));
                        Busy::Union(unions.len() - 1)
                    }
                    Busy::Union(u) => {
                        unions[u].union_with(cpus);
                        Busy::Union(u)
                    }
                };
            }
        }
    }
    runs
}

/// What [`gang_runs`] has chosen on one host so far.
#[derive(Debug, Clone, Copy)]
enum Busy<'a> {
    Idle,
    /// One job's CPUs there.
    One(&'a CpuSet),
    /// Several jobs', united in the set at this index.
    Union(usize),
}

/// When the core may suspend running jobs to start a waiting one (after NCI's PBS: whom to
/// suspend is chosen by expansion factor, and by where their CPUs are).
///
/// The expansion factor of a job is what its slowdown will be if nothing more happens to it:
/// (time since submission + estimated time still to run) ÷ estimate. The first waiting job may
/// preempt once its own is at least `min_xf`; the jobs suspended for it must each have a lower
/// one, have run `min_run` seconds since they last started, and have been suspended fewer than
/// `max_suspensions` times. Among the sets of such jobs whose suspension lets it start, the core
/// takes the one that frees the tightest domain (an L3 group before a NUMA node before a
/// package before a whole host), then the fewest processors, then the lowest expansion factors.
/// Suspended jobs resume on their own CPUs as soon as those are free, highest expansion factor
/// first, before any waiting job starts.
///
/// A suspended job's CPUs are held for it: its *resume-by* time is the estimated end of the job
/// it was suspended for ([`may_borrow`]). Another job may start on those CPUs only if it ends,
/// by its estimate, no later than that; and a job running on a suspended job's CPUs is not
/// suspended itself ([`holds_for_suspended`]), so that no chain of preemptions or stream of small
/// jobs keeps a victim frozen past the end of its preemptor's estimate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Preempt {
    /// Seconds a job runs after a start or resume before it may be suspended.
    pub min_run: Time,
    /// Suspensions per job at most.
    pub max_suspensions: u32,
    /// The expansion factor from which the first waiting job may preempt.
    pub min_xf: f64,
}

impl Default for Preempt {
    fn default() -> Self {
        Preempt { min_run: 300, max_suspensions: 2, min_xf: 2.0 }
    }
}

/// Why time rules of one host do not go together, in either driver (topod's configuration, the
/// simulator's `--policy`; each names its own settings before it): equipartition (topod's
/// `equipartition`, the simulator's `+malleable`) with preemption or gang slicing.
/// Equipartition grows malleable jobs into what is free, and CPUs held for a suspended job's
/// resume or shared by another gang row look free. `None` when the rules go together.
///
/// The simulator refuses more than this (migration, reservations and prime-time pools with
/// preemption or gang slicing; preemption with gang slicing): those are combinations its
/// cluster core does not model, which topod runs.
pub fn rules_conflict(preempt: bool, gang: bool, equipartition: bool) -> Option<&'static str> {
    (equipartition && (preempt || gang)).then_some(
        "equipartition would resize malleable jobs onto CPUs held for a suspended job's resume or shared by another gang row",
    )
}

/// Defragmenting migration (see the cluster core's documentation): when a job is refused on shape
/// although enough cores are free, running jobs are moved by [`crate::defrag::plan_moves`] within
/// `limits`, but not a job that has run less than `min_run` seconds, nor one moved or resized
/// within the last `gap` seconds (topod's `migrate_min_run_s` and `migrate_gap_s`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Defrag {
    /// Seconds a job runs before it may be moved.
    pub min_run: Time,
    /// Seconds after a move or resize before the job may be moved again.
    pub gap: Time,
    /// How far the planner may go.
    pub limits: DefragLimits,
}

impl Default for Defrag {
    /// 60 s, 300 s and the planner's own limits (up to 4 moves), as topod's defaults.
    fn default() -> Self {
        Defrag { min_run: 60, gap: 300, limits: DefragLimits::default() }
    }
}

impl Defrag {
    /// Whether a job with `clock` (protected from its start, or its resume after preemption:
    /// [`RunClock::protected_from`]), last moved or resized at `moved_at`, may be moved at
    /// `now`. A job whose start is not known counts as starting now. topod and the policy core
    /// both decide by this.
    pub fn may_move(&self, now: Time, clock: &RunClock, moved_at: Option<Time>) -> bool {
        self.kept_in_place(now, clock, moved_at).is_none()
    }

    /// Why a job with `clock`, last moved or resized at `moved_at`, may not be moved at `now`
    /// ([`may_move`](Self::may_move)); `None` when it may. A recent move is said first.
    pub fn kept_in_place(
        &self,
        now: Time,
        clock: &RunClock,
        moved_at: Option<Time>,
    ) -> Option<NotMovable> {
        if let Some(ago) = moved_at.map(|t| now.saturating_sub(t)).filter(|&ago| ago < self.gap) {
            return Some(NotMovable::MovedRecently { ago, gap: self.gap });
        }
        let ran = now.saturating_sub(clock.protected_from().unwrap_or(now));
        (ran < self.min_run).then_some(NotMovable::TooEarly { ran, min_run: self.min_run })
    }

    /// The time from which [`may_move`](Self::may_move) holds for a job with `clock`, last
    /// moved or resized at `moved_at` (a job whose start is not known, as one whose start topod
    /// did not see, counts as starting at every look, so it never may while `min_run` is above
    /// 0); [`Time::MAX`] for never. What topod tells schedulers (its `free_map`'s `moves`), so
    /// that they decide as it will.
    pub fn movable_from(&self, clock: &RunClock, moved_at: Option<Time>) -> Time {
        let run = match clock.protected_from() {
            Some(since) => since.saturating_add(self.min_run),
            None if self.min_run > 0 => return Time::MAX,
            None => Time::MIN,
        };
        run.max(moved_at.map_or(Time::MIN, |t| t.saturating_add(self.gap)))
    }
}

/// Why migration may not move a job yet ([`Defrag::kept_in_place`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotMovable {
    /// It was moved or resized `ago` seconds ago, less than [`Defrag::gap`].
    MovedRecently {
        /// Seconds since its last move or resize.
        ago: Time,
        /// The least time between two moves of a job.
        gap: Time,
    },
    /// It has run `ran` seconds since its start (or its resume after preemption), less than
    /// [`Defrag::min_run`].
    TooEarly {
        /// Seconds it has counted as running.
        ran: Time,
        /// The least run before a first move.
        min_run: Time,
    },
}

/// A job's expansion factor: (time in the system + estimated time still to run) ÷ estimate, the
/// estimate counting as at least a second. Time suspended counts as time in the system. Who may
/// preempt whom, and the order suspended jobs resume in, go by it; topod and the policy core both
/// compute it here.
pub fn expansion_factor(in_system: Time, to_run: Time, estimate: Time) -> f64 {
    in_system.max(0).saturating_add(to_run.max(0)) as f64 / estimate.max(1) as f64
}

/// A job suspended on a host, as the resume step ([`resume_preempted`]) sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToResume<K> {
    /// The job.
    pub job: K,
    /// Its expansion factor now (suspended time counts; 0 without one).
    pub xf: f64,
    /// Preemption suspended it. A job its owner or root suspended runs again when they say.
    pub by_preemption: bool,
    /// What only its host knows keeps it suspended for now (its preemptor is being placed, it
    /// is being released or changed).
    pub kept: bool,
}

/// The jobs suspended by preemption that run again now: those neither their owner suspended nor
/// their host keeps, tried highest expansion factor first, ties by job (so both drivers resume
/// alike); each resumes if `try_resume` says it did (its CPUs are free again and no other
/// suspended job holds them), after those before it took theirs. topod calls this when CPUs come
/// free; the cluster core at every event.
pub fn resume_preempted<K: Ord>(
    suspended: impl IntoIterator<Item = ToResume<K>>,
    mut try_resume: impl FnMut(&K) -> bool,
) -> Vec<K> {
    let mut order: Vec<(K, f64)> = suspended
        .into_iter()
        .filter(|s| s.by_preemption && !s.kept)
        .map(|s| (s.job, s.xf))
        .collect();
    order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    order.into_iter().map(|(job, _)| job).filter(|job| try_resume(job)).collect()
}

/// Why a running job may not be suspended for a waiting job (the rules of [`Preempt`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Spared {
    /// It has run `ran` seconds since its start or its resume after preemption, fewer than
    /// `min_run`.
    TooEarly {
        /// Seconds it has run.
        ran: Time,
        /// [`Preempt::min_run`].
        min_run: Time,
    },
    /// Preemption has suspended it `times` times already, `max` at most.
    SuspendedEnough {
        /// Suspensions by preemption so far.
        times: u32,
        /// [`Preempt::max_suspensions`].
        max: u32,
    },
    /// It holds CPUs a job suspended by preemption waits for ([`holds_for_suspended`]).
    HoldsForSuspended(String),
    /// It has no expansion factor (no submission time or no estimate).
    NoExpansionFactor,
    /// Its expansion factor is not below the waiting job's.
    NotLower {
        /// Its expansion factor.
        xf: f64,
        /// The waiting job's.
        for_xf: f64,
    },
}

/// Whether a running job may be suspended for a waiting job whose expansion factor is
/// `for_xf`: `None` when it may, else the first rule that spares it. `ran` is the time since
/// its start or its last resume after preemption, `suspensions` how often preemption suspended
/// it, `xf` its expansion factor; `holds` says whether it holds CPUs a suspended job waits for
/// (asked last: the costliest). topod and the policy core both decide by this; topod adds what
/// only a host knows (a job that did not say it is preemptible, a gang job, one being changed).
pub fn spared(
    rules: &Preempt,
    ran: Time,
    suspensions: u32,
    xf: Option<f64>,
    for_xf: f64,
    holds: impl FnOnce() -> Option<String>,
) -> Option<Spared> {
    if ran < rules.min_run {
        return Some(Spared::TooEarly { ran, min_run: rules.min_run });
    }
    if suspensions >= rules.max_suspensions {
        return Some(Spared::SuspendedEnough { times: suspensions, max: rules.max_suspensions });
    }
    match xf {
        None => return Some(Spared::NoExpansionFactor),
        Some(xf) if xf >= for_xf => return Some(Spared::NotLower { xf, for_xf }),
        Some(_) => {}
    }
    holds().map(Spared::HoldsForSuspended)
}

/// Whether a job that ends (by its estimate) at `ends_by` may start on the CPUs held for a job
/// suspended by preemption that may resume at `resume_by` (its preemptor's estimated end; see
/// [`Preempt`]). A job without an estimate (`None`), or a suspended job whose preemptor has none,
/// lends nothing. topod and the policy core both decide by this.
pub fn may_borrow(ends_by: Option<Time>, resume_by: Option<Time>) -> bool {
    matches!((ends_by, resume_by), (Some(end), Some(by)) if end <= by)
}

/// Why a running job may not be suspended because it holds CPUs a suspended job waits for, or
/// `None`: `suspended` lists (job, CPUs) of the jobs suspended by preemption on the host, `cpus`
/// the running job's. Suspending it would push the suspended job's resume past its resume-by
/// time ([`Preempt`]). topod and the policy core both decide by this.
pub fn holds_for_suspended<'a, K: std::fmt::Display + 'a>(
    cpus: &CpuSet,
    suspended: impl IntoIterator<Item = (K, &'a CpuSet)>,
) -> Option<String> {
    suspended.into_iter().find(|(_, held)| held.intersects(cpus)).map(|(job, held)| {
        format!(
            "it runs on CPUs {} held for job {job}, suspended by preemption",
            held.intersection(cpus)
        )
    })
}

/// A running job in the way of a waiting one on one host, as preemption sees it (see
/// [`preemption_on_host`]).
#[derive(Debug, Clone, PartialEq)]
pub struct InTheWay<K> {
    /// The job.
    pub job: K,
    /// Its CPUs on the host.
    pub cpus: CpuSet,
    /// What it fences there.
    pub fenced: CpuSet,
    /// What suspending it costs (its processors).
    pub procs: u32,
    /// Seconds since its start or its last resume after preemption.
    pub ran: Time,
    /// How often preemption (never its owner) suspended it.
    pub suspensions: u32,
    /// Its expansion factor now; `None` without a submission time and estimate.
    pub xf: Option<f64>,
    /// Why its host keeps it running whatever the rules say (it did not say it may be
    /// suspended, it is gang-scheduled or being changed), asked before the rules.
    pub kept: Option<String>,
}

/// Why a running job is not suspended for a waiting one.
#[derive(Debug, Clone, PartialEq)]
pub enum Kept {
    /// What only its host knows ([`InTheWay::kept`]).
    Host(String),
    /// A rule of [`Preempt`] ([`spared`]).
    Rule(Spared),
}

/// Why a waiting job suspends nobody on a host: each driver words it for its users (topod in the
/// refusal its client gets).
#[derive(Debug, Clone, PartialEq)]
pub enum NotPreempted<K> {
    /// The waiting job gave no submission time or estimate: it has no expansion factor.
    NoExpansionFactor,
    /// Its expansion factor is below [`Preempt::min_xf`].
    BelowThreshold {
        /// Its expansion factor.
        xf: f64,
        /// [`Preempt::min_xf`].
        min_xf: f64,
    },
    /// No running job holds CPUs it may use.
    NothingInTheWay,
    /// Every job in its way is kept running, each with why.
    AllKept(Vec<(K, Kept)>),
    /// Suspending every job that may be suspended for it frees no place it fits: those jobs.
    FreesNoPlace(Vec<K>),
}

/// The expansion factor `xf` of the first waiting job when it may preempt at all (at least
/// [`Preempt::min_xf`]), or why not. The first step of preemption in both drivers.
pub fn may_preempt<K>(rules: &Preempt, xf: Option<f64>) -> Result<f64, NotPreempted<K>> {
    match xf {
        None => Err(NotPreempted::NoExpansionFactor),
        Some(xf) if xf < rules.min_xf => {
            Err(NotPreempted::BelowThreshold { xf, min_xf: rules.min_xf })
        }
        Some(xf) => Ok(xf),
    }
}

/// Which of the jobs `in_the_way` may be suspended for a waiting job whose expansion factor is
/// `for_xf` (what the host keeps first, then [`spared`]; `holds` is [`holds_for_suspended`] for
/// a job, asked last), in the order given; or why none may.
pub fn preemption_candidates<K: Clone>(
    rules: &Preempt,
    for_xf: f64,
    in_the_way: impl IntoIterator<Item = InTheWay<K>>,
    holds: impl Fn(&K) -> Option<String>,
) -> Result<Vec<Candidate<K>>, NotPreempted<K>> {
    let mut candidates = Vec::new();
    let mut kept = Vec::new();
    for j in in_the_way {
        if let Some(why) = j.kept {
            kept.push((j.job, Kept::Host(why)));
            continue;
        }
        if let Some(why) = spared(rules, j.ran, j.suspensions, j.xf, for_xf, || holds(&j.job)) {
            kept.push((j.job, Kept::Rule(why)));
            continue;
        }
        candidates.push(Candidate {
            job: j.job,
            xf: j.xf.unwrap_or(0.0),
            cpus: j.cpus,
            fenced: j.fenced,
            procs: j.procs,
        });
    }
    match (candidates.is_empty(), kept.is_empty()) {
        (false, _) => Ok(candidates),
        (true, true) => Err(NotPreempted::NothingInTheWay),
        (true, false) => Err(NotPreempted::AllKept(kept)),
    }
}

/// The jobs to suspend on one host so that a waiting job whose expansion factor is `for_xf`
/// (from [`may_preempt`]) fits there: [`preemption_candidates`] of `in_the_way`, then
/// [`victims_on_host`] over them; the victims, or why there are none. topod calls this for its
/// host; the cluster core takes the same first two steps and chooses among its hosts.
#[allow(clippy::too_many_arguments)]
pub fn preemption_on_host<K: Clone>(
    rules: &Preempt,
    for_xf: f64,
    in_the_way: impl IntoIterator<Item = InTheWay<K>>,
    holds: impl Fn(&K) -> Option<String>,
    model: &HostModel,
    occupancy: &Occupancy,
    fits_in: &mut dyn FnMut(&CpuSet, &Occupancy) -> bool,
) -> Result<Vec<K>, NotPreempted<K>> {
    let candidates = preemption_candidates(rules, for_xf, in_the_way, holds)?;
    victims_on_host(model, occupancy, &candidates, fits_in)
        .map(|(_, victims)| victims)
        .ok_or_else(|| NotPreempted::FreesNoPlace(candidates.into_iter().map(|c| c.job).collect()))
}

/// The host decision: where `request` goes on one host, by `strategy`. `topod` allocates
/// through this; the cluster steps place every part of every job through it.
pub fn start_on_host(
    model: &HostModel,
    occupancy: &Occupancy,
    request: &Request,
    strategy: Strategy,
) -> Result<Placement, PlaceError> {
    place::place(model, occupancy, request, strategy)
}

/// The request for `cores` whole cores on one host, one task each (an MPI rank per processor).
pub fn cores_request(cores: u32) -> Request {
    Request { tasks: Some(cores), unit: Level::Core, ..Request::default() }
}

mod clock;
pub use clock::{RunClock, Stopper};

#[cfg(feature = "sim")]
pub(crate) mod cluster;
#[cfg(feature = "sim")]
mod profile;
#[cfg(feature = "sim")]
mod queue;
#[cfg(feature = "sim")]
pub use cluster::*;

#[cfg(test)]
mod timer_tests {
    use super::*;

    #[test]
    fn why_a_job_is_kept_in_place_names_the_timer_that_keeps_it() {
        let d = Defrag { min_run: 60, gap: 300, limits: DefragLimits::default() };
        let clock = RunClock::started(1_000);
        assert_eq!(
            d.kept_in_place(1_030, &clock, None),
            Some(NotMovable::TooEarly { ran: 30, min_run: 60 })
        );
        // A recent move is said first, also when the job is young too.
        assert_eq!(
            d.kept_in_place(1_030, &clock, Some(1_010)),
            Some(NotMovable::MovedRecently { ago: 20, gap: 300 })
        );
        assert_eq!(d.kept_in_place(1_400, &clock, Some(1_010)), None);
        // A start topod did not see counts as now.
        assert_eq!(
            d.kept_in_place(5_000, &RunClock::default(), None),
            Some(NotMovable::TooEarly { ran: 0, min_run: 60 })
        );
    }

    #[test]
    fn a_job_is_movable_from_exactly_the_time_may_move_says() {
        for (min_run, gap) in [(60, 300), (0, 300), (60, 0), (0, 0)] {
            let d = Defrag { min_run, gap, limits: DefragLimits::default() };
            for since in [None, Some(1_000)] {
                let clock = since.map_or_else(RunClock::default, RunClock::started);
                for moved_at in [None, Some(900), Some(1_020), Some(1_500)] {
                    let from = d.movable_from(&clock, moved_at);
                    for now in (900..2_000).step_by(10) {
                        let may = d.may_move(now, &clock, moved_at);
                        assert_eq!(
                            now >= from,
                            may,
                            "min_run {min_run} gap {gap} since {since:?} moved {moved_at:?} now {now}"
                        );
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod preemption_tests {
    use super::*;

    fn job(
        name: &'static str,
        ran: Time,
        suspensions: u32,
        xf: Option<f64>,
    ) -> InTheWay<&'static str> {
        InTheWay {
            job: name,
            cpus: CpuSet::new(),
            fenced: CpuSet::new(),
            procs: 1,
            ran,
            suspensions,
            xf,
            kept: None,
        }
    }

    #[test]
    fn a_waiting_job_preempts_only_from_the_threshold_and_with_an_expansion_factor() {
        let rules = Preempt { min_run: 300, max_suspensions: 2, min_xf: 2.0 };
        assert_eq!(may_preempt::<()>(&rules, None), Err(NotPreempted::NoExpansionFactor));
        assert_eq!(
            may_preempt::<()>(&rules, Some(1.99)),
            Err(NotPreempted::BelowThreshold { xf: 1.99, min_xf: 2.0 })
        );
        assert_eq!(may_preempt::<()>(&rules, Some(2.0)), Ok(2.0));
    }

    /// What the host keeps comes before the rules, the rules before `holds` (asked only of a
    /// job the rules would suspend), and the candidates keep the order given.
    #[test]
    fn candidates_are_the_jobs_neither_the_host_nor_a_rule_keeps() {
        let rules = Preempt { min_run: 300, max_suspensions: 2, min_xf: 2.0 };
        assert_eq!(
            preemption_candidates(&rules, 3.0, Vec::<InTheWay<&str>>::new(), |_| None),
            Err(NotPreempted::NothingInTheWay)
        );
        let mut gang = job("gang", 1_000, 0, Some(1.0));
        gang.kept = Some("gang-scheduled".into());
        let jobs = vec![
            gang,
            job("young", 299, 0, Some(1.0)),
            job("tired", 1_000, 2, Some(1.0)),
            job("urgent", 1_000, 0, Some(3.0)),
            job("unknown", 1_000, 0, None),
            job("holder", 1_000, 0, Some(1.0)),
            job("b", 1_000, 1, Some(1.5)),
            job("a", 300, 0, Some(1.0)),
        ];
        let asked: std::cell::RefCell<Vec<&'static str>> = std::cell::RefCell::default();
        let holds = |j: &&'static str| {
            asked.borrow_mut().push(*j);
            (*j == "holder").then(|| "its preemptor waits".to_string())
        };
        let got = preemption_candidates(&rules, 3.0, jobs.clone(), holds).unwrap();
        assert_eq!(got.iter().map(|c| (c.job, c.xf)).collect::<Vec<_>>(), [("b", 1.5), ("a", 1.0)]);
        assert_eq!(*asked.borrow(), ["holder", "b", "a"]);
        // Without the two the rules suspend, every job is kept, each with why.
        let kept = preemption_candidates(&rules, 3.0, jobs[..6].to_vec(), |j: &&str| {
            (*j == "holder").then(|| "its preemptor waits".to_string())
        });
        let Err(NotPreempted::AllKept(kept)) = kept else { panic!("{kept:?}") };
        assert_eq!(
            kept,
            [
                ("gang", Kept::Host("gang-scheduled".into())),
                ("young", Kept::Rule(Spared::TooEarly { ran: 299, min_run: 300 })),
                ("tired", Kept::Rule(Spared::SuspendedEnough { times: 2, max: 2 })),
                ("urgent", Kept::Rule(Spared::NotLower { xf: 3.0, for_xf: 3.0 })),
                ("unknown", Kept::Rule(Spared::NoExpansionFactor)),
                ("holder", Kept::Rule(Spared::HoldsForSuspended("its preemptor waits".into()))),
            ]
        );
    }

    /// Only jobs preemption suspended and their host does not keep are tried, highest expansion
    /// factor first and ties by job; those `try_resume` turns down stay suspended.
    #[test]
    fn suspended_jobs_resume_by_expansion_factor_and_only_preemptions_victims() {
        let s = |job: &'static str, xf: f64, by_preemption: bool, kept: bool| ToResume {
            job,
            xf,
            by_preemption,
            kept,
        };
        let suspended = [
            s("low", 1.0, true, false),
            s("b", 2.0, true, false),
            s("a", 2.0, true, false),
            s("owners", 9.0, false, false),
            s("placing", 8.0, true, true),
            s("high", 3.0, true, false),
        ];
        let mut tried = Vec::new();
        let resumed = resume_preempted(suspended, |job| {
            tried.push(*job);
            *job != "a"
        });
        assert_eq!(tried, ["high", "a", "b", "low"]);
        assert_eq!(resumed, ["high", "b", "low"]);
    }
}
