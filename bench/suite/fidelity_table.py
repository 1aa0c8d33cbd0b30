"""The [fidelity] table: the settings of the phase that trains on real data, per device."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from bench.models import ModelSpec
from bench.spec import DEVICES, Fidelity
from bench.suite.values import check_ranges, model_spec, typed, weights

FIDELITY_KEYS = {
    "dataset": "'digits' (scikit-learn, offline), 'digit-pixels' (the same digits as "
    "variable-length sequences of their non-zero pixels, for token models), 'imagefolder:PATH' or "
    "'hf:PATH' (save_to_disk)",
    "steps": "optimizer steps of training from the run's initial weights",
    "batch_size": "training batch size",
    "lr": "learning rate of the default AdamW optimizer",
    "seeds": "seeds the baseline is trained with, for the noise band (at least 2)",
    "image_size": "image side for image models (digits are upsampled from 8 px)",
    "model": (
        "model to train instead of the suite's (e.g. its tiny variant, so CPU runs stay short)"
    ),
    "weights": "pretrained weights for the phase's model (default: the suite's, when it trains the "
    "suite's model)",
    "enabled": "false switches the phase off (per device in [fidelity.gpu] / [fidelity.cpu])",
}


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
        problems.append("fidelity: expected a table; keys: " + ", ".join(FIDELITY_KEYS))
        return {}
    shared = {k: v for k, v in raw.items() if k not in DEVICES}
    for key in shared.keys() - FIDELITY_KEYS.keys():
        problems.append(f"fidelity.{key}: unknown key; allowed: {', '.join(FIDELITY_KEYS)}")
    out: dict[str, Fidelity | None] = {}
    for dev in DEVICES:
        if isinstance(raw.get(dev), dict):
            own = raw.get(dev, {})
        else:
            own = {}
        for key in own.keys() - FIDELITY_KEYS.keys():
            problems.append(
                f"fidelity.{dev}.{key}: unknown key; allowed: {', '.join(FIDELITY_KEYS)}"
            )
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

    if not typed(table, "enabled", kind=bool, default=True, problems=found, where=where("enabled")):
        return None
    values = {
        f.name: typed(
            table,
            f.name,
            kind=_kind(f.type),
            default=f.default,
            problems=found,
            where=where(f.name),
        )
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
            f"{where('dataset')}dataset: {dataset!r} is not a dataset; {FIDELITY_KEYS['dataset']}"
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


def _kind(annotation: Any) -> type:
    """The runtime type of a Fidelity field's annotation (``str | None`` → str)."""
    return {"str": str, "int": int, "float": float, "str | None": str}[str(annotation)]
