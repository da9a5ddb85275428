//! The direct GPU ring all-reduce: reduce-scatter then all-gather, each
//! block cut into slot-sized pieces that flow through the next rank's IPC
//! receive slots, so copies and reductions of successive pieces overlap.
//!
//! Only tiny control messages go through the CPU backend; the data moves
//! GPU to GPU:
//!
//! ```text
//! sender, piece k (slot k % SLOTS)          receiver (next rank)
//!   [k >= SLOTS] recv "consumed k-SLOTS"      recv "filled k"
//!   stream waits next.consumed[slot]          stream waits prev.filled[slot]
//!   copy piece -> next's slot                 reduce (or copy) slot -> buffer
//!   record filled[slot], send "filled k"      record consumed[slot], send "consumed k"
//! ```
//!
//! The "waits" are stream waits (the host never waits for the GPU), or,
//! where a neighbour is another process on the same GPU, host waits
//! (`Peers::host_wait`: a stream blocked on another process's event would
//! hold the GPU's time slice).
//!
//! A wait on an IPC event waits for its latest record; the messages make
//! sure that record is the one meant (a slot is reused only after its
//! "consumed" arrives). Each op drains its outstanding "consumed" messages,
//! so the next op starts with every slot free.

use crate::setup::{Peers, SLOTS};
use std::time::Instant;
use weft::algorithms::Steps;
use weft::backend::{Backend, OpContext};
use weft::{DType, Error, ReduceOp, Result, StreamHandle, TensorMut};

const FILLED: u32 = 1;
const CONSUMED: u32 = 2;

/// One op's progress through the slots.
struct Flow<'a> {
    ring: &'a Peers,
    steps: Steps<'a>,
    stream: StreamHandle,
    next: usize,
    prev: usize,
    /// Pieces written to the next rank, and read from my slots.
    sent: u64,
    received: u64,
    deadline: Instant,
}

impl Flow<'_> {
    /// Wait for the next rank to have read piece `k`'s slot (a message,
    /// then a stream wait on its event).
    fn await_consumed(&mut self, k: u64) -> Result<()> {
        let mut m = [0u8; 8];
        self.steps.recv(CONSUMED, self.next, &mut m)?;
        check(k, m, "consumed")?;
        let what = format!("rank {}'s read of piece {k}", self.next);
        self.ring.after(self.stream, self.ring.next_consumed[(k % SLOTS as u64) as usize], self.deadline, &what)
    }

    /// Send `bytes` at `src` as the next piece.
    fn send_piece(&mut self, src: u64, bytes: usize) -> Result<()> {
        let k = self.sent;
        if k >= SLOTS as u64 {
            self.await_consumed(k - SLOTS as u64)?;
        }
        let q = (k % SLOTS as u64) as usize;
        let g = &self.ring.gpu;
        // SAFETY: the slot is free (awaited above) and `bytes` fits it; the
        // source is inside the op's buffer, borrowed until completion.
        unsafe { g.copy_dtod(self.stream, self.ring.next_slots + (q * self.ring.slot_bytes) as u64, src, bytes)? };
        g.record(self.ring.filled[q], self.stream)?;
        self.steps.send(FILLED, self.next, &k.to_le_bytes())?;
        self.sent += 1;
        Ok(())
    }

    /// Take the next piece into `dst`: reduced into it with `op`, or copied.
    fn recv_piece(&mut self, dst: u64, count: usize, dtype: DType, op: Option<ReduceOp>) -> Result<()> {
        let k = self.received;
        let mut m = [0u8; 8];
        self.steps.recv(FILLED, self.prev, &mut m)?;
        check(k, m, "filled")?;
        let q = (k % SLOTS as u64) as usize;
        let g = &self.ring.gpu;
        let what = format!("rank {}'s write of piece {k}", self.prev);
        self.ring.after(self.stream, self.ring.prev_filled[q], self.deadline, &what)?;
        let slot = self.ring.my_slots + (q * self.ring.slot_bytes) as u64;
        // SAFETY: the previous rank filled the slot (waited for above); the
        // destination is inside the op's buffer.
        unsafe {
            match op {
                Some(op) => g.reduce(self.stream, dst, slot, count, dtype, op)?,
                None => g.copy_dtod(self.stream, dst, slot, count * dtype.size())?,
            }
        }
        g.record(self.ring.consumed[q], self.stream)?;
        self.steps.send(CONSUMED, self.prev, &k.to_le_bytes())?;
        self.received += 1;
        Ok(())
    }

    /// Collect the "consumed" messages still owed, so every slot is free.
    fn drain(&mut self) -> Result<()> {
        for k in self.sent.saturating_sub(SLOTS as u64)..self.sent {
            self.await_consumed(k)?;
        }
        Ok(())
    }
}

