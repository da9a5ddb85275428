//! Every collective but all_reduce, GPU to GPU: each rank *pulls* what it
//! needs straight from its peers' buffers into its own outputs (device
//! copies, or one reduction kernel for `reduce_scatter` and `reduce`), so
//! the payload never touches host memory and each byte moves once.
//!
//! A rank *exposes* the buffers its peers read (its input for all_gather
//! and gather, every input for all_to_all and reduce_scatter, the root's
//! buffer for broadcast and its inputs for scatter, every rank's buffer
//! for reduce), and *reads* from theirs:
//!
//! | op | exposes | reads |
//! |---|---|---|
//! | broadcast | root: `buf` | others: root's `buf` |
//! | all_gather, gather | `input` | `outputs[p]` from rank p's input (gather: the root only) |
//! | all_to_all | `inputs` | `outputs[p]` from rank p's `inputs[me]` |
//! | scatter | root: `inputs` | `output` from the root's `inputs[me]` |
//! | reduce_scatter | `inputs` | `output` = the reduction of every rank's `inputs[me]` |
//! | reduce | `buf` | root: `buf` = the reduction of every rank's `buf` |
//!
//! The hand-offs are the direct all-reduce's (`direct.rs`), through the
//! CPU backend only as small records:
//!
//! ```text
//! [small: copy what I expose into my staging buffer]; record ready
//! round 1: what I expose (staged offsets, or IPC handles), and what the op is
//! map what I read from other processes; round 2: every size right, all mapped?
//! wait the ready of every rank I read from; queue the copies or the reduction; record done
//! [I mapped: wait for my done on the host, close the mappings]
//! round 3; order my stream after every rank's done (their reads of what I expose)
//! ```
//!
//! (Captured into a CUDA graph, `ready`, `done` and the waits are the
//! device-side flags of `handoff.rs`, and mappings stay open for the graph.)
//!
//! What every rank must agree on (the op, its dtype, reduce op and root,
//! and the size of each buffer one rank reads of another's) is checked in
//! rounds 1 and 2, before anything is read: a mismatch is
//! `InvalidArgument` on every rank, never a copy past a buffer's end.
//!
//! A `PremulSum` needs the same factor on every rank: staged inputs are
//! scaled before they are summed (as the other paths scale theirs), unstaged
//! ones are summed, then scaled once (the inputs are the caller's, not this
//! op's to scale in place), so there the unscaled sum must fit the dtype.
//! Ranks of this process on other GPUs cannot be reduced from (a pointer of
//! this process reaches another GPU's memory only with peer access, which
//! only the IPC mappings of other processes' buffers enable): such ops are
//! staged.
//!
//! Where it cannot run (a buffer CUDA IPC cannot export, a mapping that
//! fails, a reduction over more ranks than one kernel takes, non-contiguous
//! tensors, `PremulSum` factors that differ) every rank learns it in the
//! same round and the op is staged through the host instead
//! (`cuda-host-staging`'s pipeline), unless the hint `cuda_algorithm=direct`
//! asks for this path: then it fails with `Unsupported`.

use crate::agree::{ranks_where, round};
use crate::handoff::Handoff;
use crate::peer_buffers::PeerBuffers;
use crate::setup::Peers;
use crate::{capture_mismatch, Required};
use std::collections::HashMap;
use weft::algorithms::Steps;
use weft::backend::{Backend, Op, OpContext};
use weft::{DType, Error, ReduceOp, Result};
use weft_cuda_driver::{DevicePtr, MAX_REDUCE_ALL};

/// Bytes of an IPC handle a record carries, at most.
const HANDLE_MAX: usize = 64;
/// Bytes of a record before its buffers: flags, the op, how many buffers,
/// a `PremulSum`'s factor, the size of its staging buffer.
const HEAD: usize = 5 * 8;
/// Bytes of one exposed buffer in a record: offset, address, length,
/// handle length, handle.
const BUFFER_LEN: usize = 3 * 8 + 4 + HANDLE_MAX;
/// Staged buffers start on this alignment in the staging buffer.
const STAGE_ALIGN: usize = 256;

/// One copy into this rank's output: `bytes` of buffer `buf` of rank `from`.
struct Read {
    from: usize,
    buf: usize,
    dst: DevicePtr,
    bytes: usize,
}

