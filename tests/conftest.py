import os

import pytest
import torch

from bench.provenance import CPU_BF16
from bench.recipe import Recipe, Stepper
from bench.suite import RunSpec

CPU = torch.device("cpu")
# Tests hold on a CPU with native bf16 and on one without alike: bf16 runs as on the former (a test
# of the other sets "emulated"), in this process and the runs it starts.
os.environ[CPU_BF16] = "native"

if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 0)):
    # make test runs a pytest process per core (pytest-xdist). torch's default, a thread per core in
    # each process, would oversubscribe the cores: on two cores the suite then took 15 min of CPU
    # time instead of 10, and barely less wall time than in one process. The runs the tests start
    # inherit the share.
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    # The slowest first (a stable sort keeps their order), handed out one at a time (make test):
    # handed out last, one of them would keep one test process busy for a minute after the other had
    # finished.
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def build_trainer(spec: RunSpec, device: torch.device = CPU) -> tuple[Stepper, object]:
    """The model and techniques of a spec, applied in this process as a run applies them, with its
    synthetic batch (a Inferencer for inference specs)."""
    recipe = Recipe.of(spec, device)
    return recipe.stepper(recipe.model(spec.weights)[0]), recipe.batch()
