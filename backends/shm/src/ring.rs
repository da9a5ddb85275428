//! A single-producer single-consumer byte ring in shared memory. The
//! producer owns `tail` and the bytes after it; the consumer owns `head`.
//! Release/acquire on the counters hands bytes from one to the other.
//!
//! The bytes are reached through [`Bytes`], so the same code runs over the
//! segment ([`RawBytes`]) and, under loom, over tracked cells that make a
//! missing release/acquire a reported data race (see the loom tests).

use crate::sync::{AtomicU64, Ordering};

/// Counters, each on its own cache line.
#[repr(C, align(64))]
pub struct Counter(pub AtomicU64);

/// The ring's data bytes.
pub trait Bytes {
    /// Copy `src` to offset `at`.
    ///
    /// # Safety
    /// `[at, at + src.len())` is inside the buffer and owned by the caller.
    unsafe fn put(&self, at: usize, src: &[u8]);
    /// Copy from offset `at` into `dst`.
    ///
    /// # Safety
    /// As `put`.
    unsafe fn get(&self, at: usize, dst: &mut [u8]);
    /// [`Bytes::get`] for a piece of a destination too large to stay in
    /// cache: past this core's caches where it can (`kernels::copy_to_memory`).
    ///
    /// # Safety
    /// As `put`.
    unsafe fn get_to_memory(&self, at: usize, dst: &mut [u8]) {
        // SAFETY: the caller's contract.
        unsafe { self.get(at, dst) }
    }
    /// Let `f` write the `len` bytes at offset `at`: in place where they
    /// can be (the segment), else through a copy.
    ///
    /// # Safety
    /// As `put`.
    unsafe fn write_with(&self, at: usize, len: usize, f: impl FnOnce(&mut [u8]))
    where
        Self: Sized,
    {
        let mut copy = vec![0; len];
        f(&mut copy);
        // SAFETY: the caller's contract.
        unsafe { self.put(at, &copy) };
    }
    /// Run `f` on the `len` bytes at offset `at`: borrowed in place where
    /// they can be (the segment), else on a copy.
    ///
    /// # Safety
    /// As `put`, for the whole call.
    unsafe fn read_with<R>(&self, at: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> R
    where
        Self: Sized,
    {
        let mut copy = vec![0; len];
        // SAFETY: the caller's contract.
        unsafe { self.get(at, &mut copy) };
        f(&copy)
    }
}

/// Bytes in the mapped segment.
pub struct RawBytes(*mut u8);

impl RawBytes {
    /// The bytes from `at` on.
    ///
    /// # Safety
    /// `at` points into a live mapping; `put`/`get` offsets stay inside it.
    pub unsafe fn at(at: *mut u8) -> RawBytes {
        RawBytes(at)
    }
}

impl Bytes for RawBytes {
    unsafe fn put(&self, at: usize, src: &[u8]) {
        // SAFETY: the caller's contract: inside the mapping, and owned by
        // the producer (no one reads these bytes) until the call returns;
        // `src` is local memory, not the ring.
        weft::kernels::copy(unsafe { std::slice::from_raw_parts_mut(self.0.add(at), src.len()) }, src)
    }
    unsafe fn get(&self, at: usize, dst: &mut [u8]) {
        // SAFETY: the caller's contract: inside the mapping, and no one
        // writes these bytes until the call returns.
        weft::kernels::copy(dst, unsafe { std::slice::from_raw_parts(self.0.add(at), dst.len()) })
    }
    unsafe fn get_to_memory(&self, at: usize, dst: &mut [u8]) {
        // SAFETY: as `get`.
        weft::kernels::copy_to_memory(dst, unsafe { std::slice::from_raw_parts(self.0.add(at), dst.len()) })
    }
    unsafe fn read_with<R>(&self, at: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        // SAFETY: the caller's contract: inside the mapping, and no one
        // writes these bytes until the call returns.
        f(unsafe { std::slice::from_raw_parts(self.0.add(at), len) })
    }
    unsafe fn write_with(&self, at: usize, len: usize, f: impl FnOnce(&mut [u8])) {
        // SAFETY: the caller's contract: inside the mapping, and owned by
        // the producer (no one reads these bytes) until the call returns.
        f(unsafe { std::slice::from_raw_parts_mut(self.0.add(at), len) })
    }
}

/// Where one ring lives in the segment.
///
/// Each side keeps, in its own memory, the last value it read of the
/// other's counter, and reads the shared one again only when that value
/// shows too little room (producer) or too little to read (consumer):
/// each such read takes the line from the other core, which had just
/// written it (a profile of 8-byte sends, in one of this VM's slow phases,
/// put a sixth of a send's time in the producer's read of the head).
pub struct Ring<B: Bytes = RawBytes> {
    head: *const Counter,
    tail: *const Counter,
    data: B,
    cap: usize,
    /// Producer: the consumer's `head` as last read (at most the real one).
    seen_head: AtomicU64,
    /// Consumer: the producer's `tail` as last read (at most the real one).
    seen_tail: AtomicU64,
    /// Producer: its own `tail`, as last stored. Each side reads its own
    /// counter from here, never from the segment: there it shares a line
    /// with the peer's reads, and a small send or receive after a context
    /// switch would load it again.
    my_tail: AtomicU64,
    /// Consumer: its own `head`, as last stored.
    my_head: AtomicU64,
}

// SAFETY: see the module doc: each side touches only what it owns.
unsafe impl<B: Bytes> Send for Ring<B> {}
// SAFETY: as above.
unsafe impl<B: Bytes> Sync for Ring<B> {}

/// The producer publishes what it wrote every this many bytes: a 1 MiB
/// message published only once copied kept a receiver that had caught up
/// with nothing to read for longer than it spins, so it slept and paid a
/// wake-up (figures: bench/RESULTS.md, "Measurements behind code comments").
pub const PUBLISH: usize = 64 << 10;

/// Bytes a ring of `cap` data bytes takes in the segment.
pub const fn footprint(cap: usize) -> usize {
    2 * std::mem::size_of::<Counter>() + cap
}

impl Ring {
    /// The ring at `at` (a `footprint(cap)` region, zeroed at creation) of
    /// `cap` data bytes, a power of two.
    ///
    /// # Safety
    /// `at` must point into a live mapping with `footprint(cap)` bytes,
    /// 64-byte aligned, used by one producer and one consumer only.
    pub unsafe fn at(at: *mut u8, cap: usize) -> Ring {
        let c = std::mem::size_of::<Counter>();
        // SAFETY: inside the region (the caller's contract).
        let (tail, data) = unsafe { (at.add(c) as *const Counter, RawBytes(at.add(2 * c))) };
        // SAFETY: the caller's contract.
        unsafe { Ring::over(at as *const Counter, tail, data, cap) }
    }
}

impl<B: Bytes> Ring<B> {
    /// A ring over counters and bytes already placed.
    ///
    /// # Safety
    /// `head` and `tail` stay live as long as the ring; one producer and
    /// one consumer use it, and this side has not used it through another
    /// `Ring` (the counters it keeps start as the segment's).
    unsafe fn over(head: *const Counter, tail: *const Counter, data: B, cap: usize) -> Ring<B> {
        // (Offsets are then a mask, not a division, on every send and receive.)
        assert!(cap.is_power_of_two(), "a ring's capacity is a power of two, not {cap}");
        // SAFETY: live (the caller's contract).
        let (h, t) = unsafe { ((*head).0.load(Ordering::Acquire), (*tail).0.load(Ordering::Acquire)) };
        Ring {
            head,
            tail,
            data,
            cap,
            seen_head: AtomicU64::new(h),
            seen_tail: AtomicU64::new(t),
            my_tail: AtomicU64::new(t),
            my_head: AtomicU64::new(h),
        }
    }

