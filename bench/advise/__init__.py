"""``bench advise``: the cheapest plans that make a model fit a budget, from the catalogue,
predictions and the committed records.

``source`` turns the model or suite asked about into a suite header and its baseline run; ``plans``
lays the catalogue out on axes; ``predictions`` predicts plans in processes, cached; ``evidence``
reads what the records measured; ``estimate`` costs a plan; ``search`` walks the plans cheapest
first; ``write`` prints the table and writes the advice suite file."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from bench.advise import probe
from bench.advise.estimate import STATED, Calibration, Estimator, Rates, calibrate
from bench.advise.evidence import Evidence
from bench.advise.plans import Axis, Option, Plan, axes, problems
from bench.advise.predictions import Predictions
from bench.advise.probe import time_factors
from bench.advise.search import Candidate, Search, Searcher
from bench.advise.source import Source, source
from bench.predict.budget import Budget, fewest_ranks, runs_at
from bench.provenance import EMULATED_BF16, device_name, native_bf16
from bench.record import Prediction
from bench.spec import RunSpec

MOST_RANKS = 8  # nothing fits: the fewest ranks fsdp would need are looked for up to a node's GPUs
PREDICTION_LIMIT = 32  # combinations predicted at most, beyond the options alone
CACHE = Path(".cache/predictions")  # beside results/, never in it: its files are not records
EMULATED = EMULATED_BF16


@dataclass(kw_only=True)
class Advice:
    source: Source
    device_type: str
    budget: int
    budget_text: str
    baseline: Prediction
    plans: list[Candidate]  # ranked, each fitting
    search: Search
    estimator: Estimator
    # nothing fits: the plan that saves most (None: none could be predicted)
    closest: Candidate | None = None
    needs: tuple[str, ...] = ()  # nothing fits: what the closest plan would need
    predicted: int = 0
    reused: int = 0
    max_batch: bool = False  # plans ranked by their largest batch, and written at it

    @property
    def template(self) -> RunSpec:
        return self.source.template


def advise(
    src: Source,
    budget: Budget,
    device_type: str = "cuda",
    nproc: int = 1,
    top: int = 5,
    tolerance_pt: float | None = None,
    max_batch: bool = False,
    results: Path = Path("results"),
    jobs: int = 1,
    link_gbps: float | None = None,
    log: TextIO | None = None,
) -> Advice:
    """The ``top`` cheapest plans for ``src`` whose predicted peak at ``device_type``'s shapes fits
    ``budget`` (with ``max_batch``, those fitting the largest batch); see bench.advise.search for
    how they are found."""
    template = replace(src.template, nproc=nproc)
    batch = template.shapes(device_type).batch_size
    found = axes(src.model, src.mode, nproc=nproc, batch=batch, own=src.own)
    base = Plan(tuple(o for a in found if a.required for o in a.options[:1]))  # over processes: ddp
    if link_gbps is None:
        rates = STATED[device_type]
    else:
        rates = replace(STATED[device_type], link=link_gbps * 1e9)
    evidence = Evidence(results, src.mode, device_name(device_type) if device_type == "cpu" else "")
    model = template.model_on(device_type)
    log = log or sys.stderr  # as it is now, not at import
    predictions = Predictions(device_type, folder=CACHE, jobs=jobs, log=log, card=budget.card)
    try:
        calibration = _calibration(evidence, device_type, rates, predictions)
        timed = _timed(template, found, device_type, log)
        searcher = Searcher(
            template,
            base,
            found=found,
            predictions=predictions,
            estimator=lambda b, alone: Estimator(
                evidence,
                model,
                device_type=device_type,
                rates=rates,
                calibration=calibration,
                baseline=b,
                alone=alone,
                batch=batch,
                timed=timed,
            ),
            log=log,
            unfit=_unfit(device_type),
        )
        baseline, estimator = searcher.singles()
        limit = budget.bytes(baseline.peak_tensor_bytes)
        kept = searcher.pruned_axes(estimator)
        advice = Advice(
            source=src,
            device_type=device_type,
            budget=limit,
            budget_text=budget.text,
            baseline=baseline,
            plans=[],
            search=searcher.search,
            estimator=estimator,
            max_batch=max_batch,
        )
        strongest = _strongest(searcher, kept, predictions, estimator)
        if strongest is None or not strongest.predicted.fits(limit):
            # nothing saves more: nothing fits
            advice.closest = strongest
            if strongest is not None:
                _needs(advice, strongest, predictions)
        else:
            if max_batch:
                want = 3 * top
            else:
                want = top
            search = searcher.walk(
                kept,
                estimator,
                budget=limit,
                want=want,
                tolerance_pt=tolerance_pt,
                limit=PREDICTION_LIMIT,
                chunk=max(jobs, 2),
                minimal=not max_batch,
            )
            # the walk's limit reached first: the plan known to fit
            advice.plans = search.fits or [strongest]
            _rank(advice, predictions, top=top, max_batch=max_batch, tolerance_pt=tolerance_pt)
    except BaseException:
        predictions.close(interrupted=True)
        raise
    predictions.close()
    advice.predicted, advice.reused = predictions.made, predictions.reused
    return advice


def _unfit(device_type: str) -> Callable[[Option], list[str]]:
    """Why an option is no plan for the device asked about: on a CPU whose kernels have no native
    bf16 (oneDNN's own test, which PyTorch's CPU paths use: AVX-512, or Arm's bf16), bf16 runs on
    emulated kernels, as float16 does on every CPU (which the harness calls unsupported there). On
    such a VM a BERT-base bf16 step took 173 s, fp32's 11 s; ResNet-50's 10.3 s and 0.95 s."""
    if device_type != "cpu" or native_bf16():
        return lambda option: []
    return lambda option: [EMULATED] if option.computes == "bfloat16" else []


def _timed(template: RunSpec, found: list[Axis], device_type: str, log: TextIO) -> dict[str, float]:
    """The dtype options' step times over the baseline's, timed here where the device asked about is
    this CPU (one process: its records of a dtype may not exist yet, and counting cannot price one).
    A card is asked about from afar: its dtypes' speeds come from its records."""
    unfit = _unfit(device_type)
    chosen = [o for a in found for o in a.options if not o.countable and not unfit(o)]
    if device_type != "cpu" or template.nproc > 1 or not chosen:
        return {}
    print(
        f"advise: timing {', '.join(o.name for o in chosen)} against the baseline here "
        f"({probe.STEPS} steps each)",
        file=log,
        flush=True,
    )
    return time_factors(
        Plan(()).spec(template), {o.name: Plan((o,)).spec(template) for o in chosen}
    )


def _calibration(
    evidence: Evidence, device_type: str, rates: Rates, predictions: Predictions
) -> Calibration:
    """The device's seconds a FLOP and an operator, from its measured baseline steps; a record older
    than its counts is counted again (predicted at its own shapes, cached)."""
    records = evidence.baselines(device_type)
    counts = predictions.peaks([RunSpec.from_dict(r.identity.spec) for r in records])
    steps = [
        (
            f"{r.identity.model} (results/{r.identity.suite})",
            r.timing.step_time_ms_median / 1000,
            (c.flops_per_step, c.ops_per_step, c.op_bytes_per_step),
        )
        for r, c in zip(records, counts)
        if c.ok
    ]
    return calibrate(steps, rates)


def _rank(
    advice: Advice, predictions: Predictions, top: int, max_batch: bool, tolerance_pt: float | None
) -> None:
    """The top plans, each with its largest batch; with ``max_batch`` ranked by it first."""
    if not max_batch:
        advice.plans = advice.plans[:top]
    specs = [c.plan.spec(advice.template) for c in advice.plans]
    owns = [c.predicted for c in advice.plans]
    for candidate, largest in zip(
        advice.plans, predictions.largest_batches(specs, advice.budget, owns)
    ):
        candidate.largest_batch = largest
    if max_batch:
        advice.plans = sorted(
            advice.plans,
            key=lambda c: (c.accuracy.demoted(tolerance_pt), -(c.largest_batch or 0), c.speed.rank),
        )[:top]


def _strongest(
    searcher: Searcher, kept: list[Axis], predictions: Predictions, estimator: Estimator
) -> Candidate | None:
    """The plan of each axis's most saving option, predicted first: if it does not fit, nothing
    does."""
    plan = searcher.strongest(kept)
    if plan is None:
        return None
    out = predictions.peaks([plan.spec(searcher.template)])[0]
    if not out.ok:
        return None
    return Candidate(
        plan=plan, predicted=out, speed=estimator.speed(plan), accuracy=estimator.accuracy(plan)
    )


def _needs(advice: Advice, closest: Candidate, predictions: Predictions) -> None:
    """Nothing fits: what the plan that saves most would need (a smaller batch, more ranks, or more
    memory)."""
    spec = closest.plan.spec(advice.template)
    needs = [
        f"{closest.peak / 2**30:,.2f} GiB for tensors at batch "
        f"{spec.shapes(advice.device_type).batch_size}"
    ]
    smaller = predictions.largest_batches([spec], advice.budget, [closest.predicted])[0]
    needs.append(
        f"a batch of {smaller} (its largest that fits)"
        if smaller
        else "a smaller model: even a batch of one does not fit"
    )
    if advice.device_type == "cuda" and spec.nproc == 1:
        # sharded over ranks instead: the fewest that fit
        sharded = Plan((*closest.plan.options, Option.of("fsdp", "fsdp")))
        wide = replace(sharded.spec(advice.template), nproc=MOST_RANKS)
        if not problems(sharded, advice.template) and runs_at(wide, MOST_RANKS):
            if (ranks := fewest_ranks(wide, advice.budget)) is not None:
                needs.append(f"fsdp over {ranks} ranks (--nproc {ranks})")
    advice.needs = tuple(needs)


__all__ = ["Advice", "advise", "source"]
