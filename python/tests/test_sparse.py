"""all_reduce of sparse COO tensors through weft's sparse all-reduce."""

import pytest
import torch
import torch.distributed as dist

from harness import run


def rank_tensor(rank, rows=50, cols=3):
    """An uncoalesced COO tensor of `rows` x `cols`, different per rank."""
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, rows, (1, 20 + rank), generator=g)  # duplicates included
    val = torch.randn(idx.shape[1], cols, generator=g, dtype=torch.float64)
    return torch.sparse_coo_tensor(idx, val, (rows, cols), check_invariants=True)


def sparse_sum(rank, world, op):
    t = rank_tensor(rank)
    work = dist.all_reduce(t, op=op, async_op=True)
    work.wait()
    (fut,) = work.get_future().wait()
    return t.to_dense(), fut.to_dense(), t.is_coalesced()


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_all_reduce_sum_equals_the_dense_sum(world):
    want = sum(rank_tensor(r).to_dense() for r in range(world))
    for got, fut, coalesced in run(sparse_sum, world, dist.ReduceOp.SUM):
        assert coalesced
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()
        assert torch.allclose(fut, want, rtol=0, atol=1e-12)


def test_sparse_all_reduce_max_over_the_union_of_indices():
    world = 2
    out = run(sparse_sum, world, dist.ReduceOp.MAX)
    # MAX over every entry of an index, duplicates within a rank included
    # (absent entries do not count as 0).
    want = torch.full((50, 3), float("-inf"), dtype=torch.float64)
    for r in range(world):
        t = rank_tensor(r)
        for k, i in enumerate(t._indices()[0].tolist()):
            want[i] = torch.maximum(want[i], t._values()[k])
    want[want == float("-inf")] = 0
    for got, _, _ in out:
        assert torch.equal(got, want)
