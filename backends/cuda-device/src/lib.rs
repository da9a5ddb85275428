//! `cuda-device`: collectives GPU to GPU for ranks on one host (one process
//! per GPU, or several processes sharing one). Buffers and receive slots
//! allocated with `cuMemAlloc` are shared through CUDA IPC handles, and IPC
//! events order the ranks' streams. all_reduce: where every rank uses the
//! same GPU, each reduces its block of all the ranks' buffers in one kernel
//! (`direct.rs`); otherwise, or where a buffer cannot be exported, the ring
//! (reduce-scatter + all-gather, pipelined in slot-sized pieces) moves the
//! data (`ring.rs`). Every other collective: each rank pulls what it needs
//! from its peers' buffers (`pull.rs`). Point-to-point ops move in chunks
//! through every rank's outboxes, with device-side hand-offs (`p2p.rs`).
//! Collectives that cannot run on the device are staged through the host
//! (the same code as `cuda-host-staging`). On a stream capturing a CUDA
//! graph, all_reduce, the pulled ops and point-to-point record their work
//! into the graph with device-side hand-offs (`handoff.rs`, `p2p.rs`); the
//! rest is refused.
//!
//! Created only when every rank is on this host and every rank can export
//! and open the IPC handles; otherwise creation fails with `Unsupported` on
//! every rank and `auto` falls back to `cuda-host-staging`.

#![warn(missing_docs)]

mod agree;
mod direct;
mod handoff;
mod p2p;
mod peer_buffers;
mod pull;
mod ring;
mod setup;
mod window;

use handoff::Handoff;
use setup::Peers;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
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
        // Ranks that are threads of one process on several GPUs have no
        // peer access to each other's words: their sends and receives stay
        // staged through the host.
        let threads = (1..ring.pids.len()).any(|i| ring.pids[..i].contains(&ring.pids[i]));
        let p2p_eager = !threads;
        // Without the hand-off kernels (no NVRTC), nothing waits on the device.
        let p2p = ((ring.one_gpu || !threads) && ring.kernels)
            .then(|| p2p::DeviceP2p::new(gpu.clone(), ring.device, ctx.rank, ring.p2p, ring.ranks_flags.clone(), ring.others.clone()));
        let mut caps = weft::backend::Capabilities { native_algorithms: NATIVE, ..staging.capabilities().clone() };
        // A message moves through its sender's outbox for this rank, which
        // only a receive from that sender reads.
        caps.receives_from_any &= p2p.is_none();
        Ok(Arc::new(DeviceBackend { staging, ring: Mutex::new(ring), stream, p2p, p2p_eager, caps }))
    }
}

struct DeviceBackend {
    staging: Staging,
    /// One ring op at a time (ops of a group are serial anyway).
    ring: Mutex<Peers>,
    stream: StreamHandle,
    /// Point-to-point on the device (`p2p.rs`); `None`: staged through the host.
    p2p: Option<p2p::DeviceP2p>,
    /// Whether eager point-to-point ops run on the device too, not only
    /// captured ones: not where ranks are threads of one process. They
    /// share a CUDA context, whose `cuMemFree` waits for all its work, so
    /// one rank freeing memory would wait for another's receive spinning on
    /// the device for a send the first has not issued yet.
    p2p_eager: bool,
    caps: weft::backend::Capabilities,
}

