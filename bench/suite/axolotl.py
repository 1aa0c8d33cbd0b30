"""An axolotl YAML (``bench predict --job FILE``), read into the job --hf takes: the model and how
axolotl loads it, the TrainingArguments its trainer builder writes, the LoraConfig its adapter
loader builds and the BitsAndBytesConfig of ``load_in_4bit``/``load_in_8bit``. Each rule is
axolotl's own (its ``utils/schemas``, ``utils/config.resolve_dtype``, ``loaders/model.py``,
``loaders/adapter.py``, ``core/builders/base.py``); a key that changes what a step holds and is not
modelled is refused by name, one not known to this reader too (a newer axolotl's), and the keys
that change nothing are listed as ignored."""

from __future__ import annotations

from typing import Any

from bench.suite import quantized
from bench.suite.translated import Translated, whole

KIND = "axolotl"
# the keys that say a YAML is axolotl's: its model, and its batch or sequence names
CLAIMS = ({"base_model"}, {"micro_batch_size", "sequence_len", "adapter", "lora_r", "datasets"})

# axolotl's defaults (utils/schemas) for the keys read here
SEQUENCE_LEN = 512
MICRO_BATCH = 1
OPTIMIZER = "adamw_torch_fused"
# the attention a flag of the old names asks for (attn_implementation's values)
OLD_ATTENTION = {
    "flash_attention": "flash_attention_2",
    "sdp_attention": "sdpa",
    "eager_attention": "eager",
}
# the attention implementations that pack a micro-batch's samples into one row (multipack's bins
# of micro_batch_size × sequence_len tokens: attn_supports_packing), as this harness models them
PACKING_ATTENTION = ("flash_attention_2",)
# keys that change what a step holds and are not modelled: what each does
NOT_MODELLED = {
    # (a plugin's own keys, liger_* and the like, are refused with it)
    "plugins": "its plugins patch the model (Liger's kernels, Cut Cross Entropy's chunked loss)",
    "fsdp": "axolotl's FSDP settings (fsdp_config's fsdp_version and its keys), not the Trainer's",
    "fsdp_config": "axolotl's FSDP settings, not the Trainer's",
    "unfrozen_parameters": "freezes every parameter but those it names",
    "activation_offloading": "moves checkpointed activations to the host",
    "layer_offloading": "keeps layers' parameters on the host between forward and backward",
    "selective_checkpointing": "saves some operators' outputs inside checkpointed layers",
    "fp8": "trains the linears in float8 through torchao",
    "rl": "a preference or RL trainer (DPO, KTO, ORPO, GRPO) holds a reference model or rollouts",
    "relora": "ReLoRA merges and restarts its adapters",
    "sequence_parallel_degree": "splits each sequence over ranks",
    "context_parallel_size": "splits each sequence over ranks",
    "tensor_parallel_size": "splits each layer's weights over ranks",
    "multipack_real_batches": "packs each of micro_batch_size rows apart",
    "lora_mlp_kernel": "axolotl's fused LoRA kernels",
    "lora_qkv_kernel": "axolotl's fused LoRA kernels",
    "lora_o_kernel": "axolotl's fused LoRA kernels",
    "lora_embedding_kernel": "axolotl's fused LoRA kernels",
    "flash_attn_cross_entropy": "flash-attention's cross-entropy kernel",
    "flash_attn_rms_norm": "flash-attention's RMSNorm kernel",
    "flash_attn_fuse_mlp": "fuses the MLP",
    "chunked_cross_entropy": "computes the loss over chunks of the logits",
    "lora_target_parameters": "adapts parameters (experts) rather than linears",
    "peft_layers_to_transform": "adapts some layers only",
    "peft_trainable_token_indices": "trains some embedding rows",
    "lora_on_cpu": "loads the adapters on the host",
    "embedding_lr": "the embeddings in an optimizer group of their own",
    "embedding_lr_scale": "the embeddings in an optimizer group of their own",
    "lr_groups": "optimizer groups of its own",
    "loraplus_lr_ratio": "LoRA+'s optimizer groups",
    "optim_target_modules": "GaLore-style optimizers keep these modules' gradients projected",
    "torch_empty_cache_steps": "the allocator's cache is emptied every N steps",
    "auto_find_batch_size": "the Trainer halves the batch after each out-of-memory",
    "neftune_noise_alpha": "adds noise to the embeddings' output",
    "pad_to_multiple_of": "pads each batch to a multiple other than sequence_len",
    "peft_autocast_adapter_dtype": "the adapters' dtype other than PEFT's float32",
    "bnb_config_kwargs": "BitsAndBytesConfig fields other than axolotl's",
    "gptq": "loads GPTQ weights",
    "ddp_bucket_cap_mb": "DDP's bucket size, under a launcher's ranks",
}
# the attention implementations axolotl takes that this harness models (its others:
# FlashAttention-3, flex, xformers, sage, fp8, hub kernels)
ATTENTION_MODELLED = ("eager", "sdpa", "flash_attention_2")
# keys that change nothing a step holds (the data, evaluation, logging, saving, schedules)
UNCHANGED = frozenset(
    {
        "datasets",
        "test_datasets",
        "dataset_prepared_path",
        "dataset_processes",
        "dataset_num_proc",
        "shuffle_merged_datasets",
        "val_set_size",
        "output_dir",
        "hub_model_id",
        "hub_strategy",
        "wandb_project",
        "wandb_entity",
        "wandb_watch",
        "wandb_name",
        "wandb_log_model",
        "wandb_run_id",
        "mlflow_tracking_uri",
        "mlflow_experiment_name",
        "use_tensorboard",
        "num_epochs",
        "max_steps",
        "lr_scheduler",
        "lr_scheduler_kwargs",
        "learning_rate",
        "cosine_min_lr_ratio",
        "warmup_ratio",
        "warmup_steps",
        "evals_per_epoch",
        "eval_steps",
        "eval_strategy",
        "eval_sample_packing",
        "eval_batch_size",
        "eval_sequence_len",
        "saves_per_epoch",
        "save_steps",
        "save_strategy",
        "save_total_limit",
        "save_first_step",
        "save_safetensors",
        "save_only_model",
        "logging_steps",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "special_tokens",
        "tokens",
        "tokenizer_type",
        "tokenizer_config",
        "tokenizer_use_fast",
        "model_type",
        "trust_remote_code",
        "resume_from_checkpoint",
        "auto_resume_from_checkpoints",
        "lora_model_dir",
        "loss_watchdog_threshold",
        "loss_watchdog_patience",
        "train_on_inputs",
        "group_by_length",
        "seed",
        "strict",
        "early_stopping_patience",
        "chat_template",
        "default_system_message",
        "excess_length_strategy",
        "min_sample_len",
        "sample_packing_group_size",
        "sample_packing_bin_size",
        "sample_packing_sequentially",
        "dataloader_num_workers",
        "dataloader_pin_memory",
        "dataloader_prefetch_factor",
        "ddp_timeout",
        "gc_steps",
        "tf32",
        "lora_fan_in_fan_out",
        "peft_use_rslora",
        "torch_compile_backend",
    }
)


