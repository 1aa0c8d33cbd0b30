"""A run's phase, told by its process to the sweep waiting on it, which prints it as a heartbeat: a
CPU run's baseline alone can take ten minutes, and nothing else would show that it moves.

The run's process writes one line to the file ``BENCH_PROGRESS`` names (nothing where it is unset: a
run in a test or a Slurm job); a change of phase is written at once, steps within a phase at most
every few seconds."""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "BENCH_PROGRESS"
EVERY_S = 2.0  # the least time between two writes within a phase
_last = {"phase": "", "at": 0.0}


def say(phase: str, step: int | None = None, of: int | None = None) -> None:
    """``phase`` ("timed steps"), with ``step`` of ``of`` where it counts them."""
    path = os.environ.get(ENV)
    now = time.monotonic()
    if not path or (phase == _last["phase"] and now - _last["at"] < EVERY_S):
        return
    _last.update(phase=phase, at=now)
    if step is None:
        line = phase
    else:
        line = f"{phase}, step {step}/{of}"
    try:
        Path(f"{path}.tmp").write_text(line)
        os.replace(f"{path}.tmp", path)
    except OSError:  # the sweep's folder is gone: the run goes on without a heartbeat
        pass


def heard(path: Path) -> str:
    """The last phase the run said, or how far it got without saying one."""
    try:
        return path.read_text().strip() or "starting"
    except OSError:
        return "starting (imports, prediction)"
