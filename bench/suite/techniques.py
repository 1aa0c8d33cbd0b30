"""A run's technique list: names resolved, options type-checked, combinations and batch sizes
checked."""

from __future__ import annotations

import math
import typing
from dataclasses import fields
from typing import Any, Literal

from bench.spec import DEVICES, MODES, Fidelity, Shapes, TechniqueSpec
from bench.techniques import Technique, build, resolve


def techniques(
    raw: Any,
    where: str,
    batch: dict[str, int] | None,
    shapes: dict[str, Shapes] | None,
    mode: str,
    problems: list[str],
) -> tuple[TechniqueSpec, ...] | None:
    if not isinstance(raw, list):
        problems.append(
            f"{where}: expected a list of names or {{ name = ..., option = ... }} tables"
        )
        return None
    specs = [
        s
        for i, item in enumerate(raw)
        if (s := _technique(item, f"{where}[{i}]", problems)) is not None
    ]
    before = len(problems)
    check(tuple(specs), where, batch=batch, shapes=shapes, mode=mode, problems=problems)
    ok = len(specs) == len(raw) and len(problems) == before
    if ok:
        return tuple(specs)
    return None


def check(
    specs: tuple[TechniqueSpec, ...],
    where: str,
    batch: dict[str, int] | None,
    shapes: dict[str, Shapes] | None,
    mode: str,
    problems: list[str],
) -> None:
    """Resolved techniques as a run: each in a mode it works in, the combination, each at the batch
    sizes."""
    built = [build(s) for s in specs]
    for spec, technique in zip(specs, built):
        if mode in MODES and mode not in technique.modes:
            problems.append(
                f"{where}: {spec.name} does not apply to {mode} suites; it works in: "
                f"{', '.join(sorted(technique.modes))}"
            )
    _check_combination(where, built, problems)
    for spec, technique in zip(specs, built):
        for dev in DEVICES:
            if shapes is not None and dev in shapes:
                if batch:
                    size = batch[dev]
                else:
                    size = shapes[dev].batch_size
                for p in _own_problems(technique, spec.name, size):
                    problems.append(f"{where}: {spec.name} at {dev} batch_size {size}: {p}")


def check_fidelity_batch(
    specs: tuple[TechniqueSpec, ...],
    fidelity: dict[str, Fidelity | None],
    where: str,
    problems: list[str],
) -> None:
    """The techniques at the fidelity phase's batch size (accumulation must divide it, too)."""
    for dev, fid in fidelity.items():
        for spec in specs if fid is not None else ():
            for p in _own_problems(build(spec), spec.name, fid.batch_size):
                problems.append(
                    f"{where}: {spec.name} at fidelity.{dev} batch_size {fid.batch_size}: {p}"
                )


def _own_problems(technique: Technique, name: str, batch_size: int) -> list[str]:
    """The technique's own checks; one that raises is a problem of that technique, not a crash of
    the loader."""
    try:
        return technique.problems(batch_size)
    except Exception as exc:  # noqa: BLE001  a user's technique may hold any bug
        return [f"its problems() raised {type(exc).__name__}: {exc}; fix {name}'s problems()"]


def _technique(item: Any, where: str, problems: list[str]) -> TechniqueSpec | None:
    options: dict[str, Any] = {}
    if isinstance(item, dict):
        options = {k: v for k, v in item.items() if k != "name"}
        item = item.get("name")
    if not isinstance(item, str):
        problems.append(f"{where}: expected a technique name or a table with name = ...")
        return None
    try:
        cls = resolve(item)
    except KeyError as exc:
        problems.append(f"{where}: {exc.args[0]}")
        return None
    return _check_options(cls, item, options, where, problems)


def _check_options(
    cls: type[Technique], name: str, options: dict[str, Any], where: str, problems: list[str]
) -> TechniqueSpec | None:
    hints = typing.get_type_hints(cls.Config)
    allowed = [f.name for f in fields(cls.Config)]
    before = len(problems)
    for key, value in options.items():
        if key not in allowed:
            problems.append(
                f"{where}.{key}: unknown option of {name}; allowed: {', '.join(allowed) or 'none'}"
            )
        elif (why := _type_error(hints[key], value)) is not None:
            problems.append(f"{where}.{key}: {why}")
    if len(problems) > before:
        return None
    return TechniqueSpec(name, tuple(sorted(options.items())))


def _type_error(hint: Any, value: Any) -> str | None:
    if type(None) in typing.get_args(hint):  # an optional option: its value has the other type
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        if value in choices:
            return None
        return f"must be one of {', '.join(map(repr, choices))}, got {value!r}"
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if math.isfinite(value):
            return None
        return f"must be a finite number, got {value}"
    if isinstance(value, hint) and not (hint is not bool and isinstance(value, bool)):
        return None
    return f"expected {hint.__name__}, got {type(value).__name__} {value!r}"


def _check_combination(where: str, built: list[Technique], problems: list[str]) -> None:
    names = [t.name or type(t).__qualname__ for t in built]
    for n in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{where}: technique {n!r} is listed twice")
    for i, a in enumerate(built):
        for j, b in enumerate(built[i + 1 :], i + 1):
            if b.name in a.conflicts or a.name in b.conflicts:
                problems.append(f"{where}: {a.name} and {b.name} cannot be combined; remove one")
            elif why := a.conflict(b) or b.conflict(a):
                problems.append(f"{where}: {a.name} and {b.name} cannot be combined: {why}")
            elif a.makes_optimizer and b.makes_optimizer:  # the step takes the first one's alone
                problems.append(
                    f"{where}: {names[i]} and {names[j]} cannot be combined: each makes the run's "
                    "optimizer; remove one"
                )
            elif why := b.follows(a):
                problems.append(f"{where}: {b.name} after {a.name}: {why}")
