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
from dataclasses import dataclass, field, replace

from bench.measure.tracker import (
    CUDA_BLOCK,
    FREED,
    MADE,
    LiveBytes,
    Moment,
    frees_in_birth_order,
)
from bench.predict.cards import Card
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
            m = replace(m, index=placed[m.index])
        out.append(m)
    return frees_in_birth_order(out), placed


def _shape(timelines: Timelines) -> tuple:
    every = (*timelines.measured, *(timelines.before or ()))
    return tuple((m.kind, m.label, m.index) for m in every), timelines.before is None


def _keys(moments: tuple[Moment, ...]) -> tuple:
    return tuple((m.kind, m.n, m.label, m.index, m.raw) for m in moments)


@dataclass(frozen=True)
class Line:
    """Steps at any size from two traced at sizes ``a`` and ``b``: each storage's bytes before
    rounding, ``start`` at ``a`` and ``slope`` more a unit of size."""

    a: int
    b: int  # the other size traced
    shape: Timelines  # the step at ``a``: what every step on the line makes, and in what order
    start: tuple[int, ...]
    slope: tuple[int, ...]
    rounding: int

    @staticmethod
    def through(a: int, at_a: Timelines, b: int, at_b: Timelines, rounding: int) -> Line | None:
        """The line through two steps the same but for their bytes, where each storage's bytes
        grow by a whole number a unit of size; else None."""
        if a == b or not at_a.same_but_bytes(at_b):
            return None
        starts = [m.raw for m in _bytes(at_a)]
        steps = [m.raw - s for m, s in zip(_bytes(at_b), starts)]
        if any(d % (b - a) for d in steps):
            return None
        slope = tuple(d // (b - a) for d in steps)
        return Line(a, b, at_a, start=tuple(starts), slope=slope, rounding=rounding)

    def at(self, size: int) -> Timelines | None:
        """The step at ``size``; None where a storage's line falls below nothing there."""
        raws = [s + k * (size - self.a) for s, k in zip(self.start, self.slope)]
        if any(r < 0 for r in raws):
            return None
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
                    m = replace(m, n=n, raw=raw)
                out.append(m)
            return tuple(out)

        before = self.shape.before and read(self.shape.before)
        return Timelines(read(self.shape.measured), before, self.shape.carried)


def _bytes(timelines: Timelines) -> list[Moment]:
    """Each storage's MADE, the step before's then the measured step's: a line per storage."""
    return [m for m in (*(timelines.before or ()), *timelines.measured) if m.kind == MADE]


@dataclass
class Sizes:
    """One run's predictions at the batches a search tries: traced at the first two, then read off
    the line through them (``Line``) and replayed through the allocator, a figure as exact as a
    traced one's where the line holds; ``confirmed`` holds it at the search's answer."""

    spec: RunSpec
    shapes: Shapes
    cuda: bool = True
    card: Card | None = None
    reserved: bool = True  # the allocator replayed without a card too
    traced: dict[int, Traced] = field(default_factory=dict)
    read: dict[int, Prediction] = field(default_factory=dict)  # the batches read off the line
    line: Line | None = None
    broken: bool = False  # a traced step disagreed with the line: every size is traced

    def __call__(self, batch: int) -> Prediction:
        if batch in self.traced:
            return self.traced[batch].prediction
        if batch in self.read:
            return self.read[batch]
        if self.line is not None and (timelines := self.line.at(batch)) is not None:
            self.read[batch] = self._replayed(timelines)
            return self.read[batch]
        return self.trace(batch).prediction

    def seed(self, batch: int, own: Traced | None) -> None:
        """A prediction at ``batch`` made already, and its tracker: the line's first point."""
        if own is not None and own.tracker is not None and own.prediction.ok:
            self._add(batch, own)

    def trace(self, batch: int) -> Traced:
        found = traced(
            self.spec,
            replace(self.shapes, batch_size=batch),
            self.cuda,
            card=self.card,
            reserved=self.reserved,
        )
        self._add(batch, found)
        return found

    def said(self, batch: int) -> str:
        """How the figure at ``batch`` was had."""
        if batch in self.read and self.line is not None:
            a, b = sorted((self.line.a, self.line.b))
            return f" (read off the line through batches {a:,} and {b:,})"
        return ""

    def confirmed(self, batch: int) -> bool:
        """Whether the step at ``batch`` (a search's answer, or 1 where none fits), if read off the
        line, is the one a fresh trace makes; where not, the line is dropped and every size from now
        on is traced."""
        if batch not in self.read or self.line is None:
            return True
        expected = self.line.at(batch)
        found = self.trace(batch)
        same = found.tracker is not None and expected is not None
        if same and self._timelines(found.tracker).exactly() == expected.exactly():
            return True
        self.line, self.broken, self.read = None, True, {}
        return False

    def _add(self, batch: int, found: Traced) -> None:
        self.traced[batch] = found
        if self.broken or self.line is not None or found.tracker is None:
            return
        if not found.prediction.ok:
            return
        rounding = CUDA_BLOCK if self.cuda else 1
        mine = self._timelines(found.tracker)
        for a, other in reversed(self.traced.items()):  # the latest first
            if a != batch and other.tracker is not None and other.prediction.ok:
                at_a = self._timelines(other.tracker)
                if line := Line.through(a, at_a, batch, mine, rounding=rounding):
                    self.line = line
                    return

    def _timelines(self, tracker: LiveBytes) -> Timelines:
        """Its timelines as this search's steps are traced: without the step before where no
        allocator is replayed (a prediction made with it may seed one made without)."""
        return Timelines.of(tracker, self.reserved or self.card is not None)

    def _replayed(self, timelines: Timelines) -> Prediction:
        tracker = timelines.tracker()
        replay = next((t.replay for t in self.traced.values() if t.replay is not None), None)
        prediction = Prediction(peak_tensor_bytes=tracker.peak)
        return finished(replayed_through(prediction, tracker, replay), self.card)
