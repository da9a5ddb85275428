//! An op's deadline, read from the clock only when first needed.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// When an op must be finished: its timeout, counted from the first time
/// anything asks for the deadline.
///
/// Most small ops (a fast-path all_reduce through shared memory) finish
/// before they ever wait, so they never read the clock: a clock read cost
/// about a tenth of an 8-byte all_reduce. Ops that do wait ask at their
/// first wait, a few microseconds after they start, which is what the
/// timeout is for.
#[derive(Debug)]
pub struct Deadline {
    timeout: Duration,
    at: OnceLock<Instant>,
}

impl Deadline {
    /// `timeout` from the first [`Deadline::get`].
    pub fn after(timeout: Duration) -> Self {
        Deadline { timeout, at: OnceLock::new() }
    }

    /// At `instant`.
    pub fn at(instant: Instant) -> Self {
        Deadline { timeout: Duration::ZERO, at: OnceLock::from(instant) }
    }

    /// The instant (fixed by the first call).
    pub fn get(&self) -> Instant {
        *self.at.get_or_init(|| instant_after(self.timeout))
    }

    /// The instant, fixed (by the first call) as the timeout from `now`,
    /// a clock reading the caller has just taken.
    pub fn get_from(&self, now: Instant) -> Instant {
        *self.at.get_or_init(|| saturating_add(now, self.timeout))
    }

    /// How long a failed op may wait for the device work it queued before
    /// it returns (that work touches the caller's memory, which is the
    /// caller's again once the op returns): the deadline, or
    /// `CLEANUP_GRACE` (5 s) from now if that is later. A timed-out op's own
    /// deadline has passed, and waiting to it would not wait at all.
    pub fn for_cleanup(&self) -> Instant {
        self.get().max(instant_after(CLEANUP_GRACE))
    }
}

/// At least this long to let a failed op's queued device work finish
/// ([`Deadline::for_cleanup`]): copies already queued take milliseconds
/// unless the device itself hangs.
pub const CLEANUP_GRACE: Duration = Duration::from_secs(5);

/// `timeout` from now; a timeout past what the clock can hold (a peer's
/// `u64::MAX` milliseconds, `Duration::MAX`) is a century.
pub(crate) fn instant_after(timeout: Duration) -> Instant {
    saturating_add(Instant::now(), timeout)
}

fn saturating_add(now: Instant, timeout: Duration) -> Instant {
    now.checked_add(timeout).unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400))
}

impl Clone for Deadline {
    /// A copy with the same instant (fixed now if it was not yet).
    fn clone(&self) -> Self {
        Deadline::at(self.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_too_long_for_the_clock_saturate() {
        assert!(Deadline::after(Duration::MAX).get() > Instant::now() + Duration::from_secs(3600 * 24 * 365));
    }

    #[test]
    fn the_clock_starts_at_the_first_get_and_copies_share_the_instant() {
        let d = Deadline::after(Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(20));
        let before = Instant::now();
        let at = d.get();
        assert!(at >= before + Duration::from_secs(5), "counted from the first get, not from creation");
        assert_eq!(d.get(), at);
        assert_eq!(d.clone().get(), at);
        let fixed = Instant::now();
        assert_eq!(Deadline::at(fixed).get(), fixed);
        let d = Deadline::after(Duration::from_secs(5));
        assert_eq!(d.get_from(fixed), fixed + Duration::from_secs(5));
        assert_eq!(d.get(), fixed + Duration::from_secs(5), "fixed by get_from");
    }

    #[test]
    fn cleanup_waits_at_least_the_grace_even_past_the_deadline() {
        let now = Instant::now();
        let passed = Deadline::at(now - Duration::from_secs(1));
        assert!(passed.for_cleanup() >= now + CLEANUP_GRACE, "a timed-out op still waits for its queued work");
        let far = Deadline::at(now + Duration::from_secs(60));
        assert_eq!(far.for_cleanup(), now + Duration::from_secs(60));
    }
}
