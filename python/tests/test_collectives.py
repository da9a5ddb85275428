"""Every torch.distributed collective on CPU tensors of every dtype, with
async_op False and True, checked exactly against values computed locally."""

import functools

import pytest
import torch
import torch.distributed as dist

from harness import run, weft_backend

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool]
FLOATS = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
R = dist.ReduceOp


def value(rank, n, dtype, salt=0):
    """Rank `rank`'s tensor: small values whose sums and products are exact."""
    base = (torch.arange(n) + salt) % 3 + rank + 1
    if dtype == torch.bool:
        return (base + rank) % 2 == 0
    return base.to(dtype)


def fold(parts, op, dtype):
    """The reduction of `parts` with `op`, in `dtype` as weft computes it."""
    if dtype == torch.bool:
        stack = torch.stack(parts)
        if op in (R.SUM, R.MAX, R.BOR):
            return stack.any(0)
        if op in (R.PRODUCT, R.MIN, R.BAND):
            return stack.all(0)
        return functools.reduce(torch.logical_xor, parts)
    if op == R.AVG:
        return (torch.stack([p.double() for p in parts]).sum(0) / len(parts)).to(dtype)
    combine = {
        R.SUM: torch.add,
        R.PRODUCT: torch.mul,
        R.MIN: torch.minimum,
        R.MAX: torch.maximum,
        R.BAND: torch.bitwise_and,
        R.BOR: torch.bitwise_or,
        R.BXOR: torch.bitwise_xor,
    }[op]
    return functools.reduce(combine, parts)


def ops_for(dtype):
    ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX]
    if dtype in FLOATS:
        ops.append(R.AVG)
    else:
        ops += [R.BAND, R.BOR, R.BXOR]
    return ops


def issue(call, async_op):
    """Run a dist call sync or async; async ones are waited for here."""
    w = call(async_op)
    if async_op:
        assert w is not None
        w.wait()
        assert w.is_completed()
    else:
        assert w is None


def all_reduces(rank, world):
    n = 37
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for async_op in (False, True):
                t = value(rank, n, dtype)
                issue(lambda a: dist.all_reduce(t, op=op, async_op=a), async_op)
                want = fold([value(r, n, dtype) for r in range(world)], op, dtype)
                assert torch.equal(t, want), f"{dtype} {op} async={async_op}: {t} != {want}"
        if dtype in FLOATS:
            t = value(rank, n, dtype)
            dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
            want = fold([value(r, n, dtype) * 0.5 for r in range(world)], R.SUM, dtype)
            assert torch.equal(t, want), f"{dtype} premul_sum"


