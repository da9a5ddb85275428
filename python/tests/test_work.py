"""Work semantics and the ops around the tensor ones: wait(timeout),
is_completed, futures, errors raised from wait, non-contiguous and scalar
tensors, object collectives, sub-groups used alongside the world group."""

import datetime
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from harness import run

import weft


def futures_and_completion(rank, world):
    t = torch.full((1000,), float(rank + 1))
    w = dist.all_reduce(t, async_op=True)
    fut = w.get_future()
    (out,) = fut.wait()
    assert out is t and torch.equal(t, torch.full((1000,), 3.0))
    assert w.is_completed() and w.is_success() and w.exception() is None
    # A future asked for after the op finished is complete at once.
    w2 = dist.all_reduce(t, async_op=True)
    w2.wait()
    assert w2.get_future().wait()[0] is t
    # Chained callbacks (what DDP comm hooks do) see the outputs.
    w3 = dist.all_reduce(torch.ones(10), async_op=True)
    doubled = w3.get_future().then(lambda f: f.value()[0] * 2).wait()
    assert torch.equal(doubled, torch.full((10,), 4.0))
    # all_gather's future holds the output lists.
    outs = [torch.zeros(2) for _ in range(world)]
    got = dist.all_gather(outs, torch.full((2,), float(rank)), async_op=True).get_future().wait()
    assert [o.data_ptr() for o in got[0]] == [o.data_ptr() for o in outs]


def wait_with_a_timeout(rank, world):
    t = torch.zeros(4)
    if rank == 0:
        w = dist.irecv(t, 1)
        with pytest.raises(TimeoutError):
            w.wait(timeout=datetime.timedelta(milliseconds=200))
        assert not w.is_completed()
        dist.send(torch.ones(1), 1)  # go ahead
        assert w.wait()
        assert torch.equal(t, torch.full((4,), 7.0))
    else:
        dist.recv(torch.zeros(1), 0)
        dist.send(torch.full((4,), 7.0), 0)


def durations(rank, world):
    # A receive whose sender sends 300 ms after it was issued lasts at
    # least that long, and its duration is known only once it has finished.
    t = torch.zeros(4)
    if rank == 0:
        w = dist.irecv(t, 1)
        dist.send(torch.ones(1), 1)  # issued: go ahead
        with pytest.raises(RuntimeError, match="finished"):
            w._get_duration()
        w.wait()
        assert 300 <= w._get_duration() < 30_000, w._get_duration()
    else:
        dist.recv(torch.zeros(1), 0)
        time.sleep(0.3)
        dist.send(torch.ones(4), 0)
    # An op waited for late: its duration ends when it did, not at the wait.
    dist.barrier()
    s = dist.all_reduce(torch.ones(8), async_op=True)
    time.sleep(0.3)
    s.wait()
    assert 0 <= s._get_duration() < 250, s._get_duration()
    dist.barrier()


def errors_from_wait(rank, world):
    # Sizes differ between ranks: both fail, and the error names the op.
    t = torch.zeros(4 if rank == 0 else 8)
    try:
        dist.all_reduce(t)
    except (dist.DistBackendError, ValueError) as e:
        return type(e).__name__, str(e)
    return "no error", ""


def bad_arguments(rank, world):
    # (torch's dist.broadcast checks the root itself: call the group.)
    with pytest.raises(ValueError, match="root 7 is out of range"):
        dist.group.WORLD.broadcast([torch.zeros(2)], _opts(7))
    with pytest.raises(ValueError, match="applies to floating-point"):
        dist.all_reduce(torch.zeros(2, dtype=torch.int32), op=dist.ReduceOp.AVG)
    with pytest.raises(TypeError, match="int16"):
        dist.all_reduce(torch.zeros(2, dtype=torch.int16))
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="positive number of seconds"):
            backend.set_timeout(bad)
    # The group is still usable after errors caught before any byte moved.
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), 2.0))


def _opts(root):
    o = dist.BroadcastOptions()
    o.rootRank = root
    return o


