"""Techniques: the interface and registry in ``base``, one module per technique family."""

from bench.techniques import (  # noqa: F401  (each module registers its techniques)
    accumulation,
    adapters,
    allocator,
    checkpointing,
    compile,
    distributed,
    inference,
    kernels,
    loss,
    lowbit,
    offload,
    optimizers,
    padding,
    precision,
    sharing,
)
from bench.techniques.base import (
    ANY_MODE,
    AXES,
    INFERENCE,
    TECHNIQUES,
    TRAIN,
    NoOptions,
    Offer,
    RunContext,
    Step,
    Technique,
    Unsupported,
    build,
    combined,
    offer,
    option,
    refuse_unchanged,
    resolve,
)

__all__ = [
    "ANY_MODE", "AXES", "INFERENCE", "TECHNIQUES", "TRAIN", "NoOptions", "Offer", "RunContext", "Step", "Technique",
    "Unsupported", "build", "combined", "offer", "option", "refuse_unchanged", "resolve",
]
