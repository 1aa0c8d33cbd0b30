"""``bench advise`` from the command line: bad input exits 2 with the fix, a budget nothing meets
says what would, and on tiny models at 60% of the baseline's peak the advice holds when measured on
this CPU."""

import shutil

import pytest

from bench import advise
from bench.advise import search
from bench.advise.plans import Option
from bench.cli import main
from bench.provenance import CPU_BF16
from bench.suite import load
from tests.advise.test_estimate import record, write


def _shapes(size: str) -> str:
    return "".join(f"[shapes.{d}]\nbatch_size = 32\n{size}\n" for d in ("gpu", "cpu"))


TINY = {  # CPU shapes where activations make the peak, and steps long enough to time on two cores
    "bert-tiny": _shapes("seq_len = 128"),
    # 48² images: at 32², only bf16 (dropped on a CPU without it) took resnet-tiny's peak under 60%
    "resnet-tiny": _shapes("image_size = 48"),
    "vit-tiny": _shapes("image_size = 32"),
}


def tiny_suite(folder, model):
    path = folder / f"tiny-{model}.toml"
    path.write_text(
        f'model = "{model}"\nbaseline = "baseline"\nwarmup_steps = 1\nmeasure_steps = '
        f"6\n{TINY[model]}"
        '[[runs]]\nname = "baseline"\ntechniques = []\n'
    )
    return path


def evidence(tmp_path):
    """The committed records, where measurements may land beside them."""
    results = tmp_path / "results"
    shutil.copytree(
        "results",
        results,
        ignore=shutil.ignore_patterns(
            "plots", "overview", "*.html", "*.md", "*.svg", "*.csv", "*.png"
        ),
    )
    return results


@pytest.mark.parametrize(
    "argv, said",
    [
        (["bert-huge", "--budget", "8GiB"], "unknown model 'bert-huge'"),
        (["bert-tiny", "--budget", "lots"], "expected a size such as 16GiB"),
        (["bert-tiny", "--budget", "0%"], "a share of the baseline's predicted peak such as 60%"),
        (["bert-tiny", "--budget", "1GiB"], "--reserve 1280MiB leaves nothing of --budget 1GiB"),
        (
            ["suites/bert.toml", "--infer", "--budget", "8GiB"],
            "is a train suite; leave out --infer",
        ),
        (
            ["bert-tiny", "--device", "cpu", "--reserve", "1GiB", "--budget", "8GiB"],
            "leave it out with --device cpu",
        ),
        (["bert-tiny"], "give one of --budget SIZE and --card NAME"),
        (
            ["bert-tiny", "--card", "t4", "--budget", "8GiB"],
            "give one of --budget SIZE and --card NAME",
        ),
        (["bert-tiny", "--card", "rtx5090"], "--card 'rtx5090': not a card known here"),
        (
            ["bert-tiny", "--card", "t4", "--device", "cpu"],
            "is a CUDA card; leave out --device cpu",
        ),
    ],
)
@pytest.mark.fault("cli values")
def test_bad_input_exits_2_with_the_fix(argv, said, capsys, tmp_path):
    assert main(["advise", *argv, "--out", str(tmp_path)]) == 2
    assert said in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.full
