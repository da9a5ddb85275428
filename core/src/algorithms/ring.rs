//! Ring algorithms: reduce-scatter, all-gather, and all-reduce as the two in
//! sequence. Every rank sends to its right neighbour and receives from its
//! left, W-1 steps each; blocks may have any size, zero included.

use super::Comm;
use crate::dtype::DType;
use crate::error::Result;
use crate::kernels::{finish, prescale, reduce_into, AlignedBuf, Scratch};
use crate::reduce_op::ReduceOp;

/// Ring reduce-scatter over blocks given by `input(i)`; returns this rank's
/// fully reduced block (finished: `Avg` divided).
fn reduce_scatter_blocks<'b>(c: &Comm<'_>, input: impl Fn(usize) -> &'b [u8], dtype: DType, op: ReduceOp, step0: u32) -> Result<Scratch> {
    let (w, r) = (c.size(), c.rank());
    // PremulSum scales each rank's own contribution once, before it is used.
    let scaled: Option<Vec<AlignedBuf>> = matches!(op, ReduceOp::PremulSum(_)).then(|| {
        (0..w)
            .map(|i| {
                let mut b = AlignedBuf::copy_of(input(i));
                prescale(b.as_mut(), dtype, op);
                b
            })
            .collect()
    });
    let block = |i: usize| -> &[u8] {
        match &scaled {
            Some(s) => s[i].as_ref(),
            None => input(i),
        }
    };
    let max = (0..w).map(|i| block(i).len()).max().unwrap_or(0);
    let (right, left) = ((r + 1) % w, (r + w - 1) % w);
    let first = block((r + w - 1) % w);
    let mut acc = Scratch::take(max);
    acc[..first.len()].copy_from_slice(first);
    let mut recv = Scratch::take(max);
    let mut send_len = first.len();
    for k in 0..w.saturating_sub(1) {
        let rb = (r + 2 * w - k - 2) % w;
        let rlen = block(rb).len();
        c.send_recv(step0 + k as u32, right, &acc[..send_len], left, &mut recv[..rlen])?;
        reduce_into(&mut recv[..rlen], block(rb), dtype, op);
        std::mem::swap(&mut acc, &mut recv);
        send_len = rlen;
    }
    acc.truncate(send_len);
    finish(&mut acc, dtype, op, w);
    Ok(acc)
}

/// Ring all-gather: `blocks[rank]` already holds this rank's data.
fn all_gather_blocks(c: &Comm<'_>, blocks: &mut [&mut [u8]], step0: u32) -> Result<()> {
    let (w, r) = (c.size(), c.rank());
    let (right, left) = ((r + 1) % w, (r + w - 1) % w);
    for k in 0..w.saturating_sub(1) {
        let (sb, rb) = ((r + w - k) % w, (r + 2 * w - k - 1) % w);
        let [send, recv] = blocks.get_disjoint_mut([sb, rb]).expect("distinct blocks when w > 1");
        c.send_recv(step0 + k as u32, right, send, left, recv)?;
    }
    Ok(())
}

/// `outputs[i]` = rank i's input.
pub fn all_gather(c: &Comm<'_>, input: &[u8], outputs: &mut [&mut [u8]]) -> Result<()> {
    outputs[c.rank()].copy_from_slice(input);
    all_gather_blocks(c, outputs, 0)
}

/// `output` = reduction over ranks of their `inputs[rank]`.
pub fn reduce_scatter(c: &Comm<'_>, inputs: &[&[u8]], output: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let mine = reduce_scatter_blocks(c, |i| inputs[i], dtype, op, 0)?;
    output.copy_from_slice(&mine);
    Ok(())
}

