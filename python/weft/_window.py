"""One-sided windows on weft's: TorchComm's (``comm.new_window()``) and
torch.distributed's (``pg.new_window()`` on a weft group), one class for
both.

A window registers one tensor per rank, collectively
(:meth:`Window.tensor_register`). Peers then :meth:`~Window.put` into it
without the target calling anything, and :meth:`~Window.signal` it; once
the target's :meth:`~Window.wait_signal` returns, the data of every put the
origin issued before its signal is in the target's tensor. Offsets count
elements of the registered tensor's dtype, as TorchComm's
``target_offset_nelems``.

weft owns the registered memory (shared memory on ``shm``, where
:meth:`~Window.map_remote_tensor` views a peer's tensor directly; device
memory every rank maps through CUDA IPC on ``cuda-device``): on
registration the tensor's contents move there and the tensor itself is
re-pointed at it (``Tensor.set_``), so puts land in the very tensor the
caller holds. Other views of its old storage do not follow. On
:meth:`~Window.tensor_deregister` the tensor gets private storage again,
with the window's last contents.

A CUDA tensor registers a device window: puts and gets are device copies
ordered on torch's current stream, a signal is ordered after the work
queued on it, and once ``wait_signal`` returns, work queued on the current
stream sees the origin's puts. Every call raises the torch.distributed
exception types of ``weft._errors``.

torch's option objects (``PutOptions``, ``SignalOptions``,
``WaitSignalOptions``) are taken where torch passes them, after
``async_op``: their ``timeout`` bounds the call (unset: the group's), and
their hints (or ``hints=``) go to weft, which applies the keys it knows
and ignores the others, as for every op. ``tensor_register``'s ``owning``
changes nothing on weft: the window's memory is weft's own either way, and
the registered tensor views it until deregistration.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from . import _weft
from ._tensors import Staged
from ._work import Work, _seconds

_c10d = torch._C._distributed_c10d


def _settings(opts, timeout, hints) -> tuple:
    """A call's `(timeout in seconds, hints)` for weft: TorchComm's
    keywords, else those of torch's option object `opts` (unset timeout:
    the group's). weft applies the hint keys it knows, as for every op."""
    if opts is not None:
        timeout = getattr(opts, "timeout", None) if timeout is None else timeout
        hints = getattr(opts, "hints", None) if hints is None else hints
    return _seconds(timeout), (dict(hints) if hints else None)


class _Waiting:
    """A window's `wait_signal` running on a thread of its own, as the
    native op a Work watches (`is_completed`, `wait`, `exception`)."""

    def __init__(self, fn, *args):
        self._error = None
        self._done = threading.Event()
        self._notify = None
        self._lock = threading.Lock()
        threading.Thread(target=self._run, args=(fn, args), name="weft-wait-signal", daemon=True).start()

    def _run(self, fn, args):
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - reported through the work
            self._error = e
        with self._lock:
            self._done.set()
            notify = self._notify
        if notify is not None:
            notify()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout=None) -> bool:
        if not self._done.wait(timeout):
            return False
        if self._error is not None:
            raise self._error
        return True

    def exception(self):
        return self._error

    def synchronize(self) -> None:
        self.wait()

    def source(self):
        return None

    def notify(self, wid: int) -> None:
        from ._work import _completer

        with self._lock:
            if not self._done.is_set():
                self._notify = lambda: _completer._finish(wid)
                return
        _completer._finish(wid)


#: How a peer's registered memory is reached from this rank: torch's
#: enum, ``UNIFIED`` (mapped in this process: :meth:`Window.map_remote_tensor`
#: works) or ``SEPARATE`` (reached by puts and gets only).
WindowAccessType = _c10d.WindowAccessType

#: What :meth:`Window.get_attr` says about a peer (torch's type):
#: ``access_type``.
WindowAttr = _c10d.WindowAttr

_ACCESS = {"unified": WindowAccessType.UNIFIED, "separate": WindowAccessType.SEPARATE}


def _attr(access: str) -> WindowAttr:
    a = WindowAttr()
    a.access_type = _ACCESS[access]
    return a


class _DeviceBytes:
    """Device memory weft owns, as ``__cuda_array_interface__`` bytes for
    ``torch.as_tensor``; the tensor keeps this object (and so `owner`)."""

    def __init__(self, owner, addr: int, nbytes: int):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (addr, False),
            # Version 2: no stream to synchronize with (weft orders its
            # copies on the caller's stream itself).
            "version": 2,
        }


def _memory(native, address: tuple[int, int], dtype: torch.dtype, shape, device: torch.device) -> torch.Tensor:
    """A tensor on `device` over registered memory at `address` (address,
    bytes); it keeps `native` (and so the memory) alive."""
    addr, nbytes = address
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    if device.type == "cuda":
        raw = torch.as_tensor(_DeviceBytes(native, addr, nbytes), device=device)
    else:
        buf = (ctypes.c_uint8 * nbytes).from_address(addr)
        buf.owner = native
        raw = torch.frombuffer(buf, dtype=torch.uint8)
    return raw.view(dtype).view(shape)