    fn head(&self) -> &AtomicU64 {
        // SAFETY: points into the live mapping (constructor contract).
        unsafe { &(*self.head).0 }
    }
    fn tail(&self) -> &AtomicU64 {
        // SAFETY: as above.
        unsafe { &(*self.tail).0 }
    }

    /// Bytes the ring holds when full.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Bytes waiting to be read.
    pub fn available(&self) -> usize {
        (self.tail().load(Ordering::Acquire) - self.my_head.load(Ordering::Relaxed)) as usize
    }

    /// Consumer: the producer's tail, from the last reading while that
    /// shows `want` bytes past `head`.
    fn known_tail(&self, head: u64, want: usize) -> u64 {
        let seen = self.seen_tail.load(Ordering::Relaxed);
        if seen >= head + want as u64 {
            return seen;
        }
        let tail = self.tail().load(Ordering::Acquire);
        self.seen_tail.store(tail, Ordering::Relaxed);
        tail
    }

    /// Producer: copy as much of `src` as fits; bytes written. The bytes
    /// are published every [`PUBLISH`] bytes, so the consumer copies out
    /// while the rest is copied in.
    pub fn write(&self, src: &[u8]) -> usize {
        self.write_with(src.len(), |at, piece| weft::kernels::copy(piece, &src[at..at + piece.len()]))
    }

