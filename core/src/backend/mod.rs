//! The interface a transport implements, and what it is given.
//!
//! A backend must move bytes between ranks ([`Backend::exchange`]); that is
//! enough for every op, because core runs its generic algorithms
//! ([`crate::algorithms`]) over it. A backend may also run any collective
//! itself ([`Backend::native_op`]), which device backends (CUDA) must do for
//! memory the host cannot touch. Transports never see a collective unless
//! they ask for it; algorithms never see a socket.

mod capabilities;
pub mod matching;
pub mod progress;

pub use crate::deadline::Deadline;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::reduce_op::ReduceOp;
use crate::store::Store;
use crate::tensor::{DeviceKind, Layout, SparseCoo, SparseCooTensor, Tensor, TensorMut};
pub use capabilities::{Capabilities, NativeAlgorithm};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The `peer` of a receive that takes a message from any rank
/// (`MPI_ANY_SOURCE`), where the transport can ([`Capabilities::receives_from_any`]);
/// the receive is bound to the sender of the message it takes.
pub const ANY_SOURCE: usize = usize::MAX;

/// One point-to-point operation of an [`Backend::exchange`] batch.
#[derive(Debug)]
pub enum P2p<'a> {
    /// Send `data` to `peer` under `tag`.
    Send {
        /// Destination rank.
        peer: usize,
        /// Message tag (see [`crate::tag`]).
        tag: u64,
        /// Bytes to send.
        data: &'a [u8],
    },
    /// Receive exactly `buf.len()` bytes from `peer` under `tag`.
    Recv {
        /// Source rank.
        peer: usize,
        /// Message tag.
        tag: u64,
        /// Destination; a message of another length is an error.
        buf: &'a mut [u8],
    },
}

impl P2p<'_> {
    /// The peer rank.
    pub fn peer(&self) -> usize {
        match self {
            P2p::Send { peer, .. } | P2p::Recv { peer, .. } => *peer,
        }
    }

    /// Its peer rank and tag, to change in place (a view of a transport
    /// in other ranks renumbers them).
    pub fn address_mut(&mut self) -> (&mut usize, &mut u64) {
        match self {
            P2p::Send { peer, tag, .. } | P2p::Recv { peer, tag, .. } => (peer, tag),
        }
    }

    /// The same op over the same buffers, borrowed for as long as `self`
    /// is.
    pub fn reborrow(&mut self) -> P2p<'_> {
        match self {
            P2p::Send { peer, tag, data } => P2p::Send { peer: *peer, tag: *tag, data },
            P2p::Recv { peer, tag, buf } => P2p::Recv { peer: *peer, tag: *tag, buf },
        }
    }
}

/// The bytes of a send that are not in one buffer (rows that lie where a
/// caller left them): the transport asks for them piece by piece, as it
/// writes them out, so they are copied once instead of packed first.
pub trait Gather: Sync {
    /// Bytes in all.
    fn len(&self) -> usize;
    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Write bytes `[at, at + dst.len())` into `dst` (always inside `len`).
    fn fill(&self, at: usize, dst: &mut [u8]);
}

/// A send of gathered bytes, for [`Backend::exchange_gathered`].
#[derive(Clone, Copy)]
pub struct GatherSend<'a> {
    /// Destination rank.
    pub peer: usize,
    /// Message tag (see [`crate::tag`]).
    pub tag: u64,
    /// The bytes.
    pub src: &'a dyn Gather,
}

impl std::fmt::Debug for GatherSend<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatherSend").field("peer", &self.peer).field("tag", &self.tag).field("len", &self.src.len()).finish()
    }
}

/// What a transport did with a [`FastOp`] ([`Backend::fast_op`]).
#[derive(Debug)]
pub enum FastOutcome {
    /// It ran the op: its outcome.
    Done(Result<()>),
    /// Nothing (decided from the op's kind and size alone): core runs it
    /// as a job ([`Backend::native_op`], else core's algorithm).
    Declined,
    /// It ran its part, which did not finish the op (an all_to_all whose
    /// parts did not all fit, which every rank learns alike): core runs
    /// its algorithm, as when `native_op` returns `None`.
    Generic,
}

