"""PyTorch's CUDA caching allocator, simulated: a step's allocations and frees, in order, replayed
through its rules as ``c10/cuda/CUDACachingAllocator.cpp`` writes them, give what the card would
have reserved, not only what was allocated. One stream; ``PYTORCH_CUDA_ALLOC_CONF``'s
``max_split_size_mb``, ``roundup_power2_divisions`` and ``expandable_segments`` (``Conf``).

The rules: a request is rounded up to 512 bytes. Requests up to 1 MiB come from the small pool,
whose segments are 2 MiB; larger ones from the large pool, whose segments are 20 MiB for requests
under 10 MiB, else the request rounded up to 2 MiB. A request takes the smallest free block of its
pool that holds it (best fit), of equal sizes the one at the lowest address (BlockComparatorSize);
the block is split when what is left is at least 512 bytes (small pool) or more than 1 MiB (large
pool), and a freed block merges with the free blocks beside it in its segment. Where no block fits,
a new segment is reserved; under a memory cap, the allocator first frees every segment wholly unused
and tries again (a retry), and raises out of memory after.

With expandable segments (Note [Expandable Segments]), each pool has one segment of virtual
addresses (9/8 of the card's memory) backed by pages mapped as they are needed: 2 MiB ones for the
small pool, 20 MiB for the large. Any block splits where 512 bytes or more are left. A request no
free block holds maps pages at the lowest address where free and unmapped space together hold it
(the free block before the unmapped tail grows into it), so what is reserved is what is mapped. A
best fit that is the block before unmapped space gives way to the next larger block whose own size
and unmapped space after it are smaller. Freeing the cache unmaps every whole page inside a free
block, wherever it is, so the pages a split left free in the middle return to the driver and a
larger request maps them again at the end: what fixed segments lose to fragmentation, this gets
back, but for pages a block only partly covers."""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

MIN_BLOCK = 512  # kMinBlockSize: every request is rounded up to a multiple of it
SMALL_SIZE = 1 << 20  # kSmallSize: requests up to this come from the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small pool's segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: a large pool's segment for requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: larger requests' segments round up to this
# where a segment with no recorded address goes: above any real one, in the order made
UNPLACED = 1 << 60
# an expandable segment's page: each pool's (ExpandableSegment's segment_size)
PAGE = {True: SMALL_BUFFER, False: LARGE_BUFFER}
# an expandable segment's addresses where the card's memory is not known (a recorded history's
# replay): more than any card has, and a request never reaches its end
ADDRESS_SPACE = 1 << 40


# CublasHandlePool.cpp: each cuBLAS handle takes a workspace per stream from this allocator when it
# first runs, and keeps it: CUBLAS_WORKSPACE_CONFIG's default, 4096 KiB × 8 on compute capability
# 9.0 (Hopper), else 4096 KiB × 2 + 16 KiB × 8; and a cuBLASLt workspace of
# CUBLASLT_WORKSPACE_SIZE's default, 1,024 KiB.
CUBLAS_WORKSPACE = {True: 4096 * 1024 * 8, False: 4096 * 1024 * 2 + 16 * 1024 * 8}
CUBLASLT_WORKSPACE = 1024 * 1024


def cublas_workspaces(hopper: bool, training: bool) -> tuple[int, ...]:
    """What cuBLAS holds in the allocator once a step has run: a handle per thread that runs
    matmuls, the main thread's (forward) and, in training, the autograd engine's device thread's
    (backward)."""
    return (CUBLAS_WORKSPACE[hopper], CUBLASLT_WORKSPACE) * (2 if training else 1)


class OutOfMemory(Exception):
    """No segment could be reserved under the cap, even after freeing the cached ones."""

    def __init__(self, message: str, request: int) -> None:
        super().__init__(message)
        self.request = request
        self.label = ""  # what the request was for (LiveBytes sets it)
        self.index = -1  # the tracker's storage it was for
        self.part = 0  # the tracker's marked part it failed in, from 1 (0: the steps before)


