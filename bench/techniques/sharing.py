"""Parameter sharing across repeated blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from bench.techniques.base import TECHNIQUES, RunContext, Technique, option


def _signature(module: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((n, tuple(p.shape)) for n, p in module.named_parameters())


@TECHNIQUES.register("share-layers")
class CrossLayerSharing(Technique):
    """ALBERT-style cross-layer sharing: consecutive repeated blocks with identical parameter shapes
    reuse one block's weights (``groups`` distinct blocks for BERT/ViT's twelve layers; for ResNet,
    the identical blocks inside each stage share, the first block of a stage keeps its own).

    Expected: parameters, gradients and optimizer state shrink with the number of shared blocks
    (ALBERT-base: 12M parameters against BERT-base's 108M with embedding factorisation; the encoder
    alone shrinks 12× with one group); activations do not, since every layer still runs. Accuracy:
    lower capacity, so a measurable drop is expected.
    """

    name = "share-layers"
    summary = "cross-layer parameter sharing (ALBERT style) across repeated blocks"

    @dataclass(frozen=True)
    class Config:
        groups: int = option(1, "distinct blocks per run of identical blocks (1: all share one)")

    def problems(self, batch_size: int) -> list[str]:
        return [] if self.config.groups >= 1 else [f"groups must be ≥ 1, got {self.config.groups}"]

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.params_before = sum(p.numel() for p in model.parameters())
        runs = self._runs_of_identical_blocks(model, ctx.model_spec.blocks(model))
        self.shared = 0
        for run in runs:
            size = -(-len(run) // self.config.groups)  # ceil: blocks per group
            for i, path in enumerate(run):
                owner = run[(i // size) * size]
                if path != owner:
                    parent, _, child = path.rpartition(".")
                    setattr(model.get_submodule(parent), child, model.get_submodule(owner))
                    self.shared += 1
        self.params_after = sum(p.numel() for p in model.parameters())  # parameters() dedupes shared ones
        return model

    @staticmethod
    def _runs_of_identical_blocks(model: nn.Module, blocks: list[str]) -> list[list[str]]:
        runs: list[list[str]] = []
        for path in blocks:
            sig = _signature(model.get_submodule(path))
            if runs and _signature(model.get_submodule(runs[-1][0])) == sig:
                runs[-1].append(path)
            else:
                runs.append([path])
        return runs

    def proof(self, steps: int) -> dict[str, Any]:
        return {"blocks_sharing": self.shared, "params_before": self.params_before, "params_after": self.params_after}
