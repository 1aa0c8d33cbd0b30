"""TRL's SFTTrainer losses, as its ``loss_type`` runs them (trl/trainer/sft_trainer.py, TRL at
f2cd577): ``chunked_nll``, its default, and ``nll``, the model's own loss with the token metrics
SFTTrainer logs at every step. A job's SFTConfig names one (bench.suite.training_args); neither is
advised, being a TRL job's own loss rather than a choice advice weighs (``chunked-loss`` is)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from bench.models import IGNORE
from bench.techniques.base import TECHNIQUES, RunContext, Step, Technique, Unsupported
from bench.techniques.loss import _HiddenStates

CHUNK = 256  # sft_trainer._CHUNKED_LM_HEAD_CHUNK_SIZE
ENTROPY_ROWS = 128  # trl.trainer.utils.entropy_from_logits' chunk_size
NOT_ADVISED = "a TRL job's own loss, read from its SFTConfig's loss_type"


def _head(model: nn.Module, ctx: RunContext) -> nn.Linear:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise Unsupported(
            f"model {ctx.model_spec.name} has no linear output head (get_output_embeddings)"
        )
    return head


@TECHNIQUES.register("sft-chunked-nll")
class SFTChunkedNLL(Technique):
    """SFTTrainer's default loss: the head never runs on the whole sequence. The last hidden states
    and the labels, shifted by one position, have the positions with a target gathered to the front
    (an argsort of the mask, so masked positions fall in a tail that is skipped), and the head and
    its cross-entropy run on 256 positions at a time, each chunk under non-reentrant checkpointing:
    its logits (float32, or the autocast dtype), log-softmax, argmax and entropy live only while it
    runs, in forward and again in backward. The loss sums over chunks and divides by the positions
    with a target.

    Expected: the full logits never exist (Llama-3 at 8 × 2,048 tokens: 7.8 GiB in float32); one
    chunk's are 256 × vocabulary. Throughput: the head's matmul runs once more, in backward's
    recomputation. Accuracy: the full cross-entropy's, up to float rounding."""

    not_advised = NOT_ADVISED
    summary = (
        "TRL SFTTrainer's default loss (`chunked_nll`): the head and cross-entropy on 256 target "
        "positions at a time, each chunk checkpointed"
    )
    inputs, objective = "tokens", "next-token"
    stand_ins = {f"{__name__}:targets": "bench.predict.stand_ins:every_position_a_target"}

    def unsupported(self, ctx: RunContext) -> str | None:
        if ctx.model_spec.objective != self.objective:
            return f"applies to next-token models; model {ctx.model_spec.name} classifies"
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.head, self.chunks = _head(model, ctx), 0
        config = getattr(model, "config", None)
        # Cohere's scale and Gemma's soft-capping, which TRL applies to each chunk's logits
        self.scale = getattr(config, "logit_scale", None) or 1.0
        self.softcap = getattr(config, "final_logit_softcapping", None)
        model.set_output_embeddings(_HiddenStates(self.head))
        return model

    def step(self) -> Step:
        return Step(loss=self._loss)

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = hidden[..., :-1, :].reshape(-1, hidden.size(-1))
        labels = labels[..., 1:].reshape(-1)
        valid = labels != IGNORE
        n_valid = valid.sum()
        count = targets(n_valid, valid)
        if count == 0:  # the whole micro-batch masked: a loss of zero that reaches every weight
            loss = (hidden.float().sum() + self.head.weight.float().sum()) * 0.0
            return loss if self.head.bias is None else loss + self.head.bias.float().sum() * 0.0
        order = valid.to(torch.int8).argsort(descending=True, stable=True)
        hidden, labels = hidden[order], labels[order]
        loss = hidden.new_zeros((), dtype=torch.float32)
        correct = hidden.new_zeros((), dtype=torch.float32)
        entropy = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, math.ceil(count / CHUNK) * CHUNK, CHUNK):
            chunk_loss, chunk_correct, chunk_entropy = checkpoint(
                self._chunk,
                hidden[start : start + CHUNK],
                labels[start : start + CHUNK],
                use_reentrant=False,
            )
            loss, correct = loss + chunk_loss, correct + chunk_correct
            entropy = entropy + chunk_entropy
            self.chunks += 1
        # SFTTrainer's compute_loss reads both as its logged metrics (a synchronisation each)
        (entropy / n_valid).item(), (correct / n_valid).item()
        return loss / n_valid

    def _chunk(
        self, h: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One chunk's loss, correct predictions and entropy (TRL's ``_chunk``; the head's weight
        and bias are read here rather than passed, which checkpointing treats alike)."""
        w, b = self.head.weight, self.head.bias
        logits = h.float() @ w.float().t()
        if b is not None:
            logits = logits + b.float()
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        log_p = F.log_softmax(logits, dim=-1)
        loss = F.nll_loss(log_p, labels, ignore_index=IGNORE, reduction="sum")
        valid = labels != IGNORE
        correct = ((logits.argmax(dim=-1) == labels) & valid).sum().float()
        entropy = (-(log_p.exp() * log_p).sum(dim=-1) * valid).sum()
        return loss, correct, entropy

    def proof(self, steps: int) -> dict[str, Any]:
        """The chunks a step's loss took: the full logits never existed."""
        return {"chunks_per_step": self.chunks / max(steps, 1), "chunk_positions": CHUNK}


