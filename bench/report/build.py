"""results/<suite>/ → table.csv, report.md, report.html and plots/*.{png,svg}."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from bench.record import KEY, Status
from bench.report import plots, tables
from bench.report.headline import (
    device_title,
    devices_best_first,
    disagreements,
    headline,
    memory_figure,
    suite_entries,
    suite_file,
    suite_throughput,
    this_machine,
)
from bench.report.page import Block, html_page, markdown
from bench.results import (
    CURVES,
    PREDICTED,
    load_records,
    read_contexts,
    slug,
    to_frame,
    write_atomic,
)

Draw = Callable[[plt.Axes, pd.DataFrame, str], None]


THROUGHPUT_SAID = {
    KEY.samples_per_s: "samples a second",
    KEY.tokens_per_s: "tokens a second, padding included",
    KEY.real_tokens_per_s: "real tokens a second, padding left out (the suite's `throughput`)",
}


HEADLINE_NOTE = (
    "Picks among the runs at the baseline's batch size that save memory (at most 0.99× the "
    "baseline's peak) and whose accuracy delta, where measured, lies within the baseline's "
    "seed-to-seed band; ratios are against the baseline on the same device. The tables below have "
    "every run."
)


EXPLAINED = [
    "**Peak memory**: CUDA's `max_memory_allocated` over the timed steps on GPUs; on CPUs the peak "
    "of live tensor bytes over one instrumented step (`peak in`: the phase of the step where it "
    "happened). Activations: bytes a forward leaves alive for backward. Throughput: batch size "
    "over the median step time of the timed steps, after warm-up. Ratios (×) are against the "
    "suite's baseline on the same device. `results/README.md` explains every column.",
    "**Breakdown**: what was alive at the peak of the instrumented step, by what holds it: "
    "parameters, buffers, gradients, optimizer state, activations (made by the forward, the input "
    "batch included, and still alive) and temporaries (made in backward or the optimizer step: "
    "gradients of activations, recomputed activations, update buffers). The parts sum to the "
    "tracked peak; on CUDA the allocator's cache slack (reserved − allocated) is stacked on top.",
    "**Pareto plot**: a run is on the front when no other run needs less memory and gives more "
    "throughput. Up and to the left is better. The marker says whether its accuracy delta lies "
    "within the baseline's noise band. Colours follow the run's first technique and are the same "
    "in every plot and suite.",
    "**Accuracy** (where a fidelity phase ran): after the measured steps, each run's process "
    "trains the model named above with the run's techniques on the training split, from the same "
    "initial weights and in the same data order as the baseline, then evaluates on the held-out "
    "split (inference suites: the plain model is trained, then evaluated under the run's "
    "techniques; `agreement` is the share of predictions equal to the fp32 model's). Δ accuracy is "
    "in points against the baseline; the band (±) is the spread (max − min) of the baseline's "
    "accuracy over its seeds, and ⚠ marks a delta outside it. `grad cos` is the cosine similarity "
    "of the run's first-step gradient to the plain model's on the same batch.",
    "**Step times**: every timed step as a box plot (quartiles; whiskers to 1.5 × IQR). A wide box "
    "is a noisy run; on a shared CPU, throughput ratios are indicative only.",
]


def build_report(suite_dir: Path, here: str | None = None) -> list[Path]:
    """Aggregate every stored record of the suite; returns the files written (table, Markdown, HTML,
    plots). ``here``: the device the report is built for (its section first), by default this
    machine's."""
    if here is None:
        here = this_machine()
    records = load_records(suite_dir)
    if not records:
        path = Path("suites") / f"{suite_dir.name}.toml"
        known = sorted({p.parent.parent.name for p in suite_dir.parent.glob("*/*/*.json")})
        if path.exists():
            hint = f"run `make bench SUITE={suite_dir.name}` first"
        else:
            hint = (
                f"there is no suite {path} either; "
                f"suites with records: {', '.join(known) or 'none'}"
            )
        raise FileNotFoundError(f"no records under {suite_dir}/*/; {hint}")
    throughput = suite_throughput(suite_dir.name)
    table = tables.summary(to_frame(records), throughput)
    plot_dir = suite_dir / "plots"
    plot_dir.mkdir(exist_ok=True)
    written = [suite_dir / "table.csv", suite_dir / "report.md", suite_dir / "report.html"]
    write_atomic(written[0], table.drop(columns=[KEY.step_times_ms]).to_csv(index=False))
    suite = suite_file(suite_dir.name)
    blocks = [
        Block("h1", f"{suite_dir.name}: memory-saving techniques"),
        Block("nav", _neighbours(suite_dir)),
        *([Block("p", suite.description + ".")] if suite and suite.description else []),
        Block("h2", "What to use"),
        Block(
            "headline",
            headline(table, suite_entries(suite_dir.name), here, read_contexts(suite_dir)),
        ),
        Block("p", f"{HEADLINE_NOTE} Throughput × compares {THROUGHPUT_SAID[throughput]}."),
    ]
    if differ := disagreements(table):
        blocks += [Block("p", "Where the GPU and the CPU disagree:"), Block("list", differ)]
    blocks += _predicted_for_gpu(suite_dir, table)
    curves = _length_curves(suite_dir, plot_dir)
    blocks += [block for _, block in curves]
    written += [p for png, _ in curves if png for p in (png, png.with_suffix(".svg"))]
    for device in devices_best_first(table, here):
        part = table[table[KEY.device] == device]
        images = device_plots(plot_dir, str(device), part)
        blocks += _device_section(str(device), part, records, images)
        written += [p for png in images for p in (png, png.with_suffix(".svg"))]
    blocks += [Block("h2", "How these figures were measured"), *[Block("p", t) for t in EXPLAINED]]
    write_atomic(written[1], markdown(blocks, suite_dir))
    write_atomic(written[2], html_page(blocks, f"{suite_dir.name}: memory-saving techniques"))
    for stale in (set(plot_dir.glob("*.png")) | set(plot_dir.glob("*.svg"))) - set(written):
        stale.unlink()  # plots of views or devices no longer in the records
    return written


