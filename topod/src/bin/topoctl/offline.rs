//! The commands that need no daemon and no root, on any machine's topology file: `show`
//! (the host picture), `check` (a request parsed and merged), `place` (what-if placement) and
//! `demo`.

use crate::cli::Source;
use crate::{print_json, Failure};
use serde::Serialize;
use std::path::{Path, PathBuf};
use topo_core::ledger::Ledger;
use topo_core::place::{self, HostMetrics, HostModel, Placement, Strategy};
use topo_core::request::{self, Request};
use topo_core::topology::{hwloc_xml, sysfs, Topology};
use topo_core::CpuSet;
use topod::picture::{self, Marks};

pub(crate) fn load(source: &Source) -> Result<Topology, Failure> {
    match (&source.topology, &source.sysfs) {
        (Some(path), _) => load_path(path),
        (None, Some(dir)) => sysfs::read(dir).map_err(|e| Failure::input(e.to_string())),
        (None, None) => sysfs::read(Path::new("/"))
            .map_err(|e| Failure::runtime(format!("reading this host: {e}"))),
    }
}

pub(crate) fn load_path(path: &Path) -> Result<Topology, Failure> {
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

pub(crate) fn show(source: &Source, json: bool) -> Result<(), Failure> {
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

pub(crate) fn check(
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

pub(crate) fn place_cmd(
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
pub(crate) fn shared_topologies() -> Option<PathBuf> {
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

pub(crate) fn demo(source: &Source, json: bool) -> Result<(), Failure> {
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
