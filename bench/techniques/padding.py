"""How variable-length sequences become batches: padded to the suite's seq_len (the baseline), to
the batch's longest, in batches of similar length, or packed into one row with attention that never
crosses a sequence.

Each chooses the run's collator (and sampler) through ``batching``; the data itself comes from the
suite's ``lengths`` (bench.data.varlen). Packing also changes the model: its attention runs on
cumulative sequence lengths (``attention_path``), through torch's variable-length flash attention
where it can, else a jagged NestedTensor with SDPA."""

from __future__ import annotations

import functools
import types
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn import functional as F

from bench.data import varlen
from bench.models import flash
from bench.techniques.base import TECHNIQUES, RunContext, Technique, Unsupported, option

if TYPE_CHECKING:
    from bench.data.synthetic import Batch

FAMILY = frozenset({"pad-to-max", "dynamic-padding", "length-bucketing", "packing", "nested"})
ATTENTION = "bench_varlen"  # the name transformers' attention interface knows packed attention by


class Padding(Technique):
    """What the batch-forming techniques share: token models only, one of them per run."""

    inputs: ClassVar[str] = "tokens"
    conflicts: ClassVar[frozenset[str]] = FAMILY

    def proof(self, steps: int) -> dict[str, Any]:
        return {"collator": self.name}


def pad_to(width: int | None, objective: str) -> Any:
    """The padding collator: to ``width``, or to the batch's longest sequence where it is None (a
    partial, so that the loader's worker processes can take it)."""
    return functools.partial(varlen.padded, width=width, objective=objective)


@TECHNIQUES.register("pad-to-max")
class PadToMax(Padding):
    """Every sequence padded to the suite's ``seq_len``: the fixed-shape batch most training scripts
    feed, and the baseline the others are measured against. Expected: the padding costs compute and
    activation memory in proportion to the padding fraction."""

    not_advised = (
        "forms batches from variable-length data (a suite's lengths); advice plans batches of "
        "fixed shapes"
    )
    summary = "every sequence padded to `seq_len`: the baseline"

    def batching(self, ctx: RunContext) -> varlen.Batching:
        return varlen.Batching(pad_to(ctx.shapes.seq_len, ctx.model_spec.objective), name=self.name)


@TECHNIQUES.register("dynamic-padding")
class DynamicPadding(Padding):
    """Each batch padded to its longest sequence (transformers' DataCollatorWithPadding). Expected:
    padding falls to the gap between a batch's longest and its others; memory and time with it."""

    not_advised = (
        "forms batches from variable-length data (a suite's lengths); advice plans batches of "
        "fixed shapes"
    )
    summary = "each batch padded to its longest (transformers' `DataCollatorWithPadding`)"

    def batching(self, ctx: RunContext) -> varlen.Batching:
        return varlen.Batching(pad_to(None, ctx.model_spec.objective), name=self.name)


@TECHNIQUES.register("length-bucketing")
class LengthBucketing(Padding):
    """Batches of similar length (transformers' group_by_length): sequences sorted by length within
    pools of ``pool`` batches, then padded to each batch's longest. Expected: padding near zero, at
    the cost of batches that are less random."""

    not_advised = (
        "forms batches from variable-length data (a suite's lengths); advice plans batches of "
        "fixed shapes"
    )
    summary = (
        "batches of similar length from pools of `pool` batches sorted by length, then shuffled "
        "(transformers' `group_by_length`)"
    )

    @dataclass(frozen=True)
    class Config:
        pool: int = option(
            50, "batches per pool sorted by length (larger: less padding, less randomness)"
        )

    def problems(self, batch_size: int) -> list[str]:
        if self.config.pool >= 1:
            return []
        return [f"pool must be ≥ 1, got {self.config.pool}"]

    def batching(self, ctx: RunContext) -> varlen.Batching:
        pool = self.config.pool
        return varlen.Batching(
            pad_to(None, ctx.model_spec.objective),
            lambda lengths, size, g: varlen.Buckets(lengths, size, pool, g),
            self.name,
        )


