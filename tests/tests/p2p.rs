//! Point-to-point that never deadlocks: background sends and receives
//! progress together, whatever the issue order, size or tag; batches;
//! sendrecv; a dead peer named within seconds. (The same ring exchange runs
//! across "hosts" in `hierarchical.rs`, through plugins in `plugins.rs` and
//! on the emulated GPU in `cuda.rs`, as `weft_conformance::run_p2p`.)

use std::time::{Duration, Instant};
use weft::prelude::*;
use weft::{DType, Device, ErrorKind, P2pOp, Tensor, TensorMut};
use weft_tests::{options, run_threads};

fn o() -> OpOptions {
    OpOptions::default()
}

/// Deterministic contents for a message from `src` to `dst` under `tag`.
fn pattern(src: usize, dst: usize, tag: u32, n: usize) -> Vec<u8> {
    (0..n).map(|i| (i as u32 ^ (src as u32 * 131 + dst as u32 * 17 + tag * 7)) as u8).collect()
}

/// Sizes the ring exchange is tried with: around cpu-tcp's 1 MiB
/// rendezvous threshold, and well past it.
const RING_SIZES: [usize; 5] = [0, 1, (1 << 20) - 1, (1 << 20) + 1, 16 << 20];

/// Every rank sends to r+1 and receives from r-1 in a scope, send first.
fn ring_exchange(spec: &'static str, w: usize) {
    run_threads(w, options(spec), move |pg| {
        let (r, w) = (pg.rank(), pg.size());
        for (k, &n) in RING_SIZES.iter().enumerate() {
            let tag = 7 + k as u32;
            let out = pattern(r, (r + 1) % w, tag, n);
            let mut inp = vec![0u8; n];
            pg.scope(|s| {
                let a = s.send(&out[..], (r + 1) % w, tag, &o())?;
                let b = s.recv(&mut inp[..], (r + w - 1) % w, tag, &o())?;
                a.wait()?;
                b.wait()
            })
            .unwrap_or_else(|e| panic!("{spec} W={w} {n} B: {e}"));
            assert!(inp == pattern((r + w - 1) % w, r, tag, n), "{spec} W={w} {n} B: wrong data");
        }
    });
}

#[test]
fn ring_exchange_cpu_tcp() {
    for w in 2..=5 {
        ring_exchange("cpu-tcp", w);
    }
}

#[test]
fn ring_exchange_shm() {
    for w in 2..=5 {
        ring_exchange("shm", w);
    }
}

/// Both ranks of a pair post a long receive first, then the send: only
/// progress on both at once completes it.
#[test]
fn both_ranks_receive_first() {
    for spec in ["cpu-tcp", "shm", "loopback"] {
        run_threads(2, options(spec), move |pg| {
            let peer = 1 - pg.rank();
            let out = pattern(pg.rank(), peer, 3, 4 << 20);
            let mut inp = vec![0u8; 4 << 20];
            pg.scope(|s| {
                let b = s.recv(&mut inp[..], peer, 3, &o())?;
                let a = s.send(&out[..], peer, 3, &o())?;
                b.wait()?;
                a.wait()
            })
            .unwrap();
            assert!(inp == pattern(peer, pg.rank(), 3, 4 << 20));
        });
    }
}

