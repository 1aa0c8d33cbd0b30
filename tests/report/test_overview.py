import pytest

from bench import results
from bench.report.overview import build_overview

MiB = 2**20


def rec(suite, run, peak, tput, batch=8, **extra):
    return {
        "suite": suite,
        "run": run,
        "device": "cpu",
        "device_type": "cpu",
        "status": "ok",
        "model": "m",
        "baseline": "baseline",
        "batch_size": batch,
        "techniques": run,
        "peak_tensor_bytes": peak * MiB,
        "samples_per_s": tput,
        "torch_version": "2.14",
    } | extra


RUNS = [
    rec("a", "baseline", 100, 100.0, accuracy=0.9, accuracy_seeds=[0.9, 0.89]),
    rec("a", "free", 97, 100.0, accuracy=0.9),  # 3% saved for nothing: scores 3 / 1%
    rec("a", "deep", 40, 50.0, accuracy=0.9),  # 60% saved, 50% slower: scores 1.2
    rec("a", "ratio", 60, 90.0, accuracy=0.9),  # 40% saved for 10% slower: scores 4, the best
    rec("a", "harmful", 10, 100.0, accuracy=0.5),  # saves most, but breaks accuracy: never picked
    rec("a", "bigger-batch", 5, 100.0, batch=2),  # a matrix row at another batch: not a technique
]


def test_overview_page_covers_every_suite(tmp_path):
    for r in RUNS + [rec("b", "baseline", 10, 10.0)]:
        results.write_atomic(results.record_path(tmp_path, r["suite"], r["device"], r["run"]), r)
    written = build_overview(tmp_path)
    assert {p.name for p in written} == {
        "overview.md",
        "overview.html",
        "overview-cpu.png",
        "overview-cpu.svg",
        "figures.md",
        "README.md",
    }
    assert "| `peak_tensor_bytes` |" in (tmp_path / "README.md").read_text()  # the field reference
    assert (tmp_path / "figures.md").read_text().startswith("# Reference figures")
    text = written[0].read_text()
    # how many of the suite's records the device has (no suite file here: the records alone), then
    # the picks
    assert (
        "| a | m | 6 | 0.098 | 100.0 | deep: 0.40× memory, 0.50× throughput, accuracy +0.0 pt"
        in text
    )
    assert "| b | m |" in text
    page = written[1].read_text()
    assert "**" not in page, "literal Markdown in the overview's HTML"
    # text left, figures right
    assert "<td>deep: 0.40× memory" in page and '<td class="n">100.0</td>' in page
    assert "<a href='../a/report.html'>a</a>" in page  # the overview links to each suite's report


def test_overview_without_records_says_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="make bench"):
        build_overview(tmp_path)
