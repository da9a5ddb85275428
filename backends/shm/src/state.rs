//! This rank's side of the group's segment: its layout (a control block
//! per rank, a single-copy cell and a byte ring per ordered pair of ranks,
//! fast-path slots), the `ShmBackend` that holds it, and what every path
//! uses: waking a peer and sleeping on this rank's futex doorbell, the
//! transport's failure, and peers' health (found by pid while waiting).
//! The paths themselves: `fastbox.rs` (small collectives), `exchange.rs`
//! (point-to-point exchanges), `transport.rs` (the `Backend`, choosing
//! between them).

use crate::cma::Cell;
use crate::fastbox::Fastbox;
use crate::nappers::Nappers;
use crate::posted::Engine;
use crate::ring::{footprint, Ring};
use crate::segment::Segment;
use linux_futex::{Futex, Shared};
use std::sync::atomic::{compiler_fence, fence, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft::backend::progress::{DriverLock, Posting};
use weft::{Error, Result};

/// A control block's `state`: the rank runs, closed its group, or aborted it.
pub(crate) const RUNNING: u32 = 0;
pub(crate) const CLOSED: u32 = 1;
pub(crate) const ABORTED: u32 = 2;
/// Spin this long without progress before sleeping.
pub(crate) const SPIN: Duration = Duration::from_micros(30);
/// The first part of that spin, without yielding the core.
pub(crate) const PAUSE_SPIN: Duration = Duration::from_micros(5);
/// The fast path's first checks, without reading the clock or yielding.
pub(crate) const PURE_SPINS: usize = 1000;
/// A waiting rank reads the clock (for its deadline and when to yield or
/// sleep) once per this many turns of its wait loop, not every turn: a
/// turn is a few tens of ns spinning and a microsecond or more yielding to
/// another rank, and right after a yield a clock read measured a sixth of
/// a waiting rank's own time (W=4 on 2 cores), so the timings stay fine
/// enough either way.
pub(crate) const TURNS_PER_CLOCK: u32 = 8;
/// Spin this long while a peer reads a single-copy offer.
pub(crate) const CMA_SPIN: Duration = Duration::from_millis(2);
/// Sleep at most this long before re-checking peers' liveness.
pub(crate) const NAP: Duration = Duration::from_millis(20);
/// A nap's bound when a notice may have been missed (see `nap`).
const SHORT_NAP: Duration = Duration::from_micros(200);

/// Per-rank control block in the segment.
#[repr(C, align(64))]
pub struct Control {
    pub(crate) pid: AtomicU32,
    pub(crate) state: AtomicU32,
    pub(crate) doorbell: Futex<Shared>,
    pub(crate) sleeping: Nappers,
    /// After an abort: 1 + the rank this rank blames (0: itself).
    pub(crate) blame: AtomicU32,
    /// 1 if this rank's sends and receives notify without a fence
    /// (`notify`): a rank that cannot ask for the barrier then naps only
    /// briefly.
    pub(crate) fence_free: AtomicU32,
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
/// single-copy cells, rings, fast-path slots, the table of large messages'
/// schemes.
pub fn segment_len(w: usize, cap: usize) -> usize {
    schemes_at(w, cap) + crate::cma::scheme::TABLE_BYTES
}

fn schemes_at(w: usize, cap: usize) -> usize {
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
    pub(crate) seg: Segment,
    rings: Vec<Ring>,
    /// Inbound state and posted ops; whoever holds it drives them all.
    pub(crate) engine: DriverLock<Engine>,
    /// Batches waiting for the driver.
    pub(crate) posting: Arc<Posting>,
    /// The first failure: the rings are out of step for good after it.
    pub(crate) failed: std::sync::OnceLock<Error>,
    /// Offer large sends single-copy, and read peers' offers (hint `shm_cma`).
    pub(crate) cma: std::sync::atomic::AtomicBool,
    /// Which sends are offered single-copy (today's rule, see `cma`).
    pub(crate) single_copy: crate::cma::Policy,
    /// Choose each large message's scheme by what the schemes cost now
    /// (`cma/scheme.rs`), over the rule; off where the hint `shm_cma` or
    /// `shm_adapt=off` says so.
    pub(crate) adapt: bool,
    /// Small collectives and barrier (`fastbox.rs`).
    pub(crate) fast: Fastbox,
    /// More ranks than cores: a waiting rank yields at once instead of
    /// spinning, since the peer it waits for may need its core.
    pub(crate) oversubscribed: bool,
    /// What it offers core (`capabilities`): posting, any-source
    /// receives, its step and ring sizes, and ranks bound to the same CPUs
    /// next to each other.
    pub(crate) caps: weft::backend::Capabilities,
    /// This process passes the barrier a napping rank asks for
    /// (`membarrier.rs`): its sends tell their peers without a fence.
    fence_free: bool,
    /// One core's L2 cache, in bytes (`cma/offers.rs` pushes messages that fit).
    pub(crate) l2: usize,
    /// Whether the peers' processes live (zombies and reused pids included).
    pub(crate) liveness: crate::liveness::Liveness,
    /// This backend, for the windows it makes (which outlive a call).
    pub(crate) me: std::sync::Weak<ShmBackend>,
}

/// What shm offers core, given one of its rings (all have one size) and
/// its rank order.
fn capabilities(ring: &Ring, order: Vec<usize>) -> weft::backend::Capabilities {
    weft::backend::Capabilities {
        posts: true,
        receives_from_any: true,
        // Small collectives through the fastbox (`fastbox.rs`).
        fast_ops: true,
        posts_device: false,
        // A step costs a few µs of handshakes through the segment, in
        // which a rank copies about this much (bench/RESULTS.md, "shm
        // design": sparse `split` against recursive doubling).
        step_bytes: 16 << 10,
        // One ring: 256 KiB at W=8, so a chain broadcast's segments shrink
        // to 64 KiB there (see `weft::algorithms::select::segment_for`).
        buffered_bytes: Some(ring.capacity()),
        // By the CPUs the ranks are bound to (`cores::placement`).
        rank_order: Some(order),
        native_algorithms: &[],
    }
}

impl ShmBackend {
    /// Wrap a mapped segment of `size` ranks with rings of `cap` bytes
    /// (zeroed by its creator); `cma`: which sends go single-copy, if any;
    /// `adapt`: choose large messages' schemes as the run goes (see
    /// `cma/scheme.rs`); `placement`: see `cores`; `budget`: how much of
    /// what peers send early is kept (see
    /// `weft::backend::matching::EarlyBudget`).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rank: usize,
        size: usize,
        seg: Segment,
        cap: usize,
        cma: Option<crate::cma::Policy>,
        adapt: bool,
        placement: crate::cores::Placement,
        budget: weft::backend::matching::EarlyBudget,
    ) -> Self {
        let ctl = rings_at(size);
        assert!(seg.len() >= segment_len(size, cap), "segment sized by segment_len");
        let rings: Vec<Ring> = (0..size * size)
            // SAFETY: ring i lies inside the segment (segment_len), is
            // 64-byte aligned (Control and footprint are multiples of 64),
            // and ring src*W+dst has one producer (src) and one consumer (dst).
            .map(|i| unsafe { Ring::at(seg.base().add(ctl + i * footprint(cap)), cap) })
            .collect();
        // SAFETY: the slots close the segment (segment_len), 64-byte aligned,
        // zeroed by the creator, used only through Fastbox.
        let fast = unsafe { Fastbox::at(seg.base().add(fastbox_at(size, cap)), rank, size) };
        let caps = capabilities(&rings[rank * size + (rank + 1) % size], placement.order);
        let b = ShmBackend {
            rank,
            size,
            seg,
            fast,
            rings,
            engine: DriverLock::new(Engine::new(rank, size, budget)),
            posting: Arc::default(),
            failed: std::sync::OnceLock::new(),
            cma: std::sync::atomic::AtomicBool::new(cma.is_some()),
            single_copy: cma.unwrap_or(crate::cma::Policy::FAST),
            adapt: adapt && cma.is_some(),
            oversubscribed: placement.oversubscribed,
            caps,
            fence_free: crate::membarrier::register(),
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
        b.control(rank).fence_free.store(b.fence_free as u32, Ordering::Release);
        b.control(rank).pid.store(std::process::id(), Ordering::Release);
        b
    }

    /// The same backend, knowing the `Arc` it lives in (see `me`).
    pub fn knowing(self, me: std::sync::Weak<ShmBackend>) -> Self {
        ShmBackend { me, ..self }
    }

    pub(crate) fn control(&self, r: usize) -> &Control {
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

    /// The group's table of schemes (`cma/scheme.rs`).
    pub(crate) fn schemes(&self) -> crate::cma::scheme::Table<'_> {
        let at = schemes_at(self.size, self.rings[0].capacity());
        // SAFETY: the table closes the segment (segment_len), 64-byte
        // aligned, zeroed by the creator, touched only through atomics.
        let words =
            unsafe { std::slice::from_raw_parts(self.seg.base().add(at) as *const std::sync::atomic::AtomicU64, crate::cma::scheme::KEYS) };
        crate::cma::scheme::Table(words)
    }

    pub(crate) fn cell(&self, src: usize, dst: usize) -> &Cell {
        // SAFETY: the cells follow the control blocks, one per ordered pair,
        // 64-byte aligned, touched only through atomics.
        unsafe { &*(self.seg.base().add(self.size * std::mem::size_of::<Control>()) as *const Cell).add(src * self.size + dst) }
    }

    /// Tell rank `r` that its ring from this rank has more bytes, or that
    /// its ring to this rank has more room: `wake` it if it naps.
    /// Registered for asymmetric barriers, this rank only reads its flag,
    /// with no fence and no write to its line: a napping rank passes every
    /// registered process through a barrier before it looks at its rings
    /// (`nap`), so either that look finds these bytes (or this room) or
    /// this read finds the flag. (Such a notice does not count on the
    /// doorbell: it serves only what the drive loop's last look covers,
    /// incoming bytes and room in a ring its sends had filled.)
    pub(crate) fn notify(&self, r: usize) {
        // (No instruction: only the compiler may not read the flag before
        // the ring's stores above, which the barrier pattern needs.)
        compiler_fence(Ordering::SeqCst);
        if self.fence_free && !self.control(r).sleeping.armed(Ordering::Relaxed) {
            return;
        }
        self.wake(r);
    }

    /// Ring rank `r`'s doorbell, and wake it if it naps. The waker that
    /// finds it armed disarms it and wakes every thread napping there, so
    /// of the ranks (or the many sends) that ring one napping rank before
    /// it runs again, one makes the system call: the rest would find
    /// nobody on the futex (see `nappers`). Every wake counts, napping or
    /// not: a rank that read its doorbell before its last look (the drive
    /// loop) must find it changed.
    pub(crate) fn wake(&self, r: usize) {
        let c = self.control(r);
        c.doorbell.value.fetch_add(1, Ordering::SeqCst);
        if c.sleeping.disarm() {
            c.doorbell.wake(i32::MAX);
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

    #[inline]
    pub(crate) fn check_failed(&self) -> Result<()> {
        match self.failed.get() {
            Some(e) => Err(failed_again(e)),
            None => Ok(()),
        }
    }
    /// This rank's doorbell as it stands: a [`Self::nap`] from this value
    /// returns at once if a peer rang it since.
    pub(crate) fn doorbell(&self) -> u32 {
        self.control(self.rank).doorbell.value.load(Ordering::SeqCst)
    }

    /// Sleep on this rank's doorbell unless `ready()`, for at most `NAP`
    /// (and not past `deadline`), and not at all if it was rung since it
    /// read `seen` ([`Self::doorbell`]). Peers ring it after writing to
    /// this rank (`wake`), and the first to find it armed wakes every
    /// thread napping there.
    pub(crate) fn nap(&self, seen: u32, now: Instant, deadline: Instant, ready: &dyn Fn() -> bool) {
        let ctl = self.control(self.rank);
        ctl.sleeping.enter();
        // With the writer's SeqCst store then SeqCst load of this word
        // (`wake_sleepers`), or `wake`'s read-modify-write: either the
        // writer sees it armed, or `ready()` sees its write.
        fence(Ordering::SeqCst);
        // And a barrier on every registered rank's processor, for those
        // that `notify` without one. Where the call fails and some peer
        // relies on it, nap briefly.
        let relied_on = || (0..self.size).any(|p| p != self.rank && self.control(p).fence_free.load(Ordering::Acquire) != 0);
        let nap = if crate::membarrier::global() || !relied_on() { NAP } else { SHORT_NAP };
        if !ready() {
            let _ = ctl.doorbell.wait_for(seen, nap.min(deadline.saturating_duration_since(now)));
        }
        ctl.sleeping.leave();
    }
}

/// The error a failed transport gives every later op (out of line: an op's
/// path checks for it every time and almost never finds one).
#[cold]
fn failed_again(e: &Error) -> Error {
    e.clone()
}
