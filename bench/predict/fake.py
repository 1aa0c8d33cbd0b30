"""One run's step on fake tensors, counted as the worker counts a real one: the predicted peak, its
breakdown and FLOPs. Fake tensors hold no values and run meta kernels; bench.predict.stand_ins makes
them behave as real ones where that changes what is counted."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils.flop_counter import flop_registry, shape_wrapper

from bench.errors import first_line
from bench.generate import Generator
from bench.measure.allocator import Conf, Replay, cublas_workspaces
from bench.measure.host import is_unified, on_host
from bench.measure.memory import Tracked, optimizer_state, replayed, track, tracked_memory
from bench.measure.tracker import CUDA_BLOCK, LiveBytes, NotRepeating, mark_trackers
from bench.models import ModelSpec
from bench.predict import depth, ranks
from bench.predict.cards import CARDS, Card
from bench.predict.cuda import KERNELS, as_cuda, host_state
from bench.predict.stand_ins import (
    OutputsAsReal,
    ScalarsRead,
    compiled_as_eager,
    generation_as_real,
    masks_as_real,
    parameters_as_real,
    techniques_as_real,
)
from bench.recipe import Recipe, batches, tracked_steps
from bench.record import Prediction, Status
from bench.suite import RunSpec, Shapes
from bench.techniques import RunContext, Unsupported
from bench.train import Trainer

CPU = torch.device("cpu")
aten = torch.ops.aten


def predict(
    spec: RunSpec,
    shapes: Shapes | None = None,
    cuda: bool = True,
    world_size: int | None = None,
    rank: int = 0,
    card: Card | None = None,
    reserved: bool = True,
) -> Prediction:
    """``traced``'s prediction."""
    return traced(
        spec, shapes, cuda, world_size, rank=rank, card=card, reserved=reserved
    ).prediction


@dataclass(frozen=True)
class Traced:
    """A prediction and the tracker whose step it reads (None where the step was not traced): its
    timeline, and the step before's where the allocator is replayed (bench.predict.lines)."""

    prediction: Prediction
    tracker: LiveBytes | None = None
    replay: Replay | None = None  # the allocator it was replayed through (its steps aside)


def traced(
    spec: RunSpec,
    shapes: Shapes | None = None,
    cuda: bool = True,
    world_size: int | None = None,
    rank: int = 0,
    card: Card | None = None,
    reserved: bool = True,
) -> Traced:
    """Predicted peak and breakdown of one run at ``shapes`` (default: its GPU shapes); ``cuda``
    models the CUDA allocator's granularity and CUDA-only techniques, else the CPU run as measured
    here. A run over several processes is predicted as its ``rank`` of ``world_size`` (default: the
    entry's nproc), with the bytes its collectives move per step. For CUDA, the step is replayed
    through the caching allocator on ``card`` (default: an H100 without a cap), which gives the
    reserved peak, the process's memory as NVML counts it and, on a named card, the verdict; without
    a card, ``reserved=False`` leaves that replay (and the first step it tracks) out, for searches
    that hold only the peak against a budget."""
    world_size = world_size or spec.nproc

    def made() -> Recipe:  # built again for a second trace: techniques keep what they applied to
        at = shapes or spec.gpu
        return Recipe.of(spec, CPU, at, predicting=cuda, world_size=world_size, rank=rank)

    recipe = made()
    model = recipe.ctx.model_spec
    unpredictable = [f"{model.name}: {model.unpredictable}"] if model.unpredictable else []
    unpredictable += [f"{t.name}: {t.unpredictable}" for t in recipe.techniques if t.unpredictable]
    if reason := next(iter(unpredictable), None):
        return Traced(Prediction.failed(Status.UNPREDICTABLE, reason))
    if reason := recipe.unsupported():
        return Traced(Prediction.failed(Status.UNSUPPORTED, reason))
    try:
        with ranks.fake_group(world_size, rank):
            if cuda and (reserved or card):
                replay = _replay(card, recipe)
            else:
                replay = None
            if cuda:
                rounding = CUDA_BLOCK
            else:
                rounding = 1
            prediction, tracker = _stepped(spec, recipe, made, rounding, replay)
            prediction = replayed_through(prediction, tracker, replay)
    except Unsupported as exc:  # a kernel CUDA would refuse: the run would be unsupported there too
        return Traced(Prediction.failed(Status.UNSUPPORTED, str(exc)))
    except Exception as exc:  # noqa: BLE001  a technique that needs real values (e.g. .item()) cannot be predicted
        message = f"{type(exc).__name__}: {first_line(exc)[:200]}"
        return Traced(Prediction.failed(Status.UNPREDICTABLE, message))
    prediction = finished(prediction, card)
    notes = [f"{t.name}: {t.approximate}" for t in recipe.techniques if t.approximate]
    if model.note:
        notes.insert(0, model.note)
    if notes:
        prediction.message = "; ".join(notes)
    return Traced(prediction, tracker, replay)


