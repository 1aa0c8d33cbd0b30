"""Techniques: the interface and registry in ``base``, one module per technique family."""

from bench.techniques.base import TECHNIQUES, NoOptions, RunContext, Technique, Unsupported, option, resolve

from bench.techniques import (  # noqa: E402,F401,I001  (each module registers its techniques)
    accumulation, adapters, allocator, checkpointing, compile, kernels, lowbit, offload, optimizers, precision,
    sharing,
)

__all__ = ["TECHNIQUES", "NoOptions", "RunContext", "Technique", "Unsupported", "option", "resolve"]
