//! Sparse COO tensors on the GPU: indices and values are copied to the
//! host, and the sparse all-reduce runs there over the CPU backend. The
//! result is the usual owned (host) `SparseCoo`.

use crate::pipeline::Staging;
use weft::backend::{Op, OpContext};
use weft::{Device, Error, Result, SparseCooTensor, Tensor};
use weft_cuda_driver::{order_after, synchronize_stream};

/// Host copies (8-byte aligned) of device tensors, taken after the work
/// already on the caller's stream.
fn download(st: &Staging, tensors: [&Tensor<'_>; 2], ctx: &OpContext) -> Result<[Vec<u64>; 2]> {
    let Device::Cuda(device) = tensors[0].device() else {
        return Err(Error::invalid("cuda-host-staging: a sparse tensor not on a CUDA device"));
    };
    let (gpu, device) = (st.gpu(), device as usize);
    let mut words = tensors.map(|t| vec![0u64; t.nbytes().div_ceil(8)]);
    let stream = gpu.new_stream(device)?;
    let r = (|| {
        order_after(&*gpu, device, stream, ctx.stream.unwrap_or_default())?;
        for (t, w) in tensors.iter().zip(words.iter_mut()) {
            // SAFETY: `w` holds the tensor's bytes and outlives the
            // synchronisation below; the device range is the caller's
            // tensor, borrowed for the op.
            unsafe { gpu.copy_dtoh(stream, w.as_mut_ptr() as *mut u8, t.as_ptr() as u64, t.nbytes())? };
        }
        synchronize_stream(&*gpu, device, stream, ctx.deadline.get(), ctx.name)
    })();
    gpu.destroy_stream(stream);
    r.map(|()| words)
}

impl Staging {
    /// A sparse all-reduce of CUDA tensors, through the host.
    pub fn run_sparse(&self, op: &mut Op<'_>, ctx: &OpContext) -> Result<()> {
        let Op::AllReduceSparse { input, output, op: redop } = op else {
            return Err(Error::unsupported("cuda-host-staging: not a sparse op"));
        };
        let [iw, vw] = download(self, [&input.indices, &input.values], ctx)?;
        let host = |t: &Tensor<'_>, w: &Vec<u64>| {
            // SAFETY: `w` holds the tensor's bytes (copied above), is 8-byte
            // aligned and lives until the op below returns.
            unsafe { Tensor::from_raw_parts(w.as_ptr() as *const u8, t.dtype(), Device::Cpu, t.dims(), None) }
        };
        let host_input = SparseCooTensor::new(host(&input.indices, &iw)?, host(&input.values, &vw)?, input.shape.clone())?;
        let mut host_op = Op::AllReduceSparse { input: Box::new(host_input), output, op: *redop };
        weft::algorithms::run(&**self.cpu(), &mut host_op, ctx)
    }
}
