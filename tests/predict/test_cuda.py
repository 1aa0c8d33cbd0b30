from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench import models, results
from bench.measure import history
from bench.measure.host import on_host
from bench.measure.tracker import LiveBytes
from bench.predict import cuda, predict
from bench.suite import RunSpec, TechniqueSpec
from tests.conftest import CPU
from tests.helpers import spec, tech

RESULTS = Path(__file__).parent.parent.parent / "results"


def test_cuda_prediction_counts_in_allocator_blocks_and_counts_flops():
    run = spec("vit-tiny", batch_size=16)
    cpu, cuda = predict(run, run.cpu, cuda=False), predict(run, run.cpu, cuda=True)
    assert cuda.peak_tensor_bytes % 512 == 0
    assert cuda.peak_tensor_bytes > cpu.peak_tensor_bytes
    # Training FLOPs are about 3× the forward's (backward computes two matmuls per forward matmul).
    assert cuda.flops_per_step > 0


def cuda_prediction(model: str, *techniques: TechniqueSpec, **shapes: Any) -> dict[str, Any]:
    """A run's CUDA-modelled prediction at the shapes given (``spec``'s keywords), small enough for
    tests."""
    run = spec(model, techniques, **shapes)
    return predict(run, run.cpu, cuda=True)


def test_cuda_prediction_takes_the_optimizer_implementation_cuda_would():
    """At batch 1 the optimizer step holds the peak: the default AdamW is predicted as foreach (its
    √v for all parameters at once), as CUDA runs it, not as the single-tensor loop CPU tensors
    get."""

    def peak(*techniques):
        out = cuda_prediction("vit-tiny", *techniques, batch_size=1)
        assert out.peak_phase == "optimizer"
        return out.peak_tensor_bytes

    default = peak()
    assert default == peak(tech("optimizer", kind="adamw", impl="foreach"))
    assert default > peak(tech("optimizer", kind="adamw", impl="single"))
    run = spec("vit-tiny", batch_size=1)
    assert predict(run, run.cpu, cuda=False).peak_tensor_bytes < default  # as this CPU runs it


def test_cuda_prediction_saves_dropout_masks_of_one_byte(monkeypatch):
    """CUDA's dropout is the fused kernel, which keeps a bool mask; CPU's keeps float32 noise: three
    bytes more per element. bert-tiny drops out five times at batch × sequence × hidden (16·16·64:
    embeddings, then attention output and feed-forward in each of two layers) and once on the pooled
    output (16·64)."""
    fused = cuda_prediction("bert-tiny", batch_size=16, seq_len=16).activation_bytes
    monkeypatch.setattr(cuda, "cuda_dropout", nullcontext)
    noise = cuda_prediction("bert-tiny", batch_size=16, seq_len=16).activation_bytes
    assert noise - fused == 3 * (5 * 16 * 16 * 64 + 16 * 64)