/// Long messages that arrive while the receiver has nothing in progress:
/// rank 0 sends a short message and at once a long one; rank 1, late,
/// receives the short one in the background, whose drain then finds the
/// long frame (inline, or a single-copy offer) with every op finished and
/// leaves it in the ring (shm), and receives the long one after a pause.
/// Every message lands whole, and replies sent in between get through.
#[test]
fn long_messages_that_arrive_with_nothing_in_progress() {
    for (spec, cma) in [("shm", "off"), ("shm", "on"), ("cpu-tcp", "off")] {
        run_threads(2, options(spec).hint("shm_cma", cma), move |pg| {
            let sizes = [(1 << 20) + 1, 4 << 20, 64 << 10, 3 << 20];
            for (k, &n) in sizes.iter().cycle().take(8).enumerate() {
                let (short, long) = (2 * k as u32, 2 * k as u32 + 1);
                let what = format!("{spec} (shm_cma={cma}), message {k} of {n} B");
                if pg.rank() == 0 {
                    let fail = |e: weft::Error| panic!("{what}: {e}");
                    pg.send(&pattern(0, 1, short, 1024)[..], 1, short, &o()).and_then(|w| w.wait()).unwrap_or_else(fail);
                    pg.send(&pattern(0, 1, long, n)[..], 1, long, &o()).and_then(|w| w.wait()).unwrap_or_else(fail);
                } else {
                    std::thread::sleep(Duration::from_millis(20));
                    let (mut a, mut b) = (vec![0u8; 1024], vec![0u8; n]);
                    pg.scope(|s| s.recv(&mut a[..], 0, short, &o())?.wait()).unwrap_or_else(|e| panic!("{what}: {e}"));
                    std::thread::sleep(Duration::from_millis(5));
                    pg.scope(|s| s.recv(&mut b[..], 0, long, &o())?.wait()).unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert!(a == pattern(0, 1, short, 1024) && b == pattern(0, 1, long, n), "{what}: wrong data");
                }
                if k % 2 == 1 {
                    // A reply while the next messages may already be in flight.
                    let back = pattern(1, 0, 100 + short, n / 2);
                    if pg.rank() == 1 {
                        pg.send(&back[..], 0, 100 + short, &o()).and_then(|w| w.wait()).unwrap_or_else(|e| panic!("{what}: reply: {e}"));
                    } else {
                        let mut inp = vec![0u8; n / 2];
                        pg.recv(&mut inp[..], 1, 100 + short, &o()).and_then(|w| w.wait()).unwrap_or_else(|e| panic!("{what}: reply: {e}"));
                        assert!(inp == back, "{what}: wrong reply");
                    }
                }
            }
        });
    }
}

/// A small xorshift, so the shuffles are the same on every run.
fn shuffle<T>(v: &mut [T], mut seed: u64) {
    for i in (1..v.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        v.swap(i, (seed % (i as u64 + 1)) as usize);
    }
}

/// 64 sends and 64 receives per rank with distinct tags, posted in
/// different shuffled orders on each rank, sizes on both sides of the
/// rendezvous threshold; then same-tag messages arrive in issue order.
#[test]
fn many_outstanding_in_shuffled_orders_and_same_tag_in_order() {
    for spec in ["cpu-tcp", "shm", "loopback"] {
        run_threads(2, options(spec), move |pg| {
            let (r, peer) = (pg.rank(), 1 - pg.rank());
            let size = |tag: u32| if tag.is_multiple_of(8) { (1 << 20) + 3 * tag as usize } else { 1 + 97 * tag as usize };
            let outs: Vec<Vec<u8>> = (0..64).map(|t| pattern(r, peer, t, size(t))).collect();
            let mut ins: Vec<Vec<u8>> = (0..64).map(|t| vec![0u8; size(t)]).collect();
            // Each rank's own order of sends and receives, interleaved.
            let mut order: Vec<(bool, u32)> = (0..64).flat_map(|t| [(true, t), (false, t)]).collect();
            shuffle(&mut order, 0x9e37_79b9 + r as u64 * 1000);
            pg.scope(|s| {
                let mut slots: Vec<Option<&mut Vec<u8>>> = ins.iter_mut().map(Some).collect();
                let mut works = Vec::new();
                for &(send, t) in &order {
                    works.push(if send {
                        s.send(&outs[t as usize][..], peer, t, &o())?
                    } else {
                        s.recv(&mut slots[t as usize].take().unwrap()[..], peer, t, &o())?
                    });
                }
                // Wait in yet another order.
                shuffle(&mut works, 77 + r as u64);
                works.iter().try_for_each(|w| w.wait())
            })
            .unwrap_or_else(|e| panic!("{spec}: {e}"));
            for t in 0..64u32 {
                assert!(ins[t as usize] == pattern(peer, r, t, size(t)), "{spec}: tag {t} wrong");
            }
            // Same tag: messages match receives in issue order, long and short mixed.
            let sizes = [10usize, (1 << 20) + 10, 10, (1 << 20) + 10];
            let outs: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &n)| vec![i as u8 + 1; n]).collect();
            let mut ins: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
            pg.scope(|s| {
                let mut works = Vec::new();
                for (i, inp) in ins.iter_mut().enumerate() {
                    if r == 0 {
                        works.push(s.send(&outs[i][..], 1, 99, &o())?);
                    } else {
                        works.push(s.recv(&mut inp[..], 0, 99, &o())?);
                    }
                }
                works.iter().rev().try_for_each(|w| w.wait())
            })
            .unwrap_or_else(|e| panic!("{spec}: {e}"));
            if r == 1 {
                for (i, v) in ins.iter().enumerate() {
                    assert!(v.iter().all(|x| *x == i as u8 + 1), "{spec}: same-tag message {i} out of order");
                }
            }
        });
    }
}

