"""A suite for a job given as its files rather than written out: a Hugging Face config.json, and
optionally the job's TrainingArguments and PEFT adapter_config.json (``bench predict --hf PATH …``,
``bench suite --hf``). The suite holds a baseline (the model fine-tuned in full, at the job's batch)
and the job itself, so that its report says what the job's choices save."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from bench.errors import BadInput
from bench.hub import REPO
from bench.spec import HF, hf_config_file
from bench.suite.quantized import loaded_as

# the GPU shapes where neither the flags nor the arguments give them
SEQ_LEN = 512
IMAGE_SIZE = 224
BATCH = 8
# a CPU's: a few seconds a step on a small config
CPU_SEQ_LEN = 64
CPU_IMAGE_SIZE = 32
CPU_BATCH = 2


def name_of(config: str) -> str:
    """``hf-<folder>``, or for a hub id ``hf-<NAME>``: the suite's (and its results folder's)
    name."""
    path = Path(config)
    if path.is_dir():
        stem = path.name
    elif not path.exists() and (named := REPO.fullmatch(config)):
        stem = named["repo"].partition("/")[2] + "-" + (named["revision"] or "")
    else:
        stem = path.parent.name or path.stem
    return "hf-" + (re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-.") or "model")


def suite_text(
    config: str,
    training_args: str | None = None,
    adapter_config: str | None = None,
    seq_len: int | None = None,
    batch: int | None = None,
    inputs: str = "tokens",
    quantization_config: str | None = None,
    nproc: int | None = None,
    loaded: dict[str, str] | None = None,
    techniques: list[Any] | None = None,
    described: str | None = None,
    adapter_options: dict[str, Any] | None = None,
    micro_batches: int | None = None,
) -> str:
    """The suite's TOML: ``inputs`` is the model's ("tokens" or "image"), which sets the shape keys.
    Without arguments, adapters or a quantization config, the baseline alone: the model fine-tuned
    in full. ``quantization_config``: a BitsAndBytesConfig file the job loads the model with (the
    baseline fine-tunes it unquantized); BadInput where it cannot be read or is not modelled.
    ``nproc``: the processes a sharded job (the arguments' ``fsdp``) spans, which it needs. A job
    file (bench.suite.job_file) gives how its tool ``loaded`` the model, the ``techniques`` that
    load or batch it before its adapters, the ``adapter_options`` beside its adapter_config, how it
    is ``described``, and, for a tool of its own loop, the ``micro_batches`` its ``batch`` is
    accumulated over."""
    from bench.suite.toml_text import to_toml
    from bench.suite.training_args import sharded

    if inputs == "tokens":
        size_key = "seq_len"
    else:
        size_key = "image_size"
    args = _read_args(training_args)
    per_device, steps, max_length, by_args = _trainer_shapes(args)
    if micro_batches:
        per_device, steps = (batch or BATCH) // micro_batches, micro_batches
    loaded = by_args | (loaded or {})
    # an SFTConfig's sequences are its max_length unless the flag says otherwise
    size = seq_len or max_length or _default_size(config, inputs)
    cpu_size = min(size, CPU_SEQ_LEN if inputs == "tokens" else CPU_IMAGE_SIZE)
    gpu_batch = batch or per_device * steps
    # the accumulation steps divide it, as the job's own batch
    cpu_batch = min(per_device, CPU_BATCH) * steps
    given = _given(training_args, adapter_config, quantization_config)
    header = {
        # as SFTTrainer loads a model it is given by name (float32 unless its kwargs say)
        "model": HF
        + config
        + ("#" + ",".join(f"{k}={v}" for k, v in loaded.items()) if loaded else ""),
        "baseline": "baseline",
        "description": f"{described or config + ': the job' + given} beside full fine-tuning",
        "shapes": {
            "gpu": {"batch_size": gpu_batch, size_key: size},
            "cpu": {"batch_size": cpu_batch, size_key: cpu_size},
        },
    }
    job: dict[str, Any] = {"name": "job", "techniques": list(techniques or [])}
    if training_args:
        job["training_args"] = training_args
    if sharded(args):
        if not nproc:
            raise BadInput(
                f"--training-args {training_args}: fsdp or deepspeed shards the job over the "
                "processes its launcher starts, which the arguments do not say: give --nproc N (8: "
                "a node of 8)"
            )
        job["nproc"] = nproc
    if quantization_config:
        job["techniques"].insert(0, _quantized(quantization_config, args))
    if adapter_config:
        adapter = {"name": _adapter(adapter_config), "config": adapter_config}
        job["techniques"] += [adapter | (adapter_options or {})]
    runs = [{"name": "baseline", "techniques": []}] + (
        [job] if training_args or adapter_config or quantization_config or techniques else []
    )
    if quantized := loaded_as(hf_config_file(config), []):
        if quantization_config:
            raise BadInput(
                f"--quantization-config {quantization_config}: {config} is saved quantized "
                "already (its config.json's quantization_config); leave the flag out"
            )
        # saved quantized: no full-precision model to fine-tune beside it, and the Trainer refuses
        # a purely quantized one, so the job alone, adapters and all, is its own baseline
        job["techniques"].insert(0, quantized)
        header["baseline"] = "job"
        header["description"] = f"{config}: the job{given}"
        runs = [job]
    return to_toml(header, runs)


def _default_size(config: str, inputs: str) -> int:
    """The sequence a job of no stated length is predicted at: ``SEQ_LEN`` tokens, or the positions
    the config gives its model where they are fewer (a BERT of 128 learned positions cannot take
    512); an image model's ``IMAGE_SIZE``."""
    if inputs != "tokens":
        return IMAGE_SIZE
    try:
        positions = json.loads(hf_config_file(config).read_text()).get("max_position_embeddings")
    except (OSError, ValueError):  # the suite's loader says what is wrong with the config
        positions = None
    if isinstance(positions, int) and 0 < positions < SEQ_LEN:
        return positions
    return SEQ_LEN


def _read_args(training_args: str | None) -> dict[str, Any]:
    """The job's TrainingArguments or SFTConfig as read; empty where none are given, or where they
    cannot be read (the suite's loader then names what is wrong)."""
    from bench.suite.training_args import load_args

    if not training_args:
        return {}
    return load_args(Path(training_args), "", []) or {}


def _trainer_shapes(args: dict[str, Any]) -> tuple[int, int, int | None, dict[str, str]]:
    """The job's batch per device, its accumulation steps, and an SFTConfig's sequence length and
    model loading, for the baseline to run at the job's shapes and weights; the defaults where the
    arguments do not give them."""
    from bench.suite.training_args import loaded_as, sequence_length

    per_device = args.get("per_device_train_batch_size", BATCH)
    steps = args.get("gradient_accumulation_steps", 1)
    if not (isinstance(per_device, int) and isinstance(steps, int)):
        per_device, steps = BATCH, 1
    return per_device, steps, sequence_length(args), loaded_as(args)


def _quantized(path: str, args: dict[str, Any]) -> dict[str, Any]:
    """The technique a BitsAndBytesConfig file (as ``to_json_file`` writes it) loads the job's
    model with; BadInput naming the file where it cannot be read, is not modelled, or an
    SFTConfig's model_init_kwargs (in ``args``) load the model too."""
    import json

    from bench.suite.quantized import technique

    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadInput(f"--quantization-config {path}: cannot read it as JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise BadInput(f"--quantization-config {path}: expected a JSON object, a config's fields")
    init = args.get("model_init_kwargs")
    if isinstance(init, dict) and init.get("quantization_config"):
        raise BadInput(
            f"--quantization-config {path}: the training arguments' model_init_kwargs load the "
            "model quantized already; give one of the two"
        )
    problems: list[str] = []
    found = technique(raw, f"--quantization-config {path}", problems)
    if found is None:
        raise BadInput("; ".join(problems))
    return found


def _adapter(path: str) -> str:
    """The technique of PEFT's adapter_config.json, by its peft_type: ia3 for IA3, else lora (whose
    loader names any other type as not modelled)."""
    import json

    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "lora"  # the loader says what is wrong with it
    return "ia3" if isinstance(raw, dict) and raw.get("peft_type") == "IA3" else "lora"


def _given(
    training_args: str | None, adapter_config: str | None, quantization_config: str | None = None
) -> str:
    parts = [
        f"training arguments {training_args}" if training_args else "",
        f"quantized by {quantization_config}" if quantization_config else "",
        f"adapters {adapter_config}" if adapter_config else "",
    ]
    if any(parts):
        return " (" + ", ".join(s for s in parts if s) + ")"
    return ""
