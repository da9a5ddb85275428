//! The shm backend: the full conformance suite at world sizes 1-8, sub-groups
//! at once, a rank killed mid-op, and nothing left behind in /dev/shm.

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;
use weft::prelude::*;
use weft::ErrorKind;
use weft_tests::procs::{run_world, run_world_on_free_port, torchrun_vars};
use weft_tests::{options, run_threads};

#[test]
fn shm_passes_conformance_at_world_sizes_1_to_8() {
    for w in 1..=8 {
        let results = run_threads(w, options("cpu:shm"), |pg| {
            assert_eq!(pg.backend_name((weft::DeviceKind::Cpu, weft::Layout::Dense)).as_deref(), Some("shm"));
            weft_conformance::run(&pg, 5)
        });
        for (r, checks) in results.iter().enumerate() {
            let (table, ok) = weft_conformance::summary(checks);
            assert!(ok, "shm at W={w}, rank {r}:\n{table}");
        }
    }
}

/// Direct sends and receives with nothing else posted skip the table
/// where they can: sends whose frames fit go straight into the ring, and a
/// receive whose message is next in its ring is read at once. What cannot
/// go that way (a message larger than the ring, the sends behind it, a
/// receive that finds another tag's frame first) still keeps MPI's order.
#[test]
fn shm_direct_p2p_keeps_order_whatever_goes_at_once() {
    // Single copy off: the 9 MiB message streams through the ring (8 MiB
    // at most), the sends behind it wait for it.
    run_threads(2, options("cpu:shm").hint("shm_cma", "off"), |pg| {
        let o = OpOptions::default();
        let sizes = [8usize, 9 << 20, 24, 8];
        for round in 0..10u8 {
            let fill = |i: usize| round.wrapping_mul(7).wrapping_add(i as u8);
            if pg.rank() == 0 {
                let outs: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &n)| vec![fill(i); n]).collect();
                // Another tag first, then one batch of all four under tag 7,
                // and a receive.
                pg.send(&[round; 3][..], 1, 3, &o).unwrap().wait().unwrap();
                let mut back = [0u8; 5];
                let mut batch: Vec<P2pOp> = outs.iter().map(|d| P2pOp::send(&d[..], 1, 7)).collect();
                batch.push(P2pOp::recv(&mut back[..], 1, 8));
                pg.batch_p2p(batch, &o).unwrap().wait().unwrap();
                assert_eq!(back, [round; 5]);
            } else {
                // Tag 7's receives first: the first finds tag 3's frame in its way.
                for (i, &n) in sizes.iter().enumerate() {
                    let mut got = vec![0u8; n];
                    pg.recv(&mut got[..], 0, 7, &o).unwrap().wait().unwrap();
                    assert!(got.iter().all(|x| *x == fill(i)), "round {round}: message {i} out of order");
                }
                let mut first = [0u8; 3];
                pg.recv(&mut first[..], 0, 3, &o).unwrap().wait().unwrap();
                assert_eq!(first, [round; 3]);
                pg.send(&[round; 5][..], 0, 8, &o).unwrap().wait().unwrap();
            }
        }
    });
}

/// Messages of 16 MiB and more are read out of the ring with stores past
/// the cache: sent both ways at once, into a receive buffer at an odd
/// address, of an odd length, every byte arrives and no other is written;
/// so does a broadcast of that length from rank 2 by a tree (whose root
/// sends its children the whole buffer, where a chain would send pieces).
#[test]
fn shm_long_messages_read_to_memory_arrive_whole() {
    run_threads(3, options("cpu:shm").hint("shm_cma", "off"), |pg| {
        let o = OpOptions::default();
        let (r, n) = (pg.rank(), (16 << 20) + 13);
        let pattern = |from: usize| (0..n).map(|i| (i * 7 + i / 4093 + from * 31) as u8 | 1).collect::<Vec<u8>>();
        if r < 2 {
            let peer = 1 - r;
            let mut inp = vec![0u8; n + 8];
            pg.sendrecv(&pattern(r)[..], peer, &mut inp[3..3 + n], peer, 4, &o).unwrap().wait().unwrap();
            assert!(inp[3..3 + n] == pattern(peer)[..], "rank {r}: the message from {peer}");
            assert!(inp[..3].iter().chain(&inp[3 + n..]).all(|b| *b == 0), "rank {r}: wrote outside the receive");
        }
        let mut all = if r == 2 { pattern(2) } else { vec![0u8; n] };
        pg.broadcast(&mut all[..], 2, &o.clone().hint("algorithm", "binomial")).unwrap().wait().unwrap();
        assert!(all == pattern(2), "rank {r}: the broadcast");
    });
}

