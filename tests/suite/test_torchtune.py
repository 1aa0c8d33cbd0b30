"""torchtune's recipe configs, as the installed torchtune ships them, read as its single-device
recipes read them: the model in dtype (adapters too), the optimizer (per parameter in backward for
the full recipe), the chunked-output loss, checkpointing, accumulation; each key not modelled
refused by name."""

import importlib.util
from pathlib import Path

import pytest
import yaml

from bench.cli import main
from bench.errors import BadInput
from bench.suite.job_file import read

FOUND = importlib.util.find_spec("recipes")  # torchtune's configs (Makefile DOORS)
SHIPPED = Path(FOUND.submodule_search_locations[0]) / "configs" if FOUND else None
needs_torchtune = pytest.mark.skipif(SHIPPED is None, reason="torchtune's configs not installed")
SMALL = {
    "model": {
        "_component_": "torchtune.models.qwen2_5.lora_qwen2_5_0_5b",
        "lora_attn_modules": ["q_proj", "v_proj"],
        "apply_lora_to_mlp": False,
        "lora_rank": 4,
        "lora_alpha": 8,
    },
    "tokenizer": {"_component_": "torchtune.models.qwen2_5.qwen2_5_tokenizer", "max_seq_len": 64},
    "dataset": {"_component_": "torchtune.datasets.alpaca_cleaned_dataset", "packed": False},
    "batch_size": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"_component_": "torch.optim.AdamW", "fused": True, "lr": 3e-4},
    "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
    "enable_activation_checkpointing": True,
    "dtype": "bf16",
    "output_dir": "/tmp/out",
}


def _read(raw: dict, tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return read(path)


@needs_torchtune
def test_the_shipped_llama3_1_8b_lora_config_reads_as_its_recipe_builds_the_job():
    job = read(SHIPPED / "llama3_1" / "8B_lora_single_device.yaml")
    assert job.kind == "torchtune" and job.model == "suites/configs/llama-3.1-8b"
    assert job.loaded == {"dtype": "bfloat16"} and job.training_args is None
    assert job.adapter["target_modules"] == [
        "q_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    assert (job.adapter["r"], job.adapter["lora_alpha"]) == (8, 16)
    assert job.adapter_options == {"adapter_dtype": "base"}  # built in bf16, as the model
    assert job.techniques == [
        {"name": "optimizer", "kind": "adamw", "impl": "fused"},
        {"name": "chunked-output-loss", "chunks": 8},
        "checkpoint",
        {"name": "accumulate", "micro_batches": 8},
    ]
    assert (job.batch, job.micro_batches, job.seq_len) == (16, 8, 512)
    assert any("max_seq_len null" in a for a in job.assumed)


@needs_torchtune
def test_the_shipped_qlora_config_quantizes_the_adapted_linears_alone():
    job = read(SHIPPED / "llama3_1" / "8B_qlora_single_device.yaml")
    assert job.techniques[0] == {
        "name": "bnb-4bit",
        "quant_type": "nf4",
        "double_quant": True,
        "compute_dtype": "bfloat16",
        "prepare": False,
        "skip": "k_proj",  # not among lora_attn_modules: a plain bf16 linear
    }


@needs_torchtune
def test_the_shipped_full_config_steps_paged_8bit_adamw_per_parameter_in_backward():
    job = read(SHIPPED / "llama3_1" / "8B_full_single_device.yaml")
    assert job.adapter is None and job.loaded == {"dtype": "bfloat16"}
    assert job.techniques == [
        {"name": "optimizer-in-backward", "optimizer": "paged-adamw-8bit"},
        {"name": "chunked-output-loss", "chunks": 8},
        "checkpoint",
    ]
    assert (job.batch, job.micro_batches) == (2, 1)


@pytest.mark.fault("cli values")
@pytest.mark.parametrize(
    "change, said",
    [
        ({"compile": True}, "compile = True: torch.compile"),
        ({"dataset": {"packed": True}}, "dataset.packed = True"),
        ({"loss": {"_component_": "torch.nn.CrossEntropyLoss"}}, "loss._component_ = "),
        ({"optimizer": {"_component_": "torch.optim.SGD"}}, "optimizer._component_ = "),
        ({"optimizer_in_bwd": True}, "optimizer_in_bwd with torch.optim.AdamW over 2"),
        ({"model": {"_component_": "torchtune.models.gemma.gemma_2b"}}, "not a builder"),
        ({"dtype": "fp16"}, "dtype = 'fp16'"),
        ({"my_key": 1}, "my_key: not a key of torchtune's single-device recipes"),
        ({"batch_size": 0}, "batch_size = 0"),
        ({"clip_grad_norm": "one"}, "clip_grad_norm = 'one': expected a positive number"),
        ({"dtype": ["bf16"]}, "dtype = ['bf16']"),
    ],
)
def test_a_key_not_modelled_is_refused_by_name(change, said, tmp_path):
    with pytest.raises(BadInput) as raised:
        _read({**SMALL, **change}, tmp_path)
    assert said in str(raised.value)


@pytest.mark.full  # 11 s of a CI core: make test reads the configs, CI's second step predicts
def test_bench_predict_takes_a_torchtune_config_alone(tmp_path, capsys, monkeypatch):
    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "suites").symlink_to(repo / "suites")
    monkeypatch.chdir(tmp_path)
    Path("recipe.yaml").write_text(yaml.safe_dump(SMALL))
    assert main(["predict", "--job", "recipe.yaml", "--jobs", "1", "--only", "job"]) == 0
    captured = capsys.readouterr()
    assert "| job | 4 | ok |" in captured.out
    assert "read as the Hugging Face config suites/configs/qwen2.5-0.5b" in captured.err


@needs_torchtune
@pytest.mark.full
@pytest.mark.parametrize("name", ["lora", "qlora", "full"])
def test_each_shipped_llama3_1_8b_single_device_config_predicts_from_the_file_alone(name, capsys):
    path = SHIPPED / "llama3_1" / f"8B_{name}_single_device.yaml"
    assert main(["predict", "--job", str(path), "--jobs", "1", "--only", "job"]) == 0
    assert "| job | " in capsys.readouterr().out
