"""How long predicting full-size models at GPU shapes takes (``make perf``; not in ``make test``: a
loaded machine takes severalfold longer): each prediction's time against one real step of a tiny
model on this machine."""

import io
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torchvision

from bench.models import ModelSpec
from bench.models.text import LLAMA, LLAMA3_8B, LLAMA3_VOCAB, _llama
from bench.predict import predict
from bench.predict.cards import CARDS
from bench.predict.table import suite_table
from bench.suite import load, select
from tests.conftest import build_trainer
from tests.helpers import spec, tech

pytestmark = pytest.mark.perf


def test_full_size_predictions_take_seconds():
    trainer, batch = build_trainer(spec("resnet-tiny", batch_size=16, image_size=64))
    trainer.step(batch)
    start = time.perf_counter()
    trainer.step(batch)
    tiny = time.perf_counter() - start
    for name in ("resnet", "bert", "vit"):
        for run in select(load(f"suites/{name}.toml"), ["baseline", "checkpoint"]).runs:
            start = time.perf_counter()
            out = predict(run)
            took = time.perf_counter() - start
            print(
                f"\n{name}/{run.name}: predicted in {took:.1f} s, {took / tiny:.0f}× a resnet-tiny "
                "step here"
            )
            assert out.status == "ok"
            assert took < 30  # about 2.5 s each on a quiet two-core CI machine


# Llama-3-8B's shapes at 2 layers of its 32 (bench/models/text.py): issue 65's depth ratio
LLAMA3_8B_2_LAYERS = ModelSpec(
    name="llama3-8b-2-layers",
    build=lambda shapes: _llama(shapes, **(LLAMA3_8B | {"num_hidden_layers": 2})),
    inputs="tokens",
    num_classes=LLAMA3_VOCAB,
    vocab_size=LLAMA3_VOCAB,
    cpu=False,
    **LLAMA,
)


