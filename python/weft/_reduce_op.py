"""`weft.ReduceOp`: the reduce ops of the communicator API, as TorchComm
names them.

``ReduceOp.SUM``, ``PRODUCT``, ``MIN``, ``MAX``, ``BAND``, ``BOR``,
``BXOR`` and ``AVG`` are values; ``ReduceOp.PREMUL_SUM(factor)`` makes the
pre-multiplied sum (every rank's tensor times ``factor``, then summed).
torch.distributed's ``ReduceOp`` values are accepted wherever a
``weft.ReduceOp`` is.
"""

from __future__ import annotations

import torch


class _Kind:
    """One reduce op by weft's name (what the native group takes)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def weft_name(self) -> str:
        """weft's name of the op (``sum``, ``premul_sum(0.5)``...)."""
        return self.name

    def _key(self) -> tuple:
        return (self.name, getattr(self, "factor", None))

    def __eq__(self, other) -> bool:
        return isinstance(other, _Kind) and other._key() == self._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name.upper()}"


class _PremulSum(_Kind):
    """``PREMUL_SUM``: call it with the factor (a number or a one-element
    tensor) to get the op."""

    __slots__ = ("factor",)

    def __init__(self, factor: float | None = None):
        super().__init__("premul_sum")
        self.factor = factor

    def __call__(self, factor) -> _PremulSum:
        """The pre-multiplied sum with `factor` (a number, or a tensor of
        one element)."""
        if isinstance(factor, torch.Tensor):
            if factor.numel() != 1:
                raise ValueError(f"weft: a PREMUL_SUM factor tensor has one element, not {factor.numel()}")
            factor = factor.item()
        return _PremulSum(float(factor))

    def weft_name(self) -> str:
        if self.factor is None:
            raise ValueError("weft: ReduceOp.PREMUL_SUM needs a factor: ReduceOp.PREMUL_SUM(factor)")
        return f"premul_sum({self.factor!r})"

    def __repr__(self) -> str:
        return "ReduceOp.PREMUL_SUM" + ("" if self.factor is None else f"({self.factor!r})")


class ReduceOp:
    """How a reduction combines the ranks' elements: ``SUM``, ``PRODUCT``,
    ``MIN``, ``MAX``, ``BAND``, ``BOR``, ``BXOR`` (bitwise, integers and
    bool), ``AVG`` (the sum divided by the world size), and
    ``PREMUL_SUM(factor)`` (each rank's tensor times ``factor``, summed)."""

    SUM = _Kind("sum")
    PRODUCT = _Kind("product")
    MIN = _Kind("min")
    MAX = _Kind("max")
    BAND = _Kind("band")
    BOR = _Kind("bor")
    BXOR = _Kind("bxor")
    AVG = _Kind("avg")
    PREMUL_SUM = _PremulSum()


__all__ = ["ReduceOp"]
