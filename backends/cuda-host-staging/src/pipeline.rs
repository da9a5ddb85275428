//! The chunked pipeline: device-to-host copies, the CPU collective and
//! host-to-device copies of different chunks overlap.
//!
//! Two streams per device (one per copy direction, so both copy engines
//! work) and `SLOTS` pinned slots. Chunk k uses slot k % SLOTS:
//!
//! ```text
//! d2h stream: wait(slot free) copy-in(k) record(in_done[s])      ... k+SLOTS ...
//! host:                        sync(in_done[s]) CPU op(k) -> queue copy-out(k)
//! h2d stream:                                     copy-out(k) record(out_done[s])
//! ```
//!
//! The first copies wait for the caller's stream; the op's completion is an
//! event on the h2d stream, which `Work::wait` makes the caller's stream wait
//! for. With `staging=whole` (one chunk) it is the unpipelined staging of
//! Gloo: the whole op copied in, run, copied out.

use crate::parts::{host_op, parts, HostViews, Part};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use weft::backend::{Backend, Capabilities, Op, OpContext};
use weft::{Error, Result, StreamHandle};
use weft_cuda_driver::{synchronize_event, synchronize_stream, Event, Gpu, PinnedPool, StreamCompletion};

/// Pinned slots in flight per op.
const SLOTS: usize = 3;
/// Default bytes staged per chunk (all of the op's tensors together).
pub const DEFAULT_CHUNK_BYTES: usize = 4 << 20;
/// Alignment of each tensor's range inside a slot.
const ALIGN: usize = 64;

/// Streams, events and pinned memory of one device, reused by every op.
struct DeviceState {
    device: usize,
    d2h: StreamHandle,
    h2d: StreamHandle,
    in_done: [Event; SLOTS],
    out_done: [Event; SLOTS],
    start: Event,
    pool: PinnedPool,
    /// Completion of the latest op (the pool may only be reallocated after it).
    last: Option<Event>,
}

/// Runs dense device ops by staging them through pinned host memory over a
/// CPU backend. Shared by `cuda-host-staging` and `cuda-device` (for the ops
/// it has no native path for).
pub struct Staging {
    gpu: Arc<dyn Gpu>,
    cpu: Arc<dyn Backend>,
    devices: Mutex<HashMap<usize, DeviceState>>,
    /// Copy streams of posted point-to-point ops (`p2p.rs`, `streams.rs`).
    pub(crate) p2p: crate::streams::P2pStreams,
    /// The CPU backend's, posting device tensors' point-to-point ops
    /// where it posts host bytes (they go through the host), without its
    /// fast path (device tensors never take it).
    caps: Capabilities,
}

/// `Unsupported` where the caller's `stream` is capturing a CUDA graph:
/// "`op` `why`". No CUDA op of weft records itself into a graph yet, and
/// running one would break the capture (host copies and host waits on a
/// capturing stream are refused, and invalidate it) or run its
/// communication outside the graph. Checked before anything touches a
/// stream, so the capture stays valid and the group usable.
pub fn refuse_capture(gpu: &dyn Gpu, stream: Option<weft::StreamHandle>, op: &str, why: &str) -> Result<()> {
    match stream {
        Some(s) if gpu.is_capturing(s)? => Err(Error::unsupported(format!(
            "{op} was issued on a stream that is capturing a CUDA graph, and {why}: issue it outside the capture"
        ))),
        _ => Ok(()),
    }
}

impl Staging {
    /// Staging over `cpu`.
    pub fn new(gpu: Arc<dyn Gpu>, cpu: Arc<dyn Backend>) -> Staging {
        let caps = Capabilities { posts_device: cpu.capabilities().posts, fast_ops: false, ..cpu.capabilities().clone() };
        Staging { gpu, cpu, devices: Mutex::default(), p2p: Default::default(), caps }
    }

    /// `Unsupported`, naming `op`, where the caller's `stream` is capturing
    /// a CUDA graph: staged through host memory, it cannot be captured
    /// (see [`refuse_capture`]).
    pub fn refuse_capture(&self, stream: Option<weft::StreamHandle>, op: &str) -> Result<()> {
        refuse_capture(&*self.gpu, stream, op, "is staged through host memory, which a CUDA graph cannot capture")
    }

    /// Staging for a group being created by backend `who`: this process's
    /// GPU and the group's CPU backend, or `Unsupported` saying which is missing.
    pub fn for_group(ctx: &weft::backend::BackendContext, who: &str) -> Result<Staging> {
        let gpu = weft_cuda_driver::gpu().map_err(Error::unsupported)?;
        let cpu = ctx
            .cpu_backend
            .clone()
            .ok_or_else(|| Error::unsupported(format!("{who} needs a backend for dense CPU tensors in the same group")))?;
        Ok(Staging::new(gpu, cpu))
    }

