//! The sparse algorithms that move runs: all-gather then k-way merge,
//! recursive doubling with a 2-way merge per step, and split (a sparse
//! reduce-scatter over key ranges, then an all-gather of the shares).

use super::coalesce::{distinct, merge_into, merge_k, recycle, reuse, Geometry, Run, RunRef, Sorted, SortedRows};
use crate::algorithms::fold::Fold;
use crate::algorithms::{linear, pipeline, ring, Steps};
use crate::backend::{Gather, P2p};
use crate::error::Result;
use crate::kernels::Scratch;
use crate::reduce_op::ReduceOp;
use std::ops::DerefMut;

fn key_bytes(keys: &[i64]) -> Vec<u8> {
    keys.iter().flat_map(|k| k.to_le_bytes()).collect()
}

fn keys_of(bytes: &[u8]) -> Vec<i64> {
    bytes.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes"))).collect()
}

/// All-gather keys and values (counts known from the header), then merge
/// (into `reused`, a finished result's buffer; `run`'s is recycled). Rows
/// land in pooled scratch: no fresh pages to fault in on every call.
pub fn allgather(c: &Steps<'_>, run: Run, nnz: &[usize], l: &Geometry, op: ReduceOp, reused: Vec<u8>) -> Result<Run> {
    let w = c.size();
    let (keys_at, rows_at) = (offsets(nnz.iter().map(|n| n * 8)), offsets(nnz.iter().map(|n| n * l.row)));
    let mut keys = vec![0u8; keys_at[w]];
    let mut rows = Scratch::take(rows_at[w]);
    ring::all_gather(&c.phase(2), &key_bytes(&run.keys), &mut pipeline::split_blocks(&mut keys, &keys_at))?;
    ring::all_gather(&c.phase(3), &run.values, &mut pipeline::split_blocks(&mut rows, &rows_at))?;
    let keys = keys_of(&keys);
    let refs: Vec<RunRef<'_>> =
        (0..w).map(|i| RunRef::packed(&keys[keys_at[i] / 8..keys_at[i + 1] / 8], &rows[rows_at[i]..rows_at[i + 1]])).collect();
    let merged = merge_k(&refs, l.row, l.dtype, op, reused);
    recycle(run.values);
    Ok(merged)
}

/// Send a run: its length, then its keys and its rows (two messages, so
/// the rows go from where they are).
fn send_run(c: &Steps<'_>, step: u32, peer: usize, run: &Run) -> Result<()> {
    c.send(step, peer, &(run.keys.len() as u64).to_le_bytes())?;
    let keys = key_bytes(&run.keys);
    c.exchange(&mut [P2p::Send { peer, tag: c.tag(step + 1), data: &keys }, P2p::Send { peer, tag: c.tag(step + 2), data: &run.values }])
}

/// Receive what [`send_run`] sent: the keys, and the rows into the buffer
/// `rows(bytes)` gives.
fn recv_run<B: DerefMut<Target = [u8]>>(
    c: &Steps<'_>,
    step: u32,
    peer: usize,
    l: &Geometry,
    rows: impl FnOnce(usize) -> B,
) -> Result<(Vec<i64>, B)> {
    let mut n = [0u8; 8];
    c.recv(step, peer, &mut n)?;
    let n = l.entries(u64::from_le_bytes(n), peer)?;
    let (mut keys, mut values) = (vec![0u8; n * 8], rows(n * l.row));
    c.exchange(&mut [
        P2p::Recv { peer, tag: c.tag(step + 1), buf: &mut keys },
        P2p::Recv { peer, tag: c.tag(step + 2), buf: &mut values },
    ])?;
    Ok((keys_of(&keys), values))
}

/// Swap runs with `peer` (both send, both receive, as [`send_run`] and
/// [`recv_run`] do); theirs arrives in pooled scratch.
fn swap_run(c: &Steps<'_>, step: u32, peer: usize, run: &Run, l: &Geometry) -> Result<(Vec<i64>, Scratch)> {
    let mut n = [0u8; 8];
    c.send_recv(step, peer, &(run.keys.len() as u64).to_le_bytes(), peer, &mut n)?;
    let theirs = l.entries(u64::from_le_bytes(n), peer)?;
    let mine = key_bytes(&run.keys);
    let (mut keys, mut values) = (vec![0u8; theirs * 8], Scratch::take(theirs * l.row));
    let (kt, vt) = (c.tag(step + 1), c.tag(step + 2));
    c.exchange(&mut [
        P2p::Send { peer, tag: kt, data: &mine },
        P2p::Recv { peer, tag: kt, buf: &mut keys },
        P2p::Send { peer, tag: vt, data: &run.values },
        P2p::Recv { peer, tag: vt, buf: &mut values },
    ])?;
    Ok((keys_of(&keys), values))
}

