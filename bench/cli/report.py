"""``bench report``, ``overview`` and ``compare``: pages from stored records, no run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.errors import BadInput


def add(sub: argparse._SubParsersAction) -> None:
    """The parsers of report, overview and compare."""
    rep = sub.add_parser("report", help="tables and plots from stored results (no torch run)")
    rep.add_argument("suite", help="suite name, or a results/<suite> folder")
    rep.add_argument("--results", type=Path, default=Path("results"))
    rep.set_defaults(func=_report)
    ovr = sub.add_parser(
        "overview", help="one page over every suite: the best combination per model"
    )
    ovr.add_argument("--results", type=Path, default=Path("results"))
    ovr.set_defaults(func=_overview)
    cmp = sub.add_parser(
        "compare", help="per-run changes between two result folders, regressions flagged"
    )
    cmp.add_argument(
        "a", type=Path, help="results/, results/<suite>/ or results/<suite>/<device>/ (before)"
    )
    cmp.add_argument("b", type=Path, help="the same for the other side (after)")
    cmp.add_argument(
        "--device", help="where a folder holds several devices: which one (part of its name)"
    )
    cmp.add_argument(
        "--out", type=Path, default=Path("results/compare"), help="folder for compare.{md,csv,png}"
    )
    cmp.add_argument(
        "--strict",
        nargs="?",
        const="all",
        metavar="KINDS",
        help="exit 1 when a run regressed (for CI); KINDS limits it to some of memory, throughput, "
        "accuracy: 'memory,accuracy' on a shared machine whose load moves throughput",
    )
    cmp.set_defaults(func=_compare)


def _report(args: argparse.Namespace) -> int:
    from bench.report import build_report
    from bench.results import writable

    # A suite's name reads --results/NAME, even where ./NAME is a folder; a path (with a slash) is
    # read as given.
    if "/" in args.suite and Path(args.suite).is_dir():
        folder = Path(args.suite)
    else:
        folder = args.results / args.suite
    if folder.is_dir():
        writable(folder, "the report", "--results FOLDER (a writable copy)")
    for path in build_report(folder):
        print(path)
    return 0


def _overview(args: argparse.Namespace) -> int:
    from bench.report.overview import build_overview
    from bench.results import writable

    writable(args.results / "overview", "the overview", "--results FOLDER (a writable copy)")
    for path in build_overview(args.results):
        print(path)
    return 0


def _compare(args: argparse.Namespace) -> int:
    from bench.report import compare
    from bench.results import writable

    # --strict alone gates every kind; --strict KINDS those named; no --strict, none.
    gate = set(compare.REGRESSIONS if args.strict == "all" else (args.strict or "").split(",")) - {
        ""
    }
    if unknown := sorted(gate - set(compare.REGRESSIONS)):
        raise BadInput(
            f"--strict {args.strict}: unknown {', '.join(map(repr, unknown))}; expected some of "
            f"{', '.join(compare.REGRESSIONS)}, comma-separated, after the two folders"
        )
    writable(args.out, "the comparison", "--out FOLDER")
    a, b = compare.load_side(args.a, args.device), compare.load_side(args.b, args.device)
    table = compare.compare(a, b)
    if table.empty:
        raise BadInput(f"no run (suite and name) is in both {args.a} and {args.b}")
    written = compare.write(table, (args.a, a), (args.b, b), args.out)
    print(written[0].read_text(encoding="utf-8"))
    for line in compare.unmatched(a, b):
        print(line, file=sys.stderr)
    print(f"written: {', '.join(str(p) for p in written)}", file=sys.stderr)
    if any(gate & set(r.split(", ")) for r in table["regression"]):
        return 1
    return 0
