"""The worker's CUDA branch, on a CPU: the step runs here while the allocator's and NVML's figures
are stood in for, so that the record a GPU run assembles is held before a GPU is lent."""

import dataclasses

import torch

from bench import worker
from bench.measure.timing import time_steps
from bench.recipe import Recipe
from bench.record import MEMORY_SUMMARY, Memory
from tests.helpers import spec

CPU = torch.device("cpu")


def timed_pass_on_cuda(monkeypatch, nvml: int, reserved_now: int):
    """The worker's CUDA timed pass over vit-tiny here, the allocator's peaks (700 allocated, 1000
    reserved), NVML's reading and what is reserved as it reads stood in for."""
    recipe = Recipe.of(spec("vit-tiny", batch_size=4), CPU)
    trainer, batch = recipe.stepper(recipe.model()[0]), recipe.batch()
    peaks = Memory(peak_allocated_bytes=700, peak_reserved_bytes=1000, alloc_retries=0, cuda_ooms=0)
    for name in ("synchronize", "reset_peak_memory_stats", "reset_accumulated_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_summary", lambda *a: "the allocator's summary")
    monkeypatch.setattr(worker, "cuda_peaks", lambda device: dataclasses.replace(peaks))
    monkeypatch.setattr(worker, "nvml_process_bytes", lambda device: nvml)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved_now)
    monkeypatch.setattr(worker, "time_steps", lambda step, n, device: time_steps(step, n, CPU))
    ctx = dataclasses.replace(recipe.ctx, device=torch.device("cuda"))
    return worker._timed_pass(trainer, batch, feed=None, samples=4, ctx=ctx)


def test_a_cuda_runs_timed_pass_gathers_the_allocators_figures_and_its_summary(monkeypatch):
    record = timed_pass_on_cuda(monkeypatch, nvml=1500, reserved_now=1000)
    assert record.memory.peak_reserved_bytes == 1000 and record.memory.nvml_process_bytes == 1500
    assert (record.memory.cache_slack_bytes, record.memory.context_bytes) == (300, 500)
    assert record.extra[MEMORY_SUMMARY] == "the allocator's summary"
    # a CUDA run's timing has no CPU share, and every figure of its timed steps
    assert record.timing.cpu_share is None and len(record.timing.step_times_ms) == 2
    flat = record.to_flat()
    assert flat["peak_allocated_bytes"] == 700 and flat[MEMORY_SUMMARY] == "the allocator's summary"


def test_nvidia_smis_figure_is_the_process_at_its_peak_when_the_cache_was_emptied(monkeypatch):
    """empty-cache releases the cache after every step, so NVML, read after the timed steps, sees
    the context and what is still reserved (the H100's resnet/empty-cache: 1.32 GiB, against a
    13.0 GiB reserved peak): the context is what it counts beyond that, and the process at its peak
    the context beside the reserved peak."""
    memory = timed_pass_on_cuda(monkeypatch, nvml=800, reserved_now=300).memory  # 500 context
    assert (memory.nvml_process_bytes, memory.context_bytes) == (1500, 500)


def test_a_cuda_out_of_memory_keeps_its_reason_beside_the_allocators_peaks(monkeypatch):
    """The H200's llama/baseline of 2026-11-28 was stored with an empty message: the peaks, merged
    after the outcome, brought their record's default one over the allocator's reason (a message
    is now absent unless said, as every other figure)."""
    peaks = Memory(peak_allocated_bytes=700, peak_reserved_bytes=1000)
    monkeypatch.setattr(worker, "cuda_peaks", lambda device: dataclasses.replace(peaks))
    monkeypatch.setattr(worker, "_history_to_failure", lambda path: "baseline.history.pickle.gz")
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB.\nmore")
    record = worker._failed(exc, None, torch.device("cuda"), "baseline.history.pickle.gz")
    reason = "OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB."
    assert record.outcome.message == reason
    assert (record.outcome.status, record.memory.peak_reserved_bytes) == ("oom", 1000)
    assert record.memory.memory_history == "baseline.history.pickle.gz"
