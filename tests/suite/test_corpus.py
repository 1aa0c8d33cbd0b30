"""Malformed suites, as users write them: each is refused at load with exit status 2, every problem
named (file and key), no traceback, and nothing written anywhere; and the names that load, in any
script, keep one record per run."""

import json

import pytest

from bench import cli, results
from bench.errors import SuiteError
from bench.provenance import device_name
from tests.helpers import write_suite

HEAD = 'model = "vit-tiny"\nbaseline = "baseline"\n'
SHAPES = (
    "[shapes.gpu]\nbatch_size = 4\nimage_size = 32\n[shapes.cpu]\nbatch_size = 2\nimage_size = 32\n"
)
RUN = '[[runs]]\nname = "baseline"\ntechniques = []\n'
GOOD = HEAD + SHAPES + RUN

# (what is wrong, the suite's text, a phrase the message must hold)
CORPUS = [
    (
        "name escapes results/",
        'name = "../../../tmp/x"\n' + GOOD,
        "name: '../../../tmp/x' cannot name a folder",
    ),
    ("empty name", 'name = ""\n' + GOOD, "name: '' cannot name a folder"),
    ("name with a separator", 'name = "a/b"\n' + GOOD, "cannot name a folder"),
    ("hidden-folder name", 'name = ".hidden"\n' + GOOD, "cannot name a folder"),
    ("name is a number", "name = 3\n" + GOOD, "name: expected str"),
    ("no model", 'baseline = "baseline"\n' + SHAPES + RUN, "model: required"),
    ("unknown model", GOOD.replace("vit-tiny", "vit-huge-xl"), "unknown model 'vit-huge-xl'"),
    ("unknown top key", "colour = 1\n" + GOOD, "colour: unknown key"),
    ("no shapes", HEAD + RUN, "shapes: required table"),
    ("no cpu shapes", HEAD + SHAPES.split("[shapes.cpu]")[0] + RUN, "shapes.cpu: required table"),
    ("negative batch", GOOD.replace("batch_size = 2", "batch_size = -2"), "shapes.cpu.batch_size"),
    (
        "string batch",
        GOOD.replace("batch_size = 2", 'batch_size = "2"'),
        "shapes.cpu.batch_size: expected int",
    ),
    (
        "unknown shape key",
        GOOD.replace("image_size = 32\n[shapes.cpu]", "image_size = 32\nseq = 3\n[shapes.cpu]"),
        "shapes.gpu.seq: unknown key",
    ),
    ("lr nan", "lr = nan\n" + GOOD, "lr: must be a finite number > 0, got nan"),
    ("lr negative", "lr = -1.0\n" + GOOD, "lr: must be a finite number > 0, got -1.0"),
    ("timeout inf", "timeout_s = inf\n" + GOOD, "timeout_s: must be a finite number > 0, got inf"),
    (
        "timeout past a week",
        "timeout_s = 1e10\n" + GOOD,
        "timeout_s: at most 604800 s (a week), got 1e+10",
    ),
    ("zero warm-up", "warmup_steps = 0\n" + GOOD, "warmup_steps: must be a finite number > 0"),
    ("no runs", HEAD + SHAPES, "the suite has no runs"),
    (
        "baseline missing",
        GOOD.replace('baseline = "baseline"', 'baseline = "fp32"'),
        "baseline: 'fp32' is not a run",
    ),
    ("duplicate run", GOOD + RUN, "duplicate run name 'baseline'"),
    (
        "unknown technique",
        GOOD + '[[runs]]\nname = "x"\ntechniques = ["gradient-magic"]\n',
        "unknown technique 'gradient-magic'",
    ),
    (
        "unknown option",
        GOOD + '[[runs]]\nname = "x"\ntechniques = [{ name = "amp", colour = 1 }]\n',
        "colour: unknown option of amp",
    ),
    (
        "option nan",
        GOOD + '[[runs]]\nname = "x"\ntechniques = [{ name = "optimizer", lr = nan }]\n',
        "lr: must be a finite number, got nan",
    ),
    (
        "option inf",
        GOOD + '[[runs]]\nname = "x"\ntechniques = [{ name = "optimizer", lr = inf }]\n',
        "lr: must be a finite number, got inf",
    ),
    (
        "technique twice",
        GOOD + '[[runs]]\nname = "x"\ntechniques = ["checkpoint", "checkpoint"]\n',
        "listed twice",
    ),
    (
        "own problems() raises",
        GOOD + '[[runs]]\nname = "x"\ntechniques = ["tests.helpers:RaisingChecks"]\n',
        "its problems() raised ZeroDivisionError: division by zero; fix "
        "tests.helpers:RaisingChecks's problems()",
    ),
    (
        "technique not importable",
        GOOD + '[[runs]]\nname = "x"\ntechniques = ["nowhere.at_all:Thing"]\n',
        "nowhere.at_all",
    ),
    (
        "fidelity dataset unknown",
        GOOD + '[fidelity]\ndataset = "mnist"\n',
        "fidelity.dataset: 'mnist' is not a dataset",
    ),
    (
        "fidelity lr negative",
        GOOD + "[fidelity]\nlr = -0.1\n",
        "fidelity.lr: must be a finite number > 0",
    ),
    (
        "fidelity lr nan",
        GOOD + "[fidelity]\nlr = nan\n",
        "fidelity.lr: must be a finite number > 0, got nan",
    ),
    (
        "fidelity folder missing",
        GOOD + '[fidelity]\ndataset = "imagefolder:/no/such/folder"\n',
        "fidelity.dataset: no folder '/no/such/folder'",
    ),
    ("fidelity one seed", GOOD + "[fidelity]\nseeds = 1\n", "fidelity.seeds: must be at least 2"),
    (
        "matrix without sizes",
        GOOD + "[matrix]\ntechniques = { a = [] }\n",
        "matrix: give batch_size",
    ),
    ("TOML syntax", GOOD + "[[runs]\n", "TOML syntax"),
]


