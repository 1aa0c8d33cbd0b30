"""What a plan costs: its time per sample over the baseline's, and its known accuracy effect, each
figure with where it came from.

A technique's time factor is measured where a committed record of the same model on the same kind of
device has it, else counted from its prediction at the plan's shapes: the step's FLOPs
(recomputation under checkpointing included), its operators and the bytes of their tensors (the
optimizer's update, pointwise work), each at the cost a FLOP, an operator and a byte take on the
device, fitted to its measured baseline steps; and bytes moved between device and host by
offloading, at the link's stated bandwidth (hidden under compute where the technique overlaps its
copies).

What counting cannot see, a dtype's speed, is timed here where the device asked about is this CPU
(the model's own steps, bench.advise.probe), else taken from another model's record, else assumed to
be the count; plans resting on either of the last two rank after the rest (``Estimate.rank``). A
plan's factor is its techniques' factors multiplied, or its own where a record of the same model
measured the whole plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from bench.advise import probe
from bench.advise.evidence import Evidence, Figure, canonical
from bench.advise.plans import Option, Plan
from bench.record import Prediction


@dataclass(frozen=True)
class Rates:
    """A device's stated figures: its FLOP rate where no baseline record measured it, and what no
    record can."""

    flops: float  # FLOP/s of an fp32 step, where no baseline record gives the measured rate
    link: float  # bytes/s between device and host (offloading)
    source: str

    def describe(self) -> str:
        return f"link {self.link / 1e9:,.0f} GB/s (--link-gbps): {self.source}"


STATED = {
    "cuda": Rates(
        67e12,
        25e9,
        "an H100 SXM's datasheet (67 TFLOP/s fp32, where no record measured it); the link as PCIe "
        "4.0 x16's pinned copies",
    ),
    "cpu": Rates(
        100e9,
        20e9,
        "a server CPU's order of magnitude (100 GFLOP/s where no record measured it); offloading "
        "copies within its memory",
    ),
}


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Seconds a FLOP, an operator and a byte of operators' tensors take on a kind of device, fitted
    to its measured baseline steps."""

    per_flop: float
    per_op: float
    per_byte: float
    source: str

    def seconds(self, flops: float, ops: float, op_bytes: float) -> float:
        return flops * self.per_flop + ops * self.per_op + op_bytes * self.per_byte

    def describe(self) -> str:
        parts = [
            f"{1e-9 / self.per_flop:,.0f} GFLOP/s" if self.per_flop else "",
            f"{self.per_op * 1e6:.1f} µs an operator" if self.per_op else "",
            f"{1e-9 / self.per_byte:,.0f} GB/s of operators' tensors" if self.per_byte else "",
        ]
        return (
            f"{', '.join(p for p in parts if p)} (what the fit left out, it prices at zero); "
            f"{self.source}"
        )


def calibrate(
    steps: list[tuple[str, float, tuple[float, float, float]]], rates: Rates
) -> Calibration:
    """Fitted to ``steps`` (where, seconds, (FLOPs, operators, bytes)) by least squares in relative
    error, so that a tiny model's step weighs as much as a large one's, every figure at zero or
    above (each subset of the three tried). Under three steps, the FLOPs alone are fitted; with
    none, the stated FLOP rate stands."""
    kinds = "; ".join(sorted({w for w, *_ in steps}))
    if not steps:
        return Calibration(
            per_flop=1 / rates.flops,
            per_op=0.0,
            per_byte=0.0,
            source="stated: no baseline step measured on such a device",
        )
    a = np.array([counts for _, _, counts in steps], dtype=float) / np.array(
        [[t] for _, t, _ in steps]
    )
    if len(steps) >= 3:
        columns = [(0, 1, 2), (0, 2), (0, 1), (1, 2), (0,), (2,), (1,)]
    else:
        columns = [(0,)]
    best: tuple[float, np.ndarray] | None = None
    for cols in columns:
        x, *_ = np.linalg.lstsq(a[:, cols], np.ones(len(steps)), rcond=None)
        if (x >= 0).all():
            fitted = np.zeros(3)
            fitted[list(cols)] = x
            residual = float(((a @ fitted - 1) ** 2).sum())
            if not (best and best[0] <= residual):
                best = (residual, fitted)
    if best:
        fitted = best[1]
    else:
        fitted = np.array([1 / rates.flops, 0.0, 0.0])
    per_flop, per_op, per_byte = map(float, fitted)
    return Calibration(
        per_flop=per_flop,
        per_op=per_op,
        per_byte=per_byte,
        source=f"fitted to {len(steps)} measured baseline steps: {kinds}",
    )


