"""A run over several processes: joining torchrun's process group, and folding every rank's figures
into one record (per-rank lists, the maximum over ranks where a figure must fit on each device,
throughput of the whole group bounded by its slowest rank)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from bench.record import Record


@dataclass(frozen=True)
class Group:
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0


def join(device_type: str, timeout_s: float) -> Group:
    """Under torchrun (WORLD_SIZE > 1): join the process group, NCCL on GPUs and gloo on CPUs, and
    take this rank's GPU. Alone: a group of one, nothing initialised."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Group()
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s)
    )
    return Group(world, dist.get_rank(), local)


def device_of(device_type: str, group: Group) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", group.local_rank)
    return torch.device(device_type)


def gather(figures: Record, group: Group) -> list[Record] | None:
    """Every rank's figures, on rank 0 (None elsewhere); a group of one returns its own."""
    if group.world_size == 1:
        return [figures]
    import torch.distributed as dist

    out: list[Record | None] = [None] * group.world_size
    dist.all_gather_object(out, figures)
    if group.rank == 0:
        return out
    return None


def leave(group: Group) -> None:
    if group.world_size > 1:
        import torch.distributed as dist

        dist.barrier()  # no rank tears its connections down while another still talks to it
        dist.destroy_process_group()


def merge(per_rank: list[Record]) -> Record:
    """One record of every rank's figures (``Record.merged``: how each figure folds over ranks is
    declared where the figure is); a run of one process is its own."""
    if len(per_rank) == 1:
        return per_rank[0]
    return Record.merged(per_rank)
