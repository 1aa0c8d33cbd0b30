"""A run's ``training_args = "PATH"``: the TrainingArguments of a transformers ``Trainer`` job (a
JSON file, as ``TrainingArguments.to_json_string`` writes it, or YAML, as TRL and axolotl configs
hold it), read for the fields that change what a step holds, each becoming the technique or batch
size it means. A field that changes what a step holds but is not modelled yet (DeepSpeed, FSDP,
Liger's kernels, …) is a problem naming it, never ignored; every other field changes nothing a step
holds and is listed as ignored. An unknown field, or two that contradict each other, is a problem
naming the key."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# The Trainer's optimizers (its `optim` names) as this harness's techniques, the parameters in the
# Trainer's groups: its SGD has no momentum (so no state); its Adafactor is transformers' own, whose
# update holds other temporaries.
OPTIMIZERS: dict[str, list[Any]] = {
    "adamw_torch": [{"name": "optimizer", "kind": "adamw", "groups": "trainer"}],
    "adamw_torch_fused": [
        {"name": "optimizer", "kind": "adamw", "impl": "fused", "groups": "trainer"}
    ],
    # transformers 4.x's own AdamW (every TrainingArguments it wrote names it): a parameter at a
    # time
    "adamw_hf": [{"name": "optimizer", "kind": "adamw", "impl": "single", "groups": "trainer"}],
    "adafactor": [{"name": "optimizer", "kind": "adafactor-transformers", "groups": "trainer"}],
    "adamw_8bit": ["adamw-8bit"],
    "adamw_bnb_8bit": ["adamw-8bit"],
    "paged_adamw_8bit": ["paged-adamw-8bit"],
    "paged_adamw_32bit": ["paged-adamw-32bit"],
    "sgd": [{"name": "optimizer", "kind": "sgd", "momentum": 0.0, "groups": "trainer"}],
}
# Fields that change what a step holds, not modelled yet: a job that sets one is refused, by name
# and why, where reading it as ignored would predict a peak several-fold off. (fsdp_config matters
# only beside fsdp, and to_json_string writes its defaults into every file.)
NOT_MODELLED = {
    "deepspeed": "DeepSpeed's ZeRO shards parameters, gradients and optimizer state over the "
    "ranks and may offload them",
    "fsdp": "FSDP shards parameters, gradients and optimizer state over the ranks",
    "use_liger_kernel": "Liger's kernels fuse the loss over chunks of the logits, and the norms "
    "and MLPs",
    "optim_target_modules": "GaLore-style optimizers keep these modules' gradients projected",
    "auto_find_batch_size": "the Trainer halves the batch after each out-of-memory until one fits",
    "torch_empty_cache_steps": "the allocator's cache is emptied every N steps, which changes "
    "what is reserved",
}
READ = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "gradient_checkpointing",
    "gradient_checkpointing_kwargs",
    "optim",
    "bf16",
    "fp16",
    "tf32",
    "torch_compile",
)


@dataclass(frozen=True)
class Job:
    """What the arguments make of a run: its techniques (TOML form), its batch per device, and what
    was ignored."""

    techniques: list[Any]
    batch_size: int
    ignored: tuple[str, ...]


def read(path: str, where: str, problems: list[str]) -> Job | None:
    """The job ``path`` describes; None, with the problems said, where it cannot be read or makes no
    sense."""
    args = load_args(Path(path), where, problems)
    if args is None:
        return None
    from transformers import TrainingArguments

    known = {f.name for f in fields(TrainingArguments)}
    found = [
        f"{where}: {key}: not a TrainingArguments field (transformers {_version()})"
        for key in sorted(args.keys() - known)
    ]
    found += [
        f"{where}: {key} = {args[key]!r}: changes what a step holds ({why}), which this harness "
        "does not model yet; remove it to predict the job without it"
        for key, why in NOT_MODELLED.items()
        if args.get(key) not in (None, False, "", [], {})
    ]
    techniques = (
        _precision(args, where, found)
        + _optimizer(args, where, found)
        + _checkpointing(args, where, found)
    )
    steps = _positive(args, "gradient_accumulation_steps", default=1, where=where, found=found)
    batch = _positive(args, "per_device_train_batch_size", default=8, where=where, found=found)
    techniques += [{"name": "accumulate", "micro_batches": steps}] if steps > 1 else []
    techniques += [{"name": "tf32", "enabled": True}] if args.get("tf32") else []
    techniques += ["compile"] if args.get("torch_compile") else []
    problems += found
    ignored = tuple(
        sorted(k for k in args.keys() & known if k not in READ and k not in NOT_MODELLED)
    )
    if found:
        return None
    return Job(techniques, batch * steps, ignored)


def load_args(path: Path, where: str, problems: list[str]) -> dict[str, Any] | None:
    """The file's fields; None, with the problem said, where it cannot be read as a table of
    them."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        problems.append(f"{where}: cannot read {path} ({exc.strerror or exc})")
        return None
    try:
        args = _parse(text, path.suffix)
    except ValueError as exc:
        problems.append(f"{where}: {path} does not parse: {exc}")
        return None
    if not isinstance(args, dict):
        problems.append(
            f"{where}: {path} holds a {type(args).__name__}; expected TrainingArguments' fields"
        )
        return None
    return args


def _parse(text: str, suffix: str) -> Any:
    if suffix in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(str(exc)) from None
    return json.loads(text)


def _precision(args: dict[str, Any], where: str, found: list[str]) -> list[Any]:
    """The Trainer's bf16 and fp16 are autocast (mixed precision), fp16 with its GradScaler."""
    if args.get("bf16") and args.get("fp16"):
        found.append(f"{where}: bf16 and fp16: both true; the Trainer takes one mixed precision")
        return []
    if args.get("bf16"):
        return [{"name": "amp", "dtype": "bfloat16"}]
    if args.get("fp16"):
        return [{"name": "amp", "dtype": "float16"}]
    return []


def _optimizer(args: dict[str, Any], where: str, found: list[str]) -> list[Any]:
    optim = args.get("optim", "adamw_torch")
    if optim in OPTIMIZERS:
        return list(OPTIMIZERS[optim])
    found.append(f"{where}: optim = {optim!r}: not modelled here; one of {', '.join(OPTIMIZERS)}")
    return []


def _checkpointing(args: dict[str, Any], where: str, found: list[str]) -> list[Any]:
    """gradient_checkpointing_enable wraps each decoder or encoder layer, non-reentrant unless the
    kwargs say otherwise (transformers 5's default; 4.x defaulted to reentrant, and says so in its
    kwargs when written)."""
    kwargs = args.get("gradient_checkpointing_kwargs") or {}
    if not isinstance(kwargs, dict) or kwargs.keys() - {"use_reentrant"}:
        found.append(
            f"{where}: gradient_checkpointing_kwargs: only use_reentrant is modelled, got "
            f"{kwargs!r}"
        )
        return []
    if not args.get("gradient_checkpointing"):
        return []
    if kwargs.get("use_reentrant"):
        return [{"name": "checkpoint", "reentrant": True}]
    return ["checkpoint"]


def _positive(args: dict[str, Any], key: str, default: int, where: str, found: list[str]) -> int:
    value = args.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        found.append(f"{where}: {key}: expected a whole number of at least 1, got {value!r}")
        return default
    return value


def _version() -> str:
    import transformers

    return transformers.__version__
