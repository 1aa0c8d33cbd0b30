"""docs/techniques.md's tables, generated from the code: each technique's options, what it does,
what to expect of it and its place in advice's catalogue, read off its class; and the interface a
technique declares, read off Technique's source. So the page never disagrees with the code (``bench
list --docs docs/techniques.md`` rewrites both; a test holds the page to them)."""

from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path

from bench.techniques.base import AXES, INTERFACE, TECHNIQUES, Technique, options_doc

BEGIN = "<!-- techniques: generated from the registry by make docs; do not edit -->\n"
END = "<!-- techniques: end -->\n"
INTERFACE_BEGIN = (
    "<!-- interface: generated from bench/techniques/base.py by make docs; do not edit -->\n"
)
INTERFACE_END = "<!-- interface: end -->\n"


def table() -> str:
    """One table, a section row per family (the technique's module), in the order they are
    registered."""
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
            f"| `{name}` | {_options(cls)} | {_cell(cls.summary)} | {_cell(expected(cls))} | "
            f"{_advice(cls)} |"
        )
    return "\n".join(rows) + "\n"


def _summary(module: object) -> str:
    """A module docstring's first sentence, on one line, without its full stop."""
    return re.split(r"\.(?:\s|$)", " ".join((inspect.getdoc(module) or "").split()))[0]


def expected(cls: type[Technique]) -> str:
    """The docstring's "Expected:" paragraph, without its label."""
    found = re.search(r"^Expected: (.*?)(?:\n\n|\Z)", inspect.getdoc(cls) or "", re.M | re.S)
    if found:
        return " ".join(found.group(1).split())
    return ""


def write(path: Path) -> Path:
    """The techniques' table and the interface's between the page's markers, the prose around them
    as written."""
    from bench.results import write_between

    text = path.read_text(encoding="utf-8")
    for begin, end, made in (
        (BEGIN, END, table),
        (INTERFACE_BEGIN, INTERFACE_END, interface_table),
    ):
        if begin not in text:
            raise ValueError(f"{path}: no {begin.strip()} marker to write the table after")
        write_between(path, begin, end, made())
    return path


def _options(cls: type[Technique]) -> str:
    """Each option's name, with its choices where it has a fixed set (``dtype`` = bfloat16 |
    float16)."""
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


def interface_table() -> str:
    """Technique's members by who reads them (``INTERFACE``), each row a member, or the attributes
    one comment of the class's describes together, with that comment or the docstring's first
    sentence (AXES spelt out: the list the page once kept by hand, and let drift)."""
    rows = ["| member | says |", "|---|---|"]
    described = _described_members()
    for group, names in INTERFACE.items():
        rows.append(f"| **{group}** | |")
        for members, text in described:
            if members[0] in names:
                shown = text.replace("``", "`").replace(
                    "AXES", f"advice's axes ({', '.join(AXES)})"
                )
                rows.append(
                    f"| {', '.join(f'`{m}`' for m in members)} | {_cell(shown.removesuffix('.'))} |"
                )
    return "\n".join(rows) + "\n"


def _described_members() -> list[tuple[list[str], str]]:
    """Technique's members in its source's order, an attribute without a comment of its own joining
    the one above it."""
    lines = inspect.getsource(Technique).splitlines()
    body = ast.parse(inspect.getsource(Technique)).body[0].body
    out: list[tuple[list[str], str]] = []
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name != "__init__":
            doc = " ".join((ast.get_docstring(node) or "").split())
            out.append(([node.name], re.split(r"(?<=\.)\s", doc)[0].removesuffix(".")))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            text = _comment(lines, node.lineno - 1)
            if text or not out:
                out.append(([node.target.id], text))
            else:
                out[-1][0].append(node.target.id)
    return out


def _comment(lines: list[str], at: int) -> str:
    """The comment on a source line (0-based), or the block of comment lines directly above it."""
    code, _, trailing = lines[at].partition("  # ")
    if trailing:
        return trailing.strip()
    above = []
    while (
        at > 0
        and lines[at - 1].strip().startswith("# ")
        and not lines[at - 1].strip().startswith("# --")
    ):
        at -= 1
        above.insert(0, lines[at].strip().removeprefix("# "))
    return " ".join(above)
