import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_key_of_the_committed_records_is_explained_in_the_results_readme():
    """A record is self-describing only if its keys are explained: every key the committed records
    hold is named in results/README.md or README.md (`rank_` and `predicted_` keys by the figure
    they repeat, `at_peak_*` and `step_time_ms_*` by their family's short form)."""
    docs = (ROOT / "results" / "README.md").read_text() + "".join(
        p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    )
    keys = {k for p in ROOT.glob("results/*/*/*.json") for k in json.loads(p.read_text())}
    assert len(keys) > 50  # the committed records are there to check

    def named(key: str) -> bool:
        if f"`{key}`" in docs:  # a prediction's own figure (its traffic) is named as it is
            return True
        key = re.sub(r"^(rank_|predicted_)", "", key)
        family = re.fullmatch(r"(?:at_peak|step_time_ms)_(\w+?)(?:_bytes)?", key)
        return f"`{key}`" in docs or bool(family and re.search(rf"`_{family[1]}_?`", docs))

    assert sorted(k for k in keys if not named(k)) == []


def test_the_archive_a_leased_machine_hands_back_holds_what_each_run_saved_beside_its_record(
    tmp_path,
):
    """The allocator's history (the trace a CUDA run replays to the segment) and a --snapshot travel
    with the record and its memory summary; another suite's files and the device's stray files do
    not."""
    import tarfile

    from bench import results

    folder = results.suite_folder(tmp_path / "results", "s", "nvidia-x")
    saved = ["a.json", "a.memory.txt", "a.history.pickle.gz", "a.snapshot.pickle", "fit/a.json"]
    for name in [*saved, "notes.log"]:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(name)
    other = results.suite_folder(tmp_path / "results", "t", "nvidia-x")
    other.mkdir(parents=True)
    (other / "b.json").write_text("{}")
    archive = tmp_path / "out" / "results.tgz"
    results.pack(archive, tmp_path / "results", ["s"], "nvidia-x")
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == sorted(f"results/s/nvidia-x/{n}" for n in saved)
