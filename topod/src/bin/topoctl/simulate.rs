//! `topoctl simulate`: replay a Standard Workload Format trace on N hosts of one machine (or a
//! cluster file's partitions, `crate::cluster`) under one or more cluster policies and host
//! strategies, and print, dump or draw what happened.
//!
//! The replay itself is `topo_core::sim` over `topo_core::policy`; this file reads the inputs,
//! times the replays, and writes the table, the JSON and the SVG.

use crate::cluster::{whole_cores, Cluster};
use crate::jobs_out::{self, JobsOut};
use crate::offline::load_path;
use crate::{print_json, Failure};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use topo_core::defrag::DefragLimits;
use topo_core::place::{HostModel, Strategy};
use topo_core::policy::{
    rules_conflict, Action, Defrag, Gang, Malleability, PolicyConfig, PoolSize, Preempt, Prime,
    QueueOrder, Reserve, Time,
};
use topo_core::prime::{OnOpen, Window};
use topo_core::sim::{self, SimReport, TraceFilter};
use topo_core::swf;
use topo_core::topology::Topology;
use topo_core::CpuSet;

const SIMULATE_HELP: &str = "\
How a trace is replayed:
  A job's processors come from the requested count (field 8), else the allocated count (field 5).
  The scheduler plans with the requested time (field 9) as the estimate; a job that ran longer than
  it requested runs its logged time (the log shows it was not killed), and the estimate is raised to
  it; with --kill-at-limit it runs its requested time instead, as under a batch system that kills
  jobs at their limit. Without field 9 the run time is the estimate.
  Failed (status 0) and cancelled (5) jobs that ran hold their processors for their run time; lines
  without a run time or a processor count (cancelled before they started) and partial-execution lines
  (status 2, 3, 4; their job's summary line is replayed) are left out and counted, as are the jobs of
  the queues --queues/--skip-queues leave out and a line whose job number an earlier one had (the
  numbers are named in a warning). The trace may be gzipped, or - for standard input.
  fcfs starts jobs in submit order; easy gives the first waiting job a reservation at the earliest
  estimated time it fits and starts later jobs now if they end by then or use only processors it will
  not need; conservative gives every waiting job, in order, a reservation at the earliest time its
  processors stay free for its whole estimate, and starts a job now only if that delays none of
  them (not with preemption, gang slicing or malleable jobs).
  With +malleable (--malleable F) the share F of the jobs, chosen by a hash of their job numbers, may
  be resized: one that asks for p processors and fits one host runs on ceil(p/4) to p (--malleable-
  divisor), with linear speedup (its p x run processor-seconds drain at the rate of the processors it
  holds, no cost per resize: an optimistic bound). On each host the malleable jobs share the cores the
  rigid jobs leave equally (equipartition), rebalanced whenever a job starts or ends there; one starts
  as soon as its least size is free, and a rigid job takes back what they hold beyond their least
  sizes. Multi-host jobs stay rigid.
  With --numa-local a rigid job that fits in one NUMA node of a host asks for one (MAX_RADIUS=0): it
  starts on the host with the fewest free cores where they are free in one node, never split over
  hosts; free cores in the wrong nodes refuse it (refused, in the table).
  With +defrag (--defrag) a job refused on a host although enough cores are free there moves running
  jobs there (the fewest moves, then the fewest PUs, each job placed again with its own request, as
  topod's defrag) and starts; a job is not moved before it has run --migrate-min-run seconds, nor
  within --migrate-gap of its last move or resize. Moves are free unless --migrate-cost S (the moved
  job makes no progress for S seconds).
  With easy+reserve (--reserve) the first waiting job also gets topology blocks: on each host it is
  predicted to start on at its reservation, the CPUs its part will take are set aside; other jobs that
  would still run when it is due are placed outside them (easy+reserve-strict: every other job), the
  job inside them (blocks, in block: how many were made, how many heads started wholly inside theirs).
  With +prime (--prime SPEC) a share of each host's cores is reserved in weekly windows of the
  trace's local time for short jobs, those whose estimate (field 9) is at most max-runtime; others are
  placed outside the pools while a window is open. SPEC: count=F (a share below 1, or whole cores),
  windows=DAYS HH:MM-HH:MM[;...], max-runtime=S, on-open=stay|migrate (stay: jobs on a pool as its
  window opens run on; migrate: they are moved out where they fit). The local time is the header's
  UnixStartTime plus the offset its StartTime shows (one offset all year: daylight saving is not
  followed), or --utc-offset.
  --jobs-out: the .csv gives every job's wait, response and bounded slowdown exactly as the summary
  averages them (utilization: procs x logged_run_s). In .swf, field 3 is the wait (time suspended by
  preemption included), field 4 the rest of its time in the system (submit + wait + run is its end;
  the logged run for fcfs, easy and conservative; with gang slicing the slices it sat out count, a
  malleable job's is as long as its sizes made it, suspension and move costs lengthen it, so a
  slowdown computed from it differs), field 5 the processors it started on, the other fields its
  trace line's; the header's MaxProcs is the simulated cluster's (a job killed at its limit has
  status 0). The .csv has a header row and, per job: job, submit_s, start_s (first run), end_s,
  wait_s, run_s, response_s, bounded_slowdown, procs (asked), procs_at_start, estimate_s,
  logged_run_s, killed_at_limit, queue, partition, user, suspensions and suspended_s (preemption),
  gang_freezes, moves, resizes, hosts, numa_nodes and l3_groups its CPUs spanned at its start
  (summed over its hosts), numa_optimal and l3_optimal (the fewest that could hold them, on every
  host), and cpus: HOSTS:CPUS entries, space-separated, the hosts (numbered from 0) with the same
  CPUs in one entry, both as lists (0-63:0 is CPU 0 of hosts 0 to 63; 3,7:0-3 5:0). Files are
  written beside their names and renamed into place when complete (a device or a pipe is written
  into).
  --cluster FILE.toml replaces --hosts and --topology: [[group]] entries (name, count, topology:
  an hwloc XML file, a sysfs snapshot directory or flat:P, relative to the file) and [[partition]]
  entries (name, groups = [...], queues = [...] of field 15, partitions = [...] of field 16,
  default = true for the jobs no partition names, and its own policy = \"...\" and placement =
  \"...\", else --policy and --placement). A job goes to the first partition naming its queue or
  partition, else to the default one; one of no partition or larger than its partition is left
  out and counted. Partitions share no group; each is replayed on its own hosts and the figures
  are summed up job by job as one replay's (a third table gives each partition's); hosts are
  numbered group by group in the file's order. Without [[partition]] every group takes every job.

Examples:
  topoctl simulate --trace SDSC-Par-1996-3.1-cln.swf --hosts 400 --policy fcfs,easy --svg out.svg
  topoctl simulate --trace SDSC-Par-1996-3.1-cln.swf --skip-queues 0 --hosts 352 --json
  topoctl simulate --trace SDSC-Par-1996-3.1-cln.swf --hosts 400 --jobs-out easy.swf \\
      --jobs-out easy.csv
  topoctl simulate --trace SDSC-Par-1996-3.1-cln.swf --hosts 25 --topology 2socket.xml \\
      --placement best-fit,first-fit
  topoctl simulate --trace SDSC-Par-1996-3.1-cln.swf --cluster docs/clusters/sdsc-paragon-today.toml \\
      --policy fcfs,easy
  topoctl simulate --trace SDSC-Par-1996-3.1-cln.swf --hosts 22 --topology 2socket.xml \\
      --skip-queues 0 --policy easy,easy+malleable --malleable 1
  topoctl simulate --trace SDSC-Par-1996-3.1-cln.swf --hosts 22 --topology 2socket.xml \\
      --skip-queues 0 --numa-local --policy easy,easy+defrag,easy+reserve
  topoctl simulate --trace SDSC-Par-1996-3.1-cln.swf --hosts 22 --topology 2socket.xml \\
      --skip-queues 0 --policy easy,easy+prime \\
      --prime 'count=0.25,windows=Mon-Fri 08:00-18:00,max-runtime=3600,on-open=migrate'";

/// `topoctl simulate`'s options.
#[derive(Args)]
#[command(after_help = SIMULATE_HELP)]
pub(crate) struct SimulateOpts {
    /// The trace: a Standard Workload Format file (e.g. from the Parallel Workloads Archive),
    /// plain or gzipped (`.swf.gz` as the archive serves them); `-` reads standard input.
    #[arg(long, value_name = "FILE", allow_hyphen_values = true)]
    trace: PathBuf,
    /// Hosts in the cluster, up to 1,000,000 [default: the trace's MaxProcs (else MaxNodes)
    /// header over the processors of one host].
    #[arg(long, value_name = "N")]
    hosts: Option<usize>,
    /// One host: an hwloc XML file, a sysfs snapshot directory, or flat:P for P plain
    /// processors. A processor is one whole core.
    #[arg(long, value_name = "FILE|flat:P", default_value = "flat:1")]
    topology: String,
    /// A cluster of several machines instead of --hosts and --topology: a TOML file of host
    /// groups (name, count, topology) and partitions (the groups, the trace's queues or
    /// partitions they take, their own policy and placement); see below.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["hosts", "topology"])]
    cluster: Option<PathBuf>,
    /// Cluster policies, comma-separated: fcfs, easy, conservative (backfilling that delays no
    /// waiting job), and fcfs or easy with +preempt (fcfs+preempt,
    /// easy+preempt: suspending running jobs for one that has waited, see --preempt), +gang
    /// (easy+gang: time slicing, see --gang) or +malleable (easy+malleable: jobs resized by
    /// equipartition, see --malleable), and +defrag (migration, see --defrag), +reserve or
    /// +reserve-strict (easy only: topology blocks for the first waiting job, see --reserve),
    /// +prime (prime-time pools, see --prime), which go together and with +malleable but not
    /// with +preempt or +gang. Each is replayed and compared.
    #[arg(long, value_name = "LIST", default_value = "easy")]
    policy: String,
    /// Host strategies, comma-separated: best-fit, pack, balance, first-fit, buddy,
    /// k8s-static, slurm-block.
    #[arg(long, value_name = "LIST", default_value = "best-fit")]
    placement: String,
    /// Replay only jobs of these queues (the trace's field 15), e.g. 1,2,3.
    #[arg(long, value_name = "LIST", allow_hyphen_values = true)]
    queues: Option<String>,
    /// Leave out jobs of these queues, e.g. 0 (the SDSC Paragon's interactive queue).
    #[arg(long, value_name = "LIST", allow_hyphen_values = true)]
    skip_queues: Option<String>,
    /// Print JSON: one object per replay (an array when there are several).
    #[arg(long)]
    json: bool,
    /// Draw utilization and queue length over time and the wait and slowdown distributions of
    /// every replay into this SVG file.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// Write each job's results into FILE: FILE.swf in the Standard Workload Format (the
    /// simulated wait and run in fields 3 and 4), FILE.csv with where each job ran and what
    /// happened to it (see below). Repeat for both. With several replays, one file each, named
    /// FILE.POLICY.PLACEMENT.swf.
    #[arg(long, value_name = "FILE")]
    jobs_out: Vec<PathBuf>,
    /// Preemption for every policy listed: a waiting job whose expansion factor ((wait +
    /// estimate) / estimate) reached --preempt-xf suspends running jobs with lower ones, chosen
    /// to free the tightest domain (checked as time passes, not only at submits and ends); their
    /// CPUs go meanwhile only to jobs that end before the preemptor, and they resume on them
    /// first when those are free.
    #[arg(long)]
    preempt: bool,
    /// Seconds a job runs before it may be suspended.
    #[arg(long, value_name = "S", default_value_t = 300)]
    preempt_min_run: u32,
    /// Suspensions per job at most.
    #[arg(long, value_name = "N", default_value_t = 2)]
    preempt_max: u32,
    /// The expansion factor from which a waiting job may preempt.
    #[arg(long, value_name = "X", default_value_t = 2.0)]
    preempt_xf: f64,
    /// Seconds of progress each suspension costs the suspended job: its memory written out and
    /// read back, its caches lost (0: suspensions are free).
    #[arg(long, value_name = "S", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=86_400))]
    preempt_cost: u32,
    /// Gang time slicing with slices of T seconds (Slurm's default slice is 30): every host has
    /// --gang-rows rows, a job starts in the first row with room on all its hosts, and in slice
    /// k the jobs of row k mod rows run, with any job of another row whose CPUs they leave idle;
    /// the rest are frozen. Applies to every policy listed when none says +gang [default for
    /// +gang: 30].
    #[arg(long, value_name = "T", value_parser = clap::value_parser!(u32).range(1..=86_400))]
    gang: Option<u32>,
    /// Seconds of progress each gang switch costs a job it freezes after it ran (its caches
    /// and TLB refilled when its row runs again; 0: switches are free). `topoctl bench gang`
    /// measures what a switch costs on a real host.
    #[arg(long, value_name = "S", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=86_400))]
    gang_cost: u32,
    /// Rows per host with gang slicing: how many jobs may share a CPU, taking turns.
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    gang_rows: u32,
    /// Malleable jobs: the share F (0 to 1) of the jobs, chosen by a hash of their job numbers
    /// (the same at every run), that may be resized while they run; those that fit one host
    /// share its cores by equipartition. Applies to every policy listed when none says
    /// +malleable [default for +malleable: 1, every job that fits one host].
    #[arg(long, value_name = "F")]
    malleable: Option<f64>,
    /// A malleable job of p processors runs on ceil(p / D) to p.
    #[arg(long, value_name = "D", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1024))]
    malleable_divisor: u32,
    /// Jobs that fit in one NUMA node of a host ask for one (MAX_RADIUS=0, one task per core):
    /// they wait for a host where their cores are free in one node, and are never split over
    /// hosts (rigid jobs only; not with preemption or gang slicing).
    #[arg(long)]
    numa_local: bool,
    /// Defragmenting migration for every policy listed when none says +defrag: a job refused on
    /// a host although enough cores are free there moves running jobs there (topod's defrag).
    #[arg(long)]
    defrag: bool,
    /// Seconds a job runs before migration may move it.
    #[arg(long, value_name = "S", default_value_t = 60)]
    migrate_min_run: u32,
    /// Seconds after a move or resize before migration may move a job again.
    #[arg(long, value_name = "S", default_value_t = 300)]
    migrate_gap: u32,
    /// Moves per start, at most [default: the planner's own, as topod's defrag_max_moves].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=64))]
    defrag_max_moves: Option<u32>,
    /// Seconds of progress a move costs the moved job (0: moves are free).
    #[arg(long, value_name = "S", default_value_t = 0)]
    migrate_cost: u32,
    /// Topology reservations for every easy policy listed when none says +reserve: blocks of
    /// CPUs set aside for the first waiting job where it will start (Paragon blocking).
    #[arg(long)]
    reserve: bool,
    /// Prime-time pools for every policy listed when none says +prime: e.g. "count=0.25,
    /// windows=Mon-Fri 08:00-18:00,max-runtime=3600[,on-open=stay|migrate]" (see below)
    /// [default for +prime: count=0.25,windows=Mon-Fri 08:00-18:00,max-runtime=3600].
    #[arg(long, value_name = "SPEC")]
    prime: Option<String>,
    /// The trace's local time for --prime, as an offset east of UTC: -08:00, +1, +05:30
    /// [default: what the header's StartTime shows against its UnixStartTime, else 0].
    #[arg(long, value_name = "OFFSET", allow_hyphen_values = true)]
    utc_offset: Option<String>,
    /// Kill jobs at their requested time (field 9): a job that ran longer in the log runs only
    /// what it asked for [default: it runs its logged time, which the log shows it was allowed].
    #[arg(long)]
    kill_at_limit: bool,
    /// With conservative backfilling, reservations for the first N waiting jobs only; the
    /// others start where they delay none of those (Maui's RESERVATIONDEPTH; 1 is close to
    /// EASY). It bounds the cost of a long queue [default: every waiting job].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    reservation_depth: Option<u32>,
    /// Replay each combination this many times and report the median speed (jobs/s).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    repeat: u32,
}

/// The largest topology file read (hwloc's largest XML files are a few MB).
const MAX_TOPOLOGY_BYTES: u64 = 64 << 20;

/// `flat:P` (one plain P-processor host), or a topology file or sysfs snapshot; `what` names
/// where it was given in messages (`--topology flat:0`, `group 1 ("a"): topology = x.xml`).
pub(crate) fn host_topology(spec: &str, what: &str) -> Result<Topology, Failure> {
    if let Some(count) = spec.strip_prefix("flat:") {
        let cores: u32 =
            count.parse().ok().filter(|c| (1..=65_536).contains(c)).ok_or_else(|| {
                Failure::input(format!(
                    "{what}: after flat: comes the processor count per host, 1 to 65536"
                ))
            })?;
        return Ok(Topology::flat(cores));
    }
    let path = Path::new(spec);
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Failure::input(format!(
                "{what}: no such file or directory (give an hwloc XML file, a sysfs snapshot directory, or flat:P)"
            )))
        }
        Err(e) => return Err(Failure::input(format!("{what}: cannot read it: {e}"))),
    };
    if !meta.is_dir() && !meta.is_file() {
        return Err(Failure::input(format!(
            "{what}: not a file or a directory (a device or a pipe): give an hwloc XML file or a sysfs snapshot directory"
        )));
    }
    if meta.is_file() && meta.len() > MAX_TOPOLOGY_BYTES {
        return Err(Failure::input(format!(
            "{what}: {} MB is more than any topology file ({} MB at most): check that it is one",
            meta.len() >> 20,
            MAX_TOPOLOGY_BYTES >> 20
        )));
    }
    load_path(path).map_err(|e| {
        // (The reader's messages start with the path, which `what` names already.)
        let why = e.message.strip_prefix(&format!("{}: ", path.display())).unwrap_or(&e.message);
        Failure::input(format!("{what}: {why}"))
    })
}

