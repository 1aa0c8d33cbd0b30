"""Plot helpers: small pure functions that draw one view of the summary table onto an Axes.

Every run has one colour wherever it appears, in every plot and suite: the colour of its first
technique (built-ins in name order on a fixed palette, a user's own by a hash of its name), grey for
the baseline."""

from __future__ import annotations

import os
import tempfile
import zlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on CI or GPU hosts
# fixed element ids: a rebuilt report changes no file
matplotlib.rcParams["svg.hashsalt"] = "memsave-bench"
SVG_METADATA = {"Date": None}  # nor a timestamp

import matplotlib.pyplot
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.lines import Line2D

from bench.record import AT_PEAK, KEY, Category, Status
from bench.report.tables import pareto_front

BASELINE_COLOUR = "#7f7f7f"
# tab20's pairs split (dark ones first), then Dark2, then tab20b's and tab20c's shades of each hue,
# darkest and middle first, without the greys the baseline wears: 52 colours. The built-in
# techniques take the first ones in name order; a user's own hash into the rest, so one never wears
# a built-in's colour beside it.
PALETTE = [
    c
    for c in (
        *matplotlib.colormaps["tab20"].colors[0::2],
        *matplotlib.colormaps["tab20"].colors[1::2],
        *matplotlib.colormaps["Dark2"].colors,
        *matplotlib.colormaps["tab20b"].colors[0::4],
        *matplotlib.colormaps["tab20b"].colors[2::4],
        *matplotlib.colormaps["tab20c"].colors[0::4],
        *matplotlib.colormaps["tab20c"].colors[2::4],
        *matplotlib.colormaps["tab20b"].colors[1::4],
        *matplotlib.colormaps["tab20c"].colors[1::4],
        *matplotlib.colormaps["Set1"].colors,
        *matplotlib.colormaps["Set2"].colors,
    )
    if len(set(c)) > 1
]
BREAKDOWN_COLOURS = {
    Category.PARAMETERS: "#1f77b4",
    Category.BUFFERS: "#aec7e8",
    Category.GRADIENTS: "#ff7f0e",
    Category.OPTIMIZER_STATE: "#2ca02c",
    Category.ACTIVATIONS: "#d62728",
    Category.TEMPORARIES: "#9467bd",
    Category.KV_CACHE: "#8c564b",
    "allocator": "#c7c7c7",  # what the allocator reserved beyond the tensors
}
# Accuracy against the baseline's noise band, as the Pareto plot's marker.
ACCURACY_MARKERS = {
    "within band": "o",
    "worse, outside band": "v",
    "better, outside band": "^",
    "not measured": "s",
}


def save(fig, path, dpi: int = 120) -> None:
    """The figure as PNG at ``path`` and SVG beside it, with tight bounds (legends outside the axes
    stay in), then closed."""
    try:
        for target, options in (
            (path, {"dpi": dpi}),
            (path.with_suffix(".svg"), {"metadata": SVG_METADATA}),
        ):
            # A full disk leaves the old plot, never half a new; a name of its own, since two
            # reports of one suite at once each renamed the other's file away from under it.
            fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
            os.close(fd)
            partial = Path(name)
            try:
                fig.savefig(partial, bbox_inches="tight", format=target.suffix[1:], **options)
                os.chmod(partial, 0o644)
                os.replace(partial, target)
            finally:
                partial.unlink(missing_ok=True)
    finally:
        matplotlib.pyplot.close(fig)


def byte_unit(largest: float) -> tuple[float, str]:
    """GiB for big figures, MiB for small ones, so tick labels stay readable."""
    if largest >= 2**30:
        return (2**30, "GiB")
    return (2**20, "MiB")


def memory_label(device_type: str, unit: str) -> str:
    if device_type == "cuda":
        what = "peak allocated"
    else:
        what = "peak live tensors"
    return f"{what} ({unit}{', CUDA allocator' if device_type == 'cuda' else ', tracked'})"


def technique_colour(first: str, is_baseline: bool = False) -> tuple | str:
    """The colour of a run by the name of its first technique (the table's ``technique``), the same
    in every report: a built-in's by its place among the registered names, a user's own
    ('module:Class') by a hash of its name into the colours after those, so it is neither a
    built-in's nor the baseline's grey."""
    from bench.techniques import TECHNIQUES

    if is_baseline or first in ("", "baseline"):
        return BASELINE_COLOUR
    names = TECHNIQUES.names()  # sorted, so a built-in's colour does not hang on import order
    if first in names:
        return PALETTE[names.index(first)]
    return PALETTE[len(names) + zlib.crc32(first.encode()) % (len(PALETTE) - len(names))]


