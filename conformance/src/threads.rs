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
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(60)));
    let opts = GroupOptions::default().backend(spec).timeout(Duration::from_secs(60));
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..w)
            .map(|rank| {
                let (store, opts) = (store.clone(), opts.clone());
                s.spawn(move || {
                    let pg = ProcessGroup::new(store, rank, w, opts).unwrap_or_else(|e| panic!("{spec} rank {rank}: {e}"));
                    let served = pg.backend_name((weft::DeviceKind::Cpu, weft::Layout::Dense));
                    assert_eq!(served.as_deref(), Some(spec), "{spec} rank {rank}: the group's backend");
                    suite(&pg)
                })
            })
            .collect();
        for (rank, r) in ranks.into_iter().enumerate() {
            let (table, ok) = summary(&r.join().unwrap_or_else(|_| panic!("{spec} W={w} rank {rank} panicked")));
            assert!(ok, "{spec} W={w} rank {rank}:\n{table}");
        }
    });
}