    /// Producer: write as much of `len` bytes as fits, each piece of free
    /// space filled by `fill(offset, piece)` (offset from the first of the
    /// `len` bytes), publishing every [`PUBLISH`] bytes; bytes written.
    pub fn write_with(&self, len: usize, mut fill: impl FnMut(usize, &mut [u8])) -> usize {
        let mut tail = self.my_tail.load(Ordering::Relaxed);
        let n = len.min(self.free(tail, len));
        let mut done = 0;
        while done < n {
            let k = (n - done).min(PUBLISH);
            let (at, first) = self.place(tail, k);
            // SAFETY: [at, at+first) and [0, k-first) are free space owned
            // by the producer until `tail` is published below.
            unsafe {
                self.data.write_with(at, first, |piece| fill(done, piece));
                if k > first {
                    self.data.write_with(0, k - first, |piece| fill(done + first, piece));
                }
            }
            tail += k as u64;
            self.publish(tail);
            done += k;
        }
        n
    }

    /// Producer: write `first` then `then`, both or nothing, published
    /// together (a frame's header and payload: the consumer finds the
    /// whole frame at its first look); whether they fit.
    pub fn write_whole(&self, first: &[u8], then: &[u8]) -> bool {
        let len = first.len() + then.len();
        let tail = self.my_tail.load(Ordering::Relaxed);
        if self.free(tail, len) < len {
            return false;
        }
        let at = self.offset(tail);
        if len <= PUBLISH && len <= self.cap - at {
            // In one piece before the buffer's end (most small frames): two
            // copies and one store to publish them.
            // SAFETY: [at, at + len) is free space, owned by the producer
            // until the tail is published.
            unsafe {
                self.data.put(at, first);
                self.data.put(at + first.len(), then);
            }
            self.publish(tail + len as u64);
            return true;
        }
        self.write_with(len, |at, piece| {
            // `piece` covers [at, at + n) of the two together.
            let n = piece.len();
            let head = &first[at.min(first.len())..];
            let split = head.len().min(n);
            piece[..split].copy_from_slice(&head[..split]);
            let from = (at + split).saturating_sub(first.len());
            weft::kernels::copy(&mut piece[split..], &then[from..from + n - split]);
        });
        true
    }

    /// Producer: if the consumer has read everything and a frame of `len`
    /// bytes fits before this ring's write position, claim the bytes from
    /// there to the buffer's end as padding, announced by the `N` bytes
    /// `pad(padding after them)` returns, so that the frame starts at the
    /// buffer's start, in the lines the last frames used. Whether it did.
    pub fn rewind<const N: usize>(&self, len: usize, pad: impl FnOnce(usize) -> [u8; N]) -> bool {
        let tail = self.my_tail.load(Ordering::Relaxed);
        let at = self.offset(tail);
        if at < len || self.cap - at < N {
            return false;
        }
        let head = self.head().load(Ordering::Acquire);
        self.seen_head.store(head, Ordering::Relaxed);
        if head != tail {
            return false;
        }
        // SAFETY: the ring is empty: [at, cap) is free space, owned by the
        // producer until the tail is published.
        unsafe { self.data.put(at, &pad(self.cap - at - N)) };
        self.publish(tail + (self.cap - at) as u64);
        true
    }

