//! `weft bench --ops sparse_all_reduce`: embedding-gradient-like sparse
//! all-reduces. A table of R rows x D columns (f32); every rank touches
//! nnz = density x R distinct rows, drawn without replacement with Zipf
//! popularity (popular rows overlap across ranks), listed in random order
//! and with a few repeated entries (real gradients are uncoalesced). Each
//! algorithm is timed side by side; results are checked against the
//! all-gather baseline's.

use super::rng::Rng;
use anyhow::Result;
use std::time::Instant;
use weft::prelude::*;
use weft::{ReduceOp, SparseCoo, SparseCooTensor};

/// The workload's knobs.
pub struct Workload {
    pub rows: usize,
    pub dim: usize,
    pub densities: Vec<f64>,
    pub zipf: f64,
    pub iters: usize,
}

const ALGOS: [&str; 5] = ["allgather", "recursive_doubling", "split", "dense", "auto"];

/// `nnz` distinct rows drawn without replacement with probability
/// proportional to `weights` (Efraimidis-Spirakis: keep the largest
/// u^(1/w)), plus 5 % repeats, in random order; rank-specific seed.
fn sample(weights: &[f64], nnz: usize, seed: u64) -> Vec<i64> {
    let mut rng = Rng(seed.wrapping_mul(0x9E3779B97F4A7C15) | 1);
    let mut keyed: Vec<(f64, usize)> = weights.iter().enumerate().map(|(i, w)| (rng.uniform().max(1e-300).ln() / w, i)).collect();
    let nnz = nnz.min(keyed.len());
    keyed.select_nth_unstable_by(nnz.saturating_sub(1), |a, b| b.0.total_cmp(&a.0));
    let mut rows: Vec<i64> = keyed[..nnz].iter().map(|(_, i)| *i as i64).collect();
    let repeats: Vec<i64> = rows.iter().step_by(20).copied().collect();
    rows.extend(repeats);
    // Gradients arrive in lookup order, not sorted.
    shuffle(&mut rows, &mut rng);
    rows
}

/// Fisher-Yates.
fn shuffle<T>(v: &mut [T], rng: &mut Rng) {
    for i in (1..v.len()).rev() {
        v.swap(i, (rng.uniform() * (i + 1) as f64) as usize % (i + 1));
    }
}

pub fn run(pg: &ProcessGroup, w: &Workload) -> Result<u64> {
    let (r, size) = (pg.rank(), pg.size());
    let o = OpOptions::default();
    let weights: Vec<f64> = (1..=w.rows).map(|k| 1.0 / (k as f64).powf(w.zipf)).collect();
    if r == 0 {
        println!(
            "# sparse_all_reduce: {} ranks, table {} x {} f32, Zipf s={}, times in us (slowest rank, median of {} iterations)",
            size, w.rows, w.dim, w.zipf, w.iters
        );
        println!(
            "{:>8} {:>9} {:>9} {}  {:>9} {:>7}",
            "density",
            "nnz/rank",
            "union",
            ALGOS.iter().map(|a| format!("{a:>19}")).collect::<String>(),
            "ag/auto",
            "#wrong"
        );
    }
    let mut wrong_total = 0;
    for &density in &w.densities {
        let idx = sample(&weights, ((density * w.rows as f64) as usize).max(1), r as u64 + 1);
        let nnz = idx.len();
        let vals = vec![1.0f32; nnz * w.dim];
        let make = || {
            SparseCooTensor::new(
                Tensor::from_slice(&idx).reshape(&[1, nnz]).unwrap(),
                Tensor::from_slice(&vals).reshape(&[nnz, w.dim]).unwrap(),
                vec![w.rows, w.dim],
            )
        };
        // One untimed call each (warm-up). Then the algorithms that move
        // runs take turns within every iteration, in an order shuffled alike
        // on every rank, so each meets the same allocator, cache and machine
        // state: run one after another, the first paid the process's
        // warm-up (8 % at the first density). `dense` sweeps the whole table
        // and would flush the others' caches: it runs on its own after them.
        // The last results are checked against the baseline's.
        let opts: Vec<OpOptions> = ALGOS.iter().map(|a| OpOptions::default().hint("sparse_algorithm", *a)).collect();
        let mut outs: Vec<SparseCoo> = ALGOS.iter().map(|_| SparseCoo::default()).collect();
        for (opt, out) in opts.iter().zip(&mut outs) {
            pg.all_reduce_sparse(out, make()?, ReduceOp::Sum, opt)?.wait()?;
        }
        let mut t = vec![vec![0f64; w.iters]; ALGOS.len()];
        let dense = ALGOS.iter().position(|a| *a == "dense").expect("dense is timed");
        let mut order: Vec<usize> = (0..ALGOS.len()).filter(|a| *a != dense).collect();
        let mut time = |a: usize, i: usize| -> Result<()> {
            // The input is built before the clock starts: the op is timed, not the caller's copy.
            let input = make()?;
            pg.barrier(&o)?.wait()?;
            let start = Instant::now();
            pg.all_reduce_sparse(&mut outs[a], input, ReduceOp::Sum, &opts[a])?.wait()?;
            t[a][i] = start.elapsed().as_secs_f64() * 1e6;
            Ok(())
        };
        let mut rng = Rng(0x5EED);
        for i in 0..w.iters {
            shuffle(&mut order, &mut rng);
            for &a in &order {
                time(a, i)?;
            }
        }
        for i in 0..w.iters {
            time(dense, i)?;
        }
        let union = outs[0].nnz();
        let wrong = outs[1..].iter().filter(|o| **o != outs[0]).count() as u64;
        let mut times = Vec::new();
        for ta in &mut t {
            pg.all_reduce(&mut ta[..], ReduceOp::Max, &o)?.wait()?;
            ta.sort_by(f64::total_cmp);
            times.push(ta[ta.len() / 2]);
        }
        let mut w_all = [wrong];
        pg.all_reduce(&mut w_all[..], ReduceOp::Sum, &o)?.wait()?;
        wrong_total += w_all[0];
        if r == 0 {
            println!(
                "{:>7.2}% {:>9} {:>9} {}  {:>8.2}x {:>7}",
                density * 100.0,
                nnz,
                union,
                times.iter().map(|t| format!("{t:>19.0}")).collect::<String>(),
                times[0] / times[ALGOS.len() - 1],
                w_all[0]
            );
        }
    }
    Ok(wrong_total)
}
