"""Launchers: how a sweep's runs reach a device. The sweep (bench.sweep) plans what to measure and
stores what comes back; a launcher only starts runs and hands back their records.

- ``Local``: each run in its own process on this machine (forked from a preloaded server, or a fresh
  interpreter), or in its own torchrun for a multi-process run (bench.launch.local,
  bench.launch.process).
- ``Slurm``: each run as a Slurm job that does on its node what ``Local`` does here
  (bench.launch.slurm).

A launcher's ``running(todo, log)`` is a context manager giving the function that returns a task's
record without what the sweep adds when it stores it (its place in the suite, ``stored_at``). Local
runs start when their record is asked for, one at a time; Slurm's jobs are all submitted on entry.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, TextIO

import torch

from bench.provenance import device_name
from bench.record import DeviceType, Record
from bench.resume import Task


@dataclass(frozen=True)
class Device:
    type: DeviceType
    name: str  # e.g. "NVIDIA H100 80GB HBM3", or "cpu"
    count: int = 1  # GPUs visible on this node (a run's nproc may not exceed it)


def detect(requested: str = "auto") -> Device:
    """The device asked for ("cuda", "cpu"), or with "auto" a CUDA card where one is visible."""
    if requested != "auto":
        kind = DeviceType(requested)
    elif torch.cuda.is_available():
        kind = DeviceType.CUDA
    else:
        kind = DeviceType.CPU
    count = torch.cuda.device_count() if kind == DeviceType.CUDA else 1
    return Device(kind, device_name(kind), count)


class MeasuredThenStopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a run in its fidelity phase, after its memory and speed were
    measured: the sweep stores ``record`` (those figures, the phase marked interrupted) before it
    stops as an interrupt does. A launcher fills in the record as it would a finished run's."""

    def __init__(self, record: Record) -> None:
        super().__init__()
        self.record = record


class Launcher(Protocol):
    # The device the records will be filed under; None where only the runs find out (a Slurm node).
    device_name: str | None
    device_type: str
    snapshot: bool  # each run's CUDA allocator history is saved beside its record

    def running(
        self, todo: list[Task], log: TextIO
    ) -> AbstractContextManager[Callable[[Task], Record]]: ...
