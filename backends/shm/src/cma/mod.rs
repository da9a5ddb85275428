//! Single-copy transfers of large messages (cross-memory attach): the
//! sender puts only a descriptor (its buffer's address) in the ring and the
//! payload moves straight from the sender's memory to the receiver's with
//! `process_vm_readv`/`process_vm_writev`, one copy instead of two through
//! the ring.
//!
//! One transfer per ordered pair is in flight at a time (the transport
//! streams one send per peer), tracked by a cell in the segment whose
//! `word` holds `sequence << 3 | phase`:
//!
//! ```text
//! sender: POSTED ──receiver claims──> READING ──receiver done──> DONE
//!            │                            └─ sender waits (one syscall)
//!            ├─ sender gives up (timeout) ─> REVOKED: never read after this
//!            └─ receiver cannot read ──────> REFUSED: payload follows inline
//! ```
//!
//! A receiver also refuses (declines) one offer whose copy would run at
//! the distance where the kernel's copy is slow
//! ([`weft::kernels::slow_copy_distance`]: its destination 1 to 31 bytes
//! past the sender's buffer within a page): that message goes inline through the ring (whose
//! `memcpy`s do not care), and later ones are offered again.
//!
//! The sender returns (and its buffer is the caller's again) only at DONE,
//! REVOKED or REFUSED-and-sent-inline, so the receiver never reads memory
//! the sender has given back.
//!
//! **Both sides copy.** While READING the payload is cut in [`Chunks`]
//! that both sides claim from one counter in the cell: the receiver pulls
//! chunks from the sender's memory, the sender pushes chunks into the
//! receiver's destination (published in the cell before READING).
//! - A sender with nothing to receive has a core with nothing to do: both
//!   copy, chunk by chunk. Two cores copying measured 2.3× faster than one
//!   (1 MiB and 64 MiB here). A sender that has claimed nothing by the
//!   receiver's second claim is busy after all, so the receiver takes
//!   every chunk left at once.
//! - A sender that is receiving a large message too (all_gather,
//!   all_to_all, ring steps: every rank sends and receives) says so in its
//!   offer (`busy`): the receiver pulls the whole payload in one system
//!   call. Where the payload is likely still in the sender's cache (the
//!   sender has just written it, as the step's tag says, or it fits in one
//!   core's L2) and the receiver will not reduce it at once (the tag says
//!   that too), the sender **pushes** it instead, all in one system call,
//!   and the receiver publishes its destination and waits; if the sender
//!   has claimed nothing after a while (it is not running), the receiver
//!   pulls everything after all (figures: bench/RESULTS.md, "Measurements behind code comments"). An
//!   idle sender pushes data it has just written whole too.
//!
//! The receiver declares DONE only after closing the counter and seeing
//! every chunk the sender claimed pushed, so the sender never writes into
//! a buffer the receiver has given back; a claimed run is always copied at
//! once (one system call), so that wait is short.
//!
//! Here: the descriptors, the cells and their phases, the copy policy and
//! the copies. The exchange's side (which send goes single-copy, reading,
//! pushing, withdrawing and cancelling offers) is in `offers.rs`; which
//! scheme each kind of exchange takes as the run goes (ring, pull or push,
//! by what they measure), in `scheme.rs`.

mod offers;
pub mod scheme;

use crate::sync::{AtomicU64, Ordering};
use std::time::Duration;
use weft::store::Store;
use weft::{Error, Result};

/// Messages at least this large go single-copy (below, the ring is faster
/// than a system call).
pub const MIN_BYTES: usize = 32 << 10;
/// Bytes of the descriptor after the frame header: address, sequence.
pub const DESCRIPTOR: usize = 16;

/// The kernel copy's cost (times `memcpy`) above which the group takes
/// [`Policy::RING`]: between the machines measured, where the ring wins
/// and where single-copy does; a lower threshold flipped one host's
/// policy from run to run (figures: bench/RESULTS.md, "Measurements behind
/// code comments"). Only one threshold: a host's cost moves with its
/// phases (4.3-10 x from run to run on AMD Zen 5 under KVM, where `memcpy`
/// ran half as fast in some runs), so a second, higher one flipped too
/// (bench/RESULTS.md, twelfth session).
const SLOW_ABOVE: f64 = 2.5;

/// Which messages go single-copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// The smallest message offered by a sender that is receiving a large
    /// message too.
    pub min_bytes: usize,
    /// The smallest message offered by a sender with nothing large to
    /// receive (it helps copy: two cores at the one payload).
    pub idle_min_bytes: usize,
    /// Whether messages the receiver reduces on arrival are offered.
    pub combining: bool,
}

