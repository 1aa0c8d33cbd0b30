import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.flop_counter import FlopCounterMode

from bench.data.synthetic import clone_batch
from bench.generate import Generator
from bench.infer import Inferencer
from bench.measure.host import making_host
from bench.measure.memory import tracked_step
from bench.measure.tracker import LiveBytes
from bench.predict import predict
from bench.predict.cards import CARDS
from bench.predict.fake import StepCounter
from bench.predict.stand_ins import masks_as_real
from bench.suite import load, select
from bench.techniques.lowbit import FP8Training
from bench.techniques.offload import ActivationOffload
from bench.train import Trainer
from tests.conftest import CPU, build_trainer
from tests.helpers import generation, spec, tech


@pytest.mark.parametrize(
    "model, techniques",
    [
        ("vit-tiny", ()),
        ("vit-tiny", (tech("checkpoint"),)),
        # transformers skips the attention mask of an unpadded batch, fake or real
        (
            "bert-tiny",
            (),
        ),
        ("vit-tiny", (tech("amp", dtype="bfloat16"), tech("accumulate", micro_batches=2))),
        ("resnet-tiny", (tech("optimizer", kind="sgd"),)),
        # fake tensors cannot be swapped: it converts in place
        (
            "resnet-tiny",
            (tech("channels-last"),),
        ),
        ("vit-tiny", (tech("bf16"),)),
        # reads norms with .item(): they read as 1
        (
            "vit-tiny",
            (tech("optimizer", kind="adafactor"),),
        ),
        # temporaries over all parameters
        (
            "vit-tiny",
            (tech("optimizer", kind="adamw", impl="foreach"),),
        ),
        # peft casts its adapters with .to(): set in place, as on real tensors
        (
            "bert-tiny",
            (tech("lora"),),
        ),
        ("vit-tiny", (tech("lora"),)),
        # a language model: logits for every position, scored on the next token
        (
            "tests.helpers:TINY_LM",
            (),
        ),
        ("tests.helpers:TINY_LM", (tech("checkpoint"),)),
        # batch norm's statistics in the weight's dtype, float32
        ("resnet-tiny", (tech("amp", dtype="bfloat16"),)),
    ],
)
def test_fake_tensor_prediction_equals_the_real_tracked_step_on_cpu(model, techniques):
    assert_predicted_exactly(spec(model, techniques, batch_size=16))


# 50 s, torchao's compile; make test holds adamw-8bit's tracked state byte for byte
@pytest.mark.full
def test_adamw_8bit_predicts_exactly_with_its_compiled_update_run_eager_on_fake_tensors():
    """torchao compiles the update, which fake tensors cannot enter: they run it eager, and the
    tracker steps aside for it on both sides, so the 8-bit state is counted to the byte."""
    pytest.importorskip("torchao")
    assert_predicted_exactly(spec("vit-tiny", (tech("adamw-8bit"),), batch_size=16))


# 70 s: every combination of the shipped suites, trained twice in processes of its own
@pytest.mark.full
def test_predictions_leave_nothing_behind_that_changes_the_real_runs_after_them():
    """A worker predicts, then measures and trains, in one process. Every technique combination of
    the shipped suites, all predicted before any runs for real, must then train to the losses of a
    process that predicted nothing: torchao once cached its 8-bit code books from fake values (read
    as 1), and every real 8-bit update after a prediction went wrong (ResNet-50's fidelity run: 96%
    → 8%). The two processes run side by side."""
    fresh, after = (_result(p) for p in [_probe(*args) for args in ((), ("predict-first",))])
    # every family's baseline and the suites' combinations that run on a CPU
    assert len(fresh) > 30, fresh
    assert {k: v for k, v in after.items() if v != fresh.get(k)} == {}


def _probe(*args: str) -> subprocess.Popen:
    root = Path(__file__).resolve().parents[2]
    # A thread each: the two side by side would otherwise each take a thread per core and contend
    # for them.
    env = os.environ | {"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.predict.trace_probe", *args],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(probe: subprocess.Popen) -> dict[str, list[float]]:
    out, err = probe.communicate(timeout=600)
    assert probe.returncode == 0, err[-3000:]
    return json.loads(out.splitlines()[-1])


