import subprocess
import sys

import pandas as pd
import pytest

from bench import results
from bench.cli import main
from bench.report.compare import compare, load_side

MiB = 2**20


def rec(run, peak, step_ms, spread, device="NVIDIA H100 80GB HBM3", **extra):
    """A record whose step times have median ``step_ms`` and quartiles ``spread`` ms either side."""
    return {
        "suite": "demo",
        "run": run,
        "device": device,
        "device_type": "cuda",
        "status": "ok",
        "baseline": "baseline",
        "batch_size": 8,
        "techniques": run,
        "model": "m",
        "torch_version": "2.11",
        "git_revision": "abc",
        "peak_allocated_bytes": peak * MiB,
        "samples_per_s": 8000 / step_ms,
        "step_time_ms_median": step_ms,
        "step_time_ms_p25": step_ms - spread,
        "step_time_ms_p75": step_ms + spread,
    } | extra


def write(root, records):
    for r in records:
        results.write_atomic(results.record_path(root, r["suite"], r["device"], r["run"]), r)
    return root / "demo"


@pytest.fixture
def sides(tmp_path):
    before = write(
        tmp_path / "a",
        [
            rec("baseline", 1000, 100.0, 1.0, accuracy=0.90, accuracy_seeds=[0.90, 0.92]),
            rec("slower", 800, 100.0, 1.0),
            rec("noisy", 800, 100.0, 10.0),
            rec("fatter", 500, 100.0, 1.0),
            rec("rounding", 500, 100.0, 1.0),
            rec("worse", 500, 100.0, 1.0, accuracy=0.90),
        ],
    )
    after = write(
        tmp_path / "b",
        [
            rec("baseline", 1000, 100.0, 1.0, accuracy=0.91, accuracy_seeds=[0.91, 0.93]),
            rec("slower", 800, 120.0, 1.0),  # planted: 20% slower, well outside a ±1 ms spread
            rec("noisy", 800, 106.0, 10.0),  # 6% slower, but inside its own ±10 ms spread: noise
            rec("fatter", 560, 100.0, 1.0),  # planted: 12% more memory
            rec("rounding", 502, 100.0, 1.0),  # 0.4%: allocator rounding, not a change
            # planted: -10 pt against the baseline's 2 pt band
            rec("worse", 500, 100.0, 1.0, accuracy=0.80),
            rec("only-after", 1, 1.0, 0.1),
        ],
    )
    return before, after


def test_compare_flags_planted_regressions_and_not_noise(sides):
    table = compare(load_side(sides[0]), load_side(sides[1])).set_index("run")
    assert table["regression"].to_dict() == {
        "baseline": "",
        "fatter": "memory",
        "noisy": "",
        "rounding": "",
        "slower": "throughput",
        "worse": "accuracy",
    }
    assert table.loc["fatter", "memory_ratio"] == pytest.approx(1.12)
    assert table.loc["slower", "throughput_ratio"] == pytest.approx(100 / 120)


def test_compare_command_writes_table_and_plot_and_fails_in_strict_mode(sides, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", str(sides[0]), str(sides[1]), "--out", str(out)]) == 0
    assert main(["compare", str(sides[0]), str(sides[1]), "--out", str(out), "--strict"]) == 1
    assert {p.name for p in out.iterdir()} == {
        "compare.md",
        "compare.csv",
        "compare.png",
        "compare.svg",
    }
    text, said = capsys.readouterr()
    # a run without its pair, said aloud
    assert said.count("only in B (not compared): demo/only-after") == 2
    assert "| demo | slower |" in text and "⚠ throughput" in text and "4 regressed" not in text
    assert "3 regressed beyond their spread: fatter, slower, worse." in text
    # only-after has no pair
    assert "Throughput × over the 6 runs: median 1.000, from 0.833 to 1.000." in text
    assert len(pd.read_csv(out / "compare.csv")) == 6


def test_strict_can_gate_some_kinds_only(sides, tmp_path, capsys):
    common = ["compare", str(sides[0]), str(sides[1]), "--out", str(tmp_path / "cmp"), "--strict"]
    assert main(common + ["memory,accuracy"]) == 1  # fatter, worse
    assert main(common + ["throughput"]) == 1  # slower
    only_slower = write(tmp_path / "c", [rec("slower", 800, 120.0, 1.0)])
    # a shared machine's load does not fail the gate
    assert (
        main(
            [
                "compare",
                str(sides[0]),
                str(only_slower),
                "--out",
                str(tmp_path / "cmp"),
                "--strict",
                "memory,accuracy",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(common + ["memroy"]) == 2
    assert (
        "--strict memroy: unknown 'memroy'; expected some of memory, throughput, accuracy"
        in capsys.readouterr().err
    )


def test_a_folder_with_several_devices_must_name_one(tmp_path, capsys):
    root = write(
        tmp_path, [rec("baseline", 1, 1.0, 0.1), rec("baseline", 1, 1.0, 0.1, device="cpu")]
    )
    assert main(["compare", str(root), str(root)]) == 2
    assert "--device" in capsys.readouterr().err
    assert len(load_side(root, "h100")) == 1


def test_compare_starts_without_importing_torch(sides, tmp_path):
    """It only reads records: on a laptop holding results, torch's import would be most of its
    time."""
    code = (
        "import sys; from bench.cli import main; rc = main(sys.argv[1:]); sys.exit(rc if 'torch' "
        "not in sys.modules else 99)"
    )
    args = ["compare", str(sides[0]), str(sides[1]), "--out", str(tmp_path / "c")]
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.fault("stored data")
def test_a_backup_copy_and_fit_rows_in_the_tree_are_not_read_as_the_suites_records(
    sides, tmp_path, capsys
):
    import shutil

    before, after = sides
    shutil.copytree(before, before.parent / "demo-backup")  # the same records, another folder name
    device = next(before.iterdir())
    (device / "fit").mkdir()
    # a bench fit row
    results.write_atomic(device / "fit" / "baseline.json", rec("baseline", 1, 1.0, 0.1))
    table = compare(load_side(before.parent), load_side(after))
    assert len(table) == 6 and table.set_index("run").loc["baseline", "peak_a"] == 1000 * MiB
    assert len(compare(load_side(device), load_side(after))) == 6