class Window:
    """A window of a communicator (TorchComm's ``TorchCommWindow``); made by
    :meth:`weft.Comm.new_window`, used once a tensor is registered."""

    def __init__(self, comm):
        # `comm`: a weft.Comm or a weft torch group (its `_native` group
        # and `_guard`, which calls a native method).
        self._comm = comm
        self._native = None
        self._tensor: torch.Tensor | None = None

    # -- registration ------------------------------------------------------

    def tensor_register(self, tensor: torch.Tensor, owning: bool = True) -> None:
        """Register ``tensor`` (collective: every rank registers one; sizes
        may differ). Its contents move into the window's memory and the
        tensor views that memory from now on (so ``owning`` changes
        nothing)."""
        if self._native is not None:
            raise ValueError("weft: this window already has a registered tensor")
        if not isinstance(tensor, torch.Tensor) or not (tensor.is_cpu or tensor.is_cuda):
            raise ValueError("weft: windows hold host or cuda tensors")
        s = Staged()
        native = self._comm._guard(self._comm._native.new_window, s.input(tensor))
        view = _memory(native, native.local_address(), tensor.dtype, tensor.shape, tensor.device)
        with torch.no_grad():
            tensor.set_(view)
        self._native, self._tensor = native, tensor

    def tensor_deregister(self) -> None:
        """End the window (collective: returns once every rank has stopped
        using it). The registered tensor keeps the window's last contents,
        in storage of its own."""
        native = self._registered()
        self._on_stream()
        self._comm._guard(native.deregister)
        tensor = self._tensor
        with torch.no_grad():
            tensor.set_(tensor.clone())
        self._native = self._tensor = None

    def _registered(self):
        if self._native is None:
            raise ValueError("weft: no tensor is registered with this window")
        return self._native

    def _on_stream(self) -> None:
        """Order a device window's next call on torch's current stream (ops
        with a tensor do this as they describe it)."""
        if self._tensor.is_cuda:
            _weft.set_current_stream(torch.cuda.current_stream(self._tensor.device).cuda_stream)

    def _offset(self, nelems: int) -> int:
        if nelems < 0:
            raise ValueError(f"weft: offset {nelems} is negative")
        return nelems * self._tensor.element_size()

    # -- one-sided ops -----------------------------------------------------

    def put(self, tensor: torch.Tensor, dst_rank: int, target_offset_nelems: int, async_op: bool, opts=None, hints=None, timeout=None) -> Work:
        """Write ``tensor`` into rank ``dst_rank``'s registered tensor from
        element ``target_offset_nelems`` on (of the registered dtype). The
        Work finishes once ``tensor`` may be reused; the target sees the
        data after a later :meth:`signal`. A put past the end of the
        target's tensor is refused (``ValueError``)."""
        native = self._registered()
        s = Staged()
        offset = self._offset(target_offset_nelems)
        op = self._comm._guard(native.put, s.input(tensor), dst_rank, offset, s.keep, *_settings(opts, timeout, hints))
        return self._work(op, async_op)

    def get(self, tensor: torch.Tensor, src_rank: int, source_offset_nelems: int, async_op: bool, opts=None, hints=None, timeout=None) -> Work:
        """Read rank ``src_rank``'s registered tensor from element
        ``source_offset_nelems`` into ``tensor`` (a weft extension)."""
        native = self._registered()
        s = Staged()
        out = s.output(tensor)
        offset = self._offset(source_offset_nelems)
        op = self._comm._guard(native.get, out, src_rank, offset, s.keep, *_settings(opts, timeout, hints))
        work = Work([op], [tensor], s.finish if s.needs_finish else None)
        if not async_op:
            work.wait()
        return work

    def signal(self, dst_rank: int, async_op: bool, opts=None, hints=None, timeout=None) -> Work:
        """Tell ``dst_rank`` that this rank's earlier puts to it are done."""
        native = self._registered()
        self._on_stream()
        op = self._comm._guard(native.signal, dst_rank, None, *_settings(opts, timeout, hints))
        return self._work(op, async_op)

    def wait_signal(self, peer_rank: int, async_op: bool, opts=None, hints=None, timeout=None) -> Work:
        """Wait for a signal from ``peer_rank`` (one no earlier wait took);
        then its puts before the signal are in the registered tensor.
        Synchronous, the call waits (the GIL released); with ``async_op``
        it returns at once and its Work completes once the signal has
        arrived (wait on it before reading the data)."""
        native = self._registered()
        self._on_stream()
        settings = _settings(opts, timeout, hints)
        if async_op:
            return Work([_Waiting(self._comm._guard, native.wait_signal, peer_rank, 1, *settings)], [])
        self._comm._guard(native.wait_signal, peer_rank, 1, *settings)
        return Work([], [], done=True)

    def _work(self, op, async_op: bool) -> Work:
        work = Work([op], [])
        if not async_op:
            work.wait()
        return work

    # -- memory ------------------------------------------------------------

    def map_remote_tensor(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s registered memory as a flat tensor of the
        registered dtype, viewed directly (no copy) where this process maps
        it (``get_attr(rank)`` is UNIFIED: on shm and cuda-device, and this
        rank's own);
        raises where it is not. It stays valid after deregistration, and
        holds the memory until dropped."""
        native = self._registered()
        address = self._comm._guard(native.remote_address, rank)
        n = address[1] // self._tensor.element_size()
        return _memory(native, address, self._tensor.dtype, (n,), self._tensor.device)

    def get_attr(self, peer_rank: int) -> WindowAttr:
        """How ``peer_rank``'s memory is reached from this rank
        (``access_type`` is torch's ``WindowAccessType`` too: see
        :class:`WindowAttr`)."""
        return _attr(self._comm._guard(self._registered().access, peer_rank))

    def __repr__(self) -> str:
        state = "unregistered" if self._native is None else f"{tuple(self._tensor.shape)} {self._tensor.dtype}"
        return f"weft.Window({self._comm!r}, {state})"


__all__ = ["Window", "WindowAccessType", "WindowAttr"]