def test_inference_mode_predicts_exactly_though_its_reads_come_undecomposed():
    """Under inference_mode, transformers' padding check (bool of a tensor) reaches the fake mode as
    is_nonzero, not as the value read it decomposes into elsewhere."""
    assert_predicted_exactly(
        spec("bert-tiny", (tech("inference-mode"),), batch_size=16, mode="inference")
    )


@pytest.mark.parametrize(
    "techniques",
    [(tech("fp8"),), (tech("fp8"), tech("amp", dtype="bfloat16")), (tech("fp8"), tech("bf16"))],
)
def test_fp8_predicts_exactly_what_its_real_kernels_keep_on_this_cpu(monkeypatch, techniques):
    """torchao's float8 linears run on a CPU too (torch has a CPU ``_scaled_mm``). The harness
    refuses an FP8 run there only because FP8 is a matter of GPU speed, so the test lets one through
    to hold the fake step against the real one: the casts' temporaries, the float8 copies and the
    saved inputs, byte for byte."""
    pytest.importorskip("torchao")
    monkeypatch.setattr(FP8Training, "unsupported", lambda self, ctx: None)
    trainer = assert_predicted_exactly(spec("vit-tiny", techniques, batch_size=16))
    # attention out and two MLP linears a block; the head's 10
    assert trainer.proof()["fp8.float8_linears"] == 6


class HostOutOfSight(torch.autograd.graph.saved_tensors_hooks):
    """save_on_cpu between this CPU and a host of its own: the copy out is made into storage the
    tracker counts as the host's (bench.measure.host.making_host), pinned as asked, and filled with
    dispatch modes off; the copy back is counted on the device, as the device copy save_on_cpu's
    unpack makes."""

    def __init__(self, pin_memory: bool) -> None:
        def pack(t: torch.Tensor) -> torch.Tensor:
            with making_host(pin_memory):
                host = torch.empty(t.shape, dtype=t.dtype)
            with _disable_current_modes():
                return host.copy_(t.detach())

        super().__init__(pack, torch.clone)


@pytest.mark.parametrize(
    "model, techniques, batch_size",
    [
        ("vit-tiny", (), 16),
        ("bert-tiny", (), 16),
        ("resnet-tiny", (), 4),
        # autocast's cached weight casts stay on the device
        (
            "vit-tiny",
            (tech("amp", dtype="bfloat16"),),
            16,
        ),
        # only the blocks' inputs are saved, and so offloaded
        (
            "vit-tiny",
            (tech("checkpoint"),),
            16,
        ),
    ],
)
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_offload_predicts_what_a_real_step_keeps_when_its_saved_tensors_leave_the_device(
    monkeypatch, model, techniques, batch_size, pinned
):
    """A CPU has no host apart from its device, so the real step here offloads to one of its own
    (HostOutOfSight); the fake step must count the same bytes on each: on the device the copies
    that backward unpacks, when they are made and freed, and on the host each saved tensor's copy,
    its pinned blocks as the caching host allocator holds them."""
    # refused on a CPU run
    monkeypatch.setattr(ActivationOffload, "unsupported", lambda self, ctx: None)
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", HostOutOfSight)
    trainer = assert_predicted_exactly(
        spec(model, (tech("offload", pin_memory=pinned), *techniques), batch_size=batch_size)
    )
    assert trainer.proof()["offload.tensors_offloaded_per_step"] > 0


