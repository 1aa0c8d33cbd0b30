"""DeepSpeed's engine at its ZeRO stages: run for real over 2 gloo processes on this CPU (its CPU
accelerator), each rank's step predicted beforehand on fake tensors under torch's fake process group
and held to the peak it then measures; and the model states a rank holds at 8 ranks, held to
DeepSpeed's own arithmetic (its estimate_zero2_model_states_mem_needs)."""

from __future__ import annotations

import math

import pytest
import torch

from bench.launch import Device
from bench.measure.host import pinned_block
from bench.measure.memory import RESIDENT_EXACT
from bench.models import MODELS
from bench.predict import predict
from bench.spec import Shapes
from tests.helpers import isolated, spec, tech
from tests.test_process_group import assert_predicted_per_rank

deepspeed = pytest.importorskip("deepspeed")

CPU = Device("cpu", "cpu")
BERT_TINY = MODELS.get("bert-tiny").build(Shapes(batch_size=8, seq_len=16))
PSI = sum(p.numel() for p in BERT_TINY.parameters())
# the Trainer's "auto" buckets, from bert-tiny's hidden size
AUTO = "reduce_bucket_size,stage3_prefetch_bucket_size,stage3_param_persistence_threshold"
# a real run's limit: DeepSpeed compiles its Adam kernels at first use (a minute each on a quiet
# machine, inside the engine's making), and parallel test workers share two cores
STARTING = 600.0


@pytest.mark.full
def test_zero_3_over_two_gloo_processes_is_each_ranks_predicted_peak():
    """Each rank predicts its own step (its partitions, its gathers, its reduce buckets) before it
    joins the real group, and the peak it then measures is the predicted one: to the byte in most
    runs, a reduce bucket (16 KiB here) over where one is still in flight at the peak, as under
    fsdp (tests/test_process_group.py: one run of three on a loaded machine). Its parameters are
    half the model's, but for those small enough to stay whole on every rank."""
    run = spec("bert-tiny", (tech("deepspeed", stage=3, auto=AUTO),), nproc=2, timeout_s=STARTING)
    record = isolated(run, CPU)
    assert record["status"] == "ok", record.get("stderr_tail", record)
    assert_predicted_per_rank(record)
    assert record["proof"]["deepspeed.zero_stage"] == 3
    assert 0.5 < record["proof"]["deepspeed.param_fraction_per_rank"] < 0.53