fn check(want: u64, got: [u8; 8], what: &str) -> Result<()> {
    let got = u64::from_le_bytes(got);
    if got != want {
        return Err(Error::backend(format!("cuda-device: ring out of step: expected \"{what}\" for piece {want}, got piece {got}")));
    }
    Ok(())
}

/// In-place all-reduce of `buf` (on the ring's device), queued on `stream`;
/// a `PremulSum` input is already scaled.
pub fn all_reduce(
    ring: &Peers,
    cpu: &dyn Backend,
    ctx: &OpContext,
    stream: StreamHandle,
    buf: &mut TensorMut<'_>,
    op: ReduceOp,
) -> Result<()> {
    let (count, dtype) = (buf.numel(), buf.dtype());
    let buf = buf.as_ptr() as u64;
    let (r, w) = (ctx.rank, ctx.size);
    let g = &ring.gpu;
    if w > 1 {
        crate::agree::check(&Steps::new(cpu, ctx).phase(2), 0, count, dtype, op)?;
    }
    let esize = dtype.size();
    let bounds: Vec<usize> = (0..=w).map(|i| count * i / w).collect();
    let block = |b: usize| (bounds[b % w], bounds[b % w + 1]);
    let piece_elems = (ring.slot_bytes / esize).max(1);
    let mut flow = Flow {
        ring,
        steps: Steps::new(cpu, ctx),
        stream,
        next: (r + 1) % w,
        prev: (r + w - 1) % w,
        sent: 0,
        received: 0,
        deadline: ctx.deadline.get(),
    };
    // Each step moves one block; both neighbours cut it into the same
    // pieces. Piece i+1 is sent before piece i is received, so the next
    // rank has work queued while this one waits (no deadlock: a rank
    // blocked on the next one's "consumed" is at most one piece ahead of it).
    let mut step = |send_block: usize, recv_block: usize, reduce: Option<ReduceOp>| -> Result<()> {
        let (s0, s1) = block(send_block);
        let (r0, r1) = block(recv_block);
        let (ns, nr) = ((s1 - s0).div_ceil(piece_elems), (r1 - r0).div_ceil(piece_elems));
        let mut sent = 0;
        for i in 0..nr {
            while sent < ns && sent <= i + 1 {
                let a = s0 + sent * piece_elems;
                flow.send_piece(buf + (a * esize) as u64, piece_elems.min(s1 - a) * esize)?;
                sent += 1;
            }
            let a = r0 + i * piece_elems;
            flow.recv_piece(buf + (a * esize) as u64, piece_elems.min(r1 - a), dtype, reduce)?;
        }
        for j in sent..ns {
            let a = s0 + j * piece_elems;
            flow.send_piece(buf + (a * esize) as u64, piece_elems.min(s1 - a) * esize)?;
        }
        Ok(())
    };
    if w > 1 {
        for t in 0..w - 1 {
            step(r + w - t, r + w - t - 1, Some(op))?;
        }
    }
    if op == ReduceOp::Avg {
        // This rank now holds block r+1 fully reduced: finish it once, here.
        let (a, b) = block(r + 1);
        // SAFETY: inside the op's buffer.
        unsafe { g.divide(stream, buf + (a * esize) as u64, b - a, dtype, w as u32)? };
    }
    if w > 1 {
        for t in 0..w - 1 {
            step(r + 1 + w - t, r + w - t, None)?;
        }
    }
    flow.drain()
}
