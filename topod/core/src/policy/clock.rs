//! A job's clock on its host: how long it has run, since when it counts as running for the
//! minimum run times, and how often the policy has suspended it. Every start, stop and resume of
//! a job goes through [`RunClock`], in topod (kept in the job's record) and in the cluster core,
//! so that the rules below are written once:
//!
//! - Only the policy's own suspensions (preemption) count toward
//!   [`Preempt::max_suspensions`](super::Preempt::max_suspensions), and only a resume after one
//!   restarts [`Preempt::min_run`](super::Preempt::min_run) (and migration's delay). A
//!   suspension by the job's owner, an administrator or the batch system does neither: an owner
//!   who suspends and resumes a job could otherwise use up its turns, or keep restarting its
//!   protection, and so shield it from preemption for good (issue 30's "owner dodge").
//! - The time a job ran is summed over its runs; time stopped does not count as run, so its
//!   estimated end moves later by as long.

use super::Time;

/// Who stopped a running job (or whose stop a resume ends), as its clock counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopper {
    /// The policy's preemption, for another job.
    Preemption,
    /// Anyone outside the policy: the job's owner, an administrator, the batch system.
    Outside,
}

/// A job's clock (see the module's docs). The field names are those of topod's job records,
/// which keep it as it is (serde), so records written before this type read the same.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RunClock {
    /// How many times the policy's preemption has suspended the job.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub suspensions: u32,
    /// Seconds it ran before its last start or resume.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub ran_s: u64,
    /// When it last started or resumed; `None` while it is stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_since: Option<Time>,
    /// When it started, or was last resumed after preemption: the minimum run times count from
    /// then. Records written before it existed take `running_since`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protected_since: Option<Time>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

fn seconds(from: Time, to: Time) -> u64 {
    u64::try_from(to.saturating_sub(from)).unwrap_or(0)
}

fn as_time(s: u64) -> Time {
    Time::try_from(s).unwrap_or(Time::MAX)
}

impl RunClock {
    /// The clock of a job that starts running at `now`.
    pub fn started(now: Time) -> Self {
        RunClock { running_since: Some(now), protected_since: Some(now), ..RunClock::default() }
    }

    /// The clock of a job found on its host with no record of its past (its record was lost):
    /// running from `now`, or, found stopped, counted as once suspended by the policy (it may
    /// have been; counting it can only spare it another suspension).
    pub fn found(now: Time, stopped: bool) -> Self {
        if stopped {
            RunClock { suspensions: 1, ..RunClock::default() }
        } else {
            RunClock::started(now)
        }
    }

    /// Whether it runs (it has started or resumed and not stopped since).
    pub fn is_running(&self) -> bool {
        self.running_since.is_some()
    }

    /// The job stops at `now`, stopped by `by`: what it ran so far is kept, and a stop by the
    /// policy counts toward its suspensions. A clock already stopped only counts the stop.
    pub fn stop(&mut self, now: Time, by: Stopper) {
        // A record from before `protected_since` counts from its last start: kept as it is, or
        // the resume after an owner's stop would restart it.
        self.protected_since = self.protected_since.or(self.running_since);
        if let Some(since) = self.running_since.take() {
            self.ran_s = self.ran_s.saturating_add(seconds(since, now));
        }
        if by == Stopper::Preemption {
            self.suspensions = self.suspensions.saturating_add(1);
        }
    }

    /// The job runs again at `now` after a stop by `after`: a resume after preemption restarts
    /// the minimum run times, any other does not (a job found stopped, whose start is not
    /// known, counts from its first resume).
    pub fn resume(&mut self, now: Time, after: Stopper) {
        self.running_since = Some(now);
        if after == Stopper::Preemption || self.protected_since.is_none() {
            self.protected_since = Some(now);
        }
    }

    /// Seconds it has run in all, up to `now`.
    pub fn ran(&self, now: Time) -> u64 {
        self.ran_s.saturating_add(self.running_since.map_or(0, |since| seconds(since, now)))
    }

    /// Since when it counts as running for the minimum run times (preemption's `min_run`,
    /// migration's delay); `None` for a job that has not run since it was found.
    pub fn protected_from(&self) -> Option<Time> {
        self.protected_since.or(self.running_since)
    }

    /// Seconds it has counted as running for the minimum run times at `now` (0 when unknown).
    pub fn protected_for(&self, now: Time) -> Time {
        self.protected_from().map_or(0, |from| now.saturating_sub(from))
    }

    /// Seconds of `estimate` still to run at `now`.
    pub fn left(&self, now: Time, estimate: u64) -> u64 {
        estimate.saturating_sub(self.ran(now))
    }

