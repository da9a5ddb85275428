//! Where a validated op goes. The [`Issuer`] (the group, a scope,
//! `Unscoped`) says which routes it offers and runs jobs; [`run`] is the
//! one place a collective's route is chosen (the table in `mod.rs`): the
//! fast path where the issuer offers one for it and the op has a form
//! that path takes, else a job, fingerprinted for `WEFT_DEBUG=detail`.

use super::check::Check;
use super::fast::FastPath;
use super::job::Job;
use super::p2p::DirectP2p;
use super::work::Work;
use super::ProcessGroup;
use crate::backend::{FastOp, Op, OpKind};
use crate::dtype::DType;
use crate::error::Result;
use crate::options::OpOptions;
use crate::reduce_op::ReduceOp;
use crate::registry::Route;
use crate::tensor::{Tensor, TensorMut};

/// Where the ops of [`crate::Collectives`] go once validated. Only weft's
/// issuers implement it (the group: ops run at once; a scope and
/// `Unscoped`: in the background), and as code outside weft cannot name
/// it, that seals `Collectives`.
pub trait Issuer<'t> {
    /// Run `job` (decided here), or queue it, as this issuer does.
    fn submit(&self, job: Job<'t>, opts: &OpOptions) -> Result<Work<'t>>;
    /// Where a direct send or receive of host tensors on `route` runs at
    /// once, without a job (the group's; none in a scope, which posts).
    fn direct_p2p(&self, _route: Route) -> Option<DirectP2p<'_>> {
        None
    }
    /// Where direct collective `name` of `kind` on `route`'s tensors of
    /// `dtype` goes first, without a job (the group's; none in a scope).
    fn fast_path(&self, _name: &'static str, _route: Route, _kind: OpKind, _dtype: DType, _opts: &OpOptions) -> Option<FastPath<'_>> {
        None
    }
    /// The group the ops run on.
    fn group(&self) -> &ProcessGroup;
}

/// A collective as issued and validated, before it becomes a job: its
/// canonical [`Op`], or a `_single` form kept whole, because a fast path
/// takes its W equal parts as slices of one buffer (splitting it into a
/// job's views is what that path saves).
pub(super) enum Call<'t> {
    /// The op in its canonical form.
    Op(Op<'t>),
    /// `output`'s i-th of W equal parts receives rank i's `input`.
    AllGatherSingle { output: TensorMut<'t>, input: Tensor<'t> },
    /// `output` becomes the reduction of every rank's `input` part `rank`.
    ReduceScatterSingle { output: TensorMut<'t>, input: Tensor<'t>, op: ReduceOp },
    /// `input`'s i-th of W equal parts goes to rank i; `output`'s i-th
    /// comes from rank i.
    AllToAllSingle { output: TensorMut<'t>, input: Tensor<'t> },
}

impl<'t> Call<'t> {
    /// Its bytes as a transport's fast path takes them, where it has that
    /// form: a host all_reduce, broadcast or barrier, or a `_single` form
    /// with non-empty parts (`size` of them); else `None` (also for
    /// tensors not in host memory, which the job refuses).
    #[inline(always)]
    fn fast(&mut self, dtype: DType, size: usize) -> Option<FastOp<'_>> {
        let nonempty = |part: usize| (part > 0).then_some(part);
        Some(match self {
            Call::Op(Op::AllReduce { buf, op }) => FastOp::AllReduce { buf: buf.host_bytes_mut().ok()?, dtype, op: *op },
            Call::Op(Op::Broadcast { buf, root }) => FastOp::Broadcast { buf: buf.host_bytes_mut().ok()?, root: *root },
            Call::Op(Op::Barrier) => FastOp::Barrier,
            Call::Op(_) => return None,
            Call::AllGatherSingle { output, input } => {
                let part = nonempty(input.nbytes())?;
                FastOp::AllGather {
                    input: input.host_bytes().ok()?,
                    outputs: output.host_bytes_mut().ok()?.chunks_exact_mut(part).collect(),
                }
            }
            Call::ReduceScatterSingle { output, input, op } => {
                let part = nonempty(output.nbytes())?;
                let inputs = input.host_bytes().ok()?.chunks_exact(part).collect();
                FastOp::ReduceScatter { inputs, output: output.host_bytes_mut().ok()?, dtype, op: *op }
            }
            Call::AllToAllSingle { output, input } => {
                let part = nonempty(input.nbytes() / size)?;
                let inputs = input.host_bytes().ok()?.chunks_exact(part).collect();
                FastOp::AllToAll { inputs, outputs: output.host_bytes_mut().ok()?.chunks_exact_mut(part).collect() }
            }
        })
    }

    /// Its canonical op: a `_single` form's buffers split into their
    /// `c.size` equal parts.
    fn into_op(self, c: &Check) -> Result<Op<'t>> {
        let parts = |n: usize| smallvec::SmallVec::<[usize; 16]>::from_elem(n / c.size, c.size);
        let op = match self {
            Call::Op(op) => op,
            Call::AllGatherSingle { output, input } => {
                let outputs = output.split_mut(&parts(input.numel() * c.size));
                Op::AllGather { input, outputs: outputs.map_err(|e| e.with_op(c.name))? }
            }
            Call::ReduceScatterSingle { output, input, op } => {
                let inputs = input.split(&parts(input.numel()));
                Op::ReduceScatter { inputs: inputs.map_err(|e| e.with_op(c.name))?, output, op }
            }
            Call::AllToAllSingle { output, input } => {
                let parts = parts(input.numel());
                let inputs = input.split(&parts).map_err(|e| e.with_op(c.name))?;
                Op::AllToAll { inputs, outputs: output.split_mut(&parts).map_err(|e| e.with_op(c.name))? }
            }
        };
        Ok(op)
    }
}

