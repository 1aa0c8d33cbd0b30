"""Variable-length token data through a real DataLoader: a length distribution, the sequences it
yields, the collators that batch them (padded to the suite's seq_len, to the batch's longest, or
packed into one row), the bucketing sampler, and the feed that times the step's wait on the loader.

Distributions, as a suite names them (``lengths`` in ``[shapes.*]`` or ``[matrix.lengths]``):
- ``uniform:LO:HI``: lengths drawn uniformly in LO..HI;
- ``lognormal:MEDIAN:SIGMA:MAX``: exp(N(ln MEDIAN, SIGMA)), rounded, clipped to 1..MAX;
- a dataset known by its ``MIN``, ``MAX`` and ``MEAN`` lengths, with a shape:
  ``triangular:MIN:MAX:MEAN`` (the triangle on MIN..MAX of that mean, its mode 3·MEAN − MIN − MAX)
  or ``lognormal-mean:MIN:MAX:MEAN`` (a long tail: the lognormal of that mean whose 99.9th
  percentile is MAX), rounded, clipped to MIN..MAX;
- ``digits``: real data, each of scikit-learn's handwritten digits as [CLS] then the positions of
  its non-zero pixels (17 to 43 tokens), with its class as label;
- ``hf:PATH``: a local tokenised dataset (``datasets``' ``save_to_disk``, an ``input_ids`` column
  and a label column; its train split), each row up to its last token that is not 0;
- ``file:PATH``: a dataset's own token lengths, one a line (a text file), a CSV's ``length``
  column (or its only one), or a Parquet file's ``length`` column or the lengths of its
  ``input_ids`` rows (a tokenised dataset's own file): as many sequences of those lengths, random
  ids and labels from the seed;
- ``histogram:PATH``: a dataset's lengths as a histogram, a CSV of ``length,count`` rows (each
  length a bin's longest): the run's sequences drawn from it, each length as often as its count
  says.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from bench.data import real
from bench.data.synthetic import to_device
from bench.models import IGNORE
from bench.spec import ORDERS

if TYPE_CHECKING:
    from bench.data.synthetic import Batch
    from bench.models import ModelSpec
    from bench.spec import Shapes

PAD = real.PAD
FIRST_TOKEN = 3  # synthetic sequences draw their ids from here up (0, 1, 2: padding, [CLS], [SEP])
DIGITS_LENGTHS = (17, 43)  # [CLS] plus 16 to 42 non-zero pixels, over all 1,797 digits
FORMS = (
    "'uniform:LO:HI', 'lognormal:MEDIAN:SIGMA:MAX', 'triangular:MIN:MAX:MEAN', "
    "'lognormal-mean:MIN:MAX:MEAN', 'digits', 'hf:PATH', 'file:PATH' or 'histogram:PATH'"
)
# the normal's 99.9th percentile: where lognormal-mean puts MAX
TAIL_Z = 3.090232306167813
# the dataset holds this many batches: enough distinct ones for any pass
SEQUENCES_PER_BATCH_SLOT = 16
Sample = tuple[torch.Tensor, int]  # one sequence's token ids, and its label


@dataclass(frozen=True)
class Lengths:
    """A parsed length distribution."""

    kind: str
    params: tuple[float, ...] = ()
    path: str = ""  # hf: the dataset's folder; file: the lengths' file

    @property
    def maximum(self) -> int:
        if self.kind == "digits":
            return DIGITS_LENGTHS[1]
        if self.kind == "hf":
            return max(hf_sequences(self.path).lengths)
        if self.kind == "file":
            return max(file_lengths(self.path))
        if self.kind == "histogram":
            return max(length for length, _ in histogram(self.path))
        if self.kind in ("triangular", "lognormal-mean"):  # MIN:MAX:MEAN
            return int(self.params[1])
        return int(self.params[-1])

    def sample(self, n: int, generator: torch.Generator) -> list[int]:
        if self.kind == "histogram":
            bins = histogram(self.path)
            counts = torch.tensor([count for _, count in bins], dtype=torch.float64)
            drawn = torch.multinomial(counts, n, replacement=True, generator=generator)
            return [bins[k][0] for k in drawn.tolist()]
        if self.kind == "uniform":
            lo, hi = map(int, self.params)
            return torch.randint(lo, hi + 1, (n,), generator=generator).tolist()
        if self.kind == "triangular":
            return _triangular(*self.params, n, generator)
        if self.kind == "lognormal-mean":
            low, top, mean = self.params
            sigma = lognormal_sigma(top, mean)
            median = mean * math.exp(-(sigma**2) / 2)
        else:
            (median, sigma, top), low = self.params, 1
        drawn = torch.exp(math.log(median) + sigma * torch.randn(n, generator=generator))
        return drawn.round().clamp(low, top).long().tolist()


def _triangular(
    low: float, top: float, mean: float, n: int, generator: torch.Generator
) -> list[int]:
    """``n`` lengths from the triangle on low..top whose mean is ``mean``, by its inverse CDF."""
    mode = 3 * mean - low - top
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    width, split = top - low, (mode - low) / (top - low)
    rising = low + torch.sqrt(u * width * (mode - low))
    falling = top - torch.sqrt((1 - u) * width * (top - mode))
    return torch.where(u < split, rising, falling).round().clamp(low, top).long().tolist()


def lognormal_sigma(top: float, mean: float) -> float:
    """The sigma of the lognormal of ``mean`` whose 99.9th percentile is ``top``: the smaller root
    of sigma²/2 − z·sigma + ln(top/mean) = 0 (ln top = mu + z·sigma, ln mean = mu + sigma²/2)."""
    return TAIL_Z - math.sqrt(TAIL_Z**2 - 2 * math.log(top / mean))


def parse(text: str) -> Lengths:
    """``text`` as a distribution; ValueError with the allowed forms where it is not one."""
    kind, *raw = text.split(":")
    if kind == "digits" and not raw:
        return Lengths("digits")
    if kind in ("hf", "file", "histogram") and raw and raw[0]:
        found = Lengths(kind, path=text.split(":", 1)[1])
        if kind == "file":
            file_lengths(found.path)  # read now: a file that cannot be is the suite's error
        if kind == "histogram":
            histogram(found.path)
        return found
    try:
        params = tuple(float(p) for p in raw)
    except ValueError:
        raise ValueError(f"{text!r}: parameters must be numbers; expected {FORMS}") from None
    if (
        kind == "uniform"
        and len(params) == 2
        and 1 <= params[0] <= params[1]
        and all(p.is_integer() for p in params)
    ):
        return Lengths(kind, params)
    if (
        kind == "lognormal"
        and len(params) == 3
        and params[0] > 0
        and params[1] >= 0
        and params[2] >= 1
    ):
        return Lengths(kind, params)
    if kind in ("triangular", "lognormal-mean"):
        return _by_mean(text, kind, params)
    raise ValueError(
        f"{text!r} is not a length distribution; expected {FORMS} (integers LO ≤ HI, MEDIAN > 0, "
        "SIGMA ≥ 0, MAX ≥ 1)"
    )


def _by_mean(text: str, kind: str, params: tuple[float, ...]) -> Lengths:
    """A ``MIN:MAX:MEAN`` form; ValueError naming what its numbers cannot make."""
    if len(params) != 3 or not all(p.is_integer() for p in params[:2]):
        raise ValueError(f"{text!r}: expected {kind}:MIN:MAX:MEAN, whole MIN and MAX")
    low, top, mean = params
    if not 1 <= low < mean < top:
        raise ValueError(f"{text!r}: needs 1 ≤ MIN < MEAN < MAX")
    if kind == "triangular" and not low <= 3 * mean - low - top <= top:
        raise ValueError(
            f"{text!r}: no triangle on {low:g}..{top:g} has a mean of {mean:g} (its mode would be "
            f"{3 * mean - low - top:g}); a mean this near an end is a long tail: "
            f"lognormal-mean:{low:g}:{top:g}:{mean:g}"
        )
    if kind == "lognormal-mean" and 2 * math.log(top / mean) > TAIL_Z**2:
        raise ValueError(
            f"{text!r}: a lognormal of mean {mean:g} has its 99.9th percentile at "
            f"{mean * math.exp(TAIL_Z**2 / 2):,.0f} at most, short of MAX; give the dataset's "
            "lengths themselves (file:PATH or histogram:PATH)"
        )
    return Lengths(kind, params)


class Sequences(Dataset):
    """Token sequences of varying length with a label each: drawn from a distribution (random ids,
    random labels, from the seed) or the real digits."""

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids, _ in self.samples]


def sequences(lengths: Lengths, spec: ModelSpec, n: int, seed: int) -> Sequences:
    """The dataset: ``n`` sequences drawn from a distribution, or a dataset's own (the digits, a
    tokenised one, a file's lengths: as many as it has)."""
    if lengths.kind == "digits":
        return Sequences(real.digit_samples())
    if lengths.kind == "hf":
        return hf_sequences(lengths.path)
    g = torch.Generator().manual_seed(seed)
    if lengths.kind == "file":
        drawn = list(file_lengths(lengths.path))
    else:
        drawn = lengths.sample(n, g)
    return Sequences(
        [
            (
                torch.randint(FIRST_TOKEN, spec.vocab_size, (k,), generator=g),
                int(torch.randint(0, spec.num_classes, (), generator=g)),
            )
            for k in drawn
        ]
    )


