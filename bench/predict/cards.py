"""The cards ``--card`` names: their memory, and what a CUDA process holds on them besides its
tensors.

A step fits a card when the caching allocator, replayed under the card's memory less the context,
can reserve every segment the step asks for (bench.measure.allocator). The context is what NVML
counts for the process beyond the allocator's reserve: the CUDA context, the kernels' code, the
libraries' handles."""

from __future__ import annotations

from dataclasses import dataclass

GiB, MiB = 2**30, 2**20

# NVML's process memory less the allocator's peak reserve, the largest of the committed H100
# records (758–766 MiB; tests/predict/test_cards.py holds it to them). No record yet measures
# another family: theirs is taken to be the same, which the table says.
H100_CONTEXT = 766 * MiB
MEASURED = "measured: NVML less reserved, committed H100 records"
ASSUMED = "assumed: the H100 figure (no record of this family yet)"


@dataclass(frozen=True, kw_only=True)
class Card:
    name: str
    memory: int  # bytes, as its maker states it
    # compute capability 9.0: cuBLAS takes its larger workspace (bench.measure.allocator)
    hopper: bool = False
    context: int = H100_CONTEXT
    context_source: str = ASSUMED

    @property
    def capacity(self) -> int:
        """What the allocator's segments may take."""
        return self.memory - self.context


# transformers' docs, "Model training anatomy": a V100-SXM2 16 GB, CUDA 11.2, whose nvidia-smi shows
# 16160 MiB in all and 1343 MiB once a first tensor has loaded the kernels (no lazy loading before
# CUDA 11.7).
V100_DOCS = "transformers docs, model_memory_anatomy (CUDA 11.2)"

CARDS = {
    "v100": Card(
        name="Tesla V100-SXM2 16GB",
        memory=16160 * MiB,
        context=1343 * MiB,
        context_source="measured: " + V100_DOCS,
    ),
    "t4": Card(name="NVIDIA T4", memory=16 * GiB),
    "l4": Card(name="NVIDIA L4", memory=24 * GiB),
    "a10": Card(name="NVIDIA A10", memory=24 * GiB),
    "rtx3090": Card(name="NVIDIA GeForce RTX 3090", memory=24 * GiB),
    "rtx4090": Card(name="NVIDIA GeForce RTX 4090", memory=24 * GiB),
    "a100-40gb": Card(name="NVIDIA A100 40GB", memory=40 * GiB),
    "a100-80gb": Card(name="NVIDIA A100 80GB", memory=80 * GiB),
    "l40s": Card(name="NVIDIA L40S", memory=48 * GiB),
    "h100": Card(name="NVIDIA H100 80GB", memory=80 * GiB, hopper=True, context_source=MEASURED),
    "h200": Card(name="NVIDIA H200", memory=141 * GiB, hopper=True),
}


def card(name: str) -> Card:
    """The card of a ``--card`` value; ValueError naming the cards known."""
    key = name.strip().lower().replace(" ", "").replace("_", "-")
    if key not in CARDS:
        raise ValueError(f"--card {name!r}: not a card known here; one of {', '.join(CARDS)}")
    return CARDS[key]
