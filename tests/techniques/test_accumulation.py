import torch

from bench.measure.memory import tracked_step
from tests.conftest import CPU, build_trainer
from tests.helpers import spec, tech


def params_after_one_step(*techniques):
    trainer, batch = build_trainer(
        spec("vit-tiny", (tech("tests.helpers:SGD", lr=1.0), *techniques), batch_size=16)
    )
    before = torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])
    trainer.step(batch)
    after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    return before - after, trainer  # = lr × gradient for plain SGD


def test_accumulated_gradient_equals_the_full_batch_gradient():
    full, _ = params_after_one_step()
    accumulated, trainer = params_after_one_step(tech("accumulate", micro_batches=4))
    assert trainer.micro_batches == 4
    torch.testing.assert_close(accumulated, full, rtol=1e-4, atol=1e-6)


def test_accumulation_lowers_the_peak_at_equal_global_batch():
    peaks = {}
    for n in (1, 4):
        trainer, batch = build_trainer(
            spec("vit-tiny", (tech("accumulate", micro_batches=n),), batch_size=64)
        )
        trainer.step(batch)
        peaks[n] = tracked_step(
            lambda t=trainer, b=batch: t.step(b), trainer.model, trainer.optimizer, CPU
        )
    assert peaks[4].activation_bytes < peaks[1].activation_bytes / 3
    assert peaks[4].peak_tensor_bytes < peaks[1].peak_tensor_bytes
