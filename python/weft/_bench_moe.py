"""The expert-parallel workload of ``python -m weft.bench --workload moe``.

Each rank routes ``--tokens`` tokens of ``--hidden`` elements to the top
``--topk`` of ``--experts`` experts (router scores drawn so that experts are
unevenly loaded: expert e's logits are shifted by ``-log(e + 1) / 4``; with
the defaults the busiest expert gets about 3 times the mean load and the
least loaded about 0.6 times), then
times dispatch, identity experts, combine and the backward pass, two ways:

- ``weft.moe``: :func:`weft.moe.dispatch` and :func:`weft.moe.combine`;
- ``recipe``: torchtitan's expert parallelism by hand: one row per (token,
  expert) sorted by expert, an ``all_to_all_single`` of the per-expert
  counts, ``.tolist()`` of the splits, ``all_to_all_single_autograd`` of the
  rows there and back, the permutations into and out of local-expert order,
  and the weighted sum on the token's rank.

Every iteration starts after a barrier and takes the slowest rank's time.
Rank 0 reports the median and spread, and the bytes of rows each rank
sends to the others per dispatch (the same come back in the combine).
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

METHODS = ["weft.moe", "recipe"]


def routing(tokens: int, experts: int, k: int, rank: int):
    """Top-k expert ids and their weights, experts unevenly loaded."""
    g = torch.Generator().manual_seed(1234 + rank)
    skew = torch.tensor([-0.25 * math.log(e + 1) for e in range(experts)])
    scores = torch.randn(tokens, experts, generator=g) + skew
    weights, idx = torch.softmax(scores, dim=1).topk(k, dim=1)
    return idx, weights / weights.sum(1, keepdim=True)


def step_weft(x, idx, weights, experts, grad):
    """One forward and backward pass with weft.moe; the bytes of rows this
    rank sends per dispatch."""
    import weft

    expert_x, counts, handle = weft.moe.dispatch(x, idx, experts)
    y = weft.moe.combine(expert_x, handle, weights)
    y.backward(grad)
    return handle.bytes_sent(x.dtype)


def step_recipe(x, idx, weights, experts, grad):
    """One forward and backward pass of torchtitan's recipe; the bytes of
    rows this rank sends per dispatch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, k = idx.shape
    per_rank = experts // world
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    routed = x[order // k]  # one row per (token, expert), by expert
    per_expert = torch.bincount(flat, minlength=experts)
    received = torch.empty_like(per_expert)
    dist.all_to_all_single(received, per_expert)  # [W, E/W]: from each rank, per local expert
    input_splits = per_expert.view(world, per_rank).sum(1).tolist()
    output_splits = received.view(world, per_rank).sum(1).tolist()
    rows = all_to_all_single_autograd(routed, output_splits, input_splits, dist.group.WORLD)
    # Rank-major to local-expert-major, and back after the experts.
    local = torch.arange(per_rank).repeat(world).repeat_interleave(received)
    perm = local.argsort(stable=True)
    expert_in = rows[perm]
    expert_out = expert_in  # identity experts
    back = torch.empty_like(expert_out).index_copy(0, perm, expert_out)
    returned = all_to_all_single_autograd(back, input_splits, output_splits, dist.group.WORLD)
    unsorted = torch.empty_like(returned).index_copy(0, order, returned)
    y = (unsorted.view(tokens, k, -1) * weights.unsqueeze(-1).to(x.dtype)).sum(1)
    y.backward(grad)
    sent = sum(n for r, n in enumerate(input_splits) if r != rank)
    return sent * x.shape[1] * x.element_size()


def worker(method: str, tokens: int, hidden: int, experts: int, k: int, dtype: str, iters: int, warmup: int) -> dict:
    """Time `method` on this rank; rank 0's row (others: None)."""
    rank = dist.get_rank()
    dt = getattr(torch, dtype)
    idx, weights = routing(tokens, experts, k, rank)
    g = torch.Generator().manual_seed(99 + rank)
    x = torch.randn(tokens, hidden, generator=g).to(dt).requires_grad_()
    weights = weights.requires_grad_()
    grad = torch.randn(tokens, hidden, generator=g).to(dt)
    step = step_weft if method == "weft.moe" else step_recipe
    for _ in range(warmup):
        step(x, idx, weights, experts, grad)
    times = torch.zeros(iters, dtype=torch.float64)
    sent = 0
    for i in range(iters):
        x.grad, weights.grad = None, None
        dist.barrier()
        t0 = time.perf_counter()
        sent = step(x, idx, weights, experts, grad)
        times[i] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    ms = sorted(t * 1e3 for t in times.tolist())
    if rank != 0:
        return None
    return {"method": method, "median_ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1], "bytes_sent": sent}
