"""What torch builds on a process group, over weft: DDP (with a comm hook),
FSDP2, DTensor, functional collectives (also under torch.compile), and
TORCH_DISTRIBUTED_DEBUG=DETAIL."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from harness import run

STEPS = 5


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def batches(world):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4 * world, 8, generator=g, dtype=torch.float64), torch.randn(4 * world, 4, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def train(model, world, rank=None):
    """SGD steps on `batches`: this rank's share of each, or all of it."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(world):
        if rank is not None:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def reference(world):
    """One process trained on the whole batch."""
    model = make_model()
    train(model, world)
    return [p.detach() for p in model.parameters()]


def ddp(rank, world, hook):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model())
    if hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(state=None, hook=default_hooks.allreduce_hook)
    train(model, world, rank)
    return [p.detach() for p in model.module.parameters()]


@pytest.mark.parametrize("hook", [False, True])
def test_ddp_matches_one_process_on_the_whole_batch(hook):
    world = 2
    want = reference(world)
    for params in run(ddp, world, hook):
        for got, ref in zip(params, want):
            assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12), (got - ref).abs().max()


def fsdp2(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train(model, world, rank)
    return [p.full_tensor().detach() for p in model.parameters()]


def test_fsdp2_fully_shard_trains_like_one_process():
    world = 2
    want = reference(world)
    for params in run(fsdp2, world):
        for got, ref in zip(params, want):
            assert torch.allclose(got, ref, rtol=1e-10, atol=1e-12), (got - ref).abs().max()


def dtensor(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor, DTensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(8 * world * 3, dtype=torch.float32).reshape(8 * world, 3)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.equal(sharded.to_local(), full.chunk(world)[rank])
    assert torch.equal(sharded.redistribute(mesh, [Replicate()]).to_local(), full)
    # Partial -> Replicate is an all_reduce.
    part = DTensor.from_local(torch.full((4,), float(rank + 1)), mesh, [Partial()])
    assert torch.equal(part.redistribute(mesh, [Replicate()]).to_local(), torch.full((4,), float(sum(range(1, world + 1)))))
    # Shard(1) of a matmul result, gathered.
    a = distribute_tensor(torch.ones(4, 2 * world), mesh, [Shard(1)])
    assert torch.equal(a.full_tensor(), torch.ones(4, 2 * world))


def test_dtensor_shard_replicate_partial():
    run(dtensor, 2)


def functional(rank, world):
    import torch.distributed._functional_collectives as fc

    group = dist.group.WORLD
    t = torch.full((6,), float(rank + 1))
    assert torch.equal(fc.all_reduce(t, "sum", group), torch.full((6,), 3.0))
    assert torch.equal(fc.all_gather_tensor(t, 0, group), torch.cat([torch.full((6,), float(r + 1)) for r in range(world)]))
    assert torch.equal(fc.reduce_scatter_tensor(torch.ones(4), "sum", 0, group), torch.full((2,), 2.0))
    assert torch.equal(fc.all_to_all_single(torch.arange(4.0) + 10 * rank, None, None, group), torch.tensor([0.0, 1.0, 10.0, 11.0]) + 2 * rank)
    # The raw ops with wait_tensor.
    name = group.group_name
    out = torch.ops._c10d_functional.all_reduce(t, "sum", name)
    out = torch.ops._c10d_functional.wait_tensor(out)
    assert torch.equal(out, torch.full((6,), 3.0))
    out = torch.ops._c10d_functional.all_gather_into_tensor(t, world, name)
    assert torch.equal(torch.ops._c10d_functional.wait_tensor(out)[6:], torch.full((6,), 2.0))

    # Under torch.compile.
    def f(x):
        y = fc.all_reduce(x * 2, "sum", group)
        return fc.all_gather_tensor(y + 1, 0, group)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = compiled(torch.full((3,), float(rank)))
    assert torch.equal(got, torch.full((3 * world,), 2.0 * sum(range(world)) + 1))
    # Autograd through the functional all_gather.
    x = torch.full((2,), float(rank + 1), requires_grad=True)
    g = torch.ops._c10d_functional_autograd.all_gather_into_tensor(x, world, name)
    g = torch.ops._c10d_functional.wait_tensor(g)
    g.sum().backward()
    assert torch.equal(x.grad, torch.full((2,), float(world)))


def test_functional_collectives_and_compile():
    run(functional, 2, timeout=240)


def detail_debug(rank, world):
    t = torch.ones(10)
    dist.all_reduce(t)
    outs = [torch.zeros(10) for _ in range(world)]
    dist.all_gather(outs, t)
    dist.barrier()
    return t.sum().item()


def test_torch_distributed_debug_detail():
    assert run(detail_debug, 2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}) == [20.0, 20.0]
