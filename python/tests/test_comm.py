"""weft.new_comm, TorchComm's communicator API: seed 001's examples run as
written there apart from the import (and a CPU device), every op at W = 2
to 4 with per-call hints and timeouts, split, finalize, abort on error, and
a communicator beside a torch.distributed group."""

import datetime
import faulthandler
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness import free_port, run

import weft

# -- seed 001's examples (device: CPU; the seed's `torch.timedelta` is
#    datetime's) ------------------------------------------------------------


def example_basic(rank, world, path):
    import weft as torchcomms

    store = torch.distributed.FileStore(path, 2)
    device = torch.device("cpu")
    comm = torchcomms.new_comm("weft", device, store=store)
    rank = comm.get_rank()
    world_size = comm.get_size()
    tensor = torch.ones(10, device=device) * rank
    comm.all_reduce(tensor, torchcomms.ReduceOp.SUM, async_op=False)
    comm.finalize()
    return rank, world_size, tensor.tolist()


def test_seed_example_basic(tmp_path):
    out = run(example_basic, 2, str(tmp_path / "store"), init=False)
    assert out == [(0, 2, [1.0] * 10), (1, 2, [1.0] * 10)]


def example_async(rank, world, path):
    import weft as torchcomms

    store = torch.distributed.FileStore(path, 2)
    device = torch.device("cpu")
    comm = torchcomms.new_comm("weft", device, store=store)
    rank = comm.get_rank()
    send_tensor = torch.ones(10, device=device) * rank
    recv_tensor = torch.zeros(10, device=device)
    if rank == 0:
        work = comm.send(send_tensor, dst=1, async_op=True)
    else:
        work = comm.recv(recv_tensor, src=0, async_op=True)
    work.wait()
    done = work.is_completed()
    comm.finalize()
    return done, recv_tensor.tolist()


def test_seed_example_async(tmp_path):
    out = run(example_async, 2, str(tmp_path / "store"), init=False)
    assert out == [(True, [0.0] * 10), (True, [0.0] * 10)]


def example_custom_options(rank, world):
    import weft as torchcomms

    device = torch.device("cpu")
    comm = torchcomms.new_comm(
        "weft",
        device,
        timeout=datetime.timedelta(seconds=60),
        abort_process_on_timeout_or_error=False,
        hints={"torchcomm::ncclx::high_priority_stream": "true", "backend_option": "value"},
    )
    t = torch.full((4,), float(comm.get_rank() + 1))
    comm.all_reduce(t, torchcomms.ReduceOp.MAX, async_op=False)
    comm.finalize()
    return t.tolist()


def test_seed_example_custom_options():
    assert run(example_custom_options, 2, init=False) == [[2.0] * 4] * 2


# -- every op ------------------------------------------------------------