@TECHNIQUES.register("sft-nll")
class SFTNLL(Technique):
    """SFTTrainer's ``loss_type = "nll"``: the model's own causal-LM loss (transformers'
    ``ForCausalLMLoss``: the logits upcast to float32, the labels shifted), then, before backward
    and with the logits still held, the metrics SFTTrainer logs under no_grad: each position's
    entropy from the shifted logits, 128 rows at a time (flattening them copies the logits where
    the batch has more than one row), their argmax, and the accuracy over positions with a target.

    Expected: the peak of a plain causal-LM step, plus the metrics' temporaries where forward's end
    is the peak (one 128-row chunk's log-softmax and its exponent, the argmax)."""

    not_advised = NOT_ADVISED
    summary = (
        "TRL SFTTrainer's `nll` loss: the model's own causal-LM loss, then its token entropy and "
        "accuracy under no_grad with the logits held"
    )
    inputs, objective = "tokens", "next-token"

    def unsupported(self, ctx: RunContext) -> str | None:
        if ctx.model_spec.objective != self.objective:
            return f"applies to next-token models; model {ctx.model_spec.name} classifies"
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.metered = 0
        return model

    def step(self) -> Step:
        return Step(loss=self._loss)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from transformers.loss.loss_utils import ForCausalLMLoss

        loss = ForCausalLMLoss(logits, labels, vocab_size=logits.size(-1))
        with torch.no_grad():
            shift_logits, shift_labels = logits[..., :-1, :], labels[..., 1:]
            entropy = _entropy(shift_logits)
            predictions = shift_logits.argmax(dim=-1)
            mask = shift_labels != IGNORE
            entropy_sum, total = (entropy * mask).sum(), mask.sum()
            correct = ((predictions == shift_labels) & mask).sum()
            # SFTTrainer reads both (a synchronisation each), as logged metrics
            (entropy_sum / total).item(), (correct / total).item()
        self.metered += 1
        return loss

    def proof(self, steps: int) -> dict[str, Any]:
        """The forwards whose token metrics were computed: SFTTrainer computes them at every one."""
        return {"metered_forwards_per_step": self.metered / max(steps, 1)}


def targets(count: torch.Tensor, valid: torch.Tensor) -> int:
    """The positions with a target, as TRL reads them off the device to count its chunks."""
    return int(count)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's entropy, ENTROPY_ROWS rows of the flattened logits at a time
    (trl.trainer.utils.entropy_from_logits)."""
    flat = logits.reshape(-1, logits.size(-1))
    out = []
    for chunk in flat.split(ENTROPY_ROWS, dim=0):
        log_p = F.log_softmax(chunk, dim=-1)
        out.append(-(torch.exp(log_p) * log_p).sum(-1))
    return torch.cat(out).reshape(logits.shape[:-1])
