//! The shm backend's `Backend`: small collectives go to the fast path
//! (`fastbox.rs`), point-to-point exchanges (and every other collective's
//! steps) to `exchange.rs`; both run on the calling thread. A waiting rank
//! spins briefly, then sleeps on its futex doorbell (`state.rs`), which
//! peers ring after writing to it or reading from it.

use crate::fastbox::{Waiter, FASTBOX_BYTES};
use crate::state::{ShmBackend, ABORTED, CLOSED, PURE_SPINS, RUNNING, SPIN, TURNS_PER_CLOCK};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use weft::backend::progress::{self, Post, Posting};
use weft::backend::{Backend, Capabilities, Deadline, FastOp, FastOutcome, GatherSend, Op, OpContext, P2p};
use weft::{Error, Result, Tensor, TensorMut};

impl progress::DrivenTransport for ShmBackend {
    fn posting(&self) -> &Arc<Posting> {
        &self.posting
    }
    fn try_drive(&self, until: &dyn Fn() -> bool) -> bool {
        let Some(mut eng) = self.engine.try_lock() else { return false };
        self.drive(&mut eng, &self.posting, false, until);
        true
    }
    fn try_exchange(&self, ops: &mut [P2p<'_>], gathered: &[GatherSend<'_>], deadline: &Deadline) -> Option<Result<()>> {
        let mut eng = self.engine.try_lock()?;
        Some(self.exchange_now(&mut eng, &self.posting, ops, gathered, deadline))
    }
    fn abandon(&self, e: &Error) {
        let e = self.fail(e.clone());
        let mut eng = self.engine.lock();
        self.fail_all(&mut eng, &self.posting, e);
    }
    fn wake_driver(&self) {
        self.wake(self.rank);
    }
}

impl Backend for ShmBackend {
    fn name(&self) -> &str {
        "shm"
    }

    /// all_reduce, broadcast, all_gather and reduce_scatter of at most
    /// `FASTBOX_BYTES` (all ranks' parts together), barrier, and
    /// all_to_all where every rank's parts fit, through the fast path (hint
    /// `shm_fastbox=off`, or an algorithm the op was told to use: through
    /// the rings, with that algorithm).
    fn native_op(&self, op: &mut Op<'_>, ctx: &OpContext) -> Option<Result<()>> {
        let (kind, len) = fast_kind(op)?;
        // (`is_empty` first: no hashing on the common path.)
        let off = match (!ctx.hints.is_empty()).then(|| ctx.hints.get("shm_fastbox")).flatten().map(String::as_str) {
            None | Some("on") => ctx.algorithm.is_some(),
            Some("off") => true,
            Some(v) => return Some(Err(Error::invalid(format!("hint shm_fastbox={v:?}: use on or off")))),
        };
        if off || (len > FASTBOX_BYTES && !matches!(op, Op::AllToAll { .. })) {
            // Numbered all the same: a rank that took the fast path
            // instead is named (see `fastbox`).
            self.fast.through_rings(self, kind, len);
            return None;
        }
        if let Op::AllToAll { inputs, outputs } = op {
            let bytes = Tensor::host_bytes_of(inputs).and_then(|i| Ok((i, TensorMut::host_bytes_of(outputs)?)));
            return match bytes.map(|(i, mut o)| self.fast_all_to_all(&i, &mut o, &ctx.deadline)) {
                Err(e) | Ok(FastOutcome::Done(Err(e))) => Some(Err(e)),
                Ok(FastOutcome::Done(Ok(()))) => Some(Ok(())),
                Ok(_) => None,
            };
        }
        Some(fast_op_of(op).and_then(|mut op| self.run_fast(&mut op, &ctx.deadline)))
    }

    /// What `native_op` runs through the fast path, as core hands it over
    /// directly: the same ops and sizes.
    fn fast_op(&self, op: &mut FastOp<'_>, deadline: &Deadline) -> FastOutcome {
        let len = match op {
            FastOp::AllReduce { buf, .. } | FastOp::Broadcast { buf, .. } => buf.len(),
            FastOp::AllGather { outputs, .. } => outputs.iter().map(|o| o.len()).sum(),
            FastOp::ReduceScatter { inputs, .. } => inputs.iter().map(|i| i.len()).sum(),
            FastOp::Barrier => 0,
            FastOp::AllToAll { inputs, outputs } => return self.fast_all_to_all(inputs, outputs, deadline),
            _ => return FastOutcome::Declined,
        };
        if len > FASTBOX_BYTES {
            return FastOutcome::Declined;
        }
        FastOutcome::Done(self.run_fast(op, deadline))
    }

