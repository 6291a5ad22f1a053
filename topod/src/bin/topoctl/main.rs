//! `topoctl`: the administrator's and user's view of topo.
//!
//! [`cli`] is the command line (clap); [`offline`] the commands that work on any machine's
//! topology file with no daemon and no root (`show`, `check`, `place`, `demo`); [`live`] those
//! that ask this host's topod; [`simulate`] replays workload traces; [`bench`](mod@bench) holds the
//! benchmarks (`topoctl bench ...`); [`lsf`] and [`slurm_features`] are the batch systems'
//! helpers; [`docs`] writes the man pages and completions. This file dispatches.

mod bench;
mod cli;
mod cluster;
mod docs;
mod jobs_out;
mod live;
mod lsf;
mod offline;
mod simulate;
mod slurm_features;

use cli::{BenchCommand, Cli, Command};
use live::{
    alloc_and_print, jobs, release_and_print, reservations, reserve_and_print, resize_and_print,
    resume_and_print, run_job, status, suspend_and_print, unreserve_and_print,
};
use offline::{check, demo, place_cmd, show};

use clap::Parser;
use nix::sys::signal::{SigHandler, Signal};
use serde::Serialize;
use std::process::ExitCode;
use topo_core::proto::Op;

/// A failure that ends the command, with the exit code to use.
#[derive(Debug)]
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
            gpus,
            gpus_by_numa,
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
                gpus,
                gpus_by_numa,
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
            // A message may quote what topod read from the host (device names).
            eprintln!("topoctl: {}", topod::picture::printable_lines(&f.message));
            ExitCode::from(f.code)
        }
    }
}

pub(crate) fn print_json<T: Serialize>(value: &T) -> Result<(), Failure> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| Failure::runtime(format!("cannot write JSON: {e}")))?;
    println!("{text}");
    Ok(())
}
