//! The direct all-reduce for ranks whose buffers can be mapped into each
//! other's address space (processes sharing a GPU, or GPUs with peer
//! access). Ranks hand off twice per op (inputs ready, results written)
//! instead of at every pipelined ring step, which on a time-sliced GPU is a
//! context switch each.
//!
//! - Large ops: each rank maps every other rank's buffer through CUDA IPC,
//!   reduces its own block of all the buffers in one kernel and writes the
//!   result into that block of every buffer: each input byte read once and
//!   each output byte written once.
//! - Small ops (up to `Peers::staged_max` bytes): mapping a buffer and
//!   closing it again costs more than the op, and a mapping must not
//!   outlive the op (its owner may free it then; CUDA leaves that
//!   undefined). So each rank copies its input into its staging buffer,
//!   mapped by every rank once at setup, and reduces the whole of every
//!   staging buffer into its own buffer (one shot, as vLLM's custom
//!   all-reduce does for small ops).
//!
//! Only tiny records go through the CPU backend, three rounds per op:
//!
//! ```text
//! [small: copy in]; record ready; round 1: (handle, offset, count, dtype, op) from all
//! [large: map every buffer; round 2: all mapped?]
//! wait every rank's ready; reduce (small: everything into mine; large: my
//! block of every buffer into all of them); record done
//! large: wait for done; unmap; round 3 (every block written, every mapping
//!        closed: the owners may free their buffers)
//! small: round 3; wait every rank's done (its reads of my staging buffer)
//! ```
//!
//! (Ranks that are threads of one process use each other's pointers and
//! events: nothing is mapped, and round 3 is followed by stream waits on
//! every rank's `done` instead of host waits. An op captured into a CUDA
//! graph hands off through the device-side flags of `handoff.rs` and keeps
//! its mappings for the graph, so it too ends with waits on every `done`.)
//!
//! A wait on an IPC event waits for its latest record: each wait comes after
//! the round that follows the record it means, and the next record of that
//! event comes only after the round that follows the wait.
//!
//! Where a buffer cannot be exported (pool memory, host memory), more ranks
//! than one kernel takes, or a mapping fails, every rank learns it in the
//! same round and the op runs on the ring instead; so it does where the
//! ranks use different GPUs, unless the hint `cuda_algorithm=direct` asks.

use crate::agree::{ranks_where, round, same_everywhere, Signature};
use crate::handoff::Handoff;
use crate::peer_buffers::PeerBuffers;
use crate::setup::Peers;
use crate::{capture_mismatch, Required};
use weft::algorithms::Steps;
use weft::backend::{Backend, OpContext};
use weft::{Error, ReduceOp, Result, TensorMut};
use weft_cuda_driver::{DevicePtr, MAX_REDUCE_ALL};

/// One rank's round-1 record: whether it stages the op, whether its buffer
/// could be exported, whether it captures the op, what it reduces, and
/// where its buffer is.
struct Offer {
    staged: bool,
    exported: bool,
    /// The rank captures the op into a CUDA graph.
    captured: bool,
    signature: Signature,
    /// The buffer's offset in its allocation.
    offset: u64,
    /// The buffer's address in its own process (used by in-process ranks).
    ptr: u64,
    handle: Vec<u8>,
}

const HANDLE_MAX: usize = 64;
const OFFER_LEN: usize = 5 * 8 + 4 + HANDLE_MAX;

impl Offer {
    fn encode(&self) -> [u8; OFFER_LEN] {
        let mut b = [0u8; OFFER_LEN];
        let flags = u64::from(self.exported) | (u64::from(self.staged) << 1) | (u64::from(self.captured) << 2);
        let words = [flags, self.signature.count, self.signature.kind, self.offset, self.ptr];
        for (i, w) in words.iter().enumerate() {
            b[8 * i..8 * i + 8].copy_from_slice(&w.to_le_bytes());
        }
        b[40..44].copy_from_slice(&(self.handle.len() as u32).to_le_bytes());
        b[44..44 + self.handle.len()].copy_from_slice(&self.handle);
        b
    }