fn parse_list<T: std::str::FromStr>(what: &str, text: &str) -> Result<Vec<T>, Failure>
where
    T::Err: std::fmt::Display,
{
    text.split(',')
        .map(|item| {
            item.trim()
                .parse::<T>()
                .map_err(|e| Failure::input(format!("{what} {text:?}: {:?}: {e}", item.trim())))
        })
        .collect()
}

/// One policy to replay: the cluster order, with preemption, gang slicing, malleable jobs,
/// migration, reservations or prime time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct PolicyChoice {
    order: Option<QueueOrder>,
    preempt: bool,
    gang: bool,
    malleable: bool,
    defrag: bool,
    reserve: bool,
    strict: bool,
    prime: bool,
}

/// A comma list of policies: `fcfs`, `easy`, each with options (`+preempt`, `+gang`,
/// `+malleable`, `+defrag`, `+reserve`, `+prime`); `everywhere` holds the options the flags
/// (`--preempt`, `--gang`, ...) add to every one: preemption always, the others to every
/// policy when no policy names them.
fn parse_policies(text: &str, everywhere: PolicyChoice) -> Result<Vec<PolicyChoice>, Failure> {
    let names: Vec<String> = parse_list("--policy", text)?;
    let named = |option: &str| names.iter().any(|n| n.split('+').skip(1).any(|x| x == option));
    let mut all = Vec::new();
    for name in &names {
        let mut pieces = name.split('+');
        let order = pieces
            .next()
            .unwrap_or_default()
            .parse::<QueueOrder>()
            .map_err(|e| Failure::input(format!("--policy {text:?}: {e}")))?;
        let mut choice = PolicyChoice {
            order: Some(order),
            preempt: everywhere.preempt,
            gang: everywhere.gang && !named("gang"),
            malleable: everywhere.malleable && !named("malleable"),
            defrag: everywhere.defrag && !named("defrag"),
            reserve: everywhere.reserve
                && !named("reserve")
                && !named("reserve-strict")
                && order == QueueOrder::Easy,
            strict: false,
            prime: everywhere.prime && !named("prime"),
        };
        for option in pieces {
            match option {
                "preempt" => choice.preempt = true,
                "gang" => choice.gang = true,
                "malleable" => choice.malleable = true,
                "defrag" => choice.defrag = true,
                "reserve" => choice.reserve = true,
                "reserve-strict" => {
                    choice.reserve = true;
                    choice.strict = true;
                }
                "prime" => choice.prime = true,
                other => {
                    return Err(Failure::input(format!(
                        "--policy {text:?}: {name:?}: +{other} is not an option (they are +preempt, +gang, +malleable, +defrag, +reserve, +reserve-strict and +prime)"
                    )))
                }
            }
        }
        if (choice.defrag || choice.reserve || choice.prime) && (choice.preempt || choice.gang) {
            return Err(Failure::input(format!(
                "--policy {text:?}: {name:?}: migration, reservations and prime time go with neither preemption nor gang slicing (they work on the CPUs of running jobs, which those suspend or share; --preempt, --gang, --defrag, --reserve and --prime apply to every policy listed)"
            )));
        }
        if choice.reserve && order != QueueOrder::Easy {
            return Err(Failure::input(format!(
                "--policy {text:?}: {name:?}: +reserve goes with easy only (blocks are set aside at EASY's reservation for the queue's head; fcfs makes no reservation, and conservative reserves processors, not CPUs, for every waiting job)"
            )));
        }
        if choice.preempt && choice.gang {
            return Err(Failure::input(format!(
                "--policy {text:?}: {name:?}: preemption and gang slicing do not go together (both suspend jobs: choose one per policy; --preempt and --gang apply to every policy listed)"
            )));
        }
        if order == QueueOrder::Conservative && (choice.preempt || choice.gang || choice.malleable)
        {
            return Err(Failure::input(format!(
                "--policy {text:?}: {name:?}: conservative backfilling goes with neither preemption, gang slicing nor malleable jobs (it reserves each waiting job's processors over time by estimates, which suspensions, slices and resizes do not keep; --preempt, --gang and --malleable apply to every policy listed)"
            )));
        }
        if let Some(why) = rules_conflict(choice.preempt, choice.gang, choice.malleable) {
            return Err(Failure::input(format!(
                "--policy {text:?}: {name:?}: malleable jobs go with neither preemption nor gang slicing: {why} (topod refuses equipartition with preempt or gang_rows alike; --preempt, --gang and --malleable apply to every policy listed)"
            )));
        }
        if !all.contains(&choice) {
            all.push(choice);
        }
    }
    Ok(all)
}

