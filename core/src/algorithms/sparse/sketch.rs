//! What ranks learn about each other's keys before moving any rows, from a
//! few kilobytes per rank in the header:
//! - a bottom-k sketch (the k keys with the smallest hashes): the bottom-k
//!   of a union is the bottom-k of the ranks' bottom-k's, so every rank gets
//!   the same uniform sample of the union, and from it an estimate of the
//!   union's size (from on how many ranks the sampled keys lie), for
//!   choosing an algorithm;
//! - evenly spaced keys of every rank's sorted keys, each weighted by the
//!   entries it stands for: key ranges holding equal shares of all ranks'
//!   entries (for `split`, whose owners each merge one range).
//!
//! Hashing runs once per key while planning; merges never hash.

/// Sample size (of each kind, per rank): enough for quantiles at W ranks
/// and a union estimate within about 1/sqrt(k).
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
    let hashed = || keys.iter().map(|key| (hash(*key), *key));
    // The k-th smallest of n uniform hashes lies near k/n of their range:
    // keep only the pairs below 3k/n of it (about 3k, so most keys cost a
    // hash and one comparison), then select among those. Too few below it
    // (a k-th hash far past its expectation): select among all.
    let mut pairs: Vec<(u64, i64)> = if n > 4 * k {
        let below = u64::MAX / n as u64 * (3 * k) as u64;
        let mut few = Vec::with_capacity(4 * k);
        few.extend(hashed().filter(|(h, _)| *h < below));
        few
    } else {
        Vec::new()
    };
    if pairs.len() < k.min(n) {
        pairs = hashed().collect();
    }
    if pairs.len() > k {
        pairs.select_nth_unstable(k - 1);
        pairs.truncate(k);
    }
    pairs.resize(k, (u64::MAX, 0));
    pairs
}

/// The estimated number of distinct keys over all ranks, from every rank's
/// [`local`] part (`k` pairs each) and the ranks' key counts together
/// (`entries`); the same on every rank. The union's k smallest hashes are a
/// uniform sample of it, and every rank holding one of those keys has it in
/// its part (its own k smallest hashes reach at least as far), so the
/// sample shows on how many ranks each key lies: the union is `entries`
/// over that mean. Where indices overlap heavily, which is where `auto`
/// must judge finely, this is far tighter than what the k-th hash alone
/// says (k minimum values: about 1/sqrt(k) off).
pub fn union_size(parts: impl IntoIterator<Item = (u64, i64)>, k: usize, entries: usize) -> f64 {
    let mut all: Vec<(u64, i64)> = parts.into_iter().filter(|(h, _)| *h != u64::MAX).collect();
    all.sort_unstable();
    // The union's sample in hash order: on how many ranks each key lies.
    let mut ranks_of: Vec<usize> = Vec::with_capacity(k);
    for (i, pair) in all.iter().enumerate() {
        if i > 0 && all[i - 1] == *pair {
            *ranks_of.last_mut().expect("a key before") += 1;
        } else if ranks_of.len() == k {
            break;
        } else {
            ranks_of.push(1);
        }
    }
    if ranks_of.len() < k {
        // Fewer distinct keys than the sample size: every rank sent all of
        // its keys, and the sample is the union.
        return ranks_of.len() as f64;
    }
    entries as f64 * k as f64 / ranks_of.iter().sum::<usize>() as f64
}

/// This rank's spaced keys: `keys` (sorted, distinct) cut into up to `k`
/// blocks of equal length, each as (its first key, its length); padded
/// with (0, 0).
pub fn spaced(keys: &[i64], k: usize) -> Vec<(i64, u64)> {
    let (n, m) = (keys.len(), k.min(keys.len()));
    let mut out: Vec<(i64, u64)> = (0..m).map(|j| (keys[j * n / m], ((j + 1) * n / m - j * n / m) as u64)).collect();
    out.resize(k, (0, 0));
    out
}