/// Long sends of one tag with a longer send of another tag between them
/// (which may be on the wire while the first waits for its go-ahead): the
/// receives of that tag still get them in issue order.
#[test]
fn a_long_send_is_not_overtaken_by_a_later_one_of_its_tag() {
    run_threads(2, options("cpu-tcp"), |pg| {
        let sizes: [(u32, usize); 4] = [(1, 2 << 20), (2, 8 << 20), (1, 2 << 20), (1, 10)];
        for round in 0..12u8 {
            if pg.rank() == 0 {
                let outs: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &(_, n))| vec![round * 10 + i as u8; n]).collect();
                pg.scope(|s| {
                    let ws: Vec<_> =
                        sizes.iter().zip(&outs).map(|(&(tag, _), out)| s.send(&out[..], 1, tag, &o())).collect::<weft::Result<_>>()?;
                    ws.iter().try_for_each(|w| w.wait())
                })
                .unwrap();
            } else {
                let mut ins: Vec<Vec<u8>> = sizes.iter().map(|&(_, n)| vec![0u8; n]).collect();
                // The receives go in late, the other tag's first.
                std::thread::sleep(std::time::Duration::from_millis(20));
                pg.scope(|s| {
                    let mut order: Vec<usize> = vec![1, 0, 2, 3];
                    let mut slots: Vec<Option<&mut Vec<u8>>> = ins.iter_mut().map(Some).collect();
                    let ws: Vec<_> = order
                        .drain(..)
                        .map(|i| s.recv(&mut slots[i].take().unwrap()[..], 0, sizes[i].0, &o()))
                        .collect::<weft::Result<_>>()?;
                    ws.iter().try_for_each(|w| w.wait())
                })
                .unwrap();
                for (i, v) in ins.iter().enumerate() {
                    assert!(v.iter().all(|x| *x == round * 10 + i as u8), "round {round}: message {i} out of order");
                }
            }
        }
    });
}

/// A receive posted and waited for before this rank's own earlier long
/// send can finish: the receive must not wait for the send.
#[test]
fn a_receive_never_waits_for_an_earlier_unrelated_send() {
    for spec in ["cpu-tcp", "shm", "loopback"] {
        run_threads(2, options(spec), move |pg| {
            let big = vec![5u8; 8 << 20];
            let mut got = vec![0u8; 8 << 20];
            let mut small = [0u8; 16];
            if pg.rank() == 0 {
                pg.scope(|s| {
                    let a = s.send(&big[..], 1, 1, &o())?;
                    let b = s.recv(&mut small[..], 1, 2, &o())?;
                    b.wait()?;
                    // Only now does rank 1 post the long receive.
                    pg.send(&[1u8][..], 1, 3, &o())?.wait()?;
                    a.wait()
                })
                .unwrap();
                assert_eq!(small, [9u8; 16]);
            } else {
                pg.send(&[9u8; 16][..], 0, 2, &o()).unwrap().wait().unwrap();
                let mut go = [0u8];
                pg.recv(&mut go[..], 0, 3, &o()).unwrap().wait().unwrap();
                pg.recv(&mut got[..], 0, 1, &o()).unwrap().wait().unwrap();
                assert!(got.iter().all(|x| *x == 5));
            }
        });
    }
}

/// Background sends and receives alongside collectives in one scope: the
/// collectives keep their order, the p2p ops complete around them.
#[test]
fn p2p_and_collectives_overlap() {
    run_threads(3, options("cpu-tcp"), |pg| {
        let (r, w) = (pg.rank(), pg.size());
        let out = pattern(r, (r + 1) % w, 5, 3 << 20);
        let mut inp = vec![0u8; 3 << 20];
        let mut x = vec![r as f32 + 1.0; 1 << 16];
        pg.scope(|s| {
            let a = s.send(&out[..], (r + 1) % w, 5, &o())?;
            let c = s.all_reduce(&mut x, ReduceOp::Sum, &o())?;
            c.wait()?;
            let b = s.recv(&mut inp[..], (r + w - 1) % w, 5, &o())?;
            b.wait()?;
            a.wait()
        })
        .unwrap();
        assert!(inp == pattern((r + w - 1) % w, r, 5, 3 << 20));
        assert!(x.iter().all(|v| *v == 6.0));
    });
}

