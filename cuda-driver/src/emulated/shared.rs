//! memfd mappings: the emulation's device memory and events, which other
//! processes open through `/proc/PID/fd/FD` as CUDA IPC would let them.

use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};
use std::num::NonZeroUsize;
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use weft::{Error, Result};

/// One shared mapping; unmapped on drop.
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    /// Kept open while the mapping is exported (peers open it by number).
    fd: OwnedFd,
    /// Unique per allocation on this host (pid and a counter), so that a
    /// handle names one allocation even when its fd number is reused.
    id: u64,
}

// SAFETY: plain shared memory; who writes which bytes when is ordered by the
// emulated streams and events, as on a GPU.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

const MAGIC: &[u8; 4] = b"WEMU";

fn os(what: &str, e: nix::errno::Errno) -> Error {
    Error::backend(format!("cuda emulation: {what}: {e}"))
}

impl Mapping {
    /// A new zeroed mapping of `len` bytes (at least one page).
    pub fn create(len: usize) -> Result<Mapping> {
        let fd = memfd_create("weft-cuda-emulation", MFdFlags::MFD_CLOEXEC).map_err(|e| os("memfd_create", e))?;
        let len = len.max(1);
        nix::unistd::ftruncate(&fd, len as i64).map_err(|e| os("ftruncate", e))?;
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let id = (u64::from(std::process::id()) << 32) | NEXT.fetch_add(1, Ordering::Relaxed);
        Self::map(fd, len, id)
    }

    fn map(fd: OwnedFd, len: usize, id: u64) -> Result<Mapping> {
        let size = NonZeroUsize::new(len).ok_or_else(|| Error::invalid("cuda emulation: empty mapping"))?;
        // SAFETY: a new shared mapping of a memfd of at least `len` bytes.
        let ptr = unsafe { mmap(None, size, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE, MapFlags::MAP_SHARED, &fd, 0) }
            .map_err(|e| os("mmap", e))?;
        Ok(Mapping { ptr: ptr.cast(), len, fd, id })
    }

    /// The first byte.
    pub fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The handle another process opens this mapping with.
    pub fn handle(&self) -> Vec<u8> {
        let mut h = MAGIC.to_vec();
        h.extend_from_slice(&std::process::id().to_le_bytes());
        h.extend_from_slice(&self.fd.as_raw_fd().to_le_bytes());
        h.extend_from_slice(&(self.len as u64).to_le_bytes());
        h.extend_from_slice(&self.id.to_le_bytes());
        h
    }

    /// Open a mapping from its handle (the exporting process must be alive).
    pub fn open(handle: &[u8]) -> Result<Mapping> {
        if handle.len() != 28 || &handle[..4] != MAGIC {
            return Err(Error::invalid("cuda emulation: not an emulated IPC handle"));
        }
        let pid = u32::from_le_bytes(handle[4..8].try_into().expect("4 bytes"));
        let fd = i32::from_le_bytes(handle[8..12].try_into().expect("4 bytes"));
        let len = u64::from_le_bytes(handle[12..20].try_into().expect("8 bytes")) as usize;
        let id = u64::from_le_bytes(handle[20..28].try_into().expect("8 bytes"));
        let path = format!("/proc/{pid}/fd/{fd}");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| Error::backend(format!("cuda emulation: cannot open IPC handle {path}: {e}")))?;
        Self::map(OwnedFd::from(file), len, id)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped by `map` with this length; the owner of the mapping
        // guarantees no stream uses it any more.
        let _ = unsafe { munmap(self.ptr.cast(), self.len) };
    }
}
