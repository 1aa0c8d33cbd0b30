"""How a run's process starts: a fresh interpreter, or a fork of a server that has imported torch
already.

A fresh interpreter pays for torch's, torchvision's and transformers' imports on every run (4 to 12
s on a CI core). The fork server is multiprocessing's: a fresh interpreter, started once per sweep,
that imports ``PRELOAD`` and forks one child per run. The server never touches CUDA (its imports see
NVML for any availability check), so each child still creates its own CUDA context and caching
allocator, and starts with zeroed peaks; the child takes the run's environment and its own session
before the worker starts.

A run starts fresh where a fork cannot give it what it needs: several processes (torchrun), or an
environment variable set by a technique (torch reads some, like its allocator settings, at import or
at CUDA's start, and a fork would start with the server's).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from multiprocessing import forkserver
from pathlib import Path
from typing import Literal

Kind = Literal["fork", "fresh"]
KINDS: tuple[Kind, ...] = ("fork", "fresh")
PRELOAD = ["bench.launch.preload"]  # what a run imports, so that a forked one finds it imported
PRELOAD_IMPORTS = "BENCH_PRELOAD"  # and the modules of the sweep's models, comma-separated
# torch.cuda.is_available() through NVML: a check by the CUDA runtime would initialise its driver in
# the server, which every forked child would inherit unusable.
SERVER_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}


SWEEP_PID = "BENCH_SWEEP_PID"  # the process that asked for the run


class Process:
    """A run's process, forked or fresh, in its own session: ``wait`` and ``kill`` as for a
    Popen."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, kind: Kind) -> None:
        self.started = time.time()
        if kind == "fresh":
            with open(log, "w") as out:
                self._popen = subprocess.Popen(
                    [sys.executable, "-m", *argv],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.pid = self._popen.pid
            return
        self._popen = None
        env = env | {SWEEP_PID: str(os.getpid())}
        self._forked = _context().Process(target=_child, args=(argv, env, str(log)), daemon=False)
        self._forked.start()
        self.pid = self._forked.pid

    def wait(self, timeout: float | None = None) -> int:
        """The exit status (negative: killed by that signal); subprocess.TimeoutExpired past
        ``timeout``."""
        if self._popen is not None:
            return self._popen.wait(timeout)
        self._forked.join(timeout)
        if self._forked.exitcode is None:
            raise subprocess.TimeoutExpired("forked run", timeout or 0)
        return self._forked.exitcode

    def kill(self) -> None:
        """The run and everything it started (compile workers, torchrun's ranks)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:  # a fork killed before it made its own session
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.wait()


def start_server(imports: Iterable[str] = ()) -> None:
    """Start the fork server now, importing ``imports`` (the runs' models' modules) besides the
    harness, so that its imports overlap the caller's own work. A server already running keeps what
    it imported: a run that needs more imports it itself."""
    _context(imports)


def _context(imports: Iterable[str] = ()) -> multiprocessing.context.BaseContext:
    """The fork server, started on first use with ``PRELOAD`` and ``imports`` imported and
    ``SERVER_ENV`` in its environment."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    env = SERVER_ENV | {PRELOAD_IMPORTS: ",".join(sorted(set(imports)))}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        forkserver.ensure_running()  # a no-op while it runs; it starts with this environment
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return context


def _child(argv: list[str], env: dict[str, str], log: str) -> None:
    """In the forked child: its own session (a kill takes its group), the run's environment and
    output file, then the module as ``python -m`` would run it."""
    os.setsid()
    if _abandoned(env, log):
        os._exit(0)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    refuse_inherited_cuda()
    module, *args = argv
    if module != "bench.worker":
        raise ValueError(f"the fork server starts bench.worker only, not {module}")
    from bench.worker import main  # preloaded: no import cost

    sys.argv = [module, *args]
    sys.exit(main(*args))


def _abandoned(env: dict[str, str], log: str) -> bool:
    """Whether the run was asked for by a sweep that has gone since: a signal in its first seconds,
    while the server still imported torch, left the request behind it, and the run started after
    bench had exited (its temporary folder gone: a traceback on the terminal)."""
    if not Path(log).parent.is_dir():
        return True
    try:
        os.kill(int(env.get(SWEEP_PID, "0")) or os.getppid(), 0)
    except (ProcessLookupError, ValueError):
        return True
    except PermissionError:  # alive, another user's
        pass
    return False


def refuse_inherited_cuda() -> None:
    """A child forked from a process that had started CUDA cannot use it: fail loudly, never measure
    that."""
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("the fork server had initialised CUDA; run with --launcher fresh")


def fork_works_on_cuda(timeout_s: float = 120.0) -> str | None:
    """On a CUDA host, before a sweep forks its runs: why a forked child cannot allocate on the GPU,
    or None. One small fork (about a second) instead of a sweep of failed runs."""
    probe = _context().Process(target=_cuda_probe)
    probe.start()
    probe.join(timeout_s)
    if probe.exitcode is None:
        probe.kill()
        return f"a forked CUDA probe did not finish in {timeout_s:g} s"
    if probe.exitcode == 0:
        return None
    return f"a forked CUDA probe failed (exit status {probe.exitcode})"


def _cuda_probe() -> None:
    import torch

    refuse_inherited_cuda()
    # Poisoned: the server asked the CUDA runtime (not NVML) how many GPUs there are. Harmless to a
    # CPU run.
    if torch.cuda._is_in_bad_fork():  # noqa: SLF001
        raise RuntimeError("the fork server asked the CUDA runtime for its devices")
    torch.zeros(1, device="cuda").add_(1)
    torch.cuda.synchronize()
