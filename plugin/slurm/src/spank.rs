//! The SPANK side: the symbols Slurm looks up, the callbacks, and the few SPANK functions used.
//!
//! The declarations are written from `<slurm/spank.h>` (Slurm 22.05); the functions are resolved
//! when Slurm loads the module, from the Slurm process itself, so the module is not linked
//! against libslurm. Item numbers and `plugin_version` come from the installed headers (build.rs).
//!
//! Rules kept here, because this code runs inside srun, sbatch and slurmstepd:
//! - every callback runs inside [`guarded`]: a panic becomes an error return and a log line,
//!   never an unwind into C;
//! - no threads, and no lock held when a callback returns (slurmstepd forks the tasks between
//!   callbacks); state set before the fork is read by the task children without locking;
//! - everything that can fail returns a message that names what and where.

use crate::args::{self, Args, Mode};
use crate::{cores, need, plan};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Mutex, OnceLock};
use topo_client::{Client, ClientError, Joined};
use topo_core::ledger::Allocation;
use topo_core::proto::{ErrorCode, Op};
use topo_core::topology::Topology;
use topo_core::CpuSet;
use topo_ffi_guard::Caught;

include!(concat!(env!("OUT_DIR"), "/slurm_abi.rs"));

/// Slurm's opaque handle.
#[repr(C)]
pub struct SpankHandle {
    _private: [u8; 0],
}
type Spank = *mut SpankHandle;
type OptionCallback = extern "C" fn(val: c_int, optarg: *const c_char, remote: c_int) -> c_int;

/// `struct spank_option`.
#[repr(C)]
struct SpankOption {
    name: *const c_char,
    arginfo: *const c_char,
    usage: *const c_char,
    has_arg: c_int,
    val: c_int,
    cb: Option<OptionCallback>,
}

const ESPANK_SUCCESS: c_int = 0;
const S_CTX_LOCAL: c_int = 1;
const S_CTX_REMOTE: c_int = 2;
const S_CTX_ALLOCATOR: c_int = 3;
const S_CTX_JOB_SCRIPT: c_int = 5;

extern "C" {
    fn spank_context() -> c_int;
    fn spank_option_register(sp: Spank, opt: *mut SpankOption) -> c_int;
    fn spank_option_getopt(sp: Spank, opt: *mut SpankOption, optarg: *mut *mut c_char) -> c_int;
    fn spank_get_item(sp: Spank, item: c_int, ...) -> c_int;
    fn spank_setenv(sp: Spank, var: *const c_char, val: *const c_char, overwrite: c_int) -> c_int;
    fn spank_getenv(sp: Spank, var: *const c_char, buf: *mut c_char, len: c_int) -> c_int;
    fn spank_job_control_setenv(
        sp: Spank,
        var: *const c_char,
        val: *const c_char,
        overwrite: c_int,
    ) -> c_int;
    fn slurm_error(fmt: *const c_char, ...);
    fn slurm_info(fmt: *const c_char, ...);
    fn slurm_verbose(fmt: *const c_char, ...);
}

#[cfg(slurm_api)]
extern "C" {
    // src/slurm_jobs.c, built against the installed slurm.h.
    fn topo_slurm_job_state(job_id: u32, state: *mut u32) -> c_int;
    fn topo_slurm_job_partition(job_id: u32, buf: *mut c_char, len: usize) -> c_int;
    fn topo_slurm_strerror(e: c_int) -> *const c_char;
}

/// Slurm's text for one of its errnos.
#[cfg(slurm_api)]
fn slurm_error_text(rc: c_int) -> String {
    // SAFETY: slurm_strerror returns a static NUL-terminated string for any errno.
    unsafe { topo_slurm_strerror(rc).as_ref().map(|p| CStr::from_ptr(p)) }
        .map(|t| t.to_string_lossy().into_owned())
        .unwrap_or_else(|| format!("Slurm error {rc}"))
}

/// The partition slurmctld runs job `job_id` in (one `slurm_load_job` RPC); `None` when its
/// record names none.
#[cfg(slurm_api)]
fn slurm_job_partition(job_id: u32) -> Result<Option<String>, String> {
    let mut buf = vec![0 as c_char; topo_core::proto::MAX_NAME_BYTES + 1];
    // SAFETY: a writable buffer of the length given; the C function writes a NUL-terminated
    // string into it, within that length, or returns an error.
    let rc = unsafe { topo_slurm_job_partition(job_id, buf.as_mut_ptr(), buf.len()) };
    if rc != 0 {
        return Err(format!(
            "cannot ask slurmctld for job {job_id}'s partition: {}",
            slurm_error_text(rc)
        ));
    }
    // SAFETY: on success the buffer holds a NUL-terminated string.
    let name = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned();
    Ok(Some(name).filter(|n| !n.is_empty()))
}

#[cfg(not(slurm_api))]
fn slurm_job_partition(job_id: u32) -> Result<Option<String>, String> {
    Err(format!("cannot ask slurmctld for job {job_id}'s partition: built without Slurm's headers"))
}

/// slurmctld's state of Slurm job `job_id` (one `slurm_load_job` RPC).
#[cfg(slurm_api)]
fn slurm_job_state(job_id: u32) -> Result<plan::SlurmState, String> {
    let mut state: u32 = 0;
    // SAFETY: a valid out-pointer; the C function writes it only on success.
    let rc = unsafe { topo_slurm_job_state(job_id, &mut state) };
    if rc != 0 {
        return Err(format!(
            "cannot ask slurmctld for job {job_id}'s state: {}",
            slurm_error_text(rc)
        ));
    }
    Ok(match state {
        1 => plan::SlurmState::Running,
        2 => plan::SlurmState::Suspended,
        3 => plan::SlurmState::Gone,
        _ => plan::SlurmState::Other,
    })
}

