"""fsdp's ``layout = "accelerate"``, held to accelerate's own ``fsdp2_prepare_model`` (the Trainer's
FSDP2): the same modules cut into the same units, each resharding after forward or not as there,
with the same mixed-precision policy, the same parameter dtypes, under torch's fake process
group (each rank's prediction held to its measured peak under gloo: tests/test_process_group.py)."""

from __future__ import annotations

import types

import pytest
import torch
from torch.distributed.fsdp import FSDPModule, OffloadPolicy

from bench.models import resolve
from bench.predict.ranks import fake_group
from bench.spec import Shapes
from bench.techniques.distributed import FullyShard, _as_accelerate_shards

TINY = "hf:suites/configs/tiny-llama"


def _units(model: torch.nn.Module) -> dict[str, tuple]:
    """Each module that is a unit's, with whether it reshards after forward, its policy, and its
    parameters' dtypes."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            group = state._fsdp_param_group
            resharded = group is not None and group.post_forward_mesh_info is not None
            dtypes = sorted({str(p.dtype) for p in module.parameters(recurse=False)})
            out[name.replace("._checkpoint_wrapped_module", "")] = (
                resharded,
                str(state._mp_policy),
                dtypes,
            )
    return out


def _accelerates(model: torch.nn.Module, precision: str, reshard: bool, checkpointed: bool):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=reshard,
        auto_wrap_policy="TRANSFORMER_BASED_WRAP",
        activation_checkpointing=checkpointed,
    )
    named = {"none": "no", "bfloat16": "bf16", "float16": "fp16"}[precision]
    if named != "no":
        plugin.set_mixed_precision(named)
    accelerator = types.SimpleNamespace(
        state=types.SimpleNamespace(fsdp_plugin=plugin),
        mixed_precision=named,
        is_main_process=True,
        device=torch.device("cpu"),
        parallelism_config=None,
    )
    plugin.set_auto_wrap_policy(model)
    if checkpointed:
        model = fsdp2_apply_ac(accelerator, model)
    return fsdp2_prepare_model(accelerator, model)


@pytest.mark.parametrize(
    "precision, reshard, checkpointed",
    [("none", True, False), ("bfloat16", True, True), ("float16", False, False)],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_accelerate_layout_is_accelerates_own(
    precision, reshard, checkpointed, dtype, monkeypatch
):
    """A model loaded in bfloat16 is upcast to float32 master weights under mixed precision, as
    accelerate does; the checkpointed layers are the units', wrapped before they are sharded."""
    import logging

    from accelerate.utils import fsdp_utils

    # its warning of the upcast logs through accelerate's state, which no Accelerator set up here
    monkeypatch.setattr(fsdp_utils, "logger", logging.getLogger("accelerate-test"))
    shapes = Shapes(batch_size=1, seq_len=8)
    config = FullyShard.Config(
        layout="accelerate",
        mixed_precision=precision,
        reshard_after_forward=reshard,
        activation_checkpointing=checkpointed,
    )
    made = []
    with fake_group(2, 0):
        for way in ("theirs", "ours"):
            model = resolve(f"{TINY}#dtype={dtype}").build(shapes)
            if way == "theirs":
                made.append(_units(_accelerates(model, precision, reshard, checkpointed)))
            else:
                kwargs = {"reshard_after_forward": reshard, "offload_policy": OffloadPolicy()}
                made.append(_units(_as_accelerate_shards(model, kwargs, config)[0]))
    theirs, ours = made
    assert ours == theirs
    assert {"", "model.embed_tokens", "model.layers.0", "lm_head"} <= ours.keys()


def test_fsdp_cpu_offload_keeps_the_model_states_on_the_host_pinned_as_fsdp2_pins_them():
    """FSDP2's CPUOffloadPolicy, predicted for CUDA over 2 ranks: between the units' gathers the
    card keeps no parameter, gradient or optimizer state; each rank's host keeps its padded shard of
    each parameter (pinned at set-up) and, after backward, each gradient's shard (copied off the
    card into pinned memory as its reduce-scatter ends), one power-of-two block each, and AdamW's
    two float32 moments of each shard, pageable, with the temporaries of its step on the host."""
    from bench.measure.host import pinned_block
    from bench.models import MODELS
    from bench.predict import predict
    from tests.helpers import spec, tech

    run = spec("bert-tiny", (tech("fsdp", cpu_offload=True),), batch_size=8, seq_len=64, nproc=2)
    kept = predict(spec("bert-tiny", (tech("fsdp"),), batch_size=8, seq_len=64, nproc=2))
    out = predict(run)
    assert out.ok, out.message
    assert (out.param_bytes, out.gradient_bytes, out.optimizer_state_bytes) == (0, 0, 0)
    assert out.peak_tensor_bytes < kept.peak_tensor_bytes
    model = MODELS.get("bert-tiny").build(Shapes(batch_size=8, seq_len=64))
    shards = []  # rank 0's: the first of two chunks of each parameter's rows
    for p in model.parameters():
        rows = -(-p.shape[0] // 2)
        shards.append(rows * p[0].numel() * p.element_size())
    assert out.host_pinned_bytes == 2 * sum(pinned_block(n) for n in shards)
    assert out.host_peak_bytes >= out.host_pinned_bytes + 2 * sum(shards)


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_fsdp_cpu_offload_over_two_gpus_is_each_ranks_predicted_peak_and_host_memory():
    """The same offload under NCCL on two cards: each rank's tracked peak against its prediction,
    and rank 0's host memory (its pinned shards and gradients, its optimizer's state and
    temporaries) against rank 0's."""
    from bench.launch import Device
    from tests.helpers import isolated, spec, tech
    from tests.test_process_group import assert_predicted_per_rank

    gpus = Device("cuda", torch.cuda.get_device_name(0), count=torch.cuda.device_count())
    run = spec("bert-tiny", (tech("fsdp", cpu_offload=True),), batch_size=32, nproc=2)
    record = isolated(run, gpus)
    assert record["status"] == "ok", record.get("stderr_tail", record)
    assert_predicted_per_rank(record)
    assert record["rank_host_peak_bytes"][0] == record["predicted_host_peak_bytes"]
    assert record["rank_host_pinned_bytes"][0] == record["predicted_host_pinned_bytes"]
