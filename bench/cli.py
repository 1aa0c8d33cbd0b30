"""Command line: python -m bench {run,campaign,fit,advise,report,predict,overview,compare,validate,list}."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from bench.errors import BadInput, SuiteError, cannot_read
from bench.record import Status
from bench.spec import MAX_NPROC, MAX_TIMEOUT_S

if TYPE_CHECKING:
    from bench.launch import Launcher
    from bench.spec import Suite

EXIT_BAD_INPUT = 2
# make gpu's order: the training suites (with their fidelity phases), then inference, then the small ones.
CAMPAIGN = ("resnet", "vit", "bert", "resnet-infer", "vit-infer", "bert-infer", "bert-varlen", "llama", "smoke",
            "dist-smoke")


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, os.getcwd())  # user techniques named "module:Class" import from here
    args = _parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    try:
        return args.func(args)
    except SuiteError as exc:
        print(exc, file=sys.stderr)
        return EXIT_BAD_INPUT
    except (BadInput, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        sweeping = args.func in (_run, _campaign)
        stored = ": finished runs are stored; run the same command again to resume" if sweeping else ""
        print(f"\ninterrupted{stored}", file=sys.stderr)
        return 130


def interrupt(signum: int, frame: object) -> None:
    """SIGTERM (kill, a scheduler's time limit) stops a sweep as Ctrl-C does: the running run's process
    group is killed on the way out and finished records are kept."""
    raise KeyboardInterrupt


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return int(text)


def _points(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"expected accuracy points from 0 to 100, got {text!r}")
    return value


def _world_size(text: str) -> int:
    if not text.isdigit() or not 2 <= int(text) <= MAX_NPROC:
        raise argparse.ArgumentTypeError(f"expected a number of processes from 2 to {MAX_NPROC:,}, got {text!r}")
    return int(text)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 0, got {text!r}")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench", description="Benchmark memory-saving PyTorch training techniques.")
    sub = p.add_subparsers(required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run (or resume) a suite and report it")
    run.add_argument("suite", help="suite name (suites/NAME.toml) or path")
    run.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    run.add_argument("--results", type=Path, default=Path("results"), help="results root (default: results)")
    run.add_argument("--only", metavar="PATTERNS", help="comma-separated run names or globs, e.g. 'baseline,amp-*'")
    run.add_argument("--snapshot", action="store_true",
                     help="CUDA: save each run's instrumented step as <run>.snapshot.pickle for memory_viz")
    _sweep_flags(run)
    run.add_argument("--torchrun", metavar="ARGS", default="",
                     help="launcher arguments for multi-process runs instead of --standalone, e.g. "
                          "'--nnodes 2 --rdzv-backend c10d --rdzv-endpoint node1:29500'")
    run.add_argument("--slurm", metavar="OPTIONS",
                     help="submit each run as a Slurm job (submitit): 'partition=gpu,timeout_min=60,…'; "
                          "'cluster=local' runs the jobs as local processes")
    run.set_defaults(func=_run)
    camp = sub.add_parser("campaign", help="every default suite in one sweep, runs never measured here first "
                                           "(make gpu); resumes, with an ETA")
    camp.add_argument("suites", nargs="*", default=list(CAMPAIGN), help=f"default: {' '.join(CAMPAIGN)}")
    camp.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    camp.add_argument("--results", type=Path, default=Path("results"), help="results root (default: results)")
    camp.add_argument("--archive", type=Path, metavar="FILE.tgz",
                      help="rewrite this archive of the suites' records on this device after every run "
                           "(a leased machine that hands back one folder and may be cut off: $OUT/results.tgz)")
    _sweep_flags(camp)
    camp.set_defaults(func=_campaign)
    rep = sub.add_parser("report", help="tables and plots from stored results (no torch run)")
    rep.add_argument("suite", help="suite name, or a results/<suite> folder")
    rep.add_argument("--results", type=Path, default=Path("results"))
    rep.set_defaults(func=_report)
    pre = sub.add_parser("predict", help="predicted peak memory at GPU shapes, on this machine (fake tensors)")
    pre.add_argument("suite", help="suite name (suites/NAME.toml) or path")
    pre.add_argument("--budget", help="the card's memory, e.g. 16GiB: which runs fit, and the largest batch that does")
    pre.add_argument("--reserve", help="held back from the budget for the CUDA context and the allocator's "
                                       "workspaces (default 1GiB, what the H100 records needed; 0: none)")
    pre.add_argument("--only", metavar="PATTERNS", help="comma-separated run names or globs")
    pre.add_argument("--results", type=Path, default=Path("results"), help="where GPU measurements are read from")
    pre.add_argument("--jobs", type=_positive, default=min(os.cpu_count() or 1, 4),
                     help="processes predicting at once (default: the cores, at most 4; each takes about 1 GB)")
    pre.add_argument("--nproc", type=_world_size, metavar="N",
                     help="the processes every ddp, fsdp or tensor-parallel entry spans (default: its nproc): "
                          f"each rank's peak and traffic under a fake process group, 2 to {MAX_NPROC:,}")
    pre.set_defaults(func=_predict)
    fit = sub.add_parser("fit", help="the largest batch that really fits a budget, measured in probes, beside "
                                     "the predicted one")
    fit.add_argument("suite", help="suite name (suites/NAME.toml) or path")
    fit.add_argument("--budget", required=True, help="the card's memory, e.g. 16GiB (on CUDA less --reserve "
                                                     "is left to tensors; on a CPU, tracked tensor bytes)")
    fit.add_argument("--reserve", default=None, help="CUDA: held back for the context and workspaces (default 1GiB)")
    fit.add_argument("--only", metavar="PATTERNS", help="comma-separated run names or globs")
    fit.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    fit.add_argument("--results", type=Path, default=Path("results"))
    fit.set_defaults(func=_fit)
    adv = sub.add_parser("advise", help="the cheapest plans that make a model fit a budget: a ranked table, and "
                                        "suites/advice-MODEL.toml to measure them")
    adv.add_argument("model", help="a model (bench list), module:NAME, or a suite file whose model and shapes to take")
    adv.add_argument("--budget", required=True, help="the card's memory, e.g. 24GiB (on CUDA less --reserve), or a "
                                                     "share of the baseline's predicted peak, e.g. 60%%")
    size = adv.add_mutually_exclusive_group()
    size.add_argument("--batch", type=_positive, help="the batch per process (default: the shapes' own)")
    size.add_argument("--max-batch", action="store_true", help="rank plans by the largest batch each fits")
    adv.add_argument("--nproc", type=_world_size, default=1, metavar="N", help="processes the plans span "
                     "(adds ddp or fsdp to every plan; the budget is each rank's)")
    mode = adv.add_mutually_exclusive_group()
    mode.add_argument("--train", dest="mode", action="store_const", const="train", help="training steps (default)")
    mode.add_argument("--infer", dest="mode", action="store_const", const="inference", help="inference only")
    adv.add_argument("--tolerance-pt", type=_points, metavar="X",
                     help="drop plans whose techniques lost more than X accuracy points in committed fidelity records")
    adv.add_argument("--top", type=_positive, default=5, help="plans listed and written (default 5)")
    adv.add_argument("--measure", action="store_true",
                     help="measure the listed plans here and report, predicted against measured, whether each fit "
                          "and how it ranked")
    adv.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                     help="cuda (default): a card, at GPU shapes, predicted anywhere; cpu: this machine at CPU shapes")
    adv.add_argument("--reserve", default=None, help="CUDA: held back from --budget for the context and workspaces "
                                                     "(default 1GiB)")
    adv.add_argument("--link-gbps", type=float, metavar="GB/S", help="device-host bandwidth for offloading "
                                                                     "(default: 25, PCIe 4.0 x16)")
    adv.add_argument("--jobs", type=_positive, default=min(os.cpu_count() or 1, 4),
                     help="processes predicting at once (default: the cores, at most 4)")
    adv.add_argument("--results", type=Path, default=Path("results"), help="committed records read as evidence")
    adv.add_argument("--out", type=Path, default=Path("suites"), help="folder for advice-MODEL.toml")
    adv.set_defaults(func=_advise)
    ovr = sub.add_parser("overview", help="one page over every suite: the best combination per model")
    ovr.add_argument("--results", type=Path, default=Path("results"))
    ovr.set_defaults(func=_overview)
    cmp = sub.add_parser("compare", help="per-run changes between two result folders, regressions flagged")
    cmp.add_argument("a", type=Path, help="results/, results/<suite>/ or results/<suite>/<device>/ (before)")
    cmp.add_argument("b", type=Path, help="the same for the other side (after)")
    cmp.add_argument("--device", help="where a folder holds several devices: which one (part of its name)")
    cmp.add_argument("--out", type=Path, default=Path("results/compare"), help="folder for compare.{md,csv,png}")
    cmp.add_argument("--strict", nargs="?", const="all", metavar="KINDS",
                     help="exit 1 when a run regressed (for CI); KINDS limits it to some of memory, throughput, "
                          "accuracy: 'memory,accuracy' on a shared machine whose load moves throughput")
    cmp.set_defaults(func=_compare)
    val = sub.add_parser("validate", help="check suite files; every problem at once")
    val.add_argument("suites", nargs="*", help="suite names or files (default: suites/*.toml)")
    val.set_defaults(func=_validate)
    lst = sub.add_parser("list", help="models and techniques with their options")
    lst.add_argument("--docs", type=Path, metavar="PAGE", help="rewrite the techniques table in PAGE (between its "
                                                              "markers) from the registry instead: make docs")
    lst.set_defaults(func=_list)
    return p


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"expected seconds from 1 to {MAX_TIMEOUT_S:g} (a week), got {text!r}")
    return value


def _sweep_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                   help="stop each run after this long instead of its suite's timeout_s (a stored record is kept)")
    p.add_argument("--force", action="store_true",
                   help="re-measure runs stored before this sweep began (interrupted, the same command resumes)")
    p.add_argument("--keep-failures", action="store_true",
                   help="keep stored error and timeout records instead of retrying them")
    p.add_argument("--no-fidelity", action="store_true",
                   help="skip every run's fidelity phase (the accuracy delta): memory and speed only, sooner; "
                        "a stored record with the phase is kept")
    p.add_argument("--launcher", choices=["fork", "fresh"], default="fork",
                   help="how each run's process starts: forked from a server that imported torch once "
                        "(default), or a fresh interpreter")
    p.add_argument("--predict-jobs", type=_count, default=None, metavar="N",
                   help="processes predicting the pending runs while the device measures (default: on CUDA "
                        "the spare cores, at most 4; on a CPU 0, each run predicting itself, so that "
                        "predictions do not slow the measured steps)")


def _sweep_options(args: argparse.Namespace) -> dict[str, object]:
    return {"force": args.force, "keep_failures": args.keep_failures, "fidelity": not args.no_fidelity}


def _local(args: argparse.Namespace, torchrun: tuple[str, ...] = ()) -> Launcher:
    """This machine's launcher, as the flags ask."""
    from bench.launch import detect
    from bench.launch.local import Local

    device = detect(args.device)
    jobs = args.predict_jobs
    if jobs is None:
        jobs = min(4, (os.cpu_count() or 1) - 1) if device.type == "cuda" else 0
    return Local(device, args.launcher, torchrun, args.snapshot, max(jobs, 0))  # a one-core host has no spare core


def suite_path(name: str) -> Path:
    """suites/NAME.toml, or the file named; one that does not exist is refused here, before torch is imported
    (which took 45 s on a loaded machine before the error)."""
    path = Path(name)
    if not (path.suffix == ".toml" or path.exists()):
        path = Path("suites") / f"{name}.toml"
    if not path.exists():
        raise cannot_read(path, "No such file or directory")
    return path


def _run(args: argparse.Namespace) -> int:
    path = suite_path(args.suite)  # before torch is imported
    from bench.report.headline import answer
    from bench.report.tables import markdown, summary
    from bench.results import to_frame
    from bench.sweep import sweep

    refuse_unusable_flags(args)
    suite = _selected(path, args)
    torchrun = tuple(shlex.split(args.torchrun))
    if args.slurm is not None:
        from bench.launch.slurm import Slurm, parse_options

        try:
            options = parse_options(args.slurm)
        except ValueError as exc:
            raise BadInput(str(exc)) from exc
        device_type = "cuda" if args.device == "auto" else args.device  # the nodes', not this machine's
        launcher = Slurm(device_type, args.results / suite.name / ".submitit", options, torchrun)
    else:
        launcher = _local(args, torchrun)
    records = sweep(suite, launcher, args.results, **_sweep_options(args))
    table = summary(to_frame(records), suite.throughput)
    print(markdown(table))
    if launcher.device_name:  # the answer the report opens with, for this device, where the user looks
        print("\n" + answer(table, launcher.device_name, len(suite.order or suite.runs)))
    # Every page the suite's records feed is kept current: the overview and results/figures.md read them too.
    _pages(args.results, [suite.name])
    # oom, timeout and unsupported are findings about the configuration; error means something broke.
    return 1 if any(r["status"] == Status.ERROR for r in records) else 0


def _campaign(args: argparse.Namespace) -> int:
    paths = [suite_path(name) for name in args.suites]  # before torch is imported
    from bench.results import writable
    from bench.sweep import campaign

    args.slurm, args.snapshot = None, False
    refuse_unusable_flags(args)
    chosen = [_selected(p, args) for p in paths]  # every file checked before anything runs
    # The archive is rewritten after every run: found unwritable after the first, the rest went unmeasured.
    if args.archive is not None:
        writable(args.archive.parent, f"the archive {args.archive.name}", "--archive PATH")
    launcher = _local(args)
    records = campaign(chosen, launcher, args.results, never_measured_first=True, archive=args.archive,
                       **_sweep_options(args))
    _pages(args.results, [s.name for s in chosen])
    return 1 if any(r["status"] == Status.ERROR for rs in records.values() for r in rs) else 0


def _selected(path: Path, args: argparse.Namespace) -> Suite:
    """The suite file loaded, with the runs ``--only`` names and the time limit ``--timeout`` sets, where the
    command has them: one place for what run, predict, fit and campaign each did apart."""
    from bench import suite as suites

    suite = suites.load(path)
    if getattr(args, "only", None) is not None:
        suite = suites.select(suite, args.only.split(","))
    if getattr(args, "timeout", None):
        suite = suites.with_timeout(suite, args.timeout)
    return suite


def _pages(results: Path, suites: list[str]) -> None:
    """The suites' reports and the overview rebuilt after a sweep; a page that cannot be written (a disk that
    filled) is named, and the rest still are: the records are stored, and `make report` rebuilds it later."""
    from bench.report import build_report
    from bench.report.overview import build_overview

    jobs = [(f"the report of {s}", lambda s=s: build_report(results / s)) for s in suites]
    for what, build in [*jobs, ("the overview", lambda: build_overview(results))]:
        try:
            page = next(p for p in build() if p.suffix == ".html")  # the page to open
            print(f"{what}: {page}", file=sys.stderr)
        except OSError as exc:
            print(f"warning: {what} could not be written ({exc.strerror or exc}); the records are stored: run "
                  "`make report SUITE=…` or `make overview` once it can be", file=sys.stderr)


def refuse_unusable_flags(args: argparse.Namespace) -> None:
    """Flags this machine cannot honour, refused before a results folder is made."""
    if args.slurm is not None:
        if args.snapshot:
            raise BadInput("--snapshot does not go with --slurm (the file would be written on the node); "
                           "take one on a GPU node with `bench run SUITE --only RUN --snapshot`")
        # A Slurm job is one run in one fresh process, predicting itself.
        if ignored := [f for f, on in (("--launcher", args.launcher != "fork"),
                                       ("--predict-jobs", args.predict_jobs is not None)) if on]:
            raise BadInput(f"{', '.join(ignored)}: for local sweeps only; leave them out with --slurm")
        if importlib.util.find_spec("submitit") is None:
            raise BadInput("--slurm needs submitit: pip install -e '.[cluster]' (or pip install submitit)")
    elif args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise BadInput(f"--device cuda, but torch {torch.__version__} (CUDA {torch.version.cuda}) finds no "
                           "CUDA device here; leave --device out to run on this machine's CPU")


def _report(args: argparse.Namespace) -> int:
    from bench.report import build_report
    from bench.results import writable

    # A suite's name reads --results/NAME, even where ./NAME is a folder; a path (with a slash) is read as given.
    folder = Path(args.suite) if "/" in args.suite and Path(args.suite).is_dir() else args.results / args.suite
    if folder.is_dir():
        writable(folder, "the report", "--results FOLDER (a writable copy)")
    for path in build_report(folder):
        print(path)
    return 0


def _predict(args: argparse.Namespace) -> int:
    path = suite_path(args.suite)  # before torch is imported
    from bench import suite as suites
    from bench.predict import ASSUMPTIONS, RESERVE, markdown, suite_table, tensor_budget
    from bench.results import load_records

    reserve = args.reserve or RESERVE
    if args.reserve and not args.budget:  # else it would be taken and ignored
        raise BadInput(f"--reserve {args.reserve} is held back from a --budget, and none was given")
    try:
        budget = tensor_budget(args.budget, reserve) if args.budget is not None else None
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    suite = _selected(path, args)
    if args.nproc:
        suite = suites.spanning(suite, args.nproc)
    measured = {r["run"]: r for r in load_records(args.results / suite.name)
                if r.get("device_type") == "cuda" and r.get("status") == Status.OK and r.get("run_key")}
    print(f"{suite.name}: predicting {len(suite.runs)} runs at GPU shapes (fake tensors, nothing allocated)",
          file=sys.stderr)
    if budget is not None:
        print(f"budget {args.budget} less {reserve} for the CUDA context and the allocator's workspaces "
              f"(--reserve): {budget / 2**30:.2f} GiB for tensors", file=sys.stderr)
    table = suite_table(list(suite.runs), measured, budget, jobs=args.jobs)
    print(markdown(table))
    if args.only is None and budget is None and not args.nproc:  # the whole suite as it is: its report shows them
        import torch

        from bench.predict.table import save
        from bench.provenance import git_revision
        from bench.results import PREDICTED

        path = save(table, args.results / suite.name / PREDICTED, git_revision(), torch.__version__)
        print(f"\nwritten: {path} (its report shows the runs no GPU has measured yet)", file=sys.stderr)
    if any(r.nproc > 1 for r in suite.runs):
        print("\nRanks: each multi-process entry is predicted as rank 0 under a fake process group; the other ranks "
              "run the same program on their own shards (fsdp's last ranks may hold a few padding elements less). "
              "Traffic is what a rank sends per step, as a ring moves it, and it receives as much.", file=sys.stderr)
    print(f"\nAssumed: {ASSUMPTIONS}.", file=sys.stderr)
    return 0


def _fit(args: argparse.Namespace) -> int:
    path = suite_path(args.suite)  # before torch is imported
    from bench.fit import fit_suite
    from bench.launch import detect
    from bench.predict import RESERVE, parse_size, tensor_budget

    args.slurm, args.snapshot = None, False
    refuse_unusable_flags(args)
    device = detect(args.device)
    try:
        budget = (tensor_budget(args.budget, args.reserve or RESERVE) if device.type == "cuda"
                  else parse_size(args.budget))
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    suite = _selected(path, args)
    rows = fit_suite([r for r in suite.runs if r.mode == "train" and r.nproc == 1], device, budget, args.results)
    print("| run | measured largest batch | predicted | prediction |\n|---|---|---|---|")
    for r in rows:
        verdict = ("error: " + r["message"] if r["status"] != Status.OK else
                   "nothing fits" if r.get("measured_largest_batch") is None else
                   "⚠ promises an OOM" if r.get("promises_oom") else
                   "within 5% below" if r.get("within_5pct_below") else "safe, more than 5% below")
        print(f"| {r['run']} | {r.get('measured_largest_batch')} | {r['predicted_largest_batch']} | {verdict} |")
    return 1 if any(r.get("promises_oom") or r["status"] != Status.OK for r in rows) else 0


def _advise(args: argparse.Namespace) -> int:
    from bench.advise import Budget, advise, source, write
    from bench.predict import RESERVE
    from bench.results import writable

    if args.reserve and args.device != "cuda":
        raise BadInput(f"--reserve {args.reserve} is held back on a CUDA card; leave it out with --device cpu")
    if args.measure:
        args.slurm, args.snapshot = None, False
        refuse_unusable_flags(args)
    try:
        budget = Budget.parse(args.budget, args.device, args.reserve or RESERVE)
    except ValueError as exc:
        raise BadInput(str(exc)) from exc
    src = source(args.model, args.mode, args.batch, args.device)
    writable(args.out, "the advice suite file", "--out FOLDER")  # before the search, not after it
    advice = advise(src, budget, args.device, args.nproc, args.top, args.tolerance_pt, args.max_batch, args.results,
                    args.jobs, args.link_gbps)
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
    """The advice suite measured here, without fidelity phases, then predicted against measured; exit 1 unless the
    top plan fits as measured and its throughput is within 10% of the best of the listed plans that fit."""
    from bench import suite as suites
    from bench.advise import write
    from bench.sweep import sweep

    args.predict_jobs, args.launcher, args.torchrun = None, "fork", ""
    suite = suites.without_fidelity(suites.load(path))
    records = sweep(suite, _local(args), args.results, fidelity=False)
    print(write.measured(advice, records))
    return 0 if write.top_holds(advice, records) else 1


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
    gate = set(compare.REGRESSIONS if args.strict == "all" else (args.strict or "").split(",")) - {""}
    if unknown := sorted(gate - set(compare.REGRESSIONS)):
        raise BadInput(f"--strict {args.strict}: unknown {', '.join(map(repr, unknown))}; expected some of "
                       f"{', '.join(compare.REGRESSIONS)}, comma-separated, after the two folders")
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
    return 1 if any(gate & set(r.split(", ")) for r in table["regression"]) else 0


def _validate(args: argparse.Namespace) -> int:
    paths = [suite_path(p) for p in args.suites] or sorted(Path("suites").glob("*.toml"))  # before torch
    from bench import suite as suites

    failed = 0
    for path in paths:
        try:
            s = suites.load(path)
            print(f"ok: {path} ({s.model}, {len(s.runs)} runs)")
        except SuiteError as exc:
            print(exc, file=sys.stderr)
            failed += 1
    return EXIT_BAD_INPUT if failed else 0


def _list(args: argparse.Namespace) -> int:
    from bench.models import MODELS
    from bench.techniques import TECHNIQUES, TRAIN
    from bench.techniques.base import options_doc

    if args.docs:
        from bench.techniques import catalogue

        print(catalogue.write(args.docs))
        return 0
    print("models:", ", ".join(MODELS.names()), "(or 'module:NAME' naming your own bench.models.ModelSpec)")
    print("techniques:")
    for name in TECHNIQUES:
        cls = TECHNIQUES.get(name)
        modes = "" if cls.modes == TRAIN else f" [{', '.join(sorted(cls.modes))}]"
        print(f"  {name}: {cls.summary}{modes}")
        for opt, kind, default, doc in options_doc(cls):
            print(f"      {opt} ({kind}, default {default!r}): {doc}")
    return 0