/// Recursive doubling over the partial unions. Ranks beyond the largest
/// power of two fold into a partner first and get the result back last
/// ([`Fold`], as the dense recursive doubling does). Each merge writes into
/// the buffer the merge before it read (the first into `spare`); the buffer
/// left over is recycled for the next op.
pub fn recursive_doubling(c: &Steps<'_>, mut run: Run, l: &Geometry, op: ReduceOp, mut spare: Vec<u8>) -> Result<Run> {
    const FOLD: u32 = 4000;
    // Both partners combine the two runs in the same order, the lower
    // rank's first (`mine_first` on that rank): where contributions meet,
    // the result's bits may depend on the order (min of -0.0 and +0.0, a
    // NaN's payload), and every rank must end with the same bits.
    let absorb = |run: Run, keys: &[i64], rows: &[u8], mine_first: bool, spare: &mut Vec<u8>| {
        let (mine, theirs) = (run.as_ref(), RunRef::packed(keys, rows));
        let runs = if mine_first { [mine, theirs] } else { [theirs, mine] };
        let merged = merge_k(&runs, l.row, l.dtype, op, std::mem::take(spare));
        *spare = run.values;
        merged
    };
    let fold = Fold::new(c);
    if let Some(to) = fold.sits_out_for() {
        send_run(c, FOLD, to, &run)?;
    } else if let Some(from) = fold.stands_for() {
        let (keys, rows) = recv_run(c, FOLD, from, l, Scratch::take)?;
        run = absorb(run, &keys, &rows, true, &mut spare);
    }
    if let Some(v) = fold.virtual_rank() {
        let (mut mask, mut step) = (1, 0);
        while mask < fold.p {
            let peer = fold.real(v ^ mask);
            let (keys, rows) = swap_run(c, step, peer, &run, l)?;
            run = absorb(run, &keys, &rows, v & mask == 0, &mut spare);
            mask <<= 1;
            step += 3;
        }
    }
    if let Some(to) = fold.stands_for() {
        send_run(c, FOLD + 3, to, &run)?;
    } else if let Some(from) = fold.sits_out_for() {
        let (keys, values) = recv_run(c, FOLD + 3, from, l, |n| reuse(std::mem::take(&mut spare), n))?;
        run = Run { keys, values };
    }
    recycle(spare);
    Ok(run)
}

