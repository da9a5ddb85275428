"""split_group against new_group for the same groups, at W = 4 (one round,
and the 4 rounds of a 4-stage pipeline's edge groups), with a first
all_reduce on each new group (gloo connects lazily).

    torchrun --nproc-per-node 4 bench/torch/split_group.py weft   # or gloo
"""
import os, sys, time, statistics, torch, torch.distributed as dist
backend = sys.argv[1]
dist.init_process_group(backend)
rank = dist.get_rank()
ROUNDS = [[[0, 1], [2, 3]], [[1, 2]], [[0, 3]], [[0, 2], [1, 3]]]
def timed(fn, n=5):
    ts = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter(); gs = fn()
        # first use (gloo connects lazily): one all_reduce on each group this rank is in
        for g in (gs if isinstance(gs, list) else [gs]):
            if isinstance(g, dist.ProcessGroup):
                dist.all_reduce(torch.ones(1), group=g)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, min(ts) * 1e3, max(ts) * 1e3
def one_round():
    return dist.split_group(split_ranks=ROUNDS[0])
def four_rounds():
    return [dist.split_group(split_ranks=r) for r in ROUNDS]
def new_groups_round():
    return [dist.new_group(r) for r in ROUNDS[0]]
def new_groups_all():
    return [dist.new_group(p) for r in ROUNDS for p in r]
res = {}
for name, fn in [("split 1 round", one_round), ("new_group same groups", new_groups_round), ("split 4 rounds (6 edges)", four_rounds), ("new_group 6 edges", new_groups_all)]:
    try:
        res[name] = timed(fn)
    except Exception as e:
        res[name] = repr(e)[:80]
if rank == 0:
    for k, v in res.items():
        print(f"{backend:6s} {k:28s}", v if isinstance(v, str) else "median %.1f ms [%.1f-%.1f]" % v)
dist.barrier()
dist.destroy_process_group()
