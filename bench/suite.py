"""Suite files (TOML) → frozen dataclasses.

Validation follows torchtune's habit: collect every problem, then raise once with all of them, each
naming the file, the key path and what is allowed. Nothing runs until a suite loads cleanly.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import tomllib
import typing
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal, NamedTuple

from bench import models
from bench.models import MODELS, ModelSpec
from bench.techniques import Technique, resolve

DEVICES = ("gpu", "cpu")
MODES = ("train", "inference")
TOP_KEYS = {
    "name": "suite name (defaults to the file name)",
    "description": "one line shown in reports",
    "model": f"one of {', '.join(MODELS.names())}, or 'module:NAME' naming your own bench.models.ModelSpec",
    "weights": "pretrained weights loaded into the model before techniques apply: a state_dict file "
               "(.pt, .bin, .safetensors) or a save_pretrained folder",
    "mode": '"train" (default: training steps) or "inference" (forward passes only, no gradients)',
    "baseline": "name of the run (or matrix key) every run is compared with",
    "seed": "integer seed for weights and data",
    "warmup_steps": "steps before measuring, at least 1 (allocator, autotune, compile); per device in [shapes.*]",
    "measure_steps": "timed steps; per device in [shapes.*]",
    "timeout_s": "seconds before a run is stopped and recorded as a timeout",
    "lr": "learning rate of the default AdamW optimizer",
    "shapes": "[shapes.gpu] and [shapes.cpu] tables",
    "runs": "[[runs]] entries with name and techniques (optional: fidelity = false, nproc = N processes)",
    "matrix": "[matrix] with techniques = {name = [...]} and batch_size = {gpu = [...], cpu = [...]}",
    "fidelity": "[fidelity] table: train on real data and report the accuracy delta (see FIDELITY_KEYS)",
}
FIDELITY_KEYS = {
    "dataset": "'digits' (scikit-learn, offline), 'imagefolder:PATH' or 'hf:PATH' (save_to_disk)",
    "steps": "optimizer steps of training from the run's initial weights",
    "batch_size": "training batch size",
    "lr": "learning rate of the default AdamW optimizer",
    "seeds": "seeds the baseline is trained with, for the noise band (at least 2)",
    "image_size": "image side for image models (digits are upsampled from 8 px)",
    "model": "model to train instead of the suite's (e.g. its tiny variant, so CPU runs stay short)",
    "weights": "pretrained weights for the phase's model (default: the suite's, when it trains the suite's model)",
    "enabled": "false switches the phase off (per device in [fidelity.gpu] / [fidelity.cpu])",
}
DEFAULTS = {"seed": 0, "warmup_steps": 2, "measure_steps": 5, "timeout_s": 900.0, "lr": 1e-4}
STEP_KEYS = ("warmup_steps", "measure_steps")  # suite-wide, and overridable per device in [shapes.*]


class SuiteError(Exception):
    """Every problem found in a suite file, one per line."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.path, self.problems = path, problems
        lines = "\n".join(f"  {path}: {p}" for p in problems)
        super().__init__(f"{len(problems)} problem(s) in suite {path}:\n{lines}")


@dataclass(frozen=True)
class Shapes:
    """What a run does on one kind of device: tensor shapes, and how many steps to warm up and time."""

    batch_size: int
    image_size: int | None = None
    seq_len: int | None = None
    warmup_steps: int = DEFAULTS["warmup_steps"]
    measure_steps: int = DEFAULTS["measure_steps"]


@dataclass(frozen=True)
class Fidelity:
    """The fidelity phase on one kind of device: what to train on, for how long, and on which model."""

    dataset: str = "digits"
    steps: int = 100
    batch_size: int = 32
    lr: float = 1e-3
    seeds: int = 3
    image_size: int = 32
    model: str | None = None
    weights: str | None = None


