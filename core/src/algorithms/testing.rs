//! An in-memory mailbox backend for unit tests of the algorithms: ranks are
//! threads, messages are queued per (source, destination, tag).

use crate::backend::{Backend, Capabilities, Deadline, OpContext, OpKind, P2p};
use crate::error::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Messages by (source, destination, tag).
type Queues = HashMap<(usize, usize, u64), VecDeque<Vec<u8>>>;

#[derive(Default)]
pub struct Mailboxes {
    queues: Mutex<Queues>,
    cv: Condvar,
    /// (source, destination) of every message with a payload.
    pub hops: Mutex<std::collections::BTreeSet<(usize, usize)>>,
}

pub struct MailBackend {
    pub rank: usize,
    pub boxes: Arc<Mailboxes>,
    /// Its capabilities: the default, with a rank order where a test gives one.
    pub caps: Capabilities,
}

impl Backend for MailBackend {
    fn name(&self) -> &str {
        "test-mailbox"
    }
    fn exchange(&self, ops: &mut [P2p<'_>], deadline: &Deadline) -> Result<()> {
        let deadline = deadline.get();
        for op in ops.iter() {
            if let P2p::Send { peer, tag, data } = op {
                self.boxes.queues.lock().unwrap().entry((self.rank, *peer, *tag)).or_default().push_back(data.to_vec());
                if !data.is_empty() {
                    self.boxes.hops.lock().unwrap().insert((self.rank, *peer));
                }
                self.boxes.cv.notify_all();
            }
        }
        for op in ops.iter_mut() {
            if let P2p::Recv { peer, tag, buf } = op {
                let mut q = self.boxes.queues.lock().unwrap();
                loop {
                    if let Some(m) = q.get_mut(&(*peer, self.rank, *tag)).and_then(|d| d.pop_front()) {
                        if m.len() != buf.len() {
                            return Err(Error::backend(format!("size mismatch from {peer}: {} vs {}", m.len(), buf.len())));
                        }
                        buf.copy_from_slice(&m);
                        break;
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(Error::timeout(format!("recv from {peer}")));
                    }
                    q = self.boxes.cv.wait_timeout(q, deadline - now).unwrap().0;
                }
            }
        }
        Ok(())
    }
    fn abort(&self, _: &Error) {}
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }
}

/// Run `f(rank, backend, ctx)` on `w` threads and collect the results in rank order.
pub fn run_ranks<T: Send>(w: usize, kind: OpKind, f: impl Fn(usize, &dyn Backend, &OpContext) -> T + Sync) -> Vec<T> {
    run_ranks_with(w, kind, &[], f)
}

/// The algorithm a hint names for an op of `kind`, as a group settles it
/// when the op is issued.
fn algorithm(kind: OpKind, hints: &std::collections::HashMap<String, String>) -> Option<&'static str> {
    let family = super::select::Family::of(kind)?;
    super::select::forced(family, Some(hints.get("algorithm")?), &Default::default(), &[]).expect("a known algorithm")
}

/// As [`run_ranks`], with op hints (e.g. `("algorithm", "ring")`).
pub fn run_ranks_with<T: Send>(
    w: usize,
    kind: OpKind,
    hints: &[(&str, &str)],
    f: impl Fn(usize, &dyn Backend, &OpContext) -> T + Sync,
) -> Vec<T> {
    run_ranks_on(&Arc::default(), None, w, kind, hints, f)
}

