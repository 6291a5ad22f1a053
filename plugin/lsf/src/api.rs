//! The scheduler's functions the module calls, resolved once at load time from the process
//! that loaded it: the LSF 9/10 `extsched_*` name where the scheduler has it, else the 6.x
//! `lsb_*` one. Nothing here is linked, so the module loads into either.

use std::os::raw::{c_char, c_int, c_void};
use topo_lsf_sys as sys;

type GetNextGroup = unsafe extern "C" fn(*mut c_void) -> *mut sys::candHostGroup;
type RemoveHost = unsafe extern "C" fn(*mut sys::candHostGroup, c_int);
type GetAvailSlot = unsafe extern "C" fn(*mut sys::candHost) -> *mut sys::hostSlot;
type GetHostId = unsafe extern "C" fn(*mut c_void, *mut *mut c_char, *mut *mut c_char) -> c_int;
type ReasonSet = unsafe extern "C" fn(*mut c_void, *mut sys::candHost, c_int) -> c_int;
type SetMainReason = unsafe extern "C" fn(*mut c_void, *mut c_char, c_int) -> c_int;
type RegisterHandler = unsafe extern "C" fn(c_int, *mut sys::RsrcReqHandlerType) -> c_int;
type SetObject = unsafe extern "C" fn(*mut c_void, c_int, *mut c_char, *mut c_void);
type GetExtResReq = unsafe extern "C" fn(*mut c_void, *mut c_int) -> *mut *mut c_char;
type GetQueExtsched =
    unsafe extern "C" fn(*mut c_void, *mut *mut c_char, *mut *mut c_char) -> c_int;
type GetJobInfo = unsafe extern "C" fn(*mut c_void, *mut sys::jobInfo) -> c_int;
type FreeJobInfo = unsafe extern "C" fn(*mut sys::jobInfo);
type GetJobInfo6 = unsafe extern "C" fn(*mut c_void, c_int) -> *mut sys::jobInfo;
type GetAlloc = unsafe extern "C" fn(*mut c_void, *mut *mut sys::extsched_Alloc) -> c_int;
type FreeAlloc = unsafe extern "C" fn(*mut *mut sys::extsched_Alloc);
type AllocGetHostSlot = unsafe extern "C" fn(
    *mut c_void,
    *mut c_void,
    *mut c_int,
    *mut *mut sys::candHostGroup,
) -> *mut sys::hostSlot;
type AddAllocLimit = unsafe extern "C" fn(
    *mut c_void,
    *mut c_void,
    *mut c_char,
    c_int,
    c_int,
    *mut c_char,
    c_int,
    c_int,
) -> c_int;

/// Which generation of the interface the scheduler speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    /// LSF 9/10: `extsched_*`.
    Extsched,
    /// LSF 6.x (or a 9/10 scheduler without the new names): `lsb_*`.
    Lsb,
}

/// The resolved functions. Those every scheduler has are plain; the rest are optional and the
/// module does without them.
#[derive(Clone, Copy)]
pub struct Api {
    pub flavour: Flavour,
    pub register_handler: RegisterHandler,
    pub set_object: SetObject,
    pub get_ext_res_req: GetExtResReq,
    pub get_que_extsched: Option<GetQueExtsched>,
    pub get_next_group: GetNextGroup,
    pub remove_host: RemoveHost,
    pub get_avail_slot: GetAvailSlot,
    /// `extsched_getHostID` (LSF 9/10): a host pointer's name and cluster, both the caller's
    /// to free.
    pub get_host_id: Option<GetHostId>,
    pub reason_set: ReasonSet,
    pub set_main_reason: Option<SetMainReason>,
    pub get_job_info: Option<GetJobInfo>,
    pub free_job_info: Option<FreeJobInfo>,
    pub get_job_info6: Option<GetJobInfo6>,
    pub get_alloc: Option<GetAlloc>,
    pub free_alloc: Option<FreeAlloc>,
    pub alloc_get_host_slot: Option<AllocGetHostSlot>,
    pub add_alloc_limit: Option<AddAllocLimit>,
}