    /// The CPU backend ops run on.
    pub fn cpu(&self) -> &Arc<dyn Backend> {
        &self.cpu
    }

    /// What a backend staging through it offers core: the CPU backend's
    /// capabilities, with device point-to-point ops posted where that
    /// backend posts.
    pub fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    /// The GPU.
    pub fn gpu(&self) -> Arc<dyn Gpu> {
        self.gpu.clone()
    }

    fn device_state(&self, device: usize) -> Result<DeviceState> {
        let g = &self.gpu;
        let ev = || g.new_event(device, false);
        Ok(DeviceState {
            device,
            d2h: g.new_stream(device)?,
            h2d: g.new_stream(device)?,
            in_done: [ev()?, ev()?, ev()?],
            out_done: [ev()?, ev()?, ev()?],
            start: ev()?,
            pool: PinnedPool::new(g.clone()),
            last: None,
        })
    }

    /// Run `op` (on one CUDA device) staged through the host.
    pub fn run(&self, op: &mut Op<'_>, ctx: &OpContext) -> Result<()> {
        self.refuse_capture(ctx.stream, ctx.name)?;
        if let Op::AllReduceSparse { .. } = op {
            return self.run_sparse(op, ctx);
        }
        let (parts, device) = parts(op, ctx.rank)?;
        let chunks = self.chunk_count(op, &parts, ctx)?;
        let mut devices = self.devices.lock().unwrap_or_else(|p| p.into_inner());
        let st = match devices.entry(device) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(self.device_state(device)?),
        };
        let caller = ctx.stream.unwrap_or_default();
        let result = self.pipeline(st, op, ctx, &parts, chunks, caller);
        if result.is_err() {
            // Nothing queued may outlive a failed op: its copies touch the
            // caller's memory, which is the caller's again once we return.
            self.drain(st, ctx);
        }
        result
    }

    /// Chunks for this op, the same on every rank (every rank's chunk k of
    /// its tensors must form one op).
    fn chunk_count(&self, op: &Op<'_>, parts: &[Part], ctx: &OpContext) -> Result<usize> {
        let Some(per) = chunk_bytes(ctx)? else { return Ok(1) };
        if let Op::Batch { .. } = op {
            // Each message must be cut alike on both of its ranks, but a
            // batch's sizes differ from rank to rank: staged whole.
            return Ok(1);
        }
        let count = |bytes: usize| bytes.div_ceil(per).clamp(1, MAX_CHUNKS);
        if let Some(bytes) = agreed_bytes(op, parts, ctx.size) {
            return Ok(count(bytes));
        }
        // Ask the group: the largest count any rank wants.
        let mine = count(parts.iter().map(|p| p.numel * p.dtype.size()).sum()) as u64;
        let mut word = [mine];
        let mut agree = Op::AllReduce { buf: weft::TensorMut::from_slice(&mut word[..]), op: weft::ReduceOp::Max };
        weft::algorithms::run(&*self.cpu, &mut agree, ctx)?;
        Ok(word[0] as usize)
    }

    fn drain(&self, st: &DeviceState, ctx: &OpContext) {
        for s in [st.d2h, st.h2d] {
            let _ = synchronize_stream(&*self.gpu, st.device, s, ctx.deadline.for_cleanup(), ctx.name);
        }
    }

    fn pipeline(
        &self,
        st: &mut DeviceState,
        op: &mut Op<'_>,
        ctx: &OpContext,
        parts: &[Part],
        chunks: usize,
        caller: StreamHandle,
    ) -> Result<()> {
        let g = &*self.gpu;
        // Slot layout: each part's largest chunk, aligned.
        let mut offsets = Vec::with_capacity(parts.len());
        let mut slot_bytes = 0;
        for p in parts {
            offsets.push(slot_bytes);
            slot_bytes += (p.numel.div_ceil(chunks) * p.dtype.size()).next_multiple_of(ALIGN);
        }
        let slot_bytes = slot_bytes.max(ALIGN);
        let slots = SLOTS.min(chunks);
        if let (Some(last), true) = (st.last, st.pool.capacity() < slot_bytes * slots) {
            // Reallocating the pool must wait for copies of the previous op.
            synchronize_event(g, last, ctx.deadline.get(), ctx.name)?;
        }
        let base = st.pool.get(slot_bytes * slots)?;
        g.record(st.start, caller)?;
        g.wait_event(st.d2h, st.start)?;
        g.wait_event(st.h2d, st.start)?;

        let copy_in = |st: &DeviceState, k: usize| -> Result<()> {
            let s = k % slots;
            g.wait_event(st.d2h, st.out_done[s])?;
            for (p, off) in parts.iter().zip(&offsets).filter(|(p, _)| p.role.downloads()) {
                let (a, b) = p.range(k, chunks);
                let sz = p.dtype.size();
                // SAFETY: the slot range is ours (after out_done[s]); the
                // device range lies inside the caller's tensor, borrowed until
                // the op's completion (the Work's contract).
                unsafe { g.copy_dtoh(st.d2h, base.add(s * slot_bytes + off), p.addr + (a * sz) as u64, (b - a) * sz)? };
            }
            g.record(st.in_done[s], st.d2h)
        };
        for k in 0..slots {
            copy_in(st, k)?;
        }
        for k in 0..chunks {
            let s = k % slots;
            synchronize_event(g, st.in_done[s], ctx.deadline.get(), ctx.name)?;
            let views = HostViews {
                ptrs: parts
                    .iter()
                    .zip(&offsets)
                    .map(|(p, off)| {
                        let (a, b) = p.range(k, chunks);
                        // SAFETY: inside the slot (sized for the largest chunk).
                        (unsafe { base.add(s * slot_bytes + off) }, b - a, p.dtype)
                    })
                    .collect(),
            };
            let mut host = host_op(op, &views)?;
            match self.cpu.native_op(&mut host, ctx) {
                Some(r) => r?,
                None => weft::algorithms::run(&*self.cpu, &mut host, ctx)?,
            }
            drop(host);
            for (p, (ptr, n, dtype)) in parts.iter().zip(&views.ptrs) {
                if p.role.uploads() {
                    // SAFETY: the host op is over; this range is ours.
                    let bytes = unsafe { std::slice::from_raw_parts_mut(*ptr, n * dtype.size()) };
                    weft::kernels::sanitize(bytes, *dtype);
                    let (a, _) = p.range(k, chunks);
                    // SAFETY: as in copy_in, in the other direction.
                    unsafe { g.copy_htod(st.h2d, p.addr + (a * dtype.size()) as u64, *ptr, bytes.len())? };
                }
            }
            g.record(st.out_done[s], st.h2d)?;
            if k + slots < chunks {
                copy_in(st, k + slots)?;
            }
        }
        let done = StreamCompletion::record(self.gpu.clone(), st.device, st.h2d, caller)?;
        st.last = Some(st.out_done[(chunks - 1) % slots]);
        ctx.completion.set(Arc::new(done));
        Ok(())
    }
}

