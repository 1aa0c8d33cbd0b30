"""A run's training_args: a transformers TrainingArguments file (JSON or YAML) becomes the
techniques and batch it means, what changes no memory is named as ignored, a wrong field is a load
error naming it, and the run holds what the Trainer itself holds in its step."""

import json

import pytest
import torch

from bench.data.synthetic import clone_batch
from bench.measure.memory import tracked_step
from bench.suite import SuiteError, load
from tests.conftest import CPU, build_trainer

# the Trainer's gradient checkpointing: transformers' activation_checkpointing_enable, which makes a
# text model's embeddings' output require grad
CHECKPOINT = "checkpoint(input_grads=True)"
ARGS = {
    "output_dir": "out",
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "gradient_checkpointing": True,
    "bf16": True,
    "optim": "adafactor",
    "learning_rate": 2e-5,
    "logging_steps": 5,
}


def suite(tmp_path, args, name="args.json", extra=""):
    (tmp_path / name).write_text(args if isinstance(args, str) else json.dumps(args))
    path = tmp_path / "job.toml"
    path.write_text(
        'model = "hf:suites/configs/tiny-llama"\nbaseline = "baseline"\n[shapes.gpu]\nbatch_size '
        "= 4\n"
        'seq_len = 32\n[shapes.cpu]\nbatch_size = 4\nseq_len = 32\n[[runs]]\nname = "baseline"\n'
        f'techniques = []\n[[runs]]\nname = "trainer"\ntraining_args = "{tmp_path / name}"\n{extra}'
    )
    return path


@pytest.mark.parametrize(
    "name, text",
    [
        ("args.json", json.dumps(ARGS)),
        # as TRL and axolotl write them
        ("args.yaml", "\n".join(f"{k}: {json.dumps(v)}" for k, v in ARGS.items())),
    ],
)
def test_the_fields_that_change_memory_become_techniques_and_the_rest_are_named(
    name, text, tmp_path, capsys
):
    run = load(suite(tmp_path, text, name)).runs[1]
    assert [t.label for t in run.techniques] == [
        "amp(dtype=bfloat16)",
        "optimizer(groups=trainer,kind=adafactor-transformers)",
        "checkpoint(input_grads=True)",
        "accumulate(micro_batches=2)",
        "clip-grad-norm(max_norm=1.0)",  # the Trainer's loop, at its default max_grad_norm
    ]
    assert run.gpu.batch_size == 4  # 2 per device, accumulated twice: the step the harness measures
    assert (
        "ignored, as they change nothing a step holds: learning_rate, logging_steps, output_dir"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "norm, kept", [(0.3, "max_norm=0.3"), (0, "clip=False"), (-1.0, "clip=False")]
)
def test_the_trainers_loop_takes_the_gradients_norm_clipping_where_max_grad_norm_is_positive(
    norm, kept, tmp_path
):
    """transformers 5's loop takes the norm every step, clipping where max_grad_norm > 0 and else
    taking it for its logs alone: read, never ignored."""
    run = load(suite(tmp_path, ARGS | {"max_grad_norm": norm})).runs[1]
    assert run.techniques[-1].label == f"clip-grad-norm({kept})"


def test_transformers_4s_own_adamw_is_read_as_what_it_was(tmp_path):
    """optim = "adamw_hf", in every TrainingArguments file transformers 4.x wrote: its own AdamW,
    stepping one parameter at a time (as the hf-bert-large suite models it), not a refusal."""
    run = load(suite(tmp_path, ARGS | {"optim": "adamw_hf"})).runs[1]
    assert "optimizer(groups=trainer,impl=single,kind=adamw)" in [t.label for t in run.techniques]


# a ds_config's offload_optimizer sections: to NVMe, and to the host
NVME, HOST = {"device": "nvme"}, {"device": "cpu"}


