"""A Hugging Face config.json's ``quantization_config``: a checkpoint saved quantized loads
quantized, whatever the job says, so its runs must name the technique that loads it so.
bitsandbytes' 4-bit is modelled (the bnb-4bit technique, its options read as transformers'
``BitsAndBytesConfig`` reads them); any other method is refused by name, never loaded as if it were
not there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# BitsAndBytesConfig's 4-bit fields, as bnb-4bit's options
BNB_4BIT = {
    "bnb_4bit_quant_type": "quant_type",
    "bnb_4bit_use_double_quant": "double_quant",
    "bnb_4bit_compute_dtype": "compute_dtype",
    "bnb_4bit_quant_storage": "storage",
}
# what config.json may write a dtype as: "bfloat16", or "torch.bfloat16" from older transformers
DTYPE_OPTIONS = ("compute_dtype", "storage")


def loaded_as(config_file: Path, problems: list[str]) -> dict[str, Any] | None:
    """The technique (in a suite's TOML form) the config's ``quantization_config`` loads the model
    with; None where it has none, or, a problem said, where its method is not modelled."""
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the model's loader says what is wrong with the file
    found = raw.get("quantization_config") if isinstance(raw, dict) else None
    if not found:
        return None
    return technique(found, f"{config_file}: quantization_config", problems)


def technique(found: dict[str, Any], where: str, problems: list[str]) -> dict[str, Any] | None:
    """The technique a ``BitsAndBytesConfig`` (as its ``to_dict`` writes it) loads a model with;
    None, a problem said, for what is not modelled."""
    if found.get("quant_method", "bitsandbytes") != "bitsandbytes" or not found.get("load_in_4bit"):
        kind = (
            "bitsandbytes 8-bit (load_in_8bit, Linear8bitLt)"
            if found.get("load_in_8bit")
            else f"quant_method {found.get('quant_method')!r}"
        )
        problems.append(
            f"{where}: {kind} is not modelled yet; bitsandbytes' 4-bit (load_in_4bit) is, as the "
            "bnb-4bit technique"
        )
        return None
    out: dict[str, Any] = {"name": "bnb-4bit"}
    for key, option in BNB_4BIT.items():
        if found.get(key) is not None:
            value = found[key]
            if option in DTYPE_OPTIONS:
                value = str(value).removeprefix("torch.")
            out[option] = value
    if skip := found.get("llm_int8_skip_modules"):
        out["skip"] = ",".join(skip)
    return out
