"""Two result folders side by side (two GPUs, two torch versions, before and after a change):
per-run changes in memory, throughput and accuracy, with regressions flagged only beyond the runs'
own spread."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from bench.errors import BadInput
from bench.record import KEY, Status
from bench.report import plots
from bench.report.tables import peak_bytes, to_markdown
from bench.results import read, slug, to_frame, write_atomic

# Peak memory is deterministic up to the allocator's rounding: a change under 1% is not a change.
MEMORY_TOLERANCE = 0.01
# what a run can regress in; --strict picks among them
REGRESSIONS = (
    "memory",
    "throughput",
    "accuracy",
)


def load_side(folder: Path, device: str | None = None) -> pd.DataFrame:
    """The ok records under a device folder (results/resnet/nvidia-h100…), a suite folder or a whole
    results root, from one device: ``device`` (a substring of its name) picks one where there are
    several."""
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder}: no such folder (expected results/, results/<suite>/ or "
            "results/<suite>/<device>/)"
        )
    records = _records(folder)
    if device:
        records = [
            r
            for r in records
            if device.lower() in r[KEY.device].lower() or device == slug(r[KEY.device])
        ]
    if not records:
        raise FileNotFoundError(
            f"no records in {folder}{f' for device {device!r}' if device else ''} (expected "
            "results/, results/<suite>/ or results/<suite>/<device>/)"
        )
    devices = sorted({r[KEY.device] for r in records})
    if len(devices) > 1:
        raise FileNotFoundError(
            f"{folder} holds several devices ({', '.join(devices)}); pick one with --device, e.g. "
            f"--device {slug(devices[0])}"
        )
    frame = to_frame(records)
    return frame[frame[KEY.status] == Status.OK].set_index([KEY.suite, KEY.run])


def _records(folder: Path) -> list[dict]:
    """The records of a device folder, a suite folder or a results root, read at that level only (a
    device's fit/ and superseded/ files are not records of its runs), and within a root only from
    the folder named after each record's suite (a backup copy of a suite beside it would give every
    run twice)."""
    for depth in ("*.json", "*/*.json", "*/*/*.json"):
        if paths := sorted(folder.glob(depth)):
            break
    found: dict[tuple[str, str, str], Path] = {}
    records = []
    for p in paths:
        r = read(p)
        if r is None or (depth == "*/*/*.json" and p.parent.parent.name != r[KEY.suite]):
            continue
        key = (r[KEY.suite], r[KEY.run], r[KEY.device])
        if key in found:
            raise BadInput(
                f"run {r[KEY.run]!r} of suite {r[KEY.suite]!r} on {r[KEY.device]} is in both "
                f"{found[key]} and {p}; compare one of the folders that hold it"
            )
        found[key] = p
        records.append(r)
    return records


def compare(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """One row per run present on both sides; ``regression`` names what got worse beyond the
    noise."""
    both = a.index.intersection(b.index)
    out = pd.DataFrame(index=both)
    for side, frame in (("a", a), ("b", b)):
        f = frame.reindex(both)
        # as in the suite's own table
        out[f"peak_{side}"] = pd.to_numeric(peak_bytes(f), errors="coerce")
        out[f"samples_per_s_{side}"] = _num(f, KEY.samples_per_s)
        for q in ("p25", "median", "p75"):
            out[f"step_ms_{q}_{side}"] = _num(f, f"step_time_ms_{q}")
        out[f"accuracy_{side}"] = _num(f, KEY.accuracy)
        out[f"band_{side}"] = _num(f, "accuracy_band")
    out["memory_ratio"] = out["peak_b"] / out["peak_a"]
    out["throughput_ratio"] = out["samples_per_s_b"] / out["samples_per_s_a"]
    out["accuracy_change"] = out["accuracy_b"] - out["accuracy_a"]
    out["regression"] = [", ".join(_regressions(r)) for r in out.itertuples()]
    return out.reset_index()


def unmatched(a: pd.DataFrame, b: pd.DataFrame) -> list[str]:
    """A line for each run in only one of the two folders: left out of the comparison, never
    silently."""

    def name(key: object) -> str:
        if isinstance(key, tuple):
            return "/".join(map(str, key))
        return str(key)

    return [f"only in A (not compared): {name(k)}" for k in a.index.difference(b.index)] + [
        f"only in B (not compared): {name(k)}" for k in b.index.difference(a.index)
    ]


def _num(frame: pd.DataFrame, col: str) -> pd.Series:
    """A numeric column; all-NaN where no record has it."""
    if col in frame:
        return pd.to_numeric(frame[col], errors="coerce")
    return pd.Series(np.nan, index=frame.index)


def _regressions(row) -> list[str]:
    found = []
    if row.memory_ratio > 1 + MEMORY_TOLERANCE:
        found.append("memory")
    # Slower only when B's step times sit wholly above A's middle half: a noisy run flags nothing.
    if row.step_ms_p25_b > row.step_ms_p75_a and row.step_ms_median_b > row.step_ms_median_a:
        found.append("throughput")
    band = np.nanmax([row.band_a, row.band_b, 0.0])
    if row.accuracy_change < -band:
        found.append(KEY.accuracy)
    return found


def shared_shift(table: pd.DataFrame) -> str:
    """The throughput change every run shares. A step's spread is measured within one process, so a
    slower machine (other load, clocks), driver, torch or harness moves every run at once and flags
    each."""
    ratios = table["throughput_ratio"].dropna()
    return (
        f"Throughput × over the {len(ratios)} runs: median {ratios.median():.3f}, from "
        f"{ratios.min():.3f} to {ratios.max():.3f}. A change every run shares points at the "
        "machine (other load, clocks), the driver, torch or the harness, not at one technique."
    )


def describe(frame: pd.DataFrame, folder: Path) -> str:
    """Where one side's figures come from: folder, device, software and revision."""
    first = frame.iloc[0]
    revisions = ", ".join(
        sorted({str(r)[:12] for r in frame.get(KEY.git_revision, pd.Series()).dropna()})
    )
    return (
        f"`{folder}`: {first[KEY.device]}, torch {first.get(KEY.torch_version)}, revision "
        f"{revisions or 'unknown'}, {len(frame)} ok runs"
    )