@pytest.mark.fault("cli values")
@pytest.mark.parametrize(
    "change, said",
    [
        (
            {"gradient_acumulation_steps": 2},
            "gradient_acumulation_steps: not a TrainingArguments field",
        ),
        ({"fp16": True}, "bf16 and fp16: both true"),
        (
            {"optim": "galore_adamw"},
            "optim = 'galore_adamw': not modelled here: galore_torch keeps the gradients",
        ),
        ({"optim": "adamw_typo"}, "optim = 'adamw_typo': not an optimizer the Trainer names"),
        (
            {"per_device_train_batch_size": 0},
            "per_device_train_batch_size: expected a whole number of at least 1",
        ),
        (
            {"gradient_checkpointing_kwargs": {"preserve_rng_state": False}},
            "only use_reentrant is modelled",
        ),
        # the Trainer's DeepSpeed: what a ds_config asks that the deepspeed technique does not take
        ({"deepspeed": "nowhere.json"}, "deepspeed 'nowhere.json': cannot read it as JSON"),
        (
            {"deepspeed": {"optimizer": {"type": "Lamb"}}},
            "deepspeed.optimizer.type = 'Lamb': only AdamW and Adam",
        ),
        (
            {"deepspeed": {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}},
            "deepspeed.optimizer.params.torch_adam: not modelled",
        ),
        (
            {"deepspeed": {"zero_optimization": {"stage": 3, "offload_param": NVME}}},
            "offload_param.device = 'nvme': the parameters swapped in from NVMe",
        ),
        (
            {
                "deepspeed": {
                    "zero_optimization": {"stage": 3, "offload_param": HOST | {"ratio": 0.5}}
                }
            },
            "offload_param.ratio: not an offload_param key DeepSpeed reads",
        ),
        (
            {"deepspeed": {"zero_optimization": {"stage": 2, "offload_optimizer": NVME}}},
            "offload_optimizer.device = 'nvme': the state swapped to NVMe",
        ),
        (
            {
                "deepspeed": {
                    "optimizer": {"type": "AdamW"},
                    "zero_optimization": {
                        "stage": 3,
                        "offload_optimizer": {"device": "cpu", "ratio": 0.3},
                    },
                }
            },
            "offload_optimizer.ratio = 0.3: a part of the partitions stepped on the device",
        ),
        # the Trainer, as DeepSpeed, refuses its own optimizer under offload
        (
            {"deepspeed": {"zero_optimization": {"stage": 2, "offload_optimizer": HOST}}},
            "offload_optimizer steps DeepSpeed's CPU Adam",
        ),
        (
            {"deepspeed": {"zero_optimization": {"stage": 2, "round_robin_gradients": True}}},
            "round_robin_gradients = True: not modelled \\(DeepSpeed's default: False\\)",
        ),
        (
            {"deepspeed": {"train_micro_batch_size_per_gpu": 4}},
            "the Trainer refuses it beside per_device_train_batch_size = 2",
        ),
        (
            {"deepspeed": {"zero_optimization": {"stage": 2}}, "fsdp": "full_shard"},
            "deepspeed and fsdp: the Trainer runs one engine",
        ),
        # the Trainer's FSDP2 as transformers 5 reads it: what it refuses, or the fsdp technique
        # does not take
        ({"fsdp": "hybrid_shard"}, "fsdp: 'hybrid_shard': not an FSDP2 option"),
        (
            {"fsdp": True, "fsdp_config": {"version": 1}},
            "fsdp_config.version = 1: FSDP1, deprecated in transformers 5, is not modelled",
        ),
        (
            {"fsdp": True, "fsdp_config": {"auto_wrap_policy": "SIZE_BASED_WRAP"}},
            "only TRANSFORMER_BASED_WRAP",
        ),
        (
            {"fsdp": True, "fsdp_config": {"activation_checkpointing_offload": True}},
            "fsdp_config.activation_checkpointing_offload: accelerate's offload_wrapper",
        ),
        (
            {"fsdp": True, "fsdp_config": {"activation_checkpointing": True}},
            "the Trainer refuses both at once",
        ),
        ({"fsdp": True, "fsdp_config": "nowhere.json"}, "fsdp_config 'nowhere.json': cannot read"),
        # each changes the peak several-fold: refused by name, never read as ignored
        ({"use_liger_kernel": True}, "use_liger_kernel = True: changes what a step holds"),
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor = 0.1: changes what a step"),
        ({"neftune_noise_alpha": 5}, "neftune_noise_alpha = 5: changes what a step holds"),
        ({"torch_compile_backend": "eager"}, "torch_compile_backend = 'eager': not modelled"),
    ],
)
def test_a_wrong_or_contradictory_field_is_a_load_error_naming_it(change, said, tmp_path):
    with pytest.raises(SuiteError, match=said):
        load(suite(tmp_path, ARGS | change))


@pytest.mark.parametrize(
    "fsdp, config, expected",
    [
        (
            "full_shard auto_wrap",
            {
                "activation_checkpointing": "true",
                "transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
            },
            {"reshard_after_forward": True, "activation_checkpointing": True},
        ),
        (["shard_grad_op", "offload"], {}, {"reshard_after_forward": False, "cpu_offload": True}),
        # everything in a JSON file beside the arguments, keys with accelerate's fsdp_ prefix
        (True, "fsdp.json", {"reshard_after_forward": False}),
    ],
)
def test_the_trainers_fsdp_is_fsdp2_laid_out_as_accelerate_lays_it_out(
    fsdp, config, expected, tmp_path
):
    """transformers 5 reads fsdp and fsdp_config into accelerate's FSDP2 plugin: the fsdp
    technique in accelerate's layout, in the Trainer's mixed precision, over the run's processes."""
    (tmp_path / "fsdp.json").write_text(json.dumps({"fsdp_reshard_after_forward": "false"}))
    args = ARGS | {"gradient_checkpointing": False, "fsdp": fsdp, "fsdp_config": config}
    run = load(suite(tmp_path, args, extra="nproc = 8\n")).runs[1]
    (sharded,) = [t for t in run.techniques if t.name == "fsdp"]
    defaults = {"reshard_after_forward": True, "cpu_offload": False}
    defaults |= {"activation_checkpointing": False, "wrap": ""}
    if isinstance(config, dict):
        defaults["wrap"] = config.get("transformer_layer_cls_to_wrap", "")
    wanted = {"layout": "accelerate", "mixed_precision": "bfloat16"} | defaults | expected
    assert dict(sharded.options) == wanted
    assert "amp(dtype=bfloat16)" in [t.label for t in run.techniques] and run.nproc == 8


