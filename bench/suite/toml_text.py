"""A suite file written from its header and runs (advice's suite, a job's suite from its config
files): TOML that the loader reads back as written."""

from __future__ import annotations

import json
from typing import Any

from bench.suite.schema import RUNS, TOP, Key


def to_toml(
    header: dict[str, Any], runs: list[dict[str, Any]], comments: dict[str, str] | None = None
) -> str:
    """A suite file: the header's keys, its tables, then one [[runs]] entry per run (with its
    comment above), each table's keys in the schema's order."""
    header, runs = _ordered(header, TOP), [_ordered(run, RUNS) for run in runs]
    lines = [f"{k} = {toml_value(v)}" for k, v in header.items() if not isinstance(v, dict)]
    for key, table in header.items():
        if isinstance(table, dict):
            lines += _table(key, table)
    for run in runs:
        lines += [
            "",
            *(f"# {c}" for c in (comments or {}).get(run["name"], "").splitlines()),
            "[[runs]]",
        ]
        lines += [f"{k} = {toml_value(v)}" for k, v in run.items()]
    return "\n".join(lines) + "\n"


def _ordered(table: dict[str, Any], keys: dict[str, Key]) -> dict[str, Any]:
    """The table's keys in the schema's order; a key it does not declare is this code's mistake."""
    if undeclared := table.keys() - keys.keys():
        raise ValueError(f"no suite file declares {', '.join(sorted(undeclared))} there")
    return {k: table[k] for k in keys if k in table}


def _table(name: str, table: dict[str, Any]) -> list[str]:
    own = [f"{k} = {toml_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    # a table of tables only needs no header of its own
    if own:
        lines = ["", f"[{name}]", *own]
    else:
        lines = []
    for key, sub in table.items():
        if isinstance(sub, dict):
            lines += _table(f"{name}.{key}", sub)
    return lines


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        if v:
            return "true"
        return "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(map(toml_value, v)) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"no TOML form for {type(v).__name__}")