@dataclass(frozen=True, kw_only=True)
class Estimate:
    factor: float  # time per sample over the baseline's: 1.25 is a 0.8× throughput
    sources: tuple[str, ...]  # one line per technique: its factor, and where it came from
    uncertain: tuple[str, ...] = ()  # options priced by another model's record, or by nothing
    # 0: every figure this model's record or counted; 1: another model's record; 2: assumed
    tier: int = 0

    @property
    def throughput(self) -> float:
        return 1 / self.factor

    @property
    def rank(self) -> tuple[int, float]:
        """The order plans are tried and listed in: those priced by this model's records and by
        counting first, then by another model's records (a speed-up may not carry over: bf16 made
        BERT-base 1.7× faster on the committed records' CPU and BERT-tiny 5× slower on one without
        AVX-512), then by assumption; within each, by factor to the percent (finer differences are
        counting's noise)."""
        return self.tier, round(self.factor, 2)


class Part(NamedTuple):
    """An option's time factor alone, where it came from, and its tier (see Estimate.tier)."""

    factor: float
    source: str
    tier: int


@dataclass(frozen=True, kw_only=True)
class Accuracy:
    # the worst known delta among the plan's techniques (a fraction), None: none measured
    delta: float | None
    outside_band: bool
    unknown: tuple[str, ...]  # options no fidelity record covers
    sources: tuple[str, ...]

    @property
    def points(self) -> float | None:
        if self.delta is None:
            return None
        return 100 * self.delta

    def demoted(self, tolerance_pt: float | None) -> bool:
        """Whether the plan ranks after every plan without such a loss: a known loss outside the
        baseline's seed band, unless the user accepted losses (``--tolerance-pt``; larger ones are
        dropped before this)."""
        return tolerance_pt is None and self.outside_band and (self.delta or 0.0) < 0


