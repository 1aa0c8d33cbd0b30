"""Generation, for suites with ``mode = "generate"``: transformers' own ``generate()`` on a causal
language model, greedy, a fixed number of new tokens (``min_new_tokens`` equal to it, so no sequence
stops early), with the techniques applied. A step is one generation: the prompt's prefill, which
makes the first token, then one forward per token from the key-value cache.

The generator tells what it sees to those who measure it: the phase of the forward now running (the
tracker labels what it allocates by it, and keeps each phase's peak), the cache's tensors (counted
as such), and per step the moments the step began, its first decode forward began and it ended (the
time to the first token, and the decoding rate)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from bench.data.synthetic import Batch
from bench.measure.memory import tensor_bytes
from bench.models import ModelSpec
from bench.record import Phase
from bench.techniques import RunContext, Technique, applied, combined
from bench.train import techniques_proof

PREFILL, DECODE = Phase.PREFILL, Phase.DECODE


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """Every tensor a transformers ``Cache`` holds, layer by layer: keys and values, and a quantized
    cache's states and scales (wrapper tensors, as quanto's, are counted by what they wrap)."""
    found = []
    for layer in getattr(cache, "layers", None) or []:
        for value in vars(layer).values():
            found += [
                t
                for t in (value if isinstance(value, tuple | list) else (value,))
                if torch.is_tensor(t)
            ]
    return found


class Generator:
    """Eval mode, no optimizer, no gradients; the same interface as ``Trainer`` for the worker, and
    the phases a tracker reads (``phase``, ``cache``)."""

    optimizer = None

    def __init__(
        self, model: nn.Module, spec: ModelSpec, techniques: list[Technique], ctx: RunContext
    ) -> None:
        self.spec, self.techniques = spec, techniques
        self.model = applied(model, techniques, ctx).eval()
        self.policy = combined([t.step() for t in techniques])
        self.prompt_len, self.new_tokens = ctx.shapes.prompt_len, ctx.shapes.new_tokens
        self.cuda = ctx.device.type == "cuda"
        self.phase = ""  # of the forward now running: prefill (every prompt chunk) or decode
        self._seen = 0  # tokens this step's forwards have taken
        self._cache: Any = None  # the cache of the last forward
        # its class (DynamicCache, StaticCache, …): what the techniques made of it
        self.cache_class = ""
        self.forwards = {PREFILL: 0, DECODE: 0}  # in the last step
        self.cache_bytes = 0  # the cache's bytes on the device at their largest, over the last step
        self.cache_held: list[int] = []  # its device bytes after each forward of the last step
        # the classes of the cache's layers (DynamicLayer, StaticLayer, …)
        self.cache_layers: frozenset[str] = frozenset()
        self.marks: list[list[Any]] = []  # per step: its start, its first decode forward's, its end
        self.steps = 0
        self.generated = 0  # new tokens per sequence, in the last step
        self.model.register_forward_pre_hook(self._begin, with_kwargs=True)
        self.model.register_forward_hook(self._end, with_kwargs=True)

    def kwargs(self) -> dict[str, Any]:
        """generate()'s arguments: greedy, exactly ``new_tokens`` new tokens, and the techniques'
        (the cache, the prefill's chunks)."""
        n = self.new_tokens
        fixed = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False, "use_cache": True}
        return fixed | dict(self.policy.generation)

    @torch.no_grad()
    def step(self, batch: Batch) -> torch.Tensor:
        """One generation from the batch's prompts; returns the sequences, prompt and new tokens."""
        inputs, _ = self.policy.prepare(batch)
        self._seen, self.cache_bytes, self.forwards = 0, 0, {PREFILL: 0, DECODE: 0}
        self.cache_held = []
        self.marks.append([self._now(), None, None])
        with self.policy.context():
            sequences = self.model.generate(**inputs, **self.kwargs())
        self.marks[-1][2] = self._now()
        self.generated = sequences.shape[1] - self.prompt_len
        self._cache, self.phase = None, ""
        self.steps += 1
        return sequences

    def cache(self) -> list[torch.Tensor]:
        """The tensors of the cache the last forward used."""
        return cache_tensors(self._cache)

    def timings(self, steps: int) -> list[tuple[float, float]]:
        """The last ``steps`` steps' time to the first token and time decoding the rest, in
        milliseconds."""
        if self.cuda:
            torch.cuda.synchronize()

        def ms(a: Any, b: Any) -> float:
            if self.cuda:
                return a.elapsed_time(b)
            return (b - a) * 1e3

        return [(ms(start, first), ms(first, end)) for start, first, end in self.marks[-steps:]]

    def proof(self) -> dict[str, object]:
        own = {
            "new_tokens": self.generated,
            "prefill_forwards": self.forwards[PREFILL],
            "decode_forwards": self.forwards[DECODE],
            "cache": self.cache_class,
        }
        return own | techniques_proof(self.techniques, self.steps)

    def _begin(self, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs["inputs_embeds"]
        if self._seen < self.prompt_len:
            self.phase = PREFILL
        else:
            self.phase = DECODE
        if self.phase == DECODE and not self.forwards[DECODE]:
            self.marks[-1][1] = self._now()
        self.forwards[self.phase] += 1
        self._seen += tokens.shape[1]

    def _end(self, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        self._cache = kwargs.get("past_key_values") or getattr(out, "past_key_values", None)
        self.cache_class = type(self._cache).__name__
        self.cache_layers = frozenset(
            type(layer).__name__ for layer in getattr(self._cache, "layers", None) or []
        )
        # an offloaded cache's layers on the host are not the card's
        if self.cuda:
            device = "cuda"
        else:
            device = "cpu"
        held = tensor_bytes(t for t in self.cache() if t.device.type == device)
        self.cache_bytes = max(self.cache_bytes, held)
        self.cache_held.append(held)

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
