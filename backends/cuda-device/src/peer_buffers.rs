//! Other processes' buffers, mapped through CUDA IPC for one op.
//!
//! CUDA leaves it undefined what happens when an allocation is freed while
//! another process still has it open, and a caller may free its tensor as
//! soon as its op completes: so a mapping is closed before the op completes
//! on any rank (never cached across ops), and only once the kernels that
//! read or wrote through it have finished.
//!
//! An op captured into a CUDA graph is the exception: its graph reads
//! through the mappings on every launch, so they are *kept* ([`Kept`])
//! until the group closes (the graph's buffers are the caller's to keep
//! alive as long as it launches the graph). A kept mapping serves every
//! later op that maps the same allocation, captured or not: CUDA refuses
//! to open a handle that is already open in the context.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;
use weft::{Result, StreamHandle};
use weft_cuda_driver::{synchronize_stream, DevicePtr, Gpu};

/// Mappings kept for captured ops, by (peer rank, IPC handle): closed when
/// the group closes.
pub type Kept = Mutex<HashMap<(usize, Vec<u8>), DevicePtr>>;

/// Mappings opened for one op, closed by [`PeerBuffers::close`] or on drop
/// (or kept, for a captured op).
pub struct PeerBuffers<'a> {
    gpu: &'a dyn Gpu,
    device: usize,
    /// The only stream that uses the mappings.
    stream: StreamHandle,
    deadline: Instant,
    kept: &'a Kept,
    /// The op is being captured: what it maps is kept, never closed.
    captured: bool,
    /// Opened for this op (kept ones are not listed).
    open: Vec<((usize, Vec<u8>), DevicePtr)>,
}

impl<'a> PeerBuffers<'a> {
    /// None yet, for work queued on `stream` of `device` (`captured`: into
    /// a graph, so every mapping is kept in `kept`).
    pub fn new(gpu: &'a dyn Gpu, device: usize, stream: StreamHandle, deadline: Instant, kept: &'a Kept, captured: bool) -> Self {
        PeerBuffers { gpu, device, stream, deadline, kept, captured, open: Vec::new() }
    }

    /// The base address here of rank `peer`'s allocation that `handle`
    /// names: a kept mapping, or one opened now.
    pub fn map(&mut self, peer: usize, handle: &[u8]) -> Result<DevicePtr> {
        let key = (peer, handle.to_vec());
        if let Some(base) = self.kept.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
            return Ok(*base);
        }
        if let Some((_, base)) = self.open.iter().find(|(k, _)| *k == key) {
            return Ok(*base);
        }
        let ptr = self.gpu.ipc_open(self.device, handle)?;
        self.open.push((key, ptr));
        if self.captured {
            self.keep();
        }
        Ok(ptr)
    }

    /// Whether this op opened mappings it must close before it completes.
    pub fn any_open(&self) -> bool {
        !self.open.is_empty()
    }

    /// Move this op's mappings to the kept ones.
    fn keep(&mut self) {
        self.kept.lock().unwrap_or_else(|p| p.into_inner()).extend(self.open.drain(..));
    }

    /// Close every mapping this op opened.
    ///
    /// # Safety
    /// No work that uses them is still queued or running.
    pub unsafe fn close(&mut self) {
        for (_, ptr) in self.open.drain(..) {
            // SAFETY: opened by `map`; the caller's contract.
            unsafe { self.gpu.ipc_close(ptr) };
        }
    }
}

impl Drop for PeerBuffers<'_> {
    /// On an error path: close once the stream has drained; if it does not
    /// drain in time, leave the mappings open (closing memory a kernel
    /// still uses is worse than leaking a mapping). (A captured op's are
    /// kept already: nothing of it has run, and draining a capturing stream
    /// would break the capture.)
    fn drop(&mut self) {
        if self.open.is_empty() {
            return;
        }
        if synchronize_stream(self.gpu, self.device, self.stream, self.deadline, "cuda-device: closing peer buffers").is_ok() {
            // SAFETY: the only stream using them has drained.
            unsafe { self.close() };
        }
    }
}
