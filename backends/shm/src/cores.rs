//! Where a group's ranks run: whether they outnumber the cores they may
//! run on (then a waiting rank yields at once instead of spinning: the
//! peer it waits for may need its core), and an order of the ranks in
//! which those bound to the same CPUs follow each other (`Capabilities::rank_order`).
//!
//! Every rank publishes the CPUs it may run on and its own parallelism
//! (which std caps by a cgroup CPU quota). The cores available to the
//! group are the union of the CPU sets, capped by a quota where one shows.
//! So four ranks on a 2-core machine are oversubscribed, while ranks
//! pinned one per core (as Slurm binds them) are not, although each sees
//! only one CPU.

use std::collections::BTreeSet;
use std::time::Duration;
use weft::store::Store;
use weft::{Error, Result};

/// What this process may use: its CPUs, and its parallelism if a quota
/// makes that smaller than their count.
fn local() -> (Vec<usize>, Option<usize>) {
    let cpus: Vec<usize> = match nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)) {
        Ok(set) => (0..nix::sched::CpuSet::count()).filter(|&i| set.is_set(i).unwrap_or(false)).collect(),
        Err(_) => Vec::new(),
    };
    let parallelism = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let quota = (cpus.is_empty() || parallelism < cpus.len()).then_some(parallelism);
    (cpus, quota)
}

fn encode((cpus, quota): &(Vec<usize>, Option<usize>)) -> String {
    let list: Vec<String> = cpus.iter().map(usize::to_string).collect();
    format!("{} {}", quota.map_or("-".to_string(), |q| q.to_string()), list.join(","))
}

fn decode(s: &str) -> Option<(Vec<usize>, Option<usize>)> {
    let (quota, list) = s.split_once(' ')?;
    let quota = if quota == "-" { None } else { Some(quota.parse().ok()?) };
    let cpus = list.split(',').filter(|c| !c.is_empty()).map(|c| c.parse().ok()).collect::<Option<Vec<usize>>>()?;
    Some((cpus, quota))
}

/// Cores the ranks described by `all` can run on at once.
fn capacity(all: &[(Vec<usize>, Option<usize>)]) -> usize {
    let union: BTreeSet<usize> = all.iter().flat_map(|(cpus, _)| cpus.iter().copied()).collect();
    let quota = all.iter().filter_map(|(_, q)| *q).min();
    union.len().min(quota.unwrap_or(usize::MAX)).max(1)
}

/// The ranks in the order of the CPUs they may run on (then by rank): ranks
/// bound to one CPU follow each other; ranks that all may run anywhere
/// (alike sets) stay in rank order.
fn by_cpus(all: &[(Vec<usize>, Option<usize>)]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..all.len()).collect();
    order.sort_by(|&a, &b| all[a].0.cmp(&all[b].0));
    order
}

/// Where a group's ranks run, the same on every rank.
pub struct Placement {
    /// The ranks outnumber the cores they share.
    pub oversubscribed: bool,
    /// Ranks bound to the same CPUs next to each other.
    pub order: Vec<usize>,
}

/// Collective over the group's store: where its `size` ranks run.
pub fn placement(store: &dyn Store, rank: usize, size: usize, timeout: Duration) -> Result<Placement> {
    let all = weft::store::all_gather(store, "cpus", rank, size, timeout, encode(&local()).as_bytes())?
        .iter()
        .enumerate()
        .map(|(r, raw)| {
            decode(&String::from_utf8_lossy(raw)).ok_or_else(|| Error::backend(format!("shm: rank {r} published a malformed CPU set")))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Placement { oversubscribed: size > capacity(&all), order: by_cpus(&all) })
}

/// The size of this CPU's level-2 cache (one core's, on current x86), from
/// sysfs; 1 MiB if it does not say.
pub fn l2_bytes() -> usize {
    let read = |i: usize, f: &str| std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index{i}/{f}")).ok();
    (0..8)
        .find(|i| read(*i, "level").as_deref().map(str::trim) == Some("2"))
        .and_then(|i| read(i, "size"))
        .and_then(|s| cache_size(&s))
        .unwrap_or(1 << 20)
}

/// Bytes in sysfs's cache size notation ("2048K").
fn cache_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: usize = num.parse().ok()?;
    let shift = match unit {
        "" => 0,
        "K" => 10,
        "M" => 20,
        _ => return None,
    };
    Some(n << shift).filter(|n| *n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_is_the_union_of_cpu_sets_capped_by_a_quota() {
        // Four unpinned ranks on a 2-core machine.
        let two = (vec![0, 1], None);
        assert_eq!(capacity(&[two.clone(), two.clone(), two.clone(), two]), 2);
        // Ranks pinned one per core: each sees one CPU, together four.
        let pinned: Vec<_> = (0..4).map(|c| (vec![c], None)).collect();
        assert_eq!(capacity(&pinned), 4);
        // A container allowed 64 CPUs but a quota of 2.
        let quota = (Vec::from_iter(0..64), Some(2));
        assert_eq!(capacity(&[quota.clone(), quota]), 2);
        // Round trip through the store's text.
        let me = local();
        assert_eq!(decode(&encode(&me)), Some(me.clone()));
        assert!(capacity(&[me]) >= 1);
        assert_eq!(decode("x 1"), None);
    }

    #[test]
    fn ranks_bound_to_one_cpu_follow_each_other() {
        // Eight ranks bound alternately to two CPUs (as `weft run` binds).
        let alternate: Vec<_> = (0..8).map(|r| (vec![r % 2], None)).collect();
        assert_eq!(by_cpus(&alternate), [0, 2, 4, 6, 1, 3, 5, 7]);
        // Unbound ranks, and ranks one per CPU in order: rank order.
        assert_eq!(by_cpus(&[(vec![0, 1], None), (vec![0, 1], None), (vec![0, 1], None)]), [0, 1, 2]);
        assert_eq!(by_cpus(&[(vec![0], None), (vec![1], None), (vec![2], None)]), [0, 1, 2]);
        // Bound in reverse.
        assert_eq!(by_cpus(&[(vec![3], None), (vec![2], None), (vec![1], None)]), [2, 1, 0]);
    }

    #[test]
    fn cache_sizes_parse() {
        assert_eq!(cache_size("2048K\n"), Some(2 << 20));
        assert_eq!(cache_size("1M"), Some(1 << 20));
        assert_eq!((cache_size("0K"), cache_size("12Q"), cache_size("")), (None, None, None));
        assert!(l2_bytes() >= 64 << 10);
    }
}
