//! `sparse`: sparse COO all-reduce for CPU tensors, layered over whatever
//! backend the group uses for dense CPU tensors (see the README).

#![warn(missing_docs)]

use std::sync::Arc;
use weft::backend::{Backend, BackendContext};
use weft::registry::{BackendFactory, StaticBackend};
use weft::{DeviceKind, Error, Layout, Result};

/// The registration of `sparse`.
pub struct Sparse;

impl BackendFactory for Sparse {
    fn name(&self) -> &str {
        "sparse"
    }
    fn devices(&self) -> &[DeviceKind] {
        &[DeviceKind::Cpu]
    }
    fn layouts(&self) -> &[Layout] {
        &[Layout::SparseCoo]
    }
    fn priority(&self) -> i32 {
        10
    }
    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>> {
        let dense = ctx.cpu_backend.ok_or_else(|| Error::unsupported("sparse needs a backend for dense CPU tensors in the same group"))?;
        let caps = weft::backend::Capabilities { fast_ops: false, ..dense.capabilities().clone() };
        Ok(Arc::new(SparseBackend { dense, caps }))
    }
}

/// Moves bytes through the group's dense CPU backend; the generic sparse
/// algorithms do the rest.
struct SparseBackend {
    dense: Arc<dyn Backend>,
    /// The dense backend's, without its fast path (sparse tensors never
    /// take it).
    caps: weft::backend::Capabilities,
}

impl Backend for SparseBackend {
    fn name(&self) -> &str {
        "sparse"
    }
    weft::forward_transport!(dense);
    fn capabilities(&self) -> &weft::backend::Capabilities {
        &self.caps
    }
}

impl SparseBackend {
    /// The dense CPU backend its bytes go through.
    fn dense(&self) -> &Arc<dyn Backend> {
        &self.dense
    }
}

static SPARSE: Sparse = Sparse;
weft::inventory::submit! { StaticBackend(&SPARSE) }

/// Reference this crate so the linker keeps its registration.
pub fn link() {}
