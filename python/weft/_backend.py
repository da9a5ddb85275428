"""weft as a torch.distributed backend: the creator c10d calls per group,
and the two shapes the backend takes.

- Where weft serves every device of the group (``"weft"``,
  ``"cpu:weft"``, ``"cuda:weft"``), the creator returns a
  :class:`ProcessGroup` (a ``torch.distributed.ProcessGroup`` subclass),
  which c10d uses as the group itself: torch's callers get weft's Work
  objects, with ``is_completed()`` and ``source_rank()`` (``recv(src=None)``).
- In a mixed spec (``"cpu:weft,cuda:nccl"``), c10d needs one backend per
  device inside its own ProcessGroup, so the creator returns a
  :class:`Backend` (``torch.distributed._Backend``). There c10d wraps the
  works it returns and forwards only ``wait`` and ``get_future``:
  ``is_completed()`` stays False and ``recv(src=None)`` is unavailable (a
  limit of torch's Python backend API).
"""

from __future__ import annotations

import os
import sys
import datetime

import torch.distributed as dist

from . import _errors, _weft  # noqa: F401 - _errors makes native errors torch types
from ._ops import Ops

ENV_BACKEND = "WEFT_BACKEND"
ENV_TIMEOUT = "WEFT_TIMEOUT_SECONDS"

# c10d may drop its last reference to the Python half of a backend while
# the C++ half lives on (TORCH_DISTRIBUTED_DEBUG=DETAIL wraps it): keep
# every one, and drop them when the group is destroyed.
_alive: list = []


class Options:
    """Backend options for ``init_process_group("weft", pg_options=...)``
    and ``new_group``: which weft backend runs inside (``auto``, ``shm``,
    ``cpu-tcp``, ``hierarchical``, ``cpu:NAME,cuda:NAME``, a plugin's name;
    default ``WEFT_BACKEND``, else ``auto``) and group hints
    (``{"algorithm": "all_reduce=ring"}``)."""

    def __init__(self, backend: str | None = None, hints: dict[str, str] | None = None):
        self.weft_backend = backend
        self.hints = dict(hints or {})


def _weft_spec(backend_options) -> str:
    """Which weft backend runs inside: the backend options' `weft_backend`,
    else WEFT_BACKEND, else auto."""
    spec = getattr(backend_options, "weft_backend", None)
    return spec or os.environ.get(ENV_BACKEND, "auto")


def _timeout_seconds(timeout) -> float:
    """WEFT_TIMEOUT_SECONDS if set, else the group's timeout from c10d."""
    env = os.environ.get(ENV_TIMEOUT)
    if env:
        return float(env)
    if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
        return timeout.total_seconds()
    return float(_weft.TIMEOUT_DEFAULT)


def _serves_every_device() -> bool:
    """Whether weft serves every device of the group being created: read
    from c10d's `backend_config` in the caller (torch has no other way to
    tell a creator); False, the safe shape, if it cannot be read."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_new_process_group_helper":
            config = frame.f_locals.get("backend_config")
            if config is None:
                return False
            return set(config.get_device_backend_map().values()) == {"weft"}
        frame = frame.f_back
    return False


def _native_group(store, rank, size, backend_options, timeout) -> _weft.Group:
    """weft's group; setup errors are torch's types (a failing store's is a
    ``DistStoreError``)."""
    hints = getattr(backend_options, "hints", None) or None
    return _weft.Group(store, rank, size, _weft_spec(backend_options), timeout, hints)


def create(opts, backend_options=None):
    """c10d's creator (extended API): one weft group per c10d group."""
    timeout = _timeout_seconds(opts.timeout)
    native = _native_group(opts.store, opts.group_rank, opts.group_size, backend_options, timeout)
    cls = ProcessGroup if _serves_every_device() else Backend
    pg = cls(opts.group_rank, opts.group_size, native, timeout)
    _alive.append(pg)
    return pg


class _Common(Ops):
    """What both shapes share besides the ops."""

    def _setup(self, native: _weft.Group, timeout: float) -> None:
        self._native = native
        self._timeout = timeout

    def getBackendName(self) -> str:
        return "weft"

    # c10d asks for a sequence number the same on every rank (DETAIL
    # debugging); weft checks its own order, so it is always 0.
    def _get_sequence_number_for_group(self) -> int:
        return 0

    def _set_sequence_number_for_group(self) -> None:
        pass

    # torch's trampoline recurses without end unless the subclass defines
    # each capability itself: none of these is offered.
    _unsupported = property(lambda self: False)
    supports_splitting = supports_coalescing = supports_shrinking = _unsupported
    supports_reconfigure = supports_window = _supports_time_estimate = _unsupported

    def weft_backend_name(self, device: str = "cpu") -> str | None:
        """The weft backend serving `device` tensors in this group."""
        return self._native.backend_name(device)

    def abort(self) -> None:
        """Fail every in-flight and later op of this group on this rank."""
        self._native.abort()

    def shutdown(self) -> None:
        """Release the group (c10d's destroy_process_group)."""
        if self in _alive:
            _alive.remove(self)


class ProcessGroup(_Common, dist.ProcessGroup):
    """weft as the whole process group (every device of the group)."""

    def __init__(self, rank: int, size: int, native: _weft.Group, timeout: float):
        super().__init__(rank, size)
        self._setup(native, timeout)
        self._name = None
        self._desc = None

    def _get_backend(self, device=None):
        return self

    def getGroupName(self):
        return self._name

    def setGroupName(self, name):
        self._name = name

    def getGroupDesc(self):
        return self._desc

    def setGroupDesc(self, desc):
        self._desc = desc

    @property
    def group_name(self):
        return self._name

    @property
    def group_desc(self):
        return self._desc

    def __repr__(self) -> str:
        return f"weft.ProcessGroup(rank {self.rank()} of {self.size()}, {self._native.backend_name()})"


class Backend(_Common, dist._Backend):
    """weft as one device's backend inside c10d's process group."""

    def __init__(self, rank: int, size: int, native: _weft.Group, timeout: float):
        super().__init__(rank, size)
        self._setup(native, timeout)

    def __repr__(self) -> str:
        return f"weft.Backend(rank {self.rank()} of {self.size()}, {self._native.backend_name()})"
