//! What ranks learn about each other's keys before moving any rows, from a
//! few kilobytes per rank in the header:
//! - a hash sample (every key whose hash lies below a threshold, at most k
//!   keys): below the lowest rank's threshold every rank's sample is
//!   complete, so all ranks see the same uniform sample of the union, and
//!   from it an estimate of the union's size (from on how many ranks the
//!   sampled keys lie), for choosing an algorithm;
//! - evenly spaced keys of every rank's sorted keys, each weighted by the
//!   entries it stands for: key ranges holding equal shares of all ranks'
//!   entries (for `split`, whose owners each merge one range).
//!
//! Hashing runs once per key while planning; merges never hash.

use super::coalesce::{distinct, RunRef};
use std::borrow::Cow;

/// Keys per rank in the hash sample: the union estimate is within about
/// 1/sqrt(k) (far tighter where indices overlap heavily, see
/// [`union_size`]); more ranks add samples of their own.
pub fn sketch_size(world: usize) -> usize {
    (32 * world).clamp(64, 256)
}

/// Spaced keys per rank: a range bound can be off by one block of every
/// rank's keys (n / k entries each), so k grows with W to keep that a
/// small part of a range (n entries over all ranks): W / k of it.
pub fn spaced_size(world: usize) -> usize {
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

/// This rank's part of the sketch: the threshold (inclusive) and every key
/// of `keys` (sorted, distinct) whose hash lies at or below it, in key
/// order: all keys if there are at most `k`; else about 3/4 k of them,
/// lowered to the k smallest hashes when more pass (a few percent of
/// calls). Why a threshold rather than exactly the k smallest hashes: no
/// selection, and the sample stays in key order, so [`union_size`] merges
/// the parts instead of sorting hashes (whose mispredicted branches cost 3
/// us for 128 hashes, as much as a 100-row all-reduce's planning is worth).
pub fn local(keys: &[i64], k: usize) -> (u64, Vec<i64>) {
    let n = keys.len();
    if n <= k {
        return (u64::MAX, keys.to_vec());
    }
    let mut threshold = u64::MAX / n as u64 * (3 * k / 4) as u64;
    let mut sample: Vec<i64> = keys.iter().copied().filter(|key| hash(*key) <= threshold).collect();
    if sample.len() > k {
        // The hash is a bijection: the k smallest hashes are distinct.
        let mut hashes: Vec<u64> = sample.iter().map(|key| hash(*key)).collect();
        threshold = *hashes.select_nth_unstable(k).1 - 1;
        sample.retain(|key| hash(*key) <= threshold);
    }
    (threshold, sample)
}

/// The estimated number of distinct keys over all ranks, from every rank's
/// [`local`] part and the ranks' key counts together (`entries`); the same
/// on every rank. Below the lowest threshold every rank's part is complete,
/// so the keys there are a uniform sample of the union in which each key
/// shows on every rank that holds it: the union is `entries` times the
/// sample's distinct keys over its entries. Where indices overlap heavily,
/// which is where `auto` must judge finely, this is far tighter than what
/// the sample's size alone says (about 1/sqrt(k) off).
pub fn union_size(parts: &[(u64, &[i64])], entries: usize) -> f64 {
    let threshold = parts.iter().map(|p| p.0).min().unwrap_or(u64::MAX);
    // A part whose own threshold is the lowest lies below it whole: no
    // hashing there (every part, where all thresholds are alike).
    let below: Vec<Cow<'_, [i64]>> = parts
        .iter()
        .map(|(own, keys)| {
            if *own == threshold {
                Cow::Borrowed(*keys)
            } else {
                Cow::Owned(keys.iter().copied().filter(|key| hash(*key) <= threshold).collect())
            }
        })
        .collect();
    let runs: Vec<RunRef<'_>> = below.iter().map(|keys| RunRef::packed(keys, &[])).collect();
    let (distinct, sampled) = (distinct(&runs) as f64, below.iter().map(|keys| keys.len()).sum::<usize>() as f64);
    if threshold == u64::MAX {
        // Every rank sent all of its keys: the sample is the union.
        distinct
    } else if sampled == 0.0 {
        // Nothing below the lowest threshold (not to be expected): no overlap seen.
        entries as f64
    } else {
        entries as f64 * distinct / sampled
    }
}

/// This rank's spaced keys, into `out` (its length is how many): `keys`
/// (sorted, distinct) cut into up to that many blocks of equal length,
/// the first key of each; the rest of `out` is 0. What each stands for
/// follows from the rank's key count ([`weighted`]), which every rank
/// knows from the header: the spaced keys travel alone.
pub fn spaced_into(keys: &[i64], out: &mut [i64]) {
    out.fill(0);
    let k = out.len();
    for (o, (start, _)) in out.iter_mut().zip(blocks(keys.len(), k)) {
        *o = keys[start];
    }
}

/// A rank's [`spaced_into`] keys (`k` of them, for its `n` keys), each with the
/// length of its block; padding left out.
pub fn weighted(spaced: impl IntoIterator<Item = i64>, n: usize, k: usize) -> impl Iterator<Item = (i64, u64)> {
    spaced.into_iter().zip(blocks(n, k)).map(|(key, (_, len))| (key, len as u64))
}

/// `n` entries cut into `m = min(k, n)` blocks of equal length (block j
/// starts at `j * n / m`), as (start, length), with one division in all:
/// every rank cuts every rank's blocks, and a division per block measured
/// about a microsecond of `auto`'s planning at W=2 (0.1 % density).
fn blocks(n: usize, k: usize) -> impl Iterator<Item = (usize, usize)> {
    let m = k.min(n);
    let (q, r) = (n.checked_div(m).unwrap_or(0), n.checked_rem(m).unwrap_or(0));
    // `rest` = j * r mod m: block j is one longer when it wraps.
    let (mut start, mut rest) = (0, 0);
    (0..m).map(move |_| {
        rest += r;
        let len = q + usize::from(rest >= m);
        if rest >= m {
            rest -= m;
        }
        start += len;
        (start - len, len)
    })
}

/// W-1 non-decreasing key bounds splitting all ranks' entries (every
/// rank's [`weighted`] spaced keys together) into W ranges of about equal
/// size: rank i owns keys k with `bounds[i-1] <= k < bounds[i]`. Balancing entries
/// rather than distinct keys balances the owners' work: an owner merges
/// every entry in its range and receives the rest of the union, so its
/// share of distinct keys evens out. (Where popular keys cluster, a range
/// with an equal share of the union would hold most of the entries.)
pub fn balanced_bounds(parts: impl IntoIterator<Item = (i64, u64)>, world: usize) -> Vec<i64> {
    let mut samples: Vec<(i64, u64)> = parts.into_iter().filter(|(_, weight)| *weight > 0).collect();
    // The samples come as W sorted runs (one per rank), which the stable
    // sort finds and merges (faster than the unstable sort here; figures:
    // bench/RESULTS.md, "Measurements behind code comments").
    samples.sort();
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

    /// `keys`' `k` spaced keys ([`spaced_into`]).
    fn spaced(keys: &[i64], k: usize) -> Vec<i64> {
        let mut out = vec![7; k];
        spaced_into(keys, &mut out);
        out
    }

    /// Which rank owns `key` under `bounds`.
    fn owner(bounds: &[i64], key: i64) -> usize {
        bounds.partition_point(|b| *b <= key)
    }

    #[test]
    fn local_part_is_every_key_below_its_threshold() {
        let k = 64;
        for n in [0, 10, 64, 65, 256, 5000, 100_000] {
            let keys: Vec<i64> = (0..n).map(|i| i * 7919).collect();
            let (threshold, sample) = local(&keys, k);
            let want: Vec<i64> = keys.iter().copied().filter(|key| hash(*key) <= threshold).collect();
            assert_eq!(sample, want, "n = {n}: every key at or below the threshold, in key order");
            if n as usize <= k {
                assert_eq!((threshold, sample.len()), (u64::MAX, n as usize));
            } else {
                assert!(sample.len() <= k && sample.len() >= k / 3, "n = {n}: {} keys", sample.len());
            }
        }
        // Far more keys below the first threshold than k (hashes crowded
        // low): the threshold drops to the k smallest.
        let low: Vec<i64> = (0..).filter(|key| hash(*key) < u64::MAX / 1000).take(1000).collect();
        let (threshold, sample) = local(&low, k);
        let mut hashes: Vec<u64> = low.iter().map(|key| hash(*key)).collect();
        hashes.sort_unstable();
        assert_eq!((threshold, sample.len()), (hashes[k] - 1, k));
    }

    #[test]
    fn union_estimate() {
        let k = 256;
        let estimate = |ranks: &[Vec<i64>], k: usize| {
            let sampled: Vec<(u64, Vec<i64>)> = ranks.iter().map(|keys| local(keys, k)).collect();
            let parts: Vec<(u64, &[i64])> = sampled.iter().map(|(t, keys)| (*t, &keys[..])).collect();
            union_size(&parts, ranks.iter().map(Vec::len).sum())
        };
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
    fn blocks_cut_where_the_division_does() {
        for (n, k) in [(0, 4), (3, 64), (64, 64), (65, 64), (1000, 64), (1001, 7), (52_500, 1024)] {
            let m = k.min(n);
            let want: Vec<(usize, usize)> = (0..m).map(|j| (j * n / m, (j + 1) * n / m - j * n / m)).collect();
            assert_eq!(blocks(n, k).collect::<Vec<_>>(), want, "n = {n}, k = {k}");
        }
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
        let bounds = balanced_bounds(parts.iter().flat_map(|p| weighted(spaced(p, k), p.len(), k)), 4);
        assert!(bounds.windows(2).all(|b| b[0] <= b[1]), "{bounds:?}");
        let share = shares(&parts, &bounds);
        assert!(share.iter().all(|s| (*s as f64 - 3000.0).abs() < 3000.0 * 0.1), "{share:?}");
        // Fewer keys than samples: every key counts exactly.
        let few = vec![vec![1i64, 5, 9], vec![5, 7]];
        let bounds = balanced_bounds(few.iter().flat_map(|p| weighted(spaced(p, k), p.len(), k)), 2);
        assert_eq!(shares(&few, &bounds), vec![3, 2]);
        // No keys anywhere: every key belongs to rank 0.
        assert_eq!(owner(&balanced_bounds(weighted(spaced(&[], k), 0, k), 3), 42), 0);
    }
}