/// The reduction into `dst` of buffer `buf` of every rank, in rank order
/// (`PremulSum(f)`: summed, then scaled by `f`, which every rank must
/// share).
struct Reduction {
    buf: Vec<usize>,
    dst: DevicePtr,
    count: usize,
    dtype: DType,
    op: ReduceOp,
}

/// What this rank does in one op.
struct Plan {
    /// What every rank must agree on: the op, dtype, reduce op and root.
    what: u64,
    /// A `PremulSum`'s factor and dtype, the same on every rank of a
    /// reduce, the root or not.
    premul: Option<(f64, DType)>,
    /// The buffers its peers read, as (address, bytes).
    exposed: Vec<(DevicePtr, usize)>,
    reads: Vec<Read>,
    reduction: Option<Reduction>,
}

/// `what` of an op: its kind, dtype, reduce op and root.
fn what(kind: u64, dtype: DType, op: Option<ReduceOp>, root: usize) -> u64 {
    let d = DType::ALL.iter().position(|x| *x == dtype).unwrap_or(255) as u64;
    let o = op.and_then(|op| ReduceOp::ALL.iter().position(|x| x.name() == op.name())).map_or(255, |o| o as u64);
    kind | (d << 8) | (o << 16) | ((root as u64) << 24)
}

fn ptr(p: *const u8) -> DevicePtr {
    p as u64
}

impl Plan {
    /// The plan of `op` on `rank` of `size`, if this path serves it.
    fn of(op: &mut Op<'_>, rank: usize, size: usize) -> Option<Plan> {
        let (r, w) = (rank, size);
        let contiguous = |ok: bool| ok.then_some(());
        // (Core checks these; a record has room for `size` buffers.)
        let (lists, root) = match op {
            Op::AllGather { outputs, .. } | Op::Gather { outputs, .. } => (outputs.len(), 0),
            Op::AllToAll { inputs, outputs } => (inputs.len().max(outputs.len()), 0),
            Op::Scatter { inputs, .. } | Op::ReduceScatter { inputs, .. } => (inputs.len(), 0),
            _ => (0, 0),
        };
        let root = match op {
            Op::Broadcast { root, .. } | Op::Reduce { root, .. } | Op::Gather { root, .. } | Op::Scatter { root, .. } => *root,
            _ => root,
        };
        contiguous(lists <= w && root < w)?;
        let gather_kind = if matches!(op, Op::Gather { .. }) { 4 } else { 3 };
        Some(match op {
            Op::Broadcast { buf, root } => {
                contiguous(buf.is_contiguous())?;
                let (at, n) = (ptr(buf.as_ptr()), buf.nbytes());
                Plan {
                    what: what(1, buf.dtype(), None, *root),
                    premul: None,
                    exposed: if r == *root { vec![(at, n)] } else { vec![] },
                    reads: if r == *root { vec![] } else { vec![Read { from: *root, buf: 0, dst: at, bytes: n }] },
                    reduction: None,
                }
            }
            Op::Reduce { buf, root, op } => {
                contiguous(buf.is_contiguous() && w <= MAX_REDUCE_ALL)?;
                let at = ptr(buf.as_ptr());
                let reduction =
                    (r == *root).then(|| Reduction { buf: vec![0; w], dst: at, count: buf.numel(), dtype: buf.dtype(), op: *op });
                let premul = premul(*op, buf.dtype());
                Plan { what: what(2, buf.dtype(), Some(*op), *root), premul, exposed: vec![(at, buf.nbytes())], reads: vec![], reduction }
            }
            Op::AllGather { input, outputs } | Op::Gather { input, outputs, .. } => {
                contiguous(input.is_contiguous() && outputs.iter().all(|o| o.is_contiguous()))?;
                // (A gather's root is the rank with outputs: the others read nothing.)
                let reads =
                    outputs.iter().enumerate().map(|(p, o)| Read { from: p, buf: 0, dst: ptr(o.as_ptr()), bytes: o.nbytes() }).collect();
                Plan {
                    what: what(gather_kind, input.dtype(), None, root),
                    premul: None,
                    exposed: vec![(ptr(input.as_ptr()), input.nbytes())],
                    reads,
                    reduction: None,
                }
            }
            Op::AllToAll { inputs, outputs } => {
                contiguous(inputs.iter().all(|i| i.is_contiguous()) && outputs.iter().all(|o| o.is_contiguous()))?;
                let dtype = inputs.first()?.dtype();
                let reads =
                    outputs.iter().enumerate().map(|(p, o)| Read { from: p, buf: r, dst: ptr(o.as_ptr()), bytes: o.nbytes() }).collect();
                Plan {
                    what: what(5, dtype, None, 0),
                    premul: None,
                    exposed: inputs.iter().map(|i| (ptr(i.as_ptr()), i.nbytes())).collect(),
                    reads,
                    reduction: None,
                }
            }
            Op::Scatter { inputs, output, root } => {
                contiguous(inputs.iter().all(|i| i.is_contiguous()) && output.is_contiguous())?;
                let read = Read { from: *root, buf: r, dst: ptr(output.as_ptr()), bytes: output.nbytes() };
                Plan {
                    what: what(6, output.dtype(), None, *root),
                    premul: None,
                    exposed: inputs.iter().map(|i| (ptr(i.as_ptr()), i.nbytes())).collect(),
                    reads: vec![read],
                    reduction: None,
                }
            }
            Op::ReduceScatter { inputs, output, op } => {
                contiguous(inputs.iter().all(|i| i.is_contiguous()) && output.is_contiguous() && w <= MAX_REDUCE_ALL)?;
                let reduction =
                    Reduction { buf: vec![r; w], dst: ptr(output.as_ptr()), count: output.numel(), dtype: output.dtype(), op: *op };
                Plan {
                    what: what(7, output.dtype(), Some(*op), 0),
                    premul: premul(*op, output.dtype()),
                    exposed: inputs.iter().map(|i| (ptr(i.as_ptr()), i.nbytes())).collect(),
                    reads: vec![],
                    reduction: Some(reduction),
                }
            }
            _ => return None,
        })
    }
}

