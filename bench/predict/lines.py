"""A search's sizes read off a line through two traced ones (issue 65): the largest batch on a card
or under a budget asks the same step at many batches, and a step's storages at another batch are
the same storages, made and freed in the same order, each of bytes that grow by the same amount a
sample (an activation, a gradient of the inputs) or not at all (a parameter, optimizer state).

Two traced steps whose timelines are the same but for their bytes give each storage's bytes as a
line in the batch; the step at any other batch is that timeline with each storage's bytes read off
its line, rebuilt as a tracker (``LiveBytes.rebuilt``) and replayed through the caching allocator
as a traced one is. A timeline is not a line where the two differ in anything but bytes (a kernel
picked by shape, a batch of one taking another path) or where a storage's bytes do not grow by a
whole number a sample; then every size is traced. A search's answer read off the line is traced
again and must equal it to the byte, or the line is dropped and the search runs again, traced."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from bench.measure.memory import at_peak_memory
from bench.measure.tracker import (
    CUDA_BLOCK,
    FREED,
    MADE,
    LiveBytes,
    Moment,
    frees_in_birth_order,
)
from bench.predict.cards import Card
from bench.predict.depth import READ_OFF
from bench.predict.fake import CPU, Traced, finished, replayed_through, traced
from bench.record import Prediction
from bench.suite import RunSpec, Shapes


@dataclass(frozen=True)
class Timelines:
    """A traced step as ``LiveBytes.steps`` gives it, each storage renumbered by its place among
    those made (as ``LiveBytes.rebuilt`` reads them) and each run of frees in that order (a cache
    let go frees in a dict's order, which another batch need not keep, and the order of frees with
    no allocation between them changes nothing counted or replayed): the measured step's moments,
    the step before's, and which storages of the step before the measured one holds (its index,
    theirs)."""

    measured: tuple[Moment, ...]
    before: tuple[Moment, ...] | None
    carried: tuple[tuple[int, int], ...]

    @staticmethod
    def of(tracker: LiveBytes, with_before: bool = True) -> Timelines:
        """``with_before``: with the step before, where the tracker followed one."""
        measured, before = tracker.steps()
        if not with_before:
            before = None
        ours, placed = _renumbered(measured)
        carried = ()
        if before is not None:
            before, theirs = _renumbered(before)
            carried = tuple(
                sorted((placed[i], theirs[h]) for i, h in tracker.carried.items() if i in placed)
            )
        return Timelines(tuple(ours), before and tuple(before), carried)

    def same_but_bytes(self, other: Timelines) -> bool:
        return self.carried == other.carried and _shape(self) == _shape(other)

    def exactly(self) -> tuple:
        """Everything it holds, bytes and indices too: two equal are the same step."""
        return (_keys(self.measured), _keys(self.before or ()), self.carried)

    def tracker(self) -> LiveBytes:
        """A tracker that saw these steps, as ``LiveBytes.rebuilt`` makes one."""
        history = None
        if self.before is not None:
            history = LiveBytes.rebuilt(CPU, list(self.before))
        return LiveBytes.rebuilt(CPU, list(self.measured), history, dict(self.carried))


def _renumbered(moments: list[Moment]) -> tuple[list[Moment], dict[int, int]]:
    """The moments with each storage named by its place among those made, and that renumbering."""
    placed: dict[int, int] = {}
    out = []
    for m in moments:
        if m.kind == MADE:
            placed[m.index] = len(placed)
        if m.kind in (MADE, FREED):
            m = m.indexed(placed[m.index])
        out.append(m)
    return frees_in_birth_order(out), placed


def _shape(timelines: Timelines) -> tuple:
    every = (*timelines.measured, *(timelines.before or ()))
    return tuple((m.kind, m.label, m.index) for m in every), timelines.before is None


def _keys(moments: tuple[Moment, ...]) -> tuple:
    return tuple((m.kind, m.n, m.label, m.index, m.raw) for m in moments)


@dataclass(frozen=True)
class Line:
    """Steps at any size from steps traced at ``sizes``: each storage's bytes before rounding, a
    polynomial in the size through its bytes at them (a line through two; through three, a
    parabola, as attention's scores over a prompt are), in Newton's form: its divided
    differences, each a whole number."""

    sizes: tuple[int, ...]
    shape: Timelines  # the step at the first size: what every step makes, and in what order
    differences: tuple[tuple[int, ...], ...]  # per storage
    rounding: int

    @staticmethod
    def through(samples: list[tuple[int, Timelines]], rounding: int) -> Line | None:
        """The curve through steps the same but for their bytes, where each storage's divided
        differences are whole numbers (its bytes a polynomial in the size with whole coefficients,
        as a tensor's are in any of its dimensions); else None."""
        sizes = [size for size, _ in samples]
        if len(set(sizes)) < len(sizes) or len(sizes) < 2:
            return None
        first = samples[0][1]
        if not all(first.same_but_bytes(t) for _, t in samples[1:]):
            return None
        columns = list(zip(*([m.raw for m in _bytes(t)] for _, t in samples)))
        differences = []
        for ys in columns:
            found = _divided(sizes, list(ys))
            if found is None:
                return None
            differences.append(found)
        return Line(tuple(sizes), first, tuple(differences), rounding)

    def at(self, size: int) -> Timelines | None:
        """The step at ``size``; None where a storage's bytes fall below nothing there."""
        raws = []
        for d in self.differences:
            raw, term = d[0], 1
            for k in range(1, len(d)):
                term *= size - self.sizes[k - 1]
                raw += d[k] * term
            if raw < 0:
                return None
            raws.append(raw)
        sized = iter(raws)

        def read(moments: tuple[Moment, ...]) -> tuple[Moment, ...]:
            made: dict[int, int] = {}
            out = []
            for m in moments:
                if m.kind == MADE:
                    made[m.index] = next(sized)
                if m.kind in (MADE, FREED):
                    raw = made[m.index]
                    n = math.ceil(raw / self.rounding) * self.rounding
                    m = m.sized(n, raw)
                out.append(m)
            return tuple(out)

        before = self.shape.before and read(self.shape.before)
        return Timelines(read(self.shape.measured), before, self.shape.carried)


def _divided(xs: list[int], ys: list[int]) -> tuple[int, ...] | None:
    """Newton's divided differences of the points, where each is a whole number; else None."""
    out, column = [ys[0]], list(ys)
    for level in range(1, len(xs)):
        nxt = []
        for i in range(len(column) - 1):
            gap, span = column[i + 1] - column[i], xs[i + level] - xs[i]
            if gap % span:
                return None
            nxt.append(gap // span)
        column = nxt
        out.append(column[0])
    return tuple(out)


def _bytes(timelines: Timelines) -> list[Moment]:
    """Each storage's MADE, the step before's then the measured step's: a line per storage."""
    return [m for m in (*(timelines.before or ()), *timelines.measured) if m.kind == MADE]


@dataclass
class Sizes:
    """One run's predictions at the sizes a search tries (its batch, or a generation's prompt):
    traced at the first ``degree`` + 1, then read off the curve through them (``Line``) and
    replayed through the allocator, a figure as exact as a traced one's where the curve holds;
    ``confirmed`` holds it at the search's answer."""

    spec: RunSpec
    shaped: Callable[[int], Shapes]  # the run's shapes at a size
    cuda: bool = True
    card: Card | None = None
    reserved: bool = True  # the allocator replayed without a card too
    named: str = "batches"  # what the sizes are, for the progress lines
    degree: int = 1  # 2 where a size also grows a square (a prompt, under attention's scores)
    traced: dict[int, Traced] = field(default_factory=dict)
    # each traced step's timelines, where it has a tracker: a curve's candidate points
    points: dict[int, Timelines] = field(default_factory=dict)
    read: dict[int, Prediction] = field(default_factory=dict)  # the sizes read off the curve
    line: Line | None = None
    broken: bool = False  # a traced step disagreed with the curve: every size is traced

    @staticmethod
    def of_batch(spec: RunSpec, shapes: Shapes, **options: Any) -> Sizes:
        return Sizes(spec, lambda batch: replace(shapes, batch_size=batch), **options)

    def __call__(self, size: int) -> Prediction:
        if size in self.traced:
            return self.traced[size].prediction
        if size in self.read:
            return self.read[size]
        if self.line is not None and (timelines := self.line.at(size)) is not None:
            self.read[size] = self._replayed(timelines)
            return self.read[size]
        return self.trace(size).prediction

    def seed(self, size: int, own: Traced | None) -> None:
        """A prediction at ``size`` made already (not made again), and its tracker where it has
        one: the curve's first point."""
        if own is not None:
            self._add(size, own)

    def trace(self, size: int) -> Traced:
        found = traced(
            self.spec, self.shaped(size), self.cuda, card=self.card, reserved=self.reserved
        )
        self._add(size, found)
        return found

    def said(self, size: int) -> str:
        """How the figure at ``size`` was had."""
        if size not in self.read or self.line is None:
            return ""
        ends = [f"{n:,}" for n in sorted(self.line.sizes)]
        through = ", ".join(ends[:-1]) + f" and {ends[-1]}"
        return (
            f" (read off the {('line', 'curve')[self.degree > 1]} through {self.named} {through})"
        )

    def predicted(self) -> list[tuple[int, Prediction, bool]]:
        """Every size predicted, in order of size, and whether it was read off the curve (a size
        traced too is the traced one)."""
        made = self.read | {n: t.prediction for n, t in self.traced.items()}
        return [(n, p, n not in self.traced) for n, p in sorted(made.items())]

    def confirmed(self, size: int) -> bool:
        """Whether the step at ``size`` (a search's answer), if read off the curve, is the one a
        fresh trace makes; where not, the curve is dropped and every size from now on is traced."""
        if size not in self.read or self.line is None:
            return True
        expected = self.line.at(size)
        self.trace(size)
        found = self.points.get(size)
        if found is not None and expected is not None and found.exactly() == expected.exactly():
            return True
        self.line, self.broken, self.read = None, True, {}
        return False

    def _add(self, size: int, found: Traced) -> None:
        self.traced[size] = found
        if found.tracker is None or not found.prediction.ok:
            return
        mine = self.points[size] = self._timelines(found.tracker)
        if self.broken or self.line is not None:
            return
        alike = [
            (n, at_n)
            for n, at_n in reversed(self.points.items())  # the latest first
            if n != size and at_n.same_but_bytes(mine)
        ]
        if len(alike) >= self.degree:
            rounding = CUDA_BLOCK if self.cuda else 1
            self.line = Line.through([(size, mine), *alike[: self.degree]], rounding)

    def _timelines(self, tracker: LiveBytes) -> Timelines:
        """Its timelines as this search's steps are traced: without the step before where no
        allocator is replayed (a prediction made with it may seed one made without)."""
        return Timelines.of(tracker, self.reserved or self.card is not None)

    def _replayed(self, timelines: Timelines) -> Prediction:
        """The prediction read off a step: its peaks (a generation's in each phase) and what was
        alive at them, and its replay."""
        tracker = timelines.tracker()
        replay = next((t.replay for t in self.traced.values() if t.replay is not None), None)
        generating = self.spec.mode == "generate"
        read = at_peak_memory(tracker, generating).flat()
        prediction = Prediction(**{k: v for k, v in read.items() if k in READ_OFF})
        return finished(replayed_through(prediction, tracker, replay), self.card)
