"""``--job FILE``: a whole job written for another tool (an axolotl, LLaMA-Factory or torchtune
YAML), told apart by its keys and read into what ``--hf`` takes (bench.suite.from_config): the
model and how it loads, the TrainingArguments (or, for a tool of its own loop, the techniques they
would have made), PEFT's adapter_config and the techniques that load or batch it. The files it is
read into are written beside the suite, so that what was predicted can be read and rerun."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.errors import BadInput
from bench.suite import axolotl, llamafactory, torchtune
from bench.suite.translated import Translated

# the keys of the kinds' files that name a path (a model's folder, a DeepSpeed config)
PATHS = frozenset({"base_model", "base_model_config", "model_name_or_path", "deepspeed"})
# Each kind of job file, by name: its module (``CLAIMS``, the sets of keys a file of its kind
# touches every one of; ``read``).
KINDS: dict[str, ModuleType] = {m.KIND: m for m in (axolotl, llamafactory, torchtune)}


def read(path: Path) -> Translated:
    """The job in ``path``; BadInput naming the file and every key refused, or the kinds known where
    it is none of them."""
    from bench.suite.training_args import load_args

    problems: list[str] = []
    raw = load_args(path, f"--job {path}", problems)
    if raw is None:
        raise BadInput("; ".join(problems))
    known = KINDS
    claimed = [name for name, m in known.items() if all(raw.keys() & keys for keys in m.CLAIMS)]
    if not claimed:
        raise BadInput(
            f"--job {path}: not a job file of a kind this harness reads ({', '.join(known)}); a "
            "transformers TrainingArguments file goes with --hf CONFIG --training-args FILE"
        )
    where = f"--job {path}"
    found = known[claimed[0]].read(_located(raw, path), where, problems)
    if found is None:
        raise BadInput("\n  ".join(["the job cannot be predicted:", *problems]))
    return found


def _located(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """The file's fields with each path it names (PATHS) found from the file's folder where it is
    not found from here, as the tool run from there would find it; a DeepSpeed config's made
    absolute, as the TrainingArguments it goes into are written elsewhere."""
    out = dict(raw)
    for key in PATHS & raw.keys():
        if not isinstance(named := raw[key], str) or Path(named).is_absolute():
            continue
        found = Path(named) if Path(named).exists() else path.parent / named
        if found.exists():
            out[key] = str(found.resolve() if key == "deepspeed" else found)
    return out


def name_of(job: Translated, path: Path) -> str:
    """``<kind>-<file's stem>``: the suite's (and its results folder's) name."""
    return f"{job.kind}-" + (re.sub(r"[^A-Za-z0-9_.-]+", "-", path.stem).strip("-.") or "job")


def written(job: Translated, folder: Path) -> tuple[Path | None, Path | None]:
    """The job's TrainingArguments and adapter_config written to ``folder`` (the files --hf's flags
    take), their paths (None for one it has not)."""
    folder.mkdir(parents=True, exist_ok=True)
    return (
        _write(job.training_args, folder / "training_args.json"),
        _write(job.adapter, folder / "adapter_config.json"),
    )


def _write(fields: dict[str, Any] | None, path: Path) -> Path | None:
    if fields is None:
        return None
    path.write_text(json.dumps(fields, indent=2) + "\n", encoding="utf-8")
    return path
