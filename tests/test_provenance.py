import subprocess

from bench.provenance import git_revision


def test_revision_is_dirty_for_changed_code_but_not_for_the_harness_own_results(tmp_path):
    git = lambda *args: subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],  # noqa: E731
        cwd=tmp_path,
        check=True,
        capture_output=True,
    )
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "run.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "first")
    clean = git_revision(tmp_path)
    assert len(clean) == 40
    (tmp_path / "results" / "run.json").write_text('{"peak": 1}')  # a sweep wrote a record
    assert git_revision(tmp_path) == clean
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_revision(tmp_path) == clean + "-dirty"


def test_a_record_names_the_packages_its_run_imported_and_no_others(monkeypatch):
    import sys

    import torch
    import torchvision

    from bench.provenance import PACKAGES, runtime_provenance

    # Installed here (make test installs torchao), but not imported by this run: not named.
    for name in ("torchao", "bitsandbytes"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    packages = runtime_provenance(torch.device("cpu")).packages
    # the installed release, build tag aside
    assert torchvision.__version__.startswith(packages["torchvision"])
    assert not {"torchao", "bitsandbytes"} & set(packages) and set(packages) <= set(PACKAGES)


def test_an_optional_packages_import_warnings_stay_out_of_the_terminal_and_go_in_the_record():
    """bitsandbytes warned on every `bench predict` that its CPU 4-bit kernels need `kernels`: read
    as an error by newcomers. Its warnings are kept for the run's record; its errors still reach the
    terminal."""
    import sys

    script = (
        "import logging, torch, bench\nfrom bench.provenance import runtime_provenance\nlog = "
        "logging.getLogger('bitsandbytes.backends.cpu.ops')\nlog.warning('Failed to load CPU "
        "gemm_4bit_forward from kernels-community')\nlog.warning('a second, later "
        "warning')\nlog.error('a real "
        "error')\nprint(runtime_provenance(torch.device('cpu')).package_notes)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    kept = "{'bitsandbytes': 'Failed to load CPU gemm_4bit_forward from kernels-community'}"
    assert done.stdout.strip() == kept
    assert done.stderr.strip() == "a real error"
