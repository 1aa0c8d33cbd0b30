"""Low-rank adapters."""

from __future__ import annotations

import importlib.util
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bench.measure.memory import tensor_bytes
from bench.techniques.base import TECHNIQUES, RunContext, Technique, Unsupported, option

# Which linear layers get adapters, and which head stays fully trainable, per model family.
# torchvision's attention projections are called through F.multi_head_attention_forward, not as
# modules, so an adapter on them would never run: ViT gets its adapters on the MLP instead.
# Llama: every linear of its layers, as QLoRA adapts them (arXiv:2305.14314), its head frozen as in fine-tuning.
TARGETS = {"bert": (["query", "value"], ["classifier"]), "vit": (["mlp.0", "mlp.3"], ["heads"]),
           "llama": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], [])}


@TECHNIQUES.register("lora")
class LoRA(Technique):
    """Freeze the base model and train low-rank adapters (peft's LoRA) plus the classification head.

    Expected: gradients and optimizer state only for the adapters and head (a fraction of a percent
    of BERT-base's 110M parameters at rank 8), so model-state memory falls by up to 12 of AdamW's 16
    bytes per frozen parameter; activations are unchanged, and backward skips weight gradients.
    Accuracy: below full fine-tuning from random init, since most weights never train here.
    """

    not_advised = "trains adapters only: another job, not a cheaper way to run this one (name it in a suite)"
    summary = ("peft LoRA on BERT (query, value), ViT (MLP) and Llama (all seven linears of a layer, head frozen), "
               "or on the linears named in `targets` (`\"fc1,fc2\"`: names or suffixes) with the `trainable` modules "
               "trained in full; base frozen")

    @dataclass(frozen=True)
    class Config:
        rank: int = option(8, "adapter rank r")
        alpha: int = option(16, "scaling numerator (scale = alpha / rank)")
        targets: str | None = option(None, "comma-separated names (or suffixes) of the linears to adapt; "
                                           "default: BERT query,value; ViT mlp.0,mlp.3; Llama all seven")
        trainable: str | None = option(None, "comma-separated modules trained in full (the head); "
                                             "default: BERT classifier; ViT heads; Llama none")

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


@TECHNIQUES.register("qlora")
class QLoRA(LoRA):
    """LoRA on a 4-bit base: every linear inside the model's repeated blocks stored as NF4 (torchao's NormalFloat
    4-bit, blocks of 64 with double-quantized scales) and frozen, dequantized as it is used; the adapters train in
    full precision. Embeddings, norms and the head stay as they are, as in QLoRA.

    Expected: the blocks' weights from 4 to about 0.52 bytes per parameter (4 bits and the scales), on top of
    LoRA's savings in gradients and optimizer state; slower than LoRA, since each linear dequantizes its weight
    in every forward and backward. QLoRA fits a 65B model's fine-tuning in under 48 GB (arXiv:2305.14314).
    Accuracy: close to LoRA on a 16-bit base.
    """

    not_advised = "trains adapters only on 4-bit weights: another job, not a cheaper way to run this one"
    summary = ("`lora` on a frozen base whose block linears are torchao NF4 (4-bit, blocks of 64, double-quantized "
               "scales), dequantized as used; embeddings, norms and head as they are")

    def unsupported(self, ctx: RunContext) -> str | None:
        if importlib.util.find_spec("torchao") is None:
            return "needs torchao for its NF4 weights: pip install torchao (or pip install -e '.[extras]')"
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
            raise Unsupported(f"model {ctx.model_spec.name} has no nn.Linear in its repeated blocks to quantize")
        return super().apply(model, ctx)

    def proof(self, steps: int) -> dict[str, Any]:
        nf4 = [p for p in self.model.parameters() if type(p).__name__ == "NF4Tensor"]
        held = tensor_bytes(nf4)
        return super().proof(steps) | {"nf4_linears": self.quantized,
                                       "nf4_bytes_per_param": round(held / sum(p.numel() for p in nf4), 4)}


def _nf4(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in NF4: blocks of 64 values, their scales quantized again in blocks of 256, or of as many as
    divide a small layer's scales (llama-tiny's key projection has 128)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    if weight.numel() % 64:
        raise Unsupported(f"a {tuple(weight.shape)} weight does not split into NF4's blocks of 64 values")
    return to_nf4(weight, 64, math.gcd(256, weight.numel() // 64))