/// A batch posts its sends and receives as one unit with one Work.
#[test]
fn batched_p2p_and_sendrecv() {
    for spec in ["cpu-tcp", "shm", "loopback"] {
        run_threads(4, options(spec), move |pg| {
            let (r, w) = (pg.rank(), pg.size());
            let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
            let n = (1 << 20) + 5;
            let (to_next, to_prev) = (pattern(r, next, 1, n), pattern(r, prev, 2, n));
            let (mut from_prev, mut from_next) = (vec![0u8; n], vec![0u8; n]);
            // Receives first, in the batch: still one unit.
            pg.batch_p2p(
                vec![
                    P2pOp::recv(&mut from_prev[..], prev, 1),
                    P2pOp::recv(&mut from_next[..], next, 2),
                    P2pOp::send(&to_next[..], next, 1),
                    P2pOp::send(&to_prev[..], prev, 2),
                ],
                &o(),
            )
            .unwrap()
            .wait()
            .unwrap();
            assert!(from_prev == pattern(prev, r, 1, n) && from_next == pattern(next, r, 2, n), "{spec}: batch data");
            // An empty batch is done at once.
            assert!(pg.batch_p2p(vec![], &o()).unwrap().is_completed());
            // sendrecv, direct and in a scope.
            let mut got = vec![0u8; n];
            pg.sendrecv(&to_next[..], next, &mut got[..], prev, 4, &o()).unwrap().wait().unwrap();
            assert!(got == pattern(prev, r, 1, n), "{spec}: sendrecv");
            let mut got2 = vec![0f32; 100];
            let mine = vec![r as f32; 100];
            pg.scope(|s| s.sendrecv(&mine[..], prev, &mut got2[..], next, 5, &o())?.wait()).unwrap();
            assert!(got2.iter().all(|v| *v == next as f32), "{spec}: scoped sendrecv");
        });
    }
}

/// Whatever bytes a peer sends into a bool tensor, it holds only 0 and 1
/// once received: direct (the group's direct path to the transport), as a
/// sendrecv, and in a scope.
#[test]
fn received_bools_are_0_or_1_whatever_the_peer_sent() {
    for spec in ["cpu-tcp", "shm"] {
        run_threads(2, options(spec), move |pg| {
            let peer = 1 - pg.rank();
            let sent = [0u8, 1, 2, 255, 7];
            let clean = [0u8, 1, 1, 1, 1];
            // Bytes seen as bools: a u8 buffer, so reading them back is
            // defined whatever arrived.
            let bools =
                |buf: &mut [u8; 5]| unsafe { TensorMut::from_raw_parts(buf.as_mut_ptr(), DType::Bool, Device::Cpu, &[5], None) }.unwrap();
            let mut buf = [9u8; 5];
            if pg.rank() == 0 {
                pg.send(&sent[..], peer, 1, &o()).unwrap().wait().unwrap();
            } else {
                pg.recv(bools(&mut buf), peer, 1, &o()).unwrap().wait().unwrap();
                assert_eq!(buf, clean, "{spec}: recv");
            }
            // (A sendrecv's tensors share a dtype: these bools are not 0 or 1.)
            let garbage = unsafe { Tensor::from_raw_parts(sent.as_ptr(), DType::Bool, Device::Cpu, &[5], None) }.unwrap();
            let mut buf = [9u8; 5];
            pg.sendrecv(garbage, peer, bools(&mut buf), peer, 2, &o()).unwrap().wait().unwrap();
            assert_eq!(buf, clean, "{spec}: sendrecv");
            let mut buf = [9u8; 5];
            pg.scope(|s| {
                let a = s.send(&sent[..], peer, 3, &o())?;
                let b = s.recv(bools(&mut buf), peer, 3, &o())?;
                a.wait()?;
                b.wait()
            })
            .unwrap();
            assert_eq!(buf, clean, "{spec}: scoped recv");
        });
    }
}

