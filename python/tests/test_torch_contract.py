"""What torch 2.15 asks of a CPU backend beyond the ops: torch sees weft as
its group's backend per device (async checkpointing, monitored_barrier),
gather_single, coalescing as one batch, per-group timeouts, get_error,
split_group and shrink_group, windows through torch's API."""

import gc
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import run, weft_backend

import weft

CPU = torch.device("cpu")


# -- the group's devices and backend ------------------------------------------


def devices_and_backend(rank, world):
    pg = dist.group.WORLD
    b = pg._get_backend(CPU)
    return (
        [d.type for d in pg._device_types],
        type(b).__name__,
        b.get_error() == dist.ErrorType.SUCCESS if hasattr(dist, "ErrorType") else str(b.get_error()),
        b.supports_splitting and b.supports_coalescing and b.supports_shrinking and b.supports_window,
        b.options._timeout.total_seconds(),
    )


@pytest.mark.parametrize("spec", ["weft", "cpu:weft", "cpu:weft,cuda:gloo"])
def test_torch_sees_weft_as_the_cpu_backend_of_its_group(spec):
    for types, cls, ok, caps, timeout in run(devices_and_backend, 2, backend=spec):
        assert "cpu" in types and cls == "Backend", (types, cls)
        assert ok is True or ok.endswith("SUCCESS"), ok
        assert caps and timeout == 60.0


def is_completed_and_source(rank, world):
    t = torch.full((4,), float(rank))
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    done = w.is_completed()
    if rank == 0:
        buf = torch.zeros(2)
        src = dist.recv(buf)
        return done, src, buf.tolist()
    dist.send(torch.full((2,), 7.0), 0)
    return done, None, None


@pytest.mark.parametrize("spec", ["weft", "cpu:weft,cuda:gloo"])
def test_works_keep_is_completed_and_recv_from_any_rank(spec):
    out = run(is_completed_and_source, 2, backend=spec)
    assert out[0] == (True, 1, [7.0, 7.0]) and out[1][0] is True


def hooks_and_recorder(rank, world):
    import json

    from torch._C._distributed_c10d import _dump_fr_trace_json

    pg = dist.group.WORLD
    seen = []
    pg.register_pre_hook(3, lambda a: seen.append(("pre", a.name.name)))
    pg.register_post_hook(3, lambda a: seen.append(("post", a.name.name, a.work is not None)))
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.broadcast(t, 0, async_op=True).wait()
    pg.unregister_pre_hook(3)
    pg.unregister_post_hook(3)
    entries = json.loads(_dump_fr_trace_json(True, False, backend="weft"))["entries"]
    recorded = [(e["profiling_name"], e["state"]) for e in entries]
    try:  # torch's NaN check (TORCH_DIST_NAN_CHECK) is a pre-hook too
        dist.all_reduce(torch.tensor([float("nan")]))
        nan = "passed"
    except RuntimeError as e:
        nan = str(e)
    aborted = []
    pg.register_abort_hook(1, lambda: aborted.append("second"))
    pg.register_abort_hook(0, lambda: aborted.append("first"))
    pg.register_abort_hook(2, lambda: aborted.append("dropped"))
    pg.unregister_abort_hook(2)
    pg.abort()
    try:
        dist.all_reduce(t)
        after = "no error"
    except Exception as e:  # noqa: BLE001
        after = type(e).__name__
    return seen, recorded, nan, pg.supports_abort_hooks, aborted, after


def test_per_op_hooks_the_flight_recorder_and_abort_hooks_see_weft():
    # Per-op hooks and the recorder see ops that go through torch's
    # dispatcher: torch's own group, which weft-only specs get with
    # WEFT_TORCH_HOOKS=1 (mixed specs always).
    env = {"WEFT_TORCH_HOOKS": "1", "TORCH_DIST_NAN_CHECK": "1"}
    for seen, recorded, nan, supported, aborted, after in run(hooks_and_recorder, 2, allow_fail=True, env=env):
        assert seen == [("pre", "ALLREDUCE"), ("post", "ALLREDUCE", True), ("pre", "BROADCAST"), ("post", "BROADCAST", True)], seen
        assert recorded == [("weft:all_reduce", "completed"), ("weft:broadcast", "completed")], recorded
        assert "NaN" in nan, nan
        assert supported and aborted == ["first", "second"] and after != "no error", (supported, aborted, after)


# -- ops torch 2.15 made public -------------------------------------------------


