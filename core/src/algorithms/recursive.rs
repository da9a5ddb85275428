//! Recursive doubling all-reduce: log2(W) exchange steps of the whole
//! buffer, for small messages where steps cost more than bytes. Ranks
//! beyond the largest power of two first fold into a partner and get the
//! result back at the end (as MPICH does; `fold.rs`). At every step both partners combine the same two
//! partial values, so all ranks end bit-identical.

use super::fold::Fold;
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
    if let Some(v) = fold.enter(c, buf, &mut tmp, dtype, op)? {
        // Both partners reduce into the lower rank's data: where the order
        // shows in the bits (min of -0.0 and +0.0, which NaN payload
        // survives), both must still end alike. (Swapping the operands of
        // the reduction instead does not do: the compiler may commute an
        // addition; only the same accumulator gives both the same bits.)
        // So the partial result lies in `buf` or in `tmp`.
        let tmp = &mut tmp[..buf.len()];
        let (mut mask, mut step, mut in_tmp) = (1, 1, false);
        while mask < fold.p {
            let peer = fold.real(v ^ mask);
            let (mine, theirs) = if in_tmp { (&mut *tmp, &mut *buf) } else { (&mut *buf, &mut *tmp) };
            c.combining().send_recv(step, peer, mine, peer, theirs)?;
            if v & mask == 0 {
                reduce_into(mine, theirs, dtype, op);
            } else {
                reduce_into(theirs, mine, dtype, op);
                in_tmp = !in_tmp;
            }
            mask <<= 1;
            step += 1;
        }
        if in_tmp {
            crate::kernels::copy(buf, tmp);
        }
        finish(buf, dtype, op, c.size());
    }
    fold.leave(c, buf)
}
