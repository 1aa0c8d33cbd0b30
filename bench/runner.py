"""A sweep: every run of a suite in a fresh process with a timeout, each record stored as it finishes.

A fresh process per run keeps peaks and allocator state from leaking between runs and lets a
technique set allocator options before CUDA starts. What a sweep keeps and what it measures again is
bench.resume's; how a run's process starts (a fork of a preloaded server, or a fresh interpreter) is
bench.launch's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from bench import launch, results, resume
from bench.launch import Launcher
from bench.predict import Ahead
from bench.provenance import device_name, git_revision
from bench.suite import RunSpec, Suite
from bench.techniques import build

STDERR_TAIL = 2000
MEMORY_SUMMARY = "memory_summary_text"  # the worker's torch.cuda.memory_summary(), saved beside the record


@dataclass(frozen=True)
class Device:
    type: str  # "cuda" or "cpu"
    name: str  # e.g. "NVIDIA H100 80GB HBM3", or "cpu"
    count: int = 1  # GPUs visible on this node (a run's nproc may not exceed it)


def detect(requested: str = "auto") -> Device:
    import torch

    kind = requested if requested != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return Device(kind, device_name(kind), torch.cuda.device_count() if kind == "cuda" else 1)


def sweep(suite: Suite, device: Device, results_root: Path, force: bool = False, log: TextIO | None = None,
          snapshot: bool = False, torchrun: tuple[str, ...] = (), **options: Any) -> list[dict[str, Any]]:
    """Run (or resume) every run of the suite; returns the records, stored and new. ``torchrun``: launcher
    arguments for multi-process runs instead of ``--standalone`` (``--nnodes 2 --rdzv-endpoint host:port``);
    ``options``: those of ``campaign``."""
    return campaign([suite], device, results_root, force, log, snapshot, torchrun, **options)[suite.name]


def campaign(suites: list[Suite], device: Device, results_root: Path, force: bool = False,
             log: TextIO | None = None, snapshot: bool = False, torchrun: tuple[str, ...] = (),
             fidelity: bool = True, keep_failures: bool = False, launcher: Launcher = "fork",
             predict_jobs: int = 0, never_measured_first: bool = False,
             archive: Path | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every run of the suites in one sweep (see bench.resume for what is kept); returns each suite's
    records, stored and new. ``never_measured_first``: runs with no record of this device and key go before
    retries and re-measurements, so a lease that ends early has added the most. ``predict_jobs``: processes
    that predict the pending runs while the device measures (0: each run predicts itself). ``archive``: a
    .tar.gz of the suites' records on this device, rewritten as each run is stored."""
    revision, start, log = git_revision(), time.monotonic(), log or sys.stderr  # stderr as it is now, not at import
    if launcher == "fork":
        launch.start_server()  # its imports go on while the sweep plans
    results.check_writable(results_root, [s.name for s in suites], device.name)  # before --force's marker
    forced = {s.name: resume.forced_since(results.suite_folder(results_root, s.name, device.name), force)
              for s in suites}
    tasks = [t for s in suites for t in resume.plan(s, device.name, results_root, fidelity, keep_failures,
                                                      forced[s.name])]
    records = {s.name: [t.stored for t in tasks if t.suite is s and not t.measure] for s in suites}
    todo = [t for t in tasks if t.measure]
    if never_measured_first:
        todo.sort(key=lambda t: not t.never_measured)  # stable: the suites' order within each group
    label = (lambda t: t.spec.name) if len(suites) == 1 else (lambda t: f"{t.suite.name}/{t.spec.name}")
    for i, t in enumerate(tasks, 1):
        if not t.measure:
            print(f"[{i}/{len(tasks)}] {label(t)}: {t.reason}{_missing_snapshot(t, snapshot, device)}", file=log)
    print(f"{len(todo)} of {len(tasks)} runs to measure on {device.name}, records in {results_root}", file=log)
    if snapshot and device.type != "cuda":
        print(f"--snapshot: the allocator history is CUDA's; none is saved on {device.name}", file=log)
    launcher = _usable(launcher, device, log) if todo else launcher
    with Ahead([t.spec for t in todo], device.type, predict_jobs) as ahead:
        for i, t in enumerate(todo, 1):
            print(f"[{i}/{len(todo)}] {label(t)}: running ({t.reason}; {_elapsed(start)} elapsed"
                  f"{_eta(start, i - 1, len(todo))})", file=log, flush=True)
            shot = t.path.with_suffix(".snapshot.pickle") if snapshot and device.type == "cuda" else None
            clock = time.monotonic()
            outcome = run_isolated(t.spec, device, shot, torchrun, launcher, ahead.get(t.spec))
            # wall_s: the run's whole process (start-up, prediction, measurement, fidelity phase)
            record = base_record(t.spec, device, t.key, revision) | {
                "run_index": t.suite.position(t.spec.name), "wall_s": round(time.monotonic() - clock, 1)}
            finish(record | outcome, records[t.suite.name], results_root)
            if archive is not None:
                results.pack(archive, results_root, [s.name for s in suites], device.name)
            print(f"[{i}/{len(todo)}] {label(t)}: {_outcome(records[t.suite.name][-1])}",
                  file=log, flush=True)
    for s in suites:
        resume.force_done(results.suite_folder(results_root, s.name, device.name))
    print(f"done: {len(todo)} runs measured in {_elapsed(start)}", file=log)
    return records