    /// Producer: whether the consumer has read everything written so far.
    pub fn drained(&self) -> bool {
        self.head().load(Ordering::Acquire) >= self.my_tail.load(Ordering::Relaxed)
    }

    /// Producer: whether the consumer has left room for at least a byte
    /// (the shared head is read again if the last reading showed none).
    pub fn has_room(&self) -> bool {
        self.free(self.my_tail.load(Ordering::Relaxed), 1) > 0
    }

    /// Free bytes for `want` more, the producer's `tail` given: from the
    /// last reading of the consumer's head while that shows room for them.
    fn free(&self, tail: u64, want: usize) -> usize {
        let seen = self.seen_head.load(Ordering::Relaxed);
        let free = self.cap - (tail - seen) as usize;
        if free >= want {
            return free;
        }
        let head = self.head().load(Ordering::Acquire);
        self.seen_head.store(head, Ordering::Relaxed);
        self.cap - (tail - head) as usize
    }

    /// Producer: hand the bytes up to `tail` to the consumer.
    fn publish(&self, tail: u64) {
        self.my_tail.store(tail, Ordering::Relaxed);
        self.tail().store(tail, Ordering::Release);
    }

    /// Where `n` bytes from `tail` on go: their offset, and how many fit
    /// before the end of the buffer (the rest wrap to its start).
    fn place(&self, tail: u64, n: usize) -> (usize, usize) {
        let at = self.offset(tail);
        (at, n.min(self.cap - at))
    }

    /// Where a counter's value falls in the buffer.
    fn offset(&self, counter: u64) -> usize {
        counter as usize & (self.cap - 1)
    }

    /// Consumer: read up to `dst.len()` bytes (all of them if they are
    /// there).
    pub fn read(&self, dst: &mut [u8]) -> usize {
        self.take(dst, false)
    }

    /// Consumer: [`Ring::read`] into a piece of a destination too large to
    /// stay in cache (a long message: the exchange's `TO_MEMORY_BYTES`),
    /// with stores that go past this core's caches.
    pub fn read_to_memory(&self, dst: &mut [u8]) -> usize {
        self.take(dst, true)
    }

    /// Consumer: copy up to `dst.len()` bytes (all of them if they are
    /// there), leaving them to read.
    pub fn peek(&self, dst: &mut [u8]) -> usize {
        self.peek_to(dst, false)
    }

    /// [`Ring::read`], past this core's caches if `to_memory`.
    #[inline]
    fn take(&self, dst: &mut [u8], to_memory: bool) -> usize {
        let n = self.peek_to(dst, to_memory);
        self.skip(n);
        n
    }

    /// [`Ring::peek`], past this core's caches if `to_memory`.
    #[inline]
    fn peek_to(&self, dst: &mut [u8], to_memory: bool) -> usize {
        let head = self.my_head.load(Ordering::Relaxed);
        let n = dst.len().min((self.known_tail(head, dst.len()) - head) as usize);
        self.copy_out_to(head, &mut dst[..n], to_memory);
        n
    }

    /// Consumer: if the next bytes are `first` and `then.len()` more, read
    /// them all, the latter into `then`, with one reading of the tail and
    /// one store of the head (a small frame: its header and its payload).
    pub fn read_whole<const N: usize>(&self, first: &[u8; N], then: &mut [u8]) -> Whole {
        let head = self.my_head.load(Ordering::Relaxed);
        let len = N + then.len();
        let there = (self.known_tail(head, len) - head) as usize;
        if there < N {
            return Whole::NotYet;
        }
        let mut next = [0u8; N];
        self.copy_out(head, &mut next);
        if next != *first {
            return Whole::Other;
        }
        if there < len {
            return Whole::NotYet;
        }
        self.copy_out(head + N as u64, then);
        self.hand_back(head + len as u64);
        Whole::Read
    }

    /// Consumer: copy the `dst.len()` bytes from `from` on, which the
    /// producer has published.
    #[inline]
    fn copy_out(&self, from: u64, dst: &mut [u8]) {
        self.copy_out_to(from, dst, false)
    }

