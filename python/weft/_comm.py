"""`weft.new_comm`: TorchComm's communicator API on weft.

A program written for TorchComm runs on weft by importing ``weft`` where
it imported ``torchcomms``: the same ``new_comm`` arguments, the same op
methods with ``async_op``, per-call ``hints`` and ``timeout``, ``split``
and ``finalize``. Every op is weft's own (reduce_scatter, all_gather_v,
reduce_scatter_v and all_to_all_v_single included, none emulated); tensors
are staged as for the torch.distributed backend (`_tensors.py`) and ops
return the same Work (`_work.py`).
"""

from __future__ import annotations

import itertools
import operator
import os
import sys

import torch

from . import _bootstrap, _errors, _weft
from ._ops import Call, Ops, reduce_name, split_elements
from ._tensors import Staged, capturing
from ._window import Window
from ._work import Work, _positive_seconds, _seconds

ENV_ABORT = "WEFT_ABORT_ON_ERROR"
ENV_TIMEOUT = "WEFT_TIMEOUT_SECONDS"
# TorchComm's names of the same settings, read when weft's are unset.
_TORCHCOMM_ENV = {ENV_ABORT: "TORCHCOMM_ABORT_ON_ERROR", ENV_TIMEOUT: "TORCHCOMM_TIMEOUT_SECONDS"}

# Names for communicators made without one, in creation order (the same on
# every rank when they create their communicators in the same order).
_unnamed = itertools.count()

# Kinds of error from the communication itself, which end the process with
# abort_process_on_timeout_or_error. Bad arguments and unsupported
# requests (refused before anything moved) raise either way.
_FATAL_KINDS = frozenset({"timeout", "peer_lost", "backend", "store", "aborted"})


def _env(name: str) -> str | None:
    """weft's variable `name`, else TorchComm's of the same meaning."""
    return os.environ.get(name) or os.environ.get(_TORCHCOMM_ENV[name])


def _abort_default() -> bool:
    """``WEFT_ABORT_ON_ERROR`` (else ``TORCHCOMM_ABORT_ON_ERROR``): true
    unless set to 0, false, no or off."""
    value = (_env(ENV_ABORT) or "true").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"weft: {ENV_ABORT}={value!r} is not a boolean (true/false, 1/0, yes/no, on/off)")


def _default_timeout() -> float:
    """``WEFT_TIMEOUT_SECONDS`` (else ``TORCHCOMM_TIMEOUT_SECONDS``), else
    weft's default (600 s)."""
    value = (_env(ENV_TIMEOUT) or "").strip()
    if not value:
        return float(_weft.TIMEOUT_DEFAULT)
    return _weft.parse_timeout(value)


def _hints(hints) -> dict[str, str] | None:
    """Per-op hints as weft takes them (strings); weft ignores keys it does
    not know."""
    return {str(k): str(v) for k, v in hints.items()} if hints else None


def _fatal(e: BaseException) -> bool:
    """Whether `e` is a failure of the communication (not of the call)."""
    return getattr(e, "kind", None) in _FATAL_KINDS


