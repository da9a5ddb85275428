"""The seed benchmark through torch.distributed: ``python -m weft.bench``.

Seed 000's op set, as torch programs call it, on a local world of W
processes per backend: ``all_gather_into_tensor`` (input ``[N // W]``,
output ``[N]``), ``all_reduce``, ``all_to_all_single``, ``broadcast``
(``[N]``), the ``isend``/``irecv`` chain 0 -> 1 -> ... -> W-1 (``p2p``),
and ``reduce_scatter_tensor`` (input ``[N]``, output ``[N // W]``); N is
``batch_size * dim_size`` float32 elements, given as bytes (``--sizes``).

Backends alternate within each round (``--backends gloo,weft``; weft's
inner backend from ``WEFT_BACKEND``), every run in fresh processes. Each
iteration starts after a barrier and takes the slowest rank's time; a run
reports the median, and the table the median over rounds with its spread
(min-max), nccl-tests' algbw/busbw, the count of wrong elements in a
checked run, and each backend's speed against the first (``x first``: the
first's time over this one's). ``--csv``, ``--json`` and ``--plot`` (needs
matplotlib) save the rows. The backend name ``rust`` runs ``weft bench``
(the Rust API, same ops, sizes and timing) instead: ``--backends rust,weft``
shows what the Python layer adds.

    python -m weft.bench --world 2 --backends gloo,weft --sizes 8,1M,64M --rounds 3

``--workload moe`` times expert parallelism instead (`_bench_moe.py`):
dispatch, experts, combine and backward with ``weft.moe`` (on weft) and
with torchtitan's recipe of ``all_to_all_single`` calls (on every backend),
DeepSeek-style by default (4096 tokens of 2048 bfloat16 per rank, 64
experts, top-8), with the bytes of rows each rank sends:

    python -m weft.bench --workload moe --world 2,4 --backends gloo,weft --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

OPS = ["all_gather_into_tensor", "all_reduce", "all_to_all_single", "broadcast", "p2p", "reduce_scatter_tensor"]


def parse_size(s: str) -> int:
    """Bytes, with an optional K, M or G suffix (powers of 1024)."""
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def bus_factor(op: str, w: int) -> float:
    """nccl-tests' busbw over algbw."""
    if op == "all_reduce":
        return 2 * (w - 1) / w
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        return (w - 1) / w
    return 1.0


# -- one rank ------------------------------------------------------------------


def _buffers(op, n, rank, world):
    import torch

    part = n // world
    if op == "all_gather_into_tensor":
        return torch.full((part,), float(rank + 1)), torch.empty(part * world)
    if op == "reduce_scatter_tensor":
        return torch.arange(part * world, dtype=torch.float32) % 7 + rank, torch.empty(part)
    if op == "all_to_all_single":
        return torch.arange(part * world, dtype=torch.float32) % 5 + 10 * rank, torch.empty(part * world)
    return torch.arange(n, dtype=torch.float32) % 3 + rank, None


def _run(op, inp, out, rank, world):
    import torch.distributed as dist

    if op == "all_gather_into_tensor":
        dist.all_gather_into_tensor(out, inp)
    elif op == "reduce_scatter_tensor":
        dist.reduce_scatter_tensor(out, inp)
    elif op == "all_to_all_single":
        dist.all_to_all_single(out, inp)
    elif op == "all_reduce":
        dist.all_reduce(inp)
    elif op == "broadcast":
        dist.broadcast(inp, src=0)
    elif op == "p2p":
        if rank > 0:
            dist.irecv(inp, rank - 1).wait()
        if rank + 1 < world:
            dist.isend(inp, rank + 1).wait()


def _wrong(op, inp, out, n, rank, world) -> int:
    """Wrong elements after one run on fresh buffers."""
    import torch

    part = n // world
    if op == "all_gather_into_tensor":
        want = torch.cat([torch.full((part,), float(r + 1)) for r in range(world)])
        got = out
    elif op == "reduce_scatter_tensor":
        full = sum(torch.arange(part * world, dtype=torch.float32) % 7 + r for r in range(world))
        want, got = full[rank * part : (rank + 1) * part], out
    elif op == "all_to_all_single":
        want = torch.cat([(torch.arange(part * world, dtype=torch.float32) % 5 + 10 * r)[rank * part : (rank + 1) * part] for r in range(world)])
        got = out
    elif op == "all_reduce":
        want, got = sum(torch.arange(n, dtype=torch.float32) % 3 + r for r in range(world)), inp
    else:
        # broadcast and the p2p chain: rank 0's input everywhere.
        want, got = torch.arange(n, dtype=torch.float32) % 3, inp
    return int((got != want).sum())


