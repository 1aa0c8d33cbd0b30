"""Low-rank adapters."""

from __future__ import annotations

import importlib.util
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from bench.measure.memory import tensor_bytes
from bench.techniques.base import TECHNIQUES, RunContext, Technique, Unsupported, listed, option

# Which linear layers get adapters, and which head stays fully trainable, per model family.
# torchvision's attention projections are called through F.multi_head_attention_forward, not as
# modules, so an adapter on them would never run: ViT gets its adapters on the MLP instead. Llama:
# every linear of its layers, as QLoRA adapts them (arXiv:2305.14314), its head frozen as in
# fine-tuning.
TARGETS = {
    "bert": (["query", "value"], ["classifier"]),
    "vit": (["mlp.0", "mlp.3"], ["heads"]),
    "llama": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], []),
}


@TECHNIQUES.register("lora")
class LoRA(Technique):
    """Freeze the base model and train low-rank adapters (peft's LoRA) plus the classification head.

    Expected: gradients and optimizer state only for the adapters and head (a fraction of a percent
    of BERT-base's 110M parameters at rank 8), so model-state memory falls by up to 12 of AdamW's 16
    bytes per frozen parameter; activations are unchanged, and backward skips weight gradients.
    Accuracy: below full fine-tuning from random init, since most weights never train here.
    """

    not_advised = (
        "trains adapters only: another job, not a cheaper way to run this one (name it in a suite)"
    )
    summary = (
        "peft LoRA on BERT (query, value), ViT (MLP) and Llama (all seven linears of a layer, "
        "head frozen), "
        'or on the linears named in `targets` (`"fc1,fc2"`: names or suffixes) with the '
        "`trainable` modules "
        "trained in full; base frozen"
    )

    adapts = True

    @dataclass(frozen=True)
    class Config:
        rank: int = option(8, "adapter rank r")
        alpha: int = option(16, "scaling numerator (scale = alpha / rank)")
        targets: str | None = option(
            None,
            "comma-separated names (or suffixes) of the linears to adapt; default: BERT "
            "query,value; ViT mlp.0,mlp.3; Llama all seven",
        )
        trainable: str | None = option(
            None,
            "comma-separated modules trained in full (the head); default: BERT classifier; ViT "
            "heads; Llama none",
        )
        dropout: float = option(
            0.0, "lora_dropout: a dropped copy of each adapted layer's input, kept for backward"
        )
        adapter_dtype: Literal["float32", "base"] = option(
            "float32",
            "the adapters' dtype under a 16-bit base (listed after bf16): float32, as PEFT casts "
            "them by default (autocast_adapter_dtype), or the base's",
        )
        dora: bool = option(
            False,
            "use_dora: DoRA, each adapted weight's magnitude trained apart from its direction "
            "(PEFT's, the merged weight's norm taken in every forward)",
        )
        config: str | None = option(
            None,
            "PEFT's own adapter_config.json: its r, lora_alpha, lora_dropout, target_modules, "
            "modules_to_save and use_dora, in place of the options above",
        )

    def problems(self, batch_size: int) -> list[str]:
        if self.config.config is not None:
            found: list[str] = []
            self._peft_config(found)
            return found
        if self.config.rank >= 1:
            return []
        return [f"rank must be ≥ 1, got {self.config.rank}"]

    def _peft_config(self, problems: list[str] | None = None) -> dict[str, Any]:
        """The LoraConfig arguments: the options, or PEFT's adapter_config.json where given (its
        fields that change no memory ignored; one that does but is not modelled, a problem)."""
        c = self.config
        if c.config is None:
            return {
                "r": c.rank,
                "lora_alpha": c.alpha,
                "lora_dropout": c.dropout,
                "target_modules": listed(c.targets),
                "modules_to_save": listed(c.trainable),
                "use_dora": c.dora,
            }
        return adapter_config(c.config, problems if problems is not None else [])

    def unsupported(self, ctx: RunContext) -> str | None:
        if importlib.util.find_spec("peft") is None:
            return "needs peft: pip install peft (or pip install -e '.[extras]')"
        named = self.config.targets or self._peft_config().get("target_modules")
        if not named and ctx.model_spec.family not in TARGETS:
            return (
                "no default layers to adapt for this model: set targets = 'name,name' (and "
                "trainable)"
            )
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        targets, head = TARGETS.get(ctx.model_spec.family, ([], []))
        found = self._peft_config()
        config = LoraConfig(
            **(
                found
                | {
                    "target_modules": found["target_modules"] or targets,
                    "modules_to_save": found["modules_to_save"] or head,
                }
            )
        )
        with warnings.catch_warnings():
            # peft reads transformers' deprecated is_gradient_checkpointing alias: noise the user
            # cannot act on.
            warnings.filterwarnings(
                "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
            )
            self.model = get_peft_model(
                model, config, autocast_adapter_dtype=self.config.adapter_dtype == "float32"
            )
        return self.model

    def proof(self, steps: int) -> dict[str, Any]:
        trainable, total = self.model.get_nb_trainable_parameters()
        adapters = sum(n.endswith("lora_A") for n, _ in self.model.named_modules())
        return {"trainable_params": trainable, "total_params": total, "adapted_layers": adapters}