#[cfg(not(slurm_api))]
fn slurm_job_state(job_id: u32) -> Result<plan::SlurmState, String> {
    Err(format!("cannot ask slurmctld for job {job_id}'s state: built without Slurm's headers"))
}

/// What slurmctld says of the Slurm jobs topod holds on this job's cores.
#[derive(Default)]
struct SlurmSide {
    /// Their states and this job's, for topod to follow (`None`: no other job holds them, and
    /// slurmctld was not asked).
    view: Option<topo_core::proto::BatchView>,
    /// slurmctld has this job suspended as it starts (gang scheduling).
    starts_suspended: bool,
    /// Jobs slurmctld does not know (named if topod refuses).
    unknown: Vec<String>,
}

/// When Slurm gave this job cores that topod holds for other Slurm jobs, Slurm time-shares
/// them (it suspended those jobs, or gang-schedules them with this one): slurmctld's states of
/// those jobs and of this one, for topod to follow. A job slurmctld cannot tell about is left
/// out, said in the log.
fn what_slurm_did(
    topod: &mut Client,
    job_id: u32,
    job_cpus: &CpuSet,
) -> Result<SlurmSide, ClientError> {
    let held = topod.list()?;
    let sharing = plan::sharing_jobs(
        held.iter().map(|v| (v.allocation.job.as_str(), &v.allocation.cpus)),
        job_id,
        job_cpus,
    );
    if sharing.is_empty() {
        return Ok(SlurmSide::default());
    }
    let mut side = SlurmSide::default();
    let mut states = Vec::new();
    for n in sharing {
        match slurm_job_state(n) {
            Ok(plan::SlurmState::Gone) => side.unknown.push(plan::topod_job_id(n)),
            Ok(s) => states.push((n, s)),
            Err(e) => log_error(&format!("job {job_id}: {e}; topod keeps it as it is")),
        }
    }
    // This job too: a later step of a job topod holds as suspended by Slurm runs only once
    // Slurm runs the job again, which topod then follows.
    match slurm_job_state(job_id) {
        Ok(s) => {
            states.push((job_id, s));
            side.starts_suspended = s == plan::SlurmState::Suspended;
        }
        Err(e) => log_error(&format!("job {job_id}: {e}; taken as running")),
    }
    side.view = Some(plan::batch_view(&states));
    Ok(side)
}

// The symbols Slurm's plugin loader checks (`plugin_version`'s major.minor must match Slurm's).
#[no_mangle]
#[used]
pub static plugin_name: [u8; 5] = *b"topo\0";
#[no_mangle]
#[used]
pub static plugin_type: [u8; 6] = *b"spank\0";
#[no_mangle]
#[used]
pub static plugin_version: u32 = SLURM_VERSION_NUMBER;
#[no_mangle]
#[used]
pub static spank_plugin_version: u32 = SLURM_VERSION_NUMBER;

/// The option table Slurm keeps a pointer to.
struct OptionTable(std::cell::UnsafeCell<SpankOption>);
// SAFETY: the table is written only by Slurm's option code, which runs on one thread per process;
// Rust never reads or writes it, it only hands Slurm the pointer.
unsafe impl Sync for OptionTable {}

static TOPOLOGY_OPTION: OptionTable = OptionTable(std::cell::UnsafeCell::new(SpankOption {
    name: c"topology".as_ptr(),
    arginfo: c"REQUEST".as_ptr(),
    usage: c"Place the job's tasks with topod, e.g. 'affinity[core(2,same=numa)*4]'".as_ptr(),
    has_arg: 1,
    val: 0,
    cb: Some(topology_option),
}));

/// Plugstack arguments (set in `slurm_spank_init`).
static ARGS: OnceLock<Args> = OnceLock::new();
/// `--topology`'s value, as the option callback saw it.
static REQUEST: Mutex<Option<String>> = Mutex::new(None);
/// What topod gave this job (slurmstepd, set before the tasks are forked).
static GRANT: OnceLock<Grant> = OnceLock::new();
/// Why slurmstepd could not get the allocation: the tasks fail with it, where the user sees it.
static GRANT_ERROR: OnceLock<String> = OnceLock::new();
/// This task's CPUs and how it is confined (in the forked task child only).
static TASK: OnceLock<(CpuSet, Mode)> = OnceLock::new();

/// What topod gave the job, and the step's own CPUs.
#[derive(Debug, Clone)]
struct Grant {
    alloc: Allocation,
    step_cpus: CpuSet,
    /// slurmctld had the job suspended when it started here (gang scheduling put it in a row
    /// that is not running): its tasks wait until slurmctld runs it ([`wait_until_running`]).
    started_suspended: bool,
}

fn log_error(msg: &str) {
    let text = CString::new(format!("topo: {msg}").replace('\0', " ")).unwrap_or_default();
    // SAFETY: a constant "%s" format with one valid NUL-terminated string argument.
    unsafe { slurm_error(c"%s".as_ptr(), text.as_ptr()) }
}

fn log_info(msg: &str) {
    let text = CString::new(format!("topo: {msg}").replace('\0', " ")).unwrap_or_default();
    // SAFETY: as in log_error.
    unsafe { slurm_info(c"%s".as_ptr(), text.as_ptr()) }
}

