"""results/<suite>/ → table.csv, report.md and plots/*.png."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from bench.report import plots, tables
from bench.results import load_records, slug, to_frame


def build_report(suite_dir: Path) -> list[Path]:
    """Aggregate every stored record of the suite; returns the files written."""
    records = load_records(suite_dir)
    if not records:
        raise FileNotFoundError(f"no records under {suite_dir}/*/; run `make bench SUITE={suite_dir.name}` first")
    table = tables.summary(to_frame(records))
    plot_dir = suite_dir / "plots"
    plot_dir.mkdir(exist_ok=True)
    written = [suite_dir / "table.csv", suite_dir / "report.md"]
    table.to_csv(written[0], index=False)
    for device, part in table.groupby("device", sort=True):
        written += _device_plots(plot_dir, str(device), part)
    written[1].write_text(_markdown(suite_dir.name, table, records, written[2:], suite_dir))
    return written


def _device_plots(plot_dir: Path, device: str, part: pd.DataFrame) -> list[Path]:
    out = []
    for name, draw in (("peak_memory", plots.peak_memory_bars), ("memory_vs_throughput", plots.memory_vs_throughput)):
        fig, ax = plt.subplots(figsize=(8, 0.35 * len(part) + 2.5) if name == "peak_memory" else (8, 5.5))
        draw(ax, part, f"{part['suite'].iloc[0]} on {device}")
        fig.tight_layout()
        path = plot_dir / f"{name}-{slug(device)}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        out.append(path)
    return out


def _markdown(suite: str, table: pd.DataFrame, records: list[dict], images: list[Path], root: Path) -> str:
    lines = [f"# {suite}: memory-saving techniques", ""]
    for device, part in table.groupby("device", sort=True):
        rec = next(r for r in records if r["device"] == device)
        lines += [f"## {device}", "", _provenance(rec, part), "", tables.markdown(part), ""]
        failed = part[part["status"] != "ok"]
        lines += [f"- **{r.run}**: {r.status}: {r.message}" for r in failed.itertuples()] + [""]
        base = next((r for r in records if r["device"] == device and r["run"] == r.get("baseline")), rec)
        lines += [_fidelity_line(base), ""] if base.get("fidelity_model") else []
        lines += [f"![{p.stem}]({p.relative_to(root)})" for p in images if slug(str(device)) in p.stem] + [""]
    lines += [
        "Peak memory: CUDA's `max_memory_allocated` over the timed steps on GPUs; on CPUs the peak of live "
        "tensor bytes over one instrumented step (`peak in`: the phase of the step where it happened). "
        "Activations: bytes a forward leaves alive for backward. Throughput: batch size over the median "
        "step time of the timed steps, after warm-up. Ratios (×) are against the suite's baseline on the "
        "same device. `results/README.md` explains every column.",
        "",
        "Accuracy (where a fidelity phase ran): after the measured steps, each run's process trains the model "
        "named above with the run's techniques on the training split, from the same initial weights and in the "
        "same data order as the baseline, then evaluates on the held-out split (inference suites: the plain "
        "model is trained, then evaluated under the run's techniques; `agreement` is the share of predictions "
        "equal to the fp32 model's). Δ accuracy is in points against the baseline; the band (±) is the spread "
        "(max − min) of the baseline's accuracy over its seeds, and ⚠ marks a delta outside it. `grad cos` is "
        "the cosine similarity of the run's first-step gradient to the plain model's on the same batch.",
    ]
    return "\n".join(lines) + "\n"


def _fidelity_line(rec: dict) -> str:
    return (f"Fidelity phase: {rec['fidelity_model']} on {rec['fidelity_dataset']} "
            f"({rec.get('fidelity_train_size')} training / {rec.get('fidelity_test_size')} held-out samples), "
            f"{rec.get('fidelity_steps')} steps; baseline over {len(rec.get('accuracy_seeds') or [1])} seeds.")


def _provenance(rec: dict, part: pd.DataFrame) -> str:
    versions = f"torch {rec.get('torch_version')}" + (f", CUDA {rec['cuda_version']}" if rec.get("cuda_version") else "")
    return (f"Device: {rec['device']} · {versions} · revision {_short(rec.get('git_revision'))} · "
            f"seed {rec.get('seed')} · warm-up {rec.get('warmup_steps')} + {rec.get('measure_steps')} measured steps · "
            f"{len(part)} runs, {int((part['status'] == 'ok').sum())} ok")


def _short(revision: str | None) -> str:
    rev, dirty, _ = str(revision).partition("-dirty")
    return rev[:12] + ("-dirty" if dirty else "")
