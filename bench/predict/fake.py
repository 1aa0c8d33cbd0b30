"""One run's step on fake tensors, counted as the worker counts a real one: the predicted peak, its
breakdown and FLOPs. Fake tensors hold no values and run meta kernels; the modes here make them behave as
real ones where that changes what is counted (values read, kernels' outputs, copies and conversions)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any
from unittest.mock import patch

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from bench.data.synthetic import clone_batch
from bench.measure.memory import tracked_step
from bench.measure.tracker import CUDA_BLOCK, on_host
from bench.predict.cuda import as_cuda, host_state
from bench.recipe import Recipe
from bench.suite import RunSpec, Shapes
from bench.techniques import Unsupported

CPU = torch.device("cpu")
aten = torch.ops.aten


def predict(spec: RunSpec, shapes: Shapes | None = None, cuda: bool = True) -> dict[str, Any]:
    """Predicted peak and breakdown of one run at ``shapes`` (default: its GPU shapes); ``cuda`` models
    the CUDA allocator's granularity and CUDA-only techniques, else the CPU run as measured here."""
    recipe = Recipe.of(spec, CPU, shapes or spec.gpu, predicting=cuda)
    if reason := next((f"{t.name}: {t.unpredictable}" for t in recipe.techniques if t.unpredictable), None):
        return {"predicted_status": "unpredictable", "predicted_message": reason}
    if reason := recipe.unsupported():
        return {"predicted_status": "unsupported", "predicted_message": reason}
    try:
        figures = _fake_step(spec, recipe, CUDA_BLOCK if cuda else 1)
    except Unsupported as exc:  # a kernel CUDA would refuse: the run would be unsupported there too
        return {"predicted_status": "unsupported", "predicted_message": str(exc)}
    except Exception as exc:  # noqa: BLE001  a technique that needs real values (e.g. .item()) cannot be predicted
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return {"predicted_status": "unpredictable", "predicted_message": f"{type(exc).__name__}: {first}"}
    return {"predicted_status": "ok", **{f"predicted_{k}": v for k, v in figures.items()}}


def _fake_step(spec: RunSpec, recipe: Recipe, rounding: int) -> dict[str, Any]:
    ctx, techniques = recipe.ctx, recipe.techniques
    backend = next((dict(t.options).get("backend", "flash") for t in spec.techniques if t.name == "sdpa"), None)
    # Pretrained weights (spec.weights) are not read: their values change no tensor's size.
    with torch.device("meta"):  # no initialisation work, and none of the init ops fake tensors refuse
        model = ctx.model_spec.build(ctx.shapes)
    kernels = as_cuda(backend) if ctx.predicting else nullcontext()  # a CPU run keeps CPU's kernels
    with FakeTensorMode(allow_non_fake_inputs=True), ScalarsReadAsOne(), OutputsAsReal(ctx.predicting), \
            parameters_as_real(), masks_as_real(), kernels:
        model = _fake_copy(model)
        runner = recipe.runner(model)
        compiled_update = any(t.compiled_update for t in techniques)
        if compiled_update:
            runner.optimizer.step = compiled_as_eager(runner.optimizer.step)
        batch = recipe.batch()
        # The warm-up step, as in the worker (optimizer state exists before the measured step), counts the
        # FLOPs: the counter's module tracking keeps recomputed activations alive, so it stays out of the
        # measured step.
        with flop_counter() as flops:
            runner.step(batch)
        if ctx.predicting:  # the counters that first step made
            for t in host_state(runner.optimizer):
                on_host(t)
        step = lambda: runner.step(clone_batch(batch))  # noqa: E731  the batch counts, as in the worker
        figures = tracked_step(step, runner.model, runner.optimizer, CPU, rounding, compiled_update)
    return {**figures, "flops_per_step": flops.get_total_flops()}


def flop_counter() -> FlopCounterMode:
    """torch's FLOP counter, counting flash attention over grouped keys (fewer key and value heads than query
    heads, as Llama's) as the kernel runs it, each key and value head serving its group of query heads. torch
    2.11's formulas (the CUDA host's) refuse those shapes, which would leave such a model unpredicted."""
    query_at = {aten._scaled_dot_product_flash_attention: 0, aten._scaled_dot_product_flash_attention_backward: 1}
    return FlopCounterMode(display=False, custom_mapping={
        op: _keys_per_query_head(flop_registry[op], at) for op, at in query_at.items()})


def _keys_per_query_head(formula: Callable[..., int], query_at: int) -> Callable[..., int]:
    """``formula`` given shapes whose key and value (after the query, at ``query_at``) have the query's heads."""
    def count(*shapes: Any, out_shape: Any = None, **kwargs: Any) -> int:
        q, k, v = shapes[query_at:query_at + 3]
        k, v = ((*s[:1], q[1], *s[2:]) for s in (k, v))
        return formula(*shapes[:query_at], q, k, v, *shapes[query_at + 3:], out_val=out_shape, **kwargs)
    return count


