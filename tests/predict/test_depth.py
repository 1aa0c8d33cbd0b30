"""A deep model's step folded from its steps at 1, 2 and 3 layers (bench.predict.depth), held to the
whole step traced layer by layer: every figure equal to the byte, the replay on a card included,
for training with the techniques that treat every layer alike, generation and forward passes; and
each model or technique the fold cannot prove repeating traced whole, saying why."""

import dataclasses
from dataclasses import replace

import pytest
import torch
from torch import nn

from bench.measure.tracker import FREED, MADE, OP, Moment
from bench.models import MODELS
from bench.models.text import LLAMA_TINY, _llama
from bench.predict import depth, fake, predict
from bench.predict.cards import CARDS
from tests.helpers import generation, spec, tech

# llama-tiny's layers, eight of them: deep enough to fold (depth.FOLD_FROM)
LLAMA_TINY_8 = replace(
    MODELS.get("llama-tiny"),
    name="llama-tiny-8",
    build=lambda shapes: _llama(shapes, **(LLAMA_TINY | {"num_hidden_layers": 8})),
)
DEEP = "tests.predict.test_depth:LLAMA_TINY_8"


def both_ways(run, monkeypatch, card="rtx4090", proven=False):
    """The run predicted folded, then traced whole; its fold proven afresh at three depths unless
    ``proven`` (a template made before is kept)."""
    if not proven:
        monkeypatch.setattr(fake, "TEMPLATES", {})
    folded = predict(run, card=CARDS[card])
    monkeypatch.setattr(depth, "FOLD_FROM", 10**9)
    return folded, predict(run, card=CARDS[card])


def differences(a, b) -> dict:
    left, right = dataclasses.asdict(a), dataclasses.asdict(b)
    return {k: (left[k], right[k]) for k in left if left[k] != right[k] and k != "depth"}


@pytest.mark.parametrize(
    "run",
    [
        spec(DEEP, batch_size=2, seq_len=16),
        spec(DEEP, (tech("checkpoint"),), batch_size=2, seq_len=16),
        spec(DEEP, (tech("lora"),), batch_size=2, seq_len=16),
        spec(DEEP, (tech("amp", dtype="bfloat16"),), batch_size=2, seq_len=16),
        spec(DEEP, (tech("bf16"),), batch_size=2, seq_len=16),
        spec(DEEP, (tech("optimizer-in-backward"),), batch_size=2, seq_len=16),
        spec(DEEP, (tech("chunked-loss"),), batch_size=2, seq_len=16),
        spec(
            DEEP,
            (tech("amp", dtype="bfloat16"), tech("checkpoint"), tech("lora")),
            batch_size=2,
            seq_len=16,
        ),
        # ten new tokens: the decode forwards past the fourth grown too (fake._untraced_decodes)
        replace(generation(new_tokens=10), model=DEEP),
        replace(generation((tech("kv-cache", kind="static"),), new_tokens=10), model=DEEP),
        spec("bert-base", batch_size=2, seq_len=16, mode="inference"),
        spec("bert-base", batch_size=2, seq_len=16),
        spec("vit-b16", batch_size=2, image_size=32),
        spec(DEEP, (tech("accumulate", micro_batches=8),), batch_size=8, seq_len=16),
        pytest.param(  # the longest here (33 s): make test-full's
            spec(
                DEEP,
                (
                    tech("amp", dtype="bfloat16"),
                    tech("checkpoint"),
                    tech("lora"),
                    tech("accumulate", micro_batches=5),
                    tech("clip-grad-norm"),
                ),
                batch_size=5,
                seq_len=16,
            ),
            marks=pytest.mark.full,
        ),
        spec(DEEP, (tech("clip-grad-norm"),), batch_size=2, seq_len=16),
    ],
    ids=[
        "plain",
        "checkpoint",
        "lora",
        "amp-bf16",
        "bf16",
        "optimizer-in-backward",
        "chunked-loss",
        "amp+checkpoint+lora",
        "generation",
        "generation-static-cache",
        "bert-base-inference",
        "bert-base",
        "vit-b16",
        "accumulate-8",
        "amp+checkpoint+lora+accumulate-5+clip",  # a TrainingArguments job's techniques
        "clip-grad-norm",
    ],
)
def test_a_deep_step_folded_from_three_shallow_ones_is_the_whole_step_to_the_byte(run, monkeypatch):
    folded, whole = both_ways(run, monkeypatch)
    assert folded.depth.endswith("layers, folded from steps at 1, 2 and 3 of them"), folded.depth
    assert folded.ok and differences(folded, whole) == {}


