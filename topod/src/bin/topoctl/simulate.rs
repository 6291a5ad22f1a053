//! `topoctl simulate`: replay a Standard Workload Format trace on N hosts of one machine under
//! one or more cluster policies and host strategies, and print, dump or draw what happened.
//!
//! The replay itself is `topo_core::sim` over `topo_core::policy`; this file reads the inputs,
//! times the replays, and writes the table, the JSON and the SVG.

use super::{load_path, print_json, Failure};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use topo_core::place::{HostModel, Strategy};
use topo_core::policy::{Gang, Malleability, PolicyConfig, Preempt, QueueOrder, Time};
use topo_core::sim::{self, SimReport, TraceFilter};
use topo_core::swf;
use topo_core::topology::Topology;
use topo_core::CpuSet;

const SIMULATE_HELP: &str = "\
How a trace is replayed:
  A job's processors come from the requested count (field 8), else the allocated count (field 5).
  The scheduler plans with the requested time (field 9) as the estimate; a job that ran longer than
  it requested runs its logged time (the log shows it was not killed), and the estimate is raised to
  it. Without field 9 the run time is the estimate.
  Failed (status 0) and cancelled (5) jobs that ran hold their processors for their run time; lines
  without a run time or a processor count (cancelled before they started) and partial-execution lines
  (status 2, 3, 4; their job's summary line is replayed) are left out and counted.
  fcfs starts jobs in submit order; easy gives the first waiting job a reservation at the earliest
  estimated time it fits and starts later jobs now if they end by then or use only processors it will
  not need.
  With +malleable (--malleable F) the share F of the jobs, chosen by a hash of their job numbers, may
  be resized: one that asks for p processors and fits one host runs on ceil(p/4) to p (--malleable-
  divisor), with linear speedup (its p x run processor-seconds drain at the rate of the processors it
  holds, no cost per resize: an optimistic bound). On each host the malleable jobs share the cores the
  rigid jobs leave equally (equipartition), rebalanced whenever a job starts or ends there; one starts
  as soon as its least size is free, and a rigid job takes back what they hold beyond their least
  sizes. Multi-host jobs stay rigid.

Examples:
  topoctl simulate --trace SDSC-Par-1996-3.1-cln.swf --hosts 400 --policy fcfs,easy --svg out.svg
  topoctl simulate --trace SDSC-Par-1996-3.1-cln.swf --skip-queues 0 --hosts 352 --json
  topoctl simulate --trace SDSC-Par-1996-3.1-cln.swf --hosts 25 --topology 2socket.xml \\
      --placement best-fit,first-fit
  topoctl simulate --trace SDSC-Par-1996-3.1-cln.swf --hosts 22 --topology 2socket.xml \\
      --skip-queues 0 --policy easy,easy+malleable --malleable 1";

/// `topoctl simulate`'s options.
#[derive(Args)]
#[command(after_help = SIMULATE_HELP)]
pub(crate) struct SimulateOpts {
    /// The trace: a Standard Workload Format file (e.g. from the Parallel Workloads Archive).
    #[arg(long, value_name = "FILE")]
    trace: PathBuf,
    /// Hosts in the cluster, up to 1,000,000 [default: the trace's MaxProcs (else MaxNodes)
    /// header over the processors of one host].
    #[arg(long, value_name = "N")]
    hosts: Option<usize>,
    /// One host: an hwloc XML file, a sysfs snapshot directory, or flat:P for P plain
    /// processors. A processor is one whole core.
    #[arg(long, value_name = "FILE|flat:P", default_value = "flat:1")]
    topology: String,
    /// Cluster policies, comma-separated: fcfs, easy, and either with +preempt (fcfs+preempt,
    /// easy+preempt: suspending running jobs for one that has waited, see --preempt), +gang
    /// (easy+gang: time slicing, see --gang) or +malleable (easy+malleable: jobs resized by
    /// equipartition, see --malleable). Each is replayed and compared.
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
    /// Preemption for every policy listed: a waiting job whose expansion factor ((wait +
    /// estimate) / estimate) reached --preempt-xf suspends running jobs with lower ones, chosen
    /// to free the tightest domain; they resume on their own CPUs first when those are free.
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
    /// Gang time slicing with slices of T seconds (Slurm's default slice is 30): every host has
    /// --gang-rows rows, a job starts in the first row with room on all its hosts, and in slice
    /// k the jobs of row k mod rows run, with any job of another row whose CPUs they leave idle;
    /// the rest are frozen. Applies to every policy listed when none says +gang [default for
    /// +gang: 30].
    #[arg(long, value_name = "T", value_parser = clap::value_parser!(u32).range(1..=86_400))]
    gang: Option<u32>,
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
    /// Replay each combination this many times and report the median speed (jobs/s).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    repeat: u32,
}

/// `flat:P` (one plain P-processor host), or a topology file or sysfs snapshot.
pub(crate) fn host_topology(spec: &str) -> Result<Topology, Failure> {
    if let Some(count) = spec.strip_prefix("flat:") {
        let cores: u32 =
            count.parse().ok().filter(|c| (1..=65_536).contains(c)).ok_or_else(|| {
                Failure::input(format!(
                    "--topology {spec}: after flat: comes the processor count per host, 1 to 65536"
                ))
            })?;
        return Ok(Topology::flat(cores));
    }
    let path = Path::new(spec);
    if !path.exists() {
        return Err(Failure::input(format!(
            "--topology {spec}: no such file or directory (give an hwloc XML file, a sysfs snapshot directory, or flat:P)"
        )));
    }
    load_path(path)
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

/// One policy to replay: the cluster order, with preemption, gang slicing or malleable jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PolicyChoice {
    order: QueueOrder,
    preempt: bool,
    gang: bool,
    malleable: bool,
}

/// A comma list of policies: `fcfs`, `easy`, each optionally `+preempt`, `+gang` or
/// `+malleable`; `all_preempt` adds preemption to every one, `all_gang` gang slicing and
/// `all_malleable` malleable jobs to every one when none names them.
fn parse_policies(
    text: &str,
    all_preempt: bool,
    all_gang: bool,
    all_malleable: bool,
) -> Result<Vec<PolicyChoice>, Failure> {
    let names: Vec<String> = parse_list("--policy", text)?;
    let any_gang = names.iter().any(|n| n.split('+').skip(1).any(|x| x == "gang"));
    let any_malleable = names.iter().any(|n| n.split('+').skip(1).any(|x| x == "malleable"));
    let mut all = Vec::new();
    for name in &names {
        let mut pieces = name.split('+');
        let order = pieces
            .next()
            .unwrap_or_default()
            .parse::<QueueOrder>()
            .map_err(|e| Failure::input(format!("--policy {text:?}: {e}")))?;
        let mut choice = PolicyChoice {
            order,
            preempt: all_preempt,
            gang: all_gang && !any_gang,
            malleable: all_malleable && !any_malleable,
        };
        for option in pieces {
            match option {
                "preempt" => choice.preempt = true,
                "gang" => choice.gang = true,
                "malleable" => choice.malleable = true,
                other => {
                    return Err(Failure::input(format!(
                        "--policy {text:?}: {name:?}: +{other} is not an option (they are +preempt, +gang and +malleable)"
                    )))
                }
            }
        }
        if choice.preempt && choice.gang {
            return Err(Failure::input(format!(
                "--policy {text:?}: {name:?}: preemption and gang slicing do not go together (both suspend jobs: choose one per policy; --preempt and --gang apply to every policy listed)"
            )));
        }
        if choice.malleable && (choice.preempt || choice.gang) {
            return Err(Failure::input(format!(
                "--policy {text:?}: {name:?}: malleable jobs go with neither preemption nor gang slicing (equipartition would grow jobs into a suspended job's CPUs, and rows would share what it divides; --preempt, --gang and --malleable apply to every policy listed)"
            )));
        }
        if !all.contains(&choice) {
            all.push(choice);
        }
    }
    Ok(all)
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

/// At most this many hosts, and processors in all.
const MAX_HOSTS: usize = 1_000_000;
const MAX_PROCESSORS: u64 = 1 << 24;

/// The largest trace read (the largest in the Parallel Workloads Archive is a few hundred MB).
const MAX_TRACE_BYTES: u64 = 4 << 30;

/// Reads a trace as text, with a size limit, naming the line of a byte that is not UTF-8.
fn read_trace(path: &Path) -> Result<String, Failure> {
    use std::io::Read;
    let cannot = |e: std::io::Error| {
        Failure::input(format!("cannot read the trace {}: {e}", path.display()))
    };
    let file = std::fs::File::open(path).map_err(cannot)?;
    let mut bytes = Vec::new();
    file.take(MAX_TRACE_BYTES + 1).read_to_end(&mut bytes).map_err(cannot)?;
    if bytes.len() as u64 > MAX_TRACE_BYTES {
        return Err(Failure::input(format!(
            "the trace {} is larger than {} GiB; cut it (e.g. with head) or check that it is a trace",
            path.display(),
            MAX_TRACE_BYTES >> 30
        )));
    }
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let line = e.as_bytes()[..at].iter().filter(|b| **b == b'\n').count() + 1;
        Failure::input(format!(
            "{}: line {line}: byte {at} is not text (UTF-8); a Standard Workload Format file is plain text",
            path.display()
        ))
    })
}