def rooted_and_gathers(rank, world):
    n = 11
    for dtype in DTYPES:
        mine = value(rank, n, dtype)
        every = [value(r, n, dtype) for r in range(world)]
        root = world - 1
        for a in (False, True):
            t = mine.clone()
            issue(lambda x: dist.broadcast(t, src=root, async_op=x), a)
            assert torch.equal(t, every[root]), f"broadcast {dtype}"

            t = mine.clone()
            issue(lambda x: dist.reduce(t, dst=0, op=R.MAX, async_op=x), a)
            assert torch.equal(t, fold(every, R.MAX, dtype) if rank == 0 else mine), f"reduce {dtype}"

            outs = [torch.zeros(n, dtype=dtype) for _ in range(world)]
            issue(lambda x: dist.all_gather(outs, mine, async_op=x), a)
            assert all(torch.equal(o, e) for o, e in zip(outs, every)), f"all_gather {dtype}"

            out = torch.zeros(world * n, dtype=dtype)
            issue(lambda x: dist.all_gather_into_tensor(out, mine, async_op=x), a)
            assert torch.equal(out, torch.cat(every)), f"all_gather_into_tensor {dtype}"

            # Reduce-scatter: rank r's input is W parts, part j salted by j.
            ins = [value(rank, n, dtype, salt=j) for j in range(world)]
            out = torch.zeros(n, dtype=dtype)
            issue(lambda x: dist.reduce_scatter(out, ins, op=R.MIN, async_op=x), a)
            want = fold([value(r, n, dtype, salt=rank) for r in range(world)], R.MIN, dtype)
            assert torch.equal(out, want), f"reduce_scatter {dtype}"

            out = torch.zeros(n, dtype=dtype)
            issue(lambda x: dist.reduce_scatter_tensor(out, torch.cat(ins), op=R.SUM, async_op=x), a)
            want = fold([value(r, n, dtype, salt=rank) for r in range(world)], R.SUM, dtype)
            assert torch.equal(out, want), f"reduce_scatter_tensor {dtype}"

            # All-to-all: rank r sends part j (salted by r*W+j) to rank j.
            ins = [value(rank, n, dtype, salt=rank * world + j) for j in range(world)]
            outs = [torch.zeros(n, dtype=dtype) for _ in range(world)]
            issue(lambda x: dist.all_to_all(outs, ins, async_op=x), a)
            for j in range(world):
                assert torch.equal(outs[j], value(j, n, dtype, salt=j * world + rank)), f"all_to_all {dtype}"

            out = torch.zeros(world * n, dtype=dtype)
            issue(lambda x: dist.all_to_all_single(out, torch.cat(ins), async_op=x), a)
            assert torch.equal(out, torch.cat([value(j, n, dtype, salt=j * world + rank) for j in range(world)])), f"a2a single {dtype}"

            gl = [torch.zeros(n, dtype=dtype) for _ in range(world)] if rank == root else None
            issue(lambda x: dist.gather(mine, gl, dst=root, async_op=x), a)
            if rank == root:
                assert all(torch.equal(o, e) for o, e in zip(gl, every)), f"gather {dtype}"

            out = torch.zeros(n, dtype=dtype)
            sl = [value(root, n, dtype, salt=j) for j in range(world)] if rank == root else None
            issue(lambda x: dist.scatter(out, sl, src=root, async_op=x), a)
            assert torch.equal(out, value(root, n, dtype, salt=rank)), f"scatter {dtype}"

            issue(lambda x: dist.barrier(async_op=x), a)


def uneven_all_to_all(rank, world):
    # Rank r sends (r + j + 1) rows of 3 columns to rank j.
    cols = 3
    in_splits = [rank + j + 1 for j in range(world)]
    out_splits = [j + rank + 1 for j in range(world)]
    inp = torch.cat([torch.full((in_splits[j], cols), float(rank * 10 + j)) for j in range(world)])
    out = torch.zeros(sum(out_splits), cols)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    want = torch.cat([torch.full((out_splits[j], cols), float(j * 10 + rank)) for j in range(world)])
    assert torch.equal(out, want), (out, want)
    # List form with different sizes per peer.
    ins = [torch.full((in_splits[j],), rank * 10 + j, dtype=torch.int64) for j in range(world)]
    outs = [torch.zeros(out_splits[j], dtype=torch.int64) for j in range(world)]
    dist.all_to_all(outs, ins)
    for j in range(world):
        assert torch.equal(outs[j], torch.full((out_splits[j],), j * 10 + rank, dtype=torch.int64))


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_every_op_and_dtype(world):
    run(all_reduces, world)


@pytest.mark.parametrize("world", [2, 4])
def test_rooted_gather_scatter_and_all_to_all_every_dtype(world):
    run(rooted_and_gathers, world)


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_single_with_uneven_splits(world):
    run(uneven_all_to_all, world)


@pytest.mark.parametrize("inner", ["shm", "cpu-tcp"])
def test_inner_backends(inner):
    """WEFT_BACKEND picks what runs inside; the default on one host is shm."""

    def check(rank, world):
        name = weft_backend().weft_backend_name()
        t = torch.ones(1000)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((1000,), 2.0))
        return name

    assert run(check, 2, env={"WEFT_BACKEND": inner}) == [inner, inner]
    assert run(check, 2) == ["shm", "shm"]
