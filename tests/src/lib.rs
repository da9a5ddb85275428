//! Harness for multi-rank tests: ranks as threads of this process over real
//! sockets (fast), with an outer time limit so a hang fails the test.

pub mod plugins;
pub mod procs;
pub mod wrapped;

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;
use weft::store::{MemoryStore, Store};
use weft::{GroupOptions, ProcessGroup};

/// Outer limit for one multi-rank test body.
pub const OUTER_LIMIT: Duration = Duration::from_secs(120);

/// Options for test groups: the given backend spec and a short timeout.
pub fn options(spec: &str) -> GroupOptions {
    weft_builtin::link();
    GroupOptions::from_env().unwrap().backend(spec).timeout(Duration::from_secs(30))
}

/// Run `f(group)` on `w` ranks (threads) sharing an in-process store;
/// results in rank order. Panics if any rank panics or the whole run takes
/// longer than [`OUTER_LIMIT`].
pub fn run_threads<T: Send + 'static>(w: usize, opts: GroupOptions, f: impl Fn(ProcessGroup) -> T + Send + Sync + 'static) -> Vec<T> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(30)));
    run_threads_on(store, w, opts, f)
}

/// As [`run_threads`] with a given store.
pub fn run_threads_on<T: Send + 'static>(
    store: Arc<dyn Store>,
    w: usize,
    opts: GroupOptions,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + 'static,
) -> Vec<T> {
    run_threads_each(store, w, move |_| opts.clone(), f)
}

/// As [`run_threads_on`] with each rank's options from `opts(rank)`.
pub fn run_threads_each<T: Send + 'static>(
    store: Arc<dyn Store>,
    w: usize,
    opts: impl Fn(usize) -> GroupOptions,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let (tx, rx) = mpsc::channel();
    for rank in 0..w {
        let (store, opts, f, tx) = (store.clone(), opts(rank), f.clone(), tx.clone());
        std::thread::Builder::new()
            .name(format!("rank{rank}"))
            .spawn(move || {
                let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let pg = ProcessGroup::new(store, rank, w, opts).unwrap_or_else(|e| panic!("rank {rank}: group creation failed: {e}"));
                    f(pg)
                }));
                let _ = tx.send((rank, out));
            })
            .expect("spawn rank thread");
    }
    drop(tx);
    let mut results: Vec<Option<T>> = (0..w).map(|_| None).collect();
    let mut failures = Vec::new();
    let deadline = std::time::Instant::now() + OUTER_LIMIT;
    for _ in 0..w {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok((rank, Ok(v))) => results[rank] = Some(v),
            Ok((rank, Err(p))) => {
                let msg =
                    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                failures.push(format!("rank {rank} panicked: {msg}"));
            }
            Err(_) => {
                failures.push(format!("multi-rank test exceeded its outer limit of {OUTER_LIMIT:?} (hang?)"));
                break;
            }
        }
    }
    // Every rank's failure, in the order they happened: the first is usually the cause.
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    results.into_iter().map(|r| r.expect("every rank reported")).collect()
}

pub use weft_conformance::{assert_close, reference, Buf};
