"""Run a function on W ranks, each a real process, under an outer time limit.

Ranks are forked from the test process (torch is imported once; it keeps
one intra-op thread, see below), meet
through `env://` on a free port unless told otherwise, and report their
function's return value or traceback through a pipe. A rank that neither
reports nor exits within the limit fails the test, and every rank still
running is killed: a bug fails a test instead of stalling CI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import time
import traceback

import torch
import torch.distributed as dist

OUTER_LIMIT = 120.0

# Forked ranks inherit the test process's OpenMP pool, which does not
# survive a fork (a child's first parallel op hangs). One intra-op thread
# has no pool to inherit; the tests are about communication.
torch.set_num_threads(1)


def weft_backend(group=None):
    """weft's Backend of `group` (default: the world) for CPU tensors,
    whichever shape torch sees it in."""
    return (group or dist.group.WORLD)._get_backend(torch.device("cpu"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(AssertionError):
    """A rank raised, died or ran past the limit; `.results` has the others."""

    def __init__(self, message, results):
        super().__init__(message)
        self.results = results


def _child(fn, rank, world, args, env, backend, init, conn):
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)})
    try:
        if init:
            dist.init_process_group(backend)
        out = fn(rank, world, *args)
        if init and dist.is_initialized():
            # Nobody leaves before everyone is done: rank 0 hosts the store,
            # and a rank still setting up (a peer that only sent may finish
            # first) would lose it. A test that broke its group on purpose
            # has its answer already.
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001
                pass
            dist.destroy_process_group()
        # Plain pickle: torch's multiprocessing pickler would share tensor
        # storage by descriptor, which dies with this process.
        conn.send_bytes(pickle.dumps(("ok", out)))
        code = 0
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send_bytes(pickle.dumps(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
        code = 1
    conn.close()
    # Skip interpreter teardown: the parent's atexit hooks are not ours.
    os._exit(code)


def run(fn, world=2, *args, env=None, backend="weft", init=True, timeout=OUTER_LIMIT, allow_fail=False):
    """`fn(rank, world, *args)` on `world` forked ranks; their return values
    in rank order. With `allow_fail`, a failed rank's entry is
    `("err", text)` (or `("died", exitcode)`) instead of failing the test."""
    ctx = mp.get_context("fork")
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WEFT_TIMEOUT_SECONDS": "60"}
    base.update(env or {})
    pipes, procs = [], []
    for r in range(world):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(fn, r, world, args, base, backend, init, child), daemon=True)
        p.start()
        child.close()
        pipes.append(parent)
        procs.append(p)
    results = [None] * world
    deadline = time.monotonic() + timeout
    pending = set(range(world))
    while pending and time.monotonic() < deadline:
        for r in list(pending):
            if pipes[r].poll(0.05):
                try:
                    results[r] = pickle.loads(pipes[r].recv_bytes())
                except EOFError:
                    procs[r].join(1)
                    results[r] = ("died", procs[r].exitcode)
                pending.discard(r)
            elif not procs[r].is_alive() and not pipes[r].poll(0):
                results[r] = ("died", procs[r].exitcode)
                pending.discard(r)
    for r in pending:
        results[r] = ("hung", None)
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(5)
    if allow_fail:
        return [v[1] if v[0] == "ok" else v for v in results]
    bad = [(r, v) for r, v in enumerate(results) if v[0] != "ok"]
    if bad:
        text = "\n".join(f"rank {r}: {kind}: {what}" for r, (kind, what) in bad)
        raise RankFailed(f"{len(bad)} of {world} ranks failed:\n{text}", results)
    return [v[1] for v in results]
