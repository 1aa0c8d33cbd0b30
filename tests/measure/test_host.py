import torch

from bench.measure.host import making_host, on_host, pinned_block
from bench.measure.tracker import LiveBytes

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # a tracker of the device it stands for: CPU tensors are its host's


def test_a_pinned_block_is_the_next_power_of_two():
    assert [pinned_block(n) for n in (1, 512, 513, 5000, 2**20, 2**20 + 1)] == [
        1,
        512,
        1024,
        8192,
        2**20,
        2**21,
    ]


def test_pinned_blocks_are_cached_for_a_request_of_their_own_size_and_never_given_back():
    """The caching host allocator serves a request from a free block of exactly its rounded size,
    else pins a new one; a freed block stays held."""
    tracker = LiveBytes(CPU)
    with tracker:
        with making_host(pinned=True):
            a = torch.empty(5000, dtype=torch.uint8)  # an 8 KiB block
            b = torch.empty(3000, dtype=torch.uint8)  # a 4 KiB block
        del a
        with making_host(pinned=True):
            c = torch.empty(6000, dtype=torch.uint8)  # a's block, cached
            d = torch.empty(2000, dtype=torch.uint8)  # 2 KiB: a block of its own
    assert (tracker.host.pinned, tracker.host.peak) == (8192 + 4096 + 2048,) * 2
    del b, c, d
    assert tracker.host.current == tracker.host.pinned
    assert tracker.current == tracker.peak == 0  # none of it the device's


def test_pageable_host_memory_is_its_bytes_while_alive():
    tracker = LiveBytes(CPU)
    with tracker:
        with making_host(pinned=False):
            a = torch.empty(5000, dtype=torch.uint8)
            b = torch.empty(3000, dtype=torch.uint8)
        del a
        with making_host(pinned=False):
            c = torch.empty(1000, dtype=torch.uint8)
    assert (tracker.host.peak, tracker.host.current, tracker.host.pinned) == (8000, 4000, 0)
    del b, c
    assert tracker.host.current == 0


def test_a_cpu_tensor_in_a_cuda_step_is_the_hosts_and_a_marked_one_in_a_prediction():
    """On CUDA the host is the CPU (its pinned tensors said by is_pinned); in a prediction, whose
    fake CPU tensors stand for CUDA's, a tensor marked on_host is the host's."""
    on_cuda = LiveBytes(CUDA)
    on_cuda.add([torch.zeros(1000), torch.zeros(())], "optimizer_state")
    assert (on_cuda.current, on_cuda.host.peak, on_cuda.host.pinned) == (0, 4004, 0)
    predicted = LiveBytes(CPU)
    kept = [torch.zeros(1000), on_host(torch.zeros(3000), pinned=True), on_host(torch.zeros(()))]
    predicted.add(kept, "optimizer_state")
    assert (predicted.current, predicted.host.peak, predicted.host.pinned) == (4000, 16388, 16384)


def test_a_step_with_nothing_on_the_host_says_nothing_of_it():
    tracker = LiveBytes(CPU)
    with tracker:
        x = torch.ones(100) * 2
    assert not tracker.host.seen and tracker.peak == 800  # the ones, then their double
    del x


def test_a_paged_moment_made_inside_a_tracked_step_is_never_the_devices():
    """bitsandbytes' paged state, made in the step that first steps the optimizer (the replayed
    step before the measured one): counted neither as the device allocator's, which never holds it,
    nor as the host's, though the tracker sees it made before its mark is set."""
    from types import SimpleNamespace

    from bench.measure.host import is_unified
    from bench.predict.stand_ins import PAGED_FROM, paged_buffer

    paged, plain = SimpleNamespace(is_paged=True), SimpleNamespace(is_paged=False)
    large, under = torch.empty(PAGED_FROM), torch.empty(PAGED_FROM - 1)
    tracker = LiveBytes(CPU)
    with tracker:
        moment = paged_buffer(paged, large, torch.uint8)
        small = paged_buffer(paged, under, torch.uint8)
        kept = paged_buffer(plain, large, torch.uint8)
    assert is_unified(moment) and not is_unified(small) and not is_unified(kept)
    assert tracker.peak == tracker.current == PAGED_FROM - 1 + PAGED_FROM  # small's and kept's
    assert tracker.host.peak == 0
