//! The decisions the plug-in makes, apart from the calls that carry them out.

use topo_core::request::{Level, Request};
use topo_core::CpuSet;

/// Slurm's special step ids, from the installed `slurm/slurm.h` (build.rs): `SLURM_BATCH_SCRIPT`,
/// `SLURM_EXTERN_CONT`, `SLURM_INTERACTIVE_STEP`, `SLURM_PENDING_STEP`.
pub mod steps {
    include!(concat!(env!("OUT_DIR"), "/slurm_steps.rs"));
}

/// The step id Slurm gives the batch script (`SLURM_BATCH_SCRIPT`).
pub const BATCH_STEP: u32 = steps::SLURM_BATCH_SCRIPT;

/// A step as people read it, the way Slurm itself prints it (`StepId=42.batch`): `batch`,
/// `extern` or `interactive` for Slurm's special steps, else the step number.
pub fn step_name(step_id: u32) -> String {
    match step_id {
        steps::SLURM_BATCH_SCRIPT => "batch".to_string(),
        steps::SLURM_EXTERN_CONT => "extern".to_string(),
        steps::SLURM_INTERACTIVE_STEP => "interactive".to_string(),
        steps::SLURM_PENDING_STEP => "pending".to_string(),
        n => n.to_string(),
    }
}

/// The id topod knows a Slurm job by on this host: `slurm-<jobid>`. One allocation per job and
/// host, shared by all its steps (the batch script and the sruns inside it run at the same time
/// on the same cores), released by the job epilog. It always passes topod's job id check.
pub fn topod_job_id(slurm_job_id: u32) -> String {
    topo_core::batch::slurm_job_id(slurm_job_id)
}

/// The Slurm job number of a job id topod holds (`slurm-42` -> 42); `None` for other batch
/// systems' jobs and anything else.
pub fn slurm_job_number(topod_job: &str) -> Option<u32> {
    let n = topod_job.strip_prefix("slurm-")?;
    // Only the exact form topod_job_id makes (no sign, no leading zeros).
    (!n.starts_with(['+', '0'])).then(|| n.parse().ok()).flatten()
}

/// What slurmctld says of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlurmState {
    /// `JobState=RUNNING`.
    Running,
    /// `JobState=SUSPENDED`: Slurm stopped it (suspend preemption, gang scheduling, `scontrol
    /// suspend`).
    Suspended,
    /// Anything else (completing, ended, pending again).
    Other,
    /// slurmctld knows no such job: it ended and was purged (or never was). topod's allocation
    /// for it is an orphan.
    Gone,
}

/// Whether a task of a job Slurm started suspended may run its program, from slurmctld's
/// answer about the job (`None`: slurmctld did not answer). Only slurmctld's word that the
/// job is no longer suspended lets it run: while slurmctld is down its gang scheduling stops,
/// and the job whose turn it was keeps the CPUs (an attack saw two jobs on one CPU when the
/// task stopped waiting after a minute without answers).
pub fn may_run(answer: Option<SlurmState>) -> bool {
    matches!(answer, Some(s) if s != SlurmState::Suspended)
}

/// Appended to topod's refusal when it holds this job's cores for Slurm jobs slurmctld does
/// not know: most likely orphans (their end never reached topod, or they were made by hand),
/// which the administrator frees; the plug-in never kills them itself (the same id may be
/// another cluster's job, or one started by hand, still running).
pub fn unknown_to_slurm(jobs: &[String]) -> String {
    format!(
        "; topod holds these cores for {}, which slurmctld does not know (an orphan whose end never reached topod, or a job started by hand): if nothing of it runs, `topoctl release {}` frees them",
        jobs.join(", "),
        jobs.first().map_or("JOB", String::as_str)
    )
}

/// The other Slurm jobs topod holds on CPUs that Slurm gave this job: Slurm gives a job cores
/// another job holds only when it time-shares them (it suspended that job, or gang-schedules
/// the two), so these are the jobs whose state slurmctld is asked before the allocate.
pub fn sharing_jobs<'a>(
    held: impl IntoIterator<Item = (&'a str, &'a CpuSet)>,
    this_job: u32,
    job_cpus: &CpuSet,
) -> Vec<u32> {
    let mut jobs: Vec<u32> = held
        .into_iter()
        .filter(|(_, cpus)| cpus.intersects(job_cpus))
        .filter_map(|(job, _)| slurm_job_number(job))
        .filter(|&n| n != this_job)
        .collect();
    jobs.sort_unstable();
    jobs.dedup();
    jobs
}

/// topod's view of what Slurm did, from slurmctld's states of the sharing jobs: the ones it
/// suspended and the ones it runs (jobs in other states, and jobs slurmctld could not be asked
/// about, are left out: topod keeps them as they are).
pub fn batch_view(states: &[(u32, SlurmState)]) -> topo_core::proto::BatchView {
    let of = |want: SlurmState| {
        states.iter().filter(|(_, s)| *s == want).map(|(n, _)| topod_job_id(*n)).collect()
    };
    topo_core::proto::BatchView {
        suspended: of(SlurmState::Suspended),
        running: of(SlurmState::Running),
    }
}

