"""Memory figures. CUDA: the caching allocator's own statistics and NVML's view of the process. Any
device: the peak of live tensor bytes (a dispatch-mode tracker, see tracker.py), the bytes held from
forward into backward, model-state bytes, and the process's resident-set peak. A figure that cannot
be had here is absent, never 0."""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol
from unittest.mock import patch

import torch
from torch import nn

from bench.measure.allocator import CachingAllocator, OutOfMemory, Replay
from bench.measure.tracker import LiveBytes, NotRepeating, storages
from bench.record import AT_PEAK as CATEGORIES
from bench.record import KEY


def cuda_peaks(device: torch.device) -> dict[str, int]:
    stats = torch.cuda.memory_stats(device)
    return {
        KEY.peak_allocated_bytes: stats["allocated_bytes.all.peak"],
        KEY.peak_reserved_bytes: stats["reserved_bytes.all.peak"],
        KEY.peak_active_bytes: stats["active_bytes.all.peak"],
        KEY.alloc_retries: stats["num_alloc_retries"],
        KEY.cuda_ooms: stats["num_ooms"],
    }


def nvml_process_bytes(device: torch.device) -> int | None:
    """GPU memory NVML charges to this process: allocator reserve plus the CUDA context."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        if device.index is not None:
            index = device.index
        else:
            index = torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        return next((p.usedGpuMemory for p in procs if p.pid == os.getpid()), None)
    except pynvml.NVMLError:
        return None


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    # Keyed by the C++ storage object: views share one, and fake tensors (prediction) have no
    # addresses.
    unique = {s._cdata: s.nbytes() for t in tensors for s in storages(t)}
    return sum(unique.values())


def optimizer_state(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The optimizer's state, and the parameters it steps that are copies of the model's (fp32
    master weights, which ZeRO counts as optimizer state)."""
    if optimizer is None:  # inference
        return []
    masters = getattr(optimizer, "masters", [])
    return [
        *masters,
        *(t for state in optimizer.state.values() for v in state.values() for t in _tensors_of(v)),
    ]


def _tensors_of(value: object) -> list[torch.Tensor]:
    """A state value's tensors: itself, or those an object in the state holds (GaLore's projector,
    its basis)."""
    if torch.is_tensor(value):
        return [value]
    held = getattr(value, "__dict__", {}).values()
    flat = [t for v in held for t in (v if isinstance(v, tuple) else [v])]
    return [t for t in flat if torch.is_tensor(t)]


# What each storage alive at the peak was: model states by what holds them, else by the phase that
# made it (the batch, cloned before the forward, counts with the activations it feeds). The
# tracker's labels, each in the record's at-peak category (bench.record.AT_PEAK).
LABELS = {
    "parameters": "parameters",
    "buffers": "buffers",
    "gradients": "gradients",
    "optimizer_state": "optimizer_state",
    "": "activations",
    "forward": "activations",
    "backward": "temporaries",
    "optimizer": "temporaries",
    "prefill": "activations",
    "decode": "activations",
    "kv_cache": "kv_cache",
}


class Phases(Protocol):
    """A stepper whose forwards are phases of their own (generation: the prompt's prefill, then one
    forward per token), and which keeps a cache from one forward to the next."""

    phase: str  # of the forward now beginning
    cache_bytes: int  # the cache's device bytes at their largest over the step

    def cache(self) -> list[torch.Tensor]: ...


PHASES = ("prefill", "decode")  # a generation's, each with its own peak (peak_<phase>_bytes)


def tracked_step(
    step: Callable[[], object],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
    rounding: int | None = None,
    compiled_update: bool = False,
    reserved: Replay | None = None,
    phases: Phases | None = None,
    repeat: int = 0,
) -> dict[str, int | str]:
    """One step under the live-bytes tracker: its peak, what was alive at that peak
    (``at_peak_*_bytes``, summing to the peak), and the bytes each forward leaves alive for backward
    (saved activations plus the logits), the quantity checkpointing and autocast shrink; with
    ``phases`` (generation), instead of the latter, each phase's peak and the cache's bytes.
    ``compiled_update``: the optimizer's step runs compiled code, which the tracker steps aside for;
    its state is counted, its own temporaries are not. ``reserved``: what CUDA's caching allocator
    would reserve for the step, its allocations and frees replayed through bench.measure.allocator
    after those of the steps before it (``peak_reserved_bytes``), and under a capacity, whether it
    fits (``_reserved``). ``repeat``: the step's last marked part ran this many times more
    (``LiveBytes.repeat``; NotRepeating where it does not repeat)."""
    if reserved is not None:
        history = reserved.history
    else:
        history = None
    done = track(
        step,
        model,
        optimizer=optimizer,
        device=device,
        rounding=rounding,
        compiled_update=compiled_update,
        history=history,
        phases=phases,
    )
    tracker = done.tracker
    if not tracker.repeat(repeat):
        raise NotRepeating
    at_peak = dict.fromkeys(CATEGORIES, 0)
    for label, n in tracker.at_peak().items():
        at_peak[LABELS[label]] += n
    if phases is not None:
        generated = {f"peak_{p}_bytes": tracker.phase_peaks.get(p) for p in PHASES} | {
            KEY.kv_cache_bytes: phases.cache_bytes
        }
    else:
        generated = {KEY.activation_bytes: max(done.held)}
    return (
        {
            KEY.peak_tensor_bytes: tracker.peak,
            KEY.peak_phase: tracker.peak_phase,
            **generated,
            # What the optimizer found in .grad (absent where gradients are freed in backward, or no
            # optimizer).
            KEY.gradient_bytes: done.grads[-1] if done.grads else None,
            # the cache's share where a generation has one (training and forward passes keep none)
            **{f"at_peak_{k}_bytes": v for k, v in at_peak.items() if k != "kv_cache" or phases},
        }
        | model_state_bytes(model, optimizer)
        | (_reserved(tracker, reserved) if reserved is not None else {})
    )


