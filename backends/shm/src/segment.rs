//! One shared-memory segment per group: created by rank 0 under a name
//! unique to the group, mapped by every rank, unlinked as soon as all have
//! mapped it (so nothing is left in /dev/shm, even after SIGKILL).

use nix::fcntl::OFlag;
use nix::sys::mman::{madvise, mmap, munmap, shm_open, shm_unlink, MapFlags, MmapAdvise, ProtFlags};
use nix::sys::stat::Mode;
use std::num::NonZeroUsize;
use std::ptr::NonNull;
use weft::{Error, Result};

/// A mapping of the group's segment.
pub struct Segment {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; every access to it goes
// through atomics or through ring protocols that hand ownership of bytes
// between exactly one writer and one reader.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

fn os(what: &str, e: nix::errno::Errno) -> Error {
    Error::backend(format!("shm: {what}: {e}"))
}

impl Segment {
    /// Create (rank 0) or open the segment `name` of `len` bytes and map it.
    pub fn map(name: &str, len: usize, create: bool) -> Result<Segment> {
        let flags = if create { OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR } else { OFlag::O_RDWR };
        let fd = shm_open(name, flags, Mode::S_IRUSR | Mode::S_IWUSR).map_err(|e| os(&format!("shm_open {name}"), e))?;
        if create {
            nix::unistd::ftruncate(&fd, len as i64).map_err(|e| os("ftruncate", e))?;
            // Reserve the pages now: a full /dev/shm is an error here, not a
            // SIGBUS when a ring first touches a page mid-transfer.
            nix::fcntl::posix_fallocate(&fd, 0, len as i64).map_err(|e| {
                let _ = shm_unlink(name);
                Error::unsupported(format!("shm: cannot reserve {len} bytes of shared memory ({e}); /dev/shm too small?"))
            })?;
        }
        let size = NonZeroUsize::new(len).ok_or_else(|| Error::invalid("shm: empty segment"))?;
        // SAFETY: a fresh shared mapping of a file we just opened, of the
        // size the creator set; nothing else aliases it in this process.
        let ptr = unsafe { mmap(None, size, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE, MapFlags::MAP_SHARED, &fd, 0) }
            .map_err(|e| os("mmap", e))?;
        Ok(Segment { ptr: ptr.cast(), len })
    }

    /// Remove the name (the memory lives on while mapped).
    pub fn unlink(name: &str) {
        let _ = shm_unlink(name);
    }

    /// The first byte.
    pub fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Fill this process's page tables for `len` bytes from `offset` now
    /// (Linux 5.14+; elsewhere they fill on first touch as before). A
    /// page's first touch costs about 2 µs on a VM, so a fresh group's
    /// first mid-size ops ran several times slower until their rings had
    /// wrapped once.
    pub fn prefault(&self, offset: usize, len: usize) {
        const PAGE: usize = 4096;
        let start = offset / PAGE * PAGE;
        let end = (offset + len).next_multiple_of(PAGE).min(self.len);
        if start >= end {
            return;
        }
        // SAFETY: a page-aligned range inside this mapping; populating
        // changes no byte of it.
        let at = unsafe { NonNull::new_unchecked(self.ptr.as_ptr().add(start)) };
        // SAFETY: as above.
        let _ = unsafe { madvise(at.cast(), end - start, MmapAdvise::MADV_POPULATE_WRITE) };
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: this mapping was created by `map` with this length and
        // nothing refers to it once the backend is dropped.
        let _ = unsafe { munmap(self.ptr.cast(), self.len) };
    }
}

/// Bytes free in /dev/shm (0 if unknown).
pub fn available() -> usize {
    nix::sys::statvfs::statvfs("/dev/shm").map(|s| (s.blocks_available() * s.fragment_size()) as usize).unwrap_or(0)
}
