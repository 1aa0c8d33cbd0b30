"""Errors the user can fix, printed without a traceback with exit status 2. They live apart from the
suite loader, which imports torch, so that a command reading only stored records need not import it:
compare does not (report and overview still do, for the technique registry that colours their
plots)."""

from __future__ import annotations

from pathlib import Path

from bench.registry import did_you_mean

EXIT_BAD_INPUT = 2  # a command's exit status for input the user can fix


def first_line(exc: BaseException) -> str:
    """An exception's message's first line, or nothing: what a record or a prediction says of it."""
    return (str(exc).strip().splitlines() or [""])[0]


class BadInput(Exception):
    """A flag or value the user can fix: printed as one line."""


class NotStored(BadInput):
    """Runs measured whose records could not be written where the sweep stores them (each was kept
    in a temporary file, named as it happened): the sweep ends with exit status 2, so a script
    notices."""


class SuiteError(Exception):
    """Every problem found in a suite file, one per line."""

    SHOWN = 50  # a generated suite can hold thousands; the first ones say what is wrong

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.path, self.problems = path, problems
        lines = "\n".join(f"  {path}: {p}" for p in problems[: self.SHOWN])
        if len(problems) > self.SHOWN:
            more = f"\n  … and {len(problems) - self.SHOWN} more"
        else:
            more = ""
        super().__init__(f"{len(problems)} problem(s) in suite {path}:\n{lines}{more}")


def cannot_read(path: Path, reason: str) -> SuiteError:
    """A suite file that cannot be read; where it does not exist, the suites beside it (and the one
    meant)."""
    if path.parent.is_dir():
        nearby = sorted(p.stem for p in path.parent.glob("*.toml"))
    else:
        nearby = []
    hint = ""
    if nearby and not path.exists():
        hint = f"{did_you_mean(path.stem, nearby)}; suites in {path.parent}: {', '.join(nearby)}"
    return SuiteError(path, [f"cannot read: {reason}{hint}"])
