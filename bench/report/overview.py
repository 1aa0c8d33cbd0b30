"""One page over every suite in a results folder: per model and device, which combination of
techniques gives the most memory for the throughput it costs."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from bench.record import KEY
from bench.report import plots
from bench.report.figures import write_fields, write_figures
from bench.report.headline import (
    PICKS,
    candidates,
    device_title,
    devices_best_first,
    pick_text,
    picks,
    suite_entries,
    suite_throughput,
    this_machine,
)
from bench.report.page import Block, html_page, markdown
from bench.report.tables import pareto_front, summary
from bench.results import load_records, slug, to_frame, write_atomic

INTRO = (
    "Recorded: how many of the suite's entries the device has a record of (each report lists the "
    "rest with its predicted peak at GPU shapes). Per suite and device (this machine's, then GPUs, "
    "first), three picks among the runs measured at the baseline's batch size that save memory (at "
    "most 0.99× the baseline's peak) and whose accuracy delta (where measured) lies within the "
    "baseline's noise band: the largest memory saving, the largest that keeps throughput within 5% "
    "of the baseline's, and the one that saves the most memory per unit of throughput lost ((1 − "
    "memory ×) ÷ (1 − throughput ×), a loss under 1% counted as 1%). Figures are relative to each "
    "suite's own baseline on the same device; each suite's report, linked above, has every run."
)


def build_overview(results: Path) -> list[Path]:
    """results/overview/{overview.md, overview.html, *.png, *.svg} from every suite under
    ``results``."""
    loaded = {
        p: load_records(p)
        for p in sorted(results.iterdir())
        if p.is_dir() and any(p.glob("*/*.json"))
    }
    # a suite whose every record is unreadable: none
    suites = [p for p, records in loaded.items() if records]
    tables = [summary(to_frame(loaded[p]), suite_throughput(p.name)) for p in suites]
    if not tables:
        raise FileNotFoundError(
            f"no suite records under {results}/*/*/; run `make bench SUITE=…` first"
        )
    figures = write_figures(results, {p.name: t for p, t in zip(suites, tables)})
    everything = pd.concat(tables, ignore_index=True)
    out = results / "overview"
    out.mkdir(exist_ok=True)
    blocks = [
        Block("h1", "All suites: what to use"),
        Block("nav", [(p.name, f"../{p.name}/report") for p in suites]),
        Block("p", INTRO),
    ]
    written = [out / "overview.md", out / "overview.html"]
    for device in devices_best_first(everything, this_machine()):
        part = everything[everything[KEY.device] == device]
        rows = []
        for suite, t in part.groupby(KEY.suite, sort=True):
            base = t[t[KEY.run] == t[KEY.baseline]]
            best = picks(t)
            entries = suite_entries(str(suite))
            rows.append(
                {
                    KEY.suite: suite,
                    KEY.model: t[KEY.model].iloc[0],
                    "recorded": f"{len(t)} of {entries}" if entries else str(len(t)),
                    "baseline peak GiB": round(base["peak_bytes"].iloc[0] / 2**30, 3)
                    if len(base)
                    else None,
                    "baseline samples/s": round(base[KEY.samples_per_s].iloc[0], 1)
                    if len(base)
                    else None,
                    **{PICKS[k]: pick_text(v) for k, v in best.items()},
                }
            )
        png = out / f"overview-{slug(str(device))}.png"
        _suite_grid(part, str(device), png)
        written += [png, png.with_suffix(".svg")]
        title = device_title(str(device), part[KEY.device_type].iloc[0])
        blocks += [Block("h2", title), Block("table", pd.DataFrame(rows)), Block("image", png)]
    write_atomic(written[0], markdown(blocks, out))
    write_atomic(written[1], html_page(blocks, "All suites: what to use"))
    return written + [figures, write_fields(results)]


def _suite_grid(table: pd.DataFrame, device: str, path: Path) -> None:
    """One panel per suite: memory × against throughput × of every run, relative to its baseline, so
    the models can be read on one scale; the Pareto front joined, colours per technique as in every
    plot."""
    groups = list(table.groupby(KEY.suite, sort=True))
    # Two panels a row at 110 dpi: about 1,200 px wide, the page's width, so labels show at their
    # own size.
    cols = min(2, len(groups))
    rows = int(np.ceil(len(groups) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5.4 * cols, 4.6 * rows), squeeze=False)
    colours: dict[str, object] = {}
    for ax, (suite, t) in zip(axes.flat, groups):
        c = candidates(t)
        x, y = c["memory_vs_baseline"].to_numpy(), c["throughput_vs_baseline"].to_numpy()
        if len(c):
            front = pareto_front(x, y)
            order = np.argsort(x[front])
            ax.step(x[front][order], y[front][order], where="post", color="black", lw=1, alpha=0.6)
            points = [
                plots.technique_colour(tq, r == b)
                for tq, r, b in zip(c["technique"], c[KEY.run], c[KEY.baseline])
            ]
            ax.scatter(x, y, color=points, zorder=3)
            plots.place_labels(ax, x[front], y[front], list(c[KEY.run][front]), fontsize=8)
            colours |= {
                ("baseline" if r == b else tq or "no technique"): p
                for tq, r, b, p in zip(c["technique"], c[KEY.run], c[KEY.baseline], points)
            }
        ax.axhline(1, color="gray", lw=0.8, ls="--")
        ax.axvline(1, color="gray", lw=0.8, ls="--")
        ax.set_title(f"{suite} ({t[KEY.model].iloc[0]})")
        ax.set_xlabel("peak memory × baseline")
        ax.set_ylabel("throughput × baseline")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(groups) :]:
        ax.set_visible(False)
    # Points off the front are identified by colour: their first technique, as in every report.
    handles = [
        plt.Line2D([], [], marker="o", ls="", color=colours[name], label=name)
        for name in sorted(colours)
    ]
    ncol = min(6, len(handles)) or 1
    fig.legend(
        handles=handles,
        loc="lower center",
        ncol=ncol,
        fontsize=8,
        title="first technique",
        bbox_to_anchor=(0.5, 0),
    )
    # the legend's share of the height
    below = (0.45 + 0.22 * np.ceil(len(handles) / ncol)) / fig.get_figheight()
    fig.suptitle(
        f"Every suite on {device}: up and left of the dashed cross is better than the baseline "
        "(front labelled)"
    )
    # room for the legend and the title
    fig.tight_layout(rect=(0, below, 1, 1 - 0.45 / fig.get_figheight()))
    plots.save(fig, path, dpi=110)
