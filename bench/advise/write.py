"""Advice as the user reads it: the ranked table, one line of reasoning, where the figures came
from, and the advice suite file; after ``--measure``, the plans' measured peaks and throughput
beside their predictions."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.advise import Advice
from bench.advise.search import Candidate
from bench.advise.source import device_type_key, loaded
from bench.record import Record, Status
from bench.results import slug, write_atomic
from bench.suite.toml_text import to_toml

GIB = 2**30


def table(advice: Advice) -> str:
    """The ranked plans that fit, or what the plan that saves most would need."""
    base = advice.baseline.peak_tensor_bytes
    head = (
        f"{advice.template.model} ({advice.source.mode}, batch {_batch(advice)}, "
        f"{advice.device_type} shapes from {advice.source.origin}): baseline predicted "
        f"{base / GIB:,.2f} GiB; budget {advice.budget_text} → {advice.budget / GIB:,.2f} GiB for "
        "tensors"
    )
    if not advice.plans:
        return head + "\n\n" + nothing_fits(advice)
    if base <= advice.budget:  # said before any plan: the user's own run needs no technique to fit
        head += (
            f"\n\nThe baseline already fits ({base / GIB:,.2f} of {advice.budget / GIB:,.2f} GiB): "
            "no technique is needed. The plans below buy headroom or speed, at the accuracy each "
            "shows."
        )
    rows = [
        "| # | plan | peak GiB | headroom GiB | largest batch | est. throughput | accuracy | "
        "figures |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, c in enumerate(advice.plans, 1):
        rows.append(
            f"| {i} | {c.plan.name} | {c.peak / GIB:,.2f} | {(advice.budget - c.peak) / GIB:,.2f} "
            f"| {c.largest_batch if c.largest_batch is not None else '—'} | "
            f"{c.speed.throughput:.2f}× | {_accuracy(c)} | {_kinds(c)} |"
        )
    return "\n".join([head, "", *rows, "", reasoning(advice)])


def reasoning(advice: Advice) -> str:
    """One line for the top pick."""
    best, fits = advice.plans[0], len(advice.search.fits) or len(advice.plans)
    why = (
        f"Why {best.plan.name}: the highest estimated throughput ({best.speed.throughput:.2f}× the "
        f"baseline's) of the {fits} plan{'s' if fits > 1 else ''} found to fit, at "
        f"{best.peak / GIB:,.2f} GiB ({(advice.budget - best.peak) / GIB:,.2f} GiB spare)"
    )
    if best.accuracy.points is not None and best.plan.options:
        why += f"; known accuracy effect {best.accuracy.points:+.1f} pt"
    if best.accuracy.unknown:
        why += f"; no fidelity record for {', '.join(best.accuracy.unknown)}"
    if best.speed.uncertain:
        why += (
            f"; {', '.join(best.speed.uncertain)} priced by another model's record or assumed (no "
            "plan priced by this model's records and counting alone fit)"
        )
    elif any(c.speed.uncertain for c in advice.plans):
        why += (
            "; plans priced by another model's record or by assumption rank after those priced by "
            "this model's"
        )
    return why + "."


def nothing_fits(advice: Advice) -> str:
    if advice.closest is None:
        return "Nothing fits, and no plan could be predicted to say what would."
    c = advice.closest
    return (
        f"Nothing fits {advice.budget / GIB:,.2f} GiB. The plan that saves most, {c.plan.name}, "
        f"peaks at {c.peak / GIB:,.2f} GiB (parameters {(c.predicted.param_bytes or 0) / GIB:,.2f} "
        f"GiB). It would need {'; or '.join(advice.needs)}."
    )


def sources(advice: Advice) -> str:
    """Where each figure of the listed plans came from, and what the search tried."""
    s, est = advice.search, advice.estimator
    listed = advice.plans or ([advice.closest] if advice.closest else [])
    cal = est.calibration
    lines = [f"- time per sample: {cal.describe()}; stated: {est.rates.describe()}"]
    lines += sorted({f"- speed, {line}" for c in listed for line in c.speed.sources})
    lines += sorted({f"- accuracy, {line}" for c in listed for line in c.accuracy.sources})
    lines.append(
        f"- searched: {len(est.alone)} options alone; dropped "
        f"{len(s.dropped)}{': ' + '; '.join(s.dropped) if s.dropped else ''}; dominated "
        f"{len(s.dominated)}{': ' + ', '.join(s.dominated) if s.dominated else ''}"
    )
    lines.append(
        f"- {s.combinations:,} combinations: {s.cannot_combine:,} cannot combine, "
        f"{s.over_tolerance:,} over the accuracy tolerance, {s.skipped:,} skipped as saving less "
        f"than a plan that did not fit (or guessed well over the budget), {s.covering:,} as a plan "
        f"that fits and more at no lower cost; {advice.predicted} predictions made, "
        f"{advice.reused} reused (.cache/predictions)"
    )
    return "\n".join(lines)


def suite_file(advice: Advice, command: str, folder: Path = Path("suites")) -> Path:
    """suites/advice-<model>.toml: the baseline and the listed plans, ready for ``make bench``;
    checked by loading it before it is written."""
    name = f"advice-{slug(advice.template.model.replace(':', '-'))}"
    header = {
        "description": f"bench advise: the cheapest plans under {advice.budget_text}",
        **advice.source.header,
    }
    if advice.source.mode != "train":
        header["mode"] = advice.source.mode
    runs, comments = [{"name": "baseline", "techniques": []} | _nproc(advice)], {}
    for c in (c for c in advice.plans if c.plan.options):  # the baseline is there already
        runs.append(
            {"name": c.plan.name, "techniques": [_technique(t) for t in c.plan.techniques]}
            | _nproc(advice)
            | _own_batch(advice, c)
        )
        comments[c.plan.name] = (
            f"predicted {c.peak / GIB:,.2f} GiB, est. {c.speed.throughput:.2f}× throughput, "
            f"accuracy {_accuracy(c)}"
        )
    loaded(header | {"name": name}, runs, name)  # a file that would not load is never written
    made = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = f"# Written by `{command}` on {made}.\n" + to_toml(
        header | {"baseline": "baseline"}, runs, comments
    )
    path = folder / f"{name}.toml"
    write_atomic(path, text)
    return path


def measured(advice: Advice, records: list[Record]) -> str:
    """The listed plans as measured here: whether each fit, and the ranks by throughput, beside the
    estimates."""
    by_run = _ok(records)
    fitting = [c for c in advice.plans if _fits(by_run.get(c.plan.name), advice.budget)]
    speeds = sorted((by_run[c.plan.name].timing.samples_per_s for c in fitting), reverse=True)
    rows = [
        "| # | plan | predicted GiB | measured GiB | fits | est. throughput | measured samples/s | "
        "measured rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, c in enumerate(advice.plans, 1):
        peak, sps, rank = "—", None, "—"
        if r := by_run.get(c.plan.name):
            peak, sps = f"{r.memory.peak_tensor_bytes / GIB:,.3f}", r.timing.samples_per_s
        if c in fitting:
            rank = speeds.index(sps) + 1
        rows.append(
            f"| {i} | {c.plan.name} | {c.peak / GIB:,.3f} | {peak} | "
            f"{'yes' if c in fitting else 'no'} | {c.speed.throughput:.2f}× | "
            f"{f'{sps:,.2f}' if sps else '—'} | {rank} |"
        )
    return "\n".join(rows) + "\n\n" + verdict(advice, by_run)


def verdict(advice: Advice, by_run: dict[str, Record]) -> str:
    top = advice.plans[0]
    record = by_run.get(top.plan.name)
    if not _fits(record, advice.budget):
        return f"The top plan, {top.plan.name}, did not fit as measured here."
    share = record.timing.samples_per_s / _best(advice, by_run)
    return (
        f"The top plan, {top.plan.name}, fits as measured here, at {share:.0%} of the best "
        "measured throughput among the listed plans that fit."
    )


def top_holds(advice: Advice, records: list[Record], within: float = 0.10) -> bool:
    """Whether the measured top plan fits and its throughput is the best, or within ``within`` of
    the best, among the listed plans that fit: the check of advice on a CPU."""
    by_run = _ok(records)
    top = by_run.get(advice.plans[0].plan.name)
    if not _fits(top, advice.budget):
        return False
    return top.timing.samples_per_s >= (1 - within) * _best(advice, by_run)


def _ok(records: list[Record]) -> dict[str, Record]:
    return {r.identity.run: r for r in records if r.outcome.status == Status.OK}


def _best(advice: Advice, by_run: dict[str, Record]) -> float:
    """The best measured throughput among the listed plans that fit."""
    return max(
        by_run[c.plan.name].timing.samples_per_s
        for c in advice.plans
        if _fits(by_run.get(c.plan.name), advice.budget)
    )


def _fits(record: Record | None, budget: int) -> bool:
    if record is None or record.memory.peak_tensor_bytes is None:
        return False
    return record.memory.peak_tensor_bytes <= budget


def _batch(advice: Advice) -> int:
    return advice.template.shapes(advice.device_type).batch_size


def _nproc(advice: Advice) -> dict[str, int]:
    if advice.template.nproc > 1:
        return {"nproc": advice.template.nproc}
    return {}


def _own_batch(advice: Advice, c: Candidate) -> dict[str, Any]:
    """A plan's largest batch, where it differs from the suite's (``--max-batch``)."""
    if not advice.max_batch or c.largest_batch is None or c.largest_batch == _batch(advice):
        return {}
    sizes = {"gpu": advice.template.gpu.batch_size, "cpu": advice.template.cpu.batch_size}
    return {"batch_size": sizes | {device_type_key(advice.device_type): c.largest_batch}}


def _technique(t: Any) -> Any:
    if t.options:
        return {"name": t.name, **dict(t.options)}
    return t.name


def _accuracy(c: Candidate) -> str:
    a = c.accuracy
    if not c.plan.options:
        return "0.0 pt (baseline)"
    if a.points is None:
        return "not measured"
    if a.unknown:
        unmeasured = f" ({len(a.unknown)} unmeasured)"
    else:
        unmeasured = ""
    return f"{'⚠ ' if a.outside_band else ''}{a.points:+.1f} pt{unmeasured}"


def _kinds(c: Candidate) -> str:
    """Where the plan's speed came from: this model's records, counting, another model's records, or
    nothing."""

    def kind(line: str) -> str:
        for marker, message in (
            ("another model", "another model's"),
            ("assumed", "assumed"),
            ("measured", "measured"),
            ("timed on this device", "timed here"),
        ):
            if marker in line:
                return message
        return "counted"

    return " + ".join(sorted({kind(line) for line in c.speed.sources})) or "baseline"


__all__ = ["measured", "nothing_fits", "reasoning", "sources", "suite_file", "table", "top_holds"]