/// Bad batches are refused before anything moves.
#[test]
fn bad_batches_are_invalid() {
    run_threads(2, options("cpu-tcp"), |pg| {
        let peer = 1 - pg.rank();
        let mut buf = [0u8; 4];
        let e = pg.batch_p2p(vec![P2pOp::recv(&mut buf[..], 2, 1)], &o()).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
        let e = pg.batch_p2p(vec![P2pOp::send(&[1u8][..], pg.rank(), 1)], &o()).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
        // The group is still usable.
        pg.sendrecv(&[pg.rank() as u8][..], peer, &mut buf[..1], peer, 1, &o()).unwrap().wait().unwrap();
        assert_eq!(buf[0], peer as u8);
    });
}

/// A simulated 1F1B pipeline over 4 stages: activations flow forward,
/// gradients backward, several micro-batches in flight, every message
/// checked exactly.
#[test]
fn one_f_one_b_pipeline() {
    for spec in ["cpu-tcp", "shm", "loopback"] {
        run_threads(4, options(spec), move |pg| pipeline_1f1b(&pg, 8, (1 << 18) + 3));
    }
}

/// Activation of micro-batch `m` after stage `s` (and the gradient coming
/// back into stage `s` is derived from it the same way on both sides).
fn act(stage: usize, m: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (stage * 1000 + m * 10) as f32 + (i % 97) as f32).collect()
}
fn grad(stage: usize, m: usize, n: usize) -> Vec<f32> {
    act(stage, m, n).iter().map(|x| -x * 0.5).collect()
}

fn pipeline_1f1b(pg: &ProcessGroup, micro: usize, n: usize) {
    let (s, w) = (pg.rank(), pg.size());
    let warmup = (w - 1 - s).min(micro);
    // The 1F1B order of one stage: warm-up forwards, then alternate, then
    // cool-down backwards.
    let mut steps: Vec<(bool, usize)> = (0..warmup).map(|m| (true, m)).collect();
    let (mut f, mut b) = (warmup, 0);
    while b < micro {
        if f < micro {
            steps.push((true, f));
            f += 1;
        }
        steps.push((false, b));
        b += 1;
    }
    let sends_fwd: Vec<Vec<f32>> = (0..micro).map(|m| act(s, m, n)).collect();
    let sends_bwd: Vec<Vec<f32>> = (0..micro).map(|m| grad(s, m, n)).collect();
    let mut recv_fwd: Vec<Vec<f32>> = (0..micro).map(|_| vec![0f32; n]).collect();
    let mut recv_bwd: Vec<Vec<f32>> = (0..micro).map(|_| vec![0f32; n]).collect();
    pg.scope(|sc| {
        let mut fwd_slots: Vec<Option<&mut Vec<f32>>> = recv_fwd.iter_mut().map(Some).collect();
        let mut bwd_slots: Vec<Option<&mut Vec<f32>>> = recv_bwd.iter_mut().map(Some).collect();
        let mut pending = Vec::new();
        for &(forward, m) in &steps {
            if forward {
                if s > 0 {
                    // Wait for the activation before computing on it.
                    sc.recv(&mut fwd_slots[m].take().unwrap()[..], s - 1, m as u32, &o())?.wait()?;
                }
                if s + 1 < w {
                    pending.push(sc.send(&sends_fwd[m][..], s + 1, m as u32, &o())?);
                }
            } else {
                if s + 1 < w {
                    sc.recv(&mut bwd_slots[m].take().unwrap()[..], s + 1, 1000 + m as u32, &o())?.wait()?;
                }
                if s > 0 {
                    pending.push(sc.send(&sends_bwd[m][..], s - 1, 1000 + m as u32, &o())?);
                }
            }
        }
        pending.iter().try_for_each(|w| w.wait())
    })
    .unwrap_or_else(|e| panic!("stage {s}: {e}"));
    for m in 0..micro {
        if s > 0 {
            assert!(recv_fwd[m] == act(s - 1, m, n), "stage {s} forward {m}");
        }
        if s + 1 < w {
            assert!(recv_bwd[m] == grad(s + 1, m, n), "stage {s} backward {m}");
        }
    }
}