def _predicted_for_gpu(suite_dir: Path, table: pd.DataFrame) -> list[Block]:
    """The suite's runs that no GPU has measured, with their predicted peaks at GPU shapes (``make
    predict`` writes them beside the records): what a card would need, before one is rented."""
    path = suite_dir / PREDICTED
    if not path.exists():
        return []
    predicted = pd.read_csv(path)
    measured = set(
        table.loc[(table[KEY.device_type] == "cuda") & (table[KEY.status] == Status.OK), KEY.run]
    )
    rest = predicted[~predicted[KEY.run].isin(measured)]
    if rest.empty:
        return []
    how = (
        f"predicted on fake tensors by `make predict SUITE={suite_dir.name}` (revision "
        f"{str(predicted[KEY.git_revision].iloc[0])[:12]}, torch "
        f"{predicted[KEY.torch_version].iloc[0]}); a GPU's allocated peak has come within a few "
        "percent of such predictions on the H100 records"
    )
    gib = lambda col: (pd.to_numeric(rest.get(col), errors="coerce") / 2**30).round(2)  # noqa: E731
    shown = pd.DataFrame(
        {
            KEY.run: rest[KEY.run],
            "batch": rest["batch"],
            KEY.status: rest[KEY.status],
            "predicted peak GiB": gib(KEY.peak_tensor_bytes),
            "peak in": rest.get(KEY.peak_phase),
            "activations GiB": gib(KEY.activation_bytes),
            "prefill GiB": gib(KEY.peak_prefill_bytes),  # a generation's phases and cache
            "decode GiB": gib(KEY.peak_decode_bytes),
            "cache GiB": gib(KEY.kv_cache_bytes),
            "note": rest.get(KEY.message, pd.Series(index=rest.index, dtype=object)).fillna(""),
        }
    )
    shown = shown.loc[:, shown.notna().any()]
    return [
        Block("h2", "Not yet measured on a GPU"),
        Block(
            "p",
            f"{len(rest)} of the suite's {len(predicted)} entries have no GPU record; their peaks "
            f"at the suite's GPU shapes, {how}.",
        ),
        Block("table", shown),
    ]


