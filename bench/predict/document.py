"""A suite's predictions as one JSON document (``bench predict --json``): every figure the Markdown
table is rendered from, each run's answers and verdict on a card, the assumptions and how the
document was made, for a notebook, another tool or a CI job to read. ``schema()`` says what it
holds (docs/predictions.schema.json is written from it); ``VERSION`` changes when a key changes
meaning or goes."""

from __future__ import annotations

import datetime
import json
import math
import platform
import types
import typing
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.predict.cards import Card
from bench.predict.table import Row
from bench.record import KEY, Prediction

if TYPE_CHECKING:
    import pandas as pd

KIND = "memsave-bench/predictions"
VERSION = 1
PROVENANCE_SCHEMA = {
    "type": "object",
    "required": [KEY.git_revision, KEY.torch_version, KEY.python_version, "made"],
    "additionalProperties": False,
    "properties": {
        k: {"type": "string"}
        for k in (KEY.git_revision, KEY.torch_version, KEY.python_version, "made")
    },
}
# what each Python type of a figure is in JSON
JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}


def document(
    table: pd.DataFrame,
    suite: str,
    card: Card | None,
    budget: int | None,
    assumptions: str,
    revision: str,
) -> dict[str, Any]:
    """The table as a document: one object per run, holding only what was predicted or asked."""
    runs = [
        {k: _plain(v) for k, v in row.items() if not _missing(v)}
        for row in table.to_dict("records")
    ]
    return {
        "kind": KIND,
        "version": VERSION,
        KEY.suite: suite,
        "card": None if card is None else _card(card),
        "budget_bytes": budget,
        "assumptions": assumptions,
        "provenance": provenance(revision),
        "runs": runs,
    }


def provenance(revision: str) -> dict[str, str]:
    """How a document was made: the code's revision, torch's and Python's versions, and when."""
    import torch

    return {
        KEY.git_revision: revision,
        KEY.torch_version: torch.__version__,
        KEY.python_version: platform.python_version(),
        "made": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def figures(prediction: Prediction) -> dict[str, Any]:
    """A prediction's figures by their own names, those not predicted left out."""
    return {
        f.name: _plain(v)
        for f in fields(prediction)
        if (v := getattr(prediction, f.name)) is not None
    }


def figures_schema() -> dict[str, Any]:
    """What ``figures`` holds: each of the prediction's figures, typed."""
    props = {f.name: _typed(hint) for f, hint in _hints(Prediction)}
    return {"type": "object", "additionalProperties": False, "properties": props}


def schema() -> dict[str, Any]:
    """The document's JSON Schema (draft 2020-12): a run's keys are the prediction's figures by
    their own names (a record's ``predicted_*`` without the prefix), the answers a card or budget
    asked, and the verdict in words."""
    run = {f.name: _typed(hint) for f, hint in _hints(Row) if f.name not in ("prediction", "asked")}
    run |= figures_schema()["properties"]
    run["said_on_card"] = {"type": "string"}
    card = {k: {"type": "integer"} for k in ("memory_bytes", KEY.context_bytes, "capacity_bytes")}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "bench predict --json",
        "type": "object",
        "required": ["kind", "version", KEY.suite, "assumptions", "provenance", "runs"],
        "additionalProperties": False,
        "properties": {
            "kind": {"const": KIND},
            "version": {"const": VERSION},
            KEY.suite: {"type": "string"},
            "card": {
                "type": ["object", "null"],
                "required": ["name", *card],
                "additionalProperties": False,
                "properties": {"name": {"type": "string"}, **card},
            },
            "budget_bytes": {"type": ["integer", "null"]},
            "assumptions": {"type": "string"},
            "provenance": PROVENANCE_SCHEMA,
            "runs": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["run", "batch", "status"],
                    "additionalProperties": False,
                    "properties": run,
                },
            },
        },
    }


def written(path: Path, schema: dict[str, Any]) -> str:
    """A JSON Schema written to ``path`` (make docs); what was written, for the command to say."""
    path.write_text(json.dumps(schema, indent=2) + "\n", encoding="utf-8")
    return str(path)


def _hints(cls: type) -> list[tuple[Any, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in fields(cls)]


def _typed(hint: Any) -> dict[str, Any]:
    """A figure's JSON type: its Python type's (an enum's values are strings), null allowed where
    it may be None."""
    kinds, out = [], {}
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    for t in typing.get_args(hint) if union else (hint,):
        if t is type(None):
            kinds.append("null")
        elif typing.get_origin(t) is tuple:  # of points, each an object (a curve of lengths)
            kinds.append("array")
            point = typing.get_args(t)[0]
            props = {f.name: _typed(h) for f, h in _hints(point)}
            out["items"] = {"type": "object", "additionalProperties": False, "properties": props}
        else:
            kinds.append(JSON_TYPES.get(t, "string"))
    return {"type": kinds[0] if len(kinds) == 1 else kinds} | out


def _card(card: Card) -> dict[str, Any]:
    return {
        "name": card.name,
        "memory_bytes": card.memory,
        KEY.context_bytes: card.context,
        "capacity_bytes": card.capacity,
    }


def _missing(value: Any) -> bool:
    """A cell the run has nothing in (pandas fills a column another run has with NaN)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _plain(value: Any) -> Any:
    """A cell as JSON holds it: numpy's numbers as Python's (a whole float as an int, as pandas
    widens an integer column with gaps), an enum as its value."""
    if isinstance(value, tuple):  # of points
        return [asdict(p) for p in value]
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return getattr(value, "value", value)