@pytest.mark.slow
def test_a_budget_under_the_parameters_says_what_the_plan_that_saves_most_would_need(
    capsys, tmp_path
):
    argv = [
        "advise",
        str(tiny_suite(tmp_path, "bert-tiny")),
        "--device",
        "cpu",
        "--budget",
        "64KiB",
        "--jobs",
        "1",
        "--results",
        str(tmp_path / "none"),
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert (
        "Nothing fits 0.00 GiB. The plan that saves most" in out
        and "even a batch of one does not fit" in out
    )
    assert not (tmp_path / "out").exists()  # no suite file of plans that do not fit


@pytest.mark.full
@pytest.mark.slow
def test_advice_on_a_card_keeps_the_plans_whose_step_its_allocator_holds(
    capsys, tmp_path, monkeypatch
):
    """--card: each plan's step is replayed through the caching allocator on the card; the plans
    listed are those it holds, each with its largest batch there."""
    seen = []
    real = search.Searcher.walk

    def walk(self, *args, **kwargs):
        found = real(self, *args, **kwargs)
        seen.extend(found.fits)
        return found

    monkeypatch.setattr(search.Searcher, "walk", walk)
    argv = [
        "advise",
        "bert-tiny",
        "--card",
        "t4",
        "--jobs",
        "1",
        "--top",
        "2",
        "--out",
        str(tmp_path),
    ]
    argv += ["--results", str(tmp_path / "none")]
    assert main(argv) == 0
    assert seen and all(
        c.predicted.card == "NVIDIA T4" and c.predicted.verdict == "fits" for c in seen
    )
    assert "budget NVIDIA T4" in capsys.readouterr().out


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.parametrize("model", list(TINY))
def test_at_60_percent_the_measured_top_plan_fits(model, capsys, tmp_path):
    # Memory is the exact proxy held here. Whether the top plan's speed is within 10% of the best is
    # a timing, held at full size by make perf (tests/perf/test_advise.py): a tiny model's 6 steps
    # last ~40 ms, and among other tests' processes on two cores one plan measured 78% of another
    # that it beat by 18% on the quiet machine.
    argv = [
        "advise",
        str(tiny_suite(tmp_path, model)),
        "--device",
        "cpu",
        "--budget",
        "60%",
        "--top",
        "3",
        "--measure",
        "--jobs",
        "1",
        "--results",
        str(evidence(tmp_path)),
        "--out",
        str(tmp_path),
    ]
    code = main(argv)
    out = capsys.readouterr().out
    assert "fits as measured here" in out, out
    assert code in (0, 1)  # 1: the top plan fit, but its speed fell short: the timing above
    written = load(tmp_path / f"advice-{model}.toml")
    assert written.runs[0].name == "baseline" and 2 <= len(written.runs) <= 4
    assert all(r.model == model for r in written.runs)


@pytest.mark.full
@pytest.mark.slow
def test_max_batch_ranks_by_the_largest_batch_and_writes_each_plan_at_it(capsys, tmp_path):
    argv = [
        "advise",
        str(tiny_suite(tmp_path, "bert-tiny")),
        "--device",
        "cpu",
        "--budget",
        "60%",
        "--max-batch",
        "--top",
        "2",
        "--jobs",
        "1",
        "--results",
        str(tmp_path / "none"),
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    rows = [
        line.split(" | ")
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| 1 |") or line.startswith("| 2 |")
    ]
    largest = [int(r[4]) for r in rows]
    assert largest == sorted(largest, reverse=True) and largest[0] > 32
    runs = {r.name: r for r in load(tmp_path / "advice-bert-tiny.toml").runs}
    assert runs[rows[0][1]].cpu.batch_size == largest[0]  # written at its largest batch
    assert runs["baseline"].cpu.batch_size == 32


@pytest.mark.slow
def test_a_cpu_without_native_bf16_is_advised_no_bf16_plan(monkeypatch, capsys, tmp_path):
    # Its kernels emulate bf16: a BERT-base step took minutes where fp32's took 11 s.
    monkeypatch.setenv(CPU_BF16, "emulated")
    monkeypatch.setattr(
        advise, "time_factors", lambda *a: pytest.fail("nothing to time without bf16")
    )
    argv = [
        "advise",
        str(tiny_suite(tmp_path, "bert-tiny")),
        "--device",
        "cpu",
        "--budget",
        "60%",
        "--top",
        "5",
        "--jobs",
        "1",
        "--results",
        str(tmp_path / "none"),
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    said = capsys.readouterr().err  # the figures' sources, the options dropped among them
    assert f"amp-bf16: {advise.EMULATED}" in said and f"bf16-pure: {advise.EMULATED}" in said
    assert not any(
        t.name in ("amp", "bf16")
        for r in load(tmp_path / "advice-bert-tiny.toml").runs
        for t in r.techniques
    )
    amp = Option.of("amp-bf16", "amp", "bfloat16", dtype="bfloat16")
    # a card is asked about from afar: nothing of this CPU applies
    assert advise._unfit("cuda")(amp) == []


@pytest.mark.parametrize("ratio, bf16_first", [(0.25, True), (8.0, False)])
def test_on_a_cpu_with_native_bf16_its_plans_are_priced_by_their_steps_timed_here(
    ratio, bf16_first, monkeypatch, capsys, tmp_path
):
    # An AVX-512 bf16 CPU, where no record of this very CPU priced bf16: its plans had ranked last
    # as assumed, and the top plan measured 34% of a bf16 plan's throughput. They are priced by
    # their steps as timed here.
    monkeypatch.setenv(CPU_BF16, "native")
    timed = []
    monkeypatch.setattr(
        advise,
        "time_factors",
        lambda base, options: timed.append(sorted(options)) or {name: ratio for name in options},
    )
    argv = [
        "advise",
        str(tiny_suite(tmp_path, "bert-tiny")),
        "--device",
        "cpu",
        "--budget",
        "60%",
        "--top",
        "5",
        "--jobs",
        "1",
        "--results",
        str(tmp_path / "none"),
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    top = rows[0].split(" | ")
    assert ("bf16" in top[1]) == bf16_first, out
    assert "assumed" not in out, out  # no plan rests on a guess, so none ranks last for it
    assert timed == [["amp-bf16", "bf16-pure"]]  # once, the dtype options only
    if bf16_first:
        assert top[-1].startswith("timed here") or "+ timed here" in top[-1], out
        assert f"{1 / ratio:.2f}× timed on this device" in err


@pytest.mark.parametrize("tolerance, lossy_first", [(None, False), ("20", True)])
def test_a_known_loss_outside_the_seed_band_ranks_last_unless_a_tolerance_accepts_it(
    tolerance, lossy_first, monkeypatch, capsys, tmp_path
):
    # bf16-pure, timed 4× faster here, lost 15 points on this model's records: by default it ranks
    # after every plan without such a loss; --tolerance-pt 20 accepts it, and speed ranks it first.
    monkeypatch.setenv(CPU_BF16, "native")
    monkeypatch.setattr(
        advise, "time_factors", lambda base, options: {"amp-bf16": 0.5, "bf16-pure": 0.25}
    )
    # no step to calibrate prices with: accuracy is what is read here
    untimed = {"step_time_ms_median": None}
    write(
        tmp_path / "results",
        [
            record(
                "s",
                "baseline",
                "bert-tiny",
                "cpu-x",
                [],
                10.0,
                0.90,
                accuracy_seeds=[0.90, 0.89],
                **untimed,
            ),
            record("s", "bf16-pure", "bert-tiny", "cpu-x", [("bf16", {})], 10.0, 0.75, **untimed),
        ],
    )
    argv = [
        "advise",
        str(tiny_suite(tmp_path, "bert-tiny")),
        "--device",
        "cpu",
        "--budget",
        "60%",
        "--top",
        "3",
        "--jobs",
        "1",
        "--results",
        str(tmp_path / "results"),
        "--out",
        str(tmp_path),
    ]
    assert main(argv + (["--tolerance-pt", tolerance] if tolerance else [])) == 0
    out = capsys.readouterr().out
    rows = [
        line.split(" | ")
        for line in out.splitlines()
        if line.startswith("| ") and line[2].isdigit()
    ]
    assert ("bf16-pure" in rows[0][1]) == lossy_first, out
    assert ("⚠ -15.0 pt" in rows[0][6]) == lossy_first, out


def test_when_the_baseline_fits_advice_says_so_before_any_plan(capsys, tmp_path):
    argv = [
        "advise",
        str(tiny_suite(tmp_path, "bert-tiny")),
        "--device",
        "cpu",
        "--budget",
        "150%",
        "--top",
        "2",
        "--jobs",
        "1",
        "--results",
        str(tmp_path / "none"),
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.index("The baseline already fits") < out.index("| 1 |")
