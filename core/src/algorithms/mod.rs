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
//! Shared pieces: `steps.rs` (what every algorithm talks to: the backend and the op, each step tagged),
//! `pipeline.rs` (segments, a pipelined step, blocks of a buffer),
//! `line.rs` (the order rings and chains visit ranks in) and `fold.rs`
//! (folding onto a power of two). `select.rs` is the
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
mod steps;
pub use linear::exchange_all;
pub mod sparse;
mod tree;

pub use steps::Steps;

use crate::backend::{Backend, Op, OpContext};
use crate::error::Result;
use crate::tensor::{Tensor, TensorMut};
use select::{AllGatherAlgorithm, AllReduceAlgorithm, AllToAllAlgorithm, BroadcastAlgorithm, ReduceAlgorithm};

/// Run `op` with its generic algorithm. Host tensors only.
pub fn run(backend: &dyn Backend, op: &mut Op<'_>, ctx: &OpContext) -> Result<()> {
    let c = Steps::new(backend, ctx);
    match op {
        Op::Send { .. } | Op::Recv { .. } | Op::Batch { .. } => backend.exchange(&mut op.host_p2p()?, &ctx.deadline),
        Op::Broadcast { buf, root } => {
            let (bytes, root) = (buf.host_bytes_mut()?, *root);
            match select::broadcast(ctx, bytes.len())? {
                BroadcastAlgorithm::ScatterAllgather => ring::broadcast_scatter_allgather(&c, bytes, root),
                BroadcastAlgorithm::Chain => chain::broadcast(&c, bytes, root),
                BroadcastAlgorithm::Binomial => tree::broadcast(&c, bytes, root),
            }
        }
        Op::AllReduce { buf, op } => {
            let (dtype, op) = (buf.dtype(), *op);
            let bytes = buf.host_bytes_mut()?;
            match select::all_reduce(ctx, bytes.len(), c.step_bytes())? {
                AllReduceAlgorithm::RecursiveDoubling => recursive::all_reduce(&c, bytes, dtype, op),
                AllReduceAlgorithm::HalvingDoubling => halving_doubling::all_reduce(&c, bytes, dtype, op),
                AllReduceAlgorithm::Ring => ring::all_reduce(&c, bytes, dtype, op),
            }
        }
        Op::Reduce { buf, root, op } => {
            let (dtype, op, root) = (buf.dtype(), *op, *root);
            let bytes = buf.host_bytes_mut()?;
            match select::reduce(ctx, bytes.len())? {
                ReduceAlgorithm::ReduceScatterGather => ring::reduce_scatter_gather(&c, bytes, dtype, op, root),
                ReduceAlgorithm::Binomial => tree::reduce(&c, bytes, dtype, op, root),
            }
        }
        Op::AllGather { input, outputs } => {
            let largest = outputs.iter().map(TensorMut::nbytes).max().unwrap_or(0);
            let (input, mut outputs) = (input.host_bytes()?, TensorMut::host_bytes_of(outputs)?);
            match select::all_gather(ctx, largest, c.step_bytes())? {
                AllGatherAlgorithm::AtOnce => linear::all_gather(&c, input, &mut outputs),
                AllGatherAlgorithm::Ring => ring::all_gather(&c, input, &mut outputs),
            }
        }
        Op::ReduceScatter { inputs, output, op } => {
            let dtype = output.dtype();
            ring::reduce_scatter(&c, &Tensor::host_bytes_of(inputs)?, output.host_bytes_mut()?, dtype, *op)
        }
        Op::AllToAll { inputs, outputs } => {
            let largest = inputs.iter().map(Tensor::nbytes).max().unwrap_or(0);
            let (inputs, mut outputs) = (Tensor::host_bytes_of(inputs)?, TensorMut::host_bytes_of(outputs)?);
            match select::all_to_all(ctx, largest, c.step_bytes())? {
                AllToAllAlgorithm::AtOnce => pairwise::all_to_all_at_once(&c, &inputs, &mut outputs),
                AllToAllAlgorithm::Pairwise => pairwise::all_to_all(&c, &inputs, &mut outputs),
            }
        }
        Op::Gather { input, outputs, root } => linear::gather(&c, input.host_bytes()?, &mut TensorMut::host_bytes_of(outputs)?, *root),
        Op::Scatter { inputs, output, root } => linear::scatter(&c, &Tensor::host_bytes_of(inputs)?, output.host_bytes_mut()?, *root),
        Op::Barrier => barrier::dissemination(&c),
        Op::AllReduceSparse { input, output, op } => sparse::all_reduce(&c, input, output, *op),
    }
}

#[cfg(test)]
pub(crate) mod testing;
