"""The runner against runs that fail in every way a real one can; each run is a real process."""

import io
import multiprocessing.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench import results, resume
from bench.errors import BadInput
from bench.launch import Device
from bench.launch.local import Local
from bench.pace import Pace
from bench.provenance import device_name
from bench.record import Prediction, Record, Status, Timing
from bench.report import build_report
from bench.suite import Fidelity, Suite, load, select
from bench.sweep import MEMORY_SUMMARY, _outcome, finish, sweep
from tests.helpers import isolated, spec, tech

CPU = Device("cpu", "cpu")


def suite_of(*runs) -> Suite:
    return Suite(
        name="test",
        path=Path("test.toml"),
        model="vit-tiny",
        description="",
        baseline="baseline",
        runs=tuple(runs),
    )


@pytest.mark.fault("resources")
def test_a_run_that_runs_out_of_memory_is_recorded_as_oom_with_what_was_predicted_for_it():
    """The prediction stays in the record: an out-of-memory run is where a verdict is held to the
    card."""
    run = spec(techniques=(tech("tests.helpers:AllocateTooMuch"),))
    record = isolated(run, CPU)
    assert record["status"] == "oom", record
    assert "memory" in record["message"]
    assert record["predicted_status"] == "ok" and record["predicted_peak_tensor_bytes"] > 0
    ahead = Record(prediction=Prediction(status=Status.OK, peak_tensor_bytes=123))
    record = isolated(run, CPU, prediction=ahead)
    assert record["predicted_status"] == "ok" and record["predicted_peak_tensor_bytes"] == 123


@pytest.mark.fault("resources")
def test_a_crash_by_signal_is_an_error_with_the_tail_of_its_output():
    record = isolated(spec(techniques=(tech("tests.helpers:Segfault"),)), CPU)
    assert record["status"] == "error"
    assert record["message"] == "run process died: killed by signal SIGSEGV"
    assert "about to crash" in record["stderr_tail"]


def test_an_inapplicable_technique_is_unsupported_with_its_reason():
    record = isolated(spec(techniques=(tech("tests.helpers:Unavailable"),)), CPU)
    assert record["status"] == "unsupported"
    assert "pip install nothing-real" in record["message"]


def test_sweep_continues_past_failures_and_stores_every_record(tmp_path):
    runs = [
        spec(name="broken", techniques=(tech("tests.helpers:Segfault"),)),
        spec(name="baseline"),
    ]
    records = sweep(suite_of(*runs), Local(CPU), tmp_path)
    assert [r["status"] for r in records] == ["error", "ok"]
    stored = results.load_records(tmp_path / "test")
    assert {r["run"]: r["status"] for r in stored} == {"broken": "error", "baseline": "ok"}
    ok = next(r for r in stored if r["status"] == "ok")
    assert (
        ok["peak_tensor_bytes"] > 0 and ok["samples_per_s"] > 0 and "peak_allocated_bytes" not in ok
    )
    assert ok["device"] == "cpu" and ok["torch_version"] and ok["git_revision"]


def test_a_selected_run_keeps_its_place_in_the_suite(tmp_path):
    full = suite_of(spec(name="baseline"), spec(name="second"), spec(name="third"))
    (record,) = [
        r for r in sweep(select(full, ["third"]), Local(CPU), tmp_path) if r["run"] == "third"
    ]
    # reports list runs in the file's order, not the order they last ran
    assert record["run_index"] == 3


def test_resume_skips_stored_runs_unless_the_spec_or_device_changed(tmp_path):
    base = spec(name="baseline")
    sweep(suite_of(base), Local(CPU), tmp_path)
    path = results.record_path(tmp_path, "test", "cpu", "baseline")
    first = path.stat().st_mtime_ns
    sweep(suite_of(base), Local(CPU), tmp_path)
    assert path.stat().st_mtime_ns == first  # kept
    sweep(suite_of(spec(name="baseline", lr=5e-4)), Local(CPU), tmp_path)
    assert path.stat().st_mtime_ns != first  # edited entry: measured again
    again = path.stat().st_mtime_ns
    sweep(suite_of(spec(name="baseline", lr=5e-4)), Local(CPU), tmp_path, force=True)
    assert path.stat().st_mtime_ns != again  # --force


