//! Small collectives issued straight to a transport's fast path
//! ([`Backend::fast_op`]): a direct all_reduce, broadcast, barrier,
//! all_gather_single, reduce_scatter_single or all_to_all_single of host
//! tensors, without
//! hints or a chosen algorithm, takes its turn in the group's order as any
//! collective, then hands its bytes to the transport without building the
//! op's list of views and the job first (at W=4 on 2 cores those were a
//! few hundred nanoseconds of an op's path, in every rank's turn). Where
//! the transport has no fast path for it, the op runs as a job in the same
//! turn; where the fast path ran its part and handed the op back, the job
//! runs core's algorithm.

use super::executor::Turn;
use super::job::Job;
use super::work::Work;
use super::GroupCore;
use crate::algorithms::select;
use crate::backend::{Backend, Deadline, FastOp, FastOutcome, Op, OpKind};
use crate::dtype::DType;
use crate::error::Result;
use crate::options::{GroupOptions, OpOptions};
use crate::registry::Route;
use crate::tensor::{DeviceKind, Layout};
use std::sync::Arc;
use std::time::Duration;

/// Where a direct small collective of host tensors goes first: the
/// group's transport for them. What [`GroupCore::fast_path`] hands out.
pub struct FastPath<'g> {
    core: &'g GroupCore,
    backend: &'g Arc<dyn Backend>,
    /// The op: its name, tensors' route and kind.
    name: &'static str,
    route: Route,
    kind: OpKind,
}

/// A [`FastPath`] op's turn in the group's order: [`FastTurn::fast`]
/// offers it to the transport's fast path, [`FastTurn::job`] runs it as
/// usual where that declined. Dropped, it passes the turn on.
pub struct FastTurn<'g> {
    path: FastPath<'g>,
    seq: u64,
    timeout: Duration,
    /// The fast path ran its part and left the rest to core's algorithm.
    generic: bool,
    _turn: Turn<'g>,
}

/// The ops that may take the fast path.
const KINDS: [OpKind; 6] =
    [OpKind::AllReduce, OpKind::Broadcast, OpKind::Barrier, OpKind::AllGather, OpKind::ReduceScatter, OpKind::AllToAll];

/// Where a group's direct ops on host tensors may skip the job, decided
/// once when it is made: a direct op reads these, not the route list, the
/// group's hints and its algorithm setting (each a cache line to fetch, in
/// a turn that follows a context switch when ranks outnumber cores).
pub(crate) struct HostPaths {
    /// The host route's transport.
    backend: Option<Arc<dyn Backend>>,
    /// It posts: direct sends and receives go to its `exchange`
    /// (`p2p.rs`).
    posts: bool,
    /// Bit i: `KINDS[i]` may be offered to its fast path (it has one, the
    /// group has no hints and no detail checks, and no algorithm is chosen
    /// for the op's family by the group or `WEFT_ALGORITHM`).
    kinds: u8,
}

impl HostPaths {
    /// What a group with these `routes`, `options`, `algorithms` setting
    /// and detail checks (`detail`) offers.
    pub(crate) fn new(routes: &[(Route, Arc<dyn Backend>)], options: &GroupOptions, algorithms: &select::Setting, detail: bool) -> Self {
        let backend = routes.iter().find(|(r, _)| *r == HOST).map(|(_, b)| b.clone());
        let posts = backend.as_ref().is_some_and(|b| b.capabilities().posts);
        let offered = |kind: OpKind| match (select::Family::of(kind), &backend) {
            _ if !options.hints.is_empty() || detail => false,
            (_, None) => false,
            (_, Some(b)) if !b.capabilities().fast_ops => false,
            (None, Some(_)) => true,
            (Some(family), Some(b)) => matches!(select::forced(family, None, algorithms, b.capabilities().native_algorithms), Ok(None)),
        };
        let kinds = KINDS.iter().enumerate().filter(|(_, k)| offered(**k)).fold(0u8, |bits, (i, _)| bits | 1 << i);
        HostPaths { backend, posts, kinds }
    }

    /// The host route's transport, if it posts.
    pub(crate) fn posting(&self) -> Option<&Arc<dyn Backend>> {
        self.backend.as_ref().filter(|_| self.posts)
    }
}

/// Host tensors' route.
const HOST: Route = (DeviceKind::Cpu, Layout::Dense);

impl GroupCore {
    /// The fast path for direct collective `name` of `kind` on `route`'s
    /// tensors of `dtype`, if nothing asks for more than the transport's
    /// own choice: host tensors, not bools (cleaned after a job), no
    /// hints, no algorithm chosen for its family, no `WEFT_DEBUG=detail`
    /// check.
    pub(crate) fn fast_path(&self, name: &'static str, route: Route, kind: OpKind, dtype: DType, opts: &OpOptions) -> Option<FastPath<'_>> {
        let i = KINDS.iter().position(|k| *k == kind)?;
        let offered = route == HOST && dtype != DType::Bool && opts.hints.is_empty() && self.host.kinds & 1 << i != 0;
        Some(FastPath { core: self, backend: self.host.backend.as_ref().filter(|_| offered)?, name, route, kind })
    }
}

impl<'g> FastPath<'g> {
    /// Wait for the op's turn (it takes its ticket now), within `opts`'
    /// timeout, else the group's.
    pub fn turn(self, opts: &OpOptions) -> FastTurn<'g> {
        let (turn, seq) = self.core.exec.begin(self.core.exec.issue(), true);
        let timeout = opts.timeout.unwrap_or(self.core.options.timeout);
        FastTurn { path: self, seq, timeout, generic: false, _turn: turn }
    }
}

impl FastTurn<'_> {
    /// Offer the op (`op`, its bytes) to the transport's fast path: its
    /// outcome as a finished [`Work`], or `None` if the op is left to
    /// [`FastTurn::job`] (declined, or handed back to core's algorithm).
    #[inline]
    pub fn fast<'t>(&mut self, op: &mut FastOp<'_>) -> Option<Work<'t>> {
        let FastPath { core, backend, name, .. } = self.path;
        let deadline = Deadline::after(self.timeout);
        let mut left = None;
        let result = core.guarded(name, || match backend.fast_op(op, &deadline) {
            FastOutcome::Done(r) => r,
            outcome => {
                left = Some(outcome);
                Ok(())
            }
        });
        self.generic = matches!(left, Some(FastOutcome::Generic));
        left.is_none().then(|| Work::done(result, None).within(self.timeout))
    }

    /// Run the op (`op`, as a job has it) as a direct collective runs, in
    /// this turn (through core's algorithm if the fast path handed it
    /// back).
    pub fn job<'t>(self, op: Op<'t>, opts: &OpOptions) -> Result<Work<'t>> {
        let FastPath { core, name, route, kind, .. } = self.path;
        let mut job = Job::new(name, kind, route, None, op);
        job.native = !self.generic;
        core.decide(&mut job, opts)?;
        let (result, device) = core.run_job(&mut job, opts, self.seq);
        Ok(Work::done(result, device).within(self.timeout))
    }
}
