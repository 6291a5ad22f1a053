//! The Standard Workload Format (SWF) of the Parallel Workloads Archive, version 2.2.
//!
//! One job per line, 18 whitespace-separated fields; `-1` means unknown; header comments start
//! with `;` (`; MaxProcs: 400`). The field meanings follow the archive's definition
//! (<https://www.cs.huji.ac.il/labs/parallel/workload/swf.html>):
//!
//! | # | field | used by the simulator as |
//! |---|---|---|
//! | 1 | job number | the job's id |
//! | 2 | submit time (s) | arrival |
//! | 3 | wait time (s) | the logged wait, for comparison only |
//! | 4 | run time (s) | how long the job holds its processors |
//! | 5 | allocated processors | size, when field 8 is unknown |
//! | 6 | average CPU time | kept |
//! | 7 | used memory (KB) | kept |
//! | 8 | requested processors | size |
//! | 9 | requested time (s) | runtime estimate (see [`SwfJob::estimate`]) |
//! | 10 | requested memory (KB) | kept |
//! | 11 | status | 1 completed, 0 failed, 5 cancelled; 2/3/4 partial executions |
//! | 12–14 | user, group, executable | kept |
//! | 15 | queue | filter (`--queues`) |
//! | 16 | partition | kept |
//! | 17–18 | preceding job, think time | kept (dependencies are not replayed) |
//!
//! Time fields may carry fractions (the definition allows it); they are rounded to whole
//! seconds. Which jobs a replay keeps is [`SwfJob::replayable`]'s decision.
//!
//! [`read`] takes the trace as a stream, a line at a time: lines end in LF, CRLF or CR alone
//! (old Mac files), a UTF-8 byte order mark before the first line is skipped, and a line that
//! is not text or longer than [`MAX_LINE_BYTES`] is refused where it is, whatever comes after
//! (so `/dev/zero` or a binary file is refused within its first bytes, not after reading it
//! all).

use std::fmt;

/// Unknown, as the format writes it.
pub const UNKNOWN: i64 = -1;

/// A job's completion status (field 11).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// 1: ran to completion.
    Completed,
    /// 0: failed; it still held its processors for its run time.
    Failed,
    /// 5: cancelled, before it started (run time and processors unknown or zero) or while
    /// running (then both are known and count).
    Cancelled,
    /// 2: one partial execution of a checkpointed job, to be continued.
    Partial,
    /// 3: the last partial execution, completed.
    PartialLastCompleted,
    /// 4: the last partial execution, failed.
    PartialLastFailed,
    /// -1.
    Unknown,
}

impl Status {
    fn from_code(code: i64) -> Option<Status> {
        Some(match code {
            1 => Status::Completed,
            0 => Status::Failed,
            5 => Status::Cancelled,
            2 => Status::Partial,
            3 => Status::PartialLastCompleted,
            4 => Status::PartialLastFailed,
            -1 => Status::Unknown,
            _ => return None,
        })
    }

    /// The number the format writes for it (field 11).
    pub fn code(self) -> i64 {
        match self {
            Status::Completed => 1,
            Status::Failed => 0,
            Status::Cancelled => 5,
            Status::Partial => 2,
            Status::PartialLastCompleted => 3,
            Status::PartialLastFailed => 4,
            Status::Unknown => -1,
        }
    }

    /// Whether this line is one partial execution (status 2, 3 or 4) of a checkpointed job:
    /// the archive writes a summary line for such a job as well, so partial lines are not jobs
    /// of their own.
    pub fn is_partial(self) -> bool {
        matches!(self, Status::Partial | Status::PartialLastCompleted | Status::PartialLastFailed)
    }
}

/// One job line: all 18 fields, `-1` where unknown.
#[derive(Debug, Clone, PartialEq)]
pub struct SwfJob {
    /// 1: job number.
    pub id: i64,
    /// 2: submit time, seconds.
    pub submit: i64,
    /// 3: logged wait, seconds.
    pub wait: i64,
    /// 4: run time, seconds.
    pub run: i64,
    /// 5: allocated processors.
    pub allocated_procs: i64,
    /// 6: average CPU time used per processor, seconds.
    pub avg_cpu: f64,
    /// 7: used memory per processor, KB.
    pub used_mem_kb: i64,
    /// 8: requested processors.
    pub requested_procs: i64,
    /// 9: requested (estimated) time, seconds.
    pub requested_time: i64,
    /// 10: requested memory per processor, KB.
    pub requested_mem_kb: i64,
    /// 11: status.
    pub status: Status,
    /// 12: user.
    pub user: i64,
    /// 13: group.
    pub group: i64,
    /// 14: executable (application).
    pub executable: i64,
    /// 15: queue.
    pub queue: i64,
    /// 16: partition.
    pub partition: i64,
    /// 17: preceding job.
    pub preceding: i64,
    /// 18: think time after the preceding job, seconds.
    pub think: i64,
}

