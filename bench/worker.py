"""One run, inside its own process: build, apply techniques, warm up, measure, return a record.

Started by the runner as ``python -m bench.worker SPEC.json OUT.json``; exit status 0 whenever a
record was written (including status oom/unsupported/error), so the parent only has to deal with
the deaths it cannot see coming (signals, hard crashes).
"""

from __future__ import annotations

import faulthandler
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from bench import process_group, progress
from bench.data.synthetic import Batch, samples_in
from bench.data.varlen import Feed
from bench.errors import first_line
from bench.fidelity import run_fidelity
from bench.generate import Generator
from bench.measure import history
from bench.measure.flops import mfu
from bench.measure.memory import (
    cuda_peaks,
    model_state_bytes,
    nvml_process_bytes,
    overheads,
    rss_peak_bytes,
    tracked_step,
)
from bench.measure.timing import summarize, time_steps
from bench.measure.tracker import mark_trackers
from bench.models.weights import digest
from bench.predict import predict_run
from bench.provenance import runtime_provenance
from bench.recipe import Recipe, Stepper, batches, tracked_steps
from bench.record import (
    MEMORY_SUMMARY,
    Data,
    FidelityResult,
    Memory,
    Outcome,
    Record,
    Status,
    Timing,
)
from bench.spec import Job
from bench.suite import Fidelity, RunSpec
from bench.techniques import RunContext, Technique, Unsupported

SLOW_FIRST_STEP = 3.0  # × the other timed steps' median: a first step this slow was not warmed up
OOM_MESSAGES = ("out of memory", "not enough memory", "can't allocate memory")


def measure(
    spec: RunSpec,
    device: torch.device,
    snapshot: str | None = None,
    group: process_group.Group = process_group.Group(),
    prediction: Record | None = None,
    launched_at: float | None = None,
    measured: Callable[[Record], None] | None = None,
    history_path: str | None = None,
) -> Record:
    """One run, phase by phase: its own prediction (unless made ahead), build, warm-up, one
    instrumented step, the timed steps, and the fidelity phase; a technique that cannot run here
    ends it as unsupported before any of them. ``launched_at``: when the sweep launched the process
    (``startup_s`` counts from there); ``measured``: handed the memory and speed figures as soon as
    they are, before the fidelity phase; ``history_path`` (CUDA): where the allocator's history,
    from the build to the instrumented step, is saved (bench.measure.history)."""
    recipe = Recipe.of(spec, device, world_size=group.world_size, rank=group.rank)
    ctx, techniques, shapes = recipe.ctx, recipe.techniques, recipe.ctx.shapes
    if reason := recipe.unsupported():
        return Record(outcome=Outcome(status=Status.UNSUPPORTED, message=reason))
    predicted = prediction or _predicted(spec, device)  # its figures, and the seconds it took
    clock = time.perf_counter()
    if device.type == "cuda" and (history_path or snapshot):
        history.start(stacks=bool(snapshot))
    progress.say("building the model")
    trainer, batch, record = _build(spec, recipe)
    feed = recipe.feed()
    timing = Timing()
    if launched_at is not None:
        # process start, imports, prediction and build: what the device waited for
        timing.startup_s = round(time.time() - launched_at, 2)
    # Warm-up: allocator, cuDNN autotune, optimizer state, compilation. The first step is timed on
    # its own, since that is where one-off costs (compilation above all) land.
    progress.say("warm-up")
    warm = batches(batch, feed, shapes.warmup_steps)
    timing.first_step_ms = time_steps(lambda: trainer.step(next(warm)), 1, device)[0]
    for b in warm:
        trainer.step(b)
    memory = _memory_pass(
        trainer,
        batch,
        feed=feed,
        steps=shapes.measure_steps,
        techniques=techniques,
        device=device,
        snapshot=snapshot,
    )
    if device.type == "cuda" and history_path:
        history.save(Path(history_path))
        memory.memory_history = Path(history_path).name
    elif device.type == "cuda" and snapshot:
        history.stop()
    # Data-parallel ranks each take their own batch: a step of the group processes that many.
    ranks = max((t.replicas(group.world_size) for t in techniques), default=1)
    timed = _timed_pass(trainer, batch, feed=feed, samples=samples_in(batch) * ranks, ctx=ctx)
    # the step's FLOP and operator counts are the prediction's
    timing.flops_per_step = predicted.prediction.flops_per_step
    timing.ops_per_step = predicted.prediction.ops_per_step
    timing.op_bytes_per_step = predicted.prediction.op_bytes_per_step
    record |= timed | Record(memory=memory, timing=timing) | predicted
    record |= _counts(trainer, record.memory)
    if device.type == "cuda":
        name, tf32 = torch.cuda.get_device_name(device), torch.backends.cuda.matmul.allow_tf32
        record.timing |= mfu(record, name, tf32)
    # build, warm-up, instrumented and timed steps
    record.timing.measure_s = round(time.perf_counter() - clock, 2)
    record.outcome |= Outcome(status=Status.OK, message="")
    if (fid := spec.fidelity(device.type)) is not None:
        if measured is not None:  # kept by the sweep if the fidelity phase is cut short
            measured(record)
        del trainer, batch  # free the measured model before training another
        progress.say("fidelity phase (accuracy)")
        clock = time.perf_counter()
        record |= Record(fidelity=_fidelity(spec, fid, device))
        record.timing.fidelity_s = round(time.perf_counter() - clock, 2)
    return record