/// Bytes per chunk: `staging=whole` gives one chunk (`None`); otherwise
/// about `staging_chunk_bytes` (default 4 MiB) of all tensors together.
fn chunk_bytes(ctx: &OpContext) -> Result<Option<usize>> {
    match (ctx.hints.get("staging").map(String::as_str), ctx.hints.get("staging_chunk_bytes")) {
        (Some("whole"), _) => Ok(None),
        (Some("pipelined") | None, None) => Ok(Some(DEFAULT_CHUNK_BYTES)),
        (Some("pipelined") | None, Some(v)) => v
            .parse::<usize>()
            .ok()
            .filter(|&b| b > 0)
            .map(Some)
            .ok_or_else(|| Error::invalid(format!("hint staging_chunk_bytes={v:?} is not a positive byte count"))),
        (Some(other), _) => Err(Error::invalid(format!("hint staging={other:?}: use whole or pipelined"))),
    }
}

/// The op's size in bytes as every rank computes it alike, where the local
/// tensors tell (not for all_to_all, whose splits differ per rank).
fn agreed_bytes(op: &Op<'_>, parts: &[Part], size: usize) -> Option<usize> {
    let bytes = |p: &Part| p.numel * p.dtype.size();
    let sum = |down: bool| parts.iter().filter(|p| p.role.downloads() == down).map(bytes).sum::<usize>();
    match op {
        Op::AllToAll { .. } => None,
        Op::AllGather { .. } => Some(sum(false)),
        Op::ReduceScatter { .. } => Some(sum(true)),
        Op::Gather { .. } => Some(bytes(&parts[0]) * size),
        Op::Scatter { .. } => Some(bytes(parts.last()?) * size),
        _ => parts.first().map(bytes),
    }
}

const MAX_CHUNKS: usize = 4096;

impl Drop for Staging {
    fn drop(&mut self) {
        self.p2p.close(&*self.gpu);
        let devices = std::mem::take(&mut *self.devices.lock().unwrap_or_else(|p| p.into_inner()));
        for (_, st) in devices {
            // Let queued copies finish before their pinned memory goes.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            let _ = synchronize_stream(&*self.gpu, st.device, st.h2d, deadline, "closing cuda-host-staging");
            for e in st.in_done.iter().chain(&st.out_done).chain([&st.start]) {
                self.gpu.destroy_event(*e);
            }
            self.gpu.destroy_stream(st.d2h);
            self.gpu.destroy_stream(st.h2d);
        }
    }
}
