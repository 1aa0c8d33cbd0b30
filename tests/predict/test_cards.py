"""--card: the step replayed through the caching allocator under a card's memory less its
context."""

import math
import re
from pathlib import Path

import pytest

from bench import results
from bench.measure import history
from bench.predict import held, predict
from bench.predict.cards import CARDS, H100_CONTEXT, Card, card
from bench.predict.table import verdict
from bench.record import Prediction
from tests.helpers import spec

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
RECORDS = {name: sorted(ROOT.glob(f"results/*/nvidia-{name}*/*.json")) for name in ("h100", "h200")}


# runs whose libraries hold memory outside the allocator: shared-basis's SVD at the build runs in
# cuSOLVER, whose handle and workspace took 98 MiB more on the H100
OWN_CONTEXT = {"shared-basis"}


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_a_measured_cards_context_is_the_largest_its_committed_records_measured(name):
    """NVML's process memory less the allocator's reserved peak, in whole MiB, but where a run's
    own library holds memory beside the allocator's."""
    records = [results.read(p) for p in RECORDS[name]]
    measured = [
        r["nvml_process_bytes"] - r["peak_reserved_bytes"]
        for r in records
        if r.get("nvml_process_bytes") and r["run"] not in OWN_CONTEXT
    ]
    assert len(measured) >= 6 and math.ceil(max(measured) / MiB) * MiB == CARDS[name].context
    assert CARDS["h100"].context == H100_CONTEXT


def test_the_h100s_memory_is_the_total_capacity_its_out_of_memory_records_state():
    """What CUDA sees of an "80 GB" H100, as PyTorch's message prints it: 79.18 GiB, not 80."""
    said = {
        re.search(r"total capacity of ([\d.]+) GiB", r["message"])[1]
        for r in map(results.read, RECORDS["h100"])
        if "total capacity" in r.get("message", "")
    }
    assert said == {f"{CARDS['h100'].memory / 2**30:.2f}"} == {"79.18"}


def test_the_h200s_memory_is_what_its_out_of_memory_history_adds_up_to():
    """Where llama/baseline's request was refused: CUDA's free bytes, the allocator's segments then
    and the context NVML measured in the suite's other runs, to the MiB."""
    events = history.read(ROOT / "results/llama/nvidia-h200/baseline.history.pickle.gz")
    reserved = 0
    for e in events["device_traces"][0]:
        if e["action"] == "oom":
            break
        reserved += {"segment_alloc": e["size"], "segment_free": -e["size"]}.get(e["action"], 0)
    total = reserved + e["device_free"] + CARDS["h200"].context
    assert round(total / MiB) * MiB == CARDS["h200"].memory


def test_every_verdict_is_the_allocator_replayed_under_the_cards_capacity():
    """Where every segment the step reserves fits, it fits; a little less, and the allocator must
    free its cache and retry; under what the step allocates at once, nothing can save it: out of
    memory, with the phase and the request that failed."""
    run = spec("vit-tiny", batch_size=64, image_size=64)
    free = predict(run)

    def on(capacity: int) -> Prediction:
        card = Card(
            name="test",
            memory=capacity,
            memory_source="test",
            hopper=True,
            context=0,
            context_source="test",
        )
        return predict(run, card=card)

    roomy = on(free.peak_reserved_bytes)
    assert (roomy.verdict, roomy.flushes, roomy.peak_reserved_bytes) == (
        "fits",
        0,
        free.peak_reserved_bytes,
    )
    tight = [
        on(c)
        for c in range(free.peak_reserved_bytes - 2 * MiB, free.peak_allocated_bytes, -2 * MiB)
    ]
    assert any(t.verdict == "fits after flushes" and t.flushes > 0 for t in tight)
    short = on(free.peak_allocated_bytes - 2 * MiB)
    assert short.verdict == "out of memory" and short.oom_phase in (
        "forward",
        "backward",
        "optimizer",
    )
    assert short.oom_request_bytes > 0 and short.card == "test"
    # No peak beside the verdict: the reserve at the failing request is not the run's reserved peak.
    assert short.peak_reserved_bytes is None and short.nvml_process_bytes is None
    assert 0 < short.oom_reserved_bytes <= free.peak_allocated_bytes - 2 * MiB
    said = verdict(short)
    assert said.startswith(f"out of memory in {short.oom_phase} (a request of ")
    assert said.endswith(" GiB reserved then)")


def test_the_process_memory_is_the_reserved_peak_and_the_cards_context():
    run = spec("vit-tiny", batch_size=8)
    out = predict(run, card=CARDS["rtx4090"])
    assert out.nvml_process_bytes == out.peak_reserved_bytes + CARDS["rtx4090"].context


def test_a_card_is_named_as_users_write_it_and_an_unknown_one_lists_the_known():
    assert card("RTX 4090") is card("rtx4090") is CARDS["rtx4090"]
    with pytest.raises(ValueError, match="not a card known here; one of v100, t4, l4"):
        card("rtx5090")


@pytest.mark.full
def test_the_docs_table_of_gpu_records_against_their_predictions_is_current(tmp_path):
    """docs/measuring.md's table is what the committed records and today's predictions give: make
    docs."""
    page = Path(__file__).resolve().parents[2] / "docs" / "measuring.md"
    copy = tmp_path / "measuring.md"
    copy.write_text(page.read_text())
    held.write(copy, page.parents[1] / "results")
    assert copy.read_text() == page.read_text(), "docs/measuring.md's table is stale: run make docs"


@pytest.mark.full
def test_every_published_figure_is_predicted_within_five_percent_on_its_card():
    """results/*/published.csv: what others measured with nvidia-smi (Hugging Face's bert-large
    table, under PyTorch 1.10), held against the prediction of the suite's run on that card."""
    root = Path(__file__).resolve().parents[2]
    found = held.published(root / "results", root / "suites")
    assert len(found) >= 6
    assert {r.run: round(r.ratio, 3) for r in found if abs(r.ratio - 1) > 0.05} == {}
