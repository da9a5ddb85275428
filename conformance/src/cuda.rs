//! The suite on CUDA memory, through `weft-cuda-driver` (a real GPU, or
//! the emulation under `WEFT_CUDA_EMULATION`).

use crate::placement::{Placement, SharedPlacement};
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft::{Device, Error, StreamHandle};
use weft_cuda_driver::{synchronize_stream, Gpu};

/// CUDA device `ordinal` with a stream of its own as the caller's stream.
pub fn placement(ordinal: usize) -> weft::Result<SharedPlacement> {
    let gpu = weft_cuda_driver::gpu().map_err(Error::unsupported)?;
    let stream = gpu.new_stream(ordinal)?;
    Ok(Arc::new(CudaPlacement { gpu, ordinal, stream }))
}

/// The device a launcher's local rank uses: `LOCAL_RANK` (else `rank`)
/// modulo the device count.
pub fn local_placement(rank: usize) -> weft::Result<SharedPlacement> {
    let gpu = weft_cuda_driver::gpu().map_err(Error::unsupported)?;
    let local: usize = std::env::var("LOCAL_RANK").ok().and_then(|v| v.parse().ok()).unwrap_or(rank);
    placement(local % gpu.device_count().max(1))
}

struct CudaPlacement {
    gpu: Arc<dyn Gpu>,
    ordinal: usize,
    stream: StreamHandle,
}

impl CudaPlacement {
    fn sync(&self) -> weft::Result<()> {
        synchronize_stream(
            &*self.gpu,
            self.ordinal,
            self.stream,
            Instant::now() + Duration::from_secs(120),
            "the conformance suite's copies",
        )
    }
}

impl Drop for CudaPlacement {
    fn drop(&mut self) {
        let _ = self.sync();
        self.gpu.destroy_stream(self.stream);
    }
}

impl Placement for CudaPlacement {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal as u32)
    }
    fn stream(&self) -> StreamHandle {
        self.stream
    }
    fn alloc(&self, bytes: usize) -> weft::Result<u64> {
        self.gpu.alloc(self.ordinal, bytes)
    }
    fn upload(&self, addr: u64, data: &[u8]) -> weft::Result<()> {
        // SAFETY: `addr` holds data.len() bytes; `data` outlives the copy
        // (the trait's contract).
        unsafe { self.gpu.copy_htod(self.stream, addr, data.as_ptr(), data.len()) }
    }
    fn download(&self, addr: u64, out: &mut [u8]) -> weft::Result<()> {
        // SAFETY: `out` lives until the sync below returns.
        unsafe { self.gpu.copy_dtoh(self.stream, out.as_mut_ptr(), addr, out.len())? };
        self.sync()
    }
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> weft::Result<()> {
        // SAFETY: both are allocations of this placement of at least `bytes`.
        unsafe { self.gpu.copy_dtod(self.stream, dst, src, bytes)? };
        self.sync()
    }
    fn free(&self, addr: u64) {
        let _ = self.sync();
        // SAFETY: allocated by `alloc`; the stream's work on it is done.
        unsafe { self.gpu.free(addr) }
    }
}
