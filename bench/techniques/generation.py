"""Generation techniques, for suites with ``mode = "generate"``: the key-value cache generate()
keeps, and how the prompt is prefilled. Each sets transformers' own generate() arguments; the run's
proof names the cache class generate() made and counts the prefill's forwards."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

from bench.techniques.base import GENERATE, TECHNIQUES, RunContext, Step, Technique, offer, option

# The quantized cache's backends (transformers' QuantizedCache) and the package each needs; fp8 is
# transformers' own, in the releases that have it.
BACKENDS = {"quanto": "optimum.quanto", "hqq": "hqq", "fp8": None}
KINDS = {  # the kind, as generate()'s cache_implementation names it
    "dynamic": "dynamic",
    "static": "static",
    "offloaded": "offloaded",
    "offloaded-static": "offloaded_static",
    "quantized": "quantized",
}


@TECHNIQUES.register("kv-cache")
class KVCache(Technique):
    """The key-value cache generate() keeps (``cache_implementation``): ``dynamic`` grows by one
    token per layer each step (concatenation, the default); ``static`` is allocated at the full
    length once, so shapes never change (what ``torch.compile`` needs); ``offloaded`` keeps every
    layer but the one computing on the host (CUDA); ``quantized`` stores keys and values in
    ``nbits`` (transformers' QuantizedCache: quanto or HQQ where installed, or fp8 where
    transformers has it), with the last ``residual_length`` tokens kept in full precision.

    Expected: the cache is 2 × layers × key-value heads × head dim × tokens × batch × bytes per
    element; static holds it at prompt + new tokens from the start (the same peak, no growth, no
    copies); quantized at 4 bits about a quarter of it plus scales and the residual window (KIVI;
    transformers' docs); offloaded about one layer's worth on the card, at the cost of host
    transfers each token.
    """

    modes = GENERATE
    axis = "cache"
    offers = (
        offer("kv-cache-static", kind="static"),
        offer("kv-cache-quantized", kind="quantized"),
    )
    conflicts = frozenset({"kv-cache"})
    summary = "the key-value cache generate() keeps: dynamic, static, offloaded or quantized"

    @dataclass(frozen=True)
    class Config:
        kind: Literal["dynamic", "static", "offloaded", "offloaded-static", "quantized"] = option(
            "static", "the cache generate() keeps"
        )
        backend: Literal["quanto", "hqq", "fp8"] = option("quanto", "quantized: the quantizer")
        nbits: int = option(
            4, "quantized (quanto, hqq): bits per element, 2 or 4 (quanto), up to 8 (hqq)"
        )
        residual_length: int = option(
            128, "quantized (quanto, hqq): recent tokens kept in full precision"
        )
        q_group_size: int = option(64, "quantized (quanto, hqq): elements sharing a scale")

    @property
    def unpredictable(self) -> str:  # type: ignore[override]
        if self.config.kind.startswith("offloaded"):
            return "fake tensors cannot stand for the copies between the card and the host"
        if self.config.kind == "quantized" and self.config.backend != "fp8":
            return f"{self.config.backend}'s quantizer reads values that fake tensors do not hold"
        return ""

    def problems(self, batch_size: int) -> list[str]:
        c = self.config
        if (
            c.kind == "quantized"
            and c.backend != "fp8"
            and min(c.nbits, c.residual_length, c.q_group_size) < 1
        ):
            return ["kv-cache: nbits, residual_length and q_group_size must be at least 1"]
        return []

    def unsupported(self, ctx: RunContext) -> str | None:
        c = self.config
        if c.kind.startswith("offloaded") and not ctx.cuda:
            return (
                "offloading moves the cache from the card to the host; a CPU run keeps it there "
                "already"
            )
        if c.kind != "quantized":
            return None
        if c.backend == "fp8":
            from transformers import cache_utils

            if not hasattr(cache_utils, "Fp8QuantizedLayer"):
                return "this transformers has no fp8 quantized cache (transformers 5.23 has one)"
            return None
        if importlib.util.find_spec(BACKENDS[c.backend].split(".")[0]) is None:
            if c.backend == "quanto":
                package = "optimum-quanto"
            else:
                package = "hqq"
            return f"needs {package} for the {c.backend} backend: pip install {package}"
        return None

    def step(self) -> Step:
        c = self.config
        kwargs: dict[str, Any] = {"cache_implementation": KINDS[c.kind]}
        if c.kind == "quantized":
            group = {
                "nbits": c.nbits,
                "residual_length": c.residual_length,
                "q_group_size": c.q_group_size,
            }
            kwargs["cache_config"] = {"backend": c.backend} | ({} if c.backend == "fp8" else group)
        return Step(generation=tuple(kwargs.items()))


@TECHNIQUES.register("chunked-prefill")
class ChunkedPrefill(Technique):
    """The prompt prefilled ``chunk`` tokens at a time (generate()'s ``prefill_chunk_size``), each
    chunk's keys and values written to the cache before the next: the prefill's activations are a
    chunk's, not the prompt's.

    Expected: the prefill peak falls towards the cache plus one chunk's activations (the attention
    scores and the MLP's intermediate grow with the chunk); the decode peak is unchanged; the time
    to the first token rises a little (more, smaller forwards).
    """

    modes = GENERATE
    axis = "activations"
    offers = (offer("chunked-prefill-512", chunk=512),)
    summary = "the prompt prefilled `chunk` tokens at a time"

    @dataclass(frozen=True)
    class Config:
        chunk: int = option(512, "tokens per prefill forward")

    def problems(self, batch_size: int) -> list[str]:
        if self.config.chunk >= 1:
            return []
        return [f"chunked-prefill: chunk must be at least 1, got {self.config.chunk}"]

    def unsupported(self, ctx: RunContext) -> str | None:
        if ctx.shapes.prompt_len is not None and self.config.chunk >= ctx.shapes.prompt_len:
            return (
                f"chunk = {self.config.chunk} holds the whole prompt of {ctx.shapes.prompt_len} "
                "tokens: the run would measure the baseline under its name"
            )
        return None

    def step(self) -> Step:
        return Step(generation=(("prefill_chunk_size", self.config.chunk),))
