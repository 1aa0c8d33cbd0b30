"""DeepSpeed's calls that fake tensors cannot run as the real run does (``deepspeed``'s
``Technique.stand_ins``): its checks that the ranks agree read back what rank 0 broadcast, which the
fake group never sends."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def ranks_agreeing(ints: list[int]) -> None:
    """``assert_ints_same_as_other_ranks`` as ranks that agree run it: rank 0's list length, then
    its list, broadcast from tensors made as DeepSpeed makes them; each rank then holds what it
    holds itself (under the fake group a rank but 0 would read back the -1s it sent)."""
    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().device_name(os.environ["LOCAL_RANK"]))
    for values in (len(ints), ints):
        dist.broadcast(torch.tensor(values, dtype=int, device=device), src=0, async_op=False)
