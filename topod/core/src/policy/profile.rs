//! The availability profile of conservative backfilling (Mu'alem and Feitelson 2001, "Utilization,
//! predictability, workloads, and user runtime estimates in scheduling the IBM SP2 with
//! backfilling"): free processors as a step function of time, from the running jobs' estimated
//! ends and the reservations already made. Every waiting job, in queue order, gets a
//! reservation at the earliest time its processors stay free for its whole estimate; a job
//! starts now only if that time is now, so no start delays a job ahead of it.
//!
//! Pure: times are the caller's seconds, processors a count (the cluster's cores).

use super::Time;

/// Free processors from each step's time until the next step's; the last step lasts forever.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Profile {
    steps: Vec<(Time, u64)>,
}

impl Profile {
    /// `free` processors from `now` on, and each of `ends` (estimated end, processors it frees)
    /// in any order; an end at or before `now` counts from the next second (the job has not
    /// ended yet).
    pub(super) fn new(now: Time, free: u64, ends: impl IntoIterator<Item = (Time, u64)>) -> Self {
        let mut ends: Vec<(Time, u64)> =
            ends.into_iter().map(|(t, p)| (t.max(now.saturating_add(1)), p)).collect();
        ends.sort_unstable();
        let mut steps = Vec::with_capacity(ends.len() + 1);
        steps.push((now, free));
        let mut level = free;
        for (at, procs) in ends {
            level = level.saturating_add(procs);
            match steps.last_mut() {
                Some(last) if last.0 == at => last.1 = level,
                _ => steps.push((at, level)),
            }
        }
        Profile { steps }
    }

    /// The profile as it stands at `now` (later than its start, with no change in between:
    /// the steps before `now` are gone, the one `now` falls in starts at `now`).
    pub(super) fn advance(&mut self, now: Time) {
        let keep = self.steps.partition_point(|&(t, _)| t <= now).saturating_sub(1);
        self.steps.drain(..keep);
        if let Some(first) = self.steps.first_mut() {
            first.0 = first.0.max(now);
        }
    }

    /// Free processors at the profile's start (now).
    pub(super) fn free_now(&self) -> u64 {
        self.steps.first().map_or(0, |s| s.1)
    }

    /// What a job that starts now must fit, as two steps: (free now, how long they stay at least
    /// that many, the free processors then). A job of `need` processors running `run` seconds
    /// can start now only if `need` is at most the third, or at most the first and `run` at
    /// most the second (a necessary condition, for the queue's index).
    pub(super) fn first_drop(&self) -> (u64, Time, u64) {
        let free = self.free_now();
        match self.steps.iter().skip(1).find(|s| s.1 < free) {
            Some(&(at, then)) => (free, at - self.now(), then),
            None => (free, Time::MAX, free),
        }
    }

    /// The profile's start.
    pub(super) fn now(&self) -> Time {
        self.steps.first().map_or(0, |s| s.0)
    }

    /// The earliest time, at or after the start of step `from`, from which `procs` processors
    /// stay free for `duration` seconds; `None` if they never are (more than the last step).
    pub(super) fn earliest_from(&self, from: usize, procs: u64, duration: Time) -> Option<Time> {
        let mut k = from;
        'candidates: while k < self.steps.len() {
            let start = self.steps[k].0;
            let end = start.saturating_add(duration.max(1));
            let mut j = k;
            while j < self.steps.len() && self.steps[j].0 < end {
                if self.steps[j].1 < procs {
                    // No window can start before this step ends.
                    k = j + 1;
                    continue 'candidates;
                }
                j += 1;
            }
            return Some(start);
        }
        None
    }

    /// [`Self::earliest_from`] the start.
    pub(super) fn earliest(&self, procs: u64, duration: Time) -> Option<Time> {
        self.earliest_from(0, procs, duration)
    }

    /// The earliest such time after now.
    pub(super) fn earliest_later(&self, procs: u64, duration: Time) -> Option<Time> {
        self.earliest_from(1, procs, duration)
    }

    /// Takes `procs` from `start` for `duration` seconds (a reservation, or a job started now).
    pub(super) fn take(&mut self, start: Time, duration: Time, procs: u64) {
        let end = start.saturating_add(duration.max(1));
        let first = self.split_at(start);
        let last = self.split_at(end);
        for step in &mut self.steps[first..last] {
            step.1 = step.1.saturating_sub(procs);
        }
    }

    /// The index of the step starting at `at`, made by splitting the one it falls in (a time
    /// before the profile's start is its start).
    fn split_at(&mut self, at: Time) -> usize {
        let i = self.steps.partition_point(|&(t, _)| t < at);
        if i < self.steps.len() && self.steps[i].0 == at {
            return i;
        }
        if i == 0 {
            return 0;
        }
        let level = self.steps[i - 1].1;
        self.steps.insert(i, (at, level));
        i
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_gets_the_first_window_that_lasts_its_estimate() {
        // 2 free now; 3 more at 100 (5); 4 more at 300 (9).
        let mut p = Profile::new(0, 2, [(300, 4), (100, 3)]);
        assert_eq!(p.earliest(2, 1000), Some(0));
        assert_eq!(p.earliest(3, 10), Some(100));
        assert_eq!(p.earliest(9, 10), Some(300));
        assert_eq!(p.earliest(10, 10), None);
        // A reservation of 4 from 100 to 400 leaves 1 there, 5 from 400.
        p.take(100, 300, 4);
        assert_eq!(p.steps, vec![(0, 2), (100, 1), (300, 5), (400, 9)]);
        assert_eq!(p.first_drop(), (2, 100, 1));
        // 2 for 150 s: now (0-150 has 2, then 1 at 100: no), so at 300? 300-450 has 5 then 9.
        assert_eq!(p.earliest(2, 150), Some(300));
        assert_eq!(p.earliest(2, 100), Some(0));
        assert_eq!(p.earliest_later(1, 100), Some(100));
        // A start now of 2 for 50 s.
        p.take(0, 50, 2);
        assert_eq!(p.free_now(), 0);
        assert_eq!(p.steps[..3], [(0, 0), (50, 2), (100, 1)]);
    }

    #[test]
    fn ends_at_or_before_now_count_from_the_next_second_and_advance_drops_the_past() {
        let mut p = Profile::new(10, 1, [(5, 2), (10, 1), (40, 1)]);
        assert_eq!(p.steps, vec![(10, 1), (11, 4), (40, 5)]);
        p.advance(20);
        assert_eq!(p.steps, vec![(20, 4), (40, 5)]);
        assert_eq!((p.now(), p.free_now()), (20, 4));
        p.advance(40);
        assert_eq!(p.steps, vec![(40, 5)]);
    }
}
