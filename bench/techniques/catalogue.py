"""docs/techniques.md's table, generated from the registry: each technique's options, what it does, what to
expect of it and its place in advice's catalogue, read off its class, so that the page never disagrees with
the code (``bench list --docs docs/techniques.md`` rewrites it; a test holds the page to it)."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

from bench.techniques.base import TECHNIQUES, Technique, options_doc

BEGIN = "<!-- techniques: generated from the registry by make docs; do not edit -->\n"
END = "<!-- techniques: end -->\n"


def table() -> str:
    """One table, a section row per family (the technique's module), in the order they are registered."""
    rows = [
        "| name | options | what it does | expected (from its docstring) | advice |",
        "|---|---|---|---|---|",
    ]
    family = ""
    for name in TECHNIQUES.registered():
        cls = TECHNIQUES.get(name)
        module = sys.modules[cls.__module__]
        if module.__name__ != family:
            family = module.__name__
            rows.append(f"| **{_cell(_summary(module))}** | | | | |")
        rows.append(
            f"| `{name}` | {_options(cls)} | {_cell(cls.summary)} | {_cell(expected(cls))} | {_advice(cls)} |"
        )
    return "\n".join(rows) + "\n"


def _summary(module: object) -> str:
    """A module docstring's first sentence, on one line, without its full stop."""
    return re.split(r"\.(?:\s|$)", " ".join((inspect.getdoc(module) or "").split()))[0]


def expected(cls: type[Technique]) -> str:
    """The docstring's "Expected:" paragraph, without its label."""
    found = re.search(r"^Expected: (.*?)(?:\n\n|\Z)", inspect.getdoc(cls) or "", re.M | re.S)
    return " ".join(found.group(1).split()) if found else ""


def write(path: Path) -> Path:
    """The table between the page's markers, the prose around it as written."""
    from bench.results import write_between

    if BEGIN not in path.read_text(encoding="utf-8"):
        raise ValueError(f"{path}: no {BEGIN.strip()} marker to write the table after")
    write_between(path, BEGIN, END, table())
    return path


def _options(cls: type[Technique]) -> str:
    """Each option's name, with its choices where it has a fixed set (``dtype`` = bfloat16 | float16)."""
    return ", ".join(
        f"`{name}`" + (f" = {kind.replace(chr(39), '')}" if "|" in kind and "'" in kind else "")
        for name, kind, *_ in options_doc(cls)
    ).replace("|", "\\|")


def _advice(cls: type[Technique]) -> str:
    if cls.not_advised:
        return f"not advised: {_cell(cls.not_advised)}"
    return f"{cls.axis}: " + ", ".join(f"`{o.label}`" for o in cls.offers)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
