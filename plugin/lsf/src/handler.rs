//! The six callbacks of the resource-requirement handler, in ABI order.

use crate::api::Api;
use crate::extsched::{self, Decision};
use crate::hosts::Resolved;
use crate::{guarded, module, Module};
use std::collections::{HashMap, VecDeque};
use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;
use topo_core::request::Request;
use topo_lsf_sys as sys;
use topo_plugin_core::cache::HostId;
use topo_plugin_core::eval::{self, Admission, Claimant, Context, NoFit, Verdict, UNKNOWN_SCORE};
use topo_plugin_core::reserve::Dispatched;
use topo_plugin_core::Unreachable;

/// The table `sched_init` registers.
pub fn table() -> sys::RsrcReqHandlerType {
    sys::RsrcReqHandlerType {
        newFn: Some(new_fn),
        freeFn: Some(free_fn),
        matchFn: Some(match_fn),
        sortFn: Some(sort_fn),
        notifyAllocFn: Some(notify_alloc_fn),
        checkAllocFn: Some(check_alloc_fn),
    }
}

/// What `newFn` attaches to a resource requirement (and its peers). It holds no scores: a
/// scheduler keeps every pending job's requirement between sessions, and scores per candidate
/// per requirement would be O(hosts) each (160 KB at 10,000 hosts; issue 31). `sortFn` finds
/// its match's scores in [`RECENT`], or asks the memo again.
struct HandlerData {
    /// Unique for the process (a freed requirement's address may be reused).
    id: u64,
    what: What,
}

static NEXT_DATA_ID: AtomicU64 = AtomicU64::new(1);

/// The scores of the last few matches, for their `sortFn`, newest first: per match, the
/// requirement's [`HandlerData::id`] and the kept candidates' host pointers and scores in the
/// candidates' order. A scheduler that sorts right after each match finds them here; one that
/// matches many requirements before sorting has them asked of the memo again (which remembers
/// the verdicts per shape and host, so that costs a lookup per candidate, not a placement).
static RECENT: Mutex<VecDeque<(u64, Scores)>> = Mutex::new(VecDeque::new());
/// Kept candidates' host pointers and scores, in the candidates' order.
type Scores = Vec<(usize, u64)>;
/// How many matches' scores [`RECENT`] keeps: at most this many times 16 bytes per kept
/// candidate, however many requirements are pending.
const RECENT_MATCHES: usize = 4;

/// Keeps the scores of requirement `id`'s match, forgetting the oldest beyond [`RECENT_MATCHES`].
fn remember_scores(id: u64, fill: impl FnOnce(&mut Scores)) {
    let mut recent = RECENT.lock().unwrap_or_else(|e| e.into_inner());
    let mut scores = match recent.iter().position(|r| r.0 == id) {
        Some(i) => recent.remove(i).map(|r| r.1).unwrap_or_default(),
        // The oldest one's buffer is reused.
        None if recent.len() >= RECENT_MATCHES => {
            recent.pop_back().map(|r| r.1).unwrap_or_default()
        }
        None => Vec::new(),
    };
    scores.clear();
    fill(&mut scores);
    recent.push_front((id, scores));
}

enum What {
    // Boxed: one pointer in each pending requirement's data, not the whole request.
    Request { request: Box<Request>, memo_key: String },
    Bad { message: String },
}

/// Pending reasons, as offsets from `[lsf] reason_base`.
const REASON_BAD_REQUEST: c_int = 0;
const REASON_NO_FIT: c_int = 1;
const REASON_UNKNOWN: c_int = 2;
const REASON_CHANGED: c_int = 3;