/// The queue to give topod for a job whose environment says partition `claimed`: the job's
/// environment is the user's to set (`SLURM_JOB_PARTITION=prime srun ...`), and a prime-time
/// pool admits jobs by queue. A claim that names no queue any of this host's pools admits
/// (`pool_queues`) gains nothing and is passed on as it is (topod shows it); one that does is
/// checked against slurmctld's record (`ask`, one RPC, made only then): slurmctld's answer is
/// the queue, and without one no queue is given (the job is then admitted by its user or its
/// named pool only). Returns the queue and, when it differs from the claim, why, for the log.
pub fn trusted_queue(
    claimed: Option<&str>,
    pool_queues: &[&str],
    ask: impl FnOnce() -> Result<Option<String>, String>,
) -> (Option<String>, Option<String>) {
    let Some(claimed) = claimed else { return (None, None) };
    if !pool_queues.contains(&claimed) {
        return (Some(claimed.to_string()), None);
    }
    match ask() {
        Ok(Some(record)) if record == claimed => (Some(record), None),
        Ok(record) => {
            let why = format!(
                "its environment says partition {claimed}, slurmctld's record says {}: the record's is given to topod",
                record.as_deref().unwrap_or("none")
            );
            (record, Some(why))
        }
        Err(e) => (
            None,
            Some(format!(
                "{e}; its partition {claimed} (from its environment, which the user may set) admits it to no prime-time pool"
            )),
        ),
    }
}

/// Why a job Slurm runs on cores that other running jobs hold is refused: Slurm oversubscribes
/// them (`OverSubscribe=FORCE` or `YES` without `PreemptMode=GANG`), and topo gives a CPU to
/// one job at a time. Appended to topod's refusal.
pub fn oversubscribed(beside: &[String]) -> String {
    format!(
        "; Slurm runs {} on these cores at the same time (OverSubscribe without gang scheduling), and topo gives a CPU to one job at a time: use PreemptMode=GANG (Slurm then takes turns, which topo follows) or OverSubscribe=NO for --topology jobs",
        beside.join(", ")
    )
}

/// The task count to place for when the request gives none (`affinity[core]`): the step's
/// tasks on this host, or for the batch step, as many units as the cores (or CPUs, for thread
/// units) Slurm gave the job here, so the script's allocation covers what later steps use.
pub fn tasks_if_unsaid(
    req: &Request,
    step_id: u32,
    local_tasks: u32,
    job_cores: usize,
    job_cpus: usize,
) -> u32 {
    if step_id != BATCH_STEP {
        return local_tasks.max(1);
    }
    let units = match req.unit {
        Level::Thread => job_cpus,
        Level::Core => job_cores,
        _ => return 1,
    };
    u32::try_from(units / req.units_per_task.max(1) as usize).unwrap_or(u32::MAX).max(1)
}

/// Whether each task is bound to its own CPUs of the allocation (`true`), or to all the job's
/// CPUs: a malleable request (`*min-max`) run as one process per host grows and shrinks as a
/// whole, and its one task must reach every CPU its job gets.
pub fn binds_per_task(req: &Request, local_tasks: u32) -> bool {
    !(req.is_malleable() && local_tasks <= 1)
}

