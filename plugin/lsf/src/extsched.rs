//! The pure part of the module: which `-extsched` strings are topo's, the handler key that
//! makes jobs with equal requests peers, and the job ids shared with `topo-exec`.

use crate::keys::KeyStore;
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use topo_core::request::{merge_extsched, MergeError, Request};

/// Marks topo's handler keys; what follows is the canonical request, or (for a request whose
/// canonical form is longer than [`KEY_MAX`]) `h#` and a hash of it.
pub const KEY_PREFIX: &str = "topo#";

/// The longest handler key the module gives LSF, in bytes. Jobs with equal keys are LSF "peer
/// jobs"; a longer canonical request (a long `CPU_LIST`) is keyed by its hash instead, so that
/// a 64 KB string does not become a 64 KB key in every scheduling session.
pub const KEY_MAX: usize = 256;

/// The longest pending reason the module sets, in bytes (the request itself is quoted at most
/// [`QUOTED_MAX`] bytes long in it; the parser's message names the fragment and its byte).
pub const REASON_MAX: usize = 512;

/// How much of a bad string a pending reason quotes.
pub const QUOTED_MAX: usize = 80;

/// Whether an `-extsched` string (or a queue's) holds a topology request topo handles: a
/// top-level `affinity[...]` or `CPUSET[...]` section (case-insensitive, spaces allowed before
/// the bracket, as topo's grammar allows). A section of another module that merely contains
/// the word (`filer[affinity[x]]`) is not topo's.
pub fn is_ours(text: &str) -> bool {
    topo_part(text).is_some()
}