/// What every replay's configuration takes from the options, whichever policy it is.
struct Settings {
    preempt: Preempt,
    gang: Gang,
    malleability: Malleability,
    numa_local: bool,
    defrag: Defrag,
    prime: Option<Prime>,
    move_cost: Time,
    suspend_cost: Time,
    switch_cost: Time,
    reservation_depth: Option<u32>,
}

/// The configuration of one replay.
fn config_for(choice: PolicyChoice, placement: Strategy, settings: &Settings) -> PolicyConfig {
    PolicyConfig {
        order: choice.order.unwrap_or(QueueOrder::Easy),
        strategy: placement,
        preempt: choice.preempt.then_some(settings.preempt),
        gang: choice.gang.then_some(settings.gang),
        malleable: choice.malleable.then_some(settings.malleability),
        numa_local: settings.numa_local,
        defrag: choice.defrag.then_some(settings.defrag),
        reserve: choice.reserve.then_some(if choice.strict {
            Reserve::Strict
        } else {
            Reserve::Outlasting
        }),
        prime: if choice.prime { settings.prime.clone() } else { None },
        move_cost: settings.move_cost,
        suspend_cost: settings.suspend_cost,
        switch_cost: settings.switch_cost,
        reservation_depth: settings.reservation_depth,
    }
}

/// See [`parse_policies`].
fn parse_placements(text: &str) -> Result<Vec<Strategy>, Failure> {
    let mut all: Vec<Strategy> = parse_list("--placement", text)?;
    let mut seen = Vec::new();
    all.retain(|s| {
        if seen.contains(s) {
            false
        } else {
            seen.push(*s);
            true
        }
    });
    Ok(all)
}

/// See [`parse_policies`].
fn parse_queues(flag: &str, text: &str) -> Result<Vec<i64>, Failure> {
    parse_list(flag, text)
}

/// `--prime` when a policy says +prime without it.
const DEFAULT_PRIME: &str = "count=0.25,windows=Mon-Fri 08:00-18:00,max-runtime=3600";

/// What `--prime` says: the pools' size, windows, admission and what a window's opening does.
#[derive(Debug, Clone, PartialEq)]
struct PrimeSpec {
    size: PoolSize,
    windows: Vec<Window>,
    max_runtime: Time,
    on_open: OnOpen,
}

/// `count=F,windows=W[;W...],max-runtime=S[,on-open=stay|migrate]`. A window's own commas
/// (`Sat,Sun 10:00-16:00`) belong to it: a new key starts only at `name=`.
fn parse_prime(text: &str) -> Result<PrimeSpec, Failure> {
    let bad = |why: String| {
        Failure::input(format!(
            "--prime {text:?}: {why} (write e.g. \"{DEFAULT_PRIME},on-open=migrate\")"
        ))
    };
    const KEYS: [&str; 4] = ["count", "windows", "max-runtime", "on-open"];
    let mut items: Vec<(String, String)> = Vec::new();
    for piece in text.split(',') {
        match piece.split_once('=') {
            Some((key, value)) if KEYS.contains(&key.trim()) => {
                if items.iter().any(|(k, _)| k == key.trim()) {
                    return Err(bad(format!("{} is given twice", key.trim())));
                }
                items.push((key.trim().to_string(), value.trim().to_string()));
            }
            _ => match items.last_mut() {
                Some((key, value)) if key == "windows" => {
                    value.push(',');
                    value.push_str(piece.trim());
                }
                _ => {
                    return Err(bad(format!(
                        "{:?} is not KEY=VALUE with a key of {}",
                        piece.trim(),
                        KEYS.join(", ")
                    )))
                }
            },
        }
    }
    let get = |key: &str| items.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
    let count = get("count").ok_or_else(|| bad("count= is missing".into()))?;
    let size = match count.parse::<f64>() {
        Ok(f) if f > 0.0 && f < 1.0 => PoolSize::Share(f),
        Ok(f) if f >= 1.0 && f.fract() == 0.0 && f <= 65_536.0 => PoolSize::Cores(f as u32),
        _ => {
            return Err(bad(format!(
                "count={count}: a share of each host's cores below 1 (0.25), or a whole number of cores (4)"
            )))
        }
    };
    let windows = get("windows")
        .ok_or_else(|| bad("windows= is missing".into()))?
        .split(';')
        .map(|w| w.parse::<Window>().map_err(|e| bad(e.to_string())))
        .collect::<Result<Vec<_>, _>>()?;
    let runtime = get("max-runtime").ok_or_else(|| bad("max-runtime= is missing".into()))?;
    let max_runtime = runtime
        .parse::<u32>()
        .ok()
        .filter(|s| *s > 0)
        .ok_or_else(|| bad(format!("max-runtime={runtime}: seconds, 1 or more")))?;
    let on_open = match get("on-open").unwrap_or("stay") {
        "stay" => OnOpen::Stay,
        "migrate" => OnOpen::Migrate,
        other => return Err(bad(format!("on-open={other}: stay or migrate"))),
    };
    Ok(PrimeSpec { size, windows, max_runtime: Time::from(max_runtime), on_open })
}

/// `[+-]H[H][:MM]` east of UTC, in seconds.
fn parse_utc_offset(text: &str) -> Result<i64, Failure> {
    let bad = || {
        Failure::input(format!(
            "--utc-offset {text}: an offset east of UTC from -14:00 to +14:00, as -08:00, +1 or +05:30"
        ))
    };
    let t = text.trim();
    let (sign, rest) = match t.as_bytes().first() {
        Some(b'-') => (-1, &t[1..]),
        Some(b'+') => (1, &t[1..]),
        _ => (1, t),
    };
    let (h, m) = rest.split_once(':').unwrap_or((rest, "0"));
    let h: i64 = h.parse().map_err(|_| bad())?;
    let m: i64 = m.parse().map_err(|_| bad())?;
    if !(0..60).contains(&m) || h < 0 || h * 60 + m > 14 * 60 {
        return Err(bad());
    }
    Ok(sign * (h * 3600 + m * 60))
}

/// Days from 1970-01-01 to a date of the proleptic Gregorian calendar.
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (i64::from(month) + 9) % 12;
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The offset east of UTC a trace's header shows: its `StartTime` (`Wed Dec 27 10:53:57 PST
/// 1995`, local) against its `UnixStartTime`, to the quarter hour; with the `TimeZoneString`.
fn header_utc_offset(text: &str, unix_start: i64) -> Option<(i64, Option<String>)> {
    const MONTHS: [&str; 12] =
        ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    let mut start = None;
    let mut zone = None;
    for line in text.lines().map(str::trim).take_while(|l| l.is_empty() || l.starts_with(';')) {
        let line = line.trim_start_matches(';').trim();
        if let Some(v) = line.strip_prefix("StartTime:") {
            start = Some(v.trim().to_string());
        } else if let Some(v) = line.strip_prefix("TimeZoneString:") {
            zone = Some(v.trim().to_string()).filter(|z| !z.is_empty());
        }
    }
    let start = start?;
    let words: Vec<&str> = start.split_whitespace().collect();
    let month = words.iter().find_map(|w| MONTHS.iter().position(|m| m == w))? as u32 + 1;
    let day: u32 = words.iter().find_map(|w| w.parse().ok().filter(|d| (1..=31).contains(d)))?;
    let year: i64 =
        words.iter().find_map(|w| w.parse().ok().filter(|y| (1900..3000).contains(y)))?;
    let clock = words.iter().find(|w| w.contains(':'))?;
    let hms: Vec<i64> = clock.split(':').map(|x| x.parse().ok()).collect::<Option<_>>()?;
    let seconds = match hms.as_slice() {
        [h, m, s] => h * 3600 + m * 60 + s,
        [h, m] => h * 3600 + m * 60,
        _ => return None,
    };
    let local_as_utc = days_from_civil(year, month, day) * 86_400 + seconds;
    let offset = ((local_as_utc - unix_start) as f64 / 900.0).round() as i64 * 900;
    (offset.abs() <= 14 * 3600).then_some((offset, zone))
}

/// The trace's clock for prime time: the epoch second of its time 0, the offset east of UTC,
/// and a sentence saying where they came from.
fn trace_clock(
    text: &str,
    trace: &swf::Trace,
    flag: Option<&str>,
) -> Result<(i64, i64, String), Failure> {
    let unix_start = trace.header.unix_start_time;
    let epoch = unix_start.unwrap_or(0);
    let start_note = match unix_start {
        Some(t) => format!("time 0 is the header's UnixStartTime {t}"),
        None => "no UnixStartTime in the header: time 0 is 1970-01-01 00:00 UTC, a Thursday".into(),
    };
    let show = |offset: i64| {
        let sign = if offset < 0 { '-' } else { '+' };
        format!("UTC{sign}{:02}:{:02}", offset.abs() / 3600, offset.abs() % 3600 / 60)
    };
    if let Some(flag) = flag {
        let offset = parse_utc_offset(flag)?;
        return Ok((
            epoch,
            offset,
            format!("{start_note}; local time {} (--utc-offset)", show(offset)),
        ));
    }
    match unix_start.and_then(|t| header_utc_offset(text, t)) {
        Some((offset, zone)) => {
            let zone = zone.map(|z| format!(", {z}")).unwrap_or_default();
            Ok((
                epoch,
                offset,
                format!(
                    "{start_note}; local time {} as the header's StartTime shows{zone} (one offset all year: daylight saving is not followed)",
                    show(offset)
                ),
            ))
        }
        None => Ok((
            epoch,
            0,
            format!("{start_note}; local time UTC (no StartTime to tell; --utc-offset sets one)"),
        )),
    }
}

/// At most this many hosts, and processors in all.
pub(crate) const MAX_HOSTS: usize = 1_000_000;
pub(crate) const MAX_PROCESSORS: u64 = 1 << 24;

/// The largest trace read (the largest in the Parallel Workloads Archive is a few hundred MB).
const MAX_TRACE_BYTES: u64 = 4 << 30;