def _length_curves(suite_dir: Path, plot_dir: Path) -> list[tuple[Path | None, Block]]:
    """Per card, each run's longest sequence and the lengths its search predicted on the way
    (``bench predict --card NAME --longest`` saves them beside the records): a section's blocks,
    each with the plot it shows (None for text)."""
    out: list[tuple[Path | None, Block]] = []
    for path in sorted(suite_dir.glob(CURVES.format(card="*"))):
        curves = pd.read_csv(path)
        card = str(curves["card"].iloc[0])
        fig, ax = plt.subplots(figsize=(8, 5))
        plots.length_curves(ax, curves, f"{suite_dir.name}: the longest sequence on {card}")
        fig.tight_layout()
        png = plot_dir / f"lengths-{slug(card)}.png"
        plots.save(fig, png)
        answers = curves.groupby(KEY.run, sort=False)["longest_sequence"].first()
        said = [
            f"`{run}`: {'none fits' if pd.isna(n) else f'{int(n):,} tokens'}"
            for run, n in answers.items()
        ]
        how = (
            f"predicted on fake tensors by `bench predict --card {path.stem.split('-', 1)[1]} "
            f"--longest` (revision {str(curves[KEY.git_revision].iloc[0])[:12]}, torch "
            f"{curves[KEY.torch_version].iloc[0]}), each step replayed through the caching "
            "allocator; the lengths past the first three traced are read off the curve through "
            "them, and each answer is traced again"
        )
        out += [
            (None, Block("h2", f"The longest sequence on the {card}")),
            (None, Block("p", f"At each run's batch, {how}: " + "; ".join(said) + ".")),
            (png, Block("image", png)),
        ]
    return out


def _neighbours(suite_dir: Path) -> list[tuple[str, str]]:
    """The overview and the other suites' reports in the same results folder."""
    others = sorted(
        p.name
        for p in suite_dir.parent.iterdir()
        if p.is_dir() and p != suite_dir and any(p.glob("*/*.json"))
    )
    return [("overview", "../overview/overview")] + [(name, f"../{name}/report") for name in others]


def device_plots(plot_dir: Path, device: str, part: pd.DataFrame) -> list[Path]:
    """The plots that have something to show for this device, each as PNG and SVG; returns the
    PNGs."""
    title = f"{part[KEY.suite].iloc[0]} on {device}"
    views: list[tuple[str, Draw, tuple[float, float]]] = [
        ("pareto", plots.pareto, (9, 6.5)),
        ("peak_memory", plots.peak_memory_bars, (8, 0.3 * len(part) + 2)),
    ]
    if broken_down := len(plots.breakdown_frame(part)):
        views.append(("breakdown", plots.breakdown_bars, (9, 0.3 * broken_down + 2)))
    if part[KEY.step_times_ms].map(lambda v: isinstance(v, list)).any():
        views.append(("step_times", plots.step_time_boxes, (8, 0.3 * len(part) + 2)))
    predicted = int(
        (part[KEY.predicted_peak_tensor_bytes].notna() & part["peak_bytes"].notna()).sum()
    )
    if predicted and not tables.prediction_exact(part):
        views.append(
            ("predicted_vs_measured", plots.predicted_vs_measured, (7, 0.3 * predicted + 2))
        )
    out = []
    for name, draw, size in views:
        fig, ax = plt.subplots(figsize=size)
        draw(ax, part, title)
        fig.tight_layout()
        path = plot_dir / f"{name}-{slug(device)}.png"
        plots.save(fig, path)
        out.append(path)
    return out


def _device_section(
    device: str, part: pd.DataFrame, records: list[dict], images: list[Path]
) -> list[Block]:
    rec = next(r for r in records if r[KEY.device] == device)
    base = next(
        (r for r in records if r[KEY.device] == device and r[KEY.run] == r.get(KEY.baseline)), rec
    )
    failed = part[part[KEY.status] != Status.OK]
    title = device_title(device, part[KEY.device_type].iloc[0])
    blocks = [
        Block("h2", title),
        Block(
            "p",
            f"Memory here is the {memory_figure(part)} (a run's own batch where its name says so); "
            "× is against the baseline on this device.",
        ),
        Block("p", provenance(part, rec)),
        Block("table", tables.display(part)),
    ]
    if len(failed):
        blocks.append(
            Block("list", [f"**{r.run}**: {r.status}: {r.message}" for r in failed.itertuples()])
        )
    if len(no_accuracy := part[part[KEY.fidelity_error].notna()]):
        # measured, but its accuracy is missing
        blocks.append(
            Block(
                "list",
                [
                    f"**{r.run}**: fidelity phase failed: {r.fidelity_error}"
                    for r in no_accuracy.itertuples()
                ],
            )
        )
    if len(warned := part[part[KEY.warning].notna()]):
        blocks.append(Block("list", [f"**{r.run}**: {r.warning}" for r in warned.itertuples()]))
    if base.get(KEY.fidelity_model):
        blocks.append(Block("p", _fidelity_line(base)))
    if tables.prediction_exact(part):
        blocks.append(
            Block(
                "p",
                f"Prediction: each of the {int(part['predicted_vs_measured'].notna().sum())} "
                "predicted runs' peak, predicted on fake tensors before it ran, equals its "
                "measured peak to the byte, as it should on a CPU, where both count the same live "
                "tensors; on CUDA the prediction models the allocator (`make predict`).",
            )
        )
    if monitors := _monitor_links(records, device):
        blocks.append(
            Block(
                "p",
                "The allocator's own account of each run's timed steps "
                f"(`torch.cuda.memory_summary()`, the seed article's monitor): {monitors}.",
            )
        )
    blocks += [
        Block("h3", "Against the baseline, largest memory saving first"),
        Block("table", tables.savings(part)),
    ]
    measured = set(part.loc[part[KEY.status] == Status.OK, KEY.run])
    no_breakdown = sorted(measured - set(plots.breakdown_frame(part).index))
    if any("breakdown" in p.stem for p in images) and no_breakdown:
        blocks.append(
            Block(
                "p",
                "No at-peak breakdown (a compiled model the tracker cannot see, or a record older "
                f"than the breakdown): {', '.join(no_breakdown)}.",
            )
        )
    return blocks + [Block("image", p) for p in images]


