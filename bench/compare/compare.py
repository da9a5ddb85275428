#!/usr/bin/env python3
"""Side-by-side comparison: weft bench vs Gloo vs Open MPI vs MPICH on this machine.

Builds gloo_bench.cc (Debian libgloo-dev) and mpi_bench.c (openmpi-bin,
libopenmpi-dev; and with MPICH from PyPI's `mpich` wheel, installed into a
virtual environment under --out), then runs weft and the anchors alternately, ROUNDS
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

--inputs fresh (or reused,fresh) has every tool rewrite each rank's input
on its own core before every iteration, untimed, as programs compute what
they send right before sending it; rows of that mode read "op/fresh".

--phases labels every run with the machine's phase: a probe (weft's shm
ring handing 1 MiB one way across cores, `broadcast` with single copy off,
the median of 10) runs between tool runs, and a run is "calm" when the probes
before and after it are both within 1.3 x the session's lower-decile probe,
"slow" when both are past it (or past --slow-above us), "mixed" otherwise (the
tables judge by every probe of the session; --until-phases decides to
stop by the probes so far). One table per phase follows the
overall one, pairing tools only within rounds where both ran in that
phase. --until-phases N keeps adding rounds (up to --rounds) until every
tool (the copy aside) has N calm and N slow runs of every row, and says
when it had fewer.
--runs-csv FILE writes every run (its round, time, probes and phase): the
per-round table behind the medians.

Usage: bench/compare/compare.py [--world 2] [--rounds 5] [--backend cpu-tcp]
       [--ops all_reduce,...] [--sizes 8,1048576,67108864] [--iters 10]
       [--tools weft,weft-fixed,weft-ring,weft-single,gloo,mpi-tcp,mpi-shm,mpich,copy]
       [--warmup 20] [--timing window|span] [--inputs reused,fresh]
       [--phases] [--until-phases 3] [--runs-csv runs.csv]
Needs: apt-get install libgloo-dev openmpi-bin libopenmpi-dev g++
"""
import argparse, os, statistics, subprocess, sys, tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


# Every tool compare.py can run, in the order each round runs them.
TOOLS = ["weft", "weft-fixed", "weft-ring", "weft-single", "gloo", "mpi-tcp", "mpi-shm", "mpich", "copy"]
# weft with shm hints: they mean something on --backend shm only, so they
# run only when named.
SHM_VARIANTS = {"weft-fixed", "weft-ring", "weft-single"}


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
    if "mpich" in tools:
        # MPICH from PyPI's wheel (its own mpicc and mpiexec), in a virtual
        # environment kept with the build outputs.
        venv = f"{out}/mpich-venv"
        if not os.path.exists(f"{venv}/bin/mpicc"):
            sh([sys.executable, "-m", "venv", venv])
            sh([f"{venv}/bin/pip", "install", "-q", "mpich"])
        sh([f"{venv}/bin/mpicc", "-O2", "-o", f"{out}/mpich_bench", f"{HERE}/mpi_bench.c"])


def parse_lines(text):
    res = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3:
            res[(parts[0], int(parts[1]))] = float(parts[2])
    return res


def run_weft(a, size, weft, fresh, hints=()):
    csv = sh([weft, "bench", *[x for h in hints for x in ("--hint", h)], "--world", str(a.world), "--backend", a.backend, "--ops", a.ops, "-b", str(size), "-e", str(size),
              "-n", str(a.iters), "-w", str(a.warmup), "--time-per-size", "1000", "--no-check", "--timing", a.timing, "--csv", "-"]
             + (["--fresh-inputs"] if fresh else []))
    res = {}
    for line in csv.splitlines()[1:]:
        f = line.split(",")
        res[(f[2], int(f[3]))] = float(f[9])
        # The tail within the run: p99 over the median.
        res[(f[2] + "/p99", int(f[3]))] = float(f[12]) / float(f[9])
    return res


