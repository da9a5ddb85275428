//! The sparse algorithms that move runs: all-gather then k-way merge, and
//! recursive doubling with a 2-way merge per step.

use super::coalesce::{merge2, merge_k, Layout, Run};
use crate::algorithms::{ring, Comm};
use crate::error::Result;
use crate::reduce_op::ReduceOp;

fn key_bytes(keys: &[i64]) -> Vec<u8> {
    keys.iter().flat_map(|k| k.to_le_bytes()).collect()
}

fn keys_of(bytes: &[u8]) -> Vec<i64> {
    bytes.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes"))).collect()
}

/// All-gather keys and values (counts known from the header), then merge.
pub fn allgather(c: &Comm<'_>, run: Run, nnz: &[usize], l: &Layout, op: ReduceOp) -> Result<Run> {
    let mut keys: Vec<Vec<u8>> = nnz.iter().map(|n| vec![0u8; n * 8]).collect();
    let mut vals: Vec<Vec<u8>> = nnz.iter().map(|n| vec![0u8; n * l.row]).collect();
    {
        let mut outs: Vec<&mut [u8]> = keys.iter_mut().map(|v| &mut v[..]).collect();
        ring::all_gather(&c.phase(2), &key_bytes(&run.keys), &mut outs)?;
    }
    {
        let mut outs: Vec<&mut [u8]> = vals.iter_mut().map(|v| &mut v[..]).collect();
        ring::all_gather(&c.phase(3), &run.values, &mut outs)?;
    }
    let runs: Vec<Run> = keys.iter().zip(vals).map(|(k, v)| Run { keys: keys_of(k), values: v }).collect();
    Ok(merge_k(&runs, l.row, l.dtype, op))
}

/// Send a run: its length, then keys and values in one message.
fn send_run(c: &Comm<'_>, step: u32, peer: usize, run: &Run) -> Result<()> {
    c.send(step, peer, &(run.keys.len() as u64).to_le_bytes())?;
    let mut packed = key_bytes(&run.keys);
    packed.extend_from_slice(&run.values);
    c.send(step + 1, peer, &packed)
}

fn recv_run(c: &Comm<'_>, step: u32, peer: usize, row: usize) -> Result<Run> {
    let mut n = [0u8; 8];
    c.recv(step, peer, &mut n)?;
    let n = u64::from_le_bytes(n) as usize;
    let mut packed = vec![0u8; n * (8 + row)];
    c.recv(step + 1, peer, &mut packed)?;
    let values = packed.split_off(n * 8);
    Ok(Run { keys: keys_of(&packed), values })
}

/// Swap runs with `peer` (both send, both receive).
fn swap_run(c: &Comm<'_>, step: u32, peer: usize, run: &Run, row: usize) -> Result<Run> {
    let mut n = [0u8; 8];
    c.send_recv(step, peer, &(run.keys.len() as u64).to_le_bytes(), peer, &mut n)?;
    let theirs = u64::from_le_bytes(n) as usize;
    let mut packed = key_bytes(&run.keys);
    packed.extend_from_slice(&run.values);
    let mut got = vec![0u8; theirs * (8 + row)];
    c.send_recv(step + 1, peer, &packed, peer, &mut got)?;
    let values = got.split_off(theirs * 8);
    Ok(Run { keys: keys_of(&got), values })
}

/// Recursive doubling over the partial unions. Ranks beyond the largest
/// power of two fold into a partner first and get the result back last.
pub fn recursive_doubling(c: &Comm<'_>, mut run: Run, l: &Layout, op: ReduceOp) -> Result<Run> {
    let (w, r) = (c.size(), c.rank());
    let p = 1usize << (usize::BITS - 1 - w.max(1).leading_zeros());
    let rem = w - p;
    const FOLD: u32 = 4000;
    let virt = if r < 2 * rem {
        if r % 2 == 0 {
            send_run(c, FOLD, r + 1, &run)?;
            None
        } else {
            let theirs = recv_run(c, FOLD, r - 1, l.row)?;
            run = merge2(&run, &theirs, l.row, l.dtype, op);
            Some(r / 2)
        }
    } else {
        Some(r - rem)
    };
    if let Some(v) = virt {
        let real = |x: usize| if x < rem { 2 * x + 1 } else { x + rem };
        let (mut mask, mut step) = (1, 0);
        while mask < p {
            let peer = real(v ^ mask);
            let theirs = swap_run(c, step, peer, &run, l.row)?;
            // Both partners combine the same two runs: results stay identical.
            run = merge2(&run, &theirs, l.row, l.dtype, op);
            mask <<= 1;
            step += 2;
        }
    }
    if r < 2 * rem {
        if r % 2 == 1 {
            send_run(c, FOLD + 2, r - 1, &run)?;
        } else {
            run = recv_run(c, FOLD + 2, r + 1, l.row)?;
        }
    }
    Ok(run)
}

