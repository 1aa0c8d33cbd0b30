"""Real labelled data for the fidelity phase, held in memory as tensors: a fixed train / held-out
split.

Sources (the suite's ``[fidelity] dataset``):
- ``digits``: scikit-learn's 1,797 handwritten 8×8 digits, shipped with the package (works offline).
  Images are upsampled to the model's size with channels repeated; sequences are the 64 pixel
  intensities (0–16) as token ids between [CLS] and [SEP].
- ``digit-pixels``: the same digits as variable-length sequences, [CLS] then the positions of the
  non-zero pixels (17 to 43 tokens; bench.data.varlen), padded here to the longest.
- ``imagefolder:PATH``: ``torchvision.datasets.ImageFolder`` layout, with ``train/`` and ``test/``
  (or ``val/``) class folders as CIFAR-style exports have, or one set of class folders that is split
  here.
- ``hf:PATH``: a Hugging Face dataset saved with ``save_to_disk`` (``datasets`` package), with a
  label column (``label`` or ``labels``) and ``image``/``img`` for images or ``input_ids`` for
  sequences.
"""

from __future__ import annotations

import gzip
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from bench.data.synthetic import Batch

HELD_OUT = 0.2  # fraction held out when a source has no split of its own
# the split never changes with the run's seed: every run is evaluated on the same images
SPLIT_SEED = 0
PAD, CLS, SEP, FIRST_TOKEN = 0, 1, 2, 3  # digit intensity v is token FIRST_TOKEN + v
LABEL_TOKEN = FIRST_TOKEN + 17  # for a language model, class c is token LABEL_TOKEN + c


class DataError(ValueError):
    """A dataset that cannot be used, with what to fix."""


@dataclass(frozen=True)
class Labelled:
    inputs: torch.Tensor  # images (N, 3, S, S) float, or token ids (N, L) long
    labels: torch.Tensor  # (N,) long

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_classes(self) -> int:
        return int(self.labels.max()) + 1

    def batch(self, index: torch.Tensor, device: torch.device) -> Batch:
        x, y = self.inputs[index].to(device), self.labels[index].to(device)
        if x.dtype == torch.long:
            # token ids; every position is real (sequences are padded only by PAD)
            return {"input_ids": x, "attention_mask": (x != PAD).long()}, y
        return x, y


def with_label_token(data: Labelled) -> Labelled:
    """Sequences for a language model: the class as one more token right after each sequence's last
    token, before its padding, which it learns as that sequence's last next token and is scored on
    predicting (the labels stay the classes)."""
    ids = F.pad(data.inputs, (0, 1), value=PAD)
    ids[torch.arange(len(ids)), lengths(data.inputs)] = LABEL_TOKEN + data.labels
    return Labelled(ids, data.labels)


def lengths(ids: torch.Tensor) -> torch.Tensor:
    """Each sequence's length: the position after its last token that is not padding (padding
    trails)."""
    return ((ids != PAD) * torch.arange(1, ids.shape[1] + 1, device=ids.device)).amax(dim=1)


def load(source: str, kind: str, image_size: int) -> tuple[Labelled, Labelled]:
    """(train, held-out) from a source string; ``kind`` is the model's input kind, image or
    tokens."""
    name, _, path = source.partition(":")
    if name == "digits":
        return _split(*_digits(kind, image_size))
    if name == "digit-pixels":
        if kind != "tokens":
            raise DataError(
                f"dataset {source!r}: digit pixel sequences feed token models; this model takes "
                "images"
            )
        return _split(*_digit_pixels())
    if name == "imagefolder" and path:
        if kind != "image":
            raise DataError(
                f"dataset {source!r}: image folders feed image models; this model takes tokens"
            )
        return _imagefolder(Path(path), image_size)
    if name == "hf" and path:
        return _hf(Path(path), kind, image_size)
    raise DataError(f"dataset {source!r}: expected 'digits', 'imagefolder:PATH' or 'hf:PATH'")


def _split(inputs: torch.Tensor, labels: torch.Tensor) -> tuple[Labelled, Labelled]:
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    cut = len(labels) - int(len(labels) * HELD_OUT)
    return Labelled(inputs[order[:cut]], labels[order[:cut]]), Labelled(
        inputs[order[cut:]], labels[order[cut:]]
    )


