import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from bench import models
from bench.data.synthetic import split, synthetic_batch
from bench.launch import Device
from bench.models import MODELS, ModelSpec, repeated_blocks
from bench.suite import Shapes
from bench.techniques import RunContext, build
from tests.conftest import build_trainer
from tests.helpers import isolated, spec, tech

CPU = torch.device("cpu")
USER = "tests.helpers:IMAGE_MLP"  # a model of the user's, named by import path
LM = "tests.helpers:TINY_LM"  # a causal language model of the user's


@pytest.mark.parametrize(
    "name, params, blocks",
    [
        ("resnet50", 25_557_032, 16),
        ("vit-b16", 86_567_656, 12),
        ("bert-base", 109_489_930, 12),
    ],
)
def test_full_size_models_match_their_published_sizes(name, params, blocks):
    spec = MODELS.get(name)
    with torch.device("meta"):  # structure only: no memory, no init time
        model = spec.build(Shapes(batch_size=1, image_size=224, seq_len=512))
    assert sum(p.numel() for p in model.parameters()) == params
    assert len(spec.blocks(model)) == blocks


@pytest.mark.parametrize("name", ["resnet-tiny", "vit-tiny", "bert-tiny"])
def test_tiny_models_take_their_synthetic_batch(name):
    spec = MODELS.get(name)
    image = spec.inputs == "image"
    shapes = Shapes(batch_size=6, image_size=32 if image else None, seq_len=None if image else 16)
    model = spec.build(shapes)
    inputs, labels = synthetic_batch(spec, shapes, seed=0, device=CPU)
    assert labels.shape == (6,) and int(labels.max()) < spec.num_classes
    assert spec.logits(model, inputs).shape == (6, spec.num_classes)
    parts = split((inputs, labels), 3)
    assert [p[1].shape[0] for p in parts] == [2, 2, 2]


def test_synthetic_batches_are_reproducible_from_the_seed():
    spec = MODELS.get("bert-tiny")
    shapes = Shapes(batch_size=4, seq_len=8)
    a, b = (synthetic_batch(spec, shapes, seed=3, device=CPU) for _ in range(2))
    assert torch.equal(a[0]["input_ids"], b[0]["input_ids"]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize(
    "name, shapes",
    [
        ("resnet50", Shapes(batch_size=1, image_size=224)),
        ("vit-b16", Shapes(batch_size=1, image_size=224)),
        ("bert-base", Shapes(batch_size=1, seq_len=128)),
        ("vit-tiny", Shapes(batch_size=1, image_size=32)),
        ("bert-tiny", Shapes(batch_size=1, seq_len=16)),
    ],
)
def test_blocks_found_in_the_module_tree_are_the_ones_the_registry_names(name, shapes):
    # The default for a user's model, checked against the hand-written lists of the built-in ones.
    spec = MODELS.get(name)
    with torch.device("meta"):
        model = spec.build(shapes)
    assert repeated_blocks(model) == spec.blocks(model)


def test_a_users_model_is_named_by_import_path_and_its_blocks_found():
    spec = models.resolve("tests.helpers:IMAGE_MLP")
    assert spec.name == "image-mlp" and not spec.attention and spec.family == ""
    assert spec.blocks(spec.build(Shapes(batch_size=1, image_size=8))) == ["2.0", "2.1", "2.2"]


@pytest.mark.parametrize(
    "name, message",
    [
        ("tests.helpers:NOPE", "cannot import model 'tests.helpers:NOPE': AttributeError"),
        ("no_such_module:SPEC", "cannot import model 'no_such_module:SPEC': ModuleNotFoundError"),
        (
            "tests.helpers:spec",
            "model 'tests.helpers:spec' is a function, not a bench.models.ModelSpec",
        ),
        ("resnet-51", "unknown model 'resnet-51' (did you mean 'resnet50'?); known: bert-base"),
    ],
)
def test_a_model_that_cannot_be_resolved_says_why(name, message):
    with pytest.raises(KeyError, match=re.escape(message)):
        models.resolve(name)


def test_a_model_spec_with_impossible_inputs_is_refused_where_it_is_written():
    with pytest.raises(ValueError, match="vocab_size"):
        ModelSpec(name="words", build=lambda shapes: nn.Identity(), inputs="tokens", num_classes=2)


def test_a_language_model_is_a_token_model():
    with pytest.raises(ValueError, match="objective 'next-token' needs inputs = 'tokens'"):
        ModelSpec(
            name="pixels",
            build=lambda shapes: nn.Identity(),
            inputs="image",
            num_classes=2,
            objective="next-token",
        )


def test_a_language_models_loss_scores_each_position_on_the_next_token():
    lm = models.resolve(LM)
    batch = synthetic_batch(lm, Shapes(batch_size=2, seq_len=5), seed=0, device=CPU)
    ids = batch[0]["input_ids"]
    assert torch.equal(batch[1], ids)  # the targets are the inputs themselves
    logits = torch.randn(2, 5, lm.vocab_size)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, lm.vocab_size), ids[:, 1:].reshape(-1))
    assert torch.allclose(lm.loss(logits, ids), expected)