def every_op(rank, w, backend):
    """Each op once synchronously and once asynchronously, with per-call
    hints (known and unknown) and timeouts; the results."""
    comm = weft.new_comm(backend, "cpu", abort_process_on_timeout_or_error=False)
    assert (comm.get_rank(), comm.get_size()) == (rank, w)
    R = weft.ReduceOp
    hint = {"segment_bytes": "4096", "not_a_weft_hint": "x"}
    rounds = []
    for async_op in (False, True):
        got = {}
        kw = {"hints": hint, "timeout": datetime.timedelta(seconds=30)}

        def done(work):
            work.wait()
            assert work.is_completed()

        t = torch.full((1000,), float(rank + 1))
        done(comm.all_reduce(t, R.SUM, async_op, hints=dict(hint, algorithm="ring"), timeout=kw["timeout"]))
        got["all_reduce"] = t[0].item()
        # Hints reach weft per op: an algorithm it lacks is refused (and
        # refused on every rank alike, so the communicator stays usable;
        # shm's fast path for small messages, which has no algorithms to
        # choose from, is turned off by its own hint).
        try:
            done(comm.all_reduce(t, R.SUM, async_op, hints={"algorithm": "no_such", "shm_fastbox": "off"}))
            got["bad_hint"] = None
        except weft.WeftValueError as e:
            got["bad_hint"] = "no algorithm" in str(e)
        t = torch.full((8,), float(rank + 1))
        done(comm.all_reduce(t, R.PREMUL_SUM(0.5), async_op, timeout=30.0))
        got["premul_sum"] = t[0].item()
        t = torch.full((8,), float(rank + 2))
        done(comm.all_reduce(t, R.AVG, async_op))
        got["avg"] = t[0].item()
        t = torch.full((8,), rank + 1, dtype=torch.int32)
        done(comm.all_reduce(t, R.BXOR, async_op, hints={"unknown": "1"}))
        got["bxor"] = t[0].item()
        t = torch.full((8,), float(rank + 1))
        done(comm.all_reduce(t, dist.ReduceOp.PRODUCT, async_op))
        got["torch_product"] = t[0].item()
        t = torch.full((5,), float(rank))
        done(comm.broadcast(t, w - 1, async_op, **kw))
        got["broadcast"] = t.tolist()
        t = torch.full((5,), float(rank + 1))
        done(comm.reduce(t, 0, R.MAX, async_op, **kw))
        got["reduce"] = t[0].item() if rank == 0 else None
        outs = [torch.zeros(3) for _ in range(w)]
        done(comm.all_gather(outs, torch.full((3,), float(rank)), async_op, **kw))
        got["all_gather"] = [o[0].item() for o in outs]
        outs = [torch.zeros(r + 1) for r in range(w)]
        done(comm.all_gather_v(outs, torch.full((rank + 1,), float(rank)), async_op, **kw))
        got["all_gather_v"] = [o.tolist() for o in outs]
        out = torch.zeros(2 * w)
        done(comm.all_gather_single(out, torch.full((2,), float(rank)), async_op, **kw))
        got["all_gather_single"] = out.tolist()
        out = torch.zeros(2)
        done(comm.reduce_scatter(out, [torch.full((2,), float(rank + i)) for i in range(w)], R.SUM, async_op, **kw))
        got["reduce_scatter"] = out.tolist()
        out = torch.zeros(rank + 1)
        ins = [torch.full((i + 1,), float(rank)) for i in range(w)]
        done(comm.reduce_scatter_v(out, ins, R.SUM, async_op, **kw))
        got["reduce_scatter_v"] = out.tolist()
        out = torch.zeros(2)
        done(comm.reduce_scatter_single(out, torch.arange(2 * w, dtype=torch.float32) + rank, R.SUM, async_op, **kw))
        got["reduce_scatter_single"] = out.tolist()
        outs = [torch.zeros(2) for _ in range(w)]
        done(comm.all_to_all(outs, [torch.full((2,), float(10 * rank + i)) for i in range(w)], async_op, **kw))
        got["all_to_all"] = [o[0].item() for o in outs]
        out = torch.zeros(w)
        done(comm.all_to_all_single(out, torch.arange(w, dtype=torch.float32) + 10 * rank, async_op, **kw))
        got["all_to_all_single"] = out.tolist()
        # Rank r sends r + 1 rows of 2 to every rank; rows count in dim 0.
        inp = torch.full((w * (rank + 1), 2), float(rank))
        out = torch.zeros(sum(r + 1 for r in range(w)), 2)
        done(comm.all_to_all_v_single(out, inp, [r + 1 for r in range(w)], [rank + 1] * w, async_op, **kw))
        got["all_to_all_v_single"] = out[:, 0].tolist()
        done(comm.barrier(async_op, **kw))
        out = torch.zeros(2)
        ins = [torch.full((2,), float(i)) for i in range(w)] if rank == 1 else []
        done(comm.scatter(out, ins, 1, async_op, **kw))
        got["scatter"] = out.tolist()
        outs = [torch.zeros(2) for _ in range(w)] if rank == 0 else []
        done(comm.gather(outs, torch.full((2,), float(rank)), 0, async_op, **kw))
        got["gather"] = [o[0].item() for o in outs]
        # A ring: everyone sends right and receives from the left.
        right, left = (rank + 1) % w, (rank - 1) % w
        r = torch.zeros(4)
        if async_op:
            works = [comm.recv(r, left, True, **kw), comm.send(torch.full((4,), float(rank)), right, True, **kw)]
            for x in works:
                done(x)
        elif rank % 2 == 0:
            comm.send(torch.full((4,), float(rank)), right, False, **kw)
            comm.recv(r, left, False, **kw)
        else:
            comm.recv(r, left, False, **kw)
            comm.send(torch.full((4,), float(rank)), right, False, **kw)
        got["ring"] = r[0].item()
        rounds.append(got)
    comm.finalize()
    return rounds