/// As [`run_ranks_with`], over `boxes` (which then show the hops taken),
/// with a backend that gives `order` as its [`Capabilities::rank_order`](crate::backend::Capabilities::rank_order).
pub fn run_ranks_on<T: Send>(
    boxes: &Arc<Mailboxes>,
    order: Option<&[usize]>,
    w: usize,
    kind: OpKind,
    hints: &[(&str, &str)],
    f: impl Fn(usize, &dyn Backend, &OpContext) -> T + Sync,
) -> Vec<T> {
    let hints: std::collections::HashMap<String, String> = hints.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..w)
            .map(|rank| {
                let b = MailBackend {
                    rank,
                    boxes: boxes.clone(),
                    caps: Capabilities { rank_order: order.map(<[usize]>::to_vec), ..Capabilities::DEFAULT },
                };
                let (f, hints) = (&f, &hints);
                s.spawn(move || {
                    let ctx = OpContext {
                        rank,
                        size: w,
                        name: "test",
                        kind,
                        seq: 0,
                        shape: 0,
                        deadline: crate::backend::Deadline::after(Duration::from_secs(20)),
                        hints: hints.clone(),
                        // As a group settles it when the op is issued.
                        algorithm: algorithm(kind, hints),
                        segment_bytes: hints.get("segment_bytes").map(|v| super::select::parse_segment_bytes(v).expect("a valid size")),
                        stream: None,
                        completion: Default::default(),
                    };
                    f(rank, &b, &ctx)
                })
            })
            .collect();
        let results = hs.into_iter().map(|h| h.join().unwrap()).collect();
        // Every message sent was received: a stray one would be kept by a
        // real transport for a receive that never comes.
        let queues = boxes.queues.lock().unwrap();
        let stray: Vec<_> = queues.iter().filter(|(_, q)| !q.is_empty()).map(|((from, to, tag), q)| (from, to, tag, q.len())).collect();
        assert!(stray.is_empty(), "messages no rank received (from, to, tag, count): {stray:?}");
        results
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::run;
    use crate::backend::Op;
    use crate::reduce_op::ReduceOp;
    use crate::tensor::{Tensor, TensorMut};

    fn data(rank: usize, n: usize) -> Vec<i64> {
        (0..n).map(|i| (rank * 1000 + i) as i64).collect()
    }

    #[test]
    fn every_generic_algorithm_at_world_sizes_1_to_8() {
        for w in 1..=8 {
            for n in [0usize, 1, 7, 64] {
                // all_reduce sum / max
                for op in [ReduceOp::Sum, ReduceOp::Max] {
                    let out = run_ranks(w, OpKind::AllReduce, |r, b, c| {
                        let mut v = data(r, n);
                        run(b, &mut Op::AllReduce { buf: TensorMut::from_slice(&mut v), op }, c).unwrap();
                        v
                    });
                    let expect: Vec<i64> = (0..n)
                        .map(|i| {
                            let it = (0..w).map(|r| data(r, n)[i]);
                            if op == ReduceOp::Sum {
                                it.sum()
                            } else {
                                it.max().unwrap()
                            }
                        })
                        .collect();
                    assert!(out.iter().all(|o| *o == expect), "all_reduce w={w} n={n} {op}");
                }
                for root in 0..w {
                    let out = run_ranks(w, OpKind::Broadcast, |r, b, c| {
                        let mut v = data(r, n);
                        run(b, &mut Op::Broadcast { buf: TensorMut::from_slice(&mut v), root }, c).unwrap();
                        v
                    });
                    assert!(out.iter().all(|o| *o == data(root, n)), "broadcast w={w} root={root}");
                    let out = run_ranks(w, OpKind::Reduce, |r, b, c| {
                        let mut v = data(r, n);
                        run(b, &mut Op::Reduce { buf: TensorMut::from_slice(&mut v), root, op: ReduceOp::Sum }, c).unwrap();
                        v
                    });
                    let sum: Vec<i64> = (0..n).map(|i| (0..w).map(|r| data(r, n)[i]).sum()).collect();
                    for (r, o) in out.iter().enumerate() {
                        assert_eq!(*o, if r == root { sum.clone() } else { data(r, n) }, "reduce w={w} root={root}");
                    }
                }
                // uneven all_gather: rank r contributes r+n elements (both ways)
                for algo in ["ring", "at_once"] {
                    let out = run_ranks_with(w, OpKind::AllGather, &[("algorithm", algo)], |r, b, c| {
                        let input = data(r, r + n);
                        let mut outs: Vec<Vec<i64>> = (0..w).map(|i| vec![0; i + n]).collect();
                        let views = outs.iter_mut().map(|o| TensorMut::from_slice(o)).collect();
                        run(b, &mut Op::AllGather { input: Tensor::from_slice(&input), outputs: views }, c).unwrap();
                        outs
                    });
                    let expect: Vec<Vec<i64>> = (0..w).map(|i| data(i, i + n)).collect();
                    assert!(out.iter().all(|o| *o == expect), "all_gather_v {algo} w={w} n={n}");
                }
                // reduce_scatter_v: block i has i+n elements
                let out = run_ranks(w, OpKind::ReduceScatter, |r, b, c| {
                    let ins: Vec<Vec<i64>> = (0..w).map(|i| data(r + i, i + n)).collect();
                    let mut o = vec![0i64; r + n];
                    let views = ins.iter().map(|v| Tensor::from_slice(v)).collect();
                    run(b, &mut Op::ReduceScatter { inputs: views, output: TensorMut::from_slice(&mut o), op: ReduceOp::Sum }, c).unwrap();
                    o
                });
                for (r, o) in out.iter().enumerate() {
                    let e: Vec<i64> = (0..r + n).map(|i| (0..w).map(|s| data(s + r, r + n)[i]).sum()).collect();
                    assert_eq!(*o, e, "reduce_scatter_v w={w} r={r}");
                }
                // all_to_all with sizes depending on (src, dst), both ways
                for algo in ["pairwise", "at_once"] {
                    let out = run_ranks_with(w, OpKind::AllToAll, &[("algorithm", algo)], |r, b, c| {
                        let ins: Vec<Vec<i64>> = (0..w).map(|d| data(r * 10 + d, (r + d) % 3 + n)).collect();
                        let mut outs: Vec<Vec<i64>> = (0..w).map(|s| vec![0; (s + r) % 3 + n]).collect();
                        let iv = ins.iter().map(|v| Tensor::from_slice(v)).collect();
                        let ov = outs.iter_mut().map(|v| TensorMut::from_slice(v)).collect();
                        run(b, &mut Op::AllToAll { inputs: iv, outputs: ov }, c).unwrap();
                        outs
                    });
                    for (r, outs) in out.iter().enumerate() {
                        for (s, o) in outs.iter().enumerate() {
                            assert_eq!(*o, data(s * 10 + r, (s + r) % 3 + n), "all_to_all {algo} w={w}");
                        }
                    }
                }
                let _ = run_ranks(w, OpKind::Barrier, |_, b, c| run(b, &mut Op::Barrier, c).unwrap());
            }
        }
    }
}

