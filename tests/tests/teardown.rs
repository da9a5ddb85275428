//! A rank that leaves never fails a slower peer, and a stuck peer does not
//! keep the others past the group's timeout. Ranks are processes under a
//! launcher-hosted store (see the worker's `straggler`, `stuck_at_exit`
//! and `late_receiver` scenarios), each run under an outer time limit.

use std::time::{Duration, Instant};
use weft_tests::procs::run_on_hosts;

const WORKER: &str = env!("CARGO_BIN_EXE_weft-test-worker");

/// Every kind of backend, with the hosts its 3 ranks count as on: the
/// transports, a wrapper over them (hierarchical: ranks 0 and 1 on one
/// host, rank 2 on another) and a plugin through the C ABI (cpu-tcp built
/// with the SDK).
const BACKENDS: [(&str, [&str; 3]); 4] = [
    ("cpu:cpu-tcp", ["a", "a", "a"]),
    ("cpu:shm", ["a", "a", "a"]),
    ("cpu:hierarchical", ["a", "a", "b"]),
    ("cpu:cpu-tcp-plugin", ["a", "a", "a"]),
];

/// Run `scenario` on each of [`BACKENDS`] with the group timeout
/// `timeout_s`; `check(backend, ends, start)` judges each run.
fn on_every_backend(scenario: &str, timeout_s: &str, check: impl Fn(&str, &[weft_tests::procs::RankEnd], Instant)) {
    let plugin = weft_tests::plugins::example_lib("cpu_tcp_plugin");
    for (backend, hosts) in BACKENDS {
        let env = [("WEFT_BACKEND", backend), ("WEFT_TIMEOUT_SECONDS", timeout_s), ("WEFT_PLUGIN_PATH", plugin.to_str().unwrap())];
        let start = Instant::now();
        let ends = run_on_hosts(WORKER, &hosts, &[scenario], &env, Duration::from_secs(120));
        check(backend, &ends, start);
    }
}

#[test]
fn a_straggler_stopped_while_the_others_leave_finishes_with_exact_data() {
    // Stopped for 6 s, longer than any fixed grace a leaving rank gave.
    on_every_backend("straggler", "30", |backend, ends, _| {
        let served = format!("done on {}", &backend[4..]);
        for (r, e) in ends.iter().enumerate() {
            assert!(e.status.success(), "{backend} rank {r}: {:?}\n{}", e.status, e.output);
            assert!(e.output.contains(&served), "{backend} rank {r} ran elsewhere:\n{}", e.output);
        }
    });
}

#[test]
fn a_peer_stuck_at_exit_keeps_the_others_at_most_the_timeout() {
    on_every_backend("stuck_at_exit", "3", |backend, ends, start| {
        for (r, e) in ends[..2].iter().enumerate() {
            assert!(e.status.success(), "{backend} rank {r}: {:?}\n{}", e.status, e.output);
            // Setup, the ops, then at most the timeout waiting for rank 2
            // (stopped until it is killed, 12 s after it stopped).
            let took = e.at - start;
            assert!(took < Duration::from_secs(10), "{backend} rank {r} left after {took:?}\n{}", e.output);
            // Every connection's closer names rank 2, by its rank in the
            // group (hierarchical's inner groups number ranks their own
            // way). shm waits for nobody: what it sent stays in segments
            // the stopped rank still maps.
            let named: Vec<&str> = e.output.lines().filter(|l| l.contains("did not close")).collect();
            assert!(
                named.iter().all(|l| l.contains("peer rank(s) [2] did not close")),
                "{backend} rank {r} names another rank:\n{}",
                e.output
            );
            assert!(backend == "cpu:shm" || !named.is_empty(), "{backend} rank {r} does not name rank 2:\n{}", e.output);
        }
    });
}

#[test]
fn a_rank_paused_between_its_goodbyes_never_fails_a_peer_still_receiving() {
    // Every goodbye written is followed by a 500 ms pause (an LD_PRELOAD
    // shim), as when the scheduler takes a leaving rank's core between two
    // goodbyes: at W = 256 on 2 cores, leaving ranks lost 200 ms and more
    // there. Rank 0 leaves while the last rank still waits in a receive
    // from rank 1; that wait must meet a goodbye from rank 0, never a bare
    // end of its stream, however long rank 0 took to say it.
    let dir = weft_tests::plugins::scratch("pause-after-goodbye");
    let shim = dir.join("pause_after_goodbye.so");
    weft_tests::plugins::cc(&weft_tests::plugins::repo().join("tests/shims/pause_after_goodbye.c"), &shim, &[]);
    let shim = shim.to_str().unwrap();
    let plugin = weft_tests::plugins::example_lib("cpu_tcp_plugin");
    for (backend, hosts) in BACKENDS {
        let env = [
            ("WEFT_BACKEND", backend),
            ("WEFT_PLUGIN_PATH", plugin.to_str().unwrap()),
            ("LD_PRELOAD", shim),
            ("PAUSE_AFTER_GOODBYE_MS", "500"),
        ];
        let ends = run_on_hosts(WORKER, &hosts, &["late_receiver"], &env, Duration::from_secs(120));
        let served = format!("done on {}", &backend[4..]);
        for (r, e) in ends.iter().enumerate() {
            assert!(e.status.success(), "{backend} rank {r}: {:?}\n{}", e.status, e.output);
            assert!(e.output.contains(&served), "{backend} rank {r} ran elsewhere:\n{}", e.output);
        }
    }
}
