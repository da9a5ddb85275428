"""Mixture-of-experts token dispatch and combine (expert parallelism) on
weft, with autograd.

With ``E`` experts over ``W`` ranks, rank r holds experts ``r*E/W ..
(r+1)*E/W``::

    expert_x, counts, handle = weft.moe.dispatch(x, topk_idx, num_experts)
    # expert_x: this rank's experts' tokens, grouped by local expert;
    # counts[e]: how many rows local expert e got.
    expert_out = run_experts(expert_x, counts)
    y = weft.moe.combine(expert_out, handle, topk_weights)
    # y[t] = sum over token t's experts j of topk_weights[t, j] * expert_j(x[t])

- ``x`` is ``[tokens, hidden]`` (float32, float64, float16, bfloat16),
  ``topk_idx`` ``[tokens, k]`` expert ids (``-1``: none), ``topk_weights``
  ``[tokens, k]``. A rank may have no tokens.
- A token crosses to a rank once however many of its experts live there,
  and combine sums a token's rows on each rank (weighted) before they
  travel back: one row per (token, rank) each way.
- The counts travel with the data: each rank's message to another starts
  with a small header (whether its routing is valid, what every rank must
  agree on, how many rows follow), then the rows and each token's local
  experts. A first part of fixed size (16 KiB up to 16 ranks, less beyond:
  256 KiB in all) carries the header and what fits; only a longer message
  sends the rest in a second exchange. The caller does no count exchange
  or host synchronisation of its own. The handle keeps the layout:
  combine, the backward passes and :func:`dispatch_again` reuse it without
  a header.
- Gradients flow to ``x``, to ``expert_out`` and to ``topk_weights``
  (dispatch's backward is a combine, combine's a dispatch). The backward
  passes are collective: every rank must run them (as with
  ``all_to_all_single`` in autograd).
- Invalid routing on any rank (an expert id out of range, ``num_experts``
  not divisible by ``W``, ranks that disagree on ``hidden`` or the dtype)
  raises on every rank; never wrong data.
- ``group``: a ``torch.distributed`` group that runs on weft, a weft
  :class:`~weft.Comm`, or None (the default: see ``weft._default``). CUDA
  tensors are staged through host memory.
"""

from __future__ import annotations

import torch

from . import _weft
from ._default import comm_of
from ._tensors import desc

__all__ = ["Handle", "dispatch", "dispatch_again", "combine"]

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class Handle:
    """How one :func:`dispatch` routed its tokens, on this rank: what
    :func:`combine`, :func:`dispatch_again` and the backward passes reuse."""

    def __init__(self, native: _weft.Group, tokens: int, k: int, hidden: int, timeout: float | None):
        self._native = native
        self._routing = None
        self.tokens = tokens
        self.k = k
        self.hidden = hidden
        self._timeout = timeout

    @property
    def counts(self) -> list[int]:
        """Rows this rank's experts received, per local expert."""
        return self._routing.counts()

    @property
    def rows(self) -> int:
        """Rows this rank's experts received in all."""
        return self._routing.rows()

    def bytes_sent(self, dtype: torch.dtype) -> int:
        """Bytes of rows of ``dtype`` one dispatch sends from this rank to
        the others (one row per token and other rank it goes to); a combine
        sends the same back."""
        return self._routing.bytes_sent(desc(torch.empty(0, dtype=dtype))[2])

    # -- the exchanges, on host tensors ---------------------------------------

    def _dispatch_again(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.rows, self.hidden, dtype=x.dtype)
        _weft.moe_dispatch_again(self._native, self._routing, desc(x), desc(out), self._timeout)
        return out

    def _combine(self, expert_out: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.tokens, self.hidden, dtype=expert_out.dtype)
        _weft.moe_combine(self._native, self._routing, desc(expert_out), desc(row_weights), desc(out), self._timeout)
        return out

    def _combine_backward(self, dy: torch.Tensor, expert_out: torch.Tensor, row_weights: torch.Tensor):
        grad_out = torch.empty_like(expert_out)
        grad_w = torch.empty(self.tokens, self.k, dtype=torch.float64)
        args = (desc(dy), desc(expert_out), desc(row_weights), desc(grad_out), desc(grad_w), self._timeout)
        _weft.moe_combine_backward(self._native, self._routing, *args)
        return grad_out, grad_w

    def _to_experts(self, pair_values: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.rows, dtype=torch.float64)
        _weft.moe_to_experts(self._native, self._routing, desc(pair_values), desc(out), self._timeout)
        return out


def _host(t: torch.Tensor, dtype=None) -> torch.Tensor:
    """`t` detached, contiguous, in host memory (and of `dtype`)."""
    return t.detach().to(device="cpu", dtype=dtype).contiguous()


