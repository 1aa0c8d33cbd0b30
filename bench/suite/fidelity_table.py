"""The [fidelity] table: the settings of the phase that trains on real data, per device."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from bench.models import ModelSpec
from bench.spec import DEVICES, Fidelity
from bench.suite.schema import FIDELITY, read, unknown
from bench.suite.values import check_ranges, model_spec, weights


def parse(
    raw: Any,
    model: str | None,
    spec: ModelSpec | None,
    suite_weights: str | None,
    problems: list[str],
) -> dict[str, Fidelity | None]:
    """Per device, the fidelity phase's settings: the table's keys, overridden by
    [fidelity.gpu/cpu]."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append("fidelity: expected a table; keys: " + ", ".join(FIDELITY))
        return {}
    shared = {k: v for k, v in raw.items() if k not in DEVICES}
    unknown(shared, FIDELITY, "fidelity.", problems)
    out: dict[str, Fidelity | None] = {}
    for dev in DEVICES:
        if isinstance(raw.get(dev), dict):
            own = raw.get(dev, {})
        else:
            own = {}
        unknown(own, FIDELITY, f"fidelity.{dev}.", problems)
        found: list[str] = []
        out[dev] = _device(
            shared | own,
            dev,
            own=own.keys(),
            model=model,
            spec=spec,
            suite_weights=suite_weights,
            found=found,
        )
        # shared keys: reported once, not per device
        problems.extend(p for p in found if p not in problems)
    return out


def _device(
    table: dict[str, Any],
    dev: str,
    own: Any,
    model: str | None,
    spec: ModelSpec | None,
    suite_weights: str | None,
    found: list[str],
) -> Fidelity | None:
    """One device's settings, each problem naming the table its key was written in."""

    def where(key: str) -> str:
        if key in own:
            return f"fidelity.{dev}."
        return "fidelity."

    if not read(table, "enabled", FIDELITY, found, where=where("enabled")):
        return None
    values = {
        f.name: read(table, f.name, FIDELITY, found, where=where(f.name))
        for f in fields(Fidelity)
        if f.name != "weights"
    }
    values["weights"] = weights(table, where("weights"), found)
    if values["weights"] is None and values["model"] in (None, model):
        values["weights"] = suite_weights  # the suite's model, so the suite's weights
    for key in ("steps", "batch_size", "image_size", "seeds"):
        if not values[key] or values[key] <= 0 or (key == "seeds" and values[key] < 2):
            found.append(
                f"{where(key)}{key}: must be {'at least 2' if key == 'seeds' else 'positive'}"
            )
    check_ranges({"lr": values["lr"]}, where("lr"), found)
    dataset = values["dataset"]
    if not (dataset in ("digits", "digit-pixels") or dataset.startswith(("imagefolder:", "hf:"))):
        found.append(
            f"{where('dataset')}dataset: {dataset!r} is not a dataset; {FIDELITY['dataset'].doc}"
        )
    elif ":" in dataset and not Path(dataset.split(":", 1)[1]).exists():
        found.append(
            f"{where('dataset')}dataset: no folder {dataset.split(':', 1)[1]!r} (relative paths "
            "start where bench runs)"
        )
    other = model_spec(values["model"], f"{where('model')}model", found)
    if other is not None and spec is not None and other.inputs != spec.inputs:
        found.append(
            f"{where('model')}model: {values['model']!r} takes {other.inputs} inputs and the "
            f"suite's model {spec.inputs} inputs; choose a model of the same kind"
        )
    return Fidelity(**values)