/// Large frames sent several at once start at their ring's start when it
/// is empty (padding to its end first), and lone receives and the table
/// alike skip the padding: sizes that leave every kind of offset behind,
/// some larger than the ring, between small frames that never pad, and
/// every byte arrives.
#[test]
fn shm_large_frames_rewind_their_rings_and_keep_every_byte() {
    run_threads(3, options("cpu:shm").hint("shm_cma", "off"), |pg| {
        let o = OpOptions::default();
        let r = pg.rank();
        let peers: Vec<usize> = (0..3).filter(|p| *p != r).collect();
        let pattern = |from: usize, to: usize, round: usize, n: usize| -> Vec<u8> {
            (0..n).map(|i| (i.wrapping_mul(31) ^ from.wrapping_mul(7) ^ to.wrapping_mul(3) ^ round) as u8).collect()
        };
        let sizes = [16usize << 10, 100 << 10, 8, 300 << 10, 20 << 10, (1 << 20) + 3, 17 << 10, 8];
        for (round, &n) in sizes.iter().cycle().take(3 * sizes.len()).enumerate() {
            // Every rank to both others at once (the table)...
            let outs: Vec<Vec<u8>> = peers.iter().map(|&p| pattern(r, p, round, n)).collect();
            let mut ins = vec![vec![0u8; n]; 2];
            let mut batch: Vec<P2pOp> = outs.iter().zip(&peers).map(|(d, &p)| P2pOp::send(&d[..], p, 1)).collect();
            batch.extend(ins.iter_mut().zip(&peers).map(|(b, &p)| P2pOp::recv(&mut b[..], p, 1)));
            pg.batch_p2p(batch, &o).unwrap().wait().unwrap();
            for (got, &p) in ins.iter().zip(&peers) {
                assert!(*got == pattern(p, r, round, n), "round {round}: {n} bytes from rank {p}");
            }
            // ...then rank 0 to both in one batch, each read by a lone receive.
            if r == 0 {
                let outs: Vec<Vec<u8>> = peers.iter().map(|&p| pattern(0, p, round + 1, n)).collect();
                let batch = outs.iter().zip(&peers).map(|(d, &p)| P2pOp::send(&d[..], p, 2)).collect();
                pg.batch_p2p(batch, &o).unwrap().wait().unwrap();
            } else {
                let mut got = vec![0u8; n];
                pg.recv(&mut got[..], 0, 2, &o).unwrap().wait().unwrap();
                assert!(got == pattern(0, r, round + 1, n), "round {round}: lone receive of {n} bytes");
            }
        }
    });
}

#[test]
fn shm_sub_groups_and_large_messages() {
    run_threads(4, options("cpu:shm"), |pg| {
        let sub = pg.split(&[3, 1]).unwrap();
        let mut big = vec![pg.rank() as f32; 3 << 20]; // larger than any ring
        std::thread::scope(|t| {
            t.spawn(|| pg.all_reduce(&mut big, ReduceOp::Sum, &OpOptions::default()).unwrap().wait().unwrap());
            if let Some(sub) = &sub {
                let mut v = vec![1u64; 1000];
                sub.all_reduce(&mut v, ReduceOp::Sum, &OpOptions::default()).unwrap().wait().unwrap();
                assert_eq!(v, vec![2; 1000]);
            }
        });
        assert!(big.iter().all(|x| *x == 6.0));
    });
}

/// Large messages go single-copy (pulled with process_vm_readv, or pushed
/// with process_vm_writev by a sender that is receiving too; hint
/// `shm_cma=on`, so on every machine, whatever its copy costs); a rank
/// that refuses (hint `shm_cma=off`) gets them through the ring, in both
/// directions, with identical results; ranks left on `auto` agree on their
/// policy without waiting for one whose hint forces its own.
#[test]
fn shm_single_copy_and_its_refusal_give_the_same_results() {
    for (refusing, others) in [(None, "on"), (Some(1), "on"), (Some(1), "auto"), (Some(1), "large")] {
        let store: std::sync::Arc<dyn weft::store::Store> = std::sync::Arc::new(weft::store::MemoryStore::new(Duration::from_secs(30)));
        let opts = move |r: usize| options("cpu:shm").hint("shm_cma", if Some(r) == refusing { "off" } else { others });
        weft_tests::run_threads_each(store, 3, opts, |pg| {
            let (r, w) = (pg.rank(), pg.size());
            let o = OpOptions::default();
            let n = 300_001; // 1.2 MB: above the single-copy threshold, odd-sized

            // The first offer to rank 1, larger than the 1 MiB rings of three
            // ranks: refused, its payload must stream inline over several rounds.
            let sent: Vec<u32> = (0..n as u32).collect();
            if r == 0 {
                pg.send(&sent[..], 1, 7, &o).unwrap().wait().unwrap();
            } else if r == 1 {
                let mut got = vec![0u32; n];
                pg.recv(&mut got[..], 0, 7, &o).unwrap().wait().unwrap();
                assert_eq!(got, sent);
            }
            for _ in 0..3 {
                let mut b: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 + if r == 2 { 0.5 } else { 0.0 }).collect();
                pg.broadcast(&mut b, 2, &o).unwrap().wait().unwrap();
                assert!(b.iter().enumerate().all(|(i, x)| *x == (i % 1000) as f32 + 0.5));
                let mine: Vec<u32> = (0..n).map(|i| (i * w + r) as u32).collect();
                let mut all = vec![0u32; n * w];
                pg.all_gather_single(&mut all, &mine[..], &o).unwrap().wait().unwrap();
                assert!(all.chunks(n).enumerate().all(|(k, c)| c.iter().enumerate().all(|(i, x)| *x == (i * w + k) as u32)));
                // 1.2 MB parts: like all_gather's, pushed whole by their senders
                // (receiving too, the size of a core's L2), unless refused.
                let input: Vec<u32> = (0..n * w).map(|i| (r * 1_000_000 + i) as u32).collect();
                let mut out = vec![0u32; n * w];
                pg.all_to_all_single(&mut out, &input[..], &o).unwrap().wait().unwrap();
                for (src, c) in out.chunks(n).enumerate() {
                    assert!(c.iter().enumerate().all(|(i, x)| *x == (src * 1_000_000 + r * n + i) as u32));
                }
                // all_reduce's all-gather half and a large reduce's gather
                // send blocks their senders have just reduced: pushed whole,
                // by senders receiving too and by idle ones, unless refused.
                let own = |i: usize| (i % 7 + r) as f32;
                let sum = |i: usize| (3 * (i % 7) + 3) as f32;
                let mut s: Vec<f32> = (0..n).map(own).collect();
                pg.all_reduce(&mut s, ReduceOp::Sum, &o).unwrap().wait().unwrap();
                assert!(s.iter().enumerate().all(|(i, x)| *x == sum(i)));
                let mut s: Vec<f32> = (0..n).map(own).collect();
                pg.reduce(&mut s, 1, ReduceOp::Sum, &o).unwrap().wait().unwrap();
                assert!(s.iter().enumerate().all(|(i, x)| *x == if r == 1 { sum(i) } else { own(i) }));
            }
        });
    }
}

