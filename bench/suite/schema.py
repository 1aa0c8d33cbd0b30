"""A suite file's keys, declared once: each table's keys with the type a value must have, its
default and what it means. The loader (load.py, fidelity_table.py) reads a key's type and default
here and refuses a key its table does not declare, naming the ones it does; the TOML writer
(toml_text.py) writes each table's keys in their order here; docs/suites.md's key reference is
written from here (``reference``, by ``make docs``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.models import MODELS
from bench.record import KEY
from bench.spec import DEFAULTS, MODES, Fidelity
from bench.suite.values import typed

BEGIN = "<!-- keys: generated from bench/suite/schema.py by make docs; do not edit -->\n"
END = "<!-- keys: end -->\n"
# record fields a suite may compare
THROUGHPUTS = (
    KEY.samples_per_s,
    KEY.tokens_per_s,
    KEY.real_tokens_per_s,
)


@dataclass(frozen=True)
class Key:
    kind: type
    doc: str
    default: Any = None  # None: absent unless given (the loader says which keys are required)
    choices: tuple[str, ...] = ()  # the values it may take, where they are few


TOP = {
    "name": Key(str, "suite name (defaults to the file name)"),
    "description": Key(str, "one line shown in reports", ""),
    "model": Key(
        str,
        f"one of {', '.join(MODELS.names())}, 'hf:PATH' for a Hugging Face config.json (a folder "
        "holding one) or 'hf:ORG/NAME[@REVISION]' for a hub repository's, or 'module:NAME' naming "
        "your own bench.models.ModelSpec",
    ),
    "weights": Key(
        str,
        "pretrained weights loaded into the model before techniques apply: a state_dict file (.pt, "
        ".bin, .safetensors) or a save_pretrained folder",
    ),
    "mode": Key(
        str,
        '"train" (default: training steps), "inference" (forward passes only, no gradients) or '
        '"generate" (a causal LM\'s generate(): prompt_len and new_tokens in [shapes.*])',
        MODES[0],
        MODES,
    ),
    "baseline": Key(str, "name of the run (or matrix key) every run is compared with"),
    "first_look": Key(
        list,
        "names (or globs) of the runs `bench run` measures on a CPU unless --all: a first look "
        "that ends in minutes on two cores (default: every run)",
        [],
    ),
    "seed": Key(int, "integer seed for weights and data", DEFAULTS["seed"]),
    "warmup_steps": Key(
        int,
        "steps before measuring, at least 1 (allocator, autotune, compile); per device in "
        "[shapes.*]",
        DEFAULTS["warmup_steps"],
    ),
    "measure_steps": Key(int, "timed steps; per device in [shapes.*]", DEFAULTS["measure_steps"]),
    "timeout_s": Key(
        float,
        "seconds before a run is stopped and recorded as a timeout",
        DEFAULTS["timeout_s"],
    ),
    "lr": Key(float, "learning rate of the default AdamW optimizer", DEFAULTS["lr"]),
    "shapes": Key(dict, "[shapes.gpu] and [shapes.cpu] tables"),
    "runs": Key(
        list,
        "[[runs]] entries with name and techniques (optional: fidelity = false, nproc = N "
        'processes, training_args = "PATH": a transformers TrainingArguments file\'s techniques '
        "and batch)",
    ),
    "matrix": Key(
        dict,
        "[matrix] with techniques = {name = [...]}, and batch_size = {gpu = [...], cpu = [...]}, "
        "seq_len = {gpu = [...], cpu = [...]} (token models) or [matrix.lengths] name = {gpu = "
        '"DIST", cpu = "DIST"} (or several)',
    ),
    "fidelity": Key(
        dict, "[fidelity] table: train on real data and report the accuracy delta (below)"
    ),
    "throughput": Key(
        str,
        f"the figure reports compare as throughput ×: one of {', '.join(THROUGHPUTS)} "
        "(real_tokens_per_s for variable-length data, padding left out)",
        THROUGHPUTS[0],
        THROUGHPUTS,
    ),
}
# [shapes.gpu] and [shapes.cpu]: which of the model's keys a table needs depends on the model
# (ModelSpec.shape_keys) and the mode.
SHAPES = {
    "batch_size": Key(int, "samples a step takes (required)"),
    "image_size": Key(int, "image models: the image's side in pixels (required)"),
    "seq_len": Key(int, "token models: tokens a sample holds (required)"),
    "prompt_len": Key(int, 'mode = "generate": the prompt\'s tokens (required)'),
    "new_tokens": Key(
        int, 'mode = "generate": the tokens generated after it, at least 2 (required)'
    ),
    "warmup_steps": Key(int, "this device's own warm-up steps", DEFAULTS["warmup_steps"]),
    "measure_steps": Key(int, "this device's own timed steps", DEFAULTS["measure_steps"]),
    "lengths": Key(
        str,
        "token models: a length distribution the sequences are drawn from (variable-length data, "
        "below)",
    ),
    "loader_workers": Key(
        int, "token models: the DataLoader's worker processes (0: in the step's process)", 0
    ),
    "pin_memory": Key(bool, "token models: pinned host memory for the batches (CUDA)", False),
    "model": Key(
        str,
        "a smaller model of the same kind in the suite's place on this device (llama's CPU runs "
        "llama-tiny where a GPU runs Llama-3-1B)",
    ),
}
RUNS = {
    "name": Key(str, "the run's name, unique in the suite (required)"),
    "techniques": Key(
        list, 'techniques in the order they apply: names, or { name = "…", option = … }', []
    ),
    "fidelity": Key(bool, "false: this run skips the fidelity phase", True),
    "nproc": Key(int, "processes the run spans (default: 2 with a distributed technique, else 1)"),
    "batch_size": Key(dict, "the run's own batch sizes, { gpu = N, cpu = M }"),
    "training_args": Key(
        str,
        "a transformers TrainingArguments file (JSON or YAML): its techniques before the run's "
        "own, and its batch",
    ),
}
MATRIX = {
    "techniques": Key(dict, "name = [techniques]: one entry per name (required)"),
    "batch_size": Key(dict, "{ gpu = [...], cpu = [...] }: each entry at each pair (@bsN)"),
    "seq_len": Key(dict, "token models: { gpu = [...], cpu = [...] } (@seqN)"),
    "lengths": Key(
        dict, '[matrix.lengths] name = { gpu = "DIST", cpu = "DIST" }: each distribution (@name)'
    ),
    "fidelity": Key(bool, "false: the matrix's runs skip the fidelity phase", True),
}
_PHASE = Fidelity()  # the phase's defaults
FIDELITY = {
    "dataset": Key(
        str,
        "'digits' (scikit-learn, offline), 'digit-pixels' (the same digits as variable-length "
        "sequences of their non-zero pixels, for token models), 'imagefolder:PATH' or 'hf:PATH' "
        "(save_to_disk)",
        _PHASE.dataset,
    ),
    "steps": Key(int, "optimizer steps of training from the run's initial weights", _PHASE.steps),
    "batch_size": Key(int, "training batch size", _PHASE.batch_size),
    "lr": Key(float, "learning rate of the default AdamW optimizer", _PHASE.lr),
    "seeds": Key(
        int, "seeds the baseline is trained with, for the noise band (at least 2)", _PHASE.seeds
    ),
    "image_size": Key(
        int, "image side for image models (digits are upsampled from 8 px)", _PHASE.image_size
    ),
    "model": Key(
        str,
        "model to train instead of the suite's (e.g. its tiny variant, so CPU runs stay short)",
    ),
    "weights": Key(
        str,
        "pretrained weights for the phase's model (default: the suite's, when it trains the "
        "suite's model)",
    ),
    "enabled": Key(
        bool, "false switches the phase off (per device in [fidelity.gpu] / [fidelity.cpu])", True
    ),
}
# Each kind as TOML names it.
TOML = {
    str: "string",
    int: "integer",
    float: "float",
    bool: "boolean",
    list: "array",
    dict: "table",
}
# Each table as the reference names it.
TABLES = {
    "the file's top level": TOP,
    "[shapes.gpu] and [shapes.cpu]": SHAPES,
    "[[runs]]": RUNS,
    "[matrix]": MATRIX,
    "[fidelity], [fidelity.gpu] and [fidelity.cpu]": FIDELITY,
}


def read(
    table: dict[str, Any], name: str, keys: dict[str, Key], problems: list[str], *, where: str = ""
) -> Any:
    """``table[name]`` if it has the key's type (an int is taken for a float) and is one of its
    choices, else its default, with what is wrong in ``problems``."""
    key = keys[name]
    value = typed(table, name, kind=key.kind, default=key.default, problems=problems, where=where)
    if key.choices and value not in key.choices:
        problems.append(f"{where}{name}: {value!r} is none of {', '.join(key.choices)}")
        return key.default
    return value


def unknown(table: dict[str, Any], keys: dict[str, Key], where: str, problems: list[str]) -> None:
    """A key the table does not declare, with the ones it does."""
    for name in table.keys() - keys.keys():
        problems.append(f"{where}{name}: unknown key; allowed: {', '.join(keys)}")


def reference() -> str:
    """docs/suites.md's key reference: a table of keys per table of the file."""
    parts = []
    for title, keys in TABLES.items():
        rows = [
            f"| `{name}` | {TOML[key.kind]} | {_default(key.default)} | "
            f"{key.doc.replace('|', chr(92) + '|')} |"
            for name, key in keys.items()
        ]
        parts.append(
            f"**{title}**\n\n| key | type | default | what it is |\n|---|---|---|---|\n"
            + "\n".join(rows)
        )
    return "\n\n".join(parts) + "\n"


def write(path: Path) -> Path:
    """The key reference between the page's markers, the prose around it as written."""
    from bench.results import write_between

    if BEGIN not in path.read_text(encoding="utf-8"):
        raise ValueError(f"{path}: no {BEGIN.strip()} marker to write the keys after")
    write_between(path, BEGIN, END, reference())
    return path


def _default(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"
