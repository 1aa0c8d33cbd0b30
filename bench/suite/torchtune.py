"""A torchtune recipe config (``bench predict --job FILE``), read as torchtune's single-device
recipes read it (``recipes/lora_finetune_single_device.py``, ``full_finetune_single_device.py``):
the model built in ``dtype`` (no autocast, adapters too), the batch and its accumulation, the
optimizer (per parameter inside backward with ``optimizer_in_bwd``), the chunked-output loss,
activation checkpointing and offloading, gradient clipping. torchtune's own TransformerDecoder is
not built (torchtune 0.6 needs a torchao older than this harness's): its model component is read as
the nearest Hugging Face config shipped in suites/configs, and the prediction says so. A key that
changes what a step holds and is not modelled is refused by name, as is one not known."""

from __future__ import annotations

from typing import Any

from bench.suite.translated import Translated, whole

KIND = "torchtune"
# the keys that say a YAML is torchtune's: its model, and its recipe's other components
CLAIMS = ({"model"}, {"tokenizer", "optimizer", "loss", "checkpointer"})
CONFIGS = "suites/configs"
# torchtune's model builders (torchtune.models.<family>.<name>, lora_<name>, qlora_<name>) and
# the Hugging Face config of the same architecture and sizes
MODELS = {
    "llama3_1.llama3_1_8b": "llama-3.1-8b",
    "llama3_1.llama3_1_70b": "llama-3.1-70b",
    "llama3_2.llama3_2_1b": "llama-3.2-1b",
    "llama3_2.llama3_2_3b": "llama-3.2-3b",
    "mistral.mistral_7b": "mistral-7b",
    "qwen2_5.qwen2_5_0_5b": "qwen2.5-0.5b",
}
# torchtune's LoRA module names and the Hugging Face Llama's they stand for
LORA_NAMES = {
    "q_proj": "q_proj",
    "k_proj": "k_proj",
    "v_proj": "v_proj",
    "output_proj": "o_proj",
}
MLP = ("gate_proj", "up_proj", "down_proj")  # w1, w3, w2
LINEARS = (*LORA_NAMES.values(), *MLP)
# the model builder's arguments read (a LoRA builder's)
MODEL_KEYS = frozenset(
    {
        "_component_",
        "lora_attn_modules",
        "apply_lora_to_mlp",
        "apply_lora_to_output",
        "lora_rank",
        "lora_alpha",
        "lora_dropout",
        "use_dora",
        "quantize_base",
    }
)
# the optimizers a recipe instantiates, as this harness's techniques (a class each, one group)
OPTIMIZERS: dict[str, Any] = {
    "torch.optim.AdamW": {"name": "optimizer", "kind": "adamw"},
    "bitsandbytes.optim.PagedAdamW8bit": "paged-adamw-8bit",
    "bitsandbytes.optim.AdamW8bit": {"name": "adamw-bnb", "bits": 8},
}
# per parameter inside backward (optimizer_in_bwd): optimizer-in-backward's optimizer option
IN_BACKWARD = {
    "torch.optim.AdamW": "adamw",
    "bitsandbytes.optim.PagedAdamW8bit": "paged-adamw-8bit",
    "bitsandbytes.optim.AdamW8bit": "adamw-8bit",
}
LOSS = "torchtune.modules.loss.CEWithChunkedOutputLoss"
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
DEVICE = "device"  # the recipe's key (a record's key of the same name is another)
SEQ_LEN = 512  # where tokenizer.max_seq_len is null: the data's own lengths, which no file says
# top-level keys read into the job
READ = frozenset(
    {
        "model",
        "tokenizer",
        "dataset",
        "batch_size",
        "gradient_accumulation_steps",
        "optimizer",
        "optimizer_in_bwd",
        "loss",
        "dtype",
        "enable_activation_checkpointing",
        "enable_activation_offloading",
        "compile",
        "clip_grad_norm",
        "device",
    }
)
# top-level keys that change nothing a step holds: checkpoints, schedules, logging, profiling
UNCHANGED = frozenset(
    {
        "output_dir",
        "checkpointer",
        "resume_from_checkpoint",
        "save_adapter_weights_only",
        "seed",
        "shuffle",
        "lr_scheduler",
        "epochs",
        "max_steps_per_epoch",
        "metric_logger",
        "log_every_n_steps",
        "log_peak_memory_stats",
        "log_level",
        "profiler",
        "low_cpu_ram",
        "run_val_every_n_steps",
    }
)


