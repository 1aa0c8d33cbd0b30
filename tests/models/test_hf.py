"""Models from a Hugging Face config.json (``hf:PATH``): the shipped configs build at their published sizes, tiny
ones train and predict to the byte on a CPU, and a config that cannot be read says which file and the fix."""

import json
import shutil
from pathlib import Path

import pytest

from bench import models
from bench.models import hf
from bench.suite import SuiteError, load
from tests.helpers import spec, tech
from tests.predict.test_fake import assert_predicted_exactly

CONFIGS = "hf:suites/configs/"


@pytest.mark.parametrize("name, task, params", [
    # The parameter counts their model cards state (Llama-3.2: 1.24B and 3.21B; Qwen2.5-0.5B: 0.49B; Mistral-7B:
    # 7.24B; ViT-L/16: 304M); BERT-large's 335M with a two-label head on its pooler.
    ("llama-3.2-1b", "causal-lm", 1_235_814_400), ("llama-3.2-3b", "causal-lm", 3_212_749_824),
    ("qwen2.5-0.5b", "causal-lm", 494_032_768), ("mistral-7b", "causal-lm", 7_241_732_096),
    ("bert-large-uncased#sequence-classification", "sequence-classification", 335_143_938),
    ("vit-large-patch16-224", "image-classification", 304_326_632),
])
def test_the_shipped_configs_build_at_their_published_sizes(name, task, params):
    found = models.resolve(CONFIGS + name)
    assert hf._params(hf._config(CONFIGS + name), task) == params
    assert found.cpu == (params <= hf.CPU_PARAMS)  # the 3B and 7B are predicted only, as llama3-8b is
    assert found.objective == ("next-token" if task == "causal-lm" else "classify")


@pytest.mark.parametrize("name, techniques", [
    ("tiny-llama", ()), ("tiny-llama", (tech("checkpoint"),)), ("tiny-llama", (tech("chunked-loss"),)),
    ("tiny-bert-classifier", ()), ("tiny-vit-classifier", (tech("accumulate", micro_batches=2),)),
])
def test_a_tiny_config_trains_and_is_predicted_to_the_byte(name, techniques):
    trainer = assert_predicted_exactly(spec(CONFIGS + name, techniques, batch_size=4, image_size=32, seq_len=32))
    assert trainer.spec.blocks(trainer.model)  # its layers are found, for checkpointing and the rest


def test_a_config_without_a_head_names_the_task_to_give(tmp_path):
    config = json.loads(Path("suites/configs/bert-large-uncased/config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(KeyError, match=r"name one after the path, e.g. hf:.*#causal-lm"):
        models.resolve(f"hf:{tmp_path}")  # BertForMaskedLM: no head the harness trains
    with pytest.raises(KeyError, match="cannot read missing .No such file"):
        models.resolve("hf:missing")


def test_a_suite_names_the_config_and_an_edit_to_it_measures_again(tmp_path):
    folder = tmp_path / "tiny"
    shutil.copytree("suites/configs/tiny-llama", folder)
    path = tmp_path / "mine.toml"
    path.write_text(f'model = "hf:{folder}"\nbaseline = "baseline"\n[shapes.gpu]\nbatch_size = 2\nseq_len = 16\n'
                    '[shapes.cpu]\nbatch_size = 2\nseq_len = 16\n[[runs]]\nname = "baseline"\ntechniques = []\n')
    run = load(path).runs[0]
    before = run.measured_key("cpu", "cpu")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"intermediate_size": 256}))
    assert run.measured_key("cpu", "cpu") != before
    path.write_text(path.read_text().replace(str(folder), str(tmp_path / "nowhere")))
    with pytest.raises(SuiteError, match="cannot read"):
        load(path)
