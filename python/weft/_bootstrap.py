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
    """This process's rank and the world size, from the launcher."""
    env = _weft.launch_env()
    return env["rank"], env["world_size"]


def store_from_env(timeout: float) -> tuple[dist.Store | None, int, int]:
    """The job's store at ``MASTER_ADDR:MASTER_PORT``, and this rank and
    the world size.

    Under ``weft run``, whose launcher hosts a weft store, the store is
    None: the native group connects to it itself. Otherwise it is torch's
    TCP store, hosted by rank 0 unless torchrun's agent hosts it; it is
    multi-tenant, so a torch.distributed group set up through ``env://`` in
    the same process shares its server instead of fighting over the port."""
    env = _weft.launch_env()
    if env["agent_store"]:
        return None, env["rank"], env["world_size"]
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
    return store, env["rank"], env["world_size"]
