"""What several commands share: argument types, the suite a command names (loaded with --only and
--timeout), the flags of a sweep, and this machine's launcher."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from bench.errors import BadInput, cannot_read
from bench.spec import MAX_NPROC, MAX_TIMEOUT_S

if TYPE_CHECKING:
    from bench.launch import Launcher
    from bench.spec import Suite

JOBS = min(os.cpu_count() or 1, 4)  # processes predicting at once by default: each takes about 1 GB


def digits(text: str) -> bool:
    """Whether ``text`` is a whole number in ASCII digits: ``str.isdigit`` and ``int`` take any
    script's digits ('٣' is 3 to them), which a numeric flag here does not."""
    return text.isascii() and text.isdigit()


def positive(text: str) -> int:
    if not digits(text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return int(text)


def _number(text: str) -> float:
    """``float(text)`` for an ASCII number (float() too reads any script's digits), else -1: out of
    every range a flag takes."""
    try:
        if text.isascii():
            return float(text)
        return -1.0
    except ValueError:
        return -1.0


def points(text: str) -> float:
    value = _number(text)
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"expected accuracy points from 0 to 100, got {text!r}")
    return value


def world_size(text: str) -> int:
    if not digits(text) or not 2 <= int(text) <= MAX_NPROC:
        raise argparse.ArgumentTypeError(
            f"expected a number of processes from 2 to {MAX_NPROC:,}, got {text!r}"
        )
    return int(text)


def count(text: str) -> int:
    if not digits(text):
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 0, got {text!r}")
    return int(text)


def seconds(text: str) -> float:
    value = _number(text)
    if not 0 < value <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(
            f"expected seconds from 1 to {MAX_TIMEOUT_S:g} (a week), got {text!r}"
        )
    return value


def suite_path(name: str) -> Path:
    """suites/NAME.toml, or the file named; one that does not exist is refused here, before torch is
    imported (which took 45 s on a loaded machine before the error)."""
    path = Path(name)
    if not (path.suffix == ".toml" or path.exists()):
        path = Path("suites") / f"{name}.toml"
    if not path.exists():
        raise cannot_read(path, "No such file or directory")
    return path


def job_flags(p: argparse.ArgumentParser, suite: bool = True) -> None:
    """A job given as its files instead of a suite (``bench.suite.from_config``)."""
    if suite:
        p.add_argument(
            "suite", nargs="?", help="suite name (suites/NAME.toml) or path; or give --hf"
        )
    p.add_argument(
        "--job",
        metavar="FILE",
        help="a whole job written for another tool, told apart by its keys (an axolotl, "
        "LLaMA-Factory or torchtune YAML): read into --hf's files, beside full fine-tuning",
    )
    p.add_argument(
        "--hf",
        metavar="PATH",
        help="a Hugging Face config.json (or its folder), or a hub id ORG/NAME[@REVISION] (its "
        "config.json from huggingface_hub's cache, else downloaded alone): a suite of full "
        "fine-tuning against the job the other flags give",
    )
    p.add_argument(
        "--training-args",
        metavar="FILE",
        help="with --hf: the job's TrainingArguments (JSON or YAML)",
    )
    p.add_argument(
        "--adapter-config", metavar="FILE", help="with --hf: the job's PEFT adapter_config.json"
    )
    p.add_argument(
        "--quantization-config",
        metavar="FILE",
        help="with --hf: the BitsAndBytesConfig the job loads the model with (its to_json_file's "
        "JSON): QLoRA's 4 bits or LLM.int8's 8, before the adapters",
    )
    p.add_argument(
        "--seq-len",
        type=positive,
        metavar="N",
        help="with --hf: tokens per sequence on the GPU (512)",
    )
    p.add_argument(
        "--batch",
        type=positive,
        metavar="B",
        help="with --hf: the batch on the GPU (default: the training arguments', else 8)",
    )


