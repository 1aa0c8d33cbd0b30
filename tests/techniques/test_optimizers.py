import pytest
import torch

from bench.measure.memory import tracked_step
from bench.suite import SuiteError, load
from tests.conftest import CPU, build_trainer
from tests.helpers import spec, tech


def run(*techniques, model="vit-tiny", batch_size=8):
    trainer, batch = build_trainer(spec(model, techniques, batch_size=batch_size))
    trainer.step(batch)
    return tracked_step(lambda: trainer.step(batch), trainer.model, trainer.optimizer, CPU), trainer


@pytest.mark.parametrize(
    "kind, impl, state_per_param",
    [
        ("adamw", "single", 2.0),
        ("adamw", "foreach", 2.0),
        ("sgd", "default", 1.0),
    ],
)
def test_optimizer_state_bytes_per_parameter_byte(kind, impl, state_per_param):
    figures, trainer = run(tech("optimizer", kind=kind, impl=impl))
    # fp32 step scalars
    counters = 4 * len(list(trainer.model.parameters())) if kind == "adamw" else 0
    assert figures.optimizer_state_bytes == state_per_param * figures.param_bytes + counters
    assert trainer.proof()["optimizer.optimizer"] == {"adamw": "AdamW", "sgd": "SGD"}[kind]


@pytest.mark.parametrize("kind, name", [("adagrad", "Adagrad"), ("rmsprop", "RMSprop")])
def test_the_trainers_adagrad_and_rmsprop_keep_one_value_per_parameter_and_predict_exactly(
    kind, name
):
    """optim = "adagrad" / "rmsprop": torch's at their defaults (RMSprop without momentum), each a
    float32 value per parameter and a step counter per tensor."""
    from tests.predict.test_fake import assert_predicted_exactly

    figures, trainer = run(tech("optimizer", kind=kind))
    counters = 4 * len(list(trainer.model.parameters()))
    assert figures.optimizer_state_bytes == figures.param_bytes + counters
    assert trainer.proof()["optimizer.optimizer"] == name
    assert_predicted_exactly(spec("vit-tiny", (tech("optimizer", kind=kind),), batch_size=8))


# torchao compiles each parameter's update (tens of seconds on the CI machine)
@pytest.mark.full
def test_adamw_4bit_keeps_its_moments_in_half_a_byte_each_and_predicts_exactly():
    """torchao's AdamW4bit, as the Trainer makes it for adamw_torch_4bit (blocks of 256): two
    4-bit moments and a float32 scale per block, on every parameter of a block's multiple."""
    pytest.importorskip("torchao")
    from bench.predict import predict
    from tests.predict.test_fake import assert_predicted_exactly

    four = spec("llama-tiny", (tech("adamw-4bit", block_size=256),))
    trainer = assert_predicted_exactly(four)  # the tracker steps aside for the compiled update
    assert trainer.proof()["adamw-4bit.optimizer"] == "AdamW4bit"
    figures = predict(four, four.cpu, cuda=False)
    assert figures.optimizer_state_bytes < 0.3 * figures.param_bytes


def test_adafactor_factors_its_second_moment():
    adamw, _ = run()
    ada, trainer = run(tech("optimizer", kind="adafactor", lr=1e-2))
    assert trainer.proof()["optimizer.optimizer"] == "Adafactor"
    assert ada.optimizer_state_bytes < 0.2 * adamw.optimizer_state_bytes


def test_fused_adamw_is_recorded():
    _, trainer = run(tech("optimizer", kind="adamw", impl="fused"))
    assert trainer.proof()["optimizer.impl"] == "fused"


def test_zero_grad_keep_holds_gradients_between_steps():
    fresh, default = run()
    kept, trainer = run(tech("zero-grad-keep"))
    assert all(p.grad is None for p in default.model.parameters())
    assert all(p.grad is not None and not p.grad.any() for p in trainer.model.parameters())
    # The price: every gradient is alive through backward, so the peak holds all of them.
    assert kept.at_peak_gradients_bytes == kept.param_bytes > fresh.at_peak_gradients_bytes
    assert kept.peak_tensor_bytes > fresh.peak_tensor_bytes
    assert trainer.proof()["zero-grad-keep.grads_kept_between_steps"] == len(
        list(trainer.model.parameters())
    )


