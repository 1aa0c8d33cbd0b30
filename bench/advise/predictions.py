"""Predictions for advice: made in spawned processes, and kept on disk by what decides them (the
run's specification less its names, the device kind, torch's version and this harness's code), so
that asking again with another budget predicts nothing twice."""

from __future__ import annotations

import fcntl
import hashlib
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any, TextIO

import torch

from bench.predict.ahead import spawn_pool, stop_pool
from bench.predict.budget import largest_batch, largest_batch_on
from bench.predict.cards import Card
from bench.predict.fake import Traced, predict
from bench.record import Prediction
from bench.results import write_atomic
from bench.spec import RunSpec

MAKING = ".making"  # the file whose bytes lock the predictions being made (Predictions._made_once)
LOCK_SPAN = 2**40  # the bytes a key's lock falls among: two keys on one byte is one in a trillion


class Predictions:
    def __init__(
        self,
        device_type: str,
        folder: Path | None,
        jobs: int,
        log: TextIO | None = None,
        card: Card | None = None,
    ) -> None:
        """``card``: every prediction is replayed on it (its verdict), and a largest batch is the
        card's."""
        self.device_type = device_type
        self.folder = folder
        self.jobs = jobs
        self.log = log or sys.stderr  # as it is now, not at import
        self.card = card
        self.made = self.reused = 0
        self._pool = None

    def peaks(self, specs: list[RunSpec]) -> list[Prediction]:
        """Each spec's prediction at this device's shapes, in the order given."""
        made = self._each(specs, _predicted, lambda s: {"predict": s.to_dict()})
        return [Prediction.of(m) for m in made]

    def largest_batches(
        self, specs: list[RunSpec], budget: int, owns: list[Prediction]
    ) -> list[int | None]:
        """Each spec's largest batch whose predicted peak fits ``budget`` bytes; ``owns``: each
        one's prediction at its own batch (the search starts from it)."""
        found = self._each(
            [(s, budget, o) for s, o in zip(specs, owns)],
            _largest,
            lambda w: {"largest": w[0].to_dict(), "budget": w[1]},
        )
        return [f["largest_batch"] for f in found]

    def _each(
        self,
        work: list[Any],
        job: Callable[..., dict[str, Any]],
        keyed: Callable[[Any], dict[str, Any]],
    ) -> list[dict[str, Any]]:
        keys = [self._key(keyed(w)) for w in work]
        out: list[dict[str, Any] | None] = [self._cached(k) for k in keys]
        todo = [i for i, o in enumerate(out) if o is None]
        with self._made_once([keys[i] for i in todo]):
            for i in todo:  # made by another process while this one waited
                out[i] = self._cached(keys[i])
            todo = [i for i in todo if out[i] is None]
            self.reused += len(work) - len(todo)
            args = [(work[i], self.device_type, self.card) for i in todo]
            if len(todo) > 1 and self.jobs > 1:
                self._pool = self._pool or spawn_pool(self.jobs)
                made = self._pool.starmap(job, args)
            else:
                made = [job(*a) for a in args]
            for i, result in zip(todo, made):
                out[i] = result
                if self.folder is not None:
                    write_atomic(self.folder / f"{keys[i]}.json", result)
        self.made += len(todo)
        return out  # type: ignore[return-value]

    @contextmanager
    def _made_once(self, keys: list[str]) -> Iterator[None]:
        """Held while these predictions are made: another process asking for any of them (two
        ``bench advise`` at once, the test suite's processes) waits, then finds them in the cache
        instead of making them again. Each key locks its own byte of one file (POSIX record locks,
        released when the process ends however it ends), taken in one order everywhere, so that no
        two processes wait on each other."""
        if self.folder is None or not keys:
            yield
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / MAKING, "a+") as handle:  # closing it releases every lock
            for key in sorted(set(keys)):
                fcntl.lockf(handle, fcntl.LOCK_EX, 1, int(key, 16) % LOCK_SPAN)
            yield

    def _key(self, what: dict[str, Any]) -> str:
        for spec in what.values():
            if isinstance(spec, dict):  # names change no figure
                for name in ("suite", "name", "baseline"):
                    spec.pop(name, None)
        blob = json.dumps(
            {
                **what,
                "device_type": self.device_type,
                "card": self.card and self.card.name,
                "torch": torch.__version__,
                "code": _code(),
            },
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:20]

    def _cached(self, key: str) -> dict[str, Any] | None:
        try:
            if self.folder is not None:
                return json.loads((self.folder / f"{key}.json").read_text())
            return None
        except (OSError, ValueError):  # not made yet, or cut off mid-write by hand: made again
            return None

    def close(self, interrupted: bool = False) -> None:
        if self._pool is not None:
            stop_pool(self._pool, interrupted)
            self._pool = None


def _predicted(spec: RunSpec, device_type: str, card: Card | None) -> dict[str, Any]:
    """The prediction as a record stores it, as the cache keeps it."""
    cuda = device_type == "cuda"
    return predict(
        spec, spec.shapes(device_type), cuda=cuda, card=card, reserved=card is not None
    ).flat()


def _largest(
    work: tuple[RunSpec, int, Prediction], device_type: str, card: Card | None
) -> dict[str, Any]:
    spec, budget, own = work
    if card is not None:
        return {"largest_batch": largest_batch_on(spec, card, own=Traced(own))}
    return {"largest_batch": largest_batch(spec, budget, own=Traced(own), device_type=device_type)}


@cache
def _code() -> str:
    """A digest of this harness's source: a prediction made by other code is made again."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