fn log_verbose(msg: &str) {
    let text = CString::new(format!("topo: {msg}").replace('\0', " ")).unwrap_or_default();
    // SAFETY: as in log_error.
    unsafe { slurm_verbose(c"%s".as_ptr(), text.as_ptr()) }
}

/// Why a callback fails.
enum Failure {
    /// With this message, logged.
    Say(String),
    /// Without a line of its own: the reason was said once already (see
    /// [`slurm_spank_task_init_privileged`]), and Slurm logs each failed callback itself.
    Quiet,
}

impl From<String> for Failure {
    fn from(msg: String) -> Failure {
        Failure::Say(msg)
    }
}

impl From<&str> for Failure {
    fn from(msg: &str) -> Failure {
        Failure::Say(msg.to_string())
    }
}

/// Runs a callback body: errors and panics are logged and become -1 (Slurm fails the step or
/// refuses the submission); nothing unwinds into Slurm.
///
/// In the task callbacks (the task's own process) Slurm's logger also writes to the task's
/// stderr, so the user sees the message (srun's terminal, the batch job's output file).
fn guarded(callback: &str, body: impl FnOnce() -> Result<(), Failure>) -> c_int {
    match topo_ffi_guard::catch(body) {
        Ok(()) => 0,
        Err(Caught::Error(Failure::Say(msg))) => {
            log_error(&msg);
            -1
        }
        Err(Caught::Error(Failure::Quiet)) => -1,
        Err(Caught::Panic(what)) => {
            log_error(&format!("internal error in {callback}: {what}"));
            -1
        }
    }
}

fn context() -> c_int {
    // SAFETY: spank_context takes no argument and only reads Slurm's state.
    unsafe { spank_context() }
}

fn args() -> &'static Args {
    ARGS.get_or_init(Args::default)
}

/// The plugstack arguments, parsed on the first callback of this process. Every callback gets
/// them: the job prolog/epilog process sees no `slurm_spank_init`.
fn load_args(ac: c_int, av: *mut *mut c_char) -> Result<&'static Args, String> {
    if let Some(a) = ARGS.get() {
        return Ok(a);
    }
    // SAFETY: Slurm's contract for every callback: `av` holds `ac` C strings.
    let parsed = Args::parse(unsafe { words(ac, av) }).map_err(|e| e.to_string())?;
    Ok(ARGS.get_or_init(|| parsed))
}

/// The plugstack.conf words after the plug-in path.
///
/// # Safety
/// `av` must hold `ac` valid C strings (Slurm's contract for every callback).
unsafe fn words<'a>(ac: c_int, av: *mut *mut c_char) -> Vec<&'a str> {
    if av.is_null() {
        return Vec::new();
    }
    (0..usize::try_from(ac).unwrap_or(0))
        // SAFETY: the caller guarantees `ac` readable pointers to NUL-terminated strings.
        .filter_map(|i| unsafe { (*av.add(i)).as_ref() })
        // SAFETY: as above.
        .filter_map(|p| unsafe { CStr::from_ptr(p) }.to_str().ok())
        .collect()
}

fn item_u32(sp: Spank, item: c_int, name: &str) -> Result<u32, String> {
    let mut value: u32 = 0;
    // SAFETY: these items take one `uint32_t *` (uid_t is u32 on Linux) per spank.h.
    let rc = unsafe { spank_get_item(sp, item, &mut value as *mut u32) };
    if rc == ESPANK_SUCCESS {
        Ok(value)
    } else {
        Err(format!("Slurm did not give {name} (spank error {rc})"))
    }
}

fn item_int(sp: Spank, item: c_int, name: &str) -> Result<i32, String> {
    let mut value: c_int = 0;
    // SAFETY: S_TASK_ID takes one `int *`.
    let rc = unsafe { spank_get_item(sp, item, &mut value as *mut c_int) };
    if rc == ESPANK_SUCCESS {
        Ok(value)
    } else {
        Err(format!("Slurm did not give {name} (spank error {rc})"))
    }
}

fn item_u64(sp: Spank, item: c_int, name: &str) -> Result<u64, String> {
    let mut value: u64 = 0;
    // SAFETY: S_JOB_ALLOC_MEM takes one `uint64_t *`.
    let rc = unsafe { spank_get_item(sp, item, &mut value as *mut u64) };
    if rc == ESPANK_SUCCESS {
        Ok(value)
    } else {
        Err(format!("Slurm did not give {name} (spank error {rc})"))
    }
}

fn item_string(sp: Spank, item: c_int, name: &str) -> Result<String, String> {
    let mut value: *const c_char = std::ptr::null();
    // SAFETY: the core-list items take one `char **`; Slurm keeps ownership of the string.
    let rc = unsafe { spank_get_item(sp, item, &mut value as *mut *const c_char) };
    if rc != ESPANK_SUCCESS || value.is_null() {
        return Err(format!("Slurm did not give {name} (spank error {rc})"));
    }
    // SAFETY: Slurm returned a NUL-terminated string that lives as long as the step.
    Ok(unsafe { CStr::from_ptr(value) }.to_string_lossy().into_owned())
}

