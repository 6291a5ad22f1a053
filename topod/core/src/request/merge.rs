//! The queue merge of `-extsched` strings (LSF's `MANDATORY_EXTSCHED` and `DEFAULT_EXTSCHED`).
//!
//! The rules are documented on [`merge_extsched`].

use super::parse::{parse_parts, CpusetKey, Mention, Parts, RequestError};
use super::Request;
use std::fmt;

/// Which of the three strings of the merge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExtschedSource {
    /// The queue's `MANDATORY_EXTSCHED`.
    QueueMandatory,
    /// The job's `-extsched`.
    Job,
    /// The queue's `DEFAULT_EXTSCHED`.
    QueueDefault,
}

impl fmt::Display for ExtschedSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ExtschedSource::QueueMandatory => "the queue's MANDATORY_EXTSCHED",
            ExtschedSource::Job => "the job's -extsched string",
            ExtschedSource::QueueDefault => "the queue's DEFAULT_EXTSCHED",
        })
    }
}

/// A string of the merge that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("in {source_string}: {error}")]
pub struct MergeError {
    /// Which string is wrong.
    pub source_string: ExtschedSource,
    /// What is wrong in it, with the span inside that string.
    pub error: RequestError,
}

impl MergeError {
    /// Of the three strings given to [`merge_extsched`], the one this error is about.
    pub fn input<'a>(
        &self,
        mandatory: Option<&'a str>,
        job: Option<&'a str>,
        default: Option<&'a str>,
    ) -> &'a str {
        match self.source_string {
            ExtschedSource::QueueMandatory => mandatory,
            ExtschedSource::Job => job,
            ExtschedSource::QueueDefault => default,
        }
        .unwrap_or("")
    }

    /// Like [`RequestError::render`]: `input` is the string named by `source_string`.
    pub fn render(&self, input: &str) -> String {
        format!("in {}:\n{}", self.source_string, self.error.render(input))
    }
}

/// Merges the job's `-extsched` string with the queue's `MANDATORY_EXTSCHED` and
/// `DEFAULT_EXTSCHED` (rules below). `None` where the string is not set. The merged
/// request's canonical text is `to_string()` of the result.
///
/// Precedence, per `CPUSET` keyword: the queue's `MANDATORY_EXTSCHED` over the job's
/// `-extsched` over the queue's `DEFAULT_EXTSCHED`. The highest-priority string that names a
/// keyword decides it; when it names the keyword with an empty value (`MAX_RADIUS=`), the
/// keyword is unset whatever the lower-priority strings say. LSF's worked example:
///
/// ```text
/// job                 CPUSET[CPU_LIST=1,5,7-12;MAX_CPU_PER_NODE=4]
/// DEFAULT_EXTSCHED    CPUSET[CPUSET_OPTIONS=CPUSET_CPU_EXCLUSIVE]
/// MANDATORY_EXTSCHED  CPUSET[CPUSET_TYPE=dynamic;MAX_CPU_PER_NODE=2]
/// effective           CPUSET[CPUSET_TYPE=dynamic;MAX_CPU_PER_NODE=2;CPU_LIST=1, 5, 7-12;
///                            CPUSET_OPTIONS=CPUSET_CPU_EXCLUSIVE]
/// ```
///
/// The `affinity[...]` section is one unit, not merged clause by clause (its parts depend on
/// each other: `same=` and `exclusive=` are checked against the unit): it is taken whole from
/// the highest-priority string that has one.
///
/// A string that is absent (`None`) or only white space contributes nothing. Each present
/// string must parse on its own (with empty values allowed); an error names the string.
pub fn merge_extsched(
    mandatory: Option<&str>,
    job: Option<&str>,
    default: Option<&str>,
) -> Result<Request, MergeError> {
    let sources = [
        (ExtschedSource::QueueMandatory, mandatory),
        (ExtschedSource::Job, job),
        (ExtschedSource::QueueDefault, default),
    ];
    let mut parsed: Vec<Parts> = Vec::with_capacity(3);
    for (source_string, text) in sources {
        let Some(text) = text.filter(|t| !t.trim().is_empty()) else { continue };
        let parts = parse_parts(text, true).map_err(|error| MergeError { source_string, error })?;
        parsed.push(parts);
    }
    Ok(merge_parts(&parsed))
}

/// Merges parsed strings given highest priority first.
fn merge_parts(parsed: &[Parts]) -> Request {
    let mut out = Request::default();
    if let Some(p) = parsed.iter().find(|p| p.has_affinity) {
        let r = &p.req;
        out = Request {
            tasks: r.tasks,
            tasks_max: r.tasks_max,
            unit: r.unit,
            units_per_task: r.units_per_task,
            same: r.same,
            exclusive: r.exclusive,
            cpubind: r.cpubind,
            membind: r.membind,
            distribute: r.distribute,
            mem_mib: r.mem_mib,
            gpubind: r.gpubind,
            gpus_per_task: r.gpus_per_task,
            ..Request::default()
        };
    }
    for key in CpusetKey::ALL {
        let decider = parsed.iter().find(|p| p.mentioned[key as usize] != Mention::Absent);
        if let Some(p) = decider.filter(|p| p.mentioned[key as usize] == Mention::Set) {
            key.copy(&p.req, &mut out);
        }
    }
    out
}
