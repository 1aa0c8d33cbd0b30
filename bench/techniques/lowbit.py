"""Low-bit numerics from optional packages: 8-bit optimizer state, int8 frozen weights, FP8 matmuls.

Each needs a package the harness does not require (torchao; bitsandbytes for the optimizer); without
it the run is ``unsupported`` with the install hint, never a crash or a silent no-op.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from bench.techniques.base import (
    ANY_MODE,
    SERVING,
    TECHNIQUES,
    RunContext,
    Technique,
    Unsupported,
    offer,
    option,
)

HEADS = ("classifier", "heads", "fc")  # classification heads stay in full precision and trainable


def _has(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _is_head(fqn: str) -> bool:
    return any(part in HEADS for part in fqn.split("."))


def quantize_body_linears(model: nn.Module, config: Any, freeze: bool) -> list[str]:
    """torchao ``quantize_`` with ``config`` on every plain ``nn.Linear`` except the classification
    head and LoRA adapters (optionally frozen first); returns their names. Exact type: torchvision
    attention's out_proj (a Linear subclass) is used transposed, which torchao's tensors cannot
    serve."""
    from torchao.quantization import quantize_

    picked: list[str] = []

    def body_linear(module: nn.Module, fqn: str) -> bool:
        pick = type(module) is nn.Linear and not _is_head(fqn) and "lora_" not in fqn
        if pick:
            if freeze:
                module.requires_grad_(False)
            picked.append(fqn)
        return pick

    quantize_(model, config, filter_fn=body_linear)
    if not picked:
        # a model of convolutions, say: a run that quantized nothing would pass for one that did
        raise Unsupported(f"no nn.Linear outside the head ({', '.join(HEADS)}) to quantize")
    return picked


@TECHNIQUES.register("adamw-8bit")
class AdamW8bit(Technique):
    """AdamW with both moments stored blockwise-quantized in 8 bits (torchao ``AdamW8bit``; else
    bitsandbytes on CUDA).

    Expected: optimizer state from 8 to about 2 bytes per parameter (BERT-large, V100: 14949 → 13085
    MB and slightly faster, HF perf_train_gpu_one). Accuracy: close to AdamW; quantization noise in
    the moments can show on small models.
    """

    axis = "optimizer"
    offers = (offer("adamw-8bit"),)
    summary = "torchao `AdamW8bit` (bitsandbytes on CUDA)"
    compiled_update = True  # torchao compiles each parameter's update with fullgraph=True
    conflicts = frozenset({"optimizer", "optimizer-in-backward"})

    @dataclass(frozen=True)
    class Config:
        lr: float | None = option(
            None, "learning rate (default: the run's, as the default AdamW uses)"
        )

    def unsupported(self, ctx: RunContext) -> str | None:
        if _has("torchao") or (_has("bitsandbytes") and ctx.device.type == "cuda"):
            return None
        return "needs torchao (pip install torchao) or, on CUDA, bitsandbytes"

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.lr = self.config.lr or ctx.lr
        return model

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        if _has("torchao"):
            from torchao.optim import AdamW8bit as Optimizer
            from torchao.optim.subclass_8bit import OptimState8bit

            # torchao caches its two code books on first use. Made from a prediction's fake tensors,
            # whose values read as 1, they would quantize every real moment after it in this process
            # to ones; so they are made here from real ones, whatever mode is active.
            with _disable_current_modes():
                for signed in (True, False):
                    OptimState8bit.zeros((256,), signed)
        else:
            from bitsandbytes.optim import AdamW8bit as Optimizer
        self.optimizer = Optimizer(params, lr=self.lr)
        return self.optimizer

    def proof(self, steps: int) -> dict[str, Any]:
        return {"optimizer": f"{type(self.optimizer).__module__}.{type(self.optimizer).__name__}"}


@TECHNIQUES.register("adamw-4bit")
class AdamW4bit(Technique):
    """AdamW with both moments stored blockwise-quantized in 4 bits (torchao ``AdamW4bit``), as the
    Trainer makes it for ``optim = "adamw_torch_4bit"`` (blocks of 256 there).

    Expected: optimizer state from 8 to about 1 byte per parameter (two 4-bit moments and a scale
    per block). Accuracy: close to AdamW on fine-tuning (arXiv:2309.01507); the 4-bit moments'
    noise shows sooner than 8-bit's."""

    not_advised = (
        "the Trainer's optim = adamw_torch_4bit, read from its arguments; advice weighs adamw-8bit"
    )
    summary = "torchao `AdamW4bit`: both moments in 4 bits, blockwise"
    compiled_update = True  # as AdamW8bit's, each parameter's update compiled with fullgraph=True
    conflicts = frozenset({"optimizer", "optimizer-in-backward", "adamw-8bit"})

    @dataclass(frozen=True)
    class Config:
        lr: float | None = option(
            None, "learning rate (default: the run's, as the default AdamW uses)"
        )
        block_size: int = option(128, "values per quantization block (torchao's default)")

    def problems(self, batch_size: int) -> list[str]:
        if self.config.block_size >= 1:
            return []
        return [f"block_size must be ≥ 1, got {self.config.block_size}"]

    def unsupported(self, ctx: RunContext) -> str | None:
        return None if _has("torchao") else "needs torchao (pip install torchao)"

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.lr = self.config.lr or ctx.lr
        return model

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        from torchao.optim import AdamW4bit as Optimizer
        from torchao.optim.subclass_4bit import OptimState4bit

        # its code books made from real tensors, as adamw-8bit's are (fake ones read as 1)
        with _disable_current_modes():
            for signed in (True, False):
                OptimState4bit.zeros((self.config.block_size,), signed, self.config.block_size)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = Optimizer(params, lr=self.lr, block_size=self.config.block_size)
        return self.optimizer

    def proof(self, steps: int) -> dict[str, Any]:
        return {"optimizer": type(self.optimizer).__name__, "block_size": self.config.block_size}