def read(raw: dict[str, Any], where: str, problems: list[str]) -> Translated | None:
    """The job the recipe config describes; None, with every problem said."""
    found = [
        f"{where}: {key}: not a key of torchtune's single-device recipes this harness knows: "
        "whether it changes what a step holds is not known; remove it to predict without it"
        for key in sorted(raw.keys() - READ - UNCHANGED)
    ]
    model = _table(raw, "model")
    config, lora, quantize = _model(model, where, found)
    dtype = DTYPES.get(str(raw.get("dtype", "bf16")))
    if dtype is None:
        found.append(f"{where}: dtype = {raw.get('dtype')!r}: torchtune trains in bf16 or fp32")
    micro = whole(raw, "batch_size", 1, where=where, found=found)
    steps = whole(raw, "gradient_accumulation_steps", 1, where=where, found=found)
    techniques = _quantized(lora if quantize else None) + _optimizer(raw, steps, where, found)
    techniques += _loss(raw, where, found) + _activations(raw, where, found)
    if steps > 1:
        techniques.append({"name": "accumulate", "micro_batches": steps})
    if (norm := raw.get("clip_grad_norm")) is not None:
        if isinstance(norm, bool) or not isinstance(norm, int | float) or norm <= 0:
            found.append(f"{where}: clip_grad_norm = {norm!r}: expected a positive number or null")
        else:
            techniques.append({"name": "clip-grad-norm", "max_norm": float(norm)})
    seq_len, assumed = _length(raw, where, found)
    if (device := raw.get(DEVICE, "cuda")) != "cuda":
        found.append(f"{where}: device = {device!r}: predicted for a CUDA card only")
    problems += found
    if found:
        return None
    return Translated(
        kind=KIND,
        model=f"{CONFIGS}/{config}",
        loaded={"dtype": dtype},
        training_args=None,
        adapter=lora,
        adapter_options={"adapter_dtype": "base"},  # built in dtype, as the model is
        techniques=techniques,
        seq_len=seq_len,
        batch=micro * steps,
        micro_batches=steps,
        ignored=tuple(sorted(raw.keys() & UNCHANGED)),
        assumed=(
            f"torchtune's {model.get('_component_')} read as the Hugging Face config "
            f"{CONFIGS}/{config} (the same architecture and sizes; torchtune's own "
            "TransformerDecoder is not built)",
            *assumed,
        ),
    )


def _model(
    model: dict[str, Any], where: str, found: list[str]
) -> tuple[str, dict[str, Any] | None, bool]:
    """The Hugging Face config of the model builder, PEFT's adapter_config of its LoRA (None for a
    full fine-tune), and whether its base is quantized (QLoRA)."""
    component = str(model.get("_component_", ""))
    family, _, builder = component.removeprefix("torchtune.models.").rpartition(".")
    base = builder.removeprefix("qlora_").removeprefix("lora_")
    config = MODELS.get(f"{family}.{base}")
    if config is None:
        found.append(
            f"{where}: model._component_ = {component!r}: not a builder this harness reads; "
            f"{', '.join('torchtune.models.' + m for m in MODELS)} (and their lora_, qlora_) are"
        )
        return "", None, False
    if unknown := sorted(model.keys() - MODEL_KEYS):
        found.append(f"{where}: model.{unknown[0]}: not an argument of the builders read here")
    if builder == base:
        return config, None, False
    targets = [LORA_NAMES[m] for m in model.get("lora_attn_modules", []) if m in LORA_NAMES]
    if len(targets) != len(model.get("lora_attn_modules", [])):
        found.append(f"{where}: model.lora_attn_modules: expected some of {', '.join(LORA_NAMES)}")
    if model.get("apply_lora_to_mlp"):
        targets += MLP
    if model.get("apply_lora_to_output"):
        targets.append("lm_head")
    adapter = {
        "peft_type": "LORA",
        "r": model.get("lora_rank", 8),
        "lora_alpha": model.get("lora_alpha", 16),
        "lora_dropout": model.get("lora_dropout", 0.0),
        "target_modules": targets,
        "use_dora": bool(model.get("use_dora")),
    }
    return config, adapter, builder.startswith("qlora_") or bool(model.get("quantize_base"))