pub(crate) fn run(args: SimulateOpts) -> Result<(), Failure> {
    let policies =
        parse_policies(&args.policy, args.preempt, args.gang.is_some(), args.malleable.is_some())?;
    let malleable_share = args.malleable.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&malleable_share) {
        return Err(Failure::input(format!(
            "--malleable {malleable_share}: the share of malleable jobs is from 0 to 1"
        )));
    }
    let malleability = Malleability { min_divisor: args.malleable_divisor };
    let gang = Gang { slice: Time::from(args.gang.unwrap_or(30)), rows: args.gang_rows };
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
    let placements = parse_placements(&args.placement)?;
    let queues = args.queues.as_deref().map(|q| parse_queues("--queues", q)).transpose()?;
    let skip_queues = args
        .skip_queues
        .as_deref()
        .map(|q| parse_queues("--skip-queues", q))
        .transpose()?
        .unwrap_or_default();
    let text = read_trace(&args.trace)?;
    let trace =
        swf::parse(&text).map_err(|e| Failure::input(format!("{}: {e}", args.trace.display())))?;
    let topo = host_topology(&args.topology)?;
    let model = Arc::new(
        HostModel::new(&topo, &CpuSet::new())
            .map_err(|e| Failure::input(format!("--topology {}: {e}", args.topology)))?,
    );
    let cores_per_host =
        model.cores.iter().filter(|c| c.is_subset(&model.allocatable)).count() as u64;
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
            "{} has no '; MaxProcs:' or '; MaxNodes:' header: say how many hosts with --hosts N",
            args.trace.display()
        )))
        }
    };
    let total = cores_per_host * hosts as u64;
    if total > MAX_PROCESSORS {
        return Err(Failure::input(format!(
            "{hosts} hosts of {cores_per_host} cores are {total} processors; at most {MAX_PROCESSORS} are simulated"
        )));
    }
    // Where the picture goes is checked before the replay, not after it.
    if let Some(path) = &args.svg {
        std::fs::File::create(path).map_err(|e| {
            Failure::input(format!("--svg {}: cannot write there: {e}", path.display()))
        })?;
    }
    let filter = TraceFilter { queues, skip_queues };
    let (mut jobs, skipped) = sim::jobs_from_trace(&trace, &filter, total);
    // Marks mean nothing to a policy without malleable jobs: every replay gets the same jobs.
    let any_malleable = policies.iter().any(|c| c.malleable);
    let marked = if any_malleable { sim::mark_malleable(&mut jobs, malleable_share) } else { 0 };
    if jobs.is_empty() {
        let filtered = if filter == TraceFilter::default() {
            String::new()
        } else {
            "; --queues/--skip-queues left out the rest".to_string()
        };
        return Err(Failure::input(format!(
            "{}: no job to replay ({} job lines, {} left out: {}{filtered})",
            args.trace.display(),
            trace.jobs.len(),
            skipped.values().sum::<usize>(),
            describe_skipped(&skipped)
        )));
    }
    let topology_name = Path::new(&topo.source)
        .file_name()
        .map_or_else(|| topo.source.clone(), |n| n.to_string_lossy().into());
    let trace_name = args
        .trace
        .file_name()
        .map_or_else(|| args.trace.display().to_string(), |n| n.to_string_lossy().into());
    let mut reports = Vec::new();
    for &choice in &policies {
        for &placement in &placements {
            let config = PolicyConfig {
                order: choice.order,
                strategy: placement,
                preempt: choice.preempt.then_some(rules),
                gang: choice.gang.then_some(gang),
                malleable: choice.malleable.then_some(malleability),
            };
            // Each repetition replays the same jobs and decides the same; the speed reported is
            // the median over the repetitions.
            let mut speeds = Vec::with_capacity(args.repeat as usize);
            let mut kept = None;
            for _ in 0..args.repeat.max(1) {
                let bar = progress_bar(
                    jobs.len(),
                    &format!("{} {}", sim::policy_name(&config), placement.name()),
                );
                let hosts_vec = vec![Arc::clone(&model); hosts];
                let began = Instant::now();
                let report = sim::replay(hosts_vec, &jobs, config, &mut |done| {
                    bar.set_position(done as u64)
                })
                .map_err(|e| Failure::runtime(format!("the replay stopped: {e}")))?;
                speeds.push(jobs.len() as f64 / began.elapsed().as_secs_f64().max(1e-9));
                bar.finish_and_clear();
                kept.get_or_insert(report);
            }
            let Some(mut report) = kept else { continue };
            speeds.sort_by(f64::total_cmp);
            report.jobs_per_s = speeds[speeds.len() / 2];
            report.skipped = skipped.iter().map(|(k, v)| (k.to_string(), *v)).collect();
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
        );
    }
    if let Some(path) = &args.svg {
        let title = format!("{trace_name} on {hosts} × {topology_name} ({total} processors)");
        draw(path, &title, &reports)
            .map_err(|e| Failure::runtime(format!("cannot write {}: {e}", path.display())))?;
        if !args.json {
            println!("\npictures: {}", path.display());
        }
    }
    Ok(())
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