/// Run collective `call` of `kind` on `route`'s tensors of `dtype`,
/// validated by `c`: offered to the issuer's fast path in its turn where
/// there is one for it (run as a job in that turn where the transport
/// declines), else submitted as a job.
// Inlined into each op, and the fast path's bytes lent, not moved: a
// `Call` and a `FastOp` passed by value were copied on every op
// (bench/RESULTS.md, sixth session).
#[inline(always)]
pub(super) fn run<'t, G: Issuer<'t> + ?Sized>(
    g: &G,
    c: &Check,
    kind: OpKind,
    route: Route,
    dtype: DType,
    mut call: Call<'t>,
    opts: &OpOptions,
) -> Result<Work<'t>> {
    // The fast path's turn, where it took the op but left it to a job.
    let turn = match g.fast_path(c.name, route, kind, dtype, opts) {
        Some(fast) => match call.fast(dtype, c.size) {
            Some(mut bytes) => {
                let mut turn = fast.turn(opts);
                if let Some(work) = turn.fast(&mut bytes) {
                    return Ok(work);
                }
                Some(turn)
            }
            None => None,
        },
        None => None,
    };
    let op = call.into_op(c)?;
    if let Some(turn) = turn {
        return turn.job(op, opts);
    }
    let fingerprint = c.fingerprint(kind, || canonical(&op, dtype));
    g.submit(Job::new(c.name, kind, route, fingerprint, op), opts)
}

/// What every rank must agree on for collective `op` of `dtype`, as its
/// `WEFT_DEBUG=detail` fingerprint lists it: the same for an op's list
/// and `_single` forms, which are the same collective on the wire.
fn canonical(op: &Op<'_>, dtype: DType) -> String {
    let counts = |n: &mut dyn Iterator<Item = usize>| n.collect::<Vec<_>>();
    match op {
        Op::Broadcast { buf, root } => format!("{dtype} x {} root {root}", buf.numel()),
        Op::AllReduce { buf, op } => format!("{dtype} x {} op {op}", buf.numel()),
        Op::Reduce { buf, root, op } => format!("{dtype} x {} root {root} op {op}", buf.numel()),
        Op::AllGather { outputs, .. } => format!("{dtype} counts {:?}", counts(&mut outputs.iter().map(|o| o.numel()))),
        Op::ReduceScatter { inputs, op, .. } => format!("{dtype} counts {:?} op {op}", counts(&mut inputs.iter().map(|t| t.numel()))),
        Op::Gather { input, root, .. } => format!("{dtype} x {} root {root}", input.numel()),
        Op::Scatter { output, root, .. } => format!("{dtype} x {} root {root}", output.numel()),
        Op::AllReduceSparse { input, op, .. } => format!("{dtype} shape {:?} op {op}", input.shape),
        Op::AllToAll { .. } => format!("{dtype}"),
        Op::Barrier | Op::Send { .. } | Op::Recv { .. } | Op::Batch { .. } => String::new(),
    }
}
