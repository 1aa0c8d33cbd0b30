"""The allocator's recorded history, replayed through the simulator: the segments it reserves must be the
card's. On a CPU, a hand-made trace in the form CUDA writes; on a GPU, a step's own."""

import gzip
import pickle

import pytest
import torch

from bench.measure import history

MiB = 1 << 20


def _trace(*entries):
    return {"segments": [], "device_traces": [[dict(zip(("action", "addr", "size"), e)) for e in entries]]}


def test_a_trace_replays_block_by_block_and_its_segments_are_summed_beside():
    """What the card does for 1 MiB, then 5 MiB, then 12 MiB once the 5 MiB block is freed: a 2 MiB small
    segment, a 20 MiB large one, and no third: the 12 MiB request is split off the freed 20 MiB block."""
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
    assert (out.simulated_peak_reserved, out.recorded_peak_reserved, out.allocations) == (
        22 * MiB,
        22 * MiB,
        3,
    )


def test_a_saved_history_reads_back_as_it_was(tmp_path):
    path = tmp_path / "run.history.pickle.gz"
    trace = _trace(("segment_alloc", 1, 2 * MiB), ("alloc", 1, 512))
    with gzip.open(path, "wb") as f:
        pickle.dump(trace, f)
    assert history.read(path) == trace


@pytest.mark.cuda
def test_a_training_steps_recorded_history_replays_to_the_segments_the_card_reserved(tmp_path):
    """From an empty allocator: a ViT's build and two steps, each block the card allocated replayed."""
    from tests.conftest import build_trainer
    from tests.helpers import spec

    torch.cuda.empty_cache()
    history.start(stacks=False)
    trainer, batch = build_trainer(spec("vit-tiny", batch_size=64, image_size=64), torch.device("cuda"))
    for _ in range(2):
        trainer.step(batch)
    torch.cuda.synchronize()
    history.save(tmp_path / "h.pickle.gz")
    out = history.replay(history.read(tmp_path / "h.pickle.gz"))
    assert out.allocations > 100
    assert out.simulated_peak_reserved == out.recorded_peak_reserved