impl DeviceBackend {
    fn all_reduce(&self, buf: &mut weft::TensorMut<'_>, op: weft::ReduceOp, ctx: &OpContext, algorithm: Algorithm) -> Result<()> {
        let ptr = buf.as_ptr() as u64;
        let (count, dtype) = (buf.numel(), buf.dtype());
        self.on_device(ctx, Some(buf.device()), |ring, cpu, h| {
            let (g, stream) = (&ring.gpu, h.stream());
            let premul = |f: f64| -> Result<()> {
                // SAFETY: the op's buffer, on this stream after the caller's work.
                unsafe { g.premul(stream, ptr, count, dtype, f) }
            };
            let factor = match op {
                weft::ReduceOp::PremulSum(f) => Some(f),
                _ => None,
            };
            if h.captured() {
                if ctx.size == 1 {
                    return factor.map_or(Ok(()), premul).map(|()| true); // (Nothing to exchange or divide.)
                }
                // The direct path scales the input once every rank has found
                // it can run: a refused op leaves nothing in the graph.
                return direct::all_reduce(ring, cpu, ctx, h, buf, op, factor, Required::Capture);
            }
            factor.map_or(Ok(()), premul)?;
            if algorithm != Algorithm::Ring && direct::all_reduce(ring, cpu, ctx, h, buf, op, None, Required::of(algorithm, h))? {
                return Ok(true);
            }
            ring::all_reduce(ring, cpu, ctx, stream, buf, op).map(|()| true)
        })
        .map(drop)
    }

    /// Any other collective: pulled device to device (`pull.rs`), or,
    /// where every rank learns it cannot be, staged through the host.
    fn pulled(&self, op: &mut Op<'_>, ctx: &OpContext, algorithm: Algorithm) -> Result<()> {
        let device = first_device(op);
        if self.on_device(ctx, device, |ring, cpu, h| pull::run(ring, cpu, ctx, h, op, Required::of(algorithm, h)))? {
            return Ok(());
        }
        self.staged(op, ctx)
    }

    /// Run `f` on this backend's stream, ordered after the caller's; its
    /// completion (the caller's stream waits for it) is the op's. `f`
    /// returns false where it did nothing the op needs (every rank then
    /// runs the op another way): this rank's stream is drained first, since
    /// what `f` queued may still read the caller's buffers.
    ///
    /// Where the caller's stream is capturing a CUDA graph, `f` queues the
    /// op on that stream itself, with hand-offs on the device alone
    /// (`handoff.rs`), and must run it there (no other way can be captured).
    fn on_device(
        &self,
        ctx: &OpContext,
        device: Option<Device>,
        f: impl FnOnce(&Peers, &dyn Backend, &Handoff<'_>) -> Result<bool>,
    ) -> Result<bool> {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = device.filter(|d| *d != Device::Cuda(ring.device as u32)) {
            return Err(Error::invalid(format!(
                "cuda-device: this rank's ring is on cuda:{}, the tensor on {d} (choose the device with the group hint cuda_device=N or LOCAL_RANK)",
                ring.device
            )));
        }
        let g = ring.gpu.clone();
        let caller = ctx.stream.unwrap_or_default();
        let cpu = &**self.staging.cpu();
        let deadline = ctx.deadline.get();
        if g.is_capturing(caller)? {
            let threads = (1..ring.pids.len()).any(|i| ring.pids[..i].contains(&ring.pids[i]));
            if !ring.one_gpu && threads {
                // A kernel of a process reaches another GPU's memory only
                // with peer access, which nothing enables for its own ranks
                // (every rank decides alike: it knows every rank's process).
                return Err(Error::unsupported(
                    "cuda-device: where the ranks use several GPUs and some are threads of one process, an op cannot be captured into a CUDA graph (a thread's kernels cannot reach another GPU's hand-off words without peer access)",
                )
                .with_op(ctx.name)
                .with_rank(ctx.rank));
            }
            // Each launch of the graph waits at most the op's timeout for a peer.
            let h = Handoff::new(&ring, caller, true, deadline.saturating_duration_since(Instant::now()), deadline);
            return match f(&ring, cpu, &h) {
                Ok(true) => {
                    ctx.completion.set(Arc::new(Captured));
                    Ok(true)
                }
                Ok(false) => Err(Error::unsupported("cuda-device: this op cannot be captured into a CUDA graph")),
                Err(e) => Err(e.with_op(ctx.name).with_rank(ctx.rank)),
            };
        }
        order_after(&*g, ring.device, self.stream, caller)?;
        let h = Handoff::new(&ring, self.stream, false, Duration::ZERO, deadline);
        let r = f(&ring, cpu, &h);
        if let Ok(false) = r {
            synchronize_stream(&*g, ring.device, self.stream, ctx.deadline.for_cleanup(), ctx.name)?;
            return Ok(false);
        }
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
        Ok(true)
    }
}

/// The device of `op`'s first tensor (every tensor of an op is on one).
fn first_device(op: &Op<'_>) -> Option<Device> {
    Some(match op {
        Op::Broadcast { buf, .. } | Op::Reduce { buf, .. } => buf.device(),
        Op::AllGather { input, .. } | Op::Gather { input, .. } => input.device(),
        Op::ReduceScatter { output, .. } | Op::Scatter { output, .. } => output.device(),
        Op::AllToAll { inputs, .. } => inputs.first()?.device(),
        _ => return None,
    })
}

/// Whether an op must run on the device path, and why: else it falls back
/// (to the ring, or staged through the host) where that path cannot run.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
enum Required {
    No,
    /// The hint `cuda_algorithm=direct` (or `algorithm=direct`) asks for it.
    Hint,
    /// The caller's stream is capturing a CUDA graph, which no host step
    /// can join.
    Capture,
}

impl Required {
    fn of(algorithm: Algorithm, h: &Handoff<'_>) -> Required {
        match (h.captured(), algorithm) {
            (true, _) => Required::Capture,
            (false, Algorithm::Direct) => Required::Hint,
            _ => Required::No,
        }
    }

