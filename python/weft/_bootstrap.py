"""Where a communicator made without a store finds its ranks and store: the
launcher's environment (torchrun, Slurm, Open MPI, PMI), read by weft's
own parser (``weft::launch``).
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from . import _weft


def rank_and_size() -> tuple[int, int]:
    """This process's rank and the world size, from the launcher's
    variables alone (no store address needed)."""
    return _weft.launch_ranks()


# One store per address for the whole process: communicators made one
# after another share it, so one finalized on rank 0 (which hosts it)
# cannot take the server away from a peer still setting up the next.
_stores: dict[tuple[str, int], dist.Store] = {}


def store_from_env(timeout: float) -> tuple[dist.Store | None, int, int]:
    """The job's store at ``MASTER_ADDR:MASTER_PORT``, and this rank and
    the world size.

    Under ``weft run``, whose launcher hosts a weft store, the store is
    None: the native group connects to it itself. Otherwise it is torch's
    TCP store, hosted by rank 0 unless torchrun's agent hosts it; it is
    multi-tenant, so a torch.distributed group set up through ``env://`` in
    the same process shares its server instead of fighting over the port.
    The store is made once per process and kept."""
    env = _weft.launch_env()
    if env["agent_store"]:
        return None, env["rank"], env["world_size"]
    where = (env["master_addr"], env["master_port"])
    store = _stores.get(where)
    if store is None:
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(
            env["master_addr"],
            env["master_port"],
            env["world_size"],
            is_master=env["rank"] == 0 and not agent,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
            multi_tenant=True,
        )
        if agent:
            # torchrun's store outlives a restart of the workers: each
            # attempt gets its own keys, as torch's env:// does.
            store = dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        _stores[where] = store
    return store, env["rank"], env["world_size"]
