"""Model-FLOPs utilisation: the step's counted FLOPs against the card's dense peak for the dtype in
use."""

from __future__ import annotations

from bench.record import Record, Timing

# Dense (no sparsity) tensor-core peaks in TFLOP/s, from NVIDIA's datasheets (SXM parts).
PEAK_TFLOPS = {
    "H100": {"float32": 66.9, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4, "float8": 1978.9},
    "H200": {"float32": 66.9, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4, "float8": 1978.9},
    "A100": {"float32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0},
}


def compute_dtype(record: Record, tf32: bool) -> str:
    """The dtype the step's matmuls ran in, from the record's proof: FP8, the logits' dtype, TF32
    (where ``tf32`` matmuls are allowed), else fp32."""
    proof = record.outcome.proof or {}
    if any(k.startswith("fp8.") for k in proof):
        return "float8"
    dtype = str(proof.get("output_dtype", "")).removeprefix("torch.")
    if dtype in ("bfloat16", "float16"):
        return dtype
    if tf32:
        return "tf32"
    return "float32"


def mfu(record: Record, card_name: str, tf32: bool) -> Timing:
    """``mfu`` where the card's peak is known: FLOPs per step / median step time / peak."""
    flops, step_ms = record.timing.flops_per_step, record.timing.step_time_ms_median
    card = next((PEAK_TFLOPS[k] for k in PEAK_TFLOPS if k in card_name), None)
    dtype = compute_dtype(record, tf32)
    if not (flops and step_ms and card and dtype in card):
        return Timing()
    return Timing(mfu=flops / (step_ms / 1e3) / (card[dtype] * 1e12), mfu_dtype=dtype)