def single_ops(rank, world, async_op):
    def done(w):
        if async_op:
            w.wait()

    x = torch.arange(3, dtype=torch.float32) + 10 * rank
    out = {}
    g = torch.zeros(world * 3) if rank == 1 else None
    done(dist.gather_single(x, g, group_dst=1, async_op=async_op))
    out["gather_single"] = g.tolist() if g is not None else None
    g2 = torch.zeros(world, 3) if rank == 0 else None
    done(dist.gather_into_tensor(x, g2, dst=0, async_op=async_op))
    out["gather_into_tensor"] = g2.tolist() if g2 is not None else None
    ag = torch.zeros(world * 3)
    done(dist.all_gather_single(ag, x, async_op=async_op))
    out["all_gather_single"] = ag.tolist()
    rs = torch.zeros(1)
    done(dist.reduce_scatter_single(rs, torch.arange(world, dtype=torch.float32) + rank, async_op=async_op))
    out["reduce_scatter_single"] = rs.tolist()
    return out


@pytest.mark.parametrize("spec,async_op", [("weft", False), ("weft", True), ("cpu:weft,cuda:gloo", True)])
def test_gather_single_gather_into_tensor_and_the_single_ops(spec, async_op):
    world = 3
    out = run(single_ops, world, async_op, backend=spec)
    rows = [[float(i + 10 * r) for i in range(3)] for r in range(world)]
    flat = [v for row in rows for v in row]
    for r, o in enumerate(out):
        assert o["gather_single"] == (flat if r == 1 else None)
        assert o["gather_into_tensor"] == (rows if r == 0 else None)
        assert o["all_gather_single"] == flat
        assert o["reduce_scatter_single"] == [float(world * r + sum(range(world)))]


class _Counting:
    """A native group that counts the ops issued through it."""

    def __init__(self, native):
        self._n = native
        self.calls = []

    def __getattr__(self, name):
        attr = getattr(self._n, name)
        if callable(attr):

            def call(*a, **k):
                self.calls.append(name)
                return attr(*a, **k)

            return call
        return attr


def coalesced(rank, world, async_ops):
    from torch.distributed.distributed_c10d import _coalescing_manager

    pg = dist.group.WORLD
    # Every object holding the native group (weft's Backend; its group too
    # where weft is the whole group) counts through the proxy.
    holders = [o for o in (pg, weft_backend()) if hasattr(o, "_native")]
    counting = _Counting(holders[-1]._native)
    for o in holders:
        o._native = counting
    ts = [torch.full((n,), float(rank + 1)) for n in (3, 1, 5)]
    with _coalescing_manager(pg, CPU, async_ops=async_ops) as cm:
        for t in ts:
            dist.all_reduce(t)
    if async_ops:
        works = cm.works
        cm.wait()
    else:
        works = None
    # Sends and receives in one batch too.
    peer = 1 - rank
    got = torch.zeros(4)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, peer), dist.P2POp(dist.isend, torch.full((4,), float(rank)), peer)])
    for r in reqs:
        r.wait()
    for o in holders:
        o._native = counting._n
    return [t.tolist() for t in ts], counting.calls, len(works) if works is not None else None, len(reqs), got.tolist()


@pytest.mark.parametrize("async_ops", [False, True])
def test_coalescing_manager_reaches_weft_as_one_batch_with_one_work(async_ops):
    for rank, (ts, calls, nworks, nreqs, got) in enumerate(run(coalesced, 2, async_ops)):
        assert ts == [[3.0] * 3, [3.0], [3.0] * 5]
        assert calls == ["all_reduce", "batch_p2p"], calls
        assert nworks in (None, 1) and nreqs == 1
        assert got == [float(1 - rank)] * 4


# -- timeouts, errors, monitored_barrier ---------------------------------------


def late_peer(rank, world):
    pg = dist.group.WORLD
    dist.set_timeout(timedelta(seconds=3))
    t = torch.ones(4)
    if rank == 1:
        time.sleep(12)
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001 - the test looks at it
        took = time.monotonic() - start
        return took, type(e).__name__, isinstance(e, dist.DistBackendError), str(pg._get_backend(CPU).get_error())
    return "no error"


def test_set_timeout_bounds_the_groups_later_ops_and_get_error_reads_timeout():
    out = run(late_peer, 2, env={"WEFT_TIMEOUT_SECONDS": ""}, allow_fail=True)
    took, kind, backend_error, error = out[0]
    assert 2.5 < took < 4.0 and backend_error, (took, kind)
    assert error.endswith("TIMEOUT"), error


