import torch

from bench.measure.memory import tracked_step
from tests.conftest import CPU, build_trainer
from tests.helpers import spec, tech


def run(*techniques):
    trainer, batch = build_trainer(spec("vit-tiny", techniques, batch_size=16))
    trainer.step(batch)
    figures = tracked_step(lambda: trainer.step(batch), trainer.model, trainer.optimizer, CPU)
    return figures, trainer


def test_bf16_autocast_computes_in_bf16_and_saves_fewer_activation_bytes():
    base, fp32 = run()
    amp, bf16 = run(tech("amp", dtype="bfloat16"))
    assert fp32.output_dtype == torch.float32 and bf16.output_dtype == torch.bfloat16
    assert amp["activation_bytes"] < 0.8 * base["activation_bytes"]
    # Weights and optimizer state stay fp32: autocast only changes what the forward computes.
    assert {p.dtype for p in bf16.model.parameters()} == {torch.float32}
    assert amp["optimizer_state_bytes"] == base["optimizer_state_bytes"]
    assert bf16.proof()["amp.grad_scaler"] is False


def test_fp16_autocast_comes_with_a_grad_scaler_that_steps_the_optimizer():
    _, fp16 = run(tech("amp", dtype="float16"))
    proof = fp16.proof()
    assert fp16.output_dtype == torch.float16
    assert proof["amp.grad_scaler"] is True and proof["amp.loss_scale"] > 0
    assert fp16.optimizer.state  # the scaler's step really stepped the optimizer


def test_fp16_without_its_scaler_loses_small_gradients_to_underflow():
    """resnet-tiny (vit-tiny's zero-initialised head zeroes its whole first gradient) on a tiny loss:
    scaled, the gradients keep what fp32 would; unscaled, almost every element flushes to zero."""
    def zero_fraction(scaler: bool) -> tuple[float, dict]:
        techniques = (tech("tests.helpers:TinyLoss"), tech("amp", dtype="float16", scaler=scaler))
        trainer, batch = build_trainer(spec("resnet-tiny", techniques, batch_size=16))
        zeros, total = [], []

        def count(p: torch.nn.Parameter) -> None:  # read before the step and zero_grad free them
            zeros.append(int((p.grad == 0).sum()))
            total.append(p.grad.numel())

        for p in trainer.model.parameters():
            p.register_post_accumulate_grad_hook(count)
        trainer.step(batch)
        return sum(zeros) / sum(total), trainer.proof()

    scaled, proof = zero_fraction(True)
    unscaled, no_scaler = zero_fraction(False)
    assert proof["amp.grad_scaler"] is True and no_scaler["amp.grad_scaler"] is False
    assert scaled < 0.05 and unscaled > 0.9  # measured: 0.024 (unused elements) and 0.994


def test_pure_bf16_halves_model_states_and_keeps_no_fp32_copy():
    base, _ = run()
    pure, trainer = run(tech("bf16"))
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert pure["param_bytes"] * 2 == base["param_bytes"]
    # exp_avg and exp_avg_sq follow the parameters' dtype; the step counters stay fp32 scalars.
    assert pure["optimizer_state_bytes"] < 0.51 * base["optimizer_state_bytes"]
    assert trainer.proof()["bf16.param_dtypes"] == "torch.bfloat16"


def test_tf32_is_unsupported_off_cuda():
    from bench.models import MODELS
    from bench.techniques import RunContext
    from bench.techniques.precision import TF32

    ctx = RunContext(CPU, MODELS.get("vit-tiny"), None)
    assert "CUDA" in TF32().unsupported(ctx)