def attention_bytes(fn, inputs: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], int, int]:
    """fn's output and its inputs' gradients, the bytes of the storages autograd keeps for backward,
    and the peak live bytes of forward and backward as the tracker counts them."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with LiveBytes(CPU) as live:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        grads = torch.autograd.grad(out.sum(), inputs)
    return [out.detach(), *grads], sum(storages.values()), live.peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "kv_heads, mask, causal",
    [(4, None, False), (2, None, True), (4, "bool", False), (2, "float", False)],
)
def test_the_math_path_is_atens_step_for_step_with_cudas_one_byte_dropout_mask(
    dtype, kv_heads, mask, causal
):
    """predict's copy of ATen's math attention computes the same values and gradients, keeps the
    same tensors and peaks at the same bytes as ATen's own; with dropout on, it keeps a bool mask
    where CPU's kept float32 noise over the 2·4·8·8 weights (float32 in 16-bit too: the math path
    computes in float32)."""
    torch.manual_seed(0)
    qkv = tuple(
        torch.randn(2, heads, 8, 16, dtype=dtype, requires_grad=True)
        for heads in (4, kv_heads, kv_heads)
    )
    m = {
        None: None,
        "bool": torch.rand(2, 1, 8, 8) > 0.3,
        "float": torch.randn(2, 1, 8, 8, dtype=dtype),
    }[mask]

    def aten_math(p: float) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(*qkv, m, p, causal, scale=0.3, enable_gqa=True)

    def copy(p: float) -> torch.Tensor:
        return cuda.math_attention(*qkv, m, p, causal, 0.3, grouped=kv_heads != 4)[0]

    (theirs, kept, peak), (mine, mine_kept, mine_peak) = (
        attention_bytes(lambda f=f: f(0.0), qkv) for f in (aten_math, copy)
    )
    assert all(torch.equal(a, b) and a.dtype == b.dtype == dtype for a, b in zip(mine, theirs))
    assert (mine_kept, mine_peak) == (kept, peak)
    noise, fused = (attention_bytes(lambda f=f: f(0.1), qkv)[1] for f in (aten_math, copy))
    assert noise - fused == 3 * 2 * 4 * 8 * 8


def test_cuda_prediction_of_the_math_path_saves_its_attention_dropout_mask_in_one_byte(monkeypatch):
    """bert-tiny with sdpa's math backend drops out its s×s attention weights (p 0.1) in each of two
    layers of two heads: a bool mask apiece on CUDA, where ATen's composite on a CPU tensor keeps
    float32 noise."""
    aten_math = F.scaled_dot_product_attention  # the prediction routes the module's name to its own

    def cpu_noise(q, k, v, m, p, causal, scale, grouped):
        with sdpa_kernel(SDPBackend.MATH):
            return aten_math(q, k, v, m, p, causal, scale=scale, enable_gqa=grouped), None

    fused = cuda_prediction("bert-tiny", tech("sdpa", backend="math"), batch_size=16, seq_len=16)
    monkeypatch.setattr(cuda, "math_attention", cpu_noise)
    noise = cuda_prediction("bert-tiny", tech("sdpa", backend="math"), batch_size=16, seq_len=16)
    assert noise.activation_bytes - fused.activation_bytes == 3 * 2 * 16 * 2 * 16 * 16


@pytest.mark.parametrize(
    "techniques, per_layer", [((tech("bf16"),), 34), ((tech("bf16"), tech("checkpoint")), 2)]
)
def test_a_transformer_layer_keeps_what_korthikanti_counts(techniques, per_layer):
    """Korthikanti et al. 2022 (arXiv:2205.05198): in 16-bit a transformer layer keeps s·b·h·(34 +
    5·a·s/h) bytes for backward, 2·s·b·h with full recomputation. Flash attention keeps no s×s
    matrix (the second term), only per-token statistics; the 34 counts one-byte dropout masks, as
    CUDA keeps them (CPU's dropout would make it 36). One layer is the difference between BERT-base
    with three and with two."""
    s, b, h = 512, 16, 768
    kept = [
        cuda_prediction(model, *techniques, batch_size=b, seq_len=s).activation_bytes
        for model in ("tests.helpers:BERT_BASE_2", "tests.helpers:BERT_BASE_3")
    ]
    assert per_layer <= (kept[1] - kept[0]) / (s * b * h) < per_layer + 0.1  # 34.08: the statistics


@pytest.mark.full  # ViT-L/16 at full size, a published figure: 15-20 s of a loaded two-core machine
def test_vit_l16_at_batch_1_needs_what_the_optimizer_in_backward_tutorial_measured():
    """PyTorch's optimizer_step_in_backward tutorial: ViT-L/16, batch 1, Adam on CUDA peaks at about
    6 GB, and about 4 GB with the step fused into backward. The first holds only if Adam is
    predicted as foreach: the single-tensor loop's temporaries would make it 4.9 GB."""

    def peak(*techniques):
        return (
            cuda_prediction(
                "tests.helpers:VIT_L16", *techniques, batch_size=1, image_size=224
            ).peak_tensor_bytes
            / 1e9
        )

    assert 5.5 < peak() < 6.5  # 6.09
    assert 3.5 < peak(tech("optimizer-in-backward")) < 4.5  # 4.01


def test_grouped_keys_take_flash_in_16_bit_and_the_math_path_otherwise_as_on_cuda():
    """Llama-style attention with fewer key/value heads than query heads: CUDA's flash kernel takes
    the grouped keys, its memory-efficient one does not, so float32 falls back to math (s×s scores).
    Under autocast the inputs are cast to 16-bit first (rotary embeddings leave the query in
    float32)."""

    def peak(*techniques):
        return cuda_prediction(
            "tests.helpers:TINY_LM", *techniques, batch_size=4, seq_len=256
        ).peak_tensor_bytes

    amp = tech("amp", dtype="bfloat16")
    assert peak() == peak(tech("sdpa", backend="math"))
    assert (
        peak(amp)
        == peak(amp, tech("sdpa", backend="flash"))
        < peak(amp, tech("sdpa", backend="math"))
    )


@pytest.mark.parametrize(
    "model, techniques, why",
    [
        (
            "bert-tiny",
            (tech("sdpa", backend="flash"),),
            "flash attention on CUDA takes 16-bit inputs only",
        ),
        (
            "bert-tiny",
            (tech("sdpa", backend="cudnn"),),
            "cudnn attention on CUDA takes 16-bit inputs only",
        ),
        (
            "tests.helpers:TINY_LM",
            (tech("sdpa", backend="efficient"),),
            "efficient attention on CUDA takes no grouped",
        ),
    ],
)
def test_a_pinned_attention_kernel_cuda_would_refuse_makes_the_prediction_unsupported(
    model, techniques, why
):
    """As the run on CUDA would be (the sdpa technique turns the kernel's refusal into
    `unsupported`), instead of a figure for a kernel that never runs; under autocast the same
    kernels take the call."""
    out = cuda_prediction(model, *techniques, batch_size=4, seq_len=16)
    assert out.status == "unsupported" and out.message.startswith(why)
    amp = cuda_prediction(
        model, *techniques[:1], tech("amp", dtype="bfloat16"), batch_size=4, seq_len=16
    )
    assert amp.status == ("unsupported" if "grouped" in why else "ok")


def test_fp8_is_predicted_keeping_the_activations_it_had_and_adding_its_casts():
    """torchao saves each float8 linear's input for backward in its own precision and casts it again
    there, so FP8 keeps what the model kept; the casts' temporaries (the float8 copies, their
    scales) raise the peak."""
    pytest.importorskip("torchao")
    base, fp8 = (
        cuda_prediction("vit-tiny", *techniques, batch_size=16)
        for techniques in ((), (tech("fp8"),))
    )
    assert fp8.status == "ok", fp8
    assert fp8.activation_bytes == base.activation_bytes
    assert fp8.peak_tensor_bytes > base.peak_tensor_bytes


def test_offload_leaves_only_the_logits_on_the_device_after_forward():
    """save_on_cpu moves every tensor saved for backward to the host, so what forward leaves on the
    device is the logits (16 × 10 in float32: 640 bytes, two 512-byte blocks); backward brings each
    back while its node runs."""
    base, offload = (
        cuda_prediction("vit-tiny", *techniques, batch_size=16)
        for techniques in ((), (tech("offload"),))
    )
    assert offload.activation_bytes == 1024
    assert offload.peak_tensor_bytes < base.peak_tensor_bytes


def test_offload_brings_host_tensors_back_to_the_host_not_the_device(monkeypatch):
    """save_on_cpu brings a saved tensor back to the device it came from, so the memory-efficient
    kernel's seed and offset, which CUDA keeps on the host, never reach the device: bert-tiny's
    backward peak (SGD keeps it there) comes in an attention layer's backward, where counting them
    would add their two blocks."""
    from bench.predict import stand_ins as adapters

    techniques = (tech("offload"), tech("optimizer", kind="sgd"))
    kept = cuda_prediction("bert-tiny", *techniques, batch_size=16, seq_len=128)
    monkeypatch.setattr(adapters, "is_on_host", lambda t: False)
    brought = cuda_prediction("bert-tiny", *techniques, batch_size=16, seq_len=128)
    assert kept.peak_phase == "backward"
    assert brought.peak_tensor_bytes - kept.peak_tensor_bytes == 2 * 512


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_batch_norm_saves_its_statistics_in_float32_on_cuda_and_the_weights_dtype_on_a_cpu(dtype):
    """CUDA's own batch norm kernel (16-bit weights) saves its mean and inverse std in the input's
    accumulation type, cuDNN's (float32 weights) in the weight's: float32 either way; a CPU's kernel
    saves the weight's dtype. Pure bf16 ResNet-50 on the H100 kept 196 blocks more than the weight's
    dtype gives."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bench.predict.stand_ins import OutputsAsReal, ScalarsRead

    def saved(cuda: bool) -> set[torch.dtype]:
        with FakeTensorMode() as faking, ScalarsRead(faking, OutputsAsReal(cuda=cuda)):
            x, w = torch.empty(4, 256, 3, 3, dtype=dtype), torch.empty(256, dtype=dtype)
            stats = torch.empty(256, dtype=dtype), torch.empty(256, dtype=dtype)
            out = torch.ops.aten.native_batch_norm(x, w, w, *stats, True, 0.1, 1e-5)
        return {out[1].dtype, out[2].dtype}

    assert saved(cuda=True) == {torch.float32}
    assert saved(cuda=False) == {dtype}


def test_the_host_state_is_adams_step_counters_outside_fused_groups():
    params = [torch.nn.Parameter(torch.zeros(4, 4)) for _ in range(3)]
    plain, fused = torch.optim.AdamW(params[:2]), torch.optim.AdamW(params[2:], fused=True)
    for p in params:
        p.grad = torch.ones_like(p)
    plain.step(), fused.step()
    assert cuda.host_state(plain) == [plain.state[p]["step"] for p in params[:2]]
    # fused and capturable steps keep their counters on the device
    assert cuda.host_state(fused) == []


LOGITS_HELD = "7940e663"  # the revision whose trainer held the logits through backward


@pytest.mark.full
@pytest.mark.parametrize(
    "path",
    sorted(RESULTS.glob("*/nvidia-h100*/*.json")),
    ids=lambda p: f"{p.parent.parent.name}-{p.stem}",
)
def test_every_h100_record_is_predicted_byte_for_byte(path):
    """Every committed H100 record against its prediction: what forward kept for backward is what
    the tracker counted there, to the byte, and so is the peak. Each needs CUDA's outputs where they
    differ from the meta kernels': layer norm's float32 statistics for 16-bit inputs (pure-bf16 ViT
    read 1.2 MB low without), and the host placement of the memory-efficient attention kernel's seed
    and offset (fp32 BERT and ViT: 24 blocks high), of optimizers' step counters (BERT's forward
    peaks: 201 blocks high) and not of a scalar an optimizer computes (transformers' Adafactor's
    RMS: bert-large's, 393 blocks low), and float16's scaled loss alive through backward (a block).
    The trainer that measured the records of 2026-11-22 (7940e663) held the logits through backward,
    which today's does not, as a hand-written loop would not: a peak in backward there is the
    prediction and those logits' blocks."""
    record = results.read(path)
    if record["status"] != "ok":
        pytest.skip(f"{record['status']}: no peak to hold the prediction to")
    if "activation_bytes" not in record:
        pytest.skip("compiled: the tracker sees no Python in the step, so nothing tracked to hold")
    out = predict(RunSpec.from_dict(record["spec"]))
    assert out.activation_bytes == record["activation_bytes"]
    held = 0
    if record["peak_phase"] == "backward" and record["git_revision"].startswith(LOGITS_HELD):
        shapes = record["spec"]["gpu"]
        dtype = getattr(torch, record["proof"]["output_dtype"].removeprefix("torch."))
        logits = shapes["batch_size"] * models.resolve(record["model"]).num_classes * dtype.itemsize
        held = -(-logits // 512) * 512
    assert out.peak_tensor_bytes + held == record["peak_tensor_bytes"]


def test_safe_softmax_asks_the_allocator_for_its_kernels_temporaries_as_the_h200_recorded():
    """The math attention path's ``_safe_softmax`` is one operator to the tracker, but its CUDA
    kernel makes the softmax, a one-byte mask of the scores, its rows and a zero, and frees all but
    the softmax as it returns: the H200's llama/selective-checkpoint history holds that sequence
    (1 GiB of mask a layer), which the prediction now asks of the allocator."""
    fake = FakeTensorMode()
    with fake:
        scores = torch.randn(2, 4, 64, 64)  # 128 KiB of float32 scores

    def requests(kernels: dict | None) -> list[tuple[bool, int]]:
        tracker = LiveBytes(CPU, rounding=512, kernels=kernels)
        with fake, tracker:
            out = torch.ops.aten._safe_softmax(scores, -1)
        assert out.shape == scores.shape and out.dtype == scores.dtype
        return [(freeing, n) for _, freeing, _, n in tracker._events()]

    assert requests(None) == [(False, 131072)]
    made = [(False, 131072), (False, 32768), (False, 512), (False, 512)]
    assert requests(cuda.KERNELS) == [*made, (True, 512), (True, 512), (True, 32768)]
    # the record: the same requests, each of the card's sizes (8 × 32 heads × 2,048²)
    trace = history.read(RESULTS / "llama/nvidia-h200/selective-checkpoint.history.pickle.gz")
    events = [e for e in trace["device_traces"][0] if e["action"] in ("alloc", "free_requested")]
    at = next(i for i, e in enumerate(events) if e["size"] == 2**30)
    kernel = [(e["action"] == "free_requested", e["size"]) for e in events[at - 1 : at + 6]]
    rows, mask = 8 * 32 * 2048, 8 * 32 * 2048 * 2048
    softmax = [(False, 4 * mask)]
    assert kernel == [*softmax, (False, mask), (False, rows), (False, 4)] + [
        (True, 4),
        (True, rows),
        (True, mask),
    ]


@pytest.mark.parametrize(
    "to_host, non_blocking, host, device",
    [
        # blocking: converted on the host, in the source's dtype from the card, the destination's
        # from the host
        (True, False, 4096, 0),
        (False, False, 2048, 0),
        # non-blocking: converted on the card, the same way round
        (True, True, 0, 2048),
        (False, True, 0, 4096),
    ],
    ids=["to-host", "to-device", "to-host-non-blocking", "to-device-non-blocking"],
)
def test_a_copy_across_in_another_dtype_goes_through_a_buffer_where_cuda_converts(
    to_host, non_blocking, host, device
):
    """Copy.cu's copy_kernel_cuda: between host and device in another dtype (1,024 float32 elements
    into bfloat16, or back), a contiguous buffer on the side that converts (the host for a blocking
    copy, the device for a non-blocking one), let go as the copy returns; in one dtype, a transfer
    alone."""
    fake = FakeTensorMode()
    with fake:
        wide, narrow = torch.empty(1024), torch.empty(1024, dtype=torch.bfloat16)
        alike = torch.empty(1024, dtype=torch.bfloat16)
    src, dst = (wide, on_host(narrow)) if to_host else (on_host(wide), narrow)
    tracker = LiveBytes(CPU, kernels=cuda.KERNELS)
    tracker.add([wide, narrow, alike])
    given = (tracker.current, tracker.host.current)
    with fake, tracker:
        dst.copy_(src, non_blocking=non_blocking)
        dst.copy_(alike, non_blocking=non_blocking)  # in one dtype: a transfer alone
    assert (tracker.host.peak - given[1], tracker.peak - given[0]) == (host, device)
    assert (tracker.current, tracker.host.current) == given
