//! `libtopo.so`: the C API of `ffi/include/topo.h`.
//!
//! Each call opens topod's socket, sends one operation and closes it: no state, no threads, so
//! the library is safe in any process (a resource manager's daemon, a job starter) and from any
//! thread. Arguments are checked before anything is sent; a panic inside the library becomes
//! `TOPO_ERR_INTERNAL`, never an unwind into C.
//!
//! `topo_notify_read` and `topo_resize_wait` are the job side of a malleable job: they talk to no
//! topod, only read (and wait for) the notify file topod rewrites when it resizes the job (see
//! [`notify`]).

pub mod notify;

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, CStr};
use std::path::Path;
use std::time::Duration;
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

impl From<notify::NotifyError> for Failure {
    fn from(e: notify::NotifyError) -> Self {
        invalid(e.to_string())
    }
}

/// Hands a notice to the caller: `*generation` and the CPU list (either pointer may be null),
/// then the number of CPUs; a list that does not fit is an error, after `*generation` is set.
///
/// SAFETY (for callers): `generation` is null or valid for a write; `cpus` is null or valid for
/// `cpus_len` bytes.
unsafe fn hand_out(
    notice: &notify::Notice,
    generation: *mut c_ulonglong,
    cpus: *mut c_char,
    cpus_len: usize,
) -> Result<c_int, Failure> {
    if !generation.is_null() {
        // SAFETY: guaranteed by the caller.
        unsafe { *generation = notice.generation };
    }
    let list = notice.cpus.to_string();
    // SAFETY: guaranteed by the caller.
    if !unsafe { write_out(cpus, cpus_len, &list) } {
        return Err(invalid(format!(
            "the cpus buffer of {cpus_len} bytes is too small for generation {}'s CPU list {list:?} ({} bytes with its NUL)",
            notice.generation,
            list.len() + 1
        )));
    }
    Ok(c_int::try_from(notice.cpus.len()).unwrap_or(c_int::MAX))
}

/// See topo.h.
///
/// # Safety
/// Every pointer is null or valid as topo.h says.
#[no_mangle]
pub unsafe extern "C" fn topo_notify_read(
    notify_file: *const c_char,
    generation: *mut c_ulonglong,
    cpus: *mut c_char,
    cpus_len: usize,
    err: *mut c_char,
    err_len: usize,
) -> c_int {
    run(err, err_len, || {
        // SAFETY: pointers as topo.h documents.
        let path = notify::resolve(unsafe { arg(notify_file, "notify_file") }?)?;
        let notice = notify::read(&path)?;
        // SAFETY: as above.
        unsafe { hand_out(&notice, generation, cpus, cpus_len) }
    })
}

