"""A suite's predictions as a table (``bench predict``): one row per run, predicted in processes,
with the measured peak beside it where a GPU measured the run, and what fits a budget."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from bench.measure.memory import VERDICTS
from bench.predict.ahead import spawn_pool, stop_pool
from bench.predict.budget import (
    BatchAt,
    LengthPoint,
    batches_at_lengths,
    fewest_ranks,
    largest_batch,
    largest_batch_on,
    longest_context,
    longest_sequence,
)
from bench.predict.cards import Card
from bench.predict.fake import CPU, Traced, traced
from bench.predict.ranks import KINDS
from bench.recipe import Recipe
from bench.record import AT_PEAK, KEY, Prediction, Record
from bench.spec import ORDERS
from bench.suite import RunSpec

if TYPE_CHECKING:  # the table is built in the CLI only: every run's worker imports this package
    import pandas as pd

    from bench.data.varlen import Worst


def suite_table(
    runs: list[RunSpec],
    measured: dict[str, Record],
    budget: int | None,
    log: TextIO | None = None,
    jobs: int = 1,
    card: Card | None = None,
    longest: bool = False,
) -> pd.DataFrame:
    """One row per run: predicted peak and breakdown at GPU shapes, FLOPs, and where a GPU measured
    the run, its allocated peak and the ratio; with a budget, whether it fits and the largest batch
    that does; on a ``card``, the verdict of the step replayed through its allocator, and the
    largest batch it holds; ``longest``, with either, the longest sequence each training or forward
    step holds at its batch. Runs are predicted in ``jobs`` spawned processes (each prediction is
    single-threaded Python); a progress line per run goes to ``log`` as it is done, numbered by its
    place in the suite."""
    import pandas as pd

    log = log or sys.stderr  # as it is now, not at import
    rows: list[dict[str, Any]] = [{} for _ in runs]
    for i, row in _predicted_rows(runs, budget, jobs, card, longest):
        if (rec := measured.get(runs[i].name)) and rec.memory.peak_allocated_bytes:
            row.measured_bytes = rec.memory.peak_allocated_bytes
            row.measured_on = rec.identity.device
        rows[i] = row.flat()
        print(f"[{i + 1}/{len(runs)}] {runs[i].name}: {row.said()}", file=log, flush=True)
    return pd.DataFrame(rows)


# ``--epoch worst``: the pass in each of spec.ORDERS, the one that does worst kept
WORST = "worst"


@dataclass(kw_only=True)
class Row:
    """One run's line of the table: its prediction at its batch, and what a budget or a card asked
    of it. An answer may be None (no batch fits); ``asked`` names those that were asked, so that
    the table has their columns."""

    run: str
    batch: int
    prediction: Prediction
    fits: bool | None = None  # its peak under the budget
    largest_batch: int | None = None  # under the budget, or on the card
    fewest_ranks: int | None = None  # a multi-process run's, under the budget
    largest_batch_there: int | None = None  # at those ranks
    longest_context: int | None = None  # a generation's, prompt and new tokens
    longest_sequence: int | None = None  # a training or forward step's, at its batch
    length_curve: tuple[LengthPoint, ...] | None = None  # each length its search predicted
    batches_at_lengths: tuple[BatchAt, ...] | None = None  # the largest batch at a few lengths
    worst_step: str | None = None  # on variable-length data: which of the epoch's it is
    epoch_order: str | None = None  # --epoch worst: the order of the pass that did worst
    measured_bytes: int | None = None  # a GPU's allocated peak for the run, where one measured it
    measured_on: str | None = None
    asked: set[str] = field(default_factory=set)

    def answer(self, name: str, value: Any) -> None:
        setattr(self, name, value)
        self.asked.add(name)

    def flat(self) -> dict[str, Any]:
        """As the table holds it: the prediction's figures by their own names, the answers asked
        beside them, and the verdict in words on a card."""
        own = {KEY.run: self.run, "batch": self.batch}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in ("run", "batch", "prediction", "asked") and (
                f.name in self.asked or value is not None
            ):
                own[f.name] = value
        figures = {k: v for k, v in asdict(self.prediction).items() if v is not None}
        if self.prediction.card and self.prediction.ok:
            figures["said_on_card"] = verdict(self.prediction)
        return own | figures

    def said(self) -> str:
        """The progress line's words for the row."""
        p = self.prediction
        if not p.ok:
            return f"{p.status}: {p.message or ''}"
        fit = ""
        if "largest_batch" in self.asked:
            fit = f", largest batch {self.largest_batch}"
        if "longest_context" in self.asked:
            fit = f", longest context {_tokens(self.longest_context)}"
        if "longest_sequence" in self.asked:
            fit += f", longest sequence {_tokens(self.longest_sequence)}"
        if self.worst_step:
            fit += f", worst at {self.worst_step}"
        if self.epoch_order:
            fit += f", the pass's worst order {self.epoch_order}"
        on = ""
        if p.card:
            on = f"; on {p.card}: {verdict(p)}"
        peak = p.peak_tensor_bytes / 2**30
        note = f" ({p.message})" if p.message else ""
        return (
            f"{peak:,.2f} GiB at batch {self.batch}, peak in {p.peak_phase}{fit}{on}"
            f"{host_said(p)}{note}"
        )


