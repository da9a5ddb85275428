//! The shm backend: the segment's layout (a control block per rank, a
//! single-copy cell and a byte ring per ordered pair of ranks, fast-path
//! slots), waiting, and peers' health. Small collectives go to the fast
//! path (`fastbox.rs`), point-to-point exchanges to `exchange.rs`; both run on
//! the calling thread. A waiting rank spins briefly, then sleeps on its
//! futex doorbell, which peers ring after writing to it or reading from
//! it. Dead peers are found by pid while waiting.

use crate::cma::Cell;
use crate::exchange::Engine;
use crate::fastbox::{Fastbox, Waiter, FASTBOX_BYTES};
use crate::ring::{footprint, Ring};
use crate::segment::Segment;
use linux_futex::{Futex, Shared};
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use weft::backend::{Backend, Deadline, GatherSend, Op, OpContext, P2p};
use weft::progress::{self, Post, Posting};
use weft::{Error, Result, Tensor, TensorMut};

const RUNNING: u32 = 0;
const CLOSED: u32 = 1;
const ABORTED: u32 = 2;
/// Spin this long without progress before sleeping.
pub(crate) const SPIN: Duration = Duration::from_micros(30);
/// The first part of that spin, without yielding the core.
pub(crate) const PAUSE_SPIN: Duration = Duration::from_micros(5);
/// The fast path's first checks, without reading the clock or yielding.
const PURE_SPINS: usize = 1000;
/// Spin this long while a peer reads a single-copy offer.
pub(crate) const CMA_SPIN: Duration = Duration::from_millis(2);
/// Sleep at most this long before re-checking peers' liveness.
pub(crate) const NAP: Duration = Duration::from_millis(20);

/// Per-rank control block in the segment.
#[repr(C, align(64))]
pub struct Control {
    pid: AtomicU32,
    state: AtomicU32,
    doorbell: Futex<Shared>,
    sleeping: AtomicU32,
    /// After an abort: 1 + the rank this rank blames (0: itself).
    blame: AtomicU32,
}

/// Shared memory a group may use for its rings, at most. The segment is
/// reserved up front (no SIGBUS later), so this is real memory per group:
/// kept modest for programs with many sub-groups.
const BUDGET: usize = 16 << 20;

/// Data bytes per ring for `w` ranks when `avail` bytes of /dev/shm are
/// free: a power of two in [16 KiB, 8 MiB], rings taking at most
/// min(BUDGET, avail / 4) in all. Larger rings keep big transfers streaming.
pub fn ring_cap(w: usize, avail: usize) -> usize {
    let budget = BUDGET.min(avail / 4);
    let per = budget / (w * w).max(1);
    let cap = if per.is_power_of_two() { per } else { per.next_power_of_two() / 2 };
    cap.clamp(16 << 10, 8 << 20)
}

/// Segment size for `w` ranks with rings of `cap` bytes: control blocks,
/// single-copy cells, rings, fast-path slots.
pub fn segment_len(w: usize, cap: usize) -> usize {
    fastbox_at(w, cap) + Fastbox::len(w)
}

fn fastbox_at(w: usize, cap: usize) -> usize {
    rings_at(w) + w * w * footprint(cap)
}

fn rings_at(w: usize) -> usize {
    w * std::mem::size_of::<Control>() + w * w * std::mem::size_of::<Cell>()
}

