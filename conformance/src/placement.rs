//! Where the suite's tensors live: host memory, or a device that the
//! suite reaches the way a user program would (copies on the caller's
//! stream), so device backends are checked end to end, stream order
//! included.

use std::sync::Arc;
use weft::{Device, StreamHandle};

/// A device the suite can put its buffers on.
pub trait Placement: Send + Sync {
    /// The device tensors are on.
    fn device(&self) -> Device;
    /// The stream ops are issued on (made current while the suite runs).
    fn stream(&self) -> StreamHandle;
    /// New device memory of `bytes`; returns its address.
    fn alloc(&self, bytes: usize) -> weft::Result<u64>;
    /// Queue a copy of `data` to `addr` on the stream; `data` stays alive
    /// until [`Placement::free`] of that memory.
    fn upload(&self, addr: u64, data: &[u8]) -> weft::Result<()>;
    /// Copy from `addr` on the stream and wait for it.
    fn download(&self, addr: u64, out: &mut [u8]) -> weft::Result<()>;
    /// Copy `bytes` between device buffers on the stream and wait for it
    /// (the memory-bandwidth reference of `weft bench`).
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> weft::Result<()>;
    /// Release memory from `alloc` after the stream's work on it.
    fn free(&self, addr: u64);
}

/// A shared placement.
pub type SharedPlacement = Arc<dyn Placement>;
