"""TorchComm's communicator API on weft: an all_reduce, a split into pairs,
an asynchronous exchange inside each pair, then finalize.

    torchrun --nproc-per-node 4 python/examples/torchcomm_api.py
"""

import datetime

import torch

import weft as torchcomms


def main() -> None:
    comm = torchcomms.new_comm("weft", torch.device("cpu"), timeout=datetime.timedelta(seconds=60))
    rank, size = comm.get_rank(), comm.get_size()

    t = torch.ones(1 << 20) * rank
    comm.all_reduce(t, torchcomms.ReduceOp.SUM, async_op=False)
    assert t[0].item() == sum(range(size))

    # Pairs (0, 1), (2, 3), ...: each rank names its own pair; an odd rank
    # out joins none.
    first = rank - rank % 2
    pair = comm.split([first, first + 1] if first + 1 < size else [])
    if pair is not None:
        mine = torch.full((4,), float(rank))
        theirs = torch.empty(4)
        peer = 1 - pair.get_rank()
        works = [pair.recv(theirs, peer, async_op=True), pair.send(mine, peer, async_op=True)]
        for w in works:
            w.wait()
        print(f"rank {rank}: sum {t[0].item():.0f}, pair {pair.get_name()} got {theirs[0].item():.0f}")
        pair.finalize()
    comm.finalize()


if __name__ == "__main__":
    main()
