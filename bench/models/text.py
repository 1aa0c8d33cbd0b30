"""BERT-base for sequence classification (transformers, random init from BertConfig), plus a tiny variant.

transformers is imported inside the builders: it takes seconds, and vision runs never need it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from bench.models import ModelSpec, children_of, register

if TYPE_CHECKING:
    from transformers import BertConfig

    from bench.spec import Shapes

NUM_LABELS = 10  # digits' ten classes (the accuracy phase trains on them)


def _bert(config: BertConfig, shapes: Shapes) -> nn.Module:
    from transformers import BertForSequenceClassification

    config.num_labels = NUM_LABELS
    config.max_position_embeddings = max(config.max_position_embeddings, shapes.seq_len)
    # SDPA attention, so that attention-kernel choices (flash, memory-efficient) apply to BERT.
    return BertForSequenceClassification._from_config(config, attn_implementation="sdpa")


def _bert_base(shapes: Shapes) -> nn.Module:
    from transformers import BertConfig

    return _bert(BertConfig(), shapes)


def _bert_tiny(shapes: Shapes) -> nn.Module:
    from transformers import BertConfig

    # BertConfig's initializer_range (0.02) is sized for hidden 768. At hidden 64 each sublayer's output
    # starts about 6x smaller than its input, so the post-LN encoder begins close to the identity and
    # learned digits to only 44% in the fidelity budget (±10.6 over seeds). LeCun's fan-in scale,
    # 1/sqrt(hidden), gives 82% (standard deviation 3.0 over six seeds) in the same 300 steps.
    hidden = 64
    config = BertConfig(
        vocab_size=128, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, initializer_range=hidden**-0.5,
    )
    return _bert(config, shapes)


BERT = {"blocks": children_of("bert.encoder.layer"), "family": "bert", "attention": True}
register(ModelSpec("bert-base", _bert_base, "tokens", NUM_LABELS, vocab_size=30522, **BERT))
register(ModelSpec("bert-tiny", _bert_tiny, "tokens", NUM_LABELS, vocab_size=128, **BERT))
