"""Model-FLOPs utilisation: the step's counted FLOPs against the card's dense peak for the dtype in
use."""

from __future__ import annotations

from typing import Any

from bench.record import KEY

# Dense (no sparsity) tensor-core peaks in TFLOP/s, from NVIDIA's datasheets (SXM parts).
PEAK_TFLOPS = {
    "H100": {"float32": 66.9, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4, "float8": 1978.9},
    "H200": {"float32": 66.9, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4, "float8": 1978.9},
    "A100": {"float32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0},
}


def compute_dtype(record: dict[str, Any]) -> str:
    """The dtype the step's matmuls ran in, from the record: FP8, the logits' dtype, TF32, else
    fp32."""
    proof = record.get(KEY.proof) or {}
    if any(k.startswith("fp8.") for k in proof):
        return "float8"
    dtype = str(proof.get("output_dtype", "")).removeprefix("torch.")
    if dtype in ("bfloat16", "float16"):
        return dtype
    if record.get(KEY.tf32_matmul):
        return "tf32"
    return "float32"


def mfu(record: dict[str, Any]) -> dict[str, Any]:
    """``mfu`` where the card's peak is known: FLOPs per step / median step time / peak."""
    flops, step_ms = record.get(KEY.flops_per_step), record.get(KEY.step_time_ms_median)
    card = next((PEAK_TFLOPS[k] for k in PEAK_TFLOPS if k in str(record.get(KEY.device, ""))), None)
    dtype = compute_dtype(record)
    if not (flops and step_ms and card and dtype in card):
        return {}
    return {KEY.mfu: flops / (step_ms / 1e3) / (card[dtype] * 1e12), KEY.mfu_dtype: dtype}
