//! The commands that talk to this host's topod through its socket: `status`, `jobs`, `alloc`,
//! `release`, `suspend`, `resume`, `resize`, reservations and `run`.

use crate::cli::Daemon;
use crate::{print_json, Failure};
use nix::sys::signal::{SigHandler, Signal};
use std::path::PathBuf;
use topo_client::Client;
use topo_core::ledger::Ledger;
use topo_core::ledger::{Allocation, JobState, JobView};
use topo_core::proto::reply::{FreeMap, Release};
use topo_core::proto::Op;
use topo_core::topology::Topology;
use topod::picture::printable;
use topod::picture::{self, Marks};

pub(crate) fn connect(daemon: &Daemon) -> Result<Client, Failure> {
    Client::connect(&daemon.socket).map_err(|e| Failure::runtime(e.to_string()))
}

/// Sends `op` and reads its reply as `T` (see `topo_core::proto::reply`).
pub(crate) fn call<T: serde::de::DeserializeOwned>(
    client: &mut Client,
    op: Op,
) -> Result<T, Failure> {
    let request = match &op {
        Op::Allocate(a) => Some(a.request.clone()),
        Op::Fit(f) => Some(f.request.clone()),
        Op::Reserve(r) => Some(r.request.clone()),
        _ => None,
    };
    client.call_as(op).map_err(|e| {
        // Where topod says the request string is wrong: shown under it.
        let under = match (&e, &request) {
            (topo_client::ClientError::Refused(body), Some(text)) => body
                .at
                .as_ref()
                .filter(|at| at.field == "request")
                .map(|at| format!("\n{}", topo_core::request::caret(text, at.start..at.end))),
            _ => None,
        };
        Failure::runtime(format!("{e}{}", under.unwrap_or_default()))
    })
}

fn live_state(daemon: &Daemon) -> Result<(Topology, Vec<JobView>, FreeMap), Failure> {
    let mut c = connect(daemon)?;
    Ok((call(&mut c, Op::Topology)?, call(&mut c, Op::List)?, call(&mut c, Op::FreeMap)?))
}

pub(crate) fn status(daemon: &Daemon, json: bool) -> Result<(), Failure> {
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
    if let Some(moves) = &free.moves {
        println!("{}", defrag_line(moves, now_s()));
    }
    Ok(())
}

/// Seconds since the epoch.
fn now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// What `defrag` may move now, and when the others may: what a scheduler's plug-in counts on.
fn defrag_line(moves: &topo_core::proto::reply::DefragView, now: i64) -> String {
    let movable = moves.jobs.iter().filter(|j| j.movable_from.is_some_and(|t| t <= now)).count();
    let mut later: Vec<String> = moves
        .jobs
        .iter()
        .filter(|j| j.movable_from.is_none_or(|t| t > now))
        .map(|j| match j.movable_from {
            Some(t) => format!("{} in {} s", j.job, t - now),
            None => format!("{} not while it runs", j.job),
        })
        .collect();
    later.sort();
    let mut line = format!("defrag: {movable} running job(s) may be moved now to make room");
    if !later.is_empty() {
        line.push_str(&format!("; not yet: {}", later.join(", ")));
    }
    line
}

pub(crate) fn jobs(daemon: &Daemon, json: bool) -> Result<(), Failure> {
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
            from.push(format!("queue {}", printable(queue)));
        }
        if let Some(pool) = &j.pool {
            from.push(format!("asks for prime-time pool {}", printable(pool)));
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
        if !j.gpus.is_empty() {
            let by_task = !j.task_gpus.is_empty();
            let gpus: Vec<String> = j.gpus.iter().map(|g| gpu_cell(g, by_task)).collect();
            println!("{:<16} GPUs {}", "", gpus.join(", "));
        }
        if !j.task_gpus.is_empty() {
            let tasks: Vec<String> = j
                .task_gpus
                .iter()
                .enumerate()
                .map(|(t, g)| format!("task {t}: {}", printable(&g.join(", "))))
                .collect();
            println!("{:<16} GPUs by task (nearest its CPUs) {}", "", tasks.join("; "));
        }
        if !j.nics.is_empty() {
            let nics: Vec<String> =
                j.nics.iter().map(|n| nic_cell(n, !j.gpus.is_empty())).collect();
            println!("{:<16} nearest network adapters {}", "", nics.join(", "));
        }
    }
    Ok(())
}