@pytest.mark.fault("signals")
@pytest.mark.slow
def test_interrupted_sweep_keeps_finished_records_and_resumes(tmp_path):
    suite = tmp_path / "s.toml"
    suite.write_text(
        'model = "vit-tiny"\nbaseline = "baseline"\n'
        "[shapes.gpu]\nbatch_size = 4\nimage_size = 32\n"
        "[shapes.cpu]\nbatch_size = 4\nimage_size = 32\nwarmup_steps = 1\nmeasure_steps = 1\n"
        # a fidelity phase of its own, short: the default's 3 seeds of 100 steps took 15 s of a
        # loaded machine
        "[fidelity]\nsteps = 2\nseeds = 2\nbatch_size = 8\nimage_size = 32\n"
        '[[runs]]\nname = "baseline"\ntechniques = []\n'
        '[[runs]]\nname = "slow"\ntechniques = ["tests.helpers:Sleep"]\n'
    )
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "run",
        str(suite),
        "--device",
        "cpu",
        "--results",
        str(tmp_path / "r"),
    ]
    env = os.environ | {"BENCH_TEST_SLEEP": "120"}
    # A shell that starts the tests in the background (`make test &`) leaves SIGINT ignored, and
    # Python then installs no KeyboardInterrupt handler: give the sweep the default disposition a
    # terminal has.
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    done = results.record_path(tmp_path / "r", "s", device_name("cpu"), "baseline")
    seen = ""
    for line in proc.stdout:  # wait until the slow run has started, however loaded the machine is
        seen += line
        if "[2/2] slow: running" in line:
            break
    time.sleep(2)  # inside the slow run's process
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    out = seen + out
    assert proc.returncode == 130, out
    assert "finished runs are stored" in out
    assert [p.name for p in done.parent.glob("*.json")] == ["baseline.json"]
    kept = done.stat().st_mtime_ns
    env["BENCH_TEST_SLEEP"] = "0"
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[1/2] baseline: kept stored record (ok)" in out.stderr
    assert done.stat().st_mtime_ns == kept and (done.parent / "slow.json").exists()


def test_a_terminated_sweep_takes_its_run_down_with_it(tmp_path):
    """SIGTERM (kill, a batch scheduler's time limit) must not leave the run's process behind."""
    suite = tmp_path / "s.toml"
    suite.write_text(
        'model = "vit-tiny"\nbaseline = "slow"\n'
        "[shapes.gpu]\nbatch_size = 4\nimage_size = 32\n"
        "[shapes.cpu]\nbatch_size = 4\nimage_size = 32\n"
        '[[runs]]\nname = "slow"\ntechniques = ["tests.helpers:Sleep"]\n'
    )
    pid_file = tmp_path / "worker.pid"
    env = os.environ | {"BENCH_TEST_SLEEP": "120", "BENCH_TEST_PID_FILE": str(pid_file)}
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "run",
        str(suite),
        "--device",
        "cpu",
        "--results",
        str(tmp_path / "r"),
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 120
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    worker = int(pid_file.read_text())
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in out, out
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)


@pytest.mark.fault("signals")
@pytest.mark.slow
def test_a_sweep_stopped_in_a_runs_fidelity_phase_stores_what_it_measured_and_measures_it_again(
    tmp_path,
):
    """Ctrl-C or SIGTERM in the fidelity phase, minutes after the memory and speed were measured,
    threw them away with the run's temporary folder. They are stored, marked, and the next sweep
    measures the run again."""
    suite = tmp_path / "s.toml"
    suite.write_text(
        'model = "vit-tiny"\nbaseline = "slow"\n'
        "[shapes.gpu]\nbatch_size = 2\nimage_size = 32\n"
        "[shapes.cpu]\nbatch_size = 2\nimage_size = 32\nwarmup_steps = 1\nmeasure_steps = 1\n"
        "[fidelity]\nsteps = 2\nseeds = 2\nbatch_size = 8\nimage_size = 32\n"
        '[[runs]]\nname = "slow"\ntechniques = ["tests.helpers:SleepsInFidelity"]\n'
    )
    pid_file = tmp_path / "fidelity.pid"
    env = os.environ | {"BENCH_TEST_SLEEP": "120", "BENCH_TEST_PID_FILE": str(pid_file)}
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "run",
        str(suite),
        "--device",
        "cpu",
        "--results",
        tmp_path / "r",
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 120
    while not pid_file.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "stored, fidelity phase cut short" in out, out
    path = results.record_path(tmp_path / "r", "s", device_name("cpu"), "slow")
    stored = results.read(path)
    assert (
        stored["status"] == "ok" and stored["peak_tensor_bytes"] > 0 and stored["samples_per_s"] > 0
    )
    assert stored["fidelity_interrupted"] and stored["fidelity_error"].startswith("interrupted")
    env["BENCH_TEST_SLEEP"] = "0"
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "re-measured: its fidelity phase was interrupted" in again.stderr
    assert (
        "fidelity_interrupted" not in results.read(path)
        and results.read(path)["accuracy"] is not None
    )