impl Policy {
    /// Where the kernel copies about as fast as `memcpy`: from
    /// [`MIN_BYTES`], every kind of message.
    pub const FAST: Policy = Policy { min_bytes: MIN_BYTES, idle_min_bytes: MIN_BYTES, combining: true };
    /// Single copy only for messages that outgrow the caches (the hint
    /// `shm_cma=large`): from 4 MiB, from 1 MiB where the sender is idle
    /// and copies too, never reductions (their segments stay in cache).
    /// Where kernel copies cost 2.7-4 x `memcpy` (AMD Zen 3 under KVM) the
    /// ring won below these sizes and single copy above (figures:
    /// bench/RESULTS.md, "Measurements behind code comments").
    pub const SLOW: Policy = Policy { min_bytes: 4 << 20, idle_min_bytes: 1 << 20, combining: false };
    /// Where the kernel's copy is much slower than `memcpy` (page pinning
    /// under some hypervisors): every message starts on the ring, the two
    /// copies one on each core and in cache, whatever its size; the run
    /// then moves a kind of exchange to single copy where it measures that
    /// cheaper (`scheme.rs`: large idle sends on AMD Zen 3, and any kind
    /// in a phase that slows cross-core hand-overs; kinds that do not adapt
    /// keep the ring). On AMD Zen 5 under KVM (8 x) the ring was the faster
    /// in calm phases for every op measured from 1 to 64 MiB (figures:
    /// bench/RESULTS.md, twelfth session).
    pub const RING: Policy = Policy { min_bytes: usize::MAX, idle_min_bytes: usize::MAX, combining: false };

    /// Whether a message of `len` bytes with `tag` goes single-copy, from a
    /// sender that is (or is not) `receiving` a large message too.
    pub fn offers(&self, len: usize, tag: u64, receiving: bool) -> bool {
        len >= if receiving { self.min_bytes } else { self.idle_min_bytes } && (self.combining || !weft::tag::combines(tag))
    }

    /// The policy for a kernel copy that costs `ratio` times `memcpy`
    /// ([`Policy::RING`] above [`SLOW_ABOVE`]; `None`: the kernel refuses,
    /// and peers' refusals route around it).
    fn for_cost(ratio: Option<f64>) -> Policy {
        if ratio.is_some_and(|r| r > SLOW_ABOVE) {
            Policy::RING
        } else {
            Policy::FAST
        }
    }

    /// The group's policy, the same on every rank (a collective over the
    /// group's store): each rank publishes what a kernel copy costs it
    /// ([`kernel_copy_cost`], measured once per process) and all take the
    /// mean. Each rank deciding alone measured 1.5x on one rank and 3.3x
    /// on the other of one W=2 run here, so one offered every message of
    /// 32 KiB single-copy and the other none below 4 MiB. A rank whose
    /// hint forces a policy takes part without a cost (`measure` false), so
    /// the others do not wait for it.
    pub fn agreed(store: &dyn Store, rank: usize, size: usize, timeout: Duration, measure: bool) -> Result<Policy> {
        static MEASURED: std::sync::OnceLock<Option<f64>> = std::sync::OnceLock::new();
        let mine = if measure { *MEASURED.get_or_init(kernel_copy_cost) } else { None };
        let mean = group_cost(store, rank, size, timeout, mine)?;
        let policy = Policy::for_cost(mean);
        weft::log::debug(format_args!("shm: a cross-memory read costs {mine:.1?}x memcpy here, {mean:.1?}x over the group: {policy:?}"));
        Ok(policy)
    }
}

/// Publish this rank's copy cost (`None`: the kernel refuses, or not
/// measured) and return the mean over the ranks that have one (the same
/// bits on every rank: the same numbers, added in rank order).
fn group_cost(store: &dyn Store, rank: usize, size: usize, timeout: Duration, mine: Option<f64>) -> Result<Option<f64>> {
    let mine = mine.map_or_else(|| "-".to_string(), |r| r.to_string());
    let mut costs = Vec::with_capacity(size);
    for (r, raw) in weft::store::all_gather(store, "cma_cost", rank, size, timeout, mine.as_bytes())?.iter().enumerate() {
        let text = String::from_utf8_lossy(raw);
        if text == "-" {
            continue;
        }
        match text.parse::<f64>() {
            Ok(cost) if cost.is_finite() => costs.push(cost),
            _ => return Err(Error::backend(format!("shm: rank {r} published a malformed copy cost {text:?}"))),
        }
    }
    Ok((!costs.is_empty()).then(|| costs.iter().sum::<f64>() / costs.len() as f64))
}

