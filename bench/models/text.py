"""BERT-base for sequence classification (transformers, random init from BertConfig), plus a tiny
variant; and Llama-3 causal language models: 8B's shapes for predictions of runs over many GPUs,
1B's for one GPU, and a tiny one of the same family for a CPU.

transformers is imported inside the builders: it takes seconds, and vision runs never need it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from bench.models import ModelSpec, children_of, register

if TYPE_CHECKING:
    from transformers import BertConfig

    from bench.spec import Shapes

NUM_LABELS = 10  # digits' ten classes (the accuracy phase trains on them)
LLAMA3_VOCAB, TINY_VOCAB, DIGITS_VOCAB = 128_256, 32_768, 48
# Llama-3-8B's config.json, as LlamaConfig's fields
LLAMA3_8B = {
    "vocab_size": LLAMA3_VOCAB,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}
# llama-tiny's: the family at a CPU's size
LLAMA_TINY = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


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

    # BertConfig's initializer_range (0.02) is sized for hidden 768. At hidden 64 each sublayer's
    # output starts about 6x smaller than its input, so the post-LN encoder begins close to the
    # identity and learned digits to only 44% in the fidelity budget (±10.6 over seeds). LeCun's
    # fan-in scale, 1/sqrt(hidden), gives 82% (standard deviation 3.0 over six seeds) in the same
    # 300 steps.
    hidden = 64
    config = BertConfig(
        vocab_size=128,
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        initializer_range=hidden**-0.5,
    )
    return _bert(config, shapes)


BERT = {
    "blocks": children_of("bert.encoder.layer"),
    "family": "bert",
    "attention": True,
    "imports": ("transformers.models.bert.modeling_bert",),
}
register(
    ModelSpec(
        name="bert-base",
        build=_bert_base,
        inputs="tokens",
        num_classes=NUM_LABELS,
        vocab_size=30522,
        **BERT,
    )
)
register(
    ModelSpec(
        name="bert-tiny",
        build=_bert_tiny,
        inputs="tokens",
        num_classes=NUM_LABELS,
        vocab_size=128,
        **BERT,
    )
)


LLAMA3_CONTEXT = 131_072  # max_position_embeddings of Meta's Llama-3.1 and 3.2 configs


def _llama(shapes: Shapes, **shape: object) -> nn.Module:
    """A Llama-3-family causal language model of ``shape`` (LlamaConfig's names), random, with SDPA
    attention, and Llama-3.1's and 3.2's context of 131,072 positions (no buffer is sized by it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        rope_theta=500000.0,
        use_cache=False,
        max_position_embeddings=max(LLAMA3_CONTEXT, shapes.seq_len),
        **shape,
    )
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def _llama3_8b(shapes: Shapes) -> nn.Module:
    """Llama-3-8B's shapes (Meta's config.json): 32 layers of 4,096 with 32 query and 8 key-value
    heads, an MLP of 14,336 and a 128,256-token vocabulary; 8.03 billion parameters, random, never
    trained here."""
    return _llama(shapes, **LLAMA3_8B)


def _llama3_1b(shapes: Shapes) -> nn.Module:
    """Llama-3.2-1B's shapes (Meta's config.json): 16 layers of 2,048 with 32 query and 8 key-value
    heads, an MLP of 8,192, and the 128,256-token vocabulary, its embedding tied to the head; 1.24
    billion parameters."""
    return _llama(
        shapes,
        vocab_size=LLAMA3_VOCAB,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    )


def _llama_tiny(shapes: Shapes) -> nn.Module:
    """The same family at a CPU's size, its vocabulary kept at 32,768 so that, as in the real model,
    the logits are the largest activation (batch 8 × 256 tokens: 256 MiB of float32 logits against
    4.6 million parameters)."""
    return _llama(shapes, **LLAMA_TINY)


def _llama_digits(shapes: Shapes) -> nn.Module:
    """llama-tiny's layers with the 48 tokens of the digits task (bench.data.real), for a CPU's
    fidelity phase: at 32,768 tokens the head made a training step of the task take seconds."""
    return _llama(
        shapes,
        vocab_size=DIGITS_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )


LLAMA = {
    "objective": "next-token",
    "attention": True,
    "blocks": children_of("model.layers"),
    "family": "llama",
    "imports": ("transformers.models.llama.modeling_llama",),
}
register(
    ModelSpec(
        name="llama3-8b",
        build=_llama3_8b,
        inputs="tokens",
        num_classes=LLAMA3_VOCAB,
        vocab_size=LLAMA3_VOCAB,
        cpu=False,
        **LLAMA,
    )
)
register(
    ModelSpec(
        name="llama3-1b",
        build=_llama3_1b,
        inputs="tokens",
        num_classes=LLAMA3_VOCAB,
        vocab_size=LLAMA3_VOCAB,
        **LLAMA,
    )
)
register(
    ModelSpec(
        name="llama-tiny",
        build=_llama_tiny,
        inputs="tokens",
        num_classes=TINY_VOCAB,
        vocab_size=TINY_VOCAB,
        **LLAMA,
    )
)
register(
    ModelSpec(
        name="llama-digits",
        build=_llama_digits,
        inputs="tokens",
        num_classes=DIGITS_VOCAB,
        vocab_size=DIGITS_VOCAB,
        **LLAMA,
    )
)
