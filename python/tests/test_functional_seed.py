"""The CPU-applicable behaviour of PyTorch's functional-collectives tests
(seed 002, test_inductor_collectives.py), written anew against weft:
compiled and eager results agree with buffer reuse, scalar and
non-contiguous inputs, all_to_all_single with and without split sizes,
permute_tensor, single-op and multi-op waits, and dynamo's rewrite of the
eager `dist.*` calls in every argument form."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from harness import run

BACKEND = "aot_eager"


def compiled_equals_eager(rank, world):
    group = dist.group.WORLD

    # Input buffer reuse: the all_reduce's input is read again after it.
    def reuse(a):
        ar = fc.all_reduce(a, "sum", group)
        c = torch.relu(a)
        return torch.matmul(c, c) + ar

    x = torch.ones(4, 4) + rank
    assert torch.equal(torch.compile(reuse, backend=BACKEND)(x), reuse(x))

    # permute_tensor: rank r's tensor goes to rank src_dst[r].
    def permute(t):
        return fc.permute_tensor(t, [(i + 1) % world for i in range(world)], group)

    t = torch.arange(2, dtype=torch.float32) + 2 * rank
    out = torch.compile(permute, backend=BACKEND)(t)
    assert torch.equal(out, torch.arange(2, dtype=torch.float32) + 2 * ((rank - 1) % world))

    # Output buffer reuse through an embedding, gathered and re-chunked.
    torch.manual_seed(0)
    emb = torch.nn.Embedding(4, 4)

    def gather_cat(idx):
        y = emb(idx)
        res = fc.all_gather_tensor(y, 0, group)
        return torch.cat(torch.chunk(res, world, dim=0), dim=y.dim() - 1)

    idx = torch.tensor([[2, 1, 3, 0]])
    assert torch.equal(torch.compile(gather_cat, backend=BACKEND)(idx), gather_cat(idx))

    # A scalar tensor into the eager list all_gather, compiled.
    def scalar_gather(s):
        outs = [torch.empty_like(s) for _ in range(world)]
        dist.all_gather(outs, s)
        return outs

    s = torch.tensor(rank, dtype=torch.long)
    assert [o.item() for o in torch.compile(scalar_gather, backend=BACKEND)(s)] == list(range(world))

    # An input made contiguous after an in-place transpose.
    def transposed(idx):
        y = emb(idx).transpose_(0, 2).contiguous()
        g = fc.all_gather_tensor(y, 0, group)
        return y.transpose_(0, 2).contiguous(), g

    a, b = torch.compile(transposed, backend=BACKEND)(idx)
    c, d = transposed(idx)
    assert torch.equal(a, c) and torch.equal(b, d)


def all_to_all_forms(rank, world):
    group = dist.group.WORLD

    # Split sizes computed from tensors at run time.
    def with_splits(inp, in_sizes, out_sizes):
        a2a = fc.all_to_all_single(inp, out_sizes.tolist(), in_sizes.tolist(), group)
        return a2a / a2a.sum(dim=0)

    sizes = torch.tensor([(i + 1) * (rank + 1) for i in range(world)])
    # Rank j receives (j+1)*(r+1) rows from each rank r.
    out_sizes = torch.tensor([(rank + 1) * (r + 1) for r in range(world)])
    inp = torch.ones(int(sizes.sum()), 5) * (rank + 1)
    eager = with_splits(inp, sizes, out_sizes)
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(with_splits, backend=BACKEND, fullgraph=True, dynamic=True)(inp, sizes, out_sizes)
    assert torch.allclose(eager, compiled)
    assert eager.shape[0] == int(out_sizes.sum())

    # No split sizes: equal parts.
    def no_splits(inp):
        a2a = torch.ops._c10d_functional.all_to_all_single(inp, [1] * world, [1] * world, group.group_name)
        return torch.ops._c10d_functional.wait_tensor(a2a)

    inp = torch.arange(world, dtype=torch.float32) + 10 * rank
    want = torch.tensor([10.0 * r + rank for r in range(world)])
    assert torch.equal(no_splits(inp), want)
    assert torch.equal(torch.compile(no_splits, backend=BACKEND, fullgraph=True)(inp), want)
    assert torch.equal(fc.all_to_all_single(inp, None, None, group), want)


def waits(rank, world):
    group = dist.group.WORLD
    name = group.group_name
    # Single op: wait_tensor returns the reduced buffer.
    x = torch.ones(4, 4) * (rank + 1)
    out = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", name))
    assert torch.equal(out, torch.full((4, 4), float(sum(range(1, world + 1)))))
    assert torch.equal(x, torch.ones(4, 4) * (rank + 1)), "the functional op must not mutate its input"
    # Several ops in flight, waited in reverse order.
    ins = [torch.full((8,), float(k + rank)) for k in range(5)]
    outs = [torch.ops._c10d_functional.all_reduce(t, "max", name) for t in ins]
    for k in reversed(range(5)):
        assert torch.equal(torch.ops._c10d_functional.wait_tensor(outs[k]), torch.full((8,), float(k + world - 1)))
    # An eager async all_reduce waited inside a compiled function.
    y = torch.ones(3) * 2
    work = dist.all_reduce(y, async_op=True)

    def finish(y):
        return y + 1

    work.wait()
    assert torch.equal(torch.compile(finish, backend=BACKEND)(y), torch.full((3,), 2.0 * world + 1))
    # In-place functional all_reduce_ on a buffer, then wait.
    z = torch.ones(2)
    torch.ops._c10d_functional.all_reduce_(z, "sum", name)
    torch.ops._c10d_functional.wait_tensor(z)
    assert torch.equal(z, torch.full((2,), float(world)))


def dynamo_rewrites(rank, world):
    from torch.distributed.distributed_c10d import GroupMember

    R = dist.ReduceOp
    forms = [((R.MAX, GroupMember.WORLD), {}), ((R.MAX, None), {}), ((), {"group": GroupMember.WORLD}), ((), {"group": None}), ((), {})]
    for args, kwargs in forms:

        def f(t):
            dist.all_reduce(t, *args, **kwargs)

        a, b = torch.ones(2) * (rank + 1), torch.ones(2) * (rank + 1)
        torch.compile(f, backend=BACKEND, fullgraph=True)(a)
        f(b)
        assert torch.equal(a, b), (args, kwargs, a, b)
    for op in (R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX):

        def g(t):
            dist.all_reduce(t, op=op)

        a, b = torch.arange(3.0) + rank, torch.arange(3.0) + rank
        torch.compile(g, backend=BACKEND, fullgraph=True)(a)
        g(b)
        assert torch.equal(a, b), op

    def a2a(out, inp):
        dist.all_to_all_single(out, inp, group=GroupMember.WORLD)

    o1, o2 = torch.empty(world), torch.empty(world)
    inp = torch.arange(world, dtype=torch.float32) + 10 * rank
    torch.compile(a2a, backend=BACKEND, fullgraph=True)(o1, inp)
    a2a(o2, inp)
    assert torch.equal(o1, o2)

    def gather_into(out, inp):
        dist.all_gather_into_tensor(out, inp)

    o1, o2 = torch.empty(2 * world), torch.empty(2 * world)
    torch.compile(gather_into, backend=BACKEND, fullgraph=True)(o1, torch.ones(2) * rank)
    gather_into(o2, torch.ones(2) * rank)
    assert torch.equal(o1, o2)

    def rs(out, inp):
        dist.reduce_scatter_tensor(out, inp)

    o1, o2 = torch.empty(2), torch.empty(2)
    inp = torch.arange(2.0 * world) + rank
    torch.compile(rs, backend=BACKEND, fullgraph=True)(o1, inp)
    rs(o2, inp)
    assert torch.equal(o1, o2)


def inductor(rank, world):
    group = dist.group.WORLD

    def f(a):
        x = a + 1
        ar = fc.all_reduce(x, "sum", group)
        return ar, torch.ones_like(a) + 22

    a = torch.ones(4, 4)
    got, other = torch.compile(f)(a)
    assert torch.equal(got, torch.full((4, 4), 2.0 * world)) and torch.equal(other, torch.full((4, 4), 23.0))


def test_compiled_equals_eager():
    run(compiled_equals_eager, 2, timeout=300)


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_single_with_and_without_split_sizes(world):
    run(all_to_all_forms, world, timeout=300)


def test_single_and_multi_op_waits():
    run(waits, 2, timeout=300)


def test_dynamo_rewrites_eager_calls():
    run(dynamo_rewrites, 2, timeout=300)


def test_inductor_on_cpu():
    run(inductor, 2, timeout=300)
