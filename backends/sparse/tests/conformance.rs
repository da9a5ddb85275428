//! The conformance suite with `sparse` serving sparse tensors, over shm and
//! over cpu-tcp (`auto` per layout, or each named), at W up to 4: ranks as
//! threads of this test. The sparse family runs only where a group has a
//! sparse backend, so it is checked to have run.

use weft_conformance::{assert_passed, checks_on_threads, run, run_family, Family};

fn link() {
    weft_shm::link();
    weft_cpu_tcp::link();
    weft_sparse::link();
}

#[test]
fn passes_the_conformance_suite_sparse_family_included() {
    link();
    for dense in ["shm", "cpu-tcp"] {
        for w in 1..=4 {
            let opts = weft::GroupOptions::default().backend("auto").timeout(std::time::Duration::from_secs(60));
            let opts = if dense == "cpu-tcp" { opts.backend("cpu:cpu-tcp") } else { opts };
            let results = checks_on_threads(opts, w, |pg| {
                let sparse = pg.backend_name((weft::DeviceKind::Cpu, weft::Layout::SparseCoo));
                assert_eq!(sparse.as_deref(), Some("sparse"), "rank {}: the group's sparse backend", pg.rank());
                run(pg, 9)
            });
            assert_passed(&results, &format!("over {dense}, W={w}"));
            for checks in &results {
                assert!(checks.iter().any(|c| c.op == "all_reduce_sparse"), "over {dense}, W={w}: the sparse case ran");
            }
        }
    }
}

#[test]
fn the_sparse_family_runs_alone() {
    link();
    let opts = weft::GroupOptions::default().backend("auto").timeout(std::time::Duration::from_secs(60));
    for checks in checks_on_threads(opts, 3, |pg| run_family(pg, Family::AllReduceSparse, 9, None)) {
        assert!(checks.len() == 1 && checks[0].passed, "{checks:?}");
    }
}
