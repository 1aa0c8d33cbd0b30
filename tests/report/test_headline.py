"""The picks and the first screen of every report: what to use, per device, GPUs first."""

import pandas as pd

from bench import results
from bench.predict.table import save
from bench.report import build_report
from bench.report.headline import headline, picks
from bench.report.tables import display, summary
from bench.results import PREDICTED
from tests.report.test_overview import RUNS, rec


def test_picks_skip_harmful_and_other_batch_runs():
    table = summary(results.to_frame(RUNS))
    best = {k: (v["run"] if v is not None else None) for k, v in picks(table).items()}
    assert best == {"largest": "deep", "free": "free", "trade": "ratio"}


def test_a_run_that_saves_nothing_is_never_picked():
    """dist-smoke's ddp-bucket-view at 0.998× was once 'the largest saving within 5% of the
    throughput'."""
    table = summary(
        results.to_frame([rec("a", "baseline", 1000, 100.0), rec("a", "same", 998, 130.0)])
    )
    assert picks(table) == {"largest": None, "free": None, "trade": None}
    assert headline(table, None)[0][1] == [
        "**Largest saving; Largest saving within 5% of the baseline's throughput; Best trade (most "
        "memory saved per throughput lost)**: no run measured here qualifies"
    ]


def test_a_run_whose_fidelity_phase_failed_is_never_picked():
    """resnet's share-layers ended "ok, fidelity failed" and was then named the best trade,
    "accuracy not measured here": a pick never rests on an entry whose accuracy was refused."""
    refused = rec("a", "shared", 500, 100.0) | {
        "fidelity_error": "share-layers: no identical blocks"
    }
    runs = [rec("a", "baseline", 1000, 100.0), refused, rec("a", "half", 700, 90.0)]
    best = {k: v["run"] for k, v in picks(summary(results.to_frame(runs))).items() if v is not None}
    assert best == {"largest": "half", "trade": "half"}


def test_the_first_screen_answers_per_device_gpu_first_with_coverage_and_picks(tmp_path):
    gpu = {"device": "NVIDIA X", "device_type": "cuda"}
    runs = [r | {"suite": "s"} for r in RUNS] + [
        rec("s", "baseline", 400, 50.0) | gpu,
        rec("s", "ratio", 200, 45.0) | gpu,
    ]
    runs[-2]["peak_allocated_bytes"] = runs[-2].pop("peak_tensor_bytes")
    runs[-1]["peak_allocated_bytes"] = runs[-1].pop("peak_tensor_bytes")
    for r in runs:
        results.write_atomic(results.record_path(tmp_path, "s", r["device"], r["run"]), r)
    build_report(tmp_path / "s")
    text = (tmp_path / "s" / "report.md").read_text()
    # everything before the first device's tables
    first_screen = text[: text.index("\n## NVIDIA X")]
    assert "[overview](../overview/overview.md)" in first_screen
    gpu_at = first_screen.index(
        "**NVIDIA X: 2 runs recorded, 2 ok; memory is the allocator peak, batch 8**"
    )
    cpu_at = first_screen.index(
        "**cpu: 6 runs recorded, 6 ok; memory is the tracked peak of live tensors, batch 8**"
    )
    assert gpu_at < cpu_at  # the card before the CPU
    assert "ratio: 0.50× memory, 0.90× throughput, accuracy not measured here" in first_screen
    assert (
        "**Largest saving**: deep: 0.40× memory, 0.50× throughput, accuracy +0.0 pt" in first_screen
    )
    assert text.index("\n## NVIDIA X") < text.index("\n## cpu")  # and its section first too
    page = (tmp_path / "s" / "report.html").read_text()
    assert "<div class='headline'>" in page[: page.index("<h2>NVIDIA X</h2>")] and "**" not in page


def test_a_run_that_hurts_accuracy_is_on_no_front_and_pushes_none_off_it():
    import numpy as np

    from bench.report.plots import usable_front

    memory, throughput = np.array([100.0, 60.0, 10.0]), np.array([100.0, 90.0, 100.0])
    # LoRA at -50 pt, saving most
    classes = np.array(["within band", "within band", "worse, outside band"])
    # it would beat both
    assert list(usable_front(memory, throughput, classes)) == [
        True,
        True,
        False,
    ]