    fn decode(b: &[u8]) -> Result<Offer> {
        let word = |i: usize| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().expect("8 bytes"));
        let n = u32::from_le_bytes(b[40..44].try_into().expect("4 bytes")) as usize;
        if n > HANDLE_MAX {
            return Err(Error::backend(format!("cuda-device: malformed direct all-reduce record (handle of {n} bytes)")));
        }
        Ok(Offer {
            exported: word(0) & 1 == 1,
            staged: word(0) & 2 == 2,
            captured: word(0) & 4 == 4,
            signature: Signature { count: word(1), kind: word(2) },
            offset: word(3),
            ptr: word(4),
            handle: b[44..44 + n].to_vec(),
        })
    }
}

/// Map every rank's buffer (in-process ranks' as they are), and agree that
/// every rank could: the base of each, or why not (alike on every rank).
fn map_all(
    ring: &Peers,
    c: &Steps<'_>,
    offers: &[Offer],
    peers: &mut PeerBuffers<'_>,
) -> Result<std::result::Result<Vec<DevicePtr>, String>> {
    let me = std::process::id();
    let mut bases: Vec<DevicePtr> = Vec::with_capacity(offers.len());
    let mut failed = None;
    for (p, o) in offers.iter().enumerate() {
        if ring.pids[p] == me {
            bases.push(o.ptr);
            continue;
        }
        match peers.map(p, &o.handle) {
            Ok(base) => bases.push(base + o.offset),
            Err(e) => {
                failed = Some(format!("rank {} cannot map rank {p}'s buffer: {e}", c.rank()));
                break;
            }
        }
    }
    let mapped = round(c, 1, &[u8::from(failed.is_none())])?;
    let unmapped = ranks_where(&mapped, |m| m[0] != 1);
    if unmapped.is_empty() {
        return Ok(Ok(bases));
    }
    Ok(Err(failed.unwrap_or_else(|| format!("rank(s) {unmapped:?} cannot map the others' buffers"))))
}