# transformers' documented ZeRO-3 config (docs/source/en/deepspeed.md), but for its optimizer
# section: every batch and bucket key "auto"
ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "none"},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def test_the_trainers_deepspeed_is_the_engine_with_its_auto_values_filled(tmp_path):
    """transformers 5 fills a ds_config's "auto" values from the arguments (the batch, the
    accumulation, max_grad_norm, bf16) and, for its buckets, from the model's hidden size; the
    engine then takes the precision and the clipping, so neither autocast nor the Trainer's own
    clipping runs, and steps the Trainer's optimizer."""
    (tmp_path / "ds.json").write_text(json.dumps(ZERO3))
    args = ARGS | {"deepspeed": "ds.json"}
    run = load(suite(tmp_path, args, extra="nproc = 8\n")).runs[1]
    assert [t.name for t in run.techniques] == [
        "deepspeed",
        "optimizer",
        "checkpoint",
        "accumulate",
    ]
    assert dict(run.techniques[0].options) == {
        "stage": 3,
        "precision": "bfloat16",
        "gradient_clipping": 1.0,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "stage3_max_live_parameters": 10**9,
        "stage3_max_reuse_distance": 10**9,
        "auto": "reduce_bucket_size,stage3_param_persistence_threshold,stage3_prefetch_bucket_size",
    }
    assert run.nproc == 8 and run.gpu.batch_size == 4


def test_a_ds_configs_optimizer_offload_to_the_host_is_zero_offload_pinned_as_it_says(tmp_path):
    """transformers' documented ZeRO-3 offload config: the optimizer's partitions, their gradients
    and Adam's moments on the host, stepped there by DeepSpeed's CPU Adam (which the AdamW section
    makes under offload), pinned as its pin_memory says."""
    zero = ZERO3["zero_optimization"] | {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
    config = ZERO3 | {"zero_optimization": zero, "optimizer": {"type": "AdamW"}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    run = load(suite(tmp_path, ARGS | {"deepspeed": "ds.json"}, extra="nproc = 8\n")).runs[1]
    options = dict(run.techniques[0].options)
    assert options["offload_optimizer"] == "cpu" and options["offload_pin_memory"] is True
    assert options["optimizer"] == "AdamW"


def test_a_ds_configs_parameter_offload_to_the_host_is_read_at_stage_3_alone(tmp_path):
    """ZeRO-Infinity's documented config offloads the parameters too: at stage 3 the partitions on
    the host, pinned as its pin_memory says (its NVMe keys change nothing there); below stage 3
    DeepSpeed never reads the section, and neither does the load."""
    section = {"device": "cpu", "pin_memory": True, "buffer_count": 5, "max_in_cpu": 10**9}
    zero = ZERO3["zero_optimization"] | {"offload_param": section}
    (tmp_path / "ds.json").write_text(json.dumps(ZERO3 | {"zero_optimization": zero}))
    run = load(suite(tmp_path, ARGS | {"deepspeed": "ds.json"}, extra="nproc = 8\n")).runs[1]
    options = dict(run.techniques[0].options)
    assert options["offload_param"] == "cpu" and options["offload_param_pin_memory"] is True
    zero = {"stage": 2, "offload_param": section}
    (tmp_path / "ds.json").write_text(json.dumps(ZERO3 | {"zero_optimization": zero}))
    run = load(suite(tmp_path, ARGS | {"deepspeed": "ds.json"}, extra="nproc = 8\n")).runs[1]
    assert "offload_param" not in dict(run.techniques[0].options)


def test_a_ds_configs_optimizer_is_deepspeeds_own_and_the_trainers_optim_goes_unused(tmp_path):
    """transformers' documented configs carry an AdamW section, its values "auto": DeepSpeed then
    builds FusedAdam over the trained parameters and the Trainer hands it no optimizer of its
    own (its DummyOptim), so the arguments' optim makes no technique."""
    section = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "weight_decay": "auto"}}
    (tmp_path / "ds.json").write_text(json.dumps(ZERO3 | {"optimizer": section}))
    run = load(suite(tmp_path, ARGS | {"deepspeed": "ds.json"}, extra="nproc = 8\n")).runs[1]
    assert [t.name for t in run.techniques] == ["deepspeed", "checkpoint", "accumulate"]
    assert dict(run.techniques[0].options)["optimizer"] == "AdamW"


def test_the_trainers_auto_buckets_are_the_models_hidden_size():
    """The "auto" buckets as HfTrainerDeepSpeedConfig.trainer_config_finalize fills them, from the
    config's hidden_size (tiny-llama's 64)."""
    from bench.techniques import build
    from tests.helpers import tech

    auto = "reduce_bucket_size,stage3_prefetch_bucket_size,stage3_param_persistence_threshold"
    ds = build(tech("deepspeed", stage=3, auto=auto))
    zero = ds.ds_config(batch_size=4, micro_batches=2, hidden=64)["zero_optimization"]
    assert zero == {
        "stage": 3,
        "reduce_bucket_size": 64 * 64,
        "stage3_prefetch_bucket_size": int(0.9 * 64 * 64),
        "stage3_param_persistence_threshold": 640,
    }