    /// When it ends by `estimate` if it runs on from now without a stop; `None` while stopped.
    pub fn estimated_end(&self, estimate: u64) -> Option<Time> {
        let since = self.running_since?;
        Some(since.saturating_add(as_time(estimate.saturating_sub(self.ran_s))))
    }

    /// Its expansion factor at `now` ([`super::expansion_factor`]), submitted at `submitted`
    /// with `estimate`: time in the system (suspended or not) and what is left to run.
    pub fn expansion_factor(&self, now: Time, submitted: Time, estimate: u64) -> f64 {
        super::expansion_factor(
            now.saturating_sub(submitted),
            as_time(self.left(now, estimate)),
            as_time(estimate),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_preemption_counts_and_restarts_the_protection() {
        let mut clock = RunClock::started(100);
        // The owner suspends and resumes: run time kept, nothing counted, protection from 100.
        clock.stop(400, Stopper::Outside);
        clock.resume(500, Stopper::Outside);
        assert_eq!((clock.suspensions, clock.ran(600), clock.protected_for(600)), (0, 400, 500));
        // The policy suspends and resumes: counted, and protected from the resume.
        clock.stop(700, Stopper::Preemption);
        assert!(!clock.is_running());
        assert_eq!((clock.suspensions, clock.ran(900)), (1, 500));
        clock.resume(1000, Stopper::Preemption);
        assert_eq!((clock.ran(1100), clock.protected_for(1100)), (600, 100));
    }

    #[test]
    fn a_stop_moves_the_estimated_end_later_by_as_long() {
        let mut clock = RunClock::started(0);
        assert_eq!(clock.estimated_end(1000), Some(1000));
        clock.stop(300, Stopper::Outside);
        assert_eq!(clock.estimated_end(1000), None);
        assert_eq!(clock.left(5000, 1000), 700);
        clock.resume(800, Stopper::Outside);
        assert_eq!(clock.estimated_end(1000), Some(1500));
        // Past its estimate: nothing left, the end is its last resume.
        assert_eq!(clock.left(9000, 1000), 0);
        assert_eq!(RunClock { ran_s: 2000, ..RunClock::started(50) }.estimated_end(1000), Some(50));
    }

    #[test]
    fn the_expansion_factor_counts_time_suspended_as_in_the_system() {
        let mut clock = RunClock::started(100);
        clock.stop(200, Stopper::Preemption);
        // Submitted at 0 with 400 s: at 500, 500 s in the system and 300 s left.
        assert_eq!(clock.expansion_factor(500, 0, 400), 2.0);
        assert_eq!(clock.expansion_factor(500, 0, 400), expansion_at(500, 0, 300, 400));
    }

    #[test]
    fn a_limit_of_u64_max_or_a_submission_long_ago_does_not_overflow() {
        // (An attack: an allocate with estimate_s = u64::MAX and an early submitted_at made
        // every preempting allocate panic in a debug build, and wrap in a release one.)
        let clock = RunClock::started(1);
        let xf = clock.expansion_factor(i64::MAX, i64::MIN, u64::MAX);
        assert!(xf.is_finite() && xf >= 1.0, "{xf}");
        assert_eq!(clock.estimated_end(u64::MAX), Some(i64::MAX));
        assert!(super::super::expansion_factor(Time::MAX, Time::MAX, 1) > 1e18);
    }

    fn expansion_at(now: Time, submitted: Time, left: Time, estimate: Time) -> f64 {
        super::super::expansion_factor(now - submitted, left, estimate)
    }

    #[test]
    fn a_record_without_protected_since_counts_from_its_last_start() {
        let old: RunClock = serde_json::from_str(r#"{"ran_s": 5, "running_since": 40}"#).unwrap();
        assert_eq!(old.protected_from(), Some(40));
        // Its owner's stop and resume do not restart it (the dodge, on a record from before).
        let mut dodged = old.clone();
        dodged.stop(100, Stopper::Outside);
        dodged.resume(110, Stopper::Outside);
        assert_eq!(dodged.protected_for(200), 160);
        // Found stopped, with nothing known: protected from its first resume, then kept.
        let mut found = RunClock::found(10, true);
        assert_eq!(found.protected_from(), None);
        found.resume(50, Stopper::Outside);
        found.stop(60, Stopper::Outside);
        found.resume(70, Stopper::Outside);
        assert_eq!(found.protected_from(), Some(50));
        assert_eq!(serde_json::to_string(&RunClock::default()).unwrap(), "{}");
        assert_eq!(RunClock::found(10, true).suspensions, 1);
        assert_eq!(RunClock::found(10, false), RunClock::started(10));
    }
}
