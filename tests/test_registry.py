import pytest

from bench.models import MODELS
from bench.registry import Registry
from bench.techniques import TECHNIQUES, Technique, resolve


def test_duplicate_names_are_an_error_that_names_the_first_owner():
    reg: Registry[int] = Registry("thing")
    reg.register("a")(1)
    with pytest.raises(KeyError, match="thing 'a' is already registered"):
        reg.register("a")(2)


def test_unknown_name_lists_the_known_ones():
    known = "known: accumulate, activation-offload, adamw-4bit, adamw-8bit, adamw-bnb, ademamix"
    with pytest.raises(KeyError, match=f"unknown technique 'nope'; {known}"):
        TECHNIQUES.get("nope")


def test_shipped_registries():
    assert {"resnet50", "bert-base", "vit-b16", "resnet-tiny", "bert-tiny", "vit-tiny"} <= set(
        MODELS
    )
    for name in TECHNIQUES:
        cls = TECHNIQUES.get(name)
        assert cls.name == name and cls.summary and cls.__doc__, name


def test_import_path_must_name_a_technique_class():
    assert issubclass(resolve("tests.helpers:SGD"), Technique)
    with pytest.raises(KeyError, match="is not a subclass"):
        resolve("tests.helpers:spec")
