"""Pretrained weights from a local path, loaded into a freshly built model before any technique
applies.

Accepted: a state_dict file saved with ``torch.save`` (.pt, .pth, .bin) or safetensors, a checkpoint
dict holding one under ``"state_dict"`` or ``"model"``, or a folder written by transformers'
``save_pretrained`` (its ``*.safetensors``, else ``pytorch_model*.bin``). Tensors are matched by
name and shape. A prefix the file and the model disagree on (DDP's ``module.``, a bare ``BertModel``
under ``bert.``) is found by trying each. Tensors without a match keep their random initialisation
(typically a classification head of another size) and are counted in the record, so a partly loaded
model is never mistaken for a fully loaded one.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.record import Provenance

Tensors = dict[str, torch.Tensor]
SHOWN = 5  # names of unmatched tensors kept in the record


class WeightsError(Exception):
    """A weights path that cannot be read, or that holds nothing this model can use."""


def load_weights(model: nn.Module, path: str) -> Provenance:
    """Copy the matching tensors of ``path`` into ``model``; what was loaded and what was not, for
    the record."""
    state = _read(_files(Path(path)))
    own = model.state_dict()
    mapping = max(_alignments(state, own), key=len)
    if not mapping:
        raise WeightsError(
            f"weights {path}: none of its {len(state)} tensors matches a name and shape of the "
            f"model (e.g. {next(iter(own), '?')!r}); is it a checkpoint of this model?"
        )
    model.load_state_dict({mine: state[theirs] for theirs, mine in mapping.items()}, strict=False)
    mapped = set(mapping.values())
    missing = [n for n in own if n not in mapped]
    unused = [n for n in state if n not in mapping]
    if missing:
        # in the run's log as well as its record: a partly loaded model should never go unnoticed
        print(
            f"weights {path}: {len(mapping)} tensors loaded; {len(missing)} keep their "
            f"initialisation ({', '.join(missing[:SHOWN])}{', …' if len(missing) > SHOWN else ''})",
            file=sys.stderr,
        )
    return Provenance(
        weights=path,
        weights_loaded=len(mapping),
        weights_missing=len(missing),
        weights_missing_names=missing[:SHOWN],
        weights_unused=len(unused),
        weights_unused_names=unused[:SHOWN],
    )


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    found = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not found:
        raise WeightsError(
            f"weights {path}: not a file, nor a folder with *.safetensors or pytorch_model*.bin"
        )
    return found


def _read(files: list[Path]) -> Tensors:
    state: Tensors = {}
    for f in files:  # shards of one checkpoint
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file  # installed with transformers

            part: Any = load_file(f)
        else:
            try:
                part = torch.load(f, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001  pickle, zip and the weights_only check all fail differently
                raise WeightsError(
                    f"weights {f}: cannot be read as a state_dict ({type(exc).__name__}: {exc})"
                ) from exc
        for key in ("state_dict", "model"):  # a training checkpoint wrapping the model's state
            if isinstance(part, dict) and isinstance(part.get(key), dict):
                part = part[key]
        state |= {k: v for k, v in part.items() if isinstance(v, torch.Tensor)}
    return state


def _alignments(state: Tensors, own: Tensors) -> list[dict[str, str]]:
    """The file's tensors that match the model's by name and shape: as named, then with each leading
    name of the file's stripped, then with each of the model's added. Never both: swapping one
    leading name for another would match unrelated tensors of equal shape (one head's bias for
    another's)."""

    def leading(keys: Tensors) -> list[str]:
        return sorted({k.split(".", 1)[0] + "." for k in keys if "." in k})

    renamings = [("", "")] + [(s, "") for s in leading(state)] + [("", a) for a in leading(own)]
    out = []
    for strip, add in renamings:  # as named first: max() keeps the first of equals
        names = {k: add + k.removeprefix(strip) for k in state if k.startswith(strip)}
        out.append({k: m for k, m in names.items() if m in own and own[m].shape == state[k].shape})
    return out


def digest(path: str) -> str:
    """The first 16 hex digits of the SHA-256 over the files the weights are read from, for
    provenance."""
    h = hashlib.sha256()
    for f in _files(Path(path)):
        with f.open("rb") as stream:
            while chunk := stream.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:16]