def _colours(table: pd.DataFrame) -> list:
    return [
        technique_colour(t, r == b)
        for t, r, b in zip(table["technique"], table[KEY.run], table[KEY.baseline])
    ]


def peak_memory_bars(ax: Axes, table: pd.DataFrame, title: str) -> None:
    """Peak memory per run in suite order, each bar labelled with its ratio to the baseline; runs
    without a figure are named with their status."""
    divisor, unit = byte_unit(table["peak_bytes"].max())
    peaks = table["peak_bytes"] / divisor
    ax.barh(table[KEY.run], peaks.fillna(0), color=_colours(table))
    for y, (peak, ratio, status) in enumerate(
        zip(peaks, table["memory_vs_baseline"], table[KEY.status])
    ):
        if status == Status.OK and pd.notna(ratio):
            text = f" {peak:,.1f} ({ratio:.2f}×)"
        else:
            text = f" {status}"
        ax.text(
            0 if pd.isna(peak) else peak,
            y,
            text,
            va="center",
            fontsize=8,
            color="black" if status == Status.OK else "tab:red",
        )
    ax.invert_yaxis()
    ax.margins(x=0.2)
    ax.set_xlabel(memory_label(table[KEY.device_type].iloc[0], unit))
    ax.set_title(title)


def accuracy_class(row: pd.Series) -> str:
    if pd.isna(row.get("accuracy_delta")) or pd.isna(row.get("outside_band")):
        return "not measured"
    if not row["outside_band"]:
        return "within band"
    if row["accuracy_delta"] < 0:
        return "worse, outside band"
    return "better, outside band"


def usable_front(memory: np.ndarray, throughput: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """The Pareto front of the runs a practitioner could choose: one known to hurt accuracy (worse
    than the baseline's band) is drawn, but is on no front, and does not push a usable run off
    it."""
    usable = classes != "worse, outside band"
    front = np.zeros(len(memory), dtype=bool)
    front[usable] = pareto_front(memory[usable], throughput[usable])
    return front


def pareto(ax: Axes, table: pd.DataFrame, title: str) -> None:
    """Peak memory against throughput, one point per measured run; the front (runs no other run
    beats on both) joined by a line. Marker: accuracy against the baseline's band. Up and left is
    better."""
    ok = table[
        (table[KEY.status] == Status.OK)
        & table["peak_bytes"].notna()
        & table[KEY.samples_per_s].notna()
    ]
    if ok.empty:
        ax.text(
            0.5,
            0.5,
            "no run with both peak memory and throughput",
            ha="center",
            transform=ax.transAxes,
        )
        ax.set_title(title)
        return
    divisor, unit = byte_unit(ok["peak_bytes"].max())
    x, y = ok["peak_bytes"].to_numpy() / divisor, ok[KEY.samples_per_s].to_numpy()
    classes = ok.apply(accuracy_class, axis=1).to_numpy()
    front = usable_front(x, y, classes)
    order = np.argsort(x[front])
    ax.step(
        x[front][order], y[front][order], where="post", color="black", lw=1, alpha=0.6, zorder=2
    )
    is_base = (ok[KEY.run] == ok[KEY.baseline]).to_numpy()
    for i, colour in enumerate(_colours(ok)):
        if is_base[i]:
            marker = "*"
        else:
            marker = ACCURACY_MARKERS[classes[i]]
        ax.scatter(
            x[i],
            y[i],
            color=colour,
            marker=marker,
            s=160 if is_base[i] else 60,
            zorder=3,
            edgecolors="black" if front[i] else "none",
            linewidths=1.2,
        )
    labels = [
        f"{r}{' (baseline)' if b and 'baseline' not in r else ''}"
        for r, b in zip(ok[KEY.run], is_base)
    ]
    place_labels(ax, x, y, labels)
    handles = [
        Line2D(
            [],
            [],
            color="black",
            lw=1,
            alpha=0.6,
            label="Pareto front of runs not worse than the band (black edge: on it)",
        ),
        Line2D([], [], marker="*", ls="", color=BASELINE_COLOUR, ms=12, label="baseline"),
    ]
    handles += [
        Line2D([], [], marker=m, ls="", color="dimgray", label=f"accuracy {c}")
        for c, m in ACCURACY_MARKERS.items()
        if c in set(classes)
    ]
    ax.legend(handles=handles, loc="best", fontsize=7, framealpha=0.8)
    ax.set_xlabel(memory_label(table[KEY.device_type].iloc[0], unit))
    ax.set_ylabel("throughput (samples/s)")
    ax.grid(alpha=0.3)
    ax.set_title(title)


def place_labels(
    ax: Axes, x: np.ndarray, y: np.ndarray, labels: list[str], fontsize: float = 7
) -> None:
    """Each label at the first of a ring of offsets around its point where it overlaps no label
    placed before it and no point; a leader line where it had to move away. Greedy,
    dependency-free."""
    fig = ax.figure
    fig.canvas.draw()  # fixes the axes' limits and transform
    renderer = fig.canvas.get_renderer()
    points = ax.transData.transform(np.column_stack([x, y]))
    taken: list = []
    # a label that crosses it would be clipped or sit on the axis
    frame = ax.get_window_extent(renderer)
    offsets = [
        (dx * r, dy * r)
        for r in (6, 16, 28, 42)
        for dx, dy in ((1, 1), (1, -1), (-1, 1), (-1, -1), (0, 1.4), (0, -1.4), (1.4, 0), (-1.4, 0))
    ]
    for i in np.argsort(-y):  # top points first: they have the least room above
        others = [pt for j, pt in enumerate(points) if j != i]
        for dx, dy in offsets:
            text = _label(ax, labels[i], xy=(x[i], y[i]), offset=(dx, dy), fontsize=fontsize)
            box = text.get_window_extent(renderer).expanded(1.05, 1.1)
            inside = (
                frame.x0 <= box.x0
                and box.x1 <= frame.x1
                and frame.y0 <= box.y0
                and box.y1 <= frame.y1
            )
            if (
                inside
                and not any(box.overlaps(t) for t in taken)
                and not any(box.contains(*pt) for pt in others)
            ):
                break
            text.remove()
        else:  # nowhere clear: the nearest place, overlapping
            dx, dy = offsets[0]
            text = _label(ax, labels[i], xy=(x[i], y[i]), offset=(dx, dy), fontsize=fontsize)
            box = text.get_window_extent(renderer)
        if (dx, dy) != offsets[0]:  # moved away: a leader line says whose label it is
            text.remove()
            _label(ax, labels[i], xy=(x[i], y[i]), offset=(dx, dy), fontsize=fontsize, leader=True)
        taken.append(box)


def _label(
    ax: Axes,
    text: str,
    xy: tuple[float, float],
    offset: tuple[float, float],
    fontsize: float,
    leader: bool = False,
):
    return ax.annotate(
        text,
        xy,
        xytext=offset,
        textcoords="offset points",
        fontsize=fontsize,
        ha="left" if offset[0] >= 0 else "right",
        va="bottom" if offset[1] >= 0 else "top",
        arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "gray"} if leader else None,
    )


