"""What a sweep keeps and what it measures again, and a campaign's order over several suites."""

import io
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest

from bench import results, resume
from bench.launch import Device
from bench.launch.local import Local
from bench.provenance import device_name
from bench.suite import Fidelity, Suite
from bench.sweep import campaign, sweep
from tests.helpers import spec, tech

CPU = Device("cpu", "cpu")
CPU_NAME = device_name("cpu")


def suite_of(name: str, *runs) -> Suite:
    return Suite(
        name=name,
        path=Path(f"{name}.toml"),
        model="vit-tiny",
        description="",
        baseline="baseline",
        runs=tuple(replace(r, suite=name) for r in runs),
    )


def store(root: Path, suite: Suite, run, status: str, **extra) -> Path:
    path = results.record_path(root, suite.name, CPU.name, run.name)
    results.write_atomic(
        path,
        {
            "suite": suite.name,
            "run": run.name,
            "device": CPU.name,
            "status": status,
            "run_key": run.key(CPU.name),
            "baseline": "baseline",
        }
        | extra,
    )
    return path


def test_failures_that_may_be_transient_are_retried_and_deterministic_ones_kept(tmp_path):
    runs = [spec(name=n, batch_size=2) for n in ("baseline", "hit-oom", "killed", "slow")]
    suite = suite_of("s", *runs)
    for run, status in zip(suite.runs, ("ok", "oom", "error", "timeout")):
        store(tmp_path, suite, run, status)
    decided = {t.spec.name: t.measure for t in resume.plan(suite, CPU.name, tmp_path)}
    assert decided == {"baseline": False, "hit-oom": False, "killed": True, "slow": True}
    kept = {
        t.spec.name: t.measure for t in resume.plan(suite, CPU.name, tmp_path, keep_failures=True)
    }
    assert not any(kept.values())
    log = io.StringIO()
    records = sweep(suite, Local(CPU), tmp_path, log=log)
    assert {r["run"]: r["status"] for r in records} == {
        "baseline": "ok",
        "hit-oom": "oom",
        "killed": "ok",
        "slow": "ok",
    }
    assert "running (retried: the stored record is 'error'" in log.getvalue()


@pytest.mark.fault("signals")
def test_an_interrupted_force_sweep_resumes_instead_of_starting_over(tmp_path):
    runs = [spec(name="baseline", batch_size=2), spec(name="second", batch_size=2)]
    suite = suite_of("s", *runs)
    runs = suite.runs
    old = [store(tmp_path, suite, r, "ok", stored_at="2020-01-01T00:00:00+00:00") for r in runs]
    folder = results.suite_folder(tmp_path, "s", CPU.name)
    since = resume.forced_since(folder, force=True)  # a --force sweep began ...
    # ... measured the first, and stopped
    store(tmp_path, suite, runs[0], "ok", stored_at=since[:-6] + "9+00:00")
    decided = [t.measure for t in resume.plan(suite, CPU.name, tmp_path, forced_since=since)]
    assert decided == [False, True]  # the same command, with or without --force, goes on from there
    assert resume.forced_since(folder, force=False) == since
    # without --force: the marker still holds, so 'second' is re-measured
    sweep(suite, Local(CPU), tmp_path)
    assert results.read(old[1])["stored_at"] > since
    assert not (folder / resume.FORCE_MARKER).exists()  # complete: later sweeps keep records again
    assert not any(t.measure for t in resume.plan(suite, CPU.name, tmp_path))


def test_a_quick_look_without_fidelity_keeps_the_complete_record(tmp_path):
    full = spec(
        name="baseline", batch_size=2, fidelity_cpu=Fidelity(steps=2, seeds=1, batch_size=8)
    )
    suite = suite_of("s", full)
    path = store(tmp_path, suite, suite.runs[0], "ok", accuracy=0.5)
    (task,) = resume.plan(suite, CPU.name, tmp_path, fidelity=False)
    assert not task.measure and task.spec.fidelity_cpu is None
    (record,) = sweep(suite, Local(CPU), tmp_path, fidelity=False)
    assert record["accuracy"] == 0.5 and results.read(path)["accuracy"] == 0.5


def test_a_campaign_measures_runs_never_measured_here_before_the_others(tmp_path):
    first = suite_of(
        "first", spec(name="baseline", batch_size=2), spec(name="retried", batch_size=2)
    )
    second = suite_of("second", spec(name="baseline", batch_size=2))
    # measured here before: a retry waits for the new runs
    store(tmp_path, first, first.runs[1], "timeout")
    log = io.StringIO()
    records = campaign(
        [first, second], Local(CPU, predict_jobs=1), tmp_path, log=log, never_measured_first=True
    )
    order = [
        line.split("] ")[1].split(":")[0]
        for line in log.getvalue().splitlines()
        if ": running (" in line
    ]
    assert order == ["first/baseline", "second/baseline", "first/retried"]
    assert "left)" in log.getvalue()  # the ETA, from the runs measured so far
    assert all(
        r["predicted_ahead"] and r["predicted_status"] == "ok"
        for rs in records.values()
        for r in rs
    )


