"""A job written for another tool, as the --hf intake takes it (bench.suite.job_file)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Translated:
    """A job file as the --hf intake takes it."""

    kind: str  # the tool whose file it is
    model: str  # a config.json's folder, or a hub id
    loaded: dict[str, str]  # how the tool loads the model (dtype, attn_implementation)
    # the TrainingArguments the tool's trainer is given; None for a tool of its own loop
    # (torchtune's recipes), whose every choice is in ``techniques``
    training_args: dict[str, Any] | None
    adapter: dict[str, Any] | None  # PEFT's adapter_config.json, where it trains adapters
    techniques: list[Any]  # loading and batching the arguments do not say (bnb-4bit, packing)
    seq_len: int
    ignored: tuple[str, ...]  # its keys that change nothing a step holds
    assumed: tuple[str, ...]  # what it leaves to the card it runs on, or reads as the nearest
    adapter_options: dict[str, Any] = field(default_factory=dict)  # lora's, beside its config
    # per step, and the micro-batches it is accumulated over, where no TrainingArguments say them
    batch: int | None = None
    micro_batches: int | None = None


def whole(raw: dict[str, Any], key: str, default: int, *, where: str, found: list[str]) -> int:
    """A job file's whole number of at least 1 at ``key`` (``default`` where absent or empty, as the
    tools read a YAML key left blank); a problem named where it is anything else."""
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        found.append(f"{where}: {key} = {value!r}: expected a whole number of at least 1")
        return default
    return value
