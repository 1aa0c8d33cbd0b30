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
