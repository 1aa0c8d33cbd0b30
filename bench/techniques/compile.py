"""Compilation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from bench.techniques.base import ANY_MODE, TECHNIQUES, RunContext, Technique, option


@TECHNIQUES.register("compile")
class Compile(Technique):
    """``torch.compile`` the model (TorchInductor). The first warm-up step includes compilation, so
    its time is recorded separately (``first_step_ms``) and kept out of the throughput.

    Expected: fused pointwise kernels save both time and the intermediate activations those ops
    would have saved for backward; compilation costs tens of seconds up front. The live-tensor
    tracker cannot see inside compiled graphs, so compiled runs have allocator figures (CUDA) but no
    tracked peak; a prediction gives the eager step's figures, and says so. Accuracy: same up to
    rounding.
    """

    approximate = (
        "the eager step's figures: a compiled step fuses kernels and frees otherwise, and usually "
        "holds less; measure it on the card to know"
    )
    stand_ins = {f"{__name__}:compiled": "bench.predict.stand_ins:left_eager"}
    modes = ANY_MODE
    not_advised = "what it holds is the compiler's fusion, which fake tensors cannot predict"
    summary = "`torch.compile` (Inductor); compile time in `first_step_ms`"
    trackable = False

    @dataclass(frozen=True)
    class Config:
        mode: Literal["default", "reduce-overhead", "max-autotune"] = option(
            "default", "torch.compile mode"
        )

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        compiled(model, self.config.mode)
        self.model = model
        return model

    def proof(self, steps: int) -> dict[str, Any]:
        return {"mode": self.config.mode, "compiled": self.model._compiled_call_impl is not None}


def compiled(model: nn.Module, mode: str) -> None:
    """In place: parameters, hooks and state_dict keys stay as they are."""
    model.compile(mode=mode)