/// The backend of one group: its segment, rings and fast-path slots.
pub struct ShmBackend {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    seg: Segment,
    rings: Vec<Ring>,
    /// Inbound state and posted ops; whoever holds it drives them all.
    pub(crate) engine: Mutex<Engine>,
    /// Batches waiting for the driver.
    pub(crate) posting: Arc<Posting>,
    /// The first failure: the rings are out of step for good after it.
    failed: std::sync::OnceLock<Error>,
    /// Offer large sends single-copy, and read peers' offers (hint `shm_cma`).
    pub(crate) cma: std::sync::atomic::AtomicBool,
    /// Which sends are offered single-copy.
    pub(crate) single_copy: crate::cma::Policy,
    /// Small collectives and barrier (`fastbox.rs`).
    pub(crate) fast: Fastbox,
    /// More ranks than cores: a waiting rank yields at once instead of
    /// spinning, since the peer it waits for may need its core.
    pub(crate) oversubscribed: bool,
    /// One core's L2 cache, in bytes (`exchange.rs` pushes messages that fit).
    pub(crate) l2: usize,
    /// Whether the peers' processes live (zombies and reused pids included).
    liveness: crate::liveness::Liveness,
    /// This backend, for the windows it makes (which outlive a call).
    me: std::sync::Weak<ShmBackend>,
}

impl ShmBackend {
    /// Wrap a mapped segment of `size` ranks with rings of `cap` bytes
    /// (zeroed by its creator); `cma`: which sends go single-copy, if any;
    /// `oversubscribed`: see `cores`; `budget`: how much of what peers send
    /// early is kept (see `weft::matching::EarlyBudget`).
    pub fn new(
        rank: usize,
        size: usize,
        seg: Segment,
        cap: usize,
        cma: Option<crate::cma::Policy>,
        oversubscribed: bool,
        budget: weft::matching::EarlyBudget,
    ) -> Self {
        let ctl = rings_at(size);
        assert!(seg.len() >= segment_len(size, cap), "segment sized by segment_len");
        let rings = (0..size * size)
            // SAFETY: ring i lies inside the segment (segment_len), is
            // 64-byte aligned (Control and footprint are multiples of 64),
            // and ring src*W+dst has one producer (src) and one consumer (dst).
            .map(|i| unsafe { Ring::at(seg.base().add(ctl + i * footprint(cap)), cap) })
            .collect();
        // SAFETY: the slots close the segment (segment_len), 64-byte aligned,
        // zeroed by the creator, used only through Fastbox.
        let fast = unsafe { Fastbox::at(seg.base().add(fastbox_at(size, cap)), rank, size) };
        let b = ShmBackend {
            rank,
            size,
            seg,
            fast,
            rings,
            engine: Mutex::new(Engine::new(size, budget)),
            posting: Arc::default(),
            failed: std::sync::OnceLock::new(),
            cma: std::sync::atomic::AtomicBool::new(cma.is_some()),
            single_copy: cma.unwrap_or(crate::cma::Policy::FAST),
            oversubscribed,
            l2: crate::cores::l2_bytes(),
            liveness: crate::liveness::Liveness::new(size),
            me: std::sync::Weak::new(),
        };
        // The rings this rank writes or reads, at once rather than a page
        // fault at a time during its first transfers (the others' rings it
        // never touches).
        for p in (0..size).filter(|&p| p != rank) {
            for i in [rank * size + p, p * size + rank] {
                b.seg.prefault(ctl + i * footprint(cap), footprint(cap));
            }
        }
        b.control(rank).pid.store(std::process::id(), Ordering::Release);
        b
    }

    /// The same backend, knowing the `Arc` it lives in (see `me`).
    pub fn knowing(self, me: std::sync::Weak<ShmBackend>) -> Self {
        ShmBackend { me, ..self }
    }

    fn control(&self, r: usize) -> &Control {
        // SAFETY: the control blocks open the segment, one per rank, and
        // are only touched through atomics.
        unsafe { &*(self.seg.base() as *const Control).add(r) }
    }

    /// Rank `r`'s process id (0 until it has mapped the segment).
    pub(crate) fn pid(&self, r: usize) -> u32 {
        self.control(r).pid.load(Ordering::Acquire)
    }

    pub(crate) fn ring(&self, src: usize, dst: usize) -> &Ring {
        &self.rings[src * self.size + dst]
    }

