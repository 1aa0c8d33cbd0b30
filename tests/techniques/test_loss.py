"""chunked-loss: the cross-entropy of the full logits, its gradients too, without the full logits
ever alive."""

import pytest
import torch

from bench.measure.memory import tracked_step
from bench.models import MODELS
from bench.predict.fake import predict
from bench.techniques.loss import chunk_tokens
from tests.conftest import CPU, build_trainer
from tests.helpers import spec, tech

VOCAB = MODELS.get("llama-tiny").vocab_size


def _trained(*techniques, batch_size=4, seq_len=64, lr=0.0):
    """llama-tiny after one step on the synthetic batch (lr 0: the weights stay those of the
    seed)."""
    trainer, batch = build_trainer(
        spec("llama-tiny", techniques, batch_size=batch_size, seq_len=seq_len, lr=lr)
    )
    loss = trainer.step(batch)
    return trainer, batch, loss


@pytest.mark.parametrize("chunk", [0, 7, 4096])
def test_the_loss_and_every_gradient_are_the_full_cross_entropys(chunk):
    """Any chunking (Liger's rule, chunks that do not divide the positions, one chunk of all): the
    same loss, and the same gradients for every parameter, the tied embedding and head among them,
    to float rounding."""
    plain, batch, full = _trained()
    chunked, _, loss = _trained(tech("chunked-loss", chunk_tokens=chunk))
    assert loss.item() == pytest.approx(full.item(), rel=1e-6)
    grads = dict(plain.model.named_parameters())
    for name, p in chunked.model.named_parameters():
        reference = grads[name.replace("lm_head.head.", "lm_head.")].grad
        torch.testing.assert_close(p.grad, reference, rtol=1e-4, atol=1e-6)


def test_the_full_logits_never_exist_and_the_peak_falls_by_more_than_them():
    """At the suite's CPU shapes (8 × 256 positions, a 32,768-token vocabulary) the float32 logits
    are 256 MiB; the step's tracked peak falls by at least 90% of that (in fact by about three times
    it: the logits, their log-softmax saved for backward, and its gradient); a chunk holds 256
    positions' logits, an eighth."""
    logits = 8 * 256 * VOCAB * 4
    peaks = {}
    for name, techniques in (("plain", ()), ("chunked", (tech("chunked-loss"),))):
        trainer, batch = build_trainer(spec("llama-tiny", techniques, batch_size=8, seq_len=256))
        trainer.step(batch)
        peaks[name] = tracked_step(
            lambda t=trainer, b=batch: t.step(b), trainer.model, trainer.optimizer, CPU
        )
    assert peaks["plain"].peak_tensor_bytes - peaks["chunked"].peak_tensor_bytes >= 0.9 * logits
    proof = trainer.proof()
    assert proof["chunked-loss.largest_chunk_logits_bytes"] == 256 * VOCAB * 4
    assert proof["chunked-loss.chunks_per_step"] == 8


def test_liger_rules_chunk_size_with_a_floor_of_256_positions():
    """Liger's rule makes a chunk's logits the hidden states' size: Llama-3.2-1B at 8 × 2,048 splits
    into 63, then into 32 chunks of a power of two; llama-tiny's rule (256 chunks of 8) is raised to
    256 positions."""
    assert chunk_tokens(8 * 2048, 128_256, 2048) == 512
    assert chunk_tokens(8 * 256, VOCAB, 128) == 256
    assert chunk_tokens(3, 10, 100) == 256


def test_a_frozen_head_gets_no_weight_gradient_and_evaluation_reads_the_logits():
    """Under LoRA the head is frozen: the loss makes no gradient for it (a 128k × 2,048 head's would
    be 1 GiB). In evaluation the model returns the logits themselves, which accuracy reads."""
    trainer, batch, _ = _trained(tech("lora"), tech("chunked-loss"))
    head = trainer.techniques[1].head
    assert not head.weight.requires_grad and head.weight.grad is None
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.spec.logits(trainer.model, batch[0])
    assert logits.shape == (4, 64, VOCAB)


def test_it_applies_to_next_token_models_only_and_is_predicted():
    assert predict(spec("bert-tiny", (tech("chunked-loss"),)), cuda=False).message == (
        "chunked-loss: applies to next-token models; model bert-tiny classifies"
    )
    run = spec("llama-tiny", (tech("chunked-loss"),), batch_size=8, seq_len=256)
    plain = predict(spec("llama-tiny", (), batch_size=8, seq_len=256), cuda=False)
    out = predict(run, cuda=False)
    assert plain.peak_tensor_bytes - out.peak_tensor_bytes >= 0.9 * 8 * 256 * VOCAB * 4
    # the head's matmuls, in pieces
    assert out.flops_per_step == plain.flops_per_step


def test_liger_where_it_is_missing_is_unsupported_with_the_install_hint():
    from bench.recipe import Recipe

    run = spec("llama-tiny", (tech("chunked-loss", implementation="liger"),))
    reason = Recipe.of(run, CPU).unsupported()
    assert reason.startswith("chunked-loss: Liger-Kernel")
    assert "pip install liger-kernel" in reason or "CUDA" in reason


def test_torchtunes_chunked_output_loss_never_holds_the_whole_float32_logits():
    """chunked-output-loss (torchtune's CEWithChunkedOutputLoss) on a bfloat16 Llama: the same loss
    as the model's own, to bfloat16 rounding, from eight slices of positions; the tracked peak falls
    by at least the seven eighths of the float32 copy of the logits that never exist at once."""
    model, losses, peaks = "hf:suites/configs/tiny-llama", {}, {}
    for name, techniques in (("plain", ()), ("sliced", (tech("chunked-output-loss"),))):
        trainer, batch = build_trainer(spec(model, techniques, batch_size=4, seq_len=64, lr=0.0))
        losses[name] = trainer.step(batch).item()
        peaks[name] = tracked_step(
            lambda t=trainer, b=batch: t.step(b), trainer.model, trainer.optimizer, CPU
        ).peak_tensor_bytes
    vocab = trainer.model.get_output_embeddings().head.out_features
    assert losses["sliced"] == pytest.approx(losses["plain"], rel=1e-6)
    assert peaks["plain"] - peaks["sliced"] >= 7 / 8 * 4 * 64 * vocab * 4
    assert trainer.proof()["chunked-output-loss.slices_per_step"] == 8


def test_chunked_output_loss_is_predicted_to_the_byte():
    """Its step on fake tensors is the tracked step: peak, what the peak held, its phase."""
    from tests.predict.test_fake import assert_predicted_exactly

    run = spec("hf:suites/configs/tiny-llama", (tech("chunked-output-loss"),), seq_len=64)
    assert_predicted_exactly(run)


@pytest.mark.cuda
def test_chunked_output_loss_on_cuda_is_its_predicted_peak():
    from bench.launch import Device
    from tests.helpers import isolated

    run = spec("llama-tiny", (tech("chunked-output-loss"),), batch_size=8, seq_len=256)
    record = isolated(run, Device("cuda", torch.cuda.get_device_name(0)))
    assert record["status"] == "ok", record
    assert record["peak_tensor_bytes"] == record["predicted_peak_tensor_bytes"]