def non_contiguous_and_scalars(rank, world):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) + rank
    view = base.t()[1:4]  # non-contiguous
    expect = sum(torch.arange(24, dtype=torch.float32).reshape(4, 6).t()[1:4] + r for r in range(world))
    dist.all_reduce(view)
    assert torch.equal(view, expect)
    # Async: the copy back happens even when nobody waits on the handle.
    v2 = (torch.arange(24, dtype=torch.float32).reshape(4, 6) + rank)[:, ::2]
    w = dist.all_reduce(v2, async_op=True)
    del w
    deadline = time.monotonic() + 10
    want = sum((torch.arange(24, dtype=torch.float32).reshape(4, 6) + r)[:, ::2] for r in range(world))
    while not torch.equal(v2, want) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert torch.equal(v2, want)
    # A non-contiguous all_gather output list and input.
    src = torch.arange(12.0).reshape(3, 4)[:, 1] + rank
    outs = [torch.zeros(3, 5)[:, 2] for _ in range(world)]  # strided views
    dist.all_gather(outs, src)
    for r in range(world):
        assert torch.equal(outs[r], torch.arange(12.0).reshape(3, 4)[:, 1] + r)
    # 0-dim tensors.
    s = torch.tensor(float(rank + 1))
    dist.all_reduce(s, op=dist.ReduceOp.PRODUCT)
    assert s.item() == 2.0
    e = torch.zeros(0)
    dist.all_reduce(e)
    dist.broadcast(e, 0)


def objects(rank, world):
    got = [None] * world
    dist.all_gather_object(got, {"rank": rank, "sq": [rank] * rank})
    assert got == [{"rank": r, "sq": [r] * r} for r in range(world)]
    objs = [f"hello {rank}", rank] if rank == 1 else [None, None]
    dist.broadcast_object_list(objs, src=1)
    assert objs == ["hello 1", 1]
    out = [None]
    dist.scatter_object_list(out, [("x", r) for r in range(world)] if rank == 0 else None, src=0)
    assert out == [("x", rank)]
    g = [None] * world if rank == 0 else None
    dist.gather_object(rank * 2, g, dst=0)
    if rank == 0:
        assert g == [r * 2 for r in range(world)]


def sub_groups(rank, world):
    """Two sub-groups and the world group in use at once."""
    evens = dist.new_group([0, 2], backend="weft")
    odds = dist.new_group([1, 3], backend="weft")
    mine = evens if rank % 2 == 0 else odds
    a = torch.full((1 << 16,), float(rank))
    b = torch.ones(1 << 16)
    wa = dist.all_reduce(a, group=mine, async_op=True)
    wb = dist.all_reduce(b, async_op=True)
    wb.wait()
    wa.wait()
    assert torch.equal(b, torch.full((1 << 16,), float(world)))
    pair = [0, 2] if rank % 2 == 0 else [1, 3]
    assert torch.equal(a, torch.full((1 << 16,), float(sum(pair))))
    assert dist.get_rank(mine) == rank // 2 and dist.get_world_size(mine) == 2
    # Point-to-point in a sub-group takes global ranks in torch's API.
    peer = pair[1] if rank == pair[0] else pair[0]
    t = torch.full((3,), float(rank))
    r = torch.zeros(3)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer, mine), dist.P2POp(dist.irecv, r, peer, mine)])
    for q in reqs:
        q.wait()
    assert torch.equal(r, torch.full((3,), float(peer)))
    dist.destroy_process_group(evens if rank % 2 == 0 else odds)


def dense_host_ops_skip_python(rank, world):
    """With weft's Python ops made to fail, every op on dense contiguous
    CPU tensors still runs (weft's C++ backend issues it through weft's C
    API), and a tensor that needs staging still reaches the Python ops."""
    from weft import _ops

    def refuse(self, *args, **kwargs):
        raise RuntimeError("weft's Python ops were called")

    names = ("allreduce", "broadcast", "reduce", "allgather", "all_gather_single", "reduce_scatter_single")
    for name in names + ("all_to_all_single", "alltoall", "send", "recv", "recv_anysource", "barrier"):
        setattr(_ops.Ops, name, refuse)
    x = torch.full((4,), float(rank + 1))
    dist.all_reduce(x)
    assert x.tolist() == [3.0] * 4
    w = dist.all_reduce(x, op=dist.ReduceOp.MAX, async_op=True)
    assert w.get_future().wait()[0] is x and w.is_completed()
    b = torch.full((2,), float(rank))
    dist.broadcast(b, src=1)
    dist.reduce(x, dst=0)
    gathered = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank)))
    flat = torch.zeros(2 * world)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)))
    part = torch.zeros(1)
    dist.reduce_scatter_tensor(part, torch.arange(2, dtype=torch.float32))
    swapped = torch.zeros(2)
    dist.all_to_all_single(swapped, torch.tensor([10.0 * rank, 10.0 * rank + 1]), [1, 1], [1, 1])
    listed = [torch.zeros(1) for _ in range(world)]
    dist.all_to_all(listed, [torch.tensor([float(rank)])] * world)
    got = torch.zeros(1)
    if rank == 0:
        dist.send(torch.tensor([5.0]), 1)
        src = dist.recv(got)
    else:
        dist.recv(got, 0)
        dist.send(torch.tensor([6.0]), 0)
        src = None
    dist.barrier()
    assert b.tolist() == [1.0, 1.0] and [g.tolist() for g in gathered] == [[0.0, 0.0], [1.0, 1.0]]
    assert flat.tolist() == [0.0, 0.0, 1.0, 1.0] and part.tolist() == [2.0 * rank]
    assert swapped.tolist() == [float(rank), 10.0 + rank] and [t.item() for t in listed] == [0.0, 1.0]
    assert got.item() == (6.0 if rank == 0 else 5.0) and src in (None, 1)
    with pytest.raises(RuntimeError, match="Python ops were called"):
        dist.all_reduce(torch.ones(4, 2).t())  # not contiguous: staged in Python
    return x.tolist() if rank == 0 else None