@pytest.mark.parametrize("backend,w", [("weft", 2), ("weft", 3), ("cpu-tcp", 3), ("shm", 4)])
def test_every_op_sync_and_async_with_hints_and_timeouts(backend, w):
    out = run(every_op, w, backend, init=False)
    tri = sum(range(1, w + 1))
    for rank, rounds in enumerate(out):
        assert rounds[0] == rounds[1], rank
        got = rounds[0]
        assert got["all_reduce"] == tri
        assert got["bad_hint"] is True
        assert got["premul_sum"] == tri * 0.5
        assert got["avg"] == sum(r + 2 for r in range(w)) / w
        xor = 0
        for r in range(w):
            xor ^= r + 1
        assert got["bxor"] == xor
        prod = 1
        for r in range(w):
            prod *= r + 1
        assert got["torch_product"] == prod
        assert got["broadcast"] == [float(w - 1)] * 5
        assert got["reduce"] == (w if rank == 0 else None)
        assert got["all_gather"] == [float(r) for r in range(w)]
        assert got["all_gather_v"] == [[float(r)] * (r + 1) for r in range(w)]
        assert got["all_gather_single"] == [float(r) for r in range(w) for _ in range(2)]
        assert got["reduce_scatter"] == [float(sum(r + rank for r in range(w)))] * 2
        assert got["reduce_scatter_v"] == [float(sum(range(w)))] * (rank + 1)
        assert got["reduce_scatter_single"] == [float(sum(2 * rank + j + r for r in range(w))) for j in range(2)]
        assert got["all_to_all"] == [float(10 * r + rank) for r in range(w)]
        assert got["all_to_all_single"] == [float(rank + 10 * r) for r in range(w)]
        assert got["all_to_all_v_single"] == [float(r) for r in range(w) for _ in range(r + 1)]
        assert got["scatter"] == [float(rank)] * 2
        assert got["gather"] == ([float(r) for r in range(w)] if rank == 0 else [])
        assert got["ring"] == float((rank - 1) % w)


# -- split ---------------------------------------------------------------


def splits(rank, w):
    comm = weft.new_comm("weft", "cpu", abort_process_on_timeout_or_error=False)
    # Ranks 0 and 2 form one sub-communicator (2 first), 1 and 3 another.
    mine = [2, 0] if rank % 2 == 0 else [1, 3]
    sub = comm.split(mine)
    # Only rank 0 joins the next split; the others pass an empty list.
    solo = comm.split([0] if rank == 0 else [])
    # A list without this rank raises, on every rank (the split counts).
    try:
        comm.split([(rank + 1) % w])
        refused = None
    except ValueError as e:
        refused = (type(e).__name__, str(e))
    # So does a list that is not of ranks, on rank 3 only: the split still
    # counts there, so the next one meets the others'.
    try:
        comm.split(["3"] if rank == 3 else [])
    except TypeError:
        pass
    pairs = comm.split([0, 1] if rank < 2 else [2, 3])
    pairs.barrier(False)
    pairs.finalize()
    # Sub-communicator and parent ops at once.
    t = torch.full((64,), float(rank))
    ws = comm.all_reduce(torch.ones(64), weft.ReduceOp.SUM, True)
    sub.all_reduce(t, weft.ReduceOp.SUM, False)
    ws.wait()
    names = (sub.get_name(), sub.get_rank(), sub.get_size())
    solo_info = None if solo is None else (solo.get_rank(), solo.get_size())
    for c in (solo, sub, comm):
        if c is not None:
            c.finalize()
    return names, solo_info, refused, t[0].item()


def test_split_gives_each_rank_its_group_none_for_an_empty_list_and_raises_without_this_rank():
    out = run(splits, 4, init=False)
    assert out[0][0] == ("comm0.split0", 1, 2)
    assert out[2][0][1:] == (0, 2) and out[1][0][1:] == (0, 2) and out[3][0][1:] == (1, 2)
    assert out[0][1] == (0, 1) and all(o[1] is None for o in out[1:])
    for rank, o in enumerate(out):
        kind, msg = o[2]
        assert kind == "WeftValueError" and "not in the list" in msg, (rank, msg)
        assert o[3] == (2.0 if rank % 2 == 0 else 4.0)


# -- finalize, timeouts, abort -------------------------------------------


def finalize_twice(rank, w):
    comm = weft.new_comm("weft", "cpu", abort_process_on_timeout_or_error=False)
    comm.barrier(False)
    comm.finalize()
    comm.finalize()  # nothing more to do
    try:
        comm.all_reduce(torch.ones(2), weft.ReduceOp.SUM, False)
    except weft.WeftError as e:
        return repr(comm), str(e)
    return repr(comm), None


def test_finalize_twice_is_harmless_and_use_after_finalize_raises():
    for state, msg in run(finalize_twice, 2, init=False):
        assert "finalized" in state
        assert msg is not None and "finalized" in msg


