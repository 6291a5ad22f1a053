//! Equipartition: how malleable jobs on one host share the PUs rigid jobs leave them.
//!
//! ## The model
//!
//! A malleable job runs with any number of tasks in its range `min..=max` and may be resized
//! while it runs (Charm++'s shrink and expand; topo's `*min-max` requests). Each of its tasks
//! takes `pus_per_task` PUs (processing units: whatever the caller counts in, hardware threads
//! for topod, whole cores for the simulator). [`equipartition`] decides how many tasks each job
//! gets out of `free_pus`, the PUs the rigid jobs of the host leave:
//!
//! 1. every job gets its `min` tasks; when those do not fit, there is no answer
//!    ([`EquipartitionError::MinsDoNotFit`]) and the caller must not admit the last job;
//! 2. the rest is shared so that the jobs end up with equal numbers of PUs, as far as their
//!    ranges and task sizes allow: equal *totals*, not equal shares on top of the minimums, so a
//!    job whose `min` is above the equal share keeps its `min` and the others share the rest;
//! 3. a job capped at its `max` takes no more, and what it leaves is shared by the others.
//!
//! This is the equipartition of McCann, Vaswani and Zahorjan ("A dynamic processor allocation
//! policy for multiprogrammed shared-memory multiprocessors", ACM TOCS 11(2), 1993): every job
//! an equal share of the processors, a job that wants fewer than its share keeps only what it
//! wants, the rest redistributed; the Charm++ malleable-job scheduler (Kalé, Kumar and DeSouza,
//! "A malleable-job system for timeshared parallel machines", CCGrid 2002) shares the same way.
//! topo adds the minimums (a job is never shrunk below the tasks it asked for at least) and the
//! task sizes (PUs are given a whole task at a time).
//!
//! Precisely, the answer is what this greedy procedure gives: start every job at its `min`;
//! then, over and over, take the job holding the fewest PUs among those below their `max`
//! (equal holdings: the job that comes first in the slice), and give it one more task if that
//! task fits in the PUs still unshared, or else leave that job where it is for good; stop when
//! no job is left to consider. With tasks of one size this is water-filling: no job below its
//! `max` holds two tasks fewer than a job above its `min`. [`equipartition`] computes the same
//! answer in steps of whole levels, so its cost does not grow with the PU count.
//!
//! The order of the slice breaks ties: the caller passes jobs in a fixed order (topod and the
//! policy core: the order the jobs started in), so equal jobs are treated the same way at every
//! rebalance and a leftover task does not hop between them.

/// One malleable job, as [`equipartition`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malleable {
    /// The fewest tasks it runs with (at least 1).
    pub min: u32,
    /// The most tasks it runs with (at least `min`).
    pub max: u32,
    /// PUs each of its tasks takes (at least 1).
    pub pus_per_task: u32,
}

impl Malleable {
    /// PUs of `tasks` tasks of this job.
    pub fn pus(&self, tasks: u32) -> u64 {
        u64::from(tasks) * u64::from(self.pus_per_task)
    }
}

/// Why there is no equipartition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EquipartitionError {
    /// A job's range is empty or starts at zero tasks.
    #[error(
        "malleable job {index}: the range {min}-{max} tasks is not a range of at least one task"
    )]
    BadRange {
        /// Its position in the slice.
        index: usize,
        /// Its least task count.
        min: u32,
        /// Its largest task count.
        max: u32,
    },
    /// A job's tasks take no PU.
    #[error("malleable job {index}: a task of no PU")]
    EmptyTask {
        /// Its position in the slice.
        index: usize,
    },
    /// The jobs' minimums need more PUs than are free.
    #[error("the malleable jobs need {needed} PUs at their least sizes; {free} are free")]
    MinsDoNotFit {
        /// PUs of every job at its `min`.
        needed: u64,
        /// PUs free.
        free: u32,
    },
}

