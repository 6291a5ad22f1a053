//! `topoctl simulate --jobs-out FILE`: each replayed job's fate, one line per job, in the
//! Standard Workload Format (`.swf`, for the tools that read traces) or as CSV (`.csv`, with
//! what SWF has no field for: where the job ran, its NUMA and L3 spans, its suspensions, moves
//! and resizes).
//!
//! Both give the wait, the response and the bounded slowdown exactly as the summary averages
//! them (`topo_core::sim::JobOutcome`), so a reader's means over the file are the summary's.
//! In SWF, field 3 is that wait and field 4 the rest of the job's time in the system (submit +
//! wait + run is its end); field 5 is the processors it started on; every other field is its
//! trace line's. For FCFS and EASY field 4 is the logged run time; with preemption it includes
//! no suspended time (that is wait), with gang slicing it includes the slices the job sat out,
//! and a malleable job's is as long as its sizes made it.

use crate::Failure;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use topo_core::policy::HostId;
use topo_core::sim::{JobOutcome, SimJob, SimReport};
use topo_core::swf::{self, Trace};
use topo_core::CpuSet;

/// The format of a `--jobs-out` file, from its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// Standard Workload Format.
    Swf,
    /// Comma-separated values with a header row.
    Csv,
}

/// One `--jobs-out` file as given.
#[derive(Debug, Clone)]
pub(crate) struct JobsOut {
    path: PathBuf,
    format: Format,
}

impl JobsOut {
    /// `path`'s format from its extension (`.swf` or `.csv`).
    pub(crate) fn parse(path: &Path) -> Result<Self, Failure> {
        let format = match path.extension().and_then(|e| e.to_str()) {
            Some(e) if e.eq_ignore_ascii_case("swf") => Format::Swf,
            Some(e) if e.eq_ignore_ascii_case("csv") => Format::Csv,
            _ => {
                return Err(Failure::input(format!(
                    "--jobs-out {}: the name says the format: end it in .swf (Standard Workload Format) or .csv",
                    path.display()
                )))
            }
        };
        Ok(JobsOut { path: path.to_path_buf(), format })
    }

    /// Whether it needs the CPUs each job started on (the CSV's `cpus`), which the replay
    /// gives only to an observer of its actions.
    pub(crate) fn wants_cpus(&self) -> bool {
        self.format == Format::Csv
    }

    /// Where the results of one replay go: the path as given when there is one replay, else
    /// with the policy and the placement before the extension (`jobs.easy.best-fit.swf`).
    pub(crate) fn path_for(&self, policy: &str, placement: &str, several: bool) -> PathBuf {
        if !several {
            return self.path.clone();
        }
        let stem = self.path.file_stem().map(|s| s.to_string_lossy()).unwrap_or_default();
        let ext = self.path.extension().map(|s| s.to_string_lossy()).unwrap_or_default();
        self.path.with_file_name(format!("{stem}.{policy}.{placement}.{ext}"))
    }
}

/// What the files say besides the jobs.
pub(crate) struct Context<'a> {
    /// The trace as read, and its header comment lines.
    pub trace: &'a Trace,
    pub header: &'a str,
    /// The replayed jobs, and each one's index in `trace.jobs`.
    pub jobs: &'a [SimJob],
    pub lines: &'a [usize],
    /// For the SWF header's notes.
    pub trace_name: &'a str,
    pub topology_name: &'a str,
    /// Where each job started (host, CPUs), by job, when a CSV is written.
    pub started_on: &'a [Vec<(HostId, CpuSet)>],
    /// Whether jobs were killed at their requested time (`--kill-at-limit`).
    pub kill_at_limit: bool,
}

impl Context<'_> {
    /// Whether the replay killed the job of this trace line at its requested time.
    fn killed(&self, logged: &swf::SwfJob) -> bool {
        self.kill_at_limit && logged.outlived_request()
    }
}

/// Writes `report`'s jobs to `path` in `out`'s format.
pub(crate) fn write(
    out: &JobsOut,
    path: &Path,
    context: &Context<'_>,
    report: &SimReport,
) -> Result<(), Failure> {
    let text = match out.format {
        Format::Swf => swf_text(context, report),
        Format::Csv => csv_text(context, report),
    };
    std::fs::File::create(path)
        .and_then(|mut f| {
            f.write_all(text.as_bytes())?;
            f.sync_all()
        })
        .map_err(|e| Failure::runtime(format!("--jobs-out {}: {e}", path.display())))
}

