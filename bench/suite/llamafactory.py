"""A LLaMA-Factory YAML (``bench predict --job FILE``), read into the job --hf takes. Its file is
transformers' Seq2SeqTrainingArguments with LLaMA-Factory's own ModelArguments, DataArguments and
FinetuningArguments: the Trainer's fields go to the TrainingArguments reader as they are, its own
are read as its code reads them (``hparams/parser.py``, ``model/loader.py``, ``model/patcher.py``,
``model/adapter.py``, ``model/model_utils/checkpointing.py`` and ``quantization.py``). A field that
changes what a step holds and is not modelled is refused by name, one of its own this reader does
not know too (a newer LLaMA-Factory's); the fields that change nothing are listed as ignored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.suite import quantized
from bench.suite.translated import Translated, whole

KIND = "llamafactory"
# the keys that say a YAML is LLaMA-Factory's: its model's name, and its method or data
CLAIMS = ({"model_name_or_path"}, {"stage", "finetuning_type", "cutoff_len", "template"})

# LLaMA-Factory's defaults for the fields read here (its hparams)
CUTOFF_LEN = 2048
LORA_RANK = 8
# flash_attn's values as the attention transformers loads ("auto": transformers' own choice)
ATTENTION = {"disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2"}
STAGES = ("sft", "pt")  # a causal language model's loss on the batch's tokens
# its own fields read into the job
READ = frozenset(
    {
        "model_name_or_path",
        "stage",
        "finetuning_type",
        "lora_rank",
        "lora_alpha",
        "lora_dropout",
        "lora_target",
        "additional_target",
        "use_dora",
        "use_rslora",
        "quantization_bit",
        "quantization_method",
        "quantization_type",
        "double_quantization",
        "flash_attn",
        "disable_gradient_checkpointing",
        "use_reentrant_gc",
        "cutoff_len",
        "packing",
        "pure_bf16",
    }
)
# its own fields that change what a step holds and are not modelled: what each does
NOT_MODELLED = {
    "adapter_name_or_path": "loads trained adapters, whose shapes the file does not say",
    "resize_vocab": "resizes the embeddings to the tokenizer",
    "add_tokens": "adds tokens to the embeddings",
    "add_special_tokens": "adds tokens to the embeddings",
    "rope_scaling": "scales the rotary positions",
    "shift_attn": "LongLoRA's shifted sparse attention",
    "mixture_of_depths": "skips tokens through layers",
    "use_unsloth": "Unsloth's kernels",
    "use_unsloth_gc": "Unsloth's checkpointing that moves each layer's input to the host",
    "enable_liger_kernel": "Liger's kernels fuse the loss, norms and MLPs",
    "upcast_layernorm": "keeps the norms in float32 among 16-bit layers",
    "upcast_lmhead_output": "casts the head's output to float32",
    "use_v1_kernels": "its v1 kernels",
    "use_kt": "KTransformers' kernels",
    "quantization_device_map": "places the quantized model by a device map",
    "neat_packing": "masks attention within each packed sequence",
    "loraplus_lr_ratio": "LoRA+'s optimizer groups",
    "loraplus_lr_embedding": "LoRA+'s optimizer groups",
    "use_galore": "GaLore's projected gradients",
    "use_apollo": "APOLLO's low-rank state",
    "use_badam": "BAdam trains one block at a time",
    "use_llama_pro": "LLaMA Pro's expanded blocks",
    "use_adam_mini": "Adam-mini's state",
    "use_muon": "Muon's optimizer",
    "use_mca": "Megatron-Core's training",
    "use_hyper_parallel": "its hyper-parallel training",
    "use_dft_loss": "DFT's loss weights each token by its probability",
    "use_asft_loss": "ASFT's loss",
    "use_eaft_loss": "EAFT's loss",
    "fp8": "trains the linears in float8",
    "pissa_convert": "keeps a PiSSA copy of the adapters",
}
# its own fields (and Seq2SeqTrainingArguments' beyond TrainingArguments') that change nothing a
# step holds: the data, tokenizer, hubs, evaluation, generation, export, inference engines, logging
_UNCHANGED_NAMES = """
    adapter_folder cache_dir use_fast_tokenizer split_special_tokens new_special_tokens_config
    init_special_tokens model_revision low_cpu_mem_usage moe_aux_loss_coef train_from_scratch
    infer_backend offload_folder use_kv_cache infer_dtype hf_hub_token ms_hub_token om_hub_token
    print_param_status trust_remote_code image_max_pixels image_min_pixels image_do_pan_and_scan
    crop_to_patches video_max_pixels video_min_pixels video_fps video_maxlen use_audio_in_video
    audio_sampling_rate export_dir export_size export_device export_quantization_bit
    export_quantization_dataset export_quantization_nsamples export_quantization_maxlen
    export_legacy_format export_hub_model_id kt_weight_path kt_expert_checkpoint_path
    kt_use_lora_experts kt_lora_expert_num kt_lora_expert_intermediate_size vllm_maxlen
    vllm_gpu_util vllm_enforce_eager vllm_max_lora_rank vllm_config sglang_maxlen
    sglang_mem_fraction sglang_tp_size sglang_config sglang_lora_backend template dataset
    eval_dataset dataset_dir media_dir train_on_prompt mask_history streaming buffer_size
    mix_strategy interleave_probs overwrite_cache preprocessing_batch_size preprocessing_num_workers
    max_samples eval_num_beams ignore_pad_token_for_loss val_size eval_on_each_dataset tool_format
    default_system enable_thinking preserve_thinking tokenized_path data_shared_file_system
    freeze_trainable_layers freeze_trainable_modules freeze_extra_modules module_dropout oft_rank
    oft_block_size oft_target create_new_adapter pissa_init pissa_iter pref_beta pref_ftx
    pref_bco_weight pref_loss dpo_label_smoothing kto_chosen_weight kto_rejected_weight simpo_gamma
    ppo_buffer_size ppo_epochs ppo_score_norm ppo_target ppo_whiten_rewards ref_model
    ref_model_adapters ref_model_quantization_bit reward_model reward_model_adapters
    reward_model_quantization_bit reward_model_type ld_alpha galore_target galore_rank
    galore_update_interval galore_scale galore_proj_type galore_layerwise apollo_target apollo_rank
    apollo_update_interval apollo_scale apollo_proj apollo_proj_type apollo_scale_type
    apollo_layerwise apollo_scale_front badam_mode badam_start_block badam_switch_mode
    badam_switch_interval badam_update_ratio badam_mask_mode badam_verbose use_swanlab
    swanlab_project swanlab_workspace swanlab_run_name swanlab_mode swanlab_api_key swanlab_logdir
    swanlab_lark_webhook_url swanlab_lark_secret hyper_parallel_args asft_alpha eaft_alpha
    freeze_vision_tower freeze_multi_modal_projector freeze_language_model compute_accuracy
    disable_shuffling early_stopping_steps plot_loss include_effective_tokens_per_second do_sample
    temperature top_p top_k num_beams max_length max_new_tokens repetition_penalty length_penalty
    skip_special_tokens ray_num_workers ray_init_kwargs master_addr master_port fp8_backend
    fp8_enable_fsdp_float8_all_gather enable_torch_profiler profiler_output_dir profiler_wait_steps
    profiler_warmup_steps profiler_active_steps profiler_repeat profiler_record_shapes
    profiler_profile_memory profiler_with_stack profile_modules overwrite_output_dir sortish_sampler
    predict_with_generate generation_max_length generation_num_beams generation_config
