"""One rank of a multi-process run predicted in this process, under torch's fake process group: the
bytes its collectives move, held against the textbook volumes, and ZeRO-3's model states per rank at
any world size. (That each rank's prediction is its measured peak under gloo is
tests/test_process_group.py's.)"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from bench.models import MODELS
from bench.predict.fake import predict
from bench.predict.ranks import fake_group
from bench.spec import Shapes, TechniqueSpec
from bench.techniques import build
from tests.helpers import spec, tech

PSI = sum(
    p.numel() for p in MODELS.get("bert-tiny").build(Shapes(batch_size=8, seq_len=64)).parameters()
)


def _predicted(technique, nproc: int, model: str = "bert-tiny", **shape) -> dict:
    run = spec(model, (technique,), nproc=nproc, **({"batch_size": 4, "seq_len": 16} | shape))
    out = predict(run, run.cpu, cuda=False)
    assert out.status == "ok", out.message
    assert not dist.is_initialized()  # the fake group is gone once the prediction is made
    return out


@pytest.mark.parametrize("n", [2, 8, 64])
def test_ddp_all_reduces_every_gradient_once_a_step(n):
    """A ring all-reduce moves 2(N−1)/N·Ψ elements per rank; DDP's gradients are float32 here."""
    out = _predicted(tech("ddp"), n)
    assert out.traffic_all_reduce_bytes == pytest.approx(2 * (n - 1) / n * PSI * 4, abs=n)
    assert out.traffic_all_gather_bytes == out.traffic_reduce_scatter_bytes == 0


@pytest.mark.parametrize("n", [2, 8])
def test_fsdp_gathers_parameters_in_forward_and_again_in_backward(n):
    """With resharding after forward each block's parameters are gathered twice a step, without it
    once; gradients are reduce-scattered once. Each moves (N−1)/N of the whole padded parameters'
    bytes."""
    volume = (n - 1) / n * _padded_elements("bert-tiny", n)[0] * n * 4
    resharded = _predicted(tech("fsdp"), n)
    kept = _predicted(tech("fsdp", reshard_after_forward=False), n)
    assert resharded.traffic_all_gather_bytes == pytest.approx(2 * volume, abs=n)
    assert kept.traffic_all_gather_bytes == pytest.approx(volume, abs=n)
    for out in (resharded, kept):
        assert out.traffic_reduce_scatter_bytes == pytest.approx(volume, abs=n)
        assert out.traffic_all_reduce_bytes == 0
        assert out.world_size == n


@pytest.mark.parametrize("n", [2, 8])
def test_fsdp_leaves_for_backward_what_the_plain_step_does_or_with_every_parameter_gathered(n):
    """FSDP2 frees a unit's gathered parameters by resizing their storage to nothing, which no
    operator dispatches (the tracker is told of each resize): resharding after forward, a forward
    leaves for backward exactly the plain step's activations; keeping them, the activations and the
    whole model's parameters, gathered (each padded to N rows)."""
    plain = predict(spec("bert-tiny", batch_size=4, seq_len=16), cuda=False)
    resharded = _predicted(tech("fsdp"), n)
    kept = _predicted(tech("fsdp", reshard_after_forward=False), n)
    assert resharded.activation_bytes == plain.activation_bytes
    # gathered as each rank's shard is padded: N rows at a time (float32 here)
    gathered = 4 * n * _padded_elements("bert-tiny", n)[0]
    assert gathered >= plain.param_bytes
    assert kept.activation_bytes == plain.activation_bytes + gathered


