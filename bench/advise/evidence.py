"""What the committed records say about a technique: its measured throughput against its suite's
baseline on a device of a class, and its accuracy delta in the fidelity phase. Every figure carries
the record it came from."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from bench.record import KEY, Status, migrate
from bench.results import accuracy_vs_baseline, load_records
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
        self._speed: dict[frozenset[str], list[tuple[dict[str, Any], float]]] = {}
        self._accuracy: dict[frozenset[str], list[dict[str, Any]]] = {}
        self._rates: list[dict[str, Any]] = []
        for suite in sorted(
            p for p in results.glob("*") if p.is_dir() and not p.name.startswith(".")
        ):
            self._index(
                [
                    r
                    for r in load_records(suite)
                    if (r.get(KEY.spec) or {}).get("mode", "train") == mode
                ]
            )

    def _index(self, records: list[dict[str, Any]]) -> None:
        ok = [
            migrate(r)
            for r in records
            if r.get(KEY.status) == Status.OK and r.get(KEY.spec) and r.get(KEY.nproc, 1) == 1
        ]
        baselines = {r[KEY.device]: r for r in ok if r[KEY.run] == r.get(KEY.baseline)}
        for r in ok:
            named = r[KEY.spec]["techniques"]  # the spec's own form: name and options each
            key = canonical(
                TechniqueSpec(t["name"], tuple(map(tuple, t["options"]))) for t in named
            )
            base = baselines.get(r[KEY.device])
            if base is not None and r.get(KEY.samples_per_s) and base.get(KEY.samples_per_s):
                self._speed.setdefault(key, []).append(
                    (r, r[KEY.samples_per_s] / base[KEY.samples_per_s])
                )
            r |= accuracy_vs_baseline(r, base)
            if r.get("accuracy_delta") is not None:
                self._accuracy.setdefault(key, []).append(r)
            if not key and r.get(KEY.step_time_ms_median):
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
            if r.get(KEY.device_type) == device_type
            and not (dtype and device_type == "cpu" and r[KEY.device] != self.device)
        ]
        if not found:
            return None
        r, v = max(
            found,
            key=lambda f: (
                f[0][KEY.model] == model,
                f[0][KEY.device] == self.device,
                f[0].get(KEY.measure_steps, 0),
            ),
        )
        return Figure(value=v, source=where(r), same_model=r[KEY.model] == model)

    def accuracy(self, plan: frozenset[str], model: str) -> Figure | None:
        """The plan's accuracy delta against its baseline in the fidelity phase (a fraction), on any
        device, of the same model only: another model's task and noise say little about this
        one's."""
        found = [r for r in self._accuracy.get(plan, []) if r[KEY.model] == model]
        if not found:
            return None
        r = max(found, key=lambda r: r.get(KEY.device_type) == "cuda")
        return Figure(
            value=r["accuracy_delta"], source=where(r), outside_band=bool(r.get("outside_band"))
        )

    def baselines(self, device_type: str) -> list[dict[str, Any]]:
        """The measured baseline steps (one process, no technique) on devices of ``device_type``."""
        return [r for r in self._rates if r.get(KEY.device_type) == device_type]


def where(record: dict[str, Any]) -> str:
    return (
        f"{record[KEY.model]} on {record[KEY.device]} (results/{record[KEY.suite]}, "
        f"{record[KEY.run]})"
    )
