"""FlashAttention as a config or a job names it (``attn_implementation = "flash_attention_2"``),
where the ``flash_attn`` package is not installed: transformers' own flash path
(``integrations.flash_attention``: its casts, its padding-free and unpadded variable-length cases)
run on the FlashAttention-2 kernel that PyTorch carries (``aten._flash_attention_forward``, the
same source, keeping the same tensors for backward: the inputs, the output and its log-sum-exp),
grouped keys served natively, as flash_attn serves them. Runs on CUDA and on a prediction's fake
tensors; a real CPU tensor has no such kernel (a model naming it is not measured on a CPU)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

ATTENTION = "bench_flash"  # the name transformers' attention interface knows it by
# the names a config or SFTConfig gives FlashAttention (TRL's FLASH_ATTENTION_VARIANTS)
NAMES = frozenset(
    {
        "flash_attention_2",
        "flash_attention_3",
        "kernels-community/flash-attn2",
        "kernels-community/flash-attn3",
        "kernels-community/vllm-flash-attn3",
    }
)
aten = torch.ops.aten
# the kernel's calls in this process, on whole rows and on cumulative lengths (a technique's proof)
CALLS: Counter[str] = Counter()


def register() -> str:
    """Registers the attention (and its mask: transformers' flash mask, None where nothing is
    padded) with transformers; returns its name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, flash_attention_mask)
    _loaded()  # a model built with it asks for its flash functions at once
    return ATTENTION


def attention(module: nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """transformers' flash_attention_forward, its flash functions the kernel PyTorch carries."""
    from transformers.integrations.flash_attention import flash_attention_forward

    if not (query.is_cuda or isinstance(query, FakeTensor)):
        raise RuntimeError("FlashAttention runs on CUDA only; name sdpa to run on this device")
    _loaded()
    if "cu_seq_lens_q" not in kwargs:
        # a batch of one whose position ids are its own positions: transformers reads their
        # values to tell it from sequences packed without their lengths (which no batch here
        # is: a packed one gives them), and fake tensors have none
        kwargs.pop("position_ids", None)
    return flash_attention_forward(module, query, *args, **kwargs)


def _loaded() -> None:
    """transformers' lazy import of flash functions (``lazy_import_flash_attention``), done with
    these: it keeps one implementation's at a time, under its name."""
    from transformers import modeling_flash_attention_utils as utils

    if utils._loaded_implementation == ATTENTION:
        return
    utils._flash_fn, utils._flash_varlen_fn = flash_attn_func, flash_attn_varlen_func
    utils._flash_with_kvcache_fn = None
    utils._pad_fn, utils._unpad_fn = utils._pad_input, utils._unpad_input
    utils._process_flash_kwargs_fn = utils._lazy_define_process_function(flash_attn_varlen_func)
    utils._process_with_kvcache_kwargs_fn = dict
    utils._loaded_implementation = ATTENTION


def flash_attn_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any
) -> torch.Tensor:
    """flash_attn's, on (batch, tokens, heads, dim): the kernel with no cumulative lengths."""
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=q.shape[1],
        max_seqlen_k=k.shape[1],
        **options,
    )


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
) -> torch.Tensor:
    """flash_attn's, on (tokens, heads, dim) with each sequence's cumulative lengths (or, from
    flash_attn_func, on whole rows without them); its keywords are the ones transformers passes
    both (its ``_lazy_define_process_function`` reads them off this signature)."""
    if softcap:
        raise NotImplementedError(
            "FlashAttention's softcap: PyTorch's FlashAttention-2 kernel has none; name eager"
        )
    cu = [None if c is None else c.to(torch.int32) for c in (cu_seqlens_q, cu_seqlens_k)]
    CALLS["fixed" if cu[0] is None else "variable-length"] += 1
    left, right = window_size
    out = aten._flash_attention_forward(
        query=q,
        key=k,
        value=v,
        cum_seq_q=cu[0],
        cum_seq_k=cu[1],
        max_q=max_seqlen_q,
        max_k=max_seqlen_k,
        dropout_p=dropout_p,
        is_causal=causal,
        return_debug_mask=False,
        scale=softmax_scale,
        window_size_left=None if left < 0 else left,
        window_size_right=None if right < 0 else right,
    )
    return out[0]
