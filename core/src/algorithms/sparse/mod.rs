//! Sparse COO all-reduce: every rank contributes a (possibly uncoalesced)
//! sparse tensor of the same shape; every rank gets the same coalesced
//! result over the union of indices (SUM, MIN or MAX).
//!
//! 1. Coalesce locally (sort by key, reduce duplicates).
//! 2. Exchange a small header (dtype, shape, nnz): shapes must agree, and
//!    every rank learns every nnz, so all choose the same algorithm.
//! 3. Run one of (hint `sparse_algorithm=` forces it):
//!    - `allgather`: all-gather every rank's keys and values, k-way merge
//!      (PyTorch's Gloo path; traffic W x nnz);
//!    - `recursive_doubling`: log2(W) exchanges of the partial union with
//!      a 2-way merge each; traffic follows the union, not W x nnz;
//!    - `split`: keys are owned by rank `key % W`; a pairwise exchange
//!      sends each owner its keys, owners merge 1/W of the keys, and the
//!      reduced shares are all-gathered (a sparse reduce-scatter + all-gather);
//!    - `dense`: densify, dense all-reduce plus a presence mask (SparCML's
//!      switch, cheaper once the union is dense enough).
//!
//! `auto` takes `dense` when even the smallest possible union makes the
//! sparse exchanges cost more than a dense ring; otherwise
//! `recursive_doubling` for small tensors or two ranks, `allgather` up to
//! 8 MiB per rank, and `split` beyond (least traffic and merge work when
//! indices overlap).

mod coalesce;
mod dense;
mod exchange;

pub use coalesce::{merge2, merge_k, Run};

use super::Comm;
use crate::error::{Error, Result};
use crate::reduce_op::ReduceOp;
use crate::tensor::{SparseCoo, SparseCooTensor};
use coalesce::Layout;

/// Largest number of dims a sparse tensor may have (header slots).
const MAX_DIMS: usize = 32;
/// Header words: dtype, sparse dims, ndims, nnz, dims.
const HEADER: usize = 4 + MAX_DIMS;
/// Below this many bytes per rank, the fewest steps win (recursive doubling).
const SMALL: usize = 64 << 10;
/// Up to this many bytes per rank the all-gather's single pipelined phase
/// beats split's two (measured at W=4 with `weft bench --ops sparse_all_reduce`).
const MEDIUM: usize = 8 << 20;

/// The sparse all-reduce of `input` into `output`.
pub fn all_reduce(c: &Comm<'_>, input: &SparseCooTensor<'_>, output: &mut SparseCoo, op: ReduceOp) -> Result<()> {
    if !matches!(op, ReduceOp::Sum | ReduceOp::Min | ReduceOp::Max) {
        return Err(Error::invalid(format!("sparse all_reduce supports sum, min and max, not {op}")));
    }
    if input.shape.len() > MAX_DIMS {
        return Err(Error::invalid(format!("sparse tensors have at most {MAX_DIMS} dims, got {}", input.shape.len())));
    }
    let layout = Layout::of(input)?;
    let run = coalesce::coalesce(input, &layout, op)?;
    let nnz = agree(&c.phase(0), &layout, run.keys.len())?;
    let (w, max_nnz) = (c.size(), nnz.iter().copied().max().unwrap_or(0));
    let algo = match c.ctx().hints.get("sparse_algorithm").map(String::as_str) {
        Some("allgather") => "allgather",
        Some("recursive_doubling") => "recursive_doubling",
        Some("split") => "split",
        Some("dense") => "dense",
        None | Some("auto") => {
            let steps = (usize::BITS - w.saturating_sub(1).leading_zeros()) as f64;
            let sparse_min = max_nnz as f64 * steps * (8 + layout.row) as f64;
            let dense = 2.0 * layout.rows as f64 * (layout.row + 1) as f64 * (w - 1) as f64 / w as f64;
            let bytes = max_nnz * (8 + layout.row);
            if w > 1 && sparse_min > dense {
                "dense"
            } else if bytes <= SMALL || w <= 2 {
                "recursive_doubling"
            } else if bytes <= MEDIUM {
                "allgather"
            } else {
                "split"
            }
        }
        Some(other) => {
            return Err(Error::invalid(format!(
                "sparse all_reduce has no algorithm {other:?} (choices: auto, allgather, recursive_doubling, split, dense)"
            )))
        }
    };
    let result = match algo {
        "allgather" => exchange::allgather(&c.phase(1), run, &nnz, &layout, op)?,
        "recursive_doubling" => exchange::recursive_doubling(&c.phase(1), run, &layout, op)?,
        "split" => exchange::split(&c.phase(1), run, &layout, op)?,
        _ => dense::all_reduce(&c.phase(1), run, &layout, op)?,
    };
    let mut out = coalesce::to_coo(result, &layout);
    crate::kernels::sanitize(&mut out.values, layout.dtype);
    *output = out;
    Ok(())
}

/// All-gather every rank's header; error if shapes, sparse dims or dtypes
/// differ (naming the ranks); every rank's nnz.
fn agree(c: &Comm<'_>, l: &Layout, nnz: usize) -> Result<Vec<usize>> {
    let w = c.size();
    let mut mine = [0u64; HEADER];
    mine[0] = l.dtype as u64;
    mine[1] = l.sparse_dims as u64;
    mine[2] = l.shape.len() as u64;
    mine[3] = nnz as u64;
    for (i, d) in l.shape.iter().enumerate() {
        mine[4 + i] = *d as u64;
    }
    let bytes: Vec<u8> = mine.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut all = vec![vec![0u8; HEADER * 8]; w];
    {
        let mut outs: Vec<&mut [u8]> = all.iter_mut().map(|v| &mut v[..]).collect();
        super::ring::all_gather(c, &bytes, &mut outs)?;
    }
    let heads: Vec<Vec<u64>> =
        all.iter().map(|b| b.chunks(8).map(|x| u64::from_le_bytes(x.try_into().expect("8 bytes"))).collect()).collect();
    let describe = |h: &[u64]| {
        let dims: Vec<u64> = h[4..4 + (h[2] as usize).min(MAX_DIMS)].to_vec();
        let dtype = crate::DType::from_code(h[0] as u8).map(|d| d.name()).unwrap_or("?");
        format!("shape {dims:?} with {} sparse dims, {dtype}", h[1])
    };
    let key = |h: &[u64]| (h[0], h[1], h[2], h[4..].to_vec());
    if let Some(r) = (0..w).find(|r| key(&heads[*r]) != key(&heads[0])) {
        return Err(Error::invalid(format!(
            "sparse tensors differ between ranks: rank 0 has {}, rank {r} has {}",
            describe(&heads[0]),
            describe(&heads[r])
        )));
    }
    Ok(heads.iter().map(|h| h[3] as usize).collect())
}
