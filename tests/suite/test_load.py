import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from bench import suite as suites
from bench.suite import SuiteError, load
from tests.helpers import suite_problems, write_suite

SUITES = sorted(Path("suites").glob("*.toml"))
ROOT = Path(__file__).resolve().parents[2]
GOOD = """
model = "vit-tiny"
baseline = "baseline"
[shapes.gpu]
batch_size = 8
image_size = 32
[shapes.cpu]
batch_size = 4
image_size = 32
[[runs]]
name = "baseline"
techniques = []
[[runs]]
name = "amp"
techniques = [{ name = "amp", dtype = "float16" }, "checkpoint"]
"""


@pytest.mark.parametrize("path", SUITES, ids=[p.stem for p in SUITES])
def test_every_shipped_suite_loads(path):
    s = load(path)
    assert s.runs and s.baseline in {r.name for r in s.runs} | {
        r.name.split("@")[0] for r in s.runs
    }
    assert all(r.baseline in {x.name for x in s.runs} for r in s.runs)


def test_shipped_suites_cover_the_three_models():
    assert {load(p).model for p in SUITES} >= {"resnet50", "bert-base", "vit-b16"}


def test_good_suite_loads_into_frozen_dataclasses(tmp_path):
    s = load(write_suite(tmp_path, GOOD))
    assert s.name == "s" and [r.name for r in s.runs] == ["baseline", "amp"]
    amp = s.runs[1]
    assert [t.name for t in amp.techniques] == ["amp", "checkpoint"]
    assert dict(amp.techniques[0].options) == {"dtype": "float16"}
    assert amp.shapes("cuda").batch_size == 8 and amp.shapes("cpu").batch_size == 4
    with pytest.raises(AttributeError):
        amp.name = "x"


def test_matrix_expands_techniques_by_batch_sizes_with_matching_baselines(tmp_path):
    text = (
        GOOD.split("[[runs]]")[0]
        + """
[matrix]
techniques = { baseline = [], ckpt = ["checkpoint"] }
batch_size = { gpu = [16, 32], cpu = [2, 4] }
"""
    )
    s = load(write_suite(tmp_path, text))
    assert [(r.name, r.gpu.batch_size, r.cpu.batch_size, r.baseline) for r in s.runs] == [
        ("baseline@bs16", 16, 2, "baseline@bs16"),
        ("baseline@bs32", 32, 4, "baseline@bs32"),
        ("ckpt@bs16", 16, 2, "baseline@bs16"),
        ("ckpt@bs32", 32, 4, "baseline@bs32"),
    ]


def test_matrix_expands_a_token_models_runs_by_sequence_length_too(tmp_path):
    text = """model = "llama-tiny"
baseline = "baseline"
[shapes.gpu]
batch_size = 4
seq_len = 512
[shapes.cpu]
batch_size = 2
seq_len = 32
[matrix]
techniques = { baseline = [], ckpt = ["checkpoint"] }
seq_len = { gpu = [2048, 8192], cpu = [32, 64] }
"""
    s = load(write_suite(tmp_path, text))
    assert [(r.name, r.gpu.seq_len, r.cpu.seq_len, r.baseline) for r in s.runs] == [
        ("baseline@seq2048", 2048, 32, "baseline@seq2048"),
        ("baseline@seq8192", 8192, 64, "baseline@seq8192"),
        ("ckpt@seq2048", 2048, 32, "baseline@seq2048"),
        ("ckpt@seq8192", 8192, 64, "baseline@seq8192"),
    ]
    # GOOD's model takes images
    found = suite_problems(
        tmp_path,
        GOOD.split("[[runs]]")[0] + "[matrix]\ntechniques = { baseline = [] }\nseq_len = { gpu = "
        "[64], cpu = [16] }\n",
    )
    assert found == ["matrix.seq_len: model vit-tiny takes images; seq_len is a token model's"]


