"""CUDA tensors through torch.distributed and TorchComm's windows, on a real
GPU (two ranks share it): every collective family on both CUDA backends,
results checked against the same op on host tensors' arithmetic, and device
windows (puts ordered on torch's current stream, ``map_remote_tensor`` over
CUDA IPC, 64 MiB puts, deregistration).

torch cannot make CUDA tensors without a device, so these tests run where
one is (``scripts/gpu-tests.sh`` runs this file on the lent GPU machine)
and are skipped elsewhere; the weft paths under them run in CI on weft's
emulated device (``tests/tests/cuda.rs``). The check for a device must not
start CUDA in this process: ranks are forked from it.
"""

import os
import shutil

import pytest
import torch
import torch.distributed as dist

from harness import run

import weft

pytestmark = pytest.mark.skipif(
    shutil.which("nvidia-smi") is None or not os.path.exists("/dev/nvidiactl"),
    reason="needs an NVIDIA GPU (scripts/gpu-tests.sh runs it on one)",
)

CUDA_BACKENDS = ["cpu:shm,cuda:cuda-device", "cpu:shm,cuda:cuda-host-staging"]


def collectives(rank, world):
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    checked = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        # Large enough for the pipelined and direct paths, odd to catch
        # tail handling.
        n = (1 << 20) + 3
        base = torch.arange(n, device=dev) % 97
        x = (base + rank).to(dtype)
        dist.all_reduce(x)
        want = (base * world + sum(range(world))).to(dtype)
        assert torch.equal(x, want), (dtype, x[:4], want[:4])
        x = (base + rank).to(dtype)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        assert torch.equal(x, (base + world - 1).to(dtype))
        checked.append(f"all_reduce {dtype}")

    b = torch.full((1000,), float(rank), device=dev)
    dist.broadcast(b, src=1)
    assert torch.equal(b, torch.full_like(b, 1.0))

    mine = torch.arange(6, device=dev, dtype=torch.float32) + 100 * rank
    out = torch.empty(6 * world, device=dev)
    dist.all_gather_into_tensor(out, mine)
    assert torch.equal(out, torch.cat([torch.arange(6, device=dev, dtype=torch.float32) + 100 * r for r in range(world)]))

    inp = torch.arange(4 * world, device=dev, dtype=torch.float32) + rank
    rs = torch.empty(4, device=dev)
    dist.reduce_scatter_tensor(rs, inp)
    want = (torch.arange(4 * world, device=dev, dtype=torch.float32) * world + sum(range(world)))[4 * rank : 4 * rank + 4]
    assert torch.equal(rs, want)

    a2a_in = torch.arange(3 * world, device=dev, dtype=torch.float32) + 1000 * rank
    a2a_out = torch.empty_like(a2a_in)
    dist.all_to_all_single(a2a_out, a2a_in)
    want = torch.cat([torch.arange(3 * rank, 3 * rank + 3, device=dev, dtype=torch.float32) + 1000 * r for r in range(world)])
    assert torch.equal(a2a_out, want)

    # Point-to-point around the ring, async, on a side stream.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        s = torch.full((1 << 16,), float(rank), device=dev)
        r = torch.empty_like(s)
        ops = [dist.P2POp(dist.isend, s, (rank + 1) % world), dist.P2POp(dist.irecv, r, (rank - 1) % world)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        ok = torch.equal(r, torch.full_like(r, float((rank - 1) % world)))
    assert ok
    torch.cuda.synchronize()
    return "ok"


@pytest.mark.parametrize("spec", CUDA_BACKENDS)
def test_collectives_on_cuda_tensors(spec):
    assert run(collectives, 2, env={"WEFT_BACKEND": spec}) == ["ok", "ok"]


def device_window(rank, world):
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    comm = weft.new_comm("cpu:shm,cuda:cuda-device", dev)
    right, left = (rank + 1) % world, (rank - 1) % world
    n = (16 << 20) + rank  # 64 MiB of float32 (and a bit), sizes differ
    buf = torch.zeros(n, device=dev)
    win = comm.new_window()
    win.tensor_register(buf)
    assert buf.is_cuda
    m = (16 << 20) + right
    src = torch.arange(m, device=dev, dtype=torch.float32) + rank
    # Whole, then a piece at an element offset, then the last element, on
    # a side stream: ordering follows torch's current stream.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        win.put(src, right, 0, async_op=False)
        win.put(torch.full((7,), -1.0, device=dev), right, 100, async_op=False)
        w = win.put(torch.tensor([-2.0], device=dev), right, m - 1, async_op=True)
        w.wait()
        win.signal(right, async_op=False)
    torch.cuda.current_stream().wait_stream(side)
    win.wait_signal(left, async_op=False)
    want = torch.arange(n, device=dev, dtype=torch.float32) + left
    want[100:107] = -1.0
    want[-1] = -2.0
    assert torch.equal(buf, want)
    # Gets, the peer's memory mapped here, and a wrong device refused.
    got = torch.empty(5, device=dev)
    win.get(got, right, 100, async_op=False)
    assert got.tolist() == [-1.0] * 5
    assert win.get_attr(right).access_type == weft.WindowAccessType.UNIFIED
    remote = win.map_remote_tensor(right)
    assert remote.is_cuda and remote.shape == (m,)
    assert remote[100:103].tolist() == [-1.0] * 3
    del remote
    with pytest.raises(ValueError):
        win.put(torch.ones(2), right, 0, async_op=False)
    with pytest.raises(ValueError, match="outside rank"):
        win.put(torch.ones(2, device=dev), right, m - 1, async_op=False)
    comm.barrier(False)
    win.tensor_deregister()
    assert torch.equal(buf, want)
    # A host-staging group has no device windows: a clear refusal.
    staged = weft.new_comm("cpu:shm,cuda:cuda-host-staging", dev, name="staged")
    with pytest.raises(Exception, match="no windows"):
        staged.new_window().tensor_register(torch.zeros(4, device=dev))
    staged.finalize()
    comm.finalize()
    return "ok"


def test_device_windows():
    assert run(device_window, 2, init=False) == ["ok", "ok"]
