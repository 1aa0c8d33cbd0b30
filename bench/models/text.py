"""BERT-base for sequence classification (transformers, random init from BertConfig), plus a tiny variant; and
Llama-3-8B's shapes as a causal language model, for predictions of runs over many GPUs.

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


def _llama3_8b(shapes: Shapes) -> nn.Module:
    """Llama-3-8B's shapes (Meta's config.json): 32 layers of 4,096 with 32 query and 8 key-value heads, an MLP
    of 14,336 and a 128,256-token vocabulary; 8.03 billion parameters, random, never trained here."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=LLAMA3_VOCAB, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, use_cache=False,
                         max_position_embeddings=max(8192, shapes.seq_len), tie_word_embeddings=False)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


LLAMA3_VOCAB = 128_256
register(ModelSpec("llama3-8b", _llama3_8b, "tokens", LLAMA3_VOCAB, vocab_size=LLAMA3_VOCAB, objective="next-token",
                   attention=True, cpu=False))