def test_a_sharded_job_from_its_files_spans_the_processes_given(tmp_path):
    """The arguments do not say how many processes the launcher starts: --nproc does."""
    from bench.errors import BadInput
    from bench.suite import from_config

    (tmp_path / "fsdp.json").write_text(json.dumps(ARGS | {"fsdp": "full_shard"}))
    with pytest.raises(BadInput, match="give --nproc N"):
        from_config.suite_text("suites/configs/tiny-llama", str(tmp_path / "fsdp.json"))
    text = from_config.suite_text("suites/configs/tiny-llama", str(tmp_path / "fsdp.json"), nproc=8)
    assert "nproc = 8" in text


def test_the_fields_not_modelled_pass_at_the_defaults_transformers_writes(tmp_path):
    """TrainingArguments.to_json_string writes every field: at its default, a field not modelled
    (no DeepSpeed, no FSDP, fsdp_config's defaults) is no refusal."""
    from transformers import TrainingArguments

    written = json.loads(TrainingArguments(output_dir=str(tmp_path / "out")).to_json_string())
    assert load(suite(tmp_path, written)).runs[1].gpu.batch_size == 8


def test_arguments_and_a_batch_size_of_its_own_are_refused(tmp_path):
    with pytest.raises(SuiteError, match="the arguments give the batch; leave batch_size out"):
        load(suite(tmp_path, ARGS, extra="batch_size = { gpu = 8, cpu = 8 }\n"))


@pytest.mark.parametrize("bf16", [False, True])
def test_the_run_holds_what_the_trainer_holds_for_the_same_arguments(bf16, tmp_path):
    measured, reference, theirs = _held_to_the_trainer(ARGS | {"bf16": bf16}, tmp_path)
    assert type(theirs.optimizer).__name__ == "Adafactor" and torch.is_grad_enabled()
    assert abs(measured.peak_tensor_bytes / reference.peak_tensor_bytes - 1) < 0.01, {
        k: (measured[k], reference[k]) for k in measured if measured[k] != reference[k]
    }


@pytest.mark.parametrize(
    "optim, made",
    [
        ("adamw_8bit", "AdamW"),
        ("ademamix_8bit", "AdEMAMix"),
        ("rmsprop_bnb_8bit", "RMSprop"),
        ("lion_8bit", "Lion"),
    ],
)
def test_the_trainers_bitsandbytes_optimizers_hold_what_the_run_holds(optim, made, tmp_path):
    """The Trainer builds each with its own arguments (_get_bitsandbytes_optimizer): the run's
    technique keeps the same state, and the step the same peak."""
    pytest.importorskip("bitsandbytes")
    measured, reference, theirs = _held_to_the_trainer(ARGS | {"optim": optim}, tmp_path)
    assert type(theirs.optimizer).__name__ == made
    assert measured.optimizer_state_bytes == reference.optimizer_state_bytes
    assert abs(measured.peak_tensor_bytes / reference.peak_tensor_bytes - 1) < 0.01


def _held_to_the_trainer(args, tmp_path):
    """The run's step and transformers' Trainer's for the same arguments, each tracked after a
    first step: (ours, theirs, their Trainer)."""
    from transformers import Trainer, TrainingArguments

    args = args | {"output_dir": str(tmp_path / "out"), "report_to": []}
    run = load(suite(tmp_path, args)).runs[1]
    ours, batch = build_trainer(run)
    inputs, labels = batch
    model = build_trainer(load(suite(tmp_path, args)).runs[0])[0].model
    theirs = Trainer(model=model, args=TrainingArguments(**args, use_cpu=True, save_strategy="no"))
    theirs.create_optimizer_and_scheduler(num_training_steps=10)
    theirs.current_gradient_accumulation_steps = 2  # what its train loop sets before each step
    model.gradient_checkpointing_enable(args.get("gradient_checkpointing_kwargs"))

    def their_step():  # the Trainer's loop: two micro-batches of 2, then the optimizer's step
        for half in range(2):
            part = {k: v[2 * half : 2 * half + 2].clone() for k, v in inputs.items()}
            theirs.training_step(
                theirs.model, part | {"labels": labels[2 * half : 2 * half + 2].clone()}
            )
        norm[0] = None  # the loop's grad_norm, held from one step to the next
        norm[0] = theirs._get_grad_norm(model, grad_norm=theirs._clip_grad_norm(model))
        theirs.optimizer.step()
        theirs.optimizer.zero_grad(set_to_none=True)

    norm = [None]
    ours.step(clone_batch(batch))
    their_step()
    measured = tracked_step(lambda: ours.step(clone_batch(batch)), ours.model, ours.optimizer, CPU)
    reference = tracked_step(their_step, theirs.model, theirs.optimizer, CPU)
    return measured, reference, theirs


@pytest.mark.parametrize("bits", [8, 32])
def test_the_trainers_paged_adamw_is_the_paged_technique_of_its_bits(bits, tmp_path):
    run = load(suite(tmp_path, ARGS | {"optim": f"paged_adamw_{bits}bit"})).runs[1]
    assert f"paged-adamw-{bits}bit" in [t.name for t in run.techniques]


