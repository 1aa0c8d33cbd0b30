import pytest

from bench.launch import Device
from tests.helpers import isolated, spec, tech


@pytest.mark.full  # 30 to 50 s of Inductor compiling on a two-core CPU
def test_compiled_run_records_compile_time_apart_and_no_tracked_peak():
    record = isolated(spec("vit-tiny", (tech("compile"),), measure_steps=3), Device("cpu", "cpu"))
    assert record["status"] == "ok", record
    assert record["proof"]["compile.compiled"] is True
    # The first step (where compilation happens) is timed apart from the steps throughput comes
    # from.
    assert record["first_step_ms"] > 0 and len(record["step_times_ms"]) == 3
    assert "peak_tensor_bytes" not in record  # the tracker cannot see inside compiled graphs
