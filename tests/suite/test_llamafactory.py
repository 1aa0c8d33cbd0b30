"""A LLaMA-Factory YAML read as LLaMA-Factory's code reads it: the Trainer's fields passed on, its
own checkpointing on by default (reentrant), LoRA on every linear at twice the rank's alpha, the
float32 casts of a full fine-tune, bitsandbytes computed in the compute dtype; every field that
changes what a step holds and is not modelled refused by name."""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import yaml

from bench.errors import BadInput
from bench.suite import llamafactory
from bench.suite.job_file import read

EXAMPLE = Path("docs/examples/llamafactory-qlora/llama3_lora_sft_otfq.yaml")
LORA = {
    "model_name_or_path": "suites/configs/tiny-llama",
    "stage": "sft",
    "do_train": True,
    "finetuning_type": "lora",
    "lora_target": "q_proj,v_proj",
    "dataset": "alpaca_en_demo",
    "template": "llama3",
    "cutoff_len": 128,
    "per_device_train_batch_size": 2,
    "bf16": True,
}


def _read(raw: dict, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return read(path)


def test_llamafactorys_qlora_example_reads_as_its_loader_and_adapter_make_the_job():
    job = read(EXAMPLE)
    assert job.kind == "llamafactory" and job.model == "suites/configs/llama-3.1-8b"
    assert job.loaded == {}  # torch_dtype="auto": the checkpoint's bfloat16, transformers' sdpa
    assert job.training_args["gradient_checkpointing_kwargs"] == {"use_reentrant": True}
    assert job.training_args["gradient_accumulation_steps"] == 8 and job.training_args["bf16"]
    assert job.techniques == [
        {
            "name": "bnb-4bit",
            "quant_type": "nf4",
            "double_quant": True,
            "compute_dtype": "bfloat16",
            "storage": "bfloat16",  # "crucial for fsdp+qlora": the compute dtype
            "prepare": False,  # no k-bit preparation
        }
    ]
    assert job.adapter["r"] == 8 and job.adapter["lora_alpha"] == 16
    assert job.adapter["target_modules"] == "all-linear"
    assert job.seq_len == 2048 and "dataset" in job.ignored and "warmup_ratio" in job.ignored


def test_a_full_fine_tune_casts_every_parameter_to_float32_unless_pure_bf16_or_zero3(tmp_path):
    full = {**LORA, "finetuning_type": "full"}
    assert _read(full, tmp_path).loaded == {"dtype": "float32"}
    assert _read(full, tmp_path).adapter is None
    assert _read({**full, "pure_bf16": True, "bf16": False}, tmp_path).loaded == {}
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3}}')
    # named from the YAML's folder, as LLaMA-Factory run from there finds it
    zero3 = _read({**full, "deepspeed": "ds.json"}, tmp_path)
    assert zero3.loaded == {} and zero3.training_args["deepspeed"] == str(tmp_path / "ds.json")


def test_checkpointing_attention_and_the_compute_dtype(tmp_path):
    off = _read({**LORA, "disable_gradient_checkpointing": True}, tmp_path)
    assert "gradient_checkpointing" not in off.training_args
    plain = _read({**LORA, "use_reentrant_gc": False, "flash_attn": "fa2"}, tmp_path)
    assert plain.training_args["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert plain.loaded == {"attn_implementation": "flash_attention_2"}
    assert plain.adapter["target_modules"] == ["q_proj", "v_proj"]
    # no mixed precision: the compute dtype from the checkpoint's (infer_optim_dtype)
    four = {**LORA, "bf16": False, "quantization_bit": 4}
    assert _read(four, tmp_path).techniques[0]["compute_dtype"] == "bfloat16"
    config = json.loads(Path(LORA["model_name_or_path"], "config.json").read_text())
    (tmp_path / "fp32").mkdir()
    (tmp_path / "fp32" / "config.json").write_text(json.dumps(config | {"torch_dtype": "float32"}))
    four["model_name_or_path"] = str(tmp_path / "fp32")
    assert _read(four, tmp_path).techniques[0]["compute_dtype"] == "float16"
    assert _read({**LORA, "quantization_bit": 8}, tmp_path).techniques == [
        {"name": "bnb-8bit", "prepare": False}
    ]


@pytest.mark.fault("cli values")
@pytest.mark.parametrize(
    "keys, said",
    [
        ({"stage": "dpo"}, "stage = 'dpo': a reward, preference or PPO stage"),
        ({"finetuning_type": "freeze"}, "finetuning_type = 'freeze': not modelled"),
        ({"enable_liger_kernel": True}, "enable_liger_kernel = True: Liger's kernels"),
        ({"neat_packing": True}, "neat_packing = True: masks attention"),
        ({"use_unsloth_gc": True}, "use_unsloth_gc = True"),
        ({"flash_attn": "fa3"}, "flash_attn = 'fa3': not modelled"),
        ({"quantization_bit": 4, "quantization_method": "hqq"}, "quantization_bit = 4 by hqq"),
        ({"pure_bf16": True}, "pure_bf16 with LoRA"),
        ({"my_own_field": 1}, "my_own_field: neither a TrainingArguments field"),
        ({"cutoff_len": 0}, "cutoff_len = 0: expected a whole number"),
    ],
)
def test_a_field_not_modelled_is_refused_by_name(keys, said, tmp_path):
    with pytest.raises(BadInput) as raised:
        _read({**LORA, **keys}, tmp_path)
    assert said in str(raised.value)


def test_every_field_and_default_is_llamafactorys_own(monkeypatch):
    """Held to the installed LLaMA-Factory's argument dataclasses (Makefile DOORS): each of its own
    fields read, refused or ignored here is one of theirs, every one of theirs is one of those
    (or a TrainingArguments field), and each default taken here is theirs."""
    monkeypatch.setitem(os.environ, "DISABLE_VERSION_CHECK", "1")  # it pins transformers <= 5.6
    hparams = pytest.importorskip("llamafactory.hparams")
    from transformers import Seq2SeqTrainingArguments

    from bench.suite.training_args import defaults

    classes = (
        hparams.ModelArguments,
        hparams.DataArguments,
        hparams.FinetuningArguments,
        hparams.GeneratingArguments,
        hparams.training_args.TrainingArguments,
    )
    theirs = {f.name: f for c in classes for f in dataclasses.fields(c) if f.init}
    trainer = {f.name for f in dataclasses.fields(Seq2SeqTrainingArguments)}
    mine = llamafactory.READ | set(llamafactory.NOT_MODELLED) | llamafactory.UNCHANGED
    assert not mine - theirs.keys() - trainer
    assert not theirs.keys() - trainer - mine - defaults().keys()
    assert {k: theirs[k].default for k in ("cutoff_len", "lora_rank")} == {
        "cutoff_len": llamafactory.CUTOFF_LEN,
        "lora_rank": llamafactory.LORA_RANK,
    }
    assert theirs["use_reentrant_gc"].default is True and theirs["double_quantization"].default
