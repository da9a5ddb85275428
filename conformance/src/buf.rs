//! Aligned host buffers of any dtype (optionally mirrored on a device),
//! and result comparison.

use crate::placement::SharedPlacement;

/// Aligned bytes of one dtype, viewable as a tensor; after
/// [`Buf::place`], the views are of a device copy.
pub struct Buf {
    words: Vec<Page>,
    len: usize,
    /// Element type.
    pub dtype: weft::DType,
    device: Option<(SharedPlacement, u64)>,
}

/// Buffers start on a page, as nccl-tests' and OSU's do: where a buffer
/// starts relative to a page (and to its peer buffers) changes copy speed,
/// and benchmarks should not depend on what the allocator happened to give.
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Page([u8; 4096]);

impl Buf {
    /// A buffer holding `bytes` (a multiple of the dtype size).
    pub fn from_bytes(dtype: weft::DType, bytes: &[u8]) -> Buf {
        let mut b = Buf { words: vec![Page([0; 4096]); bytes.len().div_ceil(4096)], len: bytes.len(), dtype, device: None };
        b.bytes_mut().copy_from_slice(bytes);
        b
    }
    /// `n` zero elements.
    pub fn zeros(dtype: weft::DType, n: usize) -> Buf {
        Buf::from_bytes(dtype, &vec![0; n * dtype.size()])
    }
    /// Move the buffer to `placement` (uploading its contents on the
    /// placement's stream); `None` keeps it on the host.
    pub fn place(mut self, placement: Option<&SharedPlacement>) -> weft::Result<Buf> {
        if let Some(p) = placement {
            let addr = p.alloc(self.len)?;
            p.upload(addr, self.bytes())?;
            self.device = Some((p.clone(), addr));
        }
        Ok(self)
    }
    /// The contents now: downloaded (after the stream's earlier work) for a
    /// device buffer.
    pub fn read(&self) -> weft::Result<Vec<u8>> {
        match &self.device {
            None => Ok(self.bytes().to_vec()),
            Some((p, addr)) => {
                let mut out = vec![0; self.len];
                p.download(*addr, &mut out)?;
                Ok(out)
            }
        }
    }
    /// Replace the contents with `bytes` (as long as the buffer): for a
    /// device buffer, uploaded from the host copy on the placement's stream
    /// (the host copy is not to change again before that stream has run it).
    pub fn write(&mut self, bytes: &[u8]) -> weft::Result<()> {
        self.bytes_mut().copy_from_slice(bytes);
        match &self.device {
            None => Ok(()),
            Some((p, addr)) => p.upload(*addr, self.bytes()),
        }
    }
    /// The device address (0 for a host buffer).
    pub fn addr(&self) -> u64 {
        self.device.as_ref().map_or(0, |(_, a)| *a)
    }
    /// The host bytes (the contents before [`Buf::place`], for a device buffer).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: words holds at least len bytes.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.len) }
    }
    /// The bytes, mutably.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, unique.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut u8, self.len) }
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.len / self.dtype.size()
    }
    /// A read-only tensor view.
    pub fn t(&self) -> weft::Tensor<'_> {
        if let Some((p, addr)) = &self.device {
            // SAFETY: device memory of numel elements from the placement,
            // freed only when this Buf drops.
            return unsafe { weft::Tensor::from_raw_parts(*addr as *const u8, self.dtype, p.device(), &[self.numel()], None) }.unwrap();
        }
        // SAFETY: page-aligned host memory of numel elements, borrowed for the view's life.
        unsafe { weft::Tensor::from_raw_parts(self.words.as_ptr() as *const u8, self.dtype, weft::Device::Cpu, &[self.numel()], None) }
            .unwrap()
    }
    /// A mutable tensor view.
    pub fn tm(&mut self) -> weft::TensorMut<'_> {
        let n = self.numel();
        if let Some((p, addr)) = &self.device {
            // SAFETY: as in `t`, uniquely borrowed through &mut self.
            return unsafe { weft::TensorMut::from_raw_parts(*addr as *mut u8, self.dtype, p.device(), &[n], None) }.unwrap();
        }
        // SAFETY: as above, uniquely borrowed.
        unsafe { weft::TensorMut::from_raw_parts(self.words.as_mut_ptr() as *mut u8, self.dtype, weft::Device::Cpu, &[n], None) }.unwrap()
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        if let Some((p, addr)) = self.device.take() {
            p.free(addr);
        }
    }
}

/// Compare results: exact, except f16/bf16 products (rounding order differs).
pub fn assert_close(dtype: weft::DType, op: Option<weft::ReduceOp>, got: &[u8], want: &[u8], what: &str) {
    use weft::DType;
    if got == want {
        return;
    }
    let tolerant = matches!(dtype, DType::F16 | DType::BF16) && op == Some(weft::ReduceOp::Product);
    if tolerant {
        let f = |b: &[u8]| -> Vec<f32> {
            b.chunks(2)
                .map(|c| {
                    let bits = u16::from_ne_bytes([c[0], c[1]]);
                    if dtype == DType::F16 {
                        half::f16::from_bits(bits).to_f32()
                    } else {
                        half::bf16::from_bits(bits).to_f32()
                    }
                })
                .collect()
        };
        let (g, w) = (f(got), f(want));
        if g.iter().zip(&w).all(|(a, b)| (a - b).abs() <= 0.02 * b.abs().max(1.0)) {
            return;
        }
    }
    let n = got.len().min(64);
    panic!("{what}: {dtype} mismatch\n got  {:?}\n want {:?}", &got[..n], &want[..want.len().min(64)]);
}
