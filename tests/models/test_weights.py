"""Pretrained weights from local fixtures: every format the loader accepts, and what it records."""

import hashlib

import pytest
import torch

from bench.launch import Device
from bench.models import MODELS, build_model
from bench.models.weights import WeightsError, digest
from bench.suite import Shapes
from tests.helpers import isolated, spec

IMAGE, TOKENS = Shapes(batch_size=2, image_size=32), Shapes(batch_size=2, seq_len=16)


def built(name: str, seed: int, shapes: Shapes = IMAGE) -> torch.nn.Module:
    torch.manual_seed(seed)
    return MODELS.get(name).build(shapes)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names: list[str]) -> bool:
    return all(torch.equal(a[n], b[n]) for n in names)


def test_a_state_dict_file_replaces_every_tensor_and_is_recorded_with_its_digest(tmp_path):
    source = built("resnet-tiny", seed=1).state_dict()
    path = tmp_path / "resnet-tiny.pt"
    torch.save(source, path)
    torch.manual_seed(0)
    model, record = build_model(MODELS.get("resnet-tiny"), IMAGE, str(path))
    # buffers too: BatchNorm's running statistics
    assert same(model.state_dict(), source, list(source))
    assert (
        record.weights_loaded == len(source)
        and record.weights_missing == record.weights_unused == 0
    )
    assert digest(str(path)) == hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def test_a_save_pretrained_folder_of_the_bare_encoder_loads_under_its_prefix(tmp_path):
    # A BertModel's names lack BertForSequenceClassification's "bert." prefix; the head stays as
    # initialised.
    encoder = built("bert-tiny", seed=1, shapes=TOKENS).bert
    encoder.save_pretrained(tmp_path / "encoder")  # model.safetensors
    torch.manual_seed(0)
    model, record = build_model(MODELS.get("bert-tiny"), TOKENS, str(tmp_path / "encoder"))
    theirs = {f"bert.{k}": v for k, v in encoder.state_dict().items()}
    assert same(model.state_dict(), theirs, list(theirs))
    assert record.weights_missing_names == ["classifier.weight", "classifier.bias"]
    assert record.weights_unused == 0


def test_a_training_checkpoint_from_ddp_loads_and_a_head_of_another_size_is_left_out(tmp_path):
    source = built("resnet-tiny", seed=1).state_dict()
    source["fc.weight"], source["fc.bias"] = (
        torch.zeros(5, source["fc.weight"].shape[1]),
        torch.zeros(5),
    )
    path = tmp_path / "checkpoint.pth"
    torch.save({"model": {f"module.{k}": v for k, v in source.items()}, "epoch": 3}, path)
    model, record = build_model(MODELS.get("resnet-tiny"), IMAGE, str(path))
    body = [n for n in source if not n.startswith("fc.")]
    assert same(model.state_dict(), source, body)
    assert model.fc.weight.shape == (10, source["fc.weight"].shape[1])
    assert record.weights_missing_names == ["fc.weight", "fc.bias"]
    assert record.weights_unused_names == ["module.fc.weight", "module.fc.bias"]


def test_weights_of_another_model_are_refused_naming_the_file(tmp_path):
    path = tmp_path / "bert.pt"
    torch.save(built("bert-tiny", seed=0, shapes=TOKENS).state_dict(), path)
    with pytest.raises(WeightsError, match=f"weights {path}: none of its .* tensors matches"):
        build_model(MODELS.get("resnet-tiny"), IMAGE, str(path))


@pytest.mark.parametrize("content", [b"not a checkpoint", None])
def test_an_unreadable_path_says_what_was_expected(tmp_path, content):
    path = tmp_path / ("junk.pt" if content else "empty-folder")
    path.write_bytes(content) if content else path.mkdir()
    with pytest.raises(WeightsError, match="cannot be read as a state_dict|nor a folder with"):
        build_model(MODELS.get("resnet-tiny"), IMAGE, str(path))


def test_a_run_records_the_weights_it_measured(tmp_path):
    path = tmp_path / "resnet-tiny.pt"
    torch.save(built("resnet-tiny", seed=1).state_dict(), path)
    run = spec("resnet-tiny", weights=str(path))
    record = isolated(run, Device("cpu", "cpu"))
    assert record["status"] == "ok", record
    assert record["weights"] == str(path) and record["weights_loaded"] == len(torch.load(path))
    assert record["weights_sha256"] == digest(str(path))
    # other weights, another run: never resumed as one
    assert run.key("cpu") != spec("resnet-tiny").key("cpu")
