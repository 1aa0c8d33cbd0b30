"""A run's ``training_args = "PATH"``: the TrainingArguments of a transformers ``Trainer`` job (a
JSON file, as ``TrainingArguments.to_json_string`` writes it, or YAML, as TRL and axolotl configs
hold it), read for the fields that change what a step holds, each becoming the technique or batch
size it means. A field that changes what a step holds but is not modelled yet (DeepSpeed, FSDP,
Liger's kernels, …) is a problem naming it, never ignored; every other field changes nothing a step
holds and is listed as ignored. An unknown field, or two that contradict each other, is a problem
naming the key. A file with any of TRL's SFTConfig fields is read as an SFTConfig, with TRL's
defaults and SFTTrainer's loss."""

from __future__ import annotations

import functools
import json
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from bench.models import flash
from bench.suite import quantized
from bench.techniques.deepspeed import HIDDEN, OFFLOAD_TO, ZERO_KEYS, imported

# The Trainer's optimizers (its `optim` names) as this harness's techniques, the parameters in the
# Trainer's groups: its SGD has no momentum (so no state); its Adafactor is transformers' own, whose
# update holds other temporaries.
OPTIMIZERS: dict[str, list[Any]] = {
    "adamw_torch": [{"name": "optimizer", "kind": "adamw", "groups": "trainer"}],
    "adamw_torch_fused": [
        {"name": "optimizer", "kind": "adamw", "impl": "fused", "groups": "trainer"}
    ],
    # transformers 4.x's own AdamW (every TrainingArguments it wrote names it): a parameter at a
    # time
    "adamw_hf": [{"name": "optimizer", "kind": "adamw", "impl": "single", "groups": "trainer"}],
    "adafactor": [{"name": "optimizer", "kind": "adafactor-transformers", "groups": "trainer"}],
    # bitsandbytes' AdamW, each nn.Embedding's moments in 32 bits (create_optimizer's override)
    "adamw_8bit": [{"name": "adamw-bnb", "bits": 8, "embeddings_32bit": True}],
    "adamw_bnb_8bit": [{"name": "adamw-bnb", "bits": 8, "embeddings_32bit": True}],
    "paged_adamw_8bit": [{"name": "paged-adamw-8bit", "embeddings_32bit": True}],
    "paged_adamw_32bit": ["paged-adamw-32bit"],
    "sgd": [{"name": "optimizer", "kind": "sgd", "momentum": 0.0, "groups": "trainer"}],
    "adagrad": [{"name": "optimizer", "kind": "adagrad", "groups": "trainer"}],
    "rmsprop": [{"name": "optimizer", "kind": "rmsprop", "groups": "trainer"}],
    # torchao's, in blocks of 256 (get_optimizer_cls_and_kwargs)
    "adamw_torch_4bit": [{"name": "adamw-4bit", "block_size": 256}],
    "adamw_torch_8bit": ["adamw-8bit"],
    # bitsandbytes' Lion, AdEMAMix and RMSprop as _get_bitsandbytes_optimizer builds them; in 8
    # bits create_optimizer keeps each nn.Embedding's state in 32 (its override)
    "lion_32bit": [{"name": "lion", "bits": 32}],
    "lion_8bit": [{"name": "lion", "bits": 8, "embeddings_32bit": True}],
    "paged_lion_32bit": [{"name": "lion", "bits": 32, "paged": True}],
    "paged_lion_8bit": [{"name": "lion", "bits": 8, "paged": True, "embeddings_32bit": True}],
    "ademamix": [{"name": "ademamix", "bits": 32}],
    "ademamix_8bit": [{"name": "ademamix", "bits": 8, "embeddings_32bit": True}],
    "paged_ademamix_32bit": [{"name": "ademamix", "bits": 32, "paged": True}],
    "paged_ademamix_8bit": [
        {"name": "ademamix", "bits": 8, "paged": True, "embeddings_32bit": True}
    ],
    # never paged: the Trainer passes RMSprop no is_paged
    "rmsprop_bnb": [{"name": "rmsprop-bnb", "bits": 32}],
    "rmsprop_bnb_8bit": [{"name": "rmsprop-bnb", "bits": 8, "embeddings_32bit": True}],
    "rmsprop_bnb_32bit": [{"name": "rmsprop-bnb", "bits": 32}],
}
# The Trainer's other optimizers (transformers' OptimizerNames), refused: what each keeps that no
# technique here does, and the nearest that one does.
OPTIMIZERS_NOT_MODELLED = {
    "adamw_torch_xla": ("torch_xla's AdamW runs on XLA devices, not CUDA", "adamw_torch"),
    "adamw_torch_npu_fused": ("torch_npu's fused AdamW runs on Ascend NPUs", "adamw_torch_fused"),
    "adamw_anyprecision": (
        "torchdistx's AnyPrecisionAdamW keeps its moments, and a Kahan compensation buffer, in "
        "the dtypes optim_args name",
        "adamw_torch",
    ),
    **dict.fromkeys(
        (
            "galore_adamw",
            "galore_adamw_8bit",
            "galore_adafactor",
            "galore_adamw_layerwise",
            "galore_adamw_8bit_layerwise",
            "galore_adafactor_layerwise",
        ),
        (
            "galore_torch keeps the gradients of optim_target_modules projected to a rank "
            "optim_args set, and its layerwise kinds step each parameter in backward",
            "the galore technique in a suite",
        ),
    ),
    **dict.fromkeys(
        ("apollo_adamw", "apollo_adamw_layerwise"),
        ("APOLLO keeps a low-rank auxiliary state for optim_target_modules", "adamw_8bit"),
    ),
    **dict.fromkeys(
        ("lomo", "adalomo"),
        (
            "LOMO fuses the update into backward and keeps no gradients (AdaLomo a factored "
            "second moment)",
            "the optimizer-in-backward technique in a suite",
        ),
    ),
    "grokadamw": ("GrokAdamW keeps a gradient average beside Adam's moments", "adamw_torch"),
    **dict.fromkeys(
        ("schedule_free_radam", "schedule_free_adamw", "schedule_free_sgd"),
        (
            "schedulefree keeps the z sequence beside the parameters (and the AdamW and RAdam "
            "kinds a second moment) in place of momentum",
            "adamw_torch",
        ),
    ),
    "stable_adamw": (
        "torch-optimi's StableAdamW, optionally with Kahan summation buffers",
        "adamw_torch",
    ),
}
# Fields that change what a step holds, not modelled yet: a job that sets one is refused, by name
# and why, where reading it as ignored would predict a peak several-fold off.
NOT_MODELLED = {
    "use_liger_kernel": "Liger's kernels fuse the loss over chunks of the logits, and the norms "
    "and MLPs",
    "optim_target_modules": "GaLore-style optimizers keep these modules' gradients projected",
    "auto_find_batch_size": "the Trainer halves the batch after each out-of-memory until one fits",
    "torch_empty_cache_steps": "the allocator's cache is emptied every N steps, which changes "
    "what is reserved",
    "optim_args": "options passed to the optimizer (momentum, block sizes) change its state",
    "label_smoothing_factor": "the Trainer's LabelSmoother takes the loss from the whole logits' "
    "log-softmax, not the model's own loss",
    "neftune_noise_alpha": "NEFTune adds noise to the embeddings' output in every forward",
    "parallelism_config": "accelerate's tensor and context parallelism split the model and the "
    "sequence over the ranks",
    "use_cache": "each training forward returns a cache of every layer's keys and values, which "
    "checkpointing then cannot free",
    "full_determinism": "deterministic algorithms, and CUBLAS_WORKSPACE_CONFIG=:4096:8 for "
    "cuBLAS's workspaces, change kernels' temporaries and what is reserved",
    "debug": "underflow_overflow's hooks take the absolute maximum of every module's inputs and "
    "outputs, a temporary the size of each",
    "use_cpu": "the job runs on the host's CPU, not on a card",
}
# Fields that change nothing a step holds, by where transformers' Trainer reads them (its source,
# transformers 5.x): a job sets them as it likes. tests/suite/test_training_args.py trains with
# transformers' Trainer with each of them set otherwise and holds every step's peak to the byte.
UNCHANGED: dict[str, str] = {
    **dict.fromkeys(
        (
            "output_dir",
            "num_train_epochs",
            "max_steps",
            "logging_strategy",
            "logging_steps",
            "logging_first_step",
            "log_on_each_node",
            "log_level",
            "log_level_replica",
            "logging_nan_inf_filter",
            "disable_tqdm",
            "report_to",
            "run_name",
            "project",
            "trackio_space_id",
            "trackio_bucket_id",
            "trackio_static_space_id",
            "skip_memory_metrics",
            "do_train",
            "do_eval",
            "do_predict",
            "resume_from_checkpoint",
            "ignore_data_skip",
            "restore_callback_states_from_checkpoint",
            "seed",
            "data_seed",
            "enable_jit_checkpoint",
            "include_num_input_tokens_seen",
        ),
        "the training loop's bookkeeping around its steps (how many, their logs and seeds, the "
        "tokens counted before each): no forward, backward or update reads it",
    ),
    **dict.fromkeys(
        (
            "learning_rate",
            "lr_scheduler_type",
            "lr_scheduler_kwargs",
            "warmup_steps",
            "weight_decay",
            "adam_beta1",
            "adam_beta2",
            "adam_epsilon",
        ),
        "values the update reads, not sizes: the optimizer keeps the same state and makes the "
        "same temporaries (weight decay scales the parameters in place)",
    ),
    **dict.fromkeys(
        (
            "eval_strategy",
            "eval_steps",
            "eval_delay",
            "eval_on_start",
            "per_device_eval_batch_size",
            "prediction_loss_only",
            "eval_accumulation_steps",
            "eval_do_concat_batches",
            "eval_use_gather_object",
            "include_for_metrics",
            "batch_eval_metrics",
            "bf16_full_eval",
            "fp16_full_eval",
            "metric_for_best_model",
            "greater_is_better",
            "load_best_model_at_end",
        ),
        "evaluation, which runs between training steps, not in one (its own peak, without "
        "gradients at per_device_eval_batch_size, is not predicted here)",
    ),
    **dict.fromkeys(
        (
            "save_strategy",
            "save_steps",
            "save_total_limit",
            "save_only_model",
            "save_on_each_node",
            "push_to_hub",
            "hub_token",
            "hub_private_repo",
            "hub_model_id",
            "hub_strategy",
            "hub_always_push",
            "hub_revision",
        ),
        "checkpoints and uploads, written between steps",
    ),
    **dict.fromkeys(
        (
            "dataloader_drop_last",
            "dataloader_num_workers",
            "dataloader_pin_memory",
            "dataloader_persistent_workers",
            "dataloader_prefetch_factor",
            "dataloader_multiprocessing_context",
            "dataloader_in_order",
            "remove_unused_columns",
            "label_names",
            "train_sampling_strategy",
            "length_column_name",
        ),
        "the host's data loading: a step takes the same batch on the card (its sequences all of "
        "the run's length)",
    ),
    **dict.fromkeys(
        (
            "local_rank",
            "ddp_backend",
            "ddp_timeout",
            "ddp_find_unused_parameters",
            "ddp_bucket_cap_mb",
            "ddp_broadcast_buffers",
            "ddp_static_graph",
            "accelerator_config",
            "average_tokens_across_devices",
        ),
        "settings across processes: the job is predicted on one card, where DDP's buckets and "
        "accelerate's batch dispatch do not run and a gather of one process is its own tensor",
    ),
    "liger_kernel_config": "read only beside use_liger_kernel, which is refused",
}
# TRL's SFTConfig (trl/trainer/sft_config.py and base_config.py, TRL at f2cd577): a file with any
# of its own fields is read as one. Its defaults differ from TrainingArguments' where a step's
# memory is concerned: checkpointing on, bf16 unless fp16, 1,024-token sequences, and a loss that
# runs the head on chunks of positions.
SFT_FIELDS = frozenset(
    {
        "model_init_kwargs",
        "trust_remote_code",
        "router_aux_loss_coef",
        "chat_template_path",
        "dataset_text_field",
        "dataset_kwargs",
        "dataset_num_proc",
        "eos_token",
        "max_length",
        "truncation_mode",
        "shuffle_dataset",
        "packing",
        "packing_strategy",
        "padding_free",
        "pad_to_multiple_of",
        "eval_packing",
        "completion_only_loss",
        "assistant_only_loss",
        "loss_type",
        "activation_offloading",
        "pad_token",
    }
)
SFT_DEFAULTS = {"gradient_checkpointing": True, "max_length": 1024}
SFT_LOSSES = {"chunked_nll": "sft-chunked-nll", "nll": "sft-nll"}
SFT_NOT_MODELLED = {
    "activation_offloading": "TRL moves saved activations to the host on a side stream, keeping "
    "the last five on the device",
}
# SFTConfig's fields that change nothing a step holds (TRL at f2cd577: where SFTTrainer reads them)
SFT_UNCHANGED: dict[str, str] = {
    **dict.fromkeys(
        (
            "dataset_text_field",
            "dataset_kwargs",
            "dataset_num_proc",
            "chat_template_path",
            "eos_token",
            "pad_token",
            "truncation_mode",
            "shuffle_dataset",
        ),
        "the dataset's preparation before training: a step takes sequences of the run's length",
    ),
    **dict.fromkeys(
        ("completion_only_loss", "assistant_only_loss"),
        "which tokens are targets: label values, not sizes (the chunked loss runs a chunk at a "
        "time, however many there are; the prediction counts every position a target)",
    ),
    "trust_remote_code": "how the model is loaded, not what it holds",
    "router_aux_loss_coef": "the weight of a mixture of experts' balancing loss: a value",
    "eval_packing": "evaluation, which runs between training steps, not in one",
}
SFT_READ = {
    "max_length",
    "pad_to_multiple_of",
    "model_init_kwargs",
    "loss_type",
    "packing",
    "packing_strategy",
    "padding_free",
}
# the packing strategies that flatten a batch's packed rows into one (SFTTrainer's padding_free)
FLATTENED = ("bfd", "bfd_split")
# TRL's other trainers' configs (trl/trainer/*_config.py at f2cd577), each known by fields of its
# own, and what their step holds that a TrainingArguments step does not
TRL_OTHERS = {
    "DPOConfig": {
        "precompute_ref_log_probs",
        "f_divergence_type",
        "ref_model_mixup_alpha",
        "ld_alpha",
    },
    "GRPOConfig": {"num_generations", "max_completion_length", "use_vllm", "steps_per_generation"},
    "KTOConfig": {"desirable_weight", "undesirable_weight"},
    "RewardConfig": {"center_rewards_coefficient"},
}
TRL_OTHER_WHY = {
    "DPOConfig": "preference training runs each sample's chosen and rejected sequences, beside a "
    "reference model's log-probabilities",
    "GRPOConfig": "it generates groups of completions to each prompt and trains on their rewards, "
    "beside a reference model",
    "KTOConfig": "it trains on desirable and undesirable completions beside a reference model's "
    "log-probabilities",
    "RewardConfig": "it trains a reward model on pairs of chosen and rejected sequences",
}
# model_init_kwargs: those that load the same weights the same way, and those a model's name sets
# (bench.models.hf) where SFTTrainer loads it by name; any other changes what a step holds
SAME_WEIGHTS = {"trust_remote_code", "revision", "device_map", "low_cpu_mem_usage", "use_cache"}
LOAD_DTYPES = ("float32", "bfloat16", "float16", "auto")
READ = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "gradient_checkpointing",
    "gradient_checkpointing_kwargs",
    "activation_checkpointing",
    "activation_checkpointing_kwargs",
    "optim",
    "bf16",
    "fp16",
    "tf32",
    "torch_compile",
    "torch_compile_mode",
    "torch_compile_backend",
    "max_grad_norm",
    "fsdp",
    "fsdp_config",
    "deepspeed",
)
# the Trainer's mixed precision flags, and the dtype each computes in
PRECISIONS = (("bf16", "bfloat16"), ("fp16", "float16"))
# fsdp_config's keys (transformers 5's _process_fsdp_args, FSDP2): those the fsdp technique takes,
# those that change nothing a step holds, and those refused with why
FSDP_READ = {
    "version",
    "reshard_after_forward",
    "cpu_offload",
    "auto_wrap_policy",
    "transformer_layer_cls_to_wrap",
    "activation_checkpointing",
}
FSDP_UNCHANGED = {
    "min_num_params",  # the size-based wrap's, which is refused
    "cpu_ram_efficient_loading",  # how weights load before training: rank 0 reads, then shards
    "state_dict_type",  # how checkpoints are saved
    "sync_module_states",  # FSDP1's; FSDP2 loads as cpu_ram_efficient_loading says
    "forward_prefetch",  # FSDP1's
    "backward_prefetch",  # FSDP1's
    "use_orig_params",  # FSDP1's
    "limit_all_gathers",  # FSDP1's
    "xla",
    "xla_fsdp_v2",
    "xla_fsdp_grad_ckpt",
    "xla_fsdp_settings",
}
# ds_config's keys (DeepSpeed 0.19 under transformers 5's Trainer): those read, those that change
# nothing a step holds (logs, the learning-rate schedule, checkpoints), and those refused with why
DS_READ = {
    "optimizer",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "gradient_clipping",
    "bf16",
    "fp16",
    "zero_optimization",
}
# zero_optimization's keys read when a checkpoint is saved or loaded, never in a step
DS_ZERO_UNCHANGED = {
    "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "elastic_checkpoint",
    "load_from_fp32_weights",
}
DS_UNCHANGED = {
    "steps_per_print",
    "wall_clock_breakdown",
    "scheduler",
    "zero_allow_untested_optimizer",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comms_logger",
    "flops_profiler",
    "checkpoint",
    "dump_state",
}
DS_REFUSED = {
    "activation_checkpointing": "DeepSpeed's own checkpointing (partitioned, possibly on the "
    "host) is not modelled; gradient_checkpointing is",
    "communication_data_type": "gradients reduced in another dtype than the model's",
    "data_types": "gradients accumulated in another dtype than the model's",
}
# the Trainer's arguments each batch key of ds_config must agree with (train_batch_size also
# counts the ranks, which the arguments do not give: it is checked by DeepSpeed at the run)
DS_BATCH = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
}
DS_PRECISION_KEYS = {
    # the loss scale's values: the same tensors at any of them
    "fp16": {
        "enabled",
        "auto_cast",
        "loss_scale",
        "loss_scale_window",
        "initial_scale_power",
        "hysteresis",
        "consecutive_hysteresis",
        "min_loss_scale",
    },
    "bf16": {"enabled"},
}
# a ds_config's optimizer types DeepSpeed builds as FusedAdam (its type lowercased, as it reads it),
# as the deepspeed technique names them, and the parameters that are values its update reads
DS_OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam"}
DS_OPTIMIZER_PARAMS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction"}
# offload_optimizer's keys (DeepSpeedZeroOffloadOptimizerConfig) that change nothing a step holds
# on a CPU offload: NVMe's own, and how fast the partitions are first made
DS_OFFLOAD_UNCHANGED = {
    "nvme_path",
    "buffer_count",
    "pipeline",
    "pipeline_read",
    "pipeline_write",
    "fast_init",
}
# offload_param's (DeepSpeedZeroOffloadParamConfig): NVMe's own buffers and its share kept on the
# host
DS_OFFLOAD_PARAM_UNCHANGED = {"nvme_path", "buffer_count", "buffer_size", "max_in_cpu"}
# each offload section: the technique's options it sets (to where, pinned), the keys besides those
# DeepSpeed reads (offload_optimizer's ratio, refused but at 1.0), and what NVMe would swap
DS_OFFLOADS = {
    "offload_optimizer": (
        "offload_optimizer",
        "offload_pin_memory",
        DS_OFFLOAD_UNCHANGED | {"ratio"},
        "the state swapped to NVMe through host buffers is",
    ),
    "offload_param": (
        "offload_param",
        "offload_param_pin_memory",
        DS_OFFLOAD_PARAM_UNCHANGED,
        "the parameters swapped in from NVMe through host buffers are",
    ),
}
FSDP_REFUSED = {
    "activation_checkpointing_offload": "accelerate's offload_wrapper keeps each checkpointed "
    "layer's input in host memory",
    "ignored_modules": "the modules it names stay whole on every rank, outside the shards",
}