# An SFTConfig as a TRL job writes it: TRL's own fields beside TrainingArguments'
SFT = {
    "output_dir": "out",
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "max_length": 32,
    "dataset_text_field": "text",
    "completion_only_loss": None,
}


def test_an_sftconfig_is_read_with_trls_defaults_and_its_loss(tmp_path, capsys):
    """Checkpointing on and bf16 autocast unless said otherwise, and SFTTrainer's default loss,
    chunked_nll; dataset and loss-mask fields change nothing a step holds."""
    run = load(suite(tmp_path, SFT)).runs[1]
    assert [t.label for t in run.techniques] == [
        "amp(dtype=bfloat16)",
        "optimizer(groups=trainer,impl=fused,kind=adamw)",  # the installed Trainer's default
        "checkpoint(input_grads=True)",
        "sft-chunked-nll",
        "accumulate(micro_batches=2)",
        "clip-grad-norm(max_norm=1.0)",
    ]
    err = capsys.readouterr().err
    assert "read as TRL's SFTConfig" in err
    assert "ignored, as they change nothing a step holds: completion_only_loss" in err


@pytest.mark.parametrize(
    "change, labels",
    [
        ({"loss_type": "nll"}, ["amp(dtype=bfloat16)", CHECKPOINT, "sft-nll"]),
        ({"fp16": True}, ["amp(dtype=float16)", CHECKPOINT, "sft-chunked-nll"]),
        ({"bf16": False, "gradient_checkpointing": False}, ["sft-chunked-nll"]),
        (
            {"bf16": None, "loss_type": None},
            ["amp(dtype=bfloat16)", CHECKPOINT, "sft-chunked-nll"],
        ),
        (  # packing by best fit flattens the packed rows, as padding_free does, under flash
            {"packing": True, "model_init_kwargs": {"attn_implementation": "flash_attention_2"}},
            ["amp(dtype=bfloat16)", CHECKPOINT, "sft-chunked-nll", "packing"],
        ),
        (
            {
                "padding_free": True,
                "model_init_kwargs": {"attn_implementation": "flash_attention_3"},
            },
            ["amp(dtype=bfloat16)", CHECKPOINT, "sft-chunked-nll", "packing"],
        ),
        (  # wrapped rows of max_length tokens, attending across sequences: the fixed-shape step
            {"packing": True, "packing_strategy": "wrapped"},
            ["amp(dtype=bfloat16)", CHECKPOINT, "sft-chunked-nll"],
        ),
        (  # QLoRA's BitsAndBytesConfig, as its to_dict writes it: the model loads in 4 bits
            {
                "model_init_kwargs": {
                    "quantization_config": {
                        "quant_method": "bitsandbytes",
                        "load_in_4bit": True,
                        "bnb_4bit_quant_type": "nf4",
                        "bnb_4bit_use_double_quant": True,
                        "bnb_4bit_compute_dtype": "torch.bfloat16",
                    }
                }
            },
            [
                "amp(dtype=bfloat16)",
                "checkpoint(input_grads=True)",
                "bnb-4bit(compute_dtype=bfloat16,double_quant=True,quant_type=nf4)",
                "sft-chunked-nll",
            ],
        ),
    ],
)
def test_an_sftconfigs_own_choices_are_read_as_trl_reads_them(change, labels, tmp_path):
    run = load(suite(tmp_path, SFT | change)).runs[1]
    own = [t.label for t in run.techniques if not t.label.startswith(("optim", "accum", "clip"))]
    assert own == labels


@pytest.mark.fault("cli values")
@pytest.mark.parametrize(
    "change, said",
    [
        ({"max_length": 16}, "max_length = 16 .* shorter than the suite's seq_len = 32"),
        ({"max_length": 30, "pad_to_multiple_of": 8}, "no problem"),
        ({"max_length": 0}, "max_length: expected a whole number of at least 1"),
        ({"loss_type": "dft"}, "loss_type = 'dft': not modelled here"),
        ({"packing": True}, "packing with attention sdpa .* set it to flash_attention_2"),
        (
            {"padding_free": True, "model_init_kwargs": {"attn_implementation": "eager"}},
            "padding_free with attention eager",
        ),
        ({"packing": True, "packing_strategy": "ffd"}, "packing_strategy = 'ffd': none of TRL's"),
        ({"activation_offloading": True}, "activation_offloading = True: changes what a step"),
        (
            {"model_init_kwargs": {"quantization_config": {"quant_method": "awq"}}},
            "model_init_kwargs.quantization_config: quant_method 'awq' is not modelled yet",
        ),
        (
            {"model_init_kwargs": {"device_map": "auto", "revision": "main", "foo": 1}},
            "model_init_kwargs.foo = 1: changes the weights a step holds",
        ),
        ({"model_init_kwargs": {"dtype": "float8"}}, "model_init_kwargs.dtype = 'float8'"),
        ({"max_lenght": 32}, "max_lenght: not a SFTConfig field"),
    ],
)
def test_an_sftconfig_field_not_modelled_or_wrong_is_a_load_error_naming_it(change, said, tmp_path):
    if said == "no problem":  # padded up to its multiple, 32: the suite's length
        assert load(suite(tmp_path, SFT | change)).runs[1].gpu.seq_len == 32
        return
    with pytest.raises(SuiteError, match=said):
        load(suite(tmp_path, SFT | change))


