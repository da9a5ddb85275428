//! The shm backend: one byte ring per ordered pair of ranks inside the
//! group's segment. Progress is driven by the calling thread: an exchange
//! moves its sends and drains every incoming ring in one loop (so two ranks
//! sending to each other never block), spins briefly when nothing moves,
//! then sleeps on its futex doorbell, which peers ring after writing to it
//! or reading from it. Dead peers are found by pid while waiting.

use crate::cma::{self, Cell};
use crate::fastbox::{Fastbox, Waiter, FASTBOX_BYTES};
use crate::ring::{footprint, Ring};
use crate::segment::Segment;
use linux_futex::{Futex, Shared};
use smallvec::{smallvec, SmallVec};
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use weft::backend::{Backend, Deadline, Op, OpContext, P2p};
use weft::matching::Inbound;
use weft::{Error, Result, Tensor, TensorMut};

const RUNNING: u32 = 0;
const CLOSED: u32 = 1;
const ABORTED: u32 = 2;
/// Frame header: tag and length.
const HEADER: usize = 16;
/// Set in a header's length: a single-copy descriptor follows (see `cma`).
const CMA_FLAG: u64 = 1 << 63;
/// Spin this long without progress before sleeping.
const SPIN: Duration = Duration::from_micros(30);
/// The first part of that spin, without yielding the core.
const PAUSE_SPIN: Duration = Duration::from_micros(5);
/// The fast path's first checks, without reading the clock or yielding.
const PURE_SPINS: usize = 1000;
/// Spin this long while a peer reads a single-copy offer.
const CMA_SPIN: Duration = Duration::from_millis(2);
/// Sleep at most this long before re-checking peers' liveness.
const NAP: Duration = Duration::from_millis(20);

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

/// One peer's state, kept across exchanges: what is arriving from it, and
/// the single-copy state of what this rank sends it.
#[derive(Default)]
struct PeerIn {
    hdr: [u8; HEADER + cma::DESCRIPTOR],
    hdr_got: usize,
    inbound: Inbound,
    /// A single-copy frame whose payload is still to be read.
    cma_in: Option<cma::Offer>,
    /// Sequence of the last single-copy send to this peer.
    out_seq: u64,
    /// The peer cannot read this rank's memory: send inline.
    refused: bool,
    /// This rank cannot write the peer's memory: leave every chunk to it.
    no_push: bool,
}

pub struct ShmBackend {
    rank: usize,
    size: usize,
    seg: Segment,
    rings: Vec<Ring>,
    incoming: Mutex<Vec<PeerIn>>,
    /// The first failure: the rings are out of step for good after it.
    failed: std::sync::OnceLock<Error>,
    /// Offer large sends single-copy, and read peers' offers (hint `shm_cma`).
    cma: std::sync::atomic::AtomicBool,
    /// Small collectives and barrier (`fastbox.rs`).
    fast: Fastbox,
    /// More ranks than cores: a waiting rank yields at once instead of
    /// spinning, since the peer it waits for may need its core.
    oversubscribed: bool,
}

impl ShmBackend {
    /// Wrap a mapped segment of `size` ranks with rings of `cap` bytes
    /// (zeroed by its creator); `oversubscribed`: see `cores`.
    pub fn new(rank: usize, size: usize, seg: Segment, cap: usize, cma: bool, oversubscribed: bool) -> Self {
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
            incoming: Mutex::new((0..size).map(|_| PeerIn::default()).collect()),
            failed: std::sync::OnceLock::new(),
            cma: std::sync::atomic::AtomicBool::new(cma),
            oversubscribed,
        };
        b.control(rank).pid.store(std::process::id(), Ordering::Release);
        b
    }

    fn control(&self, r: usize) -> &Control {
        // SAFETY: the control blocks open the segment, one per rank, and
        // are only touched through atomics.
        unsafe { &*(self.seg.base() as *const Control).add(r) }
    }

    fn ring(&self, src: usize, dst: usize) -> &Ring {
        &self.rings[src * self.size + dst]
    }

    fn cell(&self, src: usize, dst: usize) -> &Cell {
        // SAFETY: the cells follow the control blocks, one per ordered pair,
        // 64-byte aligned, touched only through atomics.
        unsafe { &*(self.seg.base().add(self.size * std::mem::size_of::<Control>()) as *const Cell).add(src * self.size + dst) }
    }

    fn wake(&self, r: usize) {
        let c = self.control(r);
        c.doorbell.value.fetch_add(1, Ordering::SeqCst);
        if c.sleeping.load(Ordering::SeqCst) != 0 {
            c.doorbell.wake(1);
        }
    }

    fn fail(&self, e: Error) -> Error {
        self.failed.get_or_init(|| e).clone()
    }

    /// Why `peer` can no longer take part, if it cannot.
    fn peer_problem(&self, peer: usize) -> Option<Error> {
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
            CLOSED => return Some(Error::peer_lost(peer, format!("peer rank {peer} left the group (its process group was closed)"))),
            _ => {}
        }
        let pid = c.pid.load(Ordering::Acquire);
        if pid != 0 && nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), None) == Err(nix::errno::Errno::ESRCH) {
            return Some(Error::peer_lost(peer, format!("peer rank {peer} (pid {pid}) died")));
        }
        None
    }

    fn check_failed(&self) -> Result<()> {
        match self.failed.get() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }
}

