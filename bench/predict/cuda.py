"""What makes the fake step on a CPU stand for CUDA's: the kernels and implementations CUDA picks
where they keep other tensors than CPU's (attention, dropout, the optimizer's loop; autocast's op
lists are in ``autocast``), and the state CUDA keeps on the host. ``ASSUMPTIONS`` says each of them,
and what is not modelled, to the table's reader."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest.mock import patch

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.optim import optimizer as torch_optimizer

from bench.measure.host import is_on_host, making_host
from bench.predict.autocast import cuda_autocast
from bench.techniques import Unsupported

ASSUMPTIONS = (
    "fake CPU tensors stand for CUDA ones, in 512-byte blocks; attention runs CUDA's fused "
    "kernels as CUDA picks them (flash for 16-bit inputs without a mask, else memory-efficient, "
    "or math for grouped keys; the sdpa technique's backend where named); dropout, the math "
    "path's too, saves a one-byte mask; an optimizer left to choose runs foreach; norms save "
    "their statistics in CUDA's dtypes; optimizers' step counters and the memory-efficient "
    "kernel's RNG seed and offset live on the host, as on CUDA; autocast casts by CUDA's op "
    "lists; batch norm saves no cuDNN reserve space; the reserved peak replays the first step "
    "and the measured one through the caching allocator after cuBLAS's workspaces "
    "(CublasHandlePool's defaults; a handle for forward's thread and, in training, one for "
    "backward's), on an H100 unless --card names another, following the run's "
    "PYTORCH_CUDA_ALLOC_CONF (max_split_size_mb, roundup_power2_divisions, expandable_segments: "
    "pages mapped into a segment per pool); cuDNN's and other kernels' own workspaces are not "
    "modelled; float16's GradScaler counts its scaled loss, not its own scalars; a value read "
    "off a tensor reads as the real run's where it comes from the batch's integer tensors alone "
    "(masks, positions, lengths), else as 1 (Adafactor's norms), and DeepSpeed's overflow checks "
    "as a healthy step's (no gradient inf or NaN); DeepSpeed's engine runs as on its CPU "
    "accelerator (one stream: its reduction and gather streams' overlap is not modelled); an "
    "optimizer update its package "
    "compiles (torchao's 8-bit AdamW) counts its state, not the kernel's temporaries; a "
    "bitsandbytes 4-bit matmul dequantizes its weight past 1,536 rows, as its CUDA kernel does, "
    "and below runs its fused kernel (the card's heuristic may dequantize there too); a "
    "bitsandbytes 8-bit matmul finds no input column past its outlier threshold (which columns "
    "do is read off values); packed sequences attend through the variable-length flash kernel; a "
    "generation makes exactly its new tokens (generate()'s stop check is counted, not read), its "
    "decode forwards past the fourth traced as the last three grew, a token a forward (a "
    "dynamic, static or fp8 cache's; quanto's, HQQ's and a sliding window's are traced whole)"
)
aten = torch.ops.aten


@contextmanager
def as_cuda(backend: str | None) -> Iterator[None]:
    """The kernels and implementations CUDA would pick where they differ from CPU's in what they
    keep."""
    with cuda_attention(backend), cuda_dropout(), optimizers_as_cuda(), cuda_autocast():
        yield


@contextmanager
def cuda_attention(backend: str | None) -> Iterator[None]:
    """Routes ``F.scaled_dot_product_attention`` to the fused kernel CUDA would run (the sdpa
    technique's ``backend`` where named). Their fake (meta) implementations give the real kernels'
    outputs and saved tensors on any device; CPU's own kernels fall back to the math path (s×s
    attention matrices) wherever dropout is on. Patched on the module, not through a function mode,
    so checkpointing's recomputation (in backward) takes the same route as the forward."""
    original = F.scaled_dot_product_attention

    def routed(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
        **kwargs,
    ):
        # CUDA's autocast casts attention's inputs (CPU's stands in for it)
        if torch.is_autocast_enabled("cpu"):
            dtype = torch.get_autocast_dtype("cpu")
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        # Grouped keys (fewer key/value heads than query heads, as Llama's): flash and cuDNN take
        # them as they are, CUDA's memory-efficient kernel does not, and such a call runs the math
        # path there.
        grouped = enable_gqa and key.shape[-3] != query.shape[-3]
        # what CUDA picks first, left to choose
        flash = _refused("flash", query, attn_mask, grouped) is None
        fused = backend in ("flash", "cudnn") or (backend is None and flash)
        if why := _refused(backend, query, attn_mask, grouped):
            raise Unsupported(f"{backend} attention on CUDA {why}")
        if (backend == "math" or (grouped and not fused)) and dropout_p > 0 and not kwargs:
            return math_attention(
                query, key, value, attn_mask, dropout_p, is_causal, scale, grouped
            )[0]
        if backend == "math" or kwargs or (grouped and not fused):
            with sdpa_kernel(SDPBackend.MATH):
                return original(
                    query,
                    key,
                    value,
                    attn_mask,
                    dropout_p,
                    is_causal,
                    scale=scale,
                    enable_gqa=enable_gqa,
                    **kwargs,
                )
        if fused:
            return aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, query.requires_grad, dropout_p, is_causal, scale=scale
        )[0]

    with patch.object(F, "scaled_dot_product_attention", routed):
        yield


