"""Low-rank adapters."""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from typing import Any

from torch import nn

from bench.techniques.base import TECHNIQUES, RunContext, Technique, option

# Which linear layers get adapters, and which head stays fully trainable, per model family.
# torchvision's attention projections are called through F.multi_head_attention_forward, not as
# modules, so an adapter on them would never run: ViT gets its adapters on the MLP instead.
TARGETS = {"bert": (["query", "value"], ["classifier"]), "vit": (["mlp.0", "mlp.3"], ["heads"])}


@TECHNIQUES.register("lora")
class LoRA(Technique):
    """Freeze the base model and train low-rank adapters (peft's LoRA) plus the classification head.

    Expected: gradients and optimizer state only for the adapters and head (a fraction of a percent
    of BERT-base's 110M parameters at rank 8), so model-state memory falls by up to 12 of AdamW's 16
    bytes per frozen parameter; activations are unchanged, and backward skips weight gradients.
    Accuracy: below full fine-tuning from random init, since most weights never train here.
    """

    name = "lora"
    summary = "peft LoRA adapters (BERT/ViT, or the linears you name); base frozen, head trainable"

    @dataclass(frozen=True)
    class Config:
        rank: int = option(8, "adapter rank r")
        alpha: int = option(16, "scaling numerator (scale = alpha / rank)")
        targets: str | None = option(None, "comma-separated names (or suffixes) of the linears to adapt; "
                                           "default: BERT query,value; ViT mlp.0,mlp.3")
        trainable: str | None = option(None, "comma-separated modules trained in full (the head); "
                                             "default: BERT classifier; ViT heads")

    def problems(self, batch_size: int) -> list[str]:
        return [] if self.config.rank >= 1 else [f"rank must be ≥ 1, got {self.config.rank}"]

    def unsupported(self, ctx: RunContext) -> str | None:
        if importlib.util.find_spec("peft") is None:
            return "needs peft: pip install peft (or pip install -e '.[extras]')"
        if self.config.targets is None and ctx.model_spec.family not in TARGETS:
            return "no default layers to adapt for this model: set targets = 'name,name' (and trainable)"
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        targets, head = TARGETS.get(ctx.model_spec.family, ([], []))
        targets = _names(self.config.targets) or targets
        head = _names(self.config.trainable) or head
        config = LoraConfig(r=self.config.rank, lora_alpha=self.config.alpha, target_modules=targets,
                            modules_to_save=head)
        with warnings.catch_warnings():
            # peft reads transformers' deprecated is_gradient_checkpointing alias: noise the user cannot act on.
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            self.model = get_peft_model(model, config)
        return self.model

    def proof(self, steps: int) -> dict[str, Any]:
        trainable, total = self.model.get_nb_trainable_parameters()
        adapters = sum(n.endswith("lora_A") for n, _ in self.model.named_modules())
        return {"trainable_params": trainable, "total_params": total, "adapted_layers": adapters}


def _names(option: str | None) -> list[str]:
    return [n.strip() for n in (option or "").split(",") if n.strip()]