def _fake_copy(model: nn.Module) -> nn.Module:
    """The meta model's parameters and buffers replaced by (fake) CPU tensors of the same shapes and dtypes;
    shared parameters stay shared. Called inside the fake mode."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=CPU), p.requires_grad)
                module._parameters[name] = made[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=CPU)
    return model


class ScalarsReadAsOne(TorchDispatchMode):
    """Fake tensors hold no values, so reading one (``.item()``, ``bool()``) fails; an optimizer that scales
    its step by a norm (Adafactor) would be unpredictable. Memory does not depend on such a value: it reads
    as 1. Under ``inference_mode`` the read reaches this mode undecomposed, as ``item`` or ``is_nonzero``."""

    READS = (aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            return True if args[0].dtype == torch.bool or func is aten.is_nonzero.default else 1
        return func(*args, **(kwargs or {}))


class OutputsAsReal(TorchDispatchMode):
    """Outputs as the real kernels return them, where the meta kernels fake tensors run differ in what is counted.
    The mean and inverse std a norm saves for backward, in the real kernel's dtype where the meta kernel gives
    the input's. Batch norm: the weight's (float32 under autocast), in CPU's kernel and cuDNN's alike. Layer
    norm on CUDA (``cuda``): float32 for 16-bit inputs, its accumulation type, where CPU's kernel keeps the
    input's (pure bf16 ViT-B at batch 64: 1.2 MB). And on CUDA, the memory-efficient attention kernel's RNG
    seed and offset, which it keeps on the host outside CUDA-graph capture (two 512-byte blocks a layer)."""

    def __init__(self, cuda: bool) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten._scaled_dot_product_efficient_attention.default and self.cuda:
            return out[0], out[1], on_host(out[2]), on_host(out[3])
        if func is aten.native_batch_norm.default and args[1] is not None:
            dtype = args[1].dtype
        elif func is aten.native_layer_norm.default and self.cuda and args[0].dtype in (torch.float16, torch.bfloat16):
            dtype = torch.float32
        else:
            return out
        return out[0], out[1].to(dtype), out[2].to(dtype)


@contextmanager
def parameters_as_real() -> Iterator[None]:
    """Fake parameters copied and converted as real ones are. ``Module.to()`` sets a real parameter's
    converted copy in place (``.data =``) but swaps a fake one for it, which fake tensors' weak references
    refuse; and a deep-copied fake tensor's views get storages of their own, so the tracker would count a
    view of it as new bytes. channels-last converts the model; peft casts its adapters and copies the head."""
    swap = torch.utils.swap_tensors

    def set_in_place(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if not (isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor)):
            return swap(t1, t2)
        t1.data = t2.detach()

    def deepcopy(t: FakeTensor, memo: dict[int, Any]) -> torch.Tensor:
        if id(t) not in memo:
            twin = t.detach().clone()
            memo[id(t)] = nn.Parameter(twin, t.requires_grad) if isinstance(t, nn.Parameter) else twin
        return memo[id(t)]

    with patch.object(torch.utils, "swap_tensors", set_in_place), \
            patch.object(FakeTensor, "__deepcopy__", deepcopy, create=True):
        yield


@contextmanager
def masks_as_real() -> Iterator[None]:
    """transformers takes fake tensors for tracing, and then always builds the attention mask; a real run
    without padding (every synthetic batch) skips it, so SDPA may pick flash. Here fake inputs are not taken
    for tracing: the mask's check reads True (ScalarsReadAsOne) and the prediction takes the real run's path."""
    utils = sys.modules.get("transformers.utils.import_utils")  # imported by then if the model needs it
    known = hasattr(utils, "is_fake_tensor")  # a transformers without the check builds masks as it would
    with patch.object(utils, "is_fake_tensor", lambda _: False) if known else nullcontext():
        yield


def compiled_as_eager(step: Callable[..., Any]) -> Callable[..., Any]:
    """The optimizer's ``step`` with ``torch.compile`` handing back the function itself: fake tensors cannot
    enter compiled code (dynamo refuses to trace under the fake mode). The tracker steps aside for that step as
    on a real run (``Technique.compiled_update``), so the state is counted and the eager update's temporaries,
    which the compiled kernel would not keep, are not. Patched for the step alone, so that nothing compiled
    elsewhere in the process (an import's decorator) stays eager."""
    def eager(model: Callable[..., Any] | None = None, **_: Any) -> Any:
        return model if model is not None else (lambda fn: fn)

    def run(*args: Any, **kwargs: Any) -> Any:
        with patch.object(torch, "compile", eager):
            return step(*args, **kwargs)
    return run
