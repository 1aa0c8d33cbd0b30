import re
from pathlib import Path

import pytest

from bench.suite import load
from bench.suite.schema import FIDELITY, RUNS, SHAPES, TOML, TOP, reference
from bench.suite.toml_text import to_toml
from tests.helpers import suite_problems, write_suite

ROOT = Path(__file__).resolve().parents[2]
SUITE = (
    'model = "bert-tiny"\nbaseline = "a"\n'
    "[shapes.gpu]\nbatch_size = 2\nseq_len = 8\n[shapes.cpu]\nbatch_size = 2\nseq_len = 8\n"
    '[[runs]]\nname = "a"\ntechniques = []\n'
)
# a value of the wrong type for each kind
WRONG = {str: "3", int: '"3"', float: '"3"', bool: '"yes"', list: '"a"', dict: "3"}


def test_the_docs_key_reference_is_the_schemas():
    assert reference() in (ROOT / "docs/suites.md").read_text(encoding="utf-8"), (
        "docs/suites.md's key reference is stale: run make docs"
    )


def test_a_file_with_every_default_loads_as_one_that_spells_them_out(tmp_path):
    spelt = "".join(
        f"{name} = {_toml(key.default)}\n"
        for name, key in TOP.items()
        if key.default not in (None, [])
    )
    plain, explicit = load(write_suite(tmp_path, SUITE)), load(write_suite(tmp_path, spelt + SUITE))
    assert explicit.runs == plain.runs and explicit.throughput == plain.throughput


# bert-tiny's [shapes.*] keys (an image model's, a generation's, are unknown keys to it)
TOKEN_SHAPES = ("batch_size", "seq_len", "warmup_steps", "measure_steps", "loader_workers")


@pytest.mark.parametrize(
    "table, keys, where",
    [
        ("", TOP, ""),
        ("[shapes.cpu]\n", {k: SHAPES[k] for k in (*TOKEN_SHAPES, "pin_memory")}, "shapes.cpu."),
        ("[fidelity]\n", FIDELITY, "fidelity."),
    ],
)
def test_a_value_of_another_type_is_refused_naming_the_key_and_the_type(
    table, keys, where, tmp_path
):
    checked = {
        name: key
        for name, key in keys.items()
        if key.kind in (int, float, bool) or (key.kind is str and name != "model")
    }
    for name, key in checked.items():
        text = _with(SUITE, table, f"{name} = {WRONG[key.kind]}")
        found = suite_problems(tmp_path, text)
        assert any(p.startswith(f"{where}{name}: expected {key.kind.__name__}") for p in found), (
            name,
            found,
        )


def test_a_runs_key_the_schema_does_not_declare_is_refused_with_those_it_does(tmp_path):
    found = suite_problems(tmp_path, SUITE + "colour = 1\n")
    assert f"runs[0].colour: unknown key; allowed: {', '.join(RUNS)}" in found


def test_every_kind_has_its_toml_name():
    kinds = {key.kind for keys in (TOP, SHAPES, RUNS, FIDELITY) for key in keys.values()}
    assert kinds <= TOML.keys()


def _with(suite: str, table: str, line: str) -> str:
    """``line`` in ``table`` of the suite (its top when ``table`` is empty), in place of the key's
    own line where the table has one."""
    if table not in suite:
        return suite + table + line + "\n"
    head, _, body = suite.partition(table) if table else ("", "", suite)
    own, rest = re.match(r"((?:[^\[\n][^\n]*\n)*)(.*)", body, re.S).groups()
    key = line.split(" = ")[0]
    kept = [k for k in own.splitlines(keepends=True) if not k.startswith(f"{key} = ")]
    return head + table + line + "\n" + "".join(kept) + rest


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def test_the_writer_puts_each_tables_keys_in_the_schemas_order_and_only_declared_ones(tmp_path):
    header = {
        "baseline": "a",
        "shapes": {"gpu": {"batch_size": 2, "seq_len": 8}, "cpu": {"batch_size": 2, "seq_len": 8}},
        "model": "bert-tiny",
        "description": "written",
    }
    text = to_toml(header, [{"techniques": [], "name": "a"}])
    top = [line.split(" = ")[0] for line in text.splitlines()[:3]]
    assert top == [k for k in TOP if k in ("baseline", "model", "description")]
    assert "[[runs]]\nname = " in text and load(write_suite(tmp_path, text)).baseline == "a"
    with pytest.raises(ValueError, match="no suite file declares colour"):
        to_toml(header | {"colour": "red"}, [])
