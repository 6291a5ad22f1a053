//! The pure part of the module: which `-extsched` strings are topo's, the handler key that
//! makes jobs with equal requests peers, and the job ids shared with `topo-exec`.

use topo_core::request::{merge_extsched, MergeError, Request};

/// Marks topo's handler keys; what follows is the canonical request.
pub const KEY_PREFIX: &str = "topo#";

/// Whether an `-extsched` string (or a queue's) is a topology request topo handles: it names
/// `affinity[` or `CPUSET[` (case-insensitive), whatever else the site's other modules use.
pub fn is_ours(text: &str) -> bool {
    let lower = text.to_ascii_lowercase();
    lower.contains("affinity[") || lower.contains("cpuset[")
}

/// The job's own topology string among the elements `getextresreq` returned.
///
/// Which element holds the user's string is not documented (two public modules read element
/// 1, a third element 0; see the reference); so every element is looked at, those that are
/// topo's are kept, equal ones count once, and when they differ the last one wins (and the
/// caller logs it).
pub fn job_string(elements: &[String]) -> (Option<&str>, usize) {
    let ours: Vec<&str> =
        elements.iter().map(|s| s.trim()).filter(|s| !s.is_empty() && is_ours(s)).collect();
    let mut distinct = ours.clone();
    distinct.dedup();
    (ours.last().copied(), distinct.len())
}

/// What `newFn` decided for one resource requirement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// No topology request anywhere: LSF schedules the job as if topo were not there.
    NotOurs,
    /// A request: the handler key and the request.
    Request {
        /// `topo#` and the canonical request.
        key: String,
        /// The merged request.
        request: Request,
    },
    /// A string that does not parse: the key and the message for the pending reason.
    Bad {
        /// A key unique to the bad strings.
        key: String,
        /// What is wrong, quoting the fragment.
        message: String,
    },
}

/// Merges the job's string with the queue's (MANDATORY > job > DEFAULT, per keyword) and
/// decides.
pub fn decide(job: Option<&str>, mandatory: Option<&str>, default: Option<&str>) -> Decision {
    let mandatory = mandatory.filter(|s| is_ours(s));
    let default = default.filter(|s| is_ours(s));
    if job.is_none() && mandatory.is_none() && default.is_none() {
        return Decision::NotOurs;
    }
    match merge_extsched(mandatory, job, default) {
        Ok(request) => Decision::Request { key: format!("{KEY_PREFIX}{request}"), request },
        Err(e) => Decision::Bad {
            key: format!(
                "{KEY_PREFIX}bad#{}#{}#{}",
                mandatory.unwrap_or(""),
                job.unwrap_or(""),
                default.unwrap_or("")
            ),
            message: bad_message(&e, mandatory, job, default),
        },
    }
}

/// The pending-reason text for a string that does not parse: one line, naming the string,
/// quoting it, and saying what is wrong where (a pending reason has no room for a caret line).
pub fn bad_message(
    e: &MergeError,
    mandatory: Option<&str>,
    job: Option<&str>,
    default: Option<&str>,
) -> String {
    format!(
        "topo: bad topology request in {} \"{}\": {}",
        e.source_string,
        e.input(mandatory, job, default),
        e.error
    )
}

/// The request in a handler key (the job's `resKey` in notify), when the key is topo's.
pub fn request_from_key(key: &str) -> Option<Result<Request, String>> {
    let at = key.find(KEY_PREFIX)?;
    let text = &key[at + KEY_PREFIX.len()..];
    if text.starts_with("bad#") {
        return Some(Err("the job's topology request does not parse".into()));
    }
    Some(topo_core::request::parse(text).map_err(|e| e.to_string()))
}

/// The job id topod knows an LSF job by: `lsf-<id>`, or `lsf-<id>[<index>]` for an element of
/// a job array (the same as `topo-exec` makes from `$LSB_JOBID` and `$LSB_JOBINDEX`).
pub fn job_id(job: i32, index: i32) -> String {
    topo_core::batch::lsf_job_id(job, u64::try_from(index).ok())
}

/// Slots per host from an allocation's instances (`host`, `rsrc`, `amount`): instances of the
/// slot resource (no name, or `slots`) are summed per host, in first-seen order.
pub fn slots_per_host<'a>(
    instances: impl IntoIterator<Item = (&'a str, Option<&'a str>, f32)>,
) -> Vec<(String, u32)> {
    let mut out: Vec<(String, u32)> = Vec::new();
    for (host, rsrc, amount) in instances {
        if !matches!(rsrc, None | Some("") | Some("slots") | Some("slot")) || amount <= 0.0 {
            continue;
        }
        let n = amount.round() as u32;
        match out.iter_mut().find(|(h, _)| h == host) {
            Some((_, total)) => *total += n,
            None => out.push((host.to_string(), n)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_topo_strings_only() {
        let el = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(job_string(&el(&["", "affinity[core(2)]"])), (Some("affinity[core(2)]"), 1));
        assert_eq!(
            job_string(&el(&["affinity[core(2)]", "affinity[core(2)]"])),
            (Some("affinity[core(2)]"), 1)
        );
        assert_eq!(
            job_string(&el(&["filer[a b]", "CPUSET[CPU_LIST=0-3]"])),
            (Some("CPUSET[CPU_LIST=0-3]"), 1)
        );
        assert_eq!(
            job_string(&el(&["affinity[core(1)]", "affinity[core(4)]"])),
            (Some("affinity[core(4)]"), 2)
        );
        assert_eq!(job_string(&el(&["RMS[RMS_SNODE]"])), (None, 0));
    }

    #[test]
    fn decides_and_merges_with_the_queue() {
        assert_eq!(decide(None, Some("filer[x]"), None), Decision::NotOurs);
        match decide(Some("affinity[core(2)]"), None, Some("affinity[core(1):membind=localonly]")) {
            Decision::Request { key, request } => {
                assert_eq!(request.units_per_task, 2);
                assert!(key.starts_with(KEY_PREFIX));
                assert_eq!(
                    request_from_key(&format!("other#{key}")).unwrap().unwrap(),
                    request,
                    "the key gives the request back"
                );
            }
            other => panic!("{other:?}"),
        }
        match decide(Some("affinity[core(2,same=numaa)]"), None, None) {
            Decision::Bad { message, key } => {
                assert_eq!(message, "topo: bad topology request in the job's -extsched string \"affinity[core(2,same=numaa)]\": at byte 21 (\"numaa\"): unknown level for same=; expected one of numa, socket, core, mcm, l3");
                assert!(!message.contains('\n'));
                assert!(request_from_key(&key).unwrap().is_err());
            }
            other => panic!("{other:?}"),
        }
        // Only the queue says something: its default applies.
        assert!(matches!(decide(None, None, Some("affinity[numa(1)]")), Decision::Request { .. }));
    }

    #[test]
    fn job_ids_and_slots() {
        assert_eq!(job_id(1234, 0), "lsf-1234");
        assert_eq!(job_id(1234, 7), "lsf-1234[7]");
        let inst = [
            ("a", None, 2.0),
            ("b", Some("slots"), 1.0),
            ("a", Some(""), 2.0),
            ("a", Some("mem"), 100.0),
        ];
        assert_eq!(slots_per_host(inst), vec![("a".to_string(), 4), ("b".to_string(), 1)]);
        assert!(request_from_key("somebody_else#x").is_none());
    }
}