/// Sparse reduce-scatter + all-gather over key ranges: rank i owns keys in
/// `[bounds[i-1], bounds[i])` (ranges holding equal shares of all ranks'
/// entries, from the spaced keys). Each rank's sorted input splits into W
/// slices by binary search; every rank sends each owner its slice (rows
/// gathered from where the caller left them as the transport writes them
/// out, [`SortedRows`]: shared memory's rings take them with no packed
/// copy first; other transports pack them once); owners merge their
/// range, reading their own slice where it lies, straight into its place
/// in the result (`reused`, a
/// finished result's buffer); the reduced shares, disjoint and in key
/// order, are then all-gathered around it. Traffic follows the union when
/// indices overlap, each rank merges only its range, and no row is copied
/// twice on a rank.
/// Each of the four exchanges (slice sizes, slices, share sizes, shares)
/// talks to every peer at once: four steps whatever W.
pub fn split(c: &Steps<'_>, input: &Sorted<'_>, l: &Geometry, op: ReduceOp, bounds: &[i64], reused: Vec<u8>) -> Result<Run> {
    let (w, r) = (c.size(), c.rank());
    debug_assert_eq!(bounds.len() + 1, w);
    // Slice i of the input: the keys rank i owns.
    let mut cut = vec![0usize; w + 1];
    for (i, b) in bounds.iter().enumerate() {
        cut[i + 1] = input.keys.partition_point(|k| k < b);
    }
    cut[w] = input.keys.len();
    let slice = |i: usize| cut[i]..cut[i + 1];
    // How many rows each rank sends each owner.
    let counts: Vec<[u8; 8]> = (0..w).map(|i| (slice(i).len() as u64).to_le_bytes()).collect();
    let incoming = exchange_counts(&c.phase_step(0), &counts, l)?;
    // Every owner's slice: keys as they lie, rows gathered from where they
    // lie as they go out (a transport that cannot packs them first);
    // received where the merge reads them. The row buffers come from the
    // scratch pool: no fresh pages on every call.
    let keys_out: Vec<Vec<u8>> = (0..w).map(|i| if i == r { Vec::new() } else { key_bytes(&input.keys[slice(i)]) }).collect();
    let rows_out: Vec<SortedRows<'_>> = (0..w).map(|i| input.rows(if i == r { 0..0 } else { slice(i) })).collect();
    let got_at = offsets(incoming.iter().map(|n| n * l.row));
    let mut got_rows = Scratch::take(got_at[w]);
    let mut got_keys: Vec<Vec<u8>> = incoming.iter().map(|n| vec![0u8; n * 8]).collect();
    {
        let gv = pipeline::split_blocks(&mut got_rows, &got_at);
        let gk = got_keys.iter_mut().map(Vec::as_mut_slice).collect();
        let gathered = [rows_out.iter().map(|g| g as &dyn Gather).collect()];
        linear::exchange_all_gathered(
            &c.phase_step(8).combining(),
            &[keys_out.iter().map(Vec::as_slice).collect()],
            &gathered,
            &mut [gk, gv],
        )?;
    }
    drop((keys_out, rows_out));
    let keys: Vec<Vec<i64>> = got_keys.iter().map(|k| keys_of(k)).collect();
    let parts: Vec<RunRef<'_>> = (0..w)
        .map(|src| if src == r { input.slice(slice(r)) } else { RunRef::packed(&keys[src], &got_rows[got_at[src]..got_at[src + 1]]) })
        .collect();
    // Every rank's share size, then each share's place in the result (in
    // rank order, which is key order).
    let share = distinct(&parts);
    let mut sizes = exchange_counts(&c.phase_step(16), &vec![(share as u64).to_le_bytes(); w], l)?;
    sizes[r] = share;
    let starts = offsets(sizes.iter().copied());
    let bytes_at = |unit: usize| starts.iter().map(|s| s * unit).collect::<Vec<usize>>();
    let mut all_keys = vec![0u8; starts[w] * 8];
    let mut all_values = reuse(reused, starts[w] * l.row);
    {
        let mut kb = pipeline::split_blocks(&mut all_keys, &bytes_at(8));
        let mut vb = pipeline::split_blocks(&mut all_values, &bytes_at(l.row));
        // This rank's share is sent from where it is merged; the exchange
        // leaves this rank's own blocks alone.
        let (own_keys, own_values) = (std::mem::take(&mut kb[r]), std::mem::take(&mut vb[r]));
        merge_into(&parts, l.row, l.dtype, op, own_keys, own_values);
        drop(parts);
        drop(got_rows);
        let sends = [vec![&*own_keys; w], vec![&*own_values; w]];
        linear::exchange_all(&c.phase_step(24).sending_fresh(), &sends, &mut [kb, vb])?;
    }
    Ok(Run { keys: keys_of(&all_keys), values: all_values })
}

/// Running offsets of consecutive blocks of these lengths (W+1 entries).
fn offsets(lens: impl Iterator<Item = usize>) -> Vec<usize> {
    std::iter::once(0)
        .chain(lens.scan(0, |at, n| {
            *at += n;
            Some(*at)
        }))
        .collect()
}

/// Send `counts[i]` (8 bytes, entries) to every rank i at once; what each
/// rank sent this one (0 from itself).
fn exchange_counts(c: &Steps<'_>, counts: &[[u8; 8]], l: &Geometry) -> Result<Vec<usize>> {
    let mut incoming = vec![[0u8; 8]; counts.len()];
    linear::exchange_all(c, &[counts.iter().map(|x| &x[..]).collect()], &mut [incoming.iter_mut().map(|x| &mut x[..]).collect()])?;
    incoming[c.rank()] = [0; 8];
    incoming.iter().enumerate().map(|(from, b)| l.entries(u64::from_le_bytes(*b), from)).collect()
}
