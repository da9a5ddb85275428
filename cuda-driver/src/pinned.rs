//! Page-locked staging memory, allocated once and reused across ops.

use crate::gpu::Gpu;
use std::sync::Arc;
use weft::Result;

/// A pinned host buffer that grows on demand and is kept between ops.
pub struct PinnedPool {
    gpu: Arc<dyn Gpu>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pool owns its allocation; users borrow it through &mut self.
unsafe impl Send for PinnedPool {}

impl PinnedPool {
    /// An empty pool.
    pub fn new(gpu: Arc<dyn Gpu>) -> PinnedPool {
        PinnedPool { gpu, ptr: std::ptr::null_mut(), len: 0 }
    }

    /// Bytes held now (a larger `get` reallocates).
    pub fn capacity(&self) -> usize {
        self.len
    }

    /// At least `bytes` of pinned memory (contents unspecified). The caller
    /// must have finished every copy into or out of the previous buffer.
    pub fn get(&mut self, bytes: usize) -> Result<*mut u8> {
        if bytes > self.len || self.ptr.is_null() {
            self.release();
            // Grow geometrically so a slowly growing size does not reallocate each time.
            let len = bytes.max(self.len * 2).max(4096);
            self.ptr = self.gpu.alloc_pinned(len)?;
            self.len = len;
        }
        Ok(self.ptr)
    }

    fn release(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: allocated by this gpu; `get`'s contract says no copy
            // still uses it.
            unsafe { self.gpu.free_pinned(self.ptr) };
            self.ptr = std::ptr::null_mut();
            self.len = 0;
        }
    }
}

impl Drop for PinnedPool {
    fn drop(&mut self) {
        self.release();
    }
}
