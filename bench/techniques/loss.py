"""The loss of a language model without its full logits: at a 128k vocabulary they outgrow
everything else a fine-tuning step holds (Llama-3 at 8 × 2,048 tokens: 7.8 GiB in float32)."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

from bench.models import IGNORE, next_tokens
from bench.techniques.base import (
    TECHNIQUES,
    RunContext,
    Step,
    Technique,
    Unsupported,
    offer,
    option,
)


@TECHNIQUES.register("chunked-loss")
class ChunkedLoss(Technique):
    """Cross-entropy of a next-token model from its last hidden states, a chunk of positions at a
    time, so only one chunk's logits are ever alive. Each chunk's gradients (for the hidden states
    and the head's weight) are computed in forward, as Liger-Kernel's fused linear cross-entropy
    does, and backward only scales them: nothing is recomputed. Liger's kernel runs where it is
    installed (CUDA), else this harness's autograd function in plain PyTorch.

    Expected: the peak falls by about the logits' size, several times over in float32 (the logits,
    their log-softmax saved for backward and its gradient); Liger reports about 60% less memory on
    Llama-3-8B (arXiv:2410.10989). Throughput about the same: the head's three matmuls are the same
    FLOPs, in smaller pieces. Accuracy: identical to the full cross-entropy, up to float rounding.
    """

    axis = "loss"
    offers = (offer("chunked-loss"),)
    summary = (
        "a next-token model's cross-entropy from its last hidden states a chunk of positions at a "
        "time, the chunk's gradients computed in forward: Liger-Kernel's fused linear "
        "cross-entropy where installed (CUDA), else the harness's own autograd function"
    )
    inputs, objective = "tokens", "next-token"

    @dataclass(frozen=True)
    class Config:
        chunk_tokens: int = option(
            0,
            "positions per chunk; 0: Liger's rule, as many chunks as vocabulary / hidden size (a "
            "power of two positions each), but at least 256 positions",
        )
        implementation: Literal["auto", "liger", "torch"] = option(
            "auto",
            "liger: Liger-Kernel's fused kernel (CUDA; pip install liger-kernel); torch: plain "
            "PyTorch; auto: liger where it is installed and the run is on CUDA",
        )

    def problems(self, batch_size: int) -> list[str]:
        if self.config.chunk_tokens >= 0:
            return []
        return [f"chunk_tokens must be 0 (automatic) or more, got {self.config.chunk_tokens}"]

    def unsupported(self, ctx: RunContext) -> str | None:
        if ctx.model_spec.objective != self.objective:
            return f"applies to next-token models; model {ctx.model_spec.name} classifies"
        if self.config.implementation == "liger":
            if importlib.util.find_spec("liger_kernel") is None:
                return (
                    "Liger-Kernel is not installed: pip install liger-kernel (or implementation = "
                    '"torch")'
                )
            if not ctx.cuda:
                return (
                    "Liger-Kernel's kernels are Triton's, CUDA only; implementation = \"torch\" "
                    "runs here"
                )
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.head, self.chunks, self.largest_chunk_logits = _head_skipped(model, ctx), 0, 0
        liger = (
            importlib.util.find_spec("liger_kernel") is not None and ctx.cuda and not ctx.predicting
        )
        self.implementation = self.config.implementation
        if self.implementation == "auto":
            if liger:
                self.implementation = "liger"
            else:
                self.implementation = "torch"
        return model

    def step(self) -> Step:
        return Step(loss=self._loss)

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the positions with a next token, from the (batch, seq, hidden)
        states."""
        hidden, targets = hidden.flatten(0, 1), next_tokens(labels).flatten()
        weight, bias = self.head.weight, self.head.bias
        if self.implementation == "liger":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            self.chunks += 1
            return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE)(
                weight, hidden, targets, bias
            )
        size = self.config.chunk_tokens or chunk_tokens(len(targets), *weight.shape)
        self.chunks += math.ceil(len(targets) / size)
        self.largest_chunk_logits = max(
            self.largest_chunk_logits, min(size, len(targets)) * weight.shape[0] * 4
        )
        return _ChunkedCrossEntropy.apply(hidden, weight, bias, targets, size)

    def proof(self, steps: int) -> dict[str, Any]:
        """The chunks a step's loss took, and the most logits bytes (float32) one chunk held: the
        full logits never exist."""
        return {
            "implementation": self.implementation,
            "chunks_per_step": self.chunks / max(steps, 1),
            "largest_chunk_logits_bytes": self.largest_chunk_logits,
        }


MIN_CHUNK = 256


def chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """Liger-Kernel's chunk size, the positions split into about vocab / hidden chunks, a power of
    two each; but at least MIN_CHUNK positions, since the weight gradient's matmul runs over a
    chunk's positions (on a CPU, chunks of 8 made llama-tiny's step 6× slower than the full
    logits)."""
    liger = 1 << max(0, math.ceil(math.log2(math.ceil(tokens / math.ceil(vocab / hidden)))))
    return max(liger, MIN_CHUNK)


