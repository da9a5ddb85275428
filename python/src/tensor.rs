//! Tensors as the Python side describes them: where the data is, how many
//! elements of which dtype, on which device. No bytes are copied.

use pyo3::prelude::*;
use weft::{DType, Device, Error, Result, Tensor, TensorMut};

/// `(data_ptr, numel, dtype code, device)`: a contiguous tensor, flat.
/// The dtype code is [`DType`]'s; the device is `-1` for the CPU, else the
/// CUDA device index.
#[derive(FromPyObject, Clone, Copy, Debug)]
pub struct Desc(usize, usize, u8, i64);

impl Desc {
    /// The tensor of `numel` elements of dtype `code` at `ptr` on `device`.
    pub fn new(ptr: usize, numel: usize, code: u8, device: i64) -> Desc {
        Desc(ptr, numel, code, device)
    }
}

/// Where an empty tensor points (torch may give 0): any aligned, non-null
/// address serves, since no byte is read or written.
const EMPTY: usize = 64;

impl Desc {
    fn parts(&self) -> Result<(usize, DType, Device)> {
        let dtype = DType::from_code(self.2).ok_or_else(|| Error::invalid(format!("unknown dtype code {}", self.2)))?;
        let device = match self.3 {
            -1 => Device::Cpu,
            i if i >= 0 => Device::Cuda(i as u32),
            i => return Err(Error::invalid(format!("bad device {i}"))),
        };
        let ptr = if self.1 == 0 { EMPTY } else { self.0 };
        if ptr == 0 {
            return Err(Error::invalid("a tensor with elements has no data pointer"));
        }
        Ok((ptr, dtype, device))
    }

    /// A writable view.
    ///
    /// # Safety
    /// The memory described stays valid and is touched by nothing but the
    /// op for as long as the view is used (the Python side keeps the tensor
    /// alive until the op's work has finished).
    pub unsafe fn view_mut(&self) -> Result<TensorMut<'static>> {
        let (ptr, dtype, device) = self.parts()?;
        // SAFETY: the caller's promise.
        unsafe { TensorMut::from_raw_parts(ptr as *mut u8, dtype, device, &[self.1], None) }
    }

    /// A read-only view.
    ///
    /// # Safety
    /// As [`Desc::view_mut`], except that others may read the memory too.
    pub unsafe fn view(&self) -> Result<Tensor<'static>> {
        // SAFETY: the caller's promise.
        unsafe { self.view_mut() }.map(Tensor::from)
    }
}

/// Read-only views of every tensor of a list.
///
/// # Safety
/// As [`Desc::view`], for each.
pub unsafe fn views(descs: &[Desc]) -> Result<Vec<Tensor<'static>>> {
    // SAFETY: the caller's promise.
    descs.iter().map(|d| unsafe { d.view() }).collect()
}

/// Writable views of every tensor of a list.
///
/// # Safety
/// As [`Desc::view_mut`], for each.
pub unsafe fn views_mut(descs: &[Desc]) -> Result<Vec<TensorMut<'static>>> {
    // SAFETY: the caller's promise.
    descs.iter().map(|d| unsafe { d.view_mut() }).collect()
}