/// Why a job line is not replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Skip {
    /// Neither requested (8) nor allocated (5) processors are known and positive: a job
    /// cancelled before it started.
    NoProcessors,
    /// The run time (4) is unknown.
    NoRunTime,
    /// A partial execution line (status 2, 3, 4); its job's summary line is replayed.
    PartialExecution,
    /// Larger than the whole simulated cluster.
    LargerThanCluster,
    /// In a queue the replay leaves out (`--queues`, `--skip-queues`).
    Queue,
    /// A job number an earlier replayed line had (the later line is left out).
    Duplicate,
    /// In no partition of a cluster replayed in partitions (its queue and partition are
    /// named by none, and none takes the rest).
    NoPartition,
    /// Larger than the partition it belongs to.
    LargerThanPartition,
}

impl fmt::Display for Skip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Skip::NoProcessors => "no processor count (cancelled before it started)",
            Skip::NoRunTime => "no run time",
            Skip::PartialExecution => "partial-execution line (its summary line is replayed)",
            Skip::LargerThanCluster => "larger than the simulated cluster",
            Skip::Queue => "in a queue --queues/--skip-queues leaves out",
            Skip::Duplicate => "with a job number an earlier line had",
            Skip::NoPartition => "in no partition of the cluster",
            Skip::LargerThanPartition => "larger than their partition",
        })
    }
}

impl SwfJob {
    /// The processors the job asks for: field 8 when known, else field 5.
    pub fn procs(&self) -> Option<u32> {
        [self.requested_procs, self.allocated_procs]
            .into_iter()
            .find(|p| *p > 0)
            .and_then(|p| u32::try_from(p).ok())
    }

    /// The runtime estimate a scheduler sees: the requested time (field 9) when known, raised
    /// to the run time when the job ran longer (the log shows it was not killed at its limit,
    /// so a replay lets it run too); the run time itself when no estimate is known (a perfect
    /// estimate, which is what a trace without field 9 allows).
    pub fn estimate(&self) -> i64 {
        if self.requested_time > 0 {
            self.requested_time.max(self.run)
        } else {
            self.run
        }
    }

    /// Whether the job ran longer than it requested (field 4 over a known field 9): a batch
    /// system that kills jobs at their limit would have stopped it there.
    pub fn outlived_request(&self) -> bool {
        self.requested_time > 0 && self.run > self.requested_time
    }

    /// Whether a replay keeps this job, and why not. Failed and cancelled jobs that ran count
    /// as they ran: they held their processors for their run time.
    pub fn replayable(&self) -> Result<u32, Skip> {
        if self.status.is_partial() {
            return Err(Skip::PartialExecution);
        }
        if self.run < 0 {
            return Err(Skip::NoRunTime);
        }
        self.procs().ok_or(Skip::NoProcessors)
    }
}

/// The job as one SWF line (18 fields, one space apart, no line end), as [`read`] reads it
/// back: what the simulator writes for per-job results.
impl fmt::Display for SwfJob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} {} {} {} {} {} {} {} {} {} {} {} {} {} {} {} {}",
            self.id,
            self.submit,
            self.wait,
            self.run,
            self.allocated_procs,
            self.avg_cpu,
            self.used_mem_kb,
            self.requested_procs,
            self.requested_time,
            self.requested_mem_kb,
            self.status.code(),
            self.user,
            self.group,
            self.executable,
            self.queue,
            self.partition,
            self.preceding,
            self.think,
        )
    }
}

/// Header keys a log made from this one (per-job results of a replay) carries over
/// ([`header_lines_carried`]): the clock (so local times, as prime-time windows use them, stay
/// the same) and the names of the queues and partitions. It writes its own `Version`,
/// `Computer`, `MaxJobs`, `MaxProcs` and notes.
pub const CARRIED_HEADER_KEYS: [&str; 9] = [
    "UnixStartTime",
    "TimeZone",
    "TimeZoneString",
    "StartTime",
    "EndTime",
    "Queues",
    "Queue",
    "Partitions",
    "Partition",
];

