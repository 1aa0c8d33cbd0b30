"""The cards ``--card`` names: their memory, and what a CUDA process holds on them besides its
tensors.

A step fits a card when the caching allocator, replayed under the card's memory less the context,
can reserve every segment the step asks for (bench.measure.allocator). The context is what NVML
counts for the process beyond the allocator's reserve: the CUDA context, the kernels' code, the
libraries' handles."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20

# NVML's process memory less the allocator's peak reserve, the largest of the committed H100
# records (758–766 MiB; tests/predict/test_cards.py holds it and the H200's to them). Families no
# record measures yet take the H100's, which the table says.
H100_CONTEXT = 766 * MiB
MEASURED = "measured: NVML less reserved, committed {} records"
ASSUMED = "assumed: the H100 figure (no record of this family yet)"


@dataclass(frozen=True, kw_only=True)
class Card:
    name: str
    # bytes CUDA sees (torch's total_memory, the "total capacity" of its out-of-memory message): the
    # maker's figure less what the driver keeps, and ECC's share where it is on (a T4 sold as 16 GB
    # shows 14.6 GiB). The H100 records' own OOM message says 79.18 GiB where 80 GiB was assumed.
    memory: int
    memory_source: str
    # compute capability 9.0: cuBLAS takes its larger workspace (bench.measure.allocator)
    hopper: bool = False
    context: int = H100_CONTEXT
    context_source: str = ASSUMED

    @property
    def capacity(self) -> int:
        """What the allocator's segments may take."""
        return self.memory - self.context


def _gib(figure: float) -> int:
    """A "total capacity of X GiB" as PyTorch prints it, to two decimals: to the nearest MiB."""
    return round(figure * 1024) * MiB


# transformers' docs, "Model training anatomy": a V100-SXM2 16 GB, CUDA 11.2, whose nvidia-smi shows
# 16160 MiB in all and 1343 MiB once a first tensor has loaded the kernels (no lazy loading before
# CUDA 11.7).
V100_DOCS = "transformers docs, model_memory_anatomy (CUDA 11.2)"
OOM = "a published out-of-memory message's total capacity"

CARDS = {
    "v100": Card(
        name="Tesla V100-SXM2 16GB",
        memory=16160 * MiB,
        memory_source="nvidia-smi's total, " + V100_DOCS,
        context=1343 * MiB,
        context_source="measured: " + V100_DOCS,
    ),
    # ECC on: 14.56-14.76 GiB by driver; 14.58 under driver 535 (mbzuai-oryx/GeoPixel#5)
    "t4": Card(name="NVIDIA T4", memory=_gib(14.58), memory_source=OOM + ", driver 535"),
    # vLLM's CI on L4s (22.05 GiB); the A10 is the same 24 GB of GDDR6 with ECC on, no figure here
    "l4": Card(name="NVIDIA L4", memory=_gib(22.05), memory_source=OOM + " (vLLM's CI)"),
    "a10": Card(name="NVIDIA A10", memory=_gib(22.05), memory_source="assumed: the L4's"),
    "rtx3090": Card(name="NVIDIA GeForce RTX 3090", memory=_gib(23.69), memory_source=OOM),
    # ali-vilab/VGen#104, 3DTopia/Phidias-Diffusion#8
    "rtx4090": Card(name="NVIDIA GeForce RTX 4090", memory=_gib(23.64), memory_source=OOM),
    # TianheWu/CoSeR#10
    "a100-40gb": Card(name="NVIDIA A100 40GB", memory=_gib(39.50), memory_source=OOM),
    # levihsu/OOTDiffusion#235
    "a100-80gb": Card(name="NVIDIA A100 80GB", memory=_gib(79.25), memory_source=OOM),
    # 44.39-44.42 GiB in vLLM users' reports
    "l40s": Card(name="NVIDIA L40S", memory=_gib(44.39), memory_source=OOM),
    "h100": Card(
        name="NVIDIA H100 80GB",
        memory=_gib(79.18),
        memory_source="measured: the committed H100 records' out-of-memory message",
        hopper=True,
        context_source=MEASURED.format("H100"),
    ),
    # the H200 records' llama/baseline: CUDA's free bytes at the refused request (its history), the
    # allocator's segments then and the context NVML measured beside them (758 MiB)
    "h200": Card(
        name="NVIDIA H200",
        memory=143227 * MiB,
        memory_source="measured: the committed H200 records' out-of-memory history",
        hopper=True,
        context=758 * MiB,
        context_source=MEASURED.format("H200"),
    ),
}


def card(name: str) -> Card:
    """The card of a ``--card`` value; ValueError naming the cards known."""
    key = name.strip().lower().replace(" ", "").replace("_", "-")
    if key not in CARDS:
        raise ValueError(f"--card {name!r}: not a card known here; one of {', '.join(CARDS)}")
    return CARDS[key]
