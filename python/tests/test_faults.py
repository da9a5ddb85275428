"""A rank killed mid-op: every other rank raises torch's exception for a
lost peer, naming it, within seconds, not at the timeout."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from harness import run

import weft


def killed_mid_all_reduce(rank, world, stamp):
    t = torch.ones(4 << 20)
    if rank == 1:
        for _ in range(3):
            dist.all_reduce(t)
        w = dist.all_reduce(t, async_op=True)  # noqa: F841 - in flight when killed
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    # (The others may still be in the third all_reduce when rank 1 dies:
    # the loss may surface there too.)
    try:
        while True:
            dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001 - the test looks at what came out
        return time.time(), type(e).__name__, isinstance(e, dist.DistNetworkError), getattr(e, "peer", None), str(e)


@pytest.mark.parametrize("inner", ["shm", "cpu-tcp"])
def test_a_rank_killed_mid_all_reduce_makes_every_other_rank_raise_naming_it(inner, tmp_path):
    stamp = str(tmp_path / "killed")
    out = run(killed_mid_all_reduce, 3, stamp, env={"WEFT_BACKEND": inner, "WEFT_TIMEOUT_SECONDS": "60"}, allow_fail=True)
    assert out[1][0] == "died", out[1]
    killed = float(open(stamp).read())
    for r in (0, 2):
        assert len(out[r]) == 5, (r, out[r])
        when, kind, network, peer, msg = out[r]
        assert network and kind == "WeftPeerLostError", (r, kind, msg)
        assert peer == 1 and "rank 1" in msg, (r, msg)
        assert when - killed < 10, f"rank {r} raised {when - killed:.1f} s after the kill"


def test_the_lost_peer_error_is_a_network_error_naming_the_peer():
    e = weft.WeftPeerLostError("peer rank 3 left", "peer_lost", 3, "all_reduce", 0)
    assert isinstance(e, dist.DistNetworkError) and str(e) == "peer rank 3 left"
    assert (e.kind, e.peer, e.op, e.rank) == ("peer_lost", 3, "all_reduce", 0)