@dataclass(frozen=True)
class Job:
    """What the arguments make of a run: its techniques (TOML form), its batch per device, and what
    was ignored."""

    techniques: list[Any]
    batch_size: int
    ignored: tuple[str, ...]
    # TRL's SFTConfig: its sequences' length (max_length, rounded up to pad_to_multiple_of; None
    # where it truncates nothing); None for a plain Trainer's arguments
    max_length: int | None = None
    sft: bool = False


def read(path: str, where: str, problems: list[str]) -> Job | None:
    """The job ``path`` describes; None, with the problems said, where it cannot be read or makes no
    sense."""
    args = load_args(Path(path), where, problems)
    if args is None:
        return None
    if other := next(
        ((k, f) for k, named in TRL_OTHERS.items() if (f := args.keys() & named)), None
    ):
        kind, named = other
        problems.append(
            f"{where}: a TRL {kind} (it sets {', '.join(sorted(named))}): {TRL_OTHER_WHY[kind]}, "
            "which this harness does not model; TrainingArguments and SFTConfig jobs are"
        )
        return None
    from transformers import TrainingArguments

    known = {f.name for f in fields(TrainingArguments)}
    sft = bool(args.keys() & SFT_FIELDS)
    if sft:
        known |= SFT_FIELDS
        args = sft_defaults(args)
    found = [
        f"{where}: {key}: not a {'SFTConfig' if sft else 'TrainingArguments'} field "
        f"(transformers {_version()})"
        for key in sorted(args.keys() - known)
    ]
    refused = NOT_MODELLED | (SFT_NOT_MODELLED if sft else {})
    found += [
        f"{where}: {key} = {args[key]!r}: whether it changes what a step holds is not known to "
        f"this harness (a field of transformers {_version()} it has not classified); remove it "
        "to predict the job without it"
        for key in sorted(args.keys() & unclassified())
        if args[key] != defaults()[key]
    ]
    found += [
        f"{where}: {key} = {args[key]!r}: changes what a step holds ({why}), which this harness "
        "does not model yet; remove it to predict the job without it"
        for key, why in refused.items()
        if args.get(key) not in (None, False, "", [], {})
    ]
    # under DeepSpeed its engine takes the precision and the clipping (accelerate leaves both to it)
    engine = _deepspeed(args, Path(path).parent, where, found)
    optimizer = []
    # a ds_config's optimizer section: DeepSpeed builds its own, the Trainer's optim unused
    if not any(t.get("optimizer", "trainer") != "trainer" for t in engine):
        optimizer = _optimizer(args, where, found)
    techniques = (
        (engine or _precision(args, where, found))
        + _fsdp(args, Path(path).parent, where, found)
        + optimizer
        + _checkpointing(args, where, found)
        + (_sft_loss(args, where, found) + _sft_packing(args, where, found) if sft else [])
    )
    steps = _positive(args, "gradient_accumulation_steps", default=1, where=where, found=found)
    batch = _positive(args, "per_device_train_batch_size", default=8, where=where, found=found)
    techniques += [{"name": "accumulate", "micro_batches": steps}] if steps > 1 else []
    techniques += [{"name": "tf32", "enabled": True}] if args.get("tf32") else []
    techniques += _compile(args, where, found)
    if not engine:
        techniques += _clipping(args, where, found)
    length = _sft_length(args, where, found) if sft else None
    problems += found
    read_here = set(READ) | set(refused) | (SFT_READ if sft else set())
    ignored = tuple(sorted(k for k in args.keys() & known if k not in read_here))
    if found:
        return None
    return Job(techniques, batch * steps, ignored, max_length=length, sft=sft)


