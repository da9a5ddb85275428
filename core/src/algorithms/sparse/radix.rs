//! Sorting a rank's entries by key: an LSD radix sort over only the bits
//! the keys use. Keys are bounded by the tensor's sparse shape (an
//! embedding table of 10^5 rows needs 17 bits: two passes), so this is
//! linear in nnz where a comparison sort pays log(nnz) compares per entry;
//! the sort was the largest fixed cost of every sparse algorithm.

/// Below this many entries a comparison sort wins (the passes' histograms
/// cost more than the compares).
const MIN_RADIX: usize = 256;
/// Most bits one pass sorts by (2^11 counters fit in L1).
const MAX_DIGIT: u32 = 11;

/// Sort `(key, entry)` pairs by key, equal keys in entry order. Keys must
/// be non-negative (linear indices); `entries` arrive in entry order.
pub fn sort_by_key(entries: &mut Vec<(i64, usize)>) {
    debug_assert!(entries.windows(2).all(|w| w[0].1 < w[1].1), "entries arrive in entry order");
    let max = entries.iter().map(|e| e.0).max().unwrap_or(0);
    debug_assert!(entries.iter().all(|e| e.0 >= 0), "keys are linear indices");
    if entries.len() < MIN_RADIX {
        // (key, entry) order: equal keys stay in entry order.
        entries.sort_unstable();
        return;
    }
    let bits = u64::BITS - (max as u64).leading_zeros();
    let passes = bits.div_ceil(MAX_DIGIT).max(1);
    let digit = bits.div_ceil(passes);
    let mut from = std::mem::take(entries);
    let mut to = vec![(0i64, 0usize); from.len()];
    let mut count = vec![0usize; 1 << digit];
    for pass in 0..passes {
        let shift = pass * digit;
        let mask = (1u64 << digit) - 1;
        let bucket = |key: i64| ((key as u64 >> shift) & mask) as usize;
        count.fill(0);
        for e in &from {
            count[bucket(e.0)] += 1;
        }
        if count.contains(&from.len()) {
            continue; // every key has this digit: the pass would not move anything
        }
        let mut at = 0;
        for c in count.iter_mut() {
            let n = *c;
            *c = at;
            at += n;
        }
        // Stable scatter: keys with the same digit keep their order, so
        // after the last pass equal keys are still in entry order.
        for e in &from {
            let b = bucket(e.0);
            to[count[b]] = *e;
            count[b] += 1;
        }
        std::mem::swap(&mut from, &mut to);
    }
    *entries = from;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift: deterministic keys without a dependency.
    fn keys(n: usize, max: u64, seed: u64) -> Vec<i64> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % max) as i64
            })
            .collect()
    }

    #[test]
    fn sorts_like_a_comparison_sort_with_ties_in_entry_order() {
        for (n, max) in [(0, 1), (5, 3), (300, 1), (300, 4), (1000, 100_000), (5000, 1 << 40), (4000, i64::MAX as u64)] {
            let mut got: Vec<(i64, usize)> = keys(n, max, n as u64 + max).into_iter().zip(0..).collect();
            let mut want = got.clone();
            want.sort_by_key(|e| e.0); // stable: ties in entry order
            sort_by_key(&mut got);
            assert_eq!(got, want, "n {n}, keys below {max}");
        }
    }
}
