"""Parameter sharing: across repeated blocks (ALBERT style), and within convolution kernels (shared
basis)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

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

    changes = "blocks_sharing"
    not_advised = (
        "shares weights across layers: another model, whose accuracy must be established anew"
    )
    summary = "ALBERT-style: identical consecutive blocks share weights"

    @dataclass(frozen=True)
    class Config:
        groups: int = option(1, "distinct blocks per run of identical blocks (1: all share one)")

    def layers_alike(self) -> bool:
        return False  # layers share with their neighbours

    def problems(self, batch_size: int) -> list[str]:
        if self.config.groups >= 1:
            return []
        return [f"groups must be ≥ 1, got {self.config.groups}"]

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
        # parameters() dedupes shared ones
        self.params_after = sum(p.numel() for p in model.parameters())
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
        return {
            "blocks_sharing": self.shared,
            "params_before": self.params_before,
            "params_after": self.params_after,
        }


class SharedBasisConv2d(nn.Module):
    """A k×k convolution whose every kernel is a learned combination of a few basis kernels; the
    basis is a parameter shared with the stage's other convolutions, the coefficients are this
    layer's own."""

    def __init__(self, conv: nn.Conv2d, basis: nn.Parameter) -> None:
        super().__init__()
        self.basis = basis  # (K, kh·kw), orthonormal rows at the start
        # (out, in, K)
        self.coefficients = nn.Parameter(conv.weight.detach().flatten(2) @ basis.detach().T)
        self.bias = conv.bias
        self.kernel_size, self.stride, self.padding = conv.kernel_size, conv.stride, conv.padding
        self.dilation, self.groups = conv.dilation, conv.groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = (self.coefficients @ self.basis).unflatten(2, self.kernel_size)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


@TECHNIQUES.register("shared-basis")
class SharedBasisConvolution(Technique):
    """Shared-basis convolutions for ResNet: in each stage, every 3×3 kernel becomes a learned
    combination of ``basis`` kernels common to the stage's 3×3 convolutions. The basis starts as the
    top singular vectors of the stage's initial kernels, the coefficients as their projections, so
    the model starts from the best rank-``basis`` approximation of its own initialisation.

    Expected: 3×3 weights, their gradients and optimizer state shrink by about 9/``basis`` (4:
    2.25×); each forward materialises the full kernels again, a small extra activation; the
    activations themselves do not change. Accuracy: fewer degrees of freedom per kernel, so a small
    drop.
    """

    changes = "replaced_convs"
    not_advised = (
        "shares a weight basis across layers: another model, whose accuracy must be established "
        "anew"
    )
    summary = (
        "ResNet: every 3×3 kernel of a stage a learned combination of `basis` kernels shared by "
        "the stage, started from the SVD of the initial kernels"
    )

    @dataclass(frozen=True)
    class Config:
        basis: int = option(4, "basis kernels per stage (a 3×3 kernel has 9 degrees of freedom)")

    def problems(self, batch_size: int) -> list[str]:
        if 1 <= self.config.basis < 9:
            return []
        return [f"basis must be between 1 and 8, got {self.config.basis}"]

    def unsupported(self, ctx: RunContext) -> str | None:
        if ctx.model_spec.family == "resnet":
            return None
        return "only ResNet's stages have 3×3 convolutions"

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.params_before = sum(p.numel() for p in model.parameters())
        self.replaced = 0
        for stage in ("layer1", "layer2", "layer3", "layer4"):
            convs = [
                (n, m)
                for n, m in model.get_submodule(stage).named_modules()
                if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)
            ]
            # (N, 9)
            kernels = torch.cat([m.weight.detach().flatten(0, 1).flatten(1) for _, m in convs])
            basis = nn.Parameter(
                torch.linalg.svd(kernels, full_matrices=False).Vh[: self.config.basis].contiguous()
            )
            for name, conv in convs:
                parent, _, child = f"{stage}.{name}".rpartition(".")
                setattr(model.get_submodule(parent), child, SharedBasisConv2d(conv, basis))
                self.replaced += 1
        self.params_after = sum(p.numel() for p in model.parameters())
        return model

    def proof(self, steps: int) -> dict[str, Any]:
        return {
            "replaced_convs": self.replaced,
            "params_before": self.params_before,
            "params_after": self.params_after,
        }
