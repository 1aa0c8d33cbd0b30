import pytest
import torch
from torch.nn import functional as F

from bench.measure.memory import tracked_step
from bench.techniques import Unsupported
from bench.techniques.legacy import _Softmaxes
from tests.conftest import CPU, build_trainer
from tests.helpers import spec, tech
from tests.predict.test_autocast import on
from tests.predict.test_fake import assert_predicted_exactly

BERT = "hf:suites/configs/tiny-bert-classifier#sequence-classification,attn_implementation=eager"
LAYERS, HEADS, B, S = 2, 4, 4, 64  # tiny-bert-classifier's, at these shapes
SCORES = B * HEADS * S * S  # elements of one layer's attention scores


def run(*techniques, model=BERT):
    trainer, batch = build_trainer(spec(model, techniques, batch_size=B, seq_len=S))
    trainer.step(batch)
    figures = tracked_step(lambda: trainer.step(batch), trainer.model, trainer.optimizer, CPU)
    return figures, trainer


@pytest.mark.parametrize(
    "also, kept_bytes",
    [
        ((), LAYERS * SCORES * 4),  # every layer's float32 scores, held until backward reaches it
        # only the layer recomputed from backward
        (
            (tech("checkpoint", reentrant=True),),
            SCORES * 4,
        ),
        # CPU's autocast runs softmax as given
        (
            (tech("amp", dtype="bfloat16"),),
            LAYERS * SCORES * 2,
        ),
    ],
)
def test_softmax_keeps_its_input_until_backward_as_torch_1_10_did(also, kept_bytes):
    today, base = run(*also)
    legacy, trainer = run(*also, tech("softmax-keeps-input"))
    assert legacy.peak_tensor_bytes - today.peak_tensor_bytes == kept_bytes
    assert trainer.proof()["softmax-keeps-input.softmaxes_keeping_input_per_step"] == LAYERS
    for ours, theirs in zip(trainer.model.parameters(), base.model.parameters()):
        # the same training
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("also", [(), (tech("checkpoint", reentrant=True),)])
def test_fake_tensors_predict_the_kept_inputs_to_the_byte(also):
    assert_predicted_exactly(
        spec(BERT, (*also, tech("softmax-keeps-input")), batch_size=B, seq_len=S)
    )


def test_under_cudas_autocast_it_keeps_the_float32_copy_softmax_takes():
    def softmax(make):
        with _Softmaxes():
            return F.softmax(make(4, 8, dtype=torch.bfloat16), dim=-1)

    kept, out = on("cpu", softmax, emulate=True).grad_fn.saved_tensors
    assert kept.dtype == out.dtype == torch.float32


def test_a_model_without_an_eager_softmax_is_unsupported():
    with pytest.raises(Unsupported, match="attn_implementation=eager"):
        run(tech("softmax-keeps-input"), model="bert-tiny")