def test_cpu_device_name_carries_the_processor_thread_count_and_vector_instructions():
    # Stored CPU records must not be reused on another processor, thread count or instruction set
    # (bf16's speed).
    name = device_name("cpu")
    isa = torch.backends.cpu.get_cpu_capability()
    assert name.endswith(f", {torch.get_num_threads()} threads, {isa}") and not name.startswith(",")


def test_records_carry_the_accuracy_delta_and_the_baselines_noise_band(tmp_path):
    suite = tmp_path / "fid.toml"
    suite.write_text(
        'model = "vit-tiny"\nbaseline = "baseline"\n'
        "[shapes.gpu]\nbatch_size = 4\nimage_size = 16\n"
        "[shapes.cpu]\nbatch_size = 4\nimage_size = 16\nwarmup_steps = 1\nmeasure_steps = 1\n"
        "[fidelity]\nsteps = 60\nseeds = 3\nimage_size = 16\n"
        '[[runs]]\nname = "baseline"\ntechniques = []\n'
        '[[runs]]\nname = "checkpoint"\ntechniques = ["checkpoint"]\n'
        '[[runs]]\nname = "frozen"\ntechniques = ["tests.helpers:ZeroLearningRate"]\n'
        '[[runs]]\nname = "skipped"\nfidelity = false\ntechniques = ["checkpoint"]\n'
    )
    base, ckpt, frozen, skipped = sweep(load(suite), Local(Device("cpu", "cpu")), tmp_path / "r")
    assert "accuracy_delta" not in ckpt  # derived when reporting, from the baseline as it is then
    table = results.to_frame(results.load_records(tmp_path / "r" / "fid")).set_index("run")
    assert len(base["accuracy_seeds"]) == 3 and table.loc["baseline", "accuracy_band"] == max(
        base["accuracy_seeds"]
    ) - min(base["accuracy_seeds"])
    assert (
        table.loc["checkpoint", "accuracy_delta"] == 0.0
        and not table.loc["checkpoint", "outside_band"]
    )
    assert table.loc["frozen", "accuracy_delta"] < -0.2 and table.loc["frozen", "outside_band"]
    assert "accuracy" not in skipped and skipped["status"] == "ok"
    # Where the time went: the whole process covers its prediction, measurement and fidelity phase
    # (wall_s is rounded to 0.1 s, the parts to 0.01 s each: the roundings' most is allowed).
    assert (
        base["wall_s"] + 0.08 >= base["prediction_s"] + base["measure_s"] + base["fidelity_s"] > 0
    )
    assert "fidelity_s" not in skipped


def test_snapshot_is_ignored_on_a_cpu_and_the_log_says_so(tmp_path):
    suite = Suite(
        name="s",
        path=tmp_path / "s.toml",
        model="vit-tiny",
        description="",
        baseline="run",
        runs=(spec(name="run", batch_size=4),),
    )
    log = io.StringIO()
    (record,) = sweep(suite, Local(CPU, snapshot=True), tmp_path, log=log)
    assert record["status"] == "ok" and "snapshot" not in record
    assert not list(tmp_path.rglob("*.pickle"))
    assert "--snapshot: the allocator history is CUDA's; none is saved on cpu" in log.getvalue()


