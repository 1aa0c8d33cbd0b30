"""Models from a Hugging Face config.json (``hf:PATH``): the shipped configs build at their
published sizes, tiny ones train and predict to the byte on a CPU, and a config that cannot be read
says which file and the fix."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from bench import models
from bench.data.synthetic import clone_batch
from bench.measure.memory import tracked_step
from bench.models import hf
from bench.suite import SuiteError, load
from tests.conftest import CPU, build_trainer
from tests.helpers import spec, tech
from tests.predict.test_fake import assert_predicted_exactly

CONFIGS = "hf:suites/configs/"


@pytest.mark.parametrize(
    "name, task, params",
    [
        # The parameter counts their model cards state (Llama-3.2: 1.24B and 3.21B; Qwen2.5-0.5B:
        # 0.49B; Mistral-7B: 7.24B; ViT-L/16: 304M); BERT-large's 335M with a two-label head on its
        # pooler.
        ("llama-3.2-1b", "causal-lm", 1_235_814_400),
        ("llama-3.2-3b", "causal-lm", 3_212_749_824),
        ("qwen2.5-0.5b", "causal-lm", 494_032_768),
        ("mistral-7b", "causal-lm", 7_241_732_096),
        # Llama-3.1: 8.03B and 70.55B, as their safetensors index counts them
        ("llama-3.1-8b", "causal-lm", 8_030_261_248),
        ("llama-3.1-70b", "causal-lm", 70_553_706_496),
        ("bert-large-uncased#sequence-classification", "sequence-classification", 335_143_938),
        # its own head, BertForMaskedLM: the encoder and a prediction head tied to the word
        # embeddings
        ("bert-large-uncased", "masked-lm", 335_174_458),
        ("vit-large-patch16-224", "image-classification", 304_326_632),
        # mixtures of experts: Mixtral-8x7B's 46.7B, Qwen3-30B-A3B's 30.5B (their model cards)
        ("mixtral-8x7b", "causal-lm", 46_702_792_704),
        ("qwen3-30b-a3b", "causal-lm", 30_532_122_624),
        # flan-t5-xl's 2.85B as its checkpoint's files count it holds the shared embedding
        # (32,128 × 2,048) twice, the encoder's tied copy stored apart: 2.78B parameters
        ("flan-t5-xl", "seq2seq-lm", 2_849_757_184 - 32_128 * 2_048),
    ],
)
def test_the_shipped_configs_build_at_their_published_sizes(name, task, params):
    found = models.resolve(CONFIGS + name)
    assert hf._params(hf._config(CONFIGS + name), task) == params
    # the 3B and 7B are predicted only, as llama3-8b is
    assert found.cpu == (params <= hf.CPU_PARAMS)
    objective = {"causal-lm": "next-token", "masked-lm": "masked-lm", "seq2seq-lm": "seq2seq"}
    objective = objective.get(task, "classify")
    assert found.objective == objective


@pytest.mark.parametrize(
    "name, techniques",
    [
        ("tiny-llama", ()),
        ("tiny-llama", (tech("checkpoint"),)),
        ("tiny-llama", (tech("chunked-loss"),)),
        ("tiny-bert-classifier", ()),
        ("tiny-bert-classifier#masked-lm", ()),
        ("tiny-vit-classifier", (tech("accumulate", micro_batches=2),)),
    ],
)
def test_a_tiny_config_trains_and_is_predicted_to_the_byte(name, techniques):
    trainer = assert_predicted_exactly(
        spec(CONFIGS + name, techniques, batch_size=4, image_size=32, seq_len=32)
    )
    # its layers are found, for checkpointing and the rest
    assert trainer.spec.blocks(trainer.model)


def test_a_config_without_a_head_names_the_task_to_give(tmp_path):
    config = json.loads(Path("suites/configs/bert-large-uncased/config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"architectures": ["BertModel"]}))
    with pytest.raises(KeyError, match=r"name one after the path, e.g. hf:.*#causal-lm"):
        models.resolve(f"hf:{tmp_path}")  # the bare encoder: no head the harness trains
    with pytest.raises(KeyError, match="cannot read missing .No such file"):
        models.resolve("hf:missing")


def test_the_name_sets_the_attention_after_the_task_as_from_pretrained_takes_it():
    """Eager attention keeps each layer's probabilities and their dropout mask for backward; the
    name says so (``#task,attn_implementation=eager``), and the run is predicted to the byte with
    it."""
    name = CONFIGS + "tiny-bert-classifier#sequence-classification,attn_implementation=eager"
    eager, sdpa = models.resolve(name), models.resolve(CONFIGS + "tiny-bert-classifier")
    assert not eager.attention and sdpa.attention
    trainer = assert_predicted_exactly(spec(name, batch_size=4, seq_len=32))
    assert trainer.model.config._attn_implementation == "eager"
    with pytest.raises(
        KeyError, match="torch_dtype cannot be set after the path; one of attn_implementation"
    ):
        models.resolve(CONFIGS + "tiny-bert-classifier#torch_dtype=bfloat16")


def test_a_suite_names_the_config_and_an_edit_to_it_measures_again(tmp_path):
    folder = tmp_path / "tiny"
    shutil.copytree("suites/configs/tiny-llama", folder)
    path = tmp_path / "mine.toml"
    path.write_text(
        f'model = "hf:{folder}"\nbaseline = "baseline"\n[shapes.gpu]\nbatch_size = 2\nseq_len = '
        "16\n"
        '[shapes.cpu]\nbatch_size = 2\nseq_len = 16\n[[runs]]\nname = "baseline"\ntechniques = []\n'
    )
    run = load(path).runs[0]
    before = run.measured_key("cpu", "cpu")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"intermediate_size": 256}))
    assert run.measured_key("cpu", "cpu") != before
    path.write_text(path.read_text().replace(str(folder), str(tmp_path / "nowhere")))
    with pytest.raises(SuiteError, match="cannot read"):
        load(path)


@pytest.mark.parametrize(
    "name, bf16",
    [
        ("tiny-llama", False),  # its config's torch_dtype, bfloat16, as from_pretrained loads it
        ("tiny-llama#causal-lm,dtype=float32", False),
        ("tiny-llama#causal-lm,dtype=float32", True),
        ("tiny-bert-classifier", False),
        # BertForMaskedLM's loss over every position's logits
        (
            "tiny-bert-classifier#masked-lm",
            False,
        ),
    ],
)
def test_the_harness_holds_what_transformers_trainer_holds_in_its_training_step(
    name, bf16, tmp_path
):
    # In bf16 the causal-LM loss upcasts the logits to float32: the harness's own cross-entropy did
    # not.
    from transformers import Trainer, TrainingArguments

    ours, batch = build_trainer(
        spec(CONFIGS + name, (tech("bf16"),) if bf16 else (), batch_size=4, seq_len=32)
    )
    inputs, labels = batch
    model = build_trainer(spec(CONFIGS + name, batch_size=4, seq_len=32))[0].model
    theirs = Trainer(
        model=model.to(torch.bfloat16) if bf16 else model,
        args=TrainingArguments(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            optim="adamw_torch",
            learning_rate=1e-3,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
        ),
    )
    theirs.create_optimizer_and_scheduler(num_training_steps=10)
    theirs.current_gradient_accumulation_steps = 1  # what its train loop sets before each step

    # the Trainer's own step (forward and backward), then its optimizer's, as its loop runs them
    def their_step():
        theirs.training_step(theirs.model, dict(clone_batch(batch)[0]) | {"labels": labels.clone()})
        theirs.optimizer.step()
        theirs.optimizer.zero_grad(set_to_none=True)

    ours.step(clone_batch(batch))  # warm-up both: optimizer state exists
    their_step()
    measured = tracked_step(lambda: ours.step(clone_batch(batch)), ours.model, ours.optimizer, CPU)
    reference = tracked_step(their_step, theirs.model, theirs.optimizer, CPU)
    assert abs(measured.peak_tensor_bytes / reference.peak_tensor_bytes - 1) < 0.01, (
        measured,
        reference,
    )
    assert measured.peak_phase == reference.peak_phase


def test_weights_take_the_configs_dtype_as_transformers_5_loads_them_or_one_the_name_sets():
    """from_pretrained's dtype="auto": a config that says torch_dtype bfloat16 trains in
    bfloat16."""
    shapes = spec(CONFIGS + "tiny-llama", seq_len=16).cpu
    dtypes = {
        name: {p.dtype for p in models.resolve(CONFIGS + name).build(shapes).parameters()}
        for name in ("tiny-llama", "tiny-llama#causal-lm,dtype=float32", "tiny-bert-classifier")
    }
    assert list(dtypes.values()) == [{torch.bfloat16}, {torch.float32}, {torch.float32}]
    with pytest.raises(KeyError, match="dtype 'int8' is none of float32, bfloat16, float16"):
        models.resolve(CONFIGS + "tiny-llama#causal-lm,dtype=int8")


@pytest.mark.full
@pytest.mark.parametrize("config", ["tiny-llama", "tiny-bert-classifier", "tiny-vit-classifier"])
def test_every_training_technique_that_applies_to_a_shipped_tiny_config_is_predicted_to_the_byte(
    config,
):
    """Each registered single-process training technique, with its default options, that the run
    itself accepts on this CPU (its own unsupported() and the model's say so): prediction equals the
    tracked peak."""
    from bench.recipe import Recipe
    from bench.techniques import TECHNIQUES, Unsupported

    applied = []
    for name in TECHNIQUES.registered():
        cls = TECHNIQUES.get(name)
        run = spec(CONFIGS + config, (tech(name),), batch_size=4, image_size=32, seq_len=32)
        if "train" not in cls.modes or cls.distributed or cls.unpredictable or not cls.trackable:
            continue
        if Recipe.of(run, CPU).unsupported() or (name == "packing" or "lengths" in name):
            # packing needs variable-length data (a suite's lengths), refused at load without
            continue
        try:
            assert_predicted_exactly(run)
        except Unsupported:  # found out by the run itself (flash attention refusing a masked call)
            continue
        applied.append(name)
    assert len(applied) >= 12, applied


BLOOM = {
    "architectures": ["BloomForCausalLM"],
    "model_type": "bloom",
    "hidden_size": 64,
    "n_head": 4,
    "n_layer": 2,
    "vocab_size": 1000,
}


def test_a_model_without_sdpa_gets_eager_attention_and_its_adapters_where_peft_config_names_them(
    tmp_path,
):
    """BLOOM has no SDPA path: transformers picks eager, and so does the harness (it forced SDPA,
    and the baseline of PEFT's bloomz example was unpredictable). Its adapter_config names its
    fused query_key_value, which is enough for lora without a family of default targets."""
    (tmp_path / "config.json").write_text(json.dumps(BLOOM))
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 8, "target_modules": ["query_key_value"]})
    )
    name = f"hf:{tmp_path}"
    assert models.resolve(name).attention is False
    with torch.device("meta"):
        built = models.resolve(name).build(spec(name, seq_len=16).gpu)
    assert built.config._attn_implementation == "eager"
    assert (
        models.resolve(name).note == "attention: eager (transformers' pick, the config naming none)"
    )
    lora = tech("lora", config=str(tmp_path / "adapter_config.json"))
    assert_predicted_exactly(spec(name, (lora,), batch_size=2, seq_len=16))


@pytest.mark.parametrize(
    "techniques",
    [(), (tech("lora", targets="q,v"),), (tech("amp", dtype="bfloat16"), tech("checkpoint"))],
    ids=["full", "lora", "amp+checkpoint"],
)
def test_an_encoder_decoder_trains_on_its_targets_and_is_predicted_to_the_byte(techniques):
    """T5ForConditionalGeneration (and BART's) is a seq2seq-lm: sources in, targets as labels and,
    shifted right, as the decoder's inputs, its own loss; checkpointing wraps both stacks'
    blocks."""
    name = CONFIGS + "tiny-t5"
    assert models.resolve(name).objective == "seq2seq"
    run = spec(name, techniques, batch_size=2, seq_len=16)
    trainer = assert_predicted_exactly(run)
    if techniques and techniques[-1].name == "checkpoint":
        assert trainer.proof()["checkpoint.wrapped_names"] == (
            "encoder.block.0, encoder.block.1, decoder.block.0, decoder.block.1"
        )


@pytest.mark.parametrize("routing", ["balanced", "worst", "balanced, its auxiliary loss"])
def test_a_mixture_of_experts_is_predicted_to_the_byte_whatever_its_router_picks(
    routing, monkeypatch, tmp_path
):
    """Mixtral's experts run through transformers' grouped_mm: every token's rows for its top-k
    experts in one tensor, whichever experts they are. The tracked run with its router set to
    spread the tokens evenly, and with every token sent to the same two experts, each equals the
    prediction (which holds no router values) to the byte, and the prediction says so."""
    from transformers.models.mixtral import modeling_mixtral

    def routed(self, hidden_states):
        tokens = hidden_states.reshape(-1, self.hidden_dim).shape[0]
        first = torch.zeros(tokens, dtype=int) if routing == "worst" else torch.arange(tokens)
        indices = torch.stack([first + k for k in range(self.top_k)], -1) % self.num_experts
        logits = torch.zeros(tokens, self.num_experts)
        return logits, torch.full((tokens, self.top_k), 1 / self.top_k), indices

    monkeypatch.setattr(modeling_mixtral.MixtralTopKRouter, "forward", routed)
    name = CONFIGS + "tiny-mixtral"
    if routing.endswith("loss"):  # every layer's router logits kept for the load-balancing loss
        config = json.loads(Path("suites/configs/tiny-mixtral/config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps(config | {"output_router_logits": True}))
        name = f"hf:{tmp_path}"
    techniques = (tech("lora", targets="q_proj,v_proj"), tech("checkpoint"))
    trainer = assert_predicted_exactly(spec(name, techniques, batch_size=4, seq_len=32))
    assert trainer.model.base_model.model.config._experts_implementation == "grouped_mm"
    from bench.predict import predict

    note = predict(spec(name, techniques, batch_size=4, seq_len=32)).message
    assert note.startswith(
        "attention: sdpa (transformers' pick, the config naming none); experts: 4 a layer, run "
        "through transformers' grouped_mm"
    )


def test_experts_run_in_transformers_loop_are_refused_by_name(tmp_path):
    """JetMoe's experts loop over those the router hits, each on the tokens routed to it: sizes
    that are the router's values. Its prediction says so instead of failing on a fake tensor."""
    config = {
        "architectures": ["JetMoeForCausalLM"],
        "model_type": "jetmoe",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "kv_channels": 16,
        "intermediate_size": 128,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 1024,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    from bench.predict import predict

    out = predict(spec(f"hf:{tmp_path}", batch_size=2, seq_len=16))
    assert out.status == "unpredictable", out
    assert "experts the router hits" in out.message
