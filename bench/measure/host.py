"""Host memory a step holds for its device: the tensors it keeps off the device (offloaded
activations, an optimizer stepping on the host, the few scalars CUDA keeps there), counted beside
the device's live bytes by the same tracker (tracker.LiveBytes).

Pinned (page-locked) host memory comes from PyTorch's caching host allocator
(ATen/core/CachingHostAllocator.h): each request is rounded up to the next power of two and served
from a cached free block of exactly that size, else a new block is pinned (cudaHostAlloc); a freed
block is cached for the next request of its size and never given back while the process runs
(short of emptying the cache). What that allocator holds is what torch.cuda.host_memory_stats()
calls allocated_bytes. Pageable host memory is the bytes asked for (malloc's page rounding
aside)."""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# The pinned flag of each making_host block now open, innermost last.
_MAKING: list[bool] = []


@contextmanager
def making_host(pinned: bool) -> Iterator[None]:
    """What the block makes stands for host memory, ``pinned`` or pageable: a prediction's fake
    CPU tensors stand for the device's, and a stand-in making a host copy says so here (a tracker
    counts a tensor as an operator returns it, before any mark could be set on it)."""
    _MAKING.append(pinned)
    try:
        yield
    finally:
        _MAKING.pop()


# the storages marked on_host, by id, each with its pinned flag, while they live: a view of a marked
# tensor (a sharded parameter's, of its padded shard) is the host's too
_MARKED: dict[int, bool] = {}


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding a wrapper subclass's data (quantized weights, 8-bit states, a
    DTensor's local shard; a DTensor also names its device mesh, which holds no data)."""
    names, _ = t.__tensor_flatten__()
    return [x for n in names if isinstance(x := getattr(t, n), torch.Tensor)]


def on_host(t: torch.Tensor, pinned: bool = False) -> torch.Tensor:
    """Marks ``t`` and its storage (a wrapper subclass's, those of the tensors it wraps) as
    standing for a tensor the modelled device keeps on the host (``pinned`` or pageable): a
    prediction's fake CPU tensors stand for CUDA ones, and a few of those live on the host
    there."""
    t.on_host = True
    t.pinned = pinned
    if is_traceable_wrapper_subclass(t):
        for inner in inner_tensors(t):
            on_host(inner, pinned)
        return t
    storage = t.untyped_storage()
    if id(storage) not in _MARKED:
        weakref.finalize(storage, _MARKED.pop, id(storage), None)
    _MARKED[id(storage)] = pinned
    return t


def is_on_host(t: torch.Tensor) -> bool:
    if getattr(t, "on_host", False):
        return True
    if not _MARKED:
        return False
    if is_traceable_wrapper_subclass(t):  # a DTensor whose local shard is the host's
        inner = inner_tensors(t)
        return bool(inner) and all(is_on_host(x) for x in inner)
    return _marked(t) is not None


def marked_pinned(t: torch.Tensor) -> bool:
    """Whether ``t`` is marked on_host as pinned memory, itself or its storage."""
    return is_on_host(t) and bool(getattr(t, "pinned", None) or _marked(t))


def _marked(t: torch.Tensor) -> bool | None:
    """The pinned flag of ``t``'s storage where it is marked on_host; None where not."""
    return _MARKED.get(id(t.untyped_storage()))


def making() -> bool | None:
    """The innermost open ``making_host``'s pinned flag; None outside any."""
    return _MAKING[-1] if _MAKING else None


# open making_unified blocks
_UNIFIED: list[bool] = []


@contextmanager
def making_unified() -> Iterator[None]:
    """What the block makes stands for CUDA unified memory (a stand-in making a paged optimizer's
    state): a tracker counts a tensor as an operator returns it, before its mark is set, and would
    have counted it the device allocator's."""
    _UNIFIED.append(True)
    try:
        yield
    finally:
        _UNIFIED.pop()


def is_unified(t: torch.Tensor, made: bool = False) -> bool:
    """CUDA unified memory (a paged optimizer's state: bitsandbytes' own, marked ``is_paged``, or a
    prediction's standing for it, or ``made`` under ``making_unified``): neither the device
    allocator's nor the host's, paged in and out by the driver."""
    if made and _UNIFIED:
        return True
    return getattr(t, "unified_memory", False) or getattr(t, "is_paged", False)


def host_kind(t: torch.Tensor, device_type: str, made: bool = False) -> bool | None:
    """Whether ``t``, counted by a tracker of ``device_type``, is host memory, and pinned (True) or
    pageable (False); None where it is the device's own. A CPU tensor in a CUDA step is the host's;
    in a prediction, a tensor marked ``on_host``, or ``made`` (its storage new, no view of an
    operator's input) under ``making_host``."""
    if made and _MAKING:
        return _MAKING[-1]
    if is_on_host(t):
        return marked_pinned(t)
    if t.device.type == "cpu" and device_type != "cpu":
        return t.is_pinned()
    return None


def pinned_block(n: int) -> int:
    """The block the caching host allocator pins for a request of ``n`` bytes: the next power of
    two (c10::llvm::PowerOf2Ceil)."""
    return 1 << (n - 1).bit_length()


class HostBytes:
    """The host memory a step holds: each storage counted once as it is first seen and uncounted
    when freed, pinned ones through the caching host allocator's blocks (which it never frees).
    ``current`` and ``peak``: pageable bytes alive plus pinned blocks held."""

    def __init__(self) -> None:
        self._live: dict[int, tuple[int, bool]] = {}  # id(storage) → (bytes or block, pinned)
        self._free_blocks: Counter[int] = Counter()  # the pinned allocator's cached blocks
        self.pinned = 0  # bytes of the blocks the pinned allocator holds, free or not
        self.current = 0
        self.peak = 0
        self.seen = False  # any host storage counted

    def holds(self, storage: torch.UntypedStorage) -> bool:
        return id(storage) in self._live

    def count(self, storage: torch.UntypedStorage, pinned: bool) -> None:
        key = id(storage)
        if key in self._live or not (n := storage.nbytes()):
            return
        self.seen = True
        if pinned:
            n = pinned_block(n)
            if self._free_blocks[n]:
                self._free_blocks[n] -= 1
            else:
                self.pinned += n
                self.current += n
        else:
            self.current += n
        self._live[key] = (n, pinned)
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        n, pinned = self._live.pop(key)
        if pinned:
            self._free_blocks[n] += 1  # cached for the next request of its size, still held
        else:
            self.current -= n


def host_copy(t: torch.Tensor, pinned: bool, values: bool = False) -> torch.Tensor:
    """A host copy of ``t``'s elements, contiguous, in host memory ``pinned`` or pageable, its
    values copied where ``values`` (``Tensor.pin_memory``'s): in a prediction, whose fake CPU
    tensors stand for the device's, what a library keeps on the host."""
    with making_host(pinned):
        out = torch.empty(t.shape, dtype=t.dtype)
        if values:
            out.copy_(t)
    return on_host(out, pinned)
