//! Group behaviour beyond op results: p2p tags, scopes, sub-groups, several
//! groups, abort.

use std::time::Duration;
use weft::prelude::*;
use weft::ErrorKind;
use weft_tests::{options, run_threads};

fn o() -> OpOptions {
    OpOptions::default()
}

#[test]
fn send_recv_with_tags_received_out_of_order() {
    run_threads(2, options("cpu-tcp"), |pg| {
        if pg.rank() == 0 {
            for tag in [1u32, 2, 3] {
                let v = vec![tag as i64; tag as usize];
                pg.send(&v, 1, tag, &o()).unwrap().wait().unwrap();
            }
            // Two messages under one tag arrive in send order.
            pg.send(&[10u8][..], 1, 9, &o()).unwrap().wait().unwrap();
            pg.send(&[11u8][..], 1, 9, &o()).unwrap().wait().unwrap();
        } else {
            for tag in [3u32, 1, 2] {
                let mut v = vec![0i64; tag as usize];
                pg.recv(&mut v, 0, tag, &o()).unwrap().wait().unwrap();
                assert_eq!(v, vec![tag as i64; tag as usize]);
            }
            let (mut a, mut b) = ([0u8], [0u8]);
            pg.recv(&mut a[..], 0, 9, &o()).unwrap().wait().unwrap();
            pg.recv(&mut b[..], 0, 9, &o()).unwrap().wait().unwrap();
            assert_eq!((a[0], b[0]), (10, 11));
        }
    });
}

#[test]
fn scoped_ops_run_in_background_and_in_order() {
    let out = run_threads(3, options("cpu-tcp"), |pg| {
        let mut a = vec![1.0f64; 1000];
        let mut b = vec![pg.rank() as i32; 10];
        let mut c = [0u8; 4];
        pg.scope(|s| {
            let wa = s.all_reduce(&mut a, ReduceOp::Sum, &o()).unwrap();
            let wb = s.broadcast(&mut b, 2, &o()).unwrap();
            let wc = s.barrier(&o()).unwrap();
            // Drop a handle without waiting: the scope still waits for it.
            drop(wc);
            std::mem::forget(s.all_reduce(&mut c[..], ReduceOp::Max, &o()).unwrap());
            wb.wait().unwrap();
            assert!(wa.wait_timeout(Duration::from_secs(20)).unwrap());
            assert!(wa.is_completed());
        });
        // Direct ops after the scope are ordered after it.
        pg.all_reduce(&mut c[..], ReduceOp::Sum, &o()).unwrap().wait().unwrap();
        (a[0], b[0], c[0])
    });
    assert!(out.iter().all(|x| *x == (3.0, 2, 0)), "{out:?}");
}

/// A view of `v` not tied to its borrow, for unscoped ops.
///
/// # Safety
/// `v` must outlive every op given the view, with no other access meanwhile.
unsafe fn unbound<T: weft::Element>(v: &mut [T]) -> weft::TensorMut<'static> {
    // SAFETY: the caller's promise.
    unsafe { weft::TensorMut::from_raw_parts(v.as_mut_ptr() as *mut u8, T::DTYPE, weft::Device::Cpu, &[v.len()], None) }.unwrap()
}

/// Unscoped background ops (what the Python binding issues) run like a
/// scope's: a long ring exchange whose receive is issued after its send,
/// and a collective in issue order with them.
#[test]
fn unscoped_ops_run_in_the_background() {
    for spec in ["cpu-tcp", "shm", "loopback"] {
        let out = run_threads(2, options(spec), |pg| {
            let (r, peer) = (pg.rank(), 1 - pg.rank());
            let mut data = vec![r as u8 + 1; 3 << 20];
            let mut got = vec![0u8; 3 << 20];
            let mut sum = vec![r as f32 + 1.0; 1000];
            // SAFETY: every buffer outlives its Work, each waited for below.
            let (u, send, recv, red) = unsafe { (pg.unscoped(), unbound(&mut data), unbound(&mut got), unbound(&mut sum)) };
            let send = u.send(send, peer, 5, &o()).unwrap();
            let recv = u.recv(recv, peer, 5, &o()).unwrap();
            let red = u.all_reduce(red, ReduceOp::Sum, &o()).unwrap();
            red.wait().unwrap();
            recv.wait().unwrap();
            send.wait().unwrap();
            assert!(send.is_completed() && recv.is_completed());
            (got.iter().all(|&x| x == peer as u8 + 1), sum[999])
        });
        assert!(out.iter().all(|x| *x == (true, 3.0)), "{spec}: {out:?}");
    }
}

