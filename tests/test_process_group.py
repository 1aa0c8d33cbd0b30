"""Multi-process runs under torchrun, 2 gloo processes on the CPU: per-rank records, and model
states per rank against the ZeRO formulas."""

import dataclasses
import os

import pytest
import torch
from filelock import FileLock

from bench import results
from bench.launch import Device
from bench.launch.local import Local
from bench.models import MODELS
from bench.process_group import merge
from bench.record import Record
from bench.suite import Shapes, SuiteError, load
from bench.sweep import sweep
from tests.helpers import isolated, spec, suite_problems, tech

CPU = Device("cpu", "cpu")
BERT_TINY = MODELS.get("bert-tiny").build(Shapes(batch_size=8, seq_len=64))
PSI = sum(p.numel() for p in BERT_TINY.parameters())
ADAM_FP32 = 16  # bytes per parameter: fp32 weight 4, gradient 4, Adam's two moments 8
# AdamW's per-parameter step counter (a 0-d float32 tensor): 41 parameter tensors
STEP_COUNTERS = 4 * 41


# Every multi-process dist-smoke entry a CPU runs (fsdp-offload needs CUDA).
MULTI_PROCESS = (
    "ddp",
    "ddp-bucket-view",
    "fsdp",
    "fsdp-keep-params",
    "fsdp-bf16",
    "zero-1",
    "zero-2",
    "zero-3",
    "tensor-parallel",
)


@pytest.fixture(scope="module")
def dist_records(tmp_path_factory):
    """The shipped dist-smoke suite's multi-process entries, each as 2 gloo processes: swept once
    per test session. Under make test's processes, the first to need them sweeps into the session's
    common folder while the others wait on its lock, then read the stored records, rather than each
    sweeping again."""
    base = tmp_path_factory.getbasetemp()
    # the session's, not another's
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    with FileLock(shared / "dist-records.lock"):
        root = shared / "dist-records"
        if not root.exists():
            suite = load("suites/dist-smoke.toml")
            chosen = dataclasses.replace(
                suite, runs=tuple(r for r in suite.runs if r.name in MULTI_PROCESS)
            )
            sweep(chosen, Local(CPU), root)
        return {r["run"]: r for r in results.load_records(root / "dist-smoke")}


@pytest.mark.full
@pytest.mark.slow
def test_every_rank_reports_and_the_record_keeps_each_ranks_figure(dist_records):
    for r in dist_records.values():
        assert r["status"] == "ok", r.get("stderr_tail", r)
        assert r["world_size"] == 2 and r["nproc"] == 2
        assert len(r["rank_peak_tensor_bytes"]) == 2 and r["peak_tensor_bytes"] == max(
            r["rank_peak_tensor_bytes"]
        )


@pytest.mark.full
def test_per_rank_model_states_match_the_zero_formulas(dist_records):
    """DDP replicates: 16·Ψ bytes per rank for fp32 Adam. FSDP (ZeRO-3) shards all three states:
    16·Ψ/N. Tolerance: FSDP pads each flat shard to a multiple of N elements (< 0.1% here)."""
    ddp = dist_records["ddp"]["rank_model_state_bytes"]
    fsdp = dist_records["fsdp"]["rank_model_state_bytes"]
    assert ddp == [ADAM_FP32 * PSI + STEP_COUNTERS] * 2
    for per_rank in fsdp:
        assert per_rank == pytest.approx(ADAM_FP32 * PSI / 2, rel=1e-3)
    # DeepSpeed's ZeRO in float32: the whole parameters and a float32 master partition with Adam's
    # moments at stages 1 and 2 (4·Ψ + 12·Ψ/N), everything partitioned at 3 (16·Ψ/N) but for the
    # parameters under 10·hidden elements, whole on every rank
    for run in ("zero-1", "zero-2"):
        for per_rank in dist_records[run]["rank_model_state_bytes"]:
            assert per_rank == pytest.approx(4 * PSI + 12 * PSI / 2, rel=1e-3)
    whole = 4 * sum(
        p.numel() for p in BERT_TINY.parameters() if p.numel() <= 10 * BERT_TINY.config.hidden_size
    )
    for per_rank in dist_records["zero-3"]["rank_model_state_bytes"]:
        assert per_rank == pytest.approx(16 * PSI / 2 + whole, rel=1e-3)
    assert dist_records["ddp"]["proof"]["ddp.params_in_sync"] is True
    assert dist_records["fsdp"]["proof"]["fsdp.param_fraction_per_rank"] == pytest.approx(
        0.5, abs=1e-3
    )