# the keys read into the job
READ = frozenset(
    {
        "base_model",
        "base_model_config",
        "sequence_len",
        "micro_batch_size",
        "gradient_accumulation_steps",
        "batch_size",
        "adapter",
        "lora_r",
        "lora_alpha",
        "lora_dropout",
        "lora_target_modules",
        "lora_target_linear",
        "lora_modules_to_save",
        "peft_use_dora",
        "load_in_8bit",
        "load_in_4bit",
        "bf16",
        "fp16",
        "bfloat16",
        "float16",
        "float32",
        "gradient_checkpointing",
        "gradient_checkpointing_kwargs",
        "attn_implementation",
        *OLD_ATTENTION,
        "sample_packing",
        "pad_to_sequence_len",
        "optimizer",
        "optim_args",
        "max_grad_norm",
        "deepspeed",
        "torch_compile",
    }
)


def read(raw: dict[str, Any], where: str, problems: list[str]) -> Translated | None:
    """The job the YAML describes; None, with every problem said, where a key is refused."""
    found: list[str] = []
    for key in sorted(raw):
        if key in NOT_MODELLED and raw[key] not in (None, False, "", [], {}):
            found.append(
                f"{where}: {key} = {raw[key]!r}: {NOT_MODELLED[key]}, which changes what a step "
                "holds and is not modelled here; remove it to predict the job without it"
            )
    unknown = sorted(raw.keys() - READ - NOT_MODELLED.keys() - UNCHANGED)
    found += [
        f"{where}: {key}: not a key this harness knows of axolotl's (a typo, or a newer "
        "axolotl's): whether it changes what a step holds is not known; remove it to predict "
        "without it"
        for key in unknown
    ]
    model = raw.get("base_model_config") or raw.get("base_model")
    if not isinstance(model, str) or not model:
        found.append(f"{where}: base_model: expected the model's hub id or local folder")
    dtype = _dtype(raw)
    attention = _attention(raw, where, found)
    args = _training_args(raw, where, found)
    packing = _packing(raw, attention, where, found)
    adapter, quantization = _adapter(raw, dtype, where, found)
    if not raw.get("adapter") and attention != "flash_attention_2":
        found += _upcast(dtype, attention, where)
    seq_len = whole(raw, "sequence_len", SEQUENCE_LEN, where=where, found=found)
    problems += found
    if found:
        return None
    techniques: list[Any] = [quantization] if quantization else []
    if packing:
        techniques.append("packing")
    loaded = {"dtype": dtype}
    if attention:
        loaded["attn_implementation"] = attention
    return Translated(
        kind=KIND,
        model=str(model),
        loaded=loaded,
        training_args=args,
        adapter=adapter,
        techniques=techniques,
        seq_len=seq_len,
        ignored=tuple(sorted(raw.keys() & UNCHANGED)),
        assumed=_bf16(raw)[1],
    )