"""
UNCHANGED = frozenset(_UNCHANGED_NAMES.split())


# TrainingArguments fields of the transformers LLaMA-Factory pins (<= 5.6) that the installed one
# dropped, each changing nothing a step holds (its own examples set them)
DROPPED = frozenset({"warmup_ratio"})


def read(raw: dict[str, Any], where: str, problems: list[str]) -> Translated | None:
    """The job the YAML describes; None, with every problem said, where a field is refused."""
    from bench.suite.training_args import defaults

    found: list[str] = []
    trainer = defaults().keys()
    for key in sorted(raw.keys() & NOT_MODELLED.keys()):
        if raw[key] not in (None, False, "", [], {}):
            found.append(
                f"{where}: {key} = {raw[key]!r}: {NOT_MODELLED[key]}, which changes what a step "
                "holds and is not modelled here; remove it to predict the job without it"
            )
    found += [
        f"{where}: {key}: neither a TrainingArguments field nor one of LLaMA-Factory's this "
        "harness knows (a typo, or a newer LLaMA-Factory's): whether it changes what a step "
        "holds is not known; remove it to predict without it"
        for key in sorted(raw.keys() - trainer - READ - NOT_MODELLED.keys() - UNCHANGED - DROPPED)
    ]
    model = raw.get("model_name_or_path")
    if not isinstance(model, str) or not model:
        found.append(f"{where}: model_name_or_path: expected the model's hub id or local folder")
        model = ""
    full = _method(raw, where, found)
    args = {k: v for k, v in raw.items() if k in trainer and k not in ("output_dir",)}
    args |= _checkpointing(raw)
    zero3 = _zero3(args.get("deepspeed"), where)
    loaded = _loaded(raw, full=full, zero3=zero3, where=where, found=found)
    adapter = None if full else _adapter(raw)
    bnb = _quantization(raw, model, full=full, where=where, found=found)
    cutoff = whole(raw, "cutoff_len", CUTOFF_LEN, where=where, found=found)
    problems += found
    if found:
        return None
    return Translated(
        kind=KIND,
        model=model,
        loaded=loaded,
        training_args=args,
        adapter=adapter,
        techniques=[bnb] if bnb else [],
        seq_len=cutoff,
        ignored=tuple(sorted(raw.keys() & (UNCHANGED | DROPPED))),
        assumed=(
            f"rows of cutoff_len = {cutoff} tokens: packing's full rows, or the longest a batch "
            "pads to",
        ),
    )


def _method(raw: dict[str, Any], where: str, found: list[str]) -> bool:
    """Whether the job fine-tunes in full (else LoRA): a stage whose loss is the model's own on the
    batch's tokens, and a finetuning_type modelled here."""
    stage = raw.get("stage", "sft")
    if stage not in STAGES:
        found.append(
            f"{where}: stage = {stage!r}: a reward, preference or PPO stage holds a reference or "
            f"value model, not modelled here; {' and '.join(STAGES)} are"
        )
    kind = raw.get("finetuning_type", "lora")
    if kind not in ("lora", "full"):
        found.append(f"{where}: finetuning_type = {kind!r}: not modelled here; lora and full are")
    if kind == "lora" and raw.get("pure_bf16"):
        found.append(
            f"{where}: pure_bf16 with LoRA: the adapters kept in the model's 16 bits is not "
            "modelled for a job file; leave it out (adapters in float32) or fine-tune in full"
        )
    return kind == "full"


