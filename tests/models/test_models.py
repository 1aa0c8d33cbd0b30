import pytest
import torch

from bench.data.synthetic import split, synthetic_batch
from bench.models import MODELS
from bench.suite import Shapes

CPU = torch.device("cpu")


@pytest.mark.parametrize("name, params, blocks", [
    ("resnet50", 25_557_032, 16), ("vit-b16", 86_567_656, 12), ("bert-base", 109_489_930, 12),
])
def test_full_size_models_match_their_published_sizes(name, params, blocks):
    spec = MODELS.get(name)
    with torch.device("meta"):  # structure only: no memory, no init time
        model = spec.build(Shapes(1, image_size=224, seq_len=512))
    assert sum(p.numel() for p in model.parameters()) == params
    assert len(spec.blocks(model)) == blocks


@pytest.mark.parametrize("name", ["resnet-tiny", "vit-tiny", "bert-tiny"])
def test_tiny_models_take_their_synthetic_batch(name):
    spec = MODELS.get(name)
    shapes = Shapes(6, image_size=32 if spec.inputs == "image" else None, seq_len=16 if spec.inputs == "tokens" else None)
    model = spec.build(shapes)
    inputs, labels = synthetic_batch(spec, shapes, seed=0, device=CPU)
    assert labels.shape == (6,) and int(labels.max()) < spec.num_classes
    assert spec.logits(model, inputs).shape == (6, spec.num_classes)
    parts = split((inputs, labels), 3)
    assert [p[1].shape[0] for p in parts] == [2, 2, 2]


def test_synthetic_batches_are_reproducible_from_the_seed():
    spec = MODELS.get("bert-tiny")
    shapes = Shapes(4, seq_len=8)
    a, b = (synthetic_batch(spec, shapes, seed=3, device=CPU) for _ in range(2))
    assert torch.equal(a[0]["input_ids"], b[0]["input_ids"]) and torch.equal(a[1], b[1])