@TECHNIQUES.register("paged-adamw-8bit")
class PagedAdamW8bit(Technique):
    """bitsandbytes' paged 8-bit AdamW, as the Trainer builds it for ``optim="paged_adamw_8bit"``
    (QLoRA's optimizer): ``bitsandbytes.optim.AdamW`` with ``optim_bits=8, is_paged=True``. Both
    moments are blockwise 8-bit (a float32 absmax per 256 values; parameters under 4,096 elements
    keep float32 moments), and each moment of a parameter of 100,000 elements or more lives in CUDA
    unified memory (``cudaMallocManaged``), which the driver pages to the host when the device runs
    short instead of failing.

    Expected: PyTorch's allocator never holds the paged moments (bitsandbytes wraps the managed
    pointer in a host tensor), so ``max_memory_allocated`` falls by about 2 bytes per parameter
    against adamw-8bit; ``nvidia-smi`` still counts the pages while they sit on the device. The
    QLoRA paper (arXiv:2305.14314) uses them to ride out the memory spikes of long sequences.
    Accuracy: as adamw-8bit. On a CPU there is nothing to page (bitsandbytes falls back to its plain
    8-bit AdamW, which adamw-8bit stands for), so it is a CUDA technique."""

    axis = "optimizer"
    bits: ClassVar[int] = 8  # the moments'
    offers = (offer("paged-adamw-8bit"),)
    summary = (
        "bitsandbytes `AdamW(optim_bits=8, is_paged=True)` (the Trainer's `paged_adamw_8bit`; CUDA)"
    )
    conflicts = frozenset({"optimizer", "optimizer-in-backward", "adamw-8bit"})
    stand_ins = {
        "bitsandbytes.optim.optimizer:Optimizer8bit.get_state_buffer": (
            "bench.predict.stand_ins:paged_buffer"
        )
    }

    @dataclass(frozen=True)
    class Config:
        lr: float | None = option(
            None, "learning rate (default: the run's, as the default AdamW uses)"
        )
        embeddings_32bit: bool = option(
            False, "as the Trainer builds it: each nn.Embedding's moments in 32 bits"
        )

    def unsupported(self, ctx: RunContext) -> str | None:
        if not ctx.cuda:
            return (
                "pages CUDA unified memory; on a CPU bitsandbytes falls back to the 8-bit AdamW of "
                "adamw-8bit"
            )
        if not _has("bitsandbytes"):
            return "needs bitsandbytes: pip install bitsandbytes (or pip install -e '.[extras]')"
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.lr = self.config.lr or ctx.lr
        return model

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        from bitsandbytes.optim import AdamW

        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = AdamW(params, lr=self.lr, optim_bits=self.bits, is_paged=True)
        own_overrides(self.optimizer, model, getattr(self.config, "embeddings_32bit", False))
        return self.optimizer

    def proof(self, steps: int) -> dict[str, Any]:
        moments = [
            t
            for s in self.optimizer.state.values()
            for k, t in s.items()
            if k in ("state1", "state2")
        ]
        paged = [t for t in moments if getattr(t, "is_paged", False)]
        return {
            "paged_moments": len(paged),
            "paged_bytes": sum(t.nbytes for t in paged),
            "device_moment_bytes": sum(
                t.nbytes for t in moments if not getattr(t, "is_paged", False)
            ),
        }


