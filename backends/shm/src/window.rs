//! Windows in shared memory: each rank's registered bytes are a segment of
//! their own (a memfd, as the group's: `segment.rs`) that every rank maps.
//! A put or a get is one copy between the caller's buffer and the peer's
//! mapping; a signal is an atomic counter in the target's segment and a
//! ring of its doorbell; waiting is the group's (spin, then sleep, checking
//! the peer is alive).
//!
//! ```text
//! segment of rank t:  [ per origin o: signals o -> t, closed by o ]  (64 B each, page-rounded)
//!                     [ registered bytes ]
//! ```

use crate::fastbox::Waiter;
use crate::segment::Segment;
use crate::state::ShmBackend;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use weft::backend::Deadline;
use weft::window::{Later, RmaCall, Span, WindowSpec, WindowTransport};
use weft::{Error, Result};

/// One origin's line in a target's segment.
#[repr(C, align(64))]
struct Line {
    /// Signals this origin sent to the segment's owner.
    signals: AtomicU64,
    /// 1 once this origin deregistered the window.
    closed: AtomicU64,
}

const PAGE: usize = 4096;

/// Bytes before the registered ones in a segment of a `size`-rank group.
fn header(size: usize) -> usize {
    (size * std::mem::size_of::<Line>()).next_multiple_of(PAGE)
}

/// This rank's side of a window over shared memory.
pub(crate) struct ShmWindow {
    shm: Arc<ShmBackend>,
    rank: usize,
    /// Every rank's segment, this rank's included, mapped here.
    segs: Vec<Segment>,
    /// Signals taken from each origin by this rank's waits (held while
    /// waiting, so two waits never take one signal).
    taken: Vec<Mutex<u64>>,
}

impl ShmWindow {
    /// Create this rank's segment, publish it, and map every peer's;
    /// every rank succeeds or all fail together.
    pub(crate) fn create(shm: Arc<ShmBackend>, spec: &WindowSpec) -> Result<ShmWindow> {
        let (rank, size) = (spec.rank, spec.size);
        let store = &*spec.store;
        let left = || spec.deadline.saturating_duration_since(Instant::now());
        // (Sizes are at most `weft::window::MAX_BYTES`: no overflow.)
        let len = |r: usize| header(size) + spec.sizes[r];
        let mine = weft::auth::random_u64().and_then(|n| {
            let tag = format!("win{:x}", n);
            let seg = Segment::create(&tag, len(rank))?;
            Ok((seg, tag))
        });
        let published = match &mine {
            Ok((seg, tag)) => format!("{} {} {tag}", std::process::id(), seg.creator_fd().expect("the creator holds it")),
            Err(e) => format!("failed {e}"),
        };
        store.set(&format!("segment/{rank}"), published.as_bytes())?;
        let opened = (|| {
            let (own, _) = mine?;
            let mut segs = Vec::with_capacity(size);
            for r in 0..size {
                if r == rank {
                    segs.push(None);
                    continue;
                }
                let text = String::from_utf8_lossy(&store.get(&format!("segment/{r}"), left())?).into_owned();
                if let Some(why) = text.strip_prefix("failed ") {
                    return Err(Error::unsupported(format!("shm window: rank {r} could not create its segment: {why}")));
                }
                let bad = || Error::backend(format!("shm window: malformed segment of rank {r} in the store: {text:?}"));
                let fields: Vec<&str> = text.split(' ').collect();
                let [pid, fd, tag] = fields[..] else { return Err(bad()) };
                let (pid, fd) = (pid.parse().map_err(|_| bad())?, fd.parse().map_err(|_| bad())?);
                segs.push(Some(Segment::open(r, pid, fd, tag, len(r))?));
            }
            segs[rank] = Some(own);
            Ok(segs.into_iter().map(|s| s.expect("every rank's segment")).collect::<Vec<_>>())
        })();
        let mut segs = weft::store::all_or_none(store, "opened", rank, size, left(), opened, "shm window: mapping the segments")?;
        segs[rank].close_fd();
        Ok(ShmWindow { shm, rank, segs, taken: (0..size).map(|_| Mutex::new(0)).collect() })
    }

    /// Origin `origin`'s line in rank `target`'s segment.
    fn line(&self, target: usize, origin: usize) -> &Line {
        // SAFETY: the header opens every segment, one 64-byte line per
        // origin, touched only through atomics.
        unsafe { &*(self.segs[target].base() as *const Line).add(origin) }
    }

    /// Rank `r`'s registered bytes.
    fn data(&self, r: usize) -> *mut u8 {
        // SAFETY: the registered bytes follow the header inside the segment.
        unsafe { self.segs[r].base().add(header(self.segs.len())) }
    }

