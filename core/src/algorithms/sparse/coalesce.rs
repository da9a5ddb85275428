//! Sparse data in the form the algorithms move: entries sorted by a
//! linear key (row-major over the sparse dims) with one row of values
//! each, and the merges that combine such runs. Sorting and merging only:
//! no per-element hashing on the hot path.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::reduce_into;
use crate::reduce_op::ReduceOp;
use crate::tensor::{SparseCoo, SparseCooTensor};

/// A coalesced run: sorted unique `keys`, `values` holding `row` bytes per key.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Run {
    /// Linear keys (row-major over the sparse dims), sorted and unique.
    pub keys: Vec<i64>,
    /// One row of value bytes per key.
    pub values: Vec<u8>,
}

/// A borrowed run: part of a [`Run`], or rows as they were received.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunRef<'a> {
    /// Sorted unique keys.
    pub keys: &'a [i64],
    /// One row of value bytes per key.
    pub values: &'a [u8],
}

impl Run {
    /// The whole run, borrowed.
    pub fn as_ref(&self) -> RunRef<'_> {
        RunRef { keys: &self.keys, values: &self.values }
    }
}

/// Geometry shared by all ranks: how keys map to indices and rows to bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    pub shape: Vec<usize>,
    pub sparse_dims: usize,
    pub dtype: DType,
    /// Bytes of one row of values (dense part of the shape).
    pub row: usize,
    /// Number of distinct keys (product of the sparse dims).
    pub rows: u64,
}

impl Layout {
    pub fn of(t: &SparseCooTensor<'_>) -> Result<Layout> {
        let sparse_dims = t.indices.dims()[0];
        let rows = t.shape[..sparse_dims]
            .iter()
            .try_fold(1u64, |a, d| a.checked_mul(*d as u64))
            .filter(|r| *r <= i64::MAX as u64)
            .ok_or_else(|| Error::invalid(format!("sparse dims {:?} have more than 2^63 positions", &t.shape[..sparse_dims])))?;
        let dense: usize = t.shape[sparse_dims..].iter().product();
        Ok(Layout { shape: t.shape.clone(), sparse_dims, dtype: t.values.dtype(), row: dense * t.values.dtype().size(), rows })
    }
}

/// Sort `t`'s entries by key and reduce duplicates with `op`.
pub fn coalesce(t: &SparseCooTensor<'_>, l: &Layout, op: ReduceOp) -> Result<Run> {
    let nnz = t.nnz();
    let idx: &[i64] = t.indices.as_slice()?;
    let vals = t.values.host_bytes()?;
    let mut keys = Vec::with_capacity(nnz);
    for k in 0..nnz {
        let mut key = 0i64;
        for d in 0..l.sparse_dims {
            let i = idx[d * nnz + k];
            if i < 0 || i as usize >= l.shape[d] {
                return Err(Error::invalid(format!("index {i} of entry {k} is out of range for sparse dim {d} of size {}", l.shape[d])));
            }
            key = key * l.shape[d] as i64 + i;
        }
        keys.push((key, k));
    }
    keys.sort_unstable();
    let mut out = Run { keys: Vec::with_capacity(nnz), values: Vec::with_capacity(nnz * l.row) };
    for (key, k) in keys {
        let row = &vals[k * l.row..(k + 1) * l.row];
        if out.keys.last() == Some(&key) {
            let n = out.values.len();
            reduce_into(&mut out.values[n - l.row..], row, l.dtype, op);
        } else {
            out.keys.push(key);
            out.values.extend_from_slice(row);
        }
    }
    Ok(out)
}

/// Merge two coalesced runs into one, reducing rows with equal keys.
pub fn merge2(a: &Run, b: &Run, row: usize, dtype: DType, op: ReduceOp) -> Run {
    let mut out =
        Run { keys: Vec::with_capacity(a.keys.len() + b.keys.len()), values: Vec::with_capacity(a.values.len() + b.values.len()) };
    let (mut i, mut j) = (0, 0);
    while i < a.keys.len() || j < b.keys.len() {
        let take_a = j == b.keys.len() || (i < a.keys.len() && a.keys[i] <= b.keys[j]);
        let both = i < a.keys.len() && j < b.keys.len() && a.keys[i] == b.keys[j];
        if both {
            out.keys.push(a.keys[i]);
            let start = out.values.len();
            out.values.extend_from_slice(&a.values[i * row..(i + 1) * row]);
            reduce_into(&mut out.values[start..], &b.values[j * row..(j + 1) * row], dtype, op);
            i += 1;
            j += 1;
        } else if take_a {
            out.keys.push(a.keys[i]);
            out.values.extend_from_slice(&a.values[i * row..(i + 1) * row]);
            i += 1;
        } else {
            out.keys.push(b.keys[j]);
            out.values.extend_from_slice(&b.values[j * row..(j + 1) * row]);
            j += 1;
        }
    }
    out
}

