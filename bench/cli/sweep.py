"""``bench run`` and ``bench campaign``: suites measured, then every page their records feed
rebuilt."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from bench.cli.common import (
    job_flags,
    job_suite,
    local,
    refuse_unusable_flags,
    selected,
    suite_path,
    sweep_flags,
    sweep_options,
)
from bench.errors import BadInput
from bench.record import KEY, Status

if TYPE_CHECKING:
    from bench.spec import Suite

# make gpu's order: the training suites (with their fidelity phases), then inference and generation,
# then the small ones.
CAMPAIGN = (
    "resnet",
    "vit",
    "bert",
    "resnet-infer",
    "vit-infer",
    "bert-infer",
    "bert-varlen",
    "llama",
    "llama-generate",
    "smoke",
    "dist-smoke",
)


def add(sub: argparse._SubParsersAction) -> None:
    """The parsers of run and campaign."""
    run = sub.add_parser("run", help="run (or resume) a suite and report it")
    job_flags(run)
    run.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    run.add_argument(
        "--results", type=Path, default=Path("results"), help="results root (default: results)"
    )
    run.add_argument(
        "--only",
        metavar="PATTERNS",
        help="comma-separated run names or globs, e.g. 'baseline,amp-*'",
    )
    run.add_argument(
        "--all",
        action="store_true",
        help=(
            "every run of the suite on a CPU too, where its first_look names the runs a first look "
            "measures"
        ),
    )
    run.add_argument(
        "--snapshot",
        action="store_true",
        help="CUDA: save each run's instrumented step as <run>.snapshot.pickle for memory_viz",
    )
    sweep_flags(run)
    run.add_argument(
        "--torchrun",
        metavar="ARGS",
        default="",
        help="launcher arguments for multi-process runs instead of --standalone, e.g. '--nnodes 2 "
        "--rdzv-backend c10d --rdzv-endpoint node1:29500'",
    )
    run.add_argument(
        "--slurm",
        metavar="OPTIONS",
        help="submit each run as a Slurm job (submitit): 'partition=gpu,timeout_min=60,…'; "
        "'cluster=local' runs the jobs as local processes",
    )
    run.set_defaults(func=_run, sweeping=True)
    camp = sub.add_parser(
        "campaign",
        help="every default suite in one sweep, runs never measured here first (make gpu); "
        "resumes, with an ETA",
    )
    camp.add_argument(
        "suites", nargs="*", default=list(CAMPAIGN), help=f"default: {' '.join(CAMPAIGN)}"
    )
    camp.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    camp.add_argument(
        "--results", type=Path, default=Path("results"), help="results root (default: results)"
    )
    camp.add_argument(
        "--archive",
        type=Path,
        metavar="FILE.tgz",
        help="rewrite this archive of the suites' records on this device after every run (a leased "
        "machine that hands back one folder and may be cut off: $OUT/results.tgz)",
    )
    sweep_flags(camp)
    camp.set_defaults(func=_campaign, sweeping=True)


def _run(args: argparse.Namespace) -> int:
    path = job_suite(args)
    from bench.report.headline import answer
    from bench.report.tables import markdown, summary
    from bench.results import to_frame
    from bench.sweep import sweep

    refuse_unusable_flags(args)
    if args.all and args.only is not None:
        raise BadInput("--all and --only: give one, every run or the runs named")
    suite = selected(path, args)
    torchrun = tuple(shlex.split(args.torchrun))
    if args.slurm is not None:
        from bench.launch.slurm import Slurm, parse_options

        try:
            options = parse_options(args.slurm)
        except ValueError as exc:
            raise BadInput(str(exc)) from exc
        # the nodes', not this machine's
        if args.device == "auto":
            device_type = "cuda"
        else:
            device_type = args.device
        launcher = Slurm(device_type, args.results / suite.name / ".submitit", options, torchrun)
    else:
        launcher = local(args, torchrun)
    suite = _first_look(suite, args, launcher.device_type)
    records = sweep(suite, launcher, args.results, **sweep_options(args))
    table = summary(to_frame(records), suite.throughput)
    print(markdown(table))
    if launcher.device_name:
        # the answer the report opens with, for this device, where the user looks
        print("\n" + answer(table, launcher.device_name, len(suite.order or suite.runs)))
    # Every page the suite's records feed is kept current: the overview and results/figures.md read
    # them too.
    _pages(args.results, [suite.name])
    # oom, timeout and unsupported are findings about the configuration; error means something
    # broke.
    if any(r[KEY.status] == Status.ERROR for r in records):
        return 1
    return 0


def _first_look(suite: Suite, args: argparse.Namespace, device_type: str) -> Suite:
    """On a CPU, the runs the suite's first_look names, unless --all or --only says otherwise: a
    newcomer's first command took 19 minutes of a two-core machine for runs a GPU is there to
    measure."""
    if args.all or args.only is not None or device_type != "cpu" or not suite.first_look:
        return suite
    from bench import suite as suites

    chosen = suites.select(suite, list(suite.first_look))
    print(
        f"a first look on this CPU: {len(chosen.runs)} of the suite's {len(suite.runs)} runs (its "
        f"first_look); --all measures every run (make bench SUITE={suite.name} ARGS=--all)",
        file=sys.stderr,
    )
    return chosen


def _campaign(args: argparse.Namespace) -> int:
    paths = [suite_path(name) for name in args.suites]  # before torch is imported
    from bench.sweep import campaign

    args.slurm, args.snapshot = None, False
    refuse_unusable_flags(args)
    chosen = [selected(p, args) for p in paths]  # every file checked before anything runs
    # The archive is rewritten after every run: found unwritable after the first, the rest went
    # unmeasured.
    if args.archive is not None:
        _archive_writable(args.archive)
    launcher = local(args)
    records = campaign(
        chosen,
        launcher,
        args.results,
        never_measured_first=True,
        archive=args.archive,
        **sweep_options(args),
    )
    _pages(args.results, [s.name for s in chosen])
    if any(r[KEY.status] == Status.ERROR for rs in records.values() for r in rs):
        return 1
    return 0


def _archive_writable(archive: Path) -> None:
    """The archive's path names a file that can be written: a folder there took the first rename's
    traceback, with a temporary file left beside it and every later run unmeasured."""
    from bench.results import writable

    if archive.is_dir():
        raise BadInput(
            f"--archive {archive} is a folder; name a file to write, e.g. --archive "
            f"{archive / 'records.tgz'}"
        )
    writable(archive.parent, f"the archive {archive.name}", "--archive PATH")


def _pages(results: Path, suites: list[str]) -> None:
    """The suites' reports and the overview rebuilt after a sweep; a page that cannot be written (a
    disk that filled) is named, and the rest still are: the records are stored, and `make report`
    rebuilds it later."""
    from bench.report import build_report
    from bench.report.overview import build_overview

    jobs = [(f"the report of {s}", lambda s=s: build_report(results / s)) for s in suites]
    for what, build in [*jobs, ("the overview", lambda: build_overview(results))]:
        try:
            page = next(p for p in build() if p.suffix == ".html")  # the page to open
            print(f"{what}: {page}", file=sys.stderr)
        except OSError as exc:
            print(
                f"warning: {what} could not be written ({exc.strerror or exc}); the records are "
                "stored: run `make report SUITE=…` or `make overview` once it can be",
                file=sys.stderr,
            )