def finished(prediction: Prediction, card: Card | None) -> Prediction:
    """A step's prediction, its replay done, as the process would be: nvidia-smi's figure, the
    card."""
    if prediction.peak_reserved_bytes is not None:
        on = card or CARDS["h100"]
        # pages of unified memory (a paged optimizer's) count for nvidia-smi while they are on the
        # card
        resident = prediction.paged_bytes or 0
        prediction.nvml_process_bytes = prediction.peak_reserved_bytes + on.context + resident
    prediction.status = Status.OK
    prediction.card = card and card.name
    return prediction


def _replay(card: Card | None, recipe: Recipe) -> Replay:
    """The allocator the step is replayed through: cuBLAS's workspaces first, under the card's
    capacity."""
    hopper = card is None or card.hopper
    conf = next((c for t in recipe.techniques if (c := t.env().get("PYTORCH_CUDA_ALLOC_CONF"))), "")
    workspaces = cublas_workspaces(hopper, not recipe.inference)
    on = card or CARDS["h100"]
    return Replay(
        workspaces=workspaces,
        capacity=card.capacity if card else None,
        memory=on.memory,
        conf=Conf.parse(conf),
        epoch=recipe.ctx.shapes.epoch,
    )


# The kinds of step that did not fold in this process, and why: a search predicts one run at many
# batches or lengths, and a fold that fails costs its three shallow steps each time. The whole step
# is traced for them at once (it is the same prediction either way).
UNFOLDED: dict[tuple, str] = {}
# Each kind of step's fold as proven at its three depths (depth.fold): at another size (a search's
# next batch or prompt) its steps at the first two depths alone are traced and refolded by it.
TEMPLATES: dict[tuple, depth.Template] = {}
FOLDED = ", ".join(map(str, depth.DEPTHS[:-1])) + f" and {depth.DEPTHS[-1]} of them"
REFOLDED = f"{' and '.join(map(str, depth.DEPTHS[:2]))} of them, as proven at {depth.DEPTHS[2]}"


def _stepped(
    spec: RunSpec,
    recipe: Recipe,
    made: Callable[[], Recipe],
    rounding: int,
    replay: Replay | None,
) -> tuple[Prediction, LiveBytes]:
    """The step traced whole, or, for a model of many layers alike, folded from its steps at a few
    layers (bench.predict.depth), and its tracker; where ``replay`` is given, the step before is
    traced as the allocator replays it."""
    # built once per model and shape but for the batch: a search asks at many batches
    one = dataclasses.replace(recipe.ctx.shapes, batch_size=1)
    layers, why = _depth_of(recipe.ctx.model_spec, one)
    if placed := [t.name for t in recipe.techniques if not t.layers_alike()]:
        why = f"{', '.join(placed)} treats layers by their place"
    # what decides whether a step folds, and its timeline's moments, but for their bytes: a
    # generation's new tokens are as many forwards (a search's short generations and its whole ones
    # each keep their own template)
    kind = (recipe.ctx.model_spec.name, spec.techniques, recipe.mode, recipe.ctx.world_size)
    kind += (replay is not None, recipe.mode == "generate" and recipe.ctx.shapes.new_tokens)
    why = why or UNFOLDED.get(kind, "")
    if layers >= depth.FOLD_FROM and not why:
        generating = recipe.mode == "generate"
        template = TEMPLATES.get(kind)
        folded = _folded_depth(
            spec, made, rounding, replay, layers, generating=generating, template=template
        )
        if not isinstance(folded, str):
            prediction, tracker, proven = folded
            if proven is template:
                prediction.depth = f"{layers} layers, folded from steps at {REFOLDED}"
            else:
                prediction.depth = f"{layers} layers, folded from steps at {FOLDED}"
            TEMPLATES[kind] = proven
            return prediction, tracker
        why = UNFOLDED[kind] = folded
    whole = _traced(spec, recipe, made, rounding, replay)
    if layers >= depth.FOLD_FROM:
        whole.prediction.depth = f"{layers} layers, traced whole: {why}"
    return whole.prediction, whole.tracker