def breakdown_bars(ax: Axes, table: pd.DataFrame, title: str) -> None:
    """What was alive at each run's peak, stacked, runs sorted by total; on CUDA the allocator's
    cache slack (reserved − allocated) on top."""
    parts = breakdown_frame(table)
    divisor, unit = byte_unit(parts.sum(axis=1).max() if len(parts) else 0)
    left = np.zeros(len(parts))
    for part in parts.columns:
        values = parts[part].to_numpy() / divisor
        ax.barh(
            parts.index,
            values,
            left=left,
            color=BREAKDOWN_COLOURS[part],
            label=part.replace("_", " "),
        )
        left += values
    ax.invert_yaxis()
    ax.set_xlabel(f"bytes alive at the peak ({unit}), by what holds them")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)  # outside: bars fill the axes
    ax.set_title(title)


def breakdown_frame(table: pd.DataFrame) -> pd.DataFrame:
    """One row per run that has an at-peak breakdown (tracked step), columns in AT_PEAK order plus
    the allocator's slack where measured; sorted by total, largest first."""
    # a generation's alone, and newer
    cols = [f"at_peak_{p}_bytes" for p in AT_PEAK if p != Category.KV_CACHE]
    if all(c in table for c in cols):
        have = table.dropna(subset=cols)
    else:
        have = table.iloc[:0]
    have = have[have[KEY.status] == Status.OK]
    kept = [p for p in AT_PEAK if f"at_peak_{p}_bytes" in have]
    parts = pd.DataFrame(
        {p: have[f"at_peak_{p}_bytes"].astype(float).fillna(0) for p in kept}, index=have.index
    )
    if KEY.cache_slack_bytes in have and have[KEY.cache_slack_bytes].notna().any():
        parts["allocator"] = pd.to_numeric(have[KEY.cache_slack_bytes], errors="coerce").fillna(0)
    parts.index = have[KEY.run]
    return parts.loc[parts.sum(axis=1).sort_values(ascending=False).index]


