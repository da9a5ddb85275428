"""TorchComm's windows on weft (``comm.new_window()``): puts that land in
the registered tensor after a signal, offsets in elements, several origins,
gets, a target busy in Python while puts arrive, ``map_remote_tensor`` and
``get_attr``, bad ranges, deregistration, on shm and cpu-tcp at W = 2-4."""

import time

import pytest
import torch

from harness import run

import weft

BACKENDS = ["shm", "cpu-tcp"]


def ring(rank, world, backend):
    comm = weft.new_comm(backend, "cpu")
    right, left = (rank + 1) % world, (rank - 1) % world
    buf = torch.zeros(1000 + rank, dtype=torch.float32)
    before = buf  # the same tensor object: puts land in it
    win = comm.new_window()
    win.tensor_register(buf)
    n = 1000 + right
    src = torch.arange(n, dtype=torch.float32) + 10_000 * rank
    # Whole, then a piece at an element offset, then the last element.
    win.put(src, right, 0, async_op=False)
    win.put(torch.full((7,), -1.0), right, 100, async_op=False)
    w = win.put(torch.tensor([-2.0]), right, n - 1, async_op=True)
    w.wait()
    win.signal(right, async_op=False)
    win.wait_signal(left, async_op=False)
    want = torch.arange(1000 + rank, dtype=torch.float32) + 10_000 * left
    want[100:107] = -1.0
    want[-1] = -2.0
    assert before is buf and torch.equal(buf, want), (buf[:10], want[:10])
    # A get reads the right rank's tensor back.
    got = torch.empty(5)
    win.get(got, right, 100, async_op=False)
    assert got.tolist() == [-1.0] * 5
    attr = win.get_attr(right)
    unified = attr.access_type == weft.WindowAccessType.UNIFIED
    if unified:
        remote = win.map_remote_tensor(right)
        assert remote.shape == (1000 + right,) and remote.dtype == torch.float32
    else:
        with pytest.raises(weft.WeftError, match="not mapped"):
            win.map_remote_tensor(right)
    assert torch.equal(win.map_remote_tensor(rank), buf)
    # A range past the target's end is refused on the origin.
    with pytest.raises(ValueError, match="outside rank"):
        win.put(torch.ones(2), right, n - 1, async_op=False)
    comm.barrier(False)
    win.tensor_deregister()
    # The tensor keeps its contents in storage of its own.
    assert torch.equal(buf, want)
    buf += 1
    comm.finalize()
    return unified


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_puts_land_in_the_registered_tensor(backend, world):
    unified = run(ring, world, backend, init=False)
    assert all(unified) == (backend == "shm")


def busy_target(rank, world, backend):
    comm = weft.new_comm(backend, "cpu")
    n = 16 << 20
    win = comm.new_window()
    buf = torch.zeros(n, dtype=torch.uint8)
    win.tensor_register(buf)
    comm.barrier(False)
    start = time.monotonic()
    if rank == 0:
        # Busy in Python (holding the GIL) for 2 s, never calling weft.
        x = 0
        while time.monotonic() - start < 2.0:
            x += 1
        end = time.monotonic() - start
        win.wait_signal(1, async_op=False, timeout=0.5)
        assert bool((buf == 7).all())
    else:
        win.put(torch.full((n,), 7, dtype=torch.uint8), 0, 0, async_op=False)
        win.signal(0, async_op=False)
        end = time.monotonic() - start
    win.tensor_deregister()
    comm.finalize()
    return end


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_target_busy_in_python_takes_puts(backend):
    target, origin = run(busy_target, 2, backend, init=False)
    assert origin < target, (origin, target)


def many_origins(rank, world, backend):
    comm = weft.new_comm(backend, "cpu")
    win = comm.new_window()
    buf = torch.zeros(world * 64 if rank == 0 else 0, dtype=torch.int64)
    win.tensor_register(buf)
    win.put(torch.full((64,), rank, dtype=torch.int64), 0, rank * 64, async_op=False)
    win.signal(0, async_op=False)
    if rank == 0:
        for origin in range(world):
            win.wait_signal(origin, async_op=False)
        assert buf.view(world, 64).tolist() == [[r] * 64 for r in range(world)]
    win.tensor_deregister()
    comm.finalize()


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_origin_into_one_target(backend):
    run(many_origins, 3, backend, init=False)


def timeout_names_the_peer(rank, world, backend):
    comm = weft.new_comm(backend, "cpu", abort_process_on_timeout_or_error=False)
    win = comm.new_window()
    win.tensor_register(torch.zeros(4))
    with pytest.raises(weft.WeftTimeoutError, match=f"rank {(rank + 1) % world}"):
        win.wait_signal((rank + 1) % world, async_op=False, timeout=0.2, hints={"no_such_key": "1"})
    # Hints go to weft, which ignores keys it does not know; a timeout that
    # is not a number of seconds is refused, on every window call.
    peer = (rank + 1) % world
    win.put(torch.ones(1), peer, 0, async_op=False, hints={"no_such_key": "1"})
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="not a number of seconds"):
            win.signal(peer, async_op=False, timeout=bad)
    comm.barrier(False)
    win.tensor_deregister()
    comm.finalize()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_missing_signal_times_out_naming_the_peer(backend):
    run(timeout_names_the_peer, 2, backend, init=False)