@TECHNIQUES.register("packing")
class Packing(Padding):
    """Padding-free batches (transformers' DataCollatorWithFlattening): the batch's sequences
    concatenated in one row, position ids restarting at each, and attention on cumulative sequence
    lengths so that it never crosses a sequence. Attention runs ``torch.nn.attention.varlen``
    (flash, 16-bit CUDA, no dropout), else a jagged NestedTensor through SDPA (flash or
    memory-efficient on CUDA, per-sequence on a CPU), or for causal attention, which NestedTensors
    refuse, SDPA one sequence at a time; a classifier pools each sequence's first token. Expected:
    no padding, no s×s scores; the article's 2.5× step time, and 2× tokens/s with about 20% less
    peak memory (arXiv:2407.09105)."""

    not_advised = (
        "forms batches from variable-length data (a suite's lengths); advice plans batches of "
        "fixed shapes"
    )
    summary = (
        "padding-free: a batch's sequences in one row, positions restarting, attention within each "
        "sequence on cumulative lengths (`DataCollatorWithFlattening`)"
    )

    def unsupported(self, ctx: RunContext) -> str | None:
        spec = ctx.model_spec
        if spec.family != "bert" and spec.objective != "next-token":
            return (
                "packing needs a model whose attention goes through transformers' attention "
                "interface and whose per-sequence output it can find: the bert family, or a "
                "next-token language model"
            )
        return None

    def batching(self, ctx: RunContext) -> varlen.Batching:
        return varlen.Batching(
            functools.partial(varlen.packed, objective=ctx.model_spec.objective), name=self.name
        )

    def fixed(self, batch: Batch, ctx: RunContext, parts: int) -> Batch:
        """The batch's sequences of seq_len tokens packed (TRL's padding-free rows, as full as its
        packing fills them), a row a micro-batch."""
        inputs, labels = batch
        objective = ctx.model_spec.objective
        packed, targets = varlen.packed([(ids, 0) for ids in inputs["input_ids"]], objective, parts)
        return packed, labels if objective == "classify" else targets  # a label a sequence

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        from transformers import AttentionInterface, AttentionMaskInterface

        self.paths: Counter[str] = Counter()
        if model.config._attn_implementation == flash.ATTENTION:
            # transformers' flash path runs the cumulative lengths itself, as TRL's packing has it
            self._flash_calls = flash.CALLS["variable-length"]
            return model
        self._flash_calls = None
        AttentionInterface.register(
            ATTENTION, functools.partial(packed_attention, paths=self.paths)
        )
        # the lengths are the mask
        AttentionMaskInterface.register(ATTENTION, lambda *args, **kwargs: None)
        model.config._attn_implementation = ATTENTION
        if ctx.model_spec.family == "bert":  # pool each sequence's [CLS], not the row's
            model.forward = types.MethodType(_packed_classifier, model)
        return model

    def proof(self, steps: int) -> dict[str, Any]:
        if self._flash_calls is not None:
            paths = {"transformers' flash path": flash.CALLS["variable-length"] - self._flash_calls}
        else:
            paths = self.paths
        return {
            "collator": self.name,
            "attention_path": ", ".join(sorted(p for p, n in paths.items() if n)) or "none",
            "attention_calls": sum(paths.values()),
        }


@TECHNIQUES.register("nested")
class Nested(Padding):
    """NestedTensor (jagged) batches end to end: no padding anywhere, every op on the ragged batch.
    Runs where the model's code takes a jagged batch; transformers' models reshape with the batch's
    sequence length and do not, and ``packing`` runs their attention on NestedTensors instead."""

    not_advised = (
        "forms batches from variable-length data (a suite's lengths); advice plans batches of "
        "fixed shapes"
    )
    summary = "NestedTensor (jagged) batches end to end, where a model takes them"

    def unsupported(self, ctx: RunContext) -> str | None:
        return (
            f"model {ctx.model_spec.name} reshapes its activations to (batch, sequence length, "
            "...), which a jagged NestedTensor has no single value of; packing runs its attention "
            "on NestedTensors instead"
        )

    def batching(self, ctx: RunContext) -> varlen.Batching:
        raise Unsupported(self.unsupported(ctx))


