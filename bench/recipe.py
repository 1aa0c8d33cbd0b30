"""One recipe for every run: a RunSpec becomes its model, its techniques and a Trainer (or
Inferencer) the same way in a measured run, a prediction on fake tensors, the fidelity phase and the
tests, so that what is predicted and what is checked for accuracy is what was measured."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from bench import models
from bench.data import varlen
from bench.data.synthetic import Batch, clone_batch, synthetic_batch
from bench.generate import Generator
from bench.infer import Inferencer
from bench.record import Provenance
from bench.spec import RunSpec, Shapes
from bench.techniques import RunContext, Technique, build
from bench.techniques.padding import PadToMax
from bench.train import Trainer

# what takes a run's steps: training, forward passes, generation
Stepper = Trainer | Inferencer | Generator


@dataclass(kw_only=True)
class Recipe:
    """A run's context and techniques (built once, applied in the suite's order), its mode and
    seed."""

    ctx: RunContext
    techniques: list[Technique]
    mode: str  # train, inference or generate
    seed: int

    @property
    def inference(self) -> bool:
        """No backward: forward passes only, or generation."""
        return self.mode != "train"

    @classmethod
    def of(
        cls,
        spec: RunSpec,
        device: torch.device,
        shapes: Shapes | None = None,
        *,
        model: str | None = None,
        lr: float | None = None,
        seed: int | None = None,
        predicting: bool = False,
        world_size: int = 1,
        rank: int = 0,
    ) -> Recipe:
        """The recipe of ``spec`` on ``device`` at ``shapes`` (default: the spec's for that device
        type). The fidelity phase names its stand-in ``model``, its ``lr`` and each ``seed``;
        ``predicting``: fake tensors on the CPU standing for a CUDA run."""
        if lr is None:
            lr = spec.lr
        shapes = shapes or spec.shapes(device.type)
        ctx = RunContext(
            device=device,
            model_spec=models.resolve(model or shapes.model or spec.model),
            shapes=shapes,
            lr=lr,
            predicting=predicting,
            world_size=world_size,
            rank=rank,
        )
        return cls(
            ctx=ctx,
            techniques=[build(t) for t in spec.techniques],
            mode=spec.mode,
            seed=spec.seed if seed is None else seed,
        )

    def unsupported(self) -> str | None:
        """The model's or the first technique's reason it cannot run here (``"name: reason"``); None
        when all can."""
        spec = self.ctx.model_spec
        if not spec.cpu and self.ctx.device.type == "cpu" and not self.ctx.predicting:
            return (
                f"model {spec.name}: {spec.off_cpu}; it is predicted (bench predict) and runs on "
                "CUDA"
            )
        return next(
            (f"{t.name}: {r}" for t in self.techniques if (r := t.unsupported(self.ctx))), None
        )

    def model(self, weights: str | None = None) -> tuple[nn.Module, Provenance]:
        """The plain model on the device, initialised from the seed (then ``weights``), with what
        loading found."""
        torch.manual_seed(self.seed)
        model, figures = models.build_model(self.ctx.model_spec, self.ctx.shapes, weights)
        return model.to(self.ctx.device), figures

    def stepper(
        self,
        model: nn.Module,
        techniques: list[Technique] | None = None,
        inference: bool | None = None,
    ) -> Stepper:
        """``model`` with ``techniques`` (default: the recipe's) applied, in a Trainer, an
        Inferencer for an inference run, or a Generator; the fidelity phase trains an inference
        run's plain model first (``inference=False``)."""
        if techniques is None:
            techniques = self.techniques
        if inference is False or (inference is None and self.mode == "train"):
            return Trainer(model, self.ctx.model_spec, techniques, self.ctx, self.ctx.lr)
        if self.mode == "generate":
            return Generator(model, self.ctx.model_spec, techniques, self.ctx)
        return Inferencer(model, self.ctx.model_spec, techniques, self.ctx)

    def batch(self) -> Batch:
        """The synthetic batch every measured step takes, from the seed: generation's, its
        prompts."""
        shapes = self.ctx.shapes
        if self.mode == "generate":
            shapes = dataclasses.replace(shapes, seq_len=shapes.prompt_len)
        batch = synthetic_batch(self.ctx.model_spec, shapes, self.seed, self.ctx.device)
        if shapes.lengths is not None:  # the loader's batches are the steps' (``feed``)
            return batch
        parts = math.prod(t.batch_multiple() for t in self.techniques)  # its micro-batches
        formed = (t.fixed(batch, self.ctx, parts) for t in self.techniques)
        return next((b for b in formed if b is not None), batch)

    def _batching(self) -> varlen.Batching | None:
        """The first technique's way of forming batches from variable-length sequences, if one has
        it."""
        return next((b for t in self.techniques if (b := t.batching(self.ctx)) is not None), None)

    def regroup(self, batch: Batch) -> Batch:
        """A padded batch of real data (the fidelity phase's) formed again by the run's
        batch-forming technique, if it has one: what it is trained and evaluated on is what it
        measured."""
        batching = self._batching()
        if batching is None:
            return batch
        return varlen.regroup(batch, batching.collate)

    def feed(self) -> varlen.Feed | None:
        """Where the shapes name a length distribution, the DataLoader feed every step takes its
        batch from, collated by the run's batch-forming technique (padding to seq_len where it has
        none); else None."""
        ctx = self.ctx
        if ctx.shapes.lengths is None:
            return None
        batching = self._batching() or PadToMax().batching(ctx)
        data = varlen.sequences(
            varlen.parse(ctx.shapes.lengths),
            ctx.model_spec,
            varlen.dataset_size(ctx.shapes),
            self.seed,
        )
        feed = varlen.Feed(
            data=data, batching=batching, shapes=ctx.shapes, device=ctx.device, seed=self.seed
        )
        if ctx.shapes.worst_step:
            feed.worst()  # found now, on real values: a prediction collates under fake tensors
        return feed


def batches(batch: Batch, feed: varlen.Feed | None, n: int) -> Iterator[Batch]:
    """The batches of ``n`` steps: the loader's, the same ones on every pass, or the one synthetic
    batch."""
    if feed is not None:
        return feed.batches(n)
    return itertools.repeat(batch, n)


def tracked_steps(
    trainer: Stepper,
    batch: Batch,
    feed: varlen.Feed | None,
    steps: int,
    counted: Callable[[], AbstractContextManager[object]] = nullcontext,
    ended: Callable[[], None] | None = None,
) -> Callable[[], object]:
    """What the instrumented pass runs: one step on a fresh copy of the synthetic batch (allocated
    inside it, the batch counts as it does on CUDA), or, on variable-length data, the timed pass's
    ``steps`` batches, whose peaks differ with their lengths, ``ended`` called after each.
    ``counted`` is entered around the steps themselves (a prediction's counters), not the copy."""

    if feed is None:

        def one() -> object:
            # handed over, not named: a name would hold the copy through a step that frees it
            # (pure bf16 rebinds the batch to its bf16 copy)
            fresh = [clone_batch(batch)]
            with counted():
                return trainer.step(fresh.pop())

        return one
    loader = feed

    def loaded() -> object:
        out = []
        with counted():
            for b in loader.batches(steps):
                out.append(trainer.step(b))
                if ended is not None:
                    ended()
        return out

    return loaded
