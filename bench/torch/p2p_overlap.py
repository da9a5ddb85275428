"""Background progress while the sender computes, W = 2: rank 0 `isend`s
1 MiB, then spins 20 ms in Python (holding its core) before it waits;
rank 1 times its `irecv` from issue to completion (40 trials; median, and
min-max). The message gets through only as far as weft's progress thread
on rank 0's core moves it, so this shows whether that thread gets its
share of a busy core. Run as `p2p_stream.py` says (ranks pinned).
"""
import os, statistics, time, torch, torch.distributed as dist

dist.init_process_group(os.environ.get("BACKEND", "weft"))
rank = dist.get_rank()
t = torch.ones((1 << 20) // 4)
lat = []
for _ in range(40):
    dist.barrier()
    if rank == 0:
        w = dist.isend(t, 1)
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            pass
        w.wait()
    else:
        t0 = time.perf_counter()
        dist.irecv(t, 0).wait()
        lat.append((time.perf_counter() - t0) * 1e6)
if rank == 1:
    print(f"{dist.get_backend()}: receive while the sender computes 20 ms: median {statistics.median(lat):.0f} us [{min(lat):.0f}-{max(lat):.0f}]")
dist.destroy_process_group()