@TECHNIQUES.register("paged-adamw-32bit")
class PagedAdamW32bit(PagedAdamW8bit):
    """bitsandbytes' paged AdamW with float32 moments, as the Trainer builds it for
    ``optim="paged_adamw_32bit"`` (the QLoRA paper's own script): ``bitsandbytes.optim.AdamW``
    with ``optim_bits=32, is_paged=True``. Each moment of a parameter of 100,000 elements or more
    lives in CUDA unified memory, the others on the device.

    Expected: PyTorch's allocator holds only the small parameters' moments, so against the default
    AdamW ``max_memory_allocated`` falls by about 8 bytes per parameter of the large ones;
    ``nvidia-smi`` still counts the pages while they sit on the device. Accuracy: AdamW's own
    (float32 moments). On a CPU there is nothing to page, so it is a CUDA technique."""

    bits: ClassVar[int] = 32
    offers = (offer("paged-adamw-32bit"),)
    summary = (
        "bitsandbytes `AdamW(optim_bits=32, is_paged=True)` (the Trainer's `paged_adamw_32bit`; "
        "CUDA)"
    )
    conflicts = frozenset({"optimizer", "optimizer-in-backward", "adamw-8bit", "paged-adamw-8bit"})

    @dataclass(frozen=True)
    class Config:  # no embeddings' override: the Trainer registers it for 8 bits alone
        lr: float | None = option(
            None, "learning rate (default: the run's, as the default AdamW uses)"
        )


@TECHNIQUES.register("int8-weights")
class Int8FrozenWeights(Technique):
    """Freeze every linear layer except the classification head (and LoRA adapters) and store its
    weight as int8 with a per-channel scale (torchao ``Int8WeightOnlyConfig``): the QLoRA recipe
    with int8 instead of NF4. Combine with ``lora`` so the model still learns.

    Expected: frozen linear weights 4 → ~1 byte per parameter, no gradients or optimizer state for
    them; activations unchanged. Accuracy: the frozen base loses precision; alone (no adapters) most
    of the model no longer trains.
    """

    modes = ANY_MODE
    not_advised = "freezes the linear layers: with lora, it trains adapters only, another job"
    summary = "torchao int8 weight-only storage of frozen linear layers (pair with `lora`)"

    def unsupported(self, ctx: RunContext) -> str | None:
        # What no install changes first: installing torchao would not make it apply.
        if ctx.model_spec.family == "resnet":
            return (
                "ResNet's only linear layer is its head; int8 convolutions for training are out of "
                "scope"
            )
        if not _has("torchao"):
            return "needs torchao: pip install torchao (or pip install -e '.[extras]')"
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        from torchao.quantization import Int8WeightOnlyConfig

        self.quantized = quantize_body_linears(model, Int8WeightOnlyConfig(), freeze=True)
        return model

    def proof(self, steps: int) -> dict[str, Any]:
        return {"quantized_linears": len(self.quantized)}


class BnbLoaded(Technique):
    """What loading a model quantized by bitsandbytes shares, as transformers loads a
    ``BitsAndBytesConfig``: every ``nn.Linear`` but the head and ``skip``'s replaced by the
    subclass's layer (``layer``), then peft's k-bit casts where ``prepare``; proven by the count of
    layers replaced (``proof_key``)."""

    modes = ANY_MODE
    not_advised = "freezes the linear layers: with lora, it trains adapters only, another job"
    proof_key: ClassVar[str]

    def unsupported(self, ctx: RunContext) -> str | None:
        if not _has("bitsandbytes"):
            return "needs bitsandbytes: pip install bitsandbytes (or pip install -e '.[extras]')"
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.quantized = _loaded_quantized(model, self.config, self.layer)
        return model

    @staticmethod
    def layer(model: nn.Module, name: str, linear: nn.Linear, config: Any) -> None:
        raise NotImplementedError

    def proof(self, steps: int) -> dict[str, Any]:
        return {self.proof_key: len(self.quantized)}