def _bf16(raw: dict[str, Any]) -> tuple[bool | str, tuple[str, ...]]:
    """bf16 as ``resolve_dtype`` settles it (True, False or "full"), and what that assumes of the
    card: ``auto`` (the default) is true on a card with bfloat16 (Ampere or later)."""
    bf16 = raw.get("bf16", "auto")
    if bf16 != "auto":
        return bf16, ()
    if raw.get("fp16"):
        return False, ()
    return True, ("bf16: auto read as a card with bfloat16 (Ampere or later)",)


def _dtype(raw: dict[str, Any]) -> str:
    """The dtype axolotl loads the model in (``resolve_dtype``'s torch_dtype)."""
    if _bf16(raw)[0] or raw.get("bfloat16"):
        return "bfloat16"
    if raw.get("load_in_8bit") or raw.get("fp16") or raw.get("float16"):
        return "float16"
    return "float32"


def _attention(raw: dict[str, Any], where: str, found: list[str]) -> str | None:
    """attn_implementation, or the old flag that names one; None: transformers' default (sdpa)."""
    named = raw.get("attn_implementation")
    for flag, implementation in OLD_ATTENTION.items():
        if raw.get(flag):
            named = named or implementation
    if named is not None and named not in ATTENTION_MODELLED:
        found.append(
            f"{where}: attn_implementation = {named!r}: not modelled here; flash_attention_2, "
            "sdpa or eager are"
        )
        return None
    return named


