"""Beyond one device: data parallelism, fully sharded model states and tensor parallelism, on
PyTorch's own engine (torch.distributed). The runner starts these runs under torchrun with ``nproc``
processes; the worker joins the process group (NCCL on GPUs, gloo on CPUs) before the techniques
apply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from bench.measure.memory import tensor_bytes
from bench.techniques.base import TECHNIQUES, RunContext, Technique, Unsupported, offer, option

DISTRIBUTED = frozenset({"ddp", "fsdp", "tensor-parallel"})


class _Distributed(Technique):
    distributed = True
    # one parallelism technique per run; 2-D (TP inside FSDP) is an fsdp option
    conflicts = DISTRIBUTED

    def unsupported(self, ctx: RunContext) -> str | None:
        return too_few_processes(ctx)

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.world_size = ctx.world_size
        self.full_param_bytes = tensor_bytes(model.parameters())
        return self.parallelize(model, ctx)

    def parallelize(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        raise NotImplementedError

    def proof(self, steps: int) -> dict[str, Any]:
        local = tensor_bytes(self.model.parameters())
        return {
            "world_size": self.world_size,
            "param_bytes_per_rank": local,
            "param_fraction_per_rank": round(local / self.full_param_bytes, 4),
        }


def too_few_processes(ctx: RunContext) -> str | None:
    """Why a technique over several processes cannot run in this one, if it cannot."""
    if ctx.world_size < 2:
        return (
            f"needs at least 2 processes (nproc in the suite entry); this run has {ctx.world_size}"
        )
    return None


def _mesh(ctx: RunContext, inner: int = 0, names: tuple[str, str] = ("replicate", "shard")):
    """The ranks as one dimension, or as (world_size / inner, inner): a 2-D mesh whose inner groups
    are neighbouring ranks (a node). FSDP2 shards over the inner dimension and replicates over the
    outer (HSDP); under 2-D parallelism, tensor parallelism takes the inner and FSDP the outer."""
    from torch.distributed.device_mesh import init_device_mesh

    if inner and inner < ctx.world_size:
        return init_device_mesh(
            ctx.device.type, (ctx.world_size // inner, inner), mesh_dim_names=names
        )
    return init_device_mesh(ctx.device.type, (ctx.world_size,))


@TECHNIQUES.register("ddp")
class DataParallel(_Distributed):
    """DistributedDataParallel: every rank holds the whole model and its own slice of the data;
    gradients are all-reduced in buckets during backward. The multi-GPU baseline.

    Expected: per-rank memory as on one GPU plus the communication buckets (about one more copy of
    the gradients, unless ``gradient_as_bucket_view``); throughput about ``nproc`` times one GPU's.
    """

    data_parallel = True
    axis = "sharding"
    offers = (offer("ddp"),)
    summary = "`DistributedDataParallel`; the multi-GPU baseline"

    @dataclass(frozen=True)
    class Config:
        gradient_as_bucket_view: bool = option(
            False, "gradients are views into the all-reduce buckets (saves a copy)"
        )

    def parallelize(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        if ctx.device.type == "cuda":
            ids = [ctx.device.index]
        else:
            ids = None
        self.model = nn.parallel.DistributedDataParallel(
            model, device_ids=ids, gradient_as_bucket_view=self.config.gradient_as_bucket_view
        )
        return self.model

    def proof(self, steps: int) -> dict[str, Any]:
        """Also that the ranks' parameters are still identical after the steps: the all-reduce
        happened."""
        import torch.distributed as dist

        checksum = (
            torch.stack([p.detach().double().sum() for p in self.model.parameters()]).sum().cpu()
        )
        sums = [None] * self.world_size
        dist.all_gather_object(sums, float(checksum))
        return super().proof(steps) | {
            "params_in_sync": max(sums) - min(sums) <= 1e-9 * max(1.0, abs(sums[0]))
        }


@TECHNIQUES.register("fsdp")
class FullyShard(_Distributed):
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) on every repeated block, then the root:
    parameters, gradients and optimizer state are split across ranks (ZeRO-3); each block's
    parameters are all-gathered just before use and freed after.

    Expected: per-rank model states of 16·Ψ/N bytes for Adam in fp32 (and for mixed-precision Adam),
    against DDP's 16·Ψ; activations as DDP's; throughput a little below DDP's from the extra
    gathers. With ``shard_group`` G (hybrid sharding), 16·Ψ/G, the gathers kept inside a group (a
    node), and the gradients all-reduced across the groups. With ``tensor_parallel`` T (2-D,
    torchtitan's FSDP × TP), each group of T neighbouring ranks splits every layer as
    ``tensor-parallel`` does and shares one batch, and FSDP shards across the N/T groups: the
    sharded layers' model states are 16·Ψ/N per rank.
    """

    data_parallel = True
    axis = "sharding"
    offers = (
        offer("fsdp"),
        offer("fsdp-bf16", mixed_precision="bfloat16"),
        offer("fsdp-keep", reshard_after_forward=False),
    )
    summary = (
        "FSDP2 `fully_shard` on each repeated block, then the root; `shard_group = 8`: hybrid "
        "sharding, sharded within each group of 8 ranks (a node) and replicated across groups; "
        "`tensor_parallel = 8`: 2-D, each group of 8 neighbouring ranks splits the layers as "
        "`tensor-parallel` does and shares a batch, and fsdp shards across the groups "
        "(torchtitan's FSDP × TP)"
    )

    @dataclass(frozen=True)
    class Config:
        reshard_after_forward: bool = option(
            True,
            "free gathered parameters after forward (ZeRO-3); false: keep them to backward "
            "(ZeRO-2-like)",
        )
        mixed_precision: Literal["none", "bfloat16", "float16"] = option(
            "none", "parameter dtype in forward and backward (gradients reduced in float32)"
        )
        cpu_offload: bool = option(
            False, "keep sharded parameters, gradients and optimizer step on the host (CUDA)"
        )
        shard_group: int = option(
            0,
            "ranks each shard spans, replicated across the groups (hybrid sharding, e.g. 8: within "
            "a node of 8); 0: all ranks",
        )
        tensor_parallel: int = option(
            0,
            "2-D: tensor parallelism over groups of this many ranks (e.g. 8: a node), fsdp across "
            "the groups; 0: none",
        )
        layout: Literal["blocks", "accelerate"] = option(
            "blocks",
            "blocks: each repeated block, then the root; accelerate: as the Trainer's FSDP2 "
            "(accelerate's fsdp2_prepare_model) lays out a transformers model, its reduction and "
            "outputs in mixed_precision's dtype",
        )
        wrap: str = option(
            "",
            "layout accelerate: the classes each wrapped unit is (fsdp_config's "
            "transformer_layer_cls_to_wrap, comma-separated); empty: the model's _no_split_modules",
        )
        activation_checkpointing: bool = option(
            False,
            "layout accelerate: each wrapped unit checkpointed first, non-reentrant (fsdp_config's "
            "activation_checkpointing, accelerate's fsdp2_apply_ac)",
        )

    @property
    def cuda_stand_ins(self) -> dict[str, str]:  # type: ignore[override]  as cpu_offload says
        """With cpu_offload, FSDP2's moves between host and device as the real run makes them."""
        if not self.config.cpu_offload:
            return {}
        fsdp = "torch.distributed.fsdp._fully_shard"
        return {
            f"{fsdp}._fsdp_param_group:foreach_reduce": "bench.predict.crossing:moving_across",
            f"{fsdp}._fsdp_param:FSDPParam.all_gather_inputs": (
                "bench.predict.crossing:gathered_from_host"
            ),
        }

    def problems(self, batch_size: int) -> list[str]:
        found = [
            f"{k} must be 0 or a number of ranks, got {v}"
            for k in ("shard_group", "tensor_parallel")
            if (v := getattr(self.config, k)) < 0
        ]
        if self.config.shard_group and self.config.tensor_parallel:
            found.append(
                "shard_group and tensor_parallel cannot be combined (hybrid sharding with tensor "
                "parallelism, 3-D, is not offered); set one to 0"
            )
        if self.config.layout == "accelerate" and self.config.tensor_parallel:
            found.append("layout = 'accelerate' shards one dimension; set tensor_parallel to 0")
        if self.config.layout != "accelerate" and (
            self.config.wrap or self.config.activation_checkpointing
        ):
            found.append("wrap and activation_checkpointing are layout = 'accelerate''s")
        return found

    def replicas(self, world_size: int) -> int:
        return world_size // (self.config.tensor_parallel or 1)

    def unsupported(self, ctx: RunContext) -> str | None:
        for key in ("shard_group", "tensor_parallel"):
            if (group := getattr(self.config, key)) and ctx.world_size % group:
                return (
                    f"{key} {group} does not divide the {ctx.world_size} processes; choose a "
                    "divisor"
                )
        if self.config.tensor_parallel == ctx.world_size:
            return (
                "tensor_parallel over all the processes leaves none to shard across; use "
                "tensor-parallel"
            )
        if missing := self._missing_classes(ctx):
            return f"wrap: no {', '.join(missing)} in {ctx.model_spec.name}"
        if self.config.cpu_offload and not ctx.cuda:
            return (
                "cpu_offload moves sharded states to host memory; on a CPU they are there already"
            )
        return super().unsupported(ctx)

    def _missing_classes(self, ctx: RunContext) -> list[str]:
        """The classes ``wrap`` names that the model has none of (accelerate raises on one)."""
        if self.config.layout != "accelerate" or not self.config.wrap:
            return []
        with torch.device("meta"):
            found = {type(m).__name__ for m in ctx.model_spec.build(ctx.shapes).modules()}
        return [c for c in _names(self.config.wrap) if c not in found]

    def parallelize(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        kwargs: dict[str, Any] = {
            "mesh": self._mesh(model, ctx),
            "reshard_after_forward": self.config.reshard_after_forward,
            "offload_policy": CPUOffloadPolicy() if self.config.cpu_offload else OffloadPolicy(),
        }
        if self.config.layout == "accelerate":
            self.model, self.units = _as_accelerate_shards(model, kwargs, self.config)
            return self.model
        if self.config.mixed_precision != "none":
            dtype = getattr(torch, self.config.mixed_precision)
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=dtype, reduce_dtype=torch.float32
            )
        blocks = ctx.model_spec.blocks(model)
        for name in blocks:
            fully_shard(model.get_submodule(name), **kwargs)
        self.model, self.units = fully_shard(model, **kwargs), len(blocks) + 1
        return self.model

    def _mesh(self, model: nn.Module, ctx: RunContext) -> Any:
        """The mesh FSDP shards over; under 2-D, the outer dimension, once tensor parallelism took
        the inner."""
        if not (size := self.config.tensor_parallel):
            return _mesh(ctx, self.config.shard_group)
        mesh = _mesh(ctx, size, ("fsdp", "tp"))
        self.sharded_linears = _tensor_parallel(model, mesh["tp"], ctx)
        return mesh["fsdp"]

    def proof(self, steps: int) -> dict[str, Any]:
        if self.config.tensor_parallel:
            tp = {"sharded_linears": self.sharded_linears}
        else:
            tp = {}
        return super().proof(steps) | {"sharded_modules": self.units} | tp


