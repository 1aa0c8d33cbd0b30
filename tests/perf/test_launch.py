"""The run launchers side by side (``make perf``): the smoke suite's wall time and each run's
start-up overhead with today's fork server and ahead-of-time predictions, against a fresh
interpreter per run that predicts itself. Each sweep is a whole ``bench run`` in its own process, so
the fork server's own start is paid as a user pays it; the two alternate, round after round, on the
same machine state."""

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.perf
ROUNDS = 2
WAYS = {
    "fresh, predicting itself": ["--launcher", "fresh", "--predict-jobs", "0"],
    "fork, predicted ahead": ["--launcher", "fork", "--predict-jobs", "1"],
}


def sweep(flags: list[str], results: Path) -> tuple[float, list[float]]:
    """Wall seconds of the whole sweep, and each run's startup_s (launch to its first warm-up
    step)."""
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "run",
            "smoke",
            "--no-fidelity",
            "--device",
            "cpu",
            "--results",
            str(results),
            *flags,
        ],
        check=True,
        capture_output=True,
    )
    wall = time.perf_counter() - start
    return wall, [json.loads(p.read_text())["startup_s"] for p in results.glob("smoke/*/*.json")]


def test_the_fork_server_cuts_each_runs_start_up_to_a_third(tmp_path):
    walls, starts = {w: [] for w in WAYS}, {w: [] for w in WAYS}
    for i in range(ROUNDS):
        for way, flags in WAYS.items():
            wall, per_run = sweep(flags, tmp_path / f"{i}-{way[:4]}")
            walls[way].append(wall)
            starts[way] += per_run
    print()
    for way in WAYS:
        print(
            f"{way:>26}: smoke suite {statistics.median(walls[way]):5.1f} s; start-up per run "
            f"median {statistics.median(starts[way]):.2f} s, max {max(starts[way]):.2f} s"
        )
    old, new = (statistics.median(starts[w]) for w in WAYS)
    old_wall, new_wall = (statistics.median(walls[w]) for w in WAYS)
    print(
        f"start-up per run, new / old: {new / old:.3f}; smoke wall time, new / old: "
        f"{new_wall / old_wall:.3f}"
    )
    assert new <= old / 3