/// A collective of host bytes, as a transport's fast path takes it
/// ([`Backend::fast_op`]): every rank's parts equal in size, and no bools
/// (which core cleans after a job).
#[derive(Debug)]
#[non_exhaustive]
pub enum FastOp<'a> {
    /// `buf` becomes the reduction of every rank's `buf`.
    AllReduce {
        /// In and out.
        buf: &'a mut [u8],
        /// Its elements' type.
        dtype: DType,
        /// The reduction.
        op: ReduceOp,
    },
    /// `buf` becomes `root`'s.
    Broadcast {
        /// In at the root, out elsewhere.
        buf: &'a mut [u8],
        /// The rank whose bytes every rank gets.
        root: usize,
    },
    /// `outputs[r]` receives rank r's `input`.
    AllGather {
        /// This rank's part.
        input: &'a [u8],
        /// One part per rank, in rank order.
        outputs: smallvec::SmallVec<[&'a mut [u8]; 8]>,
    },
    /// `output` becomes the reduction over ranks of their `inputs[rank]`.
    ReduceScatter {
        /// One part per rank, in rank order.
        inputs: smallvec::SmallVec<[&'a [u8]; 8]>,
        /// This rank's reduced part.
        output: &'a mut [u8],
        /// The elements' type.
        dtype: DType,
        /// The reduction.
        op: ReduceOp,
    },
    /// Every rank has arrived.
    Barrier,
    /// `outputs[r]` receives rank r's `inputs[rank]`.
    AllToAll {
        /// One part per rank, in rank order.
        inputs: smallvec::SmallVec<[&'a [u8]; 8]>,
        /// One part per rank, in rank order.
        outputs: smallvec::SmallVec<[&'a mut [u8]; 8]>,
    },
}

/// The ops as a backend sees them, in one canonical form each: single-tensor
/// and list variants arrive here as lists of views (disjoint parts of one
/// tensor for the `_single` forms). Inputs and outputs are already checked
/// against each other locally.
#[derive(Debug)]
#[non_exhaustive]
pub enum Op<'a> {
    /// Send `data` to `peer` under `tag` (already encoded, see [`crate::tag`]).
    Send {
        /// Data.
        data: Tensor<'a>,
        /// Destination rank.
        peer: usize,
        /// Encoded tag.
        tag: u64,
    },
    /// Receive into `buf` from `peer` under `tag`.
    Recv {
        /// Destination.
        buf: TensorMut<'a>,
        /// Source rank.
        peer: usize,
        /// Encoded tag.
        tag: u64,
    },
    /// Root's `buf` is copied into every rank's `buf`.
    Broadcast {
        /// Data (read at root, written elsewhere).
        buf: TensorMut<'a>,
        /// Root rank.
        root: usize,
    },
    /// `buf` becomes the reduction of every rank's `buf`.
    AllReduce {
        /// In/out data.
        buf: TensorMut<'a>,
        /// Operator.
        op: ReduceOp,
    },
    /// Root's `buf` becomes the reduction; other ranks' `buf` is unchanged.
    Reduce {
        /// In/out data.
        buf: TensorMut<'a>,
        /// Root rank.
        root: usize,
        /// Operator.
        op: ReduceOp,
    },
    /// `outputs[i]` receives rank i's `input` (sizes may differ per rank).
    AllGather {
        /// This rank's contribution (same length as `outputs[rank]`).
        input: Tensor<'a>,
        /// One output per rank.
        outputs: Vec<TensorMut<'a>>,
    },
    /// `output` becomes the reduction over ranks of their `inputs[rank]`.
    ReduceScatter {
        /// One input per destination rank.
        inputs: Vec<Tensor<'a>>,
        /// This rank's result (same length as `inputs[rank]`).
        output: TensorMut<'a>,
        /// Operator.
        op: ReduceOp,
    },
    /// `outputs[i]` receives rank i's `inputs[rank]`.
    AllToAll {
        /// One input per destination rank.
        inputs: Vec<Tensor<'a>>,
        /// One output per source rank.
        outputs: Vec<TensorMut<'a>>,
    },
    /// Root's `outputs[i]` receives rank i's `input`; `outputs` is empty elsewhere.
    Gather {
        /// This rank's contribution.
        input: Tensor<'a>,
        /// At root, one output per rank.
        outputs: Vec<TensorMut<'a>>,
        /// Root rank.
        root: usize,
    },
    /// Every rank's `output` receives root's `inputs[rank]`; `inputs` is empty elsewhere.
    Scatter {
        /// At root, one input per rank.
        inputs: Vec<Tensor<'a>>,
        /// This rank's result.
        output: TensorMut<'a>,
        /// Root rank.
        root: usize,
    },
    /// No rank leaves before every rank has entered.
    Barrier,
    /// Sends and receives ([`Op::Send`] and [`Op::Recv`] only) that
    /// progress together and finish as one.
    Batch {
        /// The sends and receives, in issue order.
        ops: Vec<Op<'a>>,
    },
    /// `output` becomes the coalesced reduction of every rank's sparse
    /// `input` over the union of their indices (SUM, MIN or MAX).
    AllReduceSparse {
        /// This rank's contribution (may be uncoalesced); boxed so that
        /// this rare variant does not double the size of every op.
        input: Box<SparseCooTensor<'a>>,
        /// The result, identical on every rank.
        output: &'a mut SparseCoo,
        /// Operator.
        op: ReduceOp,
    },
}

impl<'a> Op<'a> {
    /// A receive from any rank ([`ANY_SOURCE`]).
    pub fn receives_from_any(&self) -> bool {
        matches!(self, Op::Recv { peer: ANY_SOURCE, .. })
    }

    /// The sends and receives of a send, a receive or a batch, over host
    /// memory, in issue order; `InvalidArgument` for any other op.
    pub fn host_p2p(&mut self) -> Result<smallvec::SmallVec<[P2p<'_>; 2]>> {
        fn one<'b>(op: &'b mut Op<'_>) -> Result<P2p<'b>> {
            match op {
                Op::Send { data, peer, tag } => Ok(P2p::Send { peer: *peer, tag: *tag, data: data.host_bytes()? }),
                Op::Recv { buf, peer, tag } => Ok(P2p::Recv { peer: *peer, tag: *tag, buf: buf.host_bytes_mut()? }),
                _ => Err(Error::invalid("only sends and receives are point-to-point")),
            }
        }
        match self {
            Op::Batch { ops } => {
                // (A loop: collecting through `Result` cost a tenth of a
                // small sendrecv.)
                let mut all = smallvec::SmallVec::with_capacity(ops.len());
                for op in ops {
                    all.push(one(op)?);
                }
                Ok(all)
            }
            op => Ok(smallvec::smallvec![one(op)?]),
        }
    }

    /// True for every op but send, recv and their batches.
    pub fn is_collective(&self) -> bool {
        !matches!(self, Op::Send { .. } | Op::Recv { .. } | Op::Batch { .. })
    }

    /// The outputs this op writes on this rank.
    pub fn outputs_mut(&mut self) -> impl Iterator<Item = &mut TensorMut<'a>> {
        // One arm per shape of op, without collecting (this runs on every op).
        let (one, many, batch): (Option<&mut TensorMut<'a>>, &mut [TensorMut<'a>], &mut [Op<'a>]) = match self {
            Op::Recv { buf, .. } | Op::Broadcast { buf, .. } | Op::AllReduce { buf, .. } | Op::Reduce { buf, .. } => {
                (Some(buf), &mut [], &mut [])
            }
            Op::AllGather { outputs, .. } | Op::AllToAll { outputs, .. } | Op::Gather { outputs, .. } => (None, outputs, &mut []),
            Op::ReduceScatter { output, .. } | Op::Scatter { output, .. } => (Some(output), &mut [], &mut []),
            Op::Batch { ops } => (None, &mut [], ops),
            Op::Send { .. } | Op::Barrier | Op::AllReduceSparse { .. } => (None, &mut [], &mut []),
        };
        let received = batch.iter_mut().filter_map(|op| match op {
            Op::Recv { buf, .. } => Some(buf),
            _ => None,
        });
        one.into_iter().chain(many.iter_mut()).chain(received)
    }
}

/// The canonical kind of an op: what the tag and debug checks are keyed by.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OpKind {
    /// Point-to-point send.
    Send = 1,
    /// Point-to-point receive.
    Recv = 2,
    /// Broadcast.
    Broadcast = 3,
    /// All-reduce.
    AllReduce = 4,
    /// Reduce.
    Reduce = 5,
    /// All-gather (all forms).
    AllGather = 6,
    /// Reduce-scatter (all forms).
    ReduceScatter = 7,
    /// All-to-all (all forms).
    AllToAll = 8,
    /// Gather.
    Gather = 9,
    /// Scatter.
    Scatter = 10,
    /// Barrier.
    Barrier = 11,
    /// The `WEFT_DEBUG=detail` consistency check before a collective.
    DebugCheck = 12,
    /// Sparse all-reduce.
    AllReduceSparse = 13,
}