class _Finalized:
    """Stands in for the native group once the communicator is finalized."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        """Any use of the group: an error saying it was finalized."""
        raise _errors.WeftError(f"weft: communicator {self._name!r} was finalized", "aborted")


def new_comm(
    backend: str,
    device,
    *,
    store=None,
    timeout=None,
    hints: dict[str, str] | None = None,
    name: str | None = None,
    abort_process_on_timeout_or_error: bool | None = None,
) -> Comm:
    """Create a communicator of every rank of the job (collective).

    - ``backend``: weft's backend, ``"weft"`` (= ``auto``: shared memory on
      one host, TCP across hosts), ``"shm"``, ``"cpu-tcp"``,
      ``"hierarchical"``, ``"cpu:NAME,cuda:NAME"``, or a plugin's name.
    - ``device``: the communicator's device (``torch.device`` or a string);
      tensors go to the weft backend serving their own device.
    - ``store``: a torch.distributed Store to meet through; without one,
      the launcher's (torchrun, Slurm, Open MPI, ``weft run``) at
      ``MASTER_ADDR:MASTER_PORT``. Rank and size come from the launcher's
      environment either way.
    - ``timeout`` (timedelta or seconds): every op's default and setup's
      limit; default ``WEFT_TIMEOUT_SECONDS`` (or TorchComm's
      ``TORCHCOMM_TIMEOUT_SECONDS``), else 600 s.
    - ``hints``: weft's group hints (keys weft does not know are ignored).
    - ``name``: keeps this communicator's keys apart on the store (default
      ``comm0``, ``comm1``... in creation order).
    - ``abort_process_on_timeout_or_error``: end the process (``abort()``)
      when an op fails or times out, instead of raising (bad arguments
      and unsupported requests still raise); default
      ``WEFT_ABORT_ON_ERROR`` (or ``TORCHCOMM_ABORT_ON_ERROR``), else
      true, as TorchComm's.
    """
    abort = _abort_default() if abort_process_on_timeout_or_error is None else bool(abort_process_on_timeout_or_error)
    secs = _default_timeout() if timeout is None else _positive_seconds(timeout)
    name = f"comm{next(_unnamed)}" if name is None else str(name)
    if store is None:
        store, rank, size = _bootstrap.store_from_env(secs)
    else:
        rank, size = _bootstrap.rank_and_size()
    spec = "auto" if backend == "weft" else backend
    native = _weft.Group(store, rank, size, spec, secs, _hints(hints), name)
    return Comm(native, backend=backend, device=torch.device(device), name=name, timeout=secs, abort=abort, store=store)


class Comm:
    """A communicator (TorchComm's ``TorchComm``); made by :func:`new_comm`
    or :meth:`split`.

    Every op takes ``async_op`` (False: it has finished when the call
    returns; True: it runs in weft's threads and the returned Work says
    when), and optional ``hints`` (``{"algorithm": "ring",
    "segment_bytes": "65536"}``; keys weft does not know are ignored) and
    ``timeout`` (timedelta or seconds; bounds this op). Each returns a
    Work with ``wait()`` and ``is_completed()``. Split sizes count rows
    of dim 0, as torch's.
    """

    def __init__(self, native, *, backend: str, device: torch.device, name: str, timeout: float, abort: bool, store):
        self._native = native
        self._backend = backend
        self._device = device
        self._name = name
        self._timeout = timeout
        self._abort = abort
        # Rank 0 may host the store: it lives as long as the communicator.
        self._store = store
        self._inflight: list[Work] = []
        self._splits = itertools.count()

    # -- the communicator --------------------------------------------------

    def get_rank(self) -> int:
        """This rank in the communicator."""
        return self._native.rank

    def get_size(self) -> int:
        """Number of ranks in the communicator."""
        return self._native.size

    def get_name(self) -> str:
        """The communicator's name."""
        return self._name

    def get_device(self) -> torch.device:
        """The device the communicator was made for."""
        return self._device

    def get_backend(self) -> str:
        """The backend name it was made with."""
        return self._backend

    def split(self, ranks, name: str | None = None) -> Comm | None:
        """This rank's sub-communicator (collective: every rank calls it,
        each with the ranks of the sub-communicator it joins, in its rank
        order; the same list on every member). An empty list joins none and
        returns None; a list without this rank raises ``ValueError``.
        ``name`` (a weft extension) names the sub-communicator; by default
        it is ``<this name>.split<N>``."""
        number = next(self._splits)
        try:
            ranks = [operator.index(r) for r in ranks]
        except TypeError:
            self._native.split([])  # the split still counts, as on the others
            raise
        sub = self._guard(self._native.split, ranks)
        if sub is None:
            return None
        name = name or f"{self._name}.split{number}"
        return Comm(sub, backend=self._backend, device=self._device, name=name, timeout=self._timeout, abort=self._abort, store=self._store)

    def new_window(self) -> Window:
        """A window for one-sided puts (TorchComm's ``new_window``): register
        a tensor with :meth:`Window.tensor_register` (collective) to use it."""
        return Window(self)

    def finalize(self) -> None:
        """Shut the communicator down (collective): wait for this rank's
        unfinished ops, meet every rank, release the group. Raises the
        first error no ``wait`` raised (or aborts the process, with
        ``abort_process_on_timeout_or_error``); any later use raises.
        Finalizing again does nothing."""
        native = self._native
        if isinstance(native, _Finalized):
            return
        unreported = []
        for w in self._inflight:
            seen = w._reported
            try:
                w.wait()
            except Exception as e:  # noqa: BLE001 - reported below
                if not seen:
                    unreported.append(e)
        if not unreported:
            try:
                native.barrier(([], self._timeout, None, True))
            except _errors.ERRORS as e:
                unreported.append(e)
        self._native = _Finalized(self._name)
        self._inflight = []
        self._store = None
        del native  # the group shuts down here (nothing else holds it)
        if unreported:
            self._failed(unreported[0])
            raise unreported[0]

    def __repr__(self) -> str:
        state = "finalized" if isinstance(self._native, _Finalized) else f"rank {self.get_rank()} of {self.get_size()}"
        return f"weft.Comm({self._name!r}, {self._backend}, {state})"

    # -- issuing -----------------------------------------------------------

    def _failed(self, e: BaseException) -> None:
        """An op failed or timed out: with abort_process_on_timeout_or_error,
        end the process (TorchComm's behaviour); else the caller raises."""
        if not self._abort or not _fatal(e):
            return
        sys.stderr.write(f"weft: communicator {self._name!r}: {e}\nweft: aborting the process (abort_process_on_timeout_or_error)\n")
        sys.stderr.flush()
        os.abort()

    def _guard(self, fn, *args):
        """Call the native group; its errors go through `_failed` first."""
        try:
            return fn(*args)
        except _errors.ERRORS as e:
            self._failed(e)
            raise

    def _issue(self, s: Staged, outputs, async_op, hints, timeout, fn, *args, p2p: bool = False) -> Work:
        """Run `fn(*args, call)` (a native op); the Work.

        A synchronous collective runs on this thread; sends and receives
        run in the background (a synchronous one is waited for), so their
        progress never depends on the order peers issue them. While a CUDA
        graph is being captured, every op runs on this thread (see
        `capturing`; sends and receives only if theirs is a CUDA tensor)."""
        direct = (not async_op and not p2p) or capturing(outputs if p2p else None)
        call = Call(s.keep, _seconds(timeout), _hints(hints), direct)
        native = self._guard(fn, *args, call)
        w = Ops._work_of(s, [native], outputs, call, self._failed if self._abort else None)
        if direct:
            return w
        if len(self._inflight) >= 64:
            # Keep what finalize must still wait for or report.
            self._inflight = [x for x in self._inflight if not x.is_completed() or (x._error is not None and not x._reported)]
        self._inflight.append(w)
        if not async_op:
            w.wait()
        return w

    # -- point to point ----------------------------------------------------

    def send(self, tensor, dst: int, async_op: bool, hints=None, timeout=None) -> Work:
        """Send ``tensor`` to rank ``dst``."""
        s = Staged()
        return self._issue(s, [tensor], async_op, hints, timeout, self._native.send, s.input(tensor), dst, 0, p2p=True)

    def recv(self, tensor, src: int, async_op: bool, hints=None, timeout=None) -> Work:
        """Receive into ``tensor`` from rank ``src``."""
        s = Staged()
        return self._issue(s, [tensor], async_op, hints, timeout, self._native.recv, s.output(tensor), src, 0, p2p=True)

    # -- collectives -------------------------------------------------------

    def broadcast(self, tensor, root: int, async_op: bool, hints=None, timeout=None) -> Work:
        """Copy rank ``root``'s ``tensor`` into every rank's."""
        s = Staged()
        return self._issue(s, [tensor], async_op, hints, timeout, self._native.broadcast, s.output(tensor), root)

    def all_reduce(self, tensor, op, async_op: bool, hints=None, timeout=None) -> Work:
        """Reduce every rank's ``tensor`` with ``op`` into every rank's."""
        s = Staged()
        return self._issue(s, [tensor], async_op, hints, timeout, self._native.all_reduce, s.output(tensor), reduce_name(op))

    def reduce(self, tensor, root: int, op, async_op: bool, hints=None, timeout=None) -> Work:
        """Reduce every rank's ``tensor`` with ``op`` into rank ``root``'s."""
        s = Staged()
        return self._issue(s, [tensor], async_op, hints, timeout, self._native.reduce, s.output(tensor), root, reduce_name(op))

    def all_gather(self, tensor_list, tensor, async_op: bool, hints=None, timeout=None) -> Work:
        """``tensor_list[i]`` receives rank i's ``tensor`` (equal sizes)."""
        return self._all_gather(tensor_list, tensor, async_op, hints, timeout, uneven=False)

    def all_gather_v(self, tensor_list, tensor, async_op: bool, hints=None, timeout=None) -> Work:
        """``tensor_list[i]`` receives rank i's ``tensor``, whose size may
        differ from rank to rank."""
        return self._all_gather(tensor_list, tensor, async_op, hints, timeout, uneven=True)

    def _all_gather(self, tensor_list, tensor, async_op, hints, timeout, uneven):
        s = Staged()
        outs = list(tensor_list)
        return self._issue(s, outs, async_op, hints, timeout, self._native.all_gather, s.outputs(outs), s.input(tensor), uneven)

    def all_gather_single(self, output, input, async_op: bool, hints=None, timeout=None) -> Work:
        """Rank i's ``input`` lands in the i-th of W equal parts of ``output``."""
        s = Staged()
        return self._issue(s, [output], async_op, hints, timeout, self._native.all_gather_single, s.output(output), s.input(input))

    def reduce_scatter(self, output, input_list, op, async_op: bool, hints=None, timeout=None) -> Work:
        """``output`` becomes the reduction over ranks of their
        ``input_list[rank]`` (equal sizes)."""
        return self._reduce_scatter(output, input_list, op, async_op, hints, timeout, uneven=False)

    def reduce_scatter_v(self, output, input_list, op, async_op: bool, hints=None, timeout=None) -> Work:
        """As :meth:`reduce_scatter`, with sizes that may differ per rank
        (``input_list[i]`` matches rank i's ``output``)."""
        return self._reduce_scatter(output, input_list, op, async_op, hints, timeout, uneven=True)

    def _reduce_scatter(self, output, input_list, op, async_op, hints, timeout, uneven):
        s = Staged()
        fn = self._native.reduce_scatter
        return self._issue(s, [output], async_op, hints, timeout, fn, s.output(output), s.inputs(input_list), reduce_name(op), uneven)

    def reduce_scatter_single(self, output, input, op, async_op: bool, hints=None, timeout=None) -> Work:
        """The i-th of W equal parts of every rank's ``input``, reduced into
        rank i's ``output``."""
        s = Staged()
        fn = self._native.reduce_scatter_single
        return self._issue(s, [output], async_op, hints, timeout, fn, s.output(output), s.input(input), reduce_name(op))

    def all_to_all(self, output_tensor_list, input_tensor_list, async_op: bool, hints=None, timeout=None) -> Work:
        """``output_tensor_list[i]`` receives rank i's ``input_tensor_list[rank]``."""
        s = Staged()
        outs = list(output_tensor_list)
        return self._issue(s, outs, async_op, hints, timeout, self._native.all_to_all, s.outputs(outs), s.inputs(input_tensor_list))

    def all_to_all_single(self, output, input, async_op: bool, hints=None, timeout=None) -> Work:
        """Part i of ``input`` goes to rank i; part i of ``output`` comes
        from rank i (W equal parts)."""
        s = Staged()
        fn = self._native.all_to_all_single
        return self._issue(s, [output], async_op, hints, timeout, fn, s.output(output), s.input(input), None, None)

    def all_to_all_v_single(
        self, output, input, output_split_sizes, input_split_sizes, async_op: bool, hints=None, timeout=None
    ) -> Work:
        """As :meth:`all_to_all_single`, with the parts' sizes given (rows of
        dim 0): ``input_split_sizes[i]`` go to rank i, ``output_split_sizes[i]``
        come from rank i."""
        s = Staged()
        outs, ins = split_elements(output, input, output_split_sizes, input_split_sizes, self.get_size())
        fn = self._native.all_to_all_single
        return self._issue(s, [output], async_op, hints, timeout, fn, s.output(output), s.input(input), outs, ins)

    def barrier(self, async_op: bool, hints=None, timeout=None) -> Work:
        """Every rank has entered it (after its earlier ops)."""
        return self._issue(Staged(), [], async_op, hints, timeout, self._native.barrier)

    def scatter(self, output_tensor, input_tensor_list, root: int, async_op: bool, hints=None, timeout=None) -> Work:
        """Every rank's ``output_tensor`` receives rank ``root``'s
        ``input_tensor_list[rank]`` (the list is read at the root only)."""
        s = Staged()
        ins = s.inputs(input_tensor_list) if self.get_rank() == root else []
        return self._issue(s, [output_tensor], async_op, hints, timeout, self._native.scatter, s.output(output_tensor), ins, root)

    def gather(self, output_tensor_list, input_tensor, root: int, async_op: bool, hints=None, timeout=None) -> Work:
        """At rank ``root``, ``output_tensor_list[i]`` receives rank i's
        ``input_tensor`` (the list is written at the root only)."""
        s = Staged()
        outs = list(output_tensor_list) if self.get_rank() == root else []
        return self._issue(s, outs, async_op, hints, timeout, self._native.gather, s.outputs(outs), s.input(input_tensor), root)


__all__ = ["Comm", "new_comm"]
