"""``bench predict`` (fake tensors, no GPU) and ``bench fit`` (the largest batch, measured)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from bench.cli.common import (
    JOBS,
    job_flags,
    job_suite,
    positive,
    refuse_unusable_flags,
    selected,
    suite_path,
    world_size,
)
from bench.errors import BadInput
from bench.record import Record, Status
from bench.spec import MAX_NPROC, ORDERS

if TYPE_CHECKING:  # imported when a command runs: torch comes with it
    import pandas as pd

    from bench.fit import Fit
    from bench.predict.cards import Card
    from bench.suite import Suite


def add(sub: argparse._SubParsersAction) -> None:
    """The parsers of predict and fit."""
    pre = sub.add_parser(
        "predict", help="predicted peak memory at GPU shapes, on this machine (fake tensors)"
    )
    job_flags(pre)
    pre.add_argument(
        "--budget",
        help="the card's memory, e.g. 16GiB: which runs fit, and the largest batch that does",
    )
    pre.add_argument(
        "--reserve",
        help="held back from the budget for the CUDA context and the allocator's workspaces "
        "(default 1280MiB: the H100 records' context and workspaces; 0: none)",
    )
    pre.add_argument(
        "--card",
        metavar="NAME",
        help="a card (rtx4090, a100-80gb, h100, …): each step replayed through the caching "
        "allocator under its memory less the CUDA context: fits, fits after cache flushes, or out "
        "of memory at a phase; and the largest batch it holds",
    )
    pre.add_argument(
        "--longest",
        action="store_true",
        help="with --card or --budget: the longest seq_len each training or forward run holds at "
        "its batch, in steps of 256 tokens up to the model's positions (a generation suite "
        "answers its longest context without it)",
    )
    pre.add_argument(
        "--worst-step",
        action="store_true",
        help="each run on variable-length data predicted at its epoch's worst batch, the one of "
        "most padded tokens as its collator forms the epoch (and, with --card or --budget, the "
        "largest batch whose worst step fits): which step it is, and its peak",
    )
    pre.add_argument(
        "--epoch",
        nargs="?",
        const="loader",
        metavar="ORDER",
        choices=(*ORDERS, "worst"),
        help="each run on variable-length data predicted over a whole pass of its data, every "
        "batch in the order its loader forms them (or ORDER: ascending, descending, longest-last, "
        "or worst: each of those and the loader's, the one that does worst kept), through one "
        "replay of the caching allocator: with --card, the first step whose request the card "
        "cannot hold, and whether expandable_segments or max_split_size_mb would hold it",
    )
    pre.add_argument(
        "--json",
        action="store_true",
        help="one JSON document on stdout in place of the table (docs/results.md; its schema "
        "docs/predictions.schema.json): every figure, each run's answers and verdict, the "
        "assumptions and how it was made",
    )
    pre.add_argument("--only", metavar="PATTERNS", help="comma-separated run names or globs")
    pre.add_argument(
        "--results", type=Path, default=Path("results"), help="where GPU measurements are read from"
    )
    pre.add_argument(
        "--jobs",
        type=positive,
        default=JOBS,
        help="processes predicting at once (default: the cores, at most 4; each takes about 1 GB)",
    )
    pre.add_argument(
        "--nproc",
        type=world_size,
        metavar="N",
        help="the processes every ddp, fsdp or tensor-parallel entry spans (default: its nproc): "
        f"each rank's peak and traffic under a fake process group, 2 to {MAX_NPROC:,}",
    )
    pre.add_argument(
        "--zero-stages",
        action="store_true",
        help="each DeepSpeed entry at ZeRO stages 1, 2 and 3, a row each (<run>-zero<stage>; "
        "offload_param, stage 3's alone, left out below it): with --card, the fewest such cards "
        "at each stage",
    )
    pre.add_argument(
        "--breakdown",
        action="store_true",
        help="what is alive at each run's peak, by kind (parameters, gradients, optimizer state, "
        "activations, temporaries)",
    )
    pre.set_defaults(func=_predict)
    fit = sub.add_parser(
        "fit",
        help=(
            "the largest batch that really fits a budget, measured in probes, beside the predicted "
            "one"
        ),
    )
    fit.add_argument("suite", help="suite name (suites/NAME.toml) or path")
    fit.add_argument(
        "--budget",
        help="the card's memory, e.g. 16GiB (on CUDA less --reserve is left to tensors; on a CPU, "
        "tracked tensor bytes)",
    )
    fit.add_argument(
        "--card",
        metavar="NAME",
        help="instead of --budget, on a GPU: a card (rtx4090, a100-40gb, …) whose capacity caps "
        "the probes' allocator, beside the largest batch predicted by replaying the step on it",
    )
    fit.add_argument(
        "--reserve",
        default=None,
        help="CUDA: held back for the context and workspaces (default 1280MiB)",
    )
    fit.add_argument("--only", metavar="PATTERNS", help="comma-separated run names or globs")
    fit.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    fit.add_argument("--results", type=Path, default=Path("results"))
    fit.set_defaults(func=_fit)


def _lengthened(suite: Suite, capped: bool) -> None:
    """BadInput where ``--longest`` has nothing to search: no card or budget to hold a length to,
    or a model that takes no sequence (no positions in its config)."""
    from bench.predict.budget import positions

    if not capped:
        raise BadInput(
            "--longest searches the longest sequence a card holds: give --card or --budget"
        )
    try:
        positions(suite.runs[0])
    except AttributeError:
        raise BadInput(
            f"--longest: {suite.runs[0].model} takes no sequence (its config gives no "
            "max_position_embeddings); --card alone gives the largest batch"
        ) from None


def _predict(args: argparse.Namespace) -> int:
    path = job_suite(args)
    from bench import suite as suites
    from bench.predict import ASSUMPTIONS, RESERVE, Budget, cards, markdown, suite_table
    from bench.results import load_records

    reserve = args.reserve or RESERVE
    if args.reserve and not args.budget:  # else it would be taken and ignored
        raise BadInput(f"--reserve {args.reserve} is held back from a --budget, and none was given")
    if args.card and args.budget:
        raise BadInput("--card and --budget: give one (a card's memory is its budget)")
    try:
        if args.budget is not None:
            budget = Budget.parse(args.budget, "cuda", reserve).bytes()
        else:
            budget = None
        if args.card:
            card = cards.card(args.card)
        else:
            card = None
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    suite = selected(path, args)
    if args.longest:
        _lengthened(suite, budget is not None or card is not None)
    if args.worst_step and args.epoch:
        raise BadInput("--worst-step and --epoch: one step, or all of them; give one")
    for flag, shapes in (("--worst-step", "worst_step"), ("--epoch", "epoch")):
        if not getattr(args, shapes):
            continue
        if not any(r.gpu.lengths for r in suite.runs):
            raise BadInput(
                f"{flag}: no run of {suite.name} takes variable-length data (lengths in "
                "[shapes.gpu]); every step of a fixed-shape run is alike"
            )
        order = {"epoch_order": args.epoch} if shapes == "epoch" else {}
        suite = suites.varlen_steps(suite, **{shapes: True}, **order)
    if args.nproc:
        suite = suites.spanning(suite, args.nproc)
    if args.zero_stages:
        if not any(t.name == "deepspeed" for r in suite.runs for t in r.techniques):
            raise BadInput(f"--zero-stages: no run of {suite.name} uses deepspeed")
        suite = suites.zero_stages(suite)
    stored = map(Record.from_flat, load_records(args.results / suite.name))
    measured = {
        r.identity.run: r
        for r in stored
        if r.identity.device_type == "cuda" and r.outcome.status == Status.OK and r.identity.run_key
    }
    print(
        f"{suite.name}: predicting {len(suite.runs)} runs at GPU shapes (fake tensors, nothing "
        "allocated)",
        file=sys.stderr,
    )
    if budget is not None:
        print(
            f"budget {args.budget} less {reserve} for the CUDA context and the allocator's "
            f"workspaces (--reserve): {budget / 2**30:.2f} GiB for tensors",
            file=sys.stderr,
        )
    if card is not None:
        print(
            f"{card.name}: {card.memory / 2**30:.2f} GiB as CUDA sees it ({card.memory_source}) "
            f"less {card.context / 2**20:,.0f} MiB for the CUDA context ({card.context_source}): "
            f"{card.capacity / 2**30:.2f} GiB for the allocator",
            file=sys.stderr,
        )
    table = suite_table(
        list(suite.runs), measured, budget, jobs=args.jobs, card=card, longest=args.longest
    )
    if args.json:
        import json

        from bench.predict.document import document
        from bench.provenance import git_revision

        made = document(
            table,
            suite.name,
            card=card,
            budget=budget,
            assumptions=ASSUMPTIONS,
            revision=git_revision(),
        )
        print(json.dumps(made, indent=2))
    else:
        print(markdown(table, args.breakdown))
    # a suite file, whole: its report
    whole = not (args.only or args.nproc or args.hf or args.job or args.zero_stages)
    if whole and budget is None and card is None:
        import torch

        from bench.predict.table import save
        from bench.provenance import git_revision
        from bench.results import PREDICTED

        path = save(table, args.results / suite.name / PREDICTED, git_revision(), torch.__version__)
        print(
            f"\nwritten: {path} (its report shows the runs no GPU has measured yet)",
            file=sys.stderr,
        )
    if card is not None and not args.zero_stages:  # the suite's own entries' answers alone
        _card_answers_saved(table, args.results / suite.name, args.card, card)
    if any(r.nproc > 1 for r in suite.runs):
        print(
            "\nRanks: each multi-process entry is predicted as rank 0 under a fake process group; "
            "the other ranks run the same program on their own shards (fsdp's last ranks may hold "
            "a few padding elements less; under deepspeed a rank may hold more than rank 0 where "
            "its partition's boundaries fall: dist-smoke's zero-2, rank 1 3.4% more). Traffic is "
            "what a rank sends per step, as a ring moves it, and it receives as much.",
            file=sys.stderr,
        )
    print(f"\nAssumed: {ASSUMPTIONS}.", file=sys.stderr)
    return 0


def _card_answers_saved(table: pd.DataFrame, folder: Path, named: str, card: Card) -> None:
    """What a card's searches found, kept beside the suite's records for its report: a
    generation's longest contexts, a training step's lengths predicted on the way to its longest
    sequence."""
    import torch

    from bench.predict.table import save_contexts, save_curves
    from bench.provenance import git_revision
    from bench.results import CONTEXTS, CURVES

    card_name, revision = named.strip().lower(), git_revision()
    if "longest_context" in table:
        where = folder / CONTEXTS.format(card=card_name)
        path = save_contexts(table, where, card, revision=revision, torch_version=torch.__version__)
        print(
            f"\nwritten: {path} (the report says which run holds the longest context)",
            file=sys.stderr,
        )
    if "length_curve" in table and table["length_curve"].notna().any():
        where = folder / CURVES.format(card=card_name)
        path = save_curves(table, where, card, revision=revision, torch_version=torch.__version__)
        print(f"\nwritten: {path} (its report plots each length against the card)", file=sys.stderr)


def _fit(args: argparse.Namespace) -> int:
    path = suite_path(args.suite)  # before torch is imported
    from bench.fit import fit_suite
    from bench.launch import detect
    from bench.predict import RESERVE, Budget, cards

    args.slurm, args.snapshot = None, False
    refuse_unusable_flags(args)
    if (args.card is None) == (args.budget is None):
        raise BadInput("give one of --budget SIZE and --card NAME")
    device = detect(args.device)
    if args.card and device.type != "cuda":
        raise BadInput(
            f"--card {args.card}: a card's allocator is capped on a GPU; this is {device.name}"
        )
    try:
        if args.card:
            card = cards.card(args.card)
        else:
            card = None
        if card:
            budget = card.capacity
        else:
            budget = Budget.parse(args.budget, device.type, args.reserve or RESERVE).bytes()
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    suite = selected(path, args)
    runs = [r for r in suite.runs if r.mode == "train" and r.nproc == 1]
    fits = fit_suite(runs, device, budget, args.results, card=card)
    print("| run | measured largest batch | predicted | prediction |\n|---|---|---|---|")
    for f in fits:
        measured, predicted = f.measured_largest_batch, f.predicted_largest_batch
        print(f"| {f.run} | {measured} | {predicted} | {_fit_verdict(f)} |")
    if any(f.promises_oom or f.status != Status.OK for f in fits):
        return 1
    return 0


def _fit_verdict(fit: Fit) -> str:
    """How the predicted largest batch stands against the measured one."""
    if fit.status != Status.OK:
        return "error: " + fit.message
    if fit.measured_largest_batch is None:
        return "nothing fits"
    if fit.promises_oom:
        return "⚠ promises an OOM"
    if fit.close_below:
        return "within 5% below"
    return "safe, more than 5% below"