@functools.cache
def file_lengths(path: str) -> tuple[int, ...]:
    """A file's token lengths: one a line, or a CSV's ``length`` column (or its only one);
    ValueError naming the file, the line and the fix where one is not a whole number ≥ 1. A
    Parquet file: ``_parquet_lengths``."""
    if path.endswith(".parquet"):
        return _parquet_lengths(path)
    rows = _lines("file", path)
    column, first = 0, 1
    if path.endswith(".csv") and rows:
        header = [h.strip() for h in rows[0].split(",")]
        if "length" not in header and len(header) > 1:
            raise ValueError(f"file:{path}: no 'length' column among {', '.join(header)}")
        column = header.index("length") if "length" in header else 0
        first = 2
    out = []
    for number, row in enumerate(rows[first - 1 :], start=first):
        cell = row.split(",")[column].strip()
        if not (cell.isdigit() and int(cell) >= 1):
            raise ValueError(
                f"file:{path}, line {number}: {cell!r} is not a token length (a whole number ≥ 1)"
            )
        out.append(int(cell))
    if not out:
        raise ValueError(f"file:{path}: no lengths in it; one a line")
    return tuple(out)


def _parquet_lengths(path: str) -> tuple[int, ...]:
    """A Parquet file's ``length`` column, else the length of each of its ``input_ids`` rows (a
    tokenised dataset's shard, each row as its collator gets it); ValueError naming the file, the
    row and the fix where it cannot be read or a length is not a whole number ≥ 1."""
    try:
        import pyarrow
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"file:{path}: reading Parquet needs pyarrow (pip install pyarrow; make's install has "
            "it, with datasets)"
        ) from None
    try:
        names = pq.read_schema(path).names
        column = next((c for c in ("length", "input_ids") if c in names), None)
        if column is None:
            raise ValueError(
                f"file:{path}: no 'length' or 'input_ids' column among {', '.join(names)}"
            )
        values = pq.read_table(path, columns=[column]).column(column)
    except (OSError, pyarrow.ArrowException) as exc:
        raise ValueError(f"file:{path}: cannot read it as Parquet ({exc})") from None
    if column == "input_ids":
        values = pc.list_value_length(values)
    out = values.to_pylist()
    for row, n in enumerate(out):
        if not (isinstance(n, int) and n >= 1):
            raise ValueError(
                f"file:{path}, row {row} of its {column!r} column: {n!r} is not a token length "
                "(a whole number ≥ 1)"
            )
    if not out:
        raise ValueError(f"file:{path}: no rows in it")
    return tuple(out)