def assert_predicted_exactly(run) -> Trainer | Inferencer | Generator:
    trainer, batch = build_trainer(run)
    trainer.step(batch)
    real = tracked_step(
        lambda: trainer.step(clone_batch(batch)),
        trainer.model,
        trainer.optimizer,
        CPU,
        compiled_update=any(t.compiled_update for t in trainer.techniques),
        phases=trainer if isinstance(trainer, Generator) else None,
    ).flat()
    fake = predict(run, run.cpu, cuda=False)
    assert fake.status == "ok", fake
    at_peak = [k for k in real if k.startswith("at_peak_")]
    for key in (
        "peak_tensor_bytes",
        "activation_bytes",
        "param_bytes",
        "optimizer_state_bytes",
        "peak_phase",
        "peak_prefill_bytes",
        "peak_decode_bytes",
        "kv_cache_bytes",
        "host_peak_bytes",
        "host_pinned_bytes",
        *at_peak,
    ):
        assert getattr(fake, key) == real.get(key), key
    return trainer


GENERATION = load(Path(__file__).resolve().parents[2] / "suites" / "llama-generate.toml")


@pytest.mark.parametrize("run", GENERATION.runs, ids=lambda r: r.name)
def test_every_generation_entry_is_predicted_exactly_in_each_phase_or_says_why_not(run):
    """llama-generate's entries on this CPU: the peak of the prefill and of the decoding, and the
    cache's bytes, predicted to the byte; an entry that cannot run or be predicted here says why."""
    made = predict(run, run.cpu, cuda=False)
    if made.status != "ok":
        assert made.status in ("unsupported", "unpredictable")
        assert made.message.split(":")[0] in ("kv-cache", "int4-weights"), made.message
        return
    generator = assert_predicted_exactly(run)
    assert generator.generated == run.cpu.new_tokens


LLAMA, MISTRAL = "llama-tiny", "hf:suites/configs/tiny-mistral"
DECODES = [
    pytest.param((), LLAMA, True, id="dynamic-cache"),
    pytest.param((tech("kv-cache", kind="static"),), LLAMA, True, id="static-cache"),
    pytest.param(
        (tech("half", dtype="bfloat16"), tech("chunked-prefill", chunk=16)),
        LLAMA,
        True,
        id="chunked",
    ),
    pytest.param(
        (tech("half", dtype="bfloat16"), tech("kv-cache", kind="quantized", backend="fp8")),
        LLAMA,
        True,
        id="fp8-cache",
    ),
    # tiny-mistral's window of 32 tokens fills while it decodes: from there its cache stops growing
    pytest.param((), MISTRAL, False, id="sliding-window"),
]


@pytest.mark.parametrize("techniques, model, grown", DECODES)
def test_a_generations_decode_forwards_past_the_fourth_are_grown_from_the_last_three(
    monkeypatch, techniques, model, grown
):
    """Every figure to the byte, the allocator's on a card and the FLOPs too: the decode forwards
    past the fourth grow as the last three traced did (bench.predict.fake._untraced_decodes); a
    cache whose forwards do not all do the same (a sliding window stops growing once full) is
    traced whole."""
    from bench.measure.tracker import NotRepeating
    from bench.predict import fake

    run = replace(generation(techniques, batch_size=2, prompt_len=24, new_tokens=16), model=model)
    folds = []
    original = fake._grown_cache

    def spied(runner, untraced):
        try:
            out = original(runner, untraced)
        except NotRepeating:
            folds.append(False)
            raise
        folds.append(True)
        return out

    monkeypatch.setattr(fake, "_grown_cache", spied)
    folded = predict(run, card=CARDS["t4"])
    monkeypatch.setattr(fake, "_untraced_decodes", lambda ctx: 0)
    assert folded == predict(run, card=CARDS["t4"]) and folded.status == "ok"
    assert folds and all(folds) == grown


def test_generation_is_predicted_exactly_with_a_chunked_prompt_and_at_gpu_shapes_by_phase():
    chunked = assert_predicted_exactly(
        generation((tech("chunked-prefill", chunk=8),), prompt_len=20)
    )
    assert chunked.forwards == {"prefill": 3, "decode": 3}
    on_gpu = predict(generation(batch_size=4, prompt_len=128, new_tokens=3))
    assert on_gpu.peak_prefill_bytes > on_gpu.peak_decode_bytes > on_gpu.kv_cache_bytes > 0
    assert on_gpu.peak_tensor_bytes == on_gpu.peak_prefill_bytes and on_gpu.peak_reserved_bytes