@pytest.mark.full  # 28 s: every suite measured, reported and drawn
def test_bench_campaign_measures_the_suites_then_writes_their_reports_and_the_figures(
    tmp_path, capsys
):
    from bench import cli

    root, archive = tmp_path / "r", tmp_path / "out" / "results.tgz"
    assert (
        cli.main(
            [
                "campaign",
                "smoke",
                "--device",
                "cpu",
                "--no-fidelity",
                "--results",
                str(root),
                "--archive",
                str(archive),
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert (
        "4 of 4 runs to measure" in err
        and f"the report of smoke: {root / 'smoke' / 'report.html'}" in err
    )
    assert (root / "smoke" / "report.html").exists() and (
        root / "overview" / "overview.html"
    ).exists()
    # coverage: all 4 entries
    assert f"| smoke | {CPU_NAME} | 4 | 4 | 4 |" in (root / "figures.md").read_text()
    with tarfile.open(archive) as tar:  # every record, as a leased machine hands it back
        assert sorted(Path(n).name for n in tar.getnames()) == sorted(
            p.name for p in root.glob("smoke/*/*.json")
        )
    assert (
        cli.main(["campaign", "smoke", "--device", "cpu", "--no-fidelity", "--results", str(root)])
        == 0
    )
    # the next lease resumes: nothing left here
    assert "0 of 4 runs to measure" in capsys.readouterr().err


@pytest.mark.fault("stored data")
def test_an_edit_that_cannot_change_the_figures_keeps_the_record(tmp_path):
    # the time limit, and on a CPU the GPU's shapes, change nothing a CPU run measures
    run = spec(name="baseline", batch_size=2)
    suite = suite_of("s", run)
    path = results.record_path(tmp_path, "s", CPU.name, "baseline")
    results.write_atomic(
        path,
        {
            "suite": "s",
            "run": "baseline",
            "device": CPU.name,
            "status": "ok",
            "run_key": suite.runs[0].measured_key(CPU.name, "cpu"),
            "baseline": "baseline",
        },
    )
    edited = suite_of("s", replace(run, timeout_s=5000.0, gpu=replace(run.gpu, batch_size=64)))
    assert not any(t.measure for t in resume.plan(edited, CPU.name, tmp_path))
    on_cpu = suite_of("s", replace(run, cpu=replace(run.cpu, batch_size=4)))
    assert all(t.measure for t in resume.plan(on_cpu, CPU.name, tmp_path))


def test_editing_your_own_technique_measures_the_run_again(tmp_path, monkeypatch):
    module = tmp_path / "my_tech.py"
    module.write_text(
        "from bench.techniques import Technique\n\nclass Mine(Technique):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    run = spec(name="mine", batch_size=2, techniques=(tech("my_tech:Mine"),))
    suite = suite_of("s", run)
    store(tmp_path, suite, suite.runs[0], "ok", run_key=suite.runs[0].measured_key(CPU.name, "cpu"))
    assert not any(t.measure for t in resume.plan(suite, CPU.name, tmp_path))
    module.write_text(module.read_text() + "    # edited: its step changed\n")
    (task,) = resume.plan(suite, CPU.name, tmp_path)
    assert (
        task.measure and "the code of the user's modules the run names has changed" in task.reason
    )


@pytest.mark.fault("stored data")
def test_a_record_measured_again_is_kept_in_superseded(tmp_path):
    suite = suite_of("s", spec(name="baseline", batch_size=2))
    old = store(
        tmp_path,
        suite,
        suite.runs[0],
        "ok",
        run_key="another-spec",
        stored_at="2020-01-01T00:00:00+00:00",
        samples_per_s=1.5,
    )
    sweep(suite, Local(CPU), tmp_path)
    (kept,) = (old.parent / results.SUPERSEDED).glob("*.json")
    assert (
        kept.name == "baseline.2020-01-01T000000+0000.json"
        and results.read(kept)["samples_per_s"] == 1.5
    )
    # reports read today's only
    assert [r["run"] for r in results.load_records(tmp_path / "s")] == ["baseline"]


@pytest.mark.fault("stored data")
def test_a_force_marker_that_holds_no_time_is_refused_naming_it(tmp_path):
    import pytest

    from bench.errors import BadInput

    folder = results.suite_folder(tmp_path, "s", CPU.name)
    folder.mkdir(parents=True)
    # cut off by a full disk: --force then measured nothing
    (folder / resume.FORCE_MARKER).write_text("")
    with pytest.raises(BadInput, match="holds no time a --force sweep began; remove it"):
        resume.forced_since(folder, force=True)
    (folder / resume.FORCE_MARKER).unlink()
    (folder / resume.FORCE_MARKER).mkdir()  # a folder in its place crashed every run of the suite
    with pytest.raises(BadInput, match="holds no time"):
        resume.forced_since(folder, force=False)


@pytest.mark.fault("resources")
def test_a_run_that_printed_a_flood_keeps_a_bounded_tail(tmp_path):
    from bench.launch import local

    log = tmp_path / "stderr.txt"
    log.write_bytes(b"x" * (8 * 2**20) + b"\nthe last words\n")
    tail = local._last_words(log)
    assert tail.endswith("the last words") and len(tail) <= local.STDERR_TAIL


def test_a_cuda_record_without_its_allocator_history_is_measured_again_after_the_new_runs(tmp_path):
    """The 12 H100 records from before runs saved their history cannot be replayed; a campaign
    re-measures them once the runs never measured are done. A CPU record never has one, and is
    kept."""
    suite = suite_of("s", *(spec(name=n, batch_size=2) for n in ("old", "traced", "on-cpu")))
    store(tmp_path, suite, suite.runs[0], "ok", device_type="cuda")
    store(
        tmp_path,
        suite,
        suite.runs[1],
        "ok",
        device_type="cuda",
        memory_history="traced.history.pickle.gz",
    )
    store(tmp_path, suite, suite.runs[2], "ok", device_type="cpu")
    old, traced, on_cpu = resume.plan(suite, CPU.name, tmp_path)
    assert (old.measure, traced.measure, on_cpu.measure) == (True, False, False)
    assert "holds no allocator history" in old.reason and not old.never_measured
