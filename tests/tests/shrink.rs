//! Keeping going when ranks die: revoke, shrink to the survivors, agree.
//! Ranks are processes under a launcher-hosted store (as `weft run` runs
//! them); one or two die (SIGKILL), stop (SIGSTOP) or nobody dies and rank
//! 0 revokes, mid all_reduce; the survivors shrink, run the conformance
//! suite on the new group and agree on a value (see the worker's `shrink`
//! scenario).

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;
use weft_tests::procs::{run_on_hosts, run_world, shm_segments, RankEnd};

const WORKER: &str = env!("CARGO_BIN_EXE_weft-test-worker");

fn world(backend: &str, n: usize, env: &[(&str, &str)]) -> Vec<RankEnd> {
    let mut env = env.to_vec();
    env.push(("WEFT_BACKEND", backend));
    run_world(WORKER, n, &["shrink"], &env, Duration::from_secs(120))
}

/// Every survivor succeeded and reports the survivor count; the victims
/// were killed; nothing is left in /dev/shm.
fn check(ends: &[RankEnd], victims: &[usize], what: &str) {
    let survivors = ends.len() - victims.len();
    for (r, e) in ends.iter().enumerate() {
        if victims.contains(&r) {
            assert_eq!(e.status.signal(), Some(9), "{what}: victim {r}:\n{}", e.output);
        } else {
            assert!(e.status.success(), "{what}: rank {r}: {:?}\n{}", e.status, e.output);
            assert!(e.output.contains(&format!("{survivors} survivors ok")), "{what}: rank {r}:\n{}", e.output);
        }
    }
    let stale = shm_segments();
    assert!(stale.is_empty(), "{what}: left in /dev/shm: {stale:?}");
}

#[test]
fn survivors_of_a_killed_rank_shrink_and_pass_conformance_at_w_3_4_5() {
    for backend in ["cpu-tcp", "cpu:shm"] {
        for n in [3, 4, 5] {
            // The victim in the middle of the ranks (not the first, not the last).
            let victim = n / 2;
            let v = victim.to_string();
            let ends = world(backend, n, &[("WEFT_TEST_VICTIMS", &v)]);
            check(&ends, &[victim], &format!("{backend} W={n}"));
        }
    }
}

#[test]
fn the_hierarchical_backend_shrinks_too() {
    // Two "hosts" of two ranks; one rank of the first dies.
    let ends = run_on_hosts(WORKER, &["a", "a", "b", "b"], &["shrink"], &[("WEFT_TEST_VICTIMS", "1")], Duration::from_secs(120));
    check(&ends, &[1], "hierarchical");
    assert!(ends[0].output.contains("backend=hierarchical"), "{}", ends[0].output);
}

#[test]
fn shrink_can_leave_out_live_ranks_who_are_told_so() {
    let ends = world("cpu-tcp", 4, &[("WEFT_TEST_HOW", "exclude"), ("WEFT_TEST_VICTIMS", "0,2")]);
    for (r, e) in ends.iter().enumerate() {
        assert!(e.status.success(), "rank {r}:\n{}", e.output);
        let want = if r % 2 == 0 { "excluded" } else { "2 survivors ok" };
        assert!(e.output.contains(want), "rank {r}:\n{}", e.output);
    }
}

#[test]
fn two_ranks_die_one_after_the_other_and_the_group_shrinks_twice() {
    for backend in ["cpu-tcp", "cpu:shm"] {
        let ends = world(backend, 5, &[("WEFT_TEST_VICTIMS", "3,0")]);
        check(&ends, &[3, 0], backend);
    }
}

#[test]
fn a_stopped_rank_is_left_out_after_the_wait_and_told_so_when_it_resumes() {
    for backend in ["cpu-tcp", "cpu:shm"] {
        let ends = world(backend, 3, &[("WEFT_TEST_HOW", "stop"), ("WEFT_TEST_VICTIMS", "1"), ("WEFT_TIMEOUT_SECONDS", "2")]);
        assert!(ends[1].status.success(), "{backend}: the resumed rank:\n{}", ends[1].output);
        assert!(ends[1].output.contains("left out after resuming"), "{backend}:\n{}", ends[1].output);
        for r in [0, 2] {
            assert!(ends[r].status.success(), "{backend}: rank {r}:\n{}", ends[r].output);
            assert!(ends[r].output.contains("2 survivors ok"), "{backend}: rank {r}:\n{}", ends[r].output);
        }
        // Each survivor blamed a peer, not itself (the worker checks; which
        // peer depends on who timed out first: the stopped rank, or one
        // waiting for it).
        assert!(ends.iter().all(|e| e.output.contains("left out") || e.output.contains("blames rank")), "{backend}: {ends:?}");
    }
}

#[test]
fn a_revoked_group_fails_with_aborted_everywhere_and_shrinks_to_everyone() {
    for backend in ["cpu-tcp", "cpu:shm"] {
        let ends = world(backend, 4, &[("WEFT_TEST_HOW", "revoke"), ("WEFT_TEST_VICTIMS", "0")]);
        for (r, e) in ends.iter().enumerate() {
            assert!(e.status.success(), "{backend}: rank {r}:\n{}", e.output);
            assert!(e.output.contains("4 survivors ok"), "{backend}: rank {r}:\n{}", e.output);
        }
    }
}

#[test]
fn the_shrunk_group_serves_cuda_tensors_too() {
    // The emulated GPU: cuda-device (and shm for the CPU), then host
    // staging over cpu-tcp, in the new group.
    for spec in ["auto", "cpu:cpu-tcp,cuda:cuda-host-staging"] {
        let ends = world(spec, 3, &[("WEFT_TEST_CUDA", "1"), ("WEFT_CUDA_EMULATION", "1"), ("WEFT_TEST_VICTIMS", "2")]);
        check(&ends, &[2], spec);
    }
}
