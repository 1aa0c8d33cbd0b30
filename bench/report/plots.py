"""Plot helpers: small pure functions that draw one view of the summary table onto an Axes."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only; no display on CI or GPU hosts

import pandas as pd  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

GIB = 2**30


def memory_label(device_type: str) -> str:
    return "peak allocated (GiB, CUDA)" if device_type == "cuda" else "peak live tensors (GiB, tracked)"


def peak_memory_bars(ax: Axes, table: pd.DataFrame, title: str) -> None:
    """Peak memory per run, baseline highlighted; failed runs shown as labelled gaps."""
    rows = table.sort_values("run")
    peaks = rows["peak_bytes"].astype(float).fillna(0) / GIB
    colors = ["tab:gray" if r == b else "tab:blue" for r, b in zip(rows["run"], rows["baseline"])]
    ax.barh(rows["run"], peaks, color=colors)
    for y, (peak, status) in enumerate(zip(peaks, rows["status"])):
        if status != "ok":
            ax.text(peak, y, f" {status}", va="center", color="tab:red")
    ax.invert_yaxis()
    ax.set_xlabel(memory_label(rows["device_type"].iloc[0]))
    ax.set_title(title)


def memory_vs_throughput(ax: Axes, table: pd.DataFrame, title: str) -> None:
    """One point per successful run: lower-right is better (less memory, more samples/s)."""
    ok = table[table["status"] == "ok"]
    ax.scatter(ok["peak_bytes"].astype(float) / GIB, ok["samples_per_s"].astype(float), color="tab:blue")
    for _, r in ok.iterrows():
        ax.annotate(r["run"], (r["peak_bytes"] / GIB, r["samples_per_s"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    base = ok[ok["run"] == ok["baseline"]]
    ax.scatter(base["peak_bytes"].astype(float) / GIB, base["samples_per_s"].astype(float),
               color="tab:gray", s=80, marker="*", label="baseline", zorder=3)
    ax.set_xlabel(memory_label(table["device_type"].iloc[0]))
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title(title)
    if len(base):
        ax.legend(loc="best", fontsize=8)
