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
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from bench import results
from bench.launch import Device
from bench.launch.local import run_isolated
from bench.predict import largest_batch
from bench.predict.budget import largest_batch_on
from bench.predict.cards import Card
from bench.record import KEY, Record, Status
from bench.suite import RunSpec

CLOSE = 0.05  # how far below the measured largest batch the predicted one may lie


class ProbeFailed(Exception):
    """A probe ended in neither ok nor oom: the run cannot be fitted here (its status and
    message)."""


def fit_run(
    spec: RunSpec, device: Device, budget: int, limit: int = 4096, card: Card | None = None
) -> dict[str, Any]:
    """One run's measured and predicted largest batch under ``budget`` bytes, and each probe taken;
    on a ``card``, the probes' allocator is capped at what the card leaves it (``budget``, its
    capacity), and the prediction is the card's verdict (bench.predict.budget.largest_batch_on)."""
    shapes = spec.shapes(device.type)
    probes: list[dict[str, Any]] = []

    def measured_peak(batch: int) -> float:
        probe = replace(
            spec,
            fidelity_gpu=None,
            fidelity_cpu=None,
            **{_field(device): replace(shapes, batch_size=batch, warmup_steps=1, measure_steps=1)},
        )
        out = run_isolated(probe, device, budget=budget)
        status = out.outcome.status
        probes.append({KEY.batch_size: batch, KEY.status: status, "peak_bytes": _peak(out)})
        if status == Status.OOM:
            return math.inf
        if status != Status.OK:
            raise ProbeFailed(f"{status} at batch {batch}: {out.outcome.message or ''}")
        return _peak(out) or 0.0

    row: dict[str, Any] = {KEY.run: spec.name, "budget_bytes": budget, KEY.device: device.name}
    if card:
        row["predicted_largest_batch"] = largest_batch_on(spec, card, limit)
    else:
        row["predicted_largest_batch"] = largest_batch(spec, budget, limit, device_type=device.type)
    try:
        row["measured_largest_batch"] = largest_batch(
            spec, budget, limit, peak=measured_peak, device_type=device.type
        )
        row[KEY.status] = Status.OK
    except ProbeFailed as exc:
        row |= {KEY.status: Status.ERROR, KEY.message: str(exc)}
    return row | {"probes": probes} | verdict(row)


def verdict(row: dict[str, Any]) -> dict[str, Any]:
    """Whether the prediction promised a batch that runs out of memory, and whether it lies close
    below."""
    predicted, measured = row.get("predicted_largest_batch"), row.get("measured_largest_batch")
    if predicted is None or measured is None:
        return {}
    return {
        "promises_oom": predicted > measured,
        "within_5pct_below": measured * (1 - CLOSE) <= predicted <= measured,
    }


def fit_suite(
    runs: list[RunSpec],
    device: Device,
    budget: int,
    results_root: Path,
    log: TextIO | None = None,
    card: Card | None = None,
) -> list[dict[str, Any]]:
    """Every run fitted, each stored under results/<suite>/<device>/fit/ as it is done."""
    log = log or sys.stderr
    # before any probe: measured rows were lost to an unwritable folder
    for suite in {spec.suite for spec in runs}:
        results.writable(
            results.suite_folder(results_root, suite, device.name) / "fit",
            "fit rows",
            "--results FOLDER",
        )
    rows = []
    for i, spec in enumerate(runs, 1):
        print(
            f"[{i}/{len(runs)}] {spec.name}: probing batch sizes under {budget / 2**30:.2f} GiB",
            file=log,
            flush=True,
        )
        row = fit_run(spec, device, budget, card=card) | {
            KEY.suite: spec.suite,
            KEY.run_key: spec.measured_key(device.name, device.type),
        }
        folder = results.suite_folder(results_root, spec.suite, device.name) / "fit"
        results.write_atomic(folder / f"{results.run_stem(spec.name)}@{budget}.json", row)
        print(f"[{i}/{len(runs)}] {spec.name}: {row_line(row)}", file=log, flush=True)
        rows.append(row)
    return rows


def row_line(row: dict[str, Any]) -> str:
    if row[KEY.status] != Status.OK:
        return f"{row[KEY.status]}: {row[KEY.message]}"
    if row.get("promises_oom"):
        flag = " ⚠ the prediction promises a batch that runs out of memory"
    else:
        flag = ""
    return (
        f"largest batch measured {row['measured_largest_batch']}, predicted "
        f"{row['predicted_largest_batch']} ({len(row['probes'])} probes){flag}"
    )


def _field(device: Device) -> str:
    if device.type == "cuda":
        return "gpu"
    return "cpu"


def _peak(out: Record) -> float | None:
    return out.memory.peak_allocated_bytes or out.memory.peak_tensor_bytes