/// Tasks per job (in the order of `jobs`) when `jobs` share `free_pus` by equipartition (see the
/// module documentation). Every answer is within its job's range and the answers' PUs add up to
/// at most `free_pus`.
pub fn equipartition(free_pus: u32, jobs: &[Malleable]) -> Result<Vec<u32>, EquipartitionError> {
    for (index, j) in jobs.iter().enumerate() {
        if j.min == 0 || j.min > j.max {
            return Err(EquipartitionError::BadRange { index, min: j.min, max: j.max });
        }
        if j.pus_per_task == 0 {
            return Err(EquipartitionError::EmptyTask { index });
        }
    }
    let needed: u64 = jobs.iter().map(|j| j.pus(j.min)).sum();
    if needed > u64::from(free_pus) {
        return Err(EquipartitionError::MinsDoNotFit { needed, free: free_pus });
    }
    let mut tasks: Vec<u32> = jobs.iter().map(|j| j.min).collect();
    let mut left = u64::from(free_pus) - needed;
    // Jobs still considered: below their max and not yet refused a task for want of room.
    let mut open: Vec<usize> = (0..jobs.len()).filter(|&i| jobs[i].min < jobs[i].max).collect();
    while !open.is_empty() {
        // Every grant the greedy procedure would make below this level fits at once (the room
        // left only shrinks, so none of them would have been refused): make them together.
        let level = highest_affordable_level(jobs, &tasks, &open, left);
        for &i in &open {
            let after = tasks_at_level(&jobs[i], tasks[i], level);
            left -= jobs[i].pus(after - tasks[i]);
            tasks[i] = after;
        }
        open.retain(|&i| tasks[i] < jobs[i].max);
        // The greedy procedure's next step: the poorest open job (first in the slice on ties)
        // gets one task, or is left where it is for good when the task does not fit.
        let Some(pos) = (0..open.len()).min_by_key(|&p| (jobs[open[p]].pus(tasks[open[p]]), p))
        else {
            break;
        };
        let i = open[pos];
        if u64::from(jobs[i].pus_per_task) <= left {
            left -= u64::from(jobs[i].pus_per_task);
            tasks[i] += 1;
            if tasks[i] == jobs[i].max {
                open.remove(pos);
            }
        } else {
            open.remove(pos);
        }
    }
    Ok(tasks)
}

/// Tasks of `job` (now `now` tasks) once it has every grant below `level` PUs: a grant from `k`
/// tasks happens below the level when `k` tasks' PUs are below it.
fn tasks_at_level(job: &Malleable, now: u32, level: u64) -> u32 {
    let want = level.div_ceil(u64::from(job.pus_per_task));
    u32::try_from(want).unwrap_or(u32::MAX).clamp(now, job.max)
}

/// PUs the `open` jobs take from `left` to reach `level`.
fn cost_of_level(jobs: &[Malleable], tasks: &[u32], open: &[usize], level: u64) -> u128 {
    open.iter()
        .map(|&i| {
            let more = tasks_at_level(&jobs[i], tasks[i], level) - tasks[i];
            u128::from(jobs[i].pus(more))
        })
        .sum()
}