/// One rank's round-1 record: whether it staged what it exposes, whether
/// every buffer could be exported, what the op is, and each exposed buffer.
struct Record {
    staged: bool,
    exported: bool,
    /// Whether this path serves the op on that rank (else every rank stages it).
    serves: bool,
    /// Whether that rank captures the op into a CUDA graph.
    captured: bool,
    what: u64,
    /// A `PremulSum`'s factor (its bits; 0 for other ops).
    factor: u64,
    /// Bytes of its staging buffer (what a staged buffer must lie within).
    stage: u64,
    /// (offset in its allocation or staging buffer, address in its own
    /// process, bytes, IPC handle)
    buffers: Vec<(u64, u64, u64, Vec<u8>)>,
}

impl Record {
    fn len(size: usize) -> usize {
        HEAD + size * BUFFER_LEN
    }

    fn encode(&self, size: usize) -> Vec<u8> {
        let mut b = vec![0u8; Record::len(size)];
        let flags =
            u64::from(self.staged) | (u64::from(self.exported) << 1) | (u64::from(self.serves) << 2) | (u64::from(self.captured) << 3);
        for (i, w) in [flags, self.what, self.buffers.len() as u64, self.factor, self.stage].iter().enumerate() {
            b[8 * i..8 * i + 8].copy_from_slice(&w.to_le_bytes());
        }
        for (k, (offset, at, bytes, handle)) in self.buffers.iter().enumerate() {
            let o = HEAD + k * BUFFER_LEN;
            b[o..o + 8].copy_from_slice(&offset.to_le_bytes());
            b[o + 8..o + 16].copy_from_slice(&at.to_le_bytes());
            b[o + 16..o + 24].copy_from_slice(&bytes.to_le_bytes());
            b[o + 24..o + 28].copy_from_slice(&(handle.len() as u32).to_le_bytes());
            b[o + 28..o + 28 + handle.len()].copy_from_slice(handle);
        }
        b
    }