def _as_accelerate_shards(
    model: nn.Module, kwargs: dict[str, Any], config: FullyShard.Config
) -> tuple[nn.Module, int]:
    """``model`` sharded as the Trainer's FSDP2 shards a transformers model (accelerate 1.x's
    ``fsdp2_apply_ac`` and ``fsdp2_prepare_model``): with ``activation_checkpointing``, each module
    of a wrapped class (``wrap``, else those ``_no_split_modules`` names) checkpointed first; in
    mixed precision, every trainable parameter not in float32 upcast to it (the master copy) and
    the policy reducing and returning in that dtype too; each module of a wrapped class, children
    before parents; the input embeddings alone, unless tied to the output's; the final norm and the
    output embeddings (the tied input ones too) as one unit kept gathered after forward; the root
    left to torch's default for it (kept gathered). The root, and how many units it was cut
    into."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    wrapped = set(_wrapped_classes(model, config.wrap))
    if config.activation_checkpointing:
        for name, module in _bottom_up(model)[:-1]:
            if type(module).__name__ in wrapped:
                model.set_submodule(name, checkpoint_wrapper(module, preserve_rng_state=False))
    if config.mixed_precision != "none":
        dtype = getattr(torch, config.mixed_precision)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, output_dtype=dtype)
        kwargs = kwargs | {"mp_policy": policy}
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.to(torch.float32)
    units = 0
    for _, module in _bottom_up(model)[:-1]:
        if type(module).__name__ in wrapped and not isinstance(module, FSDPModule):
            fully_shard(module, **kwargs)
            units += 1
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    out = getattr(model, "get_output_embeddings", lambda: None)()
    tied = embed is not None and out is not None and embed.weight is out.weight
    if not tied and embed is not None and not isinstance(embed, FSDPModule):
        fully_shard(embed, **kwargs)
        units += 1
    tail = [m for m in (_final_norm(model), *((embed,) if tied else ()), out) if m is not None]
    if tail := [m for m in tail if not isinstance(m, FSDPModule)]:
        fully_shard(tail, **(kwargs | {"reshard_after_forward": False}))
        units += 1
    root = {k: v for k, v in kwargs.items() if k != "reshard_after_forward"}
    return fully_shard(model, **root), units + 1


def _wrapped_classes(model: nn.Module, wrap: str) -> list[str]:
    """The classes each unit is: ``wrap``'s names, else the model's ``_no_split_modules``."""
    return _names(wrap) or list(getattr(model, "_no_split_modules", None) or ())


def _names(wrap: str) -> list[str]:
    return [name.strip() for name in wrap.split(",") if name.strip()]


def _bottom_up(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module and its name, children before their parents, the model last (accelerate's
    ``get_module_children_bottom_up``: a stack popped depth first, its order reversed)."""
    stack, ordered = [("", model)], []
    while stack:
        name, current = stack.pop()
        stack.extend((f"{name}.{n}" if name else n, m) for n, m in current.named_children())
        ordered.append((name, current))
    return ordered[::-1]


