"""Plot helpers: small pure functions that draw one view of the summary table onto an Axes."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only; no display on CI or GPU hosts

import pandas as pd
from matplotlib.axes import Axes


def byte_unit(largest: float) -> tuple[float, str]:
    """GiB for big figures, MiB for small ones, so tick labels stay readable."""
    return (2**30, "GiB") if largest >= 2**30 else (2**20, "MiB")


def memory_label(device_type: str, unit: str) -> str:
    what = "peak allocated" if device_type == "cuda" else "peak live tensors"
    return f"{what} ({unit}{', CUDA allocator' if device_type == 'cuda' else ', tracked'})"


def peak_memory_bars(ax: Axes, table: pd.DataFrame, title: str) -> None:
    """Peak memory per run in suite order, baseline in grey, each bar labelled with its ratio to it;
    runs without a figure are named with their status."""
    divisor, unit = byte_unit(table["peak_bytes"].max())
    peaks = table["peak_bytes"] / divisor
    colors = ["tab:gray" if r == b else "tab:blue" for r, b in zip(table["run"], table["baseline"])]
    ax.barh(table["run"], peaks.fillna(0), color=colors)
    for y, (peak, ratio, status) in enumerate(zip(peaks, table["memory_vs_baseline"], table["status"])):
        text = f" {peak:,.1f} ({ratio:.2f}×)" if status == "ok" and pd.notna(ratio) else f" {status}"
        ax.text(0 if pd.isna(peak) else peak, y, text, va="center", fontsize=8,
                color="black" if status == "ok" else "tab:red")
    ax.invert_yaxis()
    ax.margins(x=0.2)
    ax.set_xlabel(memory_label(table["device_type"].iloc[0], unit))
    ax.set_title(title)


def memory_vs_throughput(ax: Axes, table: pd.DataFrame, title: str) -> None:
    """One point per successful run: towards the upper left is better (less memory, more samples/s)."""
    ok = table[table["status"] == "ok"]
    divisor, unit = byte_unit(ok["peak_bytes"].max() if len(ok) else 0)
    is_base = ok["run"] == ok["baseline"]
    for subset, style in ((ok[~is_base], {"color": "tab:blue"}),
                          (ok[is_base], {"color": "tab:gray", "marker": "*", "s": 150, "label": "baseline"})):
        ax.scatter(subset["peak_bytes"] / divisor, subset["samples_per_s"], zorder=3, **style)
    for r in ok.itertuples():
        ax.annotate(r.run, (r.peak_bytes / divisor, r.samples_per_s), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel(memory_label(table["device_type"].iloc[0], unit))
    ax.set_ylabel("throughput (samples/s)")
    ax.grid(alpha=0.3)
    ax.set_title(title)
    if is_base.any():
        ax.legend(loc="best", fontsize=8)
