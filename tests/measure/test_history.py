"""The allocator's recorded history, replayed through the simulator: the segments it reserves must
be the card's. On a CPU, a hand-made trace in the form CUDA writes; on a GPU, a step's own."""

import gzip
import pickle
from pathlib import Path

import pytest

from bench.measure import history

MiB = 1 << 20
RECORDED = Path(__file__).resolve().parents[2].glob("results/*/*/*.history.pickle.gz")


def _trace(*entries):
    return {
        "segments": [],
        "device_traces": [[dict(zip(("action", "addr", "size"), e)) for e in entries]],
    }


def test_a_trace_replays_block_by_block_and_its_segments_are_summed_beside():
    """What the card does for 1 MiB, then 5 MiB, then 12 MiB once the 5 MiB block is freed: a 2 MiB
    small segment, a 20 MiB large one, and no third: the 12 MiB request is split off the freed 20
    MiB block."""
    trace = _trace(
        ("segment_alloc", 0x1000000, 2 * MiB),
        ("alloc", 0x1000000, 1 * MiB),
        ("segment_alloc", 0x2000000, 20 * MiB),
        ("alloc", 0x2000000, 5 * MiB),
        ("free_requested", 0x2000000, 5 * MiB),
        ("free_completed", 0x2000000, 5 * MiB),
        ("alloc", 0x2000000, 12 * MiB),
    )
    out = history.replay(trace)
    assert (
        out.simulated_peak_reserved,
        out.recorded_peak_reserved,
        out.allocations,
        out.misplaced,
    ) == (
        22 * MiB,
        22 * MiB,
        3,
        0,
    )


def test_a_tie_between_free_blocks_goes_to_the_address_the_driver_gave_the_segment():
    """Two 12 MiB segments, the second placed below the first: once both are free, the card takes
    the lower one. The replay places each segment where the trace says, so it takes the same
    block."""
    trace = _trace(
        ("segment_alloc", 0x9000000, 12 * MiB),
        ("alloc", 0x9000000, 12 * MiB),
        ("segment_alloc", 0x1000000, 12 * MiB),
        ("alloc", 0x1000000, 12 * MiB),
        ("free_completed", 0x9000000, 12 * MiB),
        ("free_completed", 0x1000000, 12 * MiB),
        ("alloc", 0x1000000, 12 * MiB),
        ("alloc", 0x9000000, 12 * MiB),
    )
    assert history.replay(trace).misplaced == 0
    swapped = trace["device_traces"][0]
    # a card that took the higher one would not be this allocator
    swapped[-2:] = [
        swapped[-1],
        swapped[-2],
    ]
    assert history.replay(trace).misplaced == 2


def test_segments_released_together_are_the_cache_emptied_and_the_next_request_reserves_anew():
    """cuDNN's benchmark empties the cache after each search: the card releases every wholly free
    segment (here the 20 MiB one; the 2 MiB one still holds a block) and reserves a new segment
    for the next request. A replay that kept the freed block cached would place that request in
    it."""
    trace = _trace(
        ("segment_alloc", 0x1000000, 2 * MiB),
        ("alloc", 0x1000000, 1 * MiB),
        ("segment_alloc", 0x2000000, 20 * MiB),
        ("alloc", 0x2000000, 5 * MiB),
        ("free_requested", 0x2000000, 5 * MiB),
        ("free_completed", 0x2000000, 5 * MiB),
        ("segment_free", 0x2000000, 20 * MiB),
        ("segment_alloc", 0x5000000, 20 * MiB),
        ("alloc", 0x5000000, 5 * MiB),
    )
    out = history.replay(trace)
    assert (out.misplaced, out.simulated_peak_reserved) == (0, out.recorded_peak_reserved)


@pytest.mark.parametrize(
    "path", sorted(RECORDED), ids=lambda p: f"{p.parent.parent.name}/{p.name.split('.')[0]}"
)
def test_every_committed_gpu_trace_replays_to_the_card_block_by_block(path):
    """The histories the cards recorded (results/<suite>/<card>/<run>.history.pickle.gz), from the
    build to the instrumented step or the request refused: every block where the card put it, so
    the same reserved peak (an out-of-memory as Llama-1B's first backward begins holds 981).
    cuDNN's benchmark empties the cache after each search (ResNet-50's warm-up: 181 segments
    released), which the replay follows. A run with expandable segments maps pages into a segment
    a pool that grows, and unmaps the free ones when the cache is emptied (ResNet-50's
    expandable-segments: 4,145 blocks, 328 maps, 116 unmaps)."""
    out = history.replay(history.read(path))
    assert out.allocations > 500
    assert (out.misplaced, out.simulated_peak_reserved) == (0, out.recorded_peak_reserved)


def test_a_saved_history_reads_back_as_it_was(tmp_path):
    path = tmp_path / "run.history.pickle.gz"
    trace = _trace(("segment_alloc", 1, 2 * MiB), ("alloc", 1, 512))
    with gzip.open(path, "wb") as f:
        pickle.dump(trace, f)
    assert history.read(path) == trace


@pytest.mark.cuda
def test_a_cuda_runs_recorded_history_replays_to_the_card_block_by_block(tmp_path):
    """A run as the campaign makes it, in its own process, so the allocator starts empty (in
    pytest's process other tests' segments would be there already, unknown to the trace): a ViT's
    build and steps, every block where the card put it."""
    from bench.launch import detect
    from tests.helpers import isolated, spec

    path = tmp_path / "run.history.pickle.gz"
    record = isolated(spec("vit-tiny", batch_size=64, image_size=64), detect("cuda"), history=path)
    assert record["status"] == "ok", record
    out = history.replay(history.read(path))
    assert out.allocations > 100
    assert (out.misplaced, out.simulated_peak_reserved) == (0, out.recorded_peak_reserved)
