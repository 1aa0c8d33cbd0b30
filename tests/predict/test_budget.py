import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from bench.predict import RESERVE, Budget, largest_batch, parse_size, predict, tensor_budget
from bench.predict.budget import largest
from bench.predict.fake import Traced, traced
from bench.record import Prediction
from tests.helpers import generation, spec, tech

RESULTS = Path(__file__).parent.parent.parent / "results"


def test_budget_search_finds_the_largest_batch_that_fits_in_a_handful_of_predictions(monkeypatch):
    run = spec("vit-tiny", (tech("accumulate", micro_batches=2),), batch_size=16)
    budget = predict(run, replace(run.gpu, batch_size=40)).peak_tensor_bytes
    calls = []
    monkeypatch.setattr(
        "bench.predict.lines.traced", lambda *a, **k: calls.append(a) or traced(*a, **k)
    )
    best = largest_batch(run, budget)
    assert best is not None and best % 2 == 0 and best >= 40
    over = predict(run, replace(run.gpu, batch_size=best + 2)).peak_tensor_bytes
    assert predict(run, replace(run.gpu, batch_size=best)).peak_tensor_bytes <= budget < over
    # traced at its own batch and the next it tries; the rest read off the line through both, the
    # answer traced again
    assert len(calls) == 3
    assert largest_batch(run, 1000) is None