/// Reads a C string the scheduler owns.
///
/// SAFETY (for callers): `p` is null or points to a NUL-terminated string valid for the call.
unsafe fn text(p: *const c_char) -> Option<String> {
    // SAFETY: guaranteed by the caller.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

unsafe extern "C" fn new_fn(resreq: *mut c_void) -> c_int {
    guarded("newFn", -1, || {
        let m = module()?;
        if resreq.is_null() {
            return Err("newFn called with no resource requirement".into());
        }
        let mut count: c_int = 0;
        // SAFETY: resreq is the scheduler's live requirement; count is a valid out-pointer.
        let array = unsafe { (m.api.get_ext_res_req)(resreq, &mut count) };
        let mut elements = Vec::new();
        if !array.is_null() {
            for i in 0..count.max(0) as usize {
                // SAFETY: the scheduler returned `count` entries, each null or a C string.
                let s = unsafe { text(*array.add(i)) };
                tracing::debug!(index = i, element = ?s, "-extsched element");
                elements.push(s.unwrap_or_default());
            }
        }
        let (mut mandatory, mut default) = (ptr::null_mut(), ptr::null_mut());
        if let Some(f) = m.api.get_que_extsched {
            // SAFETY: as above; both out-pointers are valid and start null.
            unsafe { f(resreq, &mut mandatory, &mut default) };
        }
        // SAFETY: null or C strings owned by the scheduler.
        let (mandatory, default) = unsafe { (text(mandatory), text(default)) };
        tracing::debug!(?mandatory, ?default, "queue extsched strings");
        let (job, distinct) = extsched::job_string(&elements);
        if distinct > 1 {
            tracing::warn!(?elements, chosen = ?job, "several different topology strings; the last one is used");
        }
        let (key, what) = match extsched::decide(job, mandatory.as_deref(), default.as_deref()) {
            Decision::NotOurs => return Ok(0),
            Decision::Request { key, request } => {
                let memo_key = format!("{request}#{}", request.tasks.unwrap_or(1));
                (key, What::Request { request: Box::new(request), memo_key })
            }
            Decision::Bad { key, message } => {
                tracing::info!("{message}");
                (key, What::Bad { message })
            }
        };
        let key = CString::new(key.replace('\0', "")).map_err(|e| e.to_string())?;
        let id = NEXT_DATA_ID.fetch_add(1, Ordering::Relaxed);
        let data = Box::into_raw(Box::new(HandlerData { id, what }));
        // SAFETY: the scheduler copies the key; `data` stays valid until it calls freeFn.
        unsafe {
            (m.api.set_object)(
                resreq,
                m.config.lsf.handler_id,
                key.as_ptr() as *mut c_char,
                data as *mut c_void,
            )
        };
        Ok(0)
    })
}

unsafe extern "C" fn free_fn(data: *mut c_void) {
    guarded("freeFn", (), || {
        if !data.is_null() {
            // SAFETY: `data` came from Box::into_raw in newFn and the scheduler frees it once.
            let data = unsafe { Box::from_raw(data as *mut HandlerData) };
            RECENT.lock().unwrap_or_else(|e| e.into_inner()).retain(|r| r.0 != data.id);
        }
        Ok(())
    })
}

/// One candidate: its group, its place in the group, its host pointer and cache host.
struct Candidate {
    group: *mut sys::candHostGroup,
    index: usize,
    host_ptr: usize,
    /// The cache's host (none: no topod is known for it).
    host: Option<HostId>,
}

/// The candidate groups of a list, in order.
///
/// SAFETY (for callers): `list` is the scheduler's live candidate list.
unsafe fn groups(api: &Api, list: *mut c_void) -> Vec<*mut sys::candHostGroup> {
    let mut out = Vec::new();
    // SAFETY: the documented idiom: the list first, then null for the next group.
    let mut g = unsafe { (api.get_next_group)(list) };
    while !g.is_null() {
        out.push(g);
        // SAFETY: as above.
        g = unsafe { (api.get_next_group)(ptr::null_mut()) };
    }
    out
}

/// The members of a group.
///
/// SAFETY (for callers): `g` is a live group whose `candHost` holds `numOfMembers` entries.
unsafe fn members<'a>(g: *mut sys::candHostGroup) -> &'a mut [sys::candHost] {
    // SAFETY: guaranteed by the caller.
    unsafe {
        let n = (*g).numOfMembers.max(0) as usize;
        if n == 0 || (*g).candHost.is_null() {
            return &mut [];
        }
        std::slice::from_raw_parts_mut((*g).candHost, n)
    }
}

unsafe extern "C" fn match_fn(data: *mut c_void, list: *mut c_void, reason: *mut c_void) -> c_int {
    guarded("matchFn", -1, || {
        let m = module()?;
        if data.is_null() || list.is_null() {
            return Err("matchFn called without handler data or candidates".into());
        }
        // SAFETY: `data` is the HandlerData newFn attached, alive until freeFn.
        let data = unsafe { &*(data as *const HandlerData) };
        // SAFETY: `list` is the scheduler's candidate list for this call.
        let groups = unsafe { groups(&m.api, list) };
        // A snapshot: never waits for the refresher.
        let cache = m.shared.cache.load();
        let (candidates, unknown) = candidates_of(m, &cache, &groups);
        if !unknown.is_empty() && !m.config.cache.address_template.is_empty() {
            let mut discovered = m.shared.discovered.lock().unwrap_or_else(|e| e.into_inner());
            let before = discovered.len();
            discovered.extend(unknown);
            if discovered.len() > before {
                tracing::info!(
                    hosts = discovered.len() - before,
                    "hosts not in the cache yet; fetching their state in the background"
                );
            }
        }
        let base = m.config.lsf.reason_base;
        let (request, memo_key) = match &data.what {
            What::Bad { message } => {
                remove(m, reason, &candidates, |_| Some(base + REASON_BAD_REQUEST));
                if let Some(f) = m.api.set_main_reason {
                    let msg = CString::new(message.replace('\0', "")).map_err(|e| e.to_string())?;
                    // SAFETY: `reason` is the scheduler's reason object; it copies the text.
                    unsafe { f(reason, msg.as_ptr() as *mut c_char, 1) };
                }
                return Ok(0);
            }
            What::Request { request, memo_key } => (request, memo_key),
        };
        let mut req = request.clone();
        req.tasks.get_or_insert(1);
        let verdicts = decide_all(m, &cache, &req, memo_key, &candidates);
        drop(cache);
        let mut removed = 0;
        remember_scores(data.id, |scores| {
            scores.reserve(candidates.len());
            for (c, v) in candidates.iter().zip(&verdicts) {
                match v {
                    Ok(score) => scores.push((c.host_ptr, *score)),
                    Err(_) => removed += 1,
                }
            }
        });
        tracing::debug!(request = %req, candidates = candidates.len(), removed, "match");
        remove(m, reason, &candidates, |i| verdicts[i].as_ref().err().map(|&r| base + r));
        Ok(0)
    })
}

/// The candidates of `groups`, in order, each with its cache host; and the names just found to
/// have none (to fetch, when a template allows).
fn candidates_of(
    m: &Module,
    cache: &topo_plugin_core::HostCache,
    groups: &[*mut sys::candHostGroup],
) -> (Vec<Candidate>, Vec<String>) {
    // SAFETY: live groups from the scheduler.
    let total = groups.iter().map(|&g| unsafe { members(g) }.len()).sum();
    let mut candidates = Vec::with_capacity(total);
    let mut unknown = Vec::new();
    let mut index = m.hosts.lock().unwrap_or_else(|e| e.into_inner());
    for &g in groups {
        // SAFETY: a live group from the scheduler.
        for (i, c) in unsafe { members(g) }.iter().enumerate() {
            // SAFETY: `c` is a live candidate of this call.
            let host = match unsafe { index.resolve(&m.api, cache, c) } {
                Resolved::Host(h) => h,
                Resolved::Unknown(name) => {
                    unknown.extend(name);
                    None
                }
            };
            candidates.push(Candidate { group: g, index: i, host_ptr: c.hostPtr as usize, host });
        }
    }
    (candidates, unknown)
}

/// Per candidate: its rank ([`Verdict::rank`]: fits as it is, then only in a block for this
/// request's shape, then only after topod's moves, then in a pool, then unknown), or the pending reason (as
/// an offset) that removes it.
fn decide_all(
    m: &Module,
    cache: &topo_plugin_core::HostCache,
    req: &Request,
    memo_key: &str,
    candidates: &[Candidate],
) -> Vec<Result<u64, c_int>> {
    let reservations = m.shared.reservations.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = context(m, cache, &reservations);
    let known: Vec<HostId> = candidates.iter().filter_map(|c| c.host).collect();
    let ranks = m.memo.lock().unwrap_or_else(|e| e.into_inner()).ranks(&ctx, memo_key, req, &known);
    let mut ranks = ranks.into_iter();
    let fresh_from = topo_plugin_core::cache::fresh_from(ctx.now, ctx.stale_after);
    candidates
        .iter()
        .map(|c| match c.host {
            Some(h) => match ranks.next().filter(|&r| r != eval::NO_RANK) {
                Some(r) => Ok(r),
                None => {
                    if tracing::enabled!(tracing::Level::DEBUG) {
                        let peers = Claimant::peers_of(req);
                        if let Verdict::NoFit(why) = eval::evaluate(&ctx, h, req, peers) {
                            tracing::debug!(host = %cache.host(h).name, "does not fit: {why}");
                        }
                    }
                    Err(if cache.fetched_since(h, fresh_from) {
                        REASON_NO_FIT
                    } else {
                        REASON_UNKNOWN
                    })
                }
            },
            None => match ctx.unreachable {
                Unreachable::Open => Ok(UNKNOWN_SCORE),
                Unreachable::Closed => Err(REASON_UNKNOWN),
            },
        })
        .collect()
}

fn context<'a>(
    m: &Module,
    cache: &'a topo_plugin_core::HostCache,
    reservations: &'a topo_plugin_core::Reservations,
) -> Context<'a> {
    Context {
        cache,
        reservations,
        now: Instant::now(),
        epoch_s: eval::epoch_now(),
        stale_after: m.config.cache.stale_after(),
        unreachable: m.config.cache.unreachable,
    }
}

