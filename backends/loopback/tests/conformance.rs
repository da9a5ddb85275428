//! The conformance suite, point-to-point patterns and windows on
//! `loopback`, at W up to 5 (ranks as threads of this test, handing messages between them).

weft_conformance::backend_tests!("loopback", weft_loopback::link, 5);

/// One family failing (here those that run broadcast, reduce, all_gather
/// or all_to_all: the group's hint names an algorithm only all_reduce has)
/// costs only that family: every later one runs, and passes, on a fresh
/// group.
#[test]
fn a_failing_family_does_not_skip_the_others() {
    weft_loopback::link();
    let opts = weft::GroupOptions::default()
        .backend("loopback")
        .timeout(std::time::Duration::from_secs(30))
        .hint("algorithm", "recursive_doubling");
    for checks in weft_conformance::checks_on_threads(opts, 3, |pg| weft_conformance::run(pg, 5)) {
        let failed: std::collections::BTreeSet<&str> = checks.iter().filter(|c| !c.passed).map(|c| c.op).collect();
        assert_eq!(
            failed.into_iter().collect::<Vec<_>>(),
            [
                "all_gather (list)",
                "all_gather_single",
                "all_gather_v",
                "all_reduce (bits alike on every rank)",
                "all_to_all (list)",
                "all_to_all_single",
                "all_to_all_v_single",
                "broadcast",
                "reduce"
            ],
            "{}",
            weft_conformance::summary(&checks).0
        );
        assert!(checks.iter().any(|c| c.op == "barrier" && c.passed), "the last case ran");
    }
}

/// Each family runs alone and in any order (here backwards), with as many
/// cases as the whole suite has.
#[test]
fn every_family_runs_alone() {
    weft_loopback::link();
    let opts = weft::GroupOptions::default().backend("loopback").timeout(std::time::Duration::from_secs(30));
    let whole = weft_conformance::checks_on_threads(opts.clone(), 3, |pg| weft_conformance::run(pg, 5));
    let alone = weft_conformance::checks_on_threads(opts, 3, |pg| {
        weft_conformance::Family::ALL.iter().rev().flat_map(|f| weft_conformance::run_family(pg, *f, 5, None)).collect()
    });
    for (rank, checks) in alone.iter().enumerate() {
        let (table, ok) = weft_conformance::summary(checks);
        assert!(ok, "rank {rank}:\n{table}");
        assert_eq!(checks.len(), whole[rank].len(), "rank {rank}");
    }
}
