"""``bench fit``: the largest batch that really fits a memory budget, measured, beside the predicted
one.

Each probe is a run of its own (one warm-up and one timed step, no fidelity phase) at one batch
size. On CUDA the process's allocator is limited to the budget
(``torch.cuda.set_per_process_memory_fraction``), so a batch that does not fit runs out of memory as
on a smaller card; on a CPU, which has no allocator to limit, the budget holds against the tracked
peak of live tensor bytes. The search is the prediction's (bench.predict.budget): a line through the
last two peaks, with bisection behind it.

The prediction must never promise a batch that runs out of memory (predicted ≤ measured), and should
lie within 5% below the measured largest batch.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from bench import results
from bench.launch import Device
from bench.launch.local import run_isolated
from bench.predict import largest_batch
from bench.predict.budget import largest_batch_on
from bench.predict.cards import Card
from bench.record import Record, Status
from bench.suite import RunSpec

CLOSE = 0.05  # how far below the measured largest batch the predicted one may lie


class ProbeFailed(Exception):
    """A probe ended in neither ok nor oom: the run cannot be fitted here (its status and
    message)."""


@dataclass(frozen=True)
class Probe:
    """One batch size tried: how its run ended, and its peak (allocated on CUDA, tracked on a
    CPU)."""

    batch_size: int
    status: Status
    peak_bytes: float | None


@dataclass(kw_only=True)
class Fit:
    """One run's largest batch under a budget, measured by probing and predicted; stored under
    results/<suite>/<device>/fit/."""

    suite: str
    run: str
    run_key: str
    device: str
    budget_bytes: int
    predicted_largest_batch: int | None
    measured_largest_batch: int | None = None
    status: Status = Status.OK
    message: str = ""
    probes: list[Probe] = field(default_factory=list)

    @property
    def promises_oom(self) -> bool:
        """The prediction promised a batch that ran out of memory."""
        both = self.predicted_largest_batch is not None and self.measured_largest_batch is not None
        return both and self.predicted_largest_batch > self.measured_largest_batch

    @property
    def close_below(self) -> bool:
        """The prediction lies at or within CLOSE below the measured largest batch."""
        measured, predicted = self.measured_largest_batch, self.predicted_largest_batch
        if measured is None or predicted is None:
            return False
        return measured * (1 - CLOSE) <= predicted <= measured

    def stored(self) -> dict[str, Any]:
        """As its file holds it, the two verdicts with it."""
        verdicts = {"promises_oom": self.promises_oom, "within_5pct_below": self.close_below}
        return asdict(self) | verdicts

    def line(self) -> str:
        """The fit in words, as the progress line says it."""
        if self.status != Status.OK:
            return f"{self.status}: {self.message}"
        flag = ""
        if self.promises_oom:
            flag = " ⚠ the prediction promises a batch that runs out of memory"
        return (
            f"largest batch measured {self.measured_largest_batch}, predicted "
            f"{self.predicted_largest_batch} ({len(self.probes)} probes){flag}"
        )


def fit_run(
    spec: RunSpec, device: Device, budget: int, limit: int = 4096, card: Card | None = None
) -> Fit:
    """One run's measured and predicted largest batch under ``budget`` bytes, and each probe taken;
    on a ``card``, the probes' allocator is capped at what the card leaves it (``budget``, its
    capacity), and the prediction is the card's verdict (bench.predict.budget.largest_batch_on)."""
    shapes = spec.shapes(device.type)
    probes: list[Probe] = []

    def measured_peak(batch: int) -> float:
        probe = replace(
            spec,
            fidelity_gpu=None,
            fidelity_cpu=None,
            **{_field(device): replace(shapes, batch_size=batch, warmup_steps=1, measure_steps=1)},
        )
        out = run_isolated(probe, device, budget=budget)
        status = out.outcome.status
        probes.append(Probe(batch, status, _peak(out)))
        if status == Status.OOM:
            return math.inf
        if status != Status.OK:
            raise ProbeFailed(f"{status} at batch {batch}: {out.outcome.message or ''}")
        return _peak(out) or 0.0

    if card:
        predicted = largest_batch_on(spec, card, limit)
    else:
        predicted = largest_batch(spec, budget, limit, device_type=device.type)
    fit = Fit(
        suite=spec.suite,
        run=spec.name,
        run_key=spec.measured_key(device.name, device.type),
        device=device.name,
        budget_bytes=budget,
        predicted_largest_batch=predicted,
        probes=probes,
    )
    try:
        fit.measured_largest_batch = largest_batch(
            spec, budget, limit, peak=measured_peak, device_type=device.type
        )
    except ProbeFailed as exc:
        fit.status, fit.message = Status.ERROR, str(exc)
    return fit


def fit_suite(
    runs: list[RunSpec],
    device: Device,
    budget: int,
    results_root: Path,
    log: TextIO | None = None,
    card: Card | None = None,
) -> list[Fit]:
    """Every run fitted, each stored under results/<suite>/<device>/fit/ as it is done."""
    log = log or sys.stderr
    # before any probe: measured rows were lost to an unwritable folder
    for suite in {spec.suite for spec in runs}:
        results.writable(
            results.suite_folder(results_root, suite, device.name) / "fit",
            "fit rows",
            "--results FOLDER",
        )
    fits = []
    for i, spec in enumerate(runs, 1):
        print(
            f"[{i}/{len(runs)}] {spec.name}: probing batch sizes under {budget / 2**30:.2f} GiB",
            file=log,
            flush=True,
        )
        fit = fit_run(spec, device, budget, card=card)
        folder = results.suite_folder(results_root, spec.suite, device.name) / "fit"
        results.write_atomic(folder / f"{results.run_stem(spec.name)}@{budget}.json", fit.stored())
        print(f"[{i}/{len(runs)}] {spec.name}: {fit.line()}", file=log, flush=True)
        fits.append(fit)
    return fits


def _field(device: Device) -> str:
    if device.type == "cuda":
        return "gpu"
    return "cpu"


def _peak(out: Record) -> float | None:
    return out.memory.peak_allocated_bytes or out.memory.peak_tensor_bytes
