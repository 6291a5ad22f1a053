//! `topoctl lsf-pre-exec` and `lsf-post-exec`: the LSF host pre- and post-execution commands
//! (run as root, `LSB_PRE_POST_EXEC_USER=root`). The pre-exec places the job on this host from
//! its environment before it starts, so that `topo-exec`, the job starter, running as the job's
//! user, only has to join; the post-exec releases it.
//!
//! `topoctl lsf-suspend` and `lsf-resume`: a queue's `JOB_CONTROLS` SUSPEND and RESUME actions
//! (run by LSF as the job's user, with the job's environment and `LSB_JOBPGIDS`). A job topod
//! holds is frozen and thawed by the kernel's freezer; one it does not hold (no topology
//! request) gets what LSF would have sent, SIGSTOP and SIGCONT to its process groups.

use crate::cli::Daemon;
use crate::live::{call, connect};
use crate::Failure;
use topo_core::batch;
use topo_core::proto::Op;
use topo_core::request::merge_extsched;

/// Exit status that makes LSF end the job instead of pending it again (its request can never
/// work).
const EXIT_NEVER: u8 = 99;

fn env(k: &str) -> Option<String> {
    std::env::var(k).ok().filter(|v| !v.is_empty())
}

fn lsf_job() -> Result<String, Failure> {
    if env("LSB_JOBID").is_none() {
        return Err(Failure::input(
            "LSB_JOBID is not set: this command runs as LSF's host pre- or post-execution command, or as a queue's JOB_CONTROLS action",
        ));
    }
    Ok(batch::job_id(env).expect("LSB_JOBID is set"))
}

/// The job's request: `$TOPO_REQUEST` (set by esub.topo from `bsub -extsched`) merged with the
/// queue's `$TOPO_QUEUE_MANDATORY` and `$TOPO_QUEUE_DEFAULT` the way the scheduler module merged
/// them; None when there is none.
fn request() -> Result<Option<String>, Failure> {
    let (mandatory, job, default) =
        (env("TOPO_QUEUE_MANDATORY"), env("TOPO_REQUEST"), env("TOPO_QUEUE_DEFAULT"));
    if mandatory.is_none() && job.is_none() && default.is_none() {
        return Ok(None);
    }
    match merge_extsched(mandatory.as_deref(), job.as_deref(), default.as_deref()) {
        Ok(r) => Ok(Some(r.to_string())),
        Err(e) => {
            let input = e.input(mandatory.as_deref(), job.as_deref(), default.as_deref());
            Err(Failure {
                message: format!("bad topology request {}", e.render(input)),
                code: EXIT_NEVER,
            })
        }
    }
}

/// Allocates the job on this host.
pub fn pre_exec(daemon: &Daemon) -> Result<(), Failure> {
    let job = lsf_job()?;
    let Some(request) = request()? else {
        println!("job {job}: no topology request; nothing to do");
        return Ok(());
    };
    let host =
        nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned()).unwrap_or_default();
    let tasks = env("LSB_MCPU_HOSTS")
        .and_then(|m| batch::lsf_slots_on(&m, &host))
        .or_else(|| env("LSB_DJOB_NUMPROC").and_then(|v| v.parse().ok()));
    let user = env("LSFUSERNAME").or_else(|| env("USER"));
    let owner_uid = match &user {
        Some(name) => Some(
            nix::unistd::User::from_name(name)
                .ok()
                .flatten()
                .ok_or_else(|| {
                    Failure::runtime(format!(
                        "job {job}: its user {name:?} is not known on this host"
                    ))
                })?
                .uid
                .as_raw(),
        ),
        None => None,
    };
    let mut c = connect(daemon)?;
    let a: topo_core::ledger::Allocation = call(
        &mut c,
        Op::Allocate(topo_core::proto::AllocateArgs {
            tasks,
            owner_uid,
            ..topo_core::proto::AllocateArgs::new(job.clone(), request.clone())
        }),
    )
    .map_err(|f| {
        if f.message.contains("can never fit") {
            Failure { code: EXIT_NEVER, ..f }
        } else {
            f
        }
    })?;
    println!("job {job} ({request}): CPUs {}, memory nodes {}", a.cpus, a.mems);
    Ok(())
}

