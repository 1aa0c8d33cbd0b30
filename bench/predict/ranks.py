"""One rank of a run over N processes, predicted in this one: torch's fake process group (its
collectives return at once and move nothing) under the fake tensors, and the bytes each collective
the rank issues would move.

Every rank of ``ddp``, ``fsdp`` and ``tensor-parallel`` runs the same program on its own shard, so
rank 0 stands for all of them; ``bench predict`` says so. Traffic is counted from the collectives
actually issued in the measured step, as a ring moves them: an all-reduce of S bytes sends and
receives 2(N−1)/N·S per rank, an all-gather or a reduce-scatter of S bytes in all (N−1)/N·S, a
broadcast or scatter S at most."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from unittest.mock import patch

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from bench.record import Prediction

# c10d's operators by the collective they are, and the tensor argument whose bytes that collective
# moves.
COLLECTIVES = {
    "c10d.allreduce_": ("all_reduce", 0),
    "_c10d_functional.all_reduce": ("all_reduce", 0),
    "c10d._allgather_base_": ("all_gather", 0),
    "c10d.allgather_": ("all_gather", 0),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", None),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d.reduce_scatter_": ("reduce_scatter", 1),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 0),
    "c10d.broadcast_": ("broadcast", 0),
    "c10d.scatter_": ("broadcast", 0),
}
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


class Traffic(TorchDispatchMode):
    """Bytes this rank sends (and, in a ring, as many it receives) per collective kind, while it is
    entered."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.world_size, self.bytes, self.largest = world_size, Counter(), 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        found = COLLECTIVES.get(str(func).removesuffix(".default"))
        if found is not None:
            kind, at = found
            tensors = _tensors(out if at is None else args[at])
            ring, size = _group_size(args) or self.world_size, sum(t.nbytes for t in tensors)
            self.bytes[kind] += round(_ring_share(kind, ring) * size)
            self.largest = max(self.largest, size)
        return out

    def figures(self) -> Prediction:
        """Bytes per kind, and the largest single collective's tensors: what a rank may also hold at
        its peak on a real group, while an asynchronous collective waits for a peer."""
        return Prediction(
            **{f"traffic_{kind}_bytes": self.bytes[kind] for kind in KINDS},
            largest_collective_bytes=self.largest,
        )


def _group_size(args: tuple) -> int | None:
    """The ranks of the group a collective runs in (a subgroup under hybrid sharding): c10d's
    operators take the group itself, the functional ones its name (their last text argument; a
    reduce op's name comes before)."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject) and arg._type().qualified_name().endswith(
            ".ProcessGroup"
        ):
            return dist.ProcessGroup.unbox(arg).size()
    names = [arg for arg in args if isinstance(arg, str)]
    if names:
        return dist.distributed_c10d._resolve_process_group(names[-1]).size()
    return None


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value if isinstance(v, (list, tuple, torch.Tensor)) for t in _tensors(v)]


def _ring_share(kind: str, n: int) -> float:
    """Bytes a rank sends per byte of the collective's whole tensor, in a ring (NCCL's and gloo's
    large messages)."""
    return {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
    }.get(kind, 1.0)


@contextmanager
def fake_group(world_size: int, rank: int) -> Iterator[None]:
    """A fake process group of ``world_size`` with this process as ``rank``, for the length of the
    prediction (nothing for a single process)."""
    if world_size == 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError(
            "a process group is already up in this process; predict before joining it"
        )
    # registers the "fake" backend
    from torch.testing._internal.distributed.fake_pg import (
        FakeStore,
    )

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    # as torchrun sets them for the rank (DeepSpeed's engine reads them; the node's rank is kept
    # where a launcher gave one)
    launched = {"RANK": str(rank), "WORLD_SIZE": str(world_size)}
    launched["LOCAL_RANK"] = os.environ.get("LOCAL_RANK", "0")
    try:
        with _setup_as_real(), patch.dict(os.environ, launched):
            yield
    finally:
        dist.destroy_process_group()


@contextmanager
def _setup_as_real() -> Iterator[None]:
    """What the parallel wrappers do at set-up that fake tensors cannot: a device mesh, and each
    mesh made from it (its dimensions under 2-D parallelism, their concatenation in FSDP over tensor
    parallelism), finds this rank's coordinates in a real tensor of ranks; and DDP compares every
    rank's parameter shapes by reading them (all equal here). And FSDP2's cut of each parameter into
    a chunk per rank makes only the chunks a rank takes: at 1,024 ranks, the other 1,023 views of
    every parameter took most of a prediction's time."""
    from torch.distributed import device_mesh
    from torch.distributed.fsdp._fully_shard import _fsdp_param as fsdp_param
    from torch.nn.parallel import distributed as ddp
    from torch.utils._python_dispatch import _disable_current_modes

    def real(fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with _disable_current_modes():
                # the fake mode, and the modes that read its values as one
                return fn(*args, **kwargs)

        return run

    with (
        patch.object(fsdp_param, "_chunk_with_empty", _one_chunk_at_a_time),
        patch.object(device_mesh, "init_device_mesh", real(device_mesh.init_device_mesh)),
        patch.object(device_mesh.DeviceMesh, "__init__", real(device_mesh.DeviceMesh.__init__)),
        patch.object(ddp, "_verify_param_shape_across_processes", lambda *args, **kwargs: None),
    ):
        yield


class _OneChunkAtATime(Sequence):
    """``torch.chunk(tensor, n, dim)`` padded with empty tensors to ``n`` (FSDP2's
    ``_chunk_with_empty``), each chunk made when it is read."""

    def __init__(self, tensor: torch.Tensor, n: int, dim: int) -> None:
        self.tensor, self.n, self.dim = tensor, n, dim
        # torch.chunk's: ceil, so fewer than n chunks may hold rows
        self.size = -(-tensor.size(dim) // n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        start = range(self.n)[i] * self.size
        if start >= self.tensor.size(self.dim):
            return self[0].new_empty(0)
        return self.tensor.narrow(
            self.dim, start, min(self.size, self.tensor.size(self.dim) - start)
        )


def _one_chunk_at_a_time(tensor: torch.Tensor, num_chunks: int, dim: int) -> Sequence[torch.Tensor]:
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    if tensor.size(dim) == 0:  # torch.chunk's own rules for an empty dimension
        return _chunk_with_empty(tensor, num_chunks, dim)
    return _OneChunkAtATime(tensor, num_chunks, dim)


class _KeptBuckets:
    """DDP's reducer, but for rebuilding its buckets in backward's order after the first step: that
    reads bucket indices off a broadcast tensor, which a fake one cannot give. The buckets keep
    their first layout, which holds the same gradient bytes."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def fake_ddp(model: nn.Module) -> None:
    """DDP under the fake group: its buckets kept as first laid out, and all-reduced as its default
    hook does (averaged in place), completed at once, since the fake group's future carries no
    tensor, which DDP's reducer refuses."""
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return
    model.reducer = _KeptBuckets(model.reducer)

    def hook(state, bucket):  # noqa: ANN001, ANN202  unannotated: DDP compares annotations to its own classes
        buffer = bucket.buffer().div_(dist.get_world_size())
        dist.all_reduce(buffer)
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    model.register_comm_hook(None, hook)
