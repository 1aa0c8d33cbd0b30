def test_mfu_is_the_counted_flops_over_the_median_step_against_the_cards_peak_for_its_dtype():
    from bench.measure.flops import PEAK_TFLOPS, mfu
    from bench.record import Outcome, Record, Timing

    step = Timing(flops_per_step=10**12, step_time_ms_median=10.0)
    bf16 = Record(timing=step, outcome=Outcome(proof={"output_dtype": "torch.bfloat16"}))
    got = mfu(bf16, "NVIDIA H100 80GB HBM3", tf32=True)
    assert (got.mfu, got.mfu_dtype) == (1e14 / (PEAK_TFLOPS["H100"]["bfloat16"] * 1e12), "bfloat16")
    fp32 = Record(timing=step)
    assert mfu(fp32, "NVIDIA A100-SXM4-80GB", tf32=True).mfu_dtype == "tf32"
    assert mfu(fp32, "NVIDIA A100-SXM4-80GB", tf32=False).mfu_dtype == "float32"
    assert mfu(fp32, "NVIDIA GeForce RTX 4090", tf32=False) == Timing()  # no peak known
