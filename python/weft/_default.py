"""Which weft communicator serves a call that names a group, or none.

- A :class:`~weft.Comm` serves itself.
- A ``torch.distributed`` group that runs on weft (``init_process_group("weft")``,
  ``new_group(backend="weft")``) is served by a Comm over its own weft group.
- No group: the default ``torch.distributed`` group if it runs on weft;
  else weft's default communicator, made on first use, over the default
  group's store if the program made one (gloo, say), else from the
  launcher's environment (torchrun, ``weft run``, Slurm, Open MPI).
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from . import _weft
from ._comm import Comm, _default_timeout, new_comm

# Comms over torch groups' weft groups, by the weft group's id (torch's
# group objects do not all take weak references).
_over: dict[int, Comm] = {}
_default: Comm | None = None
_lock = threading.Lock()

DEFAULT_NAME = "weft.default"


def _weft_group_of(group) -> _weft.Group | None:
    """The weft group behind a torch.distributed group, if it runs on weft."""
    native = getattr(group, "_native", None)
    if native is None:
        try:
            native = getattr(group._get_backend(torch.device("cpu")), "_native", None)
        except (RuntimeError, AttributeError, ValueError):
            native = None
    return native if isinstance(native, _weft.Group) else None


def comm_of(group=None) -> Comm:
    """The communicator that serves `group` (see the module docs); a
    ``ValueError`` for a torch group that does not run on weft."""
    if isinstance(group, Comm):
        return group
    if group is None:
        if dist.is_initialized():
            native = _weft_group_of(dist.group.WORLD)
            if native is not None:
                return _comm_over(native)
        return default_comm()
    native = _weft_group_of(group)
    if native is None:
        raise ValueError(f"weft: group {group!r} does not run on weft (make it with backend 'weft', or pass a weft Comm)")
    return _comm_over(native)


def _comm_over(native: _weft.Group) -> Comm:
    with _lock:
        comm = _over.get(id(native))
        if comm is None or comm._native is not native:
            secs = _default_timeout()
            comm = Comm(native, backend="weft", device=torch.device("cpu"), name="", timeout=secs, abort=False, store=None)
            _over[id(native)] = comm
        return comm


def default_comm() -> Comm:
    """weft's default communicator, made (collectively) on first use."""
    global _default
    with _lock:
        if _default is None:
            if dist.is_initialized():
                store = dist.distributed_c10d._get_default_store()
                secs = _default_timeout()
                native = _weft.Group(store, dist.get_rank(), dist.get_world_size(), "auto", secs, None, DEFAULT_NAME)
                _default = Comm(native, backend="weft", device=torch.device("cpu"), name=DEFAULT_NAME, timeout=secs, abort=False, store=store)
            else:
                _default = new_comm("weft", "cpu", name=DEFAULT_NAME, abort_process_on_timeout_or_error=False)
        return _default