/// Removes the candidates `reason_of` gives a reason for, setting that reason. Each group is
/// walked from its end, so that removing a member never moves one not yet visited.
fn remove(
    m: &Module,
    reason: *mut c_void,
    candidates: &[Candidate],
    reason_of: impl Fn(usize) -> Option<c_int>,
) {
    for (i, c) in candidates.iter().enumerate().rev() {
        let Some(r) = reason_of(i) else { continue };
        // SAFETY: the group is live for this call and `index` is within it: members after it
        // may already be gone, but none before it.
        unsafe {
            let member = (*c.group).candHost.add(c.index);
            if !reason.is_null() {
                (m.api.reason_set)(reason, member, r);
            }
            (m.api.remove_host)(c.group, c.index as c_int);
        }
    }
}

unsafe extern "C" fn sort_fn(data: *mut c_void, list: *mut c_void, _reason: *mut c_void) -> c_int {
    guarded("sortFn", -1, || {
        let m = module()?;
        if data.is_null() || list.is_null() {
            return Err("sortFn called without handler data or candidates".into());
        }
        // SAFETY: `data` is the HandlerData newFn attached.
        let data = unsafe { &*(data as *const HandlerData) };
        // SAFETY: the scheduler's live candidate list.
        let groups = unsafe { groups(&m.api, list) };
        let kept = {
            let mut recent = RECENT.lock().unwrap_or_else(|e| e.into_inner());
            recent.iter().position(|r| r.0 == data.id).and_then(|i| recent.remove(i))
        };
        let scores = match (kept, &data.what) {
            // Taken: a requirement's scores live from its match to its sort.
            (Some((_, scores)), _) => scores,
            (None, What::Bad { .. }) => return Ok(0),
            (None, What::Request { request, memo_key }) => rescore(m, request, memo_key, &groups),
        };
        // Built only when the list is not the kept candidates in matchFn's order.
        let mut by_ptr: Option<HashMap<usize, u64>> = None;
        let mut offset = 0;
        for g in groups {
            // SAFETY: a live group; its members are reordered in place, none added or lost.
            let members = unsafe { members(g) };
            let same = scores
                .get(offset..offset + members.len())
                .filter(|s| s.iter().zip(members.iter()).all(|(s, c)| s.0 == c.hostPtr as usize));
            offset += members.len();
            let mut keyed: Vec<(u64, sys::candHost)> = match same {
                // The usual case: the scheduler removed what matchFn removed and kept the order.
                Some(s) => s.iter().zip(members.iter()).map(|(s, c)| (s.1, *c)).collect(),
                None => {
                    let map = by_ptr.get_or_insert_with(|| scores.iter().copied().collect());
                    members
                        .iter()
                        .map(|c| {
                            (map.get(&(c.hostPtr as usize)).copied().unwrap_or(UNKNOWN_SCORE), *c)
                        })
                        .collect()
                }
            };
            // Stable: equal scores keep the scheduler's order.
            keyed.sort_by_key(|k| k.0);
            for (slot, (_, c)) in members.iter_mut().zip(keyed) {
                *slot = c;
            }
        }
        Ok(0)
    })
}

