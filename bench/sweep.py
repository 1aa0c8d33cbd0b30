"""A sweep: every run of its suites planned (bench.resume: what is kept, what is measured), handed
to a launcher (bench.launch: this machine's processes, or Slurm jobs), and each record stored as it
comes back."""

from __future__ import annotations

import math
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from bench import results, resume
from bench.errors import NotStored
from bench.launch import Launcher, MeasuredThenStopped
from bench.pace import Pace
from bench.record import KEY, MEMORY_SUMMARY, Accuracy, Record, Status
from bench.suite import Suite


def sweep(
    suite: Suite, launcher: Launcher, results_root: Path, **options: Any
) -> list[dict[str, Any]]:
    """Run (or resume) every run of the suite; returns the records, stored and new. ``options``:
    those of ``campaign``."""
    return campaign([suite], launcher, results_root, **options)[suite.name]


def campaign(
    suites: list[Suite],
    launcher: Launcher,
    results_root: Path,
    force: bool = False,
    log: TextIO | None = None,
    fidelity: bool = True,
    keep_failures: bool = False,
    never_measured_first: bool = False,
    archive: Path | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Every run of the suites in one sweep (see bench.resume for what is kept); returns each
    suite's records, stored and new. ``never_measured_first``: runs with no record of this device
    and key go before retries and re-measurements, so a lease that ends early has added the most.
    ``archive``: a .tar.gz of the suites' records on this device, rewritten as each run is
    stored."""
    start, log = time.monotonic(), log or sys.stderr  # stderr as it is now, not at import
    device = launcher.device_name
    names = [s.name for s in suites]
    results.check_writable(results_root, names, device)  # before --force's marker
    folders = {
        s.name: results.suite_folder(results_root, s.name, device)
        if device
        else results_root / s.name
        for s in suites
    }
    with results.sweeping(list(folders.values())):
        records, todo, unstored = _measure(
            suites,
            launcher,
            results_root=results_root,
            folders=folders,
            start=start,
            log=log,
            fidelity=fidelity,
            keep_failures=keep_failures,
            force=force,
            never_measured_first=never_measured_first,
            archive=archive,
        )
    print(f"done: {len(todo)} runs measured in {_elapsed(start)}", file=log)
    if unstored:
        raise NotStored(
            f"{len(unstored)} measured run(s) could not be stored in {results_root}: "
            f"{', '.join(unstored)}; each is kept in the temporary file named above: copy it there "
            "once the folder can be written"
        )
    return records


def _measure(
    suites: list[Suite],
    launcher: Launcher,
    results_root: Path,
    folders: dict[str, Path],
    start: float,
    log: TextIO,
    fidelity: bool,
    keep_failures: bool,
    force: bool,
    never_measured_first: bool,
    archive: Path | None,
) -> tuple[dict[str, list[dict[str, Any]]], list[resume.Task], list[str]]:
    """The sweep proper, under the folders' lock: plan, say what is kept, measure the rest. Returns
    the records, the tasks measured, and the runs whose records could not be stored."""
    device, names = launcher.device_name, [s.name for s in suites]
    tasks = [
        t
        for s in suites
        for t in resume.plan(
            s,
            device,
            root=results_root,
            fidelity=fidelity,
            keep_failures=keep_failures,
            forced_since=resume.forced_since(folders[s.name], force),
            device_type=launcher.device_type,
        )
    ]
    records = {s.name: [t.stored for t in tasks if t.suite is s and not t.measure] for s in suites}
    todo = [t for t in tasks if t.measure]
    if never_measured_first:
        todo.sort(key=lambda t: not t.never_measured)  # stable: the suites' order within each group
    if len(suites) == 1:
        label = lambda t: t.spec.name
    else:
        label = lambda t: f"{t.suite.name}/{t.spec.name}"
    for i, t in enumerate(tasks, 1):
        if not t.measure:
            print(
                f"[{i}/{len(tasks)}] {label(t)}: {t.reason}{_missing_snapshot(t, launcher)}",
                file=log,
            )
    print(
        f"{len(todo)} of {len(tasks)} runs to measure on {device or launcher.device_type}, records "
        f"in {results_root}",
        file=log,
    )
    pace = Pace(todo, results_root, device, launcher.device_type)
    if todo and (line := pace.estimate_line(todo)):
        print(line, file=log)
    unstored: list[str] = []
    with launcher.running(todo, log) as result:
        for i, t in enumerate(todo, 1):
            print(
                f"[{i}/{len(todo)}] {label(t)}: running ({t.reason}; {_elapsed(start)} "
                f"elapsed{_left(pace.left(todo[i - 1 :]))})",
                file=log,
                flush=True,
            )
            stopped = None
            try:
                record = result(t)
            except (
                MeasuredThenStopped
            ) as stop:  # its memory and speed were measured: stored, never lost
                record, stopped = stop.record, stop
            record.identity.run_index = t.suite.position(t.spec.name)
            paced = pace.measure(t, record)
            if not finish(record, records[t.suite.name], results_root):
                unstored.append(label(t))
            if archive is not None and device:
                results.pack(archive, results_root, names, device)
            if stopped is not None:
                print(
                    f"[{i}/{len(todo)}] {label(t)}: stored, fidelity phase cut short",
                    file=log,
                    flush=True,
                )
                raise stopped
            kept = Record.from_flat(records[t.suite.name][-1])  # as stored: what reports will read
            summary = _outcome(kept, _baseline(kept, records[t.suite.name]))
            print(
                f"[{i}/{len(todo)}] {label(t)}: {summary}",
                file=log,
                flush=True,
            )
            if paced and (left := pace.left(todo[i:])):
                print(f"{paced}: about {_minutes(left)} left", file=log, flush=True)
    for folder in folders.values():
        resume.force_done(folder)
    return records, todo, unstored


def _missing_snapshot(task: resume.Task, launcher: Launcher) -> str:
    # A snapshot is taken only while a run is measured: say so rather than leave the user looking
    # for it.
    if launcher.snapshot and task.path and not task.path.with_suffix(".snapshot.pickle").exists():
        return ", no snapshot: --force re-measures it with one"
    return ""


def finish(record: Record, records: list[dict[str, Any]], results_root: Path) -> bool:
    """Store the record atomically, in its stored form (a figure without a value is absent), and
    keep that with the others; returns whether it is stored under ``results_root``. What is derived
    from several records (the accuracy delta) is left to reports."""
    # what --force compares
    record.provenance.stored_at = datetime.now(UTC).isoformat(timespec="microseconds")
    who = record.identity
    path = results.record_path(results_root, who.suite, who.device, who.run)
    if summary := record.extra.pop(MEMORY_SUMMARY, None):
        record.memory.memory_summary = results.save_beside(path, ".memory.txt", summary)
    flat = finite(record.to_flat())
    results.set_aside_if_unreadable(path)
    results.keep_superseded(path)
    stored = results.store(path, flat)
    records.append(flat)
    return stored


def finite(record: dict[str, Any]) -> dict[str, Any]:
    """NaN and infinite figures as null (JSON has no such numbers; Python wrote bare NaN tokens),
    named in ``non_finite``."""
    bad: list[str] = []

    def clean(value: Any, key: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            bad.append(key)
            return None
        if isinstance(value, list):
            return [clean(v, key) for v in value]
        if isinstance(value, dict):
            return {k: clean(v, f"{key}.{k}") for k, v in value.items()}
        return value

    out = {k: clean(v, k) for k, v in record.items()}
    return out | ({KEY.non_finite: sorted(set(bad))} if bad else {})


def _baseline(record: Record, records: list[dict[str, Any]]) -> Record | None:
    """The suite's baseline record on the record's device: the record itself, or one stored before
    it."""
    who = record.identity
    return next(
        (
            Record.from_flat(r)
            for r in reversed(records)
            if r[KEY.run] == who.baseline and r[KEY.device] == who.device
        ),
        None,
    )


def _outcome(record: Record, baseline: Record | None = None) -> str:
    """The progress line's summary: what a user watching the sweep wants first; the accuracy delta
    against ``baseline`` where both have an accuracy."""
    if record.outcome.status != Status.OK:
        return f"{record.outcome.status}: {record.outcome.message}"
    peak = record.memory.peak_allocated_bytes or record.memory.peak_tensor_bytes
    # No peak: a compiled model runs nothing the tracker sees, and a CPU has no allocator peak. Not
    # a zero.
    parts = [
        f"peak {peak / 2**20:,.1f} MiB" if peak else "peak not tracked",
        f"{record.timing.samples_per_s:,.1f} samples/s",
    ]
    fid = record.fidelity
    if fid.accuracy is not None:
        shown = ""
        accuracy = Accuracy.of(fid, baseline and baseline.fidelity)
        if accuracy is not None and record.identity.run != record.identity.baseline:
            shown = f" ({accuracy.delta * 100:+.1f} pt)"
        parts.append(f"accuracy {fid.accuracy:.1%}{shown}")
    if fid.fidelity_error:
        parts.append(f"fidelity phase failed: {fid.fidelity_error}")
    if record.outcome.warning:
        parts.append(f"warning: {record.outcome.warning}")
    return "ok, " + ", ".join(parts)


def _left(seconds: float | None) -> str:
    if seconds:
        return f", about {_minutes(seconds)} left"
    return ""


def _minutes(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}m{s % 60:02d}s"


def _elapsed(start: float) -> str:
    return _minutes(time.monotonic() - start)
