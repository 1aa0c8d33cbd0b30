"""``--job FILE``: a whole job written for another tool (an axolotl or LLaMA-Factory YAML), told
apart by its keys and read into what ``--hf`` takes (bench.suite.from_config): the model and how it
loads, the TrainingArguments, PEFT's adapter_config and the techniques that load or batch it. The
files it is read into are written beside the suite, so that what was predicted can be read and
rerun with the flags alone."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType

from bench.errors import BadInput
from bench.suite import axolotl, llamafactory
from bench.suite.translated import Translated

# Each kind of job file, by name: its module (``CLAIMS``, the sets of keys a file of its kind
# touches every one of; ``read``).
KINDS: dict[str, ModuleType] = {m.KIND: m for m in (axolotl, llamafactory)}


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
    found = known[claimed[0]].read(raw, where, problems)
    if found is None:
        raise BadInput("\n  ".join(["the job cannot be predicted:", *problems]))
    return _located(found, path)


def _located(job: Translated, path: Path) -> Translated:
    """The job with a model (and a DeepSpeed config) named by a path relative to the file found
    there where it is not found from here, as a tool run from the file's folder would."""
    model = job.model
    if not Path(model).exists() and (path.parent / model).exists():
        model = str(path.parent / model)
    args = dict(job.training_args)
    if isinstance(ds := args.get("deepspeed"), str) and not Path(ds).is_absolute():
        args["deepspeed"] = str(Path(ds).resolve() if Path(ds).exists() else path.parent / ds)
    return Translated(**{**vars(job), "model": model, "training_args": args})


def name_of(job: Translated, path: Path) -> str:
    """``<kind>-<file's stem>``: the suite's (and its results folder's) name."""
    return f"{job.kind}-" + (re.sub(r"[^A-Za-z0-9_.-]+", "-", path.stem).strip("-.") or "job")


def written(job: Translated, folder: Path) -> tuple[Path, Path | None]:
    """The job's TrainingArguments and adapter_config written to ``folder`` (the files --hf's flags
    take), their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    args = folder / "training_args.json"
    args.write_text(json.dumps(job.training_args, indent=2) + "\n", encoding="utf-8")
    if job.adapter is None:
        return args, None
    adapter = folder / "adapter_config.json"
    adapter.write_text(json.dumps(job.adapter, indent=2) + "\n", encoding="utf-8")
    return args, adapter
