"""The fork server against the guarantees a fresh interpreter gives: its own environment, its own
peaks, its own session, and no CUDA inherited from the server."""

import json
import multiprocessing
import os
import re
import subprocess
import sys
from dataclasses import replace
from multiprocessing import forkserver
from pathlib import Path

import pytest
import torch

from bench.launch import Device, local
from bench.launch import process as launch
from bench.suite import Fidelity
from tests.helpers import isolated, spec, tech

CPU = Device("cpu", "cpu")


def _imports_in_a_fork() -> None:
    """Exit 0 when the forked child finds what the server preloaded, without torchao and without
    CUDA."""
    assert "bench.worker" in sys.modules and "transformers.models.bert.modeling_bert" in sys.modules
    # its import asks the GPU for its properties: never in the server
    assert "torchao" not in sys.modules
    assert not torch.cuda.is_initialized()


def test_a_forked_child_finds_its_models_imports_done_and_cuda_untouched():
    forkserver._forkserver._stop()  # a server an earlier test started has that test's imports
    launch.start_server(local.model_imports([spec(model="bert-tiny")], "cpu"))
    child = launch._context().Process(target=_imports_in_a_fork)
    child.start()
    child.join(120)
    assert child.exitcode == 0


def test_the_server_imports_the_modules_of_the_models_a_sweep_builds(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "gpt2", "architectures": ["GPT2ForSequenceClassification"]}')
    cases = {
        "resnet-tiny": {"torchvision.models"},
        f"hf:{config}": {"transformers.models.gpt2.modeling_gpt2"},
        "tests.helpers:NO_SUCH_MODEL": set(),  # its run says why it cannot be built
    }
    for model, imports in cases.items():
        assert local.model_imports([replace(spec(), model=model)], "cpu") == imports, model
    stand_in = replace(spec(), model="resnet-tiny", fidelity_cpu=Fidelity(model="bert-tiny"))
    assert local.model_imports([stand_in], "cpu") == {
        "torchvision.models",
        "transformers.models.bert.modeling_bert",
    }


def test_a_forked_run_takes_the_environment_of_its_own_launch(monkeypatch):
    launch.start_server()  # the server's environment is fixed now; the run's is set later
    monkeypatch.setenv("BENCH_PROBE", "set-after-the-server-started")
    record = isolated(spec(techniques=(tech("tests.helpers:ReportEnv"),)), CPU)
    assert record["launcher"] == "fork" and record["status"] == "ok", record
    assert record["proof"]["ReportEnv.seen"] == "set-after-the-server-started"
    assert 0 < record["startup_s"] < 120


def test_a_technique_that_sets_the_environment_gets_a_fresh_interpreter():
    record = isolated(spec(techniques=(tech("tests.helpers:EnvProbe"),)), CPU)
    assert record["launcher"] == "fresh"
    assert record["proof"]["EnvProbe.seen"] == "set-by-technique"


def test_a_forked_run_starts_with_its_own_peak_not_its_predecessors():
    big = isolated(spec(techniques=(tech("tests.helpers:HoldHalfAGibibyte"),)), CPU)
    small = isolated(spec(), CPU)
    assert big["launcher"] == small["launcher"] == "fork"
    # the half GiB stayed with its own run
    assert big["rss_peak_bytes"] - small["rss_peak_bytes"] > 2**28


@pytest.mark.fault("resources")
@pytest.mark.parametrize("launcher", launch.KINDS)
def test_a_crash_or_a_hang_is_a_status_under_either_launcher(launcher, monkeypatch, tmp_path):
    crashed = isolated(spec(techniques=(tech("tests.helpers:Segfault"),)), CPU, kind=launcher)
    assert crashed["message"] == "run process died: killed by signal SIGSEGV"
    assert "about to crash" in crashed["stderr_tail"]
    monkeypatch.setenv("BENCH_TEST_SLEEP", "60")
    monkeypatch.setenv("BENCH_TEST_PID_FILE", str(tmp_path / "pid"))
    # long enough to reach the prediction: a fresh interpreter's imports took over 3 s on a busy
    # 2-core CI
    limit = 3 if launcher == "fork" else 20
    hung = isolated(
        spec(techniques=(tech("tests.helpers:Sleep"),), timeout_s=limit), CPU, kind=launcher
    )
    assert hung["status"] == "timeout" and hung["message"].startswith(
        f"stopped after {limit} s in its predicting its peak"
    )
    assert "running the same command again retries it, and --timeout SECONDS" in hung["message"]
    # stopped at its time: the sleeping process is gone, not waited for
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "pid").read_text()), 0)


def test_the_fork_server_refuses_a_child_that_inherited_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="--launcher fresh"):
        launch.refuse_inherited_cuda()


LAUNCH_TWO_ON_CUDA = """
import json, torch
from bench.launch import detect, process
from tests.helpers import isolated
from tests.helpers import spec
assert process.fork_works_on_cuda() is None
gpu = detect("cuda")  # the card's name through NVML, as a campaign reads it
big, small = (isolated(spec(batch_size=n), gpu) for n in (64, 2))
print(json.dumps([big["launcher"], small["launcher"], big["peak_allocated_bytes"],
                  small["peak_allocated_bytes"], torch.cuda.is_initialized()]))
"""


