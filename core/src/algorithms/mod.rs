//! Generic collective algorithms over a backend's point-to-point
//! [`exchange`](crate::backend::Backend::exchange). They run on host memory
//! and know nothing of sockets: any transport that moves bytes gets every op.
//!
//! | op | algorithm | file |
//! |---|---|---|
//! | all_reduce | recursive doubling (small), halving-doubling (medium), pipelined ring reduce-scatter + all-gather (large) | `recursive.rs`, `halving_doubling.rs`, `ring.rs` |
//! | reduce_scatter(_v) | ring | `ring.rs` |
//! | all_gather(_v) | ring; everything at once (large blocks through shared memory, more than two ranks) | `ring.rs`, `linear.rs` |
//! | broadcast | binomial tree (small), scatter + ring all-gather (medium), pipelined chain (large) | `tree.rs`, `ring.rs`, `chain.rs` |
//! | reduce | binomial tree (small), ring reduce-scatter + gather (large) | `tree.rs`, `ring.rs` |
//! | gather, scatter | root exchanges with every rank at once | `linear.rs` |
//! | all_to_all(_v) | everything at once (shared memory, or blocks up to 1 MiB), pairwise exchange (large blocks over sockets) | `pairwise.rs` |
//! | barrier | dissemination | `barrier.rs` |
//! | sparse all_reduce | all-gather, recursive doubling with merging, key-range split, or dense | `sparse/` |
//!
//! Shared pieces: `pipeline.rs` (segments, a pipelined step, blocks of a
//! buffer), `line.rs` (the order rings and chains visit ranks in) and
//! `fold.rs` (folding onto a power of two). `select.rs` is the
//! one place an op's algorithm is decided: a name the op, its group or
//! `WEFT_ALGORITHM` gives (settled and checked when the op is issued,
//! `group/decide.rs`), else a choice by size.

mod barrier;
mod chain;
mod fold;
mod halving_doubling;
mod line;
mod linear;
mod pairwise;
mod pipeline;
mod recursive;
mod ring;
pub mod select;
pub use linear::exchange_all;
pub mod sparse;
mod tree;

use crate::backend::{Backend, GatherSend, Op, OpContext, P2p};
use crate::error::{Error, Result};
use crate::tensor::{Tensor, TensorMut};

/// A backend plus the op being run: what every algorithm talks to.
#[derive(Clone, Copy)]
pub struct Comm<'a> {
    backend: &'a dyn Backend,
    ctx: &'a OpContext,
    /// Added to every step: lets one op run several algorithms in turn.
    base: u32,
    /// Locality bits for every step's tag ([`crate::tag::COMBINES`],
    /// [`crate::tag::FRESH`]).
    locality: u64,
}

impl<'a> Comm<'a> {
    /// Bind a backend to an op.
    pub fn new(backend: &'a dyn Backend, ctx: &'a OpContext) -> Self {
        Comm { backend, ctx, base: 0, locality: 0 }
    }
    /// The same comm for phase `n` of an op (steps of different phases never share a tag).
    pub fn phase(&self, n: u32) -> Self {
        Comm { base: n * 4096, ..*self }
    }
    /// The same comm for steps whose receiver reduces what it receives as
    /// it arrives: a transport that can leave a message in either side's
    /// cache leaves it in the receiver's.
    pub fn combining(&self) -> Self {
        Comm { locality: crate::tag::COMBINES, ..*self }
    }
    /// The same comm for steps whose sender has just written what it sends
    /// (a block it reduced, one it received in the step before): a
    /// transport that can move a message with either side's core moves it
    /// with the sender's, whose cache holds it. Read by the receiver's
    /// core, every line would come out of the sender's cache one by one
    /// (measured, shm W=2: all_reduce 1 MiB 167 against 69 us).
    pub fn sending_fresh(&self) -> Self {
        Comm { locality: crate::tag::FRESH, ..*self }
    }
    /// Which phase this comm is in.
    pub fn phase_index(&self) -> u32 {
        self.base / 4096
    }
    /// The same phase with steps shifted by `offset` (a sub-range of tags).
    pub fn phase_step(&self, offset: u32) -> Self {
        Comm { base: self.base + offset, ..*self }
    }
    /// The tag of `step` in this phase.
    pub fn tag(&self, step: u32) -> u64 {
        self.ctx.tag(self.base + step) | self.locality
    }
    /// This rank.
    pub fn rank(&self) -> usize {
        self.ctx.rank
    }
    /// Group size.
    pub fn size(&self) -> usize {
        self.ctx.size
    }
    /// The op context.
    pub fn ctx(&self) -> &OpContext {
        self.ctx
    }
    /// The backend's [`Backend::step_bytes`].
    pub fn step_bytes(&self) -> usize {
        self.backend.step_bytes()
    }
    /// Where this rank sits along rings and chains (the backend's
    /// [`Backend::rank_order`]).
    pub fn line(&self) -> line::Line<'a> {
        line::Line::new(self.backend.rank_order(), self.size(), self.rank())
    }
    /// Run a batch of point-to-point ops.
    pub fn exchange(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        self.backend.exchange(ops, &self.ctx.deadline)
    }
    /// Run a batch of point-to-point ops plus sends of gathered bytes
    /// ([`Backend::exchange_gathered`]).
    pub fn exchange_gathered(&self, ops: &mut [P2p<'_>], gathered: &[GatherSend<'_>]) -> Result<()> {
        self.backend.exchange_gathered(ops, gathered, &self.ctx.deadline)
    }
    /// Send `data` to `to` and receive `buf` from `from` at once, as step `step`.
    pub fn send_recv(&self, step: u32, to: usize, data: &[u8], from: usize, buf: &mut [u8]) -> Result<()> {
        let tag = self.tag(step);
        self.exchange(&mut [P2p::Send { peer: to, tag, data }, P2p::Recv { peer: from, tag, buf }])
    }
    /// Send only.
    pub fn send(&self, step: u32, to: usize, data: &[u8]) -> Result<()> {
        self.exchange(&mut [P2p::Send { peer: to, tag: self.tag(step), data }])
    }
    /// Receive only.
    pub fn recv(&self, step: u32, from: usize, buf: &mut [u8]) -> Result<()> {
        self.exchange(&mut [P2p::Recv { peer: from, tag: self.tag(step), buf }])
    }
}

