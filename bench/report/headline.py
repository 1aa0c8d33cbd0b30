"""What to use, in plain words: per device, the picks among a suite's runs, and how much of the
suite the device has measured. The first screen of every report and the overview's table both come
from here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from bench.record import KEY, Phase, Status
from bench.report.tables import busy_runs

if TYPE_CHECKING:
    from bench.spec import Suite

NEAR_FREE = 0.95  # "costs nothing": throughput within 5% of the baseline's
SAVES = 0.99  # a saving: at most 99% of the baseline's peak (1.00× is noise, allocator rounding)
PICKS = {
    "largest": "Largest saving",
    "free": f"Largest saving within {100 * (1 - NEAR_FREE):.0f}% of the baseline's throughput",
    "trade": "Best trade (most memory saved per throughput lost)",
}


def candidates(table: pd.DataFrame) -> pd.DataFrame:
    """Runs a practitioner could pick: measured, at the baseline's batch size (matrix rows that
    change the batch are left out), not known to hurt accuracy (a delta outside the baseline's
    band), whose accuracy was not refused (a fidelity phase that failed says nothing of it), and not
    timed on a busy machine (their throughput × is the neighbours' as much as theirs)."""
    base_batch = table.set_index(KEY.run)[KEY.batch_size].reindex(table[KEY.baseline]).to_numpy()
    refused = table.get(
        KEY.fidelity_error, pd.Series(None, index=table.index, dtype=object)
    ).notna()
    keep = (
        (table[KEY.status] == Status.OK)
        & ~refused
        & table["memory_vs_baseline"].notna()
        & table["throughput_vs_baseline"].notna()
        & (table[KEY.batch_size].to_numpy() == base_batch)
        & ~table["outside_band"].eq(True)
        & ~busy_runs(table)
    )
    out = table[keep].copy()
    saved, lost = 1 - out["memory_vs_baseline"], (1 - out["throughput_vs_baseline"]).clip(lower=0)
    # a free saving scores as if it cost 1%
    out["memory_per_throughput"] = saved / lost.clip(lower=0.01)
    return out


def picks(table: pd.DataFrame) -> dict[str, pd.Series | None]:
    """One device's table: the largest saving; the largest within 5% of the baseline's throughput;
    the most saving per throughput lost. Only runs that save memory (at most 0.99× the baseline's
    peak) are picked."""
    c = candidates(table)
    saving = c[c["memory_vs_baseline"] <= SAVES]
    cheap = saving[saving["throughput_vs_baseline"] >= NEAR_FREE]
    return {
        "largest": saving.loc[saving["memory_vs_baseline"].idxmin()] if len(saving) else None,
        "free": cheap.loc[cheap["memory_vs_baseline"].idxmin()] if len(cheap) else None,
        "trade": saving.loc[saving["memory_per_throughput"].idxmax()] if len(saving) else None,
    }


def pick_text(row: pd.Series | None) -> str:
    """A pick in plain words: the run, its memory ×, throughput × and accuracy effect."""
    if row is None:
        return "no run measured here qualifies"
    return (
        f"{row[KEY.run]}: {row['memory_vs_baseline']:.2f}× memory, "
        f"{row['throughput_vs_baseline']:.2f}× throughput, {accuracy_effect(row)}"
    )


def accuracy_effect(row: pd.Series) -> str:
    if pd.isna(row.get("accuracy_delta")):
        return "accuracy not measured here"
    if row.get("outside_band") is True:
        within = "outside the baseline's band ⚠"
    else:
        within = "within the baseline's band"
    return (
        f"accuracy {100 * row['accuracy_delta']:+.1f} pt ({within} "
        f"±{100 * row['accuracy_band']:.1f})"
    )


def suite_entries(name: str, suites_dir: Path = Path("suites")) -> int | None:
    """How many runs the suite file has today; None for a suite with records but no (valid) file
    here."""
    suite = suite_file(name, suites_dir)
    if suite is None:
        return None
    return len(suite.runs)


def suite_throughput(name: str, suites_dir: Path = Path("suites")) -> str:
    """The figure the suite compares as throughput × (its ``throughput`` key; samples/s without a
    file)."""
    suite = suite_file(name, suites_dir)
    if suite is None:
        return KEY.samples_per_s
    return suite.throughput


def suite_file(name: str, suites_dir: Path = Path("suites")) -> Suite | None:
    """The suite file as it is today; None for a suite with records but no (valid) file here."""
    from bench.suite import SuiteError, load

    try:
        return load(suites_dir / f"{name}.toml")
    except SuiteError:
        return None


def devices_best_first(table: pd.DataFrame, here: str | None = None) -> list[str]:
    """The devices of a table: ``here`` (the machine the page is built on) first, for the user who
    just measured on it; then GPUs before CPUs (a reader renting a card wants its figures first);
    legacy CPU names last."""
    kinds = table.groupby(KEY.device)[KEY.device_type].first()
    return sorted(
        kinds.index, key=lambda d: (d != here, legacy(str(d), kinds[d]), kinds[d] != "cuda", str(d))
    )


def this_machine() -> str:
    """The device a page built here puts first: this machine's GPU, else its CPU (as its records
    name it)."""
    import torch

    from bench.provenance import device_name

    return device_name("cuda" if torch.cuda.is_available() else "cpu")


def legacy(device: str, device_type: str) -> bool:
    """A CPU named before names carried the vector instructions its kernels use ("AMD EPYC, 2
    threads"): its records may mix machines whose bf16 speeds differ 25-fold, and no CPU measures
    under that name now."""
    return device_type != "cuda" and re.fullmatch(r".+, \d+ threads?", device) is not None


def device_title(device: str, device_type: str) -> str:
    """A device as a heading names it; a legacy CPU name says what it is."""
    if legacy(device, device_type):
        return (
            f"{device} (legacy: recorded before CPU names carried their vector instructions; it "
            "may mix machines, and no CPU measures under this name now)"
        )
    return device


def coverage(part: pd.DataFrame, entries: int | None) -> str:
    """How much of the suite a device has measured."""
    ok = int((part[KEY.status] == Status.OK).sum())
    if entries is None or len(part) >= entries:
        return f"{len(part)} runs recorded, {ok} ok"
    return (
        f"{len(part)} of the suite's {entries} entries recorded ({ok} ok); the rest not yet on "
        "this device"
    )


def headline(
    table: pd.DataFrame,
    entries: int | None,
    here: str | None = None,
    contexts: dict[str, dict[str, int | None]] | None = None,
) -> list[tuple[str, list[str]]]:
    """Per device, ``here`` first and then best first: its heading line (device, coverage, what its
    peak is) and its picks; a generation suite's first, the context each run holds (``contexts``:
    per card, each run's predicted longest context) and how fast it decodes."""
    out = []
    for device in devices_best_first(table, here):
        part = table[table[KEY.device] == device]
        title = device_title(str(device), part[KEY.device_type].iloc[0])
        items = generation_items(part, contexts or {}) + _items(picks(part))
        out.append(
            (f"{title}: {coverage(part, entries)}; memory is the {memory_figure(part)}", items)
        )
    return out


def generation_items(part: pd.DataFrame, contexts: dict[str, dict[str, int | None]]) -> list[str]:
    """A generation suite on one device: per card predicted, the run that holds the longest context;
    else the run whose cache costs least per token; and the fastest decoding. Each with its decoding
    rate here and against the baseline's."""
    if KEY.decode_tokens_per_s not in part:
        return []
    ok = part[(part[KEY.status] == Status.OK) & part[KEY.decode_tokens_per_s].notna()].set_index(
        KEY.run
    )
    if ok.empty:
        return []
    base = ok[KEY.decode_tokens_per_s].get(ok[KEY.baseline].iloc[0])
    per_token = ok[KEY.kv_cache_bytes] / (
        ok[KEY.batch_size] * (ok[KEY.prompt_len] + ok[KEY.new_tokens] - 1)
    )

    def speed(run: str) -> str:
        rate, first = ok.loc[run, KEY.decode_tokens_per_s], ok.loc[run, KEY.ttft_ms_median]
        if base:
            against = f" ({rate / base:.2f}× the baseline's)"
        else:
            against = ""
        return (
            f"decodes at {rate:,.0f} tokens/s here{against}, {first:,.0f} ms to the first token; "
            f"its cache {per_token[run] / 1024:,.1f} KiB a token"
        )

    items = []
    for card, held in contexts.items():
        known = {r: n for r, n in held.items() if r in ok.index and n}
        if known:
            run = max(known, key=lambda r: (known[r], ok.loc[r, KEY.decode_tokens_per_s]))
            items.append(
                f"**Longest context on {card} (predicted)**: {run}: {known[run]:,} tokens; "
                f"{speed(run)}"
            )
    if not items:
        run = per_token.idxmin()
        items.append(f"**Smallest cache a token**: {run}: {speed(run)}")
    fastest = ok[KEY.decode_tokens_per_s].idxmax()
    items.append(f"**Fastest decoding**: {fastest}: {speed(fastest)}")
    return items


def answer(table: pd.DataFrame, device: str, entries: int | None) -> str:
    """What to use on ``device``, as a sweep ends: its picks in plain text, for the terminal."""
    part = table[table[KEY.device] == device]
    if part.empty:
        return f"What to use on {device}: nothing measured there yet."
    lines = [item.replace("**", "") for item in generation_items(part, {}) + _items(picks(part))]
    return "\n".join(
        [
            f"What to use on {device} ({coverage(part, entries)}; against its baseline):",
            *(f"- {line}" for line in lines),
        ]
    )


def memory_figure(part: pd.DataFrame) -> str:
    """What one device's memory figures are: the CUDA allocator's peak or the tracked one, at the
    baseline's batch."""
    if part[KEY.device_type].iloc[0] == "cuda":
        peak = "allocator peak"
    else:
        peak = "tracked peak of live tensors"
    batch = part.loc[part[KEY.run] == part[KEY.baseline], KEY.batch_size]
    return peak + (
        f", batch {int(batch.iloc[0])}" if len(batch) and pd.notna(batch.iloc[0]) else ""
    )


# memory × apart by this much on a GPU and a CPU: the two stories differ, and the reader is told why
DISAGREE = 0.2
PHASES = {
    Phase.FORWARD: "the forward",
    Phase.BACKWARD: "backward",
    Phase.OPTIMIZER: "the optimizer step",
}


def disagreements(table: pd.DataFrame, shown: int = 3) -> list[str]:
    """Runs whose memory × on a GPU and on a CPU differ by at least DISAGREE, largest first, each
    with where its peak fell on each: a technique saves at the peak only what is alive there
    (checkpointing saves nothing when the peak is the optimizer step, as at small CPU shapes)."""
    kinds = table.groupby(KEY.device)[KEY.device_type].first()
    gpus = [d for d in kinds.index if kinds[d] == "cuda"]
    cpus = [d for d in kinds.index if kinds[d] != "cuda"]
    if not gpus or not cpus:
        return []
    gpu, cpu = (table[table[KEY.device] == d].set_index(KEY.run) for d in (gpus[0], cpus[0]))
    both = gpu.index.intersection(cpu.index)
    gap = (gpu.loc[both, "memory_vs_baseline"] - cpu.loc[both, "memory_vs_baseline"]).abs().dropna()
    lines = []
    for run in gap[gap >= DISAGREE].sort_values(ascending=False).index[:shown]:
        g, c = gpu.loc[run], cpu.loc[run]
        lines.append(
            f"**{run}**: {g['memory_vs_baseline']:.2f}× memory on {gpus[0]} (batch "
            f"{int(g[KEY.batch_size])}) against {c['memory_vs_baseline']:.2f}× on {cpus[0]} (batch "
            f"{int(c[KEY.batch_size])}): " + _why(g, c, gpus[0], cpus[0])
        )
    return lines


def _why(gpu: pd.Series, cpu: pd.Series, gpu_name: str, cpu_name: str) -> str:
    phases = gpu.get(KEY.peak_phase), cpu.get(KEY.peak_phase)
    if any(pd.isna(p) for p in phases) or phases[0] == phases[1]:
        return "the shapes differ, and with them what dominates the peak"
    return (
        f"its peak falls in {PHASES.get(phases[0], phases[0])} on {gpu_name} and in "
        f"{PHASES.get(phases[1], phases[1])} on {cpu_name}, so what it saves is alive at one peak "
        "and not the other"
    )


def _items(chosen: dict[str, pd.Series | None]) -> list[str]:
    """One line per picked run, naming every pick it is (one run is often the largest saving and the
    best trade)."""
    runs: dict[str | None, list[str]] = {}
    for key, row in chosen.items():
        runs.setdefault(None if row is None else row[KEY.run], []).append(key)
    rows = {None if row is None else row[KEY.run]: row for row in chosen.values()}
    return [
        f"**{'; '.join(PICKS[k] for k in keys)}**: {pick_text(rows[run])}"
        for run, keys in runs.items()
    ]