def _checkpointing(raw: dict[str, Any]) -> dict[str, Any]:
    """LLaMA-Factory checkpoints every layer unless told not to (``prepare_model_for_training``),
    reentrant unless use_reentrant_gc is false; a Trainer's own gradient_checkpointing calls the
    same patched method, reentrant unless its kwargs say."""
    if raw.get("disable_gradient_checkpointing") and not raw.get("gradient_checkpointing"):
        return {}
    kwargs = raw.get("gradient_checkpointing_kwargs") or {
        "use_reentrant": raw.get("use_reentrant_gc", True)
    }
    return {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": kwargs}


def _zero3(config: Any, where: str) -> bool:
    """Whether the arguments' DeepSpeed config is ZeRO-3 (the TrainingArguments reader says what is
    wrong with one it cannot read)."""
    if isinstance(config, dict):
        found = config
    elif isinstance(config, str):
        try:
            found = json.loads(Path(config).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
    else:
        return False
    stage = found.get("zero_optimization", {}).get("stage") if isinstance(found, dict) else None
    return stage == 3


def _loaded(
    raw: dict[str, Any], *, full: bool, zero3: bool, where: str, found: list[str]
) -> dict[str, str]:
    """How the model loads: its checkpoint's dtype (``torch_dtype="auto"``), every parameter cast
    to float32 for a full fine-tune (``init_adapter``: trainable parameters in float32 unless
    pure_bf16 or ZeRO-3); the attention flash_attn names."""
    out = {"dtype": "float32"} if full and not raw.get("pure_bf16") and not zero3 else {}
    attention = raw.get("flash_attn", "auto")
    if isinstance(attention, str) and attention in ATTENTION:
        out["attn_implementation"] = ATTENTION[attention]
    elif attention != "auto":
        found.append(
            f"{where}: flash_attn = {attention!r}: not modelled here; auto, disabled, sdpa or fa2 "
            "are"
        )
    return out


def _adapter(raw: dict[str, Any]) -> dict[str, Any]:
    """PEFT's adapter_config of the LoraConfig ``_setup_lora_tuning`` builds: lora_target "all" is
    every linear but the head (``find_all_linear_modules``), lora_alpha twice the rank unless
    given; the adapters in float32 (``autocast_adapter_dtype``, then every trainable parameter)."""
    rank = raw.get("lora_rank", LORA_RANK)
    targets = _listed(raw.get("lora_target", "all"))
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": raw.get("lora_alpha") or rank * 2,
        "lora_dropout": raw.get("lora_dropout", 0.0),
        "target_modules": "all-linear" if targets == ["all"] else targets,
        "modules_to_save": _listed(raw.get("additional_target")) or None,
        "use_dora": bool(raw.get("use_dora")),
        "use_rslora": bool(raw.get("use_rslora")),
    }


def _quantization(
    raw: dict[str, Any], model: str, *, full: bool, where: str, found: list[str]
) -> dict[str, Any] | None:
    """The technique of the BitsAndBytesConfig ``configure_quantization`` builds: 4 bits of
    quantization_type (NF4), double quantization unless told not to, computed and stored in the
    compute dtype; 8 bits LLM.int8. No k-bit preparation follows (``prepare`` off)."""
    bits = raw.get("quantization_bit")
    if bits is None:
        return None
    method = raw.get("quantization_method", "bnb")
    if method != "bnb" or bits not in (4, 8):
        found.append(
            f"{where}: quantization_bit = {bits!r} by {method}: not modelled here; bitsandbytes' "
            "(quantization_method bnb) 4 and 8 bits are"
        )
        return None
    if full:
        found.append(
            f"{where}: quantization_bit with finetuning_type full: LLaMA-Factory refuses it"
        )
        return None
    if bits == 8:
        config: dict[str, Any] = {"load_in_8bit": True}
    else:
        dtype = _compute_dtype(raw, model)
        config = {
            "load_in_4bit": True,
            "bnb_4bit_compute_dtype": dtype,
            "bnb_4bit_use_double_quant": raw.get("double_quantization", True),
            "bnb_4bit_quant_type": raw.get("quantization_type", "nf4"),
            "bnb_4bit_quant_storage": dtype,
        }
    technique = quantized.technique(config, where, found)
    return technique and technique | {"prepare": False}


def _compute_dtype(raw: dict[str, Any], model: str) -> str:
    """The compute dtype (``get_train_args``, else ``patch_config``'s ``infer_optim_dtype``):
    bfloat16 under bf16 or pure_bf16, float16 under fp16, else bfloat16 for a checkpoint in
    bfloat16 or of no stated dtype (a card that has it), float16 for another."""
    if raw.get("bf16") or raw.get("pure_bf16"):
        return "bfloat16"
    if raw.get("fp16"):
        return "float16"
    from bench.errors import BadInput
    from bench.spec import hf_config_file

    try:
        config = json.loads(hf_config_file(model).read_text(encoding="utf-8"))
    except (OSError, ValueError, BadInput):  # the model's loader says what is wrong with it
        config = {}
    if not isinstance(config, dict):
        config = {}
    stated = config.get("dtype") or config.get("torch_dtype")
    return "bfloat16" if stated in (None, "bfloat16") else "float16"


def _listed(value: Any) -> list[str]:
    """A field given as a list or as comma-separated names (LLaMA-Factory splits them)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    return list(value)