@pytest.mark.full
def test_tensor_parallel_shards_the_attention_and_mlp_pairs_exactly(dist_records):
    """bert-tiny: 2 layers × (query, key, value, attention output, intermediate, output) = 12
    linears. Column-wise linears split weight and bias, row-wise ones the weight (their bias is
    added once, whole); embeddings, norms, pooler and head stay whole on every rank."""
    tp = dist_records["tensor-parallel"]
    assert tp["proof"]["tensor-parallel.sharded_linears"] == 12
    assert tp["proof"]["tensor-parallel.param_fraction_per_rank"] == round(
        (PSI - _tp_split() / 2) / PSI, 4
    )
    # Every rank takes the same batch: the group's throughput is one batch per step, not two.
    assert tp["samples_per_s"] == pytest.approx(8 / tp["step_time_ms_median"] * 1000, rel=1e-6)
    ddp = dist_records["ddp"]
    assert ddp["samples_per_s"] == pytest.approx(
        2 * 8 / ddp["step_time_ms_median"] * 1000, rel=1e-6
    )


def _tp_split() -> int:
    """bert-tiny's parameters that tensor parallelism splits: the weights of the 12 linears in its
    layers, and the biases of the column-wise ones (a row-wise linear adds its bias once, whole)."""
    model = MODELS.get("bert-tiny").build(Shapes(batch_size=8, seq_len=64))
    return sum(
        m.weight.numel() + (0 if name.endswith("output.dense") else m.bias.numel())
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".layer." in name
    )


@pytest.mark.slow
def test_a_failing_rank_ends_the_run_at_once_with_its_reason():
    record = isolated(spec("bert-tiny", (tech("tests.helpers:FailOnRank1"),), nproc=2), CPU)
    assert record["status"] == "error" and record["failed_rank"] == 1, record
    assert "rank 1 gave up" in record["message"]


@pytest.mark.slow
def test_a_rank_that_aborts_leaves_its_own_last_words_in_the_record():
    record = isolated(spec("bert-tiny", (tech("tests.helpers:AbortOnRank1"),), nproc=2), CPU)
    assert record["status"] == "error" and "run process died" in record["message"], record
    assert (
        "--- rank 1 stderr ---" in record["stderr_tail"]
        and "rank 1: about to abort" in record["stderr_tail"]
    )


def test_more_processes_than_gpus_is_unsupported_without_starting_anything():
    record = isolated(
        spec("bert-tiny", (tech("ddp"),), nproc=4), Device("cuda", "NVIDIA H100", count=2)
    )
    assert record == {"status": "unsupported", "message": "needs 4 GPUs per node; 2 visible"}


def test_merge_takes_the_worst_rank_and_the_slowest_pace():
    ranks = [
        {
            "status": "ok",
            "peak_tensor_bytes": 10,
            "samples_per_s": 100.0,
            "step_time_ms_median": 5.0,
        },
        {
            "status": "ok",
            "peak_tensor_bytes": 30,
            "samples_per_s": 80.0,
            "step_time_ms_median": 6.0,
        },
    ]
    out = merge([Record.from_flat(r) for r in ranks]).to_flat()
    assert (
        out["peak_tensor_bytes"] == 30
        and out["peak_rank"] == 1
        and out["rank_peak_tensor_bytes"] == [10, 30]
    )
    assert (
        out["samples_per_s"] == 80.0
        and out["step_time_ms_median"] == 6.0
        and out["world_size"] == 2
    )