@pytest.mark.parametrize("left", [False, True], ids=["read-off", "left-behind"])
def test_a_generations_warm_up_is_read_off_the_measured_one_where_it_leaves_nothing(
    left, monkeypatch
):
    """The worker's warm-up generation makes what the measured one makes, the batch aside (made
    before it, kept after it): the prediction reads it off the measured one instead of running it
    (one generate() a trace, not two), and replays the same requests through the allocator but
    the batch's. Where a generation leaves a storage alive, its warm-up runs, as before."""
    from bench.predict import fake

    run = generation((tech("half", dtype="bfloat16"),), batch_size=4, prompt_len=128, new_tokens=3)
    steps = []
    monkeypatch.setattr(Generator, "step", _counted(Generator.step, steps))
    if left:
        monkeypatch.setattr(fake, "_warm_up", _leaves_behind)
    read_off = fake.traced(run)
    assert len(steps) == 1 + left * 2  # a measured generation alone; else again, after its warm-up
    monkeypatch.setattr(fake, "_fake_step", _with_warm_up(fake._fake_step))
    ran = fake.traced(run)
    batch = 4 * 128 * 8 * 2  # input_ids and attention_mask, int64
    tensor = batch // 2
    assert _requests(read_off.tracker._history, tensor) == _requests(ran.tracker._history, tensor)
    theirs, ours = ran.prediction, read_off.prediction
    assert ours.peak_reserved_bytes == theirs.peak_reserved_bytes
    assert 0 <= ours.peak_allocated_bytes - theirs.peak_allocated_bytes <= batch
    assert ours.peak_tensor_bytes == theirs.peak_tensor_bytes


def _counted(step, calls):
    def counted(self, *args, **kwargs):
        calls.append(1)
        return step(self, *args, **kwargs)

    return counted


def _leaves_behind(tracker, batch):
    from bench.predict.fake import LeftBehind

    raise LeftBehind


def _with_warm_up(fake_step):
    def stepped(*args, **kwargs):
        return fake_step(*args, **kwargs, warm_up=True)

    return stepped


def _requests(history, tensor):
    """The sizes a tracker allocates, in order, the batch's tensors' aside: the traced warm-up
    counts the batch it was handed where it first sees a view of it, the read-off one before it
    begins."""
    return [n for n, *_ in history._lives if n != tensor]


@pytest.mark.parametrize(
    "run",
    [generation(prompt_len=64), spec("bert-tiny", mode="inference")],
    ids=["generate", "inference"],
)
def test_a_serving_steps_counts_are_the_measured_steps_with_or_without_the_allocators_history(run):
    """The step before the measured one is the allocator's history, traced, or a warm-up: the
    measured step counts the same FLOPs, operators and peak after either."""
    warmed, traced = predict(run, reserved=False), predict(run)
    for key in ("flops_per_step", "ops_per_step", "op_bytes_per_step", "peak_tensor_bytes"):
        assert getattr(traced, key) == getattr(warmed, key), key
    assert traced.peak_reserved_bytes and warmed.peak_reserved_bytes is None


def test_techniques_that_cannot_be_predicted_say_why():
    out = predict(spec("vit-tiny", (tech("jit-trace"),), mode="inference"))
    assert out.status == "unpredictable" and out.message.startswith("jit-trace"), out


@pytest.mark.parametrize("mode", ["train", "inference"])
def test_a_compiled_run_is_predicted_as_its_eager_step_and_says_so(mode):
    """Fake tensors cannot enter dynamo: compile's prediction is the eager step's, every figure the
    same as without it, labelled as such beside them (the Trainer's torch_compile had no figure)."""
    compiled = predict(spec("vit-tiny", (tech("compile"),), mode=mode))
    eager = predict(spec("vit-tiny", mode=mode))
    assert compiled.status == "ok" and compiled.message.startswith("compile: the eager step's")
    assert replace(compiled, message=None) == eager


