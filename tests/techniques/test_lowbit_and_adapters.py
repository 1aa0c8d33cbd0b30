"""Techniques from optional packages: run where the package is installed (`make test` installs
them), unsupported with an install hint where it is not."""

import math
import re

import pytest
import torch

from bench.launch import Device
from bench.measure.host import pinned_block
from bench.measure.memory import model_state_bytes, tensor_bytes, tracked_step
from bench.models import MODELS, build_model
from bench.predict import predict
from bench.predict.cards import CARDS
from bench.record import AT_PEAK
from bench.suite import load
from bench.worker import measure
from tests.conftest import CPU, build_trainer
from tests.helpers import MLP_PARAM_BYTES, isolated, mlp_step, spec, suite_problems, tech
from tests.predict.test_fake import assert_predicted_exactly


def run(model, *techniques):
    trainer, batch = build_trainer(spec(model, techniques, batch_size=8, seq_len=32))
    trainer.step(batch)
    return tracked_step(lambda: trainer.step(batch), trainer.model, trainer.optimizer, CPU), trainer


@pytest.mark.parametrize("model", ["bert-tiny", "vit-tiny"])
def test_lora_trains_adapters_and_head_only(model):
    pytest.importorskip("peft")
    base, _ = run(model)
    lora, trainer = run(model, tech("lora", rank=4))
    proof = trainer.proof()
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    assert (
        proof["lora.trainable_params"]
        == sum(p.numel() for p in trainable)
        < proof["lora.total_params"] / 5
    )
    assert proof["lora.adapted_layers"] == 4  # two target layers in each of two blocks
    assert lora.optimizer_state_bytes < base.optimizer_state_bytes / 5


def test_int8_weights_store_frozen_linears_in_a_quarter_of_the_bytes():
    pytest.importorskip("torchao")
    pytest.importorskip("peft")
    lora, _ = run("bert-tiny", tech("lora"))
    int8, trainer = run("bert-tiny", tech("lora"), tech("int8-weights"))
    frozen_linears = trainer.proof()["int8-weights.quantized_linears"]
    # per layer q, k, v, attention out, MLP in, MLP out; plus the pooler
    assert frozen_linears == 2 * 6 + 1
    assert int8.param_bytes < lora.param_bytes


def adamw_8bit_state_bytes(numel: int) -> int:
    """torchao's AdamW8bit state for one parameter: each moment as a byte per value, a float32 scale
    per block of 256 values and its 256-entry float32 code book, for tensors of 4096+ values in
    whole blocks (smaller ones stay float32, as bitsandbytes does); and a float32 step counter."""
    moment = numel + numel // 256 * 4 + 256 * 4 if numel >= 4096 and numel % 256 == 0 else 4 * numel
    return 2 * moment + 4


def test_adamw_8bit_keeps_its_moments_in_a_byte_per_value():
    pytest.importorskip("torchao")
    trainer, batch = build_trainer(spec("vit-tiny", (tech("adamw-8bit"),), batch_size=8))
    trainer.step(batch)
    figures = model_state_bytes(trainer.model, trainer.optimizer)
    assert trainer.proof()["adamw-8bit.optimizer"] == "torchao.optim.adam.AdamW8bit"
    assert figures.optimizer_state_bytes == sum(
        adamw_8bit_state_bytes(p.numel()) for p in trainer.model.parameters()
    )


def test_adamw_8bit_step_is_tracked_with_its_state_but_not_its_compiled_temporaries():
    """Linear(64→256)→ReLU→Linear(256→10), batch 32, as the AdamW test in
    tests/measure/test_tracker.py. torchao compiles each parameter's update, which the tracker steps
    aside for: the state it keeps is counted, the kernel's temporaries are not, so the peak is
    backward's where AdamW's own was its step's."""
    model, opt, step = mlp_step(pytest.importorskip("torchao.optim").AdamW8bit)
    figures = tracked_step(step, model, opt, CPU, compiled_update=True)
    params = MLP_PARAM_BYTES
    # only the first weight is 8-bit
    state = 2 * (64 * 256 + 64 * 4 + 1024) + 2 * 4 * (256 + 256 * 10 + 10) + 4 * 4
    assert state == sum(adamw_8bit_state_bytes(p.numel()) for p in model.parameters())
    assert figures.optimizer_state_bytes == state
    # At backward's peak: the model states, every gradient, the hidden layer's gradient (32 × 256
    # floats) as the first weight's is made, and the loss with its gradient (4 bytes each).
    assert figures.peak_phase == "backward"
    assert {k: v for k, v in figures.flat().items() if k.startswith("at_peak_")} == {
        "at_peak_parameters_bytes": params,
        "at_peak_buffers_bytes": 0,
        "at_peak_gradients_bytes": params,
        "at_peak_optimizer_state_bytes": state,
        "at_peak_activations_bytes": 0,
        "at_peak_temporaries_bytes": 32 * 256 * 4 + 2 * 4,
    }


def test_adamw_8bit_runs_record_a_tracked_peak_and_its_breakdown():
    pytest.importorskip("torchao")
    record = measure(spec("vit-tiny", (tech("adamw-8bit"),), batch_size=8), CPU)
    assert record.outcome.status == "ok", record.outcome
    memory = record.memory
    assert memory.at_peak_optimizer_state_bytes == memory.optimizer_state_bytes > 0
    at_peak = [getattr(memory, f"at_peak_{c}_bytes") or 0 for c in AT_PEAK]
    assert sum(at_peak) == memory.peak_tensor_bytes


