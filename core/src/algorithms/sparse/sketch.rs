//! What ranks learn about the union of indices before moving any rows: a
//! bottom-k sketch (the k keys with the smallest hashes). The bottom-k of a
//! union is the bottom-k of the ranks' bottom-k's, so a few hundred bytes
//! per rank in the header give every rank the same uniform sample of the
//! union. From it: an estimate of the union's size (k minimum values, for
//! choosing an algorithm) and key ranges holding equal shares of the union
//! (for `split`). Hashing runs once per key while planning; merges never hash.

/// Sample size: enough for quantiles at W ranks and a union estimate within
/// about 1/sqrt(k).
pub fn sample_size(world: usize) -> usize {
    (32 * world).clamp(64, 1024)
}

/// A 64-bit mix of a key (splitmix64's finaliser): uniform enough that the
/// smallest hashes are a uniform sample of keys.
fn hash(key: i64) -> u64 {
    let mut z = (key as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// This rank's part of the sketch: up to `k` (hash, key) pairs with the
/// smallest hashes of `keys` (distinct keys), padded with (u64::MAX, 0).
pub fn local(keys: &[i64], k: usize) -> Vec<(u64, i64)> {
    let n = keys.len();
    // The k-th smallest of n uniform hashes lies near k/n of their range:
    // keep only the pairs below 3k/n of it (about 3k, so most keys cost a
    // hash and one comparison), then select among those. Too few below it
    // (a k-th hash far past its expectation): select among all.
    let mut pairs: Vec<(u64, i64)> = if n > 4 * k {
        let below = u64::MAX / n as u64 * (3 * k) as u64;
        let mut few = Vec::with_capacity(4 * k);
        few.extend(keys.iter().map(|key| (hash(*key), *key)).filter(|(h, _)| *h < below));
        few
    } else {
        Vec::new()
    };
    if pairs.len() < k.min(n) {
        pairs = keys.iter().map(|key| (hash(*key), *key)).collect();
    }
    if pairs.len() > k {
        pairs.select_nth_unstable(k - 1);
        pairs.truncate(k);
    }
    pairs.resize(k, (u64::MAX, 0));
    pairs
}

/// The union's sketch, built alike on every rank from all ranks' parts.
#[derive(Debug, Clone, PartialEq)]
pub struct Sketch {
    /// Estimated number of distinct keys over all ranks.
    pub union: f64,
    /// The sampled keys of the union, sorted.
    pub keys: Vec<i64>,
}

impl Sketch {
    /// Combine every rank's [`local`] part (`k` pairs each).
    pub fn combine(parts: impl IntoIterator<Item = (u64, i64)>, k: usize) -> Sketch {
        let mut all: Vec<(u64, i64)> = parts.into_iter().filter(|(h, _)| *h != u64::MAX).collect();
        all.sort_unstable();
        all.dedup();
        all.truncate(k);
        let union = if all.len() < k {
            // Fewer distinct keys than the sample size: the sample is the union.
            all.len() as f64
        } else {
            // k minimum values: the k-th smallest of U uniform hashes sits near k/U.
            let kth = all[k - 1].0 as f64 / u64::MAX as f64;
            (k - 1) as f64 / kth.max(f64::MIN_POSITIVE)
        };
        let mut keys: Vec<i64> = all.into_iter().map(|(_, key)| key).collect();
        keys.sort_unstable();
        Sketch { union, keys }
    }

    /// W-1 non-decreasing key bounds splitting the union into W ranges of
    /// about equal size: rank i owns keys k with bounds[i-1] <= k < bounds[i].
    pub fn bounds(&self, world: usize) -> Vec<i64> {
        let n = self.keys.len();
        (1..world).map(|i| if n == 0 { i64::MAX } else { self.keys[(i * n / world).min(n - 1)] }).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which rank owns `key` under `bounds`.
    fn owner(bounds: &[i64], key: i64) -> usize {
        bounds.partition_point(|b| *b <= key)
    }

    /// The k smallest hashes, by sorting every pair.
    fn bottom_k(keys: &[i64], k: usize) -> Vec<(u64, i64)> {
        let mut all: Vec<(u64, i64)> = keys.iter().map(|key| (hash(*key), *key)).collect();
        all.sort_unstable();
        all.resize(k, (u64::MAX, 0));
        all
    }

    #[test]
    fn local_part_is_the_k_smallest_hashes() {
        let sorted = |mut v: Vec<(u64, i64)>| {
            v.sort_unstable();
            v
        };
        for n in [0, 10, 64, 256, 257, 5000] {
            let keys: Vec<i64> = (0..n).map(|i| i * 7919).collect();
            assert_eq!(sorted(local(&keys, 64)), bottom_k(&keys, 64), "n = {n}");
        }
        // Keys whose hashes all lie in the upper half: nothing passes the
        // filter, and the part still holds the k smallest.
        let high: Vec<i64> = (0..).filter(|key| hash(*key) > u64::MAX / 2).take(1000).collect();
        assert_eq!(sorted(local(&high, 64)), bottom_k(&high, 64));
    }

    #[test]
    fn union_estimate_and_bounds() {
        let k = 256;
        // Four ranks with 3000 keys each, overlapping by half: 7500 distinct.
        let parts: Vec<Vec<i64>> = (0..4).map(|r| (r * 1500..r * 1500 + 3000).collect()).collect();
        let sketch = Sketch::combine(parts.iter().flat_map(|p| local(p, k)), k);
        assert!((sketch.union - 7500.0).abs() < 7500.0 * 0.2, "{}", sketch.union);
        // Equal shares of the union, within sampling error.
        let bounds = sketch.bounds(4);
        let mut share = [0usize; 4];
        for key in 0..7500 {
            share[owner(&bounds, key)] += 1;
        }
        assert!(share.iter().all(|s| (*s as f64 - 1875.0).abs() < 1875.0 * 0.4), "{share:?}");
        // A small union is counted exactly.
        let small = Sketch::combine([vec![1i64, 5, 9], vec![5, 7]].iter().flat_map(|p| local(p, k)), k);
        assert_eq!((small.union, small.keys.clone()), (4.0, vec![1, 5, 7, 9]));
        // No keys anywhere: every key belongs to rank 0.
        let empty = Sketch::combine(local(&[], k), k);
        assert_eq!((empty.union, owner(&empty.bounds(3), 42)), (0.0, 0));
    }
}
