//! Ring algorithms: reduce-scatter, all-gather, and all-reduce as the two in
//! sequence. Every rank sends to its right neighbour and receives from its
//! left, W-1 steps each; blocks may have any size, zero included. The ring
//! runs along [`Steps::line`] (ranks sharing a core next to each other), so
//! block indices are ranks at positions relative to this rank's.

use super::line::Line;
use super::pipeline::{pipelined_step, split_blocks, Landing, Segments};
use super::steps::Steps;
use crate::dtype::DType;
use crate::error::Result;
use crate::kernels::{finish, prescale, reduce_into, AlignedBuf, Scratch};
use crate::reduce_op::ReduceOp;

/// Ring reduce-scatter over blocks given by `input(i)`: `out` gets the
/// finished (`Avg` divided) reduction of block `rank`. Step k sends the
/// partial block received at step k-1 (the own input at step 0) and adds
/// the own input into the one received; the last step receives into `out`.
fn reduce_scatter_blocks<'b>(
    c: &Steps<'_>,
    input: impl Fn(usize) -> &'b [u8],
    out: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    step0: u32,
) -> Result<()> {
    let (w, line) = (c.size(), c.line());
    let me = line.me;
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
    if w == 1 {
        crate::kernels::copy(out, block(0));
    } else {
        let max = (0..w).map(|i| block(i).len()).max().unwrap_or(0);
        let seg = Segments::new(c, max, dtype.size())?;
        // Partial blocks in flight: received into one, sent from the other.
        let (mut sending, mut receiving) = (Scratch::take(if w > 2 { max } else { 0 }), Scratch::take(if w > 2 { max } else { 0 }));
        let mut send_len = 0;
        let c = &c.combining();
        for k in 0..w - 1 {
            let rb = line.rank(me + 2 * w - k - 2);
            let rlen = block(rb).len();
            let send: &[u8] = if k == 0 { block(line.rank(me + w - 1)) } else { &sending[..send_len] };
            let land: &mut [u8] = if k == w - 2 { &mut *out } else { &mut receiving[..rlen] };
            pipelined_step(c, step0 + k as u32, (line.right(), send), (line.left(), rlen, Landing::InPlace(land)), seg, |rp, got| {
                reduce_into(got, &block(rb)[rp], dtype, op)
            })?;
            std::mem::swap(&mut sending, &mut receiving);
            send_len = rlen;
        }
    }
    finish(out, dtype, op, w);
    Ok(())
}

/// Ring all-gather along `line` (the op's, built once): `blocks[rank]`
/// already holds this rank's data, or `own` does (it is copied in first,
/// but sent from `own` itself). Every step but an `own` block's sends a
/// block this rank has just written (it reduced it, or received it in the
/// step before).
fn all_gather_blocks(c: &Steps<'_>, line: Line<'_>, blocks: &mut [&mut [u8]], own: Option<&[u8]>, step0: u32) -> Result<()> {
    let (w, r) = (c.size(), c.rank());
    let (right, left, me) = (line.right(), line.left(), line.me);
    if let Some(own) = own {
        crate::kernels::copy(blocks[r], own);
    }
    for k in 0..w.saturating_sub(1) {
        let (sb, rb) = (line.rank(me + w - k), line.rank(me + 2 * w - k - 1));
        let [send, recv] = blocks.get_disjoint_mut([sb, rb]).expect("distinct blocks when w > 1");
        // Only step 0 sends this rank's own block.
        let (send, c) = match own {
            Some(own) if k == 0 => (own, *c),
            _ => (&**send, c.sending_fresh()),
        };
        c.send_recv(step0 + k as u32, right, send, left, recv)?;
    }
    Ok(())
}

/// `outputs[i]` = rank i's input. The first step sends `input` itself, not
/// the copy in `outputs[rank]`: a peer reading (single-copy) a buffer this
/// rank has just written pulls every line out of this core's cache, which
/// measured twice as slow as reading one at rest.
pub fn all_gather(c: &Steps<'_>, input: &[u8], outputs: &mut [&mut [u8]]) -> Result<()> {
    all_gather_blocks(c, c.line(), outputs, Some(input), 0)
}