HOST_SAID_FROM = 2**20  # host bytes below this are a few scalars CUDA keeps there: not said
NODE = 8  # ranks a node holds (an 8-GPU server): a run's host memory a node, the nodes it needs


def host_said(p: Prediction) -> str:
    """What the step holds on the host, where it holds more than a few scalars: a rank's, pinned
    and pageable, and a node's where the run has ranks (NODE of them on a node, or fewer)."""
    if (p.host_peak_bytes or 0) < HOST_SAID_FROM:
        return ""
    pinned = p.host_pinned_bytes or 0
    said = (
        f"; on the host {p.host_peak_bytes / 2**30:,.2f} GiB ({pinned / 2**30:,.2f} pinned, "
        f"{(p.host_peak_bytes - pinned) / 2**30:,.2f} pageable)"
    )
    if (ranks := min(p.world_size or 1, NODE)) > 1:
        said += f", {ranks * p.host_peak_bytes / 2**30:,.2f} GiB a node of {ranks} ranks"
    return said


SAVED = (
    KEY.run,
    "batch",
    KEY.status,
    KEY.peak_tensor_bytes,
    KEY.peak_phase,
    KEY.param_bytes,
    KEY.gradient_bytes,
    KEY.optimizer_state_bytes,
    KEY.activation_bytes,
    KEY.peak_prefill_bytes,
    KEY.peak_decode_bytes,
    KEY.kv_cache_bytes,
    KEY.flops_per_step,
    KEY.world_size,
    KEY.message,
)


def save(table: pd.DataFrame, path: Path, revision: str, torch_version: str) -> Path:
    """The predictions a report shows for the runs no GPU has measured, with how they were made."""
    from bench.results import write_atomic

    kept = table.reindex(columns=[c for c in SAVED if c in table]).assign(
        git_revision=revision, torch_version=torch_version
    )
    write_atomic(path, kept.to_csv(index=False))
    return path


def save_contexts(
    table: pd.DataFrame, path: Path, card: Card, revision: str, torch_version: str
) -> Path:
    """A generation suite's longest contexts on a card, by run, merged into those predicted before
    (a run predicted again replaces its row): the report's first screen says which run holds the
    longest."""

    rows = table[table["longest_context"].notna()][[KEY.run, "longest_context"]].assign(
        card=card.name, git_revision=revision, torch_version=torch_version
    )
    return _merged(rows, path)


def save_curves(
    table: pd.DataFrame, path: Path, card: Card, revision: str, torch_version: str
) -> Path:
    """Each length the longest-sequence search predicted on a card, a row per run and length,
    merged into those saved before (a run searched again replaces its rows): the report plots them
    against the card's capacity."""
    import pandas as pd

    rows = pd.DataFrame(
        [
            {KEY.run: run, **asdict(point), "longest_sequence": longest}
            for run, curve, longest in zip(
                table[KEY.run], table["length_curve"], table["longest_sequence"]
            )
            if isinstance(curve, tuple)
            for point in curve
        ]
    ).assign(
        card=card.name,
        capacity_bytes=card.capacity,
        git_revision=revision,
        torch_version=torch_version,
    )
    return _merged(rows, path)