def unclassified() -> set[str]:
    """The installed TrainingArguments' fields neither read, refused nor known to change nothing
    (a field a newer transformers adds): at a value other than its default, a job is refused."""
    return defaults().keys() - set(READ) - NOT_MODELLED.keys() - UNCHANGED.keys()


@functools.cache
def defaults() -> dict[str, Any]:
    """The installed TrainingArguments' fields and their defaults."""
    from transformers import TrainingArguments

    return {
        f.name: f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]
        for f in fields(TrainingArguments)
        if f.init
    }


def sft_defaults(args: dict[str, Any]) -> dict[str, Any]:
    """An SFTConfig's fields with TRL's defaults where they differ from TrainingArguments' and
    change what a step holds (bf16: true unless fp16, as its __post_init__ sets it)."""
    out = SFT_DEFAULTS | args
    for key, default in (("bf16", not out.get("fp16")), ("loss_type", "chunked_nll")):
        if out.get(key) is None:  # TRL's __post_init__ fills these where left None
            out[key] = default
    return out


def sequence_length(args: dict[str, Any]) -> int | None:
    """An SFTConfig's sequences' length (``Job.max_length``); None for TrainingArguments, or where
    it truncates nothing."""
    if not args.keys() & SFT_FIELDS:
        return None
    return _sft_length(sft_defaults(args), "", [])