def _dispatch_problem(x: torch.Tensor, topk_idx: torch.Tensor) -> Exception | None:
    """What is wrong with a dispatch's arguments on this rank, if anything."""
    if x.dim() != 2:
        return ValueError(f"weft.moe: x must be [tokens, hidden], not of shape {tuple(x.shape)}")
    if x.dtype not in _FLOATS:
        return TypeError(f"weft.moe: x must be float32, float64, float16 or bfloat16, not {x.dtype}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        return ValueError(f"weft.moe: topk_idx must be [tokens, k] with tokens = {x.shape[0]}, not of shape {tuple(topk_idx.shape)}")
    if topk_idx.dtype.is_floating_point or topk_idx.dtype.is_complex or topk_idx.dtype == torch.bool:
        return TypeError(f"weft.moe: topk_idx must hold integer expert ids, not {topk_idx.dtype}")
    return None


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, handle, plan, xh):
        out = torch.empty(plan.rows(), handle.hidden, dtype=x.dtype)
        handle._routing = _weft.moe_dispatch(handle._native, plan, desc(xh), desc(out), handle._timeout)
        ctx.handle, ctx.device = handle, x.device
        return out.to(x.device)

    @staticmethod
    def backward(ctx, grad):
        # Each row of a token goes back to it and is summed there.
        h = ctx.handle
        g = h._combine(_host(grad), torch.ones(h.rows, dtype=torch.float64))
        return g.to(ctx.device), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, topk_weights, handle):
        row_weights = handle._to_experts(_host(topk_weights, torch.float64))
        eo = _host(expert_out)
        y = handle._combine(eo, row_weights)
        ctx.handle, ctx.device, ctx.wdtype, ctx.wdevice = handle, expert_out.device, topk_weights.dtype, topk_weights.device
        ctx.save_for_backward(eo, row_weights)
        return y.to(expert_out.device)

    @staticmethod
    def backward(ctx, dy):
        eo, row_weights = ctx.saved_tensors
        # Both gradients, whatever this rank's inputs need: every rank
        # takes part in the exchanges.
        grad_out, grad_w = ctx.handle._combine_backward(_host(dy, eo.dtype), eo, row_weights)
        return grad_out.to(ctx.device), grad_w.to(device=ctx.wdevice, dtype=ctx.wdtype), None


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, group=None, timeout: float | None = None):
    """Send each token's row of ``x`` (``[tokens, hidden]``) to the ranks
    holding its experts in ``topk_idx`` (``[tokens, k]``, ``-1``: none).
    Collective. Returns ``(expert_x, counts, handle)``: this rank's
    experts' rows (``[rows, hidden]``, grouped by local expert, then by
    source rank, then token), the rows per local expert (int64), and the
    :class:`Handle`."""
    comm = comm_of(group)
    problem = _dispatch_problem(x, topk_idx)
    if problem is not None:
        # Take part in the first exchange as an invalid rank, so that the
        # others fail too instead of waiting for this one.
        empty = torch.empty(0, dtype=torch.int64)
        try:
            _weft.moe_plan(comm._native, desc(empty), desc(torch.empty(0)), 0, int(num_experts), 0, timeout)
        except Exception:  # noqa: BLE001 - this rank's own error is the one to raise
            pass
        raise problem
    tokens, k, hidden = x.shape[0], topk_idx.shape[1], x.shape[1]
    handle = Handle(comm._native, tokens, k, hidden, timeout)
    idx, xh = _host(topk_idx, torch.int64), _host(x)
    # The counts travel at the head of the rows: step one sends what fits.
    plan = _weft.moe_plan(comm._native, desc(idx), desc(xh), k, int(num_experts), hidden, timeout)
    expert_x = _Dispatch.apply(x, handle, plan, xh)
    return expert_x, torch.tensor(handle.counts, dtype=torch.int64), handle


def dispatch_again(x: torch.Tensor, handle: Handle) -> torch.Tensor:
    """A second dispatch with ``handle``'s routing (another tensor of the
    same tokens: ``[tokens, hidden]``, any float dtype), without headers
    or counts; not differentiable. A wrong ``x`` raises here and on every
    rank it sends to."""
    return handle._dispatch_again(_host(x)).to(x.device)


def combine(expert_out: torch.Tensor, handle: Handle, topk_weights: torch.Tensor) -> torch.Tensor:
    """Each token's weighted sum over its experts' outputs, on the token's
    rank: ``[tokens, hidden]``. ``expert_out`` is ``[handle.rows, hidden]``
    in dispatch's row order, ``topk_weights`` ``[tokens, k]``. Collective:
    wrong sizes raise here and on every rank this one exchanges with
    (checked by weft as the rows move)."""
    return _Combine.apply(expert_out, topk_weights, handle)
