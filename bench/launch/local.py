"""Runs on this machine: each in its own process with a timeout (a fork of the preloaded server, or
a fresh interpreter; several ranks under their own torchrun), while spare processes predict the runs
still to come.

A process per run keeps peaks and allocator state from leaking between runs and lets a technique set
allocator options before CUDA starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from bench import models, progress, results
from bench.launch import Device, MeasuredThenStopped
from bench.launch.process import Kind, Process, fork_works_on_cuda, start_server
from bench.predict import Ahead
from bench.provenance import git_revision
from bench.record import Outcome, Record, Status
from bench.resume import Task
from bench.spec import Job
from bench.suite import RunSpec
from bench.techniques import build

STDERR_TAIL = 2000
HEARTBEAT_S = 30.0  # a line at least this often while a run goes on: its phase and time so far
WATCH_S = 2.0  # how often the run's resident memory is looked at (what an OOM kill leaves to say)


class Local:
    """``kind``: how each run's process starts (bench.launch.process); ``torchrun``: launcher
    arguments for multi-process runs instead of ``--standalone``; ``snapshot``: on CUDA, each run's
    allocator history of its instrumented step beside its record; ``predict_jobs``: processes
    predicting the pending runs while the device measures (0: each run predicts itself)."""

    def __init__(
        self,
        device: Device,
        kind: Kind = "fork",
        torchrun: tuple[str, ...] = (),
        snapshot: bool = False,
        predict_jobs: int = 0,
    ) -> None:
        self.device = device
        self.kind = kind
        self.torchrun = torchrun
        self.predict_jobs = predict_jobs
        self.device_name, self.device_type = device.name, device.type
        self.snapshot = snapshot and device.type == "cuda"
        self.refused_snapshot = snapshot and not self.snapshot

    @contextmanager
    def running(self, todo: list[Task], log: TextIO) -> Iterator[Callable[[Task], Record]]:
        if self.refused_snapshot:
            print(
                f"--snapshot: the allocator history is CUDA's; none is saved on {self.device.name}",
                file=log,
            )
        if todo and self.kind == "fork":  # the server imports what these runs' models import
            start_server(model_imports([t.spec for t in todo], self.device.type))
        if todo:
            kind = self._usable(log)
        else:
            kind = self.kind
        revision = git_revision()
        with Ahead([t.spec for t in todo], self.device.type, self.predict_jobs) as ahead:

            def run(task: Task) -> Record:
                if self.snapshot:
                    shot = task.path.with_suffix(".snapshot.pickle")
                else:
                    shot = None
                cuda = self.device.type == "cuda" and task.path is not None
                if cuda:
                    kept = task.path.with_suffix(".history.pickle.gz")
                else:
                    kept = None
                clock = time.monotonic()

                def record(outcome: Record) -> Record:
                    # wall_s: the run's whole process (start-up, prediction, measurement, fidelity
                    # phase)
                    base = results.base_record(
                        task.spec,
                        self.device.name,
                        device_type=self.device.type,
                        key=task.key,
                        revision=revision,
                    )
                    base.timing.wall_s = round(time.monotonic() - clock, 1)
                    return base | outcome

                try:
                    outcome = run_isolated(
                        task.spec,
                        self.device,
                        snapshot=shot,
                        torchrun=self.torchrun,
                        kind=kind,
                        prediction=ahead.get(task.spec),
                        heartbeat=lambda phase: print(
                            f"    {task.spec.name}: {phase}", file=log, flush=True
                        ),
                        history=kept,
                    )
                except MeasuredThenStopped as stop:
                    stop.record = record(stop.record)
                    raise
                return record(outcome)

            yield run

    def _usable(self, log: TextIO) -> Kind:
        """The fork server, where a forked child can use this device; else fresh processes, saying
        why."""
        if self.kind == "fork" and self.device.type == "cuda" and (why := fork_works_on_cuda()):
            print(f"warning: {why}; every run starts a fresh interpreter instead", file=log)
            return "fresh"
        return self.kind


def model_imports(specs: list[RunSpec], device_type: str) -> set[str]:
    """The modules the runs' models (and their fidelity phases' stand-ins) import as they are built;
    none for a model that cannot be resolved here (its run says why)."""
    names = {s.model_on(device_type) for s in specs}
    names |= {f.model for s in specs if (f := s.fidelity(device_type)) and f.model}
    imports = set()
    for name in names:
        try:
            imports.update(models.resolve(name).imports)
        except (KeyError, ImportError, ValueError):
            pass
    return imports


def run_isolated(
    spec: RunSpec,
    device: Device,
    snapshot: Path | None = None,
    torchrun: tuple[str, ...] = (),
    kind: Kind = "fork",
    prediction: Record | None = None,
    budget: int | None = None,
    heartbeat: Callable[[str], None] | None = None,
    history: Path | None = None,
) -> Record:
    """The run in its own process (``nproc`` > 1: its own torchrun, one process per rank); a crash
    or a timeout becomes a status, never an exception, and keeps the memory and speed figures
    measured before its fidelity phase. With ``snapshot`` (CUDA), the instrumented step's memory
    history is dumped there for memory_viz; with ``prediction``, made ahead, the run skips its own;
    with ``budget`` (bytes), more memory than that is out of memory (bench fit); ``heartbeat`` is
    told the run's phase every ``HEARTBEAT_S``; ``history`` (CUDA): where the allocator's history of
    the run is saved (bench.measure.history)."""
    if device.type == "cuda" and spec.nproc > device.count:
        why = f"needs {spec.nproc} GPUs per node; {device.count} visible"
        return Record(outcome=Outcome(status=Status.UNSUPPORTED, message=why))
    own_env = {k: v for t in spec.techniques for k, v in build(t).env().items()}
    if own_env or spec.nproc > 1:
        # see bench.launch.process: a fork would start with the server's environment, or one process
        kind = "fresh"
    with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp:
        spec_path, out_path, err_path, progress_file = (
            Path(tmp) / n for n in ("spec.json", "out.json", "stderr.txt", "progress.txt")
        )
        job = Job(
            spec=spec,
            device_type=device.type,
            snapshot=str(snapshot) if snapshot else None,
            prediction=prediction,
            launched_at=time.time(),
            budget_bytes=budget,
            history=str(history) if history else None,
        )
        spec_path.write_text(job.to_json())
        argv = ["bench.worker", str(spec_path), str(out_path)]
        if spec.nproc > 1:
            argv = [
                "torch.distributed.run",
                f"--nproc-per-node={spec.nproc}",
                "--tee=3",
                f"--log-dir={Path(tmp) / 'ranks'}",
                *(torchrun or ("--standalone",)),
                "-m",
                *argv,
            ]
        kills = oom_kills()
        proc = Process(
            argv, os.environ | own_env | {progress.ENV: str(progress_file)}, err_path, kind
        )
        try:
            code, resident = _wait(
                proc, spec.timeout_s, progress_file=progress_file, heartbeat=heartbeat
            )
        except subprocess.TimeoutExpired:
            proc.kill()
            return _measured(
                out_path,
                Status.TIMEOUT,
                f"stopped after {spec.timeout_s:g} s in its {progress.heard(progress_file)}; "
                "running the same command again retries it, and --timeout SECONDS (or timeout_s "
                "in the suite) raises the limit",
            )
        except (
            BaseException
        ) as stop:  # Ctrl-C or SIGTERM: take the run down with us, keep what is stored
            proc.kill()
            if isinstance(stop, KeyboardInterrupt) and (early := _early(out_path)) is not None:
                interrupted = (
                    "interrupted: stopped by Ctrl-C or SIGTERM; the same command measures it again"
                )
                early.fidelity.fidelity_error = interrupted
                early.fidelity.fidelity_interrupted = True
                raise MeasuredThenStopped(early) from stop
            raise
        tail = _tail(err_path, Path(tmp) / "ranks")
        if code == 0 and out_path.exists():
            out = _read(out_path)
            out.timing.launcher = kind
            if out.outcome.status == Status.ERROR:
                out.outcome.stderr_tail = tail
            return out
        if failed := sorted(Path(tmp).glob("out.json.rank*")):
            # a rank's own record of why it stopped
            out = _read(failed[0])
            out.outcome.stderr_tail = tail
            return out
        if code == -signal.SIGKILL and kills is not None and (oom_kills() or 0) > kills:
            out = _measured(
                out_path,
                Status.OOM,
                "killed by the host's OOM killer (SIGKILL, and /proc/vmstat's oom_kill rose): its "
                f"resident memory reached {(resident or 0) / 2**30:,.2f} GiB at the last look",
            )
            out.timing.launcher = kind
            # The watched peak stands in only where the run measured none: a figure of its timed
            # steps stays theirs.
            if out.outcome.status == Status.OOM and resident is not None:
                out.memory.rss_peak_bytes = resident
            return out
        if code < 0:
            why = f"killed by signal {signal.Signals(-code).name}"
        else:
            why = _exited(code)
        died = _measured(out_path, Status.ERROR, f"run process died: {why}")
        died.outcome.stderr_tail, died.timing.launcher = tail, kind
        return died


def _wait(
    proc: Process,
    timeout_s: float,
    progress_file: Path,
    heartbeat: Callable[[str], None] | None,
) -> tuple[int, int | None]:
    """The run's exit status and the highest resident memory its process reached at a look (one
    every WATCH_S; None: it ended before the first), telling ``heartbeat`` its phase every
    HEARTBEAT_S; TimeoutExpired past the limit."""
    start = last = time.monotonic()
    resident = None
    while True:
        left = timeout_s - (time.monotonic() - start)
        if left <= 0:
            raise subprocess.TimeoutExpired("run", timeout_s)
        try:
            return proc.wait(timeout=min(left, WATCH_S)), resident
        except subprocess.TimeoutExpired:
            resident = max(resident or 0, _resident_peak(proc.pid))
            if heartbeat is not None and time.monotonic() - last >= HEARTBEAT_S:
                last, elapsed = time.monotonic(), int(time.monotonic() - start)
                heartbeat(f"{progress.heard(progress_file)} ({elapsed // 60}m{elapsed % 60:02d}s)")


def _resident_peak(pid: int) -> int:
    """The process's resident memory high-water mark (VmHWM), 0 where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has ended since boot (/proc/vmstat), None where
    unknown."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _measured(out_path: Path, status: Status, message: str) -> Record:
    """A run stopped short: where its memory and speed were measured before the fidelity phase, it
    stays ``ok`` with those figures and the phase's failure beside them; else ``status`` with
    ``message``."""
    if (early := _early(out_path)) is not None:
        early.fidelity.fidelity_error = f"{status}: {message}"
        return early
    return Record(outcome=Outcome(status=status, message=message))