def test_suite_checks_nproc_against_the_techniques(tmp_path):
    base = (
        'model = "bert-tiny"\nbaseline = "a"\n[shapes.gpu]\nbatch_size = 2\nseq_len = 8\n'
        '[shapes.cpu]\nbatch_size = 2\nseq_len = 8\n[[runs]]\nname = "a"\ntechniques = []\n'
    )
    found = suite_problems(
        tmp_path,
        base + '[[runs]]\nname = "b"\ntechniques = ["ddp"]\nnproc = 1\n'
        '[[runs]]\nname = "c"\ntechniques = []\nnproc = 4\n',
    )
    assert "runs[1].nproc: ddp needs at least 2 processes, got 1" in found
    assert any(
        p.startswith("runs[2].nproc: 4 processes without ddp, fsdp or tensor-parallel")
        for p in found
    )
    path = tmp_path / "ok.toml"
    path.write_text(base + '[[runs]]\nname = "b"\ntechniques = ["fsdp"]\n[fidelity]\nsteps = 1\n')
    runs = {r.name: r for r in load(path).runs}
    assert runs["b"].nproc == 2 and runs["a"].nproc == 1  # implied by the technique
    # one process trains
    assert runs["b"].fidelity("cpu") is None and runs["a"].fidelity("cpu") is not None
    with pytest.raises(SuiteError):
        path.write_text(base + '[[runs]]\nname = "b"\ntechniques = ["fsdp", "ddp"]\n')
        load(path)
    for nproc in (0, -2, 65_537):
        found = suite_problems(
            tmp_path, base + f'[[runs]]\nname = "b"\ntechniques = ["ddp"]\nnproc = {nproc}\n'
        )
        assert f"runs[1].nproc: must be 1 to 65,536, got {nproc}" in found


def assert_predicted_per_rank(record: dict) -> None:
    """Each rank's prediction (made on fake tensors under torch's fake process group, before the
    rank joins the real one) bounds the peak it then measures under gloo: never under, nor over by
    more than two collectives' tensors. Under gloo a rank may still hold collectives' buffers at its
    peak while they wait for a slower peer (FSDP2 keeps one all-gather and one reduce-scatter in
    flight); which rank, and whether, changes from run to run: usually one rank is exact to the
    byte, but CI once saw both ranks 10,816 bytes over under fsdp, and 111,312 under tensor-parallel
    was seen on a loaded machine. Exactness to the byte is held by the single-process tests, where
    nothing waits on a peer."""
    assert record["predicted_status"] == "ok", record.get("predicted_message")
    predicted = record["rank_predicted_peak_tensor_bytes"]
    measured = record["rank_peak_tensor_bytes"]
    gaps = [m - p for p, m in zip(predicted, measured)]
    slack = 2 * record["predicted_largest_collective_bytes"]
    assert all(0 <= gap <= slack for gap in gaps), (predicted, measured, slack)


@pytest.mark.full
@pytest.mark.parametrize("run", MULTI_PROCESS)
def test_each_ranks_prediction_is_its_measured_peak(dist_records, run):
    assert_predicted_per_rank(dist_records[run])


@pytest.mark.full
@pytest.mark.slow
def test_predictions_hold_at_four_ranks(tmp_path):
    """ddp and fsdp over 4 gloo processes (bert-tiny's 2 attention heads cannot split 4 ways for
    tensor-parallel), dist-smoke's 2-D entry, and the model states each rank holds: 16·Ψ/4 under
    fsdp."""
    suite = load("suites/dist-smoke.toml")
    chosen = dataclasses.replace(
        suite,
        runs=tuple(
            dataclasses.replace(r, nproc=4)
            for r in suite.runs
            if r.name in ("ddp", "fsdp", "fsdp-tp")
        ),
    )
    sweep(chosen, Local(CPU), tmp_path)
    records = {r["run"]: r for r in results.load_records(tmp_path / "dist-smoke")}
    for record in records.values():
        assert record["status"] == "ok" and record["world_size"] == 4, record.get(
            "stderr_tail", record
        )
        assert_predicted_per_rank(record)
    # Each shard padded to a multiple of 4 elements: 0.3% here.
    assert records["fsdp"]["rank_model_state_bytes"][0] == pytest.approx(
        ADAM_FP32 * PSI / 4, rel=5e-3
    )
    # 2-D: the pairs split the 12 linears (their parameters halved), fsdp halves everything across
    # the pairs, and the two ranks of a pair share one batch: the group of 4 takes 2 batches a step.
    two_d = records["fsdp-tp"]
    assert two_d["proof"]["fsdp.sharded_linears"] == 12
    assert two_d["proof"]["fsdp.param_fraction_per_rank"] == pytest.approx(
        (PSI - _tp_split() / 2) / PSI / 2, abs=2e-3
    )
    assert two_d["samples_per_s"] == pytest.approx(
        2 * 8 / two_d["step_time_ms_median"] * 1000, rel=1e-6
    )