@pytest.mark.parametrize("shape", ["torch", "own"])
def test_dense_host_ops_reach_weft_without_python(shape):
    env = {"WEFT_TORCH_HOOKS": "1" if shape == "torch" else "0"}
    out = run(dense_host_ops_skip_python, 2, env=env)
    assert out[0] == [6.0] * 4  # reduce (sum) of both ranks' max, at the root


_EXIT_IN_FLIGHT = """
import sys, torch, torch.distributed as dist
dist.init_process_group("weft", init_method="file://" + sys.argv[1], rank=0, world_size=1)
t = torch.ones(16 << 20)
for _ in range(5):
    dist.all_reduce(t, async_op=True)  # the Work dropped at once, the op in flight
"""


@pytest.mark.parametrize("shape", ["torch", "own"])
def test_exiting_with_dropped_ops_in_flight_is_clean(shape, tmp_path):
    # The ops' tensors are freed after Python has begun to shut down; that
    # must not kill the process (it once did: a thread of weft's C++
    # backend asked for the GIL inside a tensor's destructor).
    env = {**os.environ, "WEFT_TORCH_HOOKS": "1" if shape == "torch" else "0"}
    for i in range(3):
        r = subprocess.run([sys.executable, "-c", _EXIT_IN_FLIGHT, str(tmp_path / f"store{i}")], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "terminate" not in r.stderr, (r.returncode, r.stderr[-2000:])


def test_futures_and_completion():
    run(futures_and_completion, 2)


def test_wait_with_a_timeout_raises_and_the_op_goes_on():
    run(wait_with_a_timeout, 2, env={"WEFT_BACKEND": "cpu-tcp"})


def test_get_duration_covers_the_op_from_issue_to_end():
    run(durations, 2)


def test_a_size_mismatch_is_an_error_on_every_rank():
    # Caught when the first message arrives: its tag carries the call's
    # counts (hashed), so the error is a ValueError naming the op.
    # (shm's fast path for small ops compares the calls themselves.)
    for inner in ("cpu-tcp", "shm"):
        out = run(errors_from_wait, 2, env={"WEFT_BACKEND": inner, "WEFT_TIMEOUT_SECONDS": "10"})
        for kind, msg in out:
            assert kind == "WeftValueError", (inner, kind, msg)
            assert "all_reduce" in msg and "mismatch" in msg, (inner, msg)


def test_bad_arguments_are_value_errors_and_leave_the_group_usable():
    run(bad_arguments, 2)


def test_non_contiguous_scalar_and_empty_tensors():
    run(non_contiguous_and_scalars, 2)


def test_object_collectives():
    run(objects, 3)


def test_sub_groups_run_alongside_the_world_group():
    run(sub_groups, 4)


def test_the_errors_are_torch_types():
    assert issubclass(weft.WeftPeerLostError, dist.DistNetworkError)
    assert issubclass(weft.WeftTimeoutError, dist.DistBackendError) and issubclass(weft.WeftTimeoutError, TimeoutError)
    assert issubclass(weft.WeftStoreError, dist.DistStoreError)
    assert issubclass(weft.WeftValueError, ValueError)
