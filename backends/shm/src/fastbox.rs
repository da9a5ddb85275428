//! The small-message fast path (after Open MPI's vader "fast boxes"): each
//! rank owns two slots in the segment; a small all_reduce, broadcast,
//! all_gather, reduce_scatter or barrier writes this rank's part into one
//! slot, publishes it with a sequence number, and reads every peer's slot
//! straight from the segment.
//! No ring, no frame, no system call while the peers are running: one cache
//! line each way for an 8-byte all_reduce.
//!
//! Slot reuse needs no acknowledgement: op k uses slot k % 2, and a rank
//! publishes op k + 2 only after it has seen every peer's op k + 1, which
//! each peer published only after it had finished reading op k. Every fast
//! op therefore waits for every peer's slot, barrier included; broadcast
//! waits only for what it needs (a non-root for the root; the root for no
//! one) and owes the rest, which the rank's next fast op settles before it
//! publishes (as does an op that reports a mismatch, which the group
//! survives). A root thus leaves at once, and a non-root as soon as the
//! root's bytes are there, which with more ranks than cores saves waiting
//! for every peer to be scheduled. With more ranks than cores the barrier
//! is rooted too (`barrier_from_zero`): rank 0 publishes once it has seen
//! every peer's part, and the others wait for rank 0 alone, so rank 0
//! leaves first.
//!
//! Every rank reduces all contributions in rank order, so every rank gets
//! the same bits (as the ring algorithms guarantee too).
//!
//! Ranks that call an op differently may choose differently (4000 bytes
//! here, 8000 there: one takes the slots, the other the rings, and each
//! would wait for the other in vain). So every call of an op the fast path
//! could take is numbered, alike on every rank; a fast op's slot carries
//! its call number, and an op sent to the rings publishes its number and
//! description in this rank's marker. A rank waiting for a slot sees a
//! peer's marker of the same call, and a rank in the rings sees
//! (`rings_mismatch`) a peer's slot of its call: both name the mismatch.

use crate::ring::{Bytes, RawBytes};
use crate::sync::{AtomicU64, Ordering};
use weft::backend::Deadline;
use weft::kernels::{finish, prescale, reduce_into};
use weft::{DType, Error, ReduceOp, Result};

/// Payload bytes a slot holds: ops up to this size take the fast path.
pub const FASTBOX_BYTES: usize = 4096;
/// Sequence, description and call words, then the payload (an 8-byte
/// payload shares their cache line).
const HEADER: usize = 24;
/// Whether a wait first looks for what it waits for in plain loads
/// (`parts_in`, `await_part`): the same loads as the wait's own, made
/// before it is set up. Not under loom, whose model checks the waits: the
/// extra loads only multiply the interleavings it explores.
const FAST_LOOKS: bool = !cfg!(loom);
/// Bytes of a rank's marker (one cache line).
const MARKER: usize = 64;
/// Bytes per slot, whole cache lines.
pub const SLOT: usize = (HEADER + FASTBOX_BYTES).next_multiple_of(64);

/// How a peer's slot stands against this rank's op (`Fastbox::part`).
enum Part {
    /// Published, as the same call of the same op.
    Matches,
    /// Not published: the peer took the call through the rings.
    Missing,
    /// Published as another call: its number and its op's description.
    OtherCall(u64, u64),
    /// Published as this call, of another op: its description.
    OtherOp(u64),
}

/// Which op a slot's contents belong to, to catch ranks that disagree.
#[derive(Copy, Clone, Debug)]
pub enum Kind {
    /// all_reduce with this dtype and op.
    AllReduce(DType, ReduceOp),
    /// broadcast from this root.
    Broadcast(usize),
    /// barrier.
    Barrier,
    /// all_gather (lists and `_v` alike).
    AllGather,
    /// reduce_scatter with this dtype and op.
    ReduceScatter(DType, ReduceOp),
    /// all_to_all (lists and `_v` alike); its length is this rank's
    /// payload, or [`NO_FIT`].
    AllToAll,
}

/// The length field of a description word.
const LEN: u64 = 0xffff_ffff;
/// An all_to_all length: this rank's parts did not fit in its slot.
const NO_FIT: usize = LEN as usize;
/// all_to_all's code in a description word.
const ALL_TO_ALL: u64 = 6;

/// The part of a description that every rank must share: all but the
/// length for all_to_all (whose payloads differ between ranks).
fn shared_part(word: u64) -> u64 {
    if word >> 56 == ALL_TO_ALL {
        word & !LEN
    } else {
        word
    }
}

impl Kind {
    /// (kind, dtype or root, op) in one word, with the op's length (the
    /// same on every rank except for all_to_all: for all_gather and
    /// reduce_scatter, all ranks' parts together).
    pub(crate) fn describe(self, len: usize) -> u64 {
        let (kind, a, b) = match self {
            Kind::AllReduce(d, op) => (1u64, d as u64, op_code(op)),
            Kind::Broadcast(root) => (2, root as u64, 0),
            Kind::Barrier => (3, 0, 0),
            Kind::AllGather => (4, 0, 0),
            Kind::ReduceScatter(d, op) => (5, d as u64, op_code(op)),
            Kind::AllToAll => (ALL_TO_ALL, 0, 0),
        };
        (kind << 56) | ((a & 0xffff) << 40) | (b << 32) | len as u64
    }
}

