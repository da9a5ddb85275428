//! Sparse COO all-reduce: every rank contributes a (possibly uncoalesced)
//! sparse tensor of the same shape; every rank gets the same coalesced
//! result over the union of indices (SUM, MIN or MAX).
//!
//! 1. Sort locally by key (a radix sort over the bits the shape needs,
//!    `radix.rs`), reducing duplicates (rows stay where they lie until an
//!    algorithm moves them: `coalesce::Sorted`).
//! 2. Exchange a small header (dtype, shape, nnz, op, the algorithm asked
//!    for; for `auto` a hash sample of the keys, and for `auto` and
//!    `split` evenly spaced keys, `sketch.rs`): shapes, ops and algorithms
//!    must agree (else every rank fails, naming the ranks), and every rank
//!    learns every nnz, the same estimate of the union and the same spread
//!    of keys, so all choose alike.
//! 3. Run one of (hint `sparse_algorithm=` forces it):
//!    - `allgather`: all-gather every rank's keys and values, k-way merge
//!      (PyTorch's Gloo path; traffic W x nnz);
//!    - `recursive_doubling`: log2(W) exchanges of the partial union with
//!      a 2-way merge each; traffic follows the union, not W x nnz;
//!    - `split`: rank i owns a key range holding 1/W of all ranks' entries
//!      (bounds from the spaced keys); every rank sends each owner its
//!      slice of its run, owners merge, and the reduced shares are
//!      all-gathered straight into the result (a sparse reduce-scatter +
//!      all-gather, four steps that each talk to every peer at once);
//!    - `dense`: densify, dense all-reduce plus a presence mask (SparCML's
//!      switch, cheaper once the union is dense enough).
//!
//! `auto` takes the least estimated cost (`cost.rs`): bytes received and
//! merged per rank, from every nnz and the sketch's union estimate, plus a
//! price per message.

mod coalesce;
mod cost;
mod dense;
mod exchange;
mod radix;
mod sketch;

pub use coalesce::{merge_k, Rows, Run, RunRef, Sorted, SortedRows};

use super::steps::Steps;
use crate::error::{Error, Result};
use crate::reduce_op::ReduceOp;
use crate::tensor::{SparseCoo, SparseCooTensor};
use coalesce::Geometry;

/// Largest number of dims a sparse tensor may have (header slots).
const MAX_DIMS: usize = 32;
/// Header words: dtype, sparse dims, ndims, nnz, op, algorithm, then dims.
const DIMS: usize = 6;
/// Header words in all.
const HEADER: usize = DIMS + MAX_DIMS;
/// The hint `sparse_algorithm=`'s choices, in header code order.
const ALGORITHMS: [&str; 5] = ["auto", "allgather", "recursive_doubling", "split", "dense"];
/// The ops a sparse all-reduce supports, in header code order.
const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max];

/// `op`'s code in the header: the one check of a sparse all-reduce's op
/// (the group's, when the op is issued, and here).
pub(crate) fn op_code(op: ReduceOp) -> Result<usize> {
    OPS.iter().position(|o| *o == op).ok_or_else(|| Error::invalid(format!("sparse all_reduce supports sum, min and max, not {op}")))
}

/// The sparse all-reduce of `input` into `output`.
pub fn all_reduce(c: &Steps<'_>, input: &SparseCooTensor<'_>, output: &mut SparseCoo, op: ReduceOp) -> Result<()> {
    let op_code = op_code(op)?;
    if input.shape.len() > MAX_DIMS {
        return Err(Error::invalid(format!("sparse tensors have at most {MAX_DIMS} dims, got {}", input.shape.len())));
    }
    // An unknown name still takes part in the header exchange (as code
    // `ALGORITHMS.len()`), so every rank fails alike instead of waiting.
    let hint = c.ctx().hints.get("sparse_algorithm").map(String::as_str).unwrap_or("auto");
    let requested = ALGORITHMS.iter().position(|a| *a == hint).unwrap_or(ALGORITHMS.len());
    let layout = Geometry::of(input)?;
    let sorted = coalesce::sort(input, &layout, op)?;
    let plan = agree(&c.phase(0), &layout, &sorted.keys, op_code, requested)?;
    let algo = match ALGORITHMS.get(requested) {
        Some(&"auto") => cost::cheapest(c.size(), &plan.nnz, plan.union, &layout, c.step_bytes()),
        Some(algo) => algo,
        None => return Err(Error::invalid(format!("sparse all_reduce has no algorithm {hint:?} (choices: {})", ALGORITHMS.join(", ")))),
    };
    // The caller's previous result's buffers hold this one: their pages are
    // already there (fresh ones fault in every page on every call). Until
    // the new result is in, `output` is empty, also if this fails.
    // Recursive doubling packs its run into the previous result's buffer
    // and merges into a recycled one: the other way round was slower
    // (figures: bench/RESULTS.md, "Measurements behind code comments").
    let SparseCoo { values: reused, indices: reused_indices, .. } = std::mem::take(output);
    let result = match algo {
        "allgather" => exchange::allgather(&c.phase(1).combining(), sorted.into_run(coalesce::spare()), &plan.nnz, &layout, op, reused)?,
        "recursive_doubling" => {
            exchange::recursive_doubling(&c.phase(1).combining(), sorted.into_run(reused), &layout, op, coalesce::spare())?
        }
        "split" => exchange::split(&c.phase(1), &sorted, &layout, op, &sketch::balanced_bounds(plan.spaced(), c.size()), reused)?,
        _ => dense::all_reduce(&c.phase(1), &sorted, &layout, op, reused)?,
    };
    let mut out = coalesce::to_coo(result, &layout, reused_indices);
    crate::kernels::sanitize(&mut out.values, layout.dtype);
    *output = out;
    Ok(())
}

