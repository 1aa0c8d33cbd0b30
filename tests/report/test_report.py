import math
import os
import subprocess
import sys
from html.parser import HTMLParser

import pandas as pd
import pytest

from bench import results
from bench.report import build_report
from bench.suite import load

MiB = 2**20
BREAKDOWN = {
    "parameters": 100,
    "buffers": 0,
    "gradients": 100,
    "optimizer_state": 50,
    "activations": 30,
    "temporaries": 20,
}


def record(run, status="ok", device="cpu", peak=None, tput=None, **extra):
    r = {
        "suite": "demo",
        "run": run,
        "model": "resnet50",
        "baseline": "baseline",
        "techniques": run,
        "device": device,
        "device_type": "cuda" if device != "cpu" else "cpu",
        "batch_size": 8,
        "status": status,
        "message": "" if status == "ok" else f"{status} happened",
        "seed": 0,
        "torch_version": "2.14.1",
        "git_revision": "abc123",
        "warmup_steps": 1,
        "measure_steps": 3,
    }
    if status == "ok":
        key = "peak_allocated_bytes" if device != "cpu" else "peak_tensor_bytes"
        r |= {key: peak * MiB, "samples_per_s": tput, "step_time_ms_median": 8000 / tput}
    return r | extra


@pytest.fixture
def suite_dir(tmp_path):
    fixtures = [
        record("baseline", peak=400, tput=100.0, wall_s=61.5),
        record(
            "checkpoint",
            peak=300,
            tput=75.0,
            proof={"checkpoint.wrapped_modules": 16},
            step_times_ms=[100.0, 104.0, 98.0],
            predicted_peak_tensor_bytes=297 * MiB,
            wall_s=60.0,
            **{f"at_peak_{k}_bytes": v * MiB for k, v in BREAKDOWN.items()},
        ),
        record("huge", status="oom", wall_s=4.9),
        record("broken", status="error", stderr_tail="Traceback ..."),
        record("fp8", status="unsupported"),
        record(
            "baseline",
            device="NVIDIA H100 80GB HBM3",
            peak=8000,
            tput=1000.0,
            peak_reserved_bytes=9000 * MiB,
        ),
        record(
            "checkpoint",
            device="NVIDIA H100 80GB HBM3",
            peak=4000,
            tput=800.0,
            peak_reserved_bytes=5000 * MiB,
        ),
    ]
    for r in fixtures:
        results.write_atomic(results.record_path(tmp_path, "demo", r["device"], r["run"]), r)
    return tmp_path / "demo"


def test_report_writes_table_markdown_html_and_each_plot_that_has_data(suite_dir):
    (suite_dir / "plots").mkdir()
    (suite_dir / "plots" / "memory_vs_throughput-cpu.png").write_bytes(b"old view")
    written = build_report(suite_dir)
    names = {p.name for p in written}
    # The CPU records have a breakdown, step times and a prediction (one run each); the GPU ones do
    # not.
    cpu = {
        f"{v}-cpu.{ext}"
        for v in ("pareto", "peak_memory", "breakdown", "step_times", "predicted_vs_measured")
        for ext in ("png", "svg")
    }
    gpu = {
        f"{v}-nvidia-h100-80gb-hbm3.{ext}"
        for v in ("pareto", "peak_memory")
        for ext in ("png", "svg")
    }
    assert names == {"table.csv", "report.md", "report.html"} | cpu | gpu
    assert all(p.stat().st_size > 0 for p in written)
    assert {p.name for p in (suite_dir / "plots").iterdir()} == cpu | gpu  # the stale view is gone


def test_html_report_is_self_contained(suite_dir):
    build_report(suite_dir)
    page = (suite_dir / "report.html").read_text()
    assert page.count("<img ") == 7 and page.count("src='data:image/png;base64,") == 7
    for external in ("http://", "https://", "<link", "<script", "src='plots", 'src="'):
        assert external not in page
    assert "<table" in page and "oom happened" in page


def test_pareto_front_on_a_hand_made_set():
    from bench.report.tables import pareto_front

    memory = [1.0, 2.0, 2.0, 3.0, 4.0, 1.0]
    throughput = [1.0, 3.0, 2.0, 3.0, 5.0, 1.0]
    # (2,2) is beaten by (2,3); (3,3) by (2,3); the duplicate (1,1) points beat neither each other
    # nor are beaten, so both stay.
    assert list(pareto_front(memory, throughput)) == [True, True, False, False, True, True]


