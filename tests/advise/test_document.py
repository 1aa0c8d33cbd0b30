"""``bench advise --json``'s document (bench.advise.document), held to its schema; its committed
schema is the one the code writes."""

import json
from pathlib import Path

import pytest

from bench.advise import Advice, source
from bench.advise.document import KIND, document, schema
from bench.advise.estimate import Accuracy, Estimate
from bench.advise.plans import Option, Plan
from bench.advise.search import Candidate, Search
from bench.cli import main
from bench.predict import predict
from tests.helpers import spec, tech
from tests.predict.test_document import errors

SCHEMA = Path(__file__).resolve().parents[2] / "docs" / "advice.schema.json"


def test_the_committed_schema_is_the_one_the_code_writes():
    assert json.loads(SCHEMA.read_text()) == schema()


def test_advice_as_a_document_holds_to_its_schema():
    """A plan that fits, ranked, with the prediction it stands on; none measured for accuracy."""
    baseline = predict(spec("bert-tiny"))
    checkpoint = predict(spec("bert-tiny", (tech("checkpoint"),)))
    plan = Candidate(
        plan=Plan((Option.of("checkpoint", "checkpoint"),)),
        predicted=checkpoint,
        speed=Estimate(factor=1.25, sources=("checkpoint: 0.80× counted",)),
        accuracy=Accuracy(delta=None, outside_band=False, unknown=("checkpoint",), sources=()),
        largest_batch=64,
    )
    advice = Advice(
        source=source("bert-tiny", None, None, "cuda"),
        device_type="cuda",
        budget=baseline.peak_tensor_bytes - 1,
        budget_text="99%",
        baseline=baseline,
        plans=[plan],
        search=Search(combinations=3, dominated=["bf16 (by bf16-pure)"]),
        estimator=None,
    )
    made = document(advice, "assumed", "abc123")
    assert errors(made, schema()) == []
    assert made["kind"] == KIND and made["baseline"]["peak_tensor_bytes"] > 0
    (only,) = made["plans"]
    assert only["techniques"] == ["checkpoint"] and only["throughput"] == 0.8
    assert only["headroom_bytes"] == advice.budget - checkpoint.peak_tensor_bytes


@pytest.mark.full
@pytest.mark.slow
def test_advise_json_is_one_document_on_stdout(capsys, tmp_path):
    """End to end on this CPU (about a minute on two cores): stdout holds the document alone."""
    argv = ["advise", "bert-tiny", "--device", "cpu", "--budget", "60%", "--top", "2"]
    assert main([*argv, "--jobs", "1", "--json", "--out", str(tmp_path)]) == 0
    made = json.loads(capsys.readouterr().out)
    assert errors(made, schema()) == []
    assert 1 <= len(made["plans"]) <= 2 and made["device_type"] == "cpu"
