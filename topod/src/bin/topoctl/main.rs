//! `topoctl`: the administrator's and user's view of topo.
//!
//! Offline commands work on any machine's topology file, with no daemon and no root:
//! `show` (the host picture), `check` (parse and merge a request), `place` (what-if placement),
//! `bench placement` (the placement-quality benchmark) and `demo`.

mod bench;
mod docs;
mod lsf;
mod simulate;
mod slurm_features;

use clap::{Args, Parser, Subcommand};
use nix::sys::signal::{SigHandler, Signal};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use topo_client::Client;
use topo_core::ledger::Ledger;
use topo_core::ledger::{Allocation, JobState, JobView};
use topo_core::place::{self, HostMetrics, HostModel, Placement, Strategy};
use topo_core::proto::reply::{FreeMap, Release};
use topo_core::proto::Op;
use topo_core::request::{self, Request};
use topo_core::topology::{hwloc_xml, sysfs, Topology};
use topo_core::CpuSet;
use topod::picture::{self, Marks};

#[derive(Parser)]
#[command(
    name = "topoctl",
    version,
    about = "Topology-aware job placement: look at hosts, check requests, try placements"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Draw a host: packages, NUMA nodes, L3 groups, cores, PUs and devices.
    Show {
        #[command(flatten)]
        source: Source,
        /// Print JSON (the whole graph and its counts) instead of the picture.
        #[arg(long)]
        json: bool,
    },
    /// Parse a request (LSF CPUSET[...] and/or affinity[...]), merge it with queue strings, and
    /// print the normalized form, or say what is wrong and where.
    Check {
        /// The job's request, e.g. "affinity[core(2,same=numa)*4:membind=localonly]".
        request: String,
        /// The queue's DEFAULT_EXTSCHED (used where the job says nothing).
        #[arg(long, value_name = "STRING")]
        queue_default: Option<String>,
        /// The queue's MANDATORY_EXTSCHED (overrides the job).
        #[arg(long, value_name = "STRING")]
        queue_mandatory: Option<String>,
        /// Print JSON; a bad request prints {"error": {message, source, byte, fragment,
        /// expected, text}} on stdout (and the usual text on stderr), exit status 2.
        #[arg(long)]
        json: bool,
    },
    /// Place a sequence of requests on a topology and show where they went.
    Place {
        #[command(flatten)]
        source: Source,
        /// Placement strategy: best-fit, pack, balance, first-fit, buddy, or the baselines
        /// k8s-static and slurm-block.
        #[arg(long, short, default_value = "best-fit", value_parser = parse_strategy)]
        strategy: Strategy,
        /// Tasks for requests that do not say (like `bsub -n`).
        #[arg(long, short = 'n', default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=65536))]
        tasks: u32,
        /// CPUs no job may get (kept for the system), e.g. 0-1.
        #[arg(long, value_name = "LIST", value_parser = parse_cpus)]
        reserve: Option<CpuSet>,
        /// Requests, placed in order.
        #[arg(required = true)]
        requests: Vec<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
    /// Ask the local topod: the host picture with its live jobs and reserved or foreign CPUs.
    Status {
        #[command(flatten)]
        daemon: Daemon,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Publish this host's free topology to Slurm as node features (topo_free_N, topo_numa_N)
    /// with `scontrol update`, whenever they change or slurmctld lost them (`scontrol
    /// reconfigure` and a slurmctld restart reset features to slurm.conf's); see
    /// packaging/slurm/README.md.
    SlurmFeatures {
        #[command(flatten)]
        daemon: Daemon,
        /// The Slurm node name [default: `hostname -s`].
        #[arg(long)]
        node: Option<String>,
        /// Seconds between looks at topod's free map and slurmctld's node features.
        #[arg(long, default_value_t = 30)]
        interval: u64,
        /// Publish once and exit.
        #[arg(long)]
        once: bool,
        /// Print the features once, without publishing them, and exit.
        #[arg(long)]
        dry_run: bool,
        /// The scontrol to run.
        #[arg(long, default_value = "scontrol")]
        scontrol: String,
    },
    /// Ask the local topod: the jobs it holds CPUs for.
    Jobs {
        #[command(flatten)]
        daemon: Daemon,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Ask the local topod to place a job and make its cgroup (root or administrators).
    Alloc {
        #[command(flatten)]
        daemon: Daemon,
        /// The job id.
        #[arg(long)]
        job: String,
        /// Tasks when the request does not say.
        #[arg(long, short = 'n')]
        tasks: Option<u32>,
        /// Place only inside these CPUs (those the batch system gave the job).
        #[arg(long, value_name = "LIST")]
        cpus: Option<String>,
        /// Gang-schedule the job: it may share CPUs with gang jobs of other rows and takes turns
        /// with them by slices (topod.toml gang_rows).
        #[arg(long, conflicts_with = "no_gang")]
        gang: bool,
        /// Do not gang-schedule the job, whatever topod.toml gang_all_jobs says.
        #[arg(long)]
        no_gang: bool,
        /// The gang row to take (the same on every host of a multi-host job); implies --gang.
        #[arg(long, value_name = "ROW", conflicts_with = "no_gang")]
        gang_row: Option<u32>,
        /// A prime job: runs through every slice and shares no CPU.
        #[arg(long)]
        prime: bool,
        /// The batch system's queue (jobs of gang_prime_queues are prime).
        #[arg(long, value_name = "NAME")]
        queue: Option<String>,
        /// When the job does not fit, it may suspend running preemptible jobs (topod.toml
        /// preempt = true); needs --submitted-at and --estimate.
        #[arg(long, requires_all = ["submitted_at", "estimate"])]
        preempt: bool,
        /// The job may be suspended for another; needs --submitted-at and --estimate.
        #[arg(long, requires_all = ["submitted_at", "estimate"])]
        preemptible: bool,
        /// When the batch system took the job, seconds since the epoch.
        #[arg(long, value_name = "SECONDS")]
        submitted_at: Option<i64>,
        /// The job's estimated run time (its time limit), seconds.
        #[arg(long, value_name = "SECONDS")]
        estimate: Option<u64>,
        /// A malleable job (request *min-max): the signal topod sends its processes after a
        /// resize, e.g. 10 (SIGUSR1).
        #[arg(long, value_name = "SIGNAL")]
        resize_signal: Option<i32>,
        /// A prime-time pool (topod.toml prime_pools) the job may use inside its windows.
        #[arg(long, value_name = "NAME")]
        pool: Option<String>,
        /// The user the job runs as (a name or a uid): that user may then move its own
        /// processes in (topo-exec), shrink the job, and suspend and resume it.
        #[arg(long, value_name = "USER", value_parser = parse_owner)]
        owner: Option<u32>,
        /// The request.
        request: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Ask the local topod to kill what is left of a job and free its CPUs (root or
    /// administrators).
    Release {
        #[command(flatten)]
        daemon: Daemon,
        /// The job id.
        job: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Ask the local topod to freeze every process of a job at once (the kernel's freezer); its
    /// memory stays where it is, and its CPUs may go to other jobs until it is resumed (root,
    /// administrators, or the job's owner).
    Suspend {
        #[command(flatten)]
        daemon: Daemon,
        /// The job id.
        job: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Ask the local topod to set a block of CPUs aside for a waiting job (root or
    /// administrators): other jobs are placed outside it, jobs running in it run on until they
    /// end, and the job is placed inside it when it is allocated. A new reservation for the same
    /// job replaces the old one.
    Reserve {
        #[command(flatten)]
        daemon: Daemon,
        /// The waiting job.
        #[arg(long)]
        job: String,
        /// How long it holds if the job is not allocated: seconds, or with a unit (90m, 2h, 1d);
        /// at most 30 days.
        #[arg(long = "for", value_name = "DURATION", value_parser = parse_duration_s)]
        duration: u64,
        /// Tasks when the request does not say.
        #[arg(long, short = 'n')]
        tasks: Option<u32>,
        /// Choose the block only inside these CPUs.
        #[arg(long, value_name = "LIST")]
        cpus: Option<String>,
        /// The block's shape, as a request: affinity[numa], affinity[core(8,same=l3)].
        request: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Ask the local topod to drop a job's reservation (root or administrators).
    Unreserve {
        #[command(flatten)]
        daemon: Daemon,
        /// The job.
        job: String,
    },
    /// Ask the local topod: the topology reservations it keeps.
    Reservations {
        #[command(flatten)]
        daemon: Daemon,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Ask the local topod to grow or shrink a running malleable job (request *min-max) to TASKS
    /// tasks within its range; the job hears of it through its notify file and its resize
    /// signal (root, administrators; the job's owner may only shrink it).
    Resize {
        #[command(flatten)]
        daemon: Daemon,
        /// The job id.
        job: String,
        /// Its new number of tasks.
        tasks: u32,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Ask the local topod to thaw a suspended job; refused, naming the job, while another job
    /// runs on its CPUs (root, administrators, or the job's owner if the owner suspended it).
    Resume {
        #[command(flatten)]
        daemon: Daemon,
        /// The job id.
        job: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// LSF host pre-exec (as root): place the job on this host from its environment
    /// ($LSB_JOBID, $TOPO_REQUEST, $LSB_MCPU_HOSTS) before it starts.
    LsfPreExec {
        #[command(flatten)]
        daemon: Daemon,
    },
    /// LSF host post-exec (as root): release the job on this host.
    LsfPostExec {
        #[command(flatten)]
        daemon: Daemon,
    },
    /// LSF JOB_CONTROLS SUSPEND action (as the job's user): freeze the job ($LSB_JOBID); for a
    /// job topod does not hold, SIGSTOP to $LSB_JOBPGIDS as LSF would.
    LsfSuspend {
        #[command(flatten)]
        daemon: Daemon,
    },
    /// LSF JOB_CONTROLS RESUME action (as the job's user): thaw the job once its CPUs are free,
    /// else fail (LSF keeps it suspended); for a job topod does not hold, SIGCONT.
    LsfResume {
        #[command(flatten)]
        daemon: Daemon,
    },
    /// Run a command in a new job on this host: allocate, run inside the job's cgroup, release.
    Run {
        #[command(flatten)]
        daemon: Daemon,
        /// The request.
        #[arg(long)]
        request: String,
        /// The job id [default: topoctl-run-PID].
        #[arg(long)]
        job: Option<String>,
        /// The command and its arguments.
        #[arg(required = true, last = true)]
        command: Vec<String>,
    },
    /// Place a short mixed job stream on a real machine (the 2-socket AMD EPYC 9654 from the
    /// shared topologies, or this host) and show the picture and the metrics.
    Demo {
        #[command(flatten)]
        source: Source,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Replay a workload trace (Standard Workload Format) on N hosts of one machine under
    /// cluster policies (fcfs, easy backfilling) and host strategies, through the same policy
    /// core and placement code topod runs; print a table, JSON, and pictures.
    Simulate(simulate::SimulateOpts),
    /// Print the protocol between topod and its clients as a JSON Schema (the file
    /// packaging/protocol.schema.json, which the PBS hook reads replies against).
    ProtocolSchema,
    #[command(flatten)]
    Docs(docs::Docs),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Measure a running topod: job start (allocate with join_pid in one request, and allocate
    /// then join in two) and release against the same cgroup v1 operations done directly (as
    /// root), allocate/release pairs per second with concurrent clients, and topod's memory
    /// with many live jobs.
    Daemon {
        #[command(flatten)]
        daemon: Daemon,
        /// Start/release cycles to time.
        #[arg(long, default_value_t = 300)]
        cycles: usize,
        /// Concurrent clients for the throughput figure.
        #[arg(long, default_value_t = 8)]
        clients: usize,
        /// Instead: root's job start and release, and `topoctl status`, while unprivileged
        /// clients attack (two loop 64 KiB fit requests; then one user holds N idle
        /// connections; then a job of that user's spins --spinners threads on all the CPUs
        /// but one). Needs root.
        #[arg(long, value_name = "N")]
        hostile: Option<usize>,
        /// With --hostile: the spinning job's threads (0: no such phase).
        #[arg(long, value_name = "N", default_value_t = 400, requires = "hostile")]
        spinners: usize,
        /// With --hostile: the spinning job takes every free CPU (a full host); root's cycles
        /// are then `fit` and `list`, and this program runs at topod's priority (nice -10).
        #[arg(long, requires = "hostile")]
        spin_everywhere: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Gang time slicing on real cgroups: the CPU time two jobs sharing a CPU lose per switch
    /// and per second, and the skew between two topods' slice boundaries. Starts its own topods
    /// (from beside topoctl) on subtrees of their own. Needs root and two CPUs.
    Gang {
        /// Slice lengths to measure, seconds, comma-separated.
        #[arg(long, value_name = "LIST", default_value = "1,10,30")]
        slices: String,
        /// Slices per measurement (the baseline before it is as long).
        #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u32).range(2..=1000))]
        per_run: u32,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Suspend and resume of a job of busy processes: the kernel's freezer (until the kernel
    /// reports the cgroup frozen, then thawed) against SIGSTOP/SIGCONT to the same processes
    /// (until every one shows state T, then none). Needs root; makes and removes its own
    /// cgroups.
    Freeze {
        /// Busy processes in the job.
        #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
        processes: u64,
        /// Rounds (each: one freeze and thaw, one SIGSTOP and SIGCONT).
        #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=100_000))]
        rounds: u64,
        /// Freeze through a cgroup v2 `cgroup.freeze` even where topod would use v1 (a hybrid
        /// host's v2 mount has the freezer without cpuset).
        #[arg(long)]
        v2_freezer: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// A running malleable job (the program of tests/malleable/build.sh, started by topo-exec
    /// in a running topod) shrunk and expanded: the time from the resize request to topod's
    /// reply, to every thread on the new CPUs, and to the program's own line for the change.
    /// Needs root and real cgroups.
    Resize(bench::resize::ResizeOpts),
    /// One move of a running job on real cgroups (the cgroup rewrite of a defragmenting
    /// migration): the job's CPUs alone (to every thread on the new CPUs), and, where the host
    /// has two NUMA nodes, its CPUs and its memory (1 GiB by default) to the other node (to 99%
    /// of its pages there). Needs root; makes and removes its own cgroups.
    Migrate(bench::migrate::MigrateOpts),
    /// An attacker for `bench daemon --hostile` (runs until killed).
    #[command(hide = true)]
    Attack {
        #[command(flatten)]
        daemon: Daemon,
        #[arg(long)]
        mode: String,
        #[arg(long, default_value_t = 0)]
        count: usize,
        #[arg(long)]
        stats: PathBuf,
    },
    /// Replay a seeded job stream per strategy on each topology and compare placement quality.
    Placement {
        /// Topology files (hwloc XML) or sysfs roots; default: every XML topology in the shared
        /// topologies folder.
        #[arg(long = "topology", value_name = "FILE")]
        topologies: Vec<PathBuf>,
        /// Strategies to compare (best-fit, pack, balance, first-fit, buddy, k8s-static,
        /// slurm-block); default: all.
        #[arg(long = "strategy", short, value_parser = parse_strategy)]
        strategies: Vec<Strategy>,
        /// Seed of the job stream.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Jobs in the stream.
        #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
        jobs: u64,
        /// Print one JSON object per (topology, strategy), one per line.
        #[arg(long)]
        json: bool,
        /// Replay each stream once more with defragmenting migration: a job refused while
        /// enough PUs are free moves running jobs when topo_core::defrag finds a plan. Reports
        /// the rejections without and with it, the moves, the PUs moved, the locality where
        /// jobs end up and the planner's time per call (with --json, one more object per
        /// topology and strategy, with "rejected_while_free_without").
        #[arg(long)]
        migrate: bool,
        /// With --migrate: jobs one plan may move, at most.
        #[arg(long, value_name = "N", default_value_t = topo_core::defrag::DefragLimits::default().max_moves)]
        max_moves: usize,
    },
}

// No group of its own: `bench daemon`'s variant already makes one named Daemon (clap's checks
// of the whole command, which `topoctl man` and `completions` build, refuse two).
#[derive(Args)]
#[group(skip)]
struct Daemon {
    /// topod's socket.
    #[arg(long, value_name = "PATH", default_value = topo_core::proto::DEFAULT_SOCKET)]
    socket: PathBuf,
}

#[derive(Args)]
struct Source {
    /// An hwloc XML v2 file (e.g. from `lstopo --of xml`), or a directory holding `sys/` and
    /// `proc/` (an extracted `hwloc-gather-topology` snapshot).
    #[arg(long, value_name = "FILE", conflicts_with = "sysfs")]
    topology: Option<PathBuf>,
    /// A directory holding `sys/` and `proc/`, read like this host's /sys.
    #[arg(long, value_name = "DIR")]
    sysfs: Option<PathBuf>,
}

fn parse_strategy(s: &str) -> Result<Strategy, String> {
    s.parse().map_err(|e: place::UnknownStrategy| e.to_string())
}

fn parse_cpus(s: &str) -> Result<CpuSet, String> {
    CpuSet::parse_list(s).map_err(|e| e.to_string())
}

/// A failure that ends the command, with the exit code to use.
pub(crate) struct Failure {
    message: String,
    code: u8,
}

impl Failure {
    pub(crate) fn input(message: impl Into<String>) -> Self {
        Failure { message: message.into(), code: 2 }
    }
    pub(crate) fn runtime(message: impl Into<String>) -> Self {
        Failure { message: message.into(), code: 1 }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

fn main() -> ExitCode {
    // Like other command-line tools: output cut short by a closed pipe (`topoctl demo | head`)
    // ends topoctl quietly, instead of a panic on the next print.
    // SAFETY: restores the default disposition before any thread starts; no handler of ours.
    let _ = unsafe { nix::sys::signal::signal(Signal::SIGPIPE, SigHandler::SigDfl) };
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Show { source, json } => show(&source, json),
        Command::Check { request, queue_default, queue_mandatory, json } => {
            check(&request, queue_default.as_deref(), queue_mandatory.as_deref(), json)
        }
        Command::Place { source, strategy, tasks, reserve, requests, json } => {
            place_cmd(&source, strategy, tasks, reserve.unwrap_or_default(), &requests, json)
        }
        Command::Bench {
            what:
                BenchCommand::Daemon {
                    daemon,
                    cycles,
                    hostile: Some(n),
                    spinners,
                    spin_everywhere,
                    json,
                    ..
                },
        } => bench::hostile::run(&daemon.socket, cycles, n, spinners, spin_everywhere, json),
        Command::Bench {
            what: BenchCommand::Daemon { daemon, cycles, clients, hostile: None, json, .. },
        } => bench::daemon::run(&daemon.socket, cycles, clients, json),
        Command::Bench { what: BenchCommand::Freeze { processes, rounds, v2_freezer, json } } => {
            bench::freeze::run(processes as usize, rounds as usize, v2_freezer, json)
        }
        Command::Bench { what: BenchCommand::Gang { slices, per_run, json } } => slices
            .split(',')
            .map(|s| {
                s.trim().parse::<u64>().ok().filter(|t| (1..=3600).contains(t)).ok_or_else(|| {
                    Failure::input(format!(
                        "--slices {slices:?}: {s:?} is not a slice length (1 to 3600 seconds)"
                    ))
                })
            })
            .collect::<Result<Vec<u64>, Failure>>()
            .and_then(|list| bench::gang::run(&list, per_run, json)),
        Command::Bench { what: BenchCommand::Resize(opts) } => bench::resize::run(opts),
        Command::Bench { what: BenchCommand::Migrate(opts) } => bench::migrate::run(opts),
        Command::Bench { what: BenchCommand::Attack { daemon, mode, count, stats } } => {
            bench::hostile::attack(&daemon.socket, &mode, count, &stats)
        }
        Command::Bench {
            what:
                BenchCommand::Placement { topologies, strategies, seed, jobs, json, migrate, max_moves },
        } => {
            let migrate = migrate.then(|| topo_core::defrag::DefragLimits {
                max_moves,
                ..topo_core::defrag::DefragLimits::default()
            });
            bench::placement::run(&topologies, &strategies, seed, jobs as usize, json, migrate)
        }
        Command::Demo { source, json } => demo(&source, json),
        Command::Simulate(opts) => simulate::run(opts),
        Command::ProtocolSchema => print_json(&topo_core::proto::schema::document()),
        Command::Docs(d) => docs::run(d, <Cli as clap::CommandFactory>::command()),
        Command::Status { daemon, json } => status(&daemon, json),
        Command::Jobs { daemon, json } => jobs(&daemon, json),
        Command::SlurmFeatures { daemon, node, interval, once, dry_run, scontrol } => {
            slurm_features::run(&daemon, node, interval, once, dry_run, &scontrol)
        }
        Command::Alloc {
            daemon,
            job,
            tasks,
            cpus,
            gang,
            no_gang,
            gang_row,
            prime,
            queue,
            preempt,
            preemptible,
            submitted_at,
            estimate,
            resize_signal,
            pool,
            owner,
            request,
            json,
        } => alloc_and_print(
            &daemon,
            Op::Allocate(topo_core::proto::AllocateArgs {
                tasks,
                cpus,
                gang: if gang || gang_row.is_some() {
                    Some(true)
                } else if no_gang {
                    Some(false)
                } else {
                    None
                },
                gang_row,
                prime,
                queue,
                preempt,
                preemptible,
                submitted_at,
                estimate_s: estimate,
                resize_signal,
                pool,
                owner_uid: owner,
                ..topo_core::proto::AllocateArgs::new(job, request)
            }),
            json,
        ),
        Command::Release { daemon, job, json } => release_and_print(&daemon, job, json),
        Command::Suspend { daemon, job, json } => suspend_and_print(&daemon, job, json),
        Command::Resume { daemon, job, json } => resume_and_print(&daemon, job, json),
        Command::Resize { daemon, job, tasks, json } => resize_and_print(&daemon, job, tasks, json),
        Command::Reserve { daemon, job, duration, tasks, cpus, request, json } => {
            reserve_and_print(
                &daemon,
                topo_core::proto::ReserveArgs { job, request, tasks, cpus, expires_in_s: duration },
                json,
            )
        }
        Command::Unreserve { daemon, job } => unreserve_and_print(&daemon, job),
        Command::Reservations { daemon, json } => reservations(&daemon, json),
        Command::Run { daemon, request, job, command } => run_job(&daemon, request, job, &command),
        Command::LsfPreExec { daemon } => lsf::pre_exec(&daemon),
        Command::LsfPostExec { daemon } => lsf::post_exec(&daemon),
        Command::LsfSuspend { daemon } => lsf::suspend(&daemon),
        Command::LsfResume { daemon } => lsf::resume(&daemon),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("topoctl: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}

fn load(source: &Source) -> Result<Topology, Failure> {
    match (&source.topology, &source.sysfs) {
        (Some(path), _) => load_path(path),
        (None, Some(dir)) => sysfs::read(dir).map_err(|e| Failure::input(e.to_string())),
        (None, None) => sysfs::read(Path::new("/"))
            .map_err(|e| Failure::runtime(format!("reading this host: {e}"))),
    }
}

fn load_path(path: &Path) -> Result<Topology, Failure> {
    if path.is_dir() {
        return sysfs::read(path).map_err(|e| Failure::input(e.to_string()));
    }
    let name = path.to_string_lossy();
    if name.ends_with(".tar.bz2") || name.ends_with(".tar") {
        return Err(Failure::input(format!(
            "{name} is an archive; extract it first (tar xjf {name}) and pass the directory that holds sys/ and proc/"
        )));
    }
    hwloc_xml::read_file(path).map_err(|e| Failure::input(e.to_string()))
}

pub(crate) fn print_json<T: Serialize>(value: &T) -> Result<(), Failure> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| Failure::runtime(format!("cannot write JSON: {e}")))?;
    println!("{text}");
    Ok(())
}

fn show(source: &Source, json: bool) -> Result<(), Failure> {
    let topo = load(source)?;
    if json {
        #[derive(Serialize)]
        struct Shown<'a> {
            #[serde(flatten)]
            counts: topo_core::topology::Counts,
            topology: &'a Topology,
        }
        return print_json(&Shown { counts: topo.counts(), topology: &topo });
    }
    print!("{}", picture::render(&topo, &Ledger::new(), &Marks::default()));
    Ok(())
}

fn parse_request(text: &str) -> Result<Request, Failure> {
    request::parse(text).map_err(|e| Failure::input(format!("bad request\n{}", e.render(text))))
}

fn check(
    job: &str,
    queue_default: Option<&str>,
    queue_mandatory: Option<&str>,
    json: bool,
) -> Result<(), Failure> {
    let blank = |s: Option<&str>| s.is_none_or(|s| s.trim().is_empty());
    if blank(Some(job)) && blank(queue_default) && blank(queue_mandatory) {
        // The Slurm plug-in refuses `--topology=` with nothing in it; so does the check.
        let failure = Failure::input(
            "empty request: nothing to check; a request is CPUSET[...] and/or affinity[...], \
             for example affinity[core(2)]",
        );
        if json {
            let _ = print_json(
                &serde_json::json!({ "error": { "message": failure.message, "text": failure.message, "source": "job" } }),
            );
        }
        return Err(failure);
    }
    let merged =
        request::merge_extsched(queue_mandatory, Some(job), queue_default).map_err(|e| {
            // Words for whoever typed it (a Slurm, PBS or LSF user, or an administrator trying a
            // queue's strings), not LSF's names for the three strings.
            let (input, which) = match e.source_string {
                request::ExtschedSource::QueueMandatory => {
                    (queue_mandatory.unwrap_or_default(), " in --queue-mandatory")
                }
                request::ExtschedSource::Job => (job, ""),
                request::ExtschedSource::QueueDefault => {
                    (queue_default.unwrap_or_default(), " in --queue-default")
                }
            };
            let failure = Failure::input(format!("bad request{which}\n{}", e.error.render(input)));
            if json {
                // The same words on stderr, and for programs (the PBS hook) the parts on stdout.
                let _ = print_json(&check_error_json(&e, &failure.message));
            }
            failure
        })?;
    if json {
        #[derive(Serialize)]
        struct Checked<'a> {
            canonical: String,
            request: &'a Request,
        }
        return print_json(&Checked { canonical: merged.to_string(), request: &merged });
    }
    println!("{merged}");
    Ok(())
}

/// `check --json` on a bad request: `message` is the one-line description (the last line of the
/// text form), `text` the whole text form as printed on stderr after `topoctl: `.
fn check_error_json(e: &request::MergeError, text: &str) -> serde_json::Value {
    let source = match e.source_string {
        request::ExtschedSource::QueueMandatory => "queue_mandatory",
        request::ExtschedSource::Job => "job",
        request::ExtschedSource::QueueDefault => "queue_default",
    };
    serde_json::json!({ "error": {
        "message": e.error.to_string(),
        "source": source,
        "byte": e.error.span.start,
        "fragment": e.error.fragment,
        "expected": e.error.expected,
        "text": text,
    }})
}

#[derive(Serialize)]
struct Placed {
    job: String,
    request: String,
    #[serde(flatten)]
    outcome: Outcome,
}

#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
enum Outcome {
    Placed { placement: Box<Placement>, score: u64 },
    Rejected { reason: String },
}

fn place_cmd(
    source: &Source,
    strategy: Strategy,
    tasks: u32,
    reserve: CpuSet,
    requests: &[String],
    json: bool,
) -> Result<(), Failure> {
    let topo = load(source)?;
    let model = HostModel::new(&topo, &reserve).map_err(|e| Failure::input(e.to_string()))?;
    let mut parsed = Vec::with_capacity(requests.len());
    for text in requests {
        let mut r = parse_request(text)?;
        r.tasks.get_or_insert(tasks);
        parsed.push(r);
    }
    let (ledger, placed) = place_all(&model, &parsed, strategy);
    if json {
        #[derive(Serialize)]
        struct Out<'a> {
            topology: &'a str,
            strategy: Strategy,
            jobs: &'a [Placed],
            host: HostMetrics,
        }
        return print_json(&Out {
            topology: topo.short_name(),
            strategy,
            jobs: &placed,
            host: HostMetrics::measure(&model, ledger.occupancy()),
        });
    }
    print!(
        "{}",
        picture::render(&topo, &ledger, &Marks { reserved: reserve.intersection(&topo.pus) })
    );
    println!();
    print_outcomes(&placed);
    print_host_metrics(&HostMetrics::measure(&model, ledger.occupancy()));
    Ok(())
}

fn place_all(model: &HostModel, requests: &[Request], strategy: Strategy) -> (Ledger, Vec<Placed>) {
    let mut ledger = Ledger::new();
    let mut out = Vec::new();
    for (i, req) in requests.iter().enumerate() {
        let job = format!("job{}", i + 1);
        let canonical = req.to_string();
        let outcome = match place::place(model, ledger.occupancy(), req, strategy) {
            Ok(p) => match ledger.allocate(&job, &p, &canonical) {
                Ok(_) => {
                    Outcome::Placed { score: place::score(&p.metrics), placement: Box::new(p) }
                }
                Err(e) => Outcome::Rejected { reason: e.to_string() },
            },
            Err(e) => Outcome::Rejected { reason: e.to_string() },
        };
        out.push(Placed { job, request: canonical, outcome });
    }
    (ledger, out)
}

fn print_outcomes(placed: &[Placed]) {
    println!(
        "{:<6} {:>4} {:>9} {:>9} {:>6} {:>4} {:>6}  request",
        "job", "PUs", "NUMA/min", "L3/min", "radius", "SMT", "score"
    );
    for p in placed {
        match &p.outcome {
            Outcome::Placed { placement, score } => {
                let m = &placement.metrics;
                println!(
                    "{:<6} {:>4} {:>9} {:>9} {:>6} {:>4} {:>6}  {}",
                    p.job,
                    m.cpus,
                    format!("{}/{}", m.numa_nodes, m.min_numa_nodes),
                    format!("{}/{}", m.l3_groups, m.min_l3_groups),
                    m.radius,
                    m.smt_shared,
                    score,
                    p.request
                );
            }
            Outcome::Rejected { reason } => {
                println!("{:<6} rejected: {reason}\n       request {}", p.job, p.request)
            }
        }
    }
}

fn print_host_metrics(h: &HostMetrics) {
    let n = |count: usize, one: &str, many: &str| {
        format!("{count} {}", if count == 1 { one } else { many })
    };
    println!(
        "\nfree: {}, {}, {}, {}, {}; most in one L3 {}, in one NUMA node {}, in one package {}",
        n(h.free_cpus, "PU", "PUs"),
        n(h.free_cores, "whole core", "whole cores"),
        n(h.free_l3_groups, "whole L3 group", "whole L3 groups"),
        n(h.free_numa_nodes, "whole NUMA node", "whole NUMA nodes"),
        n(h.free_sockets, "whole package", "whole packages"),
        h.largest_in_one_l3,
        h.largest_in_one_numa,
        h.largest_in_one_socket
    );
}

/// Where the shared topologies live: `$TOPO_SHARED_DIR/topologies` (the variable the test
/// suite uses too), or a `shared/topologies` folder next to (or above) the current directory or
/// the source tree.
fn shared_topologies() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("TOPO_SHARED_DIR") {
        return Some(PathBuf::from(dir).join("topologies"));
    }
    let mut starts: Vec<PathBuf> = Vec::new();
    if let Ok(cwd) = std::env::current_dir() {
        starts.push(cwd);
    }
    starts.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    for start in starts {
        for dir in start.ancestors().take(4) {
            let candidate = dir.join("shared").join("topologies");
            if candidate.is_dir() {
                return Some(candidate);
            }
        }
    }
    None
}

/// The demo's job mix: every syntax, the shapes of the benchmark, and one that cannot fit.
const DEMO_REQUESTS: &[&str] = &[
    "affinity[core(8,same=l3)*2:membind=localonly]",
    "affinity[thread*6]",
    "CPUSET[CPUSET_OPTIONS=CPUSET_CPU_EXCLUSIVE;MAX_RADIUS=0] affinity[thread*3]",
    "affinity[core(4,same=numa,exclusive=(core,alljobs))*4:cpubind=core:distribute=pack]",
    "affinity[thread*40]",
    "affinity[core(2,same=socket)*8:distribute=balance]",
    "affinity[numa*1]",
    "affinity[thread*1]",
];

/// The machine `topoctl demo` places on when given none: a real Dell PowerEdge R740 (2x Xeon Gold
/// 6230, SNC2: 4 NUMA nodes, SMT, a distance matrix), bundled (see `topod/data/README.md`).
const DEMO_MACHINE: (&str, &str) = (
    "dell-r740-2x-xeon-gold-6230-snc2.xml",
    include_str!("../../../data/dell-r740-2x-xeon-gold-6230-snc2.xml"),
);

fn demo(source: &Source, json: bool) -> Result<(), Failure> {
    let topo = if source.topology.is_some() || source.sysfs.is_some() {
        load(source)?
    } else {
        hwloc_xml::parse(DEMO_MACHINE.0, DEMO_MACHINE.1)
            .map_err(|e| Failure::runtime(format!("the bundled demo machine: {e}")))?
    };
    let model = HostModel::new(&topo, &CpuSet::new()).map_err(|e| Failure::input(e.to_string()))?;
    let requests: Vec<Request> =
        DEMO_REQUESTS.iter().map(|t| parse_request(t)).collect::<Result<_, _>>()?;
    let (ledger, placed) = place_all(&model, &requests, Strategy::BestFit);
    if json {
        return print_json(&placed);
    }
    let done = placed.iter().filter(|p| matches!(p.outcome, Outcome::Placed { .. })).count();
    println!(
        "topo demo: {} requests placed best-fit, one after the other, on {}: {done} placed, {} refused\n",
        requests.len(),
        topo.short_name(),
        requests.len() - done
    );
    print!("{}", picture::render(&topo, &ledger, &Marks::default()));
    println!();
    print_outcomes(&placed);
    print_host_metrics(&HostMetrics::measure(&model, ledger.occupancy()));
    println!(
        "\nNUMA/min, L3/min: the NUMA nodes and L3 groups a job spans, and the fewest its size allows.\n\
         radius: the largest NUMA distance between its CPUs (10 = all local). SMT: hardware threads\n\
         it shares a core with another job on. score: how far from the tightest placement (0 =\n\
         tightest; the LSF module ranks hosts by it)."
    );
    Ok(())
}

fn connect(daemon: &Daemon) -> Result<Client, Failure> {
    Client::connect(&daemon.socket).map_err(|e| Failure::runtime(e.to_string()))
}

/// Sends `op` and reads its reply as `T` (see `topo_core::proto::reply`).
pub(crate) fn call<T: serde::de::DeserializeOwned>(
    client: &mut Client,
    op: Op,
) -> Result<T, Failure> {
    client.call_as(op).map_err(|e| Failure::runtime(e.to_string()))
}

fn live_state(daemon: &Daemon) -> Result<(Topology, Vec<JobView>, FreeMap), Failure> {
    let mut c = connect(daemon)?;
    Ok((call(&mut c, Op::Topology)?, call(&mut c, Op::List)?, call(&mut c, Op::FreeMap)?))
}

fn status(daemon: &Daemon, json: bool) -> Result<(), Failure> {
    let (topo, jobs, free) = live_state(daemon)?;
    if json {
        return print_json(
            &serde_json::json!({ "topology": topo, "jobs": jobs, "free_map": free }),
        );
    }
    let mut ledger = Ledger::new();
    // Running jobs first: a suspended job's CPUs may be lent to one of them.
    let (frozen, jobs): (Vec<JobView>, Vec<JobView>) =
        jobs.into_iter().partition(|j| j.state == JobState::Frozen);
    let (suspended, running): (Vec<JobView>, Vec<JobView>) =
        jobs.into_iter().partition(|j| j.state == JobState::Suspended || !j.lent_to.is_empty());
    for j in running {
        ledger
            .insert(j.allocation)
            .map_err(|e| Failure::runtime(format!("topod's job list is inconsistent: {e}")))?;
    }
    for j in suspended {
        ledger
            .insert_suspended(j.allocation)
            .map_err(|e| Failure::runtime(format!("topod's job list is inconsistent: {e}")))?;
    }
    for j in frozen {
        ledger
            .insert_gang_frozen(j.allocation)
            .map_err(|e| Failure::runtime(format!("topod's job list is inconsistent: {e}")))?;
    }
    let reserved = topo.allowed.difference(&free.allocatable);
    print!("{}", picture::render(&topo, &ledger, &Marks { reserved }));
    println!("\ngeneration {}, {} job(s)", free.generation, free.jobs);
    Ok(())
}

fn jobs(daemon: &Daemon, json: bool) -> Result<(), Failure> {
    let (_, jobs, _) = live_state(daemon)?;
    if json {
        return print_json(&jobs);
    }
    if jobs.is_empty() {
        println!("no jobs");
        return Ok(());
    }
    // The first four columns stay where scripts read them (job, PUs, CPUs, mems).
    println!(
        "{:<16} {:>4}  {:<24} {:<8} {:<9} {:>6}  request",
        "job", "PUs", "CPUs", "mems", "state", "owner"
    );
    for j in jobs {
        let a = &j.allocation;
        let owner = j.owner_uid.map(|u| u.to_string()).unwrap_or_else(|| "-".into());
        println!(
            "{:<16} {:>4}  {:<24} {:<8} {:<9} {:>6}  {}",
            a.job,
            a.cpus.len(),
            a.cpus.to_string(),
            a.mems.to_string(),
            j.state.to_string(),
            owner,
            match a.gang_row {
                Some(row) => format!("{} (gang row {row})", a.request),
                None => a.request.clone(),
            }
        );
        if let Some(preemptor) = &j.preempted_by {
            println!(
                "{:<16} suspended by topod for job {preemptor}; resumed by topod once its CPUs are free of running jobs and of {preemptor}",
                ""
            );
        }
        for (holder, cpus) in &j.lent_to {
            println!("{:<16} CPUs {cpus} lent to job {holder}", "");
        }
        for (owner, cpus) in &j.borrowed_from {
            println!("{:<16} CPUs {cpus} borrowed from suspended job {owner}", "");
        }
        if let Some(m) = &j.missized {
            println!("{:<16} mis-sized ({}): {}", "", m.kind.as_str(), m.reason);
        }
        let mut from = Vec::new();
        if let Some(queue) = &j.queue {
            from.push(format!("queue {queue}"));
        }
        if let Some(pool) = &j.pool {
            from.push(format!("asks for prime-time pool {pool}"));
        }
        if !from.is_empty() {
            println!("{:<16} {}", "", from.join(", "));
        }
        if let Some(cap) = j.tasks_cap {
            println!(
                "{:<16} its last resize asked for {cap} tasks: equipartition grows it no further",
                ""
            );
        }
    }
    Ok(())
}

fn alloc_and_print(daemon: &Daemon, op: Op, json: bool) -> Result<(), Failure> {
    let a: Allocation = call(&mut connect(daemon)?, op)?;
    if json {
        return print_json(&a);
    }
    match a.gang_row {
        Some(row) => println!(
            "job {}: CPUs {}, memory nodes {}, gang row {row} (shares its CPUs with other rows' jobs, taking turns)",
            a.job, a.cpus, a.mems
        ),
        None => println!("job {}: CPUs {}, memory nodes {}", a.job, a.cpus, a.mems),
    }
    Ok(())
}

fn release_and_print(daemon: &Daemon, job: String, json: bool) -> Result<(), Failure> {
    let r: Release = call(&mut connect(daemon)?, Op::Release { job })?;
    if json {
        return print_json(&r);
    }
    println!("job {} released ({} process(es) killed)", r.job, r.killed);
    Ok(())
}

fn suspend_and_print(daemon: &Daemon, job: String, json: bool) -> Result<(), Failure> {
    let r: topo_core::proto::reply::Suspend = call(&mut connect(daemon)?, Op::Suspend { job })?;
    if json {
        return print_json(&r);
    }
    println!(
        "job {} suspended: frozen in {:.1} ms; its CPUs {} may be lent until it is resumed",
        r.job,
        r.frozen_after_us as f64 / 1000.0,
        r.cpus
    );
    Ok(())
}

/// `3600`, `90s`, `90m`, `2h`, `1d`: seconds.
fn parse_duration_s(text: &str) -> Result<u64, String> {
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => text.split_at(i),
        None => (text, "s"),
    };
    let scale = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => {
            return Err(format!(
                "{text:?}: a number of seconds, or with a unit s, m, h or d (90m, 2h)"
            ))
        }
    };
    digits.parse::<u64>().ok().and_then(|n| n.checked_mul(scale)).ok_or_else(|| {
        format!("{text:?}: a number of seconds, or with a unit s, m, h or d (90m, 2h)")
    })
}

fn reserve_and_print(
    daemon: &Daemon,
    args: topo_core::proto::ReserveArgs,
    json: bool,
) -> Result<(), Failure> {
    let r: topo_core::proto::reply::Reserve = call(&mut connect(daemon)?, Op::Reserve(args))?;
    if json {
        return print_json(&r);
    }
    let until = r.reservation.expires_at - r.reservation.made_at;
    if r.busy.is_empty() {
        println!(
            "job {}: CPUs {} reserved for {until} s; all free now",
            r.reservation.job, r.reservation.cpus
        );
    } else {
        println!(
            "job {}: CPUs {} reserved for {until} s; {} of them ({}) are busy until their jobs end",
            r.reservation.job,
            r.reservation.cpus,
            r.busy.len(),
            r.busy
        );
    }
    Ok(())
}

fn unreserve_and_print(daemon: &Daemon, job: String) -> Result<(), Failure> {
    let r: topo_core::reservation::Reservation =
        call(&mut connect(daemon)?, Op::Unreserve { job })?;
    println!("job {}: reservation of CPUs {} dropped", r.job, r.cpus);
    Ok(())
}

fn reservations(daemon: &Daemon, json: bool) -> Result<(), Failure> {
    let free: topo_core::proto::reply::FreeMap = call(&mut connect(daemon)?, Op::FreeMap)?;
    if json {
        return print_json(&free.reservations);
    }
    if free.reservations.is_empty() {
        println!("no topology reservations");
        return Ok(());
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    println!("{:<16} {:>4}  {:<24} {:>10}  request", "job", "PUs", "CPUs", "expires in");
    for r in &free.reservations {
        println!(
            "{:<16} {:>4}  {:<24} {:>9}s  {}",
            r.job,
            r.cpus.len(),
            r.cpus.to_string(),
            (r.expires_at - now).max(0),
            r.request
        );
    }
    Ok(())
}

fn resize_and_print(daemon: &Daemon, job: String, tasks: u32, json: bool) -> Result<(), Failure> {
    let a: topo_core::ledger::Allocation =
        call(&mut connect(daemon)?, Op::Resize { job: job.clone(), tasks })?;
    if json {
        return print_json(&a);
    }
    println!(
        "job {job} now runs {} tasks on CPUs {} (memory nodes {})",
        a.tasks.len(),
        a.cpus,
        a.mems
    );
    Ok(())
}

fn resume_and_print(daemon: &Daemon, job: String, json: bool) -> Result<(), Failure> {
    let r: topo_core::proto::reply::Resume = call(&mut connect(daemon)?, Op::Resume { job })?;
    if json {
        return print_json(&r);
    }
    println!(
        "job {} resumed on CPUs {} (thawed in {:.1} ms)",
        r.job,
        r.cpus,
        r.thawed_after_us as f64 / 1000.0
    );
    Ok(())
}

fn run_job(
    daemon: &Daemon,
    request: String,
    job: Option<String>,
    command: &[String],
) -> Result<(), Failure> {
    let job = job.unwrap_or_else(|| format!("topoctl-run-{}", std::process::id()));
    let mut c = connect(daemon)?;
    let alloc: Allocation =
        call(&mut c, Op::Allocate(topo_core::proto::AllocateArgs::new(job.clone(), request)))?;
    eprintln!("topoctl: job {job} on CPUs {}", alloc.cpus);
    // topo-exec moves itself into the job's cgroup before it execs the command, so nothing the
    // command forks can start outside.
    let topo_exec = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("topo-exec")))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("topo-exec"));
    drop(c);
    // Like a shell waiting for its foreground job: a Ctrl-C or Ctrl-\\ at the terminal reaches the
    // command (same process group) and ends it, and topoctl stays to release the job.
    let ignored = [Signal::SIGINT, Signal::SIGQUIT].map(|sig| {
        // SAFETY: SIG_IGN installs no handler of ours; the previous disposition is put back below.
        unsafe { nix::sys::signal::signal(sig, SigHandler::SigIgn) }.ok().map(|old| (sig, old))
    });
    let status = std::process::Command::new(&topo_exec)
        .arg("--socket")
        .arg(&daemon.socket)
        .args(["--job", &job, "--"])
        .args(command)
        .status();
    for (sig, old) in ignored.into_iter().flatten() {
        // SAFETY: puts back the disposition `signal` returned above.
        let _ = unsafe { nix::sys::signal::signal(sig, old) };
    }
    // A new connection: topod closes idle ones, and the command may have run for hours.
    let released =
        connect(daemon).and_then(|mut c| call::<Release>(&mut c, Op::Release { job: job.clone() }));
    let status =
        status.map_err(|e| Failure::runtime(format!("running {}: {e}", topo_exec.display())))?;
    released.map_err(|e| {
        Failure::runtime(format!(
            "releasing job {job}: {}; release it with: topoctl release {job}",
            e.message
        ))
    })?;
    if status.success() {
        Ok(())
    } else {
        Err(Failure {
            message: format!("{} exited with {status}", command[0]),
            code: status.code().map_or(1, |c| c.clamp(1, 255) as u8),
        })
    }
}

/// `--owner`: a uid, or a user name looked up on this host.
fn parse_owner(text: &str) -> Result<u32, String> {
    if let Ok(uid) = text.parse::<u32>() {
        return Ok(uid);
    }
    match nix::unistd::User::from_name(text) {
        Ok(Some(user)) => Ok(user.uid.as_raw()),
        Ok(None) => Err(format!("no user {text:?} on this host (give a name it knows, or a uid)")),
        Err(e) => Err(format!("cannot look up user {text:?}: {e}")),
    }
}
