"""The CUDA caching allocator's own history of a run, saved beside its record, and replayed through
the simulator (bench.measure.allocator) to check it to the segment.

On a GPU the worker records every allocation and free from before the model is built to the end of
the instrumented step (``torch.cuda.memory._record_memory_history``, without stacks unless
``--snapshot`` asks for them) and saves the snapshot gzipped as ``<run>.history.pickle.gz``. Its
trace says what the allocator did: each block allocated and freed, and each segment it reserved from
the driver (at the address the driver chose) and released. Replayed block by block through the
simulator, with each new segment where the driver put it (the allocator breaks ties between free
blocks of one size by address), every block must land where the card put it, and the segments the
simulator reserves must be the ones the card did."""

from __future__ import annotations

import gzip
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.measure.allocator import CachingAllocator

# trace entries kept (a ring buffer): a step of BERT-base makes a few thousand
MAX_ENTRIES = 1_000_000


def start(stacks: bool) -> None:
    """Record from now: every allocation and free, with Python stacks where ``stacks``
    (memory_viz)."""
    import torch

    if stacks:
        context = "all"
    else:
        context = None
    torch.cuda.memory._record_memory_history(
        "all", context=context, stacks="python", max_entries=MAX_ENTRIES
    )


def save(path: Path) -> None:
    """The history so far, gzipped (a pickle memory_viz reads once unzipped); recording stops."""
    import torch

    snapshot = torch.cuda.memory._snapshot()
    stop()
    with gzip.open(path, "wb") as f:
        pickle.dump(snapshot, f)


def stop() -> None:
    import torch

    torch.cuda.memory._record_memory_history(None)


def read(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rb") as f:
        return pickle.load(f)


@dataclass(kw_only=True)
class Replayed:
    """A trace through the simulator: the reserved peak it reached and the one the card's segments
    did, and how many of the allocations it placed elsewhere than the card did (0: the simulator
    chose every block the card chose)."""

    simulated_peak_reserved: int
    recorded_peak_reserved: int
    allocations: int
    misplaced: int


def replay(snapshot: dict[str, Any], device: int = 0) -> Replayed:
    """The device's trace, block by block, through the simulator; the card's own segments summed
    beside."""
    trace = snapshot["device_traces"][device]
    # a run under expandable_segments maps pages where another reserves segments
    allocator = CachingAllocator(expandable=any(e["action"] == "segment_map" for e in trace))
    reserved = peak = count = misplaced = 0
    placed = None  # where the driver put the segment the card reserved for the request that follows
    emptying = False  # within a run of segments released: one emptying of the cache
    for entry in trace:
        action, addr, size = entry["action"], entry.get("addr"), entry.get("size", 0)
        if action == "alloc":
            # ties between free blocks go by address, as on the card
            allocator.malloc(addr, size, placed)
            placed, count, misplaced = (
                None,
                count + 1,
                misplaced + (allocator.address(addr) != addr),
            )
        elif action == "free_completed":
            allocator.free(addr)
        elif action in ("segment_alloc", "segment_map"):
            placed, reserved = addr, reserved + size
            peak = max(peak, reserved)
        elif action in ("segment_free", "segment_unmap"):
            # The cache emptied (empty_cache, or cuDNN's benchmark after each search for a
            # convolution's algorithm): every wholly free segment released at once.
            if not emptying:
                allocator.empty_cache()
            reserved -= size
        emptying = action in ("segment_free", "segment_unmap")
    return Replayed(
        simulated_peak_reserved=allocator.peak_reserved,
        recorded_peak_reserved=peak,
        allocations=count,
        misplaced=misplaced,
    )