def test_optimizer_in_backward_gives_adamw_updates_without_holding_all_gradients():
    base, adamw = run(
        tech("optimizer", kind="adamw", impl="single", lr=1e-4), model="bert-tiny", batch_size=4
    )
    fused, inbwd = run(tech("optimizer-in-backward", lr=1e-4), model="bert-tiny", batch_size=4)
    for a, b in zip(adamw.model.parameters(), inbwd.model.parameters()):
        torch.testing.assert_close(a, b)
    n_params = len(list(inbwd.model.parameters()))
    assert inbwd.proof()["optimizer-in-backward.parameters_stepped_in_backward"] == n_params
    assert fused.optimizer_state_bytes == base.optimizer_state_bytes
    assert fused.peak_tensor_bytes < base.peak_tensor_bytes


def test_optimizer_in_backward_rejects_accumulation_and_fp16_scaling(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(
        'model = "vit-tiny"\nbaseline = "a"\n[shapes.gpu]\nbatch_size = 8\nimage_size = 32\n'
        "[shapes.cpu]\nbatch_size = 8\nimage_size = 32\n"
        '[[runs]]\nname = "a"\ntechniques = ["optimizer-in-backward", "accumulate"]\n'
        '[[runs]]\nname = "b"\n'
        'techniques = ["optimizer-in-backward", { name = "amp", dtype = "float16" }]\n'
    )
    with pytest.raises(SuiteError) as info:
        load(path)
    found = "\n".join(info.value.problems)
    assert "optimizer-in-backward and accumulate cannot be combined" in found
    assert "float16 loss scaling must see every gradient" in found


def test_optimizer_techniques_follow_the_runs_learning_rate_unless_given_one():
    for technique, expected in [
        (tech("optimizer", kind="sgd"), 3e-3),
        (tech("optimizer", kind="sgd", lr=0.01), 0.01),
        (tech("adamw-8bit"), 3e-3),
    ]:
        if technique.name == "adamw-8bit":
            pytest.importorskip("torchao")
        trainer, _ = build_trainer(spec("vit-tiny", (technique,), lr=3e-3))
        assert trainer.optimizer.param_groups[0]["lr"] == expected


def test_galore_keeps_each_block_matrixs_moments_in_its_rank_r_projection():
    """llama-tiny: the 14 matrices of its blocks are projected at a quarter of their smaller side
    (m×n, m ≤ n: both moments r×n and the m×r basis); the tied embedding and the norms keep AdamW's
    two full moments. The state is exactly that, the projector's basis counted with it, and the
    prediction counts the same."""
    pytest.importorskip("pytorch_optimizer")
    from bench.measure.memory import optimizer_state, tensor_bytes
    from bench.predict.fake import predict
    from tests.conftest import build_trainer

    run = spec("llama-tiny", (tech("galore"),), batch_size=2, seq_len=32)
    trainer, batch = build_trainer(run)
    trainer.step(batch)
    expected = 0
    for group in trainer.optimizer.param_groups:
        for p in group["params"]:
            if "rank" in group:
                assert group["rank"] == min(p.shape) // 4
                expected += 4 * (2 * group["rank"] * max(p.shape) + group["rank"] * min(p.shape))
            else:
                expected += 4 * 2 * p.numel()
    assert tensor_bytes(optimizer_state(trainer.optimizer)) == expected
    assert trainer.proof()["galore.projected_matrices"] == 14
    assert predict(run, cuda=False).optimizer_state_bytes == expected


def test_techniques_that_make_the_optimizer_refuse_each_other_but_not_pure_bf16():
    """bf16 makes an optimizer only with master_weights: galore and cpu-offload-optimizer combine
    with pure bf16."""
    from bench.suite.techniques import _check_combination
    from bench.techniques import build

    def problems(*techniques):
        found: list[str] = []
        _check_combination("runs[0]", [build(t) for t in techniques], found)
        return found

    for own in ("galore", "cpu-offload-optimizer"):
        assert problems(tech(own), tech("bf16")) == []
        assert problems(tech(own), tech("bf16", master_weights=True)) != []
        assert problems(tech(own), tech("adamw-8bit")) != []


@pytest.mark.parametrize("clip", [True, False])
def test_clip_grad_norm_scales_the_gradients_to_max_norm_before_the_optimizer_steps(
    clip, monkeypatch
):
    """clip = false: the norm taken for the Trainer's logs alone (max_grad_norm = 0)."""
    seen = []
    step = torch.optim.AdamW.step

    def stepping(self, *args, **kwargs):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        seen.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", stepping)
    _, trainer = run(tech("clip-grad-norm", max_norm=1e-3, clip=clip))
    kept = trainer.techniques[0].norm
    assert kept.dim() == 0 and kept.item() > 1e-3  # the norm before clipping, as the Trainer logs
    expected = 1e-3 if clip else kept.item()
    assert abs(seen[-1] / expected - 1) < 1e-3
    assert trainer.proof()["clip-grad-norm.norm_kept"]


@pytest.mark.parametrize("techniques", [(), (tech("amp", dtype="float16"),)])
def test_the_norm_kept_to_the_next_clipping_is_allocated_through_the_next_step(techniques):
    """The Trainer holds the last step's norm (a float32 scalar) until it clips again, after the
    next backward: on CUDA one 512-byte block more at a peak in backward, which the allocator's
    replay counts (the tracker counts what the step makes, and this the step before made). float16
    autocast's gradients are unscaled before they are clipped, as accelerate does."""
    from bench.predict import predict

    plain = predict(spec("vit-tiny", techniques, batch_size=8))
    clipped = predict(spec("vit-tiny", (*techniques, tech("clip-grad-norm")), batch_size=8))
    assert plain.peak_phase == clipped.peak_phase == "backward"
    assert clipped.peak_allocated_bytes - plain.peak_allocated_bytes == 512
    assert clipped.ops_per_step > plain.ops_per_step  # a norm a gradient, and their scaling


def test_clip_grad_norm_is_predicted_exactly():
    from tests.predict.test_fake import assert_predicted_exactly

    assert_predicted_exactly(spec("bert-tiny", (tech("clip-grad-norm"),), batch_size=4))


def test_clip_grad_norm_refuses_a_norm_that_clips_everything_away():
    from bench.techniques import build

    assert build(tech("clip-grad-norm", max_norm=0.0)).problems(8) == [
        "clip-grad-norm: max_norm must be positive, not 0.0"
    ]


def test_optimizer_in_backward_pages_each_parameters_8bit_moments_as_torchtunes_full_recipe():
    """optimizer-in-backward with bitsandbytes' PagedAdamW8bit per parameter (torchtune's
    optimizer_in_bwd): predicted for CUDA, the moments of parameters of 100,000 elements or more
    are paged off the allocator, as paged-adamw-8bit's are, and no gradient waits for a step; on a
    CPU there is nothing to page."""
    pytest.importorskip("bitsandbytes")
    from bench.predict.fake import predict

    inbwd = spec("llama-tiny", (tech("optimizer-in-backward", optimizer="paged-adamw-8bit"),))
    paged = spec("llama-tiny", (tech("paged-adamw-8bit"),))
    ours, theirs = (predict(r, r.cpu, cuda=True) for r in (inbwd, paged))
    assert ours.ok and theirs.ok, (ours, theirs)
    assert ours.paged_bytes == theirs.paged_bytes > 0
    assert ours.gradient_bytes == 0 < theirs.gradient_bytes  # each freed as its step runs
    on_cpu = predict(inbwd, inbwd.cpu, cuda=False)
    assert on_cpu.status == "unsupported" and "unified memory" in on_cpu.message


@pytest.mark.cuda
def test_optimizer_in_backward_pages_its_moments_on_cuda_as_predicted():
    """torchtune's full recipe's optimizer on a card: the large moments paged, the allocator's peak
    and what the optimizer keeps on the device as predicted."""
    pytest.importorskip("bitsandbytes")
    from bench.launch import Device
    from tests.helpers import isolated

    chosen = tech("optimizer-in-backward", optimizer="paged-adamw-8bit")
    record = isolated(
        spec("llama-tiny", (chosen,), batch_size=8, seq_len=64),
        Device("cuda", torch.cuda.get_device_name(0)),
    )
    assert record["status"] == "ok", record
    assert record["optimizer_state_bytes"] == record["predicted_optimizer_state_bytes"]
    assert record["peak_tensor_bytes"] == record["predicted_peak_tensor_bytes"]
