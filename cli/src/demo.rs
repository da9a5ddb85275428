//! `weft demo`: all_reduce over a size sweep on a local world, verified,
//! with timings. Re-launches itself under the launcher when started bare.

use anyhow::{bail, Result};
use std::time::{Duration, Instant};
use weft::prelude::*;
use weft_cli::launcher;

pub fn main(nproc: usize, backend: &str, max_bytes: usize, iters: usize) -> Result<i32> {
    if std::env::var("RANK").is_err() {
        let args = ["demo", "--backend", backend, "--max-bytes", &max_bytes.to_string(), "--iters", &iters.to_string()];
        return launcher::relaunch_local(nproc, args.iter().map(|a| a.to_string()).collect(), Some(Duration::from_secs(600)));
    }
    let pg = ProcessGroup::from_env(GroupOptions::from_env()?.backend(backend))?;
    let (r, w) = (pg.rank(), pg.size());
    let o = OpOptions::default();
    if r == 0 {
        println!(
            "weft demo: all_reduce (sum, f32) on {w} ranks, backend {:?}",
            pg.backend_name((weft::DeviceKind::Cpu, weft::Layout::Dense)).unwrap_or_default()
        );
        println!(
            "{:>12} {:>10} {:>12} {:>12} {:>10} {:>10} {:>7}",
            "size(B)", "count", "median(us)", "min(us)", "algbw", "busbw", "#wrong"
        );
    }
    // 8 B, then x8 per step, ending exactly at max_bytes.
    let mut sizes: Vec<usize> = std::iter::successors(Some(8usize), |b| Some(b * 8)).take_while(|b| *b < max_bytes).collect();
    sizes.push(max_bytes.max(4) / 4 * 4);
    let mut wrong_total = 0;
    for bytes in sizes {
        let n = bytes / 4;
        let mut v = vec![0f32; n];
        let mut times = Vec::new();
        let mut wrong = 0;
        for it in 0..iters + 2 {
            v.iter_mut().enumerate().for_each(|(i, x)| *x = ((i + r) % 7) as f32);
            pg.barrier(&o)?.wait()?;
            let t = Instant::now();
            pg.all_reduce(&mut v, ReduceOp::Sum, &o)?.wait()?;
            if it >= 2 {
                times.push(t.elapsed());
            }
            wrong += v.iter().enumerate().filter(|(i, x)| **x != (0..w).map(|k| ((i + k) % 7) as f32).sum::<f32>()).count();
        }
        times.sort();
        let med = times[times.len() / 2].as_secs_f64();
        let algbw = bytes as f64 / med / 1e9;
        let busbw = algbw * 2.0 * (w - 1) as f64 / w as f64;
        wrong_total += wrong;
        if r == 0 {
            println!(
                "{bytes:>12} {n:>10} {:>12.1} {:>12.1} {algbw:>10.3} {busbw:>10.3} {wrong:>7}",
                med * 1e6,
                times[0].as_secs_f64() * 1e6
            );
        }
    }
    if wrong_total > 0 {
        bail!("rank {r}: {wrong_total} wrong elements");
    }
    if r == 0 {
        println!("algbw/busbw in GB/s (busbw = algbw x 2(W-1)/W, as nccl-tests)");
    }
    Ok(0)
}
