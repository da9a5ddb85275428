"""weft for PyTorch: weft's collectives as a torch.distributed backend.

Under torchrun, ``dist.init_process_group("weft")`` is all a program needs
(the package registers the name through an entry point; ``import weft``
does too). Which weft backend runs inside comes from ``WEFT_BACKEND``
(``auto``: shared memory on one host, TCP across hosts), or the backend
options (``pg_options=weft.Options(backend="cpu-tcp")``).

``weft.new_comm`` is TorchComm's communicator API on weft: a TorchComm
program runs on weft by importing ``weft`` instead of ``torchcomms``,
windows (``comm.new_window()``) included.

``weft.moe`` is mixture-of-experts token dispatch and combine (expert
parallelism) with autograd. MORI's module-level collectives
(``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``,
``barrier``, ``send``, ``recv``) run as written with ``import weft as
mori``, and ``all_gather_v`` / ``reduce_scatter_v`` take a
``torch.distributed`` group on weft (``_functions.py``).
"""

from __future__ import annotations

from . import _weft, moe
from ._backend import Options
from ._comm import Comm, new_comm
from ._errors import WeftError, WeftPeerLostError, WeftStoreError, WeftTimeoutError, WeftValueError
from ._functions import all_gather, all_gather_v, all_reduce, barrier, broadcast, recv, reduce_scatter, reduce_scatter_v, send
from ._reduce_op import ReduceOp
from ._register import register
from ._window import Window, WindowAccessType, WindowAttr

register()

__all__ = [
    "all_gather",
    "all_gather_v",
    "all_reduce",
    "barrier",
    "broadcast",
    "Comm",
    "moe",
    "recv",
    "reduce_scatter",
    "reduce_scatter_v",
    "send",
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