def write(
    table: pd.DataFrame, a: tuple[Path, pd.DataFrame], b: tuple[Path, pd.DataFrame], out: Path
) -> list[Path]:
    """compare.md (sides, table, flagged runs), compare.csv and the side-by-side plot, under
    ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    flagged = table[table["regression"] != ""]
    lines = [
        "# Comparison: A → B",
        "",
        f"- A = {describe(a[1], a[0])}",
        f"- B = {describe(b[1], b[0])}",
        "",
        markdown(table, "A", "B"),
        "",
        f"{len(table)} runs on both sides; {len(flagged)} regressed beyond their spread"
        + (f": {', '.join(flagged[KEY.run])}." if len(flagged) else "."),
        "",
        shared_shift(table),
        "",
        "Regression rules: memory more than 1% above A (peaks are deterministic up to allocator "
        "rounding); throughput when B's step-time quartiles lie wholly above A's middle half (p25 "
        "of B > p75 of A); accuracy when it drops by more than the wider of the two baselines' "
        "seed bands.",
        "",
        "![side by side](compare.png)",
        "",
    ]
    written = [out / "compare.md", out / "compare.csv", out / "compare.png"]
    write_atomic(written[0], "\n".join(lines))
    write_atomic(written[1], table.to_csv(index=False))
    if len(table):
        side_by_side(table, "A", "B", written[2])
    return written[:2] + ([written[2], written[2].with_suffix(".svg")] if len(table) else [])


def markdown(table: pd.DataFrame, name_a: str, name_b: str) -> str:
    show = pd.DataFrame(
        {
            KEY.suite: table[KEY.suite],
            KEY.run: table[KEY.run],
            f"peak MiB ({name_a})": (table["peak_a"] / 2**20).round(1),
            f"peak MiB ({name_b})": (table["peak_b"] / 2**20).round(1),
            "memory ×": table["memory_ratio"].round(3),
            f"samples/s ({name_a})": table["samples_per_s_a"].round(1),
            f"samples/s ({name_b})": table["samples_per_s_b"].round(1),
            "throughput ×": table["throughput_ratio"].round(3),
            "Δ accuracy pt": (100 * table["accuracy_change"]).round(1),
            "regression": table["regression"]
            .replace("", "–")
            .map(lambda s: s if s == "–" else f"⚠ {s}"),
        }
    )
    return to_markdown(show.dropna(axis=1, how="all"))


def side_by_side(table: pd.DataFrame, name_a: str, name_b: str, path: Path) -> None:
    """Memory and throughput of each run, A and B as paired bars; regressions' names in red."""
    labels = [
        f"{s}/{r}" if table[KEY.suite].nunique() > 1 else r
        for s, r in zip(table[KEY.suite], table[KEY.run])
    ]
    y = np.arange(len(table))
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.35 * len(table) + 2), sharey=True)
    if max(table["peak_a"].max(), table["peak_b"].max()) >= 2**30:
        unit = 2**30
    else:
        unit = 2**20
    for ax, (col, xlabel, scale) in zip(
        axes,
        (
            ("peak", f"peak memory ({'GiB' if unit == 2**30 else 'MiB'})", unit),
            (KEY.samples_per_s, "throughput (samples/s)", 1),
        ),
    ):
        ax.barh(y - 0.2, table[f"{col}_a"] / scale, height=0.4, color="tab:blue", label=name_a)
        ax.barh(y + 0.2, table[f"{col}_b"] / scale, height=0.4, color="tab:orange", label=name_b)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_yticks(y, labels)
    for tick, flagged in zip(axes[0].get_yticklabels(), table["regression"]):
        tick.set_color("tab:red" if flagged else "black")
    axes[0].invert_yaxis()
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{name_a} → {name_b} (red: a regression beyond the runs' spread)")
    fig.tight_layout()
    plots.save(fig, path)
