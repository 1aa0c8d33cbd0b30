from dataclasses import replace

import pytest
import torch

from bench.data import real
from bench.fidelity import _batches, run_fidelity
from bench.models import IGNORE, MODELS
from bench.record import Accuracy
from bench.suite import Fidelity, Shapes
from tests.helpers import TINY_LM, spec, tech

CPU = torch.device("cpu")
QUICK = Fidelity(steps=60, batch_size=32, lr=1e-3, seeds=2, image_size=16)


def fidelity(*techniques, name="run", model="vit-tiny", **kw):
    return run_fidelity(spec(model, tuple(techniques), name=name, **kw), QUICK, CPU)


def test_baseline_training_is_deterministic_and_learns_digits_above_chance():
    first, again = fidelity(name="baseline"), fidelity(name="baseline")
    assert first.accuracy_seeds == again.accuracy_seeds and len(first.accuracy_seeds) == 2
    assert first.accuracy == first.accuracy_seeds[0] > 0.3  # chance is 0.1
    assert abs(first.grad_cosine - 1) < 1e-9 and first.fidelity_test_size == 359


def test_checkpointing_without_dropout_or_batch_norm_changes_nothing():
    base, ckpt = fidelity(name="baseline"), fidelity(tech("checkpoint"))
    assert ckpt.accuracy == base.accuracy and ckpt.final_loss == base.final_loss
    assert abs(ckpt.grad_cosine - 1) < 1e-6
    delta = Accuracy.of(ckpt, base)
    assert delta.delta == 0.0 and delta.outside_band is False


def test_a_technique_that_stops_learning_falls_outside_the_band():
    base, broken = fidelity(name="baseline"), fidelity(tech("tests.helpers:ZeroLearningRate"))
    delta = Accuracy.of(broken, base)
    assert delta.delta < -0.2 and delta.outside_band is True
    assert broken.grad_cosine > 0.999  # its first gradient was right; only the update is broken


@pytest.mark.full
@pytest.mark.slow
def test_bert_tiny_learns_digit_sequences_well_above_chance():
    """The token path (64 intensity tokens) learns too: BertConfig's default initialisation, sized
    for hidden 768, left bert-tiny at 18-19% after these 100 steps."""
    out = run_fidelity(spec("bert-tiny", (), name="baseline"), replace(QUICK, steps=100), CPU)
    assert min(out.accuracy_seeds) > 0.3  # chance is 0.1


def test_a_language_model_is_scored_on_the_class_token_it_predicts():
    """An oracle that always predicts the class token one position early scores 100% only if the
    scores are read at that position, over the class tokens (that a real one learns: the README's
    Llama test)."""
    oracle = run_fidelity(spec("tests.helpers:ORACLE_LM"), replace(QUICK, steps=2, seeds=1), CPU)
    assert oracle.accuracy == 1.0
    train, _ = real.load("digits", "tokens", 8)
    sequences = real.with_label_token(train)
    assert torch.equal(sequences.inputs[:, -1], real.LABEL_TOKEN + train.labels)


def test_a_padded_language_model_gets_its_class_after_the_last_token_and_no_padding_targets(
    tmp_path,
):
    """Saved token ids of three lengths, padded to the longest: the class token follows each
    sequence's own last token, padding is no target, and the oracle is scored where each sequence's
    class is predicted."""
    datasets = pytest.importorskip("datasets")
    rows = [[real.CLS, 5, 6], [real.CLS, 7], [real.CLS, 8, 9, 4]] * 8
    saved = datasets.Dataset.from_dict({"input_ids": rows, "labels": [0, 1, 2] * 8})
    datasets.DatasetDict({"train": saved, "test": saved.select(range(3))}).save_to_disk(
        tmp_path / "tok"
    )
    fid = replace(QUICK, dataset=f"hf:{tmp_path / 'tok'}", batch_size=4, steps=2, seeds=1)
    assert run_fidelity(spec("tests.helpers:ORACLE_LM"), fid, CPU).accuracy == 1.0
    c, pad = real.LABEL_TOKEN, real.PAD
    padded = torch.tensor([[real.CLS, 5, 6, pad], [real.CLS, 7, pad, pad], [real.CLS, 8, 9, 4]])
    sequences = real.with_label_token(real.Labelled(padded, torch.tensor([0, 1, 2])))
    assert sequences.inputs.tolist() == [
        [real.CLS, 5, 6, c, pad],
        [real.CLS, 7, c + 1, pad, pad],
        [real.CLS, 8, 9, 4, c + 2],
    ]
    inputs, targets = next(_batches(sequences, replace(fid, batch_size=3), 0, CPU, TINY_LM))
    assert (
        torch.equal(targets == IGNORE, inputs["input_ids"] == real.PAD)
        and (targets == IGNORE).sum() == 3
    )


def test_a_dataset_smaller_than_the_batch_is_refused_instead_of_waiting_forever():
    with pytest.raises(
        real.DataError, match=r"1438 training samples, fewer than \[fidelity\] batch_size = 2000"
    ):
        run_fidelity(spec("vit-tiny"), replace(QUICK, batch_size=2000), CPU)


def test_a_language_model_too_small_for_the_class_tokens_is_refused():
    small = replace(spec("tests.helpers:TINY_LM"), model="tests.helpers:SMALL_VOCAB_LM")
    with pytest.raises(real.DataError, match=r"has 24 tokens; its 10 classes are tokens 20…29"):
        run_fidelity(small, QUICK, CPU)


def test_dropout_gets_the_same_masks_in_the_reference_gradient():
    assert fidelity(model="bert-tiny", name="baseline").grad_cosine > 0.9999


def test_inference_runs_train_the_plain_model_then_evaluate_under_the_technique():
    base = fidelity(name="baseline", mode="inference")
    half = fidelity(tech("half", dtype="bfloat16"), mode="inference")
    assert base.fidelity_agreement == 1.0 and 0.9 < half.fidelity_agreement < 1.0 + 1e-9
    assert abs(half.accuracy - base.accuracy) < 0.05


def test_the_phase_trains_from_the_pretrained_weights(tmp_path):
    # A head that always says 3, and a learning rate of zero: what is evaluated is exactly what was
    # loaded.
    torch.manual_seed(1)
    state = MODELS.get("resnet-tiny").build(Shapes(batch_size=1, image_size=16)).state_dict()
    state["fc.weight"].zero_()
    state["fc.bias"].zero_()[3] = 100.0
    torch.save(state, tmp_path / "threes.pt")
    fid = replace(QUICK, steps=1, lr=0.0, weights=str(tmp_path / "threes.pt"))
    out = run_fidelity(spec("resnet-tiny", ()), fid, CPU)
    test_labels = real.load("digits", "image", 16)[1].labels
    assert out.accuracy == (test_labels == 3).float().mean().item()
    # 100 for every digit but the threes; about 2.3 from random weights
    assert out.fidelity_test_loss > 80
    assert out.fidelity_weights == str(tmp_path / "threes.pt")


def test_a_masked_language_model_is_told_the_phase_has_no_task_for_it():
    masked = spec("hf:suites/configs/tiny-bert-classifier#masked-lm", seq_len=32)
    with pytest.raises(
        real.DataError, match=r"masked language model: the fidelity phase has no task"
    ):
        run_fidelity(masked, QUICK, CPU)
