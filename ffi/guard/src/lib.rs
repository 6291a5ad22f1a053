//! The one panic boundary of topo's C-facing libraries: `schmod_topo.so` (inside LSF's mbschd),
//! `spank_topo.so` (inside slurmd and slurmstepd) and `libtopo.so` (inside whatever links it).
//!
//! A panic must never unwind into their callers' C code, which is undefined behaviour, so every
//! exported function runs its body through [`catch`]: a panic becomes [`Caught::Panic`] with its
//! message, an error stays the library's own error, and each library turns both into the return
//! code and log line its caller expects. The libraries are built with `panic = "unwind"` (the
//! workspace never sets `abort`), or there would be nothing to catch.
//!
//! No process-wide panic hook is installed: the hook belongs to the process (mbschd, slurmstepd),
//! and a library that replaced it would change what every other Rust library in that process
//! reports. The message comes from the panic's payload instead.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// What went wrong in a guarded call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caught<E> {
    /// The body returned this error.
    Error(E),
    /// The body panicked, with this message.
    Panic(String),
}

/// Runs `body`, catching a panic. The body is treated as unwind-safe: after a panic the
/// libraries return an error and keep no state the panic could have left half-changed that a
/// later call would trust without checking (their shared state sits behind locks that are
/// recovered from poisoning and re-validated).
pub fn catch<T, E>(body: impl FnOnce() -> Result<T, E>) -> Result<T, Caught<E>> {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(Caught::Error(e)),
        Err(payload) => Err(Caught::Panic(message(payload.as_ref()))),
    }
}

/// The message of a panic payload (`panic!("...")` gives a `&str` or a `String`).
pub fn message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_errors_and_panics_come_back_as_such() {
        assert_eq!(catch(|| Ok::<_, String>(3)), Ok(3));
        assert_eq!(
            catch(|| Err::<(), _>("bad".to_string())),
            Err(Caught::Error("bad".to_string()))
        );
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let literal = catch(|| -> Result<(), ()> { panic!("boom") });
        let formatted = catch(|| -> Result<(), ()> { panic!("boom {}", 7) });
        let other = catch(|| -> Result<(), ()> { std::panic::panic_any(42u8) });
        std::panic::set_hook(hook);
        assert_eq!(literal, Err(Caught::Panic("boom".into())));
        assert_eq!(formatted, Err(Caught::Panic("boom 7".into())));
        assert_eq!(other, Err(Caught::Panic("a panic without a message".into())));
    }
}
