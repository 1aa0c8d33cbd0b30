"""Memory figures. CUDA: the caching allocator's own statistics and NVML's view of the process. Any
device: the peak of live tensor bytes (a dispatch-mode tracker, see tracker.py), the bytes held from
forward into backward, model-state bytes, and the process's resident-set peak. A figure that cannot
be had here is absent, never 0."""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol
from unittest.mock import patch

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from bench.measure.allocator import CachingAllocator, OutOfMemory, Replay
from bench.measure.host import host_kind, inner_tensors, is_unified
from bench.measure.tracker import Kernel, LiveBytes, storages
from bench.record import AT_PEAK, Category, Memory, Phase, Prediction


def cuda_peaks(device: torch.device) -> Memory:
    stats = torch.cuda.memory_stats(device)
    return Memory(
        peak_allocated_bytes=stats["allocated_bytes.all.peak"],
        peak_reserved_bytes=stats["reserved_bytes.all.peak"],
        peak_active_bytes=stats["active_bytes.all.peak"],
        alloc_retries=stats["num_alloc_retries"],
        cuda_ooms=stats["num_ooms"],
        pinned_host_bytes=_pinned_host_bytes(),
    )


def _pinned_host_bytes() -> int | None:
    """The caching host allocator's pinned blocks now (torch 2.6 on); None where CUDA is not
    initialised, or torch does not say."""
    stats = getattr(torch.cuda, "host_memory_stats", dict)()
    return stats.get("allocated_bytes.current")


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


STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")
# glibc's settings under which a process's resident memory follows its tensors: each allocation of
# 64 KiB and more mapped on its own and handed back when freed, nothing kept on trim
RESIDENT_EXACT = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
_PEAKS_BEFORE: list[int] = [0]  # the high-water mark as each reset found it


def rss_peak_bytes() -> int:
    """The process's resident peak over its life: the kernel's (in KiB on Linux), or the one
    ``resident_growth`` read before it reset the kernel's, where larger."""
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, *_PEAKS_BEFORE)


@contextmanager
def resident_growth() -> Iterator[list[int]]:
    """The process's resident memory's growth over the block, in the list it yields once the block
    is done: its high-water mark over the block (Linux's, reset as the block begins by writing 5
    to clear_refs; the mark it had is kept for ``rss_peak_bytes``) less what it held as the block
    began. Empty where the system keeps no such mark."""
    out: list[int] = []
    try:
        peak = _status_bytes("VmHWM:")
        CLEAR_REFS.write_text("5")
        _PEAKS_BEFORE.append(peak)
        before = _status_bytes("VmRSS:")
    except (OSError, ValueError):
        yield out
        return
    yield out
    out.append(_status_bytes("VmHWM:") - before)


def _status_bytes(field: str) -> int:
    line = next(x for x in STATUS.read_text().splitlines() if x.startswith(field))
    return int(line.split()[1]) * 1024  # in kB


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    # Keyed by the C++ storage object: views share one, and fake tensors (prediction) have no
    # addresses.
    unique = {s._cdata: s.nbytes() for t in tensors for s in storages(t)}
    return sum(unique.values())


