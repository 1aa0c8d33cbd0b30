"""bench fit on a CPU: the budget held against tracked live bytes, each probe a run of its own."""

import pytest
import torch

from bench import results
from bench.fit import fit_suite, verdict
from bench.launch import Device
from bench.worker import over_budget
from tests.helpers import spec

CPU = Device("cpu", "cpu")


def test_the_measured_largest_batch_matches_the_prediction_that_a_cpu_run_is_held_to(tmp_path):
    run = spec("vit-tiny", batch_size=4, name="baseline")
    (row,) = fit_suite([run], CPU, budget=3 * 2**20, results_root=tmp_path)
    assert row["status"] == "ok" and row["measured_largest_batch"] > 1
    # on a CPU the prediction is exact
    assert row["measured_largest_batch"] == row["predicted_largest_batch"]
    assert not row["promises_oom"] and row["within_5pct_below"]
    fits = [p for p in row["probes"] if p["status"] == "ok"]
    over = [p for p in row["probes"] if p["status"] == "oom"]
    assert max(p["batch_size"] for p in fits) == row["measured_largest_batch"]
    # the bracket is closed
    assert min(p["batch_size"] for p in over) == row["measured_largest_batch"] + 1
    assert all(p["peak_bytes"] <= 3 * 2**20 for p in fits) and all(
        p["peak_bytes"] > 3 * 2**20 for p in over
    )
    stored = results.suite_folder(tmp_path, "test", "cpu") / "fit" / f"baseline@{3 * 2**20}.json"
    assert results.read(stored)["measured_largest_batch"] == row["measured_largest_batch"]
    # not a run's record: reports never take it for one
    assert results.load_records(tmp_path / "test") == []


def test_a_run_over_the_budget_is_out_of_memory_and_one_under_it_is_untouched():
    ok = {"status": "ok", "peak_tensor_bytes": 100}
    assert over_budget(ok, 100) == {}
    assert over_budget(ok, 99)["status"] == "oom"
    assert over_budget({"status": "error"}, 1) == {}


def test_the_verdict_flags_a_promised_oom_and_a_prediction_far_below():
    assert verdict({"predicted_largest_batch": 33, "measured_largest_batch": 32})["promises_oom"]
    assert (
        verdict({"predicted_largest_batch": 30, "measured_largest_batch": 32})["within_5pct_below"]
        is False
    )
    assert verdict({"predicted_largest_batch": 31, "measured_largest_batch": 32}) == {
        "promises_oom": False,
        "within_5pct_below": True,
    }


@pytest.mark.cuda
def test_on_a_card_the_prediction_never_promises_a_batch_that_runs_out_of_memory(tmp_path):
    gpu = Device("cuda", torch.cuda.get_device_name(0))
    (row,) = fit_suite(
        [spec("resnet-tiny", batch_size=32, image_size=64, name="baseline")],
        gpu,
        budget=2**30,
        results_root=tmp_path,
    )
    assert row["status"] == "ok" and not row["promises_oom"], row
