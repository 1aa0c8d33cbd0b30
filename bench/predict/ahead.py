"""A run's own prediction, made in the run's process or ahead of it on the host's spare cores.

Every record carries the prediction of its own run, so the table can hold prediction against
measurement. Made inside the run's process it costs 1 to 6 s of the device's clock; on a GPU host
the sweep makes the pending runs' predictions ahead, in processes on the CPU cores, while the GPU
measures the runs before them.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import signal
import time
from multiprocessing.pool import AsyncResult

from bench.predict.fake import predict
from bench.record import Prediction, Record, Status, Timing
from bench.suite import RunSpec


def predict_run(spec: RunSpec, device_type: str, rank: int = 0) -> Record:
    """The run's prediction at the run's shapes (as its ``rank``, over several processes), modelling
    CUDA for a CUDA run and the CPU run exactly on a CPU, with the seconds it took: the part of the
    run's record it fills. A failed prediction is a status, never a cost to the measurement."""
    clock = time.perf_counter()
    try:
        out = predict(spec, spec.shapes(device_type), cuda=device_type == "cuda", rank=rank)
    except Exception as exc:  # noqa: BLE001
        out = Prediction.failed(Status.ERROR, f"{type(exc).__name__}: {exc}"[:300])
    return Record(prediction=out, timing=Timing(prediction_s=round(time.perf_counter() - clock, 2)))


def spawn_pool(processes: int) -> multiprocessing.pool.Pool:
    """Processes that each import torch afresh (a fork of a process that has run torch ops may
    deadlock in its thread pools). They ignore Ctrl-C: it reaches the parent only, which terminates
    the pool on its way out."""
    return multiprocessing.get_context("spawn").Pool(
        processes, initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN)
    )


def stop_pool(pool: multiprocessing.pool.Pool, interrupted: bool) -> None:
    """The pool's processes ended. Interrupted (SIGTERM to the process group, as `timeout` and Slurm
    send it), a worker may have died holding the pool's queue lock, and Pool.terminate would wait on
    that lock forever (13 minutes, once): the workers are killed outright instead, none respawned,
    and the pool's own finalizer, which would wait on the same lock at exit, is cancelled."""
    if not interrupted:
        pool.terminate()
        pool.join()
        return
    pool._worker_handler._state = multiprocessing.pool.TERMINATE  # no worker replaces a killed one
    for worker in pool._pool:
        worker.kill()
        worker.join()
    pool._terminate.cancel()


class Ahead:
    """Predictions of runs still to be measured, computed in ``jobs`` spawned processes in the order
    given; ``jobs`` = 0 makes none, and each run predicts itself."""

    def __init__(self, specs: list[RunSpec], device_type: str, jobs: int) -> None:
        self._pool = None
        self._pending: dict[tuple[str, str], AsyncResult] = {}
        if jobs < 1 or not specs:
            return
        self._pool = spawn_pool(min(jobs, len(specs)))
        self._pending = {
            (s.suite, s.name): self._pool.apply_async(predict_run, (s, device_type)) for s in specs
        }

    def get(self, spec: RunSpec) -> Record | None:
        """The run's prediction (waiting for it if it is still being made), or None: the run makes
        its own."""
        result = self._pending.pop((spec.suite, spec.name), None)
        if result is None:
            return None
        made: Record = result.get()
        made.prediction.ahead = True
        return made

    def __enter__(self) -> Ahead:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if self._pool is not None:
            # predictions of runs never reached (an interrupted sweep) are dropped
            stop_pool(self._pool, interrupted=kind is not None)