def test_a_users_model_runs_in_its_own_process_with_its_blocks_checkpointed():
    record = isolated(spec(USER, (tech("checkpoint"),)), Device("cpu", "cpu"))
    assert record["status"] == "ok", record
    assert record["proof"]["checkpoint.wrapped_modules"] == 3
    # which ones, not only how many
    assert record["proof"]["checkpoint.wrapped_names"] == "2.0, 2.1, 2.2"
    # each block ran twice: really wrapped
    assert record["proof"]["checkpoint.block_forwards_per_step"] == 2.0


def test_lora_adapts_the_linears_named_on_a_users_model():
    pytest.importorskip("peft")
    trainer, batch = build_trainer(spec(USER, (tech("lora", targets="fc1,fc2", trainable="3"),)))
    trainer.step(batch)
    proof = trainer.proof()
    assert proof["lora.adapted_layers"] == 6  # fc1 and fc2 of three blocks
    head = 32 * 10 + 10
    adapters = 6 * 8 * (32 + 64)  # rank 8: A (r × in) and B (out × r), 32 ↔ 64 features
    assert proof["lora.trainable_params"] == head + adapters


@pytest.mark.parametrize(
    "technique, reason",
    [
        (tech("sdpa"), "the model has no attention"),
        (tech("lora"), "no default layers to adapt for this model: set targets"),
        (tech("shared-basis"), "only ResNet's stages have 3×3 convolutions"),
    ],
)
def test_techniques_that_need_a_layout_say_so_on_a_users_model(technique, reason):
    model_spec = models.resolve(USER)
    assert (
        build(technique)
        .unsupported(
            RunContext(
                device=CPU,
                model_spec=model_spec,
                shapes=Shapes(batch_size=2, image_size=8),
                lr=1e-3,
            )
        )
        .startswith(reason)
    )


def test_blocks_are_found_where_a_container_holds_a_run_of_one_class_among_others():
    from torchvision.models import efficientnet_b0, mobilenet_v3_small

    from bench.models import repeated_blocks

    # stem and head share the Sequential with the 11 blocks
    mobile = repeated_blocks(mobilenet_v3_small())
    assert mobile == [f"features.{i}" for i in range(1, 12)]
    efficient = repeated_blocks(efficientnet_b0())  # stages 1 and 7 hold a single block each
    assert (
        len(efficient) == 16 and efficient[0] == "features.1.0" and efficient[-1] == "features.7.0"
    )


def test_logits_narrower_than_num_classes_say_which_widths_disagree():
    from dataclasses import replace

    narrow = replace(models.resolve("vit-tiny"), num_classes=12)
    with pytest.raises(ValueError, match="logits are 10 wide but its spec says num_classes = 12"):
        narrow.loss(torch.zeros(4, 10), torch.tensor([0, 1, 9, 11]))
