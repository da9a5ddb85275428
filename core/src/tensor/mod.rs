//! Tensor views: borrowed memory plus dtype, device, shape and layout.
//!
//! A view never owns memory. Safe constructors take `&[T]` / `&mut [T]` of
//! host memory; `unsafe` constructors take a raw pointer for memory owned by
//! another framework (a CUDA allocation, a PyTorch tensor...).

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use std::fmt;
use std::marker::PhantomData;

mod device;
mod sparse;

pub use device::{Device, DeviceKind, Layout};
pub use sparse::{SparseCoo, SparseCooTensor};

/// Shape and strides of a dense view, in elements, with the element count
/// and contiguity worked out once (ops ask for them several times each).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shape {
    dims: Dims,
    strides: Dims,
    numel: usize,
    contiguous: bool,
}

/// Dims or strides: up to 4 inline, so making a view (every op makes
/// some) allocates nothing.
type Dims = smallvec::SmallVec<[usize; 4]>;

impl Shape {
    fn new(dims: Dims, strides: Dims) -> Self {
        let numel = dims.iter().product();
        // Row-major strides for the dims; a dim of 1 may have any stride,
        // and with no element nothing can be out of place.
        let mut expect = 1;
        let mut contiguous = true;
        for (d, s) in dims.iter().zip(&strides).rev() {
            contiguous &= *d <= 1 || *s == expect;
            expect *= d;
        }
        Shape { dims, strides, numel, contiguous: contiguous || numel == 0 }
    }
    fn flat(numel: usize) -> Self {
        Shape { dims: smallvec::smallvec![numel], strides: smallvec::smallvec![1], numel, contiguous: true }
    }
    fn contiguous(dims: &[usize]) -> Self {
        let mut strides: Dims = smallvec::smallvec![1; dims.len()];
        for i in (0..dims.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * dims[i + 1].max(1);
        }
        // Row-major by construction: no need to check the strides again.
        Shape { numel: dims.iter().product(), dims: dims.into(), strides, contiguous: true }
    }
    /// True when strides are the row-major strides of the dims.
    fn is_contiguous(&self) -> bool {
        self.contiguous
    }
    /// Number of elements the dims describe.
    fn numel(&self) -> usize {
        self.numel
    }
}

/// Why a view's bytes cannot be handed to a host transport (out of line:
/// every op checks, and almost none fails).
#[cold]
fn not_host_bytes(device: Device, shape: &Shape) -> Error {
    if device != Device::Cpu {
        return Error::unsupported(format!("tensor on {device} is not host memory"));
    }
    Error::invalid(format!("tensor with dims {:?} strides {:?} is not contiguous", shape.dims, shape.strides))
}

macro_rules! view_common {
    ($t:ident) => {
        impl<'a> $t<'a> {
            /// Element type.
            pub fn dtype(&self) -> DType {
                self.dtype
            }
            /// Device the memory lives on.
            pub fn device(&self) -> Device {
                self.device
            }
            /// Layout (always [`Layout::Dense`] for this type).
            pub fn layout(&self) -> Layout {
                Layout::Dense
            }
            /// Number of elements.
            pub fn numel(&self) -> usize {
                self.shape.numel()
            }
            /// Size in bytes of the elements.
            pub fn nbytes(&self) -> usize {
                self.numel() * self.dtype.size()
            }
            /// Dimensions.
            pub fn dims(&self) -> &[usize] {
                &self.shape.dims
            }
            /// Strides in elements.
            pub fn strides(&self) -> &[usize] {
                &self.shape.strides
            }
            /// True if the elements are contiguous in row-major order.
            pub fn is_contiguous(&self) -> bool {
                self.shape.is_contiguous()
            }
            /// Base address (device address for non-CPU tensors).
            pub fn as_ptr(&self) -> *const u8 {
                self.ptr as *const u8
            }
            /// The same memory viewed with `dims` (row-major, contiguous).
            /// Errors if the element count differs.
            pub fn reshape(mut self, dims: &[usize]) -> Result<Self> {
                let s = Shape::contiguous(dims);
                if s.numel() != self.numel() || !self.is_contiguous() {
                    return Err(Error::invalid(format!(
                        "cannot view {} contiguous={} elements as {:?}",
                        self.numel(),
                        self.is_contiguous(),
                        dims
                    )));
                }
                self.shape = s;
                Ok(self)
            }
            /// Host bytes of a contiguous CPU view, or an error naming why not.
            #[inline]
            pub fn host_bytes(&self) -> Result<&[u8]> {
                self.check_host()?;
                // SAFETY: the constructors guarantee `ptr` is valid for
                // `nbytes` bytes for 'a (safe ones from a slice, unsafe ones by
                // the caller's contract); the view is contiguous host memory.
                Ok(unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.nbytes()) })
            }
            #[inline]
            fn check_host(&self) -> Result<()> {
                if self.device != Device::Cpu || !self.is_contiguous() {
                    return Err(not_host_bytes(self.device, &self.shape));
                }
                Ok(())
            }
        }
        impl fmt::Debug for $t<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({} {:?} on {})", stringify!($t), self.dtype, self.shape.dims, self.device)
            }
        }
    };
}

