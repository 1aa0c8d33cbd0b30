"""One training step with the techniques applied, in the order the suite lists them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from bench.data.synthetic import Batch, split
from bench.models import ModelSpec
from bench.techniques import RunContext, Technique, Unsupported, applied, combined


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        techniques: list[Technique],
        ctx: RunContext,
        lr: float,
    ) -> None:
        self.spec, self.techniques = spec, techniques
        self.model = applied(model, techniques, ctx).train()
        if not any(p.requires_grad for p in self.model.parameters()):
            # a model quantized in 4 bits and frozen, its adapters left out: the Trainer refuses it
            raise Unsupported(
                "nothing in the model trains once its techniques are applied: add adapters (lora)"
            )
        self.optimizer = self._optimizer(lr)
        self.policy = combined([t.step() for t in techniques])
        self.micro_batches = self.policy.micro_batches
        for t in techniques:
            if (engine := t.engine(self.model, self.optimizer, self.micro_batches)) is not None:
                self.model, self.optimizer = engine
        # A prediction's folding of accumulation (bench.predict.fake): the micro-batches a step
        # runs (None: all), and a call after each one's backward (where a repeated part ends).
        self.runs: int | None = None
        self.marking: Callable[[], None] | None = None
        self.steps = 0
        self.output_dtype: torch.dtype | None = None

    def _optimizer(self, lr: float) -> torch.optim.Optimizer:
        for t in self.techniques:
            if (opt := t.make_optimizer(self.model)) is not None:
                return opt
        return torch.optim.AdamW(parameter_groups(self.model), lr=lr)

    def step(self, batch: Batch) -> torch.Tensor:
        """Forward and backward over every micro-batch, then one optimizer step; returns the mean
        loss."""
        total, policy = None, self.policy
        # Rebound, as a user's loop rebinds `x = x.to(torch.bfloat16)`: the batch as it came (fp32
        # under pure bf16) is freed here rather than held through the step beside its prepared copy.
        batch = policy.prepare(batch)
        parts = split(batch, self.micro_batches)
        for i, (inputs, labels) in enumerate(parts[: self.runs]):
            with policy.context():
                logits, loss = self.spec.forward(self.model, inputs, labels, policy.loss)
                loss = loss / self.micro_batches
            self.output_dtype = logits.dtype
            del logits  # a plain training loop would not hold the logits through backward either
            # Kept on the device: a .item() here would synchronise CUDA inside the timed step.
            if total is None:
                total = loss.detach()
            else:
                total = total + loss.detach()
            if policy.backward is not None:
                policy.backward(policy.scale_loss(loss), i == len(parts) - 1)
            else:
                policy.scale_loss(loss).backward()
            if self.marking is not None:
                self.marking()
        if policy.clip is not None:
            if policy.unscale is not None:
                policy.unscale(self.optimizer)
            policy.clip(self.optimizer)
        if policy.optimizer_step is not None:
            policy.optimizer_step(self.optimizer)
        else:
            self.optimizer.step()
        if policy.zero_grad is not None:
            policy.zero_grad(self.optimizer)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        policy.after()
        self.steps += 1
        return total

    def proof(self) -> dict[str, object]:
        own = {"micro_batches": self.micro_batches, "output_dtype": str(self.output_dtype)}
        return own | techniques_proof(self.techniques, self.steps)


def techniques_proof(techniques: list[Technique], steps: int) -> dict[str, object]:
    """Each technique's evidence of application, under its name."""
    out: dict[str, object] = {}
    for t in techniques:
        out |= {f"{t.name or type(t).__name__}.{k}": v for k, v in t.proof(steps).items()}
    return out


def parameter_groups(model: nn.Module) -> list[dict[str, list[nn.Parameter]]]:
    """The parameters, those split across ranks (DTensors) in a group apart from whole ones: the
    foreach kernels a CUDA optimizer picks refuse a list that mixes them, as tensor parallelism's
    does (its embeddings and norms stay whole)."""
    from torch.distributed.tensor import DTensor

    groups: dict[bool, list[nn.Parameter]] = {}
    for p in model.parameters():
        groups.setdefault(isinstance(p, DTensor), []).append(p)
    return [{"params": params} for params in groups.values()]
