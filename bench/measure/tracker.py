"""Live tensor bytes, counted exactly at every operator on any device.

A TorchDispatchMode sees every tensor an operator returns; each new storage is counted once and
uncounted when it is freed (a weakref finalizer on the storage). Unlike the caching allocator's
statistics this works on the CPU, and unlike PyTorch's MemTracker it handles a module called several
times in one step (gradient accumulation) and reports the bytes held from forward into backward.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

CUDA_BLOCK = 512  # the caching allocator rounds every allocation up to this


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding a wrapper subclass's data (quantized weights, 8-bit states)."""
    names, _ = t.__tensor_flatten__()
    return [getattr(t, n) for n in names]


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    if is_traceable_wrapper_subclass(t):
        return [s for inner in inner_tensors(t) for s in storages(inner)]
    return [t.untyped_storage()]


class LiveBytes(TorchDispatchMode):
    def __init__(self, device: torch.device, rounding: int | None = None) -> None:
        """``rounding``: allocation granularity to count in; CUDA's 512 bytes by default on CUDA, so a
        prediction on a CPU can model the CUDA allocator too."""
        super().__init__()
        self.device_type = device.type
        self.rounding = rounding or (CUDA_BLOCK if device.type == "cuda" else 1)
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.phase = ""  # set by the caller (forward / backward / optimizer); remembered at the peak
        self.peak_phase = ""

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that exist already (parameters, optimizer state, the batch)."""
        for t in tensors:
            self._count(t)

    def _count(self, t: torch.Tensor) -> None:
        if t.device.type != self.device_type:
            return
        if is_traceable_wrapper_subclass(t):  # e.g. an 8-bit optimizer state: count what it wraps
            for inner in inner_tensors(t):
                self._count(inner)
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._live:
            return
        n = math.ceil(storage.nbytes() / self.rounding) * self.rounding
        self._live[key] = n
        self.current += n
        if self.current > self.peak:
            self.peak, self.peak_phase = self.current, self.phase
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out
