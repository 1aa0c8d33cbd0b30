"""The record of one run, typed: what every field is, in which group, and its documentation
(results/README.md's field reference is generated from it). On disk a record stays one flat JSON
object, a key per field, so that it reads with any tool and loads into pandas as a row;
``Record.from_flat`` reads one, older records included (``migrate``), and ``to_flat`` writes it.
Figures derived from several records (the accuracy delta against the baseline) are computed when
reporting, never stored.

Nothing here imports the project: every layer that makes or reads records can use it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields, make_dataclass, replace
from enum import StrEnum
from typing import Any, ClassVar, Self

# stored by older records; recomputed on read
DERIVED = (
    "accuracy_delta",
    "accuracy_band",
    "outside_band",
)
RANK_PREFIX = "rank_"  # a multi-process run's per-rank lists: rank_<figure>


class Category(StrEnum):
    """What a storage alive at a peak was (a record's ``at_peak_<category>_bytes``): a model state,
    by what holds it, else what the phase that made it makes."""

    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"  # forward's (the batch, cloned before it, with them)
    TEMPORARIES = "temporaries"  # backward's and the optimizer step's
    KV_CACHE = "kv_cache"  # a generation's


AT_PEAK = tuple(Category)  # in the order records and reports list them


class Phase(StrEnum):
    """Where in a step a storage was made and a peak fell (``peak_phase``): a training step's three,
    or a generation's two forwards."""

    START = ""  # before the step's first forward (the batch's copy)
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    PREFILL = "prefill"  # the prompt, up to its first token
    DECODE = "decode"  # each token after the first


class DeviceType(StrEnum):
    """What a run measured on (``device_type``): a CUDA card, or this machine's processor. Suites
    give each its own shapes."""

    CUDA = "cuda"
    CPU = "cpu"


class Status(StrEnum):
    """How a run (``status``) or its prediction (``predicted_status``) ended; stored as its plain
    string."""

    OK = "ok"
    # out of memory: the device's, the host's OOM killer, or a --budget the tracked peak went over
    OOM = "oom"
    ERROR = "error"
    TIMEOUT = "timeout"
    UNSUPPORTED = "unsupported"  # the technique cannot apply here, with the reason
    UNPREDICTABLE = "unpredictable"  # predictions only: fake tensors cannot stand for the technique


def as_member(kind: type[StrEnum], stored: str | None) -> StrEnum | str | None:
    """A stored value as its member of ``kind``; one no member names (another tool's) stays as it
    was, for ``problems`` to name."""
    return kind(stored) if stored in kind._value2member_map_ else stored


# what a run's record may say
STATUSES = tuple(s.value for s in Status if s is not Status.UNPREDICTABLE)
# Outcomes another attempt would repeat: a resumed sweep keeps them (an error or a timeout is tried
# again).
DETERMINISTIC = (Status.OK, Status.OOM, Status.UNSUPPORTED)


# How a run over several processes folds a figure that differs by rank into the record's own value
# (every rank's is kept beside it as rank_<figure>): memory must fit on each device, so the largest;
# the group moves at its slowest rank's pace, so the smallest rate.
FOLDS = {"max": max, "min": min}
OVER_RANKS = {"max": " (over ranks: the largest)", "min": " (over ranks: the smallest)"}


def doc(text: str, default: Any = None, table: bool = False, ranks: str | None = None) -> Any:
    """A field with its documentation; absent (None) unless the run has the figure. ``table``: a
    column of the reports' summary table (COLUMNS); ``ranks``: how it folds over ranks (FOLDS)."""
    meta = {"doc": text, "column": table, "ranks": ranks}
    if isinstance(default, (list, dict)):
        return field(default_factory=type(default), metadata=meta)
    return field(default=default, metadata=meta)


def column(text: str, default: Any = None, ranks: str | None = None) -> Any:
    """A field that is also a column of the summary table."""
    return doc(text, default, table=True, ranks=ranks)


class Part:
    """A group of a record's fields (the groups below): a figure it lacks is None, and is absent
    from its stored form."""

    prefix: ClassVar[str] = ""  # before each field's name in the stored record

    def flat(self) -> dict[str, Any]:
        """As a record stores it: ``<prefix><field>`` for each field that has a value."""
        return {
            self.prefix + f.name: v
            for f in fields(self)  # every Part is a dataclass
            if (v := getattr(self, f.name)) is not None
        }

    def __or__(self, other: Self) -> Self:
        """This group with ``other``'s figures where it has them (as ``dict | dict``)."""
        return replace(
            self, **{f.name: v for f in fields(other) if (v := getattr(other, f.name)) is not None}
        )


@dataclass(kw_only=True)
class Identity(Part):
    """Which run: the suite's entry as it ran, and where."""

    suite: str = column("the suite's name")
    run: str = column("the run's name in the suite")
    run_index: int | None = doc("its place in the suite file (reports keep that order)")
    model: str = column("the model's registered name, or module:NAME")
    baseline: str = doc(
        "the suite's baseline run, which ratios and accuracy deltas are held against"
    )
    # None, not []: a part of a record (a run's outcome) merged into its identity keeps its labels
    techniques: list[str] | None = column(
        "the techniques' labels, with their options, in the order they applied"
    )
    device: str = column(
        "the device's name: the CUDA card's, or the processor model, thread count and vector "
        "instructions (AVX2, AVX512…)"
    )
    device_type: DeviceType | None = column("cuda or cpu")
    batch_size: int | None = column("the measured steps' batch size (per rank)")
    image_size: int | None = doc("image models: the side of the square input")
    seq_len: int | None = doc(
        "token models: tokens per sequence (generation: the prompt and the new tokens)"
    )
    prompt_len: int | None = column("generation: the prompt's tokens, per sequence")
    new_tokens: int | None = column(
        "generation: the tokens generated after the prompt, per sequence"
    )
    seed: int | None = doc(
        "seeds the model's initial weights, the batch and the fidelity phase's data order"
    )
    warmup_steps: int | None = doc("steps before anything is measured")
    measure_steps: int | None = doc("timed steps")
    nproc: int | None = doc("processes the run takes (torchrun's nproc-per-node)")
    spec: dict[str, Any] | None = doc("the full entry as loaded, options and defaults included")
    run_key: str | None = doc(
        "hash of spec and device: a stored record with the same key is kept on resume"
    )

    def __post_init__(self) -> None:
        self.device_type = as_member(DeviceType, self.device_type)


@dataclass(kw_only=True)
class Outcome(Part):
    """How the run ended."""

    status: Status | None = column(", ".join(STATUSES[:-1]) + " or " + STATUSES[-1])
    # absent unless said: a record merged in that says nothing of the outcome (an allocator's
    # peaks) leaves the reason a failure gave (the H200's first OOM records lost theirs to an "")
    message: str | None = column("empty when ok; else the reason")
    warning: str | None = column(
        "an ok run whose first timed step was far slower than the rest (warm-up too short)"
    )
    stderr_tail: str | None = doc("an error's last output (each rank's, under torchrun)")
    non_finite: list[str] | None = doc(
        "figures that came out NaN or infinite (a diverged fidelity phase's loss), stored as null "
        "so that any strict JSON reader reads the record"
    )
    failed_rank: int | None = doc("a multi-process run's rank that failed")
    proof: dict[str, Any] | None = doc(
        "each technique's evidence of application, read off the live run, as <technique>.<key>; "
        "the trainer's micro_batches and output_dtype"
    )

    def __post_init__(self) -> None:
        self.status = as_member(Status, self.status)


@dataclass(kw_only=True)
class Memory(Part):
    """What was alive: the tracker's live tensor bytes (every device), the CUDA allocator's and
    NVML's figures."""

    peak_tensor_bytes: int | None = column(
        "tracked peak of live tensor storages over one instrumented step", ranks="max"
    )
    peak_phase: str | None = column(
        "where that peak fell: forward, backward or optimizer (generation: prefill or decode)"
    )
    peak_prefill_bytes: int | None = column(
        "generation: tracked peak while the prompt is processed, up to its first token"
    )
    peak_decode_bytes: int | None = column(
        "generation: tracked peak over the tokens after the first"
    )
    kv_cache_bytes: int | None = column(
        "generation: the key-value cache's bytes on the device after the last token (its largest)"
    )
    activation_bytes: int | None = column("bytes a forward leaves alive for backward", ranks="max")
    gradient_bytes: int | None = doc("gradients alive after backward", ranks="max")
    param_bytes: int | None = doc("the model's parameters", ranks="max")
    buffer_bytes: int | None = doc("the model's buffers", ranks="max")
    optimizer_state_bytes: int | None = doc("the optimizer's state", ranks="max")
    model_state_bytes: int | None = column(
        "parameters + gradients + optimizer state on one rank (the ZeRO quantity)", ranks="max"
    )
    host_peak_bytes: int | None = column(
        "host memory the step holds for the device at its most (offloaded activations, an "
        "optimizer on the host, the scalars CUDA keeps there): pageable tensors' bytes plus the "
        "blocks the pinned host allocator holds; absent where the device is the host",
        ranks="max",
    )
    host_pinned_bytes: int | None = doc(
        "of which pinned: the caching host allocator's blocks (each a power of two, cached once "
        "freed, never given back)",
        ranks="max",
    )
    at_peak_parameters_bytes: int | None = column("alive at the tracked peak: parameters")
    at_peak_buffers_bytes: int | None = column("alive at the tracked peak: buffers")
    at_peak_gradients_bytes: int | None = column("alive at the tracked peak: gradients")
    at_peak_optimizer_state_bytes: int | None = column("alive at the tracked peak: optimizer state")
    at_peak_activations_bytes: int | None = column(
        "alive at the tracked peak: made by a forward, the input included"
    )
    at_peak_temporaries_bytes: int | None = column(
        "alive at the tracked peak: made in backward or the optimizer step"
    )
    at_peak_kv_cache_bytes: int | None = column(
        "alive at the tracked peak: the key-value cache (generation)"
    )
    step_peak_bytes: list[int] | None = doc(
        "variable-length data: the tracked peak of each step of the instrumented pass, in order "
        "(their largest is peak_tensor_bytes)"
    )
    step_reserved_bytes: list[int] | None = doc(
        "CUDA, variable-length data: what the caching allocator holds after each timed step, in "
        "order (the drift --epoch predicts)"
    )
    param_count: int | None = doc("parameters")
    trainable_param_count: int | None = doc("parameters that require gradients")
    rss_peak_bytes: int | None = column("the run process's peak resident host memory", ranks="max")
    rss_peak_tensor_bytes: int | None = doc(
        "a CPU run under MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0 (glibc handing "
        "every tensor's pages back): the instrumented step's peak as the process's resident memory "
        "says it, the tensor bytes alive as it began and its resident growth over it (Linux)",
        ranks="max",
    )
    peak_allocated_bytes: int | None = column(
        "CUDA: torch.cuda.max_memory_allocated over the timed steps", ranks="max"
    )
    peak_reserved_bytes: int | None = column(
        "CUDA: the caching allocator's reserved peak over the timed steps", ranks="max"
    )
    peak_active_bytes: int | None = doc("CUDA: the allocator's active-bytes peak", ranks="max")
    alloc_retries: int | None = doc(
        "CUDA: allocations retried after freeing the cache (fragmentation)", ranks="max"
    )
    cuda_ooms: int | None = doc("CUDA: out-of-memory errors the allocator raised", ranks="max")
    nvml_process_bytes: int | None = column(
        "CUDA: what NVML charges the process (context included)", ranks="max"
    )
    pinned_host_bytes: int | None = doc(
        "CUDA: what the caching host allocator holds pinned after the timed steps "
        "(torch.cuda.host_memory_stats' allocated_bytes): every block pinned since the process "
        "began, the tracked host_pinned_bytes' twin",
        ranks="max",
    )
    context_bytes: int | None = column(
        "CUDA: NVML's figure minus reserved: the context and libraries", ranks="max"
    )
    cache_slack_bytes: int | None = column(
        "CUDA: reserved minus allocated at their peaks", ranks="max"
    )
    snapshot: str | None = doc("CUDA, --snapshot: the allocator history file beside the record")
    memory_history: str | None = doc(
        "CUDA: the allocator's own history of the run, from the build to the instrumented step, "
        "beside the record (<run>.history.pickle.gz; bench.measure.history replays it)"
    )
    memory_summary: str | None = doc(
        "CUDA: the file beside the record with torch.cuda.memory_summary()"
    )


@dataclass(kw_only=True)
class Timing(Part):
    """How fast, and where the run's time went."""

    first_step_ms: float | None = doc(
        "the first warm-up step, where one-off costs (compilation) land"
    )
    step_time_ms_median: float | None = column(
        "median timed step (CUDA events on a GPU, wall clock on a CPU)", ranks="max"
    )
    step_time_ms_p25: float | None = column("first quartile of the timed steps", ranks="max")
    step_time_ms_p75: float | None = column("third quartile of the timed steps", ranks="max")
    step_time_ms_min: float | None = doc("fastest timed step", ranks="min")
    step_time_ms_max: float | None = doc("slowest timed step", ranks="max")
    step_times_ms: list[float] | None = doc("every timed step")
    samples_per_s: float | None = column(
        "samples a step processes (every rank's, data-parallel) over the median step", ranks="min"
    )
    tokens_per_s: float | None = column(
        "token models: tokens in the batch (padding included) per second; generation: new tokens",
        ranks="min",
    )
    ttft_ms_median: float | None = column(
        "generation: median time to the first token (the prompt's prefill and its sampling)"
    )
    ttft_ms_p25: float | None = doc("generation: first quartile of the time to the first token")
    ttft_ms_p75: float | None = doc("generation: third quartile of the time to the first token")
    decode_tokens_per_s: float | None = column(
        "generation: tokens after the first, over every sequence of the batch, per second of "
        "decoding (median step)"
    )
    decode_tokens_per_s_p25: float | None = doc(
        "generation: the decoding rate of the third quartile's decoding time (a slower step's)"
    )
    decode_tokens_per_s_p75: float | None = doc(
        "generation: the decoding rate of the first quartile's decoding time (a faster step's)"
    )
    flops_per_step: int | None = column("the step's FLOPs, counted on fake tensors")
    ops_per_step: int | None = doc(
        "operators the step dispatches, views aside, counted on fake tensors: each a kernel "
        "launch, the fixed cost eager PyTorch pays however small the tensors"
    )
    op_bytes_per_step: int | None = doc(
        "bytes of the tensors those operators take and make, counted on fake tensors: what crosses "
        "device memory, pointwise work's cost"
    )
    mfu: float | None = column(
        "CUDA: flops_per_step over the median step, against the card's dense peak"
    )
    mfu_dtype: str | None = doc("CUDA: the dtype whose peak mfu is held against")
    wall_s: float | None = column("the run's whole process, start-up included")
    startup_s: float | None = doc("launch to the first warm-up step: imports, prediction, build")
    prediction_s: float | None = doc("the prediction on fake tensors")
    measure_s: float | None = doc("build, warm-up, instrumented and timed steps")
    fidelity_s: float | None = doc("the fidelity phase")
    launcher: str | None = doc(
        "how the run's process started: fork (from a preloaded server) or fresh"
    )
    load_average: float | None = column(
        "CPU: the machine's 1-minute load average as the timed steps ended"
    )
    cpu_share: float | None = column(
        "CPU: the CPU time the run's process got over the timed steps, over their wall time times "
        "its threads (1.0: every thread ran throughout)"
    )
    busy_machine: bool | None = column(
        "CPU: cpu_share under 0.75, the process clearly got less than its share: its throughput "
        "says more about the machine's load than the technique, and no pick rests on it"
    )


@dataclass(kw_only=True)
class Data(Part):
    """Variable-length token data (a suite's ``lengths``): what the batches carried, and what
    feeding them cost."""

    lengths: str | None = doc(
        "the length distribution the sequences were drawn from (bench.data.varlen)"
    )
    loader: str | None = doc(
        "the technique that formed the batches: pad-to-max, dynamic-padding, packing, …"
    )
    loader_workers: int | None = doc(
        "the DataLoader's worker processes (0: collated in the step's process)"
    )
    real_tokens_per_s: float | None = column(
        "sequence tokens over the timed steps' time, padding excluded"
    )
    padding_fraction: float | None = column("padding over all tokens of the timed batches")
    padding_fraction_per_batch: list[float] | None = doc("each timed batch's padding fraction")
    loader_wait_ms_median: float | None = column(
        "median host time a timed step waited for its batch"
    )


# What the live-bytes tracker gives for one step: measured (Memory), and predicted on fake tensors
# (Prediction).
TRACKED = (
    "peak_tensor_bytes",
    "peak_phase",
    "peak_prefill_bytes",
    "peak_decode_bytes",
    "kv_cache_bytes",
    "activation_bytes",
    "gradient_bytes",
    "param_bytes",
    "buffer_bytes",
    "optimizer_state_bytes",
    "host_peak_bytes",
    "host_pinned_bytes",
    *(f"at_peak_{p}_bytes" for p in AT_PEAK),
)


@dataclass(kw_only=True)
class _PredictionOutcome(Part):
    status: Status | None = doc("ok, unsupported or unpredictable")
    message: str | None = doc(
        "why a prediction was not made; or, made, what its figures stand for (compile's: the "
        "eager step's)"
    )
    ahead: bool | None = doc("made in a spare process while the device measured earlier runs")
    world_size: int | None = doc(
        "multi-process runs: the processes of the fake group the rank was predicted in"
    )
    rank: int | None = doc(
        "multi-process runs: the rank predicted (every rank of a run predicts itself)"
    )
    traffic_all_reduce_bytes: int | None = doc(
        "bytes the rank sends (and receives) in all-reduces a step, in a ring"
    )
    traffic_all_gather_bytes: int | None = doc("the same for all-gathers")
    traffic_reduce_scatter_bytes: int | None = doc("the same for reduce-scatters")
    traffic_broadcast_bytes: int | None = doc("the same for broadcasts and scatters")
    largest_collective_bytes: int | None = doc(
        "the largest single collective's tensors: what a real rank may also hold at its peak while "
        "a collective waits for a peer"
    )
    depth: str | None = doc(
        "a model of many layers alike: whether its step was folded from its steps at a few layers "
        "(bench.predict.depth) or traced whole, and why"
    )
    card: str | None = doc("the card the step was replayed under (--card): its name")
    verdict: str | None = doc(
        "on that card: fits, fits after flushes (the allocator freed its cache and retried: each a "
        "pause), or out of memory"
    )
    flushes: int | None = doc("times the allocator freed its cache and retried on that card")
    paged_bytes: int | None = doc(
        "optimizer state in CUDA unified memory (a paged optimizer's): never the allocator's, "
        "counted by nvidia-smi while its pages sit on the card"
    )
    largest_free_bytes: int | None = doc(
        "the largest block the allocator held cached and free when allocation peaked "
        "(fragmentation: a request larger than it needs a new segment)"
    )
    oom_phase: str | None = doc("out of memory: the phase of the request the card could not hold")
    oom_request_bytes: int | None = doc("out of memory: that request's bytes")
    oom_reserved_bytes: int | None = doc(
        "out of memory: what the allocator held reserved when that request failed (not a peak: the "
        "step never reached its own)"
    )
    oom_step: int | None = doc(
        "out of memory over a whole pass of the data (--epoch): the step, from 1, whose request "
        "failed (0: the warm-up step before the pass)"
    )
    epoch_steps: int | None = doc("a whole pass replayed (--epoch): its steps")
    epoch_reserved_bytes: list[int] | None = doc(
        "a whole pass replayed (--epoch): what the allocator held reserved at the end of each "
        "step, to the one that ran out of memory (fragmentation shows as reserved that grows "
        "while the steps' own peaks do not)"
    )
    epoch_largest_free_bytes: list[int] | None = doc(
        "a whole pass replayed (--epoch): the largest block the allocator held cached and free "
        "when each step's allocation peaked, to the one that ran out of memory"
    )
    expandable_verdict: str | None = doc(
        "a whole pass whose allocator settings run out of memory or flush their cache (--epoch): "
        "the verdict with expandable_segments:True, the same pass replayed"
    )
    split_verdict: str | None = doc(
        "such a pass without max_split_size_mb: the largest of 512, 256, 128 and 64 MiB under "
        "which it does better, and its verdict ('fits with max_split_size_mb:128'), or that none "
        "does"
    )


# The tracked figures and the FLOPs, each documented as its measured twin, so that the two never
# drift apart. Those the report holds against their twins: the peak, and on CUDA the allocator's
# figures and nvidia-smi's.
COMPARED = (
    "peak_tensor_bytes",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "nvml_process_bytes",
)
_PredictedFigures = make_dataclass(
    "_PredictedFigures",
    [
        (
            f.name,
            f.type,
            doc(
                f"predicted: {f.metadata['doc']}",
                table=f.name in COMPARED,
                # each rank predicts itself: its peak is held against its own
                ranks=f.metadata["ranks"] if f.name == "peak_tensor_bytes" else None,
            ),
        )
        for group in (Memory, Timing)
        for f in fields(group)
        if f.name
        in (
            *TRACKED,
            "peak_allocated_bytes",
            "peak_reserved_bytes",
            "nvml_process_bytes",
            "flops_per_step",
            "ops_per_step",
            "op_bytes_per_step",
        )
    ],
    bases=(_PredictionOutcome,),
)


@dataclass
class Prediction(_PredictedFigures):
    """The step predicted on fake tensors before the run, at its shapes: the tracker's figures and
    the FLOPs, as predicted_*."""

    prefix: ClassVar[str] = "predicted_"

    def __post_init__(self) -> None:
        self.status = as_member(Status, self.status)

    @property
    def ok(self) -> bool:
        return self.status == Status.OK

    def at_peak(self) -> dict[str, int]:
        """What was alive at the predicted peak, by category (AT_PEAK), the empty ones left out."""
        return {p: v for p in AT_PEAK if (v := getattr(self, f"at_peak_{p}_bytes"))}

    def fits(self, budget: int) -> bool:
        """On a named card, its verdict (the step replayed through its allocator); else the peak
        against ``budget`` bytes for tensors."""
        if self.verdict is not None:
            return self.verdict != "out of memory"
        return self.peak_tensor_bytes <= budget

    @classmethod
    def of(cls, flat: dict[str, Any]) -> Prediction:
        """The prediction a record (or a cached prediction) stores; other keys are ignored."""
        return cls(
            **{
                f.name: flat[cls.prefix + f.name]
                for f in fields(cls)
                if cls.prefix + f.name in flat
            }
        )

    @classmethod
    def failed(cls, status: Status, message: str) -> Prediction:
        return cls(status=status, message=message)


@dataclass(kw_only=True)
class FidelityResult(Part):
    """Does the technique change what the model learns: trained on real data, evaluated on its
    held-out split."""

    accuracy: float | None = column("held-out accuracy (the first seed's)")
    accuracy_seeds: list[float] | None = doc(
        "the baseline: accuracy over each seed (their spread is the band)"
    )
    final_loss: float | None = column("mean training loss over the last 10 steps")
    grad_cosine: float | None = column(
        "first-step gradient against the plain model's, same batch, weights, dropout"
    )
    fidelity_test_loss: float | None = doc("held-out loss")
    fidelity_agreement: float | None = column(
        "inference suites: predictions equal to the fp32 model's"
    )
    fidelity_model: str | None = doc("the model trained (the run's, or the suite's stand-in)")
    fidelity_weights: str | None = doc("the weights it started from, if any")
    fidelity_dataset: str | None = doc("the dataset")
    fidelity_steps: int | None = doc("training steps")
    fidelity_train_size: int | None = doc("training samples")
    fidelity_test_size: int | None = doc("held-out samples")
    fidelity_error: str | None = column("the fidelity phase failed: why (the measurement stands)")
    fidelity_interrupted: bool | None = doc(
        "the fidelity phase was stopped by Ctrl-C or SIGTERM: the measurement is kept, and a sweep "
        "run again measures the run again"
    )


@dataclass(frozen=True)
class Accuracy:
    """A run's accuracy against its baseline's first seed (same initial weights and data order),
    and the noise band: the spread (max − min) of the baseline's accuracies over its seeds. Derived
    when reporting, never stored (DERIVED names its columns)."""

    delta: float
    band: float

    @property
    def outside_band(self) -> bool:
        return abs(self.delta) > self.band

    @classmethod
    def of(cls, run: FidelityResult, baseline: FidelityResult | None) -> Accuracy | None:
        """None where either lacks an accuracy."""
        if run.accuracy is None or baseline is None or baseline.accuracy is None:
            return None
        seeds = baseline.accuracy_seeds or [baseline.accuracy]
        return cls(run.accuracy - baseline.accuracy, max(seeds) - min(seeds))

    def flat(self) -> dict[str, Any]:
        """As a report's row holds it."""
        return dict(zip(DERIVED, (self.delta, self.band, self.outside_band), strict=True))


@dataclass
class Distributed(Part):
    """Multi-process runs: every figure is the worst rank's (largest memory and step time, smallest
    rate)."""

    world_size: int | None = column("processes in the run")
    peak_rank: int | None = doc("the rank whose figures the record shows")
    ranks: dict[str, list[Any]] = doc(
        "each rank's figure, in rank order, stored as rank_<figure>", {}
    )

    def flat(self) -> dict[str, Any]:
        """As a record stores it, each rank's figures as rank_<figure>."""
        own = {k: v for k, v in super().flat().items() if k != "ranks"}
        return own | {RANK_PREFIX + k: v for k, v in self.ranks.items()}


@dataclass(kw_only=True)
class Provenance(Part):
    """How, when and with what the run was measured."""

    git_revision: str | None = column(
        "the harness's commit, -dirty with uncommitted changes outside results/"
    )
    torch_version: str | None = column("torch")
    python_version: str | None = doc("Python")
    packages: dict[str, str] | None = doc(
        "versions of the optional packages the run's process imported"
    )
    package_notes: dict[str, str] | None = doc(
        "what an optional package said at import it could not load (kept out of the terminal)"
    )
    hostname: str | None = doc("the machine")
    cpu_threads: int | None = doc("torch's intra-op threads in the run")
    finished_at: str | None = column("UTC, when the run's process ended")
    stored_at: str | None = doc(
        "UTC to the microsecond, when the record was stored (what --force compares)"
    )
    cuda_version: str | None = doc("CUDA: the runtime torch was built with")
    cudnn_version: int | None = doc("CUDA: cuDNN")
    driver_version: str | None = doc("CUDA: the driver")
    device_memory_bytes: int | None = doc(
        "CUDA: the card's memory as CUDA sees it (torch's total_memory), less than its maker's "
        "figure by what the driver keeps"
    )
    allocator_conf: str | None = doc("CUDA: PYTORCH_CUDA_ALLOC_CONF as the run saw it")
    tf32_matmul: bool | None = doc(
        "CUDA: TF32 matmuls allowed (changes an fp32 baseline's speed and accuracy)"
    )
    tf32_cudnn: bool | None = doc("CUDA: TF32 convolutions allowed")
    cudnn_benchmark: bool | None = doc("CUDA: cuDNN autotuning on")
    weights: str | None = column("the measured run's pretrained weights, if any")
    weights_sha256: str | None = column("their digest")
    weights_loaded: int | None = doc("tensors loaded from them")
    weights_missing: int | None = doc("model tensors they lacked (kept their initialisation)")
    weights_missing_names: list[str] | None = doc("the first of those")
    weights_unused: int | None = doc("their tensors the model did not use")
    weights_unused_names: list[str] | None = doc("the first of those")


# Each group under the Record attribute that holds it, in the order the reference lists them.
GROUPS = {
    "identity": Identity,
    "outcome": Outcome,
    "memory": Memory,
    "timing": Timing,
    "data": Data,
    "prediction": Prediction,
    "fidelity": FidelityResult,
    "distributed": Distributed,
    "provenance": Provenance,
}
# the worker's torch.cuda.memory_summary(); stored beside the record
MEMORY_SUMMARY = "memory_summary_text"
# The summary table's stored columns, group by group: the fields declared with column().
COLUMNS = tuple(
    getattr(group, "prefix", "") + f.name
    for group in GROUPS.values()
    for f in fields(group)
    if f.metadata["column"]
)


class _Keys:
    """Every stored key, as an attribute of ``KEY`` (``KEY.peak_tensor_bytes ==
    "peak_tensor_bytes"``), derived from the groups: code reads a record through these names, so
    that a typo is an AttributeError where it is read rather than a silent None, and a renamed field
    is renamed everywhere."""

    def __init__(self) -> None:
        for group in GROUPS.values():
            prefix = getattr(group, "prefix", "")
            for f in fields(group):
                if f.name != "ranks":  # stored as rank_<figure> (RANK_PREFIX)
                    setattr(self, prefix + f.name, prefix + f.name)


KEY = _Keys()


@dataclass(kw_only=True)
class Record:
    identity: Identity = field(default_factory=Identity)
    outcome: Outcome = field(default_factory=Outcome)
    memory: Memory = field(default_factory=Memory)
    timing: Timing = field(default_factory=Timing)
    data: Data = field(default_factory=Data)
    prediction: Prediction = field(default_factory=Prediction)
    fidelity: FidelityResult = field(default_factory=FidelityResult)
    distributed: Distributed = field(default_factory=Distributed)
    provenance: Provenance = field(default_factory=Provenance)
    # keys no group documents: kept, never dropped
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_flat(cls, flat: dict[str, Any]) -> Record:
        """A stored record, after ``migrate``; keys no group knows go to ``extra``."""
        left = migrate(flat)
        ranks = {
            k[len(RANK_PREFIX) :]: left.pop(k) for k in list(left) if k.startswith(RANK_PREFIX)
        }
        groups = {}
        for name, group in GROUPS.items():
            prefix = getattr(group, "prefix", "")
            taken = {
                f.name: left.pop(prefix + f.name) for f in fields(group) if prefix + f.name in left
            }
            groups[name] = group(**taken)
        groups["distributed"].ranks = ranks
        return cls(**groups, extra=left)

    def __or__(self, other: Record) -> Record:
        """This record with ``other``'s figures where it has them (as their stored forms' ``|``)."""
        return Record.from_flat(self.to_flat() | other.to_flat())

    @classmethod
    def merged(cls, per_rank: list[Record]) -> Record:
        """One record of a run over several processes: the rank with the highest peak speaks for
        the breakdown, each field with a rule (``ranks``, FOLDS) takes it over every rank's value
        and keeps them all, and a rank that did not end ok overrides what it has."""
        worst = max(
            per_rank,
            key=lambda r: r.memory.peak_allocated_bytes or r.memory.peak_tensor_bytes or 0,
        )
        out = copy.deepcopy(worst)
        out.distributed.world_size = len(per_rank)
        out.distributed.peak_rank = per_rank.index(worst)
        for name, group in GROUPS.items():
            prefix = getattr(group, "prefix", "")
            for f in fields(group):
                if (rule := f.metadata["ranks"]) is None:
                    continue
                values = [getattr(getattr(r, name), f.name) for r in per_rank]
                if any(v is not None for v in values):
                    out.distributed.ranks[prefix + f.name] = values
                    setattr(
                        getattr(out, name), f.name, FOLDS[rule](v for v in values if v is not None)
                    )
        failed = next((r for r in per_rank if r.outcome.status != Status.OK), None)
        if failed is None:
            return out
        return cls.from_flat(out.to_flat() | failed.to_flat())

    def to_flat(self) -> dict[str, Any]:
        """The stored form: one key per field that has a value (a figure a device cannot give is
        absent)."""
        out: dict[str, Any] = {}
        for name in GROUPS:
            out |= getattr(self, name).flat()
        return out | self.extra


KINDS = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "Status": (str,),
    "DeviceType": (str,),
    "bool": (bool,),
    "list": (list,),
    "dict": (dict,),
}
LARGEST = 2**63  # no figure of a run is larger; 10**400 overflowed the reports' arithmetic