impl OpKind {
    /// The kind with this code (as stored in a collective tag).
    pub fn from_code(code: u8) -> Option<OpKind> {
        use OpKind::*;
        [
            Send,
            Recv,
            Broadcast,
            AllReduce,
            Reduce,
            AllGather,
            ReduceScatter,
            AllToAll,
            Gather,
            Scatter,
            Barrier,
            DebugCheck,
            AllReduceSparse,
        ]
        .into_iter()
        .find(|k| *k as u8 == code)
    }
    /// Snake-case name.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::Broadcast => "broadcast",
            OpKind::AllReduce => "all_reduce",
            OpKind::Reduce => "reduce",
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllToAll => "all_to_all",
            OpKind::Gather => "gather",
            OpKind::Scatter => "scatter",
            OpKind::Barrier => "barrier",
            OpKind::DebugCheck => "debug_check",
            OpKind::AllReduceSparse => "all_reduce_sparse",
        }
    }
    /// A readable description of a tag, for error messages.
    pub fn describe_tag(tag: u64) -> String {
        if crate::tag::is_window(tag) {
            return format!("window #{} channel {}", (tag >> 8) & ((1 << 54) - 1), tag & 0xff);
        }
        if !crate::tag::is_collective(tag) {
            return format!("user tag {tag}");
        }
        let op = OpKind::from_code(crate::tag::op_code(tag)).map(OpKind::name).unwrap_or("unknown op");
        let shape = crate::tag::shape(tag);
        let dtype = crate::shape::dtype(shape).map(|d| format!(" {d}")).unwrap_or_default();
        let redop = crate::shape::reduce_op(shape).map(|o| format!(" {o}")).unwrap_or_default();
        format!("{op} #{} step {}{dtype}{redop}", crate::tag::seq(tag), crate::tag::step(tag))
    }
}

