"""DeepSpeed's engine (``deepspeed.initialize``) with its ZeRO stages: the Hugging Face Trainer's
``deepspeed = "ds_config.json"``. Its engine takes the model and the optimizer over once both are
made, runs each micro-batch's backward (reducing the gradients at the step's last) and the step.
The runner starts these runs under torchrun; the worker's process group (NCCL on GPUs, gloo on
CPUs) is the one DeepSpeed joins."""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from bench.measure.host import host_copy, is_on_host, on_host
from bench.measure.memory import parameter_tensors, tensor_bytes
from bench.techniques.base import (
    TECHNIQUES,
    RunContext,
    Step,
    Technique,
    Unsupported,
    listed,
    option,
)
from bench.techniques.distributed import DISTRIBUTED, too_few_processes

# zero_optimization's keys an option sets where given (None: DeepSpeed's own default)
ZERO_KEYS = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "overlap_comm",
    "contiguous_gradients",
    "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_param_persistence_threshold",
)
# the bucket keys the Trainer fills from the model's hidden size h where "auto"
# (HfTrainerDeepSpeedConfig.trainer_config_finalize)
HIDDEN = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}
# where each of DeepSpeed's optimizers keeps its float32 partitions: ZeRO 1-2's, 3's, and stage 0's
# in 16 bits (whole, flat under its fused optimizer, a tensor a parameter under the others)
MASTERS = (
    "single_partition_of_fp32_groups",
    "fp32_partitioned_groups_flat",
    "fp32_groups_flat_partition",
    "fp32_groups_flat",
    "fp32_groups",
)
# on CUDA (``DeepSpeed.cuda_stand_ins``)
CUDA_STAND_INS = {
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer."
    "async_accumulate_grad_in_cpu_via_gpu": "bench.predict.deepspeed:made_on_host",
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.partition_grads": (
        "bench.predict.crossing:fetching"
    ),
}
PARAMS_ON_HOST = {
    "deepspeed.runtime.zero.partition_parameters:Init._partition_param": (
        "bench.predict.deepspeed:partitioned_on_host"
    ),
    "deepspeed.runtime.zero.partition_parameters:Init._convert_to_deepspeed_param": (
        "bench.predict.deepspeed:fetched_from_host"
    ),
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions": (
        "bench.predict.deepspeed:masters_from_host"
    ),
}
OFFLOAD_TO = "device"  # an offload section's key: where to ("none", "cpu", "nvme")
# DeepSpeed's log: a line per engine setting at INFO
QUIET = logging.WARNING