/// A large message whose receive buffer lies 1 to 31 bytes past its send
/// buffer within a page (where the kernel's copy is slow on AMD's Zen
/// cores) is declined single-copy and streams through the ring, into a
/// posted receive or a stash; every byte arrives, and so does every
/// message after it, at distances slow and not.
#[test]
fn shm_messages_at_the_slow_copy_distance_take_the_ring_with_every_byte() {
    run_threads(2, options("cpu:shm").hint("shm_cma", "on"), |pg| {
        let o = OpOptions::default();
        let n = 300_007;
        // A buffer of n bytes starting at page offset `at`.
        let placed = |v: &[u8], at: usize| {
            let skip = (at + 4096 - v.as_ptr() as usize % 4096) % 4096;
            skip..skip + n
        };
        let pairs = [(0, 8), (0, 0), (16, 40), (100, 100), (0, 31), (4000, 4001), (24, 0), (4090, 5)];
        for (round, (from, to)) in pairs.into_iter().enumerate() {
            let data: Vec<u8> = (0..n).map(|i| (i * 7 + round * 13) as u8).collect();
            let mut buf = vec![0u8; n + 4096];
            if pg.rank() == 0 {
                let r = placed(&buf, from);
                buf[r.clone()].copy_from_slice(&data);
                pg.send(&buf[r], 1, round as u32, &o).unwrap().wait().unwrap();
            } else {
                if round % 2 == 1 {
                    // The message comes first and is stashed.
                    std::thread::sleep(Duration::from_millis(20));
                }
                let r = placed(&buf, to);
                pg.recv(&mut buf[r.clone()], 0, round as u32, &o).unwrap().wait().unwrap();
                assert!(buf[r] == data[..], "round {round}: page offsets {from} -> {to}");
            }
            pg.barrier(&o).unwrap().wait().unwrap();
        }
    });
}

/// Large messages are copied by both sides at once (the receiver pulls
/// chunks, the idle sender pushes chunks into the receiver's buffer),
/// also when the receiver has not posted its receive yet (the message
/// lands in a stash) and when receives are posted out of order.
#[test]
fn shm_two_sided_copies_land_in_posted_and_stashed_buffers() {
    run_threads(2, options("cpu:shm").hint("shm_cma", "on"), |pg| {
        let o = OpOptions::default();
        let n = 1_200_003; // 4.8 MB: several chunks, the last one short
        let data = |tag: u32| -> Vec<u32> { (0..n).map(|i| (i as u32).wrapping_mul(2_654_435_761) ^ tag).collect() };
        for _ in 0..3 {
            if pg.rank() == 0 {
                let (a, b) = (data(1), data(2));
                let first = pg.send(&a[..], 1, 1, &o).unwrap();
                let second = pg.send(&b[..], 1, 2, &o).unwrap();
                first.wait().unwrap();
                second.wait().unwrap();
            } else {
                // Tag 1 arrives first and is stashed while tag 2 is awaited.
                std::thread::sleep(Duration::from_millis(20));
                let (mut a, mut b) = (vec![0u32; n], vec![0u32; n]);
                pg.recv(&mut b[..], 0, 2, &o).unwrap().wait().unwrap();
                pg.recv(&mut a[..], 0, 1, &o).unwrap().wait().unwrap();
                assert!(a == data(1) && b == data(2));
            }
            pg.barrier(&o).unwrap().wait().unwrap();
        }
    });
}

/// A large send nobody receives: the sender times out and withdraws its
/// offer (its buffer is its own again); the late receiver gets an error,
/// never the sender's reused memory. (`shm_cma=on`: where kernel copies
/// are slow, the group's own policy starts everything on the ring.)
#[test]
fn shm_withdrawn_single_copy_offer_is_never_read() {
    run_threads(2, options("cpu:shm").hint("shm_cma", "on"), |pg| {
        let o = OpOptions::default().timeout(Duration::from_millis(300));
        if pg.rank() == 0 {
            let mut data = vec![7u8; 1 << 20];
            let e = pg.send(&data[..], 1, 5, &o).unwrap().wait().unwrap_err();
            assert_eq!(e.kind(), &weft::ErrorKind::Timeout, "{e}");
            data.fill(0xEE); // reused: a read now would see this
            std::thread::sleep(Duration::from_millis(600));
        } else {
            std::thread::sleep(Duration::from_millis(500));
            let mut buf = vec![0u8; 1 << 20];
            let r = pg.recv(&mut buf[..], 0, 5, &OpOptions::default().timeout(Duration::from_secs(5))).unwrap().wait();
            assert!(r.is_err(), "a withdrawn message was received");
            assert!(buf.iter().all(|b| *b != 0xEE), "read the sender's reused buffer");
        }
    });
}

