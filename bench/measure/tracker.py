"""Live tensor bytes, counted exactly at every operator on any device.

A TorchDispatchMode sees every tensor an operator returns; each new storage is counted once and
uncounted when it is freed (a weakref finalizer on the storage). Unlike the caching allocator's
statistics this works on the CPU, and unlike PyTorch's MemTracker it handles a module called several
times in one step (gradient accumulation) and reports the bytes held from forward into backward.

Every storage's life is kept as (bytes, label, born, freed) on one event clock, so what was alive at
the peak, and what it was, can be read off afterwards without copying the live set at every new
peak.
"""

from __future__ import annotations

import bisect
import math
import weakref
from collections.abc import Callable, Container, Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode_temporarily,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_leaves

from bench.measure.allocator import CachingAllocator, OutOfMemory
from bench.measure.host import HostBytes, host_kind, inner_tensors, is_unified, making

CUDA_BLOCK = 512  # the caching allocator rounds every allocation up to this
DEVICE = torch.ops.prim.device.default


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    if is_traceable_wrapper_subclass(t):
        return [s for inner in inner_tensors(t) for s in storages(inner)]
    return [t.untyped_storage()]


MADE, FREED, PHASE, OP, MARK, UNTIL = "made", "freed", "phase", "op", "mark", "until"


class Moment:
    """One thing a tracker saw, in order (``LiveBytes.timeline``): a storage MADE or FREED (its
    bytes, its label, and its index among the tracker's storages), an OP returning (its name as the
    label), a PHASE beginning (its name), the MARK ending a part that repeats (``mark``), or the
    UNTIL where a following tracker took over.
    Compared without the index: two steps that make and free the same sizes in the same order, in
    the same operators, are the same. A plain slotted class, not a dataclass: a prediction makes
    and copies millions of them, and a frozen dataclass's ``__init__`` and ``replace`` cost
    several times a slotted one's."""

    __slots__ = ("kind", "n", "label", "index", "raw")

    def __init__(self, kind: str, n: int, label: str, index: int = -1, raw: int = 0) -> None:
        self.kind, self.n, self.label = kind, n, label
        self.index = index
        # its bytes before rounding to blocks (bench.predict.lines reads them at other sizes)
        self.raw = raw

    def indexed(self, index: int) -> Moment:
        """The same moment naming the storage ``index``."""
        return Moment(self.kind, self.n, self.label, index, raw=self.raw)

    def sized(self, n: int, raw: int) -> Moment:
        """The same moment of a storage of ``n`` bytes, ``raw`` before rounding."""
        return Moment(self.kind, n, self.label, self.index, raw=raw)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Moment):
            return NotImplemented
        return self.kind == other.kind and self.n == other.n and self.label == other.label

    def __hash__(self) -> int:
        return hash((self.kind, self.n, self.label))

    def __repr__(self) -> str:
        return f"Moment({self.kind!r}, {self.n}, {self.label!r}, {self.index}, raw={self.raw})"


class NotRepeating(Exception):
    """A step's marked parts did not repeat (``LiveBytes.repeat``): it must be traced whole."""


# An operator's kernel written as the operators it calls, each called through ``call`` (which counts
# what it makes): (call, *args, **kwargs) -> the operator's outputs.
Kernel = Callable[..., object]


_RESIZE = torch.UntypedStorage.resize_
_RESIZING: list[LiveBytes] = []  # the trackers counting now: each is told of a storage resized


