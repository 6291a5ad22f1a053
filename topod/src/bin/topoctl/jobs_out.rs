//! `topoctl simulate --jobs-out FILE`: each replayed job's fate, one line per job, in the
//! Standard Workload Format (`.swf`, for the tools that read traces) or as CSV (`.csv`, with
//! what SWF has no field for: where the job ran, its NUMA and L3 spans, its suspensions, moves
//! and resizes).
//!
//! The CSV gives each job's wait, response and bounded slowdown exactly as the summary averages
//! them (`topo_core::sim::JobOutcome`), with its logged run for the utilization, so a reader's
//! means over it are the summary's under every policy. In SWF, field 3 is that wait and field 4
//! the rest of the job's time in the system (submit + wait + run is its end); field 5 is the
//! processors it started on; every other field is its trace line's. Field 4 is the logged run
//! only where the job ran its logged time on its processors (FCFS, EASY and conservative
//! backfilling; preemption and moves without a cost): with gang slicing it includes the slices
//! the job sat out, a malleable job's is as long as its sizes made it, and a suspension or move
//! cost lengthens it; a slowdown or utilization computed from fields 4 and 5 then differs from
//! the summary's.
//!
//! A file is written beside its name and renamed into place when complete, from rows made one
//! at a time (a job's CPUs are kept as its CSV cell from its start, not as sets).

use crate::Failure;
use std::ffi::OsString;
use std::io::{self, Write};
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
        // (As OS strings: a name that is not UTF-8 keeps its bytes.)
        let mut name = self.path.file_stem().map(OsString::from).unwrap_or_default();
        name.push(format!(".{policy}.{placement}."));
        name.push(self.path.extension().unwrap_or_default());
        self.path.with_file_name(name)
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
    /// Where each job started ([`cpus_cell`]), by job, when a CSV is written.
    pub started_on: &'a [String],
    /// Whether jobs were killed at their requested time (`--kill-at-limit`).
    pub kill_at_limit: bool,
}

impl Context<'_> {
    /// Whether the replay killed the job of this trace line at its requested time.
    fn killed(&self, logged: &swf::SwfJob) -> bool {
        self.kill_at_limit && logged.outlived_request()
    }
}

/// Writes `report`'s jobs to `path` in `out`'s format: into a new file beside it, renamed
/// over it once complete, so a replay or a write that fails leaves what was there.
pub(crate) fn write(
    out: &JobsOut,
    path: &Path,
    context: &Context<'_>,
    report: &SimReport,
) -> Result<(), Failure> {
    let failed = |e: io::Error| Failure::runtime(format!("--jobs-out {}: {e}", path.display()));
    // Through a symbolic link, the file it names is replaced.
    let target = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    if std::fs::metadata(&target).is_ok_and(|m| !m.is_file()) {
        // A device or a pipe (a link to /dev/null, say): written into, never replaced.
        let file = std::fs::OpenOptions::new().write(true).open(&target).map_err(failed)?;
        let mut writer = io::BufWriter::new(file);
        return write_rows(&mut writer, out.format, context, report)
            .and_then(|()| writer.flush())
            .map_err(failed);
    }
    let mut temporary = target.clone().into_os_string();
    temporary.push(format!(".{}.partial", std::process::id()));
    let temporary = PathBuf::from(temporary);
    let result = std::fs::File::create(&temporary).and_then(|file| {
        let mut writer = io::BufWriter::new(file);
        write_rows(&mut writer, out.format, context, report)?;
        let file = writer.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        std::fs::rename(&temporary, &target)
    });
    result.map_err(|e| {
        let _ = std::fs::remove_file(&temporary);
        failed(e)
    })
}

fn write_rows(
    out: &mut impl Write,
    format: Format,
    context: &Context<'_>,
    report: &SimReport,
) -> io::Result<()> {
    match format {
        Format::Swf => write_swf(out, context, report),
        Format::Csv => write_csv(out, context, report),
    }
}

/// A name for a header comment, on one line: a control character (a line end) is shown
/// escaped, so a file's name cannot add header or job lines.
fn one_line(name: &str) -> String {
    if name.chars().any(char::is_control) {
        name.escape_debug().to_string()
    } else {
        name.to_string()
    }
}

