//! Data-parallel training that survives losing a rank: each step every
//! rank computes a gradient on its shard and the ranks average them; when
//! a rank dies mid-step, the survivors shrink their group, agree that the
//! step must be redone, rescale the learning rate to the new world size
//! (the global batch shrank with it) and carry on from the weights they
//! hold, which are the same on every survivor.
//!
//! Run (the launcher must not stop the survivors, and hosts the store so
//! it outlives any rank):
//! `cargo build --example elastic_data_parallel &&
//!  weft run --keep-going -n 4 -- target/debug/examples/elastic_data_parallel`
//! Rank 2 kills itself during step 3 (`ELASTIC_VICTIM` picks another rank,
//! `none` nobody).

use std::time::Duration;
use weft::prelude::*;
use weft::{ErrorKind, ShrinkOptions};

const STEPS: usize = 8;
/// Learning rate per rank of the global batch.
const LR_PER_RANK: f32 = 0.02;

/// The gradient of this rank's shard of the data at `step` (a toy model:
/// pulls every weight towards a target that depends on the shard).
fn gradient(weights: &[f32], shard: usize, step: usize) -> Vec<f32> {
    weights.iter().enumerate().map(|(i, w)| w - ((shard + i + step) % 7) as f32).collect()
}

fn main() -> anyhow::Result<()> {
    weft_builtin::link();
    let mut pg = ProcessGroup::from_env(GroupOptions::from_env()?)?;
    let me = pg.rank();
    let victim = match std::env::var("ELASTIC_VICTIM").as_deref() {
        Ok("none") => None,
        Ok(v) => Some(v.parse::<usize>()?),
        Err(_) => Some(2.min(pg.size() - 1)),
    };
    let mut weights = vec![0f32; 1 << 16];
    let o = OpOptions::default();
    let mut step = 0;
    while step < STEPS {
        let mut g = gradient(&weights, me, step);
        if step == 3 && Some(me) == victim {
            // Die mid-step, after the others have started averaging.
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(50));
                let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
            });
            std::thread::sleep(Duration::from_secs(5));
        }
        let averaged = pg.all_reduce(&mut g[..], ReduceOp::Avg, &o)?.wait();
        match averaged {
            Ok(()) => {
                let lr = LR_PER_RANK * pg.size() as f32;
                weights.iter_mut().zip(&g).for_each(|(w, g)| *w -= lr * g);
                step += 1;
            }
            Err(e) if matches!(e.kind(), ErrorKind::PeerLost { .. } | ErrorKind::Aborted) => {
                // Survivors: a new group of who is left. Then they check
                // that all are at the same step (the AND of the step and of
                // its complement give it back only if all agree): a
                // survivor whose all_reduce had completed would be a step
                // ahead, and would have to roll back (from a checkpoint, in
                // a real job). Here the rank died before sending anything,
                // so no survivor could complete the step.
                let shrunk = pg.shrink(&ShrinkOptions::default())?;
                let s = step as u64;
                let same = shrunk.agree(s, &ShrinkOptions::default())? == s && shrunk.agree(!s, &ShrinkOptions::default())? == !s;
                anyhow::ensure!(same, "survivors are at different steps");
                if shrunk.rank() == 0 {
                    println!(
                        "step {step}: {e}; going on with {} ranks (learning rate {})",
                        shrunk.size(),
                        LR_PER_RANK * shrunk.size() as f32
                    );
                }
                pg = shrunk;
            }
            Err(e) => return Err(e.into()),
        }
    }
    // Every survivor holds the same model.
    let mut check = vec![weights[0], weights[weights.len() - 1]];
    let mine = check.clone();
    pg.broadcast(&mut check, 0, &o)?.wait()?;
    anyhow::ensure!(check == mine, "models diverged");
    if pg.rank() == 0 {
        println!("done: {STEPS} steps, {} ranks at the end, w[0] = {}", pg.size(), weights[0]);
    }
    Ok(())
}
