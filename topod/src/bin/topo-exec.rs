//! `topo-exec`: run a command inside a job's cgroup, so that nothing it forks can escape.
//!
//! `topo-exec --job ID [--request R] -- CMD ARGS...` asks the local topod to allocate for the job
//! (when `--request` is given; an existing allocation for the same request is reused), moves
//! itself into the job's cgroup, exports what the job got, and execs the command.
//!
//! As an LSF `JOB_STARTER` (`topo-exec -- %USRCMD`) the job id is `lsf-$LSB_JOBID` (with
//! `[$LSB_JOBINDEX]` in a job array), the request comes from `$TOPO_REQUEST` (which `esub.topo`
//! sets), the tasks are this host's slots in `$LSB_MCPU_HOSTS`, and an
//! `LSB_AFFINITY_HOSTFILE`-compatible file is written for MPI launchers.

use clap::Parser;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use topo_client::Client;
use topo_core::batch;
use topo_core::proto::Op;
use topod::cli::TopoExecArgs;

fn main() -> ExitCode {
    let args = TopoExecArgs::parse();
    match run(args) {
        Ok(never) => match never {},
        Err(message) => {
            eprintln!("topo-exec: {message}");
            ExitCode::from(1)
        }
    }
}

enum Never {}

fn run(args: TopoExecArgs) -> Result<Never, String> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let job = args
        .job
        .or_else(|| batch::job_id(env))
        .ok_or("no job id: give --job or run under LSF, Slurm or PBS")?;
    let request = args.request.or_else(|| env("TOPO_REQUEST"));
    let host = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "localhost".into());
    let tasks = args
        .tasks
        .or_else(|| env("LSB_MCPU_HOSTS").and_then(|m| batch::lsf_slots_on(&m, &host)))
        .or_else(|| env("LSB_DJOB_NUMPROC").and_then(|v| v.parse().ok()));
    let under_lsf = env("LSB_JOBID").is_some();
    let hostfile = args.hostfile.or_else(|| {
        under_lsf.then(|| {
            PathBuf::from(env("TMPDIR").unwrap_or_else(|| "/tmp".into()))
                .join(format!("topo-affinity.{job}"))
        })
    });
    let mut client = Client::connect(&args.socket).map_err(|e| e.to_string())?;
    // An allocation made before the job started (by LSF's host pre-exec, as root) is joined as it
    // is; otherwise the job is allocated here (which needs root or an administrator).
    let jobs = client.list().map_err(|e| e.to_string())?;
    let existing = jobs.into_iter().find(|j| j.allocation.job == job).map(|j| j.allocation);
    let alloc = match (existing, request) {
        (Some(a), _) => a,
        (None, Some(request)) => client
            .allocate(Op::Allocate(topo_core::proto::AllocateArgs {
                tasks,
                owner_uid: Some(nix::unistd::getuid().as_raw()),
                resize_signal: args
                    .resize_signal
                    .or_else(|| env("TOPO_RESIZE_SIGNAL").and_then(|v| v.parse().ok())),
                // The prime-time pools admit by queue (the batch system's), owner, or name.
                queue: env("LSB_QUEUE")
                    .or_else(|| env("SLURM_JOB_PARTITION"))
                    .or_else(|| env("PBS_QUEUE")),
                pool: env("TOPO_POOL"),
                ..topo_core::proto::AllocateArgs::new(job.clone(), request)
            }))
            .map_err(|e| e.to_string())?,
        (None, None) => {
            return Err(format!("job {job} has no allocation on this host; give --request"))
        }
    };
    client.join_self(&job).map_err(|e| e.to_string())?;
    let cpus = alloc.cpus.to_string();
    let mems = alloc.mems.to_string();
    let mut command = Command::new(&args.command[0]);
    command
        .args(&args.command[1..])
        .env("TOPO_JOB", &job)
        .env("TOPO_CPUS", &cpus)
        .env("TOPO_MEMS", &mems)
        .env("TOPO_NOTIFY_FILE", topo_core::proto::notify_file_for(&args.socket, &job));
    if let Some(path) = hostfile {
        let tasks: Vec<String> = alloc.tasks.iter().map(|t| t.to_string()).collect();
        let tasks = if tasks.is_empty() { vec![cpus.clone()] } else { tasks };
        std::fs::write(&path, batch::affinity_hostfile(&host, &tasks))
            .map_err(|e| format!("cannot write the affinity host file {}: {e}", path.display()))?;
        command.env("LSB_AFFINITY_HOSTFILE", &path);
    }
    let err = command.exec();
    Err(format!("cannot run {}: {err}", args.command[0]))
}
