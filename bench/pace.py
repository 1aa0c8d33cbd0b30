"""How long a sweep's runs will take here. Each run is priced by the wall time its stored record
took on a reference device (this one where it has records, else the one with the most records of the
suite), and the price is scaled to this machine's pace as runs finish: the runs measured here
against the same runs there. A CPU never seen before is thus estimated from its first run on (its
first command was priced at another machine's pace alone, and read 5 minutes for 19)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import results
from bench.record import KEY, Record, Status
from bench.resume import Task


@dataclass(frozen=True, kw_only=True)
class Price:
    """A run's wall time at its reference's pace."""

    seconds: float
    without_fidelity: float  # the same, less the fidelity phase (what --no-fidelity would take)
    reference: str  # the device whose records priced it
    # its own record's time, of a run that ran there: its time here sets the pace (else a median)
    own: bool


def wall(record: dict[str, Any], fidelity: bool) -> float:
    """The record's wall time, less its fidelity phase for a run measured without one."""
    return float(record[KEY.wall_s]) - (0.0 if fidelity else float(record.get(KEY.fidelity_s) or 0))


class Pace:
    """The sweep's runs priced from stored records, and this machine's pace learnt from the runs
    measured."""

    def __init__(self, todo: list[Task], root: Path, device: str | None, device_type: str) -> None:
        self.device = device
        refs = {s: _reference(root / s, device, device_type) for s in {t.suite.name for t in todo}}
        self.prices = {id(t): _price(t, refs[t.suite.name], device_type) for t in todo}
        # per reference: wall times measured here ...
        self.here: dict[str, float] = defaultdict(float)
        self.there: dict[str, float] = defaultdict(float)  # ... and the same runs' there
        self.measured: list[float] = []  # every wall time measured here, for runs nothing priced

    def estimate_line(self, todo: list[Task]) -> str:
        """The estimate before the first run, saying where it comes from."""
        priced = [p for t in todo if (p := self.prices[id(t)])]
        if not priced:
            return ""
        total, quick = sum(p.seconds for p in priced), sum(p.without_fidelity for p in priced)
        sources = sorted({p.reference for p in priced})
        if sources == [self.device]:
            where = "this device"
        else:
            where = "; ".join(sources)
        medians = sum(not p.own for p in priced)
        runs = f"{len(priced)} of the {len(todo)} runs"
        if len(priced) == len(todo):
            runs = f"the {len(todo)} runs"
        parts = [
            f"estimated: about {total / 60:.0f} min for {runs}, from their records' wall times on "
            f"{where}" + (f" ({medians} priced as a median run there)" if medians else "")
        ]
        if sources != [self.device]:
            parts.append("at that pace until the first runs here measure this machine's")
        if len(priced) < len(todo):
            parts.append(f"the other {len(todo) - len(priced)} priced once runs here are measured")
        if total - quick >= 60:
            parts.append(f"{quick / 60:.0f} min of it without the fidelity phase (--no-fidelity)")
        return "; ".join([*parts, "--only NAMES measures some of them"])

    def measure(self, task: Task, record: Record) -> str:
        """A run measured here: its wall time against its reference's sets the pace. Returns a line
        to say where this is the first run to set it, else ''."""
        took = record.timing.wall_s
        if not took:
            return ""
        self.measured.append(took)
        price = self.prices[id(task)]
        # A refused run takes seconds wherever it is refused: its time says nothing of the machine.
        if price is None or not price.own or record.outcome.status != Status.OK:
            return ""
        first = price.reference not in self.here and price.reference != self.device
        self.here[price.reference] += took
        self.there[price.reference] += price.seconds
        if not first:
            return ""
        factor = self.factor(price.reference)
        return (
            f"pace: this machine took {factor:.2f}× the time {price.reference} took for "
            f"{task.spec.name}"
        )

    def factor(self, reference: str) -> float:
        """This machine's time over the reference's, for the same runs; 1 until one is measured."""
        there = self.there.get(reference)
        if there:
            return self.here[reference] / there
        return 1.0

    def left(self, todo: list[Task]) -> float | None:
        """Seconds the runs of ``todo`` should take here; None where a run is priced by nothing
        yet."""
        if self.measured:
            fallback = statistics.mean(self.measured)
        else:
            fallback = None
        total = 0.0
        for t in todo:
            if price := self.prices[id(t)]:
                total += price.seconds * self.factor(price.reference)
            elif fallback is not None:
                total += fallback
            else:
                return None
        return total


def _reference(
    folder: Path, device: str | None, device_type: str
) -> tuple[str, dict[str, dict]] | None:
    """The device whose records price a suite's runs, and its records by run: this device where it
    has any with a wall time, else the one of this kind with the most (one device: one pace scales
    them all)."""
    by_device: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in results.load_records(folder) if folder.is_dir() else []:
        if r.get(KEY.wall_s) and r.get(KEY.device_type, "cpu") == device_type:
            by_device[r[KEY.device]][r[KEY.run]] = r
    if not by_device:
        return None
    if device in by_device:
        name = device
    else:
        name = max(by_device, key=lambda d: (len(by_device[d]), d))
    return name, by_device[name]


def _price(
    task: Task, reference: tuple[str, dict[str, dict]] | None, device_type: str
) -> Price | None:
    """A run's price at its reference's pace: its own record's wall time there, else the median of
    the reference's runs that ran (a refused run's seconds would price every new run as refused)."""
    if reference is None:
        return None
    name, records = reference
    fidelity = task.spec.fidelity(device_type) is not None
    if (own := records.get(task.spec.name)) is not None:
        # else refused there: its seconds are no measure of the pace
        ran = own[KEY.status] == Status.OK
        return Price(
            seconds=wall(own, fidelity), without_fidelity=wall(own, False), reference=name, own=ran
        )
    ran = [r for r in records.values() if r[KEY.status] == Status.OK]
    if not ran:
        return None
    if fidelity:
        with_phase = [r for r in ran if r.get(KEY.fidelity_s)]
    else:
        with_phase = ran
    typical = statistics.median(wall(r, fidelity) for r in with_phase or ran)
    return Price(
        seconds=typical,
        without_fidelity=statistics.median(wall(r, False) for r in ran),
        reference=name,
        own=False,
    )
