import torch

from bench.measure.memory import tracked_step
from tests.conftest import CPU, build_trainer
from tests.helpers import spec


def test_inference_step_keeps_only_the_logits_and_needs_far_less_than_training():
    predictor, batch = build_trainer(spec("vit-tiny", batch_size=8, mode="inference"))
    trainer, _ = build_trainer(spec("vit-tiny", batch_size=8))
    trainer.step(batch)
    logits = predictor.step(batch)
    assert not predictor.model.training and logits.grad_fn is None
    infer = tracked_step(lambda: predictor.step(batch), predictor.model, None, CPU)
    train = tracked_step(lambda: trainer.step(batch), trainer.model, trainer.optimizer, CPU)
    # Exactly the logits survive a forward without autograd (8 × 10 fp32, one 512-byte-free CPU
    # storage).
    assert infer.activation_bytes == logits.numel() * logits.element_size()
    assert infer.optimizer_state_bytes == 0 and infer.peak_phase == "forward"
    assert infer.peak_tensor_bytes < train.peak_tensor_bytes - train.optimizer_state_bytes
    assert predictor.proof()["output_dtype"] == str(torch.float32)