def _resize(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
    """``UntypedStorage.resize_`` while a tracker counts: no operator is dispatched for it."""
    out = _RESIZE(storage, size)
    for tracker in _RESIZING:
        tracker.resized(storage)
    return out


class LiveBytes(TorchDispatchMode):
    def __init__(
        self,
        device: torch.device,
        rounding: int | None = None,
        kernels: dict[torch._ops.OpOverload, Kernel] | None = None,
    ) -> None:
        """``rounding``: allocation granularity to count in; CUDA's 512 bytes by default on CUDA, so
        a prediction on a CPU can model the CUDA allocator too. ``kernels``: operators whose kernel
        on the modelled device is a composite of others, run as that composite, so that the
        temporaries it makes and frees before it returns are counted as the allocator is asked for
        them (a real run's tracker sees the operator whole)."""
        super().__init__()
        self.device_type = device.type
        self.rounding = rounding or (CUDA_BLOCK if device.type == "cuda" else 1)
        self.kernels = kernels or {}
        self._live: dict[int, int] = {}  # id(storage) → its index in _lives
        self._lives: list[list] = []  # [bytes, label, born, freed or None] per storage ever counted
        self._raw: list[int] = []  # each one's bytes before rounding, in the same order
        self._clock = 0
        self._peak_clock = 0
        self.current = 0
        self.peak = 0
        # each phase's own peak, from the bytes alive as it began
        self.phase_peaks: dict[str, int] = {}
        # (clock, phase) as each phase began: where in the order of events (bench.predict.depth)
        self.phase_log: list[tuple[int, str]] = []
        # (clock, operator) as each operator returned: where one ends and the next begins
        self.op_ends: list[tuple[int, str]] = []
        # the clock as the step began and ended (``track``): what was counted before was given
        # to it; what is freed later is its teardown, whenever the garbage collector comes to it
        self.started: int | None = None
        self.ended: int | None = None
        self.at_start = 0  # the bytes given to the step
        # set by the caller (forward / backward / optimizer); remembered at the peak
        self.phase = ""
        self.peak_phase = ""
        self._history: LiveBytes | None = None  # follow()
        self._history_until = 0
        # this tracker's index → the history's, for the same storage
        self._carried: dict[int, int] = {}
        self.marks: list[int] = []  # the clock where each repeated part of the step ended (mark)
        # a rebuilt history's clock where the steps after it took over (its timeline's UNTIL)
        self.until: int | None = None
        self._repeats: Repeats | None = None  # what repeat() wrote, for the replay to cut short
        self.host = HostBytes()  # what the step holds on the host for the device (host.py)

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, name: str) -> None:
        self._phase = name
        self.phase_log.append((self._clock, name))
        self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.current)

    def add(self, tensors: Iterable[torch.Tensor], label: str = "") -> None:
        """Count tensors that exist already (parameters, optimizer state), labelled by what they
        are."""
        for t in tensors:
            self._count(t, label)

    def label(self, tensors: Iterable[torch.Tensor], label: str) -> None:
        """Name what live storages are (gradients are only known as such once backward has made
        them)."""
        for t in tensors:
            for storage in storages(t):
                if (index := self._live.get(id(storage))) is not None:
                    self._lives[index][1] = label

    def at_peak(self) -> dict[str, int]:
        """Bytes alive at the peak by label; storages counted while running carry the phase they
        were made in. The values sum to ``peak``."""
        out: dict[str, int] = {}
        for n, label, born, freed in self._lives:
            if born <= self._peak_clock and (freed is None or freed > self._peak_clock):
                out[label] = out.get(label, 0) + n
        return out

    @contextmanager
    def stepped_aside(self) -> Iterator[None]:
        """The block runs without this mode, as compiled code must (dynamo refuses to trace under a
        dispatch mode): what it allocates is not counted, what it frees still is (the finalizers
        stay)."""
        with _pop_mode_temporarily() as mode:
            assert mode is self, "the tracker must be the innermost dispatch mode to step aside"
            yield

    def _count(self, t: torch.Tensor, label: str | None = None, made: bool = False) -> None:
        """Counts ``t``'s storage where first seen: the host's (``host_kind``; ``made`` by an
        operator, no view of its inputs) or the device's."""
        if is_traceable_wrapper_subclass(t):  # e.g. an 8-bit optimizer state: count what it wraps
            for inner in inner_tensors(t):
                self._count(inner, label, made)
            return
        storage = t.untyped_storage()
        if id(storage) in self._live or self.host.holds(storage) or is_unified(t, made):
            return
        if (pinned := host_kind(t, self.device_type, made)) is not None:
            self.host.count(storage, pinned)
        elif t.device.type == self.device_type:
            self._born(storage, label)

    def _born(self, storage: torch.UntypedStorage, label: str | None = None) -> None:
        """A storage counted from now, at its bytes now, freed when it dies."""
        key = id(storage)
        n = math.ceil(storage.nbytes() / self.rounding) * self.rounding
        index = len(self._lives)
        self._lives.append([n, self.phase if label is None else label, self._tick(), None])
        self._raw.append(storage.nbytes())
        self._live[key] = index
        self.current += n
        if self.current > self.phase_peaks[self._phase]:
            self.phase_peaks[self._phase] = self.current
        if self.current > self.peak:
            self.peak = self.current
            self.peak_phase = self.phase
            self._peak_clock = self._lives[index][2]
        weakref.finalize(storage, self._free, key, index)

    def follow(self, history: LiveBytes) -> None:
        """Take ``history`` (a tracker of the steps before, still counting frees) as what came
        before this one: its storages alive now are the tensors this one was given (``add``) before
        its step."""
        self._history, self._history_until = history, history._clock
        self._carried = {
            i: history._live[key] for key, i in self._live.items() if key in history._live
        }

    def begin(self) -> None:
        """The step begins: what was counted before it was given to it (``started``,
        ``at_start``)."""
        self.started = self._clock
        self.at_start = self.current

    def end(self) -> None:
        """The step is over: what is freed after this is its teardown (``ended``)."""
        self.ended = self._clock

    def made_in_step(self) -> list[int]:
        """The storages the step made (after ``begin``), in the order it made them."""
        return [i for i, life in enumerate(self._lives) if life[2] > self.started]

    def outlived(self, indices: Iterable[int]) -> bool:
        """Whether any of these storages lived past the step's end."""
        return any(self._lives[i][3] is None or self._lives[i][3] > self.ended for i in indices)

    def raw_bytes(self, indices: Iterable[int]) -> list[int]:
        """These storages' bytes before rounding."""
        return [self._raw[i] for i in indices]

    def preceded_by_itself(self, kept: set[int]) -> LiveBytes:
        """The same step run once before this one, as the allocator sees it (a warm-up that makes
        what this step makes), and this one following it: a rebuilt tracker of this step's
        moments, the ``kept`` storages never freed (made before the warm-up and held past it)."""
        placed: dict[int, int] = {}
        moments = []
        for m in self.timeline(self.ended):
            if m.kind == FREED and m.index in kept:
                continue
            if m.kind == MADE:
                placed[m.index] = len(placed)
            if m.kind in (MADE, FREED):
                m = m.indexed(placed[m.index])
            moments.append(m)
        history = LiveBytes.rebuilt(torch.device(self.device_type), moments)
        given = [i for i, life in enumerate(self._lives) if life[2] <= self.started]
        self._history, self._history_until = history, history.until
        self._carried = {i: placed[i] for i in given}
        return history

    @property
    def carried(self) -> dict[int, int]:
        """Its storages that the steps before made (``follow``): its index, and theirs."""
        return self._carried

    @property
    def followed_until(self) -> int:
        """The clock of the steps before (``follow``) where this one took over."""
        return self._history_until

    def mark(self) -> None:
        """The end of a part of the step that repeats (a micro-batch, after its backward)."""
        self.marks.append(self._clock)

    def part_peaks(self) -> list[int]:
        """The live bytes' peak within each marked part, the first from the tracker's start (each
        step of a variable-length pass, marked after each: ``mark_trackers``)."""
        peaks, current, marks = [], 0, iter(self.marks)
        end, highest = next(marks, None), 0
        for clock, freeing, _, n in self._events():
            while end is not None and clock > end:
                peaks.append(highest)
                end, highest = next(marks, None), current
            if end is None:
                break
            current += -n if freeing else n
            highest = max(highest, current)
        if end is not None:
            peaks.append(highest)
        return peaks

    def repeat(self, times: int, growing: bool = False, rounding: int | None = None) -> bool:
        """Every storage's life as if the last marked part had run ``times`` times more, where it
        provably repeats; False, and nothing changed, where it does not.

        A part repeats where the last two make the same storages (bytes and label) in the same
        order, interleaved with the same frees, each of a storage made in the same part or, at the
        same place in order, in the one before; and where nothing either made lives past the next
        part but into what follows them, already freed. A program that runs the same code on
        tensors of the same shapes then makes the same storages every time, so the repeats' lives
        are the last part's, shifted along the clock: each one's storages freed in the next part as
        the part before's were freed in it, the last one's as the last part's were freed after it.
        The live bytes at every point of a repeat are the last part's, so the peak and what was
        alive at it are unchanged; only the order of allocations and frees the caching allocator
        sees grows.

        ``growing`` (a generation's decode forwards, each attending to one token more): each
        storage of a part may grow by the same bytes from one part to the next, as the last three
        show (a dynamic cache's keys, the ids so far, attention's scores), and does in each repeat;
        what follows the last part, made as the part's first storages are (the last forward), grows
        by as much as they would have at its place, and must make nothing else. The peak is counted
        again. Sizes grown are rounded to ``rounding`` bytes (the tracker's own by default)."""
        if times <= 0:
            return True
        if len(self.marks) < 4:
            return False
        edges = self.marks[-4:]  # the three parts before the last mark
        spans = [_span(self._lives, edges[k], edges[k + 1]) for k in range(3)]
        growth = self._growth(spans, edges, growing)
        tail = self._tail(spans[2], edges[3], growth)
        if growth is None or tail is None:
            return False
        last, before, end = spans[2], spans[1], edges[3]
        if any(self._lives[i][3] is None for i in last):  # (_pattern: all of before's are freed)
            return False  # a storage of theirs still alive: its finalizer would free another
        # the clock of the free, in the last part, of each storage the part before carried into it
        freed_next = {
            j: self._lives[i][3] for j, i in enumerate(before) if self._lives[i][3] > edges[2]
        }
        period = end - edges[2]
        shift = times * period
        for life in self._lives:
            if life[2] > end:
                life[2] += shift
            if life[3] is not None and life[3] > end:
                life[3] += shift
        lasting = {j: self._lives[i][3] for j, i in enumerate(last) if self._lives[i][3] > end}
        for j in lasting:  # the last part's carried storages are now freed in the first repeat
            self._lives[last[j]][3] = freed_next[j] + period
        grain = rounding or self.rounding
        first = len(self._lives)  # the first repeat's first storage
        for r in range(1, times + 1):
            for j, i in enumerate(last):
                n, label, born, freed = self._lives[i]
                if j in lasting:
                    if r == times:
                        freed = lasting[j]
                    else:
                        freed = freed_next[j] + (r + 1) * period
                else:
                    freed += r * period
                raw = self._raw[i] + r * growth[j]
                if growth[j]:
                    n = math.ceil(raw / grain) * grain
                self._lives.append([n, label, born + r * period, freed])
                self._raw.append(raw)
        for i, by in tail.items():
            self._raw[i] += times * by
            self._lives[i][0] = math.ceil(self._raw[i] / grain) * grain
        self._clock += shift
        if self.until is not None and self.until > end:
            self.until += shift
        if self.ended is not None and self.ended > end:
            self.ended += shift
        # what came after the last part (the optimizer's phase, its operators) comes after the
        # repeats
        self.phase_log = [(c + shift * (c > end), name) for c, name in self.phase_log]
        self.op_ends = [(c + shift * (c > end), name) for c, name in self.op_ends]
        if any(growth) or tail:
            self._repeats = None  # no two repeats alike: the replay runs every one
            self._recount()
            return True
        # a second repeat of one tracker is replayed whole
        repeats = Repeats(end, period, times, tuple(last), first, frozenset(lasting))
        self._repeats = repeats if self._repeats is None else None
        if self._peak_clock > end:
            self._peak_clock += shift
        return True

    def _growth(self, spans: list[list[int]], edges: list[int], growing: bool) -> list[int] | None:
        """The bytes each storage of the last part grows by from one part to the next (none unless
        ``growing``), where the last two parts repeat (``repeat``); else None."""
        patterns = [
            self._pattern(spans[k], spans[k + 1], edges[k + 1], edges[k + 2], sized=not growing)
            for k in (0, 1)
        ]
        if patterns[0] is None or patterns[0] != patterns[1]:
            return None
        if not growing:
            return [0] * len(spans[2])
        labels = [[self._lives[i][1] for i in span] for span in spans]
        if labels[0] != labels[1]:
            return None
        raws = [[self._raw[i] for i in span] for span in spans]
        steps = [b - a for a, b in zip(raws[1], raws[2])]
        if any(b - a != d for a, b, d in zip(raws[0], raws[1], steps)):
            return None
        return steps

    def _tail(self, last: list[int], end: int, growth: list[int] | None) -> dict[int, int] | None:
        """What follows the last part, where its parts grow: each storage it makes, made as the
        last part's at the same place, with the bytes that one grows by; None where it makes one
        that is not, or not one part's growth larger."""
        if growth is None or not any(growth):
            return {}
        after = sorted(
            (i for i, life in enumerate(self._lives) if life[2] > end),
            key=lambda i: self._lives[i][2],
        )
        out = {}
        for j, i in enumerate(after):
            if self.ended is not None and self._lives[i][2] > self.ended:
                break  # made after the step: not the step's
            if j >= len(last) or self._lives[i][1] != self._lives[last[j]][1]:
                return None
            if self._raw[i] - self._raw[last[j]] != growth[j]:
                return None
            out[i] = growth[j]
        return out

    def _recount(self) -> None:
        """The peak, its phase and clock, each phase's peak and the bytes alive now, counted
        again over every storage's life (``repeat`` grew some)."""
        changes: list[tuple[int, int]] = []
        for n, _, born, freed in self._lives:
            changes.append((born, n))
            if freed is not None:
                changes.append((freed, -n))
        changes.sort()
        phases = sorted(self.phase_log)
        self.current = self.peak = self._peak_clock = 0
        self.phase_peaks = {}
        phase, k = "", 0
        for clock, n in changes:
            while k < len(phases) and phases[k][0] < clock:  # a phase set before this event
                phase = phases[k][1]
                self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), self.current)
                k += 1
            self.current += n
            if n > 0:
                self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), self.current)
            if self.current > self.peak:
                self.peak, self.peak_phase, self._peak_clock = self.current, phase, clock
        for _, name in phases[k:]:
            self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.current)

    def _pattern(
        self, before: list[int], span: list[int], start: int, end: int, sized: bool = True
    ) -> list[tuple[object, ...]] | None:
        """A part's makes and frees in order, each free naming the storage it frees by its place
        among those made in the part or the part before, each make its bytes where ``sized``;
        None where it frees another, or where a storage the part before made outlives this
        part."""
        if any(self._lives[i][3] is None or self._lives[i][3] > end for i in before):
            return None  # made in the part before and alive after this one: it accumulates
        events = []
        for i in span:
            n, label, born, _ = self._lives[i]
            events.append((born, ("make", n if sized else None, label)))
        place = {i: ("same", j) for j, i in enumerate(span)} | {
            i: ("before", j) for j, i in enumerate(before)
        }
        for i, (_, _, _, freed) in enumerate(self._lives):
            if freed is not None and start < freed <= end:
                if i not in place:
                    return None  # frees a storage made before the part before
                events.append((freed, ("free", *place[i])))
        return [e for _, e in sorted(events)]

    def timeline(self, until: int, ordered: bool = False) -> list[Moment]:
        """Every birth and death of a storage, each operator's return and each phase's beginning,
        in the order they came, up to the clock ``until`` (the step's end, or where the step after
        began, ``follow``), and a marker there; ``ordered``: each run of frees with nothing between
        them in the order their storages were made (``frees_in_birth_order``)."""
        # every make and free has a clock of its own (``_tick``), so the moments fall into place
        # by clock without a sort; operators, marks and phases share clocks, and come after the
        # make or free at theirs, operators first (a part ends before the next phase begins)
        stored: list[Moment | None] = [None] * (until + 1)
        for i, (n, label, born, freed) in enumerate(self._lives):
            if born <= until:
                stored[born] = Moment(MADE, n, label, i, raw=self._raw[i])
            if freed is not None and freed <= until:
                stored[freed] = Moment(FREED, n, label, i, raw=self._raw[i])
        after: dict[int, list[Moment]] = {}
        shared = (
            *((clock, Moment(OP, 0, name)) for clock, name in self.op_ends),
            *((clock, Moment(MARK, 0, "")) for clock in self.marks),
            *((clock, Moment(PHASE, 0, name)) for clock, name in self.phase_log),
        )
        for clock, m in shared:
            if clock <= until:
                after.setdefault(clock, []).append(m)
        moments = []
        for clock, m in enumerate(stored):
            if m is not None:
                moments.append(m)
            if clock in after:
                moments += after[clock]
        moments.append(Moment(UNTIL, 0, ""))
        if ordered:
            return frees_in_birth_order(moments)
        return moments

    def steps(self) -> tuple[list[Moment], list[Moment] | None]:
        """Its own timeline to the step's end (all it saw, where none was marked), and the steps
        before's up to where it took over (None where it follows none), each storage named by its
        index in its own tracker (``carried`` pairs them)."""
        own = self.timeline(self._clock if self.ended is None else self.ended)
        before = None
        if self._history is not None:
            before = self._history.timeline(self._history_until)
        return own, before

    @classmethod
    def rebuilt(
        cls,
        device: torch.device,
        moments: list[Moment],
        history: LiveBytes | None = None,
        carried: dict[int, int] | None = None,
    ) -> LiveBytes:
        """A tracker that saw ``moments`` (``timeline``'s form; each FREED names the index of the
        MADE it frees), as counting them would have left it: its peak, the phase the peak fell in,
        each phase's peak; following ``history`` up to its UNTIL, ``carried`` its storages that
        are this one's (``follow``)."""
        out = cls(device, rounding=1)
        for m in moments:
            if m.kind == PHASE:
                out.phase = m.label
            elif m.kind == MADE:
                out._lives.append([m.n, m.label, out._tick(), None])
                out._raw.append(m.raw)
                out.current += m.n
                out.phase_peaks[out._phase] = max(out.phase_peaks[out._phase], out.current)
                if out.current > out.peak:
                    out.peak, out.peak_phase, out._peak_clock = out.current, out.phase, out._clock
            elif m.kind == FREED:
                out._lives[m.index][3] = out._tick()
                out.current -= m.n
            elif m.kind == MARK:
                out.mark()
            elif m.kind == UNTIL:  # where the steps after this one took over (a history's own)
                out.until = out._clock
        if history is not None:
            out._history, out._history_until = history, history.until
            out._carried = carried or {}
        return out

    def replay(self, allocator: CachingAllocator) -> None:
        """Every allocation and free this tracker saw, in order, through ``allocator``: after the
        history's (``follow``), or else with the tensors it was given before its step (parameters,
        kept gradients, optimizer state) allocated first, in order."""
        carried = {i: ("history", h) for i, h in self._carried.items()}
        if self._history is not None:
            history = self._history
            history._feed(allocator, lambda i: ("history", i), (), self._history_until)
        try:
            self._feed(allocator, lambda i: carried.get(i, i), carried)
        except OutOfMemory as exc:  # the marked part whose request failed
            exc.part = bisect.bisect_left(self.marks, self._lives[exc.index][2]) + 1
            raise

    def _feed(
        self,
        allocator: CachingAllocator,
        handle: Callable[[int], Hashable],
        given: Container[int],
        until: int | None = None,
    ) -> None:
        """This tracker's allocations and frees up to ``until``, in order, through ``allocator``,
        each storage under its ``handle``; the ``given`` ones (the steps before made them) are
        freed, not allocated. A run of repeats (``repeat``) is cut short where the allocator's state
        at the end of one is its state at the end of one before (the storages each repeat hands on
        to the next named by their place): every repeat asks the same, so from there the states
        come round with that period, and whole periods are skipped, what the last skipped repeat
        hands on renamed as the one it stands for."""
        events, reps = self._events(until), self._repeats
        at, boundary = 0, 0  # the next event; the next end of a repeat to look at
        seen: dict[tuple, int] = {}  # the allocator's state at each end looked at
        marks = iter(self.marks if until is None else ())  # the allocator told of each end
        mark = next(marks, None)
        while at < len(events):
            clock, freeing, i, n = events[at]
            while mark is not None and clock > mark:
                allocator.mark()
                mark = next(marks, None)
            if reps is not None and boundary <= reps.times and clock > reps.end_of(boundary):
                state = allocator.state(
                    {handle(k): ("handed", j) for j, k in reps.handed(boundary)}
                )
                if state in seen:  # periodic from here: skip whole periods
                    period = boundary - seen[state]
                    to = boundary + (reps.times - boundary) // period * period
                    for (_, old), (_, new) in zip(reps.handed(boundary), reps.handed(to)):
                        allocator.rename(handle(old), handle(new))
                    while at < len(events) and events[at][0] <= reps.end_of(to):
                        at += 1
                    seen, reps = {}, None  # the repeats left (under a period) replayed as they are
                    continue
                seen[state], boundary = boundary, boundary + 1
                continue
            if freeing:
                allocator.free(handle(i))
            elif i not in given:
                self._malloc(allocator, handle(i), n, i)
            at += 1
        while mark is not None:
            allocator.mark()
            mark = next(marks, None)

    def _events(self, until: int | None = None) -> list[tuple[int, bool, int, int]]:
        """(clock, freeing, index, bytes) in clock order, up to ``until``."""
        events = sorted(
            [(born, 0, i, n) for i, (n, _, born, _) in enumerate(self._lives)]
            + [
                (freed, 1, i, n)
                for i, (n, _, _, freed) in enumerate(self._lives)
                if freed is not None
            ]
        )
        return [(c, bool(f), i, n) for c, f, i, n in events if until is None or c <= until]

    def _malloc(self, allocator: CachingAllocator, handle: Hashable, n: int, i: int) -> None:
        try:
            allocator.malloc(handle, n)
        except OutOfMemory as exc:
            exc.label = self._lives[i][1]  # what the request was for: its phase, or what it holds
            exc.index = i
            raise

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _free(self, key: int, index: int) -> None:
        if self._lives[index][3] is not None:  # resized away before it died (``resized``)
            return
        if self._live.get(key) == index:
            del self._live[key]
        self._lives[index][3] = self._tick()
        self.current -= self._lives[index][0]

    def resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` was resized in place (FSDP2 frees an unsharded parameter's storage after
        use, resizing it to nothing, and resizes it back for the next all-gather): the bytes it
        held are freed, those it holds now counted, as the caching allocator frees and allocates
        them. A storage grown that this tracker never counted is one of its device's (a storage of
        another device, a host's, is left out); one shrunk that it never counted is not its own."""
        key = id(storage)
        if (index := self._live.get(key)) is not None:
            if self._raw[index] == storage.nbytes():
                return
            self._free(key, index)
        elif storage.nbytes() == 0 or storage.device.type not in (self.device_type, "meta"):
            return
        if storage.nbytes():
            self._born(storage)

    def __enter__(self) -> LiveBytes:
        if not _RESIZING:
            torch.UntypedStorage.resize_ = _resize  # type: ignore[method-assign]
        _RESIZING.append(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        _RESIZING.remove(self)
        if not _RESIZING:
            torch.UntypedStorage.resize_ = _RESIZE  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE:
            return device_of(args[0])
        if (kernel := self.kernels.get(func)) is not None:
            out = kernel(self._called, *args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        given = set()
        if making() is not None:  # what is made now may be the host's, what is viewed is not new
            inputs = (a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor))
            given = {id(s) for a in inputs for s in storages(a)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t, made=not given or id(t.untyped_storage()) not in given)
        self.op_ends.append((self._clock, func.__name__))
        return out

    def _called(self, func: torch._ops.OpOverload, *args: object, **kwargs: object) -> object:
        """An operator a composite kernel calls, counted as if dispatched here."""
        return self.__torch_dispatch__(func, (), args, kwargs)


def mark_trackers() -> None:
    """Each live-bytes tracker counting now marks the end of a part (a step of a pass)."""
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, LiveBytes):
            mode.mark()


def device_of(t: torch.Tensor) -> torch.device:
    """A tensor's device, asked of the modes when a fake tensor's is read (autograd's engine and
    the model's code read it thousands of times a step): a fake one answers itself, past the modes
    beneath, and no operator is counted, as none runs on a real device."""
    if (fake := getattr(t, "fake_device", None)) is not None:
        return fake
    return DEVICE(t)


@dataclass(frozen=True)
class Repeats:
    """What ``LiveBytes.repeat`` wrote: ``times`` copies of the part that ended at the clock
    ``end``, each ``period`` ticks long, the r-th copy of the part's j-th storage at index
    ``first + (r - 1) * len(part) + j``; the storages at ``handing`` (their places in the part) each
    live into the next copy."""

    end: int
    period: int
    times: int
    part: tuple[int, ...]  # the last traced part's storages, in the order they were made
    first: int
    handing: frozenset[int]

    def end_of(self, r: int) -> int:
        """The clock where the r-th copy ends (the 0th: the traced part)."""
        return self.end + r * self.period

    def handed(self, r: int) -> list[tuple[int, int]]:
        """(place, index) of each storage the r-th copy hands on to the next."""
        if r == 0:
            return [(j, self.part[j]) for j in sorted(self.handing)]
        return [(j, self.first + (r - 1) * len(self.part) + j) for j in sorted(self.handing)]


def frees_in_birth_order(moments: list[Moment]) -> list[Moment]:
    """Each run of frees with nothing between them (a cache cleared, a graph let go) in the order
    their storages were made: the order a dict or the garbage collector freed them in is no order
    a step keeps from one layer to the next, and changes nothing counted (no storage is made
    between them, and the caching allocator's free blocks are the same whatever order they came
    back in)."""
    out: list[Moment] = []
    run: list[Moment] = []
    for m in [*moments, None]:
        if m is not None and m.kind == FREED:
            run.append(m)
            continue
        if run:
            out += sorted(run, key=_index) if len(run) > 1 else run
            run = []
        if m is not None:
            out.append(m)
    return out


def _index(m: Moment) -> int:
    return m.index


def _span(lives: list[list], start: int, end: int) -> list[int]:
    """The storages made between two clocks, in the order they were made."""
    return sorted(
        (i for i, life in enumerate(lives) if start < life[2] <= end), key=lambda i: lives[i][2]
    )