def _merged(rows: pd.DataFrame, path: Path) -> Path:
    """``rows`` written to ``path`` over those saved there before, a run's rows replacing its old
    ones (a run predicted again)."""
    import pandas as pd

    from bench.results import write_atomic

    if path.exists():
        before = pd.read_csv(path)
        rows = pd.concat([before[~before[KEY.run].isin(rows[KEY.run])], rows], ignore_index=True)
    write_atomic(path, rows.to_csv(index=False))
    return path


def _predicted_rows(
    runs: list[RunSpec], budget: int | None, jobs: int, card: Card | None, longest: bool = False
) -> Iterator[tuple[int, Row]]:
    """(index, row) for each run as it is done: here, or in spawned processes (fork is unsafe once
    torch has started threads). A process costs an import of torch (about 5 s and 1 GB), so there is
    one per run at most. Ctrl-C reaches the parent only, which stops the processes on its way
    out."""
    work = [(i, spec, budget, card, longest) for i, spec in enumerate(runs)]
    processes = min(jobs, len(runs))
    if processes <= 1:
        yield from map(_indexed_row, work)
        return
    pool, interrupted = spawn_pool(processes), True
    try:
        yield from pool.imap_unordered(_indexed_row, work)
        interrupted = False
    finally:  # the processes end, finished or not
        stop_pool(pool, interrupted)


def _indexed_row(work: tuple[int, RunSpec, int | None, Card | None, bool]) -> tuple[int, Row]:
    index, spec, budget, card, longest = work
    return index, _row(spec, budget, card, longest)


# A run's prediction that has taken this long says what it is doing, step by step: a 7B model's
# first prediction alone takes a minute or more on a laptop, and the search after it several.
SAY_AFTER_S = 5.0


class Told:
    """What one run's prediction is doing, on stderr: nothing while its work is quick; once it has
    taken SAY_AFTER_S, each step it is told (every batch and length a search tries)."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.since = time.monotonic()

    def __call__(self, text: str) -> None:
        if time.monotonic() - self.since >= SAY_AFTER_S:
            print(f"    {self.run}: {text}", file=sys.stderr, flush=True)

    @contextmanager
    def meanwhile(self, text: str) -> Iterator[None]:
        """``text`` said once the work inside has taken SAY_AFTER_S, if it is not done by then."""
        timer = threading.Timer(SAY_AFTER_S, self, args=(text,))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()


def _row(spec: RunSpec, budget: int | None, card: Card | None, longest: bool = False) -> Row:
    told = Told(spec.name)
    doing = f"predicting its step on fake tensors at batch {spec.gpu.batch_size:,}"
    if card is not None:
        doing += f", its allocator replayed on the {card.name}"
    with told.meanwhile(doing):
        if spec.gpu.epoch_order == WORST:
            own, order = _worst_order(spec, card, told)
        else:
            own, order = traced(spec, card=card), None  # its tracker: a search's line's first point
    out = own.prediction
    row = Row(run=spec.name, batch=spec.gpu.batch_size, prediction=out)
    if order is not None:
        row.answer("epoch_order", order)
    if spec.gpu.worst_step:
        row.answer("worst_step", _worst(spec).said())
    if not out.ok:
        return row
    if spec.mode == "generate":
        # what a card or budget answers for a generation: its longest context
        if budget is not None or card is not None:
            found = longest_context(spec, card=card, budget=budget, progress=told)
            row.answer("longest_context", found)
        return row
    if budget is not None:
        row.answer("fits", out.peak_tensor_bytes <= budget)
    if spec.gpu.epoch:  # a whole pass answers for its own batch alone: no search
        return row
    if budget is not None:
        row.answer("largest_batch", largest_batch(spec, budget, own=own, progress=told))
    if budget is not None and spec.nproc > 1:
        if (fewest := fewest_ranks(spec, budget, own=out)) is not None:
            row.answer("fewest_ranks", fewest)
            there = largest_batch(replace(spec, nproc=fewest), budget)
            row.answer("largest_batch_there", there)
    if card is not None and spec.nproc > 1:  # as many such cards as it needs, each rank's own
        if (fewest := fewest_ranks(spec, None, own=out, card=card)) is not None:
            row.answer("fewest_ranks", fewest)
            there = largest_batch_on(replace(spec, nproc=fewest), card, progress=told)
            row.answer("largest_batch_there", there)
    if card is not None and spec.nproc == 1:
        row.answer("largest_batch", largest_batch_on(spec, card, own=own, progress=told))
    if longest and spec.nproc == 1 and spec.gpu.lengths is None:  # a varlen run's lengths are its
        curve: list[LengthPoint] = []
        found = longest_sequence(
            spec, card=card, budget=budget, own=own, progress=told, curve=curve
        )
        row.answer("longest_sequence", found)
        row.answer("length_curve", tuple(curve))
        at = batches_at_lengths(spec, card, budget, found, progress=told)
        row.answer("batches_at_lengths", tuple(at))
    return row


def _worst_order(spec: RunSpec, card: Card | None, told: Told) -> tuple[Traced, str]:
    """The run's pass in each order its batches may come (``spec.ORDERS``), and the one that does
    worst on the card: out of memory before fitting after flushes before fitting, then the earlier
    step out of memory, the more flushes, the more reserved (without a card: the most reserved)."""

    def severity(out: Prediction) -> tuple:
        verdict = VERDICTS.index(out.verdict) if out.verdict else len(VERDICTS)
        reserved = out.peak_reserved_bytes or out.oom_reserved_bytes or 0
        return (not out.ok, verdict, out.oom_step or 0, -(out.flushes or 0), -reserved)

    tried = {}
    for order in ORDERS:
        told(f"the pass in the {order} order")
        tried[order] = traced(replace(spec, gpu=replace(spec.gpu, epoch_order=order)), card=card)
    worst = min(tried, key=lambda o: severity(tried[o].prediction))
    return tried[worst], worst


def _worst(spec: RunSpec) -> Worst:
    """The run's epoch at its GPU shapes, and its worst batch, as its loader forms them."""
    feed = Recipe.of(spec, CPU, spec.gpu, predicting=True).feed()
    assert feed is not None  # a worst step is asked of runs with lengths alone
    return feed.worst()