/// The lines of `header` (as [`read`] returns it) whose key is one of [`CARRIED_HEADER_KEYS`].
pub fn header_lines_carried(header: &str) -> impl Iterator<Item = &str> {
    header.lines().filter(|line| {
        let key = line.trim_start_matches(';').split(':').next().unwrap_or("").trim();
        CARRIED_HEADER_KEYS.contains(&key)
    })
}

/// The header comments a replay uses.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Header {
    /// `; MaxProcs:`.
    pub max_procs: Option<u32>,
    /// `; MaxNodes:`.
    pub max_nodes: Option<u32>,
    /// `; MaxJobs:`.
    pub max_jobs: Option<u64>,
    /// `; UnixStartTime:`: the wall-clock time of submit time 0.
    pub unix_start_time: Option<i64>,
    /// `; Computer:`.
    pub computer: Option<String>,
    /// `; Queue: N name`, in file order.
    pub queues: Vec<(i64, String)>,
}

/// A parsed trace.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trace {
    /// The header comments.
    pub header: Header,
    /// The job lines, in file order.
    pub jobs: Vec<SwfJob>,
}

/// A line that is not SWF.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SwfError {
    /// Not 18 fields.
    #[error("line {line}: {found} fields, a job line has 18 (job number, submit time, ... think time): {text:?}")]
    FieldCount {
        /// 1-based line number.
        line: usize,
        /// Fields found.
        found: usize,
        /// The line (cut to 120 characters).
        text: String,
    },
    /// A field that is not a number.
    #[error("line {line}, field {field} ({name}): {value:?} is not a number")]
    NotANumber {
        /// 1-based line number.
        line: usize,
        /// 1-based field number.
        field: usize,
        /// The field's name.
        name: &'static str,
        /// What was there (cut to 40 characters).
        value: String,
    },
    /// A value no job can have: negative other than -1 (unknown), a fraction where the format
    /// counts, or beyond what any machine or log could hold.
    #[error("line {line}, field {field} ({name}): {value:?} {why}")]
    BadValue {
        /// 1-based line number.
        line: usize,
        /// 1-based field number.
        field: usize,
        /// The field's name.
        name: &'static str,
        /// What was there (cut to 40 characters).
        value: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A header comment the replay uses, with a value that is not one.
    #[error("line {line}: the header says {key}: {value:?}, which is not a count from 1 to {max}")]
    BadHeader {
        /// 1-based line number.
        line: usize,
        /// `MaxProcs` or `MaxNodes`.
        key: &'static str,
        /// What it says (cut to 40 characters).
        value: String,
        /// The largest accepted.
        max: u32,
    },
    /// A status code the format does not define.
    #[error("line {line}, field 11 (status): {code} is not a status the format defines (0, 1, 2, 3, 4, 5 or -1)")]
    BadStatus {
        /// 1-based line number.
        line: usize,
        /// The code.
        code: i64,
    },
    /// A line longer than any SWF line (18 numbers).
    #[error("line {line} is longer than {max} bytes: a Standard Workload Format line holds 18 numbers (is this a trace?)")]
    LineTooLong {
        /// 1-based line number.
        line: usize,
        /// [`MAX_LINE_BYTES`].
        max: usize,
    },
    /// A line that is not UTF-8 text.
    #[error("line {line}: byte {byte} of the line is not text (UTF-8); a Standard Workload Format file is plain text (a compressed trace must be gzip)")]
    NotText {
        /// 1-based line number.
        line: usize,
        /// 1-based byte in the line.
        byte: usize,
    },
    /// Reading failed.
    #[error("line {line}: cannot read on: {message}")]
    Read {
        /// 1-based line number being read.
        line: usize,
        /// What the system said.
        message: String,
    },
}

/// The longest line [`read`] accepts, in bytes. An SWF job line is 18 numbers (under 200
/// bytes in the archive's traces); header comments are short.
pub const MAX_LINE_BYTES: usize = 64 * 1024;

