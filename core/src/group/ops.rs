//! Every op of a group: local validation, then one canonical job.
//!
//! Validation happens here, before any byte moves: sizes, dtypes, devices,
//! roots, peers, split sizes, tags and reduce ops. What cannot be checked
//! locally (the other ranks' sizes) is checked by the transport, which
//! rejects a message whose length differs from the posted receive.

use super::debug::Fingerprint;
use super::work::Work;
use crate::backend::{FastOp, Op, OpKind, P2p};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::options::OpOptions;
use crate::reduce_op::ReduceOp;
use crate::registry::Route;
use crate::tag::MAX_USER_TAG;
use crate::tensor::{Device, Layout, SparseCoo, SparseCooTensor, Tensor, TensorMut};

/// An op ready to run: what the executor takes. Opaque outside weft.
#[doc(hidden)]
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

/// One send or receive of a [`Collectives::batch_p2p`].
#[derive(Debug)]
pub enum P2pOp<'t> {
    /// Send `tensor` to rank `peer` under `tag`.
    Send {
        /// The data.
        tensor: Tensor<'t>,
        /// Destination rank.
        peer: usize,
        /// Tag (at most [`MAX_USER_TAG`]).
        tag: u32,
    },
    /// Receive into `tensor` from rank `peer` under `tag`.
    Recv {
        /// Where the message lands (its size must match).
        tensor: TensorMut<'t>,
        /// Source rank.
        peer: usize,
        /// Tag (at most [`MAX_USER_TAG`]).
        tag: u32,
    },
}

impl<'t> P2pOp<'t> {
    /// A send of `tensor` to `peer` under `tag`.
    pub fn send(tensor: impl Into<Tensor<'t>>, peer: usize, tag: u32) -> Self {
        P2pOp::Send { tensor: tensor.into(), peer, tag }
    }
    /// A receive into `tensor` from `peer` under `tag`.
    pub fn recv(tensor: impl Into<TensorMut<'t>>, peer: usize, tag: u32) -> Self {
        P2pOp::Recv { tensor: tensor.into(), peer, tag }
    }
}

/// Only weft's issuers implement [`Collectives`] (each says so where it
/// is defined: the group, a scope, `Unscoped`).
pub(super) mod sealed {
    pub trait Sealed {}
}
impl sealed::Sealed for super::ProcessGroup {}

/// Checks shared by the ops; each error names the op and this rank.
struct Check {
    name: &'static str,
    rank: usize,
    size: usize,
    /// `WEFT_DEBUG=detail`: ops carry a fingerprint to compare across ranks.
    detail: bool,
}

impl Check {
    /// The op's fingerprint, built only when detail checking is on (the
    /// formatting would otherwise cost every op).
    fn fingerprint(&self, kind: OpKind, canon: impl FnOnce() -> String) -> Option<Fingerprint> {
        self.detail.then(|| Fingerprint::new(self.name, kind, canon()))
    }
    #[cold]
    fn fail(&self, msg: String) -> Error {
        Error::invalid(msg).with_op(self.name).with_rank(self.rank)
    }
    #[inline]
    fn rank_arg(&self, what: &str, r: usize) -> Result<()> {
        if r >= self.size {
            return Err(self.fail(format!("{what} {r} is out of range for a group of size {}", self.size)));
        }
        Ok(())
    }
    #[inline]
    fn peer(&self, r: usize) -> Result<()> {
        self.rank_arg("peer rank", r)?;
        if r == self.rank {
            return Err(self.fail(format!("peer rank {r} is this rank; copy locally instead")));
        }
        Ok(())
    }
    fn list_len(&self, what: &str, n: usize) -> Result<()> {
        if n != self.size {
            return Err(self.fail(format!("{what} has {n} tensors, expected one per rank ({})", self.size)));
        }
        Ok(())
    }
    /// `what` is formatted only on failure (this runs per tensor per op).
    fn numel(&self, what: impl std::fmt::Display, got: usize, want: usize) -> Result<()> {
        if got != want {
            return Err(self.fail(format!("{what} has {got} elements, expected {want}")));
        }
        Ok(())
    }
    fn reduce_op(&self, op: ReduceOp, dtype: DType) -> Result<()> {
        op.check(dtype).map_err(|e| e.with_op(self.name).with_rank(self.rank))
    }
    /// All tensors share dtype and device, are dense and contiguous; returns the route.
    fn tensors(&self, ts: impl IntoIterator<Item = (DType, Device, bool)>) -> Result<(Route, DType, Device)> {
        let mut first: Option<(DType, Device)> = None;
        for (i, (dtype, device, contiguous)) in ts.into_iter().enumerate() {
            if !contiguous {
                return Err(self.fail(format!("tensor {i} is not contiguous (strided views are not supported yet)")));
            }
            match first {
                None => first = Some((dtype, device)),
                Some((d, _)) if d != dtype => {
                    return Err(self.fail(format!("tensor {i} has dtype {dtype}, expected {d} like the first tensor")))
                }
                Some((_, dev)) if dev != device => {
                    return Err(self.fail(format!("tensor {i} is on {device}, expected {dev} like the first tensor")))
                }
                _ => {}
            }
        }
        let (dtype, device) = first.unwrap_or((DType::U8, Device::Cpu));
        Ok(((device.kind(), Layout::Dense), dtype, device))
    }
}