/// How messages name the trace: its path, or "standard input" for `-`.
fn trace_shown(path: &Path) -> String {
    if path == Path::new("-") {
        "standard input".into()
    } else {
        path.display().to_string()
    }
}

/// Reads a trace (plain or gzip, a file or `-`) a line at a time, with a size limit; returns it
/// with its header comment lines.
fn read_trace(path: &Path) -> Result<(swf::Trace, String), Failure> {
    use std::io::{BufRead, BufReader, Read};
    let name = trace_shown(path);
    let cannot = |e: std::io::Error| Failure::input(format!("cannot read the trace {name}: {e}"));
    let input: Box<dyn Read> = if path == Path::new("-") {
        Box::new(std::io::stdin().lock())
    } else {
        Box::new(std::fs::File::open(path).map_err(cannot)?)
    };
    let mut input = BufReader::with_capacity(1 << 16, input);
    // gzip by its magic number, whatever the name says.
    let gzipped = input.fill_buf().map_err(cannot)?.starts_with(&[0x1f, 0x8b]);
    let text: Box<dyn Read> = if gzipped {
        Box::new(flate2::bufread::MultiGzDecoder::new(input))
    } else {
        Box::new(input)
    };
    // A valid trace this large would not fit in memory as jobs either.
    let mut text = BufReader::with_capacity(1 << 16, text.take(MAX_TRACE_BYTES + 1));
    let read = swf::read(&mut text);
    if text.get_ref().limit() == 0 {
        // (Whatever the cut last line made of it.)
        return Err(Failure::input(format!(
            "the trace {name} is larger than {} GiB; cut it (e.g. with head) or check that it is a trace",
            MAX_TRACE_BYTES >> 30
        )));
    }
    read.map_err(|e| Failure::input(format!("{name}: {e}")))
}

pub(crate) fn run(args: SimulateOpts) -> Result<(), Failure> {
    let mut everywhere = PolicyChoice {
        order: None,
        preempt: args.preempt,
        gang: args.gang.is_some(),
        malleable: args.malleable.is_some(),
        defrag: args.defrag,
        reserve: args.reserve,
        strict: false,
        prime: args.prime.is_some(),
    };
    let file_cluster = args.cluster.as_deref().map(Cluster::load).transpose()?;
    // A flag whose option a policy names, in --policy or a partition's own, only sets its
    // parameter (--gang 60 with easy+gang listed): it adds the option to no other policy.
    let texts: Vec<&str> = std::iter::once(args.policy.as_str())
        .chain(
            file_cluster
                .iter()
                .flat_map(|c| c.partitions.iter().filter_map(|p| p.policy.as_deref())),
        )
        .collect();
    let named = |option: &str| {
        texts.iter().flat_map(|t| t.split(',')).any(|n| {
            n.trim()
                .split('+')
                .skip(1)
                .any(|x| x == option || (option == "reserve" && x == "reserve-strict"))
        })
    };
    everywhere.gang &= !named("gang");
    everywhere.malleable &= !named("malleable");
    everywhere.defrag &= !named("defrag");
    everywhere.reserve &= !named("reserve");
    everywhere.prime &= !named("prime");
    let policies = parse_policies(&args.policy, everywhere)?;
    let placements = parse_placements(&args.placement)?;
    // Each partition's own policy and host strategy, checked as --policy and --placement are.
    let own = match (&file_cluster, &args.cluster) {
        (Some(cluster), Some(path)) => own_choices(cluster, path, everywhere)?,
        _ => Vec::new(),
    };
    let mut every_choice = policies.clone();
    every_choice.extend(own.iter().filter_map(|(choice, _)| *choice));
    if !own.is_empty() {
        let shown = args.cluster.as_deref().unwrap_or(Path::new("")).display();
        if policies.len() > 1 && own.iter().all(|(choice, _)| choice.is_some()) {
            return Err(Failure::input(format!(
                "--policy {}: every partition of {shown} names its own policy, so there is nothing to compare",
                args.policy
            )));
        }
        if placements.len() > 1 && own.iter().all(|(_, placement)| placement.is_some()) {
            return Err(Failure::input(format!(
                "--placement {}: every partition of {shown} names its own placement, so there is nothing to compare",
                args.placement
            )));
        }
    }
    if args.numa_local && (args.preempt || every_choice.iter().any(|c| c.gang || c.preempt)) {
        return Err(Failure::input(
            "--numa-local goes with neither preemption nor gang slicing, in --policy or a partition's own policy (the jobs would ask for one NUMA node only where those are off)",
        ));
    }
    let defrag = Defrag {
        min_run: Time::from(args.migrate_min_run),
        gap: Time::from(args.migrate_gap),
        limits: DefragLimits {
            max_moves: args
                .defrag_max_moves
                .map_or(DefragLimits::default().max_moves, |n| n as usize),
            ..DefragLimits::default()
        },
    };
    let malleable_share = args.malleable.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&malleable_share) {
        return Err(Failure::input(format!(
            "--malleable {malleable_share}: the share of malleable jobs is from 0 to 1"
        )));
    }
    let malleability = Malleability { min_divisor: args.malleable_divisor };
    let gang = Gang { slice: Time::from(args.gang.unwrap_or(30)), rows: args.gang_rows };
    let gangs = every_choice.iter().any(|c| c.gang);
    if gangs && Time::from(args.gang_cost) >= gang.slice {
        return Err(Failure::input(format!(
            "--gang-cost {}: a switch may not cost the whole {} s slice or more (a job frozen after each slice it runs would never progress)",
            args.gang_cost, gang.slice
        )));
    }
    // Costs of what no policy listed does.
    if args.gang_cost > 0 && !gangs {
        eprintln!("topoctl: warning: --gang-cost: no policy listed uses gang slicing (+gang or --gang); it changes nothing");
    }
    if args.reservation_depth.is_some()
        && !every_choice.iter().any(|c| c.order == Some(QueueOrder::Conservative))
    {
        eprintln!("topoctl: warning: --reservation-depth: no policy listed is conservative; it changes nothing");
    }
    if args.preempt_cost > 0 && !every_choice.iter().any(|c| c.preempt) {
        eprintln!("topoctl: warning: --preempt-cost: no policy listed preempts (+preempt or --preempt); it changes nothing");
    }
    if !(args.preempt_xf.is_finite() && args.preempt_xf >= 1.0) {
        return Err(Failure::input(format!(
            "--preempt-xf {}: an expansion factor is 1 or more",
            args.preempt_xf
        )));
    }
    let rules = Preempt {
        min_run: Time::from(args.preempt_min_run),
        max_suspensions: args.preempt_max,
        min_xf: args.preempt_xf,
    };
    let queues = args.queues.as_deref().map(|q| parse_queues("--queues", q)).transpose()?;
    let skip_queues = args
        .skip_queues
        .as_deref()
        .map(|q| parse_queues("--skip-queues", q))
        .transpose()?
        .unwrap_or_default();
    let (trace, text) = read_trace(&args.trace)?;
    let shown_trace = trace_shown(&args.trace);
    let prime_spec = match (&args.prime, every_choice.iter().any(|c| c.prime)) {
        (_, false) => None,
        (Some(text), true) => Some(parse_prime(text)?),
        (None, true) => Some(parse_prime(DEFAULT_PRIME)?),
    };
    let (prime, clock_note) = match &prime_spec {
        Some(spec) => {
            let (epoch, offset, note) = trace_clock(&text, &trace, args.utc_offset.as_deref())?;
            let prime = Prime {
                size: spec.size,
                windows: spec.windows.clone(),
                max_estimate: spec.max_runtime,
                on_open: spec.on_open,
                epoch_at_zero: epoch,
                utc_offset: offset,
            };
            (Some(prime), Some(note))
        }
        None => (None, None),
    };
    let cluster = match file_cluster {
        Some(cluster) => cluster,
        None => one_group(&args, &trace, &shown_trace)?,
    };
    let hosts = cluster.host_count();
    let total = cluster.processors();
    if let Some(size) = prime_spec.as_ref().map(|p| p.size) {
        for group in &cluster.groups {
            if let Some(warning) = pool_size_warning(size, group.cores) {
                let which = if cluster.from_file {
                    format!("group {:?}: ", group.name)
                } else {
                    String::new()
                };
                eprintln!("topoctl: warning: --prime: {which}{warning}");
            }
        }
    }
    let settings = Settings {
        preempt: rules,
        gang,
        malleability,
        numa_local: args.numa_local,
        defrag,
        prime,
        move_cost: Time::from(args.migrate_cost),
        suspend_cost: Time::from(args.preempt_cost),
        switch_cost: Time::from(args.gang_cost),
        reservation_depth: args.reservation_depth,
    };
    let jobs_out =
        args.jobs_out.iter().map(|p| JobsOut::parse(p)).collect::<Result<Vec<_>, _>>()?;
    let several = policies.len() * placements.len() > 1;
    let wants_cpus = jobs_out.iter().any(JobsOut::wants_cpus);
    // Where the results go is checked before the replay, not after it; none is the trace.
    let mut outputs: Vec<(&str, PathBuf)> = args.svg.iter().map(|p| ("--svg", p.clone())).collect();
    for out in &jobs_out {
        for choice in &policies {
            for placement in &placements {
                let (policy, placement) =
                    whole_name(&config_for(*choice, *placement, &settings), &own);
                outputs.push(("--jobs-out", out.path_for(&policy, placement, several)));
            }
        }
    }
    check_outputs(&outputs, &args.trace, cluster.input_files())?;
    let filter = TraceFilter { queues, skip_queues };
    let mut selected = sim::jobs_from_trace(&trace, &filter, total);
    let capacities: Vec<u64> = cluster.partitions.iter().map(|p| p.processors).collect();
    let parts = sim::split(&mut selected, &trace, &capacities, &|line| cluster.partition_of(line));
    let sim::Selected { mut jobs, skipped, duplicates, lines } = selected;
    for (partition, part) in cluster.partitions.iter().zip(&parts) {
        if cluster.from_file && part.is_empty() {
            eprintln!(
                "topoctl: warning: --cluster: partition {:?} gets no job of {shown_trace}: its queues and partitions are none of the trace's jobs'",
                partition.name
            );
        }
    }
    let killed = args.kill_at_limit.then(|| sim::kill_at_limit(&mut jobs, &lines, &trace));
    // Marks mean nothing to a policy without malleable jobs: every replay gets the same jobs.
    let any_malleable = every_choice.iter().any(|c| c.malleable);
    let marked = if any_malleable { sim::mark_malleable(&mut jobs, malleable_share) } else { 0 };
    if jobs.is_empty() {
        return Err(Failure::input(format!(
            "{}: no job to replay ({} job lines, {} left out: {})",
            shown_trace,
            trace.jobs.len(),
            skipped.values().sum::<usize>(),
            describe_skipped(&skipped)
        )));
    }
    if !duplicates.is_empty() {
        const SHOWN: usize = 10;
        let mut listed: Vec<String> = duplicates.iter().take(SHOWN).map(i64::to_string).collect();
        if duplicates.len() > SHOWN {
            listed.push(format!("and {} more", duplicates.len() - SHOWN));
        }
        eprintln!(
            "topoctl: warning: {shown_trace}: job numbers on more than one line: {}; only the first line of each is replayed",
            listed.join(", ")
        );
    }
    let topology_name = match &args.cluster {
        Some(path) => format!(
            "the cluster {}: {}",
            path.file_name()
                .map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into()),
            cluster.describe()
        ),
        None => cluster.groups.first().map(|g| g.machine()).unwrap_or_default(),
    };
    let trace_name = match args.trace.file_name() {
        _ if args.trace == Path::new("-") => shown_trace.clone(),
        Some(n) => n.to_string_lossy().into(),
        None => shown_trace.clone(),
    };
    let all_hosts = cluster.hosts();
    let partition_hosts: Vec<Vec<Arc<HostModel>>> = cluster
        .partitions
        .iter()
        .map(|p| p.hosts.iter().map(|&h| Arc::clone(&all_hosts[h])).collect())
        .collect();
    // Each partition's jobs (one partition of every job replays them where they are).
    let part_jobs: Vec<std::borrow::Cow<'_, [sim::SimJob]>> = parts
        .iter()
        .map(|part| {
            if part.len() == jobs.len() {
                std::borrow::Cow::Borrowed(jobs.as_slice())
            } else {
                std::borrow::Cow::Owned(part.iter().map(|&i| jobs[i]).collect())
            }
        })
        .collect();
    let mut reports = Vec::new();
    for &choice in &policies {
        for &placement in &placements {
            let config = config_for(choice, placement, &settings);
            let mut started_on: Vec<String> = Vec::new();
            if wants_cpus {
                started_on.resize(jobs.len(), String::new());
            }
            // Each partition's own policy and strategy, else this one's.
            let configs: Vec<PolicyConfig> = own_or(&own, cluster.partitions.len())
                .map(|(c, s)| config_for(c.unwrap_or(choice), s.unwrap_or(placement), &settings))
                .collect();
            // Each repetition replays the same jobs and decides the same; the speed reported is
            // the median over the repetitions.
            let mut speeds = Vec::with_capacity(args.repeat as usize);
            let mut kept = None;
            for _ in 0..args.repeat.max(1) {
                // Where each job started, for a CSV (only once: every repetition decides the same).
                let record = wants_cpus && kept.is_none();
                let began = Instant::now();
                let mut replays = Vec::with_capacity(cluster.partitions.len());
                for (k, partition) in cluster.partitions.iter().enumerate() {
                    let config = &configs[k];
                    let mut label =
                        format!("{} {}", sim::policy_name(config), config.strategy.name());
                    if cluster.from_file {
                        label = format!("{}: {label}", partition.name);
                    }
                    let bar = progress_bar(part_jobs[k].len(), &label);
                    let report = sim::replay_observed(
                        partition_hosts[k].clone(),
                        &part_jobs[k],
                        config.clone(),
                        &mut |done| bar.set_position(done as u64),
                        &mut |_, action| {
                            if let (true, Action::Start { job, parts: on }) = (record, action) {
                                // Hosts and jobs numbered in the whole cluster.
                                let on: Vec<_> = on
                                    .iter()
                                    .map(|p| {
                                        let host = partition.hosts[p.host as usize];
                                        (host as topo_core::policy::HostId, &p.placement.cpus)
                                    })
                                    .collect();
                                started_on[parts[k][*job as usize]] = jobs_out::cpus_cell(&on);
                            }
                        },
                    )
                    .map_err(|e| {
                        let which = if cluster.from_file {
                            format!(" of partition {:?}", partition.name)
                        } else {
                            String::new()
                        };
                        Failure::runtime(format!("the replay{which} stopped: {e}"))
                    })?;
                    bar.finish_and_clear();
                    replays.push(report);
                }
                speeds.push(jobs.len() as f64 / began.elapsed().as_secs_f64().max(1e-9));
                let report = if cluster.from_file {
                    let partitions = cluster
                        .partitions
                        .iter()
                        .zip(replays)
                        .zip(&parts)
                        .map(|((p, report), jobs)| sim::Partition {
                            name: p.name.clone(),
                            report,
                            jobs: jobs.clone(),
                        })
                        .collect();
                    let (policy, placement) = whole_name(&config, &own);
                    sim::merge(policy, placement, partitions, &jobs, (hosts, total))
                } else {
                    replays.pop().ok_or_else(|| Failure::runtime("no replay"))?
                };
                kept.get_or_insert(report);
            }
            let Some(mut report) = kept else { continue };
            speeds.sort_by(f64::total_cmp);
            report.jobs_per_s = speeds[speeds.len() / 2];
            report.skipped = skipped.iter().map(|(k, v)| (k.to_string(), *v)).collect();
            report.killed_at_limit = killed;
            let context = jobs_out::Context {
                trace: &trace,
                header: &text,
                jobs: &jobs,
                lines: &lines,
                trace_name: &trace_name,
                topology_name: &topology_name,
                started_on: &started_on,
                kill_at_limit: args.kill_at_limit,
            };
            for out in &jobs_out {
                let path = out.path_for(&report.policy, placement.name(), several);
                jobs_out::write(out, &path, &context, &report)?;
                // A cluster file whose partitions set both says "by-partition" once.
                let what = if report.policy == report.placement {
                    report.policy.clone()
                } else {
                    format!("{} {}", report.policy, report.placement)
                };
                eprintln!("topoctl: {what}: each job's results are in {}", path.display());
            }
            // (Written: the table, the JSON and the pictures need only the figures.)
            report.outcomes = Vec::new();
            reports.push(report);
        }
    }
    if args.json {
        let objects: Vec<serde_json::Value> = reports
            .iter()
            .map(|r| {
                let mut v = serde_json::to_value(r).unwrap_or_default();
                if let Some(o) = v.as_object_mut() {
                    o.insert("trace".into(), trace_name.clone().into());
                    o.insert("topology".into(), topology_name.clone().into());
                }
                v
            })
            .collect();
        match objects.as_slice() {
            [one] => print_json(one)?,
            _ => print_json(&objects)?,
        }
    } else {
        let malleable = any_malleable.then_some(MalleableNote {
            share: malleable_share,
            divisor: args.malleable_divisor,
            marked,
        });
        print_table(
            &trace_name,
            &trace,
            &topology_name,
            hosts,
            total,
            &skipped,
            &reports,
            malleable.as_ref(),
            &SpaceNote {
                numa_local: args.numa_local,
                defrag: policies.iter().any(|c| c.defrag).then_some(defrag),
                move_cost: args.migrate_cost,
                prime: prime_spec.as_ref().zip(clock_note.as_deref()),
            },
        );
    }
    if let Some(path) = &args.svg {
        let mut title = if cluster.from_file {
            format!("{trace_name} on {topology_name} ({total} processors)")
        } else {
            format!("{trace_name} on {hosts} × {topology_name} ({total} processors)")
        };
        if args.numa_local {
            title.push_str(", NUMA-local jobs");
        }
        if any_malleable && malleable_share < 1.0 {
            title.push_str(&format!(", {malleable_share} of the jobs malleable"));
        }
        draw(path, &title, &reports)
            .map_err(|e| Failure::runtime(format!("cannot write {}: {e}", path.display())))?;
        if !args.json {
            println!("\npictures: {}", path.display());
        }
    }
    Ok(())
}

