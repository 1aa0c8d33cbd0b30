"""Optimizer choice and gradient housekeeping."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from bench.techniques.base import (
    TECHNIQUES,
    RunContext,
    Step,
    Technique,
    Unsupported,
    offer,
    option,
)

# Each implementation as torch's optimizers take it (default: torch picks, foreach on CUDA).
IMPL_KWARGS: dict[str, dict[str, bool]] = {
    "default": {},
    "single": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


@TECHNIQUES.register("optimizer")
class OptimizerChoice(Technique):
    """Replace the default AdamW (foreach on CUDA) with another optimizer or implementation.

    Expected optimizer state per parameter: AdamW 8 bytes (fp32 exp_avg + exp_avg_sq), SGD with
    momentum 4, Adafactor ~0 (factored second moments: one row and one column vector per matrix;
    BERT-large, V100: 14949 → 12295 MB, HF perf_train_gpu_one). ``foreach`` batches the update into
    a few kernels at the cost of temporaries the size of a parameter group; ``fused`` does it in one
    kernel without them. Accuracy: SGD and Adafactor need their own learning rates to match AdamW.
    """

    axis = "optimizer"
    offers = (
        offer("adafactor", kind="adafactor", lr=0.01),
        offer("sgd-momentum", kind="sgd", lr=0.01),
    )
    summary = "another optimizer or update implementation"

    @dataclass(frozen=True)
    class Config:
        kind: Literal[
            "sgd", "adamw", "adafactor", "adafactor-transformers", "adagrad", "rmsprop"
        ] = option(
            "adamw",
            "which optimizer; adafactor-transformers: transformers' own Adafactor, as its Trainer "
            "makes it for optim = 'adafactor' (its update's temporaries are not torch's); adagrad "
            "and rmsprop: torch's, at their defaults, as the Trainer makes them",
        )
        impl: Literal["default", "single", "foreach", "fused"] = option(
            "default", "adamw/sgd update implementation; default lets PyTorch choose"
        )
        lr: float | None = option(
            None, "learning rate (default: the run's, as the default AdamW uses)"
        )
        momentum: float = option(0.9, "sgd momentum")
        groups: Literal["model", "trainer"] = option(
            "model",
            "trainer: the parameters in transformers' Trainer's two groups, the weights that "
            "decay, then the rest; the update runs in that order, which sets the temporaries alive "
            "at once",
        )

    def problems(self, batch_size: int) -> list[str]:
        if self.config.kind.startswith("adafactor") and self.config.impl not in (
            "default",
            "single",
            "foreach",
        ):
            return [
                f"adafactor has no {self.config.impl} implementation; use impl = 'default' or "
                "'foreach'"
            ]
        return []

    def unsupported(self, ctx: RunContext) -> str | None:
        if self.config.impl == "fused" and ctx.device.type not in ("cuda", "cpu"):
            return f"no fused {self.config.kind} on {ctx.device.type}"
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.lr = self.config.lr or ctx.lr
        return model

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        params, c = self._groups(model), self.config
        impl = IMPL_KWARGS[c.impl]
        if c.kind == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=self.lr, momentum=c.momentum, **impl)
        elif c.kind == "adafactor":
            self.optimizer = torch.optim.Adafactor(params, lr=self.lr, **impl)
        elif c.kind == "adagrad":
            self.optimizer = torch.optim.Adagrad(params, lr=self.lr, **impl)
        elif c.kind == "rmsprop":
            self.optimizer = torch.optim.RMSprop(params, lr=self.lr, **impl)
        # the Trainer's own arguments for it (get_optimizer_cls_and_kwargs)
        elif c.kind == "adafactor-transformers":
            from transformers.optimization import Adafactor

            self.optimizer = Adafactor(
                params, lr=self.lr, scale_parameter=False, relative_step=False
            )
        else:
            self.optimizer = torch.optim.AdamW(params, lr=self.lr, **impl)
        return self.optimizer

    def _groups(self, model: nn.Module) -> list[Any]:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if self.config.groups == "model":
            return [p for _, p in named]
        from transformers import Trainer

        # the Trainer's own rule; it reads no state
        decay = set(Trainer.get_decay_parameter_names(None, model))
        return [
            {"params": [p for n, p in named if n in decay]},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]

    def proof(self, steps: int) -> dict[str, Any]:
        group = self.optimizer.param_groups[0]
        impl = next((k for k in ("fused", "foreach") if group.get(k)), "default/single")
        return {"optimizer": type(self.optimizer).__name__, "impl": impl}


@TECHNIQUES.register("zero-grad-keep")
class ZeroGradKeep(Technique):
    """``optimizer.zero_grad(set_to_none=False)``: gradients are zeroed in place and stay allocated.

    Expected: a contrast to PyTorch's default (``set_to_none=True`` since 2.0): the gradients' bytes
    (4 per fp32 parameter) stay allocated between steps, so the peak of the forward pass grows by
    them; a memset per step instead of fresh allocations. Accuracy: identical.
    """

    not_advised = (
        "keeps the gradients allocated between steps: it spares the allocator, never memory"
    )
    summary = "`zero_grad(set_to_none=False)`"

    def step(self) -> Step:
        return Step(zero_grad=self._zero_in_place)

    def _zero_in_place(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=False)
        self.optimizer = optimizer

    def proof(self, steps: int) -> dict[str, Any]:
        if steps:
            groups = self.optimizer.param_groups
        else:
            groups = []
        kept = [p.grad for g in groups for p in g["params"] if p.grad is not None]
        return {"grads_kept_between_steps": len(kept)}


@TECHNIQUES.register("clip-grad-norm")
class ClipGradNorm(Technique):
    """The gradients' total norm, and the gradients scaled down to ``max_norm`` where it is larger,
    after the last backward and before the optimizer step: ``torch.nn.utils.clip_grad_norm_``, as
    the transformers Trainer runs it every step (``max_grad_norm``, 1.0 by default; at 0 it still
    takes the norm for its logs, clipping nothing: ``clip = false`` here). Its gradients are those
    of the parameters the optimizer updates (the Trainer passes the model's, and those without a
    gradient are skipped: the same set). Where the loss is scaled (float16 autocast), the gradients
    are unscaled first, as accelerate unscales them.

    Expected: a scalar norm per gradient and their stack for a moment, and the total norm kept: the
    Trainer holds it for its logs until the next step's clipping, so it is alive through the next
    forward and backward (one 512-byte block on CUDA). Accuracy: clipping changes the update, not
    what a step holds.
    """

    not_advised = "clipping bounds the update; it saves no memory"
    summary = "`clip_grad_norm_` before each optimizer step, as the Trainer does"
    # the update runs in backward there: no gradient is left to clip
    conflicts = frozenset({"optimizer-in-backward"})

    @dataclass(frozen=True)
    class Config:
        max_norm: float = option(1.0, "the largest total norm kept")
        clip: bool = option(
            True,
            "false: the norm taken and nothing clipped, as the Trainer does at max_grad_norm = 0",
        )

    def problems(self, batch_size: int) -> list[str]:
        if self.config.max_norm > 0:
            return []
        return [f"clip-grad-norm: max_norm must be positive, not {self.config.max_norm}"]

    def step(self) -> Step:
        return Step(clip=self._clip)

    def _clip(self, optimizer: torch.optim.Optimizer) -> None:
        self.norm = None  # the Trainer lets the last step's norm go just before it clips
        params = [p for g in optimizer.param_groups for p in g["params"]]
        limit = self.config.max_norm if self.config.clip else float("inf")
        self.norm = torch.nn.utils.clip_grad_norm_(params, limit)

    def proof(self, steps: int) -> dict[str, Any]:
        norm = getattr(self, "norm", None)
        return {"norm_kept": norm is not None and norm.dim() == 0}


class _PerParameterState(Mapping):
    """Parameter → its own optimizer's state for it (a ChainMap would create empty entries in the
    optimizers' defaultdicts on every miss)."""

    def __init__(self, optimizers: dict[nn.Parameter, torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def __getitem__(self, param: nn.Parameter) -> dict[str, Any]:
        return self.optimizers[param].state[param]

    def __iter__(self) -> Iterator[nn.Parameter]:
        return (p for p, o in self.optimizers.items() if p in o.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _StepsInBackward(torch.optim.Optimizer):
    """What the trainer holds when every parameter steps from its own hook: stepping it does
    nothing, its ``state`` is all the per-parameter optimizers' state (so memory accounting sees
    it)."""

    def __init__(self, optimizers: dict[nn.Parameter, torch.optim.Optimizer]) -> None:
        super().__init__(list(optimizers), {})
        self.state = _PerParameterState(optimizers)  # type: ignore[assignment]

    def step(self, closure: Any = None) -> None:
        return None


@TECHNIQUES.register("optimizer-from")
class OptimizerFrom(Technique):
    """Your own optimizer: ``factory`` (``"module:NAME"``) is called with the trainable parameters
    and returns the ``torch.optim.Optimizer`` the step updates them with, in place of the default
    AdamW. Expected: whatever state that optimizer keeps, counted as it makes it."""

    not_advised = "your own optimizer, which a run names"
    summary = "your own optimizer: `factory` (`module:NAME`) called with the trainable parameters"

    @dataclass(frozen=True)
    class Config:
        factory: str = option(
            "", "module:NAME of a function of the parameters returning a torch.optim.Optimizer"
        )

    def problems(self, batch_size: int) -> list[str]:
        if ":" in self.config.factory:
            return []
        return [f"factory must name a function as module:NAME, got {self.config.factory!r}"]

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        from bench.registry import import_object

        try:
            made = import_object(self.config.factory, "optimizer factory")
        except KeyError as exc:
            raise Unsupported(str(exc.args[0])) from None
        return made([p for p in model.parameters() if p.requires_grad])


@TECHNIQUES.register("optimizer-in-backward")
class OptimizerInBackward(Technique):
    """Fuse the optimizer step into backward: each parameter is updated by its own AdamW as soon as
    its gradient is complete (``Tensor.register_post_accumulate_grad_hook``), and the gradient is
    freed.

    Expected: gradients never all exist at once, so up to 4 bytes per parameter come off the peak
    (ViT-L/16, batch 1, Adam: about 6 GB → 4 GB; PyTorch tutorial optimizer_step_in_backward).
    Cannot accumulate gradients over micro-batches, since each gradient is consumed at once.
    Accuracy: identical to AdamW (same update, per parameter), except without gradient clipping.
    ``optimizer = "adamw-8bit"`` steps bitsandbytes' 8-bit AdamW per parameter instead (moments in a
    byte per value, as adamw-8bit keeps them): its update runs eager, so it can run inside
    backward's hooks, where torchao's compiled one cannot. ``"paged-adamw-8bit"``: bitsandbytes'
    paged 8-bit AdamW per parameter, its large moments in CUDA unified memory (as paged-adamw-8bit
    keeps them): torchtune's full single-device recipe (``optimizer_in_bwd``).
    """

    axis = "optimizer"
    offers = (offer("optimizer-in-backward"),)
    summary = "per-parameter AdamW in `register_post_accumulate_grad_hook`, gradient freed at once"
    conflicts = frozenset({"accumulate", "optimizer", "zero-grad-keep"})

    @dataclass(frozen=True)
    class Config:
        lr: float | None = option(
            None, "learning rate (default: the run's, as the default AdamW uses)"
        )
        optimizer: Literal["adamw", "adamw-8bit", "paged-adamw-8bit"] = option(
            "adamw",
            "each parameter's optimizer: torch's AdamW, or bitsandbytes' 8-bit AdamW (paged: "
            "PagedAdamW8bit, CUDA)",
        )

    @property
    def stand_ins(self) -> dict[str, str]:  # type: ignore[override]
        """The paged moments' buffers, where the optimizer pages them (as paged-adamw-8bit's)."""
        if self.config.optimizer == "paged-adamw-8bit":
            from bench.techniques.lowbit import PagedAdamW8bit

            return PagedAdamW8bit.stand_ins
        return {}

    def unsupported(self, ctx: RunContext) -> str | None:
        chosen = self.config.optimizer
        if chosen != "adamw" and importlib.util.find_spec("bitsandbytes") is None:
            return (
                f"optimizer = {chosen} needs bitsandbytes: pip install bitsandbytes (or "
                "'.[extras]')"
            )
        if chosen == "paged-adamw-8bit" and not ctx.cuda:
            return (
                "optimizer = paged-adamw-8bit pages CUDA unified memory; on a CPU bitsandbytes "
                "falls back to the 8-bit AdamW of optimizer = adamw-8bit"
            )
        return None

    def conflict(self, other: Technique) -> str | None:
        if other.name == "amp" and other.config.dtype == "float16":
            return (
                "float16 loss scaling must see every gradient before any step; use amp with "
                "bfloat16"
            )
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        lr = self.config.lr or ctx.lr
        self.optimizers = {p: self._optimizer(p, lr) for p in model.parameters() if p.requires_grad}
        self.updates = 0
        for p in self.optimizers:
            p.register_post_accumulate_grad_hook(self._step)
        return model

    def _optimizer(self, param: nn.Parameter, lr: float) -> torch.optim.Optimizer:
        if self.config.optimizer == "adamw":
            return torch.optim.AdamW([param], lr=lr, foreach=False)
        from bitsandbytes.optim import AdamW8bit, PagedAdamW8bit

        from bench.techniques.lowbit import own_overrides

        made = {"adamw-8bit": AdamW8bit, "paged-adamw-8bit": PagedAdamW8bit}[self.config.optimizer]
        optimizer = made([param], lr=lr)
        # every one's parameter is the first of its group: the place the process's manager keys
        # another optimizer's overrides by (an embedding's 32 bits, a Trainer's run before)
        own_overrides(optimizer, nn.Module(), embeddings_32bit=False)
        return optimizer

    def _step(self, param: nn.Parameter) -> None:
        self.optimizers[param].step()
        param.grad = None
        self.updates += 1

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return _StepsInBackward(self.optimizers)

    def proof(self, steps: int) -> dict[str, Any]:
        return {"parameters_stepped_in_backward": self.updates / max(steps, 1)}


@TECHNIQUES.register("galore")
class GaLore(Technique):
    """AdamW whose moments for each weight matrix live in a rank-r projection of its gradient, the
    projection refreshed from the gradient's SVD every ``update_proj_gap`` steps (GaLore,
    arXiv:2403.03507; the implementation of pytorch-optimizer, a maintained package). As in the
    paper, the matrices of the repeated blocks (attention and MLP) are projected; embeddings, head
    and vectors keep full AdamW state.

    Expected: a projected m×n matrix (m ≤ n) holds 2·r·n moments and its m×r projection instead of
    2·m·n, so at r = m/4 optimizer state falls to about 5/8 of AdamW's on the projected weights; the
    paper reports up to 65.5% less optimizer memory and LLaMA-7B pre-training on a 24 GB card (with
    8-bit states and per-layer updates). Each refresh costs an SVD per matrix. Accuracy: close to
    full-rank AdamW at these ranks, per the paper."""

    axis = "optimizer"
    offers = (offer("galore"),)
    summary = (
        "GaLore (pytorch-optimizer): AdamW moments of each block matrix in a rank-r projection of "
        "its gradient (default r = a quarter of its smaller side), refreshed by SVD every "
        "`update_proj_gap` steps; embeddings, head and vectors keep AdamW"
    )

    @dataclass(frozen=True)
    class Config:
        rank: int = option(
            0, "projection rank; 0: a quarter of each matrix's smaller side (the paper's ratio)"
        )
        update_proj_gap: int = option(
            200, "steps between refreshes of the projection (an SVD per matrix)"
        )
        scale: float = option(0.25, "the projected update's scale (the paper's alpha)")

    def problems(self, batch_size: int) -> list[str]:
        c = self.config
        return [
            f"{k} must be {'0 or more' if k == 'rank' else 'positive'}, got {v}"
            for k, v in (
                ("rank", c.rank),
                ("update_proj_gap", c.update_proj_gap),
                ("scale", c.scale),
            )
            if v < 0 or (v == 0 and k != "rank")
        ]

    def conflict(self, other: Technique) -> str | None:
        if other.makes_optimizer:
            return f"GaLore is the optimizer; {other.name} makes another"
        return None

    def unsupported(self, ctx: RunContext) -> str | None:
        if importlib.util.find_spec("pytorch_optimizer") is None:
            return (
                "needs pytorch-optimizer: pip install pytorch-optimizer (or pip install -e "
                "'.[extras]')"
            )
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.lr = ctx.lr
        self.in_blocks = {
            id(p) for b in ctx.model_spec.blocks(model) for p in model.get_submodule(b).parameters()
        }
        return model

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        from pytorch_optimizer import GaLore as Optimizer

        groups: dict[int, list[nn.Parameter]] = {}  # by rank; 0: full AdamW state
        for p in model.parameters():
            if p.requires_grad:
                projected = p.dim() == 2 and id(p) in self.in_blocks
                if projected:
                    rank = self.config.rank or min(p.shape) // 4
                else:
                    rank = 0
                groups.setdefault(rank if 0 < rank < min(p.shape) else 0, []).append(p)
        c = self.config
        self.projected = sum(len(ps) for rank, ps in groups.items() if rank)
        self.optimizer = Optimizer(
            [
                {"params": ps}
                if not rank
                else {
                    "params": ps,
                    "rank": rank,
                    "update_proj_gap": c.update_proj_gap,
                    "scale": c.scale,
                    "projection_type": "std",
                }
                for rank, ps in groups.items()
            ],
            lr=self.lr,
        )
        return self.optimizer

    def proof(self, steps: int) -> dict[str, Any]:
        ranks = sorted({g["rank"] for g in self.optimizer.param_groups if "rank" in g})
        return {"projected_matrices": self.projected, "ranks": ",".join(map(str, ranks))}
