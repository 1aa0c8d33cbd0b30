import io
import os
import re
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from bench.predict import table
from bench.suite import load, select


def test_predict_command_prints_the_table_and_rejects_a_bad_budget(tmp_path):
    cmd = [sys.executable, "-m", "bench", "predict", "smoke", "--only", "checkpoint", "--results", str(tmp_path)]
    out = subprocess.run(cmd + ["--budget", "2GiB"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "budget 2GiB less 1GiB for the CUDA context and the allocator's workspaces (--reserve): " \
           "1.00 GiB for tensors" in out.stderr
    assert re.search(r"^\| checkpoint \| 32 \| ok \|.* \| yes \| \d+ \|", out.stdout, re.M), out.stdout  # no 194.0
    assert "largest batch" in out.stdout and "Assumed:" in out.stderr
    line = r"^\[2/\d+\] checkpoint: [\d.]+ GiB at batch 32, peak in \w+, largest batch \d+$"
    assert re.search(line, out.stderr, re.M)
    bad = subprocess.run(cmd + ["--budget", "lots"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--budget 'lots': expected a size" in bad.stderr
    for wrong, said in ((["--budget", "1GiB"], "--reserve 1GiB leaves nothing of --budget 1GiB"),
                        (["--reserve", "0"], "--reserve 0 is held back from a --budget, and none was given")):
        bad = subprocess.run(cmd + wrong, capture_output=True, text=True, timeout=300)
        assert bad.returncode == 2 and said in bad.stderr and not bad.stdout, bad.stderr
    bad = subprocess.run(cmd + ["--jobs", "0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--jobs: expected a whole number of at least 1, got '0'" in bad.stderr


def test_predicting_in_processes_gives_the_same_table_in_the_suite_order():
    runs = list(select(load("suites/smoke.toml"), ["baseline", "checkpoint", "amp-bf16"]).runs)
    log = io.StringIO()
    here = table.suite_table(runs, {}, None, log=io.StringIO(), jobs=1)
    spawned = table.suite_table(runs, {}, None, log=log, jobs=2)  # the CLI test covers a budget
    pd.testing.assert_frame_equal(here, spawned)
    assert list(spawned["run"]) == ["baseline", "checkpoint", "amp-bf16"]
    assert sorted(re.findall(r"^\[(\d)/3\]", log.getvalue(), re.M)) == ["1", "2", "3"]


def test_ctrl_c_stops_predict_and_its_processes():
    cmd = [sys.executable, "-m", "bench", "predict", "smoke", "--budget", "2GiB", "--jobs", "2"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a terminal
    first = "".join(proc.stderr.readline() for _ in range(3))  # what is predicted, the budget, the first run
    assert "\n[" in first, first  # a run is done: the processes are up and predicting the others
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground group
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 130 and "interrupted" in rest and "Traceback" not in rest, rest
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker exits once it sees the parent go
    with pytest.raises(ProcessLookupError):
        while time.monotonic() < deadline:
            os.killpg(proc.pid, 0)  # raises once nothing of the group is left
            time.sleep(0.2)