/// A rank killed (SIGKILL) while the others wait on a batch from it and a
/// send to it: every survivor gets `PeerLost` naming it within 10 s, over
/// sockets and over shared memory.
#[test]
fn a_batch_whose_peer_is_killed_fails_naming_it_within_10s() {
    for backend in ["cpu-tcp", "shm"] {
        weft_tests::procs::last_rank_killed_is_named_within_10s(env!("CARGO_BIN_EXE_weft-test-worker"), "sigkill_p2p_batch", backend, 3);
    }
}

/// A peer that aborts with a batch outstanding: the survivor's batch fails
/// with `PeerLost` naming it, within seconds.
#[test]
fn a_batch_whose_peer_dies_fails_naming_it() {
    for spec in ["cpu-tcp", "shm", "loopback"] {
        let out = run_threads(2, options(spec).timeout(Duration::from_secs(60)), move |pg| {
            if pg.rank() == 1 {
                // Leave without ever sending: the group is abandoned.
                std::thread::sleep(Duration::from_millis(300));
                pg.abort();
                return None;
            }
            let mut a = vec![0u8; 2 << 20];
            let mut b = [0u8; 10];
            let t = Instant::now();
            let e = pg.batch_p2p(vec![P2pOp::recv(&mut a[..], 1, 1), P2pOp::recv(&mut b[..], 1, 2)], &o()).unwrap().wait().unwrap_err();
            Some((e, t.elapsed()))
        });
        let (e, took) = out[0].as_ref().unwrap();
        assert_eq!(e.kind(), &ErrorKind::PeerLost { rank: 1 }, "{spec}: {e}");
        assert!(*took < Duration::from_secs(10), "{spec}: took {took:?}");
    }
}

/// Receives from any rank: three senders at different times, long and
/// short messages, direct and in a scope; each Work names its sender.
#[test]
fn receive_from_any_rank_names_the_sender() {
    for spec in ["cpu-tcp", "shm", "loopback"] {
        run_threads(4, options(spec), move |pg| {
            let r = pg.rank();
            // Long enough for cpu-tcp's rendezvous on the second round.
            for (round, n) in [(0u32, 100usize), (1, (1 << 20) + 7)] {
                if r == 0 {
                    let mut got = Vec::new();
                    // The first two direct, the last in a scope.
                    for _ in 0..2 {
                        let mut buf = vec![0u8; n];
                        let from = {
                            let w = pg.recv_any(&mut buf[..], 40 + round, &o()).unwrap();
                            w.wait().unwrap();
                            w.source().expect("a finished recv_any names its sender")
                        };
                        assert!(buf == pattern(from, 0, 40 + round, n), "{spec}: data of rank {from}");
                        got.push(from);
                    }
                    let mut buf = vec![0u8; n];
                    let from = pg
                        .scope(|s| {
                            let w = s.recv_any(&mut buf[..], 40 + round, &o())?;
                            w.wait()?;
                            Ok::<_, weft::Error>(w.source())
                        })
                        .unwrap()
                        .expect("sender");
                    assert!(buf == pattern(from, 0, 40 + round, n), "{spec}: data of rank {from}");
                    got.push(from);
                    got.sort();
                    assert_eq!(got, vec![1, 2, 3], "{spec}: every sender once");
                } else {
                    // Senders at different times, the last first.
                    std::thread::sleep(Duration::from_millis(30 * (4 - r as u64)));
                    pg.send(&pattern(r, 0, 40 + round, n)[..], 0, 40 + round, &o()).unwrap().wait().unwrap();
                }
            }
            // A receive from a specific rank posted first keeps that
            // rank's message; the any-source one takes the other's.
            if r < 3 {
                let tag = 50;
                if r == 0 {
                    let (mut a, mut b) = (vec![0u8; 8], vec![0u8; 8]);
                    pg.scope(|s| {
                        let wa = s.recv(&mut a[..], 2, tag, &o())?;
                        let wb = s.recv_any(&mut b[..], tag, &o())?;
                        wa.wait()?;
                        wb.wait()?;
                        assert_eq!(wb.source(), Some(1), "{spec}");
                        Ok::<_, weft::Error>(())
                    })
                    .unwrap();
                    assert_eq!((a[0], b[0]), (2, 1), "{spec}");
                } else {
                    pg.send(&[r as u8; 8][..], 0, tag, &o()).unwrap().wait().unwrap();
                }
            }
        });
    }
}
