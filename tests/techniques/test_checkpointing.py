import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from bench.measure.memory import tracked_step
from bench.techniques import Unsupported
from tests.conftest import CPU, build_trainer
from tests.helpers import spec, suite_problems, tech
from tests.suite.test_load import GOOD


def held_and_trainer(model: str, *techniques, batch_size: int = 8):
    trainer, batch = build_trainer(spec(model, tuple(techniques), batch_size=batch_size))
    trainer.step(batch)
    figures = tracked_step(lambda: trainer.step(batch), trainer.model, trainer.optimizer, CPU)
    return figures, trainer


@pytest.mark.parametrize("model, blocks", [("vit-tiny", 2), ("resnet-tiny", 4), ("bert-tiny", 2)])
def test_wraps_every_block_and_recomputes_it_in_backward(model, blocks):
    base, _ = held_and_trainer(model)
    ckpt, trainer = held_and_trainer(model, tech("checkpoint"))
    wrapped = [m for m in trainer.model.modules() if isinstance(m, CheckpointWrapper)]
    assert len(wrapped) == blocks
    proof = trainer.proof()
    assert proof["checkpoint.wrapped_modules"] == blocks
    assert proof["checkpoint.block_forwards_per_step"] == 2.0  # forward, then recompute in backward
    assert ckpt.activation_bytes < base.activation_bytes


def test_dense_layers_in_a_module_dict_are_found_and_wrapped():
    base, _ = held_and_trainer("tests.helpers:DENSENET")
    ckpt, trainer = held_and_trainer("tests.helpers:DENSENET", tech("checkpoint"))
    assert trainer.proof()["checkpoint.wrapped_modules"] == 5  # 3 + 2 dense layers
    assert ckpt.activation_bytes < base.activation_bytes


def test_a_model_with_no_block_to_wrap_is_unsupported_with_the_reason():
    with pytest.raises(
        Unsupported, match="checkpoint: wrapped_modules = 0: it found nothing to apply to"
    ):
        build_trainer(spec("tests.helpers:LINEAR", (tech("checkpoint"),)))


def test_same_gradients_as_without_checkpointing():
    """ViT-tiny has neither dropout nor batch norm: recomputation must reproduce the forward
    exactly."""
    grads = []
    for techniques in [(), (tech("checkpoint"),)]:
        trainer, (inputs, labels) = build_trainer(spec("vit-tiny", techniques))
        loss = torch.nn.functional.cross_entropy(trainer.model(inputs), labels)
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_every_k_and_selective_sit_between_none_and_full():
    held = {}
    for label, techniques in {
        "none": (),
        "full": (tech("checkpoint"),),
        "every-2": (tech("checkpoint", every=2),),
        "selective": (tech("selective-checkpoint"),),
    }.items():
        figures, trainer = held_and_trainer("vit-tiny", *techniques, batch_size=32)
        held[label] = figures.activation_bytes
        if label == "every-2":
            assert trainer.proof()["checkpoint.wrapped_modules"] == 1
        if label == "selective":
            proof = trainer.proof()
            # Per layer: q/k/v in-projection, out-projection, two MLP linears are saved ...
            assert proof["selective-checkpoint.saved_ops_per_step"] > 0
            # ... and the rest (norms, GELU, adds, views) is recomputed.
            recomputed, saved = (
                proof[f"selective-checkpoint.{k}_ops_per_step"] for k in ("recomputed", "saved")
            )
            assert recomputed > saved
    assert held["full"] < held["every-2"] < held["none"]
    assert held["full"] < held["selective"] < held["none"]


def running_means(trainer) -> dict[str, torch.Tensor]:
    return {
        n.replace("_checkpoint_wrapped_module.", ""): b.clone()
        for n, b in trainer.model.named_buffers()
        if n.endswith("running_mean")
    }


@pytest.mark.parametrize("correct", [False, True])
def test_batch_norm_stats_update_twice_unless_the_momentum_is_corrected(correct):
    plain, batch = build_trainer(spec("resnet-tiny", batch_size=8))
    ckpt, _ = build_trainer(
        spec("resnet-tiny", (tech("checkpoint", bn_momentum_correction=correct),), batch_size=8)
    )
    plain.step(batch)
    ckpt.step(batch)
    expected, got = running_means(plain), running_means(ckpt)
    in_blocks = [n for n in expected if n.startswith("layer")]
    same = [torch.allclose(got[n], expected[n], rtol=1e-5, atol=1e-6) for n in in_blocks]
    # Corrected: two updates with momentum 1 - sqrt(1 - m) equal one with m. Uncorrected: none
    # match.
    assert all(same) if correct else not any(same)
    # the stem is not wrapped
    assert torch.equal(got["bn1.running_mean"], expected["bn1.running_mean"])


def test_selective_policies_are_named_torchtitans_saving_every_other_matmul():
    held = {}
    attention = {"ops": "_scaled_dot_product_flash_attention_for_cpu"}  # SDPA's kernel on a CPU
    for save, extra in (("matmuls", {}), ("torchtitan", {}), ("ops", attention)):
        trainer, batch = build_trainer(
            spec(
                "llama-tiny",
                (tech("selective-checkpoint", save=save, **extra),),
                batch_size=2,
                seq_len=32,
            )
        )
        trainer.step(batch)
        held[save] = tracked_step(
            lambda t=trainer, b=batch: t.step(b), trainer.model, trainer.optimizer, CPU
        ).activation_bytes
        proof = trainer.techniques[0].proof(1)
        if save == "torchtitan":  # 7 matmuls a layer: 4 saved, 3 recomputed, attention saved
            assert proof["saved_ops_per_step"] > 0 and proof["recomputed_ops_per_step"] > 0
    assert held["ops"] < held["torchtitan"] < held["matmuls"]


@pytest.mark.parametrize(
    "options, said",
    [
        ({"save": "ops"}, "save = 'ops' needs ops"),
        ({"ops": "mm"}, "ops goes with save = 'ops'"),
        ({"save": "ops", "ops": "mm,matmool"}, "no aten operator 'matmool'"),
    ],
)
def test_a_selective_policy_that_cannot_be_built_is_refused_at_load(options, said, tmp_path):
    technique = (
        '{ name = "selective-checkpoint", '
        + ", ".join(f'{k} = "{v}"' for k, v in options.items())
        + " }"
    )
    found = suite_problems(tmp_path, GOOD.replace('"checkpoint"]', technique + "]"))
    assert any(said in p for p in found), found


def test_reentrant_checkpointing_under_adapters_trains_them_once_the_inputs_require_grad():
    """Reentrant checkpointing passes gradients only to inputs that require them: with the base
    frozen, a Llama's layers see none unless its embeddings' output requires grad, as transformers'
    gradient_checkpointing_enable (and LLaMA-Factory's own) makes it."""
    model, lora = "hf:suites/configs/tiny-llama", tech("lora", rank=4)
    trainer, batch = build_trainer(spec(model, (tech("checkpoint", reentrant=True), lora)))
    with pytest.raises(RuntimeError, match="does not require grad"):
        trainer.step(batch)
    checkpoint = tech("checkpoint", reentrant=True, input_grads=True)
    trainer, batch = build_trainer(spec(model, (checkpoint, lora)))
    trainer.step(batch)
    assert trainer.proof()["checkpoint.block_forwards_per_step"] == 2.0
    assert trainer.proof()["checkpoint.inputs_require_grad"] is True
    adapters = [p for name, p in trainer.model.named_parameters() if "lora_B" in name]
    assert adapters and all(p.abs().sum() > 0 for p in adapters)  # B starts at zero
