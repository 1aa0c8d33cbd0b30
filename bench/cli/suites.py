"""``bench validate``, ``bench list`` and ``bench suite``: suite files checked, models and
techniques listed, and a suite written from a job's files."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from bench.cli.common import job_flags, job_suite, suite_path
from bench.errors import EXIT_BAD_INPUT, BadInput, SuiteError


def add(sub: argparse._SubParsersAction) -> None:
    """The parsers of validate, list and suite."""
    val = sub.add_parser("validate", help="check suite files; every problem at once")
    val.add_argument("suites", nargs="*", help="suite names or files (default: suites/*.toml)")
    val.set_defaults(func=_validate)
    lst = sub.add_parser("list", help="models and techniques with their options")
    lst.add_argument(
        "--docs",
        type=Path,
        metavar="PAGE",
        help="rewrite the techniques table in PAGE (between its markers) from the registry "
        "instead: make docs",
    )
    lst.add_argument(
        "--held",
        type=Path,
        metavar="PAGE",
        help=(
            "rewrite the table of committed GPU records against their predictions in PAGE: make "
            "docs"
        ),
    )
    lst.add_argument(
        "--keys",
        type=Path,
        metavar="PAGE",
        help="rewrite the reference of a suite file's keys in PAGE (between its markers) from "
        "bench/suite/schema.py instead: make docs",
    )
    lst.add_argument(
        "--predictions-schema",
        type=Path,
        metavar="FILE",
        help="write the JSON Schema of bench predict --json's document to FILE: make docs",
    )
    lst.add_argument(
        "--advice-schema",
        type=Path,
        metavar="FILE",
        help="write the JSON Schema of bench advise --json's document to FILE: make docs",
    )
    lst.set_defaults(func=_list)
    new = sub.add_parser(
        "suite",
        help="write the suite a job's files describe (--hf config.json, --training-args, "
        "--adapter-config), to keep and edit",
    )
    job_flags(new, suite=False)
    new.add_argument(
        "--out",
        type=Path,
        default=Path("suites"),
        help="folder for hf-<model>.toml (default: suites)",
    )
    new.set_defaults(func=_suite, suite=None)


def _validate(args: argparse.Namespace) -> int:
    # before torch
    paths = [suite_path(p) for p in args.suites] or sorted(Path("suites").glob("*.toml"))
    from bench import suite as suites

    failed = 0
    for path in paths:
        try:
            s = suites.load(path)
            print(f"ok: {path} ({s.model}, {len(s.runs)} runs)")
        except SuiteError as exc:
            print(exc, file=sys.stderr)
            failed += 1
    if failed:
        return EXIT_BAD_INPUT
    return 0


def _list(args: argparse.Namespace) -> int:
    from bench.models import MODELS
    from bench.techniques import TECHNIQUES, TRAIN
    from bench.techniques.base import options_doc

    pages = (args.docs, args.held, args.keys, args.predictions_schema, args.advice_schema)
    if any(pages):
        from bench.advise import document as advice
        from bench.predict import document, held
        from bench.suite import schema
        from bench.techniques import catalogue

        for page, write in (
            (args.docs, catalogue.write),
            (args.held, lambda p: held.write(p, Path("results"))),
            (args.keys, schema.write),
            (args.predictions_schema, lambda p: document.written(p, document.schema())),
            (args.advice_schema, lambda p: document.written(p, advice.schema())),
        ):
            if page:
                print(write(page))
        return 0
    print(
        "models:",
        ", ".join(MODELS.names()),
        "(or 'hf:PATH' for a Hugging Face config.json, or 'module:NAME' naming your own "
        "bench.models.ModelSpec)",
    )
    print("techniques:")
    for name in TECHNIQUES:
        cls = TECHNIQUES.get(name)
        if cls.modes == TRAIN:
            modes = ""
        else:
            modes = f" [{', '.join(sorted(cls.modes))}]"
        print(f"  {name}: {cls.summary}{modes}")
        for opt, kind, default, doc in options_doc(cls):
            print(f"      {opt} ({kind}, default {default!r}): {doc}")
    return 0


def _suite(args: argparse.Namespace) -> int:
    from bench import suite as suites
    from bench.results import writable
    from bench.suite import from_config

    if not (args.hf or args.job):
        raise BadInput(
            "--hf PATH: the Hugging Face config.json (or its folder) the suite is for (or --job "
            "FILE: a job file)"
        )
    if args.job:
        from bench.suite import job_file

        named = job_file.name_of(job_file.read(Path(args.job)), Path(args.job))
    else:
        named = from_config.name_of(args.hf)
    target = args.out / f"{named}.toml"
    if target.exists():
        raise BadInput(f"{target} exists; edit it, or give --out another folder")
    writable(args.out, "the suite file", "--out FOLDER")
    written = job_suite(args, args.out)
    try:
        suites.load(written)  # every problem of the files said now, as the loader says it
    except SuiteError:
        written.unlink()  # nothing half-written: nor the files a job file was read into
        shutil.rmtree(written.with_suffix(""), ignore_errors=True)
        raise
    if written.parent == Path("suites"):
        name = written.stem
    else:
        name = written
    print(f"written: {written} (make predict SUITE={name}, make bench SUITE={name})")
    return 0