def test_breakdown_sums_to_the_peak_and_savings_table_is_relative_to_the_baseline(suite_dir):
    from bench.report.plots import breakdown_frame
    from bench.report.tables import savings, summary

    table = summary(results.to_frame(results.load_records(suite_dir)))
    cpu = table[table.device == "cpu"]
    parts = breakdown_frame(cpu)
    assert list(parts.index) == ["checkpoint"] and parts.loc["checkpoint"].sum() == 300 * MiB
    rows = savings(cpu).set_index("run")
    # failed runs are listed elsewhere, not here
    assert list(rows.index) == [
        "checkpoint",
        "baseline",
    ]
    assert rows.loc["checkpoint", "memory saved %"] == 25.0
    assert rows.loc["checkpoint", "throughput change %"] == -25.0


def test_table_has_one_row_per_run_and_ratios_against_the_same_device_baseline(suite_dir):
    build_report(suite_dir)
    table = pd.read_csv(suite_dir / "table.csv")
    assert len(table) == 7
    for col in [
        "suite",
        "run",
        "model",
        "techniques",
        "device",
        "batch_size",
        "status",
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "samples_per_s",
        "step_time_ms_median",
    ]:
        assert col in table.columns
    cpu = table[table.device == "cpu"].set_index("run")
    gpu = table[table.device != "cpu"].set_index("run")
    assert cpu.loc["checkpoint", "memory_vs_baseline"] == pytest.approx(0.75)
    assert cpu.loc["checkpoint", "throughput_vs_baseline"] == pytest.approx(0.75)
    assert gpu.loc["checkpoint", "memory_vs_baseline"] == pytest.approx(0.5)
    # No CUDA on the CPU rows: the CUDA figures are absent, never 0.
    assert cpu["peak_allocated_bytes"].isna().all() and cpu["peak_reserved_bytes"].isna().all()
    assert math.isnan(cpu.loc["huge", "memory_vs_baseline"])
    assert cpu.loc["checkpoint", "proof.checkpoint.wrapped_modules"] == 16


def test_markdown_lists_failed_runs_with_their_reason_and_provenance(suite_dir):
    build_report(suite_dir)
    md = (suite_dir / "report.md").read_text()
    for line in [
        "- **huge**: oom: oom happened",
        "- **broken**: error: error happened",
        "- **fp8**: unsupported: unsupported happened",
        "## NVIDIA H100 80GB HBM3",
        "torch 2.14.1",
        "revision abc123",
        "](plots/peak_memory-cpu.png)",
        "](plots/breakdown-cpu.png)",
        "### Against the baseline, largest memory saving first",
        "| checkpoint | 0.75 | 25.0 |",
        "· 2 min 06 s of runs (2 without a time)",
    ]:
        assert line in md
    # the H100 records kept no run times: nothing is claimed for them
    assert md.count("of runs") == 1


def test_report_without_records_says_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="run `make bench SUITE=smoke` first"):
        build_report(tmp_path / "smoke")  # suites/smoke.toml exists: it has not been run
    with pytest.raises(FileNotFoundError, match="there is no suite suites/nothing.toml either"):
        build_report(tmp_path / "nothing")


@pytest.mark.fault("stored data")
def test_an_unreadable_record_is_named_and_the_others_are_reported(suite_dir, capsys):
    broken = suite_dir / "cpu" / "huge.json"
    broken.write_text('{"run": "huge",\n<<<<<<< HEAD\n')  # a merge conflict in a committed record
    assert sorted(r["run"] for r in results.load_records(suite_dir) if r["device"] == "cpu") == [
        "baseline",
        "broken",
        "checkpoint",
        "fp8",
    ]
    assert f"warning: {broken}: unreadable record, treated as absent" in capsys.readouterr().err


def test_accuracy_deltas_sit_next_to_the_baselines_band_and_are_flagged_outside_it():
    from bench.report.tables import markdown, summary

    frame = results.to_frame(
        [
            record(
                "baseline", peak=400, tput=100.0, accuracy=0.90, accuracy_seeds=[0.90, 0.88, 0.91]
            ),
            record("checkpoint", peak=300, tput=75.0, accuracy=0.89),
            record("frozen", peak=300, tput=75.0, accuracy=0.10),
            record("no-fidelity", peak=300, tput=75.0),
        ]
    )
    table = summary(frame).set_index("run")
    assert table.loc["checkpoint", "accuracy_delta"] == pytest.approx(-0.01)
    assert table.loc["checkpoint", "accuracy_band"] == pytest.approx(0.03)
    assert not table.loc["checkpoint", "outside_band"] and table.loc["frozen", "outside_band"]
    assert math.isnan(table.loc["no-fidelity", "accuracy_delta"])
    text = markdown(summary(frame))
    assert "| -1.0 ±3.0 |" in text and "| -80.0 ±3.0 ⚠ |" in text


