"""Variable-length data in a suite: lengths per device or as a matrix, and the problems the loader
refuses."""

from __future__ import annotations

from bench.suite import RunSpec, load
from tests.helpers import suite_problems, write_suite

TOKENS = """
model = "bert-tiny"
baseline = "pad-to-max"
[shapes.gpu]
batch_size = 8
seq_len = 512
[shapes.cpu]
batch_size = 4
seq_len = 64
"""
RUNS = """
[[runs]]
name = "pad-to-max"
techniques = ["pad-to-max"]
[[runs]]
name = "packing"
techniques = ["packing"]
"""
MATRIX = """
[matrix]
techniques = { pad-to-max = ["pad-to-max"], packing = ["packing"] }
[matrix.lengths]
uniform = { gpu = "uniform:16:512", cpu = "uniform:4:64" }
digits = { gpu = "digits", cpu = "digits" }
"""


def test_matrix_over_length_distributions_with_matching_baselines(tmp_path):
    s = load(write_suite(tmp_path, TOKENS + MATRIX))
    assert [(r.name, r.baseline, r.gpu.lengths, r.cpu.lengths) for r in s.runs] == [
        ("pad-to-max@uniform", "pad-to-max@uniform", "uniform:16:512", "uniform:4:64"),
        ("pad-to-max@digits", "pad-to-max@digits", "digits", "digits"),
        ("packing@uniform", "pad-to-max@uniform", "uniform:16:512", "uniform:4:64"),
        ("packing@digits", "pad-to-max@digits", "digits", "digits"),
    ]
    assert RunSpec.from_dict(s.runs[2].to_dict()) == s.runs[2]


def test_lengths_and_loader_options_in_shapes(tmp_path):
    text = TOKENS.replace(
        "seq_len = 64",
        'seq_len = 64\nlengths = "lognormal:18:1.27:64"\nloader_workers = 2\npin_memory = true',
    ).replace("seq_len = 512", 'seq_len = 512\nlengths = "uniform:1:512"')
    run = load(write_suite(tmp_path, text + RUNS)).runs[1]
    assert (run.cpu.lengths, run.cpu.loader_workers, run.cpu.pin_memory) == (
        "lognormal:18:1.27:64",
        2,
        True,
    )
    assert run.gpu.lengths == "uniform:1:512" and run.gpu.loader_workers == 0


def test_fixed_length_runs_keep_their_keys(tmp_path):
    """Shapes without the data keys write none of them: records stored before lengths existed still
    match."""
    run = load(
        write_suite(tmp_path, TOKENS + '[[runs]]\nname = "pad-to-max"\ntechniques = []\n')
    ).runs[0]
    assert "lengths" not in run.to_dict()["cpu"] and "loader_workers" not in run.to_dict()["gpu"]


def test_a_distribution_longer_than_seq_len_names_the_key(tmp_path):
    text = TOKENS + MATRIX.replace('cpu = "uniform:4:64"', 'cpu = "uniform:4:100"')
    assert suite_problems(tmp_path, text) == [
        "matrix.lengths.uniform.cpu: 'uniform:4:100' reaches 100 tokens, beyond seq_len = 64; "
        "lower its maximum or raise seq_len"
    ]
    text = TOKENS.replace("seq_len = 64", 'seq_len = 64\nlengths = "digits"').replace(
        "seq_len = 512", 'seq_len = 32\nlengths = "digits"'
    )
    assert suite_problems(tmp_path, text + RUNS) == [
        "shapes.gpu.lengths: 'digits' reaches 43 tokens, beyond seq_len = 32; lower its maximum or "
        "raise seq_len"
    ]


def test_a_distribution_that_is_not_one_lists_the_forms(tmp_path):
    text = TOKENS + MATRIX.replace('cpu = "uniform:4:64"', 'cpu = "zipf:2"')
    (problem,) = suite_problems(tmp_path, text)
    assert problem.startswith(
        "matrix.lengths.uniform.cpu: 'zipf:2' is not a length distribution; expected "
        "'uniform:LO:HI', 'lognormal:MEDIAN:SIGMA:MAX', 'triangular:MIN:MAX:MEAN', "
        "'lognormal-mean:MIN:MAX:MEAN', 'digits', 'hf:PATH', 'file:PATH' or 'histogram:PATH'"
    )


def test_padding_technique_on_an_image_model_is_refused(tmp_path):
    text = (
        TOKENS.replace("bert-tiny", "vit-tiny")
        .replace("seq_len", "image_size")
        .replace("512", "32")
    )
    problems = suite_problems(tmp_path, text.replace("64", "32") + RUNS)
    assert (
        "runs[1].techniques: packing applies to models that take tokens; model vit-tiny takes image"
        in problems
    )


def test_padding_technique_without_lengths_is_refused(tmp_path):
    assert suite_problems(tmp_path, TOKENS + RUNS)[0] == (
        "runs[0].techniques: pad-to-max forms batches from variable-length data; set lengths in "
        "[shapes.gpu] and [shapes.cpu], or name distributions in [matrix.lengths]"
    )


def test_packing_with_accumulation_on_variable_length_data_is_refused(tmp_path):
    """Each micro-batch's packed row has its own length; rows of fixed-shape sequences stack
    (tests/techniques/test_padding.py)."""
    text = TOKENS.replace("seq_len = 64", 'seq_len = 64\nlengths = "digits"').replace(
        "seq_len = 512", 'seq_len = 512\nlengths = "digits"'
    )
    text += '[[runs]]\nname = "pad-to-max"\ntechniques = []\n[[runs]]\nname = "p"\n'
    text += 'techniques = ["packing", { name = "accumulate", micro_batches = 2 }]\n'
    (problem,) = suite_problems(tmp_path, text)
    assert problem.startswith(
        "runs[1].techniques: packing with micro-batches on variable-length data: each "
        "micro-batch's packed row has its own length"
    ), problem


def test_loader_workers_must_not_be_negative(tmp_path):
    text = TOKENS.replace(
        "seq_len = 64", 'seq_len = 64\nlengths = "digits"\nloader_workers = -1'
    ).replace("seq_len = 512", 'seq_len = 512\nlengths = "digits"')
    assert (
        "shapes.cpu.loader_workers: must be 0 (load in the step's process) or more, got -1"
        in suite_problems(tmp_path, text + RUNS)
    )


def test_image_models_take_no_lengths(tmp_path):
    text = (
        TOKENS.replace("bert-tiny", "vit-tiny")
        .replace("seq_len = 512", "image_size = 32")
        .replace("seq_len = 64", 'image_size = 32\nlengths = "digits"')
    )
    problems = suite_problems(tmp_path, text + '[[runs]]\nname = "pad-to-max"\ntechniques = []\n')
    assert problems[0].startswith("shapes.cpu.lengths: unknown key for model vit-tiny")