#[cfg(test)]
mod algorithm_tests {
    use super::*;
    use crate::algorithms::run;
    use crate::backend::Op;
    use crate::reduce_op::ReduceOp;
    use crate::tensor::{Tensor, TensorMut};

    #[test]
    fn every_all_reduce_and_broadcast_algorithm_at_every_world_size() {
        for w in 1..=8 {
            // 0, 1, odd, not divisible by W, and more than W elements.
            for n in [0usize, 1, 5, 7 * w + 3] {
                for algo in ["ring", "recursive_doubling", "halving_doubling"] {
                    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::PremulSum(0.5)] {
                        let out = run_ranks_with(w, OpKind::AllReduce, &[("algorithm", algo)], |r, b, c| {
                            let mut v: Vec<f64> = (0..n).map(|i| (r * 3 + i) as f64).collect();
                            run(b, &mut Op::AllReduce { buf: TensorMut::from_slice(&mut v), op }, c).unwrap();
                            v
                        });
                        let expect: Vec<f64> = (0..n)
                            .map(|i| {
                                let s: f64 = (0..w).map(|r| (r * 3 + i) as f64).sum();
                                match op {
                                    ReduceOp::Avg => s / w as f64,
                                    ReduceOp::PremulSum(f) => s * f,
                                    _ => s,
                                }
                            })
                            .collect();
                        for (r, o) in out.iter().enumerate() {
                            assert_eq!(o, &expect, "{algo} w={w} n={n} {op} rank {r}");
                        }
                    }
                }
                for algo in ["binomial", "reduce_scatter_gather"] {
                    for root in [0, w - 1] {
                        let out = run_ranks_with(w, OpKind::Reduce, &[("algorithm", algo)], |r, b, c| {
                            let mut v: Vec<i64> = (0..n).map(|i| (r * 10 + i) as i64).collect();
                            run(b, &mut Op::Reduce { buf: TensorMut::from_slice(&mut v), root, op: ReduceOp::Sum }, c).unwrap();
                            v
                        });
                        let sum: Vec<i64> = (0..n).map(|i| (0..w).map(|r| (r * 10 + i) as i64).sum()).collect();
                        for (r, o) in out.iter().enumerate() {
                            let own: Vec<i64> = (0..n).map(|i| (r * 10 + i) as i64).collect();
                            assert_eq!(*o, if r == root { sum.clone() } else { own }, "reduce {algo} w={w} n={n} root={root}");
                        }
                    }
                }
                for algo in ["binomial", "scatter_allgather", "chain"] {
                    for root in [0, w - 1] {
                        let out = run_ranks_with(w, OpKind::Broadcast, &[("algorithm", algo)], |r, b, c| {
                            let mut v: Vec<u8> = (0..n).map(|i| (r * 31 + i) as u8).collect();
                            run(b, &mut Op::Broadcast { buf: TensorMut::from_slice(&mut v), root }, c).unwrap();
                            v
                        });
                        let expect: Vec<u8> = (0..n).map(|i| (root * 31 + i) as u8).collect();
                        assert!(out.iter().all(|o| *o == expect), "{algo} w={w} n={n} root={root}");
                    }
                }
            }
        }
    }

    /// Rings and chains go along the backend's rank order: data moves only
    /// between neighbours in it (a chain from its root on, a ring all
    /// round), and every result is what rank order gives, uneven blocks
    /// included.
    #[test]
    fn rings_and_chains_follow_the_rank_order() {
        let order = [0, 2, 4, 6, 1, 3, 5, 7];
        let (w, n) = (8, 1000);
        let ring: std::collections::BTreeSet<(usize, usize)> = (0..w).map(|k| (order[k], order[(k + 1) % w])).collect();
        let data = |r: usize, len: usize| -> Vec<i64> { (0..len).map(|i| (r * 1000 + i * 7) as i64).collect() };
        let on = |kind, hints: &[(&str, &str)], f: &(dyn Fn(usize, &dyn Backend, &OpContext) -> Vec<i64> + Sync)| {
            let boxes = Arc::default();
            let out = run_ranks_on(&boxes, Some(&order), w, kind, hints, f);
            let hops = boxes.hops.lock().unwrap().clone();
            (out, hops)
        };
        for root in 0..w {
            let (out, hops) = on(OpKind::Broadcast, &[("algorithm", "chain"), ("segment_bytes", "96")], &|r, b, c| {
                let mut v = data(r, n);
                run(b, &mut Op::Broadcast { buf: TensorMut::from_slice(&mut v), root }, c).unwrap();
                v
            });
            assert!(out.iter().all(|o| *o == data(root, n)), "chain root {root}");
            let start = order.iter().position(|&r| r == root).unwrap();
            let line: std::collections::BTreeSet<_> = (0..w - 1).map(|k| (order[(start + k) % w], order[(start + k + 1) % w])).collect();
            assert_eq!(hops, line, "chain root {root}: data went between other ranks");
        }
        let sum: Vec<i64> = (0..n).map(|i| (0..w).map(|r| data(r, n)[i]).sum()).collect();
        let (out, hops) = on(OpKind::AllReduce, &[("algorithm", "ring"), ("segment_bytes", "96")], &|r, b, c| {
            let mut v = data(r, n);
            run(b, &mut Op::AllReduce { buf: TensorMut::from_slice(&mut v), op: ReduceOp::Sum }, c).unwrap();
            v
        });
        assert!(out.iter().all(|o| *o == sum) && hops == ring, "all_reduce: {hops:?}");
        // Uneven blocks: rank r gathers i + 3 elements from rank i, and
        // reduces block i of i + 3 elements.
        let (out, hops) = on(OpKind::AllGather, &[("algorithm", "ring")], &|r, b, c| {
            let input = data(r, r + 3);
            let mut outs: Vec<Vec<i64>> = (0..w).map(|i| vec![0; i + 3]).collect();
            let views = outs.iter_mut().map(|o| TensorMut::from_slice(o)).collect();
            run(b, &mut Op::AllGather { input: Tensor::from_slice(&input), outputs: views }, c).unwrap();
            outs.concat()
        });
        let gathered: Vec<i64> = (0..w).flat_map(|i| data(i, i + 3)).collect();
        assert!(out.iter().all(|o| *o == gathered) && hops == ring, "all_gather: {hops:?}");
        let (out, hops) = on(OpKind::ReduceScatter, &[], &|r, b, c| {
            let ins: Vec<Vec<i64>> = (0..w).map(|i| data(r + i, i + 3)).collect();
            let mut o = vec![0i64; r + 3];
            let views = ins.iter().map(|v| Tensor::from_slice(v)).collect();
            run(b, &mut Op::ReduceScatter { inputs: views, output: TensorMut::from_slice(&mut o), op: ReduceOp::Sum }, c).unwrap();
            o
        });
        for (r, o) in out.iter().enumerate() {
            let e: Vec<i64> = (0..r + 3).map(|i| (0..w).map(|s| data(s + r, r + 3)[i]).sum()).collect();
            assert_eq!(*o, e, "reduce_scatter rank {r}");
        }
        assert_eq!(hops, ring, "reduce_scatter");
        // Rooted forms over the ring: their last step goes to or from the root.
        for root in [0, 5] {
            let (out, _) = on(OpKind::Broadcast, &[("algorithm", "scatter_allgather")], &|r, b, c| {
                let mut v = data(r, n);
                run(b, &mut Op::Broadcast { buf: TensorMut::from_slice(&mut v), root }, c).unwrap();
                v
            });
            assert!(out.iter().all(|o| *o == data(root, n)), "scatter_allgather root {root}");
            let (out, _) = on(OpKind::Reduce, &[("algorithm", "reduce_scatter_gather")], &|r, b, c| {
                let mut v = data(r, n);
                run(b, &mut Op::Reduce { buf: TensorMut::from_slice(&mut v), root, op: ReduceOp::Sum }, c).unwrap();
                v
            });
            assert_eq!(out[root], sum, "reduce_scatter_gather root {root}");
        }
    }

    /// Where contributions meet, bits can depend on the order they combine
    /// in (min and max of -0.0 and +0.0; which NaN payload survives): every
    /// rank must still end with the same bits.
    #[test]
    fn all_reduce_leaves_the_same_bits_on_every_rank() {
        for w in 2..=8 {
            for algo in ["ring", "recursive_doubling", "halving_doubling"] {
                for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max] {
                    let out = run_ranks_with(w, OpKind::AllReduce, &[("algorithm", algo)], |r, b, c| {
                        let zero = if r % 2 == 0 { -0.0f32 } else { 0.0 };
                        let mut v: Vec<f32> =
                            (0..3 * w).map(|i| if i % 2 == 0 { zero } else { f32::from_bits(0x7fc0_0000 | (r as u32 + 1)) }).collect();
                        run(b, &mut Op::AllReduce { buf: TensorMut::from_slice(&mut v), op }, c).unwrap();
                        v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
                    });
                    assert!(out.iter().all(|o| *o == out[0]), "{algo} w={w} {op}: {out:x?}");
                }
            }
        }
    }

    /// Pipelined segments of 1–3 elements, at sizes one element either side
    /// of a whole number of segments per block, through every algorithm
    /// that segments.
    #[test]
    fn segmented_steps_at_segment_boundaries() {
        for w in 1..=8 {
            for seg in [1usize, 2, 3] {
                let hint = (8 * seg).to_string();
                for n in [seg * w - 1, seg * w, seg * w + 1, 2 * seg * w + 1, 7 * w + 3] {
                    let expect: Vec<f64> = (0..n).map(|i| (0..w).map(|r| (r * 7 + i) as f64).sum()).collect();
                    for algo in ["ring", "halving_doubling"] {
                        let hints = [("algorithm", algo), ("segment_bytes", hint.as_str())];
                        let out = run_ranks_with(w, OpKind::AllReduce, &hints, |r, b, c| {
                            let mut v: Vec<f64> = (0..n).map(|i| (r * 7 + i) as f64).collect();
                            run(b, &mut Op::AllReduce { buf: TensorMut::from_slice(&mut v), op: ReduceOp::Sum }, c).unwrap();
                            v
                        });
                        assert!(out.iter().all(|o| *o == expect), "{algo} w={w} seg={seg} n={n}");
                    }
                    // The chain broadcast forwards segment by segment.
                    for root in [0, w / 2] {
                        let hints = [("algorithm", "chain"), ("segment_bytes", hint.as_str())];
                        let out = run_ranks_with(w, OpKind::Broadcast, &hints, |r, b, c| {
                            let mut v: Vec<f64> = (0..n).map(|i| (r * 7 + i) as f64).collect();
                            run(b, &mut Op::Broadcast { buf: TensorMut::from_slice(&mut v), root }, c).unwrap();
                            v
                        });
                        let want: Vec<f64> = (0..n).map(|i| (root * 7 + i) as f64).collect();
                        assert!(out.iter().all(|o| *o == want), "chain broadcast w={w} seg={seg} n={n} root={root}");
                    }
                    // Tree and ring reduces: the root gets the result, other
                    // ranks keep their input unscaled.
                    for algo in ["binomial", "reduce_scatter_gather"] {
                        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::PremulSum(0.5)] {
                            let root = w - 1;
                            let hints = [("algorithm", algo), ("segment_bytes", hint.as_str())];
                            let out = run_ranks_with(w, OpKind::Reduce, &hints, |r, b, c| {
                                let mut v: Vec<f64> = (0..n).map(|i| (r * 7 + i) as f64).collect();
                                run(b, &mut Op::Reduce { buf: TensorMut::from_slice(&mut v), root, op }, c).unwrap();
                                v
                            });
                            let reduced: Vec<f64> = expect
                                .iter()
                                .map(|s| match op {
                                    ReduceOp::Avg => s / w as f64,
                                    ReduceOp::PremulSum(f) => s * f,
                                    _ => *s,
                                })
                                .collect();
                            for (r, o) in out.iter().enumerate() {
                                let own: Vec<f64> = (0..n).map(|i| (r * 7 + i) as f64).collect();
                                assert_eq!(*o, if r == root { reduced.clone() } else { own }, "{algo} {op} w={w} seg={seg} n={n} rank {r}");
                            }
                        }
                    }
                    // reduce_scatter with uneven blocks: block i has n + i elements.
                    let hints = [("segment_bytes", hint.as_str())];
                    let out = run_ranks_with(w, OpKind::ReduceScatter, &hints, |r, b, c| {
                        let ins: Vec<Vec<f64>> = (0..w).map(|i| (0..n + i).map(|e| (r * 7 + i + e) as f64).collect()).collect();
                        let mut o = vec![0f64; n + r];
                        let views = ins.iter().map(|v| crate::tensor::Tensor::from_slice(v)).collect();
                        run(b, &mut Op::ReduceScatter { inputs: views, output: TensorMut::from_slice(&mut o), op: ReduceOp::Sum }, c)
                            .unwrap();
                        o
                    });
                    for (r, o) in out.iter().enumerate() {
                        let e: Vec<f64> = (0..n + r).map(|e| (0..w).map(|s| (s * 7 + r + e) as f64).sum()).collect();
                        assert_eq!(*o, e, "reduce_scatter w={w} seg={seg} n={n} rank {r}");
                    }
                }
            }
        }
    }

    /// Wraps a rank's backend and keeps the tag of every message it sends.
    struct Recording<'a> {
        inner: &'a dyn Backend,
        sent: Mutex<Vec<u64>>,
    }

    impl Backend for Recording<'_> {
        fn name(&self) -> &str {
            "recording"
        }
        fn exchange(&self, ops: &mut [P2p<'_>], deadline: &Deadline) -> Result<()> {
            let tags = ops.iter().filter_map(|op| match op {
                P2p::Send { tag, .. } => Some(*tag),
                P2p::Recv { .. } => None,
            });
            self.sent.lock().unwrap().extend(tags);
            self.inner.exchange(ops, deadline)
        }
        fn abort(&self, e: &Error) {
            self.inner.abort(e)
        }
    }

    /// Per rank, how many of the messages it sent while `f` ran its op (on
    /// the recording backend it is given) were marked combining, fresh,
    /// neither.
    fn localities(w: usize, kind: OpKind, algo: &str, f: impl Fn(usize, &dyn Backend, &OpContext) + Sync) -> Vec<[usize; 3]> {
        run_ranks_with(w, kind, &[("algorithm", algo)], |r, b, c| {
            let rec = Recording { inner: b, sent: Mutex::default() };
            f(r, &rec, c);
            let sent = rec.sent.into_inner().unwrap();
            let combining = sent.iter().filter(|t| crate::tag::combines(**t)).count();
            let fresh = sent.iter().filter(|t| crate::tag::fresh(**t)).count();
            [combining, fresh, sent.len() - combining - fresh]
        })
    }

    #[test]
    fn steps_say_whether_their_receiver_combines_or_their_sender_just_wrote() {
        use crate::tensor::{Tensor, TensorMut};
        // 64 f32: one segment per step.
        let all_reduce = |_, b: &dyn Backend, c: &OpContext| {
            let mut v = vec![1f32; 64];
            run(b, &mut Op::AllReduce { buf: TensorMut::from_slice(&mut v), op: ReduceOp::Sum }, c).unwrap()
        };
        // Ring: W-1 reduce-scatter steps combine; the W-1 all-gather steps
        // send blocks their sender reduced or received just before.
        assert!(localities(3, OpKind::AllReduce, "ring", all_reduce).iter().all(|l| *l == [2, 2, 0]));
        // Halving-doubling: log2(W) steps each way.
        assert!(localities(4, OpKind::AllReduce, "halving_doubling", all_reduce).iter().all(|l| *l == [2, 2, 0]));
        // Recursive doubling combines at every step; at W=3 rank 0 folds
        // into rank 1 (combining) and gets the result back (fresh).
        assert!(localities(4, OpKind::AllReduce, "recursive_doubling", all_reduce).iter().all(|l| *l == [2, 0, 0]));
        assert_eq!(localities(3, OpKind::AllReduce, "recursive_doubling", all_reduce), [[1, 0, 0], [1, 1, 0], [1, 0, 0]]);
        // An all-gather's first step sends the caller's input, which this
        // rank did not write; later steps forward what it just received.
        let all_gather = |r: usize, b: &dyn Backend, c: &OpContext| {
            let input = vec![r as u32; 8];
            let mut outs = vec![vec![0u32; 8]; 3];
            let outputs = outs.iter_mut().map(|o| TensorMut::from_slice(o)).collect();
            run(b, &mut Op::AllGather { input: Tensor::from_slice(&input), outputs }, c).unwrap()
        };
        assert!(localities(3, OpKind::AllGather, "auto", all_gather).iter().all(|l| *l == [0, 1, 1]));
        // A tree reduce combines on every edge; a reduce-scatter then
        // gather combines, then sends blocks just reduced.
        let reduce = |_, b: &dyn Backend, c: &OpContext| {
            let mut v = vec![1f32; 64];
            run(b, &mut Op::Reduce { buf: TensorMut::from_slice(&mut v), root: 0, op: ReduceOp::Sum }, c).unwrap()
        };
        assert_eq!(localities(4, OpKind::Reduce, "binomial", reduce), [[0, 0, 0], [1, 0, 0], [1, 0, 0], [1, 0, 0]]);
        assert_eq!(localities(3, OpKind::Reduce, "reduce_scatter_gather", reduce), [[2, 0, 0], [2, 1, 0], [2, 1, 0]]);
    }
}
