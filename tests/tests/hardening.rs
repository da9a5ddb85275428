//! What a misbehaving peer or stranger must not be able to do to a rank:
//! make it keep unbounded memory, leave segments behind when setup is
//! killed. Ranks are processes under a launcher-hosted store, each run
//! under an outer time limit.

use std::time::Duration;
use weft_tests::procs::run_world;

const WORKER: &str = env!("CARGO_BIN_EXE_weft-test-worker");

#[test]
fn a_flooded_rank_keeps_at_most_its_budget_and_still_receives_everything() {
    // 250 MiB of early messages against a 32 MiB budget (see the worker's
    // `flood` scenario); without the budget the peak grew by 250 MiB.
    let budget = (32 << 20).to_string();
    for backend in ["cpu:cpu-tcp", "cpu:shm"] {
        let env = [("WEFT_BACKEND", backend), ("WEFT_EARLY_BYTES", budget.as_str()), ("WEFT_TIMEOUT_SECONDS", "60")];
        let ends = run_world(WORKER, 3, &["flood"], &env, Duration::from_secs(120));
        for (r, e) in ends.iter().enumerate() {
            assert!(e.status.success(), "{backend} rank {r}: {:?}\n{}", e.status, e.output);
        }
        assert!(ends[0].output.contains("peak RSS grew by"), "{}", ends[0].output);
    }
}
