"""results/figures.md, the reference figures the documentation points to, against the committed records."""

from pathlib import Path

from bench.report.figures import figures_page, write_figures
from bench.report.tables import summary
from bench.results import load_records, to_frame
from bench.suite import load

ROOT = Path(__file__).resolve().parents[2]


def committed_tables() -> dict:
    suites = sorted(p for p in (ROOT / "results").iterdir() if p.is_dir() and any(p.glob("*/*.json")))
    return {p.name: summary(to_frame(load_records(p))) for p in suites}


def test_the_committed_figures_page_is_what_the_records_give():
    tables = committed_tables()
    entries = {name: len(load(ROOT / "suites" / f"{name}.toml").runs) for name in tables}
    assert (ROOT / "results" / "figures.md").read_text() == figures_page(tables, entries), (
        "results/figures.md is stale against the records: run `make overview` and commit it")


def test_a_new_record_changes_the_page_with_no_hand_edit(tmp_path):
    tables = committed_tables()
    smoke = tables["smoke"]
    before = figures_page({"smoke": smoke}, {"smoke": 4})
    faster = smoke.copy()
    faster.loc[faster["run"] == "checkpoint", "memory_vs_baseline"] = 0.123
    after = figures_page({"smoke": faster}, {"smoke": 4})
    assert before != after and "| checkpoint | 16 | 0.123 |" in after
    assert write_figures(tmp_path, {"smoke": smoke}, ROOT / "suites").read_text() == before