def _head_skipped(model: nn.Module, ctx: RunContext) -> nn.Linear:
    """The model's linear output head, which its forward now skips in training (``_HiddenStates``)
    for a loss that applies it itself; Unsupported where it has none."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise Unsupported(
            f"model {ctx.model_spec.name} has no linear output head (get_output_embeddings)"
        )
    model.set_output_embeddings(_HiddenStates(head))
    return head


class _HiddenStates(nn.Module):
    """The output head, skipped in training, where the loss applies it a chunk at a time; applied in
    evaluation, whose accuracy reads the logits."""

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.head = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.training:
            return hidden
        return self.head(hidden)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T + bias`` against ``targets`` (IGNORE: no target), a
    chunk of ``size`` rows at a time. Forward also computes the gradients, d loss / d logits =
    (softmax − one-hot) / n for each chunk, folded at once into the gradients of the hidden states,
    weight and bias; backward scales them."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        size: int,
    ) -> torch.Tensor:
        counted = (targets != IGNORE).sum().clamp(min=1)
        # a copy only where they differ, as the plain head's matmul makes under autocast
        w = weight.to(hidden.dtype)
        if bias is None:
            b = None
        else:
            b = bias.to(hidden.dtype)
        # A frozen head (LoRA's, QLoRA's) gets no weight gradient: at a 128k vocabulary it is the
        # head's size.
        grad_hidden = torch.empty_like(hidden)
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        else:
            grad_weight = None
        biased = bias is not None and ctx.needs_input_grad[2]
        if biased:
            grad_bias = torch.zeros_like(bias, dtype=torch.float32)
        else:
            grad_bias = None
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, len(targets), size):
            h, t = hidden[start : start + size], targets[start : start + size]
            logits = F.linear(h, w, b).float()
            kept, picked = t != IGNORE, t.clamp(min=0)[:, None]
            lse = logits.logsumexp(-1)
            total += torch.where(kept, lse - logits.gather(1, picked).squeeze(1), 0.0).sum()
            grad = logits.sub_(lse[:, None]).exp_()  # the softmax, in the logits' place
            grad.scatter_add_(1, picked, -kept[:, None].float()).mul_((kept / counted)[:, None])
            grad = grad.to(h.dtype)
            grad_hidden[start : start + size] = grad @ w
            if grad_weight is not None:
                grad_weight += (grad.T @ h).float()
            if grad_bias is not None:
                grad_bias += grad.float().sum(0)
        ctx.save_for_backward(
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
        )
        return total / counted

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scaled = [
            None if g is None else g * grad_loss.to(g.dtype)
            for g in (grad_hidden, grad_weight, grad_bias)
        ]
        return *scaled, None, None


@TECHNIQUES.register("chunked-output-loss")
class ChunkedOutputLoss(Technique):
    """torchtune's ``CEWithChunkedOutputLoss``: the output head applied to the last hidden states a
    slice of positions at a time (``TransformerDecoder.set_num_output_chunks``), every slice's
    logits kept in the model's dtype, and the cross-entropy summed slice by slice, each upcast to
    float32 on its own (``compute_cross_entropy``), over the positions with a target.

    Expected: the full float32 copy of the logits never exists, only one slice's, so the loss's
    peak falls by about three quarters of the logits' float32 size against the plain loss (torchtune
    PR 1390); log-softmax still keeps every slice's float32 output for backward. Throughput: the
    same FLOPs. Accuracy: identical to the full cross-entropy, up to float rounding."""

    not_advised = (
        "torchtune's recipe loss, which a torchtune job names; chunked-loss (Liger's) keeps less "
        "and is the loss advice ranks"
    )
    summary = (
        "torchtune's `CEWithChunkedOutputLoss`: the head a slice of positions at a time, each "
        "slice's logits upcast to float32 on its own for the cross-entropy"
    )
    conflicts = frozenset({"chunked-loss", "sft-nll", "sft-chunked-nll"})
    inputs, objective = "tokens", "next-token"

    @dataclass(frozen=True)
    class Config:
        chunks: int = option(8, "num_output_chunks: the slices of positions (torchtune's 8)")

    def problems(self, batch_size: int) -> list[str]:
        if self.config.chunks >= 1:
            return []
        return [f"chunks must be at least 1, got {self.config.chunks}"]

    def unsupported(self, ctx: RunContext) -> str | None:
        if ctx.model_spec.objective != self.objective:
            return f"applies to next-token models; model {ctx.model_spec.name} classifies"
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.head, self.slices = _head_skipped(model, ctx), 0
        return model

    def step(self) -> Step:
        return Step(loss=self._loss)

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The recipe's loss: ``[head(h) for h in hidden.chunk(n, dim=1)]``, then the summed
        float32 cross-entropy of each slice against its targets, over the targets counted."""
        logits = [self.head(h) for h in hidden.chunk(self.config.chunks, dim=1)]
        targets = next_tokens(labels)
        counted = (targets != IGNORE).sum()
        total = 0.0
        for piece, target in zip(logits, targets.chunk(self.config.chunks, dim=1), strict=True):
            flat = piece.reshape(-1, piece.size(-1)).float()
            total = total + F.cross_entropy(
                flat, target.reshape(-1), ignore_index=IGNORE, reduction="sum"
            )
        self.slices += len(logits)
        return total / counted

    def proof(self, steps: int) -> dict[str, Any]:
        return {"slices_per_step": self.slices / max(steps, 1)}
