import pytest
import torch

from bench.data.synthetic import synthetic_batch
from bench.models import MODELS
from bench.suite import RunSpec
from bench.techniques import RunContext
from bench.train import Trainer

CPU = torch.device("cpu")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def build_trainer(spec: RunSpec, device: torch.device = CPU) -> tuple[Trainer, object]:
    """The model and techniques of a spec, applied in this process, with its synthetic batch."""
    model_spec = MODELS.get(spec.model)
    shapes = spec.shapes(device.type)
    torch.manual_seed(spec.seed)
    model = model_spec.build(shapes).to(device)
    trainer = Trainer(model, model_spec, [t.build() for t in spec.techniques], RunContext(device, model_spec, shapes),
                      spec.lr)
    return trainer, synthetic_batch(model_spec, shapes, spec.seed, device)
