//! A job: an op made ready to run, with what `decide.rs` settles for it.

use super::debug::Fingerprint;
use crate::backend::{Op, OpKind};
use crate::options::OpOptions;
use crate::registry::Route;

/// An op ready to run: what the executor takes (opaque outside weft,
/// which cannot name it).
pub struct Job<'t> {
    pub(crate) name: &'static str,
    pub(crate) kind: OpKind,
    pub(crate) route: Route,
    pub(crate) fingerprint: Option<Fingerprint>,
    pub(crate) op: Op<'t>,
    /// The algorithm it was told to use, and its segment size, once
    /// `GroupCore::decide` settled them.
    pub(crate) algorithm: Option<&'static str>,
    pub(crate) segment_bytes: Option<usize>,
    /// Whether the backend's native path may take it (not when its fast
    /// path already ran its part: `fast.rs`).
    pub(crate) native: bool,
}

impl<'t> Job<'t> {
    /// `op`, named `name`, of `kind`, on `route`'s tensors: not yet decided.
    pub(super) fn new(name: &'static str, kind: OpKind, route: Route, fingerprint: Option<Fingerprint>, op: Op<'t>) -> Self {
        Job { name, kind, route, fingerprint, op, algorithm: None, segment_bytes: None, native: true }
    }

    /// Every op but send, recv and their batches.
    pub(crate) fn is_collective(&self) -> bool {
        self.op.is_collective()
    }
}

impl Job<'_> {
    /// The options this job runs with: the caller's, borrowed (no copy on
    /// the latency-bound path), except that a device op without a stream
    /// takes the one current on the issuing thread, not on whichever
    /// thread runs it.
    pub(crate) fn options<'o>(&self, opts: &'o OpOptions) -> std::borrow::Cow<'o, OpOptions> {
        if self.route.0 == crate::tensor::DeviceKind::Cpu || opts.stream.is_some() {
            return std::borrow::Cow::Borrowed(opts);
        }
        std::borrow::Cow::Owned(OpOptions { stream: crate::stream::current_stream(), ..opts.clone() })
    }
}
