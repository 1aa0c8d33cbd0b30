"""A sweep: every run of a suite in a fresh process with a timeout, each record stored as it finishes.

A fresh process per run keeps peaks and allocator state from leaking between runs and lets a
technique set allocator options before CUDA starts. Resuming skips a run whose stored record has the
same key (full specification + device); ``force`` redoes it.
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
from pathlib import Path
from typing import Any, TextIO

from bench import results
from bench.provenance import device_name, git_revision
from bench.suite import RunSpec, Suite

STDERR_TAIL = 2000


@dataclass(frozen=True)
class Device:
    type: str  # "cuda" or "cpu"
    name: str  # e.g. "NVIDIA H100 80GB HBM3", or "cpu"
    count: int = 1  # GPUs visible on this node (a run's nproc may not exceed it)


def detect(requested: str = "auto") -> Device:
    import torch

    kind = requested if requested != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return Device(kind, device_name(kind), torch.cuda.device_count() if kind == "cuda" else 1)


def sweep(suite: Suite, device: Device, results_root: Path, force: bool = False,
          log: TextIO = sys.stderr, snapshot: bool = False, torchrun: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Run (or resume) every run of the suite; returns the records, stored and new. ``torchrun``: launcher
    arguments for multi-process runs instead of ``--standalone`` (``--nnodes 2 --rdzv-endpoint host:port``)."""
    revision, start, records = git_revision(), time.monotonic(), []
    n = len(suite.runs)
    print(f"{suite.name}: {n} runs on {device.name}, records in {results_root / suite.name}", file=log)
    if snapshot and device.type != "cuda":
        print(f"--snapshot: the allocator history is CUDA's; none is saved on {device.name}", file=log)
    for i, spec in enumerate(suite.runs, 1):
        path = results.record_path(results_root, suite.name, device.name, spec.name)
        key = spec.key(device.name)
        old = results.read(path)
        shot = path.with_suffix(".snapshot.pickle") if snapshot and device.type == "cuda" else None
        if old is not None and old.get("run_key") == key and not force:
            # A snapshot is taken only while a run is measured: say so rather than leave the user looking for it.
            missing = ", no snapshot: --force re-measures it with one" if shot and not shot.exists() else ""
            print(f"[{i}/{n}] {spec.name}: kept stored record ({old['status']}{missing})", file=log)
            records.append(old)
            continue
        print(f"[{i}/{n}] {spec.name}: running on {device.name} ({_elapsed(start)} elapsed)", file=log, flush=True)
        clock = time.monotonic()
        outcome = run_isolated(spec, device, shot, torchrun)
        # wall_s: the run's whole process (start-up, prediction, measurement, fidelity phase)
        record = base_record(spec, device, key, revision) | {"run_index": suite.position(spec.name),
                                                             "wall_s": round(time.monotonic() - clock, 1)}
        record |= outcome
        finish(record, records, results_root)
        print(f"[{i}/{n}] {spec.name}: {_outcome(record)}", file=log, flush=True)
    print(f"done: {n} runs in {_elapsed(start)}", file=log)
    return records


def finish(record: dict[str, Any], records: list[dict[str, Any]], results_root: Path) -> None:
    """Add the accuracy delta against the baseline's record (this one, or one stored before it), store
    the record atomically, and keep it with the others."""
    baseline = record if record["run"] == record["baseline"] else next(
        (r for r in records if r["run"] == record["baseline"] and r["device"] == record["device"]), None)
    record |= results.accuracy_vs_baseline(record, baseline)
    path = results.record_path(results_root, record["suite"], record["device"], record["run"])
    results.set_aside_if_unreadable(path)
    results.write_atomic(path, record)
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


def run_isolated(spec: RunSpec, device: Device, snapshot: Path | None = None,
                 torchrun: tuple[str, ...] = ()) -> dict[str, Any]:
    """The run in its own process (``nproc`` > 1: its own torchrun, one process per rank); a crash or a
    timeout becomes a status, never an exception. With ``snapshot`` (CUDA), the instrumented step's
    memory history is dumped there for memory_viz."""
    if device.type == "cuda" and spec.nproc > device.count:
        return {"status": "unsupported", "message": f"needs {spec.nproc} GPUs per node; {device.count} visible"}
    env = os.environ | {k: v for t in spec.techniques for k, v in t.build().env().items()}
    with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp:
        spec_path, out_path, err_path = (Path(tmp) / n for n in ("spec.json", "out.json", "stderr.txt"))
        job = {"spec": spec.to_dict(), "device_type": device.type, "snapshot": str(snapshot) if snapshot else None}
        spec_path.write_text(json.dumps(job))
        cmd = [sys.executable, "-m", "bench.worker", str(spec_path), str(out_path)]
        if spec.nproc > 1:
            cmd[1:2] = ["-m", "torch.distributed.run", f"--nproc-per-node={spec.nproc}",
                        "--tee=3", f"--log-dir={Path(tmp) / 'ranks'}", *(torchrun or ("--standalone",)), "-m"]
        with open(err_path, "w") as err:
            proc = subprocess.Popen(cmd, env=env, stdout=err, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=spec.timeout_s)
            except subprocess.TimeoutExpired:
                _kill(proc)
                return {"status": "timeout", "message": f"stopped after {spec.timeout_s:g} s"}
            except BaseException:  # Ctrl-C: take the run down with us, keep what is stored
                _kill(proc)
                raise
        tail = _tail(err_path, Path(tmp) / "ranks")
        if code == 0 and out_path.exists():
            out = json.loads(out_path.read_text())
            return out | ({"stderr_tail": tail} if out["status"] == "error" else {})
        if failed := sorted(Path(tmp).glob("out.json.rank*")):  # a rank's own record of why it stopped
            return json.loads(failed[0].read_text()) | {"stderr_tail": tail}
        why = (f"killed by signal {signal.Signals(-code).name}" if code < 0 else
               "no record written (under a multi-node torchrun, rank 0 is on another node)" if code == 0
               else f"exit status {code}")
        return {"status": "error", "message": f"run process died: {why}", "stderr_tail": tail}


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


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


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
    return "ok, " + ", ".join(parts)


def _elapsed(start: float) -> str:
    s = int(time.monotonic() - start)
    return f"{s // 60}m{s % 60:02d}s"