@TECHNIQUES.register("bnb-4bit")
class Bnb4bit(BnbLoaded):
    """The model as transformers loads it with ``BitsAndBytesConfig(load_in_4bit=True)``: every
    ``nn.Linear`` but the output head (and the modules ``skip`` names, as
    ``llm_int8_skip_modules``) becomes a frozen bitsandbytes ``Linear4bit``, its weight quantized in
    blocks of 64 (NF4 or FP4, ``quant_type``; with ``double_quant`` the blocks' float32 scales
    quantized again to 8 bits in blocks of 256), computed in ``compute_dtype``. With ``prepare``
    (QLoRA's scripts and TRL's SFTTrainer call it), peft's ``prepare_model_for_kbit_training``
    then freezes the model and upcasts every 16-bit parameter left (norms, embeddings, head) to
    float32. Pair with ``lora`` for QLoRA (arXiv:2305.14314).

    Expected: the linears' weights from 2 bytes to about 0.5 a parameter plus their scales (4
    bytes per 64, or about 1.1 per 64 double-quantized); each linear dequantizes its weight in
    forward and backward, a temporary of the weight's size in ``compute_dtype``. Accuracy: the
    frozen base loses precision; alone (no adapters) nothing but the head trains."""

    summary = (
        "bitsandbytes `Linear4bit` for every linear but the head, as transformers loads "
        "`load_in_4bit` (NF4/FP4, double quantization, compute dtype), peft's k-bit casts"
    )
    cuda_stand_ins = {"bitsandbytes:matmul_4bit": "bench.predict.cuda:matmul_4bit"}
    proof_key = "bnb_4bit_linears"

    @dataclass(frozen=True)
    class Config:
        quant_type: Literal["fp4", "nf4"] = option("fp4", "the 4-bit type (transformers' default)")
        double_quant: bool = option(False, "quantize the blocks' scales too (QLoRA's recipe)")
        compute_dtype: Literal["float32", "bfloat16", "float16"] = option(
            "float32", "what each linear dequantizes its weight to and computes in"
        )
        storage: Literal["uint8", "bfloat16", "float16", "float32"] = option(
            "uint8", "the dtype the packed 4-bit values are stored in (bnb_4bit_quant_storage)"
        )
        skip: str = option("", "comma-separated module names kept as they are, besides the head")
        prepare: bool = option(True, "peft's prepare_model_for_kbit_training casts after")

    @staticmethod
    def layer(model: nn.Module, name: str, linear: nn.Linear, config: Any) -> None:
        _to_4bit(model, name, linear, config)


@TECHNIQUES.register("bnb-8bit")
class Bnb8bit(BnbLoaded):
    """The model as transformers loads it with ``BitsAndBytesConfig(load_in_8bit=True)``
    (LLM.int8(), arXiv:2208.07339): every ``nn.Linear`` but the output head (and the modules
    ``skip`` names, as ``llm_int8_skip_modules``) becomes a frozen bitsandbytes ``Linear8bitLt``,
    its weight int8 by rows with a float32 absmax a row, ``threshold`` its outlier threshold
    (``llm_int8_threshold``). On CUDA each linear quantizes its input by rows to int8 (a float16
    copy first), multiplies into int32 and dequantizes to float16; backward dequantizes the weight
    to the input's dtype. On a CPU bitsandbytes dequantizes the weight and multiplies in the
    input's dtype instead (``MatMul8bitFp``). With ``prepare``, peft's
    ``prepare_model_for_kbit_training`` casts as for bnb-4bit. Pair with ``lora``.

    Expected: the linears' weights from 2 bytes to 1 a parameter plus 4 bytes a row; each linear's
    int32 product, a temporary of 4 bytes per output value. Accuracy: LLM.int8's outlier columns
    keep 16-bit precision where an input passes ``threshold``; frozen otherwise, as bnb-4bit."""

    summary = (
        "bitsandbytes `Linear8bitLt` for every linear but the head, as transformers loads "
        "`load_in_8bit` (LLM.int8's threshold), peft's k-bit casts"
    )
    conflicts = frozenset({"bnb-4bit"})
    cuda_stand_ins = {"bitsandbytes:matmul": "bench.predict.cuda:matmul_8bit"}
    proof_key = "bnb_8bit_linears"

    @dataclass(frozen=True)
    class Config:
        threshold: float = option(6.0, "the outlier threshold (llm_int8_threshold; 0: none)")
        skip: str = option("", "comma-separated module names kept as they are, besides the head")
        prepare: bool = option(True, "peft's prepare_model_for_kbit_training casts after")

    @staticmethod
    def layer(model: nn.Module, name: str, linear: nn.Linear, config: Any) -> None:
        _to_8bit(model, name, linear, config)


