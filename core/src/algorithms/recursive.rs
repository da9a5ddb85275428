//! Recursive doubling all-reduce: log2(W) exchange steps of the whole
//! buffer, for small messages where steps cost more than bytes. Ranks
//! beyond the largest power of two first fold into a partner and get the
//! result back at the end (as MPICH does). At every step both partners
//! combine the same two partial values, so all ranks end bit-identical.

use super::Comm;
use crate::dtype::DType;
use crate::error::Result;
use crate::kernels::{finish, prescale, reduce_into, Scratch};
use crate::reduce_op::ReduceOp;

/// In-place all-reduce of `buf`.
pub fn all_reduce(c: &Comm<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let (w, r) = (c.size(), c.rank());
    prescale(buf, dtype, op);
    let p = if w == 0 { 0 } else { 1 << (usize::BITS - 1 - w.leading_zeros()) };
    let rem = w - p;
    let mut tmp = Scratch::take(buf.len());
    // Fold: in the first 2*rem ranks, each even rank hands its data to the next odd one.
    let virt = if r < 2 * rem {
        if r % 2 == 0 {
            c.send(0, r + 1, buf)?;
            None
        } else {
            c.recv(0, r - 1, &mut tmp)?;
            reduce_into(buf, &tmp, dtype, op);
            Some(r / 2)
        }
    } else {
        Some(r - rem)
    };
    if let Some(v) = virt {
        let real = |x: usize| if x < rem { 2 * x + 1 } else { x + rem };
        let mut mask = 1;
        let mut step = 1;
        while mask < p {
            let peer = real(v ^ mask);
            c.send_recv(step, peer, buf, peer, &mut tmp)?;
            reduce_into(buf, &tmp, dtype, op);
            mask <<= 1;
            step += 1;
        }
        finish(buf, dtype, op, w);
    }
    // Unfold: odd ranks give the finished result back to the rank that folded into them.
    if r < 2 * rem {
        if r % 2 == 1 {
            c.send(u16::MAX as u32, r - 1, buf)?;
        } else {
            c.recv(u16::MAX as u32, r + 1, buf)?;
        }
    }
    Ok(())
}