@pytest.mark.parametrize(
    "technique, model, reason",
    [
        ("fp8", "vit-tiny", "FP8 tensor cores are a GPU feature"),
        ("int8-weights", "resnet-tiny", "ResNet's only linear layer is its head"),
        ("lora", "resnet-tiny", "no default layers to adapt for this model: set targets"),
    ],
)
def test_inapplicable_low_bit_runs_are_unsupported(technique, model, reason):
    # decided before anything runs: no process needed
    outcome = measure(spec(model, (tech(technique),)), CPU).outcome
    assert outcome.status == "unsupported" and reason in outcome.message, outcome


def test_missing_optional_package_gives_the_install_hint(monkeypatch):
    import importlib.util

    from bench.models import MODELS
    from bench.techniques import RunContext
    from bench.techniques.lowbit import AdamW8bit

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    ctx = RunContext(device=CPU, model_spec=MODELS.get("vit-tiny"), shapes=None)
    assert "pip install torchao" in AdamW8bit().unsupported(ctx)


def test_int8_weights_leave_torchvision_attention_projections_alone():
    """torchvision's attention calls out_proj's weight directly (transposed), which int8 storage
    cannot."""
    pytest.importorskip("torchao")
    pytest.importorskip("peft")
    _, trainer = run("vit-tiny", tech("lora"), tech("int8-weights"))
    # the two MLP linears per block
    assert trainer.proof()["int8-weights.quantized_linears"] == 2 * 2


def test_int8_weights_on_a_model_with_no_linear_but_its_head_is_unsupported_not_a_silent_no_op():
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig

    from bench.models import MODELS
    from bench.suite import Shapes
    from bench.techniques import Unsupported
    from bench.techniques.lowbit import quantize_body_linears

    # as a user's CNN would be
    convolutions = MODELS.get("resnet-tiny").build(Shapes(batch_size=1, image_size=32))
    with pytest.raises(
        Unsupported, match=r"no nn.Linear outside the head \(classifier, heads, fc\)"
    ):
        quantize_body_linears(convolutions, Int8WeightOnlyConfig(), freeze=True)


@pytest.mark.parametrize(
    "model, torchao, reason",
    [
        # ResNet's one linear is its head (to 10 classes here, 1000 at full size): FP8 would convert
        # nothing, whether or not torchao is there to be asked for.
        ("resnet-tiny", True, r"\(linears: fc 2048→10\): nothing would run in FP8"),
        ("resnet-tiny", False, r"\(linears: fc 2048→10\): nothing would run in FP8"),
        ("bert-tiny", False, "needs torchao: pip install torchao"),
    ],
)
def test_fp8_says_first_what_no_install_changes(monkeypatch, model, torchao, reason):
    """What a CUDA host without torchao would say, through the prediction (which stands for a CUDA
    run: on a CPU, fp8 is refused first as a GPU feature)."""
    from bench.predict.fake import predict
    from bench.techniques import lowbit

    if torchao:
        pytest.importorskip("torchao")
    else:
        monkeypatch.setattr(lowbit, "_has", lambda package: False)
    run = spec(model, (tech("fp8"),))
    out = predict(run, run.cpu, cuda=True)
    assert out.status == "unsupported" and re.search(reason, out.message), out


def test_qlora_stores_every_block_linear_in_nf4_and_trains_the_adapters_only():
    """llama-tiny: its 14 block linears become frozen NF4 weights of 4 bits a value plus their
    double-quantized scales (0.54 bytes a parameter at these sizes), adapted by LoRA on all seven
    linears of a layer; the tied embedding and head stay float32 and frozen. The tracked parameter
    bytes are LoRA's less exactly what NF4 saves on those weights, and the prediction counts the
    same bytes."""
    pytest.importorskip("torchao")
    pytest.importorskip("peft")
    from bench.predict.fake import predict

    lora, _ = run("llama-tiny", tech("lora"))
    qlora, trainer = run("llama-tiny", tech("qlora"))
    nf4 = [p for p in trainer.model.parameters() if type(p).__name__ == "NF4Tensor"]
    proof = trainer.proof()
    assert len(nf4) == proof["qlora.nf4_linears"] == 14 and not any(p.requires_grad for p in nf4)
    held = tensor_bytes(nf4)  # the storages behind their quantized values and scales
    assert proof["qlora.nf4_bytes_per_param"] == round(held / sum(p.numel() for p in nf4), 4) < 0.55
    assert qlora.param_bytes == lora.param_bytes - 4 * sum(p.numel() for p in nf4) + held
    # the same adapters train
    assert qlora.optimizer_state_bytes == lora.optimizer_state_bytes
    run_spec = spec("llama-tiny", (tech("qlora"),), batch_size=8, seq_len=32)
    assert predict(run_spec, cuda=False).param_bytes == qlora.param_bytes


