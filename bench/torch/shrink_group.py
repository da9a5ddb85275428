"""From a SIGKILL mid-all_reduce to the slowest survivor's first all_reduce
on the group `shrink_group([1])` made, W = 4, on shm and cpu-tcp.

    python bench/torch/shrink_group.py   # with weft installed
"""
import os, sys, time, signal, statistics, tempfile
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "tests"))
import torch, torch.distributed as dist
from harness import run

def body(rank, world, stamp):
    t = torch.ones(1 << 16)
    for _ in range(3):
        dist.all_reduce(t)
    if rank == 1:
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        while True:
            dist.all_reduce(t)
    except Exception:
        pass
    new = dist.shrink_group([1])
    x = torch.ones(4)
    dist.all_reduce(x, group=new)
    return time.time()

for inner in ("shm", "cpu-tcp"):
    ts = []
    for i in range(5):
        stamp = os.path.join(tempfile.mkdtemp(), "killed")
        out = run(body, 4, stamp, env={"WEFT_BACKEND": inner}, allow_fail=True)
        k = float(open(stamp).read())
        ts.append(max(out[r] for r in (0, 2, 3)) - k)
    print(inner, "kill -> usable shrunk group (slowest survivor), s: median %.3f [%.3f-%.3f]" % (statistics.median(ts), min(ts), max(ts)))