fn swf_text(context: &Context<'_>, report: &SimReport) -> String {
    let n = report.outcomes.len();
    let mut text = String::with_capacity(80 * (n + 12));
    let _ = writeln!(text, "; Version: 2.2");
    let _ = writeln!(text, "; Computer: topo's simulator (topoctl simulate)");
    let _ = writeln!(
        text,
        "; Note: per-job results of {} replayed under {} with {} placement on {} hosts of {} ({} processors)",
        context.trace_name,
        report.policy,
        report.placement,
        report.hosts,
        context.topology_name,
        report.processors
    );
    let _ = writeln!(
        text,
        "; Note: field 3 is the simulated wait (with time suspended by preemption), field 4 the rest of the job's time in the system, field 5 the processors it started on; the other fields are the trace's"
    );
    if context.kill_at_limit {
        let _ = writeln!(
            text,
            "; Note: jobs were killed at their requested time (field 9); those that ran longer in the log have status 0 (failed)"
        );
    }
    let _ = writeln!(text, "; MaxJobs: {n}");
    let _ = writeln!(text, "; MaxRecords: {n}");
    let _ = writeln!(text, "; MaxNodes: {}", report.hosts);
    let _ = writeln!(text, "; MaxProcs: {}", report.processors);
    for line in swf::header_lines_carried(context.header) {
        let _ = writeln!(text, "{line}");
    }
    for ((job, &line), outcome) in context.jobs.iter().zip(context.lines).zip(&report.outcomes) {
        let Some(logged) = context.trace.jobs.get(line) else { continue };
        let mut simulated = logged.clone();
        simulated.submit = job.submit;
        simulated.wait = outcome.wait;
        simulated.run = outcome.end - job.submit - outcome.wait;
        simulated.allocated_procs = i64::from(outcome.procs_at_start);
        if context.killed(logged) {
            // Stopped at its limit: it did not complete.
            simulated.status = swf::Status::Failed;
        }
        let _ = writeln!(text, "{simulated}");
    }
    text
}

/// The CSV's columns, in order.
pub(crate) const CSV_COLUMNS: [&str; 27] = [
    "job",
    "submit_s",
    "start_s",
    "end_s",
    "wait_s",
    "run_s",
    "response_s",
    "bounded_slowdown",
    "procs",
    "procs_at_start",
    "estimate_s",
    "logged_run_s",
    "killed_at_limit",
    "queue",
    "partition",
    "user",
    "suspensions",
    "suspended_s",
    "gang_freezes",
    "moves",
    "resizes",
    "hosts",
    "numa_nodes",
    "numa_optimal",
    "l3_groups",
    "l3_optimal",
    "cpus",
];

fn csv_text(context: &Context<'_>, report: &SimReport) -> String {
    let mut text = String::with_capacity(120 * (report.outcomes.len() + 1));
    text.push_str(&CSV_COLUMNS.join(","));
    text.push('\n');
    let rows = context.jobs.iter().zip(context.lines).zip(&report.outcomes);
    for (i, ((job, &line), outcome)) in rows.enumerate() {
        let Some(logged) = context.trace.jobs.get(line) else { continue };
        let &JobOutcome { start, end, wait, .. } = outcome;
        let started_on = context.started_on.get(i).map_or(&[][..], Vec::as_slice);
        let _ = writeln!(
            text,
            "{},{},{start},{end},{wait},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            job.id,
            job.submit,
            end - job.submit - wait,
            end - job.submit,
            outcome.bounded_slowdown,
            job.procs,
            outcome.procs_at_start,
            job.estimate,
            logged.run,
            context.killed(logged),
            logged.queue,
            logged.partition,
            logged.user,
            outcome.suspensions,
            outcome.suspended,
            outcome.gang_freezes,
            outcome.moves,
            outcome.resizes,
            outcome.hosts,
            outcome.numa_nodes,
            outcome.numa_optimal,
            outcome.l3_groups,
            outcome.l3_optimal,
            quoted(&cpus_cell(started_on)),
        );
    }
    text
}

/// Where the job started: `host:cpus` per host (hosts numbered from 0, CPUs as the host's
/// operating system numbers them), space-separated.
fn cpus_cell(started_on: &[(HostId, CpuSet)]) -> String {
    let parts: Vec<String> =
        started_on.iter().map(|(host, cpus)| format!("{host}:{cpus}")).collect();
    parts.join(" ")
}

/// A CSV cell (RFC 4180): quoted when it holds a comma, a quote or a line end.
fn quoted(cell: &str) -> String {
    if cell.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", cell.replace('"', "\"\""))
    } else {
        cell.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_name_says_the_format_and_several_replays_get_a_file_each() {
        let out = JobsOut::parse(Path::new("/tmp/r/jobs.swf")).unwrap();
        assert_eq!(out.format, Format::Swf);
        assert_eq!(out.path_for("easy", "best-fit", false), Path::new("/tmp/r/jobs.swf"));
        assert_eq!(
            out.path_for("easy+preempt", "pack", true),
            Path::new("/tmp/r/jobs.easy+preempt.pack.swf")
        );
        assert_eq!(JobsOut::parse(Path::new("a.CSV")).unwrap().format, Format::Csv);
        for bad in ["jobs", "jobs.txt", "jobs.swf.gz"] {
            let e = JobsOut::parse(Path::new(bad)).unwrap_err().to_string();
            assert!(e.contains(".swf") && e.contains(".csv") && e.contains(bad), "{e}");
        }
    }

    #[test]
    fn cells_with_commas_or_quotes_are_quoted() {
        assert_eq!(quoted("0:0-3"), "0:0-3");
        assert_eq!(quoted("0:0-3,8 1:2"), "\"0:0-3,8 1:2\"");
        assert_eq!(quoted("a\"b"), "\"a\"\"b\"");
    }
}
