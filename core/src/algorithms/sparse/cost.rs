//! `auto`'s choice: the algorithm with the least estimated cost, from what
//! every rank knows alike after the header (every rank's nnz and the
//! sketch's estimate of the union). Cost counts the bytes each rank
//! receives, a quarter of the bytes its merges read plus a price per
//! merged row, half of the bytes it copies locally, and a price per
//! message (the transport's step: a few µs through shared memory, tens
//! over sockets); the dense path pays its ring traffic and passes over the
//! dense table (fill, reduce, compact). The weights were fitted to
//! `weft bench --ops sparse_all_reduce` at W = 2 and 4; another algorithm
//! replaces the all-gather baseline only when it is clearly cheaper, so
//! estimation error cannot make `auto` slower than the baseline.

use super::coalesce::Geometry;

/// A byte read by a merge, against a byte received.
const MERGE: f64 = 0.25;
/// Each row a merge reads also costs a fixed price (compare, branch): what
/// dominates for narrow rows.
const MERGE_ROW: f64 = 16.0;
/// A byte copied locally (packing rows, the all-gather's own block),
/// against a byte received.
const COPY: f64 = 0.5;
/// How much cheaper than the baseline an estimate must be to replace it.
const MARGIN: f64 = 1.1;

/// The cheapest algorithm's name, where one message costs as much as
/// receiving `step_bytes` (the transport's [`Capabilities::step_bytes`]).
///
/// [`Capabilities::step_bytes`]: crate::backend::Capabilities::step_bytes
pub fn cheapest(world: usize, nnz: &[usize], union: f64, l: &Geometry, step_bytes: usize) -> &'static str {
    if world <= 1 {
        // Nothing to exchange: recursive doubling's zero steps only
        // coalesce the input (the all-gather would copy it twice more).
        return "recursive_doubling";
    }
    let (w, step) = (world as f64, step_bytes as f64);
    let n = nnz.iter().sum::<usize>() as f64 / w;
    // The union holds at least the largest contribution, at most all of them.
    let max = nnz.iter().copied().max().unwrap_or(0) as f64;
    let u = union.clamp(max, n * w);
    let b = (8 + l.row) as f64;
    // Merging `rows` rows of `b` bytes.
    let merge = |rows: f64| rows * (MERGE * b + MERGE_ROW);
    let log_w = (usize::BITS - world.saturating_sub(1).leading_zeros()) as f64;
    // Copying every row of the input into key order (all but split, which
    // gathers only the rows it sends; over shared memory straight into the
    // ring, which this still counts as a copy).
    let pack = n * l.row as f64 * COPY;
    // The baseline also copies its own run into the gathered buffers.
    let baseline = (w - 1.0) * n * b + merge(w * n) + 2.0 * (w - 1.0) * step + pack + n * b * COPY;
    let others = [
        // Step i swaps partial unions of 2^i ranks and merges two of them.
        (
            "recursive_doubling",
            (0..log_w as u32)
                .map(|i| {
                    let partial = (n * f64::from(1u32 << i)).min(u);
                    partial * b + merge(2.0 * partial)
                })
                .sum::<f64>()
                + 2.0 * log_w * step
                + pack,
        ),
        // Each owner receives its range from the others and merges it; the
        // reduced union is all-gathered. Four rounds, each with every peer:
        // a message to each is a step's price (as the ring's and recursive
        // doubling's one message a step are). Priced as one step a round,
        // `auto` took split for 100-row tensors at W=4, where it measured
        // 1.2-1.75 x recursive doubling's time (shm and sockets).
        ("split", (w - 1.0) / w * (n + u) * b + merge(n) + 4.0 * (w - 1.0) * step + (w - 1.0) / w * pack),
        // A dense ring all-reduce (and its mask), plus passes over the table.
        ("dense", {
            let table = l.rows as f64 * (l.row + 1) as f64;
            2.0 * (w - 1.0) / w * table + 4.0 * MERGE * table + 4.0 * (w - 1.0) * step
        }),
    ];
    match others.iter().min_by(|a, b| a.1.total_cmp(&b.1)) {
        Some((name, cost)) if cost * MARGIN < baseline => name,
        _ => "allgather",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    /// The default step price (sockets), and shared memory's.
    const SOCKET: usize = 64 << 10;
    const SHM: usize = 16 << 10;

    fn table(rows: u64) -> Geometry {
        Geometry { shape: vec![rows as usize, 64], sparse_dims: 1, dtype: DType::F32, row: 256, rows }
    }

    #[test]
    fn choices_follow_overlap_and_density() {
        let l = table(100_000);
        // Tiny tensors: the fewest messages (recursive doubling's four at
        // W=4), not the baseline's six nor split's twelve (figures:
        // bench/RESULTS.md, "Measurements behind code comments").
        for (n, union, step) in [(100, 118.0, SHM), (100, 324.0, SHM), (100, 118.0, SOCKET), (100, 324.0, SOCKET), (10, 30.0, SOCKET)] {
            assert_eq!(cheapest(4, &[n; 4], union, &l, step), "recursive_doubling", "{n} rows, union {union}, step {step}");
        }
        // From 1,000 rows split's traffic wins through shm (0.61-0.75 x
        // recursive doubling's time over five runs), and from 2,000 over
        // sockets where the union is three ranks' worth (0.88-0.98 x).
        assert_eq!(cheapest(4, &[1000; 4], 1179.0, &l, SHM), "split");
        assert_eq!(cheapest(4, &[1000; 4], 3029.0, &l, SHM), "split");
        assert_eq!(cheapest(4, &[2000; 4], 5848.0, &l, SOCKET), "split");
        // Indices overlapping heavily: the union is barely larger than one rank's.
        assert_eq!(cheapest(4, &[10_000; 4], 11_000.0, &l, SOCKET), "split");
        // Nearly the whole table on every rank: with wide rows, moving keys
        // too costs little more than dense; with narrow rows, dense wins.
        assert_eq!(cheapest(4, &[90_000; 4], 99_000.0, &l, SOCKET), "split");
        let narrow = Geometry { shape: vec![100_000], sparse_dims: 1, dtype: DType::F32, row: 4, rows: 100_000 };
        assert_eq!(cheapest(4, &[90_000; 4], 99_000.0, &narrow, SOCKET), "dense");
        // Little or no overlap at two ranks: the traffic is the baseline's,
        // but not its copies of every row (measured 1.2-1.4x faster).
        assert_ne!(cheapest(2, &[26_000; 2], 38_000.0, &l, SOCKET), "allgather");
        assert_ne!(cheapest(2, &[26_000; 2], 52_000.0, &l, SOCKET), "allgather");
        // Narrow rows, light overlap at four ranks: merging 4x the rows
        // costs the baseline more than split's extra steps.
        let narrow_big = Geometry { rows: 1_000_000, ..narrow.clone() };
        assert_eq!(cheapest(4, &[52_500; 4], 139_000.0, &narrow_big, SOCKET), "split");
        // Two ranks, 1000 keys each, 1762 in all: split's four steps pay
        // off where a step is cheap (measured through shm: split 102-105
        // us, recursive doubling 103-110, the baseline 112-116), not over
        // sockets. With a tenth of that, the fewest steps still win.
        assert_eq!(cheapest(2, &[1000; 2], 1762.0, &l, SHM), "split");
        assert_ne!(cheapest(2, &[1000; 2], 1762.0, &l, SOCKET), "split");
        assert_eq!(cheapest(2, &[100; 2], 181.0, &l, SHM), "recursive_doubling");
        // One rank: nothing to exchange, nothing to merge.
        assert_eq!(cheapest(1, &[5], 5.0, &l, SOCKET), "recursive_doubling");
    }
}
