//! Sparse data in the form the algorithms move: entries sorted by a
//! linear key (row-major over the sparse dims) with one row of values
//! each, and the merges that combine such runs. Sorting and merging only:
//! no per-element hashing on the hot path.

use crate::backend::Gather;
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

/// A borrowed run: part of a [`Run`], rows as they were received, or
/// part of a [`Sorted`] input whose rows still lie where the caller put them.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunRef<'a> {
    /// Sorted unique keys.
    pub keys: &'a [i64],
    /// Where the row of each key is.
    pub values: Rows<'a>,
}

/// Where the rows of a [`RunRef`] are.
#[derive(Clone, Copy, Debug)]
pub enum Rows<'a> {
    /// One row per key, packed in key order.
    Packed(&'a [u8]),
    /// The rows of a sorted input's entries from this one on.
    Sorted(&'a Sorted<'a>, usize),
}

impl Default for Rows<'_> {
    fn default() -> Self {
        Rows::Packed(&[])
    }
}

impl<'a> RunRef<'a> {
    /// Keys with their rows packed after one another.
    pub fn packed(keys: &'a [i64], values: &'a [u8]) -> RunRef<'a> {
        RunRef { keys, values: Rows::Packed(values) }
    }

    /// Entry `i`'s row of `row` bytes.
    fn row(&self, i: usize, row: usize) -> &'a [u8] {
        match self.values {
            Rows::Packed(v) => &v[i * row..(i + 1) * row],
            Rows::Sorted(s, first) => s.row(first + i),
        }
    }
}

impl Run {
    /// An empty run with room for `rows` rows of `row` bytes, its values in
    /// `values` (a finished result's buffer, kept for its pages; its
    /// contents are dropped).
    pub fn reusing(mut values: Vec<u8>, rows: usize, row: usize) -> Run {
        values.clear();
        values.reserve(rows * row);
        Run { keys: Vec::with_capacity(rows), values }
    }

    /// The whole run, borrowed.
    pub fn as_ref(&self) -> RunRef<'_> {
        RunRef::packed(&self.keys, &self.values)
    }
}

/// Geometry shared by all ranks: how keys map to indices and rows to bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct Geometry {
    pub shape: Vec<usize>,
    pub sparse_dims: usize,
    pub dtype: DType,
    /// Bytes of one row of values (dense part of the shape).
    pub row: usize,
    /// Number of distinct keys (product of the sparse dims).
    pub rows: u64,
}

impl Geometry {
    pub fn of(t: &SparseCooTensor<'_>) -> Result<Geometry> {
        let sparse_dims = t.indices.dims()[0];
        let rows = t.shape[..sparse_dims]
            .iter()
            .try_fold(1u64, |a, d| a.checked_mul(*d as u64))
            .filter(|r| *r <= i64::MAX as u64)
            .ok_or_else(|| Error::invalid(format!("sparse dims {:?} have more than 2^63 positions", &t.shape[..sparse_dims])))?;
        let dense: usize = t.shape[sparse_dims..].iter().product();
        Ok(Geometry { shape: t.shape.clone(), sparse_dims, dtype: t.values.dtype(), row: dense * t.values.dtype().size(), rows })
    }

    /// A count of distinct entries that rank `from` sent, checked against
    /// the shape's positions: a garbled count (almost always far beyond
    /// them) is an error, not an attempt to allocate that much.
    pub fn entries(&self, n: u64, from: usize) -> Result<usize> {
        if n > self.rows {
            return Err(Error::backend(format!(
                "rank {from} sent a corrupt sparse message: {n} entries, where the shape has {} positions",
                self.rows
            )));
        }
        Ok(n as usize)
    }
}

/// How many entries ahead of its use a [`Sorted`] row is prefetched (and
/// how many groups ahead [`sort`] loads the rows of repeated keys).
const AHEAD: usize = 8;

/// Tag of a [`Sorted`] row index that points into its reduced duplicates.
const REDUCED: usize = 1 << (usize::BITS - 1);

/// A rank's input in key order with duplicates reduced: what coalescing
/// yields, except that each row stays where it lies in the input (only the
/// rows of repeated keys are copied, to be reduced). An algorithm that moves
/// most rows elsewhere anyway (`split`) reads them from here and never pays
/// for a sorted copy of all of them.
#[derive(Debug)]
pub struct Sorted<'a> {
    /// Sorted unique keys.
    pub keys: Vec<i64>,
    /// Key i's row: input row `at[i]`, or `reduced` row `at[i] & !REDUCED`.
    at: Vec<usize>,
    input: &'a [u8],
    /// Rows of keys given more than once, each reduced over its entries.
    reduced: Vec<u8>,
    row: usize,
}

