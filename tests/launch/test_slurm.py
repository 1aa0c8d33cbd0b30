"""Sweeps as Slurm jobs, through submitit's local executor (each job a local process, as on a
node)."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench import results
from bench.cli import main
from bench.launch import detect
from bench.launch.local import Local
from bench.launch.slurm import ON_DEVICE, Slurm, _collect, parse_options
from bench.suite import load, select
from bench.sweep import sweep

SUITE = """
model = "resnet-tiny"
baseline = "baseline"
warmup_steps = 1
measure_steps = 2
[shapes.gpu]
batch_size = 4
image_size = 32
[shapes.cpu]
batch_size = 4
image_size = 32
[[runs]]
name = "baseline"
techniques = []
[[runs]]
name = "checkpoint"
techniques = ["checkpoint"]
"""


@pytest.mark.slow
def test_each_run_is_a_job_and_the_sweep_resumes_as_a_local_one(tmp_path):
    pytest.importorskip("submitit")  # an optional extra: the CUDA host has none
    (tmp_path / "jobs.toml").write_text(SUITE)
    suite = load(tmp_path / "jobs.toml")
    root = tmp_path / "results"
    slurm = Slurm("cpu", root / "jobs" / ".submitit", {"cluster": "local", "timeout_min": 5})
    records = sweep(suite, slurm, root)
    assert [r["status"] for r in records] == ["ok", "ok"], records
    stored = results.load_records(root / "jobs")
    assert {r["run"] for r in stored} == {"baseline", "checkpoint"}
    # The key is the one a local `bench run` on that node would compute: the sweep resumes across
    # launchers.
    assert all(
        r["run_key"] == s.measured_key(r["device"], "cpu")
        for r, s in zip(sorted(stored, key=lambda r: r["run"]), suite.runs)
    )
    again = sweep(suite, slurm, root)
    # kept, not resubmitted
    assert [r["stored_at"] for r in again] == [r["stored_at"] for r in records]
    # the node is this machine: a local sweep keeps them too
    here = sweep(suite, Local(detect("cpu")), root)
    assert [r["stored_at"] for r in here] == [r["stored_at"] for r in records]
    # A failure that may not recur is kept under --keep-failures, else submitted again, as in a
    # local sweep.
    path = results.record_path(root, "jobs", records[0]["device"], "baseline")
    results.write_atomic(path, records[0] | {"status": "error", "message": "a node went away"})
    kept = sweep(suite, slurm, root, keep_failures=True)
    assert {r["run"]: r["status"] for r in kept} == {"baseline": "error", "checkpoint": "ok"}
    retried = sweep(suite, slurm, root)
    assert {r["run"]: r["status"] for r in retried} == {"baseline": "ok", "checkpoint": "ok"}


def test_slurm_options_parse_to_executor_parameters():
    assert parse_options("partition=gpu, gpus_per_node=8,timeout_min=60") == {
        "partition": "gpu",
        "gpus_per_node": 8,
        "timeout_min": 60,
    }
    with pytest.raises(ValueError, match="key=value"):
        parse_options("partition")


def test_slurm_without_submitit_exits_2_with_the_install_hint_and_writes_nothing(
    tmp_path, monkeypatch, capsys
):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "submitit" else find_spec(name, *a),
    )
    assert (
        main(["run", "smoke", "--slurm", "cluster=local", "--results", str(tmp_path / "results")])
        == 2
    )
    assert "pip install -e '.[cluster]'" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()


def test_snapshot_with_slurm_exits_2_before_anything_is_submitted(tmp_path, capsys):
    assert (
        main(
            [
                "run",
                "smoke",
                "--slurm",
                "cluster=local",
                "--snapshot",
                "--results",
                str(tmp_path / "r"),
            ]
        )
        == 2
    )
    assert "--snapshot does not go with --slurm" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.fault("resources")
@pytest.mark.full  # 34 s of submitit's polling for a job that fails at once
def test_a_job_that_fails_on_its_node_says_why_in_the_record(tmp_path):
    pytest.importorskip("submitit")
    if torch.cuda.is_available():
        pytest.skip("the job's failure here is a CUDA node without a card")
    (tmp_path / "jobs.toml").write_text(SUITE)
    suite = select(load(tmp_path / "jobs.toml"), ["baseline"])
    records = sweep(
        suite,
        Slurm("cuda", tmp_path / ".submitit", {"cluster": "local", "timeout_min": 5}),
        tmp_path / "results",
    )
    [failed] = records
    # it died before it knew its device
    assert failed["status"] == "error" and failed["device"] == "unknown"
    assert "RuntimeError: Found no NVIDIA driver" in failed["message"], failed["message"]
    assert "_log.err)" in failed["message"]  # and where its log is


class DiedJob:
    """A job that reported its node's device, then died (preempted, out of time)."""

    job_id = "4242"
    paths = SimpleNamespace(stderr=Path("/jobs/4242_0_log.err"))

    def result(self):
        raise RuntimeError(
            "Job (task=0) failed during processing with trace:\n----------------------\nTraceback "
            '(most recent call last):\n  File "x", line 1, in f\nTimeoutError: DUE TO TIME LIMIT\n'
            "\n----------------------\nYou can check full logs with 'job.stderr(0)' and "
            "'job.stdout(0)'or at paths:\n  - /jobs/4242_0_log.err\n  - /jobs/4242_0_log.out"
        )

    def stdout(self):
        return f"submitit INFO - Starting\n{ON_DEVICE}NVIDIA H100 80GB HBM3\n"


@pytest.mark.fault("resources")
def test_a_job_that_dies_after_finding_its_device_is_filed_under_that_device(tmp_path):
    (tmp_path / "jobs.toml").write_text(SUITE)
    spec = load(tmp_path / "jobs.toml").runs[0]
    record = _collect(spec, DiedJob()).to_flat()
    assert record["device"] == "NVIDIA H100 80GB HBM3"
    assert (
        record["message"]
        == "slurm job 4242 failed: TimeoutError: DUE TO TIME LIMIT (log: /jobs/4242_0_log.err)"
    )