/// The first peer (not [`ANY_SOURCE`]) that the ops `pending` (indices
/// into `ops`) wait for: the one a timeout blames.
pub fn first_named_peer(ops: &[P2p<'_>], pending: &[usize]) -> Option<usize> {
    pending.iter().map(|&i| ops[i].peer()).find(|&p| p != ANY_SOURCE)
}

/// Everything a collective implementation needs to know about the call.
#[derive(Clone, Debug)]
pub struct OpContext {
    /// This rank in the group.
    pub rank: usize,
    /// Group size.
    pub size: usize,
    /// The op's user-facing name (`"all_gather_single"`...), for errors.
    pub name: &'static str,
    /// Canonical kind.
    pub kind: OpKind,
    /// Collective sequence number in the group (same on every rank).
    pub seq: u64,
    /// What every rank must agree on about the op ([`crate::shape`]),
    /// carried in its messages' tags.
    pub shape: u32,
    /// When the op must be finished.
    pub deadline: Deadline,
    /// The op's hints merged over the group's.
    pub hints: HashMap<String, String>,
    /// The algorithm the op was told to use (its hint `algorithm`, else the
    /// group's, else `WEFT_ALGORITHM`'s entry for its family), checked when
    /// it was issued against what runs it ([`crate::algorithms::select`]);
    /// `None`: the backend's fast paths and core's choice by size decide.
    /// A backend's native path steps aside for a name it does not offer
    /// ([`Capabilities::native_algorithms`]).
    pub algorithm: Option<&'static str>,
    /// Bytes per segment of pipelined steps: the op's hint `segment_bytes`,
    /// else the group's, checked when the op was issued, else one that fits
    /// what the backend buffers ([`Capabilities::buffered_bytes`]; `None`:
    /// core's default, [`crate::algorithms::select::SEGMENT_BYTES`]).
    pub segment_bytes: Option<usize>,
    /// Device ops: the caller's stream, captured at issue (`None`: the
    /// device's default stream).
    pub stream: Option<crate::stream::StreamHandle>,
    /// Device ops: where the backend leaves the op's device-side completion
    /// for [`crate::Work::wait`] and [`crate::Work::synchronize`].
    pub completion: crate::stream::CompletionSlot,
}

impl OpContext {
    /// The tag of step `step` of this op.
    pub fn tag(&self, step: u32) -> u64 {
        crate::tag::collective(self.kind as u8, self.seq, self.shape, step)
    }
    /// Time left before the deadline (zero if passed).
    pub fn remaining(&self) -> Duration {
        self.deadline.get().saturating_duration_since(Instant::now())
    }
}

/// A backend the registry can create ([`crate::registry`]).
pub trait BackendFactory: Send + Sync {
    /// Unique name (`"cpu-tcp"`).
    fn name(&self) -> &str;
    /// Device kinds it handles.
    fn devices(&self) -> &[DeviceKind];
    /// Layouts it handles.
    fn layouts(&self) -> &[Layout];
    /// Rank in `auto` (higher first; built-in cpu-tcp is 10).
    fn priority(&self) -> i32 {
        0
    }
    /// `Err(why)` when it cannot work on this machine (default: usable).
    fn probe(&self) -> std::result::Result<(), String> {
        Ok(())
    }
    /// Where it comes from (`"built-in"` or a plugin file).
    fn origin(&self) -> String {
        "built-in".into()
    }
    /// Create an instance for one group (collective: every rank calls it).
    /// An `Unsupported` error lets `auto` fall back to the next candidate.
    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>>;
}

/// What a backend is given when a group creates it.
#[derive(Clone)]
pub struct BackendContext {
    /// This rank.
    pub rank: usize,
    /// Group size.
    pub size: usize,
    /// A store namespace private to this backend in this group.
    pub store: Arc<dyn Store>,
    /// Default timeout (setup must finish within it too).
    pub timeout: Duration,
    /// Group hints.
    pub hints: HashMap<String, String>,
    /// The backend the group uses for dense CPU tensors, if created already:
    /// what a staging backend runs its host-side collectives on.
    pub cpu_backend: Option<Arc<dyn Backend>>,
    /// The rank the user knows each of this backend's ranks by, for what it
    /// prints: `0..size` for a group's own backend; a wrapper's backend
    /// over part of the group (hierarchical's) maps its ranks to the
    /// group's. Errors need no map: the wrapper translates them.
    pub group_ranks: Arc<[usize]>,
}

impl BackendContext {
    /// The deadline for setup started now.
    pub fn setup_deadline(&self) -> Instant {
        crate::deadline::instant_after(self.timeout)
    }
}

/// A transport (and optionally, native collectives) for one group.
///
/// Implementations must be usable from several threads: collectives of one
/// group run one at a time, in issue order, but background point-to-point
/// ops ([`Backend::post`]) progress alongside them, and `abort` may come
/// from any thread while an op is in flight.
///
/// Three methods are required: [`Backend::name`], [`Backend::exchange`]
/// and [`Backend::abort`]; with them every op runs (core's algorithms over
/// `exchange`). The rest are offers, each with a default that declines:
/// [`Backend::capabilities`] (what it can do and how it is tuned: one
/// value), posting in the background ([`Backend::post`],
/// [`Backend::post_device`], [`Backend::progress`]), its own collectives
/// ([`Backend::native_op`], [`Backend::fast_op`]), windows and a clean
/// [`Backend::shutdown`]. A wrapper forwards each offer it keeps
/// ([`forward_transport!`](crate::forward_transport) forwards the
/// transport's) and declines the others by not forwarding them.
pub trait Backend: Send + Sync {
    /// The registered name.
    fn name(&self) -> &str;

    /// Post every op of the batch, then wait until all have completed or
    /// `deadline` passes (a transport need not fix a deadline that is not
    /// fixed yet before it first waits: an exchange that finishes at once
    /// then never reads the clock). Receives are matched by (peer, tag)
    /// with the oldest message first; messages with different tags may
    /// arrive in any order.
    ///
    /// Errors: `Timeout` (naming the peer and tag still pending), `PeerLost`,
    /// `Aborted`, or `Backend` for a size mismatch (naming both sizes) or a
    /// protocol violation. After an error the batch's buffers are no longer
    /// touched.
    fn exchange(&self, ops: &mut [P2p<'_>], deadline: &Deadline) -> Result<()>;

    /// [`Backend::exchange`] with more sends, whose bytes `gathered` give
    /// piece by piece (received like any other). A transport that writes
    /// them straight where they go (shared memory's rings) saves a copy;
    /// this default gathers each into a buffer first, then exchanges.
    /// Wrappers forward it, or their inner transport never sees it.
    fn exchange_gathered(&self, ops: &mut [P2p<'_>], gathered: &[GatherSend<'_>], deadline: &Deadline) -> Result<()> {
        let packed: Vec<crate::kernels::Scratch> = gathered
            .iter()
            .map(|g| {
                let mut b = crate::kernels::Scratch::take(g.src.len());
                g.src.fill(0, &mut b);
                b
            })
            .collect();
        let mut all: Vec<P2p<'_>> = ops.iter_mut().map(P2p::reborrow).collect();
        all.extend(gathered.iter().zip(&packed).map(|(g, b)| P2p::Send { peer: g.peer, tag: g.tag, data: b }));
        self.exchange(&mut all, deadline)
    }

    /// What it can do and how it is tuned (the default:
    /// [`Capabilities::DEFAULT`]); the same value for the backend's life.
    fn capabilities(&self) -> &Capabilities {
        &capabilities::DEFAULT
    }

    /// Post a batch of point-to-point ops and return at once: its ops
    /// progress with every other posted op and every exchange, in whatever
    /// order the peers allow, and `post.done` is called exactly once when
    /// they have all finished or the batch failed (from inside this call
    /// only if it fails at once). Same matching rules and errors as
    /// [`Backend::exchange`]; batches are matched in the order they are
    /// posted. Only called where [`Capabilities::posts`] says so; this default
    /// runs the batch now.
    fn post(&self, post: crate::backend::progress::Post) {
        post.run_now(|ops, gathered, deadline| self.exchange_gathered(ops, gathered, &Deadline::at(deadline)));
    }

    /// Post a send, a receive or a batch ([`Op::Send`], [`Op::Recv`],
    /// [`Op::Batch`]) whose tensors are on this backend's device, ordered
    /// after `stream`'s work; `done` is called exactly once, when the op's
    /// host side has finished (or the op failed). Where device work may
    /// still run after that, the backend leaves its end in `completion`
    /// before calling `done` (the caller's stream then waits for it, as for
    /// a collective); otherwise the received bytes are in place when `done`
    /// runs. Only called where [`Capabilities::posts_device`] says so.
    ///
    /// # Safety
    /// The memory of `op`'s tensors stays valid until `done` has run and,
    /// where the backend set `completion`, until that has completed.
    unsafe fn post_device(
        &self,
        op: &mut Op<'_>,
        stream: Option<crate::stream::StreamHandle>,
        deadline: Instant,
        completion: crate::stream::CompletionSlot,
        done: crate::backend::progress::Done,
    ) {
        let _ = (op, stream, deadline, completion);
        done(Err(Error::unsupported(format!("backend {} cannot post point-to-point ops", self.name()))))
    }

    /// Drive posted batches on this thread until `until()` holds (or let
    /// the thread that drives now do it, and wait). Core calls it from a
    /// group's progress thread while background ops are pending.
    fn progress(&self, until: &dyn Fn() -> bool) {
        let _ = until;
    }

    /// Run `op` natively, or return `None` to let core run its generic
    /// algorithm over [`Backend::exchange`] (host memory only).
    fn native_op(&self, op: &mut Op<'_>, ctx: &OpContext) -> Option<Result<()>> {
        let _ = (op, ctx);
        None
    }

    /// Run a small collective of host bytes through a fast path, if the
    /// transport has one for it (see [`FastOutcome`]). Core asks only for
    /// ops that have no hints and no chosen algorithm, in the group's order
    /// as any collective. What `native_op` would do with the same op,
    /// without the op and the job built on the way (shm's small ops: a few
    /// hundred nanoseconds). The op is lent, not moved: with its lists of
    /// parts it is a few hundred bytes, which each move copied.
    fn fast_op(&self, op: &mut FastOp<'_>, deadline: &Deadline) -> FastOutcome {
        let _ = (op, deadline);
        FastOutcome::Declined
    }

    /// Fail every in-flight and later op with `reason` (kind `Aborted` or
    /// the error that poisoned the group); must return promptly.
    fn abort(&self, reason: &Error);

    /// This rank's side of a new window (`spec`), where the backend moves
    /// one-sided bytes itself (shm: shared memory); `None` lets core build
    /// it over [`Backend::post`]ed messages (`crate::window::over_p2p`).
    /// Collective: every rank gets the same call, in the same order.
    fn window(&self, spec: &crate::window::WindowSpec) -> Option<Result<Arc<dyn crate::window::WindowTransport>>> {
        let _ = spec;
        None
    }

    /// Close cleanly (peers learn this rank left on purpose). Called once,
    /// when the group is dropped after its last op.
    fn shutdown(&self) {}
}

/// The transport methods of [`Backend`] for a backend that moves its bytes
/// with another one (a wrapper: host staging, sparse): `exchange`,
/// `exchange_gathered`, `post`, `progress` and `abort`, forwarded to
/// `self.$inner()`, a method of the wrapper returning `&Arc<dyn Backend>`.
/// The wrapper states its [`Backend::capabilities`] itself: the inner
/// backend's, or those with what the wrapper changes (the CUDA backends
/// post device tensors' point-to-point ops through the host). Use inside
/// its `impl Backend`:
///
/// ```ignore
/// impl Backend for Staged {
///     fn name(&self) -> &str { "staged" }
///     weft::forward_transport!(cpu);
///     fn capabilities(&self) -> &Capabilities { self.cpu().capabilities() }
/// }
/// ```
#[macro_export]
macro_rules! forward_transport {
    ($inner:ident) => {
        fn exchange(&self, ops: &mut [$crate::backend::P2p<'_>], deadline: &$crate::backend::Deadline) -> $crate::Result<()> {
            self.$inner().exchange(ops, deadline)
        }
        fn exchange_gathered(
            &self,
            ops: &mut [$crate::backend::P2p<'_>],
            gathered: &[$crate::backend::GatherSend<'_>],
            deadline: &$crate::backend::Deadline,
        ) -> $crate::Result<()> {
            self.$inner().exchange_gathered(ops, gathered, deadline)
        }
        fn progress(&self, until: &dyn Fn() -> bool) {
            self.$inner().progress(until)
        }
        fn abort(&self, reason: &$crate::Error) {
            self.$inner().abort(reason)
        }
        fn post(&self, post: $crate::backend::progress::Post) {
            self.$inner().post(post)
        }
    };
}
