"""The Work torch sees for a weft op.

An op runs in weft's threads and never needs the GIL to progress. Python
learns that it finished by waiting (the GIL released), by asking
(`is_completed`), or, for futures and outputs that must be copied back,
through one daemon thread per process that blocks in weft until any
watched op finishes and then completes it on the Python side.
"""

from __future__ import annotations

import datetime
import math
import threading
from typing import Callable

import torch
import torch.distributed as dist

from . import _errors, _weft


class _Completer:
    """Finishes watched works on the Python side as their ops finish."""

    def __init__(self):
        self._lock = threading.Lock()
        self._works: dict[int, Work] = {}
        self._next = 0
        self._thread: threading.Thread | None = None

    def watch(self, work: Work) -> None:
        with self._lock:
            wid = self._next
            self._next += 1
            self._works[wid] = work
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="weft-completer", daemon=True)
                self._thread.start()
        for native in work._natives:
            native.notify(wid)

    def _run(self) -> None:
        while True:
            wid = _weft.next_completed(1.0)
            if wid is not None:
                self._finish(wid)

    def _finish(self, wid: int) -> None:
        """One of work `wid`'s ops finished: settle it if all have (also
        called by ops that are not native: a window's async wait)."""
        with self._lock:
            work = self._works.get(wid)
        if work is not None and work._all_done():
            with self._lock:
                self._works.pop(wid, None)
            work._settle()


_completer = _Completer()

# Guards every Work's settling and future (short, and rare next to ops:
# one lock for all instead of one made per op).
_settle_lock = threading.Lock()

_torch_work_init = dist._Work.__init__


