"""bench fit on a CPU: the budget held against tracked live bytes, each probe a run of its own."""

import json

import pytest
import torch

from bench import results
from bench.fit import Fit, fit_suite
from bench.launch import Device
from bench.record import Memory, Outcome, Record, Status
from bench.worker import over_budget
from tests.helpers import spec

CPU = Device("cpu", "cpu")


def test_the_measured_largest_batch_matches_the_prediction_that_a_cpu_run_is_held_to(tmp_path):
    run = spec("vit-tiny", batch_size=4, name="baseline")
    (fit,) = fit_suite([run], CPU, budget=3 * 2**20, results_root=tmp_path)
    assert fit.status == "ok" and fit.measured_largest_batch > 1
    # on a CPU the prediction is exact
    assert fit.measured_largest_batch == fit.predicted_largest_batch
    assert not fit.promises_oom and fit.close_below
    fits = [p for p in fit.probes if p.status == "ok"]
    over = [p for p in fit.probes if p.status == "oom"]
    assert max(p.batch_size for p in fits) == fit.measured_largest_batch
    # the bracket is closed
    assert min(p.batch_size for p in over) == fit.measured_largest_batch + 1
    assert all(p.peak_bytes <= 3 * 2**20 for p in fits) and all(
        p.peak_bytes > 3 * 2**20 for p in over
    )
    stored = results.suite_folder(tmp_path, "test", "cpu") / "fit" / f"baseline@{3 * 2**20}.json"
    assert results.read(stored) == json.loads(json.dumps(fit.stored()))
    # not a run's record: reports never take it for one
    assert results.load_records(tmp_path / "test") == []


def test_a_run_over_the_budget_is_out_of_memory_and_one_under_it_is_untouched():
    ok = Record(outcome=Outcome(status=Status.OK), memory=Memory(peak_tensor_bytes=100))
    assert over_budget(ok, 100) is None
    assert over_budget(ok, 99).status == Status.OOM
    assert over_budget(Record(outcome=Outcome(status=Status.ERROR)), 1) is None


def test_the_verdict_flags_a_promised_oom_and_a_prediction_far_below():
    def fit(predicted: int, measured: int | None) -> Fit:
        return Fit(
            suite="s",
            run="r",
            run_key="k",
            device="cpu",
            budget_bytes=1,
            predicted_largest_batch=predicted,
            measured_largest_batch=measured,
        )

    assert fit(33, 32).promises_oom and not fit(33, 32).close_below
    assert not fit(30, 32).promises_oom and not fit(30, 32).close_below
    assert not fit(31, 32).promises_oom and fit(31, 32).close_below
    assert fit(31, None).stored()["promises_oom"] is False  # nothing fits: nothing promised


@pytest.mark.cuda
def test_on_a_card_the_prediction_never_promises_a_batch_that_runs_out_of_memory(tmp_path):
    gpu = Device("cuda", torch.cuda.get_device_name(0))
    (row,) = fit_suite(
        [spec("resnet-tiny", batch_size=32, image_size=64, name="baseline")],
        gpu,
        budget=2**30,
        results_root=tmp_path,
    )
    assert row.status == "ok" and not row.promises_oom, row
