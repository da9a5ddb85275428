//! Sparse COO tensors on the GPU: indices and values are copied to the
//! host, and the sparse all-reduce runs there over the CPU backend. The
//! result is the usual owned (host) `SparseCoo`.

use crate::pipeline::Staging;
use weft::backend::{Op, OpContext};
use weft::{Device, Error, Result, SparseCooTensor, Tensor};
use weft_cuda_runtime::synchronize_event;

/// A host copy of a device tensor, 8-byte aligned.
fn download(st: &Staging, t: &Tensor<'_>, ctx: &OpContext, words: &mut Vec<u64>) -> Result<()> {
    let bytes = t.nbytes();
    words.resize(bytes.div_ceil(8), 0);
    let gpu = st.gpu();
    let Device::Cuda(device) = t.device() else { return Err(Error::invalid("cuda-host-staging: a sparse tensor not on a CUDA device")) };
    let stream = gpu.new_stream(device as usize)?;
    let (ready, done) = (gpu.new_event(device as usize, false)?, gpu.new_event(device as usize, false)?);
    let r = (|| {
        gpu.record(ready, ctx.stream.unwrap_or_default())?;
        gpu.wait_event(stream, ready)?;
        // SAFETY: `words` holds `bytes` and outlives the synchronisation
        // below; the device range is the caller's tensor, borrowed for the op.
        unsafe { gpu.copy_dtoh(stream, words.as_mut_ptr() as *mut u8, t.as_ptr() as u64, bytes)? };
        gpu.record(done, stream)?;
        synchronize_event(&*gpu, done, ctx.deadline, ctx.name)
    })();
    gpu.destroy_event(ready);
    gpu.destroy_event(done);
    r
}

impl Staging {
    /// A sparse all-reduce of CUDA tensors, through the host.
    pub fn run_sparse(&self, op: &mut Op<'_>, ctx: &OpContext) -> Result<()> {
        let Op::AllReduceSparse { input, output, op: redop } = op else {
            return Err(Error::unsupported("cuda-host-staging: not a sparse op"));
        };
        let (mut iw, mut vw) = (Vec::new(), Vec::new());
        download(self, &input.indices, ctx, &mut iw)?;
        download(self, &input.values, ctx, &mut vw)?;
        let host = |t: &Tensor<'_>, w: &Vec<u64>| {
            // SAFETY: `w` holds the tensor's bytes (copied above), is 8-byte
            // aligned and lives until the op below returns.
            unsafe { Tensor::from_raw_parts(w.as_ptr() as *const u8, t.dtype(), Device::Cpu, t.dims(), None) }
        };
        let host_input = SparseCooTensor::new(host(&input.indices, &iw)?, host(&input.values, &vw)?, input.shape.clone())?;
        let mut host_op = Op::AllReduceSparse { input: host_input, output, op: *redop };
        weft::algorithms::run(&**self.cpu(), &mut host_op, ctx)
    }
}