def _seconds(timeout) -> float | None:
    """A c10d timeout (timedelta, seconds, or negative/None for unset).
    NaN passes, for weft to refuse with the other values that are not a
    number of seconds."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    return timeout if timeout > 0 or timeout != timeout else None


def _positive_seconds(timeout) -> float:
    """A timeout that must be given (`set_timeout`, `new_comm`): a positive,
    finite number of seconds or a timedelta of one, else `ValueError`."""
    secs = _seconds(timeout)
    if secs is None or not math.isfinite(secs):
        raise ValueError(f"weft: a timeout must be a positive number of seconds, not {timeout!r}")
    return secs


class Work(dist._Work):
    """One weft op (or several issued as one), as a torch.distributed Work.

    `wait(timeout)` blocks without the GIL and raises weft's error as a
    torch exception; `is_completed`, `exception`, `get_future` (whose value
    is the op's output tensors), `source_rank` (a receive from any rank)
    behave as on torch's own backends.
    """

    # Defaults as class attributes: a Work is made per op, and each
    # attribute set on a torch Work costs (a direct op's sets two).
    _settled = False
    _error: Exception | None = None
    _future: torch.futures.Future | None = None
    _finish_fn: Callable[[], None] | None = None
    _result_fn: Callable[[], list] | None = None
    #: Called with the error once a failed op settles (a communicator that
    #: aborts the process on errors sets it).
    _on_error: Callable[[Exception], None] | None = None
    #: Whether `wait` has raised the op's error to somebody.
    _reported = False

    def __init__(
        self,
        natives,
        outputs,
        finish: Callable[[], None] | None = None,
        result=None,
        done: bool = False,
        on_error: Callable[[Exception], None] | None = None,
    ):
        _torch_work_init(self)
        self._natives = natives
        self._outputs = outputs
        if result is not None:
            self._result_fn = result
        if done:
            # It ran directly on this thread and succeeded (a failure was
            # raised by the call): settled already, outputs copied back,
            # after torch's current stream is ordered after a CUDA op's
            # device side (which may still run on weft's stream).
            if finish is not None:
                for n in natives:
                    n.wait()
                finish()
            self._settled = True
            return
        if on_error is not None:
            self._on_error = on_error
        if finish is not None or on_error is not None:
            # Outputs staged through copies are copied back even if nobody
            # waits, as torch's gloo backend does, and a failure is seen by
            # `on_error` even if nobody waits: now if the op has finished,
            # else once it does.
            self._finish_fn = finish
            if self._all_done():
                self._settle()
            else:
                _completer.watch(self)

    def _rebind(self, natives, outputs, finish: Callable[[], None] | None) -> None:
        """Make this Work (handed out before its ops were issued: a
        coalesced batch's) the Work of `natives`."""
        with _settle_lock:
            self._natives, self._outputs, self._settled = natives, outputs, False
        self._finish_fn = finish
        if self._all_done():
            self._settle()
        elif finish is not None or self._future is not None:
            _completer.watch(self)

    def _all_done(self) -> bool:
        return all(n.is_completed() for n in self._natives)

    def _settle(self) -> None:
        """Once every op has finished: copy outputs back (on success), then
        complete the future. Runs once, on whichever thread gets here first;
        `_settled` turns True after the copies."""
        with _settle_lock:
            if self._settled:
                return
            for n in self._natives:
                e = n.exception()
                if e is not None:
                    self._error = e
                    break
            if self._error is None and self._finish_fn is not None:
                try:
                    self._finish_fn()
                except Exception as e:  # noqa: BLE001 - reported through the work
                    self._error = e
            self._settled = True
            fut = self._future
        if self._error is not None and self._on_error is not None:
            self._on_error(self._error)
        if fut is not None:
            self._complete_future(fut)

    def _complete_future(self, fut) -> None:
        if fut.done():
            return
        if self._error is not None:
            fut.set_exception(self._error)
        else:
            fut.set_result(self.result())

    def wait(self, timeout=None) -> bool:
        """Block until the op has finished; raise its error. With a timeout
        (timedelta or seconds) that passes first, raise a timeout error (the
        op keeps running)."""
        if self._settled:
            # Finished: a CUDA op's wait still orders torch's current stream
            # after it (nothing to do for CPU tensors).
            if self._error is None:
                for n in self._natives:
                    n.wait()
        else:
            secs = _seconds(timeout)
            for n in self._natives:
                try:
                    done = n.wait(secs)
                except _errors.ERRORS:
                    done = True  # _settle takes the op's error
                if not done:
                    raise _errors.WeftTimeoutError(f"weft: the op did not finish within {secs} s (it keeps running)", "timeout")
            self._settle()
        if self._error is not None:
            self._reported = True
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether the op has finished (successfully or not)."""
        if not self._settled and self._all_done():
            self._settle()
        return self._settled

    def is_success(self) -> bool:
        """Whether the op has finished without an error."""
        return self.is_completed() and self._error is None

    def exception(self):
        """The op's error, once it has failed; else None."""
        self.is_completed()
        return self._error

    def result(self):
        """The op's output tensors."""
        return self._result_fn() if self._result_fn is not None else self._outputs

    def get_future(self) -> torch.futures.Future:
        """A future completed with the op's output tensors (or its error)."""
        with _settle_lock:
            if self._future is None:
                self._future = torch.futures.Future()
                settled = self._settled
                watch = not settled and self._finish_fn is None
            else:
                return self._future
        if settled:
            self._complete_future(self._future)
        elif self._all_done():
            self._settle()
        elif watch:
            _completer.watch(self)
        return self._future

    def synchronize(self) -> None:
        """Block the host until the op has finished, the device side of a
        CUDA op included (``wait()`` only makes torch's current stream wait)."""
        for n in self._natives:
            try:
                n.synchronize()
            except _errors.ERRORS:
                pass  # wait raises it
        self.wait()

    def _get_duration(self) -> float:
        """Milliseconds from the op's issue to the end of its host side (the
        slowest, for several ops issued as one; a CUDA op's device side may
        end later). Raises until the op has finished, as torch's backends do."""
        if not self.is_completed():
            raise RuntimeError("weft: an op's duration is known once it has finished")
        return max((d for d in (n.duration() for n in self._natives) if d is not None), default=0.0)

    def block_current_stream(self) -> None:
        """Make torch's current stream wait for the op (what ``wait()``
        does for a CUDA op; for host tensors it waits on the host)."""
        self.wait()

    def source_rank(self) -> int:
        """For a receive from any rank: the rank the message came from."""
        self.wait()
        src = self._natives[0].source()
        if src is None:
            raise RuntimeError("weft: source_rank is only known for a receive from any rank")
        return src

    _source_rank = source_rank

    def __repr__(self) -> str:
        return f"weft.Work(completed={self.is_completed()})"