/// The scores of the candidates in `groups` asked of the memo again, for a sort whose match's
/// scores [`RECENT`] no longer has; a candidate that no longer fits goes last.
fn rescore(
    m: &Module,
    request: &Request,
    memo_key: &str,
    groups: &[*mut sys::candHostGroup],
) -> Scores {
    let cache = m.shared.cache.load();
    let (candidates, _) = candidates_of(m, &cache, groups);
    let mut req = request.clone();
    req.tasks.get_or_insert(1);
    let verdicts = decide_all(m, &cache, &req, memo_key, &candidates);
    candidates.iter().zip(verdicts).map(|(c, v)| (c.host_ptr, v.unwrap_or(u64::MAX))).collect()
}

/// The first fields of `struct jobInfo` as LSF 6.x lays it out (its `lsb_get_jobinfo`);
/// `shared/reference/lsf-plugin-api.md`: the 9/10 struct inserts `indexRangeCnt` and three
/// index-range pointers after `jobIndex`.
#[repr(C)]
struct JobInfo6 {
    job_id: c_int,
    job_index: c_int,
    cluster: *mut c_char,
    user: *mut c_char,
    queue: *mut c_char,
    res_key: *mut c_char,
}

/// The first fields of `struct jobInfo` as LSF 9/10 lays it out.
#[repr(C)]
struct JobInfo10 {
    job_id: c_int,
    job_index: c_int,
    index_range_cnt: c_int,
    index_range_start: *mut c_int,
    index_range_end: *mut c_int,
    index_range_step: *mut c_int,
    cluster: *mut c_char,
    user: *mut c_char,
    queue: *mut c_char,
    res_key: *mut c_char,
}