@dataclass(eq=False)
class Block:
    """A stretch of a segment, linked to the blocks beside it in address order (as
    CUDACachingAllocator's are): a split and a merge touch its neighbours alone."""

    segment: int
    offset: int
    size: int
    free: bool = True
    mapped: bool = True  # False: an expandable segment's addresses with no pages behind them
    prev: Block | None = field(default=None, repr=False)  # each links the other: no repr
    next: Block | None = field(default=None, repr=False)


@dataclass(kw_only=True)
class Segment:
    size: int
    small: bool
    base: int  # its device address: of two free blocks of one size, the lower address is taken
    expandable: bool = False


@dataclass(frozen=True)
class Conf:
    """The settings of ``PYTORCH_CUDA_ALLOC_CONF`` the simulator follows (CUDAAllocatorConfig's
    names)."""

    max_split_size: int | None = None  # max_split_size_mb, in bytes; None: blocks of any size split
    roundup_divisions: int = 0  # roundup_power2_divisions (one value for every size); 0 or 1: none
    expandable: bool = False  # expandable_segments

    @staticmethod
    def parse(text: str) -> Conf:
        """``"max_split_size_mb:128,roundup_power2_divisions:4,expandable_segments:True"``; other
        settings change no reservation modelled here and are left out."""
        found = dict(item.split(":", 1) for item in text.replace(" ", "").split(",") if ":" in item)
        split = found.get("max_split_size_mb")
        divisions = found.get("roundup_power2_divisions", "0")
        return Conf(
            int(split) << 20 if split else None,
            int(divisions) if divisions.isdigit() else 0,
            # CUDAAllocatorConfig reads "True" alone as on
            expandable=found.get("expandable_segments") == "True",
        )


def round_size(size: int, divisions: int = 0) -> int:
    """round_size: to 512 bytes, or with ``divisions``, up to the next of that many steps between
    two powers of two (1200 in 4 divisions of 1024–2048: 1280), for requests over 512 ×
    ``divisions`` bytes."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    if divisions > 1 and size > MIN_BLOCK * divisions:
        return roundup_power2(size, divisions)
    return MIN_BLOCK * math.ceil(size / MIN_BLOCK)


def roundup_power2(size: int, divisions: int) -> int:
    """roundup_power2_next_division."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    if rounded == size:
        return size
    return rounded + step


