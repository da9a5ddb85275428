"""Every c10d op, by the names and arguments c10d calls a backend with,
turned into weft ops on the native group.

Here torch's conventions become weft's: option objects, reduce ops, split
sizes in rows of dim 0, nested output lists, sparse tensors. Tensors are
checked and staged in `_tensors.py`; weft itself validates sizes, roots,
peers and tags.

With weft's C++ backend, the common ops on dense contiguous CPU tensors
do not come here: it issues them through weft's C API
(`_c10d/native.hpp`), with the same conventions, and hands this module
the rest (tensors to stage, CUDA and sparse tensors, coalescing).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from . import _weft
from ._reduce_op import _Kind
from ._tensors import Staged, capturing
from ._work import Work, _seconds

_RED = dist.ReduceOp.RedOpType
_REDUCE_NAMES = {
    _RED.SUM: "sum",
    _RED.PRODUCT: "product",
    _RED.MIN: "min",
    _RED.MAX: "max",
    _RED.BAND: "band",
    _RED.BOR: "bor",
    _RED.BXOR: "bxor",
    _RED.AVG: "avg",
}
_SUM = _RED.SUM


class Call(NamedTuple):
    """What every native op takes after its tensors, in the order
    `python/src/options.rs` reads it."""

    #: The objects keeping the op's tensors alive until it has finished.
    keep: list
    #: The op's timeout in seconds (None: the group's).
    timeout: float | None
    #: The op's hints (keys weft does not know are ignored), or None.
    hints: dict | None
    #: Run it on this thread (a synchronous call) instead of in the background.
    direct: bool


def reduce_name(op) -> str:
    """weft's name of a c10d reduce op (`ReduceOp`, `RedOpType`, or one
    made by `_make_nccl_premul_sum`) or of a `weft.ReduceOp`."""
    if op == _SUM:  # the common case, without the slower lookup below
        return "sum"
    if isinstance(op, _Kind):
        return op.weft_name()
    kind = getattr(op, "op", op)
    if kind == _RED.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if isinstance(factor, torch.Tensor):
            factor = factor.item()
        if factor is None:
            raise ValueError("weft: PREMUL_SUM needs a factor (torch.distributed._make_nccl_premul_sum)")
        return f"premul_sum({float(factor)!r})"
    try:
        return _REDUCE_NAMES[kind]
    except KeyError:
        raise ValueError(f"weft: unsupported reduce op {op}") from None


def _rows_to_elements(t: torch.Tensor, splits):
    """Split sizes in rows of dim 0 (torch's) as element counts (weft's)."""
    if not splits:
        return None
    row = math.prod(t.shape[1:])  # 1 for a 1-D tensor
    return [int(s) * row for s in splits]


def split_elements(output: torch.Tensor, input: torch.Tensor, output_splits, input_splits, world: int):
    """An all_to_all_single's split sizes (rows of dim 0, either side may
    be missing or empty) as weft's element counts: both None for equal
    parts; one side given, the other is equal parts of its tensor."""
    outs = _rows_to_elements(output, output_splits)
    ins = _rows_to_elements(input, input_splits)
    if outs is None and ins is not None:
        outs = [output.numel() // world] * world
    elif ins is None and outs is not None:
        ins = [input.numel() // world] * world
    return outs, ins


class Ops:
    """The op methods c10d calls; a class using it sets `self._native` (the
    native group) and `self._timeout` (seconds) before any op runs."""

    _native: _weft.Group
    _timeout: float | None = None

    # -- helpers -----------------------------------------------------------

    def _begin(self, opts) -> tuple[Staged, Call]:
        """An op's staging and its native call settings (see `_call`)."""
        s = Staged()
        return s, self._call(s, opts)

    def _call(self, s: Staged, opts) -> Call:
        """The native ops' call settings. A synchronous torch call
        (`opts.asyncOp` False), or any call while the current CUDA stream
        captures a graph (see `capturing`), runs directly on this thread,
        with no hand-over to weft's threads."""
        timeout = _seconds(getattr(opts, "timeout", None)) or self._timeout
        return Call(s.keep, timeout, None, not getattr(opts, "asyncOp", True) or capturing())

    def _p2p_call(self, s: Staged, tensors) -> Call:
        """Sends and receives run in the background: torch's `isend` and
        `irecv` must not block, and its blocking `send` and `recv` wait on
        the work. Those of CUDA `tensors` whose stream captures a CUDA
        graph run directly (see `capturing`): only their small records
        wait for the peer's host, their device work is queued on the
        capturing stream. (Host tensors stay in the background: two ranks
        that both send first must not block.)"""
        return Call(s.keep, self._timeout, None, capturing(tensors))

    @staticmethod
    def _work_of(s: Staged, natives, outputs, call: Call, on_error=None) -> Work:
        """The Work of ops issued with `call` (finished already if direct);
        `on_error` sees a failure of one that was not."""
        return Work(natives, outputs, s.finish if s.needs_finish else None, done=call.direct, on_error=on_error)

    def _work(self, s: Staged, natives, outputs, call: Call, finish=None) -> Work:
        """The Work of this group's ops issued with `call`; `finish` (else
        the staging's copy-back) runs once they have succeeded. While the
        group coalesces, the batch's Work covers them too, finish included:
        torch hands out the batch's Work instead of this one."""
        if finish is None and s.needs_finish:
            finish = s.finish
        batch = self._shared.get("batch")
        if batch is not None:
            batch.natives.extend(natives)
            if finish is not None:
                batch.finishes.append(finish)  # again if this Work ran it: the same bytes
        return Work(natives, outputs, finish, done=call.direct)

    # -- coalescing (see `start_coalescing`) ---------------------------------

    def _issue_batch(self, batch: _Batch) -> Work:
        """Issue a batch's sends and receives as one native batch; its Work
        (the one its sends and receives returned) covers them and the
        collectives issued while it was open."""
        s = batch.staged
        natives = list(batch.natives)
        if batch.p2p:
            natives.append(self._native.batch_p2p(batch.p2p, self._p2p_call(s, batch.outputs)))
        finishes = ([s.finish] if s.needs_finish else []) + batch.finishes
        batch.work._rebind(natives, batch.outputs, (lambda: [f() for f in finishes]) if finishes else None)
        return batch.work

    # -- collectives -------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        opts = opts or c10d.AllreduceOptions()
        name = reduce_name(opts.reduceOp)
        if tensors and tensors[0].is_sparse:
            return self._allreduce_sparse(tensors, name, opts)
        s, call = self._begin(opts)
        natives = [self._native.all_reduce(s.output(x), name, call) for x in tensors]
        return self._work(s, natives, list(tensors), call)

    def allreduce_coalesced(self, tensors, opts=None):
        """Several tensors reduced as one op (torch's coalesced all_reduce
        and `_coalescing_manager`): tensors of one dtype and device are
        packed into one buffer, reduced once, and unpacked, as gloo does;
        else one op per tensor under one Work."""
        opts = opts or c10d.AllreduceCoalescedOptions()
        if len(tensors) < 2 or tensors[0].is_sparse or any(t.dtype != tensors[0].dtype or t.device != tensors[0].device for t in tensors):
            return self.allreduce(tensors, opts)
        name = reduce_name(opts.reduceOp)
        flat = torch.cat([t.reshape(-1) for t in tensors])
        s, call = self._begin(opts)
        native = self._native.all_reduce(s.output(flat), name, call)

        def unpack():
            at = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[at : at + n].view_as(t))
                at += n

        return self._work(s, [native], list(tensors), call, finish=unpack)

    def _allreduce_sparse(self, tensors, name, opts):
        if len(tensors) != 1:
            raise ValueError("weft: a sparse all_reduce takes one tensor")
        (x,) = tensors
        if name not in ("sum", "min", "max"):
            raise ValueError(f"weft: a sparse all_reduce supports SUM, MIN and MAX, not {name}")
        s = Staged()
        indices = x._indices().to(torch.int64)
        values = x._values()
        native = self._native.all_reduce_sparse(s.input(indices), x.sparse_dim(), s.input(values), list(x.shape), name, self._call(s, opts))

        def result():
            raw_i, raw_v, nnz = native.sparse_result()
            i = torch.frombuffer(bytearray(raw_i), dtype=torch.int64) if nnz else torch.empty(0, dtype=torch.int64)
            v = torch.frombuffer(bytearray(raw_v), dtype=values.dtype) if nnz else torch.empty(0, dtype=values.dtype)
            i = i.reshape(x.sparse_dim(), nnz)
            v = v.reshape((nnz,) + tuple(values.shape[1:]))
            return [torch.sparse_coo_tensor(i, v, x.shape, is_coalesced=True)]

        # torch's backends leave a sparse all_reduce's result in its input.
        return Work([native], [x], lambda: _replace_sparse(x, result()[0]), result)

    def broadcast(self, tensors, opts=None):
        opts = opts or c10d.BroadcastOptions()
        s, call = self._begin(opts)
        natives = [self._native.broadcast(s.output(x), opts.rootRank, call) for x in tensors]
        return self._work(s, natives, list(tensors), call)

    def reduce(self, tensors, opts=None):
        opts = opts or c10d.ReduceOptions()
        name = reduce_name(opts.reduceOp)
        s, call = self._begin(opts)
        natives = [self._native.reduce(s.output(x), opts.rootRank, name, call) for x in tensors]
        return self._work(s, natives, list(tensors), call)

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or c10d.AllgatherOptions()
        s, call = self._begin(opts)
        natives = []
        for outs, x in zip(output_lists, inputs, strict=True):
            uneven = any(o.numel() != x.numel() for o in outs)
            natives.append(self._native.all_gather(s.outputs(outs), s.input(x), uneven, call))
        return self._work(s, natives, list(output_lists), call)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        # Here out[r][j] is input j of rank r (the other nesting of allgather).
        per_input = [list(col) for col in zip(*output_lists, strict=True)] if output_lists else []
        w = self.allgather(per_input, inputs, opts)
        w._outputs = list(output_lists)
        return w

    def all_gather_single(self, output, input, opts=None):
        return self.all_gather_single_coalesced([output], [input], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or c10d.AllgatherOptions()
        s, call = self._begin(opts)
        natives = [self._native.all_gather_single(s.output(o), s.input(i), call) for o, i in zip(outputs, inputs, strict=True)]
        return self._work(s, natives, list(outputs), call)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        name = reduce_name(opts.reduceOp)
        s, call = self._begin(opts)
        natives = []
        for o, ins in zip(outputs, input_lists, strict=True):
            uneven = any(i.numel() != o.numel() for i in ins)
            natives.append(self._native.reduce_scatter(s.output(o), s.inputs(ins), name, uneven, call))
        return self._work(s, natives, list(outputs), call)

    def reduce_scatter_single(self, output, input, opts=None):
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        name = reduce_name(opts.reduceOp)
        s, call = self._begin(opts)
        natives = [self._native.reduce_scatter_single(s.output(o), s.input(i), name, call) for o, i in zip(outputs, inputs, strict=True)]
        return self._work(s, natives, list(outputs), call)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, outputs, inputs, opts=None):
        opts = opts or c10d.AllToAllOptions()
        s, call = self._begin(opts)
        native = self._native.all_to_all(s.outputs(outputs), s.inputs(inputs), call)
        return self._work(s, [native], list(outputs), call)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, opts=None):
        opts = opts or c10d.AllToAllOptions()
        s, call = self._begin(opts)
        outs, ins = split_elements(output, input, output_split_sizes, input_split_sizes, self.size())
        native = self._native.all_to_all_single(s.output(output), s.input(input), outs, ins, call)
        return self._work(s, [native], [output], call)

    alltoall_base = all_to_all_single

    def gather(self, output_lists, inputs, opts=None):
        opts = opts or c10d.GatherOptions()
        s, call = self._begin(opts)
        outs = s.outputs(output_lists[0]) if output_lists else []
        (x,) = inputs
        native = self._native.gather(outs, s.input(x), opts.rootRank, call)
        return self._work(s, [native], list(output_lists), call)

    def gather_single(self, output, input, opts=None):
        """At the root, `output` (``[W * n]`` or ``[W, *input.shape]``)
        receives rank i's `input` in its i-th part; elsewhere `output` is
        not touched (torch's ``gather_single`` / ``gather_into_tensor``)."""
        opts = opts or c10d.GatherOptions()
        s, call = self._begin(opts)
        root = opts.rootRank
        if self.rank() == root:
            world = self.size()
            if output.numel() != input.numel() * world:
                raise ValueError(f"weft: gather_single's output has {output.numel()} elements, not {world} x {input.numel()}")
            if output.dtype != input.dtype:
                raise TypeError(f"weft: gather_single's output is {output.dtype}, its input {input.dtype}")
            parts = list(s.staged_output(output).view(world, -1).unbind(0))
            outs = [s.output(p) for p in parts]
        else:
            outs = []
        native = self._native.gather(outs, s.input(input), root, call)
        return self._work(s, [native], [output], call)

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts or c10d.ScatterOptions()
        s, call = self._begin(opts)
        ins = s.inputs(input_lists[0]) if input_lists else []
        (o,) = outputs
        native = self._native.scatter(s.output(o), ins, opts.rootRank, call)
        return self._work(s, [native], list(outputs), call)

    def barrier(self, opts=None):
        s, call = self._begin(opts or c10d.BarrierOptions())
        return self._work(s, [self._native.barrier(call)], [], call)

    # -- point to point ----------------------------------------------------

    def send(self, tensors, dst, tag=0):
        batch = self._shared.get("batch")
        if batch is not None:
            return batch.add(True, tensors, dst, tag)
        s = Staged()
        call = self._p2p_call(s, tensors)
        natives = [self._native.send(s.input(x), dst, tag, call) for x in tensors]
        return self._work(s, natives, list(tensors), call)

    def recv(self, tensors, src, tag=0):
        batch = self._shared.get("batch")
        if batch is not None:
            return batch.add(False, tensors, src, tag)
        s = Staged()
        call = self._p2p_call(s, tensors)
        natives = [self._native.recv(s.output(x), src, tag, call) for x in tensors]
        return self._work(s, natives, list(tensors), call)

    def recv_anysource(self, tensors, tag=0):
        s = Staged()
        call = self._p2p_call(s, tensors)
        natives = [self._native.recv_any(s.output(x), tag, call) for x in tensors]
        return self._work(s, natives, list(tensors), call)


class _Batch:
    """Sends and receives collected while a group coalesces, issued as one
    native batch at its end. Each returns the batch's Work, which completes
    with the whole batch (ask it after the batch has ended)."""

    __slots__ = ("p2p", "staged", "natives", "finishes", "outputs", "work")

    def __init__(self):
        self.p2p: list = []
        self.staged = Staged()
        self.natives: list = []
        #: What the batch's Work runs once every op has succeeded.
        self.finishes: list = []
        self.outputs: list = []
        self.work = Work([], [])

    def add(self, send: bool, tensors, peer: int, tag: int) -> Work:
        for x in tensors:
            desc = self.staged.input(x) if send else self.staged.output(x)
            self.p2p.append((send, desc, peer, tag))
            self.outputs.append(x)
        return self.work


def _replace_sparse(x: torch.Tensor, out: torch.Tensor) -> None:
    """Leave `out` in the sparse tensor `x`, as torch's backends do."""
    x.resize_as_(out)
    x.copy_(out)


__all__ = ["Call", "Ops", "reduce_name"]