# PEFT's adapter_config.json: the fields read, what each is here; the fields that change what a step
# holds but are not modelled; every other field changes no memory (init, the base model's name,
# revision, …).
READ = {
    "r": "r",
    "lora_alpha": "lora_alpha",
    "lora_dropout": "lora_dropout",
    "target_modules": "target_modules",
    "modules_to_save": "modules_to_save",
    "use_dora": "use_dora",
}
NOT_MODELLED = {
    "bias": "none",
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "target_parameters": None,
}


def adapter_config(path: str, problems: list[str]) -> dict[str, Any]:
    """LoraConfig's arguments from PEFT's adapter_config.json; each problem names the file and the
    field."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        problems.append(f"config: cannot read {path} as PEFT's adapter_config.json ({exc})")
        return {}
    if not isinstance(raw, dict) or raw.get("peft_type", "LORA") != "LORA":
        fix = " (an IA3 one is the ia3 technique's)" if isinstance(raw, dict) else ""
        problems.append(
            f"config: {path} is not a LoRA adapter_config.json (peft_type "
            f"{raw.get('peft_type') if isinstance(raw, dict) else None!r}){fix}"
        )
        return {}
    for key, plain in NOT_MODELLED.items():
        if raw.get(key) not in (plain, None, [], {}):
            problems.append(
                f"config: {path}: {key} = {raw[key]!r} is not modelled here; leave it at {plain!r}"
            )
    out = {mine: raw[theirs] for theirs, mine in READ.items() if theirs in raw}
    # a string is PEFT's regex (or "all-linear")
    out["target_modules"] = raw.get("target_modules") or []
    out["modules_to_save"] = list(raw.get("modules_to_save") or [])
    if not isinstance(out.get("r", 8), int) or out.get("r", 8) < 1:
        problems.append(
            f"config: {path}: r must be a whole number of at least 1, got {out.get('r')!r}"
        )
    return {"r": 8, "lora_alpha": 8, "lora_dropout": 0.0} | out


@TECHNIQUES.register("ia3")
class IA3(Technique):
    """Freeze the base model and train IA3's vectors (peft's IA3): each adapted linear's output
    scaled by a trained vector, a feed-forward one's input instead (arXiv:2205.05638).

    Expected: one vector per adapted layer trains (Llama-3-8B: about 0.01% of its parameters), so
    gradients and optimizer state nearly vanish, as LoRA's do; activations: what each scaling keeps
    for backward. Accuracy: below LoRA's on most tasks, with far fewer trained parameters."""

    not_advised = (
        "trains scaling vectors only: another job, not a cheaper way to run this one (name it in a "
        "suite)"
    )
    summary = (
        "peft IA3: trained vectors scaling the adapted linears' outputs (feed-forward ones' "
        "inputs), base frozen; PEFT's layers for the model's type, or those named"
    )
    adapts = True

    @dataclass(frozen=True)
    class Config:
        targets: str | None = option(
            None, "comma-separated linears to adapt; default: PEFT's for the model's type"
        )
        feedforward: str | None = option(
            None, "of those, the feed-forward ones (their input scaled); default: PEFT's"
        )
        trainable: str | None = option(None, "comma-separated modules trained in full")
        config: str | None = option(
            None,
            "PEFT's own IA3 adapter_config.json: its target_modules, feedforward_modules and "
            "modules_to_save, in place of the options above",
        )

    def problems(self, batch_size: int) -> list[str]:
        found: list[str] = []
        self._peft_config(found)
        return found

    def _peft_config(self, problems: list[str] | None = None) -> dict[str, Any]:
        c = self.config
        if c.config is not None:
            return ia3_config(c.config, problems if problems is not None else [])
        return {
            "target_modules": listed(c.targets) or None,
            "feedforward_modules": listed(c.feedforward) or None,
            "modules_to_save": listed(c.trainable) or None,
        }

    def unsupported(self, ctx: RunContext) -> str | None:
        if importlib.util.find_spec("peft") is None:
            return "needs peft: pip install peft (or pip install -e '.[extras]')"
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        from peft import IA3Config, get_peft_model

        try:
            with warnings.catch_warnings():  # as LoRA's: peft reads a deprecated alias
                warnings.filterwarnings(
                    "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
                )
                self.model = get_peft_model(model, IA3Config(**self._peft_config()))
        except ValueError as exc:  # PEFT knows no layers for this model's type
            raise Unsupported(f"IA3: {exc}; name targets = 'name,name'") from None
        return self.model

    def proof(self, steps: int) -> dict[str, Any]:
        trainable, total = self.model.get_nb_trainable_parameters()
        adapted = sum(hasattr(m, "ia3_l") for m in self.model.modules())
        return {"trainable_params": trainable, "total_params": total, "adapted_layers": adapted}


