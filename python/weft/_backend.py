"""weft as a torch.distributed backend: the creator c10d calls per group,
and the objects torch sees.

Every weft group is a :class:`Backend`, the object torch asks for by
device (``pg._get_backend(device)``): its ops, capabilities, errors,
timeouts, splits, shrinks, windows and abort hooks. Its class derives from
weft's C++ ``c10d::Backend`` (``weft/_c10d``, built against the installed
torch on first use), which issues the common ops on dense CPU tensors
through weft's C API without Python, and hands torch weft's Work whole
(``is_completed()``, ``source_rank()`` for ``recv(src=None)``,
``exception()``) for the rest, which runs the Python ops here (``_ops.py``).
Without a C++ compiler (or with ``WEFT_TORCH_CPP=0``) it is a
``torch.distributed._Backend`` (torch's Python trampoline, which wraps its
Works and forwards only ``wait`` and ``get_future``).

- Where weft serves every device of the group (``"weft"``,
  ``"cpu:weft"``, ``"cuda:weft"``), the creator returns a
  :class:`ProcessGroup` (a ``torch.distributed.ProcessGroup`` subclass)
  with the Backend registered for each device weft serves: torch's calls
  reach the Backend's ops without torch's dispatcher (the cheapest path:
  the common ones go straight to the C++ backend's), and callers get
  weft's Work. torch's per-op hooks and flight recorder see only ops that
  go through the dispatcher: with ``WEFT_TORCH_HOOKS=1`` (and the C++
  backend) these specs get torch's own group instead.
- In a mixed spec (``"cpu:weft,cuda:nccl"``), and in the groups torch
  builds around a shrunk Backend, the Backend sits inside torch's own
  ProcessGroup: ops go through the dispatcher (hooks, flight recorder).
"""

from __future__ import annotations

import datetime
import functools
import os
import sys
import weakref

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from . import _c10d, _errors, _weft
from ._ops import Call, Ops, _Batch
from ._tensors import Staged
from ._window import Window
from ._work import _positive_seconds, _seconds

ENV_BACKEND = "WEFT_BACKEND"
ENV_TIMEOUT = "WEFT_TIMEOUT_SECONDS"
# "1": weft-only specs too get torch's own group around weft's C++ backend,
# so torch's per-op hooks and flight recorder see their ops (at torch's
# cost per op: its dispatcher and recorder).
ENV_HOOKS = "WEFT_TORCH_HOOKS"

# c10d may drop its last reference to the Python half of a backend while
# the C++ half lives on (TORCH_DISTRIBUTED_DEBUG=DETAIL wraps it, and a
# registered Backend is held by C++ only): keep every one, and drop them
# when the group is shut down.
_alive: list = []

# torch's ErrorType by weft's code (python/src/health.rs).
_ERROR_TYPES = (c10d.ErrorType.SUCCESS, c10d.ErrorType.TIMEOUT, c10d.ErrorType.COMM_ERROR, c10d.ErrorType.REMOTE_ERROR)

# monitored_barrier's messages: tags of their own, one per call (mod 2^16),
# above any tag a program is likely to use; a late rank's message lands in
# the receive of its own call, never in a later one.
_MONITORED_TAG = 0x7FFF_0000


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
    env = os.environ.get(ENV_TIMEOUT, "").strip()
    if env:
        return _weft.parse_timeout(env)
    if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
        return timeout.total_seconds()
    return float(_weft.TIMEOUT_DEFAULT)


def _device_map() -> dict | None:
    """c10d's device -> backend map of the group being created, read from
    its `backend_config` in the caller (torch has no other way to tell a
    creator); None if it cannot be read."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_new_process_group_helper":
            config = frame.f_locals.get("backend_config")
            return None if config is None else dict(config.get_device_backend_map())
        frame = frame.f_back
    return None


def _native_group(store, rank, size, backend_options, timeout) -> _weft.Group:
    """weft's group; setup errors are torch's types (a failing store's is a
    ``DistStoreError``)."""
    hints = getattr(backend_options, "hints", None) or None
    return _weft.Group(store, rank, size, _weft_spec(backend_options), timeout, hints)


def create(opts, backend_options=None):
    """c10d's creator (extended API): one weft group per c10d group."""
    timeout = _timeout_seconds(opts.timeout)
    native = _native_group(opts.store, opts.group_rank, opts.group_size, backend_options, timeout)
    devices = _device_map()
    whole = devices is not None and set(devices.values()) == {"weft"}
    through_torch = os.environ.get(ENV_HOOKS) == "1" and _cpp_backend_class() is not None
    return _wrap(native, timeout, _DEVICES if whole and not through_torch else None, opts.store)


# The devices a weft group may serve (those it has a backend for).
_DEVICES = ("cpu", "cuda")