fn op_code(op: ReduceOp) -> u64 {
    match op {
        ReduceOp::Sum => 1,
        ReduceOp::Product => 2,
        ReduceOp::Min => 3,
        ReduceOp::Max => 4,
        ReduceOp::Avg => 5,
        ReduceOp::Band => 6,
        ReduceOp::Bor => 7,
        ReduceOp::Bxor => 8,
        // The factor may differ between ranks; only the kind must agree.
        ReduceOp::PremulSum(_) => 9,
    }
}

fn explain(word: u64) -> String {
    let len = word & LEN;
    match word >> 56 {
        1 => format!("all_reduce of {len} bytes"),
        2 => format!("broadcast of {len} bytes from root {}", (word >> 40) & 0xffff),
        3 => "barrier".into(),
        4 => format!("all_gather of {len} bytes in all"),
        5 => format!("reduce_scatter of {len} bytes in all"),
        ALL_TO_ALL => "all_to_all".into(),
        _ => format!("an unknown op ({word:#x})"),
    }
}

/// A slot's header words, at the start of its first cache line (whose
/// other 48 bytes start the payload).
#[repr(C)]
pub struct Header {
    /// The op whose payload is in the slot (published last).
    seq: AtomicU64,
    /// `Kind::describe` of that op.
    what: AtomicU64,
    /// The call number of that op (see the module doc).
    call: AtomicU64,
}

/// A rank's last op sent to the rings: its call number and description,
/// written as a sequence lock (the call is 0 while the description
/// changes), so a reader never pairs one op's number with another's
/// description.
#[repr(C)]
pub struct Marker {
    call: AtomicU64,
    what: AtomicU64,
}

impl Marker {
    /// Publish op `call` described by `what`.
    fn write(&self, call: u64, what: u64) {
        self.call.store(0, Ordering::Relaxed);
        crate::sync::fence(Ordering::Release);
        self.what.store(what, Ordering::Relaxed);
        // SeqCst, as a slot's publication (`wake_sleepers`).
        self.call.store(call, Ordering::SeqCst);
    }

    /// The op published, if one is and it was not being rewritten.
    fn read(&self) -> Option<(u64, u64)> {
        let call = self.call.load(Ordering::Acquire);
        let what = self.what.load(Ordering::Relaxed);
        crate::sync::fence(Ordering::Acquire);
        (call != 0 && self.call.load(Ordering::Relaxed) == call).then_some((call, what))
    }
}

/// One rank's slot: header, then payload bytes.
pub struct Slot<B: Bytes = RawBytes> {
    header: *const Header,
    data: B,
}

// SAFETY: the header words are atomics; the payload follows the protocol
// of the module doc (one writer, readers only between publications).
unsafe impl<B: Bytes> Send for Slot<B> {}
// SAFETY: as above.
unsafe impl<B: Bytes> Sync for Slot<B> {}

impl Slot {
    /// The slot at `base`.
    ///
    /// # Safety
    /// `base` is 64-byte aligned, inside a live mapping with `SLOT` bytes
    /// from it, zeroed at creation and used only through this type.
    pub unsafe fn at(base: *mut u8) -> Slot {
        // SAFETY: the caller's contract.
        Slot { header: base as *const Header, data: unsafe { RawBytes::at(base.add(HEADER)) } }
    }
}

impl<B: Bytes> Slot<B> {
    fn header(&self) -> &Header {
        // SAFETY: points into the live mapping (constructor contract).
        unsafe { &*self.header }
    }
    /// Write this rank's payload and publish it as op `seq` (the caller
    /// owns the slot: see the module doc).
    fn publish(&self, seq: u64, what: u64, call: u64, data: &[u8]) {
        debug_assert!(data.len() <= FASTBOX_BYTES);
        // SAFETY: inside the payload area; no peer reads it until `seq` is
        // stored below, and none still reads the op published before.
        unsafe { self.data.put(0, data) };
        let h = self.header();
        h.what.store(what, Ordering::Relaxed);
        h.call.store(call, Ordering::Relaxed);
        // SeqCst: `Waiter::wake_sleepers` relies on it to see a sleeping
        // peer's flag (no separate fence).
        h.seq.store(seq, Ordering::SeqCst);
    }
    /// The description of op `seq`, once published.
    fn published(&self, seq: u64) -> Option<u64> {
        let h = self.header();
        (h.seq.load(Ordering::Acquire) == seq).then(|| h.what.load(Ordering::Relaxed))
    }
    /// The call number and description of whatever op is published.
    fn latest(&self) -> Option<(u64, u64)> {
        let h = self.header();
        (h.seq.load(Ordering::Acquire) != 0).then(|| (h.call.load(Ordering::Relaxed), h.what.load(Ordering::Relaxed)))
    }
    /// Copy the published payload's bytes from `at` into `dst`.
    fn read(&self, at: usize, dst: &mut [u8]) {
        debug_assert!(at + dst.len() <= FASTBOX_BYTES);
        // SAFETY: published (acquire in `published`) and not rewritten before
        // this rank finishes the op (module doc); within FASTBOX_BYTES.
        unsafe { self.data.get(at, dst) }
    }
    /// Reduce the published payload's bytes from `at` into `acc`.
    fn reduce_into(&self, at: usize, acc: &mut [u8], dtype: DType, op: ReduceOp) {
        debug_assert!(at + acc.len() <= FASTBOX_BYTES);
        // SAFETY: as in `read`.
        unsafe { self.data.read_with(at, acc.len(), |src| reduce_into(acc, src, dtype, op)) }
    }
}

