import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from bench.cli import main
from bench.predict import table
from bench.predict.fake import Traced
from bench.record import Prediction
from bench.suite import load, select
from tests.helpers import spec, tech


@pytest.mark.slow
def test_predict_command_prints_the_table_with_what_fits_the_budget(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "predict",
        "smoke",
        "--only",
        "checkpoint",
        "--results",
        str(tmp_path),
        # in this process: the spawned ones are another test's (they took 10 s to start here)
        "--jobs",
        "1",
    ]
    out = subprocess.run(cmd + ["--budget", "2GiB"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (
        "budget 2GiB less 1280MiB for the CUDA context and the allocator's workspaces (--reserve): "
        "0.75 GiB for tensors" in out.stderr
    )
    # no 194.0
    assert re.search(r"^\| checkpoint \| 32 \| ok \|.* \| yes \| \d+ \|", out.stdout, re.M), (
        out.stdout
    )
    assert "largest batch" in out.stdout and "Assumed:" in out.stderr
    line = r"^\[2/\d+\] checkpoint: [\d.]+ GiB at batch 32, peak in \w+, largest batch \d+$"
    assert re.search(line, out.stderr, re.M)


def test_bad_budget_reserve_or_jobs_exit_2_naming_the_option_and_print_no_table(tmp_path, capsys):
    args = ["predict", "smoke", "--only", "checkpoint", "--results", str(tmp_path)]
    for wrong, said in (
        (["--budget", "lots"], "--budget 'lots': expected a size"),
        (["--budget", "1GiB"], "--reserve 1280MiB leaves nothing of --budget 1GiB"),
        (["--reserve", "0"], "--reserve 0 is held back from a --budget, and none was given"),
    ):
        assert main(args + wrong) == 2
        out = capsys.readouterr()
        assert said in out.err and not out.out, out.err
    with pytest.raises(SystemExit) as exit_:  # argparse's own exit
        main(args + ["--jobs", "0"])
    assert (
        exit_.value.code == 2
        and "--jobs: expected a whole number of at least 1, got '0'" in capsys.readouterr().err
    )


def test_predicting_in_processes_gives_the_same_table_in_the_suite_order():
    runs = list(select(load("suites/smoke.toml"), ["baseline", "checkpoint", "amp-bf16"]).runs)
    log = io.StringIO()
    here = table.suite_table(runs, {}, None, log=io.StringIO(), jobs=1)
    spawned = table.suite_table(runs, {}, None, log=log, jobs=2)  # the CLI test covers a budget
    pd.testing.assert_frame_equal(here, spawned)
    assert list(spawned["run"]) == ["baseline", "checkpoint", "amp-bf16"]
    assert sorted(re.findall(r"^\[(\d)/3\]", log.getvalue(), re.M)) == ["1", "2", "3"]


@pytest.mark.fault("signals")
@pytest.mark.parametrize("sent", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_to_the_group_stops_predict_and_its_processes(sent):
    # Ctrl-C reaches the whole foreground group; SIGTERM does too from `timeout`, Slurm and `kill --
    # -PGID`, and once left the idle workers dead holding the pool's lock, and the cleanup waiting
    # on it for good: two processes for two runs, so that the first to finish waits idle for work
    # that never comes (four for four took 50 s of a loaded two-core machine, for the same case).
    only = ["--only", "baseline,checkpoint"]
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "predict",
        "smoke",
        *only,
        "--budget",
        "2GiB",
        "--jobs",
        "2",
    ]
    proc = subprocess.Popen(
        cmd,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        # as in a terminal
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # what is predicted, the budget (and on a loaded machine what a run is doing), the first run
    first = ""
    while not first.endswith("\n") or not first.splitlines()[-1].startswith("["):
        line = proc.stderr.readline()
        assert line, first
        first += line
    # a run is done: the processes are up and predicting the others
    os.killpg(proc.pid, sent)
    _, rest = proc.communicate(timeout=60)  # a hang fails here rather than holding the test suite
    assert proc.wait(timeout=60) == 130 and "interrupted" in rest and "Traceback" not in rest, rest
    # multiprocessing's resource tracker exits once it sees the parent go
    deadline = time.monotonic() + 10
    with pytest.raises(ProcessLookupError):
        while time.monotonic() < deadline:
            os.killpg(proc.pid, 0)  # raises once nothing of the group is left
            time.sleep(0.2)


def _linear(monkeypatch):
    """Predictions of 10,000 bytes and 300 a sample, in no time: what a search tries is exact."""

    def fake(spec, shapes=None, cuda=True, reserved=True, card=None):
        batch = (shapes or spec.gpu).batch_size
        return Traced(Prediction(status="ok", peak_tensor_bytes=10_000 + 300 * batch))

    monkeypatch.setattr("bench.predict.lines.traced", fake)
    monkeypatch.setattr(table, "traced", fake)


def test_a_long_prediction_says_each_batch_its_search_tries(monkeypatch, capsys):
    _linear(monkeypatch)
    monkeypatch.setattr(table, "SAY_AFTER_S", 0.0)
    row = table._row(spec("vit-tiny", batch_size=16, name="run"), budget=20_000, card=None)
    tried = dict(re.findall(r"^    run: batch (\d+): (.*)$", capsys.readouterr().err, re.M))
    assert row.largest_batch == 33  # 10,000 + 300 × 33 = 19,900
    assert tried["33"].endswith(", fits") and tried["34"].endswith(", does not fit")


def test_a_quick_prediction_says_nothing_but_its_row(monkeypatch, capsys):
    _linear(monkeypatch)
    table._row(spec("vit-tiny", batch_size=16, name="run"), budget=20_000, card=None)
    assert "    run:" not in capsys.readouterr().err


@pytest.mark.parametrize("after, said", [(0.0, ["predicting"]), (3600.0, [])])
def test_work_that_takes_long_is_said_once_it_has(after, said, monkeypatch):
    monkeypatch.setattr(table, "SAY_AFTER_S", after)
    heard, told = [], table.Told("run")
    monkeypatch.setattr(table.Told, "__call__", lambda self, text: heard.append(text))
    with told.meanwhile("predicting"):
        deadline = time.monotonic() + 30
        while said and not heard and time.monotonic() < deadline:  # the timer's thread, loaded
            time.sleep(0.01)
    assert heard == said


def _varlen_suites(tmp_path: Path) -> tuple[Path, Path]:
    """Two suites of bert-tiny: fixed-shape, and on a long-tailed file of lengths (32 sequences,
    8 batches of 4)."""
    (tmp_path / "tail.txt").write_text("\n".join(["8"] * 13 + ["60"] + ["8"] * 18))
    lengths = f'lengths = "file:{tmp_path}/tail.txt"'
    suite = """model = "bert-tiny"
baseline = "pad"
[shapes.gpu]
batch_size = 4
seq_len = 64
LENGTHS
[shapes.cpu]
batch_size = 4
seq_len = 64
LENGTHS
[[runs]]
name = "pad"
techniques = ["TECHNIQUE"]
"""
    fixed = suite.replace("LENGTHS", "").replace("TECHNIQUE", "amp")
    (tmp_path / "fixed.toml").write_text(fixed)
    varying = suite.replace("LENGTHS", lengths).replace("TECHNIQUE", "dynamic-padding")
    (tmp_path / "varlen.toml").write_text(varying)
    return tmp_path / "fixed.toml", tmp_path / "varlen.toml"


def test_worst_step_predicts_each_variable_length_run_at_its_epochs_worst_batch(tmp_path, capsys):
    """bench predict --worst-step: a long-tailed file's worst batch named and predicted; a suite of
    fixed-shape runs, whose steps are all alike, is refused by name (exit 2)."""
    fixed, varying = _varlen_suites(tmp_path)
    common = ["--jobs", "1", "--results", str(tmp_path), "--worst-step"]
    assert main(["predict", str(fixed), *common]) == 2
    assert "--worst-step: no run of fixed takes variable-length data" in capsys.readouterr().err
    assert main(["predict", str(varying), *common]) == 0
    out = capsys.readouterr()
    assert "| worst step |" in out.out
    assert re.search(r"\| step \d of 8: 240 tokens, 84 of them real \|", out.out)


def test_epoch_replays_every_step_of_a_pass_through_the_cards_allocator(tmp_path, capsys):
    """bench predict --epoch --card: the whole pass, its 8 steps, through one allocator on the
    card; refused by name (exit 2) for fixed-shape runs and beside --worst-step."""
    fixed, varying = _varlen_suites(tmp_path)
    common = ["--jobs", "1", "--results", str(tmp_path), "--card", "t4", "--epoch"]
    assert main(["predict", str(fixed), *common]) == 2
    assert "--epoch: no run of fixed takes variable-length data" in capsys.readouterr().err
    assert main(["predict", str(varying), *common, "--worst-step"]) == 2
    assert "--worst-step and --epoch" in capsys.readouterr().err
    assert main(["predict", str(varying), *common]) == 0
    said = r"\| fits for the whole epoch of 8 steps \(reserved after step 1: [\d.]+ GiB, "
    assert re.search(said + r"after step 8: [\d.]+ GiB\) \|", capsys.readouterr().out)


def test_epoch_worst_keeps_the_order_of_the_pass_that_does_worst(monkeypatch):
    """--epoch worst: the same batches in each order (varlen.ORDERS) and the one that does worst
    kept, named: without a card, the one that reserves the most (bert-tiny over long-tailed
    lengths, whose reserve drifts from step to step). Each order's pass is the one the table
    traced, read as it traced it."""
    from dataclasses import replace

    from bench.predict import table as tables
    from bench.spec import ORDERS

    shapes = {"batch_size": 64, "seq_len": 512, "lengths": "lognormal:18:1.27:512"}
    run = spec("bert-tiny", (tech("dynamic-padding"),), **shapes)
    run = replace(run, gpu=replace(run.gpu, epoch=True, epoch_order="worst"))
    reserved = {}

    def traced(spec, **options):
        out = real(spec, **options)
        reserved[spec.gpu.epoch_order] = out.prediction
        return out

    real = tables.traced
    monkeypatch.setattr(tables, "traced", traced)
    table = tables.suite_table([run], {}, None, log=io.StringIO())
    assert set(reserved) == set(ORDERS)
    assert len({tuple(p.epoch_reserved_bytes) for p in reserved.values()}) > 1  # orders differ
    worst = max(ORDERS, key=lambda o: reserved[o].peak_reserved_bytes)
    assert table["epoch_order"][0] == worst
    assert table["peak_reserved_bytes"][0] == reserved[worst].peak_reserved_bytes


def test_a_passs_orders_are_its_batches_rearranged():
    from bench.data.varlen import ordered

    batches = [[0], [1], [2], [3], [4]]
    padded = {0: 30, 1: 90, 2: 10, 3: 90, 4: 50}.__getitem__
    length = lambda b: padded(b[0])  # noqa: E731
    assert ordered(batches, "loader", length) == batches
    assert ordered(batches, "ascending", length) == [[2], [0], [4], [1], [3]]
    assert ordered(batches, "descending", length) == [[1], [3], [4], [0], [2]]
    # the longest, both of them, last, in the order they came
    assert ordered(batches, "longest-last", length) == [[0], [2], [4], [1], [3]]


def test_the_fewest_ranks_are_said_in_nodes_of_eight_too():
    """A multi-process entry's fewest ranks, as the servers of eight cards they fill."""
    import pandas as pd

    from bench.predict.table import markdown

    rows = [
        {"run": r, "batch": 8, "status": "ok", "peak_tensor_bytes": 2**30, "fewest_ranks": n}
        | {"largest_batch_there": 4}
        for r, n in (("three", 3), ("eight", 8), ("nine", 9), ("sixty-four", 64))
    ]
    lines = markdown(pd.DataFrame(rows)).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    nodes = [line.strip("|").split("|")[header.index("nodes of 8")].strip() for line in lines[2:]]
    assert nodes == ["1", "1", "2", "8"]