/// How many times longer a cross-memory read of 256 KiB (cache-hot, from
/// this process) takes than `memcpy`; `None` if the kernel refuses it. The
/// median of five rounds, each the best of four of either copy, read
/// side by side: a round now and then lands on a busy moment (the
/// group's other ranks are measuring too).
fn kernel_copy_cost() -> Option<f64> {
    use weft::kernels::AlignedBuf;
    const BYTES: usize = 256 << 10;
    let mut src = AlignedBuf::zeroed(BYTES);
    src.as_mut().fill(1);
    let mut dst = AlignedBuf::zeroed(BYTES);
    dst.as_mut().fill(0);
    let best = |f: &mut dyn FnMut() -> bool| -> Option<Duration> {
        let mut best = Duration::MAX;
        for _ in 0..4 {
            let t = std::time::Instant::now();
            if !f() {
                return None;
            }
            best = best.min(t.elapsed());
        }
        Some(best)
    };
    let addr = src.as_ref().as_ptr() as u64;
    let mut ratios = Vec::with_capacity(5);
    for _ in 0..5 {
        let plain = best(&mut || {
            dst.as_mut().copy_from_slice(src.as_ref());
            std::hint::black_box(dst.as_mut());
            true
        })?;
        let kernel = best(&mut || read(std::process::id(), addr, dst.as_mut()).is_ok())?;
        ratios.push(kernel.as_secs_f64() / plain.as_secs_f64().max(1e-9));
    }
    ratios.sort_by(f64::total_cmp);
    Some(ratios[ratios.len() / 2])
}

pub const POSTED: u64 = 0;
pub const READING: u64 = 1;
pub const DONE: u64 = 2;
pub const REVOKED: u64 = 3;
pub const REFUSED: u64 = 4;

/// The destination word of a refused transfer that the receiver declined
/// (that message only, see the module's notes), not refused for good.
const DECLINED: u64 = u64::MAX;

/// The state of one ordered pair's transfer, on its own cache line.
#[repr(C, align(64))]
pub struct Cell {
    word: AtomicU64,
    /// The receiver's destination address (valid while READING).
    dst: AtomicU64,
    /// `sequence << 24 | the next chunk nobody has claimed`.
    next: AtomicU64,
    /// `sequence << 24 | chunks the sender has pushed`.
    pushed: AtomicU64,
    /// `sequence << 24 | 1 + the first chunk of the run the sender failed
    /// to push` (0: none).
    failed: AtomicU64,
    /// The end of that run (valid once `failed` is set, read after
    /// `pushed` counts it).
    failed_end: AtomicU64,
}

const fn word(seq: u64, phase: u64) -> u64 {
    (seq << 3) | phase
}

const fn tagged(seq: u64, v: u64) -> u64 {
    (seq << 24) | v
}

/// The value of a `tagged` word if it belongs to transfer `seq`.
const fn untag(w: u64, seq: u64) -> Option<u64> {
    if w >> 24 == seq & ((1 << 40) - 1) {
        Some(w & ((1 << 24) - 1))
    } else {
        None
    }
}

impl Cell {
    /// A cell at rest (the segment's cells start zeroed, which is the same).
    #[cfg(test)]
    pub fn new() -> Cell {
        let z = || AtomicU64::new(0);
        Cell { word: z(), dst: z(), next: z(), pushed: z(), failed: z(), failed_end: z() }
    }
    /// Sender: transfer `seq` is offered.
    pub fn post(&self, seq: u64) {
        self.word.store(word(seq, POSTED), Ordering::Release);
    }
    /// The phase of transfer `seq` (`None` if the cell holds another one).
    pub fn phase(&self, seq: u64) -> Option<u64> {
        let w = self.word.load(Ordering::Acquire);
        (w >> 3 == seq).then_some(w & 7)
    }
    /// Move `seq` from POSTED to `to`; the phase found if it was not POSTED.
    pub fn advance(&self, seq: u64, to: u64) -> std::result::Result<(), Option<u64>> {
        self.word.compare_exchange(word(seq, POSTED), word(seq, to), Ordering::AcqRel, Ordering::Acquire).map(drop).map_err(|w| {
            if w >> 3 == seq {
                Some(w & 7)
            } else {
                None
            }
        })
    }
    /// Receiver: refuse `seq` while it is POSTED (the phase found if it was
    /// not): for good, or with `declined` this message only.
    pub fn refuse(&self, seq: u64, declined: bool) -> std::result::Result<(), Option<u64>> {
        // Published by the phase's release.
        self.dst.store(if declined { DECLINED } else { 0 }, Ordering::Relaxed);
        self.advance(seq, REFUSED)
    }
    /// Sender, once it has seen REFUSED: whether the receiver declined only
    /// that message.
    pub fn declined(&self) -> bool {
        self.dst.load(Ordering::Relaxed) == DECLINED
    }
    /// Receiver: leave READING for `to` (REFUSED when it cannot read).
    pub fn advance_from_reading(&self, seq: u64, to: u64) {
        self.word.store(word(seq, to), Ordering::Release);
    }
    /// Receiver: the read of `seq` is over.
    pub fn done(&self, seq: u64) {
        self.word.store(word(seq, DONE), Ordering::Release);
    }