def killed_peer_error(rank, world, inner):
    pg = dist.group.WORLD
    aborted = []
    pg.register_abort_hook(0, lambda: aborted.append(pg.rank()))
    t = torch.ones(1 << 16)
    dist.all_reduce(t)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        while True:
            dist.all_reduce(t)
    except Exception:  # noqa: BLE001
        # The hooks ran before the error reached here, once.
        fired = list(aborted)
        for _ in range(2):
            with pytest.raises(Exception):  # noqa: B017, PT011
                dist.all_reduce(t)
        return str(pg._get_backend(CPU).get_error()), fired, aborted


@pytest.mark.parametrize("shape", ["own", "torch"])
@pytest.mark.parametrize("inner", ["shm", "cpu-tcp"])
def test_a_peer_killed_gives_a_remote_error_and_runs_the_abort_hooks(inner, shape):
    env = {"WEFT_BACKEND": inner, "WEFT_TORCH_HOOKS": "1" if shape == "torch" else "0"}
    error, fired, aborted = run(killed_peer_error, 2, inner, env=env, allow_fail=True)[0]
    assert error.endswith("REMOTE_ERROR") or error.endswith("COMM_ERROR"), error
    assert fired == [0] and aborted == [0], (fired, aborted)


def monitored(rank, world, absent, wait_all):
    if rank in absent:
        time.sleep(4)
        return None
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=2), wait_all_ranks=wait_all)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return "passed"


def test_monitored_barrier_passes_when_every_rank_comes():
    assert run(monitored, 3, (), False) == ["passed"] * 3


@pytest.mark.parametrize("wait_all", [False, True])
def test_monitored_barrier_names_the_ranks_that_did_not_come(wait_all):
    out = run(monitored, 4, (1, 3), wait_all, allow_fail=True)
    kind, msg = out[0]
    assert isinstance(out[0], tuple) and "did not reach the barrier" in msg, out[0]
    if wait_all:
        assert "ranks [1, 3]" in msg, msg
    else:
        assert "rank 1 " in msg and "3" not in msg.split("within")[0], msg
    kind2, msg2 = out[2]
    assert "rank 2" in msg2, msg2


# -- split_group -----------------------------------------------------------


def split_pairs(rank, world):
    pairs = dist.split_group(split_ranks=[[0, 1], [2, 3]])
    mine = torch.full((3,), float(rank + 1))
    parent = torch.ones(2)
    w1 = dist.all_reduce(mine, group=pairs, async_op=True)
    w2 = dist.all_reduce(parent, async_op=True)
    w1.wait()
    w2.wait()
    # Edge groups: one round makes disjoint directed pairs; use every one.
    edges = dist.split_group(split_ranks=[[0, 1], [2, 3]] if rank < 4 else None)
    peer = rank ^ 1
    got = torch.zeros(2)
    ws = [dist.isend(torch.full((2,), float(rank)), group_dst=1 - dist.get_rank(edges), group=edges), dist.irecv(got, group_src=1 - dist.get_rank(edges), group=edges)]
    for w in ws:
        w.wait()
    return mine.tolist(), parent.tolist(), got.tolist(), peer, dist.get_world_size(pairs), type(pairs).__name__


@pytest.mark.parametrize("spec", ["weft", "cpu:weft,cuda:gloo"])
def test_split_group_into_pairs_used_with_the_parent(spec):
    out = run(split_pairs, 4, backend=spec)
    for r, (mine, parent, got, peer, size, cls) in enumerate(out):
        low = r & ~1
        assert mine == [float(low + 1 + low + 2)] * 3 and parent == [4.0, 4.0]
        assert got == [float(peer)] * 2 and size == 2 and cls == "ProcessGroup"


def pipeline_edges(rank, world):
    from torch.distributed.pipelining._p2p import _build_p2p_edge_groups  # noqa: F401 - present in 2.15

    rounds = [[[0, 1], [2, 3]], [[1, 2]], [[0, 3]], [[0, 2], [1, 3]]]
    groups = {}
    for split in rounds:
        g = dist.split_group(split_ranks=split)
        for pair in split:
            if rank in pair:
                groups[tuple(pair)] = g
    sums = {}
    for pair, g in sorted(groups.items()):
        t = torch.full((2,), float(rank))
        dist.all_reduce(t, group=g)
        sums[pair] = t.tolist()
    return sums


def test_split_group_rounds_of_a_four_stage_pipelines_edges():
    for r, sums in enumerate(run(pipeline_edges, 4)):
        for (a, b), v in sums.items():
            assert r in (a, b) and v == [float(a + b)] * 2


# -- shrink_group ----------------------------------------------------------


