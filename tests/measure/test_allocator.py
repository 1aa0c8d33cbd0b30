"""The caching allocator's rules, one hand-worked sequence each, as
c10/cuda/CUDACachingAllocator.cpp applies them."""

import pytest

from bench.measure.allocator import (
    CachingAllocator,
    Conf,
    OutOfMemory,
    cublas_workspaces,
    roundup_power2,
)

MiB = 1 << 20


def test_a_request_rounds_to_512_bytes_and_a_small_one_takes_a_2_mib_segment_shared_by_the_next():
    a = CachingAllocator()
    a.malloc(1, 1)
    assert (a.allocated, a.reserved) == (512, 2 * MiB)
    a.malloc(2, 1000)  # 1,024 bytes, split off the same segment's rest
    assert (a.allocated, a.reserved, len(a.segments)) == (1536, 2 * MiB, 1)


def test_a_large_request_under_10_mib_takes_a_20_mib_segment_that_four_of_5_mib_share():
    a = CachingAllocator()
    for handle in range(4):
        a.malloc(handle, 5 * MiB)
    # the fourth takes the 5 MiB left, unsplit
    assert (a.reserved, len(a.segments)) == (
        20 * MiB,
        1,
    )
    a.malloc(4, 5 * MiB)
    assert (a.reserved, len(a.segments)) == (40 * MiB, 2)


