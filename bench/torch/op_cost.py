"""Per-op cost of `dist.all_reduce` of 8 B through torch on weft, W = 2.

    torchrun --nproc-per-node 2 bench/torch/op_cost.py
"""
import time, torch, torch.distributed as dist, statistics, os
dist.init_process_group("weft")
t = torch.ones(2)
for _ in range(200): dist.all_reduce(t)
ts=[]
for r in range(5):
    dist.barrier()
    t0=time.perf_counter()
    for _ in range(2000): dist.all_reduce(t)
    ts.append((time.perf_counter()-t0)/2000*1e6)
if dist.get_rank()==0: print("all_reduce 8 B per op us: median %.2f [%.2f-%.2f]" % (statistics.median(ts), min(ts), max(ts)), "hooks:", dist.distributed_c10d._world.pg_flight_recorder_hooks.keys().__len__())
dist.destroy_process_group()
