//! Pipelined chain broadcast: root → root+1 → … → root+W-1, segment by
//! segment, each rank forwarding segment j-1 while it receives segment j.
//! "+1" is the next rank in the backend's [`rank_order`], where it gives
//! one: ranks that share a core follow each other, so a hop rarely
//! crosses cores (in rank order every hop may cross, and a third of the
//! runs were twice as slow: bench/RESULTS.md, "Algorithm choices").
//! Every byte crosses W-1 links once, the fewest bytes any broadcast moves
//! (what counts where ranks share cores and each copy costs CPU time), and
//! the time is about N/B plus W-2 segments to fill the pipe (NCCL's
//! broadcast is such a chain).
//!
//! A receiver acknowledges each segment with an empty message, and a
//! sender goes at most [`WINDOW`] segments past the last one acknowledged.
//! Otherwise a root whose next rank waits (to forward, or for a core) runs
//! ahead by the whole buffer, and every segment it sends early is copied
//! aside by the transport and copied again when its receive is posted.
//!
//! [`rank_order`]: crate::backend::Capabilities::rank_order

use super::pipeline::Segments;
use super::steps::Steps;
use crate::backend::P2p;
use crate::error::Result;
use smallvec::{smallvec, SmallVec};

/// How far a sender goes past the last segment acknowledged (the ack of
/// segment i comes once segment i + 1 is awaited). Four of the default
/// 256 KiB fill one shm ring at W=4. Without acknowledgements a receiver
/// that falls behind copies aside nearly the whole buffer, three times
/// slower with ranks bound to cores (figures: bench/RESULTS.md, "Algorithm choices").
pub(crate) const WINDOW: usize = 4;

/// Root's `buf` is copied to every rank.
pub fn broadcast(c: &Steps<'_>, buf: &mut [u8], root: usize) -> Result<()> {
    let w = c.size();
    if w == 1 {
        return Ok(());
    }
    let n = buf.len();
    let seg = Segments::new(c, n, 1)?;
    let line = c.line();
    let (next, prev) = (line.right(), line.left());
    let vr = (line.me + w - line.position(root)) % w;
    let (tag, ack) = (c.tag(0), c.tag(1));
    // Segment i is acknowledged only if its sender waits for that, when it
    // sends segment i + WINDOW: the two sides count alike.
    let acked = |i: usize| i + WINDOW < seg.count;
    if vr == 0 {
        for j in 0..seg.count {
            let mut ops: SmallVec<[P2p<'_>; 2]> = smallvec![P2p::Send { peer: next, tag, data: &buf[seg.piece(j, n)] }];
            if let Some(i) = j.checked_sub(WINDOW) {
                ops.push(P2p::Recv { peer: next, tag: ack, buf: &mut [] });
                debug_assert!(acked(i));
            }
            c.exchange(&mut ops)?;
        }
        return Ok(());
    }
    let forwards = vr < w - 1;
    for j in 0..=seg.count {
        let (got, rest) = buf.split_at_mut(seg.piece(j, n).start);
        let mut ops: SmallVec<[P2p<'_>; 4]> = SmallVec::new();
        if j < seg.count {
            ops.push(P2p::Recv { peer: prev, tag, buf: &mut rest[..seg.piece(j, n).len()] });
        }
        if let Some(i) = j.checked_sub(1) {
            // Segment i came in the step before.
            if acked(i) {
                ops.push(P2p::Send { peer: prev, tag: ack, data: &[] });
            }
            if forwards {
                ops.push(P2p::Send { peer: next, tag, data: &got[seg.piece(i, n)] });
                if i >= WINDOW {
                    ops.push(P2p::Recv { peer: next, tag: ack, buf: &mut [] });
                }
            }
        }
        c.exchange(&mut ops)?;
    }
    Ok(())
}