/// `--topology`'s value: from the option callback, else asked of Slurm (the batch step and the
/// epilog read it from the job environment).
fn requested(sp: Spank) -> Option<String> {
    if let Some(r) = REQUEST.lock().unwrap_or_else(|e| e.into_inner()).clone() {
        return Some(r);
    }
    let mut value: *mut c_char = std::ptr::null_mut();
    // SAFETY: the registered option table and an out-pointer; Slurm keeps ownership of the value.
    let rc = unsafe { spank_option_getopt(sp, TOPOLOGY_OPTION.0.get(), &mut value) };
    if rc != ESPANK_SUCCESS || value.is_null() {
        return None;
    }
    // SAFETY: Slurm returned a NUL-terminated string.
    let text = unsafe { CStr::from_ptr(value) }.to_string_lossy().into_owned();
    Some(text).filter(|t| !t.is_empty())
}

/// A variable of the job's environment (remote context only), if set and shorter than 64 KiB
/// (the longest line topod reads).
fn job_env(sp: Spank, name: &str) -> Option<String> {
    let n = CString::new(name).ok()?;
    let mut buf = vec![0 as c_char; topo_core::proto::MAX_LINE_BYTES];
    // SAFETY: a valid C string and a writable buffer of the length given; spank_getenv writes
    // a NUL-terminated value into it or fails (ESPANK_ENV_NOEXIST, ESPANK_NOSPACE).
    let rc = unsafe { spank_getenv(sp, n.as_ptr(), buf.as_mut_ptr(), buf.len() as c_int) };
    if rc != ESPANK_SUCCESS {
        return None;
    }
    // SAFETY: on success the buffer holds a NUL-terminated string.
    let value = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned();
    Some(value).filter(|v| !v.is_empty())
}

fn set_task_env(sp: Spank, name: &str, value: &str) -> Result<(), String> {
    let (n, v) = (CString::new(name).unwrap_or_default(), CString::new(value).unwrap_or_default());
    // SAFETY: two valid C strings; spank_setenv copies them.
    let rc = unsafe { spank_setenv(sp, n.as_ptr(), v.as_ptr(), 1) };
    if rc == ESPANK_SUCCESS {
        Ok(())
    } else {
        Err(format!("cannot set {name} in the task environment (spank error {rc})"))
    }
}

/// Narrows the calling process's CPU affinity to `cpus` (the kernel intersects it with the
/// cgroup's CPUs; an empty result is refused, so the task is never left without a CPU).
fn set_affinity(cpus: &CpuSet) -> Result<(), String> {
    let words = cpus.last().map_or(1, |l| l as usize / 64 + 1);
    let mut mask = vec![0u64; words];
    for c in cpus.iter() {
        mask[c as usize / 64] |= 1 << (c % 64);
    }
    // SAFETY: pid 0 is the caller; the mask is `words * 8` readable bytes.
    let rc = unsafe {
        libc::syscall(libc::SYS_sched_setaffinity, 0, words * 8, mask.as_ptr() as *const c_void)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("cannot bind the task to CPUs {cpus}: {}", std::io::Error::last_os_error()))
    }
}

/// Option callback: in srun/sbatch/salloc (`remote == 0`) the request is checked with the
/// placement core's parser, and a bad one refuses the submission with the parse error.
extern "C" fn topology_option(_val: c_int, optarg: *const c_char, remote: c_int) -> c_int {
    guarded("--topology", || {
        if optarg.is_null() {
            return Err("--topology needs a request, e.g. --topology='affinity[core(2)*4]'".into());
        }
        // SAFETY: Slurm passes the option's NUL-terminated argument.
        let text = unsafe { CStr::from_ptr(optarg) }.to_string_lossy().into_owned();
        if remote == 0 {
            topo_core::request::parse(&text).map_err(|e| format!("--topology={text}: {e}"))?;
        }
        *REQUEST.lock().unwrap_or_else(|e| e.into_inner()) = Some(text);
        Ok(())
    })
}

/// Registers `--topology` and reads the plugstack arguments.
#[no_mangle]
pub extern "C" fn slurm_spank_init(sp: Spank, ac: c_int, av: *mut *mut c_char) -> c_int {
    guarded("slurm_spank_init", || {
        load_args(ac, av)?;
        let ctx = context();
        if matches!(ctx, S_CTX_LOCAL | S_CTX_ALLOCATOR | S_CTX_REMOTE | S_CTX_JOB_SCRIPT) {
            // SAFETY: the static table outlives the process; Slurm only reads it.
            let rc = unsafe { spank_option_register(sp, TOPOLOGY_OPTION.0.get()) };
            if rc != ESPANK_SUCCESS && matches!(ctx, S_CTX_LOCAL | S_CTX_ALLOCATOR) {
                return Err(format!("cannot register --topology (spank error {rc})").into());
            }
        }
        Ok(())
    })
}

/// Submitting side: puts the request's summary into the job's control environment for
/// job_submit.lua. slurmstepd: allocates the job on this host, before the tasks are forked.
#[no_mangle]
pub extern "C" fn slurm_spank_init_post_opt(sp: Spank, ac: c_int, av: *mut *mut c_char) -> c_int {
    guarded("slurm_spank_init_post_opt", || {
        load_args(ac, av)?;
        let Some(text) = REQUEST.lock().unwrap_or_else(|e| e.into_inner()).clone() else {
            return Ok(());
        };
        match context() {
            S_CTX_LOCAL | S_CTX_ALLOCATOR => {
                let req = topo_core::request::parse(&text)
                    .map_err(|e| format!("--topology={text}: {e}"))?;
                // The task count is not known to the plug-in before submission; SLURM_NTASKS
                // when the user set it, else 1 (the summary is a lower bound either way).
                let tasks =
                    std::env::var("SLURM_NTASKS").ok().and_then(|n| n.parse().ok()).unwrap_or(1);
                let summary = CString::new(need::summary(&req, tasks)).unwrap_or_default();
                let name = CString::new(need::NEED_VARIABLE).unwrap_or_default();
                // SAFETY: two valid C strings; Slurm copies them.
                unsafe { spank_job_control_setenv(sp, name.as_ptr(), summary.as_ptr(), 1) };
                Ok(())
            }
            S_CTX_REMOTE => {
                // A failure here would only show the user "Plugin initialization failed" and
                // let srun exit 0: keep it for the tasks, which fail with it (exit code 1, the
                // message on the user's terminal and in slurmd's log, once per step).
                if let Err(e) = grant(sp, &text) {
                    let _ = GRANT_ERROR.set(e);
                }
                Ok(())
            }
            _ => Ok(()),
        }
    })
}