@pytest.mark.parametrize(
    "stage, precision", [(1, "float16"), (2, "bfloat16"), (3, "bfloat16"), (3, "float16")]
)
def test_a_ranks_model_states_are_deepspeeds_own_arithmetic(stage, precision):
    """ZeRO in 16 bits over 8 ranks, predicted (float16 as on CUDA, which DeepSpeed's CPU
    accelerator would refuse): each rank holds the 16-bit parameters (whole at stages 1 and 2, its
    partition at 3, none persisting whole) and its float32 master partition with Adam's two
    moments, 12·Ψ/8. DeepSpeed's estimate for stage 2 is those with its gradient terms (16-bit and
    float32 partitions, 6·Ψ/8) beside them. A partition is padded to whole elements per rank."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    options = {"stage": stage, "precision": precision, "auto": "reduce_bucket_size"}
    options |= {"stage3_param_persistence_threshold": 0}
    states = predict(spec("bert-tiny", (tech("deepspeed", **options),), nproc=8))
    assert states.ok, states.message
    partition = math.ceil(PSI / 8)
    params = 2 * PSI if stage < 3 else 2 * partition
    assert states.param_bytes == pytest.approx(params, abs=16)
    # (torch's AdamW counts its steps in a float32 tensor a parameter, which CUDA keeps on the host)
    assert states.optimizer_state_bytes == 12 * partition
    if stage == 2:
        _, gpu = estimate_zero2_model_states_mem_needs(PSI, 8, cpu_offload=False)
        gradients = 6 * PSI / 8
        assert states.param_bytes + states.optimizer_state_bytes + gradients == pytest.approx(
            gpu, abs=64
        )


def test_stage_0_in_16_bits_keeps_a_whole_float32_copy_beside_adams_moments():
    """No ZeRO: DeepSpeed's fp16 optimizer keeps a float32 copy of every parameter, which torch's
    AdamW steps (its step counters on the host): 12·Ψ on every rank, as ZeRO's paper counts stage
    0."""
    states = predict(spec("bert-tiny", (tech("deepspeed", stage=0, precision="float16"),), nproc=8))
    assert states.ok, states.message
    tensors = len(list(BERT_TINY.parameters()))
    assert states.param_bytes == 2 * PSI
    assert states.optimizer_state_bytes == 12 * PSI
    assert states.host_peak_bytes == 4 * tensors


@pytest.mark.full
def test_deepspeeds_own_fused_adam_over_two_gloo_processes_is_each_ranks_predicted_peak():
    """A ds_config's AdamW section: DeepSpeed builds FusedAdam (on this CPU its CPU kernel, which it
    compiles at first use, about a minute) and keeps Adam's moments without torch's step counter;
    the prediction runs DeepSpeed's FusedAdam with its kernel's launch left out (it makes
    nothing)."""
    options = {"stage": 2, "optimizer": "AdamW", "auto": "reduce_bucket_size"}
    run = spec("bert-tiny", (tech("deepspeed", **options),), nproc=2, timeout_s=STARTING)
    record = isolated(run, CPU)
    assert record["status"] == "ok", record.get("stderr_tail", record)
    assert_predicted_per_rank(record)
    # the whole parameters, a float32 master partition and the two moments (DeepSpeed pads its flat
    # buffer to a few elements' alignment)
    for held in record["rank_model_state_bytes"]:
        assert held == pytest.approx(4 * PSI + 12 * PSI / 2, abs=64)


OFFLOAD_OPTIMIZER = {"optimizer": "AdamW", "offload_optimizer": "cpu"}
OFFLOAD_PARAM = {"offload_param": "cpu"}


@pytest.mark.full
@pytest.mark.parametrize(
    "stage, offload, held",
    [
        (2, OFFLOAD_OPTIMIZER, 16),
        (3, OFFLOAD_OPTIMIZER, 16),
        (3, OFFLOAD_PARAM, 2),
        (3, OFFLOAD_OPTIMIZER | OFFLOAD_PARAM, 18),
    ],
    ids=["2-optimizer", "3-optimizer", "3-param", "3-both"],
)
def test_zero_offload_over_two_gloo_processes_is_each_ranks_predicted_peak(stage, offload, held):
    """ZeRO-Offload on this CPU, over two micro-batches (the gradients summed in host buffers at
    stage 2): DeepSpeed's CPU Adam steps the float32 partitions where they are, and under
    ``offload_param`` ZeRO-3 gathers each module's parameters from their partitions' host buffers
    (on this CPU host and device are one memory, so the real step counts both; the prediction runs
    DeepSpeed's code on fake tensors, its CPU Adam's kernel left out, which compiles at first use,
    about a minute). ``held``: at least these bytes a parameter of a rank's partition offloaded."""
    options = {"stage": stage, "auto": AUTO} | offload
    techniques = (tech("deepspeed", **options), tech("accumulate", micro_batches=2))
    run = spec("bert-tiny", techniques, batch_size=16, nproc=2, timeout_s=STARTING)
    record = isolated(run, CPU)
    assert record["status"] == "ok", record.get("stderr_tail", record)
    assert_predicted_per_rank(record)
    assert record["proof"]["deepspeed.offloaded_bytes_per_rank"] > held * PSI / 2


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_zero_offload_keeps_deepspeeds_own_arithmetic_on_the_host_and_the_16_bit_rest_on_the_card(
    stage, pinned
):
    """ZeRO-Offload in bf16 over 8 ranks, predicted for CUDA: the card keeps the 16-bit parameters
    (whole at stage 2, a partition at 3: DeepSpeed's estimates' device terms, 2·Ψ and 2·Ψ/8) and no
    optimizer state; each rank's host keeps 18 bytes a parameter of its partition: the float32
    partition and its gradient, Adam's moments, and a 16-bit copy of the partition (stage 2's, to
    step back through) or of its gradients (stage 3's, reduced into), which DeepSpeed's estimate
    (16·Ψ a node) leaves out; stage 2 also stages a gradient the size of the largest parameter.
    Pinned, each buffer but the moments (and stage 3's float32 partition) is one power-of-two block
    of the caching host allocator."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    options = {"stage": stage, "precision": "bfloat16", "optimizer": "AdamW"}
    options |= {"offload_optimizer": "cpu", "offload_pin_memory": pinned}
    options |= {"auto": "reduce_bucket_size", "stage3_param_persistence_threshold": 0}
    states = predict(spec("bert-tiny", (tech("deepspeed", **options),), nproc=8))
    assert states.ok, states.message
    part = math.ceil(PSI / 8)
    largest = max(p.numel() for p in BERT_TINY.parameters())
    if stage == 2:
        # (its host term, 4·Ψ a process, is each process's float32 copy of the whole model while
        # the engine is made, before the step)
        _, gpu = estimate_zero2_model_states_mem_needs(PSI, 8, cpu_offload=True)
        blocks = [4 * part, 4 * part, 2 * part, 2 * largest]  # partition, its grad, copy, staging
        held = 18 * part + 2 * largest
    else:
        cpu, gpu, largest_layer = estimate_zero3_model_states_mem_needs(
            PSI, largest, 8, cpu_offload=True, cpu_offload_params=False
        )
        assert cpu == 1.5 * 16 * PSI  # a node of 8: 16·Ψ, times its buffer factor
        gpu -= largest_layer  # its allowance for one layer gathered, which the tracker sees apart
        blocks = [4 * part, 2 * part]  # the partition's gradient, the gradient partitions
        held = 18 * part
    assert states.param_bytes == pytest.approx(gpu, abs=16)
    assert states.optimizer_state_bytes == 0
    # stage 3 copies the stepped float32 partition into the card's 16-bit one, a blocking copy in
    # another dtype, which CUDA converts on the host first: a 16-bit buffer there while it copies
    # (stage 2 converts into its own 16-bit copy on the host, then copies that over)
    held += 2 * part if stage == 3 else 0
    if pinned:
        assert states.host_pinned_bytes == sum(pinned_block(n) for n in blocks)
        assert states.host_peak_bytes == states.host_pinned_bytes + held - sum(blocks)
    else:
        assert states.host_pinned_bytes == 0
        assert states.host_peak_bytes == held


@pytest.mark.full
def test_zero_offloads_tracked_peak_is_memory_the_process_holds(monkeypatch):
    """What an offloading step holds (on this CPU host and device are one memory: the offloaded
    partitions, their gradients and CPU Adam's moments beside the rest) is memory the process
    holds: each rank's tracked peak is the tensor bytes it began the step with plus its resident
    memory's growth over the step, within 1% (pages, Python's own objects), where glibc hands each
    tensor's pages back (its mmap threshold fixed at 64 KiB, nothing kept on trim). BERT-base, whose
    tensors are mostly far over a page."""
    for key, value in RESIDENT_EXACT.items():
        monkeypatch.setenv(key, value)
    options = {"stage": 3, "auto": AUTO} | OFFLOAD_OPTIMIZER | OFFLOAD_PARAM
    techniques = (tech("deepspeed", **options),)
    run = spec("bert-base", techniques, batch_size=4, seq_len=128, nproc=2, timeout_s=STARTING)
    record = isolated(run, CPU)
    assert record["status"] == "ok", record.get("stderr_tail", record)
    assert_predicted_per_rank(record)
    tracked, resident = record["rank_peak_tensor_bytes"], record["rank_rss_peak_tensor_bytes"]
    assert resident == pytest.approx(tracked, rel=0.01)


# a float32 model's partitions (the masters a copy of them on the card): make test-full's
@pytest.mark.parametrize("precision", ["bfloat16", pytest.param("none", marks=pytest.mark.full)])
@pytest.mark.parametrize("optimizer", [False, True], ids=["param", "param-and-optimizer"])
def test_zero_3_parameter_offload_keeps_the_partitions_on_the_host_and_none_on_the_card(
    precision, optimizer
):
    """ZeRO-3's offload_param over 8 ranks, predicted for CUDA, against the same engine without it:
    the card no longer keeps the rank's parameter partition, and the host keeps it in one flat
    buffer, pinned whatever the config's pin_memory (DeepSpeed pins it itself), one power-of-two
    block; each gather copies a module's partitions to the card first. The float32 partition (a
    copy on the card, even of a float32 model's partitions) and Adam's moments stay where they
    were: on the card (12·Ψ/8), or on the host under ZeRO-Offload. With both, the card keeps no
    model state, DeepSpeed's estimate's device term (the largest layer, gathered, which the tracker
    sees apart), and in bf16 the host 20 bytes a parameter of the partition: the estimate's 18 and
    the 16-bit gradient partitions it leaves out. A copy across in another dtype goes through a
    buffer on the host (``bench.predict.cuda._copy``)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    options = {"stage": 3, "precision": precision}
    options |= {"auto": "reduce_bucket_size", "stage3_param_persistence_threshold": 0}
    if optimizer:
        options |= OFFLOAD_OPTIMIZER | {"offload_pin_memory": True}
    before = predict(spec("bert-tiny", (tech("deepspeed", **options),), nproc=8))
    states = predict(spec("bert-tiny", (tech("deepspeed", **options | OFFLOAD_PARAM),), nproc=8))
    assert states.ok, states.message
    part = math.ceil(PSI / 8)
    width = 2 if precision == "bfloat16" else 4
    assert (before.param_bytes, states.param_bytes) == (width * part, 0)
    held = 0 if optimizer else 12 * part
    assert states.optimizer_state_bytes == before.optimizer_state_bytes == held
    flat = pinned_block(width * part)
    assert states.host_pinned_bytes == before.host_pinned_bytes + flat
    # the step copies the stepped float32 partition into the 16-bit one: in bf16, across, through a
    # buffer on the host (CUDA converts a blocking copy there): the float32 one, from the card, as
    # it lands on the host; without offload_param the 16-bit one, made from the host's float32
    # partition under ZeRO-Offload; none where both are on one side
    converted = (-2 if optimizer else 4) * part if precision == "bfloat16" else 0
    assert states.host_peak_bytes == before.host_peak_bytes + flat + converted
    if optimizer and precision == "bfloat16":
        largest = max(p.numel() for p in BERT_TINY.parameters())
        cpu, gpu, largest_layer = estimate_zero3_model_states_mem_needs(PSI, largest, 8)
        assert gpu == largest_layer
        assert cpu == 1.5 * 18 * PSI  # a node of 8: 18·Ψ, times its buffer factor
        blocks = [4 * part, 2 * part, 2 * part]  # the float32 gradients, the 16-bit ones, params
        assert states.host_pinned_bytes == sum(pinned_block(n) for n in blocks)
        assert states.host_peak_bytes == states.host_pinned_bytes + 12 * part
        assert 12 * part + sum(blocks) == 20 * part


