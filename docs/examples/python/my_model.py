"""Your own model's training step predicted from Python (bench.entry.predict_step), no suite to write:
the same job `bench predict docs/examples/python/my_model.toml --card rtx4090` predicts, to the
byte (tests/test_entry.py runs both).

    .venv/bin/python docs/examples/python/my_model.py
"""

import torch
from torch import nn

from bench.entry import predict_step
from bench.models import ModelSpec


class Block(nn.Module):
    """A residual convolution, the unit checkpointing wraps (repeated blocks of one class)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.norm = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.conv(x)))


def build(shapes) -> nn.Module:
    """Eight residual blocks of 128 channels and a 10-class head, at any image size."""
    return nn.Sequential(
        nn.Conv2d(3, 128, 3, padding=1),
        *(Block(128) for _ in range(8)),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )


def make_optimizer(params) -> torch.optim.Optimizer:
    """Your optimizer, made from the trainable parameters: SGD with Nesterov momentum."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True)


MY_CNN = ModelSpec(name="my-cnn", build=build, inputs="image", num_classes=10)
TECHNIQUES = ["checkpoint", {"name": "amp", "dtype": "bfloat16"}]

if __name__ == "__main__":
    images, labels = torch.randn(256, 3, 64, 64), torch.randint(10, (256,))
    prediction = predict_step(
        MY_CNN,
        (images, labels),
        techniques=TECHNIQUES,
        optimizer=make_optimizer,
        card="rtx4090",
    )
    print(
        f"{prediction.status}: peak {prediction.peak_tensor_bytes / 2**30:.2f} GiB allocated, "
        f"{prediction.peak_reserved_bytes / 2**30:.2f} GiB reserved; on {prediction.card}: "
        f"{prediction.verdict}"
    )