/// The job behind a notify or check call.
struct JobOf {
    /// Its topod job id.
    id: String,
    /// Its request.
    request: Request,
    /// Its queue and owner, for the prime-time pools that admit them.
    admission: Admission,
}

/// The job behind a notify or check call: its topod job id, request, queue and owner.
fn job_of(api: &Api, job: *mut c_void) -> Result<Option<JobOf>, String> {
    if job.is_null() {
        return Err("called without a job".into());
    }
    // (id, index, resKey, queue, user)
    let (id, index, key, queue, user) =
        if let (Some(get), Some(free)) = (api.get_job_info, api.free_job_info) {
            let mut info = sys::jobInfo::default();
            // SAFETY: `job` is the scheduler's job; `info` is a zeroed struct of the header's layout.
            if unsafe { get(job, &mut info) } != 0 {
                return Err("extsched_getJobInfo failed".into());
            }
            // SAFETY: filled by the scheduler (each null or a C string); freed right after.
            let r = unsafe {
                (info.jobId, info.jobIndex, text(info.resKey), text(info.queue), text(info.user))
            };
            // SAFETY: what extsched_getJobInfo filled.
            unsafe { free(&mut info) };
            r
        } else if let Some(get) = api.get_job_info6 {
            // SAFETY: `job` is the scheduler's job; the result is its static buffer.
            let info = unsafe { get(job, sys::phase_PHASE_NOTIFY as c_int) };
            if info.is_null() {
                return Err("lsb_get_jobinfo returned nothing".into());
            }
            // A scheduler without extsched_getJobInfo is of the LSF 6.x generation, whose
            // lsb_get_jobinfo fills the 6.x struct jobInfo; one that has it (but not
            // extsched_freeJobInfo, so the module cannot use it) fills the 9/10 one. Each is read
            // with its own layout, whatever header the module was built with: 9/10 inserts four
            // index-range fields before `cluster`, which shifts `resKey`.
            if api.get_job_info.is_none() {
                let i = info.cast::<JobInfo6>();
                // SAFETY: the scheduler's buffer of at least the 6.x prefix read here, read before
                // any other call; each string null or a C string.
                unsafe {
                    let i = &*i;
                    (i.job_id, i.job_index, text(i.res_key), text(i.queue), text(i.user))
                }
            } else {
                let i = info.cast::<JobInfo10>();
                // SAFETY: as above, with the 9/10 prefix.
                unsafe {
                    let i = &*i;
                    (i.job_id, i.job_index, text(i.res_key), text(i.queue), text(i.user))
                }
            }
        } else {
            return Err("the scheduler has neither extsched_getJobInfo nor lsb_get_jobinfo".into());
        };
    let Some(key) = key else { return Ok(None) };
    match extsched::request_from_key(&key) {
        None => Ok(None),
        Some(Ok(request)) => Ok(Some(JobOf {
            id: extsched::job_id(id, index),
            request,
            admission: Admission::new(queue.as_deref(), user.as_deref().and_then(uid_of)),
        })),
        Some(Err(e)) => Err(format!("job {id}: {e}")),
    }
}