#[test]
fn shm_fast_path_agrees_with_the_rings_and_catches_mismatched_calls() {
    let o = OpOptions::default;
    // Integer-valued floats: every summation order gives the same bits.
    let value = |r: usize, i: usize| ((i * 7 + r * 13) % 101) as f32;
    for w in [2, 3, 5] {
        run_threads(w, options("cpu:shm"), move |pg| {
            let r = pg.rank();
            // 1024 f32 = 4096 bytes, the fast path's limit: both sides of it.
            for n in [1usize, 2, 1023, 1024, 1025] {
                let want: Vec<f32> = (0..n).map(|i| (0..w).map(|q| value(q, i)).sum()).collect();
                // "direct": no hint, so core hands the op to the fast path
                // itself (`group/fast.rs`); "on": as a job, through
                // `native_op`; "mixed": odd ranks as a job, even ranks
                // straight to the fast path, in one op; "off": the rings.
                for path in ["direct", "on", "mixed", "off"] {
                    let opts = match path {
                        "direct" => o(),
                        "mixed" => {
                            if r % 2 == 1 {
                                o().hint("shm_fastbox", "on")
                            } else {
                                o()
                            }
                        }
                        p => o().hint("shm_fastbox", p),
                    };
                    let mut v: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
                    pg.all_reduce(&mut v, ReduceOp::Sum, &opts).unwrap().wait().unwrap();
                    assert_eq!(v, want, "all_reduce n={n} fastbox={path} W={w}");
                    let mut b: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
                    pg.broadcast(&mut b, w - 1, &opts).unwrap().wait().unwrap();
                    assert!(b.iter().enumerate().all(|(i, x)| *x == value(w - 1, i)), "broadcast n={n} fastbox={path}");
                    // n elements per rank in all: the whole op on one side of the limit.
                    let part = n.div_ceil(w);
                    let mine: Vec<f32> = (0..part).map(|i| value(r, i)).collect();
                    let mut all = vec![0f32; part * w];
                    pg.all_gather_single(&mut all[..], &mine[..], &opts).unwrap().wait().unwrap();
                    let gathered: Vec<f32> = (0..w).flat_map(|q| (0..part).map(move |i| value(q, i))).collect();
                    assert_eq!(all, gathered, "all_gather part={part} fastbox={path}");
                    let input: Vec<f32> = (0..part * w).map(|j| value(r, j)).collect();
                    let mut out = vec![0f32; part];
                    pg.reduce_scatter_single(&mut out[..], &input[..], ReduceOp::Sum, &opts).unwrap().wait().unwrap();
                    let want: Vec<f32> = (0..part).map(|i| (0..w).map(|q| value(q, r * part + i)).sum()).collect();
                    assert_eq!(out, want, "reduce_scatter part={part} fastbox={path}");
                    // Part q of rank r's input goes to rank q.
                    let mut out = vec![0f32; part * w];
                    pg.all_to_all_single(&mut out[..], &input[..], &opts).unwrap().wait().unwrap();
                    let want: Vec<f32> = (0..w).flat_map(|q| (0..part).map(move |i| value(q, r * part + i))).collect();
                    assert_eq!(out, want, "all_to_all part={part} fastbox={path}");
                    pg.barrier(&opts).unwrap().wait().unwrap();
                }
            }
            // PREMUL_SUM with a factor of its own on each rank, and AVG.
            let mut v = vec![1f64; 3];
            pg.all_reduce(&mut v, ReduceOp::PremulSum(r as f64 + 1.0), &o()).unwrap().wait().unwrap();
            assert_eq!(v, vec![(w * (w + 1) / 2) as f64; 3]);
            let mut v = vec![r as f64; 3];
            pg.all_reduce(&mut v, ReduceOp::Avg, &o()).unwrap().wait().unwrap();
            assert_eq!(v, vec![(w - 1) as f64 / 2.0; 3]);
        });
    }
    // Ranks calling different small collectives: an error on both, no hang,
    // and the group still works afterwards.
    run_threads(2, options("cpu:shm"), move |pg| {
        let mut v = [1f32; 2];
        let o = o().timeout(Duration::from_secs(5));
        let e = if pg.rank() == 0 {
            pg.all_reduce(&mut v[..], ReduceOp::Sum, &o).unwrap().wait().unwrap_err()
        } else {
            pg.broadcast(&mut v[..], 0, &o).unwrap().wait().unwrap_err()
        };
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("mismatched collectives") && e.to_string().contains("broadcast of 8 bytes from root 0"), "{e}");
        pg.barrier(&o).unwrap().wait().unwrap();
        pg.all_reduce(&mut v[..], ReduceOp::Sum, &o).unwrap().wait().unwrap();
        assert_eq!(v, [2.0; 2]);
    });
}