/// A makespan: days, or hours when under two days.
fn span(s: f64) -> String {
    if s >= 2.0 * 86_400.0 {
        format!("{:.1} d", s / 86_400.0)
    } else {
        format!("{:.1} h", s / 3600.0)
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
    println!();
    let pw = reports.iter().map(|r| r.policy.len()).max().unwrap_or(0).max(7);
    let preempting = reports.iter().any(|r| r.policy.contains("preempt"));
    let gang = reports.iter().find_map(|r| r.gang_slice_s);
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
        cells
    };
    println!(
        "{:<pw$} {:<12} {:>6} {:>10} {:>10} {:>10} {:>9} {:>9} {:>7} {:>7} {:>10}{}{}{}",
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
    println!("util: processor-seconds used / (processors x first submit to last end); bnd sldn: mean bounded slowdown, tau = 10 s;");
    println!("NUMA, L3: jobs within the fewest NUMA nodes / L3 groups that hold their size on every host they use.");
    if preempting {
        println!("With preemption the wait runs to a job's first start, and the slowdown counts the time it spent suspended.");
    }
    if let Some(slice) = gang {
        println!("gang: {slice} s slices; frozen: times a job was stopped at a slice boundary for another row. The wait runs to a job's");
        println!("first slice of running, and the slowdown counts the time it spent frozen.");
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
            gang_slice_s: None,
            gang_freezes: 0,
            malleable_jobs: 0,
            resizes: 0,
            skipped: Default::default(),
            utilization: 1.0,
            mean_wait_s: 0.0,
            p95_wait_s: 0.0,
            max_wait_s: 0.0,
            mean_bounded_slowdown: 1.0,
            makespan_s,
            numa_optimal_share: 1.0,
            l3_optimal_share: 1.0,
            jobs_per_s: 0.0,
            waits: vec![0],
            slowdowns: vec![1.0],
            series,
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
}