def _refused(
    backend: str | None, query: torch.Tensor, attn_mask: torch.Tensor | None, grouped: bool
) -> str | None:
    """Why this kernel would refuse this call on CUDA (its checks in sdp_utils), as a run there
    pinned to it would find out; None where it takes the call."""
    if backend in ("flash", "cudnn") and query.dtype not in (torch.float16, torch.bfloat16):
        return f"takes 16-bit inputs only; this call's are {query.dtype}"
    if backend == "flash" and attn_mask is not None:
        return "takes no attention mask; this call has one"
    if backend == "flash" and query.shape[-1] > 256:
        return f"takes head sizes up to 256; this call's is {query.shape[-1]}"
    if backend == "efficient" and grouped:
        return "takes no grouped keys (fewer key/value heads than query heads)"
    return None


def math_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    grouped: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ATen's math path (``_scaled_dot_product_attention_math``) step for step, with its dropout as
    CUDA runs it: output and attention weights. That composite calls ``at::dropout`` from C++, out
    of cuda_dropout's reach, which on a CPU tensor keeps float32 noise the size of the s×s scores
    where CUDA's fused kernel keeps a one-byte mask."""
    dtype = query.dtype
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # as SDPA converts it, before the math path
        attn_mask = torch.where(
            attn_mask, torch.tensor(0.0, dtype=dtype), torch.tensor(-math.inf, dtype=dtype)
        )
    # Names as ATen's locals, so each tensor lives as long as there: the float32 copies (the math
    # path computes in float32) and the repeated heads until it returns, the scores only until
    # softmax.
    query_acc, key_acc, value_acc = (
        t.float() if dtype in (torch.float16, torch.bfloat16) else t for t in (query, key, value)
    )
    factor = math.sqrt(abs(scale) if scale is not None else 1 / math.sqrt(query.shape[-1]))
    query = query_acc * factor  # q and k each scaled by √scale, for stability
    if is_causal:
        attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool).tril()
        attn_mask = torch.where(attn_mask, torch.tensor(0.0), torch.tensor(-math.inf))
    # each key/value head repeated for its group of query heads
    key_expanded, value_expanded = (
        (_repeat_heads(t, query.shape[-3]) for t in (key_acc, value_acc))
        if grouped
        else (key_acc, value_acc)
    )
    attn = query @ (key_expanded.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn = attn + attn_mask
    attn = aten._safe_softmax(attn, -1)
    if dropout_p > 0:
        attn = torch.native_dropout(attn, dropout_p, True)[0]
    weights = attn.to(dtype)  # ATen casts the weights it returns first, then the output
    return (attn @ value_expanded).to(dtype), weights


def _safe_softmax(
    call: Callable[..., Any], self: torch.Tensor, dim: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """ATen's ``_safe_softmax`` (the math attention path's softmax, rows all masked out made zero),
    as its composite kernel runs on CUDA (attention.cpp): the softmax, a one-byte mask of the
    scores' size and its rows, a zero on the device, the rows zeroed in the softmax's own storage.
    The mask and the rows are let go as the kernel returns, the zero first, as C++ destroys its
    locals; the H200's llama/selective-checkpoint asked for each (a 1 GiB mask a layer at 8 × 2,048,
    which the prediction's reserved peak was 4.3% low without)."""
    # softmax's cast, a temporary of its own (not met on the math path, which passes no dtype)
    cast = self if dtype is None else call(aten._to_copy.default, self, dtype=dtype)
    out = call(aten._softmax.default, cast, dim, False)
    del cast
    masked = call(aten.isneginf.default, self)
    masked_rows = call(aten.all.dim, masked, dim, True)
    zero = call(aten.scalar_tensor.default, 0.0, dtype=out.dtype, device=out.device)
    call(aten.where.self_out, masked_rows, zero, out, out=out)
    del zero, masked_rows, masked
    return out


def _copy(
    call: Callable[..., Any], self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False
) -> torch.Tensor:
    """``copy_`` between host and device (a tensor marked on the host and one that is not) as
    CUDA's copy kernel runs it (Copy.cu, copy_kernel_cuda): in one dtype between contiguous tensors,
    one transfer; else through contiguous temporaries in one dtype, the conversion made on the host
    for a blocking copy and on the device for a non-blocking one. Where that is the source's side,
    the source is converted there (and the destination, if not contiguous, gets a buffer of its
    own); else the destination's side takes it in the source's dtype first. The temporaries are
    let go as the kernel returns, the last made first (C++'s locals); fake tensors run the copy
    itself below the tracker, which makes nothing."""
    copy = aten.copy_.default
    from_host = is_on_host(src)
    if is_on_host(self) == from_host or not _needs_temporaries(self, src):
        return copy(self, src, non_blocking)
    at_source = from_host != non_blocking  # Copy.cu's conversion device is the source's
    dtype = self.dtype if at_source else src.dtype  # both temporaries'
    made = []
    if not self.is_contiguous() or (not at_source and src.dtype != self.dtype):
        made.append(_made(call, self.shape, dtype, host=not from_host))
    if not src.is_contiguous() or (at_source and src.dtype != self.dtype):
        made.append(_made(call, self.shape, dtype, host=from_host))
    while made:
        made.pop()
    return copy(self, src, non_blocking)


def _made(call: Callable[..., Any], shape: torch.Size, dtype: torch.dtype, host: bool) -> Any:
    """An empty tensor, counted as the host's (pageable) where ``host``."""
    with making_host(pinned=False) if host else contextlib.nullcontext():
        return call(aten.empty.memory_format, list(shape), dtype=dtype)


def _needs_temporaries(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """copy_requires_temporaries, between host and device: any copy but one in one dtype between
    contiguous tensors of one shape."""
    same = dst.dtype == src.dtype and dst.shape == src.shape
    return not (same and dst.is_contiguous() and src.is_contiguous())


# Operators whose CUDA kernel is a composite of others: run as such, so that their temporaries are
# asked of the allocator (bench.measure.tracker.LiveBytes)
KERNELS = {aten._safe_softmax.default: _safe_softmax, aten.copy_.default: _copy}


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    *batch, kv, s, d = t.shape
    return t.unsqueeze(-3).expand(*batch, kv, heads // kv, s, d).reshape(*batch, heads, s, d)


@contextmanager
def cuda_dropout() -> Iterator[None]:
    """Dropout as CUDA runs it: the fused ``native_dropout``, which saves a one-byte mask for
    backward. On a CPU tensor ``dropout`` multiplies by a noise tensor of the input's dtype and
    saves that: three bytes more per element in float32 (BERT-base at batch 16 × 512: 0.42 GiB).
    In-place dropout is not fused on CUDA either, and p = 0 or 1 never reaches the fused kernel."""
    original = F.dropout

    def routed(input, p=0.5, training=True, inplace=False):
        if not training or inplace or not 0 < p < 1 or input.numel() == 0:
            return original(input, p, training, inplace)
        return torch.native_dropout(input, p, True)[0]

    with patch.object(F, "dropout", routed):
        yield


@contextmanager
def optimizers_as_cuda() -> Iterator[None]:
    """An optimizer left to choose its implementation picks foreach for CUDA tensors: one kernel per
    step over all parameters, whose temporaries (Adam's √v) are the size of all parameters at once.
    For CPU tensors, and fake ones, it picks the loop over single tensors, whose temporaries are one
    parameter's size."""
    devices = [*torch_optimizer._get_foreach_kernels_supported_devices(), "cpu"]
    types = [*torch_optimizer._foreach_supported_types, FakeTensor]
    with (
        patch.object(torch_optimizer, "_get_foreach_kernels_supported_devices", lambda: devices),
        patch.object(torch_optimizer, "_foreach_supported_types", types),
    ):
        yield


# bitsandbytes.backends.cuda.ops: past this many rows a 4-bit matmul dequantizes its weight and
# calls F.linear (_dequant_linear_fallback); below, a per-card heuristic may pick its fused kernel
BNB_DEQUANT_PAST_ROWS = 1536


def matmul_4bit(
    A: torch.Tensor,
    B: torch.Tensor,
    quant_state: Any,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``bitsandbytes.matmul_4bit`` (0.50) as CUDA runs it (the bnb-4bit technique's CUDA
    stand-in): past 1,536 rows, its dequantize-then-matmul path, whose temporaries neither the
    fake kernel (the output alone) nor CPU's (the same path inside one operator, unseen) show;
    below, its fused kernel, the output alone. Run above the operator, so that the tracker counts
    each temporary; backward dequantizes the weight again, as bitsandbytes' does."""
    if torch.is_grad_enabled() and (A.requires_grad or (bias is not None and bias.requires_grad)):
        return _MatMul4Bit.apply(A, B, bias, quant_state)
    return _gemm_4bit(A, B.view(-1, 1), bias, quant_state)


class _MatMul4Bit(torch.autograd.Function):
    """bitsandbytes' ``MatMul4Bit``: the packed weight saved, dequantized again for the input's
    gradient."""

    @staticmethod
    def forward(ctx: Any, A: torch.Tensor, B: torch.Tensor, bias: Any, state: Any) -> torch.Tensor:
        ctx.state, ctx.bias_dtype = state, None if bias is None else bias.dtype
        ctx.save_for_backward(B.view(-1, 1))
        return _gemm_4bit(A, B.view(-1, 1), bias, state)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        from bitsandbytes import functional as bnb_functional

        (B,) = ctx.saved_tensors
        grad_bias = None
        if ctx.needs_input_grad[2]:
            grad_bias = grad_output.sum(0, dtype=ctx.bias_dtype)
        grad_A = None
        if ctx.needs_input_grad[0]:
            weight = bnb_functional.dequantize_4bit(B, ctx.state).to(grad_output.dtype)
            grad_A = torch.matmul(grad_output, weight)
        return grad_A, None, grad_bias, None


def _gemm_4bit(
    A: torch.Tensor, B: torch.Tensor, bias: torch.Tensor | None, state: Any
) -> torch.Tensor:
    """The kernel CUDA's ``gemm_4bit`` picks by the rows it is given."""
    if A.numel() // A.shape[-1] > BNB_DEQUANT_PAST_ROWS:
        return _dequant_linear(A, B, bias, state)
    return _fused_4bit(A, B, bias, state)


def _fused_4bit(
    A: torch.Tensor, B: torch.Tensor, bias: torch.Tensor | None, state: Any
) -> torch.Tensor:
    """bitsandbytes' fused ``gemm_4bit`` as MatMul4Bit calls it."""
    nested = {}
    absmax = state.absmax
    if state.nested:
        absmax = state.state2.absmax
        nested = {
            "absmax_8bit": state.absmax,
            "absmax_code": state.state2.code,
            "absmax_offset": state.offset,
        }
    return torch.ops.bitsandbytes.gemm_4bit.default(
        A,
        B,
        shapeB=state.shape,
        absmax=absmax,
        blocksize=state.blocksize,
        quant_type=state.quant_type,
        bias=bias,
        **nested,
    )


def _dequant_linear(
    A: torch.Tensor, B: torch.Tensor, bias: torch.Tensor | None, state: Any
) -> torch.Tensor:
    """bitsandbytes' ``_dequant_linear_fallback``, each buffer it fills made by the operator that
    fills it: the scales' 8-bit codes back to float32 plus their offset, then the weight in the
    input's dtype, all held through F.linear."""
    absmax = state.absmax
    if state.nested:
        absmax_dq = torch.ops.bitsandbytes.dequantize_blockwise.default(
            state.absmax,
            absmax=state.state2.absmax,
            code=state.state2.code,
            blocksize=256,
            dtype=torch.float32,
        )
        absmax = absmax_dq + state.offset
    B_dq = torch.ops.bitsandbytes.dequantize_4bit.default(
        B,
        absmax=absmax,
        blocksize=state.blocksize,
        quant_type=state.quant_type,
        shape=state.shape,
        dtype=A.dtype,
    )
    return F.linear(A, B_dq, bias)


def matmul_8bit(
    A: torch.Tensor,
    B: torch.Tensor,
    out: torch.Tensor | None = None,
    state: Any = None,
    threshold: float = 0.0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``bitsandbytes.matmul`` (0.50) as CUDA runs it for a frozen int8 weight (the bnb-8bit
    technique's CUDA stand-in): ``MatMul8bitLt``, whose custom kernels the fake ones show as their
    outputs alone, here as the tensors each makes (bitsandbytes' backends/cuda/ops.py, and the
    default composites CUDA falls to). On fake tensors bitsandbytes would take its CPU path, which
    dequantizes the weight instead. No input column is taken for an outlier: which are is read off
    the values, which fake tensors lack, and each would add a column of the input and a row of the
    weight in 16 bits."""
    if threshold > 0.0:
        state.threshold = threshold
    return _MatMul8bitLt.apply(A, B, bias, state)


class _MatMul8bitLt(torch.autograd.Function):
    """bitsandbytes' ``MatMul8bitLt`` for a frozen weight (its fast path: the input quantized by
    rows alone): the input kept on the context for backward, which dequantizes the weight to the
    input's dtype."""

    @staticmethod
    def forward(ctx: Any, A: torch.Tensor, B: torch.Tensor, bias: Any, state: Any) -> torch.Tensor:
        shape = A.shape
        if len(shape) == 3:
            A = A.reshape(-1, shape[-1])
        rows, row_stats = _int8_rows(A.to(torch.float16), state.threshold)
        # int8_mixed_scaled_mm (default) with no outlier column: an empty subA, then int8_scaled_mm
        sub = torch.empty(0, device=A.device, dtype=A.dtype) if state.threshold > 0.0 else None
        # dequantized by the rows' and the columns' absmaxes, which make nothing new
        output = _int8_scaled_mm(rows, state.CB, bias=bias, dtype=A.dtype)
        ctx.state, ctx.grad_shape, ctx.dtype_A = state, shape, A.dtype
        ctx.dtype_bias = None if bias is None else bias.dtype
        ctx.tensors = (None, sub, A) if any(ctx.needs_input_grad[:2]) else (None, None, None)
        if len(shape) == 3:
            return output.reshape(*shape[:-1], state.CB.shape[0])
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        state, grad_A, grad_bias = ctx.state, None, None
        if ctx.needs_input_grad[2]:
            grad_bias = grad_output.sum(0, dtype=ctx.dtype_bias)
        if len(grad_output.shape) == 3:
            grad_output = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        if ctx.needs_input_grad[0]:
            weight = state.CB.to(ctx.dtype_A, copy=True).mul_(
                state.SCB.unsqueeze(1).mul(1.0 / 127.0)
            )
            grad_A = torch.matmul(grad_output.to(ctx.dtype_A), weight).view(ctx.grad_shape)
        return grad_A, None, grad_bias, None


def _int8_rows(A: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``int8_vectorwise_quant`` as its CUDA kernel runs it: the statistics and the int8 rows made
    first, then, past a threshold, the mask of outliers (and whether there is any), the outlier
    columns none, their zeroing in every row an empty index."""
    row_stats = torch.empty(A.numel() // A.shape[-1], device=A.device, dtype=torch.float32)
    rows = torch.empty(A.shape, device=A.device, dtype=torch.int8)
    if threshold > 0.0:
        outliers = A.abs() >= threshold
        outliers.any()  # read on the host, which the assumption answers: none
        columns = torch.empty(0, device=A.device, dtype=torch.int64)
        if rows.numel() // rows.shape[-1] > 1:
            rows[:, columns] = 0
        del outliers
    return rows, row_stats


def _int8_scaled_mm(
    A: torch.Tensor, B: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """bitsandbytes' default ``int8_scaled_mm`` over its CUDA kernels: the int32 product
    (cuBLASLt's, or in float32 where the inner dimension is not a multiple of 4), dequantized to
    float16, the bias added where not float16, then cast to ``dtype``."""
    if A.shape[-1] % 4:
        product = torch.empty((*A.shape[:-1], B.shape[0]), device=A.device, dtype=torch.int32)
        product.copy_(torch.matmul(A.float(), B.float().t()).to(torch.int32))
    else:  # cuBLASLt's: aten's int8 product makes the same int32 output, and counts its FLOPs
        product = torch._int_mm(A, B.t())
    out = torch.empty_like(product, dtype=torch.float16)
    if bias is not None and bias.dtype != torch.float16:
        out.add_(bias)
    cast = out.to(dtype)
    del out  # int8_mm_dequant returns: its float16 output freed, then the product as this returns
    return cast


# The scalar state optimizers make on the host (torch.tensor(0.0), no device): torch.optim's step
# counters (and NAdam's running product) outside capturable and fused groups, torchao's step
# counters. A scalar an optimizer computes from a parameter stays on its device: transformers'
# Adafactor keeps its RMS, a norm, there (hf-bert-large's Adafactor on the H100: a block a
# parameter).
HOST_SCALARS = ("step", "mu_product")


def host_state(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The optimizer state CUDA keeps on the host (HOST_SCALARS), one tensor per parameter and
    name."""
    if optimizer is None:
        return []
    on_device = {
        id(p)
        for g in optimizer.param_groups
        if g.get("capturable") or g.get("fused")
        for p in g["params"]
    }
    return [
        v
        for p, state in optimizer.state.items()
        if id(p) not in on_device
        for k, v in state.items()
        if k in HOST_SCALARS and torch.is_tensor(v) and v.dim() == 0
    ]