def test_a_job_from_its_files_runs_at_the_sftconfigs_max_length_and_weights(tmp_path):
    """bench predict --hf … --training-args sft.json: the sequences are max_length tokens long,
    the baseline's too, unless --seq-len says otherwise; the weights as SFTTrainer loads them."""
    from bench.suite import from_config

    (tmp_path / "sft.json").write_text(
        json.dumps(SFT | {"max_length": 1000, "pad_to_multiple_of": 64})
    )
    text = from_config.suite_text("suites/configs/tiny-llama", str(tmp_path / "sft.json"))
    assert "seq_len = 1024" in text
    # loaded as SFTTrainer loads a model named by a string: float32 unless model_init_kwargs say
    assert 'model = "hf:suites/configs/tiny-llama#dtype=float32"' in text
    (tmp_path / "auto.json").write_text(json.dumps(SFT | {"model_init_kwargs": {"dtype": "auto"}}))
    text = from_config.suite_text("suites/configs/tiny-llama", str(tmp_path / "auto.json"))
    assert 'model = "hf:suites/configs/tiny-llama"' in text
    text = from_config.suite_text(
        "suites/configs/tiny-llama", str(tmp_path / "sft.json"), seq_len=512
    )
    assert "seq_len = 512" in text


def test_a_job_of_no_stated_length_runs_at_512_tokens_or_the_fewer_positions_its_model_has():
    """A BERT of 128 learned positions cannot take 512 tokens: its job runs at 128 (it was
    unpredictable, its position ids expanded past their buffer); a stated length stands."""
    from bench.suite import from_config

    assert "seq_len = 512" in from_config.suite_text("suites/configs/tiny-llama")
    assert "seq_len = 128" in from_config.suite_text("suites/configs/tiny-bert-classifier")
    text = from_config.suite_text("suites/configs/tiny-bert-classifier", seq_len=64)
    assert "seq_len = 64" in text


def test_a_packed_sftconfig_job_runs_trls_padding_free_rows_on_its_flash_path(tmp_path):
    """bench predict --hf … --training-args sft.json with packing under FlashAttention: each
    micro-batch's sequences flattened into a row, transformers' flash path attending within each
    on their cumulative lengths, predicted."""
    from bench.predict import predict
    from bench.recipe import Recipe
    from bench.suite import from_config

    flashed = {"model_init_kwargs": {"attn_implementation": "flash_attention_2"}}
    (tmp_path / "sft.json").write_text(json.dumps(SFT | flashed | {"packing": True}))
    text = from_config.suite_text("suites/configs/tiny-llama", str(tmp_path / "sft.json"))
    (tmp_path / "job.toml").write_text(text)
    job = load(tmp_path / "job.toml").runs[1]
    inputs, _ = Recipe.of(job, torch.device("cpu"), job.gpu, predicting=True).batch()
    # two micro-batches (SFT's accumulation) of two sequences of max_length (32) in a row each
    assert inputs["input_ids"].shape == (2, 64) and inputs["cu_seq_lens_q"].numel() == 6
    out = predict(job)
    assert out.ok and "flash_attention_2" in out.message, out.message


@pytest.mark.parametrize(
    "change, checkpointed",
    [
        ({"gradient_checkpointing": False, "activation_checkpointing": True}, True),
        ({"gradient_checkpointing": True, "activation_checkpointing": False}, False),
        ({"gradient_checkpointing": True, "activation_checkpointing": None}, True),
    ],
)
def test_transformers_5s_activation_checkpointing_is_read_before_its_old_name(
    change, checkpointed, tmp_path
):
    """transformers 5 renamed gradient_checkpointing; the new name wins where set, as its
    __post_init__ resolves them (a file naming only the new one was read as unchecked before)."""
    run = load(suite(tmp_path, ARGS | change)).runs[1]
    assert (CHECKPOINT in [t.label for t in run.techniques]) is checkpointed


def test_a_job_from_its_files_takes_the_adapter_its_peft_type_names(tmp_path):
    """--adapter-config: a LoRA adapter_config.json is the lora technique's, an IA3 one ia3's."""
    from bench.suite import from_config

    for kind, name in (("LORA", "lora"), ("IA3", "ia3")):
        (tmp_path / "adapter.json").write_text(json.dumps({"peft_type": kind}))
        text = from_config.suite_text(
            "suites/configs/tiny-llama", None, str(tmp_path / "adapter.json")
        )
        assert f'name = "{name}"' in text


