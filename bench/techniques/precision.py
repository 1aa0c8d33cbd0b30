"""Numeric precision: autocast, pure bfloat16, TF32."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from bench.provenance import EMULATED_BF16, native_bf16
from bench.techniques.base import (
    ANY_MODE,
    TECHNIQUES,
    NoOptions,
    RunContext,
    Step,
    Technique,
    offer,
    option,
)

if TYPE_CHECKING:
    from bench.data.synthetic import Batch


@TECHNIQUES.register("amp")
class Amp(Technique):
    """Autocast forward and loss to a 16-bit dtype; fp32 weights and optimizer stay as they are.

    Expected: activations saved for backward roughly halve (matmul/conv outputs in 16-bit), model
    states unchanged; on tensor-core GPUs 2.6-3.3× ResNet-50 throughput (NVIDIA
    DeepLearningExamples: V100 367 → 1200 img/s, A100 938 → 2470). float16 needs loss scaling or
    small gradients underflow, so it comes with a GradScaler; bfloat16 has fp32's range and needs
    none. Accuracy: on par with fp32. ``scaler = false`` drops the GradScaler from float16, to show
    what it prevents: gradients below float16's smallest subnormal (6e-8) flush to zero and those
    weights stop learning.
    """

    modes = ANY_MODE
    axis = "precision"
    offers = (offer("amp-bf16", "bfloat16", dtype="bfloat16"),)
    stand_ins = {"torch.amp:GradScaler": "bench.predict.stand_ins:ScalerWithoutValues"}
    summary = (
        "`torch.autocast` over forward and loss; float16 adds a `GradScaler` (`scaler = false` "
        "leaves it out, to show the underflow it prevents)"
    )

    @dataclass(frozen=True)
    class Config:
        dtype: Literal["bfloat16", "float16"] = option("bfloat16", "autocast compute dtype")
        scaler: bool = option(
            True, "float16: loss scaling by a GradScaler (false shows the underflow it prevents)"
        )

    def problems(self, batch_size: int) -> list[str]:
        if not self.config.scaler and self.config.dtype != "float16":
            return [
                "scaler = false applies to float16 only: bfloat16 has fp32's range and is never "
                "scaled"
            ]
        return []

    def unsupported(self, ctx: RunContext) -> str | None:
        if self.config.dtype == "float16" and not ctx.cuda:
            # It runs, but on emulated half-precision kernels (>10x slower than fp32 on this CI
            # CPU), so its figures would describe nothing a user would run; it is a GPU technique.
            return "float16 autocast is a CUDA technique; CPU kernels for it are emulated and slow"
        return emulated_bf16(ctx, self.config.dtype)

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.device_type = ctx.device.type
        self.dtype = getattr(torch, self.config.dtype)
        scaled = self.config.dtype == "float16" and self.config.scaler
        if scaled:
            self.scaler = torch.amp.GradScaler(self.device_type)
        else:
            self.scaler = None
        return model

    def step(self) -> Step:
        autocast = Step(context=lambda: torch.autocast(self.device_type, dtype=self.dtype))
        if self.scaler is None:
            return autocast
        return replace(
            autocast,
            scale_loss=self.scaler.scale,
            unscale=self.scaler.unscale_,
            optimizer_step=self._scaled_step,
        )

    def _scaled_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.step(optimizer)
        self.scaler.update()

    def proof(self, steps: int) -> dict[str, Any]:
        if self.scaler:
            scale = self.scaler.get_scale()
        else:
            scale = None
        return {
            "autocast_dtype": self.config.dtype,
            "grad_scaler": self.scaler is not None,
            "loss_scale": scale,
        }


def emulated_bf16(ctx: RunContext, dtype: str) -> str | None:
    """The reason a bf16 run is unsupported on a CPU that only emulates bf16, as float16 is on every
    CPU; a prediction for CUDA is unaffected."""
    if (
        dtype == "bfloat16"
        and ctx.device.type == "cpu"
        and not ctx.predicting
        and not native_bf16()
    ):
        return EMULATED_BF16
    return None


def cast_(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model.to(dtype)`` in place, as ``Module.to`` does for plain tensors (floating-point
    parameters and buffers only). Written out because ``Module.to`` swaps fake tensors (``bench
    predict``), which the fake mode's own references forbid. A quantized weight (qlora's NF4) keeps
    its format, as a 4-bit model loaded in bfloat16 keeps its 4-bit layers: its ``.to(dtype)`` would
    dequantize it."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point() and not is_traceable_wrapper_subclass(t):
                t.data = t.data.to(dtype)
    return model


@TECHNIQUES.register("bf16")
class PureBF16(Technique):
    """Parameters, gradients, optimizer state and activations all in bfloat16; with
    ``master_weights``, an fp32 copy of the weights in the optimizer, which steps on it and copies
    the result back (apex's O2, the first seed article's recipe).

    Expected: without master weights, model states halve (AdamW: 16 → 8 bytes per parameter) and
    activations halve; updates smaller than bf16's resolution (8 bits of mantissa) are lost, so
    training can stall where autocast would not. With them, 16 bytes per parameter as autocast's (2
    + 2 + 4 master + 8 moments: ZeRO's mixed-precision Adam, arXiv:1910.02054) plus the fp32
    gradients during the step, activations still halved, and autocast's accuracy.
    """

    axis = "precision"
    offers = (offer("bf16-pure", "bfloat16"),)
    summary = (
        "everything in bfloat16; `master_weights = true`: the optimizer steps an fp32 copy of the "
        "weights and rounds it back into the model (apex O2, the first seed article)"
    )
    conflicts = frozenset({"amp"})

    @dataclass(frozen=True)
    class Config:
        master_weights: bool = option(
            False, "the optimizer steps an fp32 copy of the weights and copies it back (apex O2)"
        )

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    @property
    def masters(self) -> bool:
        return getattr(self.config, "master_weights", False)  # inference's half has no such option

    @property
    def makes_optimizer(self) -> bool:
        return self.masters

    def conflict(self, other: Technique) -> str | None:
        if self.masters and other.makes_optimizer:
            return (
                f"master_weights makes its own AdamW over the fp32 copy; {other.name} makes "
                "another optimizer"
            )
        return None

    def unsupported(self, ctx: RunContext) -> str | None:
        return emulated_bf16(ctx, str(self.dtype).removeprefix("torch."))

    def follows(self, earlier: Technique) -> str | None:
        if earlier.adapts:
            return (
                f"listed after {earlier.name}, it would cast the adapters too: list {self.name} "
                f"first, and give {earlier.name} adapter_dtype (float32, PEFT's default under a "
                "16-bit base, or base)"
            )
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.lr, self.pairs = ctx.lr, []
        self.model = cast_(model, self.dtype)
        return self.model

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer | None:
        if not self.masters:
            return None
        self.pairs = [
            (p, nn.Parameter(p.detach().float())) for p in model.parameters() if p.requires_grad
        ]
        optimizer = torch.optim.AdamW([m for _, m in self.pairs], lr=self.lr)
        # counted as optimizer state (bench.measure.memory)
        optimizer.masters = [m for _, m in self.pairs]
        return optimizer

    def step(self) -> Step:
        if not self.masters:
            return Step(prepare=self._cast_inputs)
        return Step(
            prepare=self._cast_inputs, optimizer_step=self._master_step, zero_grad=self._zero_grad
        )

    def _master_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The 16-bit gradients as the masters' fp32 ones, the update on the masters, their new
        values rounded into the model; the fp32 gradients live for the step only."""
        for p, master in self.pairs:
            if p.grad is None:
                master.grad = None
            else:
                master.grad = p.grad.float()
        self._update(optimizer)
        with torch.no_grad():
            for p, master in self.pairs:
                p.copy_(master)
                master.grad = None

    def _update(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def _zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        for p, _ in self.pairs:
            p.grad = None

    def _cast_inputs(self, batch: Batch) -> Batch:
        inputs, labels = batch
        if isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
            inputs = inputs.to(self.dtype)
        return inputs, labels

    def proof(self, steps: int) -> dict[str, Any]:
        masters = sorted({str(m.dtype) for _, m in self.pairs})
        return {
            "param_dtypes": ",".join(sorted({str(p.dtype) for p in self.model.parameters()})),
            "master_dtypes": ",".join(masters) or "none",
            "master_params": len(self.pairs),
        }


@TECHNIQUES.register("fp16")
class PureFP16(PureBF16):
    """Pure float16 with fp32 master weights and dynamic loss scaling: apex's O2 as the first seed
    article describes it. The model, its gradients and activations in float16; the optimizer steps
    an fp32 copy, on gradients a GradScaler unscaled (it refuses float16 ones, so float16 always has
    its masters).

    Expected: as ``bf16`` with ``master_weights`` in memory (16 bytes per parameter plus the fp32
    gradients during the step, activations halved); float16's 10-bit mantissa is closer to fp32 than
    bfloat16's 7, its range narrower, which the scaler covers. Tensor-core throughput as bf16's.
    """

    axis, offers = "", ()  # not its parent's place in the catalogue
    not_advised = (
        "float16 training needs loss scaling and can overflow; bf16-pure and amp-bf16 hold the "
        "same bytes"
    )
    summary = "everything in float16, fp32 master weights and a `GradScaler` (apex O2; CUDA)"
    stand_ins = {"torch.amp:GradScaler": "bench.predict.stand_ins:ScalerWithoutValues"}
    conflicts = frozenset({"amp", "bf16"})
    Config = NoOptions

    @property
    def dtype(self) -> torch.dtype:
        return torch.float16

    @property
    def masters(self) -> bool:
        return True

    def unsupported(self, ctx: RunContext) -> str | None:
        if ctx.cuda:
            return None
        return "float16 training is a CUDA technique; CPU kernels for it are emulated and slow"

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.scaler = torch.amp.GradScaler(ctx.device.type)
        return super().apply(model, ctx)

    def step(self) -> Step:
        return replace(super().step(), scale_loss=self.scaler.scale)

    def _update(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.step(optimizer)
        self.scaler.update()

    def proof(self, steps: int) -> dict[str, Any]:
        return super().proof(steps) | {"loss_scale": self.scaler.get_scale()}


@TECHNIQUES.register("tf32")
class TF32(Technique):
    """TensorFloat-32 for fp32 matmuls and convolutions on Ampere and newer (10-bit mantissa
    inputs).

    Expected: no memory change; fp32 matmul throughput several times higher on A100/H100 (NVIDIA
    DeepLearningExamples run their "FP32" rows as TF32). Every CUDA record states both settings
    anyway, because PyTorch's defaults differ for matmul (off) and cuDNN (on).
    """

    modes = ANY_MODE
    not_advised = "lowers matmul precision for speed on Ampere and later; no tensor gets smaller"
    summary = "TF32 for fp32 matmuls and cuDNN convs (CUDA)"

    @dataclass(frozen=True)
    class Config:
        enabled: bool = option(True, "allow TF32 in fp32 matmuls and cuDNN convolutions")

    def unsupported(self, ctx: RunContext) -> str | None:
        if ctx.cuda:
            return None
        return "TF32 is a CUDA tensor-core mode; a CPU has no such setting"

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        torch.backends.cuda.matmul.allow_tf32 = self.config.enabled
        torch.backends.cudnn.allow_tf32 = self.config.enabled
        return model

    def proof(self, steps: int) -> dict[str, Any]:
        return {
            "matmul": torch.backends.cuda.matmul.allow_tf32,
            "cudnn": torch.backends.cudnn.allow_tf32,
        }
