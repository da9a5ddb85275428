//! Who naps on a rank's doorbell, in one word of its control block.
//!
//! More than one thread of a rank can nap at once (a collective's wait on
//! the caller's thread, the progress thread driving background
//! point-to-point), on the one doorbell. The word counts them, and an
//! armed bit says a waker must make the wake-up call: the first waker to
//! find it set clears it and wakes every napper, so of the many wakers
//! that find a rank napping one makes the system call. A napper that
//! leaves while another still naps leaves the bit as it is: a flag that
//! the first to wake took down would leave the other asleep, unseen by
//! every later waker, until its nap's bound.

use std::sync::atomic::{AtomicU32, Ordering};

/// Bit 0: armed; the rest: how many threads nap.
const ARMED: u32 = 1;
const ONE: u32 = 2;

/// The word (in the segment: a plain `u32`, zero when nobody naps).
#[repr(transparent)]
#[derive(Default)]
pub struct Nappers(AtomicU32);

impl Nappers {
    /// A thread is about to nap: counted, and the bit armed. SeqCst, as
    /// the napper's fence and last look after it rely on.
    pub(crate) fn enter(&self) {
        let _ = self.0.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |s| Some((s + ONE) | ARMED));
    }

    /// A napper is awake again: uncounted; the last one out also disarms.
    pub(crate) fn leave(&self) {
        let _ = self.0.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |s| Some(if s / ONE <= 1 { 0 } else { s - ONE }));
    }

    /// Whether a waker must call: some thread naps, and no waker has woken
    /// it yet (a plain load: most wakes find nobody, and a write would
    /// take the line from the owner each time). `order`: SeqCst where the
    /// waker's fence pairs with the napper's, Relaxed where a barrier does
    /// (see `ShmBackend::notify`).
    pub(crate) fn armed(&self, order: Ordering) -> bool {
        self.0.load(order) & ARMED != 0
    }

    /// Disarm: true for the one waker that must now wake every napper.
    pub(crate) fn disarm(&self) -> bool {
        self.armed(Ordering::SeqCst) && self.0.fetch_and(!ARMED, Ordering::SeqCst) & ARMED != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_napper_is_woken_once() {
        let n = Nappers::default();
        assert!(!n.armed(Ordering::SeqCst));
        n.enter();
        assert!(n.armed(Ordering::SeqCst));
        assert!(n.disarm(), "the first waker calls");
        assert!(!n.disarm(), "later ones need not");
        n.leave();
        assert!(!n.armed(Ordering::SeqCst));
        n.enter();
        assert!(n.disarm(), "a new nap is armed again");
        n.leave();
    }

    #[test]
    fn a_napper_leaving_keeps_the_other_reachable() {
        let n = Nappers::default();
        n.enter();
        n.enter();
        n.leave();
        assert!(n.armed(Ordering::SeqCst), "the thread still napping must be woken by the next waker");
        assert!(n.disarm());
        n.leave();
        assert!(!n.armed(Ordering::SeqCst));
        assert_eq!(n.0.load(Ordering::SeqCst), 0, "nobody naps");
    }

    #[test]
    fn a_napper_after_a_wake_arms_again() {
        let n = Nappers::default();
        n.enter();
        assert!(n.disarm());
        // The woken napper has not left yet when another starts to nap.
        n.enter();
        assert!(n.armed(Ordering::SeqCst));
        n.leave();
        assert!(n.disarm(), "the second napper is still to be woken");
        n.leave();
        assert_eq!(n.0.load(Ordering::SeqCst), 0);
    }
}