/// In-place all-reduce of `buf` queued on `stream` (a `PremulSum` input is
/// already scaled, or, `scale`, scaled here once every rank has found the
/// op can run). `Ok(false)`, decided alike on every rank, where it
/// cannot run here and the ring should; `Err` where it is `required` (the hint
/// `cuda_algorithm=direct`, or a capture) and it cannot.
#[allow(clippy::too_many_arguments)]
pub fn all_reduce(
    ring: &Peers,
    cpu: &dyn Backend,
    ctx: &OpContext,
    h: &Handoff<'_>,
    buf: &mut TensorMut<'_>,
    op: ReduceOp,
    scale: Option<f64>,
    required: Required,
) -> Result<bool> {
    let stream = h.stream();
    let (r, w) = (ctx.rank, ctx.size);
    let fallback = |why: String| required.fallback(why);
    if w == 1 {
        // Nothing to exchange: the ring's no-op serves.
        return Ok(false);
    }
    if w > MAX_REDUCE_ALL {
        return fallback(format!("runs on at most {MAX_REDUCE_ALL} ranks, the group has {w}"));
    }
    if !ring.one_gpu && !required.is_required() {
        // Measured only where the ranks share a GPU; across GPUs every
        // block would cross the links as loads and stores, which only a
        // full NVLink mesh carries well (vLLM's custom all-reduce draws
        // the same line): there it is the hint's to choose.
        return Ok(false);
    }
    let (count, dtype) = (buf.numel(), buf.dtype());
    let ptr = buf.as_ptr() as u64;
    let g = ring.gpu.clone();
    let c = Steps::new(cpu, ctx).phase(1);
    // Small ops go through the staging buffers, mapped once at setup; every
    // rank decides alike where the counts agree (checked in round 1, which
    // both ways reach with the same record).
    let bytes = count * dtype.size();
    let staged = bytes <= ring.staged_max;
    // My input, staged, then `ready`: before round 1 offers it (an event
    // wait means the latest record); a captured op only once every rank has
    // found it can run, so that an op that cannot leaves nothing in the graph.
    let expose = || -> Result<()> {
        if let Some(f) = scale {
            // SAFETY: the op's buffer, on this stream after the caller's work.
            unsafe { g.premul(stream, ptr, count, dtype, f)? };
        }
        if staged {
            // SAFETY: my staging buffer holds `staged_max` bytes; no rank uses
            // it between ops (each staged op waits for every rank's `done`, and
            // ready is recorded after this copy).
            unsafe { g.copy_dtod(stream, ring.stage, ptr, bytes)? };
        }
        h.ready()
    };
    if !h.captured() {
        expose()?;
    }

    // Round 1: every rank's buffer, and whether it captures the op.
    // Ranks in one process read each other's buffers as they are.
    let (exported, handle, offset) = match g.ipc_export(ptr) {
        _ if staged => (true, Vec::new(), 0),
        Ok((h, off)) if h.len() <= HANDLE_MAX => (true, h, off),
        _ => (ring.others.is_empty(), Vec::new(), 0),
    };
    let mine = Offer { staged, exported, captured: h.captured(), signature: Signature::of(count, dtype, op), offset, ptr, handle };
    let offers = round(&c, 0, &mine.encode())?.iter().map(|b| Offer::decode(b)).collect::<Result<Vec<_>>>()?;
    let unlike = ranks_where(&offers, |o| o.captured != h.captured());
    if !unlike.is_empty() {
        return Err(capture_mismatch(&unlike, h.captured()));
    }
    let signatures: Vec<Signature> = offers.iter().map(|o| o.signature).collect();
    same_everywhere(&signatures, mine.signature, dtype, op)?;
    let differ = ranks_where(&offers, |o| o.staged != staged);
    if !differ.is_empty() {
        return Err(Error::invalid(format!(
            "cuda-device: rank(s) {differ:?} {} {bytes} bytes and this rank {}: give every rank the same hint cuda_direct_staged_bytes",
            if staged { "do not stage" } else { "stage" },
            if staged { "does" } else { "does not" },
        )));
    }
    let unexported = ranks_where(&offers, |o| !o.exported);
    if !unexported.is_empty() {
        return fallback(format!("the buffers of rank(s) {unexported:?} cannot be exported with CUDA IPC (pool or host memory)"));
    }

    // Round 2 (unstaged): every buffer mapped here.
    let mut peers = PeerBuffers::new(&*g, ring.device, stream, ctx.deadline.get(), &ring.kept, h.captured());
    let mapped;
    let bases: &[DevicePtr] = if staged {
        &ring.ranks_stage
    } else {
        mapped = match map_all(ring, &c, &offers, &mut peers)? {
            Ok(bases) => bases,
            Err(why) => return fallback(why),
        };
        &mapped
    };

    if h.captured() {
        expose()?;
    }
    for p in (0..w).filter(|p| *p != r) {
        h.after_ready(p, &format!("rank {p}'s input"))?;
    }
    if staged {
        // One shot: the whole of every staging buffer, reduced into mine.
        // SAFETY: every staging buffer holds `count` elements (checked in
        // round 1) until its owner's next op, which waits for every rank's
        // `done`; the op's buffer is borrowed until completion.
        unsafe { g.reduce_all(stream, bases, &[ptr], count, dtype, op)? };
    } else {
        // My block of every buffer. Block edges fall on 16 bytes where
        // they can, for the kernel's wide loads.
        let unit = (16 / dtype.size()).max(1);
        let edge = |b: usize| (count.div_ceil(unit) * b / w * unit).min(count);
        let (a, z) = (edge(r), edge(r + 1));
        let at: Vec<DevicePtr> = bases.iter().map(|b| b + (a * dtype.size()) as u64).collect();
        // SAFETY: every rank's buffer holds `count` elements (checked in
        // round 1) and stays borrowed until round 3 below; the blocks of
        // different ranks do not overlap.
        unsafe { g.reduce_all(stream, &at, &at, z - a, dtype, op)? };
    }

    // Round 3: my part is done once `done` completes.
    h.done()?;
    if !peers.any_open() {
        // Nothing mapped for this op alone (staged, in-process ranks, or
        // mappings kept for a graph): my stream (or, where `host_wait`,
        // this thread) waits for every rank's `done`: their blocks of my
        // buffer written, or their reads of my staging buffer over before
        // my next op fills it.
        round(&c, 2, &[1])?;
        for p in (0..w).filter(|p| *p != r) {
            h.after_done(p, &format!("rank {p}'s part of the op"))?;
        }
    } else {
        // Other processes' buffers are closed before any rank's op can
        // complete (their owners may free them then): my kernel first,
        // then the mappings, then the round, after which every rank knows
        // every block is written and every mapping of its buffer closed.
        ring.wait_host(ring.done, ctx.deadline.get(), "this rank's share of the result")?;
        // SAFETY: the kernel that used the mappings has finished.
        unsafe { peers.close() };
        round(&c, 2, &[1])?;
    }
    Ok(true)
}
