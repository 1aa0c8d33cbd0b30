"""The conftest's stand-in for the CPU's bf16 answer holds for every test, whatever module was
collected first."""

import os

from bench.provenance import CPU_BF16


def test_every_test_sees_the_cpu_bf16_stand_in_after_collection():
    # tests/perf/test_advise.py once popped it at import: collected by make test, it left every test
    # on an AVX2 CPU asking the CPU, and six bf16 predictions there came out unsupported.
    assert os.environ.get(CPU_BF16) == "native"
