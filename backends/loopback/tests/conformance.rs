//! The conformance suite, point-to-point patterns and windows on
//! `loopback`, at W = 1 to 5 (ranks as threads of this test).

use std::sync::Arc;
use std::time::Duration;
use weft::store::{MemoryStore, Store};
use weft::{GroupOptions, ProcessGroup};
use weft_conformance::{summary, Check};

/// `suite` on `w` threads of one loopback world; every check passes.
fn world(w: usize, suite: fn(&ProcessGroup) -> Vec<Check>) {
    weft_loopback::link();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(30)));
    let opts = GroupOptions::default().backend("loopback").timeout(Duration::from_secs(30));
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..w)
            .map(|rank| {
                let (store, opts) = (store.clone(), opts.clone());
                s.spawn(move || {
                    let pg = ProcessGroup::new(store, rank, w, opts).expect("a loopback group");
                    assert_eq!(pg.backend_name((weft::DeviceKind::Cpu, weft::Layout::Dense)).as_deref(), Some("loopback"));
                    suite(&pg)
                })
            })
            .collect();
        for (rank, r) in ranks.into_iter().enumerate() {
            let (table, ok) = summary(&r.join().expect("no panic"));
            assert!(ok, "W={w} rank {rank}:\n{table}");
        }
    });
}

#[test]
fn passes_the_conformance_suite() {
    for w in 1..=5 {
        world(w, |pg| weft_conformance::run(pg, 33));
    }
}

#[test]
fn point_to_point_progresses_together() {
    for w in 2..=5 {
        world(w, |pg| weft_conformance::run_p2p(pg, None, 16 << 20));
    }
}

#[test]
fn windows_pass_their_cases() {
    for w in 2..=4 {
        world(w, |pg| weft_conformance::run_windows(pg, 1 << 20));
    }
}
