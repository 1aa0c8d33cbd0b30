"""Mixed precision."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from bench.techniques.base import TECHNIQUES, RunContext, Technique, option


@TECHNIQUES.register("amp")
class Amp(Technique):
    """Autocast forward and loss to a 16-bit dtype; fp32 weights and optimizer stay as they are.

    Expected: activations saved for backward roughly halve (matmul/conv outputs in 16-bit), model states
    unchanged; on tensor-core GPUs 2.6-3.3× ResNet-50 throughput (NVIDIA DeepLearningExamples: V100
    367 → 1200 img/s, A100 938 → 2470). float16 needs loss scaling or small gradients underflow, so it
    comes with a GradScaler; bfloat16 has fp32's range and needs none. Accuracy: on par with fp32.
    """

    name = "amp"
    summary = "autocast to bfloat16 or float16 (float16 with a GradScaler)"

    @dataclass(frozen=True)
    class Config:
        dtype: Literal["bfloat16", "float16"] = option("bfloat16", "autocast compute dtype")

    def unsupported(self, ctx: RunContext) -> str | None:
        if self.config.dtype == "float16" and ctx.device.type == "cpu":
            # It runs, but on emulated half-precision kernels (>10x slower than fp32 on this CI CPU),
            # so its figures would describe nothing a user would run; it is a GPU technique.
            return "float16 autocast is a CUDA technique; CPU kernels for it are emulated and slow"
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.device_type = ctx.device.type
        self.dtype = getattr(torch, self.config.dtype)
        fp16 = self.config.dtype == "float16"
        self.scaler = torch.amp.GradScaler(self.device_type) if fp16 else None
        return model

    def step_context(self) -> AbstractContextManager[Any]:
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler else loss

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        if self.scaler is None:
            return False
        self.scaler.step(optimizer)
        self.scaler.update()
        return True

    def proof(self, steps: int) -> dict[str, Any]:
        scale = self.scaler.get_scale() if self.scaler else None
        return {"autocast_dtype": self.config.dtype, "grad_scaler": self.scaler is not None, "loss_scale": scale}
