"""Activation offloading."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from bench.measure.tracker import is_on_host
from bench.techniques.base import TECHNIQUES, RunContext, Technique, option


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

    def step_context(self) -> AbstractContextManager[Any]:
        return _CountingSaveOnCpu(self, self.config.pin_memory)

    def proof(self, steps: int) -> dict[str, Any]:
        return {"tensors_offloaded_per_step": self.packed / max(steps, 1), "pin_memory": self.config.pin_memory}


class _DeviceCopy(NamedTuple):
    """What bench predict keeps of an offloaded fake tensor: its host copy is no device memory."""

    shape: torch.Size
    dtype: torch.dtype


class _CountingSaveOnCpu(torch.autograd.graph.saved_tensors_hooks):
    """save_on_cpu that counts the tensors it moves, as proof that it did. A fake tensor (bench predict's,
    standing for a CUDA one) keeps only its shape and dtype, and unpacking it makes the device copy that
    save_on_cpu's ``.to(device)`` makes, contiguous as the pinned copy is; one standing for a host tensor
    stays as it is, as on CUDA, where it never reaches the device."""

    def __init__(self, owner: ActivationOffload, pin_memory: bool) -> None:
        host = torch.autograd.graph.save_on_cpu(pin_memory=pin_memory)

        def pack(t: torch.Tensor) -> Any:
            owner.packed += 1
            if not isinstance(t, FakeTensor):
                return host.pack_hook(t)
            return t if is_on_host(t) else _DeviceCopy(t.shape, t.dtype)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, _DeviceCopy):
                return torch.empty(packed.shape, dtype=packed.dtype)
            return packed if isinstance(packed, FakeTensor) else host.unpack_hook(packed)

        super().__init__(pack, unpack)