@pytest.mark.full
@pytest.mark.slow
def test_full_size_models_predict_at_gpu_shapes():
    for name in ("resnet", "bert", "vit"):  # how fast: make perf (tests/perf/test_predict.py)
        for run in select(load(f"suites/{name}.toml"), ["baseline", "checkpoint"]).runs:
            out = predict(run)
            assert out.status == "ok" and out.peak_tensor_bytes > 2**30, (name, out)


def test_a_model_that_computes_its_shape_from_tensor_values_is_predicted_exactly():
    # torchvision's RegNet calls .tolist() on its block widths while it is built, which no meta
    # tensor allows
    run = spec("tests.helpers:REGNET", batch_size=2, image_size=32)
    trainer, batch = build_trainer(run)
    trainer.step(batch)
    measured = tracked_step(
        lambda: trainer.step(clone_batch(batch)), trainer.model, trainer.optimizer, CPU
    )
    assert predict(run, run.cpu, cuda=False).peak_tensor_bytes == measured.peak_tensor_bytes


def test_a_transformers_without_the_fake_tensor_check_is_left_as_it_is(monkeypatch):
    import transformers.utils.import_utils as utils

    monkeypatch.delattr(utils, "is_fake_tensor")
    with masks_as_real():  # the GPU host's older transformers: nothing to patch, nothing raised
        assert not hasattr(utils, "is_fake_tensor")