/// `n` elements for each of `w` ranks: split sizes without a heap
/// allocation in groups of up to 16.
fn equal_parts(n: usize, w: usize) -> smallvec::SmallVec<[usize; 16]> {
    smallvec::SmallVec::from_elem(n, w)
}

fn meta(t: &Tensor<'_>) -> (DType, Device, bool) {
    (t.dtype(), t.device(), t.is_contiguous())
}
fn meta_mut(t: &TensorMut<'_>) -> (DType, Device, bool) {
    (t.dtype(), t.device(), t.is_contiguous())
}

/// The ops of a process group. Implemented by [`crate::ProcessGroup`] (ops
/// run at once, on the calling thread) and [`crate::Scope`] (ops run in the
/// background; the scope waits for them).
///
/// Every op takes [`OpOptions`] (timeout, hints) and returns a [`Work`].
/// Collectives must be issued in the same order on every rank of the group.
pub trait Collectives<'t>: sealed::Sealed {
    #[doc(hidden)]
    fn submit(&self, job: Job<'t>, opts: &OpOptions) -> Result<Work<'t>>;
    #[doc(hidden)]
    /// Where a direct send or receive of host tensors on `route` runs at
    /// once, without a job (the group's; none in a scope, which posts).
    fn direct_p2p(&self, _route: Route) -> Option<super::p2p::DirectP2p<'_>> {
        None
    }
    #[doc(hidden)]
    /// Where a direct small collective of host tensors goes first, without
    /// a job (the group's; none in a scope).
    fn fast_path(
        &self,
        _name: &'static str,
        _route: Route,
        _kind: OpKind,
        _dtype: DType,
        _opts: &OpOptions,
    ) -> Option<super::fast::FastPath<'_>> {
        None
    }
    #[doc(hidden)]
    /// The group the ops run on.
    fn group(&self) -> &super::ProcessGroup;
    /// This rank in the group.
    fn rank(&self) -> usize {
        self.group().core.rank
    }
    /// Number of ranks in the group.
    fn size(&self) -> usize {
        self.group().core.size
    }
    #[doc(hidden)]
    /// Whether ops are fingerprinted for `WEFT_DEBUG=detail`.
    fn debug_detail(&self) -> bool {
        self.group().core.debug_detail
    }

    /// Send `tensor` to rank `dst` under `tag` (at most [`MAX_USER_TAG`]).
    /// Messages with different tags may be received in any order; messages
    /// with the same tag are received in the order they were sent.
    ///
    /// Issued directly on a [`crate::ProcessGroup`], it returns once sent:
    /// a pattern where two ranks wait on each other (both send first, a ring
    /// exchange of long messages) needs a [`crate::Scope`], a
    /// [`Collectives::batch_p2p`] or [`Collectives::sendrecv`]. In a scope
    /// it is posted at once and completes whenever the peer allows,
    /// regardless of other ops (see [`crate::ProcessGroup::scope`]).
    fn send(&self, tensor: impl Into<Tensor<'t>>, dst: usize, tag: u32, opts: &OpOptions) -> Result<Work<'t>> {
        let data = tensor.into();
        let c = check(self, "send");
        c.peer(dst)?;
        user_tag(&c, tag)?;
        let (route, ..) = c.tensors([meta(&data)])?;
        if let Some(direct) = self.direct_p2p(route) {
            return Ok(direct.run(c.name, &mut [P2p::Send { peer: dst, tag: crate::tag::user(tag), data: data.host_bytes()? }], opts));
        }
        self.submit(job(&c, OpKind::Send, route, None, Op::Send { data, peer: dst, tag: crate::tag::user(tag) }), opts)
    }

    /// Receive into `tensor` from rank `src` the oldest message sent under `tag`;
    /// its size must equal the tensor's. Direct or in a scope, as
    /// [`Collectives::send`].
    fn recv(&self, tensor: impl Into<TensorMut<'t>>, src: usize, tag: u32, opts: &OpOptions) -> Result<Work<'t>> {
        let mut buf = tensor.into();
        let c = check(self, "recv");
        c.peer(src)?;
        user_tag(&c, tag)?;
        let (route, dtype, _) = c.tensors([meta_mut(&buf)])?;
        // (Received bools are cleaned on the way out of a job.)
        if let Some(direct) = self.direct_p2p(route).filter(|_| dtype != DType::Bool) {
            return Ok(direct.run(c.name, &mut [P2p::Recv { peer: src, tag: crate::tag::user(tag), buf: buf.host_bytes_mut()? }], opts));
        }
        self.submit(job(&c, OpKind::Recv, route, None, Op::Recv { buf, peer: src, tag: crate::tag::user(tag) }), opts)
    }

    /// Receive into `tensor` the oldest message sent to this rank under
    /// `tag` by any rank (`MPI_ANY_SOURCE`, torch's `recv(src=None)`); its
    /// size must equal the tensor's. Once finished, [`Work::source`] says
    /// which rank sent it. Direct or in a scope, as [`Collectives::recv`];
    /// on transports that can (cpu-tcp, shm, hierarchical), else
    /// `Unsupported`.
    fn recv_any(&self, tensor: impl Into<TensorMut<'t>>, tag: u32, opts: &OpOptions) -> Result<Work<'t>> {
        let buf = tensor.into();
        let c = check(self, "recv_any");
        if c.size < 2 {
            return Err(c.fail("a group of one rank has no other rank to receive from".into()));
        }
        user_tag(&c, tag)?;
        let (route, ..) = c.tensors([meta_mut(&buf)])?;
        self.submit(
            job(&c, OpKind::Recv, route, None, Op::Recv { buf, peer: crate::backend::ANY_SOURCE, tag: crate::tag::user(tag) }),
            opts,
        )
    }

    /// Post sends and receives as one unit with one [`Work`] (torch's
    /// `batch_isend_irecv`, NCCL's grouped calls): they progress together,
    /// in any order the peers allow, and the work completes once all have.
    /// All tensors must be on one device; an empty batch is done at once.
    fn batch_p2p(&self, ops: Vec<P2pOp<'t>>, opts: &OpOptions) -> Result<Work<'t>> {
        batch_job(self, check(self, "batch_p2p"), ops, opts)
    }

    /// Send `send` to `dst` and receive `recv` from `src` at once, both
    /// under `tag` (`MPI_Sendrecv`): a ring shift in one call, safe however
    /// long the messages.
    fn sendrecv(
        &self,
        send: impl Into<Tensor<'t>>,
        dst: usize,
        recv: impl Into<TensorMut<'t>>,
        src: usize,
        tag: u32,
        opts: &OpOptions,
    ) -> Result<Work<'t>> {
        let (send, mut recv) = (send.into(), recv.into());
        let c = check(self, "sendrecv");
        c.peer(dst)?;
        c.peer(src)?;
        user_tag(&c, tag)?;
        let (route, dtype, _) = c.tensors([meta_mut(&recv), meta(&send)])?;
        if let Some(direct) = self.direct_p2p(route).filter(|_| dtype != DType::Bool) {
            let tag = crate::tag::user(tag);
            let ops =
                &mut [P2p::Recv { peer: src, tag, buf: recv.host_bytes_mut()? }, P2p::Send { peer: dst, tag, data: send.host_bytes()? }];
            return Ok(direct.run(c.name, ops, opts));
        }
        // (An array, not a Vec: nothing to allocate on this latency-bound path.)
        batch_job(self, c, [P2pOp::recv(recv, src, tag), P2pOp::send(send, dst, tag)], opts)
    }

    /// Copy `root`'s tensor into every rank's tensor.
    fn broadcast(&self, tensor: impl Into<TensorMut<'t>>, root: usize, opts: &OpOptions) -> Result<Work<'t>> {
        let mut buf = tensor.into();
        let c = check(self, "broadcast");
        c.rank_arg("root", root)?;
        let (route, dtype, _) = c.tensors([meta_mut(&buf)])?;
        if let Some(fast) = self.fast_path(c.name, route, OpKind::Broadcast, dtype, opts) {
            let mut turn = fast.turn(opts);
            if let Some(w) = turn.fast(FastOp::Broadcast { buf: buf.host_bytes_mut()?, root }) {
                return Ok(w);
            }
            return turn.job(Op::Broadcast { buf, root }, opts);
        }
        let fp = c.fingerprint(OpKind::Broadcast, || format!("{dtype} x {} root {root}", buf.numel()));
        self.submit(job(&c, OpKind::Broadcast, route, fp, Op::Broadcast { buf, root }), opts)
    }

    /// Reduce every rank's tensor with `op`; the result replaces each tensor.
    fn all_reduce(&self, tensor: impl Into<TensorMut<'t>>, op: ReduceOp, opts: &OpOptions) -> Result<Work<'t>> {
        let mut buf = tensor.into();
        let c = check(self, "all_reduce");
        let (route, dtype, _) = c.tensors([meta_mut(&buf)])?;
        c.reduce_op(op, dtype)?;
        if let Some(fast) = self.fast_path(c.name, route, OpKind::AllReduce, dtype, opts) {
            let mut turn = fast.turn(opts);
            if let Some(w) = turn.fast(FastOp::AllReduce { buf: buf.host_bytes_mut()?, dtype, op }) {
                return Ok(w);
            }
            return turn.job(Op::AllReduce { buf, op }, opts);
        }
        let fp = c.fingerprint(OpKind::AllReduce, || format!("{dtype} x {} op {op}", buf.numel()));
        self.submit(job(&c, OpKind::AllReduce, route, fp, Op::AllReduce { buf, op }), opts)
    }

    /// Reduce every rank's tensor with `op` into `root`'s tensor; the other
    /// ranks' tensors are left unchanged.
    fn reduce(&self, tensor: impl Into<TensorMut<'t>>, root: usize, op: ReduceOp, opts: &OpOptions) -> Result<Work<'t>> {
        let buf = tensor.into();
        let c = check(self, "reduce");
        c.rank_arg("root", root)?;
        let (route, dtype, _) = c.tensors([meta_mut(&buf)])?;
        c.reduce_op(op, dtype)?;
        let fp = c.fingerprint(OpKind::Reduce, || format!("{dtype} x {} root {root} op {op}", buf.numel()));
        self.submit(job(&c, OpKind::Reduce, route, fp, Op::Reduce { buf, root, op }), opts)
    }

    /// `outputs[i]` receives rank i's `input`; every tensor has the same size.
    fn all_gather(&self, outputs: Vec<TensorMut<'t>>, input: impl Into<Tensor<'t>>, opts: &OpOptions) -> Result<Work<'t>> {
        let input = input.into();
        let c = check(self, "all_gather");
        c.list_len("outputs", outputs.len())?;
        for (i, o) in outputs.iter().enumerate() {
            c.numel(format_args!("outputs[{i}]"), o.numel(), input.numel())?;
        }
        gather_job(self, c, input, outputs, opts)
    }

    /// Rank i's `input` lands in the i-th of W equal parts of `output`.
    fn all_gather_single(&self, output: impl Into<TensorMut<'t>>, input: impl Into<Tensor<'t>>, opts: &OpOptions) -> Result<Work<'t>> {
        let (mut output, input) = (output.into(), input.into());
        let c = check(self, "all_gather_single");
        c.numel("output", output.numel(), input.numel() * c.size)?;
        let (route, dtype, _) = c.tensors([meta_mut(&output), meta(&input)])?;
        let part = input.nbytes();
        if let Some(fast) = self.fast_path(c.name, route, OpKind::AllGather, dtype, opts).filter(|_| part > 0) {
            let mut turn = fast.turn(opts);
            let outputs = output.host_bytes_mut()?.chunks_exact_mut(part).collect();
            if let Some(w) = turn.fast(FastOp::AllGather { input: input.host_bytes()?, outputs }) {
                return Ok(w);
            }
            let outputs = output.split_mut(&equal_parts(input.numel(), c.size)).map_err(|e| e.with_op(c.name))?;
            return turn.job(Op::AllGather { input, outputs }, opts);
        }
        let outputs = output.split_mut(&equal_parts(input.numel(), c.size)).map_err(|e| e.with_op(c.name))?;
        gather_job(self, c, input, outputs, opts)
    }

    /// `outputs[i]` receives rank i's `input`; sizes may differ per rank
    /// (every rank passes the same output sizes).
    fn all_gather_v(&self, outputs: Vec<TensorMut<'t>>, input: impl Into<Tensor<'t>>, opts: &OpOptions) -> Result<Work<'t>> {
        let input = input.into();
        let c = check(self, "all_gather_v");
        c.list_len("outputs", outputs.len())?;
        c.numel(format_args!("outputs[{}] (this rank's part)", c.rank), outputs[c.rank].numel(), input.numel())?;
        gather_job(self, c, input, outputs, opts)
    }

    /// `output` becomes the reduction over ranks of their `inputs[rank]`;
    /// every tensor has the same size.
    fn reduce_scatter(
        &self,
        output: impl Into<TensorMut<'t>>,
        inputs: Vec<Tensor<'t>>,
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<Work<'t>> {
        let output = output.into();
        let c = check(self, "reduce_scatter");
        c.list_len("inputs", inputs.len())?;
        for (i, t) in inputs.iter().enumerate() {
            c.numel(format_args!("inputs[{i}]"), t.numel(), output.numel())?;
        }
        scatter_reduce_job(self, c, output, inputs, op, opts)
    }

    /// The i-th of W equal parts of every rank's `input` is reduced into rank i's `output`.
    fn reduce_scatter_single(
        &self,
        output: impl Into<TensorMut<'t>>,
        input: impl Into<Tensor<'t>>,
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<Work<'t>> {
        let (mut output, input) = (output.into(), input.into());
        let c = check(self, "reduce_scatter_single");
        c.numel("input", input.numel(), output.numel() * c.size)?;
        let (route, dtype, _) = c.tensors([meta_mut(&output), meta(&input)])?;
        let part = output.nbytes();
        if let Some(fast) = self.fast_path(c.name, route, OpKind::ReduceScatter, dtype, opts).filter(|_| part > 0) {
            // (The job's path checks it in `scatter_reduce_job`.)
            c.reduce_op(op, dtype)?;
            let mut turn = fast.turn(opts);
            let inputs = input.host_bytes()?.chunks_exact(part).collect();
            if let Some(w) = turn.fast(FastOp::ReduceScatter { inputs, output: output.host_bytes_mut()?, dtype, op }) {
                return Ok(w);
            }
            let inputs = input.split(&equal_parts(output.numel(), c.size)).map_err(|e| e.with_op(c.name))?;
            return turn.job(Op::ReduceScatter { inputs, output, op }, opts);
        }
        let inputs = input.split(&equal_parts(output.numel(), c.size)).map_err(|e| e.with_op(c.name))?;
        scatter_reduce_job(self, c, output, inputs, op, opts)
    }

    /// `output` becomes the reduction over ranks of their `inputs[rank]`;
    /// sizes may differ per destination (every rank passes the same sizes).
    fn reduce_scatter_v(
        &self,
        output: impl Into<TensorMut<'t>>,
        inputs: Vec<Tensor<'t>>,
        op: ReduceOp,
        opts: &OpOptions,
    ) -> Result<Work<'t>> {
        let output = output.into();
        let c = check(self, "reduce_scatter_v");
        c.list_len("inputs", inputs.len())?;
        c.numel(format_args!("inputs[{}] (this rank's part)", c.rank), inputs[c.rank].numel(), output.numel())?;
        scatter_reduce_job(self, c, output, inputs, op, opts)
    }

    /// `outputs[i]` receives rank i's `inputs[rank]` (sizes may differ).
    fn all_to_all(&self, outputs: Vec<TensorMut<'t>>, inputs: Vec<Tensor<'t>>, opts: &OpOptions) -> Result<Work<'t>> {
        let c = check(self, "all_to_all");
        c.list_len("outputs", outputs.len())?;
        c.list_len("inputs", inputs.len())?;
        c.numel(format_args!("outputs[{}] (from this rank)", c.rank), outputs[c.rank].numel(), inputs[c.rank].numel())?;
        all_to_all_job(self, c, outputs, inputs, opts)
    }

    /// The i-th of W equal parts of `input` goes to rank i; the i-th part of
    /// `output` comes from rank i.
    fn all_to_all_single(&self, output: impl Into<TensorMut<'t>>, input: impl Into<Tensor<'t>>, opts: &OpOptions) -> Result<Work<'t>> {
        let (mut output, input) = (output.into(), input.into());
        let c = check(self, "all_to_all_single");
        c.numel("output", output.numel(), input.numel())?;
        if input.numel() % c.size != 0 {
            return Err(c.fail(format!("input has {} elements, not divisible by the group size {}", input.numel(), c.size)));
        }
        let (route, dtype, _) = c.tensors([meta_mut(&output), meta(&input)])?;
        let bytes = input.nbytes() / c.size;
        let part = || equal_parts(input.numel() / c.size, c.size);
        if let Some(fast) = self.fast_path(c.name, route, OpKind::AllToAll, dtype, opts).filter(|_| bytes > 0) {
            let mut turn = fast.turn(opts);
            let (inputs, outputs) =
                (input.host_bytes()?.chunks_exact(bytes).collect(), output.host_bytes_mut()?.chunks_exact_mut(bytes).collect());
            if let Some(w) = turn.fast(FastOp::AllToAll { inputs, outputs }) {
                return Ok(w);
            }
            let part = part();
            let inputs = input.split(&part).map_err(|e| e.with_op(c.name))?;
            let outputs = output.split_mut(&part).map_err(|e| e.with_op(c.name))?;
            return turn.job(Op::AllToAll { outputs, inputs }, opts);
        }
        let part = part();
        let inputs = input.split(&part).map_err(|e| e.with_op(c.name))?;
        let outputs = output.split_mut(&part).map_err(|e| e.with_op(c.name))?;
        all_to_all_job(self, c, outputs, inputs, opts)
    }

    /// As `all_to_all_single` with explicit split sizes (elements per rank).
    fn all_to_all_v_single(
        &self,
        output: impl Into<TensorMut<'t>>,
        input: impl Into<Tensor<'t>>,
        output_splits: &[usize],
        input_splits: &[usize],
        opts: &OpOptions,
    ) -> Result<Work<'t>> {
        let (output, input) = (output.into(), input.into());
        let c = check(self, "all_to_all_v_single");
        c.list_len("output_splits", output_splits.len())?;
        c.list_len("input_splits", input_splits.len())?;
        c.numel("input (sum of input_splits)", input.numel(), input_splits.iter().sum())?;
        c.numel("output (sum of output_splits)", output.numel(), output_splits.iter().sum())?;
        c.numel("output_splits[rank]", output_splits[c.rank], input_splits[c.rank])?;
        c.tensors([meta_mut(&output), meta(&input)])?;
        let inputs = input.split(input_splits).map_err(|e| e.with_op(c.name))?;
        let outputs = output.split_mut(output_splits).map_err(|e| e.with_op(c.name))?;
        all_to_all_job(self, c, outputs, inputs, opts)
    }

    /// At `root`, `outputs[i]` receives rank i's `input`; other ranks'
    /// `outputs` are ignored (empty or not, as in MPI).
    fn gather(&self, outputs: Vec<TensorMut<'t>>, input: impl Into<Tensor<'t>>, root: usize, opts: &OpOptions) -> Result<Work<'t>> {
        let input = input.into();
        let c = check(self, "gather");
        c.rank_arg("root", root)?;
        let outputs = root_list(&c, root, "outputs", outputs)?;
        for (i, o) in outputs.iter().enumerate() {
            c.numel(format_args!("outputs[{i}]"), o.numel(), input.numel())?;
        }
        let (route, dtype, _) = c.tensors(std::iter::once(meta(&input)).chain(outputs.iter().map(meta_mut)))?;
        let fp = c.fingerprint(OpKind::Gather, || format!("{dtype} x {} root {root}", input.numel()));
        self.submit(job(&c, OpKind::Gather, route, fp, Op::Gather { input, outputs, root }), opts)
    }

    /// Every rank's `output` receives `root`'s `inputs[rank]`; other ranks'
    /// `inputs` are ignored (empty or not, as in MPI).
    fn scatter(&self, output: impl Into<TensorMut<'t>>, inputs: Vec<Tensor<'t>>, root: usize, opts: &OpOptions) -> Result<Work<'t>> {
        let output = output.into();
        let c = check(self, "scatter");
        c.rank_arg("root", root)?;
        let inputs = root_list(&c, root, "inputs", inputs)?;
        for (i, t) in inputs.iter().enumerate() {
            c.numel(format_args!("inputs[{i}]"), t.numel(), output.numel())?;
        }
        let (route, dtype, _) = c.tensors(std::iter::once(meta_mut(&output)).chain(inputs.iter().map(meta)))?;
        let fp = c.fingerprint(OpKind::Scatter, || format!("{dtype} x {} root {root}", output.numel()));
        self.submit(job(&c, OpKind::Scatter, route, fp, Op::Scatter { inputs, output, root }), opts)
    }

    /// Reduce every rank's sparse COO tensor `input` (SUM, MIN or MAX over
    /// the union of indices) into `output` (first, as in every op): a new
    /// coalesced tensor, identical on every rank. All ranks must pass the same shape, dtype, op and hint
    /// `sparse_algorithm=auto|allgather|recursive_doubling|split|dense` (which
    /// forces an algorithm); a mismatch is an error on every rank naming the
    /// ranks and both calls.
    fn all_reduce_sparse(&self, output: &'t mut SparseCoo, input: SparseCooTensor<'t>, op: ReduceOp, opts: &OpOptions) -> Result<Work<'t>> {
        let c = check(self, "all_reduce_sparse");
        crate::algorithms::sparse::op_code(op).map_err(|e| c.fail(e.message().to_string()))?;
        let dtype = input.values.dtype();
        c.reduce_op(op, dtype)?;
        if !input.indices.is_contiguous() || !input.values.is_contiguous() {
            return Err(c.fail("sparse indices and values must be contiguous".into()));
        }
        let route = (input.device().kind(), Layout::SparseCoo);
        let fp = c.fingerprint(OpKind::AllReduceSparse, || format!("{dtype} shape {:?} op {op}", input.shape));
        self.submit(job(&c, OpKind::AllReduceSparse, route, fp, Op::AllReduceSparse { input: Box::new(input), output, op }), opts)
    }

    /// Return once every rank has entered the barrier (and, as collectives
    /// of a group run in order, once this rank's earlier collectives have
    /// finished; point-to-point ops are not ordered with it).
    fn barrier(&self, opts: &OpOptions) -> Result<Work<'t>> {
        let c = check(self, "barrier");
        let route = (crate::tensor::DeviceKind::Cpu, Layout::Dense);
        if let Some(fast) = self.fast_path(c.name, route, OpKind::Barrier, DType::U8, opts) {
            let mut turn = fast.turn(opts);
            if let Some(w) = turn.fast(FastOp::Barrier) {
                return Ok(w);
            }
            return turn.job(Op::Barrier, opts);
        }
        let fp = c.fingerprint(OpKind::Barrier, String::new);
        self.submit(job(&c, OpKind::Barrier, route, fp, Op::Barrier), opts)
    }
}

