import pytest
import torch
from torch import nn

from bench.measure.memory import tracked_step
from tests.conftest import CPU, build_trainer
from tests.helpers import spec, tech


def infer(model="vit-tiny", *techniques, batch_size=8):
    predictor, batch = build_trainer(
        spec(model, techniques, batch_size=batch_size, mode="inference")
    )
    logits = predictor.step(batch)
    figures = tracked_step(lambda: predictor.step(batch), predictor.model, None, CPU)
    return figures, predictor, logits


def test_inference_mode_makes_inference_tensors_with_identical_outputs():
    _, plain, expected = infer()
    _, fast, logits = infer("vit-tiny", tech("inference-mode"))
    assert plain.proof()["inference_tensors"] is False and fast.proof()["inference_tensors"] is True
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_stores_weights_in_16_bits_and_halves_their_bytes(dtype):
    base, _, _ = infer()  # (vit-tiny's head starts at zero, so its logits cannot be compared)
    half, predictor, logits = infer("vit-tiny", tech("half", dtype=dtype))
    assert {p.dtype for p in predictor.model.parameters()} == {getattr(torch, dtype)}
    assert half.param_bytes * 2 == base.param_bytes
    assert (
        logits.dtype == getattr(torch, dtype)
        and predictor.proof()["output_dtype"] == f"torch.{dtype}"
    )


def test_dynamic_int8_quantizes_every_body_linear_and_shrinks_their_bytes():
    pytest.importorskip("torchao")
    base, _, expected = infer("bert-tiny")
    quant, predictor, logits = infer("bert-tiny", tech("dynamic-int8"))
    model = build_trainer(spec("bert-tiny", mode="inference"))[0].model
    body = [n for n, m in model.named_modules() if type(m) is nn.Linear and "classifier" not in n]
    assert predictor.proof()["dynamic-int8.quantized_linears"] == len(body) > 0
    body_bytes = sum(m.weight.numel() * 4 for n, m in model.named_modules() if n in body)
    # int8 instead of fp32 for those weights: 3 bytes per weight saved, less the per-channel scales.
    assert base.param_bytes - quant.param_bytes > 0.7 * body_bytes
    # 0.98: with AVX2 kernels only (no VNNI), int8 GEMMs sum byte pairs in saturating int16s; 0.984
    # measured there
    assert torch.nn.functional.cosine_similarity(logits.flatten(), expected.flatten(), dim=0) > 0.98


@pytest.mark.parametrize("model", ["resnet-tiny", "bert-tiny"])
def test_jit_trace_runs_a_traced_graph_with_eager_outputs(model):
    _, _, expected = infer(model)
    figures, predictor, logits = infer(model, tech("jit-trace"))
    proof = predictor.proof()
    assert proof["jit-trace.traced"] is True and proof["jit-trace.graph_nodes"] > 10
    torch.testing.assert_close(logits, expected)
    assert figures.peak_tensor_bytes > 0  # the traced graph's ops still pass the tracker
