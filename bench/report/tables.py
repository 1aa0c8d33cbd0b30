"""The summary table: one row per run, figures relative to the run's baseline on the same device."""

from __future__ import annotations

import numpy as np
import pandas as pd

from bench import record
from bench.record import DERIVED, KEY, Prediction, Status

# The record's columns, then the ratios computed here against each run's baseline.
COLUMNS = [
    *record.COLUMNS,
    "memory_vs_baseline",
    "throughput_vs_baseline",
    *DERIVED,
    "predicted_vs_measured",
    "reserved_predicted_vs_measured",
    "nvml_predicted_vs_measured",
]


def peak_bytes(df: pd.DataFrame) -> pd.Series:
    """The peak to compare runs by: CUDA's allocated peak where measured, else tracked live tensor
    bytes."""
    allocated = df.get(KEY.peak_allocated_bytes, pd.Series(index=df.index, dtype=float))
    return allocated.fillna(df.get(KEY.peak_tensor_bytes, pd.Series(index=df.index, dtype=float)))


def summary(df: pd.DataFrame, throughput: str = KEY.samples_per_s) -> pd.DataFrame:
    """The records as the reports' table, with each run's memory × and throughput × against its
    baseline on the same device; ``throughput``: the figure compared (the suite's, e.g. real
    tokens/s for variable-length data)."""
    df = df.copy()
    for col in COLUMNS:
        if col not in df:
            df[col] = None
        if col.endswith(("_bytes", "_s", "_median", "_p25", "_p75")):
            df[col] = pd.to_numeric(df[col], errors="coerce")  # absent figures become NaN, not 0
    df["peak_bytes"] = peak_bytes(df)
    base = df.set_index([KEY.device, KEY.run])
    keys = list(zip(df[KEY.device], df[KEY.baseline]))
    ok = base[KEY.status] == Status.OK
    base_peak = base["peak_bytes"].where(ok).reindex(keys).to_numpy()
    base_tput = base[throughput].where(ok).reindex(keys).to_numpy()
    df["memory_vs_baseline"] = df["peak_bytes"] / base_peak
    df["throughput_vs_baseline"] = df[throughput] / base_tput
    # On CUDA the allocated peak, cuBLAS's workspaces with the tensors, where the prediction gave it
    predicted = pd.to_numeric(df[KEY.predicted_peak_allocated_bytes], errors="coerce").where(
        df[KEY.peak_allocated_bytes].notna()
    )
    predicted = predicted.fillna(
        pd.to_numeric(df[KEY.predicted_peak_tensor_bytes], errors="coerce")
    )
    df["predicted_vs_measured"] = predicted / df["peak_bytes"]
    for name, measured in (("reserved", KEY.peak_reserved_bytes), ("nvml", KEY.nvml_process_bytes)):
        guess = pd.to_numeric(df[Prediction.prefix + measured], errors="coerce")
        df[f"{name}_predicted_vs_measured"] = guess / pd.to_numeric(df[measured], errors="coerce")
    packages = sorted(c for c in df.columns if c.startswith("package."))
    extra = packages + [c for c in df.columns if c.startswith("proof.")]
    if KEY.run_index in df:
        order = df[KEY.run_index]
    else:
        order = pd.Series(0, index=df.index)
    df = df.assign(_order=order).sort_values([KEY.device, "_order", KEY.run])
    df[KEY.step_times_ms] = df.get(KEY.step_times_ms)
    df["technique"] = df.get("technique")
    return df[
        COLUMNS + ["peak_bytes", KEY.baseline, "technique", KEY.step_times_ms] + extra
    ].reset_index(drop=True)


def pareto_front(memory: np.ndarray, throughput: np.ndarray) -> np.ndarray:
    """True for each point no other point beats: as little memory or less and as much throughput or
    more, strictly better in one."""
    m, t = np.asarray(memory, dtype=float), np.asarray(throughput, dtype=float)
    no_worse = (m[None, :] <= m[:, None]) & (t[None, :] >= t[:, None])
    better = (m[None, :] < m[:, None]) | (t[None, :] > t[:, None])
    return ~(no_worse & better).any(axis=1)


def savings(table: pd.DataFrame) -> pd.DataFrame:
    """Against the baseline, largest saving first: memory and throughput as × and %, accuracy with
    its band. Runs without figures are left to the list of failed runs."""
    ok = table[(table[KEY.status] == Status.OK) & table["memory_vs_baseline"].notna()]
    ok = ok.sort_values("memory_vs_baseline", kind="stable")
    return pd.DataFrame(
        {
            KEY.run: ok[KEY.run],
            "memory ×": ok["memory_vs_baseline"].round(3),
            "memory saved %": (100 * (1 - ok["memory_vs_baseline"])).round(1)
            + 0.0,  # + 0.0: never "-0.0"
            "throughput ×": ok["throughput_vs_baseline"].round(3),
            "throughput change %": (100 * (ok["throughput_vs_baseline"] - 1)).round(1) + 0.0,
            "Δ accuracy pt (band)": ok.apply(_delta_cell, axis=1) if len(ok) else None,
        }
    )


def _delta_cell(row: pd.Series) -> str | None:
    if pd.isna(row.get("accuracy_delta")):
        return None
    if row["outside_band"]:
        flag = " ⚠"
    else:
        flag = ""
    return f"{100 * row['accuracy_delta']:+.1f} ±{100 * row['accuracy_band']:.1f}{flag}"