def _digits(kind: str, image_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    pixels, labels = _digits_table()
    if kind == "tokens":
        ids = pixels.flatten(1).long() + FIRST_TOKEN
        n = len(ids)
        return torch.cat([torch.full((n, 1), CLS), ids, torch.full((n, 1), SEP)], dim=1), labels
    return _images(pixels.unsqueeze(1) / 16.0, image_size), labels


def _digits_table() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as ``load_digits`` reads them, (1797, 8, 8) intensities 0..16 and their
    labels, from the file the package ships: importing sklearn.datasets (scipy and all) took 1.5 s
    of every fidelity phase's process."""
    found = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if found is None or not found.submodule_search_locations:
        raise DataError("dataset 'digits': scikit-learn is not installed; pip install scikit-learn")
    table = Path(found.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(table, "rt") as rows:
        values = torch.tensor(
            [[int(v) for v in row.split(",")] for row in rows if row.strip()], dtype=torch.long
        )
    return values[:, :-1].reshape(-1, 8, 8).float(), values[:, -1]


def digit_samples() -> list[tuple[torch.Tensor, int]]:
    """Each digit as [CLS] and the positions of its non-zero pixels, row by row (pixel p is token
    FIRST_TOKEN + p; 17 to 43 tokens), labelled with its class: real variable-length sequences."""
    pixels, labels = _digits_table()
    return [
        (torch.cat([torch.tensor([CLS]), FIRST_TOKEN + row.nonzero().flatten()]), int(label))
        for row, label in zip(pixels.flatten(1), labels.tolist())
    ]


def _digit_pixels() -> tuple[torch.Tensor, torch.Tensor]:
    samples = digit_samples()
    ids = torch.nn.utils.rnn.pad_sequence(
        [seq for seq, _ in samples], batch_first=True, padding_value=PAD
    )
    return ids, torch.tensor([label for _, label in samples])


def _images(x: torch.Tensor, image_size: int) -> torch.Tensor:
    """(N, C, H, W) in [0, 1] → (N, 3, S, S), standardised to mean 0 and unit spread per channel."""
    x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    else:
        x = x[:, :3]
    return ((x - 0.5) / 0.5).contiguous()


def _imagefolder(root: Path, image_size: int) -> tuple[Labelled, Labelled]:
    if not root.is_dir():
        raise DataError(f"dataset imagefolder:{root}: no such folder")
    held = next((root / d for d in ("test", "val") if (root / d).is_dir()), None)
    if (root / "train").is_dir() and held is not None:
        train = _read_folder(root / "train", image_size)
        test = _read_folder(held, image_size, classes=train[2])
        return Labelled(*train[:2]), Labelled(*test[:2])
    inputs, labels, _ = _read_folder(root, image_size)
    return _split(inputs, labels)


def _read_folder(
    root: Path, image_size: int, classes: list[str] | None = None
) -> tuple[Any, Any, list[str]]:
    from torchvision import transforms
    from torchvision.datasets import ImageFolder

    tf = transforms.Compose([transforms.Resize((image_size, image_size)), transforms.ToTensor()])
    try:
        folder = ImageFolder(str(root), transform=tf)
    except (FileNotFoundError, RuntimeError) as exc:
        raise DataError(f"dataset imagefolder:{root}: {exc}") from None
    if classes is not None and folder.classes != classes:
        raise DataError(
            f"dataset imagefolder:{root}: classes {folder.classes} differ from train's {classes}"
        )
    images = torch.stack([folder[i][0] for i in range(len(folder))])
    return (
        _images(images, image_size),
        torch.as_tensor(folder.targets, dtype=torch.long),
        folder.classes,
    )


def _hf(root: Path, kind: str, image_size: int) -> tuple[Labelled, Labelled]:
    try:
        from datasets import Dataset, load_from_disk
    except ImportError:
        raise DataError(
            f"dataset hf:{root}: needs the datasets package (pip install -e '.[data]')"
        ) from None
    try:
        saved = load_from_disk(str(root))
    except FileNotFoundError as exc:
        raise DataError(f"dataset hf:{root}: {exc}") from None
    if isinstance(saved, Dataset):
        return _split(*_hf_tensors(saved, root, kind, image_size))
    held = next((s for s in ("test", "validation") if s in saved), None)
    if "train" not in saved or held is None:
        raise DataError(
            f"dataset hf:{root}: splits {list(saved)}; need 'train' and 'test' (or 'validation')"
        )
    train, test = (_hf_tensors(saved[s], root, kind, image_size) for s in ("train", held))
    if kind == "tokens":  # pad both splits to one length
        width = max(train[0].shape[1], test[0].shape[1])
        train, test = ((F.pad(x, (0, width - x.shape[1]), value=PAD), y) for x, y in (train, test))
    return Labelled(*train), Labelled(*test)


def _hf_tensors(
    ds: Any, root: Path, kind: str, image_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    label = next((c for c in ("label", "labels") if c in ds.column_names), None)
    column = next(
        (
            c
            for c in (("image", "img") if kind == "image" else ("input_ids",))
            if c in ds.column_names
        ),
        None,
    )
    if label is None or column is None:
        if kind == "image":
            want = "image (or img)"
        else:
            want = "input_ids"
        raise DataError(
            f"dataset hf:{root}: columns {ds.column_names}; need {want} and label (or labels)"
        )
    labels = torch.as_tensor(ds[label], dtype=torch.long)
    if kind == "tokens":
        rows = ds[column]
        width = max(len(r) for r in rows)
        return torch.tensor(
            [list(r) + [PAD] * (width - len(r)) for r in rows], dtype=torch.long
        ), labels
    from torchvision.transforms.functional import pil_to_tensor

    images = [pil_to_tensor(im.convert("RGB")).float() / 255 for im in ds[column]]
    resized = torch.stack(
        [
            F.interpolate(im[None], size=(image_size, image_size), mode="bilinear")[0]
            for im in images
        ]
    )
    return _images(resized, image_size), labels