/// The uid of user `name` on the scheduler's host (the job's owner, as topod will see it on the
/// execution host when the site's users are the same everywhere); remembered, since a lookup
/// may go to a directory service. `None` when unknown.
fn uid_of(name: &str) -> Option<u32> {
    static KNOWN: Mutex<Option<HashMap<String, Option<u32>>>> = Mutex::new(None);
    /// Names remembered at most; then forgotten all at once.
    const MAX_USERS: usize = 4096;
    let mut known = KNOWN.lock().unwrap_or_else(|e| e.into_inner());
    let known = known.get_or_insert_with(HashMap::new);
    if let Some(&uid) = known.get(name) {
        return uid;
    }
    let uid = lookup_uid(name);
    if known.len() >= MAX_USERS {
        known.clear();
    }
    known.insert(name.to_string(), uid);
    uid
}

/// `getpwnam_r(3)`: the uid of user `name`, `None` when there is no such user or the lookup
/// fails.
fn lookup_uid(name: &str) -> Option<u32> {
    let name = CString::new(name).ok()?;
    let mut size = 16 * 1024;
    loop {
        let mut buf: Vec<c_char> = vec![0; size];
        // SAFETY: a struct of plain fields and pointers, all-zero is a valid value.
        let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::passwd = ptr::null_mut();
        // SAFETY: a NUL-terminated name, the struct, the buffer with its length and the result
        // pointer, all live for the call; the strings it sets point into `buf`, unread here.
        let rc = unsafe {
            libc::getpwnam_r(name.as_ptr(), &mut pwd, buf.as_mut_ptr(), buf.len(), &mut found)
        };
        if rc == libc::ERANGE && size < 1024 * 1024 {
            size *= 4;
            continue;
        }
        return (rc == 0 && !found.is_null()).then_some(pwd.pw_uid);
    }
}