def _tokens(n: int | None) -> str:
    if n is None:
        return "none"
    return f"{n:,} tokens"


def verdict(prediction: Prediction) -> str:
    """A prediction's verdict on its card, in words: over a whole pass (--epoch), at which step;
    and where it does not simply fit, what expandable segments would do."""
    p = prediction
    if p.verdict == "out of memory":
        request = p.oom_request_bytes / 2**20
        held = (p.oom_reserved_bytes or 0) / 2**30
        said = (
            f"out of memory{_step(p)} in {p.oom_phase} (a request of {request:,.0f} MiB, "
            f"{held:.2f} GiB reserved then)"
        )
    elif not p.flushes:
        said = "fits"
    else:
        said = f"fits after {p.flushes} cache flush{'es' if p.flushes > 1 else ''}"
    if p.epoch_steps is not None and p.verdict != "out of memory":
        said += f" for the whole epoch of {p.epoch_steps:,} steps"
    if reserved := p.epoch_reserved_bytes:  # how the pass's reserve grew
        said += f" (reserved after step 1: {reserved[0] / 2**30:.2f} GiB"
        if len(reserved) > 1:
            said += f", after step {len(reserved):,}: {reserved[-1] / 2**30:.2f} GiB"
        said += ")"
    if p.expandable_verdict is not None:
        said += f"; with expandable_segments:True, {p.expandable_verdict}"
    if p.split_verdict is not None:
        said += f"; {p.split_verdict}"
    return said


def _step(p: Prediction) -> str:
    if p.oom_step is None:
        return ""
    if p.oom_step == 0:
        return " in the warm-up step before the epoch"
    return f" at step {p.oom_step:,} of {p.epoch_steps:,}"


