//! The benchmarked ops: buffer shapes (N = bytes per rank from the size
//! sweep, W = world size, as nccl-tests), one timed call, and a check of
//! the result against the conformance references.

use weft::prelude::*;
use weft::{DType, ReduceOp};
use weft_conformance::reference::{make, reduced_tensor};
use weft_conformance::{Buf, SharedPlacement};

/// The ops `weft bench` knows.
pub const ALL: [&str; 13] = [
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_v",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "p2p",
    "sendrecv",
    "put",
    "barrier",
];

/// Bus-bandwidth factor (nccl-tests' formulas).
pub fn bus_factor(op: &str, w: usize) -> f64 {
    let w = w as f64;
    match op {
        "all_reduce" => 2.0 * (w - 1.0) / w,
        "all_gather" | "reduce_scatter" | "all_to_all" | "all_to_all_v" | "gather" | "scatter" => (w - 1.0) / w,
        _ => 1.0,
    }
}

/// The op [`Case::run`] calls, its name resolved once: an iteration times
/// the op, not a string comparison per op this list knows.
#[derive(Clone, Copy)]
enum Kind {
    AllReduce,
    Reduce,
    Broadcast,
    AllGather,
    ReduceScatter,
    AllToAll,
    AllToAllV,
    Gather,
    Scatter,
    P2p,
    Put,
    SendRecv,
    DeviceCopy,
    Barrier,
}

impl Kind {
    fn of(op: &str) -> Kind {
        match op {
            "all_reduce" => Kind::AllReduce,
            "reduce" => Kind::Reduce,
            "broadcast" => Kind::Broadcast,
            "all_gather" => Kind::AllGather,
            "reduce_scatter" => Kind::ReduceScatter,
            "all_to_all" => Kind::AllToAll,
            "all_to_all_v" => Kind::AllToAllV,
            "gather" => Kind::Gather,
            "scatter" => Kind::Scatter,
            "p2p" => Kind::P2p,
            "put" => Kind::Put,
            "sendrecv" => Kind::SendRecv,
            "device_copy" => Kind::DeviceCopy,
            _ => Kind::Barrier,
        }
    }
}

/// Buffers for one (op, size): inputs, outputs and what to expect.
pub struct Case {
    op: &'static str,
    kind: Kind,
    dtype: DType,
    redop: ReduceOp,
    root: usize,
    /// Elements per rank (N / element size, rounded to what the op needs).
    pub count: usize,
    input: Buf,
    output: Buf,
    splits_in: Vec<usize>,
    splits_out: Vec<usize>,
    /// Where the buffers live (host if `None`).
    place: Option<SharedPlacement>,
    /// `put`: the window every rank registers `count` elements in.
    window: Option<weft::Window>,
    /// The input as made, kept by the first [`Case::refresh`] of an op
    /// that only reads it.
    pristine: Option<Vec<u8>>,
}

/// Period of the reference patterns (see weft_conformance::reference).
const PERIOD: usize = 30;

