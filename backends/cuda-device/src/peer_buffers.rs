//! Other processes' buffers mapped here through CUDA IPC, kept open across
//! ops: opening a handle costs far more than a small all-reduce, and a
//! training loop hands the same buffers to every step.
//!
//! A handle names one allocation (memory freed and allocated again gets a
//! new one), so a cached mapping is never stale; at most [`CAPACITY`] stay
//! open, the least recently used closed first.

use std::time::Instant;
use weft::{Result, StreamHandle};
use weft_cuda_runtime::{synchronize_stream, DevicePtr, Gpu};

/// Mappings kept open per group.
pub const CAPACITY: usize = 16;

/// Open mappings, most recently used last.
#[derive(Default)]
pub struct PeerBuffers {
    open: Vec<(Vec<u8>, DevicePtr)>,
}

impl PeerBuffers {
    /// The base of the allocation `handle` names, mapped on `device`. Before
    /// closing a mapping to make room, waits for `stream` (the only stream
    /// that reads through them) to finish what it was given.
    pub fn map(&mut self, gpu: &dyn Gpu, device: usize, handle: &[u8], stream: StreamHandle, deadline: Instant) -> Result<DevicePtr> {
        if let Some(i) = self.open.iter().position(|(h, _)| h == handle) {
            let hit = self.open.remove(i);
            let ptr = hit.1;
            self.open.push(hit);
            return Ok(ptr);
        }
        if self.open.len() >= CAPACITY {
            synchronize_stream(gpu, device, stream, deadline, "cuda-device: closing a peer buffer")?;
            let (_, old) = self.open.remove(0);
            // SAFETY: opened by ipc_open below; the stream that used it is drained.
            unsafe { gpu.ipc_close(old) };
        }
        let ptr = gpu.ipc_open(device, handle)?;
        self.open.push((handle.to_vec(), ptr));
        Ok(ptr)
    }

    /// Close every mapping.
    ///
    /// # Safety
    /// No stream still uses them.
    pub unsafe fn close_all(&mut self, gpu: &dyn Gpu) {
        for (_, ptr) in self.open.drain(..) {
            // SAFETY: the caller's contract; opened by ipc_open.
            unsafe { gpu.ipc_close(ptr) };
        }
    }
}
