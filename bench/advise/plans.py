"""The plans advice chooses among: one option (or none) on each axis of the catalogue, combined.

An axis holds the techniques that save the same kind of memory in different ways (activations:
recompute them or move them to the host), so a plan takes at most one of each. The catalogue is what
each technique declares (``Technique.axis`` and ``offers``: checkpoint every-k, accumulation
factors, optimizer kinds, precisions, offload, and sharding when the plan spans processes), a user's
own techniques among them where they declare an axis; whether a combination can run is the suite
loader's own check."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from bench.errors import BadInput
from bench.models import ModelSpec
from bench.spec import RunSpec, TechniqueSpec
from bench.suite.techniques import check
from bench.techniques import AXES, TECHNIQUES, Technique, build, resolve


@dataclass(frozen=True)
class Option:
    """One choice on an axis: ``name`` is its part of the plan's run name ("checkpoint-every-2")."""

    name: str
    technique: TechniqueSpec
    # the dtype its kernels compute in, where it changes it ("bfloat16", "int8")
    computes: str | None = None

    @staticmethod
    def of(name: str, technique: str, computes: str | None = None, **options: Any) -> Option:
        return Option(name, TechniqueSpec(technique, tuple(sorted(options.items()))), computes)

    @property
    def cls(self) -> type[Technique]:
        return resolve(self.technique.name)

    @property
    def multiple(self) -> int:
        """What the batch must be a multiple of (accumulation's micro-batches)."""
        return build(self.technique).batch_multiple()

    @property
    def countable(self) -> bool:
        """Whether counting FLOPs and bytes says what it costs: not where it changes the dtype,
        whose speed is the device's."""
        return self.computes is None


@dataclass(frozen=True)
class Axis:
    """Options of which a plan takes at most one (exactly one where ``required``: sharding over
    processes)."""

    name: str
    options: tuple[Option, ...]
    required: bool = False

    @property
    def choices(self) -> tuple[Option | None, ...]:
        if self.required:
            return self.options
        return (None, *self.options)


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


def axes(
    model: ModelSpec, mode: str, nproc: int, batch: int, own: tuple[str, ...] = ()
) -> list[Axis]:
    """The catalogue's options for a model in a mode, spanning ``nproc`` processes at ``batch`` per
    process: what every registered technique, and each of the user's ``own`` (module:Class) that
    declares an axis, offers (``Technique.offered``), by axis in AXES order. CUDA-only options
    (offload, the host optimizer) stay in: a CPU plan drops them as unsupported. Sharding is
    required over processes: each plan takes one way of it."""
    found: dict[str, list[Option]] = {axis: [] for axis in AXES}
    for name in (*TECHNIQUES.names(), *own):
        cls = resolve(name)
        if cls.axis and cls.axis not in AXES:
            raise BadInput(
                f"technique {name}: axis {cls.axis!r} is none of advice's: {', '.join(AXES)}"
            )
        for o in cls.offered(model, mode, nproc, batch) if cls.axis else ():
            found[cls.axis].append(Option(o.label, TechniqueSpec(name, o.options), o.computes))
    return [
        Axis(axis, tuple(options), required=all(o.cls.distributed for o in options))
        for axis, options in found.items()
        if options
    ]


def combinations(found: list[Axis]) -> Iterator[Plan]:
    """Every plan taking at most one option of each axis (exactly one of a required axis)."""
    for chosen in itertools.product(*(a.choices for a in found)):
        yield Plan(tuple(o for o in chosen if o is not None))


def problems(plan: Plan, template: RunSpec) -> list[str]:
    """Why the plan cannot be a run of a suite with the template's shapes (empty: it can), as the
    loader says."""
    found: list[str] = []
    check(
        plan.techniques,
        plan.name,
        batch=None,
        shapes={"gpu": template.gpu, "cpu": template.cpu},
        mode=template.mode,
        problems=found,
    )
    return found