def _folded_depth(
    spec: RunSpec,
    made: Callable[[], Recipe],
    rounding: int,
    replay: Replay | None,
    layers: int,
    generating: bool,
    template: depth.Template | None,
) -> tuple[Prediction, LiveBytes, depth.Template] | str:
    """The step at ``layers`` layers folded from its shallow steps, or why it cannot be: one that
    fails at a few layers (a technique with nothing to apply to there) is traced whole, where it
    may not fail. With the ``template`` of the same kind of step at another size, its steps at the
    first two depths are refolded by it, and where they do not follow it the third is traced."""
    shallow = []
    for d in depth.DEPTHS:
        try:
            shallow.append(_traced(spec, made(), made, rounding, replay, d))
        except Exception as exc:  # noqa: BLE001  the whole step says what it says
            return f"at {d} layers: {type(exc).__name__}: {first_line(exc)[:200]}"
        if template is not None and len(shallow) == 2:
            refolded = depth.refold(template, shallow, layers, generating)
            if not isinstance(refolded, str):
                return refolded
    ordered = template is not None and template.ordered
    return depth.fold(shallow, layers, generating, ordered)


@functools.cache
def _depth_of(spec: ModelSpec, shapes: Shapes) -> tuple[int, str]:
    """The model's stack of layers and why it cannot fold (depth.depth_of), its model built on the
    meta device once per process."""
    return depth.depth_of(_meta_model(spec, shapes))


def _traced(
    spec: RunSpec,
    recipe: Recipe,
    made: Callable[[], Recipe],
    rounding: int,
    replay: Replay | None,
    layers: int | None = None,
) -> depth.Shallow:
    """The step on fake tensors, its micro-batches folded where they repeat; at its first
    ``layers`` layers alone where given."""
    try:
        return _fake_step(spec, recipe, rounding, replay, fold=True, layers=layers)
    except NotRepeating:  # its micro-batches differ: every one of them is traced
        return _fake_step(spec, made(), rounding, replay, fold=False, layers=layers)
    except LeftBehind:  # a generation that keeps what it made: its warm-up runs before it
        return _fake_step(spec, made(), rounding, replay, fold=True, layers=layers, warm_up=True)


def replayed_through(
    prediction: Prediction, tracker: LiveBytes, replay: Replay | None
) -> Prediction:
    """The prediction with what the allocator reserves for the tracked step, where ``replay`` says
    how it is replayed."""
    if replay is not None:
        prediction |= replayed(tracker, replay)
    return prediction


