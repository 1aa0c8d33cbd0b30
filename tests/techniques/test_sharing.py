from pathlib import Path

import torch

from bench.models import MODELS
from bench.suite import Shapes
from bench.techniques import RunContext
from bench.techniques.sharing import CrossLayerSharing
from tests.conftest import build_trainer
from tests.helpers import spec, tech


def shared(model_name, groups, **shape):
    model_spec = MODELS.get(model_name)
    shapes = Shapes(batch_size=1, **shape)
    with torch.device("meta"):
        model = model_spec.build(shapes)
    technique = CrossLayerSharing(CrossLayerSharing.Config(groups=groups))
    technique.apply(
        model, RunContext(device=torch.device("meta"), model_spec=model_spec, shapes=shapes)
    )
    return technique.proof(1)


def layer_params(model_name, **shape):
    with torch.device("meta"):
        model = MODELS.get(model_name).build(Shapes(batch_size=1, **shape))
    first = MODELS.get(model_name).blocks(model)[0]
    return sum(p.numel() for p in model.get_submodule(first).parameters())


def test_one_group_leaves_one_encoder_layer_for_bert_and_vit():
    for name, shape in [("bert-base", {"seq_len": 128}), ("vit-b16", {"image_size": 224})]:
        proof = shared(name, 1, **shape)
        assert proof["blocks_sharing"] == 11
        assert proof["params_before"] - proof["params_after"] == 11 * layer_params(name, **shape)


def test_groups_keep_that_many_distinct_layers():
    proof = shared("bert-base", 3, seq_len=128)
    assert proof["blocks_sharing"] == 9


def test_resnet_shares_the_identical_blocks_within_each_stage():
    proof = shared("resnet50", 1, image_size=224)
    # The first block of a stage changes width (downsample), so blocks 2..n of stage share block 2.
    assert proof["blocks_sharing"] == (3 - 2) + (4 - 2) + (6 - 2) + (3 - 2)


def test_resnets_fidelity_stand_in_has_blocks_to_share_as_resnet50_has():
    """resnet-tiny stood in for ResNet-50 in a CPU's fidelity phase: with one block a stage,
    share-layers found nothing to share there and resnet's share-layers ended "ok, fidelity
    failed"."""
    from bench.suite import load

    stand_in = load(Path("suites/resnet.toml")).runs[0].fidelity_cpu.model
    assert shared(stand_in, 1, image_size=32)["blocks_sharing"] == 1


def test_shared_model_trains_and_shrinks_optimizer_state():
    trainer, batch = build_trainer(spec("vit-tiny", (tech("share-layers"),)))
    trainer.step(batch)
    layers = trainer.model.encoder.layers
    assert layers[0] is layers[1]
    state = sum(v.numel() for s in trainer.optimizer.state.values() for v in s.values() if v.dim())
    assert state == 2 * sum(p.numel() for p in trainer.model.parameters())


def test_shared_basis_replaces_every_stage_3x3_conv_with_the_exact_parameter_count():
    trainer, batch = build_trainer(
        spec("resnet-tiny", (tech("shared-basis", basis=4),), batch_size=4)
    )
    plain, _ = build_trainer(spec("resnet-tiny", batch_size=4))
    convs = [
        m
        for n, m in plain.model.named_modules()
        if n.startswith("layer") and isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3)
    ]
    full = sum(m.weight.numel() for m in convs)
    # Each 9-weight kernel becomes 4 coefficients; plus one 4×9 basis per stage.
    expected = sum(p.numel() for p in plain.model.parameters()) - full + full // 9 * 4 + 4 * 4 * 9
    proof = trainer.proof()
    assert proof["shared-basis.replaced_convs"] == len(convs) == 4
    assert (
        proof["shared-basis.params_after"]
        == expected
        == sum(p.numel() for p in trainer.model.parameters())
    )
    trainer.model(batch[0]).sum().backward()
    bases = {id(m.basis): m.basis for m in trainer.model.modules() if hasattr(m, "basis")}
    assert len(bases) == 4 and all(
        b.grad is not None and b.grad.abs().sum() > 0 for b in bases.values()
    )


def test_shared_basis_starts_from_the_best_low_rank_version_of_the_initial_kernels():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 8, 3, padding=1)
    from bench.techniques.sharing import SharedBasisConv2d

    basis = torch.nn.Parameter(torch.eye(9)[:9])  # a complete basis reproduces the conv exactly
    x = torch.randn(2, 8, 5, 5)
    torch.testing.assert_close(SharedBasisConv2d(conv, basis)(x), conv(x))
