//! Mixture-of-experts dispatch and combine (`weft::moe`) across ranks:
//! exact results for every kind of routing, each token crossing to a rank
//! once each way (bytes counted on the wire), and bad input failing every
//! rank with a clear error instead of wrong data.

use half::{bf16, f16};
use std::sync::Arc;
use weft::backend::{Backend, Deadline, P2p};
use weft::registry::StaticBackend;
use weft::{Collectives, DType, ErrorKind, OpOptions, ProcessGroup, Result, Tensor, TensorMut};
use weft_tests::wrapped::WrappedLoopback;
use weft_tests::{options, run_threads, Buf};

/// A small deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// How tokens pick their experts.
#[derive(Clone, Copy, Debug)]
enum Routing {
    /// Uniformly at random.
    Random,
    /// Zipf-like: expert e with weight 1 / (e + 1).
    Skewed,
    /// Every token's experts on one rank (rank (r + 1) % W for rank r).
    OneRank,
    /// As `Random`, but rank 0 has no tokens.
    RankWithoutTokens,
}

/// `k` distinct experts (of `e`, on `w` ranks) per token, some slots -1.
fn route(kind: Routing, rank: usize, w: usize, tokens: usize, k: usize, e: usize, rng: &mut Rng) -> Vec<i64> {
    let per_rank = e / w;
    let mut out = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        let mut chosen: Vec<i64> = Vec::new();
        while chosen.len() < k {
            let pick = match kind {
                Routing::Random | Routing::RankWithoutTokens => rng.below(e as u64) as usize,
                Routing::Skewed => {
                    // Inverse-weight sampling over 1/(i+1).
                    let total: f64 = (1..=e).map(|i| 1.0 / i as f64).sum();
                    let mut u = (rng.below(1 << 30) as f64 / (1u64 << 30) as f64) * total;
                    let mut i = 0;
                    while i + 1 < e && u > 1.0 / (i + 1) as f64 {
                        u -= 1.0 / (i + 1) as f64;
                        i += 1;
                    }
                    i
                }
                Routing::OneRank => ((rank + 1) % w) * per_rank + rng.below(per_rank as u64) as usize,
            };
            if !chosen.contains(&(pick as i64)) {
                chosen.push(pick as i64);
            }
        }
        // One slot in five routed nowhere (when k > 1).
        if k > 1 && rng.below(5) == 0 {
            chosen[k - 1] = -1;
        }
        out.extend(chosen);
    }
    out
}

/// Values as bytes of `dtype` (exact for the small values used here).
fn encode(v: &[f64], dtype: DType) -> Vec<u8> {
    v.iter()
        .flat_map(|x| match dtype {
            DType::F64 => x.to_le_bytes().to_vec(),
            DType::F32 => (*x as f32).to_le_bytes().to_vec(),
            DType::F16 => f16::from_f64(*x).to_bits().to_le_bytes().to_vec(),
            _ => bf16::from_f64(*x).to_bits().to_le_bytes().to_vec(),
        })
        .collect()
}

fn decode(b: &[u8], dtype: DType) -> Vec<f64> {
    b.chunks_exact(dtype.size())
        .map(|c| match dtype {
            DType::F64 => f64::from_le_bytes(c.try_into().unwrap()),
            DType::F32 => f64::from(f32::from_le_bytes(c.try_into().unwrap())),
            DType::F16 => f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64(),
            _ => bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64(),
        })
        .collect()
}

/// Dispatch, experts that scale their rows by 1 + (global expert % 2),
/// then combine with the router's weights; checked against the sum each
/// token expects. Returns the rows this rank received.
fn dispatch_and_combine(pg: &ProcessGroup, kind: Routing, k: usize, dtype: DType, seed: u64) -> usize {
    dispatch_and_combine_rows_of(pg, kind, k, dtype, seed, 5)
}

