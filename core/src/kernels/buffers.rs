//! Scratch space for the algorithms: 16-byte aligned buffers, and a
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
    /// At least `len` bytes, aligned to 16.
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

/// A zeroed byte buffer aligned to 16 bytes, for scratch space that kernels
/// read as any dtype.
pub struct AlignedBuf {
    words: Vec<u128>,
    len: usize,
}

impl AlignedBuf {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        AlignedBuf { words: vec![0u128; len.div_ceil(16)], len }
    }
    /// A copy of `data`.
    pub fn copy_of(data: &[u8]) -> Self {
        let mut b = Self::zeroed(data.len());
        b.as_mut().copy_from_slice(data);
        b
    }
}

impl AlignedBuf {
    fn capacity(&self) -> usize {
        self.words.len() * 16
    }
    fn as_ref_full(&self) -> &[u8] {
        // SAFETY: the Vec<u128> holds capacity() bytes.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.capacity()) }
    }
    fn as_mut_full(&mut self) -> &mut [u8] {
        // SAFETY: as above, unique through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut u8, self.capacity()) }
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the Vec<u128> holds at least len bytes; u8 has no alignment needs.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.len) }
    }
}
impl AsMut<[u8]> for AlignedBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, unique through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut u8, self.len) }
    }
}