def _predicted(spec: RunSpec, device: torch.device) -> Record:
    progress.say("predicting its peak")
    return predict_run(spec, device.type)  # before anything real is allocated


def _build(spec: RunSpec, recipe: Recipe) -> tuple[Stepper, Batch, Record]:
    """The model on its device, wrapped with its techniques in a trainer (or predictor); the
    synthetic batch every step takes; and what the build reports (what loading the weights found,
    their digest)."""
    if recipe.ctx.device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed shapes: let warm-up pick the fastest kernels
    model, loaded = recipe.model(spec.weights)
    record = Record(provenance=loaded)
    if spec.weights:  # once per run: the fidelity phase loads the same file again for each seed
        record.provenance.weights_sha256 = digest(spec.weights)
    return recipe.stepper(model), recipe.batch(), record


def _memory_pass(
    trainer: Stepper,
    batch: Batch,
    feed: Feed | None,
    steps: int,
    techniques: list[Technique],
    device: torch.device,
    snapshot: str | None,
) -> Memory:
    """One instrumented step (every timed batch, on variable-length data), kept out of the timing
    since the tracker slows it; with ``snapshot``, the allocator's history up to it, with stacks, is
    saved there for pytorch.org/memory_viz."""
    progress.say("instrumented step (memory)")
    if all(t.trackable for t in techniques):
        # on variable-length data, each step's peak too: the worst step, as it came
        ended = mark_trackers if feed is not None else None
        step = tracked_steps(trainer, batch, feed, steps, ended=ended)
        memory = tracked_step(
            step,
            trainer.model,
            trainer.optimizer,
            device,
            compiled_update=any(t.compiled_update for t in techniques),
            phases=trainer if isinstance(trainer, Generator) else None,
            marked=ended is not None,
        )
    else:  # a compiled model (torch.compile) runs no Python the tracker could see
        memory = model_state_bytes(trainer.model, trainer.optimizer, device.type)
    if snapshot:
        torch.cuda.memory._dump_snapshot(snapshot)
        memory.snapshot = Path(snapshot).name
    return memory


def _timed_pass(
    trainer: Stepper, batch: Batch, feed: Feed | None, samples: int, ctx: RunContext
) -> Record:
    """The timed steps, and on CUDA the allocator's and NVML's figures over them alone."""
    device = ctx.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        # retries and OOMs of the timed steps only
        torch.cuda.reset_accumulated_memory_stats(device)
    todo, n = batches(batch, feed, ctx.shapes.measure_steps), ctx.shapes.measure_steps
    steps = iter(range(1, n + 1))
    # on variable-length data, what the allocator holds after each step (read on the host, where
    # the allocator works: no synchronisation)
    reserved: list[int] = []
    held = device.type == "cuda" and feed is not None

    def step() -> None:
        progress.say("timed steps", next(steps), n)
        trainer.step(next(todo))
        if held:
            reserved.append(torch.cuda.memory_reserved(device))

    cpu_clock = time.process_time()
    times = time_steps(step, n, device)
    record = Record()
    if device.type == "cuda":
        memory = cuda_peaks(device)
        memory.step_reserved_bytes = reserved or None
        if (now := nvml_process_bytes(device)) is not None:
            # NVML reads the process as it is now, when the cache may hold less than at its peak
            # (empty-cache empties it every step): what it holds beyond the allocator's reserve now
            # is the context, and the process at its peak is that beside the reserve's peak.
            context = now - torch.cuda.memory_reserved(device)
            memory.nvml_process_bytes = context + memory.peak_reserved_bytes
        record.memory |= memory | overheads(memory)
        # The seed article's monitor, over the timed steps: the runner saves it beside the record.
        record.extra[MEMORY_SUMMARY] = torch.cuda.memory_summary(device)
    else:
        record.timing = share(time.process_time() - cpu_clock, sum(times) / 1e3)
    if ctx.model_spec.inputs == "tokens" and feed is None:
        tokens = ctx.shapes.seq_len
    else:
        tokens = None
    if isinstance(trainer, Generator):
        tokens = ctx.shapes.new_tokens
        record.timing |= generation_figures(trainer.timings(n), samples, tokens)
    record.timing |= summarize(times, samples, tokens) | Timing(step_times_ms=times)
    record.outcome.warning = _warm_up_check(times, ctx.shapes.warmup_steps)
    if feed is not None:
        record |= loader_figures(feed, times)
    record.memory.rss_peak_bytes = rss_peak_bytes()
    return record