/// What every rank knows, alike, after the header exchange.
struct Plan {
    /// Every rank's number of distinct keys.
    nnz: Vec<usize>,
    /// The estimated number of distinct keys over all ranks (`auto` only).
    union: f64,
    /// Every rank's header words (see [`agree`]).
    heads: Vec<Vec<i64>>,
    /// Where the spaced keys lie in a header, and how many.
    spaced_at: usize,
    spaced_k: usize,
}

impl Plan {
    /// Every rank's spaced keys with their weights (`sketch::weighted`; sent
    /// for `auto` and `split` only), in rank order; read only where `split`
    /// runs.
    fn spaced(&self) -> impl Iterator<Item = (i64, u64)> + '_ {
        self.heads
            .iter()
            .zip(&self.nnz)
            .flat_map(|(h, n)| sketch::weighted(h[self.spaced_at..][..self.spaced_k].iter().copied(), *n, self.spaced_k))
    }
}

/// All-gather every rank's header, sketch part and spaced keys (each only
/// where the `requested` algorithm uses it); error if shapes, sparse dims,
/// dtypes, ops or requested algorithms differ (naming the ranks).
fn agree(c: &Steps<'_>, l: &Geometry, keys: &[i64], op_code: usize, requested: usize) -> Result<Plan> {
    let w = c.size();
    let (k, spaced_k) = (sketch::sketch_size(w), sketch::spaced_size(w));
    let (auto, split) = (ALGORITHMS.get(requested) == Some(&"auto"), ALGORITHMS.get(requested) == Some(&"split"));
    // Header; sketch: threshold, key count, keys; spaced keys.
    let (sketch_at, spaced_at) = (HEADER, HEADER + 2 + k);
    let words = spaced_at + spaced_k;
    // Header words are i64 (keys are; the counts and codes fit).
    let mut mine = vec![0i64; words];
    mine[0] = l.dtype as i64;
    mine[1] = l.sparse_dims as i64;
    mine[2] = l.shape.len() as i64;
    mine[3] = keys.len() as i64;
    mine[4] = op_code as i64;
    mine[5] = requested as i64;
    for (i, d) in l.shape.iter().enumerate() {
        mine[DIMS + i] = *d as i64;
    }
    if auto {
        let (threshold, sample) = sketch::local(keys, k);
        mine[sketch_at] = threshold as i64;
        mine[sketch_at + 1] = sample.len() as i64;
        mine[sketch_at + 2..][..sample.len()].copy_from_slice(&sample);
    }
    if auto || split {
        sketch::spaced_into(keys, &mut mine[spaced_at..]);
    }
    let mut bytes = vec![0u8; words * 8];
    for (b, x) in bytes.chunks_exact_mut(8).zip(&mine) {
        b.copy_from_slice(&x.to_le_bytes());
    }
    let mut all = vec![0u8; w * words * 8];
    {
        let mut outs: Vec<&mut [u8]> = all.chunks_mut(words * 8).collect();
        super::ring::all_gather(c, &bytes, &mut outs)?;
    }
    let words_of = |b: &[u8]| b.chunks_exact(8).map(|x| i64::from_le_bytes(x.try_into().expect("8 bytes"))).collect::<Vec<i64>>();
    let heads: Vec<Vec<i64>> = all.chunks(words * 8).map(words_of).collect();
    let describe = |h: &[i64]| {
        let dims = &h[DIMS..DIMS + (h[2] as usize).min(MAX_DIMS)];
        let dtype = crate::DType::from_code(h[0] as u8).map(|d| d.name()).unwrap_or("?");
        format!("shape {dims:?} with {} sparse dims, {dtype}", h[1])
    };
    let key = |h: &[i64]| (h[0], h[1], h[2], h[DIMS..HEADER].to_vec());
    if let Some(r) = (0..w).find(|r| key(&heads[*r]) != key(&heads[0])) {
        return Err(Error::invalid(format!(
            "sparse tensors differ between ranks: rank 0 has {}, rank {r} has {}",
            describe(&heads[0]),
            describe(&heads[r])
        )));
    }
    // The same call everywhere: one op and one algorithm (an unknown one
    // on every rank fails in the caller, naming it).
    let call = |h: &[i64]| {
        let op = OPS.get(h[4] as usize).map_or("?", |o| o.name());
        format!("op {op} and sparse_algorithm={}", ALGORITHMS.get(h[5] as usize).unwrap_or(&"(unknown)"))
    };
    if let Some(r) = (0..w).find(|r| heads[*r][4..6] != heads[0][4..6]) {
        return Err(Error::invalid(format!(
            "mismatched sparse all_reduce calls: rank 0 called it with {}, rank {r} with {}",
            call(&heads[0]),
            call(&heads[r])
        )));
    }
    let nnz: Vec<usize> = heads.iter().enumerate().map(|(r, h)| l.entries(h[3] as u64, r)).collect::<Result<_>>()?;
    let union = if auto {
        // Each rank's sample, where it lies in its header.
        let parts: Vec<(u64, &[i64])> =
            heads.iter().map(|h| (h[sketch_at] as u64, &h[sketch_at + 2..][..(h[sketch_at + 1] as usize).min(k)])).collect();
        sketch::union_size(&parts, nnz.iter().sum())
    } else {
        0.0
    };
    Ok(Plan { nnz, union, heads, spaced_at, spaced_k })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::testing::run_ranks_with;
    use crate::backend::{Backend, Deadline, OpKind, P2p};
    use crate::tensor::Tensor;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    /// Passes messages on, but overwrites 8 bytes at `at` of every message
    /// this rank sends in its `batch`-th exchange with a huge count.
    struct Garbling<'a> {
        inner: &'a dyn Backend,
        batch: usize,
        at: usize,
        seen: AtomicUsize,
    }

    impl Backend for Garbling<'_> {
        fn name(&self) -> &str {
            "garbling"
        }
        fn exchange(&self, ops: &mut [P2p<'_>], deadline: &Deadline) -> Result<()> {
            if self.seen.fetch_add(1, Ordering::Relaxed) != self.batch {
                return self.inner.exchange(ops, deadline);
            }
            let garbled: Vec<Vec<u8>> = ops
                .iter()
                .map(|op| match op {
                    P2p::Send { data, .. } => {
                        let mut d = data.to_vec();
                        d[self.at..self.at + 8].copy_from_slice(&(1u64 << 60).to_le_bytes());
                        d
                    }
                    P2p::Recv { .. } => Vec::new(),
                })
                .collect();
            let mut passed: Vec<P2p<'_>> = ops
                .iter_mut()
                .zip(&garbled)
                .map(|(op, g)| match op {
                    P2p::Send { peer, tag, .. } => P2p::Send { peer: *peer, tag: *tag, data: g },
                    P2p::Recv { peer, tag, buf } => P2p::Recv { peer: *peer, tag: *tag, buf },
                })
                .collect();
            self.inner.exchange(&mut passed, deadline)
        }
        fn abort(&self, _: &Error) {}
    }

    #[test]
    fn a_garbled_count_is_an_error_on_every_rank() {
        // (algorithm, exchange to garble, byte offset): the header's nnz
        // word; split's first counts; recursive doubling's run length.
        for (algo, batch, at) in [("allgather", 0, 24), ("split", 1, 0), ("recursive_doubling", 1, 0)] {
            let errors = run_ranks_with(2, OpKind::AllReduce, &[("sparse_algorithm", algo)], |_, inner, ctx| {
                let b = Garbling { inner, batch, at, seen: AtomicUsize::new(0) };
                let (idx, vals) = (vec![1i64, 4, 7], vec![1f32, 2.0, 3.0]);
                let t =
                    SparseCooTensor::new(Tensor::from_slice(&idx).reshape(&[1, 3]).unwrap(), Tensor::from_slice(&vals), vec![10]).unwrap();
                let started = Instant::now();
                let e = all_reduce(&Steps::new(&b, ctx), &t, &mut SparseCoo::default(), ReduceOp::Sum).unwrap_err();
                (e, started.elapsed())
            });
            for (rank, (e, took)) in errors.iter().enumerate() {
                assert!(e.to_string().contains("sent a corrupt sparse message"), "{algo} rank {rank}: {e}");
                assert!(took.as_secs() < 5, "{algo} rank {rank}: failed only after {took:?}");
            }
        }
    }
}