/// Run `op` with its generic algorithm. Host tensors only.
pub fn run(backend: &dyn Backend, op: &mut Op<'_>, ctx: &OpContext) -> Result<()> {
    let c = Comm::new(backend, ctx);
    match op {
        Op::Send { .. } | Op::Recv { .. } | Op::Batch { .. } => backend.exchange(&mut op.host_p2p()?, &ctx.deadline),
        Op::Broadcast { buf, root } => match select::pick(ctx, "broadcast", buf.nbytes(), c.step_bytes())? {
            "scatter_allgather" => ring::broadcast_scatter_allgather(&c, buf.host_bytes_mut()?, *root),
            "chain" => chain::broadcast(&c, buf.host_bytes_mut()?, *root),
            _ => tree::broadcast(&c, buf.host_bytes_mut()?, *root),
        },
        Op::AllReduce { buf, op } => {
            let dtype = buf.dtype();
            match select::pick(ctx, "all_reduce", buf.nbytes(), c.step_bytes())? {
                "recursive_doubling" => recursive::all_reduce(&c, buf.host_bytes_mut()?, dtype, *op),
                "halving_doubling" => halving_doubling::all_reduce(&c, buf.host_bytes_mut()?, dtype, *op),
                _ => ring::all_reduce(&c, buf.host_bytes_mut()?, dtype, *op),
            }
        }
        Op::Reduce { buf, root, op } => {
            let dtype = buf.dtype();
            match select::pick(ctx, "reduce", buf.nbytes(), c.step_bytes())? {
                "reduce_scatter_gather" => ring::reduce_scatter_gather(&c, buf.host_bytes_mut()?, dtype, *op, *root),
                _ => tree::reduce(&c, buf.host_bytes_mut()?, dtype, *op, *root),
            }
        }
        Op::AllGather { input, outputs } => {
            let largest = outputs.iter().map(TensorMut::nbytes).max().unwrap_or(0);
            let (input, mut outputs) = (input.host_bytes()?, TensorMut::host_bytes_of(outputs)?);
            match select::pick(ctx, "all_gather", largest, c.step_bytes())? {
                "at_once" => linear::all_gather(&c, input, &mut outputs),
                _ => ring::all_gather(&c, input, &mut outputs),
            }
        }
        Op::ReduceScatter { inputs, output, op } => {
            let dtype = output.dtype();
            ring::reduce_scatter(&c, &Tensor::host_bytes_of(inputs)?, output.host_bytes_mut()?, dtype, *op)
        }
        Op::AllToAll { inputs, outputs } => {
            let largest = inputs.iter().map(Tensor::nbytes).max().unwrap_or(0);
            let (inputs, mut outputs) = (Tensor::host_bytes_of(inputs)?, TensorMut::host_bytes_of(outputs)?);
            match select::pick(ctx, "all_to_all", largest, c.step_bytes())? {
                "at_once" => pairwise::all_to_all_at_once(&c, &inputs, &mut outputs),
                _ => pairwise::all_to_all(&c, &inputs, &mut outputs),
            }
        }
        Op::Gather { input, outputs, root } => linear::gather(&c, input.host_bytes()?, &mut TensorMut::host_bytes_of(outputs)?, *root),
        Op::Scatter { inputs, output, root } => linear::scatter(&c, &Tensor::host_bytes_of(inputs)?, output.host_bytes_mut()?, *root),
        Op::Barrier => barrier::dissemination(&c),
        Op::AllReduceSparse { input, output, op } => sparse::all_reduce(&c, input, output, *op),
        #[allow(unreachable_patterns)]
        _ => Err(Error::unsupported(format!("{}: no generic algorithm", ctx.name))),
    }
}

#[cfg(test)]
pub(crate) mod testing;