/// Run `f` on `len` zeroed bytes of scratch: on the stack when small (the
/// latency-bound case: no allocation), else on the heap (a 4 KiB stack
/// buffer's zeroing measured costlier than the allocation).
fn with_scratch<T>(len: usize, f: impl FnOnce(&mut [u8]) -> T) -> T {
    const STACK: usize = 256;
    if len <= STACK {
        f(&mut [0u8; STACK][..len])
    } else {
        f(&mut vec![0u8; len])
    }
}

/// How a rank waits for a peer's slot: spin, then sleep (the transport's
/// doorbell), checking the deadline and the peer's health.
pub trait Waiter {
    /// Wait until `ready()` or fail (timeout, peer lost, aborted); `what()`
    /// names the op for the error (built only then: it allocates).
    fn wait_until(&self, peer: usize, what: &dyn Fn() -> String, deadline: &Deadline, ready: &dyn Fn() -> bool) -> Result<()>;
    /// Wake peers sleeping in `wait_until`, after a publication (a SeqCst
    /// store).
    fn wake_sleepers(&self);
}

/// The fast path of one rank: its slots and its peers'.
pub struct Fastbox<B: Bytes = RawBytes> {
    rank: usize,
    /// Rank r's slot for op k is `slots[r * 2 + k % 2]`.
    slots: Vec<Slot<B>>,
    /// Rank r's marker.
    markers: Vec<*const Marker>,
    /// The next fast op's sequence number.
    next: AtomicU64,
    /// The next call's number (fast op or marked, see the module doc).
    calls: AtomicU64,
    /// A peer took a call through the other path, or was at another call:
    /// the ranks' numbers are out of step for good.
    desynced: std::sync::atomic::AtomicBool,
    /// The op whose peers' publications this rank has not all seen yet
    /// (a broadcast's, a rooted barrier's, or one that reported a mismatch),
    /// to see before its next publication.
    owed: Owed,
    /// A mismatch found there, for the next op that finishes to report
    /// (`has_late`: whether there is one, read without the lock).
    late: std::sync::Mutex<Option<Error>>,
    has_late: std::sync::atomic::AtomicBool,
}

/// An op this rank has left before seeing every peer's part of it: its
/// number (0: none), call number and description, the peer it did see
/// (`NO_PEER`: none), and whether the op already reported a mismatch
/// (`quiet`: then its parts are only waited for, not checked again).
#[derive(Default)]
struct Owed {
    k: AtomicU64,
    call: AtomicU64,
    what: AtomicU64,
    seen: AtomicU64,
    quiet: std::sync::atomic::AtomicBool,
}

const NO_PEER: u64 = u64::MAX;

// SAFETY: the markers are atomics in the shared mapping (or leaked, in
// model checks), alive as long as the slots.
unsafe impl<B: Bytes> Send for Fastbox<B> {}
// SAFETY: as above.
unsafe impl<B: Bytes> Sync for Fastbox<B> {}

impl Fastbox {
    /// Over `size` ranks' slot pairs starting at `base`.
    ///
    /// # Safety
    /// `base` is 64-byte aligned with [`Fastbox::len`] zeroed bytes of a
    /// live mapping after it, shared by the group's ranks and used only
    /// through `Fastbox`.
    pub unsafe fn at(base: *mut u8, rank: usize, size: usize) -> Fastbox {
        // SAFETY: the caller's contract, slot by slot.
        let slots = (0..2 * size).map(|i| unsafe { Slot::at(base.add(i * SLOT)) }).collect();
        // SAFETY: the markers follow the slots, within `len`.
        let markers = (0..size).map(|r| unsafe { base.add(2 * size * SLOT + r * MARKER) } as *const Marker).collect();
        Fastbox::new(rank, slots, markers)
    }

    /// Bytes of segment for `size` ranks.
    pub const fn len(size: usize) -> usize {
        size * (2 * SLOT + MARKER)
    }
}

impl<B: Bytes> Fastbox<B> {
    fn new(rank: usize, slots: Vec<Slot<B>>, markers: Vec<*const Marker>) -> Fastbox<B> {
        Fastbox {
            rank,
            slots,
            markers,
            next: AtomicU64::new(1),
            calls: AtomicU64::new(1),
            desynced: Default::default(),
            owed: Owed::default(),
            late: Default::default(),
            has_late: Default::default(),
        }
    }

    /// Whether a mismatch left the ranks' call numbers out of step (a
    /// mismatch of two fast calls does not: both go on in step).
    pub fn desynced(&self) -> bool {
        self.desynced.load(Ordering::Relaxed)
    }

    /// This call's number. (A load and a store, not a locked increment:
    /// a group's collectives run one at a time, as the slots require.)
    fn next_call(&self) -> u64 {
        let call = self.calls.load(Ordering::Relaxed);
        self.calls.store(call + 1, Ordering::Relaxed);
        call
    }

    fn marker(&self, r: usize) -> &Marker {
        // SAFETY: see the constructor (and `Send`).
        unsafe { &*self.markers[r] }
    }

    /// An op of `kind` (`len` bytes in all) that the fast path could take
    /// goes through the rings: it takes a call number all the same, and
    /// says so in this rank's marker.
    pub fn through_rings(&self, waiter: &dyn Waiter, kind: Kind, len: usize) {
        let call = self.next_call();
        self.marker(self.rank).write(call, kind.describe(len.min(LEN as usize - 1)));
        waiter.wake_sleepers();
    }