/// The CPUs of local task `task` of a step that runs on `step_cpus` (OS ids): its own CPUs from
/// topod when the allocation has one set per task, inside the step's CPUs; else the job's CPUs
/// inside the step's; never empty while the allocation is not.
pub fn task_cpus(
    job_cpus: &CpuSet,
    per_task: &[CpuSet],
    task: usize,
    step_cpus: &CpuSet,
) -> CpuSet {
    let inside_step =
        |s: &CpuSet| if step_cpus.is_empty() { s.clone() } else { s.intersection(step_cpus) };
    if let Some(own) = per_task.get(task).map(inside_step).filter(|s| !s.is_empty()) {
        return own;
    }
    Some(inside_step(job_cpus)).filter(|s| !s.is_empty()).unwrap_or_else(|| job_cpus.clone())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_partition_from_the_environment_admits_to_a_pool_only_as_slurmctld_confirms() {
        let never = || -> Result<Option<String>, String> { panic!("slurmctld asked") };
        // No claim, or one no pool admits: slurmctld is not asked.
        assert_eq!(trusted_queue(None, &["prime"], never), (None, None));
        assert_eq!(trusted_queue(Some("debug"), &["prime"], never), (Some("debug".into()), None));
        // A claim a pool admits: slurmctld's record decides.
        let said = |p: &str| {
            let p = p.to_string();
            move || Ok(Some(p))
        };
        assert_eq!(
            trusted_queue(Some("prime"), &["prime"], said("prime")),
            (Some("prime".into()), None)
        );
        let (queue, why) = trusted_queue(Some("prime"), &["prime"], said("debug"));
        assert_eq!(queue.as_deref(), Some("debug"));
        assert!(why.unwrap().contains("slurmctld's record says debug"));
        let (queue, why) =
            trusted_queue(Some("prime"), &["prime"], || Err("slurmctld is down".into()));
        assert_eq!(queue, None);
        assert!(why.unwrap().contains("slurmctld is down; its partition prime"));
    }

    use super::*;

    fn set(text: &str) -> CpuSet {
        CpuSet::parse_list(text).unwrap()
    }

    #[test]
    fn slurm_job_numbers_read_back_only_from_topods_own_form() {
        assert_eq!(slurm_job_number("slurm-42"), Some(42));
        assert_eq!(slurm_job_number(&topod_job_id(4_294_967_000)), Some(4_294_967_000));
        for other in [
            "pbs-42.server",
            "42",
            "slurm-",
            "slurm-042",
            "slurm-+4",
            "slurm-4x",
            "slurm-99999999999",
        ] {
            assert_eq!(slurm_job_number(other), None, "{other}");
        }
    }

    #[test]
    fn only_jobs_on_this_jobs_cpus_are_asked_about() {
        let (a, b, c, d) = (set("0-1"), set("2-3"), set("1"), set("0"));
        let held = [("slurm-7", &a), ("slurm-8", &b), ("pbs-9.x", &c), ("slurm-5", &d)];
        assert_eq!(sharing_jobs(held, 10, &set("0-1")), vec![5, 7]);
        assert_eq!(sharing_jobs(held, 7, &set("0-1")), vec![5], "never the job itself");
        assert!(sharing_jobs(held, 10, &set("4-7")).is_empty());
    }

    #[test]
    fn a_task_waits_until_slurmctld_says_its_job_runs() {
        assert!(!may_run(Some(SlurmState::Suspended)));
        assert!(!may_run(None), "slurmctld down: its gang scheduling stopped, keep waiting");
        assert!(may_run(Some(SlurmState::Running)));
        assert!(may_run(Some(SlurmState::Other)), "ending: nothing to wait for");
        assert!(may_run(Some(SlurmState::Gone)));
        assert!(unknown_to_slurm(&["slurm-7".into()])
            .contains("slurm-7, which slurmctld does not know"));
    }

    #[test]
    fn the_view_says_what_slurm_suspended_and_runs() {
        let v = batch_view(&[
            (1, SlurmState::Suspended),
            (2, SlurmState::Running),
            (3, SlurmState::Other),
            (4, SlurmState::Suspended),
        ]);
        assert_eq!(v.suspended, vec!["slurm-1", "slurm-4"]);
        assert_eq!(v.running, vec!["slurm-2"]);
        assert_eq!(v.check(), Ok(()));
    }

    #[test]
    fn job_ids_pass_topods_check() {
        for id in [1, 4_294_967_000] {
            topo_core::JobId::parse(&topod_job_id(id)).unwrap();
        }
    }

    #[test]
    fn special_steps_are_named_as_slurm_names_them() {
        // Slurm 22.05's values (slurm.h); the build reads them from the installed headers.
        assert_eq!(step_name(0xffff_fffb), "batch");
        assert_eq!(step_name(0xffff_fffc), "extern");
        assert_eq!(step_name(0xffff_fffa), "interactive");
        assert_eq!(step_name(BATCH_STEP), "batch");
        assert_eq!(step_name(0), "0");
        assert_eq!(step_name(17), "17");
        assert!(!step_name(BATCH_STEP).contains("4294967291"));
    }

    #[test]
    fn task_counts() {
        let core = topo_core::request::parse("affinity[core]").unwrap();
        assert_eq!(tasks_if_unsaid(&core, 0, 3, 8, 16), 3);
        assert_eq!(tasks_if_unsaid(&core, BATCH_STEP, 1, 8, 16), 8);
        let pairs = topo_core::request::parse("affinity[thread(2)]").unwrap();
        assert_eq!(tasks_if_unsaid(&pairs, BATCH_STEP, 1, 8, 16), 8);
        assert_eq!(tasks_if_unsaid(&pairs, BATCH_STEP, 1, 1, 1), 1);
    }

    #[test]
    fn one_task_of_a_malleable_job_is_bound_to_all_its_cpus() {
        let malleable = topo_core::request::parse("affinity[core*1-2]").unwrap();
        let rigid = topo_core::request::parse("affinity[core*2]").unwrap();
        assert!(!binds_per_task(&malleable, 1));
        assert!(binds_per_task(&malleable, 2));
        assert!(binds_per_task(&rigid, 1));
    }

    #[test]
    fn task_cpus_stay_inside_the_step() {
        let job = set("0-7");
        let per = [set("0-1"), set("2-3"), set("4-5"), set("6-7")];
        assert_eq!(task_cpus(&job, &per, 1, &set("0-7")), set("2-3"));
        assert_eq!(
            task_cpus(&job, &per, 1, &set("4-7")),
            set("4-7"),
            "task 1's own CPUs are outside this step"
        );
        assert_eq!(task_cpus(&job, &per, 9, &set("4-5")), set("4-5"));
        assert_eq!(task_cpus(&job, &per, 0, &set("12")), job, "never empty");
        assert_eq!(task_cpus(&job, &[], 0, &CpuSet::new()), job);
    }
}