def _early(out_path: Path) -> Record | None:
    """The run's memory and speed figures, handed over before its fidelity phase; None: it got no
    further."""
    early = out_path.with_name(out_path.name + ".measured")
    if early.exists():
        return _read(early)
    return None


def _read(path: Path) -> Record:
    """A record the run's process wrote (bench.worker), in its stored form."""
    return Record.from_flat(json.loads(path.read_text()))


def _tail(err_path: Path, rank_logs: Path) -> str:
    """The end of the run's output; under torchrun, each rank's own stderr too, since the launcher's
    closing report would otherwise push the failing rank's last words (an abort message) out of the
    tail."""
    tail = _last_words(err_path)
    for log in sorted(rank_logs.glob("*/attempt_*/*/stderr.log")):
        if text := _last_words(log):
            tail += f"\n--- rank {log.parent.name} stderr ---\n{text}"
    return tail


# bytes read from the end of a run's output: a run that printed 1.5 GB took 7.2 GB to read whole
TAIL_READ = 64 * 1024


def _last_words(log: Path) -> str:
    # faulthandler's list of loaded extension modules would fill the tail and tell nothing
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_READ))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = text.strip().splitlines()
    return "\n".join(x for x in lines if not x.startswith("Extension modules:"))[-STDERR_TAIL:]


def _exited(code: int) -> str:
    """What a run's exit status says of it, where no signal killed it."""
    if code == 0:
        return "no record written (under a multi-node torchrun, rank 0 is on another node)"
    return f"exit status {code}"