/// `output` = reduction over ranks of their `inputs[rank]`.
pub fn reduce_scatter(c: &Steps<'_>, inputs: &[&[u8]], output: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    reduce_scatter_blocks(c, |i| inputs[i], output, dtype, op, 0)
}

/// In-place all-reduce: a ring reduce-scatter that accumulates in `buf`
/// itself (each step sends the partial block it just reduced and adds the
/// received one into the next), then a ring all-gather of the W blocks
/// (not combining: each rank sends a block its own core has just written).
/// One block of scratch, taken from the pool.
pub fn all_reduce(c: &Steps<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let (w, r) = (c.size(), c.rank());
    let esize = dtype.size();
    let n = buf.len() / esize;
    // Block i covers elements [n*i/w, n*(i+1)/w): sizes differ by at most one.
    let bounds: Vec<usize> = (0..=w).map(|i| n * i / w * esize).collect();
    prescale(buf, dtype, op);
    let line = c.line();
    let (right, left, me) = (line.right(), line.left(), line.me);
    let largest = bounds[1..].iter().zip(&bounds).map(|(b, a)| b - a).max().unwrap_or(0);
    let seg = Segments::new(c, largest, esize)?;
    let mut tmp = Scratch::take(seg.bytes.min(largest));
    let mut blocks = split_blocks(buf, &bounds);
    for k in 0..w.saturating_sub(1) {
        let (sb, rb) = (line.rank(me + 2 * w - k - 1), line.rank(me + 2 * w - k - 2));
        let [send, acc] = blocks.get_disjoint_mut([sb, rb]).expect("distinct blocks when w > 1");
        let rlen = acc.len();
        pipelined_step(&c.combining(), k as u32, (right, send), (left, rlen, Landing::Scratch(&mut tmp)), seg, |rp, got| {
            reduce_into(&mut acc[rp], got, dtype, op)
        })?;
    }
    // After W-1 steps this rank holds the full reduction of block r.
    finish(blocks[r], dtype, op, w);
    drop(tmp);
    all_gather_blocks(c, line, &mut blocks, None, w as u32)
}

/// Broadcast for large buffers: the root scatters W blocks (one to each
/// rank), then a ring all-gather completes every copy. The root sends the
/// buffer about once instead of log2(W) times.
pub fn broadcast_scatter_allgather(c: &Steps<'_>, buf: &mut [u8], root: usize) -> Result<()> {
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
    all_gather_blocks(c, c.line(), &mut blocks, None, 1)
}

/// Reduce for large buffers: a ring reduce-scatter leaves block i reduced on
/// rank i, then every rank sends its block to the root. Each byte crosses
/// the wire about twice instead of log2(W) times in a tree. Only the
/// root's `buf` is written.
pub fn reduce_scatter_gather(c: &Steps<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp, root: usize) -> Result<()> {
    let (w, r) = (c.size(), c.rank());
    let esize = dtype.size();
    let n = buf.len() / esize;
    let bounds: Vec<usize> = (0..=w).map(|i| n * i / w * esize).collect();
    let mut mine = Scratch::take(bounds[r + 1] - bounds[r]);
    {
        let ro: &[u8] = buf;
        reduce_scatter_blocks(c, |i| &ro[bounds[i]..bounds[i + 1]], &mut mine, dtype, op, 0)?;
    }
    let g = c.phase_step(w as u32).sending_fresh();
    if r != root {
        return g.send(0, root, &mine);
    }
    let mut blocks = split_blocks(buf, &bounds);
    crate::kernels::copy(blocks[r], &mine);
    let tag = g.tag(0);
    let mut ops: Vec<crate::backend::P2p<'_>> =
        blocks.iter_mut().enumerate().filter(|(i, _)| *i != r).map(|(peer, b)| crate::backend::P2p::Recv { peer, tag, buf: b }).collect();
    g.exchange(&mut ops)
}