impl Case {
    /// Set up `op` for `bytes` per rank.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        op: &'static str,
        dtype: DType,
        redop: ReduceOp,
        root: usize,
        bytes: usize,
        pg: &ProcessGroup,
        place: Option<SharedPlacement>,
    ) -> weft::Result<Case> {
        let (r, w) = (pg.rank(), pg.size());
        let per = (bytes / dtype.size()).max(1);
        // Ops that split a buffer in W parts need a multiple of W elements.
        let count = match op {
            "all_gather" | "reduce_scatter" | "all_to_all" | "all_to_all_v" | "gather" | "scatter" => (per / w).max(1) * w,
            "barrier" => 0,
            _ => per,
        };
        let part = count / w;
        let (input, output) = match op {
            "all_gather" | "gather" => (Buf::from_bytes(dtype, &make(dtype, r, part)), Buf::zeros(dtype, count)),
            "reduce_scatter" => (Buf::from_bytes(dtype, &make(dtype, r, count)), Buf::zeros(dtype, part)),
            "scatter" => (Buf::from_bytes(dtype, &make(dtype, r, count)), Buf::zeros(dtype, part)),
            "all_to_all" | "all_to_all_v" | "p2p" | "sendrecv" | "device_copy" | "put" => {
                (Buf::from_bytes(dtype, &make(dtype, r, count)), Buf::zeros(dtype, count))
            }
            _ => (Buf::from_bytes(dtype, &make(dtype, r, count)), Buf::zeros(dtype, 0)),
        };
        let (splits_in, splits_out) = if op == "all_to_all_v" {
            (skewed_splits(count, w, r), (0..w).map(|s| skewed_splits(count, w, s)[r]).collect())
        } else {
            (vec![], vec![])
        };
        let output = if op == "all_to_all_v" { Buf::zeros(dtype, splits_out.iter().sum()) } else { output };
        let (input, output) = (input.place(place.as_ref())?, output.place(place.as_ref())?);
        let window = if op == "put" { Some(pg.new_window_on(count * dtype.size(), input.t().device())?) } else { None };
        Ok(Case { op, kind: Kind::of(op), dtype, redop, root, count, input, output, splits_in, splits_out, place, window, pristine: None })
    }

    /// Bytes per element.
    pub fn dtype_size(&self) -> usize {
        self.dtype.size()
    }

    /// Rewrite every byte of the input on this rank's core, as a program
    /// computes what it sends just before it sends it (`--fresh-inputs`):
    /// the bytes sit dirty in this core's cache, not in memory. Two byte
    /// patterns alternate (normal floats in every dtype: 0x3f3f.., 0x4040..).
    pub fn refresh(&mut self, iteration: usize) {
        if self.pristine.is_none() && !self.in_place() {
            self.pristine = Some(self.input.bytes().to_vec());
        }
        self.input.bytes_mut().fill(if iteration.is_multiple_of(2) { 0x3f } else { 0x40 });
    }

    /// Whether the op writes its result over its input.
    fn in_place(&self) -> bool {
        matches!(self.op, "all_reduce" | "reduce" | "broadcast")
    }

    /// Restore inputs that an in-place op or [`Case::refresh`] overwrote.
    pub fn reset(&mut self, r: usize) -> weft::Result<()> {
        if self.in_place() {
            self.input = Buf::from_bytes(self.dtype, &make(self.dtype, r, self.count)).place(self.place.as_ref())?;
        } else if let Some(made) = &self.pristine {
            self.input.bytes_mut().copy_from_slice(made);
        }
        Ok(())
    }

    /// Run the op once.
    pub fn run(&mut self, pg: &ProcessGroup, o: &OpOptions) -> weft::Result<()> {
        let (r, w) = (pg.rank(), pg.size());
        let part = self.count / w.max(1);
        match self.kind {
            Kind::AllReduce => pg.all_reduce(self.input.tm(), self.redop, o)?.synchronize(),
            Kind::Reduce => pg.reduce(self.input.tm(), self.root, self.redop, o)?.synchronize(),
            Kind::Broadcast => pg.broadcast(self.input.tm(), self.root, o)?.synchronize(),
            Kind::AllGather => pg.all_gather_single(self.output.tm(), self.input.t(), o)?.synchronize(),
            Kind::ReduceScatter => pg.reduce_scatter_single(self.output.tm(), self.input.t(), self.redop, o)?.synchronize(),
            Kind::AllToAll => pg.all_to_all_single(self.output.tm(), self.input.t(), o)?.synchronize(),
            Kind::AllToAllV => {
                pg.all_to_all_v_single(self.output.tm(), self.input.t(), &self.splits_out, &self.splits_in, o)?.synchronize()
            }
            Kind::Gather => {
                let outs = if r == self.root { self.output.tm().split_mut(&vec![part; w])? } else { vec![] };
                pg.gather(outs, self.input.t(), self.root, o)?.synchronize()
            }
            Kind::Scatter => {
                let t = self.input.t();
                let ins = if r == self.root { t.split(&vec![part; w])? } else { vec![] };
                pg.scatter(self.output.tm(), ins, self.root, o)?.synchronize()
            }
            Kind::P2p => {
                // A chain 0 -> 1 -> ... -> W-1, each rank forwarding what it received.
                if r > 0 {
                    pg.recv(self.output.tm(), r - 1, 0, o)?.synchronize()?;
                }
                if r + 1 < w {
                    let src = if r == 0 { self.input.t() } else { self.output.t() };
                    pg.send(src, r + 1, 0, o)?.synchronize()?;
                }
                Ok(())
            }
            // Rank r puts into rank r+1's window and signals it; r+1 waits
            // for the signal (TorchComm's PutBwBenchmark, as a chain).
            Kind::Put => {
                let win = self.window.as_ref().expect("made for put");
                if r + 1 < w {
                    // The signal is ordered after the put whether or not the
                    // put has finished locally (as MPI_Put before a fence).
                    let put = win.put(self.input.t(), r + 1, 0, o)?;
                    win.signal(r + 1, o)?.synchronize()?;
                    put.synchronize()?;
                }
                if r > 0 {
                    win.wait_signal(r - 1, o)?;
                }
                Ok(())
            }
            // Every rank sends to r+1 and receives from r-1 at once
            // (nccl-tests' sendrecv_perf).
            Kind::SendRecv if w > 1 => pg.sendrecv(self.input.t(), (r + 1) % w, self.output.tm(), (r + w - 1) % w, 0, o)?.synchronize(),
            Kind::SendRecv => Ok(()),
            // The memory-bandwidth reference: a copy on every rank, no communication.
            Kind::DeviceCopy => match &self.place {
                Some(p) => p.copy(self.output.addr(), self.input.addr(), self.count * self.dtype.size()),
                None => {
                    weft::kernels::copy(self.output.bytes_mut(), self.input.bytes());
                    Ok(())
                }
            },
            Kind::Barrier => pg.barrier(o)?.synchronize(),
        }
    }

    /// Number of wrong elements in this rank's result after a fresh run.
    pub fn wrong(&self, r: usize, w: usize) -> weft::Result<usize> {
        let (d, sz, part) = (self.dtype, self.dtype.size(), self.count / w.max(1));
        let (input, output) = (self.input.read()?, self.output.read()?);
        // Compare `got` with a pattern that repeats every PERIOD elements.
        let cmp = |got: &[u8], pattern: &[u8]| -> usize {
            got.chunks(sz).enumerate().filter(|(i, e)| *e != &pattern[(i % PERIOD) * sz..(i % PERIOD + 1) * sz]).count()
        };
        let pat = |rank: usize| make(d, rank, PERIOD);
        Ok(match self.op {
            "all_reduce" => cmp(&input, &reduced_tensor(d, self.redop, w, PERIOD)),
            "reduce" if r == self.root => cmp(&input, &reduced_tensor(d, self.redop, w, PERIOD)),
            "reduce" => cmp(&input, &pat(r)),
            "broadcast" => cmp(&input, &pat(self.root)),
            "all_gather" => (0..w).map(|k| cmp(&output[k * part * sz..(k + 1) * part * sz], &pat(k))).sum(),
            "gather" if r == self.root => (0..w).map(|k| cmp(&output[k * part * sz..(k + 1) * part * sz], &pat(k))).sum(),
            "reduce_scatter" => {
                // Rank r's part starts at element r*part of the full reduced pattern.
                let full = reduced_tensor(d, self.redop, w, PERIOD);
                let shifted = shift(&full, r * part, sz);
                cmp(&output, &shifted)
            }
            "scatter" => {
                let full = pat(self.root);
                let shifted = shift(&full, r * part, sz);
                cmp(&output, &shifted)
            }
            "p2p" if r > 0 => cmp(&output, &pat(0)),
            "put" if r > 0 => match &self.window {
                Some(win) if win.device() == weft::Device::Cpu => {
                    let mut got = vec![0u8; win.local().len()];
                    win.local().read(0, &mut got)?;
                    cmp(&got, &pat(r - 1))
                }
                _ => 0,
            },
            "sendrecv" if w > 1 => cmp(&output, &pat((r + w - 1) % w)),
            "all_to_all" | "all_to_all_v" => {
                // From each source s, its part for this rank: offset of r in s's splits.
                let mut off = 0;
                let mut bad = 0;
                for s in 0..w {
                    let (start, n) = if self.op == "all_to_all" { (r * part, part) } else { self.part_of(s, r) };
                    let full = pat(s);
                    let shifted = shift(&full, start, sz);
                    bad += cmp(&output[off * sz..(off + n) * sz], &shifted);
                    off += n;
                }
                bad
            }
            "device_copy" => cmp(&output, &pat(r)),
            _ => 0,
        })
    }

    /// Start and length of the part source `s` sends to `dst` in all_to_all_v.
    fn part_of(&self, s: usize, dst: usize) -> (usize, usize) {
        let v = skewed_splits(self.count, self.splits_out.len(), s);
        (v[..dst].iter().sum(), v[dst])
    }

    /// Whether the reduce op applies to this op.
    pub fn uses_redop(op: &str) -> bool {
        matches!(op, "all_reduce" | "reduce" | "reduce_scatter")
    }
    /// Whether the root applies to this op.
    pub fn uses_root(op: &str) -> bool {
        matches!(op, "broadcast" | "reduce" | "gather" | "scatter")
    }
}

/// all_to_all_v's skew: source `s` sends destination d a share of its
/// `count` elements proportional to 1 + (s + d) % W.
fn skewed_splits(count: usize, w: usize, s: usize) -> Vec<usize> {
    let share = |d: usize| 1 + (s + d) % w;
    let total: usize = (0..w).map(share).sum();
    let mut v: Vec<usize> = (0..w).map(|d| count * share(d) / total).collect();
    v[w - 1] += count - v.iter().sum::<usize>();
    v
}

/// A PERIOD-element pattern rotated to start at element `start`.
fn shift(pattern: &[u8], start: usize, sz: usize) -> Vec<u8> {
    (0..PERIOD).flat_map(|i| pattern[((start + i) % PERIOD) * sz..((start + i) % PERIOD + 1) * sz].to_vec()).collect()
}
