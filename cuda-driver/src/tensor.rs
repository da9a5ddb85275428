//! weft tensor views of CUDA memory.

use crate::gpu::DevicePtr;
use weft::{DType, Device, Result, Tensor, TensorMut};

/// A read-only view of `dims` contiguous elements at device address `ptr`
/// on CUDA device `ordinal` (memory owned by another framework).
///
/// # Safety
/// The memory is valid device memory of that device for `'a`, and is not
/// written by anyone but weft while an op uses it.
pub unsafe fn tensor_from_raw<'a>(ptr: DevicePtr, dtype: DType, ordinal: usize, dims: &[usize]) -> Result<Tensor<'a>> {
    // SAFETY: the caller's contract.
    unsafe { Tensor::from_raw_parts(ptr as *const u8, dtype, Device::Cuda(ordinal as u32), dims, None) }
}

/// A mutable view of device memory, as [`tensor_from_raw`].
///
/// # Safety
/// As [`tensor_from_raw`], and no other access while an op uses it.
pub unsafe fn tensor_mut_from_raw<'a>(ptr: DevicePtr, dtype: DType, ordinal: usize, dims: &[usize]) -> Result<TensorMut<'a>> {
    // SAFETY: the caller's contract.
    unsafe { TensorMut::from_raw_parts(ptr as *mut u8, dtype, Device::Cuda(ordinal as u32), dims, None) }
}

/// Views of `cudarc` slices (the device pointer comes with cudarc's own
/// ordering: `stream` first waits for earlier writes to the slice).
pub mod cudarc_views {
    use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
    use weft::{Element, Result, Tensor, TensorMut};

    /// A read-only weft view of a cudarc slice.
    pub fn tensor<'a, T: DeviceRepr + Element>(slice: &'a CudaSlice<T>, stream: &CudaStream) -> Result<Tensor<'a>> {
        let (ptr, _sync) = slice.device_ptr(stream);
        let ordinal = stream.context().ordinal();
        // SAFETY: cudarc owns `len` elements of T at `ptr` on this device
        // for as long as the slice is borrowed.
        unsafe { super::tensor_from_raw(ptr, T::DTYPE, ordinal, &[slice.len()]) }
    }

    /// A mutable weft view of a cudarc slice.
    pub fn tensor_mut<'a, T: DeviceRepr + Element>(slice: &'a mut CudaSlice<T>, stream: &CudaStream) -> Result<TensorMut<'a>> {
        let len = slice.len();
        let ordinal = stream.context().ordinal();
        let (ptr, _sync) = slice.device_ptr_mut(stream);
        // SAFETY: as above, uniquely borrowed.
        unsafe { super::tensor_mut_from_raw(ptr, T::DTYPE, ordinal, &[len]) }
    }
}