def test_a_request_of_10_mib_or_more_is_rounded_to_2_mib_and_a_1_mib_rest_is_not_split():
    a = CachingAllocator()
    a.malloc(1, 11 * MiB)
    assert a.reserved == 12 * MiB
    a.free(1)
    # 0.5 MiB would be left: the whole 12 MiB block is taken, and counted
    a.malloc(2, 11 * MiB + MiB // 2)
    assert (a.allocated, a.reserved) == (12 * MiB, 12 * MiB)


def test_freed_neighbours_merge_and_the_smallest_free_block_that_fits_is_taken():
    a = CachingAllocator()
    for handle in range(3):
        a.malloc(handle, 5 * MiB)  # 0-5, 5-10, 10-15 of one 20 MiB segment, 15-20 free
    a.free(1)
    a.free(0)  # merges with the free block after it: 10 MiB at 0
    a.malloc(3, 9 * MiB)
    # 9 of the merged 10 (1 MiB left unsplit), 15-20
    assert (a.reserved, a.largest_free()) == (20 * MiB, 5 * MiB)
    # the 5 MiB block at 15 is the best fit, taken whole (1 MiB left is not split off)
    a.malloc(4, 4 * MiB)
    assert (a.allocated, a.largest_free()) == (20 * MiB, 0)


def test_under_a_cap_the_cached_segments_are_freed_and_the_request_retried_then_out_of_memory():
    a = CachingAllocator(capacity=22 * MiB)
    a.malloc(1, 11 * MiB)
    a.free(1)  # 12 MiB stays reserved, cached
    a.malloc(2, 15 * MiB)  # 12 + 16 > 22: the cached segment is released, then 16 MiB is reserved
    assert (a.reserved, a.retries, a.peak_reserved) == (16 * MiB, 1, 16 * MiB)
    with pytest.raises(OutOfMemory, match="tried to reserve 20,971,520 bytes"):
        a.malloc(3, 8 * MiB)  # needs a 20 MiB segment: nothing cached to free
    assert a.retries == 2


def test_max_split_size_keeps_oversize_blocks_from_small_requests():
    a = CachingAllocator(max_split_size=4 * MiB)
    a.malloc(1, 11 * MiB)
    a.free(1)
    a.malloc(2, 2 * MiB)  # under max_split: the free 12 MiB block is not split for it
    assert (a.reserved, len(a.segments)) == (32 * MiB, 2)


def test_empty_cache_releases_only_wholly_free_segments():
    a = CachingAllocator()
    a.malloc(1, 5 * MiB)  # a 20 MiB segment, 15 MiB of it free
    a.malloc(2, 16 * MiB)  # too large for the free 15: a segment of its own
    a.free(2)
    a.empty_cache()
    assert a.reserved == 20 * MiB and a.peak_reserved == 36 * MiB


@pytest.mark.parametrize(
    "hopper, training, reserved",
    [
        # two handles' 32 MiB, their two 1 MiB Lt ones in one small segment
        (
            True,
            True,
            2 * 32 * MiB + 2 * MiB,
        ),
        (False, False, 20 * MiB + 2 * MiB),  # one handle's 8 MiB + 128 KiB in a 20 MiB segment
    ],
)
def test_cublas_takes_its_workspaces_from_the_allocator_as_cublashandlepool_sizes_them(
    hopper, training, reserved
):
    a = CachingAllocator()
    for i, size in enumerate(cublas_workspaces(hopper, training)):
        a.malloc(("workspace", i), size)
    assert a.reserved == reserved


def test_roundup_power2_divisions_rounds_a_request_to_the_next_step_between_two_powers_of_two():
    """CUDACachingAllocator.cpp's own example (1200 in 4 divisions: 1280), and a 5 MiB request plus
    a byte under roundup_power2_divisions:4 taking 6 MiB, where 512-byte rounding would take 5 MiB
    and 512 bytes."""
    assert roundup_power2(1200, 4) == 1280 and roundup_power2(4096, 4) == 4096
    conf = Conf.parse("max_split_size_mb:64, roundup_power2_divisions:4")
    assert conf == Conf(64 * MiB, 4)
    a = CachingAllocator(roundup_divisions=conf.roundup_divisions)
    a.malloc(1, 5 * MiB + 1)
    assert a.allocated == 6 * MiB
    plain = CachingAllocator()
    plain.malloc(1, 5 * MiB + 1)
    assert plain.allocated == 5 * MiB + 512


def test_the_largest_free_block_when_allocation_peaks_is_kept_as_the_fragmentation_there():
    a = CachingAllocator()
    a.malloc(1, 4 * MiB)
    a.malloc(2, 4 * MiB)
    a.free(1)  # 4 MiB free at the head of the 20 MiB segment, 12 MiB after the second block
    a.malloc(3, 5 * MiB)  # the allocation peak: 9 MiB, best fit left 7 MiB free after it
    assert (a.peak_allocated, a.largest_free_at_peak) == (9 * MiB, 7 * MiB)


def test_of_two_free_blocks_of_one_size_the_one_at_the_lower_address_is_taken():
    """BlockComparatorSize orders a pool by size, then address: the driver's placement of a segment,
    not the order the segments were made in, decides a tie. A prediction, with no addresses, places
    each new segment above the last."""
    high, low = 0x9000000, 0x1000000
    a = CachingAllocator()
    a.malloc(1, 12 * MiB, address=high)
    a.malloc(2, 12 * MiB, address=low)  # block 1 is taken: a second segment, below the first
    a.free(1)
    a.free(2)
    a.malloc(3, 12 * MiB)
    assert (a.address(3), a.reserved) == (low, 24 * MiB)
    unplaced = CachingAllocator()
    for handle in (1, 2):
        unplaced.malloc(handle, 12 * MiB)
    first = unplaced.address(1)
    unplaced.free(2)
    unplaced.free(1)
    unplaced.malloc(3, 12 * MiB)
    assert unplaced.address(3) == first


def _fragmenting(a: CachingAllocator) -> None:
    """60 MiB made and freed, then 20 and 30 MiB split off it, and the 20 freed: 30 MiB allocated,
    20 and 10 MiB free on either side of it, 60 reserved."""
    a.malloc("x", 60 * MiB)
    a.free("x")
    a.malloc("y", 20 * MiB)
    a.malloc("z", 30 * MiB)
    a.free("y")


def test_fragmentation_alone_runs_fixed_segments_out_of_memory_where_expandable_ones_fit():
    """Under an 80 MiB cap, 40 MiB asked with 30 allocated: no free block holds it, and the
    segment it would take (40 more) is over the cap; the 60 MiB segment is split, so freeing the
    cache releases nothing. With expandable segments the same requests map 20 MiB pages: freeing
    the cache unmaps the free page at the head, and the pages the request needs are mapped after
    the 10 MiB free at the end, which it grows from."""
    fixed = CachingAllocator(capacity=80 * MiB)
    _fragmenting(fixed)
    with pytest.raises(OutOfMemory):
        fixed.malloc("w", 40 * MiB)
    assert (fixed.allocated, fixed.reserved, fixed.retries) == (30 * MiB, 60 * MiB, 1)
    grown = CachingAllocator(capacity=80 * MiB, expandable=True)
    _fragmenting(grown)
    grown.malloc("w", 40 * MiB)
    assert (grown.allocated, grown.reserved, grown.retries) == (70 * MiB, 80 * MiB, 1)
    assert grown.address("w") - grown.address("z") == 30 * MiB  # right after z: from its free 10


def test_an_expandable_segment_maps_whole_pages_2_mib_small_and_20_mib_large_and_splits_any_rest():
    a = CachingAllocator(expandable=True)
    a.malloc(1, 512)
    a.malloc(2, 5 * MiB)
    assert (a.reserved, len(a.segments)) == (22 * MiB, 2)
    a.malloc(3, 15 * MiB - 512)  # 512 bytes left in the page: split off, where a segment keeps it
    a.malloc(4, 512 + 2 * MiB)  # past the page: 20 MiB more mapped, one block across the two
    assert (a.reserved, a.allocated) == (42 * MiB, 22 * MiB + 512)
    assert a.address(4) - a.address(3) == 15 * MiB - 512
    assert Conf.parse("expandable_segments:True").expandable
    assert not Conf.parse("expandable_segments:False,max_split_size_mb:64").expandable


def test_emptying_the_cache_unmaps_the_whole_free_pages_anywhere_in_an_expandable_segment():
    """Three 20 MiB blocks, the middle one freed: its page is unmapped (reserved falls by it) and
    the segment kept; once all are freed the segment is released."""
    a = CachingAllocator(expandable=True)
    for handle in range(3):
        a.malloc(handle, 20 * MiB)
    a.free(1)
    a.empty_cache()
    assert (a.reserved, len(a.segments)) == (40 * MiB, 1)
    a.malloc(3, 20 * MiB)  # the hole is mapped again, not the end
    assert (a.address(3) - a.address(0), a.reserved) == (20 * MiB, 60 * MiB)
    for handle in (0, 2, 3):
        a.free(handle)
    a.empty_cache()
    assert (a.reserved, a.segments) == (0, {})
