"""Generation with transformers' own generate(): the tokens it makes, the forwards it takes, the
cache it keeps as the textbook counts it, and what a run of it records."""

import math
from dataclasses import replace

import pytest
import torch

from bench import results
from bench.data.synthetic import clone_batch
from bench.launch import Device
from bench.recipe import Recipe
from tests.conftest import CPU, build_trainer
from tests.helpers import generation, isolated, tech

BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def textbook(generator, run, element_bytes: int) -> int:
    """2 (keys and values) × layers × key-value heads × head dim × tokens × batch × bytes per
    element; the tokens are those fed to the model: the prompt and every new token but the last."""
    config = generator.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    tokens = run.cpu.prompt_len + run.cpu.new_tokens - 1
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    return 2 * layers * heads * head_dim * tokens * run.cpu.batch_size * element_bytes


def generate(run):
    generator, batch = build_trainer(run)
    sequences = generator.step(clone_batch(batch))
    return generator, sequences


def test_a_generation_makes_its_new_tokens_one_forward_each_after_the_prompts_prefill():
    run = generation(batch_size=3, prompt_len=24, new_tokens=5)
    generator, sequences = generate(run)
    assert sequences.shape == (3, 24 + 5)
    assert generator.proof() == {
        "new_tokens": 5,
        "prefill_forwards": 1,
        "decode_forwards": 4,
        "cache": "DynamicCache",
    }


@pytest.mark.parametrize(
    "techniques, element, extra",
    [
        ((), torch.float32, 0),
        ((tech("half", dtype="bfloat16"),), torch.bfloat16, 0),
        # a static cache counts the tokens it holds: an int64 per layer
        ((tech("kv-cache", kind="static"),), torch.float32, 8),
    ],
    ids=["dynamic", "dynamic-bf16", "static"],
)
def test_the_cache_holds_every_fed_token_as_the_textbook_counts_it(techniques, element, extra):
    run = generation(techniques)
    generator, _ = generate(run)
    layers = generator.model.config.num_hidden_layers
    assert generator.cache_bytes == textbook(generator, run, BYTES[element]) + extra * layers


def test_an_fp8_cache_holds_a_byte_an_element_and_float32_scales_for_keys_and_values_per_layer():
    run = generation(
        (tech("half", dtype="bfloat16"), tech("kv-cache", kind="quantized", backend="fp8"))
    )
    if reason := Recipe.of(run, CPU).unsupported():  # a transformers before 5.23
        pytest.skip(reason)
    generator, _ = generate(run)
    layers = generator.model.config.num_hidden_layers
    assert generator.cache_class == "QuantizedCache"
    assert generator.cache_bytes == textbook(generator, run, 1) + 2 * 4 * layers


def test_a_prompt_prefilled_in_chunks_takes_a_forward_per_chunk_and_holds_the_same_cache():
    whole, _ = generate(generation(prompt_len=20))
    chunked, sequences = generate(generation((tech("chunked-prefill", chunk=8),), prompt_len=20))
    assert chunked.forwards == {"prefill": math.ceil(20 / 8), "decode": 3}
    assert chunked.cache_bytes == whole.cache_bytes and sequences.shape[1] == 24


def test_a_generation_records_each_phases_peak_its_time_to_first_token_and_decoding_rate():
    run = generation(new_tokens=6)
    record = isolated(run, Device("cpu", "cpu"))
    assert record["status"] == "ok", record
    said = results.base_record(run, "cpu", "cpu", "key", "revision").identity
    assert (said.prompt_len, said.new_tokens, said.seq_len) == (32, 6, 38)
    assert record["peak_tensor_bytes"] == max(
        record["peak_prefill_bytes"], record["peak_decode_bytes"]
    )
    assert record["kv_cache_bytes"] > 0 and "activation_bytes" not in record
    assert 0 < record["ttft_ms_p25"] <= record["ttft_ms_median"] <= record["ttft_ms_p75"]
    assert 0 < record["decode_tokens_per_s_p25"] <= record["decode_tokens_per_s"]
    assert (
        record["decode_tokens_per_s"] <= record["decode_tokens_per_s_p75"]
        and record["tokens_per_s"] > 0
    )
    assert record["proof"]["decode_forwards"] == 5
    # what the prediction made ahead says of the same phases, to the byte on a CPU
    assert record["predicted_peak_decode_bytes"] == record["peak_decode_bytes"]


def test_a_sliding_window_cache_holds_the_window_not_the_whole_context():
    """Mistral's sliding window, as its config has it (32 tokens): every forward leaves the window's
    last 31 tokens in the cache, where a full context would be 63. Its bytes at their largest are
    the prefill's: the 31 are a view of the prompt's 48 tokens of states, whose storage stays until
    decoding concatenates."""
    run = replace(generation(prompt_len=48, new_tokens=16), model="hf:suites/configs/tiny-mistral")
    generator, batch = build_trainer(run)
    held = []
    generator.model.register_forward_hook(lambda *_: held.append(generator.cache()[0].shape[-2]))
    generator.step(clone_batch(batch))
    assert held == [31] * 16
    config, windows = generator.model.config, 8 * 2  # each layer's window, an int64 tensor
    assert (
        generator.cache_bytes
        == 2 * 2 * config.num_key_value_heads * config.head_dim * 48 * 2 * 4 + windows
    )


@pytest.mark.cuda
def test_on_a_card_a_generation_is_predicted_by_phase_and_an_offloaded_cache_keeps_less_there():
    """Timed by CUDA events in the generator's hooks (no synchronisation inside the step); the
    phases' tracked peaks against their prediction made ahead; the offloaded cache's layers mostly
    on the host."""
    from bench.launch import detect

    gpu, shapes = detect("cuda"), {"batch_size": 4, "prompt_len": 256, "new_tokens": 8}
    plain = isolated(generation(**shapes), gpu)
    offloaded = isolated(generation((tech("kv-cache", kind="offloaded"),), **shapes), gpu)
    assert plain["status"] == offloaded["status"] == "ok", (plain, offloaded)
    assert offloaded["kv_cache_bytes"] < plain["kv_cache_bytes"]
    assert plain["ttft_ms_median"] > 0 and plain["proof"]["decode_forwards"] == 7
    for phase in ("prefill", "decode"):
        predicted, tracked = plain[f"predicted_peak_{phase}_bytes"], plain[f"peak_{phase}_bytes"]
        assert predicted == pytest.approx(tracked, rel=0.02), phase
