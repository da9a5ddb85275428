//! Pipelined chain broadcast: root → root+1 → … → root+W-1, segment by
//! segment, each rank forwarding segment j-1 while it receives segment j.
//! Every byte crosses W-1 links once, the fewest bytes any broadcast moves
//! (what counts where ranks share cores and each copy costs CPU time), and
//! the time is about N/B plus W-2 segments to fill the pipe (NCCL's
//! broadcast is such a chain).

use super::pipeline::Segments;
use super::Comm;
use crate::backend::P2p;
use crate::error::Result;

/// Root's `buf` is copied to every rank.
pub fn broadcast(c: &Comm<'_>, buf: &mut [u8], root: usize) -> Result<()> {
    let (w, r) = (c.size(), c.rank());
    if w == 1 {
        return Ok(());
    }
    let n = buf.len();
    let seg = Segments::new(c, n, 1)?;
    let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
    let vr = (r + w - root) % w;
    let tag = c.tag(0);
    if vr == 0 {
        for j in 0..seg.count {
            c.exchange(&mut [P2p::Send { peer: next, tag, data: &buf[seg.piece(j, n)] }])?;
        }
        return Ok(());
    }
    let forwards = vr < w - 1;
    for j in 0..=seg.count {
        let (got, rest) = buf.split_at_mut(seg.piece(j, n).start);
        let mut ops = Vec::with_capacity(2);
        if j < seg.count {
            ops.push(P2p::Recv { peer: prev, tag, buf: &mut rest[..seg.piece(j, n).len()] });
        }
        if j > 0 && forwards {
            ops.push(P2p::Send { peer: next, tag, data: &got[seg.piece(j - 1, n)] });
        }
        c.exchange(&mut ops)?;
    }
    Ok(())
}