def generation_figures(
    timings: list[tuple[float, float]], sequences: int, new_tokens: int
) -> Timing:
    """The time to the first token (median and quartiles over the timed steps) and the decoding
    rate: the tokens after the first, over every sequence, per second of the median step's
    decoding."""
    firsts, rests = ([t[i] for t in timings] for i in (0, 1))
    q, r = (statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3 for ms in (firsts, rests))
    rate = lambda ms: sequences * (new_tokens - 1) / (ms / 1e3)  # noqa: E731  the tokens after the first
    return Timing(
        ttft_ms_median=statistics.median(firsts),
        ttft_ms_p25=q[0],
        ttft_ms_p75=q[2],
        decode_tokens_per_s=rate(statistics.median(rests)),
        decode_tokens_per_s_p25=rate(r[2]),  # the slower quarter's decoding
        decode_tokens_per_s_p75=rate(r[0]),
    )


# a CPU run whose process got less than this share of its threads' time over the timed steps
BUSY = 0.75


def share(cpu_s: float, wall_s: float) -> Timing:
    """How much of the machine a CPU run's timed steps got: the CPU time of its process over the
    wall time times its threads, and the load average. The machine was busy where both say so: the
    process got under BUSY of its share while more was runnable than the machine has cores (a tiny
    model's step, Python-bound, leaves its other threads idle on a quiet machine too). Its
    throughput then measures the neighbours as much as the technique: the record says so
    (``busy_machine``), and reports mark it."""
    if wall_s > 0:
        got = cpu_s / (wall_s * torch.get_num_threads())
    else:
        got = None
    load = os.getloadavg()[0]
    return Timing(
        load_average=round(load, 2),
        cpu_share=None if got is None else round(got, 3),
        busy_machine=got is not None and got < BUSY and load > (os.cpu_count() or 1),
    )


def loader_figures(feed: Feed, times_ms: list[float]) -> Record:
    """What variable-length batches cost and carry over the timed steps: the tokens per second in
    the batch (padding included) and of real sequence (excluded), each batch's padding fraction, and
    the host's wait on the loader inside each step."""
    seconds = sum(times_ms) / 1e3
    real, total = (sum(column) for column in zip(*feed.tokens))
    data = Data(
        real_tokens_per_s=real / seconds,
        padding_fraction=1 - real / total,
        padding_fraction_per_batch=[round(1 - r / t, 4) for r, t in feed.tokens],
        loader_wait_ms_median=statistics.median(feed.waits_ms),
        loader=feed.batching.name,
        lengths=feed.shapes.lengths,
        loader_workers=feed.shapes.loader_workers,
    )
    return Record(timing=Timing(tokens_per_s=total / seconds), data=data)