    /// [`Ring::copy_out`], past this core's caches if `to_memory`.
    #[inline]
    fn copy_out_to(&self, from: u64, dst: &mut [u8], to_memory: bool) {
        let at = self.offset(from);
        let first = dst.len().min(self.cap - at);
        let (a, b) = dst.split_at_mut(first);
        // SAFETY: these bytes were published by the producer (acquire when
        // the tail was read) and stay untouched until `head` moves past them.
        unsafe {
            for (at, piece) in [(at, a), (0, b)] {
                match to_memory {
                    _ if piece.is_empty() => {}
                    true => self.data.get_to_memory(at, piece),
                    false => self.data.get(at, piece),
                }
            }
        }
    }

    /// Consumer: skip `n` bytes of padding ([`Ring::rewind`]) if they are
    /// there and run to the buffer's end, so that the next frame is read
    /// from its start; whether they did (a peer that says otherwise sent
    /// garbage).
    pub fn skip_to_start(&self, n: usize) -> bool {
        let head = self.my_head.load(Ordering::Relaxed);
        let to_end = (self.cap - self.offset(head)) & (self.cap - 1);
        let fits = n == to_end && self.known_tail(head, n) - head >= n as u64;
        if fits {
            self.hand_back(head + n as u64);
        }
        fits
    }

    /// Consumer: hand `n` bytes back to the producer (at most those
    /// waiting).
    pub fn skip(&self, n: usize) {
        if n > 0 {
            self.hand_back(self.my_head.load(Ordering::Relaxed) + n as u64);
        }
    }

    /// Consumer: the bytes before `head` are read.
    fn hand_back(&self, head: u64) {
        self.my_head.store(head, Ordering::Relaxed);
        self.head().store(head, Ordering::Release);
    }
}

/// What [`Ring::read_whole`] found next in the ring.
#[derive(Debug, PartialEq, Eq)]
pub enum Whole {
    /// The bytes asked for, now read.
    Read,
    /// Other bytes (nothing was read).
    Other,
    /// Not all of them yet (nothing was read).
    NotYet,
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A ring of `cap` bytes in `mem`, which the caller keeps while it uses
    /// the ring.
    fn ring_in(mem: &mut Vec<u128>, cap: usize) -> Ring {
        *mem = vec![0u128; footprint(cap) / 16 + 8];
        let base = mem.as_mut_ptr() as *mut u8;
        // SAFETY: the offset is under 64, inside the 128 spare bytes.
        let base = unsafe { base.add(base.align_offset(64)) };
        // SAFETY: the buffer above is large enough and 64-byte aligned.
        unsafe { Ring::at(base, cap) }
    }

    #[test]
    fn read_whole_reads_only_the_frame_it_is_given() {
        let mut mem = Vec::new();
        let ring = ring_in(&mut mem, 64);
        // Start two bytes before the buffer's end: the header wraps.
        assert_eq!(ring.write(&[0; 62]), 62);
        ring.skip(62);
        let mut out = [0u8; 5];
        assert_eq!(ring.read_whole(b"head", &mut out), Whole::NotYet, "empty");
        assert_eq!(ring.write(b"hea"), 3);
        assert_eq!(ring.read_whole(b"head", &mut out), Whole::NotYet, "part of the header");
        assert_eq!(ring.write(b"dpay"), 4);
        assert_eq!(ring.read_whole(b"heal", &mut out), Whole::Other, "another header");
        assert_eq!(ring.read_whole(b"head", &mut out), Whole::NotYet, "part of the payload");
        assert_eq!(ring.write(b"load+"), 5);
        assert_eq!(ring.read_whole(b"head", &mut out), Whole::Read);
        assert_eq!(&out, b"paylo");
        let mut rest = [0u8; 8];
        assert_eq!(ring.read(&mut rest), 3, "the bytes after the frame stay");
        assert_eq!(&rest[..3], b"ad+");
    }

    /// Stream bytes 0..=255 through a 64-byte ring, each write offering at
    /// most `piece` bytes (`write`: the offered bytes; the count written),
    /// each read taking at most 17: what comes out.
    fn stream(piece: usize, mut write: impl FnMut(&Ring, &[u8]) -> usize) -> Vec<u8> {
        let mut mem = Vec::new();
        let ring = ring_in(&mut mem, 64);
        let data: Vec<u8> = (0..=255).collect();
        let (mut sent, mut got) = (0, Vec::new());
        while got.len() < data.len() {
            sent += write(&ring, &data[sent..(sent + piece).min(data.len())]);
            let mut buf = [0u8; 17];
            let n = ring.read(&mut buf);
            got.extend_from_slice(&buf[..n]);
        }
        got
    }