def test_issue_65_ratios_side_by_side():
    """Issue 65's three ratios, each pair timed in this run (its goals: depth ≤ 1.5, accumulation
    ≤ 1.2, a --card row ≤ 2 times the row without): what each step of that issue has bought."""

    def took(run, card=None) -> float:
        """Seconds to predict ``run`` (on a ``card``: its row, the largest batch searched too), as a
        command of its own would: no fold proven by the prediction timed before it, no operator's
        fake output cached by it (each pair was timed in turn, the second on the first's caches)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        from bench.predict import fake

        fake.TEMPLATES.clear()
        fake.UNFOLDED.clear()
        FakeTensorMode.cache_clear()
        start = time.perf_counter()
        if card is None:
            assert predict(run).ok
        else:
            table = suite_table([run], {}, None, log=io.StringIO(), card=card)
            assert (table["status"] == "ok").all()
        return time.perf_counter() - start

    predict(spec("bert-tiny"))  # warm: imports, kernels' first calls
    two = spec("tests.perf.test_predict:LLAMA3_8B_2_LAYERS", batch_size=1, seq_len=512)
    depth = took(spec("llama3-8b", batch_size=1, seq_len=512)) / took(two)
    micro = spec("bert-base", (tech("accumulate", micro_batches=128),), batch_size=128)
    accumulation = took(micro) / took(spec("bert-base", batch_size=1))
    bert = spec("bert-base", batch_size=8, seq_len=128)
    card = took(bert, CARDS["l40s"]) / took(bert)
    print(
        f"\nissue 65: Llama-3-8B 32 layers ÷ 2 = {depth:.2f} (goal 1.5); 128 micro-batches ÷ 1 = "
        f"{accumulation:.2f} (goal 1.2); bert-base's row on an L40S ÷ without a card = {card:.2f} "
        "(goal 2)"
    )


def test_a_generations_decode_forwards_grown_side_by_side(monkeypatch):
    """llama-generate's bfloat16 entry at its GPU shapes, 128 new tokens: its decode forwards past
    the fourth grown from the last three traced (fake._untraced_decodes) against all 127 traced,
    each timed in this run, the two predictions equal."""
    from bench.predict import fake

    run = select(load("suites/llama-generate.toml"), ["half-bf16"]).runs[-1]
    predict(spec("bert-tiny"))  # warm: imports, kernels' first calls
    times, made = {}, {}
    for way in ("grown", "traced"):
        if way == "traced":
            monkeypatch.setattr(fake, "_untraced_decodes", lambda ctx: 0)
        monkeypatch.setattr(fake, "TEMPLATES", {})
        start = time.perf_counter()
        made[way] = predict(run)
        times[way] = time.perf_counter() - start
    assert made["grown"] == made["traced"] and made["grown"].ok
    print(
        f"\nllama-generate half-bf16, 128 new tokens: grown {times['grown']:.1f} s, traced "
        f"{times['traced']:.1f} s: {times['traced'] / times['grown']:.1f} times faster"
    )


def __getattr__(name: str) -> ModelSpec:
    """``tests.perf.test_predict:TV_<name>``: torchvision's classification model ``name``, as a user
    names one."""
    if not name.startswith("TV_"):
        raise AttributeError(name)
    model = name.removeprefix("TV_")
    quiet = (
        {"aux_logits": False, "init_weights": False}
        if model in ("inception_v3", "googlenet")
        else {}
    )
    return ModelSpec(
        name=model,
        build=lambda shapes: torchvision.models.get_model(model, num_classes=10, **quiet),
        inputs="image",
        num_classes=10,
    )


@pytest.mark.parametrize("model", torchvision.models.list_models(module=torchvision.models))
def test_every_torchvision_classification_model_predicts(model):
    # about 140 s for the 80 models on a two-core CI machine
    size = 299 if model == "inception_v3" else 224
    out = predict(spec(f"tests.perf.test_predict:TV_{model}", batch_size=1, image_size=size))
    assert out.status == "ok", out


def test_accumulation_costs_the_micro_batches_it_traces_not_their_count():
    """Past four, a step's micro-batches are not traced (bench.predict.fake._folded): 128 cost what
    16 do but for the allocator's replay of every request. Issue 65 asks 128 ÷ 1 ≤ 1.2."""
    times = {}
    for n in (1, 16, 128):
        techniques = (tech("accumulate", micro_batches=n),) if n > 1 else ()
        run = spec("bert-base", techniques, batch_size=n, seq_len=128)
        predict(run)  # warm: imports, kernels' first calls
        start = time.perf_counter()
        assert predict(run).status == "ok"
        times[n] = time.perf_counter() - start
    print(
        f"\nbert-base, a micro-batch of 1: predicted in {times[1]:.1f} s with no accumulation, "
        f"{times[16]:.1f} s with 16 micro-batches, {times[128]:.1f} s with 128: "
        f"128 ÷ 1 = {times[128] / times[1]:.2f}, 128 ÷ 16 = {times[128] / times[16]:.2f}"
    )
    assert times[128] / times[16] < 2  # traced whole, 128 took 8 times 16's


REPO = Path(__file__).resolve().parents[2]
LORA = REPO / "docs/examples/llama-lora"
# issue 65's "done when": each command as a user types it, cold (its own folder: no cached suite or
# prediction), and its goal in seconds on the quiet two-core CI machine
ASKED = {
    "Llama-3.1-8B LoRA job from its files, --card a100-40gb": (
        [
            "predict",
            "--hf",
            str(REPO / "suites/configs/llama-3.1-8b"),
            "--training-args",
            str(LORA / "training_args.json"),
            "--adapter-config",
            str(LORA / "adapter_config.json"),
            "--card",
            "a100-40gb",
            "--jobs",
            "1",
        ],
        15,
    ),
    "Llama-3.1-70B's config.json": (
        ["predict", "--hf", str(REPO / "suites/configs/llama-3.1-70b"), "--jobs", "1"],
        30,
    ),
    "advise bert-base --budget 8GiB": (
        ["advise", "bert-base", "--budget", "8GiB", "--out", "."],
        30,
    ),
    "predict llama-generate --card rtx4090": (
        ["predict", str(REPO / "suites/llama-generate.toml"), "--card", "rtx4090"],
        120,
    ),
}


@pytest.mark.parametrize("asked", ASKED)
def test_issue_65_commands_as_a_user_types_them(asked, tmp_path):
    """Each command's wall time, start-up included, against issue 65's goal: printed, not asserted
    (a loaded machine takes severalfold longer)."""
    argv, goal = ASKED[asked]
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "bench", *argv], cwd=tmp_path, capture_output=True, text=True
    )
    took = time.perf_counter() - start
    print(f"\nissue 65: {asked}: {took:.0f} s (goal {goal} s)")
    assert done.returncode == 0, done.stderr[-3000:]
