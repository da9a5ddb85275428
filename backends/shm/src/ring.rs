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
        // SAFETY: the caller's contract; `src` is local memory, not the ring.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.0.add(at), src.len()) }
    }
    unsafe fn get(&self, at: usize, dst: &mut [u8]) {
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(self.0.add(at), dst.as_mut_ptr(), dst.len()) }
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
pub struct Ring<B: Bytes = RawBytes> {
    head: *const Counter,
    tail: *const Counter,
    data: B,
    cap: usize,
}

// SAFETY: see the module doc: each side touches only what it owns.
unsafe impl<B: Bytes> Send for Ring<B> {}
// SAFETY: as above.
unsafe impl<B: Bytes> Sync for Ring<B> {}

/// The producer publishes what it wrote every this many bytes: a 1 MiB
/// message published only once copied kept a receiver that had caught up
/// with nothing to read for longer than it spins, so it slept and paid a
/// wake-up (W=2 sendrecv 1 MiB: median 180 us against a best of 55).
pub const PUBLISH: usize = 64 << 10;

/// Bytes a ring of `cap` data bytes takes in the segment.
pub const fn footprint(cap: usize) -> usize {
    2 * std::mem::size_of::<Counter>() + cap
}

impl Ring {
    /// The ring at `at` (a `footprint(cap)` region, zeroed at creation).
    ///
    /// # Safety
    /// `at` must point into a live mapping with `footprint(cap)` bytes,
    /// 64-byte aligned, used by one producer and one consumer only.
    pub unsafe fn at(at: *mut u8, cap: usize) -> Ring {
        let c = std::mem::size_of::<Counter>();
        Ring { head: at as *const Counter, tail: at.add(c) as *const Counter, data: RawBytes(at.add(2 * c)), cap }
    }
}

impl<B: Bytes> Ring<B> {
    fn head(&self) -> &AtomicU64 {
        // SAFETY: points into the live mapping (constructor contract).
        unsafe { &(*self.head).0 }
    }
    fn tail(&self) -> &AtomicU64 {
        // SAFETY: as above.
        unsafe { &(*self.tail).0 }
    }

    /// Bytes waiting to be read.
    pub fn available(&self) -> usize {
        (self.tail().load(Ordering::Acquire) - self.head().load(Ordering::Relaxed)) as usize
    }

    /// Producer: copy as much of `src` as fits; bytes written. The bytes
    /// are published every [`PUBLISH`] bytes, so the consumer copies out
    /// while the rest is copied in.
    pub fn write(&self, src: &[u8]) -> usize {
        self.write_with(src.len(), |at, piece| piece.copy_from_slice(&src[at..at + piece.len()]))
    }

    /// Producer: write as much of `len` bytes as fits, each piece of free
    /// space filled by `fill(offset, piece)` (offset from the first of the
    /// `len` bytes), publishing every [`PUBLISH`] bytes; bytes written.
    pub fn write_with(&self, len: usize, mut fill: impl FnMut(usize, &mut [u8])) -> usize {
        let mut tail = self.tail().load(Ordering::Relaxed);
        let n = len.min(self.free(tail));
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
            self.tail().store(tail, Ordering::Release);
            done += k;
        }
        n
    }

    /// Free bytes, the producer's `tail` given.
    fn free(&self, tail: u64) -> usize {
        self.cap - (tail - self.head().load(Ordering::Acquire)) as usize
    }

    /// Where `n` bytes from `tail` on go: their offset, and how many fit
    /// before the end of the buffer (the rest wrap to its start).
    fn place(&self, tail: u64, n: usize) -> (usize, usize) {
        let at = tail as usize % self.cap;
        (at, n.min(self.cap - at))
    }

    /// Consumer: read up to `dst.len()` bytes.
    pub fn read(&self, dst: &mut [u8]) -> usize {
        let head = self.head().load(Ordering::Relaxed);
        let n = dst.len().min((self.tail().load(Ordering::Acquire) - head) as usize);
        if n == 0 {
            return 0;
        }
        let at = head as usize % self.cap;
        let first = n.min(self.cap - at);
        // SAFETY: these bytes were published by the producer (acquire above)
        // and stay untouched until `head` moves past them.
        unsafe {
            self.data.get(at, &mut dst[..first]);
            self.data.get(0, &mut dst[first..n]);
        }
        self.head().store(head + n as u64, Ordering::Release);
        n
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Stream bytes 0..=255 through a 64-byte ring, each write offering at
    /// most `piece` bytes (`write`: the offered bytes; the count written),
    /// each read taking at most 17: what comes out.
    fn stream(piece: usize, mut write: impl FnMut(&Ring, &[u8]) -> usize) -> Vec<u8> {
        let cap = 64;
        let mut mem = vec![0u128; footprint(cap) / 16 + 8];
        let base = mem.as_mut_ptr() as *mut u8;
        // SAFETY: the offset is under 64, inside the 128 spare bytes.
        let base = unsafe { base.add(base.align_offset(64)) };
        // SAFETY: the buffer above is large enough and 64-byte aligned.
        let ring = unsafe { Ring::at(base, cap) };
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

    #[test]
    fn wraps_around_and_hands_over_every_byte_in_order() {
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(stream(23, |ring, src| ring.write(src)), all);
        // Filled in place, in the pieces the free space comes in.
        let filled = stream(29, |ring, src| ring.write_with(src.len(), |at, piece| piece.copy_from_slice(&src[at..][..piece.len()])));
        assert_eq!(filled, all);
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
            let cap = 3;
            let head = Box::leak(Box::new(Counter(AtomicU64::new(0))));
            let tail = Box::leak(Box::new(Counter(AtomicU64::new(0))));
            let ring = loom::sync::Arc::new(Ring { head, tail, data: Cells::new(cap), cap });
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