def _fake_step(
    spec: RunSpec,
    recipe: Recipe,
    rounding: int,
    replay: Replay | None,
    fold: bool,
    layers: int | None = None,
    warm_up: bool = False,
) -> depth.Shallow:
    """The step on fake tensors after its warm-up step, as the worker runs them. A generation's
    warm-up is not run (unless ``warm_up``) but read off the measured one (``_warm_up``)."""
    ctx, techniques = recipe.ctx, recipe.techniques
    backend = next((b for t in techniques if (b := t.attention_backend())), None)
    # Pretrained weights (spec.weights) are not read: their values change no tensor's size.
    model = _meta_model(ctx.model_spec, ctx.shapes)
    if layers is not None:
        depth.truncate(model, layers)
    kernels = as_cuda(backend) if ctx.predicting else nullcontext()  # a CPU run keeps CPU's kernels
    # variable-length sequences, and the order of their pass, drawn with real values before fake
    # tensors take over
    feed = recipe.feed()
    if feed is not None:
        feed.epoch()
    generating = recipe.mode == "generate"
    untraced = _untraced_decodes(ctx) if fold and generating else 0
    marking = _mark_trackers if untraced else None  # where generate()'s passes repeat
    if generating:
        generated = generation_as_real(ctx.shapes.new_tokens - untraced, marking)
    else:
        generated = nullcontext()
    faking = FakeTensorMode(allow_non_fake_inputs=True)
    with (
        faking,
        ScalarsRead(faking, OutputsAsReal(ctx.predicting)),
        parameters_as_real(),
        masks_as_real(),
        techniques_as_real(techniques, cuda=ctx.predicting),
        generated,
        kernels,
    ):
        model = _fake_copy(model)
        runner = recipe.stepper(model)
        if isinstance(runner, Generator):
            phases = runner
        else:
            phases = None
        ranks.fake_ddp(runner.model)
        compiled_update = any(t.compiled_update for t in techniques)
        if compiled_update:
            runner.optimizer.step = compiled_as_eager(runner.optimizer.step)
        batch = recipe.batch()
        first = lambda: runner.step(next(batches(batch, feed, 1)))  # noqa: E731
        # the measured steps: on variable-length data, the timed pass's, or every one of an epoch
        if feed is not None and ctx.shapes.epoch:
            steps = len(feed.epoch())
        else:
            steps = ctx.shapes.measure_steps
        if untraced:
            more = untraced
        elif fold:
            more = _folded(runner, feed, ctx.world_size)
        else:
            more = 0
        # a shallow step's micro-batches are repeated once it is folded to full depth
        repeats = 0 if layers is not None else more

        def traced(step: Callable[[], object], history: LiveBytes | None = None) -> Tracked:
            return track(
                step,
                runner.model,
                optimizer=runner.optimizer,
                device=CPU,
                rounding=rounding,
                compiled_update=compiled_update,
                history=history,
                phases=phases,
                kernels=KERNELS if ctx.predicting else None,
            )

        derived = generating and not warm_up
        if replay is not None and not derived:
            # the first step, as the allocator sees it: where optimizer state first lands
            history = traced(first)
            if not history.tracker.repeat(repeats, growing=generating):
                raise NotRepeating
            replay = dataclasses.replace(replay, history=history.tracker)
        elif not derived:  # the worker's warm-up: optimizer state exists before the measured step
            first()
        if ctx.predicting:  # the counters that first step made
            for t in host_state(runner.optimizer):
                on_host(t)
        # the batches, as in the worker; the counts are the measured steps', their batches' copies
        # aside
        counter = StepCounter(counting=False)
        step = tracked_steps(
            runner,
            batch,
            feed,
            steps,
            counted=lambda: _counting(counter),
            ended=_mark_trackers if ctx.shapes.epoch else None,
        )
        # the measured step's collectives, not the set-up's or warm-up's; the counter beneath the
        # tracker, which steps aside alone for an update its package compiles
        traffic = ranks.Traffic(ctx.world_size)
        with traffic if ctx.world_size > 1 else nullcontext(), counter:
            done = traced(step, history=replay and replay.history)
    if untraced:
        runner.cache_bytes = _grown_cache(runner, untraced)
    if not done.tracker.repeat(repeats, growing=generating):
        raise NotRepeating
    if derived:
        history = _warm_up(done.tracker, batch)
        if replay is not None:
            replay = dataclasses.replace(replay, history=history)
    # the tracker's figures are the prediction's, by name (record.TRACKED)
    prediction = Prediction(**tracked_memory(done, runner.model, runner.optimizer, phases).flat())
    if ctx.world_size > 1:
        prediction |= traffic.figures() | Prediction(world_size=ctx.world_size, rank=ctx.rank)
    if paged := sum(t.nbytes for t in optimizer_state(runner.optimizer) if is_unified(t)):
        prediction.paged_bytes = paged
    counted = counter.totals()
    if untraced:
        counted = _grown_counts(counted, counter.marked, untraced)
    elif more:  # the micro-batches not traced count what the last one did
        counted = [c + more * (b - a) for c, a, b in zip(counted, *counter.marked[-2:])]
    if feed is None:
        steps = 1
    counted = [c // steps for c in counted]  # a varlen step: their mean
    prediction.flops_per_step, prediction.ops_per_step, prediction.op_bytes_per_step = counted
    before = replay and replay.history
    return depth.Shallow(
        prediction=prediction,
        tracker=done.tracker,
        history=before,
        repeats=more - repeats,
        growing=generating,
    )


class LeftBehind(Exception):
    """A generation left alive a storage it made (a static cache kept on the model): the one after
    it starts from more, so its warm-up must run (``_warm_up``)."""


def _warm_up(tracker: LiveBytes, batch: Any) -> LiveBytes:
    """The warm-up generation the worker runs before the measured one, as the allocator sees it,
    its tracker following it (``LiveBytes.preceded_by_itself``). Where the measured generation
    leaves alive nothing it made, the warm-up started from what it started from, and being the same
    program on the same tensors it made the same storages in the same order: the measured one's,
    but that the measured step's first storages, its copy of the batch, stand for the batch itself,
    which the worker makes before the warm-up and keeps past it. A generation is a forward per
    token, so this halves what predicting one costs. LeftBehind where it leaves something, or its
    first storages are not the batch's copy."""
    made = tracker.made_in_step()
    if tracker.outlived(made):
        raise LeftBehind
    copies = [t.untyped_storage().nbytes() for t in pytree.tree_leaves(batch) if torch.is_tensor(t)]
    first = made[: len(copies)]
    if tracker.raw_bytes(first) != copies:
        raise LeftBehind
    return tracker.preceded_by_itself(kept=set(first))


TRACED_MICRO_BATCHES = 4  # of a step's, where it has more: two to settle, two to show they repeat


def _folded(runner: Any, feed: Any, world_size: int) -> int:
    """How many of a training step's micro-batches a prediction leaves untraced (the runner then
    runs TRACED_MICRO_BATCHES and marks the tracker after each): every one after the first makes
    the tensors the one before made, adds its gradients into those the first made and frees what it
    made, so the last traced one stands for the rest (``LiveBytes.repeat`` proves it, or the step is
    traced whole). Not on variable-length data, whose micro-batches each have their own lengths, nor
    over ranks, whose collectives run each micro-batch."""
    if not isinstance(runner, Trainer) or feed is not None or world_size > 1:
        return 0
    if runner.micro_batches <= TRACED_MICRO_BATCHES:
        return 0
    runner.runs = TRACED_MICRO_BATCHES
    runner.marking = _mark_trackers
    return runner.micro_batches - TRACED_MICRO_BATCHES


TRACED_DECODES = 4  # of a generation's decode forwards, where it has more: one to settle, three to
# show how they grow
# the cache layers whose every decode forward does what the one before did, a token longer
# (transformers' cache_utils: fp8's scale is frozen after the first update, each token appended as
# it comes); a sliding window's stops growing once full, and quanto's and HQQ's quantize their
# residual every so many tokens
GROWING_CACHES = frozenset({"DynamicLayer", "StaticLayer", "Fp8QuantizedLayer"})


def _untraced_decodes(ctx: RunContext) -> int:
    """How many of a generation's decode forwards a prediction leaves untraced: generate() runs
    its loop past the prefill's pass for TRACED_DECODES forwards and stops, the cache sized for
    every new token (a static one) as generate() sizes it, and the tracker marked as each pass
    begins. Each pass after the first few makes what the one before made, a token longer where it
    holds one per token, so the last ones traced stand for the rest (``LiveBytes.repeat``, growing,
    proves it, or the generation is traced whole); what follows the loop makes nothing. Not over
    ranks, whose collectives run each forward."""
    decodes = ctx.shapes.new_tokens - 1
    if ctx.world_size > 1 or decodes <= TRACED_DECODES:
        return 0
    return decodes - TRACED_DECODES


def _grown_cache(runner: Generator, untraced: int) -> int:
    """The cache's bytes at their largest over the whole generation, its untraced forwards grown
    by what each of the last traced ones added; NotRepeating where they did not add the same, or
    the cache is not one whose forwards all do (GROWING_CACHES)."""
    held = runner.cache_held[-3:]
    if not runner.cache_layers <= GROWING_CACHES or len(held) < 3:
        raise NotRepeating
    if held[2] - held[1] != held[1] - held[0]:
        raise NotRepeating
    return max(runner.cache_bytes, held[2] + untraced * (held[2] - held[1]))


def _grown_counts(counted: list[int], counts: list[list[int]], untraced: int) -> list[int]:
    """A generation's FLOPs, operators and bytes with its untraced decode forwards: the passes of
    generate()'s loop between the last marks (``counts``) grow by the same amount each, and each
    untraced one counts one more such amount than the one before. NotRepeating where they do not
    grow evenly."""
    parts = [[b - a for a, b in zip(x, y)] for x, y in zip(counts[-4:-1], counts[-3:])]
    if len(parts) < 3:
        raise NotRepeating
    steps = [c - b for b, c in zip(parts[1], parts[2])]
    if steps != [b - a for a, b in zip(parts[0], parts[1])]:
        raise NotRepeating
    m = untraced
    return [c + m * last + d * m * (m + 1) // 2 for c, last, d in zip(counted, parts[2], steps)]


def _mark_trackers() -> None:
    """Each live-bytes tracker and step counter counting now marks the end of a repeated part (a
    micro-batch, a pass of generate()'s loop)."""
    mark_trackers()
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, StepCounter):
            mode.mark()


def _keys_per_query_head(formula: Callable[..., int], query_at: int) -> Callable[..., int]:
    """``formula`` given shapes whose key and value (after the query, at ``query_at``) have the
    query's heads."""

    def count(*shapes: Any, out_shape: Any = None, **kwargs: Any) -> int:
        q, k, v = shapes[query_at : query_at + 3]
        k, v = ((*s[:1], q[1], *s[2:]) for s in (k, v))
        return formula(
            *shapes[:query_at], q, k, v, *shapes[query_at + 3 :], out_val=out_shape, **kwargs
        )

    return count


# torch's formulas, and flash attention over grouped keys (fewer key and value heads than query
# heads, as Llama's) counted as the kernel runs it, each key and value head serving its group of
# query heads: torch 2.11's formulas (the CUDA host's) refuse those shapes, which would leave such a
# model unpredicted.
FLOP_FORMULAS: dict[torch._ops.OpOverloadPacket, Callable[..., int]] = {
    **flop_registry,
    aten._int_mm: flop_registry[aten.mm],  # an int8 product (bitsandbytes' 8-bit matmul on CUDA)
    **{
        op: shape_wrapper(_keys_per_query_head(flop_registry[op], at))
        for op, at in (
            (aten._scaled_dot_product_flash_attention, 0),
            (aten._scaled_dot_product_flash_attention_backward, 1),
        )
    },
}


@contextmanager
def _counting(counter: StepCounter) -> Iterator[None]:
    """``counter`` counting a step (a folded one's totals taken at each mark)."""
    counter.counting = True
    try:
        yield
    finally:
        counter.counting = False


class StepCounter(TorchDispatchMode):
    """A step's FLOPs by torch's formulas (``FLOP_FORMULAS``), its operators, views aside (they
    launch nothing), and the bytes of the tensors they take and make: each operator is a kernel
    launch with a fixed cost, and its bytes cross device memory, which is what makes pointwise work
    (normalisation, activations, recomputing them) and tiny steps slower than their FLOPs say.

    Unlike torch's ``FlopCounterMode`` it runs each operator as it comes: that one decomposes those
    with a Python decomposition (batch norm's, SiLU's backward) into the operators they are made of,
    which saves other tensors for backward, and tracks modules with hooks that keep recomputed
    activations alive, so that a step it counts is not the step the worker measures. None of those
    decompositions holds a matrix product, so the FLOPs are the same."""

    def __init__(self, counting: bool = True) -> None:
        super().__init__()
        self.flops = self.ops = self.bytes = 0
        self.counting = counting  # off: what runs under it is not counted (a batch's copy)
        self.marked: list[list[int]] = []  # the totals at each mark of the step counted

    def mark(self) -> None:
        """The end of a repeated part of the step (``_mark_trackers``): the totals so far."""
        if self.counting:
            self.marked.append(self.totals())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.counting:
            return out
        if formula := FLOP_FORMULAS.get(func._overloadpacket):
            self.flops += formula(*args, **kwargs, out_val=out)
        if not func.is_view:
            self.ops += 1
            self.bytes += sum(
                t.nbytes
                for t in pytree.tree_leaves((args, kwargs, out))
                if isinstance(t, torch.Tensor)
            )
        return out

    def totals(self) -> list[int]:
        return [self.flops, self.ops, self.bytes]


def _meta_model(spec: ModelSpec, shapes: Shapes) -> nn.Module:
    """The model built on the meta device: no initialisation work, and none of the init ops fake
    tensors refuse. A model that computes its own shape from tensor values while it is built
    (torchvision's RegNet calls .tolist() on its block widths) is built on the CPU instead, each
    parameter and buffer moved to the meta device as it is registered, so that no more than one of
    them is ever held in memory."""
    try:
        with torch.device("meta"):
            return spec.build(shapes)
    except NotImplementedError:  # "Cannot copy out of meta tensor"
        with _registered_on_meta():
            return spec.build(shapes)


@contextmanager
def _registered_on_meta() -> Iterator[None]:
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), param.requires_grad)
        register_parameter(module, name, param)

    def buffer(
        module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> None:
        register_buffer(module, name, None if tensor is None else tensor.to("meta"), persistent)

    nn.Module.register_parameter, nn.Module.register_buffer = parameter, buffer
    try:
        yield
    finally:
        nn.Module.register_parameter = register_parameter
        nn.Module.register_buffer = register_buffer


def _fake_copy(model: nn.Module) -> nn.Module:
    """The meta model's parameters and buffers replaced by (fake) CPU tensors of the same shapes and
    dtypes; shared parameters stay shared. Called inside the fake mode."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(
                        torch.empty(p.shape, dtype=p.dtype, device=CPU), p.requires_grad
                    )
                module._parameters[name] = made[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=CPU)
    return model
