#!/usr/bin/env python3
"""Side-by-side comparison: weft bench vs Gloo vs Open MPI on this machine.

Builds gloo_bench.cc (Debian libgloo-dev) and mpi_bench.c (openmpi-bin,
libopenmpi-dev), then runs weft, Gloo and Open MPI alternately, ROUNDS
times, at each size, with the same timing method (barrier before each
iteration, slowest rank per iteration, median, after the same number of
untimed warm-up iterations). Prints one table: the
median over rounds of each tool's time, the spread (min-max over rounds),
and weft's speed relative to each anchor (>1 means weft is faster), with
the worst round's ratio ("min x", from the same round's runs) and weft's
worst p99 over median. Pass --iters 200 or more where the tail matters.
With --timing span every tool times an iteration from the first rank's
start to the last rank's end on the host's clock instead of the slowest
rank's own window: with more ranks than cores a rank may only start its
clock once its peers are done, and windows then undercount (Open MPI's
3-hop p2p chain measured 0.1 us at W=4 on 2 cores).

The last column is the ceiling: every rank copying N bytes at once (the
host copy weft uses for outputs, `weft bench --ops device_copy`), in the
same rounds; "x copy" is
that time over weft's (1.0: the op costs one plain copy of its buffer).

Usage: bench/compare/compare.py [--world 2] [--rounds 5] [--backend cpu-tcp]
       [--ops all_reduce,...] [--sizes 8,1048576,67108864] [--iters 10]
       [--tools weft,gloo,mpi-tcp,mpi-shm,copy]
       [--warmup 20] [--timing window|span]
Needs: apt-get install libgloo-dev openmpi-bin libopenmpi-dev g++
"""
import argparse, os, statistics, subprocess, sys, tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


# Every tool compare.py can run, in the order each round runs them.
TOOLS = ["weft", "gloo", "mpi-tcp", "mpi-shm", "copy"]


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


def build(out, tools):
    """Build weft and the anchors among `tools` (so a run without Gloo
    needs no libgloo-dev)."""
    os.makedirs(out, exist_ok=True)
    sh(["cargo", "build", "--release", "-q", "-p", "weft-cli"], cwd=ROOT)
    if "gloo" in tools:
        sh(["g++", "-O2", "-std=c++17", "-o", f"{out}/gloo_bench", f"{HERE}/gloo_bench.cc", "-lgloo", "-lpthread"])
    if tools & {"mpi-tcp", "mpi-shm"}:
        sh(["mpicc", "-O2", "-o", f"{out}/mpi_bench", f"{HERE}/mpi_bench.c"])


def parse_lines(text):
    res = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3:
            res[(parts[0], int(parts[1]))] = float(parts[2])
    return res


def run_weft(a, size, weft):
    csv = sh([weft, "bench", "--world", str(a.world), "--backend", a.backend, "--ops", a.ops, "-b", str(size), "-e", str(size),
              "-n", str(a.iters), "-w", str(a.warmup), "--time-per-size", "1000", "--no-check", "--timing", a.timing, "--csv", "-"])
    res = {}
    for line in csv.splitlines()[1:]:
        f = line.split(",")
        res[(f[2], int(f[3]))] = float(f[9])
        # The tail within the run: p99 over the median.
        res[(f[2] + "/p99", int(f[3]))] = float(f[12]) / float(f[9])
    return res


def run_copy(a, size, weft):
    csv = sh([weft, "bench", "--world", str(a.world), "--backend", a.backend, "--ops", "device_copy", "-b", str(size), "-e", str(size),
              "-n", str(a.iters), "-w", str(a.warmup), "--time-per-size", "1000", "--no-check", "--timing", a.timing, "--csv", "-"])
    return {("device_copy", int(f[3])): float(f[9]) for f in (line.split(",") for line in csv.splitlines()[1:])}


def run_gloo(a, size, out, weft):
    ops = ",".join(o for o in a.ops.split(",") if o not in ("reduce_scatter", "scatter", "gather", "all_to_all_v", "sendrecv", "put"))
    with tempfile.TemporaryDirectory() as store:
        env = dict(os.environ, GLOO_STORE_DIR=store)
        bind = ["--bind-cores"] if a.bind else []
        text = sh([weft, "run", "-n", str(a.world), "--no-prefix", "--timeout", "600"] + bind + ["--",
                   f"{out}/gloo_bench", ops, str(size), str(size), "2", str(a.iters), str(a.warmup), a.timing], env=env)
    return parse_lines(text)