/// Hosts and slots of an allocation.
fn hosts_of(api: &Api, alloc: *mut c_void) -> Result<Vec<(String, u32)>, String> {
    if alloc.is_null() {
        return Err("called without an allocation".into());
    }
    if let (Some(get), Some(free)) = (api.get_alloc, api.free_alloc) {
        let mut info: *mut sys::extsched_Alloc = ptr::null_mut();
        // SAFETY: `alloc` is the scheduler's; `info` is a valid out-pointer, freed below.
        if unsafe { get(alloc, &mut info) } != 0 || info.is_null() {
            return Err("extsched_getAlloc failed".into());
        }
        let mut owned = Vec::new();
        // SAFETY: `info` holds nInst pointers to instances with C strings.
        unsafe {
            for i in 0..(*info).nInst.max(0) as usize {
                let inst = *(*info).inst.add(i);
                if inst.is_null() {
                    continue;
                }
                owned.push((
                    text((*inst).host).unwrap_or_default(),
                    text((*inst).rsrc),
                    (*inst).amount,
                ));
            }
            free(&mut info);
        }
        tracing::debug!(instances = ?owned, "allocation");
        return Ok(extsched::slots_per_host(
            owned.iter().map(|(h, r, a)| (h.as_str(), r.as_deref(), *a)),
        ));
    }
    // The reference (shared/reference/lsf-plugin-api.md) documents the ownership of
    // extsched_getAlloc's result (the caller frees it with extsched_freeAlloc, done above), and
    // that is why it is preferred. It documents none for lsb_alloc_gethostslot (LSF 6.x, the only
    // allocation call there): the recipe it quotes only reads the array, and the one plug-in
    // seen freeing a hostSlot freed lsb_cand_getavailslot's, "observed in one plug-in only".
    // Freeing memory the scheduler may own (a static or an array inside the allocation, as the
    // test harness does) would corrupt mbschd's heap, whereas not freeing costs at most one
    // array per notification; so the array is read, copied and left to the scheduler.
    if let Some(get) = api.alloc_get_host_slot {
        let (mut count, mut group) = (0, ptr::null_mut());
        // SAFETY: `alloc` is the scheduler's; out-pointers are valid.
        let slots = unsafe { get(alloc, ptr::null_mut(), &mut count, &mut group) };
        if slots.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: `count` host slots from the scheduler.
        let slots = unsafe { std::slice::from_raw_parts(slots, count.max(0) as usize) };
        // SAFETY: each name is a C string or null.
        return Ok(slots
            .iter()
            .filter_map(|s| unsafe { text(s.name) }.map(|n| (n, s.nslotAlloc.max(0) as u32)))
            .collect());
    }
    Err("the scheduler has neither extsched_getAlloc nor lsb_alloc_gethostslot".into())
}

unsafe extern "C" fn notify_alloc_fn(
    _info: *mut c_void,
    job: *mut c_void,
    alloc: *mut c_void,
    _limits: *mut c_void,
    flag: c_int,
) -> c_int {
    guarded("notifyAllocFn", -1, || {
        let m = module()?;
        let Some(JobOf { id: job_id, request, admission }) = job_of(&m.api, job)? else {
            return Ok(0);
        };
        let flag = flag as u32;
        let mut reservations = m.shared.reservations.lock().unwrap_or_else(|e| e.into_inner());
        if flag & sys::NOTIFY_DEALLOC != 0 {
            let had = reservations.release(&job_id);
            tracing::info!(job = %job_id, had_reservation = had, "deallocated");
            return Ok(0);
        }
        if flag & (sys::NOTIFY_ALLOC | sys::NOTIFY_STARTUP) == 0 {
            return Ok(0);
        }
        let startup = flag & sys::NOTIFY_STARTUP != 0;
        let cache = m.shared.cache.load();
        let hosts = hosts_of(&m.api, alloc)?;
        for (host, slots) in hosts {
            let mut req = request.clone();
            req.tasks.get_or_insert(slots.max(1));
            // Never dropped: a host whose state is not known yet (NOTIFY_STARTUP replayed before
            // the first refresh, or a host not in the cache yet) keeps the dispatch pending until
            // the refresher brings its state; a job that does not fit still reserves CPUs.
            match reservations.dispatch_as(&cache, &job_id, admission, &host, &req, Instant::now())
            {
                Dispatched::Reserved(cpus) => {
                    tracing::info!(job = %job_id, %host, %cpus, startup, "reserved")
                }
                Dispatched::Squeezed(cpus, why) => {
                    tracing::warn!(job = %job_id, %host, %cpus, startup, "dispatched although it does not fit ({why}); its least CPU count is reserved")
                }
                Dispatched::AfterMoves(cpus) => {
                    tracing::info!(job = %job_id, %host, %cpus, startup, "fits only after the host's topod moves running jobs; its least CPU count is reserved")
                }
                Dispatched::Held => {
                    tracing::debug!(job = %job_id, %host, "topod already reports the job")
                }
                Dispatched::Pending => {
                    if cache.lookup(&host).is_none() && !m.config.cache.address_template.is_empty()
                    {
                        m.shared
                            .discovered
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(host.clone());
                    }
                    tracing::info!(job = %job_id, %host, startup, "host state not known yet; reserved when it arrives")
                }
            }
        }
        Ok(0)
    })
}