def shrink_after_kill(rank, world, victim, flags, list_victim):
    t = torch.ones(1 << 16)
    dist.all_reduce(t)
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        while True:
            dist.all_reduce(t)
    except Exception:  # noqa: BLE001 - the op that saw the death
        pass
    killed = time.monotonic()
    try:
        new = dist.shrink_group([victim] if list_victim else [world - 1 if victim != world - 1 else 0], shrink_flags=flags)
    except Exception as e:  # noqa: BLE001
        return "refused", type(e).__name__, str(e)
    ready = time.monotonic() - killed
    x = torch.full((5,), float(rank))
    dist.all_reduce(x, group=new)
    w = dist.all_reduce(torch.ones(2), async_op=True)
    w.wait()
    # The shrunk group (torch's own, around weft's Backend) keeps weft's Work.
    src = None
    if dist.get_rank() == 0:
        src = dist.recv(torch.zeros(1))
    elif dist.get_rank() == 1:
        dist.send(torch.ones(1), 0)
    return ready, x.tolist(), new.size(), new is dist.group.WORLD, dist.get_rank(), w.is_completed(), src


@pytest.mark.parametrize("inner", ["shm", "cpu-tcp"])
@pytest.mark.parametrize("world", [3, 4])
def test_shrink_group_after_a_rank_is_killed(inner, world):
    victim = 1
    out = run(shrink_after_kill, world, victim, dist.distributed_c10d.SHRINK_DEFAULT, True, env={"WEFT_BACKEND": inner}, allow_fail=True)
    survivors = [r for r in range(world) if r != victim]
    want = float(sum(survivors))
    for r in survivors:
        ready, x, size, is_world, new_rank, done, src = out[r]
        assert x == [want] * 5 and size == world - 1 and is_world and done, out[r]
        assert new_rank == survivors.index(r) and src == (1 if new_rank == 0 else None)
        assert ready < 5.0, ready


def test_shrink_group_with_abort_and_a_dead_rank_not_listed():
    out = run(shrink_after_kill, 3, 2, dist.distributed_c10d.SHRINK_ABORT, True, allow_fail=True)
    assert out[0][1] == [1.0] * 5 and out[1][1] == [1.0] * 5, out
    # Rank 1 dies but the survivors list rank 0... which is themselves: torch
    # refuses; listing nobody dead gives weft's error naming the dead rank.
    out = run(shrink_after_kill, 4, 1, 0, False, allow_fail=True)
    for r in (0, 2):
        assert out[r][0] == "refused" and "rank(s) [1]" in out[r][2], out[r]


def excluded_calls(rank, world):
    try:
        dist.shrink_group([rank])
    except RuntimeError as e:
        return "RuntimeError", str(e)
    return "accepted"


def test_an_excluded_rank_calling_shrink_group_gets_torchs_runtime_error():
    for kind, msg in run(excluded_calls, 2):
        assert kind == "RuntimeError" and "exclusion list" in msg


# -- windows through torch ---------------------------------------------------


def torch_windows(rank, world, inner, spec):
    pg = dist.group.WORLD
    right, left = (rank + 1) % world, (rank - 1) % world
    buf = torch.zeros(100 + rank)
    # In a mixed spec the group's new_window asks its default backend (the
    # CUDA one); weft's is the CPU backend's.
    win = pg.new_window() if spec == "weft" else pg._get_backend(CPU).new_window()
    win.tensor_register(buf, owning=False)
    n = 100 + right
    c10d = torch._C._distributed_c10d
    opts = c10d.PutOptions()
    opts.timeout = timedelta(seconds=5)
    win.put(torch.arange(n, dtype=torch.float32), right, 0, False, opts)
    win.put(torch.full((3,), -1.0), right, 10, True).wait()
    waiting = win.wait_signal(left, True)
    early = waiting.is_completed()
    win.signal(right, False, c10d.SignalOptions())
    waiting.wait()
    want = torch.arange(100 + rank, dtype=torch.float32)
    want[10:13] = -1.0
    ok = torch.equal(buf, want)
    try:
        win.put(torch.ones(5), right, n - 2, False)
        past_end = "accepted"
    except ValueError as e:
        past_end = str(e)
    access = win.get_attr(right).access_type
    mapped = win.map_remote_tensor(right)[:3].tolist() if access == c10d.WindowAccessType.UNIFIED else None
    dist.barrier()
    win.tensor_deregister()
    return ok, early, past_end, str(access), mapped


