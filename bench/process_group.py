"""A run over several processes: joining torchrun's process group, and folding every rank's figures
into one record (per-rank lists, the maximum over ranks where a figure must fit on each device,
throughput of the whole group bounded by its slowest rank)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from bench.record import KEY, Status

# Figures that differ by rank: kept as rank_<name> lists; the record's own value is the largest.
PER_RANK_MAX = (
    KEY.peak_tensor_bytes,
    KEY.peak_allocated_bytes,
    KEY.peak_reserved_bytes,
    KEY.peak_active_bytes,
    KEY.activation_bytes,
    KEY.param_bytes,
    KEY.buffer_bytes,
    KEY.gradient_bytes,
    KEY.optimizer_state_bytes,
    KEY.model_state_bytes,
    KEY.nvml_process_bytes,
    KEY.context_bytes,
    KEY.cache_slack_bytes,
    KEY.rss_peak_bytes,
    KEY.step_time_ms_median,
    KEY.step_time_ms_p25,
    KEY.step_time_ms_p75,
    KEY.step_time_ms_max,
    KEY.alloc_retries,
    KEY.cuda_ooms,
    KEY.predicted_peak_tensor_bytes,
)
# Rates: the group moves at its slowest rank's pace.
PER_RANK_MIN = (KEY.samples_per_s, KEY.tokens_per_s, KEY.step_time_ms_min)


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


def gather(figures: dict[str, Any], group: Group) -> list[dict[str, Any]] | None:
    """Every rank's figures, on rank 0 (None elsewhere); a group of one returns its own."""
    if group.world_size == 1:
        return [figures]
    import torch.distributed as dist

    out: list[Any] = [None] * group.world_size
    dist.all_gather_object(out, figures)
    if group.rank == 0:
        return out
    return None


def leave(group: Group) -> None:
    if group.world_size > 1:
        import torch.distributed as dist

        dist.barrier()  # no rank tears its connections down while another still talks to it
        dist.destroy_process_group()


def merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One record: the rank with the highest peak speaks for the breakdown; every rank's figure is
    kept."""
    if len(per_rank) == 1:
        return per_rank[0]
    worst = max(
        per_rank, key=lambda r: r.get(KEY.peak_allocated_bytes) or r.get(KEY.peak_tensor_bytes) or 0
    )
    out = dict(worst) | {KEY.world_size: len(per_rank), KEY.peak_rank: per_rank.index(worst)}
    for key, pick in [(k, max) for k in PER_RANK_MAX] + [(k, min) for k in PER_RANK_MIN]:
        values = [r.get(key) for r in per_rank]
        if any(v is not None for v in values):
            out[f"rank_{key}"] = values
            out[key] = pick(v for v in values if v is not None)
    bad = [r for r in per_rank if r.get(KEY.status) != Status.OK]
    return out | (bad[0] if bad else {})