unsafe extern "C" fn check_alloc_fn(
    _info: *mut c_void,
    job: *mut c_void,
    alloc: *mut c_void,
    limits: *mut c_void,
) -> c_int {
    guarded("checkAllocFn", -1, || {
        let m = module()?;
        let Some(JobOf { id: job_id, request, admission }) = job_of(&m.api, job)? else {
            return Ok(0);
        };
        let hosts = hosts_of(&m.api, alloc)?;
        let cache = m.shared.cache.load();
        let reservations = m.shared.reservations.lock().unwrap_or_else(|e| e.into_inner());
        let ctx = context(m, &cache, &reservations);
        for (host, slots) in hosts {
            let Some(h) = cache.lookup(&host) else { continue };
            if reservations.of_job(&job_id).iter().any(|r| r.host == h) {
                continue;
            }
            let mut req = request.clone();
            req.tasks.get_or_insert(slots.max(1));
            // This job's own blocks only: matchFn counted a block for the request's shape as the
            // peers', and this may be another peer than the one it is for; and the pools that
            // admit its queue or owner only (matchFn kept a host where the peers fit only in an
            // open pool). A host where it fits only after moves, or in a pool that may admit it
            // by name, is left to topod, as matchFn kept it.
            let who = Claimant::job_of(&job_id, admission);
            let Verdict::NoFit(why) = eval::evaluate(&ctx, h, &req, who) else { continue };
            if matches!(why, NoFit::Unknown(_))
                && m.config.cache.unreachable == Unreachable::Open
                && cache.status(h).asked()
            {
                continue;
            }
            let max = eval::max_tasks(&ctx, h, &request, who, slots.saturating_sub(1));
            // Capped: a request's CPU_LIST of thousands of CPUs made it hundreds of KB (attack).
            let detail = crate::extsched::capped(format!(
                "topo: {host} can no longer hold {slots} task(s) of {request}: {why}"
            ));
            tracing::info!(job = %job_id, max_tasks = max, "{detail}");
            let Some(add) = m.api.add_alloc_limit else {
                tracing::warn!(
                    "the scheduler has no extsched_addAllocLimit; cannot limit the allocation"
                );
                continue;
            };
            let (host_c, detail_c) = (
                CString::new(host.replace('\0', "")).map_err(|e| e.to_string())?,
                CString::new(detail.replace('\0', "")).map_err(|e| e.to_string())?,
            );
            // SAFETY: the scheduler's limit list and allocation for this call; the strings are
            // copied by the scheduler.
            unsafe {
                add(
                    limits,
                    alloc,
                    host_c.as_ptr() as *mut c_char,
                    max as c_int,
                    m.config.lsf.reason_base + REASON_CHANGED,
                    detail_c.as_ptr() as *mut c_char,
                    m.config.lsf.handler_id,
                    0,
                )
            };
        }
        Ok(0)
    })
}