def ia3_config(path: str, problems: list[str]) -> dict[str, Any]:
    """IA3Config's arguments from PEFT's IA3 adapter_config.json (its layers; the rest, its
    initialisation and the base model's name, change no memory)."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        problems.append(f"config: cannot read {path} as PEFT's adapter_config.json ({exc})")
        return {}
    if not isinstance(raw, dict) or raw.get("peft_type") != "IA3":
        kind = raw.get("peft_type") if isinstance(raw, dict) else None
        problems.append(f"config: {path} is not an IA3 adapter_config.json (peft_type {kind!r})")
        return {}
    keys = ("target_modules", "feedforward_modules", "modules_to_save", "exclude_modules")
    return {k: raw[k] for k in keys if raw.get(k) is not None}


@TECHNIQUES.register("qlora")
class QLoRA(LoRA):
    """LoRA on a 4-bit base: every linear inside the model's repeated blocks stored as NF4
    (torchao's NormalFloat 4-bit, blocks of 64 with double-quantized scales) and frozen, dequantized
    as it is used; the adapters train in full precision. Embeddings, norms and the head stay as they
    are, as in QLoRA.

    Expected: the blocks' weights from 4 to about 0.52 bytes per parameter (4 bits and the scales),
    on top of LoRA's savings in gradients and optimizer state; slower than LoRA, since each linear
    dequantizes its weight in every forward and backward. QLoRA fits a 65B model's fine-tuning in
    under 48 GB (arXiv:2305.14314). Accuracy: close to LoRA on a 16-bit base."""

    not_advised = (
        "trains adapters only on 4-bit weights: another job, not a cheaper way to run this one"
    )
    summary = (
        "`lora` on a frozen base whose block linears are torchao NF4 (4-bit, blocks of 64, "
        "double-quantized scales), dequantized as used; embeddings, norms and head as they are"
    )

    def unsupported(self, ctx: RunContext) -> str | None:
        if importlib.util.find_spec("torchao") is None:
            return (
                "needs torchao for its NF4 weights: pip install torchao (or pip install -e "
                "'.[extras]')"
            )
        return super().unsupported(ctx)

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        blocks = ctx.model_spec.blocks(model)
        self.quantized = 0
        for name in blocks:
            for linear in model.get_submodule(name).modules():
                if type(linear) is nn.Linear:
                    linear.weight = nn.Parameter(_nf4(linear.weight.detach()), requires_grad=False)
                    self.quantized += 1
        if not self.quantized:
            raise Unsupported(
                f"model {ctx.model_spec.name} has no nn.Linear in its repeated blocks to quantize"
            )
        return super().apply(model, ctx)

    def proof(self, steps: int) -> dict[str, Any]:
        nf4 = [p for p in self.model.parameters() if type(p).__name__ == "NF4Tensor"]
        held = tensor_bytes(nf4)
        return super().proof(steps) | {
            "nf4_linears": self.quantized,
            "nf4_bytes_per_param": round(held / sum(p.numel() for p in nf4), 4),
        }


def _nf4(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in NF4: blocks of 64 values, their scales quantized again in blocks of 256, or of
    as many as divide a small layer's scales (llama-tiny's key projection has 128)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    if weight.numel() % 64:
        raise Unsupported(
            f"a {tuple(weight.shape)} weight does not split into NF4's blocks of 64 values"
        )
    return to_nf4(weight, 64, math.gcd(256, weight.numel() // 64))