impl Backend for ShmBackend {
    fn name(&self) -> &str {
        "shm"
    }

    /// all_reduce, broadcast, all_gather and reduce_scatter of at most
    /// `FASTBOX_BYTES` (all ranks' parts together), barrier, and
    /// all_to_all where every rank's parts fit, through the fast path (hint
    /// `shm_fastbox=off`: through the rings).
    fn native_op(&self, op: &mut Op<'_>, ctx: &OpContext) -> Option<Result<()>> {
        // (`is_empty` first: no hashing on the common path.)
        match (!ctx.hints.is_empty()).then(|| ctx.hints.get("shm_fastbox")).flatten().map(String::as_str) {
            None | Some("on") => {}
            Some("off") => return None,
            Some(v) => return Some(Err(Error::invalid(format!("hint shm_fastbox={v:?}: use on or off")))),
        }
        if let Op::AllToAll { inputs, outputs } = op {
            // Whether a rank's parts fit differs between ranks: every rank
            // takes the fast round, and all take the rings if one did not fit.
            return match self.check_failed().and_then(|()| self.fast_all_to_all(inputs, outputs, &ctx.deadline)) {
                Ok(true) => Some(Ok(())),
                Ok(false) => None,
                Err(e) => Some(Err(e)),
            };
        }
        let small = |n: usize| n <= FASTBOX_BYTES;
        let fast = match op {
            Op::AllReduce { buf, .. } | Op::Broadcast { buf, .. } => small(buf.nbytes()),
            Op::Barrier => true,
            Op::AllGather { outputs, .. } => small(outputs.iter().map(|o| o.nbytes()).sum()),
            Op::ReduceScatter { inputs, .. } => small(inputs.iter().map(|i| i.nbytes()).sum()),
            _ => false,
        };
        if !fast {
            return None;
        }
        Some(self.check_failed().and_then(|()| self.run_fast(op, &ctx.deadline)))
    }