def step_time_boxes(ax: Axes, table: pd.DataFrame, title: str) -> None:
    """Every timed step of every run as a box (quartiles, whiskers to 1.5 IQR, outliers as dots): a
    wide box is a noisy run, whose ratios deserve less trust."""
    timed = table[KEY.step_times_ms].map(lambda v: isinstance(v, list) and len(v) > 0)
    ok = table[(table[KEY.status] == Status.OK) & timed]
    boxes = ax.boxplot(
        list(ok[KEY.step_times_ms]),
        orientation="horizontal",
        patch_artist=True,
        widths=0.6,
        flierprops={"markersize": 3},
    )
    for patch, colour in zip(boxes["boxes"], _colours(ok)):
        patch.set_facecolor(colour)
        patch.set_alpha(0.7)
    ax.set_yticks(range(1, len(ok) + 1), ok[KEY.run])
    ax.invert_yaxis()
    times = [t for ts in ok[KEY.step_times_ms] for t in ts]
    if times and max(times) / max(min(times), 1e-9) > 20:
        ax.set_xscale("log")  # a slow outlier run would squash every other box
    ax.set_xlabel("step time (ms)")
    ax.grid(alpha=0.3, axis="x")
    ax.set_title(title)


def predicted_vs_measured(ax: Axes, table: pd.DataFrame, title: str) -> None:
    """The fake-tensor prediction over the measured peak, per run: 1 is exact, the band is ±10%."""
    both = table[table[KEY.predicted_peak_tensor_bytes].notna() & table["peak_bytes"].notna()]
    ratio = pd.to_numeric(both[KEY.predicted_peak_tensor_bytes]) / both["peak_bytes"]
    ax.axvspan(0.9, 1.1, color="gray", alpha=0.15, label="±10%")
    ax.axvline(1.0, color="black", lw=1)
    ax.scatter(ratio, range(len(both)), color=_colours(both), zorder=3)
    for y, r in enumerate(ratio):
        ax.annotate(
            f"{r:.3f}", (r, y), xytext=(6, 0), textcoords="offset points", va="center", fontsize=7
        )
    ax.set_yticks(range(len(both)), both[KEY.run])
    ax.invert_yaxis()
    low, high = min(ratio.min(), 0.85), max(ratio.max(), 1.15)
    ax.set_xlim(low - 0.02, high + 0.05)
    ax.set_xlabel("predicted ÷ measured peak memory (bytes / bytes)")
    ax.legend(loc="lower right", fontsize=7)
    ax.grid(alpha=0.3, axis="x")
    ax.set_title(title)


def length_curves(ax: Axes, curves: pd.DataFrame, title: str) -> None:
    """One card's longest-sequence searches (``bench predict --card --longest``): each run's
    predicted allocated peak (solid) and reserved (dashed) at each length its search tried, the
    capacity the card leaves its allocator as a line; a run's longest sequence is the last length
    whose reserved stays under it, marked."""
    capacity = int(curves["capacity_bytes"].iloc[0])
    divisor, unit = byte_unit(capacity)
    for run, part in curves.groupby(KEY.run, sort=False):
        part = part.sort_values("seq_len")
        (line,) = ax.plot(
            part["seq_len"], part[KEY.peak_tensor_bytes] / divisor, marker="o", label=f"{run}"
        )
        ax.plot(
            part["seq_len"],
            part["reserved_bytes"] / divisor,
            linestyle="--",
            marker="x",
            color=line.get_color(),
        )
        longest = part["longest_sequence"].iloc[0]
        at = part[part["seq_len"] == longest]
        if not at.empty:
            ax.plot(
                longest, at["reserved_bytes"].iloc[0] / divisor, "*", ms=14, color=line.get_color()
            )
    ax.axhline(capacity / divisor, color="black", linewidth=1)
    ax.annotate(
        f"{curves['card'].iloc[0]}: {capacity / divisor:,.1f} {unit} for the allocator",
        (0, capacity / divisor),
        xycoords=("axes fraction", "data"),
        textcoords="offset points",
        xytext=(4, 4),
        fontsize=8,
    )
    ax.set_xlabel("sequence length (tokens) at the run's batch")
    ax.set_ylabel(f"predicted peak ({unit}): allocated —, reserved - -")
    ax.set_ylim(0, 1.6 * capacity / divisor)  # what is far over the card runs off the top
    ax.legend(fontsize=7, title="★ longest sequence", title_fontsize=7)
    ax.set_title(title)