fn check<'t, G: Collectives<'t> + ?Sized>(g: &G, name: &'static str) -> Check {
    Check { name, rank: g.rank(), size: g.size(), detail: g.debug_detail() }
}

fn job<'t>(c: &Check, kind: OpKind, route: Route, fingerprint: Option<Fingerprint>, op: Op<'t>) -> Job<'t> {
    Job { name: c.name, kind, route, fingerprint, op, algorithm: None, segment_bytes: None, native: true }
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

fn user_tag(c: &Check, tag: u32) -> Result<()> {
    if tag > MAX_USER_TAG {
        return Err(c.fail(format!("tag {tag} is above the largest user tag {MAX_USER_TAG}")));
    }
    Ok(())
}

/// A list that only `root` reads (gather's outputs, scatter's inputs): one
/// tensor per rank there; elsewhere whatever the caller passes is left
/// alone (MPI's rule), so every rank can run the same code.
fn root_list<T>(c: &Check, root: usize, what: &str, list: Vec<T>) -> Result<Vec<T>> {
    if c.rank != root {
        return Ok(Vec::new());
    }
    c.list_len(what, list.len())?;
    Ok(list)
}

/// `ops` as one job (batch_p2p's, and sendrecv's where the direct path does not take it):
/// each peer and tag checked, all tensors on one device.
fn batch_job<'t, G: Collectives<'t> + ?Sized>(
    g: &G,
    c: Check,
    ops: impl IntoIterator<Item = P2pOp<'t>, IntoIter: ExactSizeIterator>,
    opts: &OpOptions,
) -> Result<Work<'t>> {
    let ops = ops.into_iter();
    let mut batch = Vec::with_capacity(ops.len());
    for op in ops {
        match op {
            P2pOp::Send { tensor, peer, tag } => {
                c.peer(peer)?;
                user_tag(&c, tag)?;
                batch.push(Op::Send { data: tensor, peer, tag: crate::tag::user(tag) });
            }
            P2pOp::Recv { tensor, peer, tag } => {
                c.peer(peer)?;
                user_tag(&c, tag)?;
                batch.push(Op::Recv { buf: tensor, peer, tag: crate::tag::user(tag) });
            }
        }
    }
    if batch.is_empty() {
        return Ok(Work::done(Ok(()), None));
    }
    let (route, ..) = c.tensors(batch.iter().map(|op| match op {
        Op::Send { data, .. } => meta(data),
        Op::Recv { buf, .. } => meta_mut(buf),
        _ => unreachable!("a batch of sends and receives"),
    }))?;
    g.submit(job(&c, OpKind::Send, route, None, Op::Batch { ops: batch }), opts)
}