# The ops torch's Python functions call a group with that weft's C++
# backend issues without Python where it can (dense contiguous CPU tensors,
# not while coalescing; the rest it hands to the Python ops): weft's own
# ProcessGroup calls them there directly (`_native_<name>`).
_NATIVE_OPS = (
    "allreduce",
    "broadcast",
    "reduce",
    "allgather",
    "all_gather_single",
    "reduce_scatter_single",
    "all_to_all_single",
    "alltoall",
    "send",
    "recv",
    "recv_anysource",
    "barrier",
)


def _wrap(native: _weft.Group, timeout: float, devices, store=None):
    """The object torch gets for `native`: a :class:`ProcessGroup` with its
    Backend registered for those of `devices` weft has a backend for, or
    with None the :class:`Backend` alone."""
    backend = _backend(native, timeout)
    if devices is None:
        return backend
    pg = ProcessGroup(native, backend, store)
    custom = c10d.ProcessGroup.BackendType.CUSTOM
    for d in devices:
        if native.backend_name(d) is not None:
            pg._register_backend(torch.device(d), custom, backend)
    pg._set_default_backend(custom)
    if hasattr(backend, "_bind_native"):
        for name in _NATIVE_OPS:
            setattr(pg, name, getattr(backend, "_native_" + name))
        pg._allgather_base, pg._reduce_scatter_base, pg.alltoall_base = pg.all_gather_single, pg.reduce_scatter_single, pg.all_to_all_single
    _alive.append(pg)
    return pg


