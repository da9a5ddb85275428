//! A shared-memory segment (the group's, a window's): an anonymous file
//! (memfd) that one rank (rank 0, for the group's) creates and every other rank opens through
//! `/proc/<pid>/fd/<n>` while rank 0 holds it open. It never has a name in
//! /dev/shm, so no process killed at any moment of setup can leave one
//! behind: the memory goes when the last process that maps it exits.

use nix::fcntl::OFlag;
use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::sys::mman::{madvise, mmap, munmap, MapFlags, MmapAdvise, ProtFlags};
use nix::sys::stat::Mode;
use std::num::NonZeroUsize;
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;
use weft::{Error, Result};

/// A mapping of the group's segment.
pub struct Segment {
    ptr: NonNull<u8>,
    len: usize,
    /// The creator's descriptor, open until every rank has opened its own.
    fd: Option<OwnedFd>,
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

/// The name a segment is created with (memfd names are only labels: the
/// ranks opening it check it, so a reused pid or descriptor number is
/// never mistaken for the segment).
fn label(tag: &str) -> String {
    format!("weft-shm-{tag}")
}

/// Map `len` bytes of `fd`, shared.
fn map(fd: &OwnedFd, len: usize) -> Result<NonNull<u8>> {
    let size = NonZeroUsize::new(len).ok_or_else(|| Error::invalid("shm: empty segment"))?;
    // SAFETY: a fresh shared mapping of a file we hold, of the size its
    // creator set (checked by `open`); nothing else aliases it in this
    // process.
    let ptr = unsafe { mmap(None, size, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE, MapFlags::MAP_SHARED, fd, 0) }
        .map_err(|e| os("mmap", e))?;
    Ok(ptr.cast())
}

impl Segment {
    /// Create a segment of `len` bytes labelled with `tag` (rank 0), zeroed,
    /// its memory reserved, and map it.
    pub fn create(tag: &str, len: usize) -> Result<Segment> {
        let fd = memfd_create(label(tag).as_str(), MFdFlags::MFD_CLOEXEC).map_err(|e| os("memfd_create", e))?;
        nix::unistd::ftruncate(&fd, len as i64).map_err(|e| os("ftruncate", e))?;
        // Reserve the pages now: too little shared memory is an error here,
        // not a SIGBUS when a ring first touches a page mid-transfer.
        nix::fcntl::posix_fallocate(&fd, 0, len as i64)
            .map_err(|e| Error::unsupported(format!("shm: cannot reserve {len} bytes of shared memory ({e})")))?;
        let ptr = map(&fd, len)?;
        Ok(Segment { ptr, len, fd: Some(fd) })
    }

    /// Open and map the segment labelled `tag` of `len` bytes that rank
    /// `owner`'s process `pid` created and holds as its descriptor `fd`.
    pub fn open(owner: usize, pid: u32, fd: i32, tag: &str, len: usize) -> Result<Segment> {
        let path = format!("/proc/{pid}/fd/{fd}");
        let file = nix::fcntl::open(path.as_str(), OFlag::O_RDWR | OFlag::O_CLOEXEC, Mode::empty()).map_err(|e| match e {
            nix::errno::Errno::ENOENT => {
                Error::backend(format!("shm: rank {owner} (pid {pid}) exited or closed the segment before this rank opened it"))
            }
            e => Error::unsupported(format!("shm: cannot open rank {owner}'s segment ({path}: {e})")),
        })?;
        // What was opened: the name it was created with, and its size.
        let opened = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).unwrap_or_default();
        let size = nix::sys::stat::fstat(&file).map(|st| st.st_size as usize).unwrap_or(0);
        if opened.to_string_lossy() != format!("/memfd:{} (deleted)", label(tag)) || size != len {
            return Err(Error::backend(format!(
                "shm: {path} is not rank {owner}'s segment ({} of {size} bytes, expected {} of {len})",
                opened.display(),
                label(tag)
            )));
        }
        let ptr = map(&file, len)?;
        Ok(Segment { ptr, len, fd: None })
    }

    /// The creator's descriptor number, for the others to open (`None` on
    /// the others, and once closed).
    pub fn creator_fd(&self) -> Option<i32> {
        self.fd.as_ref().map(|fd| fd.as_raw_fd())
    }

    /// Every rank has opened the segment: close the creator's descriptor
    /// (the mappings keep the memory).
    pub fn close_fd(&mut self) {
        self.fd = None;
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
    /// (Linux 5.14+; elsewhere they fill on first touch as before): a
    /// page's first touch is costly on a VM, so a fresh group's first
    /// mid-size ops ran several times slower until their rings had wrapped
    /// once (figures: bench/RESULTS.md, "Measurements behind code comments").
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