/// Topo's sections of an `-extsched` string, joined by a space, with every other module's
/// sections (`PSET[...]`, `filer[...]`) and stray words left out; `None` when there is none.
///
/// Sections are `NAME [ ... ]` at the top level, brackets balanced; a section of topo's that is
/// never closed runs to the end of the string, so that the parser says where it is unclosed.
pub fn topo_part(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut ours: Vec<&str> = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i].is_ascii_whitespace() {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
            i += 1;
        }
        let name = &text[start..i];
        let mut j = i;
        while j < bytes.len() && bytes[j].is_ascii_whitespace() {
            j += 1;
        }
        if name.is_empty() || j >= bytes.len() || bytes[j] != b'[' {
            // Not a section (`filer-affinity[...]`, `x=affinity[...]`, a stray word): skip the
            // whole word, brackets and all, to the next space outside brackets.
            let mut depth = 0usize;
            while i < bytes.len() && !(depth == 0 && bytes[i].is_ascii_whitespace()) {
                match bytes[i] {
                    b'[' => depth += 1,
                    b']' => depth = depth.saturating_sub(1),
                    _ => {}
                }
                i += 1;
            }
            continue;
        }
        let mut depth = 0usize;
        let mut end = bytes.len();
        for (k, &b) in bytes.iter().enumerate().skip(j) {
            match b {
                b'[' => depth += 1,
                b']' => {
                    depth -= 1;
                    if depth == 0 {
                        end = k + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        if name.eq_ignore_ascii_case("affinity") || name.eq_ignore_ascii_case("cpuset") {
            ours.push(&text[start..end]);
        }
        i = end;
    }
    (!ours.is_empty()).then(|| ours.join(" "))
}

/// Requests keyed by a hash ([`KEY_MAX`]), so that `notifyAllocFn` finds the request of a job
/// whose key is one. Bounded: past [`LONG_KEYS_MAX`] distinct long requests the one used least
/// recently is forgotten here, and read back from the key store ([`crate::keys`]) when a job
/// keyed by it is notified; so a key is never longer than [`KEY_MAX`], and a running job's
/// request is never lost, also to a new scheduler process.
static LONG_KEYS: Mutex<Option<LongKeys>> = Mutex::new(None);
const LONG_KEYS_MAX: usize = 16_384;

/// The registry: the request and the tick it was last keyed at, by key.
#[derive(Default)]
struct LongKeys {
    by_key: HashMap<String, (Request, u64)>,
    tick: u64,
}

/// A 128-bit hash of `parts` (two 64-bit SipHashes, differently salted), as 32 hex digits.
fn hash_of(parts: &[&str]) -> String {
    let half = |salt: u8| {
        let mut h = DefaultHasher::new();
        salt.hash(&mut h);
        parts.hash(&mut h);
        h.finish()
    };
    format!("{:016x}{:016x}", half(1), half(2))
}

/// Where long requests outlive the process ([`crate::keys`]), once `sched_init` has set it.
static KEY_STORE: Mutex<Option<Arc<dyn KeyStore>>> = Mutex::new(None);

/// Sets where long requests are kept for a new scheduler process (`None`: memory only).
pub fn set_key_store(store: Option<Arc<dyn KeyStore>>) {
    *KEY_STORE.lock().unwrap_or_else(|e| e.into_inner()) = store;
}

fn key_store() -> Option<Arc<dyn KeyStore>> {
    KEY_STORE.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Keeps `request` under `key` in memory, the one used least recently forgotten past
/// [`LONG_KEYS_MAX`] (the key store still has it).
fn remember(keys: &mut LongKeys, key: &str, request: &Request, tick: u64) {
    if keys.by_key.len() >= LONG_KEYS_MAX && !keys.by_key.contains_key(key) {
        let oldest = keys.by_key.iter().min_by_key(|(_, (_, used))| *used).map(|(k, _)| k.clone());
        if let Some(oldest) = oldest {
            keys.by_key.remove(&oldest);
        }
    }
    keys.by_key.insert(key.to_string(), (request.clone(), tick));
}

/// The handler key of `request`: its canonical form, or its hash when that is too long (the
/// request then kept in memory and in the key store, so that a new process finds it too).
pub fn key_of(request: &Request) -> String {
    let canonical = format!("{KEY_PREFIX}{request}");
    if canonical.len() <= KEY_MAX {
        return canonical;
    }
    let (key, new) = {
        let mut keys = LONG_KEYS.lock().unwrap_or_else(|e| e.into_inner());
        let keys = keys.get_or_insert_with(LongKeys::default);
        keys.tick += 1;
        let tick = keys.tick;
        let mut key = format!("{KEY_PREFIX}h#{}", hash_of(&[&canonical]));
        if keys.by_key.get(&key).is_some_and(|(r, _)| r != request) {
            // Another request has this hash: salt it with the tick, unique from here on.
            key = format!("{KEY_PREFIX}h#{}", hash_of(&[&canonical, &tick.to_string()]));
        }
        let new = !keys.by_key.contains_key(&key);
        remember(keys, &key, request, tick);
        (key, new)
    };
    if new {
        // Written outside the lock: a file write must not hold up other requirements' keys.
        if let Some(store) = key_store() {
            store.save(&key[KEY_PREFIX.len() + 2..], &canonical[KEY_PREFIX.len()..]);
        }
    }
    key
}

/// The request kept under a hashed key: in memory, else in the key store (a key a previous
/// scheduler process made, replayed at `NOTIFY_STARTUP`), then remembered.
fn long_request(key: &str) -> Option<Request> {
    {
        let keys = LONG_KEYS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((r, _)) = keys.as_ref().and_then(|k| k.by_key.get(key)) {
            return Some(r.clone());
        }
    }
    let hash = key.strip_prefix(KEY_PREFIX)?.strip_prefix("h#")?;
    let text = key_store()?.load(hash)?;
    let request = match topo_core::request::parse(&text) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(key, "the key store's request for this key does not parse: {e}");
            return None;
        }
    };
    let mut keys = LONG_KEYS.lock().unwrap_or_else(|e| e.into_inner());
    let keys = keys.get_or_insert_with(LongKeys::default);
    keys.tick += 1;
    let tick = keys.tick;
    remember(keys, key, &request, tick);
    Some(request)
}

/// The job's own topology string among the elements `getextresreq` returned.
///
/// Which element holds the user's string is not documented (two public modules read element
/// 1, a third element 0; see the reference); so every element is looked at, those that are
/// topo's are kept, equal ones count once, and when they differ the last one wins (and the
/// caller logs it).
pub fn job_string(elements: &[String]) -> (Option<&str>, usize) {
    // Which element is topo's is decided by its top-level sections ([`is_ours`]); [`decide`]
    // keeps only those sections of it.
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
/// Merges the job's string with the queue's (MANDATORY > job > DEFAULT, per keyword) and
/// decides. Only topo's sections of each string count ([`topo_part`]).
pub fn decide(job: Option<&str>, mandatory: Option<&str>, default: Option<&str>) -> Decision {
    let (job, mandatory, default) =
        (job.and_then(topo_part), mandatory.and_then(topo_part), default.and_then(topo_part));
    let (job, mandatory, default) = (job.as_deref(), mandatory.as_deref(), default.as_deref());
    if job.is_none() && mandatory.is_none() && default.is_none() {
        return Decision::NotOurs;
    }
    match merge_extsched(mandatory, job, default) {
        Ok(request) => Decision::Request { key: key_of(&request), request },
        Err(e) => Decision::Bad {
            // Equal bad strings share a key (one pending reason for all of them), of bounded size.
            key: format!(
                "{KEY_PREFIX}bad#{}",
                hash_of(&[mandatory.unwrap_or(""), job.unwrap_or(""), default.unwrap_or("")])
            ),
            message: bad_message(&e, mandatory, job, default),
        },
    }
}

/// The pending-reason text for a string that does not parse: one line, naming the string,
/// quoting it (at most [`QUOTED_MAX`] bytes of it), and saying what is wrong where (a pending
/// reason has no room for a caret line); at most [`REASON_MAX`] bytes in all.
pub fn bad_message(
    e: &MergeError,
    mandatory: Option<&str>,
    job: Option<&str>,
    default: Option<&str>,
) -> String {
    let input = e.input(mandatory, job, default);
    let quoted = if input.len() > QUOTED_MAX {
        format!("{}...", &input[..floor_char_boundary(input, QUOTED_MAX)])
    } else {
        input.to_string()
    };
    capped(format!("topo: bad topology request in {} \"{quoted}\": {}", e.source_string, e.error))
}

/// `message` cut to at most [`REASON_MAX`] bytes (ending "..." when cut): what the module
/// hands the scheduler as a reason, which it may copy into a buffer of its own.
pub fn capped(mut message: String) -> String {
    if message.len() > REASON_MAX {
        message.truncate(floor_char_boundary(&message, REASON_MAX - 3));
        message.push_str("...");
    }
    message
}

/// The largest character boundary of `text` at or below `at`.
fn floor_char_boundary(text: &str, at: usize) -> usize {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// The request in a handler key (the job's `resKey` in notify), when the key is topo's.
pub fn request_from_key(key: &str) -> Option<Result<Request, String>> {
    let at = key.find(KEY_PREFIX)?;
    let text = &key[at + KEY_PREFIX.len()..];
    if text.starts_with("bad#") {
        return Some(Err("the job's topology request does not parse".into()));
    }
    if text.starts_with("h#") {
        return Some(long_request(&key[at..]).ok_or_else(|| {
            "the job's topology request is keyed by a hash neither this module nor its key_dir has"
                .to_string()
        }));
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
    fn a_reason_is_capped_at_a_character_boundary() {
        let long = format!(
            "topo: h can no longer hold 1 task(s) of CPUSET[CPU_LIST={}é]",
            "0,".repeat(100_000)
        );
        let cut = capped(long);
        assert!(cut.len() <= REASON_MAX && cut.ends_with("..."), "{}", cut.len());
        assert_eq!(capped("short".into()), "short");
        let accents = capped("é".repeat(REASON_MAX));
        assert!(accents.len() <= REASON_MAX && accents.is_char_boundary(accents.len() - 3));
    }

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
    fn only_top_level_sections_of_topo_are_claimed() {
        assert_eq!(topo_part("filer[affinity[x]]"), None, "another module's section");
        assert_eq!(
            topo_part("PSET[PSET_TYPE=cpu] CPUSET[CPU_LIST=0-3]").as_deref(),
            Some("CPUSET[CPU_LIST=0-3]")
        );
        assert_eq!(topo_part("affinity [core(1)]").as_deref(), Some("affinity [core(1)]"));
        assert_eq!(
            topo_part("  Affinity[core(1)]  cpuset[MAX_RADIUS=1]").as_deref(),
            Some("Affinity[core(1)] cpuset[MAX_RADIUS=1]")
        );
        assert_eq!(
            topo_part("RMS[RMS_SNODE] affinity[core(2"),
            Some("affinity[core(2".to_string()),
            "unclosed: to the end"
        );
        assert_eq!(topo_part("affinity"), None);
        assert_eq!(topo_part("é affinity[core(1)]").as_deref(), Some("affinity[core(1)]"));
        for other in ["filer-affinity[core(1)]", "filer:affinity[core(1)]", "x=affinity[core(48)]"]
        {
            assert_eq!(topo_part(other), None, "{other}");
        }
        // What decide does with them: the other module's part is left alone, ours is parsed.
        assert!(matches!(
            decide(Some("PSET[PSET_TYPE=cpu] CPUSET[CPU_LIST=0-3]"), None, None),
            Decision::Request { .. }
        ));
        assert!(matches!(decide(Some("affinity [core(1)]"), None, None), Decision::Request { .. }));
        assert_eq!(decide(Some("filer[affinity[x]]"), None, None), Decision::NotOurs);
    }

    /// The tests that use hashed keys, one at a time: they share the process's registry.
    static LONG_KEY_TESTS: Mutex<()> = Mutex::new(());

    #[test]
    fn a_long_request_is_found_by_a_new_process_and_after_memory_forgot_it() {
        let _one = LONG_KEY_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let store = Arc::new(crate::keys::MemKeyStore::default());
        set_key_store(Some(store.clone()));
        let long = |odd: u32| {
            let list: String = (0..200).step_by(2).map(|c| format!("{c},")).collect();
            format!("CPUSET[CPU_LIST={list}{}]", 201 + 2 * odd)
        };
        let Decision::Request { key, request } = decide(Some(&long(0)), None, None) else {
            panic!("a request")
        };
        assert!(key.len() <= KEY_MAX);
        assert_eq!(key_of(&request), key);
        assert_eq!(store.0.lock().unwrap().len(), 1, "written once");
        // A new scheduler process: nothing in memory, the key store kept. Its replay of the
        // running job (NOTIFY_STARTUP) finds the request.
        *LONG_KEYS.lock().unwrap() = None;
        assert_eq!(request_from_key(&key).unwrap().unwrap(), request);
        // Without a key store, it could not.
        *LONG_KEYS.lock().unwrap() = None;
        set_key_store(None);
        let e = request_from_key(&key).unwrap().unwrap_err();
        assert!(e.contains("neither this module nor its key_dir"), "{e}");
        // Memory forgets the oldest past LONG_KEYS_MAX distinct long requests; the store does
        // not, so a running job's request is never lost.
        set_key_store(Some(store.clone()));
        assert_eq!(key_of(&request), key);
        for odd in 1..=LONG_KEYS_MAX as u32 {
            let Ok(r) = topo_core::request::parse(&long(odd)) else { panic!("parses") };
            key_of(&r);
        }
        assert!(!LONG_KEYS.lock().unwrap().as_ref().unwrap().by_key.contains_key(&key));
        assert_eq!(request_from_key(&key).unwrap().unwrap(), request);
        *LONG_KEYS.lock().unwrap() = None;
        set_key_store(None);
    }

    #[test]
    fn keys_and_reasons_are_bounded() {
        let _one = LONG_KEY_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let list: String = (0..20000).step_by(2).map(|c| format!("{c},")).collect();
        let long = format!("CPUSET[CPU_LIST={list}0]");
        match decide(Some(&long), None, None) {
            Decision::Request { key, request } => {
                assert!(key.len() <= KEY_MAX, "key of {} bytes", key.len());
                assert_eq!(
                    request_from_key(&key).unwrap().unwrap(),
                    request,
                    "the hash gives it back"
                );
                assert_eq!(key, key_of(&request), "equal requests, equal keys");
            }
            other => panic!("{other:?}"),
        }
        let bad = format!("CPUSET[CPU_LIST={list}x]");
        match decide(Some(&bad), None, None) {
            Decision::Bad { key, message } => {
                assert!(key.len() <= KEY_MAX, "bad key of {} bytes", key.len());
                assert!(message.len() <= REASON_MAX, "reason of {} bytes", message.len());
                assert!(message.contains("at byte"), "{message}");
                assert_eq!(
                    decide(Some(&bad), None, None),
                    Decision::Bad { key, message },
                    "equal bad strings are peers"
                );
            }
            other => panic!("{other:?}"),
        }
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