class Estimator:
    """Estimates for the plans of one model, from the baseline's and each option's own
    prediction."""

    def __init__(
        self,
        evidence: Evidence,
        model: str,
        device_type: str,
        rates: Rates,
        calibration: Calibration,
        baseline: Prediction,
        alone: dict[str, Prediction],
        batch: int,
        timed: dict[str, float] | None = None,
    ) -> None:
        self.evidence = evidence
        self.model = model
        self.device_type = device_type
        self.rates = rates
        self.calibration = calibration
        self.baseline = baseline
        self.alone = alone
        self.batch = batch
        # an option's step time over the baseline's, timed on this very CPU
        self.timed = timed or {}
        self._factors: dict[str, Part] = {}

    def speed(self, plan: Plan) -> Estimate:
        dtype = any(not o.countable for o in plan.options)
        if whole := self.evidence.speed(
            canonical(plan.techniques), self.model, self.device_type, dtype
        ):
            if whole.same_model and len(plan.options) > 1:
                return Estimate(
                    factor=1 / whole.value,
                    sources=(f"{plan.name}: {whole.value:.2f}× measured, {whole.source}",),
                )
        factor, sources, uncertain, tier = 1.0, [], [], 0
        for option in plan.options:
            part = self.factor(option)
            factor *= part.factor
            sources.append(f"{option.name}: {1 / part.factor:.2f}× {part.source}")
            uncertain += [option.name] if part.tier else []
            tier = max(tier, part.tier)
        return Estimate(
            factor=factor, sources=tuple(sources), uncertain=tuple(uncertain), tier=tier
        )

    def factor(self, option: Option) -> Part:
        """The option's time factor alone, and where it came from."""
        if option.name not in self._factors:
            self._factors[option.name] = self._factor(option)
        return self._factors[option.name]

    def _factor(self, option: Option) -> Part:
        """This model's record; else counting; else, for what counting cannot see (a dtype's speed),
        its steps timed here; else another model's record; else the count, assumed to hold."""
        found = self.evidence.speed(
            canonical((option.technique,)), self.model, self.device_type, not option.countable
        )
        if found and found.same_model:
            return Part(1 / found.value, f"measured, {found.source}", 0)
        counted = self.seconds(self.alone[option.name], option) / self.seconds(self.baseline, None)
        if option.countable:
            return Part(counted, "counted (FLOPs, operators and their bytes, offload bytes)", 0)
        if option.name in self.timed:
            how = f"timed on this device ({probe.STEPS} steps against the baseline's)"
            return Part(self.timed[option.name], how, 0)
        if found:
            return Part(1 / found.value, f"measured (another model), {found.source}", 1)
        return Part(
            counted, "assumed: a dtype's speed is not counted, and no record measured it", 2
        )

    def seconds(self, predicted: Prediction, option: Option | None) -> float:
        """Counted seconds per sample of a step as predicted (see the module's note)."""
        compute = self.calibration.seconds(
            predicted.flops_per_step or 0,
            predicted.ops_per_step or 0,
            predicted.op_bytes_per_step or 0,
        )
        moved = self._moved(predicted, option) / self.rates.link
        overlapped = option is not None and option.cls.overlaps_traffic
        return (max(compute, moved) if overlapped else compute + moved) / self.batch

    def _moved(self, predicted: Prediction, option: Option | None) -> float:
        """Bytes an offloading option moves between device and host a step
        (``Technique.host_traffic``): the activations it keeps off the device, down in forward and
        up in backward; a host optimizer's gradients down and weights up."""
        if option:
            traffic = option.cls.host_traffic
        else:
            traffic = ""
        if traffic == "activations":
            kept_off = self.baseline.activation_bytes - predicted.activation_bytes
            return 2 * max(kept_off, 0)
        if traffic == "optimizer":
            return 2 * self.baseline.param_bytes
        return 0.0

    def accuracy(self, plan: Plan) -> Accuracy:
        """The plan's known accuracy effect: its own fidelity record where one exists, else the
        worst of its techniques' (the same model's where measured)."""
        if not plan.options:
            return Accuracy(delta=0.0, outside_band=False, unknown=(), sources=())
        if whole := self.evidence.accuracy(canonical(plan.techniques), self.model):
            return Accuracy(
                delta=whole.value,
                outside_band=whole.outside_band,
                unknown=(),
                sources=(f"{plan.name}: {_pt(whole)}",),
            )
        found = {
            o.name: self.evidence.accuracy(canonical((o.technique,)), self.model)
            for o in plan.options
        }
        known: dict[str, Figure] = {k: f for k, f in found.items() if f is not None}
        worst = min((f.value for f in known.values()), default=None)
        return Accuracy(
            delta=worst,
            outside_band=any(f.outside_band for f in known.values()),
            unknown=tuple(k for k, f in found.items() if f is None),
            sources=tuple(f"{k}: {_pt(f)}" for k, f in known.items()),
        )


def _pt(figure: Figure) -> str:
    if figure.same_model:
        other = ""
    else:
        other = " (another model)"
    if figure.outside_band:
        band = ", outside the seed band"
    else:
        band = ""
    return f"{100 * figure.value:+.1f} pt{band}{other}, {figure.source}"