/// W-1 non-decreasing key bounds splitting all ranks' entries (every
/// rank's [`spaced`] part together) into W ranges of about equal size:
/// rank i owns keys k with bounds[i-1] <= k < bounds[i]. Balancing entries
/// rather than distinct keys balances the owners' work: an owner merges
/// every entry in its range and receives the rest of the union, so its
/// share of distinct keys evens out. (Where popular keys cluster, a range
/// with an equal share of the union would hold most of the entries.)
pub fn balanced_bounds(parts: impl IntoIterator<Item = (i64, u64)>, world: usize) -> Vec<i64> {
    let mut samples: Vec<(i64, u64)> = parts.into_iter().filter(|(_, weight)| *weight > 0).collect();
    samples.sort_unstable();
    let total: u128 = samples.iter().map(|(_, weight)| u128::from(*weight)).sum();
    // `before`: the entries of the samples before the j-th (about those with
    // a smaller key: samples of equal keys, from different ranks, are taken
    // together). A range ends before the first key whose samples lie mostly
    // past its target (2 * (before + weight / 2) compared with 2 * target).
    let (mut before, mut j, w) = (0u128, 0usize, world as u128);
    (1..world)
        .map(|i| {
            while let Some(&(key, _)) = samples.get(j) {
                let same = samples[j..].iter().take_while(|(k, _)| *k == key);
                let (count, weight) = same.fold((0, 0u128), |(n, sum), (_, x)| (n + 1, sum + u128::from(*x)));
                if (2 * before + weight) * w >= 2 * total * i as u128 {
                    break;
                }
                before += weight;
                j += count;
            }
            samples.get(j).map_or(i64::MAX, |(key, _)| *key)
        })
        .collect()
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
    fn union_estimate() {
        let k = 256;
        let estimate =
            |parts: &[Vec<i64>], k: usize| union_size(parts.iter().flat_map(|p| local(p, k)), k, parts.iter().map(Vec::len).sum());
        // Four ranks with 3000 keys each, overlapping by half: 7500 distinct.
        let parts: Vec<Vec<i64>> = (0..4).map(|r| (r * 1500..r * 1500 + 3000).collect()).collect();
        let union = estimate(&parts, k);
        assert!((union - 7500.0).abs() < 7500.0 * 0.1, "{union}");
        // Heavy overlap at two ranks, 64 samples: 1000 keys shared, 40 of
        // each rank's own. Deciding between split and recursive doubling
        // needs the union within a few percent of one rank's keys.
        let heavy: Vec<Vec<i64>> = (0..2).map(|r| (0..1000).chain(10_000 * (r + 1)..10_000 * (r + 1) + 40).collect()).collect();
        let union = estimate(&heavy, 64);
        assert!((union - 1080.0).abs() < 1080.0 * 0.03, "{union}");
        // A small union is counted exactly; none at all is none.
        assert_eq!(estimate(&[vec![1i64, 5, 9], vec![5, 7]], k), 4.0);
        assert_eq!(estimate(&[vec![]], k), 0.0);
    }

    #[test]
    fn bounds_balance_entries() {
        let k = 64;
        // Entries per owner under `bounds`, over every rank's keys.
        let shares = |parts: &[Vec<i64>], bounds: &[i64]| {
            let mut share = vec![0usize; bounds.len() + 1];
            parts.iter().flatten().for_each(|key| share[owner(bounds, *key)] += 1);
            share
        };
        // Popular keys cluster low: every rank has 0..2000, and 1000 keys of
        // its own above. 12,000 entries: 3000 per owner at W=4, where equal
        // shares of the 6000 distinct keys would put 8000 entries in the
        // first two ranges.
        let parts: Vec<Vec<i64>> = (0..4).map(|r| (0..2000).chain(10_000 + r * 1000..11_000 + r * 1000).collect()).collect();
        let bounds = balanced_bounds(parts.iter().flat_map(|p| spaced(p, k)), 4);
        assert!(bounds.windows(2).all(|b| b[0] <= b[1]), "{bounds:?}");
        let share = shares(&parts, &bounds);
        assert!(share.iter().all(|s| (*s as f64 - 3000.0).abs() < 3000.0 * 0.1), "{share:?}");
        // Fewer keys than samples: every key counts exactly.
        let few = vec![vec![1i64, 5, 9], vec![5, 7]];
        let bounds = balanced_bounds(few.iter().flat_map(|p| spaced(p, k)), 2);
        assert_eq!(shares(&few, &bounds), vec![3, 2]);
        // No keys anywhere: every key belongs to rank 0.
        assert_eq!(owner(&balanced_bounds(spaced(&[], k), 3), 42), 0);
    }
}