    /// Receiver, before claiming `seq` (the claim publishes these): chunks
    /// go to `dst`, none taken yet.
    pub fn open_chunks(&self, seq: u64, dst: u64) {
        self.dst.store(dst, Ordering::Relaxed);
        self.pushed.store(tagged(seq, 0), Ordering::Relaxed);
        self.failed.store(tagged(seq, 0), Ordering::Relaxed);
        self.next.store(tagged(seq, 0), Ordering::Relaxed);
    }
    /// Either side: take the next of `count` chunks of `seq`, if any is
    /// left. With `rest_at`, if the next chunk is that one (the other side
    /// has claimed nothing since this side's claims), take every chunk left
    /// instead: the other side is busy elsewhere, and one system call copies
    /// them all.
    pub fn claim(&self, seq: u64, count: u64, rest_at: Option<u64>) -> Option<std::ops::Range<u64>> {
        self.claim_to(seq, count, |i| if rest_at == Some(i) { count } else { i + 1 })
    }
    /// Either side: take every chunk of `seq` still unclaimed, if any.
    pub fn claim_rest(&self, seq: u64, count: u64) -> Option<std::ops::Range<u64>> {
        self.claim_to(seq, count, |_| count)
    }
    /// Take chunks from the next unclaimed one, `i`, to `end(i)`.
    fn claim_to(&self, seq: u64, count: u64, end: impl Fn(u64) -> u64) -> Option<std::ops::Range<u64>> {
        let mut w = self.next.load(Ordering::Acquire);
        loop {
            let i = untag(w, seq).filter(|i| *i < count)?;
            let end = end(i);
            match self.next.compare_exchange_weak(w, w + (end - i), Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(i..end),
                Err(now) => w = now,
            }
        }
    }
    /// How many chunks of `seq` either side has claimed so far.
    pub fn claimed(&self, seq: u64) -> u64 {
        untag(self.next.load(Ordering::Acquire), seq).unwrap_or(0)
    }
    /// Receiver: no more claims; how many chunks were claimed in all.
    pub fn close(&self, seq: u64, count: u64) -> u64 {
        let w = self.next.swap(tagged(seq, count), Ordering::AcqRel);
        untag(w, seq).unwrap_or(count).min(count)
    }
    /// Sender: where chunks of the transfer being read go.
    pub fn dst(&self) -> u64 {
        self.dst.load(Ordering::Acquire)
    }
    /// Sender: the chunks `run` of `seq` are in place, or (`ok` false)
    /// could not be written and are the receiver's to copy.
    pub fn pushed(&self, seq: u64, run: std::ops::Range<u64>, ok: bool) {
        if !ok {
            self.failed_end.store(run.end, Ordering::Relaxed);
            self.failed.store(tagged(seq, run.start + 1), Ordering::Relaxed);
        }
        self.pushed.fetch_add(run.end - run.start, Ordering::Release);
    }
    /// Receiver: chunks of `seq` the sender has pushed (or given up on).
    pub fn pushed_count(&self, seq: u64) -> u64 {
        untag(self.pushed.load(Ordering::Acquire), seq).unwrap_or(0)
    }
    /// Receiver, once every pushed chunk is counted: the run that failed.
    pub fn failed_run(&self, seq: u64) -> Option<std::ops::Range<u64>> {
        let start = untag(self.failed.load(Ordering::Acquire), seq).filter(|v| *v > 0)? - 1;
        Some(start..self.failed_end.load(Ordering::Relaxed))
    }
}

/// How a payload is cut for two-sided copying: a few chunks per side for
/// balance, each large enough that a system call per chunk is noise.
#[derive(Clone, Copy)]
pub struct Chunks {
    len: usize,
    size: usize,
}

