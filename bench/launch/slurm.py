"""A suite swept across a Slurm cluster with submitit: each run is one job, which measures on its node
exactly as ``bench run`` would there (its own process, or its own torchrun), and the records land in
the same results folder, keyed by the device the job found."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, TextIO

from bench import results
from bench.provenance import git_revision
from bench.runner import base_record, detect, finish, run_isolated
from bench.suite import RunSpec, Suite


def parse_options(text: str) -> dict[str, Any]:
    """``partition=gpu,gpus_per_node=8,timeout_min=60`` → submitit parameters (integers where they are);
    ``cluster=local`` runs the jobs as local processes (what the tests use), ``cluster=debug`` in-process."""
    out: dict[str, Any] = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--slurm: expected key=value pairs separated by commas, got {item!r}")
        out[key.strip()] = int(value) if value.strip().isdigit() else value.strip()
    return out


def remote_run(spec_dict: dict[str, Any], device_type: str, torchrun: tuple[str, ...], revision: str
               ) -> dict[str, Any]:
    """Inside the job, on its node: the record ``bench run`` would write there."""
    spec = RunSpec.from_dict(spec_dict)
    device = detect(device_type)
    return base_record(spec, device, spec.key(device.name), revision) | run_isolated(spec, device, None, torchrun)


def sweep_slurm(suite: Suite, device_type: str, results_root: Path, options: dict[str, Any], force: bool = False,
                torchrun: tuple[str, ...] = (), log: TextIO = sys.stderr) -> list[dict[str, Any]]:
    """Submit every run without a stored record (any device's, same key) and store each as it is collected."""
    import submitit

    options = dict(options)
    folder = results_root / suite.name / ".submitit"
    executor = submitit.AutoExecutor(folder=folder, cluster=options.pop("cluster", None))
    gpus = max(r.nproc for r in suite.runs) if device_type == "cuda" else 0
    defaults = {"timeout_min": max(1, int(max(r.timeout_s for r in suite.runs) // 60) + 5), "nodes": 1,
                "tasks_per_node": 1, "name": f"bench-{suite.name}"} | ({"gpus_per_node": gpus} if gpus else {})
    executor.update_parameters(**(defaults | options))
    revision, start = git_revision(), time.monotonic()
    stored = {r.get("run_key"): r for r in results.load_records(results_root / suite.name)}
    records, jobs = [], []
    for spec in suite.runs:
        kept = next((r for k, r in stored.items() if r["run"] == spec.name and k == spec.key(r["device"])), None)
        if kept is not None and not force:
            print(f"{spec.name}: kept stored record ({kept['status']}, {kept['device']})", file=log)
            records.append(kept)
            continue
        job = executor.submit(remote_run, spec.to_dict(), device_type, tuple(torchrun), revision)
        print(f"{spec.name}: submitted as job {job.job_id} (logs in {folder})", file=log, flush=True)
        jobs.append((spec, job))
    for i, (spec, job) in enumerate(jobs, 1):
        record = _collect(spec, job) | {"run_index": suite.position(spec.name)}
        finish(record, records, results_root)
        print(f"[{i}/{len(jobs)}] {spec.name} on {record['device']}: {record['status']} "
              f"({int(time.monotonic() - start)} s)", file=log, flush=True)
    return records


def _collect(spec: RunSpec, job: Any) -> dict[str, Any]:
    """The job's record; a job that died (preempted, out of time) becomes an error record of the run."""
    try:
        out = job.result()
    except Exception as exc:  # noqa: BLE001  submitit re-raises the job's failure here
        first = (str(exc).strip().splitlines() or [""])[-1][:300]
        return {"suite": spec.suite, "run": spec.name, "device": "unknown", "status": "error",
                "message": f"slurm job {job.job_id} failed: {first}", "baseline": spec.baseline}
    if not isinstance(out, list):
        return out
    # Multi-node jobs return one record per node; the node holding rank 0 has the merged one.
    return next((r for r in out if r.get("world_size") or r["status"] == "ok"), out[0])
