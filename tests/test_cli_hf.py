"""A job given as its files (--hf config.json, --training-args, --adapter-config) instead of a
suite: bench suite writes the suite to keep, bench predict and bench run take the files directly,
and a wrong combination exits 2."""

import json
import shutil
from pathlib import Path

import pytest

from bench.cli import main
from bench.suite import load

TINY = "suites/configs/tiny-llama"
REPO = Path(__file__).resolve().parents[1]
ARGS = {
    "output_dir": "out",
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "gradient_checkpointing": True,
    "learning_rate": 2e-4,
}
ADAPTER = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture
def job(tmp_path):
    (tmp_path / "args.json").write_text(json.dumps(ARGS))
    (tmp_path / "adapter_config.json").write_text(json.dumps(ADAPTER))
    return [
        "--hf",
        TINY,
        "--training-args",
        str(tmp_path / "args.json"),
        "--adapter-config",
        str(tmp_path / "adapter_config.json"),
    ]


def test_bench_suite_writes_the_jobs_suite_beside_full_fine_tuning(job, tmp_path, capsys):
    assert main(["suite", *job, "--seq-len", "256", "--out", str(tmp_path / "suites")]) == 0
    written = load(tmp_path / "suites" / "hf-tiny-llama.toml")
    baseline, mine = written.runs
    assert (
        baseline.techniques == () and baseline.gpu.batch_size == 4 and baseline.gpu.seq_len == 256
    )
    techniques = [t.name for t in mine.techniques]
    assert techniques == ["optimizer", "checkpoint", "accumulate", "clip-grad-norm", "lora"]
    # the accumulation steps divide both
    assert mine.gpu.batch_size == 4 and mine.cpu.batch_size % 2 == 0
    assert main(["suite", *job, "--out", str(tmp_path / "suites")]) == 2  # kept: never written over
    assert "exists; edit it" in capsys.readouterr().err


