"""CUDA's autocast for the fake CPU tensors that stand for CUDA ones.

Autocast keeps other op lists per device: CUDA runs layer norm, softmax, ``exp`` or ``sum`` in
float32 when handed 16-bit tensors, where CPU runs them as given; it runs ``mv`` or ``addmv`` in 16
bits, where CPU leaves them in float32; and CPU's float32 losses and padding ops are not on CUDA's
lists at all. What each op keeps for backward follows (ConvNeXt's layer norms, on a 16-bit
convolution's output, keep a float32 copy of their input on CUDA). So while predicting, the CPU
autocast key runs CUDA's lists: ops CUDA casts get its casting rule, ops only CPU casts fall
through, and the ops both cast to 16 bits keep CPU's own kernel (and its cache of cast weights, as
CUDA's). The lists are CUDA's in ``torch/include/ATen/autocast_mode.h``; a test holds them to the
ops this torch registers for CUDA's autocast, and holds the rules to CUDA's own kernels run on fake
CUDA tensors.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest.mock import patch

import torch
from torch._C import DispatchKey, DispatchKeySet
from torch.library import Library, fallthrough_kernel

from bench.techniques import Unsupported

# By op name: CUDA registers each overload, every overload of a name under one rule.
# the last three: CUDA's own ops
LOWER = (
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "convolution",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "linalg_vecdot",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "linalg_multi_dot",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
    "_cudnn_rnn",
)
FP32 = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "group_norm",
    "frobenius_norm",
    "nuclear_norm",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "upsample_nearest1d",
    "_upsample_nearest_exact1d",
    "upsample_nearest2d",
    "_upsample_nearest_exact2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "_upsample_bilinear2d_aa",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
    "linalg_matrix_sqrth",
)
# float32 unless asked
FP32_DTYPE = (
    "prod",
    "softmax",
    "log_softmax",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "sum",
)
# (torch 2.11 registers the last)
FP32_APPEND = {
    "norm.Scalar": "ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "ScalarOpt_dim_dtype",  # → overload
    "norm.names_ScalarOpt_dim": "names_ScalarOpt_dim_dtype",
}
# the widest of the inputs' types
PROMOTE = (
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "vdot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
)
BANNED = ("binary_cross_entropy",)  # CUDA's autocast refuses it (unsafe in 16 bits)
AUTOCAST = DispatchKeySet(DispatchKey.AutocastCPU)


@contextmanager
def cuda_autocast() -> Iterator[None]:
    """While it lasts, CPU autocast casts as CUDA's does (the registrations are undone on exit)."""
    lib, casts = Library("aten", "IMPL"), _Casts()
    try:
        with warnings.catch_warnings():
            # overriding CPU's kernels is the point (torch 2.11 warns of it)
            warnings.filterwarnings("ignore", "Warning only once for all operators", UserWarning)
            for name in _registered("AutocastCPU") - _registered("AutocastCUDA"):
                lib.impl(name, fallthrough_kernel, "AutocastCPU")
            for name in _registered("AutocastCUDA"):
                if _base(name) in LOWER and name in _registered("AutocastCPU"):
                    # CPU's kernel does as CUDA's
                    continue
                if kernel := _kernel(name, casts):
                    lib.impl(name, kernel, "AutocastCPU")
        with patch.object(
            torch, "clear_autocast_cache", casts.clear_with(torch.clear_autocast_cache)
        ):
            yield
    finally:
        lib._destroy()


@functools.cache
def _registered(key: str) -> frozenset[str]:
    """The aten ops (``name`` or ``name.overload``) with a kernel of their own for dispatch ``key``.
    Other libraries' ops (torchvision's) keep their own autocast kernels."""
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")]
    return frozenset(
        n.removeprefix("aten::")
        for n in names
        if torch._C._dispatch_has_kernel_for_dispatch_key(n, key)
    )


def _base(name: str) -> str:
    return name.partition(".")[0]