    /// While this rank's latest call runs through the rings: a peer that
    /// took that call through the fast path, or called another op, is a
    /// mismatch (`InvalidArgument`).
    pub fn rings_mismatch(&self) -> Option<Error> {
        // (Another thread may be starting the next call: then its turn.)
        let (call, what) = self.marker(self.rank).read()?;
        if call.wrapping_add(1) != self.calls.load(Ordering::Relaxed) {
            return None;
        }
        (0..self.size()).filter(|p| *p != self.rank).find_map(|p| {
            let fast = (0..2).find_map(|i| self.slots[2 * p + i].latest().filter(|(c, _)| *c == call));
            let marked = self.marker(p).read().filter(|(c, _)| *c == call).map(|(_, what)| what);
            let theirs = match (fast, marked) {
                (Some((_, theirs)), _) => format!("{} (fast path)", explain(theirs)),
                (None, Some(theirs)) if shared_part(theirs) != shared_part(what) => explain(theirs),
                _ => return None,
            };
            Some(Error::invalid(format!("mismatched collectives: this rank called {} (rings), rank {p} {theirs}", explain(what))))
        })
    }

    /// One round: publish `mine` as this rank's part of op `kind` (`len`
    /// bytes in all, the same on every rank), then wait until every peer
    /// has published its part of the same op.
    fn round(&self, waiter: &dyn Waiter, kind: Kind, len: usize, mine: &[u8], deadline: &Deadline) -> Result<Round<'_, B>> {
        let (round, call) = self.publish(waiter, kind, len, mine, deadline)?;
        let what = kind.describe(len);
        self.await_parts(round.k, call, what, self.peers(), waiter, deadline).map_err(|e| self.owe_after(round.k, call, what, e))?;
        self.report_late().map(|()| round)
    }

    /// The op just finished, on this rank and for its peers: now report a
    /// mismatch found in an op this rank had left without waiting.
    fn report_late(&self) -> Result<()> {
        if !self.has_late.load(Ordering::Relaxed) || !self.has_late.swap(false, Ordering::Relaxed) {
            return Ok(());
        }
        self.late.lock().unwrap_or_else(|p| p.into_inner()).take().map_or(Ok(()), Err)
    }

    /// Every rank but this one.
    fn peers(&self) -> impl Iterator<Item = usize> + Clone {
        let me = self.rank;
        (0..self.size()).filter(move |p| *p != me)
    }

    /// Wait until each of `peers` has published its part of op `k` (call
    /// `call`, described by `what`); a peer that took the call through the
    /// rings, or called another op, is a mismatch.
    fn await_parts(
        &self,
        k: u64,
        call: u64,
        what: u64,
        peers: impl Iterator<Item = usize> + Clone,
        waiter: &dyn Waiter,
        deadline: &Deadline,
    ) -> Result<()> {
        if FAST_LOOKS && self.parts_in(k, call, what, peers.clone()) {
            return Ok(());
        }
        for p in peers {
            self.await_part(k, call, what, p, waiter, deadline)?;
            match self.part(k, call, what, p) {
                Part::Matches => {}
                Part::Missing => {
                    self.desynced.store(true, Ordering::Relaxed);
                    let theirs = self.marker(p).read().map_or(0, |(_, what)| what);
                    return Err(Error::invalid(format!(
                        "mismatched collectives: this rank called {} (fast path), rank {p} {} (rings)",
                        explain(what),
                        explain(theirs)
                    )));
                }
                Part::OtherCall(their_call, theirs) => {
                    self.desynced.store(true, Ordering::Relaxed);
                    return Err(Error::invalid(format!(
                        "mismatched collectives: rank {p} called {} as another op than this rank's {} \
                         (calls that may take the fast path: its #{their_call}, this rank's #{call})",
                        explain(theirs),
                        explain(what)
                    )));
                }
                Part::OtherOp(theirs) => {
                    return Err(Error::invalid(format!(
                        "mismatched collectives: this rank called {}, rank {p} {}",
                        explain(what),
                        explain(theirs)
                    )))
                }
            }
        }
        Ok(())
    }

    /// Whether each of `peers` has published its part of op `k`, as call
    /// `call` of the same op as `what`: the common case, checked in a few
    /// loads a peer before anything is set up to wait or to explain a
    /// mismatch (`await_parts` does both).
    #[inline]
    fn parts_in(&self, k: u64, call: u64, what: u64, mut peers: impl Iterator<Item = usize>) -> bool {
        peers.all(|p| matches!(self.part(k, call, what, p), Part::Matches))
    }

    /// How peer `p`'s slot stands against this rank's op `k`, call `call`,
    /// described by `what`.
    #[inline]
    fn part(&self, k: u64, call: u64, what: u64, p: usize) -> Part {
        let round = Round { fb: self, k };
        let slot = round.slot(p);
        let Some(theirs) = slot.published(k) else { return Part::Missing };
        let their_call = slot.header().call.load(Ordering::Relaxed);
        if their_call != call {
            return Part::OtherCall(their_call, theirs);
        }
        if shared_part(theirs) != shared_part(what) {
            return Part::OtherOp(theirs);
        }
        Part::Matches
    }

    /// Wait until peer `p` has published its part of op `k`, or taken its
    /// call `call` (described by `what`) through the rings.
    #[inline]
    fn await_part(&self, k: u64, call: u64, what: u64, p: usize, waiter: &dyn Waiter, deadline: &Deadline) -> Result<()> {
        let round = Round { fb: self, k };
        let slot = round.slot(p);
        // (Most parts are there at the first look: no wait to set up.)
        if FAST_LOOKS && slot.published(k).is_some() {
            return Ok(());
        }
        let marked = || self.marker(p).read().is_some_and(|(c, _)| c == call);
        waiter.wait_until(p, &|| explain(what), deadline, &|| slot.published(k).is_some() || marked())
    }

    /// Publish `mine` as this rank's part of op `kind`, once every peer's
    /// part of the op before is seen (so no peer still reads the slot this
    /// overwrites: see the module doc); the round and its call number.
    fn publish(&self, waiter: &dyn Waiter, kind: Kind, len: usize, mine: &[u8], deadline: &Deadline) -> Result<(Round<'_, B>, u64)> {
        debug_assert!(mine.len() <= FASTBOX_BYTES);
        self.settle_owed(waiter, deadline)?;
        // (A load and a store, as `next_call`.)
        let k = self.next.load(Ordering::Relaxed);
        self.next.store(k + 1, Ordering::Relaxed);
        let call = self.next_call();
        let round = Round { fb: self, k };
        round.slot(self.rank).publish(k, kind.describe(len), call, mine);
        waiter.wake_sleepers();
        Ok((round, call))
    }

    /// Op `k` (a broadcast) is left before every peer's part of it is seen
    /// (all but `seen`'s): the next publication waits for them.
    fn owe(&self, k: u64, call: u64, what: u64, seen: Option<usize>) {
        self.owed.call.store(call, Ordering::Relaxed);
        self.owed.what.store(what, Ordering::Relaxed);
        self.owed.seen.store(seen.map_or(NO_PEER, |p| p as u64), Ordering::Relaxed);
        self.owed.quiet.store(false, Ordering::Relaxed);
        self.owed.k.store(k, Ordering::Relaxed);
    }

    /// Whether `e` is a mismatch the group goes on after: an invalid call,
    /// with the ranks' call numbers still in step.
    fn survivable(&self, e: &Error) -> bool {
        !self.desynced() && e.kind() == &weft::ErrorKind::InvalidArgument
    }

    /// `e` ended op `k` on this rank. After a mismatch (the ranks' call
    /// numbers still in step) the group goes on, so the op's parts not yet
    /// seen are owed: the next publication waits for them, as for a
    /// broadcast, or it could overwrite the slot of the op before while a
    /// slow peer still reads it. Owed quietly: this op has reported its
    /// mismatch.
    fn owe_after(&self, k: u64, call: u64, what: u64, e: Error) -> Error {
        if self.survivable(&e) {
            self.owe(k, call, what, None);
            self.owed.quiet.store(true, Ordering::Relaxed);
        }
        e
    }

    /// See every peer's part of the op owed, if one is. A peer that called
    /// another fast op there is a mismatch to report once this rank's
    /// current op is done (its peers would otherwise wait for its part in
    /// vain); one that took the rings never publishes, and fails the
    /// transport (`desynced`) at once.
    fn settle_owed(&self, waiter: &dyn Waiter, deadline: &Deadline) -> Result<()> {
        let k = self.owed.k.load(Ordering::Relaxed);
        if k == 0 {
            return Ok(());
        }
        let (call, what) = (self.owed.call.load(Ordering::Relaxed), self.owed.what.load(Ordering::Relaxed));
        let seen = self.owed.seen.load(Ordering::Relaxed);
        if FAST_LOOKS && self.parts_in(k, call, what, self.peers().filter(|p| *p as u64 != seen)) {
            self.owed.k.store(0, Ordering::Relaxed);
            return Ok(());
        }
        let quiet = self.owed.quiet.load(Ordering::Relaxed);
        let mut late = None;
        for p in self.peers().filter(|p| *p as u64 != seen) {
            let parts = if quiet {
                self.await_part(k, call, what, p, waiter, deadline)
            } else {
                self.await_parts(k, call, what, std::iter::once(p), waiter, deadline)
            };
            match parts {
                Ok(()) => {}
                Err(e) if self.survivable(&e) => {
                    late.get_or_insert(Error::invalid(format!(
                        "{e} (found at this rank's next collective: a broadcast waits only for its root's part)"
                    )));
                }
                Err(e) => return Err(e),
            }
        }
        self.owed.k.store(0, Ordering::Relaxed);
        if late.is_some() {
            *self.late.lock().unwrap_or_else(|p| p.into_inner()) = late;
            self.has_late.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    fn size(&self) -> usize {
        self.slots.len() / 2
    }

    /// all_reduce of `buf` (at most [`FASTBOX_BYTES`]) in place.
    pub fn all_reduce(&self, waiter: &dyn Waiter, buf: &mut [u8], dtype: DType, op: ReduceOp, deadline: &Deadline) -> Result<()> {
        let kind = Kind::AllReduce(dtype, op);
        let round = if matches!(op, ReduceOp::PremulSum(_)) {
            with_scratch(buf.len(), |scratch| {
                scratch.copy_from_slice(buf);
                prescale(scratch, dtype, op);
                self.round(waiter, kind, buf.len(), scratch, deadline)
            })?
        } else {
            // Published straight from the caller's buffer: the round
            // copies it into this rank's slot, and the result is read back
            // from the slots.
            self.round(waiter, kind, buf.len(), buf, deadline)?
        };
        round.reduce(0, buf, dtype, op);
        finish(buf, dtype, op, self.size());
        Ok(())
    }

    /// reduce_scatter: `inputs` (one per rank, at most [`FASTBOX_BYTES`]
    /// together) reduced over the ranks into `output`.
    pub fn reduce_scatter(
        &self,
        waiter: &dyn Waiter,
        inputs: &[&[u8]],
        output: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        deadline: &Deadline,
    ) -> Result<()> {
        with_scratch(inputs.iter().map(|i| i.len()).sum(), |mine| {
            let mut at = 0;
            for i in inputs {
                weft::kernels::copy(&mut mine[at..at + i.len()], i);
                at += i.len();
            }
            prescale(mine, dtype, op);
            let at = inputs[..self.rank].iter().map(|i| i.len()).sum();
            let round = self.round(waiter, Kind::ReduceScatter(dtype, op), mine.len(), mine, deadline)?;
            round.reduce(at, output, dtype, op);
            finish(output, dtype, op, self.size());
            Ok(())
        })
    }

    /// all_gather: `outputs[p]` receives rank p's `input` (outputs at most
    /// [`FASTBOX_BYTES`] together).
    pub fn all_gather(&self, waiter: &dyn Waiter, input: &[u8], outputs: &mut [&mut [u8]], deadline: &Deadline) -> Result<()> {
        let len = outputs.iter().map(|o| o.len()).sum();
        let round = self.round(waiter, Kind::AllGather, len, input, deadline)?;
        for (p, out) in outputs.iter_mut().enumerate() {
            round.slot(p).read(0, out);
        }
        Ok(())
    }

    /// broadcast of `buf` (at most [`FASTBOX_BYTES`]) from `root`. The
    /// root waits for no one and a non-root only for the root; the other
    /// parts of the op are owed (see the module doc).
    pub fn broadcast(&self, waiter: &dyn Waiter, buf: &mut [u8], root: usize, deadline: &Deadline) -> Result<()> {
        let kind = Kind::Broadcast(root);
        let mine: &[u8] = if root == self.rank { buf } else { &[] };
        let (round, call) = self.publish(waiter, kind, buf.len(), mine, deadline)?;
        let what = kind.describe(buf.len());
        if root == self.rank {
            self.owe(round.k, call, what, None);
        } else {
            self.owe(round.k, call, what, Some(root));
            self.await_parts(round.k, call, what, std::iter::once(root), waiter, deadline)
                .map_err(|e| self.owe_after(round.k, call, what, e))?;
            round.slot(root).read(0, buf);
        }
        self.report_late()
    }

    /// all_to_all: `outputs[p]` receives rank p's part for this rank, if
    /// every rank's parts fit in its slot. `Ok(false)` if some rank's did
    /// not, with nothing written: the op must then run through the rings.
    ///
    /// Whether they fit differs between ranks, so every rank publishes:
    /// its part lengths and parts, or that they do not fit. A rank whose
    /// parts fit waits for every peer's publication; one whose parts do not
    /// returns at once. Its slot stays safe to reuse: it finishes this op
    /// only after every peer has sent it a part through the rings, which
    /// each does after reading every slot of the round.
    pub fn all_to_all(&self, waiter: &dyn Waiter, inputs: &[&[u8]], outputs: &mut [&mut [u8]], deadline: &Deadline) -> Result<bool> {
        let table = 4 * self.size();
        let total = table + inputs.iter().map(|i| i.len()).sum::<usize>();
        if total > FASTBOX_BYTES {
            // (A late mismatch waits for an op that finishes here.)
            self.publish(waiter, Kind::AllToAll, NO_FIT, &[], deadline)?;
            return Ok(false);
        }
        let round = with_scratch(total, |mine| {
            let mut at = table;
            for (p, i) in inputs.iter().enumerate() {
                mine[4 * p..4 * p + 4].copy_from_slice(&(i.len() as u32).to_le_bytes());
                weft::kernels::copy(&mut mine[at..at + i.len()], i);
                at += i.len();
            }
            self.round(waiter, Kind::AllToAll, total, mine, deadline)
        })?;
        if (0..self.size()).any(|p| round.len(p) == NO_FIT) {
            return Ok(false);
        }
        let me = self.rank;
        for (p, out) in outputs.iter_mut().enumerate() {
            // Rank p's lengths up to this rank's part locate it; they come
            // from another process, so they are checked against its slot.
            let slot = round.slot(p);
            let bad = |why: String| Error::backend(format!("shm: rank {p}'s all_to_all slot {why}"));
            let (mut at, mut len) = (table, 0);
            for q in 0..=me {
                at += len;
                let mut word = [0u8; 4];
                slot.read(4 * q, &mut word);
                len = u32::from_le_bytes(word) as usize;
            }
            let size = round.len(p);
            if size > FASTBOX_BYTES || at + len > size {
                return Err(bad(format!("puts a part at {at}..{} of its {size} bytes", at + len)));
            }
            if len != out.len() {
                return Err(bad(format!("holds {len} bytes for this rank, which expects {}", out.len())));
            }
            slot.read(at, out);
        }
        Ok(true)
    }

    /// barrier.
    pub fn barrier(&self, waiter: &dyn Waiter, deadline: &Deadline) -> Result<()> {
        self.round(waiter, Kind::Barrier, 0, &[], deadline).map(drop)
    }

    /// barrier that lets rank 0 go first: the others publish and wait for
    /// rank 0 alone, which publishes once it has seen every one of them.
    /// For ranks that outnumber their cores, where a rank leaves a barrier
    /// only when it next runs: in [`Fastbox::barrier`] the last to arrive
    /// goes first, and rank 0, the root of most of what follows a barrier
    /// (a broadcast, a pipeline's first stage), may be the last to run.
    ///
    /// Rank 0's part is published after every peer's, so a rank that has
    /// seen it has seen (through rank 0) every part; the others' parts are
    /// still owed as a broadcast's (see the module doc), so a mismatch
    /// among them is still found, at the next op. Rank 0 publishes after
    /// finding a mismatch too (the peers wait for its part; it owes the
    /// parts it has not seen), but not after a timeout or a lost peer: no
    /// rank may leave a barrier some rank has not reached. A rank that
    /// times out waiting for rank 0 blames the first rank that has not
    /// joined, as the flat barrier does.
    pub fn barrier_from_zero(&self, waiter: &dyn Waiter, deadline: &Deadline) -> Result<()> {
        let what = Kind::Barrier.describe(0);
        if self.rank != 0 {
            let (round, call) = self.publish(waiter, Kind::Barrier, 0, &[], deadline)?;
            self.owe(round.k, call, what, Some(0));
            if let Err(e) = self.await_parts(round.k, call, what, std::iter::once(0), waiter, deadline) {
                let missing = self.peers().find(|&p| p != 0 && round.slot(p).published(round.k).is_none());
                return Err(match missing {
                    Some(p) if e.kind() == &weft::ErrorKind::Timeout => {
                        Error::timeout(format!("shm: rank {p} did not join the barrier before the deadline")).stalled_on(Some(p))
                    }
                    _ => self.owe_after(round.k, call, what, e),
                });
            }
            return self.report_late();
        }
        self.settle_owed(waiter, deadline)?;
        // The op and call number `publish` takes next.
        let (k, call) = (self.next.load(Ordering::Relaxed), self.calls.load(Ordering::Relaxed));
        let seen = self.await_parts(k, call, what, self.peers(), waiter, deadline);
        if let Err(e) = &seen {
            if !self.survivable(e) {
                return seen;
            }
        }
        let (round, published) = self.publish(waiter, Kind::Barrier, 0, &[], deadline)?;
        debug_assert_eq!((round.k, published), (k, call), "no other op between");
        seen.map_err(|e| self.owe_after(k, call, what, e))?;
        self.report_late()
    }
}

/// Op `k`'s slots, every one published.
struct Round<'a, B: Bytes> {
    fb: &'a Fastbox<B>,
    k: u64,
}