    fn exchange(&self, ops: &mut [P2p<'_>], deadline: Instant) -> Result<()> {
        self.check_failed()?;
        for op in ops.iter() {
            if op.peer() >= self.size || op.peer() == self.rank {
                return Err(Error::invalid(format!("shm: bad peer rank {}", op.peer())));
            }
        }
        let mut incoming = self.incoming.lock().unwrap_or_else(|p| p.into_inner());
        let n = ops.len();
        // Inline for the usual few ops: no allocation per exchange.
        let mut done: SmallVec<[bool; 8]> = smallvec![false; n];
        let mut sent: SmallVec<[usize; 8]> = smallvec![0; n];
        // Per send: the single-copy sequence, if it went that way.
        let mut offers: SmallVec<[Option<cma::Offer>; 8]> = smallvec![None; n];
        // Receives first served by messages that arrived earlier.
        for (i, op) in ops.iter_mut().enumerate() {
            if let P2p::Recv { peer, tag, buf } = op {
                done[i] = incoming[*peer].inbound.serve_early(self.rank, *peer, *tag, buf).map_err(|e| self.fail(e))?;
            }
        }
        let result = self.progress(ops, &mut incoming, &mut done, &mut sent, &mut offers, deadline);
        if let Err(e) = &result {
            for p in incoming.iter_mut() {
                p.inbound.detach(ops);
            }
            // Offers still open are withdrawn before the caller gets its
            // buffers back; the pair's stream is then out of step for good.
            let open: Vec<(usize, u64)> = (0..n).filter(|i| !done[*i]).filter_map(|i| offers[i].map(|o| (ops[i].peer(), o.seq))).collect();
            if !open.is_empty() {
                // Abort first, so a peer that finds the offer withdrawn also
                // finds why (and whom to blame) in our control block.
                self.abort(e);
                for (peer, seq) in open {
                    self.revoke(peer, seq);
                }
                return Err(self.fail(e.clone()));
            }
        }
        result
    }

    fn abort(&self, reason: &Error) {
        self.fail(reason.clone());
        let me = self.control(self.rank);
        if let weft::ErrorKind::PeerLost { rank } = reason.kind() {
            me.blame.store(*rank as u32 + 1, Ordering::Release);
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
                return Err(Error::timeout(format!("shm: rank {peer} did not join the {} before the deadline", what())));
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

/// The bytes of a fast op's tensors (no heap allocation for up to 8).
fn host_bytes<'t>(ts: &'t [Tensor<'_>]) -> Result<SmallVec<[&'t [u8]; 8]>> {
    ts.iter().map(|t| t.host_bytes()).collect()
}

/// As [`host_bytes`], writable.
fn host_bytes_mut<'t>(ts: &'t mut [TensorMut<'_>]) -> Result<SmallVec<[&'t mut [u8]; 8]>> {
    ts.iter_mut().map(|t| t.host_bytes_mut()).collect()
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
            Op::AllGather { input, outputs } => fb.all_gather(self, input.host_bytes()?, &mut host_bytes_mut(outputs)?, d),
            Op::ReduceScatter { inputs, output, op } => {
                let dtype = output.dtype();
                fb.reduce_scatter(self, &host_bytes(inputs)?, output.host_bytes_mut()?, dtype, *op, d)
            }
            Op::Barrier => fb.barrier(self, d),
            _ => unreachable!("native_op sends only the ops above"),
        }
    }

    /// all_to_all through the fast path; `Ok(false)` if some rank's parts
    /// did not fit.
    fn fast_all_to_all(&self, inputs: &[Tensor<'_>], outputs: &mut [TensorMut<'_>], d: &Deadline) -> Result<bool> {
        self.fast.all_to_all(self, &host_bytes(inputs)?, &mut host_bytes_mut(outputs)?, d)
    }

    /// Withdraw single-copy offer `seq` to `peer`; if the peer is reading
    /// it right now, wait (one system call) until it is done.
    fn revoke(&self, peer: usize, seq: u64) {
        let cell = self.cell(self.rank, peer);
        if cell.advance(seq, cma::REVOKED) == Err(Some(cma::READING)) {
            let until = Instant::now() + Duration::from_secs(10);
            while cell.phase(seq) == Some(cma::READING) && Instant::now() < until && self.peer_problem(peer).is_none() {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    /// The frame prefix of send `i`: header, plus the descriptor when it
    /// goes single-copy. The offer is decided at its first byte and kept, so
    /// a prefix written in several pieces is the same in each.
    #[allow(clippy::too_many_arguments)]
    fn prefix(
        &self,
        to: usize,
        tag: u64,
        data: &[u8],
        peer: &mut PeerIn,
        offer: &mut Option<cma::Offer>,
        first: bool,
        sender_busy: bool,
    ) -> ([u8; HEADER + cma::DESCRIPTOR], usize) {
        let mut p = [0u8; HEADER + cma::DESCRIPTOR];
        p[..8].copy_from_slice(&tag.to_le_bytes());
        // Until a byte is in the ring (a full ring takes none), the offer is
        // decided afresh.
        if first {
            *offer = None;
            if data.len() >= cma::MIN_BYTES && !peer.refused && self.cma.load(Ordering::Relaxed) {
                peer.out_seq += 1;
                *offer = Some(cma::Offer { addr: data.as_ptr() as u64, seq: peer.out_seq, sender_busy });
                // Posted before the descriptor can be seen.
                self.cell(self.rank, to).post(peer.out_seq);
            }
        }
        match offer {
            Some(o) => {
                p[8..16].copy_from_slice(&(data.len() as u64 | CMA_FLAG).to_le_bytes());
                p[16..].copy_from_slice(&o.encode());
                (p, HEADER + cma::DESCRIPTOR)
            }
            None => {
                p[8..16].copy_from_slice(&(data.len() as u64).to_le_bytes());
                (p, HEADER)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn progress(
        &self,
        ops: &mut [P2p<'_>],
        incoming: &mut [PeerIn],
        done: &mut [bool],
        sent: &mut [usize],
        offers: &mut [Option<cma::Offer>],
        deadline: Instant,
    ) -> Result<()> {
        let (me, w) = (self.rank, self.size);
        let mut idle_since = Instant::now();
        let mut last_check = Instant::now();
        let mut busy: SmallVec<[bool; 16]> = smallvec![false; w];
        loop {
            let mut moved = false;
            // Sends: the first unfinished send to each peer streams into its ring.
            busy.fill(false);
            // Help copy single-copy sends only with nothing left to receive:
            // while receiving, this core is busy pulling already.
            let nothing_to_receive = ops.iter().zip(done.iter()).all(|(op, d)| *d || matches!(op, P2p::Send { .. }));
            for i in 0..ops.len() {
                let P2p::Send { peer, tag, data } = &ops[i] else { continue };
                if done[i] || busy[*peer] {
                    continue;
                }
                busy[*peer] = true;
                let ring = self.ring(me, *peer);
                // An offer made while a large receive is pending says so: this
                // core will be pulling, not helping (all_gather, all_to_all).
                let first = sent[i] == 0;
                let sender_busy = first
                    && ops.iter().zip(done.iter()).any(|(op, d)| !*d && matches!(op, P2p::Recv { buf, .. } if buf.len() >= cma::MIN_BYTES));
                let (prefix, plen) = self.prefix(*peer, *tag, data, &mut incoming[*peer], &mut offers[i], first, sender_busy);
                let before = sent[i];
                if sent[i] < plen {
                    sent[i] += ring.write(&prefix[sent[i]..plen]);
                }
                let mut inline = offers[i].is_none();
                if let (Some(cma::Offer { seq, .. }), true) = (offers[i], sent[i] == plen) {
                    // Offered: done when the peer has read it, inline if it cannot.
                    match self.cell(me, *peer).phase(seq) {
                        Some(cma::DONE) => {
                            done[i] = true;
                            busy[*peer] = false;
                            moved = true;
                            continue;
                        }
                        Some(cma::REFUSED) => {
                            incoming[*peer].refused = true;
                            inline = true;
                        }
                        Some(cma::READING) if nothing_to_receive && self.push_chunk(*peer, seq, data, &mut incoming[*peer]) => moved = true,
                        _ => {}
                    }
                }
                if inline && sent[i] >= plen {
                    sent[i] += ring.write(&data[sent[i] - plen..]);
                }
                if sent[i] != before {
                    moved = true;
                    self.wake(*peer);
                }
                if inline && sent[i] == plen + data.len() {
                    done[i] = true;
                    busy[*peer] = false;
                }
            }
            // Receives: drain every incoming ring, matching or stashing frames.
            for peer in (0..w).filter(|p| *p != me) {
                if self.drain(peer, ops, incoming, done)? {
                    moved = true;
                    self.wake(peer);
                }
            }
            if done.iter().all(|d| *d) {
                return Ok(());
            }
            let now = Instant::now();
            if moved {
                idle_since = now;
                continue;
            }
            // Nothing moved: check why, then spin or sleep.
            self.check_failed()?;
            if now.duration_since(last_check) >= NAP || now >= deadline {
                last_check = now;
                for i in (0..ops.len()).filter(|i| !done[*i]) {
                    let peer = ops[i].peer();
                    let drained = matches!(ops[i], P2p::Send { .. }) || self.ring(peer, me).available() == 0;
                    if let (true, Some(e)) = (drained, self.peer_problem(peer)) {
                        return Err(self.fail(e));
                    }
                }
            }
            if now >= deadline {
                let pending: Vec<String> = (0..ops.len())
                    .filter(|i| !done[*i])
                    .map(|i| {
                        format!(
                            "{} peer rank {}",
                            if matches!(ops[i], P2p::Send { .. }) { "send to" } else { "receive from" },
                            ops[i].peer()
                        )
                    })
                    .collect();
                let e = Error::timeout(format!("shm: {} not finished before the deadline", pending.join(", ")));
                let half_sent = |i: usize| matches!(&ops[i], P2p::Send { data, .. } if sent[i] > 0 && sent[i] < HEADER + data.len());
                if (0..ops.len()).any(|i| !done[i] && offers[i].is_none() && half_sent(i)) {
                    // Half a frame sits in a ring: the stream cannot be trusted again.
                    return Err(self.fail(e));
                }
                return Err(e);
            }
            // A peer copying our offered buffer finishes in about a
            // millisecond per 16 MiB: keep spinning for it rather than pay a
            // wake-up (~50 us) at the end of every large send.
            let reading = (0..ops.len()).any(|i| !done[i] && offers[i].is_some());
            let idle = now.duration_since(idle_since);
            if idle < PAUSE_SPIN && !self.oversubscribed {
                // The peer is most likely running on another core and about
                // to answer: a system call here would only add latency.
                std::hint::spin_loop();
                continue;
            }
            if idle < if reading { CMA_SPIN } else { SPIN } {
                std::thread::yield_now();
                continue;
            }
            self.nap(now, deadline, &|| (0..w).any(|p| p != me && self.ring(p, me).available() > 0));
        }
    }

    /// Sleep on this rank's doorbell unless `ready()`, for at most `NAP`
    /// (and not past `deadline`). Peers ring it after writing to this rank
    /// (`wake`) when they see its `sleeping` flag.
    fn nap(&self, now: Instant, deadline: Instant, ready: &dyn Fn() -> bool) {
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

    /// Take single-copy offer `seq` from `peer` into the current frame's
    /// destination, or refuse it (the payload then follows inline).
    fn read_offer(&self, peer: usize, offer: cma::Offer, st: &mut PeerIn, ops: &mut [P2p<'_>]) -> Result<()> {
        let (addr, seq) = (offer.addr, offer.seq);
        let cell = self.cell(peer, self.rank);
        // A withdrawn offer means the sender failed and aborted: report its cause.
        let withdrawn = || {
            let why = self.peer_problem(peer);
            self.fail(why.unwrap_or_else(|| Error::backend(format!("shm: peer rank {peer} withdrew a message before this rank read it"))))
        };
        if !self.cma.load(Ordering::Relaxed) {
            if cell.advance(seq, cma::REFUSED).is_err() {
                return Err(withdrawn());
            }
            self.wake(peer);
            return Ok(());
        }
        let dst = st.inbound.payload(ops);
        let chunks = cma::Chunks::of(dst.len());
        cell.open_chunks(seq, dst.as_mut_ptr() as u64);
        if cell.advance(seq, cma::READING).is_err() {
            return Err(withdrawn());
        }
        let pid = self.control(peer).pid.load(Ordering::Acquire);
        let n = dst.len();
        let mut pull = |run: std::ops::Range<u64>| {
            let range = chunks.range(run);
            cma::read(pid, addr + range.start as u64, &mut dst[range])
        };
        let mut r = Ok(());
        let mut mine = 0;
        // A sender busy receiving will not help: take everything in one
        // call. Otherwise, after the first chunk, a sender that has claimed
        // none is busy after all: take the rest in one call.
        while let Some(run) = cell.claim(seq, chunks.count(), (mine > 0 || offer.sender_busy).then_some(mine)) {
            mine += run.end - run.start;
            r = pull(run);
            if r.is_err() {
                break;
            }
        }
        // The sender may be writing the chunks it claimed into `dst`: no
        // more claims, and wait until those are in before going on.
        let theirs = cell.close(seq, chunks.count()) - mine;
        let start = Instant::now();
        while cell.pushed_count(seq) < theirs {
            // A chunk is one system call: only a dead or stopped peer takes long.
            if start.elapsed() > Duration::from_millis(1) {
                if let Some(e) = self.peer_problem(peer) {
                    return Err(self.fail(e));
                }
                if start.elapsed() > Duration::from_secs(10) {
                    // It may still write there later: this stream is done for.
                    return Err(self.fail(Error::backend(format!("shm: peer rank {peer} never finished copying into this rank"))));
                }
            }
            std::thread::yield_now();
        }
        if let (Ok(()), Some(i)) = (&r, cell.failed_chunk(seq)) {
            r = pull(i..i + 1);
        }
        match r {
            Ok(()) => {
                st.inbound.advance(n);
                cell.done(seq);
            }
            Err(cma::CopyError::Forbidden(e)) => {
                // Not allowed here (a container, a ptrace policy): refuse this
                // and every later offer; the sender streams inline instead.
                weft::log::debug(format_args!("shm: reading rank {peer}'s memory is not allowed ({e}); using the ring"));
                self.cma.store(false, Ordering::Relaxed);
                cell.advance_from_reading(seq, cma::REFUSED);
            }
            Err(cma::CopyError::Failed(e)) => {
                cell.advance_from_reading(seq, cma::REFUSED);
                self.wake(peer);
                // ESRCH: the sender died mid-read (its memory is gone, even
                // while it is still a zombie that kill(pid, 0) finds).
                let why = match (e, self.peer_problem(peer)) {
                    (_, Some(problem)) => problem,
                    (nix::errno::Errno::ESRCH, None) => Error::peer_lost(peer, format!("peer rank {peer} (pid {pid}) died")),
                    (e, None) => Error::backend(format!("shm: reading rank {peer}'s message failed: {e}")),
                };
                return Err(self.fail(why));
            }
        }
        self.wake(peer);
        Ok(())
    }

    /// Sender of offer `seq` to `to`, while the receiver reads it: copy one
    /// chunk into the receiver's destination, if one is left; true if so.
    fn push_chunk(&self, to: usize, seq: u64, data: &[u8], st: &mut PeerIn) -> bool {
        if st.no_push {
            return false;
        }
        let cell = self.cell(self.rank, to);
        let chunks = cma::Chunks::of(data.len());
        let Some(run) = cell.claim(seq, chunks.count(), None) else { return false };
        let (i, range) = (run.start, chunks.range(run));
        let pid = self.control(to).pid.load(Ordering::Acquire);
        // The receiver published `dst` before READING (which we saw) and
        // keeps it until it has counted this chunk as pushed.
        let ok = match cma::write(pid, cell.dst() + range.start as u64, &data[range]) {
            Ok(()) => true,
            // Whatever went wrong, the receiver copies this chunk itself;
            // this rank stops offering help to that peer.
            Err(cma::CopyError::Failed(e) | cma::CopyError::Forbidden(e)) => {
                weft::log::debug(format_args!("shm: writing into rank {to}'s memory failed ({e}); it copies alone"));
                st.no_push = true;
                false
            }
        };
        cell.pushed(seq, i, ok);
        true
    }

    /// Read what `peer` has written to us; true if any byte moved.
    fn drain(&self, peer: usize, ops: &mut [P2p<'_>], incoming: &mut [PeerIn], done: &mut [bool]) -> Result<bool> {
        let ring = self.ring(peer, self.rank);
        let st = &mut incoming[peer];
        let mut moved = false;
        loop {
            if !st.inbound.in_frame() {
                let raw_len = |h: &[u8]| u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
                let need = if st.hdr_got >= HEADER && raw_len(&st.hdr) & CMA_FLAG != 0 { HEADER + cma::DESCRIPTOR } else { HEADER };
                let n = ring.read(&mut st.hdr[st.hdr_got..need]);
                if n == 0 {
                    return Ok(moved);
                }
                moved = true;
                st.hdr_got += n;
                if st.hdr_got < HEADER || (st.hdr_got == HEADER && raw_len(&st.hdr) & CMA_FLAG != 0) || st.hdr_got < need {
                    continue;
                }
                st.hdr_got = 0;
                let tag = u64::from_le_bytes(st.hdr[..8].try_into().expect("8 bytes"));
                let len = raw_len(&st.hdr);
                if len & CMA_FLAG != 0 {
                    st.cma_in = Some(cma::Offer::decode(&st.hdr[HEADER..]));
                }
                st.inbound.begin(self.rank, peer, tag, (len & !CMA_FLAG) as usize, ops, done).map_err(|e| self.fail(e))?;
            }
            if let Some(offer) = st.cma_in.take() {
                self.read_offer(peer, offer, st, ops)?;
                moved = true;
            }
            let dst = st.inbound.payload(ops);
            if !dst.is_empty() {
                let n = ring.read(dst);
                if n == 0 {
                    return Ok(moved);
                }
                st.inbound.advance(n);
                moved = true;
            }
            st.inbound.finish(self.rank, peer, ops, done).map_err(|e| self.fail(e))?;
        }
    }
}