/// One try at the allocation failed: topod went away (tried again), or anything else (final).
enum Attempt {
    Unreachable(ClientError),
    Failed(String),
}

/// topod's socket, tried again every 200 ms for up to `timeout` while topod cannot be reached:
/// a job that starts while topod restarts (an upgrade, `systemctl restart`, a crash and
/// systemd's restart) waits for it instead of failing.
/// `waiting` is called once, at the first failure, to say that it waits.
fn connect_patiently(
    socket: &std::path::Path,
    timeout: std::time::Duration,
    waiting: impl Fn(&ClientError),
) -> Result<Client, ClientError> {
    let deadline = std::time::Instant::now() + timeout;
    let mut said = false;
    loop {
        match Client::connect_with_timeout(socket, timeout) {
            Err(e) if e.is_unreachable() && std::time::Instant::now() < deadline => {
                if !std::mem::replace(&mut said, true) {
                    waiting(&e);
                }
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            other => return other,
        }
    }
}

/// The device files of the GPUs Slurm gave the job on this host (its gres: `SLURM_JOB_GPUS`,
/// else the step's `SLURM_STEP_GPUS`), from gres.conf ([`crate::gres`]); none without GPUs.
/// When they cannot be told, the job is placed as without GPUs (the log says why), unless its
/// request binds it to them (`gpubind=numa` or `socket`): then the step fails saying why.
fn job_gpus(
    sp: Spank,
    job_id: u32,
    step_id: u32,
    req: &topo_core::request::Request,
) -> Result<Vec<String>, String> {
    // A step's own GPUs on this node; the job's only in the batch step, which runs here (an
    // srun inside the batch script inherits the batch node's SLURM_JOB_GPUS, not this node's).
    let indices = match job_env(sp, "SLURM_STEP_GPUS") {
        Some(step) => Some(step),
        None if step_id == plan::BATCH_STEP => job_env(sp, "SLURM_JOB_GPUS"),
        None => None,
    };
    let Some(indices) = indices else {
        return Ok(Vec::new());
    };
    let path = args().gres_conf_path(std::env::var("SLURM_CONF").ok().as_deref());
    // gres.conf's NodeName= lines are matched against this host's short name (the job's
    // environment may carry another node's).
    let node = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().split('.').next().unwrap_or_default().to_string())
        .unwrap_or_default();
    let files = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))
        .and_then(|text| crate::gres::gpu_files(&text, &node))
        .and_then(|files| crate::gres::pick(&files, &indices))
        .and_then(|files| Ok((topo_client::device_numbers(&files)?, files)));
    match files {
        Ok((numbers, files)) => {
            log_verbose(&format!(
                "job {job_id}: Slurm's GPUs {indices} are {} ({})",
                files.join(" "),
                numbers.join(" ")
            ));
            Ok(numbers)
        }
        Err(why) => {
            let why = format!("job {job_id}: which device files Slurm's GPUs {indices} are: {why}");
            use topo_core::request::GpuBind;
            if matches!(req.gpubind, Some(GpuBind::Numa | GpuBind::Socket)) {
                return Err(why);
            }
            log_error(&format!("{why}; its CPUs are placed as without GPUs"));
            Ok(Vec::new())
        }
    }
}

