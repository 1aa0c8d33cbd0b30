"""ResNet-50 and ViT-B/16 from torchvision, plus tiny variants with the same structure for tests.

torchvision is imported inside the builders: its models import torch._dynamo (about 1.4 s), which
every bench command (suites name models) and every text model's run would otherwise pay for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from bench.models import ModelSpec, children_of, register

if TYPE_CHECKING:
    from bench.spec import Shapes


def _resnet50(shapes: Shapes) -> nn.Module:
    from torchvision.models import resnet50

    return resnet50(weights=None)


def _resnet_tiny(shapes: Shapes) -> nn.Module:
    from torchvision.models.resnet import Bottleneck, ResNet

    # One bottleneck per stage, narrow: the same code paths as ResNet-50 (BN, downsample,
    # residuals).
    return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10, width_per_group=16)


def _resnet_small(shapes: Shapes) -> nn.Module:
    from torchvision.models.resnet import Bottleneck, ResNet

    # resnet-tiny with three blocks in its third stage, the last two identical as ResNet-50's blocks
    # after a stage's first are: ResNet-50's stand-in in a CPU's fidelity phase, where share-layers
    # has blocks to share (on resnet-tiny it had none, and its phase failed). 8% slower a step than
    # resnet-tiny.
    return ResNet(Bottleneck, [1, 1, 3, 1], num_classes=10, width_per_group=16)


def _vit_b16(shapes: Shapes) -> nn.Module:
    from torchvision.models import vit_b_16

    return vit_b_16(weights=None, image_size=shapes.image_size)


def _vit_tiny(shapes: Shapes) -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        image_size=shapes.image_size,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=64,
        mlp_dim=128,
        num_classes=10,
    )


TORCHVISION = ("torchvision.models",)
RESNET = {
    "blocks": children_of("layer1,layer2,layer3,layer4"),
    "family": "resnet",
    "imports": TORCHVISION,
}
VIT = {
    "blocks": children_of("encoder.layers"),
    "family": "vit",
    "attention": True,
    "imports": TORCHVISION,
}
register(ModelSpec(name="resnet50", build=_resnet50, inputs="image", num_classes=1000, **RESNET))
register(
    ModelSpec(name="resnet-tiny", build=_resnet_tiny, inputs="image", num_classes=10, **RESNET)
)
register(
    ModelSpec(name="resnet-small", build=_resnet_small, inputs="image", num_classes=10, **RESNET)
)
register(ModelSpec(name="vit-b16", build=_vit_b16, inputs="image", num_classes=1000, **VIT))
register(ModelSpec(name="vit-tiny", build=_vit_tiny, inputs="image", num_classes=10, **VIT))