def test_a_file_naming_no_optimizer_gets_the_installed_trainers_default(tmp_path):
    """transformers 5 on torch 2.8 or later defaults to the fused AdamW (it was read as foreach's,
    whose temporaries a fused update does not hold)."""
    from dataclasses import fields

    from transformers import TrainingArguments

    default = next(f.default for f in fields(TrainingArguments) if f.name == "optim")
    args = {k: v for k, v in ARGS.items() if k != "optim"}
    labels = [t.label for t in load(suite(tmp_path, args)).runs[1].techniques]
    impl = "impl=fused," if default == "adamw_torch_fused" else ""
    assert f"optimizer(groups=trainer,{impl}kind=adamw)" in labels


def test_a_compile_mode_compiles_as_the_trainer_reads_it(tmp_path):
    """TrainingArguments sets torch_compile where a mode or backend is given."""
    run = load(suite(tmp_path, ARGS | {"torch_compile_mode": "max-autotune"})).runs[1]
    assert "compile(mode=max-autotune)" in [t.label for t in run.techniques]


@pytest.mark.parametrize(
    "optim, label",
    [
        ("adagrad", "optimizer(groups=trainer,kind=adagrad)"),
        ("rmsprop", "optimizer(groups=trainer,kind=rmsprop)"),
        ("adamw_torch_4bit", "adamw-4bit(block_size=256)"),
        ("adamw_torch_8bit", "adamw-8bit"),
        ("lion_32bit", "lion(bits=32)"),
        ("lion_8bit", "lion(bits=8,embeddings_32bit=True)"),
        ("paged_lion_8bit", "lion(bits=8,embeddings_32bit=True,paged=True)"),
        ("ademamix", "ademamix(bits=32)"),
        ("paged_ademamix_8bit", "ademamix(bits=8,embeddings_32bit=True,paged=True)"),
        ("rmsprop_bnb", "rmsprop-bnb(bits=32)"),
        ("rmsprop_bnb_8bit", "rmsprop-bnb(bits=8,embeddings_32bit=True)"),
    ],
)
def test_the_trainers_other_optimizers_are_what_it_makes(optim, label, tmp_path):
    run = load(suite(tmp_path, ARGS | {"optim": optim})).runs[1]
    assert label in [t.label for t in run.techniques]


def test_every_optimizer_the_installed_trainer_names_is_modelled_or_refused_with_its_reason():
    """No optim value of the installed transformers falls to the generic refusal: each is mapped to
    the optimizer the Trainer builds, or refused with what it keeps and the nearest one modelled."""
    from transformers.training_args import OptimizerNames

    from bench.suite.training_args import OPTIMIZERS, OPTIMIZERS_NOT_MODELLED

    names = {o.value for o in OptimizerNames}
    assert names - OPTIMIZERS.keys() - OPTIMIZERS_NOT_MODELLED.keys() == set()
    # transformers 4.x's adamw_hf is no longer among them, and still read as what it was
    assert OPTIMIZERS_NOT_MODELLED.keys() <= names and OPTIMIZERS.keys() - names == {"adamw_hf"}


def test_optimizer_arguments_are_refused_by_name(tmp_path):
    with pytest.raises(SuiteError, match="optim_args = 'momentum=0.9': changes what a step"):
        load(suite(tmp_path, ARGS | {"optim": "rmsprop", "optim_args": "momentum=0.9"}))


@pytest.mark.fault("cli values")
@pytest.mark.parametrize(
    "fields, kind",
    [
        ({"beta": 0.1, "precompute_ref_log_probs": False}, "DPOConfig"),
        ({"num_generations": 8, "max_completion_length": 256}, "GRPOConfig"),
        ({"desirable_weight": 1.0}, "KTOConfig"),
        ({"center_rewards_coefficient": 0.01}, "RewardConfig"),
    ],
)
def test_trls_other_trainers_configs_are_refused_by_name(fields, kind, tmp_path):
    """A DPO, GRPO, KTO or reward model's config holds what a TrainingArguments step does not (a
    reference model, chosen and rejected sequences, generated completions): refused, named."""
    with pytest.raises(SuiteError, match=f"a TRL {kind} .*which this harness does not model"):
        load(suite(tmp_path, ARGS | fields))


