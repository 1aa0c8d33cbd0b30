"""Runs as Slurm jobs, through submitit: each run is one job, which measures on its node exactly as
``bench run`` would there (its own process, or its own torchrun), and hands its record back to the
sweep, which stores it in the same results folder, under the device the job found."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from bench import results
from bench.launch import detect
from bench.launch.local import run_isolated
from bench.provenance import git_revision
from bench.record import Identity, Outcome, Record, Status
from bench.resume import Task
from bench.suite import RunSpec


def parse_options(text: str) -> dict[str, Any]:
    """``partition=gpu,gpus_per_node=8,timeout_min=60`` → submitit parameters (integers where they
    are); ``cluster=local`` runs the jobs as local processes (what the tests use), ``cluster=debug``
    in-process."""
    out: dict[str, Any] = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--slurm: expected key=value pairs separated by commas, got {item!r}")
        if value.strip().isdigit():
            out[key.strip()] = int(value)
        else:
            out[key.strip()] = value.strip()
    return out


class Slurm:
    """``device_type``: the nodes' (the device itself, and so the records' folder, is known when a
    job reports); ``options``: submitit's parameters (``parse_options``); ``torchrun``: as for
    ``Local``."""

    device_name = None
    snapshot = False  # the file would be written on the node

    def __init__(
        self,
        device_type: str,
        folder: Path,
        options: dict[str, Any],
        torchrun: tuple[str, ...] = (),
    ) -> None:
        self.device_type = device_type
        self.folder = folder
        self.options = dict(options)
        self.torchrun = torchrun

    @contextmanager
    def running(self, todo: list[Task], log: TextIO) -> Iterator[Callable[[Task], Record]]:
        """Every job submitted on entry; a task's record is its job's, waited for."""
        import submitit

        options = dict(self.options)
        executor = submitit.AutoExecutor(folder=self.folder, cluster=options.pop("cluster", None))
        executor.update_parameters(**(self._defaults([t.spec for t in todo]) | options))
        revision, jobs = git_revision(), {}
        for t in todo:
            jobs[id(t)] = executor.submit(
                remote_run, t.spec.to_dict(), self.device_type, self.torchrun, revision
            )
            print(
                f"{t.spec.name}: submitted as job {jobs[id(t)].job_id} (logs in {self.folder})",
                file=log,
                flush=True,
            )
        yield lambda t: _collect(t.spec, jobs[id(t)])

    def _defaults(self, specs: list[RunSpec]) -> dict[str, Any]:
        if not specs:
            return {}
        if self.device_type == "cuda":
            gpus = max(s.nproc for s in specs)
        else:
            gpus = 0
        return {
            "timeout_min": max(1, int(max(s.timeout_s for s in specs) // 60) + 5),
            "nodes": 1,
            "tasks_per_node": 1,
            "name": f"bench-{specs[0].suite}",
        } | ({"gpus_per_node": gpus} if gpus else {})


# The line a job prints once it knows its node's device, so that a job that dies later is filed
# under that device.
ON_DEVICE = "bench: measuring on "


def remote_run(
    spec_dict: dict[str, Any], device_type: str, torchrun: tuple[str, ...], revision: str
) -> Record:
    """Inside the job, on its node: the record ``bench run`` would write there."""
    spec = RunSpec.from_dict(spec_dict)
    device = detect(device_type)
    print(f"{ON_DEVICE}{device.name}", flush=True)
    clock = time.monotonic()
    outcome = run_isolated(spec, device, snapshot=None, torchrun=torchrun, kind="fresh")
    key = spec.measured_key(device.name, device.type)
    base = results.base_record(
        spec, device.name, device_type=device.type, key=key, revision=revision
    )
    base.timing.wall_s = round(time.monotonic() - clock, 1)
    return base | outcome


def _collect(spec: RunSpec, job: Any) -> Record:
    """The job's record; a job that died (preempted, out of time, no device on its node) becomes an
    error record of the run, filed under the device its node reported (``unknown`` where it died
    before knowing it), with the error's own line and where the job's log is."""
    try:
        out = job.result()
    except Exception as exc:  # noqa: BLE001  submitit re-raises the job's failure here
        device = _reported_device(job)
        why = f"slurm job {job.job_id} failed: {_cause(str(exc))} (log: {job.paths.stderr})"
        return Record(
            identity=Identity(
                suite=spec.suite, run=spec.name, device=device or "unknown", baseline=spec.baseline
            ),
            outcome=Outcome(status=Status.ERROR, message=why),
        )
    if not isinstance(out, list):
        return out
    # Multi-node jobs return one record per node; the node holding rank 0 has the merged one.
    merged = (r for r in out if r.distributed.world_size or r.outcome.status == Status.OK)
    return next(merged, out[0])


def _cause(text: str) -> str:
    """The error's own line in submitit's message: the trace's last line, not the log paths after
    it."""
    trace = text.split("\n----------------------\nYou can check full logs")[0]
    lines = [
        line for line in trace.splitlines() if line.strip() and not line.startswith((" ", "-"))
    ]
    return (lines[-1] if lines else text.strip() or "no message")[:300]


def _reported_device(job: Any) -> str | None:
    try:
        printed = job.stdout() or ""
    except OSError:  # the log never reached the shared folder
        return None
    found = [
        line[len(ON_DEVICE) :].strip()
        for line in printed.splitlines()
        if line.startswith(ON_DEVICE)
    ]
    if found:
        return found[-1]
    return None