/// The highest PU level every open job can be raised to within `left` (binary search: the cost
/// only grows with the level).
fn highest_affordable_level(jobs: &[Malleable], tasks: &[u32], open: &[usize], left: u64) -> u64 {
    let (mut low, mut high) =
        (0u64, open.iter().map(|&i| jobs[i].pus(jobs[i].max)).max().unwrap_or(0));
    // Invariant: `low` is affordable; above `high` nothing more is granted.
    while low < high {
        let mid = low + (high - low).div_ceil(2);
        if cost_of_level(jobs, tasks, open, mid) <= u128::from(left) {
            low = mid;
        } else {
            high = mid - 1;
        }
    }
    low
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn job(min: u32, max: u32, pus_per_task: u32) -> Malleable {
        Malleable { min, max, pus_per_task }
    }

    /// The greedy procedure of the module documentation, one task at a time.
    fn one_task_at_a_time(free: u32, jobs: &[Malleable]) -> Option<Vec<u32>> {
        let needed: u64 = jobs.iter().map(|j| j.pus(j.min)).sum();
        let mut left = u64::from(free).checked_sub(needed)?;
        let mut tasks: Vec<u32> = jobs.iter().map(|j| j.min).collect();
        let mut open: Vec<bool> = jobs.iter().map(|j| j.min < j.max).collect();
        while let Some(i) =
            (0..jobs.len()).filter(|&i| open[i]).min_by_key(|&i| (jobs[i].pus(tasks[i]), i))
        {
            if u64::from(jobs[i].pus_per_task) <= left {
                left -= u64::from(jobs[i].pus_per_task);
                tasks[i] += 1;
                open[i] = tasks[i] < jobs[i].max;
            } else {
                open[i] = false;
            }
        }
        Some(tasks)
    }

    #[test]
    fn equal_jobs_share_equally_and_the_first_ones_take_the_leftover() {
        let three = [job(1, 16, 1); 3];
        assert_eq!(equipartition(16, &three).unwrap(), vec![6, 5, 5]);
        assert_eq!(equipartition(15, &three).unwrap(), vec![5, 5, 5]);
        assert_eq!(equipartition(0, &[]).unwrap(), Vec::<u32>::new());
    }

    #[test]
    fn a_capped_job_leaves_its_share_to_the_others() {
        let jobs = [job(1, 2, 1), job(1, 16, 1), job(1, 16, 1)];
        assert_eq!(equipartition(16, &jobs).unwrap(), vec![2, 7, 7]);
        // Everyone capped: PUs stay free.
        assert_eq!(equipartition(100, &jobs).unwrap(), vec![2, 16, 16]);
    }

    #[test]
    fn a_large_minimum_is_kept_and_the_rest_shared_to_equal_totals() {
        // Equal totals, not equal extras: 8 + 4, not 8 + something on top of both minimums.
        let jobs = [job(8, 8, 1), job(1, 16, 1)];
        assert_eq!(equipartition(12, &jobs).unwrap(), vec![8, 4]);
        let jobs = [job(6, 16, 1), job(1, 16, 1)];
        assert_eq!(equipartition(16, &jobs).unwrap(), vec![8, 8]);
        assert_eq!(equipartition(10, &jobs).unwrap(), vec![6, 4]);
    }

    #[test]
    fn tasks_of_several_pus_are_given_whole() {
        // Job 0: tasks of 4 PUs. At 4 PUs each, job 0 comes first and goes to 8; job 1 follows
        // to 8; nothing is left for a third task of job 0.
        let jobs = [job(1, 4, 4), job(1, 16, 1)];
        assert_eq!(equipartition(16, &jobs).unwrap(), vec![2, 8]);
        // 15 PUs: job 0's second task (4 PUs) fits at level 4, then job 1 takes 7.
        assert_eq!(equipartition(15, &jobs).unwrap(), vec![2, 7]);
        // A task too large for what is left does not stop the others.
        let jobs = [job(1, 3, 8), job(1, 20, 1)];
        assert_eq!(equipartition(20, &jobs).unwrap(), vec![1, 12]);
    }

    #[test]
    fn minimums_that_do_not_fit_and_bad_ranges_are_refused() {
        assert_eq!(
            equipartition(10, &[job(4, 8, 2), job(3, 3, 1)]).unwrap_err(),
            EquipartitionError::MinsDoNotFit { needed: 11, free: 10 }
        );
        assert_eq!(
            equipartition(10, &[job(1, 2, 1), job(3, 2, 1)]).unwrap_err(),
            EquipartitionError::BadRange { index: 1, min: 3, max: 2 }
        );
        assert_eq!(
            equipartition(10, &[job(0, 2, 1)]).unwrap_err(),
            EquipartitionError::BadRange { index: 0, min: 0, max: 2 }
        );
        assert_eq!(
            equipartition(10, &[job(1, 2, 0)]).unwrap_err(),
            EquipartitionError::EmptyTask { index: 0 }
        );
    }

    #[test]
    fn huge_counts_take_no_time_and_do_not_overflow() {
        let jobs = [job(1, u32::MAX, 1), job(1, 8, 1 << 30), job(2, 1 << 20, 4096)];
        let tasks = equipartition(u32::MAX, &jobs).unwrap();
        let used: u64 = jobs.iter().zip(&tasks).map(|(j, t)| j.pus(*t)).sum();
        // Job 0 takes single PUs up to any count: nothing is left idle.
        assert_eq!(used, u64::from(u32::MAX));
        // Three jobs near a third each (job 1 in tasks of 2^30 PUs).
        assert!(tasks.iter().zip(&jobs).all(|(t, j)| j.pus(*t) >= 1 << 30), "{tasks:?}");
        assert_eq!(equipartition(u32::MAX, &[job(1, u32::MAX, 1); 3]).unwrap()[0], 1_431_655_765);
    }

    fn jobs_strategy(unit: u32) -> impl Strategy<Value = Vec<Malleable>> {
        proptest::collection::vec(
            (1u32..6, 0u32..20, 1u32..=unit).prop_map(|(min, extra, u)| job(min, min + extra, u)),
            0..7,
        )
    }

    proptest! {
        #[test]
        fn the_answer_is_the_greedy_procedure_and_fair(
            free in 0u32..120,
            jobs in jobs_strategy(4),
        ) {
            let greedy = one_task_at_a_time(free, &jobs);
            let got = equipartition(free, &jobs);
            let Some(expect) = greedy else {
                let refused = matches!(got, Err(EquipartitionError::MinsDoNotFit { .. }));
                prop_assert!(refused, "{:?}", got);
                return Ok(());
            };
            let tasks = got.unwrap();
            prop_assert_eq!(&tasks, &expect);
            let used: u64 = jobs.iter().zip(&tasks).map(|(j, t)| j.pus(*t)).sum();
            prop_assert!(used <= u64::from(free));
            let left = u64::from(free) - used;
            for (i, (a, t)) in jobs.iter().zip(&tasks).enumerate() {
                prop_assert!((a.min..=a.max).contains(t));
                if *t < a.max {
                    // Nothing more fits for a job below its max: no PU left idle that it could use.
                    prop_assert!(u64::from(a.pus_per_task) > left, "job {} could take a task", i);
                }
                for (j, (b, s)) in jobs.iter().zip(&tasks).enumerate() {
                    // Job j got its last task when i was at least as poor and could have taken
                    // one: then j held less than i does now, or as much and came first.
                    if *t < a.max && *s > b.min
                        && u64::from(a.pus_per_task) <= left + u64::from(b.pus_per_task)
                    {
                        let before = b.pus(*s - 1);
                        prop_assert!(
                            before < a.pus(*t) || (before == a.pus(*t) && j < i),
                            "job {} ({} tasks) was favoured over job {} ({} tasks)", j, s, i, t
                        );
                    }
                }
            }
        }

        #[test]
        fn with_tasks_of_one_size_no_job_is_two_tasks_behind_another_unless_at_a_bound(
            free in 0u32..200,
            jobs in jobs_strategy(1),
        ) {
            let Ok(tasks) = equipartition(free, &jobs) else { return Ok(()) };
            let used: u32 = tasks.iter().sum();
            prop_assert!(used <= free);
            for (a, t) in jobs.iter().zip(&tasks) {
                for (b, s) in jobs.iter().zip(&tasks) {
                    if *s >= *t + 2 {
                        prop_assert!(*t == a.max || *s == b.min, "{t} of {a:?} against {s} of {b:?}");
                    }
                }
                // Work-conserving: PUs stay idle only when every job is at its max.
                prop_assert!(used == free || *t == a.max);
            }
        }
    }
}
