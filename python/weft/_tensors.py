"""Torch tensors as weft sees them: pointer, element count, dtype, device.

Contiguous tensors cross without a copy. A non-contiguous one (or one of
several views of the same memory) goes through a contiguous copy, and an
output is copied back once the op has finished, as torch's gloo backend
does.
"""

from __future__ import annotations

import torch

from . import _weft

# weft's dtype codes (core/src/dtype.rs).
_CODES = {
    torch.float32: 0,
    torch.float64: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int8: 4,
    torch.uint8: 5,
    torch.int32: 6,
    torch.int64: 7,
    torch.uint32: 8,
    torch.uint64: 9,
    torch.bool: 10,
}

_STRIDED = torch.strided


def desc(t: torch.Tensor) -> tuple:
    """`(data_ptr, numel, dtype code, device)` of a contiguous dense tensor.

    A CUDA tensor also makes torch's current stream on its device the one
    weft orders the op after (and makes wait for it in `Work.wait()`)."""
    code = _CODES.get(t.dtype)
    if code is None:
        raise TypeError(f"weft: tensors of dtype {t.dtype} are not supported")
    if t.is_cpu:
        return (t.data_ptr(), t.numel(), code, -1)
    if not t.is_cuda:
        raise TypeError(f"weft: tensors on {t.device.type} are not supported (cpu and cuda are)")
    dev = t.device
    _weft.set_current_stream(torch.cuda.current_stream(dev).cuda_stream)
    return (t.data_ptr(), t.numel(), code, dev.index or 0)


def capturing(tensors=None) -> bool:
    """Whether torch's current CUDA stream is capturing a CUDA graph: on
    the current device, or, given `tensors`, on the device of any of them
    on CUDA (host tensors alone: never). An op issued then runs on the
    calling thread (a direct call), so that its device work and the
    copy-back of staged outputs are queued on the capturing stream before
    the capture ends, and no weft thread makes a CUDA call the capture
    would refuse."""
    if not torch.cuda.is_initialized():
        return False
    if tensors is None:
        return torch.cuda.is_current_stream_capturing()
    for d in {t.device for t in tensors if t.is_cuda}:
        with torch.cuda.device(d):
            if torch.cuda.is_current_stream_capturing():
                return True
    return False


class Staged:
    """The tensors of one op, made contiguous where they were not.

    `inputs(ts)` and `outputs(ts)` return what weft should read and write;
    `finish()` copies staged outputs back into the caller's tensors (call it
    once the op has succeeded). `keep` holds every tensor weft sees.
    """

    __slots__ = ("keep", "_back")

    def __init__(self):
        self.keep = []
        self._back = None

    def input(self, t: torch.Tensor) -> tuple:
        if t.layout is not _STRIDED:
            raise ValueError(f"weft: expected a dense tensor, got layout {t.layout}")
        if not t.is_contiguous():
            t = t.contiguous()
        self.keep.append(t)
        return desc(t)

    def output(self, t: torch.Tensor) -> tuple:
        if t.layout is not _STRIDED:
            raise ValueError(f"weft: expected a dense tensor, got layout {t.layout}")
        if not t.is_contiguous():
            c = t.contiguous()
            if self._back is None:
                self._back = []
            self._back.append((t, c))
            t = c
        self.keep.append(t)
        return desc(t)

    def staged_output(self, t: torch.Tensor) -> torch.Tensor:
        """`t` itself if contiguous, else a contiguous copy copied back by
        `finish` (for an output weft writes through views of its parts)."""
        if t.layout is not _STRIDED:
            raise ValueError(f"weft: expected a dense tensor, got layout {t.layout}")
        if t.is_contiguous():
            return t
        c = t.contiguous()
        if self._back is None:
            self._back = []
        self._back.append((t, c))
        return c

    def inputs(self, ts) -> list:
        return [self.input(t) for t in ts]

    def outputs(self, ts) -> list:
        return [self.output(t) for t in ts]

    @property
    def needs_finish(self) -> bool:
        return self._back is not None

    def finish(self) -> None:
        if self._back is not None:
            for orig, staged in self._back:
                orig.copy_(staged)
            self._back = None
