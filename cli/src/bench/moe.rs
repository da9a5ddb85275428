//! `weft bench --ops moe`: expert parallelism through weft's Rust API
//! (`weft::moe`). Every rank routes `tokens` rows of `hidden` elements to
//! the top `k` of `experts` experts, unevenly loaded (expert e's scores
//! shifted by -ln(e + 1) / 4, as `python -m weft.bench --workload moe`),
//! with weights that sum to one, through identity experts; each phase of a forward
//! and backward pass is timed, the slowest rank's time per iteration, and
//! the result checked (the weights sum to one: the output is the input).

use anyhow::Result;
use std::time::Instant;
use weft::prelude::*;
use weft::DType;
use weft_conformance::reference::encode;

use super::rng::Rng;

/// The workload's knobs.
pub struct Workload {
    pub tokens: usize,
    pub hidden: usize,
    pub experts: usize,
    pub k: usize,
    pub dtype: DType,
    pub iters: usize,
    pub warmup: usize,
}

/// The timed phases, in order.
const PHASES: [&str; 6] = ["plan", "dispatch", "weights", "combine", "combine_backward", "dispatch_backward"];

/// This rank's routing: `k` expert ids per token.
fn routing(w: &Workload, rank: usize) -> Vec<i64> {
    let mut rng = Rng(0x9E3779B97F4A7C15 ^ (rank as u64 + 1));
    let mut topk = Vec::with_capacity(w.tokens * w.k);
    let mut scores: Vec<(f64, usize)> = vec![(0.0, 0); w.experts];
    for _ in 0..w.tokens {
        for (e, s) in scores.iter_mut().enumerate() {
            *s = (rng.normal() - 0.25 * ((e + 1) as f64).ln(), e);
        }
        scores.sort_unstable_by(|a, b| b.0.total_cmp(&a.0));
        topk.extend(scores[..w.k].iter().map(|(_, e)| *e as i64));
    }
    topk
}

/// Run the workload; the count of wrong output elements (rank 0 prints).
pub fn run(pg: &ProcessGroup, w: &Workload) -> Result<u64> {
    let (rank, size) = (pg.rank(), pg.size());
    let o = OpOptions::default();
    let topk = routing(w, rank);
    let elem = w.dtype.size();
    // Small integers: exact in every float dtype, and so are their sums
    // with weights 1/k (k a power of two) or one.
    let values: Vec<u8> = (0..w.tokens * w.hidden).flat_map(|i| encode(w.dtype, ((i * 7 + rank) % 9) as f64 - 4.0)).collect();
    let x = weft_conformance::Buf::from_bytes(w.dtype, &values);
    // Weights that sum to one exactly: 1/m (m the power of two at or
    // above k) for all but the first slot, which takes the rest.
    let m = w.k.next_power_of_two() as f64;
    let weights: Vec<f64> = (0..w.tokens * w.k).map(|i| if i % w.k == 0 { 1.0 - (w.k - 1) as f64 / m } else { 1.0 / m }).collect();
    let mut times = vec![Vec::with_capacity(w.iters); PHASES.len()];
    let (mut wrong, mut sent) = (0u64, 0usize);
    for it in 0..w.warmup + w.iters {
        let mut t = [0.0f64; PHASES.len()];
        pg.barrier(&o)?.wait()?;
        let start = Instant::now();
        let lap = |i: usize, t: &mut [f64; PHASES.len()]| t[i] = start.elapsed().as_secs_f64();
        let plan = pg.dispatch_plan(&topk, w.k, w.experts, x.t(), w.hidden, &o)?;
        lap(0, &mut t);
        let mut recv = weft_conformance::Buf::zeros(w.dtype, plan.rows() * w.hidden);
        let routing = pg.dispatch(plan, x.t(), recv.tm(), &o)?;
        lap(1, &mut t);
        let row_weights = pg.pair_values_to_experts(&routing, &weights, &o)?;
        lap(2, &mut t);
        let mut y = weft_conformance::Buf::zeros(w.dtype, w.tokens * w.hidden);
        pg.combine(&routing, recv.t(), &row_weights, y.tm(), &o)?;
        lap(3, &mut t);
        // The output's gradient: the output itself.
        let mut grad_rows = weft_conformance::Buf::zeros(w.dtype, routing.rows() * w.hidden);
        pg.combine_backward(&routing, y.t(), recv.t(), &row_weights, grad_rows.tm(), &o)?;
        lap(4, &mut t);
        let mut grad_x = weft_conformance::Buf::zeros(w.dtype, w.tokens * w.hidden);
        pg.combine(&routing, grad_rows.t(), &vec![1.0; routing.rows()], grad_x.tm(), &o)?;
        lap(5, &mut t);
        if it >= w.warmup {
            for (i, times) in times.iter_mut().enumerate() {
                times.push(t[i] - if i == 0 { 0.0 } else { t[i - 1] });
            }
        }
        if it == 0 {
            wrong = y.bytes().chunks_exact(elem).zip(x.bytes().chunks_exact(elem)).filter(|(a, b)| a != b).count() as u64;
            sent = routing.bytes_sent(w.dtype);
        }
    }
    // The slowest rank's time per phase and iteration.
    let mut flat: Vec<f64> = times.concat();
    pg.all_reduce(&mut flat[..], ReduceOp::Max, &o)?.wait()?;
    let mut counts = [wrong, sent as u64];
    pg.all_reduce(&mut counts[..], ReduceOp::Sum, &o)?.wait()?;
    if rank == 0 {
        println!(
            "# weft bench moe: {size} ranks, {} tokens x {} {} per rank, {} experts, top-{}, identity experts; ms, slowest rank, {} iterations",
            w.tokens, w.hidden, w.dtype, w.experts, w.k, w.iters
        );
        println!("{:>18} {:>10} {:>10} {:>10}", "phase", "median", "min", "max");
        let mut totals = vec![0.0; w.iters];
        for (i, phase) in PHASES.iter().enumerate() {
            let mut ms: Vec<f64> = flat[i * w.iters..(i + 1) * w.iters].iter().map(|s| s * 1e3).collect();
            totals.iter_mut().zip(&ms).for_each(|(t, m)| *t += m);
            ms.sort_by(f64::total_cmp);
            println!("{phase:>18} {:>10.3} {:>10.3} {:>10.3}", ms[ms.len() / 2], ms[0], ms[ms.len() - 1]);
        }
        totals.sort_by(f64::total_cmp);
        println!("{:>18} {:>10.3} {:>10.3} {:>10.3}", "total", totals[totals.len() / 2], totals[0], totals[totals.len() - 1]);
        println!(
            "# rows sent to other ranks per dispatch, all ranks: {:.2} MiB; wrong elements: {}",
            counts[1] as f64 / (1 << 20) as f64,
            counts[0]
        );
    }
    Ok(counts[0])
}
