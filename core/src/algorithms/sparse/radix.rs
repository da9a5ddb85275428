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

/// An entry to sort: its key's bits, and an order that is (key, entry
/// number), so a comparison sort of small inputs agrees with the radix sort.
pub trait Entry: Copy + Ord + Default {
    /// The key (non-negative), as bits to sort by.
    fn key_bits(self, shift: u32) -> u64;
    /// The entry's number (its place in the input).
    fn number(self, shift: u32) -> u64;
}

/// `(key, entry number)`: any key and any number of entries.
impl Entry for (i64, usize) {
    #[inline]
    fn key_bits(self, _: u32) -> u64 {
        self.0 as u64
    }
    fn number(self, _: u32) -> u64 {
        self.1 as u64
    }
}

/// `key << shift | entry number` in one word, where both fit: half the
/// bytes to move per pass (the scatter's stores are what a pass waits on).
impl Entry for u64 {
    #[inline]
    fn key_bits(self, shift: u32) -> u64 {
        self >> shift
    }
    fn number(self, shift: u32) -> u64 {
        self & ((1 << shift) - 1)
    }
}

/// Sort `entries` (arriving in entry order) by key, equal keys in entry
/// order; keys are at most `max_key`; `shift` as [`Entry::key_bits`] takes
/// it. `scratch` is the second buffer the passes swap with (its contents
/// are dropped): pass the one an earlier sort left, whose pages are in.
pub fn sort_by_key<E: Entry>(entries: &mut Vec<E>, max_key: u64, shift: u32, scratch: &mut Vec<E>) {
    debug_assert!(entries.windows(2).all(|w| w[0].number(shift) < w[1].number(shift)), "entries arrive in entry order");
    if entries.len() < MIN_RADIX {
        // (key, entry) order: equal keys stay in entry order.
        entries.sort_unstable();
        return;
    }
    let bits = u64::BITS - max_key.leading_zeros();
    let passes = bits.div_ceil(MAX_DIGIT).max(1);
    let digit = bits.div_ceil(passes);
    let (from, to) = (entries, scratch);
    to.clear();
    to.resize(from.len(), E::default());
    let mut count = vec![0usize; 1 << digit];
    for pass in 0..passes {
        let at_bit = pass * digit;
        let mask = (1u64 << digit) - 1;
        let bucket = |e: E| ((e.key_bits(shift) >> at_bit) & mask) as usize;
        count.fill(0);
        for e in from.iter() {
            count[bucket(*e)] += 1;
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
        for e in from.iter() {
            let b = bucket(*e);
            to[count[b]] = *e;
            count[b] += 1;
        }
        std::mem::swap(from, to);
    }
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
            let mut packed: Vec<u64> = got.iter().map(|(k, e)| (*k as u64) << 20 | *e as u64).collect();
            sort_by_key(&mut got, max - 1, 0, &mut vec![(7, 7); 3]);
            assert_eq!(got, want, "n {n}, keys below {max}");
            if max <= 1 << 40 {
                // Both in one word, the scratch reused from a longer sort.
                sort_by_key(&mut packed, max - 1, 20, &mut vec![0; 2 * n]);
                let unpacked: Vec<(i64, usize)> = packed.iter().map(|v| ((v >> 20) as i64, (v & 0xfffff) as usize)).collect();
                assert_eq!(unpacked, want, "packed: n {n}, keys below {max}");
            }
        }
    }
}