@pytest.mark.parametrize("inner", ["shm", "cpu-tcp"])
@pytest.mark.parametrize("world", [2, 3])
def test_windows_through_torchs_api(inner, world):
    # The mixed spec too: torch's group reaches weft's window through the C++ backend.
    spec = "cpu:weft,cuda:gloo" if world == 3 else "weft"
    for ok, early, past_end, access, mapped in run(torch_windows, world, inner, spec, env={"WEFT_BACKEND": inner}, backend=spec):
        assert ok and past_end != "accepted", past_end
        if inner == "shm":
            assert access.endswith("UNIFIED") and mapped == [0.0, 1.0, 2.0]
        else:
            assert access.endswith("SEPARATE") and mapped is None


# -- async checkpointing ---------------------------------------------------


def dcp_async_round_trip(rank, world, where):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    mesh = init_device_mesh("cpu", (world,))
    m = fully_shard(model(), mesh=mesh)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(float(rank + 1))  # sharded: each rank moves its own shard
    saved = {k: v.full_tensor().clone() for k, v in get_model_state_dict(m).items()}
    fut = dcp.async_save(get_model_state_dict(m), checkpoint_id=where)
    fut.result()
    fresh = fully_shard(model(), mesh=mesh)
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=where)
    set_model_state_dict(fresh, state)
    loaded = {k: v.full_tensor() for k, v in get_model_state_dict(fresh).items()}
    return all(torch.equal(saved[k], loaded[k]) for k in saved) and saved.keys() == loaded.keys()


@pytest.mark.parametrize("spec", ["weft", "cpu:weft"])
def test_dcp_async_save_then_load_of_an_fsdp2_model(spec, tmp_path):
    assert run(dcp_async_round_trip, 2, str(tmp_path / "ckpt"), backend=spec) == [True, True]


# -- pipelining over per-edge communicators --------------------------------

STAGES = 4


def _pipeline_layers():
    torch.manual_seed(1)
    return [torch.nn.Linear(6, 6) for _ in range(STAGES)]


def _pipeline_data():
    torch.manual_seed(2)
    return torch.randn(8, 6), torch.randn(8, 6)


def pipeline_1f1b(rank, world, per_edge):
    import torch.distributed.config as dist_config
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    dist_config.pipeline_per_edge_p2p = per_edge
    layer = _pipeline_layers()[rank]
    x, y = _pipeline_data()
    stage = PipelineStage(layer, rank, world, torch.device("cpu"))
    losses = []
    sched = Schedule1F1B(stage, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss)
    if rank == 0:
        sched.step(x)
    elif rank == world - 1:
        sched.step(target=y, losses=losses)
    else:
        sched.step()
    from torch.distributed.pipelining import _p2p

    edges = sum(len(groups) for groups, _ in (v for cache in _p2p._PP_EDGE_GROUP_CACHE.values() for v in cache.values()))
    return [float(v) for v in losses], [p.grad.clone() for p in layer.parameters()], edges


@pytest.mark.parametrize("per_edge", [True, False])
def test_1f1b_pipeline_gives_the_loss_and_gradients_of_one_process(per_edge):
    layers = _pipeline_layers()
    model = torch.nn.Sequential(*layers)
    x, y = _pipeline_data()
    want_losses = []
    for xm, ym in zip(x.chunk(4), y.chunk(4)):
        loss = torch.nn.functional.mse_loss(model(xm), ym)
        (loss / 4).backward()  # the schedule averages over its microbatches
        want_losses.append(loss.item())
    out = run(pipeline_1f1b, STAGES, per_edge)
    assert out[-1][0] == pytest.approx(want_losses, rel=1e-5)
    for r, (_, grads, edges) in enumerate(out):
        # Per edge: each stage holds the groups of its edges (to its neighbours).
        assert (edges > 0) == per_edge, edges
        for g, p in zip(grads, layers[r].parameters()):
            assert torch.allclose(g, p.grad, rtol=1e-5, atol=1e-6), r


# -- lifecycle -------------------------------------------------------------------


def groups_made_and_destroyed(rank, world):
    def fds():
        return len(os.listdir("/proc/self/fd"))

    def one():
        g = dist.new_group([0, 1], backend="weft")
        dist.all_reduce(torch.ones(1), group=g)
        dist.destroy_process_group(g)

    one()
    gc.collect()
    before = fds()
    for _ in range(10):
        one()
    gc.collect()
    return fds() - before


@pytest.mark.parametrize("cpp", ["1", "0"])
def test_destroying_a_group_closes_its_connections(cpp):
    """destroy_process_group lets weft's group go: its sockets close (each
    cpu-tcp group holds some), in both of weft's shapes."""
    grew = run(groups_made_and_destroyed, 2, env={"WEFT_BACKEND": "cpu-tcp", "WEFT_TORCH_CPP": cpp})
    assert grew == [0, 0], grew
