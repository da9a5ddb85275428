"""A window put of 1 MiB into a target whose core is busy, W = 2: rank 0
puts into rank 1's window (`pg.new_window()`) while rank 1 spins 20 ms in
Python; rank 0 times each put (30 trials; median, and min-max). On
transports without native windows (cpu-tcp) the target's progress thread
writes the put into place, so this shows how soon it gets the busy core.
Run as `p2p_stream.py` says, with `WEFT_BACKEND=cpu-tcp`.
"""
import os, statistics, time, torch, torch.distributed as dist
dist.init_process_group("weft")
rank = dist.get_rank()
n = (1 << 20) // 4
buf = torch.zeros(n)
win = dist.group.WORLD.new_window()
win.tensor_register(buf)
src = torch.ones(n)
lat = []
for i in range(30):
    dist.barrier()
    if rank == 0:
        t0 = time.perf_counter()
        win.put(src, 1, 0, False)
        lat.append((time.perf_counter() - t0) * 1e6)
    else:
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            pass
if rank == 0:
    print(f"put 1 MiB into a busy target: median {statistics.median(lat):.0f} us [{min(lat):.0f}-{max(lat):.0f}]")
win.tensor_deregister()
dist.destroy_process_group()