def probe(weft):
    """The phase probe: weft's shm ring handing 1 MiB one way across cores
    (broadcast at W = 2, single copy off), median of 10, in us. One way,
    because the receiver's copy then reads lines the other core has just
    written, which is what slow phases tax; 1 MiB, because that stays in
    one core's L2: a 4 MiB probe also read slow (200-313 us against 70-100)
    where 1 MiB ops ran at their calm times, while ring-based ops were 1.4
    x slower at readings of 100-150 us (bench/RESULTS.md, thirteenth
    session)."""
    csv = sh([weft, "bench", "--world", "2", "--backend", "shm", "--hint", "shm_cma=off", "--ops", "broadcast", "-b", "1048576",
              "-e", "1048576", "-n", "10", "-w", "3", "--no-check", "--csv", "-"])
    return float(csv.splitlines()[1].split(",")[9])


def run_copy(a, size, weft):
    csv = sh([weft, "bench", "--world", str(a.world), "--backend", a.backend, "--ops", "device_copy", "-b", str(size), "-e", str(size),
              "-n", str(a.iters), "-w", str(a.warmup), "--time-per-size", "1000", "--no-check", "--timing", a.timing, "--csv", "-"])
    return {("device_copy", int(f[3])): float(f[9]) for f in (line.split(",") for line in csv.splitlines()[1:])}


def run_gloo(a, size, out, weft, fresh):
    ops = ",".join(o for o in a.ops.split(",") if o not in ("reduce_scatter", "scatter", "gather", "all_to_all_v", "sendrecv", "put"))
    with tempfile.TemporaryDirectory() as store:
        env = dict(os.environ, GLOO_STORE_DIR=store)
        bind = ["--bind-cores"] if a.bind else []
        text = sh([weft, "run", "-n", str(a.world), "--no-prefix", "--timeout", "600"] + bind + ["--",
                   f"{out}/gloo_bench", ops, str(size), str(size), "2", str(a.iters), str(a.warmup), a.timing]
                  + (["fresh"] if fresh else []), env=env)
    return parse_lines(text)


def mpi_ops(a):
    """The ops of --ops that mpi_bench.c times."""
    return ",".join(o for o in a.ops.split(",") if o not in ("scatter", "gather", "all_to_all_v"))


def run_mpi(a, size, out, btl, fresh):
    ops = mpi_ops(a)
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(a.world), "--mca", "pml", "ob1", "--mca", "btl", btl]
    if a.bind:
        cmd += ["--bind-to", "core:overload-allowed", "--map-by", "core"]
    if btl.startswith("tcp"):
        # One-sided ops as messages over TCP (osc pt2pt); Open MPI would
        # otherwise pick shared memory (osc sm) for a window on one host.
        cmd += ["--mca", "btl_tcp_if_include", "lo", "--mca", "osc", "pt2pt"]
    else:
        cmd += ["--mca", "osc", "sm"]
    return parse_lines(sh(cmd + [f"{out}/mpi_bench", ops, str(size), str(size), "2", str(a.iters), str(a.warmup), a.timing]
                          + (["fresh"] if fresh else [])))