def test_predicted_peak_is_held_against_the_measured_one():
    from bench.report.tables import summary

    frame = results.to_frame(
        [
            record(
                "baseline",
                device="NVIDIA H100 80GB HBM3",
                peak=8000,
                tput=1000.0,
                predicted_peak_tensor_bytes=7920 * MiB,
            ),
            record("checkpoint", device="NVIDIA H100 80GB HBM3", peak=4000, tput=800.0),
        ]
    )
    table = summary(frame).set_index("run")
    assert table.loc["baseline", "predicted_vs_measured"] == pytest.approx(0.99)
    assert math.isnan(table.loc["checkpoint", "predicted_vs_measured"])


def test_the_provenance_line_names_the_pretrained_weights_and_their_digest(tmp_path):
    weights = {"weights": "ckpt/resnet50.pt", "weights_sha256": "0123456789abcdef"}
    for r in (
        record("baseline", peak=400, tput=100.0, **weights),
        record("fp8", status="unsupported"),
    ):
        results.write_atomic(results.record_path(tmp_path, "demo", r["device"], r["run"]), r)
    build_report(tmp_path / "demo")
    md = (tmp_path / "demo" / "report.md").read_text()
    assert (
        "seed 0 · weights ckpt/resnet50.pt (sha256 0123456789abcdef) · warm-up 1 + 3 measured steps"
        in md
    )


def test_the_provenance_line_and_table_name_the_package_versions_the_runs_imported(tmp_path):
    for r in (
        record("baseline", peak=400, tput=100.0, packages={"torchvision": "0.29.1"}),
        record(
            "adamw-8bit",
            peak=300,
            tput=90.0,
            packages={"torchvision": "0.29.1", "torchao": "0.18.0"},
        ),
    ):
        results.write_atomic(results.record_path(tmp_path, "demo", r["device"], r["run"]), r)
    build_report(tmp_path / "demo")
    md = (tmp_path / "demo" / "report.md").read_text()
    assert "Device: cpu · torch 2.14.1, torchao 0.18.0, torchvision 0.29.1 · " in md
    table = pd.read_csv(tmp_path / "demo" / "table.csv").set_index("run")
    assert table.loc["adamw-8bit", "package.torchao"] == "0.18.0" and pd.isna(
        table.loc["baseline", "package.torchao"]
    )


def test_every_technique_has_its_own_colour_across_reports_and_only_the_baseline_is_grey():
    from bench.report.plots import BASELINE_COLOUR, PALETTE, technique_colour
    from bench.techniques import TECHNIQUES

    names = TECHNIQUES.names()
    assert len(PALETTE) > len(names), (
        "every built-in needs its own colour and users' own a spare: extend PALETTE"
    )
    # once, tf32 wore adamw-8bit's colour
    assert len({technique_colour(n) for n in names}) == len(names)

    frame = results.to_frame(
        [
            record("mixed", peak=1, tput=1.0, techniques=["amp(dtype=bfloat16)", "checkpoint"]),
            record("older", peak=1, tput=1.0, techniques="amp(dtype=float16) + checkpoint"),
        ]
    )
    # a run is coloured by its first technique, in any record
    assert list(frame["technique"]) == ["amp", "amp"]
    assert technique_colour("amp") != technique_colour("checkpoint")
    assert (
        technique_colour("amp", is_baseline=True) == technique_colour("baseline") == BASELINE_COLOUR
    )
    own = {technique_colour(f"my_techniques:Own{i}") for i in range(50)}
    assert own <= set(PALETTE) and len(own) > 1  # a user's own: spread over the palette, never grey
    # once, SGDMomentum wore a built-in's colour
    assert not own & {technique_colour(n) for n in names}