/// What the scheduler lacks.
#[derive(Debug, thiserror::Error)]
#[error(
    "the scheduler that loaded schmod_topo exports neither {new} nor {old}; is this LSF's mbschd?"
)]
pub struct Missing {
    new: &'static str,
    old: &'static str,
}

fn need<T>(f: Option<T>, new: &'static str, old: &'static str) -> Result<T, Missing> {
    f.ok_or(Missing { new, old })
}

fn pick<T: Copy>(
    new: &Result<T, libloading::Error>,
    old: &Result<T, libloading::Error>,
) -> Option<T> {
    new.as_ref().ok().or(old.as_ref().ok()).copied()
}

impl Api {
    /// Resolves the functions from the loading process.
    pub fn resolve() -> Result<Api, String> {
        let this: libloading::Library = libloading::os::unix::Library::this().into();
        // SAFETY: the library handle is the running process itself; bindgen's loader only looks
        // symbols up (dlsym) and keeps the handle, which stays valid for the life of the process.
        let lib = unsafe { sys::LsfApi::from_library(this) }
            .map_err(|e| format!("cannot look up the scheduler's functions: {e}"))?;
        let r = || -> Result<Api, Missing> {
            Ok(Api {
                flavour: if lib.extsched_resreq_registerhandler.is_ok() {
                    Flavour::Extsched
                } else {
                    Flavour::Lsb
                },
                register_handler: need(
                    pick(&lib.extsched_resreq_registerhandler, &lib.lsb_resreq_registerhandler),
                    "extsched_resreq_registerhandler",
                    "lsb_resreq_registerhandler",
                )?,
                set_object: need(
                    pick(&lib.extsched_resreq_setobject, &lib.lsb_resreq_setobject),
                    "extsched_resreq_setobject",
                    "lsb_resreq_setobject",
                )?,
                get_ext_res_req: need(
                    pick(&lib.extsched_resreq_getextresreq, &lib.lsb_resreq_getextresreq),
                    "extsched_resreq_getextresreq",
                    "lsb_resreq_getextresreq",
                )?,
                get_que_extsched: pick(
                    &lib.extsched_resreq_getqueextsched,
                    &lib.lsb_resreq_getqueextsched,
                ),
                get_next_group: need(
                    pick(&lib.extsched_cand_getnextgroup, &lib.lsb_cand_getnextgroup),
                    "extsched_cand_getnextgroup",
                    "lsb_cand_getnextgroup",
                )?,
                remove_host: need(
                    pick(&lib.extsched_cand_removehost, &lib.lsb_cand_removehost),
                    "extsched_cand_removehost",
                    "lsb_cand_removehost",
                )?,
                get_avail_slot: need(
                    pick(&lib.extsched_cand_getavailslot, &lib.lsb_cand_getavailslot),
                    "extsched_cand_getavailslot",
                    "lsb_cand_getavailslot",
                )?,
                get_host_id: lib.extsched_getHostID.as_ref().ok().copied(),
                reason_set: need(
                    pick(&lib.extsched_reason_set, &lib.lsb_reason_set),
                    "extsched_reason_set",
                    "lsb_reason_set",
                )?,
                set_main_reason: lib.extsched_setMainReason.as_ref().ok().copied(),
                get_job_info: lib.extsched_getJobInfo.as_ref().ok().copied(),
                free_job_info: lib.extsched_freeJobInfo.as_ref().ok().copied(),
                get_job_info6: lib.lsb_get_jobinfo.as_ref().ok().copied(),
                get_alloc: lib.extsched_getAlloc.as_ref().ok().copied(),
                free_alloc: lib.extsched_freeAlloc.as_ref().ok().copied(),
                alloc_get_host_slot: lib.lsb_alloc_gethostslot.as_ref().ok().copied(),
                add_alloc_limit: lib.extsched_addAllocLimit.as_ref().ok().copied(),
            })
        };
        r().map_err(|e| e.to_string())
    }
}
