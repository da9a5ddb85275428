"""weft's module-level collectives.

- MORI's API: a program written as ``import mori;
  mori.all_reduce(t, op=mori.ReduceOp.SUM)`` runs on weft with ``import
  weft as mori`` and no init call of its own.
- The v-collectives (``all_gather_v``, ``reduce_scatter_v``: sizes that
  differ per rank) on a ``torch.distributed`` group that runs on weft.

Each call takes an optional ``group`` (a torch group on weft or a weft
Comm); without one it runs on weft's default communicator (`_default.py`: the default
``torch.distributed`` group if it runs on weft, else one made on first use
from the default group's store or the launcher's environment) and has
finished when it returns. Tensors may be on the CPU or a CUDA device.
"""

from __future__ import annotations

from ._default import comm_of
from ._reduce_op import ReduceOp


def all_reduce(tensor, op=ReduceOp.SUM, group=None) -> None:
    """Reduce every rank's ``tensor`` with ``op`` (SUM, PRODUCT, MIN, MAX)
    into every rank's."""
    comm_of(group).all_reduce(tensor, op, async_op=False)


def all_gather(output_tensors, input_tensor, group=None) -> None:
    """``output_tensors[i]`` receives rank i's ``input_tensor`` (sizes may
    differ from rank to rank)."""
    comm = comm_of(group)
    if all(o.numel() == input_tensor.numel() for o in output_tensors):
        comm.all_gather(output_tensors, input_tensor, async_op=False)
    else:
        comm.all_gather_v(output_tensors, input_tensor, async_op=False)


def reduce_scatter(output_tensor, input_tensors, op=ReduceOp.SUM, group=None) -> None:
    """``output_tensor`` becomes the reduction over ranks of their
    ``input_tensors[rank]`` (sizes may differ per destination rank)."""
    comm = comm_of(group)
    if all(i.numel() == output_tensor.numel() for i in input_tensors):
        comm.reduce_scatter(output_tensor, input_tensors, op, async_op=False)
    else:
        comm.reduce_scatter_v(output_tensor, input_tensors, op, async_op=False)


def broadcast(tensor, src=0, group=None) -> None:
    """Copy rank ``src``'s ``tensor`` into every rank's."""
    comm_of(group).broadcast(tensor, src, async_op=False)


def barrier(group=None) -> None:
    """Return once every rank has entered."""
    comm_of(group).barrier(async_op=False)


def send(tensor, dst, group=None) -> None:
    """Send ``tensor`` to rank ``dst``; returns once it is sent."""
    comm_of(group).send(tensor, dst, async_op=False)


def recv(tensor, src, group=None) -> None:
    """Receive into ``tensor`` from rank ``src``."""
    comm_of(group).recv(tensor, src, async_op=False)


def all_gather_v(tensor_list, tensor, group=None, async_op: bool = False):
    """``tensor_list[i]`` receives rank i's ``tensor``, whose size may
    differ per rank (TorchComm's ``all_gather_v``), on a weft
    ``torch.distributed`` group, a weft Comm, or the default (see the
    module docs). Returns a Work with ``async_op``, else None."""
    work = comm_of(group).all_gather_v(tensor_list, tensor, async_op=async_op)
    return work if async_op else None


def reduce_scatter_v(output, input_list, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """``output`` becomes the reduction over ranks of their
    ``input_list[rank]``, sizes differing per destination (TorchComm's
    ``reduce_scatter_v``); groups as :func:`all_gather_v`."""
    work = comm_of(group).reduce_scatter_v(output, input_list, op, async_op=async_op)
    return work if async_op else None
