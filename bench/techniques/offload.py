"""Activation offloading."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bench.techniques.base import TECHNIQUES, RunContext, Step, Technique, option


@TECHNIQUES.register("offload")
class ActivationOffload(Technique):
    """Move every tensor saved for backward to host memory during forward and bring it back in backward
    (``torch.autograd.graph.save_on_cpu``).

    Expected: GPU activation memory close to zero, paid for in PCIe transfers: the step slows by the
    time to copy the activations twice, less with pinned memory. Accuracy: identical.
    """

    name = "offload"
    summary = "offload saved activations to CPU memory (save_on_cpu), optionally pinned"

    @dataclass(frozen=True)
    class Config:
        pin_memory: bool = option(True, "copy through page-locked host memory (faster, not pageable)")

    def unsupported(self, ctx: RunContext) -> str | None:
        return None if ctx.cuda else "activations already live in host memory on a CPU"

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.packed = 0
        return model

    def step(self) -> Step:
        return Step(context=lambda: _CountingSaveOnCpu(self, self.config.pin_memory))

    def proof(self, steps: int) -> dict[str, Any]:
        return {"tensors_offloaded_per_step": self.packed / max(steps, 1), "pin_memory": self.config.pin_memory}


class _CountingSaveOnCpu(torch.autograd.graph.saved_tensors_hooks):
    """save_on_cpu that counts the tensors it moves, as proof that it did."""

    def __init__(self, owner: ActivationOffload, pin_memory: bool) -> None:
        host = torch.autograd.graph.save_on_cpu(pin_memory=pin_memory)

        def pack(t: torch.Tensor) -> Any:
            owner.packed += 1
            return host.pack_hook(t)

        super().__init__(pack, host.unpack_hook)
