import pytest
import torch

from bench.measure.memory import tracked_step
from bench.predict import predict
from bench.provenance import CPU_BF16, EMULATED_BF16
from bench.recipe import Recipe
from bench.suite import TechniqueSpec
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
    assert amp.activation_bytes < 0.8 * base.activation_bytes
    # Weights and optimizer state stay fp32: autocast only changes what the forward computes.
    assert {p.dtype for p in bf16.model.parameters()} == {torch.float32}
    assert amp.optimizer_state_bytes == base.optimizer_state_bytes
    assert bf16.proof()["amp.grad_scaler"] is False


def test_fp16_autocast_comes_with_a_grad_scaler_that_steps_the_optimizer():
    _, fp16 = run(tech("amp", dtype="float16"))
    proof = fp16.proof()
    assert fp16.output_dtype == torch.float16
    assert proof["amp.grad_scaler"] is True and proof["amp.loss_scale"] > 0
    assert fp16.optimizer.state  # the scaler's step really stepped the optimizer


def test_fp16_without_its_scaler_loses_small_gradients_to_underflow():
    """resnet-tiny (vit-tiny's zero-initialised head zeroes its whole first gradient) on a tiny
    loss: scaled, the gradients keep what fp32 would; unscaled, almost every element flushes to
    zero."""

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
    assert pure.param_bytes * 2 == base.param_bytes
    # exp_avg and exp_avg_sq follow the parameters' dtype; the step counters stay fp32 scalars.
    assert pure.optimizer_state_bytes < 0.51 * base.optimizer_state_bytes
    assert trainer.proof()["bf16.param_dtypes"] == "torch.bfloat16"


def test_tf32_is_unsupported_off_cuda():
    from bench.models import MODELS
    from bench.techniques import RunContext
    from bench.techniques.precision import TF32

    ctx = RunContext(device=CPU, model_spec=MODELS.get("vit-tiny"), shapes=None)
    assert "CUDA" in TF32().unsupported(ctx)


def test_master_weights_step_an_fp32_copy_that_keeps_updates_bf16_would_lose():
    """bf16 with master_weights: bf16 parameters and gradients, an fp32 master per parameter in the
    optimizer (counted as optimizer state with its two fp32 moments: 12 bytes per parameter), and
    the model rounded from the masters after each step. An update far below bf16's resolution is
    lost by pure bf16 and kept by the masters (apex O2's reason to exist)."""

    def stepped(master: bool, lr: float):
        trainer, batch = build_trainer(
            spec("vit-tiny", (tech("bf16", master_weights=master),), batch_size=16, lr=lr)
        )
        before = [p.detach().float().clone() for p in trainer.model.parameters()]
        trainer.step(batch)
        return trainer, batch, before

    trainer, batch, before = stepped(True, 1e-6)
    params = list(trainer.model.parameters())
    masters = [m for _, m in trainer.techniques[0].pairs]
    assert {p.dtype for p in params} == {torch.bfloat16} and {m.dtype for m in masters} == {
        torch.float32
    }
    assert any(not torch.equal(m, b) for m, b in zip(masters, before))  # the masters moved
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(params, masters))
    pure, _, pure_before = stepped(False, 1e-6)
    moved = sum(not torch.equal(p.float(), b) for p, b in zip(pure.model.parameters(), pure_before))
    assert moved <= 2  # only the zero-initialised head's weights can take so small a step in bf16
    figures = tracked_step(lambda: trainer.step(batch), trainer.model, trainer.optimizer, CPU)
    psi = sum(p.numel() for p in params)
    # and AdamW's step counters
    assert figures.optimizer_state_bytes == 12 * psi + 4 * len(params)
    assert figures.param_bytes == 2 * psi
    assert trainer.proof()["bf16.master_dtypes"] == "torch.float32"


def test_fp16_is_o2_on_cuda_only_and_master_weights_claim_the_optimizer():
    from bench.predict.fake import predict
    from bench.recipe import Recipe

    run = spec("vit-tiny", (tech("fp16"),), batch_size=16)
    assert Recipe.of(run, CPU).unsupported() == (
        "fp16: float16 training is a CUDA technique; CPU kernels for it are emulated and slow"
    )
    out = predict(run)  # standing for CUDA: float16 model, fp32 masters and moments
    master = predict(spec("vit-tiny", (tech("bf16", master_weights=True),), batch_size=16))
    assert out.optimizer_state_bytes == master.optimizer_state_bytes
    assert out.param_bytes == master.param_bytes
    problems = suite_problems_of((tech("bf16", master_weights=True), tech("adamw-8bit")))
    assert any(
        "master_weights makes its own AdamW over the fp32 copy; adamw-8bit makes another optimizer"
        in p
        for p in problems
    )


def suite_problems_of(techniques) -> list[str]:
    from bench.suite.techniques import _check_combination
    from bench.techniques import build

    found: list[str] = []
    _check_combination("runs[0]", [build(t) for t in techniques], found)
    return found


@pytest.mark.parametrize(
    "technique",
    [TechniqueSpec("amp"), TechniqueSpec("bf16"), TechniqueSpec("half", (("dtype", "bfloat16"),))],
)
def test_bf16_on_a_cpu_that_emulates_it_is_unsupported_with_the_reason(technique, monkeypatch):
    # On such a CPU a ResNet-50 bf16 step took 10.3 s against fp32's 0.95 s: make bench SUITE=resnet
    # took hours.
    mode = "inference" if technique.name == "half" else "train"
    run = spec("vit-tiny", (technique,), mode=mode)
    monkeypatch.setenv(CPU_BF16, "emulated")
    assert Recipe.of(run, CPU).unsupported() == f"{technique.name}: {EMULATED_BF16}"
    assert predict(run).status == "ok"  # a card asked about from this CPU is unaffected
    monkeypatch.setenv(CPU_BF16, "native")
    assert Recipe.of(run, CPU).unsupported() is None