def test_cpu_offload_optimizer_leaves_the_device_its_small_parameters_state_only():
    """Predicted as CUDA (a CPU run is unsupported: the state is in host memory already): AdamW's
    state, and with offload_gradients the gradients, of every parameter of 4,096 elements or more
    leave the device; llama-tiny's five 128-wide norms keep theirs (two float32 moments each)."""
    pytest.importorskip("torchao")
    from bench.predict.fake import predict
    from bench.recipe import Recipe

    plain = predict(spec("llama-tiny", (), batch_size=1, seq_len=16))
    out = predict(spec("llama-tiny", (tech("cpu-offload-optimizer"),), batch_size=1, seq_len=16))
    freed = predict(
        spec(
            "llama-tiny",
            (tech("cpu-offload-optimizer", offload_gradients=True),),
            batch_size=1,
            seq_len=16,
        )
    )
    norms = 5 * 128 * 4
    assert out.optimizer_state_bytes == 2 * norms  # their AdamW's step counters on the host
    assert out.gradient_bytes == plain.gradient_bytes
    assert freed.gradient_bytes == norms
    assert plain.peak_tensor_bytes - out.peak_tensor_bytes > 0.9 * plain.optimizer_state_bytes
    # on the host: each large parameter's copy and gradient pinned (a power-of-two block each),
    # and the host AdamW's float32 moments and step counter, pageable; the device AdamW's step
    # counters are the host's too, as on CUDA
    run = spec("llama-tiny", (), batch_size=1, seq_len=16)
    model, _ = build_model(MODELS.get(run.model), run.shapes("cpu"))
    large = [p for p in model.parameters() if p.numel() >= 4096]
    pinned = sum(2 * pinned_block(p.numel() * p.element_size()) for p in large)
    adamw = sum(2 * 4 * p.numel() + 4 for p in large)
    assert out.host_pinned_bytes == pinned
    assert out.host_peak_bytes == pinned + adamw + 4 * 5
    reason = Recipe.of(spec("llama-tiny", (tech("cpu-offload-optimizer"),)), CPU).unsupported()
    assert reason == (
        "cpu-offload-optimizer: the optimizer state lives in host memory on a CPU already; this "
        "moves it off a GPU"
    )


@pytest.mark.cuda
def test_cpu_offload_optimizer_on_a_gpu_keeps_the_offloaded_state_off_the_device():
    pytest.importorskip("torchao")
    cuda = torch.device("cuda")
    trainer, batch = build_trainer(
        spec("llama-tiny", (tech("cpu-offload-optimizer"),), batch_size=2, seq_len=64), cuda
    )
    trainer.step(batch)
    figures = tracked_step(lambda: trainer.step(batch), trainer.model, trainer.optimizer, cuda)
    # the norms' moments, a 512-byte block each
    assert figures.optimizer_state_bytes <= 5 * 2 * 512
    assert trainer.proof()["cpu-offload-optimizer.offloaded_params"] > 0


GOOD_LLAMA = """model = "llama-tiny"
baseline = "baseline"
[shapes.gpu]
batch_size = 2
seq_len = 16
[shapes.cpu]
batch_size = 2
seq_len = 16
[[runs]]
name = "baseline"
techniques = []
[[runs]]
name = "adapted"
techniques = [TECHNIQUES]
"""


def adapters(model):
    return [p for n, p in model.named_parameters() if "lora_" in n]


@pytest.mark.parametrize(
    "adapter_dtype, expected", [("float32", torch.float32), ("base", torch.bfloat16)]
)
def test_the_adapters_dtype_under_a_bf16_base_is_the_options(adapter_dtype, expected):
    pytest.importorskip("peft")
    trainer, _ = build_trainer(
        spec(
            "llama-tiny",
            (tech("bf16"), tech("lora", adapter_dtype=adapter_dtype)),
            batch_size=2,
            seq_len=16,
        )
    )
    # float32: PEFT's own default there
    assert {p.dtype for p in adapters(trainer.model)} == {expected}


@pytest.mark.parametrize("adapter", ["lora", "qlora"])
def test_a_cast_listed_after_the_adapters_is_refused_as_ambiguous(adapter, tmp_path):
    found = suite_problems(tmp_path, GOOD_LLAMA.replace("TECHNIQUES", f'"{adapter}", "bf16"'))
    assert any(
        f"bf16 after {adapter}: listed after {adapter}, it would cast the adapters too" in p
        for p in found
    )
    (tmp_path / "ordered.toml").write_text(GOOD_LLAMA.replace("TECHNIQUES", f'"bf16", "{adapter}"'))
    # the cast first: loads
    assert load(tmp_path / "ordered.toml").runs[1].techniques[0].name == "bf16"


def test_a_cast_keeps_nf4_weights_in_their_four_bits():
    # [qlora, bf16] once dequantized them in a cast (NF4Tensor.to(dtype) dequantizes): Llama-3-8B
    # was predicted at 5.07 GiB, below its own 5.35 GiB of parameters, the tracker no longer seeing
    # the NF4 bytes.
    pytest.importorskip("torchao")
    trainer, _ = build_trainer(spec("llama-tiny", (tech("qlora"),), batch_size=2, seq_len=16))
    before = model_state_bytes(trainer.model, None).param_bytes
    from bench.techniques.precision import cast_

    cast_(trainer.model, torch.bfloat16)
    nf4 = [p for p in trainer.model.parameters() if type(p).__name__ == "NF4Tensor"]
    assert len(nf4) == 14 and model_state_bytes(trainer.model, None).param_bytes < before


