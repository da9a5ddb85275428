//! Binomial trees rooted at any rank: broadcast and reduce in log2(W) rounds.

use super::Comm;
use crate::dtype::DType;
use crate::error::Result;
use crate::kernels::{finish, prescale, reduce_into, AlignedBuf};
use crate::reduce_op::ReduceOp;

/// Root's `buf` is copied to every rank.
pub fn broadcast(c: &Comm<'_>, buf: &mut [u8], root: usize) -> Result<()> {
    let (w, r) = (c.size(), c.rank());
    let vr = (r + w - root) % w;
    let real = |v: usize| (v + root) % w;
    let mut mask = 1;
    while mask < w {
        if vr & mask != 0 {
            c.recv(0, real(vr - mask), buf)?;
            break;
        }
        mask <<= 1;
    }
    mask >>= 1;
    while mask > 0 {
        if vr + mask < w {
            c.send(0, real(vr + mask), buf)?;
        }
        mask >>= 1;
    }
    Ok(())
}

/// Root's `buf` becomes the reduction of every rank's `buf`; other ranks'
/// buffers are left unchanged (partial sums live in scratch space).
pub fn reduce(c: &Comm<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp, root: usize) -> Result<()> {
    let (w, r) = (c.size(), c.rank());
    let vr = (r + w - root) % w;
    let real = |v: usize| (v + root) % w;
    let mut acc = AlignedBuf::copy_of(buf);
    prescale(acc.as_mut(), dtype, op);
    let mut tmp = AlignedBuf::zeroed(buf.len());
    let mut mask = 1;
    while mask < w {
        if vr & mask == 0 {
            if vr | mask < w {
                c.recv(0, real(vr | mask), tmp.as_mut())?;
                reduce_into(acc.as_mut(), tmp.as_ref(), dtype, op);
            }
        } else {
            return c.send(0, real(vr & !mask), acc.as_ref());
        }
        mask <<= 1;
    }
    finish(acc.as_mut(), dtype, op, w);
    buf.copy_from_slice(acc.as_ref());
    Ok(())
}
