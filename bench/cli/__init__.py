"""Command line: python -m bench
{run,campaign,predict,fit,advise,report,overview,compare,validate,list}. One module per family of
commands, each adding its own parsers (``add``); the logic each calls lives with its package."""

from __future__ import annotations

import argparse
import os
import sys

from bench.cli import advise, predict, report, suites, sweep
from bench.errors import EXIT_BAD_INPUT, BadInput, SuiteError

__all__ = ["EXIT_BAD_INPUT", "interrupt", "main"]


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, os.getcwd())  # user techniques named "module:Class" import from here
    args = parser().parse_args(argv)
    if argv is None:
        args.argv = sys.argv[1:]
    else:
        args.argv = argv
    try:
        return args.func(args)
    except SuiteError as exc:
        print(exc, file=sys.stderr)
        return EXIT_BAD_INPUT
    except (BadInput, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        if args.sweeping:
            stored = ": finished runs are stored; run the same command again to resume"
        else:
            stored = ""
        print(f"\ninterrupted{stored}", file=sys.stderr)
        return 130


def interrupt(signum: int, frame: object) -> None:
    """SIGTERM (kill, a scheduler's time limit) stops a sweep as Ctrl-C does: the running run's
    process group is killed on the way out and finished records are kept."""
    raise KeyboardInterrupt


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench", description="Benchmark memory-saving PyTorch training techniques."
    )
    p.set_defaults(sweeping=False)
    sub = p.add_subparsers(required=True, metavar="COMMAND")
    for family in (sweep, report, predict, advise, suites):
        family.add(sub)
    return p
