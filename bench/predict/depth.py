"""A deep model's step from three shallow ones (issue 65): a transformer is the same layer many
times, so its step is predicted from the step at 1, 2 and 3 of its layers instead of all of them.

Each step a tracker saw is a timeline (``LiveBytes.timeline``): storages made and freed, phases
beginning. The timeline at 2 layers is the one at 1 with blocks inserted (a layer's parameters, its
forward, its backward, its share of each optimizer operator); the fold holds only where the timeline
at 3 layers is the one at 1 with each block inserted twice at the same place, and where every free
of a repeated block names the storage it frees by a rule that both shallow steps obey (the same
copy's, the copy before's or after's, the mirror copy's as backward runs the layers in reverse, the
first's, the last's, or one made once). The step at full depth is then the one at 1 with each block
inserted once per layer more, its frees resolved by those rules: the same timeline the whole step
would make, its peak, breakdown and phase read off it and its allocations replayed through the
caching allocator as the whole one's would be. Figures that are sums over layers (parameters,
gradients, optimizer state, activations kept for backward, FLOPs, collectives' bytes) are the
shallow steps' line through 1, 2 and 3 layers, which must be straight. A model whose layers are not
all alike (another width, a sliding window on some, experts on some) or whose shallow steps do not
show the pattern is traced whole, and the prediction says why. The same step at another size
(``refold``) is traced at 1 and 2 layers alone where they follow the fold proven at three depths
but for their bytes.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields, replace
from difflib import SequenceMatcher

import torch
from torch import nn

from bench.measure.memory import at_peak_memory
from bench.measure.tracker import FREED, MADE, PHASE, LiveBytes, Moment
from bench.models import CUT_STACK
from bench.record import Prediction

DEPTHS = (1, 2, 3)  # the shallow steps traced
FOLD_FROM = 8  # layers: below, the whole step costs about as much as the three shallow ones
CPU = torch.device("cpu")
# what a stack's layers may differ in: the index each is told (a cache's slot)
INDEX_NAMES = ("layer_idx", "layer_id", "layer_index", "idx")


def stack(model: nn.Module) -> tuple[nn.Module, str] | None:
    """The model's run of repeated layers, as (its parent, its attribute): the longest ModuleList or
    Sequential of one class; None where none has two."""
    found = None
    for parent in model.modules():
        for name, child in parent.named_children():
            layers = (
                list(child.children()) if isinstance(child, nn.ModuleList | nn.Sequential) else []
            )
            if len(layers) >= 2 and len({type(m) for m in layers}) == 1:
                if found is None or len(layers) > len(getattr(*found)):
                    found = (parent, name)
    return found


def depth_of(model: nn.Module) -> tuple[int, str]:
    """The model's layers, and why they cannot be folded ("" where they can): a stack of layers
    alike, but for the index each is told, in their parameters, buffers, classes and settings."""
    found = stack(model)
    if found is None:
        return 0, "no stack of repeated layers"
    layers = list(getattr(*found).children())
    if len({_signature(m) for m in layers}) > 1:
        return len(layers), "its layers differ (widths, attention windows or experts)"
    types = getattr(getattr(model, "config", None), "layer_types", None)
    if types and len(set(types)) > 1:
        return len(layers), f"its layers are of {len(set(types))} types ({', '.join(set(types))})"
    return len(layers), ""


def truncate(model: nn.Module, depth: int) -> None:
    """The model's first ``depth`` layers alone, its config (a copy) told so: transformers' models
    loop over config.num_hidden_layers of their layers."""
    parent, name = stack(model)
    layers = getattr(parent, name)
    if isinstance(layers, nn.Sequential):
        cut = layers[:depth]  # its children's names kept
    else:
        cut = nn.ModuleList(list(layers)[:depth])
    setattr(cut, CUT_STACK, True)  # one layer left is still the repeated block techniques wrap
    setattr(parent, name, cut)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        return
    # a copy: the config is the model spec's, which builds the next model too
    own = copy.deepcopy(config)
    own.num_hidden_layers = depth
    if getattr(own, "layer_types", None):
        own.layer_types = own.layer_types[:depth]
    for module in model.modules():
        if getattr(module, "config", None) is config:
            module.config = own


def _signature(layer: nn.Module) -> tuple:
    def settings(m: nn.Module) -> tuple:
        return tuple(
            sorted(
                (k, v)
                for k, v in vars(m).items()
                if not k.startswith("_")
                and k not in INDEX_NAMES
                and isinstance(v, int | float | str | bool | type(None))
            )
        )

    return tuple(
        (name, type(m).__name__, settings(m))
        + tuple((p, tuple(t.shape), t.dtype) for p, t in m.named_parameters(recurse=False))
        + tuple((b, tuple(t.shape), t.dtype) for b, t in m.named_buffers(recurse=False))
        for name, m in layer.named_modules()
    )


# Where an event of a folded timeline comes from: the shallowest step's event j, ("base", j), or
# event e of block k's r-th copy, ("copy", k, r, e).
Origin = tuple


@dataclass(frozen=True)
class Pattern:
    """How a tracker's timeline grows a layer at a time: the shallowest's moments, and the blocks
    inserted into it per layer (before which of its moments, and what they hold)."""

    base: list[Moment]
    blocks: list[tuple[int, list[Moment]]]

    def origins(self, copies: int) -> list[Origin]:
        """Each moment of the timeline with ``copies`` copies of every block, by where it comes
        from."""
        at: dict[int, list[int]] = {}
        for k, (pos, _) in enumerate(self.blocks):
            at.setdefault(pos, []).append(k)
        out: list[Origin] = []
        for j in range(len(self.base) + 1):
            for k in at.get(j, []):  # blocks at one place: each one's copies, in turn
                size = len(self.blocks[k][1])
                out += [("copy", k, r, e) for r in range(1, copies + 1) for e in range(size)]
            if j < len(self.base):
                out.append(("base", j))
        return out

    def twins(self) -> dict[int, tuple[int, int, bool]]:
        """The base moments that are the shallowest layer's own instance of a block's, right
        before or right after where its copies go: each, with its (block, event, after)."""
        out = {}
        for k, (p, x) in enumerate(self.blocks):
            n = len(x)
            if p >= n and self.base[p - n : p] == x:
                out |= {p - n + e: (k, e, False) for e in range(n)}
            elif self.base[p : p + n] == x:
                out |= {p + e: (k, e, True) for e in range(n)}
        return out

    def slid(self, step: int) -> Pattern:
        """The same pattern with each block slid as far as it goes towards the start (``step``
        -1) or the end (+1): X inserted before base[p] is X turned by one before base[p - 1] where
        base[p - 1] is X's last moment, and the same every number of copies. Which of the moments
        alike is the layer's own and which the base's changes what the frees name, not the
        timeline."""
        blocks = []
        for k, (p, x) in enumerate(self.blocks):
            low = self.blocks[k - 1][0] if k else 0
            high = self.blocks[k + 1][0] if k + 1 < len(self.blocks) else len(self.base)
            while step < 0 and p > low and self.base[p - 1] == x[-1]:
                p, x = p - 1, [self.base[p - 1], *x[:-1]]
            while step > 0 and p < high and self.base[p] == x[0]:
                p, x = p + 1, [*x[1:], self.base[p]]
            blocks.append((p, x))
        return Pattern(self.base, blocks)

    def moment(self, origin: Origin) -> Moment:
        if origin[0] == "base":
            return self.base[origin[1]]
        return self.blocks[origin[1]][1][origin[3]]


def pattern(shallow: list[Moment], deeper: list[Moment], deepest: list[Moment]) -> Pattern | None:
    """The blocks a layer inserts, where the step a layer deeper is the shallow one with them
    inserted and the step two layers deeper the same with them inserted twice; else None.

    Phase by phase: a shortest edit (difflib's) across phases may cut a layer's block where another
    phase's moments look the same, and one that does not repeat is tried again from the end."""
    phases = [_phases(line) for line in (shallow, deeper, deepest)]
    if len({len(p) for p in phases}) > 1 or any(
        a[:1] != b[:1] or a[:1] != c[:1] for a, b, c in zip(*phases)
    ):
        return None
    blocks, at = [], 0
    for a, b, c in zip(*phases):
        found = _inserted(a, b, c) or _inserted(a[::-1], b[::-1], c[::-1], backwards=True)
        if found is None:
            return None
        blocks += [(at + p, x) for p, x in found]
        at += len(a)
    return Pattern(shallow, blocks)


def _phases(line: list[Moment]) -> list[list[Moment]]:
    """The timeline cut where each phase begins."""
    out: list[list[Moment]] = [[]]
    for m in line:
        if m.kind == PHASE:
            out.append([])
        out[-1].append(m)
    return out


def _inserted(
    a: list[Moment], b: list[Moment], c: list[Moment], backwards: bool = False
) -> list[tuple[int, list[Moment]]] | None:
    """``b`` as ``a`` with blocks inserted, where ``c`` is ``a`` with each inserted twice; read
    ``backwards``, the blocks are turned round and placed from the start."""
    blocks = _insertions(a, b)
    if blocks is None:
        return None
    found = Pattern(a, blocks)
    if [found.moment(o) for o in found.origins(2)] != c:
        blocks = _pieces(a, blocks, c)
        if blocks is None:
            return None
    if backwards:
        return [(len(a) - p, x[::-1]) for p, x in reversed(blocks)]
    return blocks


def _insertions(a: list[Moment], b: list[Moment]) -> list[tuple[int, list[Moment]]] | None:
    """``b`` as ``a`` with blocks inserted (each before which of ``a``'s moments), by a shortest
    edit (difflib's) of what lies between their common start and end: a diff's time grows with
    the product of its lengths, and a phase a layer deeper is most often the same but for one
    block; None where ``b`` is not ``a`` with blocks inserted."""
    head = 0
    while head < len(a) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < len(a) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    middle = a[head : len(a) - tail]
    ops = SequenceMatcher(None, middle, b[head : len(b) - tail], autojunk=False).get_opcodes()
    if any(tag not in ("equal", "insert") for tag, *_ in ops):
        return None
    return [(head + i1, b[head + j1 : head + j2]) for tag, i1, _, j1, j2 in ops if tag == "insert"]


def _pieces(
    a: list[Moment], blocks: list[tuple[int, list[Moment]]], c: list[Moment]
) -> list[tuple[int, list[Moment]]] | None:
    """The blocks cut where ``c`` (``a`` with two copies of each) shows them doubled piece by piece:
    a diff may take two places' blocks that meet (one operator's share of a layer, the next
    one's) for one block. None where ``c`` is not ``a`` with each block's pieces doubled."""
    out, t, done = [], 0, 0
    for p, x in blocks:
        if c[t : t + p - done] != a[done:p]:
            return None
        t, done = t + p - done, p
        while x:
            n = next((n for n in (len(x), *range(1, len(x))) if _doubled(c, t, x[:n])), 0)
            if not n:
                return None
            out.append((p, x[:n]))
            t, x = t + 2 * n, x[n:]
    return out if c[t:] == a[done:] else None


def _doubled(c: list[Moment], t: int, piece: list[Moment]) -> bool:
    n = len(piece)
    return c[t : t + n] == piece and c[t + n : t + 2 * n] == piece


# A rule naming the storage a repeated moment refers to: (family, block, event, shift, where it
# falls outside the copies: the base moment for each such place)
Rule = tuple
FAMILIES = ("same", "mirror", "first", "last")  # a copy relative to its own, or to the ends


def _copy(family: str, shift: int, r: int, copies: int) -> int:
    base = {"same": r, "mirror": copies + 1 - r, "first": 1, "last": copies}[family]
    return base + shift


def _outside(copy: int, copies: int) -> tuple[str, int]:
    """A copy's place outside 1..copies: how far before the first, or after the last."""
    if copy < 1:
        return ("before", 1 - copy)
    return ("after", copy - copies)


def _target(rule: Rule, r: int, copies: int) -> Origin | None:
    family, k, e, shift, outside = rule
    if family == "base":
        return ("base", e)
    copy = _copy(family, shift, r, copies)
    if 1 <= copy <= copies:
        return ("copy", k, copy, e)
    j = dict(outside).get(_outside(copy, copies))
    return None if j is None else ("base", j)


def _rule(family: str, k: int, e: int, shift: int, seen: list) -> Rule | None:
    """The rule of this family and shift, where every sample obeys it: a target outside the copies
    is the base moment each sample there names, one per place."""
    outside: dict[tuple[str, int], int] = {}
    for r, copies, to in seen:
        copy = _copy(family, shift, r, copies)
        if 1 <= copy <= copies:
            if to != ("copy", k, copy, e):
                return None
        elif to[0] != "base" or outside.setdefault(_outside(copy, copies), to[1]) != to[1]:
            return None
    return (family, k, e, shift, tuple(sorted(outside.items())))


def rules(
    samples: list[tuple[Origin, Origin, int]],
    twins: dict[int, tuple[int, int, bool]] | None = None,
) -> dict[tuple, Rule] | None:
    """For each kind of moment (a base one, or block k's event e), the one rule every sample obeys:
    ``samples`` are (the moment, what it refers to, the copies in its timeline); ``twins``, the base
    moments that are the shallowest layer's own instance of a block's (``Pattern.twins``), which a
    rule may name as the copy before the first or after the last. None where a kind has no such
    rule."""
    found = _ruled(samples, twins or {})
    return None if None in found.values() else found


def _ruled(
    samples: list[tuple[Origin, Origin, int]], twins: dict[int, tuple[int, int, bool]]
) -> dict[tuple, Rule | None]:
    """Each kind of moment's rule, None for a kind that has none (``rules``)."""
    by_slot: dict[tuple, list[tuple[int, int, Origin]]] = {}
    for at, to, copies in samples:
        slot, r = _slot(at)
        by_slot.setdefault(slot, []).append((r, copies, to))
    found: dict[tuple, Rule | None] = {}
    for slot, seen in by_slot.items():
        if len({to for *_, to in seen}) == 1 and seen[0][2][0] == "base":
            found[slot] = ("base", None, seen[0][2][1], 0, ())
            continue
        found[slot] = next(
            (
                rule
                for r, copies, (k, copy, e) in _as_copies(seen, twins)
                for family in FAMILIES
                if r or family in ("first", "last")
                if (rule := _rule(family, k, e, copy - _copy(family, 0, r, copies), seen))
                is not None
            ),
            None,
        )
    return found


def _as_copies(
    seen: list[tuple[int, int, Origin]], twins: dict[int, tuple[int, int, bool]]
) -> list[tuple[int, int, tuple[int, int, int]]]:
    """Each sample's target as (block, copy, event): a base twin is the copy before the first (0)
    or after the last."""
    out = []
    for r, copies, to in seen:
        if to[0] == "copy":
            out.append((r, copies, (to[1], to[2], to[3])))
        elif (twin := twins.get(to[1])) is not None:
            k, e, after = twin
            out.append((r, copies, (k, copies + 1 if after else 0, e)))
    return out


def samples(
    pattern: Pattern, copies: int, moments: list[Moment], sets: frozenset[tuple] = frozenset()
) -> list[tuple[Origin, Origin, int]]:
    """Each free of a traced timeline, as (where it is, where what it frees was made, copies).

    A run of frees alike (the same bytes, raw and rounded, and label, nothing between them) with a
    kind of moment in ``sets`` is paired with what it frees as a set, each in the order of
    ``_place``, not as they came. The timeline is the same either way, and the allocator's state
    after the run too (a free block merges with its free neighbours whatever their order); but a
    list of storages alike freed at once (the norms clip_grad_norm_ keeps, one per gradient, freed
    last to first) is a run whose every place a diff may take for a layer's, and the order in which
    they came ties its frees to the wrong layers."""
    origins = pattern.origins(copies)
    made = {m.index: o for m, o in zip(moments, origins) if m.kind == MADE}
    out: list[tuple[Origin, Origin, int]] = []
    run: list[tuple[Origin, Origin]] = []
    last = None
    for m, o in zip(moments, origins):
        if run and not (m.kind == FREED and m == last and m.raw == last.raw):
            out += _paired(run, copies, sets)
            run = []
        if m.kind == FREED:
            run.append((o, made[m.index]))
        last = m
    return out + _paired(run, copies, sets)


def _paired(
    run: list[tuple[Origin, Origin]], copies: int, sets: frozenset[tuple]
) -> list[tuple[Origin, Origin, int]]:
    if not any(_slot(at)[0] in sets for at, _ in run):
        return [(at, to, copies) for at, to in run]
    places = sorted((at for at, _ in run), key=_place)
    return [(at, to, copies) for at, to in zip(places, sorted((to for _, to in run), key=_place))]


def _place(origin: Origin) -> tuple:
    """The base's moments first, in order, then copy by copy each block's."""
    return (0, origin[1]) if origin[0] == "base" else (1, origin[2], origin[1], origin[3])


def unfold(pattern: Pattern, frees: dict[tuple, Rule], copies: int) -> list[Moment] | None:
    """The timeline with ``copies`` copies of each block, each free naming the index of the MADE it
    frees; None where a rule names a storage not alive there."""
    out, made, alive = [], {}, set()
    for origin in pattern.origins(copies):
        m = pattern.moment(origin)
        if m.kind == MADE:
            made[origin] = len(out)
            alive.add(len(out))
            out.append(m.indexed(len(made) - 1))
            continue
        if m.kind == FREED:
            slot, r = _slot(origin)
            index = made.get(_target(frees[slot], r, copies))
            if index not in alive:
                return None
            alive.discard(index)
            m = m.indexed(out[index].index)
        out.append(m)
    return out


def _slot(origin: Origin) -> tuple[tuple, int]:
    if origin[0] == "base":
        return origin, 0
    return ("copy", origin[1], origin[3]), origin[2]


@dataclass(frozen=True)
class Shallow:
    """A shallow step as traced: its prediction (the replay aside), the tracker of the measured
    step and, where the allocator is replayed, the tracker of the step before it."""

    prediction: Prediction
    tracker: LiveBytes
    history: LiveBytes | None
    # its last micro-batch (or decode forward) repeated this many times more once folded
    # (fake._folded; the prediction's figures count them already), growing as it repeats where
    # ``growing`` (LiveBytes.repeat)
    repeats: int = 0
    growing: bool = False


# Figures read off the folded timeline (the peak, where it fell, what was alive at it), or left to
# the replay: every other figure is a sum over layers, the line through the shallow steps'.
READ_OFF = {
    "peak_tensor_bytes",
    "peak_phase",
    "peak_prefill_bytes",
    "peak_decode_bytes",
    *(f.name for f in fields(Prediction) if f.name.startswith("at_peak_")),
}


@dataclass(frozen=True)
class Learnt:
    """How a timeline grows a layer at a time: the blocks a layer inserts, and the rule each free
    follows."""

    pattern: Pattern
    frees: dict[tuple, Rule]
    # the kinds of moment whose runs of frees alike are read as sets (``samples``)
    sets: frozenset[tuple] = frozenset()
    # the base's storages that grow with the layers, and by how many bytes a layer (``_growth``)
    growth: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Template:
    """A fold as proven at the three depths at one size, for the same step at another (a search's
    next batch or prompt): the measured step's and the step before's patterns and rules, the rule of
    each storage the step before hands on, the figures that were the same at every depth, and
    whether its frees were read in order."""

    ordered: bool
    measured: Learnt
    history: Learnt | None
    handing: tuple[dict[tuple, Rule], dict[tuple, bool]] | None
    constant: frozenset[str]


def fold(
    shallow: list[Shallow], layers: int, generating: bool, ordered_first: bool = False
) -> tuple[Prediction, LiveBytes, Template] | str:
    """The step at ``layers`` layers from the steps at DEPTHS: its prediction (the replay aside),
    its tracker (following the step before's, where there is one) and the fold as proven, for the
    same step at another size (``refold``); or why it cannot be folded. The timelines are read as
    they came, then with each run of frees in the order its storages were made (a cache cleared at
    once frees in its own order, no layer's); ``ordered_first``, the other way round."""
    found: tuple[Prediction, LiveBytes, Template] | str = ""
    for ordered in (ordered_first, not ordered_first):
        found = _fold(shallow, layers, generating, ordered)
        if not isinstance(found, str):
            return found
    return found


def refold(
    template: Template, shallow: list[Shallow], layers: int, generating: bool
) -> tuple[Prediction, LiveBytes, Template] | str:
    """The step at ``layers`` layers from its steps at the first two DEPTHS alone, where they are
    the template's steps but for their bytes: each of their phases the shallowest step with the
    template's blocks inserted at the template's places, every free following the template's rule,
    every storage handed on as the template's were, each figure the template had the same at every
    depth the same at both. The step three layers deep, traced, would prove nothing more than it
    proved at the template's size; where the two steps differ in anything but bytes, why."""
    return _fold(shallow, layers, generating, template.ordered, template)


def _fold(
    shallow: list[Shallow],
    layers: int,
    generating: bool,
    ordered: bool,
    template: Template | None = None,
) -> tuple[Prediction, LiveBytes, Template] | str:
    copies = layers - DEPTHS[0]
    if template is not None and (template.history is None) != (shallow[0].history is None):
        return "the template's step is replayed otherwise"
    lines = [s.tracker.timeline(s.tracker.ended, ordered) for s in shallow]
    found = _learnt(lines, copies, template and template.measured)
    if isinstance(found, str):
        return found
    measured, unfolded = found
    rounding = shallow[0].tracker.rounding
    timeline = _grown(unfolded, measured.pattern, measured.growth, copies, rounding)
    before = carried = history = handing = None
    if shallow[0].history is not None:
        befores = [s.history.timeline(s.tracker.followed_until, ordered) for s in shallow]
        found = _learnt(befores, copies, template and template.history)
        if isinstance(found, str):
            return "the step before: " + found
        history, unfolded = found
        handing = _handing(
            shallow,
            lines,
            befores,
            measured=measured.pattern,
            history=history.pattern,
            template=template,
        )
        if handing is None:
            return "the storages the step before hands on do not repeat with the layers"
        carried = _carried(measured.pattern, history.pattern, handing, copies)
        history_timeline = _grown(unfolded, history.pattern, history.growth, copies, rounding)
        before = LiveBytes.rebuilt(CPU, history_timeline)
        if not before.repeat(shallow[0].repeats, shallow[0].growing, rounding):
            return "the step before's repeated parts do not repeat at full depth"
    tracker = LiveBytes.rebuilt(CPU, timeline, history=before, carried=carried)
    if not tracker.repeat(shallow[0].repeats, shallow[0].growing, rounding):
        return "its repeated parts do not repeat at full depth"
    predictions = [s.prediction for s in shallow]
    figures = _line(predictions, layers, template and template.constant)
    if isinstance(figures, str):
        return figures
    read = at_peak_memory(tracker, generating).flat()
    prediction = figures | Prediction(**{k: v for k, v in read.items() if k in READ_OFF})
    proven = template or Template(
        ordered,
        measured,
        history=history,
        handing=handing,
        constant=frozenset(_constant(predictions)),
    )
    return prediction, tracker, proven


def _growth(
    pattern: Pattern, lines: list[list[Moment]], growing: frozenset[int] | None = None
) -> dict[int, int]:
    """The storages of the base whose bytes before rounding grow with the layers, each with its
    growth a layer: a stack of one norm per gradient (clip_grad_norm_'s) is below one 512-byte block
    at three layers and over it at thirty. Those that grow by the same bytes at each depth traced;
    with two depths (``refold``), those ``growing`` at the template's three. (A storage whose bytes
    change otherwise is one the diff took for another of its block's size: kept as it is.)"""
    raws = [
        {
            o[1]: m.raw
            for o, m in zip(pattern.origins(d - DEPTHS[0]), line)
            if o[0] == "base" and m.kind == MADE
        }
        for d, line in zip(DEPTHS, lines)
    ]
    out = {}
    for j in raws[0] if growing is None else growing:
        steps = {deeper[j] - shallower[j] for shallower, deeper in zip(raws, raws[1:])}
        if len(steps) == 1 and (step := steps.pop()):
            out[j] = step
    return out


def _grown(
    timeline: list[Moment], pattern: Pattern, growth: dict[int, int], copies: int, rounding: int
) -> list[Moment]:
    """The unfolded ``timeline`` (``unfold``'s at ``copies``, one moment per origin) with each
    storage of ``growth`` grown to full depth, its frees too (``LiveBytes.rebuilt`` reads a
    storage's bytes before rounding at its MADE alone)."""
    if not growth:
        return timeline
    sizes: dict[int, tuple[int, int]] = {}
    out = []
    for origin, m in zip(pattern.origins(copies), timeline):
        if m.kind == MADE and origin[0] == "base" and origin[1] in growth:
            raw = m.raw + copies * growth[origin[1]]
            sizes[m.index] = (math.ceil(raw / rounding) * rounding, raw)
        if m.kind in (MADE, FREED) and m.index in sizes:
            m = m.sized(*sizes[m.index])
        out.append(m)
    return out


def _line(
    shallow: list[Prediction], layers: int, constant: frozenset[str] | None = None
) -> Prediction | str:
    """Each figure but those read off the timeline: the same at every depth, or growing by the same
    bytes (or FLOPs) a layer, continued to ``layers``. With a template's ``constant`` figures (two
    depths, ``refold``): those the same at both, every other growing as it grew there."""
    out = {}
    same = _constant(shallow)
    for f in fields(Prediction):
        if f.name in READ_OFF:
            continue
        values = [getattr(p, f.name) for p in shallow]
        if f.name in same and (constant is None or f.name in constant):
            out[f.name] = values[0]
        elif constant is not None and f.name in constant:
            return f"{f.name} is no longer the same at every depth ({values})"
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in values) and (
            len(values) == 2 or values[1] - values[0] == values[2] - values[1]
        ):
            out[f.name] = values[0] + (layers - DEPTHS[0]) * (values[1] - values[0])
        else:
            return f"{f.name} does not grow by the same amount a layer ({values})"
    return Prediction(**out)