/// A fast broadcast's root leaves at once and a non-root once the root's
/// bytes are there; the rest waits for the rank's next fast op. Back to
/// back from every root in turn (each slot rewritten while slower peers
/// may still be on the op before), mixed with all_reduces and ops through
/// the rings; and calls that differ, which only the next op can find on a
/// root.
#[test]
fn shm_fast_broadcasts_leave_early_and_mismatches_are_still_found() {
    let o = || OpOptions::default().timeout(Duration::from_secs(10));
    for w in [2, 3, 5] {
        run_threads(w, options("cpu:shm"), move |pg| {
            let r = pg.rank();
            for i in 0..300usize {
                let root = (i / 3) % w;
                let mut b = [(r * 1000 + i) as u32; 3];
                let path = if i % 7 == 0 { "off" } else { "on" };
                pg.broadcast(&mut b[..], root, &o().hint("shm_fastbox", path)).unwrap().wait().unwrap();
                assert_eq!(b, [(root * 1000 + i) as u32; 3], "broadcast {i} from {root}, W={w}");
                if i % 5 == 0 {
                    let mut v = [r as u32 + i as u32];
                    pg.all_reduce(&mut v[..], ReduceOp::Sum, &o()).unwrap().wait().unwrap();
                    assert_eq!(v[0] as usize, w * (w - 1) / 2 + w * i, "all_reduce after broadcast {i}, W={w}");
                }
            }
        });
    }
    // Each case: what rank 0 and rank 1 call (a broadcast from root R, or
    // an all_reduce), and which ranks learn of the mismatch at that call
    // and which only at the next (a root waits for no one).
    let call = move |pg: &ProcessGroup, what: Option<usize>| {
        let mut v = [1f32; 2];
        match what {
            Some(root) => pg.broadcast(&mut v[..], root, &o()).unwrap().wait(),
            None => pg.all_reduce(&mut v[..], ReduceOp::Sum, &o()).unwrap().wait(),
        }
    };
    for (calls, now, next) in [
        ([Some(0), Some(1)], [false, false], [true, true]),
        ([Some(1), Some(0)], [true, true], [false, false]),
        ([None, Some(1)], [true, false], [false, true]),
        ([Some(0), None], [false, true], [true, false]),
    ] {
        run_threads(2, options("cpu:shm"), move |pg| {
            let r = pg.rank();
            let first = call(&pg, calls[r]);
            assert_eq!(first.is_err(), now[r], "{calls:?} rank {r} at the call: {first:?}");
            let second = pg.barrier(&o()).unwrap().wait();
            assert_eq!(second.is_err(), next[r], "{calls:?} rank {r} at the next call: {second:?}");
            mismatches_then_it_works(&pg, [first, second]);
        });
    }
}

/// Ranks that outnumber their cores (here three held to one CPU) take a
/// barrier that lets rank 0 go first: the others wait for rank 0 alone,
/// which goes once every rank has arrived. It still holds every rank until
/// all have arrived, mixed with fast ops that reuse the slots around it; a
/// rank that called something else is still found, by rank 0 at once and
/// by a rank that left early at its next call; and a rank that never
/// comes holds everyone, who all blame it.
#[test]
fn shm_oversubscribed_barrier_lets_rank_zero_go_first_and_still_holds_everyone() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    // This thread, and the rank threads it starts, on one CPU.
    let mine = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
    let cpu = (0..nix::sched::CpuSet::count()).find(|&c| mine.is_set(c).unwrap_or(false)).unwrap();
    let mut one = nix::sched::CpuSet::new();
    one.set(cpu).unwrap();
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &one).unwrap();
    let o = || OpOptions::default().timeout(Duration::from_secs(10));
    let arrived = std::sync::Arc::new(AtomicUsize::new(0));
    let count = arrived.clone();
    run_threads(3, options("cpu:shm"), move |pg| {
        let r = pg.rank();
        for i in 0..200usize {
            count.fetch_add(1, Ordering::SeqCst);
            pg.barrier(&o()).unwrap().wait().unwrap();
            assert_eq!(count.load(Ordering::SeqCst), 3 * (i + 1), "rank {r} left barrier {i} before every rank arrived");
            let mut v = [(r + i) as u32];
            pg.all_reduce(&mut v[..], ReduceOp::Sum, &o()).unwrap().wait().unwrap();
            assert_eq!(v[0] as usize, 3 + 3 * i, "all_reduce {i}");
            let mut b = [(r * 100 + i) as u32; 2];
            pg.broadcast(&mut b[..], i % 3, &o()).unwrap().wait().unwrap();
            assert_eq!(b, [((i % 3) * 100 + i) as u32; 2], "broadcast {i}");
            pg.barrier(&o()).unwrap().wait().unwrap();
        }
    });
    // Rank 1 calls an all_reduce where ranks 0 and 2 call a barrier.
    run_threads(3, options("cpu:shm"), move |pg| {
        let r = pg.rank();
        let mut v = [1f32; 2];
        let first = if r == 1 { pg.all_reduce(&mut v[..], ReduceOp::Sum, &o()) } else { pg.barrier(&o()) }.unwrap().wait();
        let second = pg.barrier(&o()).unwrap().wait();
        // Rank 0 and rank 1 see it at the call; rank 2, which waited for
        // rank 0 alone, at its next.
        assert_eq!((first.is_err(), second.is_err()), (r != 2, r == 2), "rank {r}: {first:?}, then {second:?}");
        mismatches_then_it_works(&pg, [first, second]);
    });
    // Rank 1 never comes: rank 0 gives up without letting rank 2 go, and
    // both blame rank 1 (rank 2 waited for rank 0 alone).
    run_threads(3, options("cpu:shm"), move |pg| {
        let r = pg.rank();
        if r == 1 {
            std::thread::sleep(Duration::from_millis(1500));
            return;
        }
        let e = pg.barrier(&OpOptions::default().timeout(Duration::from_millis(500))).unwrap().wait().unwrap_err();
        assert_eq!(e.blamed_peer(), Some(1), "rank {r}: {e}");
    });
}

