"""The documentation's own-technique example (docs/techniques.md), run exactly as written there."""

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_file(name: str) -> str:
    """The code block that follows ``<!-- file: NAME -->`` in docs/."""
    text = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    match = re.search(rf"<!-- file: {re.escape(name)} -->\s*```\w*\n(.*?)```", text, re.DOTALL)
    assert match, f"docs/ has no block for {name}"
    return match.group(1)


def run_readme_suite(
    tmp_path: Path, module: str, suite: str, *flags: str, edit: Callable[[str], str] = str
) -> dict[str, dict]:
    """Write the README's module and suite (through ``edit``) as a user would, run the suite on the
    CPU with ``flags``; its records by run."""
    suite_file = f"suites/{suite}.toml"
    for name, text in ((module, readme_file(module)), (suite_file, edit(readme_file(suite_file)))):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "bench", "run", suite, "--device", "cpu", *flags],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / f"results/{suite}/report.md").exists()
    return {
        p.stem: json.loads(p.read_text()) for p in (tmp_path / f"results/{suite}").glob("*/*.json")
    }


@pytest.mark.full
@pytest.mark.slow
def test_user_technique_from_the_readme_runs_and_proves_itself(tmp_path):
    # without the fidelity phase (tests/test_fidelity.py holds it): what is asserted is the
    # technique's step
    records = run_readme_suite(tmp_path, "my_techniques.py", "mine", "--no-fidelity")
    adamw, sgd = records["baseline"], records["sgd-momentum"]
    assert sgd["status"] == "ok" and sgd["proof"]["SGDMomentum.optimizer"] == "SGD"
    # One momentum buffer per parameter instead of AdamW's two moments (+ step counters).
    assert sgd["optimizer_state_bytes"] == sgd["param_bytes"]
    assert adamw["optimizer_state_bytes"] > 2 * adamw["param_bytes"]


@pytest.mark.full
@pytest.mark.slow
def test_user_model_from_the_readme_runs_with_its_blocks_found(tmp_path):
    records = run_readme_suite(tmp_path, "my_models.py", "convnext", "--no-fidelity")
    assert {r["status"] for r in records.values()} == {"ok"}, records
    proof = records["checkpoint"]["proof"]
    assert (
        proof["checkpoint.wrapped_modules"] == 18
        and proof["checkpoint.block_forwards_per_step"] == 2.0
    )
    assert records["checkpoint"]["activation_bytes"] < records["baseline"]["activation_bytes"]


@pytest.mark.full
@pytest.mark.slow
def test_a_language_model_from_the_readme_trains_on_its_next_tokens(tmp_path):
    # The suite as written trains its baseline on three seeds and the checkpoint run once more; the
    # fewest seeds a band takes (two) show the learning in half the time, and the checkpoint run's
    # memory needs no training.
    def lighter(text: str) -> str:
        text = text.replace("[fidelity]\n", "[fidelity]\nseeds = 2\n")
        return text.replace('name = "checkpoint"\n', 'name = "checkpoint"\nfidelity = false\n')

    records = run_readme_suite(tmp_path, "my_lm.py", "my-llama", edit=lighter)
    base, ckpt = records["baseline"], records["checkpoint"]
    assert base["status"] == ckpt["status"] == "ok", records
    # the two decoder layers, found in the tree
    assert ckpt["proof"]["checkpoint.wrapped_modules"] == 2
    assert ckpt["activation_bytes"] < base["activation_bytes"]
    # the CPU run, predicted exactly
    assert base["predicted_peak_tensor_bytes"] == base["peak_tensor_bytes"]
    assert base["accuracy"] > 0.2  # chance is 0.1: it learned the class as its last next token


def test_no_example_in_the_docs_writes_over_a_shipped_suite():
    text = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    written = re.findall(r"<!-- file: (suites/[^ ]+) -->", text)
    assert written and not [w for w in written if (ROOT / w).exists()]


def test_every_link_to_a_section_of_the_docs_finds_its_heading():
    def anchor(heading: str) -> str:  # as GitHub makes them
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")

    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, fragment in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            path = (page.parent / target) if target else page
            headings = re.findall(r"^#+ (.*)$", path.read_text(), re.M) if path.is_file() else []
            if fragment not in {anchor(h) for h in headings}:
                broken.append(f"{page.name}: {target}#{fragment}")
    assert not broken