def worker(backend: str, sizes: list[int], ops: list[str], iters: int, warmup: int, out_path: str, bind: bool) -> None:
    """One rank: every op at every size; rank 0 writes the rows."""
    import torch
    import torch.distributed as dist

    if bind:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[int(os.environ["LOCAL_RANK"]) % len(cpus)]})
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for nbytes in sizes:
        n = max(world, nbytes // 4 // world * world)
        for op in ops:
            inp, out = _buffers(op, n, rank, world)
            for _ in range(warmup):
                _run(op, inp, out, rank, world)
            times = torch.zeros(iters, dtype=torch.float64)
            for i in range(iters):
                dist.barrier()
                t0 = time.perf_counter()
                _run(op, inp, out, rank, world)
                times[i] = time.perf_counter() - t0
            # The slowest rank's time per iteration.
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            inp, out = _buffers(op, n, rank, world)
            _run(op, inp, out, rank, world)
            wrong = torch.tensor([_wrong(op, inp, out, n, rank, world)], dtype=torch.int64)
            dist.all_reduce(wrong)
            us = sorted(t * 1e6 for t in times.tolist())
            med = statistics.median(us)
            rows.append(
                {
                    "op": op,
                    "bytes": n * 4,
                    "count": n,
                    "iters": iters,
                    "median_us": med,
                    "min_us": us[0],
                    "max_us": us[-1],
                    "p99_us": us[min(len(us) - 1, int(0.99 * len(us)))],
                    "wrong": int(wrong.item()),
                }
            )
    dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)


# -- the launcher --------------------------------------------------------------