def test_run_key_changes_with_the_spec_and_the_device(tmp_path):
    a, b = load(write_suite(tmp_path, GOOD)).runs
    assert a.key("cpu") == a.key("cpu") != a.key("NVIDIA H100")
    assert a.key("cpu") != b.key("cpu")
    assert suites.RunSpec.from_dict(b.to_dict()) == b


def test_toml_syntax_error_names_the_file(tmp_path):
    (msg,) = suite_problems(tmp_path, 'model = "vit-tiny"\nbaseline = ')
    assert msg.startswith("TOML syntax")


def test_a_suite_that_is_not_there_lists_the_ones_that_are(tmp_path):
    (tmp_path / "resnet.toml").write_text(GOOD)
    (tmp_path / "bert.toml").write_text(GOOD)
    with pytest.raises(SuiteError) as info:
        load(tmp_path / "renset.toml")
    assert info.value.problems == [
        f"cannot read: No such file or directory (did you mean 'resnet'?); suites in {tmp_path}: "
        "bert, resnet"
    ]


def test_a_missing_suite_is_refused_before_torch_is_imported(tmp_path):
    # Every command took about 45 s on a loaded machine to say so, importing torch first.
    code = (
        "import sys; from bench.cli import main; rc = main(['run', 'renset']); sys.exit(rc if "
        "'torch' not in sys.modules else 99)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert "(did you mean 'resnet'?)" in out.stderr


def test_every_problem_is_reported_at_once(tmp_path):
    text = """
model = "resnet-51"
baseline = "nope"
colour = "blue"
[shapes.gpu]
batch_size = 0
[shapes.cpu]
batch_size = "eight"
image_size = 32
[[runs]]
name = "baseline"
techniques = ["warp-drive", { name = "amp", dtype = "float8" }, { name = "amp", speed = 3 }]
[[runs]]
name = "acc"
techniques = [{ name = "accumulate", micro_batches = 3 }]
[[runs]]
name = "acc"
techniques = [{ name = "accumulate", micro_batches = "two" }]
"""
    found = "\n".join(suite_problems(tmp_path, text))
    for expected in [
        "colour: unknown key; allowed: name, description, model",
        "model: unknown model 'resnet-51' (did you mean 'resnet50'?); known: bert-base",
        "baseline: 'nope' is not a run name",
        "shapes.gpu.batch_size: required positive integer, got 0",
        "shapes.cpu.batch_size: expected int, got str 'eight'",
        "runs[0].techniques[0]: unknown technique 'warp-drive'; known: accumulate, "
        "activation-offload, adamw-4bit, adamw-8bit, adamw-bnb, ademamix",
        "runs[0].techniques[1].dtype: must be one of 'bfloat16', 'float16', got 'float8'",
        "runs[0].techniques[2].speed: unknown option of amp; allowed: dtype",
        "runs[2].techniques[0].micro_batches: expected int, got str 'two'",
        "runs: duplicate run name 'acc'",
    ]:
        assert expected in found, f"missing {expected!r} in:\n{found}"


def test_accumulation_must_divide_the_batch_on_each_device(tmp_path):
    text = GOOD.replace('"checkpoint"]', '{ name = "accumulate", micro_batches = 8 }]')
    (msg,) = suite_problems(tmp_path, text)
    assert "accumulate at cpu batch_size 4: micro_batches=8 does not divide" in msg


def test_an_option_that_would_be_ignored_is_rejected(tmp_path):
    text = GOOD.replace('"checkpoint"]', '{ name = "amp", dtype = "bfloat16", scaler = false }]')
    found = suite_problems(tmp_path, text)
    assert any(
        "amp at cpu batch_size 4: scaler = false applies to float16 only" in p for p in found
    ), found


def test_conflicting_and_repeated_techniques_are_rejected(tmp_path, monkeypatch):
    from bench.techniques.checkpointing import ActivationCheckpointing

    monkeypatch.setattr(ActivationCheckpointing, "conflicts", frozenset({"amp"}))
    found = suite_problems(tmp_path, GOOD.replace('"checkpoint"]', '"checkpoint", "checkpoint"]'))
    assert any("amp and checkpoint cannot be combined" in p for p in found)
    assert any("technique 'checkpoint' is listed twice" in p for p in found)


def test_shape_keys_follow_the_model(tmp_path):
    text = GOOD.replace('"vit-tiny"', '"bert-tiny"')
    found = suite_problems(tmp_path, text)
    unknown = "shapes.gpu.image_size: unknown key for model bert-tiny; allowed: batch_size, seq_len"
    assert any(unknown in p for p in found)
    assert any("shapes.gpu.seq_len: required positive integer" in p for p in found)


def test_user_technique_by_import_path(tmp_path):
    s = load(write_suite(tmp_path, GOOD.replace('"checkpoint"]', '"tests.helpers:SGD"]')))
    assert s.runs[1].techniques[1].name == "tests.helpers:SGD"
    found = suite_problems(tmp_path, GOOD.replace('"checkpoint"]', '"tests.helpers:Nope"]'))
    assert "cannot import technique 'tests.helpers:Nope'" in found[0]


@pytest.mark.fault("cli values")
def test_selecting_runs_keeps_their_baselines(tmp_path):
    s = suites.select(load(write_suite(tmp_path, GOOD)), ["am*"])
    assert [r.name for r in s.runs] == ["baseline", "amp"]
    with pytest.raises(SuiteError, match="'nothing' matches no run"):
        suites.select(s, ["nothing"])
    with pytest.raises(SuiteError, match=r"'ampp' matches no run \(did you mean 'amp'\?\)"):
        # a typo is never dropped
        suites.select(load(write_suite(tmp_path, GOOD)), ["baseline", "ampp"])
    with pytest.raises(SuiteError, match="'' matches no run"):
        suites.select(s, [""])  # --only "" once ran the whole suite


@pytest.mark.fault("hostile text")
def test_a_run_name_too_long_for_a_file_name_is_refused_at_load(tmp_path):
    # 300 characters were measured, then storing failed with "file name too long" and no record
    # anywhere
    found = suite_problems(tmp_path, GOOD.replace('name = "amp"', f'name = "{"a" * 300}"'))
    assert any("is 300 bytes; at most 120" in p for p in found), found


def test_techniques_must_fit_the_suite_mode(tmp_path):
    infer = GOOD.replace('baseline = "baseline"', 'baseline = "baseline"\nmode = "inference"')
    # amp applies to both modes; checkpointing has no backward to save for
    (msg,) = suite_problems(tmp_path, infer)
    assert (
        "runs[1].techniques: checkpoint does not apply to inference suites; it works in: train"
        in msg
    )
    (msg,) = suite_problems(tmp_path, GOOD.replace('"checkpoint"]', '"inference-mode"]'))
    assert "inference-mode does not apply to train suites; it works in: generate, inference" in msg
    serve = GOOD.replace("model =", 'mode = "serve"\nmodel =')
    said = suite_problems(tmp_path, serve)[0]
    assert "mode: 'serve' is none of train, inference, generate" in said


GENERATE = """
model = "llama-tiny"
mode = "generate"
baseline = "baseline"
[shapes.gpu]
batch_size = 8
prompt_len = 2048
new_tokens = 128
[shapes.cpu]
batch_size = 2
prompt_len = 64
new_tokens = 8
[[runs]]
name = "baseline"
techniques = []
[[runs]]
name = "static"
techniques = [{ name = "kv-cache", kind = "static" }, { name = "half", dtype = "bfloat16" }]
"""


def test_a_generation_suite_gives_the_prompt_and_new_tokens_and_holds_their_sum(tmp_path):
    run = load(write_suite(tmp_path, GENERATE)).runs[1]
    assert run.mode == "generate" and run.gpu.seq_len == 2048 + 128 and run.cpu.seq_len == 72
    assert (run.cpu.prompt_len, run.cpu.new_tokens) == (64, 8)
    assert suites.RunSpec.from_dict(run.to_dict()) == run


def test_a_generation_suite_says_what_it_lacks_and_what_it_cannot_use(tmp_path):
    text = (
        GENERATE.replace("prompt_len = 64\n", "seq_len = 64\n")
        .replace("new_tokens = 128", "new_tokens = 1")
        .replace('"llama-tiny"', '"bert-tiny"')
        .replace("[[runs]]", '[[runs]]\nname = "ckpt"\ntechniques = ["checkpoint"]\n[[runs]]', 1)
        + "[fidelity]\nsteps = 10\n"
    )
    said = "\n".join(suite_problems(tmp_path, text))
    for problem in (
        "mode: generate needs a causal language model (a next-token objective); model bert-tiny",
        "shapes.cpu.prompt_len: required positive integer",
        "shapes.cpu.seq_len: unknown key",
        "shapes.gpu.new_tokens: at least 2, got 1",
        "fidelity: generation has no fidelity phase yet",
        "checkpoint does not apply to generate suites",
    ):
        assert problem in said, problem


def test_train_mode_stays_out_of_the_key_so_older_records_keep_theirs(tmp_path):
    train = load(write_suite(tmp_path, GOOD)).runs[0]
    inference = GOOD.replace('"checkpoint"]', "]").replace("model =", 'mode = "inference"\nmodel =')
    infer = load(write_suite(tmp_path, inference)).runs[0]
    assert "mode" not in train.to_dict() and infer.to_dict()["mode"] == "inference"
    assert (
        suites.RunSpec.from_dict(train.to_dict()) == train
        and suites.RunSpec.from_dict(infer.to_dict()) == infer
    )
    assert train.key("cpu") != infer.key("cpu")


FIDELITY = (
    GOOD
    + """
[fidelity]
steps = 50
seeds = 2
[fidelity.cpu]
model = "vit-tiny"
batch_size = 16
[fidelity.gpu]
enabled = false
"""
)


def test_fidelity_table_with_per_device_overrides_and_a_per_run_switch(tmp_path):
    text = FIDELITY.replace(
        'name = "amp"\ntechniques', 'name = "amp"\nfidelity = false\ntechniques'
    )
    base, amp = load(write_suite(tmp_path, text)).runs
    assert base.fidelity("cpu") == suites.Fidelity(
        steps=50, batch_size=16, seeds=2, model="vit-tiny"
    )
    assert base.fidelity("cuda") is None and amp.fidelity("cpu") is None
    assert suites.RunSpec.from_dict(base.to_dict()) == base


def test_no_fidelity_drops_the_phase_and_keys_runs_as_fidelity_false(tmp_path):
    suite = load(write_suite(tmp_path, FIDELITY))
    off = load(
        write_suite(
            tmp_path, FIDELITY.replace("techniques = []", "fidelity = false\ntechniques = []")
        )
    )
    base = suites.without_fidelity(suite).runs[0]
    assert base.fidelity("cpu") is None and base.fidelity("cuda") is None
    assert base.key("cpu") == off.runs[0].key("cpu") != suite.runs[0].key("cpu")


def test_fidelity_problems_are_reported_with_their_keys(tmp_path):
    text = (
        GOOD.replace('"checkpoint"]', '{ name = "accumulate", micro_batches = 2 }]')
        + """
[fidelity]
seeds = 1
colour = 3
[fidelity.cpu]
model = "bert-tiny"
batch_size = 15
"""
    )
    found = suite_problems(tmp_path, text)
    assert (
        "fidelity.colour: unknown key; allowed: dataset, steps, batch_size, lr, seeds, image_size, "
        "model, weights, enabled"
    ) in found
    # a shared key: reported once, where it is written
    assert "fidelity.seeds: must be at least 2" in found
    assert (
        "fidelity.cpu.model: 'bert-tiny' takes tokens inputs and the suite's model image inputs; "
        "choose a model of the same kind"
    ) in found
    assert any(
        "accumulate at fidelity.cpu batch_size 15: micro_batches=2 does not divide" in p
        for p in found
    )


def test_a_users_model_by_import_path(tmp_path):
    s = load(write_suite(tmp_path, GOOD.replace('"vit-tiny"', '"tests.helpers:IMAGE_MLP"')))
    assert s.model == "tests.helpers:IMAGE_MLP" and {r.model for r in s.runs} == {
        "tests.helpers:IMAGE_MLP"
    }
    # nothing else: shapes wait
    (msg,) = suite_problems(tmp_path, GOOD.replace('"vit-tiny"', '"tests.helpers:NOPE"'))
    assert msg.startswith("model: cannot import model 'tests.helpers:NOPE': AttributeError")


WEIGHTS = (
    GOOD.replace('baseline = "baseline"', 'baseline = "baseline"\nweights = "WEIGHTS"')
    + """
[fidelity]
steps = 10
[fidelity.cpu]
model = "vit-tiny"
[fidelity.gpu]
model = "resnet-tiny"
"""
)


def test_weights_go_to_the_suite_model_wherever_it_is_trained(tmp_path):
    weights = tmp_path / "vit.pt"
    weights.write_bytes(b"")  # existence is checked at load; reading it waits for the run
    base = load(write_suite(tmp_path, WEIGHTS.replace("WEIGHTS", str(weights)))).runs[0]
    assert base.weights == str(weights) and base.fidelity("cpu").weights == str(weights)
    # another model: the suite's weights would not fit it
    assert base.fidelity("cuda").weights is None
    assert suites.RunSpec.from_dict(base.to_dict()) == base


def test_a_suite_without_weights_keeps_the_run_keys_it_had(tmp_path):
    spec = load(write_suite(tmp_path, WEIGHTS.replace('weights = "WEIGHTS"\n', ""))).runs[0]
    d = spec.to_dict()
    assert (
        "weights" not in d
        and "weights" not in d["fidelity_cpu"]
        and "weights" not in d["fidelity_gpu"]
    )


def test_weights_that_are_not_there_are_reported_where_they_are_named(tmp_path):
    text = WEIGHTS.replace("WEIGHTS", "nope.pt").replace(
        'model = "resnet-tiny"', 'weights = "gone/"'
    )
    found = suite_problems(tmp_path, text)
    assert "weights: no file or folder 'nope.pt' (relative paths start where bench runs)" in found
    assert (
        "fidelity.gpu.weights: no file or folder 'gone/' (relative paths start where bench runs)"
        in found
    )


def test_a_device_may_run_a_smaller_model_of_the_suites_kind(tmp_path):
    """[shapes.cpu] model: the CPU builds llama-tiny where a GPU builds Llama-3-1B; the record names
    the model built, predictions at GPU shapes keep the suite's, and a suite without the key keeps
    its run keys."""
    from bench.recipe import Recipe
    from bench.results import base_record
    from tests.conftest import CPU

    s = load("suites/llama.toml")
    run = s.runs[0]
    assert (run.model, run.cpu.model, run.gpu.model) == ("llama3-1b", "llama-tiny", None)
    assert Recipe.of(run, CPU).ctx.model_spec.name == "llama-tiny"
    assert Recipe.of(run, CPU, run.gpu, predicting=True).ctx.model_spec.name == "llama3-1b"
    assert base_record(run, "cpu", "cpu", "k", "r").identity.model == "llama-tiny"
    assert "model" not in load(write_suite(tmp_path, GOOD)).runs[0].to_dict()["cpu"]


def test_a_stand_in_of_another_kind_is_refused_with_the_fix(tmp_path):
    found = suite_problems(
        tmp_path, GOOD.replace("[shapes.cpu]\n", '[shapes.cpu]\nmodel = "bert-tiny"\n')
    )
    assert (
        "shapes.cpu.model: bert-tiny takes tokens for classify, model vit-tiny takes image for "
        "classify; name a smaller model of the same kind"
    ) in found
    found = suite_problems(
        tmp_path, GOOD.replace("[shapes.cpu]\n", '[shapes.cpu]\nmodel = "nope"\n')
    )
    assert any(p.startswith("shapes.cpu.model: ") and "nope" in p for p in found)


@pytest.mark.fault("resources")
def test_a_user_module_that_hangs_on_import_stops_the_load_with_the_reason(tmp_path, monkeypatch):
    import importlib

    # the module: the package's `load` is its function
    loader = importlib.import_module("bench.suite.load")

    (tmp_path / "slow_techs.py").write_text("import time\ntime.sleep(600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(loader, "LOAD_LIMIT_S", 1)
    with pytest.raises(SuiteError, match="loading took more than 1 s: a module it imports"):
        load(write_suite(tmp_path, GOOD.replace('"checkpoint"]', '"slow_techs:Mine"]')))


FIRST_LOOK = (
    'model = "vit-tiny"\nbaseline = "b"\nfirst_look = FIRST\n[shapes.gpu]\nbatch_size = '
    "2\nimage_size = 32\n"
    '[shapes.cpu]\nbatch_size = 2\nimage_size = 32\n[[runs]]\nname = "b"\ntechniques = []\n'
    '[[runs]]\nname = "amp-bf16"\ntechniques = [{ name = "amp", dtype = "bfloat16" }]\n'
    '[[runs]]\nname = "checkpoint"\ntechniques = ["checkpoint"]\n'
)


def test_a_first_look_names_runs_of_the_suite_and_a_typo_is_refused(tmp_path):
    from tests.helpers import suite_problems, write_suite

    assert load(write_suite(tmp_path, FIRST_LOOK.replace("FIRST", '["amp-*"]'))).first_look == (
        "amp-*",
    )
    (problem,) = suite_problems(tmp_path, FIRST_LOOK.replace("FIRST", '["checkpiont"]'))
    assert problem == "first_look: 'checkpiont' matches no run (did you mean 'checkpoint'?)"


def test_a_first_look_is_what_a_cpu_measures_unless_all_or_only_says_otherwise(tmp_path, capsys):
    from argparse import Namespace

    from bench.cli.sweep import _first_look
    from tests.helpers import write_suite

    suite = load(write_suite(tmp_path, FIRST_LOOK.replace("FIRST", '["amp-*"]')))
    plain = Namespace(all=False, only=None)
    # with its baseline
    assert [r.name for r in _first_look(suite, plain, "cpu").runs] == [
        "b",
        "amp-bf16",
    ]
    assert "a first look on this CPU: 2 of the suite's 3 runs" in capsys.readouterr().err
    assert _first_look(suite, Namespace(all=True, only=None), "cpu") is suite
    assert _first_look(suite, Namespace(all=False, only="checkpoint"), "cpu") is suite
    assert _first_look(suite, plain, "cuda") is suite  # a GPU measures every run


def test_zero_stages_leaves_zero_3s_parameter_offload_to_stage_3():
    """bench predict --zero-stages: a ZeRO-3 entry offloading its parameters is also predicted at
    stages 1 and 2, which have no partitions to offload (DeepSpeed reads offload_param at 3
    alone)."""
    suite = suites.select(load(Path("suites/dist-smoke.toml")), ["zero-3"])
    run = next(r for r in suite.runs if r.name == "zero-3")
    options = dict(run.techniques[0].options) | {"offload_param": "cpu"}
    ds = suites.TechniqueSpec("deepspeed", tuple(sorted(options.items())))
    staged = suites.zero_stages(replace(suite, runs=(replace(run, techniques=(ds,)),))).runs
    options = {r.name: dict(r.techniques[0].options) for r in staged}
    assert list(options) == ["zero-3", "zero-3-zero1", "zero-3-zero2"]
    assert [options[name]["stage"] for name in options] == [3, 1, 2]
    assert options["zero-3"]["offload_param"] == "cpu"
    assert not {"offload_param"} & (options["zero-3-zero1"].keys() | options["zero-3-zero2"].keys())
