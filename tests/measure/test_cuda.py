"""CUDA paths: skipped without a GPU, run whenever one is at hand."""

import pytest
import torch

from bench.launch import Device
from bench.measure.allocator import cublas_workspaces
from bench.measure.memory import cuda_peaks, tracked_step
from bench.measure.timing import time_steps
from tests.conftest import build_trainer
from tests.helpers import isolated, spec, tech

pytestmark = pytest.mark.cuda
GPU = torch.device("cuda")


def test_tracked_peak_agrees_with_the_allocator_within_ten_percent():
    """The allocator's active peak holds the tensors and what cuBLAS keeps, which no tracker sees:
    its workspaces, 66 MiB on a Hopper card (H100, 2026-11-26: 100.5 MiB active, 30.7 MiB of it
    tensors)."""
    trainer, batch = build_trainer(spec("vit-tiny", batch_size=64, image_size=64), GPU)
    trainer.step(batch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    figures = tracked_step(lambda: trainer.step(batch), trainer.model, trainer.optimizer, GPU)
    active = cuda_peaks(GPU).peak_active_bytes
    workspaces = sum(cublas_workspaces(torch.cuda.get_device_capability() == (9, 0), training=True))
    assert figures.peak_tensor_bytes + workspaces == pytest.approx(active, rel=0.10)


def test_cuda_event_timing_returns_one_positive_time_per_step():
    x = torch.randn(512, 512, device=GPU)
    times = time_steps(lambda: x @ x, 4, GPU)
    assert len(times) == 4 and all(t > 0 for t in times)


def test_isolated_cuda_run_records_allocator_figures_and_bf16_autocast():
    record = isolated(
        spec("vit-tiny", (tech("amp", dtype="bfloat16"),), batch_size=32, image_size=64),
        Device("cuda", torch.cuda.get_device_name(0)),
    )
    assert record["status"] == "ok", record
    assert (
        record["peak_allocated_bytes"] > 0
        and record["peak_reserved_bytes"] >= record["peak_allocated_bytes"]
    )
    assert record["proof"]["output_dtype"] == "torch.bfloat16"
    assert record["cuda_version"] and record["tf32_matmul"] in (True, False)
    # what --card's memory is held to (bench/predict/cards.py)
    assert record["device_memory_bytes"] == torch.cuda.get_device_properties(0).total_memory


def test_fp16_with_grad_scaler_runs_on_cuda():
    record = isolated(
        spec("vit-tiny", (tech("amp", dtype="float16"),), batch_size=16, image_size=32),
        Device("cuda", torch.cuda.get_device_name(0)),
    )
    assert record["status"] == "ok", record
    assert record["proof"]["amp.grad_scaler"] is True


def test_out_of_memory_on_cuda_is_recorded_as_oom():
    record = isolated(
        spec(techniques=(tech("tests.helpers:AllocateTooMuch"),)),
        Device("cuda", torch.cuda.get_device_name(0)),
    )
    assert record["status"] == "oom", record
    # the allocator's reason, kept beside its peaks (the H200's first OOM records had lost it)
    assert "CUDA out of memory" in record["message"]


def test_fp8_converts_linear_layers_on_hopper():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    record = isolated(
        spec("bert-tiny", (tech("fp8"),), batch_size=16, seq_len=64),
        Device("cuda", torch.cuda.get_device_name(0)),
    )
    assert record["status"] in ("ok", "unsupported"), record  # unsupported: no torchao on the host
    if record["status"] == "ok":
        assert record["proof"]["fp8.float8_linears"] > 0


def test_offload_moves_saved_tensors_to_the_host():
    record = isolated(
        spec("vit-tiny", (tech("offload"),), batch_size=32, image_size=64),
        Device("cuda", torch.cuda.get_device_name(0)),
    )
    assert record["status"] == "ok", record
    assert record["proof"]["offload.tensors_offloaded_per_step"] > 0
    # What forward leaves on the device (the logits) and backward's peak, as bench predict counts
    # them
    assert record["activation_bytes"] == record["predicted_activation_bytes"]
    assert record["peak_tensor_bytes"] == record["predicted_peak_tensor_bytes"]


@pytest.mark.parametrize(
    "offload",
    [
        tech("offload"),
        tech("offload", pin_memory=False),
        tech("activation-offload"),
        tech("cpu-offload-optimizer"),
    ],
    ids=["save-on-cpu-pinned", "save-on-cpu-pageable", "activation-offload", "optimizer"],
)
def test_the_host_memory_an_offloading_step_holds_is_the_predicted(offload):
    """The tracker's host tally of the real step (CPU tensors in a CUDA step, pinned ones as the
    caching host allocator rounds and caches them) is the prediction's, and the allocator's own
    count of what it holds pinned agrees with both."""
    record = isolated(
        spec("vit-tiny", (offload,), batch_size=32, image_size=64),
        Device("cuda", torch.cuda.get_device_name(0)),
    )
    if record["status"] == "unsupported":  # torchao missing
        pytest.skip(record["message"])
    assert record["status"] == "ok", record
    assert record["host_peak_bytes"] == record["predicted_host_peak_bytes"]
    assert record["host_pinned_bytes"] == record["predicted_host_pinned_bytes"]
    assert record["pinned_host_bytes"] == record["host_pinned_bytes"]


def test_autocast_is_predicted_by_cudas_op_lists():
    """ConvNeXt's layer norms take bf16 convolution outputs, which CUDA's autocast runs in float32
    (CPU's would not): what forward keeps is predicted to the byte."""
    record = isolated(
        spec("tests.helpers:CONVNEXT", (tech("amp"),), batch_size=8, image_size=64),
        Device("cuda", torch.cuda.get_device_name(0)),
    )
    assert record["status"] == "ok", record
    assert record["activation_bytes"] == record["predicted_activation_bytes"]


def test_inference_run_on_cuda_in_half_precision_with_inference_mode():
    techniques = (tech("half", dtype="float16"), tech("inference-mode"))
    record = isolated(
        spec("vit-tiny", techniques, batch_size=64, image_size=64, mode="inference"),
        Device("cuda", torch.cuda.get_device_name(0)),
    )
    assert record["status"] == "ok", record
    assert (
        record["proof"]["output_dtype"] == "torch.float16"
        and record["proof"]["inference_tensors"] is True
    )
    assert (
        record["optimizer_state_bytes"] == 0
        and record["peak_allocated_bytes"] > record["param_bytes"]
    )


def test_expandable_segments_reach_the_run_process():
    record = isolated(
        spec("vit-tiny", (tech("allocator", conf="expandable_segments:True"),), batch_size=16),
        Device("cuda", torch.cuda.get_device_name(0)),
    )
    assert record["status"] == "ok", record
    assert record["allocator_conf"] == "expandable_segments:True"


def test_snapshot_of_the_instrumented_step_is_saved_for_memory_viz(tmp_path):
    import pickle

    path = tmp_path / "run.snapshot.pickle"
    device = Device("cuda", torch.cuda.get_device_name(0))
    record = isolated(spec("vit-tiny", batch_size=16), device, snapshot=path)
    assert record["status"] == "ok", record
    assert record["snapshot"] == path.name and pickle.loads(path.read_bytes())["segments"]


FRAGMENTING = """
import os, torch
MiB = 1 << 20
# 90 MiB left to the run, the rest held by a segment of its own (fixed, whatever the run's setting)
torch.cuda.memory._set_allocator_settings("expandable_segments:False")
free, _ = torch.cuda.mem_get_info()
blocker = torch.empty((free - 90 * MiB) // (2 * MiB) * 2 * MiB, dtype=torch.uint8, device="cuda")
torch.cuda.memory._set_allocator_settings(os.environ["PYTORCH_CUDA_ALLOC_CONF"])
x = torch.empty(60 * MiB, dtype=torch.uint8, device="cuda")
del x
y = torch.empty(20 * MiB, dtype=torch.uint8, device="cuda")
z = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
del y
try:
    w = torch.empty(40 * MiB, dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError:
    print("out of memory")
else:
    print("fits")
"""


@pytest.mark.parametrize(
    "conf, expected",
    [("expandable_segments:False", "out of memory"), ("expandable_segments:True", "fits")],
)
def test_fragmentation_alone_runs_out_of_memory_as_the_simulator_says(conf, expected, tmp_path):
    """tests/measure/test_allocator.py's hand-worked case on the card, in a fresh process with
    90 MiB left to it: 60 MiB freed, 20 and 30 split off it, the 20 freed, then 40 asked. Fixed
    segments would need 100 MiB and cannot release the split one; expandable segments unmap its
    free page and map the 40 after the 30."""
    import os
    import subprocess
    import sys

    from bench.measure.allocator import CachingAllocator, Conf, OutOfMemory

    env = os.environ | {"PYTORCH_CUDA_ALLOC_CONF": conf}
    done = subprocess.run(
        [sys.executable, "-c", FRAGMENTING], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected
    simulated = CachingAllocator(capacity=90 * 2**20, expandable=Conf.parse(conf).expandable)
    for name, mib in (("x", 60), ("y", 20), ("z", 30)):
        simulated.malloc(name, mib * 2**20)
        if name == "x":
            simulated.free("x")
    simulated.free("y")
    try:
        simulated.malloc("w", 40 * 2**20)
    except OutOfMemory:
        said = "out of memory"
    else:
        said = "fits"
    assert said == expected


# bert-tiny over a long-tailed pass on the card, in a process of its own: the first batch as the
# warm-up, then every batch of the pass, what the allocator holds printed after each step
PASS = """
import json, sys, torch
from bench.recipe import Recipe
from tests.helpers import spec, tech
run = spec("bert-tiny", (tech("dynamic-padding"),), **json.loads(sys.argv[1]))
recipe = Recipe.of(run, torch.device("cuda"), run.gpu)
trainer, feed = recipe.stepper(recipe.model()[0]), recipe.feed()
trainer.step(next(feed.batches(1)))
held = []
for batch in feed.batches(len(feed.epoch())):
    trainer.step(batch)
    held.append(torch.cuda.memory_reserved())
print(json.dumps(held))
"""


def test_a_passs_reserve_after_each_step_is_the_one_epoch_predicts():
    """Issue 67's drift, held on the card: a pass over long-tailed lengths run step by step in a
    fresh process (the first batch first, as the prediction's warm-up), and what the caching
    allocator holds after each step equal to ``--epoch``'s ``epoch_reserved_bytes``, predicted on
    fake tensors for this card (its cuBLAS workspaces, no cap)."""
    import json
    import os
    import subprocess
    import sys
    from dataclasses import replace

    from bench.predict.cards import Card
    from bench.predict.fake import traced

    shapes = {"batch_size": 64, "seq_len": 512, "lengths": "lognormal:18:1.27:512"}
    run = spec("bert-tiny", (tech("dynamic-padding"),), **shapes)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    memory = torch.cuda.mem_get_info()[1]
    card = Card(name="this card", memory=memory, memory_source="test", hopper=hopper, context=0)
    predicted = traced(replace(run, gpu=replace(run.gpu, epoch=True)), card=card).prediction
    done = subprocess.run(
        [sys.executable, "-c", PASS, json.dumps(shapes)],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ | {"PYTHONPATH": "."},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(measured) == predicted.epoch_steps > 4
    # it drifts (an H100, predicted: 286 MiB after the first step, 398 after the last)
    assert predicted.epoch_reserved_bytes[-1] > predicted.epoch_reserved_bytes[0]
    assert predicted.epoch_reserved_bytes == measured


def test_a_measured_pass_on_variable_length_data_records_the_reserve_after_each_step():
    record = isolated(
        spec(
            "bert-tiny",
            (tech("dynamic-padding"),),
            batch_size=8,
            seq_len=64,
            lengths="lognormal:18:1.27:64",
            measure_steps=4,
        ),
        Device("cuda", torch.cuda.get_device_name(0)),
    )
    held = record["step_reserved_bytes"]
    assert len(held) == 4 and max(held) <= record["peak_reserved_bytes"]