def problems(flat: dict[str, Any]) -> list[str]:
    """Each field whose stored value is not of its documented type ("accuracy: expected float, got
    str '87%'"): a hand edit or another tool's record, which readers would otherwise trip over one
    by one."""
    found = []
    for group in GROUPS.values():
        prefix = getattr(group, "prefix", "")
        for f in fields(group):
            key, value = prefix + f.name, flat.get(prefix + f.name)
            if value is None or f.name == "ranks":
                continue
            kinds = [
                k for k in (k.strip().split("[")[0] for k in str(f.type).split("|")) if k != "None"
            ]
            allowed = tuple(t for k in kinds for t in KINDS.get(k, (object,)))
            # True is an int to Python, not a figure
            numeric = "bool" not in kinds and isinstance(value, bool)
            if numeric or not isinstance(value, allowed):
                found.append(
                    f"{key}: expected {' or '.join(kinds)}, got {type(value).__name__} "
                    f"{str(value)[:40]!r}"
                )
            elif (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and abs(value) >= LARGEST
            ):
                found.append(f"{key}: {str(value)[:40]}… is out of any figure's range")
    return found


def migrate(flat: dict[str, Any]) -> dict[str, Any]:
    """An older record in today's form: techniques were one label (``"a + b"``, ``"baseline"``), and
    the accuracy delta was stored with the record rather than derived when reporting."""
    out = {k: v for k, v in flat.items() if k not in DERIVED}
    if isinstance(out.get("techniques"), str):
        label = out["techniques"]
        if label == "baseline":
            out["techniques"] = []
        else:
            out["techniques"] = label.split(" + ")
    return out


def label(techniques: list[str]) -> str:
    """The techniques as one label, as tables and plots show them."""
    return " + ".join(techniques) or "baseline"


def reference() -> str:
    """The field reference of results/README.md: one table per group, in the groups' order."""
    parts = []
    for title, group in GROUPS.items():
        prefix = getattr(group, "prefix", "")
        rows = [
            f"| `{RANK_PREFIX + '<figure>' if f.name == 'ranks' else prefix + f.name}` | "
            f"{f.metadata['doc']}{OVER_RANKS.get(f.metadata['ranks'], '')} |"
            for f in fields(group)
        ]
        parts.append(
            f"### {title}\n\n{' '.join(group.__doc__.split())}\n\n| field | what it is "
            "|\n|---|---|\n" + "\n".join(rows)
        )
    return "\n\n".join(parts) + "\n"