impl Chunks {
    /// The chunks of a `len`-byte payload (both sides compute the same).
    pub fn of(len: usize) -> Chunks {
        Chunks { len, size: (len / 4).clamp(128 << 10, 2 << 20).next_multiple_of(4096) }
    }
    /// How many.
    pub fn count(&self) -> u64 {
        self.len.div_ceil(self.size) as u64
    }
    /// Byte range of chunks `run` (adjacent chunks are one range).
    pub fn range(&self, run: std::ops::Range<u64>) -> std::ops::Range<usize> {
        run.start as usize * self.size..(run.end as usize * self.size).min(self.len)
    }
}

/// What a descriptor says: where the payload is, which transfer it is,
/// whether the sender is receiving a large message too (it will not help
/// chunk by chunk), and whether it pushes the whole payload itself (see
/// the module notes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Offer {
    /// The payload's address in the sender.
    pub addr: u64,
    /// The transfer's sequence (below 2^61: the cell's word keeps 3 bits).
    pub seq: u64,
    /// The sender is receiving a large message too: a receiver that pulls
    /// takes the whole payload in one system call.
    pub busy: bool,
    /// The sender pushes it all: the receiver publishes its destination and
    /// waits (pulling only if the sender claims nothing for a while).
    pub pushes: bool,
}

/// Set in a descriptor's sequence word: the sender pushes.
const PUSHES: u64 = 1 << 63;
/// Set in a descriptor's sequence word: the sender is busy receiving.
const BUSY: u64 = 1 << 62;

impl Offer {
    /// The descriptor's bytes: address, then sequence (with `PUSHES`, `BUSY`).
    pub fn encode(&self) -> [u8; DESCRIPTOR] {
        let mut d = [0u8; DESCRIPTOR];
        d[..8].copy_from_slice(&self.addr.to_le_bytes());
        d[8..].copy_from_slice(&(self.seq | if self.pushes { PUSHES } else { 0 } | if self.busy { BUSY } else { 0 }).to_le_bytes());
        d
    }
    /// Read a descriptor.
    pub fn decode(d: &[u8]) -> Offer {
        let word = |r: std::ops::Range<usize>| u64::from_le_bytes(d[r].try_into().expect("8 bytes"));
        let seq = word(8..16);
        Offer { addr: word(0..8), seq: seq & !(PUSHES | BUSY), busy: seq & BUSY != 0, pushes: seq & PUSHES != 0 }
    }
}

/// Why a copy failed.
pub enum CopyError {
    /// The kernel or a security policy forbids reaching the peer (EPERM,
    /// ENOSYS): fall back to inline transfers.
    Forbidden(nix::errno::Errno),
    /// Anything else (a bad address: a protocol error).
    Failed(nix::errno::Errno),
}

/// Copy `dst.len()` bytes from `addr` in process `pid` into `dst`.
pub fn read(pid: u32, addr: u64, dst: &mut [u8]) -> std::result::Result<(), CopyError> {
    use nix::sys::uio::{process_vm_readv, RemoteIoVec};
    let len = dst.len();
    whole(len, |got| {
        let remote = [RemoteIoVec { base: addr as usize + got, len: len - got }];
        process_vm_readv(nix::unistd::Pid::from_raw(pid as i32), &mut [std::io::IoSliceMut::new(&mut dst[got..])], &remote)
    })
}

/// Copy `src` to `addr` in process `pid`.
pub fn write(pid: u32, addr: u64, src: &[u8]) -> std::result::Result<(), CopyError> {
    use nix::sys::uio::{process_vm_writev, RemoteIoVec};
    whole(src.len(), |put| {
        let remote = [RemoteIoVec { base: addr as usize + put, len: src.len() - put }];
        process_vm_writev(nix::unistd::Pid::from_raw(pid as i32), &[std::io::IoSlice::new(&src[put..])], &remote)
    })
}

