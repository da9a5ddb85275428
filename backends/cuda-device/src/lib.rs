//! `cuda-device`: all_reduce GPU to GPU for ranks on one host (one process
//! per GPU, or several processes sharing one). Buffers and receive slots
//! allocated with `cuMemAlloc` are shared through CUDA IPC handles, and IPC
//! events order the ranks' streams. Where every rank uses the same GPU,
//! each reduces its block of all the ranks' buffers in one kernel
//! (`direct.rs`); otherwise, or where a buffer cannot be exported, the ring
//! (reduce-scatter + all-gather, pipelined in slot-sized pieces) moves the
//! data (`ring.rs`). The other ops are staged through the host (the same
//! code as `cuda-host-staging`).
//!
//! Created only when every rank is on this host and every rank can export
//! and open the IPC handles; otherwise creation fails with `Unsupported` on
//! every rank and `auto` falls back to `cuda-host-staging`.

#![warn(missing_docs)]

mod agree;
mod direct;
mod peer_buffers;
mod ring;
mod setup;
mod window;

use setup::Peers;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use weft::backend::{Backend, BackendContext, Op, OpContext};
use weft::registry::{BackendFactory, StaticBackend};
use weft::stream::DeviceCompletion;
use weft::{Device, DeviceKind, Error, Layout, Result, StreamHandle};
use weft_cuda_driver::{order_after, synchronize_stream, StreamCompletion};
use weft_cuda_host_staging::Staging;

/// The registration of `cuda-device`.
pub struct CudaDevice;

impl BackendFactory for CudaDevice {
    fn name(&self) -> &str {
        "cuda-device"
    }
    fn devices(&self) -> &[DeviceKind] {
        &[DeviceKind::Cuda]
    }
    fn layouts(&self) -> &[Layout] {
        // Sparse tensors are staged (the sparse all-reduce runs on the host).
        &[Layout::Dense, Layout::SparseCoo]
    }
    fn priority(&self) -> i32 {
        20
    }
    fn probe(&self) -> std::result::Result<(), String> {
        weft_cuda_driver::gpu().map(|_| ())
    }
    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>> {
        let staging = Staging::for_group(&ctx, "cuda-device")?;
        let gpu = staging.gpu();
        weft::locality::check("cuda-device", &ctx)?;
        let ring = Peers::connect(&ctx, gpu.clone())?;
        let stream = gpu.new_stream(ring.device)?;
        Ok(Arc::new(DeviceBackend { staging, ring: Mutex::new(ring), stream }))
    }
}

struct DeviceBackend {
    staging: Staging,
    /// One ring op at a time (ops of a group are serial anyway).
    ring: Mutex<Peers>,
    stream: StreamHandle,
}

impl DeviceBackend {
    fn all_reduce(&self, buf: &mut weft::TensorMut<'_>, op: weft::ReduceOp, ctx: &OpContext, algorithm: Algorithm) -> Result<()> {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        if buf.device() != Device::Cuda(ring.device as u32) {
            return Err(Error::invalid(format!(
                "cuda-device: this rank's ring is on cuda:{}, the tensor on {} (choose the device with the group hint cuda_device=N or LOCAL_RANK)",
                ring.device,
                buf.device()
            )));
        }
        let g = ring.gpu.clone();
        let caller = ctx.stream.unwrap_or_default();
        order_after(&*g, ring.device, self.stream, caller)?;
        let cpu = &**self.staging.cpu();
        let r = (|| {
            if let weft::ReduceOp::PremulSum(f) = op {
                // SAFETY: the op's buffer, on this stream after the caller's work.
                unsafe { g.premul(self.stream, buf.as_ptr() as u64, buf.numel(), buf.dtype(), f)? };
            }
            if algorithm != Algorithm::Ring && direct::all_reduce(&ring, cpu, ctx, self.stream, buf, op, algorithm == Algorithm::Direct)? {
                return Ok(());
            }
            ring::all_reduce(&ring, cpu, ctx, self.stream, buf, op)
        })();
        let done = RingCompletion {
            inner: StreamCompletion::record(g, ring.device, self.stream, caller)?,
            others: ring.others.clone(),
            op: ctx.name,
            rank: ctx.rank,
        };
        if let Err(e) = r {
            // Nothing queued may outlive the failed op (it touches the caller's memory).
            let _ = done.synchronize(ctx.deadline.for_cleanup());
            return Err(done.explain(e));
        }
        ctx.completion.set(Arc::new(done));
        Ok(())
    }
}