/// A read-only view of a dense tensor.
#[derive(Clone)]
pub struct Tensor<'a> {
    ptr: *const u8,
    dtype: DType,
    device: Device,
    shape: Shape,
    _borrow: PhantomData<&'a [u8]>,
}

/// A mutable view of a dense tensor.
pub struct TensorMut<'a> {
    ptr: *mut u8,
    dtype: DType,
    device: Device,
    shape: Shape,
    _borrow: PhantomData<&'a mut [u8]>,
}

// Every op moves its views a few times: within 128 bytes the compiler
// moves them inline; past it, each move is a call to memcpy.
const _: () = assert!(std::mem::size_of::<TensorMut<'static>>() <= 128 && std::mem::size_of::<Tensor<'static>>() <= 128);

// SAFETY: a Tensor is a shared borrow of plain data (like `&[T]` with T: Sync);
// a TensorMut is a unique borrow (like `&mut [T]` with T: Send).
unsafe impl Send for Tensor<'_> {}
// SAFETY: see above; a Tensor only allows reads.
unsafe impl Sync for Tensor<'_> {}
// SAFETY: see above.
unsafe impl Send for TensorMut<'_> {}
// SAFETY: `&TensorMut` only allows reads.
unsafe impl Sync for TensorMut<'_> {}

view_common!(Tensor);
view_common!(TensorMut);

impl Tensor<'_> {
    /// [`Tensor::host_bytes`] of every view of a list (no heap allocation
    /// for up to 8: the small-op paths use it).
    pub fn host_bytes_of<'t>(ts: &'t [Tensor<'_>]) -> Result<smallvec::SmallVec<[&'t [u8]; 8]>> {
        ts.iter().map(|t| t.host_bytes()).collect()
    }
}

impl<'a> Tensor<'a> {
    /// A 1-D view of a host slice.
    pub fn from_slice<T: Element>(data: &'a [T]) -> Self {
        Tensor {
            ptr: data.as_ptr() as *const u8,
            dtype: T::DTYPE,
            device: Device::Cpu,
            shape: Shape::flat(data.len()),
            _borrow: PhantomData,
        }
    }

    /// A view of memory owned elsewhere.
    ///
    /// # Safety
    /// `ptr` must be valid for reads of every element the dims and strides
    /// reach, on `device`, for `'a`, and must not be written meanwhile.
    pub unsafe fn from_raw_parts(ptr: *const u8, dtype: DType, device: Device, dims: &[usize], strides: Option<&[usize]>) -> Result<Self> {
        let shape = make_shape(dims, strides)?;
        Ok(Tensor { ptr, dtype, device, shape, _borrow: PhantomData })
    }

    /// Reinterpret a contiguous host view as a slice of `T`.
    pub fn as_slice<T: Element>(&self) -> Result<&'a [T]> {
        self.check_host()?;
        check_dtype::<T>(self.dtype)?;
        check_align::<T>(self.ptr)?;
        // SAFETY: dtype and alignment checked; memory valid for 'a (constructor contract).
        Ok(unsafe { std::slice::from_raw_parts(self.ptr as *const T, self.numel()) })
    }

    /// Split a contiguous view into consecutive parts of `counts` elements.
    pub fn split(&self, counts: &[usize]) -> Result<Vec<Tensor<'a>>> {
        let offsets = split_offsets(self.numel(), counts, self.is_contiguous())?;
        Ok(offsets
            .zip(counts)
            .map(|(off, &n)| Tensor {
                ptr: self.ptr.wrapping_add(off * self.dtype.size()),
                dtype: self.dtype,
                device: self.device,
                shape: Shape::flat(n),
                _borrow: PhantomData,
            })
            .collect())
    }
}

