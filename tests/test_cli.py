import json
import multiprocessing.util
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch

from bench import results
from bench.cli import main, parser
from bench.predict import RESERVE
from bench.report.figures import figures_page
from bench.report.tables import summary
from bench.results import to_frame


def bench(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "bench", *args], capture_output=True, text=True, cwd=cwd
    )


def test_validate_accepts_every_shipped_suite(capsys):
    assert main(["validate"]) == 0
    assert "ok: suites/resnet.toml" in capsys.readouterr().out


def test_bad_suite_exits_2_listing_every_problem_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        'model = "vit-tiny"\nbaseline = "baseline"\nextra = 1\n[[runs]]\nname = "baseline"\n'
        'techniques = [{ name = "accumulate", micro_batches = 0 }]\n'
    )
    out = bench("run", str(bad), "--results", str(tmp_path / "results"))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert f"{bad}: extra: unknown key" in out.stderr
    assert f"{bad}: shapes: required table" in out.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_no_fidelity_measures_without_the_accuracy_phase(tmp_path):
    out = bench(
        "run",
        "smoke",
        "--only",
        "baseline",
        "--device",
        "cpu",
        "--no-fidelity",
        "--results",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    (record,) = results.load_records(tmp_path / "smoke")
    assert record["status"] == "ok" and record["peak_tensor_bytes"] > 0
    assert "accuracy" not in record and "fidelity_cpu" not in record["spec"]
    # the terminal answers what to use on this device, as the report's first screen does
    assert f"What to use on {record['device']} (1 of the suite's 4 entries recorded" in out.stdout
    # every page the records feed is current: the report, the overview and the figures page
    assert {"report.md", "table.csv"} <= {p.name for p in (tmp_path / "smoke").iterdir()}
    assert (tmp_path / "overview" / "overview.md").exists()
    table = summary(to_frame(results.load_records(tmp_path / "smoke")))
    assert (tmp_path / "figures.md").read_text() == figures_page({"smoke": table}, {"smoke": 4})


def test_list_shows_techniques_with_their_options(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "amp: `torch.autocast` over forward and loss" in out
    assert "micro_batches (int, default 2): micro-batches per optimizer step" in out


def test_report_of_a_suite_never_run_exits_2(tmp_path, capsys):
    assert main(["report", "smoke", "--results", str(tmp_path)]) == 2
    assert "run `make bench SUITE=smoke` first" in capsys.readouterr().err
    assert main(["report", "nothing", "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "make bench SUITE=nothing" not in err and "no suite suites/nothing.toml either" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_exits_2_and_writes_nothing(tmp_path, capsys):
    assert main(["run", "smoke", "--device", "cuda", "--results", str(tmp_path / "r")]) == 2
    assert "--device cuda, but torch" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_torchaos_pytree_deprecation_lines_are_dropped_and_nothing_else(caplog):
    import logging

    import bench  # noqa: F401  (installs the filter)

    pytree = logging.getLogger("torch.utils._pytree")
    with caplog.at_level(logging.WARNING, logger="torch.utils._pytree"):
        pytree.warning(
            "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by "
            "torch.compile as an opaque value type."
        )
        pytree.warning("another warning")
    assert [r.getMessage() for r in caplog.records] == ["another warning"]


def test_compare_names_a_folder_that_does_not_exist(tmp_path, capsys):
    assert (
        main(
            ["compare", str(tmp_path / "nowhere"), "results/smoke", "--out", str(tmp_path / "out")]
        )
        == 2
    )
    assert f"{tmp_path / 'nowhere'}: no such folder" in capsys.readouterr().err


def test_make_keeps_the_users_own_pythonpath_after_the_checkout():
    shown = subprocess.run(
        ["make", "-n", "bench", "PYTHON=python3", "SUITE=mine"],
        capture_output=True,
        text=True,
        env=os.environ | {"PYTHONPATH": "/my/techniques"},
        check=True,
    ).stdout
    assert "PYTHONPATH=.:.wheels/site:/my/techniques python3 -m bench run mine" in shown


@pytest.mark.fault("cli values")
def test_sweep_flags_a_slurm_sweep_would_ignore_are_refused(tmp_path, capsys):
    assert (
        main(
            [
                "run",
                "smoke",
                "--slurm",
                "cluster=local",
                "--launcher",
                "fresh",
                "--predict-jobs",
                "2",
                "--results",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "--launcher, --predict-jobs: for local sweeps only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "smoke", "--predict-jobs", "-1"])
    assert "expected a whole number of at least 0" in capsys.readouterr().err


@pytest.mark.fault("cli values")
@pytest.mark.parametrize("nproc", ["0", "1", "-3", "65537", "eight", "٣", "３"])
def test_predict_refuses_a_world_size_out_of_range(capsys, nproc):
    with pytest.raises(SystemExit) as info:
        main(["predict", "dist-smoke", "--nproc", nproc])
    assert info.value.code == 2
    assert "expected a number of processes from 2 to 65,536" in capsys.readouterr().err


def test_predict_spans_the_distributed_entries_over_nproc(capsys):
    """--nproc re-sizes the entries that run over processes (their rows say so, with each rank's
    traffic), and leaves a single-process entry as it is."""
    assert (
        main(["predict", "dist-smoke", "--nproc", "4", "--only", "single,fsdp", "--jobs", "1"]) == 0
    )
    out = capsys.readouterr()
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ") for line in out.out.splitlines()[2:]
    }
    header = out.out.splitlines()[0].split(" | ")
    assert (
        rows["fsdp"][header.index("ranks")] == "4" and rows["single"][header.index("ranks")] == "–"
    )
    assert float(rows["fsdp"][header.index("all-gather MiB/rank")]) > 0
    assert "Ranks: each multi-process entry is predicted as rank 0" in out.err


def test_make_refuses_its_variables_in_lower_case():
    # make's variables are case-sensitive: `make bench suite=resnet` ran smoke without a word
    out = subprocess.run(["make", "-n", "bench", "suite=resnet"], capture_output=True, text=True)
    assert (
        out.returncode != 0
        and "suite=resnet: make variables are upper case here, e.g. SUITE=resnet" in out.stderr
    )


@pytest.mark.fault("cli values")
@pytest.mark.parametrize("flag", ["--jobs", "--predict-jobs"])
def test_numeric_flags_take_ascii_digits_only(tmp_path, capsys, flag):
    """Python's int() reads any script's digits ('٣' is 3): a flag here takes ASCII digits, as the
    rest do."""
    command = "predict" if flag == "--jobs" else "run"
    with pytest.raises(SystemExit) as info:
        main([command, "smoke", flag, "٣", "--only", "baseline", "--results", str(tmp_path)])
    assert info.value.code == 2 and "expected a whole number" in capsys.readouterr().err


@pytest.mark.fault("cli values")
@pytest.mark.parametrize("value", ["0", "-5", "1e10", "soon", "٣٠"])
def test_timeout_flag_takes_seconds_up_to_a_week(capsys, value):
    with pytest.raises(SystemExit) as info:
        main(["run", "smoke", "--timeout", value])
    assert (
        info.value.code == 2
        and "expected seconds from 1 to 604800 (a week)" in capsys.readouterr().err
    )


@pytest.mark.fault("cli values")
def test_an_empty_budget_is_refused_not_ignored(capsys):
    assert main(["predict", "smoke", "--budget", ""]) == 2
    assert "--budget '': expected a size such as 16GiB" in capsys.readouterr().err


@pytest.mark.fault("cli values")
def test_report_reads_the_results_folder_even_where_a_folder_of_that_name_is_here(
    tmp_path, monkeypatch, capsys
):
    (tmp_path / "smoke").mkdir()  # ./smoke, not a results folder
    monkeypatch.chdir(tmp_path)
    assert main(["report", "smoke", "--results", str(tmp_path / "results")]) == 2
    assert f"no records under {tmp_path / 'results' / 'smoke'}/*/" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["advise", "bert-tiny", "--budget", "8GiB", "--out", "{ro}/advice"],
        [
            "compare",
            "results/smoke/nvidia-h100-80gb-hbm3",
            "results/smoke/nvidia-h100-80gb-hbm3",
            "--out",
            "{ro}/cmp",
        ],
        ["overview", "--results", "{ro}"],
        ["campaign", "smoke", "--archive", "{ro}/out/records.tgz", "--results", "{tmp}/r"],
        ["fit", "smoke", "--budget", "1GiB", "--results", "{ro}"],
    ],
    ids=["advise", "compare", "overview", "campaign", "fit"],
)
@pytest.mark.fault("disk")
def test_an_output_that_cannot_be_written_is_refused_before_any_work(argv, tmp_path, capsys):
    ro = tmp_path / "a-file"  # no folder can be made under a file, for root too (CI runs as root)
    ro.write_text("")
    assert main([a.format(ro=ro, tmp=tmp_path) for a in argv]) == 2
    said = capsys.readouterr().err
    assert "cannot write" in said and "make it writable or pass" in said, said


@pytest.mark.fault("disk")
def test_a_page_that_cannot_be_written_after_a_sweep_is_named_and_the_rest_are_written(
    tmp_path, capsys, monkeypatch
):
    # A disk that filled mid-sweep: the report rebuild died on ENOSPC with a traceback, a plot
    # half-written.
    from bench.report import build as report_build

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report_build, "build_report", full)
    monkeypatch.setattr("bench.report.build_report", full)
    assert (
        main(
            [
                "run",
                "smoke",
                "--only",
                "baseline",
                "--device",
                "cpu",
                "--no-fidelity",
                "--results",
                str(tmp_path),
            ]
        )
        == 0
    )
    said = capsys.readouterr().err
    assert (
        "warning: the report of smoke could not be written (No space left on device); the records "
        "are stored" in said
    )
    assert (tmp_path / "overview" / "overview.md").exists()  # the rest are written


def test_predict_on_a_card_gives_each_run_its_verdict_and_the_largest_batch_the_card_holds(capsys):
    assert main(["predict", "smoke", "--card", "t4", "--only", "baseline", "--jobs", "1"]) == 0
    out, err = capsys.readouterr()
    assert "| on NVIDIA T4 |" in out and "| fits |" in out and "largest batch" in out
    assert "NVIDIA T4: 14.58 GiB as CUDA sees it (a published out-of-memory message" in err
    assert "less 766 MiB for the CUDA context" in err


def test_predict_longest_on_a_card_keeps_each_length_it_tried_for_the_report(capsys, tmp_path):
    """The search's lengths go beside the suite's records, the answer's row among them: a model of
    512 positions that fits a T4 at every length holds all 512."""
    config = "suites/configs/tiny-llama"
    argv = ["predict", "--hf", config, "--card", "t4", "--longest", "--results", str(tmp_path)]
    assert main([*argv, "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 512 |" in out and "| 512: " in out  # and the largest batch at 512 tokens
    saved = pd.read_csv(tmp_path / "hf-tiny-llama" / "lengths-t4.csv")
    assert set(saved["card"]) == {"NVIDIA T4"} and saved["fits"].all()
    assert saved["seq_len"].max() == 512 == saved["longest_sequence"].iloc[0]


@pytest.mark.fault("cli values")
@pytest.mark.parametrize(
    "flags, said",
    [
        (["--card", "rtx5090"], "--card 'rtx5090': not a card known here"),
        (["--card", "t4", "--budget", "16GiB"], "--card and --budget: give one"),
        (["--longest"], "--longest searches the longest sequence a card holds: give --card"),
        (["--longest", "--card", "t4"], "--longest: resnet-tiny takes no sequence"),
    ],
)
def test_predict_refuses_an_unknown_card_or_a_card_beside_a_budget(capsys, flags, said):
    assert main(["predict", "smoke", *flags]) == 2
    assert said in capsys.readouterr().err


@pytest.mark.fault("cli values")
@pytest.mark.parametrize(
    "flags, said",
    [
        ([], "give one of --budget SIZE and --card NAME"),
        (["--card", "t4", "--device", "cpu"], "--card t4: a card's allocator is capped on a GPU"),
    ],
)
def test_fit_takes_a_budget_or_on_a_gpu_a_card(capsys, flags, said):
    assert main(["fit", "smoke", *flags]) == 2
    assert said in capsys.readouterr().err


@pytest.mark.fault("disk")
def test_an_archive_path_that_is_a_folder_is_refused_before_any_run(tmp_path, capsys):
    """It died renaming .archive-dir.tmp onto the folder after the first run, and measured nothing
    more."""
    (tmp_path / "out").mkdir()
    argv = [
        "campaign",
        "smoke",
        "--archive",
        str(tmp_path / "out"),
        "--results",
        str(tmp_path / "r"),
    ]
    assert main(argv) == 2
    said = capsys.readouterr().err
    assert f"--archive {tmp_path / 'out'} is a folder; name a file to write" in said
    assert not (tmp_path / "r").exists() and list((tmp_path / "out").iterdir()) == []


@pytest.mark.fault("disk")
@pytest.mark.parametrize("command", ["run", "overview"])
def test_a_dangling_link_as_the_results_folder_is_named_with_its_target(tmp_path, capsys, command):
    (tmp_path / "results").symlink_to(tmp_path / "gone")
    argv = ["run", "smoke", "--only", "baseline"] if command == "run" else ["overview"]
    assert main([*argv, "--results", str(tmp_path / "results")]) == 2
    said = capsys.readouterr().err
    assert (
        f"{tmp_path / 'results'} is a symbolic link to {tmp_path / 'gone'}, which does not exist"
        in said
    )
    assert "File exists" not in said


@pytest.mark.fault("disk")
def test_force_on_a_full_disk_says_so_and_leaves_no_marker(tmp_path, capsys, monkeypatch):
    from bench import resume

    def full(path, record):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(results, "write_atomic", full)
    argv = [
        "run",
        "smoke",
        "--only",
        "baseline",
        "--device",
        "cpu",
        "--force",
        "--results",
        str(tmp_path),
    ]
    assert main(argv) == 2
    said = capsys.readouterr().err
    assert (
        "--force: cannot write its marker" in said
        and "(No space left on device); free space in" in said
    )
    assert "Traceback" not in said and not list(tmp_path.rglob(resume.FORCE_MARKER))


@pytest.mark.fault("disk")
def test_a_sweep_that_could_not_store_a_measured_run_exits_non_zero(tmp_path, capsys, monkeypatch):
    """A full disk at the record: it was kept in the temporary folder and named, and the sweep
    exited 0."""
    import tempfile

    # multiprocessing keeps its sockets in a folder it makes under the temporary folder once per
    # process: made under tmp_path, their paths would pass AF_UNIX's 108 characters for this
    # process's later tests too
    multiprocessing.util.get_temp_dir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "kept"))
    (tmp_path / "kept").mkdir()
    write = results.write_atomic

    def full_at_records(path, record):
        if path.suffix == ".json" and path.parent.parent.name == "smoke":
            raise OSError(28, "No space left on device")
        write(path, record)

    monkeypatch.setattr(results, "write_atomic", full_at_records)
    argv = ["run", "smoke", "--only", "baseline", "--device", "cpu", "--no-fidelity", "--results"]
    assert main([*argv, str(tmp_path / "r")]) == 2
    said = capsys.readouterr().err
    assert f"error: 1 measured run(s) could not be stored in {tmp_path / 'r'}: baseline" in said
    assert len(list((tmp_path / "kept").glob("bench-unsaved-smoke-baseline-*.json"))) == 1


def test_the_reserves_default_in_every_commands_help_is_the_one_applied():
    """The help is written where the parser is built, which does not import the predictor: a
    default moved there (1 GiB to 1280 MiB after the ResNet-50 records) moves in the help too."""
    helps = [
        action.help
        for command in parser()._subparsers._group_actions[0].choices.values()  # noqa: SLF001
        for action in command._actions  # noqa: SLF001
        if "--reserve" in action.option_strings
    ]
    assert len(helps) >= 3 and all(f"default {RESERVE}" in h for h in helps)


def test_predict_zero_stages_adds_a_row_for_each_other_stage(capsys):
    """--zero-stages: a DeepSpeed entry at ZeRO-3 is predicted at 1 and 2 too, a row each, and at
    each stage a rank holds as that stage shards: whole parameters below 3, optimizer state
    partitioned at all three."""
    argv = ["predict", "dist-smoke", "--only", "zero-3", "--zero-stages", "--nproc", "4"]
    assert main([*argv, "--jobs", "1", "--json"]) == 0
    rows = {r["run"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    staged = [rows[name] for name in ("zero-3-zero1", "zero-3-zero2", "zero-3")]
    assert [r["world_size"] for r in staged] == [4, 4, 4]
    params = [r["param_bytes"] for r in staged]
    assert params[0] == params[1] > 3 * params[2]
    states = [r["optimizer_state_bytes"] for r in staged]
    assert max(states) - min(states) <= 64  # partitioned at every stage (padded as each pads)


@pytest.mark.fault("cli values")
def test_predict_zero_stages_refuses_a_suite_without_deepspeed(capsys):
    assert main(["predict", "smoke", "--zero-stages"]) == 2
    assert "--zero-stages: no run of smoke uses deepspeed" in capsys.readouterr().err
