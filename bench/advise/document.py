"""Advice as one JSON document (``bench advise --json``): the ranked plans with every figure the
table shows and the prediction each stands on, where their speed and accuracy came from, what the
search tried, the assumptions and how the document was made. ``schema()`` says what it holds
(docs/advice.schema.json is written from it by make docs)."""

from __future__ import annotations

from typing import Any

from bench.advise import Advice
from bench.advise.search import Candidate
from bench.predict.document import PROVENANCE_SCHEMA, figures, figures_schema, provenance
from bench.record import KEY

KIND = "memsave-bench/advice"
VERSION = 1
SEARCHED = ("combinations", "cannot_combine", "over_tolerance", "skipped", "covering")


def document(advice: Advice, assumptions: str, revision: str) -> dict[str, Any]:
    """The advice as data: the plans that fit in their rank order, or, where none does, the plan
    that saves most and what it would need."""
    search = advice.search
    return {
        "kind": KIND,
        "version": VERSION,
        "model": advice.template.model,
        "mode": advice.source.mode,
        KEY.device_type: advice.device_type,
        "batch": advice.template.shapes(advice.device_type).batch_size,
        "budget": advice.budget_text,
        "budget_bytes": advice.budget,
        "baseline": figures(advice.baseline),
        "plans": [_plan(c, advice.budget) for c in advice.plans],
        "closest": None if advice.closest is None else _plan(advice.closest, advice.budget),
        "needs": list(advice.needs),
        "searched": {k: getattr(search, k) for k in SEARCHED}
        | {"dominated": list(search.dominated), "dropped": list(search.dropped)},
        "assumptions": assumptions,
        "provenance": provenance(revision),
    }


def _plan(c: Candidate, budget: int) -> dict[str, Any]:
    return {
        "plan": c.plan.name,
        "techniques": [t.label for t in c.plan.techniques],
        KEY.peak_tensor_bytes: c.peak,
        "headroom_bytes": budget - c.peak,
        "largest_batch": c.largest_batch,
        "throughput": c.speed.throughput,  # over the baseline's, estimated
        "throughput_sources": list(c.speed.sources),
        "accuracy_delta": c.accuracy.delta,  # the worst known, a fraction; null: none measured
        "accuracy_outside_band": c.accuracy.outside_band,
        "accuracy_unknown": list(c.accuracy.unknown),
        "predicted": figures(c.predicted),
    }


def schema() -> dict[str, Any]:
    """The document's JSON Schema (draft 2020-12)."""
    strings = {"type": "array", "items": {"type": "string"}}
    plan = {
        "type": "object",
        "additionalProperties": False,
        "required": ["plan", "techniques", "peak_tensor_bytes", "predicted"],
        "properties": {
            "plan": {"type": "string"},
            "techniques": strings,
            KEY.peak_tensor_bytes: {"type": "integer"},
            "headroom_bytes": {"type": "integer"},
            "largest_batch": {"type": ["integer", "null"]},
            "throughput": {"type": "number"},
            "throughput_sources": strings,
            "accuracy_delta": {"type": ["number", "null"]},
            "accuracy_outside_band": {"type": "boolean"},
            "accuracy_unknown": strings,
            "predicted": figures_schema(),
        },
    }
    searched = {k: {"type": "integer"} for k in SEARCHED} | {
        "dominated": strings,
        "dropped": strings,
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "bench advise --json",
        "type": "object",
        "additionalProperties": False,
        "required": ["kind", "version", "model", "budget_bytes", "baseline", "plans", "provenance"],
        "properties": {
            "kind": {"const": KIND},
            "version": {"const": VERSION},
            "model": {"type": "string"},
            "mode": {"type": "string"},
            KEY.device_type: {"type": "string"},
            "batch": {"type": "integer"},
            "budget": {"type": "string"},
            "budget_bytes": {"type": "integer"},
            "baseline": figures_schema(),
            "plans": {"type": "array", "items": plan},
            "closest": {"anyOf": [plan, {"type": "null"}]},
            "needs": strings,
            "searched": {"type": "object", "additionalProperties": False, "properties": searched},
            "assumptions": {"type": "string"},
            "provenance": PROVENANCE_SCHEMA,
        },
    }
