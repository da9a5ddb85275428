//! `cuda-host-staging`: CUDA tensors through pinned host memory and the
//! group's CPU backend (cpu-tcp or shm): dense ops chunked and pipelined
//! (see [`Staging`]); sparse COO all-reduce copied to the host and reduced
//! there (the result, a `SparseCoo`, is host memory). Works wherever the group has a CPU backend and this
//! process has a GPU (or the emulation, `WEFT_CUDA_EMULATION`).

#![warn(missing_docs)]

mod p2p;
mod parts;
mod pipeline;
mod sparse;
mod streams;

pub use pipeline::{refuse_capture, Staging, DEFAULT_CHUNK_BYTES};

use std::sync::Arc;
use weft::backend::{Backend, BackendContext, Op, OpContext};
use weft::registry::{BackendFactory, StaticBackend};
use weft::{DeviceKind, Layout, Result};

/// The registration of `cuda-host-staging`.
pub struct HostStaging;

impl BackendFactory for HostStaging {
    fn name(&self) -> &str {
        "cuda-host-staging"
    }
    fn devices(&self) -> &[DeviceKind] {
        &[DeviceKind::Cuda]
    }
    fn layouts(&self) -> &[Layout] {
        &[Layout::Dense, Layout::SparseCoo]
    }
    fn priority(&self) -> i32 {
        10
    }
    fn probe(&self) -> std::result::Result<(), String> {
        weft_cuda_driver::gpu().map(|_| ())
    }
    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>> {
        Ok(Arc::new(HostStagingBackend { staging: Staging::for_group(&ctx, "cuda-host-staging")? }))
    }
}

struct HostStagingBackend {
    staging: Staging,
}

/// The [`Backend`] methods of a backend whose bytes go through a
/// [`Staging`] in field `$staging` (this crate's; cuda-device writes its
/// own, to move point-to-point on the device): the
/// CPU transport's (`weft::forward_transport!`, through a method `cpu()`),
/// its capabilities with device point-to-point ops posted
/// ([`Staging::capabilities`]), and those posts. Use inside its `impl
/// Backend`.
#[macro_export]
macro_rules! staged_transport {
    ($staging:ident) => {
        weft::forward_transport!(cpu);
        fn capabilities(&self) -> &weft::backend::Capabilities {
            self.$staging.capabilities()
        }
        unsafe fn post_device(
            &self,
            op: &mut weft::backend::Op<'_>,
            stream: Option<weft::StreamHandle>,
            deadline: std::time::Instant,
            _completion: weft::stream::CompletionSlot,
            done: weft::backend::progress::Done,
        ) {
            // SAFETY: the caller's promise, passed on.
            unsafe { self.$staging.post_p2p(op, stream, deadline, done) }
        }
    };
}

impl Backend for HostStagingBackend {
    fn name(&self) -> &str {
        "cuda-host-staging"
    }
    staged_transport!(staging);
    fn native_op(&self, op: &mut Op<'_>, ctx: &OpContext) -> Option<Result<()>> {
        Some(self.staging.run(op, ctx))
    }
}

impl HostStagingBackend {
    /// The CPU backend its bytes go through.
    fn cpu(&self) -> &Arc<dyn Backend> {
        self.staging.cpu()
    }
}

static HOST_STAGING: HostStaging = HostStaging;
weft::inventory::submit! { StaticBackend(&HOST_STAGING) }

/// Reference this crate so the linker keeps its registration.
pub fn link() {}