impl<'a> Sorted<'a> {
    /// Entry `i`'s row.
    pub fn row(&self, i: usize) -> &[u8] {
        // Rows are read in key order, which is no order in memory: start
        // loading the row a few entries ahead.
        if i + AHEAD < self.at.len() {
            crate::kernels::prefetch(self.row_at(self.at[i + AHEAD]));
        }
        self.row_at(self.at[i])
    }

    fn row_at(&self, at: usize) -> &[u8] {
        let row = self.row;
        if at & REDUCED == 0 {
            &self.input[at * row..(at + 1) * row]
        } else {
            let at = at & !REDUCED;
            &self.reduced[at * row..(at + 1) * row]
        }
    }

    /// Entries `range`, borrowed.
    pub fn slice(&self, range: std::ops::Range<usize>) -> RunRef<'_> {
        RunRef { keys: &self.keys[range.clone()], values: Rows::Sorted(self, range.start) }
    }

    /// The rows of entries `range` in key order, as a send gathers them
    /// (from where they lie: no packed copy first).
    pub fn rows(&self, range: std::ops::Range<usize>) -> SortedRows<'_> {
        SortedRows { sorted: self, range }
    }

    /// The coalesced run: every row copied into key order, into `values`
    /// (a buffer to reuse; its contents are dropped).
    pub fn into_run(self, mut values: Vec<u8>) -> Run {
        values.clear();
        values.reserve(self.keys.len() * self.row);
        for i in 0..self.keys.len() {
            values.extend_from_slice(self.row(i));
        }
        Run { keys: self.keys, values }
    }
}

/// Rows of a [`Sorted`] input's entries in key order ([`Sorted::rows`]).
pub struct SortedRows<'a> {
    sorted: &'a Sorted<'a>,
    range: std::ops::Range<usize>,
}

impl Gather for SortedRows<'_> {
    fn len(&self) -> usize {
        self.range.len() * self.sorted.row
    }

    fn fill(&self, at: usize, dst: &mut [u8]) {
        let row = self.sorted.row;
        if dst.is_empty() {
            return; // (rows of 0 bytes: nothing to divide by)
        }
        // A piece may start and end inside a row (the ring's free space is
        // not cut at rows).
        let (mut entry, mut skip, mut done) = (self.range.start + at / row, at % row, 0);
        while done < dst.len() {
            let src = &self.sorted.row(entry)[skip..];
            let n = src.len().min(dst.len() - done);
            dst[done..done + n].copy_from_slice(&src[..n]);
            (entry, skip, done) = (entry + 1, 0, done + n);
        }
    }
}

