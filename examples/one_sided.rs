//! One-sided dispatch, as an expert-parallel layer or a parameter server
//! uses it: every rank puts its rows for each peer straight into that
//! peer's window (no matching receive), signals it, and goes on computing;
//! each rank waits for every peer's signal and then reads its rows in place.
//!
//! It also reports what the window costs a rank that does nothing: the CPU
//! time of this process while a window stays open for a second (over
//! cpu-tcp a progress thread waits in poll() for frames; on shm nothing
//! runs).
//!
//! Run: `cargo build --release --example one_sided &&
//!       WEFT_BACKEND=cpu-tcp weft run -n 4 -- target/release/examples/one_sided`

use std::time::{Duration, Instant};
use weft::prelude::*;

/// Rows each rank sends each peer, and floats per row.
const ROWS: usize = 64;
const DIM: usize = 256;

/// This process's CPU time so far (user + system).
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or_default().split_whitespace().collect();
    let ticks: u64 = fields.get(11..13).map_or(0, |f| f.iter().filter_map(|x| x.parse::<u64>().ok()).sum());
    Duration::from_millis(ticks * 10)
}

fn main() -> anyhow::Result<()> {
    weft_builtin::link();
    let pg = ProcessGroup::from_env(GroupOptions::from_env()?)?;
    let (r, w) = (pg.rank(), pg.size());
    let o = OpOptions::default();
    // Each rank's window has room for ROWS rows from every rank.
    let win = pg.new_window(w * ROWS * DIM * 4)?;
    let start = Instant::now();
    for step in 0..10u32 {
        let mine: Vec<f32> = (0..ROWS * DIM).map(|i| (step * 1000 + r as u32) as f32 + i as f32 * 1e-3).collect();
        let slot = std::mem::size_of_val(&mine[..]);
        for peer in 0..w {
            // Into peer's window, at this rank's slot.
            win.put(&mine[..], peer, r * slot, &o)?.wait()?;
            win.signal(peer, &o)?.wait()?;
        }
        for peer in 0..w {
            win.wait_signal(peer, &o)?;
        }
        let mut first = [0u8; 4];
        for peer in 0..w {
            win.local().read(peer * slot, &mut first)?;
            anyhow::ensure!(f32::from_le_bytes(first) == (step * 1000 + peer as u32) as f32, "step {step}: rows from {peer}");
        }
        // Nobody overwrites a slot before its owner has read it.
        pg.barrier(&o)?.wait()?;
    }
    let took = start.elapsed();
    let before = cpu_time();
    std::thread::sleep(Duration::from_secs(1));
    let idle = cpu_time().saturating_sub(before);
    if r == 0 {
        println!(
            "{w} ranks on {:?}: 10 dispatch steps of {} KiB per pair in {took:?}",
            pg.backend_name((weft::DeviceKind::Cpu, weft::Layout::Dense)),
            ROWS * DIM * 4 / 1024
        );
    }
    println!("rank {r}: CPU time with the window open and idle for 1 s: {idle:?}");
    win.deregister()?;
    Ok(())
}
