"""A Hugging Face config.json's ``quantization_config``: a checkpoint saved quantized loads
quantized, whatever the job says, so its runs must name the technique that loads it so.
bitsandbytes' 4-bit and 8-bit are modelled (the bnb-4bit and bnb-8bit techniques, their options
read as transformers' ``BitsAndBytesConfig`` reads them); any other method, or an 8-bit option
that keeps other tensors, is refused by name, never loaded as if it were not there."""

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
# BitsAndBytesConfig's 8-bit options that keep other tensors than Linear8bitLt's frozen int8
# weight, refused: what each does
BNB_8BIT_NOT_MODELLED = {
    "llm_int8_has_fp16_weight": "keeps each weight in float16 and quantizes it again every forward",
    "llm_int8_enable_fp32_cpu_offload": "keeps the modules a device_map sends to the host there, "
    "in float32",
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
    bnb = found.get("quant_method", "bitsandbytes") == "bitsandbytes"
    if bnb and found.get("load_in_8bit"):
        return _eight_bit(found, where, problems)
    if not bnb or not found.get("load_in_4bit"):
        problems.append(
            f"{where}: quant_method {found.get('quant_method')!r} is not modelled yet; "
            "bitsandbytes' 4-bit (load_in_4bit) and 8-bit (load_in_8bit) are, as the bnb-4bit and "
            "bnb-8bit techniques"
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


def _eight_bit(found: dict[str, Any], where: str, problems: list[str]) -> dict[str, Any] | None:
    """bnb-8bit with the config's outlier threshold and skipped modules; None, a problem said, where
    an option keeps what it does not model."""
    for key, does in BNB_8BIT_NOT_MODELLED.items():
        if found.get(key):
            problems.append(
                f"{where}: {key} = {found[key]!r} {does}: not modelled; without it bitsandbytes' "
                "8-bit is, as the bnb-8bit technique"
            )
            return None
    out: dict[str, Any] = {"name": "bnb-8bit"}
    if found.get("llm_int8_threshold") is not None:
        out["threshold"] = float(found["llm_int8_threshold"])
    if skip := found.get("llm_int8_skip_modules"):
        out["skip"] = ",".join(skip)
    return out