@pytest.mark.fault("stored data")
def test_an_unreadable_record_is_moved_aside_and_the_run_measured_again(tmp_path, capsys):
    suite = Suite(
        name="test",
        path=tmp_path / "s.toml",
        model="vit-tiny",
        description="",
        baseline="run",
        runs=(spec(name="run", batch_size=4),),
    )
    path = results.record_path(tmp_path, "test", "cpu", "run")
    path.parent.mkdir(parents=True)
    path.write_text("<<<<<<< HEAD\n")
    (record,) = sweep(suite, Local(CPU), tmp_path)
    assert record["status"] == "ok" and results.read(path)["run"] == "run"
    assert path.with_name("run.json.unreadable").read_text() == "<<<<<<< HEAD\n"
    assert f"{path}: unreadable record" in capsys.readouterr().err
    path.write_text(">>>>>>> other\n")  # a second conflict keeps the first one's bytes too
    sweep(suite, Local(CPU), tmp_path)
    assert path.with_name("run.json.unreadable-2").read_text() == ">>>>>>> other\n"
    assert path.with_name("run.json.unreadable").read_text() == "<<<<<<< HEAD\n"


def test_a_kept_record_without_a_snapshot_says_how_to_get_one(tmp_path):
    gpu, run = Device("cuda", "NVIDIA X"), spec(name="run", batch_size=4)
    path = results.record_path(tmp_path, "s", gpu.name, "run")
    results.write_atomic(
        path,
        {
            "suite": "s",
            "run": "run",
            "device": gpu.name,
            "status": "ok",
            "run_key": run.key(gpu.name),
        },
    )
    suite = Suite(
        name="s",
        path=tmp_path / "s.toml",
        model="vit-tiny",
        description="",
        baseline="run",
        runs=(run,),
    )
    log = io.StringIO()
    # nothing runs: the stored record is kept
    sweep(suite, Local(gpu, snapshot=True), tmp_path, log=log)
    assert (
        "[1/1] run: kept stored record (ok), no snapshot: --force re-measures it with one"
        in log.getvalue()
    )
    path.with_suffix(".snapshot.pickle").write_bytes(b"")
    sweep(suite, Local(gpu, snapshot=True), tmp_path, log=(log := io.StringIO()))
    assert "[1/1] run: kept stored record (ok)\n" in log.getvalue()


def test_the_progress_line_shows_an_untracked_peak_as_absent_and_the_accuracy_as_it_comes():
    ok = {"status": "ok", "run": "compile", "baseline": "baseline", "samples_per_s": 3.0}
    # a compiled model: no tracked step, not 0 MiB

    def said(*flat: dict) -> str:
        return _outcome(*map(Record.from_flat, flat))

    assert said(ok) == "ok, peak not tracked, 3.0 samples/s"
    ran = ok | {"peak_tensor_bytes": 3 * 2**20, "accuracy": 0.8523}
    base = ran | {"run": "baseline", "accuracy": 0.869}
    assert said(ran, base) == "ok, peak 3.0 MiB, 3.0 samples/s, accuracy 85.2% (-1.7 pt)"
    # no baseline measured yet
    assert said(ran) == "ok, peak 3.0 MiB, 3.0 samples/s, accuracy 85.2%"
    assert said(base, base).endswith("accuracy 86.9%")


def test_a_cuda_runs_memory_summary_is_saved_beside_its_record_and_linked_from_the_report(tmp_path):
    record = {
        "suite": "s",
        "run": "baseline",
        "baseline": "baseline",
        "device": "NVIDIA X",
        "status": "ok",
        "run_index": 1,
        "samples_per_s": 1.0,
        "peak_allocated_bytes": 2**20,
        MEMORY_SUMMARY: "|   PyTorch CUDA memory summary, device ID 0   |",
    }
    finish(Record.from_flat(record), [], tmp_path)
    path = results.record_path(tmp_path, "s", "NVIDIA X", "baseline")
    assert path.with_suffix(".memory.txt").read_text().startswith("|   PyTorch CUDA memory summary")
    stored = results.read(path)
    assert stored["memory_summary"] == "baseline.memory.txt" and MEMORY_SUMMARY not in stored
    build_report(tmp_path / "s")
    assert "[baseline](nvidia-x/baseline.memory.txt)" in (tmp_path / "s" / "report.md").read_text()
    assert (
        "<a href='nvidia-x/baseline.memory.txt'>baseline</a>"
        in (tmp_path / "s" / "report.html").read_text()
    )