/// The job's allocation on this host, asked of topod once per process (idempotent in topod).
fn grant(sp: Spank, request: &str) -> Result<&'static Grant, String> {
    if let Some(g) = GRANT.get() {
        return Ok(g);
    }
    let job_id = item_u32(sp, S_JOB_ID, "the job id")?;
    let step_id = item_u32(sp, S_JOB_STEPID, "the step id")?;
    let step = plan::step_name(step_id);
    let uid = item_u32(sp, S_JOB_UID, "the job's uid")?;
    let job_cores = item_string(sp, S_JOB_ALLOC_CORES, "the job's cores (S_JOB_ALLOC_CORES)")?;
    let step_cores = item_string(sp, S_STEP_ALLOC_CORES, "the step's cores (S_STEP_ALLOC_CORES)")
        .unwrap_or_else(|_| job_cores.clone());
    let mem_mb = item_u64(sp, S_JOB_ALLOC_MEM, "the job's memory").unwrap_or(0);
    let local_tasks =
        item_u32(sp, S_JOB_LOCAL_TASK_COUNT, "the step's tasks on this host").unwrap_or(1);
    let job = plan::topod_job_id(job_id);
    let a = args();
    let started = std::time::Instant::now();
    let fail = |e: ClientError| format!("job {job_id} step {step}: {e}");
    let client = |e: ClientError| {
        if e.is_unreachable() {
            Attempt::Unreachable(e)
        } else {
            Attempt::Failed(fail(e))
        }
    };
    // Prime-time pools admit by queue: Slurm's is the partition. The environment's is only a
    // claim (see plan::trusted_queue), checked against slurmctld's record where it matters.
    let mut names = [("SLURM_JOB_PARTITION", None), ("TOPO_POOL", None)];
    for (variable, value) in &mut names {
        *value = job_env(sp, variable);
        if let Some(Err(e)) = value.as_deref().map(|v| topo_core::proto::check_name(variable, v)) {
            return Err(format!("job {job_id}: the job's environment: {e}"));
        }
    }
    let [(_, claimed_queue), (_, pool)] = names;
    let req =
        topo_core::request::parse(request).map_err(|e| format!("--topology={request}: {e}"))?;
    let gpus = job_gpus(sp, job_id, step_id, &req)?;
    if let (Some(n), true) = (req.gpus_per_task, gpus.is_empty()) {
        // Slurm accounts the node's GPUs: GPUs it did not give the job may be another job's.
        return Err(format!(
            "job {job_id}: --topology asks for gpus={n}, but Slurm gave this step no GPUs: ask Slurm for them (--gres=gpu:N, --gpus-per-task={n}); topod chooses GPUs only where no batch system does"
        ));
    }
    use topo_core::request::GpuBind;
    let bound_to_gpus = matches!(req.gpubind, Some(GpuBind::Numa | GpuBind::Socket));
    // One try: topod's topology, what Slurm did, the allocate. A topod that goes away in the
    // middle (restarted: an upgrade, a crash) is tried again until the timeout; the allocate is
    // idempotent in topod.
    let once = |topod: &mut Client| -> Result<(Allocation, CpuSet, CpuSet, bool), Attempt> {
        let topo: Topology = topod.topology().map_err(client)?;
        let pools = topod.free_map().map_err(client)?.pools;
        let pool_queues: Vec<&str> =
            pools.iter().flat_map(|p| p.queues.iter().map(String::as_str)).collect();
        let (queue, why) = plan::trusted_queue(claimed_queue.as_deref(), &pool_queues, || {
            slurm_job_partition(job_id)
        });
        if let Some(why) = why {
            log_error(&format!("job {job_id}: {why}"));
        }
        let order = cores::slurm_core_order(&topo);
        let job_cpus = cores::translate(&order, &job_cores)
            .map_err(|e| Attempt::Failed(format!("job {job_id}: {e}")))?;
        let step_cpus = cores::translate(&order, &step_cores)
            .map_err(|e| Attempt::Failed(format!("job {job_id} step {step}: {e}")))?;
        let tasks = plan::tasks_if_unsaid(
            &req,
            step_id,
            local_tasks,
            order.iter().filter(|c| c.is_subset(&job_cpus)).count(),
            job_cpus.len(),
        );
        let side = what_slurm_did(topod, job_id, &job_cpus).map_err(client)?;
        if let Some(view) = &side.view {
            log_verbose(&format!(
                "job {job_id}: Slurm shares its cores with jobs it suspended ({}) and runs ({}); this job {}",
                view.suspended.join(" "),
                view.running.join(" "),
                if side.starts_suspended { "starts suspended" } else { "runs" }
            ));
        }
        // Jobs Slurm runs on this job's cores at the same time as this one (oversubscription
        // without its gang scheduling): named if topod refuses.
        let beside: Vec<String> = match (&side.view, side.starts_suspended) {
            (Some(view), false) => view.running.iter().filter(|j| **j != job).cloned().collect(),
            _ => Vec::new(),
        };
        let allocate = topo_core::proto::AllocateArgs {
            tasks: Some(tasks),
            cpus: Some(job_cpus.to_string()),
            mem_limit_bytes: (mem_mb > 0).then_some(mem_mb << 20),
            owner_uid: Some(uid),
            queue,
            pool: pool.clone(),
            batch: side.view.clone(),
            starts_suspended: side.starts_suspended,
            // Never sliced by topod's gang rows: slurmctld would not know the time the job
            // spent frozen and would kill it at its time limit (observed: two --time=1 jobs
            // killed at 1:27 with 20 s of CPU each). Slurm's own gang scheduling is followed.
            gang: Some(false),
            gpus: gpus.clone(),
            ..topo_core::proto::AllocateArgs::new(job.clone(), request.to_string())
        };
        // A topod older than GPU placement refuses the field: place the job as without GPUs
        // (said in the log) rather than fail it, unless its request binds it to them.
        let refuses_gpus = |e: &ClientError| matches!(e, ClientError::Refused(r) if r.message.contains("unknown field \"gpus\""));
        let answer = match topod.allocate(Op::Allocate(allocate.clone())) {
            Err(e) if !gpus.is_empty() && !bound_to_gpus && refuses_gpus(&e) => {
                log_error(&format!(
                    "job {job_id}: this topod does not take GPUs (upgrade it); the job is placed as without them"
                ));
                topod.allocate(Op::Allocate(topo_core::proto::AllocateArgs {
                    gpus: Vec::new(),
                    ..allocate
                }))
            }
            other => other,
        };
        let alloc = match answer {
            Ok(a) => a,
            // Another step of the job (the batch script, a concurrent srun) placed it already
            // with its own task count: every step shares that allocation.
            Err(ClientError::Refused(e))
                if e.code == ErrorCode::BadRequest && e.message.contains("already holds") =>
            {
                let all = topod.list().map_err(client)?;
                let found = all.into_iter().find(|a| a.allocation.job == job);
                found
                    .map(|v| v.allocation)
                    .ok_or_else(|| Attempt::Failed(format!("job {job_id}: topod: {}", e.message)))?
            }
            Err(e) if e.is_unreachable() => return Err(Attempt::Unreachable(e)),
            Err(e) => {
                let mut why = String::new();
                if e.code() == Some(ErrorCode::DoesNotFit) {
                    if !beside.is_empty() {
                        why.push_str(&plan::oversubscribed(&beside));
                    }
                    if !side.unknown.is_empty() {
                        why.push_str(&plan::unknown_to_slurm(&side.unknown));
                    }
                }
                return Err(Attempt::Failed(format!(
                    "job {job_id} step {step}: cores {job_cores} (CPUs {job_cpus}): {e}{why}"
                )));
            }
        };
        Ok((alloc, job_cpus, step_cpus, side.starts_suspended))
    };
    let deadline = started + a.timeout;
    let (alloc, job_cpus, step_cpus, starts_suspended) = loop {
        let waiting = |e: &ClientError| {
            log_info(&format!(
                "job {job_id} step {step}: {e}; waiting up to {} s for topod (a restart?)",
                a.timeout.as_secs()
            ))
        };
        let mut topod = connect_patiently(&a.socket, a.timeout, waiting).map_err(|e| {
            if !e.is_unreachable() {
                return fail(e);
            }
            let waited = started.elapsed().as_secs_f64();
            format!("job {job_id} step {step}: waited {waited:.1} s, and still {e}")
        })?;
        match once(&mut topod) {
            Ok(done) => break done,
            Err(Attempt::Unreachable(e)) if std::time::Instant::now() < deadline => {
                log_verbose(&format!(
                    "job {job_id} step {step}: topod went away ({e}); trying again"
                ));
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            Err(Attempt::Unreachable(e)) => return Err(fail(e)),
            Err(Attempt::Failed(message)) => return Err(message),
        }
    };
    log_verbose(&format!(
        "job {job_id} step {step}: Slurm cores {job_cores} = CPUs {job_cpus}; topod gave {} (mems {}) in {:.1} ms",
        alloc.cpus,
        alloc.mems,
        started.elapsed().as_secs_f64() * 1e3
    ));
    let _ = GRANT.set(Grant { alloc, step_cpus, started_suspended: starts_suspended });
    GRANT.get().ok_or_else(|| "allocation lost".to_string())
}