def loaded_as(args: dict[str, Any]) -> dict[str, str]:
    """How SFTTrainer loads a model it is given by name (``create_model_from_path``): the fields a
    model's name sets after its path (bench.models.hf), its dtype float32 unless model_init_kwargs
    says otherwise ("auto": the config's). Empty for TrainingArguments."""
    if not args.keys() & SFT_FIELDS:
        return {}
    init = args.get("model_init_kwargs") or {}
    dtype = init.get("dtype") or init.get("torch_dtype") or "float32"
    out = {} if dtype == "auto" else {"dtype": dtype}
    if init.get("attn_implementation"):
        out["attn_implementation"] = init["attn_implementation"]
    return out


def _sft_loss(args: dict[str, Any], where: str, found: list[str]) -> list[Any]:
    """SFTTrainer's loss (``loss_type``), after the technique its model_init_kwargs load the model
    with (a BitsAndBytesConfig's 4 bits, as bnb-4bit); each other one that loads other weights a
    problem."""
    init = args.get("model_init_kwargs") or {}
    if not isinstance(init, dict):
        found.append(f"{where}: model_init_kwargs: expected a table, got {init!r}")
        init = {}
    loaded = []
    if isinstance(init.get("quantization_config"), dict):
        at = f"{where}: model_init_kwargs.quantization_config"
        loaded = [t] if (t := quantized.technique(init["quantization_config"], at, found)) else []
    for key, value in init.items():
        dtype = key in ("dtype", "torch_dtype") and value in (*LOAD_DTYPES, None)
        if key == "quantization_config" and isinstance(value, dict):
            continue
        if key not in SAME_WEIGHTS and key != "attn_implementation" and not dtype:
            found.append(
                f"{where}: model_init_kwargs.{key} = {value!r}: changes the weights a step holds, "
                "which this harness does not model for a TRL job yet; remove it to predict the "
                f"model loaded as {', '.join(LOAD_DTYPES)} weights"
            )
    loss = args["loss_type"]
    if loss in SFT_LOSSES:
        return [*loaded, SFT_LOSSES[loss]]
    found.append(
        f"{where}: loss_type = {loss!r}: not modelled here; one of {', '.join(SFT_LOSSES)}"
    )
    return loaded