def _loaded_quantized(model: nn.Module, config: Any, to: Any) -> list[str]:
    """Every ``nn.Linear`` of ``model`` but the output head and those ``config.skip`` names
    replaced by ``to`` (a quantized layer), then, where ``config.prepare``, peft's k-bit casts, as
    transformers loads a bitsandbytes config and QLoRA's scripts and TRL prepare it; their names."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skipped = {name for name in config.skip.split(",") if name}
    quantized = [
        name
        for name, linear in model.named_modules()
        if type(linear) is nn.Linear and linear is not head and not skipped & set(name.split("."))
    ]
    for name in quantized:
        to(model, name, model.get_submodule(name), config)
    if not quantized:
        raise Unsupported("no nn.Linear besides the head to quantize")
    if config.prepare:
        from peft import prepare_model_for_kbit_training

        # checkpointing is the job's own choice (its checkpoint technique), as TRL passes it
        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return quantized


def _to_4bit(model: nn.Module, name: str, linear: nn.Linear, config: Any) -> None:
    """``linear`` replaced in ``model`` by bitsandbytes' ``Linear4bit`` holding its weight
    quantized, as transformers' loader leaves it. A fake weight (a prediction) is kept as a
    parameter of the packed values carrying the quantization state, as ``Params4bit`` does: that
    class wraps its data as a plain subclass, which fake tensors refuse."""
    import bitsandbytes as bnb
    from bitsandbytes import functional as bnb_functional
    from torch._subclasses.fake_tensor import FakeTensor

    storage = getattr(torch, config.storage)
    with _disable_current_modes():  # a real module on the meta device; its weight set below
        if "dynamic" not in bnb_functional.name2qmap:  # the scales' code book, made from values
            bnb_functional.name2qmap["dynamic"] = bnb_functional.create_dynamic_map()
        module = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=getattr(torch, config.compute_dtype),
            compress_statistics=config.double_quant,
            quant_type=config.quant_type,
            quant_storage=storage,
            device="meta",
        )
    weight = linear.weight.detach()
    packed, state = bnb_functional.quantize_4bit(
        weight,
        blocksize=64,
        compress_statistics=config.double_quant,
        quant_type=config.quant_type,
        quant_storage=storage,
    )
    if isinstance(weight, FakeTensor):
        param = nn.Parameter(packed, requires_grad=False)
        for key, value in {
            "quant_state": state,
            "quant_type": config.quant_type,
            "blocksize": 64,
            "compress_statistics": config.double_quant,
            "quant_storage": storage,
            "bnb_quantized": True,
            "module": module,
        }.items():
            setattr(param, key, value)
    else:
        param = bnb.nn.Params4bit(
            packed,
            requires_grad=False,
            quant_state=state,
            blocksize=64,
            compress_statistics=config.double_quant,
            quant_type=config.quant_type,
            quant_storage=storage,
            bnb_quantized=True,
            module=module,
        )
    _installed(model, name, module, weight=param, linear=linear)


def _to_8bit(model: nn.Module, name: str, linear: nn.Linear, config: Any) -> None:
    """``linear`` replaced in ``model`` by bitsandbytes' ``Linear8bitLt`` holding its weight
    quantized by rows (``Int8Params._quantize``: a float16 copy, then int8 and a float32 absmax a
    row), as transformers' loader leaves it; a fake weight is a parameter of the int8 values
    carrying the statistics, as ``_to_4bit``'s is."""
    import bitsandbytes as bnb
    from bitsandbytes import functional as bnb_functional
    from torch._subclasses.fake_tensor import FakeTensor

    with _disable_current_modes():  # a real module on the meta device; its weight set below
        module = bnb.nn.Linear8bitLt(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            has_fp16_weights=False,
            threshold=config.threshold,
            device="meta",
        )
    weight = linear.weight.detach()
    rows, stats, _ = bnb_functional.int8_vectorwise_quant(weight.contiguous().to(torch.float16))
    if isinstance(weight, FakeTensor):
        param = nn.Parameter(rows, requires_grad=False)
        param.CB, param.SCB, param.has_fp16_weights = rows, stats, False
    else:
        param = bnb.nn.Int8Params(
            rows, requires_grad=False, has_fp16_weights=False, CB=rows, SCB=stats
        )
    _installed(model, name, module, weight=param, linear=linear)


def _installed(
    model: nn.Module, name: str, module: nn.Module, weight: nn.Parameter, linear: nn.Linear
) -> None:
    """``module`` in ``linear``'s place, its weight ``weight`` and its bias ``linear``'s, frozen."""
    module._parameters["weight"] = weight
    if linear.bias is not None:
        module._parameters["bias"] = nn.Parameter(linear.bias.detach(), requires_grad=False)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


