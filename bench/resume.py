"""What a sweep keeps and what it measures: each run's stored record held against the run as it is
now.

A stored record is kept when it measured this run (same key: what can change its figures on the
device, the device, and the source of the user's modules it names; bench.spec.RunSpec.measured_key)
and its status would come out the same again: ``ok``, ``oom`` and ``unsupported`` are deterministic,
while ``error`` and ``timeout`` may be transient (a killed worker, a busy machine) and are retried
unless the user keeps them. A record made with the fidelity phase stands for the run without it too,
so a quick ``--no-fidelity`` look never replaces the complete measurement.

``--force`` re-measures every run stored before the forced sweep began. That moment is kept in a
marker file beside the records until the sweep completes, so an interrupted ``--force`` sweep
resumes, with or without ``--force``, where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import results
from bench.errors import BadInput
from bench.record import DETERMINISTIC, KEY, Status
from bench.suite import RunSpec, Suite

FORCE_MARKER = ".forced-since"


@dataclass(frozen=True, kw_only=True)
class Task:
    """One run of a sweep: where its record goes, its key, the stored record, and the decision."""

    suite: Suite
    spec: RunSpec  # as it will run (without its fidelity phase under --no-fidelity)
    path: Path | None  # None: the device, and so the folder, is known only when the run comes back
    key: str
    stored: dict[str, Any] | None
    measure: bool  # False: the stored record is kept
    reason: str  # why it is measured, or why it is kept
    keys: frozenset[str] = frozenset()  # every key a stored record may have to stand for this run

    @property
    def never_measured(self) -> bool:
        """No record of this run (this device, this key) at all: a campaign measures these first."""
        return self.stored is None or self.stored.get(KEY.run_key) not in (self.keys or {self.key})


def plan(
    suite: Suite,
    device_name: str | None,
    root: Path,
    fidelity: bool = True,
    keep_failures: bool = False,
    forced_since: str | None = None,
    device_type: str = "cpu",
) -> list[Task]:
    """Every run of the suite with what the sweep will do about it. ``device_name`` None: the device
    is known only where the runs go (a Slurm node), and a run's record of any device stands for it
    when its key matches."""
    tasks = []
    for full in suite.runs:
        if fidelity:
            spec = full
        else:
            spec = replace(full, fidelity_gpu=None, fidelity_cpu=None)
        device = device_name or _measured_on(root, suite.name, device_type, full, spec)
        if device is None:
            tasks.append(
                Task(
                    suite=suite,
                    spec=spec,
                    path=None,
                    key="",
                    stored=None,
                    measure=True,
                    reason="no stored record of it on any device",
                )
            )
            continue
        path = results.record_path(root, suite.name, device, spec.name)
        key, stored = spec.measured_key(device, device_type), results.read(path)
        # a record with the fidelity phase stands for one without
        keys = accepted(device, device_type, full, spec)
        measure, reason = _decide(
            stored,
            keys,
            keep_failures=keep_failures,
            forced_since=forced_since,
            fidelity=spec.fidelity(device_type) is not None,
        )
        tasks.append(
            Task(
                suite=suite,
                spec=spec,
                path=path,
                key=key,
                stored=stored,
                measure=measure,
                reason=reason,
                keys=frozenset(keys),
            )
        )
    return tasks


def accepted(device: str, device_type: str, *specs: RunSpec) -> set[str]:
    """The keys a stored record may have to stand for these specs: today's, and the full
    specification's of records stored before it, where no code of the user's is named (whose edits
    that key cannot see)."""
    keys = {s.measured_key(device, device_type) for s in specs}
    return keys | {s.key(device) for s in specs if not s.user_code()}


def _measured_on(root: Path, suite: str, device_type: str, *specs: RunSpec) -> str | None:
    """The device of a stored record of this run, on any device, with the key of one of ``specs``
    there."""
    for folder in sorted(p for p in (root / suite).glob("*") if p.is_dir()):
        record = results.read(folder / f"{results.run_stem(specs[0].name)}.json", warn=False)
        if record is not None and record.get(KEY.run_key) in accepted(
            record[KEY.device], device_type, *specs
        ):
            return record[KEY.device]
    return None


def _decide(
    stored: dict[str, Any] | None,
    keys: set[str],
    keep_failures: bool,
    forced_since: str | None,
    fidelity: bool,
) -> tuple[bool, str]:
    """(measure it?, why). ``fidelity``: the sweep runs the fidelity phase."""
    if stored is None:
        return True, "no stored record"
    if stored.get(KEY.run_key) not in keys:
        return True, (
            "the stored record measured another specification or device, or the code of the user's "
            "modules the run names has changed since"
        )
    if (
        forced_since is not None
        and str(stored.get(KEY.stored_at) or stored.get(KEY.finished_at, "")) < forced_since
    ):
        return True, f"stored before --force began ({forced_since})"
    status = stored[KEY.status]
    if (
        status == Status.OK
        and stored.get(KEY.device_type) == "cuda"
        and not stored.get(KEY.memory_history)
    ):
        # the trace that holds the simulator to the card: worth a re-measure, after the runs never
        # measured
        return (
            True,
            "re-measured: its record, from before CUDA runs saved one, holds no allocator history",
        )
    if status == Status.OK and stored.get(KEY.fidelity_interrupted) and fidelity:
        return (
            True,
            "re-measured: its fidelity phase was interrupted (its record stands until then)",
        )
    if status in DETERMINISTIC or keep_failures:
        return False, f"kept stored record ({status})"
    return (
        True,
        f"retried: the stored record is {status!r}, which may not recur (--keep-failures keeps it)",
    )


def forced_since(folder: Path, force: bool) -> str | None:
    """The moment the current --force sweep of this folder began: from its marker (an interrupted
    one resumes), else now with ``force`` (the marker is written), else None."""
    marker = folder / FORCE_MARKER
    if since := _marked(marker):
        return since
    if not force:
        return None
    now = datetime.now(UTC).isoformat(timespec="microseconds")
    try:  # never a 0-byte marker: a full disk fails here, before any run, and leaves none
        results.write_atomic(marker, now + "\n")
    except OSError as exc:
        raise BadInput(
            f"--force: cannot write its marker {marker} ({exc.strerror or exc}); free space in (or "
            f"make writable) {folder}, or pass --results FOLDER elsewhere"
        ) from None
    return now


def _marked(marker: Path) -> str | None:
    """The moment a forced sweep began, from its marker; a marker that holds none (cut off by a full
    disk, or a folder in its place) is refused, naming it, rather than read as a sweep that forces
    nothing."""
    if not marker.exists():
        return None
    try:
        since = marker.read_text(encoding="utf-8").strip()
        datetime.fromisoformat(since)
    except (OSError, ValueError):
        raise BadInput(
            f"{marker} holds no time a --force sweep began; remove it, then run again (with "
            "--force to measure every run again)"
        ) from None
    return since


def force_done(folder: Path) -> None:
    """A forced sweep completed: later sweeps keep its records again."""
    (folder / FORCE_MARKER).unlink(missing_ok=True)
