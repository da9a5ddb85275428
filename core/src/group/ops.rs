//! Every op of a group ([`Collectives`]): local validation, then its
//! route (`route.rs`: a collective's; a send's or receive's here, the
//! direct path where the issuer offers it, else a job).
//!
//! Validation happens here, before any byte moves: sizes, dtypes, devices,
//! roots, peers, split sizes, tags and reduce ops. What cannot be checked
//! locally (the other ranks' sizes) is checked by the transport, which
//! rejects a message whose length differs from the posted receive.

use super::check::{meta, meta_mut, Check};
use super::job::Job;
use super::route::{run, Call, Issuer};
use super::work::Work;
use crate::backend::{Op, OpKind, P2p};
use crate::dtype::DType;
use crate::error::Result;
use crate::options::OpOptions;
use crate::reduce_op::ReduceOp;
use crate::tag::MAX_USER_TAG;
use crate::tensor::{Layout, SparseCoo, SparseCooTensor, Tensor, TensorMut};

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

/// The ops of a process group. Implemented by [`crate::ProcessGroup`] (ops
/// run at once, on the calling thread) and [`crate::Scope`] (ops run in the
/// background; the scope waits for them).
///
/// Every op takes [`OpOptions`] (timeout, hints) and returns a [`Work`].
/// Collectives must be issued in the same order on every rank of the group.
pub trait Collectives<'t>: Issuer<'t> {
    /// This rank in the group.
    fn rank(&self) -> usize {
        self.group().core.rank
    }
    /// Number of ranks in the group.
    fn size(&self) -> usize {
        self.group().core.size
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
        self.submit(Job::new(c.name, OpKind::Send, route, None, Op::Send { data, peer: dst, tag: crate::tag::user(tag) }), opts)
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
        self.submit(Job::new(c.name, OpKind::Recv, route, None, Op::Recv { buf, peer: src, tag: crate::tag::user(tag) }), opts)
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
            Job::new(c.name, OpKind::Recv, route, None, Op::Recv { buf, peer: crate::backend::ANY_SOURCE, tag: crate::tag::user(tag) }),
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
        let buf = tensor.into();
        let c = check(self, "broadcast");
        c.rank_arg("root", root)?;
        let (route, dtype, _) = c.tensors([meta_mut(&buf)])?;
        run(self, &c, OpKind::Broadcast, route, dtype, Call::Op(Op::Broadcast { buf, root }), opts)
    }

    /// Reduce every rank's tensor with `op`; the result replaces each tensor.
    fn all_reduce(&self, tensor: impl Into<TensorMut<'t>>, op: ReduceOp, opts: &OpOptions) -> Result<Work<'t>> {
        let buf = tensor.into();
        let c = check(self, "all_reduce");
        let (route, dtype, _) = c.tensors([meta_mut(&buf)])?;
        c.reduce_op(op, dtype)?;
        run(self, &c, OpKind::AllReduce, route, dtype, Call::Op(Op::AllReduce { buf, op }), opts)
    }

    /// Reduce every rank's tensor with `op` into `root`'s tensor; the other
    /// ranks' tensors are left unchanged.
    fn reduce(&self, tensor: impl Into<TensorMut<'t>>, root: usize, op: ReduceOp, opts: &OpOptions) -> Result<Work<'t>> {
        let buf = tensor.into();
        let c = check(self, "reduce");
        c.rank_arg("root", root)?;
        let (route, dtype, _) = c.tensors([meta_mut(&buf)])?;
        c.reduce_op(op, dtype)?;
        run(self, &c, OpKind::Reduce, route, dtype, Call::Op(Op::Reduce { buf, root, op }), opts)
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
        let (output, input) = (output.into(), input.into());
        let c = check(self, "all_gather_single");
        c.numel("output", output.numel(), input.numel() * c.size)?;
        let (route, dtype, _) = c.tensors([meta_mut(&output), meta(&input)])?;
        run(self, &c, OpKind::AllGather, route, dtype, Call::AllGatherSingle { output, input }, opts)
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
        let (output, input) = (output.into(), input.into());
        let c = check(self, "reduce_scatter_single");
        c.numel("input", input.numel(), output.numel() * c.size)?;
        let (route, dtype, _) = c.tensors([meta_mut(&output), meta(&input)])?;
        c.reduce_op(op, dtype)?;
        run(self, &c, OpKind::ReduceScatter, route, dtype, Call::ReduceScatterSingle { output, input, op }, opts)
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
        let (output, input) = (output.into(), input.into());
        let c = check(self, "all_to_all_single");
        c.numel("output", output.numel(), input.numel())?;
        if input.numel() % c.size != 0 {
            return Err(c.fail(format!("input has {} elements, not divisible by the group size {}", input.numel(), c.size)));
        }
        let (route, dtype, _) = c.tensors([meta_mut(&output), meta(&input)])?;
        run(self, &c, OpKind::AllToAll, route, dtype, Call::AllToAllSingle { output, input }, opts)
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
        run(self, &c, OpKind::Gather, route, dtype, Call::Op(Op::Gather { input, outputs, root }), opts)
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
        run(self, &c, OpKind::Scatter, route, dtype, Call::Op(Op::Scatter { inputs, output, root }), opts)
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
        let op = Op::AllReduceSparse { input: Box::new(input), output, op };
        run(self, &c, OpKind::AllReduceSparse, route, dtype, Call::Op(op), opts)
    }

    /// Return once every rank has entered the barrier (and, as collectives
    /// of a group run in order, once this rank's earlier collectives have
    /// finished; point-to-point ops are not ordered with it).
    fn barrier(&self, opts: &OpOptions) -> Result<Work<'t>> {
        let c = check(self, "barrier");
        let route = (crate::tensor::DeviceKind::Cpu, Layout::Dense);
        run(self, &c, OpKind::Barrier, route, DType::U8, Call::Op(Op::Barrier), opts)
    }
}

fn check<'t, G: Collectives<'t> + ?Sized>(g: &G, name: &'static str) -> Check {
    let core = &g.group().core;
    Check { name, rank: core.rank, size: core.size, detail: core.debug_detail }
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
    g.submit(Job::new(c.name, OpKind::Send, route, None, Op::Batch { ops: batch }), opts)
}

/// A list-form all_gather (sizes checked by the caller).
fn gather_job<'t, G: Collectives<'t> + ?Sized>(
    g: &G,
    c: Check,
    input: Tensor<'t>,
    outputs: Vec<TensorMut<'t>>,
    opts: &OpOptions,
) -> Result<Work<'t>> {
    let (route, dtype, _) = c.tensors(std::iter::once(meta(&input)).chain(outputs.iter().map(meta_mut)))?;
    run(g, &c, OpKind::AllGather, route, dtype, Call::Op(Op::AllGather { input, outputs }), opts)
}

/// A list-form reduce_scatter (sizes checked by the caller).
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
    run(g, &c, OpKind::ReduceScatter, route, dtype, Call::Op(Op::ReduceScatter { inputs, output, op }), opts)
}

/// A list-form all_to_all (sizes checked by the caller).
fn all_to_all_job<'t, G: Collectives<'t> + ?Sized>(
    g: &G,
    c: Check,
    outputs: Vec<TensorMut<'t>>,
    inputs: Vec<Tensor<'t>>,
    opts: &OpOptions,
) -> Result<Work<'t>> {
    let (route, dtype, _) = c.tensors(inputs.iter().map(meta).chain(outputs.iter().map(meta_mut)))?;
    run(g, &c, OpKind::AllToAll, route, dtype, Call::Op(Op::AllToAll { inputs, outputs }), opts)
}
