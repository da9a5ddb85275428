//! What torch's `Backend.get_error()` reads: the worst communication error
//! a group's ops have met, recorded where Python learns of it (a direct
//! op's failure, a background op's error once waited for or asked about).
//!
//! It also runs the group's abort callback (torch's abort hooks) once the
//! group has aborted, on the Python thread that first learns of an error
//! after that: never on weft's own threads, which may hold the group's
//! locks while Python code would wait for them.

use pyo3::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use weft::ErrorKind;

/// An op timed out (`ErrorType.TIMEOUT`).
pub const TIMEOUT: u8 = 1;
/// The transport failed or the group was aborted (`ErrorType.COMM_ERROR`).
pub const COMM_ERROR: u8 = 2;
/// A peer died or left (`ErrorType.REMOTE_ERROR`).
pub const REMOTE_ERROR: u8 = 3;

#[derive(Default)]
struct Inner {
    code: AtomicU8,
    /// Set (by core's `on_abort`, on any thread) once the group aborted.
    aborted: AtomicBool,
    /// Called once, with the GIL, after the group aborted.
    on_abort: Mutex<Option<Py<PyAny>>>,
}

/// A group's error record, shared by the group and its works.
#[derive(Clone, Default)]
pub struct Health(Arc<Inner>);

impl Health {
    /// Record `kind` if it is a communication error (a bad argument is
    /// the caller's, and leaves the group healthy). The latest one counts.
    /// Then, if the group has aborted, run its abort callback (once).
    pub fn record(&self, kind: &ErrorKind) {
        let code = match kind {
            ErrorKind::Timeout => TIMEOUT,
            ErrorKind::PeerLost { .. } => REMOTE_ERROR,
            ErrorKind::Aborted | ErrorKind::Backend => COMM_ERROR,
            _ => return,
        };
        self.0.code.store(code, Ordering::Relaxed);
        self.run_abort_callback();
    }

    /// The recorded code: 0 (torch's `ErrorType.SUCCESS`) until an error
    /// is recorded, then one of this module's constants.
    pub fn code(&self) -> u8 {
        self.0.code.load(Ordering::Relaxed)
    }

    /// The group aborted (any thread, no Python): the callback runs when
    /// Python next learns of an error.
    pub fn aborted(&self) {
        self.0.aborted.store(true, Ordering::Release);
    }

    /// Call `callback()` once the group has aborted (replacing an earlier
    /// one); at once if it already has.
    pub fn set_abort_callback(&self, callback: Py<PyAny>) {
        *self.0.on_abort.lock().unwrap_or_else(|p| p.into_inner()) = Some(callback);
        self.run_abort_callback();
    }

    fn run_abort_callback(&self) {
        if !self.0.aborted.load(Ordering::Acquire) {
            return;
        }
        let Some(callback) = self.0.on_abort.lock().unwrap_or_else(|p| p.into_inner()).take() else { return };
        Python::attach(|py| {
            if let Err(e) = callback.call0(py) {
                // The error being raised matters more than the hook's.
                e.print(py);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_communication_errors_only() {
        let h = Health::default();
        h.record(&ErrorKind::InvalidArgument);
        assert_eq!(h.code(), 0);
        h.record(&ErrorKind::Timeout);
        assert_eq!(h.code(), TIMEOUT);
        h.record(&ErrorKind::PeerLost { rank: 1 });
        assert_eq!(h.code(), REMOTE_ERROR);
        h.record(&ErrorKind::Aborted);
        assert_eq!(h.code(), COMM_ERROR);
    }
}
