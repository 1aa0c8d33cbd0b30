"""The plans advice chooses among: one option (or none) on each axis of the catalogue, combined.

An axis holds the techniques that save the same kind of memory in different ways (activations: recompute them or
move them to the host), so a plan takes at most one of each. The options are the catalogue's techniques with the
settings that matter for memory (checkpoint every-k, accumulation factors, optimizer kinds, precisions, offload,
and sharding when the plan spans processes); whether a combination can run is the suite loader's own check."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from bench.models import ModelSpec
from bench.spec import RunSpec, TechniqueSpec
from bench.suite.techniques import techniques as checked


@dataclass(frozen=True)
class Option:
    """One choice on an axis: ``name`` is its part of the plan's run name ("checkpoint-every-2")."""

    name: str
    technique: TechniqueSpec
    computes: str | None = None  # the dtype its kernels compute in, where it changes it ("bfloat16", "int8")

    @staticmethod
    def of(name: str, technique: str, computes: str | None = None, **options: Any) -> Option:
        return Option(name, TechniqueSpec(technique, tuple(sorted(options.items()))), computes)

    @property
    def countable(self) -> bool:
        """Whether counting FLOPs and bytes says what it costs: not where it changes the dtype, whose speed is the
        device's."""
        return self.computes is None


@dataclass(frozen=True)
class Axis:
    """Options of which a plan takes at most one (exactly one where ``required``: sharding over processes)."""

    name: str
    options: tuple[Option, ...]
    required: bool = False

    @property
    def choices(self) -> tuple[Option | None, ...]:
        return self.options if self.required else (None, *self.options)


@dataclass(frozen=True)
class Plan:
    options: tuple[Option, ...]

    @property
    def name(self) -> str:
        return "+".join(o.name for o in self.options) or "baseline"

    @property
    def techniques(self) -> tuple[TechniqueSpec, ...]:
        return tuple(o.technique for o in self.options)

    def spec(self, template: RunSpec) -> RunSpec:
        return replace(template, name=self.name, techniques=self.techniques, baseline=template.name)


def axes(model: ModelSpec, mode: str, nproc: int, batch: int) -> list[Axis]:
    """The catalogue's options for a model in a mode, spanning ``nproc`` processes at ``batch`` per process.
    CUDA-only options (offload, the host optimizer) stay in: a CPU plan drops them as unsupported."""
    if mode == "inference":
        return [Axis("precision", (Option.of("amp-bf16", "amp", "bfloat16", dtype="bfloat16"),
                                   Option.of("half-fp16", "half", "float16"),
                                   Option.of("half-bf16", "half", "bfloat16", dtype="bfloat16"))),
                Axis("quantization", (Option.of("dynamic-int8", "dynamic-int8", "int8"),)),
                Axis("autograd", (Option.of("inference-mode", "inference-mode"),))]
    found = [
        Axis("precision", (Option.of("amp-bf16", "amp", "bfloat16", dtype="bfloat16"),
                           Option.of("bf16-pure", "bf16", "bfloat16"))),
        Axis("activations", (Option.of("selective-checkpoint", "selective-checkpoint"),
                             Option.of("checkpoint-every-2", "checkpoint", every=2),
                             Option.of("checkpoint", "checkpoint"), Option.of("offload", "offload"),
                             Option.of("activation-offload", "activation-offload"))),
        # Adafactor and SGD at the learning rate the shipped suites measured them with.
        Axis("optimizer", (Option.of("adamw-8bit", "adamw-8bit"),
                           Option.of("adafactor", "optimizer", kind="adafactor", lr=0.01),
                           Option.of("sgd-momentum", "optimizer", kind="sgd", lr=0.01),
                           Option.of("optimizer-in-backward", "optimizer-in-backward"),
                           Option.of("cpu-offload-optimizer", "cpu-offload-optimizer"), Option.of("galore", "galore"))),
        Axis("accumulation", tuple(Option.of(f"accumulate-{k}", "accumulate", micro_batches=k)
                                   for k in (2, 4, 8) if batch % k == 0)),
    ]
    if model.objective == "next-token":  # the logits over the vocabulary, a chunk at a time
        found.append(Axis("loss", (Option.of("chunked-loss", "chunked-loss"),)))
    if nproc > 1:
        found.append(Axis("sharding", (Option.of("ddp", "ddp"), Option.of("fsdp", "fsdp"),
                                       Option.of("fsdp-bf16", "fsdp", mixed_precision="bfloat16"),
                                       Option.of("fsdp-keep", "fsdp", reshard_after_forward=False)), required=True))
    return [a for a in found if a.options]


def combinations(found: list[Axis]) -> Iterator[Plan]:
    """Every plan taking at most one option of each axis (exactly one of a required axis)."""
    for chosen in itertools.product(*(a.choices for a in found)):
        yield Plan(tuple(o for o in chosen if o is not None))


def problems(plan: Plan, template: RunSpec) -> list[str]:
    """Why the plan cannot be a run of a suite with the template's shapes (empty: it can), as the loader says."""
    raw = [{"name": t.name, **dict(t.options)} for t in plan.techniques]
    found: list[str] = []
    checked(raw, plan.name, None, {"gpu": template.gpu, "cpu": template.cpu}, template.mode, found)
    return found