/// `--hosts` hosts of `--topology`: one group, one partition that takes every job.
fn one_group(
    args: &SimulateOpts,
    trace: &swf::Trace,
    shown_trace: &str,
) -> Result<Cluster, Failure> {
    let topo = host_topology(&args.topology, &format!("--topology {}", args.topology))?;
    let model = Arc::new(
        HostModel::new(&topo, &CpuSet::new())
            .map_err(|e| Failure::input(format!("--topology {}: {e}", args.topology)))?,
    );
    let cores_per_host = whole_cores(&model);
    // The machine the log came from: MaxProcs, else MaxNodes (one processor each).
    let logged = trace.header.max_procs.or(trace.header.max_nodes);
    let hosts = match (args.hosts, logged) {
        (Some(0), _) => return Err(Failure::input("--hosts must be at least 1")),
        (Some(n), _) if n > MAX_HOSTS => {
            return Err(Failure::input(format!(
                "--hosts {n}: at most {MAX_HOSTS} hosts are simulated"
            )))
        }
        (Some(n), _) => n,
        (None, Some(max)) => (u64::from(max).div_ceil(cores_per_host.max(1))) as usize,
        (None, None) => {
            return Err(Failure::input(format!(
                "{shown_trace} has no '; MaxProcs:' or '; MaxNodes:' header: say how many hosts with --hosts N"
            )))
        }
    };
    let total = cores_per_host * hosts as u64;
    if total > MAX_PROCESSORS {
        return Err(Failure::input(format!(
            "{hosts} hosts of {cores_per_host} cores are {total} processors; at most {MAX_PROCESSORS} are simulated"
        )));
    }
    let source = Path::new(&topo.source)
        .file_name()
        .map_or_else(|| topo.source.clone(), |n| n.to_string_lossy().into());
    let cluster = Cluster::one_group(&source, model, hosts);
    Ok(if args.topology.starts_with("flat:") {
        cluster
    } else {
        cluster.with_input("the topology (--topology)", Path::new(&args.topology))
    })
}

/// A partition's own policy and host strategy, where its entry names them.
type OwnChoice = (Option<PolicyChoice>, Option<Strategy>);

/// Each partition's own policy and host strategy, if it names them: one each, checked as
/// `--policy` and `--placement` are.
fn own_choices(
    cluster: &Cluster,
    path: &Path,
    everywhere: PolicyChoice,
) -> Result<Vec<OwnChoice>, Failure> {
    let shown = path.display();
    cluster
        .partitions
        .iter()
        .map(|p| {
            // One item of `text` (as `parse` reads the flag `--{what}`), or why not; the
            // checks' messages start with the flag's name, which this file did not use.
            fn one<T: Copy>(
                what: &str,
                text: Option<&str>,
                parse: impl Fn(&str) -> Result<Vec<T>, Failure>,
                at: &str,
            ) -> Result<Option<T>, Failure> {
                let Some(text) = text else { return Ok(None) };
                match parse(text) {
                    Ok(all) => match all.as_slice() {
                        [one] => Ok(Some(*one)),
                        _ => Err(Failure::input(format!(
                            "{at}: {what} = {text:?}: one per partition (--{what} compares several)"
                        ))),
                    },
                    Err(e) => {
                        let why =
                            e.message.strip_prefix(&format!("--{what} ")).unwrap_or(&e.message);
                        Err(Failure::input(format!("{at}: {what} = {why}")))
                    }
                }
            }
            let at = format!("--cluster {shown}: partition {:?}", p.name);
            let policy =
                one("policy", p.policy.as_deref(), |t| parse_policies(t, everywhere), &at)?;
            let placement = one("placement", p.placement.as_deref(), parse_placements, &at)?;
            Ok((policy, placement))
        })
        .collect()
}