def run_mpi(a, size, out, btl):
    ops = ",".join(o for o in a.ops.split(",") if o not in ("scatter", "gather", "all_to_all_v"))
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(a.world), "--mca", "pml", "ob1", "--mca", "btl", btl]
    if a.bind:
        cmd += ["--bind-to", "core:overload-allowed", "--map-by", "core"]
    if btl.startswith("tcp"):
        # One-sided ops as messages over TCP (osc pt2pt); Open MPI would
        # otherwise pick shared memory (osc sm) for a window on one host.
        cmd += ["--mca", "btl_tcp_if_include", "lo", "--mca", "osc", "pt2pt"]
    else:
        cmd += ["--mca", "osc", "sm"]
    return parse_lines(sh(cmd + [f"{out}/mpi_bench", ops, str(size), str(size), "2", str(a.iters), str(a.warmup), a.timing]))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    # Every tool warms up alike. On this kind of VM memory copies run up to
    # twice as slow for the first few ms of copying (a plain memcpy loop in
    # C too: 150-250 us falling to 80 over its first 20 iterations of 2 MiB),
    # so 3 warm-ups measured whichever tool the machine had just warmed up.
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--backend", default="cpu-tcp")
    p.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,broadcast,all_to_all,p2p,sendrecv,barrier")
    p.add_argument("--sizes", default="8,1048576,67108864")
    p.add_argument("--tools", default=",".join(TOOLS),
                   help="which tools run, comma-separated (weft always does): e.g. weft,mpi-shm for the shm anchor alone")
    p.add_argument("--out", default=os.path.join(ROOT, "target", "compare"))
    p.add_argument("--timing", choices=["window", "span"], default="window",
                   help="window: the slowest rank's own time; span: first rank's start to last rank's end (one host)")
    # weft bench binds its ranks to cores round-robin; mpirun leaves ranks
    # that outnumber the cores unbound, and `weft run` binds only when told.
    p.add_argument("--bind", action="store_true",
                   help="bind every tool's ranks to cores round-robin (Open MPI: --bind-to core:overload-allowed --map-by core)")
    a = p.parse_args()
    chosen = set(a.tools.split(",")) | {"weft"}
    if chosen - set(TOOLS):
        p.error(f"unknown tools {sorted(chosen - set(TOOLS))}; known: {', '.join(TOOLS)}")
    build(a.out, chosen)
    weft = os.path.join(ROOT, "target", "release", "weft")
    tools = {
        "weft": lambda s: run_weft(a, s, weft),
        "gloo": lambda s: run_gloo(a, s, a.out, weft),
        "mpi-tcp": lambda s: run_mpi(a, s, a.out, "tcp,self"),
        "mpi-shm": lambda s: run_mpi(a, s, a.out, "vader,self"),
        "copy": lambda s: run_copy(a, s, weft),
    }
    tools = {t: run for t, run in tools.items() if t in chosen}
    samples = {}  # (tool, op, bytes) -> [median_us per round]
    for rnd in range(a.rounds):
        for size in [int(s) for s in a.sizes.split(",")]:
            for tool, run in tools.items():  # alternate tools within each round
                for key, us in run(size).items():
                    samples.setdefault((tool,) + key, []).append(us)
        print(f"round {rnd + 1}/{a.rounds} done", file=sys.stderr)
    keys = sorted({k[1:] for k in samples if k[0] == "weft" and not k[1].endswith("/p99")}, key=lambda k: (k[0], k[1]))
    print(f"# W={a.world}, backend {a.backend}, timing {a.timing}, {a.rounds} alternating rounds, {a.iters} iterations each after {a.warmup} warm-ups; "
          f"time = median over rounds of each run's median (us), [min-max over rounds]; x = anchor time / weft time (>1: weft faster); "
          f"min x = the worst round's ratio; p99/med = weft's worst round")
    anchors = [t for t in tools if t not in ("weft", "copy")]
    hdr = (f"{'op':<15} {'bytes':>10} " + " ".join(f"{t:>24}" for t in tools) + "  " + " ".join(f"{'x ' + t:>10}" for t in tools if t != "weft")
           + "  " + " ".join(f"{'min x ' + t:>14}" for t in anchors) + f"  {'p99/med':>8}")
    print(hdr)
    for op, b in keys:
        cells, med = [], {}
        for t in tools:
            v = samples.get((t, "device_copy" if t == "copy" else op, b))
            if v:
                med[t] = statistics.median(v)
                # Sub-10 us times need two decimals to be compared at all.
                d = 2 if med[t] < 10 else 1 if med[t] < 1000 else 0
                cells.append(f"{med[t]:>10.{d}f} [{min(v):.{d}f}-{max(v):.{d}f}]".rjust(24))
            else:
                cells.append(f"{'-':>24}")
        ratios = [f"{med[t] / med['weft']:>10.2f}" if t in med and "weft" in med else f"{'-':>10}" for t in tools if t != "weft"]
        worst = []
        for t in anchors:
            v, w = samples.get((t, op, b)), samples.get(("weft", op, b))
            # Rounds ran each tool once, in the same order: pair them up.
            worst.append(f"{min(x / y for x, y in zip(v, w)):>14.2f}" if v and w and len(v) == len(w) else f"{'-':>14}")
        tail = samples.get(("weft", op + "/p99", b))
        print(f"{op:<15} {b:>10} " + " ".join(cells) + "  " + " ".join(ratios) + "  " + " ".join(worst)
              + (f"  {max(tail):>8.2f}" if tail else f"  {'-':>8}"))


if __name__ == "__main__":
    main()
