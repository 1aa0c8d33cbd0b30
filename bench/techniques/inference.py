"""Forward-only techniques, for suites with ``mode = "inference"``.

The inference baseline runs the model in eval mode under ``torch.no_grad()``, the way most serving
code is written; these techniques are what practitioners weigh against it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from bench.techniques.base import (
    INFERENCE,
    SERVING,
    TECHNIQUES,
    RunContext,
    Step,
    Technique,
    Unsupported,
    offer,
    option,
)
from bench.techniques.lowbit import _has, quantize_body_linears
from bench.techniques.precision import PureBF16


@TECHNIQUES.register("inference-mode")
class InferenceMode(Technique):
    """``torch.inference_mode()`` instead of ``torch.no_grad()``: outputs are inference tensors,
    which skip autograd's version counters and view tracking.

    Expected: the same memory (``no_grad`` already saves nothing for backward) and a little less
    per-operator overhead, visible at small batches on CPU (PyTorch docs, "Inference Mode"). Outputs
    are bit-identical.
    """

    axis = "autograd"
    offers = (offer("inference-mode"),)
    summary = "`torch.inference_mode()` instead of `no_grad`"
    modes = SERVING

    def step(self) -> Step:
        return Step(context=torch.inference_mode)


@TECHNIQUES.register("half")
class HalfWeights(PureBF16):
    """Weights and inputs cast to 16 bits for serving: ``model.to(dtype)``, no fp32 copy anywhere.

    Expected: weight bytes and activations halve; on tensor-core GPUs 2–3× the fp32 throughput.
    Accuracy: predictions almost always agree with fp32 (float16 keeps 3 more mantissa bits than
    bfloat16 but overflows above 65504).
    """

    axis = "precision"
    offers = (offer("half-fp16", "float16"), offer("half-bf16", "bfloat16", dtype="bfloat16"))
    summary = "weights and inputs in 16 bits"
    modes = SERVING
    conflicts = frozenset({"amp", "bf16"})

    @dataclass(frozen=True)
    class Config:
        dtype: Literal["bfloat16", "float16"] = option(
            "float16", "16-bit type of weights and inputs"
        )

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.config.dtype)


@TECHNIQUES.register("dynamic-int8")
class DynamicInt8(Technique):
    """Dynamic int8 quantization of every linear layer except the classification head: int8 weights
    with per-channel scales, activations quantized per token at run time (torchao
    ``Int8DynamicActivationInt8WeightConfig``, the successor of
    ``torch.ao.quantization.quantize_dynamic``).

    Expected: linear weights 4 → ~1 byte per parameter; int8 matmuls where the backend has them (x86
    VNNI/AMX, CUDA with ``torch.compile``), else slower than fp32 in eager mode. Accuracy: typically
    a fraction of a point on classification (torchao's README reports the same for LLM perplexity).
    """

    axis = "quantization"
    offers = (offer("dynamic-int8", "int8"),)
    summary = "torchao int8 weights + per-token dynamic int8 activations for body linear layers"
    modes = SERVING

    def unsupported(self, ctx: RunContext) -> str | None:
        if not _has("torchao"):
            return "needs torchao: pip install torchao (or pip install -e '.[extras]')"
        if ctx.model_spec.family == "resnet":
            return "ResNet's only linear layer is its head, which stays in full precision"
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig

        self.quantized = quantize_body_linears(
            model, Int8DynamicActivationInt8WeightConfig(), freeze=False
        )
        return model

    def proof(self, steps: int) -> dict[str, Any]:
        return {"quantized_linears": len(self.quantized)}


class _TraceOnFirstCall(nn.Module):
    """Traces the wrapped model with the first real inputs (already shaped and cast by the
    techniques before it), then runs the traced graph; the first step's time is the tracing time."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.traced: torch.jit.ScriptModule | None = None

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> Any:
        if self.traced is None:
            with warnings.catch_warnings():
                # Deprecated in favour of compile/export (a DeprecationWarning in torch 2.11, a
                # FutureWarning since); and shapes are fixed, so traced constants are fine.
                warnings.simplefilter("ignore", FutureWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                try:
                    if kwargs:
                        self.traced = torch.jit.trace(
                            self.model, example_kwarg_inputs=kwargs, strict=False
                        )
                    else:
                        self.traced = torch.jit.trace(self.model, args, strict=False)
                except Exception as exc:  # noqa: BLE001  any tracing failure means this model cannot be traced
                    raise Unsupported(
                        f"torch.jit.trace failed: {type(exc).__name__}: {exc}"
                    ) from exc
        if kwargs:
            return self.traced(**kwargs)
        return self.traced(*args)


@TECHNIQUES.register("jit-trace")
class JitTrace(Technique):
    """``torch.jit.trace`` the model with the first batch and run the TorchScript graph, the older
    alternative to ``torch.compile`` (deprecated by PyTorch in favour of compile and export, still
    widely deployed).

    Expected: same memory as eager; TorchScript's profiling executor fuses some pointwise ops on
    CUDA after a few calls, so gains are small next to ``compile``. Outputs identical up to fusion
    rounding.
    """

    unpredictable = "TorchScript tracing needs real values"
    not_advised = "changes how forward is dispatched, not what it holds"
    summary = "`torch.jit.trace` on the first batch, then the TorchScript graph"
    modes = INFERENCE
    conflicts = frozenset({"compile"})

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.wrapper = _TraceOnFirstCall(model)
        return self.wrapper

    def proof(self, steps: int) -> dict[str, Any]:
        if self.wrapper.traced is not None:
            graph = self.wrapper.traced.inlined_graph
        else:
            graph = None
        return {
            "traced": graph is not None,
            "graph_nodes": sum(1 for _ in graph.nodes()) if graph else 0,
        }