    /// Reading with stores past the cache (a long message) hands over the
    /// same bytes as `read`, across wrap-arounds, in reads of any length
    /// into a destination at any alignment, and writes nothing else.
    #[test]
    fn reading_to_memory_hands_over_every_byte_in_order() {
        let mut mem = Vec::new();
        let ring = ring_in(&mut mem, 4096);
        let data: Vec<u8> = (0..50_000u32).map(|i| (i * 31 + i / 257) as u8 | 1).collect();
        let mut out = vec![0u8; data.len() + 8];
        let (dst, mut sent, mut got) = (&mut out[3..3 + data.len()], 0, 0);
        for step in 0.. {
            if got == data.len() {
                break;
            }
            sent += ring.write(&data[sent..(sent + 1500).min(data.len())]);
            let want = [1000, 7, 3000, 64, 65, 1][step % 6];
            got += ring.read_to_memory(&mut dst[got..(got + want).min(data.len())]);
        }
        assert!(out[3..3 + data.len()] == data[..], "the bytes read");
        assert!(out[..3].iter().chain(&out[3 + data.len()..]).all(|b| *b == 0), "wrote outside");
    }

    #[test]
    fn wraps_around_and_hands_over_every_byte_in_order() {
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(stream(23, |ring, src| ring.write(src)), all);
        // Filled in place, in the pieces the free space comes in.
        let filled = stream(29, |ring, src| ring.write_with(src.len(), |at, piece| piece.copy_from_slice(&src[at..][..piece.len()])));
        assert_eq!(filled, all);
        // Whole frames (a 3-byte prefix, then the rest), split anywhere by
        // the wrap-around; one that does not fit writes nothing.
        let framed = stream(29, |ring, src| {
            let (first, then) = src.split_at(src.len().min(3));
            if ring.write_whole(first, then) {
                src.len()
            } else {
                0
            }
        });
        assert_eq!(framed, all);
    }

    /// Each side remembers the other's counter, but a read or write still
    /// takes all that is there (or free) when it wants more.
    #[test]
    fn remembered_counters_never_cut_a_read_or_write_short() {
        let mut mem = Vec::new();
        let ring = ring_in(&mut mem, 64);
        assert_eq!(ring.write(&[1; 40]), 40);
        let mut buf = [0u8; 64];
        assert_eq!(ring.read(&mut buf[..10]), 10, "the consumer now remembers a tail of 40");
        assert_eq!(ring.write(&[2; 34]), 34, "the producer reads the head again: 34 free, not 24");
        assert_eq!(ring.peek(&mut buf), 64);
        assert_eq!(ring.read(&mut buf), 64, "past the remembered tail");
        assert_eq!(&buf[..30], &[1; 30]);
        assert_eq!(&buf[30..], &[2; 34]);
    }

    /// An empty ring pads to its end so that the next frame starts at its
    /// start, if the frame fits before where it would have gone; the
    /// consumer skips exactly that padding and reads the frame.
    #[test]
    fn an_empty_ring_rewinds_to_its_start_through_padding() {
        let mut mem = Vec::new();
        let ring = ring_in(&mut mem, 64);
        assert!(!ring.rewind(8, |_| [0u8; 4]), "already at the start");
        assert_eq!(ring.write(&[1; 20]), 20);
        assert!(!ring.rewind(8, |_| [0u8; 4]), "not empty");
        let mut buf = [0u8; 64];
        assert_eq!(ring.read(&mut buf[..20]), 20);
        assert!(!ring.rewind(21, |_| [0u8; 4]), "a frame that does not fit before offset 20");
        assert!(ring.rewind(20, |pad| [pad as u8; 4]));
        assert_eq!(ring.write(&[3; 20]), 20, "the padding left 20 bytes free, at the start");
        let mut header = [0u8; 4];
        assert_eq!(ring.read(&mut header), 4);
        assert_eq!(header, [40; 4], "64 - 20 - 4 bytes of padding follow the header");
        assert!(!ring.skip_to_start(39), "short of the end");
        assert!(!ring.skip_to_start(41), "past the end");
        assert!(!ring.skip_to_start(usize::MAX), "past the end");
        assert!(ring.skip_to_start(40));
        assert_eq!(ring.read(&mut buf), 20);
        assert_eq!(&buf[..20], &[3; 20]);
    }