@TECHNIQUES.register("deepspeed")
class DeepSpeed(Technique):
    """DeepSpeed's engine at a ZeRO stage: 0 keeps every state whole and all-reduces the gradients;
    1 partitions the optimizer state over the ranks; 2 the gradients too, reduced in buckets as
    backward makes them; 3 the parameters too, gathered for each module's forward and backward.
    Under ``precision`` the model runs in 16 bits and each rank keeps a float32 master copy of its
    partition.

    Expected: per-rank model states of (2 + 2 + 12)·Ψ bytes under mixed precision at stage 0,
    2·Ψ + 2·Ψ + 12·Ψ/N at 1, 2·Ψ + (2 + 12)·Ψ/N at 2, (2 + 2 + 12)·Ψ/N at 3 (ZeRO's paper); plus
    the reduce buckets (``reduce_bucket_size`` elements, two under ``overlap_comm``) at stages 1-2
    and, at 3, the parameters gathered ahead (``stage3_prefetch_bucket_size``)."""

    distributed = True
    data_parallel = True
    conflicts = DISTRIBUTED
    not_advised = "fsdp shards the same model states on PyTorch's own engine"
    summary = (
        "DeepSpeed's engine at ZeRO `stage` 0-3 (optimizer state, then gradients, then parameters "
        "partitioned over the ranks), its zero_optimization buckets as options; the Trainer's "
        "`deepspeed` file"
    )

    @dataclass(frozen=True)
    class Config:
        stage: int = option(
            2, "ZeRO stage: 0 none, 1 optimizer state, 2 and gradients, 3 and parameters"
        )
        precision: Literal["none", "bfloat16", "float16"] = option(
            "none", "bf16 / fp16 enabled: the model in 16 bits, a float32 master partition per rank"
        )
        gradient_clipping: float = option(0.0, "the gradients' global norm clipped to this; 0: not")
        reduce_bucket_size: int | None = option(None, "elements reduced at once (5e8)")
        allgather_bucket_size: int | None = option(None, "elements gathered at once, 1-2 (5e8)")
        overlap_comm: bool | None = option(None, "reduce beside backward (on at stage 3)")
        contiguous_gradients: bool | None = option(None, "gradients copied into one buffer (on)")
        stage3_prefetch_bucket_size: int | None = option(None, "parameters gathered ahead (5e7)")
        stage3_max_live_parameters: int | None = option(None, "gathered parameters kept (1e9)")
        stage3_max_reuse_distance: int | None = option(None, "kept if reused within (1e9)")
        stage3_param_persistence_threshold: int | None = option(
            None, "parameters this small stay whole on every rank (1e5)"
        )
        optimizer: Literal["trainer", "AdamW", "Adam"] = option(
            "trainer",
            "trainer: the run's optimizer handed to the engine; AdamW, Adam: a ds_config's "
            "optimizer section, which DeepSpeed builds (FusedAdam: Adam's moments, updated in "
            "place by one kernel)",
        )
        auto: str = option(
            "",
            'bucket keys set from the model\'s hidden size h, as the Trainer fills an "auto" '
            "(comma-separated: reduce_bucket_size h², stage3_prefetch_bucket_size 0.9·h², "
            "stage3_param_persistence_threshold 10·h)",
        )
        offload_optimizer: Literal["none", "cpu"] = option(
            "none",
            "cpu: ZeRO-Offload, the float32 partitions, their gradients and Adam's moments on the "
            "host, stepped there by DeepSpeed's CPU Adam (stages 1-3; the ds_config's own "
            "optimizer)",
        )
        offload_pin_memory: bool = option(
            False, "the offloaded partitions and their gradients in pinned host memory"
        )
        offload_param: Literal["none", "cpu"] = option(
            "none",
            "cpu: ZeRO-3's 16-bit parameter partitions on the host (the trained ones in one pinned "
            "flat buffer a group), each module's copied to the device for its gather (stage 3)",
        )
        offload_param_pin_memory: bool = option(
            False,
            "each partition pinned as ZeRO-3 first makes it (the flat buffers are either way)",
        )

    # its overflow checks read the gradients' values, and its checks that the ranks agree what
    # rank 0 sent
    stand_ins: ClassVar[dict[str, str]] = {
        **{
            f"deepspeed.runtime.zero.{m}:{name}": "bench.predict.stand_ins:healthy"
            for m, cls in (
                ("stage_1_and_2", "DeepSpeedZeroOptimizer"),
                ("stage3", "DeepSpeedZeroOptimizer_Stage3"),
            )
            for name in (f"{cls}.has_overflow", "is_invalid_grad_norm")
        },
        # ZeRO-Offload's, gradient by gradient as each reaches the host
        "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer."
        "update_offload_overflow_tracker": "bench.predict.stand_ins:healthy",
        # stage 0's under fp16
        **{
            f"deepspeed.runtime.utils:CheckOverflow.{name}": "bench.predict.stand_ins:healthy"
            for name in ("has_overflow", "check_using_norm")
        },
        # ZeRO-3's linear, set for good in the process: the prediction's own
        "torch.nn.functional:linear": "bench.predict.deepspeed:restored_after",
        # its fused Adam's kernel and its CPU Adam's, which update in place and make nothing
        "deepspeed.ops.adam.fused_adam:FusedAdamBuilder": "bench.predict.deepspeed:FusedAdamKernel",
        "deepspeed.ops.adam.cpu_adam:CPUAdamBuilder": "bench.predict.deepspeed:CPUAdamKernel",
        **{
            f"deepspeed.runtime.zero.{m}:assert_ints_same_as_other_ranks": (
                "bench.predict.deepspeed:ranks_agreeing"
            )
            for m in ("stage3", "partition_parameters", "partitioned_param_coordinator")
        },
    }

    def layers_alike(self) -> bool:
        return False  # its partitions and buckets are flat buffers over every layer at once

    def problems(self, batch_size: int) -> list[str]:
        found = [
            f"auto: {key!r} is not one of {', '.join(HIDDEN)}"
            for key in listed(self.config.auto)
            if key not in HIDDEN
        ]
        if self.config.stage not in (0, 1, 2, 3):
            found.append(f"stage must be 0, 1, 2 or 3, got {self.config.stage}")
        if self.offloading and self.config.stage == 0:
            found.append("offload_optimizer needs a ZeRO stage, 1 to 3: stage 0 offloads nothing")
        if self.offloading_params and self.config.stage != 3:
            found.append("offload_param needs ZeRO stage 3: stages 0-2 keep whole parameters")
        if self.offloading and self.config.optimizer == "trainer":
            found.append(
                "offload_optimizer steps DeepSpeed's CPU Adam, which it builds from the "
                "ds_config's optimizer section: set optimizer = 'AdamW' or 'Adam' (DeepSpeed, and "
                "the Trainer, refuse a client optimizer under offload)"
            )
        return found

    @property
    def offloading(self) -> bool:
        return self.config.offload_optimizer != "none"

    @property
    def offloading_params(self) -> bool:
        return self.config.offload_param != "none"

    @property
    def cuda_stand_ins(self) -> dict[str, str]:  # type: ignore[override]
        """On CUDA, ZeRO-Offload's host side (its buffers for gradients accumulated on the host;
        CPU Adam's moments, made from the host's partitions, are the host's as any operator on host
        tensors alone makes) and ZeRO-3's gradient partitions brought back to the device from the
        host; with ``offload_param``, each parameter's partition made on the host, and copied to
        the device for each gather."""
        found = dict(CUDA_STAND_INS)
        if self.offloading_params:
            found |= PARAMS_ON_HOST
        return found

    def unsupported(self, ctx: RunContext) -> str | None:
        try:
            imported()
        except ImportError:
            return "needs deepspeed: pip install -e '.[sharding]'"
        return too_few_processes(ctx)

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.ctx, self.full_param_bytes = ctx, tensor_bytes(model.parameters())
        return model

    def engine(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: int
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        deepspeed = imported()
        from deepspeed.accelerator import set_accelerator

        set_accelerator(_accelerator(self.ctx))
        _forget_groups()
        deepspeed.utils.logger.setLevel(QUIET)
        if self.config.optimizer == "trainer":
            handed: dict[str, Any] = {"optimizer": optimizer}
        else:  # the Trainer's, where a ds_config names one (its DummyOptim): the trained ones
            handed = {"model_parameters": [p for p in model.parameters() if p.requires_grad]}
        config = self.ds_config(self.ctx.shapes.batch_size, micro_batches, _hidden_size(model))
        self.model, optimizer, _, _ = deepspeed.initialize(
            model=model,
            config=config | self._own_optimizer(),
            dist_init_required=False,
            **handed,
        )
        # its float32 partitions, which ZeRO counts as optimizer state (bench.measure.memory)
        groups = next((getattr(optimizer, n) for n in MASTERS if hasattr(optimizer, n)), [])
        optimizer.masters = [t for g in groups for t in (g if isinstance(g, list) else [g])]
        if self.offloading:
            optimizer.host_tensors = lambda: self._host_side(optimizer)
            self._host_side(optimizer)
        self.optimizer = optimizer
        return self.model, optimizer

    def _host_side(self, optimizer: Any) -> list[torch.Tensor]:
        """What ZeRO-Offload keeps on the host (``offloaded``), each said to stand for host memory
        where fake CPU tensors stand for the device's: pageable where not pinned already
        (``AsCuda.pin_memory`` says so of what it pins)."""
        held = offloaded(optimizer)
        if self.ctx.predicting:
            for t in held:
                if not is_on_host(t):
                    on_host(t)
        return held

    def ds_config(self, batch_size: int, micro_batches: int, hidden: int | None) -> dict[str, Any]:
        """The engine's configuration: the step's batch as the Trainer passes it, the options, the
        ``auto`` ones from the model's ``hidden`` size."""
        given = {k: getattr(self.config, k) for k in ZERO_KEYS}
        for key in listed(self.config.auto):
            if hidden is None:
                raise Unsupported(
                    f"auto: {key} is set from the model's hidden size, which its config does not "
                    "give (hidden_size, hidden_sizes or text_config's); give a number"
                )
            given[key] = HIDDEN[key](hidden)
        zero = {"stage": self.config.stage} | {k: v for k, v in given.items() if v is not None}
        if self.offloading:
            zero["offload_optimizer"] = {
                OFFLOAD_TO: self.config.offload_optimizer,
                "pin_memory": self.config.offload_pin_memory,
            }
        if self.offloading_params:
            zero["offload_param"] = {
                OFFLOAD_TO: self.config.offload_param,
                "pin_memory": self.config.offload_param_pin_memory,
            }
        return {
            "train_micro_batch_size_per_gpu": batch_size // micro_batches,
            "gradient_accumulation_steps": micro_batches,
            "gradient_clipping": self.config.gradient_clipping,
            "zero_optimization": zero,
            "bf16": {"enabled": self.config.precision == "bfloat16"},
            "fp16": {"enabled": self.config.precision == "float16"},
            # the run's optimizer, any technique's (the Trainer's own where the file names none)
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 62,
        }

    def _own_optimizer(self) -> dict[str, Any]:
        """The ds_config's optimizer section, where DeepSpeed builds its own: at the run's learning
        rate (the Trainer fills "auto" ones from its arguments)."""
        if self.config.optimizer == "trainer":
            return {}
        return {"optimizer": {"type": self.config.optimizer, "params": {"lr": self.ctx.lr}}}

    def conflict(self, other: Technique) -> str | None:
        if self.config.optimizer != "trainer" and other.makes_optimizer:
            return f"optimizer = {self.config.optimizer!r} is DeepSpeed's own; leave it 'trainer'"
        return None

    def step(self) -> Step:
        return Step(
            backward=self._backward,
            optimizer_step=lambda _: self.model.step(),
            zero_grad=lambda _: None,  # the engine's step zeroes them
        )

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        """As accelerate's DeepSpeedEngineWrapper: the boundary said, then the engine's backward
        (the loss already divided by the micro-batches)."""
        self.model.set_gradient_accumulation_boundary(last)
        self.model.backward(loss, scale_wrt_gas=False)

    def proof(self, steps: int) -> dict[str, Any]:
        held = tensor_bytes(parameter_tensors(self.model.module))
        # ZeRO-Offload's partitions, gradients and moments, where the host's CPU Adam steps them
        offloaded_bytes = 0
        if self.offloading:
            offloaded_bytes = tensor_bytes(offloaded(self.optimizer))
        if self.offloading_params:  # the parameters' partitions, whose gathers copy them over
            offloaded_bytes += tensor_bytes(partitions_offloaded(self.model.module))
        return {
            "zero_stage": self.model.zero_optimization_stage(),
            "world_size": self.ctx.world_size,
            "param_bytes_per_rank": held,
            "param_fraction_per_rank": round(held / self.full_param_bytes, 4),
            "offloaded_bytes_per_rank": offloaded_bytes,
        }


def imported() -> ModuleType:
    """deepspeed, imported without its warning that it picked the CPU where no GPU is: the
    accelerator it would pick named first (the run sets its own, ``_accelerator``)."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    # its engine gathers and scatters with calls torch deprecated, which say so on every rank
    warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
    # ZeRO-1/2 check their partitions' alignment by address, which a fake tensor's reads as 0
    warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor", UserWarning)
    import deepspeed

    return deepspeed


# what ZeRO-Offload keeps on the host besides its CPU Adam's state: each group's float32 partition
# (its gradient is its .grad); at stages 1-2 (stage_1_and_2.py) the 16-bit copy it steps back
# through and one gradient the size of the largest parameter, staged on its way to the host; at 3
# (stage3.py) the gradient partitions, flat, that backward reduces into
PARTITIONS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
OFFLOADED = (
    *PARTITIONS,
    "param_buffer_of_bit16_for_cpu_offload_groups",
    "temp_grad_buffer_for_cpu_offload",
    "grad_partitions_flat_buffer",
)


def offloaded(optimizer: Any) -> list[torch.Tensor]:
    """What ZeRO-Offload keeps on the host: OFFLOADED, each partition's gradient, the buffers of
    gradients accumulated there, and the moments DeepSpeed's CPU Adam made there."""
    held: list[torch.Tensor] = []
    for name in OFFLOADED:
        value = getattr(optimizer, name, None)
        held += value if isinstance(value, list) else [value]
    partitions = next(getattr(optimizer, n) for n in PARTITIONS if hasattr(optimizer, n))
    held += [g for t in partitions if (g := t.grad) is not None]
    # micro-batches' gradients summed on the host, a buffer a parameter, kept from step to step
    held += list(getattr(optimizer, "accumulated_grads_in_cpu", {}).values())
    held += [v for state in optimizer.optimizer.state.values() for v in state.values()]
    return [t for t in held if torch.is_tensor(t)]


def partitions_offloaded(model: nn.Module) -> list[torch.Tensor]:
    """The parameters' partitions ZeRO-3's ``offload_param`` keeps on the host: all but those
    small enough to persist whole on the device (the trained ones' in the flat buffers the
    optimizer made, the frozen ones' where they were first made)."""
    return [p.ds_tensor for p in model.parameters() if not p.ds_persist]


def _hidden_size(model: nn.Module) -> int | None:
    """The model's hidden size as the Trainer reads it for an "auto" bucket (its config's
    hidden_size, the largest of hidden_sizes, or its text_config's); None where it has none."""
    config = getattr(model, "config", None)
    for c in (config, getattr(config, "text_config", None)):
        if (size := getattr(c, "hidden_size", None)) is not None:
            return size
        if sizes := getattr(c, "hidden_sizes", None):
            return max(sizes)
    return None


def _forget_groups() -> None:
    """DeepSpeed keeps the process groups it made in its module's globals, across engines: a
    prediction's, made under the fake group, would outlive that group into the run."""
    from deepspeed.utils import groups

    for name, value in list(vars(groups).items()):
        if not name.startswith("_") or not name.lstrip("_").isupper() or isinstance(value, str):
            continue  # not a group, nor a table of them
        if isinstance(value, dict):
            value.clear()
        else:
            setattr(groups, name, None)


def _accelerator(ctx: RunContext) -> Any:
    """DeepSpeed's accelerator for the run: CUDA's on a GPU, the CPU's on a CPU and on fake tensors
    (their CPU tensors stand for CUDA's; its streams are the one stream), where it takes float16
    as CUDA's does (the CPU's refuses it, having no float16 kernels, which fake tensors do not
    run)."""
    if ctx.device.type == "cuda" and not ctx.predicting:
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

        return CUDA_Accelerator()
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    # the CPU's compiles a shared-memory all-reduce at first use (a minute of g++) that only
    # inference's all-reduce takes; training's collectives are torch.distributed's
    # (the package's attribute `torch` is PyTorch, not this module)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    if not ctx.predicting:
        return CPU_Accelerator()

    class AsCuda(CPU_Accelerator):
        def is_fp16_supported(self) -> bool:
            return True

        def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, **_: Any) -> Any:
            """A pinned host copy, as CUDA's accelerator makes one (``Tensor.pin_memory``); the
            CPU's keeps the tensor as it is."""
            return host_copy(tensor, pinned=True, values=make_copy)

    return AsCuda()