@pytest.mark.fault("cli values")
@pytest.mark.parametrize("what,text,phrase", CORPUS, ids=[c[0] for c in CORPUS])
def test_a_malformed_suite_exits_2_naming_the_problem_and_writes_nothing(
    what, text, phrase, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # a write that escaped results/ would land beside the suite
    path = write_suite(tmp_path, text)
    code = cli.main(["run", str(path), "--device", "cpu", "--results", str(tmp_path / "results")])
    err = capsys.readouterr().err
    assert code == cli.EXIT_BAD_INPUT, err
    assert phrase in err and f"{path}: " in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["s.toml"]  # nothing written, anywhere


@pytest.mark.parametrize(
    "raw",
    [b"\x00\x01\xff\xfe binary", 'description = "caf\xe9"\n'.encode("latin-1")],
    ids=["binary", "latin-1"],
)
def test_a_suite_that_is_not_utf8_is_named_and_the_others_still_validate(
    raw, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "suites").mkdir()
    (tmp_path / "suites" / "bad.toml").write_bytes(raw)
    (tmp_path / "suites" / "good.toml").write_text(GOOD)
    assert cli.main(["validate"]) == cli.EXIT_BAD_INPUT
    out = capsys.readouterr()
    assert (
        "suites/bad.toml: not UTF-8 text: byte 0x" in out.err
        and "save the file as UTF-8" in out.err
    )
    assert "ok: suites/good.toml" in out.out and "Traceback" not in out.err


def test_a_huge_suite_shows_its_first_problems_and_counts_the_rest(tmp_path):
    runs = "".join(f'[[runs]]\nname = "r{i}"\ntechniques = ["nope"]\n' for i in range(200))
    with pytest.raises(SuiteError) as info:
        from bench.suite import load

        load(write_suite(tmp_path, GOOD + runs))
    assert len(info.value.problems) == 200
    text = str(info.value)
    assert text.count("unknown technique 'nope'") == SuiteError.SHOWN and text.endswith(
        "… and 150 more"
    )


def test_names_in_any_script_and_names_alike_keep_one_record_per_run(tmp_path, capsys):
    names = ["baseline", "базовый", "чекпоинт", "🚀", "🔥", "amp bf16", "AMP-bf16", "检查点"]
    text = (
        HEAD
        + SHAPES
        + "warmup_steps = 1\nmeasure_steps = 1\n"
        + "".join(f'[[runs]]\nname = "{n}"\ntechniques = []\n' for n in names)
    )
    code = cli.main(
        [
            "run",
            str(write_suite(tmp_path, text)),
            "--device",
            "cpu",
            "--results",
            str(tmp_path / "r"),
        ]
    )
    assert code == 0, capsys.readouterr().err
    stored = list((tmp_path / "r" / "s").glob("*/*.json"))
    assert sorted(json.loads(p.read_text())["run"] for p in stored) == sorted(names)
    # readable where it can be
    assert {p.stem for p in stored} >= {"baseline", "базовый", "чекпоинт", "检查点"}
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in stored)
    table = (tmp_path / "r" / "s" / "table.csv").read_text()
    assert all(n in table for n in names)


