"""The search for the cheapest plans that fit a budget, predicting as few plans as it can.

1. Each option is predicted alone: its peak, and so its place in its axis's order of savings, and
   its cost.
2. An option another choice on its axis beats on peak, cost and known accuracy alike is dropped
   (dominance).
3. The combinations of what is left are walked cheapest first, by estimated cost, and predicted a
   few at a time (in parallel processes); the first ``want`` that fit are the answer, as every
   cheaper plan was tried.
4. A plan that saves no more than one found not to fit, on every axis, is skipped unpredicted
   (monotonicity: the option that saves more alone is taken to save more beside the others), as is
   one whose peak, guessed from its options' own, is well over the budget (``_short``)."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from bench.advise.estimate import Accuracy, Estimate, Estimator
from bench.advise.plans import Axis, Option, Plan, combinations, problems
from bench.advise.predictions import Predictions
from bench.record import Prediction
from bench.spec import RunSpec

# a plan whose guessed peak is over the budget by more than this share is not predicted
GUESS_MARGIN = 1.0


@dataclass(kw_only=True)
class Candidate:
    plan: Plan
    predicted: Prediction
    speed: Estimate
    accuracy: Accuracy
    largest_batch: int | None = None

    @property
    def peak(self) -> int:
        return self.predicted.peak_tensor_bytes


@dataclass(kw_only=True)
class Search:
    """What was tried and why the rest was not: the counts advice reports under its table."""

    combinations: int = 0
    cannot_combine: int = 0
    over_tolerance: int = 0
    skipped: int = 0  # implied not to fit by a plan that saves more and did not
    covering: int = 0  # a plan that fits, and more techniques or micro-batches at no lower cost
    dominated: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # options that cannot run alone here, with why
    fits: list[Candidate] = field(default_factory=list)
    misses: list[Candidate] = field(default_factory=list)


def rank(c: Candidate, tolerance_pt: float | None) -> tuple:
    """A plan's place among those that fit: a known accuracy loss last, then one that fits its card
    only after pausing to free the allocator's cache, then by estimated speed, fewer techniques,
    fewer micro-batches."""
    return (
        c.accuracy.demoted(tolerance_pt),
        bool(c.predicted.flushes),
        c.speed.rank,
        len(c.plan.options),
        _micro(c.plan),
    )


class Searcher:
    def __init__(
        self,
        template: RunSpec,
        base: Plan,
        found: list[Axis],
        predictions: Predictions,
        estimator: Callable[[dict[str, Any], dict[str, dict[str, Any]]], Estimator],
        log: TextIO | None = None,
        unfit: Callable[[Option], list[str]] = lambda option: [],
    ):
        self.template = template
        self.base = base
        self.axes = found
        self.predictions = predictions
        self.log = log or sys.stderr  # as it is now, not at import
        # unfit: why an option is no plan for this device
        self.make_estimator = estimator
        self.unfit = unfit
        self.search = Search()
        self.alone: dict[str, Prediction] = {}
        self.order: dict[str, int] = {}  # an option's peak alone: lower saves more
        self.baseline = Prediction()
        self.baseline_peak = 0

    def singles(self) -> tuple[Prediction, Estimator]:
        """The baseline's prediction and each option's alone; options that cannot run are
        dropped."""
        options = [o for a in self.axes for o in a.options if o not in self.base.options]
        plans = [self._alone(o) for o in options]
        runnable = [
            (o, p)
            for o, p in zip(options, plans)
            if not self._refused(o, problems(p, self.template) or self.unfit(o))
        ]
        print(
            f"advise: predicting the baseline and {len(runnable)} options alone",
            file=self.log,
            flush=True,
        )
        made = self.predictions.peaks(
            [self.base.spec(self.template)] + [p.spec(self.template) for _, p in runnable]
        )
        baseline, rest = made[0], made[1:]
        if not baseline.ok:
            raise RuntimeError(f"the baseline cannot be predicted: {baseline.message}")
        for (option, _), out in zip(runnable, rest):
            if out.ok:
                why = []
            else:
                why = [out.message or ""]
            if not self._refused(option, why):
                self.alone[option.name] = out
        for o in self.base.options:
            self.alone[o.name] = baseline
        self.order = {name: out.peak_tensor_bytes for name, out in self.alone.items()}
        self.baseline, self.baseline_peak = baseline, baseline.peak_tensor_bytes
        return baseline, self.make_estimator(baseline, self.alone)

    def _alone(self, option: Option) -> Plan:
        kept = [
            o for o in self.base.options if _axis_of(self.axes, o) != _axis_of(self.axes, option)
        ]
        return Plan((*kept, option))

    def _refused(self, option: Option, why: list[str]) -> bool:
        if why:
            self.search.dropped.append(f"{option.name}: {why[0]}")
        return bool(why)

    def pruned_axes(self, estimator: Estimator) -> list[Axis]:
        """Each axis less its unrunnable and dominated options."""
        kept = []
        for axis in self.axes:
            options = [o for o in axis.options if o.name in self.alone]
            survivors = [o for o in options if not self._dominated(o, options, axis, estimator)]
            kept.append(replace(axis, options=tuple(survivors)))
        return kept

    def _dominated(
        self, option: Option, options: list[Option], axis: Axis, estimator: Estimator
    ) -> bool:
        """Whether another choice on the axis (none included, where the axis allows it) peaks no
        higher, costs no more and is known to lose no more accuracy."""

        def score(o: Option | None) -> tuple[int, float, float]:
            if o is None:
                return self.baseline_peak, 1.0, 0.0
            loss = estimator.accuracy(Plan((o,))).delta
            return self.order[o.name], estimator.factor(o).factor, -(loss or 0.0)

        # more micro-batches cost smaller, less efficient kernels, which only their
        if axis.name == "accumulation":
            # operators count: each factor stays, and the walk takes the fewest that fit (_covers)
            return False
        mine = score(option)
        rivals = [o for o in ((None,) if not axis.required else ()) + tuple(options) if o != option]
        for rival in rivals:
            theirs = score(rival)
            if all(t <= m for t, m in zip(theirs, mine)) and (
                theirs != mine or _before(rival, option, options)
            ):
                self.search.dominated.append(
                    f"{option.name} (by {rival.name if rival else 'none'})"
                )
                return True
        return False

    def walk(
        self,
        found: list[Axis],
        estimator: Estimator,
        budget: int,
        want: int,
        tolerance_pt: float | None,
        limit: int,
        chunk: int,
        minimal: bool = True,
    ) -> Search:
        """The combinations, cheapest first, predicted ``chunk`` at a time until ``want`` fit or
        ``limit`` predictions were made. ``minimal``: a plan holding one that fits is not one (what
        it adds costs, and the estimate may not see it: the launches of more micro-batches)."""
        queue = []
        for plan in combinations(found):
            self.search.combinations += 1
            if problems(plan, self.template):
                self.search.cannot_combine += 1
                continue
            accuracy = estimator.accuracy(plan)
            if (
                tolerance_pt is not None
                and accuracy.points is not None
                and accuracy.points < -tolerance_pt
            ):
                self.search.over_tolerance += 1
                continue
            queue.append((estimator.speed(plan), accuracy, plan))
        queue.sort(
            key=lambda q: (q[1].demoted(tolerance_pt), q[0].rank, len(q[2].options), _micro(q[2]))
        )
        predicted = 0
        while queue and len(self.search.fits) < want and predicted < limit:
            batch = []
            while queue and len(batch) < chunk:
                speed, accuracy, plan = queue.pop(0)
                if minimal and any(_covers(plan, speed, c) for c in self.search.fits):
                    self.search.covering += 1
                elif self._cannot_fit(plan) or self._short(plan, budget):
                    self.search.skipped += 1
                else:
                    batch.append((speed, accuracy, plan))
            outs = self.predictions.peaks([p.spec(self.template) for _, _, p in batch])
            predicted += len(batch)
            for (speed, accuracy, plan), out in zip(batch, outs):
                if out.ok:
                    if out.fits(budget):
                        found_in = self.search.fits
                    else:
                        found_in = self.search.misses
                    found_in.append(
                        Candidate(plan=plan, predicted=out, speed=speed, accuracy=accuracy)
                    )
            if minimal:  # a plan found in this chunk may cover one found beside it
                held = [
                    c
                    for c in self.search.fits
                    if any(_covers(c.plan, c.speed, o) for o in self.search.fits)
                ]
                self.search.covering += len(held)
                self.search.fits = [c for c in self.search.fits if c not in held]
            print(
                f"advise: {predicted} plans predicted, {len(self.search.fits)} fit",
                file=self.log,
                flush=True,
            )
        self.search.fits.sort(key=lambda c: rank(c, tolerance_pt))
        return self.search

    def _cannot_fit(self, plan: Plan) -> bool:
        """Whether a plan found not to fit saves at least as much as this one on every axis."""
        mine = self._savings(plan)
        return any(
            all(mine[a.name] >= theirs[a.name] for a in self.axes)
            for theirs in map(self._savings, (c.plan for c in self.search.misses))
        )

    def _short(self, plan: Plan, budget: int) -> bool:
        """Whether the plan's peak, guessed from its options' own, stays over the budget by more
        than the guess's margin. Each option alone scales each part of the peak (parameters,
        gradients, optimizer state, activations, temporaries); the guess multiplies the scales of
        each part, as bf16's halving of the activations and checkpointing's dropping of most of them
        compose."""
        guess = 0.0
        for part, base in self.baseline.at_peak().items():
            scale = 1.0
            for o in plan.options:
                scale *= self.alone[o.name].at_peak().get(part, 0) / base
            guess += base * scale
        return guess > GUESS_MARGIN * budget

    def _savings(self, plan: Plan) -> dict[str, int]:
        """Each axis's option's peak alone (the baseline's where the plan takes none)."""
        chosen = {_axis_of(self.axes, o): o.name for o in plan.options}
        return {
            a.name: self.order[chosen[a.name]] if a.name in chosen else self.baseline_peak
            for a in self.axes
        }

    def strongest(self, found: list[Axis]) -> Plan | None:
        """The combination of each axis's most saving option, as far as they combine (dropping, from
        the axis whose option saves least, until they do)."""
        chosen = [min(a.options, key=lambda o: self.order[o.name]) for a in found if a.options]
        while chosen:
            plan = Plan(tuple(chosen))
            if not problems(plan, self.template):
                return plan
            chosen.remove(max(chosen, key=lambda o: self.order[o.name]))
        return None


def _axis_of(found: list[Axis], option: Option) -> str:
    return next(a.name for a in found if option in a.options)


def _covers(plan: Plan, speed: Estimate, fit: Candidate) -> bool:
    """Whether ``plan`` takes everything a plan that fits takes (as many micro-batches or more), and
    more, at no lower estimated cost: what it adds buys nothing."""
    if plan == fit.plan or fit.speed.rank > speed.rank:
        return False
    mine = {o for o in plan.options if o.multiple == 1}
    theirs = {o for o in fit.plan.options if o.multiple == 1}
    return theirs <= mine and _micro(fit.plan) <= _micro(plan)


def _micro(plan: Plan) -> int:
    return math.prod(o.multiple for o in plan.options)


def _before(a: Option | None, b: Option, options: list[Option]) -> bool:
    """Of two options alike in every figure, the one listed first (none before any) stays."""
    return a is None or options.index(a) < options.index(b)
