"""Reading one value from a TOML table: its type checked, and what is wrong added to the
problems."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench import models
from bench.models import ModelSpec
from bench.spec import DEFAULTS, MAX_TIMEOUT_S


def typed(
    table: dict[str, Any], key: str, kind: type, default: Any, problems: list[str], where: str = ""
) -> Any:
    value = table.get(key, default)
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if value is not None and not ok:
        problems.append(
            f"{where}{key}: expected {kind.__name__}, got {type(value).__name__} {value!r}"
        )
        return default
    return value


def check_ranges(values: dict[str, Any], where: str, problems: list[str]) -> None:
    """Every number a run is made of is finite and, but for the seed, positive (TOML allows nan and
    inf); a time limit at most a week."""
    for k, v in values.items():
        if (
            k in DEFAULTS
            and k != "seed"
            and isinstance(v, (int, float))
            and not (math.isfinite(v) and v > 0)
        ):
            problems.append(f"{where}{k}: must be a finite number > 0, got {v}")
        elif k == "timeout_s" and isinstance(v, (int, float)) and v > MAX_TIMEOUT_S:
            problems.append(f"{where}{k}: at most {MAX_TIMEOUT_S:g} s (a week), got {v:g}")


def model_spec(name: str | None, where: str, problems: list[str]) -> ModelSpec | None:
    """The named model's spec, or None with the reason among the problems (an unknown name, a failed
    import)."""
    try:
        if name is None:
            return None
        return models.resolve(name)
    except KeyError as exc:
        problems.append(f"{where}: {exc.args[0]}")
        return None


def weights(table: dict[str, Any], where: str, problems: list[str]) -> str | None:
    path = typed(table, "weights", kind=str, default=None, problems=problems, where=where)
    if path is not None and not Path(path).exists():
        problems.append(
            f"{where}weights: no file or folder {path!r} (relative paths start where bench runs)"
        )
    return path
