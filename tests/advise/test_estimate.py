"""Prices and evidence: the calibration recovers the costs that made the steps, the records give
measured ratios and accuracy deltas with their sources, and plans rank by how their figures were
obtained."""

import json

import pytest

from bench.advise.estimate import STATED, Accuracy, Estimate, calibrate
from bench.advise.evidence import Evidence, canonical
from bench.advise.plans import Plan
from bench.advise.search import Candidate, rank
from bench.record import Prediction
from bench.spec import TechniqueSpec


def test_calibration_recovers_the_seconds_a_flop_an_operator_and_a_byte_take():
    per = (2e-12, 5e-6, 3e-11)
    counts = [(4e12, 900, 2e9), (5e9, 1200, 6e8), (3e11, 4000, 1e10), (8e10, 300, 4e8)]
    steps = [(f"m{i}", sum(c * p for c, p in zip(c3, per)), c3) for i, c3 in enumerate(counts)]
    fitted = calibrate(steps, STATED["cpu"])
    assert (fitted.per_flop, fitted.per_op, fitted.per_byte) == pytest.approx(per, rel=1e-6)
    assert fitted.seconds(*counts[0]) == pytest.approx(steps[0][1])


def test_calibration_keeps_every_price_at_zero_or_above_and_falls_back_to_the_stated_rate():
    # operators that make steps faster are no price: the fit drops them
    steps = [
        ("a", 1.0, (1e11, 1e6, 0.0)),
        ("b", 2.0, (2e11, 1e3, 0.0)),
        ("c", 0.5, (5e10, 1e6, 0.0)),
    ]
    fitted = calibrate(steps, STATED["cpu"])
    assert fitted.per_op == 0 and fitted.per_byte == 0 and fitted.per_flop > 0
    assert calibrate([], STATED["cuda"]).per_flop == 1 / STATED["cuda"].flops
    one = calibrate([("a", 2.0, (1e11, 5, 7))], STATED["cpu"])  # one step: its FLOPs alone
    assert one.per_flop == pytest.approx(2.0 / 1e11) and one.per_op == 0


def test_plans_priced_by_another_models_record_or_by_nothing_rank_after_the_rest():
    counted = Estimate(factor=1.30, sources=("checkpoint: counted",))
    borrowed = Estimate(
        factor=0.20,
        sources=("bf16-pure: measured (another model)",),
        uncertain=("bf16-pure",),
        tier=1,
    )
    assumed = Estimate(factor=0.10, sources=("amp: assumed",), uncertain=("amp",), tier=2)
    assert sorted([assumed, borrowed, counted], key=lambda e: e.rank) == [
        counted,
        borrowed,
        assumed,
    ]
    assert (
        Estimate(factor=1.004, sources=()).rank == Estimate(factor=0.996, sources=()).rank
    )  # under a percent: counting's noise


def record(suite, run, model, device, techniques, sps, accuracy=None, **extra):
    spec = {
        "techniques": [
            {"name": n, "options": [list(kv) for kv in o.items()]} for n, o in techniques
        ],
        "gpu": {"batch_size": 8},
        "cpu": {"batch_size": 4},
        "mode": "train",
    }
    return {
        "suite": suite,
        "run": run,
        "baseline": "baseline",
        "model": model,
        "device": device,
        "device_type": "cpu",
        "status": "ok",
        "spec": spec,
        "samples_per_s": sps,
        "accuracy": accuracy,
        "step_time_ms_median": 1000 / sps,
        **extra,
    }


def write(folder, records):
    for r in records:
        path = folder / r["suite"] / r["device"] / f"{r['run']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r))


def test_evidence_prefers_the_same_model_and_reads_accuracy_of_that_model_only(tmp_path):
    write(
        tmp_path,
        [
            record("a", "baseline", "bert-base", "cpu-x", [], 10.0, 0.90),
            record("a", "ckpt", "bert-base", "cpu-x", [("checkpoint", {"every": 1})], 7.0, 0.90),
            record("a", "amp", "bert-base", "cpu-x", [("amp", {"dtype": "bfloat16"})], 15.0, 0.85),
            record("b", "baseline", "resnet50", "cpu-x", [], 20.0, 0.5),
            record("b", "ckpt", "resnet50", "cpu-x", [("checkpoint", {})], 10.0, 0.1),
        ],
    )
    evidence = Evidence(tmp_path, "train")
    ckpt = canonical([TechniqueSpec("checkpoint")])
    assert (
        ckpt
        == canonical([TechniqueSpec("checkpoint", (("every", 1),))])
        == frozenset({"checkpoint"})
    )
    mine = evidence.speed(ckpt, "bert-base", "cpu")
    assert mine.value == pytest.approx(0.7) and mine.same_model and "results/a, ckpt" in mine.source
    other = evidence.speed(ckpt, "vit-b16", "cpu")
    assert not other.same_model and evidence.speed(ckpt, "bert-base", "cuda") is None
    amp = evidence.accuracy(canonical([TechniqueSpec("amp")]), "bert-base")
    assert amp.value == pytest.approx(-0.05)
    assert evidence.accuracy(ckpt, "vit-b16") is None  # resnet50's delta says nothing of vit's
    assert len(evidence.baselines("cpu")) == 2


def test_a_dtypes_speed_on_a_cpu_comes_from_that_very_cpu_only(tmp_path):
    # The same processor name with and without AVX-512: bf16 was 1.7x faster on one and 15x slower
    # on the other.
    write(
        tmp_path,
        [
            record("a", "baseline", "bert-base", "epyc-avx512", [], 10.0),
            record("a", "amp", "bert-base", "epyc-avx512", [("amp", {"dtype": "bfloat16"})], 17.0),
            record("a", "ckpt", "bert-base", "epyc-avx512", [("checkpoint", {})], 7.0),
        ],
    )
    amp, ckpt = canonical([TechniqueSpec("amp")]), canonical([TechniqueSpec("checkpoint")])
    here = Evidence(tmp_path, "train", device="epyc-avx2")
    assert here.speed(amp, "bert-base", "cpu", dtype=True) is None
    # fp32's ratio carries over
    assert here.speed(ckpt, "bert-base", "cpu").value == pytest.approx(0.7)
    there = Evidence(tmp_path, "train", device="epyc-avx512")
    assert there.speed(amp, "bert-base", "cpu", dtype=True).value == pytest.approx(1.7)


def test_a_plan_that_fits_its_card_only_after_cache_flushes_ranks_after_one_that_fits_cleanly():
    """Each flush is the allocator freeing its cache and retrying mid-step: a pause a clean fit
    never takes, so a faster plan that needs them ranks after a slower one that does not."""
    same_accuracy = Accuracy(delta=0.0, outside_band=False, unknown=(), sources=())

    fast = Candidate(
        plan=Plan(()),
        predicted=Prediction(status="ok", verdict="fits after flushes", flushes=2),
        speed=Estimate(factor=0.5, sources=()),
        accuracy=same_accuracy,
    )
    slow = Candidate(
        plan=Plan(()),
        predicted=Prediction(status="ok", verdict="fits", flushes=0),
        speed=Estimate(factor=1.0, sources=()),
        accuracy=same_accuracy,
    )
    assert sorted([fast, slow], key=lambda c: rank(c, None)) == [slow, fast]
