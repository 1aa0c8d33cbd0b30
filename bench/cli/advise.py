"""``bench advise``: the cheapest plans that fit a budget, written as a suite, measured here on
request."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from bench.cli.common import JOBS, local, points, positive, refuse_unusable_flags, world_size
from bench.errors import BadInput
from bench.record import Record


def add(sub: argparse._SubParsersAction) -> None:
    """The parser of advise."""
    adv = sub.add_parser(
        "advise",
        help="the cheapest plans that make a model fit a budget: a ranked table, and "
        "suites/advice-MODEL.toml to measure them",
    )
    adv.add_argument(
        "model",
        help="a model (bench list), module:NAME, or a suite file whose model and shapes to take",
    )
    adv.add_argument(
        "--budget",
        help="the card's memory, e.g. 24GiB (on CUDA less --reserve), or a share of the baseline's "
        "predicted peak, e.g. 60%%",
    )
    adv.add_argument(
        "--card",
        metavar="NAME",
        help="a card (rtx4090, a100-80gb, h100, …) instead of --budget: a plan fits where its "
        "step, replayed through the caching allocator on the card, does; one that fits only after "
        "cache flushes ranks after those that fit cleanly",
    )
    size = adv.add_mutually_exclusive_group()
    size.add_argument(
        "--batch", type=positive, help="the batch per process (default: the shapes' own)"
    )
    size.add_argument(
        "--max-batch", action="store_true", help="rank plans by the largest batch each fits"
    )
    adv.add_argument(
        "--nproc",
        type=world_size,
        default=1,
        metavar="N",
        help="processes the plans span (adds ddp or fsdp to every plan; the budget is each rank's)",
    )
    mode = adv.add_mutually_exclusive_group()
    mode.add_argument(
        "--train", dest="mode", action="store_const", const="train", help="training steps (default)"
    )
    mode.add_argument(
        "--infer", dest="mode", action="store_const", const="inference", help="inference only"
    )
    adv.add_argument(
        "--tolerance-pt",
        type=points,
        metavar="X",
        help=(
            "drop plans whose techniques lost more than X accuracy points in committed fidelity "
            "records"
        ),
    )
    adv.add_argument("--top", type=positive, default=5, help="plans listed and written (default 5)")
    adv.add_argument(
        "--json",
        action="store_true",
        help="one JSON document on stdout in place of the table (docs/results.md; its schema "
        "docs/advice.schema.json): the plans, their predictions, the search, the assumptions",
    )
    adv.add_argument(
        "--measure",
        action="store_true",
        help="measure the listed plans here and report, predicted against measured, whether each "
        "fit and how it ranked",
    )
    adv.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help=(
            "cuda (default): a card, at GPU shapes, predicted anywhere; cpu: this machine at CPU "
            "shapes"
        ),
    )
    adv.add_argument(
        "--reserve",
        default=None,
        help="CUDA: held back from --budget for the context and workspaces (default 1280MiB)",
    )
    adv.add_argument(
        "--link-gbps",
        type=float,
        metavar="GB/S",
        help="device-host bandwidth for offloading (default: 25, PCIe 4.0 x16)",
    )
    adv.add_argument(
        "--jobs",
        type=positive,
        default=JOBS,
        help="processes predicting at once (default: the cores, at most 4)",
    )
    adv.add_argument(
        "--results", type=Path, default=Path("results"), help="committed records read as evidence"
    )
    adv.add_argument(
        "--out", type=Path, default=Path("suites"), help="folder for advice-MODEL.toml"
    )
    adv.set_defaults(func=_advise)


# what a plan predicted at this machine's own shapes (--device cpu) takes for granted
CPU_ASSUMED = "each step on fake CPU tensors, counted as the tracker counts a real one here"


def _advise(args: argparse.Namespace) -> int:
    from bench.advise import advise, source, write
    from bench.predict import RESERVE, Budget, cards
    from bench.results import writable

    if args.reserve and args.device != "cuda":
        raise BadInput(
            f"--reserve {args.reserve} is held back on a CUDA card; leave it out with --device cpu"
        )
    if args.measure:
        args.slurm, args.snapshot = None, False
        refuse_unusable_flags(args)
    if (args.card is None) == (args.budget is None):
        raise BadInput("give one of --budget SIZE and --card NAME")
    if args.card and args.device != "cuda":
        raise BadInput(f"--card {args.card} is a CUDA card; leave out --device {args.device}")
    try:
        if args.card:
            budget = Budget.of_card(cards.card(args.card))
        else:
            budget = Budget.parse(args.budget, args.device, args.reserve or RESERVE, share=True)
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    src = source(args.model, args.mode, args.batch, args.device)
    writable(args.out, "the advice suite file", "--out FOLDER")  # before the search, not after it
    advice = advise(
        src,
        budget,
        device_type=args.device,
        nproc=args.nproc,
        top=args.top,
        tolerance_pt=args.tolerance_pt,
        max_batch=args.max_batch,
        results=args.results,
        jobs=args.jobs,
        link_gbps=args.link_gbps,
    )
    if args.json:
        import json

        from bench.advise.document import document
        from bench.predict import ASSUMPTIONS
        from bench.provenance import git_revision

        assumed = ASSUMPTIONS if args.device == "cuda" else CPU_ASSUMED
        print(json.dumps(document(advice, assumed, git_revision()), indent=2))
    else:
        print(write.table(advice))
    print("\nFigures:\n" + write.sources(advice), file=sys.stderr)
    if not advice.plans:
        return 1
    path = write.suite_file(advice, "bench " + shlex.join(args.argv), args.out)
    print(f"\nwritten: {path} (make bench SUITE={path.stem})", file=sys.stderr)
    if args.measure:
        return _measure_advice(advice, path, args)
    return 0


def _measure_advice(advice: object, path: Path, args: argparse.Namespace) -> int:
    """The advice suite measured here, without fidelity phases, then predicted against measured;
    exit 1 unless the top plan fits as measured and its throughput is within 10% of the best of the
    listed plans that fit."""
    from bench import suite as suites
    from bench.advise import write
    from bench.sweep import sweep

    args.predict_jobs, args.launcher, args.torchrun = None, "fork", ""
    suite = suites.without_fidelity(suites.load(path))
    stored = sweep(suite, local(args), args.results, fidelity=False)
    records = [Record.from_flat(r) for r in stored]
    print(write.measured(advice, records))
    if write.top_holds(advice, records):
        return 0
    return 1
