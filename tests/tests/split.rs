//! Sub-groups that run over their parent's transports (`core/src/group/shared.rs`):
//! every op and point-to-point pattern on them while the parent runs ops
//! at once, a pipeline's edge groups, a sub-group outliving its parent, a
//! lost peer named in the sub-group's ranks, and where a split sets up
//! its own transports instead.

use std::time::Duration;
use weft::prelude::*;
use weft::ErrorKind;
use weft_tests::{options, run_threads};

fn o() -> OpOptions {
    OpOptions::default()
}

/// Ranks 3, 0 and 2 of 4 (in that order) form a sub-group and run every
/// case of the conformance suite and its point-to-point patterns on it,
/// while a second thread all_reduces on the parent; rank 1 joins none and
/// only runs the parent's ops.
#[test]
fn a_shared_sub_group_passes_the_suite_beside_its_parent() {
    for spec in ["shm", "cpu-tcp"] {
        run_threads(4, options(spec), move |pg| {
            let mine: &[usize] = if pg.rank() == 1 { &[] } else { &[3, 0, 2] };
            let sub = pg.join_split(mine).unwrap();
            let mut parent_v = vec![pg.rank() as u64; 1 << 16];
            std::thread::scope(|t| {
                t.spawn(|| {
                    for _ in 0..20 {
                        let mut v = parent_v.clone();
                        pg.all_reduce(&mut v[..], ReduceOp::Sum, &o()).unwrap().wait().unwrap();
                        assert!(v.iter().all(|&x| x == 6), "parent all_reduce");
                    }
                    parent_v[0] = 1;
                });
                if let Some(sub) = &sub {
                    assert!(sub.shares_parent_transports());
                    assert_eq!((sub.rank(), sub.size()), ([1, 99, 2, 0][pg.rank()], 3));
                    let mut checks = weft_conformance::run(sub, 1000);
                    checks.extend(weft_conformance::run_p2p(sub, None, 1 << 20));
                    let (table, ok) = weft_conformance::summary(&checks);
                    assert!(ok, "{spec} sub-group rank {}:\n{table}", sub.rank());
                }
            });
        });
    }
}

/// The 6 directed edges of a 4-stage pipeline as 4 rounds of splits (the
/// groups of a round disjoint, as `torch.distributed.pipelining` makes
/// them), all alive at once; activations flow forward on each edge and a
/// receive from any rank names its sender in the edge's ranks.
#[test]
fn a_pipelines_edge_groups_share_the_parents_transports() {
    for spec in ["shm", "cpu-tcp"] {
        run_threads(4, options(spec), move |pg| {
            let r = pg.rank();
            let rounds: [&[[usize; 2]]; 4] = [&[[0, 1], [2, 3]], &[[1, 2]], &[[0, 3]], &[[0, 2], [1, 3]]];
            let mut edges = Vec::new();
            for round in rounds {
                let mine = round.iter().find(|e| e.contains(&r)).map(|e| &e[..]).unwrap_or(&[]);
                if let Some(g) = pg.join_split(mine).unwrap() {
                    assert!(g.shares_parent_transports());
                    edges.push((mine.to_vec(), g));
                }
            }
            for (ranks, g) in &edges {
                // The lower stage sends forward; the other receives from any rank.
                let data = vec![(ranks[0] * 10 + ranks[1]) as u32; 1000];
                if g.rank() == 0 {
                    g.send(&data[..], 1, 7, &o()).unwrap().wait().unwrap();
                } else {
                    let mut got = vec![0u32; 1000];
                    let w = g.recv_any(&mut got[..], 7, &o()).unwrap();
                    w.wait().unwrap();
                    assert_eq!(w.source(), Some(0), "the sender in the edge group's ranks");
                    drop(w);
                    assert_eq!(got, data);
                }
                let mut v = [r as u64 + 1];
                g.all_reduce(&mut v[..], ReduceOp::Sum, &o()).unwrap().wait().unwrap();
                assert_eq!(v[0], (ranks[0] + ranks[1] + 2) as u64);
            }
            edges.len()
        });
    }
}

/// Dropping the parent leaves its transports to the sub-group, which keeps
/// working; dropping the sub-group then closes them without a hang.
#[test]
fn a_sub_group_outlives_its_parent() {
    for spec in ["shm", "cpu-tcp"] {
        let out = run_threads(3, options(spec), |pg| {
            let sub = pg.split(&[2, 1]).unwrap();
            drop(pg);
            let sub = sub?;
            let mut v = vec![sub.rank() as i32 + 1; 4096];
            sub.all_reduce(&mut v[..], ReduceOp::Sum, &o()).unwrap().wait().unwrap();
            Some(v[0])
        });
        assert_eq!(out, vec![None, Some(3), Some(3)], "{spec}");
    }
}

/// A peer lost to a sub-group is named in the sub-group's ranks: parent
/// rank 2 (the sub-group's rank 0) aborts, and parent rank 0 (its rank 1),
/// waiting on a receive from it, gets `PeerLost { rank: 0 }`.
#[test]
fn a_lost_peer_is_named_in_the_sub_groups_ranks() {
    run_threads(3, options("cpu-tcp"), |pg| {
        let mine: &[usize] = if pg.rank() == 1 { &[] } else { &[2, 0] };
        let sub = pg.join_split(mine).unwrap();
        match pg.rank() {
            2 => {
                std::thread::sleep(Duration::from_millis(200));
                pg.abort();
            }
            0 => {
                let sub = sub.unwrap();
                let mut v = [0u8; 4];
                let e = sub.recv(&mut v[..], 0, 1, &o()).unwrap().wait().unwrap_err();
                assert_eq!(e.kind(), &ErrorKind::PeerLost { rank: 0 }, "{e}");
                assert!(e.to_string().contains("this group's ranks are its [2, 0]"), "{e}");
            }
            _ => {}
        }
    });
}

/// Splits that cannot share set up their own transports, and work alike:
/// past the parent's last tag space, a split of a sharing sub-group, and
/// a group with the hint `split=new`.
#[test]
fn splits_that_cannot_share_set_up_their_own() {
    run_threads(2, options("shm"), |pg| {
        let first = pg.split(&[1, 0]).unwrap().unwrap();
        for _ in 1..255 {
            pg.split(&[0, 1]).unwrap().unwrap();
        }
        let last = pg.split(&[0, 1]).unwrap().unwrap();
        let nested = first.split(&[0, 1]).unwrap().unwrap();
        assert!(first.shares_parent_transports());
        assert!(!last.shares_parent_transports(), "the parent's 256th split");
        assert!(!nested.shares_parent_transports(), "a split of a sharing sub-group");
        for g in [&pg, &first, &last, &nested] {
            let mut v = [g.rank() as i32 + 1; 3];
            g.all_reduce(&mut v[..], ReduceOp::Sum, &o()).unwrap().wait().unwrap();
            assert_eq!(v, [3; 3]);
        }
    });
    run_threads(2, options("cpu-tcp").hint("split", "new"), |pg| {
        let sub = pg.split(&[0, 1]).unwrap().unwrap();
        assert!(!sub.shares_parent_transports());
        let mut v = [1u8];
        sub.all_reduce(&mut v[..], ReduceOp::Sum, &o()).unwrap().wait().unwrap();
        assert_eq!(v, [2]);
    });
}
