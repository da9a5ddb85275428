//! Ranks as real processes, initialised from the environment like a
//! launched job.

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;
use weft_tests::procs::run_world;

const WORKER: &str = env!("CARGO_BIN_EXE_weft-test-worker");

fn assert_all_ok(ends: &[weft_tests::procs::RankEnd]) {
    for (r, e) in ends.iter().enumerate() {
        assert!(e.status.success(), "rank {r} failed: {:?}\n{}", e.status, e.output);
    }
}

#[test]
fn ops_across_processes_at_several_world_sizes() {
    for n in [1, 2, 3, 5] {
        assert_all_ok(&run_world(WORKER, n, &["ops"], &[], Duration::from_secs(60)));
    }
}

#[test]
fn sigkill_mid_all_reduce_gives_peer_lost_on_every_other_rank_within_10s() {
    for n in [2, 4] {
        let ends = run_world(WORKER, n, &["sigkill"], &[], Duration::from_secs(90));
        let victim = &ends[n - 1];
        assert_eq!(victim.status.signal(), Some(9), "the victim was killed: {}", victim.output);
        for (r, e) in ends[..n - 1].iter().enumerate() {
            assert!(e.status.success(), "rank {r}: {:?}\n{}", e.status, e.output);
            let after = e.at.saturating_duration_since(victim.at);
            assert!(after < Duration::from_secs(10), "rank {r} reported {after:?} after the kill");
            assert!(e.output.contains(&format!("peer rank {} lost", n - 1)), "{}", e.output);
        }
    }
}

#[test]
fn weft_debug_detail_names_the_mismatched_rank_across_processes() {
    assert_all_ok(&run_world(WORKER, 3, &["debug_mismatch"], &[("WEFT_DEBUG", "detail")], Duration::from_secs(60)));
}