const FIELD_NAMES: [&str; 18] = [
    "job number",
    "submit time",
    "wait time",
    "run time",
    "allocated processors",
    "average CPU time",
    "used memory",
    "requested processors",
    "requested time",
    "requested memory",
    "status",
    "user",
    "group",
    "executable",
    "queue",
    "partition",
    "preceding job",
    "think time",
];

fn cut(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}

/// The largest time a field may hold, in seconds (about 34,800 years): larger is a broken log.
pub const MAX_SECONDS: f64 = (1u64 << 40) as f64;

/// The largest processor count (and `MaxProcs`/`MaxNodes`) accepted.
pub const MAX_PROCESSORS: u32 = 1 << 24;

/// Fields that hold times in seconds (1-based): submit, wait, run, requested time, think time.
const TIME_FIELDS: [usize; 5] = [2, 3, 4, 9, 18];

/// Fields that count or name something and must be whole numbers (1-based).
const WHOLE_FIELDS: [usize; 11] = [1, 5, 8, 11, 12, 13, 14, 15, 16, 17, 7];

/// Parses a whole trace held in memory (see [`read`]).
pub fn parse(text: &str) -> Result<Trace, SwfError> {
    read(text.as_bytes()).map(|(trace, _)| trace)
}

/// Reads a trace from a stream, a line at a time (see the module documentation); returns it
/// with its header comment lines (each with its `;`, one per line), for what the caller reads
/// from them itself. Blank lines are ignored.
pub fn read(mut input: impl std::io::BufRead) -> Result<(Trace, String), SwfError> {
    let mut trace = Trace::default();
    let mut header = String::new();
    let mut bytes = Vec::new();
    let mut line_no = 0;
    while next_line(&mut input, &mut bytes, line_no + 1)? {
        line_no += 1;
        let mut raw: &[u8] = &bytes;
        if line_no == 1 {
            raw = raw.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(raw);
        }
        let text = std::str::from_utf8(raw)
            .map_err(|e| SwfError::NotText { line: line_no, byte: e.valid_up_to() + 1 })?;
        let line = text.trim();
        if line.is_empty() {
            continue;
        }
        if let Some(comment) = line.strip_prefix(';') {
            read_header(&mut trace.header, comment, line_no)?;
            header.push_str(line);
            header.push('\n');
            continue;
        }
        trace.jobs.push(parse_job(line_no, line)?);
    }
    Ok((trace, header))
}

/// Reads the next line of `input` into `line` (without its end: LF, CRLF or CR); `false` at
/// the end of the input.
fn next_line(
    input: &mut impl std::io::BufRead,
    line: &mut Vec<u8>,
    line_no: usize,
) -> Result<bool, SwfError> {
    line.clear();
    let mut any = false;
    loop {
        let buf = match input.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(SwfError::Read { line: line_no, message: e.to_string() }),
        };
        if buf.is_empty() {
            return Ok(any);
        }
        any = true;
        match buf.iter().position(|&b| b == b'\n' || b == b'\r') {
            Some(end) => {
                let cr = buf[end] == b'\r';
                line.extend_from_slice(&buf[..end]);
                input.consume(end + 1);
                if line.len() > MAX_LINE_BYTES {
                    return Err(SwfError::LineTooLong { line: line_no, max: MAX_LINE_BYTES });
                }
                if cr {
                    // CRLF: the LF is part of this line's end.
                    let next = loop {
                        match input.fill_buf() {
                            Ok(b) => break b.first().copied(),
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                            Err(e) => {
                                let message = e.to_string();
                                return Err(SwfError::Read { line: line_no, message });
                            }
                        }
                    };
                    if next == Some(b'\n') {
                        input.consume(1);
                    }
                }
                return Ok(true);
            }
            None => {
                let n = buf.len();
                line.extend_from_slice(buf);
                input.consume(n);
                if line.len() > MAX_LINE_BYTES {
                    return Err(SwfError::LineTooLong { line: line_no, max: MAX_LINE_BYTES });
                }
            }
        }
    }
}