def _usable(launcher: Launcher, device: Device, log: TextIO) -> Launcher:
    """The fork server, where a forked child can use this device; else fresh processes, saying why."""
    if launcher == "fork" and device.type == "cuda" and (why := launch.fork_works_on_cuda()):
        print(f"warning: {why}; every run starts a fresh interpreter instead", file=log)
        return "fresh"
    return launcher


def _missing_snapshot(task: resume.Task, snapshot: bool, device: Device) -> str:
    # A snapshot is taken only while a run is measured: say so rather than leave the user looking for it.
    if snapshot and device.type == "cuda" and not task.path.with_suffix(".snapshot.pickle").exists():
        return ", no snapshot: --force re-measures it with one"
    return ""


def finish(record: dict[str, Any], records: list[dict[str, Any]], results_root: Path) -> None:
    """Add the accuracy delta against the baseline's record (this one, or one stored before it), store
    the record atomically, and keep it with the others."""
    baseline = record if record["run"] == record["baseline"] else next(
        (r for r in records if r["run"] == record["baseline"] and r["device"] == record["device"]), None)
    record |= results.accuracy_vs_baseline(record, baseline)
    record["stored_at"] = datetime.now(UTC).isoformat(timespec="microseconds")  # what --force compares
    path = results.record_path(results_root, record["suite"], record["device"], record["run"])
    if summary := record.pop(MEMORY_SUMMARY, None):
        record["memory_summary"] = results.save_beside(path, ".memory.txt", summary)
    results.set_aside_if_unreadable(path)
    results.store(path, record)
    records.append(record)


def base_record(spec: RunSpec, device: Device, key: str, revision: str) -> dict[str, Any]:
    shapes = spec.shapes(device.type)
    return {
        "suite": spec.suite, "run": spec.name, "model": spec.model, "baseline": spec.baseline,
        "techniques": " + ".join(t.label for t in spec.techniques) or "baseline",
        "device": device.name, "device_type": device.type,
        "batch_size": shapes.batch_size, "image_size": shapes.image_size, "seq_len": shapes.seq_len,
        "seed": spec.seed, "warmup_steps": shapes.warmup_steps, "measure_steps": shapes.measure_steps,
        "nproc": spec.nproc,
        "git_revision": revision, "run_key": key, "spec": spec.to_dict(),
    }


