//! Recursive doubling all-reduce: log2(W) exchange steps of the whole
//! buffer, for small messages where steps cost more than bytes. Ranks
//! beyond the largest power of two first fold into a partner and get the
//! result back at the end (as MPICH does; [`Fold`] is shared with
//! halving-doubling). At every step both partners combine the same two
//! partial values, so all ranks end bit-identical.

use super::Comm;
use crate::dtype::DType;
use crate::error::Result;
use crate::kernels::{finish, prescale, reduce_into, Scratch};
use crate::reduce_op::ReduceOp;

/// The step tag of the unfold, past any exchange step.
const UNFOLD_STEP: u32 = u16::MAX as u32;

/// Folding W ranks onto the largest power of two p ≤ W: in the first
/// 2·(W-p) ranks each even rank hands its data to the next odd one, which
/// stands for both as one virtual rank; the others keep going as rank - (W-p).
pub(super) struct Fold {
    /// The power of two the exchange runs on.
    pub p: usize,
    rem: usize,
    rank: usize,
}

impl Fold {
    pub fn new(c: &Comm<'_>) -> Fold {
        let w = c.size();
        let p = if w == 0 { 0 } else { 1 << (usize::BITS - 1 - w.leading_zeros()) };
        Fold { p, rem: w - p, rank: c.rank() }
    }

    /// The real rank standing for virtual rank `v`.
    pub fn real(&self, v: usize) -> usize {
        if v < self.rem {
            2 * v + 1
        } else {
            v + self.rem
        }
    }

    /// This rank's virtual rank, or None when it sits the exchange out.
    pub fn virtual_rank(&self) -> Option<usize> {
        match (self.sits_out_for(), self.stands_for()) {
            (Some(_), _) => None,
            (None, Some(_)) => Some(self.rank / 2),
            (None, None) => Some(self.rank - self.rem),
        }
    }

    /// The rank this one hands its data to, and sits out for.
    pub fn sits_out_for(&self) -> Option<usize> {
        (self.rank < 2 * self.rem && self.rank.is_multiple_of(2)).then_some(self.rank + 1)
    }

    /// The rank whose data this one takes in and stands for.
    pub fn stands_for(&self) -> Option<usize> {
        (self.rank < 2 * self.rem && !self.rank.is_multiple_of(2)).then(|| self.rank - 1)
    }

    /// Fold `buf` in (as step 0, reducing with `tmp` of at least its size);
    /// this rank's virtual rank, or None when it sits the exchange out.
    pub fn enter(&self, c: &Comm<'_>, buf: &mut [u8], tmp: &mut [u8], dtype: DType, op: ReduceOp) -> Result<Option<usize>> {
        let c = &c.combining();
        if let Some(to) = self.sits_out_for() {
            c.send(0, to, buf)?;
        } else if let Some(from) = self.stands_for() {
            let tmp = &mut tmp[..buf.len()];
            c.recv(0, from, tmp)?;
            reduce_into(buf, tmp, dtype, op);
        }
        Ok(self.virtual_rank())
    }

    /// Give the finished `buf` back to the ranks that folded in.
    pub fn leave(&self, c: &Comm<'_>, buf: &mut [u8]) -> Result<()> {
        let c = &c.sending_fresh();
        if let Some(to) = self.stands_for() {
            c.send(UNFOLD_STEP, to, buf)
        } else if let Some(from) = self.sits_out_for() {
            c.recv(UNFOLD_STEP, from, buf)
        } else {
            Ok(())
        }
    }
}

/// In-place all-reduce of `buf`.
pub fn all_reduce(c: &Comm<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
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
            buf.copy_from_slice(tmp);
        }
        finish(buf, dtype, op, c.size());
    }
    fold.leave(c, buf)
}