@TECHNIQUES.register("int4-weights")
class Int4Weights(Technique):
    """Every linear layer except the classification head stored as 4-bit integers in groups of
    ``group_size`` with a bfloat16 scale and zero point each (torchao ``Int4WeightOnlyConfig``, its
    tinygemm layout), for serving: the weights are frozen. tinygemm's kernels are CUDA's and take
    bfloat16 activations: pair it with ``half`` in bfloat16.

    Expected: linear weights 2 → about 0.56 bytes per parameter in bfloat16 (4 bits, and a scale and
    zero point per 128); the embedding and the head stay as they are. Decoding is memory-bound, so
    it speeds up roughly with the bytes read. Accuracy: a small perplexity loss at 4 bits (torchao's
    README).
    """

    modes = SERVING
    not_advised = "advice ranks plans by their prediction, and fake tensors cannot predict this one"
    unpredictable = "tinygemm packs the weights with a CUDA kernel that fake tensors cannot run"
    summary = "torchao int4 weight-only linear layers (tinygemm, CUDA, bfloat16) for serving"

    @dataclass(frozen=True)
    class Config:
        group_size: int = option(128, "weights sharing a scale and zero point: 32, 64, 128 or 256")

    def problems(self, batch_size: int) -> list[str]:
        sizes = (32, 64, 128, 256)
        if self.config.group_size not in sizes:
            return [f"int4-weights: group_size must be one of {', '.join(map(str, sizes))}"]
        return []

    def unsupported(self, ctx: RunContext) -> str | None:
        if not ctx.cuda:
            return (
                "torchao's int4 weights run on CUDA here (tinygemm); its CPU layouts need the mslk "
                "package"
            )
        if not _has("torchao"):
            return "needs torchao: pip install torchao (or pip install -e '.[extras]')"
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        from torchao.quantization import Int4WeightOnlyConfig

        dtypes = {p.dtype for p in model.parameters()}
        if dtypes != {torch.bfloat16}:
            raise Unsupported(
                f"tinygemm takes bfloat16 weights, these are {sorted(map(str, dtypes))}: put half "
                "(bfloat16) first"
            )
        config = Int4WeightOnlyConfig(
            group_size=self.config.group_size, int4_packing_format="tile_packed_to_4d"
        )
        self.quantized = quantize_body_linears(model, config, freeze=True)
        return model

    def proof(self, steps: int) -> dict[str, Any]:
        return {"quantized_linears": len(self.quantized)}


@TECHNIQUES.register("fp8")
class FP8Training(Technique):
    """FP8 matmuls for every linear layer with dimensions divisible by 16 (torchao
    ``convert_to_float8_training``, dynamic tensorwise scaling); Hopper-class GPUs (compute
    capability 8.9+) only. A model with no such layer (ResNet-50: its one linear is the 2048→1000
    head) is unsupported rather than run unchanged.

    Expected: on H100, up to ~1.5× faster linear layers than bf16. Memory does not go down: torchao
    keeps each linear's input for backward in its own precision and casts it again there, and the
    casts' temporaries raise the peak a little; weights and optimizer state unchanged (fp32 master).
    Accuracy: close to bf16 with dynamic scaling.
    """

    not_advised = (
        "float8 matmuls need a card of compute capability 8.9 or more, and no record measured them "
        "yet"
    )
    summary = (
        "torchao float8 training for every linear layer whose dimensions divide by 16 (compute "
        "capability ≥ 8.9); a model with none (ResNet-50) is unsupported, not run unchanged"
    )

    def unsupported(self, ctx: RunContext) -> str | None:
        if not ctx.cuda:
            return "FP8 tensor cores are a GPU feature (compute capability ≥ 8.9)"
        # A prediction stands for a card that has them: what the step keeps does not depend on which
        # card.
        if ctx.device.type == "cuda" and torch.cuda.get_device_capability(ctx.device) < (8, 9):
            has = torch.cuda.get_device_capability(ctx.device)
            return f"FP8 needs compute capability ≥ 8.9, this GPU has {has}"
        return (
            None  # torchao is asked for in apply, once the model shows FP8 would convert something
        )

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        # else the run would be the baseline under another name
        if not any(_fp8_eligible(m) for _, m in linears):
            found = (
                ", ".join(f"{n} {m.in_features}→{m.out_features}" for n, m in linears[:3]) or "none"
            )
            raise Unsupported(
                "no linear layer with both dimensions divisible by 16, as FP8 matmuls need "
                f"(linears: {found}): nothing would run in FP8"
            )
        # What no install changes comes first: installing torchao would not make FP8 apply to such a
        # model.
        if not _has("torchao"):
            raise Unsupported("needs torchao: pip install torchao")
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(
            model, module_filter_fn=lambda module, fqn: _fp8_eligible(module)
        )
        self.converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        return model

    def proof(self, steps: int) -> dict[str, Any]:
        return {"float8_linears": self.converted}