/// How a replay of a cluster is named, in tables and file names: its policy and placement, or
/// `by-partition` where every partition names its own.
fn whole_name(config: &PolicyConfig, own: &[OwnChoice]) -> (String, &'static str) {
    let all = |f: fn(&OwnChoice) -> bool| !own.is_empty() && own.iter().all(f);
    let policy =
        if all(|o| o.0.is_some()) { "by-partition".into() } else { sim::policy_name(config) };
    let placement = if all(|o| o.1.is_some()) { "by-partition" } else { config.strategy.name() };
    (policy, placement)
}

/// `own`, or nothing named for each of `count` partitions (one group from `--hosts`).
fn own_or(own: &[OwnChoice], count: usize) -> impl Iterator<Item = OwnChoice> + '_ {
    (0..count).map(move |k| own.get(k).copied().unwrap_or((None, None)))
}

/// Which file a path names: its device and inode when it exists, else its folder's real path
/// and its name (two names of one file, through links or `..`, are the same).
#[derive(Debug, PartialEq, Eq)]
enum FileIdentity {
    Inode(u64, u64),
    Path(PathBuf),
}

fn identity(path: &Path) -> Option<FileIdentity> {
    use std::os::unix::fs::MetadataExt;
    if let Ok(meta) = std::fs::metadata(path) {
        return Some(FileIdentity::Inode(meta.dev(), meta.ino()));
    }
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    Some(FileIdentity::Path(std::fs::canonicalize(folder).ok()?.join(path.file_name()?)))
}

/// Checks the files a replay will write, before it runs and without changing them: none is
/// the trace (by any name, or the file standard input reads when the trace is `-`), no two
/// options name one file, and each can be written (an existing file is opened for writing
/// without emptying it; a new one is made and removed).
fn check_outputs(
    outputs: &[(&str, PathBuf)],
    trace: &Path,
    inputs: &[(String, PathBuf)],
) -> Result<(), Failure> {
    let trace_file = if trace == Path::new("-") {
        // A file redirected into standard input; a pipe names no file.
        std::fs::metadata("/dev/stdin")
            .ok()
            .filter(|m| m.is_file())
            .and_then(|_| identity(Path::new("/dev/stdin")))
    } else {
        identity(trace)
    };
    let mut seen: Vec<(&str, &Path, FileIdentity)> = Vec::new();
    for (option, path) in outputs {
        let Some(id) = identity(path) else {
            return Err(Failure::input(format!(
                "{option} {}: cannot write there: no such folder",
                path.display()
            )));
        };
        if trace_file.as_ref() == Some(&id) {
            return Err(Failure::input(format!(
                "{option} {}: that is the trace; writing there would overwrite it",
                path.display()
            )));
        }
        if let Some((what, _)) =
            inputs.iter().find(|(_, input)| identity(input).as_ref() == Some(&id))
        {
            return Err(Failure::input(format!(
                "{option} {}: that is {what}; writing there would overwrite it",
                path.display()
            )));
        }
        if let Some((other, other_path, _)) = seen.iter().find(|(_, _, s)| *s == id) {
            if other != option || format_of(other_path) != format_of(path) {
                return Err(Failure::input(format!(
                    "{option} {} and {other} {}: both name one file; give each its own",
                    path.display(),
                    other_path.display()
                )));
            }
            continue;
        }
        writable(option, path)?;
        seen.push((option, path, id));
    }
    Ok(())
}

/// An output's extension, for telling two `--jobs-out` files apart.
fn format_of(path: &Path) -> Option<String> {
    path.extension().map(|e| e.to_string_lossy().to_ascii_lowercase())
}

/// Whether `path` can be written, leaving an existing file as it is.
fn writable(option: &str, path: &Path) -> Result<(), Failure> {
    let refused = |e: std::io::Error| {
        Failure::input(format!("{option} {}: cannot write there: {e}", path.display()))
    };
    if let Ok(meta) = std::fs::metadata(path) {
        if meta.is_dir() {
            return Err(Failure::input(format!(
                "{option} {}: cannot write there: it is a folder",
                path.display()
            )));
        }
        if !meta.is_file() {
            // A device or a pipe: opening a pipe here would take its reader's turn (and the
            // results would then wait for another); its errors come when it is written.
            return Ok(());
        }
        std::fs::OpenOptions::new().write(true).open(path).map(drop).map_err(refused)
    } else {
        std::fs::OpenOptions::new().write(true).create_new(true).open(path).map_err(refused)?;
        std::fs::remove_file(path).map_err(refused)
    }
}

fn progress_bar(len: usize, label: &str) -> ProgressBar {
    // Drawn on stderr, and only when stderr is a terminal.
    let bar = ProgressBar::new(len as u64);
    if let Ok(style) =
        ProgressStyle::with_template("{msg:>18} [{bar:40}] {pos}/{len} jobs ({eta} left)")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(label.to_string());
    bar
}

fn describe_skipped(skipped: &std::collections::BTreeMap<swf::Skip, usize>) -> String {
    if skipped.is_empty() {
        return "none".into();
    }
    skipped.iter().map(|(why, n)| format!("{n} {why}")).collect::<Vec<_>>().join(", ")
}

/// What a prime-time pool's size cannot mean on hosts of `cores` cores, when it cannot: a share
/// that rounds to the whole host (a pool is at least one core), or more cores than a host has.
fn pool_size_warning(size: PoolSize, cores: u64) -> Option<String> {
    let cores = u32::try_from(cores).unwrap_or(u32::MAX);
    let pool = size.of(cores);
    match size {
        PoolSize::Share(f) if pool == cores => Some(format!(
            "count={f} of a host of {cores} core(s) is the whole host (a pool is at least one core, rounded to whole cores): in a window every host is a pool, and the jobs the pools do not admit wait until it closes"
        )),
        PoolSize::Cores(n) if n > cores => Some(format!(
            "count={n} cores, but a host has {cores}: each pool is the whole host"
        )),
        _ => None,
    }
}

/// A makespan: days, or hours when under two days.
fn span(s: f64) -> String {
    if s >= 2.0 * 86_400.0 {
        format!("{:.1} d", s / 86_400.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}

/// The second table: the 50th, 90th and 99th percentiles (nearest rank) and the largest of the
/// wait, the response and the bounded slowdown of each replay (the JSON's `percentiles`).
fn print_percentiles(reports: &[SimReport], pw: usize) {
    let columns = [
        "wait p50", "wait p90", "wait p99", "resp p50", "resp p90", "resp p99", "resp max",
        "sldn p50", "sldn p90", "sldn p99", "sldn max",
    ];
    let header: String = columns.iter().map(|c| format!(" {c:>10}")).collect();
    println!("{:<pw$} {:<12}{header}", "policy", "placement");
    for r in reports {
        let p = &r.percentiles;
        let (w, t, b) = (&p.wait_s, &p.response_s, &p.bounded_slowdown);
        let times = [w.p50, w.p90, w.p99, t.p50, t.p90, t.p99, t.max].map(hours);
        let slowdowns = [b.p50, b.p90, b.p99, b.max].map(|x| format!("{x:.1}"));
        let cells: String = times.iter().chain(&slowdowns).map(|c| format!(" {c:>10}")).collect();
        println!("{:<pw$} {:<12}{cells}", r.policy, r.placement);
    }
}

/// The third table, for a cluster of partitions: each partition's own figures in each replay
/// (the JSON's `partitions`).
fn print_partitions(reports: &[SimReport]) {
    let parts = || reports.iter().flat_map(|r| &r.partitions);
    let nw = parts().map(|p| p.name.len()).max().unwrap_or(0).max(9);
    let pw = parts().map(|p| p.policy.len()).max().unwrap_or(0).max(7);
    println!("by partition, each replayed on its own hosts:");
    println!(
        "{:<nw$} {:<pw$} {:<12} {:>6} {:>10} {:>8} {:>6} {:>10} {:>10} {:>9} {:>9}",
        "partition",
        "policy",
        "placement",
        "hosts",
        "processors",
        "jobs",
        "util",
        "mean wait",
        "p95 wait",
        "bnd sldn",
        "makespan"
    );
    for (k, r) in reports.iter().enumerate() {
        if k > 0 && reports.len() > 1 {
            println!();
        }
        if reports.len() > 1 {
            println!("({} {}:)", r.policy, r.placement);
        }
        for p in &r.partitions {
            // A partition without jobs has no waits, slowdowns or makespan.
            let [wait, p95, slowdown, makespan] = if p.jobs == 0 {
                ["-".to_string(), "-".into(), "-".into(), "-".into()]
            } else {
                [
                    hours(p.mean_wait_s),
                    hours(p.p95_wait_s),
                    format!("{:.1}", p.mean_bounded_slowdown),
                    span(p.makespan_s),
                ]
            };
            println!(
                "{:<nw$} {:<pw$} {:<12} {:>6} {:>10} {:>8} {:>6.3} {wait:>10} {p95:>10} {slowdown:>9} {makespan:>9}",
                p.name, p.policy, p.placement, p.hosts, p.processors, p.jobs, p.utilization,
            );
        }
    }
}

fn hours(s: f64) -> String {
    if s >= 3600.0 {
        format!("{:.2} h", s / 3600.0)
    } else if s >= 60.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{s:.0} s")
    }
}

/// What the table's note says of malleable jobs.
struct MalleableNote {
    share: f64,
    divisor: u32,
    marked: usize,
}

/// What the table's notes say of NUMA-local jobs, migration, reservations and prime time.
struct SpaceNote<'a> {
    numa_local: bool,
    defrag: Option<Defrag>,
    move_cost: u32,
    prime: Option<(&'a PrimeSpec, &'a str)>,
}