    fn exchange(&self, ops: &mut [P2p<'_>], deadline: &Deadline) -> Result<()> {
        progress::exchange(self, ops, &[], deadline)
    }

    fn exchange_gathered(&self, ops: &mut [P2p<'_>], gathered: &[GatherSend<'_>], deadline: &Deadline) -> Result<()> {
        progress::exchange(self, ops, gathered, deadline)
    }

    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn post(&self, post: Post) {
        self.posting.push(post);
        self.wake(self.rank);
    }

    fn progress(&self, until: &dyn Fn() -> bool) {
        progress::wait_until(self, until)
    }

    fn abort(&self, reason: &Error) {
        self.fail(reason.clone());
        let me = self.control(self.rank);
        // The rank to blame: a lost one, or the one a timeout waited for.
        if let Some(rank) = reason.blamed_peer() {
            me.blame.store(rank as u32 + 1, Ordering::Release);
        }
        me.state.store(ABORTED, Ordering::Release);
        for r in 0..self.size {
            self.wake(r);
        }
    }

    fn shutdown(&self) {
        let c = self.control(self.rank);
        let _ = c.state.compare_exchange(RUNNING, CLOSED, Ordering::AcqRel, Ordering::Acquire);
        for r in 0..self.size {
            self.wake(r);
        }
    }

    /// Windows in shared memory (`window.rs`).
    fn window(&self, spec: &weft::window::WindowSpec) -> Option<Result<Arc<dyn weft::window::WindowTransport>>> {
        let me = self.me.upgrade()?;
        Some(crate::window::ShmWindow::create(me, spec).map(|w| Arc::new(w) as Arc<dyn weft::window::WindowTransport>))
    }
}

impl Waiter for ShmBackend {
    /// Spin (a few µs without reading the clock, then yielding) for `SPIN`,
    /// then sleep on this rank's doorbell; the peer's health is checked at
    /// each wake-up. Oversubscribed, yield from the start. The clock is
    /// read every `TURNS_PER_CLOCK` turns.
    fn wait_until(&self, peer: usize, what: &dyn Fn() -> String, deadline: &Deadline, ready: &dyn Fn() -> bool) -> Result<()> {
        if self.oversubscribed {
            // More ranks than cores: the peer may be waiting for this core,
            // so go straight to yielding, after one look. The clock is read
            // only once two yields have not brought what this waits for:
            // usually the peer's turn does, and reading it would delay this
            // rank's yield and its return (figures: bench/RESULTS.md,
            // "Measurements behind code comments").
            for _ in 0..2 {
                if ready() {
                    return Ok(());
                }
                std::thread::yield_now();
            }
        } else {
            for _ in 0..PURE_SPINS {
                if ready() {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
        }
        let start = Instant::now();
        let deadline = deadline.get_from(start);
        let mut now = start;
        let mut turns: u32 = 0;
        loop {
            if ready() {
                return Ok(());
            }
            self.check_failed()?;
            turns = turns.wrapping_add(1);
            if turns.is_multiple_of(TURNS_PER_CLOCK) {
                now = Instant::now();
            }
            if now >= deadline {
                return Err(
                    Error::timeout(format!("shm: rank {peer} did not join the {} before the deadline", what())).stalled_on(Some(peer))
                );
            }
            if now.duration_since(start) < SPIN {
                std::thread::yield_now();
                continue;
            }
            self.nap(self.doorbell(), now, deadline, ready);
            now = Instant::now();
            // A peer that published and then left (closed, or died) has
            // still done its part.
            if !ready() {
                if let Some(e) = self.peer_problem(peer) {
                    return Err(self.fail(e));
                }
            }
        }
    }

    /// No fence of its own: the publication was a SeqCst store (a full
    /// barrier already), and with these SeqCst loads it pairs with a
    /// sleeper's flag and fence (see `nap`).
    fn wake_sleepers(&self) {
        for p in (0..self.size).filter(|p| *p != self.rank) {
            if self.control(p).sleeping.armed(Ordering::SeqCst) {
                self.wake(p);
            }
        }
    }
}

/// The ops the fast path may take, as its slots describe them, with their
/// bytes in all (all ranks' parts together; all_to_all: decided in the
/// round, see `Fastbox::all_to_all`).
fn fast_kind(op: &Op<'_>) -> Option<(crate::fastbox::Kind, usize)> {
    use crate::fastbox::Kind;
    Some(match op {
        Op::AllReduce { buf, op } => (Kind::AllReduce(buf.dtype(), *op), buf.nbytes()),
        Op::Broadcast { buf, root } => (Kind::Broadcast(*root), buf.nbytes()),
        Op::Barrier => (Kind::Barrier, 0),
        Op::AllGather { outputs, .. } => (Kind::AllGather, outputs.iter().map(|o| o.nbytes()).sum()),
        Op::ReduceScatter { inputs, output, op } => (Kind::ReduceScatter(output.dtype(), *op), inputs.iter().map(|i| i.nbytes()).sum()),
        Op::AllToAll { inputs, .. } => (Kind::AllToAll, inputs.iter().map(|i| i.nbytes()).sum()),
        _ => return None,
    })
}

/// A fast-path op (`native_op` chose it, not all_to_all) over its bytes.
fn fast_op_of<'a>(op: &'a mut Op<'_>) -> Result<FastOp<'a>> {
    Ok(match op {
        Op::AllReduce { buf, op } => FastOp::AllReduce { dtype: buf.dtype(), buf: buf.host_bytes_mut()?, op: *op },
        Op::Broadcast { buf, root } => FastOp::Broadcast { buf: buf.host_bytes_mut()?, root: *root },
        Op::AllGather { input, outputs } => FastOp::AllGather { input: input.host_bytes()?, outputs: TensorMut::host_bytes_of(outputs)? },
        Op::ReduceScatter { inputs, output, op } => FastOp::ReduceScatter {
            inputs: Tensor::host_bytes_of(inputs)?,
            dtype: output.dtype(),
            output: output.host_bytes_mut()?,
            op: *op,
        },
        Op::Barrier => FastOp::Barrier,
        _ => unreachable!("native_op sends only the ops above"),
    })
}

impl ShmBackend {
    /// Run a fast-path op, `native_op`'s or core's (`fast_op`).
    fn run_fast(&self, op: &mut FastOp<'_>, d: &Deadline) -> Result<()> {
        let fb = &self.fast;
        let r = self.check_failed().and_then(|()| match op {
            FastOp::AllReduce { buf, dtype, op } => fb.all_reduce(self, buf, *dtype, *op, d),
            FastOp::Broadcast { buf, root } => fb.broadcast(self, buf, *root, d),
            FastOp::AllGather { input, outputs } => fb.all_gather(self, input, outputs, d),
            FastOp::ReduceScatter { inputs, output, dtype, op } => fb.reduce_scatter(self, inputs, output, *dtype, *op, d),
            // (Every rank computed `oversubscribed` from the same data.)
            FastOp::Barrier if self.oversubscribed => fb.barrier_from_zero(self, d),
            FastOp::Barrier => fb.barrier(self, d),
            _ => unreachable!("fast_op passes only the variants above"),
        });
        r.map_err(|e| self.fast_failed(e))
    }

    /// A fast op's error: a mismatch that left the ranks' call numbers
    /// out of step (one took the rings) ends this transport, as the rings
    /// side finds too.
    fn fast_failed(&self, e: Error) -> Error {
        if self.fast.desynced() {
            self.fail(e)
        } else {
            e
        }
    }

    /// all_to_all through the fast path: `Generic` if some rank's parts
    /// did not fit (whether a rank's parts fit differs between ranks:
    /// every rank takes the fast round, and all take the rings if one did
    /// not fit).
    fn fast_all_to_all(&self, inputs: &[&[u8]], outputs: &mut [&mut [u8]], d: &Deadline) -> FastOutcome {
        match self.check_failed().and_then(|()| self.fast.all_to_all(self, inputs, outputs, d)) {
            Ok(true) => FastOutcome::Done(Ok(())),
            Ok(false) => FastOutcome::Generic,
            Err(e) => FastOutcome::Done(Err(self.fast_failed(e))),
        }
    }
}
