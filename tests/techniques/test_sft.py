"""TRL SFTTrainer's losses: chunked_nll is the full cross-entropy without the full logits, nll the
model's own loss with SFTTrainer's token metrics; both predicted to the byte."""

import math

import pytest
import torch

from bench.measure.memory import tracked_step
from bench.models import MODELS
from bench.techniques.sft import CHUNK
from tests.conftest import CPU, build_trainer
from tests.helpers import spec, tech
from tests.predict.test_fake import assert_predicted_exactly

VOCAB = MODELS.get("llama-tiny").vocab_size


def _trained(*techniques, batch_size=4, seq_len=128):
    """llama-tiny after one step on the synthetic batch (lr 0: the weights stay the seed's)."""
    trainer, batch = build_trainer(
        spec("llama-tiny", techniques, batch_size=batch_size, seq_len=seq_len, lr=0.0)
    )
    return trainer, trainer.step(batch)


@pytest.mark.parametrize("loss", ["sft-chunked-nll", "sft-nll"])
def test_the_loss_and_every_gradient_are_the_plain_cross_entropys(loss):
    """4 × 127 positions with a target: two chunks of 256 for chunked_nll, the second half masked
    tail. The same loss and the same gradients, the head's among them, to float rounding."""
    plain, full = _trained()
    sft, found = _trained(tech(loss))
    assert found.item() == pytest.approx(full.item(), rel=1e-6)
    grads = dict(plain.model.named_parameters())
    for name, p in sft.model.named_parameters():
        reference = grads[name.replace("lm_head.head.", "lm_head.")].grad
        torch.testing.assert_close(p.grad, reference, rtol=1e-4, atol=1e-6)
    if loss == "sft-chunked-nll":
        assert sft.proof()["sft-chunked-nll.chunks_per_step"] == math.ceil(4 * 127 / CHUNK) == 2
    else:
        assert sft.proof()["sft-nll.metered_forwards_per_step"] == 1


def test_chunked_nll_never_holds_the_full_logits_and_nll_holds_more_than_a_plain_step():
    """8 × 256 positions of a 32,768-token vocabulary: float32 logits of 256 MiB. chunked_nll's peak
    falls by more than them; nll's metrics, computed with the logits held, raise it."""
    logits = 8 * 256 * VOCAB * 4
    peaks = {}
    for name in ("plain", "sft-chunked-nll", "sft-nll"):
        techniques = () if name == "plain" else (tech(name),)
        trainer, batch = build_trainer(spec("llama-tiny", techniques, batch_size=8, seq_len=256))
        trainer.step(batch)
        peaks[name] = tracked_step(
            lambda t=trainer, b=batch: t.step(b), trainer.model, trainer.optimizer, CPU
        ).peak_tensor_bytes
    assert peaks["plain"] - peaks["sft-chunked-nll"] > logits
    assert peaks["sft-nll"] > peaks["plain"]


@pytest.mark.parametrize(
    "techniques",
    [
        (tech("sft-chunked-nll"),),
        (tech("amp", dtype="bfloat16"), tech("checkpoint"), tech("sft-chunked-nll")),
        (tech("lora"), tech("sft-chunked-nll")),
        (tech("sft-nll"),),
        (tech("amp", dtype="bfloat16"), tech("checkpoint"), tech("sft-nll")),
    ],
    ids=["chunked", "chunked+amp+checkpoint", "chunked+lora", "nll", "nll+amp+checkpoint"],
)
def test_predicted_to_the_byte(techniques):
    """Two chunks, recomputed in backward under checkpointing; the metrics' 128-row chunks and the
    copy flattening makes of a batch's logits."""
    assert_predicted_exactly(spec("llama-tiny", techniques, batch_size=4, seq_len=128))
