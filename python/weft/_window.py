"""TorchComm's windows (``comm.new_window()``) on weft's one-sided windows.

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
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass

import torch

from . import _weft
from ._tensors import Staged
from ._work import Work, _seconds


class WindowAccessType(enum.Enum):
    """How a peer's registered memory is reached from this rank."""

    #: Mapped in this process: :meth:`Window.map_remote_tensor` works.
    UNIFIED = "unified"
    #: Reached by puts and gets only.
    SEPARATE = "separate"


@dataclass(frozen=True)
class WindowAttr:
    """What :meth:`Window.get_attr` says about a peer."""

    access_type: WindowAccessType


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
        self._comm = comm
        self._native = None
        self._tensor: torch.Tensor | None = None

    # -- registration ------------------------------------------------------

    def tensor_register(self, tensor: torch.Tensor) -> None:
        """Register ``tensor`` (collective: every rank registers one; sizes
        may differ). Its contents move into the window's memory and the
        tensor views that memory from now on."""
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

    def put(self, tensor: torch.Tensor, dst_rank: int, target_offset_nelems: int, async_op: bool, hints=None, timeout=None) -> Work:
        """Write ``tensor`` into rank ``dst_rank``'s registered tensor from
        element ``target_offset_nelems`` on (of the registered dtype). The
        Work finishes once ``tensor`` may be reused; the target sees the
        data after a later :meth:`signal`."""
        native = self._registered()
        s = Staged()
        op = self._comm._guard(native.put, s.input(tensor), dst_rank, self._offset(target_offset_nelems), s.keep, _seconds(timeout))
        return self._work(op, async_op)

    def get(self, tensor: torch.Tensor, src_rank: int, source_offset_nelems: int, async_op: bool, hints=None, timeout=None) -> Work:
        """Read rank ``src_rank``'s registered tensor from element
        ``source_offset_nelems`` into ``tensor`` (a weft extension)."""
        native = self._registered()
        s = Staged()
        out = s.output(tensor)
        op = self._comm._guard(native.get, out, src_rank, self._offset(source_offset_nelems), s.keep, _seconds(timeout))
        work = Work([op], [tensor], s.finish if s.needs_finish else None)
        if not async_op:
            work.wait()
        return work

    def signal(self, dst_rank: int, async_op: bool, hints=None, timeout=None) -> Work:
        """Tell ``dst_rank`` that this rank's earlier puts to it are done."""
        native = self._registered()
        self._on_stream()
        return self._work(self._comm._guard(native.signal, dst_rank, None, _seconds(timeout)), async_op)

    def wait_signal(self, peer_rank: int, async_op: bool, hints=None, timeout=None) -> Work:
        """Wait for a signal from ``peer_rank`` (one no earlier wait took);
        then its puts before the signal are in the registered tensor. The
        wait happens in this call (the GIL released) either way; the Work
        returned has finished."""
        native = self._registered()
        self._on_stream()
        self._comm._guard(native.wait_signal, peer_rank, 1, _seconds(timeout))
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
        """How ``peer_rank``'s memory is reached from this rank."""
        return WindowAttr(WindowAccessType(self._comm._guard(self._registered().access, peer_rank)))

    def __repr__(self) -> str:
        state = "unregistered" if self._native is None else f"{tuple(self._tensor.shape)} {self._tensor.dtype}"
        return f"weft.Window({self._comm.get_name()!r}, {state})"


__all__ = ["Window", "WindowAccessType", "WindowAttr"]