impl<B: Bytes> Round<'_, B> {
    fn slot(&self, r: usize) -> &Slot<B> {
        &self.fb.slots[r * 2 + (self.k % 2) as usize]
    }

    /// The length in rank `r`'s description of this op.
    fn len(&self, r: usize) -> usize {
        (self.slot(r).published(self.k).expect("every slot of a round is published") & LEN) as usize
    }

    /// `out` = the bytes at `at` of every rank's part, reduced in rank
    /// order (so every rank gets the same bits), straight from the slots.
    fn reduce(&self, at: usize, out: &mut [u8], dtype: DType, op: ReduceOp) {
        self.slot(0).read(at, out);
        for p in 1..self.fb.size() {
            self.slot(p).reduce_into(at, out, dtype, op);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    /// Spins (yielding) until ready or the deadline.
    struct Yield;

    impl Waiter for Yield {
        fn wait_until(&self, peer: usize, what: &dyn Fn() -> String, deadline: &Deadline, ready: &dyn Fn() -> bool) -> Result<()> {
            while !ready() {
                if Instant::now() > deadline.get() {
                    return Err(Error::timeout(format!("rank {peer} did not join {}", what())));
                }
                std::thread::yield_now();
            }
            Ok(())
        }
        fn wake_sleepers(&self) {}
    }

    fn all_reduce(fb: &Fastbox, v: u8, op: ReduceOp) -> Result<u8> {
        let mut v = [v];
        fb.all_reduce(&Yield, &mut v, DType::U8, op, &Deadline::after(Duration::from_secs(20)))?;
        Ok(v[0])
    }

    /// Three ranks. In their second all_reduce rank 1 asks for another
    /// op, and rank 0 fails at rank 1's part before rank 2 has published
    /// (rank 2 is held back). Rank 0's third all_reduce rewrites the
    /// first's slot, which rank 2 may still be reading: it must not
    /// publish before rank 2's second part is there.
    #[test]
    fn after_a_mismatch_no_slot_is_rewritten_before_every_part_is_seen() {
        let mut mem = vec![0u128; Fastbox::len(3) / 16 + 4];
        let base = mem.as_mut_ptr() as *mut u8;
        // SAFETY: the offset is under 64, inside the spare bytes.
        let base = unsafe { base.add(base.align_offset(64)) };
        // SAFETY: zeroed, 64-byte aligned and large enough; outlives the
        // scope's threads.
        let fbs: Vec<Fastbox> = (0..3).map(|r| unsafe { Fastbox::at(base, r, 3) }).collect();
        let (failed, rank0_failed) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        let mut released = Some(released);
        let got = std::thread::scope(|s| {
            let threads: Vec<_> = fbs
                .iter()
                .enumerate()
                .map(|(r, fb)| {
                    let (failed, released) = (failed.clone(), if r == 2 { released.take() } else { None });
                    let second = if r == 1 { ReduceOp::Max } else { ReduceOp::Sum };
                    s.spawn(move || {
                        let first = all_reduce(fb, 1 + r as u8, ReduceOp::Sum).unwrap();
                        if let Some(released) = released {
                            // (Bounded: a failing check must not hang the test.)
                            let _ = released.recv_timeout(Duration::from_secs(20));
                        }
                        let second = all_reduce(fb, 1 + r as u8, second).map_err(|e| e.kind().clone());
                        if r == 0 {
                            failed.send(()).unwrap();
                        }
                        (first, second, all_reduce(fb, 10 + r as u8, ReduceOp::Sum).unwrap())
                    })
                })
                .collect();
            rank0_failed.recv_timeout(Duration::from_secs(20)).expect("rank 0 fails at rank 1's part");
            std::thread::sleep(Duration::from_millis(100));
            // Rank 0's slot for op 3, the third all_reduce.
            assert_eq!(fbs[0].slots[1].published(3), None, "rank 0 rewrote a slot rank 2 may still read");
            release.send(()).unwrap();
            threads.into_iter().map(|t| t.join().unwrap()).collect::<Vec<_>>()
        });
        for (first, second, third) in got {
            assert_eq!((first, second, third), (6, Err(weft::ErrorKind::InvalidArgument), 33));
        }
    }
}

/// Model check of slot reuse (`RUSTFLAGS="--cfg loom"`): two ranks run
/// three all_reduces back to back through the two slots, with each payload
/// byte a tracked cell, so a slot rewritten while its peer still reads it
/// is a reported race (and a wrong sum).
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::ring::loom_tests::Cells;
    use std::sync::Arc;
    use std::time::Duration;

    struct Spin;

    impl Waiter for Spin {
        fn wait_until(&self, _: usize, _: &dyn Fn() -> String, _: &Deadline, ready: &dyn Fn() -> bool) -> Result<()> {
            while !ready() {
                loom::thread::yield_now();
            }
            Ok(())
        }
        fn wake_sleepers(&self) {}
    }

    /// Two ranks' fast boxes over shared, tracked slots, each running
    /// `ops` on its own model thread; every rank's results.
    fn model_two_ranks(ops: fn(&Fastbox<Cells>, usize) -> Vec<u8>) -> [Vec<u8>; 2] {
        // Two ranks' two slots, each a header and a one-byte payload.
        let slots: Arc<Vec<(&'static Header, Cells)>> = Arc::new(
            (0..4)
                .map(|_| {
                    let h: &'static Header =
                        Box::leak(Box::new(Header { seq: AtomicU64::new(0), what: AtomicU64::new(0), call: AtomicU64::new(0) }));
                    (h, Cells::new(1))
                })
                .collect(),
        );
        // Both ranks' markers, by address (the model's threads share them).
        let markers: [usize; 2] =
            [0, 1].map(|_| Box::leak(Box::new(Marker { call: AtomicU64::new(0), what: AtomicU64::new(0) })) as *const Marker as usize);
        let rank = move |r: usize, slots: Arc<Vec<(&'static Header, Cells)>>| {
            let slots = slots.iter().map(|(h, c)| Slot { header: *h as *const Header, data: c.clone() }).collect();
            let markers = markers.iter().map(|m| *m as *const Marker).collect();
            ops(&Fastbox::new(r, slots, markers), r)
        };
        let other = {
            let slots = slots.clone();
            loom::thread::spawn(move || rank(1, slots))
        };
        let mine = rank(0, slots);
        [mine, other.join().unwrap()]
    }

    fn all_reduce(fb: &Fastbox<Cells>, v: u8) -> u8 {
        let mut v = [v];
        fb.all_reduce(&Spin, &mut v, DType::U8, ReduceOp::Sum, &Deadline::after(Duration::ZERO)).unwrap();
        v[0]
    }

    fn broadcast(fb: &Fastbox<Cells>, v: u8, root: usize) -> u8 {
        let mut v = [v];
        fb.broadcast(&Spin, &mut v, root, &Deadline::after(Duration::ZERO)).unwrap();
        v[0]
    }

    fn barrier_from_zero(fb: &Fastbox<Cells>) -> u8 {
        fb.barrier_from_zero(&Spin, &Deadline::after(Duration::ZERO)).unwrap();
        0
    }

    #[test]
    fn loom_fast_all_reduces_reuse_slots_safely() {
        loom::model(|| {
            let sums = model_two_ranks(|fb, r| (0..3u8).map(|op| all_reduce(fb, 10 * op + r as u8)).collect());
            assert_eq!(sums, [[1, 21, 41], [1, 21, 41]]);
        });
    }

    /// A broadcast's root leaves without waiting: three in a row from one
    /// root (the third overwriting the first's slot), then one from the
    /// other root, all through two slots.
    #[test]
    fn loom_broadcasts_that_do_not_wait_reuse_slots_safely() {
        loom::model(|| {
            let got = model_two_ranks(|fb, r| {
                let r = r as u8;
                let mut got: Vec<u8> = (0..3u8).map(|op| broadcast(fb, 10 * op + r, 0)).collect();
                got.push(broadcast(fb, 50 + r, 1));
                got
            });
            assert_eq!(got, [[0, 10, 20, 51], [0, 10, 20, 51]]);
        });
    }

    /// A barrier that lets rank 0 go first (rank 1 leaves once rank 0 has
    /// published) between two all_reduces: the second rewrites the first's
    /// slot, which rank 1 may do having seen only rank 0's barrier part.
    #[test]
    fn loom_a_barrier_from_rank_zero_reuses_slots_safely() {
        loom::model(|| {
            let got = model_two_ranks(|fb, r| {
                let r = r as u8;
                vec![all_reduce(fb, 1 + r), barrier_from_zero(fb), all_reduce(fb, 10 + r)]
            });
            assert_eq!(got, [[3, 0, 21], [3, 0, 21]]);
        });
    }
}
