"""weft's errors as torch.distributed's exception types.

Every error carries weft's message, which names the op, this rank and,
where one is to blame, the peer.

- a lost peer: :class:`WeftPeerLostError`, a ``DistNetworkError``
  (``.peer`` is the rank);
- a timeout: :class:`WeftTimeoutError`, a ``DistBackendError`` and a
  ``TimeoutError``;
- a store failure while setting up: :class:`WeftStoreError`, a
  ``DistStoreError``;
- a wrong argument: :class:`WeftValueError`, a ``ValueError``;
- anything else (unsupported, aborted, a transport failure):
  :class:`WeftError`, a ``DistBackendError``.
"""

from __future__ import annotations

import torch.distributed as dist

from . import _weft


class _Details:
    """What every weft exception carries besides its message: the error's
    `kind`, the `peer` to blame (if any), the `op` and this `rank`."""

    def __init__(self, message, kind="backend", peer=None, op=None, rank=None):
        super().__init__(message)
        self.kind, self.peer, self.op, self.rank = kind, peer, op, rank


class WeftError(_Details, dist.DistBackendError):
    """A weft error; `kind`, `peer`, `op` and `rank` say what it was."""


class WeftTimeoutError(WeftError, TimeoutError):
    """An op or setup did not finish before its deadline."""


class WeftPeerLostError(_Details, dist.DistNetworkError):
    """A peer rank died, closed its connection or left the group."""


class WeftStoreError(_Details, dist.DistStoreError):
    """The rendezvous store failed while the group was set up."""


class WeftValueError(_Details, ValueError):
    """An argument weft cannot accept (size, dtype, root, split, tag...)."""


# The native module raises weft's errors as these classes (by kind; any
# other kind is a WeftError).
_weft.set_error_types(
    {
        "backend": WeftError,
        "timeout": WeftTimeoutError,
        "peer_lost": WeftPeerLostError,
        "invalid_argument": WeftValueError,
        "store": WeftStoreError,
    }
)

#: Every exception class a native call raises for a weft error.
ERRORS = (WeftError, WeftPeerLostError, WeftStoreError, WeftValueError)
