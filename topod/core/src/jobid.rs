//! Job ids that are safe to use as one cgroup directory name.

use std::fmt;

/// The longest job id accepted, in bytes.
pub const MAX_JOB_ID_BYTES: usize = 128;

/// A batch system's job id, validated: 1 to 128 bytes of ASCII letters, digits and `._-:@+[]`
/// (LSF array jobs are `1234[5]`, Slurm steps `1234.0`, PBS ids `1234.server`), not starting
/// with `.` or `-`. So it can never be `.`, `..`, contain `/` or NUL, or name a path outside
/// the job's cgroup.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(String);

/// Why a job id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("job id {shown} refused: {why}")]
pub struct JobIdError {
    /// The id, escaped and cut to 40 characters, for the message.
    pub shown: String,
    /// What is wrong.
    pub why: String,
}

impl JobId {
    /// Validates `text` as a job id.
    pub fn parse(text: &str) -> Result<JobId, JobIdError> {
        let refuse = |why: String| JobIdError { shown: shown(text), why };
        if text.is_empty() {
            return Err(refuse("it is empty".into()));
        }
        if text.len() > MAX_JOB_ID_BYTES {
            return Err(refuse(format!(
                "it is {} bytes long, the limit is {MAX_JOB_ID_BYTES}",
                text.len()
            )));
        }
        if let Some((i, c)) = text.char_indices().find(|(_, c)| !allowed(*c)) {
            return Err(refuse(format!(
                "character {c:?} at byte {i} is not allowed (letters, digits and ._-:@+[] only)"
            )));
        }
        if text.starts_with('.') || text.starts_with('-') {
            return Err(refuse("it starts with '.' or '-'".into()));
        }
        // A job cgroup is a directory beside the kernel's control files: an id that is one of
        // their names (`freezer.state`, `tasks`, ...) would name a file, not a job.
        let lower = text.to_ascii_lowercase();
        if CONTROL_FILES.contains(&lower.as_str())
            || CONTROL_PREFIXES.iter().any(|p| lower.starts_with(p))
        {
            return Err(refuse(
                "it is, or looks like, the name of a cgroup control file (cgroup.*, cpuset.*, freezer.*, memory.*, tasks, ...)".into(),
            ));
        }
        Ok(JobId(text.to_string()))
    }

    /// The id.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The kernel's cgroup control files without a controller prefix (v1 and v2).
const CONTROL_FILES: [&str; 3] = ["tasks", "notify_on_release", "release_agent"];

/// Controller prefixes of cgroup control files (v1 and v2).
const CONTROL_PREFIXES: [&str; 16] = [
    "cgroup.",
    "cpuset.",
    "cpu.",
    "cpuacct.",
    "memory.",
    "freezer.",
    "io.",
    "blkio.",
    "pids.",
    "hugetlb.",
    "rdma.",
    "misc.",
    "net_cls.",
    "net_prio.",
    "devices.",
    "perf_event.",
];

fn allowed(c: char) -> bool {
    c.is_ascii_alphanumeric() || "._-:@+[]".contains(c)
}

fn shown(text: &str) -> String {
    let escaped: String = text.escape_debug().take(40).collect();
    if text.escape_debug().count() > 40 {
        format!("\"{escaped}...\"")
    } else {
        format!("\"{escaped}\"")
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn real_ids_pass() {
        for id in ["1234", "1234[5]", "1234.0", "4711.pbs-server", "job_7:step@host+1", "a"] {
            assert_eq!(JobId::parse(id).unwrap().as_str(), id);
        }
    }

    #[test]
    fn path_like_and_odd_ids_are_refused() {
        for (id, why) in [
            ("", "empty"),
            (".", "starts with"),
            ("..", "starts with"),
            ("../x", "'/'"),
            ("a/b", "'/'"),
            ("a\0b", "'\\0'"),
            ("-rf", "starts with"),
            ("job 1", "' '"),
            ("naïve", "'ï'"),
            ("a\nb", "'\\n'"),
            ("freezer.state", "cgroup control file"),
            ("tasks", "cgroup control file"),
            ("Memory.max", "cgroup control file"),
            ("cgroup.procs", "cgroup control file"),
        ] {
            let e = JobId::parse(id).unwrap_err().to_string();
            assert!(e.contains(why), "{id:?}: {e}");
        }
        let long = "9".repeat(4096);
        let e = JobId::parse(&long).unwrap_err().to_string();
        assert!(e.contains("4096 bytes") && e.len() < 200, "{e}");
    }

    proptest! {
        #[test]
        fn an_accepted_id_is_one_plain_path_component(text in ".{0,40}") {
            if let Ok(id) = JobId::parse(&text) {
                let p = std::path::Path::new(id.as_str());
                prop_assert_eq!(p.components().count(), 1);
                prop_assert!(matches!(p.components().next(), Some(std::path::Component::Normal(_))));
            }
        }
    }
}