def test_bench_predict_takes_the_files_and_shows_the_breakdown_at_the_peak(
    job, tmp_path, capsys, monkeypatch
):
    shutil.copytree(TINY, tmp_path / TINY)
    # where results/ would be written: nothing is, for files given directly
    monkeypatch.chdir(tmp_path)
    assert main(["predict", *job, "--breakdown", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "| job | 4 | ok |" in out and "temporaries at peak GiB" in out
    assert not (tmp_path / "results").exists()


@pytest.mark.fault("cli values")
@pytest.mark.parametrize(
    "argv, said",
    [
        (["predict", "--training-args", "a.json"], "--training-args goes with --hf PATH"),
        (["predict", "smoke", "--hf", TINY], "smoke and --hf: give one"),
        (["predict"], "name a suite (suites/NAME.toml), or give --hf PATH"),
        (["predict", "--hf", "suites/configs/nowhere"], "cannot read suites/configs/nowhere"),
        (
            ["run", "--hf", TINY, "--batch", "4", "--training-args", "a.json"],
            "the training arguments give the batch",
        ),
        (["suite"], "--hf PATH: the Hugging Face config.json"),
        (["predict", "--quantization-config", "q.json"], "--quantization-config goes with --hf"),
    ],
)
def test_a_wrong_combination_of_job_flags_exits_2_naming_it(argv, said, capsys):
    assert main(argv) == 2
    assert said in capsys.readouterr().err


def _bnb(path, **fields) -> str:
    """A BitsAndBytesConfig file, as transformers writes one (to_json_file)."""
    from transformers import BitsAndBytesConfig

    BitsAndBytesConfig(**fields).to_json_file(str(path))
    return str(path)


def test_a_bitsandbytes_config_file_loads_the_jobs_model_in_4_bits_before_its_adapters(
    job, tmp_path
):
    """QLoRA as its scripts write it: the model loaded with a BitsAndBytesConfig, the adapters on
    it; the baseline fine-tunes the model unquantized."""
    import torch

    quantized = _bnb(
        tmp_path / "bnb.json",
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    argv = ["suite", *job, "--quantization-config", quantized, "--out", str(tmp_path / "s")]
    assert main(argv) == 0
    baseline, mine = load(tmp_path / "s" / "hf-tiny-llama.toml").runs
    assert baseline.techniques == ()
    assert [t.label for t in mine.techniques][-2:] == [
        "bnb-4bit(compute_dtype=bfloat16,double_quant=True,quant_type=nf4,storage=uint8)",
        f"lora(config={tmp_path / 'adapter_config.json'})",
    ]


def test_an_8bit_bitsandbytes_config_file_loads_the_jobs_model_as_llm_int8(job, tmp_path):
    """PEFT's int8 examples: the model loaded with load_in_8bit, its outlier threshold and skipped
    modules read as transformers reads them."""
    eight = _bnb(
        tmp_path / "bnb8.json",
        load_in_8bit=True,
        llm_int8_threshold=4.0,
        llm_int8_skip_modules=["mlp"],
    )
    argv = ["suite", *job, "--quantization-config", eight, "--out", str(tmp_path / "s")]
    assert main(argv) == 0
    _, mine = load(tmp_path / "s" / "hf-tiny-llama.toml").runs
    assert [t.label for t in mine.techniques][-2] == "bnb-8bit(skip=mlp,threshold=4.0)"


@pytest.mark.fault("cli values")
def test_a_bitsandbytes_config_file_not_modelled_or_unreadable_exits_2_naming_it(tmp_path, capsys):
    eight = _bnb(tmp_path / "bnb8.json", load_in_8bit=True, llm_int8_has_fp16_weight=True)
    (tmp_path / "list.json").write_text("[]")
    sft = tmp_path / "sft.json"
    sft.write_text(
        json.dumps(
            {"max_length": 64, "model_init_kwargs": {"quantization_config": {"load_in_4bit": True}}}
        )
    )
    four = _bnb(tmp_path / "bnb4.json", load_in_4bit=True)
    saved = tmp_path / "saved"
    shutil.copytree(TINY, saved)
    config = json.loads((saved / "config.json").read_text())
    config["quantization_config"] = json.loads(Path(four).read_text())
    (saved / "config.json").write_text(json.dumps(config))
    for given, said in (
        ([eight], "bnb8.json: llm_int8_has_fp16_weight = True keeps each weight in float16"),
        ([str(tmp_path / "nowhere.json")], "nowhere.json: cannot read it as JSON"),
        ([str(tmp_path / "list.json")], "list.json: expected a JSON object"),
        ([four, "--training-args", str(sft)], "model_init_kwargs load the model quantized"),
        ([four, "--hf", str(saved)], "saved is saved quantized already (its config.json"),
    ):
        argv = ["suite", "--hf", TINY, "--quantization-config", *given, "--out", str(tmp_path)]
        assert main(argv) == 2
        assert said in capsys.readouterr().err
    assert not list(tmp_path.glob("hf-*.toml"))  # nothing half-written


def test_bench_predict_takes_an_axolotl_job_file_alone(tmp_path, capsys, monkeypatch):
    import yaml

    shutil.copytree(TINY, tmp_path / TINY)
    monkeypatch.chdir(tmp_path)
    job = {
        "base_model": TINY,
        "adapter": "lora",
        "lora_r": 4,
        "lora_target_modules": ["q_proj", "v_proj"],
        "sequence_len": 64,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "gradient_checkpointing": True,
        "datasets": [{"path": "somewhere", "type": "alpaca"}],
    }
    Path("job.yml").write_text(yaml.safe_dump(job))
    assert main(["predict", "--job", "job.yml", "--jobs", "1"]) == 0
    captured = capsys.readouterr()
    assert "| job | 4 | ok |" in captured.out
    assert "read as axolotl's" in captured.err and "ignored, as they change nothing" in captured.err
    # the files it was read into, and nothing under results/
    written = load(Path(".cache/suites/axolotl-job.toml"))
    assert [t.name for t in written.runs[1].techniques] == [
        "amp",
        "optimizer",
        "checkpoint",
        "accumulate",
        "clip-grad-norm",
        "lora",
    ]
    assert not Path("results").exists()


@pytest.mark.fault("cli values")
@pytest.mark.parametrize(
    "argv, said",
    [
        (["predict", "--job", "job.yml", "--hf", TINY], "--job and --hf: the job file gives them"),
        (["predict", "smoke", "--job", "job.yml"], "smoke and --job: give one"),
        (["predict", "--job", "nowhere.yml"], "--job nowhere.yml: no such file"),
        (["predict", "--job", "args.yml"], "not a job file of a kind this harness reads"),
        # a Trainer's field in a LLaMA-Factory file, refused by the TrainingArguments reader
        (["predict", "--job", "factory.yaml"], "use_liger_kernel = True: changes what a step"),
    ],
)
def test_a_job_file_given_wrongly_exits_2_naming_it(argv, said, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("job.yml").write_text("base_model: x\nsequence_len: 64\n")
    Path("args.yml").write_text("output_dir: out\n")
    Path("factory.yaml").write_text(
        f"model_name_or_path: {REPO / TINY}\nstage: sft\nuse_liger_kernel: true\n"
    )
    assert main(argv) == 2
    assert said in capsys.readouterr().err


def test_bench_suite_keeps_nothing_of_a_job_file_its_loader_refuses(tmp_path, capsys):
    """The suite and the files a job file was read into are written, then loaded as bench predict
    would load them: a refusal there (the Trainer's optim not one it knows) leaves none of them."""
    import yaml

    job = {
        "base_model": str(REPO / TINY),
        "adapter": "lora",
        "lora_r": 4,
        "lora_target_linear": True,
        "optimizer": "no_such_optim",
        "datasets": [{"path": "somewhere", "type": "alpaca"}],
    }
    (tmp_path / "job.yml").write_text(yaml.safe_dump(job))
    out = tmp_path / "suites"
    assert main(["suite", "--job", str(tmp_path / "job.yml"), "--out", str(out)]) == 2
    assert "no_such_optim" in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())
