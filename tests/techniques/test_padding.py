"""The batch-forming techniques: equal losses on equal sequences, what each batch carries, and the
proof."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from bench.data import varlen
from bench.data.synthetic import samples_in, split
from bench.measure.memory import tracked_step
from bench.models import IGNORE
from bench.recipe import Recipe, tracked_steps
from bench.spec import Shapes
from bench.techniques import RunContext, build
from tests.helpers import spec, tech

CPU = torch.device("cpu")
# four sequences of one batch, far shorter than the seq_len they are padded to
LENGTHS = [
    5,
    17,
    3,
    11,
]
SEQ_LEN = 32


def _samples(vocab: int) -> list[varlen.Sample]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randint(varlen.FIRST_TOKEN, vocab, (n,), generator=g), i % 10)
        for i, n in enumerate(LENGTHS)
    ]


def _run(model: str, technique: str):
    """The model in eval mode (dropout off: the paths must agree exactly) with ``technique``
    applied, and its collator."""
    recipe = Recipe.of(
        spec(model, (tech(technique),), batch_size=len(LENGTHS), seq_len=SEQ_LEN, lengths=None), CPU
    )
    torch.manual_seed(0)
    trainer = recipe.stepper(recipe.ctx.model_spec.build(recipe.ctx.shapes))
    trainer.model.eval()  # the trainer sets training mode
    return trainer, recipe.techniques[0].batching(recipe.ctx).collate


def _per_sequence(logits: torch.Tensor, batch, objective: str) -> list[torch.Tensor]:
    """Each sequence's logits: a classifier's row, or a language model's positions of that
    sequence."""
    if objective == "classify":
        return list(logits)
    inputs = batch[0]
    if "cu_seq_lens_q" in inputs:
        cu = inputs["cu_seq_lens_q"].tolist()
        return [logits[0, a:b] for a, b in zip(cu, cu[1:])]
    return [logits[i, :n] for i, n in enumerate(LENGTHS)]


@pytest.mark.parametrize("model", ["bert-tiny", "tests.helpers:TINY_LM"])
@pytest.mark.parametrize("technique", ["dynamic-padding", "length-bucketing", "packing"])
def test_same_logits_and_loss_as_padding_to_max(model: str, technique: str) -> None:
    """Padding-free and dynamically padded batches give every sequence the logits and the loss it
    gets padded to seq_len, to float32 rounding: the mask, the restarted positions and the
    cumulative lengths keep sequences apart."""
    reference, pad = _run(model, "pad-to-max")
    trainer, collate = _run(model, technique)
    objective = trainer.spec.objective
    vocab = trainer.spec.vocab_size
    want_batch, got_batch = pad(_samples(vocab)), collate(_samples(vocab))
    with torch.no_grad():
        want = reference.spec.logits(reference.model, want_batch[0])
        got = trainer.spec.logits(trainer.model, got_batch[0])
        for a, b in zip(
            _per_sequence(want, want_batch, objective), _per_sequence(got, got_batch, objective)
        ):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            trainer.spec.loss(got, got_batch[1]),
            reference.spec.loss(want, want_batch[1]),
            rtol=1e-5,
            atol=1e-6,
        )


def test_packing_trains_as_padding_does() -> None:
    """One training step each, dropout off: packing's gradients are padding's (the packed row is the
    same sums)."""
    grads = {}
    for technique in ("pad-to-max", "packing"):
        trainer, collate = _run("bert-tiny", technique)
        batch = collate(_samples(trainer.spec.vocab_size))
        trainer.spec.loss(trainer.spec.logits(trainer.model, batch[0]), batch[1]).backward()
        grads[technique] = torch.cat(
            [p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]
        )
    torch.testing.assert_close(grads["packing"], grads["pad-to-max"], rtol=1e-4, atol=1e-6)


def test_packed_batch_has_no_padding_and_restarts_positions() -> None:
    inputs, labels = varlen.packed(_samples(128), "classify")
    assert inputs["input_ids"].shape == (1, sum(LENGTHS))
    assert varlen.real_tokens((inputs, labels)) == (sum(LENGTHS), sum(LENGTHS))
    assert inputs["cu_seq_lens_q"].tolist() == [0, 5, 22, 25, 36]
    assert inputs["position_ids"][0, 5:8].tolist() == [0, 1, 2] and inputs["max_length_q"] == 17
    padded = varlen.padded(_samples(128), SEQ_LEN, "classify")
    assert varlen.real_tokens(padded) == (sum(LENGTHS), len(LENGTHS) * SEQ_LEN)
    assert varlen.padded(_samples(128), None, "classify")[0]["input_ids"].shape == (4, 17)


def test_language_model_targets_never_cross_sequences() -> None:
    """In a packed row, each sequence's first token is no target (the previous sequence would
    predict it)."""
    inputs, labels = varlen.packed(_samples(48), "next-token")
    assert labels[0, [5, 22, 25]].tolist() == [-100] * 3
    assert (labels[0, :5] == inputs["input_ids"][0, :5]).all()


def test_packing_proof_names_the_attention_path() -> None:
    trainer, collate = _run("bert-tiny", "packing")
    with torch.no_grad():
        trainer.spec.logits(trainer.model, collate(_samples(128))[0])
    proof = trainer.techniques[0].proof(1)
    assert proof["attention_path"] == "nested-jagged-sdpa (cpu)"
    assert proof["attention_calls"] == 2  # bert-tiny's two layers, one forward


def test_packing_keeps_fewer_bytes_than_padding() -> None:
    """The tracked peak of a step on the same sequences: padded to seq_len against packed. Every
    activation scales with the tokens in the batch, 36 real against 128 padded here."""
    peaks = {}
    for technique in ("pad-to-max", "packing"):
        recipe = Recipe.of(
            spec("bert-tiny", (tech(technique),), batch_size=4, seq_len=64, lengths="uniform:4:16"),
            CPU,
        )
        trainer = recipe.stepper(recipe.model()[0])
        step = tracked_steps(trainer, recipe.batch(), recipe.feed(), 2)
        peaks[technique] = tracked_step(
            step, trainer.model, trainer.optimizer, CPU
        ).peak_tensor_bytes
    assert peaks["packing"] < 0.6 * peaks["pad-to-max"]


def _fixed(techniques: tuple, batch_size: int = 4):
    """A fixed-shape run (no lengths) of TINY_LM at seq_len 8, its recipe and batch."""
    run = spec("tests.helpers:TINY_LM", techniques, batch_size=batch_size, seq_len=8, lengths=None)
    recipe = Recipe.of(run, CPU)
    return recipe, recipe.batch()


def test_packing_without_lengths_packs_the_fixed_shape_rows_a_micro_batch_a_row() -> None:
    """TRL's padding-free rows as full as its packing fills them: each micro-batch's sequences of
    seq_len tokens in a row of its own, the rows stacked so that the micro-batches split them."""
    _, batch = _fixed((tech("packing"), tech("accumulate", micro_batches=2)))
    inputs, labels = batch
    assert inputs["input_ids"].shape == labels.shape == (2, 16)
    assert inputs["cu_seq_lens_q"].tolist() == [0, 8, 16] * 2 and inputs["max_length_q"] == 8
    assert inputs["position_ids"][1].tolist() == list(range(8)) * 2
    assert samples_in(batch) == 4
    for part in split(batch, 2):
        assert part[0]["input_ids"].shape == (1, 16) and part[0]["max_length_k"] == 8
        assert part[0]["cu_seq_lens_k"].tolist() == [0, 8, 16]
        assert part[1][0, 8] == IGNORE  # the second sequence's first token is no target


def test_packed_micro_batches_accumulate_the_gradients_of_the_rows_unpacked() -> None:
    """Each micro-batch packed in a row: the same targets, the same means, the same gradients as the
    fixed-shape rows split into micro-batches (dropout off)."""
    grads = {}
    for techniques in ((), (tech("packing"),)):
        recipe, batch = _fixed((*techniques, tech("accumulate", micro_batches=2)))
        torch.manual_seed(0)
        trainer = recipe.stepper(recipe.ctx.model_spec.build(recipe.ctx.shapes))
        trainer.model.eval()
        for inputs, labels in split(batch, 2):
            (trainer.spec.forward(trainer.model, inputs, labels)[1] / 2).backward()
        grads[bool(techniques)] = torch.cat([p.grad.flatten() for p in trainer.model.parameters()])
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-4, atol=1e-6)


def test_packed_rows_of_unequal_tokens_do_not_stack() -> None:
    with pytest.raises(ValueError, match="packed micro-batches of unequal tokens cannot be"):
        varlen.packed(_samples(48), "next-token", parts=2)


def test_buckets_batch_similar_lengths_and_cover_the_data() -> None:
    lengths = varlen.parse("uniform:1:100").sample(400, torch.Generator().manual_seed(0))
    batches = list(varlen.Buckets(lengths, 8, 10, torch.Generator().manual_seed(0)))
    assert sorted(i for b in batches for i in b) == list(range(400))
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(
        batches
    )
    assert spread < 10  # random batches of 8 from 1..100 spread about 78
    firsts = [min(lengths[i] for i in b) for b in batches[:10]]
    # the batches are shuffled again: a pass does not start with the short ones
    assert firsts != sorted(firsts)


def test_nested_is_unsupported_with_its_reason() -> None:
    technique = build(tech("nested"))
    ctx = RunContext(
        device=CPU,
        model_spec=Recipe.of(spec("bert-tiny"), CPU).ctx.model_spec,
        shapes=Shapes(batch_size=4, seq_len=16),
    )
    assert "jagged NestedTensor" in technique.unsupported(ctx)


def test_feed_gives_the_same_batches_every_pass() -> None:
    recipe = Recipe.of(
        spec(
            "bert-tiny",
            (tech("dynamic-padding"),),
            batch_size=4,
            seq_len=64,
            lengths="lognormal:18:1.27:64",
        ),
        CPU,
    )
    feed = recipe.feed()
    first = [b[0]["input_ids"] for b in feed.batches(3)]
    again = [b[0]["input_ids"] for b in feed.batches(3)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert len(feed.waits_ms) == 3 and all(real <= total for real, total in feed.tokens)
    assert len({b.shape[1] for b in first}) > 1  # each padded to its own longest


def test_loader_workers_give_the_same_batches() -> None:
    """num_workers moves collation to worker processes; the batches are the same."""

    def first_batches(workers: int) -> list[torch.Tensor]:
        recipe = Recipe.of(
            spec(
                "bert-tiny",
                (tech("packing"),),
                batch_size=4,
                seq_len=64,
                lengths="uniform:4:64",
                loader_workers=workers,
            ),
            CPU,
        )
        return [b[0]["input_ids"] for b in recipe.feed().batches(2)]

    assert all(torch.equal(a, b) for a, b in zip(first_batches(0), first_batches(2)))


def test_padding_loss_ignores_padding() -> None:
    """The padded language-model loss is over real next tokens only: as many as the packed one."""
    batch = varlen.padded(_samples(48), SEQ_LEN, "next-token")
    following = F.pad(batch[1][:, 1:], (0, 1), value=-100)
    assert int((following != -100).sum()) == sum(n - 1 for n in LENGTHS)


def test_a_measured_run_records_what_its_batches_carried() -> None:
    """The worker's record of a variable-length run: tokens with and without padding, the padding of
    each batch, the loader's wait, and a prediction made on the same batches."""
    from bench.worker import measure

    figures = {}
    for technique in ("pad-to-max", "packing"):
        run = spec(
            "bert-tiny",
            (tech(technique),),
            batch_size=4,
            seq_len=64,
            lengths="uniform:4:32",
            measure_steps=3,
        )
        figures[technique] = measure(run, CPU).to_flat()
    pad, pack = figures["pad-to-max"], figures["packing"]
    assert pack["padding_fraction"] == 0 and pack["padding_fraction_per_batch"] == [0.0] * 3
    assert 0.5 < pad["padding_fraction"] < 1 and len(pad["padding_fraction_per_batch"]) == 3
    assert (
        pad["real_tokens_per_s"] < pad["tokens_per_s"]
        and pack["real_tokens_per_s"] == pack["tokens_per_s"]
    )
    assert (
        pack["loader"] == "packing"
        and pack["lengths"] == "uniform:4:32"
        and pack["loader_wait_ms_median"] >= 0
    )
    assert pack["proof"]["packing.attention_path"] == "nested-jagged-sdpa (cpu)"
    assert pack["peak_tensor_bytes"] < pad["peak_tensor_bytes"]
    assert pack["predicted_status"] == "ok"
    assert pack["predicted_peak_tensor_bytes"] < pad["predicted_peak_tensor_bytes"]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packing_on_cuda_takes_the_variable_length_kernels(dtype: torch.dtype) -> None:
    """On a GPU, 16-bit packed attention without dropout runs torch's varlen flash kernel, float32 a
    jagged NestedTensor through SDPA; either gives each sequence the logits padding to seq_len gives
    it."""
    cuda = torch.device("cuda")
    logits = {}
    for technique in ("pad-to-max", "packing"):
        recipe = Recipe.of(
            spec("bert-tiny", (tech(technique),), batch_size=len(LENGTHS), seq_len=SEQ_LEN), cuda
        )
        torch.manual_seed(0)
        trainer = recipe.stepper(recipe.ctx.model_spec.build(recipe.ctx.shapes).to(cuda, dtype))
        trainer.model.eval()
        batch = recipe.techniques[0].batching(recipe.ctx).collate(_samples(128))
        inputs = {k: v.to(cuda) if isinstance(v, torch.Tensor) else v for k, v in batch[0].items()}
        with torch.no_grad():
            logits[technique] = trainer.spec.logits(trainer.model, inputs).float()
        proof = trainer.techniques[0].proof(1)
    want = "torch.nn.attention.varlen" if dtype == torch.bfloat16 else "nested-jagged-sdpa (cuda)"
    assert proof["attention_path"] == want
    tolerance = (
        {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    )
    torch.testing.assert_close(logits["packing"], logits["pad-to-max"], **tolerance)