    /// Padding is skipped only once all of it is published.
    #[test]
    fn padding_is_skipped_only_once_it_is_there() {
        let mut mem = Vec::new();
        let ring = ring_in(&mut mem, 64);
        assert_eq!(ring.write(&[1; 40]), 40);
        let mut buf = [0u8; 40];
        assert_eq!(ring.read(&mut buf), 40);
        assert!(!ring.skip_to_start(24), "nothing published after offset 40");
        assert_eq!(ring.write(&[2; 10]), 10);
        assert!(!ring.skip_to_start(24), "10 of the 24 bytes");
        assert_eq!(ring.write(&[2; 14]), 14);
        assert!(ring.skip_to_start(24));
        assert_eq!(ring.available(), 0);
    }
}

/// Model checks of the ring protocol (`RUSTFLAGS="--cfg loom"`): every
/// interleaving of a producer and a consumer, with each data byte a
/// tracked cell, so a counter published too early is a reported race.
#[cfg(all(test, loom))]
pub(crate) mod loom_tests {
    use super::*;
    use loom::cell::UnsafeCell;

    /// Bytes as loom-tracked cells; clones share them (the fastbox model
    /// gives both ranks a view of each slot).
    #[derive(Clone)]
    pub(crate) struct Cells(pub(crate) std::sync::Arc<Vec<UnsafeCell<u8>>>);

    impl Cells {
        pub(crate) fn new(n: usize) -> Cells {
            Cells(std::sync::Arc::new((0..n).map(|_| UnsafeCell::new(0)).collect()))
        }
    }

    impl Bytes for Cells {
        unsafe fn put(&self, at: usize, src: &[u8]) {
            for (i, b) in src.iter().enumerate() {
                // SAFETY: loom checks that no other access overlaps.
                self.0[at + i].with_mut(|p| unsafe { *p = *b });
            }
        }
        unsafe fn get(&self, at: usize, dst: &mut [u8]) {
            for (i, b) in dst.iter_mut().enumerate() {
                // SAFETY: as above.
                *b = self.0[at + i].with(|p| unsafe { *p });
            }
        }
    }

    #[test]
    fn loom_ring_hands_over_bytes_in_order_across_wraparound() {
        loom::model(|| {
            let cap = 4;
            let head = Box::leak(Box::new(Counter(AtomicU64::new(0))));
            let tail = Box::leak(Box::new(Counter(AtomicU64::new(0))));
            // SAFETY: leaked, so live for ever; both start at 0.
            let ring = loom::sync::Arc::new(unsafe { Ring::over(head, tail, Cells::new(cap), cap) });
            let producer = {
                let ring = ring.clone();
                loom::thread::spawn(move || {
                    let data = [1u8, 2, 3, 4, 5];
                    let mut sent = 0;
                    while sent < data.len() {
                        // Copies and filled writes alternate: both publish alike.
                        let piece = &data[sent..(sent + 2).min(data.len())];
                        let n = if sent % 2 == 0 {
                            ring.write(piece)
                        } else {
                            ring.write_with(piece.len(), |at, dst| dst.copy_from_slice(&piece[at..][..dst.len()]))
                        };
                        if n == 0 {
                            loom::thread::yield_now();
                        }
                        sent += n;
                    }
                })
            };
            let mut got = Vec::new();
            while got.len() < 5 {
                let mut buf = [0u8; 2];
                let n = ring.read(&mut buf);
                if n == 0 {
                    loom::thread::yield_now();
                }
                got.extend_from_slice(&buf[..n]);
            }
            producer.join().unwrap();
            assert_eq!(got, [1, 2, 3, 4, 5]);
        });
    }
}
