"""A suite's predictions as a table (``bench predict``): one row per run, predicted in processes,
with the measured peak beside it where a GPU measured the run, and what fits a budget."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from bench.predict.ahead import spawn_pool, stop_pool
from bench.predict.budget import fewest_ranks, largest_batch, largest_batch_on, longest_context
from bench.predict.cards import Card
from bench.predict.fake import predict
from bench.predict.ranks import KINDS
from bench.record import AT_PEAK, KEY, Status
from bench.suite import RunSpec

if TYPE_CHECKING:  # the table is built in the CLI only: every run's worker imports this package
    import pandas as pd


def suite_table(
    runs: list[RunSpec],
    measured: dict[str, dict[str, Any]],
    budget: int | None,
    log: TextIO | None = None,
    jobs: int = 1,
    card: Card | None = None,
) -> pd.DataFrame:
    """One row per run: predicted peak and breakdown at GPU shapes, FLOPs, and where a GPU measured
    the run, its allocated peak and the ratio; with a budget, whether it fits and the largest batch
    that does; on a ``card``, the verdict of the step replayed through its allocator, and the
    largest batch it holds. Runs are predicted in ``jobs`` spawned processes (each prediction is
    single-threaded Python); a progress line per run goes to ``log`` as it is done, numbered by its
    place in the suite."""
    import pandas as pd

    log = log or sys.stderr  # as it is now, not at import
    rows: list[dict[str, Any]] = [{} for _ in runs]
    for i, row in _predicted_rows(runs, budget, jobs, card):
        if (rec := measured.get(runs[i].name)) and rec.get(KEY.peak_allocated_bytes):
            row["measured_bytes"] = rec[KEY.peak_allocated_bytes]
            row["measured_on"] = rec[KEY.device]
        rows[i] = row
        print(f"[{i + 1}/{len(runs)}] {runs[i].name}: {_said(row)}", file=log, flush=True)
    return pd.DataFrame(rows)


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
    table: pd.DataFrame, path: Path, card: str, revision: str, torch_version: str
) -> Path:
    """A generation suite's longest contexts on a card, by run, merged into those predicted before
    (a run predicted again replaces its row): the report's first screen says which run holds the
    longest."""
    import pandas as pd

    from bench.results import write_atomic

    rows = table[table["longest_context"].notna()][[KEY.run, "longest_context"]].assign(
        card=card, git_revision=revision, torch_version=torch_version
    )
    if path.exists():
        before = pd.read_csv(path)
        rows = pd.concat([before[~before[KEY.run].isin(rows[KEY.run])], rows], ignore_index=True)
    write_atomic(path, rows.to_csv(index=False))
    return path


def _predicted_rows(
    runs: list[RunSpec], budget: int | None, jobs: int, card: Card | None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, row) for each run as it is done: here, or in spawned processes (fork is unsafe once
    torch has started threads). A process costs an import of torch (about 5 s and 1 GB), so there is
    one per run at most. Ctrl-C reaches the parent only, which stops the processes on its way
    out."""
    work, processes = [(i, spec, budget, card) for i, spec in enumerate(runs)], min(jobs, len(runs))
    if processes <= 1:
        yield from map(_indexed_row, work)
        return
    pool, interrupted = spawn_pool(processes), True
    try:
        yield from pool.imap_unordered(_indexed_row, work)
        interrupted = False
    finally:  # the processes end, finished or not
        stop_pool(pool, interrupted)


def _indexed_row(work: tuple[int, RunSpec, int | None, Card | None]) -> tuple[int, dict[str, Any]]:
    index, spec, budget, card = work
    return index, _row(spec, budget, card)


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


def _row(spec: RunSpec, budget: int | None, card: Card | None) -> dict[str, Any]:
    told = Told(spec.name)
    doing = f"predicting its step on fake tensors at batch {spec.gpu.batch_size:,}"
    if card is not None:
        doing += f", its allocator replayed on the {card.name}"
    with told.meanwhile(doing):
        out = predict(spec, card=card)
    row: dict[str, Any] = {
        KEY.run: spec.name,
        "batch": spec.gpu.batch_size,
        KEY.status: out.status,
    }
    row |= {k: v for k, v in asdict(out).items() if v is not None}
    if spec.mode == "generate":
        # what a card or budget answers for a generation: its longest context
        if out.ok and (budget is not None or card is not None):
            row["longest_context"] = longest_context(spec, card=card, budget=budget, progress=told)
        return row
    if budget is not None and out.ok:
        row["fits"] = out.peak_tensor_bytes <= budget
        row["largest_batch"] = largest_batch(spec, budget, own=out, progress=told)
    if budget is not None and spec.nproc > 1 and out.ok:
        if (fewest := fewest_ranks(spec, budget, own=out)) is not None:
            row["fewest_ranks"] = fewest
            row["largest_batch_there"] = largest_batch(replace(spec, nproc=fewest), budget)
    if card is not None and out.ok and spec.nproc == 1:
        row["largest_batch"] = largest_batch_on(spec, card, own=out, progress=told)
    return row


def _said(row: dict[str, Any]) -> str:
    if row[KEY.status] != Status.OK:
        return f"{row[KEY.status]}: {row.get(KEY.message, '')}"
    if "largest_batch" in row:
        fit = f", largest batch {row['largest_batch']}"
    else:
        fit = ""
    if "longest_context" in row:
        fit = f", longest context {_tokens(row['longest_context'])}"
    peak = row[KEY.peak_tensor_bytes] / 2**30
    if row.get("card"):
        on = f"; on {row['card']}: {verdict(row)}"
    else:
        on = ""
    return f"{peak:,.2f} GiB at batch {row['batch']}, peak in {row[KEY.peak_phase]}{fit}{on}"


def _tokens(n: int | None) -> str:
    if n is None:
        return "none"
    return f"{n:,} tokens"


def verdict(row: dict[str, Any]) -> str:
    """A prediction's verdict on its card, in words."""
    if row.get("verdict") == "out of memory":
        request = row["oom_request_bytes"] / 2**20
        held = (row.get("oom_reserved_bytes") or 0) / 2**30
        return (
            f"out of memory in {row['oom_phase']} (a request of {request:,.0f} MiB, {held:.2f} GiB "
            "reserved then)"
        )
    flushes = row.get("flushes") or 0
    if not flushes:
        return "fits"
    return f"fits after {flushes} cache flush{'es' if flushes > 1 else ''}"


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
    if "card" in table:
        show[f"on {table['card'].dropna().iloc[0]}"] = [
            verdict(r) if r[KEY.status] == Status.OK else "" for r in table.to_dict("records")
        ]
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
    # multi-process entries under a budget: the fewest ranks that fit, and its batch
    if "fewest_ranks" in table:
        show["fewest ranks"] = pd.to_numeric(table["fewest_ranks"], errors="coerce").astype("Int64")
        show["largest batch there"] = pd.to_numeric(
            table["largest_batch_there"], errors="coerce"
        ).astype("Int64")
    show["note"] = table.get(KEY.message, pd.Series(dtype=object)).fillna("")
    # traffic columns no entry has, or all zero
    show = show.loc[:, show.notna().any() & (show != 0).any()]
    return to_markdown(show)
