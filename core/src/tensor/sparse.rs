//! Sparse COO tensors: a borrowed view (the input of a sparse all-reduce)
//! and an owned, coalesced result.

use super::{Device, Tensor};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};

/// A sparse COO tensor: `indices` (i64, `[sparse_dims, nnz]`), `values`
/// (`[nnz, dense dims...]`) and the full `shape` (sparse dims first).
///
/// Indices may be uncoalesced (unsorted, duplicated). Its all-reduce lives in
/// the sparse backend; dispatch routes it by `(device, Layout::SparseCoo)`.
#[derive(Clone, Debug)]
pub struct SparseCooTensor<'a> {
    /// Indices, i64, `[sparse_dims, nnz]` row-major.
    pub indices: Tensor<'a>,
    /// Values, `[nnz, dense dims...]`.
    pub values: Tensor<'a>,
    /// Full shape: sparse dims then dense dims.
    pub shape: Vec<usize>,
}

impl<'a> SparseCooTensor<'a> {
    /// Build and check a COO tensor.
    pub fn new(indices: Tensor<'a>, values: Tensor<'a>, shape: Vec<usize>) -> Result<Self> {
        if indices.dtype() != DType::I64 {
            return Err(Error::invalid(format!("COO indices must be i64, got {}", indices.dtype())));
        }
        if indices.device() != values.device() {
            return Err(Error::invalid("COO indices and values on different devices"));
        }
        let sparse_dims = indices.dims().first().copied().unwrap_or(0);
        let nnz = if indices.dims().len() == 2 { indices.dims()[1] } else { 0 };
        if indices.dims().len() != 2 || sparse_dims == 0 || sparse_dims > shape.len() {
            return Err(Error::invalid(format!(
                "COO indices must be [sparse_dims, nnz] with 1 <= sparse_dims <= {}, got {:?}",
                shape.len(),
                indices.dims()
            )));
        }
        let dense: usize = shape[sparse_dims..].iter().product();
        if values.numel() != nnz * dense {
            return Err(Error::invalid(format!("COO values have {} elements, expected nnz {nnz} x dense {dense}", values.numel())));
        }
        Ok(SparseCooTensor { indices, values, shape })
    }
    /// Device of the values.
    pub fn device(&self) -> Device {
        self.values.device()
    }
    /// Number of stored (possibly duplicated) entries.
    pub fn nnz(&self) -> usize {
        self.indices.dims()[1]
    }
}

/// An owned, coalesced sparse COO tensor: the result of a sparse
/// all-reduce. Entries are sorted by index (row-major over the sparse dims)
/// and unique.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SparseCoo {
    /// Full shape: sparse dims then dense dims.
    pub shape: Vec<usize>,
    /// Number of leading sparse dims.
    pub sparse_dims: usize,
    /// Element type of the values.
    pub dtype: Option<DType>,
    /// Indices, `[sparse_dims, nnz]` row-major (as PyTorch's `indices()`).
    pub indices: Vec<i64>,
    /// Values, `[nnz, dense dims...]`, as raw bytes of `dtype`.
    pub values: Vec<u8>,
}

impl SparseCoo {
    /// Number of entries.
    pub fn nnz(&self) -> usize {
        self.indices.len().checked_div(self.sparse_dims).unwrap_or(0)
    }
    /// The sparse index of entry `k`.
    pub fn index(&self, k: usize) -> Vec<i64> {
        let n = self.nnz();
        (0..self.sparse_dims).map(|d| self.indices[d * n + k]).collect()
    }
    /// The values as a typed slice.
    pub fn values_as<T: Element>(&self) -> Result<Vec<T>> {
        if self.dtype != Some(T::DTYPE) {
            return Err(Error::invalid(format!("values are {:?}, asked for {}", self.dtype, T::DTYPE)));
        }
        Ok(self
            .values
            .chunks_exact(std::mem::size_of::<T>())
            // SAFETY: each chunk holds one T's bytes; read_unaligned has no alignment needs,
            // and the bytes were produced as valid values of T (bools normalized to 0/1).
            .map(|c| unsafe { std::ptr::read_unaligned(c.as_ptr() as *const T) })
            .collect())
    }
}
