"""Kernel and layout choices: channels_last, the SDPA attention backend."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from bench.techniques.base import (
    ANY_MODE,
    TECHNIQUES,
    RunContext,
    Step,
    Technique,
    Unsupported,
    option,
)

if TYPE_CHECKING:
    from bench.data.synthetic import Batch


@TECHNIQUES.register("channels-last")
class ChannelsLast(Technique):
    """NHWC memory format for the model's 4-D weights and for the input images.

    Expected: no memory change; cuDNN's tensor-core convolutions run NHWC natively, so
    mixed-precision ResNet-50 gets about +22% (RTX 3090, timm: 826 → 1218 img/s; PyTorch
    memory-format tutorial); none for ViT, whose only convolution is the patch embedding. Accuracy:
    identical.
    """

    modes = ANY_MODE
    not_advised = "a memory layout for faster convolutions: no tensor gets smaller"
    summary = "NHWC weights and inputs"

    def unsupported(self, ctx: RunContext) -> str | None:
        if ctx.model_spec.inputs == "image":
            return None
        return "channels_last applies to image models only"

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.model = model.to(memory_format=torch.channels_last)
        return self.model

    def step(self) -> Step:
        return Step(prepare=_channels_last)

    def proof(self, steps: int) -> dict[str, Any]:
        convs = [p for p in self.model.parameters() if p.dim() == 4]
        nhwc = sum(p.is_contiguous(memory_format=torch.channels_last) for p in convs)
        return {"conv_weights_channels_last": f"{nhwc}/{len(convs)}"}


def _channels_last(batch: Batch) -> Batch:
    inputs, labels = batch
    return inputs.contiguous(memory_format=torch.channels_last), labels


BACKENDS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


class _AttentionOps(TorchDispatchMode):
    """Notes which fused attention operator runs; the math backend shows none (it decomposes)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.__name__:
            self.seen.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@TECHNIQUES.register("sdpa")
class AttentionBackend(Technique):
    """Pin ``scaled_dot_product_attention`` to one backend (``torch.nn.attention.sdpa_kernel``).

    Expected: math materialises the s×s attention matrix per head (memory quadratic in sequence
    length); flash and memory-efficient attention never do (linear), and are faster on GPUs. On a
    CPU, PyTorch has math and a flash kernel; memory-efficient and cuDNN are CUDA-only. The kernel
    that actually ran is read off the first step's operators. Accuracy: same up to rounding.
    """

    modes = ANY_MODE
    not_advised = (
        "pins the attention kernel that CUDA otherwise picks: no choice of memory for advice"
    )
    summary = "`torch.nn.attention.sdpa_kernel`; records which kernel ran"

    @dataclass(frozen=True)
    class Config:
        backend: Literal["math", "flash", "efficient", "cudnn"] = option(
            "flash", "SDPA backend to allow"
        )

    def attention_backend(self) -> str | None:
        return self.config.backend

    def unsupported(self, ctx: RunContext) -> str | None:
        if not ctx.model_spec.attention:
            return "the model has no attention"
        # fake tensors standing for CUDA: no CUDA kernel here to ask
        if ctx.cuda and ctx.device.type != "cuda":
            return None
        q = torch.zeros(1, 1, 8, 16, device=ctx.device, requires_grad=True)
        try:  # the only reliable test of availability is to ask the kernel
            with sdpa_kernel(BACKENDS[self.config.backend]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q)
        except RuntimeError:
            return (
                f"no {self.config.backend} attention kernel on {ctx.device.type} for these inputs"
            )
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.ops: _AttentionOps | None = None
        return model

    def step(self) -> Step:
        return Step(context=self._context)

    @contextmanager
    def _context(self) -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(sdpa_kernel(BACKENDS[self.config.backend]))
            if self.ops is None:
                # observe the first step only: a dispatch mode would slow the timed ones
                self.ops = stack.enter_context(_AttentionOps())
            try:
                yield
            except RuntimeError as exc:
                if "No available kernel" not in str(exc):
                    raise
                # The kernel exists but refuses this model's call (e.g. CPU flash with attention
                # dropout).
                raise Unsupported(
                    f"{self.config.backend} attention refuses this model's attention call on this "
                    "device (dropout, mask or head size); see the run's warnings"
                ) from exc

    def proof(self, steps: int) -> dict[str, Any]:
        if self.ops:
            seen = sorted(self.ops.seen)
        else:
            seen = []
        return {"kernel": ",".join(seen) or "math (decomposed)"}