def test_flash_attention_over_grouped_keys_counts_every_query_head():
    """Two key/value heads serving eight query heads: forward's two s×s products and backward's five
    (the scores recomputed, then four gradients) per query head, 2·s·s·d FLOPs each. torch 2.11's
    own formula refuses the shapes."""
    b, h_q, h_kv, s, d = 2, 8, 2, 64, 32
    with FakeTensorMode(), StepCounter() as flops:
        q = torch.empty(b, h_q, s, d, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.empty(b, h_kv, s, d, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[0]
        out.backward(torch.ones_like(out))
    assert k.grad.shape == k.shape
    assert flops.flops == (2 + 5) * 2 * b * h_q * s * s * d


@pytest.mark.parametrize(
    "run",
    [
        spec("resnet-tiny", (tech("amp", dtype="bfloat16"),)),  # batch norm: decomposed there
        spec("llama-tiny", (tech("checkpoint"),)),  # SiLU's backward: decomposed there
        spec("bert-tiny", (tech("accumulate", micro_batches=2),)),
    ],
    ids=["resnet-amp", "llama-checkpoint", "bert-accumulate"],
)
def test_a_predictions_counts_are_those_counted_on_a_real_step(run):
    """The prediction's counter runs each operator as it comes where torch's FlopCounterMode
    decomposes some (changing what backward keeps): the FLOPs are the same, counted on a warm step
    of the real run, and so are its operators and their bytes."""
    trainer, batch = build_trainer(run)
    trainer.step(clone_batch(batch))
    with FlopCounterMode(display=False) as torchs:
        trainer.step(clone_batch(batch))
    counted_batch = clone_batch(batch)  # its copies are no part of the step
    with StepCounter() as ours:
        trainer.step(counted_batch)
    assert ours.flops == torchs.get_total_flops() > 0
    predicted = predict(run, cuda=False)
    assert predicted.flops_per_step == ours.flops
    # a fake tensor's device is asked of the modes (autograd reads it thousands of times a step),
    # a real one's is not: it is no operator, and the counts are the real step's
    counted = (predicted.ops_per_step, predicted.op_bytes_per_step)
    assert counted == (ours.ops, ours.bytes), (counted, ours.totals())


def test_a_technique_declares_a_stand_in_for_a_library_call_that_fake_tensors_cannot_run():
    """``Technique.stand_ins``: a user's optimizer that reads the weights' values is unpredictable
    until its technique names a stand-in; with it, the prediction equals the real run's tracked
    figures."""
    undeclared = predict(spec("vit-tiny", (tech("tests.helpers:ScaledSGDUndeclared"),)), cuda=False)
    assert undeclared.status == "unpredictable", undeclared
    assert_predicted_exactly(spec("vit-tiny", (tech("tests.helpers:ScaledSGD"),), batch_size=16))


def test_bitsandbytes_8bit_adamw_stepped_in_backward_is_predicted_exactly():
    pytest.importorskip("bitsandbytes")
    techniques = (tech("optimizer-in-backward", optimizer="adamw-8bit"),)
    trainer = assert_predicted_exactly(spec("llama-tiny", techniques, batch_size=4, seq_len=32))
    assert trainer.proof()["optimizer-in-backward.parameters_stepped_in_backward"] > 0


FULL = pytest.mark.full  # more of the same: make test-full
FOLDED_ACCUMULATION = [
    ("bert-tiny", (tech("accumulate", micro_batches=8),), None),
    pytest.param(
        "llama-tiny", (tech("accumulate", micro_batches=8), tech("lora")), "t4", marks=FULL
    ),
    # memory that grows with every micro-batch: traced whole, as it must be
    ("vit-tiny", (tech("accumulate", micro_batches=8), tech("tests.helpers:KeepsEveryLoss")), None),
    pytest.param(
        "bert-tiny", (tech("accumulate", micro_batches=16), tech("checkpoint")), "t4", marks=FULL
    ),
    pytest.param(
        "resnet-tiny",
        (tech("accumulate", micro_batches=8), tech("amp", dtype="bfloat16")),
        "t4",
        marks=FULL,
    ),
    pytest.param(
        "vit-tiny", (tech("accumulate", micro_batches=8), tech("offload")), None, marks=FULL
    ),
]


@pytest.mark.parametrize("model, techniques, card", FOLDED_ACCUMULATION)
def test_accumulation_traced_four_micro_batches_deep_is_predicted_as_traced_whole(
    monkeypatch, model, techniques, card
):
    """Every figure, the allocator's included, to the byte: the micro-batches past the fourth
    repeat the fourth (bench.predict.fake._folded), or the step is traced whole."""
    run = spec(model, techniques, batch_size=16, image_size=32, seq_len=32)
    on = CARDS[card] if card else None
    repeats = []
    repeat = LiveBytes.repeat
    monkeypatch.setattr(
        LiveBytes,
        "repeat",
        lambda self, n, *more, **options: (
            repeats.append(ok := repeat(self, n, *more, **options)) or ok
        ),
    )
    folded = predict(run, card=on)
    monkeypatch.setattr("bench.predict.fake.TRACED_MICRO_BATCHES", 1 << 30)
    assert folded == predict(run, card=on) and folded.status == "ok"
    keeps = "tests.helpers:KeepsEveryLoss" in {t.name for t in techniques}
    assert (False in repeats) == keeps  # folded where it repeats, and only there


@pytest.mark.full
def test_a_pass_whose_worst_step_fits_alone_runs_out_after_shorter_ones_and_expandable_fits():
    """docs/examples/epoch/suite.toml, as docs/measuring.md tells it: BERT-base at batch 40 over the
    docstrings' long-tailed lengths on a T4. Its worst batch, the third of the pass, fits the card
    alone; after the two shorter steps before it, whose activations were other sizes, the
    allocator's segments hold no block for its requests and the pass runs out of memory there;
    expandable segments are predicted to hold it (about 25 s here)."""
    from bench.predict.cards import CARDS
    from bench.predict.fake import traced
    from bench.suite import load

    (run,) = load("docs/examples/epoch/suite.toml").runs
    t4 = CARDS["t4"]
    worst = traced(replace(run, gpu=replace(run.gpu, worst_step=True)), card=t4).prediction
    assert worst.verdict == "fits"
    out = traced(replace(run, gpu=replace(run.gpu, epoch=True)), card=t4).prediction
    assert (out.verdict, out.oom_step, out.epoch_steps) == ("out of memory", 3, 16)
    assert out.peak_tensor_bytes <= t4.capacity  # its tensors alone would fit
    assert out.expandable_verdict == "fits"
    # blocks of 64 MiB and more kept whole: it runs, freeing the cache on the way
    assert out.split_verdict == "fits after flushes with max_split_size_mb:64"