#[test]
fn work_is_a_future() {
    run_threads(2, options("cpu-tcp"), |pg| {
        let mut v = vec![2u32; 3];
        pg.scope(|s| {
            let w = s.all_reduce(&mut v, ReduceOp::Product, &o()).unwrap();
            block_on(w).unwrap();
        });
        assert_eq!(v, [4, 4, 4]);
    });
}

/// A minimal executor: poll with a thread-parking waker.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake};
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Arc::new(Unpark(std::thread::current())).into();
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park_timeout(Duration::from_millis(50));
    }
}

#[test]
fn split_sub_groups_run_concurrently_with_the_parent() {
    let out = run_threads(5, options("cpu-tcp"), |pg| {
        let r = pg.rank();
        let evens = pg.split(&[0, 2, 4]).unwrap();
        let odds = pg.split(&[3, 1]).unwrap();
        assert_eq!(evens.is_some(), r % 2 == 0);
        assert_eq!(odds.is_some(), r % 2 == 1);
        let sub = evens.or(odds).unwrap();
        if r == 3 {
            assert_eq!(sub.rank(), 0, "ranks follow the list order");
        }
        // Sub-group and parent ops interleaved from two threads at once.
        let mut parent_v = vec![1i64; 64];
        let mut sub_v = vec![r as i64; 64];
        std::thread::scope(|t| {
            t.spawn(|| pg.all_reduce(&mut parent_v, ReduceOp::Sum, &o()).unwrap().wait().unwrap());
            t.spawn(|| sub.all_reduce(&mut sub_v, ReduceOp::Sum, &o()).unwrap().wait().unwrap());
        });
        // Invalid lists are errors on every rank.
        for bad in [&[][..], &[0, 0][..], &[0, 7][..]] {
            assert_eq!(pg.split(bad).unwrap_err().kind(), &ErrorKind::InvalidArgument);
        }
        (parent_v[0], sub_v[0])
    });
    for (r, (p, s)) in out.into_iter().enumerate() {
        assert_eq!(p, 5);
        assert_eq!(s, if r % 2 == 0 { 6 } else { 4 });
    }
}

#[test]
fn join_split_gives_each_rank_the_sub_group_it_names() {
    let out = run_threads(4, options("cpu-tcp"), |pg| {
        let r = pg.rank();
        // Ranks 0 and 2 form one group, rank 1 another alone; rank 3 joins none.
        let mine: &[usize] = match r {
            0 | 2 => &[2, 0],
            1 => &[1],
            _ => &[],
        };
        let sub = pg.join_split(mine).unwrap();
        assert_eq!(sub.is_none(), r == 3);
        // A list without this rank is refused (the split still counts).
        let e = pg.join_split(&[(r + 1) % 4]).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
        assert!(e.to_string().contains("not in the list"), "{e}");
        // Later splits stay in step on every rank.
        let all = pg.split(&[3, 2, 1, 0]).unwrap().unwrap();
        assert_eq!(all.rank(), 3 - r);
        // Members that disagree on the order are told so (not left waiting).
        let e = pg.join_split(if r == 0 { &[0, 1, 2, 3] } else { &[3, 2, 1, 0] }).unwrap_err();
        assert!(e.to_string().contains("rank lists differ"), "{e}");
        let mut v = vec![r as u64 + 1; 16];
        if let Some(sub) = &sub {
            sub.all_reduce(&mut v, ReduceOp::Sum, &o()).unwrap().wait().unwrap();
        }
        (sub.map(|s| (s.rank(), s.size())), v[0])
    });
    assert_eq!(out[0], (Some((1, 2)), 4));
    assert_eq!(out[2], (Some((0, 2)), 4));
    assert_eq!(out[1], (Some((0, 1)), 2));
    assert_eq!(out[3], (None, 4));
}