def at(run, **shapes):
    return replace(run, gpu=replace(run.gpu, **shapes))


@pytest.mark.parametrize(
    "run, other",
    [
        (spec(DEEP, batch_size=2, seq_len=16), {"batch_size": 3}),
        (
            spec(
                DEEP,
                (
                    tech("amp", dtype="bfloat16"),
                    tech("checkpoint"),
                    tech("lora"),
                    tech("clip-grad-norm"),
                ),
                seq_len=16,
            ),
            {"batch_size": 5, "seq_len": 24},
        ),
        pytest.param(  # 16 s: make test-full's
            spec(DEEP, (tech("accumulate", micro_batches=6),), batch_size=12, seq_len=16),
            {"batch_size": 18},
            marks=pytest.mark.full,
        ),
        (
            replace(generation(), model=DEEP),
            {"prompt_len": 12, "seq_len": 12 + generation().gpu.new_tokens},
        ),
    ],
    ids=["plain", "amp+checkpoint+lora+clip", "accumulate-6", "generation"],
)
def test_the_same_step_at_another_size_refolds_from_two_shallow_ones_to_the_byte(
    run, other, monkeypatch
):
    """A search's next batch or prompt: its steps at 1 and 2 layers follow the fold proven at the
    first size but for their bytes, and the step at 3 layers is not traced."""
    monkeypatch.setattr(fake, "TEMPLATES", {})
    assert predict(run, card=CARDS["rtx4090"]).depth.endswith("1, 2 and 3 of them")
    depths = []
    traced = fake._traced
    monkeypatch.setattr(
        fake, "_traced", lambda *a, **k: depths.append(a[5:] or [None]) or traced(*a, **k)
    )
    folded, whole = both_ways(at(run, **other), monkeypatch, proven=True)
    assert folded.depth.endswith("layers, folded from steps at 1 and 2 of them, as proven at 3")
    assert [d[0] for d in depths] == [1, 2, None]  # the whole step, traced to hold it to
    assert folded.ok and differences(folded, whole) == {}


def test_a_step_that_differs_at_another_size_but_in_bytes_is_folded_afresh(monkeypatch):
    """BERT at batch 1 makes a backward storage fewer than at batch 2: its steps at 1 and 2 layers
    do not follow the fold proven at batch 2, and the step at 3 layers proves its own."""
    run = spec("bert-base", batch_size=2, seq_len=16)
    monkeypatch.setattr(fake, "TEMPLATES", {})
    predict(run, card=CARDS["rtx4090"])
    folded, whole = both_ways(at(run, batch_size=1), monkeypatch, proven=True)
    assert folded.depth == "12 layers, folded from steps at 1, 2 and 3 of them"
    assert differences(folded, whole) == {}


@pytest.mark.parametrize(
    "technique, why",
    [
        (tech("checkpoint", every=4), "checkpoint treats layers by their place"),
        (tech("share-layers"), "share-layers treats layers by their place"),
    ],
)
def test_a_technique_that_treats_layers_by_their_place_is_traced_whole(technique, why, monkeypatch):
    folded, whole = both_ways(spec(DEEP, (technique,), batch_size=2, seq_len=16), monkeypatch)
    assert folded.depth == f"8 layers, traced whole: {why}"
    assert differences(folded, whole) == {}


def test_a_stack_of_layers_that_differ_is_not_folded():
    alike = nn.Sequential(nn.ModuleList(nn.Linear(4, 4) for _ in range(8)))
    assert depth.depth_of(alike) == (8, "")
    wider = nn.Sequential(nn.ModuleList(nn.Linear(4, 4 + i % 2) for i in range(8)))
    assert depth.depth_of(wider) == (8, "its layers differ (widths, attention windows or experts)")
    depth.truncate(alike, 3)
    assert len(alike[0]) == 3


def made(n: int, raw: int = 0) -> Moment:
    return Moment(MADE, n, "forward", raw=raw)


def freed(n: int, raw: int = 0) -> Moment:
    return Moment(FREED, n, "forward", raw=raw)


