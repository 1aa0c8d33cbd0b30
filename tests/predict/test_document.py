"""``bench predict --json``'s document (bench.predict.document), held to its schema for training on
a card, generation under a budget and a sharded entry; its committed schema is the one the code
writes."""

import io
import json
from pathlib import Path

from bench.cli import main
from bench.predict import suite_table
from bench.predict.document import KIND, document, schema
from tests.helpers import generation, spec, tech

SCHEMA = Path(__file__).resolve().parents[2] / "docs" / "predictions.schema.json"
JSON_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "null": type(None),
}


def errors(value, rule, at="$"):
    """Where ``value`` breaks ``rule``, for the keywords the schemas use (anyOf, const, type,
    required, additionalProperties, properties, items)."""
    found = []
    if "anyOf" in rule:
        if all(errors(value, r, at) for r in rule["anyOf"]):
            found.append(f"{at}: {value!r} is none of its choices")
        return found
    if "const" in rule and value != rule["const"]:
        found.append(f"{at}: {value!r} is not {rule['const']!r}")
    kinds = rule.get("type", [])
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if kinds and not any(_is(value, k) for k in kinds):
        found.append(f"{at}: {value!r} is not {kinds}")
    if isinstance(value, dict):
        found += [f"{at}: {k} missing" for k in rule.get("required", []) if k not in value]
        props = rule.get("properties", {})
        if rule.get("additionalProperties") is False:
            found += [f"{at}: {k} not in the schema" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                found += errors(v, props[k], f"{at}.{k}")
    if isinstance(value, list) and "items" in rule:
        for i, v in enumerate(value):
            found += errors(v, rule["items"], f"{at}[{i}]")
    return found


def _is(value, kind):
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, JSON_TYPES[kind])


def test_the_committed_schema_is_the_one_the_code_writes():
    """make docs writes it: a figure added to Prediction changes it."""
    assert json.loads(SCHEMA.read_text()) == schema()


def test_predict_json_is_one_document_on_stdout_that_holds_to_its_schema(capsys):
    """Training on a card: each run's figures, its verdict and largest batch; stdout holds the
    document alone (progress and assumptions go to stderr)."""
    argv = ["predict", "smoke", "--card", "t4", "--only", "baseline", "--jobs", "1", "--json"]
    assert main(argv) == 0
    made = json.loads(capsys.readouterr().out)
    assert errors(made, schema()) == []
    assert made["kind"] == KIND and made["card"]["name"] == "NVIDIA T4"
    (run,) = made["runs"]
    assert run["run"] == "baseline" and run["said_on_card"] == "fits"
    assert run["largest_batch"] > 0 and run["peak_reserved_bytes"] >= run["peak_tensor_bytes"]


def test_a_generation_under_a_budget_and_a_sharded_entry_hold_to_the_schema():
    runs = [
        generation(name="generate"),
        spec("bert-tiny", (tech("fsdp"),), nproc=2, batch_size=4, seq_len=16, name="sharded"),
        spec("bert-tiny", batch_size=4, seq_len=16, name="longest"),
    ]
    table = suite_table(runs, {}, 2**30, log=io.StringIO(), longest=True)
    made = document(table, "mixed", None, 2**30, "assumed", "abc123")
    assert errors(made, schema()) == []
    generate, sharded, longest = made["runs"]
    assert longest["longest_sequence"] == max(
        p["seq_len"] for p in longest["length_curve"] if p["fits"]
    )
    assert longest["batches_at_lengths"] == [
        {"seq_len": 512, "largest_batch": longest["batches_at_lengths"][0]["largest_batch"]}
    ]
    assert generate["longest_context"] > 0 and generate["peak_decode_bytes"] > 0
    assert sharded["world_size"] == 2 and sharded["fewest_ranks"] == 2
    assert "longest_sequence" not in generate  # not asked: no key, not a null
