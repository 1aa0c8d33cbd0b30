"""Predict a run's peak memory without a GPU: the run's step on fake tensors, counted by the tracker.

Under ``FakeTensorMode`` every operator computes shapes and dtypes but allocates nothing, so a full
ResNet-50 step at batch 256 takes about a second on a laptop. The live-bytes tracker counts the fake
storages exactly as it counts real ones, in CUDA's 512-byte allocation granularity, and
``FlopCounterMode`` counts the step's FLOPs on the way.

Fake CUDA tensors cannot run backward without a CUDA context, so the fake tensors sit on the CPU and
stand for CUDA ones; where the two differ the prediction assumes (see ``ASSUMPTIONS``). What it counts is
tensor bytes: the CUDA allocator's peak adds workspaces (cuBLAS, cuDNN) and fragmentation on top.
"""

from __future__ import annotations

import math
import multiprocessing
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TextIO
from unittest.mock import patch

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.optim import optimizer as torch_optimizer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from bench import models
from bench.data.synthetic import clone_batch, synthetic_batch
from bench.infer import Predictor
from bench.measure.memory import tracked_step
from bench.measure.tracker import CUDA_BLOCK, on_host
from bench.suite import RunSpec, Shapes
from bench.techniques import RunContext, Technique, Unsupported
from bench.train import Trainer

if TYPE_CHECKING:  # the table is built in the CLI only: every run's worker imports this module
    import pandas as pd

ASSUMPTIONS = (
    "fake CPU tensors stand for CUDA ones, in 512-byte blocks; attention runs CUDA's fused kernels as CUDA picks "
    "them (flash for 16-bit inputs without a mask, else memory-efficient, or math for grouped keys; the sdpa "
    "technique's backend where named); dropout, the math path's too, saves a one-byte mask; an optimizer left to "
    "choose runs foreach; norms save their statistics in CUDA's dtypes; Adam's step counters and the "
    "memory-efficient kernel's RNG seed and offset live on the host, as on CUDA; autocast uses CPU's op lists; "
    "batch norm saves no cuDNN reserve space; allocator workspaces and fragmentation are not modelled; float16 "
    "autocast leaves out its GradScaler; a value read off a tensor (.item(), as Adafactor's norms) reads as 1"
)
CPU = torch.device("cpu")
aten = torch.ops.aten


@contextmanager
def cuda_attention(backend: str | None) -> Iterator[None]:
    """Routes ``F.scaled_dot_product_attention`` to the fused kernel CUDA would run (the sdpa technique's
    ``backend`` where named). Their fake (meta) implementations give the real kernels' outputs and saved
    tensors on any device; CPU's own kernels fall back to the math path (s×s attention matrices) wherever
    dropout is on. Patched on the module, not through a function mode, so checkpointing's recomputation
    (in backward) takes the same route as the forward."""
    original = F.scaled_dot_product_attention

    def routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
               **kwargs):
        if torch.is_autocast_enabled("cpu"):  # CUDA's autocast casts attention's inputs (CPU's stands in for it)
            dtype = torch.get_autocast_dtype("cpu")
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        # Grouped keys (fewer key/value heads than query heads, as Llama's): flash and cuDNN take them as they
        # are, CUDA's memory-efficient kernel does not, and such a call runs the math path there.
        grouped = enable_gqa and key.shape[-3] != query.shape[-3]
        flash = _refused("flash", query, attn_mask, grouped) is None  # what CUDA picks first, left to choose
        fused = backend in ("flash", "cudnn") or (backend is None and flash)
        if why := _refused(backend, query, attn_mask, grouped):
            raise Unsupported(f"{backend} attention on CUDA {why}")
        if (backend == "math" or (grouped and not fused)) and dropout_p > 0 and not kwargs:
            return math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, grouped)[0]
        if backend == "math" or kwargs or (grouped and not fused):
            with sdpa_kernel(SDPBackend.MATH):
                return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                enable_gqa=enable_gqa, **kwargs)
        if fused:
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                            scale=scale)[0]
        return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, query.requires_grad,
                                                            dropout_p, is_causal, scale=scale)[0]

    with patch.object(F, "scaled_dot_product_attention", routed):
        yield