def _monitor_links(records: list[dict], device: str) -> str:
    """Links to the files saved beside this device's records: memory summaries, and snapshots for
    memory_viz."""
    folder = slug(device)
    return ", ".join(
        f"[{r[KEY.run]}]({folder}/{r[KEY.memory_summary]})"
        + (f" ([snapshot]({folder}/{r[KEY.snapshot]}))" if r.get(KEY.snapshot) else "")
        for r in sorted(records, key=lambda r: r.get(KEY.run_index, 0))
        if r[KEY.device] == device and r.get(KEY.memory_summary)
    )


def provenance(part: pd.DataFrame, rec: dict) -> str:
    """How the figures were obtained: device, software, when, from which revision(s)."""
    packages = [KEY.torch_version, *sorted(c for c in part.columns if c.startswith("package."))]
    versions = ", ".join(
        f"{c.removeprefix('package.').removesuffix('_version')} {v}"
        for c in packages
        for v in sorted(part[c].dropna().unique())
    )
    if rec.get(KEY.cuda_version):
        versions += f", CUDA {rec[KEY.cuda_version]}"
    dates = sorted(str(d)[:10] for d in part[KEY.finished_at].dropna())
    when = ""
    if dates:
        when = f"measured {dates[0]}" + (f" to {dates[-1]}" if dates[-1] != dates[0] else "")
    revisions = ", ".join(sorted({_short(r) for r in part[KEY.git_revision].dropna()}))
    return (
        f"Device: {rec[KEY.device]} · {versions} · {when} · revision {revisions or 'unknown'} · "
        f"seed {rec.get(KEY.seed)}{_weights(part)} · warm-up {rec.get(KEY.warmup_steps)} + "
        f"{rec.get(KEY.measure_steps)} measured steps · {len(part)} runs, "
        f"{int((part[KEY.status] == Status.OK).sum())} ok" + _run_time(part)
    )


def _weights(part: pd.DataFrame) -> str:
    """The pretrained weights the runs started from, with their digests; nothing for random
    weights."""
    loaded = part.dropna(subset=[KEY.weights])
    return "".join(
        f" · weights {w} (sha256 {h})"
        for w, h in sorted(set(zip(loaded[KEY.weights], loaded[KEY.weights_sha256])))
    )


def _run_time(part: pd.DataFrame) -> str:
    """The runs' process time added up: what a sweep of these runs costs on this device."""
    if part[KEY.wall_s].isna().all():
        return ""  # records from before run times were kept
    seconds = int(part[KEY.wall_s].sum())
    missing = int(part[KEY.wall_s].isna().sum())
    return f" · {seconds // 60} min {seconds % 60:02d} s of runs" + (
        f" ({missing} without a time)" if missing else ""
    )


def _fidelity_line(rec: dict) -> str:
    if rec.get(KEY.fidelity_weights):
        start = f" from {rec[KEY.fidelity_weights]}"
    else:
        start = ""
    return (
        f"Fidelity phase: {rec[KEY.fidelity_model]}{start} on {rec[KEY.fidelity_dataset]} "
        f"({rec.get(KEY.fidelity_train_size)} training / {rec.get(KEY.fidelity_test_size)} "
        f"held-out samples), {rec.get(KEY.fidelity_steps)} steps; baseline over "
        f"{len(rec.get(KEY.accuracy_seeds) or [1])} seeds."
    )


def _short(revision: str | None) -> str:
    rev, dirty, _ = str(revision).partition("-dirty")
    return rev[:12] + ("-dirty" if dirty else "")
