"""The catalogue on axes: which options a model gets, how many plans they make, and the loader's own
verdict on each combination."""

from bench.advise.plans import Plan, axes, combinations, problems
from bench.advise.source import source
from bench.models import resolve


def names(found):
    return {a.name: [o.name for o in a.options] for a in found}


def test_a_vision_model_gets_no_loss_axis_and_accumulation_only_where_it_divides_the_batch():
    found = names(axes(resolve("resnet-tiny"), "train", 1, batch=12))
    assert "loss" not in found and "sharding" not in found
    assert found["accumulation"] == ["accumulate-2", "accumulate-4"]  # 8 does not divide 12
    assert found["activations"] == [
        "activation-offload",
        "checkpoint-every-2",
        "checkpoint",
        "offload",
        # by technique name, each one's offers in its order
        "selective-checkpoint",
    ]


def test_a_language_model_gets_chunked_loss_and_processes_get_a_required_sharding_axis():
    found = axes(resolve("llama-tiny"), "train", 4, batch=8)
    assert names(found)["loss"] == ["chunked-loss"]
    sharding = next(a for a in found if a.name == "sharding")
    assert sharding.required and None not in sharding.choices
    plans = list(combinations(found))
    # every axis's options and none, but sharding always one of its four
    expected = 4
    for a in found:
        expected *= len(a.choices) if not a.required else 1
    assert len(plans) == expected and all(
        any(o.technique.name in ("ddp", "fsdp") for o in p.options) for p in plans
    )


def test_inference_has_its_own_axes():
    assert names(axes(resolve("bert-tiny"), "inference", 1, batch=8)) == {
        "precision": ["amp-bf16", "half-fp16", "half-bf16"],
        "quantization": ["dynamic-int8"],
        "autograd": ["inference-mode"],
    }


def test_the_loader_says_which_combinations_cannot_run(tmp_path):
    template = source("resnet-tiny", "train", None, "cpu").template
    found = {o.name: o for a in axes(resolve("resnet-tiny"), "train", 1, 8) for o in a.options}
    ok = Plan((found["amp-bf16"], found["checkpoint"], found["accumulate-2"]))
    assert problems(ok, template) == []
    clash = Plan((found["optimizer-in-backward"], found["accumulate-2"]))
    assert any("cannot be combined" in p for p in problems(clash, template))
    assert ok.name == "amp-bf16+checkpoint+accumulate-2"
    assert ok.spec(template).techniques[0].label == "amp(dtype=bfloat16)"


def test_a_suites_name_is_taken_where_a_model_is_asked_for():
    # make advise MODEL=resnet was refused where make bench SUITE=resnet worked
    from bench.advise import source

    src = source("resnet", None, None, "cuda")
    assert src.origin == "suites/resnet.toml" and src.template.model == "resnet50"
    # a model's name stays a model's
    assert source("resnet50", None, None, "cuda").template.model == "resnet50"