fn read_header(header: &mut Header, comment: &str, line: usize) -> Result<(), SwfError> {
    let Some((key, value)) = comment.split_once(':') else { return Ok(()) };
    let value = value.trim();
    let leading_int = || {
        let digits: String =
            value.chars().take_while(|c| c.is_ascii_digit() || *c == '-').collect();
        digits.parse::<i64>().ok()
    };
    let count = |key: &'static str| match leading_int() {
        Some(v) if (1..=i64::from(MAX_PROCESSORS)).contains(&v) => Ok(Some(v as u32)),
        _ => Err(SwfError::BadHeader { line, key, value: cut(value, 40), max: MAX_PROCESSORS }),
    };
    match key.trim() {
        "MaxProcs" => header.max_procs = count("MaxProcs")?,
        "MaxNodes" => header.max_nodes = count("MaxNodes")?,
        "MaxJobs" => header.max_jobs = leading_int().and_then(|v| u64::try_from(v).ok()),
        "UnixStartTime" => header.unix_start_time = leading_int(),
        "Computer" => header.computer = Some(value.to_string()),
        "Queue" => {
            let mut parts = value.split_whitespace();
            if let (Some(n), Some(name)) = (parts.next().and_then(|n| n.parse().ok()), parts.next())
            {
                header.queues.push((n, name.to_string()));
            }
        }
        _ => {}
    }
    Ok(())
}