/// Every error among `results` is a mismatch (`InvalidArgument`), and the
/// group goes on working: an all_reduce of the ranks' numbers.
fn mismatches_then_it_works(pg: &ProcessGroup, results: [weft::Result<()>; 2]) {
    for e in results.into_iter().filter_map(|x| x.err()) {
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("mismatched collectives"), "{e}");
    }
    let (r, w) = (pg.rank(), pg.size());
    let mut v = [r as f32; 2];
    pg.all_reduce(&mut v[..], ReduceOp::Sum, &OpOptions::default().timeout(Duration::from_secs(10))).unwrap().wait().unwrap();
    assert_eq!(v, [(w * (w - 1) / 2) as f32; 2]);
}

/// all_to_all takes the fast path only if every rank's parts fit in its
/// slot. Here, every other time, rank 0's do not while the others' do: rank
/// 0 publishes that and goes to the rings at once, the others see it and
/// follow. Fast ops in between reuse the same slots.
#[test]
fn shm_fast_all_to_all_falls_back_together_when_one_rank_does_not_fit() {
    let o = OpOptions::default;
    for w in [2, 3] {
        run_threads(w, options("cpu:shm"), move |pg| {
            let r = pg.rank();
            // Elements rank s sends rank d: 1100 f32 (4400 bytes) from rank 0 when `big`.
            let count = |s: usize, d: usize, big: bool| if big && s == 0 { 1100 } else { 1 + (s + 2 * d) % 3 };
            let value = |s: usize, d: usize, i: usize| (s * 1000 + d * 100 + i % 97) as f32;
            for round in 0..40 {
                let big = round % 2 == 0;
                let send: Vec<usize> = (0..w).map(|d| count(r, d, big)).collect();
                let recv: Vec<usize> = (0..w).map(|s| count(s, r, big)).collect();
                let input: Vec<f32> = (0..w).flat_map(|d| (0..send[d]).map(move |i| value(r, d, i))).collect();
                let mut out = vec![0f32; recv.iter().sum()];
                pg.all_to_all_v_single(&mut out[..], &input[..], &recv, &send, &o()).unwrap().wait().unwrap();
                let want: Vec<f32> = (0..w).flat_map(|s| (0..recv[s]).map(move |i| value(s, r, i))).collect();
                assert_eq!(out, want, "round {round} W={w}");
                let mut v = [r as f32; 2];
                pg.all_reduce(&mut v[..], ReduceOp::Sum, &o()).unwrap().wait().unwrap();
                assert_eq!(v, [(w * (w - 1) / 2) as f32; 2], "round {round} W={w}");
            }
        });
    }
}

#[test]
fn shm_sigkill_mid_op_gives_peer_lost_and_leaves_dev_shm_clean() {
    let worker = env!("CARGO_BIN_EXE_weft-test-worker");
    // Large all_reduces (through the rings only, and single copy as well),
    // 8-byte ones (the fast path) and all_gathers whose parts senders push.
    for (scenario, cma) in [("sigkill", "off"), ("sigkill", "on"), ("sigkill_small", "auto"), ("sigkill_all_gather", "on")] {
        let ends = run_world(worker, 3, &[scenario], &[("WEFT_BACKEND", "cpu:shm"), ("WEFT_SHM_CMA", cma)], Duration::from_secs(90));
        let victim = &ends[2];
        assert_eq!(victim.status.signal(), Some(9), "{}", victim.output);
        for (r, e) in ends[..2].iter().enumerate() {
            assert!(e.status.success(), "{scenario} (cma {cma}) rank {r}: {:?}\n{}", e.status, e.output);
            assert!(e.at.saturating_duration_since(victim.at) < Duration::from_secs(10), "{scenario} (cma {cma}) rank {r} was late");
        }
        assert_all_clean(&ends);
    }
    let ends = run_world(worker, 3, &["ops"], &[("WEFT_BACKEND", "cpu:shm")], Duration::from_secs(60));
    for e in &ends {
        assert!(e.status.success(), "{}", e.output);
    }
    assert_all_clean(&ends);
}

