"""results/figures.md, the reference figures the documentation points to, against the committed
records.

The committed page is held to the committed records, read from git's HEAD: a user's own `make bench`
adds records and rewrites the page in their working tree, and the test must hold whatever they
ran."""

import io
import subprocess
import tarfile
from pathlib import Path

import pytest

from bench.report.figures import figures_page, write_figures
from bench.report.headline import suite_throughput
from bench.report.tables import summary
from bench.results import load_records, to_frame
from bench.suite import load

ROOT = Path(__file__).resolve().parents[2]


def committed(folder: Path) -> Path:
    """HEAD's results/ and suites/, as committed, under ``folder``."""
    try:
        tar = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "HEAD", "results", "suites"],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: nothing is committed to compare")
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(folder, filter="data")
    return folder


def tables_of(results: Path) -> dict:
    suites = sorted(p for p in results.iterdir() if p.is_dir() and any(p.glob("*/*.json")))
    return {
        p.name: summary(
            to_frame(load_records(p)), suite_throughput(p.name, results.parent / "suites")
        )
        for p in suites
    }


def test_the_committed_figures_page_is_what_the_committed_records_give(tmp_path):
    root = committed(tmp_path)
    tables = tables_of(root / "results")
    entries = {name: len(load(root / "suites" / f"{name}.toml").runs) for name in tables}
    assert (root / "results" / "figures.md").read_text() == figures_page(tables, entries), (
        "results/figures.md is stale against the committed records: run `make overview` and commit "
        "it"
    )


def test_a_new_record_changes_the_page_with_no_hand_edit(tmp_path):
    tables = tables_of(committed(tmp_path / "head") / "results")
    smoke = tables["smoke"]
    before = figures_page({"smoke": smoke}, {"smoke": 4})
    faster = smoke.copy()
    faster.loc[faster["run"] == "checkpoint", "memory_vs_baseline"] = 0.123
    after = figures_page({"smoke": faster}, {"smoke": 4})
    assert before != after and "| checkpoint | 16 | 0.123 |" in after
    assert write_figures(tmp_path, {"smoke": smoke}, ROOT / "suites").read_text() == before
