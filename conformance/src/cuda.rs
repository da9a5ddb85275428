//! The suite on CUDA memory, through `weft-cuda-driver` (a real GPU, or
//! the emulation under `WEFT_CUDA_EMULATION`).

use crate::placement::{Placement, SharedPlacement};
use crate::{assert_passed, checks_on_threads, Check};
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft::{Device, Error, GroupOptions, ProcessGroup, StreamHandle};
use weft_cuda_driver::{synchronize_stream, Gpu};

/// This process's GPU, for one test at a time: take it first in every test
/// that uses the device in this process. Tests sharing one device run one
/// after another, as `scripts/gpu-tests.sh` runs them on a real one: freeing
/// memory waits for every stream's work, so another test's stream, stalled
/// on purpose, would hold this one up (past its deadline, once, in CI).
pub fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    static DEVICE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    DEVICE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Run `suite` on `w` ranks that are threads of this process, in a group
/// of backend `spec` (`"cpu:NAME,cuda:NAME"`, linked) with group `hints`,
/// every tensor in the memory of CUDA device 0 (a stream of each rank's
/// own); panics with the failing checks' table if any rank has one. The GPU
/// is weft's emulated one unless `WEFT_TEST_REAL_GPU=1`: a CUDA backend's
/// conformance tests run in CI and, unchanged, on a real GPU.
pub fn on_threads(spec: &str, hints: &[(&str, &str)], w: usize, suite: fn(&ProcessGroup, SharedPlacement) -> Vec<Check>) {
    if std::env::var("WEFT_TEST_REAL_GPU").as_deref() != Ok("1") {
        weft_cuda_driver::emulate(1).expect("the emulated GPU");
    }
    let mut opts = GroupOptions::default().backend(spec).timeout(Duration::from_secs(60));
    for (k, v) in hints {
        opts = opts.hint(*k, *v);
    }
    let results = checks_on_threads(opts, w, |pg| suite(pg, placement(0).expect("CUDA device 0")));
    assert_passed(&results, &format!("{spec} {hints:?} W={w}"));
}

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
