"""A config.json saved quantized (its quantization_config): bitsandbytes' 4-bit and 8-bit load as
the bnb-4bit and bnb-8bit techniques with the options they name, every run must name it, and any
other method, or 8-bit option keeping other tensors, is refused by name."""

import json
from pathlib import Path

import pytest

from bench.suite import SuiteError, from_config, load
from tests.predict.test_fake import assert_predicted_exactly

QLORA = {
    "quant_method": "bitsandbytes",
    "load_in_4bit": True,
    "load_in_8bit": False,
    "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_use_double_quant": True,
    "bnb_4bit_compute_dtype": "bfloat16",
    "bnb_4bit_quant_storage": "uint8",
    "llm_int8_skip_modules": None,
}


def saved(tmp_path, quantization):
    config = json.loads(Path("suites/configs/tiny-llama/config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps(config | {"quantization_config": quantization})
    )
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    return tmp_path


def test_a_job_from_a_4bit_checkpoint_loads_it_as_its_config_says_and_is_its_own_baseline(
    tmp_path,
):
    folder = saved(tmp_path, QLORA)
    text = from_config.suite_text(str(folder), None, str(folder / "adapter_config.json"))
    (tmp_path / "job.toml").write_text(text)
    suite = load(tmp_path / "job.toml")
    assert [r.name for r in suite.runs] == ["job"] and suite.baseline == "job"
    assert [t.label for t in suite.runs[0].techniques][0] == (
        "bnb-4bit(compute_dtype=bfloat16,double_quant=True,quant_type=nf4,storage=uint8)"
    )
    assert_predicted_exactly(suite.runs[0])


def test_a_run_of_a_4bit_checkpoint_that_does_not_load_it_so_is_refused_naming_the_technique(
    tmp_path,
):
    folder = saved(tmp_path, QLORA)
    (tmp_path / "suite.toml").write_text(
        f'model = "hf:{folder}"\nbaseline = "lora"\n[shapes.gpu]\nbatch_size = 2\nseq_len = 16\n'
        '[shapes.cpu]\nbatch_size = 2\nseq_len = 16\n[[runs]]\nname = "lora"\n'
        'techniques = ["lora"]\n'
    )
    with pytest.raises(SuiteError, match=r'saved quantized.*\{ name = "bnb-4bit", quant_type'):
        load(tmp_path / "suite.toml")


def test_a_job_from_an_8bit_checkpoint_loads_it_with_its_threshold(tmp_path):
    eight = {"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_threshold": 6.0}
    folder = saved(tmp_path, eight)
    text = from_config.suite_text(str(folder), None, str(folder / "adapter_config.json"))
    (tmp_path / "job.toml").write_text(text)
    suite = load(tmp_path / "job.toml")
    assert [t.label for t in suite.runs[0].techniques][0] == "bnb-8bit(threshold=6.0)"
    assert_predicted_exactly(suite.runs[0])


@pytest.mark.parametrize(
    "quantization, said",
    [
        (
            {
                "quant_method": "bitsandbytes",
                "load_in_8bit": True,
                "llm_int8_has_fp16_weight": True,
            },
            "llm_int8_has_fp16_weight = True keeps each weight in float16 .*: not modelled",
        ),
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not modelled yet"),
    ],
)
def test_another_quantization_is_refused_by_name(quantization, said, tmp_path):
    folder = saved(tmp_path, quantization)
    text = from_config.suite_text(str(folder), None, str(folder / "adapter_config.json"))
    (tmp_path / "job.toml").write_text(text)
    with pytest.raises(SuiteError, match=f"quantization_config: {said}"):
        load(tmp_path / "job.toml")
