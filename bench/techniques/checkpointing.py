"""Activation checkpointing: full per block, every k-th block, or selective within blocks."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from bench.techniques.base import TECHNIQUES, RunContext, Technique, listed, offer, option

aten = torch.ops.aten
MATMULS = [aten.mm.default, aten.addmm.default, aten.bmm.default, aten.convolution.default]
ATTENTION = [
    getattr(aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(aten, name)
]


# The reduce-scatter that tensor (sequence) parallelism issues inside a block, where functional
# collectives exist.
if hasattr(torch.ops, "_c10d_functional") and hasattr(
    torch.ops._c10d_functional, "reduce_scatter_tensor"
):
    REDUCE_SCATTER = [torch.ops._c10d_functional.reduce_scatter_tensor.default]
else:
    REDUCE_SCATTER = []


@TECHNIQUES.register("checkpoint")
class ActivationCheckpointing(Technique):
    """Recompute repeated blocks (ResNet bottleneck, encoder layer) in backward instead of saving
    their activations; only block inputs are kept (non-reentrant ``torch.utils.checkpoint``).

    Expected: activation memory falls towards one block's worth plus the block inputs, for about one
    extra forward (~30% more step time; Chen et al. 2016, arXiv:1604.06174; Korthikanti et al. 2022:
    2·s·b·h bytes per transformer layer with full recomputation). ``every`` = k wraps every k-th
    block, a knob between the two. Accuracy: identical without dropout or batch norm; BatchNorm's
    running statistics are updated twice per step (once more in the recomputation), as if with a
    larger momentum; ``bn_momentum_correction`` sets each wrapped BatchNorm's momentum to 1 − √(1 −
    m), so that two updates with the same batch statistics equal one with m.
    """

    axis = "activations"
    offers = (offer("checkpoint-every-2", every=2), offer("checkpoint"))
    summary = (
        "non-reentrant `torch.utils.checkpoint` on every (k-th) repeated block; optionally "
        "BatchNorm momentum 1 − √(1 − m) so the recomputation's second running-stats update does "
        "not count twice"
    )
    conflicts = frozenset({"selective-checkpoint"})
    changes = "wrapped_modules"

    @dataclass(frozen=True)
    class Config:
        every: int = option(1, "wrap every k-th block (1: all of them)")
        bn_momentum_correction: bool = option(
            False, "compensate BatchNorm's second running-stats update"
        )
        reentrant: bool = option(
            False,
            "the reentrant implementation (transformers 4's gradient checkpointing default), else "
            "the non-reentrant one PyTorch recommends",
        )
        input_grads: bool = option(
            False,
            "a text model's embeddings' output requires grad, as transformers' "
            "gradient_checkpointing_enable makes it (enable_input_require_grads): the reentrant "
            "implementation needs it where only adapters train, and backward then computes it",
        )

    def layers_alike(self) -> bool:
        return self.config.every == 1  # every k-th: a layer's place decides

    def problems(self, batch_size: int) -> list[str]:
        if self.config.every >= 1:
            return []
        return [f"every must be ≥ 1, got {self.config.every}"]

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.blocks = ctx.model_spec.blocks(model)[:: self.config.every]
        self.calls = 0
        for path in self.blocks:
            parent, _, child = path.rpartition(".")
            block = model.get_submodule(path)
            block.register_forward_pre_hook(self._count)
            if self.config.bn_momentum_correction:
                self._correct_momentum(block)
            wrapped = self.wrap(block)
            wrapped.register_forward_pre_hook(_own_lists)
            setattr(model.get_submodule(parent), child, wrapped)
        self.inputs_grad = self.config.input_grads and _inputs_require_grad(model)
        return model

    def _correct_momentum(self, block: nn.Module) -> None:
        for bn in (m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)):
            if bn.momentum is not None:  # None: a cumulative average, which no momentum can correct
                bn.momentum = 1 - (1 - bn.momentum) ** 0.5

    def wrap(self, block: nn.Module) -> nn.Module:
        return checkpoint_wrapper(
            block,
            CheckpointImpl.REENTRANT if self.config.reentrant else CheckpointImpl.NO_REENTRANT,
        )

    def _count(self, module: nn.Module, args: Any) -> None:
        self.calls += 1

    def proof(self, steps: int) -> dict[str, Any]:
        # 2.0 per micro-batch means every wrapped block ran forward twice: once, and once to
        # recompute.
        if steps and self.blocks:
            per_step = self.calls / (steps * len(self.blocks))
        else:
            per_step = 0.0
        if len(self.blocks) <= 4:
            names = self.blocks
        else:
            names = [*self.blocks[:3], "…", self.blocks[-1]]
        out = {
            "wrapped_modules": len(self.blocks),
            "wrapped_names": ", ".join(names),
            "block_forwards_per_step": per_step,
        }
        if self.config.input_grads:  # where a text model's embeddings' output was made to
            out["inputs_require_grad"] = self.inputs_grad
        return out


def _inputs_require_grad(model: nn.Module) -> bool:
    """transformers' ``enable_input_require_grads`` on the model's transformers model, where its
    main input is token ids (``activation_checkpointing_enable`` calls it for those); whether it
    was."""
    found = next((m for m in model.modules() if hasattr(m, "enable_input_require_grads")), None)
    if found is None or getattr(found, "main_input_name", None) != "input_ids":
        return False
    found.enable_input_require_grads()
    return True


def _own_lists(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The block's list arguments copied: recomputation in backward reads the arguments it was
    given, and DenseNet's dense block appends to the list of features it passes each layer after the
    call (recomputed with the longer list, a layer concatenated more channels than its batch norm
    takes)."""
    return tuple(list(a) if isinstance(a, list) else a for a in args)