def segment_size(size: int) -> int:
    """get_allocation_size: what is reserved for a rounded request that no free block holds."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * math.ceil(size / ROUND_LARGE)


@dataclass(frozen=True, kw_only=True)
class Replay:
    """How a step is replayed: the workspaces allocated before it (``cublas_workspaces``), and the
    bytes its segments may take (the card less the context; None: no cap)."""

    workspaces: tuple[int, ...] = ()
    capacity: int | None = None
    memory: int | None = None  # the card's, where known: an expandable segment's addresses
    epoch: bool = False  # the tracker's marks end the steps of a whole pass (--epoch)
    conf: Conf = Conf()  # the run's PYTORCH_CUDA_ALLOC_CONF
    history: Any = None  # the steps before, as a tracker saw them (bench.measure.tracker.LiveBytes)


class CachingAllocator:
    """``capacity``: the bytes segments may take (the card less what the process holds besides);
    None, no cap. ``max_split_size``: blocks this large or larger are never split
    (max_split_size_mb), None: any; ``roundup_divisions``: roundup_power2_divisions;
    ``expandable``: expandable_segments (``Conf``), each segment's addresses 9/8 of ``memory``, the
    card's (ADDRESS_SPACE where not known)."""

    def __init__(
        self,
        capacity: int | None = None,
        max_split_size: int | None = None,
        roundup_divisions: int = 0,
        expandable: bool = False,
        memory: int | None = None,
    ) -> None:
        self.capacity, self.max_split, self.divisions = capacity, max_split_size, roundup_divisions
        self.expandable = expandable
        self.address_space = ADDRESS_SPACE if memory is None else memory + memory // 8
        self.segments: dict[int, Segment] = {}
        # each pool's free blocks, as the card orders them: (size, address, segment, offset)
        self._free: dict[bool, list[tuple[int, int, int, int]]] = {True: [], False: []}
        # each pool's unmapped stretches of expandable segments, by address: (address, segment,
        # offset), and each by (segment, offset)
        self._unmapped: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
        self._holes: dict[tuple[int, int], Block] = {}
        self._taken: dict[Hashable, Block] = {}  # an allocation's handle → its block
        self._cached: dict[tuple[int, int], Block] = {}  # each free block by (segment, offset)
        self._next_segment = 0
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.retries = 0
        # the largest cached free block when allocation peaked: fragmentation
        self.largest_free_at_peak = 0
        self.at_marks: list[int] = []  # what was reserved at the end of each marked part (``mark``)
        # the largest cached free block when each marked part's allocation peaked, and the part now
        self.free_at_marks: list[int] = []
        self._part_peak = self._part_free = 0

    def mark(self) -> None:
        """The end of a marked part of the stream (a step of a pass): what is reserved then, and
        the largest free block when the part's allocation peaked."""
        self.at_marks.append(self.reserved)
        self.free_at_marks.append(self._part_free)
        self._part_peak, self._part_free = self.allocated, self.largest_free()

    def malloc(self, handle: Hashable, size: int, address: int | None = None) -> None:
        """Allocate ``size`` bytes under ``handle`` (freed by ``free(handle)``). ``address``: where
        the driver put the segment, if this request needs a new one (a recorded trace knows; a
        prediction cannot, and its segments are placed in the order they are made, each above the
        last)."""
        size = round_size(size, self.divisions)
        small = size <= SMALL_SIZE
        block = self._best_fit(size, small)
        if block is None:
            block = self._reserved_block(size, small, address)
        self._remove_free(block)
        if self._should_split(block, size, small):
            rest = Block(block.segment, block.offset + size, block.size - size)
            self._splice(rest, block, block.next)
            self._add_free(rest, small)
            block.size = size
        block.free = False
        self._taken[handle] = block
        self.allocated += block.size
        if self.allocated > self._part_peak:
            self._part_peak, self._part_free = self.allocated, self.largest_free()
        if self.allocated > self.peak_allocated:
            self.peak_allocated, self.largest_free_at_peak = self.allocated, self.largest_free()

    def address(self, handle: Hashable) -> int:
        """Where an allocation's block starts."""
        block = self._taken[handle]
        return self.segments[block.segment].base + block.offset

    def free(self, handle: Hashable) -> None:
        block = self._taken.pop(handle)
        self.allocated -= block.size
        block.free = True
        self._merge_free(block)
        self._add_free(block, self.segments[block.segment].small)

    def state(self, roles: dict[Hashable, Hashable]) -> tuple:
        """Everything that decides what it does next (its segments, its cached blocks in order, each
        allocation's place and size, its counters), each allocation named by its role in
        ``roles`` where it has one, else by its handle: two states equal make the same choices for
        the same requests."""
        taken = frozenset(
            (roles.get(h, h), self.segments[b.segment].base + b.offset, b.size)
            for h, b in self._taken.items()
        )
        segments = tuple((k, s.size) for k, s in self.segments.items())
        free = (tuple(self._free[True]), tuple(self._free[False]))
        unmapped = (tuple(self._unmapped[True]), tuple(self._unmapped[False]))
        return taken, segments, free, unmapped, self.allocated, self.reserved, self.retries

    def rename(self, handle: Hashable, to: Hashable) -> None:
        """The allocation under ``handle`` is now ``to``'s."""
        self._taken[to] = self._taken.pop(handle)

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache (release_cached_blocks): every segment wholly free is released;
        in an expandable one, every whole page inside a free block is unmapped, and the segment
        released once nothing in it is mapped."""
        for block in list(self._cached.values()):
            if self.segments[block.segment].expandable:
                self._unmap(block)
            elif block.prev is None and block.next is None:  # the whole segment
                self._remove_free(block)
                self.reserved -= self.segments.pop(block.segment).size

    def largest_free(self) -> int:
        # each pool is sorted
        return max((pool[-1][0] for pool in self._free.values() if pool), default=0)

    def _best_fit(self, size: int, small: bool) -> Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1, -1, -1))
        if i == len(pool):
            return None
        if self.expandable:
            i = self._expandable_fit(pool, i)
        found, _, segment, offset = pool[i]
        if self.max_split is not None and (
            # an oversize block is kept for large requests
            (size < self.max_split and found >= self.max_split)
            # and used only where it nearly fits
            or (size >= self.max_split and found >= size + LARGE_BUFFER)
        ):
            return None
        return self._cached[segment, offset]

    def _expandable_fit(self, pool: list[tuple[int, int, int, int]], i: int) -> int:
        """get_free_block with expandable segments: a block's size, for best fit, is what it can
        grow to (itself and the unmapped space after it), so a fit that can grow gives way to each
        larger block that can grow to less."""

        def can_grow_to(k: int) -> int:
            block = self._cached[pool[k][2], pool[k][3]]
            after = block.next
            return block.size + (after.size if after is not None and not after.mapped else 0)

        while (
            self.segments[pool[i][2]].expandable
            and i + 1 < len(pool)
            and can_grow_to(i + 1) < can_grow_to(i)
        ):
            i += 1
        return i

    def _should_split(self, block: Block, size: int, small: bool) -> bool:
        remaining = block.size - size
        if small or self.expandable:
            return remaining >= MIN_BLOCK
        return (self.max_split is None or size < self.max_split) and remaining > SMALL_SIZE

    def _reserved_block(self, size: int, small: bool, address: int | None) -> Block:
        """A free block of at least ``size`` bytes from the driver: a new segment, or pages mapped
        into an expandable one; where the card refuses, the cache is freed and it is asked once
        more (a retry)."""
        block = self._reserve(size, small, address)
        if block is None:
            self.retries += 1
            self.empty_cache()
            block = self._reserve(size, small, address)
        if block is None:
            raise OutOfMemory(
                f"tried to reserve {self._wanted(size, small):,} bytes with {self.reserved:,} of "
                f"{self.capacity:,} reserved",
                size,
            )
        return block

    def _reserve(self, size: int, small: bool, address: int | None) -> Block | None:
        if self.expandable:
            return self._expanded(size, small, address)
        wanted = segment_size(size)
        if not self._holds(wanted):
            return None
        block = self._segment(wanted, small, address, expandable=False)
        self._add_free(block, small)
        self._reserved(wanted)
        return block

    def _wanted(self, size: int, small: bool) -> int:
        if self.expandable:
            return PAGE[small] * math.ceil(size / PAGE[small])
        return segment_size(size)

    def _holds(self, wanted: int) -> bool:
        return self.capacity is None or self.reserved + wanted <= self.capacity

    def _reserved(self, wanted: int) -> None:
        self.reserved += wanted
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _segment(self, size: int, small: bool, address: int | None, expandable: bool) -> Block:
        """A new segment of ``size`` bytes (of addresses, where ``expandable``), as one block."""
        key, self._next_segment = self._next_segment, self._next_segment + 1
        if address is not None:
            base = address
        else:
            base = UNPLACED + (key << 40)
        self.segments[key] = Segment(size=size, small=small, base=base, expandable=expandable)
        return Block(key, 0, size, mapped=not expandable)

    def _expanded(self, size: int, small: bool, address: int | None) -> Block | None:
        """try_allocate_expandable_block: the free block of an expandable segment that holds
        ``size`` bytes once the unmapped space after it is mapped, grown to hold them; None where
        the card has no pages left for it."""
        block = self._expandable_block(size, small, address)
        if not block.mapped and not self._map(block, min(block.size, size)):
            return None
        while block.size < size:
            after = block.next
            assert after is not None and not after.mapped
            if not self._map(after, min(size - block.size, after.size)):
                return None
            block = after  # mapped, it took in the free block before it
        return block

    def _expandable_block(self, size: int, small: bool, address: int | None) -> Block:
        """find_expandable_block: the lowest unmapped stretch (with the free block before it) whose
        free and unmapped space together hold ``size`` bytes; else a new segment's addresses."""
        for _, segment, offset in self._unmapped[small]:
            block = self._holes[segment, offset]
            if block.prev is not None and block.prev.free:
                block = block.prev
            room, at = 0, block
            while at is not None and at.free and room < size:
                room, at = room + at.size, at.next
            if room >= size:
                return block
        block = self._segment(self.address_space, small, address, expandable=True)
        self._add_hole(block, small)
        return block

    def _map(self, block: Block, size: int) -> bool:
        """map_block: pages behind the start of an unmapped stretch, enough for ``size`` bytes,
        merged with the free blocks beside them; False where the card has none left."""
        small = self.segments[block.segment].small
        mapped = self._wanted(size, small)
        if not self._holds(mapped):
            return False
        self._remove_hole(block)
        block.mapped = True
        if mapped < block.size:
            rest = Block(block.segment, block.offset + mapped, block.size - mapped, mapped=False)
            self._splice(rest, block, block.next)
            self._add_hole(rest, small)
            block.size = mapped
        self._merge_free(block)
        self._add_free(block, small)
        self._reserved(mapped)
        return True

    def _unmap(self, block: Block) -> None:
        """unmap_block: the whole pages inside a free block of an expandable segment returned to
        the driver, what is left of the block on either side kept free; the segment released once
        none of it is mapped."""
        small = self.segments[block.segment].small
        page = PAGE[small]
        begin = page * math.ceil(block.offset / page)
        end = page * ((block.offset + block.size) // page)
        if begin >= end:
            return
        self._remove_free(block)
        if begin > block.offset:
            before = Block(block.segment, block.offset, begin - block.offset)
            self._splice(before, block.prev, block)
            self._add_free(before, small)
        if end < block.offset + block.size:
            after = Block(block.segment, end, block.offset + block.size - end)
            self._splice(after, block, block.next)
            self._add_free(after, small)
        block.offset, block.size, block.mapped = begin, end - begin, False
        self.reserved -= end - begin
        for near in (block.prev, block.next):  # unmapped neighbours: one stretch
            if near is not None and not near.mapped:
                self._remove_hole(near)
                self._absorb(block, near)
        if block.prev is None and block.next is None:
            del self.segments[block.segment]
        else:
            self._add_hole(block, small)

    def _merge_free(self, block: Block) -> None:
        """A block freed or just mapped takes in the free mapped blocks beside it."""
        for near in (block.prev, block.next):
            if near is not None and near.free and near.mapped:
                self._remove_free(near)
                self._absorb(block, near)

    @staticmethod
    def _absorb(block: Block, near: Block) -> None:
        """``near``, the block before or after ``block``, becomes part of it."""
        if near is block.prev:
            block.offset, block.prev = near.offset, near.prev
            if near.prev is not None:
                near.prev.next = block
        else:
            block.next = near.next
            if near.next is not None:
                near.next.prev = block
        block.size += near.size

    @staticmethod
    def _splice(block: Block, before: Block | None, after: Block | None) -> None:
        """``block`` placed between two blocks beside each other (either None at an end)."""
        block.prev, block.next = before, after
        if before is not None:
            before.next = block
        if after is not None:
            after.prev = block

    def _add_hole(self, block: Block, small: bool) -> None:
        key = (self.segments[block.segment].base + block.offset, block.segment, block.offset)
        bisect.insort(self._unmapped[small], key)
        self._holes[block.segment, block.offset] = block

    def _remove_hole(self, block: Block) -> None:
        segment = self.segments[block.segment]
        pool = self._unmapped[segment.small]
        del pool[bisect.bisect_left(pool, (segment.base + block.offset, block.segment, -1))]
        del self._holes[block.segment, block.offset]

    def _add_free(self, block: Block, small: bool) -> None:
        bisect.insort(self._free[small], self._key(block))
        self._cached[block.segment, block.offset] = block

    def _remove_free(self, block: Block) -> None:
        pool, key = self._free[self.segments[block.segment].small], self._key(block)
        del pool[bisect.bisect_left(pool, key)]
        del self._cached[block.segment, block.offset]

    def _key(self, block: Block) -> tuple[int, int, int, int]:
        return (
            block.size,
            self.segments[block.segment].base + block.offset,
            block.segment,
            block.offset,
        )
