"""Model registry: each entry builds a randomly initialised model from its config (nothing downloaded)
and says what its inputs look like and which blocks repeat (the units checkpointing wraps)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from bench.registry import Registry

if TYPE_CHECKING:
    from bench.suite import Shapes

Inputs = torch.Tensor | dict[str, torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[Shapes], nn.Module]
    inputs: Literal["image", "tokens"]
    num_classes: int
    # Dotted module names of the repeated blocks (residual blocks, encoder layers).
    blocks: Callable[[nn.Module], list[str]]
    vocab_size: int = 0

    @property
    def shape_keys(self) -> tuple[str, ...]:
        """The shape entries a suite must give for this model besides batch_size."""
        return ("image_size",) if self.inputs == "image" else ("seq_len",)

    def logits(self, model: nn.Module, inputs: Inputs) -> torch.Tensor:
        if isinstance(inputs, dict):
            return model(**inputs)["logits"]  # a ModelOutput, or the plain dict a traced model returns
        return model(inputs)


MODELS: Registry[ModelSpec] = Registry("model")


def register(spec: ModelSpec) -> ModelSpec:
    return MODELS.register(spec.name)(spec)


def children_of(container: str) -> Callable[[nn.Module], list[str]]:
    """Block names for every child of the module(s) named, e.g. ``"layer1,layer2"``."""

    def names(model: nn.Module) -> list[str]:
        out = []
        for path in container.split(","):
            out += [f"{path}.{n}" for n, _ in model.get_submodule(path).named_children()]
        return out

    return names


from bench.models import text, vision  # noqa: F401  (registers the models)