fn dispatch_and_combine_rows_of(pg: &ProcessGroup, kind: Routing, k: usize, dtype: DType, seed: u64, hidden: usize) -> usize {
    let (rank, w) = (pg.rank(), pg.size());
    let e = 8 * w;
    let mut rng = Rng(seed * 7919 + rank as u64 + 1);
    let tokens = if matches!(kind, Routing::RankWithoutTokens) && rank == 0 { 0 } else { 3 + rng.below(6) as usize };
    let topk = route(kind, rank, w, tokens, k, e, &mut rng);
    let x: Vec<f64> = (0..tokens * hidden).map(|_| rng.below(9) as f64 - 4.0).collect();
    let weights: Vec<f64> = (0..tokens * k).map(|_| 0.5 * (1 + rng.below(4)) as f64).collect();
    let o = OpOptions::default();

    let xb = Buf::from_bytes(dtype, &encode(&x, dtype));
    let plan = pg.dispatch_plan(&topk, k, e, xb.t(), hidden, &o).unwrap();
    let rows = plan.rows();
    let mut recv = Buf::zeros(dtype, rows * hidden);
    let routing = pg.dispatch(plan, xb.t(), recv.tm(), &o).unwrap();
    assert_eq!(routing.counts().iter().sum::<usize>(), rows);
    assert_eq!(routing.counts().len(), e / w);

    // The experts: rows of local expert l belong to global expert rank * E/W + l.
    let mut out_rows = decode(recv.bytes(), dtype);
    let mut row = 0;
    for (l, n) in routing.counts().iter().enumerate() {
        let factor = 1.0 + ((rank * (e / w) + l) % 2) as f64;
        for _ in 0..*n {
            out_rows[row * hidden..(row + 1) * hidden].iter_mut().for_each(|v| *v *= factor);
            row += 1;
        }
    }
    let out_b = Buf::from_bytes(dtype, &encode(&out_rows, dtype));
    let w_rows = pg.pair_values_to_experts(&routing, &weights, &o).unwrap();
    let mut y = Buf::zeros(dtype, tokens * hidden);
    pg.combine(&routing, out_b.t(), &w_rows, y.tm(), &o).unwrap();

    let y = decode(y.bytes(), dtype);
    for t in 0..tokens {
        let mut scale = 0.0;
        for j in 0..k {
            let ex = topk[t * k + j];
            if ex >= 0 {
                scale += weights[t * k + j] * (1.0 + (ex as usize % 2) as f64);
            }
        }
        for h in 0..hidden {
            assert_eq!(y[t * hidden + h], scale * x[t * hidden + h], "rank {rank} token {t} {kind:?} k={k} {dtype}");
        }
    }

    // The backward pass, with dy = the token's own row: each expert row's
    // gradient is its weight times dy, each weight's the dot product of
    // the expert's output and dy.
    let mut grad = Buf::zeros(dtype, rows * hidden);
    let grad_w = pg.combine_backward(&routing, xb.t(), out_b.t(), &w_rows, grad.tm(), &o).unwrap();
    let grad = decode(grad.bytes(), dtype);
    let recv_rows = decode(recv.bytes(), dtype);
    for r in 0..rows {
        for h in 0..hidden {
            assert_eq!(grad[r * hidden + h], w_rows[r] * recv_rows[r * hidden + h], "rank {rank} row {r} {dtype}");
        }
    }
    for t in 0..tokens {
        for j in 0..k {
            let ex = topk[t * k + j];
            let want =
                if ex < 0 { 0.0 } else { (1.0 + (ex as usize % 2) as f64) * (0..hidden).map(|h| x[t * hidden + h].powi(2)).sum::<f64>() };
            assert_eq!(grad_w[t * k + j], want, "rank {rank} token {t} slot {j} {dtype}");
        }
    }

    // The router's values come back where they were routed, zero elsewhere.
    let back = pg.pair_values_to_tokens(&routing, &w_rows, &o).unwrap();
    for (i, v) in back.iter().enumerate() {
        assert_eq!(*v, if topk[i] >= 0 { weights[i] } else { 0.0 }, "rank {rank} pair {i}");
    }

    // A second dispatch with the same routing lands the same rows.
    let mut again = Buf::zeros(dtype, rows * hidden);
    pg.dispatch_again(&routing, xb.t(), again.tm(), &o).unwrap();
    assert_eq!(again.bytes(), recv.bytes());
    rows
}

#[test]
fn dispatch_then_combine_is_exact_for_every_routing() {
    for spec in ["cpu:shm", "cpu-tcp"] {
        for w in [2, 3, 4] {
            run_threads(w, options(spec), |pg| {
                let mut seed = 0;
                for kind in [Routing::Random, Routing::Skewed, Routing::OneRank, Routing::RankWithoutTokens] {
                    for k in [1, 2, 8] {
                        seed += 1;
                        dispatch_and_combine(&pg, kind, k, DType::F64, seed);
                    }
                }
            });
        }
    }
}

#[test]
fn dispatch_then_combine_in_every_float_dtype() {
    run_threads(3, options("cpu:shm"), |pg| {
        for (i, dtype) in [DType::F32, DType::F64, DType::F16, DType::BF16].into_iter().enumerate() {
            dispatch_and_combine(&pg, Routing::Random, 2, dtype, 100 + i as u64);
            // Rows longer than the kernels' blocks.
            dispatch_and_combine_rows_of(&pg, Routing::Random, 2, dtype, 200 + i as u64, 700);
        }
    });
}

