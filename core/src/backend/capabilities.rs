//! What a backend can do and how core tunes its algorithms for it: one
//! value a backend gives ([`Backend::capabilities`]), so a wrapper forwards
//! one thing (or derives its own from its inner backend's) instead of
//! guessing which of many methods to forward.
//!
//! [`Backend::capabilities`]: super::Backend::capabilities

use crate::algorithms::select::Family;

/// An algorithm a backend runs natively, beyond core's generic ones: the
/// name an `algorithm` hint or `WEFT_ALGORITHM` gives for ops of `family`
/// (hierarchical's `"hierarchical"` all_reduce). A name core also has is
/// the backend's where this backend serves the op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NativeAlgorithm {
    /// The op family it serves.
    pub family: Family,
    /// The name hints give.
    pub name: &'static str,
}

/// What a backend can do and how it is tuned. Read by core where it
/// decides (never changing after the backend is created); the defaults
/// suit a blocking socket transport without native algorithms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Whether [`Backend::post`](super::Backend::post) progresses batches in
    /// the background, together with each other and with
    /// [`Backend::exchange`](super::Backend::exchange) calls from other
    /// threads. Without it, core runs a scope's sends and receives one at a
    /// time in issue order, as collectives.
    pub posts: bool,
    /// Whether a posted receive may name [`ANY_SOURCE`](super::ANY_SOURCE)
    /// as its peer (the cell given by [`crate::backend::progress::Post::with_source`]
    /// then learns the sender).
    pub receives_from_any: bool,
    /// Whether it runs small collectives of host bytes through a fast path
    /// of its own ([`Backend::fast_op`](super::Backend::fast_op): shm).
    /// Core offers a direct op without hints there first, in its turn,
    /// without building the job; elsewhere the op runs as a job. A wrapper
    /// that does not forward `fast_op` declares false.
    pub fast_ops: bool,
    /// Whether [`Backend::post_device`](super::Backend::post_device) posts
    /// point-to-point ops on this backend's device memory (as `posts` does
    /// for host bytes).
    pub posts_device: bool,
    /// About how many bytes a rank receives in the time one more message
    /// step costs on this transport (its latency times its bandwidth).
    /// Algorithm choices that trade steps for bytes (all_reduce's by size,
    /// the sparse `auto`) weigh them with it. The default suits sockets; a
    /// backend layered over another reports that one's.
    pub step_bytes: usize,
    /// How many bytes a send to one peer can hand over before that peer
    /// has received any (shm: one ring), where the transport has such a
    /// bound; `None`: no fixed one (sockets). Pipelined algorithms keep
    /// their segments small enough that the few they keep in flight fit
    /// ([`crate::algorithms::select::segment_for`]): a send that does not
    /// fit waits for its receiver to run.
    pub buffered_bytes: Option<usize>,
    /// The group's ranks in an order where neighbours share a core or its
    /// caches (shm: ranks bound to the same CPU next to each other), the
    /// same on every rank; algorithms that pass data to a neighbour (ring
    /// and chain: [`crate::algorithms`]' `line.rs`) follow it, so fewer
    /// hops cross cores. `None`: rank order.
    pub rank_order: Option<Vec<usize>>,
    /// The algorithms it runs natively ([`Backend::native_op`](super::Backend::native_op)),
    /// which hints may name.
    pub native_algorithms: &'static [NativeAlgorithm],
}

impl Capabilities {
    /// A blocking transport: nothing posted, no native algorithms, tuned
    /// for sockets.
    pub const DEFAULT: Capabilities = Capabilities {
        posts: false,
        receives_from_any: false,
        fast_ops: false,
        posts_device: false,
        step_bytes: 64 << 10,
        buffered_bytes: None,
        rank_order: None,
        native_algorithms: &[],
    };

    /// A transport that posts in the background and receives from any
    /// source, otherwise the defaults (cpu-tcp, loopback).
    pub const POSTING: Capabilities = Capabilities { posts: true, receives_from_any: true, ..Capabilities::DEFAULT };
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities::DEFAULT
    }
}

/// What [`Backend::capabilities`](super::Backend::capabilities) gives by
/// default.
pub(crate) static DEFAULT: Capabilities = Capabilities::DEFAULT;