def _warm_up_check(times: list[float], warmup_steps: int) -> str | None:
    """A warning when the first timed step is far slower than the others: a one-off cost
    (compilation, autotuning, torchao's first update) landed in the timed steps, and warm-up was too
    short for it."""
    rest = sorted(times[1:])
    if not rest:
        return None
    median = rest[len(rest) // 2]
    if times[0] <= SLOW_FIRST_STEP * median:
        return None
    return (
        f"the first timed step took {times[0]:,.0f} ms against {median:,.0f} ms for the others: "
        f"{warmup_steps} warm-up step(s) did not absorb a one-off cost; raise warmup_steps"
    )


def _counts(trainer: Stepper, memory: Memory) -> Record:
    """Parameter counts, model states as the sharding formulas count them (ZeRO: 16·Ψ per rank for
    Adam, 16·Ψ/N fully sharded), and the trainer's proof that each technique took effect."""
    params = list(trainer.model.parameters())
    states = (memory.param_bytes, memory.gradient_bytes, memory.optimizer_state_bytes)
    counted = Memory(
        param_count=sum(p.numel() for p in params),
        trainable_param_count=sum(p.numel() for p in params if p.requires_grad),
        model_state_bytes=sum(b or 0 for b in states),
    )
    return Record(memory=counted, outcome=Outcome(proof=trainer.proof()))


def _fidelity(spec: RunSpec, fid: Fidelity, device: torch.device) -> FidelityResult:
    """The fidelity phase's figures; a failure there is recorded beside the measurement, never
    instead of it."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        return run_fidelity(spec, fid, device)
    except Unsupported as exc:
        return FidelityResult(fidelity_error=f"unsupported: {exc}")
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        return FidelityResult(fidelity_error=f"{type(exc).__name__}: {first_line(exc)[:300]}")


def over_budget(result: Record, budget: int) -> Outcome | None:
    """On a CPU, where no allocator can be limited, a budget holds against the tracked peak of live
    tensor bytes, the figure a CPU run is measured by: a run over it is out of memory as it would be
    on a card."""
    peak = result.memory.peak_tensor_bytes
    if result.outcome.status != Status.OK or peak is None or peak <= budget:
        return None
    message = f"tracked peak {peak:,} bytes is over the budget of {budget:,} bytes"
    return Outcome(status=Status.OOM, message=message)


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in OOM_MESSAGES)


def main(spec_path: str, out_path: str) -> int:
    """Alone, or as one rank under torchrun: every rank measures, rank 0 writes the merged record. A
    rank that fails writes its own record beside it and exits 1, so torchrun stops the others at
    once instead of leaving them waiting in a collective."""
    # a hard crash (abort, segfault) leaves its Python stack in the run's stderr tail
    faulthandler.enable()
    job = Job.from_json(Path(spec_path).read_text())
    spec, prediction = job.spec, job.prediction
    # under a fake process group, which must be gone before the real one
    if prediction is None and spec.nproc > 1:
        prediction = predict_run(spec, job.device_type, rank=int(os.environ.get("RANK", "0")))
    group = process_group.join(job.device_type, spec.timeout_s)
    device = process_group.device_of(job.device_type, group)
    budget = job.budget_bytes
    provenance = runtime_provenance(device)
    try:
        if budget and device.type == "cuda":
            # a smaller card: the allocator refuses past the budget
            torch.cuda.set_per_process_memory_fraction(
                budget / torch.cuda.get_device_properties(device).total_memory, device
            )

        def partial(record: Record) -> None:  # kept by the sweep if the fidelity phase is cut short
            record.provenance |= provenance
            _write(f"{out_path}.measured", record)

        if prediction is None:  # here, so that a run that fails after it keeps it
            prediction = _predicted(spec, device)
        result = measure(
            spec,
            device,
            snapshot=job.snapshot if group.rank == 0 else None,
            group=group,
            prediction=prediction,
            launched_at=job.launched_at,
            measured=partial if group.world_size == 1 else None,  # a rank's: merged at the end
            history_path=job.history if group.rank == 0 else None,
        )
        if budget and device.type == "cpu" and (oom := over_budget(result, budget)):
            result.outcome |= oom
    except Unsupported as exc:
        result = Record(outcome=Outcome(status=Status.UNSUPPORTED, message=str(exc)))
    except Exception as exc:  # noqa: BLE001  a failed run is a result, not a crash of the sweep
        traceback.print_exc()
        result = _failed(exc, prediction, device, job.history if group.rank == 0 else None)
        if group.world_size > 1:
            result.outcome.failed_rank = group.rank
            result.distributed.world_size = group.world_size
            result.provenance |= provenance
            _write(f"{out_path}.rank{group.rank}", result)
            return 1
    result.provenance |= provenance
    per_rank = process_group.gather(result, group)
    if per_rank is not None:
        _write(out_path, process_group.merge(per_rank))
    process_group.leave(group)
    if group.world_size > 1:
        # Skip interpreter teardown: gloo's threads can still hold tensors then, and freeing them
        # without a live interpreter aborts the process (about 1 run in 20 under tensor-parallel)
        # after the record is already written. Nothing is left to flush but the standard streams.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _failed(
    exc: Exception, prediction: Record | None, device: torch.device, history_path: str | None
) -> Record:
    """A run that raised: out of memory or an error, with what was predicted for it and, on CUDA,
    the allocator's peaks and history up to the failure."""
    status = Status.OOM if is_oom(exc) else Status.ERROR
    message = f"{type(exc).__name__}: {first_line(exc)[:500]}"
    result = Record(outcome=Outcome(status=status, message=message))
    if prediction is not None:
        result = prediction | result
    if device.type == "cuda":
        result |= Record(memory=cuda_peaks(device))
        result.memory.memory_history = _history_to_failure(history_path)
    return result


def _history_to_failure(path: str | None) -> str | None:
    """The allocator's history up to the failure, saved as a finished run's is: an out-of-memory
    run's trace shows the request the card refused, to hold a predicted verdict against."""
    if path is None or not any(torch.cuda.memory._snapshot()["device_traces"]):  # noqa: SLF001  none recorded
        return None
    history.save(Path(path))
    return Path(path).name


def _write(path: str, record: Record) -> None:
    """The record as stored: one flat JSON object, written whole or not at all."""
    Path(f"{path}.tmp").write_text(json.dumps(record.to_flat(), default=str))
    os.replace(f"{path}.tmp", path)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
