"""Length distributions, and a local tokenised dataset as the source of variable-length
sequences."""

from __future__ import annotations

import pytest
import torch

from bench.data import varlen
from bench.models import MODELS
from bench.suite import load
from tests.helpers import write_suite

datasets = pytest.importorskip("datasets")


def test_distributions_draw_within_their_bounds():
    g = torch.Generator().manual_seed(0)
    assert set(varlen.parse("uniform:3:5").sample(200, g)) == {3, 4, 5}
    drawn = varlen.parse("lognormal:18:1.27:128").sample(2000, g)
    # median about 18
    assert min(drawn) >= 1 and max(drawn) == 128 and 14 <= sorted(drawn)[1000] <= 22
    lengths = varlen.sequences(varlen.parse("digits"), MODELS.get("bert-tiny"), 0, 0).lengths
    assert (
        (min(lengths), max(lengths), len(lengths))
        == (17, 43, 1797)
        == (17, varlen.parse("digits").maximum, 1797)
    )


def test_a_local_tokenised_dataset_gives_its_rows_without_padding(tmp_path):
    rows = [[5, 6, 7, 0, 0], [8, 9, 0, 0, 0], [4, 4, 4, 4, 4]]
    datasets.Dataset.from_dict({"input_ids": rows, "label": [1, 0, 2]}).save_to_disk(
        tmp_path / "tok"
    )
    lengths = varlen.parse(f"hf:{tmp_path / 'tok'}")
    data = varlen.sequences(lengths, MODELS.get("bert-tiny"), 0, 0)
    assert lengths.maximum == 5 and sorted(data.lengths) == [2, 3, 5]
    assert sorted((s.tolist(), y) for s, y in data.samples) == [
        ([4, 4, 4, 4, 4], 2),
        ([5, 6, 7], 1),
        ([8, 9], 0),
    ]


SUITE = """
model = "bert-tiny"
baseline = "p"
[shapes.gpu]
batch_size = 2
seq_len = 8
lengths = "{lengths}"
[shapes.cpu]
batch_size = 2
seq_len = 8
lengths = "{lengths}"
[[runs]]
name = "p"
techniques = ["packing"]
"""


def test_a_dataset_that_cannot_be_read_is_a_load_error_naming_it(tmp_path):
    from bench.errors import SuiteError

    with pytest.raises(SuiteError) as info:
        load(write_suite(tmp_path, SUITE.format(lengths=f"hf:{tmp_path / 'nowhere'}")))
    assert info.value.problems[0].startswith(
        f"shapes.gpu.lengths: dataset hf:{tmp_path / 'nowhere'}:"
    )