def moe_worker(backend: str, args, out_path: str, bind: bool) -> None:
    """One rank of the expert-parallel workload: each method that runs on
    `backend` (weft.moe on weft only); rank 0 writes the rows."""
    import torch.distributed as dist

    from . import _bench_moe

    if bind:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[int(os.environ["LOCAL_RANK"]) % len(cpus)]})
    dist.init_process_group(backend)
    rank = dist.get_rank()
    rows = []
    for method in _bench_moe.METHODS:
        if method == "weft.moe" and backend != "weft":
            continue
        row = _bench_moe.worker(method, args.tokens, args.hidden, args.experts, args.topk, args.dtype, args.iters, args.warmup)
        rows.append(row)
    dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def print_moe(samples: dict, backends: list[str]) -> None:
    """Median [min-max] over rounds of each (W, backend, method), and its
    speed against the recipe on the same backend and on the first."""
    med = {key: statistics.median(r["median_ms"] for r in runs) for key, runs in samples.items()}
    print(f"{'W':>3} {'backend':<8} {'method':<9} {'ms fwd+bwd':>12} {'[min-max over rounds]':>22} {'MiB sent/rank':>14} {'x recipe':>9} {'x ' + backends[0] + ' recipe':>14}")
    for (w, b, m), runs in sorted(samples.items()):
        rounds = [r["median_ms"] for r in runs]
        own = med.get((w, b, "recipe"))
        first = med.get((w, backends[0], "recipe"))
        x_own = f"{own / med[(w, b, m)]:.2f}" if own else "-"
        x_first = f"{first / med[(w, b, m)]:.2f}" if first else "-"
        sent = runs[0]["bytes_sent"] / (1 << 20)
        print(f"{w:>3} {b:<8} {m:<9} {med[(w, b, m)]:>12.1f} {f'[{min(rounds):.1f}-{max(rounds):.1f}]':>22} {sent:>14.2f} {x_own:>9} {x_first:>14}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(backend: str, world: int, args, timeout: float) -> list[dict]:
    """One run: `world` fresh processes; rank 0's rows."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        # One intra-op thread per rank, as torchrun sets: torch's OpenMP
        # threads otherwise share a pinned rank's core with it (W=2 shm
        # all_reduce of 1 MiB: 69-75 us against 47 with one thread).
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [sys.executable, "-m", "weft.bench", "--worker", backend, "--sizes", ",".join(map(str, args.sizes)), "--ops", ",".join(args.ops)]
        cmd += ["--iters", str(args.iters), "--warmup", str(args.warmup), "--out", out, "--workload", args.workload]
        cmd += ["--tokens", str(args.tokens), "--hidden", str(args.hidden), "--experts", str(args.experts), "--topk", str(args.topk), "--dtype", args.dtype]
        if args.bind_cores if args.bind_cores is not None else world <= len(os.sched_getaffinity(0)):
            cmd.append("--bind-cores")
        procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(world)]
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise SystemExit(f"weft.bench: {backend} at W={world} ran past {timeout:.0f} s") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(p.returncode for p in procs):
            raise SystemExit(f"weft.bench: a rank of {backend} at W={world} failed (exit codes {[p.returncode for p in procs]})")
        with open(out) as f:
            return json.load(f)


# The same ops in `weft bench` (Rust), for `--backends rust,...`.
_RUST_OPS = {
    "all_gather_into_tensor": "all_gather",
    "all_reduce": "all_reduce",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "p2p": "p2p",
    "reduce_scatter_tensor": "reduce_scatter",
}


def launch_rust(world: int, args, timeout: float) -> list[dict]:
    """One run of `weft bench` (the Rust API, same timing) on the same ops
    and sizes, with weft's backend from WEFT_BACKEND: what the Python layer
    adds shows against it."""
    back = {v: k for k, v in _RUST_OPS.items()}
    rows = []
    for nbytes in args.sizes:
        cmd = [args.weft_cli, "bench", "--world", str(world), "--backend", os.environ.get("WEFT_BACKEND", "auto")]
        cmd += ["--ops", ",".join(_RUST_OPS[o] for o in args.ops), "-b", str(nbytes), "-e", str(nbytes)]
        cmd += ["-n", str(args.iters), "-w", str(args.warmup), "--time-per-size", "1000", "--csv", "-"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True).stdout
        for line in out.splitlines()[1:]:
            f = line.split(",")
            rows.append(
                {
                    "op": back[f[2]],
                    "bytes": int(f[4]) * 4,
                    "count": int(f[4]),
                    "iters": int(f[8]),
                    "median_us": float(f[9]),
                    "min_us": float(f[10]),
                    "max_us": float(f[11]),
                    "p99_us": float(f[12]),
                    "wrong": int(f[15]),
                }
            )
    return rows


def summarize(samples: dict, backends: list[str]) -> list[dict]:
    """Rows over rounds: median of the runs' medians, spread, bandwidths,
    and speed against the first backend."""
    rows = []
    for (backend, world, op, nbytes), runs in sorted(samples.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][3], backends.index(kv[0][0]))):
        med = statistics.median(r["median_us"] for r in runs)
        algbw = nbytes / med / 1e3 if med > 0 else 0.0
        first = samples.get((backends[0], world, op, nbytes))
        ratio = statistics.median(r["median_us"] for r in first) / med if first else float("nan")
        rows.append(
            {
                "backend": backend,
                "weft_backend": os.environ.get("WEFT_BACKEND", "auto") if backend == "weft" else "",
                "world": world,
                "op": op,
                "bytes": nbytes,
                "count": runs[0]["count"],
                "dtype": "f32",
                "rounds": len(runs),
                "iters": runs[0]["iters"],
                "median_us": med,
                "min_us": min(r["median_us"] for r in runs),
                "max_us": max(r["median_us"] for r in runs),
                "p99_us": max(r["p99_us"] for r in runs),
                "algbw_gbps": algbw,
                "busbw_gbps": algbw * bus_factor(op, world),
                "wrong": sum(r["wrong"] for r in runs),
                "x_first": ratio,
            }
        )
    return rows


def print_table(rows: list[dict], backends: list[str]) -> None:
    print(f"# times: median over rounds of each run's median (us), [min-max over rounds]; x first = {backends[0]}'s time over this backend's")
    hdr = f"{'W':>2} {'op':<23} {'size(B)':>10} {'count':>9} {'backend':>8} {'time(us)':>10} {'[min-max]':>21} {'p99(us)':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} {'x first':>7}"
    print(hdr)
    for r in rows:
        spread = f"[{r['min_us']:.1f}-{r['max_us']:.1f}]"
        print(
            f"{r['world']:>2} {r['op']:<23} {r['bytes']:>10} {r['count']:>9} {r['backend']:>8} {r['median_us']:>10.1f} {spread:>21} "
            f"{r['p99_us']:>10.1f} {r['algbw_gbps']:>7.3f} {r['busbw_gbps']:>7.3f} {r['wrong']:>6} {r['x_first']:>7.2f}"
        )


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("weft.bench: --plot needs matplotlib (pip install matplotlib)") from None
    worlds = sorted({r["world"] for r in rows})
    ops = sorted({r["op"] for r in rows})
    fig, axes = plt.subplots(len(worlds), len(ops), figsize=(4 * len(ops), 3.2 * len(worlds)), squeeze=False)
    for i, w in enumerate(worlds):
        for j, op in enumerate(ops):
            ax = axes[i][j]
            for backend in dict.fromkeys(r["backend"] for r in rows):
                pts = [(r["bytes"], r["busbw_gbps"]) for r in rows if r["world"] == w and r["op"] == op and r["backend"] == backend]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=backend)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{op}, W={w}", fontsize=9)
            ax.set_xlabel("bytes")
            ax.set_ylabel("busbw (GB/s)")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m weft.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", default="2", help="world sizes, comma-separated (e.g. 2,4,8)")
    p.add_argument("--backends", default="gloo,weft", help="torch backend names, alternated within each round; the first is the reference")
    p.add_argument("--sizes", default="8,1K,64K,1M,16M,64M", help="N in bytes of float32, comma-separated (K, M, G suffixes)")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1800, help="seconds a run may take")
    p.add_argument(
        "--bind-cores",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pin rank r to the r-th usable CPU, every backend alike (default: when the ranks fit the CPUs, as `weft bench`)",
    )
    p.add_argument("--weft-cli", default="weft", help="the `weft` command, for the backend name `rust` (weft bench itself)")
    p.add_argument("--csv")
    p.add_argument("--json")
    p.add_argument("--plot")
    p.add_argument("--workload", choices=["ops", "moe"], default="ops", help="the seed's ops over sizes, or expert parallelism (see above)")
    p.add_argument("--tokens", type=int, default=4096, help="moe: tokens per rank")
    p.add_argument("--hidden", type=int, default=2048, help="moe: elements per token")
    p.add_argument("--experts", type=int, default=64, help="moe: experts in all")
    p.add_argument("--topk", type=int, default=8, help="moe: experts per token")
    p.add_argument("--dtype", default="bfloat16", help="moe: the tokens' dtype")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.sizes = [parse_size(s) for s in a.sizes.split(",")]
    a.ops = [o for o in a.ops.split(",") if o]
    unknown = [o for o in a.ops if o not in OPS]
    if unknown:
        p.error(f"unknown ops {unknown}; choose from {OPS}")
    if a.worker:
        if a.workload == "moe":
            moe_worker(a.worker, a, a.out, bool(a.bind_cores))
        else:
            worker(a.worker, a.sizes, a.ops, a.iters, a.warmup, a.out, bool(a.bind_cores))
        return
    backends = [b for b in a.backends.split(",") if b]
    worlds = [int(w) for w in a.world.split(",")]
    samples: dict = {}
    if a.workload == "moe":
        for rnd in range(a.rounds):
            for w in worlds:
                for b in backends:
                    for row in launch(b, w, a, a.timeout):
                        samples.setdefault((w, b, row["method"]), []).append(row)
            print(f"round {rnd + 1}/{a.rounds} done", file=sys.stderr)
        print_moe(samples, backends)
        return
    for rnd in range(a.rounds):
        for w in worlds:
            for b in backends:
                for row in launch_rust(w, a, a.timeout) if b == "rust" else launch(b, w, a, a.timeout):
                    samples.setdefault((b, w, row["op"], row["bytes"]), []).append(row)
        print(f"round {rnd + 1}/{a.rounds} done", file=sys.stderr)
    rows = summarize(samples, backends)
    print_table(rows, backends)
    if a.csv:
        with open(a.csv, "w") as f:
            f.write(",".join(rows[0].keys()) + "\n")
            for r in rows:
                f.write(",".join(str(v) for v in r.values()) + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.plot:
        plot(rows, a.plot)
    if sum(r["wrong"] for r in rows):
        raise SystemExit("weft.bench: some results were wrong (#wrong)")


if __name__ == "__main__":
    main()
