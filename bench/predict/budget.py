"""The largest batch whose predicted peak fits a memory budget (``bench predict --budget``)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from bench.predict.cards import Card
from bench.predict.fake import CPU, Traced, predict
from bench.predict.lines import Sizes
from bench.recipe import Recipe
from bench.record import Phase, Prediction
from bench.suite import RunSpec, Shapes
from bench.techniques import build

# Held back from a card's memory (--budget) for what a CUDA process holds besides tensors: the
# context (the driver's, CUDA's and its libraries' code and handles; NVML's process memory less the
# allocator's reserve: 758–766 MiB in the committed H100 records, 862 with cuSOLVER's handle) and
# the allocator's own share of its peak (cuBLAS and cuDNN workspaces, kernels' buffers: 68–470 MiB;
# a checkpointed ResNet-50's recomputed convolutions, 404). Fragmentation is not held back: under
# pressure the allocator frees its cache and retries. tests/predict/test_budget.py holds this
# against the records.
RESERVE = "1280MiB"


def largest_batch(
    spec: RunSpec,
    budget: int,
    limit: int = 1 << 16,
    own: Traced | None = None,
    peak: Callable[[int], float] | None = None,
    device_type: str = "cuda",
    progress: Callable[[str], None] = lambda _: None,
    sizes: Sizes | None = None,
) -> int | None:
    """The largest batch whose predicted peak fits ``budget`` bytes (in multiples of the micro-batch
    count, so every candidate is a valid run); None if none fits. A peak is close to linear in the
    batch (past the small batches where the optimizer step holds it), so the line through the last
    two predictions guesses the answer, and a guess the line gives again is confirmed by its
    neighbour: four to seven predictions a run, where doubling and bisection took about seventeen. A
    guess that does not halve the bracket twice in a row is followed by a doubling or bisection
    step, so a peak far from linear still gets the right answer in at most three times bisection's
    count. ``own``: the prediction at the run's own batch, if made already (the line starts from
    it). ``peak``: the peak at a batch size (inf: it does not fit), instead of the prediction at
    ``device_type``'s shapes (``bench fit`` measures it). ``progress`` is told each batch tried.
    Where the run's own parameters and optimizer state alone are over the budget, no batch is.
    The predictions past the first two are read off the line through them where the step is one
    (bench.predict.lines.Sizes, or ``sizes`` where ``peak`` reads them), and the answer read off it
    is traced again."""
    shapes = spec.shapes(device_type)
    if own is not None and (held := _states(own.prediction)) > budget:
        progress(
            f"no batch fits: its parameters and optimizer state alone hold {held / 2**30:,.2f} GiB"
        )
        return None
    if peak is None:
        sizes = Sizes.of_batch(spec, shapes, cuda=device_type == "cuda", reserved=False)
        sizes.seed(shapes.batch_size, own)

        def peak(batch: int) -> float:
            return _held(sizes(batch), None)

    unit = math.lcm(1, *(build(t).batch_multiple() for t in spec.techniques))

    def at(n: int) -> float:
        figure = peak(n * unit)
        how = sizes.said(n * unit) if sizes is not None else ""
        progress(f"batch {n * unit:,}: {_against(figure, budget)}{how}")
        return figure

    found = largest(at, budget, limit // unit, start=shapes.batch_size // unit)
    while sizes is not None and not sizes.confirmed(max(found, 1) * unit):  # the line did not hold
        progress(f"batch {found * unit:,} traced is not the step read off the line: all traced")
        found = largest(at, budget, limit // unit, start=shapes.batch_size // unit)
    return found * unit or None


def largest(
    at: Callable[[int], float],
    budget: float,
    limit: int,
    start: int | None = None,
    grow: int | None = None,
) -> int:
    """The largest n from 1 to ``limit`` whose ``at(n)`` (a peak) is within ``budget``, 0 if none
    is: the search of ``largest_batch``, in its units. ``start``: a size whose figure is at hand
    (the run's own, or one traced), probed first. ``grow``: a guess goes no further than this many
    times the largest size that fits (a line through two small sizes, where fixed costs hold the
    peak, points far past the answer, and a far size costs more)."""
    lo, hi = 0, limit + 1  # lo fits (0: none yet), hi does not (past the limit: assumed)
    seen: dict[int, float] = {}  # each size probed, in order, and its figure

    def probe(n: int) -> None:
        nonlocal lo, hi
        seen[n] = at(n)
        lo, hi = (max(lo, n), hi) if seen[n] <= budget else (lo, min(hi, n))

    if start is not None and 1 < start <= limit:  # at hand: where it fits, so does every size below
        probe(start)
    if lo == 0:
        probe(1)
        if lo == 0:
            return 0
    misses = 0  # guesses in a row that did not halve the bracket
    while hi - lo > 1:
        width = hi - lo
        if misses < 2:
            guess = _guess(seen, lo, hi, budget)
        else:
            guess = None
        if guess is None:  # no line, or the line is not converging: double, or halve the bracket
            probe(min(2 * lo, hi - 1) if hi > limit else (lo + hi) // 2)
            misses = 0
            continue
        probe(min(max(guess, lo + 1), hi - 1, grow * lo if grow else hi))
        if hi - lo <= width // 2:
            misses = 0
        else:
            misses = misses + 1
    return lo


def _guess(seen: dict[int, float], lo: int, hi: int, budget: float) -> int | None:
    """The next size to try: where the line through the bracket's ends crosses the budget, when both
    have a figure (a card's out of memory gives one above it: what was reserved and asked for then);
    else where the line through the last two sizes with a figure does."""
    ends = [(n, seen[n]) for n in (lo, hi) if math.isfinite(seen.get(n, math.inf))]
    if len(ends) == 2:
        finite = ends
    else:
        finite = [p for p in seen.items() if math.isfinite(p[1])][-2:]
    if len(finite) < 2 or finite[0][1] == finite[1][1]:
        return None
    (a, pa), (b, pb) = finite
    return math.floor(a + (budget - pa) * (b - a) / (pb - pa))


def _against(figure: float, budget: float) -> str:
    if math.isinf(figure):
        return "does not fit"
    said = f"{figure / 2**30:,.2f} GiB"
    if figure <= budget:
        return f"{said}, fits"
    return f"{said}, does not fit"


def largest_batch_on(
    spec: RunSpec,
    card: Card,
    limit: int = 1 << 16,
    own: Traced | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> int | None:
    """The largest batch the card holds: the step replayed through the caching allocator under the
    card's memory less its context, at each batch the search tries (``largest_batch``, on the
    reserved peak). ``own``: the prediction on the card at the run's own batch, if made already;
    ``progress`` is told each batch tried."""
    shapes = spec.shapes("cuda")
    sizes = Sizes.of_batch(spec, shapes, card=card)
    sizes.seed(shapes.batch_size, own)

    def reserved(batch: int) -> float:
        return _held(sizes(batch), card)

    return largest_batch(
        spec, card.capacity, limit, own=own, peak=reserved, progress=progress, sizes=sizes
    )


def _states(out: Prediction) -> int:
    """What a step holds on the device at any batch: its parameters and optimizer state, alive from
    its start to its end, neither sized by the batch (0 where not predicted)."""
    if not out.ok:
        return 0
    return (out.at_peak_parameters_bytes or 0) + (out.at_peak_optimizer_state_bytes or 0)


CONTEXT_STEP = 256  # tokens: the longest context is found to this many


def longest_context(
    spec: RunSpec,
    card: Card | None = None,
    budget: int | None = None,
    step: int = CONTEXT_STEP,
    progress: Callable[[str], None] = lambda _: None,
) -> int | None:
    """The longest context (prompt and new tokens) a generation holds, its new tokens kept and its
    prompt lengthened in steps of ``step`` tokens up to the model's positions: on ``card``, the step
    replayed through its allocator; else its tracked peak within ``budget`` bytes. None if not even
    the shortest prompt fits.

    A generation predicted whole costs a forward per new token, a minute or two at GPU shapes, so
    the search predicts generations of two new tokens twice instead, each a few seconds: at the
    prompt (its prefill is the real one's) and at the prompt and the new tokens less two (its one
    decode step is the real last one, which holds all that any step before it held: a cache that
    only grows, and longer ids). That second generation's prefill is longer than the real one, so
    only its decode counts: its decode peak, or on a card whether it ran out of memory decoding (a
    prompt of an odd length fragments the allocator's segments otherwise than the real one, and ran
    out of memory in a prefill the real generation never makes). The larger of the two leads the
    search; whole generations then confirm the answer and the prompt a step longer, moving the
    answer until they agree. ``progress`` is told each length tried, as it is (minutes of work)."""
    shapes, new = spec.gpu, spec.gpu.new_tokens
    if card is not None:
        cap = card.capacity
    else:
        cap = budget
    limit = (positions(spec) - new) // step  # prompts of 1 to ``limit`` steps
    prompts = range(1, limit + 1)
    first = next(
        (n for n in prompts if runs_at(spec, shapes=replace(shapes, prompt_len=n * step))), 0
    )
    if not first:
        return None

    def at(prompt: int, tokens: int) -> Shapes:
        return replace(shapes, prompt_len=prompt, new_tokens=tokens, seq_len=prompt + tokens)

    # the short generations past the first three read off the curve through them: attention's
    # scores over a prompt grow as its square where no fused kernel runs
    short = Sizes(
        spec,
        lambda prompt: at(prompt, 2),
        card=card,
        reserved=card is not None,
        named="prompts",
        degree=2,
    )

    def peak(prompt: int, tokens: int, decoding: bool = False) -> float:
        if tokens == 2:
            out = short(prompt)
        else:
            out = predict(spec, at(prompt, tokens), card=card, reserved=card is not None)
        if decoding and out.verdict == "out of memory" and out.oom_phase != Phase.DECODE:
            value = 0.0  # its own, longer prefill failed: nothing learnt of the real decode
        elif not out.ok or out.verdict == "out of memory":
            value = math.inf
        elif card is not None:
            value = out.peak_reserved_bytes
        else:
            if decoding:
                value = out.peak_decode_bytes
            else:
                value = out.peak_tensor_bytes
        if tokens == new:
            how = "whole"
        else:
            how = f"{tokens} new tokens"
        how += ", its decode" if decoding else ""
        said = "fits" if value <= cap else "does not fit"
        if tokens == 2:
            said += short.said(prompt)
        progress(f"a {prompt:,}-token prompt ({how}): {said}")
        return value

    def led(
        k: int,
    ) -> float:  # the k-th prompt from the first that runs, by its two short generations
        prompt = (first + k - 1) * step
        prefilled = peak(prompt, 2)
        if prefilled > cap:
            return prefilled
        return max(prefilled, peak(prompt + new - 2, 2, decoding=True))

    def whole(n: int) -> bool:
        return peak(n * step, new) <= cap

    n = first - 1 + largest(led, cap, limit - first + 1, grow=4)
    read = (n * step, n * step + new - 2)  # the answer's two short generations, if read
    while not all(short.confirmed(p) for p in read):  # the curve did not hold: all traced
        progress(f"a {n * step:,}-token prompt traced is not the step read off the curve")
        # searched again from the answer the curve gave, now traced (a chunked prefill's steps
        # change with its count of chunks, which the curve's three prompts shared): the answer is
        # most often near it, and a long prompt traced costs a forward per chunk
        n = first - 1 + largest(led, cap, limit - first + 1, start=max(n - first + 1, 1), grow=4)
    while n >= first and not whole(n):
        n -= 1
    while n < limit and whole(n + 1):
        n += 1
    if n >= first:
        return n * step + new
    return None


def longest_sequence(
    spec: RunSpec,
    card: Card | None = None,
    budget: int | None = None,
    step: int = CONTEXT_STEP,
    own: Traced | None = None,
    progress: Callable[[str], None] = lambda _: None,
    curve: list[LengthPoint] | None = None,
) -> int | None:
    """The longest ``seq_len`` a training (or forward) step holds at the run's batch, in steps of
    ``step`` tokens up to the model's positions: on ``card``, its step replayed through the
    allocator (the reserved peak); else its tracked peak within ``budget`` bytes. None if not even
    ``step`` tokens fit. ``own``: the run's prediction at its own length, where that is a whole
    number of steps (the search starts there). The lengths past the first three traced are read
    off the curve through them (attention's scores grow as the square of the length where no fused
    kernel runs), and the answer read off it is traced again; ``progress`` is told each length,
    ``curve`` given each length's figures once the search is done (the report's plot)."""
    shapes = spec.gpu
    cap = card.capacity if card is not None else budget
    most = positions(spec)
    step = min(step, most)  # a model of fewer positions (a small BERT's 128): all of them, or none
    sizes = Sizes(
        spec,
        lambda tokens: replace(shapes, seq_len=tokens),
        card=card,
        reserved=card is not None,
        named="lengths",
        degree=2,
    )
    start = None
    if shapes.seq_len % step == 0:
        start = shapes.seq_len // step
        sizes.seed(shapes.seq_len, own)

    def at(n: int) -> float:
        figure = _held(sizes(n * step), card)
        progress(f"{n * step:,} tokens: {_against(figure, cap)}{sizes.said(n * step)}")
        return figure

    limit = most // step
    found = largest(at, cap, limit, start=start, grow=4)
    while not sizes.confirmed(max(found, 1) * step):  # the curve did not hold: all traced
        progress(f"{found * step:,} tokens traced is not the step read off the curve: all traced")
        found = largest(at, cap, limit, start=max(found, 1), grow=4)
    if curve is not None:
        curve += [
            LengthPoint(n, p.peak_tensor_bytes, _reserved(p, card), _held(p, card) <= cap, read)
            for n, p, read in sizes.predicted()
            if p.ok
        ]
    return found * step or None


@dataclass(frozen=True)
class LengthPoint:
    """A length a search predicted: the step's tracked peak; on a card, what its allocator
    reserves (where it ran out of memory, what it had reserved and asked for then); whether it
    fits; whether it was read off the curve or traced."""

    seq_len: int
    peak_tensor_bytes: int
    reserved_bytes: int | None
    fits: bool
    read_off: bool


@dataclass(frozen=True)
class BatchAt:
    """The largest batch a card (or budget) holds at a sequence length; None where none does."""

    seq_len: int
    largest_batch: int | None


def batches_at_lengths(
    spec: RunSpec,
    card: Card | None,
    budget: int | None,
    longest: int | None,
    progress: Callable[[str], None] = lambda _: None,
) -> list[BatchAt]:
    """The largest batch at a few lengths (issue 67): the powers of two from 512 up to the model's
    positions, the last four at most twice the longest sequence at the run's batch (its own length
    where none fits): where a shorter sequence buys a larger batch, and a longer one costs it."""
    most = positions(spec)
    reach = 2 * (longest or spec.gpu.seq_len)
    lengths = [n for n in (512 << k for k in range(9)) if n <= min(most, reach)][-4:]
    out = []
    for n in lengths:
        at = replace(spec, gpu=replace(spec.gpu, seq_len=n))
        if card is not None:
            found = largest_batch_on(at, card, progress=progress)
        else:
            found = largest_batch(at, budget, progress=progress)
        out.append(BatchAt(n, found))
    return out


def _reserved(out: Prediction, card: Card | None) -> int | None:
    if card is None:
        return None
    if out.verdict == "out of memory":
        return out.oom_reserved_bytes + out.oom_request_bytes
    return out.peak_reserved_bytes


def _held(out: Prediction, card: Card | None) -> float:
    """What a prediction holds against its budget: on a card, the reserved peak (above the card by
    what it could not hold, where it ran out of memory); else the tracked peak; inf where it was
    not predicted."""
    if not out.ok:
        return math.inf
    if card is None:
        return out.peak_tensor_bytes
    if out.verdict == "out of memory":
        return max(_reserved(out, card), card.capacity + 1)
    return out.peak_reserved_bytes


# the longest sequence searched for a model whose positions are relative (T5's buckets): its config
# sets no length, and its attention's scores, a square of the length, end any search well before
RELATIVE_POSITIONS = 1 << 17


def positions(spec: RunSpec) -> int:
    """The positions the model's config gives it (max_position_embeddings), read off the model built
    on the meta device; ``RELATIVE_POSITIONS`` for relative ones; AttributeError where it takes no
    sequence (a CNN)."""
    return _positions(spec.gpu.model or spec.model, spec.gpu)


@functools.cache
def _positions(model: str, shapes: Shapes) -> int:
    """``positions``, its model built once per model and shapes (``--longest`` asks it for the
    length search and for the batches at lengths; a built-in Llama's positions follow seq_len)."""
    import torch

    from bench import models

    with torch.device("meta"):
        config = models.resolve(model).build(shapes).config
    if getattr(config, "max_position_embeddings", None) is None and getattr(
        config, "relative_attention_num_buckets", None
    ):
        return RELATIVE_POSITIONS
    return config.max_position_embeddings


def fewest_ranks(
    spec: RunSpec,
    budget: int | None,
    own: Prediction | None = None,
    card: Card | None = None,
) -> int | None:
    """The fewest processes, from 2 to the entry's nproc, over which each rank's predicted peak at
    GPU shapes fits ``budget``, or on ``card`` each rank's step replayed through its allocator does
    not run out of memory; None if even nproc does not. Sharding only takes memory off a rank as
    ranks are added, so the answer is bisected over the world sizes the entry can run at (multiples
    of its groups, under hybrid sharding or 2-D parallelism): about log2(nproc) predictions.
    ``own``: the prediction at nproc (on the card, where one is given), if made already."""

    def fits(n: int, out: Prediction | None = None) -> bool:
        out = out or predict(replace(spec, nproc=n), card=card, reserved=card is not None)
        return _held(out, card) <= (budget if card is None else card.capacity)

    if not fits(spec.nproc, own):
        return None
    sizes = [n for n in range(2, spec.nproc) if runs_at(spec, n)] + [spec.nproc]
    lo, hi = -1, len(sizes) - 1  # lo does not fit (one process is no run of these), hi does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(sizes[mid]) else (mid, hi)
    return sizes[hi]


def runs_at(spec: RunSpec, world_size: int | None = None, shapes: Shapes | None = None) -> bool:
    """Whether the entry's techniques can run over ``world_size`` processes (default: its own) at
    ``shapes`` (default: its GPU shapes; a prefill's chunk must be shorter than the prompt), checked
    without torch work."""
    recipe = Recipe.of(
        spec, CPU, shapes or spec.gpu, predicting=True, world_size=world_size or spec.nproc
    )
    return recipe.unsupported() is None


@dataclass(frozen=True, kw_only=True)
class Budget:
    """The memory a plan may peak at: bytes for tensors, or a share of the baseline's predicted peak
    ("60%")."""

    text: str
    size: int | None = None
    share: float | None = None
    card: Card | None = None  # a named card: plans fit by its verdict (bench.predict.cards)

    @staticmethod
    def of_card(card: Card) -> Budget:
        """A card's budget: what its allocator may reserve; each plan's verdict says whether it
        fits."""
        return Budget(text=card.name, size=card.capacity, card=card)

    @staticmethod
    def parse(text: str, device_type: str, reserve: str = RESERVE, share: bool = False) -> Budget:
        """'16GiB' (on CUDA less ``reserve`` for the context and workspaces), or, where ``share``
        (advice, which predicts the baseline first), '60%'; ValueError naming the fix. Every
        command's --budget is read here."""
        if text.strip().endswith("%"):
            if not share:
                raise ValueError(
                    f"--budget {text!r}: a share of the baseline's peak is for bench advise; give "
                    "the card's memory, such as 16GiB"
                )
            try:
                share = float(text.strip()[:-1]) / 100
            except ValueError:
                share = -1
            if not 0 < share <= 10:
                raise ValueError(
                    f"--budget {text!r}: expected a size such as 16GiB, or a share of the "
                    "baseline's predicted peak such as 60%"
                )
            return Budget(text=text, share=share)
        return Budget(
            text=text,
            size=tensor_budget(text, reserve) if device_type == "cuda" else parse_size(text),
        )

    def bytes(self, baseline_peak: int = 0) -> int:
        if self.size is not None:
            return self.size
        return int(self.share * baseline_peak)


def tensor_budget(card: str, reserve: str = RESERVE) -> int:
    """Bytes left for tensors on a card of ``card`` once ``reserve`` is held back (both sizes as
    text); ValueError naming the option at fault."""
    total, held = parse_size(card), parse_size(reserve, "--reserve")
    if held >= total:
        raise ValueError(
            f"--reserve {reserve} leaves nothing of --budget {card} for tensors: give the card's "
            "whole memory as the budget, or a smaller reserve (0 for none)"
        )
    return total - held


def parse_size(text: str, option: str = "--budget") -> int:
    """'16GiB', '80GB', '512MiB' or plain bytes → bytes; ``option`` names the flag in the error."""
    units = {
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "b": 1,
        "": 1,
    }
    number = text.strip().rstrip("BbIiKkMmGgTt")
    unit = text.strip()[len(number) :].lower()
    try:
        size = int(float(number) * units[unit])
    except (ValueError, KeyError, OverflowError):  # not a number, an unknown unit, infinity
        size = -1  # refused below, with the negative sizes
    if size < 0:
        raise ValueError(f"{option} {text!r}: expected a size such as 16GiB, 80GB or 512MiB")
    return size