def test_lora_dropout_keeps_a_dropped_copy_of_each_adapted_input():
    pytest.importorskip("peft")
    held = {}
    for p in (0.0, 0.1):
        trainer, batch = build_trainer(
            spec("bert-tiny", (tech("lora", dropout=p),), batch_size=4, seq_len=32)
        )
        trainer.step(batch)
        held[p] = tracked_step(
            lambda t=trainer, b=batch: t.step(b), trainer.model, trainer.optimizer, CPU
        ).activation_bytes
    assert held[0.1] > held[0.0]


def test_peft_adapter_config_json_is_read_for_the_fields_that_change_memory(tmp_path):
    pytest.importorskip("peft")
    path = tmp_path / "adapter_config.json"
    path.write_text(
        '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.05, '
        '"target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": '
        '"meta-llama/Llama-3.2-1B"}'
    )
    trainer, _ = build_trainer(
        spec("llama-tiny", (tech("lora", config=str(path)),), batch_size=2, seq_len=16)
    )
    shapes = {tuple(p.shape) for n, p in trainer.model.named_parameters() if "lora_A" in n}
    assert {s[0] for s in shapes} == {4}  # r = 4
    # q and v in each of the two layers
    assert trainer.techniques[0].proof(1)["adapted_layers"] == 2 * 2
    path.write_text('{"peft_type": "LORA", "r": 4, "bias": "all"}')
    found = suite_problems(
        tmp_path, GOOD_LLAMA.replace("TECHNIQUES", f'{{ name = "lora", config = "{path}" }}')
    )
    assert any("bias = 'all' is not modelled here" in p for p in found), found
    path.write_text('{"peft_type": "IA3", "target_modules": ["k_proj"]}')
    found = suite_problems(
        tmp_path, GOOD_LLAMA.replace("TECHNIQUES", f'{{ name = "lora", config = "{path}" }}')
    )
    assert any("(an IA3 one is the ia3 technique's)" in p for p in found), found


def test_dora_trains_a_magnitude_per_output_beside_the_adapters_as_its_adapter_config_says(
    tmp_path,
):
    """use_dora: PEFT's DoRA, a magnitude vector per adapted linear's outputs trained beside A and
    B; the merged weight's norm, taken in every forward, held as PEFT holds it."""
    pytest.importorskip("peft")
    path = tmp_path / "adapter_config.json"
    path.write_text('{"peft_type": "LORA", "r": 4, "use_dora": true, "target_modules": ["q_proj"]}')
    plain, dora = (
        build_trainer(spec("llama-tiny", (t,), batch_size=2, seq_len=16))[0]
        for t in (tech("lora", rank=4, targets="q_proj"), tech("lora", config=str(path)))
    )
    extra = (
        dora.techniques[0].proof(1)["trainable_params"]
        - plain.techniques[0].proof(1)["trainable_params"]
    )
    q = dora.model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")
    assert extra == 2 * q.out_features  # one magnitude per output, in each of the two layers
    assert_predicted_exactly(
        spec("llama-tiny", (tech("lora", dora=True),), batch_size=2, seq_len=16)
    )


def test_ia3_trains_one_vector_per_adapted_linear_as_its_adapter_config_says(tmp_path):
    """PEFT's IA3 on Llama's key, value and down projections (its defaults for the type), the
    last a feed-forward one whose input is scaled: a vector each, nothing else trained."""
    pytest.importorskip("peft")
    path = tmp_path / "adapter_config.json"
    path.write_text(
        '{"peft_type": "IA3", "target_modules": ["k_proj", "v_proj", "down_proj"], '
        '"feedforward_modules": ["down_proj"], "base_model_name_or_path": "x"}'
    )
    trainer = build_trainer(spec("llama-tiny", (tech("ia3", config=str(path)),), seq_len=16))[0]
    layer = trainer.model.get_submodule("base_model.model.model.layers.0")
    vectors = layer.self_attn.k_proj.out_features + layer.self_attn.v_proj.out_features
    vectors += layer.mlp.down_proj.in_features
    assert trainer.techniques[0].proof(1)["trainable_params"] == 2 * vectors
    assert trainer.techniques[0].proof(1)["adapted_layers"] == 2 * 3
    assert_predicted_exactly(spec("llama-tiny", (tech("ia3"),), batch_size=2, seq_len=16))


def _rounded(n: int) -> int:
    return math.ceil(n / 512) * 512  # what the CUDA allocator takes for a request of n bytes


