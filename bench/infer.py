"""One inference step (forward only) with the techniques applied, for suites with ``mode =
"inference"``."""

from __future__ import annotations

import torch
from torch import nn

from bench.data.synthetic import Batch
from bench.models import ModelSpec
from bench.techniques import RunContext, Technique, applied, combined
from bench.train import techniques_proof


def forward(spec: ModelSpec, model: nn.Module, techniques: list[Technique], batch: Batch) -> Batch:
    """The logits of one batch through the techniques' batch preparation and step contexts
    (autocast, 16-bit inputs, channels_last, inference mode), with the labels as prepared."""
    policy = combined([t.step() for t in techniques])
    inputs, labels = policy.prepare(batch)
    with policy.context():
        return spec.logits(model, inputs), labels


class Inferencer:
    """Eval mode, no optimizer, and no gradients: ``torch.no_grad()`` always, inside which a
    technique may enter a stronger context (``inference_mode``). Same interface as ``Trainer`` for
    the worker."""

    optimizer = None

    def __init__(
        self, model: nn.Module, spec: ModelSpec, techniques: list[Technique], ctx: RunContext
    ) -> None:
        self.spec, self.techniques = spec, techniques
        self.model = applied(model, techniques, ctx).eval()
        self.steps = 0
        self.output_dtype: torch.dtype | None = None
        self.inference_tensors = False

    @torch.no_grad()
    def step(self, batch: Batch) -> torch.Tensor:
        logits, _ = forward(self.spec, self.model, self.techniques, batch)
        # Flags only: holding the logits would keep them alive into the next measured step.
        self.output_dtype, self.inference_tensors = logits.dtype, logits.is_inference()
        self.steps += 1
        return logits

    def proof(self) -> dict[str, object]:
        own = {"output_dtype": str(self.output_dtype), "inference_tensors": self.inference_tensors}
        return own | techniques_proof(self.techniques, self.steps)
