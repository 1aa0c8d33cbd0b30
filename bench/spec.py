"""What a loaded suite is: frozen dataclasses the rest of the harness reads, and a run's identity.

The ground floor: plain values that import nothing from the project but the record's field names
(bench.record) and where a config.json is (bench.hub), neither importing anything of ours, so that
models, data and techniques can take Shapes and a TechniqueSpec without reaching up to the suite
loader (bench.techniques.build turns a TechniqueSpec into its technique)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from bench.hub import config_file
from bench.record import KEY, Record

DEVICES = ("gpu", "cpu")
MODES = ("train", "inference", "generate")
DEFAULTS = {"seed": 0, "warmup_steps": 2, "measure_steps": 5, "timeout_s": 900.0, "lr": 1e-4}
# suite-wide, and overridable per device in [shapes.*]
STEP_KEYS = (
    "warmup_steps",
    "measure_steps",
)
# a week: beyond it the wait's arithmetic overflows (1e10 did, at the first run)
MAX_TIMEOUT_S = 7 * 24 * 3600.0
# processes a run (or a prediction) may span: the largest clusters built, and some room
MAX_NPROC = 65_536


@dataclass(frozen=True, kw_only=True)
class Shapes:
    """What a run does on one kind of device: tensor shapes, and how many steps to warm up and
    time."""

    batch_size: int
    image_size: int | None = None
    seq_len: int | None = None
    warmup_steps: int = DEFAULTS["warmup_steps"]
    measure_steps: int = DEFAULTS["measure_steps"]
    # Variable-length token data through a DataLoader (bench.data.varlen): a length distribution, or
    # None for fixed-length synthetic batches; the loader's worker processes, and pinned host memory
    # on CUDA.
    lengths: str | None = None
    loader_workers: int = 0
    pin_memory: bool = False
    # Each pass takes the epoch's worst batch alone, the one of most padded tokens (``bench predict
    # --worst-step``), where lengths are given; False: the loader's batches in order.
    worst_step: bool = False
    # Each pass measures the epoch's every batch in order (``bench predict --epoch``), each step
    # marked as it ends, so the allocator replays the whole pass: where lengths are given.
    epoch: bool = False
    # The pass's order (``ORDERS``): the loader's, from the seed, or another of the same batches,
    # each a way a cache may be split before a long batch comes
    epoch_order: str = "loader"
    # The model this device runs in the suite's place, of its family and smaller (a CPU's llama-tiny
    # for Llama-3-1B); None: the suite's own.
    model: str | None = None
    # Generation (mode = "generate"): the prompt's tokens and the tokens generated after it; seq_len
    # is their sum, the context the model holds.
    prompt_len: int | None = None
    new_tokens: int | None = None


# The orders a pass may take (``epoch_order``, ``bench predict --epoch ORDER``): the loader's, from
# the seed; the same batches shortest first, longest first, or the loader's with its longest (those
# padded to the most tokens) moved to the end, in the order they came: the batch that finally comes
# is longer than any before it (bench.data.varlen.ordered)
ORDERS = ("loader", "ascending", "descending", "longest-last")


# Left out of a spec's key at their defaults, so that records made before these fields keep their
# keys.
DATA_DEFAULTS = {
    "lengths": None,
    "loader_workers": 0,
    "pin_memory": False,
    "worst_step": False,
    "epoch": False,
    "epoch_order": "loader",
    "model": None,
    "prompt_len": None,
    "new_tokens": None,
}


@dataclass(frozen=True, kw_only=True)
class Fidelity:
    """The fidelity phase on one kind of device: what to train on, for how long, and on which
    model."""

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

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        if opts:
            return f"{self.name}({opts})"
        return self.name


# a model built from a Hugging Face config.json: hf:PATH[#task] or hf:ORG/NAME[@REVISION][#task]
# (bench.models.hf, bench.hub)
HF = "hf:"


@dataclass(frozen=True, kw_only=True)
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
        if device_type == "cuda":
            return self.gpu
        return self.cpu

    def model_on(self, device_type: str) -> str:
        """The model a run on this kind of device builds: the suite's, or the device's stand-in."""
        return self.shapes(device_type).model or self.model

    def fidelity(self, device_type: str) -> Fidelity | None:
        if device_type == "cuda":
            return self.fidelity_gpu
        return self.fidelity_cpu

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        # Defaults stay out: records made before suites had these keys keep their keys valid.
        for key, default in (
            ("mode", "train"),
            ("fidelity_gpu", None),
            ("fidelity_cpu", None),
            ("nproc", 1),
            ("weights", None),
        ):
            if d[key] == default:
                del d[key]
        for shapes in (d["gpu"], d["cpu"]):
            for key, default in DATA_DEFAULTS.items():
                if shapes[key] == default:
                    del shapes[key]
        for fid in (d.get("fidelity_gpu"), d.get("fidelity_cpu")):
            if fid is not None and fid["weights"] is None:
                del fid["weights"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunSpec:
        techs = tuple(
            TechniqueSpec(t["name"], tuple(map(tuple, t["options"]))) for t in d["techniques"]
        )
        fid = {k: Fidelity(**d[k]) for k in ("fidelity_gpu", "fidelity_cpu") if d.get(k)}
        return cls(
            **{
                **d,
                "techniques": techs,
                "gpu": Shapes(**d["gpu"]),
                "cpu": Shapes(**d["cpu"]),
                **fid,
            }
        )

    def key(self, device: str) -> str:
        """The full specification plus the device: the key records were stored under before
        ``measured_key``, still accepted for runs that name no code of the user's (bench.resume)."""
        blob = json.dumps({"spec": self.to_dict(), "device": device}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def measured_key(self, device: str, device_type: str) -> str:
        """Identity of a measurement: what can change its figures on this kind of device, the
        device, and the source of the user's own modules the run names. Left out: the time limit,
        and the other kind of device's shapes and fidelity phase (editing ``[shapes.gpu]``
        re-measures nothing on a CPU)."""
        spec = self.to_dict()
        if device_type == "cuda":
            other = "cpu"
        else:
            other = "gpu"
        for key in ("timeout_s", other, f"fidelity_{other}"):
            spec.pop(key, None)
        blob = json.dumps(
            {"spec": spec, "device": device, "code": self.user_code()}, sort_keys=True, default=str
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def user_code(self) -> dict[str, str]:
        """A digest of the source file of each module of the user's that the run names
        (``module:NAME`` models and techniques), found without importing it: an edited class
        measures again. Modules they import in turn are not read."""
        names = {self.model, self.gpu.model, self.cpu.model, *(t.name for t in self.techniques)}
        modules = sorted(
            {n.partition(":")[0] for n in names if n and ":" in n and not n.startswith(HF)}
        )
        # an edited config.json measures again too, and an edited file of lengths
        configs = sorted(n for n in names if n and n.startswith(HF))
        files = sorted(
            {
                s.lengths
                for s in (self.gpu, self.cpu)
                if s.lengths and s.lengths.startswith(("file:", "histogram:"))
            }
        )
        return (
            {m: _source_digest(m) for m in modules}
            | {c: _digest(hf_config_file(c)) for c in configs}
            | {f: _digest(Path(f.partition(":")[2])) for f in files}
        )


def hf_config_file(name: str) -> Path:
    """The config.json an ``hf:PATH[#task]`` model names: PATH itself, the config.json in that
    folder, or a hub repository's (``hf:ORG/NAME[@REVISION]``, bench.hub)."""
    return config_file(name.removeprefix(HF).partition("#")[0])


def _source_digest(module: str) -> str:
    try:
        found = importlib.util.find_spec(module)
        if found and found.origin:
            return _digest(Path(found.origin))
        return ""
    except (ImportError, ValueError):  # not importable here: the run itself will say why
        return ""


def _digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError:  # unreadable here: the run itself will say why
        return ""


@dataclass(frozen=True, kw_only=True)
class Job:
    """What the launcher hands a worker process (as a JSON file): the run, where and how it is
    measured."""

    spec: RunSpec
    device_type: str  # cuda or cpu
    snapshot: str | None = None  # where rank 0 saves the allocator's snapshot (CUDA)
    prediction: Record | None = None  # made ahead (its prediction and the time it took)
    launched_at: float | None = None  # the launcher's clock when it started the process
    budget_bytes: int | None = None  # more memory than this is out of memory (bench fit)
    history: str | None = None  # where rank 0 saves the allocator's history of the run (CUDA)

    def to_json(self) -> str:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["spec"] = self.spec.to_dict()
        if self.prediction is not None:  # as a record stores it
            values["prediction"] = self.prediction.to_flat()
        return json.dumps(values)

    @classmethod
    def from_json(cls, text: str) -> Job:
        values = json.loads(text)
        values["spec"] = RunSpec.from_dict(values["spec"])
        if values["prediction"] is not None:
            values["prediction"] = Record.from_flat(values["prediction"])
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class Suite:
    name: str
    path: Path
    model: str
    description: str
    baseline: str
    runs: tuple[RunSpec, ...]
    # after select(): every run's name as the file lists them (empty: runs are all)
    order: tuple[str, ...] = ()
    throughput: str = KEY.samples_per_s  # the record's figure that reports compare as throughput ×
    first_look: tuple[str, ...] = ()  # the runs a CPU measures unless --all (empty: every run)

    def position(self, run: str) -> int:
        """The run's 1-based place in the suite file: reports list runs in it, whichever were run
        last."""
        return (self.order or tuple(r.name for r in self.runs)).index(run) + 1