def _constant(shallow: list[Prediction]) -> set[str]:
    """The figures the same at every depth."""
    return {
        f.name for f in fields(Prediction) if len({repr(getattr(p, f.name)) for p in shallow}) == 1
    }


def _handing(
    shallow: list[Shallow],
    lines: list[list[Moment]],
    befores: list[list[Moment]],
    measured: Pattern,
    history: Pattern,
    template: Template | None,
) -> tuple[dict[tuple, Rule], dict[tuple, bool]] | None:
    """Which kinds of storage the step before hands on (``LiveBytes.follow``), and the rule naming
    the one each is; with a ``template``, its own where the shallow steps hand on by them. None
    where they do not repeat with the layers."""
    seen, kinds = _handed(shallow, lines, befores, measured=measured, history=history)
    if kinds is None:
        return None
    if template is not None:
        rules_then, kinds_then = template.handing
        if any(kinds_then.get(k) != v for k, v in kinds.items()) or not _obeys(rules_then, seen):
            return None
        return template.handing
    handing = rules(seen, history.twins())
    if handing is None:
        return None
    return handing, kinds


def _handed(
    shallow: list[Shallow],
    lines: list[list[Moment]],
    befores: list[list[Moment]],
    measured: Pattern,
    history: Pattern,
) -> tuple[list[tuple[Origin, Origin, int]], dict[tuple, bool] | None]:
    """Each storage handed on, as (where the measured step has it, where the step before made it,
    copies); and for each kind of storage whether it is handed on (None where not every one of a
    kind is, or none)."""
    seen: list[tuple[Origin, Origin, int]] = []
    kinds: dict[tuple, bool] = {}
    for d, s, line, before in zip(DEPTHS, shallow, lines, befores):
        n = d - DEPTHS[0]
        made = {m.index: o for m, o in zip(line, measured.origins(n)) if m.kind == MADE}
        made_before = {m.index: o for m, o in zip(before, history.origins(n)) if m.kind == MADE}
        for i, origin in made.items():
            handed = i in s.tracker.carried
            if kinds.setdefault(_slot(origin)[0], handed) != handed:
                return seen, None
            if handed:
                seen.append((origin, made_before[s.tracker.carried[i]], n))
    return seen, kinds


