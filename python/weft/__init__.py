"""weft for PyTorch: weft's collectives as a torch.distributed backend.

Under torchrun, ``dist.init_process_group("weft")`` is all a program needs
(the package registers the name through an entry point; ``import weft``
does too). Which weft backend runs inside comes from ``WEFT_BACKEND``
(``auto``: shared memory on one host, TCP across hosts), or the backend
options (``pg_options=weft.Options(backend="cpu-tcp")``).

``weft.new_comm`` is TorchComm's communicator API on weft: a TorchComm
program runs on weft by importing ``weft`` instead of ``torchcomms``,
windows (``comm.new_window()``) included.
"""

from __future__ import annotations

from . import _weft
from ._backend import Options
from ._comm import Comm, new_comm
from ._errors import WeftError, WeftPeerLostError, WeftStoreError, WeftTimeoutError, WeftValueError
from ._reduce_op import ReduceOp
from ._register import register
from ._window import Window, WindowAccessType, WindowAttr

register()

__all__ = [
    "Comm",
    "new_comm",
    "Options",
    "ReduceOp",
    "register",
    "WeftError",
    "WeftPeerLostError",
    "WeftStoreError",
    "WeftTimeoutError",
    "WeftValueError",
    "Window",
    "WindowAccessType",
    "WindowAttr",
]
