"""Point-to-point through torch.distributed: send/recv with tags, isend and
irecv that never block, receive from any rank, batch_isend_irecv."""

import gc
import time

import pytest
import torch
import torch.distributed as dist

from harness import run

INNER = ["shm", "cpu-tcp"]


def tags_out_of_order(rank, world):
    if rank == 0:
        for tag in (1, 2, 3):
            dist.send(torch.full((tag,), float(tag)), 1, tag=tag)
    elif rank == 1:
        got = {}
        for tag in (3, 1, 2):
            t = torch.zeros(tag)
            dist.recv(t, 0, tag=tag)
            got[tag] = t
        for tag, t in got.items():
            assert torch.equal(t, torch.full((tag,), float(tag))), (tag, t)


def ring_of_isend_irecv(rank, world, n):
    """Each rank isends to r+1 first, then irecvs from r-1: long messages
    complete only if neither blocks."""
    out = torch.arange(n, dtype=torch.float32) + rank
    inp = torch.zeros(n)
    s = dist.isend(out, (rank + 1) % world)
    r = dist.irecv(inp, (rank - 1) % world)
    r.wait()
    s.wait()
    assert torch.equal(inp, torch.arange(n, dtype=torch.float32) + (rank - 1) % world)
    assert s.is_completed() and r.is_completed()


def batched_ring(rank, world, n):
    out = [torch.full((n,), float(rank * 10 + k)) for k in range(3)]
    inp = [torch.zeros(n) for _ in range(3)]
    ops = []
    # Receives first on purpose, and several per peer (matched in order).
    for k in range(3):
        ops.append(dist.P2POp(dist.irecv, inp[k], (rank - 1) % world))
    for k in range(3):
        ops.append(dist.P2POp(dist.isend, out[k], (rank + 1) % world))
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    src = (rank - 1) % world
    for k in range(3):
        assert torch.equal(inp[k], torch.full((n,), float(src * 10 + k))), k


def any_source(rank, world):
    """Ranks 1..W-1 send at different times; rank 0 receives from anyone and
    is told who sent each message."""
    if rank == 0:
        seen = set()
        for _ in range(world - 1):
            t = torch.zeros(4)
            src = dist.recv(t, tag=9)
            assert torch.equal(t, torch.full((4,), float(src))), (src, t)
            seen.add(src)
        assert seen == set(range(1, world))
        w = dist.irecv(torch.zeros(4), tag=10)
        w.wait()
        return w.source_rank()
    time.sleep(0.05 * (world - rank))
    dist.send(torch.full((4,), float(rank)), 0, tag=9)
    if rank == 2:
        dist.send(torch.full((4,), 2.0), 0, tag=10)
    return None


def dropped_handle(rank, world):
    """An isend whose Work is dropped unwaited still completes, with its
    tensor kept alive until then."""
    n = 3 << 20
    if rank == 0:
        dist.isend(torch.full((n,), 5.0), 1)
        gc.collect()
        t = torch.zeros(1)
        dist.recv(t, 1)
        assert t.item() == 1.0
    else:
        time.sleep(0.3)
        t = torch.zeros(n)
        dist.recv(t, 0)
        assert torch.equal(t, torch.full((n,), 5.0))
        dist.send(torch.ones(1), 0)


@pytest.mark.parametrize("inner", INNER)
def test_tags_match_out_of_order(inner):
    run(tags_out_of_order, 2, env={"WEFT_BACKEND": inner})


@pytest.mark.parametrize("inner", INNER)
@pytest.mark.parametrize("world", [2, 3])
def test_isend_then_irecv_ring_of_long_messages(inner, world):
    run(ring_of_isend_irecv, world, (4 << 20) + 1, env={"WEFT_BACKEND": inner})


@pytest.mark.parametrize("inner", INNER)
def test_batch_isend_irecv(inner):
    run(batched_ring, 3, (1 << 20) + 7, env={"WEFT_BACKEND": inner})


@pytest.mark.parametrize("inner", INNER)
def test_recv_from_any_rank_reports_the_source(inner):
    out = run(any_source, 4, env={"WEFT_BACKEND": inner})
    assert out[0] == 2


def test_a_dropped_isend_still_completes():
    run(dropped_handle, 2, env={"WEFT_BACKEND": "cpu-tcp"})
