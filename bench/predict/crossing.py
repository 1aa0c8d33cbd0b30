"""Moves between host and device (``Tensor.to``) for fake tensors, which stand for the device's on
the CPU: where the CPU stands for both sides, ``.to`` from a host tensor to "the device" is a no-op
on fake tensors, and to "cpu" from a device one too; inside a library's function that moves tensors
so, the move the real run makes. FSDP2's CPU offload (``fsdp``'s ``cpu_offload``): its sharded
parameters in pinned host memory (``Tensor.pin_memory``, which bench.predict.stand_ins.OutputsAsReal
makes for fake tensors), each all-gather copying a shard to the device first, each reduce-scatter's
gradient shard copied to the host (pinned where the copy overlaps, ``non_blocking``), the optimizer
stepping on the host (an operator on host tensors alone makes host tensors, ``OutputsAsReal`` too).
DeepSpeed's ZeRO-3 offload: each gradient partition brought to the device from its host buffer
before its norm is taken; under ``offload_param``, each parameter's host partition copied to the
device for its gather."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any
from unittest.mock import patch

import torch

from bench.measure.host import host_copy, is_on_host

_TO = torch.Tensor.to


def _moved(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``Tensor.to`` where the CPU stands for both sides: to "the device" from a host tensor is a
    copy on the device, to "cpu" from a device tensor a copy on the host; any other call as it
    is."""
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
    if device is None or device.type != "cpu" or (dtype is not None and dtype != self.dtype):
        return _TO(self, *args, **kwargs)
    if is_on_host(self):
        return device_copy(self)
    return host_copy(self, pinned=non_blocking)


def _fetched(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``Tensor.to`` where every move named is to the device (ZeRO-3's gathers name the device for
    each partition, on the host or persisting on the device, and its gradient buffers for each,
    on the host under ZeRO-Offload or not): a host tensor's is a copy on the device (in the dtype
    named), any other call as it is."""
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    if device is not None and device.type == "cpu" and is_on_host(self):
        return device_copy(self, dtype)
    return _TO(self, *args, **kwargs)


def device_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor's copy on the device: a factory's output (an operator on the host tensor
    alone would make one on the host)."""
    return torch.empty(t.shape, dtype=dtype or t.dtype).copy_(t)


def _moving(
    run: Callable[..., Any], to: Callable[..., torch.Tensor] = _moved
) -> Callable[..., Any]:
    @functools.wraps(run)
    def moving(*args: Any, **kwargs: Any) -> Any:
        with patch.object(torch.Tensor, "to", to):
            return run(*args, **kwargs)

    return moving


def moving_across(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (FSDP2's ``foreach_reduce``) with each move it makes between host and device
    made."""
    return _moving(original)


def gathered_from_host(original: property) -> property:
    """``FSDPParam.all_gather_inputs``, each host shard copied to the device first."""
    return property(_moving(original.fget))


def fetching(run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` (ZeRO-3's ``partition_grads``, its gather of a module's parameters) with each host
    tensor it moves to the device copied there."""
    return _moving(run, to=_fetched)


fetching.wraps_original = True  # type: ignore[attr-defined]

moving_across.wraps_original = True  # type: ignore[attr-defined]
gathered_from_host.wraps_original = True  # type: ignore[attr-defined]