def per_call_timeout(rank, w):
    comm = weft.new_comm("weft", "cpu", abort_process_on_timeout_or_error=False)
    comm.barrier(False)
    if rank == 1:
        # Rank 0 never joins this all_reduce: the call's own timeout ends
        # it, long before the communicator's (60 s).
        t0 = time.monotonic()
        try:
            comm.all_reduce(torch.ones(4), weft.ReduceOp.SUM, False, timeout=datetime.timedelta(seconds=0.5))
        except weft.WeftTimeoutError as e:
            return time.monotonic() - t0, str(e)
        return None
    time.sleep(2.5)
    return None


def test_a_per_call_timeout_bounds_that_op():
    out = run(per_call_timeout, 2, init=False, allow_fail=True)
    took, msg = out[1]
    assert took < 5, took
    assert "all_reduce" in msg, msg


def unreported_error(rank, w):
    comm = weft.new_comm("weft", "cpu", abort_process_on_timeout_or_error=False)
    comm.barrier(False)
    if rank == 1:
        # An async op that times out and nobody waits for: finalize says.
        comm.all_reduce(torch.ones(4), weft.ReduceOp.SUM, True, timeout=0.3)
        try:
            comm.finalize()
        except weft.WeftTimeoutError as e:
            return "raised", str(e)
        return "silent", None
    time.sleep(2.0)
    return None


def test_finalize_reports_an_error_no_wait_raised():
    out = run(unreported_error, 2, init=False, allow_fail=True)
    assert out[1][0] == "raised", out[1]


def abort_on_error(rank, w):
    # Rank 1 aborts on errors (the default); rank 0 raises instead. (No
    # traceback dump from pytest's fault handler when rank 1 aborts.)
    faulthandler.disable()
    if rank == 0:
        os.environ["WEFT_ABORT_ON_ERROR"] = "0"
    comm = weft.new_comm("cpu-tcp", "cpu")
    comm.barrier(False)
    if rank == 1:
        comm.all_reduce(torch.ones(4), weft.ReduceOp.SUM, False, timeout=0.3)
        return "still alive"
    time.sleep(1.5)
    try:
        # The first may still complete: rank 1 sent its part before it
        # timed out. The next cannot.
        for _ in range(2):
            comm.all_reduce(torch.ones(4), weft.ReduceOp.SUM, False)
    except weft.WeftPeerLostError as e:
        return e.peer, str(e)
    except weft.WeftError as e:
        return None, f"{type(e).__name__}: {e}"
    return None, "no error"


def test_abort_on_error_ends_the_process_and_the_others_raise_naming_it():
    out = run(abort_on_error, 2, init=False, allow_fail=True)
    assert out[1] == ("died", -signal.SIGABRT), out[1]
    peer, msg = out[0]
    assert peer == 1 and "rank 1" in msg, msg


def abort_on_an_async_error_nobody_waits_for(rank, w):
    faulthandler.disable()
    comm = weft.new_comm("weft", "cpu", abort_process_on_timeout_or_error=rank == 1)
    comm.barrier(False)
    if rank == 0:
        time.sleep(3)
        return "rank 0 done"
    # A bad argument raises even here: nothing was sent, nothing is broken.
    try:
        comm.broadcast(torch.ones(2), 7, False)
    except ValueError as e:
        refused = str(e)
    # An op that fails with nobody waiting for it still ends the process.
    comm.all_reduce(torch.ones(4), weft.ReduceOp.SUM, True, timeout=0.3)
    time.sleep(2)
    return f"still alive ({refused})"


def test_abort_on_error_also_for_an_async_op_nobody_waits_for_but_not_for_a_bad_argument():
    out = run(abort_on_an_async_error_nobody_waits_for, 2, init=False, allow_fail=True)
    assert out[1] == ("died", -signal.SIGABRT), out[1]


# -- bootstrap and living beside torch.distributed -----------------------