    /// `PeerLost` (or the group's failure) if `peer` can no longer take part.
    fn check(&self, peer: usize) -> Result<()> {
        self.shm.check_failed()?;
        match self.shm.peer_problem(peer) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Wait until `ready()`, as the group's waits do.
    fn wait(&self, peer: usize, what: &dyn Fn() -> String, deadline: Instant, ready: &dyn Fn() -> bool) -> Result<()> {
        self.shm.wait_until(peer, what, &Deadline::at(deadline), ready)
    }
}

/// Copy `len` bytes from `src` to `dst`: weft's copy kernel (streaming
/// stores for large copies), or a move where the two overlap (a caller's
/// buffer that is itself window memory).
///
/// # Safety
/// Both ranges are valid for `len` bytes.
unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) {
    let (d, s) = (dst as usize, src as usize);
    if d < s + len && s < d + len {
        // SAFETY: the caller's promise.
        return unsafe { std::ptr::copy(src, dst, len) };
    }
    // SAFETY: the caller's promise; the ranges do not overlap (checked).
    let (dst, src) = unsafe { (std::slice::from_raw_parts_mut(dst, len), std::slice::from_raw_parts(src, len)) };
    weft::kernels::copy(dst, src)
}

/// Puts this long check the target is alive first (a system call, which
/// short ones skip: their signal checks).
const CHECKED_PUT: usize = 64 << 10;

impl WindowTransport for ShmWindow {
    fn local(&self) -> Span {
        Span { ptr: self.data(self.rank), len: self.segs[self.rank].len() - header(self.segs.len()) }
    }

    unsafe fn put(&self, src: Span, dst: usize, offset: usize, _: &RmaCall, _: Later<'_>) -> Option<Result<()>> {
        if src.len >= CHECKED_PUT {
            if let Err(e) = self.check(dst) {
                return Some(Err(e));
            }
        }
        // SAFETY: the range lies inside `dst`'s registered bytes (checked
        // by the window); `src` is the caller's, valid for the call.
        unsafe { copy(self.data(dst).add(offset), src.ptr, src.len) };
        Some(Ok(()))
    }

    unsafe fn get(&self, dst: Span, src: usize, offset: usize, _: &RmaCall, _: Later<'_>) -> Option<Result<()>> {
        if dst.len >= CHECKED_PUT {
            if let Err(e) = self.check(src) {
                return Some(Err(e));
            }
        }
        // SAFETY: as in `put`.
        unsafe { copy(dst.ptr, self.data(src).add(offset), dst.len) };
        Some(Ok(()))
    }

    fn signal(&self, peer: usize, _: &RmaCall, _: Later<'_>) -> Option<Result<()>> {
        // (No liveness check here: a signal is a store, as cheap as the
        // put before it; waits and long puts find a dead peer.)
        if let Err(e) = self.shm.check_failed() {
            return Some(Err(e));
        }
        // Release: the puts before it are seen by whoever sees the count.
        self.line(peer, self.rank).signals.fetch_add(1, Ordering::SeqCst);
        self.shm.wake(peer);
        Some(Ok(()))
    }

    fn wait_signal(&self, peer: usize, count: u64, call: &RmaCall) -> Result<()> {
        let mut taken = self.taken[peer].lock().unwrap_or_else(|p| p.into_inner());
        let want = *taken + count;
        let line = self.line(self.rank, peer);
        // Acquire (SeqCst): the puts before the peer's signal are in place.
        let arrived = || line.signals.load(Ordering::SeqCst) >= want;
        let what = || format!("{count} signal(s) of window (at {} of {want})", line.signals.load(Ordering::SeqCst));
        self.shm.wait_until(peer, &what, &call.deadline, &|| arrived() || line.closed.load(Ordering::SeqCst) == 1)?;
        if !arrived() {
            return Err(Error::invalid(format!("rank {peer} deregistered the window before the signal waited for")));
        }
        *taken = want;
        Ok(())
    }

    fn remote(&self, rank: usize) -> Option<*mut u8> {
        Some(self.data(rank))
    }

    fn close(&self, deadline: Instant) -> Result<()> {
        let size = self.segs.len();
        for t in (0..size).filter(|&t| t != self.rank) {
            self.line(t, self.rank).closed.store(1, Ordering::SeqCst);
            self.shm.wake(t);
        }
        for o in (0..size).filter(|&o| o != self.rank) {
            let closed = &self.line(self.rank, o).closed;
            self.wait(o, &|| "deregistration of the window".to_string(), deadline, &|| closed.load(Ordering::SeqCst) == 1)?;
        }
        Ok(())
    }
}