def test_paged_adamw_8bit_keeps_its_large_moments_off_the_cuda_allocator():
    """Predicted for CUDA, the state the allocator holds is bitsandbytes' rule (optim/optimizer.py):
    float32 moments under 4,096 elements; 8-bit moments above, with a float32 absmax per 256 values
    and the two shared 256-entry code books, the moments of parameters of 100,000 elements or more
    paged out of its reach."""
    pytest.importorskip("bitsandbytes")
    run = spec("llama-tiny", (tech("paged-adamw-8bit"),), batch_size=4, seq_len=16)
    out = predict(run, run.cpu, cuda=True)
    assert out.ok, out
    sizes = [p.numel() for p in build_model(MODELS.get("llama-tiny"), run.cpu)[0].parameters()]
    assert any(n >= 100_000 for n in sizes) and any(4096 <= n < 100_000 for n in sizes)

    def state(r, paged_out):  # the moments' and absmaxes' bytes, each request as ``r`` takes it
        return 2 * r(256 * 4) + sum(
            2 * r(4 * n)
            if n < 4096
            else 2 * r(4 * math.ceil(n / 256)) + (0 if paged_out(n) else 2 * r(n))
            for n in sizes
        )

    # the device's share, as its allocator rounds it; and every state tensor, paged ones included
    assert out.at_peak_optimizer_state_bytes == state(_rounded, lambda n: n >= 100_000)
    assert out.optimizer_state_bytes == state(lambda b: b, lambda n: False)
    # off the allocator, on nvidia-smi's count: the paged moments are resident while the card has
    # room
    paged = sum(2 * n for n in sizes if n >= 100_000)
    assert out.paged_bytes == paged
    assert out.nvml_process_bytes == out.peak_reserved_bytes + CARDS["h100"].context + paged


def test_paged_adamw_32bit_keeps_its_large_float32_moments_off_the_cuda_allocator():
    """The Trainer's paged_adamw_32bit: float32 moments for every parameter (no absmax, no code
    book), those of parameters of 100,000 elements or more paged out of the allocator's reach."""
    pytest.importorskip("bitsandbytes")
    run = spec("llama-tiny", (tech("paged-adamw-32bit"),), batch_size=4, seq_len=16)
    out = predict(run, run.cpu, cuda=True)
    assert out.ok, out
    sizes = [p.numel() for p in build_model(MODELS.get("llama-tiny"), run.cpu)[0].parameters()]
    assert any(n >= 100_000 for n in sizes) and any(n < 100_000 for n in sizes)
    assert out.at_peak_optimizer_state_bytes == sum(
        2 * _rounded(4 * n) for n in sizes if n < 100_000
    )
    assert out.optimizer_state_bytes == sum(2 * 4 * n for n in sizes)
    assert out.paged_bytes == sum(2 * 4 * n for n in sizes if n >= 100_000)


def test_paged_adamw_8bit_is_a_cuda_technique():
    run = spec("llama-tiny", (tech("paged-adamw-8bit"),), batch_size=4, seq_len=16)
    out = predict(run, run.cpu, cuda=False)
    assert out.status == "unsupported" and "unified memory" in out.message


@pytest.mark.cuda
def test_paged_adamw_8bit_pages_its_large_moments_on_cuda_as_predicted():
    pytest.importorskip("bitsandbytes")
    record = isolated(
        spec("llama-tiny", (tech("paged-adamw-8bit"),), batch_size=8, seq_len=64),
        Device("cuda", torch.cuda.get_device_name(0)),
    )
    assert record["status"] == "ok", record
    assert record["proof"]["paged-adamw-8bit.paged_moments"] > 0
    assert record["optimizer_state_bytes"] == record["predicted_optimizer_state_bytes"]
    assert record["peak_tensor_bytes"] == record["predicted_peak_tensor_bytes"]


def test_lora_on_the_embeddings_with_rslora_is_predicted_to_the_byte(tmp_path):
    """target_modules naming embed_tokens: PEFT's LoRA embedding (its A and B as parameters of the
    embedding's own); use_rslora changes the adapters' scale, not what a step holds."""
    pytest.importorskip("peft")
    path = tmp_path / "adapter_config.json"
    path.write_text(
        '{"peft_type": "LORA", "r": 4, "target_modules": ["embed_tokens", "q_proj"], '
        '"use_rslora": true}'
    )
    run = spec("hf:suites/configs/tiny-llama", (tech("lora", config=str(path)),), seq_len=16)
    trainer = assert_predicted_exactly(run)
    embedding = trainer.model.get_submodule("base_model.model.model.embed_tokens")
    assert {n for n, p in embedding.named_parameters() if p.requires_grad} == {
        "lora_embedding_A.default",
        "lora_embedding_B.default",
    }


@pytest.mark.parametrize(
    "options",
    [
        {},  # BitsAndBytesConfig's defaults: FP4, float32 compute, scales in float32
        {"quant_type": "nf4", "double_quant": True, "compute_dtype": "bfloat16"},  # QLoRA's
        {"quant_type": "nf4", "storage": "bfloat16", "prepare": False},
    ],
    ids=["defaults", "qlora", "bf16-storage"],
)
def test_bnb_4bit_linears_with_lora_are_predicted_to_the_byte(options):
    """bitsandbytes' Linear4bit as transformers loads load_in_4bit, every linear but the head; the
    tracked run and the prediction count each weight's quantization state with the parameters."""
    run = spec(
        "hf:suites/configs/tiny-llama",
        (tech("bnb-4bit", **options), tech("lora")),
        batch_size=4,
        seq_len=32,
    )
    trainer = assert_predicted_exactly(run)
    assert trainer.proof()["bnb-4bit.bnb_4bit_linears"] == 14  # 7 in each of 2 layers
    assert type(trainer.model.base_model.model.lm_head) is torch.nn.Linear  # the head stays
    dtypes = {p.dtype for p in trainer.model.parameters()}
    if options.get("prepare", True):  # peft's casts: the bf16 config's norms, embeddings and head
        assert dtypes == {torch.float32, torch.uint8}
    else:
        assert dtypes == {torch.float32, torch.bfloat16}  # the adapters; all else in bf16