def _lines(form: str, path: str) -> list[str]:
    """A lengths file's lines that are not blank; ValueError naming the ``form:path`` where it
    cannot be read."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"{form}:{path}: cannot read it ({exc.strerror or exc})") from None
    return [line for line in lines if line.strip()]


@functools.cache
def histogram(path: str) -> tuple[tuple[int, int], ...]:
    """A histogram's (length, count) rows: a CSV whose first line names its ``length`` and
    ``count`` columns; ValueError naming the file, the line and the fix where a row is not a
    length ≥ 1 and a count ≥ 0, or where no count is above 0."""
    rows = _lines("histogram", path)
    header = [h.strip() for h in rows[0].split(",")] if rows else []
    if "length" not in header or "count" not in header:
        raise ValueError(
            f"histogram:{path}: its first line must name a 'length' and a 'count' column, got "
            f"{', '.join(header) or 'nothing'}"
        )
    at = header.index("length"), header.index("count")
    out = []
    for number, row in enumerate(rows[1:], start=2):
        cells = row.split(",")
        length, count = (cells[k].strip() if k < len(cells) else "" for k in at)
        if not (length.isdigit() and int(length) >= 1 and count.isdigit()):
            raise ValueError(
                f"histogram:{path}, line {number}: {row.strip()!r} is not a length (a whole "
                "number ≥ 1) and its count (a whole number ≥ 0)"
            )
        out.append((int(length), int(count)))
    if not any(count for _, count in out):
        raise ValueError(f"histogram:{path}: no count above 0; a 'length,count' row per bin")
    return tuple(out)


@functools.cache
def hf_sequences(path: str) -> Sequences:
    """The train split of a local tokenised dataset, each row without its trailing padding;
    DataError (naming the dataset and what is wrong) where it cannot be read."""
    train, _ = real.load(f"hf:{path}", "tokens", 0)
    ends = real.lengths(train.inputs).tolist()
    if not train.inputs.numel() or min(ends) == 0:
        raise real.DataError(
            f"dataset hf:{path}: a row without tokens; every input_ids row needs one"
        )
    return Sequences(
        [(row[:end], int(label)) for row, end, label in zip(train.inputs, ends, train.labels)]
    )


# -- collators: a list of samples becomes a batch, as the technique chooses --------------------


def padded(samples: list[Sample], width: int | None, objective: str) -> Batch:
    """Every sequence padded to ``width`` (None: the longest's) with an attention mask; a language
    model's labels are its ids, with the padding ignored."""
    width = width or max(len(seq) for seq, _ in samples)
    ids = torch.full((len(samples), width), PAD, dtype=torch.long)
    for row, (seq, _) in enumerate(samples):
        ids[row, : len(seq)] = seq
    mask = (torch.arange(width) < torch.tensor([len(s) for s, _ in samples])[:, None]).long()
    if objective != "classify":
        # a language model's targets are its tokens: every real one is scored
        return {"input_ids": ids, "attention_mask": mask}, ids.masked_fill(mask == 0, IGNORE)
    return {"input_ids": ids, "attention_mask": mask}, torch.tensor([label for _, label in samples])


def packed(samples: list[Sample], objective: str, parts: int = 1) -> Batch:
    """The batch's sequences one after another in a single row, no padding: position ids restart at
    each sequence, and ``cu_seq_lens`` (cumulative lengths, as flash attention's variable-length
    path takes them) keep attention inside each. A language model's first token of each sequence
    after the first is ignored as a target, so no sequence is scored on predicting the next one's
    start. ``parts``: the batch's micro-batches, each of its consecutive share of the sequences
    packed in a row of its own, as a loader of micro-batches packs them; the rows stacked (each
    row's cumulative lengths after the one before's, so that the micro-batches split the batch
    evenly), which needs as many tokens in each (ValueError where not)."""
    if parts == 1:
        return _row(samples, objective)
    size = len(samples) // parts
    rows = [_row(samples[k * size : (k + 1) * size], objective) for k in range(parts)]
    if len({inputs["input_ids"].shape[1] for inputs, _ in rows}) > 1:
        raise ValueError(
            "packed micro-batches of unequal tokens cannot be stacked: accumulate over packed "
            "batches of sequences of one length"
        )
    inputs = {
        k: torch.cat([r[k] for r, _ in rows]) if torch.is_tensor(v) else max(r[k] for r, _ in rows)
        for k, v in rows[0][0].items()
    }
    return inputs, torch.cat([labels for _, labels in rows])


def _row(samples: list[Sample], objective: str) -> Batch:
    """``packed``'s single row."""
    seqs = [s for s, _ in samples]
    # Python values throughout: bench predict collates under fake tensors
    lens = [len(s) for s in seqs]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    ids = torch.cat(seqs)[None]
    inputs = {
        "input_ids": ids,
        "position_ids": torch.cat([torch.arange(k) for k in lens])[None],
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max(lens),
        "max_length_k": max(lens),
    }
    if objective == "next-token":
        return inputs, ids.clone().index_fill_(1, cu[1:-1].long(), IGNORE)
    if objective == "masked-lm":
        return inputs, ids.clone()
    return inputs, torch.tensor([label for _, label in samples])


def regroup(batch: Batch, collate: Callable[[list[Sample]], Batch]) -> Batch:
    """A batch of padded rows (the fidelity phase's real data) collated again as a technique forms
    batches: each row's sequence up to its last token that is not padding, with its label."""
    inputs, labels = batch
    ids = inputs["input_ids"]
    ends = (
        ((ids != PAD) * torch.arange(1, ids.shape[1] + 1, device=ids.device)).amax(dim=1).tolist()
    )
    inputs, labels = collate(
        [(row[:end].cpu(), int(label)) for row, end, label in zip(ids, ends, labels)]
    )
    return to_device(inputs, ids.device), labels.to(ids.device)


def real_tokens(batch: Batch) -> tuple[int, int]:
    """(tokens that are sequence, tokens in the batch's input ids): padding is the difference."""
    inputs = batch[0]
    if "cu_seq_lens_q" in inputs:
        return int(inputs["cu_seq_lens_q"][-1]), inputs["input_ids"].numel()
    return int(inputs["attention_mask"].sum()), inputs["input_ids"].numel()


class Buckets(Sampler[list[int]]):
    """Batches of similar length: the dataset shuffled, cut in pools of ``pool`` batches, each pool
    sorted by length and cut into batches, and the batches shuffled again (so that no pass sees only
    the short ones)."""

    def __init__(
        self, lengths: list[int], batch_size: int, pool: int, generator: torch.Generator
    ) -> None:
        self.lengths = lengths
        self.batch_size = batch_size
        self.pool = pool
        self.generator = generator

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(len(self.lengths), generator=self.generator).tolist()
        size = self.batch_size * self.pool
        batches = []
        for start in range(0, len(order), size):
            chunk = sorted(order[start : start + size], key=self.lengths.__getitem__)
            batches += [
                chunk[i : i + self.batch_size]
                for i in range(0, len(chunk) - self.batch_size + 1, self.batch_size)
            ]
        for i in torch.randperm(len(batches), generator=self.generator).tolist():
            yield batches[i]

    def __len__(self) -> int:
        return len(self.lengths) // self.batch_size


@dataclass(frozen=True)
class Batching:
    """How a technique forms batches: its collator (samples → batch) and, where it has one, its
    sampler."""

    collate: Callable[[list[Sample]], Batch]
    sampler: Callable[[list[int], int, torch.Generator], Sampler[list[int]]] | None = None
    name: str = ""


@dataclass(frozen=True)
class Worst:
    """A pass's worst batch: its place (from 0) among the pass's ``steps``, and its real and
    padded tokens."""

    step: int
    steps: int
    real: int
    padded: int

    def said(self) -> str:
        return (
            f"step {self.step + 1:,} of {self.steps:,}: {self.padded:,} tokens, "
            f"{self.real:,} of them real"
        )


@dataclass(kw_only=True)
class Feed:
    """Batches from a DataLoader over ``data``, the same ones in the same order on every pass
    (``batches(n)``), with the host time each waited for and each batch's real and padded tokens."""

    data: Sequences
    batching: Batching
    shapes: Shapes
    device: torch.device
    seed: int
    waits_ms: list[float] = field(default_factory=list)
    tokens: list[tuple[int, int]] = field(default_factory=list)
    _epoch: list[list[int]] | None = field(default=None, repr=False)
    _worst: Worst | None = field(default=None, repr=False)

    def loader(self) -> DataLoader:
        common = {
            "collate_fn": self.batching.collate,
            "num_workers": self.shapes.loader_workers,
            "pin_memory": self.shapes.pin_memory and self.device.type == "cuda",
        }
        # the pass's batches as drawn once (``epoch``): a prediction iterates the loader under fake
        # tensors, where a draw from the generator reads no value and would shuffle otherwise
        if self.shapes.worst_step:
            return DataLoader(self.data, batch_sampler=[self.epoch()[self.worst().step]], **common)
        return DataLoader(self.data, batch_sampler=self.epoch(), **common)

    def _ordered(self, data: Dataset, **common: object) -> DataLoader:
        """A pass over ``data`` in the order of every pass: shuffled, or by the technique's sampler,
        from the seed."""
        g = torch.Generator().manual_seed(self.seed)
        size = self.shapes.batch_size
        if self.batching.sampler is not None:
            return DataLoader(
                data, batch_sampler=self.batching.sampler(self.data.lengths, size, g), **common
            )
        return DataLoader(
            data, batch_size=size, shuffle=True, drop_last=True, generator=g, **common
        )

    def epoch(self) -> list[list[int]]:
        """Each batch of a pass as the loader forms it: its sequences' places in the data (a loader
        of the places themselves, drawing from the generator as the batches' loader draws)."""
        if self._epoch is None:
            places = self._ordered(range(len(self.data)), collate_fn=list)  # type: ignore[arg-type]
            padded = lambda indices: self._tokens(indices)[1]  # noqa: E731
            self._epoch = ordered(list(places), self.shapes.epoch_order, padded)
        return self._epoch

    def _tokens(self, indices: list[int]) -> tuple[int, int]:
        """A batch's real and padded tokens, collated as the run's technique collates it."""
        return real_tokens(self.batching.collate([self.data[i] for i in indices]))

    def worst(self) -> Worst:
        """The pass's batch of most padded tokens (the first of them), collated as the run's
        technique collates it: where a step's activations are largest."""
        if self._worst is None:
            counted = [self._tokens(indices) for indices in self.epoch()]
            step = max(range(len(counted)), key=lambda k: counted[k][1])
            self._worst = Worst(step, len(counted), *counted[step])
        return self._worst

    def batches(self, n: int) -> Iterator[Batch]:
        """The first ``n`` batches of the pass (epochs repeat, in the same order, where ``n`` runs
        past one)."""
        self.waits_ms, self.tokens = [], []
        given = 0
        while given < n:
            it = iter(self.loader())
            for _ in range(min(n - given, len(it))):
                start = time.perf_counter()
                inputs, labels = next(it)
                self.waits_ms.append((time.perf_counter() - start) * 1e3)
                self.tokens.append(real_tokens((inputs, labels)))
                yield (
                    to_device(inputs, self.device, True),
                    labels.to(self.device, non_blocking=True),
                )
                given += 1


def ordered(
    batches: list[list[int]], order: str, padded: Callable[[list[int]], int]
) -> list[list[int]]:
    """A pass's ``batches`` in ``order`` (``ORDERS``), each batch's length its ``padded`` tokens;
    sorts are stable, ties keeping the loader's order."""
    if order == ORDERS[0]:  # the loader's own
        return batches
    tokens = [padded(b) for b in batches]
    places = range(len(batches))
    if order == "ascending":
        return [batches[k] for k in sorted(places, key=tokens.__getitem__)]
    if order == "descending":
        return [batches[k] for k in sorted(places, key=lambda k: -tokens[k])]
    if order == "longest-last":
        longest = max(tokens)
        return [batches[k] for k in sorted(places, key=lambda k: tokens[k] == longest)]
    raise ValueError(f"epoch_order {order!r}: one of {', '.join(ORDERS)}")


def dataset_size(shapes: Shapes) -> int:
    return shapes.batch_size * SEQUENCES_PER_BATCH_SLOT