#[allow(clippy::too_many_arguments)]
fn print_table(
    name: &str,
    trace: &swf::Trace,
    topology: &str,
    hosts: usize,
    total: u64,
    skipped: &std::collections::BTreeMap<swf::Skip, usize>,
    reports: &[SimReport],
    malleable: Option<&MalleableNote>,
    space: &SpaceNote<'_>,
) {
    let computer = trace.header.computer.as_deref().map(|c| format!(" ({c})")).unwrap_or_default();
    let plural = |n: u64, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
    println!(
        "{name}{computer}: {} replayed on {} of {topology}, {} (whole cores)",
        plural(reports.first().map_or(0, |r| r.jobs as u64), "job", "jobs"),
        plural(hosts as u64, "host", "hosts"),
        plural(total, "processor", "processors"),
    );
    println!("left out: {}", describe_skipped(skipped));
    if let Some(depth) = reports.iter().find_map(|r| r.reservation_depth) {
        println!(
            "conservative: reservations for the first {depth} waiting job(s) (--reservation-depth)"
        );
    }
    if let Some(killed) = reports.first().and_then(|r| r.killed_at_limit) {
        println!(
            "killed at their requested time (--kill-at-limit): {} that ran longer in the log",
            plural(killed as u64, "job", "jobs")
        );
    }
    println!();
    let pw = reports.iter().map(|r| r.policy.len()).max().unwrap_or(0).max(7);
    let preempting = reports.iter().any(|r| r.policy.contains("preempt"));
    let gang = reports.iter().find_map(|r| r.gang_slice_s);
    let shapes = space.numa_local || space.defrag.is_some();
    let reserving = reports.iter().any(|r| r.policy.contains("+reserve"));
    let suspensions = |r: &SimReport| {
        let mut cells = String::new();
        if preempting {
            cells.push_str(&format!(" {:>9}", r.suspensions));
        }
        if gang.is_some() {
            cells.push_str(&format!(" {:>9}", r.gang_freezes));
        }
        if malleable.is_some() {
            cells.push_str(&format!(" {:>9} {:>9}", r.malleable_jobs, r.resizes));
        }
        if shapes {
            cells.push_str(&format!(" {:>9} {:>9}", r.refused_on_shape, r.moves));
        }
        if reserving {
            cells.push_str(&format!(
                " {:>9} {:>9}",
                r.blocks,
                format!("{}/{}", r.heads_in_block, r.reserved_heads)
            ));
        }
        if space.prime.is_some() {
            cells.push_str(&format!(" {:>9} {:>9}", r.admitted_starts, r.prime_moves));
        }
        cells
    };
    let mut extra = String::new();
    if shapes {
        extra.push_str("   refused     moves");
    }
    if reserving {
        extra.push_str("    blocks  in block");
    }
    if space.prime.is_some() {
        extra.push_str("  admitted moved out");
    }
    println!(
        "{:<pw$} {:<12} {:>6} {:>10} {:>10} {:>10} {:>9} {:>9} {:>7} {:>7} {:>10}{}{}{}{extra}",
        "policy",
        "placement",
        "util",
        "mean wait",
        "p95 wait",
        "max wait",
        "bnd sldn",
        "makespan",
        "NUMA",
        "L3",
        "jobs/s",
        if preempting { " suspended" } else { "" },
        if gang.is_some() { "    frozen" } else { "" },
        if malleable.is_some() { " malleable   resized" } else { "" }
    );
    for r in reports {
        println!(
            "{:<pw$} {:<12} {:>6.3} {:>10} {:>10} {:>10} {:>9.1} {:>9} {:>6.1}% {:>6.1}% {:>10.0}{}",
            r.policy,
            r.placement,
            r.utilization,
            hours(r.mean_wait_s),
            hours(r.p95_wait_s),
            hours(r.max_wait_s),
            r.mean_bounded_slowdown,
            span(r.makespan_s),
            r.numa_optimal_share * 100.0,
            r.l3_optimal_share * 100.0,
            r.jobs_per_s,
            suspensions(r)
        );
    }
    println!();
    print_percentiles(reports, pw);
    println!();
    if reports.iter().any(|r| !r.partitions.is_empty()) {
        print_partitions(reports);
        println!();
    }
    println!("util: processor-seconds used / (processors x first submit to last end); bnd sldn: mean bounded slowdown, tau = 10 s;");
    println!("p50, p90, p99 (nearest rank), max: of the wait, the response (submit to end: resp) and the bounded slowdown (sldn).");
    println!("NUMA, L3: jobs within the fewest NUMA nodes / L3 groups that hold their size on every host they use.");
    if reports.iter().any(|r| !r.partitions.is_empty()) {
        println!("With a cluster file the figures are over every job of every partition; policy and placement name what the partitions");
        println!("that name none of their own ran (by partition: what each ran).");
    }
    if preempting {
        println!("With preemption the wait and the slowdown count the time a job spent suspended; suspended: how many suspensions.");
        println!("A suspended job's CPUs are lent only to jobs that end, by their estimates, before the job it was suspended for does.");
        if let Some(cost) = reports.iter().find_map(|r| r.suspend_cost_s) {
            println!(
                "Each suspension cost the suspended job {cost} s of progress (--preempt-cost)."
            );
        }
    }
    if let Some(slice) = gang {
        println!("gang: {slice} s slices; frozen: times a job was stopped at a slice boundary for another row. The wait runs to a job's");
        println!("first slice of running, and the slowdown counts the time it spent frozen.");
        if let Some(cost) = reports.iter().find_map(|r| r.switch_cost_s).filter(|c| *c > 0) {
            println!(
                "Each freeze of a job that had run cost it {cost} s of progress (--gang-cost)."
            );
        }
    }
    if let Some(m) = malleable {
        println!(
            "malleable: {} of the jobs marked ({} of {}); those that fit one host ran on ceil(p/{}) to p processors (malleable: how many),",
            m.share,
            m.marked,
            reports.first().map_or(0, |r| r.jobs),
            m.divisor
        );
        println!("sharing each host's cores by equipartition, with linear speedup and no cost per resize (an optimistic bound); resized: size");
        println!("changes. The wait runs to a job's start at whatever size it got; the slowdown counts a job run shrunk.");
    }
    if space.numa_local {
        println!("numa-local: rigid jobs that fit one NUMA node asked for one; refused: start attempts refused on shape on every host");
        println!("tried although cores were free there.");
    } else if shapes {
        println!("refused: start attempts refused on shape although cores were free (without --numa-local, only a strategy that cannot");
        println!("place a plain count refuses).");
    }
    if let Some(d) = space.defrag {
        let cost = match space.move_cost {
            0 => "free (work conserving)".to_string(),
            s => format!("{s} s of the moved job's progress each"),
        };
        println!(
            "defrag: moves: running jobs moved to make room, at most {} per start, none before {} s of running nor within {} s",
            d.limits.max_moves, d.min_run, d.gap
        );
        println!("of its last move or resize; moves are {cost}.");
    }
    if reserving {
        println!("reserve: blocks: CPU blocks set aside for the first waiting job where it is predicted to start; in block: heads that");
        println!("started wholly inside their blocks / heads that had blocks. Other jobs still running when it is due are placed outside");
        println!("the blocks (+reserve-strict: every other job).");
    }
    if let Some((spec, clock)) = space.prime {
        let size = match spec.size {
            PoolSize::Share(f) => format!("{f} of each host's cores"),
            PoolSize::Cores(n) => format!("{n} cores of each host"),
        };
        let on_open = match spec.on_open {
            OnOpen::Stay => "stay",
            OnOpen::Migrate => "are moved out where they fit",
        };
        println!(
            "prime: {size} reserved in the windows for jobs with an estimate of at most {} s (admitted: how many started); others",
            spec.max_runtime
        );
        println!("on a pool when its window opens {on_open} (moved out: how many); {clock}.");
    }
}

const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

type DrawResult = Result<(), Box<dyn std::error::Error>>;

/// Four panels: utilization over time, queue length over time, and the distributions (CDF)
/// of waits and of bounded slowdowns, one line per (policy, placement).
fn draw(path: &Path, title: &str, reports: &[SimReport]) -> DrawResult {
    let root = SVGBackend::new(path, (1400, 1000)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, body) = root.split_vertically(40);
    top.titled(title, ("sans-serif", 22))?;
    let panels = body.split_evenly((2, 2));
    let makespan_days = reports.iter().map(|r| r.makespan_s).fold(1.0, f64::max) / 86_400.0;
    let label = |r: &SimReport| format!("{} / {}", r.policy, r.placement);

    // Daily means over two months or less, weekly beyond (a year of days is noise), and never
    // more than 2,000 points a line.
    let (mut bin_days, mut per) =
        if makespan_days > 60.0 { (7.0, "weekly".to_string()) } else { (1.0, "daily".to_string()) };
    if makespan_days / bin_days > 2_000.0 {
        bin_days = (makespan_days / 2_000.0).ceil();
        per = format!("{bin_days:.0}-day");
    }
    let utilization: Vec<Vec<(f64, f64)>> = reports
        .iter()
        .map(|r| binned(r, bin_days, |s| s.busy as f64 / r.processors.max(1) as f64))
        .collect();
    line_panel(
        &panels[0],
        &format!("Utilization over time ({per} mean)"),
        "days",
        "busy share",
        makespan_days,
        1.0,
        reports,
        &utilization,
        &label,
        SeriesLabelPosition::LowerRight,
    )?;

    let queue: Vec<Vec<(f64, f64)>> =
        reports.iter().map(|r| binned(r, bin_days, |s| s.queue as f64)).collect();
    let queue_max = queue.iter().flatten().map(|p| p.1).fold(1.0, f64::max) * 1.05;
    line_panel(
        &panels[1],
        &format!("Jobs waiting ({per} mean)"),
        "days",
        "jobs",
        makespan_days,
        queue_max,
        reports,
        &queue,
        &label,
        SeriesLabelPosition::UpperRight,
    )?;

    let waits: Vec<Vec<f64>> =
        reports.iter().map(|r| r.waits.iter().map(|w| (*w).max(1) as f64).collect()).collect();
    cdf_panel(
        &panels[2],
        "Wait time distribution",
        "wait, seconds (log; 0 drawn at 1 s)",
        reports,
        waits,
        &label,
    )?;
    let slowdowns: Vec<Vec<f64>> = reports.iter().map(|r| r.slowdowns.clone()).collect();
    cdf_panel(
        &panels[3],
        "Bounded slowdown distribution (tau = 10 s)",
        "bounded slowdown (log)",
        reports,
        slowdowns,
        &label,
    )?;
    root.present()?;
    Ok(())
}

/// The time-weighted mean of `value` over each `bin_days` of the replay, at the bins' middles
/// in days.
fn binned(r: &SimReport, bin_days: f64, value: impl Fn(&sim::Sample) -> f64) -> Vec<(f64, f64)> {
    let width = 86_400.0 * bin_days;
    let span = r.makespan_s.max(1.0);
    let bins = ((span / width).ceil() as usize).clamp(1, 4_000);
    let mut sum = vec![0.0; bins];
    for pair in r.series.windows(2) {
        let (a, b) = (pair[0].t as f64, pair[1].t as f64);
        let v = value(&pair[0]);
        let mut t = a;
        while t < b {
            let bin = ((t / width) as usize).min(bins - 1);
            let bin_end = if bin == bins - 1 { b } else { ((bin + 1) as f64 * width).min(b) };
            if bin_end <= t {
                break;
            }
            sum[bin] += v * (bin_end - t);
            t = bin_end;
        }
    }
    // Each bin's mean over the time it covers: the last one may be shorter than the others.
    sum.iter()
        .enumerate()
        .map(|(i, s)| {
            let start = i as f64 * width;
            let covered = (span - start).clamp(1.0, width);
            ((start + covered / 2.0) / 86_400.0, s / covered)
        })
        .collect()
}

