//! Dispatch by device: one group, two real backends. This test binary
//! registers `test-staging`, a CUDA-device backend over emulated device
//! memory (host memory labelled `cuda:0`) that stages every op through the
//! group's CPU backend, as cuda-host-staging does.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use weft::backend::{Backend, BackendContext, Op, OpContext, P2p};
use weft::prelude::*;
use weft::registry::{BackendFactory, StaticBackend};
use weft::{DType, Device, DeviceKind, ErrorKind, Layout, Result};
use weft_tests::{options, run_threads, Buf};

static STAGED_OPS: AtomicUsize = AtomicUsize::new(0);

struct Staging {
    cpu: Arc<dyn Backend>,
}

impl Backend for Staging {
    fn name(&self) -> &str {
        "test-staging"
    }
    fn exchange(&self, ops: &mut [P2p<'_>], deadline: &weft::backend::Deadline) -> Result<()> {
        self.cpu.exchange(ops, deadline)
    }
    fn native_op(&self, op: &mut Op<'_>, ctx: &OpContext) -> Option<Result<()>> {
        // "Device" memory is host memory here: copy it to a host tensor,
        // run the op on the CPU backend, copy back.
        let Op::AllReduce { buf, op: red } = op else {
            return Some(Err(weft::Error::unsupported(format!("test-staging has no {}", ctx.name))));
        };
        STAGED_OPS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: emulated device memory is host memory of buf.nbytes() bytes.
        let dev = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr() as *mut u8, buf.nbytes()) };
        let mut host = Buf::from_bytes(buf.dtype(), dev);
        let mut staged = Op::AllReduce { buf: host.tm(), op: *red };
        let r = weft::algorithms::run(self.cpu.as_ref(), &mut staged, ctx);
        dev.copy_from_slice(host.bytes());
        Some(r)
    }
    fn abort(&self, reason: &weft::Error) {
        self.cpu.abort(reason)
    }
}

struct StagingFactory;
impl BackendFactory for StagingFactory {
    fn name(&self) -> &str {
        "test-staging"
    }
    fn devices(&self) -> &[DeviceKind] {
        &[DeviceKind::Cuda]
    }
    fn layouts(&self) -> &[Layout] {
        &[Layout::Dense]
    }
    fn priority(&self) -> i32 {
        5
    }
    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>> {
        let cpu = ctx.cpu_backend.ok_or_else(|| weft::Error::unsupported("no CPU backend to stage through"))?;
        Ok(Arc::new(Staging { cpu }))
    }
}

static STAGING: StagingFactory = StagingFactory;
weft::inventory::submit! { StaticBackend(&STAGING) }

fn cuda_view(b: &mut Buf) -> weft::TensorMut<'_> {
    let n = b.numel();
    let dtype = b.dtype;
    // SAFETY: host memory of n elements, labelled as device 0 for the emulated backend.
    unsafe { weft::TensorMut::from_raw_parts(b.bytes_mut().as_mut_ptr(), dtype, Device::Cuda(0), &[n], None) }.unwrap()
}

#[test]
fn tensors_route_to_the_backend_of_their_device() {
    for spec in ["cpu:cpu-tcp,cuda:test-staging", "auto"] {
        let before = STAGED_OPS.load(Ordering::Relaxed);
        run_threads(3, options(spec), move |pg| {
            // auto prefers shm when every rank is on this host.
            let cpu = if spec == "auto" { "shm" } else { "cpu-tcp" };
            assert_eq!(pg.backend_name((DeviceKind::Cpu, Layout::Dense)).as_deref(), Some(cpu));
            assert_eq!(pg.backend_name((DeviceKind::Cuda, Layout::Dense)).as_deref(), Some("test-staging"));
            let mut host = vec![pg.rank() as f32; 5];
            let mut dev = Buf::from_bytes(DType::F32, &[1f32.to_ne_bytes(); 5].concat());
            pg.all_reduce(&mut host, ReduceOp::Sum, &OpOptions::default()).unwrap().wait().unwrap();
            pg.all_reduce(cuda_view(&mut dev), ReduceOp::Max, &OpOptions::default()).unwrap().wait().unwrap();
            assert_eq!(host, vec![3.0; 5]);
            assert_eq!(dev.bytes(), [1f32.to_ne_bytes(); 5].concat());
            // An op the CUDA backend lacks is a clear error, not a host access.
            let e = pg.broadcast(cuda_view(&mut dev), 0, &OpOptions::default()).unwrap().wait().unwrap_err();
            assert_eq!(e.kind(), &ErrorKind::Unsupported, "{e}");
        });
        assert_eq!(STAGED_OPS.load(Ordering::Relaxed) - before, 3, "one staged all_reduce per rank ({spec})");
    }
}

#[test]
fn bad_specs_name_what_is_registered() {
    weft_builtin::link();
    let e = weft::registry::plan("no-such-backend").unwrap_err().to_string();
    assert!(e.contains("cpu-tcp") && e.contains("test-staging"), "{e}");
    let e = weft::registry::plan("cuda:cpu-tcp").unwrap_err().to_string();
    assert!(e.contains("does not handle cuda"), "{e}");
    assert!(weft::registry::plan("gpu:cpu-tcp").is_err());
    assert!(weft::registry::plan("cpu:cpu-tcp,cpu:auto").is_err());
    let p = weft::registry::plan("cpu:cpu-tcp").unwrap();
    assert!(p.routes.iter().all(|(r, ..)| r.0 == DeviceKind::Cpu));
}