    fn decode(b: &[u8], size: usize) -> Result<Record> {
        let bad = |why: String| Error::backend(format!("cuda-device: malformed record of a device collective ({why})"));
        if b.len() != Record::len(size) {
            return Err(bad(format!("{} bytes", b.len())));
        }
        let word = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let n = word(16) as usize;
        if n > size {
            return Err(bad(format!("{n} buffers in a group of {size}")));
        }
        let mut buffers = Vec::with_capacity(n);
        for k in 0..n {
            let o = HEAD + k * BUFFER_LEN;
            let h = u32::from_le_bytes(b[o + 24..o + 28].try_into().expect("4 bytes")) as usize;
            if h > HANDLE_MAX {
                return Err(bad(format!("a handle of {h} bytes")));
            }
            buffers.push((word(o), word(o + 8), word(o + 16), b[o + 28..o + 28 + h].to_vec()));
        }
        let flags = word(0);
        Ok(Record {
            staged: flags & 1 != 0,
            exported: flags & 2 != 0,
            serves: flags & 4 != 0,
            captured: flags & 8 != 0,
            what: word(8),
            factor: word(24),
            stage: word(32),
            buffers,
        })
    }
}

/// Run `op` device to device, queued on `stream` (ordered after the
/// caller's already). `Ok(false)`, decided alike on every rank, where it
/// cannot run here and should be staged; `Err` where it is `required` (the hint
/// `cuda_algorithm=direct`, or a capture) and it cannot.
pub fn run(ring: &Peers, cpu: &dyn Backend, ctx: &OpContext, h: &Handoff<'_>, op: &mut Op<'_>, required: Required) -> Result<bool> {
    let stream = h.stream();
    let (r, w) = (ctx.rank, ctx.size);
    let fallback = |why: String| required.fallback(why);
    // A kernel cannot read another GPU's memory through a pointer of this
    // process without peer access, which only the IPC mappings of other
    // processes' buffers enable: reductions with ranks of this process on
    // other GPUs are staged.
    let in_process_elsewhere = !ring.one_gpu && ring.others.len() + 1 < w;
    let plan = Plan::of(op, r, w).filter(|p| p.reduction.is_none() && !matches!(op, Op::Reduce { .. }) || !in_process_elsewhere);
    let g = ring.gpu.clone();
    let c = Steps::new(cpu, ctx).phase(1);
    let (exposed, serves) = match &plan {
        Some(p) => (p.exposed.clone(), true),
        None => (vec![], false),
    };
    let total: usize = exposed.iter().map(|(_, n)| n.next_multiple_of(STAGE_ALIGN)).sum();
    let staged = serves && total <= ring.staged_max;
    let mut buffers = Vec::with_capacity(exposed.len());
    let mut exported = true;
    let mut at = 0u64;
    let premul = plan.as_ref().and_then(|p| p.premul);
    for &(p, n) in &exposed {
        if staged {
            buffers.push((at, p, n as u64, Vec::new()));
            at += n.next_multiple_of(STAGE_ALIGN) as u64;
            continue;
        }
        match g.ipc_export(p) {
            Ok((h, off)) if h.len() <= HANDLE_MAX => buffers.push((off, p, n as u64, h)),
            // Ranks in one process read each other's buffers as they are.
            _ if n == 0 || ring.others.is_empty() => buffers.push((0, p, n as u64, Vec::new())),
            _ => {
                exported = false;
                buffers.push((0, p, n as u64, Vec::new()));
            }
        }
    }
    // What I expose, staged (and a PremulSum's inputs scaled there), then
    // `ready`: before round 1 offers it (an event wait means the latest
    // record); a captured op only once every rank has found it can run,
    // so that an op that cannot leaves nothing in the graph.
    let staging: Vec<(DevicePtr, DevicePtr, usize)> =
        if staged { buffers.iter().map(|(at, p, n, _)| (ring.stage + at, *p, *n as usize)).collect() } else { Vec::new() };
    let expose = || -> Result<()> {
        for &(to, from, n) in &staging {
            // SAFETY: my staging buffer holds `staged_max` bytes, which these
            // fit; no rank reads it between ops (each op ends with every
            // rank's `done`), and `ready` is recorded after these copies.
            unsafe { g.copy_dtod(stream, to, from, n)? };
            if let Some((f, dtype)) = premul {
                // A staged PremulSum input is scaled before it is summed, as
                // the other paths scale theirs (a sum of 16-bit floats scaled
                // after could overflow where the scaled one does not).
                // SAFETY: the staged copy just queued, on this stream.
                unsafe { g.premul(stream, to, n / dtype.size(), dtype, f)? };
            }
        }
        h.ready()
    };
    if !h.captured() {
        expose()?;
    }
    // Round 1: what every rank exposes, and whether it captures the op.
    let what = plan.as_ref().map_or(0, |p| p.what);
    let factor = premul.map_or(0, |(f, _)| f.to_bits());
    let mine = Record { staged, exported, serves, captured: h.captured(), what, factor, stage: ring.staged_max as u64, buffers };
    let records = round(&c, 0, &mine.encode(w))?.iter().map(|b| Record::decode(b, w)).collect::<Result<Vec<_>>>()?;
    let unlike = ranks_where(&records, |x| x.captured != h.captured());
    if !unlike.is_empty() {
        return Err(capture_mismatch(&unlike, h.captured()));
    }
    let unserved = ranks_where(&records, |x| !x.serves);
    if !unserved.is_empty() {
        return fallback(format!(
            "rank(s) {unserved:?} cannot run this op on the device (non-contiguous tensors, or a reduction over more than {MAX_REDUCE_ALL} ranks)"
        ));
    }
    let plan = plan.expect("served here");
    let differ = ranks_where(&records, |x| x.what != plan.what);
    if !differ.is_empty() {
        return Err(Error::invalid(format!(
            "cuda-device: mismatched collectives: rank(s) {differ:?} run another op, dtype, reduce op or root than this rank"
        )));
    }
    let unexported = ranks_where(&records, |x| !x.exported);
    if !unexported.is_empty() {
        return fallback(format!("the buffers of rank(s) {unexported:?} cannot be exported with CUDA IPC (pool or host memory)"));
    }
    let factors = ranks_where(&records, |x| x.factor != factor);
    if !factors.is_empty() {
        return fallback(format!("rank(s) {factors:?} scale their PremulSum inputs by another factor than this rank"));
    }
    // A PremulSum's staged inputs come scaled, its unstaged ones not: all
    // one way or the other.
    let unlike = ranks_where(&records, |x| x.staged != staged);
    if factor != 0 && !unlike.is_empty() {
        return fallback(format!("rank(s) {unlike:?} stage this PremulSum and others do not"));
    }

    // Round 2: every rank's sizes agree with what it reads, and what it
    // reads from other processes is mapped here (a rank sees only its own
    // reads, so every rank learns of any mismatch or failure in one round).
    let mut peers = PeerBuffers::new(&*g, ring.device, stream, ctx.deadline.get(), &ring.kept, h.captured());
    let mut address: HashMap<(usize, usize), DevicePtr> = HashMap::new();
    let mismatch = check_sizes(&plan, &records, w).err();
    let mut failed = None;
    if mismatch.is_none() {
        for (from, buf) in sources(&plan, w) {
            let x = &records[from];
            let (offset, at, _, handle) = &x.buffers[buf];
            let addr = if x.staged {
                ring.ranks_stage[from] + offset
            } else if from == r || ring.pids[from] == std::process::id() || handle.is_empty() {
                *at
            } else {
                match peers.map(from, handle) {
                    Ok(base) => base + offset,
                    Err(e) => {
                        failed = Some(format!("rank {r} cannot map rank {from}'s buffer: {e}"));
                        break;
                    }
                }
            };
            address.insert((from, buf), addr);
        }
    }
    let status = if mismatch.is_some() { 2 } else { u8::from(failed.is_some()) };
    let all = round(&c, 1, &[status])?;
    let mismatched = ranks_where(&all, |x| x[0] == 2);
    if !mismatched.is_empty() {
        return Err(mismatch.unwrap_or_else(|| {
            Error::invalid(format!("cuda-device: mismatched collectives: rank(s) {mismatched:?} found sizes that disagree with theirs"))
        }));
    }
    let unmapped = ranks_where(&all, |x| x[0] == 1);
    if !unmapped.is_empty() {
        return fallback(failed.unwrap_or_else(|| format!("rank(s) {unmapped:?} cannot map the others' buffers")));
    }

    if h.captured() {
        expose()?;
    }
    // Wait for every rank I read from, then read.
    let mut from_ranks: Vec<usize> = sources(&plan, w).map(|(p, _)| p).filter(|p| *p != r).collect();
    from_ranks.sort_unstable();
    from_ranks.dedup();
    for &p in &from_ranks {
        h.after_ready(p, &format!("rank {p}'s buffers"))?;
    }
    for read in plan.reads.iter().filter(|x| x.bytes > 0) {
        let src = address[&(read.from, read.buf)];
        if src == read.dst {
            continue; // In place (all_gather's own part of its output).
        }
        // SAFETY: the source holds `bytes` (checked in round 2) and stays
        // its owner's until round 3; the destination is this op's output.
        unsafe { g.copy_dtod(stream, read.dst, src, read.bytes)? };
    }
    if let Some(red) = plan.reduction.as_ref().filter(|x| x.count > 0) {
        let srcs: Vec<DevicePtr> = red.buf.iter().enumerate().map(|(p, b)| address[&(p, *b)]).collect();
        // SAFETY: every source holds `count` elements (checked in round 2)
        // until round 3; the destination is this op's buffer, which may be
        // one of the sources (`reduce`: each element is read before it is
        // written).
        unsafe { g.reduce_all(stream, &srcs, &[red.dst], red.count, red.dtype, red.op)? };
        if let (ReduceOp::PremulSum(f), false) = (red.op, staged) {
            // SAFETY: this op's buffer, after the sum above on this stream.
            unsafe { g.premul(stream, red.dst, red.count, red.dtype, f)? };
        }
    }

    // Round 3: my reads are done once `done` completes. Mappings are closed
    // before any rank's op can complete (their owners may free the buffers
    // then): my reads first, then the mappings, then the round.
    h.done()?;
    if peers.any_open() {
        ring.wait_host(ring.done, ctx.deadline.get(), "this rank's reads of the others' buffers")?;
        // SAFETY: the copies that used the mappings have finished.
        unsafe { peers.close() };
    }
    round(&c, 2, &[1])?;
    // Every rank's reads of what I expose (my staging buffer, or my buffers
    // read in place by ranks in this process) are over before my op
    // completes.
    for p in (0..w).filter(|p| *p != r) {
        h.after_done(p, &format!("rank {p}'s reads"))?;
    }
    Ok(true)
}