#[test]
fn two_groups_in_one_process_are_independent() {
    run_threads(3, options("cpu-tcp"), |pg| {
        // A second group on the same store gets its own namespace.
        let mut a = vec![1u32; 8];
        let second = pg.split(&[0, 1, 2]).unwrap().unwrap();
        pg.scope(|s| {
            let w1 = s.all_reduce(&mut a, ReduceOp::Sum, &o()).unwrap();
            let mut b = vec![2u32; 8];
            second.all_reduce(&mut b, ReduceOp::Sum, &o()).unwrap().wait().unwrap();
            w1.wait().unwrap();
            assert_eq!(b, vec![6; 8]);
        });
        assert_eq!(a, vec![3; 8]);
    });
}

#[test]
fn abort_ends_a_blocked_op_promptly_and_poisons_later_ops() {
    run_threads(2, options("cpu-tcp"), |pg| {
        if pg.rank() == 0 {
            let mut v = [0u8; 4];
            std::thread::scope(|t| {
                t.spawn(|| {
                    std::thread::sleep(Duration::from_millis(200));
                    pg.abort();
                });
                let start = std::time::Instant::now();
                let e = pg.recv(&mut v[..], 1, 5, &o()).unwrap().wait().unwrap_err();
                assert_eq!(e.kind(), &ErrorKind::Aborted, "{e}");
                assert!(start.elapsed() < Duration::from_secs(5));
            });
            let e = pg.barrier(&o()).unwrap().wait().unwrap_err();
            assert_eq!(e.kind(), &ErrorKind::Aborted);
        } else {
            // The peer sees rank 0 go away.
            let e = pg.barrier(&o()).unwrap().wait().unwrap_err();
            assert_eq!(e.kind(), &ErrorKind::PeerLost { rank: 0 }, "{e}");
        }
    });
}