impl<'a> TensorMut<'a> {
    /// A 1-D view of a mutable host slice.
    pub fn from_slice<T: Element>(data: &'a mut [T]) -> Self {
        TensorMut {
            ptr: data.as_mut_ptr() as *mut u8,
            dtype: T::DTYPE,
            device: Device::Cpu,
            shape: Shape::flat(data.len()),
            _borrow: PhantomData,
        }
    }

    /// A mutable view of memory owned elsewhere.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of every element the dims and
    /// strides reach, on `device`, for `'a`, with no other access meanwhile.
    pub unsafe fn from_raw_parts(ptr: *mut u8, dtype: DType, device: Device, dims: &[usize], strides: Option<&[usize]>) -> Result<Self> {
        let shape = make_shape(dims, strides)?;
        Ok(TensorMut { ptr, dtype, device, shape, _borrow: PhantomData })
    }

    /// A read-only view of the same memory, borrowing this one.
    pub fn as_tensor(&self) -> Tensor<'_> {
        Tensor { ptr: self.ptr, dtype: self.dtype, device: self.device, shape: self.shape.clone(), _borrow: PhantomData }
    }

    /// A shorter-lived mutable view of the same memory.
    pub fn reborrow(&mut self) -> TensorMut<'_> {
        TensorMut { ptr: self.ptr, dtype: self.dtype, device: self.device, shape: self.shape.clone(), _borrow: PhantomData }
    }

    /// Mutable host bytes of a contiguous CPU view.
    #[inline]
    pub fn host_bytes_mut(&mut self) -> Result<&mut [u8]> {
        self.check_host()?;
        // SAFETY: as for `host_bytes`, and `&mut self` makes the access unique.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.nbytes()) })
    }

    /// [`TensorMut::host_bytes_mut`] of every view of a list (no heap
    /// allocation for up to 8: the small-op paths use it).
    pub fn host_bytes_of<'t>(ts: &'t mut [TensorMut<'_>]) -> Result<smallvec::SmallVec<[&'t mut [u8]; 8]>> {
        ts.iter_mut().map(|t| t.host_bytes_mut()).collect()
    }

    /// Reinterpret a contiguous host view as a mutable slice of `T`.
    pub fn as_slice_mut<T: Element>(&mut self) -> Result<&mut [T]> {
        self.check_host()?;
        check_dtype::<T>(self.dtype)?;
        check_align::<T>(self.ptr)?;
        // SAFETY: dtype and alignment checked; memory valid and unique.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, self.numel()) })
    }

    /// Split into disjoint consecutive mutable parts of `counts` elements.
    pub fn split_mut(self, counts: &[usize]) -> Result<Vec<TensorMut<'a>>> {
        let offsets = split_offsets(self.numel(), counts, self.is_contiguous())?;
        Ok(offsets
            .zip(counts)
            .map(|(off, &n)| TensorMut {
                ptr: self.ptr.wrapping_add(off * self.dtype.size()),
                dtype: self.dtype,
                device: self.device,
                shape: Shape::flat(n),
                _borrow: PhantomData,
            })
            .collect())
    }
}

impl<'a, T: Element> From<&'a [T]> for Tensor<'a> {
    fn from(s: &'a [T]) -> Self {
        Tensor::from_slice(s)
    }
}
impl<'a, T: Element> From<&'a Vec<T>> for Tensor<'a> {
    fn from(s: &'a Vec<T>) -> Self {
        Tensor::from_slice(s)
    }
}
impl<'a, T: Element> From<&'a mut [T]> for TensorMut<'a> {
    fn from(s: &'a mut [T]) -> Self {
        TensorMut::from_slice(s)
    }
}
impl<'a, T: Element> From<&'a mut Vec<T>> for TensorMut<'a> {
    fn from(s: &'a mut Vec<T>) -> Self {
        TensorMut::from_slice(s)
    }
}
impl<'a> From<TensorMut<'a>> for Tensor<'a> {
    fn from(t: TensorMut<'a>) -> Self {
        Tensor { ptr: t.ptr, dtype: t.dtype, device: t.device, shape: t.shape, _borrow: PhantomData }
    }
}