def _carried(
    measured: Pattern,
    history: Pattern,
    handing: tuple[dict[tuple, Rule], dict[tuple, bool]],
    copies: int,
) -> dict[int, int]:
    """The storages the step before hands on at full depth: the measured step's index of each, and
    the step before's."""
    rules_of, kinds = handing
    index_before = _made_indices(history, copies)
    out = {}
    for i, origin in enumerate(
        o for o in measured.origins(copies) if measured.moment(o).kind == MADE
    ):
        slot, r = _slot(origin)
        if kinds[slot]:
            out[i] = index_before[_target(rules_of[slot], r, copies)]
    return out


def _made_indices(pattern: Pattern, copies: int) -> dict[Origin, int]:
    """Each MADE of the unfolded timeline, by origin: its index among the storages."""
    made = [o for o in pattern.origins(copies) if pattern.moment(o).kind == MADE]
    return {o: i for i, o in enumerate(made)}


def _learnt(
    lines: list[list[Moment]], copies: int, template: Learnt | None = None
) -> tuple[Learnt, list[Moment]] | str:
    """How the timelines at DEPTHS grow a layer at a time, and the timeline with ``copies`` copies
    of each block unfolded by it (``unfold``); with a ``template`` (two depths), the same pattern
    and rules, where they follow it but for their bytes. Of the ways the blocks may be placed and
    the frees read, the first whose rules hold at every depth traced and name a storage alive at
    full depth: three samples a kind may fit a rule that names, deeper, a copy not yet made."""
    if template is not None:
        learnt = _following(template, *lines)
        if isinstance(learnt, str):
            return learnt
        unfolded = unfold(learnt.pattern, learnt.frees, copies)
        if unfolded is None:
            return "a layer's free names a storage already freed"
        return learnt, unfolded
    grown = pattern(*lines)
    if grown is None:
        return "a layer more does not add the same storages at the same places"
    why = "what a layer's storages free does not follow one rule"
    for found in (grown, grown.slid(-1), grown.slid(1)):
        if (learnt := _ruling(found, lines)) is None:
            continue
        if (unfolded := unfold(found, learnt.frees, copies)) is not None:
            return replace(learnt, growth=_growth(found, lines)), unfolded
        why = "a layer's free names a storage already freed"
    return why