@pytest.mark.fault("stored data")
def test_a_record_of_the_wrong_shape_is_set_aside_and_measured_again(tmp_path, capsys):
    path = write_suite(
        tmp_path, GOOD.replace(SHAPES, SHAPES + "warmup_steps = 1\nmeasure_steps = 1\n")
    )
    record = results.record_path(tmp_path / "r", "s", device_name("cpu"), "baseline")
    record.parent.mkdir(parents=True)
    for wrong in ("[1, 2, 3]", '{"status": "ok"}'):
        record.write_text(wrong)
        # no record: named, no crash
        assert cli.main(["report", str(tmp_path / "r" / "s")]) == cli.EXIT_BAD_INPUT
        assert (
            cli.main(["run", str(path), "--device", "cpu", "--results", str(tmp_path / "r")]) == 0
        )
        assert results.read(record)["status"] == "ok"
        assert "unreadable record, treated as absent (not a record" in capsys.readouterr().err
    assert sorted(p.read_text() for p in record.parent.glob("baseline.json.unreadable*")) == [
        "[1, 2, 3]",
        '{"status": "ok"}',
    ]


# (the field, a value of the wrong type) as hand edits and other tools leave them
WRONG_TYPED = [
    ("accuracy", "87%"),
    ("run_index", "3"),
    ("device", 7),
    ("proof", ["a"]),
    ("spec", ["x"]),
    ("peak_tensor_bytes", 10**400),
    ("techniques", {"amp": 1}),
    ("samples_per_s", True),
]


@pytest.mark.fault("stored data")
@pytest.mark.parametrize("field, value", WRONG_TYPED, ids=[f for f, _ in WRONG_TYPED])
def test_a_record_with_a_wrong_typed_field_is_named_and_left_out_and_the_rest_reported(
    field, value, tmp_path, capsys
):
    from bench.report import build_report
    from bench.report.overview import build_overview

    good = {
        "suite": "s",
        "device": "cpu",
        "device_type": "cpu",
        "status": "ok",
        "baseline": "baseline",
        "batch_size": 8,
        "peak_tensor_bytes": 100,
        "samples_per_s": 2.0,
    }
    results.write_atomic(
        results.record_path(tmp_path, "s", "cpu", "baseline"), good | {"run": "baseline"}
    )
    bad = results.record_path(tmp_path, "s", "cpu", "bad")
    bad.write_text(
        json.dumps(good | {"run": "bad", field: value}, default=str)
        if field != "peak_tensor_bytes"
        else json.dumps(good | {"run": "bad"}).replace(
            '"peak_tensor_bytes": 100', f'"{field}": {value}'
        )
    )
    assert [r["run"] for r in results.load_records(tmp_path / "s")] == ["baseline"]
    said = capsys.readouterr().err
    assert (
        f"warning: {bad}: unreadable record" in said
        and f"a field of the wrong type: {field}: " in said
    )
    build_report(tmp_path / "s")  # the rest is reported, and the overview is made
    build_overview(tmp_path)


@pytest.mark.fault("stored data")
def test_the_overview_leaves_out_a_suite_whose_every_record_is_unreadable(tmp_path):
    from bench.report.overview import build_overview

    good = {
        "suite": "s",
        "device": "cpu",
        "device_type": "cpu",
        "status": "ok",
        "baseline": "baseline",
        "run": "baseline",
        "batch_size": 8,
        "peak_tensor_bytes": 100,
        "samples_per_s": 2.0,
    }
    results.write_atomic(results.record_path(tmp_path, "s", "cpu", "baseline"), good)
    results.write_atomic(
        results.record_path(tmp_path, "t", "cpu", "baseline"), good | {"suite": "t", "device": 7}
    )
    assert "| s |" in build_overview(tmp_path)[0].read_text()  # KeyError 'baseline' before