def test_a_suite_names_the_figure_its_throughput_compares(tmp_path):
    # bert-varlen's bucketing read 5.6× in samples/s over three steps where real tokens/s said 3.6×
    from bench.report.tables import summary
    from bench.results import to_frame

    base = {
        "suite": "v",
        "device": "cpu",
        "device_type": "cpu",
        "status": "ok",
        "baseline": "pad",
        "batch_size": 8,
        "peak_tensor_bytes": 100,
    }
    records = [
        base | {"run": "pad", "samples_per_s": 10.0, "real_tokens_per_s": 400.0},
        base | {"run": "bucket", "samples_per_s": 56.0, "real_tokens_per_s": 1440.0},
    ]
    assert (
        summary(to_frame(records)).set_index("run").loc["bucket", "throughput_vs_baseline"] == 5.6
    )
    table = summary(to_frame(records), "real_tokens_per_s").set_index("run")
    assert table.loc["bucket", "throughput_vs_baseline"] == 3.6
    assert load("suites/bert-varlen.toml").throughput == "real_tokens_per_s"


HOSTILE = [
    "[click me](javascript:alert%28document.domain%29)",
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    "[x](JaVaScRiPt:alert(1))",
    "[d](data:text/html,<b>)",
    "' onmouseover='x",
]


class Scripts(HTMLParser):
    """What in a page could run: script elements, event-handler attributes, links that are not
    relative or http(s)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "script":
            self.found.append("<script>")
        for name, value in attrs:
            if name.startswith("on"):
                self.found.append(f"{name}=")
            # the plots
            embedded = name == "src" and (value or "").startswith("data:image/png;base64,")
            web = (value or "").startswith(("http://", "https://"))
            if (
                name in ("href", "src")
                and value
                and ":" in value.split("/")[0]
                and not embedded
                and not web
            ):
                self.found.append(f"{name}={value}")


@pytest.mark.fault("hostile text")
def test_hostile_run_names_and_messages_run_nothing_in_any_page(tmp_path):
    from bench.report.overview import build_overview

    base = {
        "suite": "s",
        "device": "cpu",
        "device_type": "cpu",
        "baseline": "baseline",
        "batch_size": 8,
        "peak_tensor_bytes": 100,
        "samples_per_s": 1.0,
    }
    records = [base | {"run": "baseline", "status": "ok"}]
    records += [
        base | {"run": name, "status": "error", "message": name, "run_index": i}
        for i, name in enumerate(HOSTILE, 2)
    ]
    for r in records:
        results.write_atomic(results.record_path(tmp_path, "s", r["device"], r["run"]), r)
    pages = [
        p for p in build_report(tmp_path / "s") + build_overview(tmp_path) if p.suffix == ".html"
    ]
    assert len(pages) == 2
    for page in pages:
        parser = Scripts()
        parser.feed(page.read_text())
        assert parser.found == [], page


@pytest.mark.fault("disk")
def test_pages_are_written_whole_in_utf8_whatever_the_locale(tmp_path):
    # LC_ALL=C: report.md was emptied to 0 bytes, then a traceback (its "×" has no ASCII form)
    base = {
        "suite": "s",
        "device": "cpu",
        "device_type": "cpu",
        "baseline": "baseline",
        "batch_size": 8,
        "status": "ok",
        "peak_tensor_bytes": 100,
        "samples_per_s": 1.0,
    }
    for r in (base | {"run": "baseline"}, base | {"run": "amp×2", "peak_tensor_bytes": 50}):
        results.write_atomic(results.record_path(tmp_path, "s", r["device"], r["run"]), r)
    code = (
        "from pathlib import Path; from bench.report import build_report; "
        f"build_report(Path({str(tmp_path / 's')!r}))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LC_")} | {
        "LC_ALL": "C",
        "LANG": "C",
        "PYTHONUTF8": "0",
    }
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "amp×2" in (tmp_path / "s" / "report.md").read_text(encoding="utf-8")


@pytest.mark.fault("concurrency")
def test_two_reports_writing_one_plot_at_once_each_write_it_whole(tmp_path):
    """Two `bench report` of one suite at once: each wrote the plot through one temporary name, and
    the one that renamed it first left the other "No such file or directory". Here the second writes
    the same plot while the first is in the middle of it."""
    import matplotlib.pyplot as plt

    from bench.report import plots

    target = tmp_path / "pareto-cpu.png"
    inner, outer = plt.figure(), plt.figure()
    savefig, nested = outer.savefig, []

    def saved_with_another_in_between(path, **options):
        savefig(path, **options)
        if not nested:
            nested.append(path)
            plots.save(inner, target)  # the other process, from start to end

    outer.savefig = saved_with_another_in_between
    plots.save(outer, target)
    assert nested and target.read_bytes().startswith(b"\x89PNG")
    assert target.with_suffix(".svg").read_text().lstrip().startswith("<?xml")
    assert not list(tmp_path.glob(".*.tmp"))  # nothing left behind
