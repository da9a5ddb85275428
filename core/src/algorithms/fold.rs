//! Folding a group onto the largest power of two (as MPICH does), for the
//! algorithms that need one: recursive doubling, halving-doubling, the
//! sparse all-reduce's exchanges. The ranks beyond it hand their data to a
//! partner first and get the result back at the end.

use super::steps::Steps;
use crate::dtype::DType;
use crate::error::Result;
use crate::kernels::reduce_into;
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
    pub fn new(c: &Steps<'_>) -> Fold {
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
    pub fn enter(&self, c: &Steps<'_>, buf: &mut [u8], tmp: &mut [u8], dtype: DType, op: ReduceOp) -> Result<Option<usize>> {
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
    pub fn leave(&self, c: &Steps<'_>, buf: &mut [u8]) -> Result<()> {
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