def _final_norm(model: nn.Module) -> nn.Module | None:
    """The last child of the base model whose class names a norm (accelerate's
    ``_find_final_norm``: Llama's ``model.norm``)."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else model
    if not isinstance(base, nn.Module):
        return None
    return next((m for m in reversed(list(base.children())) if "Norm" in type(m).__name__), None)


@TECHNIQUES.register("tensor-parallel")
class TensorParallel(_Distributed):
    """Megatron-style tensor parallelism (``torch.distributed.tensor.parallel``): in each
    transformer layer the first linear of a pair is split by output columns and the second by input
    rows, so the pair needs one all-reduce. BERT: query/key/value column-wise, the attention output
    row-wise, the MLP column- then row-wise. torchvision's ViT: its MLP (its attention is one packed
    ``nn.MultiheadAttention`` that this plan leaves whole). Every rank sees the same batch.

    Expected: the sharded layers' weights, gradients and optimizer state divided by N per rank, and
    the activations inside each pair; embeddings, norms and the head stay whole.
    """

    not_advised = (
        "splits each layer over the GPUs of one node, with its own batch semantics; advice shards "
        "with FSDP"
    )
    summary = (
        "`torch.distributed.tensor.parallel`: attention q/k/v and MLP up column-wise, their output "
        "projections row-wise (BERT); Llama's q/k/v and gate/up column-wise, o and down row-wise "
        "(its heads and key-value heads must divide N); the MLP only in torchvision's ViT, whose "
        "attention is one packed module"
    )

    def parallelize(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.sharded = _tensor_parallel(model, _mesh(ctx), ctx)
        self.model = model
        return model

    def proof(self, steps: int) -> dict[str, Any]:
        return super().proof(steps) | {"sharded_linears": self.sharded}


def _tensor_parallel(model: nn.Module, mesh: Any, ctx: RunContext) -> int:
    """``model``'s linear pairs split in place over the 1-D ``mesh``; the number of linears
    split."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = _tp_plan(model)
    if not plan:
        raise Unsupported(f"{ctx.model_spec.name} has no transformer linear pairs to shard")
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        if (heads := getattr(config, key, None)) and heads % mesh.size():
            raise Unsupported(
                f"{heads} {key.removeprefix('num_').replace('_', ' ')} do not split over "
                f"{mesh.size()} ranks; choose a divisor"
            )
    parallelize_module(model, mesh, plan)
    return len(plan)