/// In-place all-reduce: a ring reduce-scatter that accumulates in `buf`
/// itself (each step sends the partial block it just reduced and adds the
/// received one into the next), then a ring all-gather of the W blocks.
/// One block of scratch, taken from the pool.
pub fn all_reduce(c: &Comm<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let (w, r) = (c.size(), c.rank());
    let esize = dtype.size();
    let n = buf.len() / esize;
    // Block i covers elements [n*i/w, n*(i+1)/w): sizes differ by at most one.
    let bounds: Vec<usize> = (0..=w).map(|i| n * i / w * esize).collect();
    let range = |i: usize| bounds[i]..bounds[i + 1];
    prescale(buf, dtype, op);
    let (right, left) = ((r + 1) % w, (r + w - 1) % w);
    let mut tmp = Scratch::take(bounds[1..].iter().zip(&bounds).map(|(b, a)| b - a).max().unwrap_or(0));
    for k in 0..w.saturating_sub(1) {
        let (sb, rb) = ((r + 2 * w - k - 1) % w, (r + 2 * w - k - 2) % w);
        let rlen = range(rb).len();
        c.send_recv(k as u32, right, &buf[range(sb)], left, &mut tmp[..rlen])?;
        reduce_into(&mut buf[range(rb)], &tmp[..rlen], dtype, op);
    }
    // After W-1 steps this rank holds the full reduction of block r.
    finish(&mut buf[range(r)], dtype, op, w);
    drop(tmp);
    let mut blocks = split_blocks(buf, &bounds);
    all_gather_blocks(c, &mut blocks, w as u32)
}

/// Broadcast for large buffers: the root scatters W blocks (one to each
/// rank), then a ring all-gather completes every copy. The root sends the
/// buffer about once instead of log2(W) times.
pub fn broadcast_scatter_allgather(c: &Comm<'_>, buf: &mut [u8], root: usize) -> Result<()> {
    let (w, r) = (c.size(), c.rank());
    let n = buf.len();
    let bounds: Vec<usize> = (0..=w).map(|i| n * i / w).collect();
    if r == root {
        let tag = c.tag(0);
        let mut ops: Vec<crate::backend::P2p<'_>> = (0..w)
            .filter(|i| *i != root)
            .map(|i| crate::backend::P2p::Send { peer: i, tag, data: &buf[bounds[i]..bounds[i + 1]] })
            .collect();
        c.exchange(&mut ops)?;
    } else {
        c.recv(0, root, &mut buf[bounds[r]..bounds[r + 1]])?;
    }
    let mut blocks = split_blocks(buf, &bounds);
    all_gather_blocks(c, &mut blocks, 1)
}

/// `buf` cut at `bounds` (W+1 increasing offsets) into W disjoint blocks.
fn split_blocks<'b>(buf: &'b mut [u8], bounds: &[usize]) -> Vec<&'b mut [u8]> {
    let mut blocks = Vec::with_capacity(bounds.len() - 1);
    let mut rest = buf;
    for pair in bounds.windows(2) {
        let (head, tail) = rest.split_at_mut(pair[1] - pair[0]);
        blocks.push(head);
        rest = tail;
    }
    blocks
}

/// Reduce for large buffers: a ring reduce-scatter leaves block i reduced on
/// rank i, then every rank sends its block to the root. Each byte crosses
/// the wire about twice instead of log2(W) times in a tree.
pub fn reduce_scatter_gather(c: &Comm<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp, root: usize) -> Result<()> {
    let (w, r) = (c.size(), c.rank());
    let esize = dtype.size();
    let n = buf.len() / esize;
    let bounds: Vec<usize> = (0..=w).map(|i| n * i / w * esize).collect();
    let mine = {
        let ro: &[u8] = buf;
        reduce_scatter_blocks(c, |i| &ro[bounds[i]..bounds[i + 1]], dtype, op, 0)?
    };
    let g = c.phase_step(w as u32);
    if r != root {
        return g.send(0, root, &mine);
    }
    let mut blocks = split_blocks(buf, &bounds);
    blocks[r].copy_from_slice(&mine);
    let tag = g.tag(0);
    let mut ops: Vec<crate::backend::P2p<'_>> =
        blocks.iter_mut().enumerate().filter(|(i, _)| *i != r).map(|(peer, b)| crate::backend::P2p::Recv { peer, tag, buf: b }).collect();
    g.exchange(&mut ops)
}