def _sft_packing(args: dict[str, Any], where: str, found: list[str]) -> list[Any]:
    """``packing`` where SFTTrainer flattens a batch into one row (``padding_free``, or packing by
    best fit, which sets it): its sequences as the run's of max_length tokens each, the rows as
    full as packing fills them. SFTTrainer asks for FlashAttention there; under any other
    attention transformers masks the row by its position ids, which is not modelled. Wrapped
    packing alone cuts rows of max_length across sequences: the fixed-shape step as it is."""
    strategy = args.get("packing_strategy", "bfd")
    if args.get("packing") and strategy not in (*FLATTENED, "wrapped"):
        found.append(
            f"{where}: packing_strategy = {strategy!r}: none of TRL's ({', '.join(FLATTENED)}, "
            "wrapped)"
        )
        return []
    if not (args.get("padding_free") or (args.get("packing") and strategy in FLATTENED)):
        return []
    named = "packing" if args.get("packing") else "padding_free"
    if args.get("max_length") is None:
        found.append(f"{where}: {named} with max_length = None: TRL packs to max_length; set it")
        return []
    init = args.get("model_init_kwargs")
    attention = isinstance(init, dict) and init.get("attn_implementation")
    if attention not in flash.NAMES:
        found.append(
            f"{where}: {named} with attention {attention or 'sdpa'} (model_init_kwargs."
            "attn_implementation): transformers then masks the flattened row by its position "
            "ids, which this harness does not model; set it to flash_attention_2, as TRL asks"
        )
        return []
    return ["packing"]


