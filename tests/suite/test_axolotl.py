"""An axolotl YAML read as axolotl's own code reads it: the model's dtype and attention, the
TrainingArguments its builder writes, its LoraConfig and BitsAndBytesConfig, packing; every key that
changes what a step holds and is not modelled refused by name."""

import pytest
import yaml

from bench.suite import axolotl, job_file
from bench.suite.job_file import read

EXAMPLE = "docs/examples/axolotl-qlora/qlora-1b.yml"
TINY = "suites/configs/tiny-llama"
LORA = {
    "base_model": TINY,
    "adapter": "lora",
    "lora_r": 4,
    "lora_alpha": 8,
    "lora_target_linear": True,
    "sequence_len": 128,
    "micro_batch_size": 2,
    "datasets": [{"path": "somewhere", "type": "alpaca"}],
}


def _read(raw: dict, tmp_path):
    path = tmp_path / "job.yml"
    path.write_text(yaml.safe_dump(raw))
    return read(path)


def test_axolotls_qlora_example_reads_as_its_loader_and_builder_make_the_job():
    job = read(__import__("pathlib").Path(EXAMPLE))
    assert job.kind == "axolotl" and job.model == "suites/configs/llama-3.2-1b"
    assert job.loaded == {"dtype": "bfloat16", "attn_implementation": "flash_attention_2"}
    assert job.training_args == {
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "optim": "adamw_bnb_8bit",
        "bf16": True,
        "fp16": False,
        "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},  # axolotl's default kwargs
    }
    # _set_quantization_config's NF4, and peft's k-bit upcasts cast back by axolotl
    bnb = {
        "name": "bnb-4bit",
        "quant_type": "nf4",
        "double_quant": True,
        "compute_dtype": "bfloat16",
        "storage": "bfloat16",
        "prepare": False,
    }
    assert job.techniques == [bnb, "packing"]
    assert job.adapter["r"] == 32 and job.adapter["lora_alpha"] == 16
    assert job.adapter["target_modules"] == [
        "gate_proj",
        "down_proj",
        "up_proj",
        "q_proj",
        "v_proj",
        "k_proj",
        "o_proj",
    ]
    assert job.seq_len == 2048 and "datasets" in job.ignored and job.assumed


@pytest.mark.parametrize(
    "keys, loaded, bf16, fp16",
    [
        ({}, "bfloat16", True, False),  # bf16: auto on a card that has it
        ({"bf16": False}, "float32", False, False),
        ({"fp16": True}, "float16", False, True),  # auto gives way to fp16
        ({"bf16": "full"}, "bfloat16", False, False),  # bf16_full_eval alone: no autocast
        ({"bf16": False, "bfloat16": True}, "bfloat16", True, False),  # `cfg.bf16 or bfloat16`
        ({"bf16": False, "load_in_8bit": True}, "float16", False, False),
    ],
)
def test_precision_is_resolve_dtype_and_the_builders(keys, loaded, bf16, fp16, tmp_path):
    raw = {**LORA, **keys}
    if keys.get("load_in_8bit"):
        raw["lora_target_linear"] = True
    job = _read(raw, tmp_path)
    assert job.loaded["dtype"] == loaded
    assert (job.training_args["bf16"], job.training_args["fp16"]) == (bf16, fp16)


def test_batch_size_sets_the_accumulation_steps_as_normalize_config_does(tmp_path):
    job = _read({**LORA, "batch_size": 16}, tmp_path)
    assert job.training_args["gradient_accumulation_steps"] == 8
    assert job.adapter["target_modules"] == "all-linear"  # every linear but the head
    plain = _read({**LORA, "gradient_checkpointing": True}, tmp_path)
    assert plain.training_args["gradient_accumulation_steps"] == 1
    assert plain.loaded == {"dtype": "bfloat16"}  # transformers' default attention


@pytest.mark.fault("cli values")
@pytest.mark.parametrize(
    "keys, said",
    [
        ({"plugins": ["axolotl.integrations.liger.LigerPlugin"]}, "plugins = "),
        ({"activation_offloading": True}, "activation_offloading = True: moves"),
        ({"rl": "dpo"}, "rl = 'dpo': a preference or RL trainer"),
        ({"my_own_key": 1}, "my_own_key: not a key this harness knows of axolotl's"),
        ({"attn_implementation": "xformers"}, "attn_implementation = 'xformers': not modelled"),
        ({"attn_implementation": "my-kernels/attn"}, "'my-kernels/attn': not modelled"),
        ({"sample_packing": True}, "sample_packing under attention sdpa"),
        ({"gradient_checkpointing": "offload"}, "gradient_checkpointing = 'offload'"),
        ({"adapter": "llama-adapter"}, "adapter = 'llama-adapter': not modelled"),
        ({"adapter": None}, "a full fine-tune in bfloat16 under attention sdpa"),
        ({"adapter": "qlora"}, "axolotl quantizes for qlora with load_in_4bit"),
        ({"lora_r": None}, "lora_r: the adapters' rank"),
        ({"micro_batch_size": 0}, "micro_batch_size = 0: expected a whole number"),
        ({"sequence_len": "long"}, "sequence_len = 'long': expected a whole number"),
        ({"gradient_accumulation_steps": 2, "batch_size": 6}, "batch_size = 6 is not"),
    ],
)
def test_a_key_not_modelled_is_refused_by_name(keys, said, tmp_path):
    from bench.errors import BadInput

    with pytest.raises(BadInput) as raised:
        _read({**LORA, **keys}, tmp_path)
    assert said in str(raised.value) and str(tmp_path / "job.yml") in str(raised.value)


def test_a_file_of_no_kind_known_is_refused_with_the_kinds_known(tmp_path):
    from bench.errors import BadInput

    kinds = "axolotl, llamafactory, torchtune"
    with pytest.raises(
        BadInput, match=f"not a job file of a kind this harness reads \\({kinds}\\)"
    ):
        _read({"output_dir": "out", "per_device_train_batch_size": 2}, tmp_path)


def test_every_key_is_read_refused_or_unchanging_once():
    tables = [axolotl.READ, set(axolotl.NOT_MODELLED), axolotl.UNCHANGED]
    assert all(not a & b for i, a in enumerate(tables) for b in tables[i + 1 :])
    assert job_file.KINDS["axolotl"] is axolotl


def test_every_key_and_default_is_axolotls_own():
    """Held to the installed axolotl's schema (Makefile DOORS): each key read, refused or ignored is
    one of its fields (or their aliases), and each default taken here is its default."""
    schema = pytest.importorskip("axolotl.utils.schemas.config").AxolotlInputConfig.model_fields
    names = set(schema) | {f.alias for f in schema.values() if f.alias}
    assert not (axolotl.READ | set(axolotl.NOT_MODELLED) | axolotl.UNCHANGED) - names
    defaults = {
        "sequence_len": axolotl.SEQUENCE_LEN,
        "micro_batch_size": axolotl.MICRO_BATCH,
        "optimizer": axolotl.OPTIMIZER,
        "gradient_accumulation_steps": 1,
        "bf16": "auto",
        "lora_dropout": 0.0,
    }
    assert {k: schema[k].default for k in defaults} == defaults
