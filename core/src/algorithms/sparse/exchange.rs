//! The sparse algorithms that move runs: all-gather then k-way merge, and
//! recursive doubling with a 2-way merge per step.

use super::coalesce::{merge2, merge_k, Layout, Run, RunRef};
use crate::algorithms::recursive::Fold;
use crate::algorithms::{linear, ring, Comm};
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
    let refs: Vec<RunRef<'_>> = runs.iter().map(Run::as_ref).collect();
    Ok(merge_k(&refs, l.row, l.dtype, op))
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
/// power of two fold into a partner first and get the result back last
/// ([`Fold`], as the dense recursive doubling does).
pub fn recursive_doubling(c: &Comm<'_>, mut run: Run, l: &Layout, op: ReduceOp) -> Result<Run> {
    const FOLD: u32 = 4000;
    let fold = Fold::new(c);
    if let Some(to) = fold.sits_out_for() {
        send_run(c, FOLD, to, &run)?;
    } else if let Some(from) = fold.stands_for() {
        let theirs = recv_run(c, FOLD, from, l.row)?;
        run = merge2(&run, &theirs, l.row, l.dtype, op);
    }
    if let Some(v) = fold.virtual_rank() {
        let (mut mask, mut step) = (1, 0);
        while mask < fold.p {
            let peer = fold.real(v ^ mask);
            let theirs = swap_run(c, step, peer, &run, l.row)?;
            // Both partners combine the same two runs: results stay identical.
            run = merge2(&run, &theirs, l.row, l.dtype, op);
            mask <<= 1;
            step += 2;
        }
    }
    if let Some(to) = fold.stands_for() {
        send_run(c, FOLD + 2, to, &run)?;
    } else if let Some(from) = fold.sits_out_for() {
        run = recv_run(c, FOLD + 2, from, l.row)?;
    }
    Ok(run)
}

/// Sparse reduce-scatter + all-gather over key ranges: rank i owns keys in
/// [bounds[i-1], bounds[i]) (ranges holding equal shares of the union, from
/// the sketch). Each rank's sorted run splits into W slices without
/// copying; every rank sends each owner its slice; owners merge; the
/// reduced shares, disjoint and in key order, are all-gathered straight
/// into the result. Traffic follows the union when indices overlap, each
/// rank merges only its range, and nothing is merged twice. Each of the four
/// exchanges (slice sizes, slices, share sizes, shares) talks to every peer
/// at once: four steps whatever W.
pub fn split(c: &Comm<'_>, run: Run, l: &Layout, op: ReduceOp, bounds: &[i64]) -> Result<Run> {
    let (w, r) = (c.size(), c.rank());
    debug_assert_eq!(bounds.len() + 1, w);
    // Slice i of the run: the keys rank i owns.
    let mut cut = vec![0usize; w + 1];
    for (i, b) in bounds.iter().enumerate() {
        cut[i + 1] = run.keys.partition_point(|k| k < b);
    }
    cut[w] = run.keys.len();
    let slice = |i: usize| RunRef { keys: &run.keys[cut[i]..cut[i + 1]], values: &run.values[cut[i] * l.row..cut[i + 1] * l.row] };
    // How many rows each rank sends each owner.
    let counts: Vec<[u8; 8]> = (0..w).map(|i| (slice(i).keys.len() as u64).to_le_bytes()).collect();
    let incoming = exchange_counts(&c.phase_step(0), &counts)?;
    // Every owner's slices, keys and values as they lie, landing where the
    // merge reads them.
    let keys_out: Vec<Vec<u8>> = (0..w).map(|i| if i == r { Vec::new() } else { key_bytes(slice(i).keys) }).collect();
    let mut got: Vec<(Vec<u8>, Vec<u8>)> = incoming.iter().map(|n| (vec![0u8; n * 8], vec![0u8; n * l.row])).collect();
    {
        let sends = [keys_out.iter().map(Vec::as_slice).collect(), (0..w).map(|i| slice(i).values).collect()];
        let (gk, gv): (Vec<&mut [u8]>, Vec<&mut [u8]>) = got.iter_mut().map(|(k, v)| (k.as_mut_slice(), v.as_mut_slice())).unzip();
        linear::exchange_all(&c.phase_step(8), &sends, &mut [gk, gv])?;
    }
    drop(keys_out);
    let owned = {
        let keys: Vec<Vec<i64>> = got.iter().map(|(k, _)| keys_of(k)).collect();
        let parts: Vec<RunRef<'_>> =
            (0..w).map(|src| if src == r { slice(r) } else { RunRef { keys: &keys[src], values: &got[src].1 } }).collect();
        merge_k(&parts, l.row, l.dtype, op)
    };
    drop(got);
    // All-gather the reduced shares (sizes first) into one run: shares are
    // disjoint and in rank order, which is key order.
    let mut sizes = exchange_counts(&c.phase_step(16), &vec![(owned.keys.len() as u64).to_le_bytes(); w])?;
    sizes[r] = owned.keys.len();
    // Where each rank's share starts, in rows.
    let starts: Vec<usize> = std::iter::once(0)
        .chain(sizes.iter().scan(0, |at, n| {
            *at += n;
            Some(*at)
        }))
        .collect();
    let bytes_at = |unit: usize| starts.iter().map(|s| s * unit).collect::<Vec<usize>>();
    let mut all_keys = vec![0u8; starts[w] * 8];
    let mut all_values = vec![0u8; starts[w] * l.row];
    {
        let own_keys = key_bytes(&owned.keys);
        let mut kb = ring::split_blocks(&mut all_keys, &bytes_at(8));
        let mut vb = ring::split_blocks(&mut all_values, &bytes_at(l.row));
        kb[r].copy_from_slice(&own_keys);
        vb[r].copy_from_slice(&owned.values);
        let sends = [vec![own_keys.as_slice(); w], vec![owned.values.as_slice(); w]];
        linear::exchange_all(&c.phase_step(24), &sends, &mut [kb, vb])?;
    }
    Ok(Run { keys: keys_of(&all_keys), values: all_values })
}

/// Send `counts[i]` (8 bytes) to every rank i at once; what each rank sent
/// this one (0 from itself).
fn exchange_counts(c: &Comm<'_>, counts: &[[u8; 8]]) -> Result<Vec<usize>> {
    let mut incoming = vec![[0u8; 8]; counts.len()];
    linear::exchange_all(c, &[counts.iter().map(|x| &x[..]).collect()], &mut [incoming.iter_mut().map(|x| &mut x[..]).collect()])?;
    let mut n: Vec<usize> = incoming.iter().map(|b| u64::from_le_bytes(*b) as usize).collect();
    n[c.rank()] = 0;
    Ok(n)
}