/// Releases the job on this host and removes its affinity host file.
pub fn post_exec(daemon: &Daemon) -> Result<(), Failure> {
    let job = lsf_job()?;
    let mut c = connect(daemon)?;
    match call::<topo_core::proto::reply::Release>(&mut c, Op::Release { job: job.clone() }) {
        Ok(r) => println!("job {job} released ({} process(es) killed)", r.killed),
        Err(f) if f.message.contains("holds nothing") => {
            println!("job {job}: nothing held on this host")
        }
        Err(f) => return Err(f),
    }
    let hostfile = std::path::PathBuf::from(env("TMPDIR").unwrap_or_else(|| "/tmp".into()))
        .join(format!("topo-affinity.{job}"));
    let _ = std::fs::remove_file(hostfile);
    Ok(())
}

/// The job's process groups, from `LSB_JOBPGIDS` (space-separated).
fn job_pgids() -> Vec<i32> {
    env("LSB_JOBPGIDS")
        .map(|v| v.split_whitespace().filter_map(|p| p.parse().ok()).filter(|p| *p > 1).collect())
        .unwrap_or_default()
}

/// What LSF does without an action: `sig` to each of the job's process groups.
fn signal_groups(job: &str, sig: nix::sys::signal::Signal) -> Result<(), Failure> {
    let groups = job_pgids();
    if groups.is_empty() {
        return Err(Failure::runtime(format!(
            "job {job}: topod holds nothing for it and LSB_JOBPGIDS names no process group to send {sig} to"
        )));
    }
    for pgid in &groups {
        nix::sys::signal::killpg(nix::unistd::Pid::from_raw(*pgid), sig).map_err(|e| {
            Failure::runtime(format!("job {job}: sending {sig} to process group {pgid}: {e}"))
        })?;
    }
    println!("job {job}: topod holds nothing for it; {sig} sent to process group(s) {groups:?}");
    Ok(())
}

/// JOB_CONTROLS SUSPEND: freezes the job (or stops it with signals when topod holds nothing).
pub fn suspend(daemon: &Daemon) -> Result<(), Failure> {
    let job = lsf_job()?;
    let mut c = connect(daemon)?;
    match call::<topo_core::proto::reply::Suspend>(&mut c, Op::Suspend { job: job.clone() }) {
        Ok(r) => {
            println!(
                "job {job} frozen in {:.1} ms; CPUs {} may be lent",
                r.frozen_after_us as f64 / 1000.0,
                r.cpus
            );
            Ok(())
        }
        Err(f) if f.message.contains("is suspended") => Ok(()),
        Err(f) if f.message.contains("holds nothing") => {
            signal_groups(&job, nix::sys::signal::Signal::SIGSTOP)
        }
        Err(f) => Err(f),
    }
}

/// JOB_CONTROLS RESUME: thaws the job once its CPUs are free (fails, so LSF keeps it suspended,
/// while another job runs on them).
pub fn resume(daemon: &Daemon) -> Result<(), Failure> {
    let job = lsf_job()?;
    let mut c = connect(daemon)?;
    match call::<topo_core::proto::reply::Resume>(&mut c, Op::Resume { job: job.clone() }) {
        Ok(r) => {
            println!("job {job} thawed on CPUs {}", r.cpus);
            Ok(())
        }
        // Running, or frozen by gang slicing until its slice: not suspended, nothing to undo.
        Err(f) if f.message.contains("is running") || f.message.contains("is frozen") => Ok(()),
        Err(f) if f.message.contains("holds nothing") => {
            signal_groups(&job, nix::sys::signal::Signal::SIGCONT)
        }
        Err(f) => Err(f),
    }
}