thread_local! {
    /// A transient run's buffer, kept for the next op on this thread.
    static SPARE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Largest buffer [`recycle`] keeps.
const SPARE_MAX_BYTES: usize = 256 << 20;

/// The buffer an earlier op on this thread [`recycle`]d (empty if none):
/// its pages are in. Filling a fresh allocation instead measured up to
/// three times slower, and swung with what the allocator handed out.
pub fn spare() -> Vec<u8> {
    SPARE.with(|s| std::mem::take(&mut *s.borrow_mut()))
}

/// Keep a transient run's buffer for the next [`spare`] (the larger of it
/// and the one kept).
pub fn recycle(buf: Vec<u8>) {
    if buf.capacity() <= SPARE_MAX_BYTES {
        SPARE.with(|s| {
            let mut s = s.borrow_mut();
            if buf.capacity() > s.capacity() {
                *s = buf;
            }
        });
    }
}

thread_local! {
    /// The packed sort's two buffers, kept for the next op on this thread:
    /// fresh ones fault in every page on every call (three times the sort's
    /// own cost at 25,000 entries, where malloc maps large blocks anew).
    static PACKED: std::cell::RefCell<(Vec<u64>, Vec<u64>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Sort `t`'s entries by key and reduce duplicates with `op` (in entry
/// order, so every rank's bits are reproducible).
pub fn sort<'a>(t: &'a SparseCooTensor<'_>, l: &Geometry, op: ReduceOp) -> Result<Sorted<'a>> {
    let nnz = t.nnz();
    let idx: &[i64] = t.indices.as_slice()?;
    let input = t.values.host_bytes()?;
    // Key and entry number in one word where both fit (keys below `rows`),
    // as they do for any table of fewer than 2^40 rows and 2^24 entries.
    let entry_bits = usize::BITS - nnz.leading_zeros();
    let key_bits = u64::BITS - l.rows.saturating_sub(1).leading_zeros();
    if key_bits + entry_bits <= u64::BITS {
        PACKED.with(|p| {
            let (entries, scratch) = &mut *p.borrow_mut();
            entries.clear();
            entries.reserve(nnz);
            let max = keys(idx, l, nnz, |key, k| entries.push(key << entry_bits | k as u64))?;
            super::radix::sort_by_key(entries, max, entry_bits, scratch);
            let mask = (1u64 << entry_bits) - 1;
            let sorted = group(entries, |e| ((e >> entry_bits) as i64, (e & mask) as usize), input, l, op);
            if entries.capacity() * 8 > SPARE_MAX_BYTES {
                *entries = Vec::new();
                *scratch = Vec::new();
            }
            Ok(sorted)
        })
    } else {
        let mut entries = Vec::with_capacity(nnz);
        let max = keys(idx, l, nnz, |key, k| entries.push((key as i64, k)))?;
        super::radix::sort_by_key(&mut entries, max, 0, &mut Vec::new());
        Ok(group(&entries, |e| e, input, l, op))
    }
}

/// Call `each(key, entry)` for every entry's linear key, in entry order,
/// checking every index against its dim; the largest key.
fn keys(idx: &[i64], l: &Geometry, nnz: usize, mut each: impl FnMut(u64, usize)) -> Result<u64> {
    let bad = |k: usize, d: usize| {
        let i = idx[d * nnz + k];
        Error::invalid(format!("index {i} of entry {k} is out of range for sparse dim {d} of size {}", l.shape[d]))
    };
    let mut max = 0;
    if l.sparse_dims == 1 {
        // The usual case (an embedding table's rows), one compare per entry.
        let rows = l.shape[0] as u64;
        for (k, i) in idx[..nnz].iter().enumerate() {
            let key = *i as u64; // a negative index wraps beyond any dim
            if key >= rows {
                return Err(bad(k, 0));
            }
            max = max.max(key);
            each(key, k);
        }
        return Ok(max);
    }
    for k in 0..nnz {
        let mut key = 0u64;
        for d in 0..l.sparse_dims {
            let i = idx[d * nnz + k] as u64;
            if i >= l.shape[d] as u64 {
                return Err(bad(k, d));
            }
            key = key * l.shape[d] as u64 + i;
        }
        max = max.max(key);
        each(key, k);
    }
    Ok(max)
}

/// The entries sorted by key (`decode` gives an entry's key and number)
/// as a [`Sorted`] over `input`'s rows: keys first; then the entries of
/// repeated keys are reduced, with the rows of a group a few groups ahead
/// already loading (they lie anywhere in the input). Reduced inside the
/// first pass, each group waited for its rows (figures: bench/RESULTS.md, "Measurements behind code comments").
fn group<'a, E: Copy>(entries: &[E], decode: impl Fn(E) -> (i64, usize), input: &'a [u8], l: &Geometry, op: ReduceOp) -> Sorted<'a> {
    let (nnz, row) = (entries.len(), l.row);
    let mut out = Sorted { keys: Vec::with_capacity(nnz), at: Vec::with_capacity(nnz), input, reduced: Vec::new(), row };
    let mut repeated = Vec::new();
    for same in entries.chunk_by(|a, b| decode(*a).0 == decode(*b).0) {
        let (key, first) = decode(same[0]);
        out.keys.push(key);
        if same.len() == 1 {
            out.at.push(first);
        } else {
            out.at.push(REDUCED | repeated.len());
            repeated.push(same);
        }
    }
    let row_of = |e: E| {
        let k = decode(e).1;
        &input[k * row..(k + 1) * row]
    };
    out.reduced.reserve_exact(repeated.len() * row);
    for (g, same) in repeated.iter().enumerate() {
        if let Some(ahead) = repeated.get(g + AHEAD) {
            ahead.iter().for_each(|e| crate::kernels::prefetch(row_of(*e)));
        }
        let start = out.reduced.len();
        out.reduced.extend_from_slice(row_of(same[0]));
        for e in &same[1..] {
            reduce_into(&mut out.reduced[start..], row_of(*e), l.dtype, op);
        }
    }
    out
}

/// Up to this many runs, the smallest head is found by scanning the heads
/// (predictable branches, no heap upkeep); beyond, a heap.
const SCAN_RUNS: usize = 16;

/// Call `each(key, run, position)` for every entry of the runs (sorted,
/// each unique within its run) in key order; entries with equal keys come
/// together, in run order.
fn in_key_order(runs: &[RunRef<'_>], mut each: impl FnMut(i64, usize, usize)) {
    if let [a, b] = runs {
        return in_key_order2(a.keys, b.keys, each);
    }
    let mut pos = vec![0usize; runs.len()];
    if runs.len() <= SCAN_RUNS {
        while let Some(key) = runs.iter().zip(&pos).filter_map(|(r, p)| r.keys.get(*p)).min().copied() {
            for (i, (r, p)) in runs.iter().zip(pos.iter_mut()).enumerate() {
                if r.keys.get(*p) == Some(&key) {
                    each(key, i, *p);
                    *p += 1;
                }
            }
        }
        return;
    }
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let mut heap: BinaryHeap<Reverse<(i64, usize)>> =
        runs.iter().enumerate().filter(|(_, r)| !r.keys.is_empty()).map(|(i, r)| Reverse((r.keys[0], i))).collect();
    while let Some(Reverse((key, i))) = heap.pop() {
        each(key, i, pos[i]);
        pos[i] += 1;
        if let Some(next) = runs[i].keys.get(pos[i]) {
            heap.push(Reverse((*next, i)));
        }
    }
}

/// [`in_key_order`] of two runs (every algorithm's case at two ranks): a
/// plain two-way merge, one comparison per entry, instead of scanning the
/// heads twice per key.
fn in_key_order2(a: &[i64], b: &[i64], mut each: impl FnMut(i64, usize, usize)) {
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        let (x, y) = (a[i], b[j]);
        if x <= y {
            each(x, 0, i);
            i += 1;
        }
        if y <= x {
            each(y, 1, j);
            j += 1;
        }
    }
    (i..a.len()).for_each(|i| each(a[i], 0, i));
    (j..b.len()).for_each(|j| each(b[j], 1, j));
}

/// Merge k coalesced runs (k-way merge), reducing rows with equal keys.
/// The result's values go into `values`, a buffer to reuse (its contents
/// are dropped).
pub fn merge_k(runs: &[RunRef<'_>], row: usize, dtype: DType, op: ReduceOp, values: Vec<u8>) -> Run {
    let mut out = Run::reusing(values, runs.iter().map(|r| r.keys.len()).sum(), row);
    in_key_order(runs, |key, i, p| {
        let src = runs[i].row(p, row);
        if out.keys.last() == Some(&key) {
            let n = out.values.len();
            reduce_into(&mut out.values[n - row..], src, dtype, op);
        } else {
            out.keys.push(key);
            out.values.extend_from_slice(src);
        }
    });
    out
}

/// How many distinct keys the runs hold together (what [`merge_into`]
/// writes).
pub fn distinct(runs: &[RunRef<'_>]) -> usize {
    let (mut n, mut last) = (0, None);
    in_key_order(runs, |key, _, _| {
        if last != Some(key) {
            n += 1;
            last = Some(key);
        }
    });
    n
}

/// [`merge_k`] straight into place: the merged keys (little-endian, 8
/// bytes each) into `keys` and their rows into `values`, both exactly
/// [`distinct`] entries long.
pub fn merge_into(runs: &[RunRef<'_>], row: usize, dtype: DType, op: ReduceOp, keys: &mut [u8], values: &mut [u8]) {
    let (mut n, mut last) = (0, None);
    in_key_order(runs, |key, i, p| {
        let src = runs[i].row(p, row);
        if last == Some(key) {
            reduce_into(&mut values[(n - 1) * row..n * row], src, dtype, op);
        } else {
            keys[n * 8..(n + 1) * 8].copy_from_slice(&key.to_le_bytes());
            values[n * row..(n + 1) * row].copy_from_slice(src);
            n += 1;
            last = Some(key);
        }
    });
    debug_assert_eq!(n * 8, keys.len(), "merge_into: buffers sized by `distinct`");
}

/// `buf` (a finished result's buffer) made `len` bytes long for a new
/// result, keeping its pages: the bytes are unspecified, and the caller
/// overwrites every one.
pub fn reuse(mut buf: Vec<u8>, len: usize) -> Vec<u8> {
    buf.truncate(len);
    buf.resize(len, 0);
    buf
}

/// The run as a user-facing tensor: keys unravelled into `[sparse_dims, nnz]`
/// indices, written into `indices` (a finished result's buffer: its pages
/// are already there). The outermost index is what the inner dims leave, so
/// one sparse dim needs no division at all.
pub fn to_coo(run: Run, l: &Geometry, mut indices: Vec<i64>) -> SparseCoo {
    let n = run.keys.len();
    indices.clear();
    indices.resize(l.sparse_dims * n, 0);
    for (k, key) in run.keys.iter().enumerate() {
        // Keys lie in [0, rows), rows <= i64::MAX (`Geometry::of`).
        let mut rem = *key as u64;
        for d in (1..l.sparse_dims).rev() {
            let extent = l.shape[d] as u64;
            indices[d * n + k] = (rem % extent) as i64;
            rem /= extent;
        }
        if l.sparse_dims > 0 {
            indices[k] = rem as i64;
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
    fn keys_unravel_into_a_reused_buffer() {
        let l = Geometry { shape: vec![3, 4, 5], sparse_dims: 2, dtype: DType::I32, row: 20, rows: 12 };
        let coo = to_coo(Run { keys: vec![0, 7, 11], values: vec![0; 60] }, &l, vec![-1; 50]);
        assert_eq!(coo.indices, vec![0, 1, 2, 0, 3, 3]);
        let l1 = Geometry { shape: vec![9, 5], sparse_dims: 1, ..l };
        assert_eq!(to_coo(Run { keys: vec![2, 8], values: vec![0; 40] }, &l1, Vec::new()).indices, vec![2, 8]);
    }

    #[test]
    fn two_way_and_k_way_merges_agree() {
        let a = run(&[1, 4, 9], &[1, 2, 3]);
        let b = run(&[0, 4, 10, 11], &[5, 6, 7, 8]);
        let c = run(&[4], &[100]);
        let merge = |runs: &[RunRef<'_>]| merge_k(runs, 4, DType::I32, ReduceOp::Sum, vec![1; 100]);
        // Two runs take the two-way path; with an empty third, the scan.
        let ab = merge(&[a.as_ref(), b.as_ref()]);
        assert_eq!(ab, merge(&[a.as_ref(), b.as_ref(), RunRef::default()]));
        assert_eq!(merge(&[b.as_ref(), a.as_ref()]), merge(&[b.as_ref(), RunRef::default(), a.as_ref()]));
        assert_eq!(distinct(&[a.as_ref(), b.as_ref()]), 6);
        let mk = merge(&[a.as_ref(), b.as_ref(), c.as_ref(), RunRef::default()]);
        assert_eq!(merge(&[ab.as_ref(), c.as_ref()]), mk);
        assert_eq!(mk, run(&[0, 1, 4, 9, 10, 11], &[5, 1, 108, 3, 7, 8]));
    }

    #[test]
    fn scanning_and_heap_merges_agree() {
        // 40 runs (the heap path) against the same merged in pairs.
        let runs: Vec<Run> = (0..40).map(|i| run(&[i % 7, 10 + i, 100], &[i as i32, 1, 2])).collect();
        let refs: Vec<RunRef<'_>> = runs.iter().map(Run::as_ref).collect();
        let heap = merge_k(&refs, 4, DType::I32, ReduceOp::Sum, vec![7; 3]);
        let scanned = refs.chunks(SCAN_RUNS).map(|c| merge_k(c, 4, DType::I32, ReduceOp::Sum, Vec::new())).collect::<Vec<_>>();
        let pairwise = scanned
            .iter()
            .skip(1)
            .fold(scanned[0].clone(), |a, b| merge_k(&[a.as_ref(), b.as_ref()], 4, DType::I32, ReduceOp::Sum, Vec::new()));
        assert_eq!(heap, pairwise);
        assert_eq!(heap.keys.len(), 7 + 40 + 1);
    }

    /// A sparse tensor of `shape` (its first `idx.len()` dims sparse)
    /// with one i32 value per entry, 1, 2, 3, ...
    fn coo(idx: &[Vec<i64>], shape: Vec<usize>) -> (Vec<i64>, Vec<i32>, Vec<usize>) {
        let vals = (1..=idx[0].len() as i32).collect();
        (idx.concat(), vals, shape)
    }

    /// `sort`'s keys and rows (each row as its i32), or its error.
    fn sorted(idx: &[Vec<i64>], shape: Vec<usize>) -> Result<(Vec<i64>, Vec<i32>)> {
        use crate::tensor::Tensor;
        let (flat, vals, shape) = coo(idx, shape);
        let t = SparseCooTensor::new(Tensor::from_slice(&flat).reshape(&[idx.len(), idx[0].len()])?, Tensor::from_slice(&vals), shape)?;
        let l = Geometry::of(&t)?;
        let s = sort(&t, &l, ReduceOp::Sum)?;
        let rows = (0..s.keys.len()).map(|i| i32::from_ne_bytes(s.row(i).try_into().expect("4 bytes"))).collect();
        Ok((s.keys.clone(), rows))
    }

    #[test]
    fn sort_packs_narrow_keys_and_keeps_wide_ones_exact() {
        // 300 entries (the radix path), keys repeating every 100.
        let narrow: Vec<i64> = (0..300).map(|k| (k * 37) % 100).collect();
        let (keys, rows) = sorted(std::slice::from_ref(&narrow), vec![1000]).unwrap();
        assert_eq!(keys, (0..100).collect::<Vec<_>>());
        // Key j is entries j', j'+100, j'+200 with j' * 37 = j (mod 100),
        // values j'+1 and so on: their sum.
        for (key, row) in keys.iter().zip(&rows) {
            let first = (0..100).find(|k| (k * 37) % 100 == *key).unwrap() as i32;
            assert_eq!(*row, 3 * first + 300 + 3, "key {key}");
        }
        // Two sparse dims of 2^31: 62-bit keys leave no room for entry
        // numbers in one word, and must come out the same.
        let big = 1i64 << 31;
        let hi: Vec<i64> = narrow.iter().map(|k| big - 1 - k).collect();
        let lo: Vec<i64> = narrow.iter().map(|k| k * 1000).collect();
        let (wide, wide_rows) = sorted(&[hi, lo], vec![1 << 31, 1 << 31]).unwrap();
        let want: Vec<i64> = (0..100).rev().map(|k| (big - 1 - k) * big + k * 1000).collect();
        assert_eq!(wide, want);
        assert_eq!(wide_rows, rows.iter().rev().copied().collect::<Vec<_>>());
    }

    #[test]
    fn gathered_rows_come_out_packed_in_any_pieces() {
        use crate::tensor::Tensor;
        // 40 entries of 3 i32 (12-byte rows), keys repeating every 25 (so
        // some rows are reduced copies), in shuffled order.
        let idx: Vec<i64> = (0..40).map(|k| (k * 7) % 25).collect();
        let vals: Vec<i32> = (0..120).collect();
        let t = SparseCooTensor::new(
            Tensor::from_slice(&idx).reshape(&[1, 40]).unwrap(),
            Tensor::from_slice(&vals).reshape(&[40, 3]).unwrap(),
            vec![25, 3],
        )
        .unwrap();
        let l = Geometry::of(&t).unwrap();
        let s = sort(&t, &l, ReduceOp::Sum).unwrap();
        let range = 3..22;
        let packed: Vec<u8> = range.clone().flat_map(|i| s.row(i).to_vec()).collect();
        let rows = s.rows(range);
        assert_eq!(rows.len(), packed.len());
        // Pieces that start and end inside rows, and across several.
        for piece in [1, 5, 12, 13, 40, packed.len()] {
            let mut got = vec![0u8; packed.len()];
            for (k, dst) in got.chunks_mut(piece).enumerate() {
                rows.fill(k * piece, dst);
            }
            assert_eq!(got, packed, "pieces of {piece} bytes");
        }
        assert!(s.rows(5..5).is_empty());
    }

    #[test]
    fn an_index_outside_its_dim_is_an_error_naming_it() {
        for (idx, shape, what) in [
            (vec![vec![0, 5, 2]], vec![5], "index 5 of entry 1 is out of range for sparse dim 0 of size 5"),
            (vec![vec![0, -1, 2]], vec![5], "index -1 of entry 1 is out of range for sparse dim 0 of size 5"),
            (vec![vec![0, 1, 2], vec![3, 3, -2]], vec![5, 4], "index -2 of entry 2 is out of range for sparse dim 1 of size 4"),
            (vec![vec![0, 7, 2], vec![3, 3, 3]], vec![5, 4], "index 7 of entry 1 is out of range for sparse dim 0 of size 5"),
        ] {
            let e = sorted(&idx, shape).unwrap_err();
            assert!(e.to_string().contains(what), "{e}");
        }
    }
}
