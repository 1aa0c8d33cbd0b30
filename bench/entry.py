"""``bench.entry.predict_step``: a training step of your own model predicted from Python, with no
suite file to write: the ModelSpec, a sample batch (or its sizes), the techniques as a suite names
them (the optimizer among them), and a card for the verdict. It is the suite a user would write,
loaded and checked as ``bench predict`` loads it, so the Prediction is the one the CLI makes of the
same job, to the byte (docs/examples/python/)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.errors import BadInput
from bench.models import ModelSpec
from bench.record import Prediction
from bench.registry import GIVEN, GIVEN_PREFIX

# each kind of input's size key in a suite, and the dimensions of a batch of it
SIZES = {"image": ("image_size", 4), "tokens": ("seq_len", 2)}


def predict_step(
    model: ModelSpec,
    batch: Sequence[torch.Tensor] | None = None,
    *,
    batch_size: int | None = None,
    image_size: int | None = None,
    seq_len: int | None = None,
    techniques: Sequence[str | dict[str, Any]] = (),
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
    card: str | None = None,
) -> Prediction:
    """The training step of ``model`` at the sizes of ``batch`` (its inputs first: images of
    (batch, 3, size, size), or token ids of (batch, seq_len)) or those given, on fake tensors, with
    ``techniques`` (names, or tables of a name and options, as a suite's entry lists them) and
    ``optimizer``, a function of the trainable parameters returning yours (optimizer-from); on
    ``card`` (rtx4090, a100-80gb, h100, …) replayed through its caching allocator, the verdict
    read as ``prediction.verdict``. BadInput where the sizes or techniques are not a job."""
    from bench.predict import predict
    from bench.predict.cards import card as card_named
    from bench.suite import load

    shapes = _shapes(model, batch, batch_size=batch_size, image_size=image_size, seq_len=seq_len)
    name = GIVEN_PREFIX + model.name
    GIVEN[name] = model
    techniques = list(techniques)
    if optimizer is not None:
        GIVEN[GIVEN_PREFIX + optimizer.__name__] = optimizer
        techniques.append({"name": "optimizer-from", "factory": GIVEN_PREFIX + optimizer.__name__})
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "python.toml"
        path.write_text(suite_text(name, shapes, techniques), encoding="utf-8")
        run = load(path).runs[-1]
    try:
        chosen = card_named(card) if card else None
    except ValueError as exc:
        raise BadInput(str(exc).replace("--card", "card")) from None
    return predict(run, card=chosen)


def suite_text(model: str, shapes: dict[str, int], techniques: Sequence[str | dict]) -> str:
    """The suite of one job: ``model`` trained at ``shapes`` with ``techniques`` (the CPU's shapes
    the same, as nothing here runs)."""
    from bench.suite.toml_text import to_toml

    header = {"model": model, "baseline": "job", "shapes": {"gpu": shapes, "cpu": shapes}}
    return to_toml(header, [{"name": "job", "techniques": list(techniques)}])


def _shapes(
    model: ModelSpec,
    batch: Sequence[torch.Tensor] | None,
    *,
    batch_size: int | None,
    image_size: int | None,
    seq_len: int | None,
) -> dict[str, int]:
    """The suite's GPU shapes, read off the sample batch's inputs where one is given."""
    key, dims = SIZES[model.inputs]
    size = {"image": image_size, "tokens": seq_len}[model.inputs]
    if batch is not None:
        inputs = batch[0]
        if inputs.dim() != dims or (dims == 4 and inputs.shape[-1] != inputs.shape[-2]):
            raise BadInput(
                f"batch: model {model.name} takes {model.inputs} of (batch, 3, size, size) or "
                f"(batch, seq_len); its inputs are {tuple(inputs.shape)}"
            )
        batch_size, size = inputs.shape[0], inputs.shape[-1]
    if not batch_size or not size:
        raise BadInput(f"give a sample batch, or batch_size and {key}")
    return {"batch_size": int(batch_size), key: int(size)}
