import torch

from bench.models import MODELS
from bench.suite import Shapes
from bench.techniques import RunContext
from bench.techniques.sharing import CrossLayerSharing
from tests.conftest import build_trainer
from tests.helpers import spec, tech


def shared(model_name, groups, **shape):
    model_spec = MODELS.get(model_name)
    shapes = Shapes(1, **shape)
    with torch.device("meta"):
        model = model_spec.build(shapes)
    technique = CrossLayerSharing(CrossLayerSharing.Config(groups=groups))
    technique.apply(model, RunContext(torch.device("meta"), model_spec, shapes))
    return technique.proof(1)


def layer_params(model_name, **shape):
    with torch.device("meta"):
        model = MODELS.get(model_name).build(Shapes(1, **shape))
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


def test_shared_model_trains_and_shrinks_optimizer_state():
    trainer, batch = build_trainer(spec("vit-tiny", (tech("share-layers"),)))
    trainer.step(batch)
    layers = trainer.model.encoder.layers
    assert layers[0] is layers[1]
    state = sum(v.numel() for s in trainer.optimizer.state.values() for v in s.values() if v.dim())
    assert state == 2 * sum(p.numel() for p in trainer.model.parameters())