class _Common(Ops):
    """What the ProcessGroup and its Backend share: state, settings and
    ops. Both objects of one group hold the same `_shared` dict and
    native group."""

    def _setup(self, native: _weft.Group, timeout: float, shared: dict) -> None:
        self._native = native
        self._timeout = timeout
        self._shared = shared
        # Weakly: the members refer to each other through it, and Python's
        # collector does not free torch's objects caught in a cycle (a
        # destroyed group would keep its connections open).
        shared.setdefault("members", weakref.WeakSet()).add(self)

    def getBackendName(self) -> str:
        return "weft"

    # c10d asks for a sequence number the same on every rank (DETAIL
    # debugging); weft checks its own order, so it is always 0.
    def _get_sequence_number_for_group(self) -> int:
        return 0

    def _set_sequence_number_for_group(self) -> None:
        pass

    # torch's trampoline recurses without end unless the subclass defines
    # each capability itself. Reconfiguring and time estimates are not
    # offered (see the README).
    supports_splitting = supports_coalescing = supports_shrinking = supports_window = property(lambda self: True)
    supports_reconfigure = _supports_time_estimate = property(lambda self: False)
    # Abort hooks live in weft's C++ backend (see `_run_abort_hooks`).
    supports_abort_hooks = property(lambda self: any(hasattr(m, "_fire_abort_hooks") for m in self._shared["members"]))

    def supports_tensor_alloc(self, device) -> bool:
        """weft allocates no tensors for torch (torch's own allocator serves)."""
        return False

    def weft_backend_name(self, device: str = "cpu") -> str | None:
        """The weft backend serving `device` tensors in this group."""
        return self._native.backend_name(device)

    # -- settings and health -----------------------------------------------

    @property
    def options(self):
        """torch's backend options: the name and the group's timeout."""
        return c10d.Backend.Options("weft", datetime.timedelta(seconds=self._timeout))

    def set_timeout(self, timeout) -> None:
        """The timeout of this group's later ops (`timedelta` or seconds)."""
        secs = _positive_seconds(timeout)
        for m in self._shared["members"]:
            m._timeout = secs
            if hasattr(m, "_set_native_timeout"):
                m._set_native_timeout(secs)

    _set_default_timeout = set_timeout

    def get_error(self):
        """The last communication error an op of this group met (torch's
        ``ErrorType``): ``TIMEOUT``, ``REMOTE_ERROR`` (a peer died or left),
        ``COMM_ERROR`` (a broken transport, an abort), else ``SUCCESS``."""
        return _ERROR_TYPES[self._native.error_code()]

    def abort(self) -> None:
        """Fail every in-flight and later op of this group on this rank
        (the group's abort hooks run first)."""
        self._run_abort_hooks()
        self._native.abort()

    def _run_abort_hooks(self) -> None:
        """Before this rank aborts the group (``abort()``, ``SHRINK_ABORT``):
        run torch's abort hooks, kept and run by weft's C++ backend without
        the GIL (torch's flight recorder dumps from one). The Python API has
        no abort hooks (``supports_abort_hooks`` False there)."""
        fire = getattr(self, "_fire_abort_hooks", None)
        if fire is not None:
            fire()

    def shutdown(self) -> None:
        """Release the group (c10d's destroy_process_group): once torch
        lets go of it too, weft's group closes its connections."""
        for m in list(self._shared["members"]):
            if m in _alive:
                _alive.remove(m)

    def _guard(self, fn, *args):
        """Call a native method (a window's): errors propagate as they are."""
        return fn(*args)

    # -- coalescing --------------------------------------------------------

    def start_coalescing(self) -> None:
        """Collect this group's sends and receives until `end_coalescing`,
        which issues them as one batch; collectives issued meanwhile run as
        usual and join the batch's Work."""
        if self._shared.get("batch") is not None:
            raise ValueError("weft: this group is already coalescing")
        self._shared["batch"] = _Batch()
        self._coalescing(True)

    def end_coalescing(self):
        """Issue the collected sends and receives as one batch: one Work for
        them and the collectives issued since `start_coalescing`."""
        batch = self._shared.pop("batch", None)
        if batch is None:
            raise ValueError("weft: end_coalescing without start_coalescing")
        self._coalescing(False)
        return self._issue_batch(batch)

    def _coalescing(self, on: bool) -> None:
        """Tell the C++ backend whether the group coalesces: meanwhile its
        ops go through the Python ops, which batch them."""
        for m in self._shared["members"]:
            if hasattr(m, "_set_coalescing"):
                m._set_coalescing(on)

    # -- monitored barrier -------------------------------------------------

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks that did not reach it within
        `timeout` (the group's if None): rank 0 hears from every other rank,
        then answers each. With `wait_all_ranks` rank 0 names every rank
        missing, else the first it finds."""
        if isinstance(timeout, (c10d.BarrierOptions,)):
            timeout = timeout.timeout
        secs = _seconds(timeout) or self._timeout
        n = self._shared.get("monitored", 0)
        self._shared["monitored"] = n + 1
        tag = _MONITORED_TAG + n % 0x1_0000
        me, world = self.rank(), self.size()
        if me != 0:
            token = torch.zeros(1, dtype=torch.uint8)
            self._monitored_p2p("send", token, 0, tag, secs)
            try:
                self._monitored_p2p("recv", token, 0, tag, secs).wait()
            except _errors.ERRORS as e:
                raise _errors.WeftError(
                    f"weft: monitored_barrier: rank {me} did not hear from rank 0 within {secs} s "
                    f"(a rank did not reach the barrier, or rank 0 failed): {e}",
                    "timeout",
                    0,
                    "monitored_barrier",
                    me,
                ) from e
            return
        tokens = [torch.zeros(1, dtype=torch.uint8) for _ in range(world)]
        recvs = {r: self._monitored_p2p("recv", tokens[r], r, tag, secs) for r in range(1, world)}
        missing = []
        for r, w in recvs.items():
            try:
                w.wait()
            except _errors.ERRORS:
                missing.append(r)
                if not wait_all_ranks:
                    break
        if missing:
            which = f"ranks {missing}" if len(missing) > 1 else f"rank {missing[0]}"
            raise _errors.WeftError(
                f"weft: monitored_barrier: {which} did not reach the barrier within {secs} s",
                "timeout",
                missing[0],
                "monitored_barrier",
                0,
            )
        for w in [self._monitored_p2p("send", tokens[r], r, tag, secs) for r in range(1, world)]:
            w.wait()

    def _monitored_p2p(self, kind: str, t: torch.Tensor, peer: int, tag: int, secs: float):
        """A send or receive of monitored_barrier's, bounded by `secs`."""
        s = Staged()
        desc = s.input(t) if kind == "send" else s.output(t)
        call = Call(s.keep, secs, None, False)
        return self._work(s, [getattr(self._native, kind)(desc, peer, tag, call)], [t], call)

    # -- new groups --------------------------------------------------------

    def _split_native(self, ranks) -> _weft.Group | None:
        """This rank's native sub-group of `ranks` (None if not a member);
        every rank of this group calls it, members and others alike."""
        ranks = [int(r) for r in ranks]
        return self._native.split(ranks if self.rank() in ranks else [])

    def split(self, store, ranks, opts=None):
        """torch's split (c10d's own ProcessGroup calls it per backend): a
        Backend of `ranks` for their members, None for the others."""
        sub = self._split_native(ranks)
        if sub is None:
            return None
        timeout = _seconds(getattr(opts, "_timeout", None)) or self._timeout
        return _wrap(sub, timeout, None)

    def shrink(self, ranks_to_exclude, shrink_flags: int = 0, opts_override=None):
        """torch's ``shrink_group``: a Backend of this group's ranks less
        `ranks_to_exclude`, made by every rank that stays (weft's shrink).
        With ``SHRINK_ABORT`` this rank's ops in flight fail first instead
        of being waited for. A rank found dead but not listed fails it on
        every survivor, naming that rank: the group never shrinks by more
        than asked."""
        excluded = sorted(int(r) for r in ranks_to_exclude)
        if shrink_flags & 0x01:  # torch's SHRINK_ABORT
            self._run_abort_hooks()
            self._native.revoke()
        sub, members = self._native.shrink(excluded)
        expected = [r for r in range(self.size()) if r not in excluded]
        if members != expected:
            gone = sorted(set(expected) - set(members))
            raise _errors.WeftError(
                f"weft: shrink: rank(s) {gone} did not take part (dead or hung) but are not in ranks_to_exclude {excluded}; "
                f"list every rank to leave out",
                "backend",
                gone[0] if gone else None,
                "shrink",
                self.rank(),
            )
        timeout = _seconds(getattr(opts_override, "_timeout", None)) or self._timeout
        return _wrap(sub, timeout, None)

    # -- windows -----------------------------------------------------------

    def new_window(self, tensor=None):
        """A one-sided window of this group (torch's ``Window``; see
        ``weft/_window.py``), with `tensor` registered if given (every rank
        calls it)."""
        win = Window(self)
        if tensor is not None:
            win.tensor_register(tensor)
        return win


class _Backend(_Common):
    """What both Backend classes hold: a weft group as a device's backend."""

    def __init__(self, rank: int, size: int, native: _weft.Group, timeout: float):
        super().__init__(rank, size)
        self._setup(native, timeout, {})

    def __repr__(self) -> str:
        return f"weft.Backend(rank {self.rank()} of {self.size()}, {self._native.backend_name()})"


class Backend(_Backend, dist._Backend):
    """weft as a device's backend of a torch group, on torch's Python
    backend API (where weft's C++ one cannot be built: see the module docs)."""


@functools.cache
def _cpp_backend_class():
    """weft's Backend over its C++ ``c10d::Backend`` (``weft/_c10d``), or
    None where that cannot be built here."""
    native = _c10d.load()
    if native is None:
        return None
    doc = "weft as a torch backend, over weft's C++ c10d::Backend (see the module docs)."
    return type("Backend", (_Backend, native.Backend), {"__doc__": doc, "__module__": __name__})


def _abort_callback(backend: weakref.ref):
    """What weft calls once `backend`'s group has aborted by itself (a
    timeout or a lost peer made it unusable): torch's abort hooks. Weakly,
    so the native group does not keep its backend alive."""

    def run() -> None:
        b = backend()
        if b is not None:
            b._run_abort_hooks()

    return run


def _backend(native: _weft.Group, timeout: float):
    """A Backend of `native` (kept alive with the module: see `_alive`)."""
    cls = _cpp_backend_class() or Backend
    backend = cls(native.rank, native.size, native, timeout)
    if hasattr(backend, "_bind_native"):
        backend._bind_native(native._torch_handle(), _weft.TORCH_API, timeout)
    native.set_abort_callback(_abort_callback(weakref.ref(backend)))
    _alive.append(backend)
    return backend


class ProcessGroup(_Common, dist.ProcessGroup):
    """weft as the whole process group (every device of the group), with
    its :class:`Backend` registered for each device."""

    def __init__(self, native: _weft.Group, backend: Backend, store=None):
        if store is not None:
            super().__init__(store, native.rank, native.size)
        else:
            super().__init__(native.rank, native.size)
        self._setup(native, backend._timeout, backend._shared)
        self._store = store
        self._name = ""
        self._desc = ""

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

    # torch calls these on the group with a device; the group and its
    # Backend share the batch.
    def _start_coalescing(self, device=None) -> None:
        self.start_coalescing()

    def _end_coalescing(self, device=None):
        return self.end_coalescing()

    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None, device_types=None):
        """torch's ``split_group`` on this group: a weft ProcessGroup of
        `ranks` (over weft's split of this group's native group) for its
        members, None for the other ranks, which call it too."""
        sub = self._split_native(ranks)
        if sub is None:
            return None
        served = [d.type for d in self._device_types]
        if device_types is not None:
            wanted = {torch.device(d).type for d in device_types}
            served = [d for d in served if d in wanted]
        store = None
        if self._store is not None and group_name is not None:
            store = dist.PrefixStore(f"{group_name}/", self._store)
        timeout = _timeout_seconds(timeout) if timeout is not None else self._timeout
        pg = _wrap(sub, timeout, served, store)
        if group_name is not None:
            pg.setGroupName(group_name)
        if group_desc is not None:
            pg.setGroupDesc(group_desc)
        return pg

    def __repr__(self) -> str:
        return f"weft.ProcessGroup(rank {self.rank()} of {self.size()}, {self._native.backend_name()})"