fn gather_job<'t, G: Collectives<'t> + ?Sized>(
    g: &G,
    c: Check,
    input: Tensor<'t>,
    outputs: Vec<TensorMut<'t>>,
    opts: &OpOptions,
) -> Result<Work<'t>> {
    let (route, dtype, _) = c.tensors(std::iter::once(meta(&input)).chain(outputs.iter().map(meta_mut)))?;
    let fp = c.fingerprint(OpKind::AllGather, || format!("{dtype} counts {:?}", outputs.iter().map(|o| o.numel()).collect::<Vec<_>>()));
    g.submit(job(&c, OpKind::AllGather, route, fp, Op::AllGather { input, outputs }), opts)
}

fn scatter_reduce_job<'t, G: Collectives<'t> + ?Sized>(
    g: &G,
    c: Check,
    output: TensorMut<'t>,
    inputs: Vec<Tensor<'t>>,
    op: ReduceOp,
    opts: &OpOptions,
) -> Result<Work<'t>> {
    let (route, dtype, _) = c.tensors(std::iter::once(meta_mut(&output)).chain(inputs.iter().map(meta)))?;
    c.reduce_op(op, dtype)?;
    let fp = c.fingerprint(OpKind::ReduceScatter, || {
        format!("{dtype} counts {:?} op {op}", inputs.iter().map(|t| t.numel()).collect::<Vec<_>>())
    });
    g.submit(job(&c, OpKind::ReduceScatter, route, fp, Op::ReduceScatter { inputs, output, op }), opts)
}

fn all_to_all_job<'t, G: Collectives<'t> + ?Sized>(
    g: &G,
    c: Check,
    outputs: Vec<TensorMut<'t>>,
    inputs: Vec<Tensor<'t>>,
    opts: &OpOptions,
) -> Result<Work<'t>> {
    let (route, dtype, _) = c.tensors(inputs.iter().map(meta).chain(outputs.iter().map(meta_mut)))?;
    let fp = c.fingerprint(OpKind::AllToAll, || format!("{dtype}"));
    g.submit(job(&c, OpKind::AllToAll, route, fp, Op::AllToAll { inputs, outputs }), opts)
}
