"""torch's TCPStore.clone() at W = 4, no weft involved: what shrink_group
does after weft's shrink (torch gives the shrunk group a cloned store
connection). On this 2-core host one trial in two or three has a clone
that takes 5 s on every rank at once, with the libuv store server and
without (USE_LIBUV=0): the cause of the 5 s outliers of
`shrink_group.py` (weft's own shrink takes 10 ms in those trials).

    python bench/torch/store_clone.py        # gloo ranks, 6 trials of 5 clones
"""
import os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "tests"))
import torch, torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from harness import run

def body(rank, world):
    store = c10d._world.pg_map[dist.group.WORLD][1]
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        store.clone()
        ts.append(round(time.perf_counter() - t0, 3))
    return ts

for trial in range(6):
    print("trial", trial, "clone seconds per rank:", run(body, 4, backend="gloo"))
