"""What every technique declares for the rest of the house: its place in advice's catalogue or why
it has none, the batch multiple it needs, its host traffic and the kernel it pins, read off the
built technique."""

from dataclasses import fields
from pathlib import Path

import pytest

from bench.advise.plans import axes
from bench.advise.source import source
from bench.models import resolve as model
from bench.spec import TechniqueSpec
from bench.techniques import AXES, TECHNIQUES, build, catalogue
from bench.techniques.base import INTERFACE, Technique


@pytest.mark.parametrize("name", TECHNIQUES.names())
def test_every_technique_is_in_advices_catalogue_or_says_why_not(name):
    cls = TECHNIQUES.get(name)
    assert cls.name == name  # the registry names it: written once
    if cls.not_advised:
        assert not cls.axis and not cls.offers, f"{name}: advised and not advised"
    else:
        assert cls.axis in AXES and cls.offers, (
            f"{name}: neither on an axis of {AXES} nor not_advised with a reason"
        )
    for offer in cls.offers:  # every setting advice would try is one the technique takes
        assert {k for k, _ in offer.options} <= {f.name for f in fields(cls.Config)}, offer


def test_the_batch_multiple_and_the_pinned_kernel_are_the_techniques_own():
    assert build(TechniqueSpec("accumulate", (("micro_batches", 4),))).batch_multiple() == 4
    assert build(TechniqueSpec("checkpoint")).batch_multiple() == 1
    assert build(TechniqueSpec("sdpa")).attention_backend() == "flash"  # its default, written once
    assert build(TechniqueSpec("sdpa", (("backend", "math"),))).attention_backend() == "math"
    assert {
        n: TECHNIQUES.get(n).host_traffic
        for n in ("offload", "activation-offload", "cpu-offload-optimizer")
    } == {
        "offload": "activations",
        "activation-offload": "activations",
        "cpu-offload-optimizer": "optimizer",
    }


OWN = """model = "bert-tiny"
baseline = "baseline"
[shapes.gpu]
batch_size = 8
seq_len = 32
[shapes.cpu]
batch_size = 8
seq_len = 32
[[runs]]
name = "baseline"
techniques = []
[[runs]]
name = "mine"
techniques = ["tests.helpers:HalfMomentumSGD"]
[[runs]]
name = "other"
techniques = ["tests.helpers:SGD"]
"""


def test_a_users_technique_that_declares_an_axis_is_advised_like_a_built_in_one(tmp_path):
    (tmp_path / "own.toml").write_text(OWN)
    src = source(str(tmp_path / "own.toml"), None, None, "cpu")
    # SGD declares no axis: not advice's to try
    assert src.own == ("tests.helpers:HalfMomentumSGD",)
    optimizers = next(
        a for a in axes(model("bert-tiny"), "train", 1, 8, src.own) if a.name == "optimizer"
    )
    mine = [o for o in optimizers.options if o.technique.name == "tests.helpers:HalfMomentumSGD"]
    assert [o.name for o in mine] == ["half-momentum-sgd"] and mine[0].technique.options == (
        ("lr", 0.01),
    )


def test_the_docs_table_is_the_registrys():
    page = Path("docs/techniques.md").read_text(encoding="utf-8")
    assert catalogue.BEGIN + "\n" + catalogue.table() + "\n" + catalogue.END in page, (
        "docs/techniques.md's table is stale: run make docs"
    )
    assert catalogue.expected(TECHNIQUES.get("accumulate")).startswith(
        "activation memory scales with the micro-batch"
    )


def test_the_interface_table_groups_every_member_of_technique_once_and_is_the_pages():
    members = {n for n in vars(Technique) if not n.startswith("_")}
    grouped = [m for names in INTERFACE.values() for m in names]
    assert sorted(grouped) == sorted(members)  # each member in one group, none forgotten
    table = catalogue.interface_table()
    assert "| `axis`, `offers`, `not_advised` |" in table and ", ".join(AXES) in table
    page = Path("docs/techniques.md").read_text(encoding="utf-8")
    assert catalogue.INTERFACE_BEGIN + "\n" + table + "\n" + catalogue.INTERFACE_END in page, (
        "docs/techniques.md's interface table is stale: run make docs"
    )