#[test]
fn shm_a_dead_peer_left_unreaped_is_lost_not_waited_for() {
    // The last rank dies mid-op, but its parent does not reap it for 8 s:
    // kill(pid, 0) still finds the zombie. The others must name it well
    // before it is reaped, and before their 30 s timeout.
    let worker = env!("CARGO_BIN_EXE_weft-test-worker");
    let env = [("WEFT_BACKEND", "cpu:shm"), ("WEFT_TIMEOUT_SECONDS", "30")];
    let ends = run_world(worker, 3, &["zombie"], &env, Duration::from_secs(90));
    let reaped = ends[2].at;
    for (r, e) in ends[..2].iter().enumerate() {
        assert!(e.status.success(), "rank {r}: {:?}\n{}", e.status, e.output);
        assert!(e.output.contains("zombie"), "rank {r} names the zombie: {}", e.output);
        assert!(reaped.saturating_duration_since(e.at) > Duration::from_secs(4), "rank {r} waited for the reaping");
    }
    assert_all_clean(&ends);
}

/// No segment of these processes is left in /dev/shm.
fn assert_all_clean(ends: &[weft_tests::procs::RankEnd]) {
    let _ = ends;
    let stale = weft_tests::procs::shm_segments();
    assert!(stale.is_empty(), "left in /dev/shm: {stale:?}");
}

#[test]
fn auto_picks_shm_on_one_host_and_leaves_it_when_a_rank_looks_remote() {
    let worker = env!("CARGO_BIN_EXE_weft-test-worker");
    for e in run_world(worker, 3, &["which_backend"], &[("WEFT_BACKEND", "auto")], Duration::from_secs(60)) {
        assert!(e.status.success() && e.output.contains("backend=shm"), "{}", e.output);
    }
    // Rank 2 claims another host: shm refuses the group and auto falls back.
    let vars = |r: usize, port: &str| {
        let mut v = torchrun_vars(r, 3, port, &[("WEFT_BACKEND", "auto".into())]);
        if r == 2 {
            v.push(("WEFT_HOST_ID".into(), "elsewhere".into()));
        }
        v
    };
    // Ranks 0 and 1 still share a host: the hierarchical backend takes it.
    for e in run_world_on_free_port(worker, 3, &["which_backend"], &[], Duration::from_secs(60), vars) {
        assert!(e.status.success() && e.output.contains("backend=hierarchical"), "{}", e.output);
    }
}

/// What a run of the `adaptive_schemes` scenario (1,500 checked all_gathers
/// of 1 MiB parts, W = 2) under the `slow_copies` shim showed: the lines
/// each rank logged when the group's table changed its scheme for a key,
/// and the copies the shim counted (cross-memory, large `memcpy`) over
/// both ranks.
struct AdaptiveRun {
    moves: [Vec<String>; 2],
    /// The lines each rank logged when the table changed a key's
    /// exploring pace.
    paces: [Vec<String>; 2],
    cma_copies: u64,
    large_memcpys: u64,
    /// Rank 0's output (the decider says why it moved).
    decider: String,
}

/// Run `adaptive_schemes` with policy `cma` and `shm_adapt` as `adapt`,
/// under the shim with `slow` (its variables).
fn adaptive_run(cma: &str, adapt: &str, slow: &[(&str, &str)]) -> AdaptiveRun {
    let worker = env!("CARGO_BIN_EXE_weft-test-worker");
    // A folder per run: tests run side by side, and each removes its own.
    let dir = weft_tests::plugins::scratch(&format!("slow-copies-{cma}-{adapt}"));
    let shim = dir.join("slow_copies.so");
    weft_tests::plugins::cc(&weft_tests::plugins::repo().join("tests/shims/slow_copies.c"), &shim, &[]);
    let shim = shim.to_str().unwrap();
    let mut env =
        vec![("WEFT_BACKEND", "cpu:shm"), ("WEFT_LOG", "debug"), ("WEFT_SHM_CMA", cma), ("WEFT_SHM_ADAPT", adapt), ("LD_PRELOAD", shim)];
    env.extend_from_slice(slow);
    let ends = run_world(worker, 2, &["adaptive_schemes"], &env, Duration::from_secs(120));
    for (r, e) in ends.iter().enumerate() {
        assert!(e.status.success(), "{cma}, adapt {adapt}, rank {r}: {:?}\n{}", e.status, e.output);
        assert!(e.output.contains("done on shm"), "{cma}, adapt {adapt}, rank {r}:\n{}", e.output);
    }
    let lines = |output: &str, what: &dyn Fn(&str) -> bool| -> Vec<String> {
        output.lines().filter(|l| l.contains("shm: ") && what(l)).map(|l| l.trim().to_string()).collect()
    };
    let moves = |output: &str| lines(output, &|l| l.contains(" from exchange ") && !l.contains(" -> "));
    let paces = |output: &str| lines(output, &|l| l.contains(" exploring pace "));
    // "slow_copies: N cross-memory, M large memcpy", at exit.
    let counts = |output: &str| -> (u64, u64) {
        let line = output.lines().find_map(|l| l.strip_prefix("slow_copies: ")).expect("the shim's counts");
        let mut n = line.split(", ").map(|part| part.split(' ').next().unwrap().parse::<u64>().unwrap());
        (n.next().unwrap(), n.next().unwrap())
    };
    let (a, b) = (counts(&ends[0].output), counts(&ends[1].output));
    AdaptiveRun {
        moves: [moves(&ends[0].output), moves(&ends[1].output)],
        paces: [paces(&ends[0].output), paces(&ends[1].output)],
        cma_copies: a.0 + b.0,
        large_memcpys: a.1 + b.1,
        decider: ends[0].output.clone(),
    }
}

