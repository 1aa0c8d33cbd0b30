"""What advice is asked about: a model (built-in or ``module:NAME``) or a suite file, as the header
of a suite (model, mode, shapes, steps, fidelity) that the advice suite file is written from and the
plans are runs of."""

from __future__ import annotations

import json
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.errors import BadInput
from bench.models import MODELS, ModelSpec
from bench.models import resolve as resolve_model
from bench.spec import RunSpec, Suite
from bench.suite import load
from bench.suite.toml_text import to_toml
from bench.techniques import resolve

HEADER_KEYS = (
    "model",
    "mode",
    "seed",
    "lr",
    "warmup_steps",
    "measure_steps",
    "timeout_s",
    "weights",
    "shapes",
    "fidelity",
)
# Shapes for a model no shipped suite measures: the ViT and BERT studies' GPU shapes, a few seconds
# a step on a CPU.
DEFAULT_SHAPES = {
    "image": {
        "gpu": {"batch_size": 32, "image_size": 224},
        "cpu": {"batch_size": 8, "image_size": 64},
    },
    "tokens": {"gpu": {"batch_size": 8, "seq_len": 512}, "cpu": {"batch_size": 8, "seq_len": 64}},
}


@dataclass(frozen=True, kw_only=True)
class Source:
    header: dict[str, Any]  # the suite's top-level keys and tables, as TOML values
    origin: str  # where the shapes came from, for the table's caption
    model: ModelSpec
    template: RunSpec  # the baseline run: no techniques
    # the user's own techniques (module:Class) the suite's runs name that declare an axis
    own: tuple[str, ...] = ()

    @property
    def mode(self) -> str:
        return self.header.get("mode", "train")


def source(
    name: str, mode: str | None, batch: int | None, device_type: str, suites: Path = Path("suites")
) -> Source:
    """The header for ``name``: a suite file's own (a path, or a suite's name where no model has it:
    ``resnet``), or a model's shipped suite's (of ``mode``), or defaults."""
    path = Path(name)
    if (
        not (path.suffix == ".toml" or path.is_file())
        and name not in MODELS
        and (suites / f"{name}.toml").is_file()
    ):
        path = suites / f"{name}.toml"
    if path.suffix == ".toml" or path.is_file():
        raw, origin = _read(path), str(path)
        if mode and raw.get("mode", "train") != mode:
            if mode == "train":
                flag = "--train"
            else:
                flag = "--infer"
            raise BadInput(
                f"{path} is a {raw.get('mode', 'train')} suite; leave out {flag}, or name its "
                "model instead"
            )
    else:
        try:
            spec = resolve_model(name)
        except (KeyError, ImportError) as exc:
            raise BadInput(
                f"{exc.args[0] if exc.args else exc}; or module:NAME for your own ModelSpec, or a "
                "suite file (suites/NAME.toml)"
            ) from None
        raw, origin = _shipped(name, mode or "train", suites) or _defaults(
            name, spec, mode or "train"
        )
    header = {k: raw[k] for k in HEADER_KEYS if k in raw}
    if batch is not None:
        header["shapes"][device_type_key(device_type)]["batch_size"] = batch
    model = resolve_model(header["model"])
    return Source(
        header=header, origin=origin, model=model, template=template(header), own=_own(raw)
    )


def _own(raw: dict[str, Any]) -> tuple[str, ...]:
    """The user's own techniques that a suite's runs name and that declare an axis of advice's
    catalogue, in the order they are first named: advised beside the built-in ones."""
    named = [
        t if isinstance(t, str) else t.get("name", "")
        for run in raw.get("runs", [])
        for t in run.get("techniques", [])
    ]
    return tuple(n for n in dict.fromkeys(named) if ":" in n and resolve(n).axis)


def device_type_key(device_type: str) -> str:
    if device_type == "cuda":
        return "gpu"
    return "cpu"


def template(header: dict[str, Any]) -> RunSpec:
    """The baseline run of a suite with this header (loaded as a file is, so that every check
    applies)."""
    return loaded(header, [{"name": "baseline", "techniques": []}]).runs[0]


def loaded(header: dict[str, Any], runs: list[dict[str, Any]], name: str = "advice") -> Suite:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{name}.toml"
        path.write_text(to_toml(header | {"baseline": "baseline"}, runs))
        return load(path)


def _read(path: Path) -> dict[str, Any]:
    load(path)  # every problem of the file reported as the loader reports it (exit 2)
    return tomllib.loads(path.read_text())


def _shipped(model: str, mode: str, suites: Path) -> tuple[dict[str, Any], str] | None:
    """The first shipped suite measuring ``model`` in ``mode`` on one process, with its shapes."""
    for path in sorted(suites.glob("*.toml")):
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError):
            continue
        written = path.stem.startswith("advice-")  # advice's own output is no source of shapes
        if (
            raw.get("model") == model
            and raw.get("mode", "train") == mode
            and "matrix" not in raw
            and not written
        ):
            return raw, str(path)
    return None


def _defaults(name: str, spec: ModelSpec, mode: str) -> tuple[dict[str, Any], str]:
    shapes = json.loads(json.dumps(DEFAULT_SHAPES[spec.inputs]))  # a copy the batch can be set in
    return {"model": name, "mode": mode, "shapes": shapes}, f"default {spec.inputs} shapes"
