//! A data-parallel training step: every rank computes gradients on its own
//! shard, all-reduces them (overlapping the reduction of one layer with the
//! backward pass of the next), and applies the same update.
//!
//! Run: `cargo build --example data_parallel &&
//!       weft run -n 4 -- target/debug/examples/data_parallel`

use weft::prelude::*;

/// A toy linear model y = w.x, one weight vector per "layer".
fn gradients(layer: usize, rank: usize, weights: &[f32]) -> Vec<f32> {
    weights.iter().enumerate().map(|(i, w)| w - 1.0 - ((layer + i + rank) % 5) as f32).collect()
}

fn main() -> anyhow::Result<()> {
    weft_builtin::link();
    let pg = ProcessGroup::from_env(GroupOptions::from_env()?)?;
    let mut layers: Vec<Vec<f32>> = (0..4).map(|_| vec![1.0; 1 << 16]).collect();
    for step in 0..3 {
        let mut grads: Vec<Vec<f32>> = vec![Vec::new(); layers.len()];
        pg.scope(|s| -> weft::Result<()> {
            let mut pending = Vec::new();
            // Backward pass from the last layer: each layer's gradient is
            // all-reduced in the background while the next one is computed.
            for (l, (g, w)) in grads.iter_mut().zip(&layers).enumerate().rev() {
                *g = gradients(l, pg.rank(), w);
                pending.push(s.all_reduce(&mut g[..], ReduceOp::Avg, &OpOptions::default())?);
            }
            pending.iter().try_for_each(Work::wait)
        })?;
        for (w, g) in layers.iter_mut().zip(&grads) {
            w.iter_mut().zip(g).for_each(|(w, g)| *w -= 0.1 * g);
        }
        if pg.rank() == 0 {
            println!("step {step}: w[0][0] = {}", layers[0][0]);
        }
    }
    // Every rank holds the same model.
    let mut check = vec![layers[0][0]];
    pg.broadcast(&mut check, 0, &OpOptions::default())?.wait()?;
    anyhow::ensure!(check[0] == layers[0][0], "models diverged");
    Ok(())
}
