//! Halving-doubling all-reduce (Rabenseifner): a reduce-scatter by
//! recursive halving (each step exchanges half of what is left with a
//! partner at distance p/2, p/4, … 1) and an all-gather by recursive
//! doubling back up. The same bytes as a ring in 2·log2(p) steps instead of
//! 2·(p-1): the choice for medium messages. Ranks beyond the power of two
//! fold in first ([`Fold`]).

use super::fold::Fold;
use super::pipeline::{pipelined_step, Landing, Segments};
use super::steps::Steps;
use crate::dtype::DType;
use crate::error::Result;
use crate::kernels::{finish, prescale, reduce_into, Scratch};
use crate::reduce_op::ReduceOp;

/// In-place all-reduce of `buf`.
pub fn all_reduce(c: &Steps<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    prescale(buf, dtype, op);
    let fold = Fold::new(c);
    let mut tmp = Scratch::take(buf.len());
    let Some(v) = fold.enter(c, buf, &mut tmp, dtype, op)? else {
        return fold.leave(c, buf);
    };
    let p = fold.p;
    let esize = dtype.size();
    let n = buf.len() / esize;
    // Virtual rank i ends up owning block i: elements [n*i/p, n*(i+1)/p).
    let at = |block: usize| n * block / p * esize;
    // Blocks [lo, hi) are this rank's share; halve it each step.
    let (mut lo, mut hi) = (0, p);
    let mut mask = p / 2;
    let mut step = 1;
    while mask > 0 {
        let peer = fold.real(v ^ mask);
        let mid = (lo + hi) / 2;
        let (keep, give) = if v & mask == 0 { ((lo, mid), (mid, hi)) } else { ((mid, hi), (lo, mid)) };
        let (keep_r, give_r) = (at(keep.0)..at(keep.1), at(give.0)..at(give.1));
        let seg = Segments::new(c, keep_r.len().max(give_r.len()), esize)?;
        let (kept, given) = split_pair(buf, keep_r.clone(), give_r);
        pipelined_step(&c.combining(), step, (peer, given), (peer, keep_r.len(), Landing::Scratch(&mut tmp)), seg, |rp, got| {
            reduce_into(&mut kept[rp], got, dtype, op)
        })?;
        (lo, hi) = keep;
        mask /= 2;
        step += 1;
    }
    finish(&mut buf[at(lo)..at(hi)], dtype, op, c.size());
    // All-gather back up: swap shares with partners at distance 1, 2, … p/2.
    let mut mask = 1;
    while mask < p {
        let peer = fold.real(v ^ mask);
        let width = hi - lo;
        let theirs = if v & mask == 0 { (hi, hi + width) } else { (lo - width, lo) };
        let (mine_r, theirs_r) = (at(lo)..at(hi), at(theirs.0)..at(theirs.1));
        let (got, mine) = split_pair(buf, theirs_r, mine_r);
        c.sending_fresh().send_recv(step, peer, mine, peer, got)?;
        (lo, hi) = (lo.min(theirs.0), hi.max(theirs.1));
        mask *= 2;
        step += 1;
    }
    fold.leave(c, buf)
}

/// Two disjoint ranges of `buf`: the first mutable, the second shared.
fn split_pair(buf: &mut [u8], a: std::ops::Range<usize>, b: std::ops::Range<usize>) -> (&mut [u8], &[u8]) {
    if a.start >= b.end {
        let (head, tail) = buf.split_at_mut(a.start);
        (&mut tail[..a.len()], &head[b])
    } else {
        let (head, tail) = buf.split_at_mut(b.start);
        (&mut head[a], &tail[..b.len()])
    }
}