@dataclass
class Tracked:
    """A step as the tracker saw it: every storage's life, what each forward left for backward
    (``held``), and the gradients the optimizer found (``grads``)."""

    tracker: LiveBytes
    held: list[int]
    grads: list[int]


def track(
    step: Callable[[], object],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
    rounding: int | None = None,
    compiled_update: bool = False,
    history: LiveBytes | None = None,
    phases: Phases | None = None,
) -> Tracked:
    """``step`` under a tracker that knows the model's states as such, and each phase as it begins
    (forward, backward, optimizer; or the ``phases`` of a generation's forwards, its cache labelled
    as such after each); following ``history``, the tracker of the steps before
    (``LiveBytes.follow``)."""
    tracker = LiveBytes(device, rounding)
    tracker.add(model.parameters(), "parameters")
    tracker.add(model.buffers(), "buffers")
    tracker.add(_grads(model), "gradients")
    tracker.add(optimizer_state(optimizer), "optimizer_state")
    if history is not None:
        tracker.follow(history)
    done = Tracked(tracker, [], [])
    starts: list[int] = []

    def forward_start(*_: object) -> None:
        if phases is not None:
            tracker.phase = phases.phase
        else:
            tracker.phase = "forward"
        starts.append(tracker.current)

    def forward_end(*_: object) -> None:
        done.held.append(tracker.current - starts[-1])
        if phases is None:
            tracker.phase = "backward"
        else:  # the phase goes on: the token is chosen after the forward
            tracker.label(phases.cache(), "kv_cache")

    hooks = [
        model.register_forward_pre_hook(forward_start),
        model.register_forward_hook(forward_end),
    ]

    def optimizer_start(*_: object) -> None:
        tracker.phase = "optimizer"
        tracker.label(_grads(model), "gradients")
        done.grads.append(tensor_bytes(_grads(model)))

    if optimizer is not None:
        hooks.append(optimizer.register_step_pre_hook(optimizer_start))
    if compiled_update:
        aside = patch.object(optimizer, "step", _stepped_aside(optimizer.step, tracker))
    else:
        aside = nullcontext()
    try:
        with tracker, aside:
            step()
    finally:
        for h in hooks:
            h.remove()
    # kept past the step (no optimizer, or zero_grad keeps them)
    tracker.label(_grads(model), "gradients")
    tracker.label(optimizer_state(optimizer), "optimizer_state")  # made in the step (a first step)
    return done


# The phase an allocation the card cannot hold was made in, by what the tracker called it.
OOM_PHASES = {
    "": "forward",
    "gradients": "backward",
    "optimizer_state": "optimizer",
    "parameters": "set-up",
}


def _reserved(tracker: LiveBytes, replay: Replay) -> dict[str, Any]:
    """The step through the caching allocator after the workspaces, under the card's capacity if
    given: the reserved peak, and the verdict: fits, fits only after freeing the cache (each flush a
    pause), or out of memory at a phase and request."""
    allocator = CachingAllocator(
        replay.capacity, replay.conf.max_split_size, replay.conf.roundup_divisions
    )
    for i, size in enumerate(replay.workspaces):
        allocator.malloc(("workspace", i), size)  # never freed: cuBLAS keeps its workspaces
    try:
        tracker.replay(allocator)
    except OutOfMemory as exc:
        return {  # no peaks: the step never reached its own, and the reserve here is the failure's
            "oom_reserved_bytes": allocator.reserved,
            "verdict": "out of memory",
            "flushes": allocator.retries,
            "oom_phase": OOM_PHASES.get(exc.label, exc.label),
            "oom_request_bytes": exc.request,
        }
    out: dict[str, Any] = {
        KEY.peak_allocated_bytes: allocator.peak_allocated,  # the workspaces with the tensors
        KEY.peak_reserved_bytes: allocator.peak_reserved,
        "largest_free_bytes": allocator.largest_free_at_peak,
    }
    if replay.capacity is not None:
        if allocator.retries:
            verdict = "fits after flushes"
        else:
            verdict = "fits"
        out |= {"verdict": verdict, "flushes": allocator.retries}
    return out


def _stepped_aside(step: Callable[..., Any], tracker: LiveBytes) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with tracker.stepped_aside():
            return step(*args, **kwargs)

    return run


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    return {
        KEY.param_bytes: tensor_bytes(model.parameters()),
        KEY.buffer_bytes: tensor_bytes(model.buffers()),
        KEY.optimizer_state_bytes: tensor_bytes(optimizer_state(optimizer)),
    }


def overheads(figures: dict[str, Any]) -> dict[str, int]:
    """CUDA memory beyond the tensors: the context and libraries (NVML's process figure minus what
    the allocator reserved) and the cache's slack (reserved minus allocated at their peaks)."""
    out = {}
    if (
        figures.get(KEY.peak_reserved_bytes) is not None
        and figures.get(KEY.peak_allocated_bytes) is not None
    ):
        out[KEY.cache_slack_bytes] = (
            figures[KEY.peak_reserved_bytes] - figures[KEY.peak_allocated_bytes]
        )
    if figures.get(KEY.nvml_process_bytes) and figures.get(KEY.peak_reserved_bytes) is not None:
        out[KEY.context_bytes] = figures[KEY.nvml_process_bytes] - figures[KEY.peak_reserved_bytes]
    return out