def _refused(backend: str | None, query: torch.Tensor, attn_mask: torch.Tensor | None, grouped: bool) -> str | None:
    """Why this kernel would refuse this call on CUDA (its checks in sdp_utils), as a run there pinned to it
    would find out; None where it takes the call."""
    if backend in ("flash", "cudnn") and query.dtype not in (torch.float16, torch.bfloat16):
        return f"takes 16-bit inputs only; this call's are {query.dtype}"
    if backend == "flash" and attn_mask is not None:
        return "takes no attention mask; this call has one"
    if backend == "flash" and query.shape[-1] > 256:
        return f"takes head sizes up to 256; this call's is {query.shape[-1]}"
    if backend == "efficient" and grouped:
        return "takes no grouped keys (fewer key/value heads than query heads)"
    return None


def math_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                   dropout_p: float, is_causal: bool, scale: float | None,
                   grouped: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """ATen's math path (``_scaled_dot_product_attention_math``) step for step, with its dropout as CUDA runs
    it: output and attention weights. That composite calls ``at::dropout`` from C++, out of cuda_dropout's
    reach, which on a CPU tensor keeps float32 noise the size of the s×s scores where CUDA's fused kernel
    keeps a one-byte mask."""
    dtype = query.dtype
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as SDPA converts it, before the math path
        attn_mask = torch.where(attn_mask, torch.tensor(0.0, dtype=dtype), torch.tensor(-math.inf, dtype=dtype))
    # Names as ATen's locals, so each tensor lives as long as there: the float32 copies (the math path
    # computes in float32) and the repeated heads until it returns, the scores only until softmax.
    query_acc, key_acc, value_acc = (t.float() if dtype in (torch.float16, torch.bfloat16) else t
                                     for t in (query, key, value))
    factor = math.sqrt(abs(scale) if scale is not None else 1 / math.sqrt(query.shape[-1]))
    query = query_acc * factor  # q and k each scaled by √scale, for stability
    if is_causal:
        attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool).tril()
        attn_mask = torch.where(attn_mask, torch.tensor(0.0), torch.tensor(-math.inf))
    # each key/value head repeated for its group of query heads
    key_expanded, value_expanded = ((_repeat_heads(t, query.shape[-3]) for t in (key_acc, value_acc)) if grouped
                                    else (key_acc, value_acc))
    attn = query @ (key_expanded.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn = attn + attn_mask
    attn = aten._safe_softmax(attn, -1)
    if dropout_p > 0:
        attn = torch.native_dropout(attn, dropout_p, True)[0]
    weights = attn.to(dtype)  # ATen casts the weights it returns first, then the output
    return (attn @ value_expanded).to(dtype), weights


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    *batch, kv, s, d = t.shape
    return t.unsqueeze(-3).expand(*batch, kv, heads // kv, s, d).reshape(*batch, heads, s, d)


@contextmanager
def cuda_dropout() -> Iterator[None]:
    """Dropout as CUDA runs it: the fused ``native_dropout``, which saves a one-byte mask for backward.
    On a CPU tensor ``dropout`` multiplies by a noise tensor of the input's dtype and saves that: three
    bytes more per element in float32 (BERT-base at batch 16 × 512: 0.42 GiB). In-place dropout is not
    fused on CUDA either, and p = 0 or 1 never reaches the fused kernel."""
    original = F.dropout

    def routed(input, p=0.5, training=True, inplace=False):
        if not training or inplace or not 0 < p < 1 or input.numel() == 0:
            return original(input, p, training, inplace)
        return torch.native_dropout(input, p, True)[0]

    with patch.object(F, "dropout", routed):
        yield


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


@contextmanager
def optimizers_as_cuda() -> Iterator[None]:
    """An optimizer left to choose its implementation picks foreach for CUDA tensors: one kernel per step
    over all parameters, whose temporaries (Adam's √v) are the size of all parameters at once. For CPU tensors,
    and fake ones, it picks the loop over single tensors, whose temporaries are one parameter's size."""
    devices = [*torch_optimizer._get_foreach_kernels_supported_devices(), "cpu"]
    types = [*torch_optimizer._foreach_supported_types, FakeTensor]
    with patch.object(torch_optimizer, "_get_foreach_kernels_supported_devices", lambda: devices), \
            patch.object(torch_optimizer, "_foreach_supported_types", types):
        yield


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


def host_state(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The optimizer state CUDA keeps on the host: torch.optim's scalar state (Adam's step counter, one per
    parameter) outside capturable and fused groups."""
    if optimizer is None:
        return []
    on_device = {id(p) for g in optimizer.param_groups if g.get("capturable") or g.get("fused") for p in g["params"]}
    return [v for p, state in optimizer.state.items() if id(p) not in on_device
            for v in state.values() if torch.is_tensor(v) and v.dim() == 0]


def predict(spec: RunSpec, shapes: Shapes | None = None, cuda: bool = True) -> dict[str, Any]:
    """Predicted peak and breakdown of one run at ``shapes`` (default: its GPU shapes); ``cuda`` models
    the CUDA allocator's granularity and CUDA-only techniques, else the CPU run as measured here."""
    shapes = shapes or spec.gpu
    techniques = [t.build() for t in spec.techniques]
    if reason := next((f"{t.name}: {t.unpredictable}" for t in techniques if t.unpredictable), None):
        return {"predicted_status": "unpredictable", "predicted_message": reason}
    model_spec = models.resolve(spec.model)
    ctx = RunContext(CPU, model_spec, shapes, spec.lr, predicting=cuda)
    if reason := next((f"{t.name}: {r}" for t in techniques if (r := t.unsupported(ctx))), None):
        return {"predicted_status": "unsupported", "predicted_message": reason}
    try:
        figures = _fake_step(spec, techniques, ctx, CUDA_BLOCK if cuda else 1)
    except Unsupported as exc:  # a kernel CUDA would refuse: the run would be unsupported there too
        return {"predicted_status": "unsupported", "predicted_message": str(exc)}
    except Exception as exc:  # noqa: BLE001  a technique that needs real values (e.g. .item()) cannot be predicted
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return {"predicted_status": "unpredictable", "predicted_message": f"{type(exc).__name__}: {first}"}
    return {"predicted_status": "ok", **{f"predicted_{k}": v for k, v in figures.items()}}


def _fake_step(spec: RunSpec, techniques: list[Technique], ctx: RunContext, rounding: int) -> dict[str, Any]:
    backend = next((dict(t.options).get("backend", "flash") for t in spec.techniques if t.name == "sdpa"), None)
    # Pretrained weights (spec.weights) are not read: their values change no tensor's size.
    with torch.device("meta"):  # no initialisation work, and none of the init ops fake tensors refuse
        model = ctx.model_spec.build(ctx.shapes)
    kernels = _as_cuda(backend) if ctx.predicting else nullcontext()  # a CPU run keeps CPU's kernels
    with FakeTensorMode(allow_non_fake_inputs=True), ScalarsReadAsOne(), OutputsAsReal(ctx.predicting), \
            parameters_as_real(), masks_as_real(), kernels:
        model = _fake_copy(model)
        runner = (Predictor(model, ctx.model_spec, techniques, ctx) if spec.mode == "inference"
                  else Trainer(model, ctx.model_spec, techniques, ctx, spec.lr))
        batch = synthetic_batch(ctx.model_spec, ctx.shapes, spec.seed, CPU)
        # The warm-up step, as in the worker (optimizer state exists before the measured step), counts the
        # FLOPs: the counter's module tracking keeps recomputed activations alive, so it stays out of the
        # measured step.
        with FlopCounterMode(display=False) as flops:
            runner.step(batch)
        if ctx.predicting:  # the counters that first step made
            for t in host_state(runner.optimizer):
                on_host(t)
        step = lambda: runner.step(clone_batch(batch))  # noqa: E731  the batch counts, as in the worker
        figures = tracked_step(step, runner.model, runner.optimizer, CPU, rounding)
    return {**figures, "flops_per_step": flops.get_total_flops()}


@contextmanager
def _as_cuda(backend: str | None) -> Iterator[None]:
    """The kernels and implementations CUDA would pick where they differ from CPU's in what they keep."""
    with cuda_attention(backend), cuda_dropout(), optimizers_as_cuda():
        yield


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


def largest_batch(spec: RunSpec, budget: int, limit: int = 1 << 16,
                  own: dict[str, Any] | None = None) -> int | None:
    """The largest GPU batch whose predicted peak fits ``budget`` bytes (in multiples of the micro-batch
    count, so every candidate is a valid run); None if none fits. A peak is close to linear in the batch
    (past the small batches where the optimizer step holds it), so the line through the last two
    predictions guesses the answer, and a guess the line gives again is confirmed by its neighbour: four
    to seven predictions a run, where doubling and bisection took about seventeen. A guess that does not
    halve the bracket twice in a row is followed by a doubling or bisection step, so a peak far from
    linear still gets the right answer in at most three times bisection's count.
    ``own``: the prediction at the run's own batch, if made already (the line starts from it)."""
    unit = max(int(dict(t.options).get("micro_batches", 1)) for t in spec.techniques) if spec.techniques else 1
    lo, hi = 0, limit // unit + 1  # in units: lo fits (0: none yet), hi does not (past the limit: assumed)
    points: list[tuple[int, float]] = []

    def probe(n: int, out: dict[str, Any] | None = None) -> None:
        nonlocal lo, hi
        out = out or predict(spec, replace(spec.gpu, batch_size=n * unit))
        peak = out["predicted_peak_tensor_bytes"] if out["predicted_status"] == "ok" else math.inf
        points.append((n, peak))
        lo, hi = (max(lo, n), hi) if peak <= budget else (lo, min(hi, n))

    probe(1)
    if lo == 0:
        return None
    if lo < (mine := spec.gpu.batch_size // unit) < hi:  # far from 1, so the line through both is a good one
        probe(mine, own)
    misses = 0  # guesses in a row that did not halve the bracket
    while hi - lo > 1:
        width, guess = hi - lo, _on_the_line(points, budget) if misses < 2 else None
        if guess is None:  # no line, or the line is not converging: double, or halve the bracket
            probe(min(2 * lo, hi - 1) if hi > limit // unit else (lo + hi) // 2)
            misses = 0
            continue
        n = min(max(guess, lo + 1), hi - 1)
        if any(n == m for m, _ in points):  # the line agrees with itself: its neighbour closes the bracket
            n = n + 1 if n == lo else n - 1
        probe(n)
        misses = 0 if hi - lo <= width // 2 else misses + 1
    return lo * unit


def _on_the_line(points: list[tuple[int, float]], budget: int) -> int | None:
    """The largest batch under the budget on the line through the last two predictions that gave a peak."""
    finite = [p for p in points if math.isfinite(p[1])]
    if len(finite) < 2 or finite[-1][1] == finite[-2][1]:
        return None
    (a, pa), (b, pb) = finite[-2:]
    return math.floor(a + (budget - pa) * (b - a) / (pb - pa))


def parse_size(text: str) -> int:
    """'16GiB', '80GB', '512MiB' or plain bytes → bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "b": 1, "": 1}
    number = text.strip().rstrip("BbIiKkMmGgTt")
    unit = text.strip()[len(number):].lower()
    try:
        return int(float(number) * units[unit])
    except (ValueError, KeyError):
        raise ValueError(f"--budget {text!r}: expected a size such as 16GiB, 80GB or 512MiB") from None


def suite_table(runs: list[RunSpec], measured: dict[str, dict[str, Any]], budget: int | None,
                log: TextIO = sys.stderr, jobs: int = 1) -> pd.DataFrame:
    """One row per run: predicted peak and breakdown at GPU shapes, FLOPs, and where a GPU measured the
    run, its allocated peak and the ratio; with a budget, whether it fits and the largest batch that does.
    Runs are predicted in ``jobs`` spawned processes (each prediction is single-threaded Python); a
    progress line per run goes to ``log`` as it is done, numbered by its place in the suite."""
    import pandas as pd

    rows: list[dict[str, Any]] = [{} for _ in runs]
    for i, row in _predicted_rows(runs, budget, jobs):
        if (rec := measured.get(runs[i].name)) and rec.get("peak_allocated_bytes"):
            row["measured_bytes"], row["measured_on"] = rec["peak_allocated_bytes"], rec["device"]
        rows[i] = row
        print(f"[{i + 1}/{len(runs)}] {runs[i].name}: {_said(row)}", file=log, flush=True)
    return pd.DataFrame(rows)


def _predicted_rows(runs: list[RunSpec], budget: int | None, jobs: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, row) for each run as it is done: here, or in spawned processes (fork is unsafe once torch
    has started threads). A process costs an import of torch (about 5 s and 1 GB), so there is one per run
    at most. Ctrl-C reaches the parent only, which stops the processes on its way out."""
    work, processes = [(i, spec, budget) for i, spec in enumerate(runs)], min(jobs, len(runs))
    if processes <= 1:
        yield from map(_indexed_row, work)
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(processes, initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN)) \
            as pool:  # leaving the block terminates the processes, finished or not
        yield from pool.imap_unordered(_indexed_row, work)


def _indexed_row(work: tuple[int, RunSpec, int | None]) -> tuple[int, dict[str, Any]]:
    index, spec, budget = work
    return index, _row(spec, budget)


def _row(spec: RunSpec, budget: int | None) -> dict[str, Any]:
    out = predict(spec)
    row: dict[str, Any] = {"run": spec.name, "batch": spec.gpu.batch_size, "status": out["predicted_status"]}
    row |= {k.removeprefix("predicted_"): v for k, v in out.items() if k.startswith("predicted_")}
    if budget is not None and out["predicted_status"] == "ok":
        row["fits"] = out["predicted_peak_tensor_bytes"] <= budget
        row["largest_batch"] = largest_batch(spec, budget, own=out)
    return row


def _said(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row.get('message', '')}"
    fit = f", largest batch {row['largest_batch']}" if "largest_batch" in row else ""
    return f"{row['peak_tensor_bytes'] / 2**30:,.2f} GiB at batch {row['batch']}, peak in {row['peak_phase']}{fit}"


def markdown(table: pd.DataFrame) -> str:
    import pandas as pd

    from bench.report.tables import to_markdown

    gib = lambda col: (pd.to_numeric(table.get(col), errors="coerce") / 2**30).round(2)  # noqa: E731
    show = pd.DataFrame({
        "run": table["run"], "batch": table["batch"], "status": table["status"],
        "peak GiB": gib("peak_tensor_bytes"), "peak in": table.get("peak_phase"),
        "params GiB": gib("param_bytes"), "grads GiB": gib("gradient_bytes"),
        "optimizer GiB": gib("optimizer_state_bytes"), "activations GiB": gib("activation_bytes"),
        "TFLOP/step": (pd.to_numeric(table.get("flops_per_step"), errors="coerce") / 1e12).round(2),
    })
    if "measured_bytes" in table:
        show["measured GiB"] = gib("measured_bytes")
        show["predicted / measured"] = (table["peak_tensor_bytes"] / table["measured_bytes"]).round(3)
    if "fits" in table:
        show["fits"] = table["fits"].map({True: "yes", False: "no"})
        show["largest batch"] = pd.to_numeric(table["largest_batch"], errors="coerce").astype("Int64")
    show["note"] = table.get("message", pd.Series(dtype=object)).fillna("")
    return to_markdown(show.dropna(axis=1, how="all"))
