import torch

from bench.launch import Device
from bench.measure.memory import tracked_step
from bench.worker import measure
from tests.conftest import CPU, build_trainer
from tests.helpers import isolated, spec, tech


def run(model, *techniques, **shape):
    trainer, batch = build_trainer(spec(model, techniques, **shape))
    trainer.step(batch)
    return tracked_step(lambda: trainer.step(batch), trainer.model, trainer.optimizer, CPU), trainer


def test_channels_last_converts_every_conv_weight_and_the_inputs():
    _, trainer = run("resnet-tiny", tech("channels-last"))
    convs = [p for p in trainer.model.parameters() if p.dim() == 4]
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in convs)
    assert (
        trainer.proof()["channels-last.conv_weights_channels_last"] == f"{len(convs)}/{len(convs)}"
    )


def test_sdpa_records_the_kernel_that_ran_and_math_holds_the_attention_matrix():
    """ViT-tiny at 128 px: 257 tokens, 2 heads, 2 layers, no attention dropout."""
    math, t_math = run("vit-tiny", tech("sdpa", backend="math"), batch_size=4, image_size=128)
    flash, t_flash = run("vit-tiny", tech("sdpa", backend="flash"), batch_size=4, image_size=128)
    assert t_flash.proof()["sdpa.kernel"] == "_scaled_dot_product_flash_attention_for_cpu"
    assert t_math.proof()["sdpa.kernel"] == "math (decomposed)"
    # math keeps softmax(QKᵀ) per head for backward: 4 × 2 heads × 257² fp32 in each of 2 layers.
    assert math.activation_bytes - flash.activation_bytes >= 2 * 4 * 2 * 257 * 257 * 4


def test_a_kernel_that_refuses_the_models_call_makes_the_run_unsupported():
    # CPU flash attention has no dropout; BERT trains with attention dropout 0.1.
    record = isolated(spec("bert-tiny", (tech("sdpa", backend="flash"),)), Device("cpu", "cpu"))
    assert record["status"] == "unsupported", record
    assert "flash attention refuses this model's attention call" in record["message"]


def test_unavailable_kernels_and_devices_are_unsupported_with_a_reason():
    # Each is decided before anything runs, so the worker's measure() is called here, not in a
    # process of its own (test_runner holds an unsupported run's record end to end).
    for technique, model, reason in [
        (tech("sdpa", backend="efficient"), "vit-tiny", "no efficient attention kernel on cpu"),
        (tech("sdpa"), "resnet-tiny", "the model has no attention"),
        (tech("channels-last"), "bert-tiny", "image models only"),
        (tech("offload"), "vit-tiny", "already live in host memory"),
        (tech("allocator"), "vit-tiny", "CUDA allocator setting"),
        (tech("empty-cache"), "vit-tiny", "nothing to empty on a CPU"),
    ]:
        outcome = measure(spec(model, (technique,)), CPU).outcome
        assert outcome.status == "unsupported" and reason in outcome.message, outcome


def test_technique_environment_reaches_the_run_process():
    record = isolated(spec("vit-tiny", (tech("tests.helpers:EnvProbe"),)), Device("cpu", "cpu"))
    assert record["proof"]["EnvProbe.seen"] == "set-by-technique"


def test_the_env_technique_sets_its_variables_for_a_fresh_run_process():
    record = isolated(
        spec("vit-tiny", (tech("env", vars="CUDA_LAUNCH_BLOCKING=1 BENCH_NOTE='two words'"),)),
        Device("cpu", "cpu"),
    )
    assert record["status"] == "ok" and record["launcher"] == "fresh"
    assert record["proof"]["env.in_process.CUDA_LAUNCH_BLOCKING"] == "1"
    assert record["proof"]["env.in_process.BENCH_NOTE"] == "two words"


def test_the_env_technique_with_only_cudas_variables_is_unsupported_on_a_cpu():
    """CUDA_LAUNCH_BLOCKING=1 alone changes nothing a CPU runs: resnet's launch-blocking measured
    its baseline again under another name, for 20 s of a first command."""
    from bench.models import MODELS
    from bench.spec import Shapes
    from bench.techniques.base import RunContext, build

    cpu = RunContext(
        device=torch.device("cpu"),
        model_spec=MODELS.get("vit-tiny"),
        shapes=Shapes(batch_size=2, image_size=32),
    )
    cuda_only = build(tech("env", vars="CUDA_LAUNCH_BLOCKING=1"))
    assert cuda_only.unsupported(cpu) == (
        "CUDA_LAUNCH_BLOCKING: read by CUDA alone; on a CPU the run would be the baseline again"
    )
    assert (
        build(tech("env", vars="CUDA_LAUNCH_BLOCKING=1 OMP_NUM_THREADS=1")).unsupported(cpu) is None
    )


def test_the_env_technique_refuses_what_is_not_a_name_value_pair(tmp_path):
    from tests.helpers import suite_problems

    text = (
        'model = "vit-tiny"\nbaseline = "b"\n[shapes.gpu]\nbatch_size = 2\nimage_size = 32\n'
        '[shapes.cpu]\nbatch_size = 2\nimage_size = 32\n[[runs]]\nname = "b"\n'
        'techniques = [{ name = "env", vars = "CUDA_LAUNCH_BLOCKING 1=x" }]\n'
    )
    (problem,) = {p.split(": env at ")[1].split(": ", 1)[1] for p in suite_problems(tmp_path, text)}
    assert problem == "vars: expected NAME=VALUE pairs, got ['CUDA_LAUNCH_BLOCKING', '1=x']"
