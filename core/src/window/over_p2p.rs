//! Windows over a backend's posted point-to-point messages: what cpu-tcp
//! and hierarchical give, and any backend that posts.
//!
//! The target keeps one receive posted per peer for its next frame
//! ([`super::frame`]). Whichever thread drives the transport completes it
//! — the group's progress thread for the transport, which keeps driving
//! while a window is open (so a target busy computing still takes puts),
//! or a thread waiting in any op —, and the completion acts on the frame:
//! an inline put is copied into place, a long put's bytes are received
//! straight into the checked range, a signal is counted, a get is
//! answered. Only then is the next receive for that peer posted, so one
//! origin's frames act in issue order and a signal counts after the puts
//! before it have landed.

use super::frame::{Frame, CONTROL, DATA, FRAME_BYTES, INLINE, REPLY};
use super::memory::Heap;
use super::{Later, RmaCall, Span, WindowSpec, WindowTransport};
use crate::backend::progress::{Done, Post};
use crate::backend::{Backend, P2p};
use crate::error::{Error, Result};
use crate::group::ProgressThread;
use smallvec::SmallVec;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A window of one rank over posted messages.
pub(crate) struct P2pWindow {
    service: Arc<Service>,
    size: usize,
    /// The progress thread drives for this window (until `close`, or the drop of a
    /// window that was never closed).
    listening: std::sync::atomic::AtomicBool,
}

impl Drop for P2pWindow {
    fn drop(&mut self) {
        if self.listening.swap(false, std::sync::atomic::Ordering::AcqRel) {
            self.service.progress.unlisten();
        }
    }
}

/// The target side: this rank's memory and what peers' frames did to it.
struct Service {
    id: u64,
    rank: usize,
    backend: Arc<dyn Backend>,
    progress: Arc<ProgressThread>,
    heap: Heap,
    origins: Mutex<Origins>,
    changed: Condvar,
    /// The first failure of a put or signal that completed at once
    /// (`EAGER`): later calls report it.
    failed: std::sync::OnceLock<Error>,
}

/// Puts of at most this many bytes copy their source into the frame's
/// buffer and complete at once, as signals do (MPI's local completion):
/// the caller never waits for the progress thread to hand them over. A
/// failure to send them fails the window's next call.
const EAGER: usize = 64 << 10;

/// Per peer: signals arrived and taken, and whether it ended.
struct Origins {
    arrived: Vec<u64>,
    taken: Vec<u64>,
    /// `None` while it may send frames; `Some(None)` once it closed,
    /// `Some(Some(e))` once its frames failed (the target stopped reading).
    ended: Vec<Option<Option<Error>>>,
    /// This rank's close frames sent (or failed).
    closes_sent: usize,
}

/// A posted op's view of bytes that something the op's completion owns
/// keeps alive.
///
/// # Safety
/// `ptr..ptr + len` stays valid, and unused elsewhere if written, until
/// the op's completion has run.
unsafe fn bytes<'a>(ptr: *mut u8, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: the caller's promise.
    unsafe { std::slice::from_raw_parts_mut(ptr, len) }
}

impl P2pWindow {
    /// This rank's side of window `spec`, its frames moved by `backend`
    /// (which posts) and driven by `progress`.
    pub(crate) fn new(spec: WindowSpec, backend: Arc<dyn Backend>, progress: Arc<ProgressThread>) -> Result<P2pWindow> {
        let size = spec.size;
        // Every rank has its memory, or all fail (before any frame is sent).
        let left = spec.deadline.saturating_duration_since(Instant::now());
        let heap = Heap::zeroed(spec.sizes[spec.rank]);
        let heap = crate::store::all_or_none(&*spec.store, "allocated", spec.rank, size, left, heap, "window: allocating the memory")?;
        let service = Arc::new(Service {
            id: spec.id,
            rank: spec.rank,
            backend,
            progress,
            heap,
            origins: Mutex::new(Origins { arrived: vec![0; size], taken: vec![0; size], ended: vec![None; size], closes_sent: 0 }),
            changed: Condvar::new(),
            failed: std::sync::OnceLock::new(),
        });
        if size > 1 {
            service.progress.listen();
            for origin in (0..size).filter(|&p| p != spec.rank) {
                service.listen(origin);
            }
        }
        Ok(P2pWindow { service, size, listening: std::sync::atomic::AtomicBool::new(size > 1) })
    }

