"""Synthetic batches: random inputs of the model's shape and labels in its label space (for a
language model, its input ids), from a seed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from bench.models import IGNORE

if TYPE_CHECKING:
    from bench.models import Inputs, ModelSpec
    from bench.spec import Shapes

Batch = tuple["Inputs", torch.Tensor]
# DataCollatorForLanguageModeling's default mlm_probability: the share of positions a masked LM is
# scored on. The chosen positions keep their ids: a [MASK] id is the tokenizer's, not the config's,
# and what the step holds is the same either way.
MLM_PROBABILITY = 0.15


def synthetic_batch(spec: ModelSpec, shapes: Shapes, seed: int, device: torch.device) -> Batch:
    g = torch.Generator().manual_seed(seed)
    b = shapes.batch_size
    labels = torch.randint(0, spec.num_classes, (b,), generator=g)
    if spec.inputs == "image":
        inputs: Inputs = torch.randn(b, 3, shapes.image_size, shapes.image_size, generator=g)
    else:
        ids = torch.randint(0, spec.vocab_size, (b, shapes.seq_len), generator=g)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if spec.objective == "next-token":  # a language model's targets are its own inputs
            labels = ids.clone()
        elif spec.objective == "masked-lm":
            # DataCollatorForLanguageModeling's share of positions is scored
            chosen = torch.rand(b, shapes.seq_len, generator=g) < MLM_PROBABILITY
            labels = ids.masked_fill(~chosen, IGNORE)
        elif spec.objective == "seq2seq":
            # targets as long as the sources; the decoder reads them shifted right by one, as
            # DataCollatorForSeq2Seq prepares them (prepare_decoder_input_ids_from_labels)
            labels = torch.randint(0, spec.vocab_size, (b, shapes.seq_len), generator=g)
            inputs["decoder_input_ids"] = F.pad(labels[:, :-1], (1, 0), value=0)
    return to_device(inputs, device), labels.to(device)


def to_device(inputs: Inputs, device: torch.device, non_blocking: bool = False) -> Inputs:
    """``non_blocking``: from pinned host memory, the copy overlaps the step instead of waiting for
    it."""
    if isinstance(inputs, dict):  # a packed batch's longest length rides along as an int
        return {
            k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v
            for k, v in inputs.items()
        }
    return inputs.to(device, non_blocking=non_blocking)


def clone_batch(batch: Batch) -> Batch:
    """A fresh copy: allocated inside a tracked step, the batch counts as it does on CUDA."""
    inputs, labels = batch
    if isinstance(inputs, dict):
        inputs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    else:
        inputs = inputs.clone()
    return inputs, labels.clone()


def split(batch: Batch, n: int) -> list[Batch]:
    """``n`` equal micro-batches along the batch dimension (n divides the batch: checked at
    load)."""
    if n == 1:
        return [batch]
    inputs, labels = batch
    label_parts = labels.tensor_split(n)
    if isinstance(inputs, dict):  # each input split once: n views of it, not n² made on the way
        # (a packed batch's longest length is an int, the same for each)
        splits = {
            k: v.tensor_split(n) if isinstance(v, torch.Tensor) else [v] * n
            for k, v in inputs.items()
        }
        parts = [{k: pieces[i] for k, pieces in splits.items()} for i in range(n)]
    else:
        parts = list(inputs.tensor_split(n))
    return list(zip(parts, label_parts))


def samples_in(batch: Batch) -> int:
    inputs = batch[0]
    if isinstance(inputs, dict) and "cu_seq_lens_q" in inputs:  # packed: each row's sequences
        return inputs["cu_seq_lens_q"].numel() - inputs["input_ids"].shape[0]
    return int(batch[1].shape[0])
