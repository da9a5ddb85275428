//! Groups spanning "hosts" (ranks given different `WEFT_HOST_ID`s): `auto`
//! picks the hierarchical backend when some host has several ranks and
//! cpu-tcp when none does; every op passes conformance; a killed rank is
//! named by every other rank, on both hosts.

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;
use weft_tests::procs::{run_on_hosts, RankEnd};

/// Run the worker `scenario` with rank r on host `hosts[r]`; the store is
/// hosted here, as `weft run` hosts it.
fn on_hosts(hosts: &[&str], scenario: &str, limit: Duration) -> Vec<RankEnd> {
    run_on_hosts(env!("CARGO_BIN_EXE_weft-test-worker"), hosts, &[scenario], &[], limit)
}

#[test]
fn auto_picks_hierarchical_across_hosts_with_several_ranks_each() {
    for e in on_hosts(&["a", "a", "b", "b"], "which_backend", Duration::from_secs(60)) {
        assert!(e.status.success() && e.output.contains("backend=hierarchical"), "{}", e.output);
    }
    // One rank per host: nothing to share locally, plain cpu-tcp.
    for e in on_hosts(&["a", "b", "c"], "which_backend", Duration::from_secs(60)) {
        assert!(e.status.success() && e.output.contains("backend=cpu-tcp"), "{}", e.output);
    }
}

#[test]
fn hierarchical_passes_conformance() {
    for hosts in [&["a", "a", "b", "b"][..], &["a", "b", "b", "a", "b"][..]] {
        for (r, e) in on_hosts(hosts, "conformance", Duration::from_secs(120)).iter().enumerate() {
            assert!(e.status.success(), "hosts {hosts:?}, rank {r}:\n{}", e.output);
        }
    }
}

#[test]
fn hierarchical_windows_pass_their_cases() {
    for hosts in [&["a", "a", "b"][..], &["a", "b", "b", "a"][..]] {
        for (r, e) in on_hosts(hosts, "windows", Duration::from_secs(120)).iter().enumerate() {
            assert!(e.status.success() && e.output.contains("hierarchical"), "hosts {hosts:?}, rank {r}:\n{}", e.output);
        }
    }
}

#[test]
fn hierarchical_point_to_point_progresses_together() {
    for hosts in [&["a", "a", "b"][..], &["a", "a", "b", "b"][..], &["a", "b", "b", "a", "b"][..]] {
        for (r, e) in on_hosts(hosts, "p2p", Duration::from_secs(120)).iter().enumerate() {
            assert!(e.status.success() && e.output.contains("hierarchical"), "hosts {hosts:?}, rank {r}:\n{}", e.output);
        }
    }
}

#[test]
fn hierarchical_all_reduce_of_large_buffers() {
    // The worker's "ops" scenario checks all_reduce, all_gather and broadcast.
    for (r, e) in on_hosts(&["a", "a", "a", "b", "b"], "ops", Duration::from_secs(60)).iter().enumerate() {
        assert!(e.status.success(), "rank {r}:\n{}", e.output);
    }
}

#[test]
fn hierarchical_all_reduce_through_every_hinted_path() {
    for hosts in [&["a", "a", "b", "b"][..], &["a", "a", "a", "b"][..]] {
        for (r, e) in on_hosts(hosts, "all_reduce_hints", Duration::from_secs(60)).iter().enumerate() {
            assert!(e.status.success(), "hosts {hosts:?}, rank {r}:\n{}", e.output);
        }
    }
}

#[test]
fn a_killed_rank_is_named_on_both_hosts() {
    let ends = on_hosts(&["a", "a", "b", "b"], "sigkill", Duration::from_secs(90));
    assert_eq!(ends[3].status.signal(), Some(9), "{}", ends[3].output);
    for (r, e) in ends[..3].iter().enumerate() {
        assert!(e.status.success(), "rank {r}:\n{}", e.output);
        assert!(e.at.saturating_duration_since(ends[3].at) < Duration::from_secs(15), "rank {r} was late");
    }
}