def test_the_engine_is_configured_as_the_options_say():
    from bench.techniques import build

    ds = build(tech("deepspeed", stage=2, precision="bfloat16", overlap_comm=True))
    config = ds.ds_config(batch_size=8, micro_batches=4, hidden=None)
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_accumulation_steps"] == 4
    assert config["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
@pytest.mark.parametrize(
    "stage, offload",
    [
        (2, {}),
        (3, {}),
        (2, OFFLOAD_OPTIMIZER),
        (3, OFFLOAD_OPTIMIZER),
        (3, OFFLOAD_PARAM),
        (3, OFFLOAD_OPTIMIZER | OFFLOAD_PARAM),
    ],
    ids=["on-device-2", "on-device-3", "offload-2", "offload-3", "param-3", "both-3"],
)
def test_zero_over_two_gpus_is_each_ranks_predicted_peak(stage, offload):
    """The same engine under NCCL on two cards (DeepSpeed's CUDA accelerator in the run, its CPU
    one in the prediction made before it): each rank's tracked peak against its prediction, within
    the collectives in flight that its reduction and gather streams may hold; with ZeRO-Offload
    (pinned) or ZeRO-3's parameters on the host, the host memory the rank's step holds against its
    prediction too."""
    gpus = Device("cuda", torch.cuda.get_device_name(0), count=torch.cuda.device_count())
    options = {"stage": stage, "auto": AUTO} | offload
    if "offload_optimizer" in offload:
        options["offload_pin_memory"] = True
    run = spec("bert-tiny", (tech("deepspeed", **options),), batch_size=32, nproc=2)
    record = isolated(run, gpus)
    assert record["status"] == "ok", record.get("stderr_tail", record)
    assert_predicted_per_rank(record)
    if offload:  # rank 0's, as its prediction is the record's
        assert record["rank_host_peak_bytes"][0] == record["predicted_host_peak_bytes"]
        assert record["rank_host_pinned_bytes"][0] == record["predicted_host_pinned_bytes"]
