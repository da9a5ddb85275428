//! Run a suite on a world of threads: what each backend crate's own
//! `cargo test` does (`tests/conformance.rs`), with its backend linked.

use crate::{summary, Check};
use std::sync::Arc;
use std::time::Duration;
use weft::store::{MemoryStore, Store};
use weft::{GroupOptions, ProcessGroup};

/// Run `suite` on `w` ranks that are threads of this process, in a group
/// of backend `spec` (which must be linked) over an in-process store;
/// panics with the failing checks' table (or a rank's panic) if any rank
/// has a failing check. Each rank's group must be served by `spec` for
/// dense CPU tensors.
pub fn on_threads(spec: &str, w: usize, suite: fn(&ProcessGroup) -> Vec<Check>) {
    let opts = GroupOptions::default().backend(spec).timeout(Duration::from_secs(60));
    let results = checks_on_threads(opts, w, |pg| {
        let served = pg.backend_name((weft::DeviceKind::Cpu, weft::Layout::Dense));
        assert_eq!(served.as_deref(), Some(spec), "{spec} rank {}: the group's backend", pg.rank());
        suite(pg)
    });
    assert_passed(&results, &format!("{spec} W={w}"));
}

/// Panic, with every failing rank's table, unless every rank's checks of
/// `results` (by rank) passed; `label` says which run.
pub fn assert_passed(results: &[Vec<Check>], label: &str) {
    // Every failing rank's table: the first rank's failure is often a
    // consequence of another's (a barrier that rank never joined).
    let failed: Vec<String> = results
        .iter()
        .enumerate()
        .filter_map(|(rank, checks)| {
            let (table, ok) = summary(checks);
            (!ok).then(|| format!("{label}, rank {rank}:\n{table}"))
        })
        .collect();
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// `suite`'s checks on `w` ranks that are threads of this process, in
/// groups made with `opts` over an in-process store, by rank (a rank that
/// panics panics here).
pub fn checks_on_threads(opts: GroupOptions, w: usize, suite: impl Fn(&ProcessGroup) -> Vec<Check> + Sync) -> Vec<Vec<Check>> {
    checks_on_threads_each(|_| opts.clone(), w, suite)
}

/// As [`checks_on_threads`], rank r's group made with `opts(r)` (a hint of
/// its own, such as the host it emulates: `host_id`).
pub fn checks_on_threads_each(
    opts: impl Fn(usize) -> GroupOptions,
    w: usize,
    suite: impl Fn(&ProcessGroup) -> Vec<Check> + Sync,
) -> Vec<Vec<Check>> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(60)));
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..w)
            .map(|rank| {
                let (store, opts, suite) = (store.clone(), opts(rank), &suite);
                s.spawn(move || {
                    let pg = ProcessGroup::new(store, rank, w, opts).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                    suite(&pg)
                })
            })
            .collect();
        ranks.into_iter().enumerate().map(|(rank, r)| r.join().unwrap_or_else(|_| panic!("W={w} rank {rank} panicked"))).collect()
    })
}

/// The conformance tests of one backend crate (its `tests/conformance.rs`):
/// the suite at W = 1 to `max_w`, the point-to-point patterns and the
/// window cases at W = 2 to `max_w`, on threads of the test, after `link`
/// (the crate's registration).
///
/// ```ignore
/// weft_conformance::backend_tests!("shm", weft_shm::link, 4);
/// ```
#[macro_export]
macro_rules! backend_tests {
    ($spec:expr, $link:path, $max_w:expr) => {
        #[test]
        fn passes_the_conformance_suite() {
            $link();
            for w in 1..=$max_w {
                $crate::on_threads($spec, w, |pg| $crate::run(pg, 33));
            }
        }

        #[test]
        fn point_to_point_progresses_together() {
            $link();
            for w in 2..=$max_w {
                $crate::on_threads($spec, w, |pg| $crate::run_p2p(pg, None, 16 << 20));
            }
        }

        #[test]
        fn windows_pass_their_cases() {
            $link();
            for w in 2..=$max_w {
                $crate::on_threads($spec, w, |pg| $crate::run_windows(pg, 1 << 20));
            }
        }
    };
}
