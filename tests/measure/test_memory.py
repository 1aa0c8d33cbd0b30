"""A tracked pass replayed through the caching allocator under a card (bench.measure.memory): the
step whose request the card cannot hold, and what expandable segments would do; and the resident
memory a block grows by, which a CPU run's record sets beside its tracked peak."""

import os

import pytest
import torch

from bench.measure.allocator import Conf, Replay
from bench.measure.memory import replayed, resident_growth, rss_peak_bytes
from bench.measure.tracker import FREED, MADE, MARK, LiveBytes, Moment

MiB = 1 << 20


def _pass(*steps: tuple[tuple[str, str, int], ...]) -> LiveBytes:
    """A tracker that saw ``steps``, each a run of (made or freed, name, MiB), a mark after each."""
    moments, made = [], {}
    for step in steps:
        for kind, name, mib in step:
            if kind == MADE:
                made[name] = len(made)
            moments.append(Moment(kind, mib * MiB, name, made[name], raw=mib * MiB))
        moments.append(Moment(MARK, 0, ""))
    return LiveBytes.rebuilt(torch.device("cpu"), moments)


# 60 MiB made and freed; then 20 and 30 split off it and the 20 freed, the 30 kept into the next
# step; then 40 asked: 30 allocated, 60 reserved, and no free block of 40
X = ((MADE, "x", 60), (FREED, "x", 60))
YZ = ((MADE, "y", 20), (MADE, "z", 30), (FREED, "y", 20))
W = ((MADE, "w", 40), (FREED, "w", 40), (FREED, "z", 30))


def test_a_pass_runs_out_of_memory_at_the_step_fragmentation_fails_and_expandable_segments_fit():
    """Under an 80 MiB cap the third step's 40 MiB needs a segment of its own, over the cap, and the
    split 60 MiB segment cannot be released: out of memory at step 3 of 3. Expandable segments
    unmap the free page and grow the free end into it: the same pass fits (after a flush). The same
    steps in another order (the 40 MiB before the split) fit either way."""
    card = Replay(capacity=80 * MiB, epoch=True)
    out = replayed(_pass(X, YZ, W), card)
    assert (out.verdict, out.oom_step, out.epoch_steps) == ("out of memory", 3, 3)
    assert (out.oom_request_bytes, out.oom_reserved_bytes) == (40 * MiB, 60 * MiB)
    assert out.epoch_reserved_bytes == [60 * MiB, 60 * MiB]  # the steps before the third
    # at each one's peak: none free beside x, then the 10 MiB after z
    assert out.epoch_largest_free_bytes == [0, 10 * MiB]
    assert out.expandable_verdict == "fits after flushes"
    # every block here is under 64 MiB: a limit on which blocks split changes nothing
    assert out.split_verdict == "out of memory with max_split_size_mb at 512, 256, 128, 64 too"
    grown = replayed(_pass(X, YZ, W), Replay(capacity=80 * MiB, conf=Conf(expandable=True)))
    assert (grown.verdict, grown.expandable_verdict) == ("fits after flushes", None)
    reordered = replayed(_pass(X, (*W[:2],), (*YZ, (FREED, "z", 30))), card)
    assert (reordered.verdict, reordered.epoch_steps, reordered.expandable_verdict) == (
        "fits",
        3,
        None,
    )
    # every request split off the one 60 MiB segment: reserved stays 60 MiB
    assert reordered.epoch_reserved_bytes == [60 * MiB, 60 * MiB, 60 * MiB]
    assert reordered.epoch_largest_free_bytes == [0, 20 * MiB, 10 * MiB]


def test_a_step_that_fits_says_nothing_of_expandable_segments_and_a_lone_step_names_no_step():
    out = replayed(_pass(X), Replay(capacity=80 * MiB))
    assert (out.verdict, out.oom_step, out.epoch_steps, out.expandable_verdict) == (
        "fits",
        None,
        None,
        None,
    )


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="Linux's clear_refs")
def test_resident_growth_is_the_high_water_mark_over_the_block_freed_or_not():
    """A 256 MiB tensor made, written and freed inside the block: glibc maps it on its own (past its
    largest mmap threshold, 32 MiB) and hands it back when freed, and the block's growth is its
    pages all the same, as the high-water mark reset at the block's start saw them (within what
    else the process frees or makes meanwhile: its garbage collector, a test worker's threads)."""
    with resident_growth() as grown:
        held = torch.ones(64 * 2**20)
        del held
    assert grown[0] == pytest.approx(256 * 2**20, rel=0.05)


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="Linux's clear_refs")
def test_the_process_peak_outlives_the_reset_resident_growth_makes():
    """The run's rss_peak_bytes is its process's peak over its life: a block that resets Linux's
    high-water mark to measure itself does not take the peak before it away."""
    held = torch.ones(64 * 2**20)  # 256 MiB, written
    del held
    before = rss_peak_bytes()
    with resident_growth():
        pass
    assert rss_peak_bytes() >= before
