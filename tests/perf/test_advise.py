"""``bench advise`` checked on the shipped models (``make perf``): at CPU shapes, with the budget at
60% of the baseline's predicted (on a CPU, exact) peak, the listed plans are measured here, and the
top plan must fit and run within 10% of the best throughput among those that fit. Plans known to
lose more than 5 accuracy points are dropped, as a user would. On a CPU without native bf16 (the
CI's VMs, some of them), no bf16 plan is offered: its steps take 6 to 15 times fp32's there. The
committed records are the evidence, copied so that the measurements land in a scratch folder."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from bench.provenance import CPU_BF16

pytestmark = pytest.mark.perf


@pytest.mark.parametrize("suite", ["resnet", "bert", "vit"])
def test_the_top_plan_fits_and_is_within_ten_percent_of_the_best_measured(suite, tmp_path):
    results = tmp_path / "results"
    shutil.copytree(
        "results",
        results,
        ignore=shutil.ignore_patterns("plots", "overview", "*.html", "*.md", "*.svg"),
    )
    start = time.perf_counter()
    argv = [
        "advise",
        f"suites/{suite}.toml",
        "--device",
        "cpu",
        "--budget",
        "60%",
        "--top",
        "3",
        "--tolerance-pt",
        "5",
        "--measure",
        "--results",
        str(results),
        "--out",
        str(tmp_path),
    ]
    # The shipped-model check asks this very CPU, as a user's advice would. Left out of the advice's
    # process only: popped here at import, it had left every test collected after it asking the CPU
    # (bf16 tests failed on AVX2).
    here = {k: v for k, v in os.environ.items() if k != CPU_BF16}
    done = subprocess.run(
        [sys.executable, "-m", "bench", *argv], capture_output=True, text=True, env=here
    )
    print(f"\n{suite}: {time.perf_counter() - start:.0f} s\n{done.stdout}")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