def _padded_elements(model: str, n: int) -> tuple[int, int]:
    """FSDP2 shards each parameter along its first dimension, padded to a multiple of N rows: a
    rank's elements, and the number of parameter tensors."""
    params = list(MODELS.get(model).build(Shapes(batch_size=1, seq_len=8)).parameters())
    return sum(math.ceil(p.shape[0] / n) * (p.numel() // p.shape[0]) for p in params), len(params)


@pytest.mark.parametrize("n", [8, 64, 1024])
def test_zero3_model_states_per_rank_at_any_world_size(n):
    """fsdp with bf16 mixed precision and AdamW keeps float32 sharded parameters, gradients and both
    moments: 16 bytes per element of the rank's shard (ZeRO-3's 16·Ψ/N, arXiv:1910.02054, with
    FSDP2's padding of each parameter's rows to N), and AdamW's step counter per parameter tensor,
    exactly."""
    out = _predicted(tech("fsdp", mixed_precision="bfloat16"), n, batch_size=1, seq_len=8)
    elements, tensors = _padded_elements("bert-tiny", n)
    states = out.param_bytes + out.gradient_bytes + out.optimizer_state_bytes
    assert states == 16 * elements + 4 * tensors


@pytest.mark.full  # BERT-base at full size: make test holds ZeRO-3's states on tiny models
def test_zero3_on_bert_base_is_the_textbook_figure():
    """At BERT-base's size, the padding and counters are noise: 16·Ψ/8 to 0.02%."""
    out = _predicted(
        tech("fsdp", mixed_precision="bfloat16"), 8, "bert-base", batch_size=1, seq_len=8
    )
    states = out.param_bytes + out.gradient_bytes + out.optimizer_state_bytes
    assert states == pytest.approx(16 * 109_489_930 / 8, rel=2e-4)


def test_a_prediction_made_beside_a_live_process_group_says_why():
    """Inside a rank of a real run the fake group cannot come up: the worker predicts before
    joining."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        out = predict(
            spec("bert-tiny", (tech("ddp"),), nproc=2, batch_size=4, seq_len=16), cuda=False
        )
    finally:
        dist.destroy_process_group()
    assert out.status == "unpredictable"
    assert "already up" in out.message


@pytest.mark.full
@pytest.mark.slow
def test_llama3_8b_over_8_ranks_is_predicted_and_never_built_on_a_cpu():
    """Llama-3-8B's 8.03 billion parameters under fsdp over 8 ranks: a rank holds an eighth of the
    float32 weights, gradients and AdamW moments, built on the meta device only; a CPU run of it is
    refused before anything is built."""
    from bench.recipe import Recipe

    run = spec(
        "llama3-8b",
        (tech("fsdp", mixed_precision="bfloat16"), tech("checkpoint")),
        nproc=8,
        batch_size=1,
        seq_len=64,
    )
    out = predict(run, run.cpu)  # standing for CUDA: a CPU run, and so its prediction, is refused
    assert out.status == "ok", out.message
    assert out.param_bytes == pytest.approx(8_030_261_248 * 4 / 8, rel=1e-5)
    # bf16 parameters gathered in forward and again in backward: 2 × 7/8 of the model's bf16 bytes
    assert out.traffic_all_gather_bytes == pytest.approx(2 * 7 / 8 * 8_030_261_248 * 2, rel=1e-4)
    assert predict(run, run.cpu, cuda=False).status == "unsupported"
    reason = Recipe.of(run, torch.device("cpu"), world_size=8).unsupported()
    assert reason.startswith("model llama3-8b: too large to build in a CPU's memory")


def test_fewest_ranks_is_the_first_world_size_whose_rank_fits():
    """Under fsdp a rank's peak falls as ranks are added: the fewest ranks under a budget set at 5
    ranks' peak is 5 or fewer, and one rank fewer is over it."""
    from dataclasses import replace

    from bench.predict.budget import fewest_ranks

    run = spec("bert-tiny", (tech("fsdp"),), nproc=16, batch_size=1, seq_len=8)
    peak = lambda n: predict(replace(run, nproc=n)).peak_tensor_bytes  # noqa: E731
    budget = peak(5)
    fewest = fewest_ranks(run, budget)
    assert 2 <= fewest <= 5 and peak(fewest) <= budget
    assert fewest == 2 or budget < peak(fewest - 1)
    assert fewest_ranks(run, peak(16) - 1) is None


def test_on_a_card_the_fewest_ranks_are_the_first_whose_rank_the_card_holds():
    """With a card (bench predict --card on a sharded entry): each rank's step replayed through
    its allocator, the fewest ranks are the first world size that does not run out of memory."""
    from dataclasses import replace

    from bench.predict.budget import fewest_ranks
    from bench.predict.cards import Card

    run = spec("bert-tiny", (tech("fsdp"),), nproc=16, batch_size=1, seq_len=8)
    reserved = lambda n: predict(replace(run, nproc=n)).peak_reserved_bytes  # noqa: E731
    card = Card(name="tiny", memory=reserved(5), memory_source="a test's", context=0)
    held = lambda n: predict(replace(run, nproc=n), card=card).verdict != "out of memory"  # noqa: E731
    fewest = fewest_ranks(run, None, card=card)
    assert 2 <= fewest <= 5 and held(fewest)
    assert fewest == 2 or not held(fewest - 1)


def test_hybrid_sharding_shards_within_a_group_and_replicates_across():
    """fsdp with shard_group 8 over 16 ranks: each rank holds an eighth of the model (as at 8
    ranks), gathers within its group only, and all-reduces its gradient shard across the two groups:
    2(2−1)/2 of an eighth."""
    hybrid = _predicted(tech("fsdp", shard_group=8), 16)
    flat = _predicted(tech("fsdp"), 8)
    assert hybrid.param_bytes == flat.param_bytes
    assert hybrid.traffic_all_gather_bytes == flat.traffic_all_gather_bytes
    assert hybrid.traffic_all_reduce_bytes == pytest.approx(flat.param_bytes, abs=16)
    run = spec("bert-tiny", (tech("fsdp", shard_group=3),), nproc=16, batch_size=4, seq_len=16)
    assert (
        "shard_group 3 does not divide the 16 processes"
        in predict(run, run.cpu, cuda=False).message
    )


def test_two_d_splits_the_layers_in_a_group_and_shards_across_the_groups():
    """fsdp with tensor_parallel 2 over 8 ranks: the 12 linears' split parameters are an eighth per
    rank, the rest a quarter (each padded to a multiple of 4 rows); the tensor-parallel all-reduces
    stay in the pair and move what tensor-parallel's alone do over 2 ranks, since a pair takes one
    batch."""
    two_d = _predicted(tech("fsdp", tensor_parallel=2), 8)
    tp = _predicted(tech("tensor-parallel"), 2)
    model = MODELS.get("bert-tiny").build(Shapes(batch_size=1, seq_len=8))
    split = {
        f"{n}.weight"
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".layer." in n
    }
    split |= {n.replace(".weight", ".bias") for n in split if not n.endswith("output.dense.weight")}
    elements = sum(
        p.numel() // 8 if name in split else math.ceil(p.shape[0] / 4) * (p.numel() // p.shape[0])
        for name, p in model.named_parameters()
    )
    assert two_d.param_bytes == 4 * elements
    assert two_d.traffic_all_reduce_bytes == tp.traffic_all_reduce_bytes > 0


def test_tensor_parallel_predicted_as_cuda_keeps_split_and_whole_parameters_apart():
    """CUDA's optimizers run foreach, whose kernels refuse a list mixing DTensors with whole tensors
    (the embeddings and norms tensor parallelism leaves alone): the trainer keeps them in two
    parameter groups."""
    run = spec("bert-tiny", (tech("tensor-parallel"),), nproc=2, batch_size=4, seq_len=16)
    assert predict(run, run.cpu).status == "ok"


def test_llamas_attention_and_gated_mlp_are_split_and_its_heads_must_divide():
    """Llama's plan: q, k and v column-wise and o row-wise; gate and up column-wise and down
    row-wise: 7 linears a layer, every one of them an eighth per rank over 8 (the embedding, norms
    and head stay whole). Its key-value heads must divide too: llama-tiny's 2 do not split over
    4."""
    from bench.recipe import Recipe

    run = spec("llama-tiny", (tech("tensor-parallel"),), nproc=2, batch_size=1, seq_len=8)
    out = _predicted(tech("tensor-parallel"), 2, "llama-tiny", batch_size=1, seq_len=8)
    model = MODELS.get("llama-tiny").build(Shapes(batch_size=1, seq_len=8))
    layers = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    assert out.param_bytes == 4 * (sum(p.numel() for p in model.parameters()) - layers // 2)
    recipe = Recipe.of(run, torch.device("cpu"), run.cpu, world_size=2)
    with fake_group(2, 0):
        model = recipe.stepper(model).model
    assert sum(isinstance(p, DTensor) for p in model.parameters()) == 7 * 2
    refused = predict(
        spec("llama-tiny", (tech("tensor-parallel"),), nproc=4, batch_size=1, seq_len=8), cuda=False
    )
    assert refused.message == "2 key value heads do not split over 4 ranks; choose a divisor"


def test_two_d_options_that_cannot_run_say_why():
    problems = build(TechniqueSpec("fsdp", (("shard_group", 8), ("tensor_parallel", 4)))).problems(
        1
    )
    assert problems == [
        "shard_group and tensor_parallel cannot be combined (hybrid sharding with tensor "
        "parallelism, 3-D, is not offered); set one to 0"
    ]
    for nproc, why in (
        (6, "tensor_parallel 4 does not divide the 6 processes; choose a divisor"),
        (
            4,
            "tensor_parallel over all the processes leaves none to shard across; use "
            "tensor-parallel",
        ),
    ):
        run = spec(
            "bert-tiny", (tech("fsdp", tensor_parallel=4),), nproc=nproc, batch_size=1, seq_len=8
        )
        assert predict(run, cuda=False).message == f"fsdp: {why}"


def test_fewest_ranks_tries_only_the_world_sizes_an_entry_runs_at():
    """Under 2-D over pairs, 3 or 5 ranks cannot run: the answer is a multiple of the pair, past one
    pair."""
    from bench.predict.budget import fewest_ranks, runs_at

    run = spec("bert-tiny", (tech("fsdp", tensor_parallel=2),), nproc=12, batch_size=1, seq_len=8)
    assert [n for n in range(2, 13) if runs_at(run, n)] == [4, 6, 8, 10, 12]
    budget = predict(dataclasses.replace(run, nproc=6)).peak_tensor_bytes
    assert fewest_ranks(run, budget) in (4, 6)


@pytest.mark.parametrize(
    ("shape", "n", "dim"),
    [
        ((10, 3), 4, 0),
        ((7,), 16, 0),
        ((1, 5), 2, 0),
        ((64, 8), 1024, 0),
        ((3, 8), 2, 1),
        ((0, 4), 3, 0),
        ((5,), 5, 0),
    ],
)
def test_a_ranks_chunks_are_made_as_read_and_are_fsdps_own(shape, n, dim):
    """The prediction's cut of a parameter into one chunk per rank (made as each is read, so that
    1,024 ranks do not make 1,024 views of every parameter) gives FSDP2's chunks: the same shapes
    and elements."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from bench.predict.ranks import _one_chunk_at_a_time

    t = torch.arange(math.prod(shape)).reshape(shape)
    ours, theirs = _one_chunk_at_a_time(t, n, dim), _chunk_with_empty(t, n, dim)
    assert len(ours) == len(theirs) == n
    assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(ours, theirs))