def markdown(table: pd.DataFrame) -> str:
    return to_markdown(display(table))


def prediction_exact(table: pd.DataFrame) -> bool:
    """Every predicted run's prediction equals its measured peak (a CPU's, where both count the same
    live tensors): a column of 1.000s says nothing that one sentence does not."""
    ratios = pd.to_numeric(table["predicted_vs_measured"], errors="coerce").dropna()
    return len(ratios) > 0 and bool((ratios.round(3) == 1).all())


def display(table: pd.DataFrame) -> pd.DataFrame:
    """The human-facing table: MiB, ratios and statuses, one line per run; columns no run has are
    left out (e.g. no CUDA columns for a CPU)."""
    show = pd.DataFrame(
        {
            KEY.run: table[KEY.run],
            "batch": table[KEY.batch_size],
            KEY.status: table[KEY.status].where(
                table[KEY.fidelity_error].isna(), table[KEY.status] + ", fidelity failed"
            ),
            "peak MiB": (table["peak_bytes"] / 2**20).round(1),
            "peak in": table[KEY.peak_phase],
            "activations MiB": (table[KEY.activation_bytes] / 2**20).round(1),
            "prefill MiB": (
                pd.to_numeric(table[KEY.peak_prefill_bytes], errors="coerce") / 2**20
            ).round(1),
            "decode MiB": (
                pd.to_numeric(table[KEY.peak_decode_bytes], errors="coerce") / 2**20
            ).round(1),
            "cache MiB": (pd.to_numeric(table[KEY.kv_cache_bytes], errors="coerce") / 2**20).round(
                2
            ),
            "ranks": pd.to_numeric(table[KEY.world_size], errors="coerce").astype("Int64"),
            # Shown in suites with multi-process runs, for every run there (the single-process one
            # included).
            "model states MiB/rank": (table[KEY.model_state_bytes] / 2**20).round(2)
            if table[KEY.world_size].notna().any()
            else None,
            "reserved MiB": (table[KEY.peak_reserved_bytes] / 2**20).round(1),
            "nvidia-smi MiB": (
                pd.to_numeric(table[KEY.nvml_process_bytes], errors="coerce") / 2**20
            ).round(1),
            "samples/s": table[KEY.samples_per_s].round(1),
            "first token ms": pd.to_numeric(table[KEY.ttft_ms_median], errors="coerce").round(1),
            "decode tokens/s": pd.to_numeric(table[KEY.decode_tokens_per_s], errors="coerce").round(
                0
            ),
            "real tokens/s": pd.to_numeric(table[KEY.real_tokens_per_s], errors="coerce").round(0),
            "padding %": (100 * pd.to_numeric(table[KEY.padding_fraction], errors="coerce")).round(
                1
            ),
            "loader wait ms": pd.to_numeric(
                table[KEY.loader_wait_ms_median], errors="coerce"
            ).round(2),
            "step ms (median)": table[KEY.step_time_ms_median].round(1),
            "memory ×": table["memory_vs_baseline"].round(3),
            "throughput ×": _throughput_cell(table),
            "accuracy %": (100 * pd.to_numeric(table[KEY.accuracy], errors="coerce")).round(1),
            "Δ accuracy pt (band)": table.apply(_delta_cell, axis=1) if len(table) else None,
            "grad cos": pd.to_numeric(table[KEY.grad_cosine], errors="coerce").round(4),
            "agreement %": (
                100 * pd.to_numeric(table[KEY.fidelity_agreement], errors="coerce")
            ).round(1),
            "predicted ×": None
            if prediction_exact(table)
            else table["predicted_vs_measured"].round(3),
            "reserved predicted ×": table["reserved_predicted_vs_measured"].round(3),
            "nvidia-smi predicted ×": table["nvml_predicted_vs_measured"].round(3),
            "MFU %": (100 * pd.to_numeric(table[KEY.mfu], errors="coerce")).round(1),
        }
    )
    return show.dropna(axis=1, how="all")


def _throughput_cell(table: pd.DataFrame) -> pd.Series:
    """Throughput ×, marked where the run (or its baseline) was measured on a busy machine."""
    ratio = table["throughput_vs_baseline"].round(3)
    busy = busy_runs(table)
    return ratio.astype(object).where(~busy | ratio.isna(), ratio.astype(str) + " (busy ⚠)")


def busy_runs(table: pd.DataFrame) -> pd.Series:
    """Runs whose throughput × rests on steps timed on a busy machine: their own, or their
    baseline's."""
    busy = table[KEY.busy_machine].eq(True)
    base = table.set_index([KEY.device, KEY.run])[KEY.busy_machine].eq(True)
    return busy | pd.Series(
        base.reindex(list(zip(table[KEY.device], table[KEY.baseline]))).fillna(False).to_numpy(),
        index=table.index,
    ).astype(bool)


def to_markdown(df: pd.DataFrame) -> str:
    """A GitHub table; missing values shown as '–' (absent, not zero)."""
    cells = df.astype(object).where(df.notna(), "–").astype(str)
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(row) + " |" for row in cells.itertuples(index=False)]
    return "\n".join(lines)