def test_bnb_4bit_counts_each_weights_quantization_state_as_parameter_bytes():
    """A 256 × 512 NF4 weight double-quantized: 65,536 packed bytes, 2,048 8-bit scales, their 8
    float32 scales, the 256-value code book they were quantized with, NF4's 16-value code book and
    the scales' float32 offset, each a storage of its own."""
    import bitsandbytes as bnb

    from bench.measure.memory import parameter_tensors
    from bench.techniques.lowbit import Bnb4bit, _to_4bit

    holder = torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False))
    config = Bnb4bit.Config(quant_type="nf4", double_quant=True, compute_dtype="bfloat16")
    _to_4bit(holder, "0", holder[0], config)
    assert isinstance(holder[0], bnb.nn.Linear4bit)
    assert tensor_bytes(parameter_tensors(holder)) == 65_536 + 2_048 + 8 * 4 + 256 * 4 + 16 * 4 + 4


@pytest.mark.parametrize("rows, dequantized", [(1024, False), (2048, True)])
def test_a_4bit_matmul_as_cuda_runs_it_dequantizes_its_weight_past_1536_rows(rows, dequantized):
    """Past 1,536 rows bitsandbytes' CUDA kernel dequantizes the weight to the input's dtype (and,
    double-quantized, the scales to float32 twice) and calls F.linear: the prediction counts those
    temporaries, which the fake kernel does not show; below, its fused kernel makes the output
    alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bench.measure.memory import parameter_tensors
    from bench.measure.tracker import LiveBytes
    from bench.predict.stand_ins import techniques_as_real
    from bench.techniques.lowbit import Bnb4bit, _to_4bit

    config = Bnb4bit.Config(quant_type="nf4", double_quant=True, compute_dtype="bfloat16")
    bnb = Bnb4bit(config)
    with FakeTensorMode(allow_non_fake_inputs=True), techniques_as_real([bnb], cuda=True):
        holder = torch.nn.Sequential(torch.nn.Linear(4096, 1024, bias=False))
        _to_4bit(holder, "0", holder[0], config)
        x = torch.empty(rows, 4096, dtype=torch.bfloat16)
        tracker = LiveBytes(CPU)
        held = parameter_tensors(holder)
        tracker.add(held, "parameters")
        with tracker:
            holder(x)
    assert tracker.peak - tensor_bytes(held) == output_and(rows, dequantized)


def output_and(rows, dequantized):
    output = rows * 1024 * 2
    weight, scales = 1024 * 4096 * 2, 1024 * 4096 // 64 * 4
    return output + dequantized * (weight + 2 * scales)


@pytest.mark.cuda
@pytest.mark.parametrize("seq_len", [64, 512], ids=["fused", "dequantized"])
def test_bnb_4bit_with_lora_on_cuda_is_predicted_to_the_byte(seq_len):
    """On a card, each 4-bit linear runs bitsandbytes' CUDA kernel: past 1,536 rows (8 × 512) its
    weight dequantized for F.linear, below its fused kernel; the prediction models both."""
    pytest.importorskip("bitsandbytes")
    options = {"quant_type": "nf4", "double_quant": True, "compute_dtype": "bfloat16"}
    run = spec(
        "hf:suites/configs/tiny-llama",
        (tech("bnb-4bit", **options), tech("lora")),
        batch_size=8,
        seq_len=seq_len,
    )
    record = isolated(run, Device("cuda", torch.cuda.get_device_name(0)))
    assert record["status"] == "ok", record
    assert record["param_bytes"] == record["predicted_param_bytes"]
    assert record["peak_tensor_bytes"] == record["predicted_peak_tensor_bytes"]


@pytest.mark.parametrize(
    "options",
    [{}, {"threshold": 0.0}, {"prepare": False}],
    ids=["defaults", "no-outlier-threshold", "unprepared"],
)
def test_bnb_8bit_linears_with_lora_are_predicted_to_the_byte(options):
    """bitsandbytes' Linear8bitLt as transformers loads load_in_8bit, every linear but the head:
    the tracked run (bitsandbytes' CPU path, the weight dequantized for each matmul) and the
    prediction count each weight's int8 rows and its absmax a row with the parameters."""
    pytest.importorskip("bitsandbytes")
    run = spec(
        "hf:suites/configs/tiny-llama",
        (tech("bnb-8bit", **options), tech("lora")),
        batch_size=4,
        seq_len=32,
    )
    trainer = assert_predicted_exactly(run)
    assert trainer.proof()["bnb-8bit.bnb_8bit_linears"] == 14  # 7 in each of 2 layers
    assert type(trainer.model.base_model.model.lm_head) is torch.nn.Linear  # the head stays
    dtypes = {p.dtype for p in trainer.model.parameters()}
    if options.get("prepare", True):
        assert dtypes == {torch.float32, torch.int8}
    else:
        assert dtypes == {torch.float32, torch.bfloat16, torch.int8}


def test_bnb_8bit_counts_each_weights_absmax_a_row_as_parameter_bytes():
    """A 256 × 512 weight in 8 bits: 131,072 int8 values and 512 float32 absmaxes, one a row,
    before its first forward (on the weight) and after it (on the layer's state)."""
    import bitsandbytes as bnb

    from bench.measure.memory import parameter_tensors
    from bench.techniques.lowbit import Bnb8bit, _to_8bit

    holder = torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False))
    _to_8bit(holder, "0", holder[0], Bnb8bit.Config())
    assert isinstance(holder[0], bnb.nn.Linear8bitLt)
    assert tensor_bytes(parameter_tensors(holder)) == 131_072 + 512 * 4
    holder.eval()(torch.randn(3, 256))
    assert holder[0].weight.SCB is None and holder[0].state.SCB is not None
    assert tensor_bytes(parameter_tensors(holder)) == 131_072 + 512 * 4