def job_suite(args: argparse.Namespace, folder: Path = Path(".cache/suites")) -> Path:
    """The suite file a command runs: the one named, or the one ``--hf`` and its flags describe,
    written to ``folder`` as hf-<model>.toml (``bench suite --hf`` writes it where it is kept)."""
    given = [
        f
        for f in ("training_args", "adapter_config", "quantization_config", "seq_len", "batch")
        if getattr(args, f, None)
    ]
    if getattr(args, "job", None):
        return _job_file_suite(args, given, folder)
    if not args.hf:
        if given:
            raise BadInput(
                f"--{given[0].replace('_', '-')} goes with --hf PATH (a config.json); a suite says "
                "it"
            )
        if not args.suite:
            raise BadInput(
                "name a suite (suites/NAME.toml), or give --hf PATH for a Hugging Face config.json"
            )
        return suite_path(args.suite)
    if getattr(args, "suite", None):
        raise BadInput(f"{args.suite} and --hf: give one, a suite or a config")
    if args.batch and args.training_args:
        raise BadInput(
            "--batch and --training-args: the training arguments give the batch; leave --batch out"
        )
    from bench.models import resolve
    from bench.spec import HF
    from bench.suite import from_config

    try:
        inputs = resolve(HF + args.hf).inputs
    except KeyError as exc:
        raise BadInput(str(exc.args[0] if exc.args else exc)) from None
    text = from_config.suite_text(
        args.hf,
        args.training_args,
        adapter_config=args.adapter_config,
        quantization_config=args.quantization_config,
        seq_len=args.seq_len,
        batch=args.batch,
        inputs=inputs,
        nproc=getattr(args, "nproc", None),
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{from_config.name_of(args.hf)}.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _job_file_suite(args: argparse.Namespace, given: list[str], folder: Path) -> Path:
    """The suite of ``--job FILE`` (bench.suite.job_file), its files read into those --hf's flags
    take, written beside it; what was assumed and ignored said on stderr."""
    refused = [f"--{f.replace('_', '-')}" for f in given if f != "seq_len"]
    if others := refused + (["--hf"] if args.hf else []):
        raise BadInput(f"--job and {', '.join(others)}: the job file gives them; leave them out")
    if getattr(args, "suite", None):
        raise BadInput(f"{args.suite} and --job: give one, a suite or a job file")
    from bench.models import resolve
    from bench.spec import HF
    from bench.suite import from_config, job_file

    path = Path(args.job)
    if not path.is_file():
        raise BadInput(f"--job {path}: no such file")
    job = job_file.read(path)
    name = job_file.name_of(job, path)
    try:
        inputs = resolve(HF + job.model).inputs
    except KeyError as exc:
        raise BadInput(f"--job {path}: {exc.args[0] if exc.args else exc}") from None
    training_args, adapter = job_file.written(job, folder / name)
    text = from_config.suite_text(
        job.model,
        training_args and str(training_args),
        adapter_config=adapter and str(adapter),
        seq_len=args.seq_len or job.seq_len,
        batch=job.batch,
        micro_batches=job.micro_batches,
        inputs=inputs,
        nproc=getattr(args, "nproc", None),
        loaded=job.loaded,
        techniques=job.techniques,
        described=f"{path}: {job.kind}'s job",
        adapter_options=job.adapter_options,
    )
    said = "; ".join(job.assumed) + "; " if job.assumed else ""
    print(
        f"--job {path}: read as {job.kind}'s, into {folder / name}/; {said}ignored, as they change "
        f"nothing a step holds: {', '.join(job.ignored) or 'none'}",
        file=sys.stderr,
    )
    written = folder / f"{name}.toml"
    written.write_text(text, encoding="utf-8")
    return written


def selected(path: Path, args: argparse.Namespace) -> Suite:
    """The suite file loaded, with the runs ``--only`` names and the time limit ``--timeout`` sets,
    where the command has them: one place for what run, predict, fit and campaign each did apart."""
    from bench import suite as suites

    suite = suites.load(path)
    if getattr(args, "only", None) is not None:
        suite = suites.select(suite, args.only.split(","))
    if getattr(args, "timeout", None):
        suite = suites.with_timeout(suite, args.timeout)
    return suite


def sweep_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeout",
        type=seconds,
        metavar="SECONDS",
        help=(
            "stop each run after this long instead of its suite's timeout_s (a stored record is "
            "kept)"
        ),
    )
    p.add_argument(
        "--force",
        action="store_true",
        help=(
            "re-measure runs stored before this sweep began (interrupted, the same command resumes)"
        ),
    )
    p.add_argument(
        "--keep-failures",
        action="store_true",
        help="keep stored error and timeout records instead of retrying them",
    )
    p.add_argument(
        "--no-fidelity",
        action="store_true",
        help="skip every run's fidelity phase (the accuracy delta): memory and speed only, sooner; "
        "a stored record with the phase is kept",
    )
    p.add_argument(
        "--launcher",
        choices=["fork", "fresh"],
        default="fork",
        help="how each run's process starts: forked from a server that imported torch once "
        "(default), or a fresh interpreter",
    )
    p.add_argument(
        "--predict-jobs",
        type=count,
        default=None,
        metavar="N",
        help="processes predicting the pending runs while the device measures (default: on CUDA "
        "the spare cores, at most 4; on a CPU 0, each run predicting itself, so that predictions "
        "do not slow the measured steps)",
    )


def sweep_options(args: argparse.Namespace) -> dict[str, object]:
    return {
        "force": args.force,
        "keep_failures": args.keep_failures,
        "fidelity": not args.no_fidelity,
    }


def local(args: argparse.Namespace, torchrun: tuple[str, ...] = ()) -> Launcher:
    """This machine's launcher, as the flags ask."""
    from bench.launch import detect
    from bench.launch.local import Local

    device = detect(args.device)
    jobs = args.predict_jobs
    if jobs is None:
        if device.type == "cuda":
            jobs = min(4, (os.cpu_count() or 1) - 1)
        else:
            jobs = 0
    # a one-core host has no spare core
    return Local(
        device,
        args.launcher,
        torchrun=torchrun,
        snapshot=args.snapshot,
        predict_jobs=max(jobs, 0),
    )


def refuse_unusable_flags(args: argparse.Namespace) -> None:
    """Flags this machine cannot honour, refused before a results folder is made."""
    if args.slurm is not None:
        if args.snapshot:
            raise BadInput(
                "--snapshot does not go with --slurm (the file would be written on the node); take "
                "one on a GPU node with `bench run SUITE --only RUN --snapshot`"
            )
        # A Slurm job is one run in one fresh process, predicting itself.
        if ignored := [
            f
            for f, on in (
                ("--launcher", args.launcher != "fork"),
                ("--predict-jobs", args.predict_jobs is not None),
            )
            if on
        ]:
            raise BadInput(
                f"{', '.join(ignored)}: for local sweeps only; leave them out with --slurm"
            )
        if importlib.util.find_spec("submitit") is None:
            raise BadInput(
                "--slurm needs submitit: pip install -e '.[cluster]' (or pip install submitit)"
            )
    elif args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise BadInput(
                f"--device cuda, but torch {torch.__version__} (CUDA {torch.version.cuda}) finds "
                "no CUDA device here; leave --device out to run on this machine's CPU"
            )
