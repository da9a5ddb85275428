//! The hierarchical all-reduce, in two forms.
//!
//! - Hosts of equal size L (as NCCL does): reduce-scatter within each host,
//!   so local rank i holds slice i reduced over its host; all-reduce slice
//!   i with the i-th ranks of the other hosts; all-gather within the host.
//!   Every rank works in parallel and each sends 1/L of the data between
//!   hosts.
//! - Otherwise: reduce to each host's leader, all-reduce among leaders,
//!   broadcast from each leader.

use crate::{Inter, SubGroup};
use weft::backend::{Op, OpContext};
use weft::kernels::Scratch;
use weft::{Device, ReduceOp, Result, Tensor, TensorMut};

/// `op`'s parts: what the local reduce and the leaders' all-reduce use, and
/// whether the result is divided by the group size at the end (AVG).
fn split(op: ReduceOp) -> (ReduceOp, ReduceOp, bool) {
    match op {
        ReduceOp::Avg => (ReduceOp::Sum, ReduceOp::Sum, true),
        // Each contribution is scaled once, in the host-local step.
        ReduceOp::PremulSum(f) => (ReduceOp::PremulSum(f), ReduceOp::Sum, false),
        op => (op, op, false),
    }
}

pub fn run(local: &SubGroup, inter: &Inter, buf: &mut TensorMut<'_>, op: ReduceOp, ctx: &OpContext) -> Result<()> {
    let (local_op, inter_op, average) = split(op);
    // The host-local transport carries only this op's two phases: two
    // sequence numbers per op keep their tags apart.
    match inter {
        Inter::Cross(cross) => sliced(local, cross, buf, local_op, inter_op, ctx)?,
        Inter::Leaders(leaders) => {
            local.run(&mut Op::Reduce { buf: buf.reborrow(), root: 0, op: local_op }, ctx, 2 * ctx.seq)?;
            if let Some(leaders) = leaders {
                leaders.run(&mut Op::AllReduce { buf: buf.reborrow(), op: inter_op }, ctx, ctx.seq)?;
            }
            local.run(&mut Op::Broadcast { buf: buf.reborrow(), root: 0 }, ctx, 2 * ctx.seq + 1)?;
        }
    }
    if average {
        let dtype = buf.dtype();
        weft::kernels::finish(buf.host_bytes_mut()?, dtype, ReduceOp::Avg, ctx.size);
    }
    Ok(())
}

/// A host view of `len` bytes at `ptr`.
fn view<'a>(ptr: *const u8, len: usize, dtype: weft::DType) -> Result<Tensor<'a>> {
    // SAFETY: callers pass ranges inside a buffer they hold for the op.
    unsafe { Tensor::from_raw_parts(ptr, dtype, Device::Cpu, &[len / dtype.size()], None) }
}

/// Reduce-scatter within the host, all-reduce slice by slice across hosts,
/// all-gather within the host.
fn sliced(
    local: &SubGroup,
    cross: &SubGroup,
    buf: &mut TensorMut<'_>,
    local_op: ReduceOp,
    inter_op: ReduceOp,
    ctx: &OpContext,
) -> Result<()> {
    let dtype = buf.dtype();
    let (l, me) = (local.size(), local.rank());
    let n = buf.numel();
    let bounds: Vec<usize> = (0..=l).map(|i| n * i / l * dtype.size()).collect();
    let bytes = buf.host_bytes_mut()?;
    // Inputs are a copy: the output slice is part of the buffer.
    let mut input = Scratch::take(bytes.len());
    input.copy_from_slice(bytes);
    let inputs = (0..l).map(|i| view(input[bounds[i]..].as_ptr(), bounds[i + 1] - bounds[i], dtype)).collect::<Result<Vec<_>>>()?;
    let mine = &mut bytes[bounds[me]..bounds[me + 1]];
    local.run(&mut Op::ReduceScatter { inputs, output: view_mut(mine, dtype)?, op: local_op }, ctx, 2 * ctx.seq)?;
    cross.run(&mut Op::AllReduce { buf: view_mut(mine, dtype)?, op: inter_op }, ctx, ctx.seq)?;
    // The all-gather reads this rank's slice from a copy, too.
    let mut own = Scratch::take(mine.len());
    own.copy_from_slice(mine);
    let outputs = bytes_split(bytes, &bounds, dtype)?;
    local.run(&mut Op::AllGather { input: view(own.as_ptr(), own.len(), dtype)?, outputs }, ctx, 2 * ctx.seq + 1)
}

/// A mutable host view of `bytes` as `dtype` elements.
fn view_mut(bytes: &mut [u8], dtype: weft::DType) -> Result<TensorMut<'_>> {
    // SAFETY: `bytes` is borrowed mutably for the view's life; it is a
    // dtype-aligned part of the op's buffer (or of a scratch buffer).
    unsafe { TensorMut::from_raw_parts(bytes.as_mut_ptr(), dtype, Device::Cpu, &[bytes.len() / dtype.size()], None) }
}

/// `bytes` cut at `bounds` into tensors of `dtype`.
fn bytes_split<'a>(bytes: &'a mut [u8], bounds: &[usize], dtype: weft::DType) -> Result<Vec<TensorMut<'a>>> {
    let mut rest = bytes;
    let mut out = Vec::new();
    for w in bounds.windows(2) {
        let (head, tail) = rest.split_at_mut(w[1] - w[0]);
        out.push(view_mut(head, dtype)?);
        rest = tail;
    }
    Ok(out)
}
