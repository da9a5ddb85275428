//! The pieces every pipelined algorithm shares (ring, halving-doubling,
//! chain, sparse): how a step is cut into segments, one step that sends
//! and receives segment by segment while combining what arrived, and a
//! buffer cut into per-rank blocks.

use super::steps::Steps;
use crate::backend::OpContext;
use crate::error::Result;
use std::ops::Range;

/// Default bytes per pipelined segment of a ring step: small enough that a
/// received segment is still in the L2 cache when it is reduced
/// (figures: bench/RESULTS.md, "Algorithm choices").
pub const SEGMENT_BYTES: usize = 256 << 10;

/// Bytes per segment of a pipelined ring step: the op's
/// [`OpContext::segment_bytes`] (its hint, the group's or the transport's,
/// settled when it was issued, `select.rs`), else [`SEGMENT_BYTES`];
/// rounded down to whole elements of `esize` bytes.
fn segment_bytes(ctx: &OpContext, esize: usize) -> usize {
    (ctx.segment_bytes.unwrap_or(SEGMENT_BYTES) / esize).max(1) * esize
}

/// Where a pipelined step lands what it receives.
pub(super) enum Landing<'a> {
    /// One segment of scratch, reused for every segment.
    Scratch(&'a mut [u8]),
    /// The whole incoming block, received in place.
    InPlace(&'a mut [u8]),
}

/// How a ring step is cut: `count` segments of `bytes` each. Every rank
/// derives it from the largest block, so sender and receiver agree on the
/// number of messages even where block sizes differ.
#[derive(Clone, Copy)]
pub(super) struct Segments {
    /// Bytes per segment (whole elements).
    pub bytes: usize,
    /// Segments per step.
    pub count: usize,
}

impl Segments {
    pub fn new(c: &Steps<'_>, largest_block: usize, esize: usize) -> Result<Segments> {
        let bytes = segment_bytes(c.ctx(), esize);
        Ok(Segments { bytes, count: largest_block.div_ceil(bytes) })
    }
    /// Segment `j` of a block of `len` bytes (empty past its end).
    pub fn piece(&self, j: usize, len: usize) -> Range<usize> {
        (j * self.bytes).min(len)..((j + 1) * self.bytes).min(len)
    }
}

/// One ring step in segments: segment j of `send` goes right while segment
/// j of the `rlen` incoming bytes comes from the left, and
/// `combine(range, received)` runs on it while it is still in cache. The
/// segments share the step's tag: a transport delivers one peer's messages
/// in order.
pub(super) fn pipelined_step(
    c: &Steps<'_>,
    step: u32,
    (right, send): (usize, &[u8]),
    (left, rlen, mut landing): (usize, usize, Landing<'_>),
    seg: Segments,
    mut combine: impl FnMut(Range<usize>, &mut [u8]),
) -> Result<()> {
    for j in 0..seg.count {
        let rp = seg.piece(j, rlen);
        let land = match &mut landing {
            Landing::Scratch(t) => &mut t[..rp.len()],
            Landing::InPlace(b) => &mut b[rp.clone()],
        };
        c.send_recv(step, right, &send[seg.piece(j, send.len())], left, land)?;
        combine(rp, land);
    }
    Ok(())
}

/// `buf` cut at `bounds` (W+1 increasing offsets) into W disjoint blocks.
pub(super) fn split_blocks<'b>(buf: &'b mut [u8], bounds: &[usize]) -> Vec<&'b mut [u8]> {
    let mut blocks = Vec::with_capacity(bounds.len() - 1);
    let mut rest = buf;
    for pair in bounds.windows(2) {
        let (head, tail) = rest.split_at_mut(pair[1] - pair[0]);
        blocks.push(head);
        rest = tail;
    }
    blocks
}