def run_mpich(a, size, out, fresh):
    ops = mpi_ops(a)
    cmd = [f"{out}/mpich-venv/bin/mpiexec", "-n", str(a.world)] + (["-bind-to", "core"] if a.bind else [])
    return parse_lines(sh(cmd + [f"{out}/mpich_bench", ops, str(size), str(size), "2", str(a.iters), str(a.warmup), a.timing]
                          + (["fresh"] if fresh else [])))


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
    p.add_argument("--tools", default=",".join(t for t in TOOLS if t not in SHM_VARIANTS),
                   help="which tools run, comma-separated (weft always does): e.g. weft,mpi-shm for the shm anchor alone")
    p.add_argument("--out", default=os.path.join(ROOT, "target", "compare"))
    p.add_argument("--timing", choices=["window", "span"], default="window",
                   help="window: the slowest rank's own time; span: first rank's start to last rank's end (one host)")
    # weft bench binds its ranks to cores round-robin; mpirun leaves ranks
    # that outnumber the cores unbound, and `weft run` binds only when told.
    p.add_argument("--bind", action="store_true",
                   help="bind every tool's ranks to cores round-robin (Open MPI: --bind-to core:overload-allowed --map-by core)")
    p.add_argument("--inputs", default="reused",
                   help="reused (as nccl-tests), fresh (each rank rewrites its input before every iteration), or both: reused,fresh")
    p.add_argument("--phases", action="store_true", help="probe the machine's phase between tool runs and report per phase")
    p.add_argument("--slow-above", type=float, default=0.0,
                   help="with --phases: a probe slower than this many us is slow (default: 1.3 x the session's lower-decile probe)")
    p.add_argument("--until-phases", type=int, default=0,
                   help="with --phases: keep adding rounds (up to --rounds) until every tool but the copy has this many calm and slow runs of every row")
    p.add_argument("--runs-csv", default="",
                   help="also write every run (round, tool, op, bytes, us; with --phases its probes and phase) to this CSV file")
    a = p.parse_args()
    chosen = set(a.tools.split(",")) | {"weft"}
    if chosen - set(TOOLS):
        p.error(f"unknown tools {sorted(chosen - set(TOOLS))}; known: {', '.join(TOOLS)}")
    if chosen & SHM_VARIANTS and a.backend != "shm":
        p.error(f"{', '.join(sorted(chosen & SHM_VARIANTS))}: shm hints; pass --backend shm")
    modes = a.inputs.split(",")
    if set(modes) - {"reused", "fresh"} or not modes:
        p.error("--inputs: reused, fresh or reused,fresh")
    a.phases |= a.until_phases > 0
    if a.rounds < 1:
        p.error("--rounds: at least 1")
    build(a.out, chosen)
    weft = os.path.join(ROOT, "target", "release", "weft")
    tools = {
        "weft": lambda s, f: run_weft(a, s, weft, f),
        # shm keeping the copy policy agreed at setup (no scheme chosen as the run goes).
        "weft-fixed": lambda s, f: run_weft(a, s, weft, f, ["shm_adapt=off"]),
        # shm with the scheme of large messages fixed for the whole run: all through the ring, or single copy (pulled or pushed).
        "weft-ring": lambda s, f: run_weft(a, s, weft, f, ["shm_cma=off"]),
        "weft-single": lambda s, f: run_weft(a, s, weft, f, ["shm_cma=on"]),
        "gloo": lambda s, f: run_gloo(a, s, a.out, weft, f),
        "mpi-tcp": lambda s, f: run_mpi(a, s, a.out, "tcp,self", f),
        "mpi-shm": lambda s, f: run_mpi(a, s, a.out, "vader,self", f),
        "mpich": lambda s, f: run_mpich(a, s, a.out, f),
        "copy": lambda s, f: run_copy(a, s, weft),
    }
    tools = {t: run for t, run in tools.items() if t in chosen}
    samples = {}  # (tool, op, bytes) -> [(round, median_us, phase probes)]
    last = probe(weft) if a.phases else None
    probes = [last] if a.phases else []  # each probe once, in order
    for rnd in range(a.rounds):
        for size in [int(s) for s in a.sizes.split(",")]:
            for tool, run in tools.items():  # alternate tools within each round
                for mode in modes if tool != "copy" else ["reused"]:
                    got = run(size, mode == "fresh")
                    before, last = last, probe(weft) if a.phases else None
                    probes += [last] if a.phases else []
                    for (op, b), us in got.items():
                        if mode == "fresh":  # all_gather/fresh, all_gather/fresh/p99
                            op = op.replace("/p99", "") + "/fresh" + ("/p99" if op.endswith("/p99") else "")
                        samples.setdefault((tool, op, b), []).append((rnd, us, (before, last)))
        print(f"round {rnd + 1}/{a.rounds} done", file=sys.stderr)
        if a.until_phases and enough(samples, slow_line(a, probes), a.until_phases):
            break
    print(f"# W={a.world}, backend {a.backend}, timing {a.timing}, inputs {a.inputs}, {rnd + 1} alternating rounds, {a.iters} iterations each after {a.warmup} warm-ups; "
          f"time = median over rounds of each run's median (us), [min-max over rounds]; x = anchor time / weft time (>1: weft faster); "
          f"min x = the worst round's ratio; p99/med = weft's worst round")
    table(samples, tools, None)
    line = slow_line(a, probes) if a.phases else None
    if a.phases:
        print(f"# phase probe (shm ring, 1 MiB one way across cores): {min(probes):.0f}-{max(probes):.0f} us; slow above {line:.0f} us")
        for phase in ("calm", "slow", "mixed"):
            picked = {k: [x for x in v if phase_of(x[2], line) == phase] for k, v in samples.items()}
            print(f"\n# {phase} runs")
            table(picked, tools, phase)
        if a.until_phases and not enough(samples, line, a.until_phases):
            print(f"# fewer than {a.until_phases} calm and {a.until_phases} slow runs of every row within {a.rounds} rounds")
    if a.runs_csv:
        write_runs(a.runs_csv, samples, line)