thread_local! {
    /// Calls of `exchange` on the counting backend from this thread (the
    /// rank's: a loopback group runs its ops on the caller's thread).
    static EXCHANGES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    /// Bytes this thread (its rank) sent through `exchange` on the
    /// counting backend: per thread, so that tests running side by side
    /// on it, and the other ranks of one test, never count into one
    /// another's window.
    static SENT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// `loopback`, counting the bytes of every send.
struct Counting(Arc<dyn Backend>);

impl Backend for Counting {
    fn name(&self) -> &str {
        "counting"
    }
    fn exchange(&self, ops: &mut [P2p<'_>], deadline: &Deadline) -> Result<()> {
        let bytes: usize = ops.iter().map(|op| if let P2p::Send { data, .. } = op { data.len() } else { 0 }).sum();
        SENT.set(SENT.get() + bytes);
        EXCHANGES.set(EXCHANGES.get() + 1);
        self.0.exchange(ops, deadline)
    }
    fn abort(&self, reason: &weft::Error) {
        self.0.abort(reason)
    }
}

static COUNTING: WrappedLoopback = WrappedLoopback { name: "counting", wrap: |inner| Arc::new(Counting(inner)) };
weft::inventory::submit! { StaticBackend(&COUNTING) }

#[test]
fn a_token_crosses_to_a_rank_once_each_way_whatever_its_experts_there() {
    // Each token's 4 experts all live on the next rank: the rows cross
    // once per token, not once per expert, both ways.
    let (w, tokens, hidden, k) = (2usize, 64usize, 256usize, 4usize);
    let row = hidden * 8;
    let sent = run_threads(w, options("counting"), move |pg| {
        let rank = pg.rank();
        let e = 4 * w;
        let topk: Vec<i64> = (0..tokens).flat_map(|_| (0..4).map(|j| (((rank + 1) % w) * 4 + j) as i64)).collect();
        let x = vec![1.0f64; tokens * hidden];
        let o = OpOptions::default();
        pg.barrier(&o).unwrap().wait().unwrap();
        let before = SENT.get();
        pg.barrier(&o).unwrap().wait().unwrap();
        let plan = pg.dispatch_plan(&topk, k, e, Tensor::from(&x), hidden, &o).unwrap();
        let mut recv = vec![0.0f64; plan.rows() * hidden];
        let routing = pg.dispatch(plan, Tensor::from(&x), TensorMut::from(&mut recv), &o).unwrap();
        pg.barrier(&o).unwrap().wait().unwrap();
        let dispatched = SENT.get() - before;
        pg.barrier(&o).unwrap().wait().unwrap();
        let mut y = vec![0.0f64; tokens * hidden];
        let ones = vec![1.0; routing.rows()];
        pg.combine(&routing, Tensor::from(&recv), &ones, TensorMut::from(&mut y), &o).unwrap();
        pg.barrier(&o).unwrap().wait().unwrap();
        let combined = SENT.get() - before - dispatched;
        assert!(y.iter().all(|v| *v == 4.0));
        (dispatched, combined, routing.bytes_sent(DType::F64))
    });
    // Every rank sent its tokens' rows once (plus metadata and barriers,
    // far less than a second copy of any row).
    let rows_once = tokens * row;
    for (rank, &(dispatched, combined, own)) in sent.iter().enumerate() {
        assert!(
            dispatched >= rows_once && dispatched < rows_once + rows_once / 4,
            "rank {rank}: dispatch sent {dispatched} bytes for {rows_once} of rows"
        );
        assert!(
            combined >= rows_once && combined < rows_once + rows_once / 4,
            "rank {rank}: combine sent {combined} bytes for {rows_once} of rows"
        );
        assert_eq!(own, rows_once, "rank {rank}: what the routing says it sends");
    }
}

#[test]
fn bad_routing_on_one_rank_fails_every_rank() {
    let errors = run_threads(3, options("cpu:shm"), |pg| {
        let o = OpOptions::default();
        let id = if pg.rank() == 1 { 99 } else { 0 };
        pg.dispatch_plan(&[id, 1], 2, 6, Tensor::from(&[0.0f32; 4][..]), 4, &o).unwrap_err()
    });
    assert!(errors[1].to_string().contains("topk_idx[0][0] = 99"), "{}", errors[1]);
    for e in [&errors[0], &errors[2]] {
        assert_eq!(*e.kind(), ErrorKind::InvalidArgument);
        assert!(e.to_string().contains("rank(s) [1]"), "{e}");
    }
}

#[test]
fn ranks_that_disagree_or_uneven_experts_are_errors() {
    let errors = run_threads(2, options("cpu:shm"), |pg| {
        let o = OpOptions::default();
        let hidden = 4 + pg.rank();
        let e = pg.dispatch_plan(&[0], 1, 4, Tensor::from(&vec![0.0f32; hidden]), hidden, &o).unwrap_err().to_string();
        let uneven = pg.dispatch_plan(&[0], 1, 3, Tensor::from(&[0.0f32; 4][..]), 4, &o).unwrap_err().to_string();
        (e, uneven)
    });
    for (e, uneven) in errors {
        assert!(e.contains("ranks disagree on the row size"), "{e}");
        assert!(uneven.contains("multiple of the group size 2"), "{uneven}");
    }
}

#[test]
fn wrong_rows_at_the_plan_fail_every_rank_naming_the_rank() {
    let results = run_threads(2, options("cpu-tcp"), |pg| {
        let o = OpOptions::default();
        // Rank 0 passes 2 tokens of 2 elements instead of 3.
        let x = vec![1.0f32; if pg.rank() == 0 { 4 } else { 6 }];
        pg.dispatch_plan(&[0, 2, 1, 3], 2, 4, Tensor::from(&x), 3, &o).unwrap_err().to_string()
    });
    assert!(results[0].contains("x has 4 elements, expected 2 rows of 3"), "{}", results[0]);
    assert!(results[1].contains("rank(s) [0] passed invalid routing or rows"), "{}", results[1]);
}

#[test]
fn a_wrong_tensor_at_dispatch_fails_its_rank_only_and_the_others_get_their_rows() {
    // Messages of 40 tokens of 1 KiB outgrow their first parts: the
    // failing rank still sends the rest it took at the plan.
    for bad in ["another x", "a short out"] {
        let results = run_threads(3, options("cpu:shm"), move |pg| {
            let (rank, w, hidden, tokens) = (pg.rank(), pg.size(), 128usize, 40usize);
            let o = OpOptions::default();
            let topk: Vec<i64> = (0..tokens).map(|t| ((rank + t) % w) as i64).collect();
            let x: Vec<f64> = (0..tokens * hidden).map(|i| (i / hidden * 10 + rank) as f64).collect();
            let plan = pg.dispatch_plan(&topk, 1, w, Tensor::from(&x), hidden, &o).unwrap();
            let rows = plan.rows();
            let copy = x.clone();
            let (x_then, rows_out) = match (rank, bad) {
                (1, "another x") => (&copy, rows),
                (1, _) => (&x, rows - 1),
                _ => (&x, rows),
            };
            let mut out = vec![0.0f64; rows_out * hidden];
            let routing = pg.dispatch(plan, Tensor::from(x_then), TensorMut::from(&mut out), &o);
            routing.map(|_| out.chunks_exact(hidden).map(|r| r[0]).collect::<Vec<_>>()).map_err(|e| e.to_string())
        });
        let e = results[1].as_ref().unwrap_err();
        let want = if bad == "another x" { "x is not the tensor dispatch_plan took" } else { "out has" };
        assert!(e.contains(want), "{bad}: {e}");
        for (rank, got) in [(0usize, &results[0]), (2, &results[2])] {
            // Rank r's expert gets token t of rank s where (s + t) % 3 == r:
            // grouped by source, tokens ascending; each row starts with
            // t * 10 + s.
            let want: Vec<f64> =
                (0..3).flat_map(|s| (0..40).filter(move |t| (s + t) % 3 == rank).map(move |t| (t * 10 + s) as f64)).collect();
            assert_eq!(got.as_ref().unwrap(), &want, "{bad}: rank {rank}");
        }
    }
}

#[test]
fn a_small_dispatch_is_one_exchange_and_a_long_one_two() {
    // The counts travel at the head of the rows: a dispatch whose messages
    // fit their first parts costs what one all_to_all costs, one with
    // longer messages two.
    let calls = run_threads(3, options("counting"), |pg| {
        let (rank, w) = (pg.rank(), pg.size());
        let o = OpOptions::default();
        let count = |f: &dyn Fn()| {
            let before = EXCHANGES.get();
            f();
            EXCHANGES.get() - before
        };
        let dispatch = |tokens: usize, hidden: usize| {
            let topk: Vec<i64> = (0..tokens).map(|t| ((rank + t) % w) as i64).collect();
            let x = vec![1.0f64; tokens * hidden];
            let plan = pg.dispatch_plan(&topk, 1, w, Tensor::from(&x), hidden, &o).unwrap();
            let mut out = vec![0.0f64; plan.rows() * hidden];
            pg.dispatch(plan, Tensor::from(&x), TensorMut::from(&mut out), &o).unwrap();
            assert!(out.iter().all(|v| *v == 1.0));
        };
        let all_to_all = count(&|| {
            let (send, mut got) = (vec![1u8; 3 * 64], vec![0u8; 3 * 64]);
            pg.all_to_all_single(&mut got[..], &send[..], &o).unwrap().wait().unwrap();
        });
        // 6 tokens of 64 B to each rank; then, from rank 0 only, 40 of 4 KiB.
        let small = count(&|| dispatch(18, 8));
        let long = count(&|| dispatch(if rank == 0 { 120 } else { 3 }, 512));
        (all_to_all, small, long)
    });
    let (all_to_all, small, long) = calls[0];
    eprintln!("exchanges: all_to_all {all_to_all}, small {small}, long {long}");
    assert!(all_to_all > 0);
    assert_eq!(small, all_to_all, "a dispatch that fits its first parts");
    assert_eq!(long, 2 * all_to_all, "a dispatch with a second part");
}

#[test]
fn a_long_part_a_rank_keeps_needs_no_second_part() {
    // A rank's own tokens stay in x, however many: 7 rows of 8 KiB stay,
    // one goes to the other rank (W = 2) and fits its first part.
    for w in [1, 2] {
        run_threads(w, options("cpu:shm"), move |pg| {
            let (rank, w, hidden, tokens) = (pg.rank(), pg.size(), 1024usize, 8usize);
            let topk: Vec<i64> = (0..tokens).map(|t| if t == 0 { (rank + 1) % w } else { rank } as i64).collect();
            let x: Vec<f64> = (0..tokens * hidden).map(|i| (i / hidden * 10 + rank) as f64).collect();
            let o = OpOptions::default();
            let plan = pg.dispatch_plan(&topk, 1, w, Tensor::from(&x), hidden, &o).unwrap();
            let mut out = vec![0.0f64; plan.rows() * hidden];
            let routing = pg.dispatch(plan, Tensor::from(&x), TensorMut::from(&mut out), &o).unwrap();
            let mut y = vec![0.0f64; tokens * hidden];
            pg.combine(&routing, Tensor::from(&out), &vec![1.0; routing.rows()], TensorMut::from(&mut y), &o).unwrap();
            assert_eq!(y, x, "rank {rank} of {w}");
        });
    }
}

#[test]
fn a_forged_header_is_refused_before_anything_is_allocated_for_it() {
    // Rank 1 skips dispatch_plan and sends rank 0 a first part (16 KiB: a
    // header of status, experts, row bytes, dtype code, tokens, pairs, k,
    // whether a second part follows; then zeros) and itself a header:
    // 2^31 tokens in 2^40 pairs, 16 GiB of metadata for pairs of no token,
    // or 2,000 tokens (more than a first part holds) and no second part.
    let code = DType::ALL.iter().position(|d| *d == DType::F32).unwrap() as u64;
    let forgeries = [(1u64 << 31, 1u64 << 40, 1u64 << 10, "pairs"), (0, u64::from(u32::MAX), 8, "pairs"), (2000, 2000, 1, "second part")];
    for (tokens, pairs, k, why) in forgeries {
        let errors = run_threads(2, options("cpu:shm"), move |pg| {
            let o = OpOptions::default();
            if pg.rank() == 0 {
                return Some(pg.dispatch_plan(&[1], 1, 2, Tensor::from(&[0.0f32; 4][..]), 4, &o).unwrap_err());
            }
            let bytes = |words: &[u64]| -> Vec<u8> { words.iter().flat_map(|w| w.to_le_bytes()).collect() };
            let mut to0 = vec![0u8; 16 << 10];
            to0[..64].copy_from_slice(&bytes(&[0, 2, 16, code, tokens, pairs, k, 0]));
            let to1 = bytes(&[0, 2, 16, code, 0, 0, 1, 0]);
            let (mut from0, mut from1) = (vec![0u8; 16 << 10], vec![0u8; 64]);
            let outputs = vec![TensorMut::from(&mut from0), TensorMut::from(&mut from1)];
            pg.all_to_all(outputs, vec![Tensor::from(&to0), Tensor::from(&to1)], &o).unwrap().wait().unwrap();
            None
        });
        let e = errors[0].as_ref().unwrap().to_string();
        assert!(e.contains("rank 1 announced a dispatch that cannot be") && e.contains(why), "{e}");
    }
}
