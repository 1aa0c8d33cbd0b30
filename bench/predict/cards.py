"""The cards ``--card`` names: their memory, and what a CUDA process holds on them besides its
tensors.

A step fits a card when the caching allocator, replayed under the card's memory less the context,
can reserve every segment the step asks for (bench.measure.allocator). The context is what NVML
counts for the process beyond the allocator's reserve: the CUDA context, the kernels' code, the
libraries' handles."""

from __future__ import annotations

from dataclasses import dataclass

GiB, MiB = 2**30, 2**20

# NVML's process memory less the allocator's peak reserve, the largest of the 14 committed H100
# records (742–764 MiB; tests/predict/test_cards.py holds it to them). No record yet measures
# another family: theirs is taken to be the same, which the table says.
H100_CONTEXT = 764 * MiB
MEASURED = "measured: NVML less reserved, committed H100 records"
ASSUMED = "assumed: the H100 figure (no record of this family yet)"


@dataclass(frozen=True)
class Card:
    name: str
    memory: int  # bytes, as its maker states it
    hopper: (
        bool  # compute capability 9.0: cuBLAS takes its larger workspace (bench.measure.allocator)
    )
    context: int
    context_source: str

    @property
    def capacity(self) -> int:
        """What the allocator's segments may take."""
        return self.memory - self.context


# transformers' docs, "Model training anatomy": a V100-SXM2 16 GB, CUDA 11.2, whose nvidia-smi shows
# 16160 MiB in all and 1343 MiB once a first tensor has loaded the kernels (no lazy loading before
# CUDA 11.7).
V100_DOCS = "transformers docs, model_memory_anatomy (CUDA 11.2)"

CARDS = {
    "v100": Card("Tesla V100-SXM2 16GB", 16160 * MiB, False, 1343 * MiB, "measured: " + V100_DOCS),
    "t4": Card("NVIDIA T4", 16 * GiB, False, H100_CONTEXT, ASSUMED),
    "l4": Card("NVIDIA L4", 24 * GiB, False, H100_CONTEXT, ASSUMED),
    "a10": Card("NVIDIA A10", 24 * GiB, False, H100_CONTEXT, ASSUMED),
    "rtx3090": Card("NVIDIA GeForce RTX 3090", 24 * GiB, False, H100_CONTEXT, ASSUMED),
    "rtx4090": Card("NVIDIA GeForce RTX 4090", 24 * GiB, False, H100_CONTEXT, ASSUMED),
    "a100-40gb": Card("NVIDIA A100 40GB", 40 * GiB, False, H100_CONTEXT, ASSUMED),
    "a100-80gb": Card("NVIDIA A100 80GB", 80 * GiB, False, H100_CONTEXT, ASSUMED),
    "l40s": Card("NVIDIA L40S", 48 * GiB, False, H100_CONTEXT, ASSUMED),
    "h100": Card("NVIDIA H100 80GB", 80 * GiB, True, H100_CONTEXT, MEASURED),
    "h200": Card("NVIDIA H200", 141 * GiB, True, H100_CONTEXT, ASSUMED),
}


def card(name: str) -> Card:
    """The card of a ``--card`` value; ValueError naming the cards known."""
    key = name.strip().lower().replace(" ", "").replace("_", "-")
    if key not in CARDS:
        raise ValueError(f"--card {name!r}: not a card known here; one of {', '.join(CARDS)}")
    return CARDS[key]