@pytest.mark.parametrize(
    "peak",
    [
        lambda b: 10_000 + 300 * b,  # linear
        # steps: a guess off the line, bisection finishes
        lambda b: 10_000 + 300 * b + 4_000 * (b // 7),
        lambda b: 10_000 + 3 * b * b,  # convex
        # unpredictable past 50: does not fit
        lambda b: 10_000 + 300 * b if b < 50 else float("nan"),
        # the optimizer step holds the peak at small batches
        lambda b: max(30_000, 10_000 + 300 * b),
    ],
)
def test_budget_search_agrees_with_trying_every_batch(monkeypatch, peak):
    run = spec("vit-tiny", batch_size=16)
    calls = []

    def fake(spec, shapes, cuda=True, card=None, reserved=True):
        calls.append(shapes.batch_size)
        value = peak(shapes.batch_size)
        if value != value:
            return Traced(Prediction(status="unpredictable"))
        return Traced(Prediction(status="ok", peak_tensor_bytes=value))  # no tracker: no line

    monkeypatch.setattr("bench.predict.lines.traced", fake)
    for budget in (5_000, 10_300, 20_000, 24_567, 60_000, 10**9):
        fits = [b for b in range(1, (1 << 16) + 1) if (p := peak(b)) == p and p <= budget]
        calls.clear()
        assert largest_batch(run, budget, limit=1 << 16) == (max(fits) if fits else None), budget
        # bounded by three times doubling then bisection over 1…65536
        assert len(calls) <= 3 * 17, calls


def test_sizes_parse_with_binary_and_decimal_units():
    assert (
        parse_size("16GiB") == 16 * 2**30
        and parse_size("80GB") == 80 * 10**9
        and parse_size("512") == 512
    )
    for wrong in ("lots", "-1GiB", "infGB", "16XB"):
        with pytest.raises(ValueError, match="expected a size"):
            parse_size(wrong)


def test_a_budget_is_the_cards_memory_less_the_reserve():
    assert tensor_budget("16GiB") == 16 * 2**30 - 1280 * 2**20
    assert tensor_budget("80GB", "0") == 80 * 10**9
    with pytest.raises(ValueError, match="--reserve 'some': expected a size"):
        tensor_budget("16GiB", "some")
    with pytest.raises(
        ValueError, match="--reserve 1280MiB leaves nothing of --budget 1GiB for tensors"
    ):
        tensor_budget("1GiB")


def test_the_default_reserve_holds_what_every_cuda_record_held_besides_tensors():
    """The CUDA context (NVML's process memory less the allocator's reserve) and the allocator's own
    share of its peak (its allocated peak less the tracked tensors'), summed, in every committed
    CUDA record."""
    records = [json.loads(p.read_text()) for p in RESULTS.glob("*/*/*.json")]
    cuda = [
        r
        for r in records
        if r.get("device_type") == "cuda"
        and r.get("nvml_process_bytes")
        # a compiled step has no tracked tensors to set against the allocator's peak
        and r.get("peak_tensor_bytes")
    ]
    assert len(cuda) >= 14
    for r in cuda:
        context = r["nvml_process_bytes"] - r["peak_reserved_bytes"]
        allocator = r["peak_allocated_bytes"] - r["peak_tensor_bytes"]
        assert context > 0 and allocator > 0 and context + allocator <= parse_size(RESERVE), (
            r["suite"],
            r["run"],
        )


def test_every_command_reads_its_budget_one_way():
    # less the reserve, on a card
    assert Budget.parse("16GiB", "cuda").bytes() == 16 * 2**30 - 1280 * 2**20
    assert Budget.parse("16GiB", "cpu").bytes() == 16 * 2**30
    # advise: a share of the baseline's peak
    assert Budget.parse("60%", "cuda", share=True).bytes(1000) == 600
    with pytest.raises(ValueError, match="a share of the baseline's peak is for bench advise"):
        Budget.parse("60%", "cuda")  # predict and fit: there is no baseline to take a share of


def test_a_short_generation_out_of_memory_in_its_own_longer_prefill_does_not_cut_the_context(
    monkeypatch,
):
    """The probe of the last decode step prefills a prompt longer than the real one, of an odd
    length that fragments the allocator otherwise: on a card, its running out of memory in that
    prefill says nothing of the real generation (int8 weights on an RTX 4090 did so at 23,166 tokens
    where 23,040 fit whole, and the search climbed to its answer a whole generation at a time,
    minutes each). Only a decode that runs out of memory counts against a prompt."""
    from types import SimpleNamespace

    from bench.predict import budget
    from bench.predict.cards import card

    rtx = card("rtx4090")
    fits = 40 * 256  # the longest prompt whose generation (128 new tokens) the fake card holds

    wholes = []

    def fake(spec, at, card=None, reserved=False):
        wholes.extend([at.prompt_len] if at.new_tokens == 128 else [])
        over, odd = at.prompt_len + at.new_tokens > fits + 128, at.prompt_len % 256 != 0
        oom = "prefill" if odd and not over else ("decode" if over else None)
        return SimpleNamespace(
            ok=True,
            verdict="out of memory" if oom else "fits",
            oom_phase=oom,
            peak_reserved_bytes=rtx.capacity * at.prompt_len / (fits + 1),
        )

    monkeypatch.setattr(budget, "predict", fake)
    # the short generations, which a search reads off a curve where their steps make one
    monkeypatch.setattr(
        "bench.predict.lines.traced",
        lambda spec, at, cuda=True, card=None, reserved=False: Traced(fake(spec, at, card)),
    )
    monkeypatch.setattr(budget, "positions", lambda spec: 1 << 17)
    run = generation(new_tokens=128)
    assert budget.longest_context(run, card=rtx) == fits + 128
    # whole generations only confirm the answer the short ones led to
    assert wholes == [
        fits,
        fits + 256,
    ]


@pytest.mark.full
def test_the_longest_context_a_generation_holds_fits_whole_and_a_step_longer_does_not(monkeypatch):
    """Found to 256 tokens, led by short generations and confirmed by whole ones; a prompt shorter
    than its prefill's chunk is not a run of the entry, so the search begins past it. End to end
    (30 to 48 s of make test's CI machine): the search's rules each have their own test above and
    below."""
    from bench.predict.budget import longest_context

    run = generation(
        (tech("chunked-prefill", chunk=300),), batch_size=2, prompt_len=512, new_tokens=8
    )
    budget = 30 * 2**20

    def whole(prompt: int) -> int:
        at = replace(run.gpu, prompt_len=prompt, seq_len=prompt + 8)
        return predict(run, at, reserved=False).peak_tensor_bytes

    calls, shorts = [], []
    monkeypatch.setattr(
        "bench.predict.budget.predict", lambda *a, **k: calls.append(a[1]) or predict(*a, **k)
    )
    # the short generations are traced by the search's curve, not predicted one by one
    monkeypatch.setattr(
        "bench.predict.lines.traced", lambda *a, **k: shorts.append(a[1]) or traced(*a, **k)
    )
    longest = longest_context(run, budget=budget)
    assert longest is not None and (longest - 8) % 256 == 0
    assert whole(longest - 8) <= budget < whole(longest - 8 + 256)
    # 256 is not over the chunk of 300: not a run of it
    assert min(c.prompt_len for c in calls + shorts) == 512
    assert all(c.new_tokens == 2 for c in shorts)
    assert sum(c.new_tokens == 8 for c in calls) <= 3  # whole generations only to confirm
    assert longest_context(run, budget=2**20) is None


@pytest.mark.parametrize("over", [lambda value: value, lambda value: math.inf])
def test_a_figure_above_the_budget_narrows_the_search_as_a_card_out_of_memory_gives_one(over):
    """A card's out of memory says what was reserved and asked for: the line through both ends of
    the bracket then lands on the answer, where a failure without a figure leaves bisection to close
    the bracket."""
    calls = []
    peak = lambda n: 10_000 + 300 * n + 4_000 * (n // 64)  # noqa: E731  linear, with the allocator's steps

    def at(n: int) -> float:
        calls.append(n)
        return peak(n) if peak(n) <= 2_000_000 else over(peak(n))

    assert largest(at, 2_000_000, 1 << 16, start=16) == max(
        n for n in range(6_000) if peak(n) <= 2_000_000
    )
    assert len(calls) <= 8 if over(1.0) == 1.0 else len(calls) > 8, calls


@pytest.mark.parametrize("card", [None, "tiny"], ids=["budget", "card"])
def test_the_longest_sequence_a_step_holds_fits_and_a_step_longer_does_not(card):
    """A training step's longest seq_len at its batch: found by the search over lengths (past three
    traced, read off the curve through them), and held to fresh predictions either side of it, its
    tracked peak within a budget or, on a card, its step replayed through the allocator."""
    from bench.predict.budget import longest_sequence
    from bench.predict.cards import Card

    run = spec("llama-tiny", (tech("checkpoint"),), batch_size=4, seq_len=64)
    step, limit = 16, 600 * 2**20
    on = Card(name="tiny", memory=limit, memory_source="a test's", context=0) if card else None

    def held(tokens: int) -> int:
        out = predict(run, replace(run.gpu, seq_len=tokens), card=on, reserved=on is not None)
        if on is None:
            return out.peak_tensor_bytes
        return math.inf if out.verdict == "out of memory" else out.peak_reserved_bytes

    curve = []
    longest = longest_sequence(run, card=on, budget=None if on else limit, step=step, curve=curve)
    assert longest is not None and longest % step == 0
    assert held(longest) <= limit < held(longest + step)
    # the lengths it tried, for the report's plot: the answer the longest that fits among them
    assert [p.seq_len for p in curve] == sorted({p.seq_len for p in curve}) and len(curve) >= 4
    assert max(p.seq_len for p in curve if p.fits) == longest
    answer = next(p for p in curve if p.seq_len == longest)
    assert not answer.read_off  # traced again, to confirm the curve
    if on is None:
        assert answer.peak_tensor_bytes == held(longest) and answer.reserved_bytes is None
    else:
        assert answer.reserved_bytes == held(longest) >= answer.peak_tensor_bytes


@pytest.mark.full  # 22 s of searches at four lengths
def test_the_largest_batch_at_a_few_lengths_falls_as_the_sequence_grows():
    """Beside the longest sequence, the largest batch at the powers of two from 512 to twice it:
    each the batch search's answer at that length, none larger than a shorter length's."""
    from bench.predict.budget import batches_at_lengths, positions

    run = spec("llama-tiny", (tech("checkpoint"),), batch_size=4, seq_len=64)
    budget = 600 * 2**20
    found = batches_at_lengths(run, None, budget, longest=1024)
    assert [b.seq_len for b in found] == [n for n in (512, 1024, 2048) if n <= positions(run)]
    for b in found:
        at = replace(run, gpu=replace(run.gpu, seq_len=b.seq_len))
        assert b.largest_batch == largest_batch(at, budget)
    batches = [b.largest_batch or 0 for b in found]
    assert batches == sorted(batches, reverse=True) and batches[0] > batches[-1]


def test_a_model_of_fewer_positions_than_a_step_may_hold_them_all_and_relative_ones_never_end():
    """A small BERT's 128 positions are one step of the search (its longest sequence was none, 128
    being under a step of 256); T5's relative positions give no length: the search runs until the
    step does not fit."""
    from bench.predict.budget import RELATIVE_POSITIONS, longest_sequence, positions

    bert = spec("hf:suites/configs/tiny-bert-classifier", batch_size=2, seq_len=64)
    assert longest_sequence(bert, budget=2**30) == 128
    t5 = spec("hf:suites/configs/tiny-t5", batch_size=2, seq_len=64)
    assert positions(t5) == RELATIVE_POSITIONS


def test_no_sequence_fits_where_the_shortest_does_not():
    from bench.predict.budget import longest_sequence

    run = spec("llama-tiny", batch_size=4, seq_len=64)
    assert longest_sequence(run, budget=2**20, step=16) is None


def test_no_batch_fits_where_the_parameters_and_optimizer_state_alone_do_not(monkeypatch):
    """They are alive through every step at every batch: a card or budget under them holds no
    batch, said without tracing one (a full fine-tune of an 8B model on a 40 GB card)."""
    from bench.predict import budget
    from bench.predict.cards import Card

    run = spec("llama-tiny", batch_size=4, seq_len=16)
    own = traced(run, run.gpu)
    states = own.prediction.at_peak_parameters_bytes + own.prediction.at_peak_optimizer_state_bytes
    tiny = Card(name="tiny", memory=states - 512, memory_source="a test's", context=0)
    said, sizes = [], []
    monkeypatch.setattr(budget.Sizes, "__call__", lambda self, n: sizes.append(n))
    assert budget.largest_batch_on(run, tiny, own=own, progress=said.append) is None
    assert budget.largest_batch(run, states - 512, own=own, progress=said.append) is None
    assert sizes == [] and all(s.startswith("no batch fits: its parameters and") for s in said)
    # and the shortest batch, predicted, does not fit
    assert predict(run, replace(run.gpu, batch_size=1), card=tiny).verdict == "out of memory"


SHIPPED = sorted(p.name for p in Path("suites/configs").iterdir() if p.is_dir())


@pytest.mark.full
@pytest.mark.parametrize("config", SHIPPED)
def test_the_longest_sequence_answers_on_every_shipped_config_on_a_card(config, tmp_path):
    """Issue 67's done-when: ``bench predict --hf suites/configs/NAME --card h100 --longest``'s
    answer for the job a config alone gives (its full fine-tune), held to the simulator: a step at
    the answer fits the card and one a step longer does not (or the model has no more positions);
    where none fits, the shortest step does not; a model that takes no sequence (a ViT) is
    refused."""
    from bench.models import resolve
    from bench.predict.budget import CONTEXT_STEP, longest_sequence, positions
    from bench.predict.cards import CARDS
    from bench.suite import load
    from bench.suite.from_config import suite_text

    path = f"suites/configs/{config}"
    written = tmp_path / "job.toml"
    written.write_text(suite_text(path, inputs=resolve(f"hf:{path}").inputs))
    run = load(written).runs[0]
    if "vit" in config:
        with pytest.raises(AttributeError):
            positions(run)
        return
    card, most = CARDS["h100"], positions(run)
    step = min(CONTEXT_STEP, most)

    def fits(tokens: int) -> bool:
        out = predict(run, replace(run.gpu, seq_len=tokens), card=card)
        return out.ok and out.verdict != "out of memory"

    longest = longest_sequence(run, card=card)
    if longest is None:
        assert not fits(step)
        return
    assert longest % step == 0 and fits(longest)
    assert longest + step > most or not fits(longest + step)
