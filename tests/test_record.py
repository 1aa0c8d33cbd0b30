"""The typed record against every committed record, and the field reference generated from it."""

import ast
import json
from pathlib import Path

import pytest

from bench.record import DERIVED, KEY, STATUSES, Record, label, migrate, reference
from bench.suite.schema import TABLES

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = sorted(ROOT.glob("results/*/*/*.json"))


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(ROOT / "results")))
def test_every_committed_record_loads_into_its_groups_and_stores_back_as_it_was(path):
    stored = json.loads(path.read_text())
    record = Record.from_flat(stored)
    assert record.extra == {}, f"fields no group documents: {sorted(record.extra)}"
    assert isinstance(record.identity.techniques, list)
    # Stored back: the same fields, less what is now derived when reporting and what had no value.
    kept = {k: v for k, v in migrate(stored).items() if v is not None}
    assert record.to_flat() == kept


def test_an_older_records_label_becomes_the_list_of_its_techniques_and_its_delta_is_dropped():
    old = {
        "suite": "s",
        "run": "r",
        "device": "cpu",
        "status": "ok",
        "techniques": "amp(dtype=bfloat16) + checkpoint",
        "accuracy_delta": -0.01,
        "accuracy_band": 0.02,
        "outside_band": False,
    }
    flat = migrate(old)
    assert flat["techniques"] == ["amp(dtype=bfloat16)", "checkpoint"] and not DERIVED & flat.keys()
    assert migrate(old | {"techniques": "baseline"})["techniques"] == []
    assert (
        label(flat["techniques"]) == "amp(dtype=bfloat16) + checkpoint" and label([]) == "baseline"
    )


def test_a_field_no_group_knows_is_kept_not_dropped():
    record = Record.from_flat(
        {"suite": "s", "run": "r", "device": "cpu", "status": "ok", "tomorrows_figure": 3}
    )
    assert record.extra == {"tomorrows_figure": 3} and record.to_flat()["tomorrows_figure"] == 3


def test_per_rank_figures_go_to_the_distributed_group():
    record = Record.from_flat(
        {
            "suite": "s",
            "run": "r",
            "device": "cpu",
            "status": "ok",
            "world_size": 2,
            "rank_peak_tensor_bytes": [1, 2],
        }
    )
    assert record.distributed.ranks == {"peak_tensor_bytes": [1, 2]}
    assert record.to_flat()["rank_peak_tensor_bytes"] == [1, 2]


def test_the_results_readme_holds_the_reference_generated_from_the_fields():
    text = (ROOT / "results" / "README.md").read_text()
    assert reference() in text, "results/README.md is stale: run make overview"


def _spelt(tree: ast.AST, keys: set[str], in_proof: bool = False) -> list[tuple[int, str]]:
    """String constants used as a record's key (a subscript, a .get, a dict's key) or compared as a
    status. A technique's proof is its own namespace (stored as ``<technique>.<key>``)."""
    found = []
    for node in ast.iter_child_nodes(tree):
        proof = in_proof or isinstance(node, ast.FunctionDef) and node.name == "proof"
        found += _spelt(node, keys, proof)
        named = (
            [node.slice]
            if isinstance(node, ast.Subscript)
            else node.args[:1]
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "get"
            else []
            if proof
            else node.keys
            if isinstance(node, ast.Dict)
            else node.comparators
            if isinstance(node, ast.Compare)
            else []
        )
        statuses = node.comparators if isinstance(node, ast.Compare) else []
        for c in named:
            if isinstance(c, ast.Constant) and (
                c.value in keys or c in statuses and c.value in STATUSES
            ):
                found.append((c.lineno, c.value))
    return found


def test_no_module_but_the_record_spells_a_record_key_or_a_status():
    """Code reads and writes a record's fields as ``KEY.<field>`` and compares statuses as
    ``Status``: a misspelt one fails at import, where a string would read None. Suite-file keys of
    the same name (``model``) are the suite's; an identity digest hashes a spec under the names its
    stored records were keyed with."""
    suite_keys = {key for table in TABLES.values() for key in table}
    keys = {k for k in vars(KEY) if not k.startswith("_")} - suite_keys
    found = [
        f"{rel}:{line}: {word!r}"
        for path in sorted((ROOT / "bench").rglob("*.py"))
        if (rel := str(path.relative_to(ROOT)))
        not in {"bench/record.py", "bench/spec.py", "bench/advise/predictions.py"}
        for line, word in _spelt(ast.parse(path.read_text()), keys)
    ]
    assert not found, found


def test_a_job_carries_the_prediction_made_ahead_to_the_worker_as_the_record_it_fills():
    from bench.record import Prediction, Status, Timing
    from bench.spec import Job
    from tests.helpers import spec

    made = Record(
        prediction=Prediction(status=Status.OK, peak_tensor_bytes=123, ahead=True),
        timing=Timing(prediction_s=1.5),
    )
    job = Job(spec=spec(), device_type="cpu", prediction=made, budget_bytes=2**20)
    again = Job.from_json(job.to_json())
    assert again.prediction.to_flat() == made.to_flat()
    assert again.spec == job.spec and again.budget_bytes == 2**20
    alone = Job.from_json(Job(spec=spec(), device_type="cpu").to_json())
    assert alone.prediction is None