@pytest.mark.parametrize("threshold", [6.0, 0.0])
def test_an_8bit_matmul_as_cuda_runs_it_makes_its_kernels_tensors(threshold):
    """On CUDA, bitsandbytes' MatMul8bitLt copies a bf16 input to float16, makes its int8 rows and
    a float32 absmax a row and, past an outlier threshold, the input's absolute values and their
    mask; then the int32 product, its float16 dequantization and the cast back: 6 bytes per input
    value at once with a threshold (the copy, the rows, the absolute values, the mask), else the
    rows and the product's 8 bytes per output value. The fake kernels show their outputs alone."""
    pytest.importorskip("bitsandbytes")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bench.measure.memory import parameter_tensors
    from bench.measure.tracker import LiveBytes
    from bench.predict.stand_ins import techniques_as_real
    from bench.techniques.lowbit import Bnb8bit, _to_8bit

    config = Bnb8bit.Config(threshold=threshold)
    rows, inputs, outputs = 64, 4096, 2048
    with (
        FakeTensorMode(allow_non_fake_inputs=True),
        techniques_as_real([Bnb8bit(config)], cuda=True),
    ):
        holder = torch.nn.Sequential(torch.nn.Linear(inputs, outputs, bias=False)).eval()
        _to_8bit(holder, "0", holder[0], config)
        x = torch.empty(rows, inputs, dtype=torch.bfloat16)
        tracker = LiveBytes(CPU)
        held = parameter_tensors(holder)
        tracker.add(held, "parameters")
        with tracker:
            holder(x)
    at_once = (6 if threshold else 1) * rows * inputs
    if not threshold:
        at_once += 8 * rows * outputs
    assert tracker.peak - tensor_bytes(held) == at_once + 4 * rows  # and the absmaxes


@pytest.mark.cuda
@pytest.mark.parametrize("threshold", [6.0, 0.0])
def test_bnb_8bit_with_lora_on_cuda_is_predicted_to_the_byte(threshold):
    """On a card, each 8-bit linear runs bitsandbytes' CUDA kernels (MatMul8bitLt); random inputs
    past a threshold of 6 are as rare as the prediction assumes them absent."""
    pytest.importorskip("bitsandbytes")
    run = spec(
        "hf:suites/configs/tiny-llama",
        (tech("bnb-8bit", threshold=threshold), tech("lora")),
        batch_size=8,
        seq_len=64,
    )
    record = isolated(run, Device("cuda", torch.cuda.get_device_name(0)))
    assert record["status"] == "ok", record
    assert record["param_bytes"] == record["predicted_param_bytes"]
    assert record["peak_tensor_bytes"] == record["predicted_peak_tensor_bytes"]


def test_a_4bit_model_prepared_without_adapters_is_unsupported_as_the_trainer_refuses_it():
    """peft's k-bit preparation freezes every parameter: with no adapters nothing would learn."""
    run = spec("hf:suites/configs/tiny-llama", (tech("bnb-4bit"),), batch_size=4, seq_len=32)
    out = predict(run, run.cpu, cuda=False)
    assert out.status == "unsupported"
    assert out.message == (
        "nothing in the model trains once its techniques are applied: add adapters (lora)"
    )


@pytest.mark.parametrize("bits", [32, 8])
def test_lion_keeps_one_moment_and_is_predicted_to_the_byte(bits):
    """bitsandbytes' Lion (the Trainer's lion_32bit, lion_8bit): one moment per parameter, float32
    or blockwise 8-bit from 4,096 elements (a float32 absmax per 256 values, one code book shared),
    tracked and predicted alike on the CPU."""
    pytest.importorskip("bitsandbytes")
    run = spec("llama-tiny", (tech("lion", bits=bits),), batch_size=4, seq_len=16)
    trainer = assert_predicted_exactly(run)
    sizes = [p.numel() for p in trainer.model.parameters()]
    proof = trainer.techniques[0].proof(1)
    moment = sum(4 * n if bits == 32 or n < 4096 else n for n in sizes)
    assert proof["moments"] == len(sizes) and proof["moment_bytes"] == moment
    quantized = [n for n in sizes if bits == 8 and n >= 4096]
    codes = sum(4 * math.ceil(n / 256) for n in quantized) + (4 * 256 if quantized else 0)
    state = model_state_bytes(trainer.model, trainer.optimizer).optimizer_state_bytes
    assert state == moment + codes


