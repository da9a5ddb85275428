//! Scratch space for the algorithms: page- or line-aligned buffers, and a
//! per-thread pool that lends them out so the hot path does not allocate.

/// Reusable scratch space for the algorithms: buffers go back to a
/// per-thread pool when dropped, so the hot path does not allocate (and
/// fault in fresh pages) on every op. Contents are unspecified on reuse:
/// callers write before they read.
pub struct Scratch {
    buf: Option<AlignedBuf>,
    len: usize,
}

thread_local! {
    static POOL: std::cell::RefCell<Vec<AlignedBuf>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Buffers kept per thread, and the largest one kept.
const POOL_BUFFERS: usize = 4;
const POOL_MAX_BYTES: usize = 512 << 20;

impl Scratch {
    /// At least `len` bytes, aligned as [`AlignedBuf`] is.
    pub fn take(len: usize) -> Scratch {
        let reused = POOL.with(|p| {
            let mut p = p.borrow_mut();
            // The smallest pooled buffer that is large enough.
            let best = p.iter().enumerate().filter(|(_, b)| b.capacity() >= len).min_by_key(|(_, b)| b.capacity()).map(|(i, _)| i);
            best.map(|i| p.swap_remove(i))
        });
        Scratch { buf: Some(reused.unwrap_or_else(|| AlignedBuf::zeroed(len))), len }
    }
}

impl Scratch {
    /// Keep only the first `len` bytes (no copy).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

impl std::ops::Deref for Scratch {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf.as_ref().expect("present until drop").as_ref_full()[..self.len]
    }
}
impl std::ops::DerefMut for Scratch {
    fn deref_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.buf.as_mut().expect("present until drop").as_mut_full()[..len]
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            if b.capacity() <= POOL_MAX_BYTES {
                POOL.with(|p| {
                    let mut p = p.borrow_mut();
                    if p.len() >= POOL_BUFFERS {
                        // Keep the largest buffers.
                        if let Some((i, _)) = p.iter().enumerate().min_by_key(|(_, x)| x.capacity()) {
                            if p[i].capacity() < b.capacity() {
                                p[i] = b;
                            }
                        }
                    } else {
                        p.push(b);
                    }
                });
            }
        }
    }
}

/// A zeroed byte buffer for scratch space that kernels read as any dtype:
/// page-aligned from a page up, else cache-line aligned.
///
/// Why pages: user buffers usually start on a page (or a cache line), and
/// a copy whose destination sits a few bytes off its source's alignment
/// runs at half speed: scratch 16 bytes past a page is where glibc's
/// `malloc` puts blocks of 128 KiB and up (figures: bench/RESULTS.md, "Measurements behind code comments").
pub struct AlignedBuf {
    /// The allocation (`alloc_zeroed` with [`AlignedBuf::raw_layout`]).
    raw: std::ptr::NonNull<u8>,
    /// Where the buffer starts in it.
    offset: usize,
    cap: usize,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation outright (like a Vec<u8>).
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only reads.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// The start alignment of a buffer of `cap` bytes.
    fn align(cap: usize) -> usize {
        if cap >= 4096 {
            4096
        } else {
            64
        }
    }
    /// The allocation for `cap` bytes: 16-byte aligned with room to start
    /// on `align(cap)`, so that the allocator's zeroed allocation (`calloc`:
    /// fresh zero pages, faulted in as touched) serves; asking it for page
    /// alignment meant `memset` of the whole buffer on every allocation.
    fn raw_layout(cap: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(cap + Self::align(cap) - 16, 16).expect("scratch sizes fit a layout")
    }
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        let cap = len.max(1).next_multiple_of(64);
        let layout = Self::raw_layout(cap);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let raw = std::ptr::NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        let offset = (raw.as_ptr() as usize).next_multiple_of(Self::align(cap)) - raw.as_ptr() as usize;
        AlignedBuf { raw, offset, cap, len }
    }
    /// A copy of `data`.
    pub fn copy_of(data: &[u8]) -> Self {
        let mut b = Self::zeroed(data.len());
        b.as_mut().copy_from_slice(data);
        b
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.raw.as_ptr(), Self::raw_layout(self.cap)) }
    }
}

impl AlignedBuf {
    fn capacity(&self) -> usize {
        self.cap
    }
    fn as_ref_full(&self) -> &[u8] {
        // SAFETY: the allocation holds `offset + cap` initialised (zeroed)
        // bytes: offset < align(cap) - 15, and 16 | the allocation's start.
        unsafe { std::slice::from_raw_parts(self.raw.as_ptr().add(self.offset), self.cap) }
    }
    fn as_mut_full(&mut self) -> &mut [u8] {
        // SAFETY: as above, unique through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.raw.as_ptr().add(self.offset), self.cap) }
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        &self.as_ref_full()[..self.len]
    }
}
impl AsMut<[u8]> for AlignedBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.as_mut_full()[..len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_starts_on_a_page_or_a_line_and_is_zeroed_when_new() {
        for (len, align) in [(1, 64), (100, 64), (4096, 4096), (128 << 10, 4096), ((1 << 20) + 3, 4096)] {
            let b = AlignedBuf::zeroed(len);
            assert_eq!(b.as_ref().len(), len);
            assert_eq!(b.as_ref().as_ptr() as usize % align, 0, "{len} bytes aligned to {align}");
            assert!(b.as_ref().iter().all(|x| *x == 0));
        }
        assert_eq!(AlignedBuf::copy_of(&[1, 2, 3]).as_ref(), &[1, 2, 3]);
        assert_eq!(AlignedBuf::zeroed(0).as_ref().len(), 0);
        let mut s = Scratch::take(200 << 10);
        assert_eq!(s.as_ptr() as usize % 4096, 0);
        s[0] = 7;
        drop(s);
        // Reused from the pool: still on a page.
        assert_eq!(Scratch::take(150 << 10).as_ptr() as usize % 4096, 0);
    }
}