    fn is_required(self) -> bool {
        self != Required::No
    }

    /// Where the device path cannot run because of `why`: `Ok(false)` (the
    /// op falls back), or, where it is required, `Unsupported` saying why.
    fn fallback(self, why: String) -> Result<bool> {
        match self {
            Required::No => Ok(false),
            Required::Hint => Err(Error::unsupported(format!(
                "cuda-device: the direct algorithm was asked for (algorithm or cuda_algorithm=direct): {why}"
            ))),
            Required::Capture => Err(Error::unsupported(format!("cuda-device: this op cannot be captured into a CUDA graph: {why}"))),
        }
    }
}

/// `InvalidArgument`, alike on every rank, where ranks disagree whether
/// an op is captured into a CUDA graph (`unlike`: the ranks that differ
/// from this one, which captures it or not): the hand-offs of the two ways
/// do not meet, and an eager rank would read what a graph has not yet run.
fn capture_mismatch(unlike: &[usize], captured: bool) -> Error {
    let (they, me) = if captured { ("do not capture", "does") } else { ("capture", "does not") };
    Error::invalid(format!(
        "cuda-device: mismatched capture: rank(s) {unlike:?} {they} this op into a CUDA graph and this rank {me}: every rank must capture the same ops"
    ))
}

/// How `cuda-device` runs a collective (hint `cuda_algorithm`): all_reduce
/// directly or on the ring, the others pulled (`Direct`, `Auto`) or staged.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
enum Algorithm {
    /// Direct where the ranks share one GPU and it can run, else the ring
    /// (the default).
    Auto,
    /// Direct, or an `Unsupported` error.
    Direct,
    Ring,
    /// Through host memory (as point-to-point ops always are).
    Staging,
}

/// The algorithms cuda-device offers where core chooses one for every
/// backend (`weft::algorithms::select`: hint `algorithm`, `WEFT_ALGORITHM`),
/// beside core's names: `direct` (all_reduce's direct algorithm, the other
/// families pulled, or an error) and `staging` (through the host). A named
/// `ring` is all_reduce's device ring; core's other names run staged.
/// (reduce_scatter, gather and scatter, which core has one way to run,
/// take the same names through the hint `cuda_algorithm`.)
const NATIVE: &[weft::backend::NativeAlgorithm] = &{
    use weft::algorithms::select::Family::{AllGather, AllReduce, AllToAll, Broadcast, Reduce};
    use weft::backend::NativeAlgorithm as N;
    [
        N { family: AllReduce, name: "direct" },
        N { family: AllReduce, name: "staging" },
        N { family: Broadcast, name: "direct" },
        N { family: Broadcast, name: "staging" },
        N { family: Reduce, name: "direct" },
        N { family: Reduce, name: "staging" },
        N { family: AllToAll, name: "direct" },
        N { family: AllToAll, name: "staging" },
        N { family: AllGather, name: "direct" },
        N { family: AllGather, name: "staging" },
    ]
};

impl Algorithm {
    /// The hint `cuda_algorithm`; without it, the algorithm the op was
    /// told to use where core chooses (`algorithm`, `WEFT_ALGORITHM`,
    /// checked against core's names and [`NATIVE`]): `direct` and
    /// `staging` as above, `ring` the device ring, any other of core's
    /// runs on the host, staged.
    fn from_hints(ctx: &OpContext) -> Result<Algorithm> {
        Ok(match ctx.hints.get("cuda_algorithm").map(String::as_str) {
            None => match ctx.algorithm {
                None => Algorithm::Auto,
                Some("direct") => Algorithm::Direct,
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

/// The device side of an op run on this backend's stream; a failure or timeout while a neighbour's
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
        setup::blame_gone(&self.others, e, "the ring").with_op(self.op).with_rank(self.rank)
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

/// The device side of an op captured into a CUDA graph: its work is on
/// the caller's stream, in the graph, and runs when the graph is launched;
/// there is nothing to order or wait for on the host meanwhile.
struct Captured;

impl DeviceCompletion for Captured {
    fn order_caller_stream(&self) -> Result<()> {
        Ok(())
    }
    fn is_complete(&self) -> Result<bool> {
        Ok(true)
    }
    fn synchronize(&self, _deadline: Instant) -> Result<()> {
        Ok(())
    }
}

impl DeviceBackend {
    /// Run `op` staged through the host (`cuda-host-staging`'s pipeline),
    /// on core's algorithm the op was told to use, if any: a name of
    /// cuda-device's own ([`NATIVE`]) chose the staging itself.
    fn staged(&self, op: &mut Op<'_>, ctx: &OpContext) -> Result<()> {
        if ctx.algorithm.is_some_and(|a| NATIVE.iter().any(|n| n.name == a)) {
            return self.staging.run(op, &OpContext { algorithm: None, ..ctx.clone() });
        }
        self.staging.run(op, ctx)
    }

    /// Run a send, a receive or a batch issued as an op of the group (a
    /// `sendrecv`, a batch) on the device (`p2p.rs`): posted, then the
    /// CPU backend driven until its records have been exchanged; the device
    /// work is left in the op's completion.
    fn p2p_now(&self, p2p: &p2p::DeviceP2p, op: &Op<'_>, ctx: &OpContext) -> Result<()> {
        let result: Arc<Mutex<Option<Result<()>>>> = Arc::default();
        let set = result.clone();
        let done: weft::backend::progress::Done = Box::new(move |r| *set.lock().unwrap_or_else(|p| p.into_inner()) = Some(r));
        // SAFETY: this returns only once `done` has run; the device work
        // left in `ctx.completion` keeps the tensors, as every device op's.
        unsafe { p2p.post(&**self.cpu(), op, ctx.stream, ctx.deadline.get(), ctx.completion.clone(), done) };
        let finished = || result.lock().unwrap_or_else(|p| p.into_inner()).is_some();
        self.cpu().progress(&finished);
        let r = result.lock().unwrap_or_else(|p| p.into_inner()).take();
        r.unwrap_or_else(|| Err(Error::backend("cuda-device: a point-to-point op's records were never exchanged")))
    }

    /// The CPU backend its host-side bytes go through.
    fn cpu(&self) -> &Arc<dyn Backend> {
        self.staging.cpu()
    }
}

impl Drop for DeviceBackend {
    fn drop(&mut self) {
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        if let Some(p2p) = &self.p2p {
            p2p.close(deadline);
        }
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let _ = synchronize_stream(&*ring.gpu, ring.device, self.stream, deadline, "closing cuda-device");
        ring.gpu.destroy_stream(self.stream);
    }
}

impl Backend for DeviceBackend {
    fn name(&self) -> &str {
        "cuda-device"
    }
    weft::forward_transport!(cpu);
    fn capabilities(&self) -> &weft::backend::Capabilities {
        &self.caps
    }
    /// Sends and receives GPU to GPU (`p2p.rs`), or staged through the host
    /// as in cuda-host-staging where the device path cannot reach a peer.
    /// Decided per group, never per op (no hint applies): both ranks of a
    /// message must take the same path, and a posted op sees no hints.
    unsafe fn post_device(
        &self,
        op: &mut Op<'_>,
        stream: Option<StreamHandle>,
        deadline: Instant,
        completion: weft::stream::CompletionSlot,
        done: weft::backend::progress::Done,
    ) {
        let on_device = |p2p: &p2p::DeviceP2p| self.p2p_eager || p2p.capturing(stream);
        match &self.p2p {
            // SAFETY: the caller's promise, passed on.
            Some(p2p) if on_device(p2p) => unsafe { p2p.post(&**self.cpu(), op, stream, deadline, completion, done) },
            // SAFETY: as above.
            _ => unsafe { self.staging.post_p2p(op, stream, deadline, done) },
        }
    }
    fn native_op(&self, op: &mut Op<'_>, ctx: &OpContext) -> Option<Result<()>> {
        // Captured ops run on the device alone: all_reduce directly, the
        // other collectives pulled. The rest (the ring, staged ops) is
        // refused before it touches a stream, leaving the capture valid.
        let capturable = match (&*op, Algorithm::from_hints(ctx)) {
            // (Point-to-point takes no algorithm hint: see `post_device`.)
            (Op::Send { .. } | Op::Recv { .. } | Op::Batch { .. }, _) => self.p2p.is_some(),
            (_, Err(_) | Ok(Algorithm::Staging | Algorithm::Ring)) => false,
            (Op::AllReduce { .. } | Op::Broadcast { .. } | Op::Reduce { .. } | Op::AllGather { .. }, _) => true,
            (Op::ReduceScatter { .. } | Op::AllToAll { .. } | Op::Gather { .. } | Op::Scatter { .. }, _) => true,
            _ => false,
        };
        let why =
            "cuda-device runs it through the host (cuda_algorithm=ring or staging, or sparse tensors), which a CUDA graph cannot capture";
        if !capturable {
            if let Err(e) = weft_cuda_host_staging::refuse_capture(&*self.staging.gpu(), ctx.stream, ctx.name, why) {
                return Some(Err(e));
            }
        }
        Some(match op {
            Op::AllReduce { buf, op } => match Algorithm::from_hints(ctx) {
                Ok(Algorithm::Staging) => self.staged(&mut Op::AllReduce { buf: buf.reborrow(), op: *op }, ctx),
                Ok(algorithm) => self.all_reduce(buf, *op, ctx, algorithm),
                Err(e) => Err(e),
            },
            Op::Broadcast { .. }
            | Op::Reduce { .. }
            | Op::AllGather { .. }
            | Op::ReduceScatter { .. }
            | Op::AllToAll { .. }
            | Op::Gather { .. }
            | Op::Scatter { .. } => match Algorithm::from_hints(ctx) {
                // (The ring is all_reduce's: another op told to use one of
                // core's algorithms runs it on the host.)
                Ok(Algorithm::Staging | Algorithm::Ring) => self.staged(op, ctx),
                Ok(algorithm) => self.pulled(op, ctx, algorithm),
                Err(e) => Err(e),
            },
            // The same way as when posted (`post_device`): a rank's messages
            // to a peer take one path whichever way they were issued.
            Op::Send { .. } | Op::Recv { .. } | Op::Batch { .. } => match &self.p2p {
                Some(p2p) if self.p2p_eager || p2p.capturing(ctx.stream) => self.p2p_now(p2p, op, ctx),
                _ => self.staged(op, ctx),
            },
            _ => self.staged(op, ctx),
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