/// Repeat a partial copy (`step(bytes done so far)`) until `len` bytes moved.
fn whole(len: usize, mut step: impl FnMut(usize) -> nix::Result<usize>) -> std::result::Result<(), CopyError> {
    use nix::errno::Errno;
    let mut done = 0;
    while done < len {
        match step(done) {
            Ok(0) => return Err(CopyError::Failed(Errno::EFAULT)),
            Ok(n) => done += n,
            Err(Errno::EINTR) => {}
            Err(e @ (Errno::EPERM | Errno::ENOSYS | Errno::EACCES)) => return Err(CopyError::Forbidden(e)),
            Err(e) => return Err(CopyError::Failed(e)),
        }
    }
    Ok(())
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn ranks_that_measure_differently_agree_on_one_policy() {
        let store = weft::store::MemoryStore::new(Duration::from_secs(5));
        let costs = [Some(1.5), Some(3.7), None];
        let agreed: Vec<Option<f64>> = std::thread::scope(|s| {
            let handles: Vec<_> = costs
                .iter()
                .enumerate()
                .map(|(r, c)| {
                    let store = &store;
                    s.spawn(move || group_cost(store, r, 3, Duration::from_secs(5), *c).unwrap())
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // The mean of the two that measured; the rank the kernel refuses does not count.
        assert!(agreed.iter().all(|m| (m.unwrap() - 2.6).abs() < 1e-9), "{agreed:?}");
        assert_eq!(Policy::for_cost(agreed[0]), Policy::RING);
        assert_eq!(Policy::for_cost(Some(1.5)), Policy::FAST);
        assert_eq!(Policy::for_cost(Some(2.1)), Policy::FAST);
        assert_eq!(Policy::for_cost(None), Policy::FAST);
        assert_eq!((Policy::for_cost(Some(4.3)), Policy::for_cost(Some(10.0))), (Policy::RING, Policy::RING));
        // Garbage in the store is an error naming the rank, not a guess.
        let store = weft::store::MemoryStore::new(Duration::from_secs(5));
        store.set("cma_cost/1", b"fast").unwrap();
        let e = group_cost(&store, 0, 2, Duration::from_secs(5), Some(2.0)).unwrap_err();
        assert!(e.to_string().contains("rank 1 published a malformed copy cost"), "{e}");
    }

    #[test]
    fn phases_and_races() {
        let c = Cell::new();
        c.post(5);
        assert_eq!(c.phase(5), Some(POSTED));
        assert_eq!(c.phase(4), None);
        // The receiver claims it; the sender can then no longer revoke.
        assert!(c.advance(5, READING).is_ok());
        assert_eq!(c.advance(5, REVOKED), Err(Some(READING)));
        c.done(5);
        assert_eq!(c.phase(5), Some(DONE));
        // A revoked transfer cannot be claimed.
        c.post(6);
        assert!(c.advance(6, REVOKED).is_ok());
        assert_eq!(c.advance(6, READING), Err(Some(REVOKED)));
        // Declining one message, then refusing for good: the sender tells
        // them apart (and a revoked offer cannot be refused).
        c.post(7);
        assert!(c.refuse(7, true).is_ok());
        assert_eq!((c.phase(7), c.declined()), (Some(REFUSED), true));
        c.post(8);
        assert!(c.refuse(8, false).is_ok());
        assert_eq!((c.phase(8), c.declined()), (Some(REFUSED), false));
        c.post(9);
        assert!(c.advance(9, REVOKED).is_ok());
        assert_eq!(c.refuse(9, true), Err(Some(REVOKED)));
    }

    #[test]
    fn offers_round_trip() {
        for o in [
            Offer { addr: 0x7f00_dead_b000, seq: 1, busy: false, pushes: false },
            Offer { addr: 1, seq: (1 << 61) - 1, busy: true, pushes: false },
            Offer { addr: 2, seq: 5, busy: true, pushes: true },
        ] {
            assert_eq!(Offer::decode(&o.encode()), o);
        }
    }

    #[test]
    fn the_large_policy_offers_large_messages_not_reduced_and_the_ring_policy_none() {
        let plain = weft::tag::collective(1, 5, 0, 0);
        let reduced = plain | weft::tag::COMBINES;
        let fast = Policy::FAST;
        assert!(fast.offers(MIN_BYTES, plain, true) && fast.offers(MIN_BYTES, reduced, false));
        assert!(!fast.offers(MIN_BYTES - 1, plain, false));
        let slow = Policy::SLOW;
        assert!(!slow.offers(1 << 20, plain, true) && slow.offers(4 << 20, plain, true));
        assert!(!slow.offers((1 << 20) - 1, plain, false) && slow.offers(1 << 20, plain, false));
        assert!(!slow.offers(64 << 20, reduced, false));
        // Where kernel copies cost most, the rule offers nothing: every
        // message starts on the ring, and only measuring moves it.
        assert!([true, false].iter().all(|&r| !Policy::RING.offers(1 << 40, plain, r)));
        // A measured cost is a positive ratio (None where the kernel forbids the copy).
        assert!(kernel_copy_cost().is_none_or(|r| r > 0.0 && r.is_finite()));
    }

    #[test]
    fn chunks_cover_the_payload_once() {
        for len in [1, 4095, 128 << 10, (128 << 10) + 1, 1_200_004, 64 << 20, (64 << 20) + 12_345] {
            let c = Chunks::of(len);
            let mut at = 0;
            for i in 0..c.count() {
                let r = c.range(i..i + 1);
                assert_eq!(r.start, at);
                assert!(r.end > r.start && r.end <= len);
                at = r.end;
            }
            assert_eq!(at, len, "len {len}");
        }
        assert_eq!(Chunks::of(1_200_004).count(), 4, "a few chunks per side");
        let c = Chunks::of(1_200_004);
        assert_eq!(c.range(1..4), c.range(1..2).start..1_200_004, "a run of chunks is one range");
    }

    #[test]
    fn both_sides_claim_each_chunk_once_and_failures_come_back() {
        let c = Cell::new();
        c.post(9);
        c.open_chunks(9, 0x1000);
        assert!(c.advance(9, READING).is_ok());
        // A stale sequence claims nothing.
        assert_eq!(c.claim(8, 4, None), None);
        assert_eq!(c.claim(9, 4, None), Some(0..1)); // receiver
        assert_eq!(c.claim(9, 4, None), Some(1..2)); // sender
        assert_eq!(c.dst(), 0x1000);
        // ... which could not write it.
        c.pushed(9, 1..2, false);
        // The receiver (1 claimed) would take the rest only if the sender had claimed none.
        assert_eq!(c.claim(9, 4, Some(1)), Some(2..3));
        // The receiver closes: chunk 3 is nobody's, so 3 were claimed.
        assert_eq!(c.close(9, 4), 3);
        assert_eq!(c.claim(9, 4, None), None);
        assert_eq!(c.pushed_count(9), 1);
        assert_eq!(c.failed_run(9), Some(1..2));
        // The next transfer starts clean.
        c.post(10);
        c.open_chunks(10, 0x2000);
        assert_eq!((c.pushed_count(10), c.failed_run(10), c.pushed_count(9)), (0, None, 0));
        // A busy sender: after its first chunk the receiver takes the rest at once.
        assert!(c.advance(10, READING).is_ok());
        assert_eq!(c.claim(10, 4, None), Some(0..1));
        assert_eq!(c.claim(10, 4, Some(1)), Some(1..4));
        assert_eq!(c.claim(10, 4, None), None);
        assert_eq!(c.close(10, 4), 4);
        // A pushing sender takes every chunk left in one run; a failed run
        // comes back whole, and counts as pushed chunk by chunk.
        c.post(11);
        c.open_chunks(11, 0x3000);
        assert!(c.advance(11, READING).is_ok());
        assert_eq!(c.claimed(11), 0);
        assert_eq!(c.claim_rest(11, 5), Some(0..5));
        assert_eq!((c.claimed(11), c.claim_rest(11, 5), c.claim(11, 5, Some(0))), (5, None, None));
        c.pushed(11, 0..5, false);
        assert_eq!((c.close(11, 5), c.pushed_count(11), c.failed_run(11)), (5, 5, Some(0..5)));
    }

    #[test]
    fn writes_this_process() {
        let src: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        match write(std::process::id(), dst.as_mut_ptr() as u64, &src) {
            Ok(()) => assert_eq!(dst, src),
            Err(CopyError::Forbidden(_)) => {}
            Err(CopyError::Failed(e)) => panic!("{e}"),
        }
    }

    #[test]
    fn reads_this_process() {
        let src: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        let mut dst = vec![0u8; src.len()];
        match read(std::process::id(), src.as_ptr() as u64, &mut dst) {
            Ok(()) => assert_eq!(dst, src),
            Err(CopyError::Forbidden(_)) => {} // a sandbox without CMA: the fallback covers it
            Err(CopyError::Failed(e)) => panic!("{e}"),
        }
    }
}

/// Model check of claim against withdraw (`RUSTFLAGS="--cfg loom"`): the
/// receiver reads the sender's buffer only if it claimed the offer, and the
/// sender reuses it only after DONE or a successful withdrawal. The buffer
/// is a tracked cell, so a read after reuse is a reported race.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;

    /// Transfer 1 in READING, into a destination of `chunks` one-byte chunks.
    fn reading(chunks: usize) -> (Arc<Cell>, Arc<Vec<UnsafeCell<u8>>>) {
        let cell = Arc::new(Cell::new());
        cell.post(1);
        cell.open_chunks(1, 0);
        cell.advance(1, READING).unwrap();
        (cell, Arc::new((0..chunks).map(|_| UnsafeCell::new(0)).collect()))
    }

    /// The receiver counts the sender's pushed chunks (acquire) before it
    /// reads them, and each chunk is written by exactly one side: the
    /// destination's bytes are tracked cells, so either mistake is a
    /// reported race.
    #[test]
    fn loom_pushed_chunks_are_visible_before_the_receiver_finishes() {
        loom::model(|| {
            let (cell, dst) = reading(3);
            let sender = {
                let (cell, dst) = (cell.clone(), dst.clone());
                loom::thread::spawn(move || {
                    if cell.phase(1) == Some(READING) {
                        if let Some(run) = cell.claim(1, 3, None) {
                            let i = run.start;
                            // SAFETY: chunk i is this side's alone (claimed).
                            dst[i as usize].with_mut(|p| unsafe { *p = 10 + i as u8 });
                            cell.pushed(1, run, true);
                        }
                    }
                })
            };
            // The receiver takes the rest in one run when the sender has not claimed yet.
            let mut mine = 0;
            while let Some(run) = cell.claim(1, 3, (mine > 0).then_some(mine)) {
                mine += run.end - run.start;
                for i in run {
                    // SAFETY: as above.
                    dst[i as usize].with_mut(|p| unsafe { *p = 10 + i as u8 });
                }
            }
            let theirs = cell.close(1, 3) - mine;
            while cell.pushed_count(1) < theirs {
                loom::thread::yield_now();
            }
            // SAFETY: every chunk is written and its writer is done with it.
            let got: Vec<u8> = dst.iter().map(|c| c.with(|p| unsafe { *p })).collect();
            assert_eq!(got, [10, 11, 12]);
            cell.done(1);
            sender.join().unwrap();
        });
    }

    /// A pushing sender takes every chunk at once while the receiver, tired
    /// of waiting, may steal them: each chunk is written once, and all are
    /// in before the receiver finishes.
    #[test]
    fn loom_a_pushed_payload_or_a_stolen_one_is_whole() {
        loom::model(|| {
            let (cell, dst) = reading(2);
            let write = |dst: &[UnsafeCell<u8>], run: std::ops::Range<u64>| {
                for i in run {
                    // SAFETY: the run is the writer's alone (claimed).
                    dst[i as usize].with_mut(|p| unsafe { *p = 20 + i as u8 });
                }
            };
            let sender = {
                let (cell, dst) = (cell.clone(), dst.clone());
                loom::thread::spawn(move || {
                    if let Some(run) = cell.claim_rest(1, 2) {
                        write(&dst, run.clone());
                        cell.pushed(1, run, true);
                    }
                })
            };
            // The receiver steals only if the sender has claimed nothing.
            let mut mine = 0;
            if cell.claimed(1) == 0 {
                if let Some(run) = cell.claim_rest(1, 2) {
                    mine = run.end - run.start;
                    write(&dst, run);
                }
            }
            let theirs = cell.close(1, 2) - mine;
            while cell.pushed_count(1) < theirs {
                loom::thread::yield_now();
            }
            // SAFETY: every chunk is written and its writer is done with it.
            let got: Vec<u8> = dst.iter().map(|c| c.with(|p| unsafe { *p })).collect();
            assert_eq!(got, [20, 21]);
            cell.done(1);
            sender.join().unwrap();
        });
    }

    #[test]
    fn loom_a_withdrawn_offer_is_never_read() {
        loom::model(|| {
            let cell = Arc::new(Cell::new());
            let buffer = Arc::new(UnsafeCell::new(7u8));
            cell.post(1);
            let receiver = {
                let (cell, buffer) = (cell.clone(), buffer.clone());
                loom::thread::spawn(move || {
                    if cell.advance(1, READING).is_ok() {
                        // SAFETY: claimed: the sender keeps the buffer until DONE.
                        let v = buffer.with(|p| unsafe { *p });
                        assert_eq!(v, 7);
                        cell.done(1);
                    }
                })
            };
            // The sender gives up: withdraw, or wait for a read in progress.
            match cell.advance(1, REVOKED) {
                Ok(()) => {}
                Err(_) => {
                    while cell.phase(1) != Some(DONE) {
                        loom::thread::yield_now();
                    }
                }
            }
            // SAFETY: withdrawn or read: the buffer is the sender's again.
            buffer.with_mut(|p| unsafe { *p = 0xEE });
            receiver.join().unwrap();
        });
    }
}