/// Up to this many runs, the smallest head is found by scanning the heads
/// (predictable branches, no heap upkeep); beyond, a heap.
const SCAN_RUNS: usize = 16;

/// Merge k coalesced runs (k-way merge), reducing rows with equal keys.
pub fn merge_k(runs: &[RunRef<'_>], row: usize, dtype: DType, op: ReduceOp) -> Run {
    let total: usize = runs.iter().map(|r| r.keys.len()).sum();
    let mut out = Run { keys: Vec::with_capacity(total), values: Vec::with_capacity(total * row) };
    let mut pos = vec![0usize; runs.len()];
    let push = |out: &mut Run, key: i64, src: &[u8]| {
        if out.keys.last() == Some(&key) {
            let n = out.values.len();
            reduce_into(&mut out.values[n - row..], src, dtype, op);
        } else {
            out.keys.push(key);
            out.values.extend_from_slice(src);
        }
    };
    if runs.len() <= SCAN_RUNS {
        loop {
            let Some(key) = runs.iter().zip(&pos).filter_map(|(r, p)| r.keys.get(*p)).min().copied() else {
                return out;
            };
            for (r, p) in runs.iter().zip(pos.iter_mut()) {
                if r.keys.get(*p) == Some(&key) {
                    push(&mut out, key, &r.values[*p * row..(*p + 1) * row]);
                    *p += 1;
                }
            }
        }
    }
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let mut heap: BinaryHeap<Reverse<(i64, usize)>> =
        runs.iter().enumerate().filter(|(_, r)| !r.keys.is_empty()).map(|(i, r)| Reverse((r.keys[0], i))).collect();
    while let Some(Reverse((key, i))) = heap.pop() {
        let p = pos[i];
        push(&mut out, key, &runs[i].values[p * row..(p + 1) * row]);
        pos[i] += 1;
        if let Some(next) = runs[i].keys.get(pos[i]) {
            heap.push(Reverse((*next, i)));
        }
    }
    out
}

/// The run as a user-facing tensor: keys unravelled into `[sparse_dims, nnz]` indices.
pub fn to_coo(run: Run, l: &Layout) -> SparseCoo {
    let n = run.keys.len();
    let mut indices = vec![0i64; l.sparse_dims * n];
    for (k, key) in run.keys.iter().enumerate() {
        let mut rem = *key;
        for d in (0..l.sparse_dims).rev() {
            indices[d * n + k] = rem % l.shape[d] as i64;
            rem /= l.shape[d] as i64;
        }
    }
    SparseCoo { shape: l.shape.clone(), sparse_dims: l.sparse_dims, dtype: Some(l.dtype), indices, values: run.values }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(keys: &[i64], vals: &[i32]) -> Run {
        Run { keys: keys.to_vec(), values: vals.iter().flat_map(|v| v.to_ne_bytes()).collect() }
    }

    #[test]
    fn two_way_and_k_way_merges_agree() {
        let a = run(&[1, 4, 9], &[1, 2, 3]);
        let b = run(&[0, 4, 10], &[5, 6, 7]);
        let c = run(&[4], &[100]);
        let m2 = merge2(&merge2(&a, &b, 4, DType::I32, ReduceOp::Sum), &c, 4, DType::I32, ReduceOp::Sum);
        let mk = merge_k(&[a.as_ref(), b.as_ref(), c.as_ref(), RunRef::default()], 4, DType::I32, ReduceOp::Sum);
        assert_eq!(m2, mk);
        assert_eq!(mk, run(&[0, 1, 4, 9, 10], &[5, 1, 108, 3, 7]));
    }

    #[test]
    fn scanning_and_heap_merges_agree() {
        // 40 runs (the heap path) against the same merged in pairs.
        let runs: Vec<Run> = (0..40).map(|i| run(&[i % 7, 10 + i, 100], &[i as i32, 1, 2])).collect();
        let refs: Vec<RunRef<'_>> = runs.iter().map(Run::as_ref).collect();
        let heap = merge_k(&refs, 4, DType::I32, ReduceOp::Sum);
        let scanned = refs.chunks(SCAN_RUNS).map(|c| merge_k(c, 4, DType::I32, ReduceOp::Sum)).collect::<Vec<_>>();
        let pairwise = scanned.iter().skip(1).fold(scanned[0].clone(), |a, b| merge2(&a, b, 4, DType::I32, ReduceOp::Sum));
        assert_eq!(heap, pairwise);
        assert_eq!(heap.keys.len(), 7 + 40 + 1);
    }
}