    fn tag(&self, channel: u8) -> u64 {
        crate::tag::window(self.service.id, channel)
    }

    /// Frame `f` for `peer` in a heap buffer of its own, and its send on
    /// the control channel, which views that buffer: pass the buffer as
    /// the batch's `keep` (its address stays put when the `Vec` moves).
    fn control_send(&self, peer: usize, f: Frame) -> (Vec<u8>, P2p<'static>) {
        let mut frame = f.encode(&[]).to_vec();
        // SAFETY: the caller keeps `frame` until the send's completion.
        let data = unsafe { bytes(frame.as_mut_ptr(), FRAME_BYTES) };
        (frame, P2p::Send { peer, tag: self.tag(CONTROL), data })
    }

    /// Post `ops` as a background batch; `keep` (what they borrow) lives
    /// until `done` has run. A failure fails the window too (see `failed`):
    /// a put or get given up half way leaves its frames out of step.
    ///
    /// # Safety
    /// Whatever `ops` borrow that `keep` does not own stays valid until
    /// `done` has run.
    unsafe fn post(&self, ops: &mut [P2p<'_>], keep: Vec<u8>, deadline: Instant, done: Done) {
        let me = self.service.clone();
        let done: Done = Box::new(move |r| {
            drop(keep);
            if let Err(e) = &r {
                me.fail(e.clone());
            }
            done(r)
        });
        // SAFETY: the caller's promise, and `keep` moved into `done`.
        self.service.progress.post(unsafe { Post::new(ops, &[], deadline, done) });
    }

    /// Post `ops`, which borrow only `keep`, finished at once for the
    /// caller: a failure to send is kept for the next call (see `failed`).
    /// They never expire (their delivery is the transport's, as for any
    /// send that completed locally): a signal after them can then never
    /// reach the target while they did not.
    fn post_eager(&self, ops: &mut [P2p<'_>], keep: Vec<u8>) -> Option<Result<()>> {
        // SAFETY: `ops` borrow only `keep`, which `post` keeps.
        unsafe { self.post(ops, keep, forever(), Box::new(|_| {})) };
        Some(Ok(()))
    }

    /// An earlier eager put or signal that failed.
    fn failed(&self) -> Result<()> {
        match self.service.failed.get() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }
}

impl WindowTransport for P2pWindow {
    fn local(&self) -> Span {
        Span { ptr: self.service.heap.ptr(), len: self.service.heap.len() }
    }

    unsafe fn put(&self, src: Span, dst: usize, offset: usize, call: &RmaCall, later: Later<'_>) -> Option<Result<()>> {
        if let Err(e) = self.failed() {
            return Some(Err(e));
        }
        // SAFETY: host memory (windows over messages are on the host),
        // valid until `done` (the caller's promise).
        let src: &[u8] = unsafe { src.host() };
        let (len, deadline) = (src.len(), call.deadline.get());
        let frame = Frame::Put { offset: offset as u64, len: len as u64 }.encode(if len <= INLINE { src } else { &[] });
        let mut keep = Vec::with_capacity(FRAME_BYTES + if len <= EAGER { len } else { 0 });
        keep.extend_from_slice(&frame);
        if len > INLINE && len <= EAGER {
            keep.extend_from_slice(src);
        }
        // SAFETY: `keep` goes to `post`'s keep.
        let kept = unsafe { bytes(keep.as_mut_ptr(), keep.len()) };
        let (frame, copied) = kept.split_at_mut(FRAME_BYTES);
        let mut ops: SmallVec<[P2p<'_>; 2]> = smallvec::smallvec![P2p::Send { peer: dst, tag: self.tag(CONTROL), data: frame }];
        if len > INLINE {
            ops.push(P2p::Send { peer: dst, tag: self.tag(DATA), data: if len <= EAGER { copied } else { src } });
        }
        if len <= EAGER {
            return self.post_eager(&mut ops, keep);
        }
        // SAFETY: `src` is valid until the completion runs (the caller's
        // promise).
        unsafe { self.post(&mut ops, keep, deadline, later()) };
        None
    }

    unsafe fn get(&self, dst: Span, src: usize, offset: usize, call: &RmaCall, later: Later<'_>) -> Option<Result<()>> {
        if let Err(e) = self.failed() {
            return Some(Err(e));
        }
        // SAFETY: as in `put`.
        let (dst, deadline) = (unsafe { dst.host() }, call.deadline.get());
        let (frame, request) = self.control_send(src, Frame::Get { offset: offset as u64, len: dst.len() as u64 });
        // The reply's receive is posted before the request goes out: gets
        // from one rank to one target are answered, and matched, in order.
        let mut ops = [P2p::Recv { peer: src, tag: self.tag(REPLY), buf: dst }, request];
        // SAFETY: `dst` is valid until the completion runs (the caller's
        // promise).
        unsafe { self.post(&mut ops, frame, deadline, later()) };
        None
    }

    fn signal(&self, peer: usize, _: &RmaCall, _: Later<'_>) -> Option<Result<()>> {
        if peer == self.service.rank {
            self.service.origins.lock().unwrap_or_else(|p| p.into_inner()).arrived[peer] += 1;
            return Some(Ok(()));
        }
        if let Err(e) = self.failed() {
            return Some(Err(e));
        }
        let (frame, send) = self.control_send(peer, Frame::Signal);
        self.post_eager(&mut [send], frame)
    }

    fn wait_signal(&self, peer: usize, count: u64, call: &RmaCall) -> Result<()> {
        let deadline = call.deadline.get();
        let s = &self.service;
        // The progress thread drives the transport and wakes this one: a
        // waiting thread that took the transport over instead was slower
        // (figures: bench/RESULTS.md, "Measurements behind code comments").
        let mut o = s.origins.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let have = o.arrived[peer] - o.taken[peer];
            if have >= count {
                o.taken[peer] += count;
                return Ok(());
            }
            self.failed()?;
            match &o.ended[peer] {
                Some(Some(e)) => return Err(e.clone()),
                Some(None) => {
                    return Err(Error::invalid(format!(
                        "rank {peer} deregistered the window after {have} of the {count} signals waited for"
                    )))
                }
                None => {}
            }
            let now = Instant::now();
            if now >= deadline {
                let e = Error::timeout(format!("window: {have} of {count} signals from rank {peer} arrived before the deadline"));
                return Err(e.stalled_on(Some(peer)));
            }
            o = s.changed.wait_timeout(o, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    fn remote(&self, _rank: usize) -> Option<*mut u8> {
        None
    }

    fn close(&self, deadline: Instant) -> Result<()> {
        let s = &self.service;
        if self.size == 1 {
            return Ok(());
        }
        // Every peer learns that this rank sends nothing more (after its
        // earlier frames); this rank waits for the same from every peer.
        for peer in (0..self.size).filter(|&p| p != s.rank) {
            let me = s.clone();
            let (frame, send) = self.control_send(peer, Frame::Close);
            let done: Done = Box::new(move |r| {
                let mut o = me.origins.lock().unwrap_or_else(|p| p.into_inner());
                o.closes_sent += 1;
                if let (Err(e), None) = (r, &o.ended[peer]) {
                    o.ended[peer] = Some(Some(e));
                }
                drop(o);
                me.changed.notify_all();
            });
            // SAFETY: the batch borrows only `frame`.
            unsafe { self.post(&mut [send], frame, deadline, done) };
        }
        let mut o = s.origins.lock().unwrap_or_else(|p| p.into_inner());
        let result = loop {
            let open = (0..self.size).find(|&p| p != s.rank && o.ended[p].is_none());
            if open.is_none() && o.closes_sent == self.size - 1 {
                if let Some(e) = s.failed.get() {
                    break Err(e.clone());
                }
                break match o.ended.iter().find_map(|e| e.as_ref().and_then(|e| e.clone())) {
                    Some(e) => Err(e),
                    None => Ok(()),
                };
            }
            let now = Instant::now();
            if now >= deadline {
                let peer = open.unwrap_or(s.rank);
                break Err(Error::timeout(format!("window: rank {peer} did not deregister it before the deadline")).stalled_on(Some(peer)));
            }
            o = s.changed.wait_timeout(o, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        };
        drop(o);
        if self.listening.swap(false, std::sync::atomic::Ordering::AcqRel) {
            s.progress.unlisten();
        }
        result
    }
}

/// A posted receive's deadline for a frame that may never come.
fn forever() -> Instant {
    crate::deadline::instant_after(Duration::MAX)
}

impl Service {
    /// Post the receive of `origin`'s next frame.
    fn listen(self: &Arc<Self>, origin: usize) {
        let mut frame = vec![0u8; FRAME_BYTES];
        // SAFETY: `frame` moves into the completion, which runs last.
        let mut ops =
            [P2p::Recv { peer: origin, tag: crate::tag::window(self.id, CONTROL), buf: unsafe { bytes(frame.as_mut_ptr(), FRAME_BYTES) } }];
        let me = self.clone();
        let done: Done = Box::new(move |r| me.on_frame(origin, frame, r));
        // SAFETY: as above.
        self.backend.post(unsafe { Post::new(&mut ops, &[], forever(), done) });
    }

    /// The window failed (`e`, the first failure, is reported by every
    /// later call): an op of this rank's was given up or failed.
    fn fail(&self, e: Error) {
        if self.failed.set(e).is_ok() {
            let _g = self.origins.lock().unwrap_or_else(|p| p.into_inner());
            self.changed.notify_all();
        }
    }

    /// Post `op` (a long put's bytes, a get's reply: it views the heap),
    /// then read `origin`'s next frame once it is done. Through the progress thread,
    /// which keeps driving until it is (after a close too).
    fn then_listen(self: &Arc<Self>, origin: usize, op: P2p<'static>) {
        let me = self.clone();
        let done: Done = Box::new(move |r| match r {
            Ok(()) => me.listen(origin),
            Err(e) => me.end(origin, Some(e)),
        });
        let mut ops = [op];
        // SAFETY: `op` views the heap, which `me` (in the completion) keeps.
        self.progress.post(unsafe { Post::new(&mut ops, &[], forever(), done) });
    }

    /// `origin` stopped: it closed (`None`) or failed.
    fn end(&self, origin: usize, why: Option<Error>) {
        let mut o = self.origins.lock().unwrap_or_else(|p| p.into_inner());
        if o.ended[origin].is_none() {
            if let Some(e) = &why {
                crate::log::info(format_args!("window #{} on rank {}: stopped reading rank {origin}: {e}", self.id, self.rank));
            }
            o.ended[origin] = Some(why);
        }
        drop(o);
        self.changed.notify_all();
    }

    /// Act on a frame from `origin` (or on its receive's failure).
    fn on_frame(self: &Arc<Self>, origin: usize, frame: Vec<u8>, r: Result<()>) {
        let b: [u8; FRAME_BYTES] = frame[..].try_into().expect("a frame buffer");
        let frame = match r.and_then(|()| Frame::decode(&b, origin, self.heap.len())) {
            Ok(f) => f,
            Err(e) => return self.end(origin, Some(e)),
        };
        match frame {
            Frame::Put { offset, len } if len as usize <= INLINE => {
                // SAFETY: inside the heap (checked by `decode`).
                unsafe { std::ptr::copy_nonoverlapping(Frame::inline(&b).as_ptr(), self.heap.ptr().add(offset as usize), len as usize) };
                self.listen(origin);
            }
            Frame::Put { offset, len } => {
                // SAFETY: inside the heap (checked by `decode`), which the
                // completion keeps alive.
                let buf = unsafe { bytes(self.heap.ptr().add(offset as usize), len as usize) };
                self.then_listen(origin, P2p::Recv { peer: origin, tag: crate::tag::window(self.id, DATA), buf });
            }
            Frame::Signal => {
                self.origins.lock().unwrap_or_else(|p| p.into_inner()).arrived[origin] += 1;
                self.changed.notify_all();
                self.listen(origin);
            }
            Frame::Get { offset, len } => {
                // SAFETY: as for a long put. The next frame is read only
                // once the reply went: at most one reply per origin in
                // flight, and a put after the get cannot change the bytes it
                // returns.
                let data = unsafe { bytes(self.heap.ptr().add(offset as usize), len as usize) };
                self.then_listen(origin, P2p::Send { peer: origin, tag: crate::tag::window(self.id, REPLY), data });
            }
            Frame::Close => self.end(origin, None),
        }
    }
}