# Each field the harness reads as changing nothing a step holds (training_args.UNCHANGED), set
# otherwise than its default, as a tiny job can train with it here
OTHERWISE = {
    "num_train_epochs": 5.0,
    "logging_strategy": "steps",
    "logging_steps": 1,
    "logging_first_step": True,
    "log_on_each_node": False,
    "log_level": "error",
    "log_level_replica": "error",
    "logging_nan_inf_filter": False,
    "disable_tqdm": True,
    "run_name": "other",
    "project": "other",
    "skip_memory_metrics": False,
    "do_train": True,
    "do_eval": True,
    "do_predict": True,
    "ignore_data_skip": True,
    "restore_callback_states_from_checkpoint": True,
    "seed": 7,
    "data_seed": 7,
    "enable_jit_checkpoint": True,
    "include_num_input_tokens_seen": "all",
    "learning_rate": 0.1,
    "lr_scheduler_type": "cosine",
    "lr_scheduler_kwargs": {"num_cycles": 0.25},
    "warmup_steps": 1,
    "weight_decay": 0.1,
    "adam_beta1": 0.8,
    "adam_beta2": 0.99,
    "adam_epsilon": 1e-6,
    "eval_steps": 3,
    "eval_delay": 1,
    "per_device_eval_batch_size": 3,
    "prediction_loss_only": True,
    "eval_accumulation_steps": 2,
    "eval_do_concat_batches": False,
    "eval_use_gather_object": True,
    "include_for_metrics": ["inputs"],
    "batch_eval_metrics": True,
    "bf16_full_eval": True,
    "metric_for_best_model": "accuracy",
    "greater_is_better": False,
    "save_steps": 7,
    "save_total_limit": 1,
    "save_only_model": True,
    "save_on_each_node": True,
    "hub_token": "other",
    "hub_private_repo": True,
    "hub_model_id": "other/other",
    "hub_strategy": "end",
    "hub_always_push": True,
    "hub_revision": "other",
    "dataloader_drop_last": True,
    "dataloader_in_order": False,
    "remove_unused_columns": False,
    "label_names": ["labels"],
    "train_sampling_strategy": "sequential",
    "ddp_timeout": 60,
    "ddp_find_unused_parameters": True,
    "ddp_bucket_cap_mb": 5,
    "ddp_broadcast_buffers": False,
    "ddp_static_graph": True,
    "accelerator_config": {"even_batches": False, "non_blocking": True},
    "average_tokens_across_devices": False,
}
# ... and those left at their default here, each for why
KEPT = {
    **dict.fromkeys(("output_dir", "max_steps", "save_strategy"), "the test's own: two steps"),
    **dict.fromkeys(
        ("report_to", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id"),
        "a logger's package or a network",
    ),
    **dict.fromkeys(("push_to_hub", "resume_from_checkpoint"), "a hub or a checkpoint"),
    **dict.fromkeys(
        ("eval_strategy", "eval_on_start", "load_best_model_at_end", "fp16_full_eval"),
        "an evaluation set (and fp16_full_eval, a card)",
    ),
    **dict.fromkeys(
        (
            "dataloader_num_workers",
            "dataloader_pin_memory",
            "dataloader_persistent_workers",
            "dataloader_prefetch_factor",
            "dataloader_multiprocessing_context",
        ),
        "worker processes or a card: on a CPU the loader's batch is in the tracked memory, whose "
        "workers' copies the tracker cannot see",
    ),
    "length_column_name": "group_by_length, which needs lengths",
    **dict.fromkeys(("local_rank", "ddp_backend"), "a process group"),
    "liger_kernel_config": "use_liger_kernel, refused",
}


def _trained(tmp_path, **otherwise) -> tuple[int, dict[str, int]]:
    """transformers' Trainer training tiny-llama two steps of two micro-batches: the peak of what
    it made, and what was alive then."""
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    from bench.measure.tracker import LiveBytes

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained("suites/configs/tiny-llama")
    model = AutoModelForCausalLM.from_config(config)
    data = [{"input_ids": torch.randint(0, config.vocab_size, (16,))} for _ in range(8)]
    data = [d | {"labels": d["input_ids"].clone()} for d in data]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        use_cpu=True,
        save_strategy="no",
        report_to="none",
        **otherwise,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    tracker = LiveBytes(CPU)
    with tracker:
        trainer.train()
    return tracker.peak, tracker.at_peak()


def test_the_fields_read_as_changing_nothing_change_nothing_the_trainers_steps_hold(tmp_path):
    """The Trainer itself, trained with every such field set otherwise, holds what it holds at the
    defaults to the byte (what it made, at its peak); a field this test cannot set here says
    why."""
    from bench.suite.training_args import UNCHANGED

    assert OTHERWISE.keys() | KEPT.keys() == UNCHANGED.keys()
    assert not OTHERWISE.keys() & KEPT.keys()
    assert _trained(tmp_path, **OTHERWISE) == _trained(tmp_path)


def test_every_field_the_installed_transformers_names_is_read_refused_or_known_to_change_nothing(
    tmp_path,
):
    """A field a newer transformers adds is refused at any value but its default until it is
    classified: a test fails here rather than a job's prediction silently."""
    from bench.suite import training_args

    assert training_args.unclassified() == set()
    assert (
        training_args.SFT_READ
        | training_args.SFT_NOT_MODELLED.keys()
        | training_args.SFT_UNCHANGED.keys()
    ) == training_args.SFT_FIELDS
    new = next(iter(training_args.UNCHANGED))
    monkey = dict(training_args.UNCHANGED)
    del monkey[new]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(training_args, "UNCHANGED", monkey)
        with pytest.raises(SuiteError, match=f"{new} = .*not known to this harness"):
            load(suite(tmp_path, ARGS | {new: "x"}))
        assert load(suite(tmp_path, ARGS | {new: training_args.defaults()[new]})).runs[1]


@pytest.mark.parametrize(
    "field, value",
    [
        ("use_cache", True),
        ("full_determinism", True),
        ("debug", "underflow_overflow"),
        ("use_cpu", True),
    ],
)
def test_the_fields_that_change_memory_in_ways_not_modelled_are_refused_by_name(
    field, value, tmp_path
):
    with pytest.raises(SuiteError, match=f"{field} = .*changes what a step holds"):
        load(suite(tmp_path, ARGS | {field: value}))