def _tp_plan(model: nn.Module) -> dict[str, Any]:
    """Module name → ColwiseParallel / RowwiseParallel, found by the layer classes of the three
    families."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}

    def pair(name: str, columns: tuple[str, ...], row: str) -> None:
        plan.update(
            {f"{name}.{k}": ColwiseParallel() for k in columns}
            | {f"{name}.{row}": RowwiseParallel()}
        )

    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind.endswith("SelfAttention") and all(
            hasattr(module, k) for k in ("query", "key", "value")
        ):
            plan |= {f"{name}.{k}": ColwiseParallel() for k in ("query", "key", "value")}
        elif kind.endswith("SelfOutput"):  # attention's output projection
            plan[f"{name}.dense"] = RowwiseParallel()
        elif kind.endswith("Intermediate"):
            plan[f"{name}.dense"] = ColwiseParallel()
        elif kind.endswith("Output") and hasattr(module, "dense") and f"{name}.dense" not in plan:
            plan[f"{name}.dense"] = RowwiseParallel()  # the MLP's down projection (BertOutput)
        elif all(hasattr(module, k) for k in ("q_proj", "k_proj", "v_proj", "o_proj")):
            # Llama's attention
            pair(name, ("q_proj", "k_proj", "v_proj"), "o_proj")
        elif all(hasattr(module, k) for k in ("gate_proj", "up_proj", "down_proj")):
            # Llama's gated MLP
            pair(name, ("gate_proj", "up_proj"), "down_proj")
        elif kind == "MLPBlock":  # torchvision ViT: Linear, GELU, Dropout, Linear, Dropout
            plan |= {f"{name}.0": ColwiseParallel(), f"{name}.3": RowwiseParallel()}
    return plan