@TECHNIQUES.register("selective-checkpoint")
class SelectiveCheckpointing(ActivationCheckpointing):
    """Inside each wrapped block, save the outputs of the expensive ops (matmuls and convolutions,
    and optionally attention) and recompute only the cheap pointwise ones
    (``torch.utils.checkpoint.create_selective_checkpoint_contexts``).

    Expected: between no checkpointing and full: most of full checkpointing's recompute time is
    saved, while pointwise activations (GELU, dropout masks, norms) are dropped (Korthikanti et al.
    2022's selective recomputation: 34 → ~10 bytes per s·b·h in 16-bit for attention recompute).
    """

    axis = "activations"
    offers = (offer("selective-checkpoint"),)
    summary = "saves matmul/conv (attention) outputs, recomputes pointwise ops"
    conflicts = frozenset({"checkpoint"})

    @dataclass(frozen=True)
    class Config(ActivationCheckpointing.Config):
        save: Literal["matmuls", "matmuls+attention", "torchtitan", "ops"] = option(
            "matmuls",
            "which op outputs to keep: matmuls (and attention); torchtitan: its op policy, "
            "attention and every other matmul; ops: the operators named in ops",
        )
        ops: str | None = option(
            None,
            "with save = 'ops': comma-separated aten operators whose outputs to keep, e.g. "
            "'mm,_scaled_dot_product_flash_attention' (their .default overload)",
        )

    def problems(self, batch_size: int) -> list[str]:
        found = super().problems(batch_size)
        if self.config.reentrant:
            found.append(
                "reentrant: selective checkpointing runs non-reentrant only (its contexts need it)"
            )
        if (self.config.save == "ops") != (self.config.ops is not None):
            found.append(
                "ops goes with save = 'ops', and save = 'ops' needs ops: the operators to keep"
            )
        unknown = [n for n in listed(self.config.ops) if not hasattr(aten, n)]
        return found + (
            [f"ops: no aten operator {', '.join(map(repr, unknown))}"] if unknown else []
        )

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.decisions: Counter[str] = Counter()
        return super().apply(model, ctx)

    def wrap(self, block: nn.Module) -> nn.Module:
        return checkpoint_wrapper(block, CheckpointImpl.NO_REENTRANT, context_fn=self._contexts)

    def _contexts(self) -> Any:
        # A fresh count of matmuls per checkpointed call, in forward and in its recompute apart, as
        # torchtitan's.
        return create_selective_checkpoint_contexts(
            partial(self._policy, set(self._saved_ops()), Counter())
        )

    def _saved_ops(self) -> list[Any]:
        save = self.config.save
        if save == "ops":
            return [getattr(aten, n).default for n in listed(self.config.ops)]
        # its op save list: matmuls, attention, the reduce-scatters, amax (for float8)
        if save == "torchtitan":
            return [aten.mm.default, aten.max.default, *ATTENTION, *REDUCE_SCATTER]
        return MATMULS + (ATTENTION if save == "matmuls+attention" else [])

    def _policy(
        self, saved: set[Any], matmuls: Counter[bool], ctx: Any, op: Any, *args: Any, **kwargs: Any
    ) -> CheckpointPolicy:
        keep = op in saved
        if self.config.save == "torchtitan" and op == aten.mm.default:
            matmuls[ctx.is_recompute] += 1
            keep = matmuls[ctx.is_recompute] % 2 == 1  # every second matmul is recomputed
        if not ctx.is_recompute:
            self.decisions["saved" if keep else "recomputed"] += 1
        if keep:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def proof(self, steps: int) -> dict[str, Any]:
        return super().proof(steps) | {
            "saved_ops_per_step": self.decisions["saved"] / max(steps, 1),
            "recomputed_ops_per_step": self.decisions["recomputed"] / max(steps, 1),
        }
