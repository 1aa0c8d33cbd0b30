import importlib.util

import pytest
import torch

from bench.recipe import Recipe
from bench.techniques import build
from bench.techniques.generation import KVCache
from tests.conftest import CPU
from tests.helpers import generation, tech


def reason(*techniques, **shapes) -> str | None:
    return Recipe.of(generation(techniques, **shapes), CPU).unsupported()


def test_each_cache_kind_is_the_cache_implementation_generate_takes():
    for kind, named in [("static", "static"), ("offloaded-static", "offloaded_static")]:
        assert build(tech("kv-cache", kind=kind)).step().generation == (
            ("cache_implementation", named),
        )
    quantized = dict(
        build(tech("kv-cache", kind="quantized", nbits=2, residual_length=64)).step().generation
    )
    assert quantized == {
        "cache_implementation": "quantized",
        "cache_config": {
            "backend": "quanto",
            "nbits": 2,
            "residual_length": 64,
            "q_group_size": 64,
        },
    }
    fp8 = dict(build(tech("kv-cache", kind="quantized", backend="fp8")).step().generation)
    # per-tensor: the group-wise options are refused there
    assert fp8["cache_config"] == {"backend": "fp8"}


def test_a_cache_that_cannot_be_kept_here_or_predicted_says_why(monkeypatch):
    assert reason(tech("kv-cache", kind="offloaded")).startswith(
        "kv-cache: offloading moves the cache"
    )
    real_find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "optimum" else real_find(n, *a)
    )
    assert reason(tech("kv-cache", kind="quantized")) == (
        "kv-cache: needs optimum-quanto for the quanto backend: pip install optimum-quanto"
    )
    assert KVCache(KVCache.Config(kind="offloaded")).unpredictable.startswith(
        "fake tensors cannot stand"
    )
    assert KVCache(KVCache.Config(kind="quantized")).unpredictable.startswith(
        "quanto's quantizer reads"
    )
    assert KVCache(KVCache.Config(kind="quantized", backend="fp8")).unpredictable == ""
    assert KVCache(KVCache.Config(kind="static")).unpredictable == ""


def test_a_chunk_that_holds_the_whole_prompt_would_measure_the_baseline_and_is_refused():
    assert reason(tech("chunked-prefill", chunk=32), prompt_len=32) == (
        "chunked-prefill: chunk = 32 holds the whole prompt of 32 tokens: the run would measure "
        "the baseline under its name"
    )
    assert reason(tech("chunked-prefill", chunk=31), prompt_len=32) is None
    assert build(tech("chunked-prefill", chunk=0)).problems(8) == [
        "chunked-prefill: chunk must be at least 1, got 0"
    ]


def test_generation_techniques_apply_to_generation_alone_and_weight_precision_to_it_too():
    for name in ("kv-cache", "chunked-prefill"):
        assert build(tech(name)).modes == {"generate"}
    for name in ("half", "inference-mode", "int8-weights", "amp", "sdpa"):
        assert "generate" in build(tech(name)).modes, name
    assert torch.bfloat16 == build(tech("half", dtype="bfloat16")).dtype


def test_int4_weights_say_where_they_run_and_that_fake_tensors_cannot_pack_them():
    assert reason(tech("half", dtype="bfloat16"), tech("int4-weights")) == (
        "int4-weights: torchao's int4 weights run on CUDA here (tinygemm); its CPU layouts need "
        "the mslk package"
    )
    assert build(tech("int4-weights")).unpredictable.startswith("tinygemm packs the weights")
    assert build(tech("int4-weights", group_size=100)).problems(8) == [
        "int4-weights: group_size must be one of 32, 64, 128, 256"
    ]


@pytest.mark.cuda
def test_int4_weights_store_a_generations_linear_layers_in_4_bits_on_a_card():
    pytest.importorskip("torchao")
    from bench.launch import detect
    from tests.helpers import isolated

    half = (tech("half", dtype="bfloat16"),)
    plain = isolated(generation(half), detect("cuda"))
    int4 = isolated(generation((*half, tech("int4-weights", group_size=32))), detect("cuda"))
    assert plain["status"] == int4["status"] == "ok", int4
    assert int4["proof"]["int4-weights.quantized_linears"] > 0
    assert int4["param_bytes"] < plain["param_bytes"]