def _sft_length(args: dict[str, Any], where: str, found: list[str]) -> int | None:
    """The sequences' length: max_length, to which TRL truncates, padded up to a multiple of
    pad_to_multiple_of; None where max_length is None (nothing truncated)."""
    length, multiple = args.get("max_length"), args.get("pad_to_multiple_of")
    for key, value in (("max_length", length), ("pad_to_multiple_of", multiple)):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            found.append(f"{where}: {key}: expected a whole number of at least 1, got {value!r}")
            return None
    if length is None:
        return None
    return -(-length // multiple) * multiple if multiple else length


def load_args(path: Path, where: str, problems: list[str]) -> dict[str, Any] | None:
    """The file's fields; None, with the problem said, where it cannot be read as a table of
    them."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        problems.append(f"{where}: cannot read {path} ({exc.strerror or exc})")
        return None
    try:
        args = _parse(text, path.suffix)
    except ValueError as exc:
        problems.append(f"{where}: {path} does not parse: {exc}")
        return None
    if not isinstance(args, dict):
        problems.append(
            f"{where}: {path} holds a {type(args).__name__}; expected TrainingArguments' fields"
        )
        return None
    return args


def _parse(text: str, suffix: str) -> Any:
    if suffix in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(str(exc)) from None
    return json.loads(text)


def _precision(args: dict[str, Any], where: str, found: list[str]) -> list[Any]:
    """The Trainer's bf16 and fp16 are autocast (mixed precision), fp16 with its GradScaler."""
    if args.get("bf16") and args.get("fp16"):
        found.append(f"{where}: bf16 and fp16: both true; the Trainer takes one mixed precision")
        return []
    if precision := mixed_precision(args):
        return [{"name": "amp", "dtype": precision}]
    return []


def _fsdp(args: dict[str, Any], folder: Path, where: str, found: list[str]) -> list[Any]:
    """The Trainer's FSDP as transformers 5 reads it (``_process_fsdp_args``) and accelerate lays
    it out: FSDP2 unless ``fsdp_config`` says version 1; ``fsdp`` as a string or list of options
    (full_shard: reshard after forward; shard_grad_op: not; offload: cpu_offload; auto_wrap: the
    default) or True, the rest in ``fsdp_config`` (a dict, or a JSON file's path, ``fsdp_`` taken
    off its keys); mixed precision from bf16 or fp16. Each rank of the job's processes (the run's
    nproc) is predicted. What transformers would refuse, or what changes a step's memory that the
    fsdp technique does not take, is a problem named."""
    if not _fsdp_asked(args):
        return []
    fsdp = args["fsdp"]
    config = _fsdp_config(args.get("fsdp_config"), folder, where, found)
    if config is None:
        return []
    if int(config.get("version", 2)) != 2:
        found.append(
            f"{where}: fsdp_config.version = {config['version']!r}: FSDP1, deprecated in "
            "transformers 5, is not modelled; FSDP2 (version 2, the default) is"
        )
    if isinstance(fsdp, str):
        items = fsdp.split()
    elif isinstance(fsdp, list):
        items = fsdp
    else:  # True: everything in fsdp_config
        items = []
    for item in items:
        if item in ("full_shard", "shard_grad_op"):
            config.setdefault("reshard_after_forward", item == "full_shard")
        elif item == "offload":
            config.setdefault("cpu_offload", True)
        elif item != "auto_wrap":
            found.append(
                f"{where}: fsdp: {item!r}: not an FSDP2 option (transformers 5 takes full_shard, "
                "shard_grad_op, offload and auto_wrap; hybrid_shard and no_shard are FSDP1's)"
            )
    for key in sorted(config.keys() - FSDP_READ - FSDP_UNCHANGED):
        why = FSDP_REFUSED.get(key, "not an fsdp_config key transformers 5 reads")
        found.append(f"{where}: fsdp_config.{key}: {why}; not modelled")
    if (policy := config.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")) != (
        "TRANSFORMER_BASED_WRAP"
    ):
        found.append(
            f"{where}: fsdp_config.auto_wrap_policy = {policy!r}: only TRANSFORMER_BASED_WRAP (the "
            "default: each transformer layer a unit) is modelled"
        )
    checkpointed = _bool(config.get("activation_checkpointing", False))
    if checkpointed and _renamed(args, "activation_checkpointing", "gradient_checkpointing"):
        found.append(
            f"{where}: fsdp_config.activation_checkpointing and gradient_checkpointing: the "
            "Trainer refuses both at once; keep FSDP's own"
        )
    layers = config.get("transformer_layer_cls_to_wrap") or []
    technique = {
        "name": "fsdp",
        "layout": "accelerate",
        "reshard_after_forward": _bool(config.get("reshard_after_forward", True)),
        "cpu_offload": _bool(config.get("cpu_offload", False)),
        "activation_checkpointing": checkpointed,
        "wrap": ",".join([layers] if isinstance(layers, str) else layers),
    }
    precision = mixed_precision(args)
    return [technique | ({"mixed_precision": precision} if precision else {})]


def mixed_precision(args: dict[str, Any]) -> str | None:
    """The dtype the Trainer's bf16 or fp16 computes in; None for neither."""
    return next((dtype for flag, dtype in PRECISIONS if args.get(flag)), None)


def sharded(args: dict[str, Any]) -> bool:
    """Whether the arguments ask for the Trainer's FSDP or DeepSpeed (``deepspeed``, a
    ds_config)."""
    return _fsdp_asked(args) or bool(args.get("deepspeed"))


def _fsdp_asked(args: dict[str, Any]) -> bool:
    """Whether ``fsdp`` is set, as a flag or options."""
    return args.get("fsdp") not in (None, False, "", [])


def _deepspeed(args: dict[str, Any], folder: Path, where: str, found: list[str]) -> list[Any]:
    """The Trainer's DeepSpeed (``deepspeed``: a ds_config, a dict or a JSON file's path) as
    transformers 5 and accelerate fill it (HfTrainerDeepSpeedConfig, DeepSpeedPlugin): each "auto"
    from the arguments (the batch, the accumulation steps, max_grad_norm, bf16 or fp16; a section
    left out takes the arguments' mixed precision) or, for the buckets, from the model's hidden
    size (the technique's ``auto``, read where the model is); the Trainer's optimizer handed to the
    engine. A key set otherwise than the arguments, or one the technique does not take at a value
    other than DeepSpeed's default, is a problem named."""
    if not args.get("deepspeed"):
        return []
    at = f"{where}: deepspeed"
    if _fsdp_asked(args):
        found.append(f"{at} and fsdp: the Trainer runs one engine; keep one")
        return []
    config = _json_table(args["deepspeed"], folder, at, found)
    if config is None:
        return []
    try:
        imported()
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except ImportError:
        found.append(f"{at}: reading a ds_config needs deepspeed: pip install -e '.[sharding]'")
        return []
    for key in sorted(config.keys() - DS_READ - DS_UNCHANGED):
        why = DS_REFUSED.get(key, "not a ds_config key this harness reads")
        found.append(f"{at}.{key}: {why}; remove it to predict the job without it")
    for key, arg in DS_BATCH.items():
        value, own = config.get(key, "auto"), args.get(arg, _default(arg))
        if value != "auto" and value != own:
            found.append(f"{at}.{key} = {value!r}: the Trainer refuses it beside {arg} = {own!r}")
    technique = {"name": "deepspeed"} | _ds_precision(config, args, at, found)
    if (own := _ds_optimizer(config.get("optimizer"), at, found)) is not None:
        technique["optimizer"] = own
    clipping = config.get("gradient_clipping", 0.0)
    if clipping == "auto":
        clipping = args.get("max_grad_norm", _default("max_grad_norm"))
    technique["gradient_clipping"] = float(clipping or 0.0)
    return [
        technique | _zero(config.get("zero_optimization") or {}, DeepSpeedZeroConfig, at, found)
    ]


def _ds_optimizer(section: Any, at: str, found: list[str]) -> str | None:
    """The optimizer a ds_config's section has DeepSpeed build (the Trainer then hands it no
    optimizer of its own, its optim unused); None where it names none."""
    if not section:
        return None
    kind = str(section.get("type", "")).lower()
    if kind not in DS_OPTIMIZERS:
        found.append(
            f"{at}.optimizer.type = {section.get('type')!r}: only AdamW and Adam (DeepSpeed's "
            "FusedAdam) are modelled; without the section the engine steps the Trainer's optim"
        )
        return None
    for key in sorted((section.get("params") or {}).keys() - DS_OPTIMIZER_PARAMS):
        found.append(
            f"{at}.optimizer.params.{key}: not modelled (torch_adam, fp32_optimizer_states: "
            "another optimizer or other state than FusedAdam's); remove it"
        )
    return DS_OPTIMIZERS[kind]


def _ds_precision(
    config: dict[str, Any], args: dict[str, Any], at: str, found: list[str]
) -> dict[str, str]:
    """The engine's 16-bit mode: a section's ``enabled`` where set, "auto" or left out the
    arguments' flag (accelerate's set_mixed_precision)."""
    enabled = []
    for section, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
        table = config.get(section) or {}
        for key in sorted(table.keys() - DS_PRECISION_KEYS[section]):
            found.append(f"{at}.{section}.{key}: not modelled; remove it")
        on = table.get("enabled", "auto")
        if on == "auto":
            on = args.get(section)
        if _bool(on):
            enabled.append(dtype)
    if len(enabled) > 1:
        found.append(f"{at}: bf16 and fp16 both enabled; DeepSpeed takes one")
    if not enabled:
        return {}
    return {"precision": enabled[0]}


def _zero(zero: dict[str, Any], schema: Any, at: str, found: list[str]) -> dict[str, Any]:
    """zero_optimization as the technique's options: its stage, the bucket keys it takes ("auto":
    the model's hidden size, at stage 3 for the stage3_ ones, as the Trainer fills them), and any
    other key only at DeepSpeed's own default (``schema``: its DeepSpeedZeroConfig)."""
    stage = zero.get("stage", 0)
    options: dict[str, Any] = {"stage": stage}
    autos = []
    defaults = {(f.alias or name): f.default for name, f in schema.model_fields.items()}
    for key, value in sorted(zero.items()):
        if key == "stage" or (key.startswith("stage3_") and stage != 3):
            continue  # the Trainer fills, and DeepSpeed reads, the stage3_ keys at stage 3 alone
        if key in ZERO_KEYS and value == "auto" and key in HIDDEN:
            autos.append(key)
        elif key in ZERO_KEYS and not isinstance(value, str):
            options[key] = value
            if not isinstance(value, bool):  # 2e8, as JSON configs write it
                options[key] = int(value)
        elif key in DS_OFFLOADS:
            if key != "offload_param" or stage == 3:  # DeepSpeed reads that one at stage 3 alone
                options |= _offload(key, value or {}, f"{at}.zero_optimization.{key}", found)
        elif key not in DS_ZERO_UNCHANGED and (key not in defaults or value != defaults[key]):
            found.append(
                f"{at}.zero_optimization.{key} = {value!r}: not modelled (DeepSpeed's default: "
                f"{defaults.get(key, 'none')!r}); remove it to predict the job without it"
            )
    if autos:
        options["auto"] = ",".join(autos)
    return options


def _offload(key: str, section: dict[str, Any], at: str, found: list[str]) -> dict[str, Any]:
    """An offload section (``DS_OFFLOADS``) as the technique's options: to the host ("cpu"), pinned
    or not; NVMe, a part offloaded (offload_optimizer's ``ratio``) and a key DeepSpeed does not read
    are problems named."""
    option, pinned_option, reads, swapped = DS_OFFLOADS[key]
    device = section.get(OFFLOAD_TO, "none")
    if device == "none":
        return {}
    if device != "cpu":
        found.append(f"{at}.device = {device!r}: {swapped} not modelled; 'cpu' is")
        return {}
    if "ratio" in reads and (ratio := section.get("ratio", 1.0)) != 1.0:
        found.append(
            f"{at}.ratio = {ratio!r}: a part of the partitions stepped on the device (ZeRO-3's "
            "partial offload) is not modelled; 1.0 is"
        )
    for unread in sorted(set(section) - {OFFLOAD_TO, "pin_memory"} - reads):
        found.append(f"{at}.{unread}: not an {key} key DeepSpeed reads")
    return {option: "cpu", pinned_option: _bool(section.get("pin_memory", False))}


def _json_table(given: Any, folder: Path, at: str, found: list[str]) -> dict[str, Any] | None:
    """A dict given inline or as a JSON file's path (read where given, else beside the
    arguments); None, the problem said, where it is neither."""
    if isinstance(given, str):
        path = Path(given) if Path(given).exists() else folder / given
        try:
            given = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            found.append(f"{at} {given!r}: cannot read it as JSON ({exc})")
            return None
    if not isinstance(given, dict):
        found.append(f"{at}: a dict or a JSON file's path, got {given!r}")
        return None
    return given


def _fsdp_config(given: Any, folder: Path, where: str, found: list[str]) -> dict[str, Any] | None:
    """``fsdp_config`` as a dict (``_json_table``), each key without its ``fsdp_`` prefix; None,
    the problem said, where it cannot be read."""
    if given in (None, ""):
        return {}
    table = _json_table(given, folder, f"{where}: fsdp_config", found)
    if table is None:
        return None
    return {k.removeprefix("fsdp_"): v for k, v in table.items()}


def _bool(value: Any) -> bool:
    """A flag as transformers reads it (``str_to_bool``: "true", "1", True)."""
    return str(value).lower() in ("true", "1", "yes", "y", "on", "t")


def _optimizer(args: dict[str, Any], where: str, found: list[str]) -> list[Any]:
    """The Trainer's optimizer; where the file names none, the installed TrainingArguments'
    default (transformers 5 on torch 2.8 or later: the fused AdamW, which holds no foreach
    temporaries)."""
    optim = args.get("optim") or _default("optim")
    if optim in OPTIMIZERS:
        return list(OPTIMIZERS[optim])
    if optim in OPTIMIZERS_NOT_MODELLED:
        why, nearest = OPTIMIZERS_NOT_MODELLED[optim]
        found.append(f"{where}: optim = {optim!r}: not modelled here: {why}; nearest: {nearest}")
    else:
        found.append(
            f"{where}: optim = {optim!r}: not an optimizer the Trainer names; one of "
            f"{', '.join(OPTIMIZERS)}"
        )
    return []


def _checkpointing(args: dict[str, Any], where: str, found: list[str]) -> list[Any]:
    """gradient_checkpointing_enable wraps each decoder or encoder layer, non-reentrant unless the
    kwargs say otherwise (transformers 5's default; 4.x defaulted to reentrant, and says so in its
    kwargs when written). transformers 5 names them activation_checkpointing(_kwargs), the old
    names read where the new ones are unset."""
    enabled, kwargs = (
        _renamed(args, f"activation_checkpointing{end}", f"gradient_checkpointing{end}")
        for end in ("", "_kwargs")
    )
    kwargs = kwargs or {}
    if not isinstance(kwargs, dict) or kwargs.keys() - {"use_reentrant"}:
        found.append(
            f"{where}: gradient_checkpointing_kwargs: only use_reentrant is modelled, got "
            f"{kwargs!r}"
        )
        return []
    if not enabled:
        return []
    # activation_checkpointing_enable makes a text model's embeddings' output require grad
    reentrant = {"reentrant": True} if kwargs.get("use_reentrant") else {}
    return [{"name": "checkpoint", "input_grads": True, **reentrant}]


def _renamed(args: dict[str, Any], new: str, old: str) -> Any:
    """A field by its new name, else its deprecated one (TrainingArguments.__post_init__)."""
    if args.get(new) is not None:
        return args[new]
    return args.get(old)


def _compile(args: dict[str, Any], where: str, found: list[str]) -> list[Any]:
    """torch_compile, which a compile mode or backend sets too (TrainingArguments.__post_init__);
    Inductor's backend only."""
    mode, backend = args.get("torch_compile_mode"), args.get("torch_compile_backend")
    if not (args.get("torch_compile") or mode or backend):
        return []
    if backend not in (None, "inductor"):
        found.append(
            f"{where}: torch_compile_backend = {backend!r}: not modelled here; inductor (or leave "
            "it unset)"
        )
        return []
    return [{"name": "compile", "mode": mode}] if mode else ["compile"]


def _clipping(args: dict[str, Any], where: str, found: list[str]) -> list[Any]:
    """The gradients' norm, which the Trainer's loop takes every step after the last backward
    (transformers 5: clipped to max_grad_norm where positive, else taken for its logs alone) and
    holds until the next step's."""
    value = args.get("max_grad_norm", _default("max_grad_norm"))
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        found.append(f"{where}: max_grad_norm: expected a number, got {value!r}")
        return []
    if value > 0:
        return [{"name": "clip-grad-norm", "max_norm": float(value)}]
    return [{"name": "clip-grad-norm", "clip": False}]


def _positive(args: dict[str, Any], key: str, default: int, where: str, found: list[str]) -> int:
    value = args.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        found.append(f"{where}: {key}: expected a whole number of at least 1, got {value!r}")
        return default
    return value


def _default(name: str) -> Any:
    from transformers import TrainingArguments

    return next(f.default for f in fields(TrainingArguments) if f.name == name)


def _version() -> str:
    import transformers

    return transformers.__version__
