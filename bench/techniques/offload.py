"""Offloading to host memory: the activations saved for backward, or the optimizer's state and
step."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bench.techniques.base import TECHNIQUES, RunContext, Step, Technique, offer, option


@TECHNIQUES.register("offload")
class ActivationOffload(Technique):
    """Move every tensor saved for backward to host memory during forward and bring it back in
    backward (``torch.autograd.graph.save_on_cpu``).

    Expected: GPU activation memory close to zero, paid for in PCIe transfers: the step slows by the
    time to copy the activations twice, less with pinned memory. Accuracy: identical.
    """

    axis = "activations"
    offers = (offer("offload"),)
    host_traffic = "activations"
    summary = "`torch.autograd.graph.save_on_cpu` (CUDA)"
    stand_ins = {"torch.autograd.graph:save_on_cpu": "bench.predict.stand_ins:FakeSaveOnCpu"}

    @dataclass(frozen=True)
    class Config:
        pin_memory: bool = option(
            True, "copy through page-locked host memory (faster, not pageable)"
        )

    def unsupported(self, ctx: RunContext) -> str | None:
        if ctx.cuda:
            return None
        return "activations already live in host memory on a CPU"

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.packed = 0
        return model

    def step(self) -> Step:
        return Step(context=lambda: _CountingSaveOnCpu(self, self.config.pin_memory))

    def proof(self, steps: int) -> dict[str, Any]:
        return {
            "tensors_offloaded_per_step": self.packed / max(steps, 1),
            "pin_memory": self.config.pin_memory,
        }


class _CountingSaveOnCpu(torch.autograd.graph.saved_tensors_hooks):
    """save_on_cpu that counts the tensors it moves, as proof that it did."""

    def __init__(self, owner: ActivationOffload, pin_memory: bool) -> None:
        host = torch.autograd.graph.save_on_cpu(pin_memory=pin_memory)

        def pack(t: torch.Tensor) -> Any:
            owner.packed += 1
            return host.pack_hook(t)

        super().__init__(pack, host.unpack_hook)


@TECHNIQUES.register("cpu-offload-optimizer")
class OptimizerOffload(Technique):
    """torchao's ``CPUOffloadOptimizer``: AdamW's state, an fp32 copy of each parameter and its
    gradient live in pinned host memory; backward copies each gradient to the host as it is made (on
    a side stream), the host steps (fused CPU AdamW) and the new values are copied back. Parameters
    under 4,096 elements stay with an on-device AdamW. ``offload_gradients`` frees each device
    gradient once copied.

    Expected: the device sheds AdamW's 8 bytes per parameter (and, offloading gradients, most of the
    4 of the gradients); the step waits for the host's update and the copies. torchao's README:
    ViT-giant 9.82 → 5.24 GB (gradients offloaded too), at a cost in step time that depends on the
    host."""

    axis = "optimizer"
    offers = (offer("cpu-offload-optimizer"),)
    host_traffic = "optimizer"
    stand_ins = {
        f"{__name__}:OptimizerOffload.host_optimizer": "bench.predict.stand_ins:fake_host_optimizer"
    }
    summary = (
        "torchao `CPUOffloadOptimizer`: AdamW state, fp32 params and gradients in pinned host "
        "memory, the step on the host (CUDA)"
    )

    @dataclass(frozen=True)
    class Config:
        offload_gradients: bool = option(
            False, "free each device gradient once it is copied to the host (not with accumulation)"
        )

    def conflict(self, other: Technique) -> str | None:
        if other.makes_optimizer:
            return f"the host steps its own AdamW; {other.name} makes another optimizer"
        if self.config.offload_gradients and other.name == "accumulate":
            return (
                "offload_gradients frees each gradient after backward, so micro-batches cannot "
                "accumulate"
            )
        return None

    def unsupported(self, ctx: RunContext) -> str | None:
        if importlib.util.find_spec("torchao") is None:
            return "needs torchao: pip install torchao (or pip install -e '.[extras]')"
        if not ctx.cuda:
            return (
                "the optimizer state lives in host memory on a CPU already; this moves it off a GPU"
            )
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.lr = ctx.lr
        return model

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        params = list(model.parameters())
        self.host = self.host_optimizer()(
            params, torch.optim.AdamW, lr=self.lr, offload_gradients=self.config.offload_gradients
        )
        return _Offloaded(params, self.host)

    @staticmethod
    def host_optimizer() -> type[torch.optim.Optimizer]:
        from torchao.optim import CPUOffloadOptimizer

        return CPUOffloadOptimizer

    def proof(self, steps: int) -> dict[str, Any]:
        host = self.host.param_d2h_map.values()
        kept = sum(len(g["params"]) for g in self.host.d_param_groups)
        return {
            "offloaded_params": len(host),
            "host_param_bytes": sum(p.nbytes for p in host),
            "device_params": kept,
            "offload_gradients": self.config.offload_gradients,
        }


class _Offloaded(torch.optim.Optimizer):
    """torchao's optimizer as the harness steps any other: it never initialises torch's Optimizer,
    whose step hooks the tracker registers on and whose state it counts. The state here is what
    stays on the device (the small parameters' AdamW); the host's is host memory."""

    def __init__(self, params: list[nn.Parameter], host: Any) -> None:
        super().__init__(params, {})
        self.host = host
        if host.d_opt is not None:
            self.state = host.d_opt.state

    def step(self, closure: Any = None) -> Any:
        return self.host.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.host.zero_grad(set_to_none)

    def host_tensors(self) -> list[torch.Tensor]:
        """What torchao keeps on the host: each parameter's copy and its gradient, pinned, and the
        host AdamW's state."""
        copies = list(self.host.param_d2h_map.values())
        states = [
            v
            for p, host in self.host.param_d2h_map.items()
            for v in self.host.optim_dict[p].state[host].values()
            if torch.is_tensor(v)
        ]
        return [*copies, *(c.grad for c in copies), *states]


@TECHNIQUES.register("activation-offload")
class OverlappedOffload(Technique):
    """Saved activations copied to pinned host memory on a side CUDA stream while forward goes on,
    and copied back in backward one tensor ahead of their use, as torchtune's ``OffloadActivations``
    does; ``offload`` beside it is the synchronous ``save_on_cpu``. A device tensor is released as
    soon as its copy is queued: the allocator, told the copy stream uses it (``record_stream``),
    keeps its block until the copy is done. Tensors under ``min_bytes`` and parameters stay on the
    device.

    Expected: torchtune reports about 24% less memory at under 1% slowdown on Llama-3-8B with
    checkpointing (its memory optimisations guide); without overlap the copies add their whole PCIe
    time, as ``offload`` shows."""

    axis = "activations"
    offers = (offer("activation-offload"),)
    host_traffic = "activations"
    overlaps_traffic = True
    stand_ins = {f"{__name__}:OverlappedSaves": "bench.predict.stand_ins:FakeOverlappedSaves"}
    summary = (
        "saved activations to pinned host memory on a side CUDA stream as forward goes on, fetched "
        "back one ahead in backward (torchtune's `OffloadActivations`); parameters and tensors "
        "under `min_bytes` stay"
    )

    @dataclass(frozen=True)
    class Config:
        min_bytes: int = option(
            1024, "saved tensors smaller than this stay on the device (a copy costs more)"
        )

    def problems(self, batch_size: int) -> list[str]:
        if self.config.min_bytes >= 0:
            return []
        return [f"min_bytes must be 0 or more, got {self.config.min_bytes}"]

    def unsupported(self, ctx: RunContext) -> str | None:
        if ctx.cuda:
            return None
        return "copies on a side CUDA stream; on a CPU activations live in host memory already"

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.offloaded, self.prefetched = 0, 0
        return model

    def step(self) -> Step:
        return Step(context=lambda: OverlappedSaves(self))

    def proof(self, steps: int) -> dict[str, Any]:
        return {
            "tensors_offloaded_per_step": self.offloaded / max(steps, 1),
            "tensors_prefetched_per_step": self.prefetched / max(steps, 1),
        }


class OverlappedSaves(torch.autograd.graph.saved_tensors_hooks):
    """One forward and backward's saved tensors: each large one goes to the host on ``copies``, a
    side stream, and comes back on it, the next one to be needed (the one saved before it) fetched
    as each is unpacked."""

    def __init__(self, owner: OverlappedOffload) -> None:
        self.owner, self.copies, self.count = owner, torch.cuda.Stream(), 0
        self.host: dict[int, torch.Tensor] = {}
        self.fetched: dict[int, tuple[torch.Tensor, torch.cuda.Event]] = {}
        super().__init__(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        if (
            t.device.type != "cuda"
            or t.nbytes < self.owner.config.min_bytes
            or isinstance(t, nn.Parameter)
        ):
            return t
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        self.copies.wait_stream(torch.cuda.current_stream())  # t is complete before it is copied
        with torch.cuda.stream(self.copies):
            host.copy_(t, non_blocking=True)
        t.record_stream(self.copies)  # t's block is not reused before the copy has read it
        key, self.count = self.count, self.count + 1
        self.host[key] = host
        self.owner.offloaded += 1
        return key

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, int):
            return packed
        device, done = self.fetched.pop(packed, None) or self._fetch(packed)
        torch.cuda.current_stream().wait_event(done)
        # made on the copy stream, used and freed on this one
        device.record_stream(torch.cuda.current_stream())
        if packed - 1 in self.host and packed - 1 not in self.fetched:
            self.fetched[packed - 1] = self._fetch(packed - 1)
            self.owner.prefetched += 1
        return device

    def _fetch(self, key: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        host = self.host.pop(key)
        with torch.cuda.stream(self.copies):
            device = host.to("cuda", non_blocking=True)
            return device, self.copies.record_event()