/// Sparse reduce-scatter + all-gather: keys are owned by rank `key % W`;
/// every rank sends each owner its keys (pairwise), merges the keys it owns,
/// and the reduced shares are all-gathered and merged. Traffic follows the
/// union when indices overlap, and each rank merges only 1/W of the keys.
pub fn split(c: &Comm<'_>, run: Run, l: &Layout, op: ReduceOp) -> Result<Run> {
    let (w, r) = (c.size(), c.rank());
    // Bucket by owner; a pass in key order keeps every bucket sorted.
    let mut buckets: Vec<Run> = (0..w).map(|_| Run::default()).collect();
    for (k, key) in run.keys.iter().enumerate() {
        let b = &mut buckets[key.rem_euclid(w as i64) as usize];
        b.keys.push(*key);
        b.values.extend_from_slice(&run.values[k * l.row..(k + 1) * l.row]);
    }
    drop(run);
    // Pairwise exchange: in step s, send to r+s, receive from r-s.
    let mut mine: Vec<Run> = Vec::with_capacity(w);
    for s in 1..w {
        let (to, from) = ((r + s) % w, (r + w - s) % w);
        let got = if to == from {
            swap_run(c, 2 * s as u32, to, &buckets[to], l.row)?
        } else {
            // Different peers: counts and payloads in both directions at once.
            let mut n = [0u8; 8];
            c.send_recv(2 * s as u32, to, &(buckets[to].keys.len() as u64).to_le_bytes(), from, &mut n)?;
            let theirs = u64::from_le_bytes(n) as usize;
            let mut packed = key_bytes(&buckets[to].keys);
            packed.extend_from_slice(&buckets[to].values);
            let mut got = vec![0u8; theirs * (8 + l.row)];
            c.send_recv(2 * s as u32 + 1, to, &packed, from, &mut got)?;
            let values = got.split_off(theirs * 8);
            Run { keys: keys_of(&got), values }
        };
        mine.push(got);
    }
    mine.push(std::mem::take(&mut buckets[r]));
    let owned = merge_k(&mine, l.row, l.dtype, op);
    drop(mine);
    // All-gather the reduced shares (sizes first), then merge the disjoint runs.
    let ag = c.phase(c_phase_next(c));
    let mut counts = vec![vec![0u8; 8]; w];
    {
        let mut outs: Vec<&mut [u8]> = counts.iter_mut().map(|v| &mut v[..]).collect();
        ring::all_gather(&ag, &(owned.keys.len() as u64).to_le_bytes(), &mut outs)?;
    }
    let sizes: Vec<usize> = counts.iter().map(|b| u64::from_le_bytes(b[..].try_into().expect("8 bytes")) as usize).collect();
    let mut packed: Vec<Vec<u8>> = sizes.iter().map(|n| vec![0u8; n * (8 + l.row)]).collect();
    {
        let mut mine = key_bytes(&owned.keys);
        mine.extend_from_slice(&owned.values);
        let mut outs: Vec<&mut [u8]> = packed.iter_mut().map(|v| &mut v[..]).collect();
        ring::all_gather(&ag.phase_step(1024), &mine, &mut outs)?;
    }
    let shares: Vec<Run> = packed
        .into_iter()
        .zip(&sizes)
        .map(|(mut p, n)| {
            let values = p.split_off(n * 8);
            Run { keys: keys_of(&p), values }
        })
        .collect();
    Ok(merge_k(&shares, l.row, l.dtype, op))
}

/// The phase after the one `c` runs in.
fn c_phase_next(c: &Comm<'_>) -> u32 {
    c.phase_index() + 1
}
