//! `topo-exec`: run a command inside a job's cgroup, so that nothing it forks can escape.
//!
//! `topo-exec --job ID [--request R] -- CMD ARGS...` asks the local topod to allocate for the job
//! (when `--request` is given; an existing allocation for the same request is reused), moves
//! itself into the job's cgroup, exports what the job got, and execs the command. As an LSF
//! `JOB_STARTER` the job id comes from `$LSB_JOBID` and the request from `$TOPO_REQUEST`.

use clap::Parser;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use topod::client::Client;
use topod::proto::Op;

#[derive(Parser)]
#[command(name = "topo-exec", version, about = "Run a command inside a job's cpuset/cgroup")]
struct Args {
    /// The job id [default: $LSB_JOBID, $SLURM_JOB_ID or $PBS_JOBID].
    #[arg(long)]
    job: Option<String>,
    /// The topology request; without it the job must already be allocated [default: $TOPO_REQUEST].
    #[arg(long)]
    request: Option<String>,
    /// Tasks when the request does not say [default: $LSB_DJOB_NUMPROC or 1].
    #[arg(long)]
    tasks: Option<u32>,
    /// topod's socket.
    #[arg(long, default_value = "/run/topo/topod.sock")]
    socket: PathBuf,
    /// The command and its arguments.
    #[arg(required = true, last = true)]
    command: Vec<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(never) => match never {},
        Err(message) => {
            eprintln!("topo-exec: {message}");
            ExitCode::from(1)
        }
    }
}

enum Never {}

fn run(args: Args) -> Result<Never, String> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let job = args
        .job
        .or_else(|| env("LSB_JOBID"))
        .or_else(|| env("SLURM_JOB_ID"))
        .or_else(|| env("PBS_JOBID"))
        .ok_or("no job id: give --job or run under LSF, Slurm or PBS")?;
    let request = args.request.or_else(|| env("TOPO_REQUEST"));
    let tasks = args.tasks.or_else(|| env("LSB_DJOB_NUMPROC").and_then(|v| v.parse().ok()));
    let mut client = Client::connect(&args.socket).map_err(|e| e.to_string())?;
    let alloc = match request {
        Some(request) => client
            .call(Op::Allocate { job: job.clone(), request, tasks, cpus: None, mem_limit_bytes: None, owner_uid: Some(nix::unistd::getuid().as_raw()) })
            .map_err(|e| e.to_string())?,
        None => {
            let jobs = client.call(Op::List).map_err(|e| e.to_string())?;
            jobs.as_array()
                .and_then(|a| a.iter().find(|j| j["job"] == job.as_str()).cloned())
                .ok_or_else(|| format!("job {job} has no allocation on this host; give --request"))?
        }
    };
    client.call(Op::Join { job: job.clone(), pid: std::process::id() as i32 }).map_err(|e| e.to_string())?;
    let cpus = alloc["cpus"].as_str().unwrap_or_default().to_string();
    let mems = alloc["mems"].as_str().unwrap_or_default().to_string();
    let err = Command::new(&args.command[0]).args(&args.command[1..]).env("TOPO_JOB", &job).env("TOPO_CPUS", &cpus).env("TOPO_MEMS", &mems).exec();
    Err(format!("cannot run {}: {err}", args.command[0]))
}