/// A network adapter near a job for `topoctl jobs`: `0000:12:00.0 (ib0, mlx5_0; behind its
/// GPUs' PCIe switch)`.
fn nic_cell(n: &topo_core::ledger::JobNic, with_gpus: bool) -> String {
    let names: Vec<String> = n.names.iter().map(|t| printable(t)).collect();
    let near = n.near.describe(with_gpus);
    match names.is_empty() {
        true => format!("{} ({near})", printable(&n.pci_address)),
        false => format!("{} ({}; {near})", printable(&n.pci_address), names.join(", ")),
    }
}

/// A job's GPU for `topoctl jobs`: `0000:3b:00.0 (card0, NUMA node 1, local to every CPU)`;
/// `by_task`: the job's tasks have GPUs of their own, and the distance is to those of its
/// tasks ("local to its tasks' CPUs").
fn gpu_cell(g: &topo_core::ledger::JobGpu, by_task: bool) -> String {
    // The record is root's, but its text is still not the terminal's to interpret.
    let address = printable(&g.pci_address);
    if g.gone {
        return format!("{address} (no longer on this host)");
    }
    let mut parts: Vec<String> = g.name.iter().map(|n| printable(n)).collect();
    let whose = if by_task { "of its tasks" } else { "" };
    match (g.numa_node, g.distance) {
        (Some(node), Some(10)) if by_task => {
            parts.push(format!("NUMA node {node}, local to its tasks' CPUs"))
        }
        (Some(node), Some(10)) => parts.push(format!("NUMA node {node}, local to every CPU")),
        (Some(node), Some(d)) => parts.push(format!(
            "NUMA node {node}, distance {d} to the farthest CPU{}{whose} (10 = local)",
            if by_task { " " } else { "" }
        )),
        (Some(node), None) => parts.push(format!("NUMA node {node}")),
        (None, _) => parts.push("NUMA node not known".into()),
    }
    if let Some(fabric) = g.fabric.as_deref().and_then(topo_core::topology::fabric_name) {
        parts.push(printable(&fabric));
    }
    format!("{address} ({})", parts.join(", "))
}

pub(crate) fn alloc_and_print(daemon: &Daemon, op: Op, json: bool) -> Result<(), Failure> {
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

pub(crate) fn release_and_print(daemon: &Daemon, job: String, json: bool) -> Result<(), Failure> {
    let r: Release = call(&mut connect(daemon)?, Op::Release { job })?;
    if json {
        return print_json(&r);
    }
    println!("job {} released ({} process(es) killed)", r.job, r.killed);
    Ok(())
}

pub(crate) fn suspend_and_print(daemon: &Daemon, job: String, json: bool) -> Result<(), Failure> {
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

pub(crate) fn reserve_and_print(
    daemon: &Daemon,
    args: topo_core::proto::ReserveArgs,
    json: bool,
) -> Result<(), Failure> {
    let r: topo_core::proto::reply::Reserve = call(&mut connect(daemon)?, Op::Reserve(args))?;
    if json {
        return print_json(&r);
    }
    let until = r.reservation.expires_at - r.reservation.made_at;
    let gpus = if r.reservation.gpus.is_empty() {
        String::new()
    } else {
        format!(" and GPU(s) {}", r.reservation.gpus.join(", "))
    };
    // What running jobs still hold of it, CPUs and GPUs.
    let mut busy = Vec::new();
    if !r.busy.is_empty() {
        busy.push(format!("{} of the CPUs ({})", r.busy.len(), r.busy));
    }
    if !r.busy_gpus.is_empty() {
        busy.push(format!("GPU(s) {}", r.busy_gpus.join(", ")));
    }
    let now = if busy.is_empty() {
        "all free now".to_string()
    } else {
        format!("{} are busy until their jobs end", busy.join(" and "))
    };
    println!(
        "job {}: CPUs {}{gpus} reserved for {until} s; {now}",
        r.reservation.job, r.reservation.cpus
    );
    Ok(())
}

pub(crate) fn unreserve_and_print(daemon: &Daemon, job: String) -> Result<(), Failure> {
    let r: topo_core::reservation::Reservation =
        call(&mut connect(daemon)?, Op::Unreserve { job })?;
    println!("job {}: reservation of CPUs {} dropped", r.job, r.cpus);
    Ok(())
}

pub(crate) fn reservations(daemon: &Daemon, json: bool) -> Result<(), Failure> {
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
            "{:<16} {:>4}  {:<24} {:>9}s  {}{}",
            r.job,
            r.cpus.len(),
            r.cpus.to_string(),
            (r.expires_at - now).max(0),
            r.request,
            if r.gpus.is_empty() {
                String::new()
            } else {
                format!(" (GPUs {})", r.gpus.join(", "))
            }
        );
    }
    Ok(())
}

