//! What torch's `Backend.get_error()` reads: the worst communication error
//! a group's ops have met, recorded where Python learns of it (a direct
//! op's failure, a background op's error once waited for or asked about).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use weft::ErrorKind;

/// An op timed out (`ErrorType.TIMEOUT`).
pub const TIMEOUT: u8 = 1;
/// The transport failed or the group was aborted (`ErrorType.COMM_ERROR`).
pub const COMM_ERROR: u8 = 2;
/// A peer died or left (`ErrorType.REMOTE_ERROR`).
pub const REMOTE_ERROR: u8 = 3;

/// A group's error record, shared by the group and its works.
#[derive(Clone, Default)]
pub struct Health(Arc<AtomicU8>);

impl Health {
    /// Record `kind` if it is a communication error (a bad argument is
    /// the caller's, and leaves the group healthy). The latest one counts.
    pub fn record(&self, kind: &ErrorKind) {
        let code = match kind {
            ErrorKind::Timeout => TIMEOUT,
            ErrorKind::PeerLost { .. } => REMOTE_ERROR,
            ErrorKind::Aborted | ErrorKind::Backend => COMM_ERROR,
            _ => return,
        };
        self.0.store(code, Ordering::Relaxed);
    }

    /// The recorded code: 0 (torch's `ErrorType.SUCCESS`) until an error
    /// is recorded, then one of this module's constants.
    pub fn code(&self) -> u8 {
        self.0.load(Ordering::Relaxed)
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
