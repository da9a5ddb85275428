"""A stream of `isend`/`irecv` from rank 0 to rank 1 through torch, W = 2,
with no barrier between messages, as a pipeline's stages send: the sender
runs ahead, so each message is in flight before its receive is posted.
Prints the time per message (median of 7 rounds of 1000 after 300 warm-up
messages); `SIZE` sets the bytes (default 1 MiB), `BACKEND` the backend (weft).

    torchrun --nproc-per-node 2 bench/torch/p2p_stream.py

or, without torchrun's agent on the two cores, ranks pinned:

    export MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 WORLD_SIZE=2
    RANK=1 taskset -c 1 python bench/torch/p2p_stream.py &
    RANK=0 taskset -c 0 python bench/torch/p2p_stream.py; wait
"""
import os, statistics, time, torch, torch.distributed as dist

dist.init_process_group(os.environ.get("BACKEND", "weft"))
rank = dist.get_rank()
t = torch.ones(int(os.environ.get("SIZE", 1 << 20)) // 4)


def message():
    if rank == 1:
        dist.irecv(t, 0).wait()
    else:
        dist.isend(t, 1).wait()


for _ in range(300):
    message()
ts = []
for _ in range(7):
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(1000):
        message()
    ts.append((time.perf_counter() - t0) / 1000 * 1e6)
if rank == 0:
    print(f"{dist.get_backend()}: isend/irecv stream of {t.numel() * 4} B: {statistics.median(ts):.1f} us per message [{min(ts):.1f}-{max(ts):.1f}]")
dist.destroy_process_group()
