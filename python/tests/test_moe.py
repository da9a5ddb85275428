"""weft.moe (mixture-of-experts dispatch and combine, with autograd), MORI's
module-level API with ``import weft as mori``, and the v-collectives on a
torch.distributed group, across real processes."""

import pytest
import torch
import torch.distributed as dist

from harness import run

import weft

# -- routing ----------------------------------------------------------------


def routing(kind: str, rank: int, world: int, tokens: int, k: int, experts: int, g: torch.Generator) -> torch.Tensor:
    """`[tokens, k]` distinct expert ids per token, about one slot in five
    of a token routed nowhere (-1) when k > 1."""
    per_rank = experts // world
    if kind == "skewed":
        weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
    elif kind == "one_rank":
        weights = torch.zeros(experts, dtype=torch.float64)
        nxt = (rank + 1) % world
        weights[nxt * per_rank : (nxt + 1) * per_rank] = 1.0
    else:
        weights = torch.ones(experts, dtype=torch.float64)
    idx = torch.stack([torch.multinomial(weights, k, replacement=False, generator=g) for _ in range(tokens)]) if tokens else torch.empty(0, k, dtype=torch.int64)
    if k > 1 and tokens:
        drop = torch.rand(tokens, generator=g) < 0.2
        idx[drop, k - 1] = -1
    return idx


