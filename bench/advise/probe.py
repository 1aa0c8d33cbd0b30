"""What a dtype costs on this CPU, timed here: the one part of a plan's cost that counting FLOPs and
bytes cannot see, for the options no record of this very CPU measured yet.

It is the model's own step, not a kernel's: oneDNN's bf16 ran a 1024² matmul 4× faster than fp32 on
an AVX-512 bf16 CPU, yet a vit-tiny step, whose matmuls are small, no faster at all."""

from __future__ import annotations

import statistics

import torch

from bench.data.synthetic import clone_batch
from bench.measure.timing import time_steps
from bench.recipe import Recipe
from bench.spec import RunSpec

CPU = torch.device("cpu")
STEPS = 3  # timed after one warm-up step; the median is kept


def time_factors(baseline: RunSpec, options: dict[str, RunSpec]) -> dict[str, float]:
    """Each option's median step time over the baseline's, at the CPU shapes, in this process
    (options that cannot run here are left out: advice drops them with their reason)."""
    base = _median_step(baseline)
    times = {name: _median_step(spec) for name, spec in options.items()}
    return {name: t / base for name, t in times.items() if t is not None and base}


def _median_step(spec: RunSpec) -> float | None:
    recipe = Recipe.of(spec, CPU)
    if recipe.unsupported() or recipe.feed() is not None:
        # variable-length steps differ batch to batch
        return None
    runner = recipe.stepper(recipe.model(spec.weights)[0])
    batch = recipe.batch()
    runner.step(clone_batch(batch))  # the optimizer's state and the kernels' first-call work
    return statistics.median(time_steps(lambda: runner.step(clone_batch(batch)), STEPS, CPU))
