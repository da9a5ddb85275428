//! How a rank of a device op tells the others that what they read of it is
//! ready, and that its own reads are done, and how it waits for theirs.
//!
//! - **Eager** ops use interprocess events: a rank records its `ready` or
//!   `done` on its stream; the others order their streams after it on the
//!   device, or on the host where the ranks share a GPU
//!   ([`Peers::after`]). A host round between record and wait says which
//!   record a wait means.
//! - **Captured** ops (the caller's stream is capturing a CUDA graph) can
//!   have no host step at all: a replay runs the graph alone, with no round
//!   in between. So every hand-off is a kernel on the caller's stream over
//!   words each rank maps at setup (the start of its staging allocation):
//!   a rank's `ready` adds one to its op counter and stores it in its
//!   ready flag, its `done` stores the counter in its done flag, and a
//!   wait holds the stream until a peer's flag reaches this rank's counter
//!   ([`Gpu::signal`], [`Gpu::wait_flag`]).
//!
//! Counters agree because every rank launches the same captured ops in
//! the same order (as NCCL asks of graphs, and as a rank's op sequence
//! must match anyway). A rank is at most one op ahead of another: its next
//! op's reads wait for the other's `ready` of that op, and no op ends
//! before every reader's `done`. So "at least my counter" is exact.

use crate::setup::Peers;
use std::time::{Duration, Instant};
use weft::{Result, StreamHandle};
use weft_cuda_driver::{DevicePtr, Gpu};

/// Offset of a rank's op counter in its hand-off words.
const COUNTER: u64 = 0;
/// Offset of its ready flag.
const READY: u64 = 8;
/// Offset of its done flag.
const DONE: u64 = 16;

/// Offset of a word no hand-off uses (setup loads the kernels on it).
const SCRATCH: u64 = 24;

/// Queue on `stream` a signal and a wait on the scratch word of this
/// rank's hand-off words at `flags` (zeroed: both pass at once), so the
/// two kernels are compiled and loaded now rather than inside a capture
/// (NVRTC and a module load there may be refused).
///
/// # Safety
/// `flags` holds the rank's zeroed hand-off words until the stream has run these.
pub unsafe fn load_kernels(gpu: &dyn Gpu, stream: StreamHandle, flags: DevicePtr) -> Result<()> {
    // SAFETY: the caller's contract; the scratch word is no peer's flag.
    unsafe {
        gpu.signal(stream, flags + COUNTER, false, flags + SCRATCH)?;
        gpu.wait_flag(stream, flags + COUNTER, flags + SCRATCH, Duration::from_secs(10))
    }
}

/// One op's hand-offs on `stream`.
pub struct Handoff<'a> {
    ring: &'a Peers,
    stream: StreamHandle,
    /// Captured: on the device alone, waiting at most this long each
    /// (measured when the graph runs); else through events, by `deadline`.
    captured: Option<Duration>,
    deadline: Instant,
}

impl<'a> Handoff<'a> {
    /// The hand-offs of an op queued on `stream`: through flags if
    /// `captured` (each wait bounded by `timeout`), else through events.
    pub fn new(ring: &'a Peers, stream: StreamHandle, captured: bool, timeout: Duration, deadline: Instant) -> Handoff<'a> {
        Handoff { ring, stream, captured: captured.then_some(timeout), deadline }
    }

    /// The stream the op's work is queued on.
    pub fn stream(&self) -> StreamHandle {
        self.stream
    }

    /// Whether the op is being captured into a graph.
    pub fn captured(&self) -> bool {
        self.captured.is_some()
    }

    /// What this rank exposes is ready (after the work queued so far).
    pub fn ready(&self) -> Result<()> {
        let (r, g) = (self.ring, &self.ring.gpu);
        match self.captured {
            // SAFETY: this rank's hand-off words, allocated for the group's life.
            Some(_) => unsafe { g.signal(self.stream, r.flags + COUNTER, true, r.flags + READY) },
            None => g.record(r.ready, self.stream),
        }
    }

    /// This rank's reads are done (after the work queued so far).
    pub fn done(&self) -> Result<()> {
        let (r, g) = (self.ring, &self.ring.gpu);
        match self.captured {
            // SAFETY: as in `ready`.
            Some(_) => unsafe { g.signal(self.stream, r.flags + COUNTER, false, r.flags + DONE) },
            None => g.record(r.done, self.stream),
        }
    }

    /// Order the stream after rank `peer`'s `ready` of this op.
    pub fn after_ready(&self, peer: usize, what: &str) -> Result<()> {
        self.after(peer, READY, what)
    }

    /// Order the stream after rank `peer`'s `done` of this op.
    pub fn after_done(&self, peer: usize, what: &str) -> Result<()> {
        self.after(peer, DONE, what)
    }

    fn after(&self, peer: usize, flag: u64, what: &str) -> Result<()> {
        let r = self.ring;
        match self.captured {
            // SAFETY: this rank's counter, and the peer's words, mapped
            // here for the group's life.
            Some(limit) => unsafe { r.gpu.wait_flag(self.stream, r.flags + COUNTER, r.ranks_flags[peer] + flag, limit) },
            None => {
                let event = if flag == READY { r.ranks_ready[peer] } else { r.ranks_done[peer] };
                r.after(self.stream, event, self.deadline, what)
            }
        }
    }
}