def test_a_cpu_prediction_equal_to_every_peak_is_said_once_not_shown_as_a_column_of_ones(tmp_path):
    from bench.report.tables import display, savings

    runs = [
        rec("s", "baseline", 100, 100.0, predicted_peak_tensor_bytes=100 * 2**20),
        rec("s", "same", 100, 100.0, predicted_peak_tensor_bytes=100 * 2**20),
    ]
    table = summary(results.to_frame(runs))
    assert "predicted ×" not in display(table).columns
    # never "-0.0"
    assert str(savings(table).set_index("run").loc["same", "memory saved %"]) == "0.0"
    for r in runs:
        results.write_atomic(results.record_path(tmp_path, "s", r["device"], r["run"]), r)
    written = {p.name for p in build_report(tmp_path / "s")}
    assert "predicted_vs_measured-cpu.png" not in written
    assert "equals its measured peak to the byte" in (tmp_path / "s" / "report.md").read_text()


def test_where_the_gpu_and_the_cpu_disagree_the_report_says_where_each_peak_fell():
    """bert's checkpoint: 0.35× on the H100, 0.86× on the CPU, whose peak at batch 8 is the
    optimizer step."""
    from bench.report.headline import disagreements

    gpu = {"device": "NVIDIA X", "device_type": "cuda"}
    runs = [
        rec("s", "baseline", 100, 10.0, peak_phase="backward"),
        rec("s", "checkpoint", 86, 9.0, peak_phase="optimizer"),
        rec("s", "baseline", 1000, 100.0, peak_phase="backward") | gpu,
        rec("s", "checkpoint", 350, 80.0, peak_phase="backward") | gpu,
    ]
    table = summary(results.to_frame(runs))
    assert disagreements(table) == [
        "**checkpoint**: 0.35× memory on NVIDIA X (batch 8) against 0.86× on cpu (batch 8): its "
        "peak falls in backward on NVIDIA X and in the optimizer step on cpu, so what it saves is "
        "alive at one peak and not the other"
    ]
    # one device: nothing to hold it against
    assert disagreements(table[table["device"] == "cpu"]) == []


def test_this_machines_device_comes_first_and_a_legacy_cpu_name_last_and_labelled(tmp_path):
    here, old = "AMD EPYC, 2 threads, AVX512", "AMD EPYC, 2 threads"
    runs = [
        rec("s", run, peak, sps) | {"device": device}
        for device in ("NVIDIA X", here, old)
        for run, peak, sps in (("baseline", 400, 50.0), ("half", 200, 49.0))
    ]
    for r in runs:
        results.write_atomic(results.record_path(tmp_path, "s", r["device"], r["run"]), r)
    build_report(tmp_path / "s", here=here)
    text = (tmp_path / "s" / "report.md").read_text()
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    assert sections[1:4] == [
        f"## {here}",
        "## NVIDIA X",
        f"## {old} (legacy: recorded before CPU names carried their vector instructions; it may "
        "mix machines, and no CPU measures under this name now)",
    ]


def test_runs_no_gpu_measured_show_their_predicted_peak_at_gpu_shapes(tmp_path):
    gpu = {"device": "NVIDIA X", "device_type": "cuda"}
    runs = [
        rec("s", "baseline", 400, 50.0),
        rec("s", "half", 200, 49.0),
        rec("s", "baseline", 400, 50.0) | gpu,
    ]
    for r in runs:
        results.write_atomic(results.record_path(tmp_path, "s", r["device"], r["run"]), r)
    table = pd.DataFrame(
        {
            "run": ["baseline", "half"],
            "batch": [64, 64],
            "status": ["ok", "ok"],
            "peak_tensor_bytes": [6 * 2**30, 3 * 2**30],
            "peak_phase": ["backward", "forward"],
        }
    )
    save(table, tmp_path / "s" / PREDICTED, "abc123", "2.14")
    build_report(tmp_path / "s")
    text = (tmp_path / "s" / "report.md").read_text()
    section = text[text.index("## Not yet measured on a GPU") :]
    assert (
        "1 of the suite's 2 entries have no GPU record" in section
        and "revision abc123, torch 2.14" in section
    )
    assert (
        "| half | 64 | ok | 3.0 | forward |" in section
        and "| baseline |" not in section.split("\n## ")[0]
    )


def test_a_run_timed_on_a_busy_machine_is_marked_and_never_picked():
    runs = [
        rec("s", "baseline", 400, 50.0),
        rec("s", "half", 200, 49.0) | {"busy_machine": True},
        rec("s", "quarter", 100, 20.0),
    ]
    table = summary(results.to_frame(runs))
    best = {k: (v["run"] if v is not None else None) for k, v in picks(table).items()}
    assert "half" not in best.values() and best["largest"] == "quarter"
    shown = display(table).set_index("run")["throughput ×"]
    assert shown["half"] == "0.98 (busy ⚠)" and shown["quarter"] == 0.4
    runs[0]["busy_machine"] = True  # a busy baseline: every ratio against it is suspect
    assert picks(summary(results.to_frame(runs))) == {"largest": None, "free": None, "trade": None}