def run_isolated(spec: RunSpec, device: Device, snapshot: Path | None = None, torchrun: tuple[str, ...] = (),
                 launcher: Launcher = "fork", prediction: dict[str, Any] | None = None,
                 budget: int | None = None) -> dict[str, Any]:
    """The run in its own process (``nproc`` > 1: its own torchrun, one process per rank); a crash or a
    timeout becomes a status, never an exception. With ``snapshot`` (CUDA), the instrumented step's
    memory history is dumped there for memory_viz; with ``prediction``, made ahead, the run skips its own;
    with ``budget`` (bytes), more memory than that is out of memory (bench fit)."""
    if device.type == "cuda" and spec.nproc > device.count:
        return {"status": "unsupported", "message": f"needs {spec.nproc} GPUs per node; {device.count} visible"}
    own_env = {k: v for t in spec.techniques for k, v in build(t).env().items()}
    if own_env or spec.nproc > 1:
        launcher = "fresh"  # see bench.launch: a fork would start with the server's environment, or one process
    with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp:
        spec_path, out_path, err_path = (Path(tmp) / n for n in ("spec.json", "out.json", "stderr.txt"))
        job = {"spec": spec.to_dict(), "device_type": device.type, "snapshot": str(snapshot) if snapshot else None,
               "prediction": prediction, "launched_at": time.time(), "budget_bytes": budget}
        spec_path.write_text(json.dumps(job))
        argv = ["bench.worker", str(spec_path), str(out_path)]
        if spec.nproc > 1:
            argv = ["torch.distributed.run", f"--nproc-per-node={spec.nproc}", "--tee=3",
                    f"--log-dir={Path(tmp) / 'ranks'}", *(torchrun or ("--standalone",)), "-m", *argv]
        proc = launch.Process(argv, os.environ | own_env, err_path, launcher)
        try:
            code = proc.wait(timeout=spec.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return {"status": "timeout", "message": f"stopped after {spec.timeout_s:g} s"}
        except BaseException:  # Ctrl-C: take the run down with us, keep what is stored
            proc.kill()
            raise
        tail = _tail(err_path, Path(tmp) / "ranks")
        if code == 0 and out_path.exists():
            out = json.loads(out_path.read_text())
            return out | {"launcher": launcher} | ({"stderr_tail": tail} if out["status"] == "error" else {})
        if failed := sorted(Path(tmp).glob("out.json.rank*")):  # a rank's own record of why it stopped
            return json.loads(failed[0].read_text()) | {"stderr_tail": tail}
        why = (f"killed by signal {signal.Signals(-code).name}" if code < 0 else
               "no record written (under a multi-node torchrun, rank 0 is on another node)" if code == 0
               else f"exit status {code}")
        return {"status": "error", "message": f"run process died: {why}", "stderr_tail": tail, "launcher": launcher}


def _tail(err_path: Path, rank_logs: Path) -> str:
    """The end of the run's output; under torchrun, each rank's own stderr too, since the launcher's
    closing report would otherwise push the failing rank's last words (an abort message) out of the tail."""
    tail = _last_words(err_path)
    for log in sorted(rank_logs.glob("*/attempt_*/*/stderr.log")):
        if text := _last_words(log):
            tail += f"\n--- rank {log.parent.name} stderr ---\n{text}"
    return tail


def _last_words(log: Path) -> str:
    # faulthandler's list of loaded extension modules would fill the tail and tell nothing
    lines = log.read_text(errors="replace").strip().splitlines()
    return "\n".join(x for x in lines if not x.startswith("Extension modules:"))[-STDERR_TAIL:]


def _outcome(record: dict[str, Any]) -> str:
    """The progress line's summary: what a user watching the sweep wants first."""
    if record["status"] != "ok":
        return f"{record['status']}: {record['message']}"
    peak = record.get("peak_allocated_bytes") or record.get("peak_tensor_bytes")
    # No peak: a compiled model runs nothing the tracker sees, and a CPU has no allocator peak. Not a zero.
    parts = [f"peak {peak / 2**20:,.1f} MiB" if peak else "peak not tracked",
             f"{record['samples_per_s']:,.1f} samples/s"]
    if record.get("accuracy") is not None:
        delta = record.get("accuracy_delta")
        shown = delta is not None and record["run"] != record["baseline"]
        parts.append(f"accuracy {record['accuracy']:.1%}" + (f" ({delta * 100:+.1f} pt)" if shown else ""))
    if record.get("fidelity_error"):
        parts.append(f"fidelity phase failed: {record['fidelity_error']}")
    if record.get("warning"):
        parts.append(f"warning: {record['warning']}")
    return "ok, " + ", ".join(parts)


def _eta(start: float, done: int, total: int) -> str:
    """The time left, from the mean of the runs measured so far in this sweep."""
    if not done or done >= total:
        return ""
    left = int((time.monotonic() - start) / done * (total - done))
    return f", about {left // 60}m{left % 60:02d}s left"


def _elapsed(start: float) -> str:
    s = int(time.monotonic() - start)
    return f"{s // 60}m{s % 60:02d}s"
