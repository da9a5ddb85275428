//! Window memory: a view of registered bytes (this rank's, or a mapped
//! peer's), and the heap allocation windows over messages register.

use crate::error::{Error, Result};
use crate::tensor::Device;
use std::marker::PhantomData;
use std::ptr::NonNull;

/// Registered bytes of a window, borrowed from it: this rank's
/// ([`super::Window::local`]) or a peer's mapped here
/// ([`super::Window::map_remote`]). Peers may write them at any time
/// (puts), so host bytes are read and written by copies and a slice of
/// them is `unsafe`, as in MPI's RMA. Device memory is an address, for
/// device copies and kernels.
#[derive(Clone, Copy)]
pub struct WindowMemory<'w> {
    ptr: *mut u8,
    len: usize,
    device: Device,
    _window: PhantomData<&'w ()>,
}

// SAFETY: a view of memory that stays mapped for 'w; copies in and out
// are what a put or get from another process does too.
unsafe impl Send for WindowMemory<'_> {}
// SAFETY: as above.
unsafe impl Sync for WindowMemory<'_> {}

impl WindowMemory<'_> {
    /// A view of `len` bytes at `ptr` on `device`.
    ///
    /// # Safety
    /// They stay mapped (readable and writable) for the view's lifetime.
    pub(crate) unsafe fn new(ptr: *mut u8, len: usize, device: Device) -> Self {
        WindowMemory { ptr, len, device, _window: PhantomData }
    }

    /// Bytes registered.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether none are.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The first byte's address (a device address on a device).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    /// Where the bytes live.
    pub fn device(&self) -> Device {
        self.device
    }

    fn range(&self, offset: usize, len: usize) -> Result<()> {
        if self.device != Device::Cpu {
            return Err(Error::invalid(format!("window memory on {} is not host memory: copy it on the device", self.device)));
        }
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::invalid(format!("{len} bytes at offset {offset} lie outside the window's {} bytes", self.len)));
        }
        Ok(())
    }

    /// Copy the bytes at `offset` into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.range(offset, dst.len())?;
        // SAFETY: inside the mapped bytes (checked); `dst` is the caller's
        // own buffer, which may only overlap them through an unsafe slice
        // (hence `copy`, not `copy_nonoverlapping`).
        unsafe { std::ptr::copy(self.ptr.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copy `src` to `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.range(offset, src.len())?;
        // SAFETY: as in `read`.
        unsafe { std::ptr::copy(src.as_ptr(), self.ptr.add(offset), src.len()) };
        Ok(())
    }

    /// The bytes as a slice.
    ///
    /// # Safety
    /// Host memory, which no put, get or other view writes while the slice
    /// is used (a signal that arrived orders the origin's earlier puts
    /// before it).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        if self.len == 0 || self.device != Device::Cpu {
            return &mut [];
        }
        // SAFETY: mapped for the view's lifetime; exclusive use is the
        // caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl std::fmt::Debug for WindowMemory<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WindowMemory({:p}, {} bytes)", self.ptr, self.len)
    }
}

/// Zeroed heap bytes, 64-byte aligned: what a window over messages
/// registers. Written through raw pointers only (by the transport, as
/// puts land, and by views).
pub(crate) struct Heap {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: plain bytes; every access is through raw pointers, coordinated
// by the window protocol (and by the user for local access).
unsafe impl Send for Heap {}
// SAFETY: as above.
unsafe impl Sync for Heap {}

const ALIGN: usize = 64;

impl Heap {
    /// `len` zeroed bytes.
    pub(crate) fn zeroed(len: usize) -> Result<Heap> {
        if len == 0 {
            return Ok(Heap { ptr: NonNull::<[u8; ALIGN]>::dangling().cast(), len });
        }
        let layout = std::alloc::Layout::from_size_align(len, ALIGN).map_err(|_| Error::invalid(format!("a window of {len} bytes")))?;
        // SAFETY: a layout of non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::backend(format!("cannot allocate a window of {len} bytes")))?;
        Ok(Heap { ptr, len })
    }

    /// The first byte.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    /// Bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Heap {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated by `zeroed` with this layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), std::alloc::Layout::from_size_align_unchecked(self.len, ALIGN)) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_copy_in_range_and_refuse_beyond() {
        let heap = Heap::zeroed(100).unwrap();
        // SAFETY: the heap outlives the view.
        let v = unsafe { WindowMemory::new(heap.ptr(), heap.len(), Device::Cpu) };
        v.write(96, &[1, 2, 3, 4]).unwrap();
        let mut out = [0u8; 5];
        v.read(95, &mut out).unwrap();
        assert_eq!(out, [0, 1, 2, 3, 4]);
        assert!(v.write(97, &[0; 4]).is_err());
        assert!(v.read(usize::MAX, &mut [0; 2]).is_err());
        assert!(v.read(100, &mut []).is_ok());
        assert_eq!(heap.ptr() as usize % ALIGN, 0);
        let empty = Heap::zeroed(0).unwrap();
        // SAFETY: as above.
        assert!(unsafe { WindowMemory::new(empty.ptr(), 0, Device::Cpu).as_mut_slice() }.is_empty());
        // SAFETY: never dereferenced (device memory).
        let dev = unsafe { WindowMemory::new(heap.ptr(), 100, Device::Cuda(0)) };
        assert!(dev.read(0, &mut out).is_err() && dev.write(0, &[1]).is_err());
    }
}