def write_runs(path, samples, line):
    """Every run, one line each, ordered by round: the per-round table
    behind the medians (probes in us; phase empty without --phases)."""
    with open(path, "w") as f:
        f.write("round,tool,op,bytes,us,probe_before_us,probe_after_us,phase\n")
        runs = [(r, t, op, b, us, pr) for (t, op, b), v in samples.items() if not op.endswith("/p99") for r, us, pr in v]
        for r, t, op, b, us, pr in sorted(runs, key=lambda x: (x[0], x[2], x[3], x[1])):
            before, after = ("" if p is None else f"{p:.1f}" for p in pr)
            f.write(f"{r + 1},{t},{op},{b},{us:.2f},{before},{after},{phase_of(pr, line) if line is not None else ''}\n")


# By default a run is slow when its probes took more than this many times
# the session's lower decile (a calm reading, where the session has calm
# moments; the fastest alone can be an outlier). Calm 1 MiB probes read
# 18-24 us, slow ones 25-140, and ring-based ops were 1.3 x slower at 25-38
# already (bench/RESULTS.md, thirteenth session).
SLOW = 1.3


def slow_line(a, probes):
    """The probe time above which the machine counts as slow."""
    return a.slow_above or sorted(probes)[len(probes) // 10] * SLOW


def phase_of(pair, line):
    """calm, slow or mixed, from the probes before and after a run."""
    kinds = {"slow" if p > line else "calm" for p in pair}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def enough(samples, line, n):
    """Whether every tool (the copy aside) has n calm and n slow runs of
    every row: the phase tables then compare tools, not weft alone."""
    rows = [v for k, v in samples.items() if k[0] != "copy" and not k[1].endswith("/p99")]
    return all(sum(phase_of(x[2], line) == ph for x in v) >= n for v in rows for ph in ("calm", "slow"))


def table(samples, tools, phase):
    """One table: per row, each tool's median over its runs, the ratios,
    the worst round's ratio (runs of one round paired) and weft's tail."""
    keys = sorted({k[1:] for k in samples if k[0] == "weft" and not k[1].endswith("/p99") and samples[k]}, key=lambda k: (k[0], k[1]))
    anchors = [t for t in tools if t not in ("weft", "copy")]
    hdr = (f"{'op':<21} {'bytes':>10} " + " ".join(f"{t:>24}" for t in tools) + "  " + " ".join(f"{'x ' + t:>10}" for t in tools if t != "weft")
           + "  " + " ".join(f"{'min x ' + t:>14}" for t in anchors) + f"  {'p99/med':>8}")
    print(hdr)
    for op, b in keys:
        cells, med = [], {}
        for t in tools:
            v = [x[1] for x in samples.get((t, "device_copy" if t == "copy" else op, b), [])]
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
            # Pair the runs of one round (each tool ran once per round and mode).
            v, w = dict((x[0], x[1]) for x in samples.get((t, op, b), [])), dict((x[0], x[1]) for x in samples.get(("weft", op, b), []))
            both = sorted(set(v) & set(w))
            worst.append(f"{min(v[r] / w[r] for r in both):>14.2f}" if both else f"{'-':>14}")
        tail = [x[1] for x in samples.get(("weft", op + "/p99", b), [])] if phase is None else []
        print(f"{op:<21} {b:>10} " + " ".join(cells) + "  " + " ".join(ratios) + "  " + " ".join(worst)
              + (f"  {max(tail):>8.2f}" if tail else f"  {'-':>8}"))


if __name__ == "__main__":
    main()
