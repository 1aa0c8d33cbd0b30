"""What the committed records say about a technique: its measured throughput against its suite's
baseline on a device of a class, and its accuracy delta in the fidelity phase. Every figure carries
the record it came from."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path

from bench.record import Accuracy, Record, Status
from bench.results import load_records
from bench.spec import TechniqueSpec
from bench.techniques import resolve


@dataclass(frozen=True, kw_only=True)
class Figure:
    """A measured figure and where it came from ("bert-base on amd-epyc-2-threads, suite bert, run
    checkpoint")."""

    value: float
    source: str
    outside_band: bool = False  # accuracy: the delta lay outside the baseline's seed-to-seed spread
    same_model: bool = True


def canonical(techniques: Iterable[TechniqueSpec]) -> frozenset[str]:
    """A plan's techniques as labels with options at their defaults left out, so that a suite's
    ``{ name = "amp", dtype = "bfloat16" }`` and a plain ``"amp"`` name the same thing."""
    labels = set()
    for t in techniques:
        try:
            defaults = {f.name: f.default for f in fields(resolve(t.name).Config)}
        except (
            KeyError,
            ImportError,
            TypeError,
        ):
            # a user's technique that no longer imports: keep it whole
            defaults = {}
        labels.add(
            TechniqueSpec(
                t.name, tuple((k, v) for k, v in t.options if defaults.get(k, object()) != v)
            ).label
        )
    return frozenset(labels)


class Evidence:
    """The committed records of every suite under ``results``, of one mode, indexed by their
    techniques."""

    def __init__(self, results: Path, mode: str, device: str = "") -> None:
        # the device asked about, whose own records are preferred (a CPU's thread count)
        self.device = device
        self._speed: dict[frozenset[str], list[tuple[Record, float]]] = {}
        self._accuracy: dict[frozenset[str], list[tuple[Record, Accuracy]]] = {}
        self._rates: list[Record] = []
        for suite in sorted(
            p for p in results.glob("*") if p.is_dir() and not p.name.startswith(".")
        ):
            stored = map(Record.from_flat, load_records(suite))
            self._index([r for r in stored if (r.identity.spec or {}).get("mode", "train") == mode])

    def _index(self, records: list[Record]) -> None:
        ok = [
            r
            for r in records
            if r.outcome.status == Status.OK and r.identity.spec and (r.identity.nproc or 1) == 1
        ]
        baselines = {r.identity.device: r for r in ok if r.identity.run == r.identity.baseline}
        for r in ok:
            named = r.identity.spec["techniques"]  # the spec's own form: name and options each
            key = canonical(
                TechniqueSpec(t["name"], tuple(map(tuple, t["options"]))) for t in named
            )
            base = baselines.get(r.identity.device)
            speed, base_speed = r.timing.samples_per_s, base and base.timing.samples_per_s
            if speed and base_speed:
                self._speed.setdefault(key, []).append((r, speed / base_speed))
            if accuracy := Accuracy.of(r.fidelity, base and base.fidelity):
                self._accuracy.setdefault(key, []).append((r, accuracy))
            if not key and r.timing.step_time_ms_median:
                self._rates.append(r)

    def speed(
        self, plan: frozenset[str], model: str, device_type: str, dtype: bool = False
    ) -> Figure | None:
        """The plan's measured throughput over its baseline's, on a device of ``device_type``: from
        a record of the same model where one exists (on the device asked about, where measured
        there), else of another.

        A plan that changes the ``dtype`` is taken, on a CPU, from that very CPU only: under one
        processor's name, bf16 steps took 0.6 times the fp32 step on the committed BERT-base records
        and 15 times on the Llama ones, measured on a VM without AVX-512 (records keyed before the
        name carried the instructions match no CPU here)."""
        found = [
            (r, v)
            for r, v in self._speed.get(plan, [])
            if r.identity.device_type == device_type
            and not (dtype and device_type == "cpu" and r.identity.device != self.device)
        ]
        if not found:
            return None
        r, v = max(
            found,
            key=lambda f: (
                f[0].identity.model == model,
                f[0].identity.device == self.device,
                f[0].identity.measure_steps or 0,
            ),
        )
        return Figure(value=v, source=where(r), same_model=r.identity.model == model)

    def accuracy(self, plan: frozenset[str], model: str) -> Figure | None:
        """The plan's accuracy delta against its baseline in the fidelity phase (a fraction), on any
        device, of the same model only: another model's task and noise say little about this
        one's."""
        found = [(r, a) for r, a in self._accuracy.get(plan, []) if r.identity.model == model]
        if not found:
            return None
        r, a = max(found, key=lambda f: f[0].identity.device_type == "cuda")
        return Figure(value=a.delta, source=where(r), outside_band=a.outside_band)

    def baselines(self, device_type: str) -> list[Record]:
        """The measured baseline steps (one process, no technique) on devices of ``device_type``."""
        return [r for r in self._rates if r.identity.device_type == device_type]


def where(record: Record) -> str:
    who = record.identity
    return f"{who.model} on {who.device} (results/{who.suite}, {who.run})"