def _fp8_eligible(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.Linear)
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def own_overrides(optimizer: Any, model: nn.Module, embeddings_32bit: bool) -> None:
    """``optimizer`` (bitsandbytes') reading its per-parameter overrides from a manager of its own,
    holding, where ``embeddings_32bit``, the Trainer's: each ``nn.Embedding``'s weight in 32 bits
    (``Trainer.create_optimizer`` registers it for any 8-bit bitsandbytes optimizer). bitsandbytes'
    manager is one per process, and it keys an override by the parameter's place in its group, so
    another optimizer's overrides would reach this one's parameter at the same place (a process
    predicting several runs, or a test beside a Trainer's)."""
    from bitsandbytes.optim import GlobalOptimManager

    own = GlobalOptimManager.__new__(GlobalOptimManager)
    own.initialize()
    if embeddings_32bit:
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                own.register_module_override(module, "weight", {"optim_bits": 32})
    optimizer.mng = own


class BnbOptimizer(Technique):
    """What bitsandbytes' optimizers share, as the Trainer builds them
    (``_get_bitsandbytes_optimizer``): the trainable parameters in one group, their state in 32
    bits or, from 4,096 elements, blockwise 8-bit (a float32 absmax per 256 values, and one
    256-entry code book per kind of buffer, shared by every parameter); paged, a buffer of a
    parameter of 100,000 elements or more lives in CUDA unified memory, out of the allocator's
    reach. A subclass names its optimizer (``made``)."""

    not_advised = "another optimizer than AdamW, whose learning rate wants retuning"
    conflicts = frozenset(
        {"optimizer", "optimizer-in-backward", "adamw-8bit", "paged-adamw-8bit", "adamw-4bit"}
    )
    stand_ins = PagedAdamW8bit.stand_ins

    @dataclass(frozen=True)
    class Config:
        bits: Literal[32, 8] = option(32, "the state's bits: 32, or 8 blockwise")
        paged: bool = option(False, "the large state in CUDA unified memory (CUDA only)")
        lr: float | None = option(None, "learning rate (default: the run's)")
        embeddings_32bit: bool = option(
            False, "as the Trainer builds it: each nn.Embedding's state in 32 bits where bits = 8"
        )

    def unsupported(self, ctx: RunContext) -> str | None:
        if not _has("bitsandbytes"):
            return "needs bitsandbytes: pip install bitsandbytes (or pip install -e '.[extras]')"
        if getattr(self.config, "paged", False) and not ctx.cuda:
            return "pages CUDA unified memory; on a CPU there is nothing to page (paged = false)"
        return None

    def apply(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        self.lr = self.config.lr or ctx.lr
        return model

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        self.optimizer = self.made([p for p in model.parameters() if p.requires_grad])
        embeddings = self.config.embeddings_32bit and self.config.bits == 8
        own_overrides(self.optimizer, model, embeddings)
        return self.optimizer

    def made(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        raise NotImplementedError

    def proof(self, steps: int) -> dict[str, Any]:
        buffers = [
            t
            for s in self.optimizer.state.values()
            for k in ("state1", "state2")
            if (t := s.get(k)) is not None
        ]
        return {
            "moments": len(buffers),
            "moment_bytes": sum(t.nbytes for t in buffers),
            "paged_moments": sum(bool(getattr(t, "is_paged", False)) for t in buffers),
        }


@TECHNIQUES.register("adamw-bnb")
class AdamWBnb(BnbOptimizer):
    """bitsandbytes' AdamW, as the Trainer builds it for ``optim="adamw_8bit"`` and
    ``"adamw_bnb_8bit"`` (``bitsandbytes.optim.AdamW`` with ``optim_bits=8``, each nn.Embedding's
    moments in 32 bits), its betas and epsilon the Trainer's defaults. The suite's ``adamw-8bit``
    is torchao's where torchao is installed, another kernel with other temporaries.

    Expected: optimizer state from AdamW's 8 bytes per parameter to about 2 in 8 bits.
    Accuracy: as adamw-8bit (Dettmers et al., arXiv:2110.02861: 32-bit AdamW's quality)."""

    summary = "bitsandbytes `AdamW(optim_bits=32 or 8, is_paged=...)` (the Trainer's `adamw_8bit`)"

    def made(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        from bitsandbytes.optim import AdamW as Optimizer

        return Optimizer(
            params,
            lr=self.lr,
            betas=(0.9, 0.999),  # the Trainer's adam_beta1, adam_beta2 and adam_epsilon defaults
            eps=1e-8,
            optim_bits=self.config.bits,
            is_paged=self.config.paged,
        )


@TECHNIQUES.register("lion")
class Lion(BnbOptimizer):
    """bitsandbytes' Lion, as the Trainer builds it for ``optim="lion_32bit"``, ``"lion_8bit"``,
    ``"paged_lion_32bit"`` and ``"paged_lion_8bit"``: ``bitsandbytes.optim.Lion`` with those bits
    and paging, its betas the run's Adam betas (0.9, 0.999). Lion (arXiv:2302.06675) keeps one
    moment per parameter, not Adam's two, and steps by its sign.

    Expected: optimizer state from AdamW's 8 bytes per parameter to 4 (32 bits) or about 1 (8
    bits). Accuracy: the Lion paper trains to AdamW's quality at a 3-10 times smaller learning rate;
    at the same rate it is another update."""

    summary = "bitsandbytes `Lion(optim_bits=32 or 8, is_paged=...)` (the Trainer's `lion_*`)"

    def made(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        from bitsandbytes.optim import Lion as Optimizer

        return Optimizer(
            params,
            lr=self.lr,
            betas=(0.9, 0.999),  # the Trainer's adam_beta1 and adam_beta2 defaults
            optim_bits=self.config.bits,
            is_paged=self.config.paged,
        )


@TECHNIQUES.register("ademamix")
class AdEMAMix(BnbOptimizer):
    """bitsandbytes' AdEMAMix, as the Trainer builds it for ``optim="ademamix"``,
    ``"ademamix_8bit"``, ``"paged_ademamix_32bit"`` and ``"paged_ademamix_8bit"``: Adam's two
    moments and a slow first moment beside the fast one (arXiv:2409.03237), the two first moments
    in one buffer twice the parameter's size; the Trainer's betas (0.9, 0.999, 0.9999), alpha 5.

    Expected: optimizer state 12 bytes per parameter in 32 bits (AdamW's 8 and 4 more), about 3 in
    8 bits. Accuracy: the paper reaches AdamW's loss in fewer tokens; its slow moment needs
    t_alpha and t_beta3 warm-ups on short runs, which change no tensor's size."""

    summary = (
        "bitsandbytes `AdEMAMix(optim_bits=32 or 8, is_paged=...)` (the Trainer's `*ademamix*`)"
    )
    stand_ins = {
        **BnbOptimizer.stand_ins,
        "bitsandbytes.optim.ademamix:AdEMAMix._get_state_double_buffer": (
            "bench.predict.stand_ins:paged_double_buffer"
        ),
    }

    def made(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        from bitsandbytes.optim import AdEMAMix as Optimizer

        return Optimizer(
            params,
            lr=self.lr,
            betas=(0.9, 0.999, 0.9999),  # adam_beta1, adam_beta2, and optim_args' beta3 default
            alpha=5.0,
            optim_bits=self.config.bits,
            is_paged=self.config.paged,
        )


@TECHNIQUES.register("rmsprop-bnb")
class RMSpropBnb(BnbOptimizer):
    """bitsandbytes' RMSprop, as the Trainer builds it for ``optim="rmsprop_bnb"``,
    ``"rmsprop_bnb_32bit"`` and ``"rmsprop_bnb_8bit"`` (never paged: the Trainer passes no
    ``is_paged`` to it): the square average alone, as torch's RMSprop without momentum keeps.

    Expected: optimizer state 4 bytes per parameter in 32 bits, about 1 in 8 bits. Accuracy:
    RMSprop's, a step without momentum."""

    summary = "bitsandbytes `RMSprop(optim_bits=32 or 8)` (the Trainer's `rmsprop_bnb*`)"

    @dataclass(frozen=True)
    class Config:
        bits: Literal[32, 8] = option(32, "the square average's bits: 32, or 8 blockwise")
        lr: float | None = option(None, "learning rate (default: the run's)")
        embeddings_32bit: bool = option(
            False, "as the Trainer builds it: each nn.Embedding's state in 32 bits where bits = 8"
        )

    def made(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        from bitsandbytes.optim import RMSprop as Optimizer

        return Optimizer(params, lr=self.lr, optim_bits=self.config.bits)