/// How `cuda-device` runs an all_reduce (hint `cuda_algorithm`).
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
enum Algorithm {
    /// Direct where the ranks share one GPU and it can run, else the ring
    /// (the default).
    Auto,
    /// Direct, or an `Unsupported` error.
    Direct,
    Ring,
    /// Through host memory, as every other op.
    Staging,
}

impl Algorithm {
    /// The hint `cuda_algorithm`; without it, the algorithm the op was
    /// told to use (`algorithm`, `WEFT_ALGORITHM`): `ring` is the device
    /// ring, any other of core's runs on the host, staged.
    fn from_hints(ctx: &OpContext) -> Result<Algorithm> {
        Ok(match ctx.hints.get("cuda_algorithm").map(String::as_str) {
            None => match ctx.algorithm {
                None => Algorithm::Auto,
                Some("ring") => Algorithm::Ring,
                Some(_) => Algorithm::Staging,
            },
            Some("auto") => Algorithm::Auto,
            Some("direct") => Algorithm::Direct,
            Some("ring") => Algorithm::Ring,
            Some("staging") => Algorithm::Staging,
            Some(v) => return Err(Error::invalid(format!("hint cuda_algorithm={v:?}: \"auto\", \"direct\", \"ring\" or \"staging\""))),
        })
    }
}

/// The device side of a ring or direct all_reduce; a failure or timeout while a neighbour's
/// process is gone is reported as that peer lost (its events will never
/// complete), not as an anonymous device error.
struct RingCompletion {
    inner: StreamCompletion,
    others: Vec<(usize, u32)>,
    op: &'static str,
    rank: usize,
}

impl RingCompletion {
    fn explain(&self, e: Error) -> Error {
        if matches!(e.kind(), weft::ErrorKind::PeerLost { .. }) {
            // Already names the lost peer (a neighbour gone now may only
            // have exited after seeing that same loss).
            return e.with_op(self.op).with_rank(self.rank);
        }
        match setup::first_gone(&self.others) {
            Some((peer, pid)) => {
                Error::peer_lost(peer, format!("rank {peer} (pid {pid}) exited while the ring waited for it on the GPU: {e}"))
                    .with_op(self.op)
                    .with_rank(self.rank)
            }
            None => e.with_op(self.op).with_rank(self.rank),
        }
    }
}

impl DeviceCompletion for RingCompletion {
    fn order_caller_stream(&self) -> Result<()> {
        self.inner.order_caller_stream()
    }
    fn is_complete(&self) -> Result<bool> {
        self.inner.is_complete().map_err(|e| self.explain(e))
    }
    fn synchronize(&self, deadline: Instant) -> Result<()> {
        self.inner.synchronize(deadline).map_err(|e| self.explain(e))
    }
}

impl DeviceBackend {
    /// The CPU backend its host-side bytes go through.
    fn cpu(&self) -> &Arc<dyn Backend> {
        self.staging.cpu()
    }
}

impl Drop for DeviceBackend {
    fn drop(&mut self) {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        let _ = synchronize_stream(&*ring.gpu, ring.device, self.stream, deadline, "closing cuda-device");
        ring.gpu.destroy_stream(self.stream);
    }
}

impl Backend for DeviceBackend {
    fn name(&self) -> &str {
        "cuda-device"
    }
    // Point-to-point ops go through the host, as in cuda-host-staging.
    weft_cuda_host_staging::staged_transport!(staging);
    fn native_op(&self, op: &mut Op<'_>, ctx: &OpContext) -> Option<Result<()>> {
        Some(match op {
            Op::AllReduce { buf, op } => match Algorithm::from_hints(ctx) {
                Ok(Algorithm::Staging) => self.staging.run(&mut Op::AllReduce { buf: buf.reborrow(), op: *op }, ctx),
                Ok(algorithm) => self.all_reduce(buf, *op, ctx, algorithm),
                Err(e) => Err(e),
            },
            _ => self.staging.run(op, ctx),
        })
    }
    /// Windows in device memory, mapped by every rank (`window.rs`).
    fn window(&self, spec: &weft::window::WindowSpec) -> Option<Result<Arc<dyn weft::window::WindowTransport>>> {
        let gpu = self.staging.gpu();
        Some(window::CudaWindow::create(gpu.clone(), spec).map(|w| Arc::new(w) as Arc<dyn weft::window::WindowTransport>))
    }
}

static CUDA_DEVICE: CudaDevice = CudaDevice;
weft::inventory::submit! { StaticBackend(&CUDA_DEVICE) }

/// Reference this crate so the linker keeps its registration.
pub fn link() {}