@pytest.mark.cuda
def test_a_forked_child_can_use_the_gpu_and_starts_with_zeroed_peaks():
    """In a fresh interpreter, as a campaign is: pytest's own process has used CUDA in other
    tests."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", LAUNCH_TWO_ON_CUDA],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    big_launcher, small_launcher, big, small, initialized = json.loads(out.stdout.splitlines()[-1])
    assert big_launcher == small_launcher == "fork"
    assert small < big
    assert initialized is False  # the launching process never started CUDA


def test_the_offline_wheel_script_installs_a_wheel_folder_into_a_target(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    _tiny_wheel(wheels, "benchdemo", "0.1")
    env = {
        "OFFLINE_WHEELS": str(wheels),
        "OFFLINE_SITE": str(site),
        "OFFLINE_PACKAGES": "benchdemo==0.1",
        "PATH": "/usr/bin:/bin",
    }
    done = subprocess.run(
        ["scripts/offline-wheels", "install", sys.executable],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (site / "benchdemo" / "__init__.py").read_text() == "VERSION = '0.1'\n"
    again = subprocess.run(
        ["scripts/offline-wheels", "install", sys.executable],
        capture_output=True,
        text=True,
        env=env | {"PYTHONPATH": str(site), "OFFLINE_SITE": str(tmp_path / "other")},
        timeout=120,
    )
    # the host's own copy is never shadowed
    assert "has every optional package already" in again.stdout


def _tiny_wheel(folder, name: str, version: str) -> None:
    import zipfile

    folder.mkdir()
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = '{version}'\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    files[f"{info}/RECORD"] = "".join(f"{p},,\n" for p in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)


def test_a_long_run_says_its_phase_at_least_every_heartbeat(monkeypatch):
    monkeypatch.setattr(local, "HEARTBEAT_S", 1.0)
    monkeypatch.setattr(local, "WATCH_S", 0.5)
    monkeypatch.setenv("BENCH_TEST_SLEEP", "4")
    said = []
    record = isolated(spec(techniques=(tech("tests.helpers:Sleep"),)), CPU, heartbeat=said.append)
    assert record["status"] == "ok" and len(said) >= 2
    # the phase and the time so far (the technique sleeps where it is applied: its prediction and
    # its build)
    phases = (
        r"(starting.*|predicting its peak|building the model|warm-up|instrumented step \(memory\)"
        r"|timed steps.*)"
    )
    assert all(re.fullmatch(phases + r" \(\dm\d\ds\)", s) for s in said), said
    assert any(s.startswith("building the model") for s in said) and any(
        s.startswith("predicting") for s in said
    )


@pytest.mark.fault("resources")
def test_a_fidelity_phase_cut_short_keeps_what_was_measured_before_it():
    run = spec(
        techniques=(tech("tests.helpers:DiesInFidelity"),),
        batch_size=2,
        fidelity_cpu=Fidelity(steps=2, seeds=1, batch_size=8),
    )
    record = isolated(run, CPU)
    assert (
        record["status"] == "ok" and record["peak_tensor_bytes"] > 0 and record["samples_per_s"] > 0
    )
    assert record["fidelity_error"] == "error: run process died: killed by signal SIGKILL"


@pytest.mark.fault("resources")
def test_a_run_the_hosts_oom_killer_ended_is_an_oom_with_the_memory_it_reached(monkeypatch):
    # /proc/vmstat's oom_kill before the run and after it: the kernel killed a process
    counts = iter([7, 8])
    monkeypatch.setattr(local, "oom_kills", lambda: next(counts))
    record = isolated(spec(techniques=(tech("tests.helpers:KilledByTheHost"),)), CPU)
    assert record["status"] == "oom" and record["message"].startswith(
        "killed by the host's OOM killer"
    )
    assert record["rss_peak_bytes"] > 2**20  # the run's process was looked at while it lived
    # no OOM kill: a SIGKILL from elsewhere stays an error
    monkeypatch.setattr(local, "oom_kills", lambda: 7)
    assert (
        isolated(spec(techniques=(tech("tests.helpers:KilledByTheHost"),)), CPU)["status"]
        == "error"
    )


@pytest.mark.fault("signals")
@pytest.mark.parametrize("gone", ["the sweep", "its folder"])
def test_a_run_whose_sweep_has_gone_does_not_start(gone, tmp_path):
    # A signal in bench's first seconds left its request with the fork server, which started the run
    # once its imports were done, after bench had exited: a traceback on the terminal, and a run
    # nobody waited for.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    env = {launch.SWEEP_PID: str(dead.pid if gone == "the sweep" else os.getpid())}
    log = tmp_path / ("stderr.txt" if gone == "the sweep" else "gone/stderr.txt")
    child = multiprocessing.get_context("fork").Process(
        target=launch._child, args=(["bench.worker", "x", "y"], env, str(log))
    )
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0 and not log.exists()  # it left at once: nothing run, nothing written