def test_frees_follow_the_rule_both_shallow_steps_obey():
    """A layer saves 8 bytes in forward and frees them in backward, last layer first: the mirror
    copy's, as backward runs the layers in reverse."""
    base = [made(1), made(8), freed(8), freed(1)]
    block_forward, block_backward = [made(8)], [freed(8)]
    steps = []
    for layers in (1, 2, 3):
        extra = layers - 1
        line = [made(1), made(8), *block_forward * extra, *block_backward * extra, freed(8)]
        line.append(freed(1))
        steps.append(line)
    found = depth.pattern(*steps)
    assert found is not None and [len(x) for _, x in found.blocks] == [1, 1]
    assert [found.moment(o) for o in found.origins(0)] == base
    seen = [
        sample
        for layers, line in zip((1, 2, 3), steps, strict=True)
        for sample in depth.samples(found, layers - 1, _indexed(line))
    ]
    rules = depth.rules(seen)
    assert rules is not None
    # four copies: the fourth layer's saved bytes are freed first
    out = depth.unfold(found, rules, 4)
    frees = [m.index for m in out if m.kind == FREED]
    assert frees == [5, 4, 3, 2, 1, 0]


def _indexed(line: list[Moment]) -> list[Moment]:
    """Each MADE its storage's index, each FREED the index of what it frees (last made, first
    freed, as the lines above are built)."""
    out, alive = [], []
    for m in line:
        if m.kind == MADE:
            alive.append(len([x for x in out if x.kind == MADE]))
            out.append(m.indexed(alive[-1]))
        elif m.kind == FREED:
            out.append(m.indexed(alive.pop()))
        else:
            out.append(m)
    return out


def _clipped(layers: int) -> list[Moment]:
    """clip_grad_norm_ over a model of ``layers`` layers, two gradients each, with one before them
    and two after: a norm per gradient, their stack (4 bytes a norm, one 512-byte block below 128
    of them) and its norm; then the stack freed and the list of norms, last to first; then each
    gradient scaled, and the total norm freed. Each storage indexed by its place among those
    made."""
    norms = 1 + 2 * layers + 2
    stack = -(-4 * norms // 512) * 512
    dev, vector_norm = Moment(OP, 0, "device"), Moment(OP, 0, "vector_norm")
    line = [m for i in range(norms) for m in (made(512, raw=4).indexed(i), vector_norm)]
    line += [dev] * 2 * norms + [made(stack, raw=4 * norms).indexed(norms), Moment(OP, 0, "stack")]
    line += [made(512, raw=4).indexed(norms + 1), vector_norm]
    line += [freed(stack, raw=4 * norms).indexed(norms)]
    line += [freed(512, raw=4).indexed(i) for i in reversed(range(norms))]
    line += [dev] * 2 * norms + [Moment(OP, 0, "mul_")] * norms
    return line + [freed(512, raw=4).indexed(norms + 1)]


def test_a_run_of_frees_alike_is_read_as_a_set_and_a_storage_growing_with_depth_grows():
    """clip_grad_norm_'s norms, one a gradient, alike and freed last to first in one run: read as
    they came, the frees of a layer's norms fall where the diff puts the layer's block and no rule
    names them; read as a set, one does. Its stack of norms is one block at three layers and five
    at 300, as the whole step's is."""
    lines = [_clipped(layers) for layers in depth.DEPTHS]
    found = depth._learnt(lines, copies=299)
    assert not isinstance(found, str)
    learnt, unfolded = found
    assert learnt.sets and len(learnt.growth) == 1  # the stack, 8 bytes a layer
    out = depth._grown(unfolded, learnt.pattern, learnt.growth, 299, 512)
    assert out == _clipped(300)  # kinds, bytes and labels
    assert [(m.n, m.raw) for m in out if m.kind == MADE and m.raw > 4] == [(2560, 4 * 603)]
    made_raw = {m.index: m.raw for m in out if m.kind == MADE}
    assert all(m.raw == made_raw[m.index] for m in out if m.kind == FREED)
    # the stack first, then every norm in some order, the total norm last
    frees = [m.index for m in out if m.kind == FREED]
    assert frees[0] == 603 and sorted(frees[1:-1]) == list(range(603)) and frees[-1] == 604


def test_folding_leaves_the_models_own_config_whole(monkeypatch):
    """A config.json's model spec builds every model of the run from one config: the shallow steps
    are cut from copies of it, and the model built after them has all its layers."""
    from bench import models

    name = "hf:suites/configs/llama-3.2-1b"
    run = spec(name, batch_size=1, seq_len=16)
    folded, whole = both_ways(run, monkeypatch)
    assert folded.depth == "16 layers, folded from steps at 1, 2 and 3 of them"
    assert differences(folded, whole) == {}
    with torch.device("meta"):
        built = models.resolve(name).build(run.gpu)
    assert built.config.num_hidden_layers == len(built.model.layers) == 16
