//! Checks shared by the ops (`ops.rs`), made before any byte moves: each
//! error names the op and this rank.

use super::debug::Fingerprint;
use crate::backend::OpKind;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::reduce_op::ReduceOp;
use crate::registry::Route;
use crate::tensor::{Device, Layout, Tensor, TensorMut};

/// The checks, for one op on this rank.
pub(super) struct Check {
    pub(super) name: &'static str,
    pub(super) rank: usize,
    pub(super) size: usize,
    /// `WEFT_DEBUG=detail`: ops carry a fingerprint to compare across ranks.
    pub(super) detail: bool,
}

impl Check {
    /// The op's fingerprint, built only when detail checking is on (the
    /// formatting would otherwise cost every op).
    pub(super) fn fingerprint(&self, kind: OpKind, canon: impl FnOnce() -> String) -> Option<Fingerprint> {
        self.detail.then(|| Fingerprint::new(self.name, kind, canon()))
    }
    #[cold]
    pub(super) fn fail(&self, msg: String) -> Error {
        Error::invalid(msg).with_op(self.name).with_rank(self.rank)
    }
    #[inline]
    pub(super) fn rank_arg(&self, what: &str, r: usize) -> Result<()> {
        if r >= self.size {
            return Err(self.fail(format!("{what} {r} is out of range for a group of size {}", self.size)));
        }
        Ok(())
    }
    #[inline]
    pub(super) fn peer(&self, r: usize) -> Result<()> {
        self.rank_arg("peer rank", r)?;
        if r == self.rank {
            return Err(self.fail(format!("peer rank {r} is this rank; copy locally instead")));
        }
        Ok(())
    }
    pub(super) fn list_len(&self, what: &str, n: usize) -> Result<()> {
        if n != self.size {
            return Err(self.fail(format!("{what} has {n} tensors, expected one per rank ({})", self.size)));
        }
        Ok(())
    }
    /// `what` is formatted only on failure (this runs per tensor per op).
    pub(super) fn numel(&self, what: impl std::fmt::Display, got: usize, want: usize) -> Result<()> {
        if got != want {
            return Err(self.fail(format!("{what} has {got} elements, expected {want}")));
        }
        Ok(())
    }
    pub(super) fn reduce_op(&self, op: ReduceOp, dtype: DType) -> Result<()> {
        op.check(dtype).map_err(|e| e.with_op(self.name).with_rank(self.rank))
    }
    /// All tensors share dtype and device, are dense and contiguous; returns the route.
    pub(super) fn tensors(&self, ts: impl IntoIterator<Item = (DType, Device, bool)>) -> Result<(Route, DType, Device)> {
        let mut first: Option<(DType, Device)> = None;
        for (i, (dtype, device, contiguous)) in ts.into_iter().enumerate() {
            if !contiguous {
                return Err(self.fail(format!("tensor {i} is not contiguous (strided views are not supported yet)")));
            }
            match first {
                None => first = Some((dtype, device)),
                Some((d, _)) if d != dtype => {
                    return Err(self.fail(format!("tensor {i} has dtype {dtype}, expected {d} like the first tensor")))
                }
                Some((_, dev)) if dev != device => {
                    return Err(self.fail(format!("tensor {i} is on {device}, expected {dev} like the first tensor")))
                }
                _ => {}
            }
        }
        let (dtype, device) = first.unwrap_or((DType::U8, Device::Cpu));
        Ok(((device.kind(), Layout::Dense), dtype, device))
    }
}

pub(super) fn meta(t: &Tensor<'_>) -> (DType, Device, bool) {
    (t.dtype(), t.device(), t.is_contiguous())
}
pub(super) fn meta_mut(t: &TensorMut<'_>) -> (DType, Device, bool) {
    (t.dtype(), t.device(), t.is_contiguous())
}