def _training_args(raw: dict[str, Any], where: str, found: list[str]) -> dict[str, Any]:
    """The TrainingArguments axolotl's builder writes for the keys that change what a step holds
    (``_set_base_training_args``: precision, checkpointing, optimizer, clipping, batch)."""
    micro = whole(raw, "micro_batch_size", MICRO_BATCH, where=where, found=found)
    steps = whole(raw, "gradient_accumulation_steps", 1, where=where, found=found)
    if raw.get("batch_size") is not None:
        total = whole(raw, "batch_size", micro * steps, where=where, found=found)
        if "gradient_accumulation_steps" in raw and total != micro * steps:
            found.append(
                f"{where}: batch_size = {total} is not micro_batch_size × "
                f"gradient_accumulation_steps ({micro} × {steps}); give two of the three"
            )
        steps = max(total // micro, 1)  # axolotl's normalize_config, one process
    bf16 = _bf16(raw)[0]
    args: dict[str, Any] = {
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": steps,
        "optim": raw.get("optimizer") or OPTIMIZER,
        # (_configure_precision_settings) bf16: full sets bf16_full_eval alone, the weights
        # bfloat16 with no autocast in training
        "bf16": bf16 != "full" and bool(bf16 or raw.get("bfloat16")),
        "fp16": bool(raw.get("fp16")) and not bf16,
    }
    checkpointing = raw.get("gradient_checkpointing")
    if checkpointing in ("offload", "offload_disk"):
        found.append(
            f"{where}: gradient_checkpointing = {checkpointing!r}: axolotl's checkpointing that "
            "moves each layer's input to the host (or disk) is not modelled; true is"
        )
    elif checkpointing:
        args["gradient_checkpointing"] = True
        args["gradient_checkpointing_kwargs"] = raw.get("gradient_checkpointing_kwargs") or {
            "use_reentrant": False
        }
    for key in ("max_grad_norm", "optim_args", "torch_compile", "deepspeed"):
        if raw.get(key) is not None:
            args[key] = raw[key]
    return args


def _packing(raw: dict[str, Any], attention: str | None, where: str, found: list[str]) -> bool:
    """sample_packing: each micro-batch one row of micro_batch_size × sequence_len tokens, the
    samples apart by their cumulative lengths (multipack's bins, padded to the full row); under an
    attention that cannot keep them apart axolotl packs otherwise, not modelled."""
    if not raw.get("sample_packing"):
        return False
    if attention not in PACKING_ATTENTION:
        found.append(
            f"{where}: sample_packing under attention {attention or 'sdpa'}: axolotl then packs "
            "each of micro_batch_size rows apart (multipack_real_batches), not modelled; set "
            "attn_implementation: flash_attention_2"
        )
        return False
    return True


def _adapter(
    raw: dict[str, Any], dtype: str, where: str, found: list[str]
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """PEFT's adapter_config of axolotl's LoraConfig (``_build_peft_lora_config``), and the
    technique of the BitsAndBytesConfig its loader builds for qlora with load_in_4bit or lora with
    load_in_8bit."""
    adapter = raw.get("adapter")
    if not adapter:
        if raw.get("load_in_4bit") or raw.get("load_in_8bit"):
            found.append(
                f"{where}: load_in_4bit/load_in_8bit without an adapter: axolotl loads the model "
                "quantized only for adapter: qlora (4 bits) or lora (8 bits)"
            )
        return None, None
    if adapter not in ("lora", "qlora"):
        found.append(f"{where}: adapter = {adapter!r}: not modelled here; lora and qlora are")
        return None, None
    if not isinstance(raw.get("lora_r"), int):
        found.append(f"{where}: lora_r: the adapters' rank, a whole number, is required")
        return None, None
    targets = raw.get("lora_target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": raw["lora_r"],
        "lora_alpha": raw.get("lora_alpha") or 8,  # LoraConfig's default where None is passed
        "lora_dropout": raw.get("lora_dropout") or 0.0,
        # lora_target_linear: every linear but the output head, PEFT's "all-linear" for these
        "target_modules": "all-linear" if raw.get("lora_target_linear") else targets,
        "modules_to_save": raw.get("lora_modules_to_save") or None,
        "use_dora": bool(raw.get("peft_use_dora")),
        "bias": "none",
    }
    if raw.get("lora_target_linear") and targets:
        found.append(
            f"{where}: lora_target_linear with lora_target_modules: give one (every linear, or "
            "those named)"
        )
    return config, _quantization(raw, adapter, dtype, where=where, found=found)


def _quantization(
    raw: dict[str, Any], adapter: str, dtype: str, where: str, found: list[str]
) -> dict[str, Any] | None:
    """The technique of axolotl's BitsAndBytesConfig (``_set_quantization_config``): for qlora
    NF4, double quantization, the compute dtype the model's, the 4-bit values stored in bfloat16;
    for lora in 8 bits LLM.int8 at its defaults. peft's k-bit preparation upcasts the rest to
    float32, which axolotl casts back (norms and embeddings to the model's dtype,
    ``_configure_embedding_dtypes``): the model as loaded, ``prepare`` off."""
    if adapter == "qlora" and raw.get("load_in_4bit"):
        config: dict[str, Any] = {
            "load_in_4bit": True,
            "bnb_4bit_compute_dtype": dtype,
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_quant_storage": "bfloat16",
        }
    elif adapter == "lora" and raw.get("load_in_8bit"):
        config = {"load_in_8bit": True}
    else:
        config = {}
    if config:
        loaded = quantized.technique(config, where, found)
        return loaded and loaded | {"prepare": False}
    if raw.get("load_in_4bit") or raw.get("load_in_8bit") or adapter == "qlora":
        found.append(
            f"{where}: adapter = {adapter!r} with load_in_4bit = {raw.get('load_in_4bit')!r}, "
            f"load_in_8bit = {raw.get('load_in_8bit')!r}: axolotl quantizes for qlora with "
            "load_in_4bit and for lora with load_in_8bit only"
        )
    return None


def _upcast(dtype: str, attention: str | None, where: str) -> list[str]:
    """axolotl upcasts every norm and the embeddings to float32 before training and casts them back
    only for adapters or an attention that needs the model's dtype: a full fine-tune under sdpa or
    eager keeps them in float32 among 16-bit layers, a mix this harness does not load."""
    if dtype == "float32":
        return []
    return [
        f"{where}: a full fine-tune in {dtype} under attention {attention or 'sdpa'}: axolotl "
        "keeps the norms and embeddings upcast to float32 among the other layers' 16 bits, which "
        "is not modelled; set attn_implementation: flash_attention_2 (cast back), or an adapter"
    ]
