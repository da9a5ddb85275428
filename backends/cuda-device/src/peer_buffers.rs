//! Other processes' buffers, mapped through CUDA IPC for one op.
//!
//! CUDA leaves it undefined what happens when an allocation is freed while
//! another process still has it open, and a caller may free its tensor as
//! soon as its op completes: so a mapping is closed before the op completes
//! on any rank (never cached across ops), and only once the kernels that
//! read or wrote through it have finished. An op captured into a CUDA graph
//! is the exception: its graph reads through the mappings on every launch,
//! so they stay open until the group closes (the graph's buffers are the
//! caller's to keep alive as long as it launches the graph).

use std::time::Instant;
use weft::{Result, StreamHandle};
use weft_cuda_driver::{synchronize_stream, DevicePtr, Gpu};

/// Mappings opened for one op, closed by [`PeerBuffers::close`] or on drop.
pub struct PeerBuffers<'a> {
    gpu: &'a dyn Gpu,
    device: usize,
    /// The only stream that uses the mappings.
    stream: StreamHandle,
    deadline: Instant,
    open: Vec<DevicePtr>,
}

impl<'a> PeerBuffers<'a> {
    /// None yet, for work queued on `stream` of `device`.
    pub fn new(gpu: &'a dyn Gpu, device: usize, stream: StreamHandle, deadline: Instant) -> Self {
        PeerBuffers { gpu, device, stream, deadline, open: Vec::new() }
    }

    /// Map the allocation `handle` names; its base address here.
    pub fn map(&mut self, handle: &[u8]) -> Result<DevicePtr> {
        let ptr = self.gpu.ipc_open(self.device, handle)?;
        self.open.push(ptr);
        Ok(ptr)
    }

    /// Keep every mapping open in `kept` (closed when the group closes):
    /// a captured op's graph reads through them on every launch.
    pub fn keep(&mut self, kept: &std::sync::Mutex<Vec<DevicePtr>>) {
        kept.lock().unwrap_or_else(|p| p.into_inner()).append(&mut self.open);
    }

    /// Close every mapping.
    ///
    /// # Safety
    /// No work that uses them is still queued or running.
    pub unsafe fn close(&mut self) {
        for ptr in self.open.drain(..) {
            // SAFETY: opened by `map`; the caller's contract.
            unsafe { self.gpu.ipc_close(ptr) };
        }
    }
}

impl Drop for PeerBuffers<'_> {
    /// On an error path: close once the stream has drained; if it does not
    /// drain in time, leave the mappings open (closing memory a kernel
    /// still uses is worse than leaking a mapping).
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
