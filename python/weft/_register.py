"""Registration with torch.distributed: what the `torch.distributed.backends`
entry point (and `import weft`) calls."""

from __future__ import annotations

import torch.distributed as dist

NAME = "weft"


def register() -> None:
    """Register the backend name ``weft`` for CPU and CUDA tensors (once)."""
    if NAME.upper() in dist.Backend._plugins:
        return
    from ._backend import create

    dist.Backend.register_backend(NAME, create, devices=["cpu", "cuda"], extended_api=True)