def _ruling(found: Pattern, lines: list[list[Moment]]) -> Learnt | None:
    """The rule of each free of the timelines at DEPTHS as ``found`` places them: read as they came,
    then with each run of frees alike where a kind of moment has no rule read as a set, until every
    kind has one or the runs read so change nothing."""
    sets: frozenset[tuple] = frozenset()
    while True:
        seen = [
            x for d, line in zip(DEPTHS, lines) for x in samples(found, d - DEPTHS[0], line, sets)
        ]
        frees = _ruled(seen, found.twins())
        failed = {slot for slot, rule in frees.items() if rule is None}
        if not failed:
            return Learnt(found, frees, sets)
        if failed <= sets:
            return None
        sets |= failed


def _following(template: Learnt, shallow: list[Moment], deeper: list[Moment]) -> Learnt | str:
    """The template's pattern with the bytes of ``shallow`` and ``deeper`` (a layer deeper), where
    ``deeper`` is ``shallow`` with the template's blocks inserted at its places, each moment of the
    kind and label the template has there, and every free of both follows the template's rule."""
    base, why = template.pattern.base, "its steps at 1 and 2 layers differ from the template's"
    origins = template.pattern.origins(1)
    if len(shallow) != len(base) or len(deeper) != len(origins):
        return why
    if any((m.kind, m.label) != (t.kind, t.label) for m, t in zip(shallow, base)):
        return why
    blocks: list[list[Moment]] = [[] for _ in template.pattern.blocks]
    for origin, m in zip(origins, deeper):
        if origin[0] == "base":
            if shallow[origin[1]] != m:
                return why
            continue
        was = template.pattern.moment(origin)
        if (m.kind, m.label) != (was.kind, was.label):
            return why
        blocks[origin[1]].append(m)
    found = Pattern(shallow, [(p, x) for (p, _), x in zip(template.pattern.blocks, blocks)])
    seen = samples(found, 0, shallow, template.sets) + samples(found, 1, deeper, template.sets)
    if not _obeys(template.frees, seen):
        return "what a layer's storages free no longer follows the template's rules"
    growth = _growth(found, [shallow, deeper], frozenset(template.growth))
    return Learnt(found, template.frees, template.sets, growth)


def _obeys(frees: dict[tuple, Rule], seen: list[tuple[Origin, Origin, int]]) -> bool:
    for at, to, copies in seen:
        slot, r = _slot(at)
        if slot not in frees or _target(frees[slot], r, copies) != to:
            return False
    return True