/// Labels with as many decimals as the axis's range needs.
fn label_for(range: f64) -> impl Fn(&f64) -> String {
    let decimals = if range < 2.0 {
        2
    } else if range < 20.0 {
        1
    } else {
        0
    };
    move |v: &f64| format!("{v:.decimals$}")
}

#[allow(clippy::too_many_arguments)]
fn line_panel(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    caption: &str,
    x_desc: &str,
    y_desc: &str,
    x_max: f64,
    y_max: f64,
    reports: &[SimReport],
    lines: &[Vec<(f64, f64)>],
    label: &dyn Fn(&SimReport) -> String,
    legend: SeriesLabelPosition,
) -> DrawResult {
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..x_max.max(1.0), 0f64..y_max)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(&label_for(x_max))
        .y_label_formatter(&label_for(y_max))
        .draw()?;
    for (i, (r, points)) in reports.iter().zip(lines).enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        chart
            .draw_series(LineSeries::new(points.iter().copied(), colour.stroke_width(2)))?
            .label(label(r))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(legend)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

fn cdf_panel(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    caption: &str,
    x_desc: &str,
    reports: &[SimReport],
    mut values: Vec<Vec<f64>>,
    label: &dyn Fn(&SimReport) -> String,
) -> DrawResult {
    let x_max = values.iter().flatten().copied().fold(10.0, f64::max) * 1.5;
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((0.5f64..x_max).log_scale(), 0f64..1.0)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc("share of jobs at or below")
        .x_label_formatter(&|v| if *v < 1.0 { format!("{v:.1}") } else { format!("{v:.0}") })
        .draw()?;
    for (i, (r, v)) in reports.iter().zip(values.iter_mut()).enumerate() {
        v.sort_by(f64::total_cmp);
        let n = v.len().max(1);
        // 400 quantiles are plenty for a picture.
        let points: Vec<(f64, f64)> = (0..=400)
            .map(|q| {
                let idx = ((q * (n - 1)) / 400).min(n - 1);
                (v.get(idx).copied().unwrap_or(1.0).max(1.0), (idx + 1) as f64 / n as f64)
            })
            .collect();
        let colour = COLOURS[i % COLOURS.len()];
        chart.draw_series(LineSeries::new(points, colour.stroke_width(2)))?.label(label(r)).legend(
            move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2)),
        );
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(series: Vec<sim::Sample>, makespan_s: f64) -> SimReport {
        SimReport {
            policy: "fcfs".into(),
            placement: "best-fit",
            hosts: 1,
            processors: 1,
            jobs: 1,
            suspensions: 0,
            suspend_cost_s: None,
            switch_cost_s: None,
            reservation_depth: None,
            gang_slice_s: None,
            gang_freezes: 0,
            malleable_jobs: 0,
            resizes: 0,
            numa_local: false,
            refused_on_shape: 0,
            defrag_starts: 0,
            moves: 0,
            moved_pus: 0,
            prime_moves: 0,
            blocks: 0,
            reserved_heads: 0,
            heads_in_block: 0,
            admitted_starts: 0,
            skipped: Default::default(),
            killed_at_limit: None,
            utilization: 1.0,
            mean_wait_s: 0.0,
            p95_wait_s: 0.0,
            max_wait_s: 0.0,
            mean_bounded_slowdown: 1.0,
            percentiles: Default::default(),
            makespan_s,
            numa_optimal_share: 1.0,
            l3_optimal_share: 1.0,
            jobs_per_s: 0.0,
            waits: vec![0],
            slowdowns: vec![1.0],
            series,
            outcomes: Vec::new(),
            partitions: Vec::new(),
        }
    }

    #[test]
    fn a_machine_busy_all_the_time_is_drawn_busy_all_the_time_also_in_a_short_last_bin() {
        // One job holds the only processor for a day and a half.
        let end = 129_600;
        let r = report(
            vec![
                sim::Sample { t: 0, busy: 1, queue: 0 },
                sim::Sample { t: end, busy: 0, queue: 0 },
            ],
            end as f64,
        );
        let points = binned(&r, 1.0, |s| s.busy as f64);
        assert_eq!(points.len(), 2);
        assert!(points.iter().all(|(_, v)| (*v - 1.0).abs() < 1e-9), "{points:?}");
        assert!(
            (points[1].0 - 1.25).abs() < 1e-9,
            "the last bin is drawn at its middle: {points:?}"
        );
        // Times far beyond any day count end in bounded time with bounded points.
        let far = report(
            vec![
                sim::Sample { t: 0, busy: 1, queue: 0 },
                sim::Sample { t: 1 << 40, busy: 0, queue: 0 },
            ],
            (1u64 << 40) as f64,
        );
        assert!(binned(&far, 1.0, |s| s.busy as f64).len() <= 4_000);
    }

    /// The value, or a panic with the failure's message.
    fn ok<T>(r: Result<T, Failure>) -> T {
        r.unwrap_or_else(|f| panic!("{}", f.message))
    }

    /// The failure's message.
    fn err<T>(r: Result<T, Failure>) -> String {
        match r {
            Ok(_) => panic!("no failure"),
            Err(f) => f.message,
        }
    }

    #[test]
    fn a_pool_size_that_means_whole_hosts_is_said() {
        assert!(pool_size_warning(PoolSize::Share(0.25), 1).unwrap().contains("whole host"));
        assert!(pool_size_warning(PoolSize::Share(0.25), 3).is_none(), "one core of three");
        assert!(pool_size_warning(PoolSize::Share(0.25), 16).is_none());
        assert!(pool_size_warning(PoolSize::Cores(4), 2).unwrap().contains("a host has 2"));
        assert!(pool_size_warning(PoolSize::Cores(2), 2).is_none(), "asked for the whole host");
    }

    #[test]
    fn prime_specs_read_with_windows_of_their_own_commas_and_bad_ones_say_why() {
        let p = ok(parse_prime(
            "count=0.25,windows=Mon-Fri 08:00-18:00;Sat,Sun 10:00-14:00,max-runtime=3600,on-open=migrate",
        ));
        assert_eq!(p.size, PoolSize::Share(0.25));
        assert_eq!(p.windows.len(), 2);
        assert_eq!(p.windows[1].days, [false, false, false, false, false, true, true]);
        assert_eq!((p.max_runtime, p.on_open), (3600, OnOpen::Migrate));
        let q = ok(parse_prime(DEFAULT_PRIME));
        assert_eq!((q.size, q.on_open), (PoolSize::Share(0.25), OnOpen::Stay));
        assert_eq!(
            ok(parse_prime("count=4,windows=Mon 00:00-24:00,max-runtime=1")).size,
            PoolSize::Cores(4)
        );
        for (bad, says) in [
            ("windows=Mon 08:00-18:00,max-runtime=60", "count= is missing"),
            ("count=0.25,max-runtime=60", "windows= is missing"),
            ("count=0.25,windows=Mon 08:00-18:00", "max-runtime= is missing"),
            ("count=1.5,windows=Mon 08:00-18:00,max-runtime=60", "whole number of cores"),
            ("count=0.25,windows=Mo 08:00-18:00,max-runtime=60", "not a day"),
            ("count=0.25,windows=Mon 08:00-18:00,max-runtime=0", "seconds, 1 or more"),
            ("count=0.25,windows=Mon 08:00-18:00,max-runtime=60,on-open=move", "stay or migrate"),
            ("count=0.25,count=0.5,windows=Mon 08:00-18:00,max-runtime=60", "twice"),
            ("size=3,count=0.25", "KEY=VALUE"),
        ] {
            let e = err(parse_prime(bad));
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn the_trace_clock_comes_from_its_header_or_the_flag() {
        assert_eq!(ok(parse_utc_offset("-08:00")), -28_800);
        assert_eq!(ok(parse_utc_offset("+5:30")), 19_800);
        assert_eq!(ok(parse_utc_offset("1")), 3600);
        for bad in ["-15", "+01:60", "PST", ""] {
            assert!(parse_utc_offset(bad).is_err(), "{bad}");
        }
        // The SDSC Paragon log's header: 10:53:57 PST is 18:53:57 UTC.
        let header = "; UnixStartTime: 820090437\n; TimeZoneString: US/Pacific\n\
; StartTime: Wed Dec 27 10:53:57 PST 1995\n1 0 -1 10 2 -1 -1 -1 -1 -1 1 -1 -1 -1 0 -1 -1 -1\n";
        assert_eq!(
            header_utc_offset(header, 820_090_437),
            Some((-28_800, Some("US/Pacific".into())))
        );
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(1995, 12, 27) * 86_400 + 18 * 3600 + 53 * 60 + 57, 820_090_437);
        let trace = swf::parse(header).unwrap();
        let (epoch, offset, note) = ok(trace_clock(header, &trace, None));
        assert_eq!((epoch, offset), (820_090_437, -28_800));
        assert!(note.contains("UTC-08:00") && note.contains("US/Pacific"), "{note}");
        let (_, offset, note) = ok(trace_clock(header, &trace, Some("+01:00")));
        assert_eq!(offset, 3600);
        assert!(note.contains("--utc-offset"), "{note}");
        let bare = swf::parse("1 0 -1 10 2 -1 -1 -1 -1 -1 1 -1 -1 -1 0 -1 -1 -1\n").unwrap();
        let (epoch, offset, note) = ok(trace_clock("", &bare, None));
        assert_eq!((epoch, offset), (0, 0));
        assert!(note.contains("Thursday"), "{note}");
    }

    #[test]
    fn policies_take_their_options_and_refuse_what_does_not_go_together() {
        let none = PolicyChoice::default();
        let p = ok(parse_policies("easy,easy+defrag+reserve,fcfs+prime", none));
        assert_eq!(p.len(), 3);
        assert!(p[1].defrag && p[1].reserve && !p[1].strict && p[2].prime);
        let strict = ok(parse_policies("easy+reserve-strict", none));
        assert!(strict[0].reserve && strict[0].strict);
        // --defrag adds to every policy when none names it; --reserve only to easy ones.
        let everywhere = PolicyChoice { defrag: true, reserve: true, ..none };
        let p = ok(parse_policies("fcfs,easy", everywhere));
        assert!(p.iter().all(|c| c.defrag));
        assert_eq!(p.iter().map(|c| c.reserve).collect::<Vec<_>>(), vec![false, true]);
        for (bad, says) in [
            ("fcfs+reserve", "easy only"),
            ("easy+preempt+defrag", "neither preemption nor gang"),
            ("easy+gang+prime", "neither preemption nor gang"),
            ("easy+defragment", "not an option"),
        ] {
            let e = err(parse_policies(bad, none));
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
