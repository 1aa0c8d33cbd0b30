"""A search's batches read off the line through two traced ones (bench.predict.lines): the step
read off the line at a third batch is, to the byte, the step a trace makes there, and a line that
does not hold is dropped, never believed."""

from dataclasses import replace

import pytest
import torch

from bench.measure.tracker import MADE, LiveBytes
from bench.predict import largest_batch
from bench.predict.budget import largest_batch_on, longest_context
from bench.predict.cards import CARDS
from bench.predict.fake import Traced, traced
from bench.predict.lines import Line, Sizes, Timelines
from tests.helpers import generation, spec, tech

L40S = CARDS["l40s"]
RUNS = {
    "vit, accumulating": spec("vit-tiny", (tech("accumulate", micro_batches=2),), batch_size=4),
    "bert, amp and checkpoint": spec(
        "bert-tiny", (tech("amp", dtype="bfloat16"), tech("checkpoint")), batch_size=2
    ),
    "llama, lora": spec("llama-tiny", (tech("lora"),), batch_size=2),
}


def at(run, batch: int, card=L40S):
    return traced(run, replace(run.gpu, batch_size=batch), card=card)


@pytest.mark.parametrize("name", RUNS)
def test_the_step_read_off_the_line_is_the_traced_step_to_the_byte(name):
    run = RUNS[name]
    unit = 2 if "accumulating" in name else 1
    a, b, c = (at(run, n * unit) for n in (2, 3, 7))
    line = Line.through(
        [(2 * unit, Timelines.of(a.tracker)), (3 * unit, Timelines.of(b.tracker))], 512
    )
    assert line is not None
    assert line.at(7 * unit).exactly() == Timelines.of(c.tracker).exactly()
    # read through the allocator as the traced step was: the same reserved peak and verdict
    sizes = Sizes.of_batch(run, run.gpu, card=L40S)
    sizes.seed(2 * unit, a)
    sizes.seed(3 * unit, b)
    read = sizes(7 * unit)
    assert 7 * unit in sizes.read
    for figure in ("peak_tensor_bytes", "peak_reserved_bytes", "peak_allocated_bytes", "verdict"):
        assert getattr(read, figure) == getattr(c.prediction, figure), figure


def test_a_tracker_keeps_each_storages_bytes_before_rounding():
    tracker = LiveBytes(torch.device("cpu"), rounding=512)
    with tracker:
        x = torch.empty(3, dtype=torch.uint8)
    made = [m for m in tracker.steps()[0] if m.kind == MADE]
    assert [(m.n, m.raw) for m in made] == [(512, 3)]
    del x


def test_steps_that_differ_but_in_their_bytes_make_no_line():
    """bert at a batch of one makes a storage fewer in backward (a sum over a dimension of one is a
    view there): no line through it."""
    run = spec("bert-tiny", batch_size=2)
    one, two, three = (Timelines.of(at(run, n).tracker) for n in (1, 2, 3))
    assert Line.through([(1, one), (2, two)], 512) is None
    assert Line.through([(2, two), (3, three)], 512) is not None


def test_bytes_that_do_not_grow_by_a_whole_number_a_sample_make_no_line():
    run = spec("vit-tiny", batch_size=2)
    two, four = (Timelines.of(at(run, n).tracker) for n in (2, 4))
    assert Line.through([(2, two), (4, four)], 512) is not None
    # read as batches 2 and 5: a storage of 2·k bytes more over three samples is no whole number
    grown = [m.raw for m in four.measured if m.kind == MADE]
    assert any((g - m.raw) % 3 for g, m in zip(grown, (m for m in two.measured if m.kind == MADE)))
    assert Line.through([(2, two), (5, four)], 512) is None


def test_a_line_that_does_not_hold_at_the_answer_is_dropped_and_the_search_traced(monkeypatch):
    """A line that reads every step a sample too large (as a step that is not a line would): its
    answer is traced again, disagrees, and the search runs again, traced, to the traced answer."""
    run = spec("vit-tiny", batch_size=4)
    budget = at(run, 40, card=None).prediction.peak_tensor_bytes
    truth = largest_batch(run, budget)
    through = Line.through

    def off(samples, rounding):
        line = through(samples, rounding)
        return line and replace(line, sizes=tuple(n - 1 for n in line.sizes))

    monkeypatch.setattr(Line, "through", staticmethod(off))
    assert largest_batch(run, budget) == truth


def test_the_largest_batch_on_a_card_is_the_one_every_batch_traced_finds(monkeypatch):
    run = RUNS["llama, lora"]
    card = replace(L40S, memory=2**28, context=0)
    said: list[str] = []
    read = largest_batch_on(run, card, progress=said.append)
    assert any("read off the line" in line for line in said), said  # the line was used
    monkeypatch.setattr(Line, "through", staticmethod(lambda *a, **k: None))
    assert read == largest_batch_on(run, card)


def prompts(run):
    return lambda n: replace(run.gpu, prompt_len=n, new_tokens=2, seq_len=n + 2)


@pytest.mark.parametrize("techniques", [(), (tech("kv-cache", kind="static"),)])
def test_a_generation_read_off_the_curve_through_three_prompts_is_the_traced_one(techniques):
    """Attention's scores over a prompt grow as its square (llama-tiny's grouped keys take the
    math kernel): three prompts give each storage's parabola, and a fourth read off it is the
    traced generation to the byte."""
    run = generation(techniques, batch_size=2, prompt_len=64, new_tokens=2)
    sizes = Sizes(run, prompts(run), card=L40S, named="prompts", degree=2)
    for n in (64, 128, 192):
        sizes.trace(n)
    assert sizes.line is not None and len(sizes.line.sizes) == 3
    read = sizes(448)
    fresh = traced(run, prompts(run)(448), card=L40S)
    assert sizes.line.at(448).exactly() == Timelines.of(fresh.tracker).exactly()
    for figure in ("peak_tensor_bytes", "peak_decode_bytes", "peak_reserved_bytes", "verdict"):
        assert getattr(read, figure) == getattr(fresh.prediction, figure), figure
    # through two of them, the line misses the square
    two = Line.through([(n, Timelines.of(sizes.traced[n].tracker)) for n in (64, 128)], 512)
    assert two is None or two.at(448).exactly() != Timelines.of(fresh.tracker).exactly()


def test_the_longest_context_on_a_card_is_the_one_every_prompt_traced_finds(monkeypatch):
    run = generation(batch_size=2, prompt_len=256, new_tokens=8)
    card = replace(L40S, memory=2**27, context=0)
    said: list[str] = []
    read = longest_context(run, card=card, step=64, progress=said.append)
    assert any("read off the curve" in line for line in said), said  # the curve was used
    monkeypatch.setattr(Line, "through", staticmethod(lambda *a, **k: None))
    assert read is not None and read == longest_context(run, card=card, step=64)


def test_a_prediction_made_already_is_not_made_again_even_without_its_tracker(monkeypatch):
    """advise hands a search its cached prediction, which has no tracker: its figure is used."""
    run = spec("vit-tiny", batch_size=4)
    own = traced(run, card=None, reserved=False)
    calls = []
    monkeypatch.setattr(
        "bench.predict.lines.traced", lambda *a, **k: calls.append(a[1]) or traced(*a, **k)
    )
    largest_batch(run, own.prediction.peak_tensor_bytes, own=Traced(own.prediction))
    assert run.gpu not in calls  # the run's own batch: never traced again