/// See topo.h.
///
/// # Safety
/// Every pointer is null or valid as topo.h says.
#[no_mangle]
pub unsafe extern "C" fn topo_resize_wait(
    notify_file: *const c_char,
    last_generation: c_ulonglong,
    timeout_ms: c_int,
    generation: *mut c_ulonglong,
    cpus: *mut c_char,
    cpus_len: usize,
    err: *mut c_char,
    err_len: usize,
) -> c_int {
    run(err, err_len, || {
        // SAFETY: pointers as topo.h documents.
        let path = notify::resolve(unsafe { arg(notify_file, "notify_file") }?)?;
        let timeout = u64::try_from(timeout_ms).ok().map(Duration::from_millis);
        match notify::wait(&path, last_generation, timeout)? {
            // SAFETY: as above.
            Some(notice) => unsafe { hand_out(&notice, generation, cpus, cpus_len) },
            None => Ok(0),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;

    fn text(buf: &[c_char]) -> String {
        // SAFETY: the library always NUL-terminates what it writes; the buffers start zeroed.
        unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
    }

    #[test]
    fn the_c_calls_fill_the_buffers_and_say_what_went_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job-1");
        std::fs::write(&path, "generation=2\ncpus=0-3,8-11\nmems=0\n").unwrap();
        let c_path = CString::new(path.to_str().unwrap()).unwrap();
        let (mut generation, mut cpus, mut err) = (0u64, [0 as c_char; 64], [0 as c_char; 256]);

        // SAFETY: every pointer is valid for the lengths given.
        let n = unsafe {
            topo_notify_read(
                c_path.as_ptr(),
                &mut generation,
                cpus.as_mut_ptr(),
                64,
                err.as_mut_ptr(),
                256,
            )
        };
        assert_eq!((n, generation, text(&cpus)), (8, 2, "0-3,8-11".to_string()));

        // Newer than 1: at once. Not newer than 2: a timeout after 50 ms, 0.
        // SAFETY: as above.
        let n = unsafe {
            topo_resize_wait(
                c_path.as_ptr(),
                1,
                -1,
                &mut generation,
                cpus.as_mut_ptr(),
                64,
                err.as_mut_ptr(),
                256,
            )
        };
        assert_eq!(n, 8);
        // SAFETY: as above.
        let n = unsafe {
            topo_resize_wait(
                c_path.as_ptr(),
                2,
                50,
                &mut generation,
                cpus.as_mut_ptr(),
                64,
                err.as_mut_ptr(),
                256,
            )
        };
        assert_eq!(n, 0);

        // A list that does not fit: -1, the generation still set, the message says so.
        generation = 0;
        // SAFETY: as above; 4 bytes of `cpus` are given.
        let n = unsafe {
            topo_resize_wait(
                c_path.as_ptr(),
                0,
                0,
                &mut generation,
                cpus.as_mut_ptr(),
                4,
                err.as_mut_ptr(),
                256,
            )
        };
        assert_eq!((n, generation), (-1, 2));
        assert!(text(&err).contains("too small"), "{}", text(&err));

        // Null outputs are allowed; the count still comes back.
        // SAFETY: null outputs are allowed by topo.h.
        let n = unsafe {
            topo_notify_read(
                c_path.as_ptr(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
                std::ptr::null_mut(),
                0,
            )
        };
        assert_eq!(n, 8);

        // Bad content and a missing file: -1 with a message naming the file.
        std::fs::write(&path, "generation=3\n").unwrap();
        // SAFETY: as above.
        let n = unsafe {
            topo_resize_wait(
                c_path.as_ptr(),
                2,
                1000,
                &mut generation,
                cpus.as_mut_ptr(),
                64,
                err.as_mut_ptr(),
                256,
            )
        };
        assert_eq!(n, -1);
        assert!(text(&err).contains("malformed") && text(&err).contains("job-1"), "{}", text(&err));
        std::fs::remove_file(&path).unwrap();
        // SAFETY: as above.
        let n = unsafe {
            topo_notify_read(
                c_path.as_ptr(),
                &mut generation,
                cpus.as_mut_ptr(),
                64,
                err.as_mut_ptr(),
                256,
            )
        };
        assert_eq!(n, -1);
        assert!(text(&err).contains("cannot read notify file"), "{}", text(&err));
    }

    #[test]
    fn a_null_path_means_the_environment_and_no_environment_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job-env");
        std::fs::write(&path, "generation=1\ncpus=1\n").unwrap();
        let mut err = [0 as c_char; 256];
        // This is the only test that touches the variable.
        std::env::remove_var(notify::NOTIFY_FILE_ENV);
        // SAFETY: null path and outputs are allowed by topo.h; `err` is valid for 256 bytes.
        let n = unsafe {
            topo_resize_wait(
                std::ptr::null(),
                0,
                0,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
                err.as_mut_ptr(),
                256,
            )
        };
        assert_eq!(n, -1);
        assert!(text(&err).contains("TOPO_NOTIFY_FILE is not set"), "{}", text(&err));
        std::env::set_var(notify::NOTIFY_FILE_ENV, &path);
        // SAFETY: as above.
        let n = unsafe {
            topo_resize_wait(
                std::ptr::null(),
                0,
                0,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
                err.as_mut_ptr(),
                256,
            )
        };
        std::env::remove_var(notify::NOTIFY_FILE_ENV);
        assert_eq!(n, 1);
    }
}