def generated(run, peak, decode, cache_kib, **extra):
    """A generation's record: batch 2, a 63-token prompt, 2 new tokens (64 tokens fed), cache_kib a
    token."""
    return (
        rec("g", run, peak, decode * 2 / 64, batch=2, prompt_len=63, new_tokens=2)
        | {
            "decode_tokens_per_s": decode,
            "ttft_ms_median": 20.0,
            "kv_cache_bytes": cache_kib * 1024 * 2 * 64,
        }
        | extra
    )


def test_a_generation_suites_first_screen_names_the_longest_context_and_its_decoding_rate(
    tmp_path,
):
    runs = [
        generated("baseline", 100, 400.0, 32),
        generated("half", 60, 380.0, 16),
        generated("fp8", 55, 250.0, 8),
    ]
    for r in runs:
        results.write_atomic(results.record_path(tmp_path, "g", "cpu", r["run"]), r)
    build_report(tmp_path / "g")
    first = (tmp_path / "g" / "report.md").read_text().split("\n## ")[1]
    assert (
        "**Smallest cache a token**: fp8: decodes at 250 tokens/s here (0.62× the baseline's)"
        in first
    )
    assert "its cache 8.0 KiB a token" in first
    assert (
        "**Fastest decoding**: baseline: decodes at 400 tokens/s here (1.00× the baseline's)"
        in first
    )
    # predicted on a card (bench predict --card): the longest context is the card's, the speed this
    # device's
    contexts = pd.DataFrame(
        {
            "run": ["baseline", "half", "fp8"],
            "longest_context": [40_000, 90_000, 90_000],
            "card": "RTX",
        }
    )
    results.write_atomic(
        tmp_path / "g" / results.CONTEXTS.format(card="rtx"), contexts.to_csv(index=False)
    )
    build_report(tmp_path / "g")
    first = (tmp_path / "g" / "report.md").read_text().split("\n## ")[1]
    # of two that hold as long a context, the faster decoder
    assert (
        "**Longest context on RTX (predicted)**: half: 90,000 tokens; decodes at 380 tokens/s here"
        in first
    )
    assert "Smallest cache a token" not in first


def test_a_cards_longest_sequence_search_is_plotted_against_its_capacity(tmp_path):
    """``bench predict --card NAME --longest`` keeps each length its search predicted beside the
    records (save_curves, merged: a run searched again replaces its rows); the report says each
    run's answer and plots the lengths against the card's capacity."""
    from bench.predict.budget import LengthPoint
    from bench.predict.cards import Card
    from bench.predict.table import save_curves

    r = rec("s", "baseline", 400, 50.0)
    results.write_atomic(results.record_path(tmp_path, "s", r["device"], r["run"]), r)
    card = Card(name="NVIDIA Y", memory=10 * 2**30, memory_source="a test's", context=0)
    gib = 2**30

    def searched(run, longest, points):  # (tokens, allocated GiB, reserved GiB) each
        curve = tuple(LengthPoint(n, a * gib, b * gib, b <= 10, False) for n, a, b in points)
        return {"run": run, "longest_sequence": longest, "length_curve": curve}

    path = tmp_path / "s" / results.CURVES.format(card="y")
    first = [searched("baseline", 512, [(256, 4, 5), (512, 8, 9), (1024, 16, 11)])]
    save_curves(pd.DataFrame(first), path, card, "abc123", "2.14")
    again = [
        searched("baseline", 1024, [(512, 4, 5), (1024, 8, 9), (2048, 16, 11)]),
        searched("lora", None, [(256, 20, 11)]),
    ]
    save_curves(pd.DataFrame(again), path, card, "abc123", "2.14")
    saved = pd.read_csv(path)
    baseline = saved[saved["run"] == "baseline"]
    assert len(saved) == 4 and set(baseline["seq_len"]) == {512, 1024, 2048}
    build_report(tmp_path / "s")
    text = (tmp_path / "s" / "report.md").read_text()
    section = text[text.index("## The longest sequence on the NVIDIA Y") :].split("\n## ")[0]
    assert "`baseline`: 1,024 tokens; `lora`: none fits." in section
    assert "--card y --longest" in section and "revision abc123, torch 2.14" in section
    assert "![lengths-nvidia-y](plots/lengths-nvidia-y.png)" in section
    assert (tmp_path / "s" / "plots" / "lengths-nvidia-y.svg").exists()
