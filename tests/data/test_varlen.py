"""Length distributions, and a local tokenised dataset as the source of variable-length
sequences."""

from __future__ import annotations

import pytest
import torch

from bench.data import varlen
from bench.models import MODELS
from bench.suite import load
from tests.helpers import spec, write_suite

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


def test_a_file_of_lengths_is_its_own_dataset(tmp_path):
    """One length a line, or a CSV's length column: as many sequences of those lengths."""
    (tmp_path / "lengths.txt").write_text("5\n17\n\n3\n11\n")
    (tmp_path / "lengths.csv").write_text("id,length\n0,5\n1,17\n2,3\n3,11\n")
    for name in ("lengths.txt", "lengths.csv"):
        lengths = varlen.parse(f"file:{tmp_path / name}")
        assert lengths.maximum == 17
        data = varlen.sequences(lengths, MODELS.get("bert-tiny"), n=100, seed=0)
        assert data.lengths == [5, 17, 3, 11]


def test_a_parquet_files_length_column_or_its_token_rows_are_its_lengths(tmp_path):
    """A tokenised dataset's own shard: its ``input_ids`` rows' lengths, or a ``length`` column
    where it has one (taken first); a file without either, or with a length below 1, names it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = {"input_ids": [[1] * 5, [2] * 17, [3] * 3, [4] * 11], "label": [0, 1, 0, 1]}
    pq.write_table(pa.table(rows), tmp_path / "shard.parquet")
    pq.write_table(pa.table(rows | {"length": [6, 18, 4, 12]}), tmp_path / "counted.parquet")
    for name, expected in (("shard", [5, 17, 3, 11]), ("counted", [6, 18, 4, 12])):
        lengths = varlen.parse(f"file:{tmp_path / name}.parquet")
        data = varlen.sequences(lengths, MODELS.get("bert-tiny"), n=100, seed=0)
        assert data.lengths == expected
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "text.parquet")
    with pytest.raises(ValueError, match="no 'length' or 'input_ids' column among text"):
        varlen.parse(f"file:{tmp_path / 'text.parquet'}")
    pq.write_table(pa.table({"input_ids": [[1], []]}), tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match="row 1 of its 'input_ids' column: 0 is not a token"):
        varlen.parse(f"file:{tmp_path / 'empty.parquet'}")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="cannot read it as Parquet"):
        varlen.parse(f"file:{tmp_path / 'bad.parquet'}")


@pytest.mark.parametrize(
    "text, said",
    [
        ("5\nfive\n", "lengths.txt, line 2: 'five' is not a token length"),
        ("5\n0\n", "lengths.txt, line 2: '0' is not a token length"),
        ("\n", "lengths.txt: no lengths in it"),
    ],
)
def test_a_file_of_lengths_that_is_not_one_names_the_line(text, said, tmp_path):
    (tmp_path / "lengths.txt").write_text(text)
    with pytest.raises(ValueError, match=said):
        varlen.parse(f"file:{tmp_path / 'lengths.txt'}")
    with pytest.raises(ValueError, match="cannot read it"):
        varlen.parse(f"file:{tmp_path / 'absent.txt'}")


def test_a_histogram_draws_each_length_as_often_as_its_count(tmp_path):
    """A CSV of length,count rows: the run's sequences drawn from it, a bin of count 0 never, and
    each length near its share of 1,024 draws (the seed's, so the same every time); an edited
    histogram measures its runs again."""
    path = tmp_path / "hist.csv"
    path.write_text("length,count\n16,600\n64,300\n256,100\n512,0\n")
    lengths = varlen.parse(f"histogram:{path}")
    assert lengths.maximum == 512  # its longest bin, as a loader would pad to
    data = varlen.sequences(lengths, MODELS.get("bert-tiny"), n=1024, seed=0)
    drawn = {k: data.lengths.count(k) for k in (16, 64, 256, 512)}
    assert drawn[512] == 0 and sum(drawn.values()) == 1024
    assert abs(drawn[16] / 1024 - 0.6) < 0.05 and abs(drawn[256] / 1024 - 0.1) < 0.03
    assert data.lengths == varlen.sequences(lengths, MODELS.get("bert-tiny"), 1024, 0).lengths
    run = spec("bert-tiny", lengths=f"histogram:{path}")
    before = run.user_code()
    path.write_text("length,count\n16,1\n")
    assert run.user_code() != before


@pytest.mark.parametrize(
    "text, said",
    [
        ("length,n\n5,1\n", "must name a 'length' and a 'count' column, got length, n"),
        ("length,count\n5,x\n", "line 2: '5,x' is not a length"),
        ("length,count\n0,3\n", "line 2: '0,3' is not a length"),
        ("length,count\n5,0\n", "no count above 0"),
    ],
)
def test_a_histogram_that_is_not_one_names_the_line(text, said, tmp_path):
    (tmp_path / "hist.csv").write_text(text)
    with pytest.raises(ValueError, match=said):
        varlen.parse(f"histogram:{tmp_path / 'hist.csv'}")


def test_a_csv_without_a_length_column_names_its_columns(tmp_path):
    (tmp_path / "lengths.csv").write_text("id,tokens\n0,5\n")
    with pytest.raises(ValueError, match="no 'length' column among id, tokens"):
        varlen.parse(f"file:{tmp_path / 'lengths.csv'}")


# a long-tailed file: one sequence far longer than the rest, in a pass of 8 batches of 4
TAIL = [8] * 13 + [60] + [8] * 18


def _fed(tmp_path, technique: str, model: str = "bert-tiny", lengths: str | None = None):
    """``model`` on the long-tailed file's sequences (or ``lengths``, at bert-varlen's CPU shapes),
    its run, recipe and feed (on this CPU)."""
    from bench.recipe import Recipe
    from tests.helpers import spec, tech

    (tmp_path / "tail.txt").write_text("\n".join(map(str, TAIL)))
    shapes = {"batch_size": 8, "seq_len": 128} if lengths else {"batch_size": 4, "seq_len": 64}
    lengths = lengths or f"file:{tmp_path}/tail.txt"
    run = spec(model, (tech(technique),), lengths=lengths, **shapes)
    recipe = Recipe.of(run, torch.device("cpu"))
    return run, recipe, recipe.feed()


def test_a_pass_is_the_batches_the_loader_forms_in_their_order(tmp_path):
    _, _, feed = _fed(tmp_path, "length-bucketing")
    loaded = [varlen.real_tokens(b) for b in feed.batches(len(feed.epoch()))]
    collated = [
        varlen.real_tokens(feed.batching.collate([feed.data[i] for i in places]))
        for places in feed.epoch()
    ]
    assert loaded == collated and len(loaded) == len(TAIL) // 4


def _tracked_worst(run, recipe, feed) -> int:
    """Each step of a pass tracked as the worker tracks one (after a warm-up step); the place of
    the highest, held to the step the feed names worst, and to its prediction to the byte (as one
    measured step: more hold the steps before's losses, as the worker's do)."""
    from dataclasses import replace

    from bench.measure.memory import tracked_step
    from bench.predict import predict
    from bench.recipe import tracked_steps

    trainer = recipe.stepper(recipe.model()[0])
    trainer.step(next(feed.batches(1)))
    peaks = []
    for k in range(len(feed.epoch())):
        only = replace(feed, shapes=replace(feed.shapes, worst_step=True))
        only._worst = varlen.Worst(k, len(feed.epoch()), 0, 0)
        step = tracked_steps(trainer, recipe.batch(), only, 1)
        peaks.append(tracked_step(step, trainer.model, trainer.optimizer, torch.device("cpu")))
    highest = max(range(len(peaks)), key=lambda k: peaks[k].peak_tensor_bytes)
    assert feed.worst().step == highest
    alike = replace(run.cpu, worst_step=True, measure_steps=1)
    assert predict(run, alike, cuda=False).peak_tensor_bytes == peaks[highest].peak_tensor_bytes
    return highest


@pytest.mark.parametrize(
    "model, technique",
    [
        ("bert-tiny", "dynamic-padding"),
        ("bert-tiny", "length-bucketing"),
        ("hf:suites/configs/tiny-llama", "dynamic-padding"),  # a causal mask, padded
    ],
)
def test_the_worst_step_is_the_one_whose_tracked_peak_is_highest(model, technique, tmp_path):
    """The long-tailed file's worst batch (its padded attention mask too: the batch's integer
    values are kept beside the fakes), named, and a worst-step feed gives that batch alone."""
    from dataclasses import replace

    highest = _tracked_worst(*_fed(tmp_path, technique, model))
    _, _, feed = _fed(tmp_path, technique, model)
    worst = feed.worst()
    assert worst.padded == 4 * 60 and worst.real == 3 * 8 + 60
    assert worst.said() == f"step {highest + 1} of 8: 240 tokens, 84 of them real"
    alone = replace(feed, shapes=replace(feed.shapes, worst_step=True))
    assert [varlen.real_tokens(b) for b in alone.batches(2)] == [(84, 240)] * 2


@pytest.mark.parametrize(
    "lengths",
    [
        "uniform:8:128",
        "lognormal:18:1.27:128",
        pytest.param("digits", marks=pytest.mark.full),  # 224 steps a pass: 20-40 s here
    ],
)
def test_bert_varlens_distributions_have_their_worst_steps_predicted(lengths, tmp_path):
    """bert-varlen's three CPU distributions at its CPU shapes, bert-tiny standing for bert-base:
    the worst step named is the tracked one, and predicted to the byte."""
    _tracked_worst(*_fed(tmp_path, "dynamic-padding", lengths=lengths))


def test_a_measured_pass_records_each_steps_peak_and_the_worst_is_the_one_named(tmp_path):
    """The worker's instrumented pass over variable-length data keeps each step's tracked peak, in
    order: as many as the pass has steps, their largest the run's peak, at the step the loader's
    pass names worst; the prediction of that pass is the same peak."""
    from dataclasses import replace

    from bench.worker import measure

    run, _, feed = _fed(tmp_path, "dynamic-padding")
    steps = len(feed.epoch())
    run = replace(run, cpu=replace(run.cpu, measure_steps=steps))
    record = measure(run, torch.device("cpu"))
    peaks = record.memory.step_peak_bytes
    assert len(peaks) == steps and max(peaks) == record.memory.peak_tensor_bytes
    assert peaks.index(max(peaks)) == feed.worst().step
    assert record.prediction.peak_tensor_bytes == record.memory.peak_tensor_bytes


@pytest.mark.parametrize(
    "form, low, top, mean",
    [("triangular:8:128:60", 8, 128, 60), ("lognormal-mean:4:2048:187", 4, 2048, 187)],
)
def test_a_dataset_known_by_its_min_max_and_mean_is_drawn_in_a_shape_of_that_mean(
    form, low, top, mean
):
    """A dataset card's three numbers and a shape: every length within MIN..MAX, their mean the
    dataset's (a triangle's exactly in expectation; a lognormal's nearly, its tail past MAX cut),
    and a long tail where asked: the lognormal's 99.9th percentile at MAX."""
    lengths = varlen.parse(form)
    assert lengths.maximum == top
    drawn = torch.tensor(lengths.sample(40_000, torch.Generator().manual_seed(0)), dtype=float)
    assert low <= drawn.min() and drawn.max() <= top
    assert abs(drawn.mean().item() - mean) / mean < 0.02
    if form.startswith("lognormal"):
        assert drawn.quantile(0.999).item() == pytest.approx(top, rel=0.1)
        assert drawn.median().item() < mean  # a long tail: most sequences are short


@pytest.mark.parametrize(
    "form, said",
    [
        ("triangular:8:128:20", "a mean this near an end is a long tail: lognormal-mean:8:128:20"),
        ("triangular:8:128:200", "needs 1 ≤ MIN < MEAN < MAX"),
        ("lognormal-mean:1:100000:10", "at 1,185 at most, short of MAX"),
        ("triangular:8.5:128:40", "whole MIN and MAX"),
    ],
)
def test_min_max_and_mean_no_shape_can_have_are_refused_with_the_way_out(form, said):
    with pytest.raises(ValueError, match=said):
        varlen.parse(form)
