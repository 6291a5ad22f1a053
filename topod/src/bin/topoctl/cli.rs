//! topoctl's command line: every command, its options and their checks (clap).

use crate::{bench, docs, simulate};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use topo_core::place::{self, Strategy};
use topo_core::CpuSet;

#[derive(Parser)]
#[command(
    name = "topoctl",
    version,
    about = "Topology-aware job placement: look at hosts, check requests, try placements"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
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
        /// The GPUs the batch system gave the job, comma-separated: PCI addresses, names
        /// `topoctl show` lists, or device files (/dev/nvidia0, sent as their device numbers):
        /// its CPUs go near them as the request's gpubind= says.
        #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = parse_gpu)]
        gpus: Vec<String>,
        /// How many of the job's GPUs the batch system counted in each NUMA node,
        /// comma-separated NODE:COUNT (PBS's per-NUMA vnodes: 0:1,1:1): topod takes that many
        /// free GPUs in each node for the request's gpus=.
        #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = parse_numa_gpus, conflicts_with = "gpus")]
        gpus_by_numa: Vec<topo_core::proto::NumaGpus>,
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
        /// The block's shape, as a request: `affinity[numa]`, `affinity[core(8,same=l3)]`.
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
    /// Replay a workload trace (Standard Workload Format) on N hosts of one machine, or a
    /// cluster of partitions of several machines (--cluster), under cluster policies (fcfs; easy and conservative backfilling) and host strategies, through
    /// the same policy core and placement code topod runs; print a table, JSON, and pictures.
    Simulate(simulate::SimulateOpts),
    /// Print the protocol between topod and its clients as a JSON Schema (the file
    /// packaging/protocol.schema.json, which the PBS hook reads replies against).
    ProtocolSchema,
    #[command(flatten)]
    Docs(docs::Docs),
}

#[derive(Subcommand)]
pub(crate) enum BenchCommand {
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
pub(crate) struct Daemon {
    /// topod's socket.
    #[arg(long, value_name = "PATH", default_value = topo_core::proto::DEFAULT_SOCKET)]
    pub(crate) socket: PathBuf,
}

#[derive(Args)]
pub(crate) struct Source {
    /// An hwloc XML v2 file (e.g. from `lstopo --of xml`), or a directory holding `sys/` and
    /// `proc/` (an extracted `hwloc-gather-topology` snapshot).
    #[arg(long, value_name = "FILE", conflicts_with = "sysfs")]
    pub(crate) topology: Option<PathBuf>,
    /// A directory holding `sys/` and `proc/`, read like this host's /sys.
    #[arg(long, value_name = "DIR")]
    pub(crate) sysfs: Option<PathBuf>,
}

fn parse_strategy(s: &str) -> Result<Strategy, String> {
    s.parse().map_err(|e: place::UnknownStrategy| e.to_string())
}

fn parse_cpus(s: &str) -> Result<CpuSet, String> {
    CpuSet::parse_list(s).map_err(|e| e.to_string())
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

/// A GPU as `--gpus` names it; a device file goes to topod as its number (`char:MAJ:MIN`), read
/// here, where the user's `/dev` is (topod's, under the unit's PrivateDevices=, has no GPUs).
fn parse_gpu(text: &str) -> Result<String, String> {
    if !text.starts_with('/') {
        return Ok(text.to_string());
    }
    let mut numbers = topo_client::device_numbers(&[text.to_string()])?;
    Ok(numbers.remove(0))
}

/// One of `--gpus-by-numa`'s `NODE:COUNT`.
fn parse_numa_gpus(text: &str) -> Result<topo_core::proto::NumaGpus, String> {
    let (node, count) = text.split_once(':').ok_or_else(|| {
        format!("{text:?} is not NODE:COUNT (a NUMA node's number and its GPUs, e.g. 1:2)")
    })?;
    let number = |what: &str, v: &str| {
        v.trim().parse::<u32>().map_err(|_| {
            format!("{text:?}: {what} {v:?} is not a whole number from 0 to {}", u32::MAX)
        })
    };
    Ok(topo_core::proto::NumaGpus { numa: number("node", node)?, count: number("count", count)? })
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