@pytest.mark.fault("disk")
def test_a_record_that_cannot_be_written_is_kept_elsewhere_and_named(tmp_path, capsys, monkeypatch):
    # multiprocessing keeps its sockets in a folder it makes under the temporary folder once per
    # process: made under tmp_path, their paths would pass AF_UNIX's 108 characters for this
    # process's later tests too
    multiprocessing.util.get_temp_dir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "kept"))
    (tmp_path / "kept").mkdir()
    record = {
        "suite": "s",
        "run": "baseline",
        "baseline": "baseline",
        "device": "cpu",
        "status": "ok",
    }
    blocked = tmp_path / "results"
    blocked.write_text("a file where the results folder should be")
    finish(Record.from_flat(record), [], blocked)
    (kept,) = (tmp_path / "kept").glob("bench-unsaved-s-baseline-*.json")
    assert results.read(kept)["run"] == "baseline"
    assert f"the measurement is kept in {kept}" in capsys.readouterr().err


@pytest.mark.fault("disk")
def test_a_results_folder_that_cannot_be_written_stops_the_sweep_before_any_run(tmp_path):
    blocked = tmp_path / "results"
    blocked.write_text("a file where the results folder should be")
    with pytest.raises(BadInput, match=f"cannot write records in {blocked}/test/cpu"):
        sweep(suite_of(spec(name="baseline")), Local(CPU), blocked)


def test_a_failed_fidelity_phase_shows_in_the_progress_line_the_table_and_the_report(tmp_path):
    record = {
        "suite": "s",
        "run": "baseline",
        "baseline": "baseline",
        "device": "cpu",
        "status": "ok",
        "run_index": 1,
        "samples_per_s": 2.0,
        "peak_tensor_bytes": 2**20,
        "fidelity_error": "DataError: dataset 'mnist': expected 'digits'",
    }
    assert _outcome(Record.from_flat(record)).endswith(
        "fidelity phase failed: DataError: dataset 'mnist': expected 'digits'"
    )
    finish(Record.from_flat(record), [], tmp_path)
    build_report(tmp_path / "s")
    report = (tmp_path / "s" / "report.md").read_text()
    assert "| ok, fidelity failed |" in report
    assert "**baseline**: fidelity phase failed: DataError: dataset 'mnist'" in report
    assert "fidelity_error" in (tmp_path / "s" / "table.csv").read_text().splitlines()[0]


def test_a_first_timed_step_far_slower_than_the_rest_warns_that_warm_up_was_short():
    from bench.worker import _warm_up_check

    assert _warm_up_check([30.0, 10.0, 11.0], 1) is None
    warned = _warm_up_check([900.0, 10.0, 11.0], 1)
    assert (
        warned.startswith("the first timed step took 900 ms against 11 ms")
        and "raise warmup_steps" in warned
    )
    flat = {"status": "ok", "run": "r", "baseline": "r", "samples_per_s": 1.0, "warning": warned}
    assert _outcome(Record.from_flat(flat)).endswith(f"warning: {warned}")


@pytest.mark.fault("stored data")
def test_a_second_sweep_of_the_same_folder_is_refused_naming_the_first(tmp_path):
    suite = Suite(
        name="s",
        path=Path("s.toml"),
        model="vit-tiny",
        description="",
        baseline="run",
        runs=(replace(spec(batch_size=2), suite="s"),),
    )
    folder = results.suite_folder(tmp_path, "s", CPU.name)
    with results.sweeping([folder]):  # the first sweep, still measuring
        with pytest.raises(
            BadInput, match=rf"{folder} is being measured by another sweep \(pid {os.getpid()}"
        ):
            sweep(suite, Local(CPU), tmp_path)
    # once it is done, it may
    assert [r["status"] for r in sweep(suite, Local(CPU), tmp_path)] == ["ok"]


@pytest.mark.parametrize(
    "cpu_s, load, busy", [(3.8, 1.9, False), (1.0, 1.2, False), (1.0, 4.0, True)]
)
def test_a_cpu_run_says_when_the_machine_was_busy(cpu_s, load, busy, monkeypatch):
    # 2 threads for 2 s: 4 CPU-seconds were its share. A Python-bound step idles a thread on a quiet
    # machine too, so a low share alone is not a busy machine: more must have been runnable than
    # there are cores.
    from bench import worker

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    timing = worker.share(cpu_s, 2.0)
    assert timing == Timing(load_average=load, cpu_share=round(cpu_s / 4, 3), busy_machine=busy)