/// In each task, before privileges drop: join topod's cgroup for the job (or stay in Slurm's
/// and only narrow, see [`Mode`]), and note the task's CPUs.
#[no_mangle]
pub extern "C" fn slurm_spank_task_init_privileged(
    sp: Spank,
    ac: c_int,
    av: *mut *mut c_char,
) -> c_int {
    guarded("slurm_spank_task_init_privileged", || {
        load_args(ac, av)?;
        let Some(request) = requested(sp) else { return Ok(()) };
        let task = item_int(sp, S_TASK_ID, "the task id")?;
        if let Some(e) = GRANT_ERROR.get() {
            // The step has no allocation: every task fails, and the first one on this host says
            // why (in slurmd's log and on the user's terminal), so a step's failure is one line.
            return Err(if task == 0 { Failure::Say(e.clone()) } else { Failure::Quiet });
        }
        let g = grant(sp, &request)?;
        let job_id = item_u32(sp, S_JOB_ID, "the job id")?;
        let mode = match args().mode {
            Mode::Auto => {
                let text = std::fs::read_to_string("/proc/self/cgroup")
                    .map_err(|e| format!("cannot read /proc/self/cgroup: {e}"))?;
                if args::inside_slurm_job_cgroup(&text, job_id) {
                    Mode::Narrow
                } else {
                    Mode::Join
                }
            }
            m => m,
        };
        if mode == Mode::Join {
            let a = args();
            let started = std::time::Instant::now();
            let how = Client::connect_with_timeout(&a.socket, a.timeout)
                .map_err(|e| e.to_string())
                .and_then(|mut t| t.join_self(&g.alloc.job).map_err(|e| e.to_string()))
                .map_err(|e| {
                    format!("job {job_id} task {task}: cannot join {}: {e}", g.alloc.job)
                })?;
            let how = match how {
                Joined::Itself => "moved itself in".to_string(),
                Joined::ByTopod { why } => format!("topod moved it in ({why})"),
            };
            log_verbose(&format!(
                "job {job_id} task {task}: joined {} in {:.1} ms: {how}",
                g.alloc.job,
                started.elapsed().as_secs_f64() * 1e3
            ));
        }
        let local_tasks =
            item_u32(sp, S_JOB_LOCAL_TASK_COUNT, "the step's tasks on this host").unwrap_or(1);
        let per_task = topo_core::request::parse(&request)
            .map(|r| plan::binds_per_task(&r, local_tasks))
            .unwrap_or(true);
        let cpus = plan::task_cpus(
            &g.alloc.cpus,
            if per_task { &g.alloc.tasks } else { &[] },
            usize::try_from(task).unwrap_or(0),
            &g.step_cpus,
        );
        let _ = TASK.set((cpus, mode));
        Ok(())
    })
}