def dispatch_combine_exact(rank, world, kind, ks, dtype_name):
    """Experts that scale rows by 1 + (expert % 2); y, and the gradients of
    x and the weights for loss = sum(y * g), against closed forms."""
    dtype = getattr(torch, dtype_name)
    experts, hidden = 8 * world, 6
    out = []
    for k in ks:
        g = torch.Generator().manual_seed(1000 * k + rank)
        tokens = 0 if (kind == "zero_tokens" and rank == 0) else 5 + rank
        idx = routing("random" if kind == "zero_tokens" else kind, rank, world, tokens, k, experts, g)
        x = torch.randint(-4, 5, (tokens, hidden), generator=g).to(dtype).requires_grad_()
        w = (torch.randint(1, 5, (tokens, k), generator=g) * 0.5).to(dtype).requires_grad_()
        ex, counts, handle = weft.moe.dispatch(x, idx, experts)
        assert ex.shape == (int(counts.sum()), hidden) and counts.shape == (experts // world,)
        first = rank * (experts // world)
        factor = torch.cat([torch.full((int(n),), 1.0 + (first + e) % 2, dtype=dtype) for e, n in enumerate(counts.tolist())]) if len(counts) else torch.empty(0, dtype=dtype)
        y = weft.moe.combine(ex * factor.unsqueeze(1), handle, w)
        routed = idx >= 0
        scale = torch.where(routed, 1.0 + (idx.clamp(min=0) % 2).to(torch.float64), torch.zeros((), dtype=torch.float64))
        want = (w.detach().double() * scale).sum(1, keepdim=True) * x.detach().double()
        assert torch.equal(y.detach().double(), want), (rank, kind, k)
        gy = torch.randint(-2, 3, (tokens, hidden), generator=g).to(dtype)
        (y * gy).sum().backward()
        want_dx = (w.detach().double() * scale).sum(1, keepdim=True) * gy.double()
        want_dw = torch.where(routed, scale * (x.detach().double() * gy.double()).sum(1, keepdim=True), torch.zeros((), dtype=torch.float64))
        assert torch.equal(x.grad.double(), want_dx), (rank, kind, k, "dx")
        assert torch.equal(w.grad.double(), want_dw), (rank, kind, k, "dw")
        again = weft.moe.dispatch_again(x.detach(), handle)
        assert torch.equal(again, ex.detach())
        out.append(int(counts.sum()))
    return out


@pytest.mark.parametrize("backend", ["shm", "cpu-tcp"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_dispatch_then_combine_is_exact_with_gradients(backend, world):
    for kind in ["random", "skewed", "one_rank", "zero_tokens"]:
        rows = run(dispatch_combine_exact, world, kind, [1, 2, 8], "float64", env={"WEFT_BACKEND": backend})
        assert sum(sum(r) for r in rows) > 0


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dispatch_then_combine_in_low_precision(dtype):
    run(dispatch_combine_exact, 2, "random", [2], dtype)


def one_row_each_way(rank, world):
    """Every token's 4 experts live on the next rank: one row crosses per
    token, whatever the number of experts there."""
    tokens, hidden, experts = 32, 64, 4 * world
    nxt = (rank + 1) % world
    idx = torch.tensor([[nxt * 4 + j for j in range(4)]] * tokens)
    x = torch.ones(tokens, hidden)
    ex, counts, handle = weft.moe.dispatch(x, idx, experts)
    assert ex.shape[0] == 4 * tokens
    return handle.bytes_sent(torch.float32), tokens * hidden * 4


def test_a_token_crosses_to_a_rank_once():
    for sent, one_row_per_token in run(one_row_each_way, 3):
        assert sent == one_row_per_token


# -- a small MoE layer trained with expert parallelism ------------------------

E, H, F, TOKENS = 8, 6, 10, 12  # experts, hidden, expert MLP width, tokens per rank


def init_params(g):
    router = torch.randn(H, E, generator=g, dtype=torch.float64) * 0.5
    w1 = torch.randn(E, H, F, generator=g, dtype=torch.float64) * 0.3
    w2 = torch.randn(E, F, H, generator=g, dtype=torch.float64) * 0.3
    return router, w1, w2


def route(x, router):
    scores = torch.softmax(x @ router, dim=1)
    weights, idx = scores.topk(2, dim=1)
    return idx, weights / weights.sum(1, keepdim=True)


def reference_step(x, target, router, w1, w2):
    """The layer on the whole batch in one process."""
    idx, weights = route(x, router)
    y = torch.zeros_like(x)
    for e in range(E):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        h = torch.relu(x[tok] @ w1[e]) @ w2[e]
        y = y.index_add(0, tok, weights[tok, slot].unsqueeze(1) * h)
    return ((y - target) ** 2).sum()


def train_moe(rank, world):
    g = torch.Generator().manual_seed(7)
    router, w1, w2 = init_params(g)
    xs = torch.randn(world * TOKENS, H, generator=g, dtype=torch.float64)
    targets = torch.randn(world * TOKENS, H, generator=g, dtype=torch.float64)
    per = E // world
    # The reference, on every rank.
    ref = [p.clone().requires_grad_() for p in (router, w1, w2)]
    # This rank's share: the router (replicated) and its experts.
    mine = [router.clone().requires_grad_(), w1[rank * per : (rank + 1) * per].clone().requires_grad_(), w2[rank * per : (rank + 1) * per].clone().requires_grad_()]
    lr = 0.05
    for _ in range(5):
        loss = reference_step(xs, targets, *ref)
        loss.backward()
        with torch.no_grad():
            for p in ref:
                p -= lr * p.grad
                p.grad = None
        x = xs[rank * TOKENS : (rank + 1) * TOKENS]
        t = targets[rank * TOKENS : (rank + 1) * TOKENS]
        idx, weights = route(x, mine[0])
        ex, counts, handle = weft.moe.dispatch(x, idx, E)
        outs = []
        for l, rows in enumerate(ex.split(counts.tolist())):
            outs.append(torch.relu(rows @ mine[1][l]) @ mine[2][l])
        y = weft.moe.combine(torch.cat(outs), handle, weights)
        ((y - t) ** 2).sum().backward()
        dist.all_reduce(mine[0].grad)  # the router is replicated: sum its gradients
        with torch.no_grad():
            for p in mine:
                p -= lr * p.grad
                p.grad = None
    want = [ref[0].detach(), ref[1].detach()[rank * per : (rank + 1) * per], ref[2].detach()[rank * per : (rank + 1) * per]]
    return [float((a.detach() - b).abs().max()) for a, b in zip(mine, want)]


@pytest.mark.parametrize("world", [2, 4])
def test_a_moe_layer_trained_with_expert_parallelism_matches_one_process(world):
    for errs in run(train_moe, world):
        assert max(errs) < 1e-10, errs


# -- errors -------------------------------------------------------------------


def bad_expert_on_rank_1(rank, world):
    idx = torch.tensor([[0, 1]]) if rank != 1 else torch.tensor([[0, 99]])
    try:
        weft.moe.dispatch(torch.ones(1, 4), idx, 4 * world)
    except Exception as e:  # noqa: BLE001 - the test reads it
        return type(e).__name__, str(e)
    return None


def test_bad_routing_on_one_rank_raises_on_every_rank():
    errs = run(bad_expert_on_rank_1, 3)
    assert "topk_idx[0][1] = 99" in errs[1][1]
    for _, text in (errs[0], errs[2]):
        assert "rank(s) [1]" in text, text


def bad_shape_on_rank_0(rank, world):
    idx = torch.tensor([[0], [1]]) if rank != 0 else torch.tensor([0, 1])
    try:
        weft.moe.dispatch(torch.ones(2, 4), idx, 2 * world)
    except Exception as e:  # noqa: BLE001 - the test reads it
        return str(e)
    return None


def test_a_local_shape_error_fails_the_others_instead_of_hanging():
    errs = run(bad_shape_on_rank_0, 2)
    assert "topk_idx must be [tokens, k]" in errs[0]
    assert "rank(s) [0]" in errs[1]


# -- MORI's API with `import weft as mori` ----------------------------------


def mori_calls(rank, world):
    import weft as mori

    t = torch.full((4,), float(rank + 1))
    mori.all_reduce(t, op=mori.ReduceOp.SUM)
    m = torch.full((3,), float(rank))
    mori.all_reduce(m, op=mori.ReduceOp.MAX)
    outs = [torch.empty(2) for _ in range(world)]
    mori.all_gather(outs, torch.full((2,), float(rank)))
    rs = torch.empty(2)
    mori.reduce_scatter(rs, [torch.full((2,), float(rank * 10 + i)) for i in range(world)], op=mori.ReduceOp.SUM)
    b = torch.full((3,), float(rank))
    mori.broadcast(b, src=world - 1)
    mori.barrier()
    got = None
    if rank == 0:
        mori.send(torch.arange(5.0), dst=1)
    elif rank == 1:
        got = torch.empty(5)
        mori.recv(got, src=0)
        got = got.tolist()
    return t.tolist(), m.tolist(), [o.tolist() for o in outs], rs.tolist(), b.tolist(), got


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("first", [None, "gloo", "weft"])
def test_mori_calls_run_unchanged_with_import_weft_as_mori(world, first):
    res = run(mori_calls, world, backend=first or "weft", init=first is not None)
    total = float(sum(range(1, world + 1)))
    for rank, (t, m, outs, rs, b, got) in enumerate(res):
        assert t == [total] * 4
        assert m == [float(world - 1)] * 3
        assert outs == [[float(r)] * 2 for r in range(world)]
        assert rs == [float(sum(r * 10 + rank for r in range(world)))] * 2
        assert b == [float(world - 1)] * 3
        assert got == (list(map(float, range(5))) if rank == 1 else None)


def v_collectives_on_a_torch_group(rank, world):
    outs = [torch.empty(r + 1) for r in range(world)]
    weft.all_gather_v(outs, torch.full((rank + 1,), float(rank)), group=dist.group.WORLD)
    out = torch.empty(rank + 1)
    weft.reduce_scatter_v(out, [torch.ones(r + 1) for r in range(world)], group=dist.group.WORLD)
    return [o.tolist() for o in outs], out.tolist()


def test_v_collectives_take_a_torch_group_on_weft():
    for rank, (outs, out) in enumerate(run(v_collectives_on_a_torch_group, 3)):
        assert outs == [[float(r)] * (r + 1) for r in range(3)]
        assert out == [3.0] * (rank + 1)


# -- the benchmark's baseline --------------------------------------------------


def recipe_and_weft_moe_gradients(rank, world):
    """torchtitan's recipe (`weft._bench_moe.step_recipe`) and weft.moe on
    the same float64 data: the gradients of x and of the router weights."""
    from weft import _bench_moe as b

    tokens, hidden, experts, k = 64, 16, 8 * world, 4
    idx, weights = b.routing(tokens, experts, k, rank)
    x = torch.randn(tokens, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    grad = torch.randn(tokens, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + rank))
    grads = []
    for step in (b.step_weft, b.step_recipe):
        xx, ww = x.clone().requires_grad_(), weights.double().clone().requires_grad_()
        step(xx, idx, ww, experts, grad)
        grads.append((xx.grad, ww.grad))
    (gx1, gw1), (gx2, gw2) = grads
    return float((gx1 - gx2).abs().max()), float((gw1 - gw2).abs().max())


def test_the_benchmarks_recipe_computes_what_weft_moe_does():
    for dx, dw in run(recipe_and_weft_moe_gradients, 3):
        assert dx < 1e-12 and dw < 1e-12, (dx, dw)
