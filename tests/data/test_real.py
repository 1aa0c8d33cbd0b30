import pytest
import torch
from PIL import Image

from bench.data import real


def test_digits_as_images_keep_a_fixed_split_and_the_model_size():
    train, test = real.load("digits", "image", 32)
    again, _ = real.load("digits", "image", 32)
    assert (len(train), len(test)) == (1438, 359) and train.num_classes == 10
    assert train.inputs.shape == (1438, 3, 32, 32) and torch.equal(train.labels, again.labels)
    assert -1.0 <= train.inputs.min() < train.inputs.max() <= 1.0


def test_digits_are_scikit_learns_as_load_digits_reads_them_without_importing_it():
    from sklearn.datasets import load_digits

    pixels, labels = real._digits_table()
    digits = load_digits()
    assert torch.equal(pixels, torch.as_tensor(digits.images, dtype=torch.float32))
    assert torch.equal(labels, torch.as_tensor(digits.target, dtype=torch.long))


def test_digits_as_tokens_are_intensities_between_cls_and_sep():
    train, _ = real.load("digits", "tokens", 32)
    assert train.inputs.shape == (1438, 66) and train.inputs.dtype == torch.long
    assert (train.inputs[:, 0] == real.CLS).all() and (train.inputs[:, -1] == real.SEP).all()
    body = train.inputs[:, 1:-1]
    assert body.min() >= real.FIRST_TOKEN and body.max() <= real.FIRST_TOKEN + 16
    inputs, _ = train.batch(torch.arange(4), torch.device("cpu"))
    assert inputs["attention_mask"].all()


def write_images(folder, classes=("cat", "dog"), per_class=3):
    for i, name in enumerate(classes):
        (folder / name).mkdir(parents=True)
        for j in range(per_class):
            Image.new("RGB", (10, 12), color=(40 * i + j, 0, 200)).save(folder / name / f"{j}.png")


def test_image_folder_with_train_and_test_splits(tmp_path):
    write_images(tmp_path / "train")
    write_images(tmp_path / "test", per_class=2)
    train, test = real.load(f"imagefolder:{tmp_path}", "image", 16)
    assert train.inputs.shape == (6, 3, 16, 16) and len(test) == 4
    assert train.labels.tolist() == [0, 0, 0, 1, 1, 1]


def test_image_folder_without_splits_is_split_here(tmp_path):
    write_images(tmp_path, per_class=5)
    train, test = real.load(f"imagefolder:{tmp_path}", "image", 8)
    assert (len(train), len(test)) == (8, 2)


def test_saved_hugging_face_datasets_images_and_token_ids(tmp_path):
    datasets = pytest.importorskip("datasets")
    images = [Image.new("RGB", (8, 8), color=(i * 20, 0, 0)) for i in range(6)]
    image_ds = datasets.Dataset.from_dict({"image": images, "label": [0, 1, 0, 1, 0, 1]})
    datasets.DatasetDict({"train": image_ds, "test": image_ds.select(range(2))}).save_to_disk(
        tmp_path / "img"
    )
    train, test = real.load(f"hf:{tmp_path / 'img'}", "image", 16)
    assert train.inputs.shape == (6, 3, 16, 16) and len(test) == 2
    tokens = datasets.Dataset.from_dict(
        {"input_ids": [[1, 5, 6], [1, 7], [1, 8, 9, 4]] * 2, "labels": [0, 1, 2] * 2}
    )
    tokens.save_to_disk(tmp_path / "tok")
    train, test = real.load(f"hf:{tmp_path / 'tok'}", "tokens", 16)
    assert train.inputs.shape[1] == 4 and len(train) + len(test) == 6
    with pytest.raises(real.DataError, match="need input_ids and label"):
        real.load(f"hf:{tmp_path / 'img'}", "tokens", 16)


@pytest.mark.parametrize(
    "source, message",
    [
        ("mnist", "expected 'digits', 'imagefolder:PATH' or 'hf:PATH'"),
        ("imagefolder:/nonexistent", "no such folder"),
    ],
)
def test_unusable_sources_say_what_to_fix(source, message):
    with pytest.raises(real.DataError, match=message):
        real.load(source, "image", 8)