@dataclass(frozen=True)
class TechniqueSpec:
    name: str
    options: tuple[tuple[str, Any], ...] = ()

    def build(self) -> Technique:
        cls = resolve(self.name)
        return cls(cls.Config(**dict(self.options)))

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        return f"{self.name}({opts})" if opts else self.name


@dataclass(frozen=True)
class RunSpec:
    suite: str
    name: str
    model: str
    techniques: tuple[TechniqueSpec, ...]
    gpu: Shapes
    cpu: Shapes
    baseline: str
    seed: int
    timeout_s: float
    lr: float
    mode: str = "train"
    fidelity_gpu: Fidelity | None = None
    fidelity_cpu: Fidelity | None = None
    nproc: int = 1  # processes (torchrun) for distributed techniques; batch_size is per process
    weights: str | None = None  # a local path the model's weights are loaded from (else random)

    def shapes(self, device_type: str) -> Shapes:
        return self.gpu if device_type == "cuda" else self.cpu

    def fidelity(self, device_type: str) -> Fidelity | None:
        return self.fidelity_gpu if device_type == "cuda" else self.fidelity_cpu

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        # Defaults stay out: records made before suites had these keys keep their keys valid.
        for key, default in (("mode", "train"), ("fidelity_gpu", None), ("fidelity_cpu", None), ("nproc", 1),
                             ("weights", None)):
            if d[key] == default:
                del d[key]
        for fid in (d.get("fidelity_gpu"), d.get("fidelity_cpu")):
            if fid is not None and fid["weights"] is None:
                del fid["weights"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunSpec:
        techs = tuple(TechniqueSpec(t["name"], tuple(map(tuple, t["options"]))) for t in d["techniques"])
        fid = {k: Fidelity(**d[k]) for k in ("fidelity_gpu", "fidelity_cpu") if d.get(k)}
        return cls(**{**d, "techniques": techs, "gpu": Shapes(**d["gpu"]), "cpu": Shapes(**d["cpu"]), **fid})

    def key(self, device: str) -> str:
        """Identity of a measurement: the full specification plus the device it ran on."""
        blob = json.dumps({"spec": self.to_dict(), "device": device}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Suite:
    name: str
    path: Path
    model: str
    description: str
    baseline: str
    runs: tuple[RunSpec, ...]


def load(path: str | Path) -> Suite:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise SuiteError(path, [f"cannot read: {exc.strerror}"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise SuiteError(path, [f"TOML syntax: {exc}"]) from None
    problems: list[str] = []
    suite = _build(path, raw, problems)
    if problems:
        raise SuiteError(path, problems)
    return suite


def select(suite: Suite, patterns: list[str]) -> Suite:
    """The runs matching any of the names or globs, always with the baselines they are compared with."""
    chosen = {r.name for r in suite.runs if any(fnmatch.fnmatchcase(r.name, p) for p in patterns)}
    if not chosen:
        raise SuiteError(suite.path, [f"--only {','.join(patterns)}: no run matches; runs: "
                                      f"{', '.join(r.name for r in suite.runs)}"])
    chosen |= {r.baseline for r in suite.runs if r.name in chosen}
    return replace(suite, runs=tuple(r for r in suite.runs if r.name in chosen))


def _build(path: Path, raw: dict[str, Any], problems: list[str]) -> Suite:
    for key in raw.keys() - TOP_KEYS.keys():
        problems.append(f"{key}: unknown key; allowed: {', '.join(TOP_KEYS)}")
    name = _typed(raw, "name", str, path.stem, problems)
    model = _typed(raw, "model", str, None, problems)
    if model is None:
        problems.append(f"model: required; {TOP_KEYS['model']}")
    spec = _model_spec(model, "model", problems)
    weights = _weights(raw, "", problems)
    mode = _typed(raw, "mode", str, "train", problems)
    if mode not in MODES:
        problems.append(f"mode: {mode!r} is not a mode; allowed: {', '.join(MODES)}")
    common = {k: _typed(raw, k, type(v), v, problems) for k, v in DEFAULTS.items()}
    _check_ranges(common, "", problems)
    steps = {k: common.pop(k) for k in STEP_KEYS}
    shapes = _shapes(raw.get("shapes"), spec, steps, problems)
    entries = _entries(raw, problems)
    baseline = _baseline(raw, entries, problems)
    fidelity = _fidelity(raw.get("fidelity"), model, spec, weights, problems)
    runs = []
    for e in entries:
        techniques = _techniques(e.techniques, e.where, e.batch, shapes, mode, problems)
        if shapes is None or techniques is None or spec is None or baseline is None:
            continue  # already reported; keep collecting problems from the other entries
        _check_fidelity_batch(techniques, fidelity, e.where, problems)
        nproc = _nproc(e, techniques, problems)
        gpu, cpu = (replace(shapes[d], batch_size=e.batch[d]) if e.batch else shapes[d] for d in DEVICES)
        base = f"{baseline}@bs{gpu.batch_size}" if e.batch and baseline in _matrix_keys(entries) else baseline
        # The fidelity phase trains in one process: a distributed run has none.
        fid = {f"fidelity_{d}": fidelity.get(d) if e.fidelity and nproc == 1 else None for d in DEVICES}
        runs.append(RunSpec(name, e.name, model, techniques, gpu, cpu, base, **common, mode=mode, **fid, nproc=nproc,
                            weights=weights))
    description = _typed(raw, "description", str, "", problems)
    return Suite(name, path, model or "", description, baseline or "", tuple(runs))


def _model_spec(name: str | None, where: str, problems: list[str]) -> ModelSpec | None:
    """The named model's spec, or None with the reason among the problems (an unknown name, a failed import)."""
    try:
        return None if name is None else models.resolve(name)
    except KeyError as exc:
        problems.append(f"{where}: {exc.args[0]}")
        return None


def _weights(table: dict[str, Any], where: str, problems: list[str]) -> str | None:
    path = _typed(table, "weights", str, None, problems, where)
    if path is not None and not Path(path).exists():
        problems.append(f"{where}weights: no file or folder {path!r} (relative paths start where bench runs)")
    return path


def _fidelity(raw: Any, model: str | None, spec: ModelSpec | None, weights: str | None,
              problems: list[str]) -> dict[str, Fidelity | None]:
    """Per device, the fidelity phase's settings: the table's keys, overridden by [fidelity.gpu/cpu]."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append("fidelity: expected a table; keys: " + ", ".join(FIDELITY_KEYS))
        return {}
    out: dict[str, Fidelity | None] = {}
    shared = {k: v for k, v in raw.items() if k not in DEVICES}
    for key in shared.keys() - FIDELITY_KEYS.keys():
        problems.append(f"fidelity.{key}: unknown key; allowed: {', '.join(FIDELITY_KEYS)}")
    for dev in DEVICES:
        own = raw.get(dev, {}) if isinstance(raw.get(dev), dict) else {}
        for key in own.keys() - FIDELITY_KEYS.keys():
            problems.append(f"fidelity.{dev}.{key}: unknown key; allowed: {', '.join(FIDELITY_KEYS)}")
        table, found = shared | own, []

        def where(key: str) -> str:
            return f"fidelity.{dev}." if key in own else "fidelity."  # noqa: B023  (used within this iteration)

        if not _typed(table, "enabled", bool, True, found, where("enabled")):
            out[dev] = None
            continue
        values = {f.name: _typed(table, f.name, _kind(f.type), f.default, found, where(f.name))
                  for f in fields(Fidelity) if f.name != "weights"}
        values["weights"] = _weights(table, where("weights"), found)
        if values["weights"] is None and values["model"] in (None, model):
            values["weights"] = weights  # the suite's model, so the suite's weights
        for key in ("steps", "batch_size", "image_size", "seeds"):
            if not values[key] or values[key] <= 0 or (key == "seeds" and values[key] < 2):
                found.append(f"{where(key)}{key}: must be {'at least 2' if key == 'seeds' else 'positive'}")
        other = _model_spec(values["model"], f"{where('model')}model", found)
        if other is not None and spec is not None and other.inputs != spec.inputs:
            found.append(f"{where('model')}model: {values['model']!r} takes {other.inputs} inputs and the suite's "
                         f"model {spec.inputs} inputs; choose a model of the same kind")
        problems.extend(p for p in found if p not in problems)  # shared keys: reported once, not per device
        out[dev] = Fidelity(**values)
    return out


def _nproc(entry: Entry, techniques: tuple[TechniqueSpec, ...], problems: list[str]) -> int:
    """Processes for the run: as written, else 2 where a technique is distributed; checked both ways."""
    distributed = [t.name for t in techniques if t.build().distributed]
    nproc = entry.nproc or (2 if distributed else 1)
    where = entry.where.removesuffix(".techniques")
    if distributed and nproc < 2:
        problems.append(f"{where}.nproc: {distributed[0]} needs at least 2 processes, got {nproc}")
    if not distributed and nproc > 1:
        problems.append(f"{where}.nproc: {nproc} processes without ddp, fsdp or tensor-parallel would train "
                        "independent copies; add one of them or remove nproc")
    return nproc


def _kind(annotation: Any) -> type:
    """The runtime type of a Fidelity field's annotation (``str | None`` → str)."""
    return {"str": str, "int": int, "float": float, "str | None": str}[str(annotation)]


def _check_fidelity_batch(techniques: tuple[TechniqueSpec, ...], fidelity: dict[str, Fidelity | None], where: str,
                          problems: list[str]) -> None:
    for dev, fid in fidelity.items():
        for spec in techniques if fid is not None else ():
            for p in spec.build().problems(fid.batch_size):
                problems.append(f"{where}: {spec.name} at fidelity.{dev} batch_size {fid.batch_size}: {p}")


def _matrix_keys(entries: list[Entry]) -> set[str]:
    return {e.key for e in entries if e.batch is not None}


def _baseline(raw: dict[str, Any], entries: list[Entry], problems: list[str]) -> str | None:
    baseline = _typed(raw, "baseline", str, None, problems)
    names = {e.name for e in entries}
    if baseline is None:
        problems.append("baseline: required; the name of a run (or matrix key) to compare against")
    elif baseline not in names | _matrix_keys(entries):
        problems.append(f"baseline: {baseline!r} is not a run name or matrix key; runs: {', '.join(sorted(names))}")
        return None
    return baseline


def _typed(table: dict[str, Any], key: str, kind: type, default: Any, problems: list[str], where: str = "") -> Any:
    value = table.get(key, default)
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if value is not None and not ok:
        problems.append(f"{where}{key}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
        return default
    return value


def _check_ranges(values: dict[str, Any], where: str, problems: list[str]) -> None:
    for k, v in values.items():
        if k in DEFAULTS and k != "seed" and isinstance(v, (int, float)) and v <= 0:
            problems.append(f"{where}{k}: must be > 0, got {v}")


def _shapes(raw: Any, spec: ModelSpec | None, steps: dict[str, int], problems: list[str]) -> dict[str, Shapes] | None:
    if not isinstance(raw, dict):
        problems.append("shapes: required table with [shapes.gpu] and [shapes.cpu]")
        return None
    for key in raw.keys() - set(DEVICES):
        problems.append(f"shapes.{key}: unknown device; allowed: gpu, cpu")
    need = spec.shape_keys if spec is not None else ()
    out = {}
    for dev in DEVICES:
        table = raw.get(dev)
        if not isinstance(table, dict):
            problems.append(f"shapes.{dev}: required table with batch_size and {', '.join(need) or 'the model shapes'}")
            continue
        allowed = ("batch_size", *need)
        for key in table.keys() - {*allowed, *STEP_KEYS} if spec is not None else ():  # else: model reported
            problems.append(f"shapes.{dev}.{key}: unknown key for model {spec.name}; "
                            f"allowed: {', '.join(allowed + STEP_KEYS)}")
        values = {key: _typed(table, key, int, None, problems, f"shapes.{dev}.") for key in allowed}
        bad = [k for k, v in values.items() if v is None or v <= 0]
        for key in bad:
            if values[key] is not None or key not in table:  # a wrong type is reported already
                problems.append(f"shapes.{dev}.{key}: required positive integer, got {table.get(key)!r}")
        own_steps = {k: _typed(table, k, int, v, problems, f"shapes.{dev}.") for k, v in steps.items()}
        _check_ranges(own_steps, f"shapes.{dev}.", problems)
        if not bad:
            out[dev] = Shapes(**values, **own_steps)
    return out if len(out) == len(DEVICES) else None


class Entry(NamedTuple):
    """A run as written in the file, before its techniques are checked."""

    name: str
    techniques: Any
    batch: dict[str, int] | None  # per-device batch sizes from the matrix, else None
    key: str  # the matrix key, or the run name
    where: str  # key path for messages
    fidelity: bool = True  # false: this entry skips the fidelity phase
    nproc: int | None = None  # processes, as written (None: 2 with a distributed technique, else 1)


def _entries(raw: dict[str, Any], problems: list[str]) -> list[Entry]:
    entries: list[Entry] = []
    runs = raw.get("runs", [])
    if not isinstance(runs, list):
        problems.append("runs: expected an array of [[runs]] tables")
        runs = []
    for i, run in enumerate(runs):
        where = f"runs[{i}]"
        if not isinstance(run, dict):
            problems.append(f"{where}: expected a table with name and techniques")
            continue
        for key in run.keys() - {"name", "techniques", "fidelity", "nproc"}:
            problems.append(f"{where}.{key}: unknown key; allowed: name, techniques, fidelity, nproc")
        name = _typed(run, "name", str, None, problems, f"{where}.")
        if name is None:
            problems.append(f"{where}.name: required string")
            continue
        fidelity = _typed(run, "fidelity", bool, True, problems, f"{where}.")
        nproc = _typed(run, "nproc", int, None, problems, f"{where}.")
        if nproc is not None and nproc < 1:
            problems.append(f"{where}.nproc: must be at least 1, got {nproc}")
        entries.append(Entry(name, run.get("techniques", []), None, name, f"{where}.techniques", fidelity, nproc))
    if "matrix" in raw:
        entries += _matrix(raw["matrix"], problems)
    if not entries:
        problems.append("runs: the suite has no runs; add [[runs]] entries or a [matrix]")
    seen: set[str] = set()
    for name in (e.name for e in entries):
        if name in seen:
            problems.append(f"runs: duplicate run name {name!r}; names must be unique")
        seen.add(name)
    return entries


def _matrix(raw: Any, problems: list[str]) -> list[Entry]:
    if not isinstance(raw, dict):
        problems.append(f"matrix: expected a table; {TOP_KEYS['matrix']}")
        return []
    for key in raw.keys() - {"techniques", "batch_size", "fidelity"}:
        problems.append(f"matrix.{key}: unknown key; allowed: techniques, batch_size, fidelity")
    fidelity = _typed(raw, "fidelity", bool, True, problems, "matrix.")
    techs, sizes = raw.get("techniques"), raw.get("batch_size")
    if not isinstance(techs, dict) or not techs:
        problems.append("matrix.techniques: required table of name = [techniques]")
        return []
    lists = isinstance(sizes, dict) and all(isinstance(v, list) for v in sizes.values())
    if not (lists and set(sizes) == set(DEVICES)):
        problems.append("matrix.batch_size: required {gpu = [...], cpu = [...]}, lists of equal length")
        return []
    if len(sizes["gpu"]) != len(sizes["cpu"]) or not sizes["gpu"]:
        problems.append("matrix.batch_size: gpu and cpu lists must be non-empty and of equal length")
        return []
    for dev in DEVICES:
        for j, b in enumerate(sizes[dev]):
            if not isinstance(b, int) or isinstance(b, bool) or b <= 0:
                problems.append(f"matrix.batch_size.{dev}[{j}]: must be a positive integer, got {b!r}")
                return []
    return [
        Entry(f"{key}@bs{g}", t, {"gpu": g, "cpu": c}, key, f"matrix.techniques.{key}", fidelity)
        for key, t in techs.items()
        for g, c in zip(sizes["gpu"], sizes["cpu"])
    ]


def _techniques(raw: Any, where: str, batch: dict[str, int] | None, shapes: dict[str, Shapes] | None,
                mode: str, problems: list[str]) -> tuple[TechniqueSpec, ...] | None:
    if not isinstance(raw, list):
        problems.append(f"{where}: expected a list of names or {{ name = ..., option = ... }} tables")
        return None
    specs = [s for i, item in enumerate(raw) if (s := _technique(item, f"{where}[{i}]", problems)) is not None]
    built = [s.build() for s in specs]
    before = len(problems)
    for spec, technique in zip(specs, built):
        if mode in MODES and mode not in technique.modes:
            problems.append(f"{where}: {spec.name} does not apply to {mode} suites; "
                            f"it works in: {', '.join(sorted(technique.modes))}")
    _check_combination(where, built, problems)
    for spec, technique in zip(specs, built):
        for dev in DEVICES:
            if shapes is not None and dev in shapes:
                size = batch[dev] if batch else shapes[dev].batch_size
                for p in technique.problems(size):
                    problems.append(f"{where}: {spec.name} at {dev} batch_size {size}: {p}")
    ok = len(specs) == len(raw) and len(problems) == before
    return tuple(specs) if ok else None


def _technique(item: Any, where: str, problems: list[str]) -> TechniqueSpec | None:
    options: dict[str, Any] = {}
    if isinstance(item, dict):
        options = {k: v for k, v in item.items() if k != "name"}
        item = item.get("name")
    if not isinstance(item, str):
        problems.append(f"{where}: expected a technique name or a table with name = ...")
        return None
    try:
        cls = resolve(item)
    except KeyError as exc:
        problems.append(f"{where}: {exc.args[0]}")
        return None
    return _check_options(cls, item, options, where, problems)


def _check_options(cls: type[Technique], name: str, options: dict[str, Any], where: str,
                   problems: list[str]) -> TechniqueSpec | None:
    hints = typing.get_type_hints(cls.Config)
    allowed = [f.name for f in fields(cls.Config)]
    before = len(problems)
    for key, value in options.items():
        if key not in allowed:
            problems.append(f"{where}.{key}: unknown option of {name}; allowed: {', '.join(allowed) or 'none'}")
        elif (why := _type_error(hints[key], value)) is not None:
            problems.append(f"{where}.{key}: {why}")
    if len(problems) > before:
        return None
    return TechniqueSpec(name, tuple(sorted(options.items())))


def _type_error(hint: Any, value: Any) -> str | None:
    if type(None) in typing.get_args(hint):  # an optional option: its value has the other type
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        return None if value in choices else f"must be one of {', '.join(map(repr, choices))}, got {value!r}"
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return None
    if isinstance(value, hint) and not (hint is not bool and isinstance(value, bool)):
        return None
    return f"expected {hint.__name__}, got {type(value).__name__} {value!r}"


def _check_combination(where: str, techniques: list[Technique], problems: list[str]) -> None:
    names = [t.name or type(t).__qualname__ for t in techniques]
    for n in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{where}: technique {n!r} is listed twice")
    for i, a in enumerate(techniques):
        for b in techniques[i + 1:]:
            if b.name in a.conflicts or a.name in b.conflicts:
                problems.append(f"{where}: {a.name} and {b.name} cannot be combined; remove one")
            elif why := a.conflict(b) or b.conflict(a):
                problems.append(f"{where}: {a.name} and {b.name} cannot be combined: {why}")