def markdown(table: pd.DataFrame, breakdown: bool = False) -> str:
    """The table as Markdown; ``breakdown``: what was alive at each run's peak, by kind, in place of
    the model's states (the at-peak columns sum to the peak)."""
    import pandas as pd

    from bench.report.tables import to_markdown

    gib = lambda col: (pd.to_numeric(table.get(col), errors="coerce") / 2**30).round(2)  # noqa: E731
    show = pd.DataFrame(
        {
            KEY.run: table[KEY.run],
            "batch": table["batch"],
            KEY.status: table[KEY.status],
            "peak GiB": gib(KEY.peak_tensor_bytes),
            "peak in": table.get(KEY.peak_phase),
            "params GiB": gib(KEY.param_bytes),
            "grads GiB": gib(KEY.gradient_bytes),
            "optimizer GiB": gib(KEY.optimizer_state_bytes),
            "activations GiB": gib(KEY.activation_bytes),
            "prefill GiB": gib(KEY.peak_prefill_bytes),  # generation's phases and cache
            "decode GiB": gib(KEY.peak_decode_bytes),
            "cache GiB": gib(KEY.kv_cache_bytes),
            "TFLOP/step": (
                pd.to_numeric(table.get(KEY.flops_per_step), errors="coerce") / 1e12
            ).round(2),
            "ranks": pd.to_numeric(
                table.get(KEY.world_size, pd.Series(index=table.index, dtype=float)),
                errors="coerce",
            ).astype("Int64"),
        }
    )
    if breakdown:
        show = show.drop(columns=["params GiB", "grads GiB", "optimizer GiB", "activations GiB"])
        for part in AT_PEAK:
            show.insert(
                len(show.columns) - 2,
                f"{part.replace('_', ' ')} at peak GiB",
                gib(f"at_peak_{part}_bytes"),
            )
    for kind in KINDS:  # sent per rank per step, in a ring
        show[f"{kind.replace('_', '-')} MiB/rank"] = (
            pd.to_numeric(table.get(f"traffic_{kind}_bytes"), errors="coerce") / 2**20
        ).round(2)
    show["reserved GiB"] = gib(KEY.peak_reserved_bytes)
    show["nvidia-smi GiB"] = gib(KEY.nvml_process_bytes)
    # on the host, for the device: a rank's (an offloading entry's; a few bytes of scalars else)
    show["host GiB"] = gib(KEY.host_peak_bytes)
    show["of it pinned GiB"] = gib(KEY.host_pinned_bytes)
    if "card" in table:
        show[f"on {table['card'].dropna().iloc[0]}"] = table["said_on_card"].fillna("")
    if "measured_bytes" in table:
        show["measured GiB"] = gib("measured_bytes")
        # the allocated peak, cuBLAS's workspaces with the tensors, as max_memory_allocated counts
        # it
        predicted = table.get(KEY.peak_allocated_bytes, table[KEY.peak_tensor_bytes])
        show["predicted / measured"] = (predicted / table["measured_bytes"]).round(3)
    if "fits" in table:
        show["fits"] = table["fits"].map({True: "yes", False: "no"})
    if "largest_batch" in table:
        show["largest batch"] = pd.to_numeric(table["largest_batch"], errors="coerce").astype(
            "Int64"
        )
    if "longest_context" in table:  # prompt and new tokens
        show["longest context"] = pd.to_numeric(table["longest_context"], errors="coerce").astype(
            "Int64"
        )
    if "longest_sequence" in table:
        show["longest sequence"] = pd.to_numeric(table["longest_sequence"], errors="coerce").astype(
            "Int64"
        )
    if "batches_at_lengths" in table:  # "512: 64, 1,024: 30"
        show["largest batch at lengths"] = table["batches_at_lengths"].map(_batches_said)
    if "epoch_order" in table:  # --epoch worst: the order of the pass shown
        show["pass order"] = table["epoch_order"].fillna("")
    if "worst_step" in table:  # on variable-length data: the epoch's step predicted
        show["worst step"] = table["worst_step"].fillna("")
    # multi-process entries under a budget: the fewest ranks that fit, and its batch
    if "fewest_ranks" in table:
        fewest = pd.to_numeric(table["fewest_ranks"], errors="coerce").astype("Int64")
        show["fewest ranks"] = fewest
        show[f"nodes of {NODE}"] = -(-fewest // NODE)  # servers of NODE cards those ranks fill
        show["largest batch there"] = pd.to_numeric(
            table["largest_batch_there"], errors="coerce"
        ).astype("Int64")
    show["note"] = table.get(KEY.message, pd.Series(dtype=object)).fillna("")
    # traffic columns no entry has, or all zero
    show = show.loc[:, show.notna().any() & (show != 0).any()]
    return to_markdown(show)


def _batches_said(found: object) -> str:
    if not isinstance(found, tuple):
        return ""
    return ", ".join(f"{b.seq_len:,}: {b.largest_batch or 'none'}" for b in found)