pub(crate) fn resize_and_print(
    daemon: &Daemon,
    job: String,
    tasks: u32,
    json: bool,
) -> Result<(), Failure> {
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

pub(crate) fn resume_and_print(daemon: &Daemon, job: String, json: bool) -> Result<(), Failure> {
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

pub(crate) fn run_job(
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

#[cfg(test)]
mod defrag_line_tests {
    use super::defrag_line;
    use topo_core::proto::reply::{DefragView, MovableJob};

    #[test]
    fn the_status_says_which_jobs_defrag_may_move_and_when_the_others_may() {
        let job = |name: &str, from: Option<i64>| MovableJob {
            job: name.into(),
            request: "affinity[core(1)]".into(),
            cpus: topo_core::CpuSet::parse_list("0").unwrap(),
            fenced: Default::default(),
            tasks: Vec::new(),
            movable_from: from,
        };
        let view = DefragView {
            strategy: topo_core::place::Strategy::BestFit,
            limits: Default::default(),
            jobs: vec![job("a", Some(900)), job("b", Some(1_030)), job("c", None)],
        };
        assert_eq!(
            defrag_line(&view, 1_000),
            "defrag: 1 running job(s) may be moved now to make room; not yet: b in 30 s, c not \
             while it runs"
        );
    }
}

#[cfg(test)]
mod printable_tests {
    use super::*;

    #[test]
    fn device_names_cannot_drive_the_terminal() {
        let hostile = "\u{1b}]0;PWNED\u{7}\u{1b}[2Jred\nx\u{202e}y\u{9b}z\u{200b}";
        assert_eq!(printable(hostile), "]0;PWNED[2Jredxyz");
        let gpu = topo_core::ledger::JobGpu {
            pci_address: "0000:88:00.0".into(),
            name: Some("\u{1b}[31mred".into()),
            numa_node: Some(1),
            distance: Some(10),
            gone: false,
            fabric: None,
        };
        assert_eq!(
            gpu_cell(&gpu, false),
            "0000:88:00.0 ([31mred, NUMA node 1, local to every CPU)"
        );
        let linked = topo_core::ledger::JobGpu { fabric: Some("xgmi:\u{1b}[2J7".into()), ..gpu };
        assert_eq!(
            gpu_cell(&linked, false),
            "0000:88:00.0 ([31mred, NUMA node 1, local to every CPU, xGMI hive [2J7)"
        );
        let nic = topo_core::ledger::JobNic {
            pci_address: "0000:12:00.0".into(),
            names: vec!["ib\u{1b}[2J0".into(), "mlx5_0".into()],
            near: topo_core::gpus::NicNearness::NumaNode,
        };
        assert_eq!(nic_cell(&nic, false), "0000:12:00.0 (ib[2J0, mlx5_0; in its CPUs' NUMA node)");
    }
}