def _quantized(lora: dict[str, Any] | None) -> list[Any]:
    """QLoRA's base: torchao's NF4Tensor for each linear LoRA adapts (the others keep the model's
    dtype), read as bitsandbytes' NF4 (blocks of 64, the scales quantized again in blocks of 256),
    dequantized to bfloat16 for each matmul; no k-bit preparation."""
    if lora is None:
        return []
    skipped = ",".join(name for name in LINEARS if name not in lora["target_modules"])
    out = {
        "name": "bnb-4bit",
        "quant_type": "nf4",
        "double_quant": True,
        "compute_dtype": "bfloat16",
        "prepare": False,
    }
    if skipped:
        out["skip"] = skipped
    return [out]


def _optimizer(raw: dict[str, Any], steps: int, where: str, found: list[str]) -> list[Any]:
    """The recipe's optimizer (``config.instantiate``), or with optimizer_in_bwd one per parameter
    stepped in backward (``optimizer_in_backward_hook``), which takes no accumulation."""
    chosen = _table(raw, "optimizer")
    component = chosen.get("_component_")
    if raw.get("optimizer_in_bwd"):
        if component not in IN_BACKWARD or steps > 1:
            found.append(
                f"{where}: optimizer_in_bwd with {component} over {steps} accumulation steps: one "
                f"of {', '.join(IN_BACKWARD)} at gradient_accumulation_steps 1 is modelled"
            )
            return []
        return [{"name": "optimizer-in-backward", "optimizer": IN_BACKWARD[component]}]
    if component not in OPTIMIZERS:
        found.append(
            f"{where}: optimizer._component_ = {component!r}: not modelled here; "
            f"{', '.join(OPTIMIZERS)} are"
        )
        return []
    technique = OPTIMIZERS[component]
    if component == "torch.optim.AdamW" and chosen.get("fused"):
        technique = technique | {"impl": "fused"}
    return [technique]


def _loss(raw: dict[str, Any], where: str, found: list[str]) -> list[Any]:
    loss = _table(raw, "loss")
    if loss.get("_component_") != LOSS:
        found.append(
            f"{where}: loss._component_ = {loss.get('_component_')!r}: not modelled here; {LOSS} is"
        )
        return []
    return [{"name": "chunked-output-loss", "chunks": loss.get("num_output_chunks", 8)}]


def _activations(raw: dict[str, Any], where: str, found: list[str]) -> list[Any]:
    """Activation checkpointing (non-reentrant, each transformer layer), offloading (side-stream
    copies to the host, as the harness's activation-offload models torchtune's); compile refused."""
    if raw.get("compile"):
        found.append(
            f"{where}: compile = {raw['compile']!r}: torch.compile of each layer and the loss "
            "is not modelled; set it false"
        )
    keys = {"enable_activation_checkpointing": "checkpoint"}
    keys["enable_activation_offloading"] = "activation-offload"
    return [technique for key, technique in keys.items() if raw.get(key)]


def _length(raw: dict[str, Any], where: str, found: list[str]) -> tuple[int, tuple[str, ...]]:
    """The sequences' length: tokenizer.max_seq_len, to which the tokenizer truncates; where null,
    the data's own, which no file says (SEQ_LEN, said so). Packed datasets are refused."""
    tokenizer, dataset = _table(raw, "tokenizer"), _table(raw, "dataset")
    if dataset.get("packed"):
        found.append(
            f"{where}: dataset.packed = True: torchtune's packed rows attend within each sample "
            "through a block mask, not modelled; set it false"
        )
    length = tokenizer.get("max_seq_len")
    if length is None:
        return SEQ_LEN, (
            f"tokenizer.max_seq_len null: each sequence as long as the data's own, predicted at "
            f"{SEQ_LEN} tokens (--seq-len N to say)",
        )
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        found.append(f"{where}: tokenizer.max_seq_len = {length!r}: expected a whole number")
        return SEQ_LEN, ()
    return length, ()


def _table(raw: dict[str, Any], key: str) -> dict[str, Any]:
    """A component's table (``_component_`` and its arguments); empty where absent or not one."""
    found = raw.get(key)
    return found if isinstance(found, dict) else {}