def _packed_classifier(
    self: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, **lengths: Any
) -> dict[str, torch.Tensor]:
    """BertForSequenceClassification's forward on a packed row: each sequence's [CLS] pooled and
    classified."""
    hidden = self.bert(input_ids=input_ids, position_ids=position_ids, **lengths).last_hidden_state
    first = hidden[0, lengths["cu_seq_lens_q"][:-1].long()]
    return {"logits": self.classifier(self.dropout(self.bert.pooler(first[:, None])))}


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    paths: Counter[str],
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over a packed row, (1, heads, tokens, dim), within each sequence of
    ``cu_seq_lens_q``; returns (1, tokens, heads, dim) as transformers' attention functions do."""
    cu, longest = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    causal = bool(getattr(module, "is_causal", False))
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (tokens, heads, dim)
    flashed = isinstance(q, FakeTensor) or _flash_varlen(q, dropout)
    if k.shape[1] != q.shape[1] and not (flashed and "enable_gqa" in _varlen_params()):
        # each key head repeated for its group of query heads, where the kernel cannot serve them
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    # bench predict: the flash variable-length kernel's outputs and saved tensors
    if isinstance(q, FakeTensor):
        paths["torch.nn.attention.varlen (fake tensors)"] += 1
        out = _varlen_attn(q, k, v=v, cu=cu, longest=longest, causal=causal, scaling=scaling)
    elif flashed:
        paths["torch.nn.attention.varlen"] += 1
        out = _varlen_attn(q, k, v=v, cu=cu, longest=longest, causal=causal, scaling=scaling)
    elif not causal:
        paths[f"nested-jagged-sdpa ({q.device.type})"] += 1
        out = _nested_sdpa(q, k, v=v, cu=cu, scaling=scaling, dropout=dropout)
    else:  # NestedTensor's SDPA takes no causal mask
        paths[f"per-sequence-sdpa ({q.device.type})"] += 1
        out = _per_sequence_sdpa(q, k, v=v, cu=cu, scaling=scaling, dropout=dropout)
    return out[None], None


def _flash_varlen(q: torch.Tensor, dropout: float) -> bool:
    """Whether torch's variable-length flash attention can run: CUDA, 16-bit, no dropout (it takes
    none)."""
    try:
        import torch.nn.attention.varlen  # noqa: F401  torch 2.10 and later
    except ImportError:
        return False
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and dropout == 0.0


def _varlen_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    longest: int,
    causal: bool,
    scaling: float | None,
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    extra = {"is_causal": causal}
    if "is_causal" not in params:
        extra = {"window_size": (-1, 0) if causal else (-1, -1)}
    if "scale" in params:
        extra["scale"] = scaling
    if k.shape[1] != q.shape[1]:  # grouped keys, served as flash serves them
        extra["enable_gqa"] = True
    return varlen_attn(q, k, v, cu, cu, longest, longest, **extra)


@functools.cache
def _varlen_params() -> frozenset[str]:
    """varlen_attn's keyword names, read once: torch 2.10/2.11 take is_causal, later releases a
    window."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _per_sequence_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """Causal attention one sequence at a time (the boundaries read to the host: a sync on CUDA)."""
    bounds = cu.tolist()
    outs = [
        F.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1) for x in (q, k, v)),
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
        ).transpose(0, 1)
        for a, b in zip(bounds, bounds[1:])
    ]
    return torch.cat(outs)


def _nested_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    offsets = cu.long()

    def jagged(x: torch.Tensor) -> torch.Tensor:  # (sequences, heads, ragged, dim)
        return torch.nested.nested_tensor_from_jagged(x, offsets=offsets).transpose(1, 2)

    with warnings.catch_warnings():
        # the CPU path converts to the strided layout inside SDPA, and says so
        warnings.filterwarnings(
            "ignore", message="The PyTorch API of nested tensors is in prototype stage"
        )
        out = F.scaled_dot_product_attention(
            jagged(q), jagged(k), jagged(v), dropout_p=dropout, scale=scaling
        )
    return out.transpose(1, 2).values()
