"""DeepSpeed's calls that fake tensors cannot run as the real run does (``deepspeed``'s
``Technique.stand_ins``): its checks that the ranks agree read back what rank 0 broadcast, which the
fake group never sends, and its fused Adam runs a kernel it compiles; and what its engine changes
for good in the process is put back once the prediction is made."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from bench.measure.host import is_on_host, making_host, on_host
from bench.predict.crossing import device_copy, fetching


def restored_after(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` itself, put back when the prediction ends (a stand-in that wraps what it
    stands in for): ZeRO-3's engine swaps ``torch.nn.functional.linear`` for its own for good
    (``memory_efficient_linear``), which the traced step takes, as the real run's does, and which
    must not outlive it into the process's next predictions."""
    return original


restored_after.wraps_original = True  # type: ignore[attr-defined]


def ranks_agreeing(ints: list[int]) -> None:
    """``assert_ints_same_as_other_ranks`` as ranks that agree run it: rank 0's list length, then
    its list, broadcast from tensors made as DeepSpeed makes them; each rank then holds what it
    holds itself (under the fake group a rank but 0 would read back the -1s it sent)."""
    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().device_name(os.environ["LOCAL_RANK"]))
    for values in (len(ints), ints):
        dist.broadcast(torch.tensor(values, dtype=int, device=device), src=0, async_op=False)


class FusedAdamKernel:
    """DeepSpeed's FusedAdamBuilder for fake tensors: the kernel it would compile (CUDA's, or the
    CPU's) updates the parameters and Adam's moments in place, in one launch over all of them, and
    makes nothing; FusedAdam makes the moments itself beforehand (``torch.zeros_like``), as
    traced."""

    def load(self) -> SimpleNamespace:
        return SimpleNamespace(multi_tensor_adam=lambda *args: None)


class CPUAdamKernel:
    """DeepSpeed's CPUAdamBuilder for fake tensors: the kernel it would compile (a minute of g++)
    updates the partition and Adam's moments in place and makes nothing; DeepSpeedCPUAdam makes the
    moments itself beforehand (``torch.zeros_like``), as traced."""

    def load(self) -> SimpleNamespace:
        def nothing(*_: Any) -> None:
            return None

        return SimpleNamespace(create_adam=nothing, adam_update=nothing, destroy_adam=nothing)


def made_on_host(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` with what it makes counted as pageable host memory (a CUDA prediction's fake CPU
    tensors stand for the device's): ZeRO-Offload's buffers for gradients accumulated on the host,
    made on "cpu" by name (their pinned copies pinned, ``AsCuda.pin_memory``)."""

    @functools.wraps(original)
    def run(*args: Any, **kwargs: Any) -> Any:
        with making_host(pinned=False):
            return original(*args, **kwargs)

    return run


made_on_host.wraps_original = True  # type: ignore[attr-defined]


def partitioned_on_host(original: Callable[..., Any]) -> Callable[..., Any]:
    """ZeRO-3's ``Init._partition_param`` under ``offload_param``: a parameter's partition, made
    on "cpu" by name the first time (pinned by ``AsCuda.pin_memory`` where its ``pin_memory``
    asks), stands for pageable host memory where not pinned; one small enough to persist whole
    stays on the device."""

    @functools.wraps(original)
    def run(self: Any, param: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, param, *args, **kwargs)
        held = getattr(param, "ds_tensor", None)
        if held is not None and not param.ds_persist and not is_on_host(held):
            on_host(held)
        return out

    return run


def fetched_from_host(original: Callable[..., Any]) -> Callable[..., Any]:
    """ZeRO-3's ``Init._convert_to_deepspeed_param`` under ``offload_param``: the gather it gives
    each parameter copies each host partition to the device before the all-gather, as the real
    run's ``ds_tensor.to(device)`` does (a no-op where the CPU stands for both)."""

    @functools.wraps(original)
    def run(self: Any, param: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, param, *args, **kwargs)
        param.all_gather_coalesced = fetching(param.all_gather_coalesced)
        return out

    return run


def masters_from_host(original: Callable[..., Any]) -> Callable[..., Any]:
    """ZeRO-3's ``_create_fp32_partitions`` under ``offload_param``: each float32 partition is
    made from the host's 16-bit one, on the device (``.to(device, float32)``) or, under
    ZeRO-Offload, on the host (``.to("cpu", float32)``), which fake tensors tell apart by the
    optimizer's flag alone."""

    @functools.wraps(original)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.offload_optimizer:
            return original(self, *args, **kwargs)
        out = fetching(original)(self, *args, **kwargs)
        # a float32 model's partitions serve as the masters where they are on the device: fake
        # tensors say the host's are, where the real run's own copy is made on the device
        masters, flats = self.fp32_partitioned_groups_flat, self.fp16_partitioned_groups_flat
        for i, (master, flat) in enumerate(zip(masters, flats)):
            if master is flat:
                masters[i] = device_copy(flat).requires_grad_()
                masters[i].ds_id = flat.ds_id
        return out

    return run


partitioned_on_host.wraps_original = True  # type: ignore[attr-defined]
fetched_from_host.wraps_original = True  # type: ignore[attr-defined]
masters_from_host.wraps_original = True  # type: ignore[attr-defined]
