"""A 64 MiB window put through torch's API (`pg.new_window()`), W = 2;
compare with `weft bench --world 2 --backend shm --ops put -b 64M -e 64M`.

    WEFT_BACKEND=shm torchrun --nproc-per-node 2 bench/torch/window_put.py
"""
import time, statistics, torch, torch.distributed as dist
dist.init_process_group("weft")
rank = dist.get_rank()
n = 16 << 20  # 64 MiB of float32
buf = torch.zeros(n)
win = dist.group.WORLD.new_window()
win.tensor_register(buf)
src = torch.ones(n)
ts = []
for i in range(12):
    dist.barrier()
    if rank == 0:
        t0 = time.perf_counter()
        win.put(src, 1, 0, False)
        ts.append(time.perf_counter() - t0)
dist.barrier()
if rank == 0:
    ts = ts[2:]
    print("torch window put 64 MiB: median %.2f ms [%.2f-%.2f] (%.2f GB/s)" % (statistics.median(ts)*1e3, min(ts)*1e3, max(ts)*1e3, 64*2**20/statistics.median(ts)/1e9))
win.tensor_deregister()
dist.destroy_process_group()