fn write_swf(out: &mut impl Write, context: &Context<'_>, report: &SimReport) -> io::Result<()> {
    let n = report.outcomes.len();
    writeln!(out, "; Version: 2.2")?;
    writeln!(out, "; Computer: topo's simulator (topoctl simulate)")?;
    writeln!(
        out,
        "; Note: per-job results of {} replayed under {} with {} placement on {} hosts of {} ({} processors)",
        one_line(context.trace_name),
        report.policy,
        report.placement,
        report.hosts,
        one_line(context.topology_name),
        report.processors
    )?;
    writeln!(
        out,
        "; Note: field 3 is the simulated wait (with time suspended by preemption), field 4 the rest of the job's time in the system, field 5 the processors it started on; the other fields are the trace's"
    )?;
    if context.kill_at_limit {
        writeln!(
            out,
            "; Note: jobs were killed at their requested time (field 9); those that ran longer in the log have status 0 (failed)"
        )?;
    }
    writeln!(out, "; MaxJobs: {n}")?;
    writeln!(out, "; MaxRecords: {n}")?;
    writeln!(out, "; MaxNodes: {}", report.hosts)?;
    writeln!(out, "; MaxProcs: {}", report.processors)?;
    for line in swf::header_lines_carried(context.header) {
        writeln!(out, "{line}")?;
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
        writeln!(out, "{simulated}")?;
    }
    Ok(())
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

fn write_csv(out: &mut impl Write, context: &Context<'_>, report: &SimReport) -> io::Result<()> {
    writeln!(out, "{}", CSV_COLUMNS.join(","))?;
    let rows = context.jobs.iter().zip(context.lines).zip(&report.outcomes);
    for (i, ((job, &line), outcome)) in rows.enumerate() {
        let Some(logged) = context.trace.jobs.get(line) else { continue };
        let &JobOutcome { start, end, wait, .. } = outcome;
        let started_on = context.started_on.get(i).map_or("", String::as_str);
        writeln!(
            out,
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
            quoted(started_on),
        )?;
    }
    Ok(())
}

/// Where a job started, for the CSV's `cpus`: `hosts:cpus` entries, space-separated, the hosts
/// (numbered from 0) with the same CPUs (as the host's operating system numbers them) in one
/// entry, both as lists: `0-63:0` is CPU 0 of hosts 0 to 63, `3,7:0-3 5:0` CPUs 0-3 of hosts 3
/// and 7 and CPU 0 of host 5. Made as the job starts, so a replay keeps a line per job, not
/// its CPU sets.
pub(crate) fn cpus_cell(parts: &[(HostId, &CpuSet)]) -> String {
    // In the order of each set's first host.
    let mut order: Vec<&CpuSet> = Vec::new();
    let mut hosts_of: std::collections::HashMap<&CpuSet, CpuSet> = Default::default();
    for &(host, cpus) in parts {
        hosts_of
            .entry(cpus)
            .or_insert_with(|| {
                order.push(cpus);
                CpuSet::new()
            })
            .insert(host);
    }
    let entries: Vec<String> =
        order.iter().map(|cpus| format!("{}:{cpus}", hosts_of[cpus])).collect();
    entries.join(" ")
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
        // A name that is not UTF-8 keeps its bytes.
        use std::os::unix::ffi::OsStrExt;
        let odd = JobsOut::parse(Path::new(std::ffi::OsStr::from_bytes(b"bad\xff.csv"))).unwrap();
        let named = odd.path_for("easy", "best-fit", true);
        assert_eq!(named.as_os_str().as_bytes(), b"bad\xff.easy.best-fit.csv");
        assert_eq!(JobsOut::parse(Path::new("a.CSV")).unwrap().format, Format::Csv);
        for bad in ["jobs", "jobs.txt", "jobs.swf.gz"] {
            let e = JobsOut::parse(Path::new(bad)).unwrap_err().to_string();
            assert!(e.contains(".swf") && e.contains(".csv") && e.contains(bad), "{e}");
        }
    }

    #[test]
    fn hosts_with_the_same_cpus_share_an_entry() {
        let (zero, low) = (CpuSet::from_iter([0]), CpuSet::from_iter(0..4));
        let wide: Vec<(HostId, &CpuSet)> = (0..64).map(|h| (h, &zero)).collect();
        assert_eq!(cpus_cell(&wide), "0-63:0");
        assert_eq!(cpus_cell(&[(3, &low), (5, &zero), (7, &low)]), "3,7:0-3 5:0");
        assert_eq!(cpus_cell(&[]), "");
    }

    #[test]
    fn a_file_name_cannot_add_header_or_job_lines() {
        assert_eq!(one_line("plain name.swf"), "plain name.swf");
        assert_eq!(one_line("evil\n; MaxProcs: 1\n1 2.swf"), "evil\\n; MaxProcs: 1\\n1 2.swf");
    }

    #[test]
    fn cells_with_commas_or_quotes_are_quoted() {
        assert_eq!(quoted("0:0-3"), "0:0-3");
        assert_eq!(quoted("0:0-3,8 1:2"), "\"0:0-3,8 1:2\"");
        assert_eq!(quoted("a\"b"), "\"a\"\"b\"");
    }
}