/// In each task just before exec, as the user: the final CPU binding (after Slurm's own
/// task/affinity binding, which it narrows) and the environment (`TOPO_*`).
#[no_mangle]
pub extern "C" fn slurm_spank_task_init(sp: Spank, ac: c_int, av: *mut *mut c_char) -> c_int {
    guarded("slurm_spank_task_init", || {
        let a = load_args(ac, av)?;
        let (Some(g), Some((cpus, mode))) = (GRANT.get(), TASK.get()) else { return Ok(()) };
        if g.started_suspended {
            wait_until_running(item_u32(sp, S_JOB_ID, "the job id")?);
        }
        set_affinity(cpus)?;
        set_task_env(sp, "TOPO_JOB", &g.alloc.job)?;
        // Where topod tells a malleable job its CPUs after a resize (libtopo's
        // topo_resize_wait reads it).
        let notify = topo_core::proto::notify_file_for(&a.socket, &g.alloc.job);
        set_task_env(sp, "TOPO_NOTIFY_FILE", &notify.to_string_lossy())?;
        set_task_env(sp, "TOPO_CPUS", &g.alloc.cpus.to_string())?;
        set_task_env(sp, "TOPO_TASK_CPUS", &cpus.to_string())?;
        set_task_env(sp, "TOPO_MEMS", &g.alloc.mems.to_string())?;
        set_task_env(sp, "TOPO_CGROUP", if *mode == Mode::Join { "topod" } else { "slurm" })?;
        Ok(())
    })
}

/// How often a task of a job Slurm started suspended asks slurmctld whether it runs yet.
const RUNNING_POLL: std::time::Duration = std::time::Duration::from_millis(100);
/// How often a task that waits while slurmctld does not answer says so in the log.
const RUNNING_UNANSWERED: std::time::Duration = std::time::Duration::from_secs(60);

/// In a task of a job slurmctld had suspended when it started here (Slurm's gang scheduling
/// starts a job in a row that is not running, and its suspend can reach slurmd before the task
/// exists, which then runs beside the job whose turn it is): waits, before the user's program
/// runs, until slurmctld says the job runs. Slurm's later suspensions stop the task as usual.
fn wait_until_running(job_id: u32) {
    // Slurm may stop the task in the middle of a question (its freezer, SIGSTOP); slurmctld
    // closes the connection meanwhile, and the write after the thaw would kill the task with
    // SIGPIPE. Ignored while waiting (the failed question is asked again), as it was after.
    // SAFETY: the task's own process, one thread, before exec; the old disposition is put back.
    let before = unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    wait_for_slurm(job_id);
    // SAFETY: as above; `before` came from signal() itself.
    unsafe { libc::signal(libc::SIGPIPE, before) };
}

fn wait_for_slurm(job_id: u32) {
    let started = std::time::Instant::now();
    let mut said = std::time::Instant::now();
    loop {
        let answer = slurm_job_state(job_id);
        if plan::may_run(answer.as_ref().ok().copied()) {
            break;
        }
        if let Err(e) = &answer {
            // Said once a minute: the task keeps waiting, as slurmctld last said.
            if said.elapsed() >= RUNNING_UNANSWERED {
                log_error(&format!("job {job_id}: started suspended by Slurm, its task waits for slurmctld to run the job, and {e} (waiting {} s)", started.elapsed().as_secs()));
                said = std::time::Instant::now();
            }
        }
        std::thread::sleep(RUNNING_POLL);
    }
    log_verbose(&format!(
        "job {job_id}: started suspended by Slurm; its task ran {:.1} s later, when slurmctld ran the job",
        started.elapsed().as_secs_f64()
    ));
}

/// The least time the epilog waits for topod's answer to a release: topod's own wait for a
/// job's processes to die (10 s) and a margin.
const RELEASE_REPLY_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// When the job ends on this host (job epilog, as root): release it in topod.
///
/// - topod holds nothing for the job (it never got its allocation): done.
/// - topod cannot be reached (stopped, restarting, not answering in time): the release is
///   queued for it ([`topo_client::queue_release`]) and done when it is back, and the epilog
///   succeeds: a short topod outage must not drain the node.
/// - topod refused or failed (processes that would not die, a cgroup it cannot remove): the
///   epilog fails and Slurm drains the node, as it does for unkillable steps.
#[no_mangle]
pub extern "C" fn slurm_spank_job_epilog(sp: Spank, ac: c_int, av: *mut *mut c_char) -> c_int {
    guarded("slurm_spank_job_epilog", || {
        load_args(ac, av)?;
        if requested(sp).is_none() {
            return Ok(());
        }
        let job_id = item_u32(sp, S_JOB_ID, "the job id")?;
        let job = plan::topod_job_id(job_id);
        let a = args();
        // A release waits for the job's processes to die (topod gives them 10 s): wait longer
        // than that, so that processes that will not die fail the epilog (and drain the node,
        // as Slurm does for unkillable steps) instead of timing out into a queued release.
        let wait = a.timeout.max(RELEASE_REPLY_WAIT);
        match Client::connect_with_timeout(&a.socket, wait).and_then(|mut t| t.release(&job)) {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some(ErrorCode::UnknownJob) => Ok(()),
            Err(e) if e.is_unreachable() => {
                let by = format!("the Slurm job epilog (pid {})", std::process::id());
                match topo_client::queue_release(&a.socket, &job, &by) {
                    Ok(file) => {
                        let dir = file.parent().unwrap_or(&file).display().to_string();
                        log_info(&format!(
                            "job {job_id}: topod unreachable; release of {job} queued in {dir}, done when topod is back ({e})"
                        ));
                        Ok(())
                    }
                    Err(q) => Err(format!(
                        "job {job_id}: cannot release {job}: {e}; and cannot queue it for later: {q}"
                    )
                    .into()),
                }
            }
            Err(e) => Err(format!("job {job_id}: cannot release {job}: {e}").into()),
        }
    })
}
