//! The scheduler's hosts as the cache's: each candidate's host pointer is resolved to a cache
//! host once (per `sched_init`, and again only when the cache's names change), so a match reads
//! no host name and hashes none; it looks each candidate up by LSF's host index.
//!
//! **Who frees the name.** The reference (`shared/reference/lsf-plugin-api.md`, appendix)
//! documents `extsched_getHostID(hostPtr, &hostname, &clustername)` as "caller frees both", so
//! where the scheduler has it (LSF 9/10) the module asks it and frees both strings with the C
//! library's `free`. `lsb_cand_getavailslot` (the only way on 6.x) has no documented ownership:
//! its `hostSlot` is read and left to the scheduler (freeing memory the scheduler owns would
//! corrupt its heap; one plug-in was seen freeing it, which the reference does not confirm), and
//! since a host is resolved once, what that could leave behind is one slot per host per
//! `sched_init`, never one per candidate per match.

use crate::api::Api;
use std::collections::HashMap;
use std::ffi::CStr;
use std::os::raw::{c_char, c_void};
use std::ptr;
use topo_lsf_sys as sys;
use topo_plugin_core::cache::{HostCache, HostId};

extern "C" {
    /// The C library's `free`, for what `extsched_getHostID` hands its caller.
    fn free(p: *mut c_void);
}

/// Host indexes below this are kept in a flat table; others (and negative ones) in a map.
const FLAT_LIMIT: usize = 1 << 20;
/// A slot for a host pointer no cache host has.
const NO_HOST: HostId = HostId::MAX;

/// What a host pointer was resolved to, and for which names of the cache.
#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    /// The host pointer (0: empty slot).
    ptr: usize,
    /// [`HostCache::names_version`] when resolved (truncated: only compared for equality).
    names_version: u32,
    /// The cache host, or [`NO_HOST`].
    id: HostId,
}

/// Host pointers resolved to cache hosts.
#[derive(Debug, Default)]
pub struct HostIndex {
    flat: Vec<Slot>,
    other: HashMap<usize, Slot>,
    /// How many host pointers were resolved (names read from the scheduler).
    pub resolved: u64,
}

/// A candidate's host: the cache host, or the name no cache host has (when it could be read).
pub enum Resolved {
    /// Remembered or found.
    Host(Option<HostId>),
    /// Just resolved to no cache host: this name (to fetch it, when a template allows).
    Unknown(Option<String>),
}

impl HostIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// The cache host of candidate `c`, from the index, or resolved by reading its name from
    /// the scheduler (once per host pointer and change of the cache's names).
    ///
    /// SAFETY (for callers): `c` is a live candidate of the scheduler for this call.
    #[inline]
    pub unsafe fn resolve(&mut self, api: &Api, cache: &HostCache, c: &sys::candHost) -> Resolved {
        // The usual case, once per candidate of every match: the host's slot in the flat
        // table, resolved before under the same names (a few instructions, inlined).
        let ptr = c.hostPtr as usize;
        if let Some(slot) = usize::try_from(c.hostIdx).ok().and_then(|i| self.flat.get(i)) {
            if ptr != 0 && slot.ptr == ptr && slot.names_version == cache.names_version() as u32 {
                return Resolved::Host((slot.id != NO_HOST).then_some(slot.id));
            }
        }
        // SAFETY: guaranteed by the caller.
        unsafe { self.resolve_slow(api, cache, c) }
    }

    /// [`resolve`](Self::resolve) for a host pointer not in the flat table under the cache's
    /// names: a new slot, an index beyond the table, a name read from the scheduler.
    ///
    /// SAFETY (for callers): `c` is a live candidate of the scheduler for this call.
    #[cold]
    #[inline(never)]
    unsafe fn resolve_slow(&mut self, api: &Api, cache: &HostCache, c: &sys::candHost) -> Resolved {
        let ptr = c.hostPtr as usize;
        let version = cache.names_version() as u32;
        let slot = match usize::try_from(c.hostIdx) {
            Ok(i) if i < FLAT_LIMIT => {
                if self.flat.len() <= i {
                    self.flat.resize(i + 1, Slot::default());
                }
                &mut self.flat[i]
            }
            _ => self.other.entry(ptr).or_default(),
        };
        if ptr != 0 && slot.ptr == ptr && slot.names_version == version {
            return Resolved::Host((slot.id != NO_HOST).then_some(slot.id));
        }
        self.resolved += 1;
        // SAFETY: guaranteed by the caller.
        let name = unsafe { host_name(api, c) };
        let id = name.as_deref().and_then(|n| cache.lookup(n));
        *slot = Slot { ptr, names_version: version, id: id.unwrap_or(NO_HOST) };
        match id {
            Some(h) => Resolved::Host(Some(h)),
            None => Resolved::Unknown(name),
        }
    }
}

/// The name of candidate `c`'s host: from `extsched_getHostID` (its strings freed here, as
/// documented), else from the candidate's slot (which the scheduler keeps).
///
/// SAFETY (for callers): `c` is a live candidate of the scheduler for this call.
unsafe fn host_name(api: &Api, c: &sys::candHost) -> Option<String> {
    if let (Some(get), false) = (api.get_host_id, c.hostPtr.is_null()) {
        let (mut name, mut cluster): (*mut c_char, *mut c_char) =
            (ptr::null_mut(), ptr::null_mut());
        // SAFETY: a live host pointer of the scheduler and two valid out-pointers that start
        // null; whatever they point to afterwards is ours to free.
        unsafe { get(c.hostPtr, &mut name, &mut cluster) };
        // SAFETY: null or a NUL-terminated string the scheduler allocated for us.
        let text = (!name.is_null())
            .then(|| unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned());
        // SAFETY: "caller frees both" (the reference's appendix); free(NULL) does nothing.
        unsafe {
            free(name.cast());
            free(cluster.cast());
        }
        if text.is_some() {
            return text;
        }
    }
    // SAFETY: a live candidate; the slot and its name are the scheduler's, read during this call.
    unsafe {
        let slot = (api.get_avail_slot)(ptr::from_ref(c).cast_mut());
        if slot.is_null() || (*slot).name.is_null() {
            return None;
        }
        Some(CStr::from_ptr((*slot).name).to_string_lossy().into_owned())
    }
}
