"""Techniques from optional packages: run where the package is installed (`make test` installs them),
unsupported with an install hint where it is not."""

import re

import pytest

from bench.measure.memory import model_state_bytes, tracked_step
from bench.worker import measure
from tests.conftest import CPU, build_trainer
from tests.helpers import spec, tech


def run(model, *techniques):
    trainer, batch = build_trainer(spec(model, techniques, batch_size=8, seq_len=32))
    trainer.step(batch)
    return tracked_step(lambda: trainer.step(batch), trainer.model, trainer.optimizer, CPU), trainer


@pytest.mark.parametrize("model", ["bert-tiny", "vit-tiny"])
def test_lora_trains_adapters_and_head_only(model):
    pytest.importorskip("peft")
    base, _ = run(model)
    lora, trainer = run(model, tech("lora", rank=4))
    proof = trainer.proof()
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    assert proof["lora.trainable_params"] == sum(p.numel() for p in trainable) < proof["lora.total_params"] / 5
    assert proof["lora.adapted_layers"] == 4  # two target layers in each of two blocks
    assert lora["optimizer_state_bytes"] < base["optimizer_state_bytes"] / 5


def test_int8_weights_store_frozen_linears_in_a_quarter_of_the_bytes():
    pytest.importorskip("torchao")
    pytest.importorskip("peft")
    lora, _ = run("bert-tiny", tech("lora"))
    int8, trainer = run("bert-tiny", tech("lora"), tech("int8-weights"))
    frozen_linears = trainer.proof()["int8-weights.quantized_linears"]
    assert frozen_linears == 2 * 6 + 1  # per layer q, k, v, attention out, MLP in, MLP out; plus the pooler
    assert int8["param_bytes"] < lora["param_bytes"]


def test_adamw_8bit_keeps_moments_in_about_a_quarter_of_the_bytes():
    pytest.importorskip("torchao")
    trainer, batch = build_trainer(spec("vit-tiny", (tech("adamw-8bit"),), batch_size=8))
    trainer.step(batch)
    figures = model_state_bytes(trainer.model, trainer.optimizer)
    assert trainer.proof()["adamw-8bit.optimizer"] == "torchao.optim.adam.AdamW8bit"
    # Small tensors stay fp32 (torchao quantizes tensors of 4096+ elements), so compare with fp32 AdamW.
    assert figures["optimizer_state_bytes"] < 0.6 * 2 * figures["param_bytes"]


@pytest.mark.parametrize("technique, model, reason", [
    ("fp8", "vit-tiny", "FP8 tensor cores are a GPU feature"),
    ("int8-weights", "resnet-tiny", "ResNet's only linear layer is its head"),
    ("lora", "resnet-tiny", "no default layers to adapt for this model: set targets"),
])
def test_inapplicable_low_bit_runs_are_unsupported(technique, model, reason):
    record = measure(spec(model, (tech(technique),)), CPU)  # decided before anything runs: no process needed
    assert record["status"] == "unsupported" and reason in record["message"], record


def test_missing_optional_package_gives_the_install_hint(monkeypatch):
    import importlib.util

    from bench.models import MODELS
    from bench.techniques import RunContext
    from bench.techniques.lowbit import AdamW8bit

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    ctx = RunContext(CPU, MODELS.get("vit-tiny"), None)
    assert "pip install torchao" in AdamW8bit().unsupported(ctx)


def test_int8_weights_leave_torchvision_attention_projections_alone():
    """torchvision's attention calls out_proj's weight directly (transposed), which int8 storage cannot."""
    pytest.importorskip("torchao")
    pytest.importorskip("peft")
    _, trainer = run("vit-tiny", tech("lora"), tech("int8-weights"))
    assert trainer.proof()["int8-weights.quantized_linears"] == 2 * 2  # the two MLP linears per block


def test_int8_weights_on_a_model_with_no_linear_but_its_head_is_unsupported_not_a_silent_no_op():
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig

    from bench.models import MODELS
    from bench.suite import Shapes
    from bench.techniques import Unsupported
    from bench.techniques.lowbit import quantize_body_linears

    convolutions = MODELS.get("resnet-tiny").build(Shapes(1, image_size=32))  # as a user's CNN would be
    with pytest.raises(Unsupported, match=r"no nn.Linear outside the head \(classifier, heads, fc\)"):
        quantize_body_linears(convolutions, Int8WeightOnlyConfig(), freeze=True)


@pytest.mark.parametrize("model, torchao, reason", [
    # ResNet's one linear is its head (to 10 classes here, 1000 at full size): FP8 would convert nothing,
    # whether or not torchao is there to be asked for.
    ("resnet-tiny", True, r"\(linears: fc 2048→10\): nothing would run in FP8"),
    ("resnet-tiny", False, r"\(linears: fc 2048→10\): nothing would run in FP8"),
    ("bert-tiny", False, "needs torchao: pip install torchao"),
])
def test_fp8_says_first_what_no_install_changes(monkeypatch, model, torchao, reason):
    """What a CUDA host without torchao would say, through the prediction (which stands for a CUDA run: on
    a CPU, fp8 is refused first as a GPU feature)."""
    from bench.predict.fake import predict
    from bench.techniques import lowbit

    if torchao:
        pytest.importorskip("torchao")
    else:
        monkeypatch.setattr(lowbit, "_has", lambda package: False)
    run = spec(model, (tech("fp8"),))
    out = predict(run, run.cpu, cuda=True)
    assert out["predicted_status"] == "unsupported" and re.search(reason, out["predicted_message"]), out