    pub(crate) fn cell(&self, src: usize, dst: usize) -> &Cell {
        // SAFETY: the cells follow the control blocks, one per ordered pair,
        // 64-byte aligned, touched only through atomics.
        unsafe { &*(self.seg.base().add(self.size * std::mem::size_of::<Control>()) as *const Cell).add(src * self.size + dst) }
    }

    pub(crate) fn wake(&self, r: usize) {
        let c = self.control(r);
        c.doorbell.value.fetch_add(1, Ordering::SeqCst);
        if c.sleeping.load(Ordering::SeqCst) != 0 {
            c.doorbell.wake(1);
        }
    }

    pub(crate) fn fail(&self, e: Error) -> Error {
        self.failed.get_or_init(|| e).clone()
    }

    /// Why `peer` can no longer take part, if it cannot.
    pub(crate) fn peer_problem(&self, peer: usize) -> Option<Error> {
        let c = self.control(peer);
        match c.state.load(Ordering::Acquire) {
            ABORTED => {
                // Report the root cause the aborting rank recorded, so every
                // rank blames the same peer.
                let blame = c.blame.load(Ordering::Acquire) as usize;
                return Some(match blame {
                    b if b > 0 && b - 1 != self.rank => {
                        Error::peer_lost(b - 1, format!("peer rank {} lost (reported by rank {peer})", b - 1))
                    }
                    _ => Error::peer_lost(peer, format!("peer rank {peer} aborted its group")),
                });
            }
            CLOSED => return Some(Error::peer_left(peer)),
            _ => {}
        }
        match self.pid(peer) {
            0 => None,
            pid => self.liveness.dead(peer, pid).map(|why| Error::peer_lost(peer, why)),
        }
    }

    pub(crate) fn check_failed(&self) -> Result<()> {
        match self.failed.get() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }
}

impl progress::Engine for ShmBackend {
    fn posting(&self) -> &Arc<Posting> {
        &self.posting
    }
    fn try_drive(&self, until: &dyn Fn() -> bool) -> bool {
        let Some(mut eng) = progress::try_lock(&self.engine) else { return false };
        self.drive(&mut eng, &self.posting, false, until);
        true
    }
    fn try_exchange(&self, ops: &mut [P2p<'_>], gathered: &[GatherSend<'_>], deadline: Instant) -> Option<Result<()>> {
        let mut eng = progress::try_lock(&self.engine)?;
        Some(self.exchange_now(&mut eng, &self.posting, ops, gathered, deadline))
    }
    fn abandon(&self, e: &Error) {
        let e = self.fail(e.clone());
        let mut eng = self.engine.lock().unwrap_or_else(|p| p.into_inner());
        self.fail_everything(&mut eng, &self.posting, e);
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
        // A mismatch that left the ranks' call numbers out of step (one
        // took the rings) ends this transport, as the rings side finds too.
        let fail_on_mismatch = |e: Error| if self.fast.desynced() { self.fail(e) } else { e };
        if let Op::AllToAll { inputs, outputs } = op {
            // Whether a rank's parts fit differs between ranks: every rank
            // takes the fast round, and all take the rings if one did not fit.
            return match self.check_failed().and_then(|()| self.fast_all_to_all(inputs, outputs, &ctx.deadline)) {
                Ok(true) => Some(Ok(())),
                Ok(false) => None,
                Err(e) => Some(Err(fail_on_mismatch(e))),
            };
        }
        Some(self.check_failed().and_then(|()| self.run_fast(op, &ctx.deadline)).map_err(fail_on_mismatch))
    }