def _op(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _kernel(name: str, casts: _Casts) -> Callable[..., Any] | None:
    """CUDA's rule for op ``name``, as a kernel for the CPU autocast key: cast, then run below
    autocast. None for an op these lists do not know (a newer torch's), which keeps CPU's rule; a
    test holds them to this torch."""
    op, base = _op(name), _base(name)
    if base in BANNED:

        def kernel(*args, **kwargs):
            raise Unsupported(
                f"CUDA's autocast refuses {name} (unsafe in 16 bits; use its _with_logits form)"
            )

        return kernel
    if name in FP32_APPEND:
        with_dtype = getattr(torch.ops.aten.norm, FP32_APPEND[name])
        return _below(lambda *a, **k: with_dtype(*a, **k, dtype=_first_or(a[0], torch.float32)))
    if base in FP32_DTYPE:
        slot = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dtype")
        return _below(lambda *a, **k: _with_float32(op, slot, a, k))
    if base in FP32:
        return _below(lambda *a, **k: casts.run(op, torch.float32, a, k))
    if base in PROMOTE:
        return _below(lambda *a, **k: casts.run(op, _widest([*a, *k.values()]), a, k))
    if base in LOWER:
        return _below(lambda *a, **k: casts.run(op, torch.get_autocast_dtype("cpu"), a, k))
    return None


def _below(run: Callable[..., Any]) -> Callable[..., Any]:
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(AUTOCAST):
            return run(*args, **kwargs)

    return kernel


def _eligible(t: Any) -> bool:
    """What CUDA's autocast casts: floating tensors other than float64."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _first_or(t: Any, dtype: torch.dtype) -> torch.dtype:
    if _eligible(t):
        return dtype
    return t.dtype


def _with_float32(op: torch._ops.OpOverload, slot: int, args: tuple, kwargs: dict[str, Any]) -> Any:
    """``op`` with float32 as its ``dtype`` (argument ``slot``) where the caller gave none and the
    first input is eligible."""
    if len(args) > slot:
        given = args[slot]
    else:
        given = kwargs.get("dtype")
    if given is not None or not _eligible(args[0]):
        return op(*args, **kwargs)
    if len(args) > slot:
        return op(*args[:slot], torch.float32, *args[slot + 1 :], **kwargs)
    return op(*args, **{**kwargs, "dtype": torch.float32})


def _widest(args: list[Any]) -> torch.dtype:
    tensors = [
        t for a in args for t in (a if isinstance(a, (list, tuple)) else [a]) if _eligible(t)
    ]
    return functools.reduce(
        torch.promote_types, (t.dtype for t in tensors), torch.get_autocast_dtype("cpu")
    )


class _Casts:
    """Casts as CUDA's autocast makes them: eligible tensors (in lists too) to the rule's type, and
    a float32 leaf that requires grad (a weight) cast to 16 bits once per autocast region, held
    until it ends. (CPU's kernels kept for the ops both devices cast keep their own cache: a weight
    that one of them and one of these cast would be cast twice, where CUDA casts it once.)"""

    def __init__(self) -> None:
        self.cache: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def run(
        self, op: torch._ops.OpOverload, dtype: torch.dtype, args: tuple, kwargs: dict[str, Any]
    ) -> Any:
        """``op`` on its arguments cast to ``dtype``."""
        return op(
            *(self.each(a, dtype) for a in args),
            **{k: self.each(v, dtype) for k, v in kwargs.items()},
        )

    def each(self, arg: Any, dtype: torch.dtype) -> Any:
        if isinstance(arg, (list, tuple)):
            return [self.one(t, dtype) for t in arg]
        return self.one(arg, dtype)

    def one(self, t: Any, dtype: torch.dtype) -> Any:
        if not _eligible(t) or t.dtype == dtype:
            return t
        cached = (
            dtype == torch.get_autocast_dtype("cpu")
            and t.dtype == torch.float32
            and t.requires_grad
            and t.is_leaf
            and not t._is_view()
            and torch.is_autocast_cache_enabled()
        )
        if not cached:
            return t.to(dtype)
        ref, cast = self.cache.get(id(t), (None, None))
        if ref is None or ref() is not t:
            cast = t.to(dtype)
            self.cache[id(t)] = (weakref.ref(t), cast)
        return cast

    def clear_with(self, clear: Callable[[], None]) -> Callable[[], None]:
        """``torch.clear_autocast_cache`` (called as the outermost autocast region ends) clearing
        this cache too."""

        def both() -> None:
            self.cache.clear()
            clear()

        return both
