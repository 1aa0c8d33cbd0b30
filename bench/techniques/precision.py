"""Numeric precision: autocast, pure bfloat16, TF32."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from bench.techniques.base import ANY_MODE, TECHNIQUES, RunContext, Step, Technique, option

if TYPE_CHECKING:
    from bench.data.synthetic import Batch


@TECHNIQUES.register("amp")
class Amp(Technique):
    """Autocast forward and loss to a 16-bit dtype; fp32 weights and optimizer stay as they are.

    Expected: activations saved for backward roughly halve (matmul/conv outputs in 16-bit), model states
    unchanged; on tensor-core GPUs 2.6-3.3× ResNet-50 throughput (NVIDIA DeepLearningExamples: V100
    367 → 1200 img/s, A100 938 → 2470). float16 needs loss scaling or small gradients underflow, so it
    comes with a GradScaler; bfloat16 has fp32's range and needs none. Accuracy: on par with fp32.
    ``scaler = false`` drops the GradScaler from float16, to show what it prevents: gradients below
    float16's smallest subnormal (6e-8) flush to zero and those weights stop learning.
    """

    name = "amp"
    modes = ANY_MODE
    summary = "autocast to bfloat16 or float16 (float16 with a GradScaler unless scaler = false)"

    @dataclass(frozen=True)
    class Config:
        dtype: Literal["bfloat16", "float16"] = option("bfloat16", "autocast compute dtype")
        scaler: bool = option(True, "float16: loss scaling by a GradScaler (false shows the underflow it prevents)")

    def problems(self, batch_size: int) -> list[str]:
        if not self.config.scaler and self.config.dtype != "float16":
            return ["scaler = false applies to float16 only: bfloat16 has fp32's range and is never scaled"]
        return []

    def unsupported(self, ctx: RunContext) -> str | None:
        if self.config.dtype == "float16" and not ctx.cuda:
            # It runs, but on emulated half-precision kernels (>10x slower than fp32 on this CI CPU),
            # so its figures would describe nothing a user would run; it is a GPU technique.
            return "float16 autocast is a CUDA technique; CPU kernels for it are emulated and slow"
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.device_type = ctx.device.type
        self.dtype = getattr(torch, self.config.dtype)
        scaled = self.config.dtype == "float16" and self.config.scaler
        self.scaler = torch.amp.GradScaler(self.device_type) if scaled else None
        return model

    def step(self) -> Step:
        autocast = Step(context=lambda: torch.autocast(self.device_type, dtype=self.dtype))
        if self.scaler is None:
            return autocast
        return replace(autocast, scale_loss=self.scaler.scale, optimizer_step=self._scaled_step)

    def _scaled_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.step(optimizer)
        self.scaler.update()

    def proof(self, steps: int) -> dict[str, Any]:
        scale = self.scaler.get_scale() if self.scaler else None
        return {"autocast_dtype": self.config.dtype, "grad_scaler": self.scaler is not None, "loss_scale": scale}


def cast_(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model.to(dtype)`` in place, as ``Module.to`` does for plain tensors (floating-point parameters
    and buffers only). Written out because ``Module.to`` swaps fake tensors (``bench predict``), which
    the fake mode's own references forbid."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.data = t.data.to(dtype)
    return model


@TECHNIQUES.register("bf16")
class PureBF16(Technique):
    """Parameters, gradients, optimizer state and activations all in bfloat16; no fp32 master copy.

    Expected: model states halve (AdamW: 16 → 8 bytes per parameter; ZeRO's 16-byte figure assumes an fp32
    master copy, arXiv:1910.02054), activations halve. Accuracy: updates smaller than bf16's resolution
    (8 bits of mantissa) are lost, so training can stall where autocast would not.
    """

    name = "bf16"
    summary = "pure bfloat16: weights, gradients, optimizer state (no fp32 master weights)"
    conflicts = frozenset({"amp"})

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.model = cast_(model, self.dtype)
        return self.model

    def step(self) -> Step:
        return Step(prepare=self._cast_inputs)

    def _cast_inputs(self, batch: Batch) -> Batch:
        inputs, labels = batch
        if isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
            inputs = inputs.to(self.dtype)
        return inputs, labels

    def proof(self, steps: int) -> dict[str, Any]:
        return {"param_dtypes": ",".join(sorted({str(p.dtype) for p in self.model.parameters()}))}


@TECHNIQUES.register("tf32")
class TF32(Technique):
    """TensorFloat-32 for fp32 matmuls and convolutions on Ampere and newer (10-bit mantissa inputs).

    Expected: no memory change; fp32 matmul throughput several times higher on A100/H100 (NVIDIA
    DeepLearningExamples run their "FP32" rows as TF32). Every CUDA record states both settings anyway,
    because PyTorch's defaults differ for matmul (off) and cuDNN (on).
    """

    name = "tf32"
    modes = ANY_MODE
    summary = "TF32 matmul and cuDNN convolutions on or off (CUDA)"

    @dataclass(frozen=True)
    class Config:
        enabled: bool = option(True, "allow TF32 in fp32 matmuls and cuDNN convolutions")

    def unsupported(self, ctx: RunContext) -> str | None:
        return None if ctx.cuda else "TF32 is a CUDA tensor-core mode; a CPU has no such setting"

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        torch.backends.cuda.matmul.allow_tf32 = self.config.enabled
        torch.backends.cudnn.allow_tf32 = self.config.enabled
        return model

    def proof(self, steps: int) -> dict[str, Any]:
        return {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32}
