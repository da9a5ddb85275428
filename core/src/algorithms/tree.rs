//! Binomial trees rooted at any rank: broadcast and reduce in log2(W) rounds.

use super::pipeline::Segments;
use super::steps::Steps;
use crate::dtype::DType;
use crate::error::Result;
use crate::kernels::{finish, prescale, reduce_into, Scratch};
use crate::reduce_op::ReduceOp;

/// Root's `buf` is copied to every rank.
pub fn broadcast(c: &Steps<'_>, buf: &mut [u8], root: usize) -> Result<()> {
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
/// buffers are left unchanged (partial sums live in pooled scratch; the
/// root accumulates in place). Each transfer goes in segments, reduced
/// while they are still in cache.
pub fn reduce(c: &Steps<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp, root: usize) -> Result<()> {
    let (w, r) = (c.size(), c.rank());
    let vr = (r + w - root) % w;
    let real = |v: usize| (v + root) % w;
    let seg = Segments::new(c, buf.len(), dtype.size())?;
    // How many children send to this rank: one per low zero bit of vr.
    let children = (0..usize::BITS).map(|b| 1usize << b).take_while(|m| *m < w && vr & m == 0).filter(|m| vr | m < w).count();
    // A separate accumulator where `buf` must stay unchanged or be scaled.
    let scaled = matches!(op, ReduceOp::PremulSum(_));
    let mut own = (r != root && children > 0 || scaled).then(|| {
        let mut a = Scratch::take(buf.len());
        crate::kernels::copy(&mut a, buf);
        prescale(&mut a, dtype, op);
        a
    });
    let acc: &mut [u8] = match &mut own {
        Some(a) => a,
        None => buf,
    };
    let mut tmp = Scratch::take(seg.bytes.min(acc.len()));
    let c = &c.combining();
    let mut mask = 1;
    while mask < w {
        if vr & mask == 0 {
            if vr | mask < w {
                let from = real(vr | mask);
                for j in 0..seg.count {
                    let p = seg.piece(j, acc.len());
                    c.recv(0, from, &mut tmp[..p.len()])?;
                    reduce_into(&mut acc[p.clone()], &tmp[..p.len()], dtype, op);
                }
            }
        } else {
            let to = real(vr & !mask);
            for j in 0..seg.count {
                c.send(0, to, &acc[seg.piece(j, acc.len())])?;
            }
            return Ok(());
        }
        mask <<= 1;
    }
    finish(acc, dtype, op, w);
    if let Some(a) = &own {
        crate::kernels::copy(buf, a);
    }
    Ok(())
}
