"""A model named by its hub id (hf:ORG/NAME[@REVISION], --hf ORG/NAME): its config.json read from
huggingface_hub's cache, laid out here as huggingface_hub lays it out under HF_HOME, offline; and
each way it cannot be had said with the two ways out."""

import shutil
from pathlib import Path

import pytest

from bench import hub
from bench.cli import main
from bench.suite.from_config import name_of

TINY = Path("suites/configs/tiny-llama")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cached(home: Path, repo: str, ref: str = "main") -> Path:
    """``repo``'s config.json in the hub cache under ``home``, at ``ref``, as hf_hub_download leaves
    it: the snapshot of a commit, the ref naming that commit."""
    folder = home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    shutil.copy(TINY / "config.json", snapshot / "config.json")
    (folder / "refs").mkdir()
    (folder / "refs" / ref).write_text(COMMIT)
    return snapshot / "config.json"


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf"


def test_a_hub_id_reads_the_cached_config_at_its_revision(offline):
    main_config = cached(offline, "acme/tiny-llama")
    assert hub.config_file("acme/tiny-llama") == main_config
    (main_config.parents[2] / "refs" / "v1").write_text(COMMIT)
    assert hub.config_file("acme/tiny-llama@v1") == main_config
    # a folder here is read as a folder, not a hub id
    assert hub.config_file(str(TINY)) == TINY / "config.json"


def test_bench_predict_takes_a_hub_id_from_the_cache_offline(
    offline, tmp_path, capsys, monkeypatch
):
    cached(offline, "acme/tiny-llama")
    monkeypatch.chdir(tmp_path)
    assert main(["predict", "--hf", "acme/tiny-llama", "--jobs", "1"]) == 0
    assert "| baseline | 8 | ok |" in capsys.readouterr().out


def test_an_uncached_hub_id_offline_names_the_cache_and_both_ways_out(offline, capsys):
    assert main(["predict", "--hf", "acme/not-cached", "--jobs", "1"]) == 2
    said = capsys.readouterr().err
    assert (
        f"acme/not-cached's config.json is not in huggingface_hub's cache ({offline / 'hub'})"
        in said
    )
    assert "HF_HUB_OFFLINE is set; run once where the hub is reachable" in said
    assert "or give a local folder holding its config.json" in said


def _raising(exc: Exception):
    def download(*_, **__):
        raise exc

    return download


def _gated() -> Exception:
    from huggingface_hub.errors import GatedRepoError

    error = GatedRepoError.__new__(GatedRepoError)  # its constructor wants an HTTP response
    Exception.__init__(error, "403")
    return error


def _unreachable() -> Exception:
    from huggingface_hub.errors import LocalEntryNotFoundError

    return LocalEntryNotFoundError("no network, and nothing cached")


@pytest.mark.parametrize(
    "raised, said",
    [
        (ConnectionError("no route to host"), "the hub cannot be reached (ConnectionError)"),
        (_unreachable(), "the hub cannot be reached (LocalEntryNotFoundError)"),
        (_gated(), "is gated: accept its licence on huggingface.co and log in (hf auth login)"),
    ],
    ids=["connection refused", "no network", "gated"],
)
def test_a_hub_that_cannot_give_the_config_says_why_and_what_to_do(
    raised, said, offline, monkeypatch
):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", _raising(raised))
    with pytest.raises(hub.HubError) as error:
        hub.config_file("acme/llama")
    assert said in str(error.value) and "or give a local folder" in str(error.value)


def test_a_hub_ids_suite_is_named_after_the_model_and_its_revision():
    assert name_of("meta-llama/Llama-3.1-8B") == "hf-Llama-3.1-8B"
    assert name_of("meta-llama/Llama-3.1-8B@v2") == "hf-Llama-3.1-8B-v2"
    assert name_of(str(TINY)) == "hf-tiny-llama"