    fn exchange(&self, ops: &mut [P2p<'_>], deadline: Instant) -> Result<()> {
        progress::exchange(self, ops, &[], deadline)
    }

    fn exchange_gathered(&self, ops: &mut [P2p<'_>], gathered: &[GatherSend<'_>], deadline: Instant) -> Result<()> {
        progress::exchange(self, ops, gathered, deadline)
    }

    fn posts(&self) -> bool {
        true
    }

    fn receives_from_any(&self) -> bool {
        true
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

    /// A step costs a few µs of handshakes through the segment, in which a
    /// rank copies about this much: at two ranks, sparse `split` (four
    /// steps) against recursive doubling (two) measured 5 µs apart on
    /// 100-row tensors.
    fn step_bytes(&self) -> usize {
        16 << 10
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
    /// each wake-up. Oversubscribed, yield from the start.
    fn wait_until(&self, peer: usize, what: &dyn Fn() -> String, deadline: &Deadline, ready: &dyn Fn() -> bool) -> Result<()> {
        // More ranks than cores: the peer may be waiting for this core, so
        // go straight to yielding (9x faster 8 B ops at W=4 on 2 cores).
        let pure_spins = if self.oversubscribed { 0 } else { PURE_SPINS };
        for _ in 0..pure_spins {
            if ready() {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        let start = Instant::now();
        let deadline = deadline.get();
        loop {
            if ready() {
                return Ok(());
            }
            self.check_failed()?;
            let now = Instant::now();
            if now >= deadline {
                return Err(
                    Error::timeout(format!("shm: rank {peer} did not join the {} before the deadline", what())).stalled_on(Some(peer))
                );
            }
            if now.duration_since(start) < SPIN {
                std::thread::yield_now();
                continue;
            }
            self.nap(now, deadline, ready);
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
            if self.control(p).sleeping.load(Ordering::SeqCst) != 0 {
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

impl ShmBackend {
    /// Run a fast-path op (`native_op` chose it).
    fn run_fast(&self, op: &mut Op<'_>, d: &Deadline) -> Result<()> {
        let fb = &self.fast;
        match op {
            Op::AllReduce { buf, op } => {
                let dtype = buf.dtype();
                fb.all_reduce(self, buf.host_bytes_mut()?, dtype, *op, d)
            }
            Op::Broadcast { buf, root } => fb.broadcast(self, buf.host_bytes_mut()?, *root, d),
            Op::AllGather { input, outputs } => fb.all_gather(self, input.host_bytes()?, &mut TensorMut::host_bytes_of(outputs)?, d),
            Op::ReduceScatter { inputs, output, op } => {
                let dtype = output.dtype();
                fb.reduce_scatter(self, &Tensor::host_bytes_of(inputs)?, output.host_bytes_mut()?, dtype, *op, d)
            }
            Op::Barrier => fb.barrier(self, d),
            _ => unreachable!("native_op sends only the ops above"),
        }
    }

    /// all_to_all through the fast path; `Ok(false)` if some rank's parts
    /// did not fit.
    fn fast_all_to_all(&self, inputs: &[Tensor<'_>], outputs: &mut [TensorMut<'_>], d: &Deadline) -> Result<bool> {
        self.fast.all_to_all(self, &Tensor::host_bytes_of(inputs)?, &mut TensorMut::host_bytes_of(outputs)?, d)
    }

    /// Sleep on this rank's doorbell unless `ready()`, for at most `NAP`
    /// (and not past `deadline`). Peers ring it after writing to this rank
    /// (`wake`) when they see its `sleeping` flag.
    pub(crate) fn nap(&self, now: Instant, deadline: Instant, ready: &dyn Fn() -> bool) {
        let ctl = self.control(self.rank);
        let seen = ctl.doorbell.value.load(Ordering::SeqCst);
        ctl.sleeping.store(1, Ordering::SeqCst);
        // With the writer's SeqCst store then SeqCst load of this flag
        // (`wake_sleepers`), or `wake`'s read-modify-write: either the
        // writer sees this flag, or `ready()` sees its write.
        fence(Ordering::SeqCst);
        if !ready() {
            let _ = ctl.doorbell.wait_for(seen, NAP.min(deadline.saturating_duration_since(now)));
        }
        ctl.sleeping.store(0, Ordering::SeqCst);
    }
}