def _priced_suite(tmp_path):
    """Three runs a, b, c; a and b measured on another CPU (with their fidelity phases), c never."""
    fid = Fidelity(steps=2, seeds=1, batch_size=8)
    runs = tuple(
        replace(spec(name=n, batch_size=2, fidelity_cpu=fid), suite="s") for n in ("a", "b", "c")
    )
    suite = Suite(
        name="s", path=Path("s.toml"), model="vit-tiny", description="", baseline="a", runs=runs
    )
    for run, wall, fid in (("a", 600.0, 420.0), ("b", 300.0, 180.0)):
        record = {"suite": "s", "run": run, "device": OTHER, "device_type": "cpu", "status": "ok"}
        results.write_atomic(
            results.record_path(tmp_path, "s", OTHER, run),
            record | {"wall_s": wall, "fidelity_s": fid, "baseline": "a"},
        )
    return suite


OTHER = "Other CPU, 2 threads, AVX2"


def test_a_sweep_prices_every_run_from_the_records_another_cpu_made(tmp_path):
    """c has no record anywhere: it is priced as the median run there, not left out (a new CPU's
    first command said "about 5 min for the 14 of 36 runs recorded before" and took 19)."""

    suite = _priced_suite(tmp_path)
    todo = resume.plan(suite, CPU.name, tmp_path)
    assert Pace(todo, tmp_path, CPU.name, "cpu").estimate_line(todo) == (
        f"estimated: about 22 min for the 3 runs, from their records' wall times on {OTHER} (1 "
        "priced as a median run there); at that pace until the first runs here measure this "
        "machine's; 8 min of it without the fidelity phase (--no-fidelity); --only NAMES measures "
        "some of them"
    )
    quick = resume.plan(suite, CPU.name, tmp_path, fidelity=False)
    said = Pace(quick, tmp_path, CPU.name, "cpu").estimate_line(quick)
    assert said.startswith("estimated: about 8 min for the 3 runs")


def test_the_time_left_follows_this_machines_pace_from_the_first_run_measured(tmp_path):
    """a took twice its time there: b and c are priced at twice theirs (c at the median run's)."""

    todo = resume.plan(_priced_suite(tmp_path), CPU.name, tmp_path)
    pace = Pace(todo, tmp_path, CPU.name, "cpu")
    assert pace.left(todo) == 600 + 300 + 450
    said = pace.measure(todo[0], Record.from_flat({"status": "ok", "wall_s": 1200.0}))
    assert said == f"pace: this machine took 2.00× the time {OTHER} took for a"
    assert pace.left(todo[1:]) == 2 * (300 + 450)
    assert (
        pace.measure(todo[1], Record.from_flat({"status": "unsupported", "wall_s": 3.0})) == ""
    )  # refused: no pace
    assert pace.left(todo[2:]) == 2 * 450


def test_runs_nothing_priced_are_priced_by_the_runs_measured_here(tmp_path):

    suite = _priced_suite(tmp_path / "elsewhere")
    todo = resume.plan(suite, CPU.name, tmp_path)
    pace = Pace(todo, tmp_path, CPU.name, "cpu")
    assert pace.estimate_line(todo) == "" and pace.left(todo) is None
    pace.measure(todo[0], Record.from_flat({"status": "ok", "wall_s": 40.0}))
    assert pace.left(todo[1:]) == 80.0


@pytest.mark.fault("stored data")
def test_a_diverged_figure_is_stored_as_null_and_named(tmp_path):
    import json

    record = {
        "suite": "s",
        "run": "r",
        "device": "cpu",
        "status": "ok",
        "baseline": "r",
        "final_loss": float("nan"),
        "accuracy_seeds": [0.5, float("inf")],
        "samples_per_s": 3.0,
    }
    finish(Record.from_flat(record), [], tmp_path)
    text = results.record_path(tmp_path, "s", "cpu", "r").read_text()
    stored = json.loads(
        text, parse_constant=lambda token: pytest.fail(f"bare {token} in the record")
    )
    assert stored["final_loss"] is None and stored["accuracy_seeds"] == [0.5, None]
    assert (
        stored["non_finite"] == ["accuracy_seeds", "final_loss"] and stored["samples_per_s"] == 3.0
    )