fn parse_job(line_no: usize, line: &str) -> Result<SwfJob, SwfError> {
    // The count first: a short line is a short line, whatever its fields hold.
    let mut tokens = [""; 18];
    let mut n = 0;
    for token in line.split_whitespace() {
        if n < 18 {
            tokens[n] = token;
        }
        n += 1;
    }
    if n != 18 {
        return Err(SwfError::FieldCount { line: line_no, found: n, text: cut(line, 120) });
    }
    let mut values = [0f64; 18];
    for (k, token) in tokens.iter().enumerate() {
        let field = k + 1;
        let bad = |why| SwfError::BadValue {
            line: line_no,
            field,
            name: FIELD_NAMES[k],
            value: cut(token, 40),
            why,
        };
        let v = token.parse::<f64>().ok().filter(|v| v.is_finite()).ok_or_else(|| {
            SwfError::NotANumber {
                line: line_no,
                field,
                name: FIELD_NAMES[k],
                value: cut(token, 40),
            }
        })?;
        if v < 0.0 && v != -1.0 {
            return Err(bad("is negative; the format writes an unknown value as -1"));
        }
        if WHOLE_FIELDS.contains(&field) && v.fract() != 0.0 {
            return Err(bad("is not a whole number"));
        }
        if TIME_FIELDS.contains(&field) && v > MAX_SECONDS {
            return Err(bad("is more seconds than any log spans (at most 2^40)"));
        }
        if (field == 5 || field == 8) && v > f64::from(MAX_PROCESSORS) {
            return Err(bad("is more processors than topoctl simulates (at most 2^24)"));
        }
        if v.abs() > 9.0e15 {
            return Err(bad("is too large"));
        }
        values[k] = v;
    }
    // Whole seconds; -1 stays -1.
    let int = |k: usize| -> i64 {
        let v = values[k];
        if v < 0.0 {
            UNKNOWN
        } else {
            v.round() as i64
        }
    };
    let code = values[10] as i64;
    let status = Status::from_code(code).ok_or(SwfError::BadStatus { line: line_no, code })?;
    Ok(SwfJob {
        id: int(0),
        submit: int(1),
        wait: int(2),
        run: int(3),
        allocated_procs: int(4),
        avg_cpu: values[5],
        used_mem_kb: int(6),
        requested_procs: int(7),
        requested_time: int(8),
        requested_mem_kb: int(9),
        status,
        user: int(11),
        group: int(12),
        executable: int(13),
        queue: int(14),
        partition: int(15),
        preceding: int(16),
        think: int(17),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_reads_as_the_text_does_with_any_line_end_and_a_byte_order_mark() {
        let lf = parse(SDSC_LIKE).unwrap();
        // CR alone (old Mac files), CRLF everywhere, a BOM first.
        let cr = SDSC_LIKE.replace("\r\n", "\n").replace('\n', "\r");
        let crlf = SDSC_LIKE.replace("\r\n", "\n").replace('\n', "\r\n");
        let bom = format!("\u{feff}{SDSC_LIKE}");
        for text in [&cr, &crlf, &bom] {
            assert_eq!(parse(text).unwrap(), lf, "{text:?}");
        }
        // One byte at a time through a reader that splits a CRLF between two reads.
        let reader = std::io::BufReader::with_capacity(1, crlf.as_bytes());
        let (trace, header) = read(reader).unwrap();
        assert_eq!(trace, lf);
        assert!(header.starts_with("; Version: 2.2\n; Computer: Intel Paragon\n"), "{header}");
        assert_eq!(header.lines().count(), 7);
    }

    #[test]
    fn what_is_not_a_trace_is_refused_at_its_first_line_without_reading_it_all() {
        // An endless stream without a line end (`/dev/zero`): refused after MAX_LINE_BYTES.
        let zeros = std::io::BufReader::new(std::io::repeat(0));
        let e = read(zeros).unwrap_err();
        assert_eq!(e, SwfError::LineTooLong { line: 1, max: MAX_LINE_BYTES });
        // Endless, with the third line not text.
        let mut bytes = b"; Version: 2.2\n\n\xff\x8b\x08 binary\n".to_vec();
        bytes.extend_from_slice(b"1 0 -1 1 1 -1 -1 -1 -1 -1 1 -1 -1 -1 0 -1 -1 -1\n");
        let endless = std::io::Read::chain(&bytes[..], std::io::repeat(b'7'));
        let e = read(std::io::BufReader::new(endless)).unwrap_err();
        assert_eq!(e, SwfError::NotText { line: 3, byte: 1 });
        assert!(e.to_string().contains("line 3: byte 1 of the line is not text"), "{e}");
    }

    const SDSC_LIKE: &str =
        "; Version: 2.2\n; Computer: Intel Paragon\n; UnixStartTime: 820090437\n\
; MaxNodes: 400 (48 interactive, 352 batch)\n; MaxProcs: 400\n; Queue:  0  interactive    \n\
; Queue:  1  q4t\n\
1    5094 -1   12072  16 -1 -1 -1 -1 -1 1 -1 -1 -1 0 -1 -1 -1\n\
2    5170 10       2   1 -1 -1 8 3600 -1 0 3 1 7 1 -1 -1 -1\r\n\
3    5200 -1       -1   -1 -1 -1 -1 -1 -1 5 -1 -1 -1 1 -1 -1 -1\n\
\n\
4    5300.6 -1  7200.4   4 -1 -1 -1 60 -1 2 -1 -1 -1 1 -1 -1 -1\n";

    #[test]
    fn a_job_written_as_a_line_reads_back_the_same_and_a_new_header_keeps_the_clock() {
        let (trace, header) = read(SDSC_LIKE.as_bytes()).unwrap();
        let mut job = trace.jobs[1].clone();
        job.avg_cpu = 1234.25;
        let line = job.to_string();
        assert_eq!(line, "2 5170 10 2 1 1234.25 -1 8 3600 -1 0 3 1 7 1 -1 -1 -1");
        assert_eq!(parse(&line).unwrap().jobs, vec![job]);
        // Every status reads back as itself.
        for code in [-1, 0, 1, 2, 3, 4, 5] {
            assert_eq!(Status::from_code(code).map(Status::code), Some(code));
        }
        let carried: Vec<&str> = header_lines_carried(&header).collect();
        assert_eq!(
            carried,
            ["; UnixStartTime: 820090437", "; Queue:  0  interactive", "; Queue:  1  q4t"]
        );
    }

    #[test]
    fn reads_the_header_and_all_eighteen_fields() {
        let t = parse(SDSC_LIKE).unwrap();
        assert_eq!(t.header.max_procs, Some(400));
        assert_eq!(t.header.max_nodes, Some(400));
        assert_eq!(t.header.unix_start_time, Some(820090437));
        assert_eq!(t.header.computer.as_deref(), Some("Intel Paragon"));
        assert_eq!(t.header.queues, vec![(0, "interactive".into()), (1, "q4t".into())]);
        assert_eq!(t.jobs.len(), 4);
        let j = &t.jobs[1];
        assert_eq!((j.id, j.submit, j.wait, j.run, j.allocated_procs), (2, 5170, 10, 2, 1));
        assert_eq!((j.requested_procs, j.requested_time, j.status), (8, 3600, Status::Failed));
        assert_eq!((j.user, j.group, j.executable, j.queue), (3, 1, 7, 1));
        // Field 8 wins over field 5; the estimate is the requested time.
        assert_eq!(j.procs(), Some(8));
        assert_eq!(j.estimate(), 3600);
        assert_eq!(j.replayable(), Ok(8));
        // Fractions are rounded.
        assert_eq!((t.jobs[3].submit, t.jobs[3].run), (5301, 7200));
    }

    #[test]
    fn unknown_estimates_and_jobs_that_ran_past_theirs() {
        let t = parse(SDSC_LIKE).unwrap();
        // No field 9: the run time is the estimate.
        assert_eq!(t.jobs[0].estimate(), 12072);
        // Ran 7200 s on a 60 s request: it was not killed, so the estimate grows to its run.
        assert_eq!(t.jobs[3].estimate(), 7200);
    }

    #[test]
    fn cancelled_before_start_and_partial_lines_are_skipped_with_a_reason() {
        let t = parse(SDSC_LIKE).unwrap();
        assert_eq!(t.jobs[2].status, Status::Cancelled);
        assert_eq!(t.jobs[2].replayable(), Err(Skip::NoRunTime));
        assert_eq!(t.jobs[3].replayable(), Err(Skip::PartialExecution));
        let cancelled_running = SwfJob { run: 50, allocated_procs: 2, ..t.jobs[2].clone() };
        assert_eq!(cancelled_running.replayable(), Ok(2));
        let no_procs = SwfJob { run: 50, ..t.jobs[2].clone() };
        assert_eq!(no_procs.replayable(), Err(Skip::NoProcessors));
    }

    #[test]
    fn garbage_is_refused_with_its_line_and_field() {
        let e = parse("; x\n1 2 3\n").unwrap_err();
        assert_eq!(e, SwfError::FieldCount { line: 2, found: 3, text: "1 2 3".into() });
        let e = parse("1 0 -1 10 4 -1 -1 -1 -1 -1 1 -1 -1 -1 zz -1 -1 -1\n").unwrap_err();
        assert!(e.to_string().contains("line 1, field 15 (queue): \"zz\""), "{e}");
        let e = parse("1 0 -1 10 4 -1 -1 -1 -1 -1 7 -1 -1 -1 0 -1 -1 -1\n").unwrap_err();
        assert!(e.to_string().contains("field 11 (status): 7"), "{e}");
        let e = parse("1 0 -1 10 4 -1 -1 -1 -1 -1 1 -1 -1 -1 0 -1 -1 -1 9\n").unwrap_err();
        assert!(matches!(e, SwfError::FieldCount { found: 19, .. }), "{e}");
        let e = parse("1 0 -1 NaN 4 -1 -1 -1 -1 -1 1 -1 -1 -1 0 -1 -1 -1\n").unwrap_err();
        assert!(e.to_string().contains("field 4 (run time)"), "{e}");
        // Values no log can hold: each named, with the field.
        for (line, expect) in [
            (
                "1 -500 -1 10 4 -1 -1 -1 -1 -1 1 -1 -1 -1 0 -1 -1 -1",
                "field 2 (submit time): \"-500\" is negative",
            ),
            (
                "1 0 -1 10 4 -1 -1 -1 -1 -1 1.7 -1 -1 -1 0 -1 -1 -1",
                "field 11 (status): \"1.7\" is not a whole number",
            ),
            (
                "1 0 -1 10 1.5 -1 -1 -1 -1 -1 1 -1 -1 -1 0 -1 -1 -1",
                "field 5 (allocated processors): \"1.5\" is not a whole number",
            ),
            (
                "1 0 -1 1e300 4 -1 -1 -1 -1 -1 1 -1 -1 -1 0 -1 -1 -1",
                "field 4 (run time): \"1e300\" is more seconds",
            ),
            (
                "1 0 -1 10 4294967296 -1 -1 -1 -1 -1 1 -1 -1 -1 0 -1 -1 -1",
                "field 5 (allocated processors): \"4294967296\" is more processors",
            ),
            (
                "1 0 -1 10 4 -1 -1 -1 -1 -1 1 -1 -1 -1 -7 -1 -1 -1",
                "field 15 (queue): \"-7\" is negative",
            ),
        ] {
            let e = parse(&format!("{line}\n")).unwrap_err().to_string();
            assert!(e.contains(expect), "{line}: {e}");
        }
        for header in ["; MaxProcs: -5", "; MaxProcs: 99999999999", "; MaxNodes: many"] {
            let e = parse(&format!("{header}\n")).unwrap_err().to_string();
            assert!(e.contains("line 1: the header says Max") && e.contains("not a count"), "{e}");
        }
    }
}