def parameter_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The model's parameters and what each keeps beside its data to be used, which lives on the
    device with it but is no parameter or buffer: a bitsandbytes 4-bit weight's quantization state
    (its blocks' scales, themselves quantized with theirs, the code books and the offset), and an
    8-bit weight's absmax a row (its SCB: on the weight until its layer's first forward, on the
    layer's state after), and a DeepSpeed ZeRO-3 parameter's partition on this rank (its
    ds_tensor, while the parameter itself is gathered for its module alone)."""
    params = list(model.parameters())
    states = [t for p in params for t in _quant_state(getattr(p, "quant_state", None))]
    holders = [*params, *(getattr(m, "state", None) for m in model.modules())]
    rows = [t for h in holders if torch.is_tensor(t := getattr(h, "SCB", None))]
    partitions = [t for p in params if torch.is_tensor(t := getattr(p, "ds_tensor", None))]
    return params + states + rows + partitions


def _quant_state(state: object) -> list[torch.Tensor]:
    if state is None:
        return []
    own = [t for t in vars(state).values() if torch.is_tensor(t)]
    return own + _quant_state(getattr(state, "state2", None))


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


def host_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """What an optimizer keeps on the host for the device (one stepping there: its
    ``host_tensors``)."""
    held = getattr(optimizer, "host_tensors", None)
    if held is None:
        return []
    return held()


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
# tracker's labels, each in the record's at-peak category.
CATEGORIES: dict[str, Category] = {
    Category.PARAMETERS: Category.PARAMETERS,
    Category.BUFFERS: Category.BUFFERS,
    Category.GRADIENTS: Category.GRADIENTS,
    Category.OPTIMIZER_STATE: Category.OPTIMIZER_STATE,
    Category.KV_CACHE: Category.KV_CACHE,
    Phase.START: Category.ACTIVATIONS,
    Phase.FORWARD: Category.ACTIVATIONS,
    Phase.BACKWARD: Category.TEMPORARIES,
    Phase.OPTIMIZER: Category.TEMPORARIES,
    Phase.PREFILL: Category.ACTIVATIONS,
    Phase.DECODE: Category.ACTIVATIONS,
}


class Phases(Protocol):
    """A stepper whose forwards are phases of their own (generation: the prompt's prefill, then one
    forward per token), and which keeps a cache from one forward to the next."""

    phase: str  # of the forward now beginning
    cache_bytes: int  # the cache's device bytes at their largest over the step

    def cache(self) -> list[torch.Tensor]: ...


# a generation's, each with its own peak (peak_<phase>_bytes)
GENERATION_PHASES = (Phase.PREFILL, Phase.DECODE)


def tracked_step(
    step: Callable[[], object],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
    rounding: int | None = None,
    compiled_update: bool = False,
    phases: Phases | None = None,
    marked: bool = False,
) -> Memory:
    """One step under the live-bytes tracker, and its figures (``tracked_memory``).
    ``compiled_update``: the optimizer's step runs compiled code, which the tracker steps aside for;
    its state is counted, its own temporaries are not. ``marked``: the step is a pass of steps, each
    marked at its end (``mark_trackers``), whose peaks are kept apart too. On a CPU, where every
    tensor is host memory, the peak as the process's resident memory says it too, where glibc is
    told to hand every tensor's pages back (RESIDENT_EXACT): else its heap keeps freed memory for
    the next request, and the figure reads low (by 13-31% on resnet's CPU entries)."""
    exact = device.type == "cpu" and all(os.environ.get(k) == v for k, v in RESIDENT_EXACT.items())
    with resident_growth() if exact else nullcontext([]) as grown:
        done = track(
            step,
            model,
            optimizer=optimizer,
            device=device,
            rounding=rounding,
            compiled_update=compiled_update,
            phases=phases,
        )
    out = tracked_memory(done, model, optimizer, phases)
    if marked:
        out.step_peak_bytes = done.tracker.part_peaks()
    if grown:
        out.rss_peak_tensor_bytes = done.tracker.at_start + grown[0]
    return out


def tracked_memory(
    done: Tracked,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    phases: Phases | None = None,
) -> Memory:
    """A tracked step's figures: its peak, what was alive at that peak (``at_peak_*_bytes``, summing
    to the peak), and the bytes each forward leaves alive for backward (saved activations plus the
    logits), the quantity checkpointing and autocast shrink; with ``phases`` (generation), instead
    of the latter, each phase's peak and the cache's bytes."""
    tracker = done.tracker
    if phases is not None:
        generated = Memory(kv_cache_bytes=phases.cache_bytes)
    else:
        generated = Memory(activation_bytes=max(done.held))
    # What the optimizer found in .grad (absent where gradients are freed in backward, or no
    # optimizer).
    grads = Memory(gradient_bytes=done.grads[-1] if done.grads else None)
    peaks = at_peak_memory(tracker, generating=phases is not None)
    states = model_state_bytes(model, optimizer, tracker.device_type)
    return peaks | grads | generated | states | host_memory(tracker)


def host_memory(tracker: LiveBytes) -> Memory:
    """What the step held on the host for the device (bench.measure.host), where it held any."""
    if not tracker.host.seen:
        return Memory()
    return Memory(host_peak_bytes=tracker.host.peak, host_pinned_bytes=tracker.host.pinned)


def at_peak_memory(tracker: LiveBytes, generating: bool) -> Memory:
    """The tracker's peak, where it fell and what was alive at it, by category; a generation's
    peak in each of its phases."""
    at_peak = dict.fromkeys(AT_PEAK, 0)
    for label, n in tracker.at_peak().items():
        at_peak[CATEGORIES[label]] += n
    out = Memory(
        peak_tensor_bytes=tracker.peak,
        peak_phase=tracker.peak_phase,
        # the cache's share where a generation has one (training and forward passes keep none)
        **{
            f"at_peak_{k}_bytes": v
            for k, v in at_peak.items()
            if k != Category.KV_CACHE or generating
        },
    )
    if generating:
        out |= Memory(**{f"peak_{p}_bytes": tracker.phase_peaks.get(p) for p in GENERATION_PHASES})
    return out


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
    kernels: dict[torch._ops.OpOverload, Kernel] | None = None,
) -> Tracked:
    """``step`` under a tracker that knows the model's states as such, and each phase as it begins
    (forward, backward, optimizer; or the ``phases`` of a generation's forwards, its cache labelled
    as such after each); following ``history``, the tracker of the steps before
    (``LiveBytes.follow``); ``kernels``: composite kernels run as such (``LiveBytes``)."""
    tracker = LiveBytes(device, rounding, kernels)
    tracker.add(parameter_tensors(model), Category.PARAMETERS)
    tracker.add(model.buffers(), Category.BUFFERS)
    tracker.add(_grads(model), Category.GRADIENTS)
    # what the optimizer keeps on the host first: it may say so of its state as it lists it
    tracker.add(host_tensors(optimizer), Category.OPTIMIZER_STATE)
    tracker.add(optimizer_state(optimizer), Category.OPTIMIZER_STATE)
    if history is not None:
        tracker.follow(history)
    done = Tracked(tracker, [], [])
    starts: list[int] = []

    def forward_start(*_: object) -> None:
        if phases is None:
            tracker.phase = Phase.FORWARD
        starts.append(tracker.current)

    def generation_phase(*_: object) -> None:  # after generate()'s own hook has named it
        if phases is not None:
            tracker.phase = phases.phase

    def forward_end(*_: object) -> None:
        done.held.append(tracker.current - starts[-1])
        if phases is None:
            tracker.phase = Phase.BACKWARD
        else:  # the phase goes on: the token is chosen after the forward
            tracker.label(phases.cache(), Category.KV_CACHE)

    hooks = [
        # before any hook of the model's own (FSDP2's root gathers its parameters in one), and
        # after them: what they make and free is the forward's
        model.register_forward_pre_hook(forward_start, prepend=True),
        model.register_forward_pre_hook(generation_phase),
        model.register_forward_hook(forward_end),
    ]

    def optimizer_start(*_: object) -> None:
        tracker.phase = Phase.OPTIMIZER
        tracker.label(_grads(model), Category.GRADIENTS)
        done.grads.append(device_bytes(_grads(model), tracker.device_type))

    if optimizer is not None:
        hooks.append(_before_each_step(optimizer, optimizer_start))
    if compiled_update:
        aside = patch.object(optimizer, "step", _stepped_aside(optimizer.step, tracker))
    else:
        aside = nullcontext()
    try:
        tracker.begin()
        with tracker, aside:
            step()
        tracker.end()
    finally:
        for h in hooks:
            h.remove()
    # kept past the step (no optimizer, or zero_grad keeps them), and the state made in it (a first
    # step)
    tracker.label(_grads(model), Category.GRADIENTS)
    tracker.label(optimizer_state(optimizer), Category.OPTIMIZER_STATE)
    return done


# The phase an allocation the card cannot hold was made in, by what the tracker called it.
OOM_PHASES: dict[str, str] = {
    Phase.START: Phase.FORWARD,
    Category.GRADIENTS: Phase.BACKWARD,
    Category.OPTIMIZER_STATE: Phase.OPTIMIZER,
    Category.PARAMETERS: "set-up",
}


def replayed(tracker: LiveBytes, replay: Replay) -> Prediction:
    """What CUDA's caching allocator would reserve for a tracked step, its allocations and frees
    replayed through bench.measure.allocator after the workspaces and the steps before it: the
    reserved peak, and under a card's capacity the verdict: fits, fits only after freeing the cache
    (each flush a pause), or out of memory at a phase and request. Over a whole pass
    (``replay.epoch``: the tracker marked each step's end), the step that ran out, and where the
    pass does not simply fit, the verdict under expandable segments."""
    allocator = CachingAllocator(
        replay.capacity,
        replay.conf.max_split_size,
        replay.conf.roundup_divisions,
        expandable=replay.conf.expandable,
        memory=replay.memory,
    )
    for i, size in enumerate(replay.workspaces):
        allocator.malloc(("workspace", i), size)  # never freed: cuBLAS keeps its workspaces
    try:
        tracker.replay(allocator)
    except OutOfMemory as exc:
        out = Prediction(  # no peaks: the step never reached its own; the reserve is the failure's
            oom_reserved_bytes=allocator.reserved,
            verdict="out of memory",
            flushes=allocator.retries,
            oom_phase=OOM_PHASES.get(exc.label, exc.label),
            oom_request_bytes=exc.request,
        )
        if replay.epoch:
            out.oom_step = exc.part
    else:
        out = Prediction(
            peak_allocated_bytes=allocator.peak_allocated,  # the workspaces with the tensors
            peak_reserved_bytes=allocator.peak_reserved,
            largest_free_bytes=allocator.largest_free_at_peak,
        )
        if replay.capacity is not None:
            if allocator.retries:
                out.verdict = "fits after flushes"
            else:
                out.verdict = "fits"
            out.flushes = allocator.retries
    if replay.epoch:  # a whole pass: whether expandable segments hold what its own settings do not
        out.epoch_steps = len(tracker.marks)
        out.epoch_reserved_bytes = allocator.at_marks
        out.epoch_largest_free_bytes = allocator.free_at_marks
        if out.verdict not in (None, "fits") and not replay.conf.expandable:
            grown = replace(replay, conf=replace(replay.conf, expandable=True))
            out.expandable_verdict = replayed(tracker, grown).verdict
            if replay.conf.max_split_size is None:
                out.split_verdict = _split_verdict(tracker, replay, out.verdict)
    return out


# max_split_size_mb tried on a pass that runs out of memory or flushes, largest first: a block over
# it is never split, so small requests do not carve up what a large one needs
SPLITS_MB = (512, 256, 128, 64)
# a card's verdicts, the worst first
VERDICTS = ("out of memory", "fits after flushes", "fits")


def _split_verdict(tracker: LiveBytes, replay: Replay, verdict: str) -> str:
    """The largest of ``SPLITS_MB`` under which the pass does better than ``verdict``, and how."""
    for mb in SPLITS_MB:
        split = replace(replay, conf=replace(replay.conf, max_split_size=mb << 20))
        found = replayed(tracker, split).verdict
        if VERDICTS.index(found) > VERDICTS.index(verdict):
            return f"{found} with max_split_size_mb:{mb}"
    return f"{verdict} with max_split_size_mb at {', '.join(map(str, SPLITS_MB))} too"


def _stepped_aside(step: Callable[..., Any], tracker: LiveBytes) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with tracker.stepped_aside():
            return step(*args, **kwargs)

    return run


def _before_each_step(optimizer: Any, hook: Callable[[], None]) -> Any:
    """``hook`` called as each optimizer step begins, and the handle that removes it: torch's step
    pre-hook, or, on an engine's optimizer that is not torch's (DeepSpeed's ZeRO), its step
    wrapped, the step it had put back as it was (a prediction's own stand-in for it included)."""
    if hasattr(optimizer, "register_step_pre_hook"):
        return optimizer.register_step_pre_hook(lambda *_: hook())
    own = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        hook()
        return own(*args, **kwargs)

    wrapped = patch.object(optimizer, "step", step)
    wrapped.start()
    return SimpleNamespace(remove=wrapped.stop)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def model_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, device_type: str | None = None
) -> Memory:
    """The model's states, parameters, buffers and the optimizer's; on a ``device_type`` with a
    host apart (CUDA), those on the device alone: what is kept on the host (FSDP's offloaded
    shards, ZeRO-Offload's partitions, the step counters CUDA keeps there) is the host's
    (``host_memory``)."""

    return Memory(
        param_bytes=device_bytes(parameter_tensors(model), device_type),
        buffer_bytes=device_bytes(model.buffers(), device_type),
        optimizer_state_bytes=device_bytes(optimizer_state(optimizer), device_type),
    )


def device_bytes(tensors: Iterable[torch.Tensor], device_type: str | None) -> int:
    """``tensor_bytes`` of those of ``tensors`` on a ``device_type`` with a host apart, not on its
    host; of all of them where None."""
    if device_type is None:
        return tensor_bytes(tensors)
    return tensor_bytes(t for t in tensors if not _on_host(t, device_type))


def _on_host(t: torch.Tensor, device_type: str) -> bool:
    """Whether ``t`` (a wrapper subclass: each tensor it wraps) is the host's."""
    if is_traceable_wrapper_subclass(t):
        return all(_on_host(x, device_type) for x in inner_tensors(t))
    return not is_unified(t) and host_kind(t, device_type) is not None


def overheads(memory: Memory) -> Memory:
    """CUDA memory beyond the tensors: the context and libraries (NVML's process figure minus what
    the allocator reserved) and the cache's slack (reserved minus allocated at their peaks)."""
    reserved, allocated = memory.peak_reserved_bytes, memory.peak_allocated_bytes
    out = Memory()
    if reserved is not None and allocated is not None:
        out.cache_slack_bytes = reserved - allocated
    if memory.nvml_process_bytes and reserved is not None:
        out.context_bytes = memory.nvml_process_bytes - reserved
    return out
