"""Step timing: CUDA events on the GPU (no host sync inside the loop), wall clock on the CPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from bench.record import Timing


def time_steps(step: Callable[[], object], n: int, device: torch.device) -> list[float]:
    """Run ``step`` n times; each step's duration in milliseconds."""
    if device.type == "cuda":
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(n)
        ]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def summarize(times_ms: list[float], samples: int, tokens_per_sample: int | None) -> Timing:
    """Median and spread (never a single run), and the throughput the median implies."""
    if len(times_ms) > 1:
        q = statistics.quantiles(times_ms, n=4)
    else:
        q = [times_ms[0]] * 3
    median = statistics.median(times_ms)
    out = Timing(
        step_time_ms_median=median,
        step_time_ms_p25=q[0],
        step_time_ms_p75=q[2],
        step_time_ms_min=min(times_ms),
        step_time_ms_max=max(times_ms),
        samples_per_s=samples / (median / 1e3),
    )
    if tokens_per_sample:
        out.tokens_per_s = out.samples_per_s * tokens_per_sample
    return out
