"""Activation checkpointing."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from bench.techniques.base import TECHNIQUES, RunContext, Technique


@TECHNIQUES.register("checkpoint")
class ActivationCheckpointing(Technique):
    """Recompute each repeated block (ResNet bottleneck, encoder layer) in backward instead of saving its
    activations; only block inputs are kept (non-reentrant ``torch.utils.checkpoint``).

    Expected: activation memory falls towards one block's worth plus the block inputs, for about one
    extra forward (~30% more step time; Chen et al. 2016, arXiv:1604.06174; Korthikanti et al. 2022:
    2·s·b·h bytes per transformer layer with full recomputation). Accuracy: identical without dropout
    or batch norm; BatchNorm's running statistics are updated twice per step.
    """

    name = "checkpoint"
    summary = "recompute every repeated block in backward (non-reentrant)"

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.blocks = ctx.model_spec.blocks(model)
        self.calls = 0
        for path in self.blocks:
            parent, _, child = path.rpartition(".")
            block = model.get_submodule(path)
            block.register_forward_pre_hook(self._count)
            setattr(model.get_submodule(parent), child, checkpoint_wrapper(block, CheckpointImpl.NO_REENTRANT))
        return model

    def _count(self, module: nn.Module, args: Any) -> None:
        self.calls += 1

    def proof(self, steps: int) -> dict[str, Any]:
        # 2.0 per micro-batch means every block ran forward twice: once, and once more to recompute.
        per_step = self.calls / (steps * len(self.blocks)) if steps and self.blocks else 0.0
        return {"wrapped_modules": len(self.blocks), "block_forwards_per_step": per_step}
