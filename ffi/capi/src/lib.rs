//! `libtopo.so`: the C API of `ffi/include/topo.h`.
//!
//! Each call opens topod's socket, sends one operation and closes it: no state, no threads, so
//! the library is safe in any process (a resource manager's daemon, a job starter) and from any
//! thread. Arguments are checked before anything is sent; a panic inside the library becomes
//! `TOPO_ERR_INTERNAL`, never an unwind into C.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, CStr};
use std::path::Path;
use topo_client::{Client, ClientError};
use topo_core::cpuset::CpuSet;
use topo_core::proto::Op;
use topo_core::JobId;

const TOPO_OK: c_int = 0;
const TOPO_ERR_INVALID: c_int = -1;
const TOPO_ERR_UNREACHABLE: c_int = -2;
const TOPO_ERR_REFUSED: c_int = -3;
const TOPO_ERR_INTERNAL: c_int = -4;
const TOPO_ERR_TRUNCATED: c_int = -5;

const DEFAULT_SOCKET: &str = topo_core::proto::DEFAULT_SOCKET;

/// A failed call: its code and message.
struct Failure(c_int, String);

fn invalid(message: impl Into<String>) -> Failure {
    Failure(TOPO_ERR_INVALID, message.into())
}

impl From<ClientError> for Failure {
    fn from(e: ClientError) -> Self {
        let code = match e {
            ClientError::Connect { .. } => TOPO_ERR_UNREACHABLE,
            _ => TOPO_ERR_REFUSED,
        };
        Failure(code, e.to_string())
    }
}

/// Copies `text` into the caller's buffer, cut to fit and NUL-terminated; false if cut.
///
/// SAFETY (for callers): `buf` is null or valid for `len` bytes.
unsafe fn write_out(buf: *mut c_char, len: usize, text: &str) -> bool {
    if buf.is_null() || len == 0 {
        return true;
    }
    let n = text.len().min(len - 1);
    // SAFETY: `buf` has room for `len` > n bytes; the source is `n` bytes of `text`.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf as *mut u8, n);
        *buf.add(n) = 0;
    }
    n == text.len()
}

/// An argument as UTF-8 text.
///
/// SAFETY (for callers): `p` is null or a NUL-terminated string.
unsafe fn arg<'a>(p: *const c_char, name: &str) -> Result<Option<&'a str>, Failure> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: guaranteed by the caller.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map(Some)
        .map_err(|_| invalid(format!("{name} is not UTF-8 text")))
}

/// SAFETY (for callers): as [`arg`].
unsafe fn job_arg(p: *const c_char) -> Result<String, Failure> {
    // SAFETY: guaranteed by the caller.
    let job = unsafe { arg(p, "job") }?.ok_or_else(|| invalid("job is NULL"))?;
    JobId::parse(job).map_err(|e| invalid(e.to_string()))?;
    Ok(job.to_string())
}

/// SAFETY (for callers): as [`arg`].
unsafe fn connect(socket: *const c_char) -> Result<Client, Failure> {
    // SAFETY: guaranteed by the caller.
    let path = unsafe { arg(socket, "socket") }?.unwrap_or(DEFAULT_SOCKET);
    Ok(Client::connect(Path::new(path))?)
}

/// Runs a call: a failure's message goes to `err`, a panic becomes TOPO_ERR_INTERNAL.
fn run(err: *mut c_char, err_len: usize, f: impl FnOnce() -> Result<c_int, Failure>) -> c_int {
    let result = topo_ffi_guard::catch(f).map_err(|caught| match caught {
        topo_ffi_guard::Caught::Error(failure) => failure,
        topo_ffi_guard::Caught::Panic(what) => {
            Failure(TOPO_ERR_INTERNAL, format!("internal error in libtopo: {what}"))
        }
    });
    match result {
        Ok(code) => code,
        Err(Failure(code, message)) => {
            // SAFETY: the caller gives `err` valid for `err_len` bytes, or null.
            unsafe { write_out(err, err_len, &message) };
            code
        }
    }
}

/// See topo.h.
#[no_mangle]
pub extern "C" fn topo_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr() as *const c_char
}

/// See topo.h.
///
/// # Safety
/// Every pointer is null or valid as topo.h says.
#[no_mangle]
pub unsafe extern "C" fn topo_allocate(
    socket: *const c_char,
    job: *const c_char,
    request: *const c_char,
    tasks: c_uint,
    cpus: *const c_char,
    mem_limit_bytes: c_ulonglong,
    cpus_out: *mut c_char,
    cpus_out_len: usize,
    mems_out: *mut c_char,
    mems_out_len: usize,
    err: *mut c_char,
    err_len: usize,
) -> c_int {
    run(err, err_len, || {
        // SAFETY: pointers as topo.h documents.
        let job = unsafe { job_arg(job) }?;
        // SAFETY: as above.
        let request =
            unsafe { arg(request, "request") }?.ok_or_else(|| invalid("request is NULL"))?;
        topo_core::request::parse(request)
            .map_err(|e| invalid(format!("bad request {request:?}: {e}")))?;
        // SAFETY: as above.
        let cpus = unsafe { arg(cpus, "cpus") }?;
        if let Some(c) = cpus {
            CpuSet::parse_list(c).map_err(|e| invalid(format!("bad CPU list {c:?}: {e}")))?;
        }
        // SAFETY: as above.
        let mut client = unsafe { connect(socket) }?;
        let alloc = client.allocate(Op::Allocate(topo_core::proto::AllocateArgs {
            tasks: (tasks > 0).then_some(tasks),
            cpus: cpus.map(str::to_string),
            mem_limit_bytes: (mem_limit_bytes > 0).then_some(mem_limit_bytes),
            ..topo_core::proto::AllocateArgs::new(job, request.to_string())
        }))?;
        // SAFETY: output buffers as topo.h documents.
        let whole = unsafe {
            write_out(cpus_out, cpus_out_len, &alloc.cpus.to_string())
                & write_out(mems_out, mems_out_len, &alloc.mems.to_string())
        };
        if whole {
            Ok(TOPO_OK)
        } else {
            Err(Failure(TOPO_ERR_TRUNCATED, "the job is allocated, but an output buffer was too small for its CPU or memory-node list".into()))
        }
    })
}

/// See topo.h.
///
/// # Safety
/// Every pointer is null or valid as topo.h says.
#[no_mangle]
pub unsafe extern "C" fn topo_bind(
    socket: *const c_char,
    job: *const c_char,
    pid: c_int,
    err: *mut c_char,
    err_len: usize,
) -> c_int {
    run(err, err_len, || {
        // SAFETY: pointers as topo.h documents.
        let job = unsafe { job_arg(job) }?;
        if pid <= 0 {
            return Err(invalid(format!("pid {pid} is not a process id")));
        }
        // SAFETY: as above.
        unsafe { connect(socket) }?.join(&job, pid)?;
        Ok(TOPO_OK)
    })
}

/// See topo.h.
///
/// # Safety
/// Every pointer is null or valid as topo.h says.
#[no_mangle]
pub unsafe extern "C" fn topo_release(
    socket: *const c_char,
    job: *const c_char,
    err: *mut c_char,
    err_len: usize,
) -> c_int {
    run(err, err_len, || {
        // SAFETY: pointers as topo.h documents.
        let job = unsafe { job_arg(job) }?;
        // SAFETY: as above.
        unsafe { connect(socket) }?.release(&job)?;
        Ok(TOPO_OK)
    })
}
