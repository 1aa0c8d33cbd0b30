"""The run's process environment, and CUDA caching-allocator settings and housekeeping."""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bench.techniques.base import ANY_MODE, TECHNIQUES, RunContext, Step, Technique, option


@TECHNIQUES.register("allocator")
class AllocatorConfig(Technique):
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` for the run's process before CUDA starts (the runner starts a
    fresh process per run, which is what makes this possible at all).

    Expected: ``expandable_segments:True`` maps memory into growing segments instead of fixed
    blocks, so reserved memory stays closer to allocated (less fragmentation, fewer allocation
    retries) at the same allocated peak. Accuracy: identical.
    """

    modes = ANY_MODE
    not_advised = (
        "tunes the CUDA caching allocator: it changes what is reserved, not the tensors a budget "
        "counts"
    )
    summary = "`PYTORCH_CUDA_ALLOC_CONF` set before CUDA starts (fresh process per run)"

    @dataclass(frozen=True)
    class Config:
        conf: str = option("expandable_segments:True", "the PYTORCH_CUDA_ALLOC_CONF value")

    def problems(self, batch_size: int) -> list[str]:
        bad = [part for part in self.config.conf.split(",") if ":" not in part]
        if bad:
            return [f"conf entries are key:value pairs separated by commas, got {bad}"]
        return []

    def env(self) -> dict[str, str]:
        return {"PYTORCH_CUDA_ALLOC_CONF": self.config.conf}

    def unsupported(self, ctx: RunContext) -> str | None:
        if ctx.cuda:
            return None
        return "a CUDA allocator setting; the CPU allocator has none"

    def proof(self, steps: int) -> dict[str, Any]:
        return {"conf_in_process": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}


# variables only CUDA and its libraries read
CUDA_ONLY = (
    "CUDA_",
    "PYTORCH_CUDA_",
    "NCCL_",
    "CUBLAS_",
    "CUDNN_",
)


@TECHNIQUES.register("env")
class Environment(Technique):
    """Any environment variables, set for the run's process before it starts (so before torch and
    CUDA read them): the seed articles' monitoring advice, measured rather than repeated.

    Expected, for ``CUDA_LAUNCH_BLOCKING=1`` (claimed by the first seed article to cure memory leaks
    caused by asynchronous execution): every kernel launch waits for the kernel, so the same peak
    memory at a lower throughput; there is no leak for it to cure. Accuracy: identical.
    """

    modes = ANY_MODE
    not_advised = (
        "tunes the CUDA caching allocator: it changes what is reserved, not the tensors a budget "
        "counts"
    )
    summary = (
        "any `NAME=VALUE` pairs set for the run's process before it starts (a fresh interpreter)"
    )

    @dataclass(frozen=True)
    class Config:
        vars: str = option(
            "CUDA_LAUNCH_BLOCKING=1", "NAME=VALUE pairs separated by spaces (shell quoting)"
        )

    def problems(self, batch_size: int) -> list[str]:
        try:
            pairs = shlex.split(self.config.vars)
        except ValueError as exc:
            return [f"vars: {exc}"]
        bad = [p for p in pairs if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", p)]
        if bad or not pairs:
            return [f"vars: expected NAME=VALUE pairs, got {bad}"]
        return []

    def env(self) -> dict[str, str]:
        return dict(pair.split("=", 1) for pair in shlex.split(self.config.vars))

    def unsupported(self, ctx: RunContext) -> str | None:
        # CUDA's own variables change nothing a CPU runs: such a run would measure the baseline
        # again.
        if ctx.cuda or not all(name.startswith(CUDA_ONLY) for name in self.env()):
            return None
        return (
            f"{', '.join(self.env())}: read by CUDA alone; on a CPU the run would be the baseline "
            "again"
        )

    def proof(self, steps: int) -> dict[str, Any]:
        return {f"in_process.{k}": os.environ.get(k) for k in self.env()}


@TECHNIQUES.register("empty-cache")
class EmptyCacheEveryStep(Technique):
    """``torch.cuda.empty_cache()`` after every step: the caching allocator returns its free blocks.

    Expected: the seed articles' fragmentation advice, measured: reserved memory between steps
    drops, the allocated peak does not move (empty_cache frees nothing in use), and each step pays
    for cudaFree/cudaMalloc again, so throughput falls. Accuracy: identical.
    """

    modes = ANY_MODE
    not_advised = (
        "tunes the CUDA caching allocator: it changes what is reserved, not the tensors a budget "
        "counts"
    )
    summary = "`torch.cuda.empty_cache()` after every step"

    def unsupported(self, ctx: RunContext) -> str | None:
        if ctx.cuda:
            return None
        return "empties the CUDA caching allocator; nothing to empty on a CPU"

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.calls = 0
        return model

    def step(self) -> Step:
        return Step(after=self._empty)

    def _empty(self) -> None:
        torch.cuda.empty_cache()
        self.calls += 1

    def proof(self, steps: int) -> dict[str, Any]:
        return {"empty_cache_calls_per_step": self.calls / max(steps, 1)}
