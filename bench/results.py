"""Result records: one flat JSON file per run under results/<suite>/<device>/, written atomically,
and loaded back into a pandas DataFrame."""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

STATUSES = ("ok", "oom", "error", "timeout", "unsupported")


def slug(text: str) -> str:
    """A file-system-safe name: 'NVIDIA H100 80GB HBM3' → 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9._@+-]+", "-", text.lower()).strip("-")


def record_path(results: Path, suite: str, device: str, run: str) -> Path:
    return results / suite / slug(device) / f"{slug(run)}.json"


def write_atomic(path: Path, record: dict[str, Any]) -> None:
    """Write to a temporary file beside the target, then rename: a reader never sees half a record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read(path: Path, warn: bool = True) -> dict[str, Any] | None:
    """The stored record, or None. One that cannot be parsed (a hand edit, a git merge conflict) is named
    on stderr: silently leaving a measured run out of a report would hide it."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        if warn:
            print(f"warning: {path}: unreadable record, treated as absent ({exc})", file=sys.stderr)
        return None


def set_aside_if_unreadable(path: Path) -> None:
    """Before a record is written over: one that cannot be parsed (a merge conflict may hold two
    measurements) moves to <run>.json.unreadable (.unreadable-2, … beside earlier ones) rather than being lost."""
    if path.exists() and read(path, warn=False) is None:  # named already, when the sweep read it
        asides = (path.with_name(path.name + ".unreadable" + (f"-{n}" if n > 1 else "")) for n in itertools.count(1))
        path.replace(next(a for a in asides if not a.exists()))


def load_records(suite_dir: Path) -> list[dict[str, Any]]:
    """Every record of a suite, all devices."""
    return [r for p in sorted(suite_dir.glob("*/*.json")) if (r := read(p)) is not None]


def accuracy_vs_baseline(record: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, Any]:
    """The accuracy delta against the baseline's first seed (same initial weights and data order), and the
    noise band: the spread (max − min) of the baseline's accuracies over its seeds."""
    acc, base = record.get("accuracy"), (baseline or {}).get("accuracy")
    if acc is None or base is None:
        return {}
    seeds = baseline.get("accuracy_seeds") or [base]
    delta, band = acc - base, max(seeds) - min(seeds)
    return {"accuracy_delta": delta, "accuracy_band": band, "outside_band": abs(delta) > band}


def to_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per run; the technique proofs become ``proof.<technique>.<key>`` columns, the versions of the
    packages the run imported ``package.<name>`` columns."""
    rows = []
    for r in records:
        row = {k: v for k, v in r.items() if k not in ("proof", "spec", "packages")}
        row |= {f"proof.{k}": v for k, v in (r.get("proof") or {}).items()}
        row |= {f"package.{k}": v for k, v in (r.get("packages") or {}).items()}
        rows.append(row)
    return pd.DataFrame(rows)