/// A `PremulSum`'s factor and the dtype it scales (`None` for other ops).
fn premul(op: ReduceOp, dtype: DType) -> Option<(f64, DType)> {
    match op {
        ReduceOp::PremulSum(f) => Some((f, dtype)),
        _ => None,
    }
}

/// Every (rank, buffer) this rank reads, its own included.
fn sources(plan: &Plan, size: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
    let reads = plan.reads.iter().filter(|x| x.bytes > 0).map(|x| (x.from, x.buf));
    let reduced = plan.reduction.iter().filter(|x| x.count > 0).flat_map(move |x| (0..size).map(|p| (p, x.buf[p])));
    reads.chain(reduced)
}

/// `InvalidArgument` unless every buffer this rank reads exists and holds
/// what it reads (alike on every rank for every mismatch a rank sees: the
/// op's sizes are every rank's to agree on).
fn check_sizes(plan: &Plan, records: &[Record], size: usize) -> Result<()> {
    let held = |from: usize, buf: usize| {
        let x = records.get(from)?;
        let (offset, _, bytes, _) = x.buffers.get(buf)?;
        // A staged buffer lies within its owner's staging buffer.
        (!x.staged || offset.checked_add(*bytes).is_some_and(|end| end <= x.stage)).then_some(*bytes as usize)
    };
    let holds = |from: usize, buf: usize| held(from, buf).map_or("nothing".into(), |n| format!("{n} bytes"));
    for read in &plan.reads {
        if held(read.from, read.buf) != Some(read.bytes) {
            return Err(Error::invalid(format!(
                "cuda-device: mismatched sizes: this rank reads {} bytes of rank {}'s buffer {}, which holds {}",
                read.bytes,
                read.from,
                read.buf,
                holds(read.from, read.buf)
            )));
        }
    }
    if let Some(red) = &plan.reduction {
        let bytes = red.count * red.dtype.size();
        for p in 0..size {
            if held(p, red.buf[p]) != Some(bytes) {
                return Err(Error::invalid(format!(
                    "cuda-device: mismatched sizes: this rank reduces {bytes} bytes of rank {p}'s buffer {}, which holds {}",
                    red.buf[p],
                    holds(p, red.buf[p])
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(buffers: Vec<(u64, u64, u64, Vec<u8>)>) -> Record {
        Record {
            staged: false,
            exported: true,
            serves: true,
            captured: false,
            what: what(3, DType::F32, None, 0),
            factor: 0,
            stage: 1 << 20,
            buffers,
        }
    }

    #[test]
    fn records_round_trip_and_malformed_ones_are_refused() {
        let r = Record {
            staged: true,
            captured: true,
            factor: 0.5f64.to_bits(),
            ..record(vec![(256, 0x7000, 12, vec![]), (0, 0x9000, 4, vec![7; HANDLE_MAX])])
        };
        let b = r.encode(3);
        let d = Record::decode(&b, 3).unwrap();
        assert_eq!(
            (d.staged, d.exported, d.serves, d.captured, d.what, d.factor, d.stage),
            (true, true, true, true, r.what, r.factor, r.stage)
        );
        assert_eq!(d.buffers, r.buffers);
        // A record of another group size, more buffers than ranks, a handle past its room.
        assert!(Record::decode(&b, 2).is_err());
        let mut more = b.clone();
        more[16..24].copy_from_slice(&4u64.to_le_bytes());
        assert!(Record::decode(&more, 3).is_err());
        let mut long = b.clone();
        long[HEAD + 24..HEAD + 28].copy_from_slice(&(HANDLE_MAX as u32 + 1).to_le_bytes());
        assert!(Record::decode(&long, 3).err().is_some_and(|e| e.to_string().contains("malformed")));
    }

    #[test]
    fn a_read_or_a_reduction_past_what_a_peer_holds_is_refused() {
        let records = vec![record(vec![(0, 0, 400, vec![])]), record(vec![(0, 0, 396, vec![])])];
        let read =
            |bytes| Plan { what: 0, premul: None, exposed: vec![], reads: vec![Read { from: 1, buf: 0, dst: 0, bytes }], reduction: None };
        assert!(check_sizes(&read(396), &records, 2).is_ok());
        let e = check_sizes(&read(400), &records, 2).unwrap_err();
        assert_eq!(e.kind(), &weft::ErrorKind::InvalidArgument);
        assert!(e.to_string().contains("reads 400 bytes of rank 1's buffer 0, which holds 396 bytes"), "{e}");
        // A buffer the peer does not expose at all.
        let missing = Plan { reads: vec![Read { from: 0, buf: 1, dst: 0, bytes: 4 }], ..read(0) };
        assert!(check_sizes(&missing, &records, 2).unwrap_err().to_string().contains("which holds nothing"));
        // Reductions: every rank's buffer must hold count elements.
        let reduce = |count| Plan {
            reads: vec![],
            reduction: Some(Reduction { buf: vec![0, 0], dst: 0, count, dtype: DType::F32, op: ReduceOp::Sum }),
            ..read(0)
        };
        assert!(check_sizes(&reduce(99), &records, 2).unwrap_err().to_string().contains("rank 0's buffer 0"));
        let equal = vec![record(vec![(0, 0, 400, vec![])]), record(vec![(0, 0, 400, vec![])])];
        assert!(check_sizes(&reduce(100), &equal, 2).is_ok());
        // A zero-byte read of a buffer that holds more is a mismatch too; a
        // rank past the group's, and a staged buffer past its staging buffer,
        // hold nothing.
        assert!(check_sizes(&read(0), &records, 2).is_err());
        let beyond = Plan { reads: vec![Read { from: 5, buf: 0, dst: 0, bytes: 4 }], ..read(0) };
        assert!(check_sizes(&beyond, &records, 2).is_err());
        let staged = vec![record(vec![(0, 0, 400, vec![])]), Record { staged: true, ..record(vec![((1 << 20) - 396, 0, 400, vec![])]) }];
        assert!(check_sizes(&read(400), &staged, 2).unwrap_err().to_string().contains("which holds nothing"));
    }
}