/// The ranks of an adapting run moved `to` a scheme, together: the same
/// key to the same scheme at the same exchange on both, and the decider
/// said why.
fn moved_together(run: &AdaptiveRun, to: &str) {
    let [zero, one] = &run.moves;
    assert!(zero.iter().any(|l| l.contains(&format!("Some({to}) from exchange"))), "rank 0 never moved to {to}:\n{}", run.decider);
    assert_eq!(zero, one, "the ranks moved apart");
    assert!(run.decider.contains(&format!("-> {to} (median")), "{}", run.decider);
}

/// Where cross-memory copies turn slow while the run goes (the shim adds
/// 2 ms a MiB to every `process_vm_readv`/`writev` after a process's first
/// 200, as page pinning under some hypervisors does), shm moves 1 MiB
/// all_gathers from single copy (the policy `shm_cma=on`, on every host)
/// to the ring by what it measures, every rank at the same exchange, after
/// which only the exploring bursts copy across processes; every result
/// stays exact. With `shm_adapt=off` every op keeps copying across
/// processes, as slow as that is.
#[test]
fn shm_moves_large_messages_to_the_ring_when_cross_memory_copies_turn_slow_and_every_rank_moves_together() {
    let slow = [("SLOW_CMA_AFTER", "200"), ("SLOW_CMA_NS_PER_BYTE", "2")];
    let adapting = adaptive_run("on", "on", &slow);
    moved_together(&adapting, "Ring");
    let fixed = adaptive_run("on", "off", &slow);
    assert!(fixed.moves.iter().all(Vec::is_empty), "{:?}", fixed.moves);
    // 1,500 all_gathers: about a copy per op and rank kept single copy; moved
    // to the ring after a few hundred, only the bursts exploring the others.
    let made = [adapting.cma_copies, fixed.cma_copies];
    assert!(made[0] * 2 < made[1], "cross-memory copies adapting and not: {made:?}");
}

/// Where every other scheme stays far dearer than the one a kind runs (the
/// ring, where kernel copies are slow, as on this project's machines),
/// rank 0 slows how often the kind explores, and every rank takes each new
/// pace at the same exchange (each logs it); every result stays exact.
/// (Where kernel copies are cheap, single copy may be the cheaper or come
/// close, and nothing slows: the test then checks only that the ranks
/// agree.)
#[test]
fn shm_ranks_slow_their_exploring_together() {
    let run = adaptive_run("ring", "on", &[]);
    let [zero, one] = &run.paces;
    assert_eq!(zero, one, "the ranks changed pace apart");
    // Where rank 0's decisions apply from: "... one exploring burst in N
    // exchanges, starting with exchange F", and a move's "... from exchange
    // F" (which brings full pace back too).
    let after = |l: &str, marker: &str| l.split(marker).nth(1)?.trim().parse::<u64>().ok();
    let paced: Vec<u64> = run.decider.lines().filter_map(|l| after(l, "starting with exchange ")).collect();
    let moved = run.decider.lines().filter(|l| l.contains(" -> ")).filter_map(|l| after(l, " from exchange "));
    let froms: Vec<u64> = paced.iter().copied().chain(moved).collect();
    for line in zero {
        let at = after(line, " at exchange ").expect("an exchange number");
        assert!(froms.contains(&at), "a pace taken at exchange {at}, where none was set:\n{}", run.decider);
    }
    let decided = paced.iter().filter(|from| **from < 1500).count();
    assert!(zero.len() >= decided, "every pace rank 0 set was taken:\n{}", run.decider);
}

/// The other way round: where the group starts every message on the ring
/// (the policy `shm_cma=ring`, taken where kernel copies are slow) and
/// copies through shared memory turn slow while the run goes (the shim
/// adds 2 ms a MiB to every `memcpy` of 16 KiB or more after a process's
/// first 3,000, as cross-core hand-overs slow down in a VM's slow phases;
/// an op's own output copy slows alike whatever the scheme), shm moves
/// the all_gathers to single copy, every rank at the same exchange; every
/// result stays exact. Kept on the ring, every op pays for its two copies
/// through the ring. (Where kernel copies are slow, as on this project's
/// machines, nothing moves without the shim's slowdown; where they are
/// cheap, single copy wins from the first exchanges whatever the shim
/// does, and the test then checks only that the ranks move together and
/// copy less.)
#[test]
fn shm_moves_large_messages_off_the_ring_when_its_copies_turn_slow_and_every_rank_moves_together() {
    let slow = [("SLOW_MEMCPY_AFTER", "3000"), ("SLOW_MEMCPY_NS_PER_BYTE", "2")];
    let adapting = adaptive_run("ring", "on", &slow);
    // Either single copy will do (`moved_together` fails if neither came).
    let to = if adapting.decider.contains("-> Push (median") { "Push" } else { "Pull" };
    moved_together(&adapting, to);
    let fixed = adaptive_run("ring", "off", &slow);
    assert!(fixed.moves.iter().all(Vec::is_empty) && fixed.cma_copies == 0, "{:?}, {} cross-memory copies", fixed.moves, fixed.cma_copies);
    let made = [adapting.large_memcpys, fixed.large_memcpys];
    assert!(made[0] * 3 < made[1] * 2, "large copies adapting and not: {made:?}");
}