#[test]
fn groups_rendezvous_through_a_file_store_and_two_groups_share_one_store() {
    let path = std::env::temp_dir().join(format!("weft-test-filestore-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let store: std::sync::Arc<dyn weft::store::Store> =
        std::sync::Arc::new(weft::store::FileStore::new(&path, Duration::from_secs(30)).unwrap());
    let out = weft_tests::run_threads_on(store.clone(), 3, options("cpu-tcp"), move |pg| {
        // A second, independently created group on the same store.
        let store = store.clone();
        let (r, w) = (pg.rank(), pg.size());
        let second = ProcessGroup::new(store, r, w, options("cpu-tcp")).unwrap();
        let mut a = vec![1i64; 4];
        let mut b = vec![10i64; 4];
        pg.all_reduce(&mut a, ReduceOp::Sum, &o()).unwrap().wait().unwrap();
        second.all_reduce(&mut b, ReduceOp::Sum, &o()).unwrap().wait().unwrap();
        (a[0], b[0])
    });
    assert!(out.iter().all(|x| *x == (3, 30)), "{out:?}");
    std::fs::remove_file(&path).unwrap();
}

/// An op's hint overrides the group's hint of the same key; the group's
/// holds for ops that do not set it.
#[test]
fn op_hints_override_group_hints() {
    run_threads(2, options("cpu-tcp").hint("algorithm", "butterfly"), |pg| {
        let mut v = vec![pg.rank() as f32; 7];
        pg.all_reduce(&mut v, ReduceOp::Sum, &o().hint("algorithm", "ring")).unwrap().wait().unwrap();
        assert_eq!(v, vec![1.0; 7]);
        // Refused when issued, before anything runs.
        let e = pg.all_reduce(&mut v, ReduceOp::Sum, &o()).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("butterfly"), "{e}");
    });
}

/// The chain broadcast in many segments over real transports, with the
/// acknowledgements that keep each sender a few segments ahead, from every
/// root, then another op. (The mailbox tests of the algorithms check that
/// no acknowledgement is left unreceived.)
#[test]
fn chain_broadcasts_in_many_segments_over_shm_and_cpu_tcp() {
    for backend in ["cpu:shm", "cpu-tcp"] {
        run_threads(4, options(backend), move |pg| {
            let chain = o().hint("algorithm", "chain").hint("segment_bytes", "64");
            for root in 0..4 {
                // 50 segments, the last one short.
                let mut b: Vec<u8> = (0..3170).map(|i| (i * 7 + pg.rank() * 50) as u8).collect();
                pg.broadcast(&mut b, root, &chain).unwrap().wait().unwrap();
                assert!(b.iter().enumerate().all(|(i, x)| *x == (i * 7 + root * 50) as u8), "{backend} root {root}");
            }
            let mut v = vec![1.0f32; 5];
            pg.all_reduce(&mut v, ReduceOp::Sum, &o()).unwrap().wait().unwrap();
            assert_eq!(v, vec![4.0; 5], "{backend}");
        });
    }
}

#[test]
fn algorithm_hints_select_and_unknown_names_are_clear_errors() {
    run_threads(3, options("cpu-tcp"), |pg| {
        for algo in ["ring", "recursive_doubling", "halving_doubling"] {
            let mut v = vec![pg.rank() as f32; 7];
            pg.all_reduce(&mut v, ReduceOp::Sum, &o().hint("algorithm", algo)).unwrap().wait().unwrap();
            assert_eq!(v, vec![3.0; 7], "{algo}");
            // Pipelined in 3-element segments over the real transport.
            let mut v = vec![pg.rank() as f32; 1001];
            pg.all_reduce(&mut v, ReduceOp::Sum, &o().hint("algorithm", algo).hint("segment_bytes", "12")).unwrap().wait().unwrap();
            assert_eq!(v, vec![3.0; 1001], "{algo} segmented");
        }
        let mut b = vec![pg.rank() as u8; 1000];
        pg.broadcast(&mut b, 1, &o().hint("algorithm", "scatter_allgather")).unwrap().wait().unwrap();
        assert!(b.iter().all(|x| *x == 1));
        let e = pg.all_reduce(&mut b, ReduceOp::Sum, &o().hint("algorithm", "butterfly")).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("choices: auto, ring, recursive_doubling, halving_doubling"), "{e}");
        // Every rank rejected it when issuing it: the group still works.
        pg.barrier(&o()).unwrap().wait().unwrap();
    });
}

/// The abort hook runs once, before the transports are aborted: when an
/// op's timeout makes the group unusable, and not again on `abort`; a
/// second hook is refused.
#[test]
fn the_abort_hook_runs_once_when_the_group_fails() {
    run_threads(2, options("cpu-tcp"), |pg| {
        let told = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let t = told.clone();
        pg.on_abort(move |e| t.lock().unwrap().push(e.kind().clone())).unwrap();
        assert_eq!(pg.on_abort(|_| {}).unwrap_err().kind(), &ErrorKind::InvalidArgument);
        if pg.rank() == 0 {
            let mut v = [0u8; 4];
            let quick = OpOptions::default().timeout(Duration::from_millis(300));
            let e = pg.recv(&mut v[..], 1, 3, &quick).unwrap().wait().unwrap_err();
            assert!(e.is_timeout(), "{e}");
            assert_eq!(*told.lock().unwrap(), vec![ErrorKind::Timeout]);
            pg.abort();
            assert_eq!(told.lock().unwrap().len(), 1, "once");
        } else {
            // Rank 0 gives up on this rank and tells it so.
            let e = pg.barrier(&o()).unwrap().wait().unwrap_err();
            assert!(!told.lock().unwrap().is_empty(), "{e}");
        }
    });
}