fn make_shape(dims: &[usize], strides: Option<&[usize]>) -> Result<Shape> {
    let shape = match strides {
        // (Most views are flat: no strides to compute.)
        None if dims.len() == 1 => Shape::flat(dims[0]),
        None => Shape::contiguous(dims),
        Some(s) if s.len() == dims.len() => Shape::new(dims.into(), s.into()),
        Some(s) => return Err(Error::invalid(format!("{} strides given for {} dims", s.len(), dims.len()))),
    };
    Ok(shape)
}

fn check_dtype<T: Element>(dtype: DType) -> Result<()> {
    if T::DTYPE != dtype {
        return Err(Error::invalid(format!("tensor has dtype {dtype}, asked for {}", T::DTYPE)));
    }
    Ok(())
}

fn check_align<T>(ptr: *const u8) -> Result<()> {
    if !(ptr as usize).is_multiple_of(std::mem::align_of::<T>()) {
        return Err(Error::invalid(format!("pointer {ptr:p} is not aligned for its dtype")));
    }
    Ok(())
}

/// Where each part starts (no allocation: this runs on every `_single` op).
fn split_offsets(numel: usize, counts: &[usize], contiguous: bool) -> Result<impl Iterator<Item = usize> + '_> {
    if !contiguous {
        return Err(Error::invalid("cannot split a non-contiguous tensor"));
    }
    let total: usize = counts.iter().sum();
    if total != numel {
        return Err(Error::invalid(format!("split sizes {counts:?} add up to {total}, tensor has {numel} elements")));
    }
    Ok(counts.iter().scan(0, |acc, &n| {
        let off = *acc;
        *acc += n;
        Some(off)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_carry_dtype_and_split_disjointly() {
        let mut v = vec![1.0f32, 2.0, 3.0, 4.0, 5.0];
        let t = TensorMut::from_slice(&mut v[..]);
        assert_eq!((t.dtype(), t.numel(), t.nbytes()), (DType::F32, 5, 20));
        let mut parts = t.split_mut(&[2, 0, 3]).unwrap();
        parts[2].as_slice_mut::<f32>().unwrap()[0] = 9.0;
        assert_eq!(parts[1].numel(), 0);
        assert_eq!(v, [1.0, 2.0, 9.0, 4.0, 5.0]);
        let t = Tensor::from_slice(&v[..]);
        assert!(t.split(&[2, 2]).is_err());
        assert!(t.as_slice::<f64>().is_err());
    }

    #[test]
    fn strided_views_are_rejected_for_host_access() {
        let v = [0u8; 12];
        // SAFETY: dims 3x2 with strides (4,1) stay inside the 12-byte array.
        let t = unsafe { Tensor::from_raw_parts(v.as_ptr(), DType::U8, Device::Cpu, &[3, 2], Some(&[4, 1])) }.unwrap();
        assert!(!t.is_contiguous());
        assert_eq!(t.host_bytes().unwrap_err().kind(), &crate::ErrorKind::InvalidArgument);
        let empty: [i64; 0] = [];
        assert!(Tensor::from_slice(&empty[..]).reshape(&[2, 0]).unwrap().is_contiguous());
        let c = Tensor::from_slice(&v[..]).reshape(&[3, 4]).unwrap();
        assert!(c.is_contiguous());
        assert_eq!(c.strides(), &[4, 1]);
        // A dim of 1 may carry any stride.
        // SAFETY: 3 bytes at stride 1 stay inside the array.
        let one = unsafe { Tensor::from_raw_parts(v.as_ptr(), DType::U8, Device::Cpu, &[3, 1], Some(&[1, 7])) }.unwrap();
        assert!(one.is_contiguous());
        assert_eq!((one.numel(), one.nbytes()), (3, 3));
    }
}
