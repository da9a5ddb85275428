//! A single-producer single-consumer byte ring in shared memory. The
//! producer owns `tail` and the bytes after it; the consumer owns `head`.
//! Release/acquire on the counters hands bytes from one to the other.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters, each on its own cache line.
#[repr(C, align(64))]
pub struct Counter(pub AtomicU64);

/// Where one ring lives in the segment.
pub struct Ring {
    head: *const Counter,
    tail: *const Counter,
    data: *mut u8,
    cap: usize,
}

// SAFETY: see the module doc: each side touches only what it owns.
unsafe impl Send for Ring {}
// SAFETY: as above.
unsafe impl Sync for Ring {}

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
        Ring { head: at as *const Counter, tail: at.add(c) as *const Counter, data: at.add(2 * c), cap }
    }

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

    /// Producer: copy as much of `src` as fits; bytes written.
    pub fn write(&self, src: &[u8]) -> usize {
        let tail = self.tail().load(Ordering::Relaxed);
        let free = self.cap - (tail - self.head().load(Ordering::Acquire)) as usize;
        let n = src.len().min(free);
        if n == 0 {
            return 0;
        }
        let at = tail as usize % self.cap;
        let first = n.min(self.cap - at);
        // SAFETY: [at, at+first) and [0, n-first) are free space owned by the
        // producer until `tail` is published below.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.data.add(at), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), self.data, n - first);
        }
        self.tail().store(tail + n as u64, Ordering::Release);
        n
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
            std::ptr::copy_nonoverlapping(self.data.add(at), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(self.data, dst.as_mut_ptr().add(first), n - first);
        }
        self.head().store(head + n as u64, Ordering::Release);
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wraps_around_and_hands_over_every_byte_in_order() {
        let cap = 64;
        let mut mem = vec![0u128; footprint(cap) / 16 + 8];
        let base = mem.as_mut_ptr() as *mut u8;
        let base = unsafe { base.add(base.align_offset(64)) };
        // SAFETY: the buffer above is large enough and 64-byte aligned.
        let ring = unsafe { Ring::at(base, cap) };
        let data: Vec<u8> = (0..=255).collect();
        let (mut sent, mut got) = (0, Vec::new());
        while got.len() < data.len() {
            sent += ring.write(&data[sent..(sent + 23).min(data.len())]);
            let mut buf = [0u8; 17];
            let n = ring.read(&mut buf);
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got, data);
    }
}