def beside_torch(rank, w, path):
    # The harness set up torch's default group over env:// (rank 0 hosts
    # its store); a communicator from the same environment shares it, and
    # one over a FileStore lives beside both.
    a = weft.new_comm("weft", "cpu", abort_process_on_timeout_or_error=False)
    b = weft.new_comm("cpu-tcp", "cpu", store=dist.FileStore(path, w), name="other")
    x, y, z = torch.ones(16), torch.full((16,), 2.0), torch.full((16,), 3.0)
    wa = a.all_reduce(x, weft.ReduceOp.SUM, True)
    wb = b.all_reduce(y, weft.ReduceOp.SUM, True)
    dist.all_reduce(z)
    wa.wait()
    wb.wait()
    # A second communicator of the same name on one store is refused (rank
    # 0 claims the name, so it is the one that knows).
    dup = None
    if rank == 0:
        try:
            weft.new_comm("weft", "cpu", store=dist.FileStore(path, w), name="other", abort_process_on_timeout_or_error=False)
        except ValueError as e:
            dup = str(e)
    a.finalize()
    b.finalize()
    return x[0].item(), y[0].item(), z[0].item(), dup


def test_a_communicator_lives_beside_a_torch_group(tmp_path):
    out = run(beside_torch, 2, str(tmp_path / "fs"))
    for rank, (x, y, z, dup) in enumerate(out):
        assert (x, y, z) == (2.0, 4.0, 6.0)
        if rank == 0:
            assert dup is not None and "already created" in dup, dup


def one_after_another(rank, w, path):
    # A communicator finalized, then another from the same environment
    # (rank 0 hosts the store for both); then one over an explicit store
    # with no store address in the environment at all.
    first = weft.new_comm("weft", "cpu", abort_process_on_timeout_or_error=False)
    first.barrier(False)
    first.finalize()
    second = weft.new_comm("cpu-tcp", "cpu", abort_process_on_timeout_or_error=False)
    t = torch.ones(2)
    second.all_reduce(t, weft.ReduceOp.SUM, False)
    second.finalize()
    for k in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k)
    third = weft.new_comm("weft", "cpu", store=dist.FileStore(path, w), abort_process_on_timeout_or_error=False)
    u = torch.ones(2)
    third.all_reduce(u, weft.ReduceOp.SUM, False)
    third.finalize()
    return t.tolist(), u.tolist(), second.get_name(), third.get_name()


def test_communicators_one_after_another_and_an_explicit_store_without_a_store_address(tmp_path):
    for out in run(one_after_another, 3, str(tmp_path / "fs"), init=False):
        assert out == ([3.0, 3.0], [3.0, 3.0], "comm1", "comm2")


def from_open_mpi(rank, w):
    # As mpirun sets it: no RANK or WORLD_SIZE, Open MPI's variables instead.
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(k, None)
    os.environ.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(w))
    comm = weft.new_comm("weft", "cpu", abort_process_on_timeout_or_error=False)
    t = torch.ones(3)
    comm.all_reduce(t, weft.ReduceOp.SUM, False)
    comm.finalize()
    return comm_info(comm), t.tolist()


def comm_info(comm):
    return comm.get_name(), comm.get_backend(), str(comm.get_device())


def test_bootstrap_from_open_mpi_variables():
    out = run(from_open_mpi, 3, init=False)
    for info, t in out:
        assert t == [3.0] * 3
        assert info[1:] == ("weft", "cpu")


def test_reduce_op_values():
    R = weft.ReduceOp
    assert R.PREMUL_SUM(torch.tensor(0.25)).weft_name() == "premul_sum(0.25)"
    assert R.SUM == R.SUM and R.SUM != R.MAX
    assert R.PREMUL_SUM(2) == R.PREMUL_SUM(2.0) != R.PREMUL_SUM(3) != R.PREMUL_SUM
    assert len({R.SUM, R.PREMUL_SUM, R.PREMUL_SUM(1)}) == 3
    with pytest.raises(ValueError, match="needs a factor"):
        R.PREMUL_SUM.weft_name()
    for var, value in [("WEFT_ABORT_ON_ERROR", "maybe"), ("TORCHCOMM_ABORT_ON_ERROR", "maybe"), ("WEFT_TIMEOUT_SECONDS", "0")]:
        os.environ[var] = value
        try:
            with pytest.raises(ValueError, match="WEFT_"):
                weft.new_comm("weft", "cpu")
        finally:
            del os.environ[var]


def test_the_example_runs_under_torchrun():
    # Bootstrap through torchrun's agent store; three ranks, one left out
    # of the pairs.
    example = Path(__file__).resolve().parents[1] / "examples" / "torchcomm_api.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(free_port()), str(example)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    # (Two ranks print to one pipe: lines may interleave.)
    lines = sorted(re.findall(r"rank \d: sum \d+, pair \S+ got \d+", out.stdout))
    assert lines == ["rank 0: sum 3, pair comm0.split0 got 1", "rank 1: sum 3, pair comm0.split0 got 0"], out.stdout
