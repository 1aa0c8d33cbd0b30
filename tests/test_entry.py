"""bench.entry.predict_step: the Python way in, its documented example run as written, and its
Prediction the one `bench predict` makes of the same job as a suite, to the byte."""

import dataclasses
import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from bench.cli import main
from bench.errors import BadInput

EXAMPLE = Path("docs/examples/python")


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    yield __import__("my_model")
    sys.modules.pop("my_model", None)


def test_the_documented_example_runs_as_written(example, capsys):
    runpy.run_path(str(EXAMPLE / "my_model.py"), run_name="__main__")
    assert "ok: peak 3.03 GiB allocated" in capsys.readouterr().out


def test_predict_step_is_the_clis_prediction_of_the_same_suite_to_the_byte(example, capsys):
    from bench.entry import predict_step

    images, labels = torch.randn(256, 3, 64, 64), torch.randint(10, (256,))
    mine = predict_step(
        example.MY_CNN,
        (images, labels),
        techniques=example.TECHNIQUES,
        optimizer=example.make_optimizer,
        card="h100",
    )
    argv = ["predict", str(EXAMPLE / "my_model.toml"), "--card", "h100", "--jobs", "1", "--json"]
    assert main(argv) == 0
    theirs = json.loads(capsys.readouterr().out)["runs"][0]
    figures = {f.name for f in dataclasses.fields(mine)} & theirs.keys()
    assert len(figures) > 20 and mine.verdict == "fits"
    assert mine.optimizer_state_bytes == sum(  # SGD's momentum: a buffer a parameter
        4 * p.numel() for p in example.build(None).parameters()
    )
    assert {f: getattr(mine, f) for f in figures} == {f: theirs[f] for f in figures}


@pytest.mark.fault("cli values")
@pytest.mark.parametrize(
    "given, said",
    [
        ({"batch": (torch.randn(8, 3, 32, 16),)}, "its inputs are (8, 3, 32, 16)"),
        ({}, "give a sample batch, or batch_size and image_size"),
        ({"batch_size": 8, "image_size": 32, "card": "tpu"}, "card 'tpu': not a card known"),
    ],
)
def test_a_job_that_is_not_one_is_refused_naming_what(example, given, said):
    from bench.entry import predict_step

    with pytest.raises(BadInput, match=said.replace("(", "\\(").replace(")", "\\)")):
        predict_step(example.MY_CNN, **given)


def test_techniques_that_are_not_a_job_are_the_suite_loaders_problems(example):
    """The suite predict_step writes is loaded as bench predict loads one: every problem at once."""
    from bench.entry import predict_step
    from bench.errors import SuiteError

    wrong = [{"name": "optimizer-from", "factory": "nowhere"}, {"name": "amp", "dtype": "int8"}]
    with pytest.raises(SuiteError) as raised:
        predict_step(example.MY_CNN, batch_size=8, image_size=32, techniques=wrong)
    said = str(raised.value)
    assert "factory must name a function as module:NAME" in said and "int8" in said


def test_your_optimizer_beside_another_technique_that_makes_one_is_refused(example):
    """optimizer-from makes the run's optimizer: a technique that makes one too is refused at load,
    by the check every optimizer-making technique shares."""
    from bench.entry import predict_step
    from bench.errors import SuiteError

    with pytest.raises(SuiteError, match="optimizer-from"):
        predict_step(
            example.MY_CNN,
            batch_size=8,
            image_size=32,
            techniques=[{"name": "optimizer", "kind": "sgd"}],
            optimizer=example.make_optimizer,
        )
