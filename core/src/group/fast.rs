//! Small collectives issued straight to a transport's fast path
//! ([`Backend::fast_op`]): a direct all_reduce, broadcast, barrier,
//! all_gather_single or reduce_scatter_single of host tensors, without
//! hints or a chosen algorithm, takes its turn in the group's order as any
//! collective, then hands its bytes to the transport without building the
//! op's list of views and the job first (at W=4 on 2 cores those were a
//! few hundred nanoseconds of an op's path, in every rank's turn). Where
//! the transport has no fast path for it, the op runs as a job in the same
//! turn.

use super::executor::Turn;
use super::ops::Job;
use super::work::Work;
use super::GroupCore;
use crate::algorithms::select;
use crate::backend::{Backend, Deadline, FastOp, OpKind};
use crate::dtype::DType;
use crate::error::Result;
use crate::options::OpOptions;
use crate::registry::Route;
use crate::tensor::{DeviceKind, Layout};
use std::sync::Arc;
use std::time::Duration;

/// Where a direct small collective of host tensors goes first: the
/// group's transport for them. What [`GroupCore::fast_lane`] hands out.
pub struct FastLane<'g> {
    core: &'g GroupCore,
    backend: &'g Arc<dyn Backend>,
}

/// A [`FastLane`] op's turn in the group's order: [`FastTurn::fast`]
/// offers it to the transport's fast path, [`FastTurn::job`] runs it as
/// usual where that declined. Dropped, it passes the turn on.
pub struct FastTurn<'g> {
    core: &'g GroupCore,
    backend: &'g Arc<dyn Backend>,
    seq: u64,
    timeout: Duration,
    _turn: Turn<'g>,
}

impl GroupCore {
    /// The lane for a direct collective of `kind` on `route`'s tensors of
    /// `dtype`, if nothing asks for more than the transport's own choice:
    /// host tensors, not bools (cleaned after a job), no hints, no
    /// algorithm chosen for its family, no `WEFT_DEBUG=detail` check.
    pub(crate) fn fast_lane(&self, route: Route, kind: OpKind, dtype: DType, opts: &OpOptions) -> Option<FastLane<'_>> {
        if route != (DeviceKind::Cpu, Layout::Dense) || dtype == DType::Bool || self.debug_detail {
            return None;
        }
        if !opts.hints.is_empty() || !self.options.hints.is_empty() {
            return None;
        }
        let backend = self.backend(route)?;
        if let Some(family) = select::family(kind) {
            if !matches!(select::forced(family, None, &self.algorithms, backend.native_algorithms(family)), Ok(None)) {
                return None;
            }
        }
        Some(FastLane { core: self, backend })
    }
}

impl<'g> FastLane<'g> {
    /// Wait for the op's turn (it takes its ticket now), within `opts`'
    /// timeout, else the group's.
    pub fn turn(self, opts: &OpOptions) -> FastTurn<'g> {
        let (turn, seq) = self.core.exec.begin(self.core.exec.issue(), true);
        let timeout = opts.timeout.unwrap_or(self.core.options.timeout);
        FastTurn { core: self.core, backend: self.backend, seq, timeout, _turn: turn }
    }
}

impl FastTurn<'_> {
    /// Offer op `name` (`op`) to the transport's fast path: its outcome as
    /// a finished [`Work`], or `None` if the transport declined (nothing
    /// was done).
    pub fn fast<'t>(&self, name: &'static str, op: FastOp<'_>) -> Option<Work<'t>> {
        let (core, deadline) = (self.core, Deadline::after(self.timeout));
        let mut declined = false;
        let result = core.guarded(name, || match self.backend.fast_op(op, &deadline) {
            Some(r) => r.map_err(|e| core.explain(e)),
            None => {
                declined = true;
                Ok(())
            }
        });
        (!declined).then(|| Work::done(result, None).within(self.timeout))
    }

    /// Run `job` as a direct collective runs, in this turn.
    pub fn job<'t>(self, mut job: Job<'t>, opts: &OpOptions) -> Result<Work<'t>> {
        self.core.decide(&mut job, opts)?;
        let (result, device) = self.core.run_job(&mut job, opts, self.seq);
        Ok(Work::done(result, device).within(self.timeout))
    }
}