@pytest.mark.parametrize("bits", [32, 8])
def test_ademamix_keeps_two_first_moments_and_a_second_and_is_predicted_to_the_byte(bits):
    """bitsandbytes' AdEMAMix (the Trainer's ademamix, ademamix_8bit): the fast and slow first
    moments in one buffer twice the parameter's size, and the second moment; 8-bit from 4,096
    elements with an absmax per 256 values for each of the three, and two code books (signed for
    the first moments, unsigned for the second)."""
    pytest.importorskip("bitsandbytes")
    run = spec("llama-tiny", (tech("ademamix", bits=bits),), batch_size=4, seq_len=16)
    trainer = assert_predicted_exactly(run)
    sizes = [p.numel() for p in trainer.model.parameters()]
    proof = trainer.techniques[0].proof(1)
    moments = sum(3 * (4 * n if bits == 32 or n < 4096 else n) for n in sizes)
    assert proof["moments"] == 2 * len(sizes) and proof["moment_bytes"] == moments
    quantized = [n for n in sizes if bits == 8 and n >= 4096]
    codes = sum(3 * 4 * math.ceil(n / 256) for n in quantized) + (2 * 4 * 256 if quantized else 0)
    state = model_state_bytes(trainer.model, trainer.optimizer).optimizer_state_bytes
    assert state == moments + codes


@pytest.mark.parametrize("bits", [32, 8])
def test_bitsandbytes_rmsprop_keeps_its_square_average_and_is_predicted_to_the_byte(bits):
    """bitsandbytes' RMSprop (the Trainer's rmsprop_bnb, rmsprop_bnb_8bit): the square average
    alone, float32 or blockwise 8-bit from 4,096 elements."""
    pytest.importorskip("bitsandbytes")
    run = spec("llama-tiny", (tech("rmsprop-bnb", bits=bits),), batch_size=4, seq_len=16)
    trainer = assert_predicted_exactly(run)
    sizes = [p.numel() for p in trainer.model.parameters()]
    moment = sum(4 * n if bits == 32 or n < 4096 else n for n in sizes)
    assert trainer.techniques[0].proof(1)["moment_bytes"] == moment
    quantized = [n for n in sizes if bits == 8 and n >= 4096]
    codes = sum(4 * math.ceil(n / 256) for n in quantized) + (4 * 256 if quantized else 0)
    state = model_state_bytes(trainer.model, trainer.optimizer).optimizer_state_bytes
    assert state == moment + codes


def test_paged_ademamix_keeps_its_large_double_buffer_out_of_the_allocator():
    """Paged (the Trainer's paged_ademamix_32bit), each buffer of a parameter of 100,000 elements
    or more is unified memory: the first moments' double buffer too, bitsandbytes' own path."""
    pytest.importorskip("bitsandbytes")
    run = spec("llama-tiny", (tech("ademamix", paged=True),), batch_size=4, seq_len=16)
    assert predict(run, run.cpu, cuda=False).status == "unsupported"
    out = predict(run, run.cpu, cuda=True)
    sizes = [p.numel() for p in build_model(MODELS.get("llama-tiny"), run.cpu)[0].parameters()]
    assert out.ok and out.paged_bytes == sum(12 * n for n in sizes if n >= 100_000)
    small = sum(_rounded(8 * n) + _rounded(4 * n) for n in sizes if n < 100_000)
    assert out.at_peak_optimizer_state_bytes == small


def test_paged_lion_is_a_cuda_technique_whose_large_moments_the_allocator_never_holds():
    pytest.importorskip("bitsandbytes")
    run = spec("llama-tiny", (tech("lion", paged=True),), batch_size=4, seq_len=16)
    out = predict(run, run.cpu, cuda=False)
    assert out.status == "unsupported" and "unified memory" in out.message
    out = predict(run, run.cpu, cuda=True)
    sizes = [p.numel() for p in build_model(MODELS.get("llama-tiny"), run.cpu)[0].parameters()]
    assert out.ok and out.paged_bytes == sum(4 * n for n in sizes if n >= 100_000)
    assert out.at_peak_optimizer_state_bytes == sum(_rounded(4 * n) for n in sizes if n < 100_000)


@pytest.mark.cuda
def test_paged_ademamix_8bit_on_cuda_holds_its_predicted_state():
    """Its double buffer paged by bitsandbytes' own path (``_get_state_double_buffer``), not the
    one the other paged optimizers share: the allocator holds what the prediction says it does."""
    pytest.importorskip("bitsandbytes")
    record = isolated(
        spec("llama-tiny", (tech("ademamix", bits=8, paged=True),), batch_size=8, seq_len=64),
        Device("cuda", torch.cuda.get_device_name(0)),
    )
    assert record["status"] == "ok", record
    assert record["optimizer_state_bytes"] == record["predicted_optimizer_state_bytes"]
    assert record["peak_tensor_bytes"] == record["predicted_peak_tensor_bytes"]


@pytest.mark.cuda
def test_lion_8bit_on_cuda_holds_its_predicted_state():
    pytest.importorskip("bitsandbytes")
    record = isolated(
        spec("llama-tiny", (tech("lion", bits=8),), batch_size=8, seq_len=64),
        Device("cuda", torch.cuda.get_device_name(0)),
    )
    assert record["status"] == "ok", record
    assert record["optimizer_state_bytes"] == record["predicted_optimizer_state_bytes"]
    assert record["peak_tensor_bytes"] == record["predicted_peak_tensor_bytes"]
